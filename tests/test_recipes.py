"""Every YAML under recipes/ loads and validates against its job's schema, has a launch comment, and no absolute paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ecomla.analyze.recon import ReconRecipe
from ecomla.convert.recipe import ConvertRecipe
from ecomla.distill.recipe import PRETRAIN_DEFAULTS, DistillRecipe
from ecomla.eval.recipe import EvalRecipe
from ecomla.recipe.schema import load_recipe
from ecomla.run.recipe import RunRecipe
from ecomla.variants.recipe import SweepRecipe

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {"convert": ConvertRecipe, "analyze": ReconRecipe, "distill": DistillRecipe, "pretrain": DistillRecipe,
           "eval": EvalRecipe, "run": RunRecipe, "variants": SweepRecipe}
OVERRIDES = {"pretrain": PRETRAIN_DEFAULTS}  # `ecomla pretrain` loads the distill schema with CE-only settings
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT / "recipes")) for p in RECIPES])
def test_recipe_loads(path):
    parts = path.relative_to(ROOT / "recipes").parts
    job = parts[0] if len(parts) > 1 else "run"  # recipes/*.yaml are `ecomla run` main jobs
    assert job in SCHEMAS, f"no schema registered for recipes/{job}/"
    recipe = load_recipe(SCHEMAS[job], path, overrides=OVERRIDES.get(job, ()))
    if job == "run":  # its convert / distill / eval sections validate as the recipes they become
        from ecomla.run.pipeline import eval_recipe, plan

        eval_recipe(recipe, plan(recipe))
    if job == "eval":
        from ecomla.eval.recipe import load_suite

        load_suite(recipe.suite)
    text = path.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"ecomla {job}" in header or f"ecomla.{job}" in header, "launch command in the header comment"

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    assert not [s for s in strings(yaml.safe_load(text)) if s.startswith("/")], "absolute path in a recipe"


def test_deepspeed_configs_build():
    """recipes/deepspeed/*.json merge into a run's config without fighting the recipe."""
    import json

    from ecomla.distill.ds_config import build_ds_config

    recipe = load_recipe(DistillRecipe, ROOT / "recipes" / "distill" / "llama3.2-1b_mla_xecomla.yaml")
    for stage in (1, 2, 3):
        path = ROOT / "recipes" / "deepspeed" / f"zero{stage}.json"
        json.loads(path.read_text())
        recipe.deepspeed.zero_stage, recipe.deepspeed.config = stage, str(path)
        cfg = build_ds_config(recipe, world_size=8, grad_accum=6)
        assert cfg["train_batch_size"] == 192 and cfg["zero_optimization"]["stage"] == stage


# Public config.json facts of the models the serving recipes name: layers, hidden, heads, KV heads, head dim.
PUBLIC_SHAPES = {"meta-llama/Llama-3.2-3B-Instruct": (28, 3072, 24, 8, 128),
                 "meta-llama/Llama-3.1-8B-Instruct": (32, 4096, 32, 8, 128)}


@pytest.mark.parametrize("name, ratio", [("llama3.2-3b-instruct_vllm_6.4x.yaml", 6.4),
                                         ("llama3.1-8b-instruct_vllm_3.56x.yaml", 3.56)])
def test_the_vllm_recipes_give_shapes_vllm_serves(name, ratio):
    """mla.serve_with: vllm passes these recipes on their models' shapes, at the ratio their names promise, and
    every vLLM and SGLang MLA backend a shape of that width allows is among the ones the report will list."""
    from ecomla.convert.plan import serve_problems
    from ecomla.mla import engines
    from ecomla.mla.budget import AttentionShape

    recipe = load_recipe(ConvertRecipe, ROOT / "recipes" / "convert" / name)
    layers, hidden, heads, kv, head_dim = PUBLIC_SHAPES[recipe.model]
    shape = AttentionShape(layers, hidden, heads, kv, head_dim)
    r, d_r = recipe.mla.kv_lora_rank, recipe.mla.qk_rope_head_dim
    assert recipe.mla.serve_with == "vllm" and serve_problems(recipe.mla, shape, r, d_r) == []
    assert shape.kv_elements / (r + d_r) == pytest.approx(ratio, abs=0.005)
    served = engines.servable_by(r, d_r, head_dim - d_r + d_r)  # best's RoRoPE key adds d_r residual dims
    assert "FLASHINFER_MLA" in served["vllm"] and "flashinfer" in served["sglang"]
    assert serve_problems(recipe.mla, shape, 128, d_r)  # and an edit to 128 + 64 is refused
