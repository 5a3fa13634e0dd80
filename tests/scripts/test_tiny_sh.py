"""scripts/tiny.sh, the README's one command for the main job: set-up, then `ecomla run` on the tiny recipe.

The whole job takes ~12 minutes (the README's table comes from it); here `--help` goes through the same
script, set-up check included, and proves the command line it ends in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_sh_sets_up_and_hands_its_arguments_to_ecomla_run():
    proc = subprocess.run(["bash", "scripts/tiny.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ecomla run")
    assert "recipes/xecomla_tiny.yaml" in (ROOT / "scripts" / "tiny.sh").read_text()
    assert (ROOT / "recipes" / "xecomla_tiny.yaml").is_file()
