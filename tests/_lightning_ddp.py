"""Two ranks of ``veil.lightning.DifferentialPrivacy`` under Lightning's DDP strategy on gloo (CPU).

Run as ``python tests/_lightning_ddp.py OUT``: Lightning starts the second rank by re-running this
script. Each rank writes ``rank<r>.pt`` (its final weights, steps taken and ε) into OUT.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from test_lightning import Classifier  # the module the one-process tests train
from veil.lightning import DifferentialPrivacy


def main(out: Path) -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)
    callback = DifferentialPrivacy(
        target_epsilon=4.0, target_delta=1e-3, max_grad_norm=0.5, dataset_id="ddp-toy", out=out / "veil"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=3,
        default_root_dir=str(out),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[callback],
    )
    module = Classifier()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    assert callback.run is not None
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    record = {"weights": state, "steps": callback.run.steps, "epsilon": callback.epsilon}
    torch.save(record, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
