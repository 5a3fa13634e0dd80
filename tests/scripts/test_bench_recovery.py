"""scripts/bench_recovery.py on a tiny random Llama: students of two presets and several recipes (one of two
stages, ILD then KD), measured along their distillation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ecomla.distill.runtime import solo_env
from tests.scripts.test_oneshot_table import ROOT


def _cmd(src, out, *extra):
    return [sys.executable, str(ROOT / "scripts" / "bench_recovery.py"), "--model", str(src), "--out", str(out),
            "--budget", "16+8", "--tokens", "1536", "--measure-every", "512", "--global-batch-tokens", "256",
            "--micro-batch-size", "2", "--lr", "3e-4", "--calibration-tokens", "1024", "--eval-tokens", "512",
            "--seq-len", "128", "--train-documents", "12", *extra]


def _run(cmd, timeout=900):
    # not this process's RANK/MASTER_PORT, if an earlier test set them
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=solo_env())


@pytest.mark.slow
def test_presets_and_recipes_are_distilled_and_measured_along_the_way(source_factory, tmp_path):
    src = source_factory("llama")
    out = tmp_path / "o"
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text(" ".join(f"The {w} clause applies to every licensee." for w in range(400)))
    proc = _run(_cmd(src, out, "--recipes", "kd-frozen-basis", "ild>kd", "--other-text", str(other)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "curves.json").read_text())
    assert [c["name"] for c in result["curves"]] == ["xecomla kd-frozen-basis", "xecomla ild>kd",
                                                     "best kd-frozen-basis", "best ild>kd"]
    for c in result["curves"]:
        assert [p["tokens"] for p in c["points"]] == [0, 512, 1024, 1536]
        kl = [(p["prose"]["kl"] + p["code"]["kl"]) for p in c["points"]]
        assert kl[-1] < kl[0], (c["name"], kl)  # closer to the source; best's linear latent trains
        assert c["tokens_per_s"] > 0 and c["train_seconds"] > 0
    two = result["curves"][3]
    assert [s["share"] for s in two["stages"]] == [0.25, 0.75]
    stage0 = [json.loads(x) for x in (out / "best" / "ild-then-kd" / "stage0" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] == r["ild"] for r in stage0 if not r.get("final_eval"))  # ILD alone first
    stage1 = (out / "best" / "ild-then-kd" / "stage1" / "ecomla_recipe.yaml").read_text()
    assert "stage0/final" in stage1  # the second stage starts from the first's final/
    assert "reaches best kd-frozen-basis" not in (out / "table.md").read_text()  # the baseline is the first curve
    assert "reaches xecomla kd-frozen-basis's final perplexity" in (out / "table.md").read_text()
    assert result["other"]["source"] > 0 and set(result["other"]["start"]) == {"xecomla", "best"}
    assert all(c["other"]["tokens"] == 1536 and c["other"]["perplexity"] > 0 for c in result["curves"])
    assert "text of another kind" in (out / "table.md").read_text()
    assert (out / "chart.png").stat().st_size > 10_000
    (out / "table.md").unlink()
    again = _run(_cmd(src, out, "--report-only"), timeout=300)
    assert again.returncode == 0 and "1.2x the source" in (out / "table.md").read_text(), again.stderr
    other = _run(_cmd(src, out, "--latent-norm", "normalize"), timeout=300)
    assert other.returncode == 2 and "other settings" in other.stderr, other.stderr[-2000:]
