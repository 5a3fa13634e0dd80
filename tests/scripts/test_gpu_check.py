"""scripts/gpu_check.sh in its CPU mode: the prepared GPU check parses, installs nothing, and runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ecomla.distill.runtime import solo_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_in_cpu_mode(tmp_path):
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**solo_env(), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(script), "--cpu"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "pip install" not in proc.stdout + proc.stderr  # the CPU mode installs nothing
    distill = json.loads((tmp_path / "out" / "distill.json").read_text())
    assert distill["mode"] == "cpu" and [r["zero_stage"] for r in distill["runs"]] == [2, 3]
    for run in distill["runs"]:
        assert run["tokens_per_s"] > 0 and run["peak_memory_gib"] > 0 and run["flops_per_token"] > 0
        assert run["mfu"] is None  # no peak FLOP/s for a CPU
    decode = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert decode["rows"] and not (tmp_path / "out" / "work").exists()


def test_flops_per_token_counts_every_matmul_parameter(tmp_path):
    """MFU's numerator: the parameters a token multiplies through are every Linear weight and the (tied) head,
    for the Llama and for its MLA conversion."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from scripts.bench_gpu import SHAPES, flops_per_token, llama_config, matmul_params
    from tests.convert.helpers import convert

    cfg = llama_config("tiny")
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    llama.save_pretrained(tmp_path / "llama")
    r_kv, d_r = SHAPES["tiny"][1]
    convert(tmp_path / "llama", tmp_path / "mla", mla={"kv_lora_rank": r_kv, "qk_rope_head_dim": d_r},
            init={"method": "svd"})
    for path in (tmp_path / "llama", tmp_path / "mla"):
        model = AutoModelForCausalLM.from_pretrained(path)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        config = json.loads((path / "config.json").read_text())
        assert matmul_params(config) == linear, path.name  # lm_head is a Linear sharing the embedding's weight
    both = [json.loads((tmp_path / p / "config.json").read_text()) for p in ("mla", "llama")]
    assert flops_per_token(*both, 64) > 6 * matmul_params(both[0]) + 2 * matmul_params(both[1])  # attention too
