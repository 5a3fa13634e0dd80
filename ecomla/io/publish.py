"""Putting a finished output in place: one rename, never a moment with no output.

Every command that writes a directory (a conversion, a distillation's `final/`, a teacher cache, prepared
shards, a reconstruction study) builds it under a temporary name beside its destination and then calls
`publish`. An old output is renamed aside first and deleted only after the new one is in place, so a reader (or
a kill) sees the old output or the new one: the destination is missing only between two renames in the same
directory, never for the time it takes to delete a tree.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def publish(tmp: str | Path, out: str | Path, *, replace: bool = True) -> Path:
    """Move the finished `tmp` (a directory or a file) to `out`; an existing `out` is replaced when `replace`
    (else FileExistsError, and `tmp` stays where it is)."""
    tmp, out = Path(tmp), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if out.exists() or out.is_symlink():
        if not replace:
            raise FileExistsError(f"{out} exists; nothing was replaced")
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return out
