"""An in-process Flower ``Grid`` for fast tests of the strategies: calls the ClientApp directly.

Only for tests (the runs veil makes go through Flower's simulation engine or real SuperNodes). A
ClientApp exception becomes an error reply, as Flower's runtimes turn it into one.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from veil.federated.settings import FederatedSettings


class InProcessGrid(Grid):
    def __init__(self, client_app: ClientApp, partitions: int, first_node: int = 101) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
            1,
            0,
            1,
        )  # as a ServerApp process sets
        self.client_app = client_app
        self.contexts = {
            first_node + k: Context(
                run_id=1,
                node_id=first_node + k,
                node_config={"partition-id": k},
                state=RecordDict(),
                run_config={},
            )
            for k in range(partitions)
        }
        self.sent: list[list[int]] = []

    def set_run(self, run: object) -> None:  # pragma: no cover - unused
        pass

    @property
    def run(self) -> object:  # pragma: no cover - unused
        return None

    def create_message(self, *args: object, **kwargs: object) -> Message:  # pragma: no cover - unused
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        messages = list(messages)
        self.sent.append([m.metadata.dst_node_id for m in messages])
        for m in messages:
            m.metadata.__dict__["_src_node_id"] = 0
            context = self.contexts[m.metadata.dst_node_id]
            try:
                replies.append(self.client_app(m, context))
            except Exception as exc:
                replies.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=m))
        return replies


def in_process_engine(s: FederatedSettings, cpus: int = 2) -> None:
    """In place of ``veil.federated.run.run_simulation_engine``: the job's ServerApp and ClientApp code
    on an :class:`InProcessGrid` (no Ray start-up)."""
    from veil.federated.apps import make_client_app
    from veil.federated.server import serve

    serve(InProcessGrid(make_client_app(s), s.clients), s)
