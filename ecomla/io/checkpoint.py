"""Reading and writing Hugging Face checkpoints one tensor at a time.

`CheckpointReader` opens a local checkpoint directory (safetensors shards with
or without an index, or a legacy `pytorch_model*.bin`) and hands out tensors by
name without loading the rest, so converters can stream layer by layer.

`AtomicCheckpointWriter` builds an output directory under a temporary name next
to the destination and renames it into place only when everything is written:
a crash or an error never leaves a directory that looks like a whole
checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ecomla.errors import UserError
from ecomla.io.publish import publish

CONFIG_FILES = ("config.json",)
# Files copied verbatim from a source checkpoint so the output tokenizes and
# generates exactly like it.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

# A directory holds a tokenizer when it has one of these (the vocabulary files a tokenizer loads from).
TOKENIZER_VOCABS = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a tokenizer's vocabulary (a hub name is taken on trust)."""
    d = Path(directory)
    return not d.is_dir() or any((d / name).is_file() for name in TOKENIZER_VOCABS)


# safetensors header dtype names -> torch dtypes (the floating ones a checkpoint stores weights in)
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CheckpointError(UserError, ValueError):
    """A checkpoint on disk is missing, incomplete or corrupt."""


def resolve_model_dir(name_or_path: str) -> Path:
    """A local directory as is; otherwise a hub name, fetched (or found in the HF cache).

    Offline machines get a clear error naming both possibilities.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{name_or_path}: expected a checkpoint directory, found a file")
    looks_like_hub = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if not looks_like_hub:
        raise CheckpointError(f"{name_or_path}: no such directory (and it is not a hub name like 'org/model')")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                name_or_path,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            )
        )
    except Exception as err:  # offline, gated, or unknown repo: say which and how to fix it
        raise CheckpointError(
            f"{name_or_path}: not a local directory, and fetching it from the hub failed "
            f"({type(err).__name__}: {err}). Pass a local checkpoint directory instead."
        ) from err


class CheckpointReader:
    """Lazy, by-name access to the tensors of a local checkpoint directory."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: unreadable index ({err})") from err
            for name, fname in weight_map.items():
                self._where[name] = self.directory / fname
        elif single.exists():
            self._scan(single)
        else:
            bins = sorted(self.directory.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(
                    f"{self.directory}: no weights found (expected model.safetensors, "
                    "model.safetensors.index.json or pytorch_model.bin)"
                )
            self._bin = {}
            for b in bins:
                try:
                    self._bin.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))
                except Exception as err:
                    raise CheckpointError(f"{b}: cannot be read ({err})") from err
            self._where = dict.fromkeys(self._bin, bins[0])  # names only; tensors come from self._bin
        # Open every shard now, so a missing or corrupt file fails before any compute.
        for shard in sorted(set(self._where.values())):
            if self._bin is None:
                self._open(shard)

    def _open(self, shard: Path):
        if shard not in self._handles:
            if not shard.exists():
                raise CheckpointError(f"{shard}: shard listed in the index is missing")
            try:
                self._handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
            except Exception as err:
                raise CheckpointError(f"{shard}: corrupt safetensors file ({err})") from err
        return self._handles[shard]

    def _scan(self, shard: Path) -> None:
        for name in self._open(shard).keys():
            self._where[name] = shard

    def release(self) -> None:
        """Unmap the shards: pages read so far stop counting in this process's RSS.

        safetensors maps whole files; a streaming converter calls this after each
        layer so that resident memory holds one layer of the source, not all of it.
        Handles reopen on the next read (only the header is parsed).
        """
        self._handles.clear()

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._bin is not None:
            return tuple(self._bin[name].shape)
        handle = self._open(self._where[name])
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """One tensor, converted to `dtype` (None keeps the stored dtype)."""
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        try:
            t = self._bin[name] if self._bin is not None else self._open(self._where[name]).get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"{self._where[name]}: cannot read tensor {name!r} ({err})") from err
        return t if dtype is None else t.to(dtype)

    def stored_dtype(self) -> torch.dtype:
        """The dtype of the first floating tensor (the checkpoint's storage precision), read from headers only."""
        for name in sorted(self._where):
            if self._bin is not None:
                dtype = self._bin[name].dtype
            else:
                dtype = _SAFETENSORS_DTYPES.get(self._open(self._where[name]).get_slice(name).get_dtype())
            if dtype is not None and dtype.is_floating_point:
                return dtype
        return torch.float32


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class AtomicCheckpointWriter:
    """Write a checkpoint directory under a temporary name; `commit()` renames it into place.

    Tensors are buffered into shards of about `shard_bytes` and flushed as they
    fill, so memory holds at most one shard. Use as a context manager: leaving
    the block with an exception removes the temporary directory.
    """

    def __init__(self, destination: str | os.PathLike, *, overwrite: bool, shard_bytes: int = 512 << 20):
        self.destination = Path(destination)
        if self.destination.exists() and not overwrite:
            raise FileExistsError(f"{self.destination} already exists; pass --force to replace it")
        self.destination.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.destination.name}.tmp-", dir=self.destination.parent))
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it private (0700); a checkpoint is an ordinary directory
        self.overwrite = overwrite
        self.shard_bytes = shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._num_shards = 0
        self._weight_map: dict[str, str] = {}
        self._total = 0
        self._committed = False

    @property
    def path(self) -> Path:
        """Where files go while the checkpoint is being written."""
        return self.tmp

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._weight_map or name in self._buffer:
            raise ValueError(f"tensor {name!r} written twice")
        self._buffer[name] = tensor.detach().contiguous().cpu()
        if _nbytes(self._buffer.values()) >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        self._num_shards += 1
        idx = self._num_shards
        fname = f"model-{idx:05d}.safetensors"
        save_file(self._buffer, str(self.tmp / fname), metadata={"format": "pt"})
        self._total += _nbytes(self._buffer.values())
        for name in self._buffer:
            self._weight_map[name] = fname
        self._buffer = {}

    def _finish_weights(self) -> None:
        self._flush()
        n = self._num_shards
        if n == 1:  # a single shard gets the plain name, like save_pretrained
            (self.tmp / "model-00001.safetensors").rename(self.tmp / "model.safetensors")
            return
        renames = {f"model-{i:05d}.safetensors": f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
        for old, new in renames.items():
            (self.tmp / old).rename(self.tmp / new)
        index = {
            "metadata": {"total_size": self._total},
            "weight_map": {k: renames[v] for k, v in sorted(self._weight_map.items())},
        }
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def copy_files(self, source_dir: Path, names: Iterable[str] = TOKENIZER_FILES) -> list[str]:
        copied = []
        for name in names:
            src = Path(source_dir) / name
            if src.is_file():
                shutil.copy2(src, self.tmp / name)
                copied.append(name)
        return copied

    def commit(self) -> Path:
        """Finish the shards and move the directory into place (replacing an old one if allowed)."""
        self._finish_weights()
        if self.destination.exists() and not self.overwrite:
            raise FileExistsError(f"{self.destination} appeared while converting; pass --force to replace it")
        publish(self.tmp, self.destination)
        self._committed = True
        return self.destination

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> AtomicCheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._committed:
            self.abort()
