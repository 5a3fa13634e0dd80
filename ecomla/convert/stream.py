"""`ecomla convert`: the one streaming conversion, for every target.

    ecomla convert RECIPE.yaml [--set mla.kv_lora_rank=64] [--force]

`convert(plan)` owns the walk over the source layers, the atomic writer, the
top-level tensors and the report; the target's layer transform turns each source
layer into the output's (`ecomla.convert.mla.MLATransform` for mla,
`ecomla.convert.targets.TargetTransform` for gqa, mqa and lrkv).

Memory. Only one layer's weights are in memory at a time (the reader is released
after each); the output is written shard by shard into a temporary directory that
is renamed into place at the end, so an error leaves nothing behind.

Report. Every run writes `conversion_report.json`: the common fields of
`ConversionReport` (KV numbers per token and layer before and after, the
compression ratio, params, per-layer entries, seconds, the resolved recipe) and
the target's own (MLA: ranks, RoPE, and with calibration data the held-out
reconstruction error per layer and the perplexity of both models; gqa/mqa/lrkv:
heads or rank, per-layer weight error).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ecomla.convert.plan import MLAPlan, Plan, make_plan
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.walk import layer_tensors
from ecomla.io.checkpoint import AtomicCheckpointWriter
from ecomla.recipe.schema import recipe_to_dict, save_recipe


class LayerTransform(Protocol):
    def layer(self, i: int, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """Source layer i's tensors (names relative to the layer, as stored) -> the output layer's and its entry."""

    def postfix(self, entry: dict) -> dict[str, str]:
        """What the progress bar shows for a layer's entry."""

    def finish(self) -> dict:
        """The target's report fields, after the last layer (compression_ratio and
        kv_elements_per_token_per_layer among them)."""


@dataclass
class ConversionReport:
    """conversion_report.json: the fields every target has, then the target's own (`details`)."""

    target: str
    source: str
    source_family: str
    output_dir: str
    output_class: str
    params: dict
    layers: list[dict]
    details: dict = field(default_factory=dict)
    files_copied: list[str] = field(default_factory=list)
    seconds: float = 0.0
    recipe: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        head = {"target": self.target, "source": self.source, "source_family": self.source_family,
                "output_dir": self.output_dir, "output_class": self.output_class}
        return {**head, **self.details, "params": self.params, "layers": self.layers,
                "files_copied": self.files_copied, "seconds": self.seconds, "recipe": self.recipe}


def transform_for(plan: Plan) -> LayerTransform:
    if isinstance(plan, MLAPlan):
        from ecomla.convert.mla import MLATransform

        return MLATransform(plan)
    from ecomla.convert.targets import TargetTransform

    return TargetTransform(plan)


def top_level_names(plan: Plan) -> list[str]:
    """The tensors outside the layers: embeddings, final norm, and the head unless it is tied."""
    return ["model.embed_tokens.weight", "model.norm.weight"] + ([] if plan.source.tied else ["lm_head.weight"])


def convert(plan: Plan, *, force: bool = False, progress: bool = True) -> dict:
    """Write the converted checkpoint at plan.recipe.output_dir and return its report (as written)."""
    t0 = time.time()
    recipe, source = plan.recipe, plan.source
    reader = source.reader
    transform = transform_for(plan)
    layers, params_after = [], 0
    with AtomicCheckpointWriter(recipe.output_dir, overwrite=force) as writer:
        desc = "convert" if recipe.target == "mla" else f"convert ({recipe.target})"
        bar = tqdm(range(plan.shape.num_layers), desc=desc, unit="layer", disable=not progress)
        for i in bar:
            prefix = source.layer_prefix(i)
            out, entry = transform.layer(i, layer_tensors(reader, i, dtype=None))
            for k, v in out.items():
                writer.add(prefix + k, v.to("cpu", plan.out_dtype))
                params_after += v.numel()
            layers.append(entry)
            reader.release()
            bar.set_postfix(transform.postfix(entry))
        for name in top_level_names(plan):
            v = reader.get(name, dtype=None)
            writer.add(name, v.to(plan.out_dtype))
            params_after += v.numel()
        details = transform.finish()
        reader.release()

        plan.config.save_pretrained(writer.path)
        params_before = sum(math.prod(reader.shape(n)) for n in reader.names()
                            if not (source.tied and n == "lm_head.weight"))
        report = ConversionReport(
            target=recipe.target, source=recipe.model, source_family=source.family, output_dir=recipe.output_dir,
            output_class=plan.config.architectures[0], params={"before": params_before, "after": params_after},
            layers=layers, details=details, files_copied=writer.copy_files(source.directory),
            seconds=time.time() - t0, recipe=recipe_to_dict(recipe),
        ).to_dict()
        (writer.path / "conversion_report.json").write_text(json.dumps(report, indent=2) + "\n")
        save_recipe(recipe, writer.path / "ecomla_recipe.yaml")
        writer.commit()
    return report


def convert_recipe(recipe: ConvertRecipe, *, force: bool = False, progress: bool = True) -> dict:
    """Plan and convert: what `ecomla convert` runs."""
    return convert(make_plan(recipe, force=force, progress=progress), force=force, progress=progress)
