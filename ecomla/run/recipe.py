"""The `ecomla run` recipe: the one experiment harness, in one file.

A run converts the base over a grid of conversions (presets or named variants) x compression points (ratios or
r_kv + d_r budgets), optionally distils the students (one or more distillation variants, each of one or more
parts), measures every model on held-out text (the yardstick: perplexity, KL and top-1 agreement against the
base, along the distillation too) and evaluates them with lm-eval, then writes the reports.

The `convert`, `distill` and `eval` sections are ordinary `ecomla convert`, `ecomla distill` and `ecomla eval`
recipes with the keys that `ecomla run` fills in per stage left out (model paths, output directories, the
compression point and the preset). They are validated against those schemas before anything runs, so
`ecomla run --help` plus `ecomla convert|distill|eval --help` document every key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ecomla.recipe.schema import knob, merged


def has_key(body: dict, dotted: str) -> bool:
    """Whether the nested mapping `body` sets the key 'a.b.c'."""
    for part in dotted.split("."):
        if not isinstance(body, dict) or part not in body:
            return False
        body = body[part]
    return True


# Keys of the sub-recipes that `ecomla run` sets for each stage; a recipe that sets them is refused.
FILLED = {
    "convert": ("model", "output_dir", "mla.kv_lora_rank", "mla.target_compression", "init.preset"),
    "distill": ("student", "teacher.model", "teacher.cache_dir", "output_dir"),
    "eval": ("models", "output_dir"),
}
# ... and, with `budgets`, the RoPE width each budget names.
FILLED_BY_BUDGET = ("mla.qk_rope_head_dim",)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass
class DistillPart:
    """One part of a distillation variant: its share of the tokens, and its keys over `distill`."""

    share: float = knob(1.0, help="Share of distill.train.total_tokens this part trains on (whole optimizer "
                        "steps; the last part takes the rest). The shares of a variant sum to 1")
    keys: dict[str, Any] = knob(default_factory=dict, help="`ecomla distill` keys merged over `distill` for this "
                                "part, e.g. {loss: {kd_weight: 0.0, ild_weight: 1.0}} for an ILD-only first part. "
                                "A one-part variant may set train.total_tokens: its own budget, with its own schedule")


@dataclass
class Measure:
    """The held-out yardstick: every model against the base, per token, on held-out text of both pytext domains."""

    eval_tokens: int = knob(4096, help="Held-out tokens per domain (whole blocks of seq_len)")
    seq_len: int = knob(512, help="Block length of the held-out text")
    every_tokens: int = knob(0, help="Also measure each student every this many distillation tokens (a whole number "
                             "of global batches; 0: before and after only). One process only")
    other_text: str | None = knob(None, help="Also measure every model on this text (a file or directory of .txt): "
                                  "text of a kind nothing else in the run touches")

    def check(self) -> list[str]:
        problems = []
        if self.seq_len < 2 or self.eval_tokens < self.seq_len:
            problems.append(f"eval_tokens: {self.eval_tokens} holds no block of seq_len {self.seq_len}")
        if self.every_tokens < 0:
            problems.append(f"every_tokens: {self.every_tokens} is negative; 0 measures before and after only")
        return problems


@dataclass
class RunRecipe:
    """`ecomla run`: conversions x compression points, distillations, measurements and lm-eval, then the report."""

    output_dir: str = knob(help="Run directory: stages/ (cached by hash), measure/ (the yardstick's report), "
                           "eval/ (lm-eval results, report.md, chart.png)")
    base: str = knob(help="The model to convert (local directory or hub name); also the base line of the reports "
                     "and the source the yardstick measures against")
    teachers: dict[str, str] = knob(
        default_factory=dict,
        help="Teacher name -> checkpoint. A teacher may be the base itself (X-EcoMLA's 1B teacher is its own base)"
    )
    ratios: list[float] = knob(
        default_factory=list,
        help="KV compression ratios to convert to (each r_kv is rounded to the nearest integer); or give budgets")
    budgets: list[str] = knob(
        default_factory=list,
        help="Instead of ratios: R_KV+D_R budgets (kv_lora_rank + qk_rope_head_dim), e.g. [128+64, 64+32]")
    presets: list[str] = knob(
        default_factory=lambda: ["auto"],
        help="Conversions, each converted at every ratio or budget: init.preset names (`ecomla convert --help` "
        "lists them; auto: best with calibration text, nodata without) or names of `variants`. The first is the "
        "main one; the others are baselines")
    variants: dict[str, dict[str, Any]] = knob(
        default_factory=dict,
        help="Name -> `convert` keys merged over `convert` for that conversion, e.g. {best-no-linear: {init: "
        "{preset: best}, mla: {latent_norm: normalize}}} or {svd-high: {init: {method: svd}, mla: {rope_dims: "
        "high}}}. A variant may set init.preset; one that sets no preset key gets auto")
    inits: list[str] | None = knob(None, help="Replaced by presets (init.method alone no longer names a "
                                   "conversion): inits: [svd] is presets: [xecomla]")
    distill_teachers: list[str] = knob(
        default_factory=list,
        help="Teachers the main conversion's students are distilled from, at every ratio (empty: no distillation)")
    baseline_teacher: str | None = knob(
        None, help="Teacher the other conversions' students are distilled from, on the same budget (null: the last "
        "of distill_teachers)"
    )
    convert: dict[str, Any] = knob(default_factory=dict, help="An `ecomla convert` recipe without its filled keys")
    convert_by_ratio: dict[float, dict[str, Any]] = knob(
        default_factory=dict,
        help="Ratio -> `convert` keys merged over `convert` for that ratio only, e.g. {4.0: {mla: "
        "{qk_rope_head_dim: 32, rope_dims: norm}}}: the best d_r and RoPE dims differ between ratios",
    )
    distill: dict[str, Any] | None = knob(
        None,
        help="An `ecomla distill` recipe without student, teacher.model, teacher.cache_dir, output_dir "
        "(teacher.source: cache adds a teacher-cache stage per teacher). Null: no distillation"
    )
    distill_variants: dict[str, list[DistillPart]] = knob(
        default_factory=dict,
        help="Name -> parts: each student is distilled once per variant, each part from the previous part's "
        "final/, e.g. {kd: [{}], ild-then-kd: [{share: 0.25, keys: {loss: {kd_weight: 0.0, ild_weight: 1.0}}}, "
        "{share: 0.75}]}. The first is the baseline of the measure report. Empty: `distill` as it is"
    )
    measure: Measure | None = knob(
        None, help="The held-out yardstick for every model (measure/report.md, conversions.png, curves.png). "
        "Null: not measured")
    eval: dict[str, Any] | None = knob(
        default_factory=dict, help="An `ecomla eval` recipe without models and output_dir. Null: no lm-eval")

    def check(self) -> list[str]:
        problems = []
        if self.inits is not None:
            problems.append("inits: replaced by presets, which name whole conversions (init.preset names or "
                            "`variants`): inits: [svd] is presets: [xecomla], [activation] is [care] or [best]")
        if bool(self.ratios) == bool(self.budgets):
            problems.append("ratios: give ratios or budgets (one of them), e.g. ratios: [2.0, 4.0] or budgets: "
                            "[128+64, 64+32]")
        if any(r <= 1 for r in self.ratios):
            problems.append(f"ratios: need compression ratios above 1, got {self.ratios}")
        for name, points in (("ratios", self.ratios), ("budgets", self.budgets), ("presets", self.presets)):
            if len(set(points)) != len(points):
                problems.append(f"{name}: an entry is listed twice")
        problems += self._budget_problems()
        problems += self._preset_problems()
        if self.distill is None and (self.distill_teachers or self.distill_variants):
            problems.append("distill: distill_teachers and distill_variants need a distill section")
        if self.distill is not None and not self.distill_teachers:
            problems.append("distill_teachers: name at least one teacher (or remove distill)")
        for t in [*self.distill_teachers, *([self.baseline_teacher] if self.baseline_teacher else [])]:
            if t not in self.teachers:
                problems.append(f"distill_teachers: {t!r} is not a key of teachers ({', '.join(self.teachers)})")
        problems += self._variant_problems()
        sections = [(s, getattr(self, s)) for s in FILLED if getattr(self, s) is not None]
        sections += [(f"convert_by_ratio.{r}", body) for r, body in self.convert_by_ratio.items()]
        for section, body in sections:
            filled = FILLED[section.partition("_")[0]]
            if section == "convert" and self.budgets:
                filled += FILLED_BY_BUDGET
            problems += [f"{section}.{key}: set by `ecomla run` for each stage; remove it"
                         for key in filled if has_key(body, key)]
        for r in self.convert_by_ratio:
            if r not in self.ratios:
                problems.append(f"convert_by_ratio: {r} is not one of ratios {self.ratios}")
        return problems

    def _budget_problems(self) -> list[str]:
        from ecomla.mla.budget import parse_budget

        problems = []
        for b in self.budgets:
            try:
                r_kv, d_r = parse_budget(b)
            except ValueError as err:
                problems.append(f"budgets: {err}")
                continue
            if r_kv < 1 or d_r < 0 or d_r % 2:
                problems.append(f"budgets: {b!r} needs r_kv >= 1 and an even d_r >= 0")
        return problems

    def _preset_problems(self) -> list[str]:
        from ecomla.convert.presets import PRESET_NAMES

        known = (*PRESET_NAMES, "auto")
        problems = [f"presets: {p!r} is neither a preset ({', '.join(known)}) nor a key of variants"
                    for p in self.presets if p not in known and p not in self.variants]
        if not self.presets:
            problems.append("presets: name at least one conversion")
        problems += [f"variants.{v}: {v!r} is also a preset name; name the variant something else"
                     for v in self.variants if v in known]
        problems += [f"variants.{v}: a name of letters, digits and _ . + - (it names a directory)"
                     for v in self.variants if not NAME.fullmatch(str(v))]
        return problems

    def _variant_problems(self) -> list[str]:
        problems = []
        for name, parts in self.distill_variants.items():
            where = f"distill_variants.{name}"
            if not NAME.fullmatch(str(name)):
                problems.append(f"{where}: a name of letters, digits and _ . + - (it names a directory)")
            if not parts:
                problems.append(f"{where}: give at least one part ([{{}}] for `distill` as it is)")
            if any(not 0 < p.share <= 1 for p in parts) or abs(sum(p.share for p in parts) - 1) > 1e-6:
                problems.append(f"{where}: each share in (0, 1], summing to 1; got {[p.share for p in parts]}")
            for i, part in enumerate(parts):
                problems += [f"{where}[{i}].keys.{key}: set by `ecomla run` for each stage; remove it"
                             for key in FILLED["distill"] if has_key(part.keys, key)]
                if len(parts) > 1 and has_key(part.keys, "train.total_tokens"):
                    problems.append(f"{where}[{i}].keys.train.total_tokens: a part of several trains on its share "
                                    "of distill.train.total_tokens; set the share (a one-part variant may set its "
                                    "own total_tokens)")
        return problems

    @property
    def points(self) -> list[tuple[str, dict, float | None]]:
        """Each compression point: (label, the mla keys it fills, its ratio or None for a budget)."""
        from ecomla.mla.budget import format_ratio, parse_budget

        if self.ratios:
            return [(format_ratio(r), {"target_compression": r}, r) for r in self.ratios]
        out = []
        for b in self.budgets:
            r_kv, d_r = parse_budget(b)
            out.append((f"{r_kv}+{d_r}", {"kv_lora_rank": r_kv, "qk_rope_head_dim": d_r}, None))
        return out

    def convert_for(self, ratio: float | None, preset: str) -> dict[str, Any]:
        """The `convert` section of one conversion: `convert`, that ratio's `convert_by_ratio` keys, then the
        variant's keys (or init.preset: the preset's name)."""
        body = merged(self.convert, self.convert_by_ratio.get(ratio, {}) if ratio is not None else {})
        if preset in self.variants:
            return merged(body, self.variants[preset])
        return merged(body, {"init": {"preset": preset}})

    @property
    def main_preset(self) -> str:
        return self.presets[0]

    @property
    def baseline(self) -> str:
        return self.baseline_teacher or self.distill_teachers[-1]

    def teachers_for(self, preset: str) -> list[str]:
        """The teachers the students of `preset` are distilled from: all of distill_teachers for the main
        conversion, baseline_teacher alone for the others (the same budget)."""
        if self.distill is None:
            return []
        return self.distill_teachers if preset == self.main_preset else [self.baseline]

    @property
    def used_teachers(self) -> list[str]:
        """The teachers some student is distilled from, in the order of `teachers`."""
        used = {t for p in self.presets for t in self.teachers_for(p)}
        return [t for t in self.teachers if t in used]

    @property
    def variant_parts(self) -> dict[str | None, list[DistillPart]]:
        """Distillation variants: name -> parts; {None: one whole part} when none are named."""
        return dict(self.distill_variants) or {None: [DistillPart()]}
