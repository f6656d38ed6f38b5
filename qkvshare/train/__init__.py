"""Pretraining of QKVShare models with Accelerate (`qkvshare train`, `accelerate launch -m qkvshare.train`).

The flags and YAML recipes are `qkvshare_cli.train` (parsed without torch). Modules: `data` (corpora and
packing), `tokenizer` (BPE training), `schedule` (warmup + cosine LR), `checkpoint` (atomic save, verification,
output-dir lock), `ranks` (decisions all ranks agree on), `model` (config, Llama twin and MFU arithmetic, the
model flags' checks that need transformers), `pretrain` (the entry point and loop).
Nothing here is imported by the model files.
"""

from .pretrain import main, train

__all__ = ["main", "train"]
