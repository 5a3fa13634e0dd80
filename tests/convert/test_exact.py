"""The exact case: an MQA source, r_kv = hidden size, every head dim kept as RoPE.

Keys are the shared RoPE key itself (one KV head, original frequencies), and the
full-width latent is an isometry of the normalized attention input, so the stock
latent RMSNorm is a constant scale. What remains is the source's own RMSNorm ε:
‖y‖² = d·ms/(ms + ε), a relative wobble of ε/ms per token. The fixture sets ε = 1e-9
so that the comparison isolates the conversion; `test_eps_is_the_only_residual`
shows the wobble appears exactly when ε is raised.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from tests.convert.helpers import convert, load, logit_error, padded_batch

EXACT = dict(mla={"kv_lora_rank": 64, "qk_rope_head_dim": 16})


def _mqa(source_factory, **kw):
    return source_factory("llama", num_key_value_heads=1, rms_norm_eps=1e-9, **kw)


def test_exact_logits_padding_and_reload(source_factory, tmp_path):
    src_dir = _mqa(source_factory)
    report = convert(src_dir, tmp_path / "mla", **EXACT)
    assert report["rope"]["exact"]
    src = load(src_dir)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32)  # plain Auto class
    assert type(out) is DeepseekV3ForCausalLM
    assert out.config.first_k_dense_replace >= out.config.num_hidden_layers
    vocab = src.config.vocab_size
    for seed in range(3):
        assert logit_error(src, out, vocab, seed) < 1e-4


def test_exact_cached_generation(source_factory, tmp_path):
    src_dir = _mqa(source_factory)
    convert(src_dir, tmp_path / "mla", **EXACT)
    src, out = load(src_dir), load(tmp_path / "mla")
    ids, mask = padded_batch(src.config.vocab_size, seed=3, T=10)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    with torch.no_grad():
        a = src.generate(ids, **kw)
        b = out.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):  # every cached decoding step
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)


def test_exact_interleaved_and_half_layouts_agree(source_factory, tmp_path):
    src_dir = _mqa(source_factory)
    convert(src_dir, tmp_path / "inter", mla={**EXACT["mla"], "rope_interleave": True})
    convert(src_dir, tmp_path / "half", mla={**EXACT["mla"], "rope_interleave": False})
    a, b = load(tmp_path / "inter"), load(tmp_path / "half")
    assert a.config.rope_interleave and not b.config.rope_interleave
    assert logit_error(a, b, a.config.vocab_size) < 1e-4


def test_eps_is_the_only_residual(source_factory, tmp_path):
    """Same model at ε = 1e-9 and ε = 1e-3: the error grows with ε, as the derivation predicts."""
    errs = []
    for eps in (1e-9, 1e-3):
        src_dir = source_factory("llama", num_key_value_heads=1, rms_norm_eps=eps, name=f"eps{eps}")
        convert(src_dir, tmp_path / f"mla{eps}", **EXACT)
        errs.append(logit_error(load(src_dir), load(tmp_path / f"mla{eps}"), 300))
    assert errs[0] < 1e-4 < errs[1]
