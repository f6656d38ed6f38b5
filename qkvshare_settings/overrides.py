"""The one `key=value` override syntax of every command (`qkvshare train --config_overrides`, `costs`, `bench`, ...).

    qkvshare train configs/tiny.yaml --config_overrides "kv_tie_point=pre_rope,layer_projection_sharing=[none,kv]"
    qkvshare costs --preset small --override hidden_size=256 num_hidden_layers=4

Design notes
- Items come as one comma-separated string, as several strings (an `nargs` flag), or both: each string is split
  at the commas outside brackets and quotes, so `layer_projection_sharing=[none,kv]` stays one item.
- Values are YAML flow scalars and collections, which also reads JSON: `128`, `true`, `null`, `[none, kv]`,
  `{"rope_theta": 10000}`, `"a,b"`. Two YAML 1.1 surprises are switched off, as YAML 1.2 and JSON have it:
  `1e-5` is a float (PyYAML's 1.1 reading makes it a string) and only `true`/`false` are booleans (not
  `yes`/`no`/`on`/`off`).
- This module checks the syntax only; which keys are valid is the caller's business (the training and analysis
  wrappers ask `QKVShareConfig.check_field_names`). It imports only the standard library and PyYAML, so a
  command's `--help` stays fast.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

EXAMPLE = "'hidden_size=128,layer_projection_sharing=[none,kv]'"
_BOOL_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLOSING = {"[": "]", "{": "}"}  # YAML flow collections


class _ValueLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 / JSON scalars: `1e-5` is a float, only true/false are booleans."""


_ValueLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ValueLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_ValueLoader.add_implicit_resolver(
    _FLOAT_TAG, re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _split_items(text: str, flag: str) -> list[str]:
    """`text` cut at the commas that are outside brackets and quotes; empty pieces dropped."""
    items, start, stack, quote = [], 0, [], None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"" and text[:i].rstrip()[-1:] in ("", "=", "[", "{", ",", ":"):
            quote = char  # a quote opens a quoted scalar only where one can start (YAML), not in "it's"
        elif char in _CLOSING:
            stack.append(_CLOSING[char])
        elif char in "]}":
            if not stack or stack.pop() != char:
                raise ValueError(f"{flag} {text!r}: unbalanced {char!r}; write e.g. {flag} {EXAMPLE}.")
        elif char == "," and not stack:
            items.append(text[start:i])
            start = i + 1
    if stack or quote:
        missing = quote or stack[-1]
        raise ValueError(f"{flag} {text!r}: missing a closing {missing!r}; write e.g. {flag} {EXAMPLE}.")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_value(text: str) -> Any:
    """One override value as YAML 1.2 / JSON: numbers, true/false, null, `[...]` lists, `{...}` maps, else a string.

    Raises `ValueError` for text that is not YAML, and for a block mapping or list (`b: c`, `- x`): on a command
    line those are typos far more often than intent; write `{b: c}` or `[x]`, or quote the string.
    """
    try:
        value = yaml.load(text, Loader=_ValueLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"not valid YAML/JSON ({str(err).splitlines()[0]})") from None
    if isinstance(value, dict | list) and text.lstrip()[:1] not in ("[", "{"):
        raise ValueError(f"reads as a YAML {type(value).__name__}, not a value; write it as {{...}} or [...]")
    return value


def parse_overrides(items: str | Iterable[str] | None, flag: str) -> dict[str, Any]:
    """Parse `key=value` overrides given to `flag` (named in every error), in order.

    `items` is one comma-separated string, several strings, or None (no overrides). Raises `ValueError` naming
    the flag and the bad item, with an example, for an item without `=`, a key that is not a name, an empty or
    unparsable value, or a key given twice.
    """
    if items is None:
        return {}
    pieces = [piece for text in ([items] if isinstance(items, str) else items) for piece in _split_items(text, flag)]
    overrides: dict[str, Any] = {}
    for item in pieces:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not _KEY.fullmatch(key):
            raise ValueError(
                f"{flag} item {item!r} is not key=value with a field name as key; write e.g. {flag} {EXAMPLE}."
            )
        if not value:
            raise ValueError(f"{flag} item {item!r} has no value; write {key}=null for None, or e.g. {flag} {EXAMPLE}.")
        if key in overrides:
            raise ValueError(f"{flag} gives {key!r} twice ({key}={overrides[key]!r} and {item!r}); keep one.")
        try:
            overrides[key] = parse_value(value)
        except ValueError as err:
            raise ValueError(
                f"{flag} item {item!r}: the value {value!r} {err}; quote strings that hold brackets, colons or "
                f"commas, e.g. {flag} {EXAMPLE}."
            ) from None
    return overrides


def format_overrides(overrides: Mapping[str, Any]) -> str:
    """The comma-separated string that `parse_overrides` reads back to `overrides` (values written as JSON)."""
    return ",".join(f"{key}={json.dumps(value, allow_nan=False)}" for key, value in overrides.items())
