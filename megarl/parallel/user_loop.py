"""The one adapter for users' own Megatron loops: megatron-core's groups as the collection megarl's functions take.

megarl's functions take their process groups as an argument (`pg`, megatron-core's ProcessGroupCollection). megarl's
own trainers pass megarl.parallel.groups().mcore. A loop of your own that set up megatron's global groups itself
(megatron.core.parallel_state.initialize_model_parallel, or megarl.parallel.initialize) calls this once and passes
the result on:

    pg = megarl.parallel.user_groups()
    bridge = ModelBridge(folder, pg=pg)
    loss_func = make_loss_func(micro_batch, cfg, num_microbatches=n, vocab_size=V, pg=pg)
"""
from __future__ import annotations


def user_groups():
    """megatron-core's ProcessGroupCollection of the groups megatron.core.parallel_state holds (its
    ProcessGroupCollection.use_mpu_process_groups()); raises when they are not initialised."""
    from ..compat.megatron import process_groups_from_parallel_state

    return process_groups_from_parallel_state()
