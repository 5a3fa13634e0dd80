"""`ecomla eval`: lm-eval (HFLM + simple_evaluate) over a list of models, one result file per model.

Everything that can be checked without running a model is checked first:
every task name against lm-eval's TaskManager (with the suite's include_path)
and every model path (a local directory needs config.json and weights; a hub
name must resolve). Only then does any model run.

Results go to <output_dir>/results/<name>.json, written atomically. A result
whose key (model files' fingerprint, suite and its task files, item limits, dtype, lm-eval version)
matches the current recipe is reused, so adding a model to a recipe evaluates
only that model; --force re-evaluates everything. The report (report.json,
report.md, chart.png) is rebuilt from the result files at the end, and by
`ecomla report RUN_DIR` at any time.
"""

from __future__ import annotations

import difflib
import json
import os
import time
from pathlib import Path

from ecomla.errors import UserError
from ecomla.eval.kv import measured_kv_bytes_per_token
from ecomla.mla.budget import compression_vs, kv_elements_per_token
from ecomla.eval.recipe import EvalModel, EvalRecipe, Suite, load_suite
from ecomla.io.fingerprint import digest, path_fingerprint, recorded_key
from ecomla.recipe.schema import recipe_to_dict, save_recipe

WEIGHT_SUFFIXES = (".safetensors", ".bin")


class EvalError(UserError):
    """A model or task that cannot be evaluated, found before any model runs."""


