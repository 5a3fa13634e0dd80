"""When does a tiny Llama learn to copy? Steps until it copies a list it has just read, per init scale and seed.

    python scripts/copy_onset.py                                  # 0.02 vs 0.06, seeds 0 1 2, up to 700 steps
    python scripts/copy_onset.py --inits 0.02 0.04 0.06 --seeds 0 --steps 400

Each training sequence is "List: w1 ... w24. Again: w1 ... w24." with the words
drawn at random from the tiny world's word pools, so the first half is
unpredictable and the second half is predictable only by copying. A model is
counted as copying at the first logged step where its loss on the second half
falls below 1 nat per token (it starts near ln(pool size) ~ 5). The model is
the zoo base's shape, read from `--recipe` (`recipes/pretrain/tiny_base.yaml`:
hidden 128, 4 layers, 4 heads of 64, 2 KV heads, tied embeddings), with each
`initializer_range` tried in turn; AdamW at lr 3e-3, batch 16 x 2 x 24 words.
This is why the zoo recipes set `initializer_range: 0.06`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import yaml


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inits", type=float, nargs="+", default=[0.02, 0.06], help="initializer_range values")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=700, help="Give up after this many steps")
    ap.add_argument("--tokenizer", default="zoo/base", help="The tiny world tokenizer (default: the committed base's)")
    ap.add_argument("--recipe", default="recipes/pretrain/tiny_base.yaml", help="Its student_config is the shape")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from ecomla.distill.models import build_from_config
    from ecomla.tinyworld.world import COLORS, GOODS, NAMES, OBJECTS, ROOMS

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    shape = yaml.safe_load(Path(args.recipe).read_text())["student_config"]
    words = list(NAMES + OBJECTS + GOODS + ROOMS + COLORS)
    torch.set_num_threads(2)
    results = []
    for init in args.inits:
        for seed in args.seeds:
            torch.manual_seed(seed)
            rng = random.Random(seed)
            model = build_from_config({**shape, "vocab_size": len(tok), "initializer_range": init}, torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
            onset, t0, second = None, time.time(), float("nan")
            for step in range(1, args.steps + 1):
                batch, halves = [], []
                for _ in range(16):
                    listed = " ".join(rng.choices(words, k=24))
                    head = tok("List: " + listed + ". Again:")["input_ids"]
                    batch.append(head + tok(" " + listed + ".")["input_ids"])
                    halves.append(len(head))
                width = max(map(len, batch))
                ids = torch.full((16, width), tok.pad_token_id)
                labels = torch.full((16, width), -100)
                for i, seq in enumerate(batch):
                    ids[i, : len(seq)] = torch.tensor(seq)
                    labels[i, : len(seq)] = torch.tensor(seq)
                out = model(ids, labels=labels)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                if step % 25 == 0:
                    with torch.no_grad():
                        logp = torch.log_softmax(out.logits.float(), -1)
                    nll = [-logp[i, torch.arange(h - 1, len(s) - 1), torch.tensor(s[h:])].mean().item()
                           for i, (s, h) in enumerate(zip(batch, halves))]  # fmt: skip
                    second = sum(nll) / len(nll)
                    if second < 1.0:
                        onset = step
                        break
            row = {"initializer_range": init, "seed": seed, "copies_at_step": onset, "max_steps": args.steps,
                   "second_half_nll": round(second, 3), "seconds": round(time.time() - t0, 1)}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
