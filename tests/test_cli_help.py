"""``kvserve ... --help`` is fast (no torch before argparse has parsed), every flag has help
that shows its default, choices are listed (issue 15, item 7)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

import kvserve.cli

COMMANDS = [[], ["serve"], ["generate"], ["bench"], ["bench", "throughput"],
            ["bench", "integrity"], ["bench", "latency"], ["bench", "quality"],
            ["bench", "serve"], ["quantize"]]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "httpx", "numpy")


def _run_help(args: list[str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", *args, "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return time.perf_counter() - t0, out


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "kvserve")
def test_help_prints_usage(args):
    """Every command's --help runs in a fresh interpreter and prints its usage. How fast is not
    asserted here (timings live in benchmarks; on a loaded host it is noise): what keeps help
    fast -- importing nothing heavy -- is the next test."""
    elapsed, out = _run_help(args)
    print(f"\nkvserve {' '.join(args)} --help: {elapsed * 1000:.0f} ms")
    assert out.startswith("usage: kvserve")


def test_python_dash_m_kvserve_is_the_cli():
    """``python -m kvserve`` runs the same command line as the console script."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "kvserve", "serve", "--help"], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("usage: kvserve serve")


def test_help_imports_nothing_heavy():
    code = ("import sys, contextlib, io\n"
            "from kvserve.cli import main\n"
            f"for args in {COMMANDS!r}:\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        main([*args, '--help'])\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]", out


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Every parser ``kvserve`` builds, by command path."""
    captured = []

    def capture(self, args=None, namespace=None):
        captured.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        kvserve.cli.main(["generate"])
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(f"{name} {sub}".strip(), child)

    walk("", captured[0])
    return found


def test_every_flag_has_help_and_shows_its_default(monkeypatch):
    parsers = _parsers(monkeypatch)
    assert {"serve", "generate", "bench", "bench serve", "quantize"} <= set(parsers)
    for name, parser in parsers.items():
        if name == "bench serve":  # a pass-through: its own parser is checked below
            continue
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = f"kvserve {name} {action.option_strings[-1]}"
            assert action.help, f"{flag} has no help"
            text = formatter._get_help_string(action)
            if not (action.default is None or action.default is False):
                assert "default" in text, f"{flag} does not show its default"


def test_choices_and_subcommands_are_listed():
    _, serve = _run_help(["serve"])
    assert "--attention-backend {auto,cpu,torch,triton,mla_torch,mla_triton}" in serve
    assert "(default: 8000)" in serve and "(default: 64)" in serve
    assert "--no-access-log" in serve and "--tokenizer-workers" in serve
    _, bench = _run_help(["bench"])
    assert "{throughput,integrity,latency,quality,serve}" in bench
    assert "HTTP load generator" in bench
    _, bench_serve = _run_help(["bench", "serve"])
    for flag in ("--url", "--concurrency", "--requests", "--max-tokens", "--api-key"):
        assert flag in bench_serve
    assert "(default: http://127.0.0.1:8000)" in bench_serve
