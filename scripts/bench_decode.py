"""Benchmark: decode latency and KV memory of the base (GQA), stock-HF MLA and absorbed MLA, side by side.

    python scripts/bench_decode.py                       # CPU, fp32, 2 layers, batch 4, contexts 512 .. 32k
    python scripts/bench_decode.py --device cuda --dtype bfloat16 --layers 16

Models have Llama-3.2-1B attention shapes (hidden 2048, 32 heads, 8 KV heads of
64, MLP 8192, vocab 128256) with random weights and `--layers` layers: the
base is a stock LlamaForCausalLM; the MLA model a stock DeepseekV3ForCausalLM
with r_kv = 64 and d_r = 32 (10.67x), run once through its own attention and
once through ecomla's absorbed decoding (same weights, same cache).

Per context length S it measures, in one run on one machine:
  - KV bytes per token, read off a real cache filled to S tokens (not a formula);
    decoding runs --batch sequences at once, as a server does, so the KV
    traffic per step is batch × S tokens while the weights are read once;
  - decode latency per token (median over --steps steps at fixed S: the cache
    is cropped back after each step), and its ratio to the base;
  - prefill time up to --max-prefill (attention is O(S²) there; longer
    contexts get a cache of random values, which decoding time does not depend on);
  - the bytes a decoding step must read (all weights + the KV cache at S),
    whose base/MLA ratio is the speed-up limit for memory-bound decoding.
It prints a table, writes JSON and a PNG (latency against context, one line per path).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from ecomla.decode import AbsorbedDeepseekV3ForCausalLM, output_cache

SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, max_position_embeddings=131072)


def build(layers: int, dtype: torch.dtype, device: str):
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=layers, num_key_value_heads=8, head_dim=64,
                                        tie_word_embeddings=True))
    mla_cfg = DeepseekV3Config(**SHAPE, num_hidden_layers=layers, num_key_value_heads=32, kv_lora_rank=64,
                               q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
                               first_k_dense_replace=layers, n_routed_experts=1, n_group=1, topk_group=1,
                               num_experts_per_tok=1, num_nextn_predict_layers=0, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    stock = DeepseekV3ForCausalLM(mla_cfg)
    absorbed = AbsorbedDeepseekV3ForCausalLM(mla_cfg)
    absorbed.load_state_dict(stock.state_dict())
    models = {"base (GQA)": base, "stock MLA": stock, "absorbed MLA": absorbed}
    for m in models.values():
        m.to(device=device, dtype=dtype).eval()
    return models


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def random_cache(model, B: int, S: int, dtype, device) -> DynamicCache:
    """A cache of B × S tokens shaped as the model's own attention writes it."""
    cfg = model.config
    cache = DynamicCache(config=cfg)
    for i in range(cfg.num_hidden_layers):
        if cfg.model_type == "deepseek_v3":
            k = torch.randn(B, 1, S, cfg.kv_lora_rank, dtype=dtype, device=device)
            v = torch.randn(B, 1, S, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        else:
            k = torch.randn(B, cfg.num_key_value_heads, S, cfg.head_dim, dtype=dtype, device=device)
            v = torch.randn_like(k)
        cache.update(k, v, i)
    return cache


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def decode_latency(model, cache, B: int, S: int, steps: int, device: str) -> float:
    """Median seconds per decoding step (B sequences, one token each) at context S."""
    token = torch.full((B, 1), 7, device=device)
    pos = torch.full((B, 1), S, device=device)
    times = []
    for i in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=token, past_key_values=cache, position_ids=pos, use_cache=True)
        sync(device)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
        cache.crop(-1)  # back to S tokens
    return statistics.median(times)


