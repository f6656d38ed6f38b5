"""Calibration and distillation text for `qkvshare convert`: a mixed set of English prose and Python code that
every Python installation already holds, with train / validation / test splits.

Where it comes from (nothing is downloaded, nothing is shipped: the running interpreter's standard library)
- code: the standard library's own `.py` files (what `qkvshare.train.data.stdlib_corpus` reads);
- prose: the Python documentation that ships with the standard library: the Language Reference topics that
  `help()` shows (`pydoc_data.topics`, 79 topics, about 0.47 MB of English) and the docstrings of the standard
  library's modules, classes and functions (those of at least `MIN_DOCSTRING_CHARS` characters: paragraphs, not
  one-liners; about 1.3 MB on Python 3.11).
Licence: both are part of CPython, distributed under the PSF License Agreement (Python 2.0 licence; the
documentation is under the same licence), which allows copying, modifying and redistributing with the notice.
The prose is technical English (how the language and its library behave), not general English: a model meant for
other text should be calibrated on it too (`--calibration_file`, `--calibration_dataset`).

Splits
- A document's split is a pure function of its name (a file's path relative to the standard library, or a
  topic's key): `SPLIT_PERCENTAGES` of a SHA-1 bucket. `test` is exactly the embedded corpus' validation split
  (`qkvshare.train.data.is_validation_file(path, 5)`), so held-out perplexities stay comparable with earlier
  measurements; `validation` is the next 5% (what the conversion stages measure their errors on); `train` the rest
  (what they fit). A file's docstrings are in the file's split, so the prose and the code of one module are never
  on two sides. No conversion stage reads `test`: it is for benchmarks.
- Documents are cut at line boundaries into pieces of at most `MAX_DOCUMENT_CHARS`, so one long module does not
  fill a calibration set; the pieces are shuffled with the seed, and the mixed stream takes from the prose or the
  code side, whichever has given fewer characters so far (half and half by default).
- Everything is lazy: a calibration set of a few thousand tokens reads a few dozen files, not the whole library.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import random
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from qkvshare.train.data import stdlib_files

SPLITS = ("train", "validation", "test")
KINDS = ("code", "prose", "mixed")
# (split, upper end of its SHA-1 bucket in percent): test first, then validation, the rest train
SPLIT_PERCENTAGES = (("test", 5), ("validation", 10), ("train", 100))
MAX_DOCUMENT_CHARS = 4000
MIN_DOCSTRING_CHARS = 200
USER_VALIDATION_EVERY = 10  # of a user's calibration text, every 10th piece is held out for the stage errors
TOPICS_FILE = "pydoc_data/topics.py"  # prose: excluded from the code side
DESCRIPTION = (
    "mixed prose and code of the Python {version} standard library (code: its .py files; prose: the Language "
    "Reference topics of pydoc_data and the library's docstrings; PSF License), {split} split, seed {seed}"
)


def split_of(name: str) -> str:
    """The split of the document called `name` (a relative path or a topic key): a hash, not an order."""
    bucket = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big") % 100
    return next(split for split, upper in SPLIT_PERCENTAGES if bucket < upper)


def pieces(text: str, max_chars: int = MAX_DOCUMENT_CHARS) -> list[str]:
    """`text` cut at line boundaries into pieces of at most `max_chars` (a longer line is a piece of its own)."""
    out, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > max_chars:
            out.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        out.append("".join(current))
    return [piece for piece in out if piece.strip()]


@functools.cache
def _stdlib_sources() -> tuple[Path, list[Path]]:
    """The standard library's .py files, listed once per process (a directory walk of about a thousand files)."""
    return stdlib_files()


def _named_files(split: str) -> list[tuple[str, Path]]:
    """(relative path, path) of the standard library's .py files in `split`, sorted, deduplicated by content."""
    root, files = _stdlib_sources()
    named = [(path.relative_to(root).as_posix(), path) for path in files]
    return [(name, path) for name, path in named if name != TOPICS_FILE and split_of(name) == split]


