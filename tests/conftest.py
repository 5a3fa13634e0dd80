"""Shared fixtures: tiny random source checkpoints and a tiny byte-level BPE tokenizer, all offline.

Caches (HF_HOME, TORCH_EXTENSIONS_DIR, ECOMLA_CACHE) live inside the repo's .cache/ so tests
never touch the user's home directory, and the hubs are switched off.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HOME", str(ROOT / ".cache" / "hf"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ECOMLA_CACHE", str(ROOT / ".cache" / "ecomla"))  # llama.cpp's converter, once unpacked

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.tiny import make_source, write_corpus  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from tests.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def source_factory(tmp_path, tokenizer_dir):
    """make(family='llama', name=..., **config overrides) -> checkpoint dir."""
    counter = iter(range(1000))

    def make(family: str = "llama", name: str | None = None, seed: int = 0, **overrides) -> Path:
        out = tmp_path / (name or f"{family}-{next(counter)}")
        return make_source(out, tokenizer_dir, family=family, seed=seed, **overrides)

    return make


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
