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

# The next calibration states come from what the heads read (kept, N·T·n_h·r floats) when that is at most this
# many times the hidden states (N·T·d); wider latents rerun the converted layer instead.
KEEP_FEATURES = 4


@torch.no_grad()
def refit_values(geo: MLAGeometry, index: int, tensors: dict[str, torch.Tensor], cvt_runner: LayerRunner,
                 h_src: torch.Tensor, h_student: torch.Tensor, wanted: torch.Tensor, ridge: float,
                 batch: int, next_states: bool = False) -> tuple[dict[str, torch.Tensor], dict, torch.Tensor | None]:
    """Layer `index`'s output tensors (names relative to the layer, float32) with o_proj and kv_b_proj's value
    rows refitted, the report entry (the relative squared error of the value path on the calibration
    tokens before and after), and the refitted layer's output on h_student (the converted model's next
    calibration states), or None. cvt_runner must run eager attention (it returns the probabilities).

    h_src, h_student (N, T, d): the layer's input states on the calibration blocks in the source and in
    the converted model; wanted (N, T, d): the source attention's output on h_src
    (`LayerRunner.run_with_attention`, which the source walk runs anyway).

    The next states (next_states=True, for a layer written in cvt_runner's dtype, so the layer the refit runs is
    the one written, and what the heads read no wider than `KEEP_FEATURES` times the hidden size): from what
    each head read (z, kept), the refitted value path and the layer's own norm and MLP, instead of a second
    run of the converted attention, whose probabilities the value path does not change. Otherwise None, and
    the caller runs the layer.
    """
    n_h, r, d_v, nope, d = geo.n_heads, geo.kv_lora_rank, geo.v_head_dim, geo.qk_nope_head_dim, geo.hidden
    layer = cvt_runner.build(index, tensors)
    attn = layer.self_attn
    T = h_src.shape[1]
    device, dtype = cvt_runner.device, cvt_runner.dtype
    mask, pos = causal_mask(T, dtype, device), torch.arange(T, device=device)[None]
    o_bias = tensors.get("self_attn.o_proj.bias")
    bias = None if o_bias is None else o_bias.to(device, dtype)
    moments = ValueMoments(n_h * r, d)
    kept = [] if next_states and n_h * r <= KEEP_FEATURES * d else None
    for hs, hc, want in zip(h_src.split(batch), h_student.split(batch), wanted.split(batch)):
        hs, hc, want = hs.to(device, dtype), hc.to(device, dtype), want.to(device, dtype)
        x = layer.input_layernorm(hc)
        _, probs = attn(x, cvt_runner.rotary(hc, pos), mask)  # (B, n_h, T, T)
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., :r])  # (B, T, r)
        z = (probs @ latent[:, None]).transpose(1, 2).reshape(-1, n_h * r)  # (B·T, n_h·r): what each head reads
        target = want + hs - hc - (0 if bias is None else bias)
        moments.add(z.cpu(), target.reshape(-1, d).cpu())
        if kept is not None:
            kept.append(z.cpu())
    kv_b = tensors["self_attn.kv_b_proj.weight"].double().view(n_h, nope + d_v, r).clone()
    o_before = tensors["self_attn.o_proj.weight"].double()
    before = value_path_error(moments, o_before, kv_b[:, nope:])
    o_w, uv = solve_value_path(moments, n_h, d_v, ridge, prior=value_map(o_before, kv_b[:, nope:]))
    kv_b[:, nope:] = uv
    out = dict(tensors)
    out["self_attn.o_proj.weight"] = o_w.float()
    out["self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, r).float()
    entry = {"refit_error_before": before, "refit_error_after": value_path_error(moments, o_w, uv)}
    if kept is None:
        return out, entry, None
    # The refitted layer on the converted model's states: attention output Σ_h W_o,h·W_UV,h·z_h (+ bias), then
    # the stock layer's residual, post-attention norm and MLP.
    uv_w = out["self_attn.kv_b_proj.weight"].view(n_h, nope + d_v, r)[:, nope:].to(device, dtype)  # (n_h, d_v, r)
    o_w_w = out["self_attn.o_proj.weight"].to(device, dtype)
    nxt = []
    for z, hc in zip(kept, h_student.split(batch)):
        hc = hc.to(device, dtype)
        v = z.to(device, dtype).view(-1, n_h, r).transpose(0, 1) @ uv_w.transpose(1, 2)  # (n_h, B·T, d_v)
        h1 = hc + torch.nn.functional.linear(v.transpose(0, 1).reshape(-1, n_h * d_v), o_w_w, bias).view(hc.shape)
        nxt.append((h1 + layer.mlp(layer.post_attention_layernorm(h1))).to(h_student.dtype).cpu())
    return out, entry, torch.cat(nxt)
