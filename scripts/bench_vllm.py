"""Does vLLM serve an ecomla checkpoint correctly? One prepared check, for a machine with a GPU and vLLM.

    pip install vllm            # on the GPU machine; not part of ecomla's set-up
    python scripts/bench_vllm.py --model runs/xecomla_smollm2/stages/distill-4x-.../run/final \\
        [--source models/smollm2-135m-instruct] [--out runs/bench_vllm]

Not run here: no GPU has been lent to this work. Per model (the converted one, and the source for comparison):
  perplexity  token perplexity on held-out prose (`pytext:heldout:prose`, blocks of --seq-len, every token after
              the first scored) from vLLM's prompt log-probs, against transformers' on the same tokens (same
              device and dtype);
  greedy      the first --new-tokens greedy tokens of a chat prompt from vLLM and from transformers, and how many
              agree before the first difference (garbage output is what users of other MLA tools reported);
  backend     the attention backend vLLM chose (its log says it; MLA shapes outside FlashMLA's kv_lora_rank 512
              + qk_rope_head_dim 64 fall back to TRITON_MLA).
Writes check.json. A relative perplexity difference above --tolerance (default 2%) fails the check (exit 1).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

PROMPT = "What is the capital of France?"


def _blocks(tok, n: int, seq_len: int) -> list[list[int]]:
    """`n` blocks of `seq_len` held-out prose tokens (documents joined by EOS), as lists."""
    from ecomla.data.text import iter_texts, token_blocks

    return token_blocks(iter_texts("pytext:heldout:prose"), tok, seq_len, n).tolist()


def _hf(path: str, blocks, prompt_ids, new_tokens: int, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    nll, n = 0.0, 0
    with torch.no_grad():
        for b in blocks:
            ids = torch.tensor([b], device="cuda")
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
            nll -= float(logp.gather(1, ids[0, 1:, None]).sum())
            n += len(b) - 1
        out = model.generate(torch.tensor([prompt_ids], device="cuda"), max_new_tokens=new_tokens, do_sample=False)
    return math.exp(nll / n), out[0, len(prompt_ids):].tolist()


def _vllm(path: str, blocks, prompt_ids, new_tokens: int, dtype: str, seq_len: int):
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, dtype=dtype, max_model_len=max(seq_len, len(prompt_ids) + new_tokens) + 8,
              gpu_memory_utilization=0.5, enforce_eager=True)
    scored = llm.generate([{"prompt_token_ids": b} for b in blocks],
                          SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll, n = 0.0, 0
    for b, out in zip(blocks, scored):
        for tok, lp in zip(b[1:], out.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            n += 1
    greedy = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=new_tokens, temperature=0.0))
    del llm
    return math.exp(nll / n), list(greedy[0].outputs[0].token_ids)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an ecomla checkpoint (stock DeepSeek-V3)")
    p.add_argument("--source", default=None, help="its source Llama, checked the same way for comparison")
    p.add_argument("--out", default="runs/bench_vllm")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tolerance", type=float, default=0.02)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    blocks = _blocks(tok, args.blocks, args.seq_len)
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    rows, ok = {}, True
    for name, path in (("model", args.model), ("source", args.source)):
        if path is None:
            continue
        hf_ppl, hf_tokens = _hf(path, blocks, prompt_ids, args.new_tokens, getattr(torch, args.dtype))
        v_ppl, v_tokens = _vllm(path, blocks, prompt_ids, args.new_tokens, args.dtype, args.seq_len)
        agree = next((i for i, (a, b) in enumerate(zip(hf_tokens, v_tokens)) if a != b), len(hf_tokens))
        rows[name] = {"path": path, "ppl_transformers": hf_ppl, "ppl_vllm": v_ppl, "ppl_rel_diff": v_ppl / hf_ppl - 1,
                      "greedy_tokens_agreeing": agree, "vllm_text": tok.decode(v_tokens),
                      "transformers_text": tok.decode(hf_tokens)}
        ok &= abs(rows[name]["ppl_rel_diff"]) <= args.tolerance
        print(f"{name}: ppl vLLM {v_ppl:.3f} / transformers {hf_ppl:.3f} ({rows[name]['ppl_rel_diff']:+.2%}); "
              f"greedy tokens agreeing {agree}/{len(hf_tokens)}; vLLM says {rows[name]['vllm_text']!r}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check.json").write_text(json.dumps({"settings": vars(args), "models": rows, "ok": ok}, indent=2) + "\n")
    print("PASS" if ok else f"FAIL: a perplexity differs by more than {args.tolerance:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
