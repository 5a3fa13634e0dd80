"""Recovery curves: held-out quality against distillation tokens, one student per (conversion preset, recipe).

    python scripts/bench_recovery.py --model models/smollm2-135m-instruct --out runs/recovery/4x --budget 64+32
    python scripts/bench_recovery.py --model M --out O --budget 64+32 --inits best \
        --recipes kd-frozen-basis kd ild+kd ild>kd attention>all --dataset pytext:train:code --tokens 40960

For each preset (`init.preset`, e.g. X-EcoMLA's `xecomla` and ecomla's `best`) it converts the model at
r_kv + d_r with `ecomla convert`'s own code (every preset calibrated on the same `pytext:calibration` tokens),
then distils the student with each recipe (RECIPES below, `--recipes`) using `ecomla distill`'s own trainer:
forward KL against the live source, the same data, order and learning-rate schedule for every recipe. A recipe of
two stages (ILD, then KD) runs two distillations, the second from the first's `final/`, with the tokens split
between them. Before training and every --measure-every tokens it measures the student on held-out blocks of both
pytext domains (`ecomla.analyze.yardstick`): perplexity, KL(source‖student) and top-1 agreement. The first recipe
is the baseline: the table gives the tokens each other recipe needs to reach its final perplexity. Writes
OUT/curves.json, OUT/table.md and OUT/chart.png. A conversion is kept in OUT/PRESET/model and reused on a rerun with
the same settings; the distillations always run again. Multiple-choice scores are not measured along the curve
(`ecomla eval` on OUT/PRESET/RECIPE/final gives them at the end).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ecomla.analyze.yardstick import DOMAINS, Yardstick
from ecomla.convert import presets
from ecomla.convert.recipe import preset_recipe
from ecomla.mla.budget import parse_budget


@dataclass(frozen=True)
class Stage:
    """One distillation of a recipe: its share of the tokens and its keys over the bench's distill recipe."""

    share: float
    keys: dict


# Per-group learning rates (docs/recovery.md#per-group-learning-rates): the base lr is --group-lr-scale x --lr,
# and the groups whose one Adam step moved held-out KL most take a fraction of it.
GROUP_LR = {"kv_b_proj": 0.1, "kv_a_proj": 0.3, "mlp": 0.3}


def group_lr(a, keys: dict | None = None) -> dict:
    train = {"lr": a.lr * a.group_lr_scale, "lr_multipliers": GROUP_LR}
    return {**(keys or {}), "train": {**(keys or {}).get("train", {}), **train}}


# name -> stages. kd-frozen-basis is the recipe every earlier curve ran (KD only, the latent basis frozen);
# ILD weight and share come from --ild-weight and --ild-share.
RECIPES = {
    "kd-frozen-basis": lambda a: [Stage(1.0, {"train": {"latent_basis": "freeze"}})],
    "kd": lambda a: [Stage(1.0, {})],
    "kd-group-lr": lambda a: [Stage(1.0, group_lr(a))],
    "ild+kd": lambda a: [Stage(1.0, {"loss": {"ild_weight": a.ild_weight}})],
    "ild>kd": lambda a: [Stage(a.ild_share, {"loss": {"kd_weight": 0.0, "ild_weight": 1.0}}), Stage(1 - a.ild_share, {})],
    "ild+kd-group-lr": lambda a: [Stage(1.0, group_lr(a, {"loss": {"ild_weight": a.ild_weight}}))],
    "ild>kd-group-lr": lambda a: [Stage(a.ild_share, group_lr(a, {"loss": {"kd_weight": 0.0, "ild_weight": 1.0}})),
                                  Stage(1 - a.ild_share, group_lr(a))],
    "attention>all": lambda a: [Stage(1.0, {"train": {"mode": "stages", "stages": [
        {"trainable": ["attention"], "fraction": a.ild_share}, {"trainable": ["all"], "fraction": 1 - a.ild_share}]}})],
    "attention-only": lambda a: [Stage(1.0, {"train": {"mode": "stages", "stages": [{"trainable": ["attention"]}]}})],
}


def settings_of(args) -> dict:
    """What a kept conversion depends on: it is reused only when these match."""
    return {"model": str(Path(args.model).resolve()), "budget": args.budget, "calibration_tokens": args.calibration_tokens,
            "seq_len": args.seq_len, "latent_norm": args.latent_norm}


