"""`init.refit: values`: one converted layer's value path refitted through its own attention.

The math is `ecomla.mla.refit`'s. Here: take the source layer's attention output on the source's
calibration states (the output to reproduce, kept from the source walk), run the converted layer's
attention on the converted model's own calibration states (the student's probabilities and latents),
and rewrite `o_proj` and the value rows of `kv_b_proj`. The target also carries the drift
h_src − h_student that the earlier converted layers left in the residual stream, so each layer corrects
what came before it where attention can.
"""

from __future__ import annotations

import torch

from ecomla.convert.source import LayerRunner, causal_mask
from ecomla.convert.to_mla import MLAGeometry
from ecomla.mla.refit import ValueMoments, solve_value_path, value_map, value_path_error


@torch.no_grad()
def refit_values(geo: MLAGeometry, index: int, tensors: dict[str, torch.Tensor], cvt_runner: LayerRunner,
                 h_src: torch.Tensor, h_student: torch.Tensor, wanted: torch.Tensor, ridge: float,
                 batch: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Layer `index`'s output tensors (names relative to the layer, float32) with o_proj and kv_b_proj's value
    rows refitted, and the report entry (the relative squared error of the value path on the calibration
    tokens before and after). cvt_runner must run eager attention (it returns the probabilities).

    h_src, h_student (N, T, d): the layer's input states on the calibration blocks in the source and in
    the converted model; wanted (N, T, d): the source attention's output on h_src
    (`LayerRunner.run_with_attention`, which the source walk runs anyway).
    """
    n_h, r, d_v, nope, d = geo.n_heads, geo.kv_lora_rank, geo.v_head_dim, geo.qk_nope_head_dim, geo.hidden
    layer = cvt_runner.build(index, tensors)
    attn = layer.self_attn
    T = h_src.shape[1]
    device, dtype = cvt_runner.device, cvt_runner.dtype
    mask, pos = causal_mask(T, dtype, device), torch.arange(T, device=device)[None]
    o_bias = tensors.get("self_attn.o_proj.bias")
    moments = ValueMoments(n_h * r, d)
    for hs, hc, want in zip(h_src.split(batch), h_student.split(batch), wanted.split(batch)):
        hs, hc, want = hs.to(device, dtype), hc.to(device, dtype), want.to(device, dtype)
        x = layer.input_layernorm(hc)
        _, probs = attn(x, cvt_runner.rotary(hc, pos), mask)  # (B, n_h, T, T)
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., :r])  # (B, T, r)
        z = (probs @ latent[:, None]).transpose(1, 2).reshape(-1, n_h * r)  # (B·T, n_h·r): what each head reads
        target = want + hs - hc - (0 if o_bias is None else o_bias.to(device, dtype))
        moments.add(z.cpu(), target.reshape(-1, d).cpu())
    kv_b = tensors["self_attn.kv_b_proj.weight"].double().view(n_h, nope + d_v, r).clone()
    o_before = tensors["self_attn.o_proj.weight"].double()
    before = value_path_error(moments, o_before, kv_b[:, nope:])
    o_w, uv = solve_value_path(moments, n_h, d_v, ridge, prior=value_map(o_before, kv_b[:, nope:]))
    kv_b[:, nope:] = uv
    out = dict(tensors)
    out["self_attn.o_proj.weight"] = o_w.float()
    out["self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, r).float()
    return out, {"refit_error_before": before, "refit_error_after": value_path_error(moments, o_w, uv)}
