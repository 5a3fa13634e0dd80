"""Student and teacher models of a training run: loading, checks, trainable groups and the final export.

Both are stock Hugging Face causal LMs loaded with `from_pretrained` (or built
with `from_config` for pretraining), so under ZeRO-3 they are partitioned at
construction with their weight initialization intact (the caller keeps an
`HfDeepSpeedConfig` alive while they are built).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ecomla.convert.recipe import LINEAR_LATENT_LORA, linear_latent
from ecomla.errors import UserError
from ecomla.io.checkpoint import TOKENIZER_FILES, resolve_model_dir
from ecomla.mla import latent


class ModelSetupError(UserError, ValueError):
    """Student, teacher or tokenizer do not fit together."""


def load_tokenizer(path: str):
    try:
        return AutoTokenizer.from_pretrained(resolve_model_dir(path))
    except Exception as err:
        raise ModelSetupError(f"tokenizer: cannot load one from {path} ({type(err).__name__}: {err})") from err


def load_causal_lm(path: str, dtype: torch.dtype, what: str):
    try:
        return AutoModelForCausalLM.from_pretrained(resolve_model_dir(path), dtype=dtype)
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


def _conversion_report(path: str | None) -> dict | None:
    """An `ecomla convert` output's conversion report (None: a hub name or another tool's checkpoint)."""
    file = Path(path).expanduser() / "conversion_report.json" if path else None
    if file is None or not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def untrainable_student(path: str | None, mode: str) -> str | None:
    """Why an `ecomla convert` output cannot be trained in train.mode `mode` (None: it can)."""
    report = _conversion_report(path)
    if report is not None and linear_latent(report) and mode == "lora":
        return f"student {path}: {LINEAR_LATENT_LORA}"
    return None


@dataclass(frozen=True)
class StoredScale:
    """A parameter stored at `scale` × its natural size, whose first `frozen_rows` rows never train."""

    scale: float
    frozen_rows: int = 0


def stored_scales(path: str | None, config) -> dict[str, StoredScale]:
    """The parameters of a linear-latent student (its conversion report says `mla.latent_norm: linear`) that
    are stored off their natural scale, by name; empty for any other model.

    The latent's scale a ≈ 1e-5 is split between the input gain γ (input_layernorm, ≈ 1e-3) and the latent
    rows of kv_a_proj_with_mqa, and the query and RoPE-key rows, which read the same input, are stored ×1/γ.
    AdamW moves an entry by about lr per step whatever its size, so the trainer gives each such tensor
    lr·s, eps/s and weight_decay/s: AdamW on s·w is then AdamW on w itself. The latent rows (stored at γ, in
    the same tensor as the RoPE-key rows at 1/γ) cannot share one scale, so they are frozen: the fitted
    latent basis stays, and kv_b_proj learns on top of it.
    """
    report = _conversion_report(path)
    if report is None or not linear_latent(report):
        return {}
    gain = latent.linear_input_gain(config.kv_lora_rank, config.hidden_size)
    query = "q_a_proj" if getattr(config, "q_lora_rank", None) else "q_proj"
    scales = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        scales[layer + "input_layernorm.weight"] = StoredScale(gain)
        scales[layer + f"self_attn.{query}.weight"] = StoredScale(1 / gain)
        scales[layer + "self_attn.kv_a_proj_with_mqa.weight"] = StoredScale(1 / gain, frozen_rows=config.kv_lora_rank)
    return scales


def freeze_rows(param: torch.nn.Parameter, rows: int) -> None:
    """Zero the gradient of `param`'s first `rows` rows in backward, so AdamW leaves them where they are."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[:rows] = 0
        return grad

    param.register_hook(hook)


def adamw_groups(params: Sequence[torch.nn.Parameter], names: Sequence[str], stage_of: Sequence[int],
                 scales: dict[str, StoredScale], weight_decay: float, eps: float = 1e-8) -> list[dict]:
    """AdamW parameter groups, one per (first stage, stored scale), each with its `first_stage` and `lr_scale`.

    A group of parameters stored at scale s gets eps/s and weight_decay/s (its lr is multiplied by s each step),
    so its updates are those of the same parameters at their natural size.
    """
    keys = [(g, scales[n].scale if n in scales else 1.0) for n, g in zip(names, stage_of)]
    groups = []
    for first, s in sorted({k for k in keys if k[0] is not None}):
        members = [p for p, k in zip(params, keys) if k == (first, s)]
        groups.append({"params": members, "first_stage": first, "lr_scale": s, "eps": eps / s,
                       "weight_decay": weight_decay / s})
    return groups


def stage_groups(names: Sequence[str], stages: Sequence[Sequence[str]]) -> list[int | None]:
    """For each parameter, the first stage whose patterns match it ('all', 'attention', or a substring).

    None: no stage trains it, so it stays frozen for the whole run.
    """

    def matches(name: str, pattern: str) -> bool:
        if pattern == "all":
            return True
        if pattern == "attention":
            return ".self_attn." in name
        return pattern in name

    return [next((i for i, pats in enumerate(stages) if any(matches(n, p) for p in pats)), None) for n in names]


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
        model.save_pretrained(tmp, state_dict=state_dict)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = tokenizer_dir / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
