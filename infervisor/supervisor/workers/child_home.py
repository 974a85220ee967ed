"""The one home of the daemon's child processes: how each is started (forked from the warm template, else exec of a
fresh interpreter), which ones are ours, and the reaping of what the supervisor adopts as a child subreaper.

Every kind of child (serving worker, background builder, audit process) is started here by `launcher.py`. While
`infervisor serve` runs, the supervisor is a child subreaper and keeps one warm template
(infervisor/worker/template.py) that imported torch and ran nothing; a child is a fork of it, re-parented to the
supervisor, so it is our child like an exec'd one: the same `poll`/`kill`/`wait`, its end noticed by the daemon's
one reaper (reaper.py), which also calls `reap_strangers`. A template
that died, hangs or is stale (torch or this package changed on disk, the environment changed) is replaced; until
one is warm, and wherever none is wanted (`warm_template: false`, `infervisor build`), children are exec'd as
before, and status says which and why.
"""

from __future__ import annotations

import ctypes
import enum
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import structlog

from infervisor.protocol import template_link as tl
from infervisor.supervisor.workers.retry_policy import ChildKind, retry_in

log = structlog.get_logger("supervisor")

TEMPLATE_ENTRY = "infervisor.worker.template"
_PR_SET_CHILD_SUBREAPER = 36
#: A fork of the template takes milliseconds; a template that does not answer within this is hung.
_FORK_ANSWER_S = 5.0
#: How long `open` waits for the first template's imports, so the first workers share them (an exec'd worker
#: would spend the same time importing).
_FIRST_READY_S = 60.0
#: What every child's environment holds unless the daemon's says otherwise: third-party progress bars (NNCF's)
#: would land between the daemon's JSON log lines.
CHILD_ENV_DEFAULTS = {"TQDM_DISABLE": "1"}
#: The environment variables each child sets for itself; a change of any other one makes the template stale.
_PER_CHILD_ENV = frozenset({"OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR"})
#: Thread pools that start when their library loads (OpenBLAS, under numpy) would make the template's fork copy a
#: process with threads; one thread each keeps it single-threaded. A child sizes torch's pools itself.
_TEMPLATE_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class ChildProcess(Protocol):
    """What an owner needs of a child process (a subprocess.Popen, or a child forked from the template)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedProcess:
    """A child forked from the template and adopted by the supervisor: reaped with waitpid like a Popen's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has ended (negative: the signal that ended it), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Someone else reaped it (never us twice): it is gone, how is unknown.
                log.error("child_reaped_elsewhere", pid=self.pid)
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL, unless it was already reaped (its pid may belong to another process since)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, waiting at most `timeout` seconds (subprocess.TimeoutExpired after)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return code


class TemplateState(enum.Enum):
    """Where the warm template stands."""

    #: Not wanted: every child is exec'd.
    OFF = "off"
    #: Started, importing; children are exec'd until it says READY.
    STARTING = "starting"
    #: Forking children.
    WARM = "warm"
    #: Gone or refused; started again after a delay, children exec'd meanwhile.
    DOWN = "down"


@dataclass
class Template:
    """One template process: its Popen, the supervisor's end of its link, and what it was started from."""

    process: subprocess.Popen[bytes]
    link: socket.socket
    #: The folders of torch and of this package it imported from (it says which in READY), and their files then.
    roots: tuple[str, ...]
    fingerprint: tuple[object, ...]
    #: The environment its imports saw, but what each child sets for itself.
    env: dict[str, str]


