"""Stage adoption: an upgrade of ecomla keeps the finished stages that it would compute the same.

A stage's key hashes its whole resolved recipe, so a release that adds a knob changes every key that hashes it.
stage.json records what the key hashed (`Stage.record`); `adopt` takes over a finished stage whose inputs are the
same and whose recipe differs only by keys added since, each at its default (`ecomla.recipe.schema.asks_the_same`).
`STAGE_VERSIONS` is the way out for a release that changes what a stage computes from the same recipe.
"""

from __future__ import annotations

import glob
import json
from typing import Any

# What each kind of stage computes, by version. A release that changes what a stage computes from the same recipe
# (a fix in the conversion's numerics, a new loss term under an existing key) bumps its kind's version: from 2 on the
# version joins the key's inputs, so every stage of that kind (and the stages after it) reruns, and none is adopted.
STAGE_VERSIONS = {"convert": 1, "teacher-cache": 1, "distill": 1, "measure": 1}


def _asks_the_same(kind: str, old: dict, new: dict) -> bool:
    """Whether a stage's recorded recipe (as an earlier ecomla resolved it) asks for what `new` asks for, keys
    added since at their defaults (`asks_the_same`)."""
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.distill.recipe import DataConfig, DistillRecipe, TeacherConfig
    from ecomla.recipe.schema import asks_the_same
    from ecomla.run.recipe import Measure

    if kind != "teacher-cache":
        return asks_the_same(old, new, {"convert": ConvertRecipe, "distill": DistillRecipe, "measure": Measure}[kind])
    # _cache_inputs: the data section, the teacher's keys with its dtype, the tokenizer and the temperature
    rest_old, rest_new = dict(old), dict(new)
    data_old, data_new = rest_old.pop("data", None), rest_new.pop("data", None)
    teacher_old, teacher_new = dict(rest_old.pop("teacher", {})), dict(rest_new.pop("teacher", {}))
    return (rest_old == rest_new and teacher_old.pop("dtype", None) == teacher_new.pop("dtype", None)
            and isinstance(data_old, dict) and asks_the_same(data_old, data_new, DataConfig)
            and asks_the_same(teacher_old, teacher_new, TeacherConfig))


def same_inputs(old: Any, new: list) -> bool:
    """The recorded inputs against the stage's: equal, but for the measure settings of a distillation measured along
    the way (its one dict), which may have gained keys since, each at its default."""
    from ecomla.recipe.schema import asks_the_same
    from ecomla.run.recipe import Measure

    if not isinstance(old, list) or len(old) != len(new):
        return False
    return all(asks_the_same(a, b, Measure) if isinstance(a, dict) and isinstance(b, dict) else a == b
               for a, b in zip(old, new))


def adopt(stage) -> None:
    """Take over a finished stage of the same label that an earlier ecomla keyed otherwise, when it computed the
    same: the same inputs (fingerprints and upstream key) and a recipe that differs only by keys added since, each
    at its default. So upgrading ecomla, which adds knobs and so changes every key that hashes them, does not
    recompute finished conversions, caches and distillations. The stage keeps the earlier key and directory, and
    the stages after it key from that key. Stages finished before stage.json kept the recipe are not adopted."""
    inputs = stage.record["inputs"]
    for record_file in sorted(stage.dir.parent.glob(f"{glob.escape(stage.label)}-*/stage.json")):  # a fixed order
        try:
            record = json.loads(record_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("recipe"), dict):
            continue  # finished before stage.json kept its recipe, or not a record at all
        key = record.get("key")
        if record_file.parent.name != f"{stage.label}-{key}" or not same_inputs(record.get("inputs"), inputs):
            continue
        if _asks_the_same(stage.kind, record["recipe"], stage.digested):
            stage.key, stage.dir, stage.adopted = key, record_file.parent, True
            return
