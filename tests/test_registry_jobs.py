"""Every job that spends privacy on a dataset is charged to the budget registry, composed, never added.

The composition rule (``veil.registry.compose``): the tighter of PLD and RDP among the accountants that
bound every charged event; RDP-only events (exponential mechanism, zCDP reservations, RepeatAndSelect)
put the whole dataset in RDP; ``DeltaOnly`` parts are taken off δ. References are independent:
dp-accounting's PLD and RDP accountants, and the RDP → (ε, δ) conversion written out below.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import RdpAccountant

from _budget_cli import cli as _cli
from _budget_cli import show as _show
from veil.accounting.events import (
    Composed,
    DeltaOnly,
    ExponentialMechanism,
    Gaussian,
    Laplace,
    OneOf,
    PoissonSampled,
    PrivacyEvent,
    RepeatAndSelect,
    SelfComposed,
    ZeroConcentrated,
    event_from_dict,
)
from veil.accounting.pld import PLDAccountant
from veil.accounting.rdp import DEFAULT_ORDERS, RDPAccountant
from veil.errors import BudgetExhaustedError, UnsupportedEventError
from veil.registry.compose import accountants_for, spent_epsilon
from veil.registry.store import BudgetRegistry


def _dpa(event: PrivacyEvent) -> dpe.DpEvent:
    """The same event in dp-accounting's vocabulary."""
    if isinstance(event, Gaussian):
        return dpe.GaussianDpEvent(event.noise_multiplier)
    if isinstance(event, Laplace):
        return dpe.LaplaceDpEvent(event.noise_multiplier)
    if isinstance(event, PoissonSampled):
        return dpe.PoissonSampledDpEvent(event.sampling_rate, _dpa(event.event))
    if isinstance(event, SelfComposed):
        return dpe.SelfComposedDpEvent(_dpa(event.event), event.count)
    if isinstance(event, Composed):
        return dpe.ComposedDpEvent([_dpa(e) for e in event.events])
    if isinstance(event, OneOf) and len(event.events) == 1:
        return _dpa(event.events[0])
    if isinstance(event, RepeatAndSelect):
        shape = math.inf if event.law == "poisson" else event.shape
        return dpe.RepeatAndSelectDpEvent(_dpa(event.event), event.mean, shape)
    raise TypeError(type(event).__name__)


def _rdp_epsilon(curve: np.ndarray, delta: float) -> float:
    """RDP → (ε, δ) (Canonne, Kamath & Steinke 2020, Prop. 12), written out over veil's orders."""
    a = np.asarray(DEFAULT_ORDERS)
    return float(np.min(curve + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)))


def _reference(events: list[PrivacyEvent], delta: float) -> tuple[float, float]:
    """(dp-accounting PLD ε, dp-accounting RDP ε) of events without DeltaOnly parts."""
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    rdp = RdpAccountant(orders=list(DEFAULT_ORDERS))
    for e in events:
        pld.compose(_dpa(e))
        rdp.compose(_dpa(e))
    return pld.get_epsilon(delta), rdp.get_epsilon(delta)


# -- the composition rule -----------------------------------------------------------------------


def test_pld_supported_events_get_the_tighter_of_pld_and_rdp() -> None:
    runs = [[SelfComposed(PoissonSampled(0.01, Gaussian(1.0)), 800)], [SelfComposed(Laplace(20.0), 10)]]
    assert accountants_for([e for r in runs for e in r]) == ["pld", "rdp"]
    pld_ref, rdp_ref = _reference([e for r in runs for e in r], 1e-5)
    got = spent_epsilon(runs, 1e-5)
    assert got == pytest.approx(min(pld_ref, rdp_ref), rel=0.01)
    assert got == pytest.approx(spent_epsilon(runs, 1e-5, "pld"), rel=1e-12)  # PLD wins here
    assert got < spent_epsilon(runs, 1e-5, "rdp")


def test_an_exponential_mechanism_puts_the_dataset_in_rdp() -> None:
    """PLD cannot bound the selection: the whole composition is RDP's, checked in closed form."""
    sigma, eps_em, n_em = 4.0, 0.3, 5
    runs = [[Gaussian(sigma)], [SelfComposed(ExponentialMechanism(eps_em), n_em)]]
    assert accountants_for([e for r in runs for e in r]) == ["rdp"]
    a = np.asarray(DEFAULT_ORDERS)
    curve = a / (2 * sigma**2) + n_em * np.minimum(a * eps_em**2 / 8, eps_em)
    assert spent_epsilon(runs, 1e-6) == pytest.approx(_rdp_epsilon(curve, 1e-6), rel=1e-9)
    with pytest.raises(UnsupportedEventError, match="ExponentialMechanism"):
        spent_epsilon(runs, 1e-6, "pld")  # a data owner who chose PLD only gets a refusal, naming it


