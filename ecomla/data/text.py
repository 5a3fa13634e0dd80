"""Text sources and fixed-length token blocks.

A text source is a local .jsonl/.json/.txt/.parquet file or a directory of
them, read with Hugging Face `datasets` in streaming mode (nothing is cached),
a hub dataset name when the machine is online, or a corpus that ecomla builds
itself (`CORPORA`): `PREFIX:SPLIT` (both domains alternating) or
`PREFIX:SPLIT:DOMAIN`, SPLIT one of train/calibration/heldout. `tinyworld:` is
the tiny world's endless generated text; `pytext:` is the installed Python's
own prose (domain `prose`) and stdlib source (`code`). `token_blocks` tokenizes
documents in order, joins them with the EOS token and cuts (n, T) blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ecomla.errors import UserError

_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


class DataError(UserError, ValueError):
    """A dataset is missing, empty, or too small for what was asked."""


def _local_files(path: Path) -> tuple[str, list[str]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS)
    if not files:
        raise DataError(f"{path}: no .jsonl/.json/.txt/.parquet files found")
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"{path}: empty (no documents); point it at a file with data")
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if None in builders:
        raise DataError(f"{path}: unsupported file type (use .jsonl, .json, .txt or .parquet)")
    if len(builders) > 1:
        raise DataError(f"{path}: mixes file types {sorted(builders)}; keep one type per dataset")
    return builders.pop(), [str(p) for p in files]


@dataclass(frozen=True)
class NamedCorpus:
    """A corpus that ecomla builds itself, named `PREFIX:SPLIT` or `PREFIX:SPLIT:DOMAIN` in a dataset key."""

    prefix: str
    module: str  # imported only when the corpus is read: it holds DOMAINS, SPLITS and iter_texts(split, domain)
    endless: bool  # True: the stream never ends, so a reader must say how much it takes
    about: str


CORPORA = {
    c.prefix: c
    for c in (
        NamedCorpus("tinyworld", "ecomla.tinyworld.corpus", True, "the generated tiny-world corpus"),
        NamedCorpus("pytext", "ecomla.pytext.corpus", False,
                    "the installed Python's language-reference prose and stdlib code"),
    )
}


def named_corpus(dataset: str | None) -> NamedCorpus | None:
    """The corpus a dataset key names (`tinyworld:train`, `pytext:heldout:code`, ...), or None for other keys."""
    if not dataset or ":" not in dataset or Path(dataset).expanduser().exists():
        return None
    return CORPORA.get(dataset.split(":", 1)[0])


def is_endless(dataset: str | None) -> bool:
    """True for the generated tiny-world streams, which never end (readers must stop on their own)."""
    corpus = named_corpus(dataset)
    return corpus is not None and corpus.endless


def _named_rows(corpus: NamedCorpus, dataset: str) -> Iterator[dict]:
    import importlib

    module = importlib.import_module(corpus.module)
    parts = dataset[len(corpus.prefix) + 1:].split(":")
    if len(parts) > 2 or parts[0] not in module.SPLITS or (len(parts) == 2 and parts[1] not in module.DOMAINS):
        raise DataError(f"{dataset}: expected {corpus.prefix}:SPLIT or {corpus.prefix}:SPLIT:DOMAIN with SPLIT one "
                        f"of {', '.join(module.SPLITS)} and DOMAIN one of {', '.join(module.DOMAINS)}")
    texts = module.iter_texts(parts[0], parts[1] if len(parts) == 2 else None)
    return ({"text": text} for text in texts)


def iter_rows(dataset: str, *, split: str = "train", subset: str | None = None, field: str | None = None) -> Iterator[dict]:
    """Rows (dicts) of a local or hub dataset or a named corpus, in order; `field` is checked on the first row."""
    import datasets

    path = Path(dataset).expanduser()
    corpus = named_corpus(dataset)
    if corpus is not None:
        ds = _named_rows(corpus, dataset)
    elif path.exists():
        builder, files = _local_files(path)
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
    else:
        try:
            ds = datasets.load_dataset(dataset, subset, split=split, streaming=True)
        except Exception as err:
            raise DataError(
                f"{dataset}: not a local file or directory, and loading it as a hub dataset failed "
                f"({type(err).__name__}: {err})"
            ) from err
    for row in ds:
        if field is not None and field not in row:
            raise DataError(f"{dataset}: rows have no '{field}' field (fields: {', '.join(row)}); set the field name")
        yield row


def iter_texts(dataset: str, *, text_field: str = "text", split: str = "train", subset: str | None = None) -> Iterator[str]:
    """Documents of a local or hub dataset, in order (empty ones skipped)."""
    path = Path(dataset).expanduser()
    field = "text" if path.exists() and path.suffix == ".txt" else text_field
    for row in iter_rows(dataset, split=split, subset=subset, field=field):
        if row[field]:
            yield row[field]


def token_blocks(texts: Iterator[str], tokenizer, seq_len: int, num_blocks: int, *, skip_blocks: int = 0) -> torch.Tensor:
    """(num_blocks, seq_len) token ids from consecutive documents joined by EOS.

    The first `skip_blocks` blocks are dropped, so calibration and held-out
    blocks cut from one stream never overlap.
    """
    eos = tokenizer.eos_token_id
    need = (skip_blocks + num_blocks) * seq_len
    buf: list[int] = []
    for text in texts:
        buf.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            buf.append(eos)
        if len(buf) >= need:
            break
    have = len(buf) // seq_len - skip_blocks
    if have < num_blocks:
        raise DataError(
            f"the dataset yields {max(0, have) * seq_len} tokens after the first {skip_blocks * seq_len}, "
            f"but {num_blocks * seq_len} were asked for; lower the token count or add data"
        )
    ids = torch.tensor(buf[skip_blocks * seq_len : need], dtype=torch.long)
    return ids.view(num_blocks, seq_len)
