"""A preloaded process that forks children on request: a host's worker fork server, and the zygote that
forks the simulated hosts' agents under ``launcher=local``.

Why not multiprocessing's forkserver: it execs a fresh interpreter that imports everything again, which
costs seconds of CPU per host (torch, Lightning, the worker's modules) on top of the agent's own
imports. This one is either forked from a process that already imported what its children need
(``ForkServer.fork``: a node agent forks its host's server before its own threads start) or, once per
job, started as a fresh interpreter that imports them first (``ForkServer.exec_preloaded``: the zygote
of every simulated host's agent, which then forks its own server from itself). Nothing in it depends
on how its process started, so an agent that torchrun or a shell started works the same way.

The protocol is multiprocessing's forkserver's, over a socketpair instead of a listening socket. For
each child the client makes a socketpair, the child's *status channel*, and sends one end, with the
descriptors the child is to receive, over the control socket (SCM_RIGHTS). The server forks; the child
reads its target and arguments from the channel and closes it; the server writes the child's pid to
the channel and, once it reaped the child, its exit code (``os.waitstatus_to_exitcode``: a signalled
child reads -9 as multiprocessing reported it), then closes it. The client's end is the child's
sentinel. A child exits as a multiprocessing Process did: SystemExit(code) -> code, an exception -> its
traceback on stderr and 1, stdio flushed, ``os._exit``. The server dies with its client and every child
with the server (``runner.agents.spawned``); it exits when the client closes the control socket.
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import NoReturn, Optional

from runner.agents import spawned

MAX_FDS = 16  # the status channel and the descriptors one child receives
_CODE = struct.Struct("!i")  # a pid or an exit code on a status channel


class ForkedProcess:
    """A child of a fork server as its client sees it, with multiprocessing.Process's interface where the
    agent needs it (``pid``, ``exitcode``, ``sentinel``, ``join``, ``kill``). The client is not the child's
    parent: the exit code comes from the server, and ``sentinel`` is readable from then on."""

    def __init__(self, pid: int, status: Connection) -> None:
        self.pid, self._status = pid, status
        self._exitcode: Optional[int] = None
        self._lock = threading.Lock()  # several threads read the exit code (the watch, the command loop)

    @property
    def sentinel(self) -> int:
        return self._status.fileno()

    @property
    def exitcode(self) -> Optional[int]:
        with self._lock:
            if self._exitcode is None and self._status.poll():
                try:
                    self._exitcode = _CODE.unpack(self._status.recv_bytes())[0]
                except (EOFError, ConnectionResetError):  # the server died before it could report (a reset:
                    self._exitcode = -signal.SIGKILL  # with bytes it had not read yet): the child died with it
            return self._exitcode

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the exit code is there (at most ``timeout`` seconds)."""
        wait([self._status], timeout)

    def kill(self) -> None:
        if self.exitcode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """The client's side of a fork server: ``start`` forks a child from it, ``close`` ends it."""

    def __init__(self, control: socket.socket, reap: Callable[[], object]) -> None:
        self._control, self._reap = control, reap

    @classmethod
    def fork(cls) -> ForkServer:
        """A server forked from this process: its children inherit every module imported here. Call it
        from the thread that lives as long as the process (the server dies when that thread ends), before
        any other thread starts."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:  # never back into the caller's code
                ours.close()
                spawned.die_with(parent)
                _serve(theirs)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        theirs.close()
        return cls(ours, lambda: os.waitpid(pid, 0))

    @classmethod
    def exec_preloaded(cls, modules: list[str]) -> ForkServer:
        """A server in a fresh interpreter that imports ``modules`` first, in a session of its own (Ctrl-C
        reaches only this process, which ends the children itself)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = (f"from runner.agents.fork_server import serve_preloaded; "
                f"serve_preloaded({theirs.fileno()}, {modules!r}, {os.getpid()})")
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], start_new_session=True)
        theirs.close()
        return cls(ours, proc.wait)

    def start(self, target: Callable[..., object], args: tuple = (),
              connections: tuple[Connection, ...] = ()) -> ForkedProcess:
        """Fork a child that runs ``target(*args, *connections)``: the connections travel as descriptors
        (close them here afterwards), the target and arguments pickled."""
        status, child_status = socket.socketpair()
        with child_status:
            socket.send_fds(self._control, [b"fork"], [child_status.fileno()] + [c.fileno() for c in connections])
        channel = Connection(status.detach())
        channel.send((target, args))
        return ForkedProcess(_CODE.unpack(channel.recv_bytes())[0], channel)

    def close(self) -> None:
        """End the server once its children ended (any still running die with it), and reap it."""
        self._control.close()
        self._reap()


def serve_preloaded(control_fd: int, modules: list[str], parent: int) -> NoReturn:
    """The entry of a server started by ``exec_preloaded``: bound to ``parent``, then the imports."""
    spawned.die_with(parent)
    for name in modules:
        importlib.import_module(name)
    _serve(socket.socket(fileno=control_fd))


def _serve(control: socket.socket) -> NoReturn:
    """Fork on every request, report every child's pid and exit; exit when the client closes ``control``."""
    spawned.bind_forked_children()
    devnull = os.open(os.devnull, os.O_RDONLY)  # no child reads a terminal (multiprocessing closed their stdin)
    os.dup2(devnull, 0)
    os.close(devnull)
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)  # a SIGCHLD's byte wakes select()
    restore = {signal.SIGCHLD: signal.signal(signal.SIGCHLD, _on_sigchld),
               signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}  # Ctrl-C is the client's to handle
    channels: dict[int, Connection] = {}  # pid -> its status channel
    while True:
        ready, _, _ = select.select([control.fileno(), sig_r], [], [])
        if sig_r in ready:
            os.read(sig_r, 4096)
            _reap(channels)
        if control.fileno() in ready:
            message, fds, _, _ = socket.recv_fds(control, 16, MAX_FDS)
            if not message:  # the client is gone or done
                os._exit(0)
            channel = Connection(fds[0])
            pid = os.fork()
            if pid == 0:
                control.close()
                for fd in (sig_r, sig_w):
                    os.close(fd)
                for other in channels.values():
                    other.close()
                signal.set_wakeup_fd(-1)
                for sig, handler in restore.items():
                    signal.signal(sig, handler)
                os._exit(_run_child(channel, fds[1:]))
            for fd in fds[1:]:
                os.close(fd)
            try:
                channel.send_bytes(_CODE.pack(pid))
            except OSError:
                pass  # the client is gone
            channels[pid] = channel


def _on_sigchld(signum: int, frame: object) -> None:
    """Nothing to do here: the signal's byte on the wakeup descriptor wakes the server's select()."""


def _reap(channels: dict[int, Connection]) -> None:
    """Report the exit of every child that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel = channels.pop(pid, None)
        if channel is None:
            continue
        try:
            channel.send_bytes(_CODE.pack(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass  # the client is gone
        channel.close()


def _run_child(channel: Connection, fds: list[int]) -> int:
    """Run the target the client sent; returns the code multiprocessing's Process would have exited with."""
    try:
        with channel:
            target, args = channel.recv()
        target(*args, *(Connection(fd) for fd in fds))
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code
