"""Pretraining data: corpora, tokenization and packing into full blocks (no padding anywhere).

Design notes
- Three sources: the embedded default corpus (the Python standard library's own `.py` files on the running
  machine, so a fresh install trains with no download), local `.txt` / `.jsonl` / `.parquet` files, and any
  Hugging Face dataset (in memory, or streamed for SlimPajama-sized corpora).
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
  machines and Python patch releases. Documents are deduplicated by content before any split (the embedded one
  and run_clm's percentage split of local or hub data), so no text is on both sides: Debian's stdlib, for one,
  ships two byte-identical `_sysconfigdata_*.py` files under different names.
- `--dataset_name` takes a hub name, a local folder of data files, or a `save_to_disk` folder (`Dataset` or
  `DatasetDict`). Local files are checked before `datasets` reads them (`check_data_file`: UTF-8, no binary
  data, one JSON object per line), so a bad file fails naming its line instead of deep inside Arrow.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkvshare_settings.train import DataArguments, TrainingSetupError

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
def stdlib_files(root: Path | None = None) -> tuple[Path, list[Path]]:
    """The `.py` files under `root` (default: the running interpreter's standard library), sorted; without
    site-packages and the `test` package (its data files include deliberately broken encodings)."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
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


def unique_documents(documents: Iterable[str]) -> tuple[list[str], int]:
    """`documents` without repeats (the first occurrence of each text stays, in order), and how many were dropped."""
    seen: set[str] = set()
    unique, dropped = [], 0
    for text in documents:
        if text in seen:
            dropped += 1
        else:
            seen.add(text)
            unique.append(text)
    return unique, dropped


def _dropped_note(dropped: int) -> str:
    return f", {dropped} duplicate document(s) dropped" if dropped else ""


def stdlib_corpus(validation_percentage: int = 5, root: Path | None = None) -> Corpus:
    """The embedded default corpus: the Python stdlib sources of the running interpreter (or the `.py` files under
    `root`), deduplicated by content, then split by a hash of each file's relative path."""
    name = f"Python {sysconfig.get_python_version()} stdlib" if root is None else "Python"
    root, files = stdlib_files(root)
    first_path: dict[str, str] = {}  # text -> its first file in sorted order, so every machine picks the same side
    dropped = 0
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        if text in first_path:
            dropped += 1
        else:
            first_path[text] = path.relative_to(root).as_posix()
    train, validation = [], []
    for text, rel in first_path.items():
        (validation if is_validation_file(rel, validation_percentage) else train).append(text)
    return Corpus(train, validation, f"{name} sources ({root}{_dropped_note(dropped)})")


def _column(dataset: Any, column: str, where: str) -> list[str]:
    names = dataset.column_names
    if column not in names:
        raise TrainingSetupError(f"{where} has no column {column!r} (columns: {names}); set --text_column.")
    return [text for text in dataset[column] if isinstance(text, str) and text.strip()]


def _split_off_validation(train: list[str], percentage: int) -> tuple[list[str], list[str]]:
    """run_clm's split: the first `percentage`% of documents validate, the rest train."""
    n_val = max(1, len(train) * percentage // 100) if len(train) > 1 else 0
    return train[n_val:], train[:n_val]


def is_saved_dataset(path: str | Path) -> bool:
    """Whether `path` is a `Dataset.save_to_disk` or `DatasetDict.save_to_disk` folder (read with `load_from_disk`)."""
    path = Path(path)
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _load_named_dataset(data: DataArguments, streaming: bool) -> Any:
    """`--dataset_name` as a split -> dataset mapping: a hub name, a local data folder or a `save_to_disk` folder."""
    import datasets

    name = data.dataset_name
    # Local data files are checked before `datasets` reads them; not when streaming, which must not read all first.
    if Path(name).is_dir() and not is_saved_dataset(name) and not streaming:
        for path in sorted(Path(name).rglob("*")):
            hidden = any(part.startswith(".") for part in path.relative_to(name).parts)
            if path.suffix.lower() in LOCAL_BUILDERS and not hidden:
                check_data_file(path, "--dataset_name", data.text_column, require_text=False)  # one file of many
    try:
        if not is_saved_dataset(name):
            return datasets.load_dataset(name, data.dataset_config_name, streaming=streaming)
        saved = datasets.load_from_disk(name)  # a Dataset (one split, used as 'train') or a DatasetDict
    except Exception as err:  # the hub error names the real problem; add what to do about it
        raise TrainingSetupError(
            f"could not {'stream' if streaming else 'load'} dataset {name!r} ({type(err).__name__}: {err}); check "
            "the name and --dataset_config_name, and network access, or use --train_file for local data."
        ) from err
    splits = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
    return {split: ds.to_iterable_dataset() if streaming else ds for split, ds in splits.items()}


def load_corpus(data: DataArguments, rank: int = 0, world_size: int = 1, seed: int = 0) -> Corpus:
    """Load the documents selected by the data arguments. Raises `TrainingSetupError` for a missing, empty or
    unreadable corpus (local files are checked line by line before anything is tokenized)."""
    if data.train_file is None and data.dataset_name is None:
        corpus = stdlib_corpus(data.validation_split_percentage)
    elif data.streaming:
        corpus = _streaming_corpus(data, rank, world_size, seed)
    else:
        import datasets

        if data.train_file is not None:
            files = {"train": data.train_file} | ({"validation": data.validation_file} if data.validation_file else {})
            builder = LOCAL_BUILDERS[Path(data.train_file).suffix.lower()]
            for split, path in files.items():
                if LOCAL_BUILDERS.get(Path(path).suffix.lower()) != builder:
                    raise TrainingSetupError(
                        f"--validation_file {path!r} is not in the format of --train_file {data.train_file!r}; "
                        "give both as text, both as JSON (.json/.jsonl) or both as Parquet."
                    )
                check_data_file(path, f"--{split}_file", data.text_column)
            kwargs = {"sample_by": "paragraph"} if builder == "text" else {}  # blank lines separate text documents
            raw = datasets.load_dataset(builder, data_files=files, **kwargs)
            where = data.train_file
        else:
            raw = _load_named_dataset(data, streaming=False)
            where = f"dataset {data.dataset_name!r}"
        if "train" not in raw:
            raise TrainingSetupError(f"{where} has no 'train' split (splits: {list(raw)}).")
        train = _column(raw["train"], data.text_column, where)
        if "validation" in raw:
            validation = _column(raw["validation"], data.text_column, where)
        else:  # deduplicate first, so no text is on both sides of the split
            train, dropped = unique_documents(train)
            train, validation = _split_off_validation(train, data.validation_split_percentage)
            where += _dropped_note(dropped)
        corpus = Corpus(train, validation, where)
    if not corpus.streaming and not corpus.train:
        raise TrainingSetupError(f"the training corpus ({corpus.description}) has no documents; give a non-empty one.")
    if not corpus.validation:
        raise TrainingSetupError(
            f"the corpus ({corpus.description}) leaves no validation documents; add --validation_file or more documents."
        )
    return corpus


def _streaming_corpus(data: DataArguments, rank: int, world_size: int, seed: int) -> Corpus:
    from datasets.distributed import split_dataset_by_node

    raw = _load_named_dataset(data, streaming=True)
    if "train" not in raw:
        raise TrainingSetupError(f"dataset {data.dataset_name!r} has no 'train' split (splits: {list(raw)}).")
    train = raw["train"]
    n_val = data.streaming_validation_documents
    if "validation" in raw:
        held_out = raw["validation"].take(n_val)
    else:  # the first documents validate; training skips them
        held_out, train = train.take(n_val), train.skip(n_val)
    validation = [text for row in held_out if isinstance(text := row.get(data.text_column), str) and text.strip()]
    held_out_texts = set(validation)  # a document repeated later in the stream must not train too
    train = train.filter(lambda row: row.get(data.text_column) not in held_out_texts)
    train = split_dataset_by_node(train.shuffle(seed=seed, buffer_size=10_000), rank=rank, world_size=world_size)
    return Corpus(train, validation, f"dataset {data.dataset_name!r} (streaming, rank {rank}/{world_size})")


# ----------------------------------------------------------------------------------------------------------------
# Checking local files before they are read
# ----------------------------------------------------------------------------------------------------------------
_JSON_ROW = 'one JSON object per line, such as {"text": "..."}'


def check_data_file(
    path: str | Path,
    flag: str,
    text_column: str | None = "text",
    error: type[ValueError] = TrainingSetupError,
    require_text: bool = True,
) -> None:
    """Check a local data file before `datasets` reads it, so a bad file fails with its name and place, not deep
    inside Arrow. Raises `error` (with `flag`, the file, the line or byte offset, and how to fix it) for:

    - text (`.txt`, `.text`, `.csv`, `.json`, `.jsonl`) that is not UTF-8, or holds NUL bytes (binary data);
    - a JSON-lines line that is not a JSON object, or whose `text_column` is neither a string nor null, or lacks
      `text_column` while other lines have it; a whole-document `.json` file that does not parse;
    - a `.parquet` file without the Parquet magic bytes, or whose `text_column` is missing or not a string column;
    - with `require_text` (the file is a whole split, not one file of a data folder): a text or JSON-lines file
      with no text at all (empty, only whitespace, or no line with a non-empty `text_column`).
    """
    path = Path(path)
    where, suffix = f"{flag} {str(path)!r}", path.suffix.lower()
    has_text = True  # whole-document JSON and Parquet files: judged after loading, by the caller
    if suffix == ".parquet":
        _check_parquet(path, where, text_column, error)
    elif suffix == ".jsonl" or (suffix == ".json" and _first_line_is_object(path, where, error)):
        has_text = _check_json_lines(path, where, text_column, error)
    elif suffix == ".json":
        try:
            json.loads("".join(line for _, line in _utf8_lines(path, where, error)))
        except json.JSONDecodeError as err:
            raise error(
                f"{where} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}). Fix that line, or "
                f"write the file as JSON lines: {_JSON_ROW}."
            ) from None
    else:
        has_text = False
        for _, line in _utf8_lines(path, where, error):  # every line: each is checked for NUL and UTF-8
            has_text = has_text or bool(line.strip())
    if require_text and not has_text:
        what = "no line with a non-empty " + repr(text_column) if suffix in (".json", ".jsonl") else "only whitespace"
        raise error(f"{where} holds no text (the file is empty or has {what}); point it at a file with documents.")


def _utf8_lines(path: Path, where: str, error: type[ValueError]) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file; `error` naming the line and byte offset of a NUL or non-UTF-8 byte."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            nul = raw.find(b"\0")
            if nul >= 0:
                raise error(
                    f"{where} holds a NUL byte at line {number} (byte offset {offset + nul}): binary data, not text. "
                    "Give a UTF-8 text file (a UTF-16 file must be re-encoded, e.g. iconv -f utf-16 -t utf-8)."
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = raw[err.start : err.start + 4]
                raise error(
                    f"{where} is not valid UTF-8 at line {number} (byte offset {offset + err.start}: {bad!r}). "
                    "Re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove the binary data."
                ) from None
            yield number, line
            offset += len(raw)


def _first_line_is_object(path: Path, where: str, error: type[ValueError]) -> bool:
    """Whether a `.json` file is JSON lines (its first non-blank line is a whole JSON object), as `datasets` reads it."""
    first = next((line for _, line in _utf8_lines(path, where, error) if line.strip()), "")
    try:
        return isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        return False


def _check_json_lines(path: Path, where: str, column: str | None, error: type[ValueError]) -> bool:
    """Check every line (see `check_data_file`); False when the file holds no text: no row, or rows whose `column`
    is blank or null. Rows without `column` at all count as text here: the caller names the missing column."""
    missing, present, has_text = None, False, False
    for number, line in _utf8_lines(path, where, error):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise error(
                f"{where} line {number} is not valid JSON ({err.msg}, column {err.colno}); each line must be "
                f"{_JSON_ROW}. Fix or remove that line."
            ) from None
        if not isinstance(row, dict):
            raise error(f"{where} line {number} is a JSON {type(row).__name__}, not an object; write {_JSON_ROW}.")
        if column is None:
            has_text = True
            continue
        if column not in row:
            missing = missing or number
        elif row[column] is not None and not isinstance(row[column], str):
            raise error(
                f"{where} line {number}: {column!r} is a {type(row[column]).__name__}, not a string; documents must "
                "be text (or pass the right --text_column)."
            )
        else:
            present = True
            has_text = has_text or bool(row[column] and row[column].strip())
    if missing and present:
        raise error(
            f"{where} line {missing} has no {column!r} key while other lines have one; give every line its text "
            "(or remove that line)."
        )
    return has_text or bool(missing)


def _check_parquet(path: Path, where: str, column: str | None, error: type[ValueError]) -> None:
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, path.stat().st_size - 4))
        tail = f.read(4)
    if path.stat().st_size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise error(f"{where} is not a Parquet file (no PAR1 magic bytes); give a real .parquet file or rename it.")
    if column is None:
        return
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow's own error says what is broken in the footer
        raise error(
            f"{where} is not a readable Parquet file ({err}); rewrite it, e.g. with Dataset.to_parquet."
        ) from err
    if column not in schema.names:
        raise error(f"{where} has no column {column!r} (columns: {schema.names}); set --text_column.")
    kind = str(schema.field(column).type)
    if kind not in ("string", "large_string", "string_view"):
        raise error(f"{where}: column {column!r} holds {kind}, not text; set --text_column to a string column.")


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

    def __init__(
        self, dataset: Any, tokenizer: Any, text_column: str, block_size: int, per_device_batch: int, accumulation: int
    ):
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
