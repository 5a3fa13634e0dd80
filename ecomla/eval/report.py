"""`ecomla report RUN_DIR`: the table and the chart, rebuilt from saved eval results alone.

Reads <RUN_DIR>/results/*.json (written by `ecomla eval`), in the order of
<RUN_DIR>/eval_recipe.yaml when it is there, and writes:
  report.json  every model's per-task scores, average, params and KV facts;
  report.md    the markdown table, with the metric that counts for each task;
  chart.png    average accuracy against KV compression ratio: one line per
               teacher the students were distilled from (students with no
               teacher form their own line per init), the base as a dashed line.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from ecomla.errors import UserError


class ReportError(UserError):
    """No results to report, or results that do not fit together."""


def load_results(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "results").glob("*.json"))
    if not files:
        raise ReportError(f"{run_dir}/results has no result files; run `ecomla eval` first")
    results = {p.stem: json.loads(p.read_text()) for p in files}
    order_file = run_dir / "eval_recipe.yaml"
    if not order_file.is_file():
        return [results[n] for n in sorted(results)]
    # the recipe's models, in its order: a result whose model has left the recipe (a renamed stage, a dropped
    # model) is kept on disk but not reported as if it belonged to this run
    order = [m["name"] for m in (yaml.safe_load(order_file.read_text()) or {}).get("models", [])]
    stale = sorted(n for n in results if n not in order)
    if stale:
        print(f"report: {len(stale)} saved result(s) of models not in {order_file.name} left out: "
              f"{', '.join(stale)}", file=sys.stderr)
    kept = [results[n] for n in order if n in results]
    if not kept:
        raise ReportError(f"{run_dir}/results holds no result of a model in {order_file.name}; run `ecomla eval`")
    return kept


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def average_stderr(r: dict, averaged: list[str]) -> float | None:
    """The standard error of a model's average: sqrt(Σ s.e.²) / k over its k averaged tasks (independent tasks;
    None when lm-eval gave no standard error for one of them)."""
    errors = [r["tasks"][t].get("stderr") for t in averaged]
    if not errors or any(e is None for e in errors):
        return None
    return sum(e * e for e in errors) ** 0.5 / len(errors)


def line_label(r: dict) -> str | None:
    """Which chart line a result belongs to (None: not a student, so not a line)."""
    if r.get("role") != "student":
        return None
    if r.get("teacher"):
        return f"{r['teacher']} teacher" + (f" ({r['init']})" if r.get("init") else "")
    return f"no training ({r.get('init') or 'converted'})"


def summarize(results: list[dict]) -> dict:
    tasks = list(results[0]["tasks"])
    for r in results[1:]:
        if list(r["tasks"]) != tasks:
            raise ReportError(f"results disagree on the task list: {r['name']} has {list(r['tasks'])}, "
                              f"{results[0]['name']} has {tasks}; evaluate them with one suite")
    metrics = {t: results[0]["tasks"][t]["metric"] for t in tasks}
    averaged = [t for t in tasks if results[0]["tasks"][t]["average"]]
    return {"tasks": tasks, "metrics": metrics, "averaged": averaged, "models": results,
            "lm_eval_version": results[0].get("lm_eval_version"),
            "task_versions": {t: results[0]["tasks"][t].get("version") for t in tasks},
            "task_items": {t: results[0]["tasks"][t].get("n") for t in tasks}}


def markdown(summary: dict) -> str:
    tasks, metrics, averaged = summary["tasks"], summary["metrics"], summary["averaged"]
    short = {t: t.removeprefix("tinyworld_") for t in tasks}
    head = ["model", "params", "KV ratio", "KV B/token"] + [f"{short[t]} ({metrics[t]})" for t in tasks] + ["average",
                                                                                                        "± s.e."]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["models"]:
        kv = r["kv"]
        ratio = "–" if kv.get("compression") is None else f"{kv['compression']:.2f}×"
        kvb = f"{kv['measured_bytes_per_token']:.0f}" + ("" if kv["match"] else " (≠ formula!)")
        cells = [r["name"], f"{r['params'] / 1e6:.2f}M", ratio, kvb]
        for t in tasks:
            cell = r["tasks"][t]
            v = cell["value"]
            cells.append(_pct(v) if t in averaged else f"{v:.2f}")
        cells += [_pct(r["average"]), _pct(average_stderr(r, averaged))]
        rows.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        f"Scores in % (perplexities as is). The average is the unweighted mean of {', '.join(short[t] for t in averaged)}, "
        "each with the metric in its column header (acc_norm where the task defines it, else acc, unless the suite "
        "says otherwise).",
        "KV ratio: KV numbers cached per token (all layers) of the base divided by the model's; KV B/token: bytes per "
        "token measured from a real `generate` cache (checked against the formula).",
        f"lm-eval {summary['lm_eval_version']}; task versions: "
        + ", ".join(f"{short[t]} {v}" for t, v in summary["task_versions"].items()) + ".",
    ]
    items = {t: n for t, n in summary.get("task_items", {}).items() if n is not None}
    if items:
        notes.append("Items scored per task: " + ", ".join(f"{short[t]} {n}" for t, n in items.items()) + ".")
        covered = [items[t] for t in averaged if t in items]
        if len(covered) == len(averaged):
            notes.append(f"The average covers {sum(covered)} items; ± s.e. is its standard error, from lm-eval's per-task "
                         "standard errors with the tasks taken as independent. Two averages closer than about twice "
                         "their standard errors are not told apart by these items.")
    return "\n".join(rows + notes) + "\n"


def chart(summary: dict, path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in summary["models"]:
        label, ratio = line_label(r), r["kv"].get("compression")
        if label and ratio:
            lines[label].append((ratio, 100 * r["average"]))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    markers = "soD^vP*X"
    ratios = sorted({x for pts in lines.values() for x, _ in pts})
    for i, (label, pts) in enumerate(sorted(lines.items())):
        pts.sort()
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=markers[i % len(markers)], label=label)
        for x, y in pts:
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    base = next((r for r in summary["models"] if r.get("role") == "base"), None)
    if base:
        ax.axhline(100 * base["average"], color="black", linestyle="--", linewidth=1.2,
                   label=f"base model ({100 * base['average']:.1f})")
    if ratios:
        ax.set_xticks(ratios, [f"{x:.2f}×" for x in ratios])
        ax.invert_xaxis()  # highest compression on the left, as in the X-EcoMLA figure
    ax.set_xlabel("KV cache compression ratio (×)")
    ax.set_ylabel("average accuracy (%)")
    ax.set_title(title or "Average accuracy against KV cache compression")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(run_dir: str | Path, title: str | None = None) -> dict:
    """Rebuild report.json, report.md and chart.png in run_dir from its results; returns the summary."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory")
    summary = summarize(load_results(run_dir))
    (run_dir / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / "report.md").write_text(markdown(summary))
    chart(summary, run_dir / "chart.png", title)
    return summary