def test_no_accountant_for_every_event_is_refused_naming_one() -> None:
    # Poisson-sampled Laplace: PLD only; the exponential mechanism: RDP only.
    with pytest.raises(UnsupportedEventError, match="PoissonSampled"):
        spent_epsilon([[PoissonSampled(0.1, Laplace(1.0))], [ExponentialMechanism(0.1)]], 1e-6)


def test_delta_only_parts_come_off_delta() -> None:
    events = [SelfComposed(Laplace(2.0), 40)]  # pure ε = 20: the accountants' bound is far smaller
    plain = PLDAccountant().compose(events[0]).epsilon(1e-6 - 3e-7)
    assert plain < 20
    assert spent_epsilon([[*events, DeltaOnly(1e-7), DeltaOnly(2e-7)]], 1e-6, "pld") == pytest.approx(plain)
    # δ used up by the (0, δ) parts: only the pure bound (basic composition) is left; beyond δ: none.
    assert spent_epsilon([[*events, *[DeltaOnly(1e-7)] * 10]], 1e-6) == pytest.approx(20.0)
    assert math.isinf(
        spent_epsilon([[SelfComposed(PoissonSampled(0.1, Gaussian(1.0)), 10), DeltaOnly(1e-6)]], 1e-6)
    )
    assert math.isinf(spent_epsilon([[*events, DeltaOnly(2e-6)]], 1e-6))


def test_an_approximate_dp_guarantee_composes_as_randomized_response_plus_its_delta() -> None:
    """PATE's (ε, δ): δ off the total, the ε part as RR(ε) in RDP (closed form), or its pure ε alone."""
    from veil.accounting.events import ApproximateDP

    eps, d = 2.0, 1e-6
    p = math.exp(eps) / (1 + math.exp(eps))
    a = np.asarray(DEFAULT_ORDERS)
    small = a <= 20  # the textbook form, where it does not overflow; log-space beyond
    rr = np.logaddexp(a * math.log(p) + (1 - a) * math.log1p(-p), a * math.log1p(-p) + (1 - a) * math.log(p))
    rr = rr / (a - 1)
    direct = np.log(p ** a[small] * (1 - p) ** (1 - a[small]) + (1 - p) ** a[small] * p ** (1 - a[small]))
    np.testing.assert_allclose(rr[small], direct / (a[small] - 1), rtol=1e-12)
    assert np.all(rr <= np.minimum(eps, a * eps**2 / 2) + 1e-12)  # ε-DP ⇒ ε²/2-zCDP (Bun & Steinke)
    gauss = Gaussian(3.0)
    got = spent_epsilon([[ApproximateDP(eps, d)], [gauss]], 1e-5)
    assert got == pytest.approx(_rdp_epsilon(rr + a / 18, 1e-5 - d), rel=1e-9)
    assert spent_epsilon([[ApproximateDP(eps, d)]], d) == pytest.approx(eps)  # reported at its own δ
    assert event_from_dict(ApproximateDP(eps, d).to_dict()) == ApproximateDP(eps, d)


def test_zcdp_reservation_dominates_what_synth_releases() -> None:
    """ρ-zCDP is RDP α·ρ; Gaussian and exponential-mechanism events of total ρ stay below it."""
    rho = 0.05
    released = [Gaussian(1 / math.sqrt(2 * rho / 2)), ExponentialMechanism(math.sqrt(8 * rho / 2))]
    assert spent_epsilon([released], 1e-6) <= spent_epsilon([[ZeroConcentrated(rho)]], 1e-6)
    a = np.asarray(DEFAULT_ORDERS)
    assert spent_epsilon([[ZeroConcentrated(rho)]], 1e-6) == pytest.approx(_rdp_epsilon(a * rho, 1e-6))
    with pytest.raises(UnsupportedEventError, match="ZeroConcentrated"):
        PLDAccountant().compose(ZeroConcentrated(rho))


