"""Conversions of tiny sources with several recipes, as hashes: is a refactor behaviour-preserving?

    python scripts/snapshot_conversions.py snap --out /tmp/snap/out --json /tmp/snap/after.json
    python scripts/snapshot_conversions.py compare /tmp/snap/before.json /tmp/snap/after.json

`snap` builds two tiny random sources (a GQA Llama and a Qwen2 with biases; seeded, so every checkout builds the
same bytes) and converts them with recipes that cover every target and the MLA options with their own code paths
(SVD, activation with `norm` pairs and `rorope_act`, energy ranks with `rope_residual: latent`, a query latent
with biases, random init in bf16, MQA, LRKV). It records the sha256 of every file each conversion writes and the
conversion report (its `seconds` left out). Run it at two checkouts with the same --out, then `compare`: every
file must be byte-identical and every report field equal (fields one side adds are listed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path.cwd()  # the checkout whose code runs: this directory, not the script's
sys.path.insert(0, str(ROOT))

CASES = {
    "xecomla": ("llama", {"mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8}}),
    "act_norm_rorope_act": ("llama", {"mla": {"kv_lora_rank": 12, "qk_rope_head_dim": 8, "rope_dims": "norm",
                                              "rope_key": "rorope_act"}, "init": {"method": "activation"}}),
    "energy_latent": ("llama", {"mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "rank_allocation": "energy",
                                        "rope_key": "rorope", "rope_residual": "latent"}}),
    "qwen_q": ("qwen", {"mla": {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "q_lora_rank": 65},
                        "init": {"method": "activation"}}),
    "random_bf16": ("llama", {"mla": {"kv_lora_rank": 8}, "init": {"method": "random"}, "dtype": "bfloat16"}),
    "mqa": ("llama", {"target": "mqa"}),
    "lrkv": ("llama", {"target": "lrkv", "lrkv": {"rank": 4}}),
}


def converter():
    try:
        from ecomla.convert.stream import convert_recipe

        return lambda r: convert_recipe(r, force=True, progress=False)
    except ImportError:  # a checkout from before the one streaming conversion (Converter, convert_target)
        from ecomla.convert import targets
        from ecomla.convert.converter import Converter
        from ecomla.convert.plan import make_plan

        def run(r):
            if r.target != "mla":
                return targets.convert_target(r, force=True, progress=False)
            return Converter(make_plan(r, force=True), force=True, progress=False).run()

        return run


def snap(out: Path) -> dict:
    from ecomla.convert.recipe import ConvertRecipe
    from ecomla.recipe.schema import load_recipe
    from tests.tiny import make_source, make_tokenizer, write_corpus

    shared = out / "sources"
    if not (shared / "qwen").exists():
        make_tokenizer(shared / "tok")
        write_corpus(shared / "corpus")
        make_source(shared / "llama", shared / "tok", family="llama", num_key_value_heads=2)
        make_source(shared / "qwen", shared / "tok", family="qwen2", num_key_value_heads=2)
    calibration = {"dataset": str(shared / "corpus" / "a_fit.jsonl"), "num_tokens": 2048, "seq_len": 64,
                   "heldout_tokens": 512}
    run, result = converter(), {}
    for name, (src, sections) in CASES.items():
        target = out / name
        data = {"model": str(shared / src), "output_dir": str(target), "dtype": "float32", "device": "cpu"}
        data.update(json.loads(json.dumps(sections)))
        if data.get("init", {}).get("method") == "activation":
            data["init"]["calibration"] = calibration
        run(load_recipe(ConvertRecipe, data=data))
        files = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(target.iterdir())
                 if f.name != "conversion_report.json"}
        report = json.loads((target / "conversion_report.json").read_text())
        report.pop("seconds")
        result[name] = {"files": files, "report": report}
    return result


def compare(before: dict, after: dict) -> bool:
    same = True
    for name in before:
        fb, fa = before[name]["files"], after[name]["files"]
        rb, ra = before[name]["report"], dict(after[name]["report"])
        added = {k: ra.pop(k) for k in list(ra) if k not in rb}
        differing = [k for k in rb if rb[k] != ra.get(k)]
        ok = fb == fa and not differing
        same &= ok
        print(f"{name:22s} {'identical' if fb == fa else 'FILES DIFFER'} ({len(fb)} files); report fields differing: "
              f"{differing or 'none'}; added: {added or 'none'}")
    return same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snap", help="convert every case and write the hashes")
    s.add_argument("--out", type=Path, required=True, help="work directory (sources and conversions)")
    s.add_argument("--json", type=Path, required=True, help="where the snapshot goes")
    c = sub.add_parser("compare", help="compare two snapshots")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args()
    if args.cmd == "snap":
        args.json.write_text(json.dumps(snap(args.out), indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
        return 0
    return 0 if compare(json.loads(args.before.read_text()), json.loads(args.after.read_text())) else 1


if __name__ == "__main__":
    sys.exit(main())
