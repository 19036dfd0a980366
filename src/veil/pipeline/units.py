"""The privacy unit of a job (``--privacy-unit COLUMN``): what each job supports, checked before reading.

Which jobs protect units (docs/privacy-unit.md): ``veil train`` on a table read through a reviewed
schema (CSV, Parquet, SQL), in one process, without ``--stream`` or ``--audit``. Every other
combination is refused here, from the configuration alone, before a row is read.
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
            "stream",
            getattr(cfg, "stream", False),
            "a streamed run samples rows window by window and cannot gather a unit's rows",
        ),
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
