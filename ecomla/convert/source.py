"""Source checkpoints the converter accepts, and running their layers one at a time.

`inspect_source` reads a Llama, Mistral or Qwen2 checkpoint's config and tensor
index and reports every reason it cannot be converted at once (QK-norm, sliding
window, MoE, unsupported RoPE types, missing or mis-shaped tensors), before any
compute or any write.

`LayerRunner` runs a single stock decoder layer of a given transformers family
(built from the public modeling module, weights loaded from the checkpoint) on
held activations. Streaming calibration and the conversion report use it to walk
a model layer by layer without ever holding all of it.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from ecomla.errors import UserError
from ecomla.io.checkpoint import CheckpointError, CheckpointReader, resolve_model_dir
from ecomla.mla.budget import AttentionShape

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "deepseek_v3": "DeepseekV3"}
SOURCE_FAMILIES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")

_WHY_NOT = {
    "qwen3": "Qwen3 applies a QK-norm per head after q_proj/k_proj, which stock DeepSeek-V3 MLA cannot express",
    "gemma": "Gemma's attention (soft-capping, scaled embeddings) is not a stock DeepSeek-V3 pattern",
    "gemma2": "Gemma-2 uses logit soft-capping and sliding-window layers",
    "gemma3": "Gemma-3 uses a QK-norm and sliding-window layers",
    "mixtral": "Mixtral is a mixture-of-experts model; only dense MLPs are converted",
    "qwen2_moe": "Qwen2-MoE is a mixture-of-experts model; only dense MLPs are converted",
    "deepseek_v3": "this checkpoint is already DeepSeek-V3 MLA",
}


class SourceError(UserError, ValueError):
    """The source checkpoint cannot be converted; `problems` lists every reason."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"cannot convert {source}:\n{lines}")


@dataclass
class SourceModel:
    """A checked, convertible source checkpoint."""

    directory: Path
    config: PretrainedConfig
    shape: AttentionShape
    reader: CheckpointReader
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, Llama attention_bias)
    o_bias: bool
    tied: bool

    @property
    def family(self) -> str:
        return self.config.model_type

    @property
    def rope_parameters(self) -> dict:
        return dict(self.config.rope_parameters)

    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}."


def _config_problems(cfg: PretrainedConfig) -> list[str]:
    problems = []
    mt = cfg.model_type
    if mt not in SOURCE_FAMILIES:
        reason = _WHY_NOT.get(mt, "no converter is written for this family")
        problems.append(f"model_type '{mt}' is not supported ({reason}); supported: {', '.join(SOURCE_FAMILIES)}")
        return problems
    if mt == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        problems.append(
            f"sliding_window={cfg.sliding_window}: sliding-window attention has no stock DeepSeek-V3 equivalent; "
            "set it to null in config.json if the model was trained or is used with full attention"
        )
    if mt == "qwen2" and getattr(cfg, "use_sliding_window", False):
        problems.append("use_sliding_window=true: sliding-window attention has no stock DeepSeek-V3 equivalent")
    if getattr(cfg, "mlp_bias", False):
        problems.append("mlp_bias=true: stock DeepSeek-V3 MLPs have no biases")
    rope = dict(cfg.rope_parameters or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_type '{rope_type}' is not supported yet; supported: {', '.join(ROPE_TYPES)}")
    if float(rope.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1 is not supported")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % kv:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd; RoPE needs pairs")
    return problems


def expected_tensors(cfg: PretrainedConfig, shape: AttentionShape, qkv_bias: bool, o_bias: bool, tied: bool):
    """name -> shape of every tensor the converter reads."""
    d, dh, inter = shape.hidden_size, shape.head_dim, cfg.intermediate_size
    q, kv = shape.num_heads * dh, shape.num_kv_heads * dh
    want = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not tied:
        want["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        want.update({
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
        })
        if qkv_bias:
            want.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)})
        if o_bias:
            want[p + "self_attn.o_proj.bias"] = (d,)
    return want


def load_config(directory: Path) -> PretrainedConfig:
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: config.json is missing")
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as err:
        raise CheckpointError(f"{directory}/config.json: cannot be read ({type(err).__name__}: {err})") from err


