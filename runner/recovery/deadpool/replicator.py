"""DeadPool's replication of ZeRO-1 optimizer shards to a neighbour on another node.

Each rank's *holder* (``Topology.replica_holder``) keeps a replica of its shard (its parameters, or fp32
masters, and their optimizer state): the rank at its (pp, tp) coordinate in another DP replica on another
node, so a member of its DP group that holds the same slice of the model and computes the same shard plan (at
tp = pp = 1, the logical rank one node further on). It holds the replica of its *partner*'s shard
(``Topology.replica_owner``) meanwhile. A shard is named by the DP coordinate of its owner (``ZeroOne.rank``),
which is the logical rank at tp = pp = 1. Before each update every rank keeps what its partner's update uses
(``UpdateRecord``: the final gradients of the partner's shard, which every rank has after the full all-reduce,
and the group hyper-parameters). Two ways to keep the replica current (``ft.deadpool.replication``):

* ``replay`` (the default): the holder applies each recorded update to its replica itself (``LiveShard``: a
  fresh optimizer of the owner's kind, the very same update math, so the replica stays bit-identical to the
  owner's shard) and nothing goes over the network per step. A full copy *seeds* the replica at the first
  update of every group generation (the start, after a recovery, a new holder); every
  ``verify_every_n_steps`` updates each owner sends its holder its shard's digest and each holder sends its
  partner its replica's (``DIGEST_BYTES`` each way); a mismatch (a drifted replica) is reported
  (``drifts``) and the owner sends a full copy again.
* ``copy``: after every update the owner sends its whole shard, and the holder keeps it in one of two slots.

Either way the work runs on the generation's side group (``Comm.side_pg``, gloo) in a background thread, so it
overlaps the next step's parameter sync, forward and backward; the next update waits for it. A copy is
received into the slot that does *not* hold the newest complete replica (ping-pong), so a failure in the
middle of a copy always leaves the previous generation intact, and the records of the updates newer than the
replica are kept: when the owner dies while the copy of update k is in flight, update k is rebuilt exactly as
the replica of k-1 plus a replay of update k (``shard_state.replay``).

Why not a torch.distributed.checkpoint or torchft component: both copy whole state to storage or
to a peer on demand; neither keeps a rolling per-step replica with a replay log, which is what
lets a spare take over with at most zero steps lost.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from runner.planning.topology import Topology
from runner.recovery.common.hooks import ABANDON_AFTER_S, ReplicaLost
from runner.training.comm import CollectiveFailure
from runner.training.shard_state import (
    DIGEST_BYTES,
    LiveShard,
    ShardLayout,
    ShardPacker,
    ShardState,
    UpdateRecord,
    describe,
    digest,
    replay,
    unpack,
)
from runner.training.zero import ZeroOne

TAG_HEADER, TAG_LAYOUT, TAG_DATA = 0, 1, 2
TAG_DIGEST_OWN, TAG_DIGEST_REPLICA = 3, 4  # replay: an owner's digest to its holder; a holder's to the owner
REPLICATION_MODES = ("replay", "copy")
HEADER_BYTES = 32  # gen, shard bytes, layout bytes, whether the rest came in the same message (int64 each)
@dataclass
class _Slot:
    gen: int = -1  # -1: empty or being written
    layout: Optional[ShardLayout] = None
    data: Optional[Tensor] = None  # the shard's bytes: a view of ``buffer`` after the header
    buffer: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))


class ShardReplicator:
    def __init__(self, zero: ZeroOne, topology: Topology, timeout_s: float, *, mode: str,
                 verify_every_n_steps: int = 50) -> None:
        if mode not in REPLICATION_MODES:
            raise ValueError(f"replication mode {mode!r}: use one of {REPLICATION_MODES}")
        self.zero = zero
        self.topology = topology
        self.timeout_s = timeout_s
        self.mode = mode
        self.verify_every_n_steps = verify_every_n_steps
        self._live: Optional[LiveShard] = None  # replay: the partner's shard, kept current by its updates
        self._seeded_in = -1  # replay: the group generation whose seed (a full copy both ways) completed
        self.drifts: list[int] = []  # replay: the updates after which the replica held differed from its owner's shard
        self._partner_groups: list[int] = []  # the optimizer group of each parameter of the partner's shard
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deadpool-replicate")
        self._job: Optional[Future] = None
        self._before_payload: Callable[[], None] = lambda: None  # the comm's, before a shard's bytes are sent
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
        self.bytes_per_step = 0  # what a step sends once the replica is seeded: the shard (copy), nothing (replay)
        self.bytes_sent = 0  # everything this rank's replication sent: copies, seeds, digests

    # -- who backs up whom -----------------------------------------------------------------------
    def holder(self, logical_rank: int) -> int:
        return self.topology.replica_holder(logical_rank)

    def partner(self, logical_rank: int) -> int:
        return self.topology.replica_owner(logical_rank)

    def _shard_of(self, logical_rank: int) -> int:
        """The shard ``logical_rank`` owns in the plan of its DP group: its DP coordinate."""
        return self.topology.coords(logical_rank)[0]

    def _groups(self, logical_rank: int) -> list[int]:
        """The optimizer group of each parameter of ``logical_rank``'s shard, in its order (``replay``'s ``groups``)."""
        return [g for g, idx in enumerate(self.zero.plan.shard(self._shard_of(logical_rank))) for _ in idx]

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
        if not self._partner_groups:  # a process's logical rank, and so its partner, stays
            self._partner_groups = self._groups(self.partner(me))
        job = self._exchange if self.mode == "copy" else self._replay_step
        self._before_payload = comm.before_side_payload
        self._job = self._pool.submit(job, comm.side_pg, comm.gen, pg_of[self.holder(me)], pg_of[self.partner(me)],
                                      gen, self._epoch)

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
        """A full copy each way: this rank's shard to its holder, the partner's into a slot."""
        if pg is None:
            raise CollectiveFailure("no side group (aborted)")
        if self._group_gen != group_gen:  # a new group: the holder has nothing of ours yet
            self._group_gen, self._layout_sent = group_gen, b""
            self._expect_send = self._expect_recv = HEADER_BYTES
        sends = self._send_shard(pg, holder, gen)
        self._receive(pg, partner, epoch)
        self._sent(sends, epoch)

    def _send_shard(self, pg, holder: int, gen: int) -> tuple[list, int, int]:
        """Start sending this rank's shard: (the sends, the message's size, the shard's bytes).

        One message per copy once sizes settle: [header | layout if new | shard bytes], sent as
        one when the holder expects exactly its size (the size of the previous one), else the
        header goes first on its own (the first copy in a group, a new layout or shard size).
        A header message of its own cost a third of a small shard's exchange."""
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
        if combined:
            self._before_payload()
            return [self._send(pg, message, holder, TAG_HEADER)], message.numel(), layout.nbytes
        sends = [self._send(pg, message[:HEADER_BYTES], holder, TAG_HEADER)]
        if layout_bytes:
            sends.append(self._send(pg, message[HEADER_BYTES:HEADER_BYTES + len(layout_bytes)], holder, TAG_LAYOUT))
        self._before_payload()
        sends.append(self._send(pg, message[prefix:], holder, TAG_DATA))
        return sends, message.numel(), layout.nbytes

    def _send(self, pg, tensor: Tensor, dst: int, tag: int):
        self.bytes_sent += tensor.numel()
        return pg.send([tensor], dst, tag)

    def _sent(self, sends: tuple[list, int, int], epoch: int) -> None:
        """Wait for a copy's sends; the holder now has this layout and expects a message of this size."""
        works, size, nbytes = sends
        for work in works:
            work.wait()
        with self._lock:
            _still_current(epoch, self._epoch)
            self._layout_sent, self._expect_send = self._encoded, size
            self.bytes_per_step = nbytes if self.mode == "copy" else 0

    def _replay_step(self, pg, group_gen: int, holder: int, partner: int, gen: int, epoch: int) -> None:
        """Replay mode, after the update producing ``gen``: the first in a group generation seeds the replicas (a
        full copy each way); the others bring the partner's replica to ``gen`` locally, and every
        ``verify_every_n_steps`` compare digests with the owner and the holder, reseeding a replica that differs."""
        if self._seeded_in != group_gen:
            self._exchange(pg, group_gen, holder, partner, gen, epoch)
            with self._lock:
                _still_current(epoch, self._epoch)
                self._seeded_in = group_gen
            return
        with self._lock:
            _still_current(epoch, self._epoch)
            self._catch_up(gen)
        if pg is None:
            raise CollectiveFailure("no side group (aborted)")
        if gen % self.verify_every_n_steps:
            return
        mine = digest(self.zero.own_optimizer_params(), self.zero.optimizer)
        with self._lock:
            live = self._live
            held = live.digest() if live is not None and live.gen == gen else bytes(DIGEST_BYTES)
        sends = [self._send(pg, _bytes_tensor(mine), holder, TAG_DIGEST_OWN),
                 self._send(pg, _bytes_tensor(held), partner, TAG_DIGEST_REPLICA)]
        owners, holders = torch.empty(DIGEST_BYTES, dtype=torch.uint8), torch.empty(DIGEST_BYTES, dtype=torch.uint8)
        pg.recv([owners], partner, TAG_DIGEST_OWN).wait()
        pg.recv([holders], holder, TAG_DIGEST_REPLICA).wait()
        for work in sends:
            work.wait()
        copy_differs, replica_differs = holders.numpy().tobytes() != mine, owners.numpy().tobytes() != held
        # both ends of a pair compared the same two digests: the owner sends again exactly when its holder receives
        copy = self._send_shard(pg, holder, gen) if copy_differs else None
        if replica_differs:
            self._receive(pg, partner, epoch)
            with self._lock:
                _still_current(epoch, self._epoch)
                self.drifts.append(gen)
        if copy is not None:
            self._sent(copy, epoch)

    def _catch_up(self, gen: int) -> None:
        """Replay: the partner's recorded updates up to ``gen`` applied to its replica (under the lock, so that an
        abandonment never leaves a replica half-updated); the records applied are dropped."""
        live = self._live
        if live is None:
            raise ReplicaLost("no seeded replica of the partner's shard to replay its updates onto")
        for record in self._records:
            if live.gen < record.gen <= gen:
                live.apply(record)
        self._records = [r for r in self._records if r.gen > live.gen]

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
            if self.mode == "replay":  # the replica from now on: the slot was only its seed
                assert self._partner_layout is not None  # the first message of a group carries it
                self._live = LiveShard(self.zero.optimizer, unpack(self._partner_layout, slot.data, gen),
                                       self._partner_groups)
                slot.gen, slot.data, slot.buffer = -1, None, torch.empty(0, dtype=torch.uint8)

    def _newest(self) -> Optional[_Slot]:
        complete = [s for s in self._slots if s.gen >= 0]
        return max(complete, key=lambda s: s.gen) if complete else None

    # -- the holder's side: a replacement asks for its shard -------------------------------------
    def replica_of(self, partner: int, gen: int) -> ShardState:
        """The partner's shard after ``gen`` updates: a replica, plus a replay of the recorded updates it misses
        (``replayed_updates``: its ``gen - base_gen``)."""
        if self.mode == "replay":
            with self._lock:
                live = self._live
                if live is None or live.gen > gen:
                    held = "none" if live is None else f"one at update {live.gen}"
                    raise ReplicaLost(f"no replica of logical rank {partner}'s shard at or before update {gen} "
                                      f"(replica held: {held})")
                base = live.state(base_gen=live.gen)
        else:
            slot = max((s for s in self._slots if 0 <= s.gen <= gen), key=lambda s: s.gen, default=None)
            if slot is None:
                raise ReplicaLost(f"no complete replica of logical rank {partner}'s shard at or before update {gen} "
                                  f"(replicas held: {sorted(s.gen for s in self._slots if s.gen >= 0)})")
            assert slot.layout is not None and slot.data is not None  # a complete slot (gen >= 0) holds both
            base = unpack(slot.layout, slot.data, slot.gen)
        missing = [r for r in self._records if base.gen < r.gen <= gen]
        if [r.gen for r in missing] != list(range(base.gen + 1, gen + 1)):
            raise ReplicaLost(f"logical rank {partner}'s replica is at update {base.gen}, and the updates up to {gen} "
                              f"were not all recorded (have {[r.gen for r in self._records]})")
        if not missing:
            return base
        return replay(self.zero.optimizer, base, self._groups(partner), missing)

    def memory_bytes(self) -> int:
        """Host memory the replication holds: the send buffer, the replica slots, the replica kept current (replay)
        and the replay records."""
        slots = sum(s.buffer.numel() for s in self._slots)
        records = sum(g.numel() * g.element_size() for r in self._records for g in r.grads)
        live = self._live.nbytes() if self._live is not None else 0
        return self._packer.buffer.numel() + slots + records + live

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


def _still_current(epoch: int, current: int) -> None:
    if epoch != current:
        raise CollectiveFailure("abandoned: a recovery replaced the generation of this exchange")


def _bytes_tensor(raw: bytes) -> Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


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
