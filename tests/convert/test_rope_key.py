"""The shared RoPE key: mean (X-EcoMLA) vs RoRoPE head mixing, from weights and from calibration."""

from __future__ import annotations

import pytest
import torch

from tests.convert.helpers import convert, load, logit_error


def _cal(corpus_dir):
    return {"dataset": str(corpus_dir / "a_fit.jsonl"), "heldout": {"dataset": str(corpus_dir / "a_held.jsonl")},
            "num_tokens": 4096, "heldout_tokens": 2048, "seq_len": 64}


def _mean(rep, key):
    return sum(layer[key] for layer in rep["layers"]) / len(rep["layers"])


def test_single_kv_head_every_choice_is_the_same_model(source_factory, corpus_dir, tmp_path):
    """MQA: one key per pair already, so mean, rorope and rorope_act write identical weights; exactness holds."""
    src = source_factory("llama", num_key_value_heads=1, rms_norm_eps=1e-9)
    models = {}
    for mode in ("mean", "rorope", "rorope_act"):
        rep = convert(src, tmp_path / mode, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 16, "rope_key": mode},
                      init={"calibration": _cal(corpus_dir)})
        assert all(layer["rope_key_energy_kept"] == pytest.approx(1.0) for layer in rep["layers"])
        models[mode] = load(tmp_path / mode)
    ref = dict(models["mean"].named_parameters())
    for mode in ("rorope", "rorope_act"):
        for name, p in models[mode].named_parameters():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-6, msg=name)
    assert logit_error(load(src), models["rorope"], 300) < 1e-4


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_rorope_keeps_more_key_energy_than_mean(source_factory, corpus_dir, tmp_path, kv_heads):
    """GQA/MHA, full-width latent (only the RoPE key is approximated): rorope beats mean on held-out keys and
    logits, and rorope_act beats rorope on keys of the calibration domain."""
    src = source_factory("llama", num_key_value_heads=kv_heads, rms_norm_eps=1e-9)
    reps = {}
    for mode in ("mean", "rorope", "rorope_act"):
        reps[mode] = convert(src, tmp_path / mode, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 8, "rope_key": mode},
                             init={"calibration": _cal(corpus_dir)})
    energy = {m: _mean(r, "rope_key_energy_kept") for m, r in reps.items()}
    k_err = {m: _mean(r, "heldout_key_rel_error") for m, r in reps.items()}
    kl = {m: r["heldout"]["kl_source_to_converted"] for m, r in reps.items()}
    assert energy["rorope"] > energy["mean"], energy
    assert k_err["rorope"] < k_err["mean"], k_err
    assert k_err["rorope_act"] < k_err["rorope"], k_err
    assert kl["rorope"] < kl["mean"], kl


def test_rorope_act_needs_calibration(source_factory, tmp_path):
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.recipe.schema import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="mla.rope_key=rorope_act need calibration data"):
        load_recipe(ConvertRecipe, data={"model": "m", "output_dir": "o",
                                         "mla": {"kv_lora_rank": 8, "rope_key": "rorope_act"}})
