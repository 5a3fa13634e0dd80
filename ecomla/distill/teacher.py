"""Teachers: a live model run every step, or a cache of its top-k log-probs; and `ecomla teacher-cache`.

    ecomla teacher-cache RECIPE.yaml

A teacher turns one micro-batch into a callback (s, e) -> TeacherDist over the
batch's valid target rows, which the chunked loss calls chunk by chunk.

The cache holds, for every training sequence and position, the teacher's top-k
log-probs at the recipe's temperature plus the log-mass of everything else
(one tail bucket). KD against it is exact when k equals the vocabulary, and
otherwise compares the two distributions coarsened onto (top-k ids, rest); see
`ecomla.distill.losses`. Rows follow the dataset's sequence indices; the cache
records the dataset's fingerprint and refuses a different one. An 8B teacher
so costs one pass instead of one per run; the price is disk:
T·k·8 + 4 bytes per sequence (k = 64: 516 bytes per token).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ecomla.data.text import DataError
from ecomla.distill.layers import LayerCatch
from ecomla.distill.losses import TeacherDist

TeacherFn = Callable[[int, int], TeacherDist]


def fingerprint(dataset) -> dict:
    """Size and a hash of the first and last sequences: enough to catch a cache made for other data."""
    n = len(dataset)
    b = dataset.batch([0, n - 1])
    digest = hashlib.sha256(b["tokens"].numpy().tobytes() + b["segments"].numpy().tobytes()).hexdigest()[:16]
    return {"num_sequences": n, "seq_len": int(b["tokens"].shape[1]), "sha": digest}


class LiveTeacher:
    """A frozen causal LM (a plain module, or the module of a ZeRO-3 inference engine)."""

    def __init__(self, model, temperature: float):
        self.model = model
        self.temperature = temperature

    @torch.no_grad()
    def prepare(self, inputs: dict, valid: torch.Tensor, indices: list[int], catch: LayerCatch | None = None) -> TeacherFn:
        """`catch`: also keep each layer's output of this forward (the teacher is the ILD source too)."""
        with catch.on(self.model) if catch is not None else contextlib.nullcontext():
            hidden = self.model.get_decoder()(**inputs).last_hidden_state  # (B, T, d_t)
        rows = hidden[valid]  # (N, d_t)
        head = self.model.get_output_embeddings()
        return lambda s, e: TeacherDist.from_logits(head(rows[s:e]), self.temperature)


def teacher_dtype(recipe) -> torch.dtype:
    """The dtype the teacher runs in, live or for its cache; `auto` follows the run's precision."""
    name = recipe.teacher.dtype
    if name == "auto":
        name = "bfloat16" if recipe.train.precision == "bf16" else "float32"
    return torch.bfloat16 if name == "bfloat16" else torch.float32


class CachedTeacher:
    """Top-k log-probs read from a cache directory written by `ecomla teacher-cache`."""

    def __init__(self, cache_dir: str, dataset, temperature: float, vocab_size: int):
        self.dir = Path(cache_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"teacher.cache_dir: {self.dir} has no meta.json; run `ecomla teacher-cache` first")
        self.meta = json.loads(meta_path.read_text())
        problems = []
        if self.meta["dataset"] != fingerprint(dataset):
            problems.append("it was written for other training data (dataset fingerprint differs)")
        if abs(self.meta["temperature"] - temperature) > 1e-12:
            problems.append(f"it holds temperature {self.meta['temperature']}, the recipe uses {temperature}")
        if self.meta["vocab_size"] != vocab_size:
            problems.append(f"its vocab size {self.meta['vocab_size']} differs from the student's {vocab_size}")
        if problems:
            raise DataError(f"teacher.cache_dir: {self.dir} does not fit this run: " + "; ".join(problems))
        self.world = int(self.meta["world_size"])
        self.arrays = [
            {k: np.load(self.dir / f"rank_{r:03d}.{k}.npy", mmap_mode="r") for k in ("idx", "logp", "tail")}
            for r in range(self.world)
        ]

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        out = {k: [] for k in ("idx", "logp", "tail")}
        for i in indices:
            a = self.arrays[i % self.world]
            for k in out:
                out[k].append(torch.from_numpy(np.array(a[k][i // self.world])))
        return {k: torch.stack(v) for k, v in out.items()}

    def prepare(self, inputs: dict, valid: torch.Tensor, indices: list[int], catch: LayerCatch | None = None) -> TeacherFn:
        """`catch` must be None: a cache holds no layers (ILD then runs its source model beside it)."""
        if catch is not None:
            raise ValueError("a cached teacher has no layers to catch; give ILD its source model")
        r = self.rows(indices)
        dev = valid.device
        idx, logp, tail = r["idx"].to(dev)[valid].long(), r["logp"].to(dev)[valid], r["tail"].to(dev)[valid]
        return lambda s, e: TeacherDist(topk_idx=idx[s:e], topk_logp=logp[s:e], tail_logp=tail[s:e])


@torch.no_grad()
def write_cache(model, dataset, out_dir: Path, *, k: int, temperature: float, batch_size: int, inputs_fn,
                rank: int, world: int, teacher_name: str, progress: bool) -> None:
    """Each rank writes rows i ≡ rank (mod world); rank 0 writes meta.json last. Called by `ecomla teacher-cache`."""
    n = len(dataset)
    mine = list(range(rank, n, world))
    T = dataset.seq_len
    vocab = int(model.config.vocab_size)
    k = min(k, vocab)
    arrays = {
        "idx": np.lib.format.open_memmap(out_dir / f"rank_{rank:03d}.idx.npy", mode="w+", dtype=np.int32, shape=(len(mine), T, k)),
        "logp": np.lib.format.open_memmap(out_dir / f"rank_{rank:03d}.logp.npy", mode="w+", dtype=np.float32, shape=(len(mine), T, k)),
        "tail": np.lib.format.open_memmap(out_dir / f"rank_{rank:03d}.tail.npy", mode="w+", dtype=np.float32, shape=(len(mine), T)),
    }
    head = model.get_output_embeddings()
    for start in tqdm(range(0, len(mine), batch_size), desc="teacher-cache", disable=not progress):
        ids = mine[start : start + batch_size]
        inputs = inputs_fn(dataset.batch(ids))
        hidden = model.get_decoder()(**inputs).last_hidden_state  # (B, T, d)
        for j in range(hidden.shape[0]):
            dist = TeacherDist.topk_from_logits(head(hidden[j]), temperature, k)
            arrays["idx"][start + j] = dist.topk_idx.cpu().numpy().astype(np.int32)
            arrays["logp"][start + j] = dist.topk_logp.float().cpu().numpy()
            arrays["tail"][start + j] = dist.tail_logp.float().cpu().numpy()
    for a in arrays.values():
        a.flush()
    if rank == 0:
        meta = {"teacher": teacher_name, "topk": k, "temperature": temperature, "world_size": world,
                "vocab_size": vocab, "dataset": fingerprint(dataset)}
        (out_dir / "meta.json.tmp").write_text(json.dumps(meta, indent=2) + "\n")
