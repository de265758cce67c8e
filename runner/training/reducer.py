"""A step's gradient all-reduce: buckets, launched while backward still runs where that is safe.

Buckets hold the trainable parameters in reverse registration order (about the order in which
autograd produces their gradients), one dtype per bucket, about ``bucket_bytes`` each. Gradients
are copied into the buckets and ``.grad`` is left alone until the reduction succeeded, so a step
whose reduction failed is retried from the intact local gradients after a regroup.

Overlap: ``arm()`` just before the step's own backward. Each parameter's post-accumulate-grad
hook then counts it ready, and a bucket whose gradients are all ready is copied and its all-reduce
launched at once, in bucket order, so every rank launches the same collectives in the same order
(gloo matches them by order). ``reduce()`` launches what backward did not (buckets with a
parameter that got no gradient), waits for everything and disarms. A reduction that is not armed
(a retry after a regroup, the corruption guard's recompute, a step with NDB micro-batches taken
over) copies and launches every bucket in ``reduce()`` instead; both produce the same collectives
on the same buffers, so a retried step sums exactly what the fault-free step would have.

Group: the world's, or with tensor parallelism the rank's DP group (``Comm.launch_reduction``): the
TP ranks of a replica hold different slices, and each slice is summed only with its copies.

Accounting: the step's accounting vector (one count per logical rank, the loss sum, a misplaced
flag) is filled in just before its bucket is launched and rides at the end of the last float32 or
float64 bucket, where counts stay exact (below 2**24), so it needs no collective of its own. A
model without such a bucket (bf16 weights) gets a float64 bucket holding only the accounting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from runner.training.comm import Comm

_EXACT_COUNTS = (torch.float32, torch.float64)  # dtypes that can carry the accounting


class _Bucket:
    def __init__(self, params: list[Tensor], dtype: torch.dtype, device: torch.device, slot: int) -> None:
        n = sum(p.numel() for p in params)
        self.params = params
        self.flat = torch.zeros(n + slot, dtype=dtype, device=device)
        self.grads = self.flat[:n]
        self.accounting = self.flat[n:] if slot else None
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.waiting = 0  # armed: parameters of this bucket whose gradient backward has not produced yet

    def fill(self) -> None:
        """Copy the local gradients in (zeros for a parameter without one)."""
        pairs = [(v, p.grad) for v, p in zip(self.views, self.params) if p.grad is not None]
        if len(pairs) < len(self.params):
            self.grads.zero_()
        if pairs:
            torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])


class GradReducer:
    def __init__(self, comm: Comm, module: torch.nn.Module, bucket_bytes: int, accounting_size: int,
                 accounting: Callable[[], Tensor]) -> None:
        """``accounting()`` returns this step's accounting vector (``accounting_size`` entries)."""
        self.comm, self.accounting = comm, accounting
        self.buckets = _make_buckets(trainable_params(module)[::-1], bucket_bytes, accounting_size, comm.device)
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        self._armed = False
        self._next = 0  # the next bucket to launch
        self.launch_s = 0.0  # this step's time inside the launches (the sending side of this rank's links)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda _, b=bucket: self._ready(b))

    def arm(self) -> None:
        """Launch each bucket as soon as the coming backward has produced its gradients."""
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
        self._next = 0
        self.launch_s = 0.0
        self._armed = True

    def disarm(self) -> None:
        """Something other than the step's own backward comes first (a regroup): reduce after it."""
        self._armed = False

    def reduce(self) -> tuple[list[Tensor], Tensor]:
        """Sum this step's gradients and accounting over the group: (one gradient sum per bucket,
        the accounting sum). Raises ``CollectiveFailure`` with nothing left in flight."""
        if not self._armed:
            self._next = 0
            self.launch_s = 0.0
        self._armed = False
        while self._next < len(self.buckets):
            self._launch_next()
        self.comm.wait_reduction()
        accounting = next(b.accounting for b in self.buckets if b.accounting is not None)
        return [b.grads for b in self.buckets if b.params], accounting

    def write_back(self, dp: int, divisor: Optional[Callable[[Tensor], int]] = None) -> None:
        """Sums -> means into ``.grad``: by ``dp``, or per parameter by ``divisor(p)`` (NDB)."""
        for bucket in self.buckets:
            if divisor is None:
                bucket.grads.div_(dp)
            else:
                for p, view in zip(bucket.params, bucket.views):
                    view.div_(divisor(p))
            have = [(p.grad, v) for p, v in zip(bucket.params, bucket.views) if p.grad is not None]
            if have:
                torch._foreach_copy_([g for g, _ in have], [v for _, v in have])
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    p.grad = view.clone()

    def _ready(self, bucket: _Bucket) -> None:
        """Post-accumulate-grad hook: runs inside backward, so it never raises (``Comm.launch``)."""
        if not self._armed:
            return
        bucket.waiting -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self._next]
        self._next += 1
        bucket.fill()
        if bucket.accounting is not None:
            bucket.accounting.copy_(self.accounting())
        t0 = time.perf_counter()
        self.comm.launch_reduction(lambda pg: pg.allreduce([bucket.flat], self._opts))
        self.launch_s += time.perf_counter() - t0


def trainable_params(module: torch.nn.Module) -> list[Tensor]:
    """Trainable parameters in registration order, each once (tied weights appear once)."""
    once = {id(p): p for p in module.parameters() if p.requires_grad}  # a dict keeps each id's first position
    return list(once.values())


def _make_buckets(params: list[Tensor], bucket_bytes: int, accounting_size: int,
                  device: torch.device) -> list[_Bucket]:
    """Consecutive parameters of one dtype, about ``bucket_bytes`` per bucket; the accounting slot
    goes to the last bucket whose dtype keeps counts exact, or to a float64 bucket of its own."""
    groups: list[list[Tensor]] = []
    size = 0
    for p in params:
        if not groups or p.dtype != groups[-1][0].dtype or size + p.numel() * p.element_size() > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    carrier = max((i for i, g in enumerate(groups) if g[0].dtype in _EXACT_COUNTS), default=None)
    buckets = [_Bucket(g, g[0].dtype, g[0].device, accounting_size if i == carrier else 0)
               for i, g in enumerate(groups)]
    if carrier is None:
        buckets.append(_Bucket([], torch.float64, device, accounting_size))
    return buckets
