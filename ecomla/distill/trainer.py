"""The project's only training loop: knowledge distillation (and, with CE only, pretraining) on DeepSpeed.

    deepspeed --num_gpus 8 --module ecomla.distill RECIPE.yaml [--set ...]
    torchrun --nproc_per_node 2 -m ecomla.distill RECIPE.yaml
    ecomla distill RECIPE.yaml        # one process, no launcher
    ecomla pretrain RECIPE.yaml       # CE only, student built from student_config

One recipe class, `DistillRun`, with `setup()`, `train()`, `save_checkpoint()`
and `export()`. Everything that can be wrong with the input (recipe, data,
batch arithmetic, vocabularies) fails in `setup()` before any compute.

Per step: the step's micro-batches come from a deterministic, resumable
sampler; the loss of each micro-batch is a SUM over its target tokens scaled by
world·accum/N_step, so after DeepSpeed's averaging over ranks and accumulation
the gradient is that of the mean over every target token of the step (not of
per-sequence means). Logits are computed in chunks inside the loss. A NaN or inf
loss on any rank stops the run before the optimizer sees it; the last
checkpoint stays the last good one.

Trainable sets (full, stage schedule, LoRA) are parameter groups whose LR is
zero while frozen, so one DeepSpeed engine serves the whole run under every
ZeRO stage, and the schedule is a pure function of the step (exact resume).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ecomla.convert import layout
from ecomla.data.packing import target_mask
from ecomla.data.sampler import StepSampler
from ecomla.distill import models
from ecomla.distill.data import model_inputs, open_dataset
from ecomla.distill.ds_config import build_ds_config, teacher_ds_config
from ecomla.distill.layers import LayerCatch
from ecomla.distill.losses import (ILDInputs, ILDTarget, KDLoss, LossConfig, LossSums, attention_kl_per_token,
                                   chunked_loss, ild_per_token)
from ecomla.distill.monitor import RunLog
from ecomla.distill.recipe import DistillRecipe
from ecomla.distill.runtime import Dist, all_reduce_max, all_reduce_sum, barrier, init_distributed
from ecomla.distill.teacher import CachedTeacher, LiveTeacher, teacher_dtype
from ecomla.errors import UserError
from ecomla.recipe.schema import recipe_to_dict, save_recipe


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (bad input found at set-up, or a non-finite loss)."""


