"""Deterministic, endless text of the tiny world, in two domains and three splits.

    from ecomla.tinyworld.corpus import iter_documents
    for text in itertools.islice(iter_documents("stories", "train", seed=0), 1000): ...

Domains: `stories` (prose narratives) and `records` (registries, ledgers and
logs), each mixing the four skills of `threads.Skill`: recall, tracking,
counting and memorized facts. Splits: `train` (pretraining and distillation),
`calibration` (fitting low-rank bases), `heldout` (perplexity and eval items).

Document `index` of (domain, split, seed) is generated from its own
`random.Random`, seeded with a string naming all four, so documents can be
made in any order or in parallel, never repeat across splits or seeds, and
need no storage: the stream is as long as you read it. Generation is pure
Python (see `ecomla build tiny-world` --help for dumping it to JSONL).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, get_args

from ecomla.tinyworld import records, stories
from ecomla.tinyworld.threads import Cast, Layout, Skill, Step, Thread, interleave, render
from ecomla.tinyworld.world import World, default_world

Domain = Literal["stories", "records"]
Split = Literal["train", "calibration", "heldout"]
DOMAINS: tuple[Domain, ...] = get_args(Domain)
SPLITS: tuple[Split, ...] = get_args(Split)

_LAYOUT: dict[str, Layout] = {"stories": "prose", "records": "lines"}
_MODULES = {"stories": stories, "records": records}
# How often each skill's threads appear; stories state facts in passing, records in bulk.
_SKILL_WEIGHTS = {
    "stories": {Skill.RECALL: 1.0, Skill.TRACKING: 2.0, Skill.COUNTING: 1.0, Skill.FACTS: 1.0},
    "records": {Skill.RECALL: 1.0, Skill.TRACKING: 2.0, Skill.COUNTING: 1.0, Skill.FACTS: 1.0},
}


def check_domain(domain: str) -> Domain:
    if domain not in DOMAINS:
        raise ValueError(f"domain {domain!r} is not one of {', '.join(DOMAINS)}")
    return domain  # type: ignore[return-value]


def check_split(split: str) -> Split:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


@dataclass
class Document:
    """A rendered document and how it was built (eval items cut it at a probe)."""

    text: str
    steps: list[tuple[int, Step]]  # (thread index, step); -1 marks the opening and ending lines
    threads: list[Thread]
    offsets: list[int]  # per step: where its answer starts in `text` (see threads.render)


def compose(
    rng: random.Random,
    world: World,
    domain: str,
    n_threads: int,
    *,
    first: Skill | None = None,
    ending: bool = True,
    without: frozenset[Skill] = frozenset(),
) -> Document:
    """One document of `n_threads` skill threads (thread 0 has skill `first` when given; none of `without`)."""
    module = _MODULES[check_domain(domain)]
    cast = Cast.draw(rng, world)
    if first is not None and first in without:
        raise ValueError(f"compose: first={first.value} is also in without; drop it from one of them")
    weights = {k: w for k, w in _SKILL_WEIGHTS[domain].items() if k not in without}
    if not weights:
        raise ValueError(f"compose: without={sorted(s.value for s in without)} leaves no skill for {domain} threads")
    skills = [first] if first is not None else []
    skills += rng.choices(list(weights), weights=list(weights.values()), k=n_threads - len(skills))
    threads = [rng.choice(module.THREADS[skill])(rng, world, cast) for skill in skills]
    if domain == "stories":
        threads += [stories.filler(rng, cast) for _ in range(rng.randint(1, 4))]
    steps: list[tuple[int, Step]] = [(-1, module.opening(rng, cast))]
    steps += interleave(threads, rng)
    # A list read back right after it is written: the plainest copying there is (see list_document)
    for _ in range(rng.randint(0, 2)):
        at = rng.randint(1, len(steps))
        steps[at:at] = [(-1, step) for step in module.readback(rng, cast)]
    if ending and domain == "stories" and rng.random() < 0.5:
        steps.append((-1, stories.ending(rng)))
    text, offsets = render([s for _, s in steps], _LAYOUT[domain], rng)
    return Document(text, steps, threads, offsets)


def document_rng(domain: str, split: str, seed: int, index: int) -> random.Random:
    """The generator of one document; the string seed keeps every (domain, split, seed, index) apart."""
    return random.Random(f"tinyworld/{check_split(split)}/{seed}/{check_domain(domain)}/{index}")


# Share of documents that are lists read back (list_document): plain copying, the first thing a model must
# learn before any context skill. Without them, read-back lists barely got easier (NLL 2.7 -> 2.2 per token)
# after 2,000 steps of a 1.25M-parameter model; they are still not enough for the key -> value probes.
LIST_SHARE = 1 / 3


def list_document(rng: random.Random, world: World, domain: str) -> Document:
    """A few lists, each read back word for word right after it is written."""
    module = _MODULES[check_domain(domain)]
    cast = Cast.draw(rng, world)
    steps: list[tuple[int, Step]] = [(-1, module.opening(rng, cast))]
    for _ in range(rng.randint(2, 4)):
        steps += [(-1, step) for step in module.readback(rng, cast, long=True)]
    text, offsets = render([s for _, s in steps], _LAYOUT[domain], rng)
    return Document(text, steps, [], offsets)


def document(
    domain: str, split: str, seed: int, index: int, world: World | None = None, without: frozenset[Skill] = frozenset()
) -> str:
    """Document `index` of a stream: the same text every time, in any order.

    `without` leaves those skills' threads out (the zoo's base first learns to
    copy on text without tracking; see recipes/pretrain/tiny_base.yaml).
    """
    rng = document_rng(domain, split, seed, index)
    world = world or default_world()
    if rng.random() < LIST_SHARE:
        return list_document(rng, world, domain).text
    return compose(rng, world, domain, rng.randint(2, 5), without=without).text


def iter_documents(
    domain: str,
    split: str,
    seed: int = 0,
    *,
    start: int = 0,
    world: World | None = None,
    without: frozenset[Skill] = frozenset(),
) -> Iterator[str]:
    """The endless stream of documents of one domain and split, from document `start` on."""
    check_domain(domain), check_split(split)
    world = world or default_world()
    for index in itertools.count(start):
        yield document(domain, split, seed, index, world, without)


def iter_mixed(split: str, seed: int = 0, *, start: int = 0, world: World | None = None) -> Iterator[str]:
    """Both domains alternating (stories, records, stories, ...): the pretraining mix."""
    world = world or default_world()
    for index in itertools.count(start):
        for domain in DOMAINS:
            yield document(domain, split, seed, index, world)


def iter_texts(split: str, domain: str | None = None) -> Iterator[str]:
    """The stream a dataset key `tinyworld:SPLIT[:DOMAIN]` names (see `ecomla.data.text.CORPORA`)."""
    return iter_documents(domain, split) if domain is not None else iter_mixed(split)
