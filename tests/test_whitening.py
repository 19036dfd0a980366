"""The scattering preset's DP whitening (veil.data.whitening): the rows' norm bound, the Gram release's
noise (symmetric, std S, on the grid), the per-row map the released model carries, and its accounting."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from veil.accounting.events import Gaussian
from veil.data.whitening import WhiteningPlan, gram_of_rows, release_gram, whiten_rows_, whitener
from veil.mechanisms.rng import SecureSource, SeededSource
from veil.models.scattering import UnitRows, WhitenedRows, unit_rows_net
from veil.optimizer import release_grid
from veil.presets import whitening_for

PARTS = [(9, 2, 2), (6, 3, 3)]  # 36 + 54 coordinates: two "scales" as MultiScaleScattering lays them out


def _raw_rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 4, n, dtype=torch.float32)[:, None]  # rows of every size, 1e-3 to 1e4
    return torch.randn(n, 90, generator=g) * scales + 5.0


def test_unit_rows_have_norm_at_most_one_whatever_the_record() -> None:
    """The Gram release's sensitivity (1) rests on ‖z‖ ≤ 1 for every row: fails if the scaling is dropped."""
    rows = UnitRows(PARTS, 0.3)
    x = torch.cat([_raw_rows(256, 0), torch.zeros(1, 90), torch.full((1, 90), 7.0)])  # blank rows too
    z = rows(x)
    assert z.shape == (len(x), rows.out_features) == (len(x), 91)
    assert float(z.norm(dim=1).max()) <= 1.0 + 1e-6
    assert torch.allclose(z[:, -1], torch.full((len(x),), 0.3))


def test_gram_of_rows_scales_rows_above_one_down() -> None:
    rows = np.zeros((2, 3), dtype=np.float32)
    rows[0] = [3.0, 4.0, 0.0]  # norm 5: counted as norm 1
    rows[1] = [0.0, 0.0, 0.5]
    gram = gram_of_rows(rows, chunk=1)
    want = np.outer([0.6, 0.8, 0], [0.6, 0.8, 0]) + np.diag([0, 0, 0.25])
    np.testing.assert_allclose(gram, want, atol=1e-6)


def test_a_record_that_overflows_the_front_adds_a_bounded_row_to_the_gram_matrix() -> None:
    """Review revJ J1: a finite image whose scattering overflows (one pixel 3e38) made its unit row NaN,
    the Gram release NaN everywhere and the released P exactly 0. Every row must stay finite with norm
    ≤ 1, whatever the record, and the Gram sum must move by at most 1 (upper triangle) with it."""
    from veil.models.scattering import MultiScaleScattering

    front = MultiScaleScattering((1, 16, 16))
    rows = UnitRows([tuple(p) for p in front.parts], 0.3)
    images = torch.rand(8, 1, 16, 16)
    bad = images[:1].clone()
    bad[0, 0, 3, 5] = 3e38  # finite in float32
    with torch.no_grad():
        z = rows(front(torch.cat([images, bad])))
    assert torch.isfinite(z).all() and float(z.norm(dim=1).max()) <= 1.0 + 1e-6
    with_bad = gram_of_rows(z.numpy())
    without = gram_of_rows(z[:-1].numpy())
    assert np.isfinite(with_bad).all()
    assert np.linalg.norm(np.triu(with_bad - without)) <= 1.0 + 1e-6
    nan_row = np.vstack([z[:-1].numpy(), np.full((1, z.shape[1]), np.nan, dtype=np.float32)])
    np.testing.assert_array_equal(gram_of_rows(nan_row), without)  # the release's own guard
    p = torch.from_numpy(whitener(without + np.eye(len(without)), 8, 0.02))
    rule = WhitenedRows(60.0)
    rule.set_whitener(p)
    assert torch.isfinite(rule(torch.cat([z, torch.full((1, z.shape[1]), float("inf"))]))).all()


