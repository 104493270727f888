"""The process groups megarl passes explicitly at its boundaries, built once per layout.

    groups = megarl.parallel.groups()        # after megarl.parallel.initialize(...)
    groups.mcore.tp, groups.mcore.dp, ...    # megatron-core's ProcessGroupCollection (what GPTModel / DDP accept)
    groups.replica, groups.leaders           # the ranks that train the same rows; who receives them for the replica

megatron-core's collection has no group for "the ranks of one data-parallel rank" (TP x CP x PP, the ranks that read
the same samples), which is what rollout data moves over: that one is built here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    mcore: object  # megatron.core.process_groups_config.ProcessGroupCollection
    replica: object  # ProcessGroup of the ranks with this rank's DP rank (TP x CP x PP), None when that is one rank
    leaders: tuple[int, ...]  # per DP rank, the global rank that receives the replica's rows (its lowest rank)
    dp_rank: int
    dp_size: int

    @property
    def leader(self) -> int:
        return self.leaders[self.dp_rank]


def build_groups(mcore) -> Groups:
    """megarl's groups around megatron-core's ProcessGroupCollection `mcore`. A collective over the world: call it on
    every rank."""
    dp_rank, dp_size = mcore.dp.rank(), mcore.dp.size()
    everyone = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor([dp_rank]))
    members = [[r for r, d in enumerate(everyone) if int(d) == k] for k in range(dp_size)]
    replica = None
    for ranks in members:  # every rank creates every group, in the same order (torch.distributed requires it)
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if dist.get_rank() in ranks:
            replica = group
    return Groups(mcore=mcore, replica=replica, leaders=tuple(m[0] for m in members), dp_rank=dp_rank,
                  dp_size=dp_size)