def convert(args, preset: str, out: Path) -> None:
    from ecomla.convert.stream import convert_recipe

    r_kv, d_r = parse_budget(args.budget)
    off = {"mla": {"latent_norm": args.latent_norm}} if args.latent_norm else None
    recipe = preset_recipe(args.model, str(out), preset, r_kv, d_r, calibration_tokens=args.calibration_tokens,
                                   seq_len=args.seq_len, overrides=off)
    convert_recipe(recipe, force=True, progress=False)


def merge(base: dict, keys: dict) -> dict:
    out = dict(base)
    for k, v in keys.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def distill_recipe(args, student: Path, out: Path, tokens: int) -> dict:
    return {
        "student": str(student),
        "teacher": {"model": args.model, "source": "live"},
        "data": {"train": {"dataset": args.dataset, "max_documents": args.train_documents}, "seq_len": args.seq_len},
        "loss": {"kind": "forward_kl", "recompute": False},
        "train": {"total_tokens": tokens, "global_batch_tokens": args.global_batch_tokens,
                  "micro_batch_size": args.micro_batch_size, "lr": args.lr, "warmup_ratio": args.warmup_ratio,
                  "min_lr_ratio": args.min_lr_ratio, "precision": "fp32"},
        "deepspeed": {"zero_stage": 0},
        "checkpoint": {"every_steps": 0},
        "log": {"eval_every_steps": 0, "tensorboard": False},
        "output_dir": str(out),
    }


def stage_tokens(stages: list[Stage], total: int, batch: int) -> list[int]:
    """Each stage's tokens, whole steps, summing to `total` (the last stage takes the remainder)."""
    steps = total // batch
    counts = [max(1, round(s.share * steps)) for s in stages[:-1]]
    return [c * batch for c in counts] + [(steps - sum(counts)) * batch]


def point(tokens: int, seconds: float, m: dict) -> dict:
    row = {"tokens": tokens, "seconds": round(seconds, 1)}
    for d in DOMAINS:
        row[d] = {"perplexity": m[d]["converted_perplexity"], "kl": m[d]["kl_source_to_converted"],
                  "top1": m[d]["top1_agreement"]}
    return row


