"""Model configs (dicts for `ecomla pretrain`'s student_config) for each attention variant, at equal parameters.

mha / gqa / mqa are stock Llama configs with num_key_value_heads = heads / g / 1;
mla is a stock DeepSeek-V3 config with dense MLPs (as `ecomla convert` writes),
kv_lora_rank r_kv and a shared RoPE key of d_r with qk_nope = head_dim − d_r;
lrkv is ecomla's registered LRKV model. KV numbers cached per token and layer:
  mha 2·n_h·d_h   gqa 2·g·d_h   mqa 2·d_h   mla r_kv + d_r   lrkv 2·(d_h + n_h·r)
(`ecomla.mla.budget.kv_elements_per_token` computes them from these dicts).
"""

from __future__ import annotations

import torch

from ecomla.variants.recipe import SizeSpec, VariantSpec


def base_fields(size: SizeSpec, vocab_size: int, special: dict, max_positions: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_hidden_layers": size.num_hidden_layers,
        "num_attention_heads": size.num_attention_heads,
        "head_dim": size.head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **special,
    }


def variant_config(size: SizeSpec, v: VariantSpec, vocab_size: int, special: dict, max_positions: int) -> dict:
    """The student_config dict of variant v at this size (MLP width not yet matched)."""
    cfg = base_fields(size, vocab_size, special, max_positions)
    heads, d_h = size.num_attention_heads, size.head_dim
    if v.kind in ("mha", "gqa", "mqa"):
        kv = {"mha": heads, "gqa": v.kv_heads, "mqa": 1}[v.kind]
        if heads % kv:
            raise ValueError(f"variant {v.name}: kv_heads {kv} does not divide {heads} query heads")
        return {"model_type": "llama", **cfg, "num_key_value_heads": kv}
    if v.kind == "lrkv":
        if not 1 <= v.rank <= min(size.hidden_size, d_h):
            raise ValueError(f"variant {v.name}: rank {v.rank} must be in [1, {min(size.hidden_size, d_h)}]")
        return {"model_type": "lrkv", **cfg, "num_key_value_heads": heads, "lrkv_rank": v.rank}
    rope_dim = v.rope_dim if v.rope_dim is not None else d_h // 2
    if rope_dim % 2 or not 0 < rope_dim < d_h:
        raise ValueError(f"variant {v.name}: rope_dim {rope_dim} must be even and below the head dim {d_h}")
    cfg.pop("head_dim")
    return {
        "model_type": "deepseek_v3", **cfg,
        "moe_intermediate_size": size.intermediate_size,
        "num_key_value_heads": heads,
        "kv_lora_rank": v.kv_lora_rank, "q_lora_rank": None,
        "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": d_h - rope_dim, "v_head_dim": d_h,
        "first_k_dense_replace": size.num_hidden_layers,  # every layer dense: no MoE
        "n_routed_experts": 1, "n_shared_experts": 1, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0, "rope_interleave": False, "attention_bias": False,
    }


def count_params(cfg: dict) -> int:
    """Parameters of the model a config dict builds (on the meta device: no memory, no init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes)

    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())


def match_mlp(cfg: dict, target: int) -> dict:
    """cfg with intermediate_size set so its parameter count is as close to `target` as the MLP width allows."""
    base = count_params(cfg)
    per_unit = 3 * cfg["hidden_size"] * cfg["num_hidden_layers"]  # gate, up and down grow by one column each
    width = max(1, cfg["intermediate_size"] + round((target - base) / per_unit))
    out = {**cfg, "intermediate_size": width}
    if "moe_intermediate_size" in out:
        out["moe_intermediate_size"] = width
    return out
