"""Tensor / expert parallelism on ``torch.distributed`` (see docs/parallelism.md)."""
