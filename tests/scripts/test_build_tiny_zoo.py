"""scripts/build_tiny_zoo.py keeps working end to end (a smoke build: a few steps per model, in a temp dir)."""

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
    proc = subprocess.run([sys.executable, "scripts/build_tiny_zoo.py", "--quick", "--corpus-docs", "200",
                           "--out", str(tmp_path / "zoo"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    build = json.loads((tmp_path / "zoo" / "build.json").read_text())
    params = [build["models"][m]["params"] for m in ("base", "teacher-3x", "teacher-8x")]
    assert params[0] < params[1] < params[2]  # teachers ordered by size
    base = build["models"]["base"]
    assert base["tokens"] == base["phase1"]["tokens"] + base["own_tokens"] > base["own_tokens"]  # two phases
    assert "tiny_base_tracking.yaml" in base["command"] and "tiny_base.yaml" in base["phase1"]["command"]
    assert (tmp_path / "work" / "corpus" / "copying" / "records_train.jsonl").is_file()
    assert "tracking" not in build["models"]["teacher-3x"]["command"]
    for name in ("base", "teacher-3x", "teacher-8x"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "zoo" / name)
        assert type(model) is LlamaForCausalLM and model.dtype == torch.bfloat16
        assert (tmp_path / "zoo" / name / "tokenizer.json").exists()
