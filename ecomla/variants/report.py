"""The attention-variant report: held-out CE against KV-cache size and against training tokens.

Reads <run_dir>/runs.json (written by `ecomla variants`) and each run's
metrics.jsonl and final checkpoint, and writes:
  report.json / report.md   per run: params, KV numbers per token (formula and
                            measured from a real generate cache), KV % of MHA,
                            final held-out CE;
  kv_vs_ce.png              final held-out CE against KV cache size as % of MHA,
                            main size, one marker per configuration;
  ce_vs_tokens.png          held-out CE against training tokens, one line per
                            variant, one panel per model size.
"""

from __future__ import annotations

import json
from pathlib import Path

from ecomla.errors import UserError
from ecomla.mla.budget import kv_elements_per_token

COLORS = {"mha": "tab:blue", "gqa": "tab:orange", "mqa": "tab:green", "mla": "tab:purple", "lrkv": "tab:red"}
MARKERS = {"mha": "D", "gqa": "^", "mqa": "v", "mla": "s", "lrkv": "o"}


class VariantsReportError(UserError):
    """Nothing to report, or a run without results."""


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "run" / "metrics.jsonl"
    if not path.is_file():
        raise VariantsReportError(f"{path} is missing; run `ecomla variants` to finish the sweep")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    points = {}
    for r in rows:
        if r.get("eval_ce") is not None:
            points[int(r["tokens"])] = float(r["eval_ce"])  # the final eval overwrites a same-step one
    return sorted(points.items())


def _measured_bytes(final: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes)
    from ecomla.eval.kv import measured_kv_bytes_per_token

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    return measured_kv_bytes_per_token(model)


def collect(run_dir: Path) -> list[dict]:
    index = run_dir / "runs.json"
    if not index.is_file():
        raise VariantsReportError(f"{run_dir} has no runs.json; run `ecomla variants` first")
    rows = []
    mha_elements = {}
    for entry in json.loads(index.read_text()):
        d = run_dir / "stages" / entry["dir"]
        curve = _curve(d)
        if not curve:
            raise VariantsReportError(f"{d}: no held-out CE logged (set pretrain.data.eval)")
        elements = kv_elements_per_token(entry["config"])
        if entry["kind"] == "mha":
            mha_elements[entry["size"]] = elements
        final = d / "run" / "final"
        measured = _measured_bytes(final) if final.is_dir() else None
        rows.append({**{k: entry[k] for k in ("size", "variant", "kind", "params")},
                     "layers": entry["config"]["num_hidden_layers"],
                     "kv_elements_per_token": elements, "kv_bytes_fp32_formula": 4 * elements,
                     "kv_bytes_fp32_measured": measured, "curve": curve, "final_ce": curve[-1][1],
                     "tokens": curve[-1][0]})
    for r in rows:
        r["kv_percent_of_mha"] = 100.0 * r["kv_elements_per_token"] / mha_elements[r["size"]]
    return rows


def markdown(rows: list[dict]) -> str:
    head = "| size | variant | params | KV numbers/token/layer | KV % of MHA | KV bytes/token fp32 (measured) | tokens | held-out CE |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = "–" if r["kv_bytes_fp32_measured"] is None else f"{r['kv_bytes_fp32_measured']:.0f}"
        if r["kv_bytes_fp32_measured"] is not None and r["kv_bytes_fp32_measured"] != r["kv_bytes_fp32_formula"]:
            measured += f" (formula {r['kv_bytes_fp32_formula']}!)"
        lines.append(f"| {r['size']} | {r['variant']} | {r['params'] / 1e6:.3f}M | "
                     f"{r['kv_elements_per_token'] // r['layers']} | {r['kv_percent_of_mha']:.1f} | {measured} | "
                     f"{r['tokens']:,} | {r['final_ce']:.4f} |")
    return "\n".join(lines) + "\n"


def charts(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = rows[0]["size"]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    seen = set()
    for r in (r for r in rows if r["size"] == main):
        label = r["kind"].upper() if r["kind"] not in seen else None
        seen.add(r["kind"])
        ax.scatter(r["kv_percent_of_mha"], r["final_ce"], color=COLORS[r["kind"]], marker=MARKERS[r["kind"]], s=60,
                   label=label, zorder=3)
        ax.annotate(f"{r['variant']}\n{r['final_ce']:.3f}", (r["kv_percent_of_mha"], r["final_ce"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=7)
    for kind in ("lrkv", "mla"):
        pts = sorted((r["kv_percent_of_mha"], r["final_ce"]) for r in rows if r["size"] == main and r["kind"] == kind)
        if len(pts) > 1:
            ax.plot(*zip(*pts), color=COLORS[kind], linewidth=1, alpha=0.6)
    ax.set_xlabel("KV cache size (% of MHA)")
    ax.set_ylabel("final held-out CE (nats/token)")
    ax.set_title(f"Held-out CE against KV cache size ({main}, equal params and tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kv_vs_ce.png", dpi=120)
    plt.close(fig)

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.4), squeeze=False, sharey=True)
    for ax, size in zip(axes[0], sizes):
        nth: dict[str, int] = {}
        for r in (r for r in rows if r["size"] == size):
            xs, ys = zip(*r["curve"])
            i = nth[r["kind"]] = nth.get(r["kind"], -1) + 1  # same kind: same color, its own line style
            ax.plot([x / 1e6 for x in xs], ys, label=f"{r['variant']} ({r['kv_percent_of_mha']:.0f}% KV)",
                    color=COLORS[r["kind"]], linestyle=("-", "--", ":", "-.")[i % 4], marker=".")
        params = next(r["params"] for r in rows if r["size"] == size)
        ax.set_title(f"{size}: {params / 1e6:.2f}M params")
        ax.set_xlabel("training tokens (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out CE (nats/token)")
    fig.tight_layout()
    fig.savefig(out / "ce_vs_tokens.png", dpi=120)
    plt.close(fig)


def write_variants_report(run_dir: str | Path) -> list[dict]:
    run_dir = Path(run_dir)
    rows = collect(run_dir)
    (run_dir / "report.json").write_text(json.dumps(rows, indent=2) + "\n")
    (run_dir / "report.md").write_text(markdown(rows))
    charts(rows, run_dir)
    return rows


def is_variants_run(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "runs.json").is_file()
