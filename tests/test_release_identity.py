"""``release/`` names the dataset without its content fingerprint (review revA, finding 1).

A file read without ``--dataset-id`` is keyed in the registry by the SHA-256 of its bytes: a function
of every private row, computed without noise. The released report names the dataset by a random id the
registry draws once per fingerprint (:mod:`veil.registry.public_ids`); the registry and the internal
report keep the hash. The end-to-end test runs ``veil synth`` (whose N is private too) on two
neighbouring files and checks that what ``release/`` holds differs only where a DP output, a random
id or a clock reading may differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sqlalchemy")

from test_registry_jobs import SYNTH_SCHEMA  # one schema text for the small job tables
from veil.cli.main import main
from veil.registry.public_ids import PREFIX
from veil.registry.reporting import budget_section, empty_status
from veil.registry.store import BudgetRegistry
from veil.report.schema import WITHHELD_ID, public_view

ALLOWED = [
    r"dataset_budget\.dataset_id",  # the registry's random id: checked below to be one
    r"dataset_budget\.runs\.\d+\.(run_id|at)",  # a random run id, a clock reading
    # synth's DP outputs (the fields its report adds with ReportBuilder.released: N̂, the model's
    # cliques, the noisy marginals, the ledger's events, chosen by the DP selections) and what is
    # composed from the ledger's events
    r"(synth\.)?(rows_estimated|model|marginals|events)(\..+)?",
    r"((synth|guarantee)\.)?(epsilon|rho_spent)",
    r"dataset_budget\.(spent_epsilon|left_epsilon|runs\.\d+\.epsilon)",
    r"checks\.\d+\.detail",
    r"summary",  # repeats the released figures in words
]
"""The leaves of the released report that may differ between neighbouring tables."""


def _leaves(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        pairs = ((f"{path}.{key}".strip("."), item) for key, item in value.items())
        return {k: v for where, item in pairs for k, v in _leaves(item, where).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{path}.{i}").items()}
    return {path: value}


def _table(rows: int) -> list[str]:
    rng = np.random.default_rng(1)
    return ["age,city,label"] + [
        f"{rng.uniform(0, 100):.1f},{'abc'[rng.integers(0, 3)]},{'yes' if rng.random() < 0.4 else 'no'}"
        for _ in range(rows)
    ]


def _synth(folder: Path, lines: list[str], monkeypatch: pytest.MonkeyPatch, out: str) -> dict[str, Any]:
    """``veil synth`` on ``folder/data.csv`` named as the operator types it (``csv:data.csv``)."""
    folder.mkdir(exist_ok=True)
    (folder / "data.csv").write_text("\n".join(lines) + "\n")
    (folder / "schema.toml").write_text(SYNTH_SCHEMA)
    monkeypatch.chdir(folder)
    argv = ["synth", "--dataset", "csv:data.csv", "--schema", "schema.toml", "--epsilon", "2", "--delta",
            "1e-6", "--rows", "50", "--iterations", "30", "--bins", "4", "--out", out]  # fmt: skip
    assert main(argv) == 0
    return json.loads((folder / out / "report.json").read_text())


def _has_part_of(text: str, digest: str, width: int = 12) -> bool:
    return any(digest[i : i + width] in text for i in range(len(digest) - width + 1))


def test_neighbouring_tables_release_no_fingerprint_and_differ_only_in_dp_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = _table(300)
    a, b = tmp_path / "a", tmp_path / "b"
    internal_a = _synth(a, lines, monkeypatch, "run")
    internal_b = _synth(b, lines[:-1], monkeypatch, "run")  # one row removed
    digests = [hashlib.sha256((d / "data.csv").read_bytes()).hexdigest() for d in (a, b)]
    assert digests[0] != digests[1]
    released = []
    for folder in (a, b):
        for name in ("report.json", "report.html"):
            text = (folder / "run" / "release" / name).read_text()
            assert not any(_has_part_of(text, d) for d in digests), f"{folder.name}/release/{name}"
        released.append(json.loads((folder / "run" / "release" / "report.json").read_text()))
    left, right = (_leaves(r) for r in released)
    differing = [k for k in left.keys() | right.keys() if left.get(k, left) != right.get(k, right)]
    unexplained = [k for k in differing if not any(re.fullmatch(p, k) for p in ALLOWED)]
    assert not unexplained, unexplained
    ids = [r["dataset_budget"]["dataset_id"] for r in released]
    assert all(i.startswith(PREFIX) and len(i) == len(PREFIX) + 32 for i in ids)
    # The operator's side keeps the key the registry works with, and says which id was released.
    for internal, digest, rel in zip((internal_a, internal_b), digests, ids, strict=True):
        assert internal["dataset_budget"]["dataset_id"] == f"sha256:{digest}"
        assert internal["dataset_budget"]["released_id"] == rel
    # Stable: a second run on the same bytes is released under the same id.
    again = _synth(a, lines, monkeypatch, "run2")
    assert again["dataset_budget"]["released_id"] == ids[0]


def test_the_released_id_is_random_per_registry_and_stable_within_one(tmp_path: Path) -> None:
    fingerprint = "sha256:" + "ab" * 32
    with BudgetRegistry(tmp_path / "one.db") as reg:
        first = reg.released_id(fingerprint)
        assert reg.released_id(fingerprint) == first
        assert reg.released_id("dir-" + fingerprint) not in (first, fingerprint)
        assert reg.released_id("name:cohort") == "name:cohort"  # a declaration, released as declared
        assert reg.released_id("builtin:digits") == "builtin:digits"
    with BudgetRegistry(tmp_path / "one.db") as reg:
        assert reg.released_id(fingerprint) == first  # stored, not recomputed
    with BudgetRegistry(tmp_path / "two.db") as reg:
        assert reg.released_id(fingerprint) != first  # not a function of the bytes
    assert "ab" * 6 not in first


def test_public_view_withholds_a_fingerprint_no_released_id_was_given_for() -> None:
    """Fail-safe: a section built without the registry's released id never releases the fingerprint."""
    section = budget_section(empty_status("sha256:" + "cd" * 32, "csv:x.csv"))
    assert section["released_id"] is None and section["dataset_id"].startswith("sha256:")
    public = public_view({"job": "synth", "dataset_budget": section})
    assert public["dataset_budget"]["dataset_id"] == WITHHELD_ID
    assert "released_id" not in public["dataset_budget"]
    named = public_view({"job": "synth", "dataset_budget": budget_section(empty_status("name:c", "name:c"))})
    assert named["dataset_budget"]["dataset_id"] == "name:c"


def test_every_release_folder_is_written_through_public_view() -> None:
    """One path: ``write_release`` is called only by :func:`veil.report.publish.publish`, which writes
    the public view; no job writes ``release/`` on its own."""
    src = Path(__file__).resolve().parents[1] / "src" / "veil"
    callers = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if "write_release(" in p.read_text() and p.name != "run_folder.py"
    )
    assert callers == ["report/publish.py"]
