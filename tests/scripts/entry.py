"""Run one of the README's entry-point scripts (scripts/*.sh) from a copy under a test's temporary directory.

The copy holds the script, the set-up and environment scripts it calls, pyproject.toml (for set-up's stamp) and
the recipes it names; `.venv` links to the checkout's. Set-up must already be current (`setup.sh --check`), so
running the script installs nothing, and what the script writes (a fetched model, caches) lands in the copy.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_is_current() -> bool:
    """setup.sh's own answer (`--check`): would it install anything?"""
    return subprocess.run(["bash", "scripts/setup.sh", "--check"], cwd=ROOT, capture_output=True).returncode == 0


def run_entry(tmp: Path, script: str, recipes: list[str], *args: str) -> subprocess.CompletedProcess:
    assert setup_is_current(), "set-up is not current: run `bash scripts/setup.sh` (scripts/test.sh runs it) first"
    for rel in ("pyproject.toml", "scripts/setup.sh", "scripts/env.sh", script, *recipes):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp / rel)
    (tmp / ".venv").symlink_to(ROOT / ".venv")
    return subprocess.run(["bash", script, *args], cwd=tmp, capture_output=True, text=True, timeout=900)
