"""DP-SGD split over a torchrun job's workers (:mod:`fedsec.learning.workers`): Poisson
sampling across shards, and the privacy accounting a restarted worker resumes.

The mechanism is the one process's, step for step, so the accountant's ε is too:

- **Sampling.** The records are split into contiguous shards, one per rank. Every rank
  runs Opacus' own single-process sampler (``UniformWithReplacementSampler``, the
  generator seeded as one process seeds it) over all ``n`` record indices and keeps the
  indices in its shard: each record joins a step independently with rate q, from the
  very draw one process makes for it, so the union of the ranks' batches *is* the
  single-process Poisson batch (a rank reads only its own shard's records; the draw of
  ``n`` uniforms per step is what one process pays too).
- **Clipping and noise.** Each rank clips its records' per-sample gradients and sums
  them; the sums are all-reduced, and rank 0 alone adds σ·C Gaussian noise before the
  reduce, drawn from the CSPRNG streams one process draws with the same seed
  (:class:`~fedsec.learning.dp_noise.CsprngDistributedNoiseOptimizer`, Opacus'
  ``DistributedDPOptimizer`` shape); the sum is divided by the expected batch q·n.
- **Accounting.** Rank 0's checkpoint carries the accountant's history and the count of
  noise draws with the model, so a resumed job neither counts the redone steps twice
  nor gives a step another step's noise stream (a redone step draws its own stream
  again, for a result that replaces the discarded one): its ε is that of one run of
  all the steps.
"""

from __future__ import annotations

import bisect
from typing import Any, Final

import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.optimizers import DPOptimizer
from torch.utils.data import DataLoader, Sampler

from fedsec.errors import ConfigError
from fedsec.learning.dp_noise import CsprngDistributedPrivacyEngine, make_private
from fedsec.learning.training import DPParams

__all__ = [
    "ShardOfBatch",
    "accounting_state",
    "poisson_batches",
    "private_over_ranks",
    "restore_accounting",
    "shard_loader",
]

#: Checkpoint keys of the accounting: the accountant's (σ, q, steps) rows, float64
#: (exact for σ and q, and for step counts below 2^53), and rank 0's noise draws.
_HISTORY: Final = "dp.history"
_NOISE_DRAWS: Final = "dp.noise_draws"


class ShardOfBatch:
    """The indices of a sorted batch that fall in ``[lo, hi)``: a rank's shard."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        # contiguous shards whose sizes differ by at most one, the first ones larger
        size, extra = divmod(n, world)
        self.lo = rank * size + min(rank, extra)
        self.hi = self.lo + size + (1 if rank < extra else 0)

    def __call__(self, batch: list[int]) -> list[int]:
        return batch[bisect.bisect_left(batch, self.lo) : bisect.bisect_left(batch, self.hi)]


def poisson_batches(loader: DataLoader[Any]) -> DPDataLoader:
    """The loader one process trains on under DP-SGD: Opacus' Poisson-sampling copy of
    ``loader`` on its generator (never iterated here: its batch sampler and its
    empty-batch collate are what the ranks share)."""
    return DPDataLoader.from_data_loader(loader)


def shard_loader(poisson: DPDataLoader, batches: Sampler[list[int]]) -> DataLoader[Any]:
    """A loader of ``poisson``'s dataset, collate, workers and generator (the generator
    the sampler draws from, as in one process) reading the batches ``batches`` picks."""
    shard: DataLoader[Any] = DataLoader(
        poisson.dataset,
        batch_sampler=batches,
        collate_fn=poisson.collate_fn,
        num_workers=poisson.num_workers,
        pin_memory=poisson.pin_memory,
        multiprocessing_context=poisson.multiprocessing_context,
        generator=poisson.generator,
        prefetch_factor=poisson.prefetch_factor,
        persistent_workers=poisson.persistent_workers,
    )
    shard.sample_rate = poisson.sample_rate  # as Opacus' loader has
    return shard


def private_over_ranks(
    work: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader[Any],
    dp: DPParams,
    noise_seed: bytes,
) -> tuple[PrivacyEngine, torch.nn.Module, DPOptimizer]:
    """Opacus' private model (``DPDDP`` under the per-sample hooks) and distributed
    optimiser for ``work``, the noise from the CSPRNG; ``loader`` (already this rank's
    Poisson shard, see :func:`shard_loader`) is kept as it is.

    Raises:
        ConfigError: a model Opacus cannot train.
    """
    engine, trained, private, _ = make_private(
        CsprngDistributedPrivacyEngine,
        noise_seed,
        DPDDP(work),
        optimizer,
        loader,
        dp.noise_multiplier,
        dp.max_grad_norm,
        # the loader samples by Poisson already, across the shards; Opacus' own
        # distributed sampler draws each rank's shard from a generator of its own
        poisson_sampling=False,
    )
    return engine, trained, private


def accounting_state(engine: PrivacyEngine, optimizer: DPOptimizer) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the privacy accounting (see the module docstring)."""
    history = torch.tensor(engine.accountant.history, dtype=torch.float64).reshape(-1, 3)
    return {_HISTORY: history, _NOISE_DRAWS: torch.tensor(optimizer._noise_draws)}


def restore_accounting(
    engine: PrivacyEngine, optimizer: DPOptimizer, saved: dict[str, torch.Tensor], steps: int
) -> None:
    """Put a checkpoint's accounting back; ``saved`` empty: a job's start.

    Raises:
        ConfigError: a checkpoint whose accounting is not that of its ``steps``.
    """
    if not saved:
        return
    rows = [(float(s), float(q), int(t)) for s, q, t in saved[_HISTORY].tolist()]
    draws = int(saved[_NOISE_DRAWS].item())
    if sum(t for _, _, t in rows) != steps or draws != steps:
        raise ConfigError(
            f"checkpoint of step {steps} accounts for {sum(t for _, _, t in rows)} steps "
            f"and {draws} noise draws: refusing to resume from it"
        )
    engine.accountant.history = rows
    optimizer._noise_draws = draws
