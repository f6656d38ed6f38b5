"""The conversion: its plan (the target config and methods, every check before any weight is read), `convert` and
the record it writes (`conversion.json`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm

from qkvshare import QKVShareConfig, QKVShareForCausalLM
from qkvshare.configuration_qkvshare import PROJECTION_ROLES, llama_config_dict
from qkvshare.convert.budget import BudgetChoice, check_cache_budget, choose_tied_layers, every_layer_needed, tie_layers
from qkvshare.convert.calibration import calibrate, check_calibration_ids
from qkvshare.convert.transfer import (
    StageFiles,
    TransferSettings,
    changed_layers,
    measure_layer_errors,
    run_stages,
)
from qkvshare.convert.weights import build_converted
from qkvshare.evaluation.fidelity import reference_log_probs, score_blocks
from qkvshare.model_dir import check_architecture
from qkvshare.version import __version__
from qkvshare_settings.convert import (
    BUDGET_CHOICES,
    CALIBRATIONS,
    CONVERT_OVERRIDES,
    DEFAULT_BUDGET_CHOICE,
    DEFAULT_CALIBRATION,
    DEFAULT_METHOD,
    DEFAULT_RIDGE,
    KV_METHODS,
    QUERY_METHODS,
)


@dataclass
class ConversionRecord:
    """How a model was converted (written as `conversion.json` next to the weights)."""

    source: str  # what was converted: a path, or the class of an in-memory model
    source_model_type: str
    source_key_value_heads: int
    variant: str  # the converted config's paper name (Q-K=V of a GQA-3 source is Q-GQA-3)
    projection_sharing: str
    num_key_value_heads: int
    method: str | None  # K=V method (None: no tied layer)
    query_method: str | None  # method of the layers whose query is shared (None: none, or mixed sources kept as own)
    kv_tie_point: str
    head_pooling: str | None  # "mean" when key/value heads were pooled
    calibration_tokens: int = 0
    calibration_source: str | None = None
    ridge: float | None = None
    # where the calibrated fit of layer l takes its inputs: "sequential" (the converted model's own hidden states,
    # layers < l converted) or "independent" (the source's); None when nothing was fitted
    calibration: str | None = None
    # per-layer ||y' - y|| / ||y|| of the attention output: "converted" (the model saved) and, for tied layers,
    # "key", "value" and "calibrated" measured side by side (None where a method does not apply to a layer)
    layer_errors: dict[str, list[float | None]] = field(default_factory=dict)
    # --method transfer: held-out tokens of the errors, each stage's budget, time, per-layer choices ("choices",
    # "best_step") and whole-model KL divergence to the source ("kl_to_source"), the layers where a stage was not
    # kept, and the --cache_budget choice
    validation_tokens: int = 0
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    not_kept: dict[str, list[int]] = field(default_factory=dict)
    cache_budget: dict[str, Any] | None = None
    seconds: float = 0.0
    qkvshare_version: str = ""
    transformers_version: str = ""

    def mean_error(self, method: str = "converted", layers: list[int] | None = None) -> float | None:
        """The mean of `method`'s per-layer errors over `layers` (default: every layer that has one); None when the
        method was not run (e.g. no stage (c)) or no chosen layer has an error."""
        errors = self.layer_errors.get(method)
        if not errors:
            return None
        values = [errors[i] for i in (range(len(errors)) if layers is None else layers) if errors[i] is not None]
        return sum(values) / len(values) if values else None


def plan_conversion(
    source_config: Any,
    variant: str | None = None,
    method: str | None = None,
    query_method: str | None = None,
    **overrides: Any,
) -> tuple[QKVShareConfig, str | None, str | None]:
    """The target config and the resolved K=V and Q=K methods, or a `ValueError` saying why the source cannot be
    converted so. `source_config` is a Llama-architecture config object or `config.json` dict. `method="transfer"`
    applies to every changed layer (K=V, Q=K, pooled heads)."""
    d = source_config.to_dict() if hasattr(source_config, "to_dict") else dict(source_config)
    check_architecture(d)
    if not hasattr(source_config, "to_dict"):  # a config.json may leave fields to their defaults
        d = llama_config_dict(d, "the source config")
    unknown = sorted(set(overrides) - set(CONVERT_OVERRIDES))
    if unknown:
        raise ValueError(
            f"override(s) {', '.join(unknown)} would change the shape of the copied weights; convert accepts only "
            f"{', '.join(CONVERT_OVERRIDES)}."
        )
    if method is not None and method not in KV_METHODS:
        raise ValueError(f"method={method!r} is not a K=V method; use one of {', '.join(KV_METHODS)}.")
    if query_method is not None and query_method not in QUERY_METHODS:
        raise ValueError(
            f"query_method={query_method!r} is not a shared-query method; use one of {', '.join(QUERY_METHODS)}."
        )
    heads = d["num_attention_heads"]
    source_kv = d.get("num_key_value_heads") or heads
    shape = f"{heads} query heads, {source_kv} key/value heads"
    try:
        config = QKVShareConfig.from_llama(d, variant, **overrides)
    except ValueError as err:
        raise ValueError(f"the source ({shape}) cannot take variant={variant!r}: {err}") from None
    if config.attention_map_pe_dim:
        raise ValueError(
            f"variant={variant!r} adds the '+' attention-map encoding, which has no counterpart in a Llama "
            "checkpoint; convert to the variant without '+' (its weights would start untrained)."
        )
    layers = range(config.num_hidden_layers)
    tied = any(config.is_kv_tied(i) for i in layers)
    # the roles ("key", "value") of the projections the shared queries are taken from (Q=K: "key")
    query_roles = {PROJECTION_ROLES[config.layer_mode(i).query_from] for i in layers if config.is_query_shared(i)}
    query_tied = bool(query_roles)
    if config.num_key_value_heads > source_kv:
        why = ""
        if query_tied:
            role = "/".join(sorted(query_roles))
            why = (
                f" (a query taken from the {role} projection makes every query head a {role} head: it needs "
                "num_key_value_heads == num_attention_heads)"
            )
        raise ValueError(
            f"variant={variant!r} needs {config.num_key_value_heads} key/value heads but the source has {source_kv} "
            f"({shape}){why}; a conversion can pool heads, not invent them. Choose at most {source_kv} (e.g. "
            "Q-K=V, which keeps the source's heads, Q-MQA or MQA)."
        )
    pooled = config.num_key_value_heads < source_kv
    if method == "transfer" and not (tied or query_tied or pooled):
        raise ValueError(
            f"method='transfer' fits converted attention layers, but variant={variant!r} ({config.variant}) changes "
            "none of the source's (an exact copy); leave --method out."
        )
    if method is not None and method != "transfer" and not tied:
        raise ValueError(
            f"method={method!r} chooses how K=V layers are made, but variant={variant!r} ({config.variant}) has no "
            "K=V layer; leave --method out."
        )
    if query_method is not None and not query_tied:
        raise ValueError(
            f"query_method={query_method!r} chooses how layers whose query is shared (Q=K) are made, but "
            f"variant={variant!r} ({config.variant}) has none; leave --query_method out."
        )
    if query_method not in (None, "query") and query_roles != {query_method}:
        roles = "/".join(sorted(query_roles))
        raise ValueError(
            f"query_method={query_method!r}: the query of variant={variant!r} ({config.variant}) is its {roles} "
            f"projection; use query_method={roles!r} (the default: that projection keeps its source weight) or "
            "'query' (it takes the source's W_q)."
        )
    method = method if method == "transfer" else (method or DEFAULT_METHOD) if tied else None
    own = next(iter(query_roles)) if len(query_roles) == 1 else None  # None: each layer keeps its own
    query_method = (query_method or own) if query_tied else None
    if method in ("calibrated", "transfer") and "kv_tie_point" not in overrides:
        config.kv_tie_point = "pre_rope"  # the tie under which the value is a linear function of U (docstring)
    return config, method, query_method


def convert(
    source: Any,
    variant: str | None = None,
    method: str | None = None,
    *,
    query_method: str | None = None,
    calibration_ids: torch.Tensor | None = None,
    ridge: float = DEFAULT_RIDGE,
    calibration: str = DEFAULT_CALIBRATION,
    source_name: str | None = None,
    calibration_source: str | None = None,
    validation_ids: torch.Tensor | None = None,
    transfer: TransferSettings | None = None,
    cache_budget: float | None = None,
    budget_choice: str = DEFAULT_BUDGET_CHOICE,
    work_dir: Path | None = None,
    progress: bool = False,
    **overrides: Any,
) -> tuple[QKVShareForCausalLM, ConversionRecord]:
    """Convert a Llama-architecture causal LM (`LlamaForCausalLM`, Mistral, Qwen2) to `variant`.

    Args:
        source: the pretrained model (left unchanged).
        variant: a paper name (`QKVShareConfig.from_llama`): `None`/`QKV` copy, `Q-K=V` (keeps the source's
            key/value heads), `Q=K-V`, `Q=K=V`, `GQA-<g>`, `MQA`, `Q-GQA-<g>`, `Q-MQA`.
        method: K=V layers: `key`, `value` or `calibrated` (default; needs `calibration_ids`), or `transfer`
            (every changed layer; needs `calibration_ids` and `validation_ids`; `qkvshare.convert.transfer`).
        query_method: Q=K layers: `key` (default) or `query`.
        calibration_ids: (batch, length) token ids from the source's tokenizer. Required by `calibrated`; with
            any method they also give the per-layer errors of the record.
        ridge: relative ridge of the calibrated fit.
        calibration: `sequential` (default: fit each layer on the converted model's own hidden states) or
            `independent` (on the source's).
        source_name, calibration_source: what the record says the source and the calibration text were.
        validation_ids: held-out (batch, length) token ids on which `transfer` measures every stage.
        transfer: the settings of stages (a) and (b) (default `TransferSettings(ridge=ridge)`).
        cache_budget: with `transfer`, the fraction of the source's KV bytes to keep (`qkvshare.convert.budget`).
        budget_choice: how `cache_budget` ranks the layers: `kl` (the whole model's KL to the source on
            `validation_ids` with the layer alone tied) or `error` (stage (b)'s error of the layer).
        work_dir: with `transfer`, where the stages save their progress (a rerun continues from it).
        progress: progress bars of the transfer stages.
        overrides: config fields of `CONVERT_OVERRIDES` (e.g. `kv_tie_point="post_rope"`).

    Returns the converted model (float32, eval mode) and its `ConversionRecord`. Raises `ValueError` before any
    weight is copied when the source or the request is not convertible.
    """
    started = time.perf_counter()
    if calibration not in CALIBRATIONS:
        raise ValueError(f"calibration={calibration!r} is not a calibration; use one of {', '.join(CALIBRATIONS)}.")
    if budget_choice not in BUDGET_CHOICES:
        raise ValueError(f"budget_choice={budget_choice!r} is not a choice; use one of {', '.join(BUDGET_CHOICES)}.")
    config, method, query_method = plan_conversion(source.config, variant, method, query_method, **overrides)
    if method in ("calibrated", "transfer") or calibration_ids is not None:
        check_calibration_ids(calibration_ids, config)
    if method == "transfer":
        check_calibration_ids(validation_ids, config, "validation_ids")
    heads = source.config.num_attention_heads
    source_kv = getattr(source.config, "num_key_value_heads", None) or heads
    check_cache_budget(config, method, source_kv, cache_budget)
    model = build_converted(source.state_dict(), source_kv, config, method, query_method)
    errors, extra = {}, {}
    source.eval()
    if method == "transfer":
        model, extra = _transfer(
            source,
            model,
            source_kv,
            calibration_ids,
            validation_ids,
            transfer or TransferSettings(ridge=ridge),
            cache_budget,
            budget_choice,
            work_dir,
            progress,
            variant,
            query_method,
            overrides,
        )
        errors = extra.pop("layer_errors")
        config = model.config
    elif calibration_ids is not None:
        errors = calibrate(source, model, calibration_ids, source_kv, method, query_method, ridge, calibration)
    record = ConversionRecord(
        source=source_name or type(source).__name__,
        source_model_type=source.config.model_type,
        source_key_value_heads=source_kv,
        variant=config.variant,
        projection_sharing=config.projection_sharing,
        num_key_value_heads=config.num_key_value_heads,
        method=method,
        query_method=query_method,
        kv_tie_point=config.kv_tie_point,
        head_pooling="mean" if config.num_key_value_heads < source_kv else None,
        calibration_tokens=int(calibration_ids.numel()) if calibration_ids is not None else 0,
        calibration_source=calibration_source if calibration_ids is not None else None,
        ridge=ridge if method in ("calibrated", "transfer") else None,
        calibration=calibration if method == "calibrated" else None,
        layer_errors=errors,
        validation_tokens=int(validation_ids.numel()) if method == "transfer" else 0,
        **extra,
        seconds=round(time.perf_counter() - started, 2),
        qkvshare_version=__version__,
        transformers_version=transformers.__version__,
    )
    return model, record


def _transfer(
    source: Any,
    model: QKVShareForCausalLM,
    source_kv: int,
    train_ids: torch.Tensor,
    validation_ids: torch.Tensor,
    settings: TransferSettings,
    cache_budget: float | None,
    budget_choice: str,
    work_dir: Path | None,
    progress: bool,
    variant: str | None,
    query_method: str | None,
    overrides: dict[str, Any],
) -> tuple[QKVShareForCausalLM, dict[str, Any]]:
    """Stages (a) and (b) on every changed layer, then the --cache_budget choice; the model and the record's
    transfer fields (layer_errors, stages, not_kept, cache_budget)."""
    reference, _ = reference_log_probs(source, validation_ids, dtype=torch.float32, progress=None)
    current = model

    def after_stage(stage: str) -> dict[str, Any]:  # the whole model's mean KL(source || model) per token
        return {"kl_to_source": score_blocks(current, validation_ids, reference=reference, progress=None).kl}

    layers = changed_layers(model.config, source_kv)
    result = run_stages(
        source, model, layers, train_ids, validation_ids, settings, work_dir, progress=progress, after_stage=after_stage
    )
    errors = result["layer_errors"]
    for stage, picks in result.get("choices", {}).items():  # per layer: which candidate a stage kept
        if stage in result["stages"]:
            result["stages"][stage]["choices"] = picks
    budget = None
    if cache_budget is not None:
        last = list(errors)[-1]  # the last stage run
        if every_layer_needed(model.config, layers, cache_budget) is not None:  # nothing to rank: no scan
            scores, chosen_by = [None] * model.config.num_hidden_layers, "the budget needs every layer"
        elif budget_choice == "kl":
            build = partial(mixed_model, source, model, variant=variant, query_method=query_method, overrides=overrides)
            files = StageFiles(work_dir)
            scores = layer_kl_scores(build, model.config, layers, validation_ids, reference, files, progress)
            chosen_by = "lowest kl_to_source with the layer alone tied"
        else:
            scores, chosen_by = errors[last], f"lowest layer_errors[{last!r}]"
        current, choice = budget_model(source, model, scores, cache_budget, variant, query_method, overrides)
        budget = asdict(choice) | {"fraction": choice.fraction, "chosen_by": chosen_by, "layer_scores": scores}
        result["stages"]["cache_budget"] = after_stage("cache_budget")
    errors["converted"] = measure_layer_errors(source, current, validation_ids)
    extra = {
        "layer_errors": errors,
        "stages": result["stages"],
        "not_kept": result.get("not_kept", {}),
        "cache_budget": budget,
    }
    return current, extra


def budget_model(
    source: Any,
    model: QKVShareForCausalLM,
    scores: list[float | None],
    cache_budget: float,
    variant: str | None,
    query_method: str | None,
    overrides: dict[str, Any],
) -> tuple[QKVShareForCausalLM, BudgetChoice]:
    """`model` (every layer converted) with only the layers `choose_tied_layers` picks from `scores` for
    `cache_budget` kept converted; every other layer is the source's exact copy (`mixed_model`)."""
    choice = choose_tied_layers(model.config, scores, cache_budget)
    mixed = mixed_model(source, model, choice, variant=variant, query_method=query_method, overrides=overrides)
    return mixed, choice


def mixed_model(
    source: Any,
    model: QKVShareForCausalLM,
    choice: BudgetChoice,
    *,
    variant: str | None,
    query_method: str | None,
    overrides: dict[str, Any],
) -> QKVShareForCausalLM:
    """The source with only `choice.tied_layers` converted, holding `model`'s (every layer converted) attention
    there; every other layer is the source's exact copy (`layer_projection_sharing`)."""
    fields = {"kv_tie_point": model.config.kv_tie_point} | overrides
    config = QKVShareConfig.from_llama(
        source.config, variant, **(fields | {"layer_projection_sharing": choice.layer_projection_sharing})
    )
    source_kv = getattr(source.config, "num_key_value_heads", None) or source.config.num_attention_heads
    mixed = build_converted(source.state_dict(), source_kv, config, "transfer", query_method)
    for i in choice.tied_layers:
        mixed.model.layers[i].self_attn.load_state_dict(model.model.layers[i].self_attn.state_dict())
    return mixed


def layer_kl_scores(
    build: Callable[[BudgetChoice], QKVShareForCausalLM],
    config: QKVShareConfig,
    layers: list[int],
    validation_ids: torch.Tensor,
    reference: torch.Tensor,
    files: StageFiles,
    progress: bool = False,
) -> list[float | None]:
    """Per layer, the whole model's mean KL(source || model) per token on `validation_ids` with that layer alone
    tied (`build` makes the model from a choice): what tying it costs at the output, where stage (b)'s error sees
    only the layer's own attention output (a layer that is easy to fit may still carry what later layers need).
    Saved in the work folder's record as each layer finishes, so a rerun (another budget) reuses them."""
    record = files.load_errors()
    saved = record.setdefault("layer_kl", {})
    for i in tqdm(layers, desc="layer KL", disable=not progress, leave=False):
        if str(i) in saved:
            continue
        single = build(tie_layers(config, [i]))
        saved[str(i)] = score_blocks(single, validation_ids, reference=reference, progress=None).kl
        del single
        files.save_errors(record)
    return [saved.get(str(i)) for i in range(config.num_hidden_layers)]
