"""Pre-tokenized packed sequences on disk (`ecomla prepare-data`) and in memory.

Layout of a prepared dataset directory:

    out_dir/meta.json                 seq_len, counts, shard list, tokenizer and source info
    out_dir/shard_00000/tokens.npy    (N, T) int32 token ids
    out_dir/shard_00000/loss_mask.npy (N, T) uint8, 1 where the token is a target
    out_dir/shard_00000/segments.npy  (N, T) uint16, 0 = padding, 1..k = document number
    out_dir/shard_00001/...

`ShardWriter` builds it in a hidden sibling directory and renames it into
place on close, so a crash never leaves a half-written dataset behind.
`PackedDataset` memory-maps the shards (nothing is read until indexed);
`InMemoryPacked` has the same interface for small data tokenized on the fly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from ecomla.data.packing import Doc, PackedSequence, pack
from ecomla.data.text import DataError
from ecomla.io.publish import publish

FORMAT_VERSION = 1
_FIELDS = {"tokens": np.int32, "loss_mask": np.uint8, "segments": np.uint16}
_RESERVED = {"format_version", "seq_len", "num_sequences", "num_tokens", "target_tokens", "fill", "shards"}


def _count(loss_mask: np.ndarray, segments: np.ndarray) -> tuple[int, int]:
    """(non-padding tokens, training targets) of (N, T) arrays; a target is a masked-in token t+1 of t's document."""
    seg = segments.astype(np.int64)
    targets = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] != 0) & (loss_mask[:, 1:] != 0)
    return int((seg != 0).sum()), int(targets.sum())


def _to_torch(tokens: np.ndarray, loss_mask: np.ndarray, segments: np.ndarray) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.from_numpy(tokens.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask.astype(np.bool_)),
        "segments": torch.from_numpy(segments.astype(np.int64)),
    }


