"""Threads, probes and how documents are woven from them.

A document is several *threads* interleaved. A thread is an ordered list of
steps about one thing (an object being moved around, a set of door codes, a
running count), each step a sentence (stories) or a line (records). Some steps
are *probes*: a prompt whose continuation is decided by earlier steps of the
same thread, e.g.

    prompt  "Nora opened the red door with the code"   answer "4817"   suffix "."

In training text a probe is written out in full (`prompt answer suffix`), so a
model learns to answer it by attending back to the step that stated the fact.
An eval item is the same document cut just before a probe's answer, with the
probe's distractors (wrong answers of the same kind, mostly mentioned in the
context) as the other choices. Training text and eval items therefore come
from one code path and share their exact format.

Interleaving threads puts other threads' steps between a fact and its probe,
which is what makes the distance to the evidence vary.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from ecomla.tinyworld.world import GOODS, NAMES, OBJECTS, City, World


class Skill(str, Enum):
    """What answering a thread's probes takes."""

    RECALL = "recall"  # in-context key -> value lookup, with other pairs as distractors
    TRACKING = "tracking"  # the latest state of an entity after several changes
    COUNTING = "counting"  # a running total over adds/removes, or a count of mentions
    FACTS = "facts"  # world facts memorized in pretraining (no in-context evidence)
    FILLER = "filler"  # scenery with no probe


@dataclass(frozen=True)
class Probe:
    """A step whose continuation (`answer`) is decided by the context."""

    prompt: str  # text up to the answer, no trailing space
    answer: str  # written after one space
    distractors: tuple[str, ...]  # wrong answers of the same kind, most confusable first
    suffix: str = "."  # text right after the answer
    evidence: str | None = None  # the earlier step text that settles the answer (None: memorized)

    @property
    def text(self) -> str:
        return f"{self.prompt} {self.answer}{self.suffix}"


Step = str | Probe
Layout = Literal["prose", "lines"]  # stories are sentences in paragraphs, records one entry per line


@dataclass
class Thread:
    """Steps about one thing, in order; the last one is usually a probe."""

    skill: Skill
    steps: list[Step] = field(default_factory=list)

    def add(self, step: Step) -> None:
        self.steps.append(step)


@dataclass(frozen=True)
class Cast:
    """Who and where a document is about, and which entities its threads have claimed."""

    people: tuple[str, ...]  # 4-5 distinct first names
    city: City  # the home city (its facts are true in the world table)
    claimed: dict[str, set[str]] = field(default_factory=dict, compare=False)  # kind -> entities in use

    @classmethod
    def draw(cls, rng: random.Random, world: World) -> Cast:
        return cls(tuple(rng.sample(NAMES, rng.randint(4, 5))), rng.choice(world.cities))

    def claim(
        self, rng: random.Random, kind: str, pool: Sequence[str], k: int, fallback: Sequence[str] = ()
    ) -> list[str]:
        """`k` distinct entities of `kind` no other thread of this document uses (from `pool`, then `fallback`).

        Two threads about the same door, parcel or person would state
        conflicting facts, leaving a probe with two right answers.
        """
        taken = self.claimed.setdefault(kind, set())
        picks: list[str] = []
        for source in (pool, fallback):
            free = [x for x in source if x not in taken and x not in picks]
            picks += rng.sample(free, min(k - len(picks), len(free)))
        if len(picks) < k:
            raise ValueError(f"only {len(picks)} free {kind} entities left, {k} asked")
        taken.update(picks)
        return picks


_NUMBERS = tuple(str(n) for n in range(10, 1000))


def list_items(rng: random.Random, k: int) -> list[str]:
    """`k` random entries of a list (names, things, goods and numbers mixed): nothing predicts them but a copy."""
    pools = (NAMES, OBJECTS, GOODS, _NUMBERS)
    return [rng.choice(rng.choice(pools)) for _ in range(k)]


