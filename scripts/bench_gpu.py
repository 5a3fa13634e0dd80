"""Benchmark: `ecomla distill` where users run it, at real model shapes with random weights: tokens/s, MFU and
peak memory under ZeRO-2 and ZeRO-3, launched by `deepspeed` as a user launches it.

    python scripts/bench_gpu.py --out OUT/distill.json                  # on a GPU: bf16, NCCL, seq 2048
    python scripts/bench_gpu.py --cpu --out OUT/distill.json            # CPU mode: tiny shapes, fp32, gloo, seconds

Per shape (`llama3.2-1b`: hidden 2048, 16 layers, 32 heads, 8 KV heads of 64, MLP 8192, vocab 128,256;
`smollm2-135m`: hidden 576, 30 layers, 9 heads, 3 KV heads of 64, MLP 1536, vocab 49,152; `tiny` in CPU mode)
it writes a Llama with random weights (speed and memory do not depend on the values; no checkpoint is carried),
converts it with `ecomla convert`'s own code into the MLA student (X-EcoMLA's 1B budget, r_kv 128 + d_r 32, or
SmolLM2's 4.0x budget, 64 + 32), and self-distils it from the Llama for a few steps on the tiny world's text with
the tiny world's tokenizer (its ids are a subset of the model's vocabulary, and the logits still cover every id).
Reported per run, from the trainer's own metrics.jsonl after the first `--warm` steps: median tokens/s, peak
memory (CUDA: allocated; CPU: RSS) and the model FLOPs utilisation, MFU = tokens/s × FLOPs per token / the
device's peak (bf16 dense; null where the device is not in PEAK_FLOPS, and on CPU). FLOPs per token count the
student's training step (3 × its forward: 2 × the matmul parameters, the head included, plus causal attention)
and the teacher's forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# Llama shapes: (hidden, layers, heads, kv heads, head dim, mlp, vocab), and the MLA budget (r_kv, d_r)
SHAPES = {
    "llama3.2-1b": ((2048, 16, 32, 8, 64, 8192, 128256), (128, 32)),
    "smollm2-135m": ((576, 30, 9, 3, 64, 1536, 49152), (64, 32)),
    "tiny": ((64, 2, 4, 2, 16, 128, 1024), (16, 8)),
}
# bf16 dense tensor-core peak FLOP/s by device name (vendor data sheets, SXM parts)
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}
GPU_RUNS = [  # (shape, ZeRO stage, sequence length, micro-batch, steps)
    ("llama3.2-1b", 2, 2048, 4, 12), ("llama3.2-1b", 3, 2048, 4, 12), ("smollm2-135m", 2, 2048, 8, 8)]
CPU_RUNS = [("tiny", 2, 64, 2, 4), ("tiny", 3, 64, 2, 4)]


def llama_config(shape: str) -> dict:
    hidden, layers, heads, kv, head_dim, mlp, vocab = SHAPES[shape][0]
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "intermediate_size": mlp, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "bos_token_id": 0, "eos_token_id": 0}


def build_world(shape: str, root: Path, device: str, dtype: str, tokenizer: Path) -> dict:
    """The random Llama (teacher) and its `ecomla convert` output (student) under root/shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.convert.stream import convert_recipe
    from ecomla.recipe.schema import load_recipe

    base, student = root / shape / "llama", root / shape / "mla"
    torch.manual_seed(0)
    cfg = llama_config(shape)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=getattr(torch, dtype))
    model.save_pretrained(base)
    del model
    for f in tokenizer.iterdir():
        shutil.copy2(f, base / f.name)
    r_kv, d_r = SHAPES[shape][1]
    recipe = load_recipe(ConvertRecipe, data={"model": str(base), "output_dir": str(student), "dtype": dtype,
                                              "device": device, "mla": {"kv_lora_rank": r_kv, "qk_rope_head_dim": d_r},
                                              "init": {"method": "svd"}})
    convert_recipe(recipe, force=True, progress=False)
    return {"teacher": base, "student": student}


def matmul_params(config: dict) -> int:
    """Parameters a token's forward multiplies through: every layer's projections and the head (no embedding
    lookup, no norms)."""
    d, L, V = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    mlp = 3 * d * config["intermediate_size"]
    if config["model_type"] == "deepseek_v3":
        n, r, d_r = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        attn = d * n * (nope + d_r) + d * (r + d_r) + r * n * (nope + v) + n * v * d
    else:
        n, kv, h = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        attn = d * n * h + 2 * d * kv * h + n * h * d
    return L * (attn + mlp) + V * d


