"""The weights of several checkpoints of one architecture, averaged into one checkpoint (a model soup).

    ecomla average OUT CKPT CKPT [CKPT ...] [--force]

Students distilled from one start (the same conversion) by different runs, for example with other seeds, data or
learning rates on a cluster, stay close enough in weight space for their mean to be a working model. Each tensor
is the plain mean of the inputs' (summed in float64, stored in the first checkpoint's dtype), read one tensor at a
time. The config, tokenizer and generation files are the first checkpoint's. Checkpoints with other tensor names
or shapes, or with other configs, are refused before anything is written; the output is written under a
temporary name and renamed into place when whole.

On SmolLM2 at 4.0x, averages of five and of nine students from the main job's start score 59.6 and 59.1 on all
1,000 multiple-choice items, against 57.7-59.7 for the students themselves (docs/recovery.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ecomla.errors import UserError
from ecomla.io.checkpoint import CONFIG_FILES, TOKENIZER_FILES, AtomicCheckpointWriter, CheckpointReader


class AverageError(UserError, ValueError):
    """Checkpoints that cannot be averaged, or an output in the way."""


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise AverageError(f"{directory}: no config.json; give checkpoint directories (a run's final/)")
    return json.loads(path.read_text())


def average_checkpoints(out: str | Path, checkpoints: list[str | Path], *, force: bool = False) -> Path:
    """Write the mean of `checkpoints`' weights to `out`; returns `out`."""
    dirs = [Path(c) for c in checkpoints]
    if len(dirs) < 2:
        raise AverageError("give at least two checkpoints to average")
    out = Path(out)
    if out.exists() and not force:
        raise AverageError(f"{out} exists; give a new directory or pass --force to replace it")
    if out.resolve() in {d.resolve() for d in dirs}:
        raise AverageError(f"{out} is one of the checkpoints to average; write the average elsewhere")
    first = _config(dirs[0])
    readers = [CheckpointReader(d) for d in dirs]
    shapes = {name: readers[0].shape(name) for name in readers[0].names()}
    for d, r in zip(dirs[1:], readers[1:]):
        if _config(d) != first:
            raise AverageError(f"{d}/config.json differs from {dirs[0]}'s; only one architecture averages")
        if {name: r.shape(name) for name in r.names()} != shapes:
            raise AverageError(f"{d} holds other tensors or shapes than {dirs[0]}; only one architecture averages")
    with AtomicCheckpointWriter(out, overwrite=force) as writer:
        for name in sorted(shapes):
            tensors = [r.get(name, None) for r in readers]
            mean = sum(t.to(torch.float64) for t in tensors) / len(tensors)
            writer.add(name, mean.to(tensors[0].dtype))
        writer.copy_files(dirs[0], (*CONFIG_FILES, *TOKENIZER_FILES))
        writer.commit()
    for r in readers:
        r.release()
    return out
