"""`ecomla.tinyworld.grow`: a grown Llama computes exactly what the small one did, then learns with all of it.

Proves, in float32 on tiny random models with non-trivial norm weights: logits
are equal (to rounding) after growing width, MLP, query heads per KV group and
depth, alone and together, tied or untied; the grown parts are not frozen (every
parameter has a gradient by the second step); and a config that would shrink or change a fixed
size is refused with every problem named.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ecomla.tinyworld.grow import check_growable, grow_llama

FIXED = dict(vocab_size=97, head_dim=16, num_key_value_heads=2, initializer_range=0.2)
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def small_model(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, **FIXED, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norm weights of 1 would hide a missing rescale
    return model


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "grown",
    [dict(hidden_size=64), dict(intermediate_size=128), dict(num_attention_heads=6, hidden_size=96),
     dict(num_hidden_layers=4), dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6)],
    ids=["width", "mlp", "heads", "depth", "all"],
)  # fmt: skip
def test_grown_model_has_the_same_logits(grown, tie):
    src = small_model(tie)
    dst = grow_llama(src, LlamaConfig(**{**SMALL, **grown}, **FIXED, tie_word_embeddings=tie)).eval()
    assert sum(p.numel() for p in dst.parameters()) > sum(p.numel() for p in src.parameters())
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = src(ids).logits, dst(ids).logits
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_every_grown_parameter_learns():
    """A zeroed output (o_proj, down_proj) gets a gradient at once; what feeds it does from the second step."""
    src = small_model(tie=True)
    dst = grow_llama(src, LlamaConfig(hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=6, **FIXED, tie_word_embeddings=True))  # fmt: skip
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(dst.parameters(), lr=0.1)
    dst(ids, labels=ids).loss.backward()
    assert dst.model.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    opt.step()
    opt.zero_grad()
    dst(ids, labels=ids).loss.backward()
    still = [n for n, p in dst.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not still


def test_shrinking_or_changing_fixed_sizes_is_refused_by_name():
    src = LlamaConfig(**SMALL, **FIXED)
    bad = LlamaConfig(**{**SMALL, "hidden_size": 16, "num_attention_heads": 2},
                      **{**FIXED, "num_key_value_heads": 1, "head_dim": 8})  # fmt: skip
    with pytest.raises(ValueError) as err:
        check_growable(src, bad)
    for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert name in str(err.value)
