"""What the typed executor messages cost per decode step, in-process (no ranks): encoding a
``Step`` on the driver plus checking and decoding it on a worker, against the integer-kind
protocol they replaced (a [kind, length] header tensor, ``StepInput.to_tensor`` /
``from_tensor``), for decode batches of B sequences; and the same for a ``Seal`` of n blocks.
JSON out. The end-to-end check is ``benchmarks/tp_decode.py --tps 2`` on both trees.

    PYTHONPATH=. python benchmarks/executor_messages.py --batches 1,16,64 --json out.json

Both paths build the same tensors the wire carries; the broadcasts themselves (two per step
either way) are not timed here. Median of ``--repeats`` windows of ``--iters`` messages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _decode_step(b: int, blocks_per_seq: int = 8):
    import torch

    from kvserve.engine.step_input import StepInput

    ids = torch.arange(b, dtype=torch.int64)
    return StepInput(ids, ids + 100, ids * 16 + 3, (1,) * b, (101,) * b,
                     tuple(tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                           for i in range(b)), (tuple(range(b)),))


def _old_step(step):
    """The integer-kind protocol: header [STEP, n], then the flat payload; the receiver reads
    the kind and rebuilds the StepInput."""
    import torch

    from kvserve.engine.step_input import StepInput

    payload = step.to_tensor()
    head = torch.tensor([1, payload.numel()], dtype=torch.int64)
    kind, _ = int(head[0]), int(head[1])
    assert kind == 1
    return StepInput.from_tensor(payload.to(torch.int64).contiguous())


def _new_step(step):
    from kvserve.engine import executor_messages as em

    f = em.encode_message(em.Step(step))
    em.frame_sizes(f.header)
    return em.decode_message(f.header, f.spill, f.body).step


def _old_seal(ids, gens, hashes):
    import numpy as np
    import torch

    x = torch.cat([torch.tensor([len(ids), *ids, *gens]),
                   torch.from_numpy(np.frombuffer(b"".join(hashes), dtype=np.int64).copy())])
    head = torch.tensor([2, x.numel()], dtype=torch.int64)
    n = int(x[0]) + 0 * int(head[0])
    raw = x[1 + 2 * n:].numpy().tobytes()
    return x[1: 1 + n].tolist(), x[1 + n: 1 + 2 * n].tolist(), \
        [raw[i: i + 16] for i in range(0, len(raw), 16)]


def _new_seal(ids, gens, hashes):
    from kvserve.engine import executor_messages as em

    f = em.encode_message(em.Seal(tuple(ids), tuple(gens), tuple(hashes)))
    em.frame_sizes(f.header)
    m = em.decode_message(f.header, f.spill, f.body)
    return list(m.block_ids), list(m.generations), list(m.token_hashes)


def _time(fn, args, iters: int, repeats: int) -> float:
    """Median microseconds per call."""
    fn(*args)
    windows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        windows.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(windows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--seal-blocks", default="1,8,64")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch

    from kvserve.bench.common import env_info

    torch.set_num_threads(1)
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        step = _decode_step(b)
        assert torch.equal(_new_step(step).input_ids, _old_step(step).input_ids)
        old, new = (_time(fn, (step,), a.iters, a.repeats) for fn in (_old_step, _new_step))
        rows.append({"message": "step", "batch": b, "old_us": old, "new_us": new})
    for n in (int(x) for x in a.seal_blocks.split(",")):
        args = (list(range(n)), [1] * n, [bytes([i % 256]) * 16 for i in range(n)])
        assert _new_seal(*args) == _old_seal(*args)
        old, new = (_time(fn, args, a.iters, a.repeats) for fn in (_old_seal, _new_seal))
        rows.append({"message": "seal", "blocks": n, "old_us": old, "new_us": new})
    for r in rows:
        size = f"batch {r['batch']}" if "batch" in r else f"{r['blocks']} blocks"
        print(f"{r['message']:5s} {size:10s} integer kinds {r['old_us']:7.1f} us   typed "
              f"{r['new_us']:7.1f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "iters": a.iters, "repeats": a.repeats, "env": env_info()},
                      f, indent=2)


if __name__ == "__main__":
    main()
