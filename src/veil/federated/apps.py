"""Flower's ClientApp and ServerApp for veil (``flwr run`` loads ``client_app`` and ``server_app``).

Both read the run's :class:`~veil.federated.settings.FederatedSettings` from Flower's run config, or
take them directly (:func:`make_client_app` / :func:`make_server_app`, for the simulation engine).
A client knows which rows it holds from its node config: ``partition-id`` (set by the simulation
engine, or ``flower-supernode --node-config "partition-id=K"``).

Record-level silos keep their own privacy state in the node's ``context.state``: the σ they
calibrated for their planned steps (target ε over ``rounds × local_steps`` DP-SGD steps at their
q = B/n) and the steps taken so far; each reply reports the silo's ε from its own accountant.
"""

from __future__ import annotations

from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from veil.federated.settings import FederatedSettings
from veil.federated.stop import ServerStop

__all__ = ["client_app", "make_client_app", "make_server_app", "server_app"]

_STATE = "veil-silo"


def _settings(given: FederatedSettings | None, context: Context) -> FederatedSettings:
    return given if given is not None else FederatedSettings.from_run_config(dict(context.run_config))


def _partition_id(context: Context) -> int:
    value = context.node_config.get("partition-id")
    if value is None:
        raise RuntimeError("this SuperNode has no partition-id: start it with --node-config 'partition-id=K'")
    return int(cast(Any, value))


def _silo_plan(s: FederatedSettings, context: Context, n: int) -> ConfigRecord:
    """The silo's (q, σ, steps so far), calibrated once and kept in the node's state."""
    if _STATE not in context.state.config_records:
        from veil.federated.charge import silo_plan

        q, sigma = silo_plan(s, n)  # the job charged the budget registry with the same numbers
        context.state.config_records[_STATE] = ConfigRecord({"q": q, "sigma": float(sigma), "steps": 0})
    return context.state.config_records[_STATE]


def _local_seed(seed: int, server_round: int, pid: int) -> int:
    from veil.pipeline.seeds import Purpose, derive_seed

    return derive_seed(seed, Purpose.FEDERATED_LOCAL, server_round * 1_000_003 + pid + 1)


def make_client_app(settings: FederatedSettings | None = None) -> ClientApp:
    """The ClientApp: ``query`` registers a silo (record level), ``train`` runs one round locally."""
    app = ClientApp()

    @app.query()
    def register(msg: Message, context: Context) -> Message:
        from veil.federated.local import federation

        s = _settings(settings, context)
        pid = _partition_id(context)
        fed = federation(s)
        n = fed.records(pid)  # what DP-SGD samples: rows, or units with a privacy unit
        plan = _silo_plan(s, context, n)
        metrics = {
            "partition-id": pid,
            "num-examples": n,
            "sampling-rate": plan["q"],
            "noise-multiplier": plan["sigma"],
        }
        if fed.units is not None:  # n counts units; the silo's row count is not public, never sent
            metrics["units"] = n
        return Message(RecordDict({"silo": MetricRecord(cast(Any, metrics))}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        import torch

        from veil.federated import local

        torch.set_num_threads(1)
        s = _settings(settings, context)
        pid = _partition_id(context)
        server_round = int(cast(Any, msg.content["config"])["server-round"])
        if pid == s.fail_client and server_round == s.fail_round:
            raise RuntimeError(f"injected fault: client {pid} fails in round {server_round}")
        fed = local.federation(s)
        front, head = local.build_network(s, fed.data)
        local.set_arrays(head, cast(Any, msg.content["arrays"]).to_numpy_ndarrays())
        x, y = local.partition_features(s, pid, front)
        seed = None if s.secure else _local_seed(s.seed, server_round, pid)
        if s.mode == "client-level":
            local.local_sgd(head, x, y, s, seed)
            metrics: dict[str, int | float] = {"num-examples": 1}
        else:
            from veil.accounting.calibrate import dpsgd_epsilon

            plan = cast(Any, _silo_plan(s, context, fed.records(pid)))
            units = local.silo_units(s, pid)
            taken = local.local_dpsgd(head, x, y, s, float(plan["sigma"]), seed, units)
            plan["steps"] = int(plan["steps"]) + taken
            eps = dpsgd_epsilon(
                float(plan["q"]), float(plan["sigma"]), int(plan["steps"]), s.delta, s.accountant
            )
            metrics = {
                # FedAvg's weight: the silo's records (rows, or units with a privacy unit: public by
                # declaration as its q's n; its row count is not, it depends on each person's rows).
                "num-examples": fed.records(pid),
                "partition-id": pid,
                "epsilon": eps,
                "steps": int(plan["steps"]),
            }
        reply = RecordDict(
            {"arrays": ArrayRecord(local.get_arrays(head)), "metrics": MetricRecord(cast(Any, metrics))}
        )
        return Message(reply, reply_to=msg)

    return app


def make_server_app(settings: FederatedSettings | None = None, stop: ServerStop | None = None) -> ServerApp:
    """The ServerApp: :func:`veil.federated.server.serve` with the run's settings. ``stop``: the
    switch by which an in-process caller (the simulation engine) ends it (:mod:`veil.federated.stop`)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from veil.federated.server import serve

        if stop is None:
            serve(grid, _settings(settings, context))
            return
        with stop.serving(grid):
            serve(grid, _settings(settings, context), stop)

    return app


client_app = make_client_app()
server_app = make_server_app()
