"""The source Llama and its MLA conversions served by llama.cpp on CPU, measured side by side in one run.

    python scripts/bench_llama_cpp.py --model source=models/smollm2-135m-instruct \\
        --model 2x=runs/xecomla_smollm2/stages/distill-2x-.../run/final --model 4x=... \\
        --out runs/bench_llama_cpp [--contexts 1024 8192] [--threads 2]

Per model (the first is the reference for the ratios):
  export      `ecomla export gguf` twice: f32 (for the perplexity comparison) and f16 (for serving speed);
  perplexity  token perplexity on held-out prose (`pytext:heldout:prose`, blocks of --seq-len, every token after
              the first scored) in llama.cpp (f32 GGUF) and in transformers (fp32) on the same tokens;
  kv bytes    what llama.cpp's cache holds per token (its saved sequence state at two lengths, f16 cells),
              against the formula: 2 * n_kv * d_h per layer for a Llama, r_kv + d_r for MLA, times 2 bytes;
  decode      tokens/s of one-token steps after a context of each length (f16 GGUF), and the ratio to the first
              model, all in this one run;
  chat        the greedy answer to one chat prompt, in llama.cpp.
Writes bench.json and prints a table. Run nothing else meanwhile: the decode rates are ratios of wall times.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

PROMPT = "What is the capital of France?"


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


def _chat(llm, tok) -> str:
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=False)
    out = llm.create_completion(prompt, max_tokens=24, temperature=0.0)
    return out["choices"][0]["text"].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                   help="a checkpoint to measure (repeatable; the first is the reference)")
    p.add_argument("--out", required=True, help="directory for the GGUFs and bench.json")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192], help="decode contexts (tokens)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    p.add_argument("--blocks", type=int, default=4, help="held-out blocks for the perplexity comparison")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from transformers import AutoTokenizer

    from ecomla.mla.budget import kv_elements_per_token
    from ecomla.export import engine
    from ecomla.export.gguf import export_gguf

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = dict(m.split("=", 1) for m in args.model)
    first = next(iter(models.values()))
    tok = AutoTokenizer.from_pretrained(first)
    blocks = _blocks(tok, args.blocks, args.seq_len)
    context = [t for b in _blocks(tok, math.ceil(max(args.contexts) / args.seq_len) + 1, args.seq_len) for t in b]
    rows = {}
    for name, path in models.items():
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        t0 = time.perf_counter()
        f32 = export_gguf(path, out / f"{name}.f32.gguf", outtype="f32", force=True, quiet=True)
        f16 = export_gguf(path, out / f"{name}.f16.gguf", outtype="f16", force=True, quiet=True)
        row = {"path": str(path), "export_s": round(time.perf_counter() - t0, 1)}
        llm = engine.load(f32, n_ctx=args.seq_len, threads=args.threads)
        nll = [engine.mean_nll(llm, b) for b in blocks]
        row["ppl_llama_cpp"] = math.exp(sum(x * n for x, n in nll) / sum(n for _, n in nll))
        row["ppl_transformers"] = math.exp(_hf_nll(path, blocks))
        row["ppl_rel_diff"] = row["ppl_llama_cpp"] / row["ppl_transformers"] - 1
        del llm
        llm = engine.load(f16, n_ctx=max(args.contexts) + args.steps + 8, threads=args.threads, logits_all=False)
        row["kv_bytes_per_token"] = engine.kv_bytes_per_token(llm, context, 256, 512)
        row["kv_bytes_formula_f16"] = kv_elements_per_token(config) * 2  # the converter's formula, f16 cells
        row["decode_tok_s"] = {str(c): engine.decode_rate(llm, context[:c], args.steps) for c in args.contexts}
        row["chat"] = _chat(llm, tok)
        del llm
        rows[name] = row
        print(f"{name}: done ({json.dumps({k: v for k, v in row.items() if k != 'path'})})", flush=True)
    ref = rows[next(iter(rows))]
    for row in rows.values():
        row["decode_vs_first"] = {c: row["decode_tok_s"][c] / ref["decode_tok_s"][c] for c in ref["decode_tok_s"]}
    (out / "bench.json").write_text(json.dumps({"settings": vars(args), "models": rows}, indent=2) + "\n")
    ctx = [str(c) for c in args.contexts]
    print(f"{'model':10s} {'ppl llama.cpp':>13s} {'ppl HF':>9s} {'diff':>7s} {'KV B/tok':>9s} {'formula':>8s} "
          + " ".join(f"{'tok/s@' + c:>11s} {'ratio':>6s}" for c in ctx))
    for name, r in rows.items():
        print(f"{name:10s} {r['ppl_llama_cpp']:13.3f} {r['ppl_transformers']:9.3f} {r['ppl_rel_diff']:+7.2%} "
              f"{r['kv_bytes_per_token']:9.0f} {r['kv_bytes_formula_f16']:8d} "
              + " ".join(f"{r['decode_tok_s'][c]:11.2f} {r['decode_vs_first'][c]:5.2f}x" for c in ctx))
    for name, r in rows.items():
        print(f"{name} chat: {r['chat']!r}")


if __name__ == "__main__":
    main()
