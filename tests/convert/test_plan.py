"""The conversion plan: frozen, one entry per layer, with the stock config derived from it before any layer."""

from __future__ import annotations

import dataclasses

import pytest

from ecomla.convert.plan import MLAPlan, TargetPlan, make_plan
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.stream import convert
from ecomla.recipe.schema import load_recipe
from tests.convert.helpers import make_layer0_low_rank


def recipe(src, out, **sections) -> ConvertRecipe:
    return load_recipe(ConvertRecipe, data={"model": str(src), "output_dir": str(out), "dtype": "float32",
                                            "device": "cpu", **sections})


def test_the_plan_is_frozen_and_holds_every_layer(source_factory, tmp_path):
    src = source_factory("llama", num_hidden_layers=3)
    plan = make_plan(recipe(src, tmp_path / "out", mla={"kv_lora_rank": 12, "qk_rope_head_dim": 8}))
    assert isinstance(plan, MLAPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.geometry.kv_lora_rank = 3
    assert [layer.kv_lora_rank for layer in plan.layers] == [12, 12, 12]
    geo, cfg = plan.geometry, plan.config
    # one shape, under the HF DeepSeek-V3 names, and the stock config is derived from it
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        geo.kv_lora_rank, geo.qk_rope_head_dim, geo.qk_nope_head_dim, geo.v_head_dim) == (12, 8, 8, 16)
    assert geo.query_scale == pytest.approx(1.0)  # d_h = nope + rope here, so the softmax scales agree
    assert not (tmp_path / "out").exists()  # planning writes nothing


def test_per_layer_shapes_are_chosen_in_planning_and_applied_as_planned(source_factory, tmp_path):
    src = source_factory("llama", num_hidden_layers=4, num_key_value_heads=4)
    make_layer0_low_rank(src)  # so that the energy allocation gives it less
    plan = make_plan(recipe(src, tmp_path / "out", mla={"kv_lora_rank": 24, "qk_rope_head_dim": 8,
                                                          "rank_allocation": "energy"}))
    ranks = [layer.kv_lora_rank for layer in plan.layers]
    assert ranks[0] < 24 and sum(ranks) == 4 * 24
    assert plan.geometry.kv_lora_rank == plan.config.kv_lora_rank == max(ranks)
    report = convert(plan, progress=False)
    assert [e["kv_lora_rank"] for e in report["layers"]] == ranks
    assert report["target"] == "mla" and report["output_class"] == "DeepseekV3ForCausalLM"


def test_targets_plan_their_output_config(source_factory, tmp_path):
    src = source_factory("llama", num_key_value_heads=2)
    plan = make_plan(recipe(src, tmp_path / "out", target="mqa"))
    assert isinstance(plan, TargetPlan) and plan.kv_heads == 1 and plan.config.num_key_value_heads == 1
    assert plan.config.architectures == ["LlamaForCausalLM"]
    report = convert(plan, progress=False)
    assert report["target"] == "mqa" and report["num_key_value_heads"] == {"before": 2, "after": 1}
