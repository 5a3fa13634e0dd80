"""`ecomla build tiny-zoo` keeps working end to end (a smoke build: a few steps per model, in a temp dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_zoo_build(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "ecomla", "build", "tiny-zoo", "--quick", "--corpus-docs", "200",
                           "--out", str(tmp_path / "zoo"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    build = json.loads((tmp_path / "zoo" / "build.json").read_text())
    params = [build["models"][m]["params"] for m in ("base", "teacher-3x", "teacher-8x")]
    assert params[0] < params[1] < params[2]  # teachers ordered by size
    base = build["models"]["base"]
    assert base["tokens"] == base["phase1"]["tokens"] + base["own_tokens"] > base["own_tokens"]  # two phases
    assert "tiny_base_tracking.yaml" in base["command"] and "tiny_base.yaml" in base["phase1"]["command"]
    copying, train = tmp_path / "work" / "corpus" / "copying", tmp_path / "work" / "corpus" / "train"
    assert f"data.train.dataset={copying}" in base["phase1"]["command"]  # phase 1 on the text without tracking
    assert f"student={tmp_path / 'work' / 'zoo-runs' / 'base-copying' / 'final'}" in base["command"]  # continues it
    assert f"data.train.dataset={train}" in base["command"]
    parcel_status = ("Parcel", "parcel")  # records' tracking threads are parcels and staff offices
    assert any(p in (train / "records_train.jsonl").read_text() for p in parcel_status)
    assert not any(p in (copying / "records_train.jsonl").read_text() for p in parcel_status)
    for name in ("teacher-3x", "teacher-8x"):
        assert f"data.train.dataset={train}" in build["models"][name]["command"], name
        assert build["models"][name]["grown_from"] == "base"
    for name in ("base", "teacher-3x", "teacher-8x"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo" / name)
        assert type(model) is LlamaForCausalLM and model.dtype == torch.bfloat16
        assert (tmp_path / "zoo" / name / "tokenizer.json").exists()
    # --teachers-only: the base and its record stay, the teachers are retrained, the reused steps are listed
    base_bytes = (tmp_path / "zoo" / "base" / "model.safetensors").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "ecomla", "build", "tiny-zoo", "--quick", "--teachers-only",
                           "--out", str(tmp_path / "zoo"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    again = json.loads((tmp_path / "zoo" / "build.json").read_text())
    assert again["reused"] == ["base", "base-copying", "data"] and build["reused"] == []
    assert again["models"]["base"] == base and (tmp_path / "zoo" / "base" / "model.safetensors").read_bytes() == base_bytes
    assert {k: again["seconds"][k] for k in again["reused"]} == {k: build["seconds"][k] for k in again["reused"]}
    assert set(again["seconds"]) == set(build["seconds"])
    assert again["total_seconds"] == pytest.approx(sum(again["seconds"].values()), abs=0.2)


def test_teachers_only_needs_an_earlier_build(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ecomla", "build", "tiny-zoo", "--teachers-only",
                           "--out", str(tmp_path / "zoo"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--teachers-only reuses an earlier build" in proc.stderr and "build.json" in proc.stderr
    assert not (tmp_path / "zoo").exists() and not (tmp_path / "work").exists()  # nothing written


def test_teachers_only_refuses_a_build_record_without_the_two_base_phases(tmp_path):
    zoo, work = tmp_path / "zoo", tmp_path / "work"
    for path in (zoo / "base", work / "tokenizer", work / "corpus" / "train"):
        path.mkdir(parents=True)
    (zoo / "base" / "config.json").write_text("{}")
    old = {"quick": False, "seconds": {"data": 29.3, "base": 1625.5}, "models": {"base": {"tokens": 1}}}
    (zoo / "build.json").write_text(json.dumps(old))
    proc = subprocess.run([sys.executable, "-m", "ecomla", "build", "tiny-zoo", "--teachers-only", "--out", str(zoo),
                           "--work", str(work)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "has no record of base-copying" in proc.stderr
    assert json.loads((zoo / "build.json").read_text()) == old and not (work / "logs").exists()
