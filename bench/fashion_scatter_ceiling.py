"""The non-private ceiling of a Fashion-MNIST scattering head: how far a head can go without privacy.

A DP run of a head cannot beat that head trained without privacy, so this bounds a lever before any
DP run is spent on it. Trains the head of ``bench/fashion_scatter_levers.py`` (same cached features,
same ``--val`` split from a fixed public seed) with plain mini-batch Adam and a cosine learning rate,
and prints validation and test accuracy after each epoch. ``--flip views`` trains on both the image
and its left-right mirror (each view a row) and averages the two views' logits at evaluation (also
printed without averaging: ``*_plain``); ``--flip mean`` trains and evaluates on the mean of the two
views' features. Not private: a research measurement on public benchmark data.

Usage::

    VEIL_BENCH_CACHE=<features> OMP_NUM_THREADS=1 python bench/fashion_scatter_ceiling.py \\
        --head linear --epochs 10 --lr 2e-3 --flip none
"""

import argparse
import json
import time

import numpy as np
import torch
from torch import nn

from fashion_scatter_levers import EXTRA_SHAPES, accuracy, head, lever_feats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", default="linear")
    p.add_argument("--groups", type=int, default=27)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--flip", default="none", choices=["none", "views", "mean"])
    p.add_argument("--val", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--extra",
        default=None,
        help=f"concatenate these features: parts of {sorted(EXTRA_SHAPES)}, comma-separated",
    )
    a = p.parse_args()
    xtr, ytr, xte, yte = lever_feats(a.extra, a.flip)
    xtr_t, xte_t = torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(np.ascontiguousarray(xte))
    ytr_t, yte_t = torch.from_numpy(np.array(ytr)), torch.from_numpy(np.array(yte))
    order = torch.from_numpy(np.random.default_rng(20261201).permutation(len(ytr_t)))  # the levers' split
    k = round(a.val * len(ytr_t))
    xva, yva = xtr_t[order[:k]], ytr_t[order[:k]]
    xtr_t, ytr_t = xtr_t[order[k:]], ytr_t[order[k:]]
    torch.manual_seed(a.seed)
    model = head(a.head, a.groups, None, a.extra)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    per_epoch = (len(ytr_t) + a.batch - 1) // a.batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.epochs * per_epoch)
    crit = nn.CrossEntropyLoss()
    t0 = time.time()
    for epoch in range(a.epochs):
        model.train()
        perm = torch.randperm(len(ytr_t))
        for i in range(0, len(ytr_t), a.batch):
            xb, yb = xtr_t[perm[i : i + a.batch]], ytr_t[perm[i : i + a.batch]]
            if a.flip == "views":
                xb, yb = xb.flatten(0, 1), yb.repeat_interleave(2)
            loss = crit(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        row = {"head": a.head, "extra": a.extra, "flip": a.flip, "epoch": epoch + 1}
        row["val"] = accuracy(model, xva, yva)
        row["test"] = accuracy(model, xte_t, yte_t)
        if a.flip == "views":
            row["val_plain"] = accuracy(model, xva[:, 0], yva)
            row["test_plain"] = accuracy(model, xte_t[:, 0], yte_t)
        row["s"] = round(time.time() - t0)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
