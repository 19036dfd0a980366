"""Privacy units (``--privacy-unit``): tightness against group privacy, and utility unit- vs row-level.

    python bench/privacy_unit.py                 # both parts, a few minutes on 2 busy cores
    python bench/privacy_unit.py --people 4000   # the generated table's size (1–50 visits each)

Tightness. For one unit-level run's settings (q over units, σ, T steps) the unit-level ε of a person
is the accountant's ε of the run (a unit is one record). A row-level DP-SGD run with the *same*
(q, σ, T) gives a person with k rows only group privacy: from its row-level (ε_r, δ_r), the
(ε, δ) group-privacy lemma gives (k·ε_r, k·e^{(k−1)·ε_r}·δ_r) for k rows; δ_r is searched so the
group δ is the target δ. Both ε come from veil's own accountants: the row-level ε at each (tiny) δ_r is
the smaller of the PLD and the RDP accountant's (both are upper bounds; PLD's pessimistic tail
truncation makes it loose below δ ≈ 1e-10, where RDP stays tight). ∞: no δ_r ≥ 1e-300 satisfies the
lemma. TensorFlow Privacy's
``compute_dp_sgd_privacy_statement(max_examples_per_user=K)`` turns a row-level run into a
user-level statement the same way (group privacy); it is the anchor cited, not a dependency.

Utility. Two tables with several rows per person, split by a keyed hash of the person's id (the same
split for both runs, so the test people are never in training): the Stanford heart transplant
start–stop table shipped with lifelines (103 patients, 172 rows; label: the interval ends in death),
and a generated longitudinal table of visits (1–50 rows per person, a logistic model with a per-person
random effect). The same model (logistic regression), epochs and sampling fraction q are trained at
ε = 1 and 3 (δ below 1/N), once protecting rows and once protecting people (K rows per unit by the
default rule). Test accuracy is a non-private diagnostic on held-out people. Research-mode seeds
(``reproducible=True``): the figures can be re-run, they are not releases.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import markdown_table


def group_epsilon(q: float, sigma: float, steps: int, delta: float, k: int) -> float:
    """ε for a person with k rows of a row-level run at (q, σ, T), by the (ε, δ) group-privacy lemma."""
    from veil.accounting.calibrate import dpsgd_event, epsilon_of
    from veil.accounting.events import SelfComposed

    events = [SelfComposed(dpsgd_event(q, sigma), steps)]
    delta_row = delta / k
    for _ in range(500):  # fixed point: δ_row = δ / (k·e^{(k−1)ε_row(δ_row)})
        if delta_row < 1e-300:
            return math.inf
        eps_row = min(epsilon_of(events, delta_row, "pld"), epsilon_of(events, delta_row, "rdp"))
        needed = delta / (k * math.exp(min((k - 1) * eps_row, 700.0)))
        if needed >= delta_row * (1 - 1e-9):
            return k * eps_row
        delta_row = needed
    return math.inf


def tightness(q: float, sigma: float, steps: int, delta: float, ks: list[int]) -> list[list[Any]]:
    from veil.accounting.calibrate import dpsgd_event, epsilon_of
    from veil.accounting.events import SelfComposed

    unit_eps = epsilon_of([SelfComposed(dpsgd_event(q, sigma), steps)], delta)
    return [[k, f"{unit_eps:.3f}", f"{group_epsilon(q, sigma, steps, delta, k):.3f}"] for k in ks]


# -- data -----------------------------------------------------------------------------------------
def heart_table() -> tuple[np.ndarray, np.ndarray, list[object]]:
    """Stanford heart transplants (start–stop rows), features scaled by public constants."""
    import csv
    import importlib.util

    spec = importlib.util.find_spec("lifelines")  # located, not imported (it needs autograd)
    if spec is None or spec.origin is None:
        raise SystemExit("lifelines is not installed: pip install lifelines")
    path = Path(spec.origin).parent / "datasets" / "stanford_heart.csv"
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    x = np.array(
        [
            [
                float(r["start"]) / 1000,
                float(r["stop"]) / 1000,
                float(r["age"]) / 20,
                float(r["year"]) / 6,
                float(r["surgery"]),
                float(r["transplant"]),
            ]
            for r in rows
        ],
        dtype=np.float32,
    )
    y = np.array([int(r["event"]) for r in rows], dtype=np.int64)
    return x, y, [r["id"] for r in rows]


def visits_table(people: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[object]]:
    """1–50 visits per person: y ~ Bernoulli(σ(w·x + z_person)), x ~ N(0, I₃), z ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 51, size=people)
    owner = np.repeat(np.arange(people), counts)
    x = rng.normal(size=(len(owner), 3)).astype(np.float32)
    z = rng.normal(size=people)[owner]
    logit = x @ np.array([1.5, -1.0, 0.5]) + z
    y = (rng.random(len(owner)) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return x, y, [f"person-{p}" for p in owner]


# -- training -------------------------------------------------------------------------------------
def train(
    data: tuple[np.ndarray, ...],
    *,
    units: np.ndarray | None,
    q: float,
    epochs: int,
    epsilon: float,
    delta: float,
    seed: int,
) -> tuple[float, float, float, int]:
    """(test accuracy, seconds, σ, steps) of logistic regression by DP-SGD at (ε, δ)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import veil

    x_tr, y_tr, x_te, y_te = data
    n = len(y_tr) if units is None else len(np.unique(units))
    batch = max(1, round(q * n))
    torch.manual_seed(seed)
    model = nn.Linear(x_tr.shape[1], 2)
    engine = veil.PrivacyEngine(reproducible=True, seed=seed)
    t0 = time.perf_counter()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=2.0),
        data_loader=DataLoader(
            TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr)), batch_size=batch
        ),
        max_grad_norm=1.0,
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        **({} if units is None else {"unit_ids": units}),
    )
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    seconds = time.perf_counter() - t0
    assert engine.get_epsilon(delta) <= epsilon * (1 + 1e-6)
    with torch.no_grad():
        acc = float((model(torch.from_numpy(x_te)).argmax(1).numpy() == y_te).mean())
    assert engine.plan is not None
    return acc, seconds, engine.plan.noise_multiplier, engine.steps


def utility(
    name: str, table: tuple[np.ndarray, np.ndarray, list[object]], q: float, epochs: int, delta: float
) -> list[list[Any]]:
    from veil.data import split_by_unit

    x, y, ids = table
    x_tr, y_tr, x_te, y_te, keys = split_by_unit(x, y, ids, 0.25, seed=0)
    data = (x_tr, y_tr, x_te, y_te)
    out = []
    for epsilon in (1.0, 3.0):
        for label, units in (("rows (add/remove one row)", None), ("people (--privacy-unit)", keys)):
            accs, secs = [], []
            for seed in (0, 1, 2):
                acc, sec, sigma, steps = train(
                    data, units=units, q=q, epochs=epochs, epsilon=epsilon, delta=delta, seed=seed
                )
                accs.append(acc)
                secs.append(sec)
            out.append(
                [
                    name,
                    f"{epsilon:g}",
                    label,
                    f"{np.mean(accs):.3f} ± {np.std(accs):.3f}",
                    f"{sigma:.3f}",
                    steps,
                    f"{np.mean(secs):.1f}",
                ]
            )
    return out


def print_tightness(q: float, steps: int, delta: float) -> None:
    """The unit-level run's ε against group privacy for the same (q, σ, T), σ calibrated to ε = 1."""
    from veil.accounting.calibrate import calibrate_noise

    sigma = float(calibrate_noise(1.0, delta, q, steps))
    print(
        f"## Tightness: one unit-level run (q = {q:.4f}, σ = {sigma:.3f}, T = {steps}, δ = {delta:g}), "
        "and the same (q, σ, T) accounted per row, then by group privacy for a person with k rows\n"
    )
    rows = tightness(q, sigma, steps, delta, [1, 2, 4, 8, 16, 50])
    print(markdown_table(["k rows", "unit-level ε (any k)", "row-level ε by group privacy"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--people", type=int, default=4000, help="people in the generated visits table")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--only", choices=("tightness", "utility"), default=None, help="run one part")
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average at the start (1, 5, 15 min): {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}\n")

    visits = visits_table(args.people)
    n_units = int(0.75 * args.people)  # the training side of the split, about
    q, delta = 256 / n_units, 1e-5
    if args.only != "utility":
        print_tightness(q, args.epochs * math.ceil(1 / q), delta)
    if args.only != "tightness":
        rows = [*utility("Stanford heart (lifelines)", heart_table(), 0.25, 10, 1e-3)]
        name = f"visits, {args.people} people, {len(visits[1])} rows"
        rows += utility(name, visits, q, args.epochs, delta)
        print("\n## Utility: logistic regression, held-out people, 3 seeds (mean ± sd)\n")
        print(markdown_table(["table", "ε", "protects", "test accuracy", "σ", "steps", "seconds"], rows))
    load = os.getloadavg()
    print(f"\nload average at the end (1, 5, 15 min): {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}")


if __name__ == "__main__":
    main()
