"""Disjoint teacher partitions, and the public pool's shape check and count of rows equal to private rows.

Guarantee. Each private example (or each group, when group ids are given) is assigned to exactly
one teacher by a keyed hash of its own content (or of its group id) — never of its position in
the dataset. Adding or removing one example therefore changes the training set of exactly one
teacher and leaves every other teacher's set untouched: the property the PATE analysis
(:mod:`veil.pate.analysis`) assumes under the add/remove-one neighbouring relation. With group
ids, the unit of privacy is the group (a patient, a hospital): all its examples land in one
teacher, so adding or removing the whole group changes one teacher. Under replace-one, a
replacement is a removal plus an addition and may touch two teachers (group privacy of size 2).

A position-based split (shuffle, then cut into k blocks) would *not* have this property: removing
one example shifts the blocks and can change every teacher.

Empty teachers. A teacher whose partition holds no example abstains: its vote vector is zero on
every query (:data:`veil.pate.teachers.ABSTAIN`), so each query's histogram sums to the number of
teachers with data, at most K. This is a rule on the teacher's own partition, never a refusal
after the rows are read (which would make the run's outcome depend on how many examples there
are). The analyses are unchanged: every record is in exactly one teacher's partition, so adding or
removing one record changes one teacher's vote vector — from one class to another (L2 distance √2,
L1 2), or between a vote and abstaining (L2 1, L1 1) when that record is the teacher's first or
last — never more than the √2 (L2) and 2 (L1) the GNMax and LNMax bounds assume; each count (so
each order statistic, and the top count the confident threshold reads) moves by at most one per
changed teacher and stays in [0, K], which is all the data-dependent bounds, their smooth
sensitivity and the PTR distance use (:mod:`veil.pate.smooth_sensitivity`, :mod:`veil.pate.ptr`).

No training row at all. The keyed train/test split may leave the training side empty (N = 0, which
depends on one record: N is private for PATE). That is the same rule at its limit, never an error:
every teacher abstains, every histogram is zero, and the aggregator answers each query as it would
any other (GNMax: the noisy argmax of zero counts, a label drawn by the noise alone; Confident-GNMax:
the threshold check on noise alone). Every query asked is charged as planned and the labels and
report are released with the shape of any other run; adding one record then moves one teacher from
abstaining to one vote, within the bounds above. The helpers here take zero rows as they take any
(:func:`row_digests` hashes none, :func:`count_shared_rows` counts none).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from veil.data.rows import flat_rows
from veil.errors import DataError, InvalidParameterError

__all__ = ["Partition", "check_public_shape", "count_shared_rows", "partition_teachers", "row_digests"]


@dataclass(frozen=True)
class Partition:
    """``assignment[i]`` is the teacher of private example ``i``; ``unit`` is what one teacher protects."""

    assignment: np.ndarray
    num_teachers: int
    unit: Literal["example", "group"]
    num_units: int

    def indices(self, teacher: int) -> np.ndarray:
        """Row indices of the private examples of ``teacher``."""
        return np.flatnonzero(self.assignment == teacher)

    @property
    def sizes(self) -> np.ndarray:
        return np.bincount(self.assignment, minlength=self.num_teachers)


def _canonical_rows(x: np.ndarray) -> np.ndarray:
    """Rows as contiguous float64 (−0.0 folded into 0.0), so equal values hash equally.

    No rows (a 0-d value, or an array of length 0: an empty training side, which depends on one
    record) is no error: an empty ``(0, row size)`` array, whose rows there are none to hash."""
    a = np.asarray(x)
    if a.ndim == 0:
        return np.zeros((0, 0), dtype=np.float64)
    flat = flat_rows(a)  # (0, row size) for no rows
    if len(flat) == 0 or np.issubdtype(flat.dtype, np.number) or flat.dtype == np.bool_:
        return np.ascontiguousarray(flat.astype(np.float64) + 0.0)
    return np.ascontiguousarray(flat)


def row_digests(x: np.ndarray, key: bytes = b"", extra: np.ndarray | None = None) -> list[bytes]:
    """A 16-byte keyed BLAKE2b digest of each row of ``x`` (and of ``extra[i]``, e.g. the label)."""
    rows = _canonical_rows(x)
    out = []
    for i in range(rows.shape[0]):
        h = hashlib.blake2b(rows[i].tobytes(), digest_size=16, key=key[:64])
        if extra is not None:
            h.update(b"|" + repr(extra[i].item() if hasattr(extra[i], "item") else extra[i]).encode())
        out.append(h.digest())
    return out


def _teacher_of(digest: bytes, num_teachers: int) -> int:
    return int.from_bytes(digest[:8], "little") % num_teachers


def partition_teachers(
    x: np.ndarray,
    y: np.ndarray,
    num_teachers: int,
    seed: int,
    groups: Sequence[object] | np.ndarray | None = None,
) -> Partition:
    """Assign each private example (or group) to one of ``num_teachers`` teachers (see module docstring).

    Never refuses on what the data holds: a teacher whose partition is empty (more teachers than
    examples, or the hash leaving one out) abstains — a public per-record rule, see the module doc.
    Only the settings (``num_teachers`` ≥ 1) and the inputs' layout (one label and one group id per
    example) are checked.
    """
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, (int, np.integer)) or num_teachers < 1:
        raise InvalidParameterError(
            "teachers", num_teachers, "the ensemble needs at least one teacher", "pass an integer ≥ 1"
        )
    k = int(num_teachers)
    n = int(np.asarray(x).shape[0])
    if len(y) != n:
        raise DataError(
            "y", len(y), f"there are {n} examples but {len(y)} labels", "pass one label per example"
        )
    key = hashlib.sha256(f"veil-pate-partition:{int(seed)}".encode()).digest()
    if groups is not None:
        g = np.asarray(groups)
        if g.shape[0] != n:
            raise DataError(
                "groups",
                g.shape[0],
                f"there are {n} examples but {g.shape[0]} group ids; an example without a group "
                "could land in another teacher than its group",
                "pass one group id per example",
            )
        ids = [repr(v.item() if hasattr(v, "item") else v).encode() for v in g]
        uniq = {v: hashlib.blake2b(v, digest_size=16, key=key).digest() for v in set(ids)}
        assignment = np.array([_teacher_of(uniq[v], k) for v in ids], dtype=np.int64)
        unit: Literal["example", "group"] = "group"
        units = len(uniq)
    else:
        digests = row_digests(x, key=key, extra=np.asarray(y))
        assignment = np.array([_teacher_of(d, k) for d in digests], dtype=np.int64)
        unit = "example"
        units = n
    return Partition(assignment=assignment, num_teachers=k, unit=unit, num_units=units)


def check_public_shape(private_x: np.ndarray, public_x: np.ndarray, what: str = "public data") -> None:
    """Refuse a public pool whose rows do not have the private rows' shape (a fact of the two files'
    layouts, the same for every row), so the teachers cannot label it."""
    a, b = np.asarray(private_x), np.asarray(public_x)
    if a.shape[1:] != b.shape[1:]:
        raise DataError(
            what,
            f"shape {b.shape[1:]}",
            f"its rows do not have the private data's shape {a.shape[1:]}, so it cannot be labelled "
            "by teachers trained on that data",
            "pass public examples with the same features as the private data",
        )


def count_shared_rows(private_x: np.ndarray, public_x: np.ndarray) -> int:
    """How many public rows equal a private row exactly (same feature values; by hashing rows).

    Never a refusal: the public pool is public by the user's declaration (or a benchmark's documented
    split), and whether a public row equals a private one is known only after reading both — refusing
    on it would make the run depend on one record. The count is computed from the private rows without
    noise, so it is reported in ``non_private`` only (for the operator to check the declaration).
    Near-duplicates (re-encoded, cropped) are not found this way."""
    private = set(row_digests(np.asarray(private_x)))
    return sum(d in private for d in row_digests(np.asarray(public_x)))
