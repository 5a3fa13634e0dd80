"""scripts/bench_init.py on a tiny random Llama: every preset at two budgets in one run, and a rerun that reuses them.

Proves: each preset converts (its expansion recorded), is measured on both pytext domains against the source,
and the wider latent of the same preset is no worse on KL; a rerun reuses every cell.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.scripts.test_oneshot_table import ROOT, run_small


def _run(src, out):
    return run_small(src, out, "bench_init.py")


def test_every_preset_at_every_budget_then_a_rerun_reuses_them(source_factory, tmp_path):
    from ecomla.convert.presets import PRESET_NAMES

    src = source_factory("llama")  # 2 KV heads of 16: 64 cached numbers per token and layer
    proc = _run(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    rows = {(r["preset"], r["budget"]): r for r in table["rows"]}
    assert set(rows) == {(name, b) for name in PRESET_NAMES for b in ("16+8", "64+8")}
    for name in PRESET_NAMES:
        small, wide = rows[(name, "16+8")], rows[(name, "64+8")]
        assert small["compression"] == 64 / 24 and wide["compression"] == 64 / 72
        for domain in ("prose", "code"):
            assert wide[domain]["source_perplexity"] == table["source"][domain]
            assert 0 < wide[domain]["kl_source_to_converted"] <= small[domain]["kl_source_to_converted"] * 1.05
    assert table["wall_seconds"] > 0
    assert "| 16+8 |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "chart.png").stat().st_size > 10_000
    assert not (tmp_path / "out" / "ckpt").exists()
    again = _run(src, tmp_path / "out")
    assert again.returncode == 0 and again.stdout.count(": reused") == len(rows)


def test_ablate_converts_best_without_each_lever(source_factory, tmp_path):
    from ecomla.convert.presets import BEST_LEVERS

    src = source_factory("llama")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_init.py"), "--model", str(src), "--out", str(tmp_path / "o"),
           "--presets", "best", "--ablate", "--budgets", "16+8", "--calibration-tokens", "1024", "--eval-tokens",
           "512", "--seq-len", "128"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["preset"]: r for r in json.loads((tmp_path / "o" / "table.json").read_text())["rows"]}
    assert set(rows) == {"best"} | {f"best-no-{lever}" for lever in BEST_LEVERS}
    kl = {name: r["prose"]["kl_source_to_converted"] for name, r in rows.items()}
    assert len(set(kl.values())) == len(kl), kl  # every lever changes the conversion


def test_ablate_refuses_a_budget_the_run_does_not_convert(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_init.py"), "--model", str(tmp_path / "none"), "--out",
           str(tmp_path / "o"), "--budgets", "16+8", "--ablate", "12+8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert "--ablate 12+8: not among --budgets" in proc.stderr
    assert not (tmp_path / "o").exists()
