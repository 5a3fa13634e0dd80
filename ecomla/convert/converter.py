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
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ecomla.convert.plan import ConversionPlan, deepseek_config, output_rope, source_inv_freq, splits_for
from ecomla.convert.recipe import CalibrationConfig
from ecomla.convert.source import LayerRunner, rotary_embedding
from ecomla.convert.to_mla import MLAGeometry, SourceAttention, convert_attention, kv_rows
from ecomla.data.text import iter_texts, token_blocks
from ecomla.io.checkpoint import AtomicCheckpointWriter
from ecomla.mla import latent
from ecomla.mla.budget import allocate_ranks, compression_ratio, mla_elements
from ecomla.mla.rope import RopeSplit, pair_norm_scores
from ecomla.recipe.schema import recipe_to_dict, save_recipe


@dataclass
class Calibration:
    """Token blocks for fitting and for held-out measurement."""

    fit: torch.Tensor  # (n_fit, T) token ids
    heldout: torch.Tensor | None  # (n_held, T) token ids


def load_calibration(cfg: CalibrationConfig, tokenizer) -> Calibration:
    n_fit = cfg.num_tokens // cfg.seq_len
    n_held = cfg.heldout_tokens // cfg.seq_len
    texts = iter_texts(cfg.dataset, text_field=cfg.text_field, split=cfg.split)
    if cfg.heldout is None:
        blocks = token_blocks(texts, tokenizer, cfg.seq_len, n_fit + n_held)
        return Calibration(blocks[:n_fit], blocks[n_fit:] if n_held else None)
    fit = token_blocks(texts, tokenizer, cfg.seq_len, n_fit)
    held = None
    if n_held:
        other = iter_texts(cfg.heldout.dataset, text_field=cfg.heldout.text_field, split=cfg.heldout.split)
        held = token_blocks(other, tokenizer, cfg.seq_len, n_held)
    return Calibration(fit, held)


def normalized_input(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """y = RMSNorm(h) without its gain, flattened to (N·T, d), float32."""
    h = hidden.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).reshape(-1, h.shape[-1])


def layer_tensors(plan: ConversionPlan, i: int) -> dict[str, torch.Tensor]:
    """All source tensors of layer i, float32, names relative to the layer."""
    prefix = f"model.layers.{i}."
    return {
        name[len(prefix) :]: plan.source.reader.get(name)
        for name in sorted(plan.source.reader.names())
        if name.startswith(prefix)
    }


def source_attention(t: dict[str, torch.Tensor]) -> SourceAttention:
    return SourceAttention.fold_gain(
        t["input_layernorm.weight"],
        q_w=t["self_attn.q_proj.weight"],
        k_w=t["self_attn.k_proj.weight"],
        v_w=t["self_attn.v_proj.weight"],
        o_w=t["self_attn.o_proj.weight"],
        q_b=t.get("self_attn.q_proj.bias"),
        k_b=t.get("self_attn.k_proj.bias"),
        v_b=t.get("self_attn.v_proj.bias"),
        o_b=t.get("self_attn.o_proj.bias"),
    )


def _augment(y: torch.Tensor, d_in: int) -> torch.Tensor:
    """Append the constant-1 coordinate that carries a query bias when M has d + 1 columns."""
    return y if y.shape[1] == d_in else torch.cat([y, torch.ones(y.shape[0], 1, dtype=y.dtype)], dim=1)


def make_fitter(method: str, y: torch.Tensor | None, ridge: float, gen: torch.Generator, std: float):
    """The latent fit of one layer: (M, rank, width) -> (Basis, up)."""

    def fit(M: torch.Tensor, rank: int, width: int):
        if method == "svd":
            basis = latent.weight_basis(M, rank)
            return basis, _pad_up(latent.up_from_weights(M, basis.rows, width), width)
        if method == "activation":
            ya = _augment(y, M.shape[1]).double()
            basis = latent.activation_basis(M, latent.second_moment(ya), rank)
            rows = torch.cat([basis.rows, basis.rows.new_zeros(width - rank, basis.rows.shape[1])])
            return basis, latent.up_from_activations(M, rows, ya, ridge=ridge)
        # random: the stock initializer, N(0, initializer_range), for both projections
        rows = torch.randn(rank, M.shape[1], generator=gen, dtype=torch.float64) * std
        up = torch.randn(M.shape[0], width, generator=gen, dtype=torch.float64) * std
        return latent.Basis(rows=rows, spectrum=torch.zeros(0), energy_kept=float("nan")), up

    return fit


