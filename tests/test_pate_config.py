"""Every ``veil pate`` configuration error is refused in veil's one format, through the CLI.

Each :class:`~veil.pate.config.PateConfig` field gets bad values (wrong type, out of range), written to
a TOML config file (and, for the settings that have one, given as a flag). The command must print one
line ``veil: error: <name>=<value>: <why>. Fix: <fix>.`` naming that setting, exit with status 2, and
write nothing.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from veil.cli.main import main
from veil.pate.config import RULES, PateConfig

_INF, _NAN = math.inf, math.nan

# Bad values for every field: the test fails if a field is added without them.
BAD: dict[str, list[Any]] = {
    "dataset": [3],
    "data_dir": [["a", "b"]],
    "dataset_id": [7],
    "target": [1],
    "public_data": [2.5],
    "holdout_fraction": [0.0, 1.0, "half"],
    "public_fraction": [-0.1, 1.5],
    "teachers": [0, -3, "many", 2.5],
    "teacher_model": [1],
    "student_model": [{"kind": 1}],
    "epochs": [0],
    "workers": [0, "two"],
    "aggregator": ["majority-vote", 3],
    "epsilon": [0.0, -1.0, _INF, _NAN, "big"],
    "delta": [0.0, 1.0, 2.0, -1e-5],
    "queries": [0, -5],
    "sigma": [0.0, -1.0, _INF, _NAN],
    "threshold": [_INF, _NAN, "high"],
    "sigma1": [0.0, -2.0],
    "budget": ["whatever", 1],
    "accountant": ["gdp"],
    "data_dependent": ["maybe"],
    "order": [1.0, 0.5, _INF],
    "smooth_beta": [0.0, -0.1],
    "smooth_sigma": [-1.0, _INF],
    "dd_confidence": [0.3, 1.0],
    "dd_check_every": [0],
    "ptr_test_share": [0.0, 1.0],
    "ptr_select_share": [1.5],
    "ptr_order": [1.0],
    "ptr_max_answers": [0],
    "semi_supervised": ["yes please"],
    "seed": [-1, "zero"],
    "reproducible": ["sometimes"],
    "classes": [["only"], ["a", "a"], ["a", ""]],
    "out": [5],
    "progress": ["loud"],
}

# Values each valid alone but wrong together, or wrong for the data (refused before anything is written).
CROSS: list[tuple[dict[str, Any], str]] = [
    ({"aggregator": "gnmax", "threshold": 5.0}, "threshold"),
    ({"aggregator": "lnmax", "budget": "data-dependent"}, "budget"),
    ({"aggregator": "lnmax", "budget": "ptr"}, "budget"),
    ({"aggregator": "gnmax", "data_dependent": False, "budget": "data-dependent"}, "budget"),
    ({"order": 2.0, "smooth_beta": 1.0}, "smooth_beta"),
    (
        {"aggregator": "confident-gnmax", "budget": "ptr", "ptr_test_share": 0.5, "ptr_select_share": 0.6},
        "ptr_select_share",
    ),
    ({"epsilon": 0.01}, "epsilon"),
    ({"delta": 0.01}, "delta"),  # δ ≥ 1/N for digits' 1,078 private examples
]

_LINE = re.compile(r"^veil: error: (?P<name>[\w.]+)=(?P<value>.+?): (?P<why>.+)\. Fix: (?P<fix>.+)\.$")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"


def _refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], out: bool = True
) -> re.Match[str]:
    before = sorted(tmp_path.iterdir())
    assert main(["pate", *argv, "--json", *(["--out", str(tmp_path / "run")] if out else [])]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    match = _LINE.match(err.strip())
    assert match is not None, err
    assert "fix this setting" not in match["fix"].lower()
    # Nothing written (the default run folder included); the test's own budget registry (conftest) may
    # have been opened, but holds no run: nothing was charged.
    assert sorted(p for p in tmp_path.iterdir() if p.name != "veil-budget.db") == before
    if (tmp_path / "veil-budget.db").exists():
        from veil.registry.store import BudgetRegistry

        with BudgetRegistry(tmp_path / "veil-budget.db") as registry:
            assert all(not s.runs for s in registry.statuses())
    return match


def test_every_field_has_bad_values_and_a_rule() -> None:
    assert set(BAD) == set(PateConfig.model_fields) == set(RULES)


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, vs in BAD.items() for v in vs])
def test_each_bad_value_in_a_config_file_is_one_line_in_the_one_format(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    value: Any,
) -> None:
    monkeypatch.chdir(tmp_path)  # a default run folder would land here
    toml = tmp_path / "pate.toml"
    toml.write_text(f"[pate]\n{field} = {_toml_value(value)}\n", encoding="utf-8")
    match = _refused(tmp_path, capsys, [str(toml)], out=field != "out")
    assert match["name"] == field


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--teachers", "0", "teachers"),
        ("--epsilon", "-1", "epsilon"),
        ("--epsilon", "inf", "epsilon"),
        ("--delta", "2", "delta"),
        ("--queries", "0", "queries"),
        ("--sigma", "0", "sigma"),
        ("--sigma1", "-1", "sigma1"),
        ("--threshold", "nan", "threshold"),
        ("--aggregator", "majority-vote", "aggregator"),
        ("--budget", "whatever", "budget"),
        ("--workers", "0", "workers"),
        ("--seed", "-1", "seed"),
    ],
)
def test_each_bad_flag_is_one_line_in_the_one_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, field: str
) -> None:
    assert _refused(tmp_path, capsys, [flag, value])["name"] == field


@pytest.mark.parametrize(("values", "field"), CROSS)
def test_settings_wrong_together_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, Any], field: str
) -> None:
    toml = tmp_path / "pate.toml"
    toml.write_text("[pate]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()))
    assert _refused(tmp_path, capsys, [str(toml)])["name"] == field


def test_ptr_max_answers_message_names_its_own_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = tmp_path / "pate.toml"
    toml.write_text("[pate]\nptr_max_answers = 0\n")
    match = _refused(tmp_path, capsys, [str(toml)])
    assert match["name"] == "ptr_max_answers" and "queries" not in match["name"]
