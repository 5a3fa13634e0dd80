"""`ecomla run`: the stage plan, its keys, and the stage cache (reuse, rerun what changed, resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ecomla.eval.runner import EvalError
from ecomla.recipe.schema import RecipeError, load_recipe
from ecomla.run.pipeline import plan, run
from ecomla.run.recipe import RunRecipe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def world(source_factory, corpus_dir, tmp_path) -> dict:
    base = source_factory(name="base", max_position_embeddings=1024)
    teacher = source_factory(name="teacher", seed=3, hidden_size=96, num_hidden_layers=3,
                             max_position_embeddings=1024)
    suite = {"name": "t", "include_path": str(ROOT / "eval" / "tasks" / "tinyworld"),
             "tasks": [{"task": "tinyworld_recall"}]}
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(suite))
    return {"base": base, "teacher": teacher, "corpus": corpus_dir, "suite": tmp_path / "suite.yaml"}


def run_recipe(world: dict, out: Path, **changes) -> RunRecipe:
    data = {
        "output_dir": str(out),
        "base": str(world["base"]),
        "teachers": {"self": str(world["base"]), "big": str(world["teacher"])},
        "ratios": [2.0, 4.0],
        "presets": ["xecomla", "random"],
        "variants": {"random": {"init": {"method": "random"}}},
        "distill_teachers": ["big"],
        "convert": {"mla": {"qk_rope_head_dim": 8}, "dtype": "float32", "device": "cpu"},
        "distill": {
            "data": {"train": {"dataset": str(world["corpus"] / "a_fit.jsonl")}, "seq_len": 64},
            "train": {"total_tokens": 256 * 3, "global_batch_tokens": 256, "micro_batch_size": 2, "lr": 1e-3,
                      "warmup_ratio": 0.0, "precision": "fp32"},
            "deepspeed": {"zero_stage": 0},
            "checkpoint": {"every_steps": 1},
        },
        "eval": {"suite": str(world["suite"]), "limit": 2, "batch_size": 8},
    }
    data.update(changes)
    return load_recipe(RunRecipe, data=data)


def test_plan_stages_and_keys(world, tmp_path):
    stages = plan(run_recipe(world, tmp_path / "r"))
    labels = [s.label for s in stages]
    assert labels == ["convert-2x-xecomla", "convert-2x-random", "convert-4x-xecomla", "convert-4x-random",
                      "distill-2x-xecomla-big", "distill-2x-random-big", "distill-4x-xecomla-big",
                      "distill-4x-random-big"]
    again = plan(run_recipe(world, tmp_path / "elsewhere"))
    assert [s.key for s in stages] == [s.key for s in again]  # keys do not depend on where the run lives
    changed = plan(run_recipe(world, tmp_path / "r", distill={**run_recipe(world, tmp_path).distill,
                                                              "train": {"total_tokens": 256 * 4,
                                                                        "global_batch_tokens": 256,
                                                                        "micro_batch_size": 2,
                                                                        "precision": "fp32"}}))
    same = [a.key == b.key for a, b in zip(stages, changed)]
    assert same == [True] * 4 + [False] * 4  # a distill edit keeps every conversion
    assert stages[4].recipe.student == str(stages[0].model_dir)
    assert stages[4].recipe.teacher.model == str(world["teacher"])


def test_convert_keys_per_ratio(world, tmp_path):
    by_ratio = {4.0: {"mla": {"qk_rope_head_dim": 4, "rope_dims": "high"}}}
    stages = plan(run_recipe(world, tmp_path / "r", convert_by_ratio=by_ratio))
    plain = plan(run_recipe(world, tmp_path / "r"))
    for s, p in zip(stages, plain):
        if s.kind != "convert":
            continue
        at_4x = s.info["ratio"] == 4.0
        assert s.recipe.mla.qk_rope_head_dim == (4 if at_4x else 8)  # merged over convert.mla, key by key
        assert s.recipe.mla.rope_dims == ("high" if at_4x else "last")
        assert s.recipe.dtype == "float32"  # the rest of convert still applies
        assert (s.key == p.key) == (not at_4x)  # only the overridden ratio's stages change
    with pytest.raises(RecipeError) as err:
        run_recipe(world, tmp_path / "r", convert_by_ratio={3.0: {"mla": {"kv_lora_rank": 9}}})
    text = str(err.value)
    assert "convert_by_ratio: 3.0 is not one of ratios [2.0, 4.0]" in text
    assert "convert_by_ratio.3.0.mla.kv_lora_rank: set by `ecomla run`" in text
    with pytest.raises(RecipeError, match=r"convert \(at 4.0x\)\.mla\.rope_dim: unknown key"):
        plan(run_recipe(world, tmp_path / "r", convert_by_ratio={4.0: {"mla": {"rope_dim": 4}}}))


def with_cache(recipe: RunRecipe, **teacher) -> dict:
    return {**recipe.distill, "teacher": {"source": "cache", **teacher}}


def test_plan_with_a_teacher_cache(world, tmp_path):
    live = run_recipe(world, tmp_path / "r", distill_teachers=["self", "big"])
    stages = plan(run_recipe(world, tmp_path / "r", distill_teachers=["self", "big"], distill=with_cache(live)))
    labels = [s.label for s in stages]
    # one cache per teacher used (the random students use big, the baseline), before any distillation
    assert labels[4:6] == ["teacher-cache-self", "teacher-cache-big"]
    assert [s.kind for s in stages[6:]] == ["distill"] * 6
    caches = {s.info["teacher"]: s for s in stages[4:6]}
    for s in stages[6:]:
        assert s.recipe.teacher.source == "cache"
        assert s.recipe.teacher.cache_dir == str(caches[s.info["teacher"]].model_dir)
    assert caches["big"].recipe.teacher.model == str(world["teacher"])
    assert caches["big"].recipe.output_dir == str(caches["big"].dir)

    def keys(**teacher_and_train):
        train = teacher_and_train.pop("train", {})
        d = with_cache(live, **teacher_and_train)
        d["train"] = {**d["train"], **train}
        return {s.label: s.key for s in plan(run_recipe(world, tmp_path / "r", distill_teachers=["self", "big"],
                                                           distill=d))}

    base = keys()
    lr = keys(train={"lr": 5e-4})  # the schedule is not an input of the cache
    assert lr["teacher-cache-big"] == base["teacher-cache-big"]
    assert all(lr[k] != base[k] for k in base if k.startswith("distill"))
    topk = keys(cache_topk=8)  # what the cache holds is
    assert topk["teacher-cache-big"] != base["teacher-cache-big"]
    assert all(topk[k] != base[k] for k in base if k.startswith("distill"))
    assert all(topk[k] == base[k] for k in base if k.startswith("convert"))


def test_recipe_problems(world, tmp_path):
    with pytest.raises(RecipeError) as err:
        run_recipe(world, tmp_path / "r", ratios=[0.5], distill_teachers=["huge"], presets=["xecomla", "pca"],
                   convert={"model": "x"})
    text = str(err.value)
    assert "ratios" in text and "'huge' is not a key of teachers" in text and "'pca'" in text
    assert "convert.model: set by `ecomla run`" in text
    with pytest.raises(RecipeError, match=r"distill\.teacher\.cache_dir: set by `ecomla run`"):
        run_recipe(world, tmp_path / "r", distill={"teacher": {"source": "cache", "cache_dir": "c"}})
    bad = run_recipe(world, tmp_path / "r", convert={"mla": {"qk_rope_head_dim": 8, "rank": 3}})
    with pytest.raises(RecipeError, match=r"convert\.mla\.rank: unknown key"):
        plan(bad)


@pytest.mark.slow
def test_run_reuses_stages_and_reruns_only_what_changed(world, tmp_path, capsys):
    out = tmp_path / "r"
    recipe = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={})
    eval_dir = run(recipe, progress=False) / "eval"
    first = capsys.readouterr().out
    assert first.count(": done in") == 2  # one conversion, one distillation
    results = json.loads((eval_dir / "report.json").read_text())
    names = [m["name"] for m in results["models"]]
    assert names == ["base", "big", "convert-4x-xecomla", "4x-xecomla-big"]
    distilled = next(m for m in results["models"] if m["name"] == "4x-xecomla-big")
    assert distilled["kv"]["compression"] == 4.0 and distilled["teacher"] == "big" and distilled["kv"]["match"]
    stamps = {p: p.stat().st_mtime_ns for p in (eval_dir / "results").glob("*.json")}

    run(recipe, progress=False)  # nothing changed: every stage and every eval result reused
    assert capsys.readouterr().out.count(": reused") == 2
    assert {p: p.stat().st_mtime_ns for p in (eval_dir / "results").glob("*.json")} == stamps

    edited = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={},
                        distill={**recipe.distill, "train": {**recipe.distill["train"], "lr": 5e-4}})
    run(edited, progress=False)
    log = capsys.readouterr().out
    assert "convert-4x-xecomla: reused" in log and "distill-4x-xecomla-big: done in" in log
    after = {p.name: p.stat().st_mtime_ns for p in (eval_dir / "results").glob("*.json")}
    assert after["4x-xecomla-big.json"] != stamps[eval_dir / "results" / "4x-xecomla-big.json"]
    assert after["base.json"] == stamps[eval_dir / "results" / "base.json"]


@pytest.mark.slow
def test_run_with_a_teacher_cache(world, tmp_path, capsys):
    out = tmp_path / "r"
    live = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={})
    recipe = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, distill=with_cache(live))
    run(recipe, progress=False)
    log = capsys.readouterr().out
    assert "[2/4] teacher-cache-big: done in" in log and "[3/4] distill-4x-xecomla-big: done in" in log
    cache, distill = plan(recipe)[1:]
    assert (cache.model_dir / "meta.json").is_file()
    assert json.loads((cache.model_dir / "meta.json").read_text())["teacher"] == str(world["teacher"])
    metrics = [json.loads(line) for line in (Path(distill.recipe.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3 and all(m["kd"] > 0 for m in metrics if "kd" in m)
    run(recipe, progress=False)
    assert capsys.readouterr().out.count(": reused") == 3


@pytest.mark.slow
def test_an_interrupted_distillation_resumes(world, tmp_path, capsys):
    from ecomla.recipe.schema import save_recipe
    from tests.distill.world import BIN, run_and_kill

    out = tmp_path / "r"
    recipe = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={})
    recipe.distill["train"]["total_tokens"] = 256 * 8
    path = tmp_path / "run.yaml"
    save_recipe(recipe, path)
    distill_stage = plan(recipe)[1]
    metrics = Path(distill_stage.recipe.output_dir) / "metrics.jsonl"
    # `ecomla run` killed (SIGKILL, the whole process tree) once the distillation has logged 3 of its 8 steps.
    run_and_kill(path, 1, metrics, after_steps=3, cmd=[str(BIN / "ecomla"), "run", str(path), "--quiet"])
    assert not distill_stage.done_file.exists()
    run(recipe, progress=False)
    log = capsys.readouterr().out
    assert "convert-4x-xecomla: reused" in log and "distill-4x-xecomla-big: running" in log
    assert "resumed from" in log
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 8 and len(steps) < 8 + 3  # continued from a checkpoint, not from step 0


def test_a_linear_latent_distilled_with_lora_is_refused_at_plan_time(world, tmp_path):
    kw = dict(presets=["xecomla"], variants={}, convert={"mla": {"qk_rope_head_dim": 8}, "dtype": "float32", "device": "cpu"},
              convert_by_ratio={4.0: {"mla": {"latent_norm": "linear"}}})
    assert any(s.kind == "distill" for s in plan(run_recipe(world, tmp_path / "full", **kw)))  # full training: fine
    r = run_recipe(world, tmp_path / "run", **kw)
    r.distill["train"]["mode"] = "lora"
    with pytest.raises(RecipeError, match=r"convert \(at 4.0x\)\.mla\.latent_norm: convert-4x-xecomla is distilled with LoRA"):
        plan(r)
    assert not (tmp_path / "run").exists()


def test_an_eval_task_limit_for_a_task_outside_the_suite_is_refused_before_any_stage(world, tmp_path):
    r = run_recipe(world, tmp_path / "run", presets=["xecomla"], variants={})
    r.eval["task_limits"] = {"tinyworld_recal": 5}
    with pytest.raises(EvalError, match="task_limits: 'tinyworld_recal' not in suite"):
        run(r, progress=False)
    assert not (tmp_path / "run").exists()
