"""Building what a run trains: the model folder, the sharded policy wrapped in Megatron DDP, its optimizer and
learning-rate schedule (all megatron-core), and a frozen reference copy."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from .. import parallel, platform
from ..compat import megatron as megatron_compat
from ..config import ConfigError
from ..models import ModelBridge, open_model_folder, write_tiny_model
from .config import EnvConfig


def prepare_model_folder(cfg) -> str:
    """The HF folder of the run's model: model.path, or a tiny random model written once by rank 0."""
    if cfg.model.path:
        return open_model_folder(cfg.model.path).path  # validates the folder on every rank
    path = os.path.abspath(os.path.join(cfg.run_dir, "base-model"))
    if dist.get_rank() == 0 and not os.path.isfile(os.path.join(path, "config.json")):
        tiny = cfg.model.tiny
        tmp = f"{path}.tmp-{os.getpid()}"
        write_tiny_model(tmp, tiny.family, seed=tiny.seed, tokenizer=tiny.tokenizer, **tiny.overrides)
        os.replace(tmp, path)
    dist.barrier()
    return path


def init_parallel(cfg, model_path: str):
    folder = open_model_folder(model_path)
    parallel.initialize(cfg.parallel, folder.shape())
    return folder


def wrap_ddp(chunks: list, distributed_optimizer: bool = False, *, pg) -> list:
    """Megatron DDP around each chunk, with the config hooks the schedules call (grad sync, finalize); pg:
    megatron-core's ProcessGroupCollection the chunks were built on (ModelBridge.pg)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               use_distributed_optimizer=distributed_optimizer)
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0,
                                       pg_collection=pg) for i, c in enumerate(chunks)]
    config = chunks[0].config
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def make_optimizer(model: list, lr: float, min_lr: float, warmup_steps: int, decay_style: str, total_steps: int,
                   weight_decay: float = 0.0, betas=(0.9, 0.999), clip_grad: float = 1.0,
                   distributed: bool = False, *, pg):
    """megatron-core Adam (optionally the distributed optimizer) and its OptimizerParamScheduler, for the model built
    on pg (megatron-core's ProcessGroupCollection). megatron-core 0.19.2's optimizer cannot take pg itself: see
    megarl.compat.megatron.get_megatron_optimizer."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    on_gpu = platform.on_gpu()
    optimizer = megatron_compat.get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay, adam_beta1=betas[0],
        adam_beta2=betas[1], clip_grad=clip_grad, use_distributed_optimizer=distributed, bf16=on_gpu,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32), model, pg)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_steps else lr, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(total_steps, warmup_steps + 1), lr_decay_style=decay_style, start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")
    return optimizer, scheduler


@dataclass
class Policy:
    bridge: ModelBridge
    chunks: list  # the bare GPTModel chunks (export, checkpoints)
    model: list  # the DDP-wrapped chunks (schedules)
    optimizer: object
    scheduler: object


def resolve_load(cfg) -> str | None:
    """model.load, with "sft" meaning this run's SFT cold start (<run_dir>/sft/checkpoints)."""
    if cfg.model.load == "sft":
        return os.path.join(cfg.run_dir, "sft", "checkpoints")
    return cfg.model.load


def moe_config_overrides(cfg, folder) -> dict:
    """TransformerConfig fields the MoE RL options set (after checking the model has experts)."""
    options = {"rollout.routing_replay": cfg.rollout.routing_replay,
               "rollout.return_routed_experts": cfg.rollout.return_routed_experts,
               "model.moe_aux_loss_coeff": cfg.model.moe_aux_loss_coeff is not None,
               "model.freeze_router_bias": cfg.model.freeze_router_bias}
    if not folder.is_moe:
        if any(options.values()):
            on = [k for k, v in options.items() if v]
            raise ConfigError(f"{', '.join(on)} apply to MoE models; {folder.path} is dense ({folder.model_type}). "
                              "Fix: unset them or use an MoE model")
        return {}
    overrides = {}
    if cfg.rollout.routing_replay:
        overrides["moe_enable_routing_replay"] = True  # megatron-core RouterReplay in every router
    if cfg.model.moe_aux_loss_coeff is not None:
        overrides["moe_aux_loss_coeff"] = float(cfg.model.moe_aux_loss_coeff)
    if cfg.model.freeze_router_bias:
        overrides["moe_router_bias_update_rate"] = 0.0  # the aux-loss-free expert bias stays where it is
    return overrides


