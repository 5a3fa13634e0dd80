"""The one-off jobs that feed a training run: `ecomla prepare-data` and `ecomla teacher-cache`.

Both read the same distill recipe as the run they feed, so data and cache
always match it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ecomla.data.text import DataError
from ecomla.distill import models
from ecomla.distill.data import model_inputs, open_dataset, prepare_data
from ecomla.distill.recipe import DistillRecipe
from ecomla.distill.runtime import barrier, init_distributed
from ecomla.distill.teacher import teacher_dtype, write_cache
from ecomla.io.publish import publish


def prepare(recipe: DistillRecipe, *, force: bool = False) -> list[Path]:
    tok_path = recipe.tokenizer or recipe.student or recipe.teacher.model
    written = prepare_data(recipe, models.load_tokenizer(tok_path), force=force)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print("nothing to prepare: data.train and data.eval are already prepared")
    return written


def teacher_cache(recipe: DistillRecipe, *, force: bool = False, progress: bool = True) -> Path:
    """Run the teacher over data.train once (any number of processes) and write teacher.cache_dir."""
    if not recipe.teacher.model or not recipe.teacher.cache_dir:
        raise DataError("teacher-cache needs teacher.model and teacher.cache_dir")
    out = Path(recipe.teacher.cache_dir)
    dist = init_distributed()
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to rebuild it")
    tok = models.load_tokenizer(recipe.tokenizer or recipe.student or recipe.teacher.model)
    data = open_dataset(recipe.data.train, tok, recipe.data.seq_len, "data.train", recipe.output_dir)
    dtype = teacher_dtype(recipe)
    model = models.load_causal_lm(recipe.teacher.model, dtype, "teacher").eval().to(dist.device)
    tmp = out.with_name(f".{out.name}.tmp")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()

    def inputs(batch):
        return model_inputs(batch, recipe.data.cross_document_attention, dtype, dist.device)["inputs"]

    try:
        write_cache(model, data, tmp, k=recipe.teacher.cache_topk, temperature=recipe.loss.temperature,
                    batch_size=recipe.train.micro_batch_size, inputs_fn=inputs, rank=dist.rank,
                    world=dist.world_size, teacher_name=recipe.teacher.model, progress=progress and dist.is_main)
        barrier()
        if dist.is_main:
            (tmp / "meta.json.tmp").rename(tmp / "meta.json")
            publish(tmp, out)
            print(f"wrote {out}")
    except BaseException:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    return out
