"""Benchmark: time and peak memory of `ecomla convert` on a checkpoint with Llama-3.2-1B shapes.

    python scripts/bench_convert.py              # 16 layers, ~2.5 GB checkpoint, a few minutes on CPU
    python scripts/bench_convert.py --layers 2   # quick check

It builds a random bf16 checkpoint with Llama-3.2-1B shapes on disk, shard by shard
(never the whole model in memory), caches it under --workdir, and converts it with
`python -m ecomla convert` (SVD init, r_kv=64, d_r=32, bf16, CPU). Side by side in one
run it measures an interpreter floor (a process that only imports torch, transformers
and the converter) and the conversion, and reports peak RSS as ratios: of the
checkpoint size, and of the target 1.5 x checkpoint + one layer (<= 1 passes).
It prints a table, writes JSON (--out), and exits 1 if the conversion fails or misses the target.

Why child processes: peak RSS is a high-water mark per process. Measured in this
process it would include whatever the benchmark itself allocated (building the
checkpoint, imports), so the build, the floor and the conversion each run in their own
child, and the parent stays free of torch: a child's ru_maxrss also counts the parent's
memory copied at fork, which must stay negligible.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import yaml

GiB = 1 << 30
# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json); num_hidden_layers is --layers.
LLAMA_1B = {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LAYERS_PER_SHARD = 4


def layer_shapes() -> dict[str, tuple[int, ...]]:
    """name (relative to model.layers.i) -> shape of one decoder layer."""
    c = LLAMA_1B
    d, inter = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter),
    }


def layer_bytes() -> int:
    """Bytes of one decoder layer in bf16."""
    return sum(2 * math.prod(shape) for shape in layer_shapes().values())


def build_checkpoint(dest: Path, layers: int) -> None:
    """Write config.json and safetensors shards of `LAYERS_PER_SHARD` layers; runs in a child process."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=layers, **LLAMA_1B).save_pretrained(tmp)
    gen = torch.Generator().manual_seed(0)

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)

    groups = [range(i, min(i + LAYERS_PER_SHARD, layers)) for i in range(0, layers, LAYERS_PER_SHARD)]
    weight_map: dict[str, str] = {}
    total = 0
    for s, group in enumerate(groups):
        shard: dict[str, torch.Tensor] = {}
        if s == 0:  # tied embeddings: no lm_head.weight
            shard["model.embed_tokens.weight"] = tensor("embed", (LLAMA_1B["vocab_size"], LLAMA_1B["hidden_size"]))
            shard["model.norm.weight"] = tensor("norm.weight", (LLAMA_1B["hidden_size"],))
        for i in group:
            shard.update({f"model.layers.{i}.{k}": tensor(k, shape) for k, shape in layer_shapes().items()})
        fname = f"model-{s + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, fname))
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tmp.rename(dest)  # only a complete checkpoint ever carries the final name


def is_complete(ckpt: Path) -> bool:
    index = ckpt / "model.safetensors.index.json"
    if not (ckpt / "config.json").is_file() or not index.is_file():
        return False
    return all((ckpt / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))


@dataclass
class Run:
    """One measured child process."""

    returncode: int
    wall_s: float
    maxrss_bytes: int  # ru_maxrss of this child alone (os.wait4), the figure the target uses
    polled_rss_bytes: int  # highest VmRSS seen polling /proc every 20 ms (a cross-check)
    polled_anon_bytes: int  # highest RssAnon: heap, tensors
    polled_file_bytes: int  # highest RssFile: mapped files, e.g. safetensors shards read via mmap


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of a live process, in bytes (empty once it has exited)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines if line.startswith(("VmRSS:", "RssAnon:", "RssFile:")))
    return {f[0].rstrip(":"): int(f[1]) * 1024 for f in fields}  # values are in kB


def measure(cmd: list[str], log: Path) -> Run:
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for k, v in proc_status(proc.pid).items():
                peak[k] = max(peak[k], v)
            time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, so tell Popen
    return Run(proc.returncode, wall, usage.ru_maxrss * 1024, peak["VmRSS"], peak["RssAnon"], peak["RssFile"])


