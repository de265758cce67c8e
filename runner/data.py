"""Step-indexed data: the micro-batch of (step, logical rank) is a pure function of (seed, step, rank).

Any process can therefore produce exactly the batch another rank would have seen (a replacement,
an NDB neighbour), and the loader's position is derived from completed optimizer steps rather than
from a count of fetched batches (Lightning fetches ahead). With gradient accumulation one step's batch
is served as its ``MicroBatches``: micro-batch ``m`` of ``(step, rank)`` is a fixed slice of that batch,
so a (step, micro) pair names it and a recovery rolls back to a step boundary exactly. The held-out
split that validation reads (``HeldOutSplit``) is a fixed sequence of batches drawn from a seed stream
of its own (synthetic data) or from a separate token file (memmap).
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


HELD_OUT = 0x7E57  # seed-stream tag of the held-out batches (4-part seeds: never a training batch's 3-part one)


class BatchSource(Protocol):
    def batch(self, step: int, logical_rank: int) -> Any: ...


class MicroBatches(list):
    """The micro-batches of one optimizer step on one rank, in micro order (gradient accumulation)."""


class HeldOutSplit:
    """The first ``size`` held-out batches of a source with ``held_out(i)``: what validation reads."""

    def __init__(self, source: Any, size: int) -> None:
        self.source, self.size = source, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.source.held_out(i)


class TokenSource:
    """A source of token sequences, each batch drawn from a seed of (seed, step, rank): a subclass says how
    ``_sequences`` turns one seed into ``micro_batch`` rows of ``seq_len + 1`` tokens; the training batches,
    the held-out ones and the micro-batch split are the same for every such source."""

    seed: int

    def batch(self, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
        return _token_batch(self._sequences(derive_seed(self.seed, step, logical_rank)), step, logical_rank)

    def held_out(self, i: int) -> dict[str, torch.Tensor]:
        """Held-out batch ``i``: sequences from a seed stream no training batch draws from."""
        return _token_batch(self._sequences(derive_seed(self.seed, HELD_OUT, i, 0)), i, -1)

    def micro_batches(self, step: int, logical_rank: int, k: int) -> MicroBatches:
        return split_token_batch(self.batch(step, logical_rank), k)

    def _sequences(self, seed: int) -> torch.Tensor:
        raise NotImplementedError


class SyntheticTokens(TokenSource):
    """Token sequences from a fixed random sparse Markov chain: learnable, so the loss falls.

    Each token has ``branching`` likely successors drawn from the seed; sequences start at a random
    token. The entropy floor is about log(branching) nats.
    """

    def __init__(self, seed: int, vocab_size: int, seq_len: int, micro_batch: int, branching: int = 4) -> None:
        self.seed, self.vocab, self.seq_len, self.micro_batch = seed, vocab_size, seq_len, micro_batch
        g = torch.Generator().manual_seed(derive_seed(seed, 0xC0FFEE))
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)

    def _sequences(self, seed: int) -> torch.Tensor:
        """The random draws in torch (they fix the data), the walk along the chain in numpy: one indexing per
        position, several times cheaper there than a torch op, the same integers."""
        g = torch.Generator().manual_seed(seed)
        n, t = self.micro_batch, self.seq_len + 1
        choice = torch.randint(0, self.successors.shape[1], (n, t), generator=g).numpy()
        seq = np.empty((n, t), dtype=np.int64)
        seq[:, 0] = torch.randint(0, self.vocab, (n,), generator=g).numpy()
        successors = self.successors.numpy()
        for i in range(1, t):
            seq[:, i] = successors[seq[:, i - 1], choice[:, i]]
        return torch.from_numpy(seq)


class MemmapTokens(TokenSource):
    """Random windows of a nanoGPT-style uint16 token file, positions drawn from (seed, step, rank).

    Validation reads a separate file (``data.val_path``, nanoGPT's val.bin) through a second instance's
    ``held_out``: carving a tail off the training file would change which windows training draws."""

    def __init__(self, path: str, seed: int, seq_len: int, micro_batch: int, vocab_size: int) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.path={path!r} does not exist; point it at a uint16 token .bin file.")
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"data.path={path!r} holds {len(self.tokens)} tokens, fewer than seq_len+1={seq_len + 1}.")
        if int(self.tokens.max()) >= vocab_size:
            raise ValueError(f"data.path={path!r} holds token ids >= model.vocab_size={vocab_size}; raise vocab_size.")
        self.seed, self.seq_len, self.micro_batch = seed, seq_len, micro_batch

    def _sequences(self, seed: int) -> torch.Tensor:
        """Windows of this file at positions drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.micro_batch,), generator=g)
        rows = [torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64)) for s in starts.tolist()]
        return torch.stack(rows)


class IndexedDatasetSource:
    """Any map-style dataset under the same contract: rows of (step, rank) are fixed index ranges."""

    def __init__(self, dataset: Any, micro_batch: int, dp_size: int, collate: Callable[[list], Any]) -> None:
        self.dataset, self.micro_batch, self.dp_size, self.collate = dataset, micro_batch, dp_size, collate

    def batch(self, step: int, logical_rank: int) -> Any:
        return self.collate(self._rows(step, logical_rank, 0, self.micro_batch))

    def micro_batches(self, step: int, logical_rank: int, k: int) -> MicroBatches:
        """The rows of ``batch(step, logical_rank)`` in ``k`` equal slices, each collated on its own."""
        size = self.micro_batch // k
        return MicroBatches(self.collate(self._rows(step, logical_rank, m * size, size)) for m in range(k))

    def _rows(self, step: int, logical_rank: int, first: int, count: int) -> list:
        base = (step * self.dp_size + logical_rank) * self.micro_batch + first
        n = len(self.dataset)
        return [self.dataset[(base + i) % n] for i in range(count)]


def split_token_batch(batch: dict[str, torch.Tensor], k: int) -> MicroBatches:
    """A token batch's rows in ``k`` equal micro-batches; each keeps the batch's (step, rank) sample id."""
    return MicroBatches({"idx": idx, "targets": targets, "sample": batch["sample"]}
                        for idx, targets in zip(batch["idx"].chunk(k), batch["targets"].chunk(k)))


def _token_batch(seq: torch.Tensor, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous(),
            "sample": torch.tensor([step, logical_rank])}


class StepLoader:
    """An endless iterable whose position is read from the trainer each time iteration starts.

    ``start_step`` returns the number of committed optimizer steps and ``logical_rank`` the rank
    this process currently computes; both are asked at ``iter()`` time, after any restore. With
    ``accumulate`` > 1 (the strategy sets it) each step's item is the step's ``MicroBatches``.
    """

    def __init__(self, source: BatchSource, start_step: Callable[[], int], logical_rank: Callable[[], int]) -> None:
        self.source, self.start_step, self.logical_rank = source, start_step, logical_rank
        self.accumulate = 1

    def __iter__(self) -> Iterator[Any]:
        step = self.start_step()
        while True:
            if self.accumulate > 1:
                yield self.source.micro_batches(step, self.logical_rank(), self.accumulate)  # type: ignore[attr-defined]
            else:
                yield self.source.batch(step, self.logical_rank())
            step += 1
