"""The weights of several checkpoints of one architecture, averaged into one checkpoint (a model soup).

    ecomla average OUT CKPT CKPT [CKPT ...] [--force]

Students distilled from one start (the same conversion) by different runs, for example with other seeds, data or
learning rates on a cluster, stay close enough in weight space for their mean to be a working model. Each floating
tensor is the plain mean of the inputs' (summed in float64, stored in the first checkpoint's dtype), read one tensor
at a time; any other tensor (an integer buffer) must be the same in every input and is copied. The config, tokenizer
and generation files are the first checkpoint's, and `average.json` beside them lists the inputs. Checkpoints
whose configs, tensor names or shapes differ are refused, naming what differs, before anything is written; the
output is written under a temporary name and renamed into place when whole.

On SmolLM2 at 4.0x, averages of five and of nine students from the main job's start score 59.6 and 59.1 on all
1,000 multiple-choice items, against 57.7-59.7 for the students themselves (docs/recovery.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ecomla.errors import UserError
from ecomla.io.checkpoint import CONFIG_FILES, TOKENIZER_FILES, AtomicCheckpointWriter, CheckpointReader

# Keys that record how a checkpoint was saved, not what it computes.
_SAVE_KEYS = ("transformers_version", "torch_dtype", "dtype", "_name_or_path")


class AverageError(UserError, ValueError):
    """Checkpoints that cannot be averaged, or an output in the way."""


def _config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise AverageError(f"{directory}: no config.json; give checkpoint directories (a run's final/)")
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in _SAVE_KEYS}


def _check_out(out: Path, dirs: list[Path], force: bool) -> None:
    """OUT must not hold an input (replacing it would delete that input), and replaces nothing without force."""
    target = out.resolve()
    for d in dirs:
        if d.resolve() == target or d.resolve().is_relative_to(target):
            raise AverageError(f"{out} holds the checkpoint {d}, which writing the average there would delete; "
                               "write it elsewhere")
    if out.exists() and not force:
        raise AverageError(f"{out} exists; give a new directory or pass --force to replace it")


def _check_same(dirs: list[Path], readers: list[CheckpointReader]) -> dict[str, tuple[int, ...]]:
    """The first checkpoint's tensor shapes, once every other checkpoint is shown to hold the same model."""
    first = _config(dirs[0])
    shapes = {name: readers[0].shape(name) for name in readers[0].names()}
    for d, r in zip(dirs[1:], readers[1:]):
        config = _config(d)
        keys = sorted(k for k in first.keys() | config.keys() if first.get(k) != config.get(k))
        if keys:
            raise AverageError(f"{d}/config.json differs from {dirs[0]}'s in {', '.join(keys)}; only checkpoints "
                               "of one architecture average")
        names = r.names()
        if names != shapes.keys():
            odd = sorted(names ^ shapes.keys())
            raise AverageError(f"{d} and {dirs[0]} hold different tensors ({', '.join(odd[:3])}"
                               f"{', ...' if len(odd) > 3 else ''}); only checkpoints of one architecture average")
        for name in sorted(names):
            if r.shape(name) != shapes[name]:
                raise AverageError(f"{name} is {list(r.shape(name))} in {d} and {list(shapes[name])} in {dirs[0]}; "
                                   "only checkpoints of one architecture average")
    return shapes


def average_checkpoints(out: str | Path, checkpoints: list[str | Path], *, force: bool = False) -> Path:
    """Write the mean of `checkpoints`' weights to `out`; returns `out`."""
    dirs = [Path(c) for c in checkpoints]
    if len(dirs) < 2:
        raise AverageError("give at least two checkpoints to average")
    out = Path(out)
    _check_out(out, dirs, force)
    readers = [CheckpointReader(d) for d in dirs]
    try:
        shapes = _check_same(dirs, readers)
        with AtomicCheckpointWriter(out, overwrite=force) as writer:
            for name in sorted(shapes):
                tensors = [r.get(name, None) for r in readers]
                if tensors[0].is_floating_point():
                    mean = sum(t.to(torch.float64) for t in tensors) / len(tensors)
                    writer.add(name, mean.to(tensors[0].dtype))
                elif all(torch.equal(t, tensors[0]) for t in tensors[1:]):
                    writer.add(name, tensors[0])
                else:
                    raise AverageError(f"{name} ({tensors[0].dtype}) differs between the checkpoints and is not "
                                       "a floating tensor, so it has no mean; only checkpoints of one model average")
            writer.copy_files(dirs[0], (*CONFIG_FILES, *TOKENIZER_FILES))
            record = {"average_of": [str(d) for d in dirs], "tensors": len(shapes)}
            (writer.path / "average.json").write_text(json.dumps(record, indent=2) + "\n")
            writer.commit()
    finally:
        for r in readers:
            r.release()
    return out
