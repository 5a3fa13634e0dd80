"""`init.preset`: the peers' conversion recipes (and ecomla's best) as named sets of recipe keys.

A preset fills the `mla` and `init` keys that a recipe leaves unset; a key the recipe
sets itself wins, and the conversion report records both the expansion and what the
recipe overrode. A recipe that names no preset and sets none of the keys any preset sets
gets `auto`: `best` when it gives calibration text, `nodata` when it does not (the best
measured recipe for each; docs/convert.md#the-default). One that sets any of those keys
takes the rest from the converter's base defaults, X-EcoMLA's recipe with the normalized
latent. The shapes (kv_lora_rank or target_compression, qk_rope_head_dim) and the
calibration data stay the recipe's: a preset is how to convert, not how much.

How each peer is approximated in the stock DeepSeek-V3 layout (one shared RoPE key,
one kv_lora_rank for every layer) is in docs/convert.md#presets.
"""

from __future__ import annotations

from typing import Any, Literal

# Keys by section, as they appear in a recipe.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # X-EcoMLA (arXiv 2503.11132): joint SVD of the weights, fresh RoPE on the last dims, the mean KV head's key.
    "xecomla": {"init": {"method": "svd"}, "mla": {"rope_dims": "last", "rope_key": "mean"}},
    # MHA2MLA (arXiv 2502.14837): 2-norm partial RoPE, joint SVD of [W_k,nope; W_v]. Its per-head RoPE keys
    # become the stock shared key, the mean over KV heads.
    "mha2mla": {"init": {"method": "svd"}, "mla": {"rope_dims": "norm", "rope_key": "mean"}},
    # TransMLA (arXiv 2502.07864): RoRoPE (a PCA over KV heads per frequency pair, from activations), the
    # other head mixtures kept unrotated through the latent, and a balanced K/V PCA on calibration activations.
    # FreqFold is not reproduced.
    "transmla": {"init": {"method": "activation", "kv_balance": True},
                 "mla": {"rope_dims": "high", "rope_key": "rorope_act", "rope_residual": "latent"}},
    # CARE (ICLR 2026): SVD under the inputs' covariance (the activation fit), X-EcoMLA's RoPE layout; its
    # per-layer ranks are not used (stock DeepSeek-V3 has one kv_lora_rank).
    "care": {"init": {"method": "activation"}, "mla": {"rope_dims": "last", "rope_key": "mean"}},
    # ecomla's best one-shot recipe on the real model (docs/real_model.md, the presets side by side): the
    # RoRoPE layout, plus four levers each measured end to end against the same recipe without it: the latent
    # fitted for what the layer's output sees (attention objective), the residual's rotation averaged over the
    # distances attention reads, the latent kept in the norm's linear regime, and the value path refitted
    # through the converted layer's own attention.
    "best": {"init": {"method": "activation", "objective": "attention", "refit": "values"},
             "mla": {"rope_dims": "high", "rope_key": "rorope_act", "rope_residual": "latent_mean",
                     "rope_residual_distances": "attention", "latent_norm": "linear"}},
    # ecomla's best one-shot recipe without calibration text (docs/real_model.md, the one-shot table): the
    # weights' joint SVD with the high-frequency RoPE dims, the mean KV head's key, and the linear latent.
    "nodata": {"init": {"method": "svd"}, "mla": {"rope_dims": "high", "rope_key": "mean", "latent_norm": "linear"}},
}

# What `auto` (a recipe with no preset and none of the presets' keys) takes, by whether it gives calibration text.
AUTO = {True: "best", False: "nodata"}

# best's own levers (docs/convert.md#the-levers-of-best), each as the keys that switch it off again: what
# recipes/run/best_levers_smollm2.yaml converts to measure every lever against the same recipe without it.
BEST_LEVERS: dict[str, dict[str, dict[str, Any]]] = {
    "objective": {"init": {"objective": "kv"}},
    "distances": {"mla": {"rope_residual_distances": "causal"}},
    "linear": {"mla": {"latent_norm": "normalize"}},
    "refit": {"init": {"refit": "none"}},
}

PRESET_NAMES = tuple(PRESETS)
PresetName = Literal[(*PRESET_NAMES, "auto")]  # the recipe's type for init.preset: the names above, or auto
# Every key some preset sets, as (section, key): a recipe that sets one of them chose its own conversion.
PRESET_KEYS = frozenset((sec, k) for preset in PRESETS.values() for sec, kv in preset.items() for k in kv)


def dotted(name: str) -> dict[str, Any]:
    """A preset's keys as 'section.key' -> value."""
    return {f"{sec}.{k}": v for sec, kv in PRESETS[name].items() for k, v in kv.items()}


def describe() -> str:
    """The presets for --help: 'name: section.key=value, ...; ...'."""
    return "; ".join(f"{name}: " + ", ".join(f"{k}={v}" for k, v in dotted(name).items()) for name in PRESETS)


def auto(raw: dict) -> str | None:
    """The preset `auto` stands for in this raw recipe: None if it sets any preset's key, else by calibration."""
    sections = {sec: raw.get(sec) if isinstance(raw.get(sec), dict) else {} for sec in ("mla", "init")}
    if any(key in sections[sec] for sec, key in PRESET_KEYS):
        return None
    return AUTO[sections["init"].get("calibration") is not None]


def expand(raw: dict) -> dict:
    """The raw convert recipe with `init.preset`'s keys filled in where unset.

    A missing `init.preset` is `auto`, which takes `auto(raw)`'s preset, or none (the converter's base defaults)
    when the recipe sets a preset's key itself; `init.preset: null` asks for the base defaults outright.
    Returns a new mapping (the input is not changed). A recipe for another target, or with a preset or section
    of the wrong kind (which the schema then reports), comes back as it is.
    """
    init = raw.get("init", {})
    if not isinstance(init, dict) or raw.get("target", "mla") != "mla":
        return raw  # other targets refuse an init section that is set; the schema reports a wrong type
    name = init.get("preset", "auto")
    if name == "auto":
        name = auto(raw)
        if name is None:
            return {**raw, "init": {**init, "preset": None}}
    if name not in PRESETS:
        return raw  # None (no preset), or a bad value the schema reports with its choices
    out = dict(raw)
    for section, keys in PRESETS[name].items():
        given = out.get(section)
        if given is not None and not isinstance(given, dict):
            return raw  # the schema reports the wrong type
        merged = dict(given or {})
        for key, value in keys.items():
            merged.setdefault(key, value)
        out[section] = merged
    return out


def resolved(name: str | None, init: Any) -> str | None:
    """The preset a validated recipe's `init.preset` stands for (`auto` left in it means `auto` took one)."""
    return AUTO[init.calibration is not None] if name == "auto" else name


def expansion(name: str | None, mla: Any, init: Any) -> dict | None:
    """For the report: the preset's keys, and those the recipe set to something else (key -> value used);
    `auto` when the recipe named none and `auto` chose it."""
    chosen = resolved(name, init)
    if chosen is None:
        return None
    sections = {"mla": mla, "init": init}
    keys = dotted(chosen)
    used = {dot: getattr(sections[dot.split(".")[0]], dot.split(".")[1]) for dot in keys}
    out = {"name": chosen, "keys": keys, "overridden": {dot: v for dot, v in used.items() if v != keys[dot]}}
    if name == "auto":
        out["auto"] = ("calibration text given" if init.calibration is not None else "no calibration text") + \
            "; set init.preset to choose another"
    return out

