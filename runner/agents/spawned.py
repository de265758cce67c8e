"""What runs in a node agent, its fork server and every process that forks: they die with their host.

A host's loss takes its processes with it. In the simulation a host is its agent's process, so the
agent and its fork server import this module first: each asks the kernel to SIGKILL it when its parent
dies (PR_SET_PDEATHSIG; the agent's parent is its launcher), and every process the fork server forks
(workers, the node's flash-checkpoint persister) asks the same about the fork server right after the
fork; a child whose parent died before it asked kills itself. ``run_worker`` is the worker processes'
entry: the host's device environment, then the worker. Linux only: elsewhere nothing is bound, and the
local launcher refuses node-loss faults.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_parent = 0  # the pid of the process about to fork, noted in it before the fork


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _note_parent() -> None:
    global _parent
    _parent = os.getpid()


def _bind_child() -> None:
    _die_with_parent()
    if os.getppid() != _parent:  # the parent died between the fork and the request
        os.kill(os.getpid(), signal.SIGKILL)


if sys.platform.startswith("linux"):
    _die_with_parent()  # the agent with its launcher, the fork server with its agent
    os.register_at_fork(before=_note_parent, after_in_child=_bind_child)


def run_worker(spec_fields: dict, cfg_dict: dict, env: dict[str, str]) -> None:
    """A worker of this host: its device (``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES``), then the worker."""
    from runner.worker import WorkerSpec, main

    os.environ.update(env)
    main(WorkerSpec(**spec_fields), cfg_dict)
