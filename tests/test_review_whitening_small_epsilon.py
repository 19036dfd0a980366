"""revI's I4: a target ε that the scattering preset's Gram release alone reaches.

The refusal came from :func:`veil.pipeline.budget.noise_multiplier` after the stand-in reservation
and after the IDX rows were read, so a run refused on public settings stayed charged at its target
ε, and its Fix named settings that cannot help. The release's cost is ``Gaussian(S)`` with the
preset's S: a function of ε, δ, the accountant, the model and a built-in dataset's public kind and
shape. Now :func:`veil.pipeline.data.refuse_whitening_over_target` refuses it in
``veil train``'s public checks, before the registry is opened and before a row is read.

Planted: drop the ``refuse_whitening_over_target`` call from :func:`veil.training.run._check_public`
and ``test_refused_before_reading_and_before_the_charge`` fails (the reader is called)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _budget_cli import cli, show
from veil.config import make_config
from veil.errors import UnreachableTargetError
from veil.pipeline.data import refuse_whitening_over_target


def test_refused_before_reading_and_before_the_charge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import veil.data.idx
    import veil.presets

    monkeypatch.setattr(veil.presets, "WHITENING_MIN_EPSILON", 0.0)  # a preset that would whiten at 0.3

    def no_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a private row was read")

    monkeypatch.setattr(veil.data.idx, "load_idx_dataset", no_read)
    junk = tmp_path / "fm"  # files that would fail to load, should the reader run after all
    junk.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        (junk / f"{name}.gz").write_bytes(b"junk")
    out = tmp_path / "run"
    code, stdout, err = cli(
        capsys, "train", "--dataset", "fashion-mnist", "--data-dir", str(junk), "--epsilon", "0.3",
        "--out", str(out),
    )  # fmt: skip
    assert code == 2, stdout + err
    assert err.count("\n") == 1 and "whitening" in err and "Traceback" not in err, err
    assert not out.exists()
    assert show(capsys, "fashion-mnist")["runs"] == []


def test_only_the_whitened_preset_on_a_public_shape_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import veil.presets

    monkeypatch.setattr(veil.presets, "WHITENING_MIN_EPSILON", 0.0)  # a preset that would whiten at 0.3
    small = {"dataset": "fashion-mnist", "epsilon": 0.3}
    with pytest.raises(UnreachableTargetError, match="Gram"):
        refuse_whitening_over_target(make_config(small), whiten=True)
    refuse_whitening_over_target(make_config({**small, "epsilon": 3.0}), whiten=True)  # above its cost
    refuse_whitening_over_target(make_config({**small, "model": "cnn"}), whiten=True)  # no whitening
    refuse_whitening_over_target(make_config(small), whiten=False)  # several ranks: no whitening
    refuse_whitening_over_target(make_config({**small, "dataset": "digits"}), whiten=True)  # 8×8: none
    refuse_whitening_over_target(make_config({**small, "noise_multiplier": 1.0}), whiten=True)  # σ given


def test_the_preset_whitens_only_from_its_smallest_epsilon() -> None:
    """Below :data:`veil.presets.WHITENING_MIN_EPSILON` the scattering preset trains its unwhitened
    head (the Gram release's cost is more than a small target can spare), so a small ε is neither
    refused nor whitened; from it on, the release is planned. A public rule on the settings alone."""
    from veil.data import BUILTIN_PRESETS, BUILTIN_SHAPES
    from veil.pipeline.data import whitening_plan
    from veil.presets import WHITENING_MIN_EPSILON

    kind, shape = BUILTIN_SHAPES["fashion-mnist"]
    preset = BUILTIN_PRESETS["fashion-mnist"]
    for eps, whitens in ((0.3, False), (1.0, False), (WHITENING_MIN_EPSILON, True), (3.0, True)):
        cfg = make_config({"dataset": "fashion-mnist", "epsilon": eps})
        assert (whitening_plan(cfg, preset, kind, shape) is not None) is whitens, eps
        refuse_whitening_over_target(cfg, whiten=True)  # nothing refused at any of them
    given = make_config({"dataset": "fashion-mnist", "epsilon": 0.3, "noise_multiplier": 1.0})
    assert whitening_plan(given, preset, kind, shape) is not None  # no target ε: the preset as tuned