def bench(args: argparse.Namespace) -> dict | None:
    """Build (or reuse) the checkpoint, measure floor and conversion; the results dict, or None on failure."""
    load = os.getloadavg()[0]  # other work on the machine slows the wall times (not the memory)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"llama-3.2-1b-shapes-L{args.layers}"
    if is_complete(ckpt):
        print(f"reusing {ckpt}")
    else:
        print(f"building {ckpt} ...", flush=True)
        subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--build-only", str(ckpt)], check=True)
        os.sync()  # flush the fresh shards now: their writeback would otherwise slow the measured run
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))

    out_dir = work / f"converted-L{args.layers}"
    recipe = work / f"recipe-L{args.layers}.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": str(ckpt), "output_dir": str(out_dir), "dtype": "bfloat16", "device": "cpu",
        "mla": {"kv_lora_rank": 64, "qk_rope_head_dim": 32}, "init": {"method": "svd"},
    }, sort_keys=False))
    print("measuring the import floor ...", flush=True)
    floor = measure([sys.executable, "-c", "import torch, transformers, ecomla.convert.converter"], work / "floor.log")
    print(f"converting ({args.layers} layers) ...", flush=True)
    conv = measure([sys.executable, "-m", "ecomla", "convert", str(recipe), "--force", "--quiet"], work / "convert.log")
    for name, r in (("floor", floor), ("convert", conv)):
        if r.returncode != 0:
            print(f"{name} child failed; end of {work / name}.log:\n" + (work / f"{name}.log").read_text()[-4000:])
            return None
    converter_s = json.loads((out_dir / "conversion_report.json").read_text())["seconds"]
    out_bytes = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    if not args.keep:
        shutil.rmtree(out_dir)

    target = 1.5 * ckpt_bytes + layer_bytes()
    return {
        "layers": args.layers, "checkpoint_bytes": ckpt_bytes, "checkpoint_gib": ckpt_bytes / GiB,
        "layer_bytes_bf16": layer_bytes(), "output_bytes": out_bytes,
        "wall_s": {"floor": floor.wall_s, "convert": conv.wall_s, "converter_reported": converter_s},
        "floor": asdict(floor), "convert": asdict(conv),
        "peak_rss_gib": conv.maxrss_bytes / GiB, "floor_rss_gib": floor.maxrss_bytes / GiB,
        "peak_minus_floor_gib": (conv.maxrss_bytes - floor.maxrss_bytes) / GiB,
        "peak_over_checkpoint": conv.maxrss_bytes / ckpt_bytes,
        "target_bytes": target, "peak_over_target": conv.maxrss_bytes / target, "pass": conv.maxrss_bytes <= target,
        "machine": {"cpus": os.cpu_count(), "torch": version("torch"), "transformers": version("transformers"),
                    "load_avg_1min_at_start": load, "python": platform.python_version(),
                    "platform": platform.platform()},
    }


def print_table(r: dict) -> None:
    def gib(b: float) -> str:
        return f"{b / GiB:7.3f}"

    m, ckpt = r["machine"], r["checkpoint_bytes"]
    print(f"\ncheckpoint: {r['layers']} layers, {ckpt:,} B ({ckpt / GiB:.3f} GiB); "
          f"one layer {r['layer_bytes_bf16']:,} B; output {r['output_bytes'] / GiB:.3f} GiB")
    print(f"machine: {m['cpus']} CPUs, torch {m['torch']}, load average {m['load_avg_1min_at_start']:.2f} at start\n")
    print(f"{'process':<9} {'wall s':>7} {'maxRSS GiB':>10} {'polled':>7} {'anon':>7} {'file':>7}")
    for name in ("floor", "convert"):
        p = r[name]
        print(f"{name:<9} {p['wall_s']:7.1f} {gib(p['maxrss_bytes']):>10} {gib(p['polled_rss_bytes'])} "
              f"{gib(p['polled_anon_bytes'])} {gib(p['polled_file_bytes'])}")
    print(f"\nconverter's own time            {r['wall_s']['converter_reported']:8.1f} s")
    print(f"peak RSS - floor                {r['peak_minus_floor_gib']:8.3f} GiB")
    print(f"peak RSS / checkpoint           {r['peak_over_checkpoint']:8.3f}")
    verdict = "PASS" if r["pass"] else "FAIL"
    print(f"peak RSS / (1.5 ckpt + 1 layer) {r['peak_over_target']:8.3f}   {verdict} (target <= 1)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="decoder layers (Llama-3.2-1B has 16)")
    p.add_argument("--workdir", type=Path, default=Path(".cache/bench_convert"), help="checkpoint cache and output")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default <workdir>/bench_convert.json)")
    p.add_argument("--keep", action="store_true", help="keep the converted checkpoint")
    p.add_argument("--build-only", type=Path, default=None, help=argparse.SUPPRESS)  # the build child
    args = p.parse_args()
    if args.build_only is not None:
        build_checkpoint(args.build_only, args.layers)
        return 0
    result = bench(args)
    if result is None:
        return 1
    out = args.out or args.workdir.resolve() / "bench_convert.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"\nwrote {out}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
