"""One report schema for every job, and a run folder a data-protection officer can act on.

Each job (train, tune, pate, synth, federated, audit) runs once, small, under umask 022. Its
``report.json`` must validate against ``docs/report-schema.json``; ``release/`` must hold what the
guarantee covers and the public report (no ``non_private`` section), world-readable; everything else
in the run folder must be owner-only (folders 0700, files 0600); the registry file too. An audit
releases nothing: no ``release/`` at all, the whole folder owner-only.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from _job_runs import keys_outside
from veil.report.schema import NON_PRIVATE_NAMES, Evidence, Guarantee, ReportBuilder

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs" / "report-schema.json").read_text())
JOBS = ["train", "tune", "pate", "synth", "federated", "audit"]
RELEASED = {  # what release/ must hold besides the public report
    "train": {"model.pt"},
    "tune": {"model.pt"},
    "pate": {"labels.npz", "student.model"},
    "synth": {"synthetic.csv", "synthetic.parquet"},
    "federated": {"model.npz"},
}


@pytest.fixture(params=JOBS)
def job_run(request: pytest.FixtureRequest, job_runs: Any) -> tuple[str, Path, Any]:
    if request.param == "federated":
        pytest.importorskip("flwr")
    return (request.param, *job_runs(request.param))


def test_every_report_validates_against_the_one_schema(job_run: tuple[str, Path, Any]) -> None:
    job, out, report = job_run
    jsonschema.validate(report, SCHEMA)
    assert report["job"] == job and job in report
    assert "test_accuracy" in report["non_private"]
    if job == "audit":  # an un-noised verdict on the private data: nothing is published
        assert not (out / "release").exists()
        return
    assert report["guarantee"]["epsilon"] > 0.0 and report["guarantee"]["evidence"]["events"] >= 1
    public = json.loads((out / "release" / "report.json").read_text())
    jsonschema.validate(public, SCHEMA)
    assert "non_private" not in public and "out_dir" not in public
    assert all(
        set(r) & {"user", "report"} == set() for r in (public["dataset_budget"] or {"runs": []})["runs"]
    )
    # Nothing computed without noise reaches the public report, wherever it would sit.
    assert not {p.rsplit(".", 1)[-1] for p in keys_outside(public)} & NON_PRIVATE_NAMES
    # The deprecated aliases repeat the job's section, nothing else.
    for key in report["deprecated_aliases"]:
        assert report[key] == report[job][key]


def test_dataset_budget_counts_this_run(job_run: tuple[str, Path, Any]) -> None:
    job, _, report = job_run
    budget = report["dataset_budget"]
    if job == "audit":  # charges nothing: the registry's record of the dataset, without a run
        assert budget is not None and budget["runs"] == []
        return
    (mine,) = [r for r in budget["runs"] if r.get("report") and Path(r["report"]).name == "run"]
    assert mine["job"] == job and mine["delta"] == report["guarantee"]["delta"]
    if job == "federated":  # the registry charges each row (2C, no client-sampling gain): looser
        assert mine["epsilon"] >= report["guarantee"]["epsilon"]
    else:
        assert mine["epsilon"] == pytest.approx(report["guarantee"]["epsilon"], rel=0.02)
    assert budget["spent_epsilon"] == pytest.approx(mine["epsilon"], rel=0.02)  # the only run
    assert report["summary"] and "this dataset" in report["summary"]


def test_release_holds_what_the_guarantee_covers_and_the_rest_is_owner_only(
    job_run: tuple[str, Path, Any],
) -> None:
    job, out, report = job_run
    release = out / "release"
    if job == "audit":
        assert not release.exists()
    else:
        names = {p.name for p in release.iterdir()}
        assert names == RELEASED[job] | {"report.json", "report.html"}
        assert set(report["release"]["files"]) == names
        assert stat.S_IMODE(release.stat().st_mode) == 0o755
        for p in release.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
        assert 'class="internal"' not in (release / "report.html").read_text()  # no internal section
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for root, dirs, files in os.walk(out):
        here = Path(root)
        if here == out and "release" in dirs:
            dirs.remove("release")
        for d in dirs:
            assert stat.S_IMODE((here / d).stat().st_mode) == 0o700, here / d
        for f in files:
            if not (here / f).is_symlink():
                assert stat.S_IMODE((here / f).stat().st_mode) == 0o600, here / f
    registry = out.parent / "registry" / "budget.db"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600


# -- the builder ----------------------------------------------------------------------------------
def _guarantee(evidence: Evidence | None) -> Guarantee:
    return Guarantee(1.0, 1e-5, "row", "add_or_remove_one", "pld", "the model", "secure", True, "s", evidence)


def test_a_released_field_needs_the_guarantees_own_events() -> None:
    from veil.accounting.events import Gaussian

    own = Evidence.of("ledger.jsonl", [Gaussian(1.0)])
    builder = ReportBuilder("train", _guarantee(own))
    builder.released("clipping", {"final_clip": 0.7}, own)  # behind the ledger's event: accepted
    with pytest.raises(ValueError, match="does not cover"):
        builder.released("mean", 0.3, Evidence.of("elsewhere", [Gaussian(9.0)]))
    with pytest.raises(ValueError, match="no DP event"):
        Evidence.of("nothing", [])
    with pytest.raises(ValueError, match="does not cover"):
        ReportBuilder("audit", _guarantee(None)).released("x", 1, own)


def test_a_figure_computed_without_noise_cannot_reach_the_released_part() -> None:
    builder = ReportBuilder("pate", _guarantee(None))
    for name in ("teacher_sizes", "trials", "test_accuracy", "n_private", "public_private_duplicates"):
        with pytest.raises(ValueError, match="non_private"):
            builder.public("dataset", {"name": "x", name: 3})
        with pytest.raises(ValueError, match="non_private"):
            builder.section(name, 3)
    builder.non_private("teacher_sizes", {"min": 1})
    builder.summary = "Anyone who sees the labels cannot tell whether any one row was in the data."
    report = builder.build()
    assert report["non_private"]["teacher_sizes"] == {"min": 1}
    assert "teacher_sizes" not in report["pate"]


def test_a_new_section_is_one_line_and_lands_in_the_public_report() -> None:
    from veil.report.schema import public_view

    builder = ReportBuilder("train", _guarantee(None)).section("privacy_unit", {"unit": "row"})
    with pytest.raises(ValueError, match="summary"):
        builder.build()  # every report opens with its plain summary
    builder.summary = "Anyone who sees the model cannot tell whether any one row was in the data."
    report = builder.build()
    jsonschema.validate(report, SCHEMA)
    assert report["privacy_unit"] == {"unit": "row"} and public_view(report)["privacy_unit"] == {
        "unit": "row"
    }
