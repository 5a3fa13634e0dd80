"""Measure `mla.rope_residual` (drop / latent / latent_mean) on a trained GQA checkpoint, without training.

    python scripts/measure_rope_key.py --model PATH/TO/LLAMA --out rope_key.json
    python scripts/measure_rope_key.py --model PATH --ranks 64 --rope-dims 8 --rope-dims-strategy high   # one cell

For every r_kv, d_r, RoPE-dim strategy and RoRoPE key (rorope, rorope_act) it converts the
checkpoint once per residual choice, side by side in one run, with the tiny world's calibration
text (`tinyworld:calibration`) and held-out text (`tinyworld:heldout`) unless --calibration /
--heldout name other dataset specs. It prints a table of held-out perplexity (the source's, and
each choice's as a ratio to drop's) and writes JSON with every conversion report's held-out
metrics, per-layer key/value errors, and the share of the key energy the fixed and the `energy`
RoPE allocations keep rotated (with whether stock DeepSeek-V3 RoPE can express the latter).
Each conversion takes ~10 s for a 4-layer, 256-wide model on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ecomla.convert.recipe import ConvertRecipe
from ecomla.convert.stream import convert_recipe
from ecomla.mla.rope_key import inexpressible_reason
from ecomla.recipe.schema import load_recipe

RESIDUALS = ("drop", "latent", "latent_mean")


def convert_once(args, out: Path, rank: int, d_r: int, dims: str, key: str, residual: str) -> dict:
    """One conversion; returns its report (the checkpoint is deleted)."""
    data = {
        "model": args.model, "output_dir": str(out), "dtype": "float32", "device": "cpu",
        "mla": {"kv_lora_rank": rank, "qk_rope_head_dim": d_r, "rope_dims": dims, "rope_key": key,
                "rope_residual": residual},
        "init": {"calibration": {"dataset": args.calibration, "heldout": {"dataset": args.heldout},
                                 "num_tokens": args.calibration_tokens, "heldout_tokens": args.heldout_tokens,
                                 "seq_len": args.seq_len}},
    }
    recipe = load_recipe(ConvertRecipe, data=data)
    report = convert_recipe(recipe, force=True, progress=False)
    shutil.rmtree(out, ignore_errors=True)
    return report


def allocation_summary(report: dict, d_h: int, d_r: int, theta: float) -> dict:
    """Mean shares of key energy kept rotated by the fixed and the energy allocation, and whether stock RoPE has it."""
    layers = [e["rope_allocation"] for e in report["layers"]]
    slots = []
    for e in layers:
        c = torch.zeros(d_h // 2, dtype=torch.long)
        for j, n in e["energy_slots"].items():
            c[int(j)] = n
        slots.append(c)
    reason = inexpressible_reason(slots, d_h, d_r, theta, allow_linear=True)
    return {
        "fixed_energy_kept": [e["fixed_energy_kept"] for e in layers],
        "energy_energy_kept": [e["energy_energy_kept"] for e in layers],
        "energy_slots": [e["energy_slots"] for e in layers],
        "energy_expressible": reason is None,
        "energy_inexpressible_reason": reason,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Trained Llama-family GQA checkpoint directory (with tokenizer)")
    p.add_argument("--out", default="rope_key.json", help="JSON written here")
    p.add_argument("--ranks", type=int, nargs="+", default=[32, 64, 128, 256], help="r_kv values")
    p.add_argument("--rope-dims", type=int, nargs="+", default=[8, 16], help="d_r values (qk_rope_head_dim)")
    p.add_argument("--rope-dims-strategy", nargs="+", default=["last", "high"], help="mla.rope_dims values")
    p.add_argument("--keys", nargs="+", default=["rorope", "rorope_act"], help="mla.rope_key values")
    p.add_argument("--calibration", default="tinyworld:calibration", help="Calibration dataset spec")
    p.add_argument("--heldout", default="tinyworld:heldout", help="Held-out dataset spec")
    p.add_argument("--calibration-tokens", type=int, default=32768, help="init.calibration.num_tokens")
    p.add_argument("--heldout-tokens", type=int, default=16384, help="init.calibration.heldout_tokens")
    p.add_argument("--seq-len", type=int, default=256, help="init.calibration.seq_len")
    args = p.parse_args()

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    d_h = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rows, t0 = [], time.time()
    work = Path(tempfile.mkdtemp(prefix="measure_rope_key-"))
    head = (f"{'rope_dims':>9} {'d_r':>3} {'r_kv':>4} {'rope_key':>10} {'ppl src':>8} {'drop':>8} "
            f"{'latent':>8} {'lat_mean':>8} {'latent/drop':>11} {'mean/drop':>9} {'E fixed':>7} {'E energy':>8}")
    print(head, flush=True)
    try:
        for dims in args.rope_dims_strategy:
            for d_r in args.rope_dims:
                for rank in args.ranks:
                    for key in args.keys:
                        reps = {res: convert_once(args, work / "out", rank, d_r, dims, key, res) for res in RESIDUALS}
                        ppl = {res: r["heldout"]["converted_perplexity"] for res, r in reps.items()}
                        alloc = allocation_summary(reps["drop"], d_h, d_r, theta)
                        row = {
                            "rope_dims": dims, "qk_rope_head_dim": d_r, "kv_lora_rank": rank, "rope_key": key,
                            "source_perplexity": reps["drop"]["heldout"]["source_perplexity"],
                            "perplexity": ppl,
                            "kl_source_to_converted": {res: r["heldout"]["kl_source_to_converted"] for res, r in reps.items()},
                            "top1_agreement": {res: r["heldout"]["top1_agreement"] for res, r in reps.items()},
                            "heldout_key_rel_error": {res: [e["heldout_key_rel_error"] for e in r["layers"]] for res, r in reps.items()},
                            "heldout_value_rel_error": {res: [e["heldout_value_rel_error"] for e in r["layers"]] for res, r in reps.items()},
                            "rope_key_energy_kept": [e["rope_key_energy_kept"] for e in reps["drop"]["layers"]],
                            "rope_residual_context": reps["latent_mean"]["rope"]["rope_residual_context"],
                            "rope_exact": reps["drop"]["rope"]["exact"],
                            "allocation": alloc,
                        }
                        rows.append(row)
                        print(f"{dims:>9} {d_r:>3} {rank:>4} {key:>10} {row['source_perplexity']:>8.3f} "
                              f"{ppl['drop']:>8.3f} {ppl['latent']:>8.3f} {ppl['latent_mean']:>8.3f} "
                              f"{ppl['latent'] / ppl['drop']:>11.3f} {ppl['latent_mean'] / ppl['drop']:>9.3f} "
                              f"{statistics.mean(alloc['fixed_energy_kept']):>7.3f} {statistics.mean(alloc['energy_energy_kept']):>8.3f}",
                              flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wins = {res: sum(min(r["perplexity"], key=r["perplexity"].get) == res for r in rows) for res in RESIDUALS}
    geo_mean = {res: float(torch.tensor([r["perplexity"][res] / r["perplexity"]["drop"] for r in rows]).log().mean().exp())
                for res in RESIDUALS}
    print(f"lowest perplexity in {len(rows)} cells: " + ", ".join(f"{k} {v}" for k, v in wins.items()))
    print("geometric-mean perplexity ratio to drop: " + ", ".join(f"{k} {v:.3f}" for k, v in geo_mean.items()))
    result = {
        "model": args.model, "calibration": args.calibration, "heldout": args.heldout,
        "calibration_tokens": args.calibration_tokens, "heldout_tokens": args.heldout_tokens, "seq_len": args.seq_len,
        "torch": torch.__version__, "platform": platform.platform(), "seconds": time.time() - t0,
        "wins": wins, "geometric_mean_ratio_to_drop": geo_mean, "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