def attention_flops(config: dict, seq: int) -> float:
    """Forward FLOPs per token of causal attention itself (scores and the weighted sum), mean over positions."""
    n, L = config["num_attention_heads"], config["num_hidden_layers"]
    if config["model_type"] == "deepseek_v3":
        qk, v = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    else:
        qk = v = config["head_dim"]
    return 2 * L * n * (qk + v) * seq / 2


def flops_per_token(student: dict, teacher: dict, seq: int) -> float:
    """A KD step per token: the student's training (3 forwards' worth) and the teacher's forward."""
    fwd = lambda c: 2 * matmul_params(c) + attention_flops(c, seq)  # noqa: E731
    return 3 * fwd(student) + fwd(teacher)


def peak_flops(device_name: str | None) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if device_name and k in device_name), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distill(world: dict, run_dir: Path, zero: int, seq: int, micro: int, steps: int, precision: str) -> Path:
    """One `deepspeed --module ecomla.distill` run on one device; returns its metrics.jsonl."""
    recipe = {"student": str(world["student"]), "teacher": {"model": str(world["teacher"])},
              "data": {"train": {"dataset": "tinyworld:train", "max_documents": 4000}, "seq_len": seq},
              "loss": {"kind": "forward_kl", "recompute": False},
              "train": {"total_tokens": seq * micro * steps, "global_batch_tokens": seq * micro,
                        "micro_batch_size": micro, "lr": 1e-4, "warmup_ratio": 0.0, "precision": precision,
                        "gradient_checkpointing": zero == 3},
              "deepspeed": {"zero_stage": zero, "config": f"recipes/deepspeed/zero{zero}.json"},
              "checkpoint": {"every_steps": 0}, "log": {"tensorboard": False}, "output_dir": str(run_dir)}
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    launcher = str(Path(sys.executable).parent / "deepspeed")
    cmd = [launcher, "--num_gpus", "1", "--master_port", str(free_port()), "--module", "ecomla.distill", str(path),
           "--quiet"]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {rc}); end of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-40:]))
    return run_dir / "metrics.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU mode: tiny shapes, fp32, a few steps (what CI runs)")
    p.add_argument("--out", type=Path, required=True, help="JSON results")
    p.add_argument("--workdir", type=Path, default=None, help="models and runs (default: beside --out)")
    p.add_argument("--warm", type=int, default=2, help="steps left out of the medians")
    args = p.parse_args(argv)
    import torch

    from ecomla.tinyworld.tokenizer import train_tokenizer

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        p.error("no CUDA device: pass --cpu for the CPU mode")
    device, dtype, precision = ("cuda", "bfloat16", "bf16") if cuda else ("cpu", "float32", "fp32")
    work = (args.workdir or args.out.parent / "bench_gpu").resolve()
    work.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"
    peak = peak_flops(device_name) if cuda else None
    t0 = time.time()
    tokenizer = train_tokenizer(work / "tokenizer", vocab_size=512, num_docs=200)
    result = {"device": device_name, "mode": "cpu" if args.cpu else "gpu", "precision": precision,
              "torch": torch.__version__, "peak_flops": peak, "runs": []}
    worlds = {}
    for shape, zero, seq, micro, steps in (CPU_RUNS if args.cpu else GPU_RUNS):
        if shape not in worlds:
            print(f"{shape}: random Llama and its MLA conversion ...", flush=True)
            worlds[shape] = build_world(shape, work, device, dtype, tokenizer)
        print(f"{shape}: ZeRO-{zero}, seq {seq}, micro-batch {micro}, {steps} steps ...", flush=True)
        rows = [json.loads(line) for line in
                distill(worlds[shape], work / f"{shape}_zero{zero}", zero, seq, micro, steps, precision).read_text().splitlines()]
        rows = [r for r in rows if "tokens_per_s" in r]
        timed = [r for r in rows if r["step"] > args.warm] or rows
        tps = statistics.median(r["tokens_per_s"] for r in timed)
        configs = [json.loads((worlds[shape][k] / "config.json").read_text()) for k in ("student", "teacher")]
        fpt = flops_per_token(*configs, seq)
        result["runs"].append({
            "shape": shape, "zero_stage": zero, "seq_len": seq, "micro_batch_size": micro, "steps": len(rows),
            "tokens_per_s": tps, "tokens_per_s_all": [r["tokens_per_s"] for r in rows],
            "peak_memory_gib": max(r["peak_memory_gib"] for r in rows), "flops_per_token": fpt,
            "mfu": tps * fpt / peak if peak else None, "kd_first_last": [rows[0]["kd"], rows[-1]["kd"]],
            "student_matmul_params": matmul_params(configs[0]), "teacher_matmul_params": matmul_params(configs[1])})
        r = result["runs"][-1]
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"  {tps:,.0f} tokens/s, peak {r['peak_memory_gib']:.2f} GiB, MFU {mfu}", flush=True)
    result["wall_s"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
