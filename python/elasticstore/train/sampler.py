"""ElasticDistributedSampler: a DistributedSampler that resumes exactly at any world size."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

__all__ = ["ElasticDistributedSampler"]

_STATE_KEYS = ("epoch", "samples_consumed", "dataset_size", "seed", "shuffle")


def _world_from_env(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """World size and rank: as given, else from the default process group, else RANK/WORLD_SIZE."""
    if num_replicas is not None and rank is not None:
        return num_replicas, rank
    if dist.is_available() and dist.is_initialized():
        world, own = dist.get_world_size(), dist.get_rank()
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        try:
            world, own = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        except ValueError as err:
            raise ValueError(
                f"RANK={os.environ['RANK']!r} / WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the "
                "environment are not integers"
            ) from err
    else:
        raise RuntimeError(
            "ElasticDistributedSampler: num_replicas and rank were not given, no process group is "
            "initialised, and RANK / WORLD_SIZE are not set (run under torchrun or "
            "elasticstore-run, or pass num_replicas= and rank=)"
        )
    return (world if num_replicas is None else num_replicas), (own if rank is None else rank)


class ElasticDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` whose order does not depend on the world size.

    Contract. For a given ``seed`` and epoch the global order is one fixed permutation of the
    dataset (``torch.randperm(len(dataset))`` seeded with ``seed + epoch``, as
    ``DistributedSampler`` draws it; ``range(len(dataset))`` without ``shuffle``), the same for
    every world size. Rank ``r`` of ``W`` starting at global position ``s`` yields
    ``order[s + r :: W]``, padded (by repeating ``order[s:]`` from its start) to
    ``ceil((N - s) / W)`` samples, or cut to ``(N - s) // W`` with ``drop_last``, exactly as
    ``DistributedSampler`` pads or cuts the whole order. With ``s = 0`` it yields what
    ``DistributedSampler`` yields. Resuming with ``s`` = the samples consumed globally so far in the
    epoch is therefore exact at any world size: no sample seen twice, none skipped (beyond the
    padding of the last step, which ``DistributedSampler`` adds too).

    State. ``state_dict()`` holds the epoch and the samples consumed globally, counted from what the
    training loop *finished*: the loop calls ``sampler.advance(n)`` after each step with the number
    of samples this rank finished (its batch size). A ``DataLoader`` with workers pulls indices from
    the sampler ahead of the loop (``prefetch_factor * num_workers`` batches), so counting what the
    sampler handed out would skip the prefetched batches on resume; ``advance`` counts what the loop
    used. Every rank finishes the same number of samples per step, so ``start + W * finished`` is
    the global count, and any rank's ``state_dict()`` is the job's.

    The iterator returned by ``iter(sampler)`` is itself stateful
    (``state_dict``/``load_state_dict``, counting what it handed out): torchdata's
    ``StatefulDataLoader`` snapshots it at the batch the loop received, so with that loader
    ``loader.state_dict()`` is right without ``advance``.

    ``start_index`` (the samples consumed globally so far) applies to the epoch current at the first
    ``iter(sampler)`` (or, after ``load_state_dict``, to the saved epoch); any other epoch starts at
    0. ``set_epoch`` changes the epoch only, as ``DistributedSampler``'s does.

    Typical loop::

        sampler = ElasticDistributedSampler(dataset, seed=seed)
        if checkpoint: sampler.load_state_dict(checkpoint["sampler"])
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for batch in DataLoader(dataset, batch_size=b, sampler=sampler, num_workers=2):
                ...train step...
                sampler.advance(len(batch))       # the samples this rank finished
                if time_to_save: save_checkpoint(dir, {"sampler": sampler.state_dict(), ...}, step)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start_index: int = 0,
    ) -> None:
        world, own = _world_from_env(num_replicas, rank)
        if world < 1:
            raise ValueError(f"num_replicas must be >= 1, not {world}")
        if not 0 <= own < world:
            raise ValueError(f"rank must be in [0, {world}), not {own}")
        size = len(dataset)
        if not 0 <= start_index <= size:
            raise ValueError(
                f"start_index must be in [0, {size}] (the dataset size), not {start_index}"
            )
        super().__init__(dataset, world, own, shuffle, seed, drop_last)  # type: ignore[arg-type]
        self.dataset_size = size
        self._start_index = start_index
        self._start_epoch: int | None = None  # bound at the first iter() (or by load_state_dict)
        # The pass in progress (the latest iter()): its epoch and start, what the loop finished.
        self._pass_epoch: int | None = None
        self._pass_start = 0
        self._finished = 0
        self._refresh_lengths(self._start_for(self.epoch))

    # -- the contract ----------------------------------------------------------------------------

    def _start_for(self, epoch: int) -> int:
        if self._start_epoch is None or self._start_epoch == epoch:
            return self._start_index
        return 0

    def _count(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def _refresh_lengths(self, start: int) -> None:
        self.num_samples = self._count(self.dataset_size - start)
        self.total_size = self.num_samples * self.num_replicas

    def global_order(self, epoch: int | None = None) -> list[int]:
        """The epoch's permutation of the dataset (the same for every world size)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.dataset_size))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=g).tolist()

    def indices(self, epoch: int, start: int) -> list[int]:
        """What this rank yields for ``epoch`` from global position ``start``."""
        remaining = self.global_order(epoch)[start:]
        total = self._count(len(remaining)) * self.num_replicas
        if total > len(remaining):  # pad by repeating remaining from its start
            padding = total - len(remaining)
            remaining += (remaining * math.ceil(padding / len(remaining)))[:padding]
        return remaining[self.rank : total : self.num_replicas]

    # -- DistributedSampler ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self._start_epoch is None:
            self._start_epoch = self.epoch
        return _ElasticIterator(self, self.epoch, self._start_for(self.epoch))

    def __len__(self) -> int:
        return self._count(self.dataset_size - self._start_for(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._refresh_lengths(self._start_for(epoch))

    # -- state -------------------------------------------------------------------------------------

    def _begin_pass(self, epoch: int, start: int) -> None:
        self._pass_epoch, self._pass_start, self._finished = epoch, start, 0
        self._refresh_lengths(start)

    def advance(self, n: int) -> None:
        """Records that the training loop finished ``n`` more samples on this rank."""
        if n < 0:
            raise ValueError(f"n must be >= 0 (samples finished on this rank), not {n}")
        if self._pass_epoch is None:
            raise RuntimeError("advance() before iter(sampler): no pass is in progress")
        self._finished += n

    @property
    def samples_consumed(self) -> int:
        """The samples consumed globally in the current epoch, as the loop reported them."""
        if self._pass_epoch != self.epoch:
            return self._start_for(self.epoch)
        consumed = self._pass_start + self.num_replicas * self._finished
        return min(consumed, self.dataset_size)

    def state_dict(self) -> dict[str, Any]:
        """``epoch`` and ``samples_consumed`` (global, from ``advance``), plus what must match."""
        return {
            "epoch": self.epoch,
            "samples_consumed": self.samples_consumed,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes at ``state``'s epoch and position; the next ``iter()`` starts there."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"state is not a sampler state: missing {', '.join(missing)}")
        for key, own in (("dataset_size", self.dataset_size), ("seed", self.seed),
                         ("shuffle", self.shuffle)):
            if state[key] != own:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, this sampler has {own!r}: "
                    "the order would differ, so resuming would not be exact"
                )
        consumed = int(state["samples_consumed"])
        if not 0 <= consumed <= self.dataset_size:
            raise ValueError(
                f"state's samples_consumed {consumed} is not in [0, {self.dataset_size}]"
            )
        self.epoch = int(state["epoch"])
        self._start_index, self._start_epoch = consumed, self.epoch
        self._pass_epoch = None
        self._refresh_lengths(consumed)


class _ElasticIterator(Iterator[int]):
    """One pass of the sampler; stateful (what it handed out), for torchdata's loader."""

    def __init__(self, sampler: ElasticDistributedSampler, epoch: int, start: int) -> None:
        self._sampler = sampler
        self._reset(epoch, start)

    def _reset(self, epoch: int, start: int) -> None:
        self._epoch, self._start = epoch, start
        self._indices = self._sampler.indices(epoch, start)
        self._yielded = 0
        self._sampler._begin_pass(epoch, start)

    def __iter__(self) -> _ElasticIterator:
        return self

    def __next__(self) -> int:
        if self._yielded >= len(self._indices):
            raise StopIteration
        index = self._indices[self._yielded]
        self._yielded += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        consumed = self._start + self._sampler.num_replicas * self._yielded
        state = self._sampler.state_dict()
        state.update(epoch=self._epoch, samples_consumed=min(consumed, self._sampler.dataset_size))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sampler.load_state_dict(state)
        self._reset(self._sampler.epoch, int(state["samples_consumed"]))
