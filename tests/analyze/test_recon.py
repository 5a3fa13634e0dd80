"""`ecomla analyze recon` writes the seed-000-shaped chart data, and its numbers behave."""

from __future__ import annotations

import json

import yaml

from ecomla.cli import main


def test_recon_cli(source_factory, corpus_dir, tmp_path, capsys):
    src = source_factory("llama", num_key_value_heads=2)
    recipe = {
        "model": str(src),
        "output_dir": str(tmp_path / "recon"),
        "calibration": {"name": "A", "dataset": str(corpus_dir / "a_fit.jsonl")},
        "heldout": [
            {"name": "A", "dataset": str(corpus_dir / "a_held.jsonl")},
            {"name": "B", "dataset": str(corpus_dir / "b_held.jsonl")},
        ],
        "token_counts": [64, 256, 1024, 4096],
        "heldout_tokens": 2048,
        "seq_len": 64,
        "mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8},
    }
    path = tmp_path / "recon.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["analyze", "recon", str(path), "--quiet"]) == 0
    out = json.loads((tmp_path / "recon" / "recon.json").read_text())
    assert (tmp_path / "recon" / "recon.png").stat().st_size > 10_000
    assert (tmp_path / "recon" / "ecomla_recipe.yaml").exists()
    series = {s["name"]: s["error"] for s in out["series"]}
    assert set(series) == {"Key A -> A", "Value A -> A", "Key A -> B", "Value A -> B"}
    print(json.dumps(series, indent=1))
    for name in ("Key A -> A", "Value A -> A"):
        assert series[name][-1] < series[name][0], (name, series[name])
    for part in ("Key", "Value"):  # out of domain is worse once the fit has enough tokens
        assert series[f"{part} A -> B"][-1] > series[f"{part} A -> A"][-1]


def recon_recipe(src, corpus_dir, out, **mla) -> dict:
    return {
        "model": str(src),
        "output_dir": str(out),
        "calibration": {"name": "A", "dataset": str(corpus_dir / "a_fit.jsonl")},
        "heldout": [{"name": "A", "dataset": str(corpus_dir / "a_held.jsonl")}],
        "token_counts": [256, 1024],
        "heldout_tokens": 1024,
        "seq_len": 64,
        "mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8, **mla},
    }


def test_recon_honours_rope_residual(source_factory, corpus_dir, tmp_path):
    """The residual RoPE key rides in the latent under `latent`, and is left out under `drop`: different errors."""
    from ecomla.analyze.recon import ReconRecipe, run_recon
    from ecomla.recipe.schema import load_recipe

    src = source_factory("llama", num_key_value_heads=2)
    errors = {}
    for residual in ("drop", "latent", "latent_mean"):
        data = recon_recipe(src, corpus_dir, tmp_path / residual, rope_key="rorope_act", rope_residual=residual)
        out = run_recon(load_recipe(ReconRecipe, data=data), progress=False)
        errors[residual] = {s["name"]: s["error"] for s in out["series"]}
    assert errors["latent"] != errors["drop"]
    # the latent now also carries the residual key rows: the key error it measures includes them
    assert errors["latent"]["Key A -> A"] != errors["drop"]["Key A -> A"]
    # latent_mean differs from latent only in the query rows, which play no part in the K/V error
    assert errors["latent_mean"] == errors["latent"]


def test_recon_refuses_mla_keys_it_does_not_read(tmp_path, capsys):
    from ecomla.analyze.recon import UNREAD_MLA_KEYS

    recipe = {
        "model": "unused", "output_dir": str(tmp_path / "recon"),
        "calibration": {"dataset": "pytext:calibration:code"}, "heldout": [{"dataset": "pytext:heldout:code"}],
        "mla": {"kv_lora_rank": 16, "rope_key": "rorope", "rope_residual": "drop", "rank_allocation": "energy",
                "rope_allocation": "energy", "q_lora_rank": 32},
    }
    path = tmp_path / "recon.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["analyze", "recon", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    for key in ("rank_allocation", "rope_allocation", "q_lora_rank"):
        assert f"mla.{key}: analyze recon does not read this key" in err
    assert "mla.rope_residual" not in err  # read: see test_recon_honours_rope_residual
    assert "rope_residual" not in UNREAD_MLA_KEYS and not (tmp_path / "recon").exists()
