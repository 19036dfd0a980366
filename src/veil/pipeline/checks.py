"""The checks a report lists, each recomputed from what the run did (ledger, engine, model).

A failed check does not stop a finished run; it is printed as FAIL in the report's checklist so
that the reader (and ``veil train``'s exit code) sees it.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.events import event_from_dict
from veil.pipeline.seeds import Purpose, derive_seed
from veil.report import Check

if TYPE_CHECKING:
    from torch import nn

    from veil.accounting.ledger import Ledger
    from veil.data import Dataset
    from veil.pipeline.budget import StepPlan
    from veil.pipeline.data import Prepared

__all__ = ["clipping_check", "delta_check", "sampling_detail", "train_checks"]

_CLIP_CHECK_EXAMPLES = 4
_CLIP_CHECK_TOLERANCE = 1e-6


def delta_check(delta: float, n: int) -> Check:
    """δ < 1/N (a larger δ allows publishing a whole record)."""
    return Check(
        name="delta_below_1_over_n",
        passed=bool(delta < 1.0 / n),
        detail=f"δ = {delta:g} < 1/N = {1.0 / n:.3g} (N = {n})",
    )


def sampling_detail(steps: StepPlan) -> str:
    """How the steps were sampled and accounted, in words."""
    gaussian = f"Gaussian(σ = {steps.sigma:.6g})"
    if steps.q == 1.0:
        return (
            "every example is in every step (q = 1: no sampling, no amplification); every step in the "
            f"ledger is accounted as {gaussian}"
        )
    return (
        f"batches drawn by Poisson sampling (each example independently with q = {steps.q:.6g}); every "
        f"step in the ledger is accounted as PoissonSampled(q = {steps.q:.6g}, {gaussian})"
    )


def clipping_check(model: nn.Module, data: Dataset, seed: int, criterion: nn.Module) -> Check:
    """The clipper's clipped sum against a per-example loop, on a float64 copy and synthetic inputs."""
    import torch

    from veil.clipping import PerSampleClipper

    gen = torch.Generator().manual_seed(derive_seed(seed, Purpose.CLIP_CHECK))
    shape = (_CLIP_CHECK_EXAMPLES, *data.input_shape)
    if data.kind == "image" and data.pixel_max:
        x = torch.rand(shape, generator=gen, dtype=torch.float64) * data.pixel_max
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3.0
    y = torch.randint(0, data.num_classes, (_CLIP_CHECK_EXAMPLES,), generator=gen)
    reference = copy.deepcopy(model).double()
    named = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grads, norms = [], []
    for i in range(_CLIP_CHECK_EXAMPLES):
        loss = criterion(reference(x[i : i + 1]), y[i : i + 1])
        g = torch.autograd.grad(loss, [p for _, p in named])
        grads.append(g)
        norms.append(math.sqrt(sum(float((t**2).sum()) for t in g)))
    # A bound between the norms, so that the check covers clipped and unclipped examples.
    bound = float(np.median(norms)) or 1.0
    expected = {n: torch.zeros_like(p) for n, p in named}
    for g, nrm in zip(grads, norms, strict=True):
        factor = min(1.0, bound / max(nrm, 1e-300))
        for (n, _), t in zip(named, g, strict=True):
            expected[n].add_(t * factor)
    clipped = copy.deepcopy(model).double()
    names = {id(p): n for n, p in clipped.named_parameters()}
    clipper = PerSampleClipper(clipped, bound, loss_reduction="sum")
    try:
        loss = torch.nn.functional.cross_entropy(clipped(x), y, reduction="sum")
        loss.backward()
        clipper.accumulate()
        got = {names[id(p)]: t for p, t in zip(clipper.parameters, clipper.clipped_sum(), strict=True)}
    finally:
        clipper.remove()
    if set(got) != set(expected):
        rel = math.inf
    else:
        num = math.sqrt(sum(float(((got[n] - e) ** 2).sum()) for n, e in expected.items()))
        den = math.sqrt(sum(float((e**2).sum()) for e in expected.values())) or 1.0
        rel = num / den
    n_clipped = sum(1 for nrm in norms if nrm > bound)
    return Check(
        name="per_sample_clipping",
        passed=bool(rel < _CLIP_CHECK_TOLERANCE),
        detail=(
            f"the clipper's clipped gradient sum on this model matches a per-example reference loop "
            f"(float64, {_CLIP_CHECK_EXAMPLES} synthetic examples, "
            f"{n_clipped} clipped): relative error {rel:.2e} "
            f"(tolerance {_CLIP_CHECK_TOLERANCE:g})"
        ),
    )


def train_checks(
    prepared: Prepared,
    steps: StepPlan,
    eps: float,
    engine_eps: float,
    engine: Any,
    ledger: Ledger,
    clip_check: Check,
) -> list[Check]:
    """The checklist of a ``veil train`` report, each item recomputed from the ledger and the engine."""
    cfg, prep = prepared.cfg, prepared.prep
    n = prepared.data.n_train
    step_dict = steps.step_event.to_dict()
    poisson_ok = (
        engine.sampling == "poisson"
        and engine.sampling_rate == steps.q
        and engine.noise_multiplier == steps.sigma
        and all(r["event"] == step_dict for r in ledger.of_kind("step"))
    )
    pre_records = list(ledger.of_kind("event"))
    if prep.public:
        data_detail = f"preprocessing is public ({prep.description})"
        data_ok = not pre_records
    else:
        assert prep.event is not None
        data_ok = bool(pre_records) and all(event_from_dict(r["event"]) == prep.event for r in pre_records)
        data_detail = (
            f"preprocessing is a DP release charged in the ledger ({prep.description}; "
            f"{len(pre_records)} release(s), event {prep.event.to_json()})"
        )
    return [
        Check(
            name="epsilon_reported",
            passed=bool(math.isfinite(eps) and eps <= cfg.epsilon and engine_eps <= eps + 1e-9),
            detail=(
                f"ε = {eps:.6g} ≤ target {cfg.epsilon:g} at δ = "
                f"{cfg.delta:g}, composed by the {cfg.accountant} "
                f"accountant from all {len(ledger.events())} events "
                "in the ledger (the engine's own accountant, "
                f"which saw only this process's steps, reports {engine_eps:.6g})"
            ),
        ),
        delta_check(cfg.delta, n),
        Check(
            name="poisson_sampling_matches_accountant",
            passed=bool(poisson_ok),
            detail=sampling_detail(steps),
        ),
        clip_check,
        Check(
            name="no_unaccounted_data_use",
            passed=bool(data_ok),
            detail=(
                f"{data_detail}; model '{prepared.model_name}' and "
                "hyperparameters come from the configuration and "
                "veil's presets, not from the private data; the "
                "final iterate is released (no model selection "
                "or early stopping on private data)"
            ),
        ),
    ]