def inspect_source(name_or_path: str) -> SourceModel:
    """Open and check a source checkpoint; raises SourceError / CheckpointError listing all problems."""
    directory = resolve_model_dir(name_or_path)
    cfg = load_config(directory)
    problems = _config_problems(cfg)
    if problems:
        raise SourceError(name_or_path, problems)
    shape = AttentionShape.from_config(cfg.to_dict())
    qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
    o_bias = cfg.model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    reader = CheckpointReader(directory)
    names = reader.names()
    for name, want in expected_tensors(cfg, shape, qkv_bias, o_bias, tied).items():
        if name not in names:
            problems.append(f"tensor {name} is missing")
        elif tuple(reader.shape(name)) != want:
            problems.append(f"tensor {name} has shape {tuple(reader.shape(name))}, config says {want}")
    if problems:
        raise SourceError(name_or_path, problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else []))
    return SourceModel(directory, cfg, shape, reader, qkv_bias, o_bias, tied)


def family_module(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def rotary_embedding(cfg: PretrainedConfig) -> torch.nn.Module:
    """The family's own rotary embedding module (its inv_freq is the ground truth for RoPE)."""
    mod = family_module(cfg.model_type)
    return getattr(mod, f"{FAMILIES[cfg.model_type]}RotaryEmbedding")(config=cfg)


def causal_mask(seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(1, 1, T, T) additive causal mask, accepted by eager and SDPA attention alike."""
    mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]


class LayerRunner:
    """Runs decoder layer i of a model family on hidden states (B, T, d), loading its weights on demand."""

    def __init__(self, cfg: PretrainedConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "sdpa"):
        cfg = copy.deepcopy(cfg)
        # Standalone layers get no dispatch from a model; SDPA is exact and fast, eager also returns the probabilities.
        cfg._attn_implementation = attn_implementation
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self._layer_cls = getattr(family_module(cfg.model_type), f"{FAMILIES[cfg.model_type]}DecoderLayer")
        self.rotary = rotary_embedding(cfg).to(device)

    def build(self, index: int, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A decoder layer with `tensors` (names relative to the layer) loaded strictly."""
        with torch.device("meta"):
            layer = self._layer_cls(self.cfg, index)
        layer = layer.to_empty(device=self.device)
        missing, unexpected = layer.load_state_dict({k: v.to(self.dtype) for k, v in tensors.items()}, strict=False)
        # Non-persistent buffers are not in checkpoints; everything else must be.
        if unexpected or [m for m in missing if not m.endswith(("inv_freq", "original_inv_freq"))]:
            raise RuntimeError(f"layer {index}: missing {missing}, unexpected {unexpected}")
        return layer.to(self.dtype).eval()

    @torch.no_grad()
    def run(self, layer: torch.nn.Module, hidden: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """Apply `layer` to (N, T, d) sequences in batches; returns (N, T, d)."""
        return self.run_with_attention(layer, hidden, batch_size, keep_attention=False)[0]

    @torch.no_grad()
    def run_with_attention(self, layer: torch.nn.Module, hidden: torch.Tensor, batch_size: int = 8,
                           keep_attention: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`, and the layer's attention output (N, T, d) on the way (what `self_attn` returned, before the
        residual add), read by a forward hook, so the attention runs once for both."""
        outs, attn_outs = [], []
        T = hidden.shape[1]
        mask = causal_mask(T, self.dtype, self.device)
        pos = torch.arange(T, device=self.device)[None]
        hook = None
        if keep_attention:
            hook = layer.self_attn.register_forward_hook(
                lambda _module, _args, out: attn_outs.append(out[0].to(hidden.dtype).cpu()))
        try:
            for chunk in hidden.split(batch_size):
                h = chunk.to(self.device, self.dtype)
                pe = self.rotary(h, pos)
                outs.append(layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe).to(hidden.dtype).cpu())
        finally:
            if hook is not None:
                hook.remove()
        return torch.cat(outs), (torch.cat(attn_outs) if keep_attention else None)
