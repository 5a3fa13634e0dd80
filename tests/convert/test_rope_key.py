"""The shared RoPE key: mean (X-EcoMLA) vs RoRoPE head mixing, from weights and from calibration; the residual
RoPE key part (`mla.rope_residual`) and the RoPE slot allocation (`mla.rope_allocation`)."""

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
    """MQA: one key per pair already, so mean, rorope and rorope_act, each with every rope_residual, write
    identical weights (there is no residual, so no extra dims); exactness holds."""
    src = source_factory("llama", num_key_value_heads=1, rms_norm_eps=1e-9)
    models = {}
    for mode in ("mean", "rorope", "rorope_act"):
        for residual in ("drop", "latent", "latent_mean"):
            name = f"{mode}-{residual}"
            rep = convert(src, tmp_path / name, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 16, "rope_key": mode,
                                                     "rope_residual": residual},
                          init={"calibration": _cal(corpus_dir)})
            assert all(layer["rope_key_energy_kept"] == pytest.approx(1.0) for layer in rep["layers"])
            models[name] = load(tmp_path / name)
    ref = dict(models["mean-drop"].named_parameters())
    for name, model in models.items():
        assert model.config.qk_nope_head_dim == 0  # d_r = d_h = 16: every dim keeps RoPE
        for pname, p in model.named_parameters():
            torch.testing.assert_close(p, ref[pname], rtol=0, atol=1e-6, msg=f"{name}: {pname}")
    assert logit_error(load(src), models["rorope-latent_mean"], 300) < 1e-4


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_rorope_keeps_more_key_energy_than_mean(source_factory, corpus_dir, tmp_path, kv_heads):
    """GQA/MHA, full-width latent (only the RoPE key is approximated): rorope beats mean on held-out keys and
    logits, and rorope_act beats rorope on keys of the calibration domain."""
    src = source_factory("llama", num_key_value_heads=kv_heads, rms_norm_eps=1e-9)
    reps = {}
    for mode in ("mean", "rorope", "rorope_act"):
        reps[mode] = convert(src, tmp_path / mode, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 8, "rope_key": mode,
                                                         "rope_residual": "drop"},
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


# ---------------------------------------------------------------- rope_residual

STILL = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 1e6}  # every pair turns < 3e-4 rad over the test


@pytest.mark.parametrize(("family", "q_rank"), [("llama", None), ("qwen2", 65)])
def test_latent_residual_is_exact_when_pairs_do_not_turn(source_factory, corpus_dir, tmp_path, family, q_rank):
    """GQA, full-width latent, RoPE that does not turn: the residual in the latent restores the source exactly,
    where drop loses it. With Qwen2's biases: the residual's key bias is dropped exactly (softmax ignores it)."""
    src = source_factory(family, num_key_value_heads=2, rms_norm_eps=1e-9, rope_parameters=STILL)
    errs = {}
    for residual in ("drop", "latent", "latent_mean"):
        rep = convert(src, tmp_path / residual, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 8, "rope_dims": "high",
                                                     "rope_key": "rorope_act", "rope_residual": residual,
                                                     "q_lora_rank": q_rank},
                      init={"calibration": _cal(corpus_dir)})
        out = load(tmp_path / residual)
        assert rep["rope"]["exact"]
        assert out.config.qk_nope_head_dim == (8 if residual == "drop" else 16)
        assert rep["rope"]["qk_nope_head_dim"] == out.config.qk_nope_head_dim
        errs[residual] = logit_error(load(src), out, 300)
    assert errs["latent"] < 1e-4 and errs["latent_mean"] < 1e-4 and errs["drop"] > 1e-2, errs


def test_latent_mean_fades_fast_pairs_to_drop(source_factory, corpus_dir, tmp_path):
    """θ = 1: every pair turns 1 rad per token, so its rotation averages out over the context and latent_mean
    lands near drop, while latent (rotation ignored) adds a term the source never had."""
    src = source_factory("llama", num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1.0})
    models = {}
    for residual in ("drop", "latent", "latent_mean"):
        convert(src, tmp_path / residual, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 8, "rope_dims": "high",
                                               "rope_key": "rorope", "rope_residual": residual,
                                               "rope_residual_context": 256})
        models[residual] = load(tmp_path / residual)
    near = logit_error(models["latent_mean"], models["drop"], 300)
    far = logit_error(models["latent"], models["drop"], 300)
    assert near < 0.1 * far, (near, far)


