"""Benchmark: what distillation costs beyond running both models, what chunking saves, and ZeRO-2 vs ZeRO-3.

    python scripts/bench_distill.py             # the full run, ~5 minutes on 2 CPU cores
    python scripts/bench_distill.py --quick     # smaller sizes, a smoke run of every part
    python scripts/bench_distill.py --skip memory zero --real STUDENT models/smollm2-135m-instruct
                                                # part 1 on a real MLA student and its source (vocab 49,152),
                                                # and parts 4 and 5 (--skip kd_real ild update: each alone)

Five measurements, each reported as a ratio of things measured side by side in this run:

1. KD overhead. Random HF Llama student and teacher, plain torch, one process: median time of
   (a) one KD step, exactly the trainer's `batch_loss` (teacher forward without grad, student
   decoder, `chunked_loss` over the student's head) plus backward; (b) one student CE step (full
   logits, cross-entropy, backward); (c) one teacher forward. Ratio a / (b + c): the cost of the
   distillation loss beyond running both models. No optimizer update in any of them. With --real
   STUDENT TEACHER, the same on two checkpoints from disk (fp32, 4 sequences of 512: the main job's
   micro-batch), e.g. SmolLM2 converted by `ecomla convert` and SmolLM2 itself.
2. Peak memory of the loss alone, at a Llama-3 vocabulary (128,256) and 2,048 tokens: forward +
   backward of a naive KL (full (T, V) logits of both, log_softmax, KL) and of `chunked_loss` with
   checkpointing, from (T, d) hidden states through Linear(d, V) heads. Reported as peak RSS minus
   the RSS of a floor process that only builds the inputs, and as naive / chunked.
3. Tokens/s of `ecomla distill` on 2 processes (torchrun, gloo, fp32) under ZeRO-2 and ZeRO-3, with
   an MLA student converted by `ecomla convert` from a small random Llama: median `tokens_per_s`
   of metrics.jsonl after the first 3 steps, and ZeRO-3 / ZeRO-2.

4. With --real: the cost of intermediate-layer distillation (loss.ild_weight) on those checkpoints, the
   teacher serving as the ILD source: a KD step with and without it (loss.recompute false), each step kind in a
   child of its own, so that its peak RSS is its own; ILD / KD for the median step time and for the peak RSS.
   The same for ILD on attention maps (loss.ild_target attention_map), whose child loads both models with eager
   attention as the trainer does, against the KD step as the trainer runs it alone (transformers' default).

5. With --real: the optimizer update on one process, as `ecomla distill` runs it (DeepSpeed ZeRO-0, fp32, AdamW;
   one sequence of 512 per step: the main job's step) on the real student: a step of student forward + CE +
   backward + update, with DeepSpeed's gradient all-reduce over the one rank and torch's default AdamW (per
   tensor on CPU: the trainer before 7d8f90c) and with backward in the engine's `no_sync` and AdamW fused
   (since), the two in turn first: the median of each part, their sum as the step, and new / old.

Why child processes: peak RSS is a per-process high-water mark that never comes down, so each
measurement runs in a fresh child (this script with a hidden --child mode) and its own ru_maxrss
is read with os.wait4 when it exits (RUSAGE_CHILDREN would give the max over all children so far).
The parent never imports torch, since a child's high-water mark starts from the parent's RSS at
fork. Timings run in children too, so every part starts from the same state.
Prints tables and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
# Memory children: glibc otherwise raises its mmap threshold up to 32 MiB after the first free, keeps
# freed blocks below it on its heap, and RSS then measures fragmentation instead of live tensors.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
# Sizes per preset; model shapes are (width, layers).
KD = {"full": {"vocab": 8192, "seq": 512, "batch": 4, "student": (256, 4), "teacher": (512, 4), "warmup": 1, "repeats": 9},
      "quick": {"vocab": 2048, "seq": 128, "batch": 2, "student": (64, 2), "teacher": (128, 2), "warmup": 1, "repeats": 2}}
KD_REAL = {"full": {"seq": 512, "batch": 4, "warmup": 1, "repeats": 5},
           "quick": {"seq": 128, "batch": 2, "warmup": 1, "repeats": 2}}
MEM = {"full": {"vocab": 128256, "tokens": 2048, "d": 256, "chunks": (1024, 256)},
       "quick": {"vocab": 16384, "tokens": 512, "d": 64, "chunks": (256, 64)}}
ZERO = {"full": {"vocab": 8192, "seq": 256, "student": (256, 4), "teacher": (384, 4), "steps": 40, "kv_lora_rank": 64},
        "quick": {"vocab": 1024, "seq": 64, "student": (64, 2), "teacher": (96, 2), "steps": 6, "kv_lora_rank": 16}}


def llama_config(vocab: int, width: int, layers: int) -> dict:
    """A Llama shape: head dim 32, 2 query heads per KV head, MLP 2x wide, untied head."""
    return {"vocab_size": vocab, "hidden_size": width, "num_hidden_layers": layers, "intermediate_size": 2 * width,
            "num_attention_heads": width // 32, "num_key_value_heads": max(1, width // 64), "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}


# ---- children (torch is imported only here) -------------------------------------------------------------------
def child_kd(spec: dict) -> dict:
    """Median seconds of (a) a KD step, (b) a student CE step, (c) a teacher forward."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from ecomla.distill.losses import LossConfig
    from ecomla.distill.teacher import LiveTeacher
    from ecomla.distill.trainer import batch_loss

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    if "student_dir" in spec:  # the real-model case: checkpoints from disk, fp32
        from transformers import AutoModelForCausalLM

        attn = spec.get("attn")  # "eager" for attention maps, as the trainer loads them; None: the default
        student = AutoModelForCausalLM.from_pretrained(spec["student_dir"], dtype=torch.float32,
                                                       attn_implementation=attn).train()
        teacher = AutoModelForCausalLM.from_pretrained(spec["teacher_dir"], dtype=torch.float32,
                                                       attn_implementation=attn)
        teacher = teacher.eval().requires_grad_(False)
        spec["vocab"] = student.config.vocab_size
    else:
        student = LlamaForCausalLM(LlamaConfig(**llama_config(spec["vocab"], *spec["student"]))).train()
        teacher = LlamaForCausalLM(LlamaConfig(**llama_config(spec["vocab"], *spec["teacher"]))).eval().requires_grad_(False)
    B, T = spec["batch"], spec["seq"]
    tokens = torch.randint(spec["vocab"], (B, T))  # (B, T), one document per row
    batch = {"tokens": tokens, "segments": torch.ones(B, T, dtype=torch.long), "loss_mask": torch.ones(B, T)}
    live = LiveTeacher(teacher, 1.0)

    def kd_step(recompute: bool = True, ild: float = 0.0, target: str = "block") -> None:
        spec_ = LossConfig(recompute=recompute, ild_weight=ild, ild_target=target)
        sums = batch_loss(student, live, batch, list(range(B)), spec_,
                          cross_document=True, dtype=torch.float32, device=torch.device("cpu"), chunk_tokens=1024,
                          ild_source="teacher" if ild else None)
        (sums.total / sums.tokens).backward()

    def ce_step() -> None:
        logits = student(input_ids=tokens).logits[:, :-1]  # (B, T-1, V)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()

    @torch.no_grad()
    def teacher_forward() -> None:
        teacher(input_ids=tokens)

    steps = {"kd_step": kd_step, "kd_step_no_recompute": lambda: kd_step(False), "ce_step": ce_step,
             "teacher_forward": teacher_forward}
    if spec.get("only"):  # one step kind alone, so that this child's peak RSS is that step's (part 4: ILD)
        steps = {spec["only"]: {"kd_step_no_recompute": lambda: kd_step(False),
                                "kd_ild_step": lambda: kd_step(False, ild=1.0),
                                "kd_maps_step": lambda: kd_step(False, ild=1.0, target="attention_map")}[spec["only"]]}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(spec["warmup"] + spec["repeats"]):
        for name, fn in steps.items():  # interleaved, so a change of machine load hits all three alike
            student.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            if i >= spec["warmup"]:
                times[name].append(time.perf_counter() - t0)
    return {"threads": torch.get_num_threads(), "vocab": spec["vocab"],
            "student_params": sum(p.numel() for p in student.parameters()),
            "teacher_params": sum(p.numel() for p in teacher.parameters()),
            **{name: {"median_s": statistics.median(t), "all_s": t} for name, t in times.items()}}


