"""Convert-and-measure cells with no training: the loop the one-shot table (`scripts/oneshot_table.py`) and the
preset bench (`scripts/bench_init.py`) share, and their chart of held-out perplexity against compression.

A cell is (name, fields, convert(out_dir) -> conversion report). Each finished cell is written to
OUT/cells/NAME.json with the settings it was measured under, so a rerun reuses it only while those match, and an
interrupted run resumes. The checkpoint is deleted once measured.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ecomla.analyze.yardstick import DOMAINS, Yardstick
from ecomla.io.publish import publish

Cell = tuple[str, dict, Callable[[Path], dict]]


def cell_settings(model: str | Path, calibration_tokens: int, eval_tokens: int, seq_len: int) -> dict:
    """What a cell's numbers depend on besides its recipe: a cell is reused only when these match."""
    return {"model": str(Path(model).resolve()), "calibration_tokens": calibration_tokens,
            "eval_tokens": eval_tokens, "seq_len": seq_len}


def run_cells(out: Path, cells: Sequence[Cell], yardstick: Yardstick, settings: dict) -> list[dict]:
    """Convert and measure each cell in turn (or reuse its OUT/cells/NAME.json); the rows in cell order."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, fields, convert_cell) in enumerate(cells, 1):
        cell = out / "cells" / f"{name}.json"
        kept = json.loads(cell.read_text()) if cell.is_file() else None
        if kept is not None and kept.get("settings") == settings:
            rows.append(kept)
            print(f"[{i}/{len(cells)}] {name}: reused")
            continue
        t0 = time.time()
        ckpt = out / "ckpt"
        report = convert_cell(ckpt)
        row = {**fields, "compression": report["compression_ratio"], **yardstick.measure(ckpt),
               "convert_seconds": report["seconds"], "seconds": time.time() - t0, "settings": settings}
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp = cell.with_name(f".{cell.name}.tmp")
        tmp.write_text(json.dumps(row, indent=2) + "\n")
        publish(tmp, cell)  # a kill leaves the cell whole or absent, never half-written
        rows.append(row)
        print(f"[{i}/{len(cells)}] {name} ({row['compression']:.2f}x): ppl prose "
              f"{row['prose']['converted_perplexity']:,.1f}, code {row['code']['converted_perplexity']:,.1f} "
              f"({row['seconds']:.0f} s)", flush=True)
    return rows


def plot_perplexity(rows: list[dict], source: dict, path: Path, key: str, names: Sequence[str],
                    split: str | None = None, splits=(), by_rope_dim: bool = False) -> None:
    """Held-out perplexity against compression, one line per rows' `key` value (in `names` order), a panel per
    domain; with `split`, one row of panels per rows' `split` value (in `splits` order). With `by_rope_dim`, a
    value's budgets of each d_r make their own line, the longest drawn with filled circles, others hollow squares."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(s, [r for r in rows if r[split] == s]) for s in splits] if split else [(None, rows)]
    groups = [(s, g) for s, g in groups if g]
    fig, axes = plt.subplots(len(groups), len(DOMAINS), figsize=(11, 4.4 * len(groups)), squeeze=False)
    for (group, members), panel_row in zip(groups, axes):
        for ax, domain in zip(panel_row, DOMAINS):
            for i, name in enumerate(names):
                chains: dict = {}  # with by_rope_dim, one line per d_r (budgets that differ only in r_kv)
                for r in members:
                    if r[key] == name:
                        chains.setdefault(r["qk_rope_head_dim"] if by_rope_dim else None, []).append(
                            (r["compression"], r[domain]["converted_perplexity"]))
                for j, pts in enumerate(sorted(chains.values(), key=len, reverse=True)):
                    ax.plot(*zip(*sorted(pts)), marker="o" if j == 0 else "s", color=f"C{i}",
                            label=name if j == 0 else None, fillstyle="full" if j == 0 else "none")
            ax.axhline(source[domain], color="k", linestyle="--", label="source")
            ax.set_yscale("log")
            ax.set_xlabel("KV compression (×)")
            ax.set_ylabel("held-out perplexity (log)")
            ax.set_title(f"{domain}, no training" + (f", {split} {group}" if split else "")
                         + (" (hollow squares: other d_r)" if by_rope_dim else ""), fontsize=10)
            ax.grid(alpha=0.3, which="both")
        panel_row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
