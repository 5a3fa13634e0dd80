"""Grow a trained Llama into a wider and deeper one that computes exactly the same function.

    from ecomla.tinyworld.grow import grow_llama
    teacher = grow_llama(base, LlamaConfig(hidden_size=384, intermediate_size=1152, num_hidden_layers=6,
                                            num_attention_heads=6, ...))

The tiny zoo's 3x and 8x teachers start from the trained base this way and are
then pretrained further (`ecomla build tiny-zoo`). Trained from scratch on 2
CPU cores, an 8x model sees an eighth of the base's tokens in the same time, and
never reaches the point where a tiny Llama learns to copy from its context
(a few thousand steps; see the README); grown, it starts with everything the
base knows and spends its steps on what the extra width and depth can add.

How the function is kept (old sizes h, I, L, n; new H, I', L', n'):
- Residual width h -> H: the new dims of the embedding and of every write into
  the residual stream (o_proj and down_proj rows) are zero, so the stream's new
  dims stay zero. RMSNorm then sees the same vector padded with zeros, whose RMS
  is sqrt(h/H) times smaller: its weights are scaled by sqrt(h/H) and its eps by
  h/H, which makes the normalized output exactly the old one, zero-padded.
- MLP width I -> I': new units have zero down_proj columns.
- Heads n -> n' (same KV heads and head dim): query heads are grouped over the
  KV heads in order, so old head j of group g goes to slot j of group g and the
  new slots at the end of each group get zero o_proj columns.
- Layers L -> L': new layers go on top with zero o_proj and down_proj, so each
  adds nothing to the stream.

Everything that multiplies the (zero) new stream dims or feeds a zeroed output
keeps its random init, so training moves the new parts at once: a zeroed output
gets a gradient at the first step, and what feeds it from the second (tested).
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM

_SAME = ("vocab_size", "head_dim", "num_key_value_heads", "rope_theta", "tie_word_embeddings", "hidden_act",
         "attention_bias", "mlp_bias")  # fmt: skip
_GROWS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_growable(src: LlamaConfig, dst: LlamaConfig) -> None:
    """Raise ValueError naming every size that cannot grow from `src` to `dst`."""
    problems = [f"{k}: {getattr(src, k, None)} -> {getattr(dst, k, None)} (must stay the same)"
                for k in _SAME if getattr(src, k, None) != getattr(dst, k, None)]  # fmt: skip
    problems += [f"{k}: {getattr(src, k)} -> {getattr(dst, k)} (can only grow)" for k in _GROWS
                 if getattr(dst, k) < getattr(src, k)]  # fmt: skip
    if dst.num_attention_heads % dst.num_key_value_heads:
        problems.append(f"num_attention_heads {dst.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads {dst.num_key_value_heads}")  # fmt: skip
    if getattr(src, "attention_bias", False) or getattr(src, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias: biases are not supported (Llama has none)")
    if src.rope_scaling != dst.rope_scaling:
        problems.append(f"rope_scaling: {src.rope_scaling} -> {dst.rope_scaling} (must stay the same)")
    if problems:
        raise ValueError("cannot grow the model:\n  " + "\n  ".join(problems))


def _head_slots(src: LlamaConfig, dst: LlamaConfig) -> torch.Tensor:
    """For each old query head, its new index: same KV group, same slot within the group."""
    per_old = src.num_attention_heads // src.num_key_value_heads
    per_new = dst.num_attention_heads // dst.num_key_value_heads
    return torch.tensor([(j // per_old) * per_new + j % per_old for j in range(src.num_attention_heads)])


def grow_llama(src: LlamaForCausalLM, config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialized `config` model with `src`'s weights placed so that its logits equal `src`'s.

    `config.rms_norm_eps` is overridden (src eps * h/H); everything else is used as given.
    """
    s = src.config
    check_growable(s, config)
    config = LlamaConfig.from_dict(config.to_dict())  # a copy: the eps below is ours to set
    h, H = s.hidden_size, config.hidden_size
    config.rms_norm_eps = s.rms_norm_eps * h / H
    torch.manual_seed(seed)
    dst = LlamaForCausalLM(config).to(src.dtype)
    scale = math.sqrt(h / H)
    d = s.head_dim
    heads = _head_slots(s, config)
    q_rows = (heads[:, None] * d + torch.arange(d)).flatten()  # rows of q_proj / columns of o_proj of old heads
    I = s.intermediate_size  # noqa: E741
    with torch.no_grad():
        dst.model.embed_tokens.weight[:, :h] = src.model.embed_tokens.weight
        dst.model.embed_tokens.weight[:, h:] = 0
        if not config.tie_word_embeddings:
            dst.lm_head.weight[:, :h] = src.lm_head.weight
            dst.lm_head.weight[:, h:] = 0
        dst.model.norm.weight[:h] = src.model.norm.weight * scale
        for i, new in enumerate(dst.model.layers):
            if i >= s.num_hidden_layers:  # a new layer on top: adds nothing until trained
                new.self_attn.o_proj.weight.zero_()
                new.mlp.down_proj.weight.zero_()
                continue
            old = src.model.layers[i]
            new.input_layernorm.weight[:h] = old.input_layernorm.weight * scale
            new.post_attention_layernorm.weight[:h] = old.post_attention_layernorm.weight * scale
            new.self_attn.q_proj.weight[q_rows, :h] = old.self_attn.q_proj.weight
            new.self_attn.k_proj.weight[:, :h] = old.self_attn.k_proj.weight
            new.self_attn.v_proj.weight[:, :h] = old.self_attn.v_proj.weight
            o = new.self_attn.o_proj.weight
            o.zero_()
            o[:h, q_rows] = old.self_attn.o_proj.weight
            new.mlp.gate_proj.weight[:I, :h] = old.mlp.gate_proj.weight
            new.mlp.up_proj.weight[:I, :h] = old.mlp.up_proj.weight
            down = new.mlp.down_proj.weight
            down.zero_()
            down[:h, :I] = old.mlp.down_proj.weight
    return dst
