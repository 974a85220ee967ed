"""The warm template: `python -P -m infervisor.worker.template LINK_FD SUPERVISOR_PID`, one per daemon.

It imports torch and the worker's code once, runs no torch op, starts no thread and loads no model, freezes what it
imported out of the garbage collector's reach, and then only forks (once forks pause, it hands the kernel the library
pages its imports touched that no child maps): each child the supervisor asks for (a serving
worker, a builder, an audit process) is a copy of this process that runs its module's `__main__` exactly as
`python -P -m MODULE LAUNCH_JSON` would, sharing the imported pages instead of importing them again (gunicorn's
`--preload`, Python's forkserver). Each child is forked twice so that it is re-parented to the supervisor, a child
subreaper: the supervisor is its parent and reaper like any worker's, and the child dies with the supervisor, not
with this template. Everything a child does before its model (pinning, thread counts, priority, memory cap,
parent-death signal, strict modes) happens in the child, in the same code as after an exec.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any

from infervisor.protocol import template_link as tl
from infervisor.protocol.constants import WorkerExitCode
from infervisor.worker.memory import page_out_unshared_library_pages
from infervisor.worker.pinning import ParentGone, die_with_parent

#: How long a new child waits for the middle process's exit to hand it to the supervisor.
_REPARENT_WAIT_S = 5.0
#: Quiet after the last fork before the template pages out: by then each new child has mapped the library pages
#: its start reads, so the advice (which skips pages another process maps) leaves them alone.
_PAGE_OUT_AFTER_S = 20.0


def main(argv: list[str]) -> int:
    """Import what children share, say READY, then fork a child for each request until the link closes."""
    try:
        fd_text, pid_text = argv
        link_fd, supervisor_pid = int(fd_text), int(pid_text)
    except ValueError:
        print(
            f"template: usage: python -P -m infervisor.worker.template LINK_FD SUPERVISOR_PID, not {argv}",
            file=sys.stderr,
        )
        return WorkerExitCode.BAD_LAUNCH
    try:
        die_with_parent(supervisor_pid)
    except ParentGone:
        return WorkerExitCode.SUPERVISOR_LOST
    link = socket.socket(fileno=link_fd)
    warm_up()
    threads = threading.active_count(), len(os.listdir("/proc/self/task"))
    if threads != (1, 1):
        # A fork copies only the calling thread: a lock another thread held would stay locked in every child.
        tl.send_message(link, {"kind": tl.REFUSED, "why": f"the template runs {threads[1]} threads after its imports"})
        return 1
    tl.send_message(link, {"kind": tl.READY, "pid": os.getpid(), "roots": imported_roots()})
    return serve_forks(link, supervisor_pid)


def warm_up() -> None:
    """Import torch and every module a child runs, and move them out of the collector's generations.

    Not the compiler's modules (torch._dynamo, inductor, torch.export, torchao: ~90 MB): measured with them
    (bench/process_tree.py, default config), an int8 worker's PSS rose from 176 to 225 MB and the tree's from 613
    to 851 MB, since the children that use them write their objects' reference counts (copies) and the ones that
    do not (eager, the audit) carry a share of pages they never use.
    """
    import torch  # noqa: F401  (the point: imported once, shared by every child)

    # What the entry modules import, not the entry modules: runpy warns when it runs one already imported.
    import infervisor.common.json_logs  # noqa: F401
    import infervisor.worker.audit_loop  # noqa: F401
    import infervisor.worker.logs  # noqa: F401
    import infervisor.worker.process_entry  # noqa: F401
    import infervisor.worker.serve  # noqa: F401

    gc.collect()
    # Objects the collector never visits are never written by it, so their pages stay shared with the children.
    gc.freeze()


def imported_roots() -> list[str]:
    """The folders torch and this package were imported from: what makes this template stale when they change."""
    import torch

    import infervisor

    return [os.path.dirname(torch.__file__), os.path.dirname(infervisor.__file__)]


def serve_forks(link: socket.socket, supervisor_pid: int) -> int:
    """Answer FORK requests one at a time, paging out what only the template holds once forks pause; 0 when the
    supervisor closes the link."""
    page_out_at: float | None = time.monotonic() + _PAGE_OUT_AFTER_S
    while True:
        wait = None if page_out_at is None else max(0.0, page_out_at - time.monotonic())
        if not select.select([link], [], [], wait)[0]:
            page_out_unshared_library_pages()
            page_out_at = None
            continue
        page_out_at = time.monotonic() + _PAGE_OUT_AFTER_S
        try:
            message, fds = tl.receive_message(link)
        except tl.TemplateLinkError:
            return 0
        try:
            if message["kind"] != tl.FORK:
                reply: dict[str, Any] = {"kind": tl.REFUSED, "why": f"unknown request {message['kind']!r}"}
            else:
                reply = {"kind": tl.FORKED, "pid": fork_child(message, fds, link, supervisor_pid)}
        except (OSError, KeyError, TypeError, ValueError) as exc:
            reply = {"kind": tl.REFUSED, "why": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        tl.send_message(link, reply)


def fork_child(request: dict[str, Any], fds: list[int], link: socket.socket, supervisor_pid: int) -> int:
    """Fork twice: the middle process forks the child and exits at once, which hands the child to the supervisor
    (the nearest subreaper); returns the child's pid."""
    entry, spec, env = str(request["entry"]), str(request["spec"]), dict(request["env"])
    title = str(request.get("title", entry))
    if not fds:
        raise ValueError("a fork request without the child's link")
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        code = 0
        try:
            os.close(read_end)
            middle_pid = os.getpid()
            child = os.fork()
            if child == 0:
                os.close(write_end)
                # The leader of a session and process group of its own, as an exec'd child is: a Ctrl-C or a group
                # SIGTERM reaches the supervisor, which stops children in order, and the supervisor ends what the
                # child started (a compiler) by killing its group (supervisor/workers/process_tree.py).
                os.setsid()
                run_child(entry, spec, env, title, fds, link, (supervisor_pid, middle_pid))
            os.write(write_end, str(child).encode())
        except OSError as exc:
            os.write(write_end, f"error {exc}".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        answer = _read_all(read_end)
    finally:
        os.close(read_end)
        os.waitpid(middle, 0)
    if not answer.isdigit():
        raise OSError(f"the middle process could not fork: {answer or 'no answer'}")
    return int(answer)


def _read_all(fd: int) -> str:
    """Everything written to a pipe until its last writer closes it."""
    chunks = []
    while chunk := os.read(fd, 64):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def run_child(
    entry: str,
    spec: str,
    env: dict[str, str],
    title: str,
    fds: list[int],
    link: socket.socket,
    parents: tuple[int, int],
) -> None:
    """Become `python -P -m ENTRY SPEC` with `env`, the link as its launch spec says; never returns.

    `parents`: the supervisor's pid and the middle process's, the two this child may see as its parent.
    """
    code: int = 1
    try:
        link.close()
        child_link, output = fds[0], (fds[1] if len(fds) > 1 else None)
        await_supervisor(*parents)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if output is not None:
            os.dup2(output, 1)
            os.dup2(output, 2)
        os.closerange(3, child_link)
        os.closerange(child_link + 1, os.sysconf("SC_OPEN_MAX"))
        set_title(title)  # before the environment changes: setproctitle finds its room beside the original one
        os.environ.clear()
        os.environ.update(env)
        launch = json.loads(spec)
        launch["link_fd"] = child_link  # the number it has here, not the supervisor's
        sys.argv = [entry, json.dumps(launch)]
        # What a re-exec after a build runs again (worker/reexec.py): this child's command, not the template's.
        sys.orig_argv = [sys.executable, "-P", "-m", entry, sys.argv[1]]
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - a child must never return into the template's loop
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def await_supervisor(supervisor_pid: int, middle_pid: int) -> None:
    """Wait until the middle process has exited and the supervisor adopted this one (its parent-death signal and
    its check of the parent are about the supervisor, as after an exec); exit at once when something else did (the
    supervisor died meanwhile).

    The middle's pid comes from the middle itself, not from this child's first `getppid()`: when the middle had
    exited and the supervisor died before that first look, the adopter (init) was taken for the middle and the
    child waited out the whole deadline as an orphan.
    """
    deadline = time.monotonic() + _REPARENT_WAIT_S
    while (parent := os.getppid()) != supervisor_pid:
        if parent != middle_pid or time.monotonic() > deadline:
            raise SystemExit(WorkerExitCode.SUPERVISOR_LOST)
        time.sleep(0.001)


def set_title(title: str) -> None:
    """What `ps` shows for this child (else it would show the template's command line)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _exit_code(code: object) -> int:
    """The process exit status `sys.exit(code)` gives."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
