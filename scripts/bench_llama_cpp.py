"""The source Llama and its MLA conversions served by llama.cpp on CPU, measured side by side in one run.

    python scripts/bench_llama_cpp.py --model source=models/smollm2-135m-instruct \\
        --model 2x=runs/xecomla_smollm2/stages/distill-2x-.../run/final --model 4x=... \\
        --out runs/bench_llama_cpp [--contexts 1024 4096 8192 16384] [--reps 5] [--threads 2]

Per model (the first is the reference for the ratios):
  export      `ecomla export gguf` twice: f32 (for the perplexity comparisons) and f16 (for serving speed);
  perplexity  token perplexity on held-out prose (`pytext:heldout:prose`, blocks of --seq-len, every token after
              the first scored) in llama.cpp (f32 GGUF, f16 cache) and in transformers (fp32) on the same tokens;
  kv bytes    what llama.cpp's cache holds per token (its saved sequence state at two lengths), against the
              formula: 2 * n_kv * d_h per layer for a Llama, r_kv + d_r for MLA, times 2 bytes for f16 cells;
  decode      tokens/s of --steps one-token steps after each context (f16 GGUF, f16 cache), with flash attention
              off and on, --reps repetitions each (median, min, max), and the median's ratio to the first model's;
              the crossover is the shortest context where a model decodes at least as fast as the first;
  cache       the quantized latent: q8_0 and q4_0 cells against f16 (flash attention on, which llama.cpp needs to
              quantize a cache): bytes per token, perplexity (f32 GGUF) and decode tokens/s at --cache-context;
  chat        the greedy answer to one chat prompt, in llama.cpp.
Writes bench.json and decode.png (tokens/s against context) and prints the tables. Run nothing else
meanwhile: the decode rates are ratios of wall times.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

PROMPT = "What is the capital of France?"
ATTENTION = {"fa_off": False, "fa_on": True}
QUANTIZED = ("f16", "q8_0", "q4_0")


def _blocks(tok, n: int, seq_len: int) -> list[list[int]]:
    """`n` blocks of `seq_len` held-out prose tokens (documents joined by EOS), as lists."""
    from ecomla.data.text import iter_texts, token_blocks

    return token_blocks(iter_texts("pytext:heldout:prose"), tok, seq_len, n).tolist()


def _hf_nll(path: Path, blocks: list[list[int]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for b in blocks:
            ids = torch.tensor([b])
            logp = model(ids).logits[0, :-1].log_softmax(-1)
            total -= float(logp.gather(1, ids[0, 1:, None]).sum())
            n += len(b) - 1
    return total / n


def _ppl(llm, blocks: list[list[int]]) -> float:
    from ecomla.export import engine

    nll = [engine.mean_nll(llm, b) for b in blocks]
    return math.exp(sum(x * n for x, n in nll) / sum(n for _, n in nll))


def _spread(runs: list[float]) -> dict:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": runs}


def _chat(llm, tok) -> str:
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=False)
    out = llm.create_completion(prompt, max_tokens=24, temperature=0.0)
    return out["choices"][0]["text"].strip()


def _cache_rows(f32: Path, f16: Path, cached_row: int, blocks, context, args) -> dict:
    """Each cache type's bytes per token, perplexity and decode rate (flash attention on), or why it fails.

    `cached_row` is the numbers one cached key row holds (d_h for a Llama, r_kv + d_r for MLA).
    """
    from ecomla.export import engine

    rows = {}
    for cache in QUANTIZED:
        try:
            llm = engine.load(f32, n_ctx=args.seq_len, threads=args.threads, cache=cache, flash_attn=True)
        except ValueError as err:  # llama.cpp refuses e.g. a q8_0 row that is not a whole number of blocks
            rows[cache] = {"loads": False, "error": f"{err} (llama.cpp stores {cache} in blocks of 32 numbers; "
                                                    f"a cached row here holds {cached_row})"}
            continue
        row = {"loads": True, "ppl": _ppl(llm, blocks)}
        del llm
        llm = engine.load(f16, n_ctx=args.cache_context + args.steps + 8, threads=args.threads, logits_all=False,
                          cache=cache, flash_attn=True)
        row["kv_bytes_per_token"] = engine.kv_bytes_per_token(llm, context, 256, 512)
        rates = engine.decode_rates(llm, context, [args.cache_context], args.steps, args.reps)
        row["decode_tok_s"] = _spread(rates[args.cache_context])
        del llm
        rows[cache] = row
    if rows["f16"]["loads"]:
        for row in rows.values():
            if row["loads"]:
                row["ppl_vs_f16"] = row["ppl"] / rows["f16"]["ppl"] - 1
                row["bytes_vs_f16"] = row["kv_bytes_per_token"] / rows["f16"]["kv_bytes_per_token"]
    return rows


def _measure(name: str, path: Path, out: Path, tok, blocks, context, args) -> dict:
    from ecomla.export import engine
    from ecomla.export.gguf import export_gguf
    from ecomla.mla.budget import MLA_TYPES, AttentionShape, kv_elements_per_token, mla_elements

    config = json.loads((path / "config.json").read_text())
    t0 = time.perf_counter()
    f32 = export_gguf(path, out / f"{name}.f32.gguf", outtype="f32", force=True, quiet=True)
    f16 = export_gguf(path, out / f"{name}.f16.gguf", outtype="f16", force=True, quiet=True)
    row = {"path": str(path), "export_s": round(time.perf_counter() - t0, 1)}
    row["ppl_llama_cpp"] = _ppl(engine.load(f32, n_ctx=args.seq_len, threads=args.threads), blocks)
    row["ppl_transformers"] = math.exp(_hf_nll(path, blocks))
    row["ppl_rel_diff"] = row["ppl_llama_cpp"] / row["ppl_transformers"] - 1
    row["kv_bytes_formula_f16"] = kv_elements_per_token(config) * 2  # the converter's formula, f16 cells
    row["decode_tok_s"] = {}
    for key, flash in ATTENTION.items():
        t0 = time.perf_counter()
        llm = engine.load(f16, n_ctx=max(args.contexts) + args.steps + 8, threads=args.threads, logits_all=False,
                          flash_attn=flash)
        if key == "fa_off":
            row["kv_bytes_per_token"] = engine.kv_bytes_per_token(llm, context, 256, 512)
            row["chat"] = _chat(llm, tok)
        rates = engine.decode_rates(llm, context, args.contexts, args.steps, args.reps)
        row["decode_tok_s"][key] = {str(c): _spread(r) for c, r in rates.items()}
        del llm
        print(f"  {name} {key}: {time.perf_counter() - t0:.0f} s", flush=True)
    cached_row = (mla_elements(config["kv_lora_rank"], config["qk_rope_head_dim"])
                  if config.get("model_type") in MLA_TYPES else AttentionShape.from_config(config).head_dim)
    row["cache"] = _cache_rows(f32, f16, cached_row, blocks, context, args)
    return row


def _compare(rows: dict) -> None:
    """Each model's median decode rate against the first's, and its crossover context (None: none measured)."""
    first = next(iter(rows))
    ref = rows[first]
    for name, row in rows.items():
        row["decode_vs_first"], row["crossover"] = {}, {}
        for key, per_ctx in row["decode_tok_s"].items():
            ratio = {c: v["median"] / ref["decode_tok_s"][key][c]["median"] for c, v in per_ctx.items()}
            row["decode_vs_first"][key] = ratio
            if name != first:
                row["crossover"][key] = next((int(c) for c, r in ratio.items() if r >= 1), None)


def _chart(rows: dict, path: Path, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, row) in enumerate(rows.items()):
        for key, style in (("fa_off", "--"), ("fa_on", "-")):
            per_ctx = row["decode_tok_s"][key]
            xs = [int(c) for c in per_ctx]
            med = [v["median"] for v in per_ctx.values()]
            err = [[m - v["min"] for m, v in zip(med, per_ctx.values())],
                   [v["max"] - m for m, v in zip(med, per_ctx.values())]]
            ax.errorbar(xs, med, yerr=err, fmt=style, marker="o", color=f"C{i}", capsize=3,
                        label=f"{name}, flash attention {'on' if key == 'fa_on' else 'off'}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.set_title(f"llama.cpp decode on CPU ({threads} threads)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print(rows: dict, contexts: list[str], cache_context: int) -> None:
    print(f"{'model':8s} {'ppl llama.cpp':>13s} {'ppl HF':>9s} {'diff':>7s} {'KV B/tok':>9s} {'formula':>8s}")
    for name, r in rows.items():
        print(f"{name:8s} {r['ppl_llama_cpp']:13.3f} {r['ppl_transformers']:9.3f} {r['ppl_rel_diff']:+7.2%} "
              f"{r['kv_bytes_per_token']:9.0f} {r['kv_bytes_formula_f16']:8d}")
    print("\ndecode tokens/s, median (min-max), and the median's ratio to the first model's")
    print(f"{'model':8s} {'flash':6s} " + " ".join(f"{'@' + c:>24s}" for c in contexts) + "  crossover")
    for name, r in rows.items():
        for key in ATTENTION:
            cells = [f"{v['median']:6.2f} ({v['min']:.2f}-{v['max']:.2f}) {r['decode_vs_first'][key][c]:4.2f}x"
                     for c, v in r["decode_tok_s"][key].items()]
            print(f"{name:8s} {key[3:]:6s} " + " ".join(f"{x:>24s}" for x in cells)
                  + f"  {r['crossover'].get(key, 'reference') or 'none'}")
    print(f"\nKV cache cells (flash attention on): bytes/token, perplexity, decode tokens/s @{cache_context}")
    for name, r in rows.items():
        for cache, c in r["cache"].items():
            if not c["loads"]:
                print(f"{name:8s} {cache:5s} does not load: {c['error']}")
                continue
            print(f"{name:8s} {cache:5s} {c['kv_bytes_per_token']:8.0f} B ({c.get('bytes_vs_f16', 1):.3f}x)  "
                  f"ppl {c['ppl']:9.3f} ({c.get('ppl_vs_f16', 0):+.2%})  {c['decode_tok_s']['median']:6.2f} tok/s")
    for name, r in rows.items():
        print(f"{name} chat: {r['chat']!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a checkpoint to measure (repeatable; the first is the reference)")
    p.add_argument("--out", required=True, help="directory for the GGUFs, bench.json and decode.png")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384],
                   help="decode contexts (tokens)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per repetition")
    p.add_argument("--reps", type=int, default=5, help="repetitions per context (median, min, max)")
    p.add_argument("--cache-context", type=int, default=4096, help="context of the quantized-cache decode rates")
    p.add_argument("--blocks", type=int, default=4, help="held-out blocks for the perplexity comparisons")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.reps < 1 or args.steps < 1:
        p.error("--reps and --steps must be >= 1")

    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = dict(m.split("=", 1) for m in args.model)
    tok = AutoTokenizer.from_pretrained(next(iter(models.values())))
    blocks = _blocks(tok, args.blocks, args.seq_len)
    longest = max(*args.contexts, args.cache_context, 512)
    context = [t for b in _blocks(tok, math.ceil(longest / args.seq_len) + 1, args.seq_len) for t in b]
    t0, rows = time.perf_counter(), {}
    for name, path in models.items():
        rows[name] = _measure(name, Path(path), out, tok, blocks, context, args)
        print(f"{name}: done after {time.perf_counter() - t0:.0f} s", flush=True)
    _compare(rows)
    settings = {**vars(args), "wall_s": round(time.perf_counter() - t0)}
    (out / "bench.json").write_text(json.dumps({"settings": settings, "models": rows}, indent=2) + "\n")
    _chart(rows, out / "decode.png", args.threads)
    _print(rows, [str(c) for c in sorted(args.contexts)], args.cache_context)


if __name__ == "__main__":
    main()
