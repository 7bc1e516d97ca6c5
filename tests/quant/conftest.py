"""Quantization tests run on small tensors: one intra-op thread (a second one only adds sync
cost, and stalls on busy hosts). Tests that sweep thread counts set their own."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