class ChildHome:
    """Starts every child process, knows which are ours, keeps the warm template, reaps adopted strangers."""

    def __init__(self) -> None:
        self.state = TemplateState.OFF
        self.why = "not started (children are exec'd)"
        self.template: Template | None = None
        self.restart_at = 0.0
        #: Deaths and failed starts since the last READY: each waits longer before the next (retry_policy.py).
        self.downs_in_row = 0
        self.forked = 0
        self.execed = 0
        self.templates_started = 0
        self.strangers_reaped = 0
        #: The children handed out and not yet collected, by pid: a zombie child not in here is a stranger.
        self.children: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    # ---- the template ------------------------------------------------------------------------

    def open(self, wanted: bool) -> None:
        """Become a child subreaper and start the template (waiting for its imports), when `wanted`."""
        if not wanted:
            self.state, self.why = TemplateState.OFF, "warm_template is false: children are exec'd"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            self.state = TemplateState.OFF
            self.why = f"prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()}): children are exec'd"
            log.warning("warm_template_off", reason=self.why)
            return
        self.start_template()
        self.await_ready(_FIRST_READY_S)

    def start_template(self) -> None:
        """Start a template process; it says READY once its imports are done."""
        ours, theirs = tl.template_socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-P", "-m", TEMPLATE_ENTRY, str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(theirs.fileno(),),
                env=template_environment(),
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            self.down(f"the template could not start: {exc}")
            return
        finally:
            theirs.close()
        self.template = Template(process, ours, (), (), _shared_env(template_environment()))
        self.children[process.pid] = process
        self.templates_started += 1
        self.state, self.why = TemplateState.STARTING, f"pid {process.pid} importing torch"
        log.info("warm_template_starting", pid=process.pid)

    def await_ready(self, timeout: float) -> None:
        """Take the template's READY (or its refusal) if it comes within `timeout` seconds."""
        template = self.template
        if template is None or self.state is not TemplateState.STARTING:
            return
        readable, _, _ = select.select([template.link], [], [], timeout)
        if not readable:
            return
        try:
            message, fds = tl.receive_message(template.link)
        except (tl.TemplateLinkError, OSError) as exc:
            self.down(f"the template ended while importing ({exc}; exit {template.process.poll()})")
            return
        for fd in fds:
            os.close(fd)
        roots = message.get("roots")
        if message["kind"] == tl.READY and isinstance(roots, list) and all(isinstance(r, str) for r in roots):
            template.roots = tuple(roots)
            template.fingerprint = fingerprint(template.roots)
            self.state, self.why = TemplateState.WARM, f"pid {template.process.pid}: children are forked from it"
            self.downs_in_row = 0
            log.info("warm_template_ready", pid=template.process.pid)
        else:
            self.down(f"the template refused: {message.get('why', message)}")

    def down(self, why: str) -> None:
        """The template is unusable: end it, exec children meanwhile, start another after a delay."""
        self.end_template()
        self.downs_in_row += 1
        wait = retry_in(ChildKind.TEMPLATE, self.downs_in_row)
        self.state, self.why = TemplateState.DOWN, f"{why}; children are exec'd until another is warm"
        self.restart_at = time.monotonic() + wait
        log.warning("warm_template_down", reason=why, restart_in_s=wait)

    def end_template(self) -> None:
        """Close the template's link (it exits at EOF) and make sure it is gone."""
        template, self.template = self.template, None
        if template is None:
            return
        template.link.close()
        if template.process.poll() is None:
            template.process.kill()
        template.process.wait()

    def tick(self, now: float) -> None:
        """Housekeeping: notice a dead template, start one when due, take a READY (the adopted strangers are reaped by
        the daemon's one reaper, workers/reaper.py)."""
        template = self.template
        if template is not None and template.process.poll() is not None:
            self.down(f"the template exited ({describe(template.process.returncode)})")
        if self.state is TemplateState.DOWN and now >= self.restart_at:
            self.start_template()
        self.await_ready(0)

    def close(self) -> None:
        """At the daemon's stop: the template goes; children are exec'd from here on."""
        self.end_template()
        if self.state is not TemplateState.OFF:
            self.state, self.why = TemplateState.OFF, "the daemon is stopping"

    def status(self) -> dict[str, object]:
        """What `infervisor status` shows under `template`."""
        template = self.template
        return {
            "state": self.state.value,
            "pid": template.process.pid if template is not None else None,
            "why": self.why,
            "forked": self.forked,
            "execed": self.execed,
            "started": self.templates_started,
        }

    # ---- children -----------------------------------------------------------------------------

    def start(
        self, entry: str, spec: str, env: Mapping[str, str], link_fd: int, output: IO[bytes] | None, name: str
    ) -> ChildProcess:
        """Start `python -P -m ENTRY SPEC` (the child `name`) with `env` and the inherited `link_fd`: forked from
        the warm template when there is one, else exec'd. OSError when the box cannot start a process now."""
        forked = self.fork(entry, spec, env, link_fd, output, f"{sys.executable} -P -m {entry} {name}")
        if forked is not None:
            self.forked += 1
            self.children[forked.pid] = forked
            log.info("child_started", child=name, pid=forked.pid, entry=entry, start="forked")
            return forked
        process = subprocess.Popen(
            # -P: nothing from the working directory (a `common.py` there) may shadow or run in a child.
            [sys.executable, "-P", "-m", entry, spec],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            close_fds=True,
            pass_fds=(link_fd,),
            env=dict(env),
            # Its own session: a Ctrl-C or a group-wide SIGTERM reaches the supervisor, which then
            # drains and stops children in order instead of losing them mid-request.
            start_new_session=True,
        )
        self.execed += 1
        self.children[process.pid] = process
        # Without a daemon (`infervisor build`) every child is exec'd: not news on the command's console.
        say = log.debug if self.state is TemplateState.OFF else log.info
        say("child_started", child=name, pid=process.pid, entry=entry, start="exec", template=self.state.value)
        return process

    def exec_fresh(self, argv: Sequence[str], name: str) -> subprocess.Popen[bytes]:
        """Start a child that must not carry torch (the OIP gateway) as a fresh interpreter, known as ours."""
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            close_fds=True,
            # Its own session, as a worker's: a terminal's Ctrl-C reaches the daemon, which stops it in order.
            start_new_session=True,
        )
        self.execed += 1
        self.children[process.pid] = process
        log.info("child_started", child=name, pid=process.pid, entry=argv[-2] if len(argv) > 1 else argv[0],
                 start="exec")  # fmt: skip
        return process

    def fork(
        self, entry: str, spec: str, env: Mapping[str, str], link_fd: int, output: IO[bytes] | None, title: str
    ) -> ForkedProcess | None:
        """A child forked from the warm template, or None when there is none to fork from now."""
        self.tick(time.monotonic())
        template = self.template
        if template is None or self.state is not TemplateState.WARM:
            return None
        if fingerprint(template.roots) != template.fingerprint or _shared_env(template_environment()) != template.env:
            self.end_template()
            self.start_template()
            self.why = "replaced: torch, this package or the environment changed since the last one started"
            return None
        if _shared_env(env) != template.env:
            # A child that asks for variables the template's imports did not see gets a fresh interpreter.
            log.info("warm_template_skipped", entry=entry, reason="the child's environment differs from the template's")
            return None
        fds = [link_fd] if output is None else [link_fd, output.fileno()]
        request = {"kind": tl.FORK, "entry": entry, "spec": spec, "env": dict(env), "title": title}
        try:
            tl.send_message(template.link, request, fds)
            readable, _, _ = select.select([template.link], [], [], _FORK_ANSWER_S)
            if not readable:
                raise tl.TemplateLinkError(f"no answer to a fork within {_FORK_ANSWER_S:.0f} s")
            answer, extra = tl.receive_message(template.link)
        except (tl.TemplateLinkError, OSError) as exc:
            self.down(f"the template failed a fork: {exc}")
            return None
        for fd in extra:
            os.close(fd)
        if answer["kind"] != tl.FORKED or not isinstance(answer.get("pid"), int):
            log.warning("warm_template_fork_refused", reason=answer.get("why", answer), entry=entry)
            return None
        return ForkedProcess(answer["pid"])

    def is_ours(self, pid: int) -> bool:
        """A child an owner holds and has not collected yet."""
        process = self.children.get(pid)
        return process is not None and getattr(process, "returncode", None) is None

    def reap_strangers(self) -> list[int]:
        """Reap the ended children nobody holds: what the supervisor adopted as a subreaper (a crashed worker's
        compiler, killed with it) would otherwise stay a zombie for the daemon's life."""
        reaped = []
        for pid in own_children():
            if not self.is_ours(pid) and is_zombie(pid):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                reaped.append(pid)
        self.strangers_reaped += len(reaped)
        return reaped


