"""The MLA layer transform: one source attention layer in, its stock DeepSeek-V3 layer out, as the plan says.

`ecomla.convert.stream` walks the source and hands this transform one layer at a
time. Per layer it reads the plan's entry (the latent's rank, the RoPE rows), fits
the latent (`init.method`) on the layer's calibration inputs, and returns the
output tensors and the layer's report entry. With calibration data it carries the
calibration and held-out hidden states from layer to layer (N·T·d floats each), so
only one layer's weights are ever in memory; held-out blocks also run through the
converted layer, for the per-layer K/V error and, at the end, the perplexity, KL
and top-1 agreement of the converted model against the source.

`fit_layer` is the fit alone, shared with `ecomla analyze recon`.
"""

from __future__ import annotations

import math

import torch

from ecomla.convert import presets
from ecomla.convert.metrics import heldout_metrics, kv_errors
from ecomla.convert.plan import MLAPlan, rope_covariance, source_inv_freq
from ecomla.convert.source import LayerRunner, rotary_embedding
from ecomla.convert.refit import refit_values
from ecomla.convert.to_mla import (
    DISTANCE_TOKENS,
    LatentObjective,
    LayerResult,
    SourceAttention,
    attention_rotation,
    convert_attention,
    make_fitter,
    residual_rotation,
    source_pair_spectra,
    read_attention,
)
from ecomla.convert.walk import embed, normalized_input, source_attention
from ecomla.mla import engines, latent
from ecomla.mla.budget import compression_ratio, mla_elements
from ecomla.mla.rope_key import allocate_slots, kept_energy

# Source tensors of a layer that pass through unchanged (the input norm's gain is folded into the projections)
COPIED = ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def fit_layer(plan: MLAPlan, i: int, src: SourceAttention, y: torch.Tensor | None,
              gen: torch.Generator) -> tuple[LayerResult, torch.Tensor | None]:
    """Layer i's MLA tensors, fitted (init.method) on its normalized inputs y.

    Returns the layer's result and the RoPE key's input second moment (rorope_act; None otherwise).
    """
    geo, layer, init = plan.geometry, plan.layers[i], plan.recipe.init
    method = init.method
    std = plan.config.initializer_range
    needs_cov = y is not None and (method == "activation" or (geo.rope_key == "rorope_act" and src.k_b is None))
    # One pass of the source attention over the calibration blocks, for what reads it: init.token_weights (each
    # token's weight in the fits of what keys and values hold: the K/V latent and the RoPE key; the query latent
    # serves every query alike) and rope_residual_distances=attention.
    latent_mean = geo.residual_dim > 0 and geo.rope_residual == "latent_mean"  # the residual query rows' rotation
    want_weights = y is not None and init.token_weights == "attention"
    want_distances = y is not None and latent_mean and plan.recipe.mla.rope_residual_distances == "attention"
    inv_freq = source_inv_freq(plan.source) if latent_mean or want_weights else None
    reading = None
    if want_weights or want_distances:
        reading = read_attention(geo, src, y, init.calibration.seq_len, inv_freq,
                                 distance_tokens=DISTANCE_TOKENS if want_distances else 0, received=want_weights)
    weights = reading.received.pow(init.token_weight_power) if want_weights else None
    y_cov = latent.second_moment(y, weights) if needs_cov else None  # once for the activation fits and the RoPE key
    fit_kv = make_fitter(method, y, init.ridge, gen, std, latent_scale=geo.latent_scale, y_cov=y_cov, weights=weights)
    # init.query_moment=uniform: the key rows' query term counts every query alike, as the output does (and as the
    # query latent's fit does, which takes the same moment)
    uniform_queries = weights is not None and init.objective == "attention" and init.query_moment == "uniform"
    query_cov = latent.second_moment(y) if uniform_queries else None
    fit_q = None
    if geo.q_lora_rank is not None:
        q_cov = y_cov if weights is None else query_cov  # the unweighted moment, where one is at hand
        fit_q = make_fitter("svd" if method == "random" else method, y, init.ridge, gen, std, y_cov=q_cov)
    rope_cov = rope_covariance(geo, y, src, y_cov, weights)
    rotation = None
    if latent_mean:  # the residual query rows' averaged rotation
        if want_distances:
            rotation = attention_rotation(geo, layer.rope, reading.distances, inv_freq)
        else:
            rotation = residual_rotation(geo, layer.rope, inv_freq, plan.rope_residual_context)
    objective = LatentObjective(init.objective, init.key_weight, init.kv_balance, query_cov)
    result = convert_attention(geo, layer.rope, src, layer.kv_lora_rank, fit_kv, fit_q, rope_cov, rotation, objective)
    return result, rope_cov


