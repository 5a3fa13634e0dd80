"""What a training run reports on rank 0: metrics.jsonl, TensorBoard, and W&B when asked for and installed."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path


class RunLog:
    """Rank-0 metrics: metrics.jsonl (truncated to the resumed step), TensorBoard and W&B when installed."""

    def __init__(self, out: Path, cfg, main: bool, start_step: int):
        self.main, self.cfg = main, cfg
        self.tb = self.wandb = None
        if not main:
            return
        path = out / "metrics.jsonl"
        if path.exists():  # drop steps logged after the checkpoint we resumed from
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            keep = [json.dumps(row) for row in rows if row.get("step", 0) <= start_step and not row.get("final_eval")]
            path.write_text("".join(k + "\n" for k in keep))
        if cfg.tensorboard:
            with contextlib.suppress(ImportError):
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
        if cfg.wandb_project:
            with contextlib.suppress(ImportError):
                import wandb

                self.wandb = wandb.init(project=cfg.wandb_project, dir=str(out))

    def log(self, row: dict, path: Path) -> None:
        if not self.main:
            return
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if row["step"] % max(1, self.cfg.every_steps) == 0:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    if self.tb is not None:
                        self.tb.add_scalar(k, v, row["step"])
            if self.wandb is not None:
                self.wandb.log(row, step=row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
