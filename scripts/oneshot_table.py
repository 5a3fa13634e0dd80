"""The one-shot table: every conversion recipe a user would try, at several budgets, with no training.

    python scripts/oneshot_table.py --model models/smollm2-135m-instruct --out runs/oneshot/smollm2
    python scripts/oneshot_table.py --model M --out O --recipes xecomla act_high_rorope_act --budgets 64+32 \
        --latent-norms linear

For each recipe (init.method x mla.rope_dims x mla.rope_key), each mla.latent_norm and each budget r_kv + d_r,
it converts the model with `ecomla convert`'s own code (activation inits calibrate on `pytext:calibration`), then
measures the converted model against the source on held-out blocks of both pytext domains: perplexity,
KL(source‖converted) and top-1 agreement per token. Each cell is written to OUT/cells/NAME.json as it finishes, and a rerun
reuses the cells whose settings match, so an interrupted run resumes. Writes OUT/table.md, OUT/table.json and
OUT/chart.png (held-out perplexity against compression, one line per recipe, one panel per domain and latent
norm).
Converted checkpoints are deleted once measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from ecomla.analyze.yardstick import DOMAINS, Yardstick
from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.stream import convert_recipe
from ecomla.mla.budget import parse_budget
from ecomla.recipe.schema import load_recipe

# name -> (init.method, mla.rope_dims, mla.rope_key); the first is X-EcoMLA's recipe, the converter's defaults
RECIPES = {
    "xecomla": ("svd", "last", "mean"),
    "svd_high_mean": ("svd", "high", "mean"),
    "svd_high_rorope": ("svd", "high", "rorope"),
    "act_last_mean": ("activation", "last", "mean"),
    "act_high_mean": ("activation", "high", "mean"),
    "act_norm_rorope_act": ("activation", "norm", "rorope_act"),
    "act_high_rorope_act": ("activation", "high", "rorope_act"),
}
BUDGETS = ("160+32", "96+32", "64+32", "28+32", "128+64")
# mla.latent_norm: normalize (the converter's default; stock RMSNorm rescales every token's latent) and linear
# (the latent kept in the norm's linear regime, docs/convert.md#the-levers-of-best)
LATENT_NORMS = ("normalize", "linear")


def convert(args, name: str, r_kv: int, d_r: int, out: Path, latent_norm: str = "normalize") -> dict:
    method, dims, key = RECIPES[name]
    data = {"model": args.model, "output_dir": str(out), "dtype": "float32", "device": "cpu",
            "mla": {"kv_lora_rank": r_kv, "qk_rope_head_dim": d_r, "rope_dims": dims, "rope_key": key,
                    "latent_norm": latent_norm},
            "init": {"method": method}}
    if method == "activation":
        data["init"]["calibration"] = {"dataset": "pytext:calibration", "num_tokens": args.calibration_tokens,
                                       "seq_len": args.seq_len, "heldout_tokens": 0}
    recipe = load_recipe(ConvertRecipe, data=data)
    return convert_recipe(recipe, force=True, progress=False)


def run_settings(args) -> dict:
    """What a cell's numbers depend on besides its recipe: a cell is reused only when these match."""
    return {"model": str(Path(args.model).resolve()), "calibration_tokens": args.calibration_tokens,
            "eval_tokens": args.eval_tokens, "seq_len": args.seq_len}


