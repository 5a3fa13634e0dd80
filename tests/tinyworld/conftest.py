"""Fixtures of the tiny-world tests: a small tokenizer and a sample of training text, built once per session."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ecomla.tinyworld.corpus import DOMAINS, iter_documents


@pytest.fixture(scope="session")
def tinyworld_tokenizer_dir(tmp_path_factory) -> Path:
    from ecomla.tinyworld.tokenizer import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tinyworld_tok"), num_docs=300)


@pytest.fixture(scope="session")
def tinyworld_tokenizer(tinyworld_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tinyworld_tokenizer_dir)


@pytest.fixture(scope="session")
def train_sample() -> dict[str, list[str]]:
    """1,500 training documents per domain (~2.6 MB of text)."""
    return {d: list(itertools.islice(iter_documents(d, "train", 0), 1500)) for d in DOMAINS}
