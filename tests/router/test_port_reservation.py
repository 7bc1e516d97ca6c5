"""``PortReservation``: the port a router (or a test) picks for a child server stays its own
until the child listens on it, with no window in which another bind can take it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvserve.http.launch import listen_socket
from kvserve.router.launch import PortReservation


def test_port_zero_binds_never_take_a_reserved_port():
    res = PortReservation()
    try:
        for reuse in (False, True):  # plain sockets and SO_REUSEADDR ones (gloo, ZMQ)
            held = []
            try:
                for _ in range(3000):
                    s = socket.socket()
                    if reuse:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", 0))
                    held.append(s)
                    assert s.getsockname()[1] != res.port
            finally:
                for s in held:
                    s.close()
        # an explicit bind without SO_REUSEADDR is refused too
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", res.port))
    finally:
        res.close()


def test_the_child_listens_on_it_and_connections_are_refused_when_it_is_gone():
    res = PortReservation()
    try:
        with socket.socket() as c:  # nobody listening yet: refused, not queued
            assert c.connect_ex(("127.0.0.1", res.port)) != 0
        # another process (the replica) binds and listens on it, as `kvserve serve` does
        child = subprocess.run(
            [sys.executable, "-c",
             "import sys; from kvserve.http.launch import listen_socket, bound_port; "
             f"s = listen_socket('127.0.0.1', {res.port}); print(bound_port(s))"],
            capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert int(child.stdout) == res.port
        with socket.socket() as c:  # the child is gone: refused again (a dead replica)
            assert c.connect_ex(("127.0.0.1", res.port)) != 0
        srv = listen_socket("127.0.0.1", res.port)  # and a restart binds it again
        try:
            with socket.create_connection(("127.0.0.1", res.port), timeout=5):
                pass
        finally:
            srv.close()
    finally:
        res.close()
