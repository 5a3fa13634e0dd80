"""AdamW groups for tensors stored off their natural scale (a linear-latent student's)."""

from __future__ import annotations

import torch

from ecomla.distill import models


def test_adamw_on_a_scaled_tensor_follows_the_natural_one():
    """w stored as s·w with lr·s, eps/s and weight_decay/s takes the steps AdamW takes on w itself, for s far
    from 1 either way (the linear latent's gain is about 1e-3, its query rows about 1e3)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(8, 4, generator=gen)
    grads = [torch.randn(8, 4, generator=gen) * 1e-6 for _ in range(5)]  # small: eps matters
    natural = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([natural], lr=1e-2, weight_decay=0.1)
    for g in grads:
        natural.grad = g.clone()
        opt.step()
    for s in (1e-3, 1e3):
        stored = torch.nn.Parameter(w0 * s)
        [group] = models.adamw_groups([stored], ["x"], [0], {"x": models.StoredScale(s)}, weight_decay=0.1)
        opt = torch.optim.AdamW([{"params": group["params"], "eps": group["eps"],
                                  "weight_decay": group["weight_decay"], "lr": 1e-2 * group["lr_scale"]}])
        for g in grads:
            stored.grad = g / s  # d loss / d(s·w) = (d loss / d w) / s
            opt.step()
        torch.testing.assert_close(stored.detach() / s, natural.detach(), rtol=1e-5, atol=1e-6)
    unscaled = torch.nn.Parameter(w0 * 1e3)
    opt = torch.optim.AdamW([unscaled], lr=1e-2, weight_decay=0.1)
    for g in grads:
        unscaled.grad = g / 1e3
        opt.step()
    assert not torch.allclose(unscaled.detach() / 1e3, natural.detach(), rtol=1e-3)  # why the groups exist


def test_groups_split_by_stage_and_scale_and_freeze_rows():
    a, b, c = (torch.nn.Parameter(torch.ones(3, 2)) for _ in range(3))
    scales = {"b": models.StoredScale(2.0, frozen_rows=1)}
    groups = models.adamw_groups([a, b, c], ["a", "b", "c"], [0, 0, None], scales, weight_decay=0.5)
    assert [(g["first_stage"], g["lr_scale"], len(g["params"])) for g in groups] == [(0, 1.0, 1), (0, 2.0, 1)]
    assert groups[1]["eps"] == 0.5e-8 and groups[1]["weight_decay"] == 0.25
    models.freeze_rows(b, 1)
    (b * torch.arange(6.0).view(3, 2)).sum().backward()
    assert b.grad[0].abs().sum() == 0 and b.grad[1:].abs().sum() > 0
