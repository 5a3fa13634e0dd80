"""Benchmark: multiple-choice evaluation time with lm-eval's HFLM and with `SharedContextLM`, side by side.

    python scripts/bench_eval.py models/smollm2-135m-instruct \
        runs/xecomla_smollm2/stages/distill-4x-best-source-0ab4b48edab2/run/final      # the main job's limits

Per model, in one process and in turn, the same multiple-choice tasks (`--tasks`, the first `--limit` items
each) through `lm_eval.simple_evaluate` three ways: plain HFLM (`--batch-size` requests a batch, each the whole
context and one choice), `SharedContextLM` one item a batch (each context once, its choices together: what
`share_context` did before it batched items), and `SharedContextLM` batching items (up to `--batch-size`
choices a batch). It checks that the three give the same scores, prints the seconds and their ratios to plain
HFLM, and writes JSON. Perplexity tasks are left out: all three run them through HFLM alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

MODES = ("hflm", "shared, one item a batch", "shared, items batched")


def run(mode: str, path: str, tasks: list[str], limit: int, batch_size: int, tm) -> tuple[float, dict]:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes)
    from ecomla.eval.shared_context import SharedContextLM

    cls = HFLM if mode == "hflm" else SharedContextLM
    # batch_size counts choices: 1 keeps SharedContextLM at one item a batch (an item is never split)
    bs = 1 if mode == "shared, one item a batch" else batch_size
    lm = cls(pretrained=path, tokenizer=path, device="cpu", dtype="float32", batch_size=bs)
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, limit=limit, log_samples=False,
                                  bootstrap_iters=0, random_seed=1234, numpy_random_seed=1234,
                                  torch_random_seed=1234, fewshot_random_seed=1234)
    seconds = time.perf_counter() - t0
    scores = {t: {k: v for k, v in out["results"][t].items() if k.endswith(",none") and "stderr" not in k}
              for t in tasks}
    return seconds, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="model directories (or hub names)")
    ap.add_argument("--tasks", default="pytext_prose_next,pytext_code_next")
    ap.add_argument("--limit", type=int, default=100, help="items per task (the main job's eval.limit)")
    ap.add_argument("--batch-size", type=int, default=16, help="the recipe's eval.batch_size")
    ap.add_argument("--include", default="eval/tasks", help="lm-eval include_path of the tasks")
    ap.add_argument("--out", default=".cache/bench_eval/bench_eval.json")
    args = ap.parse_args()
    from ecomla.eval.runner import task_manager

    tm = task_manager(Path(args.include))
    tasks = args.tasks.split(",")
    rows = []
    for path in args.models:
        row = {"model": path, "seconds": {}, "scores": {}}
        for mode in MODES:
            row["seconds"][mode], row["scores"][mode] = run(mode, path, tasks, args.limit, args.batch_size, tm)
            print(f"{path}: {mode}: {row['seconds'][mode]:.1f} s", flush=True)
        plain = row["seconds"]["hflm"]
        row["ratio_to_hflm"] = {m: row["seconds"][m] / plain for m in MODES}
        row["same_scores"] = all(
            abs(row["scores"][m][t][k] - row["scores"]["hflm"][t][k]) < 1e-9
            for m in MODES for t in tasks for k in row["scores"]["hflm"][t])
        print(f"{path}: " + ", ".join(f"{m} {row['ratio_to_hflm'][m]:.3f}x" for m in MODES)
              + f"; same scores: {row['same_scores']}", flush=True)
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tasks": tasks, "limit": args.limit, "batch_size": args.batch_size,
                               "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
