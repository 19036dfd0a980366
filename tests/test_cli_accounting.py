"""`veil epsilon`, `veil calibrate`, `veil env` through the CLI entry point (no subprocess)."""

from __future__ import annotations

import json
import math

import pytest

from veil.accounting.calibrate import dpsgd_epsilon
from veil.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "1000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    assert code == 0 and err == ""
    result = json.loads(out)
    assert set(result) == {"epsilon", "delta", "accountant", "sampling_rate", "noise_multiplier", "steps"}
    assert result["epsilon"] == pytest.approx(dpsgd_epsilon(0.01, 1.0, 1000, 1e-5))
    assert result["accountant"] == "pld"


def test_epsilon_from_batch_size_and_epochs(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "epsilon", "--batch-size", "256", "--dataset-size", "60000", "--epochs", "60",
        "--noise-multiplier", "1.1", "--delta", "1e-5", "--accountant", "rdp", "--json",
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0
    assert result["sampling_rate"] == pytest.approx(256 / 60000)
    assert result["steps"] == math.ceil(60 * 60000 / 256) == 14063
    assert result["epsilon"] == pytest.approx(2.597, abs=0.002)


def test_calibrate_json_lands_on_the_private_side(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "calibrate", "--target-epsilon", "3", "--sampling-rate", "0.01", "--steps", "2000",
        "--delta", "1e-5", "--json",
    )  # fmt: skip
    result = json.loads(out)
    assert code == 0
    assert 0.99 * 3 <= result["epsilon"] <= 3
    assert dpsgd_epsilon(0.01, result["noise_multiplier"], 2000, 1e-5) <= 3


def test_calibrate_takes_epsilon_like_every_command_and_keeps_the_old_spelling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    results = []
    for flag in ("--epsilon", "--target-epsilon"):
        code, out, _ = run(
            capsys,
            "calibrate",
            flag,
            "2",
            "--sampling-rate",
            "0.02",
            "--steps",
            "300",
            "--delta",
            "1e-5",
            "--json",
        )
        assert code == 0
        results.append(json.loads(out))
    assert results[0] == results[1] and results[0]["target_epsilon"] == 2


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "epsilon", "--sampling-rate", "0.5", "--noise-multiplier", "2", "--steps", "3",
                       "--delta", "1e-6")  # fmt: skip
    assert code == 0 and "epsilon" in out


@pytest.mark.parametrize(
    "args",
    [
        ["epsilon", "--sampling-rate", "0", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
        ["epsilon", "--sampling-rate", "1.5", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
        ["epsilon", "--sampling-rate", "0.1", "--noise-multiplier", "0", "--steps", "10", "--delta", "1e-5"],
        [
            "epsilon",
            "--sampling-rate",
            "0.1",
            "--noise-multiplier",
            "nan",
            "--steps",
            "10",
            "--delta",
            "1e-5",
        ],
        ["epsilon", "--sampling-rate", "0.1", "--noise-multiplier", "1", "--steps", "0", "--delta", "1e-5"],
        ["epsilon", "--sampling-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "1"],
        ["epsilon", "--sampling-rate", "0.1", "--noise-multiplier", "1", "--steps", "10", "--delta", "0"],
        [
            "epsilon",
            "--sampling-rate",
            "0.1",
            "--noise-multiplier",
            "1",
            "--steps",
            "10",
            "--delta",
            "1e-5",
            "--accountant",
            "moments",
        ],
        ["epsilon", "--noise-multiplier", "1", "--delta", "1e-5"],
        [
            "epsilon",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--batch-size",
            "5",
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
        ],
        [
            "epsilon",
            "--batch-size",
            "500",
            "--dataset-size",
            "100",
            "--epochs",
            "1",
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
        ],
        ["epsilon", "--sampling-rate", "abc", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
        ["calibrate", "--target-epsilon", "0", "--sampling-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
        [
            "calibrate",
            "--target-epsilon",
            "1e-6",
            "--sampling-rate",
            "1",
            "--steps",
            "1000000",
            "--delta",
            "1e-10",
        ],
        ["no-such-command"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2
    assert out == ""
    assert err.startswith("veil: error: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_env(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0
    for key in ("veil", "python", "torch", "numpy", "scipy"):
        assert info[key]


def test_import_veil_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, veil; print(','.join(m for m in ('torch', 'scipy', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_ctrl_c_exits_130_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Typer turns a KeyboardInterrupt into ``Exit(130)``, which click returns (not raises) outside
    standalone mode: the status must still reach the shell."""
    import veil.accounting.calibrate as calibrate

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "dpsgd_epsilon", interrupted)
    code, _out, err = run(
        capsys, "epsilon", "--sampling-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "10",
        "--delta", "1e-5",
    )  # fmt: skip
    assert code == 130
    assert err.strip().splitlines()[-1] == "veil: error: interrupted"
