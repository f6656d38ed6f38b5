"""Helpers shared by the analysis commands: building configs for variants, tables.

The command-line conventions of every command (help layout, `--dtype` names, file names, the checks of the
`--preset`/`--model_dir` and list flags) are in `qkvshare_settings.conventions`, with the commands' parsers.

Design notes
- A "base" config gives the model shape (a preset, a model directory's config.json, plus overrides); each
  variant is the base with only the sharing fields replaced, as the config module's `resolve_variant` gives them
  (`projection_sharing`, `num_key_value_heads`, `attention_map_pe_dim`, `key_context_dim`; per-layer mixes are
  cleared). So every variant of one table has the same shape, and a name means the same config in every command.
- Llama-architecture config.json files (model_type llama/mistral/qwen2) map onto the Llama-style QKVShare fields
  (`QKVShareConfig.from_llama`), so the tools accept any such checkpoint directory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from qkvshare.configuration_qkvshare import (
    LLAMA_ARCHITECTURES,
    SHARING_MODES,
    QKVShareConfig,
    llama_config_dict,
    resolve_variant,
)
from qkvshare.model_dir import read_config_json
from qkvshare_settings.conventions import check_shape_source
from qkvshare_settings.overrides import parse_overrides as parse_override_items


def model_fields() -> tuple[str, ...]:
    """The config's own model fields (everything below PreTrainedConfig's generic ones)."""
    return tuple(QKVShareConfig.__annotations__)


def parse_overrides(items: Iterable[str] | None) -> dict[str, Any]:
    """Parse `--override key=value ...` with the syntax every command shares (`qkvshare_settings.overrides`); keys must
    be QKVShareConfig fields. Raises `ValueError` naming the bad item or key. (The commands' parsers check the
    syntax alone, before the configuration module is imported.)
    """
    overrides = parse_override_items(items, "--override")
    QKVShareConfig.check_field_names(overrides, "--override")
    return overrides


def config_from_model_dir(model_dir: str | Path) -> QKVShareConfig:
    """The config of a QKVShare or Llama-architecture model directory (a clear error for a missing or damaged one)."""
    d = read_config_json(model_dir)
    model_type = d.get("model_type")
    if model_type == "qkvshare":
        fields = model_fields()
        return QKVShareConfig(**{k: v for k, v in d.items() if k in fields})
    if model_type in LLAMA_ARCHITECTURES:
        return QKVShareConfig.from_llama(llama_config_dict(d, str(Path(model_dir) / "config.json")))
    raise ValueError(
        f"{model_dir!s}: model_type={model_type!r} is not supported; expected 'qkvshare' or a Llama-architecture "
        f"model ({', '.join(map(repr, LLAMA_ARCHITECTURES))})."
    )


def base_config(preset: str | None = None, model_dir: str | None = None, overrides: dict[str, Any] | None = None):
    """The shape every variant shares: a preset or a model directory, then field overrides."""
    check_shape_source(preset, model_dir)
    if preset is not None:
        return QKVShareConfig.from_preset(preset, **(overrides or {}))
    base = config_from_model_dir(model_dir)
    return with_fields(base, **(overrides or {})) if overrides else base


def base_and_variants(
    preset: str | None,
    model_dir: str | None,
    override_items: Iterable[str] | None,
    variants: Sequence[str] | None,
    plus: bool,
) -> tuple[QKVShareConfig, list[str]]:
    """A command's base config (`base_config` with its `--override` items) and the variant names to measure on it:
    ``variants``, or `default_variants` of the base (with ``plus``); each name checked (a ValueError naming it)."""
    base = base_config(preset, model_dir, parse_overrides(override_items))
    return base, check_variants(base, variants or default_variants(base, plus))


def with_fields(config: QKVShareConfig, **fields: Any) -> QKVShareConfig:
    """A copy of ``config`` with some model fields replaced (validated like any new config)."""
    values = {k: getattr(config, k) for k in model_fields()} | fields
    return QKVShareConfig(**values)


def variant_config(base: QKVShareConfig, variant: str) -> QKVShareConfig:
    """``base`` turned into the paper variant ``variant`` (`resolve_variant`: same shape, only the sharing fields
    change; a name without a head count keeps the base's key/value heads). A `projection_sharing` value ("none",
    "qk", "kv", "qkv") is taken as its mode's paper name."""
    name = SHARING_MODES[variant].paper_name if variant in SHARING_MODES else variant
    return with_fields(base, **resolve_variant(name, base))


def default_gqa_groups(num_heads: int) -> int | None:
    """Key/value heads of the default GQA variant: H/4 as in the paper (GQA-4 at 16 heads, GQA-8 at 32), at least 2."""
    for g in (num_heads // 4, 2):
        if 1 < g < num_heads and num_heads % g == 0:
            return g
    return None


def default_variants(base: QKVShareConfig, plus: bool = True) -> list[str]:
    """QKV, Q=K-V, Q-K=V, Q=K=V, GQA-g, MQA, Q-GQA-g, Q-MQA for this head count (the paper's LM variants), and with
    `plus` the "+" variants, any other sharing mode of `SHARING_MODES` and the second source's QV-Ka and QV-Ka-2 (the
    full list `qkvshare costs` shows)."""
    g = default_gqa_groups(base.num_attention_heads)
    names = ["QKV", "Q=K-V", "Q-K=V", "Q=K=V"]
    if g is not None:
        names.append(f"GQA-{g}")
    if base.num_attention_heads > 1:
        names.append("MQA")
    if g is not None:
        names.append(f"Q-GQA-{g}")
    if base.num_attention_heads > 1:
        names.append("Q-MQA")
    if plus:
        names += ["(Q=K-V)+", "(Q=K=V)+"]
        names += [mode.paper_name for mode in SHARING_MODES.values() if mode.paper_name not in names]
        names += ["QV-Ka", "QV-Ka-2"]
    return names


def check_variants(base: QKVShareConfig, variants: Sequence[str]) -> list[str]:
    """Validate variant names against the base (clear ValueError before any long work)."""
    for v in variants:
        variant_config(base, v)
    return list(variants)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""

    def cell(x: Any) -> str:
        if isinstance(x, float):
            if math.isnan(x):
                return "-"
            return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"
        if isinstance(x, int) and not isinstance(x, bool):
            return f"{x:,}"
        return str(x)

    body = [[cell(x) for x in row] for row in rows]
    align = ["---:" if rows and isinstance(rows[0][i], (int, float)) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)
