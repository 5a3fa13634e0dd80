"""Run a conversion from a recipe dict and compare models; shared by the convert tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ecomla.convert.converter import Converter
from ecomla.convert.plan import make_plan
from ecomla.convert.recipe import ConvertRecipe
from ecomla.recipe.schema import load_recipe


def convert(source: Path, out: Path, force: bool = True, **sections) -> dict:
    """Convert with recipe keys given as nested dicts, e.g. mla={'kv_lora_rank': 64}."""
    data = {"model": str(source), "output_dir": str(out), "dtype": "float32", "device": "cpu"}
    data.update(sections)
    recipe = load_recipe(ConvertRecipe, data=data)
    return Converter(make_plan(recipe, force=force), force=force, progress=False).run()


def load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def padded_batch(vocab: int, seed: int = 0, T: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows, the second left-padded by 5 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


@torch.no_grad()
def logit_error(a, b, vocab: int, seed: int = 0) -> float:
    """Max |Δlogit| over the unpadded positions of a padded batch."""
    ids, mask = padded_batch(vocab, seed)
    la = a(ids, attention_mask=mask).logits
    lb = b(ids, attention_mask=mask).logits
    return float((la - lb)[mask.bool()].abs().max())
