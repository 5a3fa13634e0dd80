"""`ecomla run`: the stage plan, its keys, and the stage cache (reuse, rerun what changed, resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from ecomla.eval.runner import EvalError
from ecomla.io.fingerprint import path_fingerprint
from ecomla.recipe.schema import RecipeError, load_recipe, merged
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


def test_local_calibration_and_other_text_files_join_their_stages_keys(world, tmp_path):
    """A conversion calibrated on a local file, and the measure's other text, rerun when the file is edited in
    place (the recipe, which names only the path, is the same); named corpora keep the keys they had."""
    shutil.copy(world["corpus"] / "a_fit.jsonl", tmp_path / "cal.jsonl")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.txt").write_text("Some text of another kind. " * 40)
    calibrated = {"init": {"method": "activation", "calibration": {"dataset": str(tmp_path / "cal.jsonl"),
                                                                   "num_tokens": 128, "seq_len": 64,
                                                                   "heldout_tokens": 0}}}
    changes = {"presets": ["cal"], "variants": {"cal": calibrated}, "distill_teachers": [], "distill": None,
               "eval": None, "measure": {"eval_tokens": 64, "seq_len": 64, "other_text": str(tmp_path / "other")}}

    def keys():
        return {s.label: s.key for s in plan(run_recipe(world, tmp_path / "r", **changes), adopt=False)}

    before = keys()
    assert sorted(before) == ["convert-2x-cal", "convert-4x-cal", "measure-convert-2x-cal", "measure-convert-4x-cal"]
    with (tmp_path / "cal.jsonl").open("a") as fh:
        fh.write(json.dumps({"text": "one more calibration document"}) + "\n")
    edited = keys()
    assert all(edited[label] != before[label] for label in before)  # every conversion, and so its measure
    (tmp_path / "other" / "a.txt").write_text("Other words entirely. " * 40)
    assert {label: key != edited[label] for label, key in keys().items()} == {
        "convert-2x-cal": False, "convert-4x-cal": False, "measure-convert-2x-cal": True,
        "measure-convert-4x-cal": True}
    # a distillation measured along the way reads the other text too, so it reruns with it; one that is not does not
    along = {"eval": None, "measure": {**changes["measure"], "every_tokens": 256}}
    quiet = {"eval": None, "measure": changes["measure"]}
    def distill_keys(measure: dict) -> dict[str, str]:
        stages = plan(run_recipe(world, tmp_path / "r", **measure), adopt=False)
        return {s.label: s.key for s in stages if s.kind == "distill"}

    distills = {name: distill_keys(measure) for name, measure in (("along", along), ("quiet", quiet))}
    (tmp_path / "other" / "a.txt").write_text("And other words again. " * 40)
    for name, measure in (("along", along), ("quiet", quiet)):
        now = distill_keys(measure)
        assert len(now) == 4 and all((now[label] != key) == (name == "along") for label, key in distills[name].items())
    pytext = {"init": {"calibration": {"dataset": "pytext:calibration"}}}
    named = {**changes, "variants": {"cal": merged(calibrated, pytext)}}
    stage = plan(run_recipe(world, tmp_path / "r", **named), adopt=False)[0]
    assert stage.inputs == [path_fingerprint(world["base"])]  # a named corpus adds no input, so keys stay as they were


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


def as_an_earlier_ecomla_left_them(stages: list, knobs: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Rewrite finished stages as an ecomla without the knobs `knobs` (kind -> dotted keys) would have left them:
    those keys absent from each recorded recipe, the key its digest would then have been (the stages after it
    keyed from that key), the directory named by it. Returns each stage's label -> that earlier key."""
    from ecomla.io.fingerprint import digest

    renamed: dict[str, str] = {}
    earlier: dict[str, str] = {}
    for stage in stages:
        record = json.loads(stage.done_file.read_text())
        for dotted in knobs.get(stage.kind, ()):
            *parents, leaf = dotted.split(".")
            node = record["recipe"]
            for part in parents:
                node = node[part]
            node.pop(leaf)
        record["inputs"] = [renamed.get(x, x) if isinstance(x, str) else x for x in record["inputs"]]
        key = digest(stage.kind, record["recipe"], *record["inputs"])
        renamed[stage.key], earlier[stage.label] = key, key
        record["key"] = key
        stage.done_file.write_text(json.dumps(record))
        stage.dir.rename(stage.dir.with_name(f"{stage.label}-{key}"))
    return earlier