def readback(
    rng: random.Random, say: Callable[[str], str], back: Callable[[str], str], long: bool = False
) -> tuple[str, str]:
    """A list written down and the step that reads it back word for word (placed right after it).

    The read-back is predictable only by copying from the context, the plainest
    signal a small model gets for learning to look back (the key -> value
    probes build on it). Neither step is a probe, so it never becomes an eval item.
    """
    # Entries are separated by spaces alone: after a comma every entry would follow the same token, and
    # copying would need a two-token match before a one-token one was ever learned.
    entries = " ".join(list_items(rng, rng.randint(12, 24) if long else rng.randint(6, 12)))
    return say(entries), back(entries)


def echo_probe(text: str, value: str, distractors: tuple[str, ...]) -> Probe:
    """The probe that repeats a statement's own words up to its value (the value comes after a space)."""
    cut = text.rfind(" " + value)
    assert cut > 0, (text, value)
    return Probe(text[:cut], value, distractors, suffix=text[cut + 1 + len(value) :], evidence=text)


def interleave(threads: list[Thread], rng: random.Random) -> list[tuple[int, Step]]:
    """A uniformly random merge of the threads' steps that keeps each thread's order.

    Returns (thread index, step) pairs. Drawing the next thread with probability
    proportional to its remaining steps makes every merge order equally likely.
    """
    cursors = [0] * len(threads)
    remaining = [len(t.steps) for t in threads]
    total = sum(remaining)
    out: list[tuple[int, Step]] = []
    for _ in range(total):
        pick = rng.randrange(sum(remaining))
        k = 0
        while pick >= remaining[k]:
            pick -= remaining[k]
            k += 1
        out.append((k, threads[k].steps[cursors[k]]))
        cursors[k] += 1
        remaining[k] -= 1
    return out


def render(steps: list[Step], layout: Layout, rng: random.Random) -> tuple[str, list[int]]:
    """Join steps into text; also return, per step, where its answer starts.

    For a probe the offset is the end of its prompt (the space before the answer
    comes after it), so `text[:offset]` is exactly the eval context. For a plain
    step it is the end of the step.
    """
    parts: list[str] = []
    offsets: list[int] = []
    length = 0
    for i, step in enumerate(steps):
        if i:
            sep = "\n" if layout == "lines" else ("\n\n" if rng.random() < 0.12 else " ")
            parts.append(sep)
            length += len(sep)
        if isinstance(step, Probe):
            offsets.append(length + len(step.prompt))
            parts.append(step.text)
            length += len(step.text)
        else:
            parts.append(step)
            length += len(step)
            offsets.append(length)
    return "".join(parts), offsets


def pick_distractors(
    answer: str, preferred: list[str], pool: list[str] | tuple[str, ...], rng: random.Random, n: int = 3
) -> tuple[str, ...]:
    """Distinct wrong answers, most confusable first: all of `preferred` (in order), topped up
    from a shuffled `pool` to at least `n`."""
    out: list[str] = []
    for cand in preferred:
        if cand != answer and cand not in out:
            out.append(cand)
    rest = [c for c in pool if c != answer and c not in out]
    rng.shuffle(rest)
    out.extend(rest[: max(0, n - len(out))])
    return tuple(out)


def number_distractors(answer: int, stale: list[int], rng: random.Random) -> tuple[str, ...]:
    """Three counts (>= 0) around the answer, which gets a uniformly random rank among the four.

    A stale value (a total before the last change, or the count of everything)
    is used first when it lies on a side that needs one, so the nearest wrong
    totals are the ones offered; a fixed pattern (e.g. always answer-1, +1, +2)
    would let a model pick the answer by its rank alone.
    """
    rank = min(rng.randrange(4), answer)  # how many distractors go below the answer (none below 0)
    below = [answer - d for d in range(1, 5) if answer - d >= 0]
    above = [answer + d for d in range(1, 5)]
    for side in (below, above):
        rng.shuffle(side)
        side.sort(key=lambda x: (x not in stale[-1:], abs(x - answer) > 2))  # stale first, then near misses
    out = below[:rank] + above[: 3 - rank]
    return tuple(str(x) for x in out)