class MLATransform:
    """target: mla. `layer(i, tensors)` -> (output tensors, report entry); `finish()` -> the report's MLA fields."""

    def __init__(self, plan: MLAPlan):
        self.plan = plan
        source = plan.source
        self.eps = float(source.config.rms_norm_eps)
        self.runner = LayerRunner(source.config, plan.device)
        self.cvt_runner = LayerRunner(plan.config, plan.device)
        self.gen = torch.Generator().manual_seed(plan.recipe.seed)
        cal = plan.recipe.init.calibration
        self.batch = cal.batch_size if cal is not None else 8
        calib = plan.calibration
        self.h_fit = embed(source.reader, calib.fit) if calib is not None else None
        self.h_src = embed(source.reader, calib.heldout) if calib is not None and calib.heldout is not None else None
        self.h_cvt = self.h_src.clone() if self.h_src is not None else None
        # init.refit: the converted model's own calibration states, and a runner that returns attention probabilities
        self.refit = plan.recipe.init.refit != "none"
        self.h_fit_cvt = self.h_fit.clone() if self.refit else None
        self.refit_runner = LayerRunner(plan.config, plan.device, attn_implementation="eager") if self.refit else None

    def layer(self, i: int, stored: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        plan, geo = self.plan, self.plan.geometry
        t = {k: v.float() for k, v in stored.items()}
        src = source_attention(t)
        y_fit = normalized_input(self.h_fit, self.eps) if self.h_fit is not None else None
        res, rope_cov = fit_layer(plan, i, src, y_fit, self.gen)
        split = plan.layers[i].rope
        out = {f"self_attn.{k}": v.float() for k, v in res.tensors.items()}
        # The source gain is folded into the projections; the output's gain is geo.input_gain (1 unless linear latent)
        out["input_layernorm.weight"] = torch.full((geo.hidden,), geo.input_gain)
        out.update({k: t[k] for k in COPIED})
        src_layer = self.runner.build(i, t) if (self.h_fit is not None or self.h_src is not None) else None
        entry = {"layer": i, "kv_lora_rank": plan.layers[i].kv_lora_rank,
                 "kv_weight_energy_kept": res.kv_basis.energy_kept, "rope_key_energy_kept": res.rope.energy_kept}
        last = i + 1 == plan.shape.num_layers
        # The source walk on the calibration blocks: the next layer's inputs and, to refit, the attention output
        # that the same pass computes on the way (the target of `refit_values`).
        next_fit = wanted = None
        if self.h_fit is not None and (self.refit or not last):
            next_fit, wanted = self.runner.run_with_attention(src_layer, self.h_fit, self.batch, self.refit)
        next_cvt = None  # the converted model's next calibration states, when the refit can hand them on
        if self.refit:
            out, refit_entry, next_cvt = refit_values(
                geo, i, out, self.refit_runner, self.h_fit, self.h_fit_cvt, wanted, plan.recipe.init.refit_ridge,
                self.batch, next_states=not last and plan.out_dtype == self.refit_runner.dtype)
            entry.update(refit_entry)  # the held-out K/V errors below stay those of the latent fit (res.tensors)
        del wanted
        out = {k: v.to(plan.out_dtype) for k, v in out.items()}
        if res.q_basis is not None:
            entry["q_weight_energy_kept"] = res.q_basis.energy_kept
        if split.pairs is not None:
            entry["rope_pairs"] = list(split.pairs)
        if geo.rope_key != "mean":
            entry["rope_allocation"] = self._allocation_entry(src, res.rope, rope_cov)
        converted = None
        if self.h_src is not None or (self.refit and next_cvt is None and not last):
            converted = self.cvt_runner.build(i, {k: v.float() for k, v in out.items()})
        if self.h_src is not None:
            y_held = normalized_input(self.h_src, self.eps)
            k_err, v_err = kv_errors(geo, split, src, res.tensors, y_held, res.rope.head_scale, res.rope.residual)
            entry.update(heldout_key_rel_error=k_err, heldout_value_rel_error=v_err)
            self.h_cvt = self.cvt_runner.run(converted, self.h_cvt, self.batch)
        if next_cvt is not None:
            self.h_fit_cvt = next_cvt
        elif self.refit and not last:
            self.h_fit_cvt = self.cvt_runner.run(converted, self.h_fit_cvt, self.batch)
        if next_fit is not None and not last:
            self.h_fit = next_fit
        if self.h_src is not None:
            self.h_src = self.runner.run(src_layer, self.h_src, self.batch)
        return out, entry

    @staticmethod
    def postfix(entry: dict) -> dict[str, str]:
        if "heldout_key_rel_error" not in entry:
            return {}
        return {"k_err": f"{entry['heldout_key_rel_error']:.3f}", "v_err": f"{entry['heldout_value_rel_error']:.3f}"}

    def _allocation_entry(self, src: SourceAttention, rope, rope_cov) -> dict:
        """Share of the whole key energy kept rotated by the fixed allocation (this conversion's) and by `energy`."""
        spectra = source_pair_spectra(self.plan.geometry, src, rope_cov)
        slots = allocate_slots(spectra, self.plan.geometry.qk_rope_head_dim // 2)
        total = float(spectra.sum())
        fixed = rope.energy_kept * rope.pair_energy / total if total > 0 else 1.0
        return {"fixed_energy_kept": fixed, "energy_energy_kept": kept_energy(spectra, slots),
                "energy_slots": {str(j): int(c) for j, c in enumerate(slots.tolist()) if c}}

    def finish(self) -> dict:
        """The report's MLA fields, after the last layer: ratios, ranks, RoPE, and the held-out measurement."""
        plan, geo, shape = self.plan, self.plan.geometry, self.plan.shape
        ranks = [layer.kv_lora_rank for layer in plan.layers]
        d_r = geo.qk_rope_head_dim
        fields = {
            "init_method": plan.recipe.init.method,
            "preset": presets.expansion(plan.recipe.init.preset, plan.recipe.mla, plan.recipe.init),
            "kv_balance": plan.recipe.init.kv_balance,
            "compression_ratio": compression_ratio(shape, ranks, d_r),
            "stock_cache_compression_ratio": compression_ratio(shape, geo.kv_lora_rank, d_r),
            "kv_elements_per_token_per_layer": {"before": shape.kv_elements,
                                                "after": [mla_elements(r, d_r) for r in ranks]},
            "kv_lora_rank": geo.kv_lora_rank,
            "qk_rope_head_dim": d_r,
            "q_lora_rank": geo.q_lora_rank,
            "qk_nope_head_dim": geo.qk_nope_head_dim,
            "servable_by": engines.servable_by(geo.kv_lora_rank, d_r, geo.qk_nope_head_dim),
            "rope": self._rope_report(),
        }
        if self.h_src is not None:
            fields["heldout"] = heldout_metrics(self.h_src, self.h_cvt, plan.calibration.heldout, plan.source.reader,
                                                plan.source.tied, self.eps, float(plan.config.rms_norm_eps))
        return fields

    def _rope_report(self) -> dict:
        """Is every kept pair turning at its source frequency? Measured on the real rotary modules."""
        plan, mla = self.plan, self.plan.recipe.mla
        src_f = source_inv_freq(plan.source)
        out_f = rotary_embedding(plan.config).inv_freq.double()
        errs = []
        for layer in plan.layers:
            pairs = layer.rope.pairs
            if pairs is None:
                pairs = tuple(range(len(src_f))) if len(out_f) == len(src_f) else None
            errs.append(float("inf") if pairs is None else float((out_f / src_f[list(pairs)] - 1).abs().max()))
        worst = max(errs)
        return {
            "rope_dims": mla.rope_dims,
            "rope_key": mla.rope_key,
            "rope_residual": mla.rope_residual,
            "rope_allocation": mla.rope_allocation,
            "qk_nope_head_dim": plan.geometry.qk_nope_head_dim,
            "rope_residual_context": plan.rope_residual_context if mla.rope_residual == "latent_mean" else None,
            "rope_parameters": dict(plan.config.rope_parameters),
            "rope_interleave": plan.config.rope_interleave,
            "exact": worst < 1e-6,
            "max_rel_frequency_error": None if math.isinf(worst) else worst,
        }
