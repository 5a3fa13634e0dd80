"""scripts/bench_init.py on a tiny random Llama: every preset at two budgets in one run, and a rerun that reuses them.

Proves: each preset converts (its expansion recorded), is measured on both pytext domains against the source,
and the wider latent of the same preset is no worse on KL; a rerun reuses every cell.
"""

from __future__ import annotations

import json

from tests.scripts.test_oneshot_table import run_small


def _run(src, out):
    return run_small(src, out, "bench_init.py")


def test_every_preset_at_every_budget_then_a_rerun_reuses_them(source_factory, tmp_path):
    from ecomla.convert.presets import PRESET_NAMES

    src = source_factory("llama")  # 2 KV heads of 16: 64 cached numbers per token and layer
    proc = _run(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads((tmp_path / "out" / "table.json").read_text())
    rows = {(r["preset"], r["budget"]): r for r in table["rows"]}
    assert set(rows) == {(name, b) for name in PRESET_NAMES for b in ("16+8", "64+8")}
    for name in PRESET_NAMES:
        small, wide = rows[(name, "16+8")], rows[(name, "64+8")]
        assert small["compression"] == 64 / 24 and wide["compression"] == 64 / 72
        for domain in ("prose", "code"):
            assert wide[domain]["source_perplexity"] == table["source"][domain]
            assert 0 < wide[domain]["kl_source_to_converted"] <= small[domain]["kl_source_to_converted"] * 1.05
    assert table["wall_seconds"] > 0
    assert "| 16+8 |" in (tmp_path / "out" / "table.md").read_text()
    assert (tmp_path / "out" / "chart.png").stat().st_size > 10_000
    assert not (tmp_path / "out" / "ckpt").exists()
    again = _run(src, tmp_path / "out")
    assert again.returncode == 0 and again.stdout.count(": reused") == len(rows)
