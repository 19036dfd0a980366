"""The report: stable JSON fields, a self-contained HTML page, valid PNG plots."""

from __future__ import annotations

import io
import json

import markupsafe
import numpy as np

from veil.report import Check, DatasetInfo, NonPrivate, Report
from veil.report.html import exp_factor, guarantee_text, render_html
from veil.report.plots import curves_png, epsilon_png

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _report(**changes: object) -> Report:
    values: dict[str, object] = {
        "epsilon_spent": 2.97,
        "target_epsilon": 3.0,
        "delta": 1e-5,
        "accountant": "pld",
        "noise_multiplier": 1.9,
        "max_grad_norm": 1.0,
        "sampling_rate": 0.18,
        "batch_size": 256,
        "steps": 60,
        "steps_planned": 60,
        "epochs": 10,
        "preprocessing": {"method": "pixels", "description": "pixels / 16", "public": True, "event": None},
        "dataset": DatasetInfo(
            name="digits", n_train=1438, n_test=359, sha256="ab" * 32, kind="image", num_classes=10
        ),
        "model": "logreg",
        "parameters": 650,
        "optimizer": "sgd",
        "lr": 1.5,
        "label_set": {"source": "declared", "classes": [str(i) for i in range(10)], "declared_by": "docs"},
        "randomness": "seeded",
        "release_ready": False,
        "covers": "the released weights",
        "seed": 0,
        "veil_version": "0.1.0",
        "duration_s": 12.5,
        "checks": [
            Check(name="epsilon_reported", passed=True, detail="ε = 2.97 ≤ 3"),
            Check(name="per_sample_clipping", passed=False, detail="relative error <1e-3> & more"),
        ],
        "non_private": NonPrivate(
            test_accuracy=0.94,
            baseline_test_accuracy=0.97,
            utility_drop=0.03,
            history={"dp": [{"epoch": 1.0, "test_loss": 1.0, "test_accuracy": 0.8}], "baseline": []},
        ),
        "files": {"report.json": "this report"},
        "out_dir": "runs/x",
    }
    values.update(changes)
    return Report(**values)  # type: ignore[arg-type]


def test_json_has_the_stable_fields_and_round_trips() -> None:
    report = _report()
    data = json.loads(report.to_json())
    for key in ("epsilon_spent", "target_epsilon", "delta", "accountant", "noise_multiplier", "max_grad_norm",
                "sampling", "sampling_rate", "steps", "epochs", "dataset", "model", "label_set", "randomness",
                "release_ready", "covers", "seed", "veil_version", "duration_s", "checks",
                "non_private"):  # fmt: skip
        assert key in data, key
    # Every non-private figure sits in the one non_private section, nowhere else.
    assert set(data["non_private"]) >= {"test_accuracy", "baseline_test_accuracy", "utility_drop", "history"}
    assert not {"test_accuracy", "baseline_test_accuracy", "utility_drop", "history", "audit"} & set(data)
    assert report.test_accuracy == 0.94 and report.baseline_test_accuracy == 0.97  # the Python names stay
    assert data["sampling"] == "poisson" and data["checks"][0] == {
        "name": "epsilon_reported",
        "passed": True,
        "detail": "ε = 2.97 ≤ 3",
    }
    assert Report.model_validate(data) == report
    assert not report.all_checks_passed


def test_plots_are_png() -> None:
    eps = epsilon_png([(0, 0.0), (30, 2.0), (60, 2.97)], 3.0, 60, 1e-5)
    curves = curves_png(
        [
            {"epoch": 1.0, "test_loss": 1.0, "test_accuracy": 0.8},
            {"epoch": 2.0, "test_loss": 0.5, "test_accuracy": 0.9},
        ],
        [{"epoch": 1.0, "test_loss": 0.4, "test_accuracy": 0.95}],
    )
    import matplotlib.image as mpimg

    for png in (eps, curves):
        assert png.startswith(PNG_MAGIC)
        image = mpimg.imread(io.BytesIO(png), format="png")
        assert image.shape[0] > 100 and image.shape[1] > 100 and float(np.std(image)) > 0  # not blank