def _weights(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def model_config(model: EvalModel) -> dict:
    """The model's config dict, from a local directory or the hub (its cache when offline)."""
    path = Path(model.path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise EvalError(f"model {model.name!r}: {path} has no config.json (is it a checkpoint directory?)")
        if not _weights(path):
            raise EvalError(f"model {model.name!r}: {path} has no *.safetensors or *.bin weights")
        return json.loads((path / "config.json").read_text())
    if model.path.startswith((".", "/", "~")) or model.path.count("/") != 1:
        raise EvalError(f"model {model.name!r}: {model.path} does not exist (and is not a hub name like org/model)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model.path).to_dict()
    except (OSError, ValueError) as exc:
        raise EvalError(f"model {model.name!r}: cannot load {model.path!r} from the hub or its cache: {exc}") from None


def task_manager(include: Path | None):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(include) if include else None, include_defaults=include is None)


def check_task_limits(recipe: EvalRecipe, suite: Suite) -> None:
    """task_limits may only name the suite's own tasks."""
    listed = [t.task for t in suite.tasks]
    unknown = sorted(set(recipe.task_limits) - set(listed))
    if unknown:
        raise EvalError(f"task_limits: {', '.join(map(repr, unknown))} not in suite {suite.name!r} "
                        f"(its tasks: {', '.join(listed)})")


def check_tasks(suite: Suite, tm) -> None:
    """Every suite task must be a task, group or tag lm-eval knows."""
    known = set(tm.all_tasks)
    missing = [t.task for t in suite.tasks if t.task not in known]
    if missing:
        hints = []
        for name in missing:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise EvalError(f"suite {suite.name!r}: lm-eval does not know task(s) {', '.join(hints)}; "
                        "check the names or the suite's include_path")


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def pick_metric(task_result: dict, metric: str | None) -> str:
    """The metric that counts: the suite's, else acc_norm when the task reports it, else acc."""
    if metric:
        return metric
    return "acc_norm" if "acc_norm,none" in task_result else "acc"


def _stderr(task_result: dict, metric: str) -> float | None:
    value = task_result.get(f"{metric}_stderr,none")
    return float(value) if isinstance(value, (int, float)) else None


def evaluate_model(model: EvalModel, recipe: EvalRecipe, suite: Suite, tm, cfg: dict, base_cfg: dict | None) -> dict:
    """Run the suite on one model through lm-eval's HFLM (loaded by path; with `share_context`, its subclass that
    runs a multiple-choice item's context once) and collect its numbers."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes, which HFLM loads through)
    from ecomla.eval.shared_context import SharedContextLM

    t0 = time.time()
    lm_class = SharedContextLM if recipe.share_context else HFLM
    lm = lm_class(pretrained=model.path, tokenizer=model.path, device=recipe.device, dtype=recipe.dtype,
                  batch_size=recipe.batch_size)
    by_limit: dict[int | None, list[str]] = {}  # lm-eval takes one limit per call: one call per distinct limit
    for t in suite.tasks:
        by_limit.setdefault(recipe.limit_of(t.task), []).append(t.task)
    out = {"results": {}, "versions": {}, "n-samples": {}}
    for limit, names in by_limit.items():
        part = lm_eval.simple_evaluate(
            model=lm, tasks=names, num_fewshot=suite.num_fewshot, task_manager=tm,
            limit=limit, bootstrap_iters=recipe.bootstrap_iters, log_samples=False,
            random_seed=recipe.seed, numpy_random_seed=recipe.seed, torch_random_seed=recipe.seed,
            fewshot_random_seed=recipe.seed,
        )
        for section in out:
            out[section].update(part.get(section, {}))
    tasks = {}
    for spec in suite.tasks:
        res = out["results"][spec.task]
        metric = pick_metric(res, spec.metric)
        if f"{metric},none" not in res:
            reported = sorted(k.split(",")[0] for k in res if "," in k and "_stderr" not in k)
            raise EvalError(f"task {spec.task!r} reports no {metric!r} (it reports {', '.join(reported)})")
        tasks[spec.task] = {
            "metric": metric, "value": float(res[f"{metric},none"]), "stderr": _stderr(res, metric),
            "average": spec.average, "higher_is_better": spec.higher_is_better,
            "all_metrics": {k.split(",")[0]: float(v) for k, v in res.items()
                            if k.endswith(",none") and "_stderr" not in k and isinstance(v, (int, float))},
            "version": out.get("versions", {}).get(spec.task),
            "n": out.get("n-samples", {}).get(spec.task, {}).get("effective"),
        }
    net = lm.model
    elements = kv_elements_per_token(cfg)
    dtype_bytes = next(net.parameters()).element_size()
    measured = measured_kv_bytes_per_token(net)
    averaged = [tasks[t.task]["value"] for t in suite.averaged]
    return {
        "name": model.name, "path": model.path, "role": model.role, "teacher": model.teacher, "init": model.init,
        "stage": model.stage, "model_type": cfg.get("model_type"),
        "params": sum(p.numel() for p in net.parameters()),
        "tasks": tasks,
        "average": sum(averaged) / len(averaged),
        "kv": {
            "elements_per_token": elements,
            "formula_bytes_per_token": elements * dtype_bytes,
            "measured_bytes_per_token": measured,
            "match": abs(measured - elements * dtype_bytes) < 1e-6,
            "dtype_bytes": dtype_bytes,
            "compression": compression_vs(cfg, base_cfg) if base_cfg else None,
        },
        "lm_eval_version": lm_eval.__version__,
        "seconds": round(time.time() - t0, 1),
    }


def result_key(model: EvalModel, recipe: EvalRecipe, suite: Suite, include: Path | None, base_cfg: dict | None) -> str:
    import lm_eval

    limits = [recipe.limit_of(t.task) for t in suite.tasks]
    parts = [path_fingerprint(model.path), recipe_to_dict(model), recipe_to_dict(suite), limits, recipe.dtype,
             recipe.device.split(":")[0], recipe.batch_size, recipe.bootstrap_iters, recipe.seed, base_cfg, include and path_fingerprint(include),
             lm_eval.__version__] + (["shared-context"] if recipe.share_context else [])
    return digest(*parts, length=16)


def run_eval(recipe: EvalRecipe, *, force: bool = False, progress: bool = True) -> Path:
    """Evaluate every model of the recipe (reusing matching results) and write the report; returns output_dir."""
    from ecomla.eval.report import write_report

    suite, include = load_suite(recipe.suite)
    check_task_limits(recipe, suite)
    tm = task_manager(include)
    check_tasks(suite, tm)
    problems, cfgs = [], {}
    for m in recipe.models:
        try:
            cfgs[m.name] = model_config(m)
            kv_elements_per_token(cfgs[m.name])
        except EvalError as exc:
            problems.append(str(exc))
        except (KeyError, TypeError) as exc:
            problems.append(f"model {m.name!r}: its config lacks attention shape key {exc} (not a decoder LM?)")
    if problems:
        raise EvalError("nothing was evaluated:\n  - " + "\n  - ".join(problems))
    base_cfg = cfgs[recipe.base.name] if recipe.base else None

    out = Path(recipe.output_dir)
    (out / "results").mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, out / "eval_recipe.yaml")
    from tqdm.auto import tqdm

    bar = tqdm(recipe.models, desc="eval", unit="model", disable=not progress)
    for m in bar:
        bar.set_postfix_str(m.name)
        path = out / "results" / f"{m.name}.json"
        key = result_key(m, recipe, suite, include, base_cfg)
        if not force and recorded_key(path) == key:  # a missing or damaged result file is recomputed
            continue
        result = evaluate_model(m, recipe, suite, tm, cfgs[m.name], base_cfg)
        result["key"] = key
        _write_json(path, result)
    write_report(out)
    return out
