"""`ecomla.tinyworld.world`: the fact table is fixed by its seed, and its names are distinct made-up words."""

from __future__ import annotations

from ecomla.tinyworld.world import GOODS, NAMES, Attribute, World, default_world


def test_world_is_a_function_of_its_seed():
    assert World.build() == default_world()
    assert World.build(seed=1) != default_world()


def test_names_are_distinct_and_new():
    world = default_world()
    made_up = [c.name for c in world.cities] + list(world.countries) + list(world.rivers)
    assert len(world.cities) == 128 and len(set(made_up)) == len(made_up)
    assert not {w.lower() for w in made_up} & {w.lower() for w in NAMES + GOODS}
    assert len(set(world.founders)) == len(world.founders)


def test_every_attribute_value_comes_from_its_pool():
    world = default_world()
    for attribute in Attribute:
        pool = set(world.values(attribute))
        assert all(city.get(attribute) in pool for city in world.cities)
    used = {city.country for city in world.cities}
    assert len(used) == len(world.countries)  # every country has cities, so every distractor is plausible
