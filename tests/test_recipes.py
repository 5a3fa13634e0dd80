"""Every YAML under recipes/ loads and validates against its job's schema, has a launch comment, and no absolute paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ecomla.analyze.recon import ReconRecipe
from ecomla.convert.recipe import ConvertRecipe
from ecomla.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {"convert": ConvertRecipe, "analyze": ReconRecipe}
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=[str(p.relative_to(ROOT / "recipes")) for p in RECIPES])
def test_recipe_loads(path):
    job = path.relative_to(ROOT / "recipes").parts[0]
    assert job in SCHEMAS, f"no schema registered for recipes/{job}/"
    load_recipe(SCHEMAS[job], path)
    text = path.read_text()
    assert f"ecomla {job}" in text.split("\n\n")[0] or f"ecomla {job}" in text[:1500], "launch command in the header"

    def strings(node):
        if isinstance(node, dict):
            for v in node.values():
                yield from strings(v)
        elif isinstance(node, list):
            for v in node:
                yield from strings(v)
        elif isinstance(node, str):
            yield node

    assert not [s for s in strings(yaml.safe_load(text)) if s.startswith("/")], "absolute path in a recipe"
