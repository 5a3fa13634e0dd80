"""Human-readable summary of a `conversion_report.json`, printed at the end of `ecomla convert` (every target)."""

from __future__ import annotations

from ecomla.convert.layout import LINEAR_LATENT_LORA, report_says_linear
from ecomla.mla import engines
from ecomla.mla.budget import format_ratio


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def summary_lines(report: dict) -> list[str]:
    return mla_lines(report) if report["target"] == "mla" else target_lines(report)


def mla_lines(report: dict) -> list[str]:
    kv = report["kv_elements_per_token_per_layer"]
    after = kv["after"]
    lines = [
        f"converted {report['source']} ({report['source_family']}) -> {report['output_dir']}",
        f"  init: {_preset(report.get('preset'))}{report['init_method']}   kv_lora_rank: {report['kv_lora_rank']}   "
        f"qk_rope_head_dim: {report['qk_rope_head_dim']}   q_lora_rank: {report['q_lora_rank']}",
        f"  KV per token and layer: {kv['before']} -> {min(after)}"
        + (f"..{max(after)}" if min(after) != max(after) else "")
        + f"   compression: {format_ratio(report['compression_ratio'])}",
    ]
    if abs(report["stock_cache_compression_ratio"] - report["compression_ratio"]) > 1e-9:
        lines.append(
            f"  note: per-layer ranks are zero-padded to one kv_lora_rank in stock DeepSeek-V3; "
            f"its cache compresses {format_ratio(report['stock_cache_compression_ratio'])}"
        )
    p = report["params"]
    lines.append(f"  params: {p['before'] / 1e6:.2f}M -> {p['after'] / 1e6:.2f}M")
    if "servable_by" in report:
        lines.append("  " + serving_line(report["servable_by"]))
    rope = report["rope"]
    lines.append(
        f"  RoPE: {rope['rope_dims']}, {rope['rope_parameters'].get('rope_type', 'default')} "
        f"theta={rope['rope_parameters']['rope_theta']:.6g}, "
        + ("original frequencies kept exactly" if rope["exact"] else "frequencies not the source's (fresh or fitted RoPE)")
    )
    if rope.get("rope_key") is not None:
        line = f"  RoPE key: {rope['rope_key']}, residual {rope['rope_residual']}"
        if rope.get("rope_residual_context") is not None:
            line += f" (averaged over {rope['rope_residual_context']} tokens)"
        lines.append(line + f", qk_nope_head_dim {rope['qk_nope_head_dim']}, allocation {rope['rope_allocation']}")
    allocs = [e["rope_allocation"] for e in report["layers"] if "rope_allocation" in e]
    if allocs:
        fixed = sum(a["fixed_energy_kept"] for a in allocs) / len(allocs)
        energy = sum(a["energy_energy_kept"] for a in allocs) / len(allocs)
        lines.append(f"  key energy kept rotated (mean over layers): {fixed:.1%} with these pairs; "
                     f"{energy:.1%} by energy allocation (report only unless stock RoPE expresses it)")
    layers = report["layers"]
    has_err = "heldout_key_rel_error" in layers[0]
    head = f"  {'layer':>5} {'r_kv':>5} {'energy':>7}" + (f" {'K err':>7} {'V err':>7}" if has_err else "")
    lines.append(head)
    for e in layers:
        row = f"  {e['layer']:>5} {e['kv_lora_rank']:>5} {_fmt(e['kv_weight_energy_kept'], '7.4f')}"
        if has_err:
            row += f" {_fmt(e['heldout_key_rel_error'], '7.4f')} {_fmt(e['heldout_value_rel_error'], '7.4f')}"
        lines.append(row)
    held = report.get("heldout")
    if held:
        lines.append(
            f"  held-out ({held['tokens']} tokens): perplexity {held['source_perplexity']:.3f} (source) -> "
            f"{held['converted_perplexity']:.3f} (converted); KL {held['kl_source_to_converted']:.4f}; "
            f"top-1 agreement {held['top1_agreement']:.1%}"
        )
    if report_says_linear(report):
        lines.append(f"  note: {LINEAR_LATENT_LORA}")
    lines.append(f"  took {report['seconds']:.1f}s; report: {report['output_dir']}/conversion_report.json")
    return lines


def _preset(preset: dict | None) -> str:
    """'preset best (auto: calibration text given; ...), method ' or nothing: how the recipe chose its keys."""
    if not preset:
        return ""
    why = f" (auto: {preset['auto']})" if "auto" in preset else ""
    return f"preset {preset['name']}{why}, method "


def serving_line(servable_by: dict[str, list[str]]) -> str:
    """Which engines run the shape, by backend; those that do not, and why in a word."""
    known = [f"{e} ({', '.join(b)})" for e, b in servable_by.items()]
    missing = [e for e in engines.ENGINES if e not in servable_by]
    why = {"vllm": "needs 256 + 64 or 512 + 64", "sglang": "needs 256 + 64 or 512 + 64",
           "llama.cpp": "needs qk_nope_head_dim >= 1"}
    line = "serves in: " + ("; ".join(known) if known else "none of the engines ecomla knows")
    if missing:
        line += "; not in " + ", ".join(f"{e} ({why[e]})" for e in missing)
    return line + f" (as of {engines.FACTS_DATE}; docs/serving.md)"


def target_lines(report: dict) -> list[str]:
    """gqa, mqa, lrkv."""
    kv = report["kv_elements_per_token_per_layer"]
    ratio = report["compression_ratio"]
    if "num_key_value_heads" in report:
        heads = report["num_key_value_heads"]
        what = f"{heads['before']} -> {heads['after']} KV heads, mean-pooled"
    else:
        what = f"shared K/V + rank-{report['lrkv_rank']} residual per head"
    lines = [
        f"converted {report['source']} ({report['source_family']}) -> {report['output_dir']}",
        f"  target {report['target']}: {report['output_class']}, {what}",
        f"  KV per token and layer: {kv['before']} -> {kv['after']}   compression: {format_ratio(ratio)}",
    ]
    if ratio < 1:
        even = f" (LRKV breaks even at rank {report['lrkv_break_even_rank']})" if "lrkv_rank" in report else ""
        lines.append(f"  note: this cache is larger than the source's{even}")
    p = report["params"]
    lines.append(f"  params: {p['before'] / 1e6:.2f}M -> {p['after'] / 1e6:.2f}M")
    energy = "k_residual_energy_kept" in report["layers"][0]
    lines.append(f"  {'layer':>5} {'K err':>7} {'V err':>7}" + (f" {'K energy':>8} {'V energy':>8}" if energy else ""))
    for e in report["layers"]:
        row = f"  {e['layer']:>5} {e['k_weight_rel_error']:7.4f} {e['v_weight_rel_error']:7.4f}"
        if energy:
            row += f" {e['k_residual_energy_kept']:8.4f} {e['v_residual_energy_kept']:8.4f}"
        lines.append(row)
    lines.append("  (K/V err: relative Frobenius error of the key/value projection each query head reads)")
    lines.append(f"  took {report['seconds']:.1f}s; report: {report['output_dir']}/conversion_report.json")
    return lines


def print_summary(report: dict) -> None:
    print("\n".join(summary_lines(report)))
