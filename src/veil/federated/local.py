"""What the data holders compute: the federation's data, the model, local training and evaluation.

Each client loads the dataset named by the run, keeps only its own rows (its partition) and maps
them through the model's fixed front (scattering or random features: no parameters, each example on
its own, drawn from a public seed — so precomputing costs no privacy and every party builds the same
front). Only the head travels and trains. A simulated run computes the front's features of every
training row once, before its clients start, into a file of the run folder that every simulated
client reads its rows from (:func:`shared_features`, :mod:`veil.federated.features`).

* client-level mode: :func:`local_sgd` — ordinary (non-private) SGD on the client's rows; privacy
  comes from the server's clipping and noise, at the level of whole clients.
* record-level mode: :func:`local_dpsgd` — DP-SGD with veil's :class:`~veil.engine.PrivacyEngine`
  on the silo's rows; the silo's own accountant composes one event per step.

Preprocessing is public: images are divided by the format's documented maximum pixel value; table
features go through ``asinh`` (a fixed per-value map). No statistic of the private data is used.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from veil.data import Dataset, load_dataset
from veil.errors import DataError
from veil.federated.features import (
    FEATURES_DIR,
    cache_key,
    forget_mappings,
    read_rows,
    remove_leftovers,
    write_features,
)
from veil.federated.partition import parse_partition, row_positions, split_rows
from veil.federated.settings import FederatedSettings
from veil.models import InputTransform, build_model, fixed_features, resolve_name, split_fixed_front

__all__ = [
    "Federation",
    "build_network",
    "client_features",
    "evaluate",
    "federation",
    "get_arrays",
    "local_dpsgd",
    "local_sgd",
    "partition_features",
    "set_arrays",
    "shared_features",
    "shared_features_path",
]

FRONT_SEED = 20261130
"""Public seed of the fixed front and of the initial head: the same model on every party."""


@dataclass(frozen=True)
class Federation:
    """The dataset and each client's row indices (the partition column, if any, removed)."""

    data: Dataset
    parts: tuple[np.ndarray, ...]

    @property
    def units(self) -> np.ndarray | None:
        """Each training row's unit key (privacy units), or None: each row is its own record."""
        return self.data.units_train

    def records(self, pid: int) -> int:
        """What silo ``pid``'s DP-SGD samples: its distinct units, else its rows."""
        rows = self.parts[pid]
        return len(rows) if self.units is None else len(np.unique(self.units[rows]))


def _drop_column(data: Dataset, column: str) -> tuple[Dataset, np.ndarray]:
    names = data.feature_names or []
    if column not in names:
        raise DataError(
            "partition",
            f"column:{column}",
            "the data has no such column, so rows cannot be assigned to their clients",
            f"name one of the feature columns ({', '.join(names[:8]) or 'none: not a table'})",
        )
    j = names.index(column)
    keep = [i for i in range(len(names)) if i != j]
    values = data.x_train[:, j].copy()
    data = Dataset(
        name=data.name,
        kind=data.kind,
        x_train=data.x_train[:, keep],
        y_train=data.y_train,
        x_test=data.x_test[:, keep],
        y_test=data.y_test,
        classes=data.classes,
        sha256=data.sha256,
        preset=data.preset,
        feature_names=[names[i] for i in keep],
        pixel_max=data.pixel_max,
    )
    return data, values


@dataclass(frozen=True)
class _Source:
    """What names the data of a run (hashable: the federation is cached per source)."""

    dataset: str
    data_dir: str
    target: str
    test_fraction: float
    table_schema: str
    table: str
    query: str
    privacy_unit: str


@functools.lru_cache(maxsize=2)
def _federation(source: _Source, partition: str, clients: int) -> Federation:
    spec = parse_partition(partition)
    data = load_dataset(  # the one loader of every job (schemas, units, splits by unit)
        source.dataset,
        data_dir=source.data_dir or None,
        target=source.target or None,
        test_fraction=source.test_fraction,
        seed=0,
        schema=source.table_schema or None,
        table=source.table or None,
        query=source.query or None,
        privacy_unit=source.privacy_unit or None,
    )
    column_values = None
    if spec.kind == "column":
        data, column_values = _drop_column(data, spec.column)
    if data.units_train is not None:  # every row of a person in one silo (veil.federated.units)
        from veil.federated.units import silo_positions

        positions = silo_positions(data.units_train, FRONT_SEED)
    elif spec.kind == "column":
        positions = None
    else:
        positions = row_positions(data.x_train, data.y_train, FRONT_SEED)
    parts = split_rows(
        spec,
        data.y_train,
        clients,
        seed=FRONT_SEED,
        column_values=column_values,
        positions=positions,
        num_classes=data.num_classes,
    )
    return Federation(data, tuple(parts))  # an empty client contributes a zero update


def federation(s: FederatedSettings) -> Federation:
    """The run's data split over its clients (cached per process: simulated clients share it). Always
    ``s.clients`` of them, whatever the data holds (``column:`` hashes values onto them)."""
    source = _Source(
        s.dataset, s.data_dir, s.target, s.test_fraction, s.table_schema, s.table, s.query, s.privacy_unit
    )
    return _federation(source, s.partition, s.clients)


