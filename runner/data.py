"""Step-indexed data: the micro-batch of (step, logical rank) is a pure function of (seed, step, rank).

Any process can therefore produce exactly the batch another rank would have seen (a replacement,
an NDB neighbour), and the loader's position is derived from completed optimizer steps rather than
from a count of fetched batches (Lightning fetches ahead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and Python versions."""
    digest = hashlib.blake2b(b"/".join(str(int(p)).encode() for p in parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from: the CPU's, and the GPUs' when it runs on one.

    Not ``torch.manual_seed``: without an initialised GPU it queues a lazy seed for every
    accelerator backend together with a formatted stack trace, about 12% of a small model's step.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


class BatchSource(Protocol):
    def batch(self, step: int, logical_rank: int) -> Any: ...


class SyntheticTokens:
    """Token sequences from a fixed random sparse Markov chain: learnable, so the loss falls.

    Each token has ``branching`` likely successors drawn from the seed; sequences start at a random
    token. The entropy floor is about log(branching) nats.
    """

    def __init__(self, seed: int, vocab_size: int, seq_len: int, micro_batch: int, branching: int = 4) -> None:
        self.seed, self.vocab, self.seq_len, self.micro_batch = seed, vocab_size, seq_len, micro_batch
        g = torch.Generator().manual_seed(derive_seed(seed, 0xC0FFEE))
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    def batch(self, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, step, logical_rank))
        n, t = self.micro_batch, self.seq_len + 1
        choice = torch.randint(0, self.successors.shape[1], (n, t), generator=g)
        seq = torch.empty(n, t, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for i in range(1, t):
            seq[:, i] = self.successors[seq[:, i - 1], choice[:, i]]
        return _token_batch(seq, step, logical_rank)


class MemmapTokens:
    """Random windows of a nanoGPT-style uint16 token file, positions drawn from (seed, step, rank)."""

    def __init__(self, path: str, seed: int, seq_len: int, micro_batch: int, vocab_size: int) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.path={path!r} does not exist; point it at a uint16 token .bin file.")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"data.path={path!r} holds {len(self.tokens)} tokens, fewer than seq_len+1={seq_len + 1}.")
        if int(self.tokens.max()) >= vocab_size:
            raise ValueError(f"data.path={path!r} holds token ids >= model.vocab_size={vocab_size}; raise vocab_size.")
        self.seed, self.seq_len, self.micro_batch = seed, seq_len, micro_batch

    def batch(self, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(derive_seed(self.seed, step, logical_rank))
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.micro_batch,), generator=g)
        rows = [torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64)) for s in starts.tolist()]
        return _token_batch(torch.stack(rows), step, logical_rank)


class IndexedDatasetSource:
    """Any map-style dataset under the same contract: rows of (step, rank) are fixed index ranges."""

    def __init__(self, dataset: Any, micro_batch: int, dp_size: int, collate: Callable[[list], Any]) -> None:
        self.dataset, self.micro_batch, self.dp_size, self.collate = dataset, micro_batch, dp_size, collate

    def batch(self, step: int, logical_rank: int) -> Any:
        base = (step * self.dp_size + logical_rank) * self.micro_batch
        n = len(self.dataset)
        return self.collate([self.dataset[(base + i) % n] for i in range(self.micro_batch)])


def _token_batch(seq: torch.Tensor, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous(),
            "sample": torch.tensor([step, logical_rank])}


class StepLoader:
    """An endless iterable whose position is read from the trainer each time iteration starts.

    ``start_step`` returns the number of committed optimizer steps and ``logical_rank`` the rank
    this process currently computes; both are asked at ``iter()`` time, after any restore.
    """

    def __init__(self, source: BatchSource, start_step: Callable[[], int], logical_rank: Callable[[], int]) -> None:
        self.source, self.start_step, self.logical_rank = source, start_step, logical_rank

    def __iter__(self) -> Iterator[Any]:
        step = self.start_step()
        while True:
            yield self.source.batch(step, self.logical_rank())
            step += 1
