"""Rank accuracy levers for Fashion-MNIST scattering heads at ε = 3 with veil's engine (seeded noise).

Features: veil's Scattering2d (J = 2, L = 8) on x/255 (what ``veil train``'s scatternet trains on),
computed once and cached as .npy files in ``$VEIL_BENCH_CACHE`` (default: the system temp folder).
σ is calibrated by veil (PLD, Poisson sampling) for the schedule; one run evaluates the final
weights, their exponential moving averages (``--ema``) and the uniform average of the last share of
iterates (``--tail``) on the official test split and, with ``--val F``, on a held-out share F of
the training rows (a fixed split from a public seed; choose on it, report test). A research loop
for choosing presets, not a private job (the test split is only a diagnostic here).

Levers: ``--groups G`` (GroupNorm groups over the 81 channels, per example and data-independent:
81 = per-example channel standardisation, 0 = none), ``--log`` (log(1 + x / ``--log-scale``), a
fixed per-value map), ``--head cnn|cnn-small``, ``--opt adam``, ``--dpbn-sigma S`` (per-channel
mean and variance released with the Gaussian mechanism, noise multiplier S, per-example clip
``--dpbn-clip``, frozen as the normalisation; the release is one ``Gaussian(S)`` event composed
before the DP-SGD steps by veil's accountant, and σ is calibrated so the *total* is ``--eps``),
``--flip views|mean`` (the scattering features of each image's left-right mirror, cached beside
the others: ``views`` trains on both views with augmentation multiplicity 2 through the engine's
``clipper.group_size``, each example's two row gradients averaged and clipped once, so the
sensitivity stays C, and averages the two views' logits at evaluation; ``mean`` trains and
evaluates the head on the mean of the two views' features, a fixed flip-invariant map),
``--extra j1[,pixels]`` (veil's J = 1 scattering and/or x/255 concatenated with the J = 2 features,
each part group-normalised on its own, one linear layer on all: ``--extra j1`` is ``veil train``'s
default head; ``j1pool``: the J = 1 maps average-pooled 2 × 2), ``--smooth S`` (label smoothing of
the training loss; a change of the loss only).

Second-moment levers (the head's fixed inputs z: every part group-normalised at GroupNorm's initial
affine, flattened, scaled to norm √(1 − b²), then a constant coordinate b = ``--ssp-bias``, so
‖z‖ = 1 for every record): ``--solver ssp`` releases Σ z zᵀ and Σ z (α·onehot(y))ᵀ with one
Gaussian mechanism (sensitivity √(1 + α²)) spending the whole ``--eps`` and fits the linear layer by
ridge least squares (``--ridge``, several values from the same release); ``--whiten S`` releases
Σ z zᵀ alone (one ``Gaussian(S)`` event, sensitivity 1, composed before the DP-SGD steps), takes
P = (max(G̃, 0)/n + λI)^(-1/2) (λ = ``--whiten-ridge``), and trains a linear layer by DP-SGD on the
rows z P scaled to norm ``--whiten-norm`` (public per-record maps once P is released).

Usage::

    OMP_NUM_THREADS=1 python bench/fashion_scatter_levers.py --epochs 40 --batch 8192 --lr 8 \
        --physical-batch 1024 --seed 0 --ema 0,0.95
"""

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from veil.accounting.calibrate import (  # noqa: E402
    calibrate_noise,
    dpsgd_event,
    epsilon_of,
    with_steps,
)
from veil.accounting.events import Gaussian  # noqa: E402
from veil.data.idx import load_idx_dataset  # noqa: E402
from veil.engine import PrivacyEngine  # noqa: E402
from veil.models.scattering import scattering_features  # noqa: E402
from veil.sampling import steps_per_epoch  # noqa: E402


def _costs() -> dict:
    """The process's CPU seconds so far, its peak resident GB and the load average, for a result row."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
        "peak_gb": round(ru.ru_maxrss / 1e6, 2),
        "load": os.getloadavg()[0],
    }


def _rss_mib() -> int:
    """This process's resident memory (MiB), from /proc (Linux)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 // 2**20


C = os.environ.get("VEIL_BENCH_CACHE", tempfile.gettempdir())


