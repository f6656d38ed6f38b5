"""`qkvshare convert --cache_budget F`: tie only as many layers as a KV-cache budget needs, the easiest ones.

A tied layer caches one tensor instead of two, so with the source's key/value heads it holds half the bytes of
its untied self. Given F, the fraction of the source's KV-cache bytes to keep, the conversion ties the layers
that cost least (by default the whole model's KL divergence to the source with that layer alone tied, measured on
the validation tokens; or stage (b)'s error of the layer, `budget_choice="error"`) until the bytes per token are at
most F x the source's, and keeps every other layer exactly as the source has it (`layer_projection_sharing`
mixes the modes per layer). F = 1 keeps the source; F = 0.5 ties every layer of a K=V variant.

Only variants that keep the source's key/value heads take a budget: an untied layer of a pooled variant (Q-MQA)
would still be pooled, not the source's, and would need a conversion of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkvshare.configuration_qkvshare import kv_cache_bytes_per_layer, kv_cache_bytes_per_token


@dataclass
class BudgetChoice:
    """Which layers a budget ties and what the cache then holds (16-bit bytes per token)."""

    budget: float
    tied_layers: list[int]
    layer_projection_sharing: list[str]
    kv_bytes_per_token: int
    source_kv_bytes_per_token: int

    @property
    def fraction(self) -> float:
        return self.kv_bytes_per_token / self.source_kv_bytes_per_token


def check_cache_budget(config: Any, method: str | None, source_kv_heads: int, budget: float | None) -> float | None:
    """The smallest fraction `config` (every layer converted) reaches, None without a budget; a `ValueError` when
    `budget` cannot be met, the variant cannot take a budget or the method is not `transfer`. Called before any
    weight is read."""
    if budget is None:
        return None
    if method != "transfer":
        raise ValueError("cache_budget chooses layers from the errors of the transfer stages: use method='transfer'.")
    if not 0 < budget <= 1:
        raise ValueError(f"--cache_budget {budget} must be in (0, 1]: the fraction of the source's KV bytes to keep.")
    if config.num_key_value_heads != source_kv_heads:
        raise ValueError(
            f"--cache_budget keeps untied layers as the source has them, but variant {config.variant} pools the "
            f"source's {source_kv_heads} key/value heads into {config.num_key_value_heads}, so its untied layers would "
            "not be the source's. Use a variant that keeps the heads (Q-K=V), or leave --cache_budget out."
        )
    layers = range(config.num_hidden_layers)
    if not any(config.is_kv_tied(i) for i in layers):
        raise ValueError(
            f"--cache_budget chooses which layers to tie, but variant {config.variant} ties no key to its value; "
            "use a K=V variant (Q-K=V, Q=K=V) or leave --cache_budget out."
        )
    source_bytes = kv_cache_bytes_per_token(config, tied=False)
    smallest = kv_cache_bytes_per_token(config) / source_bytes
    if budget < smallest:
        raise ValueError(
            f"--cache_budget {budget} is below what {config.variant} reaches with every layer tied "
            f"({smallest:.4g} of the source's KV bytes); choose {smallest:.4g} or more, or a variant with fewer "
            "key/value heads (Q-MQA, Q-GQA-<g>) without a budget."
        )
    return smallest


def choose_tied_layers(config: Any, scores: list[float | None], budget: float) -> BudgetChoice:
    """Tie the layers of lowest score until the cache holds at most `budget` x the source's bytes per token.

    `config` is the fully converted config (every layer in its variant's mode), `scores` one measured cost of tying
    per layer (stage (b)'s error, or the whole model's KL with that layer alone tied; a layer without one is tied
    last). Ties between equal scores go to the lower layer index."""
    count = config.num_hidden_layers
    untied, tied_bytes = kv_cache_bytes_per_layer(config, tied=False), kv_cache_bytes_per_layer(config)
    source_bytes = sum(untied)
    order = sorted(range(count), key=lambda i: (scores[i] is None, scores[i] if scores[i] is not None else 0.0, i))
    total, tied = source_bytes, []
    for i in order:
        if total <= budget * source_bytes:
            break
        total -= untied[i] - tied_bytes[i]
        tied.append(i)
    return tie_layers(config, tied, budget)


def every_layer_needed(config: Any, layers: list[int], budget: float) -> BudgetChoice | None:
    """The choice tying every one of `layers` when the budget cannot leave any of them untied (nothing to rank,
    so no layer need be measured), else None."""
    untied, tied_bytes = kv_cache_bytes_per_layer(config, tied=False), kv_cache_bytes_per_layer(config)
    every = tie_layers(config, layers, budget)
    smallest_saving = min((untied[i] - tied_bytes[i] for i in layers), default=0)  # the cheapest to leave untied
    return every if every.kv_bytes_per_token + smallest_saving > budget * sum(untied) else None


def keeps_untied_layers(config: Any, layers: list[int], budget: float | None) -> bool:
    """Whether `budget` (None: no budget) can leave some of the converted `layers` as the source has them, known
    before any layer is ranked."""
    return budget is not None and every_layer_needed(config, layers, budget) is None


def tie_layers(config: Any, tied: list[int], budget: float = 1.0) -> BudgetChoice:
    """The choice that ties exactly `tied` (in `config`'s mode for each) and keeps every other layer the source's."""
    untied, tied_bytes = kv_cache_bytes_per_layer(config, tied=False), kv_cache_bytes_per_layer(config)
    total = sum(tied_bytes[i] if i in tied else untied[i] for i in range(config.num_hidden_layers))
    modes = [config.layer_sharing(i) if i in tied else "none" for i in range(config.num_hidden_layers)]
    return BudgetChoice(budget, sorted(tied), modes, total, sum(untied))