def _preprocess(kind: str, d: tuple[int, ...], pixel_max: float | None) -> nn.Module:
    zeros, ones = torch.zeros(d), torch.ones(d)
    inf = torch.full(d, math.inf)
    if kind == "image" and pixel_max:
        return InputTransform(-inf, inf, zeros, ones / float(pixel_max))
    return InputTransform(-inf, inf, zeros, ones, resolution=1.0 if kind == "table" else 0.0)


@functools.lru_cache(maxsize=4)
def _network(
    model: str, kind: str, shape: tuple[int, ...], classes: int, pixel_max: float | None
) -> tuple[nn.Module | None, nn.Module]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FRONT_SEED)
        name = resolve_name(model, kind, shape)
        net = build_model(name, shape, classes, kind)
        built = nn.Sequential(_preprocess(kind, shape, pixel_max), net)
    return split_fixed_front(built)


def build_network(s: FederatedSettings, data: Dataset) -> tuple[nn.Module | None, nn.Module]:
    """``(front, head)``: the fixed front (None for a model trained end to end) and the trained part.

    Built once per process from the public seed and kept: the front (no trained parameter; the
    scattering transform's filters take longer to build than a client's local epoch) is shared by
    reference, and each call gets its own copy of the initial head, as a fresh build would give."""
    front, head = _network(s.model, data.kind, tuple(data.input_shape), int(data.num_classes), data.pixel_max)
    return front, copy.deepcopy(head)


