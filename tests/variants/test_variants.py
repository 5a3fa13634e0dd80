"""`ecomla variants`: every variant's cache is real (measured bytes = formula, cached decoding = recompute),
parameters are matched, recipes are checked, and the sweep trains, reuses and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ecomla.eval.kv import measured_kv_bytes_per_token
from ecomla.mla.budget import kv_elements_per_token
from ecomla.recipe.schema import RecipeError, load_recipe
from ecomla.variants.configs import count_params, match_mlp, variant_config
from ecomla.variants.recipe import SizeSpec, SweepRecipe, VariantSpec

SIZE = SizeSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16, intermediate_size=128)
SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
VARIANTS = [
    VariantSpec(name="mha", kind="mha"),
    VariantSpec(name="gqa-2", kind="gqa", kv_heads=2),
    VariantSpec(name="mqa", kind="mqa"),
    VariantSpec(name="mla-r24", kind="mla", kv_lora_rank=24, rope_dim=8),
    VariantSpec(name="lrkv-r4", kind="lrkv", rank=4),
]
PER_LAYER = {"mha": 2 * 4 * 16, "gqa-2": 2 * 2 * 16, "mqa": 2 * 16, "mla-r24": 24 + 8, "lrkv-r4": 2 * (16 + 4 * 4)}


def build(cfg: dict, seed: int = 0):
    torch.manual_seed(seed)
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields)).eval()


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_measured_cache_bytes_equal_the_formula(variant, dtype):
    cfg = variant_config(SIZE, variant, 96, SPECIAL, 128)
    assert kv_elements_per_token(cfg) == 2 * PER_LAYER[variant.name]
    model = build(cfg).to(dtype)
    bytes_per = torch.tensor([], dtype=dtype).element_size()
    assert measured_kv_bytes_per_token(model) == kv_elements_per_token(cfg) * bytes_per


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
@torch.no_grad()
def test_cached_decoding_equals_full_recomputation(variant):
    model = build(variant_config(SIZE, variant, 96, SPECIAL, 128), seed=1)
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, pad_token_id=1)
    seq, m = ids, mask
    for step, cached in enumerate(out.logits):
        pos = (m.cumsum(-1) - 1).clamp(min=0)
        full = model(seq, attention_mask=m, position_ids=pos, use_cache=False).logits[:, -1]
        torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)
        seq = torch.cat([seq, out.sequences[:, ids.shape[1] + step, None]], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)


def test_mlp_width_matches_parameters():
    target = count_params(variant_config(SIZE, VARIANTS[0], 96, SPECIAL, 128))
    for v in VARIANTS[1:]:
        cfg = match_mlp(variant_config(SIZE, v, 96, SPECIAL, 128), target)
        assert abs(count_params(cfg) - target) <= 3 * SIZE.hidden_size * SIZE.num_hidden_layers / 2, v.name
        assert count_params(cfg) == sum(p.numel() for p in build(cfg).parameters())


def sweep_data(tmp_path: Path, **changes) -> dict:
    data = {
        "output_dir": str(tmp_path / "sweep"),
        "tokenizer": "tinyworld",
        "sizes": {"a": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16,
                        "intermediate_size": 64},
                  "b": {"hidden_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16,
                        "intermediate_size": 96}},
        "variants": [{"name": "mha", "kind": "mha"}, {"name": "mqa", "kind": "mqa"},
                     {"name": "lrkv-r2", "kind": "lrkv", "rank": 2}],
        "curves": ["mha", "lrkv-r2"],
        "max_position_embeddings": 128,
        "pretrain": {
            "data": {"train": {"dataset": "tinyworld:train", "max_documents": 40},
                     "eval": {"dataset": "tinyworld:heldout", "max_documents": 8}, "seq_len": 64},
            "train": {"total_tokens": 256 * 4, "global_batch_tokens": 256, "micro_batch_size": 4, "lr": 3e-3,
                      "precision": "fp32"},
            "deepspeed": {"zero_stage": 0},
            "log": {"eval_every_steps": 2, "eval_batches": 1},
        },
    }
    data.update(changes)
    return data


def test_recipe_problems(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(SweepRecipe, data=sweep_data(
            tmp_path, variants=[{"name": "g", "kind": "gqa"}, {"name": "g", "kind": "mla", "kv_lora_rank": 8,
                                                                 "rank": 2}],
            curves=["nope"], pretrain={"output_dir": "x"}))
    text = str(err.value)
    assert "kv_heads: required for kind gqa" in text and "rank: only used by kind lrkv" in text
    with pytest.raises(RecipeError) as err:
        load_recipe(SweepRecipe, data=sweep_data(tmp_path, variants=[{"name": "g", "kind": "mqa"}],
                                                 curves=["nope"], pretrain={"output_dir": "x"}))
    text = str(err.value)
    assert "first variant must be kind mha" in text and "'nope' is not a variant" in text
    assert "pretrain.output_dir: set by `ecomla variants`" in text


def test_sweep_trains_reuses_and_reports(tmp_path, capsys):
    from ecomla.variants.sweep import run_sweep

    recipe = load_recipe(SweepRecipe, data=sweep_data(tmp_path))
    out = run_sweep(recipe)
    log = capsys.readouterr().out
    assert log.count(": done in") == 5  # a: mha, mqa, lrkv-r2; b: the two curves only
    rows = json.loads((out / "report.json").read_text())
    assert [(r["size"], r["variant"]) for r in rows] == [("a", "mha"), ("a", "mqa"), ("a", "lrkv-r2"),
                                                         ("b", "mha"), ("b", "lrkv-r2")]
    for r in rows:
        assert r["kv_bytes_fp32_measured"] == r["kv_bytes_fp32_formula"]
        assert [t for t, _ in r["curve"]] == [512, 1024] and r["tokens"] == 1024
    assert {r["variant"]: r["kv_percent_of_mha"] for r in rows if r["size"] == "a"} == {
        "mha": 100.0, "mqa": 50.0, "lrkv-r2": 100.0 * 2 * (16 + 2 * 2) / (2 * 2 * 16)}
    for chart in ("kv_vs_ce.png", "ce_vs_tokens.png"):
        assert (out / chart).stat().st_size > 10_000
    run_sweep(recipe)
    assert capsys.readouterr().out.count(": reused") == 5