def own_children() -> list[int]:
    """The pids whose parent is this process, from every thread's /proc children list."""
    pids: list[int] = []
    tasks = Path("/proc/self/task")
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return pids
    for thread in threads:
        try:
            pids.extend(int(pid) for pid in (thread / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def is_zombie(pid: int) -> bool:
    """Whether `pid` has ended and waits to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :].startswith("Z")


def fingerprint(roots: tuple[str, ...]) -> tuple[object, ...]:
    """What a template imported, as it stands on disk now: the sizes and times of the Python files of the packages
    it imported (torch's top files, every file of ours), so an upgrade or an edit makes it stale."""
    marks: list[object] = []
    for folder in roots:
        root = Path(folder)
        if (root / "version.py").exists() and root.name == "torch":
            files = [root / "__init__.py", root / "version.py"]
        else:
            files = sorted(root.rglob("*.py"))
        marks.extend(_mark(path) for path in files)
    return tuple(marks)


def _mark(path: Path) -> tuple[str, int, int]:
    """A file's path, size and modification time (0, 0 when it is gone)."""
    try:
        stat = path.stat()
    except OSError:
        return (str(path), 0, 0)
    return (str(path), stat.st_size, stat.st_mtime_ns)


def template_environment() -> dict[str, str]:
    """The supervisor's environment with every thread pool that starts at import held to one thread, and what every
    child gets (launcher.worker_environment)."""
    env = {**os.environ, **_TEMPLATE_THREADS}
    env.setdefault("TQDM_DISABLE", CHILD_ENV_DEFAULTS["TQDM_DISABLE"])
    return env


def _shared_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment but what each child sets for itself: what the template's imports may have read."""
    return {key: value for key, value in env.items() if key not in _PER_CHILD_ENV}


def describe(code: int | None) -> str:
    """An exit code in words."""
    if code is None:
        return "running"
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


#: The daemon's one home: `infervisor serve` opens its template; a tool that starts children without a daemon
#: (`infervisor build`) uses it closed, and every child is exec'd.
HOME = ChildHome()
