"""LrkvCache holds exactly 2·(d_h + n_h·r) numbers per token and layer, measured the way ecomla.eval.kv measures."""

from __future__ import annotations

import pytest
import torch

from ecomla.eval.kv import cache_tensor_bytes, measured_kv_bytes_per_token
from ecomla.lrkv import LrkvCache, lrkv_kv_elements
from tests.lrkv.helpers import padded_batch, tiny_lrkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_measured_kv_bytes_per_token_equal_formula(dtype):
    model = tiny_lrkv().to(dtype)
    cfg = model.config
    element = torch.empty((), dtype=dtype).element_size()
    expected = 2 * (cfg.head_dim + cfg.num_attention_heads * cfg.lrkv_rank) * cfg.num_hidden_layers * element
    assert expected == lrkv_kv_elements(cfg) * element == 2 * (16 + 4 * 4) * 2 * element
    assert measured_kv_bytes_per_token(model, prompt_len=8, new_tokens=3) == expected

    ids, mask = padded_batch()  # a padded batch of 2 stores 2 rows of S tokens
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    assert cache.get_seq_length() == ids.shape[1] + 3  # the last sampled token is never fed back
    assert cache_tensor_bytes(cache) == expected * 2 * cache.get_seq_length()


@torch.no_grad()
def test_batch_operations_keep_positions_aligned_with_states():
    model = tiny_lrkv()
    ids, mask = padded_batch()
    cache = LrkvCache(model.config)
    model(ids, attention_mask=mask, past_key_values=cache)
    B, one, S, width = cache.layers[0].keys.shape
    assert (B, one, S, width) == (2, 1, ids.shape[1], 16 + 4 * 4)
    assert cache.positions.shape == (B, S)

    cache.crop(-3)
    assert cache.get_seq_length() == ids.shape[1] - 3 == cache.positions.shape[1]
    cache.batch_repeat_interleave(2)
    assert cache.positions.shape[0] == cache.layers[1].values.shape[0] == 4
    cache.batch_select_indices(torch.tensor([3]))
    assert torch.equal(cache.positions, torch.arange(ids.shape[1] - 3)[None])
    cache.reset()
    assert cache.positions is None and cache.get_seq_length() == 0


def test_eval_formula_matches_the_lrkv_formula():
    """`ecomla eval` computes KV sizes from config dicts; for LRKV it must agree with lrkv_kv_elements."""
    from ecomla.mla.budget import kv_elements_per_token
    from ecomla.lrkv import LrkvConfig, lrkv_kv_elements

    cfg = LrkvConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, head_dim=16, lrkv_rank=5)
    assert kv_elements_per_token(cfg.to_dict()) == lrkv_kv_elements(cfg) == 3 * 2 * (16 + 4 * 5)
