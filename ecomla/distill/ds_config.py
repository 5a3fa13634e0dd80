"""The DeepSpeed config of a run: a JSON file of settings, the recipe's overrides, then the batch and precision.

Batch sizes, clipping, precision and the ZeRO stage always come from the typed
recipe, so the JSON files in recipes/deepspeed/ only hold engine tuning. A file
or override that sets one of those keys differently is an error, not a silent
win for either side.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ecomla.distill.recipe import DistillRecipe
from ecomla.errors import UserError


class DeepSpeedConfigError(UserError, ValueError):
    pass


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_ds_config(recipe: DistillRecipe, world_size: int, grad_accum: int) -> dict[str, Any]:
    ds = recipe.deepspeed
    base: dict[str, Any] = {}
    if ds.config:
        path = Path(ds.config)
        if not path.is_file():
            raise DeepSpeedConfigError(f"deepspeed.config: {path} not found")
        try:
            base = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise DeepSpeedConfigError(f"deepspeed.config: {path} is not valid JSON ({err})") from err
    cfg = deep_merge(base, ds.overrides)
    t = recipe.train
    owned = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": t.micro_batch_size * grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
    }
    problems = [
        f"deepspeed: '{k}' is {cfg[k]} in the DeepSpeed settings but {v} from the recipe; set it in the recipe only"
        for k, v in owned.items()
        if k in cfg and cfg[k] != v
    ]
    stage = cfg.get("zero_optimization", {}).get("stage")
    if stage is not None and stage != ds.zero_stage:
        problems.append(
            f"deepspeed: {ds.config or 'overrides'} sets ZeRO stage {stage}, the recipe's deepspeed.zero_stage is "
            f"{ds.zero_stage}; make them agree"
        )
    if "optimizer" in cfg or "scheduler" in cfg:
        problems.append("deepspeed: leave 'optimizer'/'scheduler' out; ecomla drives AdamW and the LR schedule itself")
    if problems:
        raise DeepSpeedConfigError("\n".join(problems))
    cfg.update(owned)
    cfg.setdefault("zero_optimization", {})["stage"] = ds.zero_stage
    cfg["bf16"] = {**cfg.get("bf16", {}), "enabled": t.precision == "bf16"}
    cfg.setdefault("steps_per_print", 10**12)  # ecomla logs itself
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg


def teacher_ds_config(student_cfg: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3 inference settings for a frozen teacher beside a ZeRO-3 student (no optimizer)."""
    zero = {k: v for k, v in student_cfg.get("zero_optimization", {}).items() if k.startswith("stage3_") or k == "stage"}
    return {
        "train_micro_batch_size_per_gpu": student_cfg["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {**zero, "stage": 3},
        "bf16": dict(student_cfg.get("bf16", {"enabled": False})),
        "steps_per_print": 10**12,
    }
