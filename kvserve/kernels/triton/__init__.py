"""Triton kernels (imported lazily: nothing on the CPU path imports triton). Each module's twin
is in ``kvserve.kernels.reference``:

    attention.py  paged decode (split-K) / prefill attention, MLA decode
    cache.py      the fused KV write (copy / FP8 / INT8 quantize, checksum state)
    int4.py       the W4A16 GEMM

This package's ``__init__`` itself never imports triton."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: the kernels run on CPU tensors through triton's
    interpreter (tests), with fp32 dots (it mishandles bf16 ``tl.dot``) and small tiles.
    The one place kvserve reads that variable."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
