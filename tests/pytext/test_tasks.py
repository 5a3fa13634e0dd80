"""The Python-text lm-eval tasks in eval/tasks/pytext: committed as built, held-out only, runnable anywhere.

Proves: a fresh build gives the committed bytes (on the Python they come from); every multiple-choice item
has 4 distinct choices, the gold among them, and comes from a held-out document whose text no calibration or
train document contains; distractors come from other documents; and lm-eval runs every task and the group
with a tiny random Llama from an unrelated working directory.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ecomla.pytext.corpus import BUILT_ON, documents, python_version, split_of
from ecomla.pytext.tasks import GROUP, ITEMS, MC_TASKS, PPL_TASKS, TAG

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "eval" / "tasks" / "pytext"


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.skipif(python_version() != BUILT_ON, reason=f"the committed tasks are built from Python {BUILT_ON}")
def test_a_fresh_build_gives_the_committed_files():
    out = subprocess.run([sys.executable, "-m", "ecomla", "build", "pytext-tasks", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "identical", out.stdout + out.stderr


@pytest.mark.parametrize("task", MC_TASKS)
def test_items_are_well_formed_and_held_out(task):
    rows = _rows(task)
    assert len(rows) == ITEMS >= 500
    domain = "prose" if "prose" in task else "code"
    for row in rows:
        assert len(set(row["choices"])) == 4 and 0 <= row["gold"] < 4
        assert split_of(domain, row["source"]) == "heldout"
    golds = [r["gold"] for r in rows]
    assert all(golds.count(g) > len(rows) // 8 for g in range(4))  # the right answer is not always in one place


@pytest.mark.parametrize("task", MC_TASKS)
def test_no_item_appears_in_calibration_or_train_text(task):
    domain = "prose" if "prose" in task else "code"
    seen = "\n".join(d.text for split in ("calibration", "train") for d in documents(domain, split))
    rows = _rows(task)[::5]
    leaked = [r["id"] for r in rows if r["context"].strip() and (r["context"] + r["choices"][r["gold"]]) in seen]
    assert not leaked


def test_distractors_come_from_other_documents():
    def norm(text: str) -> str:  # prose sentences are read across line breaks
        return " ".join(text.split())

    prose = {d.name: norm(d.text) for d in documents("prose", "heldout")}
    for row in _rows(MC_TASKS[0])[::25]:
        own = prose[row["source"]]
        others = [norm(c) for i, c in enumerate(row["choices"]) if i != row["gold"]]
        assert norm(row["choices"][row["gold"]]) in own, row["id"]
        assert all(c not in own for c in others), row["id"]


@pytest.fixture(scope="module")
def tiny_lm(tokenizer_dir):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return HFLM(pretrained=LlamaForCausalLM(config).eval(), tokenizer=tok, batch_size=16, max_length=4096)


def test_tasks_and_group_run_from_any_working_directory(tiny_lm, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    assert set(MC_TASKS) | set(PPL_TASKS.values()) | {TAG, GROUP} <= set(manager.all_tasks)
    results = lm_eval.simple_evaluate(model=tiny_lm, tasks=[GROUP, *PPL_TASKS.values()],
                                     task_manager=manager, limit=6)["results"]
    for name in MC_TASKS:
        assert 0.0 <= results[name]["acc,none"] <= 1.0 and results[name]["sample_len"] == 6
    for name in PPL_TASKS.values():
        assert math.isfinite(results[name]["word_perplexity,none"]) and results[name]["word_perplexity,none"] > 1
    assert GROUP in results
