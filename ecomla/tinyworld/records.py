"""The `records` domain: registries, ledgers and logs, one entry per line.

A record file has a header and interleaved entries: lookup tables (locker
codes, phone extensions, ticket holders: recall), parcels and staff moving
between cities (tracking), visitor logs (counting), and
encyclopedic entries, tables and Q/A lines about the world's cities (facts,
the densest source of them). Records and stories share the world table and
the skills but not their wording, so each is out-of-domain for the other.
"""

from __future__ import annotations

import random

from ecomla.tinyworld import threads
from ecomla.tinyworld.threads import (
    Cast,
    Probe,
    Skill,
    Thread,
    echo_probe,
    pick_distractors,
    relocation_thread,
    tally_thread,
)
from ecomla.tinyworld.world import NAMES, Attribute, City, World


def _say(rng: random.Random, templates: tuple[str, ...], **slots) -> str:
    return rng.choice(templates).format(**slots)


def _count(n: int, forms: tuple[str, str]) -> str:
    return f"{n} {forms[0] if n == 1 else forms[1]}"


# ---------------------------------------------------------------- recall

_LOCKERS = [str(i) for i in range(1, 100)]
_IDS = [str(i) for i in range(100, 1000)]  # tickets and parcels

LOCKER = (
    "Locker {k}: code {v}.",
    "Locker {k} uses code {v}.",
    "The code of locker {k} is {v}.",
    "Locker {k} - code {v}.",
)
EXTENSION = ("{k}: extension {v}.", "Extension of {k}: {v}.", "{k} can be reached at extension {v}.")
TICKET = ("Ticket {k} was issued to {v}.", "Ticket {k}: holder {v}.", "Ticket no. {k} belongs to {v}.")


def _lookup(rng: random.Random, keys: list[str], values: list[str], pool: list[str], tell) -> Thread:
    """State key -> value lines, look some up along the way, end on a lookup of a random stated key.

    A lookup repeats the key's line up to its value, as a clerk reading the
    entry back would ("Locker 56 uses code" -> "2254").
    """
    thread = Thread(Skill.RECALL)
    lines: list[str] = []

    def probe(i: int) -> Probe:
        others = [v for j, v in enumerate(values) if j != i]
        rng.shuffle(others)
        return echo_probe(lines[i], values[i], pick_distractors(values[i], others, pool, rng))

    for i, (key, value) in enumerate(zip(keys, values)):
        lines.append(_say(rng, tell, k=key, v=value))
        thread.add(lines[i])
        if i and rng.random() < 0.5:
            thread.add(probe(rng.randrange(i + 1)))
    # a read-back of some entries, in a new order, as a clerk checking the list would
    for i in rng.sample(range(len(keys)), rng.randint(1, len(keys))):
        thread.add(probe(i))
    return thread


def locker_codes(rng: random.Random, world: World, cast: Cast) -> Thread:
    n = rng.randint(4, 8)
    keys = cast.claim(rng, "locker", _LOCKERS, n)
    values = [str(v) for v in rng.sample(range(1000, 10000), n + 4)]
    return _lookup(rng, keys, values[:n], values[n:], LOCKER)


def extensions(rng: random.Random, world: World, cast: Cast) -> Thread:
    n = rng.randint(4, 7)
    keys = cast.claim(rng, "extension", NAMES, n)
    values = [str(v) for v in rng.sample(range(100, 1000), n + 4)]
    return _lookup(rng, keys, values[:n], values[n:], EXTENSION)


def tickets(rng: random.Random, world: World, cast: Cast) -> Thread:
    n = rng.randint(4, 7)
    keys = cast.claim(rng, "ticket", _IDS, n)
    values = rng.sample(NAMES, n + 4)
    return _lookup(rng, keys, values[:n], values[n:], TICKET)


# ---------------------------------------------------------------- tracking

PARCEL_AT = (
    "Parcel {k} is at the depot in {dst}.",
    "Parcel {k} registered in {dst}.",
    "Parcel {k}: received at {dst}.",
)
# Moves name only the new place (see stories.MOVE).
PARCEL_MOVE = ("Parcel {k} was forwarded to {dst}.", "Parcel {k} arrived in {dst}.", "Parcel {k} was moved to {dst}.",
               "Transfer: parcel {k} to {dst}.")  # fmt: skip
PARCEL_WHERE = ("Parcel {k} is now in", "Current location of parcel {k}:", "Status of parcel {k}: in")
STAFF_AT = ("{k} joined the {dst} office.", "{k} works at the office in {dst}.", "New hire: {k}, office {dst}.")
STAFF_MOVE = ("{k} was transferred to {dst}.", "{k} moved to the {dst} office.", "Transfer: {k} to {dst}.")
STAFF_WHERE = ("{k} now works in", "Office of {k}:", "Current office of {k}:")


def _relocations(rng: random.Random, things: list[str], places: list[str], first, move, where) -> Thread:
    return relocation_thread(
        rng, things, places,
        first=lambda k, dst: _say(rng, first, k=k, dst=dst),
        move=lambda k, src, dst: _say(rng, move, k=k, src=src, dst=dst),
        ask=lambda k, w=(rng.choice(where),): _say(rng, w, k=k),  # one wording per thread
    )  # fmt: skip


