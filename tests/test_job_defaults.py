"""The jobs' defaults keep the guarantee: secure randomness, declared labels, a neighbour-preserving
split, and a checklist whose every item fails when its property is broken."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from veil.accounting.calibrate import dpsgd_event
from veil.accounting.events import Gaussian
from veil.errors import ConfigError
from veil.pipeline.budget import StepPlan
from veil.pipeline.checks import (
    clipping_check,
    data_use_check,
    delta_check,
    epsilon_check,
    participation_check,
    sampling_check,
    unlabelled_non_private,
)
from veil.pipeline.randomness import randomness_check, release_ready


# -- secure by default ---------------------------------------------------------------------------
def _train(tmp_path: Path, name: str, **changes: Any) -> Any:
    from veil.training import train

    cfg = {
        "dataset": "digits",
        "epochs": 1,
        "baseline": False,
        "checkpoint_every": 2,
        "out": str(tmp_path / name),
    }
    return train({**cfg, **changes}, progress=False)


def _weights(folder: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(folder / "model.pt", weights_only=True))


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Byte strings that a stored noise seed or generator state would leave in a file (torch.save keeps
# dict keys as plain pickle strings).
GENERATOR_MARKS = (b"noise_rng", b"bit_generator", b"PCG64", b"rng_state")


def test_default_runs_draw_fresh_noise_and_store_no_noise_seed(tmp_path: Path) -> None:
    from veil.pipeline.seeds import Purpose, derive_seed

    a, b = _train(tmp_path, "a"), _train(tmp_path, "b")
    assert a.randomness == b.randomness == "secure" and a.release_ready and a.all_checks_passed
    assert not _same(_weights(tmp_path / "a"), _weights(tmp_path / "b"))  # same flags, other noise
    engine_seed = str(derive_seed(0, Purpose.ENGINE)).encode()
    files = [p for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert any(p.parent.name == "checkpoints" for p in files)  # checkpoints are scanned too
    for path in files:
        data = path.read_bytes()
        assert engine_seed not in data, path
        assert not any(mark in data for mark in GENERATOR_MARKS), path
    # Research mode: replayable, so never release-ready; and the scan above does see its state.
    r1 = _train(tmp_path, "r1", reproducible=True)
    _train(tmp_path, "r2", reproducible=True)
    assert _same(_weights(tmp_path / "r1"), _weights(tmp_path / "r2"))
    assert r1.randomness == "seeded" and not r1.release_ready
    assert not next(c for c in r1.checks if c.name == "secure_randomness").passed
    assert "knows the seed" in r1.covers
    ckpts = list((tmp_path / "r1" / "checkpoints").glob("*.pt"))
    assert ckpts and any(b"noise_rng" in p.read_bytes() for p in ckpts)


def test_legacy_secure_rng_key_maps_onto_reproducible() -> None:
    from veil.config import make_config, resolve_config

    assert make_config({"secure_rng": False}).reproducible is True
    assert make_config({"secure_rng": True}).reproducible is False
    with pytest.raises(ConfigError, match="secure_rng"):
        make_config({"reproducible": True, "secure_rng": True})
    assert resolve_config(None, {"reproducible": True, "secure_rng": None}).reproducible is True


# -- the label set is declared -----------------------------------------------------------------------
def _csv(tmp_path: Path, rows: list[tuple[float, float, str]], name: str) -> str:
    p = tmp_path / name
    p.write_text("a,b,label\n" + "".join(f"{a},{b},{y}\n" for a, b, y in rows))
    return f"csv:{p}"


def test_a_unique_label_never_shows_in_the_output_width(tmp_path: Path) -> None:
    from veil.config import make_config
    from veil.pipeline.data import prepare
    from veil.pipeline.model import build_net

    rows = [(float(i), float(i % 5), "x" if i % 2 else "y") for i in range(40)]
    with_z = _csv(tmp_path, [*rows, (99.0, 99.0, "z")], "with.csv")
    without = _csv(tmp_path, rows, "without.csv")
    base = {"target": "label", "feature_bounds": [[0.0, 100.0]]}
    with pytest.raises(ConfigError, match="classes"):  # no declaration: refused, nothing read off the rows
        prepare(make_config({**base, "dataset": with_z}))
    # An undeclared label drops its row (a per-record rule, issue 23 item 7): the data are those without it.
    dropped = prepare(make_config({**base, "dataset": with_z, "classes": ["x", "y"]})).data
    assert dropped.rules["rows_dropped_label_not_declared"] == 1
    assert dropped.n_train + dropped.n_test == len(rows) and dropped.classes == ["x", "y"]
    widths = []
    for dataset in (with_z, without):
        prepared = prepare(make_config({**base, "dataset": dataset, "classes": ["x", "y", "z"]}))
        net = build_net(prepared.cfg, prepared.data, 0)
        widths.append([p.shape for p in net.parameters()])
        assert prepared.data.classes == ["x", "y", "z"]
    assert widths[0] == widths[1]  # the model's shape is the same with or without the unique row


def test_builtin_datasets_declare_their_label_set() -> None:
    from veil.data import load_dataset

    assert load_dataset("breast-cancer").classes == ["malignant", "benign"]
    with pytest.raises(ConfigError, match="declares its own"):
        load_dataset("breast-cancer", classes=["a", "b"])


# -- the split keeps neighbours neighbouring -------------------------------------------------------------
def test_adding_or_removing_a_row_moves_only_that_row() -> None:
    from sklearn import datasets

    from veil.data import held_out

    bunch = datasets.load_digits()
    x, y = bunch.data.astype(np.float32), bunch.target
    side = held_out(x, y, 0.2, seed=0)
    for i in (0, 17, 900):
        removed = held_out(np.delete(x, i, 0), np.delete(y, i), 0.2, seed=0)
        np.testing.assert_array_equal(removed, np.delete(side, i))
    new = np.full((1, x.shape[1]), 3.0, np.float32)
    added = held_out(np.concatenate([x, new]), np.append(y, 4), 0.2, seed=0)
    np.testing.assert_array_equal(added[:-1], side)
    assert not np.array_equal(held_out(x, y, 0.2, seed=1), side)  # the seed is the split's key


# -- every check fails when its property breaks ---------------------------------------------------------
def test_epsilon_and_delta_checks_fail_when_broken() -> None:
    assert epsilon_check(2.9, 2.9, 3.0, 1e-5, "pld", 10).passed
    assert not epsilon_check(3.1, 3.1, 3.0, 1e-5, "pld", 10).passed  # over the target
    assert not epsilon_check(2.0, 2.5, 3.0, 1e-5, "pld", 10).passed  # the ledger missed steps
    assert not epsilon_check(math.inf, 0.0, 3.0, 1e-5, "pld", 10).passed
    assert delta_check(1e-5, 1000).passed and not delta_check(1e-3, 1000).passed


class _Ledger:
    def __init__(self, steps: list[dict[str, Any]], events: list[dict[str, Any]] | None = None) -> None:
        self.records = {"step": steps, "event": events or []}

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return self.records.get(kind, [])


def test_sampling_check_fails_on_a_wrong_rate_event_or_draw() -> None:
    n, batch, sigma, taken = 1000, 100, 1.2, 50
    q = batch / n
    steps = StepPlan(q, 10, 50, sigma)
    event = dpsgd_event(q, sigma).to_dict()
    ledger = _Ledger([{"event": event}] * taken)
    engine = SimpleNamespace(sampling="poisson", sampling_rate=q, noise_multiplier=sigma)
    drawn = int(np.random.default_rng(0).binomial(n * taken, q))
    assert sampling_check(steps, n, batch, engine, ledger, (drawn, taken)).passed
    # The loader drew at twice the accounted rate.
    assert not sampling_check(steps, n, batch, engine, ledger, (2 * drawn, taken)).passed
    # Fixed-size shuffled batches, or another rate in the engine.
    shuffled = SimpleNamespace(sampling="shuffle", sampling_rate=q, noise_multiplier=sigma)
    assert not sampling_check(steps, n, batch, shuffled, ledger, (drawn, taken)).passed
    # A ledger step accounted at another rate than B/N.
    wrong = _Ledger([{"event": dpsgd_event(q / 2, sigma).to_dict()}] * taken)
    assert not sampling_check(steps, n, batch, engine, wrong, (drawn, taken)).passed
    # A plan whose q is not B/N (the old check compared the plan with itself).
    assert not sampling_check(StepPlan(q / 2, 10, 50, sigma), n, batch, engine, ledger, (drawn, taken)).passed


def test_the_sampling_checks_release_pass_or_fail_not_the_count_they_tested() -> None:
    """The count of examples (or clients) the sampler drew depends on the private rows and is not
    accounted: two counts with the same verdict give the same released text (revB)."""
    n, batch, sigma, taken = 1000, 100, 1.2, 50
    q = batch / n
    steps = StepPlan(q, 10, 50, sigma)
    ledger = _Ledger([{"event": dpsgd_event(q, sigma).to_dict()}] * taken)
    engine = SimpleNamespace(sampling="poisson", sampling_rate=q, noise_multiplier=sigma)
    first, second = (sampling_check(steps, n, batch, engine, ledger, (d, taken)) for d in (4990, 5013))
    assert first.passed and second.passed and first.detail == second.detail
    clients = [participation_check(c, 8, 0.5) for c in ([3, 4, 5], [4, 4, 5])]
    assert clients[0].passed and clients[1].passed and clients[0].detail == clients[1].detail


def test_clipping_check_fails_when_the_clipper_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from veil.clipping import PerSampleClipper

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    data = SimpleNamespace(input_shape=(1, 8, 8), kind="image", pixel_max=16.0, num_classes=10)
    assert clipping_check(model, data, 0, nn.CrossEntropyLoss()).passed  # type: ignore[arg-type]
    original = PerSampleClipper.clipped_sum
    monkeypatch.setattr(PerSampleClipper, "clipped_sum", lambda self: [1.01 * t for t in original(self)])
    assert not clipping_check(model, data, 0, nn.CrossEntropyLoss()).passed  # type: ignore[arg-type]


def test_randomness_check_and_release_ready() -> None:
    secure, seeded = randomness_check("secure"), randomness_check("seeded")
    assert secure.passed and not seeded.passed and "knows the seed" in seeded.detail
    assert release_ready("secure", [secure]) and not release_ready("seeded", [secure])
    assert not release_ready("secure", [secure, seeded])


def _prepared(public: bool = True) -> Any:
    prep = SimpleNamespace(public=public, description="pixels / 16", event=None)
    return SimpleNamespace(prep=prep, model_name="rff", whitening=None)


GOOD_REPORT = {
    "epsilon_spent": 3.0,
    "label_set": {"source": "declared", "classes": ["0", "1"], "declared_by": "docs"},
    "non_private": {"test_accuracy": 0.9, "history": {"dp": []}, "audit": None},
}


def test_data_use_check_fails_on_unlabelled_or_unaccounted_use() -> None:
    assert data_use_check(_prepared(), _Ledger([]), GOOD_REPORT).passed
    stray = {**GOOD_REPORT, "test_accuracy": 0.9}  # a test metric outside the non_private section
    assert unlabelled_non_private(stray) == ["test_accuracy"]
    assert not data_use_check(_prepared(), _Ledger([]), stray).passed
    nested = {**GOOD_REPORT, "dataset": {"baseline_test_accuracy": 0.95}}
    assert not data_use_check(_prepared(), _Ledger([]), nested).passed
    undeclared = {**GOOD_REPORT, "label_set": {"source": "data"}}
    assert not data_use_check(_prepared(), _Ledger([]), undeclared).passed
    # Public preprocessing, yet the ledger holds a release; or a DP one that is missing.
    assert not data_use_check(_prepared(), _Ledger([], [{"event": {}}]), GOOD_REPORT).passed
    dp = _prepared(public=False)
    dp.prep.event = dpsgd_event(1.0, 2.0)
    assert not data_use_check(dp, _Ledger([]), GOOD_REPORT).passed
    # The scattering preset's Gram release (veil.data.whitening): one, as planned, or the check fails.
    from veil.data.whitening import WhiteningPlan

    gram = {"label": "whitening", "event": Gaussian(6.0).to_dict()}
    assert not data_use_check(_prepared(), _Ledger([], [gram]), GOOD_REPORT).passed  # not planned
    whitened = _prepared()
    whitened.whitening = WhiteningPlan(6.0, 0.02, 60.0)
    assert data_use_check(whitened, _Ledger([], [gram]), GOOD_REPORT).passed
    assert not data_use_check(whitened, _Ledger([]), GOOD_REPORT).passed  # planned, not in the ledger
    assert not data_use_check(whitened, _Ledger([], [gram, gram]), GOOD_REPORT).passed  # twice


# -- hints never advise spending the budget again ------------------------------------------------------------
def test_resume_refusals_point_to_resume_or_the_budget_registry(tmp_path: Path) -> None:
    from veil.accounting.ledger import Ledger
    from veil.config import make_config
    from veil.errors import CheckpointError
    from veil.pipeline.checkpoints import check_overrides, load_checkpoint
    from veil.pipeline.run_folder import check_out

    saved = make_config({"epsilon": 3.0})
    with pytest.raises(CheckpointError) as changed:
        check_overrides(saved, {"epsilon": 5.0})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ledger.jsonl").write_text("")
    with pytest.raises(ConfigError) as taken:
        check_out(tmp_path / "run")
    ledger = Ledger.create(tmp_path / "l.jsonl", {"target_epsilon": 3.0})
    ledger.append("checkpoint", charged=1, applied=1, file="checkpoints/step-0000001.pt", sha256="0" * 64)
    with pytest.raises(CheckpointError) as lost:
        load_checkpoint(tmp_path, ledger)
    ledger.close()
    for err in (changed, taken, lost):
        message = str(err.value)
        assert "another --out" not in message and "new run with" not in message, message
        assert "--resume" in message or "veil budget" in message, message
