"""The `ecomla run` recipe: convert → distill → eval → report, in one file.

The `convert`, `distill` and `eval` sections are ordinary `ecomla convert`,
`ecomla distill` and `ecomla eval` recipes with the keys that `ecomla run`
fills in per stage left out (model paths, output directories, the compression
ratio and the init method). They are validated against those schemas before
anything runs, so `ecomla run --help` plus `ecomla convert|distill|eval --help`
document every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ecomla.recipe.schema import knob

def merged(base: dict, over: dict) -> dict:
    """A copy of `base` with `over` merged in, key by key at every depth (a non-dict value replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# Keys of the sub-recipes that `ecomla run` sets for each stage; a recipe that sets them is refused.
FILLED = {
    "convert": ("model", "output_dir", "mla.kv_lora_rank", "mla.target_compression", "init.method"),
    "distill": ("student", "teacher.model", "teacher.cache_dir", "output_dir"),
    "eval": ("models", "output_dir"),
}


@dataclass
class RunRecipe:
    """`ecomla run`: the X-EcoMLA pipeline over compression ratios, init methods and teachers."""

    output_dir: str = knob(help="Run directory: stages/ (cached by hash), eval/ (results, report.md, chart.png)")
    base: str = knob(help="The model to convert (local directory or hub name); also the base line of the report")
    teachers: dict[str, str] = knob(
        help="Teacher name -> checkpoint. A teacher may be the base itself (X-EcoMLA's 1B teacher is its own base)"
    )
    ratios: list[float] = knob(help="KV compression ratios to convert to (each r_kv is rounded to the nearest integer)")
    distill_teachers: list[str] = knob(help="Teachers the main init's students are distilled from, at every ratio")
    distill: dict[str, Any] = knob(
        help="An `ecomla distill` recipe without student, teacher.model, teacher.cache_dir, output_dir "
        "(teacher.source: cache adds a teacher-cache stage per teacher)"
    )
    inits: list[str] = knob(
        default_factory=lambda: ["svd", "random"],
        help="Latent init methods (svd, activation, random); the first is the main one, the others are baselines",
    )
    baseline_teacher: str | None = knob(
        None, help="Teacher the other inits' students are distilled from, on the same budget (null: the last "
        "of distill_teachers)"
    )
    convert: dict[str, Any] = knob(default_factory=dict, help="An `ecomla convert` recipe without its filled keys")
    convert_by_ratio: dict[float, dict[str, Any]] = knob(
        default_factory=dict,
        help="Ratio -> `convert` keys merged over `convert` for that ratio only, e.g. {4.0: {mla: "
        "{qk_rope_head_dim: 32, rope_dims: norm}}}: the best d_r and RoPE dims differ between ratios",
    )
    eval: dict[str, Any] = knob(default_factory=dict, help="An `ecomla eval` recipe without models and output_dir")

    def check(self) -> list[str]:
        problems = []
        if not self.teachers:
            problems.append("teachers: name at least one teacher")
        if not self.ratios or any(r <= 1 for r in self.ratios):
            problems.append(f"ratios: need one or more compression ratios above 1, got {self.ratios}")
        if len(set(self.ratios)) != len(self.ratios):
            problems.append("ratios: a ratio is listed twice")
        known_inits = ("svd", "activation", "random")
        problems += [f"inits: {i!r} is not one of {', '.join(known_inits)}" for i in self.inits if i not in known_inits]
        if not self.inits or len(set(self.inits)) != len(self.inits):
            problems.append("inits: list each init method once, at least one")
        for t in [*self.distill_teachers, *([self.baseline_teacher] if self.baseline_teacher else [])]:
            if t not in self.teachers:
                problems.append(f"distill_teachers: {t!r} is not a key of teachers ({', '.join(self.teachers)})")
        if not self.distill_teachers:
            problems.append("distill_teachers: name at least one teacher")
        sections = [(section, getattr(self, section)) for section in FILLED]
        sections += [(f"convert_by_ratio.{r}", body) for r, body in self.convert_by_ratio.items()]
        for section, body in sections:
            for key in FILLED[section.partition("_")[0]]:
                head, _, rest = key.partition(".")
                if head in body and (not rest or (isinstance(body[head], dict) and rest in body[head])):
                    problems.append(f"{section}.{key}: set by `ecomla run` for each stage; remove it")
        for r in self.convert_by_ratio:
            if r not in self.ratios:
                problems.append(f"convert_by_ratio: {r} is not one of ratios {self.ratios}")
        return problems

    def convert_for(self, ratio: float) -> dict[str, Any]:
        """The `convert` section of one ratio: `convert` with that ratio's `convert_by_ratio` keys merged in."""
        return merged(self.convert, self.convert_by_ratio.get(ratio, {}))

    @property
    def main_init(self) -> str:
        return self.inits[0]

    @property
    def baseline(self) -> str:
        return self.baseline_teacher or self.distill_teachers[-1]

    def teachers_for(self, init: str) -> list[str]:
        """The teachers the students of `init` are distilled from: all of distill_teachers for the main init,
        baseline_teacher alone for the others (the same budget)."""
        return self.distill_teachers if init == self.main_init else [self.baseline]

    @property
    def used_teachers(self) -> list[str]:
        """The teachers some student is distilled from, in the order of `teachers`."""
        used = {t for init in self.inits for t in self.teachers_for(init)}
        return [t for t in self.teachers if t in used]
