"""Turn a convert recipe plus its source checkpoint into a checked conversion plan.

Everything that can be wrong with the input is found here, all at once, before
any compute or any write: the recipe's ranks against the source's shapes, the
output directory, the calibration data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DeepseekV3Config

from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.source import SourceModel, inspect_source, rotary_embedding
from ecomla.convert.to_mla import residual_dim
from ecomla.mla.budget import rank_for_ratio
from ecomla.mla.rope import FrequencyFit, RopeSplit, fit_frequencies, rope_split

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanError(ValueError):
    """The recipe does not fit the source; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("cannot convert:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class ConversionPlan:
    recipe: ConvertRecipe
    source: SourceModel
    rope_dim: int  # d_r
    kv_rank: int  # uniform r_kv (the per-layer budget under energy allocation)
    out_dtype: torch.dtype
    device: torch.device
    layer_ranks: list[int] = field(default_factory=list)  # filled by the converter

    @property
    def shape(self):
        return self.source.shape

    @property
    def residual_dim(self) -> int:
        """Extra no-RoPE dims per head under mla.rope_residual=latent or latent_mean (see `ecomla.convert.to_mla`)."""
        mla = self.recipe.mla
        return residual_dim(mla.rope_residual, mla.rope_key, self.shape.num_kv_heads, self.rope_dim)

    @property
    def attention_bias(self) -> bool:
        return self.source.qkv_bias or self.source.o_bias


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


def make_plan(recipe: ConvertRecipe, *, force: bool = False) -> ConversionPlan:
    if recipe.target != "mla":
        what = f"target: {recipe.target} is converted by ecomla.convert.targets.convert_target, not the MLA converter"
        raise PlanError([what])
    problems = output_problems(recipe, force=force)
    if problems:  # cheap checks first, before opening the source
        raise PlanError(problems)

    source = inspect_source(recipe.model)
    shape, mla = source.shape, recipe.mla
    d_r = mla.qk_rope_head_dim if mla.qk_rope_head_dim is not None else shape.head_dim // 2
    if d_r % 2:  # only reachable when the head dim is odd-halved, e.g. 2·odd
        problems.append(f"mla.qk_rope_head_dim: the default d_h/2 = {d_r} is odd; set an even mla.qk_rope_head_dim")
    if d_r > shape.head_dim:
        problems.append(f"mla.qk_rope_head_dim: {d_r} exceeds the source head dim {shape.head_dim}")
    if mla.rope_dims == "uniform" and d_r <= shape.head_dim and (shape.head_dim // 2) % max(1, d_r // 2):
        problems.append(f"mla.rope_dims: 'uniform' needs d_r/2 = {d_r // 2} to divide d_h/2 = {shape.head_dim // 2}")

    kv_rank = mla.kv_lora_rank
    if mla.target_compression is not None:
        try:
            kv_rank = rank_for_ratio(shape, mla.target_compression, d_r)
        except ValueError as err:
            problems.append(f"mla.target_compression: {err}")
    if kv_rank is not None and kv_rank > shape.hidden_size:
        what = "mla.kv_lora_rank" if mla.kv_lora_rank is not None else "mla.target_compression"
        problems.append(
            f"{what}: r_kv = {kv_rank} exceeds the hidden size {shape.hidden_size}; a wider latent carries "
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
    out_dtype, device = dtype_and_device(recipe, source, problems)
    if problems:
        raise PlanError(problems)
    return ConversionPlan(recipe, source, d_r, kv_rank, out_dtype, device)


def dtype_and_device(recipe: ConvertRecipe, source, problems: list[str]) -> tuple[torch.dtype, torch.device]:
    """The output dtype (auto: the source's stored one) and the compute device; device problems go to `problems`."""
    out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" else source.reader.stored_dtype()
    try:
        return out_dtype, pick_device(recipe.device)
    except PlanError as err:
        problems.extend(err.problems)
        return out_dtype, torch.device("cpu")


def source_inv_freq(plan: ConversionPlan) -> torch.Tensor:
    """The source's RoPE inverse frequencies per pair (d_h/2,), as its own rotary module computes them."""
    return rotary_embedding(plan.source.config).inv_freq.double()


def output_rope(plan: ConversionPlan, splits: list[RopeSplit]) -> tuple[dict, FrequencyFit | None]:
    """rope_parameters for the output, fitted so kept pairs keep their frequencies where stock RoPE allows."""
    src = plan.source.rope_parameters
    rope_type = src.get("rope_type", "default")
    theta = float(src["rope_theta"])
    params = {k: v for k, v in src.items()}
    if splits[0].pairs is None:  # rope_dims=last
        return params, None  # a fresh d_r-dim RoPE with the source's θ and scaling
    fit = fit_frequencies(
        [s.pairs for s in splits], plan.shape.head_dim, plan.rope_dim, theta, allow_linear=rope_type != "llama3"
    )
    params["rope_theta"] = fit.theta
    if rope_type != "llama3":
        factor = float(src.get("factor", 1.0) if rope_type == "linear" else 1.0) * fit.linear_factor
        if math.isclose(factor, 1.0, rel_tol=1e-12):
            params = {"rope_type": "default", "rope_theta": fit.theta}
        else:
            params = {"rope_type": "linear", "rope_theta": fit.theta, "factor": factor}
    return params, fit


def deepseek_config(plan: ConversionPlan, kv_width: int, rope_parameters: dict) -> DeepseekV3Config:
    """A stock DeepSeek-V3 config: dense MLP in every layer, MLA attention, the source's vocab and norms."""
    src = plan.source.config
    shape = plan.shape
    cfg = DeepseekV3Config(
        vocab_size=src.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=src.intermediate_size,
        moe_intermediate_size=src.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        # kv_b_proj already expands the latent to every query head.
        num_key_value_heads=shape.num_heads,
        kv_lora_rank=kv_width,
        q_lora_rank=plan.recipe.mla.q_lora_rank,
        qk_rope_head_dim=plan.rope_dim,
        qk_nope_head_dim=shape.head_dim - plan.rope_dim + plan.residual_dim,
        v_head_dim=shape.head_dim,
        first_k_dense_replace=shape.num_layers,  # every layer dense: no MoE
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        hidden_act=src.hidden_act,
        max_position_embeddings=src.max_position_embeddings,
        initializer_range=getattr(src, "initializer_range", 0.02),
        rms_norm_eps=src.rms_norm_eps,
        tie_word_embeddings=plan.source.tied,
        rope_parameters=rope_parameters,
        rope_interleave=plan.recipe.mla.rope_interleave,
        attention_bias=plan.attention_bias,
        attention_dropout=0.0,
        bos_token_id=src.bos_token_id,
        eos_token_id=src.eos_token_id,
        pad_token_id=getattr(src, "pad_token_id", None),
    )
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.dtype = plan.out_dtype
    return cfg


def splits_for(plan: ConversionPlan, scores: list[torch.Tensor] | None) -> list[RopeSplit]:
    """One RopeSplit per layer (the same one unless rope_dims=norm)."""
    mla, shape = plan.recipe.mla, plan.shape
    if mla.rope_dims == "norm":
        assert scores is not None
        return [
            rope_split("norm", shape.head_dim, plan.rope_dim, interleave=mla.rope_interleave, scores=s) for s in scores
        ]
    one = rope_split(mla.rope_dims, shape.head_dim, plan.rope_dim, interleave=mla.rope_interleave)
    return [one] * shape.num_layers
