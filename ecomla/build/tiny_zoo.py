"""Rebuild the tiny world's model zoo: the base student and its 3x and 8x teachers, with `ecomla pretrain`.

    ecomla build tiny-zoo                    # the full build (recipes/pretrain/tiny_*.yaml as written)
    ecomla build tiny-zoo --quick --out /tmp/zoo   # a smoke run: a few steps per model
    ecomla build tiny-zoo --teachers-only     # retrain the teachers on the base already in zoo/

Steps, each timed: (1) the tiny world's tokenizer and corpus dumps
(`ecomla build tiny-world`) into .cache/tinyworld/, one of them
without tracking threads; (2) `ecomla pretrain` of the base from scratch in
two phases: tiny_base.yaml on the dump without tracking (it learns to copy),
then tiny_base_tracking.yaml on the full mix (the base is also the 1x
teacher, as X-EcoMLA's 1B teacher is its own base); (3) each teacher *grown* from the trained base
(ecomla.tinyworld.grow: wider, more heads, deeper, same function) to its
recipe's shape, then `ecomla pretrain` from there with its recipe's budget;
(4) each final checkpoint re-saved as bf16 safetensors with the tokenizer into
--out/<name>/. A build.json beside them records the commands, tokens (the
teachers' include the base's), parameters and seconds.

Why grown: on 2 CPU cores an 8x model trained from scratch for the same
minutes sees an eighth of the base's tokens, fewer than a tiny Llama needs
before it learns to copy from its context at all (the README's tiny-world
section), so it would end *below* the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ecomla.distill.runtime import solo_env

ROOT = Path(__file__).resolve().parents[2]  # the checkout
# Run order: the base in two phases (copying on text without tracking, then the full mix), then the teachers.
# (name, recipe in recipes/pretrain/, corpus dump)
BASE_RUNS = (("base-copying", "tiny_base", "copying"), ("base", "tiny_base_tracking", "train"))
TEACHER_RUNS = (("teacher-3x", "tiny_teacher-3x", "train"), ("teacher-8x", "tiny_teacher-8x", "train"))


def run(cmd: list[str], log: Path) -> float:
    """Run a command from the repo root, its output to `log`; seconds taken. Fails loudly with the log's end."""
    t0 = time.time()
    with open(log, "w") as f:
        # solo_env: each job is its own single process, not a rank of ours (a test may have set RANK/MASTER_PORT)
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=solo_env())
    if proc.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return time.time() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ecomla build tiny-zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "zoo"), help="Where the bf16 checkpoints and build.json go")
    ap.add_argument("--quick", action="store_true", help="smoke run: small corpus, a few steps per model")
    ap.add_argument("--corpus-docs", type=int, default=None, help="documents per domain dumped for training")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "tinyworld"),
                    help="Tokenizer, corpus dumps, run directories and logs (the recipes read .cache/tinyworld)")
    ap.add_argument("--teachers-only", action="store_true",
                    help="keep the data and the base of the build already in --out and --work and retrain only the "
                         "teachers (after editing their recipes); build.json keeps the base's steps and seconds, "
                         "listed under 'reused'")
    args = ap.parse_args(argv)
    out = Path(args.out)
    work = Path(args.work).resolve()
    logs = work / "logs"
    py = sys.executable
    docs = args.corpus_docs or (400 if args.quick else 20_000)
    timings: dict[str, float] = {}
    models: dict[str, dict] = {}
    runs, reused = BASE_RUNS + TEACHER_RUNS, []
    if args.teachers_only:  # checked before anything is written
        timings, models = reuse_base(out, work, args.quick)
        runs, reused = TEACHER_RUNS, sorted(timings)
    logs.mkdir(parents=True, exist_ok=True)
    if not args.teachers_only:
        timings["data"] = build_data(py, work, logs, docs)
    for name, recipe_name, corpus in runs:
        recipe = f"recipes/pretrain/{recipe_name}.yaml"
        run_dir = work / "zoo-runs" / name
        cmd = [str(Path(py).parent / "ecomla"), "pretrain", recipe, "--quiet", "--force", "--set", f"output_dir={run_dir}",
               "--set", f"tokenizer={work / 'tokenizer'}", "--set", f"data.train.dataset={work / 'corpus' / corpus}",
               "--set", f"data.eval.dataset={work / 'corpus' / 'heldout'}"]
        if args.quick:
            cmd += ["--set", "data.seq_len=128", "--set", "train.global_batch_tokens=2048", "--set", "train.total_tokens=4096",
                    "--set", "log.eval_every_steps=0", "--set", "log.eval_batches=1"]
        t0 = time.time()
        before, grown_from, phase1 = 0, None, None
        if name == "base":  # phase 2 continues phase 1
            cmd += ["--set", f"student={work / 'zoo-runs' / 'base-copying' / 'final'}"]
            phase1 = models.pop("base-copying")
            before = phase1["tokens"]
        elif name != "base-copying":
            grown = work / "zoo-runs" / f"{name}-grown"
            grow_from_base(out / "base", recipe, grown)
            cmd += ["--set", f"student={grown}", "--set", "student_config=null"]
            before, grown_from = models["base"]["tokens"], "base"
        timings[name] = time.time() - t0 + run(cmd, logs / f"pretrain_{name}.log")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        facts = dict(tokens=before + rows[-1]["tokens"], own_tokens=rows[-1]["tokens"], grown_from=grown_from,
                     final_ce=rows[-1].get("ce"), eval_ce=rows[-1].get("eval_ce"), command=" ".join(cmd[1:]),
                     seconds=round(timings[name], 1))
        if name == "base-copying":  # not exported: only the base's tokens count it
            models[name] = facts
            print(f"{name}: {facts['tokens']} tokens, {timings[name]:.0f} s, eval CE {facts['eval_ce']}", flush=True)
            continue
        models[name] = {**export_bf16(run_dir / "final", out / name), **facts}
        if phase1 is not None:
            models[name]["phase1"] = phase1
        print(f"{name}: {models[name]['params'] / 1e6:.2f}M params, {models[name]['tokens']} tokens, "
              f"{timings[name]:.0f} s, eval CE {models[name]['eval_ce']}", flush=True)
    build = {"quick": args.quick, "corpus_docs_per_domain": docs, "seconds": {k: round(v, 1) for k, v in timings.items()},
             "total_seconds": round(sum(timings.values()), 1), "reused": reused, "models": models}
    (out / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    print(f"zoo built in {build['total_seconds'] / 60:.1f} min -> {out}")


def build_data(py: str, work: Path, logs: Path, docs: int) -> float:
    """The tokenizer and the three corpus dumps (train, train without tracking, held-out); seconds taken."""
    data = [py, "-m", "ecomla", "build", "tiny-world", "--tasks-out", str(work / "tasks-check"),
            "--tokenizer-out", str(work / "tokenizer")]
    seconds = run([*data, "--corpus-docs", str(docs), "--corpus-splits", "train",
                   "--corpus-out", str(work / "corpus" / "train")], logs / "data_train.log")
    seconds += run([*data, "--no-tokenizer", "--corpus-docs", str(docs), "--corpus-splits", "train",
                    "--corpus-without", "tracking", "--corpus-out", str(work / "corpus" / "copying")],
                   logs / "data_copying.log")
    seconds += run([*data, "--no-tokenizer", "--corpus-docs", str(max(100, docs // 100)), "--corpus-splits", "heldout",
                    "--corpus-out", str(work / "corpus" / "heldout")], logs / "data_heldout.log")
    return seconds


def reuse_base(out: Path, work: Path, quick: bool) -> tuple[dict[str, float], dict[str, dict]]:
    """The data and base steps of the build recorded in out/build.json (for --teachers-only), checked to be there."""
    record = out / "build.json"
    needed = [record, out / "base" / "config.json", work / "tokenizer", work / "corpus" / "train"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise SystemExit(f"--teachers-only reuses an earlier build, but {', '.join(missing)} is missing; "
                         "run the full build first (without --teachers-only)")
    prev = json.loads(record.read_text())
    if prev.get("quick") != quick:
        raise SystemExit(f"--teachers-only: {record} is from a {'quick' if prev.get('quick') else 'full'} build; "
                         f"pass {'--quick' if prev.get('quick') else 'no --quick'} to match it")
    steps = ("data", *(name for name, _, _ in BASE_RUNS))
    lacking = [k for k in steps if k not in prev.get("seconds", {})] + ([] if "base" in prev.get("models", {}) else ["base"])
    if lacking:
        raise SystemExit(f"--teachers-only: {record} has no record of {', '.join(lacking)} (a build from an older "
                         "version of this script?); run the full build first (without --teachers-only)")
    return {k: prev["seconds"][k] for k in steps}, {"base": prev["models"]["base"]}


def grow_from_base(base: Path, recipe: str, dst: Path) -> None:
    """The exported base grown (in float32) to the shape of `recipe`'s student_config, saved with its tokenizer."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from ecomla.tinyworld.grow import grow_llama

    shape = yaml.safe_load((ROOT / recipe).read_text())["student_config"]
    shape.pop("model_type")
    model = grow_llama(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LlamaConfig(**shape))
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(base).save_pretrained(dst)


def export_bf16(src: Path, dst: Path) -> dict:
    """Re-save a checkpoint as bf16 safetensors with its tokenizer; returns its size facts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, dst / f.name)
    size = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": size}
