"""A linear-latent student's scaled tensors train at their natural size (distill/models.py NaturalScale)."""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from ecomla.distill import models


def _adamw(param: torch.nn.Parameter, grads, natural_of=lambda p: p):
    opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return natural_of(param).detach()


def test_adamw_through_the_parametrization_takes_the_natural_steps():
    """A tensor stored at s·w (s a power of two far from 1, per row) trains exactly as w itself does, and the
    stored tensor then is s times the trained w; plain AdamW on the stored tensor does not."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 4, generator=gen)
    grads = [torch.randn(6, 4, generator=gen) * 1e-6 for _ in range(5)]  # small: eps matters
    natural = _adamw(torch.nn.Parameter(w0.clone()), grads)
    scale = torch.tensor([2.0**-10] * 3 + [2.0**10] * 3)  # (rows,): a linear latent's kv_a_proj_with_mqa
    layer = torch.nn.Linear(4, 6, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w0 * scale[:, None])
    models.train_at_natural_scale(layer, {"weight": scale}, zero3=False)
    original = models.natural_parameter(layer, "weight")
    torch.testing.assert_close(original.detach(), w0, rtol=0, atol=0)  # powers of two: exact
    # d loss/d w = s · d loss/d(stored); here the natural gradients themselves reach `original`
    trained = _adamw(original, grads)
    torch.testing.assert_close(trained, natural, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(layer.weight.detach(), natural * scale[:, None], rtol=1e-6, atol=0)
    plain = torch.nn.Parameter(w0 * scale[:, None])
    stepped = _adamw(plain, [g / scale[:, None] for g in grads]) / scale[:, None]
    assert not torch.allclose(stepped, natural, rtol=1e-3)  # why the parametrization exists


def test_export_gives_the_stock_names_and_the_stored_values_back():
    layer = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=True))
    stored = {k: v.clone() for k, v in layer.state_dict().items()}
    scale = torch.tensor([2.0**-9, 2.0**3, 1.0])
    models.train_at_natural_scale(layer, {"0.weight": scale}, zero3=False)
    assert parametrize.is_parametrized(layer[0], "weight")
    state = layer.state_dict()
    assert "0.parametrizations.weight.original" in state and "0.weight" not in state
    back = models.stock_state_dict(layer, state)
    assert back.keys() == stored.keys()
    for k in stored:
        assert torch.equal(back[k], stored[k]), k
    assert models.stock_name("0.parametrizations.weight.original") == "0.weight"


def test_groups_split_by_stage_and_lr_multiplier_and_frozen_rows_keep_their_place():
    a, b, c, d = (torch.nn.Parameter(torch.ones(3, 2)) for _ in range(4))
    names = ["m.layers.0.self_attn.q_proj.weight", "m.layers.0.mlp.up.weight", "m.norm.weight", "m.layers.1.mlp.x"]
    mults = models.lr_multipliers(names, {"attention": 2.0, "mlp": 0.1})
    assert mults == [2.0, 0.1, 1.0, 0.1]
    groups = models.adamw_groups([a, b, c, d], [0, 1, None, 1], mults)
    assert [(g["first_stage"], g["lr_multiplier"], len(g["params"])) for g in groups] == [(0, 2.0, 1), (1, 0.1, 2)]
    models.freeze_rows(b, 1)
    (b * torch.arange(6.0).view(3, 2)).sum().backward()
    assert b.grad[0].abs().sum() == 0 and b.grad[1:].abs().sum() > 0
