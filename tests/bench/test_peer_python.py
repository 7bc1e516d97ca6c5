"""Where the bench finds a peer's interpreter (kvserve.bench.peers.peer_python): --peer-python,
then KVSERVE_<PEER>_PYTHON, then the venv scripts/setup_peers.sh builds under
KVSERVE_PEERS_DIR."""

from __future__ import annotations

import os

import pytest

from kvserve.bench.peers import PEER_PYTHON_ENV, peer_python, peer_venvs_dir


@pytest.fixture
def peers_dir(tmp_path, monkeypatch):
    for var in PEER_PYTHON_ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVSERVE_PEERS_DIR", str(tmp_path))
    return tmp_path


def _venv(root, name: str) -> str:
    path = root / name / "bin" / "python"
    path.parent.mkdir(parents=True)
    path.write_text("")
    return str(path)


def test_nothing_given_or_installed_is_none(peers_dir):
    assert peer_venvs_dir() == str(peers_dir)
    assert peer_python("llamacpp") is None and peer_python("vllm") is None


def test_setup_peers_venv_is_found(peers_dir):
    lc = _venv(peers_dir, "llamacpp")
    assert peer_python("llamacpp") == lc
    assert peer_python("vllm") is None  # only the peer whose venv exists


def test_environment_variable_beats_the_venv(peers_dir, monkeypatch):
    _venv(peers_dir, "vllm")
    monkeypatch.setenv("KVSERVE_VLLM_PYTHON", "/opt/v/bin/python")
    assert peer_python("vllm") == "/opt/v/bin/python"


def test_peer_python_flag_beats_everything(peers_dir, monkeypatch):
    _venv(peers_dir, "llamacpp")
    monkeypatch.setenv("KVSERVE_LLAMACPP_PYTHON", "/env/bin/python")
    # one path: every peer's
    assert peer_python("llamacpp", "/one/bin/python") == "/one/bin/python"
    assert peer_python("vllm", "/one/bin/python") == "/one/bin/python"
    # pairs: the named peer's; a peer left out falls back to its variable, then its venv
    pairs = "vllm=/v/bin/python,llamacpp=/l/bin/python"
    assert peer_python("llamacpp", pairs) == "/l/bin/python"
    assert peer_python("llamacpp", "vllm=/v/bin/python") == "/env/bin/python"
    monkeypatch.delenv("KVSERVE_LLAMACPP_PYTHON")
    assert peer_python("llamacpp", "vllm=/v/bin/python") == os.path.join(
        str(peers_dir), "llamacpp", "bin", "python")


def test_default_folder_and_unknown_peer(monkeypatch):
    monkeypatch.delenv("KVSERVE_PEERS_DIR", raising=False)
    assert peer_venvs_dir() == os.path.expanduser("~/.cache/kvserve/peers")
    with pytest.raises(ValueError, match="peer"):
        peer_python("hf")
