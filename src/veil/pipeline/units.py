"""The privacy unit of a job (``--privacy-unit COLUMN``): what each job supports, checked before reading.

Which jobs protect units (docs/privacy-unit.md): ``veil train`` and ``veil tune`` on a table read
through a reviewed schema (CSV, Parquet, SQL, and Parquet with ``--stream``), in one process, without
``--audit``
(``veil synth`` has its own rule: :mod:`veil.synth.units`). Every other combination is refused here,
from the configuration alone, before a row is read.
"""

from __future__ import annotations

from typing import Any

from veil.errors import ConfigError

__all__ = ["check_unit_request"]


def check_unit_request(cfg: Any, job: str, *, supported: bool) -> None:
    """Refuse a privacy unit the job cannot honour, and K without a unit (before reading)."""
    unit = getattr(cfg, "privacy_unit", None)
    k = getattr(cfg, "max_rows_per_unit", None)
    if unit is None:
        if k is not None:
            raise ConfigError(
                "max_rows_per_unit",
                k,
                "K bounds the rows of one privacy unit, and no unit column is named",
                "add --privacy-unit COLUMN, or drop --max-rows-per-unit",
            )
        return
    if not supported:
        raise ConfigError(
            "privacy_unit",
            unit,
            f"{job} does not protect units yet: it would protect single rows while the report named people",
            "drop --privacy-unit for this job (see docs/privacy-unit.md for the jobs that support it)",
        )
    for flag, on, why in (
        (
            "audit",
            getattr(cfg, "audit", False),
            "the one-run audit's canaries are single examples, not units",
        ),
    ):
        if on:
            raise ConfigError(
                "privacy_unit",
                unit,
                f"--{flag} is not supported with a privacy unit: {why}",
                f"drop --{flag} for a privacy-unit run, or drop --privacy-unit",
            )
    from veil.distributed.runtime import rank_and_world

    if rank_and_world()[1] > 1:
        raise ConfigError(
            "privacy_unit",
            unit,
            "unit-level DP-SGD samples units in one process; across ranks it is not implemented",
            "train a privacy-unit run in one process (drop --nproc-per-node)",
        )


def unit_section(cfg: Any, data: Any, max_rows_per_unit: int) -> dict[str, Any] | None:
    """The report's ``privacy_unit`` section, or None for a row-level run.

    ``units`` (N) is public by declaration, exactly as N is for rows: the accountant's q = B/N
    uses it. ``rows_used_per_step`` is a public bound computed from settings only, B·K: the
    expected rows of one step are at most that (each of the B expected units gives at most K)."""
    if data.units_train is None:
        return None
    assert cfg.batch_size is not None
    return {
        "column": data.unit_column,
        "units": data.n_units,
        "max_rows_per_unit": max_rows_per_unit,
        "rows_used_per_step": cfg.batch_size * max_rows_per_unit,
        "rows_used_per_step_means": "an upper bound on the expected rows of one step: B units × K rows",
        "unit_gradient": "mean of the unit's (at most K) rows' per-row gradients, clipped once to C",
        "public_by_declaration": "the number of units, as N is for a row-level run",
    }


def unit_covers(section: dict[str, Any] | None) -> str:
    """What one protected record is, in the words of the report's ``covers``."""
    if section is None:
        return (
            "each training row on its own (add/remove-one-row): a person with several rows is protected "
            "only by group privacy, which is weaker (about k·ε for k rows, with a larger δ); name a "
            "--privacy-unit column to protect people"
        )
    return (
        f"each person (unit column `{section['column']}`), whatever number of rows they have "
        f"(add/remove one unit with all its rows; {section['units']} units, at most "
        f"{section['max_rows_per_unit']} rows of a unit per step)"
    )
