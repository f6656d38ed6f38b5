"""The paper's set anomaly task (appendix A.3.2): in a set of 10 images, 9 of one class and 1 of another, point
at the odd one.

- Items are embedded once by a frozen feature extractor (`extract_features`): any `AutoModel` the user names with
  `--backbone` (a transformers vision model, or a timm checkpoint through transformers' TimmWrapper; pooled output,
  else the mean of the last hidden state), or by default, offline, the preprocessed pixels through a fixed random
  Gaussian projection (seed 0). The paper uses an ImageNet ResNet34 on CIFAR-100 (`--backbone
  microsoft/resnet-34 --dataset cifar100`).
- `SetAnomalyModel`: a linear map of the features into `QKVShareModel`'s blocks, bidirectional and without
  positions, then one logit per item; the loss is cross-entropy over the items of a set (the paper's "one logit
  per image, softmax over the set"). Without "+" the model is permutation-equivariant by construction (permuting
  the items permutes the logits: tested). The "+" variants add the fixed 2D encoding of the attention map, which
  depends on the item order: the "+" set models are not permutation-equivariant (tested too), as in the paper.
- Training sets are drawn per epoch, each training image once as the odd one (the paper's epoch); the test sets
  are fixed (seed 0), each test image once as the odd one, so every variant and seed sees the same test sets.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoImageProcessor, AutoModel

from qkvshare.configuration_qkvshare import QKVShareConfig
from qkvshare.modeling_qkvshare import QKVShareModel

from .data import image_processor

SET_SIZE = 10
PIXELS = "pixels"  # the default feature extractor: pixels through a fixed random projection
TEST_SETS_SEED = 0


class SetAnomalyModel(nn.Module):
    """Frozen-feature sets (B, N, F) -> one logit per item (B, N); `labels` (B,) index the odd item."""

    def __init__(self, config: QKVShareConfig, feature_dim: int):
        super().__init__()
        if config.is_causal or config.position_embedding_type != "none":
            raise ValueError(
                "SetAnomalyModel needs is_causal=False and position_embedding_type='none': sets have no order "
                f"(got is_causal={config.is_causal}, position_embedding_type={config.position_embedding_type!r})."
            )
        self.input_proj = nn.Linear(feature_dim, config.hidden_size)
        self.encoder = QKVShareModel(config, add_token_embeddings=False)
        self.score = nn.Linear(config.hidden_size, 1)

    def forward(
        self, features: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.encoder(inputs_embeds=self.input_proj(features), use_cache=False).last_hidden_state
        logits = self.score(hidden).squeeze(-1)  # (B, N)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return logits, loss


def make_sets(
    labels: torch.Tensor, generator: torch.Generator, set_size: int = SET_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """One set per item, that item the odd one: (indices (N, set_size) into `labels`, odd position (N,)).

    The other set_size - 1 items are distinct items of one other class, drawn uniformly; the odd item's position
    is uniform. Every class needs at least set_size - 1 items and there must be two classes (checked).
    """
    classes = labels.unique().tolist()
    members = {c: (labels == c).nonzero().flatten() for c in classes}
    small = [c for c in classes if len(members[c]) < set_size - 1]
    if len(classes) < 2 or small:
        raise ValueError(
            f"the set task needs at least 2 classes with {set_size - 1} items each; got {len(classes)} classes"
            + (f", and classes {small[:5]} have fewer items" if small else "")
            + " (raise --max_train/--max_test or use another dataset)."
        )
    count = len(labels)
    others = torch.randint(0, len(classes) - 1, (count,), generator=generator)
    positions = torch.randint(0, set_size, (count,), generator=generator)
    sets = torch.empty(count, set_size, dtype=torch.long)
    for i in range(count):
        own = classes.index(int(labels[i]))
        other = classes[int(others[i]) + (int(others[i]) >= own)]  # uniform over the classes except its own
        pool = members[other]
        normal = pool[torch.randperm(len(pool), generator=generator)[: set_size - 1]]
        sets[i] = torch.cat((normal[: positions[i]], torch.tensor([i]), normal[positions[i] :]))
    return sets, positions


@torch.no_grad()
def extract_features(
    images: list, backbone: str, image_size: int, feature_dim: int, batch_size: int = 64
) -> torch.Tensor:
    """(N, F) frozen features of PIL images: `backbone` = "pixels" (the default) or an `AutoModel` name/path."""
    if backbone == PIXELS:
        pixels = image_processor(image_size)(images, return_tensors="pt")["pixel_values"].flatten(1)
        projection = torch.randn(pixels.shape[1], feature_dim, generator=torch.Generator().manual_seed(0))
        return pixels @ projection / pixels.shape[1] ** 0.5  # a fixed Gaussian random projection (seed 0)

    processor = AutoImageProcessor.from_pretrained(backbone)
    model = AutoModel.from_pretrained(backbone).eval()
    features = []
    for begin in range(0, len(images), batch_size):
        inputs = processor(images[begin : begin + batch_size], return_tensors="pt")
        outputs = model(**inputs)
        pooled = getattr(outputs, "pooler_output", None)
        pooled = outputs.last_hidden_state.mean(dim=1) if pooled is None else pooled
        features.append(pooled.flatten(1).float())
    return torch.cat(features)


__all__ = ["SetAnomalyModel", "make_sets", "extract_features", "SET_SIZE", "PIXELS"]
