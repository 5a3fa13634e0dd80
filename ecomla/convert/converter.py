"""`ecomla convert`: stream a source checkpoint layer by layer into a stock DeepSeek-V3 checkpoint.

Run it as `ecomla convert RECIPE.yaml [--set mla.kv_lora_rank=64] [--force]`.

Memory. Only one layer's weights are in memory at a time; the output is written
shard by shard into a temporary directory that is renamed into place at the end.
With calibration data, the calibration and held-out hidden states of every
sequence are kept (N·T·d floats), and each layer is applied to them in turn,
so calibration also never holds more than one layer.

Reports. Every run writes `conversion_report.json` (ratios, KV elements, params,
per-layer ranks and weight energy kept); with calibration data it adds per-layer
held-out reconstruction error of keys and values and the perplexity of the
source and of the converted model on the held-out blocks.
"""

from __future__ import annotations

import json
import math
import time
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ecomla.convert.fit import make_fitter
from ecomla.convert.metrics import heldout_metrics, kv_errors
from ecomla.convert.plan import ConversionPlan, PlanError, deepseek_config, output_rope, source_inv_freq, splits_for
from ecomla.convert.source import LayerRunner, rotary_embedding
from ecomla.convert.to_mla import MLAGeometry, convert_attention, kv_rows, residual_rotation, rope_key, source_pair_spectra
from ecomla.convert.walk import Calibration, embed, layer_tensors, load_calibration, normalized_input, source_attention
from ecomla.io.checkpoint import AtomicCheckpointWriter
from ecomla.mla import latent
from ecomla.mla.budget import allocate_ranks, compression_ratio, mla_elements
from ecomla.mla.rope import RopeSplit, pair_norm_scores, rope_split
from ecomla.mla.rope_key import allocate_slots, inexpressible_reason, kept_energy
from ecomla.recipe.schema import recipe_to_dict, save_recipe


