"""Privacy units in a federated run (``veil federated --mode record-level --privacy-unit COLUMN``).

What is protected. Neighbouring federations differ by adding or removing **one unit with all its
rows** (a person), wherever those rows would sit. Two rules give it:

1. **A person lives in one silo.** A row's silo is read off a keyed hash of its *unit* key alone
   (:func:`silo_positions`: :func:`veil.pipeline.private_data.record_positions` of the unit's key,
   domain ``veil.federated.silo``, cut into ``clients`` equal intervals), so every row of a person
   lands in the same silo and adding or removing a person changes exactly that silo, by that
   person's rows. (A split by row would spread a person over silos: each silo's unit-level guarantee
   would then hold for *its part* of the person only, and parallel composition over silos would no
   longer apply to people.)
2. **Each silo runs unit-level DP-SGD** (:mod:`veil.units`, the engine's ``unit_ids``): Poisson
   sampling of the silo's units at ``q_k = min(1, B / n_k)`` with ``n_k`` the silo's *units*, at most
   ``K`` rows of a sampled unit, the mean of its rows' per-row gradients clipped once to C. Each step
   is ``PoissonSampled(q_k, Gaussian(σ_k))`` over units, so the silo's own accounting, the server's
   ledger, the parallel composition over silos and the registry's charge
   (:mod:`veil.federated.charge`) are those of a row-level run with "row" read as "unit".

The hash key. The assignment is a function of the unit alone, with a public key (the federation's
fixed seed, as the row partition's): the guarantee holds for any key fixed independently of the
data, so secrecy of the key adds nothing to it; a public key keeps every party's partition identical
without shipping a secret through Flower's run config (which the ledger header records).

What is public. Each silo's number of units ``n_k`` (its q) is treated as public, exactly as a silo's
row count is at the row level and N is for ``veil train``; ``K`` and ``B`` are settings.

Client level with a unit is refused before reading: a client-level guarantee covers a client's
whole data, but under the simulated partitions a person's rows can lie in several clients, and then
it does not cover the person (and the registry's row charge for client level, a replacement of one
client's update, assumes one record in one client). Only ``iid`` silos (by unit) are offered: a
Dirichlet split draws by label and a ``column:`` split by another column, either of which can split a
person.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from veil.errors import ConfigError

__all__ = ["check_unit_settings", "silo_positions", "unit_section"]


def check_unit_settings(s: Any) -> None:
    """Refuse, from the settings alone (before a row is read), a unit the run cannot honour.

    ``s``: the :class:`~veil.federated.settings.FederatedSettings` being built (which calls this
    from its own checks; typed loosely so that this module does not import it back)."""
    from veil.units import check_max_rows_per_unit

    if not s.privacy_unit:
        if s.max_rows_per_unit:
            raise ConfigError(
                "max_rows_per_unit",
                s.max_rows_per_unit,
                "K bounds the rows of one privacy unit, and no unit column is named",
                "add --privacy-unit COLUMN, or drop --max-rows-per-unit",
            )
        return
    if s.mode != "record-level":
        raise ConfigError(
            "privacy_unit",
            s.privacy_unit,
            "a client-level guarantee covers one client's data, and a person's rows can lie in "
            "several simulated clients, so it would not cover the person",
            "use --mode record-level with --privacy-unit (silos by person, unit-level DP-SGD in each)",
        )
    if s.partition != "iid":
        raise ConfigError(
            "partition",
            s.partition,
            "with a privacy unit every row of a person must land in one silo; this partition "
            "assigns rows by label or by another column and can split a person",
            "use --partition iid with --privacy-unit (silos by a keyed hash of the unit)",
        )
    if not s.table_schema:
        raise ConfigError(
            "privacy_unit",
            s.privacy_unit,
            "the unit column must be declared an identifier (never a feature) before the table is read",
            f'read the table through a reviewed schema (--schema) that declares [columns."{s.privacy_unit}"] '
            'type = "ignored"',
        )
    if s.max_rows_per_unit != 0:  # 0: the default rule
        check_max_rows_per_unit(s.max_rows_per_unit)


def silo_positions(units: np.ndarray, seed: int) -> np.ndarray:
    """Each row's position in [0, 1) for the silo split: a keyed hash of its unit key alone (every
    row of a person gets the same position, so the same silo)."""
    from veil.pipeline.private_data import record_positions

    return record_positions(np.zeros((len(units), 0)), [], "veil.federated.silo", seed, units=units)


def unit_section(s: Any, silos: dict[str, Any]) -> dict[str, Any] | None:
    """The report's ``privacy_unit`` section (as ``veil train``'s), or None for a row-level run.

    ``units`` (the sum of the silos' units) is public by declaration, as each silo's size is;
    ``rows_used_per_step`` is the public bound B·K of one silo's step."""
    if not s.privacy_unit:
        return None
    return {
        "column": s.privacy_unit,
        "units": sum(int(v.get("units", 0)) for v in silos.values()),
        "max_rows_per_unit": s.unit_rows,
        "rows_used_per_step": s.local_batch * s.unit_rows,
        "rows_used_per_step_means": "an upper bound on the expected rows of a silo's step: B units × K rows",
        "unit_gradient": "mean of the unit's (at most K) rows' per-row gradients, clipped once to C",
        "silos": "every row of a unit lands in one silo (a keyed hash of the unit)",
        "public_by_declaration": "the number of units of each silo, as a silo's rows are at the row level",
    }
