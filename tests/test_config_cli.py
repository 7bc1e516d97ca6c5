"""One generator for every settings dataclass's command line (``kvserve.config_cli``): the
engine's, the server's and the benchmarks' flags come from their fields, and read back into
the same dataclasses (issue 30, item 6)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvserve import serve_cli as server_cli
from kvserve.bench import cli as bench_cli
from kvserve.bench.serve_bench import ServeBenchConfig
from kvserve.bench.settings import LatencyConfig, ThroughputConfig
from kvserve.cli_help import HelpParser
from kvserve.config_cli import add_cli_args, arg, cli_values, from_cli_args, parse_list
from kvserve.engine.arg_utils import EngineArgs
from kvserve.server.settings import LaunchSettings, ServerSettings


@dataclasses.dataclass(frozen=True)
class _Knobs:
    size: int = arg(3, "a size", type=int)
    names: list[str] = arg(["a"], "names", cli_default="a", parse=lambda v: v.split(","))
    on: bool = arg(True, "turn it off (default: on)", flags=("--off",), action="store_false")
    hidden: int = arg(7, "", cli=False)


def test_generated_flags_read_back():
    p = argparse.ArgumentParser()
    add_cli_args(p, _Knobs)
    assert from_cli_args(_Knobs, p.parse_args([])) == _Knobs()
    k = from_cli_args(_Knobs, p.parse_args(["--size", "5", "--names", "x,y", "--off"]))
    assert k == _Knobs(size=5, names=["x", "y"], on=False)
    with pytest.raises(SystemExit):
        p.parse_args(["--hidden", "1"])  # cli=False: no flag
    # a field's list default is each instance's own
    assert _Knobs().names is not _Knobs().names


def test_overrides_and_skip():
    p = argparse.ArgumentParser()
    add_cli_args(p, _Knobs, skip=("names",), overrides={"size": {"default": 9}})
    ns = p.parse_args([])
    assert ns.size == 9 and not hasattr(ns, "names")
    assert cli_values(_Knobs, ns) == {"size": 9, "on": True}
    with pytest.raises(AssertionError, match="nope"):
        add_cli_args(argparse.ArgumentParser(), _Knobs, overrides={"nope": {}})


def test_parse_list_names_the_option():
    assert parse_list("1, 2,2,4", int, "x") == [1, 2, 4]
    with pytest.raises(ValueError, match="--concurrency"):
        parse_list("1,a", int, "--concurrency")


def _subparser(register, *argv: str) -> argparse.Namespace:
    root = HelpParser(prog="kvserve")
    register(root.add_subparsers(dest="cmd"))
    return root.parse_args(list(argv))


def test_serve_flags_come_from_the_settings(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    ns = _subparser(server_cli.register, "serve", "demo", "--port", "9001",
                    "--request-timeout", "0", "--no-access-log", "--max-queue", "3",
                    "--drain-timeout", "5", "--kv-cache-dtype", "int8")
    settings = from_cli_args(ServerSettings, ns, served_model_name="m")
    assert settings == ServerSettings(served_model_name="m", api_key="from-env", max_queue=3,
                                      request_timeout=None, access_log=False)
    assert from_cli_args(LaunchSettings, ns) == LaunchSettings(port=9001, drain_timeout=5.0)
    engine = EngineArgs.from_cli_args(ns)
    assert engine.model == "demo" and engine.kv_cache_dtype == "int8"
    # every CLI field of the settings has its flag, with the field's default
    defaults = _subparser(server_cli.register, "serve")
    for cls in (ServerSettings, LaunchSettings):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") and f.name not in ("api_key", "served_model_name",
                                                        "request_timeout"):
                assert getattr(defaults, f.name) == f.default, f.name
    with pytest.raises(ValueError, match="drain_timeout"):
        from_cli_args(LaunchSettings, _subparser(server_cli.register, "serve",
                                                 "--drain-timeout", "-1"))


def test_bench_flags_come_from_the_configs():
    ns = _subparser(bench_cli.register, "bench", "integrity", "--model", "demo",
                    "--concurrency", "4,8", "--no-progress")
    own = cli_values(ThroughputConfig, ns)
    assert own["kv_cache_dtypes"] == ["fp8"] and own["integrity_modes"] == ["off", "on",
                                                                            "paranoid"]
    assert own["concurrency"] == [4, 8] and own["progress"] is False
    assert own["kv_cache_memory"] == "auto32"
    ns = _subparser(bench_cli.register, "bench", "latency", "--peer", "hf", "--peer", "hf",
                    "--batch-sizes", "1,2")
    lc = from_cli_args(LatencyConfig, ns, base=EngineArgs())
    assert lc.peers == ["hf"] and lc.batch_sizes == [1, 2] and lc.output_len == 64
    # a second parse does not see the first one's appended peers
    ns = _subparser(bench_cli.register, "bench", "latency")
    assert from_cli_args(LatencyConfig, ns).peers == []


def test_bench_serve_flags():
    p = argparse.ArgumentParser()
    add_cli_args(p, ServeBenchConfig)
    cfg = from_cli_args(ServeBenchConfig, p.parse_args(["--json", "o.json", "--chat"]))
    assert cfg == ServeBenchConfig(json_out="o.json", chat=True)