@pytest.mark.parametrize(
    ("law", "shape"), [("negative_binomial", 0.5), ("negative_binomial", 1.0), ("poisson", 1.0)]
)
def test_repeat_and_select_matches_dp_accounting_and_pld_refuses_it(law: str, shape: float) -> None:
    trial = Composed([SelfComposed(PoissonSampled(0.05, Gaussian(1.2)), 200), Gaussian(5.0)])
    event = RepeatAndSelect(trial, 3.0, law, shape)
    assert event_from_dict(json.loads(event.to_json())) == event
    ref = RdpAccountant(orders=list(DEFAULT_ORDERS))
    ref.compose(_dpa(event))
    curve = np.minimum.accumulate(np.asarray(ref._rdp)[::-1])[::-1]  # RDP is monotone in the order
    assert spent_epsilon([[event]], 1e-5) == pytest.approx(_rdp_epsilon(curve, 1e-5), rel=1e-6)
    with pytest.raises(UnsupportedEventError, match=r"RepeatAndSelect.*Rényi divergences.*events_rdp"):
        PLDAccountant().compose(event)  # a clear refusal, naming the event and where it is bounded
    with pytest.raises(UnsupportedEventError, match="RepeatAndSelect"):
        spent_epsilon([[event]], 1e-5, "pld")


def test_one_of_is_the_pointwise_largest_curve() -> None:
    a, b = Gaussian(2.0), SelfComposed(ExponentialMechanism(0.2), 3)
    curve_a = RDPAccountant().compose(a).rdp
    curve_b = RDPAccountant().compose(b).rdp
    assert spent_epsilon([[OneOf([a, b])]], 1e-6) == pytest.approx(
        _rdp_epsilon(np.maximum(curve_a, curve_b), 1e-6), rel=1e-9
    )
    assert event_from_dict(OneOf([a, b]).to_dict()) == OneOf([a, b])


def test_a_dataset_refuses_a_run_no_accountant_can_compose_with_its_others(tmp_path: Path) -> None:
    with BudgetRegistry(tmp_path / "b.db") as reg:
        reg.reserve("ds", [PoissonSampled(0.1, Laplace(2.0))], "r1", delta=1e-6)
        with pytest.raises(UnsupportedEventError):
            reg.reserve("ds", [ExponentialMechanism(0.5)], "r2", delta=1e-6)
        assert [r.run_id for r in reg.status("ds").runs] == ["r1"]


# -- the jobs ---------------------------------------------------------------------------------------


def test_schema_release_and_training_are_composed_in_budget_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tables_support import gbsg2

    pytest.importorskip("pyarrow")
    data = tmp_path / "gbsg2.csv"
    data.write_bytes(gbsg2().read_bytes())
    spec = f"csv:{data}"
    assert _cli(capsys, "budget", "set", "--dataset", spec, "--epsilon", "30", "--delta", "1e-5")[0] == 0
    schema = tmp_path / "schema.toml"
    code, out, err = _cli(capsys, "schema", "infer", spec, "--target", "cens", "--out", str(schema),
                          "--epsilon", "8", "--json")  # fmt: skip
    assert code == 0, err
    run_id = json.loads(out)["budget_run_id"]
    assert f'budget_run_id = "{run_id}"' in schema.read_text()
    # The same file under another name is the same dataset (its bytes are hashed).
    renamed = tmp_path / "renamed.csv"
    data.rename(renamed)
    code, _, err = _cli(capsys, "train", "--dataset", f"csv:{renamed}", "--schema", str(schema),
                        "--epochs", "1", "--epsilon", "2", "--no-baseline", "--out", str(tmp_path / "run"),
                        "--json")  # fmt: skip
    assert code == 0, err
    status = _show(capsys, f"csv:{renamed}")
    assert status["jobs"] == {"schema": 1, "train": 1}
    runs = {r["job"]: r for r in status["runs"]}
    schema_events = [event_from_dict(e) for e in runs["schema"]["events"]]
    train_events = [event_from_dict(e) for e in runs["train"]["events"]]
    # Each thresholded histogram that ran charged its share δ/k of the release's δ = 1e-7 (k = 10 columns).
    thresholds = [e.delta for e in schema_events if isinstance(e, DeltaOnly)]
    assert thresholds and all(d == pytest.approx(1e-8) for d in thresholds)
    # The composed total against dp-accounting, at δ minus the thresholds' δ.
    accounted = [e for e in schema_events + train_events if not isinstance(e, DeltaOnly)]
    pld_ref, rdp_ref = _reference(accounted, 1e-5 - sum(thresholds))
    assert status["spent_epsilon"] == pytest.approx(min(pld_ref, rdp_ref), rel=0.01)
    assert status["spent_epsilon"] < runs["schema"]["epsilon"] + runs["train"]["epsilon"]  # composed
    # A second release over what remains: refused before a row is read, nothing written or charged.
    import veil.tables.infer as infer

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("the table was read")

    monkeypatch.setattr(infer, "_read", must_not_read)
    again = tmp_path / "again.toml"
    code, _, err = _cli(capsys, "schema", "infer", f"csv:{renamed}", "--target", "cens", "--out", str(again),
                        "--epsilon", "30")  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and "budget" in err and not again.exists()
    assert _show(capsys, f"csv:{renamed}")["jobs"] == {"schema": 1, "train": 1}