@functools.lru_cache(maxsize=8)
def _silo_features(s: FederatedSettings, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    front, _ = build_network(s, federation(s).data)
    return client_features(s, federation(s).parts[pid], front)


@functools.lru_cache(maxsize=4096)
def _client_level_features(s: FederatedSettings, pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    front, _ = build_network(s, federation(s).data)
    return client_features(s, federation(s).parts[pid], front)


@functools.lru_cache(maxsize=8)
def shared_features_path(s: FederatedSettings) -> Path | None:
    """Where the run's shared features of every training row live (:mod:`veil.federated.features`):
    inside the run folder, named by a key over the front's public description and the data's
    fingerprint; None for a model without a fixed front or a run without a folder."""
    if not s.out:
        return None
    data = federation(s).data
    name = resolve_name(s.model, data.kind, data.input_shape)
    front, _ = build_network(s, data)
    if front is None:
        return None
    description = {
        "model": name,
        "front": repr(front),
        "front_seed": FRONT_SEED,
        "input_shape": list(data.input_shape),
        "kind": data.kind,
        "pixel_max": data.pixel_max,
        "data_sha256": data.sha256,
        "train_rows": len(data.x_train),
        "columns": data.feature_names,
        "source": [s.dataset, s.data_dir, s.target, s.test_fraction, s.table_schema, s.table, s.query],
        "partition": s.partition,  # a column partition drops its column from the features
        "privacy_unit": s.privacy_unit,
    }
    return Path(s.out) / FEATURES_DIR / f"train-{cache_key(description)}.npy"


@contextlib.contextmanager
def shared_features(s: FederatedSettings) -> Iterator[Path | None]:
    """The fixed front's features of every training row, computed once for the whole simulated run
    before its clients start, and removed when it ends (they are a function of private rows: kept
    in the run folder's internal part only while the run needs them). Yields the file, or None for a
    model trained end to end."""
    path = shared_features_path(s)
    if path is None:
        yield None
        return
    front, _ = build_network(s, federation(s).data)
    assert front is not None
    try:
        remove_leftovers(path.parent)  # a killed earlier run's file, whatever its key
        write_features(front, federation(s).data.x_train, path)
        yield path
    finally:
        forget_mappings()
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def partition_features(
    s: FederatedSettings, pid: int, front: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``pid``'s features and labels. With a fixed front: read from the run's shared file when
    the simulation wrote one (:func:`shared_features`), else computed once per process and kept (in
    memory only: a fixed front such as the scattering transform costs more per client and round than
    its training, and the kept features of all clients are at most the training set's)."""
    if front is not None:
        path = shared_features_path(s)
        if path is not None and path.exists():
            fed = federation(s)
            rows = fed.parts[pid]
            return (
                torch.from_numpy(read_rows(path, rows)),
                torch.from_numpy(np.asarray(fed.data.y_train[rows], dtype=np.int64)),
            )
    if s.mode == "record-level":
        return _silo_features(s, pid)
    if front is None:
        return client_features(s, federation(s).parts[pid], None)
    return _client_level_features(s, pid)


def client_features(
    s: FederatedSettings, rows: np.ndarray | None, front: nn.Module | None, test: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (front applied) and labels of the given training rows, or of the test split."""
    data = federation(s).data
    x, y = (data.x_test, data.y_test) if test else (data.x_train[rows], data.y_train[rows])
    feats = fixed_features(front, x) if front is not None else np.asarray(x, dtype=np.float32)
    return torch.from_numpy(feats), torch.from_numpy(np.asarray(y, dtype=np.int64))


def get_arrays(head: nn.Module) -> list[np.ndarray]:
    """The head's trainable parameters, in order, as float32 numpy arrays (the travelling model)."""
    return [p.detach().cpu().numpy().astype(np.float32, copy=True) for p in head.parameters()]


def set_arrays(head: nn.Module, arrays: list[np.ndarray]) -> None:
    params = list(head.parameters())
    if len(params) != len(arrays) or any(
        tuple(p.shape) != a.shape for p, a in zip(params, arrays, strict=False)
    ):
        raise DataError(
            "model arrays",
            [a.shape for a in arrays],
            "the received model does not match this client's network, so its update would be meaningless",
            "run every party with the same --dataset and --model",
        )
    with torch.no_grad():
        for p, a in zip(params, arrays, strict=True):
            p.copy_(torch.from_numpy(np.asarray(a)))


def local_sgd(
    head: nn.Module, x: torch.Tensor, y: torch.Tensor, s: FederatedSettings, seed: int | None
) -> None:
    """``local_epochs`` of minibatch SGD on the client's own rows (client-level mode: not private alone)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.SGD(head.parameters(), lr=s.local_lr)
    loss_fn = nn.CrossEntropyLoss()
    head.train()
    for _ in range(s.local_epochs):
        order = rng.permutation(len(x))
        for i in range(0, len(order), s.local_batch):
            idx = torch.from_numpy(order[i : i + s.local_batch])
            opt.zero_grad()
            loss_fn(head(x[idx]), y[idx]).backward()
            opt.step()


def silo_sampling_rate(s: FederatedSettings, n: int) -> float:
    """q_k = min(1, B / n_k) of a silo's Poisson batches, n_k its records (rows, or units with a
    privacy unit; treated as public, as in DP-SGD): a silo smaller than the expected batch takes every
    record in each step (fewer than B), an empty one takes none; never a refusal once the rows are read."""
    return min(1.0, s.local_batch / n) if n > 0 else 1.0


def _engine(s: FederatedSettings, seed: int | None) -> Any:
    """veil's engine: secure randomness, or the research seed (asking for reproducibility by name
    where the engine's signature has ``reproducible``)."""
    import inspect

    from veil.engine import PrivacyEngine

    if s.secure:
        return PrivacyEngine(accountant=s.accountant, secure_rng=True)
    kwargs: dict[str, Any] = {"secure_rng": False, "seed": seed}
    if "reproducible" in inspect.signature(PrivacyEngine).parameters:
        kwargs["reproducible"] = True
    return PrivacyEngine(accountant=s.accountant, **kwargs)


def silo_units(s: FederatedSettings, pid: int) -> np.ndarray | None:
    """Silo ``pid``'s rows' unit keys (in the order of :func:`partition_features`), or None."""
    fed = federation(s)
    return None if fed.units is None else fed.units[fed.parts[pid]]


def local_dpsgd(
    head: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    s: FederatedSettings,
    sigma: float,
    seed: int | None,
    units: np.ndarray | None = None,
) -> int:
    """``local_steps`` DP-SGD steps with veil's engine on the silo's rows; returns the steps taken (as
    charged). A silo without rows leaves the model unchanged (a zero update) and counts its steps.

    ``units`` (one unit key per row): unit-level DP-SGD (:mod:`veil.units`, the engine's
    ``unit_ids``): the silo's units are Poisson-sampled at q = min(1, B / n_units), each contributes
    at most ``s.unit_rows`` rows, the mean of its rows' gradients clipped once to C."""
    from torch.utils.data import DataLoader, TensorDataset

    if len(x) == 0:
        return s.local_steps
    records = len(x) if units is None else len(np.unique(units))
    unit_args: dict[str, Any] = {} if units is None else {"unit_ids": units, "max_rows_per_unit": s.unit_rows}

    engine = _engine(s, seed)
    opt = torch.optim.SGD(head.parameters(), lr=s.local_lr)
    loss_fn = nn.CrossEntropyLoss()
    model, optimizer, loader = engine.make_private(
        module=head,
        optimizer=opt,
        # q = min(1, B/n): a silo smaller than its batch takes every record in each step.
        data_loader=DataLoader(TensorDataset(x, y), batch_size=min(s.local_batch, records)),
        max_grad_norm=s.clip,
        noise_multiplier=sigma,
        criterion=loss_fn,
        **unit_args,
    )
    model.train()
    while engine.steps < s.local_steps:
        for xb, yb in loader:
            loss_fn(model(xb), yb).backward()  # an empty Poisson batch still takes a noisy step
            optimizer.step()
            optimizer.zero_grad()
            if engine.steps >= s.local_steps:
                break
    return engine.steps


def evaluate(head: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(accuracy, mean cross-entropy)`` of the head on features ``x`` (non-private figures)."""
    head.eval()
    with torch.no_grad():
        logits = head(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(1) == y).float().mean()) if len(y) else math.nan
    return acc, loss
