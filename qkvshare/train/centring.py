"""Centred output projections (`--centre_output_projections`): AdamW steps on each attention output projection
`y = W x + b` taken as if it were `y = W (x - mu) + c`, with `mu` the mean of its input and `c = b + W mu`.

Why: a layer whose value carries a large constant (a converted Qwen2 layer with key and value tied keeps the key's
biases, up to 150, in its value) gives the output projection an input whose mean dwarfs its spread. The gradient of
`W` is then nearly `g mu^T`, every entry of a row with the sign of `mu`'s, and AdamW's first step (about the learning
rate on every entry) moves the row's output by `lr x sum |mu|` in one coherent direction: on Qwen2.5-Coder-0.5B with
every layer tied, one step took the KL to the source from 3.5 to 10 nats per token (docs/results.md, section 11.3).
Centred, the gradient of `W` is `sum_t delta_t (x_t - mu)^T` and the constant is the bias's to learn.

The parameters stay the model's own (`W` and `b`, saved and loaded as always); only the update differs:
- before the optimizer step, `W.grad -= b.grad mu^T` (the gradient with respect to `W` at fixed `c`; `b.grad` is
  the gradient with respect to `c`);
- after it, `b -= (W_new - W_old) mu`, so that `b` stays `c - W mu` while AdamW's state follows `(W, c)`.
Exact for the step AdamW takes (decoupled weight decay included); gradient clipping before the step sees the
uncentred gradients. The means are measured once, on the run's first validation blocks (the same on every rank), and saved in the run's
output folder, so a resumed run centres on the same `mu`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from qkvshare.runtime import write_whole

MEANS_FILE = "output_projection_means.safetensors"


def output_projections(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The attention output projections (`*.o_proj`) of `model` that have a bias and whose weight and bias train."""
    return {
        name: module
        for name, module in model.named_modules()
        if name.endswith("o_proj")
        and isinstance(module, torch.nn.Linear)
        and module.bias is not None
        and module.weight.requires_grad
        and module.bias.requires_grad
    }


@torch.no_grad()
def measure_means(model: torch.nn.Module, run_forward: Any) -> dict[str, torch.Tensor]:
    """The mean input (over every token) of each of `output_projections(model)`, during `run_forward()`."""
    modules = output_projections(model)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str) -> Any:
        def record(module: Any, args: tuple) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules.items()]
    try:
        run_forward()
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name] / counts[name]).contiguous() for name in modules if name in sums}


class CentredOutputProjections:
    """The optimizer-step hooks that centre the inputs of `model`'s output projections on `means` (module name ->
    mean input): call `before_step()` after the backward pass(es), `after_step()` after `optimizer.step()`."""

    def __init__(self, model: torch.nn.Module, means: dict[str, torch.Tensor]) -> None:
        modules = output_projections(model)
        missing = sorted(set(means) - set(modules))
        if missing:
            raise ValueError(f"centred output projections: no trainable biased o_proj named {', '.join(missing)}")
        self.pairs = [(modules[name], means[name].to(modules[name].weight.device)) for name in sorted(means)]
        self.previous: list[torch.Tensor] = []

    @torch.no_grad()
    def before_step(self) -> None:
        self.previous = []
        for module, mean in self.pairs:
            weight, bias = module.weight, module.bias
            if weight.grad is not None and bias.grad is not None:
                weight.grad.sub_(torch.outer(bias.grad.to(weight.grad.dtype), mean.to(weight.grad.dtype)))
            self.previous.append(weight.detach().clone())

    @torch.no_grad()
    def after_step(self) -> None:
        for (module, mean), before in zip(self.pairs, self.previous, strict=True):
            change = module.weight.detach() - before
            module.bias.sub_((change.double() @ mean.double()).to(module.bias.dtype))
        self.previous = []


def centring(model: torch.nn.Module, folder: Path, run_forward: Any, save: bool = True) -> CentredOutputProjections:
    """The centring of `model`'s output projections on the means saved in `folder` (a resumed run), or measured
    during `run_forward()` (the same input on every rank) and saved there (`save`: by the main process)."""
    path = folder / MEANS_FILE
    if path.is_file():
        means = load_file(path)
    else:
        means = measure_means(model, run_forward)
        if save:
            folder.mkdir(parents=True, exist_ok=True)
            write_whole(path, lambda tmp: save_file({name: mean.cpu() for name, mean in means.items()}, tmp))
    return CentredOutputProjections(model, means)
