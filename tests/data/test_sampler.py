"""`ecomla.data.sampler`: the global, resumable, rank-aware order of packed sequences.

Proves: the same settings give the same indices; within an epoch every kept
index appears exactly once over all (step, micro, rank), ranks are disjoint and
together cover each step's block of G sequences; the order follows the
documented randperm(seed + epoch) layout; a sampler built fresh at step s (a
resume) continues exactly as the uninterrupted one; steps roll into the next
epoch with a new permutation and the tail is dropped; too-small data and
incompatible resumes fail with errors that say what to change.
"""

from __future__ import annotations

import pytest
import torch

from ecomla.data.sampler import StepSampler
from ecomla.data.text import DataError

N, MB, ACC, WORLD, SEED = 103, 2, 3, 4, 7  # G = 24, 4 steps per epoch, 7 sequences dropped per epoch


def ranks(**kw) -> list[StepSampler]:
    args = {"num_sequences": N, "micro_batch": MB, "grad_accum": ACC, "world_size": WORLD, "seed": SEED} | kw
    return [StepSampler(rank=r, **args) for r in range(args["world_size"])]


def step_block(samplers, step) -> list[list[int]]:
    """Per rank: all indices it reads at `step`, micro-batches in order."""
    return [[i for m in range(ACC) for i in s.indices(step, m)] for s in samplers]


def test_deterministic_and_documented_layout():
    a, b = ranks(), ranks()
    assert a[0].global_batch == 24 and a[0].steps_per_epoch == 4
    for step in range(10):
        assert step_block(a, step) == step_block(b, step)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + 1)).tolist()
    step, micro, rank = 5, 2, 3  # epoch 1, second block
    start = 1 * 24 + micro * WORLD * MB + rank * MB
    assert a[rank].indices(step, micro) == order[start : start + MB]
    assert step_block(ranks(seed=8), 0) != step_block(a, 0)


def test_epoch_covers_each_index_once_and_ranks_are_disjoint():
    samplers = ranks()
    for epoch in range(2):
        seen = []
        for step in range(epoch * 4, epoch * 4 + 4):
            per_rank = step_block(samplers, step)
            assert all(len(r) == MB * ACC for r in per_rank)
            flat = [i for r in per_rank for i in r]
            assert len(set(flat)) == len(flat) == 24  # ranks disjoint, the block covered once
            seen += flat
        assert len(seen) == len(set(seen)) == 4 * 24  # no repeats within the epoch
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        assert set(seen) == set(order[: 4 * 24])  # exactly the epoch's order minus its dropped tail


def test_resume_matches_uninterrupted():
    straight = ranks()
    history = [step_block(straight, step) for step in range(12)]
    for s in (0, 3, 4, 9):
        resumed = ranks()  # a fresh process: no cached permutation
        resumed[0].check_compatible(straight[0].describe())
        assert [step_block(resumed, step) for step in range(s, 12)] == history[s:]


def test_epoch_boundary_uses_new_permutation():
    (s,) = ranks(world_size=1)  # G = 6, 17 steps per epoch, 1 sequence dropped
    spe, G = s.steps_per_epoch, s.global_batch
    e0, e1 = (torch.randperm(N, generator=torch.Generator().manual_seed(SEED + e)).tolist() for e in (0, 1))
    assert s.epoch(spe - 1) == 0 and s.epoch(spe) == 1
    assert s.indices(spe - 1, ACC - 1) == e0[spe * G - MB : spe * G]  # last micro-batch of epoch 0
    assert s.indices(spe, 0) == e1[:MB]  # the next step opens epoch 1
    assert s.indices(spe - 1, 0) == e0[(spe - 1) * G : (spe - 1) * G + MB]  # back again: cache is per epoch
    epoch0 = {i for step in range(spe) for m in range(ACC) for i in s.indices(step, m)}
    assert set(e0) - epoch0 == set(e0[spe * G :]) and len(e0[spe * G :]) == N % G


def test_too_small_dataset_and_bad_arguments():
    with pytest.raises(DataError, match="24 sequences, but the dataset has 23"):
        StepSampler(23, MB, ACC, WORLD, 0, SEED)
    StepSampler(24, MB, ACC, WORLD, 0, SEED)  # exactly one step is enough
    with pytest.raises(DataError, match="rank 4"):
        StepSampler(N, MB, ACC, WORLD, 4, SEED)
    with pytest.raises(DataError, match="micro"):
        ranks()[0].indices(0, ACC)


def test_check_compatible():
    (s,) = ranks(world_size=1)
    desc = s.describe()
    assert desc["global_batch"] == MB * ACC and desc["steps_per_epoch"] == N // (MB * ACC)
    s.load_state_dict(s.state_dict())
    # Same G with a different split over ranks keeps the order: allowed.
    StepSampler(N, MB, 1, ACC, 0, SEED).check_compatible(desc)
    with pytest.raises(DataError, match="seed: checkpoint 7, now 8"):
        StepSampler(N, MB, ACC, 1, 0, SEED + 1).check_compatible(desc)
    with pytest.raises(DataError, match="global_batch: checkpoint 6, now 12"):
        StepSampler(N, MB, ACC, 2, 0, SEED).check_compatible(desc)
    with pytest.raises(DataError, match="num_sequences"):
        StepSampler(N + 1, MB, ACC, 1, 0, SEED).check_compatible(desc)
