"""Fashion-MNIST at ε = 3, δ = 1e-5: veil vs Opacus with the same model, hyperparameters and seed.

Both libraries train the same small CNN (GroupNorm + tanh), from the same initial weights, with the
same optimizer, batch size, clip norm C, epochs and noise multiplier σ. σ is calibrated once by veil
(PLD accountant, Poisson sampling) for the target; each library then reports its own ε for that σ
(veil: PLD; Opacus: its default PRV accountant). Reported: test accuracy and training wall time
(evaluation excluded).

Data: the IDX files of the Debian package ``dataset-fashion-mnist`` under
/usr/share/datasets/fashion-mnist/ (``apt-get install dataset-fashion-mnist``), gzipped or not.
Pixels are scaled with the dataset's published mean/std (public constants, no private statistics).

Usage::

    python bench/fashion_mnist.py              # full run (default 10 epochs)
    python bench/fashion_mnist.py --epochs 20
    python bench/fashion_mnist.py --quick      # smoke run: 1 epoch on 6,000 training images
"""

from __future__ import annotations

import argparse
import copy
import gzip
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import describe_machine, markdown_table

DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530  # published Fashion-MNIST pixel statistics
EPSILON, DELTA = 3.0, 1e-5


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (optionally .gz) as a numpy array: magic (dtype code, rank), big-endian dims, data."""
    candidates = [path, path.with_name(path.name + ".gz")]
    found = next((p for p in candidates if p.exists()), None)
    if found is None:
        raise SystemExit(
            f"{path}(.gz) not found: install the data with "
            "`apt-get update && apt-get install -y dataset-fashion-mnist`"
        )
    raw = gzip.decompress(found.read_bytes()) if found.suffix == ".gz" else found.read_bytes()
    if raw[0] != 0 or raw[1] != 0:
        raise SystemExit(f"{found}: not an IDX file")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    dtype, rank = np.dtype(dtypes[raw[2]]), raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank))
    offset = 4 + 4 * rank
    return np.frombuffer(raw, dtype=dtype, offset=offset, count=int(np.prod(dims))).reshape(dims)


def load(split: str) -> TensorDataset:
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(DATA_DIR / f"{prefix}-images-idx3-ubyte")
    labels = read_idx(DATA_DIR / f"{prefix}-labels-idx1-ubyte")
    x = (torch.from_numpy(images.astype(np.float32) / 255.0) - MEAN) / STD
    return TensorDataset(x.unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))


class Net(nn.Module):
    """Small CNN for 28×28 images: two conv blocks (GroupNorm, tanh, max-pool), two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3),  # 14×14
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),  # 13×13
            nn.Conv2d(16, 32, 4, stride=2),  # 5×5
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),  # 4×4
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@torch.no_grad()
def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    x, y = data.tensors
    correct = sum(
        int((model(x[i : i + 2000]).argmax(1) == y[i : i + 2000]).sum()) for i in range(0, len(x), 2000)
    )
    model.train()
    return correct / len(x)


def train(
    library: str, init: Net, train_data: TensorDataset, args: argparse.Namespace, sigma: float
) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = copy.deepcopy(init)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True)
    criterion = nn.CrossEntropyLoss()
    if library == "veil":
        import veil

        engine = veil.PrivacyEngine()  # secure noise (the default); --seed fixes init only
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=args.clip,
            criterion=criterion,
        )

        def epsilon() -> float:
            return engine.get_epsilon(DELTA)
    else:
        from opacus import PrivacyEngine

        opacus_engine = PrivacyEngine()
        model, optimizer, loader = opacus_engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=args.clip,
            poisson_sampling=True,
        )

        def epsilon() -> float:
            return float(opacus_engine.get_epsilon(DELTA))

    seconds = 0.0
    for epoch in range(args.epochs):
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
        seconds += time.perf_counter() - start
        print(f"  {library} epoch {epoch + 1}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return {"seconds": seconds, "model": model, "epsilon": epsilon()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="1 epoch on 6,000 training images")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    train_data, test_data = load("train"), load("test")
    if args.quick:
        args.epochs = 1
        train_data = TensorDataset(*(t[:6000] for t in train_data.tensors))
    n = len(train_data)

    from veil.accounting.calibrate import calibrate_noise
    from veil.sampling import steps_per_epoch

    q = args.batch_size / n
    steps = args.epochs * steps_per_epoch(n, args.batch_size)
    sigma = calibrate_noise(EPSILON, DELTA, q, steps)
    torch.manual_seed(args.seed)
    init = Net()

    rows = []
    for library in ("veil", "opacus"):
        out = train(library, init, train_data, args, sigma)
        model = out["model"]
        module = getattr(model, "_module", model)  # Opacus wraps the model
        rows.append(
            [library, f"{accuracy(module, test_data):.4f}", f"{out['seconds']:.1f}", f"{out['epsilon']:.3f}"]
        )

    print(f"# Fashion-MNIST, ε = {EPSILON}, δ = {DELTA}{' (quick)' if args.quick else ''}\n")
    print(
        f"{n} training / {len(test_data)} test images; {args.epochs} epoch(s); batch {args.batch_size} "
        f"(q = {q:.4g}, {steps} steps); SGD lr {args.lr}, momentum {args.momentum}; C = {args.clip}; "
        f"σ = {sigma:.4f} (veil PLD calibration, used by both); seed {args.seed}; model: "
        f"{sum(p.numel() for p in init.parameters())}-parameter CNN (GroupNorm + tanh).\n"
    )
    print(markdown_table(["library", "test accuracy", "train seconds", "reported ε"], rows))
    print("\nMachine:\n")
    print(describe_machine())


if __name__ == "__main__":
    main()
