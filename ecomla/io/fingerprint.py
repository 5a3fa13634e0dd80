"""Fingerprints of checkpoints and files: what a cached result was computed from.

Small files (≤ 64 MiB, e.g. every file of a tiny-world model, configs and
tokenizers) are hashed by content, so a fresh clone or a copy gets the same
fingerprint. Larger files (real weights) are fingerprinted by name, size and
modification time, which is cheap and changes whenever a file is rewritten.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CONTENT_HASH_LIMIT = 64 << 20


def file_fingerprint(path: Path) -> str:
    st = path.stat()
    if st.st_size > CONTENT_HASH_LIMIT:
        return f"{st.st_size}:{st.st_mtime_ns}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def path_fingerprint(path: str | Path) -> str:
    """One hash over a file or every file under a directory (names included, __pycache__ not); a non-path stands for itself."""
    p = Path(path)
    if not p.exists():
        return f"name:{path}"  # a hub name
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(p) if f != p else f.name}\0{file_fingerprint(f)}\n".encode())
    return h.hexdigest()[:16]


def digest(*parts: Any, length: int = 12) -> str:
    """A short hash of JSON-able parts (dict keys sorted; anything else by its str): the key of a cached result."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:length]


def recorded_key(record: Path) -> str | None:
    """The "key" a finished result recorded in its JSON file; None when the file is missing or damaged."""
    try:
        return json.loads(record.read_text()).get("key")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


class CachedStage:
    """A result computed once into its own directory and reused while its key holds.

    The key hashes everything the result is computed from (`digest` of the resolved recipe and the
    `path_fingerprint`s of its inputs); <dir>/stage.json records it once the result is whole. `ecomla run`'s
    stages and `ecomla variants`' runs are such stages: a rerun reuses the ones whose key is recorded, an edited
    recipe reruns the ones whose key changed, and an interrupted one starts again (or resumes, when the job
    checkpoints inside its directory). Subclasses are dataclasses with `key` and `dir` fields.
    """

    key: str
    dir: Path

    @property
    def done_file(self) -> Path:
        return self.dir / "stage.json"

    def done(self) -> bool:
        return recorded_key(self.done_file) == self.key

    def mark_done(self, **record: Any) -> None:
        """Record the key (and what else the caller keeps about the stage): the result is whole."""
        self.done_file.write_text(json.dumps({"key": self.key, **record}, indent=2) + "\n")
