"""``RouterSettings``: every knob of the replica router, written once; ``kvserve.config_cli``
generates the ``kvserve router`` flags from the fields (and, without the replica fields, the
router flags of ``kvserve serve --data-parallel-size``).

Standard library only: ``kvserve --help`` builds its parsers from this class.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import ClassVar

from kvserve.config_cli import arg

POLICIES = ("auto", "session", "prefix", "least-loaded", "round-robin")
ROUTER = "router (docs/replicas.md)"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    REPLICA_FIELDS: ClassVar[tuple[str, ...]] = ("replicas", "prefill", "decode",
                                                 "replica_api_key", "tokenizer")

    replicas: tuple[str, ...] = arg(
        (), "a replica's base URL, e.g. http://10.0.0.2:8000 (repeatable)",
        flags=("--replica",), action="append", cli_default=None, metavar="URL",
        parse=tuple, group=ROUTER)
    # Prefill/decode disaggregation (docs/disaggregation.md): with prefill replicas, a request
    # runs its prompt on one of them and continues on a decode replica (--decode / --replica).
    prefill: tuple[str, ...] = arg(
        (), "a prefill replica's base URL (kvserve serve --role prefill; repeatable)",
        flags=("--prefill",), action="append", cli_default=None, metavar="URL",
        parse=tuple, group=ROUTER)
    decode: tuple[str, ...] = arg(
        (), "a decode replica's base URL (kvserve serve --role decode; repeatable; joins "
        "--replica)", flags=("--decode",), action="append", cli_default=None, metavar="URL",
        parse=tuple, group=ROUTER)
    replica_api_key: str | None = arg(
        None, "key the router sends to the replicas (default: $KVSERVE_REPLICA_API_KEY, else "
        "--api-key)", cli_default=lambda: os.environ.get("KVSERVE_REPLICA_API_KEY"),
        parse=lambda key: key or None, group=ROUTER)
    tokenizer: str | None = arg(
        None, "the replicas' model or tokenizer for prefix routing (HF folder, .gguf, 'demo'; "
        "default: the default model; 'none': no prefix routing)", group=ROUTER)
    routing: str = arg(
        "auto", "auto: x-session-affinity header -> consistent hash, else the replica holding "
        "the longest prompt prefix (KV events, routed prompts) weighed against load, else least "
        "loaded", choices=list(POLICIES), group=ROUTER)
    load_factor: float = arg(
        1.25, "bounded load: no replica takes a session or prefix route above this many times "
        "the mean load", type=float, group=ROUTER)
    prefix_load_cost: float = arg(
        64.0, "prefix routing: matched prompt tokens one request in flight on a replica is "
        "worth (score = matched tokens - cost x load)", type=float, group=ROUTER)
    routed_prefix_ttl: float = arg(
        60.0, "seconds a prompt routed to a replica counts as held there for prefix routing, "
        "before (or without) its KV events (0: KV events only)", type=float, group=ROUTER)
    health_interval: float = arg(0.5, "seconds between a replica's health checks",
                                 type=float, group=ROUTER)
    health_timeout: float = arg(1.0, "seconds a health check may take (a hung replica)",
                                type=float, group=ROUTER)
    fail_after: int = arg(2, "failed checks in a row that take a replica out of the pool",
                          type=int, group=ROUTER)
    max_attempts: int = arg(3, "replicas a request not yet started may be tried on", type=int,
                            group=ROUTER)
    connect_timeout: float = arg(2.0, "seconds to connect to a replica", type=float,
                                 group=ROUTER)
    session_header: str = arg("x-session-affinity", "request header naming the session",
                              group=ROUTER)

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, got {self.routing!r}")
        for name in ("replicas", "prefill", "decode"):
            if getattr(self, name) is None:  # the flag not given
                object.__setattr__(self, name, ())
            for url in getattr(self, name):
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {url!r} is not an http(s):// URL")
        if self.prefill and not (self.decode or self.replicas):
            raise ValueError("prefill replicas need decode replicas (--decode URL)")
        if not math.isfinite(self.load_factor) or self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if not self.prefix_load_cost >= 0:
            raise ValueError(f"prefix_load_cost must be >= 0, got {self.prefix_load_cost}")
        if not self.routed_prefix_ttl >= 0:
            raise ValueError(f"routed_prefix_ttl must be >= 0 seconds, got "
                             f"{self.routed_prefix_ttl}")
        for name in ("health_interval", "health_timeout", "connect_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be > 0 seconds, got {v}")
        if self.fail_after < 1:
            raise ValueError(f"fail_after must be >= 1, got {self.fail_after}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not self.session_header:
            raise ValueError("session_header must not be empty")

    @property
    def prefix_tokenizer(self) -> str | None:
        """What to load the router's tokenizer from (None: the default model)."""
        return self.tokenizer

    @property
    def uses_tokenizer(self) -> bool:
        return self.routing in ("auto", "prefix") and (self.tokenizer or "").lower() != "none"
