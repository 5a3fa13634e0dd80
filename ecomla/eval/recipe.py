"""The `ecomla eval` recipe and the task suites it names.

A suite (eval/suites/*.yaml) fixes the tasks, where lm-eval finds them, the
few-shot count and which metric counts for each task: by default acc_norm where
the task reports it, else acc (the report states the choice per task). Tasks
with `average: false` (perplexities) are reported but not averaged.

A recipe lists the models (local paths or hub names), one of which may be the
base: compression ratios are measured against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ecomla.recipe.schema import RecipeError, knob, load_recipe

ROOT = Path(__file__).resolve().parents[2]
SUITES_DIR = ROOT / "eval" / "suites"


@dataclass
class SuiteTask:
    """One task of a suite."""

    task: str = knob(help="lm-eval task (or group) name")
    metric: str | None = knob(
        None, help="Metric that counts (e.g. acc, acc_norm, word_perplexity); null: acc_norm if reported, else acc"
    )
    average: bool = knob(True, help="Include in the average (false for perplexities and other non-accuracies)")
    higher_is_better: bool = knob(True, help="Direction of the metric, for the report")


@dataclass
class Suite:
    """A fixed list of lm-eval tasks with the metric that counts for each."""

    name: str = knob(help="Suite name, used in reports")
    description: str = knob("", help="One line on what the suite measures")
    include_path: str | None = knob(
        None, help="Directory of extra task YAMLs, relative to the suite file; null: lm-eval's built-in tasks only"
    )
    num_fewshot: int = knob(0, help="Few-shot examples per task (the X-EcoMLA suite is zero-shot)")
    tasks: list[SuiteTask] = knob(default_factory=list, help="The tasks, in report order")

    def check(self) -> list[str]:
        problems = [] if self.tasks else ["tasks: a suite needs at least one task"]
        names = [t.task for t in self.tasks]
        problems += [f"tasks: {n!r} is listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
        if not any(t.average for t in self.tasks):
            problems.append("tasks: no task has average: true, so there is nothing to average")
        return problems

    @property
    def averaged(self) -> list[SuiteTask]:
        return [t for t in self.tasks if t.average]


def find_suite(name_or_path: str) -> Path:
    """A suite file by path, or by name under eval/suites/ (e.g. `tinyworld`)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    named = SUITES_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    known = sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))
    raise RecipeError([f"suite: no suite file {name_or_path!r} and no suite of that name; known: {', '.join(known)}"])


def load_suite(name_or_path: str) -> tuple[Suite, Path | None]:
    """The suite and its resolved include_path (absolute; None for built-in tasks only)."""
    path = find_suite(name_or_path)
    suite = load_recipe(Suite, path)
    include = (path.parent / suite.include_path).resolve() if suite.include_path else None
    if include is not None and not include.is_dir():
        raise RecipeError([f"include_path: {include} is not a directory"], str(path))
    return suite, include


@dataclass
class EvalModel:
    """One model to evaluate."""

    name: str = knob(help="Short name used in tables, charts and result file names")
    path: str = knob(help="Local checkpoint directory or hub name (hub names need the hub or its local cache)")
    role: Literal["base", "teacher", "student", "other"] = knob(
        "student", help="base: the reference for compression ratios and the dashed line; teacher; student; other"
    )
    teacher: str | None = knob(None, help="For students: the teacher it was distilled from (one chart line each)")
    init: str | None = knob(None, help="For students: its conversion (an init.preset or a variant name; `ecomla run` "
                            "adds /VARIANT for a distillation variant)")
    stage: str | None = knob(None, help="For students: converted (no training) or distilled; free text")

    def check(self) -> list[str]:
        problems = []
        if not self.name or any(c in self.name for c in "/\\ "):
            problems.append(f"name: {self.name!r} must be non-empty, without spaces or slashes (it names files)")
        return problems


@dataclass
class EvalRecipe:
    """`ecomla eval`: run a suite of lm-eval tasks over a list of models."""

    output_dir: str = knob(help="Results, report.json, report.md and the chart go here")
    suite: str = knob("tinyworld", help="Suite name under eval/suites/ (tinyworld, xecomla) or a suite YAML path")
    models: list[EvalModel] = knob(default_factory=list, help="Models to evaluate, in table order")
    device: str = knob("cpu", help="Torch device for every model (cpu, cuda, cuda:0)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = knob(
        "float32", help="Weights' dtype while evaluating (auto: the checkpoint's own)"
    )
    batch_size: int = knob(32, help="lm-eval batch size")
    share_context: bool = knob(
        False,
        help="Run each multiple-choice item's context once into the KV cache and score its choices on copies "
        "of it, several items a batch (up to batch_size choices; the same log-probabilities as lm-eval's HFLM, "
        "to float rounding). On 2 CPU cores the pytext multiple-choice tasks took 0.65-0.78x plain HFLM's time "
        "(docs/evaluate.md); false (default): plain HFLM, lm-eval's reference path",
    )
    limit: int | None = knob(None, help="At most this many items per task (smoke runs; null: all)")
    task_limits: dict[str, int | None] = knob(
        default_factory=dict,
        help="Per-task item limits that replace `limit` for the tasks named (suite task names; null: all items), "
        "e.g. fewer perplexity passages than multiple-choice items",
    )
    bootstrap_iters: int = knob(1000, help="Bootstrap resamples for stderr of non-mean metrics such as perplexity")
    seed: int = knob(1234, help="lm-eval's random seeds")
    chart_title: str | None = knob(None, help="Chart title; null: derived from the suite")

    def check(self) -> list[str]:
        problems = [] if self.models else ["models: list at least one model"]
        names = [m.name for m in self.models]
        problems += [f"models: name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
        if sum(m.role == "base" for m in self.models) > 1:
            problems.append("models: at most one model may have role: base")
        if self.batch_size < 1:
            problems.append("batch_size: must be >= 1")
        if self.limit is not None and self.limit < 1:
            problems.append("limit: must be >= 1 or null")
        problems += [f"task_limits.{t}: must be >= 1 or null" for t, n in self.task_limits.items()
                     if n is not None and n < 1]
        return problems

    def limit_of(self, task: str) -> int | None:
        """The item limit for one suite task: its task_limits entry, else `limit`."""
        return self.task_limits[task] if task in self.task_limits else self.limit

    @property
    def base(self) -> EvalModel | None:
        return next((m for m in self.models if m.role == "base"), None)
