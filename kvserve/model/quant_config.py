"""``config.json``'s ``quantization_config`` -> which modules load as INT4 (W4A16), and how.

Supported (everything else is a ``ValueError`` naming the scheme):

* compressed-tensors, ``format: pack-quantized`` (global or per config group): weights
  ``num_bits 4``, ``type int``, strategy ``group`` (any group size) or ``channel``, symmetric or
  not, ``actorder`` none/``weight`` (no g_idx) or ``group`` (``weight_g_idx`` stored); no input /
  output activation quantization. Modules are matched as compressed-tensors does
  (``compressed_tensors.utils.match``): a target or ``ignore`` entry is an exact module name,
  ``re:<regex>`` (``re.match`` on the name) or a class name (``Linear`` matches every linear
  layer, ``lm_head`` included). Several config groups: an exact-name target beats a regex one
  beats a class one (vLLM's ``find_matched_target`` order).
* GPTQ (``quant_method: gptq``): ``bits 4``, ``group_size`` (-1: channel-wise), ``desc_act``,
  ``sym``, ``checkpoint_format`` ``gptq`` (v1, zero points stored minus one) or ``gptq_v2``.
  Quantized: every linear layer inside a decoder block (``.layers.<i>.``), ``lm_head`` only with
  ``lm_head: true``; ``modules_in_block_to_quantize`` restricts, and GPTQModel's ``dynamic``
  rules apply (``-:<regex>`` keeps a module dense, ``+:<regex>`` / ``<regex>`` overrides its
  ``group_size`` / ``sym`` / ``desc_act`` / ``bits``), as in vLLM.

Names are checkpoint module names (``model.layers.0.self_attn.q_proj``): the loader asks once per
shard of a fused module (q/k/v, gate/up), and all shards must agree. MoE routed experts are
asked per expert and projection (``model.layers.1.mlp.experts.7.gate_proj``); router gates are
never asked (always dense).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.quant.int4 import (  # noqa: F401 - Int4Scheme and GGUF_TENSORS re-exported
    CT_TENSORS,
    GGUF_TENSORS,
    GPTQ_FORMATS,
    GPTQ_TENSORS,
    Int4Scheme,
)

_CT_ACTORDER_G_IDX = ("group", "dynamic")  # compressed-tensors orders that store weight_g_idx
_CT_ACTORDER_OK = (None, False, "weight", "static", *_CT_ACTORDER_G_IDX)
_SUPPORTED = ("compressed-tensors 'pack-quantized' W4A16 (4-bit int weights, group or channel "
              "strategy) and GPTQ 4-bit (checkpoint_format gptq / gptq_v2)")


@dataclass(frozen=True, slots=True)
class _CtGroup:
    name: str
    targets: tuple[str, ...]
    scheme: Int4Scheme


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A parsed, supported ``quantization_config``; ``scheme_for`` answers per module."""

    method: str  # "compressed-tensors" or "gptq"
    groups: tuple[_CtGroup, ...] = ()  # compressed-tensors
    ignore: tuple[str, ...] = ()  # compressed-tensors
    gptq: Int4Scheme | None = None  # GPTQ defaults
    gptq_lm_head: bool = False
    gptq_modules: tuple[str, ...] | None = None  # modules_in_block_to_quantize, flattened
    gptq_dynamic: tuple[tuple[str, Mapping[str, Any]], ...] = ()

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return CT_TENSORS if self.method == "compressed-tensors" else GPTQ_TENSORS

    def describe(self) -> str:
        if self.method == "gptq":
            assert self.gptq is not None
            return f"gptq ({self.gptq.describe()})"
        return "compressed-tensors (" + "; ".join(g.scheme.describe() for g in self.groups) + ")"

    def scheme_for(self, name: str, class_name: str = "Linear") -> Int4Scheme | None:
        """The INT4 scheme of checkpoint module ``name`` (a linear layer), None: dense."""
        if self.method == "gptq":
            return self._gptq_scheme(name)
        if any(_match(name, class_name, ign) is not None for ign in self.ignore):
            return None
        best: tuple[int, Int4Scheme] | None = None
        for group in self.groups:
            for target in group.targets:
                rank = _match(name, class_name, target)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, group.scheme)
        return best[1] if best is not None else None

    def _gptq_scheme(self, name: str) -> Int4Scheme | None:
        assert self.gptq is not None
        is_head = name == "lm_head" or name.endswith(".lm_head")
        if is_head and not self.gptq_lm_head:
            return None
        in_block = re.search(r"(?:^|\.)layers\.\d+\.", name) is not None
        if not is_head and (not in_block or (self.gptq_modules is not None and not any(
                name.endswith("." + m) for m in self.gptq_modules))):
            return None
        scheme = self.gptq
        for pattern, overrides in self.gptq_dynamic:
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    return None
            elif re.match(pattern.removeprefix("+:"), name):
                scheme = _gptq_scheme({**_gptq_fields(scheme), **overrides},
                                      f"gptq dynamic[{pattern!r}]")
                break
        return scheme


