"""A communicator whose links can be made to fail, slow down, be cut, or hold a shard copy half-way.

Only a run with a fault config builds it (``worker.py``); ``Comm`` itself knows nothing of faults.
The model is torchft's fault-injecting process-group wrapper: the faults are the victim's own, armed
by ``runner.callbacks.fault_injection.FaultTrigger``, and they surface exactly as real ones would, as a
failed launch or wait (``CollectiveFailure``) of the main group, or a failed rendezvous.

* ``fail_next_collective``: the next launched collective fails (a transient connection error);
* ``fail_next_reduction``: the next gradient reduction completes on every peer, then fails here
  only (``after_reduce``: the others commit the step, the victim lags);
* ``strike_after_next_agreement``: once the next step agreement (tp*pp > 1) completed here, it fails here
  alone, or the victim announces its kill and waits for it (``during: agreement``): the agreement
  completed on one model slice and failed on another, held deterministically;
* ``wedge_next_reduction``: the victim's part of the next gradient reduction never leaves it, and it waits as its
  peers do (a link that drops packets silently): the collective is stuck on every member, found only by the
  controller's calibrated reduction timeout (which cuts the generation off) or the collective timeout;
* ``slow_links``: a delay before every batch of collectives (like a ``tc`` delay);
* ``partition``: collectives and rendezvous fail until the partition ends;
* ``hold_next_shard_copy``: the side group's next payload message (a technique's shard copy, which its sender
  announces with ``Comm.before_side_payload``) waits until the returned event is set, so that a kill lands while
  the copy is in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import PrefixStore

from runner.training.comm import _CUT_OFF_POLL, _WAIT_MARGIN, CollectiveFailure, Comm

PARTITIONED = "network partition: this rank cannot reach its peers"


class FaultInjectingComm(Comm):
    """``Comm`` with the victim's link faults; every method not overridden here behaves as ``Comm``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._transient = False  # the next collective fails once
        self._after_reduction = False  # the next gradient reduction fails here only, once complete
        self._wedged = False  # the next gradient reduction is never sent from here, and waited for like the peers'
        self._link_delay_s = 0.0  # added before every batch of collectives
        self._partitioned_until = 0.0  # collectives and rendezvous fail until then
        self._after_agreement: Optional[Callable[[], None]] = None  # run once the next agreement completed here
        self._held_payload: Optional[threading.Event] = None  # the next side-group payload waits for it

    # -- arming, by the fault trigger ------------------------------------------------------------
    def fail_next_collective(self) -> None:
        self._transient = True

    def fail_next_reduction(self) -> None:
        self._after_reduction = True

    def wedge_next_reduction(self) -> None:
        self._wedged = True

    def strike_after_next_agreement(self, strike: Optional[Callable[[], None]] = None) -> None:
        """Once the next step agreement completed here: ``strike`` (a kill announced and waited for), or without
        one the agreement fails here alone, every peer's having completed."""
        self._after_agreement = strike or self._fail_agreement

    def _fail_agreement(self) -> None:
        self._raise_on("injected connection error after the step agreement completed on every peer")

    def slow_links(self, delay_s: float) -> None:
        self._link_delay_s = delay_s

    def partition(self, duration_s: float) -> None:
        """Cut this rank's links for ``duration_s`` (negative: for good)."""
        self._partitioned_until = time.monotonic() + (duration_s if duration_s >= 0 else 1e9)

    def hold_next_shard_copy(self) -> threading.Event:
        """Hold the side group's next payload message until the returned event is set (at most the collective
        timeout). Call it before the copy starts."""
        self._held_payload = threading.Event()
        return self._held_payload

    def before_side_payload(self) -> None:
        release, self._held_payload = self._held_payload, None
        if release is not None:
            release.wait(self.collective_timeout.total_seconds())

    # -- where the faults strike -----------------------------------------------------------------
    def _partitioned(self) -> bool:
        return time.monotonic() < self._partitioned_until

    def _arrive(self, prefix: PrefixStore, wait: timedelta, rank: int | None = None, size: int | None = None) -> None:
        if self._partitioned():
            raise CollectiveFailure(PARTITIONED)
        super()._arrive(prefix, wait, rank, size)

    def launch(self, op) -> None:
        if self._failure is None and self.pg is not None:
            if self._transient:
                self._transient = False
                self._failure = "injected transient connection error"
                return
            if self._partitioned():
                self._failure = PARTITIONED
                return
            if self._link_delay_s and not self._in_flight:
                time.sleep(self._link_delay_s)  # the fault itself: a slow link, once per batch of collectives
        super().launch(op)

    def agree(self, tensors: list) -> None:
        super().agree(tensors)
        strike, self._after_agreement = self._after_agreement, None
        if strike is not None:
            strike()

    def launch_reduction(self, op) -> None:
        if not self._wedged:  # wedged: this rank's buckets never reach the peers, whose collective waits for them
            super().launch_reduction(op)

    def wait_reduction(self) -> None:
        if self._wedged:
            self._wedged = False
            self._raise_on(self._wait_wedged())
        failure = self._drain()
        if failure is None and self._after_reduction:
            self._after_reduction = False
            failure = "injected connection error after the reduction completed on every peer"
        self._raise_on(failure)

    def _wait_wedged(self) -> str:
        """Wait as a peer of the stuck collective does: until the generation is cut off or replaced, at most the
        collective timeout (then it fails as a timed-out collective would)."""
        deadline = time.monotonic() + (self.collective_timeout + _WAIT_MARGIN).total_seconds()
        while time.monotonic() < deadline:
            reason = self._cut_off()
            if reason is not None:
                return reason
            time.sleep(_CUT_OFF_POLL.total_seconds())
        return f"the reduction timed out after {self.collective_timeout.total_seconds():.0f}s (its link dropped it)"

