"""Shared + truncated-SVD residual init: exact at full rank, error falling with rank, Llama logits reproduced."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ecomla.lrkv.convert import expand_kv_heads, lrkv_from_llama, shared_lowrank
from tests.lrkv.helpers import padded_batch, positions

N_H, D_H, D = 4, 16, 64


def test_full_rank_reproduces_every_head():
    heads = torch.randn(N_H, D_H, D)
    split = shared_lowrank(heads, rank=min(D, D_H))
    torch.testing.assert_close(split.heads(), heads, atol=1e-5, rtol=0)
    torch.testing.assert_close(split.shared, heads.mean(0))
    assert split.down.shape == (N_H, D, D_H) and split.up.shape == (N_H, D_H, D_H)
    assert split.energy_kept == pytest.approx(1.0)


def test_error_falls_as_rank_grows():
    heads = torch.randn(N_H, D_H, D)
    errors = [float((shared_lowrank(heads, r).heads() - heads).norm()) for r in range(1, D_H + 1)]
    assert all(a > b for a, b in pairwise(errors))
    assert errors[-1] < 1e-4
    # the shared part alone (what rank → 0 would leave) is worse than any residual rank
    assert float((heads.mean(0) - heads).norm()) > errors[0]


def test_down_weight_is_head_major_like_the_attention_reads_it():
    split = shared_lowrank(torch.randn(N_H, D_H, D), rank=3)
    x = torch.randn(5, D)
    latents = (x @ split.down_weight().T).view(5, N_H, 3)  # what k_down(x).view(..., n_h, r) gives
    torch.testing.assert_close(latents, torch.einsum("td,hdr->thr", x, split.down))


def test_expand_kv_heads_repeats_each_group_like_repeat_kv():
    w = torch.arange(2 * D_H * 3, dtype=torch.float32).view(2 * D_H, 3)  # 2 kv heads, d_model 3
    heads = expand_kv_heads(w, num_heads=4, head_dim=D_H)
    assert torch.equal(heads[0], heads[1]) and torch.equal(heads[2], heads[3])
    assert torch.equal(heads[2], w[D_H:])
    with pytest.raises(ValueError, match="num_heads=3"):
        expand_kv_heads(w, num_heads=3, head_dim=D_H)


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=N_H,
        num_key_value_heads=2, head_dim=D_H, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


@torch.no_grad()
def test_lrkv_from_llama_full_rank_gives_the_llamas_logits():
    llama = _tiny_llama()
    lrkv = lrkv_from_llama(llama, rank=D_H)
    assert lrkv.config.model_type == "lrkv" and lrkv.config.rope_parameters["rope_type"] == "llama3"
    ids, mask = padded_batch(T=12)
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    keep = mask.bool()
    torch.testing.assert_close(lrkv(ids, **kw).logits[keep], llama(ids, **kw).logits[keep], atol=1e-4, rtol=0)


@torch.no_grad()
def test_lrkv_from_llama_logit_error_falls_with_rank():
    llama = _tiny_llama(seed=3)
    ids, mask = padded_batch(T=12, seed=1)
    keep = mask.bool()
    reference = llama(ids, attention_mask=mask).logits[keep]
    errors = [float((lrkv_from_llama(llama, r)(ids, attention_mask=mask).logits[keep] - reference).abs().max())
              for r in (1, 4, 16)]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4


def test_lrkv_from_llama_rejects_attention_bias():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias"):
        lrkv_from_llama(llama, rank=4)
