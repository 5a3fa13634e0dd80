"""How compressible a model's keys and values are: the weight spectrum of its stacked K/V projections.

    python scripts/kv_spectrum.py zoo/base:32 models/smollm2-135m-instruct:28   # both at 6.4x (seconds)

For MODEL:R_KV, per layer, the singular values of [W_k; W_v]·diag(γ) (γ the attention input's RMSNorm gain,
which a conversion folds in): the share of their energy that the top R_KV directions keep, and the rank that
keeps 90% of it as a share of the full rank; printed as the mean (and minimum) over layers.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM


def spectrum(path: str, r_kv: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    kept, rank90 = [], []
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            w = torch.cat([attn.k_proj.weight, attn.v_proj.weight]) * layer.input_layernorm.weight  # (2·n_kv·d_h, d)
            energy = torch.linalg.svdvals(w.double()).square()
            share = energy.cumsum(0) / energy.sum()
            kept.append(float(share[r_kv - 1]))
            rank90.append(float((share < 0.9).sum() + 1) / len(energy))
    cfg = model.config
    return {"hidden": cfg.hidden_size, "kv_rows": 2 * cfg.num_key_value_heads * (cfg.head_dim or
                                                                                 cfg.hidden_size // cfg.num_attention_heads),
            "energy_kept_mean": sum(kept) / len(kept), "energy_kept_min": min(kept),
            "rank90_share": sum(rank90) / len(rank90)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", metavar="MODEL:R_KV", help="checkpoint directory and latent width")
    args = p.parse_args(argv)
    for item in args.models:
        path, _, r = item.rpartition(":")
        if not path or not r.isdigit():
            p.error(f"{item}: expected MODEL:R_KV, e.g. zoo/base:32")
        s = spectrum(path, int(r))
        print(f"{path}: hidden {s['hidden']}, {s['kv_rows']} K/V rows; the top {r} directions keep "
              f"{s['energy_kept_mean']:.1%} of the K/V energy (min over layers {s['energy_kept_min']:.1%}); "
              f"90% needs {s['rank90_share']:.0%} of the full rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
