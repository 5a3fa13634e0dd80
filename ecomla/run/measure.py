"""The measure stages' yardstick and `ecomla run`'s measure report: held-out quality of every model against the
base, for conversions side by side (no training) and along each distillation.

<output_dir>/measure/ gets report.md (the tables), report.json (every number), conversions.png (held-out
perplexity against compression, one line per conversion) and, with distillations, curves.png (perplexity and
KL against distillation tokens, one line per student). The one-shot table, the preset bench and the recovery
curves are run recipes (recipes/run/) that write this report.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ecomla.analyze.yardstick import DOMAINS, Yardstick


def yardstick(base: str, settings) -> Yardstick:
    """The yardstick of a run (`settings`: its `measure` section): the base's log-probs on held-out blocks of both
    pytext domains, and on `measure.other_text` as the domain "other"."""
    texts = {d: f"pytext:heldout:{d}" for d in DOMAINS}
    if settings.other_text:
        texts["other"] = settings.other_text
    return Yardstick(base, settings.eval_tokens, settings.seq_len, texts)


def point(tokens: int, seconds: float | None, m: dict) -> dict:
    """One point of a curve: tokens seen, training seconds (measurements excluded; None where not timed) and,
    per domain, perplexity, KL(base‖student) and top-1 agreement."""
    row = {"tokens": tokens, "seconds": None if seconds is None else round(seconds, 1)}
    for d, v in m.items():
        row[d] = {"perplexity": v["converted_perplexity"], "kl": v["kl_source_to_converted"],
                  "top1": v["top1_agreement"]}
    return row


def tokens_to_reach(points: list[dict], domain: str, target: float) -> float | None:
    """Distillation tokens at which the held-out perplexity first falls to `target` (log-linear between points;
    None: not within the curve)."""
    prev = None
    for p in points:
        ppl = p[domain]["perplexity"]
        if ppl <= target:
            if prev is None or prev[domain]["perplexity"] <= target:
                return float(p["tokens"])
            a, b = math.log(prev[domain]["perplexity"]), math.log(ppl)
            f = (a - math.log(target)) / (a - b)
            return prev["tokens"] + f * (p["tokens"] - prev["tokens"])
        prev = p
    return None


def projected_tokens(points: list[dict], domain: str, target: float, src: float) -> float | None:
    """Tokens at which the excess perplexity over the source `src`, ppl − src, fitted as a power law of the
    tokens through every measured point after the start, falls to `target` − src (None: the fit does not fall).
    A rough guide: the run's learning rate decays, which flattens its last points."""
    pts = [p for p in points if p["tokens"] > 0]
    if len(pts) < 2 or any(p[domain]["perplexity"] <= src for p in pts):
        return None
    xs = [math.log(p["tokens"]) for p in pts]
    ys = [math.log(p[domain]["perplexity"] - src) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope >= 0:
        return None
    log_tokens = mx + (math.log(target - src) - my) / slope
    return math.exp(log_tokens) if log_tokens < 700 else math.inf  # a flat curve: no float holds the answer


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text())


