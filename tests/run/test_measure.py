"""`ecomla run` as the experiment harness: conversions over presets x budgets measured with the held-out
yardstick (the one-shot table and the preset bench), and distillation variants of one or more parts measured
along the way (the recovery curves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ecomla.analyze.yardstick import Yardstick
from ecomla.recipe.schema import RecipeError, load_recipe
from ecomla.run.pipeline import part_tokens, plan, run
from ecomla.run.recipe import RunRecipe

CALIBRATION = {"dataset": "pytext:calibration", "num_tokens": 1024, "seq_len": 128, "heldout_tokens": 0}
ILD_FIRST = [{"share": 0.5, "keys": {"loss": {"kd_weight": 0.0, "ild_weight": 1.0}}}, {"share": 0.5}]


def recipe(src: Path, out: Path, distil: bool = False, **changes) -> RunRecipe:
    data = {
        "output_dir": str(out),
        "base": str(src),
        "budgets": ["16+8", "64+8"],
        "presets": ["xecomla", "best", "svd-high"],
        "variants": {"svd-high": {"init": {"method": "svd"}, "mla": {"rope_dims": "high"}}},
        "convert": {"init": {"calibration": CALIBRATION}, "dtype": "float32", "device": "cpu"},
        "measure": {"eval_tokens": 512, "seq_len": 128},
        "eval": None,
    }
    if distil:
        data.update(teachers={"source": str(src)}, distill_teachers=["source"], distill={
            "data": {"train": {"dataset": "pytext:train", "max_documents": 12}, "seq_len": 128},
            "train": {"total_tokens": 256 * 6, "global_batch_tokens": 256, "micro_batch_size": 2, "lr": 3e-4,
                      "warmup_ratio": 0.0, "precision": "fp32"},
            "deepspeed": {"zero_stage": 0}, "checkpoint": {"every_steps": 0}})
    data.update(changes)
    return load_recipe(RunRecipe, data=data)


def test_the_plan_of_budgets_variants_and_parts(source_factory, tmp_path):
    src = source_factory("llama")
    r = recipe(src, tmp_path / "r", True, budgets=["16+8"], presets=["best", "xecomla"], variants={},
               distill_variants={"kd": [{}], "ild-then-kd": ILD_FIRST})
    stages = plan(r)
    assert [s.label for s in stages] == [
        "convert-16+8-best", "convert-16+8-xecomla",
        "distill-16+8-best-source-kd", "distill-16+8-best-source-ild-then-kd-part1of2",
        "distill-16+8-best-source-ild-then-kd-part2of2",
        "distill-16+8-xecomla-source-kd", "distill-16+8-xecomla-source-ild-then-kd-part1of2",
        "distill-16+8-xecomla-source-ild-then-kd-part2of2",
        "measure-convert-16+8-best", "measure-convert-16+8-xecomla",
        "measure-16+8-best-source-kd", "measure-16+8-best-source-ild-then-kd",
        "measure-16+8-xecomla-source-kd", "measure-16+8-xecomla-source-ild-then-kd"]
    by = {s.label: s for s in stages}
    best = by["convert-16+8-best"].recipe
    assert (best.mla.kv_lora_rank, best.mla.qk_rope_head_dim, best.init.preset) == (16, 8, "best")
    assert best.mla.latent_norm == "linear" and by["convert-16+8-xecomla"].recipe.mla.latent_norm == "normalize"
    # a variant over a preset: best with one lever off
    off = plan(recipe(src, tmp_path / "r", budgets=["16+8"], presets=["best-no-linear"],
                      variants={"best-no-linear": {"init": {"preset": "best"}, "mla": {"latent_norm": "normalize"}}}))
    lever = off[0].recipe
    assert (lever.init.preset, lever.init.objective, lever.mla.latent_norm) == ("best", "attention", "normalize")
    one, two = by["distill-16+8-best-source-ild-then-kd-part1of2"], by["distill-16+8-best-source-ild-then-kd-part2of2"]
    assert (one.recipe.train.total_tokens, two.recipe.train.total_tokens) == (768, 768)
    assert one.recipe.loss.kd_weight == 0.0 and two.recipe.loss.kd_weight == 1.0
    assert two.recipe.student == str(one.model_dir)  # the second part starts from the first's final/
    assert by["measure-16+8-best-source-ild-then-kd"].model_dir == two.model_dir
    # measured along the way: the points are the distillation's output, so their settings are in its key
    along = {s.label: s.key for s in plan(recipe(src, tmp_path / "r", True, budgets=["16+8"],
                                                 presets=["best", "xecomla"], variants={},
                                                 distill_variants={"kd": [{}], "ild-then-kd": ILD_FIRST},
                                                 measure={"eval_tokens": 512, "seq_len": 128, "every_tokens": 512}))}
    assert all((along[k] == s.key) == (s.kind == "convert") for k, s in by.items() if s.kind != "measure")
    # a one-part variant may take its own budget, with its own schedule, beside the run's
    own = {s.label: s for s in plan(recipe(src, tmp_path / "r", True, budgets=["16+8"], presets=["best"],
                                           distill_variants={"kd": [{}], "short": [{"keys": {"train": {
                                               "total_tokens": 512}}}]}))}
    short = own["distill-16+8-best-source-short"]
    assert (short.recipe.train.total_tokens, short.info["tokens"]) == (512, 512)
    assert own["distill-16+8-best-source-kd"].info["tokens"] == 256 * 6
    assert part_tokens([0.25, 0.75], 40960, 2048) == [10240, 30720]
    assert part_tokens([0.5, 0.5], 768, 256) == [512, 256]  # 1.5 steps round to 2; the last part takes the rest


def test_recipe_problems(source_factory, tmp_path):
    src = source_factory("llama")
    with pytest.raises(RecipeError) as err:
        recipe(src, tmp_path / "r", True, inits=["svd"], ratios=[2.0], presets=["xecomla", "nope"],
               variants={"best": {}, "odd name": {}},
               distill_variants={"a": [{"share": 0.5}], "b": [{"share": 0.5, "keys": {"train": {"total_tokens": 9}}},
                                                   {"share": 0.5}]})
    text = str(err.value)
    for expected in ("inits: replaced by presets", "give ratios or budgets", "'nope' is neither a preset",
                     "variants.best: 'best' is also a preset name", "variants.odd name: a name of letters",
"distill_variants.a: each share",
                     "distill_variants.b[0].keys.train.total_tokens: a part of several trains on its share"):
        assert expected in text, (expected, text)
    with pytest.raises(RecipeError, match=r"convert\.mla\.qk_rope_head_dim: set by `ecomla run`"):
        recipe(src, tmp_path / "r", convert={"mla": {"qk_rope_head_dim": 8}})
    with pytest.raises(RecipeError, match=r"measure.every_tokens: 300 is not a whole number of .*\(256\)"):
        plan(recipe(src, tmp_path / "r", True, measure={"every_tokens": 300}))
    # a variant's own batch is the one the measurements must fall on
    with pytest.raises(RecipeError, match=r"every_tokens: 256 is not a whole number of "
                                          r"distill_variants\.b\[0\]\.keys\.train\.global_batch_tokens \(512\)"):
        plan(recipe(src, tmp_path / "r", True, presets=["best"], measure={"every_tokens": 256}, distill_variants={
            "b": [{"keys": {"train": {"global_batch_tokens": 512, "micro_batch_size": 2}}}]}))
    # a linear latent is refused under LoRA in any part of a variant, not only in the first
    with pytest.raises(RecipeError, match=r"convert\.mla\.latent_norm: convert-16\+8-best is distilled with LoRA"):
        plan(recipe(src, tmp_path / "r", True, budgets=["16+8"], presets=["best"], distill_variants={
            "then-lora": [{"share": 0.5}, {"share": 0.5, "keys": {"train": {"mode": "lora"}}}]}))
    with pytest.raises(RecipeError, match="distill_teachers and distill_variants need a distill section"):
        recipe(src, tmp_path / "r", distill_variants={"kd": [{}]})


def test_one_conversion_measured_and_reported(source_factory, tmp_path):
    """The fast lane's pass through the measure stage, the yardstick and the report."""
    src = source_factory("llama")
    out = run(recipe(src, tmp_path / "r", budgets=["16+8"], presets=["xecomla"], variants={}), progress=False)
    result = json.loads((out / "measure" / "report.json").read_text())
    (row,) = result["conversions"]
    assert (row["preset"], row["point"], row["compression"]) == ("xecomla", "16+8", 64 / 24)
    assert all(row[d]["kl"] > 0 and row[d]["perplexity"] > result["source"][d] * 0.5 for d in ("prose", "code"))
    assert "| xecomla | 16+8 | 2.67× |" in (out / "measure" / "report.md").read_text()
    assert (out / "measure" / "conversions.png").is_file() and not (out / "measure" / "curves.png").exists()