def _pad_up(up: torch.Tensor, width: int) -> torch.Tensor:
    return up if up.shape[1] == width else torch.cat([up, up.new_zeros(up.shape[0], width - up.shape[1])], 1)


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
    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        emb = self.plan.source.reader.get("model.embed_tokens.weight", dtype=None)
        return emb[ids].float()

    def _prepass(self) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """Per-layer stats needed before any layer is converted: RoPE pair scores and KV spectra."""
        plan, mla = self.plan, self.plan.recipe.mla
        need_scores = mla.rope_dims == "norm"
        need_spectra = mla.rank_allocation == "energy"
        if not (need_scores or need_spectra):
            return None, None
        L = plan.shape.num_layers
        scores, spectra = [], []
        hidden = self._embed(self.calib.fit) if self.calib is not None else None
        method = plan.recipe.init.method
        base_split = None if need_scores else splits_for(plan, None)[0]
        for i in tqdm(range(L), desc="prepass", disable=not self.progress):
            t = layer_tensors(plan, i)
            src = source_attention(t)
            y = normalized_input(hidden, self.eps) if hidden is not None else None
            if need_scores:
                g = plan.shape
                q = y.double() @ src.q_w.T + (0 if src.q_b is None else src.q_b.double())
                k = y.double() @ src.k_w.T + (0 if src.k_b is None else src.k_b.double())
                scores.append(pair_norm_scores(q.view(-1, g.num_heads, g.head_dim), k.view(-1, g.num_kv_heads, g.head_dim)))
            if need_spectra:
                split = base_split or splits_for(plan, [scores[-1]] * L)[0]
                M = kv_rows(self._geometry(plan.kv_rank), split, src, repeat=False)
                if method == "activation":
                    spectra.append(torch.linalg.eigvalsh(M @ latent.second_moment(y) @ M.T).flip(0).clamp_min(0))
                else:
                    spectra.append(torch.linalg.svdvals(M).square())
            if hidden is not None:
                hidden = self.runner.run(self.runner.build(i, t), hidden, self.batch)
        return (scores or None), (spectra or None)

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
        )

    # ---- the conversion ----------------------------------------------------------------------------
    def run(self) -> dict:
        plan, shape = self.plan, self.plan.shape
        recipe = plan.recipe
        t0 = time.time()
        L = shape.num_layers
        self.query_scale = 1.0  # provisional, for the prepass geometry (scale does not touch keys/values)
        scores, spectra = self._prepass()
        if spectra is not None:
            ranks = allocate_ranks(
                spectra, plan.kv_rank * L, multiple=recipe.mla.energy_multiple,
                min_rank=min(recipe.mla.energy_multiple, plan.kv_rank), max_rank=shape.hidden_size,
            )
        else:
            ranks = [plan.kv_rank] * L
        plan.layer_ranks = ranks
        width = max(ranks)
        splits = splits_for(plan, scores)
        rope_params, fit = output_rope(plan, splits)
        out_cfg = deepseek_config(plan, width, rope_params)
        self.query_scale = self._query_scale(out_cfg)
        geo = self._geometry(width)
        rope_report = self._rope_report(out_cfg, splits, fit)

        cvt_runner = LayerRunner(out_cfg, plan.device)
        gen = torch.Generator().manual_seed(recipe.seed)
        calib = self.calib
        h_fit = self._embed(calib.fit) if calib is not None else None
        h_src = self._embed(calib.heldout) if calib is not None and calib.heldout is not None else None
        h_cvt = h_src.clone() if h_src is not None else None

        layers_report = []
        params_after = 0
        with AtomicCheckpointWriter(recipe.output_dir, overwrite=self.force) as writer:
            bar = tqdm(range(L), desc="convert", unit="layer", disable=not self.progress)
            for i in bar:
                t = layer_tensors(plan, i)
                src = source_attention(t)
                y_fit = normalized_input(h_fit, self.eps) if h_fit is not None else None
                fitter = make_fitter(recipe.init.method, y_fit, recipe.init.ridge, gen, out_cfg.initializer_range)
                q_fitter = None
                if geo.q_rank is not None:
                    q_method = "svd" if recipe.init.method == "random" else recipe.init.method
                    q_fitter = make_fitter(q_method, y_fit, recipe.init.ridge, gen, out_cfg.initializer_range)
                res = convert_attention(geo, splits[i], src, ranks[i], fitter, q_fitter)
                out_t = {f"self_attn.{k}": v for k, v in res.tensors.items()}
                out_t["input_layernorm.weight"] = torch.ones(shape.hidden_size)  # gain folded into the projections
                for k in ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                    out_t[k] = t[k]
                out_t = {k: v.to(plan.out_dtype) for k, v in out_t.items()}
                for k, v in out_t.items():
                    writer.add(f"model.layers.{i}.{k}", v)
                params_after += sum(v.numel() for v in out_t.values())

                entry = {"layer": i, "kv_lora_rank": ranks[i], "kv_weight_energy_kept": res.kv_basis.energy_kept}
                if res.q_basis is not None:
                    entry["q_weight_energy_kept"] = res.q_basis.energy_kept
                if splits[i].pairs is not None:
                    entry["rope_pairs"] = list(splits[i].pairs)
                if h_src is not None:
                    y_held = normalized_input(h_src, self.eps)
                    k_err, v_err = kv_errors(geo, splits[i], src, res.tensors, y_held)
                    entry.update(heldout_key_rel_error=k_err, heldout_value_rel_error=v_err)
                    h_cvt = cvt_runner.run(cvt_runner.build(i, {k: v.float() for k, v in out_t.items()}), h_cvt, self.batch)
                if h_fit is not None or h_src is not None:
                    src_layer = self.runner.build(i, t)
                    if h_fit is not None and i + 1 < L:
                        h_fit = self.runner.run(src_layer, h_fit, self.batch)
                    if h_src is not None:
                        h_src = self.runner.run(src_layer, h_src, self.batch)
                layers_report.append(entry)
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


