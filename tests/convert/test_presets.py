"""`init.preset` (the peers' recipes as named key sets) and `init.kv_balance` (TransMLA's balanced K/V PCA)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ecomla.convert import presets
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.to_mla import balance_scale, balanced_rows, make_fitter
from ecomla.mla import latent
from ecomla.recipe.schema import RecipeError, load_recipe
from tests.convert.helpers import convert, load, logit_error


def _recipe(**sections) -> ConvertRecipe:
    data = {"model": "m", "output_dir": "o", "mla": {"kv_lora_rank": 8}, **sections}
    return load_recipe(ConvertRecipe, data=data)


def _cal(corpus_dir):
    return {"dataset": str(corpus_dir / "a_fit.jsonl"), "heldout": {"dataset": str(corpus_dir / "a_held.jsonl")},
            "num_tokens": 4096, "heldout_tokens": 2048, "seq_len": 64}


@pytest.mark.parametrize("name", presets.PRESET_NAMES)
def test_each_preset_expands_into_its_keys(name):
    r = _recipe(init={"preset": name, "calibration": {"dataset": "x"}})
    for section, keys in presets.PRESETS[name].items():
        for key, value in keys.items():
            assert getattr(getattr(r, section), key) == value, (name, section, key)
    assert r.mla.kv_lora_rank == 8  # the shape stays the recipe's
    assert presets.expansion(name, r.mla, r.init)["overridden"] == {}


def _settings(r: ConvertRecipe) -> tuple:
    return tuple(getattr(getattr(r, sec), key) for sec, key in sorted(presets.PRESET_KEYS))


def test_presets_differ_from_each_other_and_xecomla_is_the_base():
    expanded = {name: _recipe(init={"preset": name, "calibration": {"dataset": "x"}}) for name in presets.PRESET_NAMES}
    settings = {name: _settings(r) for name, r in expanded.items()}
    assert len(set(settings.values())) == len(settings), settings
    base = _recipe(init={"preset": None})
    assert base.init.preset is None and presets.expansion(None, base.mla, base.init) is None
    assert (base.init.method, base.mla.rope_dims, base.mla.rope_key, base.mla.latent_norm) == (
        expanded["xecomla"].init.method, expanded["xecomla"].mla.rope_dims, expanded["xecomla"].mla.rope_key,
        "normalize")


def test_the_shortest_recipe_gets_the_best_measured_preset_for_its_inputs():
    """No preset and no preset key: auto takes best with calibration text and nodata without, and says so; any
    preset key the recipe sets (or preset null) keeps the base defaults for the rest."""
    calibration = {"dataset": "x"}
    for given, name in (({"calibration": calibration}, "best"), ({}, "nodata")):
        r = _recipe(init=given) if given else _recipe()
        assert r.init.preset == "auto" and _settings(r) == _settings(_recipe(init={"preset": name, **given}))
        rep = presets.expansion(r.init.preset, r.mla, r.init)
        assert rep["name"] == name and rep["overridden"] == {}
        assert rep["auto"].startswith("calibration text given" if given else "no calibration text")
    base = _settings(_recipe(init={"preset": None}))
    mla = {"kv_lora_rank": 8, "rope_dims": "high"}
    own = _recipe(mla=mla, init={"calibration": calibration})
    assert own.init.preset is None and own.mla.rope_dims == "high"
    assert _settings(own) == _settings(_recipe(mla=mla, init={"preset": None, "calibration": calibration}))
    assert _settings(_recipe(init={"preset": None, "calibration": calibration})) == base
    gqa = load_recipe(ConvertRecipe, data={"model": "m", "output_dir": "o", "target": "gqa",
                                           "gqa": {"num_key_value_heads": 1}})
    assert gqa.init.preset == "auto"  # other targets refuse a changed init; the default is not a change


def test_a_key_the_recipe_sets_wins_and_is_recorded_as_overridden():
    r = _recipe(mla={"kv_lora_rank": 8, "rope_dims": "low"}, init={"preset": "transmla", "calibration": {"dataset": "x"}})
    assert r.mla.rope_dims == "low" and r.mla.rope_key == "rorope_act" and r.init.kv_balance
    assert presets.expansion("transmla", r.mla, r.init)["overridden"] == {"mla.rope_dims": "low"}


def test_bad_presets_are_named_with_the_fix():
    with pytest.raises(RecipeError, match=r"init.preset: 'trnsmla' is not one of .*did you mean 'transmla'"):
        _recipe(init={"preset": "trnsmla"})
    with pytest.raises(RecipeError, match=r"init.calibration: init.method=activation.*\(init.preset care\)"):
        _recipe(init={"preset": "care"})  # the preset asks for calibration the recipe does not give
    with pytest.raises(RecipeError, match=r"init: only target mla reads this section"):
        load_recipe(ConvertRecipe, data={"model": "m", "output_dir": "o", "target": "mqa", "init": {"preset": "xecomla"}})


def test_the_xecomla_preset_writes_the_default_conversion_and_the_report_records_it(source_factory, tmp_path):
    src = source_factory("llama", num_key_value_heads=2)
    mla = {"kv_lora_rank": 24, "qk_rope_head_dim": 8}
    plain = convert(src, tmp_path / "plain", mla=mla)
    preset = convert(src, tmp_path / "preset", mla=mla, init={"preset": "xecomla"})
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "preset" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain["preset"] is None
    assert preset["preset"] == {"name": "xecomla", "keys": {"init.method": "svd", "mla.rope_dims": "last",
                                                            "mla.rope_key": "mean"}, "overridden": {}}
    assert preset["recipe"]["init"]["preset"] == "xecomla"


@pytest.mark.parametrize("name", ["mha2mla", "transmla", "care", "best"])
def test_every_calibrated_preset_converts_and_is_exact_at_full_width(source_factory, corpus_dir, tmp_path, name):
    """MQA source, r_kv = hidden, d_r = d_h: no preset may lose anything where nothing needs to be lost. Measured
    on held-out text of the calibration's domain: the activation fits are least squares over the inputs the
    calibration reaches, so random token ids off that span are no yardstick for them. A linear latent writes
    rms_norm_eps = 1e-6 (the ε transformers hard-codes for kv_a_layernorm) for every norm, so its source takes that
    ε (a tiny random model's residual stream is small enough to feel any other); a normalized latent needs a
    negligible source ε for ‖y‖² = d (test_exact.py)."""
    linear = presets.PRESETS[name]["mla"].get("latent_norm") == "linear"
    src = source_factory("llama", num_key_value_heads=1, rms_norm_eps=1e-6 if linear else 1e-9)
    rep = convert(src, tmp_path / name, mla={"kv_lora_rank": 64, "qk_rope_head_dim": 16},
                  init={"preset": name, "calibration": _cal(corpus_dir)})
    assert rep["preset"]["name"] == name
    assert rep["heldout"]["kl_source_to_converted"] < 1e-8
    assert rep["heldout"]["top1_agreement"] == 1.0
    if presets.PRESETS[name]["init"]["method"] == "svd":  # the weights-only fit is exact for any input
        assert logit_error(load(src), load(tmp_path / name), 300) < 1e-3


def test_balance_scale_equalizes_key_and_value_energy():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(12, 10, generator=g, dtype=torch.float64)
    M[:4] *= 0.01
    keys = torch.zeros(12, dtype=torch.bool)
    keys[:4] = True
    y = torch.randn(500, 10, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, 10, dtype=torch.float64)
    cov = latent.second_moment(y)
    for c in (None, cov):
        scaled = M * balance_scale(M, keys, c)[:, None]
        energy = (scaled @ c * scaled).sum(1) if c is not None else scaled.square().sum(1)
        assert float(energy[keys].sum()) == pytest.approx(float(energy[~keys].sum()), rel=1e-9)
        assert torch.equal(scaled[~keys], M[~keys])
    assert torch.equal(balance_scale(M, torch.zeros(12, dtype=torch.bool), cov), torch.ones(12, dtype=torch.float64))


@pytest.mark.parametrize("method", ["svd", "activation"])
def test_kv_balance_trades_value_error_for_key_error_when_keys_are_small(method):
    """Keys 100x smaller than values: the plain fit spends the basis on values; the balanced one reconstructs the
    keys far better (at some cost on values), on held-out inputs."""
    g = torch.Generator().manual_seed(1)
    d, rank = 24, 8
    M = torch.randn(32, d, generator=g, dtype=torch.float64)
    M[:16] *= 0.01
    keys = torch.zeros(32, dtype=torch.bool)
    keys[:16] = True
    y_fit = torch.randn(2000, d, generator=g, dtype=torch.float64)
    y_held = torch.randn(1000, d, generator=g, dtype=torch.float64)
    errs = {}
    for balance in (False, True):
        fit = make_fitter(method, y_fit, 1e-6, torch.Generator(), 0.02)
        basis, up = fit(M, rank, rank, balanced_rows(M, keys) if balance else None)
        out = latent.reconstruct(up, basis.rows, y_held)
        true = y_held @ M.T
        errs[balance] = tuple(latent.relative_error(true[:, part], out[:, part]) for part in (keys, ~keys))
    (k0, v0), (k1, v1) = errs[False], errs[True]
    assert k1 < 0.9 * k0, errs
    assert v1 > v0, errs  # a trade, not a free lunch: the test can tell the two fits apart


def test_the_shortest_recipe_converts_with_nodata_and_says_so(source_factory, tmp_path, capsys):
    """No preset, no conversion key, no calibration text: the conversion is nodata's (the same weights as naming
    it), the report's preset says auto chose it, and `ecomla convert`'s summary prints that."""
    from ecomla.convert.stream import convert_recipe
    from ecomla.convert.summary import print_summary

    src = source_factory("llama", num_key_value_heads=2, rms_norm_eps=1e-6)
    shape = {"kv_lora_rank": 24, "qk_rope_head_dim": 8}
    reports = {}
    for name, init in (("auto", {}), ("named", {"init": {"preset": "nodata"}})):
        recipe = load_recipe(ConvertRecipe, data={"model": str(src), "output_dir": str(tmp_path / name),
                                                  "dtype": "float32", "device": "cpu", "mla": shape, **init})
        reports[name] = convert_recipe(recipe, progress=False)
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("auto", "named"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert reports["auto"]["preset"]["name"] == "nodata" and "auto" not in reports["named"]["preset"]
    print_summary(reports["auto"])
    assert "init: preset nodata (auto: no calibration text; set init.preset to choose another), method svd" in \
        capsys.readouterr().out