def run_cells(out: Path, cells: list, yardstick: Yardstick, settings: dict) -> list[dict]:
    """Convert and measure each (name, fields, convert(out_dir) -> report) cell; OUT/cells/NAME.json per cell,
    reused on a rerun when its settings match. The checkpoint is deleted once measured."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (name, fields, convert_cell) in enumerate(cells, 1):
        cell = out / "cells" / f"{name}.json"
        if cell.is_file() and json.loads(cell.read_text()).get("settings") == settings:
            rows.append(json.loads(cell.read_text()))
            print(f"[{i}/{len(cells)}] {name}: reused")
            continue
        t0 = time.time()
        ckpt = out / "ckpt"
        report = convert_cell(ckpt)
        row = {**fields, "compression": report["compression_ratio"], **yardstick.measure(ckpt),
               "convert_seconds": report["seconds"], "seconds": time.time() - t0, "settings": settings}
        shutil.rmtree(ckpt, ignore_errors=True)
        cell.write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
        print(f"[{i}/{len(cells)}] {name} ({row['compression']:.2f}x): ppl prose "
              f"{row['prose']['converted_perplexity']:,.1f}, code {row['code']['converted_perplexity']:,.1f} "
              f"({row['seconds']:.0f} s)", flush=True)
    return rows


def plot(rows: list[dict], source: dict, path: Path, key: str = "recipe", names=tuple(RECIPES),
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


def table(rows: list[dict], source: dict) -> str:
    lines = [f"Source: held-out perplexity {source['prose']:.2f} (prose), {source['code']:.2f} (code).", "",
             "| recipe | init | rope_dims | rope_key | latent_norm | r_kv + d_r | ratio | ppl prose | ppl code | KL prose "
             "| KL code | top-1 prose | top-1 code | seconds |", "|" + "---|" * 14]
    for r in sorted(rows, key=lambda r: (r["compression"], r["budget"], r["prose"]["converted_perplexity"])):
        method, dims, key = RECIPES[r["recipe"]]
        p, c = r["prose"], r["code"]
        lines.append(f"| {r['recipe']} | {method} | {dims} | {key} | {r['latent_norm']} | {r['budget']} "
                     f"| {r['compression']:.2f}× | {p['converted_perplexity']:,.1f} | {c['converted_perplexity']:,.1f} "
                     f"| {p['kl_source_to_converted']:.3f} | {c['kl_source_to_converted']:.3f} "
                     f"| {p['top1_agreement']:.1%} | {c['top1_agreement']:.1%} | {r['seconds']:.0f} |")
    return "\n".join(lines + ["", *trends(rows), "", *ranking(rows)]) + "\n"


def mean_kl(row: dict) -> float:
    return sum(row[d]["kl_source_to_converted"] for d in DOMAINS) / len(DOMAINS)


def trends(rows: list[dict]) -> list[str]:
    """Per recipe, latent norm and d_r (budgets that share d_r differ only in r_kv): KL on both domains at each
    ratio, and whether it grows with every step of compression on both."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["recipe"], r["latent_norm"], r["qk_rope_head_dim"]), []).append(r)
    lines = ["Does error grow with compression? KL(source‖converted), prose / code, at each ratio of one d_r:", "",
             "| recipe | latent_norm | d_r | KL by ratio | grows |", "|---|---|---|---|---|"]
    order = {name: i for i, name in enumerate(RECIPES)}
    for (name, norm, d_r), group in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][1], order[kv[0][0]])):
        if len(group) < 2:
            continue
        group.sort(key=lambda r: r["compression"])
        kl = {d: [r[d]["kl_source_to_converted"] for r in group] for d in DOMAINS}
        grows = all(b > a for d in DOMAINS for a, b in zip(kl[d], kl[d][1:]))
        steps = " → ".join(f"{r['compression']:.1f}×: {r['prose']['kl_source_to_converted']:.2f} / "
                           f"{r['code']['kl_source_to_converted']:.2f}" for r in group)
        lines.append(f"| {name} | {norm} | {d_r} | {steps} | {'yes' if grows else '**no**'} |")
    return lines


def ranking(rows: list[dict]) -> list[str]:
    """The cells at each ratio, best first by KL(source‖converted) averaged over the two domains."""
    lines = ["Rank at each ratio (mean KL of the two domains, lowest first):", ""]
    for ratio in sorted({round(r["compression"], 2) for r in rows}):
        cells = sorted((r for r in rows if round(r["compression"], 2) == ratio), key=mean_kl)
        lines.append(f"- {ratio:.2f}×: " + ", ".join(f"{i}. {r['recipe']} {r['latent_norm']} {r['budget']} ({mean_kl(r):.2f})"
                                                      for i, r in enumerate(cells, 1)))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="source checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (cells/, table.md, table.json, chart.png)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), help="recipes to run")
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=[parse_budget(b) for b in BUDGETS],
                   help=f"R_KV+D_R budgets (default: {' '.join(BUDGETS)})")
    p.add_argument("--latent-norms", nargs="+", default=list(LATENT_NORMS), choices=LATENT_NORMS,
                   help="mla.latent_norm values to convert each recipe with (default: both)")
    p.add_argument("--calibration-tokens", type=int, default=16384, help="activation inits: calibration tokens")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per domain")
    p.add_argument("--seq-len", type=int, default=512, help="block length for calibration and held-out text")
    p.add_argument("--table-only", action="store_true",
                   help="rebuild table.md, table.json and chart.png from the finished cells; convert nothing")
    args = p.parse_args(argv)
    if args.table_only:
        rows = [json.loads(c.read_text()) for c in sorted((Path(args.out) / "cells").glob("*.json"))]
        if not rows:
            p.error(f"{args.out}/cells holds no finished cell")
        return write_outputs(Path(args.out), rows, {d: rows[0][d]["source_perplexity"] for d in DOMAINS})

    out = Path(args.out)
    yardstick = Yardstick(args.model, args.eval_tokens, args.seq_len)
    settings = run_settings(args)
    cells = [(f"{name}_{norm}_{r_kv}+{d_r}",
              {"recipe": name, "latent_norm": norm, "budget": f"{r_kv}+{d_r}", "kv_lora_rank": r_kv,
               "qk_rope_head_dim": d_r},
              lambda o, n=name, r=r_kv, d=d_r, ln=norm: convert(args, n, r, d, o, ln))
             for norm in args.latent_norms for (r_kv, d_r) in args.budgets for name in args.recipes]
    rows = run_cells(out, cells, yardstick, settings)
    return write_outputs(out, rows, yardstick.source)


def write_outputs(out: Path, rows: list[dict], source: dict) -> int:
    for row in rows:
        row.setdefault("latent_norm", "normalize")  # cells written before the table had the column
    (out / "table.json").write_text(json.dumps({"source": source, "rows": rows}, indent=2) + "\n")
    text = table(rows, source)
    (out / "table.md").write_text(text)
    plot(rows, source, out / "chart.png", split="latent_norm", splits=LATENT_NORMS, by_rope_dim=True)
    print(text, end="")
    print(f"wrote {out}/table.md, table.json and chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
