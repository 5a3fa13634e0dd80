"""The lm-eval tasks in eval/tasks/tinyworld, run the way users run them.

Proves: lm-eval 0.4.13 indexes every task, the `tinyworld` tag and the
`tinyworld_mc` group from eval/tasks with its defaults off; and a tiny random
Llama evaluated from an unrelated working directory (so nothing depends on
the cwd) gets acc/acc_norm in [0, 1] on the multiple-choice tasks, finite
perplexities on the rolling ones, and a group mean of the four.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ecomla.tinyworld.taskfiles import GROUP, TAG, task_names

MC_METRICS = ("acc,none", "acc_norm,none")
PPL_METRICS = ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")

TASKS_DIR = Path(__file__).resolve().parents[2] / "eval" / "tasks"


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def tiny_lm(tinyworld_tokenizer):
    from lm_eval.models.huggingface import HFLM
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tinyworld_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    return HFLM(pretrained=LlamaForCausalLM(config).eval(), tokenizer=tinyworld_tokenizer, batch_size=16)


def test_every_task_the_tag_and_the_group_are_indexed(task_manager):
    names = set(task_manager.all_tasks)
    assert set(task_names()) | {TAG, GROUP} <= names


def test_tasks_run_from_any_working_directory(task_manager, tiny_lm, tmp_path, monkeypatch):
    import lm_eval

    monkeypatch.chdir(tmp_path)
    results = lm_eval.simple_evaluate(model=tiny_lm, tasks=[TAG], task_manager=task_manager, limit=10)["results"]
    assert set(results) == set(task_names())
    for name in task_names():
        metrics = results[name]
        if "_ppl_" in name:
            assert all(math.isfinite(metrics[m]) and metrics[m] > 0 for m in PPL_METRICS), metrics
        else:
            assert all(0.0 <= metrics[m] <= 1.0 for m in MC_METRICS), metrics
            assert metrics["sample_len"] == 10


def test_group_averages_the_four_multiple_choice_tasks(task_manager, tiny_lm, tmp_path, monkeypatch):
    import lm_eval

    monkeypatch.chdir(tmp_path)
    out = lm_eval.simple_evaluate(model=tiny_lm, tasks=[GROUP], task_manager=task_manager, limit=4)
    members = [n for n in task_names() if "_ppl_" not in n]
    assert set(out["results"]) == set(members) | {GROUP}
    mean = sum(out["results"][n]["acc,none"] for n in members) / len(members)
    assert out["results"][GROUP]["acc,none"] == pytest.approx(mean)
