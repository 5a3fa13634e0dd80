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
import sys
from pathlib import Path

from ecomla.analyze.cells import cell_settings, plot_perplexity, run_cells
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
    settings = cell_settings(args.model, args.calibration_tokens, args.eval_tokens, args.seq_len)
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
    plot_perplexity(rows, source, out / "chart.png", "recipe", list(RECIPES), split="latent_norm",
                    splits=LATENT_NORMS, by_rope_dim=True)
    print(text, end="")
    print(f"wrote {out}/table.md, table.json and chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
