"""Every bad input of issue 4 via the CLI: exit 2, one line on stderr, nothing written, outputs untouched."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from veil.cli.main import main


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], match: str) -> str:
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert match in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("done") / "run"
    assert (
        main(["train", "--epochs", "1", "--model", "logreg", "--no-baseline", "--out", str(out), "--json"])
        == 0
    )
    return out


def _csv(tmp_path: Path, text: str) -> str:
    p = tmp_path / "d.csv"
    p.write_text(text)
    return f"csv:{p}"


ROWS = "".join(f"{i},{i % 2}\n" for i in range(40))
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("missing file", lambda t: ["--dataset", f"csv:{t / 'none.csv'}", "--target", "y"], "does not exist"),
    (
        "missing target",
        lambda t: ["--dataset", _csv(t, "a,y\n" + ROWS), "--target", "label", "--classes", "0,1"],
        "no such column",
    ),
    ("undeclared labels", lambda t: ["--dataset", _csv(t, "a,y\n" + ROWS), "--target", "y"], "--classes"),
    ("single class", lambda t: ["--classes", "0"], "at least two distinct"),
    ("epsilon huge", lambda t: ["--epsilon", "1e9"], "epsilon=1000000000.0"),
    ("epsilon tiny", lambda t: ["--epsilon", "1e-9"], "epsilon=1e-09"),
    ("epsilon zero", lambda t: ["--epsilon", "0"], "epsilon=0.0"),
    ("epsilon negative", lambda t: ["--epsilon", "-1"], "epsilon=-1.0"),
    ("delta >= 1/N", lambda t: ["--delta", "0.001"], "1/N"),
    ("unknown dataset", lambda t: ["--dataset", "cifar-10"], "unknown dataset"),
    ("unwritable out", lambda t: ["--out", "/proc/veil-cannot-write-here"], "cannot be written"),
    ("out under a file", lambda t: ["--out", str(t / "d.csv" / "run")], "is a file"),
    ("model import", lambda t: ["--model", "veil_no_such_module_xyz:factory"], "does not import"),
    ("unknown model", lambda t: ["--model", "resnet"], "unknown model"),
    ("batch > N", lambda t: ["--batch-size", "100000"], "batch_size"),
]


@pytest.mark.parametrize(("name", "args", "match"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_writes_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    args: Callable[[Path], list[str]],
    match: str,
) -> None:
    (tmp_path / "d.csv").write_text("a,y\n")
    out = tmp_path / "out"
    given = args(tmp_path)
    if "--out" not in given:
        given += ["--out", str(out)]
    _refused(["train", *given], capsys, match)
    assert not out.exists()


def test_unknown_key_and_wrong_type_in_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text("epsilom = 3\n")
    _refused(["train", str(config), "--out", str(tmp_path / "o")], capsys, "did you mean 'epsilon'")
    config.write_text('epochs = "many"\n')
    _refused(
        ["train", str(config), "--out", str(tmp_path / "o")], capsys, "epochs='many': expected an integer"
    )
    assert not (tmp_path / "o").exists()


def test_resume_of_a_folder_with_no_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["train", "--resume", str(tmp_path)], capsys, "no veil run")
    assert list(tmp_path.iterdir()) == []


def test_existing_run_is_never_overwritten(finished_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _snapshot(finished_run)
    _refused(["train", "--epochs", "1", "--out", str(finished_run)], capsys, "already holds a run")
    assert _snapshot(finished_run) == before


def test_corrupted_checkpoint_is_refused(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ckpt = sorted((run / "checkpoints").glob("step-*.pt"))[-1]
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    before = _snapshot(run)
    _refused(["train", "--resume", str(run)], capsys, "sha256 does not match")
    assert _snapshot(run) == before


def test_corrupted_ledger_is_refused(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    ledger = run / "ledger.jsonl"
    lines = ledger.read_text().splitlines()
    first_step = next(i for i, line in enumerate(lines) if '"kind":"step"' in line)
    lines[first_step] = re.sub(r'"sampling_rate":[0-9.e-]+', '"sampling_rate":0.001', lines[first_step])
    ledger.write_text("\n".join(lines) + "\n")  # a step made to look cheaper
    before = _snapshot(run)
    _refused(["train", "--resume", str(run)], capsys, "ledger line")
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "flag", [["--epsilon", "5"], ["--max-grad-norm", "3"], ["--accountant", "rdp"], ["--seed", "9"]]
)
def test_resume_with_a_changed_privacy_setting(
    finished_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = _snapshot(run)
    _refused(["train", "--resume", str(run), *flag], capsys, "changed privacy setting")
    assert _snapshot(run) == before


def test_resume_with_a_different_fixed_front_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random features are rebuilt from the seed on resume, not saved: if they come out different
    (here: another feature scale; in the field: another torch version), the checkpointed head no
    longer fits them, and the resume is refused before anything is written."""
    import veil.models

    run = tmp_path / "run"
    args = ["train", "--epochs", "1", "--model", "rff", "--no-baseline", "--out", str(run), "--json"]
    assert main(args) == 0
    capsys.readouterr()
    before = _snapshot(run)
    monkeypatch.setattr(veil.models, "RFF_SCALE", veil.models.RFF_SCALE * 1.01)
    _refused(["train", "--resume", str(run)], capsys, "fixed feature front")
    assert _snapshot(run) == before
