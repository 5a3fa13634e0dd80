"""Each supported family converts, loads in the stock class, and is exact in its exact configuration.

Exact configuration: one KV head, r_kv = hidden size, every head dim kept as RoPE
(and, for a query bias, q_lora_rank = hidden + 1). ε is set tiny for the reason
given in test_exact.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from tests.convert.helpers import convert, load, logit_error

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama_tied": ("llama", dict(tie_word_embeddings=True), dict(kv_lora_rank=64, qk_rope_head_dim=16)),
    # head_dim 32 with hidden 64 and 4 heads: head_dim != hidden / heads
    "mistral_head_dim": ("mistral", dict(head_dim=32), dict(kv_lora_rank=64, qk_rope_head_dim=32)),
    "qwen2_bias_untied": ("qwen2", dict(tie_word_embeddings=False), dict(kv_lora_rank=64, qk_rope_head_dim=16, q_lora_rank=65)),
    "llama3_rope_scaling": ("llama", dict(rope_parameters=LLAMA3_ROPE), dict(kv_lora_rank=64, qk_rope_head_dim=16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_family_converts_exactly(source_factory, tmp_path, case):
    family, cfg, mla = CASES[case]
    src_dir = source_factory(family, num_key_value_heads=1, rms_norm_eps=1e-9, **cfg)
    report = convert(src_dir, tmp_path / "out", mla=mla)
    assert report["source_family"] == family
    assert report["rope"]["exact"]
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(out) is DeepseekV3ForCausalLM
    src = load(src_dir)
    assert out.config.tie_word_embeddings == src.config.tie_word_embeddings
    assert logit_error(src, out, src.config.vocab_size) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_family_lossy_gqa_loads(source_factory, tmp_path, case):
    """The everyday case: GQA, a compressed latent, bf16 output; loads and runs in the stock class."""
    family, cfg, mla = CASES[case]
    src_dir = source_factory(family, **cfg)
    mla = {**mla, "kv_lora_rank": 24, "qk_rope_head_dim": 8}
    if "q_lora_rank" in mla:
        mla["q_lora_rank"] = 48
    convert(src_dir, tmp_path / "out", mla=mla, dtype="bfloat16")
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert out.dtype == torch.bfloat16
    assert out.config.kv_lora_rank == 24
    with torch.no_grad():
        logits = out(torch.arange(1, 9)[None]).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("strategy, exact", [("high", True), ("low", False), ("uniform", True)])
def test_llama3_frequency_subsets(source_factory, tmp_path, strategy, exact):
    """Llama-3 scaling keeps kept pairs' frequencies for high/uniform; low needs a linear factor it cannot have."""
    src_dir = source_factory("llama", rope_parameters=LLAMA3_ROPE)
    rep = convert(src_dir, tmp_path / strategy, mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_dims": strategy})
    assert rep["rope"]["exact"] is exact
    assert rep["rope"]["rope_parameters"]["rope_type"] == "llama3"


@pytest.mark.parametrize("strategy", ["high", "low", "uniform"])
def test_default_rope_frequency_subsets_are_exact(source_factory, tmp_path, strategy):
    src_dir = source_factory("llama")
    rep = convert(src_dir, tmp_path / strategy, mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_dims": strategy})
    assert rep["rope"]["exact"], rep["rope"]


def test_norm_strategy_uses_calibration(source_factory, corpus_dir, tmp_path):
    src_dir = source_factory("llama")
    cal = {"dataset": str(corpus_dir / "a_fit.jsonl"), "num_tokens": 1024, "heldout_tokens": 512, "seq_len": 64}
    rep = convert(src_dir, tmp_path / "norm", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_dims": "norm"},
                  init={"calibration": cal})
    pairs = [layer["rope_pairs"] for layer in rep["layers"]]
    assert all(len(p) == 4 and p == sorted(p) for p in pairs)
    assert rep["rope"]["max_rel_frequency_error"] is not None
    load(tmp_path / "norm")
