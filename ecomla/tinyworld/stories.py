"""The `stories` domain: short narratives in prose.

A story has a cast (4-5 people) and a home city from the world table. Its
threads move objects between containers and people between rooms, pass
things from hand to hand (tracking), tell door codes and pets' names (recall),
count fox and crow sightings (counting), and mention facts about cities
(facts). Every construct has several wordings. `THREADS` maps each skill to
its thread builders; `opening` and `filler` give the scenery around them.
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
from ecomla.tinyworld.world import (
    COLORS,
    CONTAINERS,
    LOCKS,
    NAMES,
    OBJECTS,
    PETS,
    ROOMS,
    SIGHTINGS,
    Attribute,
    City,
    World,
)


def _say(rng: random.Random, templates: tuple[str, ...], **slots: str) -> str:
    text = rng.choice(templates).format(**slots)
    return text[0].upper() + text[1:]


def _count(n: int, forms: tuple[str, str]) -> str:
    return f"{n} {forms[0] if n == 1 else forms[1]}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ---------------------------------------------------------------- tracking

PUT = ("{a} put the {obj} in the {dst}.", "{a} placed the {obj} in the {dst}.", "{a} left the {obj} in the {dst}.",
       "{a} hid the {obj} in the {dst}.", "The {obj} was in the {dst}.")  # fmt: skip
# A move names only where the thing goes: the old place right after the thing ("moved the bell from the jar
# into the crate") is what a model that copies the word after the thing would answer.
MOVE = ("{a} moved the {obj} to the {dst}.", "{a} took the {obj} and put it in the {dst}.",
        "Later, {a} carried the {obj} to the {dst}.", "{a} moved the {obj} into the {dst}.",
        "{a} picked up the {obj} and dropped it in the {dst}.")  # fmt: skip
WHERE_OBJ = ("The {obj} is now in the", "Where is the {obj}? It is in the",
             "{a} looked for the {obj} and found it in the", "{a} knew that the {obj} was in the")  # fmt: skip
ENTER = ("{a} was in the {dst}.", "{a} sat in the {dst}.", "{a} waited in the {dst}.")
GO = ("{a} went to the {dst}.", "{a} walked into the {dst}.", "{a} ran to the {dst}.",
      "{a} got up and went to the {dst}.", "{a} headed to the {dst}.")  # fmt: skip
WHERE_WHO = (
    "{a} is now in the",
    "Where is {a}? {a} is in the",
    "{b} found {a} in the",
    "At that moment, {a} was in the",
)
HOLD = ("{a} had the {obj}.", "{a} found the {obj}.", "{a} was holding the {obj}.")
GIVE = ("{a} gave the {obj} to {b}.", "{a} handed the {obj} to {b}.", "{a} passed the {obj} to {b}.",
        "From {a}, the {obj} went to {b}.", "{a} let {b} have the {obj}.")  # fmt: skip
WHO_HAS = ("Now the {obj} is with", "The {obj} was now held by", "In the end, the {obj} belonged to",
           "Who has the {obj}? It is with")  # fmt: skip


def objects_in_containers(rng: random.Random, world: World, cast: Cast) -> Thread:
    def actor() -> str:
        return rng.choice(cast.people)

    return relocation_thread(
        rng, cast.claim(rng, "object", OBJECTS, rng.randint(2, 3)), rng.sample(CONTAINERS, 5),
        first=lambda obj, dst: _say(rng, PUT, a=actor(), obj=obj, dst=dst),
        move=lambda obj, src, dst: _say(rng, MOVE, a=actor(), obj=obj, src=src, dst=dst),
        # one question wording (and asker) per thread; every move ends with it answered
        ask=lambda obj, w=(rng.choice(WHERE_OBJ),), a=actor(): _say(rng, w, a=a, obj=obj),
    )  # fmt: skip


def people_in_rooms(rng: random.Random, world: World, cast: Cast) -> Thread:
    def other(a: str) -> str:
        return rng.choice([p for p in cast.people if p != a])

    return relocation_thread(
        rng, cast.claim(rng, "walker", cast.people, rng.randint(2, 3), NAMES), rng.sample(ROOMS, 5),
        first=lambda a, dst: _say(rng, ENTER, a=a, dst=dst),
        move=lambda a, src, dst: _say(rng, GO, a=a, src=src, dst=dst),
        # one wording per thread; in "{b} found {a} in the" the finder {b} is drawn afresh each time it is said
        ask=lambda a, w=(rng.choice(WHERE_WHO),): _say(rng, w, a=a, b=other(a)),
    )  # fmt: skip


def hand_to_hand(rng: random.Random, world: World, cast: Cast) -> Thread:
    """Two things passed between the cast; the "places" are the people holding them."""
    return relocation_thread(
        rng, cast.claim(rng, "object", OBJECTS, 2), list(cast.people),
        first=lambda obj, a: _say(rng, HOLD, a=a, obj=obj),
        move=lambda obj, a, b: _say(rng, GIVE, a=a, b=b, obj=obj),
        ask=lambda obj, w=(rng.choice(WHO_HAS),): _say(rng, w, obj=obj),  # one wording per thread
    )  # fmt: skip


# ---------------------------------------------------------------- recall

TELL = ("{a} told {b} that the code for the {key} is {v}.", "The code for the {key} was {v}.",
        "{a} wrote down the code for the {key}: {v}.", "{b} learned that the {key} opens with {v}.",
        "A note said that the {key} needs the code {v}.")  # fmt: skip
NAME_PET = ("{a} had a {pet} called {v}.", "{a}'s {pet} was named {v}.",
            "The {pet} that lived with {a} was called {v}.", "{a} named the new {pet} {v}.")  # fmt: skip


def _recall(rng, thread, pairs: list[tuple[dict, str]], tell, pool) -> None:
    """State each (slots, value) pair, probe some along the way, end on a probe of a random stated pair.

    A probe repeats its pair's statement up to the value ("Ann wrote down the
    code for the red door:" -> "4817"), so answering it is finding that
    statement among the 4-6 similar ones and copying what followed it.
    """
    told: list[int] = []
    values = [v for _, v in pairs]
    texts: dict[int, str] = {}

    def probe(i: int) -> Probe:
        others = [values[j] for j in told if j != i] + [values[j] for j in range(len(pairs)) if j not in told]
        return echo_probe(texts[i], values[i], pick_distractors(values[i], others, pool, rng))

    for i, (slots, value) in enumerate(pairs):
        texts[i] = _say(rng, tell, v=value, **slots)
        thread.add(texts[i])
        told.append(i)
        if len(told) > 1 and rng.random() < 0.5:
            thread.add(probe(rng.choice(told)))
    for i in rng.sample(told, rng.randint(1, min(3, len(told)))):
        thread.add(probe(i))


def door_codes(rng: random.Random, world: World, cast: Cast) -> Thread:
    thread = Thread(Skill.RECALL)
    n = rng.randint(4, 6)
    every_key = [f"{color} {lock}" for color in COLORS for lock in LOCKS]
    lock = rng.choice(LOCKS)  # half the time all keys are doors (or gates...), told apart by colour alone
    same_lock = [f"{color} {lock}" for color in COLORS] if rng.random() < 0.5 else every_key
    keys = cast.claim(rng, "lock", same_lock, n, every_key)
    codes = [str(c) for c in rng.sample(range(1000, 10000), n + 4)]
    pairs = [(dict(key=k, a=rng.choice(cast.people), b=rng.choice(cast.people)), c) for k, c in zip(keys, codes)]
    _recall(rng, thread, pairs, TELL, codes[n:])
    return thread


def pet_names(rng: random.Random, world: World, cast: Cast) -> Thread:
    thread = Thread(Skill.RECALL)
    n = rng.randint(4, 6)
    owned = cast.claim(rng, "pet", [f"{a}/{pet}" for a in cast.people for pet in PETS], n)
    names = rng.sample([x for x in NAMES if x not in cast.people], n + 4)
    pairs = [(dict(zip(("a", "pet"), key.split("/"))), name) for key, name in zip(owned, names)]
    _recall(rng, thread, pairs, NAME_PET, names[n:])
    return thread


# ---------------------------------------------------------------- counting

SEE = ("{a} saw {an} {animal}.", "{a} spotted {an} {animal} near the {room}.", "{An} {animal} ran past {a}.")
SEEN = ("How many {animals} did {a} see? {a} saw", "{a} counted the {animals}: there were",
        "The number of {animals} that {a} saw was")  # fmt: skip


def sightings(rng: random.Random, world: World, cast: Cast) -> Thread:
    target, *others = rng.sample(SIGHTINGS, 3)
    (a,) = cast.claim(rng, "watcher", cast.people, 1, NAMES)
    seen = [target] * rng.randint(1, 5) + [rng.choice(others) for _ in range(rng.randint(1, 4))]
    rng.shuffle(seen)

    def mention(animal: tuple[str, str]) -> str:
        an = _article(animal[0])
        return _say(rng, SEE, a=a, an=an, An=an.capitalize(), animal=animal[0], room=rng.choice(ROOMS))

    return tally_thread(rng, seen, target, mention, lambda: _say(rng, SEEN, a=a, animals=target[1]),
                        lambda n: f" {target[0] if n == 1 else target[1]}.")  # fmt: skip


# ---------------------------------------------------------------- facts

FACT_PROBES = {
    Attribute.COUNTRY: ("{city} is a city in", "The city of {city} lies in", "{city} belongs to the land of"),
    Attribute.RIVER: (
        "{city} lies on the river",
        "The river that flows through {city} is the",
        "{city} was built on the banks of the",
    ),
    Attribute.FOUNDER: ("{city} was founded by", "The founder of {city} was", "The first house in {city} was built by"),
    Attribute.GOODS: ("{city} is known for its", "{city} is famous for its", "The main trade of {city} is"),
}
FACT_SAYINGS = ("The river {river} flows through {city}.", "{founder} founded {city} long ago.",
                "{country} is home to the city of {city}.", "People came to {city} for its {goods}.",
                "{city}, on the {river}, was quiet that year.")  # fmt: skip
TRAVEL = ("{a} traveled to {city}.", "{a} came from {city}.", "{a} had a cousin in {city}.", "{a} once visited {city}.")


def fact_probe(rng: random.Random, world: World, city: City, attribute: Attribute) -> Probe:
    value = city.get(attribute)
    return Probe(
        _say(rng, FACT_PROBES[attribute], city=city.name),
        value,
        pick_distractors(value, [], world.values(attribute), rng),
    )


def city_facts(rng: random.Random, world: World, cast: Cast) -> Thread:
    thread = Thread(Skill.FACTS)
    city = cast.city if rng.random() < 0.3 else rng.choice(world.cities)
    if city is not cast.city:
        thread.add(_say(rng, TRAVEL, a=rng.choice(cast.people), city=city.name))
    if rng.random() < 0.5:
        thread.add(_say(rng, FACT_SAYINGS, city=city.name, river=city.river, founder=city.founder,
                        country=city.country, goods=city.goods))  # fmt: skip
    thread.add(fact_probe(rng, world, city, rng.choice(list(Attribute))))
    return thread


THREADS = {
    Skill.TRACKING: (objects_in_containers, people_in_rooms, hand_to_hand),
    Skill.RECALL: (door_codes, pet_names),
    Skill.COUNTING: (sightings,),
    Skill.FACTS: (city_facts,),
}

# ---------------------------------------------------------------- scenery

OPENINGS = ("Once, in {city}, there lived {people}.", "{people} lived in {city}, a city in {country}.",
            "This is a story from {city}, on the river {river}, about {people}.",
            "In the city of {city}, founded by {founder}, lived {people}.", "{people} grew up in {city}.")  # fmt: skip
FILLERS = ("The sun was low over the hills.", "A cold wind blew.", "{a} hummed a tune.", "{a} and {b} laughed.",
           "It began to rain.", "The house was quiet.", "{a} drank some tea.", "Somewhere a dog barked.",
           "{a} yawned.", "The day was warm.", "{a} looked out of the window.", "Bells rang in the distance.",
           "{a} smiled at {b}.", "Nobody said a word.", "{a} sat down to rest.")  # fmt: skip
ENDINGS = ("The end.", "That was the end of the day.", "And so the day ended.", "Then everyone went to sleep.")


def opening(rng: random.Random, cast: Cast) -> str:
    shown = list(cast.people[: rng.randint(2, len(cast.people))])
    people = ", ".join(shown[:-1]) + " and " + shown[-1]
    c = cast.city
    return _say(rng, OPENINGS, city=c.name, country=c.country, river=c.river, founder=c.founder, people=people)


def filler(rng: random.Random, cast: Cast) -> Thread:
    a, b = rng.sample(cast.people, 2)
    return Thread(Skill.FILLER, [_say(rng, FILLERS, a=a, b=b)])


LIST = ("{a} made a list: {x}.", "{a} wrote down: {x}.", "On the board {a} wrote: {x}.")
LIST_BACK = ("{b} read the list back: {x}.", "{b} read it out: {x}.", "{b} copied it: {x}.")


def readback(rng: random.Random, cast: Cast, long: bool = False) -> tuple[str, str]:
    a, b = rng.sample(cast.people, 2)
    return threads.readback(rng, lambda x: _say(rng, LIST, a=a, x=x), lambda x: _say(rng, LIST_BACK, b=b, x=x), long)


def ending(rng: random.Random) -> str:
    return rng.choice(ENDINGS)