@torch.no_grad()
def prefill(model, B: int, S: int, device: str) -> tuple[float, DynamicCache]:
    ids = torch.randint(0, SHAPE["vocab_size"], (B, S), device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t0, output_cache(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoded together (a serving batch)")
    ap.add_argument("--steps", type=int, default=5, help="timed decoding steps per context (after 2 warm-up)")
    ap.add_argument("--max-prefill", type=int, default=2048, help="longest context that is really prefilled")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=".cache/bench_decode/bench_decode.json")
    ap.add_argument("--vocab", type=int, default=SHAPE["vocab_size"],
                    help="vocabulary size (Llama-3's 128,256 by default; smaller for a quick smoke run)")
    args = ap.parse_args()
    SHAPE["vocab_size"] = args.vocab
    dtype = getattr(torch, args.dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    models = build(args.layers, dtype, args.device)
    names = list(models)
    rows = []
    for S in contexts:
        row = {"context": S}
        caches = {}
        if S <= args.max_prefill:
            row["prefill_s"] = {}
            for name in ("base (GQA)", "stock MLA"):  # absorbed prefill is the stock path
                row["prefill_s"][name], caches[name] = prefill(models[name], args.batch, S, args.device)
            caches["absorbed MLA"] = caches["stock MLA"]
        else:
            for name in ("base (GQA)", "stock MLA"):
                caches[name] = random_cache(models[name], args.batch, S, dtype, args.device)
            caches["absorbed MLA"] = caches["stock MLA"]
        row["kv_bytes_per_token"] = {n: cache_bytes(caches[n]) / (args.batch * caches[n].get_seq_length()) for n in names}
        row["step_bytes"] = {n: weight_bytes(models[n]) + cache_bytes(caches[n]) for n in names}
        row["decode_s"] = {n: decode_latency(models[n], caches[n], args.batch, S, args.steps, args.device) for n in names}
        base_t = row["decode_s"]["base (GQA)"]
        row["speedup_vs_base"] = {n: base_t / row["decode_s"][n] for n in names}
        row["bytes_ratio_base_over_mla"] = row["step_bytes"]["base (GQA)"] / row["step_bytes"]["stock MLA"]
        rows.append(row)
        print(f"S={S:>6}  " + "  ".join(f"{n}: {1e3 * row['decode_s'][n]:8.2f} ms" for n in names)
              + f"  absorbed/base speed-up {row['speedup_vs_base']['absorbed MLA']:.2f}x"
              + f"  bytes ratio {row['bytes_ratio_base_over_mla']:.2f}x", flush=True)
    crossover = next((r["context"] for r in rows if r["decode_s"]["absorbed MLA"] < r["decode_s"]["base (GQA)"]), None)
    result = {
        "machine": {"device": args.device, "cpus": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform(),
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "layers": args.layers, "batch": args.batch, "dtype": args.dtype, "shapes": SHAPE,
        "weight_bytes": {n: weight_bytes(models[n]) for n in names},
        "rows": rows, "absorbed_overtakes_base_at": crossover,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print_table(result)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def print_table(result: dict) -> None:
    print(f"\n{result['layers']} layers, batch {result['batch']}, {result['dtype']}, {result['machine']['device']}")
    print(f"{'context':>8} {'KV B/tok base':>13} {'KV B/tok MLA':>12} {'base ms':>8} {'stock ms':>9} {'absorbed ms':>11}"
          f" {'abs/base':>8} {'abs/stock':>9} {'bytes base/MLA':>14} {'prefill base s':>14} {'prefill MLA s':>13}")
    for r in result["rows"]:
        d, kv, p = r["decode_s"], r["kv_bytes_per_token"], r.get("prefill_s", {})
        print(f"{r['context']:>8} {kv['base (GQA)']:>13.0f} {kv['stock MLA']:>12.0f} {1e3 * d['base (GQA)']:>8.2f}"
              f" {1e3 * d['stock MLA']:>9.2f} {1e3 * d['absorbed MLA']:>11.2f}"
              f" {d['base (GQA)'] / d['absorbed MLA']:>7.2f}x {d['stock MLA'] / d['absorbed MLA']:>8.2f}x"
              f" {r['bytes_ratio_base_over_mla']:>13.2f}x {p.get('base (GQA)', float('nan')):>14.2f}"
              f" {p.get('stock MLA', float('nan')):>13.2f}")
    print(f"absorbed MLA decodes faster than the base from context {result['absorbed_overtakes_base_at']}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["context"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, marker in (("base (GQA)", "s"), ("stock MLA", "o"), ("absorbed MLA", "^")):
        ys = [1e3 * r["decode_s"][name] for r in result["rows"]]
        ax.plot(xs, ys, marker=marker, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode latency per token (ms)")
    ax.set_title(f"{result['layers']} layers, batch {result['batch']}, Llama-3.2-1B shapes, {result['dtype']}, "
                 f"{result['machine']['device']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