class Converter:
    """One conversion run: `run()` returns the report dict and leaves the checkpoint in place."""

    def __init__(self, plan: ConversionPlan, *, force: bool = False, progress: bool = True):
        self.plan = plan
        self.force = force
        self.progress = progress
        src = plan.source
        self.eps = float(src.config.rms_norm_eps)
        self.runner = LayerRunner(src.config, plan.device)
        self.calib: Calibration | None = None
        self.tokenizer = None
        cal = plan.recipe.init.calibration
        if cal is not None:
            self.tokenizer = AutoTokenizer.from_pretrained(src.directory)
            self.calib = load_calibration(cal, self.tokenizer)
        self.batch = cal.batch_size if cal is not None else 8

    # ---- walking the source on calibration tokens -------------------------------------------------
    def _prepass(self) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Per-layer stats needed before any layer is converted: RoPE pair scores, KV spectra, RoPE slot allocations."""
        plan, mla = self.plan, self.plan.recipe.mla
        need_scores = mla.rope_dims == "norm"
        need_spectra = mla.rank_allocation == "energy"
        need_slots = mla.rope_allocation == "energy"
        if not (need_scores or need_spectra or need_slots):
            return None, None, None
        L = plan.shape.num_layers
        scores, spectra, slots = [], [], []
        hidden = embed(self.plan.source.reader, self.calib.fit) if self.calib is not None else None
        method = plan.recipe.init.method
        base_split = None if (need_scores or need_slots) else splits_for(plan, None)[0]
        geo = self._geometry(plan.kv_rank)
        for i in tqdm(range(L), desc="prepass", disable=not self.progress):
            t = layer_tensors(plan.source.reader, i)
            src = source_attention(t)
            y = normalized_input(hidden, self.eps) if hidden is not None else None
            rope_cov = self._rope_cov(y, src)
            if need_scores:
                g = plan.shape
                q = y.double() @ src.q_w.T + (0 if src.q_b is None else src.q_b.double())
                k = y.double() @ src.k_w.T + (0 if src.k_b is None else src.k_b.double())
                scores.append(pair_norm_scores(q.view(-1, g.num_heads, g.head_dim), k.view(-1, g.num_kv_heads, g.head_dim)))
            if need_slots:
                slots.append(allocate_slots(source_pair_spectra(geo, src, rope_cov), plan.rope_dim // 2))
            if need_spectra:
                if need_slots:
                    split = self._slot_split(slots[-1])
                else:
                    split = base_split or splits_for(plan, [scores[-1]] * L)[0]
                residual = rope_key(geo, split, src, rope_cov).residual if geo.residual_dim else None
                M = kv_rows(geo, split, src, repeat=False, residual=residual)
                if method == "activation":
                    spectra.append(torch.linalg.eigvalsh(M @ latent.second_moment(y) @ M.T).flip(0).clamp_min(0))
                else:
                    spectra.append(torch.linalg.svdvals(M).square())
            if hidden is not None:
                hidden = self.runner.run(self.runner.build(i, t), hidden, self.batch)
            plan.source.reader.release()
        return (scores or None), (spectra or None), (slots or None)

    def _rope_cov(self, y: torch.Tensor | None, src) -> torch.Tensor | None:
        """rorope_act: the second moment of the key's inputs, y or [y; 1] with a key bias; None for the other modes."""
        if self.plan.recipe.mla.rope_key != "rorope_act":
            return None
        return latent.second_moment(y if src.k_b is None else torch.cat([y, torch.ones(len(y), 1, dtype=y.dtype)], 1))

    def _slot_split(self, counts: torch.Tensor) -> RopeSplit:
        """The split keeping the pairs of a one-component-per-pair slot allocation (`norm` ranks by the counts)."""
        s, mla = self.plan.shape, self.plan.recipe.mla
        return rope_split("norm", s.head_dim, self.plan.rope_dim, interleave=mla.rope_interleave, scores=counts.double())

    def _energy_splits(self, slots: list[torch.Tensor]) -> list[RopeSplit]:
        """rope_allocation=energy: the splits of the allocation, or a PlanError when stock RoPE cannot rotate it."""
        plan = self.plan
        rope_type = plan.source.rope_parameters.get("rope_type", "default")
        reason = inexpressible_reason(slots, plan.shape.head_dim, plan.rope_dim,
                                      float(plan.source.rope_parameters["rope_theta"]),
                                      allow_linear=rope_type != "llama3")
        if reason is not None:
            kept = ", ".join(f"{int(c.max())}x{int((c > 0).sum())}" for c in slots)
            raise PlanError([(
                f"mla.rope_allocation: energy cannot be written with stock DeepSeek-V3 RoPE: {reason}. "
                f"(components x pairs per layer: {kept}.) Use rope_allocation: fixed; its conversion_report.json "
                f"gives, per layer, the key energy each allocation keeps rotated (layers[i].rope_allocation)"
            )])
        return [self._slot_split(c) for c in slots]

    def _geometry(self, kv_width: int) -> MLAGeometry:
        plan, s = self.plan, self.plan.shape
        return MLAGeometry(
            hidden=s.hidden_size,
            n_heads=s.num_heads,
            n_kv=s.num_kv_heads,
            head_dim=s.head_dim,
            rope_dim=plan.rope_dim,
            kv_width=kv_width,
            q_rank=plan.recipe.mla.q_lora_rank,
            query_scale=self.query_scale,
            attention_bias=plan.attention_bias,
            rope_key=plan.recipe.mla.rope_key,
            interleave=plan.recipe.mla.rope_interleave,
            rope_residual=plan.recipe.mla.rope_residual,
        )

    # ---- the conversion ----------------------------------------------------------------------------
    def run(self) -> dict:
        plan, shape = self.plan, self.plan.shape
        recipe = plan.recipe
        t0 = time.time()
        L = shape.num_layers
        self.query_scale = 1.0  # provisional, for the prepass geometry (scale does not touch keys/values)
        scores, spectra, slots = self._prepass()
        if spectra is not None:
            ranks = allocate_ranks(
                spectra, plan.kv_rank * L, multiple=recipe.mla.energy_multiple,
                min_rank=min(recipe.mla.energy_multiple, plan.kv_rank), max_rank=shape.hidden_size,
            )
        else:
            ranks = [plan.kv_rank] * L
        plan.layer_ranks = ranks
        width = max(ranks)
        splits = self._energy_splits(slots) if slots is not None else splits_for(plan, scores)
        rope_params, fit = output_rope(plan, splits)
        out_cfg = deepseek_config(plan, width, rope_params)
        self.query_scale = self._query_scale(out_cfg)
        geo = self._geometry(width)
        rope_report = self._rope_report(out_cfg, splits, fit)

        cvt_runner = LayerRunner(out_cfg, plan.device)
        gen = torch.Generator().manual_seed(recipe.seed)
        calib = self.calib
        h_fit = embed(self.plan.source.reader, calib.fit) if calib is not None else None
        h_src = embed(self.plan.source.reader, calib.heldout) if calib is not None and calib.heldout is not None else None
        h_cvt = h_src.clone() if h_src is not None else None

        layers_report = []
        params_after = 0
        with AtomicCheckpointWriter(recipe.output_dir, overwrite=self.force) as writer:
            bar = tqdm(range(L), desc="convert", unit="layer", disable=not self.progress)
            for i in bar:
                t = layer_tensors(plan.source.reader, i)
                src = source_attention(t)
                y_fit = normalized_input(h_fit, self.eps) if h_fit is not None else None
                fitter = make_fitter(recipe.init.method, y_fit, recipe.init.ridge, gen, out_cfg.initializer_range)
                q_fitter = None
                if geo.q_rank is not None:
                    q_method = "svd" if recipe.init.method == "random" else recipe.init.method
                    q_fitter = make_fitter(q_method, y_fit, recipe.init.ridge, gen, out_cfg.initializer_range)
                rope_cov = self._rope_cov(y_fit, src)
                res = convert_attention(geo, splits[i], src, ranks[i], fitter, q_fitter, rope_cov,
                                        self._residual_rotation(geo, splits[i]))
                out_t = {f"self_attn.{k}": v for k, v in res.tensors.items()}
                out_t["input_layernorm.weight"] = torch.ones(shape.hidden_size)  # gain folded into the projections
                for k in ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                    out_t[k] = t[k]
                out_t = {k: v.to(plan.out_dtype) for k, v in out_t.items()}
                for k, v in out_t.items():
                    writer.add(f"model.layers.{i}.{k}", v)
                params_after += sum(v.numel() for v in out_t.values())

                entry = {"layer": i, "kv_lora_rank": ranks[i], "kv_weight_energy_kept": res.kv_basis.energy_kept,
                         "rope_key_energy_kept": res.rope.energy_kept}
                if res.q_basis is not None:
                    entry["q_weight_energy_kept"] = res.q_basis.energy_kept
                if splits[i].pairs is not None:
                    entry["rope_pairs"] = list(splits[i].pairs)
                if geo.rope_key != "mean":
                    entry["rope_allocation"] = self._allocation_entry(geo, src, res.rope, rope_cov)
                if h_src is not None:
                    y_held = normalized_input(h_src, self.eps)
                    k_err, v_err = kv_errors(geo, splits[i], src, res.tensors, y_held, res.rope.head_scale, res.rope.residual)
                    entry.update(heldout_key_rel_error=k_err, heldout_value_rel_error=v_err)
                    h_cvt = cvt_runner.run(cvt_runner.build(i, {k: v.float() for k, v in out_t.items()}), h_cvt, self.batch)
                if h_fit is not None or h_src is not None:
                    src_layer = self.runner.build(i, t)
                    if h_fit is not None and i + 1 < L:
                        h_fit = self.runner.run(src_layer, h_fit, self.batch)
                    if h_src is not None:
                        h_src = self.runner.run(src_layer, h_src, self.batch)
                layers_report.append(entry)
                plan.source.reader.release()
                if "heldout_key_rel_error" in entry:
                    bar.set_postfix(k_err=f"{entry['heldout_key_rel_error']:.3f}", v_err=f"{entry['heldout_value_rel_error']:.3f}")

            reader = plan.source.reader
            top = {"model.embed_tokens.weight": reader.get("model.embed_tokens.weight", dtype=None), "model.norm.weight": reader.get("model.norm.weight", dtype=None)}
            if not plan.source.tied:
                top["lm_head.weight"] = reader.get("lm_head.weight", dtype=None)
            for k, v in top.items():
                writer.add(k, v.to(plan.out_dtype))
                params_after += v.numel()

            heldout = None
            if h_src is not None:
                heldout = heldout_metrics(h_src, h_cvt, calib.heldout, reader, plan.source.tied, self.eps)
            out_cfg.save_pretrained(writer.path)
            copied = writer.copy_files(plan.source.directory)
            report = self._report(ranks, width, params_after, layers_report, rope_report, heldout, copied, time.time() - t0)
            (writer.path / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
            save_recipe(recipe, writer.path / "ecomla_recipe.yaml")
            writer.commit()
        return report

    def _residual_rotation(self, geo: MLAGeometry, split: RopeSplit) -> torch.Tensor | None:
        """rope_residual=latent_mean: the residual query rows' maps, the source's rotation averaged (to_mla)."""
        if not geo.residual_dim or self.plan.recipe.mla.rope_residual != "latent_mean":
            return None
        return residual_rotation(geo, split, source_inv_freq(self.plan), self.residual_context)

    @property
    def residual_context(self) -> int:
        """T of rope_residual=latent_mean: the recipe's, else the calibration sequence length, else the source's."""
        recipe = self.plan.recipe
        if recipe.mla.rope_residual_context is not None:
            return recipe.mla.rope_residual_context
        if recipe.init.calibration is not None:
            return recipe.init.calibration.seq_len
        return int(self.plan.source.config.max_position_embeddings)

    def _allocation_entry(self, geo: MLAGeometry, src, rope, rope_cov) -> dict:
        """Share of the whole key energy kept rotated by the fixed allocation (this conversion's) and by `energy`."""
        spectra = source_pair_spectra(geo, src, rope_cov)
        slots = allocate_slots(spectra, self.plan.rope_dim // 2)
        total = float(spectra.sum())
        fixed = rope.energy_kept * rope.pair_energy / total if total > 0 else 1.0
        return {"fixed_energy_kept": fixed, "energy_energy_kept": kept_energy(spectra, slots),
                "energy_slots": {str(j): int(c) for j, c in enumerate(slots.tolist()) if c}}

    def _query_scale(self, out_cfg) -> float:
        """s_src / s_out: the stock softmax scale is (nope + rope)^-0.5 (with YaRN mscale); the source's d_h^-0.5."""
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

        with torch.device("meta"):
            s_out = DeepseekV3Attention(out_cfg, 0).scaling
        return self.plan.shape.head_dim ** -0.5 / s_out

    def _rope_report(self, out_cfg, splits: list[RopeSplit], fit) -> dict:
        """Is every kept pair turning at its source frequency? Measured on the real rotary modules."""
        src_f = source_inv_freq(self.plan)
        out_f = rotary_embedding(out_cfg).inv_freq.double()
        errs = []
        for s in splits:
            pairs = s.pairs if s.pairs is not None else (tuple(range(len(src_f))) if len(out_f) == len(src_f) else None)
            if pairs is None:
                errs.append(float("inf"))
                continue
            errs.append(float((out_f / src_f[list(pairs)] - 1).abs().max()))
        worst = max(errs)
        return {
            "rope_dims": self.plan.recipe.mla.rope_dims,
            "rope_key": self.plan.recipe.mla.rope_key,
            "rope_residual": self.plan.recipe.mla.rope_residual,
            "rope_allocation": self.plan.recipe.mla.rope_allocation,
            "qk_nope_head_dim": self.plan.shape.head_dim - self.plan.rope_dim + self.plan.residual_dim,
            "rope_residual_context": self.residual_context if self.plan.recipe.mla.rope_residual == "latent_mean" else None,
            "rope_parameters": dict(out_cfg.rope_parameters),
            "rope_interleave": out_cfg.rope_interleave,
            "exact": worst < 1e-6,
            "max_rel_frequency_error": None if math.isinf(worst) else worst,
        }

    def _report(self, ranks, width, params_after, layers, rope, heldout, copied, seconds) -> dict:
        plan, shape = self.plan, self.plan.shape
        params_before = sum(math.prod(plan.source.reader.shape(n)) for n in plan.source.reader.names()
                            if not (plan.source.tied and n == "lm_head.weight"))
        report = {
            "source": plan.recipe.model,
            "source_family": plan.source.family,
            "output_dir": plan.recipe.output_dir,
            "init_method": plan.recipe.init.method,
            "compression_ratio": compression_ratio(shape, ranks, plan.rope_dim),
            "stock_cache_compression_ratio": compression_ratio(shape, width, plan.rope_dim),
            "kv_elements_per_token_per_layer": {"before": shape.kv_elements, "after": [mla_elements(r, plan.rope_dim) for r in ranks]},
            "kv_lora_rank": width,
            "qk_rope_head_dim": plan.rope_dim,
            "q_lora_rank": plan.recipe.mla.q_lora_rank,
            "params": {"before": params_before, "after": params_after},
            "rope": rope,
            "layers": layers,
            "files_copied": copied,
            "seconds": seconds,
            "recipe": recipe_to_dict(plan.recipe),
        }
        if heldout is not None:
            report["heldout"] = heldout
        return report