def test_released_gram_is_symmetric_with_noise_std_s_on_the_grid() -> None:
    """Upper triangle drawn once (std S per coordinate), mirrored, rounded to the release grid.

    Statistical part: the m = d(d+1)/2 = 20,100 upper-triangle noise values are i.i.d. N(0, S²) (seeded,
    so the test is deterministic); their sample std s has s/S − 1 ≈ N(0, 1/(2m)), sd 0.005. The bound
    |s/S − 1| < 0.03 is 6 sd: a false failure rate of ~2e-9 for an unseeded draw. With std × 2 the
    ratio is 2 and the test fails."""
    d, s = 200, 2.5
    rows = np.zeros((10, d), dtype=np.float32)
    gram = release_gram(rows, s, SeededSource(11))
    assert gram.dtype == np.float32
    np.testing.assert_array_equal(gram, gram.T)
    upper = gram[np.triu_indices(d)].astype(np.float64)
    ratio = upper.std() / s
    assert abs(ratio - 1) < 0.03, ratio
    assert abs(upper.mean()) < 6 * s / math.sqrt(upper.size)
    grid = release_grid(s)
    np.testing.assert_array_equal(np.rint(upper / grid) * grid, upper)
    # rows' draws are independent (not one row's draw reused): sample correlation ~ N(0, 1/198), 6 sd
    assert abs(np.corrcoef(gram[0, 2:], gram[1, 2:])[0, 1]) < 6 / math.sqrt(d - 2)


def test_released_gram_uses_each_draw_once_in_blocks_of_whole_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise is drawn in blocks (NOISE_BLOCK values, whole rows): every upper-triangle coordinate
    gets exactly one draw, in order, none reused or skipped, and no draw is larger than a block (or one
    row). Fails if a block's offset is not advanced, a row is skipped or a draw is reused."""
    import veil.data.whitening as whitening

    class Recording(SeededSource):
        def __init__(self, seed: int) -> None:
            super().__init__(seed)
            self.draws: list[torch.Tensor] = []

        def normal(self, shape: tuple[int, ...], std: float, **kw: object) -> torch.Tensor:
            out = super().normal(shape, std, **kw)  # type: ignore[arg-type]
            self.draws.append(out.clone())
            return out

    monkeypatch.setattr(whitening, "NOISE_BLOCK", 450)
    d, s = 120, 2.5
    source = Recording(5)
    gram = release_gram(np.zeros((3, d), dtype=np.float32), s, source)
    assert len(source.draws) > 1 and all(len(t) <= max(450, d) for t in source.draws)
    drawn = torch.cat(source.draws).numpy()
    assert len(drawn) == d * (d + 1) // 2
    grid = release_grid(s)
    np.testing.assert_array_equal(gram[np.triu_indices(d)], (np.rint(drawn / grid) * grid).astype(np.float32))
    np.testing.assert_array_equal(gram, gram.T)


def test_released_gram_with_secure_noise() -> None:
    rows = np.eye(4, 30, dtype=np.float32)
    gram = release_gram(rows, 1.0, SecureSource())
    np.testing.assert_array_equal(gram, gram.T)
    assert 0.5 < float(np.std(gram[np.triu_indices(30)])) < 1.5


def test_whitener_is_the_inverse_square_root_and_rows_get_the_target_norm_each() -> None:
    g = np.random.default_rng(0)
    z = g.standard_normal((500, 20)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    gram = gram_of_rows(z)
    p = whitener(gram.astype(np.float32), 500, 0.01)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, p.T, atol=1e-6)
    np.testing.assert_allclose(p @ (gram / 500 + 0.01 * np.eye(20)) @ p, np.eye(20), atol=1e-4)
    rule = WhitenedRows(60.0)
    rule.set_whitener(torch.from_numpy(p))
    rows = z.copy()
    whiten_rows_(rows, rule, chunk=7)
    want = z @ p
    want *= 60.0 / np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 60.0, rtol=1e-5)  # every row, not a mean


