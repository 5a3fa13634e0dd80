"""`ecomla run`: convert → distill → eval → report, with every stage cached by a hash of what it computes.

Stages, in order:
  convert         one per (ratio, init): the base converted to MLA, no training;
  teacher-cache   with `distill.teacher.source: cache` only, one per teacher
                  used: its top-k log-probs over the distillation data, so
                  each teacher runs once rather than once per student;
  distill         one per ratio and teacher in distill_teachers for the main
                  init, and one per ratio from baseline_teacher for every
                  other init;
  eval            every model (base, teachers, converted and distilled
                  students) through `ecomla eval` (results reused per model);
  report          the table and the chart (`ecomla report <output_dir>/eval`).

A stage's key hashes its resolved sub-recipe (output paths left out) and the
fingerprints of its inputs (the source checkpoint's files, the teacher's, the
upstream stage's key, the training data). Its outputs live in
<output_dir>/stages/<label>-<key>/ and count as finished once stage.json is
written there. So a rerun reuses finished stages, an edited recipe reruns only
the stages whose key changed (and what depends on them), and an interrupted
distillation resumes from its last checkpoint (same key, same directory).

Under a launcher (`deepspeed --module ecomla.run`, `torchrun -m ecomla.run`)
every rank takes part in the teacher caches and distillations; rank 0 alone
converts (the others wait) and evaluates (the others exit after the last
distillation).
The run directory must be on a file system all ranks share.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ecomla.io.fingerprint import CachedStage, digest, path_fingerprint
from ecomla.mla.budget import format_ratio
from ecomla.recipe.schema import RecipeError, load_recipe, recipe_to_dict, save_recipe
from ecomla.run.recipe import RunRecipe, merged


@dataclass
class Stage(CachedStage):
    kind: str  # convert | teacher-cache | distill
    label: str
    recipe: Any  # ConvertRecipe | DistillRecipe
    key: str
    dir: Path
    info: dict = field(default_factory=dict)  # ratio, init, teacher

    @property
    def model_dir(self) -> Path:
        return self.dir / {"convert": "model", "teacher-cache": "cache", "distill": "run/final"}[self.kind]


def _sub_recipe(cls: type, section: str, body: dict, fills: dict[str, Any]):
    """The stage's recipe: the run recipe's section with the stage's own keys (`FILLED`) merged in."""
    data = merged(body, fills)  # a new dict along the filled paths; load_recipe copies the rest
    try:
        return load_recipe(cls, data=data)
    except RecipeError as err:
        raise RecipeError([f"{section}.{p}" for p in err.problems], err.source) from None


def _data_fingerprints(distill) -> list[str]:
    out = []
    for src in (distill.data.train, distill.data.eval):
        if src is not None:
            out.append(path_fingerprint(src.prepared or src.dataset))
    return out


def _teacher_source(distill: dict) -> str:
    from ecomla.distill.recipe import TeacherConfig

    default = TeacherConfig().source  # the distill recipe's own default, not a copy
    teacher = distill.get("teacher")
    return teacher.get("source", default) if isinstance(teacher, dict) else default


def _cache_inputs(sub) -> dict:
    """What a teacher cache depends on besides the checkpoints and the data files: not the training schedule."""
    from ecomla.distill.teacher import teacher_dtype

    d = recipe_to_dict(sub)
    teacher = {k: v for k, v in d["teacher"].items() if k not in ("model", "cache_dir")}
    teacher["dtype"] = str(teacher_dtype(sub))
    return {"tokenizer": d.get("tokenizer"), "data": {k: v for k, v in d["data"].items() if k != "eval"},
            "teacher": teacher, "temperature": d["loss"]["temperature"]}


