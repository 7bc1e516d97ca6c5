"""The server binds its port before anything else: a port in use fails at once and clearly,
``--port 0`` lets the system pick one, and nothing started later can take it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvserve.http.launch import bound_port, listen_socket


def test_listen_socket_binds_and_names_the_port():
    with listen_socket("127.0.0.1", 0) as sock:
        port = bound_port(sock)
        assert port > 0
        with pytest.raises(ValueError, match=f"port: cannot listen on 127.0.0.1:{port}"):
            listen_socket("127.0.0.1", port)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held until closed
    with pytest.raises(ValueError, match="port must be in"):
        listen_socket("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="host"):
        listen_socket("no-such-host.invalid", 0)


def test_serve_on_a_taken_port_fails_before_loading_the_model():
    with listen_socket("127.0.0.1", 0) as sock:
        port = bound_port(sock)
        r = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "demo",
                            "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"port: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "KV cache" not in r.stderr, r.stderr  # failed before building the engine
