"""`ecomla analyze recon`: K/V reconstruction error of a calibrated latent against calibration tokens.

    ecomla analyze recon recipes/analyze/recon_tiny.yaml

For each N in `token_counts`, the MLA latent of every layer is fitted
(`init.method=activation`) on the first N calibration tokens of one domain, and
the relative reconstruction error ‖K−K̂‖/‖K‖ and ‖V−V̂‖/‖V‖ is measured on
held-out text of the same domain and of others, averaged over layers. Keys
include the shared RoPE key (and, under `mla.rope_residual: latent`, the residual
the latent carries). The shape comes from `ecomla convert`'s own plan and the fit
from its own layer transform (`ecomla.convert.mla.fit_layer`), so every `mla` key
this analysis accepts means what it means in a conversion. The source is walked
layer by layer once; every N reuses the same activations. Writes recon.json,
recon.png and the resolved recipe.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ecomla.convert.metrics import kv_errors
from ecomla.convert.mla import fit_layer
from ecomla.convert.plan import MLAPlan, make_plan
from ecomla.convert.recipe import ConvertRecipe, MLAConfig, TextSource
from ecomla.convert.source import LayerRunner
from ecomla.convert.to_mla import SourceAttention
from ecomla.convert.walk import embed, layer_tensors, normalized_input, source_attention
from ecomla.data.text import token_blocks
from ecomla.io.publish import publish
from ecomla.recipe.schema import knob, load_recipe, recipe_to_dict, save_recipe


@dataclass
class NamedSource(TextSource):
    name: str = knob("", help="Label used in the chart legend (defaults to the file name)")


# MLAConfig keys this analysis refuses rather than ignore: the allocations choose per-layer shapes from one
# fixed calibration set, which this analysis varies; the query rank and the residual's averaging context shape
# only the query rows, which play no part in the K/V error.
UNREAD_MLA_KEYS = ("rank_allocation", "energy_multiple", "rope_allocation", "q_lora_rank", "rope_residual_context",
                   "rope_residual_distances")


@dataclass
class ReconRecipe:
    """`ecomla analyze recon`: reconstruction error against the number of calibration tokens."""

    model: str = knob(help="Source checkpoint directory (or hub name when online)")
    output_dir: str = knob(help="Where recon.json and recon.png are written")
    calibration: NamedSource = knob(help="The domain the latent is fitted on")
    heldout: list[NamedSource] = knob(
        help="Held-out sources to measure on (same domain first, then others); a source equal to `calibration` "
        "is read after the fitted tokens, so the two never overlap"
    )
    token_counts: list[int] = knob(
        default_factory=lambda: [20000, 40000, 80000, 120000, 160000], help="Calibration token counts N to fit on"
    )
    heldout_tokens: int = knob(16384, help="Tokens measured per held-out source")
    seq_len: int = knob(256, help="Block length for calibration and held-out text")
    mla: MLAConfig = knob(default_factory=lambda: MLAConfig(kv_lora_rank=64), help="Latent shape (as in convert)")
    ridge: float = knob(1e-6, help="Ridge of the up-projection fit, relative to the mean eigenvalue")
    batch_size: int = knob(8, help="Sequences per forward pass")
    device: str = knob("auto", help="auto, cpu, cuda, ...")

    def check(self) -> list[str]:
        problems = []
        if not self.token_counts or any(n < self.seq_len for n in self.token_counts):
            problems.append(f"token_counts: need at least one count, each >= seq_len ({self.seq_len})")
        if not self.heldout:
            problems.append("heldout: list at least one held-out source")
        if self.mla.rope_dims == "norm":
            problems.append("mla.rope_dims: 'norm' is not supported here; use last, high, low or uniform")
        if self.heldout_tokens < self.seq_len:
            problems.append(f"heldout_tokens: must be at least seq_len ({self.seq_len})")
        default = MLAConfig()
        for key in UNREAD_MLA_KEYS:
            if getattr(self.mla, key) != getattr(default, key):
                problems.append(f"mla.{key}: analyze recon does not read this key (the allocations need one fixed "
                                f"calibration set; the query rows play no part in the K/V error); remove it (default "
                                f"{getattr(default, key)!r}) or measure with `ecomla convert`")
        return problems


def _same(a: TextSource, b: TextSource) -> bool:
    return (a.dataset, a.subset, a.split, a.text_field) == (b.dataset, b.subset, b.split, b.text_field)


def _label(src: NamedSource) -> str:
    return src.name or Path(src.dataset).stem


def recon_plan(recipe: ReconRecipe) -> MLAPlan:
    """The conversion plan of the recipe's `mla`, for the activation fit (the fits below bring their own tokens;
    the plan reads one block of the calibration source, which the activation recipes require)."""
    mla = recipe_to_dict(recipe.mla)
    calibration = {k: v for k, v in recipe_to_dict(recipe.calibration).items() if k != "name"}
    calibration.update(num_tokens=recipe.seq_len, seq_len=recipe.seq_len, heldout_tokens=0)
    data = {"model": recipe.model, "output_dir": recipe.output_dir, "mla": mla, "dtype": "float32",
            "device": recipe.device, "init": {"method": "activation", "ridge": recipe.ridge, "calibration": calibration}}
    plan = make_plan(load_recipe(ConvertRecipe, data=data), force=True, progress=False)
    if plan.source.qkv_bias and recipe.mla.q_lora_rank is None:
        # A query bias needs a query latent in the stock layout; queries play no part here, so take the exact one.
        mla["q_lora_rank"] = plan.shape.hidden_size + 1
        plan = make_plan(load_recipe(ConvertRecipe, data=data), force=True, progress=False)
    return plan


def run_recon(recipe: ReconRecipe, *, force: bool = False, progress: bool = True) -> dict:
    out = Path(recipe.output_dir)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    plan = recon_plan(recipe)
    source, shape, geo = plan.source, plan.shape, plan.geometry
    tok = AutoTokenizer.from_pretrained(source.directory)
    T = recipe.seq_len
    counts = sorted(recipe.token_counts)
    cal = recipe.calibration
    n_fit = counts[-1] // T
    fit_ids = token_blocks(cal.texts(), tok, T, n_fit)
    # Held-out text from the calibration source itself starts after the fitted blocks, so the two never overlap.
    held_ids = [
        token_blocks(h.texts(), tok, T, recipe.heldout_tokens // T, skip_blocks=n_fit if _same(h, cal) else 0)
        for h in recipe.heldout
    ]
    runner = LayerRunner(source.config, plan.device)
    eps = float(source.config.rms_norm_eps)
    h_fit = embed(source.reader, fit_ids)
    h_held = [embed(source.reader, ids) for ids in held_ids]
    # errors[n_index][heldout_index] = list of (k_err, v_err) per layer
    errors = [[[] for _ in held_ids] for _ in counts]
    for i in tqdm(range(shape.num_layers), desc="recon", unit="layer", disable=not progress):
        t = layer_tensors(source.reader, i)
        src = source_attention(t)
        kv_only = SourceAttention(q_w=src.q_w, k_w=src.k_w, v_w=src.v_w, o_w=src.o_w)  # queries play no part
        y_fit = normalized_input(h_fit, eps)
        ys_held = [normalized_input(h, eps) for h in h_held]
        split = plan.layers[i].rope
        for n_idx, n in enumerate(counts):
            res, _ = fit_layer(plan, i, kv_only, y_fit[:n], torch.Generator())
            for h_idx, y in enumerate(ys_held):
                errors[n_idx][h_idx].append(
                    kv_errors(geo, split, kv_only, res.tensors, y, res.rope.head_scale,
                              res.rope.residual))
        layer = runner.build(i, t)
        h_fit = runner.run(layer, h_fit, recipe.batch_size)
        h_held = [runner.run(layer, h, recipe.batch_size) for h in h_held]
        source.reader.release()

    labels = [_label(h) for h in recipe.heldout]
    series = []
    for h_idx, label in enumerate(labels):
        for part, which in (("Key", 0), ("Value", 1)):
            ys = [sum(e[which] for e in errors[n_idx][h_idx]) / shape.num_layers for n_idx in range(len(counts))]
            series.append({"name": f"{part} {_label(cal)} -> {label}", "kind": part.lower(), "heldout": label, "error": ys})
    result = {
        "model": recipe.model,
        "kv_lora_rank": geo.kv_lora_rank,
        "qk_rope_head_dim": geo.qk_rope_head_dim,
        "calibration": _label(cal),
        "token_counts": counts,
        "series": series,
        "per_layer": {
            f"{labels[h]}@{counts[n]}": [{"key": k, "value": v} for k, v in errors[n][h]]
            for n in range(len(counts))
            for h in range(len(labels))
        },
        "recipe": recipe_to_dict(recipe),
    }
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent if out.parent.exists() else None))
    try:
        (tmp / "recon.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_recon(result, tmp / "recon.png")
        save_recipe(recipe, tmp / "ecomla_recipe.yaml")
        publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for s in series:
        print(f"{s['name']:<40} " + "  ".join(f"{e:.4f}" for e in s["error"]))
    print(f"wrote {out}/recon.json and {out}/recon.png")
    return result


def plot_recon(result: dict, path: Path) -> None:
    """Line chart shaped like seed figure 000: error against calibration tokens (thousands), 4+ series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [n / 1000 for n in result["token_counts"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = ["-", "--", ":", "-."]
    for idx, s in enumerate(result["series"]):
        marker = "v" if s["kind"] == "value" else "o"
        ax.plot(xs, s["error"], linestyle=styles[idx % len(styles)], marker=marker, label=s["name"])
    ax.set_xlabel("#Calibration Tokens (Thousands)")
    ax.set_ylabel("Relative Reconstruction Error")
    ax.set_title(f"{Path(result['model']).name}: r_kv={result['kv_lora_rank']}, d_r={result['qk_rope_head_dim']}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
