"""Real, offline text in two domains, from the running Python installation itself.

    from ecomla.pytext.corpus import documents
    for doc in documents("prose", "heldout"): print(doc.name, len(doc.text))

Domains:
- `prose`: the language reference's English text as pydoc ships it
  (`pydoc_data.topics.topics`), one document per topic (79 on Python 3.11),
  with the paragraphs that several topics share kept in one of them only.
- `code`: the standard library's own source, one document per `.py` file,
  leaving out its test suites, site-packages and the machine-specific
  `_sysconfigdata*` module.

Each document goes to one split by a hash of its domain and name
(`split_of`): calibration (fitting low-rank bases), train (distillation) or
heldout (perplexity and eval items). The split of a document never depends on
which other documents exist, so it is the same on every machine and Python
version that has the document, and no document is in two splits. Within a
split documents come in hash order, a fixed shuffle, so the first N tokens of
a split are not all from one corner of the library.

The text itself is the installed Python's: the committed task files were built
on Python 3.11 (`BUILT_ON`); other versions carry other text under some names.
"""

from __future__ import annotations

import hashlib
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

Domain = Literal["prose", "code"]
Split = Literal["calibration", "train", "heldout"]
DOMAINS: tuple[Domain, ...] = get_args(Domain)
SPLITS: tuple[Split, ...] = get_args(Split)

# Share of documents (by hash bucket, out of 100) in each split. Prose is scarce (about 110k tokens in all),
# so it keeps a third for held-out evaluation; code is plentiful (millions of tokens), so a tenth suffices.
SHARES: dict[str, dict[str, int]] = {
    "prose": {"calibration": 35, "train": 35, "heldout": 30},
    "code": {"calibration": 10, "train": 80, "heldout": 10},
}
BUILT_ON = (3, 11)  # the Python version the committed task files come from
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Document:
    name: str  # `topics/KEY` for prose, the path below the stdlib directory for code
    text: str


def check(domain: str | None = None, split: str | None = None) -> None:
    if domain is not None and domain not in DOMAINS:
        raise ValueError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")


def _bucket(domain: str, name: str) -> int:
    """A document's hash bucket in [0, 2**64): its split and its place in the split's order."""
    return int.from_bytes(hashlib.sha256(f"{domain}/{name}".encode()).digest()[:8], "big")


def split_of(domain: str, name: str) -> Split:
    """The split that document `name` of `domain` belongs to (a pure function of the two)."""
    check(domain)
    point = _bucket(domain, name) % 100
    for split, share in SHARES[domain].items():
        if point < share:
            return split  # type: ignore[return-value]
        point -= share
    raise AssertionError("SHARES must add up to 100")


_SHARED_MIN = 60  # chars: a paragraph this long that two topics share is kept in one of them only


def _prose() -> Iterator[Document]:
    """The pydoc topics, each paragraph of 60+ chars in one topic only.

    pydoc's topics overlap: `specialnames` contains `customization` and `attribute-access` whole, `compound`
    contains `try` and `function`, and so on (about a fifth of the text). A shared paragraph stays in the
    smallest topic that has it, so that no text is in two documents, and so in two splits.
    """
    from pydoc_data.topics import topics

    blocks = {key: re.split(r"\n\s*\n", topics[key].strip()) for key in sorted(topics)}
    owner: dict[str, str] = {}
    for key in sorted(blocks, key=lambda k: (len(topics[k]), k)):
        for block in blocks[key]:
            if len(block) >= _SHARED_MIN:
                owner.setdefault(block, key)
    for key, parts in blocks.items():
        kept = [b for b in parts if len(b) < _SHARED_MIN or owner[b] == key]
        if any(len(b) >= _SHARED_MIN for b in kept):
            yield Document(f"topics/{key}", "\n\n".join(kept) + "\n")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code() -> Iterator[Document]:
    root = stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS & set(rel.parts) or rel.name.startswith("_sysconfigdata"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a file that is not UTF-8 text is not part of the corpus
            continue
        if text.strip():
            yield Document(rel.as_posix(), text)


_SOURCES = {"prose": _prose, "code": _code}


def documents(domain: str, split: str) -> list[Document]:
    """Every document of one domain and split, in the split's fixed (hash) order."""
    check(domain, split)
    docs = [d for d in _SOURCES[domain]() if split_of(domain, d.name) == split]
    return sorted(docs, key=lambda d: _bucket(domain, d.name))


def iter_texts(split: str, domain: str | None = None) -> Iterator[str]:
    """The texts of one split: one domain, or both alternating (prose, code, prose, ...) until both run out."""
    check(domain, split)
    if domain is not None:
        yield from (d.text for d in documents(domain, split))
        return
    streams = [iter(documents(dom, split)) for dom in DOMAINS]
    while streams:
        for stream in list(streams):
            doc = next(stream, None)
            if doc is None:
                streams.remove(stream)
            else:
                yield doc.text


def python_version() -> tuple[int, int]:
    return sys.version_info[:2]
