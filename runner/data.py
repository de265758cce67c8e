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
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler


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


SHUFFLE = 0x5EED  # seed-stream tag of the epoch permutations of a shuffling DataLoader with no seed of its own
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
    """Any map-style dataset under the same contract, in epochs: an epoch is ``steps_per_epoch`` steps of
    ``dp_size * micro_batch`` rows (the rows that do not fill a step are left out, DataLoader's ``drop_last``), and
    the rows of (step, rank) are a fixed range of the epoch's order. That order is the dataset's own, or with
    ``shuffle_seed`` the permutation ``torch.randperm(len(dataset))`` draws from a generator seeded with
    ``shuffle_seed + epoch`` (the one torch's DistributedSampler draws): a pure function of the step, so a
    replacement, a restored rank and a neighbour serve the same rows at every position of every epoch."""

    def __init__(self, dataset: Any, micro_batch: int, dp_size: int, collate: Callable[[list], Any],
                 shuffle_seed: int | None = None) -> None:
        self.dataset, self.micro_batch, self.dp_size, self.collate = dataset, micro_batch, dp_size, collate
        self.shuffle_seed = shuffle_seed
        self.steps_per_epoch = steps_per_epoch(len(dataset), micro_batch * dp_size)
        self._order: tuple[int, list[int]] = (-1, [])  # the last epoch's permutation (consecutive steps share it)

    def batch(self, step: int, logical_rank: int) -> Any:
        return self.collate(self._rows(step, logical_rank, 0, self.micro_batch))

    def micro_batches(self, step: int, logical_rank: int, k: int) -> MicroBatches:
        """The rows of ``batch(step, logical_rank)`` in ``k`` equal slices, each collated on its own."""
        size = self.micro_batch // k
        return MicroBatches(self.collate(self._rows(step, logical_rank, m * size, size)) for m in range(k))

    def epoch_order(self, epoch: int) -> list[int] | None:
        """The dataset indices of ``epoch`` in the order its steps read them; None: the dataset's own order."""
        if self.shuffle_seed is None:
            return None
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.shuffle_seed + epoch)
            self._order = (epoch, torch.randperm(len(self.dataset), generator=g).tolist())
        return self._order[1]

    def _rows(self, step: int, logical_rank: int, first: int, count: int) -> list:
        epoch, within = divmod(step, self.steps_per_epoch)
        base = (within * self.dp_size + logical_rank) * self.micro_batch + first
        order = self.epoch_order(epoch)
        return [self.dataset[p if order is None else order[p]] for p in range(base, base + count)]


def steps_per_epoch(rows: int, global_batch: int) -> int:
    """Optimizer steps in one pass over ``rows`` samples, ``global_batch`` a step, an incomplete last step left out
    (``drop_last``): what ``trainer.max_epochs`` counts, and what a fraction of an epoch is a fraction of."""
    steps = rows // global_batch
    if steps == 0:
        raise ValueError(f"The training dataset holds {rows} samples, fewer than one step's "
                         f"trainer.global_batch_size={global_batch}; lower trainer.global_batch_size or use more data.")
    return steps


def shuffle_seed(dataloader: Any, seed: int) -> int | None:
    """The seed of the epoch permutations (``IndexedDatasetSource``) a user's DataLoader asks for with its sampler;
    None: the dataset's own order. A DistributedSampler's permutations are its own (its ``seed``; its rank and
    replica count are the runner's); a RandomSampler has no seed to reproduce, so the run's ``seed`` draws them.
    Any other sampler would be ignored, so it is refused."""
    sampler = getattr(dataloader, "sampler", None)
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        raise TypeError(f"The training DataLoader's batch_sampler is a {type(batch_sampler).__name__}; the runner "
                        "decides which rows each (step, rank) reads, in epochs of the dataset's order or of a "
                        "permutation per epoch, so it can only follow shuffle=True/False, a RandomSampler or a "
                        "DistributedSampler. Pass one of those, or return a runner.data.StepLoader of your own.")
    if sampler is None or type(sampler) is SequentialSampler:
        return None
    if type(sampler) is DistributedSampler:
        return sampler.seed if sampler.shuffle else None
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return derive_seed(seed, SHUFFLE)
    raise TypeError(f"The training DataLoader's sampler is a {type(sampler).__name__} (or a RandomSampler with "
                    "replacement or num_samples); the runner decides which rows each (step, rank) reads, in epochs "
                    "of the dataset's order or of a permutation per epoch, so it can only follow shuffle=True/False, "
                    "a RandomSampler or a DistributedSampler. Pass one of those, or return a runner.data.StepLoader "
                    "of your own.")


def split_token_batch(batch: dict[str, torch.Tensor], k: int) -> MicroBatches:
    """A token batch's rows in ``k`` equal micro-batches; each keeps the batch's (step, rank) sample id."""
    return MicroBatches({"idx": idx, "targets": targets, "sample": batch["sample"]}
                        for idx, targets in zip(batch["idx"].chunk(k), batch["targets"].chunk(k)))


def _token_batch(seq: torch.Tensor, step: int, logical_rank: int) -> dict[str, torch.Tensor]:
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous(),
            "sample": torch.tensor([step, logical_rank])}


class StepLoader:
    """An iterable whose position is read from the trainer each time iteration starts.

    ``start_step`` returns the number of committed optimizer steps and ``logical_rank`` the rank
    this process currently computes; both are asked at ``iter()`` time, after any restore. With
    ``accumulate`` > 1 (the strategy sets it) each step's item is the step's ``MicroBatches``.

    Endless by default. With ``steps_per_epoch`` it is one epoch long (``len``) and an iteration runs from the
    committed step to the end of that step's epoch, so a rank restored or replaced mid-epoch finishes the same epoch
    and Lightning's fit loop ends each epoch where every other rank does. ``sampler`` is the user's sampler, for
    Lightning to call its ``set_epoch`` at each epoch start as it does for its own loaders.
    """

    def __init__(self, source: BatchSource, start_step: Callable[[], int], logical_rank: Callable[[], int],
                 steps_per_epoch: int | None = None, sampler: Any = None) -> None:
        self.source, self.start_step, self.logical_rank = source, start_step, logical_rank
        self.steps_per_epoch, self.sampler = steps_per_epoch, sampler
        self.accumulate = 1

    def __len__(self) -> int:
        if self.steps_per_epoch is None:
            raise TypeError("an endless StepLoader has no length")
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        step = self.start_step()
        end = None if self.steps_per_epoch is None else (step // self.steps_per_epoch + 1) * self.steps_per_epoch
        while end is None or step < end:
            if self.accumulate > 1:
                yield self.source.micro_batches(step, self.logical_rank(), self.accumulate)  # type: ignore[attr-defined]
            else:
                yield self.source.batch(step, self.logical_rank())
            step += 1

    def state_dict(self) -> dict:
        """Resumable (Lightning asks, mid-epoch): the position is the trainer's committed step, nothing to keep."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: ``__iter__`` starts at the restored committed step."""
