"""Peer runners: standalone scripts run in the peer's own interpreter (``--peer-python``),
never imported by kvserve. Each reads a JSON payload on stdin and prints one JSON object as
its last stdout line (``kvserve.bench.common.run_peer_script``); they import nothing from
kvserve, so a peer's environment needs only the peer.

Where a peer's interpreter is found (``peer_python``), first match wins:

1. ``--peer-python``: one interpreter for every peer, or ``name=PATH`` pairs split by commas
   (``llamacpp=/a/bin/python,vllm=/b/bin/python``);
2. the environment variable ``KVSERVE_LLAMACPP_PYTHON`` / ``KVSERVE_VLLM_PYTHON``;
3. ``$KVSERVE_PEERS_DIR/<name>/bin/python`` (default ``~/.cache/kvserve/peers``), the venvs
   ``scripts/setup_peers.sh`` builds, when that file exists.
"""

from __future__ import annotations

import os

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))
# the peers that run in an interpreter of their own, and the variable naming it
PEER_PYTHON_ENV = {"llamacpp": "KVSERVE_LLAMACPP_PYTHON", "vllm": "KVSERVE_VLLM_PYTHON"}
PEER_VENVS_ENV = "KVSERVE_PEERS_DIR"
DEFAULT_PEER_VENVS = os.path.join("~", ".cache", "kvserve", "peers")


def script_path(name: str) -> str:
    """The file of peer runner ``name`` (e.g. ``"vllm_latency"``)."""
    path = os.path.join(PEERS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise ValueError(f"no peer runner {name!r} in {PEERS_DIR}")
    return path


def peer_venvs_dir() -> str:
    """The folder holding one venv per peer (``scripts/setup_peers.sh`` writes it)."""
    return os.path.expanduser(os.environ.get(PEER_VENVS_ENV) or DEFAULT_PEER_VENVS)


def peer_python(name: str, given: str | None = None) -> str | None:
    """The interpreter of peer ``name`` (``llamacpp`` or ``vllm``), by the order in this
    module's docstring; None when none is given or installed."""
    if name not in PEER_PYTHON_ENV:
        raise ValueError(f"peer must be one of {', '.join(PEER_PYTHON_ENV)}, got {name!r}")
    if given and "=" not in given:
        return given
    if given:
        pairs = dict(part.split("=", 1) for part in given.split(",") if "=" in part)
        if pairs.get(name):
            return pairs[name]
    if os.environ.get(PEER_PYTHON_ENV[name]):
        return os.environ[PEER_PYTHON_ENV[name]]
    venv = os.path.join(peer_venvs_dir(), name, "bin", "python")
    return venv if os.path.isfile(venv) else None
