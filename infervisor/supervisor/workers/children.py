"""Where the supervisor keeps track of its children other than serving workers (background builders, audit and
shadow processes, the OIP gateway): one reaper notices their ends, one set of links reads them on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from infervisor.protocol.worker_link import Link
from infervisor.supervisor.workers.child_home import ChildProcess
from infervisor.supervisor.workers.child_links import ChildLinks
from infervisor.supervisor.workers.child_record import ChildRecord
from infervisor.supervisor.workers.reaper import Reaper
from infervisor.supervisor.workers.worker_inbox import ChildOwner


@dataclass
class Children:
    """The reaper and the links every owner of a child hands its new process to."""

    reaper: Reaper
    links: ChildLinks

    def adopt(
        self,
        record: ChildRecord,
        process: ChildProcess,
        link: Link | None,
        started: tuple[str, tuple[int, ...], float],
        owner: ChildOwner | None,
    ) -> None:
        """`record` holds `process` now (`started`: its id, its cores, when): its end is watched, and its link read
        on the loop, each message to `owner`."""
        worker_id, cores, now = started
        record.adopt(process, link, worker_id, cores, now)
        self.reaper.watch(process, lambda code, _now: record.reaped(process, code))
        if owner is not None:
            self.links.attach(record, owner)
