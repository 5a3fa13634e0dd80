"""`ecomla convert` to gqa, mqa and lrkv: exact where the grouping or rank allows, error falling with the budget."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import ecomla.lrkv  # noqa: F401  (registers model_type "lrkv", as a user loading an LRKV checkpoint would)
from ecomla.cli import main
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.stream import convert_recipe
from ecomla.convert.targets import per_query_head, pool_groups
from ecomla.eval.kv import measured_kv_bytes_per_token
from ecomla.mla.budget import kv_elements_per_token
from ecomla.recipe.schema import load_recipe
from tests.convert.helpers import load, logit_error


def convert(source, out, target: str, **sections) -> dict:
    data = {"model": str(source), "output_dir": str(out), "target": target, "dtype": "float32", "device": "cpu"}
    data.update(sections)
    return convert_recipe(load_recipe(ConvertRecipe, data=data), force=False, progress=False)


def test_pooling_follows_the_query_heads():
    """2 source KV heads, 6 query heads, 3 groups: the middle group straddles both source heads."""
    w = torch.stack([torch.full((2, 3), 1.0), torch.full((2, 3), 3.0)]).reshape(4, 3)  # heads of 1s and of 3s
    pooled = pool_groups(per_query_head(w, None, num_heads=6, head_dim=2), 3)  # (3, 2, 3)
    assert pooled[:, 0, 0].tolist() == [1.0, 2.0, 3.0]
    bias = torch.arange(4.0)
    assert per_query_head(w, bias, num_heads=6, head_dim=2).shape == (6, 2, 4)  # [W | b]


@pytest.mark.parametrize("family, kv", [("llama", 4), ("llama", 2), ("mistral", 2), ("qwen2", 2)])
def test_gqa_with_the_sources_kv_heads_is_exact(source_factory, tmp_path, family, kv):
    src_dir = source_factory(family, num_key_value_heads=kv)
    report = convert(src_dir, tmp_path / "out", "gqa", gqa={"num_key_value_heads": kv})
    src, out = load(src_dir), load(tmp_path / "out")
    assert type(out) is type(src) and out.config.num_key_value_heads == kv
    assert logit_error(src, out, src.config.vocab_size) < 1e-5
    assert report["compression_ratio"] == 1.0
    assert all(e["k_weight_rel_error"] < 1e-7 and e["v_weight_rel_error"] < 1e-7 for e in report["layers"])


def test_error_falls_as_kv_groups_grow(source_factory, tmp_path):
    src_dir = source_factory("llama", num_key_value_heads=4)  # MHA
    src = load(src_dir)
    errors, ratios = [], []
    for g in (1, 2, 4):
        target = {"target": "mqa"} if g == 1 else {"target": "gqa", "gqa": {"num_key_value_heads": g}}
        report = convert(src_dir, tmp_path / f"g{g}", **target)
        errors.append(logit_error(src, load(tmp_path / f"g{g}"), src.config.vocab_size))
        ratios.append(report["compression_ratio"])
        assert report["kv_elements_per_token_per_layer"] == {"before": 2 * 4 * 16, "after": 2 * g * 16}
    assert all(a > b for a, b in pairwise(errors)), errors
    assert errors[-1] < 1e-5
    assert ratios == [4.0, 2.0, 1.0]


def test_lrkv_exact_at_full_rank_and_error_falls_with_rank(source_factory, tmp_path):
    src_dir = source_factory("llama")  # 4 query heads, 2 KV heads, head_dim 16, hidden 64
    src = load(src_dir)
    errors = []
    for r in (1, 4, 16):
        report = convert(src_dir, tmp_path / f"r{r}", "lrkv", lrkv={"rank": r})
        out = load(tmp_path / f"r{r}")
        assert out.config.model_type == "lrkv" and out.config.lrkv_rank == r
        errors.append(logit_error(src, out, src.config.vocab_size))
    assert all(a > b for a, b in pairwise(errors)), errors
    assert errors[-1] < 1e-4
    assert all(e["k_residual_energy_kept"] == pytest.approx(1.0) for e in report["layers"])
    assert report["lrkv_break_even_rank"] == 4  # (2 − 1)·16/4: beyond it LRKV caches more than the source


@pytest.mark.parametrize(
    "target, sections, cls",
    [
        ("gqa", {"gqa": {"num_key_value_heads": 1}}, "LlamaForCausalLM"),
        ("mqa", {}, "LlamaForCausalLM"),
        ("lrkv", {"lrkv": {"rank": 2}}, "LrkvForCausalLM"),
    ],
)
def test_outputs_load_with_auto_and_cache_what_the_formula_says(source_factory, tmp_path, target, sections, cls):
    src_dir = source_factory("llama")
    report = convert(src_dir, tmp_path / "out", target, **sections)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()  # no trust_remote_code, no dtype
    assert type(model).__name__ == cls and model.dtype == torch.float32
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert measured_kv_bytes_per_token(model) == kv_elements_per_token(cfg) * 4
    assert report["kv_elements_per_token"]["after"] == kv_elements_per_token(cfg)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(report["files_copied"])
    for name in ("tokenizer.json", "conversion_report.json", "ecomla_recipe.yaml"):
        assert (tmp_path / "out" / name).exists(), name


def test_qwen2_biases_are_pooled(source_factory, tmp_path):
    src_dir = source_factory("qwen2")
    convert(src_dir, tmp_path / "out", "mqa")
    src, out = load(src_dir), load(tmp_path / "out")
    assert type(out).__name__ == "Qwen2ForCausalLM"
    bias = out.model.layers[0].self_attn.k_proj.bias  # (d_h,): the mean of the two source heads' biases
    torch.testing.assert_close(bias, src.model.layers[0].self_attn.k_proj.bias.view(2, 16).mean(0))
    ids = torch.arange(1, 9)[None]
    assert torch.isfinite(out(ids).logits).all()


# ---- bad input: one message through the CLI, exit 2, nothing written ---------------------------------


def _run(tmp_path, capsys, source, extra_args=(), **keys):
    recipe = {"model": str(source), "output_dir": str(tmp_path / "out"), "dtype": "float32", "device": "cpu", **keys}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["convert", str(path), "--quiet", *extra_args])
    out = capsys.readouterr()
    return code, out.err, out.out


def _nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


@pytest.mark.parametrize(
    "keys, needle",
    [
        ({"target": "gqa", "gqa": {"num_key_value_heads": 3}}, "gqa.num_key_value_heads: 3 does not divide"),
        ({"target": "lrkv", "lrkv": {"rank": 0}}, "lrkv.rank: must be >= 1"),
        ({"target": "lrkv", "lrkv": {"rank": 17}}, "lrkv.rank: 17 exceeds min(hidden_size, head_dim)"),
        ({"target": "gqa"}, "gqa: target gqa needs this section"),
        ({"target": "lrkv", "lrkv": {"rank": 4}, "gqa": {"num_key_value_heads": 2}}, "gqa: only target gqa"),
        ({"target": "mqa", "gqa": {"num_key_value_heads": 1}}, "mqa always keeps one KV head"),
        ({"target": "gqa", "gqa": {"num_key_value_heads": 2}, "mla": {"kv_lora_rank": 32}}, "mla: only target mla"),
        ({"target": "mqa", "init": {"method": "random"}}, "init: only target mla"),
        ({"mla": {"kv_lora_rank": 32}, "lrkv": {"rank": 4}}, "lrkv: only target lrkv"),
        ({"target": "gpa"}, "did you mean 'gqa'"),
    ],
)
def test_bad_recipe(source_factory, tmp_path, capsys, keys, needle):
    code, err, _ = _run(tmp_path, capsys, source_factory("llama"), **keys)
    assert code == 2 and needle in err, err
    _nothing_written(tmp_path)


def test_lrkv_refuses_attention_biases(source_factory, tmp_path, capsys):
    code, err, _ = _run(tmp_path, capsys, source_factory("qwen2"), target="lrkv", lrkv={"rank": 4})
    assert code == 2 and "target: lrkv needs a source without attention biases" in err, err
    _nothing_written(tmp_path)


def test_recipe_problems_at_once(source_factory, tmp_path, capsys):
    code, err, _ = _run(tmp_path, capsys, source_factory("llama"), target="gqa", lrkv={"rank": 4},
                        mla={"kv_lora_rank": 32})
    assert code == 2
    for needle in ("gqa: target gqa needs", "lrkv: only target lrkv", "mla: only target mla"):
        assert needle in err, err


def test_existing_output_needs_force(source_factory, tmp_path, capsys):
    src = source_factory("llama", num_key_value_heads=4)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    keys = {"target": "gqa", "gqa": {"num_key_value_heads": 2}}
    code, err, _ = _run(tmp_path, capsys, src, **keys)
    assert code == 2 and f"output_dir: {tmp_path / 'out'} already exists; pass --force" in err, err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]
    code, _, out = _run(tmp_path, capsys, src, extra_args=["--force"], **keys)
    assert code == 0 and "compression: 2x" in out and "4 -> 2 KV heads" in out, out
    assert (tmp_path / "out" / "config.json").exists() and not (tmp_path / "out" / "keep.txt").exists()