def test_whitened_rows_are_the_identity_before_p_and_load_p_at_its_size() -> None:
    """The released model carries P: a freshly built WhitenedRows (empty P) loads it from a state_dict
    and then maps rows as the trained one does; before P is set it passes the unit rows through."""
    z = UnitRows(PARTS, 0.3)(_raw_rows(64, 1))
    fresh = WhitenedRows(60.0)
    torch.testing.assert_close(fresh(z), z)
    noisy = gram_of_rows(z.numpy()) + np.random.default_rng(1).standard_normal((91, 91)) * 0.1
    trained = WhitenedRows(60.0)
    trained.set_whitener(torch.from_numpy(whitener(((noisy + noisy.T) / 2).astype(np.float32), 64, 0.05)))
    state = trained.state_dict()
    assert state["whitener"].shape == (91, 91)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(z), trained(z), rtol=0, atol=0)
    torch.testing.assert_close(fresh(z).norm(dim=1), torch.full((64,), 60.0))


def test_unit_rows_net_replaces_the_head_only() -> None:
    from veil.models import FixedFeaturesThenHead, build_model

    net = unit_rows_net(build_model("scatternet", (1, 28, 28), 10, "image"))
    assert isinstance(net, FixedFeaturesThenHead)
    assert isinstance(net.head, torch.nn.Linear) and net.head.in_features == 81 * 49 + 9 * 196 + 1
    assert not list(net.features.parameters())


