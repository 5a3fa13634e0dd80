"""Measurements of a conversion: K/V reconstruction error and held-out output agreement."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ecomla.convert.to_mla import MLAGeometry, SourceAttention, kv_rows
from ecomla.mla import latent
from ecomla.mla.rope import RopeSplit


def kv_errors(geo: MLAGeometry, split: RopeSplit, src: SourceAttention, tensors: dict, y: torch.Tensor,
              rope_scale: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> tuple[float, float]:
    """Held-out ‖K−K̂‖/‖K‖ and ‖V−V̂‖/‖V‖ over all query heads, pre-RoPE, in the output's dim order.

    Keys include the RoPE part (the shared key, times the head's RoRoPE factor, against the head's own);
    both exclude biases, which the conversion carries exactly. With `rope_residual: latent` (residual, the
    `SharedRopeKey.residual` rows) the latent's residual dims are added back to the RoPE part: the key as
    the scores see it at relative position 0, where the residual's missing rotation does not matter.

    y (N, d) is the unit-gain attention input the source's rows read; the converted rows read it times
    geo.input_gain (a linear latent's γ, 1 otherwise), so both sides are compared at the source's scale.
    """
    y = y.double()
    y_out = y * geo.input_gain  # what the converted layer's projections see (they are stored ×1/γ)
    n, nope, qk_nope, d_h, r = geo.n_heads, geo.nope_dim, geo.qk_nope_head_dim, geo.head_dim, geo.kv_lora_rank
    kv_a = tensors["kv_a_proj_with_mqa.weight"].double()
    lat = latent.rms_normalize(y_out @ kv_a[:r].T)
    kv_hat = (lat @ tensors["kv_b_proj.weight"].double().T).view(-1, n, qk_nope + d_h)
    kr_hat = (y_out @ kv_a[r:].T)[:, None].expand(-1, n, -1)  # (N, n_h, d_r): the shared key ...
    if rope_scale is not None:  # ... as each head's scores see it (RoRoPE scales the query side per KV group)
        kr_hat = kr_hat * rope_scale.repeat_interleave(geo.n_rep, dim=0)[None].to(kr_hat.dtype)
    if geo.residual_dim:  # ... plus the residual carried by the latent
        kr_hat = kr_hat + kv_hat[..., nope:qk_nope]
    kv_true = (y @ kv_rows(geo, split, src, repeat=True, residual=residual).T).view(-1, n, qk_nope + d_h)
    kv_of = torch.arange(n) // geo.n_rep
    kr_true = (y @ src.k_w.view(geo.n_kv, d_h, -1)[:, split.rope_rows].reshape(-1, y.shape[1]).T).view(-1, geo.n_kv, geo.qk_rope_head_dim)[:, kv_of]
    k_true = torch.cat([kv_true[..., :nope], kr_true], -1)
    k_hat = torch.cat([kv_hat[..., :nope], kr_hat], -1)
    return latent.relative_error(k_true, k_hat), latent.relative_error(kv_true[..., qk_nope:], kv_hat[..., qk_nope:])


def agreement(batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict:
    """Perplexity of a reference and a candidate, KL(reference‖candidate) and top-1 agreement per token.

    `batches` yields (logp_reference, logp_candidate, target): log-probabilities (M, V) of the same M
    positions and their next tokens (M,), so callers stream the logits a few sequences at a time.
    """
    F = torch.nn.functional
    ce_ref = ce_cand = kl = agree = 0.0
    n = 0
    for ref, cand, target in batches:
        ce_ref += float(F.nll_loss(ref, target, reduction="sum"))
        ce_cand += float(F.nll_loss(cand, target, reduction="sum"))
        kl += float((ref.exp() * (ref - cand)).sum())
        agree += float((ref.argmax(-1) == cand.argmax(-1)).sum())
        n += target.numel()
    return {
        "tokens": n,
        "source_perplexity": math.exp(ce_ref / n),
        "converted_perplexity": math.exp(ce_cand / n),
        "kl_source_to_converted": kl / n,
        "top1_agreement": agree / n,
    }


@torch.no_grad()
def heldout_metrics(h_src: torch.Tensor, h_cvt: torch.Tensor, ids: torch.Tensor, reader, tied: bool, eps: float,
                    converted_eps: float | None = None) -> dict:
    """Perplexity of both models, and KL(source‖converted) and top-1 agreement per token, on held-out blocks.

    Takes the last hidden states (N, T, d) of each model and applies the shared
    final norm and head in small batches, so the full logits never coexist. converted_eps: the
    converted model's norm epsilon where it differs from the source's (latent_norm=linear).
    """
    norm_w = reader.get("model.norm.weight")
    head = reader.get("model.embed_tokens.weight" if tied else "lm_head.weight")

    def batches():
        for hs, hc, t in zip(h_src.split(4), h_cvt.split(4), ids.split(4)):
            logp = []
            for h, e in ((hs, eps), (hc, eps if converted_eps is None else converted_eps)):
                x = h.float()
                x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + e) * norm_w
                logp.append(torch.log_softmax((x[:, :-1] @ head.T).double(), -1).reshape(-1, head.shape[0]))
            yield logp[0], logp[1], t[:, 1:].reshape(-1)

    return agreement(batches())
