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


def test_recon_refuses_mla_keys_it_does_not_read(tmp_path, capsys):
    from ecomla.analyze.recon import UNREAD_MLA_KEYS

    recipe = {
        "model": "unused", "output_dir": str(tmp_path / "recon"),
        "calibration": {"dataset": "pytext:calibration:code"}, "heldout": [{"dataset": "pytext:heldout:code"}],
        "mla": {"kv_lora_rank": 16, "rope_key": "rorope", "rope_residual": "drop", "rank_allocation": "energy",
                "rope_allocation": "energy"},
    }
    path = tmp_path / "recon.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["analyze", "recon", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    for key in ("rope_residual", "rank_allocation", "rope_allocation"):
        assert f"mla.{key}: analyze recon fits one uniform latent per layer and does not read this key" in err
    assert "rope_residual" in UNREAD_MLA_KEYS and not (tmp_path / "recon").exists()
