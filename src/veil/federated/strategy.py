"""The two DP strategies, as Flower strategies (subclasses of ``flwr.serverapp.strategy.FedAvg``).

:class:`PoissonDPFedAvg` (client level). ``configure_train`` samples the clients itself: every
connected node joins the round independently with probability q, drawn from veil's random source
(Flower's ``FedAvg`` draws ``fraction × nodes`` without replacement, which is not the Poisson
sampling the accountant's amplification assumes). A round may sample nobody: it is still a round,
charged and noised. The round's event is charged through ``charge`` *before* a message is sent, so
whatever a crash leaves behind was accounted. ``aggregate_train`` clips each client's update
``w_k − w`` to C, adds ``N(0, σ²C²)`` once to the sum (:mod:`veil.federated.aggregate`), divides by
the expected count qN and takes the server's step on that noisy mean (plain, momentum or Adam:
post-processing, :mod:`veil.federated.server_optimizer`). A client that fails is left out of the
sum (one client fewer is within the neighbouring relation; its round stays charged). Client-reported
metrics are not aggregated: they are functions of private data that no noise covers.

:class:`SiloFedAvg` (record level). Every silo takes part in every round (no client sampling: the
guarantee is per record, each silo's DP-SGD provides it). Before each round's messages leave, the
silo's planned DP-SGD steps for the round are charged to the run's ledger under its name; the
aggregate is Flower's FedAvg (weighted by each silo's number of records n, which DP-SGD's q = B/n
already treats as public: its rows, or its units with a privacy unit — never its row count then, which
depends on how many rows each person has).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from veil.federated.aggregate import noisy_clipped_sum
from veil.federated.server_optimizer import ServerOptimizerName, State, init_state, server_step
from veil.federated.settings import MAX_FAILED_ROUNDS, FederatedRunError
from veil.mechanisms.rng import RandomSource

__all__ = ["PoissonDPFedAvg", "SiloFedAvg", "poisson_sample"]


class _FailureWatch:
    """Stops the run (cleanly: resumable) after ``MAX_FAILED_ROUNDS`` consecutive rounds in which every
    contacted client failed: budget would keep being charged for rounds that cannot train."""

    def __init__(self) -> None:
        self.streak = 0

    def observe(self, server_round: int, contacted: int, failed: int, reasons: list[str]) -> None:
        self.streak = self.streak + 1 if contacted and failed == contacted else 0
        if self.streak >= MAX_FAILED_ROUNDS:
            raise FederatedRunError(
                "round",
                server_round,
                f"every contacted client failed in {self.streak} consecutive rounds "
                f"(last: {reasons[-1] if reasons else 'no reason given'}); each round is charged anyway",
                "fix the clients (see their logs), then continue with --resume",
            )


def poisson_sample(node_ids: Sequence[int], q: float, source: RandomSource) -> list[int]:
    """Each node independently with probability q (never above q: see ``RandomSource.bernoulli``)."""
    ordered = sorted(int(n) for n in node_ids)
    if q >= 1.0:
        return ordered
    mask = source.bernoulli(len(ordered), q)
    return [n for n, keep in zip(ordered, mask, strict=True) if keep]


def _finite(message: Message, key: str) -> bool:
    """Whether a reply's arrays are all finite (a NaN or inf update is a failed client)."""
    arrays = cast(ArrayRecord, message.content[key]).to_numpy_ndarrays()
    return all(np.isfinite(a).all() for a in arrays)


def _reasons(replies: list[Message]) -> list[str]:
    return [" ".join(str(m.error.reason).split())[-200:] for m in replies if m.has_error()]


