"""`ecomla variants`: pretrain every (size, variant) from scratch on the same data and tokens, then report.

Each run is an ordinary `ecomla pretrain` whose resolved recipe is written to
<output_dir>/stages/<size>-<variant>-<key>/recipe.yaml; the key hashes that
recipe and the tokenizer, so a rerun reuses finished runs, an edited recipe
reruns what changed, and an interrupted run resumes from its checkpoint.
Runs go `jobs` at a time in subprocesses with one CPU thread each (on 2 cores
two one-thread runs beat one two-thread run, and they never oversubscribe).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ecomla.errors import UserError
from ecomla.io.fingerprint import CachedStage, digest, path_fingerprint
from ecomla.recipe.schema import RecipeError, load_recipe, recipe_to_dict, save_recipe
from ecomla.variants.configs import count_params, match_mlp, variant_config
from ecomla.variants.recipe import SweepRecipe


class SweepError(UserError):
    """A run of the sweep failed (its log's end is in the message)."""


@dataclass
class Run(CachedStage):
    size: str
    variant: str
    kind: str
    config: dict
    params: int
    recipe: object  # DistillRecipe
    key: str
    dir: Path


def tokenizer_dir(recipe: SweepRecipe) -> Path:
    """The recipe's tokenizer; `tinyworld` trains the tiny world's BPE (deterministic, seconds) once."""
    if recipe.tokenizer != "tinyworld":
        return Path(recipe.tokenizer)
    out = Path(recipe.output_dir) / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        from ecomla.tinyworld.tokenizer import train_tokenizer

        train_tokenizer(out)
    return out


def plan(recipe: SweepRecipe) -> list[Run]:
    """Every run, with its matched config and key; recipe problems raise before anything runs."""
    from transformers import AutoTokenizer

    from ecomla.distill.recipe import PRETRAIN_DEFAULTS, DistillRecipe

    tok_dir = tokenizer_dir(recipe)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    curves = set(recipe.curves) if recipe.curves is not None else {v.name for v in recipe.variants}
    main_size = next(iter(recipe.sizes))
    runs = []
    for size_name, size in recipe.sizes.items():
        target = None
        for v in recipe.variants:
            if size_name != main_size and v.name not in curves:
                continue
            try:
                cfg = variant_config(size, v, len(tok), special, recipe.max_position_embeddings)
            except ValueError as exc:
                raise RecipeError([f"variants: {exc}"]) from None
            if target is None:
                target = count_params(cfg)  # the MHA model (first variant) sets the budget
            if recipe.match_params:
                cfg = match_mlp(cfg, target)
            data = copy.deepcopy(recipe.pretrain)
            data.update(student_config=cfg, tokenizer=str(tok_dir), output_dir="")
            try:
                sub = load_recipe(DistillRecipe, data=data, overrides=PRETRAIN_DEFAULTS)
            except RecipeError as err:
                raise RecipeError([f"pretrain.{p}" for p in err.problems]) from None
            key = digest(recipe_to_dict(sub), path_fingerprint(tok_dir))
            run_dir = Path(recipe.output_dir) / "stages" / f"{size_name}-{v.name}-{key}"
            sub.output_dir = str(run_dir / "run")
            runs.append(Run(size_name, v.name, v.kind, cfg, count_params(cfg), sub, key, run_dir))
    return runs


def _env() -> dict:
    from ecomla.distill.runtime import solo_env

    env = solo_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _launch(run: Run) -> subprocess.Popen:
    run.dir.mkdir(parents=True, exist_ok=True)
    save_recipe(run.recipe, run.dir / "recipe.yaml")
    log = open(run.dir / "log.txt", "a")
    # `pretrain` with the resolved recipe: loss and teacher are already CE-only in it.
    cmd = [sys.executable, "-m", "ecomla.cli", "pretrain", str(run.dir / "recipe.yaml"), "--quiet"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())


def run_sweep(recipe: SweepRecipe, *, progress: bool = True) -> Path:
    """Train (or reuse) every run, `jobs` at a time, then write the report; returns output_dir."""
    from ecomla.variants.report import write_variants_report

    out = Path(recipe.output_dir)
    runs = plan(recipe)
    out.mkdir(parents=True, exist_ok=True)
    save_recipe(recipe, out / "variants_recipe.yaml")
    index = [{"size": r.size, "variant": r.variant, "kind": r.kind, "params": r.params, "dir": r.dir.name,
              "config": r.config} for r in runs]
    (out / "runs.json").write_text(json.dumps(index, indent=2) + "\n")  # what the report reads
    todo = [r for r in runs if not r.done()]
    for r in runs:
        if r.done():
            print(f"{r.size}/{r.variant}: reused ({r.dir.name})", flush=True)
    running: list[tuple[Run, subprocess.Popen, float]] = []
    failed: list[str] = []
    t_all = time.time()
    while todo or running:
        while todo and len(running) < recipe.jobs and not failed:
            r = todo.pop(0)
            print(f"{r.size}/{r.variant}: training ({r.params / 1e6:.2f}M params) -> {r.dir}", flush=True)
            running.append((r, _launch(r), time.time()))
        if failed and not running:
            break
        time.sleep(1.0)
        for item in list(running):
            r, proc, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode:
                tail = (r.dir / "log.txt").read_text()[-2000:]
                failed.append(f"{r.size}/{r.variant} failed (exit {proc.returncode}); end of {r.dir}/log.txt:\n{tail}")
                continue
            seconds = round(time.time() - t0, 1)
            r.mark_done(size=r.size, variant=r.variant, kind=r.kind, params=r.params, config=r.config,
                        seconds=seconds)
            print(f"{r.size}/{r.variant}: done in {seconds:.0f} s", flush=True)
        if failed:
            todo.clear()
    if failed:
        raise SweepError("\n\n".join(failed))
    print(f"all {len(runs)} runs finished ({time.time() - t_all:.0f} s this call)", flush=True)
    write_variants_report(out)
    return out
