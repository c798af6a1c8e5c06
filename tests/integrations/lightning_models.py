"""A small Lightning module and dataset for the Lightning integration's tests (and the DDP
test's spawned ranks, which import them by name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import vramctl


class Tokens(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Deterministic samples: 16 tokens of width 64 and a class, from the index."""

    def __init__(self, n: int = 4096) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 64, generator=g), torch.randint(0, 10, (), generator=g)


class Lit(L.LightningModule):
    """A token-wise MLP classifier; ``hog`` bytes of a co-tenant are taken at train start."""

    def __init__(self, batch_size: int = 8, hog: int = 0, leak: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 10))
        self.hog = hog
        self.leak = leak
        self.held: list[torch.Tensor] = []
        self.seen: list[int] = []

    def on_train_start(self) -> None:
        if self.hog:
            self.held.append(
                vramctl.current_device().adopt(torch.empty(self.hog, dtype=torch.uint8))
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.seen.append(x.shape[0])
        loss = nn.functional.cross_entropy(self.net(x).mean(1), y)
        self.log("train_loss", loss)
        if self.leak:
            self.held.append(torch.ones(self.leak, dtype=torch.uint8))
        return loss

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(root: Path, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
    }
    options.update(kwargs)
    return L.Trainer(**options)


def rank_device(trainer: L.Trainer) -> vramctl.Device:
    """Rank 0 a 96 MiB simulated GPU, rank 1 a 64 MiB one (for the DDP agreement test)."""
    return vramctl.get_device("sim:96MiB" if trainer.global_rank == 0 else "sim:64MiB")


class Recorder(L.Callback):
    """Writes the batch size each rank trains with to ``root/rank{N}.txt``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.root, f"rank{trainer.global_rank}.txt").write_text(str(pl_module.batch_size))
