"""Peer runners: standalone scripts run in the peer's own interpreter (``--peer-python``),
never imported by kvserve. Each reads a JSON payload on stdin and prints one JSON object as
its last stdout line (``kvserve.bench.common.run_peer_script``); they import nothing from
kvserve, so a peer's environment needs only the peer."""

from __future__ import annotations

import os

PEERS_DIR = os.path.dirname(os.path.abspath(__file__))


def script_path(name: str) -> str:
    """The file of peer runner ``name`` (e.g. ``"vllm_latency"``)."""
    path = os.path.join(PEERS_DIR, f"{name}.py")
    if not os.path.isfile(path):
        raise ValueError(f"no peer runner {name!r} in {PEERS_DIR}")
    return path
