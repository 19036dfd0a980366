"""The settings of one federated run, flat so they travel as Flower's run config.

A ``flwr run`` passes settings to the ServerApp and every ClientApp as ``context.run_config`` (a
flat mapping of TOML scalars); :meth:`FederatedSettings.to_run_config` and
:meth:`FederatedSettings.from_run_config` are the two directions, so a simulated run and a deployed
one read the same values. ``seed = -1`` means no seed: noise and sampling come from the OS CSPRNG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from veil.accounting.base import AccountantName
from veil.errors import ConfigError, VeilError

__all__ = ["MAX_FAILED_ROUNDS", "MODES", "FederatedRunError", "FederatedSettings"]

MAX_FAILED_ROUNDS = 3
"""Consecutive rounds in which every contacted client failed before the server stops (resumable)."""


class FederatedRunError(VeilError, RuntimeError):
    """The federated run stopped on a refusal or a failure (its one-line reason is kept)."""


Mode = Literal["client-level", "record-level"]
MODES: tuple[Mode, ...] = ("client-level", "record-level")


@dataclass(frozen=True)
class FederatedSettings:
    """Privacy settings (mode, ε, δ, q, C, σ, rounds, local DP-SGD) and how clients train locally."""

    mode: Mode
    dataset: str
    clients: int
    rounds: int
    epsilon: float
    delta: float
    sampling_rate: float = 1.0
    """client-level: each client's probability of taking part in a round (Poisson)."""
    partition: str = "iid"
    data_dir: str = ""
    target: str = ""
    model: str = "auto"
    clip: float = 1.0
    """client-level: L2 bound C on a client's model update; record-level: DP-SGD's per-example C."""
    sigma: float = 0.0
    """client-level: noise multiplier of the noisy sum, calibrated before the run starts."""
    server_lr: float = 1.0
    server_optimizer: str = "sgd"
    """client-level: the server's step on the noisy mean update, ``sgd``, ``momentum`` (FedAvgM) or
    ``adam`` (FedAdam): post-processing, no privacy cost (:mod:`veil.federated.server_optimizer`)."""
    server_momentum: float = 0.9
    """client-level: the momentum (Adam's β₁) of ``momentum`` and ``adam``."""
    local_epochs: int = 1
    local_lr: float = 0.1
    local_batch: int = 32
    """client-level: minibatch of local SGD; record-level: expected DP-SGD batch of each silo."""
    local_steps: int = 10
    """record-level: DP-SGD steps each silo takes per round."""
    accountant: AccountantName = "pld"
    seed: int = -1
    test_fraction: float = 0.2
    out: str = ""
    node_timeout: float = 600.0
    dataset_id: str = ""
    """A declared dataset identity for the budget registry (``--dataset-id``), as ``veil train``'s."""
    budget_run_id: str = ""
    """The budget registry's id of this run (set when it is admitted; kept for a resume)."""
    budget_dataset_id: str = ""
    """The dataset identity the run is charged to (for the record in the ledger header)."""
    table_schema: str = ""
    """A reviewed table schema (``--schema``) for ``csv:``/``parquet:``/``sql:`` data, read through the
    one loader every job uses (:func:`veil.data.load_dataset`)."""
    table: str = ""
    query: str = ""
    privacy_unit: str = ""
    """record-level: the unit column (``--privacy-unit``): each silo protects people, not rows
    (:mod:`veil.federated.units`)."""
    max_rows_per_unit: int = 0
    """With a unit: K, the rows one unit contributes per step at most; 0 means the default rule
    (:func:`veil.units.default_max_rows_per_unit` of ``local_batch``)."""
    fail_client: int = -1
    """Fault injection for tests: the client with this partition id raises in round ``fail_round``."""
    fail_round: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(
                "mode", self.mode, "unknown federated privacy mode", f"use one of {list(MODES)}"
            )
        for name in ("clients", "rounds", "local_epochs", "local_batch", "local_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    name, value, "a count of clients, rounds or steps must be ≥ 1", f"pass --{name} ≥ 1"
                )
        from veil.federated.partition import parse_partition

        parse_partition(self.partition)
        from veil.federated.server_optimizer import check_server_optimizer

        check_server_optimizer(self.server_optimizer, self.server_momentum)
        for name in ("clip", "server_lr", "local_lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(name, value, "it must be a positive number", f"pass {name} > 0")
        from veil.federated.units import check_unit_settings

        check_unit_settings(self)

    @property
    def secure(self) -> bool:
        return self.seed < 0

    @property
    def unit_rows(self) -> int:
        """K of a privacy-unit run: the declared one, else the default rule on ``local_batch``."""
        from veil.units import default_max_rows_per_unit

        return self.max_rows_per_unit or default_max_rows_per_unit(self.local_batch)

    @property
    def expected_clients(self) -> float:
        """qN: the public denominator of client-level DP-FedAvg."""
        return self.sampling_rate * self.clients

    def replace(self, **changes: Any) -> FederatedSettings:
        return dataclasses.replace(self, **changes)

    def to_run_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_run_config(cls, config: Mapping[str, Any]) -> FederatedSettings:
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ConfigError(
                "run config", unknown[0], "not a veil federated setting", f"use {sorted(names)}"
            )
        values: dict[str, Any] = {}
        for key, value in config.items():
            if (
                isinstance(names[key].default, float)
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                value = float(value)  # TOML writes 1.0 as 1 when a user overrides it
            values[key] = value
        return cls(**values)
