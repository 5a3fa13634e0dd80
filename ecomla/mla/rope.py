"""Which head dims keep RoPE in MLA, and which stock RoPE frequencies carry them.

Pure tensor math: no transformers, no files.

Source layout. Llama, Mistral and Qwen2 checkpoints in Hugging Face format
rotate each head "half-wise": dim j and dim j + d_h/2 form frequency pair j,
turning at base frequency θ^(-2j/d_h) (pair 0 is the fastest).

Output layout. Stock DeepSeek-V3 rotates a d_r-dim key/query slice with its own
frequencies θ'^(-2i/d_r) / factor, i = 0 … d_r/2 − 1, laid out either
interleaved (dims 2i, 2i+1; DeepSeek's own checkpoints and serving engines) or
half-wise (dims i, i + d_r/2).

Strategies (`mla.rope_dims`):
  last     X-EcoMLA: the last d_r rows of each head, under a fresh d_r-dim RoPE
           (θ' = θ). Only exact when d_r = d_h.
  high     MHA2MLA: the d_r/2 fastest pairs. Exact: θ' = θ^(d_r/d_h).
  low      MHA2MLA: the d_r/2 slowest pairs. Exact for default/linear sources:
           θ' = θ^(d_r/d_h) and a linear factor; not for Llama-3 scaling.
  uniform  MHA2MLA: every (d_h/d_r)-th pair from pair 0. Exact: θ' = θ.
  norm     MHA2MLA 2-norm: per layer, the pairs with the largest mean
           ‖q_pair‖·‖k_pair‖ on calibration text. Exact only where the chosen
           pairs happen to form a geometric run; otherwise the stock
           frequencies are a least-squares fit in log-frequency.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

RopeDims = Literal["last", "high", "low", "uniform", "norm"]


def select_pairs(strategy: RopeDims, head_dim: int, rope_dim: int, scores: torch.Tensor | None = None) -> list[int]:
    """Source pair indices (ascending, i.e. fastest first) that keep RoPE.

    `scores` (d_h/2,) is required for `norm`. `last` is not pair-based and has
    no answer here (see `rope_rows`).
    """
    half, keep = head_dim // 2, rope_dim // 2
    if strategy == "high":
        return list(range(keep))
    if strategy == "low":
        return list(range(half - keep, half))
    if strategy == "uniform":
        if half % keep:
            raise ValueError(f"'uniform' needs d_r/2 = {keep} to divide d_h/2 = {half}")
        return list(range(0, half, half // keep))
    if strategy == "norm":
        if scores is None or scores.numel() != half:
            raise ValueError(f"'norm' needs one score per frequency pair ({half})")
        return sorted(torch.topk(scores.double(), keep).indices.tolist())
    raise ValueError(f"strategy {strategy!r} does not select pairs")


@dataclass(frozen=True)
class RopeSplit:
    """How one head's rows split into the no-RoPE part and the RoPE part."""

    nope_rows: torch.Tensor  # (d_h − d_r,) source rows, ascending
    rope_rows: torch.Tensor  # (d_r,) source rows in the output RoPE layout
    pairs: tuple[int, ...] | None  # source pairs kept, fastest first (None for `last`)


def rope_split(
    strategy: RopeDims,
    head_dim: int,
    rope_dim: int,
    *,
    interleave: bool,
    scores: torch.Tensor | None = None,
) -> RopeSplit:
    """Row indices of a source head that go to the no-RoPE and RoPE parts.

    Output pair i takes source rows (a_i, b_i); half-wise output lays them out
    as [a_0 … a_{m-1}, b_0 … b_{m-1}], interleaved output as [a_0, b_0, a_1, b_1, …].
    """
    half, keep = head_dim // 2, rope_dim // 2
    if strategy == "last":
        # The literal last d_r rows, re-paired half-wise among themselves.
        start = head_dim - rope_dim
        a = list(range(start, start + keep))
        b = list(range(start + keep, head_dim))
        pairs = None
    else:
        chosen = select_pairs(strategy, head_dim, rope_dim, scores)
        a = chosen
        b = [j + half for j in chosen]
        pairs = tuple(chosen)
    rope = [x for ab in zip(a, b) for x in ab] if interleave else a + b
    nope = sorted(set(range(head_dim)) - set(rope))
    return RopeSplit(torch.tensor(nope, dtype=torch.long), torch.tensor(rope, dtype=torch.long), pairs)


@dataclass(frozen=True)
class FrequencyFit:
    """Stock RoPE parameters for the kept pairs."""

    theta: float  # θ' (rope_theta of the output)
    linear_factor: float  # extra linear scaling (1.0 = none)
    max_log_error: float  # worst |log f'_i − log f_{pair i}| over layers, pre-scaling


def fit_frequencies(
    pairs_per_layer: Sequence[Sequence[int]],
    head_dim: int,
    rope_dim: int,
    theta: float,
    *,
    allow_linear: bool,
) -> FrequencyFit:
    """Least-squares (θ', factor) so that θ'^(-2i/d_r)/factor matches θ^(-2·pair_i/d_h).

    Works on base (pre-scaling) frequencies; a source's own linear or Llama-3
    scaling is applied on top by the caller, so exactness carries over. When
    `allow_linear` is False (e.g. Llama-3 scaling, which stock RoPE cannot
    combine with a linear factor) only θ' is fitted.
    """
    keep = rope_dim // 2
    xs, ys = [], []
    for pairs in pairs_per_layer:
        for i, j in enumerate(pairs):
            xs.append(-2.0 * i / rope_dim)  # log f' = x·log θ' − log factor
            ys.append(-2.0 * j / head_dim * math.log(theta))
    x, y = torch.tensor(xs, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)
    if keep == 1:  # a single pair fixes only the offset
        log_theta, log_factor = math.log(theta), (-float(y.mean()) if allow_linear else 0.0)
    elif allow_linear:
        A = torch.stack([x, -torch.ones_like(x)], dim=1)
        sol = torch.linalg.lstsq(A, y[:, None]).solution.squeeze(1)
        log_theta, log_factor = float(sol[0]), float(sol[1])
    else:
        log_theta, log_factor = float((x * y).sum() / (x * x).sum()), 0.0
    err = float((x * log_theta - log_factor - y).abs().max())
    return FrequencyFit(theta=math.exp(log_theta), linear_factor=math.exp(log_factor), max_log_error=err)


def pair_norm_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """MHA2MLA's 2-norm score per frequency pair, summed over query heads.

    q: (N, n_h, d_h) and k: (N, n_kv, d_h) pre-RoPE activations (RoPE keeps pair
    norms, so pre- and post-RoPE give the same score). Returns (d_h/2,) the mean
    over tokens of ‖q_pair‖·‖k_pair‖, with each query head paired to its KV head.
    """
    n_h, n_kv, d_h = q.shape[1], k.shape[1], q.shape[2]
    half = d_h // 2
    qn = torch.sqrt(q[..., :half].double() ** 2 + q[..., half:].double() ** 2)  # (N, n_h, half)
    kn = torch.sqrt(k[..., :half].double() ** 2 + k[..., half:].double() ** 2)  # (N, n_kv, half)
    kn = kn.repeat_interleave(n_h // n_kv, dim=1)  # (N, n_h, half)
    return (qn * kn).mean(0).sum(0)
