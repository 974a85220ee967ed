"""What each client connection holds of the broker's memory, and replies it has not taken yet.

A client that sends requests but never reads its replies must not grow the daemon without limit.
ZeroMQ keeps at most `PEER_SNDHWM` replies per connection in its own pipe; what does not fit waits
here, in an outbox whose bytes are counted. A client's requests in hand (their frames, and the
shared-memory bytes they declare, which a worker will copy) and its undelivered replies together
stay within its budget: past it, the broker refuses the client's next request at admission.
"""

from __future__ import annotations

import collections
import errno
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from infervisor.protocol.sockets import NOBLOCK, send_frames
from infervisor.supervisor.instruments.anomalies import Anomalies
from infervisor.supervisor.routing.pending import Peer

#: Replies ZeroMQ may queue per connection before a send says EAGAIN and the reply waits in the outbox.
PEER_SNDHWM = 64
#: An outbox past this many budgets drops further replies (counted): that client reads nothing at all.
_OUTBOX_LIMIT_BUDGETS = 2


@dataclass
class ClientAccount:
    """One connection's requests in hand and replies waiting for room."""

    in_hand: int = 0
    outbox: collections.deque[list[Any]] = field(default_factory=collections.deque)
    outbox_bytes: int = 0

    @property
    def held(self) -> int:
        """Bytes this client holds of the daemon now."""
        return self.in_hand + self.outbox_bytes


def frames_bytes(frames: Sequence[Any]) -> int:
    """Bytes of a message's frames."""
    return sum(len(frame) for frame in frames)


class ClientLedger:
    """Accounts and outboxes of the clients that hold something; an idle client costs nothing here."""

    def __init__(self, anomalies: Anomalies, budget_bytes: int, total_budget_bytes: int | None = None) -> None:
        self.anomalies = anomalies
        self.budget_bytes = budget_bytes
        #: What all clients together may hold (config `clients_budget_mb`); None: no cap over the per-client one.
        self.total_budget_bytes = total_budget_bytes
        #: Bytes all clients hold now: requests in hand and replies in outboxes.
        self.total_held = 0
        self.accounts: dict[Peer, ClientAccount] = {}
        #: Clients whose outbox is not empty: tried again every housekeeping turn.
        self.waiting: set[Peer] = set()

    def over_budget(self, client: Peer, cost: int) -> str | None:
        """Why a request of `cost` bytes from `client` is refused, or None when it fits its budget."""
        account = self.accounts.get(client)
        held = account.held if account is not None else 0
        # Any connection may send one request while nothing at all is held (a lone request is bounded by
        # max_frame_bytes); past that, fresh connections get no exemption: opening more buys nothing.
        total = self.total_budget_bytes
        if total is not None and self.total_held and self.total_held + cost > total:
            return (
                f"all clients together hold {self.total_held} bytes of the daemon; with this request ({cost} bytes) "
                f"they would pass their budget of {self.total_budget_bytes} (clients_budget_mb): send fewer at once"
            )
        if held + cost <= self.budget_bytes or held == 0:  # one request alone is bounded by max_frame_bytes
            return None
        waiting = f", {account.outbox_bytes} of them in replies it has not read" if account and account.outbox else ""
        return (
            f"this client holds {held} bytes of the daemon{waiting}; with this request ({cost} bytes) it would "
            f"pass its budget of {self.budget_bytes} (client_budget_mb): read the replies, or send fewer at once"
        )

    def take(self, client: Peer, cost: int) -> None:
        """An admitted request's bytes are held until its reply is sent."""
        self.accounts.setdefault(client, ClientAccount()).in_hand += cost
        self.total_held += cost

    def give_back(self, client: Peer, cost: int) -> None:
        """A request was answered: its bytes are no longer held."""
        account = self.accounts.get(client)
        if account is not None:
            account.in_hand -= cost
            self.total_held -= cost
            self.forget_idle(client, account)

    def send(self, client: Peer, frames: list[Any]) -> None:
        """Deliver one reply now, or keep it for when the connection has room (behind what already waits)."""
        account = self.accounts.get(client)
        if account is not None and account.outbox:
            self.keep(client, account, frames)
            return
        outcome = self.try_send(client, frames)
        if outcome == errno.EAGAIN:
            self.keep(client, account or self.accounts.setdefault(client, ClientAccount()), frames)

    def try_send(self, client: Peer, frames: list[Any]) -> int:
        """0 when sent; EAGAIN when the connection's pipe is full; EHOSTUNREACH when the client is gone."""
        socket, identity = client
        try:
            send_frames(socket, [identity, b"", *frames], NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                raise
            if exc.errno == errno.EHOSTUNREACH:
                self.anomalies.count("reply_undeliverable", "the client disconnected before its reply")
            return int(exc.errno)
        return 0

    def keep(self, client: Peer, account: ClientAccount, frames: list[Any]) -> None:
        """Queue a reply in the client's outbox; past twice its budget, drop it (counted): the client reads nothing."""
        size = frames_bytes(frames)
        if account.outbox_bytes + size > _OUTBOX_LIMIT_BUDGETS * self.budget_bytes:
            self.anomalies.count("reply_dropped_unread", "a client left more than twice its budget of replies unread")
            return
        account.outbox.append(frames)
        account.outbox_bytes += size
        self.total_held += size
        self.waiting.add(client)

    def flush(self) -> None:
        """Send what waits in outboxes while the connections take it; forget clients that have gone."""
        for client in list(self.waiting):
            account = self.accounts[client]
            while account.outbox:
                outcome = self.try_send(client, account.outbox[0])
                if outcome == errno.EAGAIN:
                    break
                sent = frames_bytes(account.outbox.popleft())
                account.outbox_bytes -= sent
                self.total_held -= sent
                if outcome == errno.EHOSTUNREACH:  # gone: nothing more it is owed can reach it
                    account.outbox.clear()
                    self.total_held -= account.outbox_bytes
                    account.outbox_bytes = 0
            if not account.outbox:
                self.waiting.discard(client)
                self.forget_idle(client, account)

    def drop_outbox(self, client: Peer) -> None:
        """The client's connection ended: the replies waiting for it are undeliverable (its routing id may be
        another client's next)."""
        account = self.accounts.get(client)
        if account is None or not account.outbox:
            return
        for _ in account.outbox:
            self.anomalies.count("reply_undeliverable", "the client disconnected before its reply")
        account.outbox.clear()
        self.total_held -= account.outbox_bytes
        account.outbox_bytes = 0
        self.waiting.discard(client)
        self.forget_idle(client, account)

    def forget_idle(self, client: Peer, account: ClientAccount) -> None:
        """Drop the account of a client that holds nothing."""
        if account.in_hand <= 0 and not account.outbox:
            self.accounts.pop(client, None)

    @property
    def outbox_bytes(self) -> int:
        """Bytes of replies waiting for their clients, all clients together."""
        return sum(a.outbox_bytes for a in self.accounts.values())
