"""scripts/oneshot_table.py on a tiny random Llama: every recipe at a budget, one table, and a resumable rerun.

Proves: each recipe, with each latent norm, converts and is measured on both pytext domains against the source
(the source against itself agrees exactly); the wider latent of the same recipe is no worse on KL; a rerun reuses every cell,
and --table-only rebuilds the same table from the cells alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_small(src: Path, out: Path, script: str = "oneshot_table.py") -> subprocess.CompletedProcess:
    """The script at two tiny budgets (16+8, 64+8) with little calibration and held-out text."""
    cmd = [sys.executable, str(ROOT / "scripts" / script), "--model", str(src), "--out", str(out),
           "--budgets", "16+8", "64+8", "--calibration-tokens", "1024", "--eval-tokens", "512", "--seq-len", "128"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)


@pytest.mark.slow
def test_every_recipe_at_every_budget_then_a_rerun_reuses_them(source_factory, tmp_path):
    from scripts.oneshot_table import LATENT_NORMS, RECIPES

    src = source_factory("llama")  # 2 KV heads of 16: 64 cached numbers per token and layer
    proc = run_small(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    rows = {(r["recipe"], r["latent_norm"], r["budget"]): r for r in table["rows"]}
    assert set(rows) == {(name, norm, b) for name in RECIPES for norm in LATENT_NORMS for b in ("16+8", "64+8")}
    for name, norm in ((name, norm) for name in RECIPES for norm in LATENT_NORMS):
        small, wide = rows[(name, norm, "16+8")], rows[(name, norm, "64+8")]
        assert small["compression"] == 64 / 24 and wide["compression"] == 64 / 72
        for domain in ("prose", "code"):
            assert wide[domain]["source_perplexity"] == table["source"][domain]
            assert 0 < wide[domain]["kl_source_to_converted"] <= small[domain]["kl_source_to_converted"] * 1.05
    assert (tmp_path / "out" / "chart.png").stat().st_size > 10_000
    assert not (tmp_path / "out" / "ckpt").exists()
    again = run_small(src, tmp_path / "out")
    assert again.returncode == 0 and again.stdout.count(": reused") == len(rows)
    md = (tmp_path / "out" / "table.md").read_text()
    assert md.count("| yes |") + md.count("| **no** |") == len(RECIPES) * len(LATENT_NORMS)  # one trend per chain
    assert "Rank at each ratio" in md
    (tmp_path / "out" / "table.md").unlink()
    cmd = [sys.executable, str(ROOT / "scripts" / "oneshot_table.py"), "--model", str(src), "--out",
           str(tmp_path / "out"), "--table-only"]
    assert subprocess.run(cmd, capture_output=True, cwd=ROOT).returncode == 0
    assert (tmp_path / "out" / "table.md").read_text() == md


def test_the_trend_table_says_no_where_any_step_of_compression_lowers_the_error():
    from scripts.oneshot_table import ranking, trends

    def row(name, norm, r_kv, kl_prose, kl_code):
        return {"recipe": name, "latent_norm": norm, "budget": f"{r_kv}+32", "qk_rope_head_dim": 32,
                "compression": 384 / (r_kv + 32), "prose": {"kl_source_to_converted": kl_prose},
                "code": {"kl_source_to_converted": kl_code}}

    rows = [row("xecomla", "normalize", 160, 11.6, 12.1), row("xecomla", "normalize", 64, 10.4, 10.9),
            row("xecomla", "linear", 160, 5.6, 5.9), row("xecomla", "linear", 64, 7.0, 7.5),
            row("act_high_mean", "linear", 160, 3.0, 3.0), row("act_high_mean", "linear", 64, 3.5, 2.9)]
    lines = {(ln.split(" | ")[0][2:], ln.split(" | ")[1]): ln.rstrip(" |").split(" | ")[-1]
             for ln in trends(rows) if ln.startswith("| ") and "recipe" not in ln}
    assert lines == {("xecomla", "normalize"): "**no**", ("xecomla", "linear"): "yes",
                     ("act_high_mean", "linear"): "**no**"}  # code KL fell from 3.0 to 2.9
    ranks = ranking(rows)
    assert ranks[-1].startswith("- 4.00×: 1. act_high_mean linear 64+32 (3.20), 2. xecomla linear 64+32 (7.25)")
