"""Pretraining and distillation of QKVShare models with Accelerate (`qkvshare train`; `accelerate launch -m
qkvshare_cli train`).

The settings and YAML recipes are `qkvshare_settings.train` (`Arguments`, parsed and checked without torch); the
Python API is `train(args)`, which returns the final metrics, and `distill(...)`, a student trained on a teacher's
next-token distributions (what `train --teacher` and `qkvshare convert`'s stage (c) run).
Modules: `data` (corpora and packing), `tokenizer` (BPE training), `schedule` (warmup + cosine LR), `checkpoint`
(atomic save, verification, output-dir lock), `ranks` (decisions all ranks agree on), `model` (config and MFU
arithmetic, the model flags' checks that need transformers), `pretrain` (the loop).
Nothing here is imported by the model files.
"""

from qkvshare_settings.train import Arguments, DataArguments, ModelArguments, TrainArguments, parse_args

from .pretrain import TrainingDiverged, TrainingInterrupted, train

__all__ = [
    "Arguments",
    "ModelArguments",
    "DataArguments",
    "TrainArguments",
    "parse_args",
    "train",
    "TrainingDiverged",
    "TrainingInterrupted",
]