def test_html_is_self_contained_and_states_the_guarantee() -> None:
    report = _report()
    png = epsilon_png([(0, 0.0), (60, 2.97)], 3.0, 60, 1e-5)
    page = render_html(report, {"ε spent": png})
    assert page.lstrip().startswith("<!DOCTYPE html>")
    assert "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    assert str(markupsafe.escape(guarantee_text(report))) in page
    assert "(2.97, 1e-05)-differentially private" in guarantee_text(report)
    assert "PASS" in page and "FAIL" in page and "per_sample_clipping" in page
    assert "&lt;1e-3&gt; &amp; more" in page  # details are escaped
    # Seeded runs carry the research-mode caveat in the guarantee itself.
    assert "not private against anyone who knows the seed" in guarantee_text(report)
    assert "--reproducible" in page and "NO" in page
    secure = render_html(_report(randomness="secure", release_ready=True), {})
    assert "--reproducible" not in secure and "CSPRNG keystream keyed from the OS (secure)" in secure
    assert "knows the seed" not in guarantee_text(_report(randomness="secure"))
    # The non-private figures are a visibly separate, internal section.
    assert '<section class="internal">' in page and "Internal: non-private" in page
    internal = page[page.index('<section class="internal">') :]
    assert "0.9400" in internal and "0.9400" not in page[: page.index('<section class="internal">')]


def test_guarantee_text_survives_a_huge_epsilon() -> None:
    assert exp_factor(1e9).startswith("10^") and exp_factor(3.0) == "20.1"
    assert "e^1e+09" in guarantee_text(_report(epsilon_spent=1e9))


SKELETON = [
    "<h2>The guarantee</h2>",
    "<h2>Result</h2>",
    "<h2>Verification checklist</h2>",
    "<h2>Parameters</h2>",
    "<h2>Plots</h2>",
    "<h2>Files</h2>",
]


def _sections(page: str) -> list[str]:
    """The skeleton's headings found in ``page``, in the order they appear."""
    return [h for _, h in sorted((page.index(h), h) for h in SKELETON if h in page)]


def test_every_job_page_has_the_same_skeleton_from_one_environment() -> None:
    from veil.audit.report import render_html as render_audit
    from veil.report.render import environment, render_page

    train_page = render_html(_report(), {"ε spent": epsilon_png([(0, 0.0), (60, 2.97)], 3.0, 60, 1e-5)})
    audit_page = render_audit(
        {
            "epsilon_lower_bound": 0.4,
            "epsilon_theoretical": 3.0,
            "confidence": 0.95,
            "delta": 1e-5,
            "verdict": "consistent",
            "reading": "consistent <with> the promise",
            "canaries": None,
            "mia": None,
            "source": "veil audit: a test",
            "run": {"dataset": "digits"},
            "files": {"report.json": "this report"},
            "veil_version": "0.1.0",
        },
        {},
    )
    # A page any job (PATE included) can render through the same call.
    generic = render_page("page.html.j2", {}, checks=[Check(name="c", passed=True, detail="d")], files={})
    for page in (train_page, audit_page, generic):
        assert _sections(page) == SKELETON
        assert page.lstrip().startswith("<!DOCTYPE html>") and "<script" not in page
    assert "consistent &lt;with&gt; the promise" in audit_page  # escaped like every value
    assert environment() is environment()  # one Environment, cached


def test_plain_summary_comes_first_and_labelled_rows_show_their_value() -> None:
    report = _report(
        non_private=NonPrivate(
            test_accuracy=0.94,
            baseline_test_accuracy=None,
            utility_drop=None,
            history={"dp": [], "baseline": []},
            labelled_elsewhere={"dataset.sha256": "a fingerprint", "dataset.n_test": "held-out rows"},
        )
    )
    page = render_html(report, {}, summary="Anyone who sees the model cannot tell <much>.")
    assert page.index("In plain words") < page.index("Anyone who sees") < page.index("The guarantee</h2>")
    assert "&lt;much&gt;" in page  # escaped like every value
    assert "<code>" + "ab" * 32 + "</code>" in page and "<code>359</code>" in page  # not empty rows
    assert "split and initialisation seed" in page and report.to_dict()["seed_role"].startswith("the split")