SYNTH_SCHEMA = """
reviewed = true

[columns.age]
type = "numeric"
bounds = [0, 100]

[columns.city]
type = "categorical"
levels = ["a", "b", "c"]

[columns.label]
role = "target"
classes = ["no", "yes"]
"""


def _synth_files(tmp_path: Path) -> tuple[str, Path]:
    rng = np.random.default_rng(0)
    lines = ["age,city,label"] + [
        f"{rng.uniform(0, 100):.1f},{'abc'[rng.integers(0, 3)]},{'yes' if rng.random() < 0.4 else 'no'}"
        for _ in range(1500)
    ]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "schema.toml").write_text(SYNTH_SCHEMA)
    return f"csv:{tmp_path / 'data.csv'}", tmp_path / "schema.toml"


def test_synth_is_charged_in_rdp_and_refused_over_budget_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, schema = _synth_files(tmp_path)
    assert _cli(capsys, "budget", "set", "--dataset", spec, "--epsilon", "2", "--delta", "1e-6")[0] == 0
    base = ["synth", "--dataset", spec, "--schema", str(schema), "--delta", "1e-6", "--rows", "50",
            "--iterations", "50", "--bins", "4"]  # fmt: skip
    code, _, err = _cli(capsys, *base, "--epsilon", "1", "--out", str(tmp_path / "s1"))
    assert code == 0, err
    status = _show(capsys, spec)
    (run,) = status["runs"]
    assert run["job"] == "synth" and run["status"] == "committed"
    events = [event_from_dict(e) for e in run["events"]]
    assert "exponential_mechanism" in json.dumps(run["events"])  # MST's tree selections
    curve = RDPAccountant().compose(Composed(events)).rdp
    assert status["spent_epsilon"] == pytest.approx(_rdp_epsilon(curve, 1e-6), rel=1e-9)
    assert status["spent_epsilon"] <= 1.0 + 1e-9
    # A second run over what remains (ε = 1 and ε = 2 compose to about 2.3 > 2 in RDP; ε = 1.5 would
    # still fit, since composition is not addition): refused before a row is read, nothing written or
    # charged.
    import veil.synth.run as synth_run

    def must_not_read(*_: object, **__: object) -> None:
        raise AssertionError("the table was read")

    monkeypatch.setattr(synth_run, "read_codes", must_not_read)
    out = tmp_path / "s2"
    code, _, err = _cli(capsys, *base, "--epsilon", "2", "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "budget" in err and not out.exists()
    assert [r["run_id"] for r in _show(capsys, spec)["runs"]] == [run["run_id"]]


def test_tune_is_charged_with_its_random_stopping_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from veil.accounting.tuning import TrialCount

    monkeypatch.setattr(TrialCount, "sample", lambda self: 1)  # one trial, for speed; the law is charged
    out = tmp_path / "tune"
    code, _, err = _cli(
        capsys,
        "tune",
        "--dataset",
        "breast-cancer",
        "--epsilon",
        "5",
        "--out",
        str(out),
        "--json",
        "--trials-mean",
        "2",
        "--score-noise",
        "10",
        "--epochs",
        "1",
        "--batch-size",
        "128",
        "--model",
        "logreg",
        "--lr",
        "1.0",
        "--max-grad-norm",
        "1",
        "--preset-share",
        "0",
        "--no-compare-preset",
    )  # fmt: skip  one shape: dp-accounting has no OneOf
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    status = _show(capsys, "breast-cancer")
    (run,) = status["runs"]
    assert run["job"] == "tune" and run["status"] == "committed"
    (event,) = [event_from_dict(e) for e in run["events"]]
    assert isinstance(event, RepeatAndSelect) and event.mean == 2.0
    assert event.to_dict() == report["budget_split"]["event"]
    # Independent: dp-accounting's RepeatAndSelectDpEvent over the same trial, same orders; the δ the
    # total is stated at is the run's own (no budget set).
    delta = status["delta"]
    ref = RdpAccountant(orders=list(DEFAULT_ORDERS))
    ref.compose(_dpa(event))
    curve = np.minimum.accumulate(np.asarray(ref._rdp)[::-1])[::-1]
    assert status["spent_epsilon"] == pytest.approx(_rdp_epsilon(curve, delta), rel=1e-6)
    assert status["spent_epsilon"] == pytest.approx(report["epsilon"], rel=0.02)  # the report's grid
    # A training run on the same data composes with it, in RDP (RepeatAndSelect is RDP-only).
    code, _, err = _cli(capsys, "train", "--dataset", "breast-cancer", "--epsilon", "1", "--epochs", "1",
                        "--model", "logreg", "--no-baseline", "--out", str(tmp_path / "train"),
                        "--json")  # fmt: skip
    assert code == 0, err
    status = _show(capsys, "breast-cancer")
    assert status["jobs"] == {"train": 1, "tune": 1}
    both = RdpAccountant(orders=list(DEFAULT_ORDERS))
    for r in status["runs"]:
        for e in r["events"]:
            both.compose(_dpa(event_from_dict(e)))
    assert status["spent_epsilon"] == pytest.approx(
        _rdp_epsilon(np.asarray(both._rdp), status["delta"]), rel=1e-6
    )
    assert status["spent_epsilon"] < sum(r["epsilon"] for r in status["runs"])
    # Over budget: refused before a row is read (the dataset's budget is already spent).
    assert (
        _cli(capsys, "budget", "set", "--dataset", "breast-cancer", "--epsilon", "1", "--delta", "1e-5")[0]
        == 0
    )
    code, _, err = _cli(capsys, "tune", "--dataset", "breast-cancer", "--epsilon", "1", "--out",
                        str(tmp_path / "t2"))  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "t2").exists()