def curve(args, preset: str, recipe: str, yardstick: Yardstick, out: Path, start: dict,
          other: Yardstick | None = None) -> dict:
    """Distil `preset`'s student with `recipe`, measuring it every --measure-every tokens (and on --other-text at
    the end)."""
    from ecomla.distill.recipe import DistillRecipe
    from ecomla.distill.trainer import DistillRun
    from ecomla.recipe.schema import load_recipe

    stages = RECIPES[recipe](args)
    points = [start]
    student, done, train_s, metrics = out / preset / "model", 0, 0.0, []
    name = f"{preset} {recipe}"
    for i, (stage, tokens) in enumerate(zip(stages, stage_tokens(stages, args.tokens, args.global_batch_tokens))):
        run_dir = out / preset / recipe.replace(">", "-then-") / f"stage{i}"
        data = merge(distill_recipe(args, student, run_dir, tokens), stage.keys)
        last = i == len(stages) - 1
        t_stage, measured = time.time(), [0.0]

        def on_step(steps: int, model, offset=done, total=tokens // args.global_batch_tokens, last=last,
                    t_stage=t_stage, measured=measured) -> None:
            seen = offset + steps * args.global_batch_tokens
            if seen % args.measure_every == 0 or (last and steps == total):
                t = time.time()
                points.append(point(seen, train_s + t - t_stage - measured[0], yardstick.measure_model(model)))
                measured[0] += time.time() - t
                print(f"{name}: {json.dumps(points[-1])}", flush=True)

        job = DistillRun(load_recipe(DistillRecipe, data=data), force=True, progress=False, on_step=on_step)
        job.setup()
        job.train()
        train_s += time.time() - t_stage - measured[0]
        metrics += [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        del job
        student, done = run_dir / "final", done + tokens
    rates = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)
    result = {"preset": preset, "recipe": recipe, "name": name, "points": points, "train_seconds": round(train_s, 1),
              "stages": [{"share": s.share, "keys": s.keys} for s in stages],
              "tokens_per_s": rates[len(rates) // 2], "kd_loss": [m["kd"] for m in metrics if "kd" in m]}
    if other is not None:
        result["other"] = {"tokens": done, **other_point(other, student)}
    return result


def other_point(other: Yardstick, model_dir: Path) -> dict:
    m = other.measure(model_dir)["other"]
    return {"perplexity": m["converted_perplexity"], "kl": m["kl_source_to_converted"], "top1": m["top1_agreement"]}


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
    return math.exp(mx + (math.log(target - src) - my) / slope)


def efficiency(curves: list[dict]) -> list[str]:
    """Against the first curve (the baseline): the tokens each other curve needs to reach its final perplexity."""
    base = curves[0]
    final = base["points"][-1]
    lines = []
    for c in curves[1:]:
        for d in DOMAINS:
            target = final[d]["perplexity"]
            need = tokens_to_reach(c["points"], d, target)
            goal = f"{base['name']}'s final perplexity {target:,.1f} (after {final['tokens']:,} tokens)"
            if need is None:
                lines.append(f"- {d}: {c['name']} does not reach {goal} within the run")
            else:
                lines.append(f"- {d}: {c['name']} reaches {goal} with {need:,.0f} tokens = "
                             f"{need / final['tokens']:.0%} of them")
    return lines


def table(result: dict) -> str:
    src = result["source"]
    lines = [f"Budget {result['budget']}; source held-out perplexity {src['prose']:.2f} (prose), {src['code']:.2f} "
             f"(code). Training data {result['args']['dataset']}. Whole run: {result['wall_seconds'] / 60:.1f} min.",
             "", "| student | tokens | ppl prose | ppl code | KL prose | KL code | top-1 prose | top-1 code | train s |",
             "|" + "---|" * 9]
    for c in result["curves"]:
        for p in c["points"]:
            lines.append(f"| {c['name']} | {p['tokens']:,} | {p['prose']['perplexity']:,.1f} "
                         f"| {p['code']['perplexity']:,.1f} | {p['prose']['kl']:.3f} | {p['code']['kl']:.3f} "
                         f"| {p['prose']['top1']:.1%} | {p['code']['top1']:.1%} | {p['seconds']:.0f} |")
    lines += ["", "Tokens/s (median step, measurements excluded): "
              + ", ".join(f"{c['name']} {c['tokens_per_s']:.0f}" for c in result["curves"]), ""]
    lines += efficiency(result["curves"]) + [""]
    if "other" in result:
        o = result["other"]
        lines += [f"On {o['text']} (text of another kind; source perplexity {o['source']:.2f}):"]
        for p, start in o["start"].items():
            lines.append(f"- {p} converted: perplexity {start['perplexity']:.2f} ({start['perplexity'] / o['source']:.2f}x "
                         f"the source), KL {start['kl']:.3f}")
        for c in result["curves"]:
            x = c["other"]
            lines.append(f"- {c['name']} after {x['tokens']:,} tokens: perplexity {x['perplexity']:.2f} "
                         f"({x['perplexity'] / o['source']:.2f}x the source), KL {x['kl']:.3f}")
        lines.append("")
    for c in result["curves"]:
        for d in DOMAINS:
            target = 1.2 * src[d]
            need = tokens_to_reach(c["points"], d, target)
            if need is None:
                need = projected_tokens(c["points"], d, target, src[d])
                how = "not reached; power law through the curve projects" if need is not None else "not reached, and the last points do not fall"
            else:
                how = "reached at"
            lines.append(f"- {c['name']}, {d}: 1.2x the source ({target:.2f}) {how}"
                         + (f" {need:,.0f} tokens" if need is not None else ""))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for c in result["curves"]:
        x = [p["tokens"] for p in c["points"]]
        for ax, d in zip(axes[:2], DOMAINS):
            ax.plot(x, [p[d]["perplexity"] for p in c["points"]], marker="o", label=c["name"])
        axes[2].plot(x, [(p["prose"]["kl"] + p["code"]["kl"]) / 2 for p in c["points"]], marker="o", label=c["name"])
    for ax, d in zip(axes[:2], DOMAINS):
        ax.axhline(result["source"][d], ls="--", color="k", label="source")
        ax.set(yscale="log", title=f"held-out perplexity, {d}", xlabel="distillation tokens")
    axes[2].set(yscale="log", title="KL(source‖student), mean of both domains", xlabel="distillation tokens")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(result['model']).name}: recovery at r_kv + d_r = {result['budget']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="source checkpoint directory (also the teacher and the ILD source)")
    p.add_argument("--out", required=True, help="output directory (PRESET/, curves.json, table.md, chart.png)")
    p.add_argument("--budget", help="R_KV+D_R, e.g. 64+32 (4.0x on SmolLM2); required unless --report-only")
    p.add_argument("--inits", nargs="+", default=["xecomla", "best"], choices=list(presets.PRESET_NAMES),
                   help="conversion presets, one student each (default: xecomla best)")
    p.add_argument("--recipes", nargs="+", default=["kd-frozen-basis"], choices=list(RECIPES),
                   help="distillation recipes, each run on every preset's student; the first is the baseline "
                   "(default: kd-frozen-basis, the recipe of the earlier curves)")
    p.add_argument("--latent-norm", choices=["linear", "normalize"], default=None,
                   help="override every preset's mla.latent_norm (default: each preset's own: linear for best, "
                   "normalize for the peers)")
    p.add_argument("--tokens", type=int, default=40960, help="distillation tokens per student (all stages)")
    p.add_argument("--measure-every", type=int, default=8192, help="measure every this many tokens")
    p.add_argument("--global-batch-tokens", type=int, default=2048, help="tokens per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward pass")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (every stage)")
    p.add_argument("--warmup-ratio", type=float, default=0.1, help="share of a stage's steps with linear warm-up")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr × this")
    p.add_argument("--group-lr-scale", type=float, default=3.0, help="*-group-lr: the base lr as a multiple of --lr "
                   f"(the groups {', '.join(f'{k} x{v}' for k, v in GROUP_LR.items())} take a share of it)")
    p.add_argument("--ild-weight", type=float, default=1.0, help="ild+kd: loss.ild_weight beside KD")
    p.add_argument("--ild-share", type=float, default=0.25,
                   help="ild>kd: share of the tokens trained on ILD alone; attention>all: share on attention alone")
    p.add_argument("--dataset", default="pytext:train", help="training data (pytext:train: prose and code "
                   "alternating; pytext:train:code: code alone, 100x more of it)")
    p.add_argument("--train-documents", type=int, default=40, help="documents of --dataset read")
    p.add_argument("--other-text", default=None, help="also measure each student before and after distillation on "
                   "this text (a file or directory of .txt), e.g. English of a kind nothing else here touches")
    p.add_argument("--calibration-tokens", type=int, default=16384, help="calibration tokens, every preset")
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens per domain")
    p.add_argument("--seq-len", type=int, default=512, help="sequence length for every stage")
    p.add_argument("--report-only", action="store_true", help="rewrite table.md and chart.png from OUT/curves.json")
    args = p.parse_args(argv)
    if args.report_only:
        result = json.loads((Path(args.out) / "curves.json").read_text())
        (Path(args.out) / "table.md").write_text(table(result))
        plot(result, Path(args.out) / "chart.png")
        print(table(result), end="")
        return 0
    if args.budget is None:
        p.error("--budget: required (e.g. 64+32)")
    try:
        parse_budget(args.budget)
    except ValueError as err:
        p.error(f"--budget {args.budget}: {err}")
    if args.tokens < args.global_batch_tokens or args.tokens % args.global_batch_tokens:
        p.error(f"--tokens {args.tokens}: must be a whole number of --global-batch-tokens ({args.global_batch_tokens})")
    if not 0 < args.ild_share < 1:
        p.error(f"--ild-share {args.ild_share}: must be between 0 and 1")
    out = Path(args.out)
    settings = settings_of(args)
    kept = out / "settings.json"
    if kept.is_file() and json.loads(kept.read_text()) != settings:
        p.error(f"{out} holds conversions made with other settings ({kept}); use a new --out or delete it")
    out.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(settings, indent=2) + "\n")
    t0 = time.time()
    yardstick = Yardstick(args.model, args.eval_tokens, args.seq_len)
    other = Yardstick(args.model, args.eval_tokens, args.seq_len, {"other": args.other_text}) if args.other_text else None
    other_start = {}
    curves = []
    for preset in args.inits:
        model_dir = out / preset / "model"
        t = time.time()
        if not (model_dir / "conversion_report.json").is_file():
            convert(args, preset, model_dir)
        start = point(0, 0.0, yardstick.measure(model_dir))
        print(f"{preset}: converted ({time.time() - t:.0f} s): {json.dumps(start)}", flush=True)
        if other is not None:
            other_start[preset] = other_point(other, model_dir)
        curves += [curve(args, preset, recipe, yardstick, out, start, other) for recipe in args.recipes]
    result = {"model": args.model, "budget": args.budget, "source": yardstick.source, "args": vars(args),
              "curves": curves, "wall_seconds": time.time() - t0}
    if other is not None:
        result["other"] = {"text": args.other_text, "source": other.source["other"], "start": other_start}
    (out / "curves.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(result))
    plot(result, out / "chart.png")
    print(table(result), end="")
    print(f"wrote {out}/curves.json, table.md and chart.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
