"""The data loaders every datamodule gives (LMDataModule, MQARDataModule, ImageDataModule): an endless,
resumable shuffled stream for training, and plain ordered passes for evaluation."""

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class EpochShuffleSampler(Sampler[int]):
    """Endless stream of per-epoch permutations, a pure function of (seed, position): training can
    resume at any sample with `start` and sees exactly the data an uninterrupted run would.
    With several processes, rank r takes every world_size-th sample of the one global stream."""

    def __init__(self, n: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.start, self.rank, self.world_size = n, seed, start, rank, world_size

    def _stream(self):
        epoch, offset = divmod(self.start, self.n)
        while True:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            yield from perm[offset:].tolist()
            epoch, offset = epoch + 1, 0

    def __iter__(self):
        for i, index in enumerate(self._stream()):
            if i % self.world_size == self.rank:
                yield index


def stream_loader(ds: Dataset, micro_batch_size: int, seed: int, samples_per_step: int, trainer):
    """The training loader of every datamodule: the endless shuffled stream of `EpochShuffleSampler`, from
    where the trainer is (on resume Lightning restores global_step before building loaders), this rank's
    share of it."""
    start = trainer.global_step * samples_per_step if trainer is not None else 0
    rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
    return loader(ds, micro_batch_size, EpochShuffleSampler(len(ds), seed, start, rank, world))


def loader(ds: Dataset, micro_batch_size: int, sampler: Sampler | None = None) -> DataLoader:
    """A DataLoader with a generator of its own: making its iterator draws a seed from it rather than from
    the global torch RNG, so a validation pass or a resume never shifts the RNG state that checkpoints keep
    (a run resumed at any step has the RNG states of an uninterrupted one)."""
    generator = torch.Generator().manual_seed(0)
    return DataLoader(ds, batch_size=micro_batch_size, sampler=sampler, generator=generator)
