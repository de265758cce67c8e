"""DeadPool's per-step replication of ZeRO-1 optimizer shards to a neighbour on another node.

After every optimizer update each rank packs its shard (its parameters and their optimizer state)
and sends it to its *holder* (``Topology.replica_holder``): the rank at its (pp, tp) coordinate in
another DP replica on another node, so a member of its DP group that holds the same slice of the
model and computes the same shard plan (at tp = pp = 1, the logical rank one node further on). It
receives the shard of its *partner* (``Topology.replica_owner``) meanwhile. A shard is named by the
DP coordinate of its owner (``ZeroOne.rank``), which is the logical rank at tp = pp = 1. The
exchange runs on the generation's side group (``Comm.side_pg``, gloo) in a background thread, so it
overlaps the next step's parameter sync, forward and backward; the next update waits for it.

The holder keeps two replica slots (ping-pong): a new replica is received into the slot that does
*not* hold the newest complete one, so a failure in the middle of a copy always leaves the
previous generation intact. Because the copy of generation k can still be in flight when the
owner dies, the holder also keeps what each of its partner's updates since its newest complete
replica used (the final gradients of the partner's shard, which every rank has after the full
all-reduce, and the group hyper-parameters): generation k is then rebuilt exactly as generation
k-1 plus a replay of update k (``shard_state.replay``).

Why not a torch.distributed.checkpoint or torchft component: both copy whole state to storage or
to a peer on demand; neither keeps a rolling per-step replica with a replay log, which is what
lets a spare take over with at most zero steps lost.
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from runner.comm import CollectiveFailure
from runner.recovery.deadpool.shard_state import (
    ShardLayout,
    ShardPacker,
    ShardState,
    UpdateRecord,
    describe,
    replay,
    unpack,
)
from runner.topology import Topology
from runner.zero import ZeroOne

TAG_HEADER, TAG_LAYOUT, TAG_DATA = 0, 1, 2
HEADER_BYTES = 32  # gen, shard bytes, layout bytes, whether the rest came in the same message (int64 each)
ABANDON_AFTER_S = 1.0  # how long a recovery waits for the broken generation's exchange (see drain())


class ReplicaLost(RuntimeError):
    """The holder cannot produce the requested generation of its partner's shard."""


@dataclass
class _Slot:
    gen: int = -1  # -1: empty or being written
    layout: Optional[ShardLayout] = None
    data: Optional[Tensor] = None  # the shard's bytes: a view of ``buffer`` after the header
    buffer: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))