class PoissonDPFedAvg(FedAvg):
    """Client-level DP-FedAvg: Poisson client sampling, server-side clipping, one noise draw per round.

    ``charge(round, sampled)`` must durably record the round's privacy event before it returns.
    """

    def __init__(
        self,
        *,
        sampling_rate: float,
        clip: float,
        noise_multiplier: float,
        expected_clients: float,
        server_lr: float,
        sampling_source: RandomSource,
        noise_source: RandomSource,
        charge: Callable[[int, list[int]], None],
        round_offset: int = 0,
        server_optimizer: ServerOptimizerName = "sgd",
        server_momentum: float = 0.9,
        optimizer_state: State | None = None,
    ) -> None:
        super().__init__(fraction_evaluate=0.0, min_available_nodes=1, min_train_nodes=0)
        self.server_optimizer: ServerOptimizerName = server_optimizer
        self.server_momentum = float(server_momentum)
        self.optimizer_state: State | None = optimizer_state  # None: zero moments at the first step
        self.sampling_rate = float(sampling_rate)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_clients = float(expected_clients)
        self.server_lr = float(server_lr)
        self._sampling = sampling_source
        self._noise = noise_source
        self._charge = charge
        self.round_offset = round_offset
        self._current: list[np.ndarray] = []
        self.failures: dict[int, int] = {}
        self.participants: dict[int, int] = {}
        self._watch = _FailureWatch()

    def summary(self) -> None:  # Flower logs this at start
        return None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        r = server_round + self.round_offset
        sampled = poisson_sample(list(grid.get_node_ids()), self.sampling_rate, self._sampling)
        self._charge(r, sampled)  # on disk before any client sees the round
        self._current = arrays.to_numpy_ndarrays()
        config["server-round"] = r
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, sampled, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        r = server_round + self.round_offset
        replies = list(replies)
        good = [m for m in replies if not m.has_error()]
        self.failures[r] = len(replies) - len(good)
        self.participants[r] = len(good)
        self._watch.observe(r, len(replies), self.failures[r], _reasons(replies))
        shapes = [a.shape for a in self._current]
        deltas = []
        for m in good:
            new = cast(ArrayRecord, m.content[self.arrayrecord_key]).to_numpy_ndarrays()
            deltas.append(
                [np.asarray(n, dtype=np.float64) - w for n, w in zip(new, self._current, strict=True)]
            )
        noisy, norms = noisy_clipped_sum(deltas, shapes, self.clip, self.noise_multiplier, self._noise)
        self.failures[r] += sum(not math.isfinite(n) for n in norms)  # left out: a failed client
        mean = [n / self.expected_clients for n in noisy]  # the fixed public denominator qN
        state = self.optimizer_state
        if state is None:
            state = init_state(self.server_optimizer, shapes)
        updated, self.optimizer_state = server_step(
            self.server_optimizer, self._current, mean, state, self.server_lr, self.server_momentum
        )
        return ArrayRecord(updated), MetricRecord({})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # clients' own metrics on private data are not released


class SiloFedAvg(FedAvg):
    """Record-level federation: every silo trains with DP-SGD each round; FedAvg of the silo models.

    ``charge(round, silos)`` must durably record each silo's planned DP-SGD events before it returns.
    """

    def __init__(
        self, *, silos: Sequence[int], charge: Callable[[int, list[int]], None], round_offset: int = 0
    ) -> None:
        n = len(silos)
        super().__init__(fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
        self.silos = sorted(int(s) for s in silos)
        self._charge = charge
        self.round_offset = round_offset
        self.failures: dict[int, int] = {}
        self.replies: dict[int, list[dict[str, float]]] = {}
        self._watch = _FailureWatch()

    def summary(self) -> None:
        return None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        r = server_round + self.round_offset
        self._charge(r, self.silos)
        config["server-round"] = r
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, self.silos, MessageType.TRAIN)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        r = server_round + self.round_offset
        replies = list(replies)
        good = [m for m in replies if not m.has_error() and _finite(m, self.arrayrecord_key)]
        self.failures[r] = len(replies) - len(good)  # an error or a non-finite update: a failed silo
        self._watch.observe(r, len(replies), self.failures[r], _reasons(replies))
        self.replies[r] = [dict(cast(Any, next(iter(m.content.metric_records.values())))) for m in good]
        arrays, _ = super().aggregate_train(server_round, good)
        return arrays, MetricRecord({})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []
