"""`ecomla.tinyworld.items` and the committed task files in eval/tasks/tinyworld.

Proves: each multiple-choice task has >= 500 items with four distinct choices
and an exactly balanced gold index; the context tasks are answerable from
their context, which mentions the distractors too (tracking, recall); the
evidence sits at varied distances; the committed files are what the generator
writes today; and no recall/tracking/counting item occurs in 3,000 training
documents, while the check itself does flag an item cut from training text.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from ecomla.tinyworld.items import MAX_CONTEXT_CHARS, MC_TASKS, Item, leaked_items, mc_items
from ecomla.tinyworld.taskfiles import mc_task_name, task_names, write_tasks
from ecomla.tinyworld.threads import Skill
from ecomla.tinyworld.world import default_world

TINYWORLD = Path(__file__).resolve().parents[2] / "eval" / "tasks" / "tinyworld"


def committed(name: str) -> list[dict]:
    with open(TINYWORLD / f"{name}.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("skill", MC_TASKS, ids=lambda s: s.value)
def test_committed_mc_tasks_are_big_balanced_and_well_formed(skill):
    rows = committed(mc_task_name(skill))
    assert len(rows) >= 500
    golds = Counter(r["gold"] for r in rows)
    assert set(golds) == {0, 1, 2, 3} and max(golds.values()) - min(golds.values()) <= 1
    for r in rows:
        assert len(r["choices"]) == 4 and len(set(r["choices"])) == 4
        assert r["context"] and not r["context"].endswith(" ") and len(r["context"]) <= MAX_CONTEXT_CHARS
    assert Counter(r["domain"] for r in rows) == {"stories": len(rows) // 2, "records": len(rows) - len(rows) // 2}


@pytest.mark.parametrize("skill", [Skill.RECALL, Skill.TRACKING], ids=lambda s: s.value)
def test_answer_and_distractors_are_in_the_context(skill):
    rows = committed(mc_task_name(skill))
    for r in rows:
        assert r["choices"][r["gold"]] in r["context"]
    all_mentioned = sum(all(c in r["context"] for c in r["choices"]) for r in rows)
    assert all_mentioned >= 0.95 * len(rows)  # copying something from the context is not enough


@pytest.mark.parametrize("skill", [Skill.RECALL, Skill.TRACKING, Skill.COUNTING], ids=lambda s: s.value)
def test_evidence_sits_at_varied_distances(skill):
    distances = sorted(r["distance_chars"] for r in committed(mc_task_name(skill)))
    tenth, ninetieth = distances[len(distances) // 10], distances[-len(distances) // 10]
    assert distances[0] >= 0 and tenth < 100 and ninetieth > 300  # a few words to a few hundred tokens back


def test_facts_ask_every_fact_of_the_table_without_context():
    rows = committed(mc_task_name(Skill.FACTS))
    world = default_world()
    assert len(rows) == 4 * len(world.cities)
    by_name = {c.name: c for c in world.cities}
    asked = Counter()
    for r in rows:
        (city,) = [by_name[w] for w in re.findall(r"\w+", r["context"]) if w in by_name]
        assert r["choices"][r["gold"]] in (city.country, city.river, city.founder, city.goods)
        assert r["distance_chars"] is None
        asked[city.name] += 1
    assert set(asked.values()) == {4}


def test_committed_files_are_what_the_generator_writes(tmp_path):
    written = write_tasks(tmp_path)
    on_disk = {p.name for p in TINYWORLD.iterdir() if p.suffix in (".yaml", ".jsonl")}
    assert {p.name for p in written} == on_disk
    for path in written:
        assert path.read_bytes() == (TINYWORLD / path.name).read_bytes(), (
            f"{path.name} is stale: rerun `ecomla build tiny-world`"
        )
    assert {p.stem for p in written if p.suffix == ".jsonl"} == set(task_names())


def test_no_eval_item_occurs_in_training_text(train_sample):
    texts = train_sample["stories"] + train_sample["records"]
    for skill in (Skill.RECALL, Skill.TRACKING, Skill.COUNTING):
        items = [Item(**r) for r in committed(mc_task_name(skill))]
        assert leaked_items(items, texts) == []


def test_the_leak_check_flags_an_item_cut_from_training_text(train_sample):
    text = train_sample["stories"][7]
    cut = text.index(" ", len(text) // 2)
    answer = text[cut + 1 :].split(" ")[0]
    fake = Item("fake-0", "recall", "stories", text[:cut], ["x", "y", "z", answer], 3, None)
    assert leaked_items([fake], train_sample["stories"]) == ["fake-0"]
    assert leaked_items([fake], train_sample["records"]) == []


def test_items_are_deterministic_and_fresh_per_seed():
    assert mc_items(Skill.RECALL, 20) == mc_items(Skill.RECALL, 20)
    other = {it.context for it in mc_items(Skill.RECALL, 20, seed=1)}
    assert not other & {it.context for it in mc_items(Skill.RECALL, 20)}
