"""A stateful model's stream bounds: how many streams the daemon keeps for it, how much state, and for how long.

Each open stream holds its state in the supervisor (supervisor/routing/streams.py) until it ends, its client's
idle time passes `stream_idle_s`, or its model's state pairs change; these keys bound that memory per model.
"""

from __future__ import annotations

from infervisor.supervisor.settings.config_keys import Applied, Integer, Key, Number

#: A model's open streams by default: a box's worth of microphones and cameras, well under its memory.
DEFAULT_MAX_STREAMS = 1024
#: State all of a model's streams hold together by default (64 MiB: 1024 streams of a 2×128 float32 GRU use 1 MiB).
DEFAULT_MAX_STATE_BYTES = 64 * 2**20
#: An open stream without a step for this long is dropped (its client went away without an end).
DEFAULT_STREAM_IDLE_S = 60.0

# fmt: off
#: Read after `state`, in this order (docs/configuration.md, "Stateful models").
STREAM_KEYS: tuple[Key, ...] = (
    Key("max_streams", Integer(DEFAULT_MAX_STREAMS, 1, 1_000_000), Applied.LIVE,
        "streams of this stateful model open at once, over all clients; one more start is answered "
        "`TOO_MANY_STREAMS` ([more](#stateful-models))."),
    Key("max_streams_per_peer", Integer(None, 1, 1_000_000), Applied.LIVE,
        "streams of this model one peer may hold open (a uid on ipc, a CURVE key on tcp, else a connection), "
        "and the same share of `max_state_bytes`; null: half of `max_streams` (at least 1), so one peer cannot take "
        "them all. One more start from that peer is answered `TOO_MANY_STREAMS` ([more](#stateful-models))."),
    Key("max_state_bytes", Integer(DEFAULT_MAX_STATE_BYTES, 1), Applied.LIVE,
        "bytes of state all open streams of this model hold in the supervisor; a start past it is answered "
        "`TOO_MANY_STREAMS`."),
    Key("stream_idle_s", Number(DEFAULT_STREAM_IDLE_S, 0.1), Applied.LIVE,
        "an open stream with no step for this long is dropped and its state freed; its next step is answered "
        "`UNKNOWN_STREAM` (expired)."),
)
# fmt: on


def peer_share(max_streams: int, max_streams_per_peer: int | None) -> int:
    """Streams one peer may hold open: its configured share, else half of the model's (at least 1), never more."""
    share = max_streams_per_peer if max_streams_per_peer is not None else max(1, max_streams // 2)
    return min(share, max_streams)
