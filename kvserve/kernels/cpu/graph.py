"""Recorded CPU decode graphs: a forward's C kernel calls recorded once as a tape, replayed by
one C call (``kvserve/csrc/graph.c``) -- what a CUDA graph is on the GPU, for the kernels of
``kernels/cpu``.

Every binding calls its kernel through :func:`launch`. While a :func:`recording` is active,
``launch`` also appends the call to the tape: the kernel's ``<name>_op`` adapter (kvs_op.h) and
its arguments as int64 (tensors as their data pointers, kept alive by the tape; floats as double
bits). One argument per call may be marked :class:`Rows` -- the batch row count -- and a replay
sets it to the live batch's rows; the bindings mark it only where every buffer of the call is
laid out rows-first, so a replay over n rows touches the ``[:n]`` prefixes of the recorded
buffers.

A recording is refused (:class:`GraphCaptureError`), never silently wrong, when the forward
does anything a replay would not repeat:
  - a kernel without an ``_op`` adapter is launched;
  - a torch op that computes (anything but views and ``torch.empty``) runs: a dispatch mode
    watches every aten op during the recording.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import struct
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.kernels.cpu import INT64, PTR, load_library


class GraphCaptureError(RuntimeError):
    """The forward being recorded cannot be replayed from a tape (the message says why)."""


class Rows(int):
    """A kernel argument that is the batch's row count (replays substitute the live count)."""


_TAPE: contextvars.ContextVar[Tape | None] = contextvars.ContextVar("kvserve_cpu_tape",
                                                                     default=None)


def _raw(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    return int(a) if isinstance(a, Rows) else a


def launch(lib: ctypes.CDLL, entry: str, *args: Any) -> Any:
    """Call ``lib.<entry>`` (tensors passed as their data pointers); while recording, also
    append the call to the active tape."""
    tape = _TAPE.get()
    if tape is not None:
        tape.record(lib, entry, args)
    return getattr(lib, entry)(*[_raw(a) for a in args])


@functools.cache
def _graph_library() -> ctypes.CDLL | None:
    return load_library("graph", {"kvs_graph_run": ([PTR, PTR, PTR, PTR, INT64, INT64],
                                                    INT64)})


def available() -> bool:
    return _graph_library() is not None


def _encode(a: Any) -> int:
    if a is None:
        return 0
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    if isinstance(a, float):
        return struct.unpack("<q", struct.pack("<d", a))[0]
    if isinstance(a, (bool, int)):
        return int(a)
    raise GraphCaptureError(f"cannot record a kernel argument of type {type(a).__name__}")


class Tape:
    """The recorded calls of one forward; ``replay(rows)`` runs them again over ``rows``
    batch rows (at most the rows they were recorded with)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._fns: list[int] = []
        self._args: list[int] = []
        self._offsets: list[int] = []
        self._rows_at: list[int] = []
        self._keep: list[torch.Tensor] = []  # every buffer the recorded pointers point into
        self.max_rows: int | None = None
        self.alloc_bytes = 0  # buffers allocated while recording (kept for the replays)
        self._packed: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def record(self, lib: ctypes.CDLL, entry: str, args: tuple[Any, ...]) -> None:
        try:
            adapter = getattr(lib, entry + "_op")
        except AttributeError:
            raise GraphCaptureError(f"kernel {entry} has no graph adapter") from None
        rows_at = -1
        for i, a in enumerate(args):
            if isinstance(a, Rows):
                if rows_at >= 0:
                    raise GraphCaptureError(f"{entry}: two row-count arguments")
                rows_at = i
                if self.max_rows is None:
                    self.max_rows = int(a)
                elif int(a) != self.max_rows:
                    raise GraphCaptureError(
                        f"{entry}: {int(a)} rows in a forward recorded at {self.max_rows}")
            elif isinstance(a, torch.Tensor):
                self._keep.append(a)
        self.names.append(entry)
        self._fns.append(ctypes.cast(adapter, ctypes.c_void_p).value or 0)
        self._offsets.append(len(self._args))
        self._rows_at.append(rows_at)
        self._args.extend(_encode(a) for a in args)
        self._packed = None

    def only(self, names: set[str]) -> Tape:
        """A tape of this one's calls to the kernels in ``names``, in order (same arguments and
        buffers) -- for timing where a replay's time goes. Replaying it runs those kernels on
        whatever the buffers hold: it can overwrite state (a KV write of stale activations),
        so only a benchmark that is done with the model's results uses it."""
        sub = Tape()
        sub._keep, sub.max_rows = self._keep, self.max_rows
        for i, name in enumerate(self.names):
            if name in names:
                end = self._offsets[i + 1] if i + 1 < len(self.names) else len(self._args)
                sub.names.append(name)
                sub._fns.append(self._fns[i])
                sub._offsets.append(len(sub._args))
                sub._rows_at.append(self._rows_at[i])
                sub._args.extend(self._args[self._offsets[i]:end])
        return sub

    def replay(self, rows: int) -> None:
        lib = _graph_library()
        assert lib is not None and self.max_rows is not None
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, {self.max_rows}], got {rows}")
        if self._packed is None:
            i64 = torch.int64
            self._packed = (torch.tensor(self._fns, dtype=i64),
                            torch.tensor(self._args, dtype=i64),
                            torch.tensor(self._offsets, dtype=i64),
                            torch.tensor(self._rows_at, dtype=i64))
        fns, args, offsets, rows_at = self._packed
        failed = lib.kvs_graph_run(fns.data_ptr(), args.data_ptr(), offsets.data_ptr(),
                                   rows_at.data_ptr(), len(self.names), rows)
        if failed:
            raise RuntimeError(f"graph op {failed - 1} ({self.names[failed - 1]}) failed "
                               "(no scratch memory, or a token id out of range)")


# aten ops a recorded forward may run: they allocate or make views, and compute nothing
_ALLOWED = frozenset({
    "empty.memory_format", "empty_like.default", "empty_strided.default",
    "view.default", "_unsafe_view.default", "reshape.default", "alias.default",
    "detach.default", "as_strided.default", "expand.default", "t.default",
    "transpose.int", "permute.default", "unsqueeze.default", "squeeze.dim",
    "squeeze.default", "select.int", "slice.Tensor", "split.Tensor",
    "split_with_sizes.default", "unbind.int", "narrow.default",
})


# conversions that are no-ops when nothing changes (x.to(x.dtype), x.contiguous())
_NOOP_UNLESS_COPY = frozenset({"to", "contiguous"})


class _ComputeGuard(TorchDispatchMode):
    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if name in _ALLOWED:
            out = func(*args, **(kwargs or {}))
            if name.startswith("empty"):
                self.tape.alloc_bytes += out.untyped_storage().nbytes()
            return out
        if name.split(".")[0] in _NOOP_UNLESS_COPY:  # allowed where it returns its input
            out = func(*args, **(kwargs or {}))
            if out is args[0]:
                return out
        raise GraphCaptureError(f"torch op {func} computes outside the recorded kernels")


@contextlib.contextmanager
def recording() -> Iterator[Tape]:
    """Record the kernel calls made in this block (they also run) into a new Tape."""
    if not available():
        raise GraphCaptureError("the graph replay library did not build")
    tape = Tape()
    token = _TAPE.set(tape)
    try:
        with _ComputeGuard(tape):
            yield tape
    finally:
        _TAPE.reset(token)