def kv_errors(geo: MLAGeometry, split: RopeSplit, src: SourceAttention, tensors: dict, y: torch.Tensor) -> tuple[float, float]:
    """Held-out ‖K−K̂‖/‖K‖ and ‖V−V̂‖/‖V‖ over all query heads, pre-RoPE, in the output's dim order.

    Keys include the RoPE part (the shared key against each head's own); both
    exclude biases, which the conversion carries exactly.
    """
    y = y.double()
    n, nope, d_h, r = geo.n_heads, geo.nope_dim, geo.head_dim, geo.kv_width
    kv_a = tensors["kv_a_proj_with_mqa.weight"].double()
    lat = latent.rms_normalize(y @ kv_a[:r].T)
    kv_hat = (lat @ tensors["kv_b_proj.weight"].double().T).view(-1, n, nope + d_h)
    kr_hat = (y @ kv_a[r:].T)[:, None].expand(-1, n, -1)
    kv_true = (y @ kv_rows(geo, split, src, repeat=True).T).view(-1, n, nope + d_h)
    kv_of = torch.arange(n) // geo.n_rep
    kr_true = (y @ src.k_w.view(geo.n_kv, d_h, -1)[:, split.rope_rows].reshape(-1, y.shape[1]).T).view(-1, geo.n_kv, geo.rope_dim)[:, kv_of]
    k_true = torch.cat([kv_true[..., :nope], kr_true], -1)
    k_hat = torch.cat([kv_hat[..., :nope], kr_hat], -1)
    return latent.relative_error(k_true, k_hat), latent.relative_error(kv_true[..., nope:], kv_hat[..., nope:])


@torch.no_grad()
def heldout_metrics(h_src: torch.Tensor, h_cvt: torch.Tensor, ids: torch.Tensor, reader, tied: bool, eps: float) -> dict:
    """Perplexity of both models, and KL(source‖converted) and top-1 agreement per token, on held-out blocks.

    Takes the last hidden states (N, T, d) of each model and applies the shared
    final norm and head in small batches, so the full logits never coexist.
    """
    norm_w = reader.get("model.norm.weight")
    head = reader.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    F = torch.nn.functional
    ce_src = ce_cvt = kl = agree = 0.0
    for hs, hc, t in zip(h_src.split(4), h_cvt.split(4), ids.split(4)):
        logp = []
        for h in (hs, hc):
            x = h.float()
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * norm_w
            logp.append(F.log_softmax((x[:, :-1] @ head.T).double(), -1).reshape(-1, head.shape[0]))
        target = t[:, 1:].reshape(-1)
        ce_src += float(F.nll_loss(logp[0], target, reduction="sum"))
        ce_cvt += float(F.nll_loss(logp[1], target, reduction="sum"))
        kl += float((logp[0].exp() * (logp[0] - logp[1])).sum())
        agree += float((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
    n = ids[:, 1:].numel()
    return {
        "tokens": n,
        "source_perplexity": math.exp(ce_src / n),
        "converted_perplexity": math.exp(ce_cvt / n),
        "kl_source_to_converted": kl / n,
        "top1_agreement": agree / n,
    }
