"""Fixtures shared by the eval tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.convert.helpers import convert


@pytest.fixture
def models(source_factory, tmp_path) -> dict[str, Path]:
    """A tiny GQA Llama and its MLA conversion (8 + 8 numbers per token and layer, from 2·2·16 = 64: 4x)."""
    base = source_factory(name="base", max_position_embeddings=1024)
    mla = tmp_path / "mla"
    convert(base, mla, mla={"kv_lora_rank": 8, "qk_rope_head_dim": 8})
    return {"base": base, "mla": mla}
