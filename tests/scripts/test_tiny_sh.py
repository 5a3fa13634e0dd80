"""scripts/tiny.sh, the README's one command for the main job: set-up, then `ecomla run` on the tiny recipe.

The whole job takes ~12 minutes (the README's table comes from it); here `--help` goes through the same
script, set-up check included, from a copy under the test's temporary directory (tests/scripts/entry.py), and
proves the command line it ends in.
"""

from __future__ import annotations

from tests.scripts.entry import ROOT, run_entry


def test_tiny_sh_sets_up_and_hands_its_arguments_to_ecomla_run(tmp_path):
    proc = run_entry(tmp_path, "scripts/tiny.sh", ["recipes/xecomla_tiny.yaml"], "--help")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ecomla run")
    assert "recipes/xecomla_tiny.yaml" in (ROOT / "scripts" / "tiny.sh").read_text()
