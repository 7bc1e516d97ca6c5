"""ctypes bindings of the C kernels in ``kvserve/csrc``, one module per library: each builds
its library on first use (``kvserve.cbuild``), declares the argument types once, and wraps
every entry point in a function taking tensors. Nothing else in kvserve loads a library."""

from __future__ import annotations

import ctypes
from typing import Any

from kvserve.cbuild import build_library

# ctypes shorthands for the signatures below and in the binding modules
PTR, INT, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float

# entry point -> (argtypes, restype)
Signatures = dict[str, tuple[list[Any], Any]]


def declare(dll: ctypes.CDLL, signatures: Signatures) -> ctypes.CDLL:
    """Declare each entry point's (argtypes, restype) on a loaded library (tests bind their
    own builds, e.g. without AVX2, through this too)."""
    for fn, (argtypes, restype) in signatures.items():
        entry = getattr(dll, fn)
        entry.argtypes, entry.restype = argtypes, restype
    return dll


def load_library(name: str, signatures: Signatures) -> ctypes.CDLL | None:
    """Build (first use) and load ``kvserve/csrc/<name>.c``, declaring its entry points; None
    when no C compiler is available or the kernels are turned off."""
    dll = build_library(name)
    return None if dll is None else declare(dll, signatures)
