"""A tiny distillation world for trainer tests: an MLA student converted from a tiny Llama, a wider teacher,
a corpus, and helpers to launch `ecomla distill` in 1 or 2 processes the way users do."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.tiny import make_source

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
SHM, SHM_BUFFERS = Path("/dev/shm"), "deepspeed_allreduce_buffer_*"


@contextlib.contextmanager
def shm_leftovers():
    """Around a run: yields a list that, after the block, holds the DeepSpeed all-reduce buffers (about 70 MB of
    RAM per rank in /dev/shm) that appeared during it, each already removed. The suite runs serially, so every
    buffer that appears during the block is the run's."""
    before, left = set(SHM.glob(SHM_BUFFERS)), []
    try:
        yield left
    finally:
        left.extend(sorted(set(SHM.glob(SHM_BUFFERS)) - before))
        for path in left:
            path.unlink(missing_ok=True)


def build_world(root: Path, tokenizer_dir: Path, corpus_dir: Path) -> dict:
    """student (stock DeepSeek-V3 MLA), teacher (Llama, 1.5x wider, 3 layers), and paths."""
    from tests.convert.helpers import convert

    base = make_source(root / "base", tokenizer_dir, seed=1)
    convert(base, root / "student", mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8})
    make_source(root / "teacher", tokenizer_dir, seed=2, hidden_size=96, num_hidden_layers=3)
    return {"student": root / "student", "teacher": root / "teacher", "corpus": corpus_dir, "root": root}


def recipe(world: dict, out: Path, **sections) -> dict:
    """A small run: seq 64, 4 sequences per step, fp32, live teacher."""
    r = {
        "student": str(world["student"]),
        "teacher": {"model": str(world["teacher"])},
        "data": {"train": {"dataset": str(world["corpus"] / "a_fit.jsonl")},
                 "eval": {"dataset": str(world["corpus"] / "a_held.jsonl")}, "seq_len": 64},
        "train": {"total_tokens": 256 * 12, "global_batch_tokens": 256, "micro_batch_size": 2, "lr": 3e-3,
                  "warmup_ratio": 0.0, "precision": "fp32"},
        "deepspeed": {"zero_stage": 0},
        "checkpoint": {"every_steps": 4},
        "log": {"eval_batches": 2},
        "output_dir": str(out),
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(r.get(key), dict):
            r[key] = {**r[key], **value}
        else:
            r[key] = value
    return r


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(recipe_path: Path, procs: int, *extra: str, launcher: str = "torchrun") -> list[str]:
    if procs == 1:
        return [str(BIN / "ecomla"), "distill", str(recipe_path), "--quiet", *extra]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(procs), "--master_port", str(_free_port()),
                "--module", "ecomla.distill", str(recipe_path), "--quiet", *extra]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(procs), "--master_port", str(_free_port()),
            "-m", "ecomla.distill", str(recipe_path), "--quiet", *extra]


def env() -> dict:
    from ecomla.distill.runtime import solo_env

    e = solo_env()
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run(recipe_path: Path, procs: int = 1, *extra: str, timeout: int = 600, launcher: str = "torchrun"):
    return subprocess.run(command(recipe_path, procs, *extra, launcher=launcher), capture_output=True, text=True,
                          timeout=timeout, env=env())


def errors(proc: subprocess.CompletedProcess) -> str:
    """What to show when a run failed: rank 0's traceback if any, else the end of stderr."""
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]")]
    return "\n".join(rank0[-60:]) if rank0 else proc.stderr[-3000:]


def run_and_kill(recipe_path: Path, procs: int, metrics: Path, after_steps: int, timeout: int = 600,
                 cmd: list[str] | None = None) -> None:
    """Start a run (`ecomla distill`, or `cmd`) and SIGKILL its whole process tree once `metrics` has
    `after_steps` lines. Any DeepSpeed all-reduce buffer the killed processes left in /dev/shm is removed (ecomla
    unlinks its own once the process group has started, so only a kill during start-up leaves one)."""
    with shm_leftovers():
        _run_and_kill(recipe_path, procs, metrics, after_steps, timeout, cmd)


def _run_and_kill(recipe_path: Path, procs: int, metrics: Path, after_steps: int, timeout: int,
                  cmd: list[str] | None) -> None:
    proc = subprocess.Popen(cmd or command(recipe_path, procs), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env(), start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            if proc.poll() is not None:
                raise AssertionError(f"run ended before it could be killed:\n{proc.stderr.read().decode()[-3000:]}")
            time.sleep(0.01)
        else:
            raise AssertionError("run did not reach the kill point in time")
    finally:
        # SIGKILL the launcher and every process under it at once, as a dying node would. torchrun's
        # workers run in sessions of their own, so killing the launcher's process group alone misses them.
        import psutil

        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        proc.wait()
        psutil.wait_procs(tree, timeout=30)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