class ShardReplicator:
    def __init__(self, zero: ZeroOne, topology: Topology, timeout_s: float) -> None:
        self.zero = zero
        self.topology = topology
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deadpool-replicate")
        self._job: Optional[Future] = None
        self._lock = threading.Lock()  # the exchange thread's changes to the slots against an abandonment
        self._epoch = 0  # bumped when an exchange is abandoned: an older one changes nothing any more
        self._slots = [_Slot(), _Slot()]
        self._records: list[UpdateRecord] = []  # the partner's updates newer than its newest complete replica
        self._packer = ShardPacker()
        self._partner_layout: Optional[ShardLayout] = None
        self._layout: Optional[ShardLayout] = None  # this rank's shard layout, and encoded for the holder
        self._encoded = b""
        self._group_gen = -1  # the side group the sizes below are about
        self._layout_sent = b""  # the layout bytes the holder has
        self._expect_send = self._expect_recv = HEADER_BYTES  # the size of the next first message, each way
        self.bytes_per_step = 0

    # -- who backs up whom -----------------------------------------------------------------------
    def holder(self, logical_rank: int) -> int:
        return self.topology.replica_holder(logical_rank)

    def partner(self, logical_rank: int) -> int:
        return self.topology.replica_owner(logical_rank)

    def _shard_of(self, logical_rank: int) -> int:
        """The shard ``logical_rank`` owns in the plan of its DP group: its DP coordinate."""
        return self.topology.coords(logical_rank)[0]

    # -- the owner's side: one exchange per update -----------------------------------------------
    def record(self, logical_rank: int, gen: int) -> None:
        """Before this rank's update producing ``gen``: keep what the partner's update uses (for a replay)."""
        params = self.zero.params
        # references, not copies: the update leaves .grad alone and zero_grad drops it (ZeroOne), so these
        # tensors stay as they are until the record is pruned
        grads = []
        for i in self.zero.plan.flat_shard(self._shard_of(self.partner(logical_rank))):
            grad = params[i].grad
            assert grad is not None  # recorded after the backward that set it, before the update
            grads.append(grad.detach())
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.zero.optimizer.param_groups]
        self._records = [r for r in self._records if r.gen < gen] + [UpdateRecord(gen, grads, hyper)]

    def start(self, comm, gen: int) -> None:
        """Send this rank's shard (``gen`` updates applied) to its holder; receive the partner's."""
        if self._job is not None:
            raise RuntimeError("a replication is still in flight; wait() for it before the next update")
        me = comm.logical_rank
        pg_of = {lr: i for i, lr in enumerate(comm.layout.logical)}
        self._job = self._pool.submit(self._exchange, comm.side_pg, comm.gen, pg_of[self.holder(me)],
                                      pg_of[self.partner(me)], gen, self._epoch)

    def wait(self) -> None:
        """Block until the exchange in flight is complete; a failed one raises CollectiveFailure."""
        job, self._job = self._job, None
        if job is None:
            return
        try:
            job.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise CollectiveFailure(f"shard replication did not finish within {self.timeout_s:.0f}s") from None
        except Exception as err:
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CollectiveFailure(f"shard replication failed: {message}") from None

    def drain(self) -> bool:
        """Recovery: end the broken generation's exchange, if one is in flight; True if it was abandoned.

        Once its peers drop their groups it fails within milliseconds; one still running after
        ABANDON_AFTER_S waits on a peer whose own exchange of that generation is stuck the same way,
        each thread keeping open the connection the other waits on until gloo's timeout (the
        collective timeout, which the recovery's collectives would hit first). It is abandoned: it
        fails on its own later and changes nothing here (``_epoch``), the slot it was writing gets a
        new buffer, and the next exchange runs on a new thread. Until it fails, that thread also
        delays the worker's exit (the executor joins it), which the launcher's shutdown bounds."""
        job, self._job = self._job, None
        if job is None:
            return False
        try:
            job.result(timeout=ABANDON_AFTER_S)
        except FutureTimeout:
            with self._lock:
                self._epoch += 1
                for slot in self._slots:
                    if slot.gen < 0:
                        slot.buffer = torch.empty(0, dtype=torch.uint8)
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="deadpool-replicate")
            return True
        except Exception:
            pass  # failed with its generation: what it left is what the slots say
        return False

    def _exchange(self, pg, group_gen: int, holder: int, partner: int, gen: int, epoch: int) -> None:
        """One message per step once sizes settle: [header | layout if new | shard bytes], sent as
        one when the holder expects exactly its size (the size of the previous one), else the
        header goes first on its own (the first exchange in a group, a new layout or shard size).
        A header message of its own cost a third of a small shard's exchange."""
        if pg is None:
            raise CollectiveFailure("no side group (aborted)")
        if self._group_gen != group_gen:  # a new group: the holder has nothing of ours yet
            self._group_gen, self._layout_sent = group_gen, b""
            self._expect_send = self._expect_recv = HEADER_BYTES
        own = self.zero.own_optimizer_params()
        layout = describe(own, self.zero.optimizer)
        if layout != self._layout:  # the layout changes only when the optimizer state gains keys
            self._layout, self._encoded = layout, _encode_layout(layout)
        layout_bytes = b"" if self._layout_sent == self._encoded else self._encoded  # the holder has it already
        prefix = _prefix(len(layout_bytes))
        message = self._packer.pack(own, self.zero.optimizer, layout, prefix)
        combined = message.numel() == self._expect_send
        message[:HEADER_BYTES].view(torch.int64).copy_(
            torch.tensor([gen, layout.nbytes, len(layout_bytes), int(combined)], dtype=torch.int64))
        if layout_bytes:
            message[HEADER_BYTES:HEADER_BYTES + len(layout_bytes)].copy_(
                torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8))
        sends = []
        if not combined:
            sends.append(pg.send([message[:HEADER_BYTES]], holder, TAG_HEADER))
            if layout_bytes:
                sends.append(pg.send([message[HEADER_BYTES:HEADER_BYTES + len(layout_bytes)]], holder, TAG_LAYOUT))
        if combined:
            sends.append(pg.send([message], holder, TAG_HEADER))
        else:
            sends.append(pg.send([message[prefix:]], holder, TAG_DATA))
        self._receive(pg, partner, epoch)
        for work in sends:
            work.wait()
        with self._lock:
            _still_current(epoch, self._epoch)
            self._layout_sent, self._expect_send = self._encoded, message.numel()
            self.bytes_per_step = layout.nbytes

    def _receive(self, pg, partner: int, epoch: int) -> None:
        with self._lock:
            _still_current(epoch, self._epoch)
            newest = self._newest()
            slot = self._slots[1] if newest is self._slots[0] else self._slots[0]
            slot.gen = -1  # a half-written replica is never taken for a complete one
            expect = self._expect_recv
            if slot.buffer.numel() < expect:
                slot.buffer = torch.empty(expect, dtype=torch.uint8)
            buf = slot.buffer  # this exchange's: an abandonment gives the slot another one
        pg.recv([buf[:expect]], partner, TAG_HEADER).wait()  # the header alone, or all of it
        gen, nbytes, layout_len, combined = buf[:HEADER_BYTES].view(torch.int64).tolist()
        prefix = _prefix(layout_len)
        if combined and prefix + nbytes != expect:
            raise CollectiveFailure(f"shard replica of {prefix + nbytes} bytes where {expect} were expected")
        if not combined:
            if buf.numel() < prefix + nbytes:
                buf = torch.empty(prefix + nbytes, dtype=torch.uint8)  # the header is read already
            if layout_len:
                pg.recv([buf[HEADER_BYTES:HEADER_BYTES + layout_len]], partner, TAG_LAYOUT).wait()
            pg.recv([buf[prefix:prefix + nbytes]], partner, TAG_DATA).wait()
        with self._lock:
            _still_current(epoch, self._epoch)
            if layout_len:
                self._partner_layout = _decode_layout(buf[HEADER_BYTES:HEADER_BYTES + layout_len])
            slot.buffer = buf
            slot.layout, slot.data, slot.gen = self._partner_layout, buf[prefix:prefix + nbytes], gen
            self._expect_recv = prefix + nbytes
            self._records = [r for r in self._records if r.gen > gen]

    def _newest(self) -> Optional[_Slot]:
        complete = [s for s in self._slots if s.gen >= 0]
        return max(complete, key=lambda s: s.gen) if complete else None

    # -- the holder's side: a replacement asks for its shard -------------------------------------
    def replica_of(self, partner: int, gen: int) -> ShardState:
        """The partner's shard after ``gen`` updates: a complete replica, plus a replay of what it missed."""
        base = max((s for s in self._slots if 0 <= s.gen <= gen), key=lambda s: s.gen, default=None)
        if base is None:
            raise ReplicaLost(f"no complete replica of logical rank {partner}'s shard at or before update {gen} "
                              f"(replicas held: {sorted(s.gen for s in self._slots if s.gen >= 0)})")
        missing = [r for r in self._records if base.gen < r.gen <= gen]
        if [r.gen for r in missing] != list(range(base.gen + 1, gen + 1)):
            raise ReplicaLost(f"logical rank {partner}'s replica is at update {base.gen}, and the updates up to {gen} "
                              f"were not all recorded (have {[r.gen for r in self._records]})")
        assert base.layout is not None and base.data is not None  # a complete slot (gen >= 0) holds both
        shard = unpack(base.layout, base.data, base.gen)
        if not missing:
            return shard
        groups = [g for g, idx in enumerate(self.zero.plan.shard(self._shard_of(partner))) for _ in idx]
        return replay(self.zero.optimizer, shard, groups, missing)

    def memory_bytes(self) -> int:
        """Host memory the replication holds: the send buffer, both replica slots and the replay records."""
        slots = sum(s.buffer.numel() for s in self._slots)
        records = sum(g.numel() * g.element_size() for r in self._records for g in r.grads)
        return self._packer.buffer.numel() + slots + records

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


def _still_current(epoch: int, current: int) -> None:
    if epoch != current:
        raise CollectiveFailure("abandoned: a recovery replaced the generation of this exchange")


def _prefix(layout_len: int) -> int:
    """Where the shard's bytes start in a message: after the header and the layout, 64-byte aligned
    so that every tensor of the shard can be viewed in place."""
    return HEADER_BYTES + -(-layout_len // 64) * 64


def _encode_layout(layout: ShardLayout) -> bytes:
    buf = io.BytesIO()
    torch.save({"entries": [list(e) for e in layout.entries],
                "values": [[k[0], k[1], v] for k, v in layout.values.items()], "nbytes": layout.nbytes}, buf)
    return buf.getvalue()


def _decode_layout(raw: Tensor) -> ShardLayout:
    d = torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)
    return ShardLayout([(e[0], e[1], e[2], tuple(e[3]), e[4]) for e in d["entries"]],
                       {(v[0], v[1]): v[2] for v in d["values"]}, d["nbytes"])
