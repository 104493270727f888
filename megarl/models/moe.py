"""MoE routing in the trainer: rollout routing replay (R3) through megatron-core's RouterReplay, the routing actually
used compared with the engine's, and load-balance statistics.

Token order. A router sees the micro-batch's hidden states [s, b, h] flattened to s*b tokens (sequence-major), and
under sequence parallelism each TP rank only its s/tp slice of the sequence. The engine's routing arrives per sample
as [positions, layers, top-k] (SGLang `return_routed_experts`); the trainer keeps it as [b, s, layers, top-k] beside
the token ids, so micro-batch splits carry it along, and rearranges it here for each router (its global layer).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


def routers(chunks: list) -> list:
    """The model's top-k routers in layer order (this pipeline stage's layers, every VPP chunk)."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for chunk in chunks:
        found += [m for m in chunk.modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda r: r.layer_number)


def _tokens_of(router, per_layer: torch.Tensor) -> torch.Tensor:
    """[b, s, k] of one layer -> [tokens, k] in the order this rank's router sees them."""
    tokens = per_layer.transpose(0, 1)  # [s, b, k]
    if router.config.sequence_parallel:  # the router's own TP group (the model's ProcessGroupCollection)
        tp, rank = router.tp_group.size(), router.tp_group.rank()
        chunk = tokens.shape[0] // tp
        tokens = tokens[rank * chunk:(rank + 1) * chunk]
    return tokens.reshape(-1, tokens.shape[-1])


@contextmanager
def replay_routing(chunk, routed_experts: torch.Tensor | None):
    """Route this micro-batch's forward through `chunk` with the engine's experts (routed_experts [b, s, L, k],
    global layer index); a no-op when routed_experts is None. Needs moe_enable_routing_replay in the model config."""
    if routed_experts is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    chunk_routers = routers([chunk])
    for router in chunk_routers:
        if router.router_replay is None:
            raise RuntimeError("rollout routing replay needs the model built with moe_enable_routing_replay "
                               "(megarl sets it when rollout.routing_replay is on)")
        router.router_replay.clear_indices()
        router.router_replay.set_target_indices(
            _tokens_of(router, routed_experts[:, :, router.layer_number - 1]).to(torch.int64))
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router in chunk_routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


class RoutingStats:
    """Forward hooks on every router: per forward, the experts each token was actually sent to. With the engine's
    routing of the same tokens (routed_experts [b, s, L, k] and a [b, s] mask of positions to count), `agreement`
    is the mean over (token, layer) of |trainer's experts ∩ engine's| / k; `load` gives tokens per expert per layer."""

    def __init__(self, chunks: list):
        self.routers = routers(chunks)
        self.maps: dict[int, list[torch.Tensor]] = {}
        self._hooks = [r.register_forward_hook(self._record) for r in self.routers]

    def _record(self, router, _inputs, outputs) -> None:
        self.maps.setdefault(router.layer_number, []).append(outputs[1].detach())  # routing_map [tokens, E]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def agreement(self, routed_experts: torch.Tensor, mask: torch.Tensor, micro_batches: int,
                  layouts: list | None = None) -> torch.Tensor:
        """[matches, counted] summed over this rank's layers and micro-batches (all-reduce them for the global
        agreement). layouts: the micro-batches' PackedLayouts when the recorded forwards ran packed
        (megarl.losses.step.schedule_layouts): the engine's routing and the mask are packed the same way."""
        out = torch.zeros(2, dtype=torch.float64)
        rows = routed_experts.shape[0] // micro_batches
        for router in self.routers:
            for m, routing_map in enumerate(self.maps.get(router.layer_number, [])):
                part = slice(m * rows, (m + 1) * rows)
                engine, positions = routed_experts[part, :, router.layer_number - 1], mask[part]
                if layouts is not None and layouts[m] is not None:
                    engine, positions = layouts[m].pack(engine, repeat_last=True), layouts[m].pack(positions)
                engine = _tokens_of(router, engine)
                counted = _tokens_of(router, positions.unsqueeze(-1)).squeeze(-1) > 0
                used = routing_map.gather(1, engine.to(routing_map.device).long()).float()  # engine's experts used?
                out[0] += float(used[counted].sum())
                out[1] += float(counted.sum()) * engine.shape[-1]
        return out

    def assignments(self) -> torch.Tensor:
        """[expert slots filled, tokens x top-k] over every recorded forward: below top-k when tokens were dropped
        (moe_expert_capacity_factor)."""
        out = torch.zeros(2, dtype=torch.float64)
        for router in self.routers:
            for routing_map in self.maps.get(router.layer_number, []):
                out[0] += float(routing_map.sum())
                out[1] += routing_map.shape[0] * router.topk
        return out

    def load(self, num_layers: int, num_experts: int) -> torch.Tensor:
        """[layers, experts] tokens routed to each expert over every recorded forward (rows of layers not on this
        pipeline stage stay 0: summing over ranks fills them)."""
        out = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        for layer, maps in self.maps.items():
            out[layer - 1] = torch.stack([m.sum(0) for m in maps]).sum(0).double()
        return out


def load_balance_metrics(load: torch.Tensor) -> dict:
    """From tokens per expert per layer ([layers, experts]; layers without tokens are skipped): the max/mean expert
    load (1.0 = perfectly balanced) and the coefficient of variation, averaged over layers."""
    rows = [t for t in load if t.sum() > 0]
    if not rows:
        return {}
    ratio = [float(t.max() / t.mean().clamp(min=1e-9)) for t in rows]
    cv = [float(t.std(unbiased=False) / t.mean().clamp(min=1e-9)) for t in rows]
    return {"moe/expert_load_max_over_mean": sum(ratio) / len(ratio), "moe/expert_load_cv": sum(cv) / len(cv)}
