"""Pretraining data: corpora, tokenization and packing into full blocks (no padding anywhere).

Design notes
- Three sources: the embedded default corpus (the Python standard library's own `.py` files on the running
  machine, so a fresh install trains with no download), local `.txt` / `.jsonl` / `.parquet` files, and any
  Hugging Face dataset by name (in memory, or streamed for SlimPajama-sized corpora).
- Documents are tokenized, each followed by EOS, and concatenated. Block `i` is tokens `[i*T, i*T + T + 1)`:
  consecutive blocks overlap by one token, so the model reads `T` inputs and every token after the first is a
  prediction target exactly once per epoch. The tail shorter than a block is dropped (run_clm does the same).
  Nothing is ever padded, so no padding can leak into the loss (the flaw of the paper's released code).
- In memory, the order of blocks is a pure function of (seed, epoch): sample `c` of the global stream is block
  `perm(seed, c // n)[c % n]`, and optimizer step `s` reads samples `[s * G, (s + 1) * G)` with G the global
  batch. Rank `r` takes a contiguous slice of each micro-batch, so one process with batch 4 sees exactly the
  blocks that two ranks with batch 2 see, and resuming at step `s` reads exactly what an uninterrupted run reads.
- Streaming: each rank reads its own shard (`split_dataset_by_node`) and packs it; resuming skips the blocks
  already consumed (exact, at the cost of re-reading them).
- The embedded corpus' validation split is chosen by a hash of each file's relative path, so it is stable across
  machines and Python patch releases, and disjoint from training by construction.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .args import DataArguments, TrainingSetupError

LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class Corpus:
    """Documents of one run. `train` is a list, or a per-rank `datasets.IterableDataset` when streaming."""

    train: Any
    validation: list[str]
    description: str

    @property
    def streaming(self) -> bool:
        return not isinstance(self.train, list)


# ----------------------------------------------------------------------------------------------------------------
# Corpora
# ----------------------------------------------------------------------------------------------------------------
def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's `.py` files, sorted; without site-packages and the `test` package (its data files
    include deliberately broken encodings)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "__pycache__"} & set(path.parts)
        and path.relative_to(root).parts[0] != "test"
    ]
    return root, sorted(files)


def is_validation_file(relative_path: str, validation_percentage: int) -> bool:
    """Deterministic held-out choice for the embedded corpus: a hash of the relative path, not the file order."""
    digest = hashlib.sha1(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < validation_percentage


def stdlib_corpus(validation_percentage: int = 5) -> Corpus:
    """The embedded default corpus: Python stdlib sources of the running interpreter."""
    root, files = stdlib_files()
    train, validation = [], []
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        rel = path.relative_to(root).as_posix()
        (validation if is_validation_file(rel, validation_percentage) else train).append(text)
    return Corpus(train, validation, f"Python {sysconfig.get_python_version()} stdlib sources ({root})")


def _column(dataset: Any, column: str, where: str) -> list[str]:
    names = dataset.column_names
    if column not in names:
        raise TrainingSetupError(f"{where} has no column {column!r} (columns: {names}); set --text_column.")
    return [text for text in dataset[column] if isinstance(text, str) and text.strip()]


def _split_off_validation(train: list[str], percentage: int) -> tuple[list[str], list[str]]:
    """run_clm's split: the first `percentage`% of documents validate, the rest train."""
    n_val = max(1, len(train) * percentage // 100) if len(train) > 1 else 0
    return train[n_val:], train[:n_val]


def load_corpus(data: DataArguments, rank: int = 0, world_size: int = 1, seed: int = 0) -> Corpus:
    """Load the documents selected by the data arguments. Raises `TrainingSetupError` for a missing or empty corpus."""
    if data.train_file is None and data.dataset_name is None:
        corpus = stdlib_corpus(data.validation_split_percentage)
    elif data.streaming:
        corpus = _streaming_corpus(data, rank, world_size, seed)
    else:
        import datasets

        if data.train_file is not None:
            builder = LOCAL_BUILDERS[Path(data.train_file).suffix]
            files = {"train": data.train_file} | ({"validation": data.validation_file} if data.validation_file else {})
            kwargs = {"sample_by": "paragraph"} if builder == "text" else {}  # blank lines separate text documents
            raw = datasets.load_dataset(builder, data_files=files, **kwargs)
            where = data.train_file
        else:
            try:
                raw = datasets.load_dataset(data.dataset_name, data.dataset_config_name)
            except Exception as err:  # the hub error names the real problem; add what to do about it
                raise TrainingSetupError(
                    f"could not load dataset {data.dataset_name!r} ({type(err).__name__}: {err}); check the name "
                    "and --dataset_config_name, and network access, or use --train_file for local data."
                ) from err
            where = f"dataset {data.dataset_name!r}"
        if "train" not in raw:
            raise TrainingSetupError(f"{where} has no 'train' split (splits: {list(raw)}).")
        train = _column(raw["train"], data.text_column, where)
        if "validation" in raw:
            validation = _column(raw["validation"], data.text_column, where)
        else:
            train, validation = _split_off_validation(train, data.validation_split_percentage)
        corpus = Corpus(train, validation, where)
    if not corpus.streaming and not corpus.train:
        raise TrainingSetupError(f"the training corpus ({corpus.description}) has no documents; give a non-empty one.")
    if not corpus.validation:
        raise TrainingSetupError(
            f"the corpus ({corpus.description}) leaves no validation documents; add --validation_file or more documents."
        )
    return corpus


def _streaming_corpus(data: DataArguments, rank: int, world_size: int, seed: int) -> Corpus:
    import datasets
    from datasets.distributed import split_dataset_by_node

    try:
        raw = datasets.load_dataset(data.dataset_name, data.dataset_config_name, streaming=True)
    except Exception as err:
        raise TrainingSetupError(
            f"could not open dataset {data.dataset_name!r} for streaming ({type(err).__name__}: {err}); check the "
            "name, --dataset_config_name and network access."
        ) from err
    if "train" not in raw:
        raise TrainingSetupError(f"dataset {data.dataset_name!r} has no 'train' split (splits: {list(raw)}).")
    train = raw["train"]
    n_val = data.streaming_validation_documents
    if "validation" in raw:
        held_out = raw["validation"].take(n_val)
    else:  # the first documents validate; training skips them
        held_out, train = train.take(n_val), train.skip(n_val)
    validation = [row[data.text_column] for row in held_out if row.get(data.text_column, "").strip()]
    train = split_dataset_by_node(train.shuffle(seed=seed, buffer_size=10_000), rank=rank, world_size=world_size)
    return Corpus(train, validation, f"dataset {data.dataset_name!r} (streaming, rank {rank}/{world_size})")


# ----------------------------------------------------------------------------------------------------------------
# Tokenization and packing
# ----------------------------------------------------------------------------------------------------------------
def tokenize_documents(tokenizer: Any, documents: list[str], batch_size: int = 1000) -> np.ndarray:
    """Token ids of `documents`, each followed by EOS, concatenated into one int32 array."""
    eos = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        ids = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        for doc in ids:
            pieces.append(np.asarray([*doc, eos], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


class PackedBlocks:
    """Fixed-length blocks over a token array: block `i` is `tokens[i*T : i*T + T + 1]` (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, block_size: int, max_blocks: int | None = None):
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.block_size = block_size
        n = max(0, (len(tokens) - 1) // block_size)
        self.num_blocks = n if max_blocks is None else min(n, max_blocks)

    def __len__(self) -> int:
        return self.num_blocks

    def block(self, i: int) -> torch.Tensor:
        """Block `i`: `T + 1` tokens."""
        start = i * self.block_size
        return self.tokens[start : start + self.block_size + 1]

    def stack(self, indices: list[int]) -> torch.Tensor:
        """Blocks `indices` as a `(len(indices), T + 1)` tensor."""
        return torch.stack([self.block(i) for i in indices])


class BlockSchedule:
    """Which blocks each rank reads at each (step, micro-step): a pure function of the seed and the position."""

    def __init__(
        self, num_blocks: int, seed: int, per_device_batch: int, accumulation: int, world_size: int, rank: int
    ):
        self.num_blocks, self.seed = num_blocks, seed
        self.per_device_batch, self.accumulation = per_device_batch, accumulation
        self.world_size, self.rank = world_size, rank
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        """Blocks per optimizer step over all ranks and micro-steps."""
        return self.per_device_batch * self.accumulation * self.world_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """Order of the blocks in `epoch`: every block exactly once."""
        if epoch not in self._perms:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_blocks, generator=generator)}  # keep one epoch cached
        return self._perms[epoch]

    def sample(self, position: int) -> int:
        """Block index of global sample `position` (counting from the start of training)."""
        epoch, offset = divmod(position, self.num_blocks)
        return int(self.permutation(epoch)[offset])

    def indices(self, step: int, micro: int) -> list[int]:
        """Blocks this rank reads in micro-step `micro` of optimizer step `step`."""
        start = step * self.global_batch + (micro * self.world_size + self.rank) * self.per_device_batch
        return [self.sample(p) for p in range(start, start + self.per_device_batch)]


class InMemoryTrainData:
    """Training batches from packed in-memory blocks, addressed by (step, micro-step)."""

    def __init__(self, blocks: PackedBlocks, schedule: BlockSchedule):
        self.blocks, self.schedule = blocks, schedule

    def batch(self, step: int, micro: int) -> torch.Tensor:
        """`(B, T + 1)` token ids for this rank."""
        return self.blocks.stack(self.schedule.indices(step, micro))


class StreamingTrainData:
    """Training batches packed on the fly from this rank's shard of a streamed dataset.

    Batches must be requested in order; the first request at step `s` skips the blocks of steps `0..s-1`.
    """

    def __init__(self, dataset: Any, tokenizer: Any, text_column: str, block_size: int, per_device_batch: int,
                 accumulation: int):  # fmt: skip
        self.dataset, self.tokenizer, self.text_column = dataset, tokenizer, text_column
        self.block_size, self.per_device_batch, self.accumulation = block_size, per_device_batch, accumulation
        self._blocks: Iterator[torch.Tensor] | None = None
        self._position = 0  # blocks handed out so far

    def _iterate(self) -> Iterator[torch.Tensor]:
        buffer: list[int] = []
        epoch = 0
        while True:
            self.dataset.set_epoch(epoch)
            produced = False
            rows = iter(self.dataset)
            while True:
                texts = [row[self.text_column] for _, row in zip(range(256), rows)]
                if not texts:
                    break
                buffer.extend(tokenize_documents(self.tokenizer, [t for t in texts if t and t.strip()]).tolist())
                while len(buffer) > self.block_size:
                    yield torch.tensor(buffer[: self.block_size + 1])
                    del buffer[: self.block_size]  # keep the last token: it is the next block's first input
                    produced = True
            if not produced and epoch > 0:
                raise RuntimeError("the streamed training shard yields no full block; use a larger dataset.")
            epoch += 1

    def batch(self, step: int, micro: int) -> torch.Tensor:
        position = (step * self.accumulation + micro) * self.per_device_batch
        if self._blocks is None:
            self._blocks = self._iterate()
            for _ in range(position):  # resume: skip what the interrupted run consumed
                next(self._blocks)
            self._position = position
        if position != self._position:
            raise RuntimeError(f"streaming batches must be read in order (expected block {self._position}).")
        self._position += self.per_device_batch
        return torch.stack([next(self._blocks) for _ in range(self.per_device_batch)])


def token_fingerprint(tokens: np.ndarray) -> str:
    """Short hash of a token array (stored in checkpoints to detect a resume on different data)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]
