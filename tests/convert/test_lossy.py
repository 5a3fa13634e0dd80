"""Lossy conversions get better with budget, and calibration beats weights-only SVD in its domain."""

from __future__ import annotations

import json

import pytest

from tests.convert.helpers import convert, load, logit_error


def _calibration(corpus_dir, domain="a", **kw):
    return {
        "dataset": str(corpus_dir / f"{domain}_fit.jsonl"),
        "heldout": {"dataset": str(corpus_dir / f"{domain}_held.jsonl")},
        "num_tokens": 4096,
        "heldout_tokens": 2048,
        "seq_len": 64,
        **kw,
    }


def _mean(report, key):
    return sum(layer[key] for layer in report["layers"]) / len(report["layers"])


# Ranks run up to where the latent holds every no-RoPE key and value row:
# hidden size 64 for MHA, and rank(M) = 2 KV heads × (8 + 16) = 48 for GQA.
@pytest.mark.parametrize("kv_heads, ranks", [(4, (8, 24, 48, 64)), (2, (8, 16, 32, 48))], ids=["mha", "gqa"])
def test_error_falls_as_rank_grows(source_factory, corpus_dir, tmp_path, kv_heads, ranks):
    src_dir = source_factory("llama", num_key_value_heads=kv_heads, rms_norm_eps=1e-9)
    src = load(src_dir)
    logit_err, k_err, v_err = [], [], []
    for r in ranks:
        out = tmp_path / f"r{r}"
        rep = convert(src_dir, out, mla={"kv_lora_rank": r, "qk_rope_head_dim": 8},
                      init={"method": "svd", "calibration": _calibration(corpus_dir)})
        logit_err.append(logit_error(src, load(out), src.config.vocab_size))
        k_err.append(_mean(rep, "heldout_key_rel_error"))
        v_err.append(_mean(rep, "heldout_value_rel_error"))
    for series in (logit_err, k_err, v_err):
        assert all(a > b for a, b in zip(series, series[1:])), series
    if ranks[-1] == 64:  # full width: the latent is an isometry, values are exact
        assert v_err[-1] < 1e-4


def test_activation_beats_svd_in_domain(source_factory, corpus_dir, tmp_path):
    src_dir = source_factory("llama", num_key_value_heads=2)
    cal = _calibration(corpus_dir)
    results = {}
    for method in ("svd", "activation"):
        rep = convert(src_dir, tmp_path / method, mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8},
                      init={"method": method, "calibration": cal})
        results[method] = rep
    for key in ("heldout_key_rel_error", "heldout_value_rel_error"):
        assert _mean(results["activation"], key) < _mean(results["svd"], key)
    # Closer to the source where it matters: the output distribution on held-out text.
    kl = {m: r["heldout"]["kl_source_to_converted"] for m, r in results.items()}
    assert kl["activation"] < kl["svd"], kl
    src_ppl = results["svd"]["heldout"]["source_perplexity"]
    assert abs(src_ppl - results["activation"]["heldout"]["source_perplexity"]) < 1e-9
    # the report on disk is the one returned
    on_disk = json.loads((tmp_path / "activation" / "conversion_report.json").read_text())
    assert on_disk["heldout"] == results["activation"]["heldout"]


def test_random_init_is_worse_than_svd(source_factory, tmp_path):
    src_dir = source_factory("llama")
    src = load(src_dir)
    errs = {}
    for method in ("svd", "random"):
        convert(src_dir, tmp_path / method, mla={"kv_lora_rank": 32, "qk_rope_head_dim": 8}, init={"method": method})
        errs[method] = logit_error(src, load(tmp_path / method), src.config.vocab_size)
    assert errs["svd"] < errs["random"]


def test_a_linear_latents_reported_errors_are_on_the_source_scale(source_factory, corpus_dir, tmp_path):
    """The held-out K/V errors compare both sides at the source's scale, whichever latent norm stores the latent:
    a linear latent's gain (about 1e-3) is undone, so its errors are relative errors below 1 like a normalized
    latent's, and exact (≈0 for values) at full width, where the linear latent is exact too."""
    src_dir = source_factory("llama", rms_norm_eps=1e-9)
    cal = _calibration(corpus_dir)
    errors = {}
    for norm in ("normalize", "linear"):
        for r in (16, 64):
            rep = convert(src_dir, tmp_path / f"{norm}{r}", mla={"kv_lora_rank": r, "qk_rope_head_dim": 8,
                                                                 "latent_norm": norm},
                          init={"method": "activation", "calibration": cal})
            errors[norm, r] = (_mean(rep, "heldout_key_rel_error"), _mean(rep, "heldout_value_rel_error"))
    for r in (16, 64):
        assert all(e < 1 for e in errors["linear", r]), errors
    assert errors["linear", 64][1] < 1e-3 and errors["linear", 16][1] > 10 * errors["linear", 64][1], errors
    # same fit, same subspace: the two norms' errors are of one size (linear has no per-token rescale to absorb)
    assert errors["linear", 16][0] < 2 * errors["normalize", 16][0], errors