def _match(name: str, class_name: str, target: str) -> int | None:
    """compressed-tensors matching: 0 exact name, 1 regex, 2 class name; None: no match."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    if target == name:
        return 0
    return 2 if target == class_name else None


def parse_quant_config(raw: Mapping[str, Any] | None) -> QuantConfig | None:
    """``quantization_config`` (dict, or an object with ``to_dict``) -> QuantConfig; None if the
    checkpoint is not quantized. Unsupported schemes raise ``ValueError`` naming the scheme."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        to_dict = getattr(raw, "to_dict", None)
        if to_dict is None:
            raise ValueError(f"quantization_config must be a JSON object, got {raw!r}")
        raw = to_dict()
    assert isinstance(raw, Mapping)
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "gptq":
        return _parse_gptq(raw)
    detail = ""
    if method == "awq":
        detail = (f" (AWQ {raw.get('version', 'gemm')} format, {raw.get('bits', '?')}-bit; "
                  "re-quantize with `kvserve quantize --calibration ...`, which runs AWQ and "
                  "writes compressed-tensors)")
    elif method in ("gptq-marlin", "marlin", "awq-marlin"):
        detail = " (Marlin GPU layout)"
    raise ValueError(f"unsupported quantization scheme: quant_method {method or '(missing)'!r}"
                     f"{detail}; kvserve loads {_SUPPORTED}")


