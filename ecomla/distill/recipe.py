"""The `ecomla distill` / `ecomla pretrain` / `ecomla teacher-cache` / `ecomla prepare-data` recipe.

One recipe describes a training run: the student, the teacher (a live model or
a cache of its top-k log-probs), the data, the loss, what trains, the
optimizer, DeepSpeed, checkpoints and logging. `ecomla pretrain` is the same
loop with the loss set to CE only and the student built from a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ecomla.distill.losses import KDLoss, LossConfig
from ecomla.recipe.schema import knob


@dataclass
class DataSource:
    """Training or evaluation text: a prepared shard directory, or a text/chat dataset packed in memory."""

    prepared: str | None = knob(None, help="Directory written by `ecomla prepare-data` (memory-mapped shards)")
    dataset: str | None = knob(
        None, help="Local .jsonl/.json/.txt/.parquet file or directory, a hub dataset name, tinyworld:SPLIT"
        "[:DOMAIN] (the generated tiny-world corpus; needs max_documents) or pytext:SPLIT[:DOMAIN] (the installed "
        "Python's prose and stdlib code, DOMAIN prose/code); tokenized at start-up"
    )
    text_field: str = knob("text", help="Field with the text (format=text)")
    messages_field: str = knob("messages", help="Field with the chat messages (format=chat)")
    split: str = knob("train", help="Split of a hub dataset")
    subset: str | None = knob(None, help="Configuration of a hub dataset")
    format: Literal["text", "chat"] = knob(
        "text", help="text: every token is a target. chat: messages rendered with the chat template, prompt masked"
    )
    max_documents: int | None = knob(None, help="Read at most this many documents (null: all)")
    max_tokens: int | None = knob(
        None, help="Read at most this many tokens, the last document cut short (null: all); with mix, the share "
        "of each source in a fixed mixture"
    )
    document_tokens: int | None = knob(
        None, help="Keep the first this many tokens of each document (null: whole documents): a token budget "
        "then spans more documents, instead of a few long ones filling it"
    )
    mix: list[DataSource] = knob(
        default_factory=list, help="More text sources packed with this one, in order, each a mapping of dataset "
        "and its own field/format/max_documents/max_tokens/document_tokens: a fixed mixture, e.g. all of a small domain and a "
        "slice of a large one (training order is shuffled anyway)"
    )

    def check(self) -> list[str]:
        from ecomla.data.text import is_endless

        if (self.prepared is None) == (self.dataset is None):
            return ["prepared: set exactly one of prepared and dataset"]
        if self.max_documents is not None and self.max_documents < 1:
            return ["max_documents: must be at least 1 (null: all)"]
        if self.max_tokens is not None and self.max_tokens < 1:
            return ["max_tokens: must be at least 1 (null: all)"]
        if self.document_tokens is not None and self.document_tokens < 1:
            return ["document_tokens: must be at least 1 (null: whole documents)"]
        if self.document_tokens is not None and self.format == "chat":
            return ["document_tokens: a chat's first tokens are mostly its prompt, which trains nothing; cap chats "
                    "with max_documents or max_tokens"]
        if self.prepared is not None:
            capped = [k for k in ("max_documents", "max_tokens", "document_tokens") if getattr(self, k) is not None]
            if capped:
                return [f"{capped[0]}: a prepared shard directory is read whole; set the caps in the recipe that "
                        "`ecomla prepare-data` packs it from, or give the dataset here"]
        if is_endless(self.dataset) and self.max_documents is None and self.max_tokens is None:
            return [f"max_documents: {self.dataset} is an endless generated stream; set how many documents to read"]
        if self.mix and self.prepared is not None:
            return ["mix: a prepared shard directory is already one mixture; pack the mixture with "
                    "`ecomla prepare-data` (its recipe's data.train with this mix) and point prepared at it"]
        problems = []  # each part's own check() already ran when the recipe loader built it
        for i, part in enumerate(self.mix):
            if part.mix:
                problems.append(f"mix[{i}].mix: list every source in the top-level mix; mixes do not nest")
            elif part.prepared is not None:
                problems.append(f"mix[{i}].prepared: a mix part is tokenized at start-up; give its dataset")
        return problems


@dataclass(kw_only=True)
class DataConfig:
    train: DataSource = knob(help="Training data")
    eval: DataSource | None = knob(None, help="Held-out data for periodic KL/CE evaluation (null: none)")
    seq_len: int = knob(2048, help="Tokens per packed sequence (documents are packed whole, never across sequences)")
    cross_document_attention: bool = knob(
        False, help="false: a block-diagonal mask keeps packed documents from attending to each other"
    )

    def check(self) -> list[str]:
        return [] if self.seq_len >= 2 else ["seq_len: must be at least 2"]


@dataclass
class TeacherConfig:
    """The teacher: a live model, or a cache of its top-k log-probs written by `ecomla teacher-cache`."""

    source: Literal["live", "cache", "none"] = knob(
        "live", help="live: run the teacher every step. cache: read top-k log-probs from cache_dir. none: no teacher"
    )
    model: str | None = knob(None, help="Teacher checkpoint (local directory or hub name); same tokenizer as the student")
    cache_dir: str | None = knob(None, help="Where `ecomla teacher-cache` writes and `source: cache` reads")
    ild_model: str | None = knob(
        None, help="loss.ild_weight > 0: the model whose layers the student's are matched to, the one it was "
        "converted from (same layers and width). null: teacher.model (then one live forward serves KD and ILD)"
    )
    cache_topk: int = knob(64, help="Log-probs kept per token in the cache; the rest is one tail bucket")
    dtype: Literal["auto", "float32", "bfloat16"] = knob("auto", help="auto: bf16 when the run is bf16, else fp32")


@dataclass
class StageConfig:
    trainable: list[str] = knob(
        default_factory=lambda: ["all"],
        help="Parameter name patterns that train in this stage ('all', 'attention' for self_attn, or substrings)",
    )
    fraction: float = knob(1.0, help="Share of the run's steps spent in this stage")


@dataclass
class LoraConfig:
    r: int = knob(16, help="LoRA rank")
    alpha: float = knob(32.0, help="LoRA alpha")
    dropout: float = knob(0.0, help="LoRA dropout")
    target_modules: list[str] = knob(
        default_factory=lambda: ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        help="Module names that get adapters (DeepSeek-V3 MLA names by default)",
    )


@dataclass(kw_only=True)
class TrainConfig:
    mode: Literal["full", "stages", "lora"] = knob(
        "full", help="full: all parameters. stages: the `stages` schedule. lora: PEFT adapters, merged at export"
    )
    stages: list[StageConfig] = knob(default_factory=list, help="mode=stages: e.g. attention first, then all")
    lora: LoraConfig = knob(default_factory=LoraConfig, help="mode=lora settings")
    latent_basis: Literal["train", "freeze"] = knob(
        "train", help="A linear-latent student's latent basis (the first kv_lora_rank rows of kv_a_proj_with_mqa): "
        "train it at its natural size like every other scaled tensor, or freeze it (only kv_b_proj and the rest "
        "learn). Other students have no such rows"
    )
    lr_multipliers: dict[str, float] = knob(
        default_factory=dict, help="Per-group learning rates: parameter name pattern ('attention' for self_attn, "
        "or a substring such as mlp or embed_tokens) -> multiplier of train.lr; the first pattern a parameter "
        "matches wins, the others take lr itself. ecomla's recovery recipe (docs/recovery.md) takes lr 3e-4 with "
        "{kv_b_proj: 0.1, kv_a_proj: 0.3, mlp: 0.3}: the up-projection, the latent basis and the MLPs need smaller "
        "steps than the rest"
    )
    total_tokens: int = knob(help="Tokens to train on (the step count is derived from the global batch)")
    global_batch_tokens: int = knob(393216, help="Tokens per optimizer step over all ranks (X-EcoMLA: 192 × 2048)")
    micro_batch_size: int = knob(4, help="Sequences per rank per forward pass")
    lr: float = knob(8e-5, help="Peak learning rate (X-EcoMLA, 1B student: 8e-5)")
    min_lr_ratio: float = knob(0.0, help="Cosine decays to lr × this")
    warmup_ratio: float = knob(0.01, help="Share of steps with linear warmup (X-EcoMLA: 1%)")
    weight_decay: float = knob(0.0, help="AdamW weight decay")
    betas: list[float] = knob(default_factory=lambda: [0.9, 0.95], help="AdamW betas")
    grad_clip: float = knob(1.0, help="Gradient-norm clipping (0: off)")
    precision: Literal["bf16", "fp32"] = knob("bf16", help="Training precision (bf16 weights with fp32 master copies)")
    gradient_checkpointing: bool = knob(False, help="Recompute activations in backward to save memory")
    seed: int = knob(0, help="Seed for data order and initialization")

    def check(self) -> list[str]:
        problems = []
        if self.total_tokens <= 0:
            problems.append("total_tokens: must be > 0")
        if self.mode == "stages" and not self.stages:
            problems.append("stages: mode=stages needs at least one stage")
        if self.stages and abs(sum(s.fraction for s in self.stages) - 1.0) > 1e-6:
            problems.append("stages: fractions must sum to 1")
        if len(self.betas) != 2:
            problems.append("betas: two values")
        if self.micro_batch_size < 1:
            problems.append("micro_batch_size: must be >= 1")
        problems += [f"lr_multipliers.{k}: must be >= 0, got {v}" for k, v in self.lr_multipliers.items() if not v >= 0]
        return problems


@dataclass
class DeepSpeedConfig:
    zero_stage: int = knob(2, help="ZeRO stage 0-3")
    config: str | None = knob(None, help="A JSON file of DeepSpeed settings (e.g. recipes/deepspeed/zero3.json)")
    overrides: dict[str, Any] = knob(default_factory=dict, help="Settings merged over `config` (nested keys)")

    def check(self) -> list[str]:
        return [] if self.zero_stage in (0, 1, 2, 3) else ["zero_stage: must be 0, 1, 2 or 3"]


@dataclass
class CheckpointConfig:
    every_steps: int = knob(500, help="Save a resumable checkpoint every N optimizer steps (0: only at the end)")
    keep_last: int = knob(2, help="Resumable checkpoints kept")


@dataclass
class LogConfig:
    every_steps: int = knob(1, help="Log metrics every N steps")
    eval_every_steps: int = knob(0, help="Evaluate KL/CE on data.eval every N steps (0: only at the end)")
    eval_batches: int = knob(8, help="Micro-batches per evaluation")
    tensorboard: bool = knob(True, help="Write TensorBoard logs when tensorboard is installed")
    wandb_project: str | None = knob(None, help="Also log to this W&B project when wandb is installed")


# `ecomla pretrain` is this recipe with the loss fixed to next-token CE and no teacher: these overrides go
# before the user's own `--set`s (the CLI and `ecomla variants` apply them alike).
PRETRAIN_DEFAULTS = ["loss.kind=none", "loss.kd_weight=0.0", "loss.ce_weight=1.0", "teacher.source=none"]


@dataclass(kw_only=True)
class DistillRecipe:
    """A training run. Launch: `deepspeed --module ecomla.distill R.yaml`, `torchrun -m ecomla.distill R.yaml`, or `ecomla distill R.yaml`."""

    student: str | None = knob(None, help="Student checkpoint: a converted stock DeepSeek-V3 model or any HF causal LM")
    student_config: dict[str, Any] | None = knob(
        None, help="`ecomla pretrain`: a transformers config dict (with model_type) to build the student from scratch"
    )
    tokenizer: str | None = knob(None, help="Tokenizer directory (default: the student's, else the teacher's)")
    teacher: TeacherConfig = knob(default_factory=TeacherConfig, help="The teacher")
    data: DataConfig = knob(help="Training and evaluation data")
    loss: LossConfig = knob(default_factory=LossConfig, help="The loss")
    train: TrainConfig = knob(help="What trains, and how")
    deepspeed: DeepSpeedConfig = knob(default_factory=DeepSpeedConfig, help="DeepSpeed settings")
    checkpoint: CheckpointConfig = knob(default_factory=CheckpointConfig, help="Resumable checkpoints")
    log: LogConfig = knob(default_factory=LogConfig, help="Logging and evaluation")
    output_dir: str = knob(help="Run directory: checkpoints/, logs, metrics.jsonl, and the exported model in final/")

    def check(self) -> list[str]:
        problems = []
        if (self.student is None) == (self.student_config is None):
            problems.append("student: set exactly one of student (a checkpoint) and student_config (pretraining)")
        wants_kd = self.loss.kind != KDLoss.NONE and self.loss.kd_weight > 0
        if wants_kd and self.teacher.source == "none":
            problems.append(f"teacher.source: loss.kind={self.loss.kind.value} needs a teacher (live or cache)")
        if self.teacher.source == "live" and wants_kd and not self.teacher.model:
            problems.append("teacher.model: a live teacher needs a checkpoint")
        if self.teacher.source == "cache" and not self.teacher.cache_dir:
            problems.append("teacher.cache_dir: source=cache needs the cache directory")
        if self.train.mode == "lora" and self.student is None:
            problems.append("train.mode: lora needs a pretrained student checkpoint")
        if self.loss.uses_ild and not (self.teacher.ild_model or self.teacher.model):
            problems.append("teacher.ild_model: loss.ild_weight > 0 needs the model the student was converted from "
                            "(set teacher.ild_model, or teacher.model when the teacher is that model)")
        if self.loss.uses_ild and self.loss.ild_inputs.value == "source" and self.train.gradient_checkpointing:
            problems.append("loss.ild_inputs: source feeds each layer through hooks that recomputation in backward "
                            "would not see; turn train.gradient_checkpointing off for it")
        return problems


def load_distill_recipe(path: str, overrides: list[str] | None = None, *, pretrain: bool = False) -> DistillRecipe:
    """A distill recipe from YAML plus `--set` overrides; `pretrain` puts PRETRAIN_DEFAULTS under them."""
    from ecomla.recipe.schema import load_recipe

    return load_recipe(DistillRecipe, path, overrides=(PRETRAIN_DEFAULTS if pretrain else []) + list(overrides or []))
