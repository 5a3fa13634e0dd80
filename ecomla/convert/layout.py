"""The linear latent's layout: its scale, carried by the checkpoint's own config.json, and the tensors it stores
off their natural size.

`mla.latent_norm: linear` (docs/convert.md#the-latent-norm) keeps the latent c = a·Q·y inside
kv_a_layernorm's ε, where the stock RMSNorm is a fixed scale c/√ε instead of a per-token one. The scale a is
split between the attention input's gain γ (input_layernorm) and the latent rows (a/γ)·Q; every other
projection that reads the input is stored ×1/γ, and kv_b_proj, which reads the latent at about a/√ε of a unit
latent's size, is stored ×√ε/a. The model computes exactly what the fit says, but these tensors sit at scales
from about 1e-3 to 1e3 of what the same weights would be in a normalized model, so an optimizer that moves every
entry by about its learning rate needs to know them.

Where the scale lives. `ecomla convert` writes it into config.json under `ecomla_linear_latent` ({"scale": a,
"input_gain": γ, "norm_eps": ε}). transformers keeps an unknown config key as an attribute and writes it back
on `save_pretrained`, so every checkpoint made from that model (a distillation's `final/`, a second
distillation's) carries it, and any reader of the checkpoint alone can find it. Checkpoints converted before
the key existed are recognised by their `conversion_report.json` (its recipe says `latent_norm: linear`);
`linear_latent_of` then derives the same numbers from the config's widths.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ecomla.mla import latent

CONFIG_KEY = "ecomla_linear_latent"

# Why `ecomla distill` refuses a LoRA run of a linear-latent student; `ecomla convert` prints it, and `ecomla run`
# refuses such a recipe at plan time with it (docs/distill.md).
LINEAR_LATENT_LORA = (
    "mla.latent_norm: linear stores the latent's scale in the weights (input_layernorm and the latent rows of "
    "kv_a_proj_with_mqa at about 1e-3, query rows x1/gain, kv_b_proj x sqrt(eps)/scale). Full and staged training "
    "train each such tensor at its natural size, but LoRA adapters on them would train at the wrong scale. Distill "
    "it with train.mode: full or stages, or convert with mla.latent_norm: normalize (--set mla.latent_norm=normalize)"
)


@dataclass(frozen=True)
class LinearLatent:
    """The numbers that fix a linear-latent checkpoint's layout (the value of config.json's CONFIG_KEY)."""

    scale: float  # a: the latent is a·Q·y, its mean square at most a small share of norm_eps
    input_gain: float  # γ: input_layernorm's gain; every projection reading the input is stored ×1/γ
    norm_eps: float = latent.LATENT_NORM_EPS  # kv_a_layernorm's ε, which turns the latent into c/√ε

    @classmethod
    def for_width(cls, width: int, hidden: int) -> LinearLatent:
        """The layout `ecomla convert` writes for a latent of (padded) `width` in a model of `hidden` size."""
        return cls(scale=latent.linear_latent_scale(width, hidden), input_gain=latent.linear_input_gain(width, hidden))

    @classmethod
    def from_value(cls, value: dict) -> LinearLatent:
        return cls(**{k: float(value[k]) for k in ("scale", "input_gain", "norm_eps") if k in value})

    def to_value(self) -> dict:
        return asdict(self)

    @property
    def latent_size(self) -> float:
        """ρ = a/√ε: the size of kv_b_proj's input against a unit-RMS latent's."""
        return self.scale / self.norm_eps**0.5

    def stored_scales(self, config) -> dict[str, torch.Tensor]:
        """Per-row scales s of the tensors stored off their natural size, by parameter name: stored = s·natural.

        Natural means the size the same weights have in a normalized-latent model: a unit attention input, an
        orthonormal latent basis, and kv_b_proj reading a unit-RMS latent. Vectors have one entry per row (a
        1-D weight: per entry). `config` is the checkpoint's DeepseekV3Config (or anything with its fields).
        """
        g, r = self.input_gain, config.kv_lora_rank
        query = "q_a_proj" if getattr(config, "q_lora_rank", None) else "q_proj"
        q_rows = config.q_lora_rank if query == "q_a_proj" else \
            config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
        kv_b_rows = config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim)
        kv_a = torch.cat([torch.full((r,), self.scale / g), torch.full((config.qk_rope_head_dim,), 1 / g)])
        scales = {}
        for i in range(config.num_hidden_layers):
            layer = f"model.layers.{i}."
            scales[layer + "input_layernorm.weight"] = torch.full((config.hidden_size,), g)
            scales[layer + f"self_attn.{query}.weight"] = torch.full((q_rows,), 1 / g)
            scales[layer + "self_attn.kv_a_proj_with_mqa.weight"] = kv_a.clone()
            scales[layer + "self_attn.kv_b_proj.weight"] = torch.full((kv_b_rows,), 1 / self.latent_size)
        return scales


def write(config, layout: LinearLatent | None) -> None:
    """Record `layout` in `config` (saved into config.json with it); None removes a stale record."""
    if layout is None:
        if hasattr(config, CONFIG_KEY):
            delattr(config, CONFIG_KEY)
        return
    setattr(config, CONFIG_KEY, layout.to_value())


def report_says_linear(report: dict) -> bool:
    """Whether a conversion report's recipe kept the latent in the norm's linear regime."""
    return ((report.get("recipe") or {}).get("mla") or {}).get("latent_norm") == "linear"


def _legacy_report(checkpoint: str | Path | None) -> dict | None:
    file = Path(checkpoint).expanduser() / "conversion_report.json" if checkpoint else None
    if file is None or not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def linear_latent_of(config, checkpoint: str | Path | None = None) -> LinearLatent | None:
    """The layout a checkpoint's config records; for a checkpoint converted before config.json carried it, the
    one its `conversion_report.json` implies. None: the latent is normalized (or the model is no ecomla MLA)."""
    value = getattr(config, CONFIG_KEY, None)
    if value:
        return LinearLatent.from_value(value)
    report = _legacy_report(checkpoint)
    if report is not None and report_says_linear(report) and getattr(config, "kv_lora_rank", None):
        return LinearLatent.for_width(config.kv_lora_rank, config.hidden_size)
    return None
