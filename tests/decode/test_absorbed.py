"""The absorbed decode path equals stock DeepSeek-V3: greedy tokens, per-step logits, sampling, padding, q-LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ecomla.decode import AbsorbedDeepseekV3ForCausalLM, output_cache
from tests.convert.helpers import convert, padded_batch

GEN = dict(max_new_tokens=10, output_logits=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.fixture(scope="module", params=[None, 48], ids=["q_full", "q_lora"])
def mla_dir(request, tmp_path_factory, tokenizer_dir):
    from tests.tiny import make_source

    root = tmp_path_factory.mktemp("absorbed")
    src = make_source(root / "src", tokenizer_dir, num_key_value_heads=2)
    mla = {"kv_lora_rank": 24, "qk_rope_head_dim": 8, "q_lora_rank": request.param}
    convert(src, root / "mla", mla=mla)
    return root / "mla"


def _pair(path, dtype=torch.float32):
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    fast = AbsorbedDeepseekV3ForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return stock, fast


def test_greedy_and_per_step_logits_match_stock(mla_dir):
    stock, fast = _pair(mla_dir)
    ids, mask = padded_batch(stock.config.vocab_size, seed=5, T=12)
    with torch.no_grad():
        a = stock.generate(ids, attention_mask=mask, do_sample=False, **GEN)
        b = fast.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    assert torch.equal(a.sequences, b.sequences)
    for la, lb in zip(a.logits, b.logits):
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)


def test_sampling_matches_stock(mla_dir):
    stock, fast = _pair(mla_dir)
    ids, mask = padded_batch(stock.config.vocab_size, seed=6, T=9)
    outs = []
    for model in (stock, fast):
        torch.manual_seed(123)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, do_sample=True, top_k=20, temperature=0.9, **GEN))
    assert torch.equal(outs[0].sequences, outs[1].sequences)


def test_bf16_runs_and_stays_close(mla_dir):
    stock, fast = _pair(mla_dir, torch.bfloat16)
    ids, mask = padded_batch(stock.config.vocab_size, seed=7, T=8)
    with torch.no_grad():
        a = stock.generate(ids, attention_mask=mask, do_sample=False, **GEN)
        b = fast.generate(ids, attention_mask=mask, do_sample=False, **GEN)
    first = (a.logits[0].float() - b.logits[0].float()).abs().max()
    assert torch.isfinite(b.logits[0]).all() and first < 0.1  # bf16 rounding differs, the model does not


def test_cache_holds_only_the_latent(mla_dir):
    _, fast = _pair(mla_dir)
    ids = torch.arange(1, 11)[None]
    with torch.no_grad():
        out = fast(ids, use_cache=True)
        out = fast(torch.tensor([[3]]), past_key_values=output_cache(out), use_cache=True)
    cache = output_cache(out)
    layer0 = cache.layers[0]
    assert layer0.keys.shape == (1, 1, 11, 24) and layer0.values.shape == (1, 1, 11, 8)
