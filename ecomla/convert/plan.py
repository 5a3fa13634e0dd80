"""Turn a convert recipe plus its source checkpoint into a checked, frozen conversion plan.

Everything that can be wrong with the input is found here, all at once, before
any compute or any write: the recipe's ranks against the source's shapes, the
output directory, the calibration data. Then everything the conversion needs is
resolved here, once: per layer, the latent's rank and the source rows that keep
RoPE (with the calibration statistics that choose them), the output's RoPE
frequencies and its stock config. `ecomla.convert.stream` only applies the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import DeepseekV3Config, PretrainedConfig

from ecomla.convert import layout
from ecomla.convert.layout import LinearLatent
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.source import FAMILIES, LayerRunner, SourceModel, inspect_source, rotary_embedding
from ecomla.convert.to_mla import MLAGeometry, SourceAttention, kv_rows, residual_dim, rope_key, source_pair_spectra
from ecomla.convert.walk import Calibration, embed, layer_tensors, load_calibration, normalized_input, source_attention
from ecomla.errors import UserError
from ecomla.io.checkpoint import has_tokenizer
from ecomla.mla import engines, latent
from ecomla.mla.budget import AttentionShape, allocate_ranks, rank_for_ratio
from ecomla.mla.rope import FrequencyFit, RopeSplit, fit_frequencies, pair_norm_scores, rope_split
from ecomla.mla.rope_key import allocate_slots, inexpressible_reason

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanError(UserError, ValueError):
    """The recipe does not fit the source; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("cannot convert:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class Plan:
    """What every conversion knows before its first layer: the checked recipe and source, and the output's config."""

    recipe: ConvertRecipe
    source: SourceModel
    config: PretrainedConfig  # the output's: derived from the plan, saved as is
    out_dtype: torch.dtype
    device: torch.device

    @property
    def shape(self) -> AttentionShape:
        return self.source.shape


@dataclass(frozen=True)
class LayerPlan:
    """One MLA layer: the rank of its latent and the source rows that keep RoPE."""

    kv_lora_rank: int  # this layer's; zero-padded to the model-wide `MLAGeometry.kv_lora_rank`
    rope: RopeSplit


@dataclass(frozen=True)
class MLAPlan(Plan):
    """target: mla. The one resolved MLA shape (`geometry`, HF DeepSeek-V3 names) and one entry per layer."""

    geometry: MLAGeometry
    layers: tuple[LayerPlan, ...]
    frequency_fit: FrequencyFit | None  # how the output's RoPE frequencies were fitted (None: rope_dims=last)
    rope_residual_context: int  # T of rope_residual=latent_mean's averaged rotation
    calibration: Calibration | None  # token blocks to fit on and to measure on


@dataclass(frozen=True)
class TargetPlan(Plan):
    """target: gqa, mqa or lrkv (`ecomla.convert.targets`)."""

    kv_heads: int | None  # g for gqa/mqa, None for lrkv
    rank: int | None  # r for lrkv, None for gqa/mqa


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PlanError([f"device: '{name}' asked for, but no CUDA device is available; use device: cpu"])
    return dev


def output_problems(recipe: ConvertRecipe, *, force: bool) -> list[str]:
    """The output directory checks every target runs first, before opening the source."""
    out = Path(recipe.output_dir)
    problems = []
    if out.exists() and not force:
        problems.append(f"output_dir: {out} already exists; pass --force to replace it")
    if out.resolve() == Path(recipe.model).expanduser().resolve():
        problems.append("output_dir: must differ from model (the source would be overwritten)")
    return problems


def make_plan(recipe: ConvertRecipe, *, force: bool = False, progress: bool = True) -> MLAPlan | TargetPlan:
    """Check the recipe against its source and resolve every layer's shape; raises PlanError with every problem.

    The cheap checks run first, before the source is opened. For target mla, the calibration tokens are read
    here, and the statistics that choose per-layer shapes (`rope_dims: norm`, `rank_allocation: energy`,
    `rope_allocation: energy`) are computed here by one walk over the source, so the conversion itself only
    applies the plan.
    """
    problems = output_problems(recipe, force=force)
    if problems:  # cheap checks first, before opening the source
        raise PlanError(problems)
    source = inspect_source(recipe.model)
    if recipe.target != "mla":
        return _target_plan(recipe, source)
    shape, mla = source.shape, recipe.mla
    d_r = mla.qk_rope_head_dim if mla.qk_rope_head_dim is not None else shape.head_dim // 2
    if d_r % 2:  # only reachable when the head dim is odd-halved, e.g. 2·odd
        problems.append(f"mla.qk_rope_head_dim: the default d_h/2 = {d_r} is odd; set an even mla.qk_rope_head_dim")
    if d_r > shape.head_dim:
        problems.append(f"mla.qk_rope_head_dim: {d_r} exceeds the source head dim {shape.head_dim}")
    if mla.rope_dims == "uniform" and d_r <= shape.head_dim and (shape.head_dim // 2) % max(1, d_r // 2):
        problems.append(f"mla.rope_dims: 'uniform' needs d_r/2 = {d_r // 2} to divide d_h/2 = {shape.head_dim // 2}")

    kv_lora_rank = mla.kv_lora_rank
    if mla.target_compression is not None:
        try:
            kv_lora_rank = rank_for_ratio(shape, mla.target_compression, d_r)
        except ValueError as err:
            problems.append(f"mla.target_compression: {err}")
    if kv_lora_rank is not None and kv_lora_rank > shape.hidden_size:
        what = "mla.kv_lora_rank" if mla.kv_lora_rank is not None else "mla.target_compression"
        problems.append(
            f"{what}: r_kv = {kv_lora_rank} exceeds the hidden size {shape.hidden_size}; a wider latent carries "
            f"nothing more (r_kv = {shape.hidden_size} is the exact case)"
        )
    q_cap = shape.hidden_size + (1 if source.qkv_bias else 0)
    if mla.q_lora_rank is not None and mla.q_lora_rank > q_cap:
        problems.append(
            f"mla.q_lora_rank: {mla.q_lora_rank} exceeds {q_cap} (hidden size"
            f"{' + 1 for the query bias' if source.qkv_bias else ''}), which is already exact"
        )
    if source.qkv_bias and mla.q_lora_rank is None:
        problems.append(
            f"mla.q_lora_rank: this {source.family} source has a query bias, which the stock full q_proj cannot "
            f"hold; set mla.q_lora_rank (hidden_size + 1 = {shape.hidden_size + 1} keeps the query exact)"
        )
    if kv_lora_rank is not None and mla.rank_allocation == "uniform":  # the stored width is known: check it now
        problems += serve_problems(mla, shape, kv_lora_rank, d_r)
    if recipe.init.calibration is not None and not has_tokenizer(source.directory):
        problems.append(f"init.calibration: {recipe.model} has no tokenizer files, so its calibration text cannot be "
                        "tokenized; copy the source's tokenizer into it, or convert without init.calibration "
                        "(with no conversion key set, init.preset auto then takes nodata)")
    out_dtype, device = dtype_and_device(recipe, source, problems)
    if problems:
        raise PlanError(problems)
    return _mla_plan(recipe, source, d_r, kv_lora_rank, out_dtype, device, progress)


def serve_problems(mla, shape: AttentionShape, kv_lora_rank: int, d_r: int) -> list[str]:
    """mla.serve_with: the engine's refusal of this stored shape, with the shapes it serves instead."""
    qk_nope = shape.head_dim - d_r + residual_dim(mla.rope_residual, mla.rope_key, shape.num_kv_heads, d_r)
    why = engines.refusal(mla.serve_with, kv_lora_rank, d_r, qk_nope, shape.kv_elements)
    return [] if why is None else [f"mla.serve_with: {why}"]


def _target_plan(recipe: ConvertRecipe, source: SourceModel) -> TargetPlan:
    """gqa / mqa: the KV heads kept; lrkv: the residual rank. The output config is the source family's own (gqa,
    mqa) or an LrkvConfig (lrkv)."""
    import copy

    from ecomla.lrkv.convert import lrkv_config_from_llama

    shape, problems = source.shape, []
    kv_heads = rank = None
    if recipe.target in ("gqa", "mqa"):
        kv_heads = 1 if recipe.target == "mqa" else recipe.gqa.num_key_value_heads
        if shape.num_heads % kv_heads:
            fits = [g for g in range(1, shape.num_heads + 1) if shape.num_heads % g == 0]
            problems.append(f"gqa.num_key_value_heads: {kv_heads} does not divide the source's {shape.num_heads} "
                            f"query heads; choose one of {fits}")
    else:
        rank = recipe.lrkv.rank
        limit = min(shape.hidden_size, shape.head_dim)
        if rank > limit:
            problems.append(f"lrkv.rank: {rank} exceeds min(hidden_size, head_dim) = min({shape.hidden_size}, "
                            f"{shape.head_dim}) = {limit}, where every residual is already exact")
        if source.qkv_bias or source.o_bias:
            which = "q/k/v" if not source.o_bias else "q/k/v/o"
            problems.append(f"target: lrkv needs a source without attention biases; this {source.family} source has "
                            f"{which} biases, which the bias-free LRKV residuals cannot hold (target gqa keeps them)")
    out_dtype, device = dtype_and_device(recipe, source, problems)
    if problems:
        raise PlanError(problems)
    if rank is not None:
        cfg = lrkv_config_from_llama(source.config, rank)
        cfg.architectures = ["LrkvForCausalLM"]
    else:
        cfg = copy.deepcopy(source.config)
        cfg.num_key_value_heads = kv_heads
        cfg.architectures = [f"{FAMILIES[source.config.model_type]}ForCausalLM"]
    cfg.dtype = out_dtype
    return TargetPlan(recipe, source, cfg, out_dtype, device, kv_heads, rank)


def _mla_plan(recipe: ConvertRecipe, source: SourceModel, d_r: int, kv_lora_rank: int, out_dtype, device,
              progress: bool) -> MLAPlan:
    """The checked MLA recipe resolved: calibration read, per-layer ranks and RoPE rows, the output config."""
    mla, shape, L = recipe.mla, source.shape, source.shape.num_layers
    calibration = None
    if recipe.init.calibration is not None:
        from transformers import AutoTokenizer

        calibration = load_calibration(recipe.init.calibration, AutoTokenizer.from_pretrained(source.directory))
    geometry = MLAGeometry(
        hidden=shape.hidden_size, n_heads=shape.num_heads, n_kv=shape.num_kv_heads, head_dim=shape.head_dim,
        qk_rope_head_dim=d_r, kv_lora_rank=kv_lora_rank, q_lora_rank=mla.q_lora_rank,
        query_scale=1.0,  # set below from the output config; keys and values, all the statistics see, ignore it
        attention_bias=source.qkv_bias or source.o_bias, rope_key=mla.rope_key, interleave=mla.rope_interleave,
        rope_residual=mla.rope_residual,
    )
    stats = layer_statistics(recipe, source, geometry, device, calibration, progress)
    if stats.spectra is not None:
        ranks = allocate_ranks(stats.spectra, kv_lora_rank * L, multiple=mla.energy_multiple,
                               min_rank=min(mla.energy_multiple, kv_lora_rank), max_rank=shape.hidden_size)
    else:
        ranks = [kv_lora_rank] * L
    if stats.slots is not None:
        splits = energy_splits(source, geometry, stats.slots)
    else:
        splits = rope_splits(mla, shape, d_r, stats.scores)
    rope_parameters, fit = output_rope(source, d_r, splits)
    geometry = replace(geometry, kv_lora_rank=max(ranks))
    if mla.rank_allocation != "uniform":  # the stored width is the largest layer's, known only now
        problems = serve_problems(mla, shape, geometry.kv_lora_rank, d_r)
        if problems:
            raise PlanError(problems)
    if mla.latent_norm == "linear":
        # The latent a·Q·y sits in kv_a_layernorm's linear regime; a is split between the input gain γ and the
        # latent rows (latent.linear_input_gain).
        linear = LinearLatent.for_width(geometry.kv_lora_rank, shape.hidden_size)
        geometry = replace(geometry, latent_scale=linear.scale, input_gain=linear.input_gain)
    config = deepseek_config(recipe, source, geometry, rope_parameters, out_dtype)
    geometry = replace(geometry, query_scale=query_scale(shape.head_dim, config))
    if mla.rope_residual_context is not None:
        context = mla.rope_residual_context
    elif recipe.init.calibration is not None:
        context = recipe.init.calibration.seq_len
    else:
        context = int(source.config.max_position_embeddings)
    layers = tuple(LayerPlan(r, s) for r, s in zip(ranks, splits))
    return MLAPlan(recipe, source, config, out_dtype, device, geometry, layers, fit, context, calibration)


def dtype_and_device(recipe: ConvertRecipe, source, problems: list[str]) -> tuple[torch.dtype, torch.device]:
    """The output dtype (auto: the source's stored one) and the compute device; device problems go to `problems`."""
    out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" else source.reader.stored_dtype()
    try:
        return out_dtype, pick_device(recipe.device)
    except PlanError as err:
        problems.extend(err.problems)
        return out_dtype, torch.device("cpu")


def source_inv_freq(source: SourceModel) -> torch.Tensor:
    """The source's RoPE inverse frequencies per pair (d_h/2,), as its own rotary module computes them."""
    return rotary_embedding(source.config).inv_freq.double()


def output_rope(source: SourceModel, d_r: int, splits: list[RopeSplit]) -> tuple[dict, FrequencyFit | None]:
    """rope_parameters for the output, fitted so kept pairs keep their frequencies where stock RoPE allows."""
    src = source.rope_parameters
    rope_type = src.get("rope_type", "default")
    theta = float(src["rope_theta"])
    params = {k: v for k, v in src.items()}
    if splits[0].pairs is None:  # rope_dims=last
        return params, None  # a fresh d_r-dim RoPE with the source's θ and scaling
    fit = fit_frequencies(
        [s.pairs for s in splits], source.shape.head_dim, d_r, theta, allow_linear=rope_type != "llama3"
    )
    params["rope_theta"] = fit.theta
    if rope_type != "llama3":
        factor = float(src.get("factor", 1.0) if rope_type == "linear" else 1.0) * fit.linear_factor
        if math.isclose(factor, 1.0, rel_tol=1e-12):
            params = {"rope_type": "default", "rope_theta": fit.theta}
        else:
            params = {"rope_type": "linear", "rope_theta": fit.theta, "factor": factor}
    return params, fit


def deepseek_config(recipe: ConvertRecipe, source: SourceModel, geo: MLAGeometry, rope_parameters: dict,
                    out_dtype: torch.dtype) -> DeepseekV3Config:
    """A stock DeepSeek-V3 config: dense MLP in every layer, MLA attention of `geo`, the source's vocab and norms."""
    src = source.config
    cfg = DeepseekV3Config(
        vocab_size=src.vocab_size,
        hidden_size=geo.hidden,
        intermediate_size=src.intermediate_size,
        moe_intermediate_size=src.intermediate_size,
        num_hidden_layers=source.shape.num_layers,
        num_attention_heads=geo.n_heads,
        # kv_b_proj already expands the latent to every query head.
        num_key_value_heads=geo.n_heads,
        kv_lora_rank=geo.kv_lora_rank,
        q_lora_rank=geo.q_lora_rank,
        qk_rope_head_dim=geo.qk_rope_head_dim,
        qk_nope_head_dim=geo.qk_nope_head_dim,
        v_head_dim=geo.v_head_dim,
        first_k_dense_replace=source.shape.num_layers,  # every layer dense: no MoE
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings,
        initializer_range=getattr(src, "initializer_range", 0.02),
        # A linear latent is scaled by kv_a_layernorm's epsilon: transformers hard-codes 1e-6 there, llama.cpp and
        # vLLM read rms_norm_eps, so the config says 1e-6 too (the other norms barely notice: ε ≪ their mean square).
        rms_norm_eps=latent.LATENT_NORM_EPS if geo.latent_scale != 1.0 else src.rms_norm_eps,
        tie_word_embeddings=source.tied,
        rope_parameters=rope_parameters,
        rope_interleave=geo.interleave,
        attention_bias=geo.attention_bias,
        attention_dropout=0.0,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        pad_token_id=getattr(src, "pad_token_id", None),
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.dtype = out_dtype
    if geo.latent_scale != 1.0:  # the layout travels with the checkpoint (convert/layout.py)
        layout.write(cfg, layout.LinearLatent(scale=geo.latent_scale, input_gain=geo.input_gain))
    return cfg


def query_scale(head_dim: int, config: DeepseekV3Config) -> float:
    """s_src / s_out: the stock softmax scale is (nope + rope)^-0.5 (with YaRN mscale); the source's d_h^-0.5."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    with torch.device("meta"):
        s_out = DeepseekV3Attention(config, 0).scaling
    return head_dim ** -0.5 / s_out


def rope_splits(mla, shape: AttentionShape, d_r: int, scores: list[torch.Tensor] | None) -> list[RopeSplit]:
    """One RopeSplit per layer (the same one unless rope_dims=norm, which ranks each layer's pairs by `scores`)."""
    if mla.rope_dims == "norm":
        assert scores is not None
        return [rope_split("norm", shape.head_dim, d_r, interleave=mla.rope_interleave, scores=s) for s in scores]
    one = rope_split(mla.rope_dims, shape.head_dim, d_r, interleave=mla.rope_interleave)
    return [one] * shape.num_layers


def slot_split(geo: MLAGeometry, counts: torch.Tensor) -> RopeSplit:
    """The split keeping the pairs of a one-component-per-pair slot allocation (`norm` ranks by the counts)."""
    return rope_split("norm", geo.head_dim, geo.qk_rope_head_dim, interleave=geo.interleave, scores=counts.double())


def energy_splits(source: SourceModel, geo: MLAGeometry, slots: list[torch.Tensor]) -> list[RopeSplit]:
    """rope_allocation=energy: the splits of the allocation, or a PlanError when stock RoPE cannot rotate it."""
    rope_type = source.rope_parameters.get("rope_type", "default")
    reason = inexpressible_reason(slots, geo.head_dim, geo.qk_rope_head_dim,
                                  float(source.rope_parameters["rope_theta"]), allow_linear=rope_type != "llama3")
    if reason is not None:
        kept = ", ".join(f"{int(c.max())}x{int((c > 0).sum())}" for c in slots)
        raise PlanError([(
            f"mla.rope_allocation: energy cannot be written with stock DeepSeek-V3 RoPE: {reason}. "
            f"(components x pairs per layer: {kept}.) Use rope_allocation: fixed; its conversion_report.json "
            f"gives, per layer, the key energy each allocation keeps rotated (layers[i].rope_allocation)"
        )])
    return [slot_split(geo, c) for c in slots]


def rope_covariance(geo: MLAGeometry, y: torch.Tensor | None, src: SourceAttention,
                    y_cov: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor | None:
    """rorope_act: the second moment of the key's inputs, y or [y; 1] with a key bias; None for the other modes.
    y_cov: y's second moment when the caller has it; weights: each input's weight (init.token_weights)."""
    if geo.rope_key != "rorope_act":
        return None
    if src.k_b is None:
        return latent.second_moment(y, weights) if y_cov is None else y_cov
    return latent.second_moment(torch.cat([y, torch.ones(len(y), 1, dtype=y.dtype)], 1), weights)


@dataclass(frozen=True)
class LayerStatistics:
    """Per-layer statistics that choose per-layer shapes; None where the recipe does not ask for them."""

    scores: list[torch.Tensor] | None  # rope_dims=norm: each source pair's 2-norm score
    spectra: list[torch.Tensor] | None  # rank_allocation=energy: the K/V rows' spectrum (under the inputs with
    # calibration), for the rank allocation
    slots: list[torch.Tensor] | None  # rope_allocation=energy: components kept per source pair


def layer_statistics(recipe: ConvertRecipe, source: SourceModel, geo: MLAGeometry, device: torch.device,
                     calibration: Calibration | None, progress: bool = True) -> LayerStatistics:
    """One walk over the source layers (on the calibration tokens when there are any), only if the recipe needs it."""
    mla, shape = recipe.mla, source.shape
    need_scores = mla.rope_dims == "norm"
    need_spectra = mla.rank_allocation == "energy"
    need_slots = mla.rope_allocation == "energy"
    if not (need_scores or need_spectra or need_slots):
        return LayerStatistics(None, None, None)
    from tqdm.auto import tqdm

    L, reader, eps = shape.num_layers, source.reader, float(source.config.rms_norm_eps)
    runner = LayerRunner(source.config, device)
    batch = recipe.init.calibration.batch_size if recipe.init.calibration is not None else 8
    scores, spectra, slots = [], [], []
    hidden = embed(reader, calibration.fit) if calibration is not None else None
    base_split = None if (need_scores or need_slots) else rope_splits(mla, shape, geo.qk_rope_head_dim, None)[0]
    for i in tqdm(range(L), desc="prepass", disable=not progress):
        t = layer_tensors(reader, i)
        src = source_attention(t)
        y = normalized_input(hidden, eps) if hidden is not None else None
        rope_cov = rope_covariance(geo, y, src)
        if need_scores:
            q = y.double() @ src.q_w.T + (0 if src.q_b is None else src.q_b.double())
            k = y.double() @ src.k_w.T + (0 if src.k_b is None else src.k_b.double())
            scores.append(pair_norm_scores(q.view(-1, shape.num_heads, shape.head_dim),
                                           k.view(-1, shape.num_kv_heads, shape.head_dim)))
        if need_slots:
            slots.append(allocate_slots(source_pair_spectra(geo, src, rope_cov), geo.qk_rope_head_dim // 2))
        if need_spectra:
            if need_slots:
                split = slot_split(geo, slots[-1])
            else:
                split = base_split or rope_splits(mla, shape, geo.qk_rope_head_dim, [scores[-1]] * L)[0]
            residual = rope_key(geo, split, src, rope_cov).residual if geo.residual_dim else None
            M = kv_rows(geo, split, src, repeat=False, residual=residual)
            if recipe.init.method == "activation":
                spectra.append(torch.linalg.eigvalsh(M @ latent.second_moment(y) @ M.T).flip(0).clamp_min(0))
            else:
                spectra.append(torch.linalg.svdvals(M).square())
        if hidden is not None:
            hidden = runner.run(runner.build(i, t), hidden, batch)
        reader.release()
    return LayerStatistics(scores or None, spectra or None, slots or None)