UPDATE = {"full": {"seq": 512, "batch": 1, "warmup": 1, "repeats": 5},
          "quick": {"seq": 128, "batch": 1, "warmup": 1, "repeats": 2}}


def child_update(spec: dict) -> dict:
    """Median seconds of the parts of a one-process ZeRO-0 step, the old way and the new (part 5)."""
    import deepspeed
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ecomla.distill.runtime import init_distributed

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    dist = init_distributed()
    student = AutoModelForCausalLM.from_pretrained(spec["student_dir"], dtype=torch.float32).train()
    B, T = spec["batch"], spec["seq"]
    tokens = torch.randint(student.config.vocab_size, (B, T))
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1, "train_batch_size": B,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**12}
    engines = {}
    for way, fused in (("old", False), ("new", True)):
        # old: torch's default loop, as the trainer had it (per tensor on CPU, foreach on CUDA)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-6, betas=(0.9, 0.95), fused=fused or None)
        engines[way] = deepspeed.initialize(model=student, optimizer=opt, config=config)[0]
    times: dict[str, list[float]] = {f"{way}_{part}": [] for way in engines for part in ("forward", "backward", "update")}
    for i in range(spec["warmup"] + spec["repeats"]):
        order = list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]
        for way, engine in order:  # interleaved, in turn first, so a change of machine load hits both alike
            t0 = time.perf_counter()
            logits = engine(input_ids=tokens).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            t1 = time.perf_counter()
            with engine.no_sync() if way == "new" else contextlib.nullcontext():
                engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            if i >= spec["warmup"]:
                for part, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("update", t3 - t2)):
                    times[f"{way}_{part}"].append(dt)
    assert dist.world_size == 1
    return {"threads": torch.get_num_threads(), "params": sum(p.numel() for p in student.parameters()),
            **{name: {"median_s": statistics.median(t), "all_s": t} for name, t in times.items()}}


