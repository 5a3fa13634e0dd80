"""Student and teacher models of a training run: loading, checks, trainable groups and the final export.

Both are stock Hugging Face causal LMs loaded with `from_pretrained` (or built
with `from_config` for pretraining), so under ZeRO-3 they are partitioned at
construction with their weight initialization intact (the caller keeps an
`HfDeepSpeedConfig` alive while they are built).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import ecomla.lrkv  # noqa: F401  (registers "lrkv" with the Auto classes: an LRKV student or teacher loads by path)
from ecomla.convert import layout
from ecomla.errors import UserError
from ecomla.io.checkpoint import TOKENIZER_FILES, resolve_model_dir
from ecomla.io.publish import publish


class ModelSetupError(UserError, ValueError):
    """Student, teacher or tokenizer do not fit together."""


def load_tokenizer(path: str):
    try:
        return AutoTokenizer.from_pretrained(resolve_model_dir(path))
    except Exception as err:
        raise ModelSetupError(f"tokenizer: cannot load one from {path} ({type(err).__name__}: {err})") from err


def load_causal_lm(path: str, dtype: torch.dtype, what: str, attn_implementation: str | None = None):
    """`attn_implementation`: None for transformers' default, "eager" where attention probabilities are needed."""
    try:
        return AutoModelForCausalLM.from_pretrained(resolve_model_dir(path), dtype=dtype,
                                                    attn_implementation=attn_implementation)
    except Exception as err:
        raise ModelSetupError(f"{what}: cannot load {path} ({type(err).__name__}: {err})") from err


def build_from_config(config: dict, dtype: torch.dtype):
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ModelSetupError("student_config: needs a model_type (e.g. llama, deepseek_v3)")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=dtype)


def check_pair(student_cfg, teacher_cfg, student_tok, teacher_tok) -> list[str]:
    """Student and teacher must predict over the same vocabulary with the same tokenizer."""
    problems = []
    if student_cfg.vocab_size != teacher_cfg.vocab_size:
        problems.append(
            f"teacher: vocab size {teacher_cfg.vocab_size} differs from the student's {student_cfg.vocab_size}; "
            "KD needs the same tokenizer and output vocabulary"
        )
    if teacher_tok is not None and student_tok.get_vocab() != teacher_tok.get_vocab():
        problems.append("teacher: its tokenizer differs from the student's (token to id maps differ)")
    return problems


def check_layers(student_cfg, source_cfg, what: str, path: str, heads: bool = False) -> str | None:
    """ILD pairs each student layer with its source's: the same number of layers of the same width (and, with
    `heads`, for attention maps, the same number of query heads)."""
    want = (student_cfg.num_hidden_layers, student_cfg.hidden_size)
    have = (source_cfg.num_hidden_layers, source_cfg.hidden_size)
    if heads and want == have and student_cfg.num_attention_heads != source_cfg.num_attention_heads:
        return (f"{what}: {path} has {source_cfg.num_attention_heads} query heads, the student "
                f"{student_cfg.num_attention_heads}; loss.ild_target attention_map pairs them head by head")
    if want != have:
        return (f"{what}: {path} has {have[0]} layers of width {have[1]}, the student {want[0]} of width {want[1]}; "
                "intermediate-layer distillation needs the model the student was converted from (set "
                "teacher.ild_model to it)")
    return None


def untrainable_student(path: str | None, mode: str) -> str | None:
    """Why a student cannot be trained in train.mode `mode` (None: it can): LoRA on a linear latent."""
    if path is None or mode != "lora":
        return None
    try:
        config = AutoConfig.from_pretrained(resolve_model_dir(path))
    except Exception:  # noqa: BLE001 - loading the student reports it properly, with its own message
        return None
    if layout.linear_latent_of(config, path) is not None:
        return f"student {path}: {layout.LINEAR_LATENT_LORA}"
    return None


