"""The checks a report lists, each recomputed from what the run did (ledger, engine, model).

A failed check does not stop a finished run; it is printed as FAIL in the report's checklist and
named in ``veil train``'s summary, and it makes the report's ``release_ready`` false.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from veil.accounting.calibrate import dpsgd_event
from veil.accounting.events import event_from_dict
from veil.pipeline.public_inputs import synthetic_inputs
from veil.pipeline.seeds import Purpose, derive_seed
from veil.report import NON_PRIVATE_FIELDS, Check

if TYPE_CHECKING:
    from torch import nn

    from veil.accounting.ledger import Ledger
    from veil.data import Dataset
    from veil.pipeline.budget import StepPlan
    from veil.pipeline.data import Prepared

__all__ = [
    "binomial_draws",
    "clipping_check",
    "data_use_check",
    "delta_check",
    "epsilon_check",
    "participation_check",
    "sampling_check",
    "sampling_detail",
    "train_checks",
    "unlabelled_non_private",
]

_CLIP_CHECK_EXAMPLES = 4
_CLIP_CHECK_TOLERANCE = 1e-6


def epsilon_check(
    eps: float, engine_eps: float, target: float, delta: float, accountant: str, events: int
) -> Check:
    """The ledger's ε is finite, within the target, and not below what the engine itself counted."""
    return Check(
        name="epsilon_reported",
        passed=bool(math.isfinite(eps) and eps <= target and engine_eps <= eps + 1e-9),
        detail=(
            f"ε = {eps:.6g} ≤ target {target:g} at δ = {delta:g}, composed by the {accountant} "
            f"accountant from all {events} events in the ledger (the engine's own accountant, "
            f"which saw only this process's steps, reports {engine_eps:.6g})"
        ),
    )


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
    x = synthetic_inputs(model, data, _CLIP_CHECK_EXAMPLES, gen)
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


# A realised total batch size further than this many standard deviations from its Poisson mean fails
# the sampling check: false-failure rate below 2e-9 (a two-sided normal tail at 6σ, plus the
# continuity margin of one example).
_SAMPLING_Z = 6.0


#: Why a sampling check states pass or fail but not the count it tested: the count is the sampler's draw
#: over the private rows (one record's presence moves it), which the accountant does not release.
_COUNT_WITHHELD = "the count is not released: the sampler's draw over the private rows is not accounted"


def binomial_draws(drawn: int, trials: int, q: float) -> tuple[float, bool]:
    """(z, within): how far ``drawn`` successes lie from Binomial(``trials``, q)'s mean, in standard
    deviations, and whether within :data:`_SAMPLING_Z` of them (plus one for a point mass). Under the
    right law a two-sided 6σ bound fails with probability about 2e-9 (normal approximation)."""
    mean = trials * q
    sd = math.sqrt(trials * q * (1 - q))
    z = abs(drawn - mean) / sd if sd > 0 else (0.0 if drawn == mean else math.inf)
    return z, trials == 0 or abs(drawn - mean) <= _SAMPLING_Z * sd + 1.0


def participation_check(sampled: list[int], clients: int, q: float) -> Check:
    """Client-level federated learning: the clients the server sampled, round by round (``sampled``,
    counts from the ledger), total within :data:`_SAMPLING_Z` standard deviations of
    Binomial(clients · rounds, q), the rate the accountant's events assume. A server that samples at
    another rate (2q; 1.1q once clients · rounds · q is a few thousand) fails."""
    rounds, drawn = len(sampled), int(sum(sampled))
    _, ok = binomial_draws(drawn, rounds * clients, q)
    return Check(
        name="poisson_client_sampling_matches_accountant",
        passed=bool(ok),
        detail=(
            f"the clients sampled over {rounds} rounds of {clients} {'lie' if ok else 'do NOT lie'} within "
            f"{_SAMPLING_Z:g} standard deviations of the {rounds * clients * q:.1f} expected at the "
            f"accounted q = {q:.6g} ({_COUNT_WITHHELD})"
        ),
    )