def write_latest(ckpt_dir: Path, tag: str) -> None:
    """Point `ckpt_dir/latest` at `tag` in one rename, so a reader (or a kill) sees the old tag or the new, never half."""
    tmp = ckpt_dir / "latest.tmp"
    tmp.write_text(tag + "\n")
    tmp.replace(ckpt_dir / "latest")


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag a resume starts from, or None for a fresh run; a `latest` that names no whole checkpoint is an error."""
    latest = ckpt_dir / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if not tag or not (ckpt_dir / tag / "trainer_state.json").is_file():
        whole = sorted(p.name for p in ckpt_dir.glob("step_*") if (p / "trainer_state.json").is_file())
        what = "is empty" if not tag else f"names {tag!r}, which holds no trainer_state.json"
        hint = (f"write the tag to resume from into it (checkpoints here: {', '.join(whole)})" if whole
                else "no checkpoint here can be resumed")
        raise TrainingError(f"{latest} {what} (a run killed while saving, by an older ecomla); {hint}, "
                            f"or pass --force to start over")
    return tag


class NonFiniteLoss(TrainingError):
    pass


def lr_at(step: int, total: int, peak: float, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup over ceil(warmup_ratio·total) steps, then cosine decay to peak·min_ratio."""
    warm = math.ceil(warmup_ratio * total)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def local_grad_norm(model) -> float:
    """The 2-norm of every gradient the model holds (whole tensors: ZeRO-0), before clipping."""
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def peak_memory_gib(device: torch.device) -> float:
    """The run's peak memory so far: allocated on a CUDA device, else this process's maximum RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def batch_loss(student, teacher, batch: dict, indices: list[int], spec: LossConfig, *, cross_document: bool,
               dtype: torch.dtype, device: torch.device, chunk_tokens: int, sync_chunks: torch.device | None = None,
               ild_source=None):
    """Loss sums of one packed micro-batch (B, T): only target positions (same document, not padding, not
    prompt) reach the loss, and logits are computed `chunk_tokens` rows at a time.

    `teacher`: a LiveTeacher or CachedTeacher, or None (no KD term and nothing to log it with). `ild_source`
    (with spec.ild_weight > 0): the model whose layers ILD matches, or the string "teacher" when the live
    teacher is that model (one forward serves both). With ILD alone (no KD or CE weight), KD and CE are still
    computed, without gradient, for the log.

    `sync_chunks` (ZeRO-3 with several ranks): every head call gathers the head's weight collectively, so all
    ranks make the same number of calls, the largest any rank needs.
    """
    mi = model_inputs(batch, cross_document, dtype, device)
    valid = mi["valid"]
    source = None
    if spec.uses_ild:
        source = LayerCatch(spec.ild_target, inputs=spec.ild_inputs is ILDInputs.SOURCE)
    teacher_fn = None
    if teacher is not None:
        teacher_fn = teacher.prepare(mi["inputs"], valid, indices, catch=source if ild_source == "teacher" else None)
    if source is not None and ild_source != "teacher":
        with torch.no_grad(), source.on(ild_source):
            ild_source.get_decoder()(**mi["inputs"])
    mine = None
    if source is not None:
        mine = LayerCatch(spec.ild_target, feed=source.inputs if spec.ild_inputs is ILDInputs.SOURCE else None)
    with mine.on(student) if mine is not None else contextlib.nullcontext():
        hidden = student.get_decoder()(**mi["inputs"]).last_hidden_state[valid]  # (N, d)
    num_chunks = None
    if sync_chunks is not None:
        num_chunks = max(1, all_reduce_max(math.ceil(hidden.shape[0] / chunk_tokens), sync_chunks))
    head, targets = student.get_output_embeddings(), mi["targets"][valid]
    if spec.trains_output:
        sums = chunked_loss(hidden, head, teacher_fn, targets, spec, chunk_tokens, checkpoint=spec.recompute,
                            num_chunks=num_chunks)
    else:  # ILD alone: the output terms only for the log
        logged = LossConfig(kind=spec.kind if teacher_fn is not None else KDLoss.NONE, temperature=spec.temperature,
                            mix=spec.mix, kd_weight=1.0 if teacher_fn is not None else 0.0, ce_weight=1.0)
        with torch.no_grad():
            sums = chunked_loss(hidden.detach(), head, teacher_fn, targets, logged, chunk_tokens, checkpoint=False,
                                num_chunks=num_chunks)
    if source is None:
        return sums
    per_token = attention_kl_per_token if spec.ild_target is ILDTarget.ATTENTION_MAP else ild_per_token
    ild = per_token(mine.rows(valid), source.rows(valid)).sum()
    total = spec.ild_weight * ild if not spec.trains_output else sums.total + spec.ild_weight * ild
    return LossSums(total, sums.kd, sums.ce, sums.tokens, ild=ild)


class DistillRun:
    """One training run of a recipe: `setup()`, then `train()`, which checkpoints and exports."""

    def __init__(self, recipe: DistillRecipe, *, force: bool = False, progress: bool = True, on_step=None):
        self.recipe = recipe
        self.on_step = on_step  # on_step(steps_done, student) after every optimizer step, e.g. to measure it
        self.force = force
        self.progress = progress
        self.out = Path(recipe.output_dir)
        self.ckpt_dir = self.out / "checkpoints"

    # ---- set-up: every check before any compute ------------------------------------------------------
    def setup(self) -> None:
        r = self.recipe
        self.dist: Dist = init_distributed()
        dist = self.dist
        if self.force and dist.is_main and self.out.exists():
            shutil.rmtree(self.out)
        barrier()
        tok_path = r.tokenizer or r.student or r.teacher.model
        if tok_path is None:
            raise TrainingError("tokenizer: set `tokenizer` (pretraining has no student checkpoint to take it from)")
        problem = models.untrainable_student(r.student, r.train.mode)
        if problem:
            raise TrainingError(problem)
        self.tokenizer = models.load_tokenizer(tok_path)
        self.tokenizer_dir = Path(tok_path) if Path(tok_path).is_dir() else None
        T = r.data.seq_len
        self.train_data = open_dataset(r.data.train, self.tokenizer, T, "data.train", r.output_dir)
        self.eval_data = open_dataset(r.data.eval, self.tokenizer, T, "data.eval", r.output_dir) if r.data.eval else None

        if dist.is_main:
            for name, ds in (("train", self.train_data), ("eval", self.eval_data)):
                if ds is not None:
                    where = f"prepared shards in {ds.dir}" if hasattr(ds, "dir") else "packed in memory"
                    print(f"data.{name}: {len(ds)} sequences of {T} tokens ({where})", flush=True)
        seqs_per_step, rem = divmod(r.train.global_batch_tokens, T)
        per_pass = r.train.micro_batch_size * dist.world_size
        if rem or seqs_per_step % per_pass:
            raise TrainingError(
                f"train.global_batch_tokens: {r.train.global_batch_tokens} tokens = {r.train.global_batch_tokens / T:g} "
                f"sequences of {T}, which must be a whole multiple of micro_batch_size × world size = "
                f"{r.train.micro_batch_size} × {dist.world_size} = {per_pass}"
            )
        self.grad_accum = seqs_per_step // per_pass
        self.total_steps = r.train.total_tokens // r.train.global_batch_tokens
        if self.total_steps < 1:
            raise TrainingError(f"train.total_tokens: {r.train.total_tokens} is less than one global batch")
        self.sampler = StepSampler(len(self.train_data), r.train.micro_batch_size, self.grad_accum,
                                   dist.world_size, dist.rank, r.train.seed)
        self.spec = r.loss
        self.dtype = torch.bfloat16 if r.train.precision == "bf16" else torch.float32
        self.ds_config = build_ds_config(r, dist.world_size, self.grad_accum)
        self._build_models()

    def _build_models(self) -> None:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        r, dist = self.recipe, self.dist
        # Alive while models are built: ZeRO-3 partitions them at construction, weight init intact.
        self._hf_ds = HfDeepSpeedConfig(self.ds_config) if r.deepspeed.zero_stage == 3 else None
        torch.manual_seed(r.train.seed)
        # attention maps for ILD: only eager attention forms them, in every model the ILD term reads
        attn = "eager" if self.spec.uses_ild and self.spec.ild_target is ILDTarget.ATTENTION_MAP else None
        if r.student is not None:
            student = models.load_causal_lm(r.student, self.dtype, "student", attn)
        else:
            student = models.build_from_config(r.student_config, self.dtype)
        teacher_model = ild_model = None
        self.teacher = None
        # ILD matches the layers of the student's source: the live teacher itself when it is that model (one
        # forward serves both), else a frozen model of its own.
        ild_path = (r.teacher.ild_model or r.teacher.model) if self.spec.uses_ild else None
        self.ild_source = None
        shared = ild_path is not None and r.teacher.source == "live" and ild_path == r.teacher.model
        if self.spec.uses_teacher or shared:
            if r.teacher.source == "live":
                teacher_model = models.load_causal_lm(r.teacher.model, teacher_dtype(r), "teacher",
                                                      attn if shared else None).eval().requires_grad_(False)
                t_tok = models.load_tokenizer(r.teacher.model)
                problems = models.check_pair(student.config, teacher_model.config, self.tokenizer, t_tok)
                if problems:
                    raise TrainingError("; ".join(problems))
            else:
                self.teacher = CachedTeacher(r.teacher.cache_dir, self.train_data, r.loss.temperature, student.config.vocab_size)
        if ild_path is not None:
            what = "teacher.ild_model" if r.teacher.ild_model else "teacher.model (the ILD source)"
            ild_model = teacher_model if shared else \
                models.load_causal_lm(ild_path, teacher_dtype(r), what, attn).eval().requires_grad_(False)
            problem = models.check_layers(student.config, ild_model.config, what, ild_path, heads=attn is not None)
            if problem:
                raise TrainingError(problem)
        if len(self.tokenizer) > student.config.vocab_size:
            raise TrainingError(f"tokenizer: {len(self.tokenizer)} tokens, but the student's vocab is {student.config.vocab_size}")
        if r.train.gradient_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if r.train.mode == "lora":
            student = models.apply_lora(student, r.train.lora)
        # A linear-latent student stores its scale in some weights (convert/layout.py): each trains at its
        # natural size through a NaturalScale parametrization, and the layout is written into the config that
        # the export saves, also for a checkpoint that only its conversion report described.
        linear = layout.linear_latent_of(student.config, r.student)
        scales = models.natural_scales(student.config, r.student)  # a LoRA run of such a student was refused
        models.train_at_natural_scale(student, scales, zero3=r.deepspeed.zero_stage == 3)
        layout.write(student.config, linear)
        if linear is not None and r.train.latent_basis == "freeze":
            for name in scales:
                if name.endswith("kv_a_proj_with_mqa.weight"):
                    models.freeze_rows(models.natural_parameter(student, name), student.config.kv_lora_rank)
        names, params = zip(*[(models.stock_name(n), p) for n, p in student.named_parameters() if p.requires_grad])
        if r.train.mode == "stages":
            stage_of = models.stage_groups(names, [s.trainable for s in r.train.stages])
            for p, g in zip(params, stage_of):
                if g is None:  # in no stage: frozen for the whole run
                    p.requires_grad_(False)
            self.stage_bounds = np.cumsum([s.fraction for s in r.train.stages])
        else:
            stage_of = [0] * len(names)
            self.stage_bounds = np.array([1.0])
        groups = models.adamw_groups(params, stage_of, models.lr_multipliers(names, r.train.lr_multipliers))
        # fused: one pass over each tensor's weights, gradients and moments (CPU and CUDA); the per-tensor loop
        # took 6% of a CPU step on SmolLM2 (docs/benchmarks.md)
        opt = torch.optim.AdamW([{"params": g["params"]} for g in groups], lr=r.train.lr,
                                betas=tuple(r.train.betas), weight_decay=r.train.weight_decay, fused=True)
        self.group_first_stage = [g["first_stage"] for g in groups]
        self.group_lr_multiplier = [g["lr_multiplier"] for g in groups]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=student, optimizer=opt, config=self.ds_config)
        # One process under ZeRO-0 with AdamW unwrapped, fp32 gradients and no pre-division: DeepSpeed's gradient
        # all-reduce would only copy every gradient into a flat buffer and back to average it over one rank (16% of
        # a CPU step on SmolLM2), so backward runs in its `no_sync` context, and `_zero_missing_grads` does the one
        # other thing the reduction does. Anything else (more ranks, ZeRO's partitions, a precision wrapper, a
        # reduction that rounds) keeps the reduction.
        self.skip_reduce = (dist.world_size == 1 and r.deepspeed.zero_stage == 0 and self.engine.optimizer is opt
                            and self.engine.communication_data_type == torch.float32
                            and self.engine.gradient_predivide_factor() == 1.0)
        if teacher_model is not None:
            if r.deepspeed.zero_stage == 3:
                t_engine = deepspeed.initialize(model=teacher_model, config=teacher_ds_config(self.ds_config))[0]
                t_engine.eval()
                teacher_model = t_engine.module
            else:
                teacher_model = teacher_model.to(dist.device)
            self.teacher = LiveTeacher(teacher_model, r.loss.temperature)
        if ild_model is not None:
            self.ild_source = "teacher" if shared else ild_model.to(dist.device)
        self.student = self.engine.module

    # ---- the loop ------------------------------------------------------------------------------------------
    def stage_at(self, step: int) -> int:
        return int(np.searchsorted(self.stage_bounds, (step + 0.5) / self.total_steps))

    def _set_lr(self, step: int) -> float:
        t = self.recipe.train
        lr = lr_at(step, self.total_steps, t.lr, t.warmup_ratio, t.min_lr_ratio)
        stage = self.stage_at(step)
        for group, first, mult in zip(self.optimizer.param_groups, self.group_first_stage, self.group_lr_multiplier):
            group["lr"] = lr * mult if first <= stage else 0.0
        return lr

    def _loss_sums(self, batch: dict, indices: list[int], teacher=None, spec: LossConfig | None = None):
        """Loss sums of one micro-batch; `teacher`/`spec` default to the run's. A teacher also serves a run that
        trains on ILD alone, for the KD column of its log."""
        r = self.recipe
        spec = spec or self.spec
        teacher = self.teacher if teacher is None else teacher
        if not (spec.uses_teacher or (spec.uses_ild and not spec.trains_output)):
            teacher = None
        sync = self.dist.device if r.deepspeed.zero_stage == 3 and self.dist.world_size > 1 else None
        return batch_loss(self.student, teacher, batch, indices, spec,
                          cross_document=r.data.cross_document_attention, dtype=self.dtype, device=self.dist.device,
                          chunk_tokens=r.loss.chunk_tokens, sync_chunks=sync, ild_source=self.ild_source)

    def train(self) -> dict:
        r, dist = self.recipe, self.dist
        start_step = self._maybe_resume()
        if dist.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            save_recipe(r, self.out / "ecomla_recipe.yaml")
        metrics_path = self.out / "metrics.jsonl"
        logger = RunLog(self.out, r.log, dist.is_main, start_step)
        bar = tqdm(total=self.total_steps, initial=start_step, unit="step",
                   desc="distill" if r.teacher.source != "none" else "pretrain",
                   disable=not (self.progress and dist.is_main))
        tokens_per_step = r.train.global_batch_tokens
        last = {"step": start_step, "tokens": start_step * tokens_per_step}  # resumed at the very end: nothing to run
        self.engine.train()
        for step in range(start_step, self.total_steps):
            t0 = time.time()
            lr = self._set_lr(step)
            micro = [self.sampler.indices(step, j) for j in range(self.grad_accum)]
            batches = [self.train_data.batch(ix) for ix in micro]
            local_targets = sum(int(target_mask(b["segments"], b["loss_mask"]).sum()) for b in batches)
            n_step = all_reduce_sum([local_targets], dist.device)[0]
            scale = dist.world_size * self.grad_accum / max(1.0, n_step)
            sums = [0.0, 0.0, 0.0, 0.0]
            grad_norm = None
            for j, (ix, batch) in enumerate(zip(micro, batches)):
                loss_sums = self._loss_sums(batch, ix)
                finite = all_reduce_sum([float(torch.isfinite(loss_sums.total).item() is False)], dist.device)[0] == 0
                if not finite:
                    raise NonFiniteLoss(
                        f"non-finite loss at step {step}; stopped before the update. The last good checkpoint "
                        f"is in {self.ckpt_dir} (lower train.lr, or check the data)"
                    )
                with self.engine.no_sync() if self.skip_reduce else contextlib.nullcontext():
                    self.engine.backward(loss_sums.total * scale)
                if j == len(micro) - 1:  # the step's last backward
                    if self.skip_reduce:
                        self._zero_missing_grads()
                    if r.deepspeed.zero_stage == 0:  # ZeRO-0 keeps whole gradients: their norm
                        grad_norm = local_grad_norm(self.engine.module)
                self.engine.step()
                ild = loss_sums.ild if loss_sums.ild is not None else loss_sums.total.new_zeros(())
                sums = [a + float(b.detach()) for a, b in zip(sums, (loss_sums.total, loss_sums.kd, loss_sums.ce, ild))]
            total, kd, ce, ild = (x / max(1.0, n_step) for x in all_reduce_sum(sums, dist.device))
            dt = time.time() - t0
            # A digest of the step's sequence ids (this rank's), so resumed runs can be checked for repeats or gaps.
            data_digest = hashlib.sha1(json.dumps(micro).encode()).hexdigest()[:12]
            last = {"step": step + 1, "tokens": (step + 1) * tokens_per_step, "loss": total, "kd": kd, "ce": ce,
                    "data": data_digest,
                    "lr": lr, "stage": self.stage_at(step), "tokens_per_s": tokens_per_step / dt,
                    "target_tokens": int(n_step)}
            if self.spec.uses_ild:
                last["ild"] = ild
            last["peak_memory_gib"] = peak_memory_gib(dist.device)
            if grad_norm is None:
                grad_norm = self.engine.get_global_grad_norm()  # before clipping; None where not computed
            if grad_norm is not None:
                last["grad_norm"] = float(grad_norm)
            if self._due(step, r.log.eval_every_steps) and self.eval_data is not None:
                last.update(self.evaluate())
            logger.log(last, metrics_path)
            if self.on_step is not None:
                self.on_step(step + 1, self.student)
            bar.set_postfix(loss=f"{total:.4f}", tok_s=f"{last['tokens_per_s']:.0f}")
            bar.update(1)
            if self._due(step, r.checkpoint.every_steps) and step + 1 < self.total_steps:
                self.save_checkpoint(step + 1)
        bar.close()
        if self.eval_data is not None and "eval_ce" not in last:
            last.update(self.evaluate())
            logger.log({**last, "final_eval": True}, metrics_path)
        if start_step < self.total_steps:
            self.save_checkpoint(self.total_steps)
        final = self.export()
        logger.close()
        return {**last, "final": str(final)}

    def _zero_missing_grads(self) -> None:
        """What DeepSpeed's reduction does besides averaging: a trainable tensor that got no gradient this step (the
        final norm and head when only ILD trains) gets a zero one, so AdamW still steps it (its moments decay, its
        weight decay applies) as on more processes."""
        for p in self.engine.module.parameters():
            if p.requires_grad and p.grad is None and p.numel():
                p.grad = torch.zeros_like(p)

    def _due(self, step: int, every: int) -> bool:
        return every > 0 and (step + 1) % every == 0

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out KD and CE per target token over the first eval_batches micro-batches (rank-sharded).

        A cached teacher covers training sequences only, so with one the evaluation is CE alone.
        """
        r, dist = self.recipe, self.dist
        live = isinstance(self.teacher, LiveTeacher) and self.spec.kind is not KDLoss.NONE
        s = self.spec
        spec = LossConfig(kind=s.kind, temperature=s.temperature, mix=s.mix, kd_weight=1.0, ce_weight=1.0) if live \
            else LossConfig(kind=KDLoss.NONE, kd_weight=0.0, ce_weight=1.0)
        self.engine.eval()
        sums = [0.0, 0.0, 0.0]
        mb, n = r.train.micro_batch_size, len(self.eval_data)
        for j in range(r.log.eval_batches):
            first = (j * dist.world_size + dist.rank) * mb
            ix = list(range(first, min(first + mb, n)))
            if ix:
                s = self._loss_sums(self.eval_data.batch(ix), ix, self.teacher if live else None, spec)
                sums = [a + b for a, b in zip(sums, (float(s.kd), float(s.ce), s.tokens))]
        kd, ce, tokens = all_reduce_sum(sums, dist.device)
        self.engine.train()
        out = {"eval_ce": ce / max(1.0, tokens), "eval_tokens": int(tokens)}
        if live:
            out["eval_kd"] = kd / max(1.0, tokens)
        return out

    # ---- checkpoints --------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        """What a resumed run must share with the checkpoint (outputs and logging may change)."""
        d = recipe_to_dict(self.recipe)
        for key in ("log", "checkpoint", "output_dir"):
            d.pop(key, None)
        return d

    def save_checkpoint(self, step: int) -> None:
        """A resumable checkpoint: DeepSpeed's model/optimizer state plus each rank's RNG, then `latest`."""
        tag = f"step_{step:08d}"
        tag_dir = self.ckpt_dir / tag
        if self.dist.is_main:
            tag_dir.mkdir(parents=True, exist_ok=True)
        barrier()
        torch.save(_rng_state(), tag_dir / f"rng_rank{self.dist.rank:03d}.pt")
        if self.dist.is_main:
            state = {"step": step, "sampler": self.sampler.describe(), "recipe": self._fingerprint()}
            (tag_dir / "trainer_state.json").write_text(json.dumps(state, indent=2, default=str) + "\n")
        barrier()
        # `latest` is ours, not DeepSpeed's: DeepSpeed truncates and rewrites it in place, so a kill at that moment
        # leaves it empty. Ours names the new tag only once every rank's shards are written, and swaps in whole.
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, save_latest=False)
        barrier()
        if self.dist.is_main:
            write_latest(self.ckpt_dir, tag)
            kept = sorted(p for p in self.ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step_"))
            for old in kept[: -max(1, self.recipe.checkpoint.keep_last)]:
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)

    def _maybe_resume(self) -> int:
        tag = read_latest(self.ckpt_dir)
        if tag is None:
            return 0
        tag_dir = self.ckpt_dir / tag
        state = json.loads((tag_dir / "trainer_state.json").read_text())
        if json.loads(json.dumps(self._fingerprint(), default=str)) != state["recipe"]:
            raise TrainingError(
                f"{self.out} holds a checkpoint of a different recipe; use a new output_dir, or --force to start over"
            )
        self.sampler.check_compatible(state["sampler"])
        path, _ = self.engine.load_checkpoint(str(self.ckpt_dir), tag=tag)
        if path is None:
            raise TrainingError(f"DeepSpeed could not load checkpoint {tag_dir}")
        rng_file = tag_dir / f"rng_rank{self.dist.rank:03d}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        if self.dist.is_main:
            print(f"resumed from {tag_dir} at step {state['step']}", flush=True)
        return int(state["step"])

    # ---- export ---------------------------------------------------------------------------------------------
    def export(self) -> Path:
        """A consolidated HF checkpoint in <output_dir>/final (gathered from ZeRO-3, LoRA merged)."""
        import deepspeed

        final = self.out / "final"
        params = list(self.student.parameters())
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.recipe.deepspeed.zero_stage == 3 else contextlib.nullcontext()
        with ctx:
            if self.dist.is_main:
                state = {k: v.detach().cpu().clone() for k, v in self.student.state_dict().items()}
                models.export_model(self.student, state, final, self.tokenizer_dir, self.recipe.train.mode == "lora")
                save_recipe(self.recipe, final / "ecomla_recipe.yaml")
        barrier()
        return final


def run(recipe: DistillRecipe, *, force: bool = False, progress: bool = True) -> dict:
    job = DistillRun(recipe, force=force, progress=progress)
    job.setup()
    result = job.train()
    if job.dist.is_main:
        print(json.dumps({k: v for k, v in result.items() if k != "stage"}, indent=None), flush=True)
    return result


__all__ = ["DistillRun", "run", "lr_at", "TrainingError", "NonFiniteLoss"]
