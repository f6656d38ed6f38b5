"""`qkvshare convert --method transfer`: make a converted attention layer do what the source's did, layer by layer.

Why it works: a conversion changes only attention, and each converted layer can be taught on dense local targets
(the source layer's attention output: `hidden_size` numbers per token and layer, not one next-token loss), with
the SOURCE's hidden states as inputs, so the layers are independent (one source forward pass serves all of them)
and their errors do not compound while they are fitted. When the key projection is kept (Q-K=V with the source's
key heads) every attention probability matrix P is exactly the source's, and the whole error is in the values.

Stages (each resumable from a work folder; the errors before and after each go to `conversion.json`)
- (a) closed form: per converted layer, two candidate o_proj weights, and the one with the lowest error on the
  held-out (validation) tokens is kept, or the layer as it was when neither is better:
  "per_head", the calibrated method's maps M_h (one d_h x d_h map per query head from the converted head output
  to the source's, folded into o_proj; `qkvshare_settings.convert`'s docstring), here fitted on the source's hidden
  states; and "full", o_proj refitted by ridge regression in output space from the features it receives,
  concat_h(P'_h U_g(h)) (P' the converted layer's attention, = P when the key is kept; U its shared key/value), to
  the source layer's attention-block output y, shrunk toward the per-head solution:
      W_o, b_o = argmin ||F W^T + b - Y||^2 + lambda ||W - W_per_head||^2,  lambda = ridge x trace(F^T F) / width,
  a map of the whole concatenation (it may mix heads), solved from the Gram matrix accumulated in float64. The
  full map has hidden x (hidden + 1) unknowns: with a few thousand calibration tokens it overfits (measured on
  SmolLM2: held-out perplexity 82 against the per-head maps' 62, docs/results.md section 11.2), hence the
  shrinkage and the held-out choice.
- (b) attention transfer (LoLCATs, Zhang et al., ICLR 2025, section 3.1 "attention transfer"): each converted
  layer's attention weights (q_proj, the shared k_proj, v_proj where it exists, o_proj, biases) trained with Adam
  to minimise the normalised MSE ||y' - y||^2 / ||y||^2 between its output and the source layer's, on the
  source's hidden states. Every `eval_steps` steps the layer's error on the validation tokens is measured and the
  best state so far is kept (early stopping: with a few tens of thousands of calibration tokens, the later epochs
  fit the calibration text, not the layer), and the trained layer replaces the layer as it was only if it is better
  there. Training the shared projection is the only way to carry value information outside the key's subspace. The batch of step s of layer l is a pure function of (seed, l, s) and the learning rate of s,
  so a run resumed from a saved step reproduces the uninterrupted one exactly.
- (c) end-to-end distillation against the source's logits: `qkvshare train --teacher` (the same loop, resume,
  checkpoints and DDP), run on the converted model by `qkvshare.convert.pipeline` (`qkvshare.train.distill`).
Head pooling (GQA-g, MQA, Q-GQA-g, Q-MQA) and Q=K layers take the same stages: their init is the mean-pooled or
key-as-query copy, and (a)/(b) fit what pooling or the symmetric score lost.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers.utils import logging

from qkvshare.convert.calibration import causal_mask, o_proj_input
from qkvshare.convert.weights import fit_head_maps, fold_into_o_proj
from qkvshare.runtime import MEMORY_SHARE, available_bytes, write_whole
from qkvshare.train.schedule import get_lr
from qkvshare_settings.convert import DEFAULT_RIDGE, DEFAULT_TRANSFER_RIDGE

logger = logging.get_logger(__name__)

STAGES = ("init", "closed_form", "transfer")  # the in-memory stages; "distill" follows on the command line
ERRORS_FILE = "errors.json"
PROGRESS_FILE = "in-progress.safetensors"  # stage (b)'s layer in progress
OLD_PROGRESS_FILE = "in-progress.pt"
PROGRESS_NUMBERS = ("layer", "step", "best_step", "best_error")  # kept as JSON beside the progress file's tensors


@dataclass
class TransferSettings:
    """How stages (a) and (b) run (the command's flags of the same names)."""

    closed_form: bool = True  # stage (a)
    ridge: float = DEFAULT_TRANSFER_RIDGE  # relative ridge of the o_proj fit
    steps: int = 100  # stage (b): Adam steps per layer (0: no stage (b))
    batch_size: int = 2  # sequences per step
    learning_rate: float = 1e-3  # peak, cosine down to a tenth after `warmup_steps`
    warmup_steps: int = 10
    save_steps: int = 50  # stage (b) saves the layer in progress every this many steps
    eval_steps: int = 25  # stage (b) measures the layer's validation error every this many steps, keeps the best
    seed: int = 0


@dataclass
class Activations:
    """The source's attention inputs and outputs on a set of token blocks, every layer, float32."""

    inputs: list[torch.Tensor]  # per layer (n, T, hidden): input_layernorm(h), what attention receives
    outputs: list[torch.Tensor]  # per layer (n, T, hidden): the attention block's output (after o_proj)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (1, T, D)
    mask: torch.Tensor  # additive causal mask (1, 1, T, T)

    @property
    def blocks(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def tokens(self) -> int:
        return self.inputs[0].shape[0] * self.inputs[0].shape[1]


@torch.no_grad()
def source_activations(source: Any, ids: torch.Tensor, batch_size: int = 4) -> Activations:
    """Run the source on `ids` (n, T) in batches; keep every layer's attention input and output (float32).

    Each layer's tensors are allocated whole before the first batch and filled in place: the memory held is
    `activation_bytes` and no more (collecting per-batch pieces and concatenating them held about twice that at its
    peak, as the allocator kept the freed pieces)."""
    layers = source.model.layers
    n, length = ids.shape
    hidden = source.config.hidden_size
    inputs = [torch.empty(n, length, hidden) for _ in layers]
    outputs = [torch.empty(n, length, hidden) for _ in layers]
    rope: list[Any] = []
    at = [0]

    def before(i: int) -> Callable:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            inputs[i][at[0] : at[0] + x.shape[0]] = x
            rope[:] = [kwargs.get("position_embeddings")]

        return hook

    def after(i: int) -> Callable:
        def hook(module: Any, args: tuple, output: Any) -> None:
            y = output[0] if isinstance(output, tuple) else output
            outputs[i][at[0] : at[0] + y.shape[0]] = y

        return hook

    handles = [layer.self_attn.register_forward_pre_hook(before(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles += [layer.self_attn.register_forward_hook(after(i)) for i, layer in enumerate(layers)]
    try:
        for start in range(0, n, batch_size):
            at[0] = start
            source.model(input_ids=ids[start : start + batch_size], use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    cos, sin = (t[:1].float() for t in rope[0])
    return Activations(inputs, outputs, (cos, sin), causal_mask(length, torch.float32))


def activation_bytes(config: Any, tokens: int) -> int:
    """Bytes `source_activations` holds for `tokens` tokens: every layer's attention input and output, float32."""
    return tokens * config.num_hidden_layers * config.hidden_size * 2 * 4


def check_activation_memory(config: Any, calibration_tokens: int, validation_tokens: int) -> None:
    """A `ValueError` before any work when stages (a)/(b)'s stored activations would not fit in memory."""
    need = activation_bytes(config, calibration_tokens + validation_tokens)
    free = available_bytes()
    if free is not None and need > MEMORY_SHARE * free:
        raise ValueError(
            f"--calibration_tokens {calibration_tokens} and --validation_tokens {validation_tokens} make the transfer "
            f"stages hold the source's attention inputs and outputs of every layer in float32: {need / 2**30:.1f} GiB "
            f"for this model ({config.num_hidden_layers} layers x hidden {config.hidden_size} x 8 bytes a token), "
            f"more than {MEMORY_SHARE:.0%} of the {free / 2**30:.1f} GiB of memory available now. Lower --calibration_tokens (at most "
            f"about {max(0, int(MEMORY_SHARE * free / activation_bytes(config, 1)) - validation_tokens)} here) or free memory."
        )


def attention_output(module: Any, acts: Activations, layer: int, index: Any = slice(None)) -> torch.Tensor:
    """The converted attention `module`'s output on the source's inputs of `layer` (blocks `index`)."""
    x = acts.inputs[layer][index]
    rope = tuple(t.expand(x.shape[0], -1, -1) for t in acts.rope)
    return module(hidden_states=x, position_embeddings=rope, attention_mask=acts.mask)[0]


@torch.no_grad()
def layer_error(module: Any, acts: Activations, layer: int, batch_size: int = 8) -> float:
    """||y' - y|| / ||y|| over all blocks: the converted layer's output against the source layer's."""
    diff = ref = 0.0
    for start in range(0, acts.blocks, batch_size):
        index = slice(start, start + batch_size)
        y = acts.outputs[layer][index].double()
        diff += float((attention_output(module, acts, layer, index).double() - y).pow(2).sum())
        ref += float(y.pow(2).sum())
    return math.sqrt(diff / max(ref, 1e-30))


def changed_layers(config: Any, source_kv_heads: int) -> list[int]:
    """The layers whose attention a conversion to `config` changes: tied, Q=K or with pooled key/value heads."""
    pooled = config.num_key_value_heads < source_kv_heads
    return [i for i in range(config.num_hidden_layers) if pooled or config.layer_sharing(i) != "none"]


@torch.no_grad()
def measure_layer_errors(source: Any, model: Any, ids: torch.Tensor, batch_size: int = 4) -> list[float]:
    """Every layer's error (`layer_error`) of the converted `model` on the source's hidden states over `ids`."""
    acts = source_activations(source, ids, batch_size)
    return [layer_error(layer.self_attn, acts, i) for i, layer in enumerate(model.model.layers)]


@torch.no_grad()
def closed_form_fits(
    module: Any, source_attention: Any, acts: Activations, layer: int, ridge: float, batch_size: int = 8
) -> dict[str, dict[str, torch.Tensor]]:
    """Stage (a)'s two candidate o_proj weights for the converted attention `module` (state dicts of its o_proj):

    - "per_head": the calibrated method's per-head maps M_h (`fit_head_maps`, ridge `DEFAULT_RIDGE`) from the
      converted layer's head outputs to the source layer's (what the source's o_proj receives), on the source's
      hidden states, folded into o_proj;
    - "full": the whole o_proj refitted in output space (module docstring), shrunk toward "per_head":
      W = argmin ||F W^T + b - Y||^2 + lambda ||W - W_per_head||^2, lambda = ridge x mean diag(F^T F). With few
      calibration tokens this map of every head at once overfits where per-head maps do not; the shrinkage
      bounds the step away from them, and `run_stages` keeps whichever candidate is best on held-out tokens.
    """
    o_proj = module.o_proj
    intercept = o_proj.bias is not None
    width = o_proj.in_features + int(intercept)
    gram = torch.zeros(width, width, dtype=torch.float64)
    cross = torch.zeros(width, o_proj.out_features, dtype=torch.float64)
    features, head_targets = [], []
    for start in range(0, acts.blocks, batch_size):
        x = acts.inputs[layer][start : start + batch_size]
        rope = tuple(t.expand(x.shape[0], -1, -1) for t in acts.rope)
        f = o_proj_input(module, x, rope, acts.mask)
        features.append(f)
        head_targets.append(o_proj_input(source_attention, x.to(source_attention.o_proj.weight.dtype), rope, acts.mask))
        f = f.double()
        if intercept:
            f = torch.cat([f, f.new_ones(f.shape[0], 1)], dim=1)
        gram += f.T @ f
        cross += f.T @ acts.outputs[layer][start : start + batch_size].reshape(-1, o_proj.out_features).double()
    per_head = copy.deepcopy(o_proj)
    heads = module.config.num_attention_heads
    maps = fit_head_maps(torch.cat(features), torch.cat(head_targets).float(), heads, DEFAULT_RIDGE, intercept)
    fold_into_o_proj(per_head, maps)
    prior = per_head.weight.double().T
    if intercept:
        prior = torch.cat([prior, per_head.bias.double()[None]], dim=0)
    lam = ridge * gram.diagonal().mean()
    solution = torch.linalg.solve(gram + lam * torch.eye(width, dtype=gram.dtype), cross + lam * prior)
    full = {"weight": solution[: o_proj.in_features].T.to(o_proj.weight.dtype).contiguous()}
    if intercept:
        full["bias"] = solution[-1].to(o_proj.bias.dtype)
    return {"per_head": {k: v.clone() for k, v in per_head.state_dict().items()}, "full": full}


def batch_indices(blocks: int, batch_size: int, seed: int, layer: int, step: int) -> torch.Tensor:
    """The blocks of step `step` of layer `layer`: consecutive slices of a seeded permutation per epoch, so the
    order is a pure function of its arguments (an exact resume reads what an uninterrupted run reads)."""
    per_epoch = max(1, blocks // batch_size)
    epoch, position = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer * 10_007 + epoch)
    order = torch.randperm(blocks, generator=generator)
    return order[position * batch_size : (position + 1) * batch_size]


def normalised_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||y' - y||^2 / ||y||^2 of a batch (stage (b)'s loss)."""
    return (output - target).pow(2).sum() / target.pow(2).sum().clamp_min(1e-12)


# --------------------------------------------------------------------------------------------------------------
# Saved state: one folder per conversion, every file written whole (temporary name, then os.replace)
# --------------------------------------------------------------------------------------------------------------
class StageFiles:
    """Where stages (a) and (b) keep their results inside a conversion's work folder (None: nothing saved)."""

    def __init__(self, root: Path | None):
        self.root = root
        if root is not None:
            for stage in ("closed_form", "transfer"):
                (root / stage).mkdir(parents=True, exist_ok=True)
            # pickled by earlier versions, never read: that layer's stage (b) starts again
            (root / "transfer" / OLD_PROGRESS_FILE).unlink(missing_ok=True)

    def layer_file(self, stage: str, layer: int) -> Path | None:
        return None if self.root is None else self.root / stage / f"layer-{layer:03d}.safetensors"

    def load_layer(self, stage: str, layer: int, module: Any) -> bool:
        """Load a finished layer of `stage` into `module`; False when there is none."""
        path = self.layer_file(stage, layer)
        if path is None or not path.is_file():
            return False
        module.load_state_dict(load_file(path), strict=True)
        return True

    def save_layer(self, stage: str, layer: int, module: Any) -> None:
        path = self.layer_file(stage, layer)
        if path is not None:
            state = {k: v.detach().contiguous().clone() for k, v in module.state_dict().items()}
            write_whole(path, lambda p: save_file(state, str(p)))

    @property
    def progress_file(self) -> Path | None:
        return None if self.root is None else self.root / "transfer" / PROGRESS_FILE

    def load_progress(self, layer: int) -> dict[str, Any] | None:
        """Stage (b)'s saved state of `layer` (None without one, or when it is another layer's)."""
        path = self.progress_file
        if path is None or not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["progress"])
            if meta["layer"] != layer:
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        return unpack_progress(meta, tensors)

    def save_progress(self, state: dict[str, Any]) -> None:
        if self.progress_file is not None:
            meta, tensors = pack_progress(state)
            write_whole(self.progress_file, lambda p: save_file(tensors, str(p), metadata={"progress": meta}))

    def clear_progress(self) -> None:
        if self.progress_file is not None:
            self.progress_file.unlink(missing_ok=True)

    def load_errors(self) -> dict[str, Any]:
        path = None if self.root is None else self.root / ERRORS_FILE
        return json.loads(path.read_text()) if path is not None and path.is_file() else {}

    def save_errors(self, errors: dict[str, Any]) -> None:
        if self.root is not None:
            write_whole(self.root / ERRORS_FILE, lambda p: p.write_text(json.dumps(errors, indent=2)))


def pack_progress(state: dict[str, Any]) -> tuple[str, dict[str, torch.Tensor]]:
    """Stage (b)'s state of a layer in progress as safetensors: the module's and best state's tensors and Adam's
    per-parameter tensors (its moments and step count) by name, the rest (the layer, step counters, the best error,
    Adam's param groups) as JSON metadata."""
    tensors = {f"module.{k}": v for k, v in state["module"].items()}
    tensors |= {f"best.{k}": v for k, v in state["best_state"].items()}
    for index, entry in state["optimizer"]["state"].items():
        tensors |= {f"optimizer.{index}.{key}": value for key, value in entry.items()}
    meta = {k: state[k] for k in PROGRESS_NUMBERS}
    meta["param_groups"] = state["optimizer"]["param_groups"]
    return json.dumps(meta), {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def unpack_progress(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `pack_progress`: the dict `train_layer` saved."""
    part = {"module": {}, "best": {}, "optimizer": {}}
    for name, tensor in tensors.items():
        kind, key = name.split(".", 1)
        part[kind][key] = tensor
    per_param: dict[int, dict[str, Any]] = {}
    for name, value in part["optimizer"].items():
        index, key = name.split(".", 1)
        per_param.setdefault(int(index), {})[key] = value
    optimizer = {"state": per_param, "param_groups": meta["param_groups"]}
    return {k: meta[k] for k in PROGRESS_NUMBERS} | {
        "module": part["module"],
        "optimizer": optimizer,
        "best_state": part["best"],
    }


class StopAfter(Exception):
    """Raised by a test hook to simulate a kill in the middle of a stage."""


@dataclass
class LayerRun:
    """What stage (b) did for one layer: the losses of the steps run now, and the step whose state it kept."""

    losses: list[float]
    best_step: int


def train_layer(
    module: Any,
    acts: Activations,
    layer: int,
    settings: TransferSettings,
    files: StageFiles,
    validation: Activations | None = None,
    bar: Any = None,
    on_step: Callable[[int, int], None] | None = None,
) -> LayerRun:
    """Stage (b) for one layer: Adam on the normalised MSE, resumed from the layer's saved progress if any. With
    `validation`, the layer's error there is measured every `settings.eval_steps` steps and after the last, and the
    module ends holding the best of those states. `on_step(layer, step)` is called after each step (a test hook)."""
    params = [p for p in module.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=settings.learning_rate)
    start, best = 0, {"step": 0, "error": math.inf, "state": None}
    saved = files.load_progress(layer)
    if saved is not None:
        module.load_state_dict(saved["module"], strict=True)
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        best = {"step": saved["best_step"], "error": saved["best_error"], "state": saved["best_state"] or None}
        if bar is not None:
            bar.update(start)

    def checkpoint(done: int) -> None:
        if validation is None:
            return
        module.eval()
        error = layer_error(module, validation, layer)
        module.train()
        if error < best["error"]:
            best.update(step=done, error=error, state=_copy_state(module))

    losses = []
    module.train()
    for step in range(start, settings.steps):
        lr = get_lr(step, peak_lr=settings.learning_rate, warmup_steps=settings.warmup_steps, max_steps=settings.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = batch_indices(acts.blocks, settings.batch_size, settings.seed, layer, step)
        loss = normalised_mse(attention_output(module, acts, layer, index), acts.outputs[layer][index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if (settings.eval_steps and done % settings.eval_steps == 0) or done == settings.steps:
            checkpoint(done)
        if settings.save_steps and done % settings.save_steps == 0 and done < settings.steps:
            files.save_progress(
                {
                    "layer": layer,
                    "step": done,
                    "module": module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "best_step": best["step"],
                    "best_error": best["error"],
                    "best_state": best["state"] or {},
                }
            )
        if bar is not None:
            bar.update(1)
            bar.set_postfix(layer=layer, loss=f"{losses[-1]:.4f}", best=f"{best['error']:.4f}@{best['step']}")
        if on_step is not None:
            on_step(layer, done)
    module.eval()
    for p in params:
        p.requires_grad_(False)
    if best["state"] is not None:
        module.load_state_dict(best["state"], strict=True)
    return LayerRun(losses, best["step"] if best["state"] is not None else settings.steps)


def run_stages(
    source: Any,
    model: Any,
    layers: list[int],
    train_ids: torch.Tensor,
    validation_ids: torch.Tensor,
    settings: TransferSettings,
    work_dir: Path | None = None,
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = True,
    after_stage: Callable[[str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Stages (a) and (b) on the converted `model`'s attention `layers` (in place), fitted on `train_ids` and
    measured on `validation_ids` (both (n, T) blocks of the source's tokens). With `work_dir`, every finished layer
    and stage (b)'s layer in progress are saved there and a rerun continues from them. `after_stage(stage)` is
    called once each stage's errors are measured (the model then holds that stage's result); what it returns (e.g.
    the whole model's KL divergence to the source) joins the stage's entry of the record.

    A stage's result for a layer is kept only when it lowers that layer's validation error (else the layer stays as
    it was, listed under "not_kept"), so no stage makes a layer worse on text it did not fit.

    Returns {"layer_errors": {stage: [error per layer or None]}, "stages": {stage: {tokens, seconds, ...}},
    "not_kept": {stage: [layers]}}, with stage in `STAGES` for the stages these settings run (a work folder may hold
    more: a stage-(a)-only rerun of a finished conversion gives the stage-(a) model); layers not in `layers` have
    None.
    """
    files = StageFiles(work_dir)
    record = files.load_errors() or {"layer_errors": {}, "stages": {}}
    fitted_on = {k: v for k, v in asdict(settings).items() if k not in ("closed_form", "save_steps")}
    fitted_on |= {"layers": layers, "train_ids": list(train_ids.shape), "validation_ids": list(validation_ids.shape)}
    if record.setdefault("settings", fitted_on) != fitted_on:
        changed = [
            f"{k}: {record['settings'].get(k)} then, {v} now"
            for k, v in fitted_on.items()
            if record["settings"].get(k) != v
        ]
        raise ValueError(
            f"the work folder {work_dir} holds stages fitted with other settings ({'; '.join(changed)}); continue "
            "with those settings, or use another (or an empty) work folder."
        )
    count = len(model.model.layers)
    errors = record["layer_errors"]
    attention = [layer.self_attn for layer in model.model.layers]
    for module in attention:
        module.float().eval().requires_grad_(False)
    validation = source_activations(source, validation_ids, settings.batch_size)

    def measure(stage: str) -> None:
        errors[stage] = [layer_error(attention[i], validation, i) if i in layers else None for i in range(count)]
        if after_stage is not None:
            record["stages"].setdefault(stage, {}).update(after_stage(stage))
        files.save_errors(record)

    def keep_best(stage: str, i: int, candidates: dict[str, dict[str, torch.Tensor]], module: Any) -> None:
        """Load into `module` the candidate state with the lowest error on the validation tokens (a fit that
        overfits its calibration text loses to the layer as it was); record the choice; save the layer."""
        scores = {}
        for name, state in candidates.items():
            module.load_state_dict(state, strict=True)
            scores[name] = layer_error(attention[i], validation, i)
        best = min(scores, key=lambda name: (scores[name], name != "unchanged"))
        module.load_state_dict(candidates[best], strict=True)
        record.setdefault("choices", {}).setdefault(stage, {})[str(i)] = best
        if best == "unchanged":
            record.setdefault("not_kept", {}).setdefault(stage, []).append(i)
        files.save_errors(record)
        files.save_layer(stage, i, attention[i])

    forget_lost_layers(files, record, layers)
    if "init" not in errors:
        measure("init")
    need_train = (settings.closed_form and "closed_form" not in errors) or (
        settings.steps > 0 and "transfer" not in errors
    )
    train = source_activations(source, train_ids, settings.batch_size) if need_train else None

    if settings.closed_form:
        started = time.perf_counter()
        for i in tqdm(layers, desc="closed form", disable=not progress, leave=False):
            if not files.load_layer("closed_form", i, attention[i]):
                fits = closed_form_fits(attention[i], source.model.layers[i].self_attn, train, i, settings.ridge)
                keep_best("closed_form", i, {"unchanged": _copy_state(attention[i].o_proj)} | fits, attention[i].o_proj)
        if "closed_form" not in errors:
            record["stages"]["closed_form"] = {
                "calibration_tokens": int(train.tokens),
                "ridge": settings.ridge,
                "seconds": round(time.perf_counter() - started, 2),
            }
            measure("closed_form")

    if settings.steps > 0:
        bar = tqdm(total=len(layers) * settings.steps, desc="attention transfer", disable=not progress)
        so_far = record["stages"].setdefault("transfer", {})  # filled as layers finish; completed below
        final_losses, best_steps = so_far.setdefault("final_loss", {}), so_far.setdefault("best_step", {})
        layer_seconds = so_far.setdefault("layer_seconds", {})  # kept over resumed runs (a layer's resumed part)
        for i in layers:
            if files.load_layer("transfer", i, attention[i]):
                bar.update(settings.steps)
                continue
            layer_started = time.perf_counter()
            before = _copy_state(attention[i])
            run = train_layer(attention[i], train, i, settings, files, validation, bar, on_step)
            keep_best("transfer", i, {"unchanged": before, "trained": _copy_state(attention[i])}, attention[i])
            files.clear_progress()
            if run.losses:
                final_losses[str(i)] = run.losses[-1]
            best_steps[str(i)] = run.best_step
            layer_seconds[str(i)] = round(time.perf_counter() - layer_started, 2)
            files.save_errors(record)
        bar.close()
        if "transfer" not in errors:
            tokens = settings.steps * settings.batch_size * train.inputs[0].shape[1]
            record["stages"]["transfer"] = asdict(settings) | {
                "calibration_tokens": int(train.tokens),
                "tokens_per_layer": tokens,
                # the layers' own times summed: a conversion resumed in this stage counts each layer's work once
                "seconds": round(sum(layer_seconds.values()), 2),
                "final_loss": final_losses,
                "best_step": best_steps,
                "layer_seconds": layer_seconds,
            }
            measure("transfer")
    run = [stage for stage, on in zip(STAGES, (True, settings.closed_form, settings.steps > 0)) if on]
    return record | {
        "layer_errors": {stage: errors[stage] for stage in run},
        "stages": {s: record["stages"][s] for s in run if s in record["stages"]},
    }


def forget_lost_layers(files: StageFiles, record: dict[str, Any], layers: list[int]) -> None:
    """A stage the work folder's record holds as finished but whose saved layers are not all there (deleted by
    hand, or a folder copied in part) is fitted again for those layers and measured again, with a warning naming
    them, instead of being taken as done with nothing to load."""
    if files.root is None:
        return
    for stage in ("closed_form", "transfer"):
        lost = [i for i in layers if not files.layer_file(stage, i).is_file()]
        if stage not in record["layer_errors"] or not lost:
            continue
        logger.warning(
            f"the work folder {files.root} holds stage {stage!r} as finished but not the saved layers {lost}: "
            "they are fitted again."
        )
        record["layer_errors"].pop(stage)
        choices = record.get("choices", {}).get(stage, {})
        for i in lost:
            choices.pop(str(i), None)
        if stage in record.get("not_kept", {}):
            record["not_kept"][stage] = [i for i in record["not_kept"][stage] if i not in lost]


def _copy_state(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
