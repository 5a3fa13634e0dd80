"""The README's tiny-zoo table: per model, params, tokens trained, acc and acc_norm per task, and the average.

    ecomla eval recipes/eval/tiny_zoo.yaml
    ecomla build zoo-table runs/eval/tiny_zoo                    # tokens from zoo/build.json
    ecomla build zoo-table runs/eval/tiny_zoo --build /tmp/zoo/build.json

Reads the saved `ecomla eval` results (nothing is re-run) and the zoo's
build.json. Tokens trained are the model's own plus, for a teacher grown from
the base, the base's; a converted model is marked as untrained after
conversion. The average is the suite's (acc_norm where the task reports it,
else acc), as in `ecomla report`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ecomla.eval.report import load_results, summarize


def _tokens(r: dict, build: dict) -> str:
    made = build.get("models", {}).get(r["name"])
    if made:
        own = made.get("own_tokens", made["tokens"])
        grown = f" ({(made['tokens'] - own) / 1e6:.1f}M as the base)" if made.get("grown_from") else ""
        return f"{made['tokens'] / 1e6:.1f}M{grown}"
    if r.get("stage") == "converted":
        return "0 after conversion"
    return "–"


def table(summary: dict, build: dict) -> str:
    tasks = summary["tasks"]
    mc = summary["averaged"]
    ppl = [t for t in tasks if t not in mc]
    short = {t: t.removeprefix("tinyworld_") for t in tasks}
    head = ["model", "params", "tokens", *(f"{short[t]} acc / acc_norm" for t in mc),
            f"average ({'/'.join(sorted(set(summary['metrics'][t] for t in mc)))})",
            *(f"{short[t]} ({summary['metrics'][t]})" for t in ppl)]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["models"]:
        cells = [r["name"], f"{r['params'] / 1e6:.2f}M", _tokens(r, build)]
        for t in mc:
            m = r["tasks"][t].get("all_metrics", {})
            cells.append(" / ".join(f"{100 * m[k]:.1f}" if k in m else "–" for k in ("acc", "acc_norm")))
        cells.append(f"**{100 * r['average']:.1f}**")
        cells += [f"{r['tasks'][t]['value']:.2f}" for t in ppl]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ecomla build zoo-table", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="An `ecomla eval` output directory (with results/*.json)")
    ap.add_argument("--build", default="zoo/build.json", help="The zoo's build.json (tokens trained)")
    args = ap.parse_args(argv)
    build_path = Path(args.build)
    build = json.loads(build_path.read_text()) if build_path.is_file() else {}
    print(table(summarize(load_results(Path(args.run_dir))), build), end="")