def test_budget_exhausted_error_is_raised_by_the_api(tmp_path: Path) -> None:
    with BudgetRegistry(tmp_path / "b.db") as reg:
        reg.set_budget("ds", 1.0, 1e-6)
        with pytest.raises(BudgetExhaustedError, match="synth"):
            reg.reserve("ds", [ZeroConcentrated(1.0)], "r", job="synth", delta=1e-6)


def test_pate_is_charged_with_its_guarantee(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from veil.accounting.events import ApproximateDP
    from veil.pate.run import run_pate

    settings = {"dataset": "breast-cancer", "teachers": 10, "sigma": 2.0, "epsilon": 6.0, "queries": 20}
    report = run_pate({**settings, "out": str(tmp_path / "p1")})
    status = _show(capsys, "breast-cancer")
    (run,) = status["runs"]
    assert run["job"] == "pate" and run["status"] == "committed"
    assert [event_from_dict(e) for e in run["events"]] == [ApproximateDP(report.epsilon, report.delta)]
    assert status["spent_epsilon"] == pytest.approx(report.epsilon)  # alone, at its own δ: its ε
    # With a budget that is spent, a second run is refused before a row is read: nothing written.
    assert (
        _cli(capsys, "budget", "set", "--dataset", "breast-cancer", "--epsilon", "6", "--delta", "2e-5")[0]
        == 0
    )
    with pytest.raises(BudgetExhaustedError):
        run_pate({**settings, "out": str(tmp_path / "p2")})
    assert not (tmp_path / "p2").exists() and len(_show(capsys, "breast-cancer")["runs"]) == 1


def test_a_schema_release_spends_a_subset_of_its_plan(tmp_path: Path) -> None:
    """Whichever branch each column takes, the released events are among the planned ones (so the
    admission check on the plan bounds the charge), in both the secure and the seeded event forms."""
    from collections import Counter

    pytest.importorskip("pyarrow")
    from veil.mechanisms.rng import make_source
    from veil.tables.infer import dp_plan, infer_schema
    from veil.tables.release import bounds_plan
    from veil.tables.sources import parse_source

    rng = np.random.default_rng(1)
    rows = [f"{rng.normal(50, 10):.2f},{'xyz'[rng.integers(0, 3)]},{rng.integers(0, 2)}" for _ in range(3000)]
    (tmp_path / "t.csv").write_text("num,cat,label\n" + "\n".join(rows) + "\n")
    for secure in (True, False):
        released: list[PrivacyEvent] = []
        infer_schema(parse_source(f"csv:{tmp_path / 't.csv'}"), target="label", epsilon=3.0, delta=1e-6,
                     rng=make_source(secure, None if secure else 3), spent=released)  # fmt: skip
        plan = dp_plan(["num", "cat", "label"], "label", 3.0, 1e-6, secure)
        assert not Counter(released) - Counter(plan)  # a sub-multiset
        assert bounds_plan(3.0 / 3 * 3 / 4, secure) in released  # the numeric column's bounds histogram
        assert sum(isinstance(e, DeltaOnly) for e in released) == 2  # the text column's and the target's