def bench_update(size: dict, threads: int, work: Path, student: str) -> dict:
    """Part 5: the old and the new one-process update, in one child, interleaved."""
    res, _ = child("update", {**size, "threads": threads, "student_dir": str(Path(student).resolve())}, work, "update")
    step = {way: sum(res[f"{way}_{part}"]["median_s"] for part in ("forward", "backward", "update"))
            for way in ("old", "new")}
    return {**res, "sizes": {**size, "student": student}, "step_s": step, "new_over_old": step["new"] / step["old"]}


def bench_ild(size: dict, threads: int, work: Path, student: str, teacher: str) -> dict:
    """Part 4: a KD step with and without intermediate-layer distillation (the teacher as the ILD source, so
    one teacher forward serves both), each in a child of its own: median step time and peak RSS, as ratios."""
    rows = {}
    for name in ("kd_step_no_recompute", "kd_ild_step", "kd_maps_step"):
        print(f"  ild: {name} ...", flush=True)
        spec = {**size, "only": name, "threads": threads, "student_dir": str(Path(student).resolve()),
                "teacher_dir": str(Path(teacher).resolve()), "attn": "eager" if name == "kd_maps_step" else None}
        res, rss = child("kd", spec, work, f"ild_{name}", MALLOC)
        rows[name] = {"median_s": res[name]["median_s"], "all_s": res[name]["all_s"], "maxrss_bytes": rss}
    kd, ild, maps = rows["kd_step_no_recompute"], rows["kd_ild_step"], rows["kd_maps_step"]
    return {"sizes": {**size, "student": student, "teacher": teacher}, "runs": rows, "threads": threads,
            "time_ild_over_kd": ild["median_s"] / kd["median_s"],
            "peak_rss_ild_over_kd": ild["maxrss_bytes"] / kd["maxrss_bytes"],
            "time_maps_over_kd": maps["median_s"] / kd["median_s"],
            "peak_rss_maps_over_kd": maps["maxrss_bytes"] / kd["maxrss_bytes"]}


