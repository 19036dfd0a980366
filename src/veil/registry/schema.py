"""The registry's two tables (SQLAlchemy Core), portable between SQLite and PostgreSQL.

``veil_budget_datasets``: one row per dataset identity: the budget (ε, δ, or none), the accountant
and neighbouring relation its runs are composed under, a label (the spec as typed, no password).
``veil_budget_runs``: one row per run: its dataset, job, status and events (JSON, as the ledger
writes them), the run's own δ, timestamps. Nothing else: no row, statistic or path of the data
beyond the label. Timestamps are ISO 8601 UTC strings, identical on both databases.
``veil_budget_units``: a dataset's privacy unit (the name of the column naming each row's person),
for the datasets that declare one; a table of its own, so that a registry made before it gains it
without a migration.
``veil_budget_run_info``: who ran a run and where its report is (for ``veil budget report``); a table
of its own, so that a registry made before it gains it by ``create_all`` (no column to migrate).
``veil_budget_fingerprints``: the content fingerprint (``sha256:``/``dir-sha256:``) of each file a named
dataset was read from, one name per fingerprint (:mod:`veil.registry.fingerprints`); created by
``create_all`` in a registry made before it, like the two above.
``veil_budget_public_ids``: the random id a release names a content-fingerprinted dataset by
(:mod:`veil.registry.public_ids`); created by ``create_all`` like the three above.
``veil_budget_released_files``: the SHA-256 of each file a run published in its ``release/`` (its model
or table), so that ``--init-from`` can tell a DP release of a dataset's rows whatever the file's path
or name (:mod:`veil.registry.released`); created by ``create_all`` like the tables above.
``veil_budget_resumes``: for a run that can be resumed, which continuation of its folder holds it
(``generation``) and how long its ledger was when last settled (``ledger_records``;
:mod:`veil.registry.resume_lease`); created by ``create_all`` like the four above.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text

__all__ = [
    "SCHEMA_VERSION",
    "datasets",
    "fingerprints",
    "metadata",
    "public_ids",
    "released_files",
    "resumes",
    "run_info",
    "runs",
    "units",
]

SCHEMA_VERSION = 1

metadata = MetaData()

datasets = Table(
    "veil_budget_datasets",
    metadata,
    Column("dataset_id", String(255), primary_key=True),
    Column("label", String(1000), nullable=False),
    Column("epsilon", Float, nullable=True),
    Column("delta", Float, nullable=True),
    Column("accountant", String(16), nullable=False),
    Column("neighbouring", String(32), nullable=False),
    Column("created_at", String(32), nullable=False),
    Column("updated_at", String(32), nullable=False),
)

runs = Table(
    "veil_budget_runs",
    metadata,
    Column("run_id", String(255), primary_key=True),
    Column("dataset_id", String(255), ForeignKey("veil_budget_datasets.dataset_id"), nullable=False),
    Column("job", String(32), nullable=False),
    # reserved: charged with planned_events (a run in progress, or one that died: it stays charged);
    # committed: charged with events (what the run's ledger recorded); released: never read a row.
    Column("status", String(16), nullable=False),
    Column("planned_events", Text, nullable=False),
    Column("events", Text, nullable=True),
    Column("delta", Float, nullable=True),
    Column("created_at", String(32), nullable=False),
    Column("finished_at", String(32), nullable=True),
    Index("ix_veil_budget_runs_dataset", "dataset_id"),
)

units = Table(
    "veil_budget_units",
    metadata,
    Column("dataset_id", String(255), ForeignKey("veil_budget_datasets.dataset_id"), primary_key=True),
    Column("privacy_unit", String(255), nullable=False),
    Column("created_at", String(32), nullable=False),
)

run_info = Table(
    "veil_budget_run_info",
    metadata,
    Column("run_id", String(255), primary_key=True),
    Column("user", String(255), nullable=True),
    Column("report", String(4000), nullable=True),
)

fingerprints = Table(
    "veil_budget_fingerprints",
    metadata,
    # The primary key makes one name per file: a second name racing for it fails on the constraint.
    Column("fingerprint", String(255), primary_key=True),
    Column("dataset_id", String(255), ForeignKey("veil_budget_datasets.dataset_id"), nullable=False),
    Column("first_seen", String(32), nullable=False),
    Index("ix_veil_budget_fingerprints_dataset", "dataset_id"),
)

public_ids = Table(
    "veil_budget_public_ids",
    metadata,
    # A random id per content-fingerprinted dataset: what a release names it by (the fingerprint is a
    # function of the private rows and stays in the registry). Created by create_all, like the above.
    Column("dataset_id", String(255), primary_key=True),
    Column("public_id", String(64), nullable=False, unique=True),
    Column("created_at", String(32), nullable=False),
)

resumes = Table(
    "veil_budget_resumes",
    metadata,
    # One row per resumable run (train, federated): the continuation that holds it and its ledger's
    # length at the last settlement. Created by create_all, like the above.
    Column("run_id", String(255), ForeignKey("veil_budget_runs.run_id"), primary_key=True),
    Column("generation", Integer, nullable=False),
    Column("ledger_records", Integer, nullable=False),
    Column("updated_at", String(32), nullable=False),
)

released_files = Table(
    "veil_budget_released_files",
    metadata,
    # One row per file a run published (release/): its content hash and name. The run's dataset is
    # found through veil_budget_runs (links move runs under a name, and their files with them).
    Column("sha256", String(64), primary_key=True),
    Column("run_id", String(255), primary_key=True),
    Column("name", String(255), nullable=False),
    Column("recorded_at", String(32), nullable=False),
)