def relocation_thread(
    rng: random.Random,
    things: list[str],
    places: list[str],
    first: Callable[[str, str], str],
    move: Callable[[str, str, str], str],
    ask: Callable[[str], str],
    min_places: int = 4,
) -> Thread:
    """Things change place (or holder) a few times; the thread ends asking where one of them is.

    `first(thing, place)`, `move(thing, src, dst)` and `ask(thing)` word the
    steps; `ask` words the question one way for the whole thread. Every
    placement and move ends with that question answered ("Parcel 417 was
    forwarded to Oslo. Status of parcel 417: in Oslo."), so the question's
    words follow every state the thing has been in (status checks on other
    things in the thread repeat their own), and answering it is
    picking the *latest* of those: the one skill this thread adds to
    recall's lookup. Without that echo a 1.25M model trained for the zoo's
    budget stayed at chance (the README's tiny-world section).

    Moves continue until `min_places` places are mentioned, so the
    distractors (earlier places of the thing, current places of the others)
    all occur in the context. Status checks along the way ask about a thing
    other than the one that just moved, and after the asked thing's last move
    other things move up to twice, so the most recently mentioned place is
    the answer only about as often as chance.
    """
    thread = Thread(Skill.TRACKING)
    loc: dict[str, str] = {}
    past: dict[str, list[str]] = {t: [] for t in things}
    evidence: dict[str, str] = {}
    mentioned: list[str] = []

    def step(thing: str, dst: str) -> None:
        text = first(thing, dst) if thing not in loc else move(thing, loc[thing], dst)
        text = f"{text} {ask(thing)} {dst}."  # the state after the step, in the question's words
        if thing in loc:
            past[thing].append(loc[thing])
        loc[thing], evidence[thing] = dst, text
        if dst not in mentioned:
            mentioned.append(dst)
        thread.add(text)

    def probe(thing: str) -> Probe:
        preferred = past[thing][::-1] + [loc[t] for t in things if t != thing] + mentioned
        return Probe(
            ask(thing), loc[thing], pick_distractors(loc[thing], preferred, places, rng), evidence=evidence[thing]
        )

    for thing in things:
        step(thing, rng.choice(places))
    n_moves = rng.randint(1, 3)
    while n_moves > 0 or len(mentioned) < min_places:
        thing = rng.choice(things)
        fresh = [p for p in places if p not in mentioned]
        step(
            thing,
            rng.choice(fresh if len(mentioned) < min_places and fresh else [p for p in places if p != loc[thing]]),
        )
        n_moves -= 1
        if rng.random() < 0.5:  # a status check of another thing
            thread.add(probe(rng.choice([t for t in things if t != thing])))
    moved = [t for t in things if past[t]]
    target = rng.choice(moved if moved and rng.random() < 0.8 else things)
    others = [t for t in things if t != target]
    for thing in rng.sample(others, min(len(others), rng.randint(0, 2))):
        step(thing, rng.choice([p for p in places if p not in (loc[thing], loc[target])]))
    thread.add(probe(target))
    return thread


def tally_thread(
    rng: random.Random,
    mentions: list[str],
    target: str,
    mention: Callable[[str], str],
    ask: Callable[[], str],
    unit: Callable[[int], str],
) -> Thread:
    """Mentions of several entities in a row; the thread ends asking how often `target` came up.

    `mention(entity)` words one mention, `ask()` the question, `unit(n)` the text
    after the count (" crows.", " times."). After some of the target's mentions a
    count so far is stated as a probe too, so that training text shows counting
    at every stage, not only once at the end of a thread.
    """
    thread = Thread(Skill.COUNTING)
    n, first = 0, None
    for i, entity in enumerate(mentions):
        text = mention(entity)
        thread.add(text)
        if entity != target:
            continue
        n += 1
        first = first or text
        if target in mentions[i + 1 :] and rng.random() < 0.3:
            thread.add(Probe(ask(), str(n), number_distractors(n, [i + 1], rng), suffix=unit(n), evidence=first))
    thread.add(Probe(ask(), str(n), number_distractors(n, [len(mentions)], rng), suffix=unit(n), evidence=first))
    return thread
