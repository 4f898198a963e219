"""Which rows go in which micro-batch: an epoch's batches of row indices, and one rank's share of them.

Every rank computes the same batches from the job's seed and the epoch (no communication), then takes
its share (``rank_share``), so all ranks step the same number of times.
"""

from __future__ import annotations

import math

from hamo_ray.training.contracts import StageJob


def make_batches(lengths: list[int], job: StageJob, epoch: int) -> list[list[int]]:
    """The epoch's micro-batches of example indices: packed to the token budget, or length-bucketed."""
    from hamo_ray.training.examples import length_bucketed_batches
    from hamo_ray.training.packing import pack_batches

    if job.spec.packed:
        return pack_batches(lengths, job.pack_tokens, job.seed, epoch, job.bucket_pool)
    return length_bucketed_batches(lengths, job.batch_size, job.seed, epoch, job.bucket_pool)


def rank_share(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This rank's batches; every rank gets the same count (collectives must match), repeating if short."""
    per_rank = math.ceil(len(batches) / world)
    mine = batches[rank::world][:per_rank]
    while len(mine) < per_rank:
        mine.append(batches[len(mine) % len(batches)])
    return mine