def child_mem(spec: dict) -> dict:
    """Forward + backward of one loss (or nothing, for the floor) on (T, d) hidden states."""
    import torch

    from ecomla.distill.losses import LossConfig, TeacherDist, chunked_loss

    def run(mode: str, T: int, d: int, V: int, chunk: int = 0, checkpoint: bool = False) -> dict:
        torch.manual_seed(0)
        hidden = torch.randn(T, d, requires_grad=True)  # (T, d) student rows
        head = torch.nn.Linear(d, V, bias=False)
        t_hidden = torch.randn(T, d)  # (T, d) teacher rows
        t_head = torch.nn.Linear(d, V, bias=False).requires_grad_(False)
        targets = torch.randint(V, (T,))
        t0 = time.perf_counter()
        if mode == "floor":
            return {"loss": None, "seconds": 0.0}
        if mode == "naive":
            with torch.no_grad():
                log_p = torch.log_softmax(t_head(t_hidden), -1)  # (T, V)
            log_q = torch.log_softmax(head(hidden), -1)  # (T, V)
            loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        else:
            loss = chunked_loss(hidden, head, lambda s, e: TeacherDist.from_logits(t_head(t_hidden[s:e]), 1.0),
                                targets, LossConfig(), chunk, checkpoint=checkpoint).total / T
        loss.backward()
        return {"loss": float(loss), "seconds": time.perf_counter() - t0}

    torch.set_num_threads(spec["threads"])
    # Every child, the floor too, first runs every code path once at toy size: the first non-reentrant
    # checkpoint imports ~800 modules (~80 MB, ~1 s), which is not the loss's memory.
    for mode, checkpoint in (("naive", False), ("chunked", False), ("chunked", True)):
        run(mode, 8, 16, 32, chunk=4, checkpoint=checkpoint)
    return run(spec["mode"], spec["tokens"], spec["d"], spec["vocab"], spec.get("chunk", 0), spec.get("checkpoint", False))


def child_world(spec: dict) -> dict:
    """Tokenizer, corpus, MLA student (converted from a Llama) and Llama teacher for the ZeRO runs."""
    from tests.convert.helpers import convert  # the child runs in the checkout (cwd, PYTHONPATH): tests/ imports
    from tests.tiny import domain_text, make_source, make_tokenizer

    root = Path(spec["root"])
    tok = make_tokenizer(root / "tok")
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in domain_text("a", 1500, 1) + domain_text("b", 1500, 1))
    base = make_source(root / "base", tok, seed=1, **llama_config(spec["vocab"], *spec["student"]))
    convert(base, root / "student", mla={"kv_lora_rank": spec["kv_lora_rank"], "qk_rope_head_dim": 16})
    make_source(root / "teacher", tok, seed=2, **llama_config(spec["vocab"], *spec["teacher"]))
    return {"root": str(root)}


CHILDREN = {"kd": child_kd, "mem": child_mem, "world": child_world, "update": child_update}


