"""LrkvForCausalLM: cached decoding equals full recomputation, eager equals sdpa, fp32 and bf16 both run."""

from __future__ import annotations

import pytest
import torch

from ecomla.lrkv import LrkvCache
from tests.lrkv.helpers import padded_batch, positions, tiny_lrkv

GEN = dict(max_new_tokens=6, return_dict_in_generate=True, output_logits=True, pad_token_id=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@torch.no_grad()
def test_greedy_cached_logits_equal_full_recompute(attn):
    model = tiny_lrkv()
    model.set_attn_implementation(attn)
    ids, mask = padded_batch()
    out = model.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    assert isinstance(out.past_key_values, LrkvCache)

    seq, m = ids, mask
    for step, cached in enumerate(out.logits):
        full = model(seq, attention_mask=m, position_ids=positions(m), use_cache=False).logits[:, -1]
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)
        nxt = full.argmax(-1)
        assert torch.equal(nxt, out.sequences[:, ids.shape[1] + step])
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)


@torch.no_grad()
def test_sampling_with_cache_equals_sampling_without():
    model = tiny_lrkv(seed=1)
    ids, mask = padded_batch(seed=2)
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        outs.append(model.generate(ids, attention_mask=mask, do_sample=True, top_k=20, temperature=0.9,
                                   use_cache=use_cache, **GEN))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@torch.no_grad()
def test_eager_equals_sdpa_on_padded_batch():
    model = tiny_lrkv()
    ids, mask = padded_batch()
    logits = {}
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        logits[attn] = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
    keep = mask.bool()
    torch.testing.assert_close(logits["eager"][keep], logits["sdpa"][keep], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_forward_and_generate_run(dtype):
    model = tiny_lrkv().to(dtype)
    model.set_attn_implementation("eager")
    ids, mask = padded_batch()
    logits = model(ids, attention_mask=mask).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    reference = tiny_lrkv()(ids, attention_mask=mask).logits  # same seed, fp32
    assert (logits.float() - reference)[mask.bool()].abs().max() < (0.1 if dtype == torch.bfloat16 else 1e-5)
    out = model.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    assert out.sequences.shape == (2, ids.shape[1] + GEN["max_new_tokens"])
    assert out.past_key_values.layers[0].keys.dtype == dtype


def test_module_names_and_shapes():
    model = tiny_lrkv()
    attn = model.model.layers[1].self_attn
    n_h, d_h, r, D = 4, 16, 4, 64
    shapes = {name: tuple(p.shape) for name, p in attn.named_parameters()}
    assert shapes == {
        "q_proj.weight": (n_h * d_h, D), "k_shared.weight": (d_h, D), "v_shared.weight": (d_h, D),
        "k_down.weight": (n_h * r, D), "v_down.weight": (n_h * r, D),
        "k_up": (n_h, r, d_h), "v_up": (n_h, r, d_h), "o_proj.weight": (D, n_h * d_h),
    }
    names = set(model.state_dict())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.layers.0.mlp.gate_proj.weight"):
        assert name in names


def test_rejects_a_cache_without_positions():
    from transformers import DynamicCache

    model = tiny_lrkv()
    ids, _ = padded_batch()
    with pytest.raises(TypeError, match="LrkvCache"):
        model(ids, past_key_values=DynamicCache())


def test_labels_give_a_loss_and_gradients():
    model = tiny_lrkv().train()
    ids, mask = padded_batch()
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    assert model.model.layers[0].self_attn.k_up.grad.abs().sum() > 0
