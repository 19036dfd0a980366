"""The server side of a run: wait for the federation, register silos, run the strategy, write the run.

Run folder (``settings.out``), written as the run goes:

* ``ledger.jsonl`` — the crash-safe, hash-chained ledger (:mod:`veil.accounting.ledger`): one
  ``step`` record per client-level round, or per silo and round at the record level, each fsync'ed
  before the round's messages are sent (so before any aggregate that depends on it exists);
* ``checkpoint.npz`` — the global model, the round it closes and the server step's moments
  (``opt_*``, post-processing of the noisy means; :mod:`veil.federated.server_optimizer`), atomic, from which
  :func:`serve` resumes: rounds already charged are never charged again nor re-run, so a run
  interrupted between a charge and its checkpoint loses that round's utility, never budget;
* ``history.json`` — per round: non-private test accuracy/loss of the global model, how many
  clients replied and failed (non-private too);
* ``silos.json`` (record level) — each silo's q, σ and size (treated as public, as DP-SGD's q = B/n);
* ``model.npz`` and an ``end`` ledger record when the planned rounds are done;
* ``error.txt`` — the one-line reason when the server stopped on a refusal.

A run stopped from outside (:class:`~veil.federated.stop.ServerStop`: the simulation's caller was
interrupted) charges no further round and saves no round the stop cut short; it writes no
``error.txt``: the folder is left as a crash leaves it, for ``--resume``.
"""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from veil.accounting.events import SelfComposed
from veil.accounting.ledger import Ledger, RunLock, atomic_write_bytes, atomic_write_text
from veil.errors import ConfigError, VeilError
from veil.federated.files import CHECKPOINT, ERROR, HISTORY, LEDGER, MODEL, SILOS
from veil.federated.privacy import round_event
from veil.federated.settings import FederatedSettings
from veil.federated.stop import ServerStop
from veil.mechanisms.rng import RandomSource, make_source

__all__ = ["serve", "wait_for_nodes"]


def _sources(s: FederatedSettings, done: int) -> tuple[RandomSource, RandomSource]:
    """(client sampling, noise): the OS CSPRNG, or independent streams of the research seed. A resumed
    run (``done`` rounds already charged) gets new streams, never a replay of the noise already used."""
    if s.secure:
        return make_source(True), make_source(True)
    from veil.pipeline.seeds import Purpose, derive_seed

    return (
        make_source(False, derive_seed(s.seed, Purpose.FEDERATED_SAMPLING, done)),
        make_source(False, derive_seed(s.seed, Purpose.FEDERATED_NOISE, done)),
    )


def wait_for_nodes(grid: Grid, s: FederatedSettings, stop: ServerStop | None = None) -> list[int]:
    """Every expected client connected (the population the accountant's q refers to), or a refusal."""
    deadline = time.monotonic() + s.node_timeout
    while True:
        if stop is not None:
            stop.check()
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) == s.clients:
            return nodes
        if len(nodes) > s.clients or time.monotonic() > deadline:
            raise ConfigError(
                "clients",
                s.clients,
                f"{len(nodes)} nodes are connected; client-level sampling rates and silo accounting are "
                "stated for the declared population",
                "start exactly --clients SuperNodes (or fix --clients)",
            )
        time.sleep(0.2)


def _save_npz(path: Path, arrays: list[np.ndarray], **extra: Any) -> None:
    buf = io.BytesIO()
    named: dict[str, Any] = {k: np.asarray(v) for k, v in extra.items()}
    np.savez(buf, *arrays, **named)
    atomic_write_bytes(path, buf.getvalue())


def _load_checkpoint(path: Path) -> tuple[list[np.ndarray], int, dict[str, np.ndarray]] | None:
    """``(model arrays, round, server-step state)`` of the checkpoint, if any."""
    if not path.exists():
        return None
    with np.load(path) as z:
        arrays = [z[f"arr_{i}"] for i in range(sum(1 for k in z.files if k.startswith("arr_")))]
        state = {k.removeprefix("opt_"): z[k] for k in z.files if k.startswith("opt_")}
        return arrays, int(z["round"]), state