@pytest.mark.slow
def test_an_upgrade_that_adds_knobs_reuses_finished_stages(world, tmp_path, capsys):
    out = tmp_path / "r"
    live = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None)
    recipe = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None,
                        distill=with_cache(live))
    run(recipe, progress=False)
    assert capsys.readouterr().out.count(": done in") == 3  # conversion, teacher cache, distillation
    stages = plan(recipe)
    def written(stages) -> dict:
        return {(s.label, str(p.relative_to(s.model_dir))): p.stat().st_mtime_ns
                for s in stages for p in s.model_dir.rglob("*") if p.is_file()}

    before = written(stages)
    # An earlier ecomla had none of these knobs; with each at its default this version computes what it did.
    earlier = as_an_earlier_ecomla_left_them(stages, {
        "convert": ("init.token_weight_power",),
        "teacher-cache": ("data.train.max_tokens",),
        "distill": ("data.train.max_tokens", "train.lr_multipliers")})
    adopted = plan(recipe)
    assert {s.label: s.key for s in adopted} == earlier and all(s.adopted and s.done() for s in adopted)
    assert adopted[2].recipe.student == str(adopted[0].model_dir)  # paths follow the adopted directories
    assert adopted[2].recipe.teacher.cache_dir == str(adopted[1].model_dir)
    run(recipe, progress=False)
    log = capsys.readouterr().out
    assert log.count("keyed by an earlier ecomla") == 3 and "done in" not in log
    assert written(adopted) == before  # nothing recomputed
    # A knob added since and set away from its default: the earlier distillation did not do that, so it reruns;
    # the conversion and the cache, which do not read it, are still taken over.
    edited = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None,
                        distill={**with_cache(live), "train": {**live.distill["train"],
                                                               "lr_multipliers": {"mlp": 0.5}}})
    convert, cache, distill = plan(edited)
    assert convert.adopted and cache.adopted and not distill.adopted and not distill.done()
    # A changed value is a change, whatever the version
    lr = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None,
                    distill={**with_cache(live), "train": {**live.distill["train"], "lr": 5e-4}})
    assert not plan(lr)[2].adopted
    # An edited conversion: the distillation's own recipe is the same, its input (the conversion's key) is not
    mla = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None,
                     convert={**live.convert, "mla": {"qk_rope_head_dim": 4}}, distill=with_cache(live))
    convert, cache, distill = plan(mla)
    assert not convert.adopted and cache.adopted and not distill.adopted and not distill.done()
    # The teacher cache's own keys: another temperature is another cache
    hot = run_recipe(world, out, ratios=[4.0], presets=["xecomla"], variants={}, eval=None,
                     distill={**with_cache(live), "loss": {"temperature": 2.0}})
    assert not plan(hot)[1].adopted
    # --force starts from an empty directory: every stage is this version's, under this version's key
    run(recipe, force=True, progress=False)
    assert "keyed by an earlier ecomla" not in capsys.readouterr().out
    again = plan(recipe)
    assert not any(s.adopted for s in again) and all(s.done() for s in again)
    assert [s.key for s in again] == [s.key for s in stages]


@pytest.mark.slow
def test_stages_finished_before_their_record_get_it_on_reuse(world, tmp_path, capsys):
    recipe = run_recipe(world, tmp_path / "r", ratios=[4.0], presets=["xecomla"], variants={}, eval=None)
    run(recipe, progress=False)
    stages = plan(recipe)
    for stage in stages:  # as a version before the record left them
        record = json.loads(stage.done_file.read_text())
        assert record["recipe"] == stage.digested
        stage.done_file.write_text(json.dumps({k: v for k, v in record.items() if k not in ("recipe", "inputs")}))
    capsys.readouterr()
    run(recipe, progress=False)
    assert capsys.readouterr().out.count(": reused") == 2
    for stage in stages:
        record = json.loads(stage.done_file.read_text())
        assert (record["recipe"], record["inputs"]) == (stage.record["recipe"], stage.record["inputs"])


def test_measure_settings_among_a_distillations_inputs_may_gain_keys_at_their_default():
    """A distillation measured along the way hashes the measure settings as an input: an earlier ecomla's settings
    without a key added since, at its default, are the same input; anything else is not."""
    from ecomla.recipe.schema import recipe_to_dict
    from ecomla.run.adopt import same_inputs
    from ecomla.run.recipe import Measure

    now = recipe_to_dict(Measure(every_tokens=512))
    earlier = {k: v for k, v in now.items() if k != "other_text"}
    assert same_inputs(["a1b2", "fp", earlier, 0], ["a1b2", "fp", now, 0])
    assert not same_inputs(["a1b2", "fp", earlier, 0], ["a1b2", "fp", {**now, "other_text": "t.txt"}, 0])
    assert not same_inputs(["a1b2", "fp", {**earlier, "every_tokens": 1024}, 0], ["a1b2", "fp", now, 0])
    assert not same_inputs(["c3d4", "fp", earlier, 0], ["a1b2", "fp", now, 0])
    assert not same_inputs(["a1b2", "fp", earlier], ["a1b2", "fp", now, 0])
    assert not same_inputs("a1b2", ["a1b2"])


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