def docstrings(source: str) -> str:
    """The docstrings of a module's source (module, classes, functions) of at least `MIN_DOCSTRING_CHARS`, in
    source order, separated by blank lines; '' when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
    return "\n\n".join(text for text in found if text and len(text) >= MIN_DOCSTRING_CHARS)


def _shuffled(items: list, seed: int, salt: str) -> list:
    items = list(items)
    random.Random(f"{seed}-{salt}").shuffle(items)
    return items


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def code_documents(split: str, seed: int = 0) -> Iterator[str]:
    """Pieces of the standard library's source files in `split`, files in a seeded order (lazy)."""
    seen: set[str] = set()
    for _, path in _shuffled(_named_files(split), seed, "code"):
        text = _read(path)
        if text.strip() and text not in seen:  # Debian ships byte-identical copies under two names
            seen.add(text)
            yield from _shuffled(pieces(text), seed, str(path.name))


def prose_documents(split: str, seed: int = 0) -> Iterator[str]:
    """Pieces of the Python documentation in `split`: Language Reference topics and module docstrings, the two
    sources interleaved, each in a seeded order (lazy)."""
    from pydoc_data.topics import topics

    topic_texts = [topics[key] for key in sorted(topics) if split_of(f"topic:{key}") == split]
    topic_pieces = (piece for text in _shuffled(topic_texts, seed, "topics") for piece in pieces(text))

    def docstring_pieces() -> Iterator[str]:
        for _, path in _shuffled(_named_files(split), seed, "prose"):
            yield from pieces(docstrings(_read(path)))

    sources = [topic_pieces, docstring_pieces()]
    while sources:
        for source in list(sources):
            piece = next(source, None)
            if piece is None:
                sources.remove(source)
            else:
                yield piece


def interleave(sides: dict[str, Iterable[str]], shares: dict[str, float]) -> Iterator[str]:
    """Documents of several sources interleaved so that about `shares[name]` of the characters come from each:
    each next document comes from the side that is furthest below its share (lazy; a side that runs out leaves the
    others to go on)."""
    streams = {name: iter(side) for name, side in sides.items()}
    given = dict.fromkeys(streams, 0)
    while streams:
        total = sum(given.values()) or 1
        name = min(streams, key=lambda k: (given[k] / total - shares[k], k))
        piece = next(streams[name], None)
        if piece is None:
            del streams[name]
            continue
        given[name] += len(piece)
        yield piece


def mixed_documents(split: str, seed: int = 0, prose_fraction: float = 0.5) -> Iterator[str]:
    """Prose and code pieces of `split` interleaved so that about `prose_fraction` of the characters are prose."""
    if not 0.0 <= prose_fraction <= 1.0:
        raise ValueError(f"prose_fraction={prose_fraction} must be between 0 and 1.")
    sides = {"prose": prose_documents(split, seed), "code": code_documents(split, seed)}
    return interleave(sides, {"prose": prose_fraction, "code": 1.0 - prose_fraction})


def documents(kind: str, split: str, seed: int = 0) -> Iterator[str]:
    """The embedded calibration text of `kind` ("code", "prose" or "mixed") and `split` (lazy)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a kind of embedded text; use one of {', '.join(KINDS)}.")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a split; use one of {', '.join(SPLITS)}.")
    return {"code": code_documents, "prose": prose_documents, "mixed": mixed_documents}[kind](split, seed)


def describe(split: str, seed: int) -> str:
    """What the embedded mixed set of `split` is (the record's `calibration_source`)."""
    return DESCRIPTION.format(version=sysconfig.get_python_version(), split=split, seed=seed)


def split_documents(texts: Iterable[str], split: str) -> list[str]:
    """A user's documents cut into pieces (in order), the pieces of `split`: every `USER_VALIDATION_EVERY`-th
    piece validates (the last one when there are fewer), the rest train, so stage errors are measured on text no
    stage fitted."""
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: a user's calibration text has train and validation splits only.")
    all_pieces = [piece for text in texts for piece in pieces(text)]
    held = {i for i in range(len(all_pieces)) if i % USER_VALIDATION_EVERY == USER_VALIDATION_EVERY - 1}
    if not held and len(all_pieces) > 1:
        held = {len(all_pieces) - 1}
    return [piece for i, piece in enumerate(all_pieces) if (i in held) == (split == "validation")]