def feats():
    if not os.path.exists(f"{C}/feats_test.npy"):
        d = load_idx_dataset("fashion-mnist", "/usr/share/datasets/fashion-mnist")
        for s, x, y in (("train", d.x_train, d.y_train), ("test", d.x_test, d.y_test)):
            f = scattering_features(x / 255.0, 2, 8)
            np.save(f"{C}/feats_{s}.npy", f)
            np.save(f"{C}/y_{s}.npy", y)
    return [
        np.load(f"{C}/{n}.npy", mmap_mode="r") for n in ("feats_train", "y_train", "feats_test", "y_test")
    ]


EXTRA_SHAPES = {"pixels": (1, 28, 28), "j1": (9, 14, 14), "j1pool": (9, 7, 7)}


def extra_feats(kind):
    """Features to concatenate with the J = 2 ones (cached like :func:`feats`): ``pixels`` (x/255),
    ``j1`` (veil's Scattering2d with J = 1, L = 8: 9 channels of 14 × 14) or ``j1pool`` (those maps
    average-pooled 2 × 2 to 9 × 7 × 7: a fixed per-example map, a quarter of the inputs)."""
    if kind == "j1pool":
        pooled = []
        for part in extra_feats("j1"):
            maps = torch.from_numpy(np.ascontiguousarray(part)).reshape(-1, 9, 14, 14)
            pooled.append(torch.nn.functional.avg_pool2d(maps, 2).reshape(len(maps), -1).numpy())
        return pooled
    if not os.path.exists(f"{C}/{kind}_test.npy"):
        d = load_idx_dataset("fashion-mnist", "/usr/share/datasets/fashion-mnist")
        for s, x in (("train", d.x_train), ("test", d.x_test)):
            x = (x / 255.0).astype(np.float32)
            f = x if kind == "pixels" else scattering_features(x, 1, 8)
            np.save(f"{C}/{kind}_{s}.npy", np.asarray(f, dtype=np.float32).reshape(len(x), -1))
    return [np.load(f"{C}/{kind}_{s}.npy", mmap_mode="r") for s in ("train", "test")]


def concat_extra(x, e):
    """One row an example: the J = 2 features flattened, then the extra ones."""
    return np.concatenate([np.asarray(x).reshape(len(x), -1), np.asarray(e).reshape(len(e), -1)], axis=1)


