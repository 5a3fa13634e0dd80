"""Process-group set-up for one or many processes, and rank-0-only output.

`deepspeed` and `torchrun` launchers set RANK/WORLD_SIZE/LOCAL_RANK and the
master address; a plain `ecomla distill` sets them for a single process, so
the same code path (DeepSpeed on gloo or NCCL) serves every launch.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def solo_env() -> dict[str, str]:
    """This process's environment minus the torch.distributed rendezvous settings, for a child that must be its
    own single process: inheriting a parent's RANK/MASTER_PORT would make it bind the parent's live port."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}


def init_distributed() -> Dist:
    """Initialize torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU)."""
    import deepspeed

    solo = "RANK" not in os.environ  # a single process without a launcher: we pick the rendezvous port
    if solo:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    fresh = not torch.distributed.is_initialized()
    for attempt in range(5):
        if torch.distributed.is_initialized():
            break
        try:
            deepspeed.init_distributed(dist_backend=backend)
        except torch.distributed.DistNetworkError as err:
            # The free port we picked can be taken by another process before the store binds it; pick again.
            if not solo or "EADDRINUSE" not in str(err) or attempt == 4:
                raise
            os.environ["MASTER_PORT"] = str(_free_port())
    rank = torch.distributed.get_rank()
    if fresh and device.type == "cpu":
        # Every rank has mapped every rank's all-reduce buffer once all have passed this barrier (DeepSpeed maps
        # them while it starts the process group, and never opens them by name again): drop this rank's name now,
        # so that no exit, clean, SIGTERMed or SIGKILLed, leaves the file behind.
        torch.distributed.barrier()
        shm_buffer(rank).unlink(missing_ok=True)
    return Dist(rank, torch.distributed.get_world_size(), local_rank, device)


def shm_buffer(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce creates for this rank (about 70 MB of RAM in /dev/shm)
    when all ranks are on one machine and its launcher said so (LOCAL_SIZE = WORLD_SIZE), named by user,
    rendezvous address and port, and rank. DeepSpeed never unlinks it, so every such CPU run would leave it behind
    until reboot; `init_distributed` unlinks it once every rank has mapped it. Unlinking only drops the name: the
    memory stays mapped until the ranks exit. DeepSpeed reads the two variables as empty when they are unset, and
    so does this."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def shutdown() -> None:
    """Tear the process group down before the interpreter exits (launcher entry points). Left to interpreter
    exit, gloo's threads can die first and a rank aborts with 'terminate called without an active exception'."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