def sampling_check(
    steps: StepPlan,
    n: int,
    batch_size: int,
    engine: Any,
    ledger: Ledger,
    sampled: tuple[int, int],
    drawn_from: int | None = None,
) -> Check:
    """The steps were sampled and accounted as claimed, from evidence independent of the plan.

    * the plan's q and every ``step`` in the ledger carry the event recomputed here from the
      configuration (q = B/N and σ) by :func:`~veil.accounting.calibrate.dpsgd_event`;
    * the engine's loader samples by Poisson at that q and noises at that σ;
    * the batches this process drew (``sampled`` = (examples drawn, logical steps)) total within
      6 standard deviations of Binomial(N·steps, q): a loader that drew at another rate fails.

    ``n``: the size q is planned on; ``drawn_from``: the records the loader draws from, when they
    differ (a public planned size, :attr:`veil.pipeline.data.Prepared.plan_size`).
    """
    q = min(1.0, batch_size / n)
    rows = n if drawn_from is None else drawn_from
    expected = dpsgd_event(q, steps.sigma).to_dict()
    events_ok = steps.q == q and all(r["event"] == expected for r in ledger.of_kind("step"))
    engine_ok = (
        engine.sampling == "poisson" and engine.sampling_rate == q and engine.noise_multiplier == steps.sigma
    )
    drawn, taken = sampled
    mean = taken * rows * q
    _, draws_ok = binomial_draws(drawn, taken * rows, q)
    return Check(
        name="poisson_sampling_matches_accountant",
        passed=bool(events_ok and engine_ok and draws_ok),
        detail=(
            f"{sampling_detail(steps)}; the ledger's step events "
            f"{'all equal' if events_ok else 'DIFFER from'} the event recomputed from B/N = {q:.6g}; "
            f"the engine {'samples' if engine_ok else 'does NOT sample'} by Poisson at that rate; "
            f"the examples this process drew in {taken} steps {'lie' if draws_ok else 'do NOT lie'} within "
            f"{_SAMPLING_Z:g} standard deviations of the {mean:.1f} expected ({_COUNT_WITHHELD})"
        ),
    )


def unlabelled_non_private(report: Any, path: str = "") -> list[str]:
    """Paths in a report dict where a non-private figure sits outside the ``non_private`` section."""
    found: list[str] = []
    if isinstance(report, dict):
        for key, value in report.items():
            here = f"{path}.{key}" if path else str(key)
            if key == "non_private" and not path:
                continue
            if key in NON_PRIVATE_FIELDS:
                found.append(here)
            found.extend(unlabelled_non_private(value, here))
    elif isinstance(report, list):
        for i, value in enumerate(report):
            found.extend(unlabelled_non_private(value, f"{path}[{i}]"))
    return found


def data_use_check(prepared: Prepared, ledger: Ledger, report: dict[str, Any]) -> Check:
    """Every use of the private data is accounted in the ledger, declared public, or labelled non-private.

    ``report``: the report as a dict (its checks aside). Fails when the preprocessing release or the
    whitening's Gram release (:mod:`veil.data.whitening`) is not in the ledger as planned, the label
    set was not declared (nor DP-released), or a non-private figure (test metrics, baseline, losses,
    audit) sits outside the ``non_private`` section."""
    prep = prepared.prep
    records = list(ledger.of_kind("event"))
    pre_records = [r for r in records if r.get("label") != "whitening"]
    gram_records = [r for r in records if r.get("label") == "whitening"]
    w = prepared.whitening
    if w is None:
        gram_ok, gram_detail = not gram_records, None
    else:
        gram_ok = len(gram_records) == 1 and event_from_dict(gram_records[0]["event"]) == w.event
        gram_detail = (
            f"the whitening's Gram matrix is a DP release charged in the ledger before the steps "
            f"({len(gram_records)} release(s), event {w.event.to_json()})"
        )
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
    labels = report.get("label_set") or {}
    labels_ok = labels.get("source") == "declared"
    stray = unlabelled_non_private({k: v for k, v in report.items() if k != "checks"})
    data_ok = data_ok and gram_ok
    parts = [
        data_detail,
        *([] if gram_detail is None else [gram_detail]),
        f"label set {'declared public' if labels_ok else 'NOT declared'} ({labels.get('declared_by', '?')})",
        "test metrics, baseline and audit only in the non_private section"
        if not stray
        else "non-private figures outside the non_private section: " + ", ".join(stray),
        f"model '{prepared.model_name}' and hyperparameters come from the configuration and veil's "
        "presets, not from the private data; the final iterate is released (no model selection or "
        "early stopping on private data)",
    ]
    return Check(
        name="no_unaccounted_data_use",
        passed=bool(data_ok and labels_ok and not stray),
        detail="; ".join(parts),
    )


def train_checks(
    prepared: Prepared,
    steps: StepPlan,
    eps: float,
    engine_eps: float,
    engine: Any,
    ledger: Ledger,
    clip_check: Check,
    sampled: tuple[int, int],
) -> list[Check]:
    """The checklist of a ``veil train`` report, each item recomputed from the ledger and the engine
    (``no_unaccounted_data_use`` needs the report itself: :func:`data_use_check`)."""
    from veil.pipeline.randomness import randomness_check, randomness_of

    cfg = prepared.cfg
    n = prepared.n_planned  # units with a privacy unit: what δ and q are counted against
    assert cfg.batch_size is not None
    return [
        epsilon_check(eps, engine_eps, cfg.epsilon, cfg.delta, cfg.accountant, len(ledger.events())),
        delta_check(cfg.delta, n),
        sampling_check(steps, n, cfg.batch_size, engine, ledger, sampled, prepared.data.n_records),
        clip_check,
        randomness_check(randomness_of(cfg.reproducible)),
    ]