class ConcatHead(nn.Module):
    """GroupNorm on the J = 2 maps and on each extra part's maps (each per example, data-independent),
    then one linear layer on all, flattened: the preset's head with more inputs."""

    def __init__(self, groups, extras):
        super().__init__()
        self.shapes = [EXTRA_SHAPES[e] for e in extras]
        self.norm = norm_layer(groups, None)
        self.extra_norms = nn.ModuleList(
            nn.GroupNorm(c // 3 if c % 3 == 0 else 1, c) for c, _, _ in self.shapes
        )
        self.fc = nn.Linear(81 * 49 + sum(int(np.prod(s)) for s in self.shapes), 10)

    def inputs(self, x):
        """What the linear layer sees: every part group-normalised, flattened, concatenated."""
        out, start = [self.norm(x[:, : 81 * 49].reshape(-1, 81, 7, 7)).flatten(1)], 81 * 49
        for norm, shape in zip(self.extra_norms, self.shapes, strict=True):
            size = int(np.prod(shape))
            out.append(norm(x[:, start : start + size].reshape(-1, *shape)).flatten(1))
            start += size
        return torch.cat(out, dim=1)

    def forward(self, x):
        return self.fc(self.inputs(x))


def extra_parts(extra):
    """``--extra`` as a list of parts (``"j1,pixels"`` → ``["j1", "pixels"]``; none → ``[]``)."""
    parts = [e for e in (extra or "").split(",") if e]
    for e in parts:
        if e not in EXTRA_SHAPES:
            raise SystemExit(f"--extra {e}: not one of {sorted(EXTRA_SHAPES)}")
    return parts


def flip_feats():
    """The scattering features of the left-right mirrored images (cached like :func:`feats`)."""
    if not os.path.exists(f"{C}/flip_train.npy"):
        d = load_idx_dataset("fashion-mnist", "/usr/share/datasets/fashion-mnist")
        for s, x in (("train", d.x_train), ("test", d.x_test)):
            f = scattering_features(np.ascontiguousarray((x / 255.0)[..., ::-1]), 2, 8)
            np.save(f"{C}/flip_{s}.npy", f)
    return [np.load(f"{C}/flip_{s}.npy", mmap_mode="r") for s in ("train", "test")]


def lever_feats(extra, flip):
    """``(x_train, y_train, x_test, y_test)``: the J = 2 features, with ``extra`` features concatenated
    and, for ``flip`` ``views``/``mean``, the mirrored images' features paired or averaged in."""
    xtr, ytr, xte, yte = feats()
    for part in extra_parts(extra):
        etr, ete = extra_feats(part)
        xtr, xte = concat_extra(xtr, etr), concat_extra(xte, ete)
    if flip != "none":
        ftr, fte = flip_feats()
        pair = (lambda u, v: np.stack([u, v], 1)) if flip == "views" else (lambda u, v: (u + v) / 2)
        xtr, xte = pair(np.asarray(xtr), np.asarray(ftr)), pair(np.asarray(xte), np.asarray(fte))
    return xtr, ytr, xte, yte


class FrozenChannelNorm(nn.Module):
    """(x − mean_c) / sqrt(var_c + eps) with fixed per-channel statistics (not trained: buffers)."""

    def __init__(self, mean, var):
        super().__init__()
        self.register_buffer("mean", mean.reshape(1, -1, 1, 1))
        self.register_buffer("scale", (var.clamp_min(0) + 1e-5).rsqrt().reshape(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) * self.scale


def norm_layer(groups, stats):
    if stats is not None:
        return FrozenChannelNorm(*stats)
    if groups == 0:
        return nn.Identity()
    return nn.GroupNorm(groups, 81)


def head(kind, groups, stats=None, extra=None):
    if extra:
        return ConcatHead(groups, extra_parts(extra))
    if kind == "linear":
        return nn.Sequential(norm_layer(groups, stats), nn.Flatten(), nn.Linear(81 * 49, 10))
    if kind == "cnn":  # small CNN on the 81x7x7 maps
        return nn.Sequential(
            norm_layer(groups, stats),
            nn.Conv2d(81, 32, 3, padding=1),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 9, 10),
        )
    if kind == "cnn-small":
        return nn.Sequential(
            norm_layer(groups, stats),
            nn.Conv2d(81, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(16 * 49, 10),
        )
    raise SystemExit(kind)


def dp_channel_stats(x, clip, sigma, generator):
    """Per-channel mean and variance of the scattering maps, released with the Gaussian mechanism.

    Each example contributes v_i = (its 81 channel means over the 7×7 positions, their 81 mean
    squares), clipped to L2 norm ``clip``; the sum gets N(0, σ² clip²) per coordinate, so one
    release is the Gaussian mechanism with sensitivity ``clip`` under add/remove-one (one
    ``Gaussian(σ)`` event, composed with the training's steps by veil's accountant). Divided by the
    training size n (treated as public, as veil's q = B / n already does)."""
    total = torch.zeros(162, dtype=torch.float64)
    for i in range(0, len(x), 4096):
        xb = x[i : i + 4096].double()
        v = torch.cat([xb.mean(dim=(2, 3)), (xb * xb).mean(dim=(2, 3))], dim=1)
        v = v * (clip / v.norm(dim=1, keepdim=True).clamp_min(clip))
        total += v.sum(0)
    total += torch.randn(162, dtype=torch.float64, generator=generator) * sigma * clip
    mean, sq = total[:81] / len(x), total[81:] / len(x)
    return mean.float(), (sq - mean * mean).float()


def unit_rows(model, x, bias):
    """The per-example map of ``--solver ssp``: the head's fixed inputs (GroupNorm at its initial
    affine, i.e. none), scaled to L2 norm √(1 − bias²), then a constant ``bias`` coordinate: every
    row has norm 1 whatever the record (a public per-record rule)."""
    with torch.no_grad():
        z = model.inputs(x) if isinstance(model, ConcatHead) else nn.Sequential(*list(model)[:-1])(x)
        z = z * (math.sqrt(1 - bias * bias) / z.norm(dim=1, keepdim=True).clamp_min(1e-12))
        return torch.cat([z, torch.full((len(z), 1), bias)], dim=1)


def ssp_release(model, x, y, bias, label_scale, sigma, generator, chunk=2048):
    """Least-squares sufficient statistics released with one Gaussian mechanism (SSP).

    Each example contributes (z zᵀ, z (α·onehot(y))ᵀ) with ‖z‖ = 1 (:func:`unit_rows`), so the
    vector of the upper triangle of z zᵀ (diagonal included) and z αyᵀ has L2 norm ≤ √(1 + α²) = Δ
    (the upper triangle's squared norm is Σᵢ zᵢ⁴ + Σᵢ<ⱼ zᵢ²zⱼ² ≤ ‖z‖⁴). The sums get N(0, σ²Δ²) on
    every released coordinate (the Gram matrix's noise is drawn on the upper triangle and mirrored),
    so the release is one ``Gaussian(σ)`` event under add/remove-one. Returns (G̃, B̃) in float64."""
    d = None
    for i in range(0, len(y), chunk):
        z = unit_rows(model, x[i : i + chunk], bias)
        assert float(z.norm(dim=1).max()) <= 1 + 1e-5, "a row above norm 1: the sensitivity would be wrong"
        t = nn.functional.one_hot(y[i : i + chunk].long(), 10).float() * label_scale
        if d is None:
            d = z.shape[1]
            gram = torch.zeros(d, d, dtype=torch.float64)
            cross = torch.zeros(d, 10, dtype=torch.float64)
        gram += (z.T @ z).double()
        cross += (z.T @ t).double()
    scale = sigma * math.sqrt(1 + label_scale * label_scale)
    noise = torch.randn(d, d, dtype=torch.float64, generator=generator).triu() * scale
    gram += noise + noise.triu(1).T
    cross += torch.randn(d, 10, dtype=torch.float64, generator=generator) * scale
    return gram, cross


def ssp_solve(gram, cross, ridge):
    """The ridge solution W = (G̃ + λI)⁻¹ B̃ (post-processing of the release)."""
    eye = torch.eye(len(gram), dtype=torch.float64)
    return torch.linalg.solve(gram + ridge * eye, cross).float()


def whitener(gram, n, ridge):
    """P = (max(G̃, 0)/n + λI)^(-1/2) from a released Gram matrix (post-processing: eigenvalues the
    noise made negative are taken as 0, λ keeps the noise-dominated directions from being blown up).
    Also keeps ``tr(P G̃₊ P)/n`` as ``whitener.released_mean_square``: the mean square row norm of zP
    estimated from the release, from which ``--whiten-scale global`` takes its one scale (the rule of
    veil train's h29fm6 preset, ``c = norm / √that``)."""
    vals, vecs = torch.linalg.eigh(gram)
    top = (vals.flip(0) / n).tolist()
    print(
        "eigenvalues/n at ranks 1, 10, 100, 300, 1000, 3000:",
        [f"{top[r - 1]:.2e}" for r in (1, 10, 100, 300, 1000, 3000)],
    )
    scale = (vals.clamp_min(0) / n + ridge).rsqrt()
    whitener.released_mean_square = float((scale.square() * vals.clamp_min(0) / n).sum())
    return ((vecs * scale) @ vecs.T).float()


def whitened_rows(model, x, bias, w, norm, chunk=4096, scale=None):
    """The fixed per-example map of ``--whiten``: :func:`unit_rows`, times the public matrix P (none:
    ``--unit-rows``), scaled to L2 norm ``norm`` (a public per-record rule); with ``scale`` (the
    ``--whiten-scale global*`` variants) multiplied by that one number instead."""
    out = []
    for i in range(0, len(x), chunk):
        z = unit_rows(model, x[i : i + chunk], bias)
        z = z if w is None else z @ w
        out.append(z * (norm / z.norm(dim=1, keepdim=True).clamp_min(1e-12)) if scale is None else z * scale)
    return torch.cat(out)


def row_norm_quantiles(x):
    """Diagnostic: the rows' L2 norms at quantiles 0, 0.01, 0.5, 0.99, 1 and their root mean square."""
    norms = torch.cat([x[i : i + 4096].norm(dim=1) for i in range(0, len(x), 4096)])
    qs = torch.quantile(norms, torch.tensor([0.0, 0.01, 0.5, 0.99, 1.0])).tolist()
    return {"q": [round(v, 2) for v in qs], "rms": round(float(norms.square().mean().sqrt()), 2)}


def ssp_accuracy(model, w, x, y, bias):
    hits = 0
    for i in range(0, len(y), 4096):
        hits += int((unit_rows(model, x[i : i + 4096], bias) @ w).argmax(1).eq(y[i : i + 4096]).sum())
    return round(hits / max(len(y), 1), 4)


def gaussian_sigma(eps, delta, prefix=()):
    """The smallest σ (to 0.1 %) such that ``prefix`` then one ``Gaussian(σ)`` is (ε, δ)-DP."""
    lo, hi = 0.05, 100.0
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if epsilon_of([*prefix, Gaussian(mid)], delta) > eps else (lo, mid)
    return hi


def run_ssp(a, model, xtr, ytr, xva, yva, xte, yte):
    """``--solver ssp``: the head's linear layer by ridge least squares on one-hot labels from the
    SSP release (:func:`ssp_release`) spending the whole ``--eps``; ridges are post-processing."""
    sigma = gaussian_sigma(a.eps, 1e-5)
    g = torch.Generator().manual_seed(a.seed + 3000)
    t0 = time.time()
    gram, cross = ssp_release(model, xtr, ytr, a.ssp_bias, a.ssp_label, sigma, g)
    release_s = time.time() - t0
    val, acc = {}, {}
    for ridge in (float(r) for r in a.ridge.split(",")):
        w = ssp_solve(gram, cross, ridge)
        acc[str(ridge)] = ssp_accuracy(model, w, xte, yte, a.ssp_bias)
        if len(yva):
            val[str(ridge)] = ssp_accuracy(model, w, xva, yva, a.ssp_bias)
    print(
        json.dumps(
            {
                "args": vars(a),
                "sigma": round(sigma, 4),
                "eps_total": round(epsilon_of([Gaussian(sigma)], 1e-5), 3),
                "val": val,
                "acc": acc,
                "release_s": round(release_s, 1),
                **_costs(),
            }
        ),
        flush=True,
    )


def _logits(model, x):
    """Logits of ``x``; for ``[N, 2, ...]`` rows (an image and its mirror) the mean over both views."""
    if x.dim() == 5:
        return model(x.flatten(0, 1)).reshape(len(x), 2, -1).mean(1)
    return model(x)


def accuracy(model, x, y):
    with torch.no_grad():
        hits = sum(
            (_logits(model, x[i : i + 4096]).argmax(1) == y[i : i + 4096]).sum()
            for i in range(0, len(y), 4096)
        )
    return round(float(hits) / max(len(y), 1), 4)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--head", default="linear")
    p.add_argument("--groups", type=int, default=27)
    p.add_argument("--epochs", type=float, default=40)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--lr", type=float, default=8.0)
    p.add_argument("--C", type=float, default=0.1)
    p.add_argument("--opt", default="sgd")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--ema", default="0,0.9,0.99,0.999")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eps", type=float, default=3.0)
    p.add_argument("--log", action="store_true")
    p.add_argument("--physical-batch", dest="pbs", type=int, default=None)
    p.add_argument("--cos", action="store_true")
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--memtrace", action="store_true")
    p.add_argument("--secure", action="store_true")
    p.add_argument("--smooth", type=float, default=0.0, help="label smoothing of the training loss")
    p.add_argument("--val", type=float, default=0.0, help="hold out this share of the training rows")
    p.add_argument("--tail", type=float, default=0.0, help="also average the last share of iterates")
    p.add_argument("--dpbn-sigma", dest="bn_sigma", type=float, default=0.0)
    p.add_argument("--dpbn-clip", dest="bn_clip", type=float, default=1.0)
    p.add_argument("--log-scale", dest="log_scale", type=float, default=1e-3)
    p.add_argument(
        "--flip",
        default="none",
        choices=["none", "views", "mean"],
        help="views: each example's image and mirror, gradients averaged before one clip (multiplicity 2),"
        " logits averaged at evaluation; mean: the head on the mean of both views' features",
    )
    p.add_argument(
        "--extra",
        default=None,
        help=f"concatenate these features: parts of {sorted(EXTRA_SHAPES)}, comma-separated",
    )
    p.add_argument(
        "--solver",
        default="dpsgd",
        choices=["dpsgd", "ssp"],
        help="ssp: ridge least squares from one Gaussian release of the sufficient statistics",
    )
    p.add_argument(
        "--whiten",
        type=float,
        default=0.0,
        help="σ of a Gaussian release of the unit rows' Gram matrix; DP-SGD on the rows whitened by it",
    )
    p.add_argument(
        "--unit-rows",
        dest="unit_rows",
        action="store_true",
        help="the --whiten rows without P (no release): the ablation of the whitening",
    )
    p.add_argument("--whiten-ridge", dest="whiten_ridge", type=float, default=0.01)
    p.add_argument("--whiten-norm", dest="whiten_norm", type=float, default=60.0)
    p.add_argument(
        "--whiten-scale",
        dest="whiten_scale",
        default="row",
        choices=["row", "global", "global-oracle"],
        help="row: each whitened row zP scaled to norm --whiten-norm; global: all rows times one c from the"
        " release (veil.data.whitening.whitener: root-mean-square --whiten-norm by the released spectrum,"
        " what veil train's h29fm6 preset did); global-oracle: one c from the training rows' true root"
        " mean square (non-private diagnostic)",
    )
    p.add_argument("--ridge", default="100,300,1000", help="ssp: ridge λ values (post-processing)")
    p.add_argument("--ssp-bias", dest="ssp_bias", type=float, default=0.3, help="ssp: constant coordinate")
    p.add_argument("--ssp-label", dest="ssp_label", type=float, default=1.0, help="ssp: the label scale α")
    a = p.parse_args()
    xtr, ytr, xte, yte = lever_feats(a.extra, a.flip)
    if a.memtrace:
        print("start rss", _rss_mib(), "MiB", flush=True)
    xtr_t = torch.from_numpy(np.ascontiguousarray(xtr))
    ytr_t = torch.from_numpy(np.asarray(ytr))
    if a.log:  # a fixed per-value map (data-independent): log(1 + x / scale)
        xtr_t = torch.log1p(xtr_t / a.log_scale)
    xte_t = torch.from_numpy(np.ascontiguousarray(xte))
    yte_t = torch.from_numpy(np.asarray(yte))
    if a.log:
        xte_t = torch.log1p(xte_t / a.log_scale)
    xva_t, yva_t = xte_t[:0], yte_t[:0]
    if a.val > 0:  # a fixed split drawn from a public seed, independent of the data and of --seed
        order = torch.from_numpy(np.random.default_rng(20261201).permutation(len(ytr_t)))
        k = round(a.val * len(ytr_t))
        xva_t, yva_t = xtr_t[order[:k]], ytr_t[order[:k]]
        xtr_t, ytr_t = xtr_t[order[k:]], ytr_t[order[k:]]
    if a.solver == "ssp":
        torch.manual_seed(a.seed)
        model = head(a.head, a.groups, None, a.extra)
        return run_ssp(a, model, xtr_t, ytr_t, xva_t, yva_t, xte_t, yte_t)
    n = len(ytr_t)
    spe = steps_per_epoch(n, a.batch)
    steps = round(a.epochs * spe)
    q = a.batch / n
    prefix = [Gaussian(a.bn_sigma)] if a.bn_sigma > 0 else []
    rows = a.whiten > 0 or a.unit_rows
    if a.whiten_scale != "row" and not a.whiten > 0:
        raise SystemExit("--whiten-scale global*: only with --whiten S")
    if rows:  # --whiten: one Gaussian release of the unit rows' Gram matrix (Δ = 1), before the steps
        t0 = time.time()
        front = head(a.head, a.groups, None, a.extra)
        w = None
        if a.whiten > 0:
            prefix.append(Gaussian(a.whiten))
            g = torch.Generator().manual_seed(a.seed + 4000)
            gram, _ = ssp_release(front, xtr_t, ytr_t, a.ssp_bias, 0.0, a.whiten, g)
            w = whitener(gram, n, a.whiten_ridge)
            del gram
            if a.whiten_scale == "global":  # veil train's h29fm6 rule: one c from the released spectrum
                scale = a.whiten_norm / math.sqrt(whitener.released_mean_square)
                print("released scale c", round(scale, 3), flush=True)
        if a.whiten_scale == "global-oracle":
            raw = whitened_rows(front, xtr_t, a.ssp_bias, w, a.whiten_norm, scale=1.0)
            scale = a.whiten_norm / float(row_norm_quantiles(raw)["rms"])
            print("oracle scale c", round(scale, 3), flush=True)
            del raw
        elif a.whiten_scale == "row":
            scale = None
        xtr_t, xva_t, xte_t = (
            whitened_rows(front, t, a.ssp_bias, w, a.whiten_norm, scale=scale) for t in (xtr_t, xva_t, xte_t)
        )
        del w
        norms = row_norm_quantiles(xtr_t)
        print("whitened", round(time.time() - t0, 1), "s; train rows' norms", norms, flush=True)
    sigma = calibrate_noise(a.eps, 1e-5, q, steps, prefix=prefix)
    torch.manual_seed(a.seed)
    stats = None
    if a.bn_sigma > 0:
        g = torch.Generator().manual_seed(a.seed + 2000)
        stats = dp_channel_stats(xtr_t, a.bn_clip, a.bn_sigma, g)
    model = nn.Linear(xtr_t.shape[1], 10) if rows else head(a.head, a.groups, stats, a.extra)
    opt = (
        torch.optim.Adam(model.parameters(), lr=a.lr)
        if a.opt == "adam"
        else torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum, nesterov=a.nesterov)
    )
    eng = PrivacyEngine() if a.secure else PrivacyEngine(seed=a.seed + 1000, reproducible=True)
    from torch.utils.data import DataLoader

    from veil.pipeline.loop import _collate_rows, _rows_dataset

    loader = DataLoader(_rows_dataset(xtr_t, ytr_t), batch_size=a.batch, collate_fn=_collate_rows)
    crit = nn.CrossEntropyLoss(label_smoothing=a.smooth)
    model, dopt, dl = eng.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=a.C,
        criterion=crit,
        physical_batch_size=a.pbs,
    )
    if a.flip == "views":  # each example's 2 rows: one averaged gradient, clipped once
        dopt.clipper.group_size = 2
    if a.memtrace:
        print(
            "after make_private rss",
            _rss_mib(),
            "MiB",
            flush=True,
        )
    emas = [float(e) for e in a.ema.split(",")]
    avg = {e: {k: v.detach().clone() for k, v in model.state_dict().items()} for e in emas}
    tail_from = steps - round(a.tail * steps) if a.tail > 0 else None
    tail = None
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(
            dopt.original_optimizer if hasattr(dopt, "original_optimizer") else opt, steps
        )
        if a.cos
        else None
    )
    t0 = time.time()
    done = 0
    while done < steps:
        for xb, yb in dl:
            if a.flip == "views":
                xb, yb = xb.flatten(0, 1), yb.repeat_interleave(2)
            loss = crit(model(xb), yb)
            loss.backward()
            dopt.step()
            dopt.zero_grad()
            if not dl.signal.last_chunk:
                continue
            done += 1
            if a.memtrace:
                print(
                    "step",
                    done,
                    "rss",
                    _rss_mib(),
                    "MiB",
                    flush=True,
                )
            if sched:
                sched.step()
            with torch.no_grad():
                for e in emas:
                    d = min(e, (1 + done) / (10 + done))
                    for k, v in model.state_dict().items():
                        if e > 0 and v.is_floating_point():
                            avg[e][k].mul_(d).add_(v, alpha=1 - d)
                        else:
                            avg[e][k].copy_(v)
            if tail_from is not None and done > tail_from:
                with torch.no_grad():
                    k = done - tail_from
                    sd = model.state_dict()
                    if tail is None:
                        tail = {n_: v.detach().clone() for n_, v in sd.items()}
                    else:
                        for n_, v in sd.items():
                            if v.is_floating_point():
                                tail[n_].mul_((k - 1) / k).add_(v, alpha=1 / k)
            if done >= steps:
                break
    tt = time.time() - t0
    ev = nn.Linear(xtr_t.shape[1], 10) if rows else head(a.head, a.groups, stats, a.extra)
    res, val = {}, {}
    weights = {str(e): avg[e] for e in emas}
    if tail is not None:
        weights[f"tail{a.tail}"] = tail
    for name, w in weights.items():
        ev.load_state_dict(w)
        ev.eval()
        res[name] = accuracy(ev, xte_t, yte_t)
        if len(yva_t):
            val[name] = accuracy(ev, xva_t, yva_t)
    print(
        json.dumps(
            {
                "args": vars(a),
                "sigma": round(sigma, 3),
                "steps": steps,
                "eps_train": round(eng.get_epsilon(1e-5), 3),
                "eps_total": round(epsilon_of(with_steps(prefix, dpsgd_event(q, sigma), steps), 1e-5), 3),
                "val": val,
                "acc": res,
                "train_s": round(tt, 1),
                **_costs(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
