"""Shared + truncated-SVD residual init: exact at full rank, error falling with rank, Llama logits reproduced
through `ecomla convert` (target lrkv)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from ecomla.lrkv.convert import expand_kv_heads, shared_lowrank
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


def test_ecomla_convert_to_lrkv_keeps_a_llama3_ropes_logits_at_full_rank(source_factory, tmp_path):
    """The one LRKV converter (`ecomla convert`, target lrkv) carries llama3 RoPE scaling and norm gains exactly."""
    from transformers import AutoModelForCausalLM

    from tests.convert.helpers import convert

    src = source_factory("llama", num_attention_heads=N_H, num_key_value_heads=2, head_dim=D_H,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
    convert(src, tmp_path / "lrkv", target="lrkv", lrkv={"rank": D_H})
    llama, lrkv = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (src, tmp_path / "lrkv"))
    assert lrkv.config.model_type == "lrkv" and lrkv.config.rope_parameters["rope_type"] == "llama3"
    ids, mask = padded_batch(T=12)
    kw = dict(attention_mask=mask, position_ids=positions(mask))
    keep = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(lrkv(ids, **kw).logits[keep], llama(ids, **kw).logits[keep], atol=1e-4, rtol=0)
