"""``veil train``'s ``report.json`` in the common schema (:mod:`veil.report.schema`).

The :class:`~veil.report.Report` object (what :func:`veil.train` returns) becomes the ``train``
section; the guarantee, the plain summary, the dataset's budget, ``non_private`` and the labelled
``files`` are the sections every job shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from veil.report import Report
from veil.report.schema import Evidence, Guarantee, ReportBuilder, label

__all__ = ["FILES", "file_table", "train_report"]

FILES: dict[str, tuple[str, bool, bool]] = {
    # name: (what it holds, in release/, non-private)
    "report.json": ("this report, machine-readable (the full internal one)", False, False),
    "report.html": ("this report as a page (the full internal one)", False, False),
    "preprocessing.json": ("the released DP preprocessing statistic", True, False),
    "whitening.npy": (
        "the released DP Gram matrix of the whitening (kept for --resume; model.pt carries the P computed "
        "from it)",
        False,
        False,
    ),
    "encoder.json": (
        "the table encoder (schema and feature layout): veil predict encodes new rows with it",
        True,
        False,
    ),
    "epsilon.png": ("ε spent against the step", False, False),
    "curves.png": ("test loss and accuracy per epoch, DP and baseline", False, True),
    "model.pt": (
        "the DP model's state_dict (torch.load(path, weights_only=True)); preprocessing included as buffers",
        True,
        False,
    ),
    "config.toml": ("the resolved configuration", False, False),
    "ledger.jsonl": (
        "the privacy ledger: every charged event, hash-chained; its header holds the dataset's plain "
        "SHA-256 fingerprint, which confirms a guess of the whole file",
        False,
        True,
    ),
    "checkpoints": (
        "the last checkpoints (resume with --resume); they hold the per-epoch test history",
        False,
        True,
    ),
    "release": (
        "what the guarantee covers, publishable as is: the model and the public report",
        False,
        False,
    ),
}

_RELEASED = ("preprocessing", "clipping")
"""Train-section fields computed from private data and released through a ledger event."""


def file_table(names: Sequence[str]) -> dict[str, str]:
    """``files`` of the :class:`~veil.report.Report`: each name with what it holds, labelled."""
    return {n: label(FILES[n][0], FILES[n][2]) for n in names}


def train_report(report: Report, events: Sequence[Any], budget: dict[str, Any] | None) -> dict[str, Any]:
    """The ``report.json`` dict of a train run; ``events``: its ledger's charged events."""
    from veil.report.html import guarantee_text
    from veil.report.publish import plain_summary

    evidence = Evidence.of("ledger.jsonl", events)
    guarantee = Guarantee(
        epsilon=report.epsilon_spent,
        delta=report.delta,
        unit="row" if report.privacy_unit is None else "privacy unit",
        neighbouring=report.neighbouring,
        accountant=report.accountant,
        covers=report.covers,
        randomness="secure" if report.randomness == "secure" else "seeded",
        release_ready=report.release_ready,
        statement=guarantee_text(report),
        evidence=evidence,
        extra={"target_epsilon": report.target_epsilon},
    )
    b = ReportBuilder("train", guarantee)
    body = report.to_dict()
    non_private = body.pop("non_private")
    body.pop("files")
    body.pop("checks")
    for key in _RELEASED:
        b.released(key, body.pop(key), evidence)
    b.public_fields(body)
    b.non_private_fields({k: v for k, v in non_private.items() if k != "note"})
    for name, what in report.files.items():
        _, release, _ = FILES.get(name, (what, False, False))
        b.file(name, what, release=release)
    b.file("release", FILES["release"][0])
    b.release_file("report.json").release_file("report.html")
    for name in ("preprocessing.json", "encoder.json"):
        if name in report.files:
            b.release_file(name)
    b.checks(report.checks)
    b.dataset_budget = budget
    b.summary = plain_summary(guarantee.to_dict(), budget, "the trained model")
    return b.build()
