"""`ecomla.tinyworld.corpus` (and the stories/records/threads it weaves).

Proves: streams are deterministic and random-access; splits, seeds and
domains never share a document; bad names are rejected by name; both domains
contain every skill; and the text tells the truth, checked by replaying it:
every door or locker has one code per document, no parcel move names the old
place, every parcel line ends with where it is now in its thread's one
question wording (status checks included), and every
visit count equals the sign-ins so far.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter, defaultdict

import pytest

from ecomla.tinyworld import records, stories
from ecomla.tinyworld.corpus import (
    DOMAINS,
    SPLITS,
    compose,
    document,
    iter_documents,
    iter_mixed,
    list_document,
)
from ecomla.tinyworld.threads import Probe, Skill
from ecomla.tinyworld.world import LOCKS, default_world


def take(domain: str, split: str, n: int, seed: int = 0) -> list[str]:
    return list(itertools.islice(iter_documents(domain, split, seed), n))


@pytest.mark.parametrize("domain", DOMAINS)
def test_same_seed_same_text_and_random_access(domain):
    first = take(domain, "train", 30)
    assert first == take(domain, "train", 30)
    assert list(itertools.islice(iter_documents(domain, "train", 0, start=17), 5)) == first[17:22]
    assert document(domain, "train", 0, 29) == first[29]
    assert len(set(first)) == 30


@pytest.mark.parametrize("domain", DOMAINS)
def test_splits_seeds_and_domains_never_share_documents(domain):
    samples = {split: set(take(domain, split, 400)) for split in SPLITS}
    for a, b in itertools.combinations(SPLITS, 2):
        assert not samples[a] & samples[b], (a, b)
    assert not set(take(domain, "train", 400, seed=1)) & samples["train"]
    other = next(d for d in DOMAINS if d != domain)
    assert not set(take(other, "train", 400)) & samples["train"]


def test_mixed_stream_alternates_domains():
    mixed = list(itertools.islice(iter_mixed("train"), 6))
    assert mixed[0::2] == take("stories", "train", 3) and mixed[1::2] == take("records", "train", 3)


def test_bad_names_are_rejected_by_name():
    with pytest.raises(ValueError, match="stories, records"):
        next(iter_documents("novels", "train"))
    with pytest.raises(ValueError, match="train, calibration, heldout"):
        next(iter_documents("stories", "test"))


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_skill_occurs_and_probes_follow_their_evidence(domain):
    world, seen = default_world(), set()
    for index in range(200):
        rng = random.Random(f"test/{domain}/{index}")
        doc = compose(rng, world, domain, rng.randint(2, 5))
        seen |= {t.skill for t in doc.threads}
        for (_, step), offset in zip(doc.steps, doc.offsets):
            if isinstance(step, Probe):
                assert doc.text[offset : offset + 1 + len(step.answer)] == " " + step.answer
                assert step.answer not in step.distractors and len(set(step.distractors)) >= 3
                if step.evidence is not None:  # the deciding step comes before the probe
                    assert 0 <= doc.text.find(step.evidence) < offset
    assert seen >= {Skill.RECALL, Skill.TRACKING, Skill.COUNTING, Skill.FACTS}


def _template_regex(template: str) -> re.Pattern:
    """A sentence template ("Parcel {k} was moved to {dst}.") as a regex: placeholders match words."""
    parts = re.split(r"(\{\w+\})", template)
    return re.compile("".join(r"[\w ]+?" if p.startswith("{") else re.escape(p) for p in parts if p))


# Every sentence template that tracking threads write (placements, moves, hand-overs, questions), per domain
TRACKING_TEMPLATES = {
    "stories": (*stories.PUT, *stories.MOVE, *stories.WHERE_OBJ, *stories.ENTER, *stories.GO, *stories.WHERE_WHO,
                *stories.HOLD, *stories.GIVE, *stories.WHO_HAS),
    "records": (*records.PARCEL_AT, *records.PARCEL_MOVE, *records.PARCEL_WHERE, *records.STAFF_AT,
                *records.STAFF_MOVE, *records.STAFF_WHERE),
}


@pytest.mark.parametrize("domain", DOMAINS)
def test_a_stream_without_tracking_has_no_tracking_text_and_keeps_the_other_skills(domain):
    world = default_world()
    kept = Counter()
    for index in range(300):
        rng = random.Random(f"test/{domain}/{index}")
        doc = compose(rng, world, domain, rng.randint(2, 5), without=frozenset({Skill.TRACKING}))
        assert Skill.TRACKING not in {t.skill for t in doc.threads}
        kept.update(t.skill for t in doc.threads)
    assert {Skill.RECALL, Skill.COUNTING, Skill.FACTS} <= set(kept)
    plain = list(itertools.islice(iter_documents(domain, "train", 0), 200))
    assert plain[:50] == list(itertools.islice(iter_documents(domain, "train", 0, without=frozenset()), 50))
    lean = list(itertools.islice(iter_documents(domain, "train", 0, without=frozenset({Skill.TRACKING})), 200))
    for template in TRACKING_TEMPLATES[domain]:  # each one is in the full mix (so the regex works), none is left
        pattern = _template_regex(template)
        assert pattern.search(" ".join(plain)), template
        assert not pattern.search(" ".join(lean)), template
    assert sum(a == b for a, b in zip(plain, lean)) >= 40  # list documents are drawn first and shared


def test_without_every_skill_or_the_first_one_is_refused():
    rng, world = random.Random(0), default_world()
    with pytest.raises(ValueError, match="leaves no skill"):
        compose(rng, world, "records", 3, without=frozenset(Skill))
    with pytest.raises(ValueError, match="first=tracking is also in without"):
        compose(rng, world, "stories", 3, first=Skill.TRACKING, without=frozenset({Skill.TRACKING}))


_KEY = re.compile(rf"\b(\w+ (?:{'|'.join(LOCKS)}))\b")


@pytest.mark.parametrize("domain", DOMAINS)
def test_every_door_and_locker_has_one_code_per_document(domain):
    checked = 0
    for text in take(domain, "train", 600):  # 600: recall threads are a fifth of the threads since tracking doubled
        codes = defaultdict(set)
        for sentence in re.split(r"(?<=[.?!:])\s+|\n", text):
            number = re.findall(r"\b\d{4}\b", sentence)
            if domain == "stories":
                key = _KEY.search(sentence)
                key = key.group(1).lower() if key else None
            else:
                key = re.search(r"\block(?:er)? (\d+)\b", sentence, re.I)
                key = key.group(1) if key else None
            if key and number:
                codes[key].add(number[0])
        assert all(len(v) == 1 for v in codes.values()), codes
        checked += len(codes)
    assert checked > 300


def test_parcel_moves_name_only_the_new_place_and_end_with_where_it_is_now():
    status = re.compile(r"(Parcel \d+ is now in|Current location of parcel \d+:|Status of parcel \d+: in) (\w+)\.$")
    moves = checks = 0
    for text in take("records", "train", 600):
        where: dict[str, str] = {}
        asked: dict[str, str] = {}  # parcel -> its thread's question wording
        for line in text.splitlines():
            m = re.search(r"\b[Pp]arcel (\d+)\b", line)
            if not m:
                continue
            parcel = m.group(1)
            state = status.search(line)
            assert state, line  # every parcel line ends saying where the parcel is now
            wording, dst = re.sub(r"\d+", "N", state.group(1)), state.group(2)
            assert asked.setdefault(parcel, wording) == wording, line  # one wording per thread
            if state.start() == 0:  # a status check: says where the parcel is
                assert where[parcel] == dst, line
                checks += 1
                continue
            if parcel in where and dst != where[parcel]:  # a move: the old place is not in the line
                assert where[parcel] not in line, line
                moves += 1
            where[parcel] = dst
    assert moves > 50 and checks > 50


def test_visit_counts_equal_the_sign_ins_so_far():
    """Replays visitor logs: every count (in passing or at the end) equals that visitor's sign-ins above it."""
    visit = re.compile(r"^(?:Visitor: (\w+)\.|Signed in: (\w+)\.|(\w+) signed the guest book\.)$")
    count = re.compile(r"^(?:Visits by (\w+):|(\w+) signed in|Number of visits by (\w+):) (\d+) times?\.$")
    checked = 0
    for text in take("records", "train", 600):
        seen: dict[str, int] = defaultdict(int)
        for line in text.splitlines():
            if m := visit.match(line):
                seen[next(x for x in m.groups() if x)] += 1
            elif m := count.match(line):
                assert seen[next(x for x in m.groups()[:3] if x)] == int(m.group(4)), line
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("domain", DOMAINS)
def test_lists_are_read_back_word_for_word_right_after_they_are_written(domain):
    """A third of the documents (LIST_SHARE) are lists read back: the copying signal a small model learns first."""
    world, lists = default_world(), 0
    for index in range(60):
        doc = list_document(random.Random(f"test/lists/{domain}/{index}"), world, domain)
        steps = [step for _, step in doc.steps[1:]]  # after the opening line
        assert len(steps) % 2 == 0 and len(steps) >= 4
        for written, read in zip(steps[0::2], steps[1::2]):
            entries = written.split(": ", 1)[1]
            assert read.endswith(": " + entries) and len(entries.split(" ")) >= 12
            lists += 1
    assert lists >= 120