def parcels(rng: random.Random, world: World, cast: Cast) -> Thread:
    ids = cast.claim(rng, "parcel", _IDS, rng.randint(2, 3))
    places = [c.name for c in rng.sample(world.cities, 5)]
    return _relocations(rng, ids, places, PARCEL_AT, PARCEL_MOVE, PARCEL_WHERE)


def staff(rng: random.Random, world: World, cast: Cast) -> Thread:
    people = cast.claim(rng, "staff", NAMES, rng.randint(2, 3))
    places = [c.name for c in rng.sample(world.cities, 5)]
    return _relocations(rng, people, places, STAFF_AT, STAFF_MOVE, STAFF_WHERE)


# ---------------------------------------------------------------- counting

VISIT = ("Visitor: {k}.", "Signed in: {k}.", "{k} signed the guest book.")
VISITS = ("Visits by {k}:", "{k} signed in", "Number of visits by {k}:")


def visitors(rng: random.Random, world: World, cast: Cast) -> Thread:
    target, *others = cast.claim(rng, "visitor", NAMES, rng.randint(3, 4))
    log = [target] * rng.randint(1, 5) + [rng.choice(others) for _ in range(rng.randint(2, 5))]
    rng.shuffle(log)
    return tally_thread(rng, log, target, lambda name: _say(rng, VISIT, k=name), lambda: _say(rng, VISITS, k=target),
                        lambda n: " time." if n == 1 else " times.")  # fmt: skip


# ---------------------------------------------------------------- facts

LABELS = {
    Attribute.COUNTRY: ("Country", "Nation", "Land"),
    Attribute.RIVER: ("River", "Waterway"),
    Attribute.FOUNDER: ("Founder", "Founded by"),
    Attribute.GOODS: ("Known for", "Trade", "Main good"),
}
QUESTIONS = {
    Attribute.COUNTRY: (
        "Q: In which country is {city}? A:",
        "Q: Which country is {city} in? A:",
        "Q: Where is {city}? A:",
    ),
    Attribute.RIVER: ("Q: Which river flows through {city}? A:", "Q: On which river does {city} lie? A:"),
    Attribute.FOUNDER: ("Q: Who founded {city}? A:", "Q: Who was the founder of {city}? A:"),
    Attribute.GOODS: ("Q: What is {city} known for? A:", "Q: What does {city} trade in? A:"),
}
PROSE = ("{city} is a city in {country} on the river {river}, founded by {founder} and known for its {goods}.",
         "{city} ({country}): on the {river}; founder {founder}; trade in {goods}.")  # fmt: skip


def qa_probe(rng: random.Random, world: World, city: City, attribute: Attribute) -> Probe:
    value = city.get(attribute)
    return Probe(_say(rng, QUESTIONS[attribute], city=city.name), value,
                 pick_distractors(value, [], world.values(attribute), rng), suffix="")  # fmt: skip


def _entry(rng: random.Random, city: City) -> str:
    fields = list(Attribute)
    rng.shuffle(fields)
    if rng.random() < 0.3:
        slots = {a.value: city.get(a) for a in Attribute}
        return _say(rng, PROSE, city=city.name, **slots)
    return f"{city.name}. " + " ".join(f"{rng.choice(LABELS[a])}: {city.get(a)}." for a in fields[: rng.randint(2, 4)])


def _table(rng: random.Random, cities: list[City]) -> str:
    columns = list(Attribute)
    rng.shuffle(columns)
    columns = columns[: rng.randint(2, 4)]
    head = "| City | " + " | ".join(LABELS[a][0] for a in columns) + " |"
    rows = ["| " + c.name + " | " + " | ".join(c.get(a) for a in columns) + " |" for c in cities]
    return "\n".join([head, *rows])


def city_records(rng: random.Random, world: World, cast: Cast) -> Thread:
    """Entries or a table about a few cities, then a Q/A line about one of them."""
    thread = Thread(Skill.FACTS)
    cities = rng.sample(world.cities, rng.randint(2, 6))
    if rng.random() < 0.4:
        thread.add(_table(rng, cities))
    else:
        for city in cities[:3]:
            thread.add(_entry(rng, city))
    asked = rng.choice(cities) if rng.random() < 0.5 else rng.choice(world.cities)
    thread.add(qa_probe(rng, world, asked, rng.choice(list(Attribute))))
    return thread


THREADS = {
    Skill.TRACKING: (parcels, staff),
    Skill.RECALL: (locker_codes, extensions, tickets),
    Skill.COUNTING: (visitors,),
    Skill.FACTS: (city_records,),
}

HEADERS = ("Registry of {city}", "Ledger {n}, {city}", "Records of the {city} office", "Log book of {city}, page {n}",
           "Archive file {n}")  # fmt: skip


MANIFEST = ("Manifest {n}: {x}.", "List {n}: {x}.", "Order {n}: {x}.")
MANIFEST_BACK = ("Check of manifest {n}: {x}.", "List {n} checked: {x}.", "Order {n} confirmed: {x}.")


def readback(rng: random.Random, cast: Cast, long: bool = False) -> tuple[str, str]:
    n, k = rng.randint(1, 99), rng.randrange(3)
    return threads.readback(rng, lambda x: MANIFEST[k].format(n=n, x=x), lambda x: MANIFEST_BACK[k].format(n=n, x=x), long)


def opening(rng: random.Random, cast: Cast) -> str:
    return _say(rng, HEADERS, city=cast.city.name, n=rng.randint(1, 999))