class ShardWriter:
    """Writes packed sequences into memory-mapped .npy shards; use as a context manager.

    Leaving the `with` block normally calls `close()` (meta.json written,
    directory renamed into place); leaving it by an exception calls `abort()`
    (everything removed). An existing `out_dir` is refused unless `overwrite`.
    """

    def __init__(self, out_dir: str | Path, seq_len: int, *, sequences_per_shard: int = 65536,
                 meta: dict | None = None, overwrite: bool = False):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and not overwrite:
            raise DataError(f"{self.out_dir} already exists; choose a new output directory or pass overwrite")
        clash = sorted(_RESERVED & set(meta or {}))
        if clash:
            raise ValueError(f"meta keys {clash} are written by ShardWriter itself; rename them")
        if seq_len < 2 or sequences_per_shard < 1:
            raise ValueError(f"need seq_len >= 2 and sequences_per_shard >= 1, got {seq_len} and {sequences_per_shard}")
        self.seq_len, self.per_shard, self.overwrite = seq_len, sequences_per_shard, overwrite
        self.meta = dict(meta or {})
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
        self._shards: list[dict] = []
        self._open: dict[str, np.memmap] | None = None  # the current shard's preallocated arrays
        self._rows = 0  # rows filled in the current shard
        self.num_sequences = self.num_tokens = self.target_tokens = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, seq: PackedSequence) -> None:
        """Append one sequence."""
        if self._tmp is None:
            raise DataError("this ShardWriter is already closed")
        if seq.tokens.shape != (self.seq_len,):
            raise DataError(f"sequence has shape {seq.tokens.shape}, but the writer's seq_len is {self.seq_len}")
        if self._open is None:
            shard = self._tmp / f"shard_{len(self._shards):05d}"
            shard.mkdir()
            self._open = {
                name: np.lib.format.open_memmap(shard / f"{name}.npy", mode="w+", dtype=dt, shape=(self.per_shard, self.seq_len))
                for name, dt in _FIELDS.items()
            }
        for name in _FIELDS:
            self._open[name][self._rows] = getattr(seq, name)
        self._rows += 1
        tokens, targets = _count(seq.loss_mask[None], seq.segments[None])
        self.num_sequences += 1
        self.num_tokens += tokens
        self.target_tokens += targets
        if self._rows == self.per_shard:
            self._finish_shard()

    def write_all(self, seqs: Iterable[PackedSequence]) -> int:
        """Append every sequence; returns how many were written."""
        n = 0
        for seq in seqs:
            self.write(seq)
            n += 1
        return n

    def _finish_shard(self) -> None:
        shard = self._tmp / f"shard_{len(self._shards):05d}"
        trim = self._rows < self.per_shard  # the last shard is rewritten with its exact row count
        for name, arr in self._open.items():
            arr.flush()
            if trim:
                np.save(shard / f"{name}.trim.npy", arr[: self._rows])
        self._open = None  # unmaps the preallocated files
        if trim:
            for name in _FIELDS:
                os.replace(shard / f"{name}.trim.npy", shard / f"{name}.npy")
        self._shards.append({"name": shard.name, "num_sequences": self._rows})
        self._rows = 0

    def close(self) -> Path:
        """Write meta.json and move the dataset into place; returns `out_dir`."""
        if self._tmp is None:
            raise DataError("this ShardWriter is already closed")
        if self._rows:
            self._finish_shard()
        if not self.num_sequences:
            self.abort()
            raise DataError("no sequences were written (the source yielded no tokens); nothing was saved")
        total = self.num_sequences * self.seq_len
        meta = {
            "format_version": FORMAT_VERSION, "seq_len": self.seq_len, "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens, "target_tokens": self.target_tokens,
            "fill": round(self.num_tokens / total, 6), "shards": self._shards, **self.meta,
        }
        (self._tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if self.out_dir.exists() and not self.overwrite:
            self.abort()
            raise DataError(f"{self.out_dir} appeared while writing; nothing was replaced")
        publish(self._tmp, self.out_dir)
        self._tmp = None
        return self.out_dir

    def abort(self) -> None:
        """Drop everything written so far."""
        self._open = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


class PackedDataset:
    """A prepared dataset directory, memory-mapped; item i is a dict of (T,) tensors.

    Items: tokens (long), loss_mask (bool), segments (long). `batch` stacks
    them to (B, T). Shards are opened lazily in each process, so the object
    can be pickled to DataLoader workers cheaply.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        meta_path = self.dir / "meta.json"
        if not self.dir.is_dir():
            raise DataError(f"{self.dir}: no such dataset directory; create it with `ecomla prepare-data`")
        if not meta_path.is_file():
            raise DataError(f"{self.dir}: no meta.json, so this is not a finished prepared dataset; rerun `ecomla prepare-data`")
        self.meta = json.loads(meta_path.read_text())
        missing = sorted({"seq_len", "num_tokens", "target_tokens", "shards"} - set(self.meta))
        if missing:
            raise DataError(f"{meta_path} lacks {missing}; it was not written by this version, rerun `ecomla prepare-data`")
        self.seq_len = int(self.meta["seq_len"])
        self.num_tokens = int(self.meta["num_tokens"])
        self.target_tokens = int(self.meta["target_tokens"])
        counts = [int(s["num_sequences"]) for s in self.meta["shards"]]
        self._offsets = np.cumsum([0] + counts)  # shard k holds rows [offsets[k], offsets[k+1])
        if self._offsets[-1] == 0:
            raise DataError(f"{self.dir}: the dataset is empty; prepare it again from a non-empty source")
        self._arrays: list[dict[str, np.ndarray]] | None = None
        self._shard_arrays()  # validate now, not at the first training step

    def _shard_arrays(self) -> list[dict[str, np.ndarray]]:
        if self._arrays is None:
            arrays = []
            for shard in self.meta["shards"]:
                parts = {}
                for name in _FIELDS:
                    path = self.dir / shard["name"] / f"{name}.npy"
                    if not path.is_file():
                        raise DataError(f"{path} is missing; the dataset is incomplete, rerun `ecomla prepare-data`")
                    parts[name] = np.load(path, mmap_mode="r")
                    if parts[name].shape != (shard["num_sequences"], self.seq_len):
                        raise DataError(f"{path} has shape {parts[name].shape}, but meta.json says "
                                        f"({shard['num_sequences']}, {self.seq_len}); rerun `ecomla prepare-data`")
                arrays.append(parts)
            self._arrays = arrays
        return self._arrays

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": None}

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _row(self, i: int) -> tuple[np.ndarray, ...]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} sequences")
        i %= len(self)
        k = int(np.searchsorted(self._offsets, i, side="right")) - 1
        parts = self._shard_arrays()[k]
        return tuple(parts[name][i - self._offsets[k]] for name in _FIELDS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _to_torch(*self._row(i))

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """(B, T) tensors for the given sequence indices, in that order."""
        rows = [self._row(int(i)) for i in indices]
        return _to_torch(*(np.stack(col) for col in zip(*rows)))


class InMemoryPacked:
    """Packed sequences held in memory, with `PackedDataset`'s interface."""

    def __init__(self, sequences: list[PackedSequence], seq_len: int):
        if not sequences:
            raise DataError("no packed sequences (the source yielded no tokens); add data")
        bad = [s.tokens.shape for s in sequences if s.tokens.shape != (seq_len,)]
        if bad:
            raise DataError(f"{len(bad)} sequences do not have shape ({seq_len},), e.g. {bad[0]}")
        self.seq_len = seq_len
        self.tokens = np.stack([s.tokens for s in sequences])  # (N, T)
        self.loss_mask = np.stack([s.loss_mask for s in sequences])  # (N, T)
        self.segments = np.stack([s.segments for s in sequences])  # (N, T)
        self.num_tokens, self.target_tokens = _count(self.loss_mask, self.segments)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _to_torch(self.tokens[i], self.loss_mask[i], self.segments[i])

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """(B, T) tensors for the given sequence indices, in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        return _to_torch(self.tokens[idx], self.loss_mask[idx], self.segments[idx])


def pack_to_memory(docs: Iterable[Doc], seq_len: int, pad_id: int) -> InMemoryPacked:
    """Pack documents (see `pack`) into an `InMemoryPacked` dataset."""
    return InMemoryPacked(list(pack(docs, seq_len, pad_id)), seq_len)