def test_only_the_scattering_preset_whitens_and_its_release_comes_first() -> None:
    assert whitening_for("image-scatternet", "scatternet", (1, 28, 28)) == {
        "std": 6.0,
        "ridge": 0.02,
        "row_norm": 60.0,
    }
    assert whitening_for("image", "cnn", (1, 28, 28)) is None
    assert whitening_for("image-rff", "rff", (1, 8, 8)) is None
    assert whitening_for("image-scatternet", "scatternet", (1, 12, 12)) is None
    assert WhiteningPlan(6.0, 0.02, 60.0).event == Gaussian(6.0)


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from veil.cli.main import main

    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _small_images(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    y = np.arange(300) % 3
    x = rng.integers(0, 80, (300, 16, 16)) + (y[:, None, None] * 60) * (np.arange(16) < 8)[None, None, :]
    data = tmp_path / "small.npz"
    np.savez(data, x=x.astype(np.uint8), y=y)
    return data


def test_train_draws_the_gram_noise_from_the_secure_source_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Secure mode (the default): the release's noise source is the OS CSPRNG, never a seeded one."""
    import veil.data.whitening as whitening

    sources: list[object] = []
    release = whitening.release_gram

    def spy(rows: np.ndarray, std: float, rng: object) -> np.ndarray:
        sources.append(rng)
        return release(rows, std, rng)  # type: ignore[arg-type]

    monkeypatch.setattr(whitening, "release_gram", spy)
    data = _small_images(tmp_path)
    args = ["train", "--dataset", f"npz:{data}", "--classes", "0,1,2", "--epochs", "1"]
    code, _, err = _run_cli([*args, "--out", str(tmp_path / "run"), "--json", "--no-baseline"], capsys)
    assert code == 0, err
    assert len(sources) == 1 and type(sources[0]) is SecureSource


def test_train_charges_the_gram_release_first_keeps_it_out_of_release_and_folds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`veil train` with the scattering preset (16 × 16 images): the Gram release is charged before the
    first step (and counted in ε), its file stays in the run folder, never under release/; model.pt is
    the unit-rows model carrying P (a d × d buffer) and reproduces the reported accuracy; a resume
    reuses the release (no second event) and releases the same weights."""
    import json
    import shutil

    from veil.accounting.calibrate import epsilon_of
    from veil.accounting.events import event_from_dict
    from veil.accounting.ledger import Ledger
    from veil.config import make_config
    from veil.data import load_dataset
    from veil.data.preprocess import build_transform, plan_preprocessing
    from veil.models import build_model

    data = _small_images(tmp_path)
    out = tmp_path / "run"
    args = ["train", "--dataset", f"npz:{data}", "--classes", "0,1,2", "--epochs", "4", "--seed", "0"]
    code, _, err = _run_cli([*args, "--out", str(out), "--json", "--no-baseline", "--reproducible"], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert failed == ["secure_randomness"], failed  # --reproducible: the only check it fails
    ledger = Ledger.open(out / "ledger.jsonl")
    kinds = [r["kind"] for r in ledger.records]
    events = [r for r in ledger.of_kind("event")]
    assert [r["label"] for r in events] == ["whitening"]
    assert kinds.index("event") < kinds.index("step")  # charged before the first step
    assert event_from_dict(events[0]["event"]) == Gaussian(6.0)
    assert report["epsilon_spent"] == pytest.approx(epsilon_of(ledger.events(), 1e-5), rel=1e-9)
    assert epsilon_of(ledger.events()[1:], 1e-5) < report["epsilon_spent"] <= 3.0
    ledger.close()
    assert (out / "whitening.npy").is_file()
    assert not list((out / "release").rglob("whitening*"))
    state = torch.load(out / "release" / "model.pt", weights_only=True)
    d = 81 * 4 * 4 + 9 * 8 * 8 + 1  # the unit rows of 16 × 16 images
    assert state["net.features.2.whitener"].shape == (d, d)  # P, carried for the per-row rule
    assert state["net.head.weight"].shape == (3, d)
    ds = load_dataset(f"npz:{data}", seed=0, classes=["0", "1", "2"])
    torch.manual_seed(123)
    model = torch.nn.Sequential()
    model.add_module("preprocess", build_transform(plan_preprocessing(make_config({}), ds), ds.input_shape))
    model.add_module("net", unit_rows_net(build_model("scatternet", ds.input_shape, 3, "image")))
    model.load_state_dict(state)
    with torch.no_grad():
        pred = model.eval()(torch.from_numpy(ds.x_test)).argmax(1).numpy()
    accuracy = float((pred == ds.y_test).mean())
    assert accuracy == pytest.approx(report["non_private"]["test_accuracy"], abs=1 / len(ds.y_test))

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    code, _, err = _run_cli(["train", "--resume", str(copy), "--json", "--no-baseline"], capsys)
    assert code == 0, err
    ledger = Ledger.open(copy / "ledger.jsonl")
    assert [r["label"] for r in ledger.of_kind("event")] == ["whitening"]  # reused, not released again
    ledger.close()
    again = torch.load(copy / "release" / "model.pt", weights_only=True)
    assert all(torch.equal(again[k], state[k]) for k in state)  # the same P folded into the same weights


def test_rows_of_huge_finite_norm_enter_the_gram_sum_at_norm_at_most_one() -> None:
    """Review revK K7: the factor 1/norm was cast to float32 before the product; for a row of norm
    ~1e40 it is subnormal and the scaled row's norm reached 1 + 5e-6 (the reviewer's k8 rows). The
    scaling is now done in float64, and a cast row still above 1 is shrunk below it."""
    from veil.data.whitening import _within_unit_norm

    for d in (2, 64, 1024, 4096):
        for value in (1e19, 1e30, 1e37, 3e38):
            row = np.full((1, d), value, dtype=np.float32)
            assert float(np.linalg.norm(gram_of_rows(row))) <= 1.0 + 1e-6, (d, value)
            scaled = _within_unit_norm(torch.from_numpy(row))
            assert float(scaled.double().norm()) <= 1.0, (d, value)
    rows = torch.from_numpy(np.random.default_rng(0).normal(size=(2000, 37)).astype(np.float32)) * 10.0
    rows[::7] *= 1e36
    assert float(_within_unit_norm(rows).double().norm(dim=1).max()) <= 1.0
