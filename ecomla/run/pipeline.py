"""`ecomla run`: convert → distill → measure → eval → report, with every stage cached by a hash of what it computes.

Stages, in order:
  convert         one per (compression point, conversion): the base converted to MLA, no training; a point is a
                  ratio or an r_kv + d_r budget, a conversion an init.preset or a named variant of `convert`;
  teacher-cache   with `distill.teacher.source: cache` only, one per teacher
                  used: its top-k log-probs over the distillation data, so
                  each teacher runs once rather than once per student;
  distill         one per point, teacher in distill_teachers and distillation variant for the main conversion,
                  and one per point and variant from baseline_teacher for every other conversion; a variant of
                  several parts runs one stage per part, each from the previous part's final/ (with
                  `measure.every_tokens`, the student is measured along the way);
  measure         with `measure` only, one per converted and distilled model: the held-out yardstick against
                  the base (ecomla.analyze.yardstick), then measure/report.md and its charts;
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
stage.json also keeps the hashed recipe and inputs, so that a later ecomla,
whose new knobs change every key that hashes them, takes over a finished stage
whose inputs are the same and whose recipe differs only by knobs added since,
each at its default (`ecomla.run.adopt`).

Under a launcher (`deepspeed --module ecomla.run`, `torchrun -m ecomla.run`)
every rank takes part in the teacher caches and distillations; rank 0 alone
converts (the others wait), measures and evaluates (the others exit after the last
distillation).
The run directory must be on a file system all ranks share.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ecomla.io.fingerprint import CachedStage, digest, path_fingerprint
from ecomla.recipe.schema import RecipeError, load_recipe, merged, recipe_to_dict, save_recipe
from ecomla.run.adopt import STAGE_VERSIONS, adopt as adopt_earlier
from ecomla.run.recipe import RunRecipe


@dataclass
class Stage(CachedStage):
    kind: str  # convert | teacher-cache | distill | measure
    label: str
    recipe: Any  # ConvertRecipe | DistillRecipe | Measure
    key: str
    dir: Path
    info: dict = field(default_factory=dict)  # point, ratio, preset, teacher, variant, part, tokens, ...
    of: Stage | None = None  # measure: the stage whose model it measures
    digested: dict = field(default_factory=dict)  # the resolved recipe the key hashes (output paths left out)
    inputs: list = field(default_factory=list)  # the key's other parts: fingerprints, the upstream stage's key
    adopted: bool = False  # a finished stage an earlier ecomla keyed otherwise (`ecomla.run.adopt`)

    def keep_record(self) -> None:
        """A finished stage whose stage.json predates `record`: add it, so the next ecomla can adopt the stage.
        Best effort: a stage directory this user cannot write (another's, a read-only mount) is still reused."""
        try:
            done = json.loads(self.done_file.read_text())
            if "recipe" not in done:
                tmp = self.done_file.with_name(".stage.json.tmp")
                tmp.write_text(json.dumps({**done, **self.record}, indent=2) + "\n")
                os.replace(tmp, self.done_file)
        except OSError:
            pass

    @property
    def record(self) -> dict:
        """What stage.json keeps besides the key, so that a later ecomla can adopt the stage (`ecomla.run.adopt`)."""
        return json.loads(json.dumps({"recipe": self.digested, "inputs": self.inputs}, default=str))

    @property
    def model_dir(self) -> Path:
        if self.kind == "measure":
            return self.of.model_dir
        return self.dir / {"convert": "model", "teacher-cache": "cache", "distill": "run/final"}[self.kind]

    @property
    def name(self) -> str:
        """The name of the stage's model in the reports: a conversion's label (convert-4x-best), a distillation's
        without its kind and the part of a variant's last part (4x-best-source, 4x-best-source-ild-then-kd)."""
        if self.kind != "distill":
            return self.label
        parts = self.info["parts"]
        name = self.label.removeprefix("distill-")
        return name.removesuffix(f"-part{parts}of{parts}") if parts > 1 else name

    @property
    def points_file(self) -> Path:
        """distill: the measurements along the way; measure: its one measurement."""
        return self.dir / ("points.json" if self.kind == "distill" else "result.json")


def _keyed(kind: str, label: str, sub: Any, digested: dict, inputs: list, out: Path, info: dict,
           of: Stage | None = None, adopt: bool = True) -> Stage:
    """A stage keyed by digest(kind, digested, *inputs) in out/<label>-<key>, or, when that is not finished, an
    earlier ecomla's finished stage that computed the same (`ecomla.run.adopt`)."""
    if STAGE_VERSIONS[kind] > 1:
        inputs = [*inputs, f"{kind} v{STAGE_VERSIONS[kind]}"]
    key = digest(kind, digested, *inputs)
    stage = Stage(kind, label, sub, key, out / f"{label}-{key}", info, of, digested, list(inputs))
    if adopt and not stage.done():
        adopt_earlier(stage)
    return stage


def _sub_recipe(cls: type, section: str, body: dict, fills: dict[str, Any]):
    """The stage's recipe: the run recipe's section with the stage's own keys (`FILLED`) merged in."""
    data = merged(body, fills)  # a new dict along the filled paths; load_recipe copies the rest
    try:
        return load_recipe(cls, data=data)
    except RecipeError as err:
        raise RecipeError([f"{section}.{p}" for p in err.problems], err.source) from None


def _data_fingerprints(distill, seen: dict[str, str]) -> list[str]:
    """The fingerprints of a distillation's data files; `seen` keeps each file's, so it is read once per run
    (a variant may train on other data than the rest)."""
    out = []
    for src in (distill.data.train, distill.data.eval):
        if src is not None:
            for part in (src, *src.mix):
                path = part.prepared or part.dataset
                if path not in seen:
                    seen[path] = path_fingerprint(path)
                out.append(seen[path])
    return out


def _local_text_fingerprints(paths: list[str | None]) -> list[str]:
    """The fingerprints of the local text files among `paths` (a calibration set, the measure's other text): what
    a stage read from them joins its key, so a file edited in place reruns the stage. A named corpus (pytext:,
    tinyworld:, a hub name) stands for itself in the recipe and adds nothing, which keeps those stages' keys."""
    return [path_fingerprint(p) for p in paths if p is not None and Path(p).exists()]


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


def _convert_section(recipe: RunRecipe, ratio: float | None) -> str:
    """Where a conversion's keys come from, for error messages: `convert`, or `convert (at RATIOx)`."""
    return "convert" if ratio not in recipe.convert_by_ratio else f"convert (at {ratio}x)"


def part_tokens(shares: list[float], total: int, batch: int) -> list[int]:
    """Each part's tokens in whole optimizer steps, summing to `total` (the last part takes the rest)."""
    steps = total // batch
    counts = [max(1, round(share * steps)) for share in shares[:-1]]
    if sum(counts) >= steps:
        raise RecipeError([f"distill_variants: shares {shares} leave the last part no step of the {steps}"])
    return [c * batch for c in counts] + [(steps - sum(counts)) * batch]


def _convert_stages(recipe: RunRecipe, out: Path, base_fp: str, adopt: bool) -> list[Stage]:
    from ecomla.convert.recipe import ConvertRecipe

    stages = []
    for point, fills_mla, ratio in recipe.points:
        for preset in recipe.presets:
            label = f"convert-{point}-{preset}"
            section = _convert_section(recipe, ratio)
            if preset in recipe.variants:
                section = f"{section} with variants.{preset}"
            fills = {"model": recipe.base, "output_dir": "", "mla": fills_mla}
            sub = _sub_recipe(ConvertRecipe, section, recipe.convert_for(ratio, preset), fills)
            calibration = sub.init.calibration
            texts = [calibration.dataset, calibration.heldout and calibration.heldout.dataset] if calibration else []
            stage = _keyed("convert", label, sub, recipe_to_dict(sub), [base_fp, *_local_text_fingerprints(texts)],
                           out, {"point": point, "ratio": ratio, "preset": preset}, adopt=adopt)
            sub.output_dir = str(stage.model_dir)
            stages.append(stage)
    return stages


def plan(recipe: RunRecipe, *, adopt: bool = True) -> list[Stage]:
    """Every convert, teacher-cache, distill and measure stage, resolved and keyed; recipe problems raise before
    anything runs. adopt: take over an earlier ecomla's finished stages that computed the same (`ecomla.run.adopt`)."""
    from ecomla.convert.layout import LINEAR_LATENT_LORA
    from ecomla.distill.recipe import DistillRecipe

    out = Path(recipe.output_dir) / "stages"
    base_fp = path_fingerprint(recipe.base)
    stages = _convert_stages(recipe, out, base_fp, adopt)
    converted = {(s.info["point"], s.info["preset"]): s for s in stages}
    # Each teacher's files and the training data are fingerprinted once, not once per stage that uses them.
    teacher_fp = {t: path_fingerprint(recipe.teachers[t]) for t in recipe.used_teachers}
    data_fps: dict[str, str] = {}
    caches: dict[str, Stage] = {}
    along = recipe.measure is not None and recipe.measure.every_tokens > 0
    other = _local_text_fingerprints([recipe.measure.other_text]) if recipe.measure is not None else []
    if recipe.distill is not None and _teacher_source(recipe.distill) == "cache":
        for teacher in recipe.used_teachers:
            label = f"teacher-cache-{teacher}"
            fills = {"student": recipe.base, "teacher": {"model": recipe.teachers[teacher], "cache_dir": "x"},
                     "output_dir": ""}
            sub = _sub_recipe(DistillRecipe, "distill", recipe.distill, fills)
            stage = _keyed("teacher-cache", label, sub, _cache_inputs(sub),
                           [base_fp, teacher_fp[teacher], _data_fingerprints(sub, data_fps)], out,
                           {"teacher": teacher}, adopt=adopt)
            sub.teacher.cache_dir, sub.output_dir = str(stage.model_dir), str(stage.dir)
            stages.append(stage)
            caches[teacher] = stage
    finals: list[Stage] = []
    for point, _, ratio in recipe.points:
        for preset in recipe.presets:
            for teacher in recipe.teachers_for(preset):
                for variant, parts in recipe.variant_parts.items():
                    src = conversion = converted[point, preset]
                    cache = caches.get(teacher)
                    teacher_keys = {"model": recipe.teachers[teacher]}
                    if cache is not None:
                        teacher_keys["cache_dir"] = str(cache.model_dir)
                    # a one-part variant's keys may set its own total_tokens (and batch); parts share distill's
                    body = merged(recipe.distill, parts[0].keys) if len(parts) == 1 else recipe.distill
                    whole = _sub_recipe(DistillRecipe, "distill", body,
                                        {"student": "x", "teacher": teacher_keys, "output_dir": ""})
                    tokens = part_tokens([p.share for p in parts], whole.train.total_tokens,
                                         whole.train.global_batch_tokens)
                    done = 0
                    for i, (part, n) in enumerate(zip(parts, tokens)):
                        label = f"distill-{point}-{preset}-{teacher}" + (f"-{variant}" if variant else "")
                        if len(parts) > 1:
                            label += f"-part{i + 1}of{len(parts)}"
                        section = f"distill_variants.{variant}[{i}].keys" if variant else "distill"
                        fills = {"student": str(src.model_dir), "teacher": teacher_keys, "output_dir": ""}
                        if len(parts) > 1:
                            fills["train"] = {"total_tokens": n}
                        sub = _sub_recipe(DistillRecipe, section, merged(recipe.distill, part.keys), fills)
                        # every part trains the conversion's latent, so every part is checked against it
                        if conversion.recipe.mla.latent_norm == "linear" and sub.train.mode == "lora":
                            raise RecipeError([f"{_convert_section(recipe, ratio)}.mla.latent_norm: "
                                               f"{conversion.label} is distilled with LoRA, but " + LINEAR_LATENT_LORA])
                        batch = sub.train.global_batch_tokens  # the part's own, which its keys may change
                        if along and recipe.measure.every_tokens % batch:
                            raise RecipeError([f"measure.every_tokens: {recipe.measure.every_tokens} is not a whole "
                                               f"number of {section}.train.global_batch_tokens ({batch})"])
                        as_dict = recipe_to_dict(sub)
                        as_dict.pop("student")
                        as_dict["teacher"].pop("cache_dir")  # a path under output_dir; the cache's key stands for it
                        # measured along the way: the points are an output, so their settings and offset are inputs
                        extra = [recipe_to_dict(recipe.measure), done, *other] if along else []
                        inputs = [src.key, teacher_fp[teacher], _data_fingerprints(sub, data_fps),
                                  cache.key if cache is not None else None, *extra]
                        stage = _keyed("distill", label, sub, as_dict, inputs, out,
                                       {"point": point, "ratio": ratio, "preset": preset, "teacher": teacher,
                                        "variant": variant, "part": i, "parts": len(parts), "offset": done,
                                        "tokens": n, "last": i == len(parts) - 1, "after": src.label,
                                        "every": recipe.measure.every_tokens if along else 0}, adopt=adopt)
                        sub.output_dir = str(stage.dir / "run")
                        stages.append(stage)
                        src, done = stage, done + n
                    finals.append(src)
    if recipe.measure is not None:
        settings = recipe_to_dict(recipe.measure)
        for of in [s for s in stages if s.kind == "convert"] + finals:
            label = f"measure-{of.name}"
            stages.append(_keyed("measure", label, recipe.measure, settings, [of.key, base_fp, *other], out,
                                 dict(of.info), of, adopt))
    return stages


def _distill(stage: Stage, progress: bool, stick) -> None:
    """One distillation stage; with a yardstick, the student is measured every `measure.every_tokens` (the stage's
    info["every"]) and at the end."""
    from ecomla.distill.trainer import DistillRun
    from ecomla.run import measure

    if stick is None:
        from ecomla.distill.trainer import run as distill

        distill(stage.recipe, force=False, progress=progress)  # resumes from run/checkpoints/latest if interrupted
        return
    batch, offset, every = stage.recipe.train.global_batch_tokens, stage.info["offset"], stage.info["every"]
    total = stage.recipe.train.total_tokens // batch
    kept = json.loads(stage.points_file.read_text()) if stage.points_file.is_file() else []
    t0, measuring = time.time(), [0.0]

    def on_step(steps: int, model) -> None:
        seen = offset + steps * batch
        if seen % every == 0 or (stage.info["last"] and steps == total):
            t = time.time()
            kept[:] = [p for p in kept if p["tokens"] < seen]  # a resumed run measures its steps again
            kept.append(measure.point(seen, t - t0 - measuring[0], stick.measure_model(model)))
            measuring[0] += time.time() - t
            stage.points_file.write_text(json.dumps(kept, indent=1) + "\n")

    job = DistillRun(stage.recipe, force=False, progress=progress, on_step=on_step)
    job.setup()
    job.train()


def _run_stage(stage: Stage, progress: bool, stick) -> None:
    stage.dir.mkdir(parents=True, exist_ok=True)
    if stage.kind == "convert":
        from ecomla.convert.stream import convert_recipe

        # The conversion writes atomically: a half-done one leaves nothing, so start over.
        convert_recipe(stage.recipe, force=True, progress=progress)
    elif stage.kind == "teacher-cache":
        from ecomla.distill.jobs import teacher_cache

        # Written to a temporary directory and renamed when whole, so an interrupted cache starts over.
        teacher_cache(stage.recipe, force=True, progress=progress)
    elif stage.kind == "distill":
        _distill(stage, progress, stick)
    else:
        from ecomla.io.publish import publish

        tmp = stage.points_file.with_name(".result.json.tmp")
        tmp.write_text(json.dumps(stick.measure(stage.model_dir), indent=1) + "\n")
        publish(tmp, stage.points_file)


def eval_models(recipe: RunRecipe, stages: list[Stage]) -> list[dict]:
    """The eval recipe's model list: base, teachers (the base's own path once), converted and distilled students."""
    models = [{"name": "base", "path": recipe.base, "role": "base"}]
    for name, path in recipe.teachers.items():
        if path != recipe.base:
            models.append({"name": name, "path": path, "role": "teacher"})
    for s in stages:
        if s.kind == "convert":
            models.append({"name": s.name, "path": str(s.model_dir), "role": "student",
                           "init": s.info["preset"], "stage": "converted"})
        elif s.kind == "distill" and s.info["last"]:
            conversion = s.info["preset"] + (f"/{s.info['variant']}" if s.info["variant"] else "")
            models.append({"name": s.name, "path": str(s.model_dir), "role": "student", "init": conversion,
                           "stage": "distilled", "teacher": s.info["teacher"]})
    return models


def eval_recipe(recipe: RunRecipe, stages: list[Stage]):
    """The `ecomla eval` recipe of the run's eval stage; None when the run has no eval."""
    from ecomla.eval.recipe import EvalRecipe

    if recipe.eval is None:
        return None
    return _sub_recipe(EvalRecipe, "eval", recipe.eval, {"models": eval_models(recipe, stages),
                                                        "output_dir": str(Path(recipe.output_dir) / "eval")})


def run(recipe: RunRecipe, *, force: bool = False, progress: bool = True) -> Path:
    """Run (or reuse) every stage, then the measure report and eval; returns the run directory."""
    stages = plan(recipe, adopt=not force)  # --force deletes the run directory below: nothing in it to adopt
    evaluation = eval_recipe(recipe, stages)
    if evaluation is not None:
        from ecomla.eval.recipe import load_suite
        from ecomla.eval.runner import check_task_limits

        check_task_limits(evaluation, load_suite(evaluation.suite)[0])  # before an hour of stages, not after
    out = Path(recipe.output_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and recipe.measure is not None and recipe.measure.every_tokens:
        raise RecipeError(["measure.every_tokens: measuring along the way runs in one process; launch the run "
                           "without deepspeed/torchrun, or set it to 0 (before and after only)"])
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
    total = len(stages) + (evaluation is not None)
    t_run = time.time()
    stick = None  # the yardstick: the base's log-probs on the held-out text, computed once, when first needed
    along = recipe.measure is not None and recipe.measure.every_tokens > 0
    for i, stage in enumerate(stages, 1):
        what = f"[{i}/{total}] {stage.label}"
        if stage.done():
            if stage.adopted:
                say(f"{what}: reused ({stage.dir.name}: keyed by an earlier ecomla; the same recipe, every key "
                    f"added since at its default)")
            else:
                say(f"{what}: reused ({stage.dir.name})")
            if is_main:
                stage.keep_record()
            continue
        say(f"{what}: running -> {stage.dir}")
        if stick is None and is_main and (stage.kind == "measure" or along and stage.kind == "distill"):
            from ecomla.run.measure import yardstick

            stick = yardstick(recipe.base, recipe.measure)
        t0 = time.time()
        if is_main or stage.kind in ("distill", "teacher-cache"):
            _run_stage(stage, progress and is_main, stick if stage.kind == "measure" or along else None)
        seconds = round(time.time() - t0, 1)
        if is_main:
            stage.mark_done(label=stage.label, seconds=seconds, **{k: v for k, v in stage.info.items()
                                                                   if k in ("point", "ratio", "preset", "teacher",
                                                                            "variant", "part", "after")},
                            **stage.record)
        barrier()
        say(f"{what}: done in {seconds:.0f} s")
    if not is_main:
        return out  # the other ranks' part ends with the last distillation
    if recipe.measure is not None:
        from ecomla.run.measure import write_report

        say(f"measure report -> {write_report(recipe, stages)}")
    if evaluation is not None:
        from ecomla.eval.runner import run_eval

        say(f"[{total}/{total}] eval of {len(evaluation.models)} models -> {evaluation.output_dir}")
        t0 = time.time()
        run_eval(evaluation, progress=progress)
        say(f"[{total}/{total}] eval done in {time.time() - t0:.0f} s")
    say(f"whole run {time.time() - t_run:.0f} s")
    return out


def run_file(path: str, overrides: list[str] | None = None, *, force: bool = False, progress: bool = True) -> Path:
    """`ecomla run RECIPE.yaml`: load the recipe, run every stage, print the reports; returns the run directory."""
    recipe = load_recipe(RunRecipe, path, overrides=list(overrides or []))
    out = run(recipe, force=force, progress=progress)
    if os.environ.get("RANK", "0") == "0":  # the other ranks stop after the last distillation
        for name in ("measure", "eval"):
            report = out / name / "report.md"
            if (recipe.measure is not None if name == "measure" else recipe.eval is not None) and report.is_file():
                print(report.read_text(), end="")
                print(f"{name}: report.md, report.json and charts in {report.parent}")
    return out