def _parse_compressed_tensors(raw: Mapping[str, Any]) -> QuantConfig:
    fmt = raw.get("format")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity and sparsity.get("format") not in (None, "dense"):
        raise ValueError(f"unsupported quantization scheme: compressed-tensors sparsity format "
                         f"{sparsity.get('format')!r}; kvserve loads {_SUPPORTED}")
    if raw.get("transform_config"):
        raise ValueError("unsupported quantization scheme: compressed-tensors transform_config "
                         f"(rotations); kvserve loads {_SUPPORTED}")
    groups_raw = raw.get("config_groups") or {}
    if not groups_raw:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    groups = []
    for gname, g in groups_raw.items():
        where = f"compressed-tensors config group {gname!r}"
        gfmt = g.get("format") or fmt
        w = g.get("weights")
        if w is None:
            raise ValueError(f"unsupported quantization scheme: {where} quantizes no weights")
        bits, typ = w.get("num_bits"), w.get("type", "int")
        strategy = w.get("strategy")
        scheme_name = (f"{where}: {bits}-bit {typ} weights, strategy {strategy!r}, format "
                       f"{gfmt!r}")
        if typ != "int" or bits != 4:
            kind = "fp8" if typ == "float" and bits == 8 else f"{bits}-bit {typ}"
            raise ValueError(f"unsupported quantization scheme: {scheme_name} ({kind} weights)"
                             f"; kvserve loads {_SUPPORTED}")
        if gfmt != "pack-quantized":
            raise ValueError(f"unsupported quantization scheme: {scheme_name} (format "
                             f"{gfmt!r}); kvserve loads {_SUPPORTED}")
        if strategy not in ("group", "channel"):
            raise ValueError(f"unsupported quantization scheme: {scheme_name} (strategy "
                             f"{strategy!r}); kvserve loads {_SUPPORTED}")
        if g.get("input_activations") or g.get("output_activations"):
            raise ValueError(f"unsupported quantization scheme: {where} quantizes activations "
                             f"(W4A{(g.get('input_activations') or {}).get('num_bits', '?')})"
                             f"; kvserve loads weight-only {_SUPPORTED}")
        if w.get("dynamic"):
            raise ValueError(f"unsupported quantization scheme: {where} has dynamic weight "
                             "quantization")
        actorder = w.get("actorder")
        if actorder not in _CT_ACTORDER_OK:
            raise ValueError(f"unsupported quantization scheme: {where} actorder {actorder!r}")
        group_size = -1 if strategy == "channel" else w.get("group_size")
        if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
            raise ValueError(f"{where}: group strategy needs a positive group_size, got "
                             f"{group_size!r}")
        targets = g.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        scheme = Int4Scheme("pack-quantized", group_size, bool(w.get("symmetric", True)),
                            act_order=actorder in _CT_ACTORDER_G_IDX)
        groups.append(_CtGroup(str(gname), tuple(targets), scheme))
    ignore = raw.get("ignore") or []
    if isinstance(ignore, str):
        ignore = [ignore]
    return QuantConfig("compressed-tensors", groups=tuple(groups), ignore=tuple(ignore))


def _gptq_fields(s: Int4Scheme) -> dict[str, Any]:
    return {"bits": 4, "group_size": s.group_size, "sym": s.symmetric, "desc_act": s.act_order,
            "checkpoint_format": s.checkpoint_format}


def _gptq_scheme(raw: Mapping[str, Any], where: str = "gptq") -> Int4Scheme:
    bits = raw.get("bits", raw.get("w_bit"))
    fmt = raw.get("checkpoint_format") or "gptq"
    if raw.get("is_marlin_format") or fmt == "marlin":
        raise ValueError(f"unsupported quantization scheme: {where} checkpoint_format 'marlin' "
                         f"(Marlin GPU layout); kvserve loads {_SUPPORTED}")
    if bits != 4:
        raise ValueError(f"unsupported quantization scheme: {where} {bits}-bit weights "
                         f"(bits={bits!r}); kvserve loads {_SUPPORTED}")
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"unsupported quantization scheme: {where} checkpoint_format {fmt!r}; "
                         f"kvserve loads {_SUPPORTED}")
    group_size = raw.get("group_size", 128)
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise ValueError(f"{where}: group_size must be -1 or a positive int, got "
                         f"{group_size!r}")
    return Int4Scheme("gptq", group_size, bool(raw.get("sym", True)),
                      act_order=bool(raw.get("desc_act", False)), checkpoint_format=fmt)


def _parse_gptq(raw: Mapping[str, Any]) -> QuantConfig:
    scheme = _gptq_scheme(raw)
    modules = raw.get("modules_in_block_to_quantize")
    flat: tuple[str, ...] | None = None
    if modules:
        flat = tuple(m for part in modules for m in ([part] if isinstance(part, str) else part))
    dynamic = tuple((str(k), dict(v or {})) for k, v in (raw.get("dynamic") or {}).items())
    for pattern, overrides in dynamic:  # validate overrides up front, naming the rule
        if not pattern.startswith("-:"):
            _gptq_scheme({**_gptq_fields(scheme), **overrides}, f"gptq dynamic[{pattern!r}]")
    return QuantConfig("gptq", gptq=scheme, gptq_lm_head=bool(raw.get("lm_head", False)),
                       gptq_modules=flat, gptq_dynamic=dynamic)