def _register_silos(grid: Grid, nodes: list[int], s: FederatedSettings) -> dict[str, dict[str, Any]]:
    """Ask each silo its size, q and σ (a query message); a silo that cannot answer stops the run."""
    messages = [Message(RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    silos: dict[str, dict[str, Any]] = {}
    for reply in grid.send_and_receive(messages, timeout=s.node_timeout):
        if reply.has_error():
            why = (reply.error.reason or "no reason").strip().splitlines()[-1]
            raise ConfigError(
                "silo",
                reply.metadata.src_node_id,
                f"the silo could not plan its DP-SGD ({why})",
                "fix the silo's data or settings and restart it",
            )
        m: dict[str, Any] = dict(cast(Any, reply.content["silo"]))
        # privacy units: q = B / units, the δ check is against 1/units; a silo's row count is not
        # public then (it depends on each person's rows), so the silo does not send it
        size = {"units": int(m["units"])} if "units" in m else {"rows": int(m["num-examples"])}
        silos[f"silo-{int(m['partition-id'])}"] = {
            "node_id": int(reply.metadata.src_node_id),
            **size,
            "sampling_rate": float(m["sampling-rate"]),
            "noise_multiplier": float(m["noise-multiplier"]),
            "steps_per_round": s.local_steps,
        }
    return dict(sorted(silos.items()))


class _Run:
    """The server's view of one run folder: ledger, checkpoint, history."""

    def __init__(self, s: FederatedSettings, run_dir: Path, stop: ServerStop) -> None:
        self.s = s
        self.dir = run_dir
        self.stop = stop
        self.history: list[dict[str, Any]] = []
        if (run_dir / HISTORY).exists():
            self.history = json.loads((run_dir / HISTORY).read_text())["rounds"]
        self.ledger: Ledger | None = None
        self.silos: dict[str, dict[str, Any]] = {}

    def open_ledger(self, header: dict[str, Any]) -> Ledger:
        path = self.dir / LEDGER
        self.ledger = Ledger.open(path, repair=True) if path.exists() else Ledger.create(path, header)
        return self.ledger

    def rounds_charged(self) -> int:
        assert self.ledger is not None
        return len({r.get("round") for r in self.ledger.records if r["kind"] == "step"})

    def charge_clients(self, r: int, sampled: list[int]) -> None:
        assert self.ledger is not None
        self.stop.check()  # a stopped run charges no further round
        # The count of sampled clients (never which): the report's participation check reads it.
        self.ledger.append("step", round=r, event=self.ledger.header["step_event"], sampled=len(sampled))

    def charge_silos(self, r: int, node_ids: list[int]) -> None:
        assert self.ledger is not None
        self.stop.check()
        for name, silo in self.silos.items():
            event = SelfComposed(
                round_event(silo["sampling_rate"], silo["noise_multiplier"]), silo["steps_per_round"]
            )
            self.ledger.append("step", round=r, silo=name, event=event.to_dict())

    def after_round(
        self,
        r: int,
        arrays: list[np.ndarray],
        metrics: dict[str, Any],
        state: dict[str, np.ndarray] | None = None,
    ) -> None:
        moments = {f"opt_{k}": v for k, v in (state or {}).items()}
        _save_npz(self.dir / CHECKPOINT, arrays, round=r, **moments)
        self.history = [h for h in self.history if h["round"] != r] + [{"round": r, **metrics}]
        atomic_write_text(self.dir / HISTORY, json.dumps({"rounds": self.history}, indent=1, allow_nan=False))


def _evaluator(s: FederatedSettings) -> Any:
    from veil.federated import local

    fed = local.federation(s)
    front, head = local.build_network(s, fed.data)
    x, y = local.client_features(s, None, front, test=True)

    def evaluate(arrays: list[np.ndarray]) -> dict[str, float | None]:
        local.set_arrays(head, arrays)
        acc, loss = local.evaluate(head, x, y)
        # Zero test rows (a keyed split may hold none out of a tiny table): no figure, never NaN, so
        # the round's history and the report are written as for any other split (review revJ J8).
        return {
            "test_accuracy": acc if math.isfinite(acc) else None,
            "test_loss": loss if math.isfinite(loss) else None,
        }

    return evaluate, local.get_arrays(head)


def serve(grid: Grid, s: FederatedSettings, stop: ServerStop | None = None) -> None:
    """Run (or resume) the federation described by ``s`` into the folder ``s.out``; ``stop``: the
    switch by which the caller may end the run (see the module doc)."""
    run_dir = Path(s.out)
    stop = stop or ServerStop()
    lock = RunLock(run_dir).acquire()  # a refused lock leaves the other run's folder untouched
    try:
        _serve(grid, s, run_dir, stop)
    except VeilError as exc:
        stop.check()  # a refusal the stop caused (no silo answered) is not the run's error
        atomic_write_text(run_dir / ERROR, str(exc) + "\n")
        raise
    finally:
        lock.release()


def _serve(grid: Grid, s: FederatedSettings, run_dir: Path, stop: ServerStop) -> None:
    run = _Run(s, run_dir, stop)
    evaluate, initial = _evaluator(s)
    nodes = wait_for_nodes(grid, s, stop)
    header: dict[str, Any] = {"mode": s.mode, "settings": s.to_run_config()}
    if s.budget_run_id:  # the budget registry's record of this run (veil.federated.charge)
        header |= {"budget_run_id": s.budget_run_id, "budget_dataset_id": s.budget_dataset_id}
    if s.mode == "client-level":
        header["step_event"] = round_event(s.sampling_rate, s.sigma).to_dict()
    else:
        if (run_dir / SILOS).exists():
            run.silos = json.loads((run_dir / SILOS).read_text())
        else:
            run.silos = _register_silos(grid, nodes, s)
            stop.check()  # the answers of a stopped run are not the silos'
            atomic_write_text(run_dir / SILOS, json.dumps(run.silos, indent=1))
        worst = max(run.silos.values(), key=lambda v: v["sampling_rate"] / v["noise_multiplier"])
        header["step_event"] = SelfComposed(
            round_event(worst["sampling_rate"], worst["noise_multiplier"]), s.local_steps
        ).to_dict()
    ledger = run.open_ledger(header)
    try:
        done = run.rounds_charged()
        saved = _load_checkpoint(run_dir / CHECKPOINT)
        arrays = saved[0] if saved else initial
        if saved is None:
            run.after_round(0, arrays, {**evaluate(arrays), "replied": 0, "failed": 0})
        remaining = s.rounds - done
        if remaining > 0:
            state = saved[2] if saved and saved[2] else None
            arrays = _rounds(grid, s, run, nodes, arrays, done, remaining, evaluate, state)
        _save_npz(run_dir / MODEL, arrays)
        if ledger.last("end") is None:
            ledger.append("end", rounds=run.rounds_charged())
    finally:
        ledger.close()


def _rounds(
    grid: Grid,
    s: FederatedSettings,
    run: _Run,
    nodes: list[int],
    arrays: list[np.ndarray],
    done: int,
    remaining: int,
    evaluate: Any,
    optimizer_state: dict[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    sampling, noise = _sources(s, done)
    strategy: Any
    if s.mode == "client-level":
        from veil.federated.strategy import PoissonDPFedAvg

        strategy = PoissonDPFedAvg(
            sampling_rate=s.sampling_rate,
            clip=s.clip,
            noise_multiplier=s.sigma,
            expected_clients=s.expected_clients,
            server_lr=s.server_lr,
            sampling_source=sampling,
            noise_source=noise,
            charge=run.charge_clients,
            round_offset=done,
            server_optimizer=cast(Any, s.server_optimizer),
            server_momentum=s.server_momentum,
            optimizer_state=optimizer_state,
        )
    else:
        from veil.federated.strategy import SiloFedAvg

        strategy = SiloFedAvg(silos=nodes, charge=run.charge_silos, round_offset=done)

    latest = [arrays]

    def after(server_round: int, record: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None
        run.stop.check()  # a round the stop cut short is not saved
        r = server_round + done
        current = record.to_numpy_ndarrays()
        latest[0] = current
        extra: dict[str, Any] = {"failed": strategy.failures.get(r, 0)}
        if s.mode == "client-level":
            extra["replied"] = strategy.participants.get(r, 0)
        else:
            extra["silos"] = strategy.replies.get(r, [])
            extra["replied"] = len(extra["silos"])
        state = getattr(strategy, "optimizer_state", None)
        run.after_round(r, current, {**evaluate(current), **extra}, state)
        return None

    strategy.start(grid, ArrayRecord(arrays), num_rounds=remaining, timeout=s.node_timeout, evaluate_fn=after)
    return latest[0]
