"""Knowledge-distillation losses for X-EcoMLA: per token, computed over rows in chunks.

Pure math: tensors in, tensors out (no transformers, no files). The training loop
selects the rows that count (real tokens, shifted targets) *before* calling in
here; every row passed is a token, so padding can never leak into a loss.

Notation, per token: z the student logits (V,), T the temperature,
q = softmax(z/T) the student, p the teacher at the same T, and
KL(a‖b) = Σ_v a_v·(log a_v − log b_v) with 0·log 0 = 0.

    forward_kl  KL(p‖q)                                         X-EcoMLA's default
    reverse_kl  KL(q‖p)
    jsd         β·KL(p‖m) + (1−β)·KL(q‖m),  m = β·p + (1−β)·q    β = spec.mix
    skew_kl     KL(p‖m),                    m = α·p + (1−α)·q    α = spec.mix

The KD term is multiplied by T² so that its gradient scale does not change with T
(Hinton et al., 2015). CE is on the hard targets at temperature 1.

Intermediate-layer distillation (ILD) compares hidden states, not distributions: for
each of the L layers, the student's output h_l and the source model's t_l at the same
token, per token  (1/L)·Σ_l ‖h_l − t_l‖² / ‖t_l‖²  (`ild_per_token`), a relative error
that is 0 when the student computes its source's layers and does not depend on how
large the residual stream has grown at that token. With the `attention_map` target it
compares where each head looks instead: per query token, the mean over layers and heads
of KL(a‖b) between the source's attention row a and the student's b
(`attention_kl_per_token`; MOHAWK's first stage aligns the same matrices).

Sparse teachers and the tail bucket. A dataset of saved teacher logits keeps only
the top-k log-probs per token plus the log of the mass outside them. The two
distributions are then compared after coarsening both onto k+1 buckets: the k
top-k ids, and one "tail" bucket holding every other id. The student's tail
log-mass is computed exactly, as logsumexp of its log-probs over the ids outside
the top-k, not as log(1 − Σ top-k), which cancels catastrophically when the top-k
hold nearly all the mass. For k = V there is no tail bucket and the result is
exact. For k < V the coarsened divergence lower-bounds the full one (the
data-processing inequality; all four kinds are f-divergences); for forward KL it
is exactly KL between p and q coarsened onto (top-k ids, everything else).

Usage (the caller divides by its global token count, e.g. summed over ranks):

    sums = chunked_loss(h, model.lm_head, lambda s, e: TeacherDist.from_logits(t[s:e], spec.temperature),
                        targets, spec, chunk_size=1024)
    (sums.total / n_tokens_global).backward()
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from ecomla.recipe.schema import knob


class KDLoss(str, enum.Enum):
    """The divergence D(teacher, student) of the KD term."""

    FORWARD_KL = "forward_kl"  # KL(p‖q): mean-seeking; X-EcoMLA's default
    REVERSE_KL = "reverse_kl"  # KL(q‖p): mode-seeking
    JSD = "jsd"  # generalized Jensen-Shannon with weight β = mix on p
    SKEW_KL = "skew_kl"  # KL(p‖α·p + (1−α)·q) with α = mix; bounded, smoother than KL
    NONE = "none"  # no KD term: pure CE (`ecomla pretrain`)


class ILDTarget(str, enum.Enum):
    """Which output of each layer intermediate-layer distillation matches."""

    BLOCK = "block"  # the decoder layer's output: the residual stream after the layer
    ATTENTION = "attention"  # the attention module's output (after o_proj), before it joins the residual stream
    ATTENTION_MAP = "attention_map"  # each head's attention probabilities over the keys (eager attention)


class ILDInputs(str, enum.Enum):
    """What each student layer reads while ILD compares it."""

    STUDENT = "student"  # its own previous layer's output: the drift of the layers below is in the comparison
    SOURCE = "source"  # the source model's input to that layer (teacher forcing): each layer is fitted alone


class LossConfigError(ValueError):
    """An invalid LossConfig; `problems` holds 'field: message' strings (the recipe loader reports each)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid loss: " + "; ".join(problems))


@dataclass(frozen=True)
class LossConfig:
    """Per-token loss: total = kd_weight·T²·D(p, q) + ce_weight·CE. The `loss` section of a distill recipe.

    Constructing an invalid one raises LossConfigError with every problem.
    """

    kind: KDLoss = knob(KDLoss.FORWARD_KL, help="forward_kl (X-EcoMLA), reverse_kl, jsd, skew_kl, or none (CE only)")
    temperature: float = knob(1.0, help="Softmax temperature of both models in the KD term (which is scaled by T²)")
    kd_weight: float = knob(1.0, help="Weight of the KD term")
    ce_weight: float = knob(0.0, help="Weight of next-token CE on the data, at temperature 1 (X-EcoMLA: 0)")
    mix: float = knob(0.5, help="β of jsd, α of skew_kl; in [0, 1]")
    chunk_tokens: int = knob(1024, help="Logits are computed this many target tokens at a time (memory ∝ chunk × vocab)")
    recompute: bool = knob(
        True, help="Recompute each chunk's logits (both heads) in backward, so only one chunk's (chunk, vocab) "
        "tensors are alive; false keeps every chunk's for backward (memory ∝ tokens × vocab) and saves the "
        "recomputation. Choose false when tokens × vocab fits in memory (its cost: docs/benchmarks.md)"
    )

    ild_weight: float = knob(
        0.0, help="Weight of intermediate-layer distillation: per token, the mean over layers of ‖h − t‖²/‖t‖² "
        "between each student layer's output and the source model's (teacher.ild_model), or with ild_target "
        "attention_map the mean KL of each head's attention row. 0: off. With kd_weight and ce_weight 0 the run "
        "trains on ILD alone (a first stage; KD and CE are still logged)"
    )
    ild_target: ILDTarget = knob(
        ILDTarget.BLOCK, help="block: each decoder layer's output (the residual stream). attention: each attention "
        "module's output, before the residual add. attention_map: each head's attention probabilities, "
        "KL(source ‖ student) per query row (both models then run eager attention: memory ∝ layers × heads × "
        "seq_len² per sequence)"
    )
    ild_inputs: ILDInputs = knob(
        ILDInputs.STUDENT, help="student: each student layer reads its own previous layer (the drift below it counts). "
        "source: each reads the source's input to that layer (teacher forcing); only for ILD alone, since the "
        "student's output then is no longer its own"
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KDLoss(self.kind))  # a plain string is converted
        object.__setattr__(self, "ild_target", ILDTarget(self.ild_target))
        object.__setattr__(self, "ild_inputs", ILDInputs(self.ild_inputs))
        problems = self.check()
        if problems:
            raise LossConfigError(problems)

    def check(self) -> list[str]:
        problems = []
        if not self.temperature > 0:
            problems.append(f"temperature: must be > 0, got {self.temperature}")
        for name in ("kd_weight", "ce_weight", "ild_weight"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.mix <= 1:
            problems.append(f"mix: must be in [0, 1], got {self.mix}")
        if self.chunk_tokens < 1:
            problems.append(f"chunk_tokens: must be >= 1, got {self.chunk_tokens}")
        if not (self.uses_teacher or self.ce_weight > 0 or self.uses_ild):
            problems.append(f"ce_weight: nothing to train with kind={self.kind.value}, kd_weight={self.kd_weight}, "
                            f"ce_weight={self.ce_weight} and ild_weight={self.ild_weight}; set ce_weight > 0 (CE only), "
                            "a KD term or an ILD weight")
        if self.ild_inputs is ILDInputs.SOURCE and self.uses_ild and self.trains_output:
            problems.append("ild_inputs: source (teacher forcing) trains on ILD alone; set kd_weight and ce_weight "
                            "to 0, or use ild_inputs: student to add ILD to KD")
        return problems

    @property
    def uses_teacher(self) -> bool:
        """Whether the total loss has a KD term (and therefore needs a teacher)."""
        return self.kind is not KDLoss.NONE and self.kd_weight > 0

    @property
    def uses_ild(self) -> bool:
        """Whether the total loss has an intermediate-layer term (and therefore needs the source model live)."""
        return self.ild_weight > 0

    @property
    def trains_output(self) -> bool:
        """Whether a term on the output distribution (KD or CE) is weighted in."""
        return self.uses_teacher or self.ce_weight > 0


@dataclass
class TeacherDist:
    """A teacher distribution over the vocab for N tokens: dense log-probs, or sparse top-k + one tail bucket."""

    logp: Tensor | None = None  # (N, V) dense log-probs at the spec temperature
    topk_idx: Tensor | None = None  # (N, k) int64 vocab ids
    topk_logp: Tensor | None = None  # (N, k) log-probs of those ids
    tail_logp: Tensor | None = None  # (N,) log of the mass outside the top-k (−inf when k = V)

    def __post_init__(self) -> None:
        sparse = [t is not None for t in (self.topk_idx, self.topk_logp, self.tail_logp)]
        if (self.logp is not None) == any(sparse) or (any(sparse) and not all(sparse)):
            raise ValueError("TeacherDist takes either logp (dense) or all of topk_idx, topk_logp, tail_logp")

    @property
    def is_dense(self) -> bool:
        return self.logp is not None

    @classmethod
    def from_logits(cls, logits: Tensor, temperature: float) -> TeacherDist:
        """Dense teacher from (N, V) logits; detached, float32."""
        return cls(logp=torch.log_softmax(logits.detach().float() / temperature, dim=-1))

    @classmethod
    def topk_from_logits(cls, logits: Tensor, temperature: float, k: int) -> TeacherDist:
        """Sparse teacher from (N, V) logits: the k most likely ids and the exact log-mass of the rest."""
        z = logits.detach().float() / temperature  # (N, V)
        if not 1 <= k <= z.shape[-1]:
            raise ValueError(f"k must be in [1, V={z.shape[-1]}], got {k}")
        lse = z.logsumexp(-1)  # (N,)
        top, idx = z.topk(k, dim=-1)  # (N, k)
        rest = z.scatter(-1, idx, -math.inf).logsumexp(-1)  # (N,); all −inf, hence −inf, when k == V
        return cls(topk_idx=idx, topk_logp=top - lse[:, None], tail_logp=rest - lse)

    def slice(self, start: int, end: int) -> TeacherDist:
        """Rows [start:end] (views, no copy)."""
        rows = (self.logp, self.topk_idx, self.topk_logp, self.tail_logp)
        return TeacherDist(*(None if t is None else t[start:end] for t in rows))


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Σ_v a_v·(log a_v − log b_v) over the last dim, with 0·log 0 = 0 and NaN-free gradients."""
    if not torch.isneginf(log_a).any():
        # The common case (a dense teacher from finite logits): no dead entries, so no masking and
        # three (N, V) temporaries instead of eight; this is most of the chunked loss's peak memory.
        return (log_a.exp() * (log_a - log_b)).sum(-1)
    live = ~torch.isneginf(log_a)  # not `> -inf`: a NaN must stay live and surface, never count as 0
    # Sanitize dead entries *before* the arithmetic: a where() after it would still
    # send NaN gradients (0·∞) back through exp(−inf)·(−inf − x).
    log_a = torch.where(live, log_a, 0.0)
    log_b = torch.where(live, log_b, 0.0)
    return torch.where(live, log_a.exp() * (log_a - log_b), 0.0).sum(-1)


def _divergence(kind: KDLoss, log_p: Tensor, log_q: Tensor, mix: float) -> Tensor:
    """D(p, q) per row for (N, K) teacher and student log-probs -> (N,)."""
    if kind is KDLoss.FORWARD_KL:
        return _kl(log_p, log_q)
    if kind is KDLoss.REVERSE_KL:
        return _kl(log_q, log_p)
    log_mix = [math.log(w) if w > 0 else -math.inf for w in (mix, 1 - mix)]
    log_m = torch.logaddexp(log_p + log_mix[0], log_q + log_mix[1])  # m = mix·p + (1−mix)·q
    if kind is KDLoss.JSD:  # a term of weight 0 is skipped, not multiplied (0·∞ at mix ∈ {0, 1})
        terms = [w * _kl(log_a, log_m) for w, log_a in ((mix, log_p), (1 - mix, log_q)) if w > 0]
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]
    if kind is KDLoss.SKEW_KL:
        return _kl(log_p, log_m)
    raise ValueError(f"no divergence for kind={kind.value}")


def kd_per_token(student_logits: Tensor, teacher: TeacherDist, spec: LossConfig,
                 log_q: Tensor | None = None) -> Tensor:
    """KD divergence per token, already multiplied by T²: (N, V) logits -> (N,) float32.

    Zeros when spec.kind is NONE. A sparse teacher is compared on k+1 buckets
    (see the module docstring). `log_q`: the student's log-softmax at T, when the caller has it.
    """
    n, v = student_logits.shape
    if spec.kind is KDLoss.NONE:
        return student_logits.new_zeros(n, dtype=torch.float32)
    if log_q is None:
        log_q = torch.log_softmax(student_logits.float() / spec.temperature, dim=-1)  # (N, V)
    if teacher.is_dense:
        log_p = teacher.logp.float()  # (N, V)
        if log_p.shape != log_q.shape:
            raise ValueError(f"teacher logp has shape {tuple(log_p.shape)}, student logits {(n, v)}")
    else:
        idx = teacher.topk_idx.long()  # (N, k); saved datasets may store int32
        log_p = teacher.topk_logp.float()  # (N, k)
        if idx.shape[0] != n or idx.shape[-1] > v:
            raise ValueError(f"teacher top-k has shape {tuple(idx.shape)}, student logits {(n, v)}")
        log_q_top = log_q.gather(-1, idx)  # (N, k)
        if idx.shape[-1] < v:
            # The student's tail, exactly: logsumexp over the ids outside the top-k.
            q_tail = log_q.scatter(-1, idx, -math.inf).logsumexp(-1, keepdim=True)  # (N, 1)
            log_p = torch.cat([log_p, teacher.tail_logp.float()[:, None]], dim=-1)  # (N, k+1)
            log_q = torch.cat([log_q_top, q_tail], dim=-1)  # (N, k+1)
        else:
            log_q = log_q_top  # k == V: the tail holds no mass on either side, so no bucket
    return _divergence(spec.kind, log_p, log_q, spec.mix) * spec.temperature**2


def ce_per_token(student_logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy at temperature 1: (N, V) logits, (N,) ids -> (N,) float32.

    Targets must be real ids; select rows beforehand (an id of -100 would silently score 0).
    """
    return F.cross_entropy(student_logits.float(), targets, reduction="none")


def token_loss(
    student_logits: Tensor, teacher: TeacherDist | None, targets: Tensor, spec: LossConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token (total, kd, ce), each (N,) float32, with total = kd_weight·kd + ce_weight·ce.

    kd and ce are always returned for logging; a term whose weight is 0 is computed
    without grad. teacher may be None only when spec has no KD term (kd is then 0).
    """
    if teacher is None and spec.uses_teacher:
        raise ValueError(f"kind={spec.kind.value} with kd_weight={spec.kd_weight} needs a teacher, got None")
    log_q = None
    if teacher is not None and spec.kind is not KDLoss.NONE and spec.temperature == 1.0:
        # One log-softmax over the (N, V) logits serves both terms: CE at T = 1 is −log q of the target. A
        # second pass over the logits (and its recomputation in the checkpointed backward) would cost as much
        # as the KL itself.
        with torch.set_grad_enabled(torch.is_grad_enabled() and (spec.uses_teacher or spec.ce_weight > 0)):
            log_q = torch.log_softmax(student_logits.float(), dim=-1)  # (N, V)
    with torch.set_grad_enabled(torch.is_grad_enabled() and spec.ce_weight > 0):
        ce = ce_per_token(student_logits, targets) if log_q is None else -log_q.gather(-1, targets[:, None].long())[:, 0]
    if teacher is None:
        kd = torch.zeros_like(ce)
    else:
        with torch.set_grad_enabled(torch.is_grad_enabled() and spec.uses_teacher):
            kd = kd_per_token(student_logits, teacher, spec, log_q)
    # Only weighted-in terms enter total (LossConfig guarantees at least one), so a
    # zero-weight term costs no backward.
    terms = [spec.kd_weight * kd] if spec.uses_teacher else []
    terms += [spec.ce_weight * ce] if spec.ce_weight > 0 else []
    total = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return total, kd, ce


def _mean_over_layers(student: list[Tensor], source: list[Tensor], per_layer: Callable[[Tensor, Tensor], Tensor]
                      ) -> Tensor:
    """(1/L)·Σ_l per_layer(student_l, source_l detached, as float32): the one loop of both ILD terms."""
    if len(student) != len(source) or not student:
        raise ValueError(f"ILD needs the same number of layers on both sides, got {len(student)} and {len(source)}")
    return sum(per_layer(s.float(), t.detach().float()) for s, t in zip(student, source)) / len(student)


def ild_per_token(student: list[Tensor], source: list[Tensor]) -> Tensor:
    """Mean over layers of ‖h_l − t_l‖² / ‖t_l‖² per token: L pairs of (N, d) -> (N,) float32.

    The source's layers carry no gradient; a token whose source state is all zeros compares against a norm of 1.
    """
    return _mean_over_layers(student, source,
                             lambda h, t: (h - t).square().sum(-1) / t.square().sum(-1).clamp_min(1e-12))


def _attention_kl(b: Tensor, a: Tensor) -> Tensor:
    """KL(a‖b) over the keys, averaged over heads: (N, H, T) rows, a the source's -> (N,)."""
    if b.shape != a.shape:
        raise ValueError(f"attention maps of shape {tuple(b.shape)} (student) and {tuple(a.shape)} (source): "
                         "attention_map needs the same number of query heads on both sides")
    # a·log b with b clamped: a row's key that the student's softmax underflowed to 0 costs a·69, not inf
    return (torch.xlogy(a, a) - torch.xlogy(a, b.clamp_min(1e-30))).sum(-1).mean(-1)


def attention_kl_per_token(student: list[Tensor], source: list[Tensor]) -> Tensor:
    """Mean over layers and heads of KL(a‖b) per query token, a the source's attention row over the keys and b the
    student's: L pairs of (N, H, T) probabilities -> (N,) float32. Keys neither model attends to (the causal
    mask's) add 0; the source's rows carry no gradient.
    """
    return _mean_over_layers(student, source, _attention_kl)


@dataclass
class LossSums:
    """Loss SUMS over a batch's tokens (0-dim float32); divide by the global token count."""

    total: Tensor  # Σ kd_weight·kd + ce_weight·ce (+ ild_weight·ild); backprop this (after normalizing)
    kd: Tensor  # Σ T²·D(p, q), for logging
    ce: Tensor  # Σ CE, for logging
    tokens: int  # N, the number of rows summed
    ild: Tensor | None = None  # Σ of ild_per_token, for logging (None: no ILD term)


def chunked_loss(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    teacher: Callable[[int, int], TeacherDist] | None,
    targets: Tensor,
    spec: LossConfig,
    chunk_size: int,
    checkpoint: bool = True,
    num_chunks: int | None = None,
) -> LossSums:
    """Sum the token losses over (N, d) hidden rows, chunk_size rows at a time.

    `num_chunks` forces exactly that many head calls (rows split as evenly as
    possible, some chunks possibly empty). Under ZeRO-3 every head call gathers
    the head's weight collectively, so all ranks must make the same number of
    calls: pass the maximum over ranks of ceil(N / chunk_size).

    head maps (n, d) hidden rows to (n, V) logits; teacher(s, e) gives the teacher
    rows [s:e] and is called under no_grad. With checkpoint=True each chunk (head,
    teacher and loss) is recomputed during backward, so no chunk's (n, V) logits
    are kept and peak memory is one chunk's, not N×V. The teacher callback then runs
    twice per chunk: keep it cheap (a slice, or a head over cached teacher hidden
    states) and deterministic.

    Returns sums; the caller divides by its global token count. N may be 0.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if teacher is None and spec.uses_teacher:
        raise ValueError(f"kind={spec.kind.value} with kd_weight={spec.kd_weight} needs a teacher, got None")
    n = hidden.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"{n} hidden rows but {targets.shape[0]} targets")

    def chunk(h: Tensor, s: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
        dist = None
        if teacher is not None:
            with torch.no_grad():
                dist = teacher(s, e)
        total, kd, ce = token_loss(head(h), dist, targets[s:e], spec)
        return total.sum(), kd.sum(), ce.sum()

    if n == 0 and num_chunks is None:
        # Wire the zero to hidden and the head, so backward still reaches them (DDP wants every parameter used).
        zero = head(hidden[:0]).float().sum() * 0.0
        return LossSums(zero, zero.clone(), zero.clone(), 0)
    if num_chunks is None:
        bounds = [(s, min(s + chunk_size, n)) for s in range(0, n, chunk_size)]
    else:
        edges = [n * i // num_chunks for i in range(num_chunks + 1)]
        bounds = list(zip(edges[:-1], edges[1:]))
    sums = []
    for s, e in bounds:
        if checkpoint:
            sums.append(_checkpoint(chunk, hidden[s:e], s, e, use_reentrant=False))
        else:
            sums.append(chunk(hidden[s:e], s, e))
    total, kd, ce = (torch.stack(col).sum() for col in zip(*sums))
    return LossSums(total, kd, ce, n)
