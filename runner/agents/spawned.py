"""Processes bound to their host: an agent, its fork server and whatever that forks die with their parent.

A host's loss takes its processes with it. In the simulation a host is its agent's process, so the
agent asks the kernel to SIGKILL it when its launcher dies (PR_SET_PDEATHSIG), its fork server asks the
same about the agent (``runner.agents.fork_server``), and every process the fork server forks (workers,
the node's flash-checkpoint persister) asks the same about the fork server right after the fork; a child
whose parent died before it asked kills itself. Under ``launcher=local`` the agents' launcher is the
zygote they are forked from, which is bound to the controller the same way.
``run_worker`` is the worker processes' entry: the host's device environment, then the worker. Linux
only: elsewhere nothing is bound, and the local launcher refuses node-loss faults.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

BINDS = sys.platform.startswith("linux")
PR_SET_PDEATHSIG = 1
_parent = 0  # the pid of the process about to fork, noted in it before the fork


def die_with_parent() -> None:
    """This process is SIGKILLed when the thread that started it ends (with its process)."""
    if BINDS:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def bind_forked_children() -> None:
    """Every process this one forks from now on dies with it."""
    if BINDS:
        os.register_at_fork(before=_note_parent, after_in_child=_bind_child)


def _note_parent() -> None:
    global _parent
    _parent = os.getpid()


def _bind_child() -> None:
    die_with(_parent)


def die_with(parent: int) -> None:
    """This process, started by ``parent``, is SIGKILLed when that dies, at once if it died already (between
    the start and this request)."""
    die_with_parent()
    if BINDS and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def run_worker(spec_fields: dict, cfg_dict: dict, env: dict[str, str]) -> None:
    """A worker of this host: its device (``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``), then the worker."""
    from runner.training.worker import WorkerSpec, main

    os.environ.update(env)
    main(WorkerSpec(**spec_fields), cfg_dict)