def test_latent_residual_lowers_heldout_key_error(source_factory, corpus_dir, tmp_path):
    """Real RoPE, full-width latent: at relative position 0 (pre-RoPE) both latent choices carry the whole key,
    drop loses the residual; the value path is unchanged."""
    src = source_factory("llama", num_key_value_heads=2, rms_norm_eps=1e-9)
    reps = {r: convert(src, tmp_path / r, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 8, "rope_key": "rorope",
                                               "rope_residual": r},
                       init={"calibration": _cal(corpus_dir)})
            for r in ("drop", "latent", "latent_mean")}
    k_err = {r: _mean(rep, "heldout_key_rel_error") for r, rep in reps.items()}
    v_err = {r: _mean(rep, "heldout_value_rel_error") for r, rep in reps.items()}
    assert k_err["latent"] < 1e-5 and k_err["latent_mean"] < 1e-5 and k_err["drop"] > 0.05, k_err
    assert all(v < 1e-5 for v in v_err.values()), v_err
    assert reps["latent_mean"]["rope"]["rope_residual_context"] == 64  # the calibration seq_len
    assert reps["latent"]["params"]["after"] > reps["drop"]["params"]["after"]  # q_proj and kv_b_proj grow ...
    assert reps["latent"]["kv_elements_per_token_per_layer"] == reps["drop"]["kv_elements_per_token_per_layer"]  # not the cache
    from ecomla.convert.summary import summary_lines

    text = "\n".join(summary_lines(reps["latent_mean"]))
    assert "residual latent_mean (averaged over 64 tokens), qk_nope_head_dim 16" in text
    assert "by energy allocation" in text


def test_mean_rope_key_keeps_x_ecomla_shapes(source_factory, tmp_path):
    src = source_factory("llama", num_key_value_heads=2)
    convert(src, tmp_path / "m", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_residual": "latent"})
    assert load(tmp_path / "m").config.qk_nope_head_dim == 8


# ---------------------------------------------------------------- rope_allocation


def _dominant_fast_pairs(path, kv_heads: int = 2, keep: int = 4):
    """Make pairs 0..keep-1 of every key head carry almost all key energy, with the KV heads proportional, so the
    energy allocation keeps one mixture each of pairs 0..keep-1: rope_dims=high, which stock RoPE expresses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    d_h = model.config.hidden_size // model.config.num_attention_heads
    rows = [j for j in range(keep)] + [j + d_h // 2 for j in range(keep)]
    with torch.no_grad():
        for layer in model.model.layers:
            k = layer.self_attn.k_proj.weight.view(kv_heads, d_h, -1)
            k[0, rows] *= 30.0
            for g in range(1, kv_heads):
                k[g, rows] = (g + 1.0) * k[0, rows]
    model.save_pretrained(path)


def test_energy_allocation_is_written_when_stock_rope_expresses_it(source_factory, tmp_path):
    src = source_factory("llama", num_key_value_heads=2, rms_norm_eps=1e-9)
    _dominant_fast_pairs(src)
    rep = convert(src, tmp_path / "energy", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_key": "rorope",
                                                 "rope_allocation": "energy"})
    fixed = convert(src, tmp_path / "high", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_key": "rorope",
                                                 "rope_dims": "high"})
    assert rep["rope"]["exact"] and all(layer["rope_pairs"] == [0, 1, 2, 3] for layer in rep["layers"])
    a, b = load(tmp_path / "energy"), load(tmp_path / "high")
    for name, p in a.named_parameters():
        torch.testing.assert_close(p, dict(b.named_parameters())[name], rtol=0, atol=1e-6, msg=name)
    for layer in fixed["layers"]:
        alloc = layer["rope_allocation"]
        assert alloc["energy_slots"] == {"0": 1, "1": 1, "2": 1, "3": 1}
        assert alloc["energy_energy_kept"] == pytest.approx(alloc["fixed_energy_kept"])


def test_energy_allocation_refused_when_stock_rope_cannot_express_it(source_factory, tmp_path):
    from ecomla.convert.plan import PlanError

    src = source_factory("llama", num_key_value_heads=2)
    fixed = convert(src, tmp_path / "fixed", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_key": "rorope",
                                                  "rope_dims": "high"})
    for layer in fixed["layers"]:  # the report: the greedy allocation keeps at least as much as any fixed one
        alloc = layer["rope_allocation"]
        assert alloc["energy_energy_kept"] >= alloc["fixed_energy_kept"] - 1e-12
        assert sum(alloc["energy_slots"].values()) == 4
    with pytest.raises(PlanError, match="mla.rope_allocation: energy cannot be written"):
        convert(src, tmp_path / "energy", mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8, "rope_key": "rorope",
                                               "rope_allocation": "energy"})
    assert not (tmp_path / "energy").exists()


@pytest.mark.parametrize(
    ("mla", "match"),
    [
        ({"rope_residual": "keep"}, "mla.rope_residual"),
        ({"rope_allocation": "greedy"}, "mla.rope_allocation"),
        ({"rope_residual_context": 0}, "mla.rope_residual_context: must be >= 1"),
        ({"rope_allocation": "energy"}, "mla.rope_allocation: energy allocates the RoRoPE head mixtures"),
        ({"rope_allocation": "energy", "rope_key": "rorope", "rope_dims": "high"}, "mla.rope_dims: not read"),
    ],
)
def test_rope_keys_are_validated(mla, match):
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.recipe.schema import RecipeError, load_recipe

    with pytest.raises(RecipeError, match=match):
        load_recipe(ConvertRecipe, data={"model": "m", "output_dir": "o", "mla": {"kv_lora_rank": 8, **mla}})
