"""scripts/bench_recovery.py on a tiny random Llama: two presets' students, measured along their distillation."""

from __future__ import annotations

import json
import subprocess
import sys

from ecomla.distill.runtime import solo_env
from tests.scripts.test_oneshot_table import ROOT


def _cmd(src, out, *extra):
    return [sys.executable, str(ROOT / "scripts" / "bench_recovery.py"), "--model", str(src), "--out", str(out),
            "--budget", "16+8", "--tokens", "1536", "--measure-every", "512", "--global-batch-tokens", "256",
            "--micro-batch-size", "2", "--lr", "3e-4", "--calibration-tokens", "1024", "--eval-tokens", "512",
            "--seq-len", "128", "--train-documents", "12", *extra]


def test_two_presets_are_distilled_and_measured_along_the_way(source_factory, tmp_path):
    src = source_factory("llama")
    proc = subprocess.run(_cmd(src, tmp_path / "o"), capture_output=True, text=True, cwd=ROOT, timeout=900,
                          env=solo_env())  # not this process's RANK/MASTER_PORT, if an earlier test set them
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "o" / "curves.json").read_text())
    assert [c["preset"] for c in result["curves"]] == ["xecomla", "best"]
    for c in result["curves"]:
        assert [p["tokens"] for p in c["points"]] == [0, 512, 1024, 1536]
        kl = [(p["prose"]["kl"] + p["code"]["kl"]) for p in c["points"]]
        assert kl[-1] < kl[0], (c["preset"], kl)  # closer to the source; for best, its linear latent trains
        assert len(c["kd_loss"]) == 6 and c["kd_tokens_per_s"] > 0
    assert "reaches" in (tmp_path / "o" / "table.md").read_text()
    assert (tmp_path / "o" / "chart.png").stat().st_size > 10_000
    assert (tmp_path / "o" / "best" / "distill" / "final" / "config.json").is_file()
    (tmp_path / "o" / "table.md").unlink()
    again = subprocess.run(_cmd(src, tmp_path / "o", "--report-only"), capture_output=True, text=True, cwd=ROOT,
                           timeout=300, env=solo_env())
    assert again.returncode == 0 and "1.2x the source" in (tmp_path / "o" / "table.md").read_text(), again.stderr
    other = subprocess.run(_cmd(src, tmp_path / "o", "--latent-norm", "normalize"), capture_output=True, text=True,
                           cwd=ROOT, timeout=300, env=solo_env())
    assert other.returncode == 2 and "other settings" in other.stderr, other.stderr[-2000:]