def build_policy(folder, optim, total_steps: int, load: str | None = None,
                 config_overrides: dict | None = None, lora=None, *, pg) -> Policy:
    """Sharded policy with the HF weights (or a megarl checkpoint's model weights when `load` is set), on the layout
    of pg (megatron-core's ProcessGroupCollection). optim None: weights only, for forward passes (`megarl eval`): no
    DDP wrapper, optimizer or schedule. lora (megarl.models.lora.LoraConfig): frozen base weights plus adapters (from
    lora.load, a PEFT folder, if set), added before DDP and the optimizer so those hold the adapters only."""
    from ..models.checkpoint import load_model_checkpoint
    from ..models.lora import apply_lora, checkpoint_has_adapters, load_peft

    bridge = ModelBridge(folder, config_overrides=config_overrides, pg=pg)
    chunks = bridge.build()
    adapters = False
    if load:
        ckpt = resolve_checkpoint(load)
        # A checkpoint of a LoRA run holds the adapters next to the frozen weights: they are added first so the load
        # reads them (a plain checkpoint, e.g. an SFT cold start, gets fresh adapters after). Loading one without
        # model.lora would silently drop its adapters. Its adapters are the run's state: model.lora.load is not read.
        if checkpoint_has_adapters(ckpt):
            if lora is None:
                raise ConfigError(f"model checkpoint {ckpt} holds LoRA adapters. Fix: set model.lora as in the run "
                                  "that wrote it")
            apply_lora(chunks, lora)
            adapters = True
        load_model_checkpoint(chunks, ckpt)
    else:
        bridge.load_hf_weights(chunks)
    if lora is not None and not adapters:
        apply_lora(chunks, lora)
        if lora.load:
            load_peft(lora.load, chunks, bridge, lora)
    if optim is None:
        return Policy(bridge, chunks, chunks, None, None)
    model = wrap_ddp(chunks, optim.distributed_optimizer, pg=bridge.pg)
    optimizer, scheduler = make_optimizer(
        model, optim.lr, optim.min_lr, optim.warmup_steps, optim.decay_style, total_steps,
        weight_decay=optim.weight_decay, betas=(optim.adam_beta1, optim.adam_beta2), clip_grad=optim.clip_grad,
        distributed=optim.distributed_optimizer, pg=bridge.pg)
    return Policy(bridge, chunks, model, optimizer, scheduler)


def build_critic(bridge: ModelBridge, policy_chunks: list, optim, lr: float, total_steps: int) -> Policy:
    """The PPO critic: the policy's network and current weights with a zero-initialised value head, its own DDP
    wrapper, optimizer and schedule."""
    chunks = bridge.build(value_head=True)
    _copy_weights(policy_chunks, chunks, skip=("output_layer",))
    model = wrap_ddp(chunks, optim.distributed_optimizer, pg=bridge.pg)
    optimizer, scheduler = make_optimizer(
        model, lr, 0.0, optim.warmup_steps, "constant", total_steps, weight_decay=optim.weight_decay,
        betas=(optim.adam_beta1, optim.adam_beta2), clip_grad=optim.clip_grad, distributed=optim.distributed_optimizer,
        pg=bridge.pg)
    return Policy(bridge, chunks, model, optimizer, scheduler)


@torch.no_grad()
def _copy_weights(source: list, target: list, skip: tuple = ()) -> None:
    """The source's current function into the target: a LoRA-adapted source layer gives its merged weight (the
    target has no adapters), so a critic made from a policy with trained adapters (a LoRA SFT checkpoint,
    model.lora.load) starts from that policy, not from its frozen base."""
    from ..models.lora import merged_weight

    for src, dst in zip(source, target):
        values = src.state_dict(keep_vars=True)
        for name, tensor in dst.state_dict(keep_vars=True).items():
            if torch.is_tensor(tensor) and name in values and not any(k in name for k in skip) \
                    and torch.is_tensor(values[name]) and values[name].shape == tensor.shape:
                tensor.copy_(merged_weight(values[name]))


@dataclass
class Reference:
    """The KL anchor, the initial policy: its model chunks, and the context its forward passes run in
    (`with ref.active(): compute_log_probs(ref.model, ...)`)."""
    model: list
    active: Callable[[], ContextManager]


def build_reference(policy: Policy, offload: bool = False) -> Reference:
    """The initial policy, frozen. Call before resumed weights load. Full fine-tuning: a copy of the policy's weights
    in eval mode with no gradients (offload: kept in host memory outside `active`, see offloaded). A LoRA policy is
    its own reference: the same model with its adapters as they are now (off when fresh), so the reference costs no
    second model (models.lora.initial_function)."""
    from ..models.lora import adapted_layers, initial_function

    if any(True for _ in adapted_layers(policy.chunks)):
        return Reference(policy.model, initial_function(policy.chunks))
    chunks = policy.bridge.build()
    _copy_weights(policy.chunks, chunks)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return Reference(chunks, offloaded(chunks, offload))


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a checkpoints/ folder (or its `latest` file) -> the step folder `latest` names."""
    from .checkpoint import latest_checkpoint

    if os.path.basename(path.rstrip("/")) == "latest":
        path = os.path.dirname(path.rstrip("/"))
    found = latest_checkpoint(path) if os.path.isfile(os.path.join(path, "latest")) else path
    if not found or not os.path.isdir(found):
        raise FileNotFoundError(f"model.load={path!r}: no checkpoint there (expected a step folder or a checkpoints/ "
                                "folder with a 'latest' file)")
    return found


def prompt_tools(env: EnvConfig) -> list[dict] | None:
    """The env's tool schemas the chat template renders into prompts (and SFT samples), or None (no env, or
    env.tools_in_prompt off: the model learned its tools from the SFT data)."""
    if env.name is None or not env.tools_in_prompt:
        return None
    from ..envs import resolve_tools

    return [t.schema() for t in resolve_tools(list(env.tools))]


def offloaded(chunks: list | None, enabled: bool):
    """GPU memory for a frozen model used now and then (the reference with rl.offload_ref): with `enabled` its chunks
    move to host memory now, and the returned context puts them on the GPU while it is open. Otherwise the context
    does nothing."""
    import contextlib

    import torch

    def place(device) -> None:
        for chunk in chunks:
            chunk.to(device)
        if device == "cpu":
            torch.cuda.empty_cache()

    if enabled:
        place("cpu")

    @contextlib.contextmanager
    def on_device():
        if enabled:
            place(torch.cuda.current_device())
        try:
            yield
        finally:
            if enabled:
                place("cpu")

    return on_device