@pytest.mark.slow
def test_conversions_side_by_side_then_a_rerun_reuses_them(source_factory, tmp_path, capsys):
    src = source_factory("llama")  # 2 KV heads of 16: 64 cached numbers per token and layer
    r = recipe(src, tmp_path / "r")
    out = run(r, progress=False)
    assert capsys.readouterr().out.count(": done in") == 12  # 6 conversions, each measured
    result = json.loads((out / "measure" / "report.json").read_text())
    rows = {(x["preset"], x["point"]): x for x in result["conversions"]}
    assert set(rows) == {(p, b) for p in ("xecomla", "best", "svd-high") for b in ("16+8", "64+8")}
    for preset in ("xecomla", "best", "svd-high"):
        small, wide = rows[preset, "16+8"], rows[preset, "64+8"]
        assert small["compression"] == 64 / 24 and wide["compression"] == 64 / 72
        for d in ("prose", "code"):
            assert 0 < wide[d]["kl"] <= small[d]["kl"] * 1.05  # more budget, no more error
    # the numbers are the yardstick's own, on the checkpoint the stage kept
    stick = Yardstick(str(src), 512, 128)
    assert result["source"] == stick.source
    best = next(s for s in plan(r) if s.label == "convert-16+8-best")
    direct = stick.measure(best.model_dir)
    assert rows["best", "16+8"]["code"]["perplexity"] == direct["code"]["converted_perplexity"]
    assert (out / "measure" / "conversions.png").stat().st_size > 10_000
    assert "Rank at each ratio" in (out / "measure" / "report.md").read_text()
    assert not (out / "eval").exists()  # eval: null
    run(r, progress=False)
    assert capsys.readouterr().out.count(": reused") == 12