def plan(recipe: RunRecipe) -> list[Stage]:
    """Every convert and distill stage, resolved and keyed; recipe problems raise before anything runs."""
    from ecomla.convert.layout import LINEAR_LATENT_LORA
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.distill.recipe import DistillRecipe

    out = Path(recipe.output_dir) / "stages"
    base_fp = path_fingerprint(recipe.base)
    stages: list[Stage] = []
    converted: dict[tuple[float, str], Stage] = {}
    for ratio in recipe.ratios:
        for init in recipe.inits:
            label = f"convert-{format_ratio(ratio)}-{init}"
            fills = {"model": recipe.base, "output_dir": "", "mla": {"target_compression": ratio},
                     "init": {"method": init}}
            section = "convert" if ratio not in recipe.convert_by_ratio else f"convert (at {ratio}x)"
            sub = _sub_recipe(ConvertRecipe, section, recipe.convert_for(ratio), fills)
            key = digest("convert", recipe_to_dict(sub), base_fp)
            stage = Stage("convert", label, sub, key, out / f"{label}-{key}", {"ratio": ratio, "init": init})
            sub.output_dir = str(stage.model_dir)
            stages.append(stage)
            converted[ratio, init] = stage
    # Each teacher's files and the training data are fingerprinted once, not once per stage that uses them.
    teacher_fp = {t: path_fingerprint(recipe.teachers[t]) for t in recipe.used_teachers}
    data_fp: list[str] | None = None
    caches: dict[str, Stage] = {}
    if _teacher_source(recipe.distill) == "cache":
        for teacher in recipe.used_teachers:
            label = f"teacher-cache-{teacher}"
            fills = {"student": recipe.base, "teacher": {"model": recipe.teachers[teacher], "cache_dir": "x"},
                     "output_dir": ""}
            sub = _sub_recipe(DistillRecipe, "distill", recipe.distill, fills)
            data_fp = data_fp or _data_fingerprints(sub)
            key = digest("teacher-cache", _cache_inputs(sub), base_fp, teacher_fp[teacher], data_fp)
            stage = Stage("teacher-cache", label, sub, key, out / f"{label}-{key}", {"teacher": teacher})
            sub.teacher.cache_dir, sub.output_dir = str(stage.model_dir), str(stage.dir)
            stages.append(stage)
            caches[teacher] = stage
    for ratio in recipe.ratios:
        for init in recipe.inits:
            for teacher in recipe.teachers_for(init):
                src = converted[ratio, init]
                label = f"distill-{format_ratio(ratio)}-{init}-{teacher}"
                cache = caches.get(teacher)
                teacher_keys = {"model": recipe.teachers[teacher]}
                if cache is not None:
                    teacher_keys["cache_dir"] = str(cache.model_dir)
                fills = {"student": str(src.model_dir), "teacher": teacher_keys, "output_dir": ""}
                sub = _sub_recipe(DistillRecipe, "distill", recipe.distill, fills)
                if src.recipe.mla.latent_norm == "linear" and sub.train.mode == "lora":
                    where = "convert" if ratio not in recipe.convert_by_ratio else f"convert (at {ratio}x)"
                    raise RecipeError([f"{where}.mla.latent_norm: {src.label} is distilled with LoRA, but "
                                       + LINEAR_LATENT_LORA])
                as_dict = recipe_to_dict(sub)
                as_dict.pop("student")
                as_dict["teacher"].pop("cache_dir")  # a path under output_dir; the cache's key stands for it
                data_fp = data_fp or _data_fingerprints(sub)
                key = digest("distill", as_dict, src.key, teacher_fp[teacher], data_fp,
                             cache.key if cache is not None else None)
                stage = Stage("distill", label, sub, key, out / f"{label}-{key}",
                              {"ratio": ratio, "init": init, "teacher": teacher, "after": src.label})
                sub.output_dir = str(stage.dir / "run")
                stages.append(stage)
    return stages


def _run_stage(stage: Stage, progress: bool) -> None:
    stage.dir.mkdir(parents=True, exist_ok=True)
    if stage.kind == "convert":
        from ecomla.convert.stream import convert_recipe

        # The conversion writes atomically: a half-done one leaves nothing, so start over.
        convert_recipe(stage.recipe, force=True, progress=progress)
    elif stage.kind == "teacher-cache":
        from ecomla.distill.jobs import teacher_cache

        # Written to a temporary directory and renamed when whole, so an interrupted cache starts over.
        teacher_cache(stage.recipe, force=True, progress=progress)
    else:
        from ecomla.distill.trainer import run as distill

        distill(stage.recipe, force=False, progress=progress)  # resumes from run/checkpoints/latest if interrupted


