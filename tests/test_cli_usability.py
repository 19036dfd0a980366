"""The `veil` command as a newcomer meets it: version, help pages with examples, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from veil.cli.main import build_app, main


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _command_paths() -> list[tuple[str, ...]]:
    """Every command and group of the built application, as argument tuples."""
    paths: list[tuple[str, ...]] = [()]

    def walk(app: typer.Typer, prefix: tuple[str, ...]) -> None:
        for command in app.registered_commands:
            paths.append((*prefix, str(command.name)))
        for group in app.registered_groups:
            path = (*prefix, str(group.name))
            paths.append(path)
            walk(group.typer_instance, path)

    walk(build_app(), ())
    return paths


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import veil

    code, out, err = cli(capsys, "--version")
    assert (code, out, err) == (0, f"veil {veil.__version__}\n", "")


def test_bare_veil_prints_help_and_no_blank_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys)
    assert code == 0
    assert "Commands" in out and "train" in out
    assert "error" not in err


def test_a_misspelled_command_is_suggested_once(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "trian")
    assert code == 2
    assert err.count("Did you mean") == 1 and "'train'" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = cli(capsys, "schema", "infr")
    assert code == 2 and err.count("Did you mean") == 1 and "'infer'" in err


@pytest.mark.parametrize("path", _command_paths(), ids=lambda p: " ".join(p) or "veil")
def test_every_help_page_has_an_example(capsys: pytest.CaptureFixture[str], path: tuple[str, ...]) -> None:
    code, out, _ = cli(capsys, *path, "--help")
    assert code == 0
    assert "Example:" in out
    assert f"veil {' '.join(path)}".strip() in out.split("Example:")[1]


def test_tune_refuses_a_poisson_mean_below_one_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_dir = tmp_path / "tune"
    code, out, err = cli(
        capsys, "tune", "--trials-law", "poisson", "--trials-mean", "0.05", "--out", str(out_dir)
    )
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "trials_mean" in err and "Traceback" not in err
    assert not out_dir.exists()


CHARGED = (("train",), ("pate",), ("tune",), ("synth",), ("federated",), ("schema", "infer"))


@pytest.mark.parametrize("path", CHARGED, ids=" ".join)
def test_every_charged_command_takes_db_and_states_the_delta_rule(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, path: tuple[str, ...]
) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # the help table's wrapping must not cut the δ rule
    code, out, _ = cli(capsys, *path, "--help")
    assert code == 0
    flat = " ".join(out.replace("│", " ").split())
    assert "--db" in flat
    assert "docs/accounting.md" in flat.split("--delta")[1][:400]  # the one documented δ rule


@pytest.mark.parametrize(
    "path", [("train",), ("audit",), ("pate",), ("synth",), ("federated",)], ids=" ".join
)
def test_research_mode_has_one_name(capsys: pytest.CaptureFixture[str], path: tuple[str, ...]) -> None:
    code, out, _ = cli(capsys, *path, "--help")
    assert code == 0 and "--reproducible" in out and "--secure-rng" not in out


def test_synth_secure_rng_is_a_deprecated_alias(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from veil.cli._privacy_args import secure_randomness

    assert secure_randomness(None, None) is True
    assert secure_randomness(True, None) is False
    assert secure_randomness(None, False) is False  # --no-secure-rng of old scripts
    assert secure_randomness(None, True) is True
    code, out, err = cli(
        capsys, "synth", "--dataset", "csv:x.csv", "--schema", "s.toml", "--epsilon", "1", "--rows", "5",
        "--reproducible", "--secure-rng",
    )  # fmt: skip
    assert code == 2 and out == "" and "--reproducible" in err and len(err.strip().splitlines()) == 1


def test_db_names_the_registry_a_charged_command_uses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json
    import os

    data = tmp_path / "t.csv"
    data.write_text("age,y\n" + "".join(f"{20 + i % 60},{'ab'[i % 2]}\n" for i in range(400)))
    db = tmp_path / "team.db"
    code, _, err = cli(
        capsys, "schema", "infer", str(data), "--target", "y", "--out", str(tmp_path / "s.toml"),
        "--epsilon", "1", "--db", str(db), "--json",
    )  # fmt: skip
    assert code == 0, err
    assert os.environ["VEIL_BUDGET_DB"] != str(db)  # restored after the command
    code, out, _ = cli(capsys, "budget", "show", "--db", str(db), "--json")
    assert code == 0 and [d["jobs"] for d in json.loads(out)["datasets"]] == [{"schema": 1}]
    code, out, _ = cli(capsys, "budget", "show", "--json")  # the default registry saw nothing
    assert code == 0 and json.loads(out)["datasets"] == []


def test_ctrl_c_in_train_prints_the_resume_command_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import veil.training.execute as training

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    run_dir = tmp_path / "run"
    monkeypatch.setattr(training, "train_steps", interrupted)
    args = ["--dataset", "digits", "--epsilon", "1", "--epochs", "1", "--no-baseline", "--json"]
    code, out, err = cli(capsys, "train", *args, "--out", str(run_dir))
    assert code == 130 and out == ""
    assert err == f"veil: interrupted; continue with: veil train --resume {run_dir}\n"
    monkeypatch.undo()
    code, out, err = cli(capsys, "train", "--resume", str(run_dir), "--json")  # the hint works as written
    assert code == 0, err
    assert json.loads(out)["steps"] > 0


SCHEMA_OK = 'reviewed = true\n\n[columns.age]\ntype = "numeric"\nbounds = [18, 90]\n\n'
TARGET = '[columns.y]\nrole = "target"\nclasses = ["a", "b"]\n'


def test_a_misspelled_schema_type_is_named_with_a_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = tmp_path / "s.toml"
    schema.write_text(SCHEMA_OK.replace('"numeric"', '"numberic"') + TARGET)
    (tmp_path / "t.csv").write_text("age,y\n30,a\n40,b\n")
    code, _, err = cli(capsys, "schema", "check", str(schema), "--dataset", f"csv:{tmp_path / 't.csv'}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'numberic' is not a column type" in err and "did you mean 'numeric'" in err
    assert "needs a type" not in err


@pytest.mark.parametrize("command", ["schema", "train"])
def test_a_toml_error_names_the_line_to_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('reviewed = true\n\n[columns.age]\ntype = "numeric"\nbounds = [18, 90\n' + TARGET)
    args = (
        ["schema", "check", str(bad), "--dataset", "csv:x.csv"]
        if command == "schema"
        else ["train", str(bad)]
    )
    code, _, err = cli(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "at the end of line 5: `bounds = [18, 90`" in err, err


def test_a_schema_error_is_shown_before_an_exhausted_budget(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = tmp_path / "t.csv"
    data.write_text("age,y\n" + "".join(f"{20 + i % 60},{'ab'[i % 2]}\n" for i in range(200)))
    code, _, err = cli(
        capsys, "budget", "set", "--dataset", f"csv:{data}", "--epsilon", "0", "--delta", "1e-6"
    )
    assert code == 0, err
    schema = tmp_path / "s.toml"
    schema.write_text(SCHEMA_OK.replace('"numeric"', '"numberic"') + TARGET)
    code, _, err = cli(
        capsys, "train", "--dataset", f"csv:{data}", "--schema", str(schema), "--out", str(tmp_path / "r")
    )
    assert code == 2 and "'numberic' is not a column type" in err and "budget" not in err
    schema.write_text(SCHEMA_OK + TARGET)  # once fixed, the budget speaks
    code, _, err = cli(
        capsys, "train", "--dataset", f"csv:{data}", "--schema", str(schema), "--out", str(tmp_path / "r")
    )
    assert code == 2 and "budget" in err and not (tmp_path / "r").exists()


def test_a_text_column_without_a_schema_points_to_schema_infer(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = tmp_path / "census.csv"
    data.write_text(
        "age,job,y\n" + "".join(f"{20 + i},{'ab'[i % 2]}x,{'no' if i % 3 else 'yes'}\n" for i in range(40))
    )
    code, out, err = cli(
        capsys, "train", "--dataset", f"csv:{data}", "--target", "y", "--classes", "no,yes",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "veil schema infer" in err and "--schema" in err
    assert not (tmp_path / "run").exists()


def test_an_over_budget_refusal_says_nothing_was_released_not_nothing_read(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The file was hashed to identify it, so "nothing was read" would be false; the message says what
    is true: no row parsed (exhausted dataset), nothing released or recorded."""
    data = tmp_path / "t.csv"
    data.write_text("age,y\n" + "".join(f"{20 + i % 60},{'ab'[i % 2]}\n" for i in range(200)))
    code, _, err = cli(
        capsys, "budget", "set", "--dataset", f"csv:{data}", "--epsilon", "0", "--delta", "1e-6"
    )
    assert code == 0, err
    code, _, err = cli(
        capsys, "schema", "infer", str(data), "--target", "y", "--out", str(tmp_path / "s.toml"),
        "--epsilon", "1",
    )  # fmt: skip
    assert code == 2 and "nothing was released or recorded" in err and "nothing was read" not in err
    assert "before any row was parsed" in err


def test_schema_check_help_says_it_is_not_private_and_refuses_no_value(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """revH's H14: the help was stale ("the first value it does not allow is refused": it counts and
    drops) and did not say that its exact counts are for the data owner's eyes only."""
    monkeypatch.setenv("COLUMNS", "240")
    code, out, _ = cli(capsys, "schema", "check", "--help")
    flat = " ".join(out.replace("│", " ").split())
    assert code == 0 and "NOT PRIVATE" in flat and "data owner's eyes only" in flat
    assert "does not allow is refused" not in flat and "No value is refused" in flat
