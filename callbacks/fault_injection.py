"""Worker side of fault injection: the victim announces that it reached its trigger point.

Kills and stops are carried out by the controller (a process other than the victim), so a
SIGKILL lands exactly at the announced step. Each fault fires once per job, claimed through an
atomic counter in the store, so a replacement never inherits its predecessor's fate. Faults of
the victim's own links, gradients or parameters (transient, slow_link, partition, bitflip, param_bitflip)
are armed or done here, the links' on the ``runner.faults.comm_faults.FaultInjectingComm`` a fault config
gives the worker.
With fault=chaos the controller orders such a fault: it writes the order and signals this
process, whose handler only raises a flag; the order is read at the next step start.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
from lightning.pytorch.callbacks import Callback

from runner.config.validate import RANK_FAULTS
from runner.faults import chaos
from runner.faults.comm_faults import FaultInjectingComm
from runner.plumbing import protocol
from runner.training.comm import Comm, RunFailedError


class FaultTrigger(Callback):
    def __init__(self, faults: list, comm: Comm, status, events, release_timeout_s: float,
                 initial: bool = True) -> None:
        """``initial``: this process started as its logical rank (not a replacement), the one a slow_rank slows."""
        self.faults = list(enumerate(faults))
        self.initial = initial
        self.comm, self.status, self.events = comm, status, events
        self.release_timeout_s = release_timeout_s
        self._t_start: float | None = None
        self._ordered = False  # the chaos signal came: an order waits in the store
        self._flip_order: int | None = None  # index of an ordered bitflip, done in the next backward
        self._flip = None  # the bitflip hook, armed for one backward
        # a kill due while this step's shard copy is in flight: (fire, release the copy)
        self._copy_held: tuple[Callable[[], None], threading.Event] | None = None
        if any(f.kind == "chaos" for f in faults):
            signal.signal(chaos.SIGNAL, self._on_order)
            signal.siginterrupt(chaos.SIGNAL, False)  # system calls under way resume instead of failing

    def _on_order(self, signum, frame) -> None:
        self._ordered = True

    def on_train_start(self, trainer, pl_module) -> None:
        """Refuse a fault set for a step the run never reaches: the configuration check compared it with
        ``trainer.max_steps``, but ``trainer.max_epochs`` ends the run at a step known only now, from the training
        set's length (the run fails before its first step, as it would have been refused)."""
        self._t_start = time.monotonic()
        end = trainer.max_steps
        late = [f"fault {i} ({fault.kind} at step {fault.step})" for i, fault in self.faults
                if fault.kind != "none" and 0 <= end <= fault.step]
        if late:
            raise RunFailedError(
                f"{', '.join(late)} would never fire: trainer.max_epochs ends this run after step {end - 1} "
                f"(trainer.max_epochs={trainer.max_epochs} epochs of the training set). Set the fault's step below "
                f"{end}, or raise trainer.max_epochs.")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._ordered:
            self._ordered = False
            order = protocol.get_json(self.comm.store, chaos.ORDER_KEY.format(wid=self.comm.wid))
            if order["kind"] == "bitflip":
                self._flip_order = order["index"]
            else:
                self._arm_link_fault(order["index"], order["kind"], delay_s=0.0, duration_s=order["duration_s"])
        for i, fault in self.faults:
            if (not self._targets_me(fault) or fault.during not in ("step", "after_reduce", "agreement", "reduction")
                    or fault.kind in ("bitflip", "param_bitflip")):
                continue
            if fault.kind == "slow_rank":  # the slowness is its process's or its host's: a replacement is not slow
                if step >= max(fault.step, 0) and self.initial:
                    time.sleep(fault.delay_s)  # the fault itself: a straggler
                continue
            if not self._due(fault, step) or self.comm.store.add(f"fault/claim/{i}", 1) != 1:
                continue
            self._fire(i, fault, step)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        """bitflip: flip the top exponent bit of one gradient element on the victim, once per job.

        The flip happens inside backward, as a faulty kernel's would (a hook on the first float32
        parameter's gradient), so it is in the reduction even though buckets launch during backward.
        """
        step = trainer.global_step
        for i, fault in self.faults:
            if fault.kind != "bitflip" or not self._targets_me(fault) or not self._due(fault, step):
                continue
            if self.comm.store.add(f"fault/claim/{i}", 1) == 1:
                self._flip_order = i
        if self._flip_order is not None:
            param = next(p for p in pl_module.parameters() if p.requires_grad and p.dtype == torch.float32)
            self._flip = param.register_hook(_flip_top_exponent_bit)
            self.events.emit("fault_injected", fault="bitflip", index=self._flip_order,
                             victims=[self.comm.logical_rank])
            self._flip_order = None

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._flip is not None:  # one backward only (not the corruption guard's recompute)
            self._flip.remove()
            self._flip = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """``during: replication``: a kill due at this step strikes while the shard copy that the update starts
        (ZeRO-1 with DeadPool's replication) is in flight: the copy is held half-way until the kill."""
        step = trainer.global_step
        for i, fault in self.faults:
            if (fault.during == "replication" and self._targets_me(fault) and self._due(fault, step)
                    and self.comm.store.add(f"fault/claim/{i}", 1) == 1):
                release = self._injecting.hold_next_shard_copy()
                # the copy overlaps step + 1
                self._copy_held = (partial(self._fire, i, fault, step + 1), release)
                return

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """param_bitflip: once step ``fault.step``'s update is in, flip one parameter bit on the victim alone, so its
        replica silently differs from the others' (the replica check's fault)."""
        step = trainer.global_step - 1  # the step just committed
        for i, fault in self.faults:
            if (fault.kind == "param_bitflip" and self._targets_me(fault) and self._due(fault, step)
                    and self.comm.store.add(f"fault/claim/{i}", 1) == 1):
                param = next(p for p in pl_module.parameters() if p.requires_grad and p.is_floating_point())
                _flip_mantissa_bit(param.data)
                self.events.emit("fault_injected", fault="param_bitflip", index=i, victims=[self.comm.logical_rank],
                                 at_step=step)
        if self._copy_held is not None:
            fire, release = self._copy_held
            self._copy_held = None
            fire()
            release.set()  # not killed after all: let the copy finish

    def on_recovery_start(self) -> None:
        """Called by the worker's recovery loop: faults with ``during: recovery`` fire here."""
        for i, fault in self.faults:
            if (fault.during == "recovery" and self._targets_me(fault)
                    and self.comm.store.add(f"fault/claim/{i}", 1) == 1):
                self._fire(i, fault, self.status.step)

    def _targets_me(self, fault) -> bool:
        if fault.kind in RANK_FAULTS:
            return fault.rank == self.comm.logical_rank
        if fault.kind == "kill_node":
            return fault.node == self.status.node
        return False

    def _due(self, fault, step: int) -> bool:
        if fault.step >= 0:
            return step == fault.step
        assert self._t_start is not None  # asked from the training hooks, which follow on_train_start
        return fault.after_s >= 0 and time.monotonic() - self._t_start >= fault.after_s

    def _fire(self, i: int, fault, step: int) -> None:
        if fault.kind in ("transient", "slow_link", "partition"):
            self._arm_link_fault(i, fault.kind, fault.delay_s, fault.duration_s, fault.during)
            return
        if fault.kind == "hang_rank" and fault.hang == "stall":
            self._stall(i, step)
            return
        if fault.during == "agreement":  # the kill lands inside the step, once its agreement completed here
            self._injecting.strike_after_next_agreement(partial(self._announce, i, fault, step))
            return
        self._announce(i, fault, step)

    def _announce(self, i: int, fault, step: int) -> None:
        """Tell the controller the victim reached its fault, and wait until it was carried out (or not)."""
        protocol.set_json(self.comm.store, f"fault/hit/{i}", {"wid": self.comm.wid, "step": step, "t": time.time()})
        try:  # the controller acts now; this wait ends only if it does not
            self.comm.store.wait([f"fault/released/{i}"], timedelta(seconds=self.release_timeout_s))
        except Exception:
            self.events.emit("fault_not_carried_out", fault=fault.kind, index=i)

    def _stall(self, i: int, step: int) -> None:
        """hang=stall: the training thread blocks here, mid-step, while the heartbeat thread goes on beating; the
        controller's hang rule kills the process long before the bound (``recovery_timeout_s``) ends the wait."""
        t = time.time()
        self.events.emit("fault_injected", fault="hang_rank", index=i, victims=[self.comm.logical_rank], t_fault=t,
                         at_step=step, hang="stall")
        threading.Event().wait(self.release_timeout_s)
        self.events.emit("fault_not_carried_out", fault="hang_rank", index=i)

    def _arm_link_fault(self, i: int, kind: str, delay_s: float, duration_s: float, during: str = "step") -> None:
        """Network faults: the victim's own links fail once, slow down, or are cut."""
        comm = self._injecting
        if kind == "transient" and during == "after_reduce":
            comm.fail_next_reduction()  # the others commit the step; the victim alone lags
        elif kind == "transient" and during == "reduction":
            comm.wedge_next_reduction()  # the step's reduction is stuck on every member
        elif kind == "transient" and during == "agreement":
            comm.strike_after_next_agreement()  # the others commit the step; the victim's slice misses it here
        elif kind == "transient":
            comm.fail_next_collective()
        elif kind == "slow_link":
            comm.slow_links(delay_s)
        else:
            comm.partition(duration_s)
        self.events.emit("fault_injected", fault=kind, index=i, victims=[comm.logical_rank])

    @property
    def _injecting(self) -> FaultInjectingComm:
        """The communicator's fault hooks: a worker with faults to inject is given a ``FaultInjectingComm``."""
        assert isinstance(self.comm, FaultInjectingComm)
        return self.comm


def _flip_mantissa_bit(param: torch.Tensor) -> None:
    """A mantissa bit of the first element, in place: the eighth below the top one (a relative change of 2**-8 in
    float32, the lowest bit in bfloat16), too small for any loss or norm to notice and too large for the next
    updates' rounding to erase, as a flip of the lowest bit can be."""
    bit = max(round(-math.log2(torch.finfo(param.dtype).eps)) - 8, 0)
    first = param.view(-1)[:1].view(torch.uint8)  # little-endian: bit k is in byte k // 8
    first[bit // 8 : bit // 8 + 1].bitwise_xor_(1 << (bit % 8))


def _flip_top_exponent_bit(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 30)
    return grad