def eval_models(recipe: RunRecipe, stages: list[Stage]) -> list[dict]:
    """The eval recipe's model list: base, teachers (the base's own path once), converted and distilled students."""
    models = [{"name": "base", "path": recipe.base, "role": "base"}]
    for name, path in recipe.teachers.items():
        if path != recipe.base:
            models.append({"name": name, "path": path, "role": "teacher"})
    for s in stages:
        if s.kind == "teacher-cache":
            continue
        entry = {"name": s.label.removeprefix("distill-"), "path": str(s.model_dir), "role": "student",
                 "init": s.info["init"]}
        if s.kind == "convert":
            entry.update(stage="converted")
        else:
            entry.update(stage="distilled", teacher=s.info["teacher"])
        models.append(entry)
    return models


def eval_recipe(recipe: RunRecipe, stages: list[Stage]):
    """The `ecomla eval` recipe of the run's eval stage."""
    from ecomla.eval.recipe import EvalRecipe

    return _sub_recipe(EvalRecipe, "eval", recipe.eval, {"models": eval_models(recipe, stages),
                                                        "output_dir": str(Path(recipe.output_dir) / "eval")})


def run(recipe: RunRecipe, *, force: bool = False, progress: bool = True) -> Path:
    """Run (or reuse) every stage, then eval and report; returns the eval directory."""
    from ecomla.eval.recipe import load_suite
    from ecomla.eval.runner import check_task_limits, run_eval

    stages = plan(recipe)
    evaluation = eval_recipe(recipe, stages)
    check_task_limits(evaluation, load_suite(evaluation.suite)[0])  # before an hour of stages, not after
    out = Path(recipe.output_dir)
    eval_dir = Path(evaluation.output_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by deepspeed / torchrun: every rank distills, rank 0 alone converts and evaluates
        from ecomla.distill.runtime import barrier, init_distributed

        is_main = init_distributed().is_main
    else:
        is_main, barrier = True, (lambda: None)

    def say(msg: str) -> None:
        if is_main:
            print(msg, flush=True)

    if is_main:
        if force and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, out / "run_recipe.yaml")
    barrier()
    total = len(stages) + 1
    t_run = time.time()
    for i, stage in enumerate(stages, 1):
        what = f"[{i}/{total}] {stage.label}"
        if stage.done():
            say(f"{what}: reused ({stage.dir.name})")
            continue
        say(f"{what}: running -> {stage.dir}")
        t0 = time.time()
        if is_main or stage.kind != "convert":
            _run_stage(stage, progress and is_main)
        seconds = round(time.time() - t0, 1)
        if is_main:
            stage.mark_done(label=stage.label, seconds=seconds, **stage.info)
        barrier()
        say(f"{what}: done in {seconds:.0f} s")
    if not is_main:
        return eval_dir  # the other ranks' part ends with the last distillation
    say(f"[{total}/{total}] eval of {len(evaluation.models)} models -> {eval_dir}")
    t0 = time.time()
    run_eval(evaluation, progress=progress)
    say(f"[{total}/{total}] eval done in {time.time() - t0:.0f} s; whole run {time.time() - t_run:.0f} s")
    return eval_dir


def run_file(path: str, overrides: list[str] | None = None, *, force: bool = False, progress: bool = True) -> Path:
    """`ecomla run RECIPE.yaml`: load the recipe, run every stage, print the report; returns the eval directory."""
    recipe = load_recipe(RunRecipe, path, overrides=list(overrides or []))
    eval_dir = run(recipe, force=force, progress=progress)
    if os.environ.get("RANK", "0") == "0":  # the other ranks stop after the last distillation
        print((eval_dir / "report.md").read_text(), end="")
        print(f"report.md, report.json and chart.png in {eval_dir}")
    return eval_dir
