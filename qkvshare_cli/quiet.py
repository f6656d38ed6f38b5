"""Known, harmless log lines of optional dependencies, kept out of the commands' output.

Why they appear: a `[dev]` or `[export]` install has torchao (executorch depends on it), and transformers imports
torchao whenever it is installed (transformers/quantizers/quantizer_torchao.py, when its modeling code is first
imported). torchao then logs one line per prebuilt kernel library its platform cannot load ("Failed to load
.../torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library: ..."; CUDA or another Python's
builds), and registers enums with torch's pytree, for which torch warns "<enum 'KernelPreference'> is an Enum
subclass and is now natively supported by torch.compile as an opaque value type ...", a deprecation notice for
torchao's authors. QKVShare uses no torchao kernel, so neither line concerns a user of the commands.

Both are Python `logging` records (on the loggers "torchao" and "torch.utils._pytree"), so a filter on those two
loggers drops exactly these records; anything else they log still shows. (The same holds for accelerate's note on
a tied LM head at every training checkpoint, see `KNOWN_HARMLESS`.) Standard library only, and it must run
before transformers' modeling code is first imported (before `import qkvshare`): that import is what loads torchao.
"""

from __future__ import annotations

import logging
import re

KNOWN_HARMLESS = {
    "torchao": re.compile(r"^Failed to load \S*torchao[/\\]_C\w*[^/\\]*\.so: "),
    # accelerate's save_state keeps one copy of tensors that share storage and asks the reader to check the reload:
    # a tied LM head (`tie_word_embeddings`) is that by design and is tied again on load (resume is exact: tests).
    "accelerate.utils.other": re.compile(r"^(\[RANK \d+\] )?Removed shared tensor \{'lm_head\.weight'\} while saving"),
    "torch.utils._pytree": re.compile(
        r"is an Enum subclass and is now natively supported by torch\.compile as an opaque value type"
    ),
}


class _DropMatching(logging.Filter):
    """Drop the records whose message matches `pattern`."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def hide_known_harmless_logs() -> None:
    """Filter the `KNOWN_HARMLESS` records out of their loggers (calling it again adds nothing)."""
    for name, pattern in KNOWN_HARMLESS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
