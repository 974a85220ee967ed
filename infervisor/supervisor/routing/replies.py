"""The one final reply every request gets, counted once where it belongs (its model's queue, or refused).

An accepted request's reply comes here through the streams' stage (streams.py: `Streams.finish`), which commits
a stream step's state first; these replies know nothing of streams.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import zmq

from infervisor.protocol.client_messages import RequestId, encode_error
from infervisor.protocol.constants import ErrorCode
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.routing.client_ledger import ClientLedger
from infervisor.supervisor.routing.connections import Connection, Connections
from infervisor.supervisor.routing.model_queue import ModelQueue
from infervisor.supervisor.routing.pending import Peer, PendingRequest
from infervisor.supervisor.settings.serving_config import ServingConfig


class Replies:
    """Sends final replies through the client ledger and counts them in their model's queue (or as refused)."""

    def __init__(
        self,
        ledger: ClientLedger,
        queues: dict[str, ModelQueue],
        refused: collections.Counter[str],
        connections: Connections,
    ) -> None:
        self.ledger = ledger
        self.connections = connections
        self.queues = queues
        self.refused = refused

    def error(self, client: Peer, request_id: RequestId | None, code: ErrorCode, message: str) -> None:
        """Send an error reply to a client connection (counted by the caller)."""
        self.ledger.send(client, [encode_error(request_id, code, message)])

    def refuse(self, client: Peer, request_id: RequestId | None, model: str | None, code: ErrorCode, why: str) -> None:
        """Answer a request at admission: counted in its model's errors when it named a served one, else as refused."""
        queue = self.queues.get(model) if model is not None else None
        if queue is not None:
            queue.errors[code.value] += 1
        else:
            self.refused[code.value] += 1
        self.error(client, request_id, code, why)

    def connection_of(self, client: Peer, frame: Any) -> Connection:
        """The connection a message just received came in on, after the disconnects known now."""
        self.forget_departed()
        return self.connections.stamp(client, frame)

    def forget_departed(self) -> None:
        """Read the disconnects libzmq reported: the replies waiting for those connections go nowhere."""
        for peer in self.connections.read():
            self.ledger.drop_outbox(peer)

    def finish(self, request: PendingRequest, code: ErrorCode | None, header: Any, frames: list[Any]) -> None:
        """Send the one final reply of an accepted request, give back its budget, and count it."""
        queue = self.queues.get(request.model)  # None once a reload removed the model
        if queue is not None and code is None:
            queue.times.request_done(request.accepted_at, request.dispatched_at, time.monotonic())
        elif queue is not None and code is not None:
            queue.errors[code.value] += 1
        self.ledger.give_back(request.client, request.cost)
        self.forget_departed()
        if request.connection is not None and self.connections.is_gone(request.connection):
            # Its routing id may name another client now (another local user): the reply goes nowhere.
            self.ledger.anomalies.count("reply_undeliverable", "the client disconnected before its reply")
        else:
            self.ledger.send(request.client, [header, *frames])

    def flush(self) -> None:
        """Send replies that waited for room at their clients."""
        if self.ledger.waiting:
            self.forget_departed()
            self.ledger.flush()


def client_replies(sockets: list[zmq.Socket[Any]], serving: ServingConfig, anomalies: Anomalies) -> Replies:
    """The replies of the daemon's client sockets: a ledger within the configured budgets, no model's queue yet."""
    current = serving.current
    ledger = ClientLedger(anomalies, current.client_budget_mb * 2**20, current.clients_budget_mb * 2**20)
    return Replies(ledger, {}, collections.Counter(), Connections(sockets))