def collect(recipe, stages) -> dict:
    """Every measurement of a finished run: the source, one row per conversion, one curve per distillation."""
    measured = {s.of.label: _read(s.points_file) for s in stages if s.kind == "measure"}
    first = next(iter(measured.values()))
    source = {d: v["source_perplexity"] for d, v in first.items()}
    rows, start = [], {}
    for s in stages:
        if s.kind != "convert":
            continue
        report = _read(s.model_dir / "conversion_report.json")
        m = measured[s.label]
        start[s.label] = point(0, 0.0, m)
        rows.append({"name": s.name, "preset": s.info["preset"], "point": s.info["point"],
                     "compression": report["compression_ratio"], "convert_seconds": round(report["seconds"], 1),
                     **start[s.label]})
    curves = []
    chain: dict[str, list[dict]] = {}  # a variant's parts, by the label of the stage each one starts from
    for s in stages:
        if s.kind != "distill":
            continue
        done = chain.pop(s.info["after"], None)
        if done is None:  # the first part: the curve starts at the conversion
            done = [start[s.info["after"]]]
        if s.points_file.is_file():  # a later part's seconds count on from the part before
            offset = done[-1]["seconds"] or 0.0 if s.info["part"] else 0.0
            done = done + [{**p, "seconds": p["seconds"] + offset} for p in _read(s.points_file)]
        if not s.info["last"]:
            chain[s.label] = done
            continue
        end = point(s.info["offset"] + s.info["tokens"], None, measured[s.label])
        if done[-1]["tokens"] != end["tokens"]:
            done = done + [end]
        metrics = [json.loads(line) for line in (s.dir / "run" / "metrics.jsonl").read_text().splitlines()]
        rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
        curves.append({"name": s.name, "point": s.info["point"], "preset": s.info["preset"],
                       "teacher": s.info["teacher"], "variant": s.info["variant"], "points": done,
                       "tokens_per_s": rates[len(rates) // 2] if rates else None})
    return {"base": recipe.base, "source": source, "conversions": rows, "curves": curves}


def _cells(p: dict, domains) -> str:
    return (" | ".join(f"{p[d]['perplexity']:,.2f}" for d in domains) + " | "
            + " | ".join(f"{p[d]['kl']:.3f}" for d in domains) + " | "
            + " | ".join(f"{p[d]['top1']:.1%}" for d in domains))


def _head(first: str, domains, last: str) -> list[str]:
    cols = ([f"ppl {d}" for d in domains] + [f"KL {d}" for d in domains] + [f"top-1 {d}" for d in domains])
    head = f"| {first} | " + " | ".join(cols) + f" | {last} |"
    return [head, "|" + "---|" * (head.count("|") - 1)]


def ranking(rows: list[dict], domains) -> list[str]:
    """The conversions at each ratio, best first by KL(source‖converted) averaged over the domains."""
    def mean_kl(r: dict) -> float:
        return sum(r[d]["kl"] for d in domains) / len(domains)

    lines = ["Rank at each ratio (mean KL over the domains, lowest first):", ""]
    for ratio in sorted({round(r["compression"], 2) for r in rows}):
        cells = sorted((r for r in rows if round(r["compression"], 2) == ratio), key=mean_kl)
        lines.append(f"- {ratio:.2f}×: " + ", ".join(f"{i}. {r['preset']} {r['point']} ({mean_kl(r):.3f})"
                                                      for i, r in enumerate(cells, 1)))
    return lines


def efficiency(curves: list[dict], domains) -> list[str]:
    """At each compression point, against its first curve (the baseline): the tokens each other curve needs to
    reach the baseline's final perplexity."""
    lines = []
    for pt in dict.fromkeys(c["point"] for c in curves):
        group = [c for c in curves if c["point"] == pt]
        base, final = group[0], group[0]["points"][-1]
        for c in group[1:]:
            for d in domains:
                target = final[d]["perplexity"]
                need = tokens_to_reach(c["points"], d, target)
                goal = f"{base['name']}'s final perplexity {target:,.2f} (after {final['tokens']:,} tokens)"
                if need is None:
                    lines.append(f"- {d}: {c['name']} does not reach {goal} within the run")
                elif need == 0:  # the baseline's training made this domain worse than the start
                    lines.append(f"- {d}: {c['name']} starts at or below {goal}")
                else:
                    lines.append(f"- {d}: {c['name']} reaches {goal} with {need:,.0f} tokens = "
                                 f"{need / final['tokens']:.0%} of them")
    return lines


def projections(curves: list[dict], source: dict, domains) -> list[str]:
    lines = []
    for c in curves:
        for d in domains:
            target = 1.2 * source[d]
            need = tokens_to_reach(c["points"], d, target)
            how = "reached at"
            if need is None:
                need = projected_tokens(c["points"], d, target, source[d])
                how = ("not reached; a power law through the curve projects" if need is not None
                       else "not reached, and the last points do not fall")
            # past 10^12 tokens a projection says only that this curve will not get there
            amount = "" if need is None else f" {need:,.0f} tokens" if need < 1e12 else " more than 10^12 tokens"
            lines.append(f"- {c['name']}, {d}: 1.2x the source ({target:.2f}) {how}{amount}")
    return lines


def table(result: dict) -> str:
    src = result["source"]
    domains = list(src)
    lines = ["Source: held-out perplexity " + ", ".join(f"{src[d]:.2f} ({d})" for d in domains) + ".", "",
             "## Conversions (no training)", "", *_head("conversion | point | ratio", domains, "convert s")]
    for r in sorted(result["conversions"], key=lambda r: (r["compression"], r[domains[0]]["perplexity"])):
        lines.append(f"| {r['preset']} | {r['point']} | {r['compression']:.2f}× | {_cells(r, domains)} "
                     f"| {r['convert_seconds']:.0f} |")
    lines += ["", *ranking(result["conversions"], domains)]
    if result["curves"]:
        lines += ["", "## Distillation", "", *_head("student | tokens", domains, "train s")]
        for c in result["curves"]:
            for p in c["points"]:
                secs = "" if p["seconds"] is None else f"{p['seconds']:.0f}"
                lines.append(f"| {c['name']} | {p['tokens']:,} | {_cells(p, domains)} | {secs} |")
        lines += ["", "Tokens/s (median step): " + ", ".join(f"{c['name']} {c['tokens_per_s']:.0f}"
                                                              for c in result["curves"] if c["tokens_per_s"]), ""]
        lines += efficiency(result["curves"], domains) + [""] + projections(result["curves"], src, domains)
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = result["source"]
    domains = list(src)
    fig, axes = plt.subplots(1, len(domains), figsize=(5.5 * len(domains), 4.2), squeeze=False)
    for ax, d in zip(axes[0], domains):
        for i, preset in enumerate(dict.fromkeys(r["preset"] for r in result["conversions"])):
            pts = sorted((r["compression"], r[d]["perplexity"]) for r in result["conversions"] if r["preset"] == preset)
            ax.plot(*zip(*pts), marker="o", color=f"C{i % 10}", label=preset)
        ax.axhline(src[d], color="k", ls="--", label="source")
        ax.set(yscale="log", xlabel="KV compression (×)", ylabel="held-out perplexity (log)", title=f"{d}, no training")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{Path(result['base']).name}: conversions")
    fig.tight_layout()
    fig.savefig(out / "conversions.png", dpi=110)
    plt.close(fig)
    if not result["curves"]:
        return
    fig, axes = plt.subplots(1, len(domains) + 1, figsize=(5 * (len(domains) + 1), 4.2), squeeze=False)
    axes = axes[0]
    for c in result["curves"]:
        x = [p["tokens"] for p in c["points"]]
        for ax, d in zip(axes, domains):
            ax.plot(x, [p[d]["perplexity"] for p in c["points"]], marker="o", label=c["name"])
        axes[-1].plot(x, [sum(p[d]["kl"] for d in domains) / len(domains) for p in c["points"]], marker="o",
                      label=c["name"])
    for ax, d in zip(axes, domains):
        ax.axhline(src[d], ls="--", color="k", label="source")
        ax.set(yscale="log", title=f"held-out perplexity, {d}", xlabel="distillation tokens")
    axes[-1].set(yscale="log", title="KL(source‖student), mean over domains", xlabel="distillation tokens")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(result['base']).name}: recovery")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def write_report(recipe, stages) -> Path:
    """measure/report.{md,json}, conversions.png and curves.png from the finished stages; returns the directory."""
    out = Path(recipe.output_dir) / "measure"
    out.mkdir(parents=True, exist_ok=True)
    result = collect(recipe, stages)
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "report.md").write_text(table(result))
    plot(result, out)
    return out
