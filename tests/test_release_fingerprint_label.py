"""No released artefact carries the SHA-256 of the private file, also outside ``dataset_id`` (review
revD, finding F2).

The registry keys a file read without ``--dataset-id`` by the SHA-256 of its bytes: anyone who knows
all rows but one recovers the last by hashing candidates (:mod:`veil.registry.public_ids`). Two
artefacts carried it past the ``dataset_id`` scrub: ``veil audit``'s ``release/`` on a dataset the
registry does not know (``dataset_budget.label`` fell back to the fingerprint) and the DP schema of
``veil schema infer --epsilon`` (``budget_dataset_id``). Each test below fails on the code before the
fix.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from veil.cli.main import main
from veil.registry.public_ids import PREFIX
from veil.registry.reporting import budget_section, empty_status, public_label
from veil.registry.store import BudgetRegistry
from veil.report.schema import WITHHELD_ID, public_view

DIGEST = "cd" * 32
FINGERPRINT = f"sha256:{DIGEST}"


def _csv(path: Path, rows: int = 160) -> str:
    """A small private table; returns the hex SHA-256 of its bytes (the registry's key for it)."""
    rng = np.random.default_rng(3)
    lines = ["a,b,outcome"] + [
        f"{rng.normal():.3f},{rng.normal():.3f},{'yes' if rng.random() < 0.5 else 'no'}" for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _carries(text: str, digest: str, width: int = 12) -> bool:
    return any(digest[i : i + width] in text for i in range(len(digest) - width + 1))


def test_an_unknown_fingerprint_is_never_a_released_label() -> None:
    """The registry labels a dataset it does not know by its id: for a file, the fingerprint."""
    section = budget_section(empty_status(FINGERPRINT, FINGERPRINT), released_id=PREFIX + "ab" * 16)
    assert section["label"] == PREFIX + "ab" * 16
    public = public_view({"job": "audit", "dataset_budget": section})
    assert DIGEST not in json.dumps(public)
    # fail-safe: built without the released id, the public view withholds the label with the id
    unknown = budget_section(empty_status(FINGERPRINT, FINGERPRINT))
    public = public_view({"job": "audit", "dataset_budget": unknown})
    assert DIGEST not in json.dumps(public)
    assert public["dataset_budget"]["label"] == public["dataset_budget"]["dataset_id"] == WITHHELD_ID
    # and a section built elsewhere with the fingerprint in its label is scrubbed as well
    forged = {**budget_section(empty_status(FINGERPRINT, "x.csv")), "label": f"x.csv ({FINGERPRINT})"}
    assert DIGEST not in json.dumps(public_view({"job": "audit", "dataset_budget": forged}))
    # a label that is not a fingerprint is kept as the operator typed it
    assert public_label("csv:data.csv", FINGERPRINT, None) == "csv:data.csv"
    named = budget_section(empty_status("name:cohort", "name:cohort"))
    assert public_view({"job": "audit", "dataset_budget": named})["dataset_budget"]["label"] == "name:cohort"


def test_audit_release_on_an_unknown_file_has_no_fingerprint(tmp_path: Path) -> None:
    _csv(tmp_path / "private.csv")
    out = tmp_path / "audit"
    argv = ["audit", "--dataset", f"csv:{tmp_path / 'private.csv'}", "--target", "outcome", "--classes",
            "no,yes", "--epochs", "1", "--canaries", "20", "--attack", "loss", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    # An audit releases nothing (revH's H7): no release/ to carry the fingerprint; its report is
    # internal and owner-only.
    assert not (out / "release").exists()
    assert all(p.stat().st_mode & 0o077 == 0 for p in [out, *out.rglob("*")])


def test_dp_schema_names_the_dataset_by_its_released_id(tmp_path: Path) -> None:
    digest = _csv(tmp_path / "private.csv")
    schema = tmp_path / "dp.toml"
    argv = ["schema", "infer", f"csv:{tmp_path / 'private.csv'}", "--target", "outcome", "--epsilon", "1",
            "--out", str(schema)]  # fmt: skip
    assert main(argv) == 0
    text = schema.read_text()
    assert not _carries(text, digest), "the DP schema carries the file's SHA-256"
    found = re.search(r'budget_dataset_id = "([^"]+)"', text)
    assert found is not None
    with BudgetRegistry() as reg:  # the registry's released id for that file, the one every release uses
        assert found.group(1) == reg.released_id(f"sha256:{digest}")
    assert found.group(1).startswith(PREFIX)
