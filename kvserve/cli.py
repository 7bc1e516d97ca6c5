"""``kvserve`` command line: generate, serve, bench, quantize."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvserve.cli_help import HelpParser


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    from kvserve.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(p, model_positional=model_positional)


def engine_args_from(ns: argparse.Namespace):
    from kvserve.engine.arg_utils import EngineArgs

    return EngineArgs.from_cli_args(ns)


def _run_headless_if_worker(ns: argparse.Namespace) -> int | None:
    """On a node other than 0, or a torchrun / srun rank other than 0: run this node's
    worker ranks (no scheduler, no server) and return their exit status; else None."""
    if getattr(ns, "tensor_parallel_size", 1) == 1 and getattr(ns, "nnodes", 1) == 1:
        return None
    from kvserve.engine.builder import settle
    from kvserve.engine.executor import local_ranks, run_headless

    args = engine_args_from(ns)
    is_driver, ranks = local_ranks(args)
    if is_driver:
        return None
    return run_headless(settle(args), ranks)


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

    for _name, module in (("serve", "kvserve.serve_cli"), ("router", "kvserve.router_cli"),
                         ("bench", "kvserve.bench.cli"), ("quantize", "kvserve.quantize_cli")):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)

    ns = parser.parse_args(args)
    ns.argv = list(args)  # serve --data-parallel-size passes it on to its replicas
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
