"""`ecomla eval` and `ecomla report` on tiny models: checks before running, results, KV facts, caching, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ecomla.eval.recipe import EvalRecipe
from ecomla.eval.report import ReportError, line_label, markdown, summarize, write_report
from ecomla.eval.runner import EvalError, run_eval
from ecomla.recipe.schema import RecipeError, load_recipe
from tests.convert.helpers import convert

ROOT = Path(__file__).resolve().parents[2]


def small_suite(tmp_path: Path, tasks: list[dict] | None = None, name: str = "suite.yaml") -> Path:
    """Two tiny-world tasks: one multiple-choice (averaged), one perplexity (not)."""
    suite = {
        "name": "tiny-test",
        "include_path": str(ROOT / "eval" / "tasks" / "tinyworld"),
        "tasks": tasks or [{"task": "tinyworld_recall"},
                           {"task": "tinyworld_ppl_records", "metric": "word_perplexity", "average": False,
                            "higher_is_better": False}],
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(suite))
    return path


def recipe(tmp_path: Path, models: dict[str, Path], **extra) -> EvalRecipe:
    data = {
        "suite": str(small_suite(tmp_path)),
        "models": [{"name": "base", "path": str(models["base"]), "role": "base"},
                   {"name": "mla-4x", "path": str(models["mla"]), "role": "student", "init": "svd",
                    "stage": "converted"}],
        "output_dir": str(tmp_path / "eval"),
        "limit": 3,
        "batch_size": 8,
        **extra,
    }
    return load_recipe(EvalRecipe, data=data)


def test_eval_of_a_converted_checkpoint_loaded_by_path(models, tmp_path):
    out = run_eval(recipe(tmp_path, models), progress=False)
    base = json.loads((out / "results" / "base.json").read_text())
    mla = json.loads((out / "results" / "mla-4x.json").read_text())
    assert mla["model_type"] == "deepseek_v3" and base["model_type"] == "llama"
    # KV: the formula and the bytes of a real generate cache agree; the ratio is the converter's.
    assert base["kv"]["elements_per_token"] == 2 * 2 * 2 * 16
    assert mla["kv"]["elements_per_token"] == 2 * (8 + 8)
    for r in (base, mla):
        assert r["kv"]["match"], r["kv"]
        assert r["kv"]["measured_bytes_per_token"] == r["kv"]["elements_per_token"] * 4  # fp32
    assert base["kv"]["compression"] == 1.0 and mla["kv"]["compression"] == 4.0
    # Per-task numbers and the average over the averaged tasks only.
    recall = mla["tasks"]["tinyworld_recall"]
    assert recall["metric"] == "acc_norm" and 0.0 <= recall["value"] <= 1.0 and recall["n"] == 3
    assert set(recall["all_metrics"]) == {"acc", "acc_norm"} and recall["all_metrics"]["acc_norm"] == recall["value"]
    assert mla["tasks"]["tinyworld_ppl_records"]["value"] > 1.0
    assert mla["average"] == recall["value"]
    assert mla["lm_eval_version"] and recall["version"] is not None
    assert {"report.md", "report.json", "chart.png"} <= {p.name for p in out.iterdir()}
    assert (out / "chart.png").stat().st_size > 10_000


def test_eval_reuses_results_and_reruns_what_changed(models, tmp_path):
    out = run_eval(recipe(tmp_path, models), progress=False)
    files = {n: out / "results" / f"{n}.json" for n in ("base", "mla-4x")}
    stamps = {n: f.stat().st_mtime_ns for n, f in files.items()}
    run_eval(recipe(tmp_path, models), progress=False)
    assert {n: f.stat().st_mtime_ns for n, f in files.items()} == stamps  # nothing re-evaluated
    convert(models["base"], models["mla"], mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8})  # a new checkpoint
    run_eval(recipe(tmp_path, models), progress=False)
    assert files["base"].stat().st_mtime_ns == stamps["base"]
    assert files["mla-4x"].stat().st_mtime_ns != stamps["mla-4x"]
    assert json.loads(files["mla-4x"].read_text())["kv"]["compression"] == 64 / 24


def test_same_numbers_in_two_runs(models, tmp_path):
    a = run_eval(recipe(tmp_path, models, output_dir=str(tmp_path / "a")), progress=False)
    b = run_eval(recipe(tmp_path, models, output_dir=str(tmp_path / "b")), progress=False)
    for name in ("base", "mla-4x"):
        ra, rb = (json.loads((d / "results" / f"{name}.json").read_text()) for d in (a, b))
        assert ra["tasks"] == rb["tasks"] and ra["average"] == rb["average"]


def test_task_limits_replace_the_limit_for_the_tasks_they_name(models, tmp_path):
    out = run_eval(recipe(tmp_path, models, task_limits={"tinyworld_ppl_records": 1}), progress=False)
    tasks = json.loads((out / "results" / "mla-4x.json").read_text())["tasks"]
    assert tasks["tinyworld_recall"]["n"] == 3 and tasks["tinyworld_ppl_records"]["n"] == 1
    assert "Items scored per task: recall 3, ppl_records 1." in (out / "report.md").read_text()
    bad = recipe(tmp_path, models, output_dir=str(tmp_path / "bad"), task_limits={"tinyworld_recal": 1})
    with pytest.raises(EvalError, match="task_limits: 'tinyworld_recal' not in suite 'tiny-test'"):
        run_eval(bad, progress=False)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(RecipeError, match="task_limits.tinyworld_recall: must be >= 1"):
        recipe(tmp_path, models, task_limits={"tinyworld_recall": 0})


def test_unknown_task_fails_before_any_model_runs(models, tmp_path):
    r = recipe(tmp_path, models, suite=str(small_suite(tmp_path, [{"task": "tinyworld_recal"}], "bad.yaml")))
    with pytest.raises(EvalError, match="tinyworld_recal.*did you mean 'tinyworld_recall'"):
        run_eval(r, progress=False)
    assert not (tmp_path / "eval").exists()


def test_bad_model_paths_fail_together_before_any_model_runs(models, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = recipe(tmp_path, models)
    r.models[0].path = str(tmp_path / "missing")
    r.models[1].path = str(empty)
    with pytest.raises(EvalError) as err:
        run_eval(r, progress=False)
    assert "does not exist" in str(err.value) and "has no config.json" in str(err.value)
    assert not (tmp_path / "eval").exists()


def test_recipe_problems_are_listed():
    with pytest.raises(RecipeError) as err:
        load_recipe(EvalRecipe, data={"output_dir": "x", "batch_size": 0, "models": [
            {"name": "a", "path": "p", "role": "base"}, {"name": "a", "path": "q", "role": "base"}]})
    text = str(err.value)
    assert "used twice" in text and "at most one model may have role: base" in text and "batch_size" in text
    with pytest.raises(RecipeError, match="must be non-empty, without spaces"):
        load_recipe(EvalRecipe, data={"output_dir": "x", "models": [{"name": "has space", "path": "r"}]})


def test_unknown_suite_names_the_known_ones(tmp_path):
    from ecomla.eval.recipe import load_suite

    with pytest.raises(RecipeError, match="known: .*tinyworld.*xecomla"):
        load_suite("nope")
    for name in ("tinyworld", "xecomla"):
        suite, include = load_suite(name)
        assert suite.averaged


# ---- the report, from saved results alone -------------------------------------------------------------------

def fake_result(name: str, role: str, ratio: float | None, scores: list[float], **extra) -> dict:
    tasks = {f"t{i}": {"metric": "acc_norm", "value": v, "stderr": 0.01, "average": True, "higher_is_better": True,
                       "version": 1.0, "n": 500} for i, v in enumerate(scores)}
    tasks["ppl"] = {"metric": "word_perplexity", "value": 12.5, "stderr": None, "average": False,
                    "higher_is_better": False, "version": 1.0, "n": 100}
    return {"name": name, "role": role, "params": 3_670_000, "tasks": tasks, "average": sum(scores) / len(scores),
            "kv": {"elements_per_token": 1024, "formula_bytes_per_token": 4096, "measured_bytes_per_token": 4096.0,
                   "match": True, "dtype_bytes": 4, "compression": ratio},
            "lm_eval_version": "0.4.13", "teacher": None, "init": None, "stage": None, **extra}


def saved_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    results = [
        fake_result("base", "base", 1.0, [0.6, 0.5, 0.7]),
        fake_result("teacher-8x", "teacher", 0.3, [0.8, 0.7, 0.9]),
        fake_result("6.4x-svd", "student", 6.4, [0.55, 0.45, 0.65], init="svd", stage="converted"),
        fake_result("6.4x-svd-t8", "student", 6.4, [0.6, 0.5, 0.66], init="svd", teacher="teacher-8x"),
        fake_result("12.8x-svd-t8", "student", 12.8, [0.5, 0.4, 0.6], init="svd", teacher="teacher-8x"),
        fake_result("12.8x-random-t8", "student", 12.8, [0.3, 0.3, 0.3], init="random", teacher="teacher-8x"),
    ]
    for r in results:
        (run / "results" / f"{r['name']}.json").write_text(json.dumps(r))
    (run / "eval_recipe.yaml").write_text(yaml.safe_dump({"models": [{"name": r["name"]} for r in results]}))
    return run


def test_the_report_leaves_out_results_of_models_no_longer_in_the_recipe(tmp_path, capsys):
    run = saved_run(tmp_path)
    stale = fake_result("6.4x-old-name", "student", 6.4, [0.1, 0.1, 0.1], init="svd", teacher="teacher-8x")
    (run / "results" / "6.4x-old-name.json").write_text(json.dumps(stale))
    summary = write_report(run)
    assert "6.4x-old-name" not in (run / "report.md").read_text()
    assert [m["name"] for m in summary["models"]].count("6.4x-old-name") == 0
    assert "1 saved result(s) of models not in eval_recipe.yaml left out: 6.4x-old-name" in capsys.readouterr().err
    (run / "eval_recipe.yaml").write_text(yaml.safe_dump({"models": [{"name": "another"}]}))
    with pytest.raises(ReportError, match="holds no result of a model in eval_recipe.yaml"):
        write_report(run)


def test_report_rebuilds_table_and_chart_from_saved_results(tmp_path):
    run = saved_run(tmp_path)
    summary = write_report(run)
    md = (run / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0].strip("| ") for r in rows] == [
        "base", "teacher-8x", "6.4x-svd", "6.4x-svd-t8", "12.8x-svd-t8", "12.8x-random-t8"]  # recipe order
    for row in rows:  # the average shown is the mean of the per-task scores shown, with its standard error
        cells = [c.strip() for c in row.strip("|").split("|")]
        scores, avg, se = [float(c) for c in cells[4:7]], float(cells[-2]), float(cells[-1])
        assert abs(sum(scores) / 3 - avg) < 0.01
        assert se == pytest.approx(100 * (3 * 0.01**2) ** 0.5 / 3, abs=0.01)  # three tasks of s.e. 1 point
    assert "The average covers 1500 items" in md
    assert "t0 (acc_norm)" in md and "ppl (word_perplexity)" in md and "12.50" in md
    assert "12.80×" in md and "lm-eval 0.4.13" in md
    assert (run / "chart.png").stat().st_size > 10_000
    assert json.loads((run / "report.json").read_text())["averaged"] == ["t0", "t1", "t2"]
    labels = {line_label(r) for r in summary["models"]}
    assert labels == {None, "no training (svd)", "teacher-8x teacher (svd)", "teacher-8x teacher (random)"}


def test_report_cli_and_its_errors(tmp_path, capsys):
    from ecomla.cli import main

    run = saved_run(tmp_path)
    assert main(["report", str(run)]) == 0
    assert "| 12.8x-random-t8 |" in capsys.readouterr().out
    empty = tmp_path / "empty"
    (empty / "results").mkdir(parents=True)
    assert main(["report", str(empty)]) == 2
    assert "no result files; run `ecomla eval` first" in capsys.readouterr().err


def test_report_refuses_results_from_different_suites(tmp_path):
    a = fake_result("a", "base", 1.0, [0.5, 0.5])
    b = fake_result("b", "student", 2.0, [0.5, 0.5, 0.5])
    with pytest.raises(ReportError, match="evaluate them with one suite"):
        summarize([a, b])
    assert "| a |" in markdown(summarize([a]))