# ---- parent ---------------------------------------------------------------------------------------------------
def spawn(cmd: list[str], log: Path, extra_env: dict[str, str]) -> tuple[int, float, int]:
    """Run cmd with stdout+stderr to log; (return code, wall seconds, this child's own ru_maxrss in bytes)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra_env)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env.setdefault("HF_HOME", str(ROOT / ".cache" / "hf"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, so tell Popen
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024  # ru_maxrss is KiB on Linux


def failed(what: str, rc: int, log: Path) -> RuntimeError:
    return RuntimeError(f"{what} failed (rc {rc}); end of {log}:\n" + "\n".join(log.read_text().splitlines()[-40:]))


def child(kind: str, spec: dict, work: Path, name: str, extra_env: dict[str, str] | None = None) -> tuple[dict, int]:
    """Run one child of this script; (its JSON result, its peak RSS in bytes)."""
    log = work / f"{name}.log"
    threads = {"OMP_NUM_THREADS": str(spec["threads"])} if "threads" in spec else {}
    rc, _, rss = spawn([sys.executable, __file__, "--child", kind, json.dumps(spec)], log,
                       {**threads, "PYTHONPATH": str(ROOT), **(extra_env or {})})
    lines = log.read_text().splitlines()
    if rc != 0 or not lines or not lines[-1].startswith("{"):
        raise failed(f"child {name}", rc, log)
    return json.loads(lines[-1]), rss


def bench_memory(size: dict, threads: int, work: Path) -> dict:
    mem = dict(size)
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    avail = int(meminfo["MemAvailable"].split()[0]) * 1024
    scaled = []
    while 10 * 4 * mem["tokens"] * mem["vocab"] > 0.6 * avail and mem["tokens"] > 256:  # ~10 live (T, V) fp32
        mem["tokens"] //= 2
        scaled.append(f"tokens halved to {mem['tokens']}: ~10 x (T, V) fp32 would exceed 60% of MemAvailable "
                      f"({avail / 2**30:.1f} GiB)")
    runs = {"floor": {"mode": "floor"}, "naive": {"mode": "naive"},
            "unchunked_lib": {"mode": "chunked", "chunk": mem["tokens"], "checkpoint": False}}
    runs.update({f"chunked_{c}": {"mode": "chunked", "chunk": c, "checkpoint": True} for c in mem["chunks"]})
    rows = {}
    for name, extra in runs.items():
        print(f"  memory: {name} ...", flush=True)
        spec = {"vocab": mem["vocab"], "tokens": mem["tokens"], "d": mem["d"], "threads": threads, **extra}
        res, rss = child("mem", spec, work, f"mem_{name}", MALLOC)
        rows[name] = {**extra, **res, "maxrss_bytes": rss}
    for row in rows.values():
        row["peak_minus_floor_mib"] = (row["maxrss_bytes"] - rows["floor"]["maxrss_bytes"]) / MiB
    for name, row in rows.items():
        if name.startswith("chunked_"):
            row["naive_over_this"] = rows["naive"]["peak_minus_floor_mib"] / max(1e-9, row["peak_minus_floor_mib"])
    losses = [row["loss"] for name, row in rows.items() if name != "floor"]
    return {"sizes": {k: mem[k] for k in ("vocab", "tokens", "d")}, "scaled_down": scaled, "runs": rows,
            "threads": threads, "malloc_env": MALLOC, "loss_spread": max(losses) - min(losses),
            "logits_bytes_fp32": 4 * mem["tokens"] * mem["vocab"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_zero(size: dict, work: Path, keep: bool) -> dict:
    world = work / "world"
    shutil.rmtree(world, ignore_errors=True)
    world.mkdir(parents=True)
    print("  zero: building student (convert) and teacher ...", flush=True)
    child("world", {**size, "root": str(world)}, work, "world")
    seq, per_step = size["seq"], 4  # 4 sequences per step: micro-batch 2 on each of 2 ranks, no accumulation
    out: dict = {"precision": "fp32", "seq_len": seq, "sequences_per_step": per_step, "steps": size["steps"]}
    for stage in (2, 3):  # identical recipes but for the ZeRO stage
        run_dir, path, log = world / f"run_zero{stage}", world / f"zero{stage}.yaml", work / f"zero{stage}.log"
        path.write_text(yaml.safe_dump({
            "student": str(world / "student"), "teacher": {"model": str(world / "teacher")},
            "data": {"train": {"dataset": str(world / "corpus.jsonl")}, "seq_len": seq},
            "train": {"total_tokens": seq * per_step * size["steps"], "global_batch_tokens": seq * per_step,
                      "micro_batch_size": 2, "lr": 1e-3, "warmup_ratio": 0.0, "precision": "fp32"},
            "deepspeed": {"zero_stage": stage, "config": f"recipes/deepspeed/zero{stage}.json"},
            "checkpoint": {"every_steps": 0}, "log": {"tensorboard": False}, "output_dir": str(run_dir),
        }, sort_keys=False))
        print(f"  zero: ZeRO-{stage}, 2 processes ...", flush=True)
        torchrun = str(Path(sys.executable).parent / "torchrun")
        rc, wall, _ = spawn([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "ecomla.distill",
                             str(path), "--quiet"], log, {"OMP_NUM_THREADS": "1"})  # 2 ranks on 2 cores
        if rc != 0:
            raise failed(f"ZeRO-{stage} run", rc, log)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [r for r in rows if "tokens_per_s" in r]
        tps = [r["tokens_per_s"] for r in steps if r["step"] > 3]
        out[f"zero{stage}"] = {"median_tokens_per_s": statistics.median(tps), "tokens_per_s": tps, "wall_s": wall,
                               "first_kd": steps[0]["kd"], "last_kd": steps[-1]["kd"]}
    out["zero3_over_zero2"] = out["zero3"]["median_tokens_per_s"] / out["zero2"]["median_tokens_per_s"]
    if not keep:
        shutil.rmtree(world)
    return out


def print_tables(r: dict) -> None:
    m = r["machine"]
    print(f"\nmachine: {m['cpus']} CPUs, torch {m['torch']}, deepspeed {m['deepspeed']}, transformers "
          f"{m['transformers']}, load average {m['load_avg_1min_at_start']:.2f} at start; preset {r['preset']}")
    for part in ("kd", "kd_real"):
        if part not in r:
            continue
        k, s = r[part], r[part]["sizes"]
        models = (f"student {s['student']}, teacher {s['teacher']}" if part == "kd_real"
                  else f"student {s['student']}, teacher {s['teacher']} (width, layers)")
        print(f"\n1{'b' if part == 'kd_real' else ''}. KD overhead{' on a real model' if part == 'kd_real' else ''} "
              f"(vocab {k['vocab']}, {s['batch']}x{s['seq']} tokens, {models}; {k['threads']} threads; "
              f"median of {s['repeats']})")
        tokens = s["batch"] * s["seq"]
        for name, label in (("kd_step", "(a) KD step: teacher fwd + student fwd + chunked KD + bwd"),
                            ("kd_step_no_recompute", "(a') the same, loss.recompute: false"),
                            ("ce_step", "(b) student CE step: fwd + full-logits CE + bwd"),
                            ("teacher_forward", "(c) teacher forward (no grad)")):
            if name in k:
                t = k[name]["median_s"]
                print(f"  {label:<58} {t:8.3f} s {tokens / t:9.0f} tokens/s")
        print(f"  {'a / (b + c)':<58} {k['a_over_b_plus_c']:8.3f}")
        if "a_no_recompute_over_b_plus_c" in k:
            label = "a' / (b + c)"
            print(f"  {label:<58} {k['a_no_recompute_over_b_plus_c']:8.3f}")
    if "memory" in r:
        mm, s = r["memory"], r["memory"]["sizes"]
        print(f"\n2. Loss-only peak memory (vocab {s['vocab']}, {s['tokens']} tokens, d {s['d']}; one (T, V) fp32 "
              f"tensor = {mm['logits_bytes_fp32'] / MiB:.0f} MiB)")
        for note in mm["scaled_down"]:
            print(f"  SCALED DOWN: {note}")
        print(f"  {'run':<16} {'maxRSS MiB':>10} {'- floor MiB':>11} {'seconds':>8} {'naive/this':>10} {'loss':>10}")
        for name, x in mm["runs"].items():
            ratio = f"{x['naive_over_this']:10.2f}" if "naive_over_this" in x else " " * 10
            loss = f"{x['loss']:10.5f}" if x["loss"] is not None else " " * 10
            print(f"  {name:<16} {x['maxrss_bytes'] / MiB:10.0f} {x['peak_minus_floor_mib']:11.0f} {x['seconds']:8.2f} "
                  f"{ratio} {loss}")
        print(f"  (chunked_N: chunked_loss, checkpoint=True, chunk N; unchunked_lib: chunked_loss in one chunk, no "
              f"checkpoint;\n   loss spread {mm['loss_spread']:.1e}; seconds: forward + backward on {mm['threads']} "
              f"threads under MALLOC_MMAP_THRESHOLD_={MALLOC['MALLOC_MMAP_THRESHOLD_']})")
    if "ild" in r:
        x, s = r["ild"], r["ild"]["sizes"]
        print(f"\n4. Intermediate-layer distillation on {s['student']} from {s['teacher']} ({s['batch']}x{s['seq']} "
              f"tokens, loss.recompute false, {x['threads']} threads; each step kind in its own child)")
        for name, label in (("kd_step_no_recompute", "KD step"), ("kd_ild_step", "KD + ILD step (ild_weight 1)"),
                            ("kd_maps_step", "KD + attention maps (eager)")):
            row = x["runs"][name]
            print(f"  {label:<30} {row['median_s']:8.3f} s   peak RSS {row['maxrss_bytes'] / MiB:8.0f} MiB")
        print(f"  time ILD / KD {x['time_ild_over_kd']:.3f}   peak RSS ILD / KD {x['peak_rss_ild_over_kd']:.3f}")
        print(f"  time maps / KD {x['time_maps_over_kd']:.3f}   peak RSS maps / KD {x['peak_rss_maps_over_kd']:.3f}")
    if "update" in r:
        x, s = r["update"], r["update"]["sizes"]
        print(f"\n5. The one-process update on {s['student']} ({s['batch']}x{s['seq']} tokens, DeepSpeed ZeRO-0, fp32, "
              f"{x['threads']} threads; median of {s['repeats']})")
        print(f"  {'':<44} {'forward':>8} {'backward':>9} {'update':>8} {'step':>8}")
        for way, label in (("old", "old: all-reduce over 1 rank, per-tensor AdamW"), ("new", "new: no_sync, fused AdamW")):
            parts = [x[f"{way}_{part}"]["median_s"] for part in ("forward", "backward", "update")]
            print(f"  {label:<44} {parts[0]:8.3f} {parts[1]:9.3f} {parts[2]:8.3f} {x['step_s'][way]:8.3f} s")
        print(f"  step new / old {x['new_over_old']:.3f}")
    if "zero" in r:
        z = r["zero"]
        print(f"\n3. ecomla distill on 2 processes ({z['precision']}, seq {z['seq_len']}, {z['sequences_per_step']} "
              f"sequences/step, {z['steps']} steps; median tokens/s after step 3)")
        for stage in (2, 3):
            x = z[f"zero{stage}"]
            print(f"  ZeRO-{stage}   {x['median_tokens_per_s']:9.1f} tokens/s   run wall {x['wall_s']:6.1f} s   "
                  f"kd {x['first_kd']:.3f} -> {x['last_kd']:.3f}")
        print(f"  ZeRO-3 / ZeRO-2   {z['zero3_over_zero2']:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every part")
    p.add_argument("--out", type=Path, default=Path(".cache/bench_distill/bench_distill.json"), help="JSON results")
    p.add_argument("--workdir", type=Path, default=Path(".cache/bench_distill"), help="child logs and run outputs")
    p.add_argument("--keep", action="store_true", help="keep the ZeRO models and run outputs")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of the one-process parts")
    p.add_argument("--skip", nargs="*", default=[], choices=["kd", "kd_real", "memory", "zero", "ild", "update"], help="parts to leave out")
    p.add_argument("--real", nargs=2, metavar=("STUDENT", "TEACHER"), default=None,
                   help="also part 1 on real checkpoints, e.g. an `ecomla convert` output of SmolLM2 and SmolLM2 "
                   "itself (fp32, 4x512 tokens: the main job's micro-batch)")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)  # KIND JSON: one measured child
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))))
        return 0
    preset = "quick" if args.quick else "full"
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"preset": preset, "machine": {
        "cpus": os.cpu_count(), "torch": version("torch"), "deepspeed": version("deepspeed"),
        "transformers": version("transformers"), "python": platform.python_version(),
        "load_avg_1min_at_start": os.getloadavg()[0], "platform": platform.platform()}}
    t0 = time.perf_counter()
    if "memory" not in args.skip:
        result["memory"] = bench_memory(MEM[preset], args.threads, work)
    if "kd" not in args.skip:
        print("  kd overhead ...", flush=True)
        kd, _ = child("kd", {**KD[preset], "threads": args.threads}, work, "kd")
        kd["sizes"] = KD[preset]
        kd["a_over_b_plus_c"] = kd["kd_step"]["median_s"] / (kd["ce_step"]["median_s"] + kd["teacher_forward"]["median_s"])
        kd["a_no_recompute_over_b_plus_c"] = (kd["kd_step_no_recompute"]["median_s"]
                                              / (kd["ce_step"]["median_s"] + kd["teacher_forward"]["median_s"]))
        result["kd"] = kd
    if args.real is not None and "kd_real" not in args.skip:
        print("  kd overhead on the real model ...", flush=True)
        size = {**KD_REAL[preset], "student": args.real[0], "teacher": args.real[1]}
        kd, _ = child("kd", {**size, "student_dir": str(Path(args.real[0]).resolve()),
                             "teacher_dir": str(Path(args.real[1]).resolve()), "threads": args.threads}, work, "kd_real")
        kd["sizes"] = size
        kd["a_over_b_plus_c"] = kd["kd_step"]["median_s"] / (kd["ce_step"]["median_s"] + kd["teacher_forward"]["median_s"])
        kd["a_no_recompute_over_b_plus_c"] = (kd["kd_step_no_recompute"]["median_s"]
                                              / (kd["ce_step"]["median_s"] + kd["teacher_forward"]["median_s"]))
        result["kd_real"] = kd
    if args.real is not None:
        if "ild" not in args.skip:
            result["ild"] = bench_ild(KD_REAL[preset], args.threads, work, *args.real)
        if "update" not in args.skip:
            print("  the one-process update on the real model ...", flush=True)
            result["update"] = bench_update(UPDATE[preset], args.threads, work, args.real[0])
    if "zero" not in args.skip:
        result["zero"] = bench_zero(ZERO[preset], work, args.keep)
    result["wall_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_tables(result)
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
