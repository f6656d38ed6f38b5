"""The text a conversion fits, validates and distils on: the mix `--calibration_text` names, by split.

Sources (`qkvshare_settings.convert.TEXT_SOURCES`), each an equal share of the characters of every split unless
weighted (`self+stdlib:2`: a third and two thirds; `data.interleave`):
- `self`: text the source model writes itself (`self_text`): generated once the source is loaded, kept in
  `--self_text_dir` or the conversion's work folder, so a killed conversion resumes it and a later one reuses it;
- `stdlib`: the Python standard library's prose and code (`data`), train and validation splits (its test split is
  read by no stage);
- `file`: the user's `--calibration_file` or `--calibration_dataset` (`calibration.calibration_texts`).
The text a source gives is read lazily; `self` needs the model, so a mix is read in two steps: the other sources
first (their problems are found before the source's weights are loaded), `add_self_text` once it is loaded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qkvshare.convert import data
from qkvshare.convert.calibration import calibration_texts
from qkvshare.convert.self_text import (
    SelfText,
    SelfTextSettings,
    folder_settings,
    generate_self_text,
    room_for_new_tokens,
)
from qkvshare.runtime import native_bf16
from qkvshare_settings.convert import ConvertArgs, text_shares

SPLITS = ("train", "validation")
# The self text holds more than its share of the stages' tokens: documents are cut where the blocks end, and chat
# documents re-tokenized from their text differ slightly from the generated ids.
SELF_TEXT_MARGIN = 1.1
MIN_NEW_TOKENS = 16  # the shortest samples worth writing (a source with fewer positions to spare is refused)


@dataclass
class CalibrationText:
    """The documents of each split of a mix of sources, and what they are (the record's `calibration_source`)."""

    shares: dict[str, float]  # each source's share of the characters, in the order of --calibration_text
    seed: int
    file: str | None = None
    dataset: str | None = None
    self_text: SelfText | None = None  # once `add_self_text` has run
    _described: dict[str, str] = field(default_factory=dict)

    @property
    def sources(self) -> list[str]:
        return list(self.shares)

    def _side(self, name: str, split: str) -> Iterable[str]:
        if name == "self":
            if self.self_text is None:
                raise RuntimeError("the self text is not generated yet: call add_self_text once the source is loaded")
            return self.self_text.documents(split)
        if name == "stdlib":
            return data.documents("mixed", split, self.seed)
        documents, _ = calibration_texts(self.file, self.seed, split, self.dataset)
        return documents

    def documents(self, split: str) -> Iterator[str]:
        """The documents of `split` ("train" to fit and distil, "validation" to measure), sources interleaved."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: the calibration text has the splits {', '.join(SPLITS)}.")
        return data.interleave({n: self._side(n, split) for n in self.shares}, self.shares)

    def describe(self, split: str) -> str:
        """What the text of `split` is, source by source."""
        parts = []
        for name in self.sources:
            if name == "self":
                parts.append(self.self_text.describe(split) if self.self_text is not None else "the source's own text")
            elif name == "stdlib":
                parts.append(data.describe(split, self.seed))
            else:
                parts.append(calibration_texts(self.file, self.seed, split, self.dataset)[1])
        if len(parts) == 1:
            return parts[0]
        if len(set(self.shares.values())) == 1:
            return f"equal shares of {len(parts)} sources: " + "; ".join(parts)
        return "; ".join(f"{share:.0%} {part}" for share, part in zip(self.shares.values(), parts, strict=True))


def read_calibration_text(args: ConvertArgs) -> CalibrationText:
    """The mix of `args.calibration_text`, with a user's file or dataset checked now (a `ValueError` naming it);
    `self` is added by `add_self_text` once the source is loaded."""
    text = CalibrationText(text_shares(args), args.seed, args.calibration_file, args.calibration_dataset)
    if "file" in text.sources:
        calibration_texts(args.calibration_file, args.seed, "train", args.calibration_dataset)  # checks the file
    return text


def self_text_bf16(args: ConvertArgs, folder: Path, device: str = "cpu") -> bool:
    """Whether the source writes its text with a bf16 copy of its weights: `--self_text_bf16` as given, else (None)
    as the text already in `folder` was written (a folder from before the setting: float32), else where `device`
    (the source's) computes bf16 natively (`runtime.native_bf16`: 1.45x as fast on a CPU with AVX512-BF16 and AMX,
    docs/results.md section 11.3). The choice is printed."""
    if args.self_text_bf16 is not None:
        return args.self_text_bf16
    held = folder_settings(folder)
    if held is not None:
        bf16, why = bool(held["bf16"]), f"as the text in {folder} was started (another --self_text_dir to choose again)"
    else:
        bf16, why = native_bf16(device)
        why += " (--no-self_text_bf16 for its float32 weights)" if bf16 else " (--self_text_bf16 forces bf16)"
    how = "a bf16 copy of its weights" if bf16 else "its float32 weights"
    print(f"qkvshare convert: the source writes its text with {how}: {why}.", flush=True)
    return bf16


def self_text_settings(args: ConvertArgs, model: Any, tokenizer: Any, bf16: bool = False) -> SelfTextSettings:
    """How the source writes its text for this conversion: the defaults, with the conversion's seed, a validation
    share as large as the validation tokens are of what the stages read (so the split holds enough of them), samples
    no longer than the source's positions allow after its longest prompt, and `bf16` (`self_text_bf16`). A source
    with too few positions for that is refused, naming the other texts."""
    needed = args.calibration_tokens + args.validation_tokens
    validation_fraction = min(0.5, max(0.05, args.validation_tokens / needed))
    base = SelfTextSettings(seed=args.seed, validation_fraction=validation_fraction, bf16=bf16)
    room = room_for_new_tokens(model, tokenizer, base)
    if room is None or room >= base.max_new_tokens:
        return base
    if room < MIN_NEW_TOKENS:
        raise ValueError(
            f"the source has {model.config.max_position_embeddings} positions, which leave {max(room, 0)} tokens after "
            "the longest built-in prompt: too few for it to write its own calibration text; use --calibration_text "
            "stdlib or file."
        )
    return dataclasses.replace(base, max_new_tokens=room)


def self_text_tokens(args: ConvertArgs) -> int:
    """The tokens the source writes: `--self_text_tokens`, or its share of every token the stages read: calibration
    and validation, and stage (c)'s `--distill_tokens` for a transfer conversion (with `SELF_TEXT_MARGIN`). Without
    the distillation's share, stage (c) would read the other sources only once the self text ran out (with the
    defaults, 93% of its tokens)."""
    if args.self_text_tokens is not None:
        return args.self_text_tokens
    read = args.calibration_tokens + args.validation_tokens
    if args.method == "transfer":
        read += args.distill_tokens
    return math.ceil(read * text_shares(args).get("self", 0.0) * SELF_TEXT_MARGIN)


def add_self_text(text: CalibrationText, args: ConvertArgs, model: Any, tokenizer: Any, folder: Path) -> None:
    """Generate (or read back from `folder`) the source's own text for `text`'s `self` share: refused before any
    generation when it would not fit the memory or the disk (`self_text.estimate_self_text`), shown with a progress
    bar and its tokens/s, resumable shard by shard."""
    if "self" in text.sources:
        device = next(model.parameters()).device.type
        settings = self_text_settings(args, model, tokenizer, self_text_bf16(args, folder, device))
        text.self_text = generate_self_text(model, tokenizer, settings, folder, self_text_tokens(args))
