"""The conversion presets side by side on one model, no training: `init.preset` x KV ratio, in one run.

    python scripts/bench_init.py --model models/smollm2-135m-instruct --out runs/bench_init/smollm2
    python scripts/bench_init.py --model M --out O --presets xecomla best --budgets 64+32

For each preset (xecomla, mha2mla, transmla, care, best; `ecomla convert --help` lists their keys) and each
budget r_kv + d_r, it converts the model with `ecomla convert`'s own code, every preset calibrated on the same
`pytext:calibration` tokens (the weights-only presets read them only where their keys need data: mha2mla's
2-norm RoPE dims), and measures it against the source on held-out blocks of both pytext domains: perplexity,
KL(source‖converted), top-1 agreement per token, and the conversion's wall time. Cells are kept in OUT/cells/
and reused on a rerun with the same settings. Writes OUT/table.md, OUT/table.json and OUT/chart.png (held-out
perplexity against compression, one line per preset, one panel per domain). The multiple-choice task scores
are not measured here (`ecomla eval` on a kept checkpoint gives them).

    python scripts/bench_init.py --model M --out O --presets best --ablate
    python scripts/bench_init.py --model M --out O --ablate 64+32

--ablate adds, for each budget (or only for those it names), `best` with each of its levers switched off
(`presets.BEST_LEVERS`; rows named best-no-LEVER), so every lever is measured end to end against the same
recipe without it, in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ecomla.analyze.cells import cell_settings, plot_perplexity, run_cells
from ecomla.analyze.yardstick import Yardstick
from ecomla.convert import presets
from ecomla.convert.recipe import preset_recipe
from ecomla.convert.stream import convert_recipe
from ecomla.mla.budget import parse_budget

# One budget per ratio of SmolLM2's 384 cached numbers: 2.0x, 3.0x, 4.0x, 6.4x
BUDGETS = ("128+64", "64+64", "64+32", "28+32")


def convert(args, preset: str, r_kv: int, d_r: int, out: Path, off: dict | None = None) -> dict:
    """One cell: `preset` at r_kv + d_r, with the keys in `off` (section -> key -> value) set over it."""
    recipe = preset_recipe(args.model, str(out), preset, r_kv, d_r, calibration_tokens=args.calibration_tokens,
                                   seq_len=args.seq_len, overrides=off)
    return convert_recipe(recipe, force=True, progress=False)


def ablations() -> dict[str, dict]:
    """best-no-LEVER -> the keys that switch that lever off."""
    return {f"best-no-{lever}": off for lever, off in presets.BEST_LEVERS.items()}


def table(rows: list[dict], source: dict, wall: float | None) -> str:
    lines = [f"Source: held-out perplexity {source['prose']:.2f} (prose), {source['code']:.2f} (code)."
             + (f" Whole run: {wall / 60:.1f} min." if wall else ""), "",
             "| r_kv + d_r | ratio | preset | ppl prose | ppl code | KL prose | KL code | top-1 prose | top-1 code "
             "| convert s |", "|" + "---|" * 10]
    for r in sorted(rows, key=lambda r: (r["compression"], r["prose"]["converted_perplexity"])):
        p, c = r["prose"], r["code"]
        lines.append(f"| {r['budget']} | {r['compression']:.2f}× | {r['preset']} "
                     f"| {p['converted_perplexity']:,.1f} | {c['converted_perplexity']:,.1f} "
                     f"| {p['kl_source_to_converted']:.3f} | {c['kl_source_to_converted']:.3f} "
                     f"| {p['top1_agreement']:.1%} | {c['top1_agreement']:.1%} | {r['convert_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import time

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="source checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (cells/, table.md, table.json, chart.png)")
    p.add_argument("--presets", nargs="+", default=list(presets.PRESET_NAMES), choices=list(presets.PRESET_NAMES),
                   help="presets to run (default: all)")
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=[parse_budget(b) for b in BUDGETS],
                   help=f"R_KV+D_R budgets (default: {' '.join(BUDGETS)})")
    p.add_argument("--calibration-tokens", type=int, default=16384, help="calibration tokens, every preset")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per domain")
    p.add_argument("--seq-len", type=int, default=512, help="block length for calibration and held-out text")
    p.add_argument("--ablate", nargs="*", type=parse_budget, default=None, metavar="R_KV+D_R",
                   help="also convert best with each of its levers switched off (rows best-no-LEVER), at the "
                   "budgets given (none given: at every budget of --budgets)")
    args = p.parse_args(argv)
    ablate = [] if args.ablate is None else (args.ablate or args.budgets)
    unknown = [f"{r}+{d}" for r, d in ablate if (r, d) not in args.budgets]
    if unknown:
        p.error(f"--ablate {' '.join(unknown)}: not among --budgets; add them to --budgets")
    t0 = time.time()
    out = Path(args.out)
    yardstick = Yardstick(args.model, args.eval_tokens, args.seq_len)
    settings = {**cell_settings(args.model, args.calibration_tokens, args.eval_tokens, args.seq_len),
                "presets": presets.PRESETS, "levers": presets.BEST_LEVERS}
    variants = [(name, None) for name in args.presets]
    cells = [(f"{name}_{r_kv}+{d_r}", {"preset": name, "budget": f"{r_kv}+{d_r}", "kv_lora_rank": r_kv,
                                       "qk_rope_head_dim": d_r},
              lambda o, off=off, base=name.split("-no-")[0], r=r_kv, d=d_r: convert(args, base, r, d, o, off))
             for (r_kv, d_r) in args.budgets
             for name, off in variants + (list(ablations().items()) if (r_kv, d_r) in ablate else [])]
    rows = run_cells(out, cells, yardstick, settings)
    wall = time.time() - t0
    (out / "table.json").write_text(json.dumps({"source": yardstick.source, "wall_seconds": wall, "rows": rows},
                                               indent=2) + "\n")
    text = table(rows, yardstick.source, wall)
    (out / "table.md").write_text(text)
    plot_perplexity(rows, yardstick.source, out / "chart.png", "preset", args.presets)  # the ablations: table only
    print(text, end="")
    print(f"wrote {out}/table.md, table.json and chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