@pytest.mark.slow
def test_distillation_variants_measured_along_the_way(source_factory, tmp_path, capsys):
    src = source_factory("llama")
    r = recipe(src, tmp_path / "r", True, budgets=["16+8"], presets=["best"], variants={},
               distill_variants={"kd": [{}], "ild-then-kd": ILD_FIRST},
               measure={"eval_tokens": 512, "seq_len": 128, "every_tokens": 512})
    out = run(r, progress=False)
    result = json.loads((out / "measure" / "report.json").read_text())
    curves = {c["variant"]: c for c in result["curves"]}
    assert set(curves) == {"kd", "ild-then-kd"}
    for c in curves.values():
        assert [p["tokens"] for p in c["points"]] == [0, 512, 1024, 1536]
        kl = [p["prose"]["kl"] + p["code"]["kl"] for p in c["points"]]
        assert kl[-1] < kl[0], (c["name"], kl)  # closer to the source: best's linear latent trains
        assert c["points"][0] == {k: v for k, v in result["conversions"][0].items() if k in c["points"][0]}
    seconds = [p["seconds"] for p in curves["ild-then-kd"]["points"]]
    assert seconds == sorted(seconds)  # the second part's time counts on from the first's
    stages = {s.label: s for s in plan(r)}
    part1 = stages["distill-16+8-best-source-ild-then-kd-part1of2"]
    metrics = [json.loads(x) for x in (part1.dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["loss"] == m["ild"] for m in metrics if "loss" in m)  # ILD alone first
    # the last point along the way is the final checkpoint's measurement
    final = json.loads(stages["measure-16+8-best-source-kd"].points_file.read_text())
    assert curves["kd"]["points"][-1]["code"]["perplexity"] == pytest.approx(
        final["code"]["converted_perplexity"], rel=1e-6)
    assert (out / "measure" / "curves.png").stat().st_size > 10_000
    md = (out / "measure" / "report.md").read_text()
    tables = [block.splitlines() for block in md.split("\n\n") if block.startswith("|")]
    assert len(tables) == 2  # the conversions, the distillations
    for table in tables:  # header, separator and rows agree on the columns
        assert len({line.count("|") for line in table}) == 1, table[:2]
    assert "16+8-best-source-ild-then-kd reaches" in md or "16+8-best-source-ild-then-kd does not reach" in md


def test_the_levers_recipe_switches_off_each_of_bests_levers():
    from ecomla.convert.presets import BEST_LEVERS
    from ecomla.recipe.schema import merged

    r = load_recipe(RunRecipe, Path(__file__).resolve().parents[2] / "recipes" / "run" / "best_levers_smollm2.yaml")
    assert r.presets == ["best", *(f"best-no-{lever}" for lever in BEST_LEVERS)]
    for lever, off in BEST_LEVERS.items():
        assert r.variants[f"best-no-{lever}"] == merged({"init": {"preset": "best"}}, off)


def test_efficiency_and_projection_lines():
    from ecomla.run.measure import efficiency, projections

    def curve(name, ppls):
        return {"name": name, "point": "4+2", "points": [{"tokens": t, "prose": {"perplexity": p}}
                                                         for t, p in zip((0, 100, 200), ppls)]}

    base, faster = curve("base", [30.0, 20.0, 10.0]), curve("faster", [30.0, 10.0, 5.0])
    below, slower = curve("below", [8.0, 9.0, 9.5]), curve("slower", [30.0, 25.0, 22.0])
    lines = efficiency([base, faster, below, slower], ["prose"])
    assert lines == ["- prose: faster reaches base's final perplexity 10.00 (after 200 tokens) with 100 tokens = 50% "
                     "of them",
                     "- prose: below starts at or below base's final perplexity 10.00 (after 200 tokens)",
                     "- prose: slower does not reach base's final perplexity 10.00 (after 200 tokens) within the run"]
    crawl = curve("crawl", [30.0, 20.0, 19.999])  # the excess falls so slowly that no budget gets there
    lines = projections([faster, crawl, below], {"prose": 4.5}, ["prose"])
    assert lines[0] == "- faster, prose: 1.2x the source (5.40) reached at 189 tokens"  # log-linear
    assert lines[1] == "- crawl, prose: 1.2x the source (5.40) not reached; a power law through the curve projects " \
                       "more than 10^12 tokens"
    assert lines[2] == "- below, prose: 1.2x the source (5.40) not reached, and the last points do not fall"
