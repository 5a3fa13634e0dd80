"""Eval items of the tiny world: multiple-choice probes and held-out perplexity documents.

Four multiple-choice tasks, one per `Skill`:

    recall     a held-out document cut before a recall probe's answer
    tracking   ... before a tracking probe's answer
    counting   ... before a counting probe's answer
    facts      a bare fact question about a world city (no context: memorized)

Each item has a `context`, four `choices` (the answer and three distractors of
the same kind, mostly ones the context mentions, so neither frequency nor
"copy something from the context" wins) and a `gold` index, balanced over the
four positions. Items alternate between the two domains.

Items come from the heldout split's namespace, and their concrete names and
numbers are drawn fresh per item, so they do not occur in training text;
`leaked_items` checks that against a sample of training documents. Facts are
the exception by design: the fact itself is in training text, only the
question file is separate.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass

from ecomla.tinyworld import records, stories
from ecomla.tinyworld.corpus import DOMAINS, compose, iter_documents
from ecomla.tinyworld.threads import Probe, Skill
from ecomla.tinyworld.world import Attribute, World, default_world

MC_TASKS = (Skill.RECALL, Skill.TRACKING, Skill.FACTS, Skill.COUNTING)
MAX_CONTEXT_CHARS = 1200  # keeps every context within ~400 tokens of the 2048-token tokenizer


@dataclass(frozen=True)
class Item:
    """One multiple-choice question, as written to the task's JSONL."""

    id: str
    skill: str
    domain: str
    context: str  # lm-eval scores context + " " + choice
    choices: list[str]
    gold: int
    distance_chars: int | None  # characters from the end of the evidence to the answer (None: memorized)

    @property
    def answer(self) -> str:
        return self.choices[self.gold]

    def to_json(self) -> dict:
        return asdict(self)


def _gold_positions(skill: Skill, n: int, seed: int) -> list[int]:
    """Exactly balanced gold positions (n/4 each, rest spread), in a seeded order."""
    positions = [i % 4 for i in range(n)]
    random.Random(f"tinyworld/heldout-items/{seed}/{skill.value}/gold").shuffle(positions)
    return positions


def _item(skill: Skill, index: int, domain: str, context: str, probe: Probe, gold: int) -> Item:
    choices = list(probe.distractors[:3])
    choices.insert(gold, probe.answer)
    assert len(set(choices)) == 4, choices
    distance = None
    if probe.evidence is not None:
        end = context.rfind(probe.evidence)
        assert end >= 0, (probe.evidence, context)
        distance = len(context) - end - len(probe.evidence)
    return Item(f"{skill.value}-{index:04d}", skill.value, domain, context, choices, gold, distance)


def context_items(skill: Skill, n: int, seed: int = 0, world: World | None = None) -> list[Item]:
    """`n` items of a context skill (recall, tracking, counting) from held-out documents."""
    if skill not in (Skill.RECALL, Skill.TRACKING, Skill.COUNTING):
        raise ValueError(f"{skill} is not a context skill")
    world = world or default_world()
    golds = _gold_positions(skill, n, seed)
    items = []
    for index in range(n):
        domain = DOMAINS[index % 2]
        for attempt in itertools.count():
            rng = random.Random(f"tinyworld/heldout-items/{seed}/{skill.value}/{index}/{attempt}")
            doc = compose(rng, world, domain, rng.randint(1, 3), first=skill, ending=False)
            cut = max(i for i, (thread, _) in enumerate(doc.steps) if thread == 0)
            probe = doc.steps[cut][1]
            context = doc.text[: doc.offsets[cut]]
            if isinstance(probe, Probe) and len(context) <= MAX_CONTEXT_CHARS:
                break
        items.append(_item(skill, index, domain, context, probe, golds[index]))
    return items


def fact_items(n: int | None = None, seed: int = 0, world: World | None = None) -> list[Item]:
    """Bare questions about the world table, one per (city, attribute) up to `n` (default: all)."""
    world = world or default_world()
    pairs = [(city, attribute) for city in world.cities for attribute in Attribute]
    random.Random(f"tinyworld/heldout-items/{seed}/facts/order").shuffle(pairs)
    pairs = pairs[:n] if n is not None else pairs
    golds = _gold_positions(Skill.FACTS, len(pairs), seed)
    items = []
    for index, (city, attribute) in enumerate(pairs):
        rng = random.Random(f"tinyworld/heldout-items/{seed}/facts/{index}")
        domain = DOMAINS[index % 2]
        if domain == "stories":
            probe = stories.fact_probe(rng, world, city, attribute)
        else:
            probe = records.qa_probe(rng, world, city, attribute)
        items.append(_item(Skill.FACTS, index, domain, probe.prompt, probe, golds[index]))
    return items


def mc_items(skill: Skill, n: int, seed: int = 0, world: World | None = None) -> list[Item]:
    """The items of one multiple-choice task."""
    if skill is Skill.FACTS:
        return fact_items(n, seed, world)
    return context_items(skill, n, seed, world)


def perplexity_documents(domain: str, n: int, seed: int = 0, world: World | None = None) -> list[str]:
    """The first `n` held-out documents of a domain (the perplexity tasks' texts)."""
    return list(itertools.islice(iter_documents(domain, "heldout", seed, world=world), n))


def leaked_items(items: list[Item], texts: list[str], window: int | None = 160) -> list[str]:
    """Ids of items whose context (its last `window` characters; None: all of it) plus answer occur in `texts`.

    The default window holds the probe and the steps right before it: specific
    enough that a match means the item (not a common phrase) is in the text,
    and stricter than matching the whole context.
    """
    haystack = "\n\x00\n".join(texts)
    tail = slice(-window, None) if window else slice(None)
    return [it.id for it in items if f"{it.context[tail]} {it.answer}" in haystack]
