"""Run a conversion from a recipe dict and compare models; shared by the convert tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.stream import convert_recipe
from ecomla.recipe.schema import load_recipe


def convert(source: Path, out: Path, force: bool = True, **sections) -> dict:
    """Convert with recipe keys given as nested dicts, e.g. mla={'kv_lora_rank': 64}.

    Unless `init` names a preset, the converter's base defaults (init.preset null: X-EcoMLA's svd/last/mean with the
    normalized latent) fill the keys left unset, not `auto`: the tests pin each key they rely on."""
    data = {"model": str(source), "output_dir": str(out), "dtype": "float32", "device": "cpu"}
    data.update(sections)
    if data.get("target", "mla") == "mla":
        data["init"] = {"preset": None, **data.get("init", {})}
    recipe = load_recipe(ConvertRecipe, data=data)
    return convert_recipe(recipe, force=force, progress=False)


def make_layer0_low_rank(src: Path) -> None:
    """Make layer 0's K/V projections nearly rank-one, so that it needs far less latent width than the others."""
    from safetensors.torch import load_file, save_file

    sd = load_file(src / "model.safetensors")
    for name in ("k_proj", "v_proj"):
        w = sd[f"model.layers.0.self_attn.{name}.weight"]
        sd[f"model.layers.0.self_attn.{name}.weight"] = torch.outer(w[:, 0], w[0]) + 1e-3 * w
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})


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
