"""`ecomla convert` to the targets other than MLA: fewer KV heads (gqa, mqa) and LRKV (lrkv).

    ecomla convert recipes/convert/llama3.2-1b-instruct_gqa4.yaml     # target: gqa, gqa.num_key_value_heads: 4
    ecomla convert recipes/convert/llama3.2-1b-instruct_lrkv16.yaml   # target: lrkv, lrkv.rank: 16

Notation: n_h query heads, n_kv source KV heads, d_h head width, D hidden size, g output KV
heads, r LRKV residual rank.

The common view. A layer's K (or V) projection is read as one affine map per query head,
[W_h | b_h] (d_h × (D+1), the bias column only where the source has one): a GQA source's KV
head is repeated for every query head that reads it (query head h reads KV head h // (n_h/n_kv),
as transformers' repeat_kv). Only k_proj/v_proj and their biases change. Every other tensor,
RMSNorm gains included, is copied as stored (cast only if `dtype` asks); no calibration data.

gqa / mqa (the grouping rule). n_h % g == 0 (mqa: g = 1). Query head h of the output reads KV
head h // (n_h/g), so output KV head j serves the consecutive query heads j·n_h/g … (j+1)·n_h/g − 1,
and it is set to the mean of their per-query-head maps, which minimizes their summed squared
Frobenius error. In terms of source KV heads:
  - g divides n_kv: head j is the plain mean of the n_kv/g consecutive source KV heads j·n_kv/g …;
  - g is a multiple of n_kv: each group reads a single source head, so output heads are copies
    and the model is exact (g = n_kv reproduces the source);
  - otherwise (n_kv 4 → g 6 with 12 query heads): a group straddling two source heads gets their
    mean weighted by how many of its query heads read each.
RoPE acts after the projection and identically on every head, so pooling the weights pools the
rotated keys. Output: the source family's own class and config (LlamaForCausalLM, ...) with
num_key_value_heads = g; Qwen2's k/v biases are pooled with their weights.

lrkv. The per-query-head maps (n_h, d_h, D) go through ecomla.lrkv.convert.shared_lowrank: the
mean head is the shared projection, each head's residual is truncated to rank r by SVD (exact at
r = min(D, d_h)). Output: an LrkvForCausalLM checkpoint (model_type "lrkv", loads with
AutoModelForCausalLM after `import ecomla`). Sources with attention biases are refused: LRKV's
residual paths carry none. LRKV caches 2·(d_h + n_h·r) numbers per token and layer, so it only
shrinks a GQA source's cache below r = (n_kv − 1)·d_h/n_h (the report gives this break-even rank).

`TargetTransform` is the layer transform that `ecomla.convert.stream` applies, one source layer at
a time. Report (conversion_report.json): KV numbers before and after, the compression ratio, and
the per-layer relative Frobenius error of the K and V maps over all query heads.
"""

from __future__ import annotations

import torch

from ecomla.convert.plan import TargetPlan
from ecomla.mla.budget import kv_elements_per_token
from ecomla.mla.latent import relative_error

SOURCE_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")


# ---- math: tensors in, tensors out ---------------------------------------------------------------


def per_query_head(weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, head_dim: int) -> torch.Tensor:
    """A K or V projection (n_kv·d_h, D) and optional bias (n_kv·d_h,) as per-query-head maps (n_h, d_h, D[+1])."""
    from ecomla.lrkv.convert import expand_kv_heads  # loads the LRKV model only where a conversion needs it

    affine = weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)  # (n_kv·d_h, D+1): [W | b]
    return expand_kv_heads(affine, num_heads, head_dim)


def pool_groups(heads: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-query-head maps (n_h, d_h, D') -> (g, d_h, D'): the mean over each run of n_h/g consecutive heads."""
    n_h, d_h, width = heads.shape
    if groups < 1 or n_h % groups:
        raise ValueError(f"{groups} KV groups do not divide {n_h} query heads")
    return heads.view(groups, n_h // groups, d_h, width).mean(dim=1)  # (g, n_h/g, d_h, D') -> (g, d_h, D')


# ---- the layer transform of the streaming conversion (ecomla.convert.stream) ---------------------


class TargetTransform:
    """target gqa, mqa or lrkv: K/V projections pooled or split, every other tensor copied as stored."""

    def __init__(self, plan: TargetPlan):
        self.plan = plan

    def layer(self, i: int, stored: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        out = {k: v for k, v in stored.items() if k not in SOURCE_KV}  # copied as stored
        kv, entry = convert_kv(self.plan, stored)
        out.update(kv)
        return out, {"layer": i, **entry}

    @staticmethod
    def postfix(entry: dict) -> dict[str, str]:
        return {"k_err": f"{entry['k_weight_rel_error']:.3f}", "v_err": f"{entry['v_weight_rel_error']:.3f}"}

    def finish(self) -> dict:
        plan, shape = self.plan, self.plan.shape
        before = kv_elements_per_token(plan.source.config.to_dict())
        after = kv_elements_per_token(plan.config.to_dict())
        L = shape.num_layers
        fields = {
            "compression_ratio": before / after,
            "kv_elements_per_token": {"before": before, "after": after},
            "kv_elements_per_token_per_layer": {"before": before // L, "after": after // L},
        }
        if plan.kv_heads is not None:
            fields["num_key_value_heads"] = {"before": shape.num_kv_heads, "after": plan.kv_heads}
        else:
            fields["lrkv_rank"] = plan.rank
            # 2·(d_h + n_h·r) <= 2·n_kv·d_h  <=>  r <= (n_kv − 1)·d_h / n_h
            fields["lrkv_break_even_rank"] = (shape.num_kv_heads - 1) * shape.head_dim // shape.num_heads
        fields["dtype"] = str(plan.out_dtype).removeprefix("torch.")
        return fields


def convert_kv(plan: TargetPlan, t: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """One layer's output K/V tensors (names relative to the layer) and its report entry."""
    shape = plan.source.shape
    n_h, d_h, D = shape.num_heads, shape.head_dim, shape.hidden_size
    out, entry = {}, {}
    for kind in ("k", "v"):
        bias = t.get(f"self_attn.{kind}_proj.bias")
        exact = per_query_head(
            t[f"self_attn.{kind}_proj.weight"].to(plan.device, torch.float64),
            None if bias is None else bias.to(plan.device, torch.float64),
            n_h,
            d_h,
        )  # (n_h, d_h, D[+1])
        if plan.kv_heads is not None:
            g = plan.kv_heads
            pooled = pool_groups(exact, g)  # (g, d_h, D[+1])
            approx = pooled.repeat_interleave(n_h // g, dim=0)  # what each query head now reads
            out[f"self_attn.{kind}_proj.weight"] = pooled[..., :D].reshape(g * d_h, D)
            if bias is not None:
                out[f"self_attn.{kind}_proj.bias"] = pooled[..., D].reshape(g * d_h)
        else:
            from ecomla.lrkv.convert import shared_lowrank

            split = shared_lowrank(exact, plan.rank)
            approx = split.heads()
            out[f"self_attn.{kind}_shared.weight"] = split.shared  # (d_h, D)
            out[f"self_attn.{kind}_down.weight"] = split.down_weight()  # (n_h·r, D)
            out[f"self_attn.{kind}_up"] = split.up  # (n_h, r, d_h)
            entry[f"{kind}_residual_energy_kept"] = split.energy_kept
        entry[f"{kind}_weight_rel_error"] = relative_error(exact, approx)
    return out, entry
