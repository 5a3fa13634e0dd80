"""`import ecomla.lrkv` registers model_type "lrkv": checkpoints round-trip through the Auto classes without remote code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ecomla.lrkv import LrkvConfig, LrkvForCausalLM
from tests.lrkv.helpers import padded_batch, tiny_lrkv


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@torch.no_grad()
def test_save_then_auto_load_gives_identical_logits(tmp_path, tie):
    model = tiny_lrkv(tie_word_embeddings=tie, rope_theta=500000.0)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "lrkv" and "auto_map" not in saved

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LrkvForCausalLM and loaded.config.model_type == "lrkv"
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LrkvConfig)
    assert loaded.config.rope_parameters["rope_theta"] == 500000.0
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    ids, mask = padded_batch()
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits,
                               atol=0, rtol=0)


@pytest.mark.slow
def test_import_ecomla_lrkv_is_enough_to_load(tmp_path):
    tiny_lrkv().save_pretrained(tmp_path)
    code = ("import ecomla.lrkv; from transformers import AutoModelForCausalLM; "
            f"print(type(AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "LrkvForCausalLM"
