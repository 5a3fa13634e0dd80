"""The fixed facts and word pools of the tiny world.

`World` holds the "world knowledge" a model can only get by memorizing its
pretraining text: a table of fictional cities, each with a country, a river, a
founder and a trade good. It is a pure function of `WORLD_SEED`, so every
split, every document and every eval item sees the same facts.

The pools below (first names, objects, containers, ...) are the vocabulary the
document generators draw fresh combinations from. Place names, countries,
rivers and founders' surnames are made-up words built from syllables, so they
carry no prior from real text and all have a similar surface form.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

WORLD_SEED = 20250101  # fixes the fact table; changing it changes what the zoo must memorize

NAMES = (
    "Ann Ben Cara Dan Eli Finn Gil Hana Ivo Jana Kai Lena Milo Nora Otto Pia Quin Rosa Sam Tara Uma Vera Wes Yara "
    "Zane Ada Bram Cleo Dora Emil Faye Greta Hugo Iris Jonas Kira Luca Mara Nico Olga Pavel Rina Saul Tess Ugo Vik "
    "Wren Xena Yuri Zora Alma Boris Celia Dario Edda Felix Gwen Hector Ines Jasper Klara Leo Mira Nils Oona Petra "
    "Ruben Sofia Timo Ulla Viggo Wanda Abel Bea Cyril Dina Ezra Flora Goran Hilde Igor Juno Karl Lise Marek Nadia "
    "Oskar Paula Remy Selma Tomas Ulf Vanja Willa"
).split()
OBJECTS = (
    "key coin book lamp ring map cup spoon hat scarf letter shell bell comb candle brush whistle button marble "
    "ribbon feather mirror compass flute glove clock kettle rope pencil medal"
).split()
CONTAINERS = (
    "box drawer basket chest cupboard bag jar bucket crate barrel trunk closet sack pot bowl tray case cabinet "
    "pouch suitcase vase wardrobe pantry satchel"
).split()
ROOMS = (
    "kitchen garden hall attic cellar library barn porch bedroom study yard workshop stable bakery market chapel"
).split()
COLORS = "red blue green yellow white black grey brown orange purple silver golden pink copper".split()
LOCKS = "door gate safe locker vault".split()
PETS = "cat dog goat horse pony parrot rabbit donkey hen duck lamb owl".split()
# (singular, plural) of things people count
COUNTABLES = (
    ("apple", "apples"), ("pear", "pears"), ("plum", "plums"), ("egg", "eggs"), ("coin", "coins"),
    ("shell", "shells"), ("stone", "stones"), ("nut", "nuts"), ("cookie", "cookies"), ("stamp", "stamps"),
    ("marble", "marbles"), ("candle", "candles"), ("berry", "berries"), ("cherry", "cherries"), ("card", "cards"),
)  # fmt: skip
SIGHTINGS = (
    ("fox", "foxes"), ("owl", "owls"), ("hare", "hares"), ("crow", "crows"), ("frog", "frogs"),
    ("goat", "goats"), ("swan", "swans"), ("heron", "herons"), ("deer", "deer"), ("boar", "boars"),
)  # fmt: skip
GOODS = (
    "salt wool glass iron silk tea grain copper timber honey cheese wine paper spice leather amber linen pottery "
    "tin wax soap dye oil flour"
).split()
UNITS = (("crate", "crates"), ("barrel", "barrels"), ("sack", "sacks"), ("bale", "bales"), ("box", "boxes"))

_ONSETS = "b br d dr f g gr h k kr l m n p r s st t th v z sk".split()
_VOWELS = "a e i o u a e o ai ei ou".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "th", "m", "k"]


class Attribute(str, Enum):
    """What a fact says about a city."""

    COUNTRY = "country"
    RIVER = "river"
    FOUNDER = "founder"
    GOODS = "goods"


@dataclass(frozen=True)
class City:
    """One row of the fact table."""

    name: str
    country: str
    river: str
    founder: str  # "First Surname"
    goods: str  # what the city is known for, from GOODS

    def get(self, attribute: Attribute) -> str:
        return getattr(self, attribute.value)


@dataclass(frozen=True)
class World:
    """The fixed fact table shared by all splits (build it with `World.build` or `default_world`)."""

    seed: int
    cities: tuple[City, ...]
    countries: tuple[str, ...]
    rivers: tuple[str, ...]
    founders: tuple[str, ...]

    @classmethod
    def build(cls, seed: int = WORLD_SEED, n_cities: int = 128, n_countries: int = 16, n_rivers: int = 32) -> World:
        rng = random.Random(f"tinyworld/world/{seed}")
        taken = {w.lower() for w in NAMES + OBJECTS + CONTAINERS + ROOMS + GOODS}

        def words(n: int, syllables: tuple[int, int], ending: tuple[str, ...] = ("",)) -> tuple[str, ...]:
            out: list[str] = []
            while len(out) < n:
                word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(*syllables)))
                word = (word + rng.choice(_CODAS) + rng.choice(ending)).capitalize()
                if word.lower() not in taken and 4 <= len(word) <= 10:
                    taken.add(word.lower())
                    out.append(word)
            return tuple(out)

        countries = words(n_countries, (2, 3), ("ia", "a", "and", "or"))
        rivers = words(n_rivers, (2, 2), ("", "a", "e"))
        names = words(n_cities, (2, 3), ("", "", "mora", "vik", "dal", "holm", "ford", "ton"))
        surnames = words(n_cities, (2, 2), ("", "er", "son", "ik"))
        founders = tuple(f"{rng.choice(NAMES)} {surname}" for surname in surnames)

        def balanced(pool: tuple[str, ...] | list[str]) -> list[str]:
            # Every value is used by as many cities as the others (+-1), so no answer is
            # more likely than its distractors just because it is more frequent.
            out = [pool[i % len(pool)] for i in range(n_cities)]
            rng.shuffle(out)
            return out

        cities = tuple(
            City(*row) for row in zip(names, balanced(countries), balanced(rivers), founders, balanced(GOODS))
        )
        return cls(seed=seed, cities=cities, countries=countries, rivers=rivers, founders=founders)

    def values(self, attribute: Attribute) -> tuple[str, ...]:
        """Every value an attribute can take: the pool its distractors come from."""
        return {
            Attribute.COUNTRY: self.countries,
            Attribute.RIVER: self.rivers,
            Attribute.FOUNDER: self.founders,
            Attribute.GOODS: tuple(GOODS),
        }[attribute]


@lru_cache(maxsize=4)
def default_world(seed: int = WORLD_SEED) -> World:
    """The world every generator uses unless told otherwise (built once per process)."""
    return World.build(seed)