class NaturalScale(torch.nn.Module):
    """A parametrization weight = natural · s (s per row, powers of two): the optimizer sees and trains
    `natural`, the tensor at the size it would have in a normalized-latent model, while the model computes
    with the stored weight. Powers of two make stored → natural → stored exact in every float format."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale, persistent=False)  # (rows,)

    def factor(self, like: torch.Tensor) -> torch.Tensor:
        return self.scale.to(like.dtype).view(-1, *[1] * (like.dim() - 1))  # (rows, 1, ...)

    def forward(self, natural: torch.Tensor) -> torch.Tensor:
        if natural.numel() == 0:  # a ZeRO-3 partitioned placeholder read outside a forward (e.g. by repr)
            return natural
        return natural * self.factor(natural)


def natural_scales(config, path: str | None) -> dict[str, torch.Tensor]:
    """Per-row scales (powers of two) of the student's parameters stored off their natural size, by name; empty
    unless the checkpoint is a linear latent (its config records it, or an older one's conversion report)."""
    linear = layout.linear_latent_of(config, path)
    if linear is None:
        return {}
    return {n: torch.exp2(torch.round(torch.log2(s))) for n, s in linear.stored_scales(config).items()}


def train_at_natural_scale(model, scales: dict[str, torch.Tensor], zero3: bool) -> None:
    """Divide each named parameter by its scale and register `NaturalScale` on it, in place: from here on the
    parameter (now `<module>.parametrizations.<name>.original`) holds the natural weights that AdamW trains.

    Under ZeRO-3 each parameter is gathered for the division (rank 0's result is kept)."""
    from torch.nn.utils import parametrize

    for name, scale in scales.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        ctx = contextlib.nullcontext()
        if zero3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters([param], modifier_rank=0)
        with ctx, torch.no_grad():
            param.div_(scale.to(param.dtype).view(-1, *[1] * (param.dim() - 1)))
        # unsafe: no trial call, which a ZeRO-3 parameter (partitioned, empty here) could not answer
        parametrize.register_parametrization(module, attr, NaturalScale(scale), unsafe=True)


def natural_parameter(model, name: str) -> torch.nn.Parameter:
    """The trainable tensor behind parameter `name` (its natural-scale original when `NaturalScale` wraps it)."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "parametrizations") and attr in module.parametrizations:
        return module.parametrizations[attr].original
    return getattr(module, attr)


def stock_name(name: str) -> str:
    """A parameter's name as the checkpoint stores it (`a.parametrizations.weight.original` -> `a.weight`)."""
    return name.replace(".parametrizations.", ".").removesuffix(".original")


def stock_state_dict(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's state_dict) under the stock names: each natural-scale original multiplied back by its
    scale, as `<module>.<name>`, so the checkpoint is what transformers and the engines load."""
    marker = ".parametrizations."
    out = {}
    for key, value in state.items():
        if marker not in key:
            out[key] = value
            continue
        module_name, rest = key.split(marker, 1)
        attr, tail = rest.split(".", 1)
        if tail != "original":
            raise ValueError(f"{key}: only single-tensor parametrizations are exported")
        wrap = model.get_submodule(module_name).parametrizations[attr][0]
        out[f"{module_name}.{attr}"] = value * wrap.factor(value).to(value.device)
    return out


def freeze_rows(param: torch.nn.Parameter, rows: int) -> None:
    """Zero the gradient of `param`'s first `rows` rows in backward, so AdamW leaves them where they are."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:rows] = 0
        return grad

    param.register_hook(hook)


def adamw_groups(params: Sequence[torch.nn.Parameter], stage_of: Sequence[int | None],
                 lr_of: Sequence[float] | None = None) -> list[dict]:
    """AdamW parameter groups, one per (first stage, lr multiplier), each with its `first_stage` (the trainer
    zeroes the lr of a group until its stage starts) and `lr_multiplier`."""
    lr_of = list(lr_of) if lr_of is not None else [1.0] * len(params)
    keys = list(zip(stage_of, lr_of))
    groups = []
    for first, mult in sorted({k for k in keys if k[0] is not None}):
        groups.append({"params": [p for p, k in zip(params, keys) if k == (first, mult)], "first_stage": first,
                       "lr_multiplier": mult})
    return groups


def matches(name: str, pattern: str) -> bool:
    """A parameter name against a recipe pattern: 'all', 'attention' (self_attn), or a substring."""
    if pattern == "all":
        return True
    if pattern == "attention":
        return ".self_attn." in name
    return pattern in name


def stage_groups(names: Sequence[str], stages: Sequence[Sequence[str]]) -> list[int | None]:
    """For each parameter, the first stage whose patterns match it ('all', 'attention', or a substring).

    None: no stage trains it, so it stays frozen for the whole run.
    """
    return [next((i for i, pats in enumerate(stages) if any(matches(n, p) for p in pats)), None) for n in names]


def lr_multipliers(names: Sequence[str], multipliers: dict[str, float]) -> list[float]:
    """For each parameter, the multiplier of the first pattern it matches (1 when none does)."""
    return [next((m for p, m in multipliers.items() if matches(n, p)), 1.0) for n in names]


def apply_lora(model, lora):
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in present]
    if missing:
        raise ModelSetupError(f"train.lora.target_modules: {missing} not in the student (it has e.g. {sorted(present)[:8]})")
    cfg = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules))
    return get_peft_model(model, cfg)


def export_model(model, state_dict: dict[str, torch.Tensor], out: Path, tokenizer_dir: Path | None, lora: bool) -> Path:
    """Write a consolidated HF checkpoint (rank 0 only) atomically; LoRA adapters are merged first."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora:
        # Merge on a plain CPU copy: load the gathered adapter weights, fold them in, drop PEFT.
        from peft import get_peft_model

        base = model.get_base_model()
        merged = base.__class__(base.config).to(next(iter(state_dict.values())).dtype)

        clone = get_peft_model(merged, model.peft_config["default"])
        clone.load_state_dict(state_dict, strict=True)
        clone = clone.merge_and_unload()
        clone.save_pretrained(tmp)
    else:
        model.save_pretrained(tmp, state_dict=stock_state_dict(model, state_dict))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    return publish(tmp, out)
