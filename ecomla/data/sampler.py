"""Deterministic, resumable, rank-aware order of packed sequences.

Notation:
    N   num_sequences in the dataset
    mb  micro_batch (sequences per rank per forward pass)
    A   grad_accum (micro-batches per optimizer step)
    W   world_size (data-parallel ranks)
    G   = mb * A * W, sequences consumed by one global (optimizer) step

Epoch e visits `torch.randperm(N)` drawn from a generator seeded `seed + e`.
Global step s (0-based, counting across epochs) takes the block
order[k*G : (k+1)*G] of epoch s // steps_per_epoch, k = s % steps_per_epoch;
the incomplete tail of every epoch (N % G sequences) is dropped. Within the
block, micro-batch j of rank r is [j*W*mb + r*mb : j*W*mb + r*mb + mb].

The order is a pure function of (seed, N, G) and the step, so the step is the
whole resume state: a resumed run asks for `indices(step, micro)` from the
step it stopped at and sees exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import torch

from ecomla.data.text import DataError

# What fixes the global order: a resume with any of these changed would repeat or skip data.
_ORDER_KEYS = ("seed", "num_sequences", "global_batch")


class StepSampler:
    """Sequence indices for (global step, micro-batch) on this rank."""

    def __init__(self, num_sequences: int, micro_batch: int, grad_accum: int, world_size: int, rank: int, seed: int):
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
            if value < 1:
                raise DataError(f"{name} must be at least 1, got {value}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.num_sequences, self.micro_batch, self.grad_accum = num_sequences, micro_batch, grad_accum
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.global_batch = micro_batch * grad_accum * world_size  # G
        if num_sequences < self.global_batch:
            raise DataError(
                f"one optimizer step needs micro_batch {micro_batch} x grad_accum {grad_accum} x world_size "
                f"{world_size} = {self.global_batch} sequences, but the dataset has {num_sequences}; "
                "add data, shorten seq_len, or lower the batch settings"
            )
        self.steps_per_epoch = num_sequences // self.global_batch
        self._epoch: int | None = None
        self._order: torch.Tensor | None = None  # (N,) permutation of the cached epoch

    def epoch(self, step: int) -> int:
        """The epoch (0-based) that global step `step` falls in."""
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_sequences, generator=gen)
            self._epoch = epoch
        return self._order

    def indices(self, step: int, micro: int) -> list[int]:
        """The `micro_batch` sequence indices of this rank's micro-batch `micro` at global step `step`."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        if not 0 <= micro < self.grad_accum:
            raise DataError(f"micro must be in [0, {self.grad_accum}), got {micro}")
        order = self._permutation(self.epoch(step))
        start = (step % self.steps_per_epoch) * self.global_batch
        start += micro * self.world_size * self.micro_batch + self.rank * self.micro_batch
        return order[start : start + self.micro_batch].tolist()

    def describe(self) -> dict:
        """What defines the data order; store it in checkpoints and pass it to `check_compatible` on resume."""
        return {
            "seed": self.seed,
            "num_sequences": self.num_sequences,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
            "steps_per_epoch": self.steps_per_epoch,
        }

    def check_compatible(self, desc: dict) -> None:
        """Raise DataError if a checkpoint's `describe()` implies a different global order.

        The order depends on seed, dataset size and G only; micro_batch,
        grad_accum and world_size may change on resume as long as their
        product G stays the same (each step then still sees the same block).
        """
        mine = self.describe()
        diffs = [f"{k}: checkpoint {desc.get(k)!r}, now {mine[k]!r}" for k in _ORDER_KEYS if desc.get(k) != mine[k]]
        if diffs:
            raise DataError(
                "cannot resume: the data order differs from the checkpoint's (" + "; ".join(diffs) + "). "
                "Resume with the same dataset, seed and micro_batch x grad_accum x world_size "
                f"(checkpoint: {desc.get('micro_batch')} x {desc.get('grad_accum')} x {desc.get('world_size')}), "
                "or start a new run"
            )

    def state_dict(self) -> dict:
        """The sampler holds no state beyond its settings; the trainer's step is the position."""
        return self.describe()

    def load_state_dict(self, state: dict) -> None:
        """Checks that `state` (a `state_dict()`) describes the same order."""
        self.check_compatible(state)
