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

Memory: one source layer at a time (the reader is released after each); the output goes through
AtomicCheckpointWriter (at most one shard buffered, renamed into place at the end, nothing left
behind on error). Report: conversion_report.json with KV numbers before and after, the compression
ratio, the per-layer relative Frobenius error of the K and V maps over all query heads, and seconds.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from ecomla.convert.plan import PlanError, dtype_and_device, output_problems
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.source import FAMILIES, SourceModel, expected_tensors, inspect_source
from ecomla.eval.kv import kv_elements_per_token
from ecomla.io.checkpoint import AtomicCheckpointWriter
from ecomla.lrkv.convert import expand_kv_heads, lrkv_config_from_llama, shared_lowrank
from ecomla.mla.budget import format_ratio
from ecomla.recipe.schema import recipe_to_dict, save_recipe

SOURCE_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")


# ---- math: tensors in, tensors out ---------------------------------------------------------------


def per_query_head(weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int, head_dim: int) -> torch.Tensor:
    """A K or V projection (n_kv·d_h, D) and optional bias (n_kv·d_h,) as per-query-head maps (n_h, d_h, D[+1])."""
    affine = weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)  # (n_kv·d_h, D+1): [W | b]
    return expand_kv_heads(affine, num_heads, head_dim)


def pool_groups(heads: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-query-head maps (n_h, d_h, D') -> (g, d_h, D'): the mean over each run of n_h/g consecutive heads."""
    n_h, d_h, width = heads.shape
    if groups < 1 or n_h % groups:
        raise ValueError(f"{groups} KV groups do not divide {n_h} query heads")
    return heads.view(groups, n_h // groups, d_h, width).mean(dim=1)  # (g, n_h/g, d_h, D') -> (g, d_h, D')


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖_F / ‖exact‖_F (0 when both are zero)."""
    norm = float(exact.double().norm())
    diff = float((approx.double() - exact.double()).norm())
    return diff / norm if norm > 0 else diff


# ---- the plan: every problem with recipe + source, before any compute --------------------------


@dataclass
class TargetPlan:
    recipe: ConvertRecipe
    source: SourceModel
    kv_heads: int | None  # g for gqa/mqa, None for lrkv
    rank: int | None  # r for lrkv, None for gqa/mqa
    out_dtype: torch.dtype
    device: torch.device


def make_target_plan(recipe: ConvertRecipe, *, force: bool = False) -> TargetPlan:
    """Check the recipe against the source; raises PlanError (SourceError/CheckpointError for the source itself)."""
    if recipe.target == "mla":
        raise PlanError(["target: mla is converted by ecomla.convert.converter.Converter"])
    problems = output_problems(recipe, force=force)
    if problems:  # cheap checks first, before opening the source
        raise PlanError(problems)
    source = inspect_source(recipe.model)
    shape = source.shape
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
    return TargetPlan(recipe, source, kv_heads, rank, out_dtype, device)


def output_config(plan: TargetPlan) -> PretrainedConfig:
    """gqa/mqa: the source's own config with g KV heads. lrkv: the LrkvConfig of the source's shapes and rank r."""
    src = plan.source.config
    if plan.rank is not None:
        cfg = lrkv_config_from_llama(src, plan.rank)
        cfg.architectures = ["LrkvForCausalLM"]
    else:
        cfg = copy.deepcopy(src)
        cfg.num_key_value_heads = plan.kv_heads
        cfg.architectures = [f"{FAMILIES[src.model_type]}ForCausalLM"]
    cfg.dtype = plan.out_dtype
    return cfg


# ---- the conversion ----------------------------------------------------------------------------


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
            split = shared_lowrank(exact, plan.rank)
            approx = split.heads()
            out[f"self_attn.{kind}_shared.weight"] = split.shared  # (d_h, D)
            out[f"self_attn.{kind}_down.weight"] = split.down_weight()  # (n_h·r, D)
            out[f"self_attn.{kind}_up"] = split.up  # (n_h, r, d_h)
            entry[f"{kind}_residual_energy_kept"] = split.energy_kept
        entry[f"{kind}_weight_rel_error"] = relative_error(approx, exact)
    return out, entry


def convert_target(recipe: ConvertRecipe, *, force: bool = False, progress: bool = True) -> dict:
    """Convert to target gqa, mqa or lrkv; returns the report and leaves the checkpoint at recipe.output_dir."""
    plan = make_target_plan(recipe, force=force)
    t0 = time.time()
    source, shape = plan.source, plan.source.shape
    reader = source.reader
    names = sorted(expected_tensors(source.config, shape, source.qkv_bias, source.o_bias, source.tied))
    cfg = output_config(plan)
    layers, params_after = [], 0

    with AtomicCheckpointWriter(recipe.output_dir, overwrite=force) as writer:
        bar = tqdm(range(shape.num_layers), desc=f"convert ({recipe.target})", unit="layer", disable=not progress)
        for i in bar:
            prefix = f"model.layers.{i}."
            t = {n[len(prefix):]: reader.get(n, dtype=None) for n in names if n.startswith(prefix)}
            kv, entry = convert_kv(plan, t)
            out_t = {k: v for k, v in t.items() if k not in SOURCE_KV}  # copied as stored
            out_t.update(kv)
            for k, v in out_t.items():
                writer.add(prefix + k, v.to("cpu", plan.out_dtype))
                params_after += v.numel()
            layers.append({"layer": i, **entry})
            reader.release()
            bar.set_postfix(k_err=f"{entry['k_weight_rel_error']:.3f}", v_err=f"{entry['v_weight_rel_error']:.3f}")
        for n in names:
            if not n.startswith("model.layers."):  # embeddings, final norm, lm_head unless tied
                v = reader.get(n, dtype=None)
                writer.add(n, v.to(plan.out_dtype))
                params_after += v.numel()
        reader.release()

        cfg.save_pretrained(writer.path)
        copied = writer.copy_files(source.directory)
        params_before = sum(math.prod(reader.shape(n)) for n in names)
        report = _report(plan, cfg, layers, params_before, params_after, copied, time.time() - t0)
        (writer.path / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
        save_recipe(recipe, writer.path / "ecomla_recipe.yaml")
        writer.commit()
    return report


def _report(plan: TargetPlan, cfg: PretrainedConfig, layers: list[dict], params_before: int, params_after: int,
            copied: list[str], seconds: float) -> dict:
    shape, recipe = plan.source.shape, plan.recipe
    before = kv_elements_per_token(plan.source.config.to_dict())
    after = kv_elements_per_token(cfg.to_dict())
    L = shape.num_layers
    report = {
        "target": recipe.target,
        "source": recipe.model,
        "source_family": plan.source.family,
        "output_dir": recipe.output_dir,
        "output_class": cfg.architectures[0],
        "compression_ratio": before / after,
        "kv_elements_per_token": {"before": before, "after": after},
        "kv_elements_per_token_per_layer": {"before": before // L, "after": after // L},
    }
    if plan.kv_heads is not None:
        report["num_key_value_heads"] = {"before": shape.num_kv_heads, "after": plan.kv_heads}
    else:
        report["lrkv_rank"] = plan.rank
        # 2·(d_h + n_h·r) <= 2·n_kv·d_h  <=>  r <= (n_kv − 1)·d_h / n_h
        report["lrkv_break_even_rank"] = (shape.num_kv_heads - 1) * shape.head_dim // shape.num_heads
    report.update({
        "dtype": str(plan.out_dtype).removeprefix("torch."),
        "params": {"before": params_before, "after": params_after},
        "layers": layers,
        "files_copied": copied,
        "seconds": seconds,
        "recipe": recipe_to_dict(recipe),
    })
    return report


# ---- what `ecomla convert` prints --------------------------------------------------------------


def summary_lines(report: dict) -> list[str]:
    kv = report["kv_elements_per_token_per_layer"]
    ratio = report["compression_ratio"]
    if "num_key_value_heads" in report:
        heads = report["num_key_value_heads"]
        what = f"{heads['before']} -> {heads['after']} KV heads, mean-pooled"
    else:
        what = f"shared K/V + rank-{report['lrkv_rank']} residual per head"
    lines = [
        f"converted {report['source']} ({report['source_family']}) -> {report['output_dir']}",
        f"  target {report['target']}: {report['output_class']}, {what}",
        f"  KV per token and layer: {kv['before']} -> {kv['after']}   compression: {format_ratio(ratio)}",
    ]
    if ratio < 1:
        even = f" (LRKV breaks even at rank {report['lrkv_break_even_rank']})" if "lrkv_rank" in report else ""
        lines.append(f"  note: this cache is larger than the source's{even}")
    p = report["params"]
    lines.append(f"  params: {p['before'] / 1e6:.2f}M -> {p['after'] / 1e6:.2f}M")
    energy = "k_residual_energy_kept" in report["layers"][0]
    lines.append(f"  {'layer':>5} {'K err':>7} {'V err':>7}" + (f" {'K energy':>8} {'V energy':>8}" if energy else ""))
    for e in report["layers"]:
        row = f"  {e['layer']:>5} {e['k_weight_rel_error']:7.4f} {e['v_weight_rel_error']:7.4f}"
        if energy:
            row += f" {e['k_residual_energy_kept']:8.4f} {e['v_residual_energy_kept']:8.4f}"
        lines.append(row)
    lines.append("  (K/V err: relative Frobenius error of the key/value projection each query head reads)")
    lines.append(f"  took {report['seconds']:.1f}s; report: {report['output_dir']}/conversion_report.json")
    return lines


def print_summary(report: dict) -> None:
    print("\n".join(summary_lines(report)))
