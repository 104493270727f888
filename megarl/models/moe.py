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
        chunk = -(-tokens.shape[0] // tp)  # the forward ran right-padded to a multiple of tp (TokenBatch.pad_to_multiple)
        tokens = torch.cat([tokens, tokens.new_zeros(chunk * tp - tokens.shape[0], *tokens.shape[1:])])
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

    def _recorded(self, mask: torch.Tensor | None, micro_batches: int, layouts: list | None):
        """Per router and recorded forward (micro-batch m): (router, rows of m, m's PackedLayout or None, routing_map
        [tokens, E], counted [tokens] bool: the tokens `mask` [b, s] selects, all of them without a mask)."""
        for router in self.routers:
            for m, routing_map in enumerate(self.maps.get(router.layer_number, [])):
                layout = layouts[m] if layouts is not None else None
                if mask is None:
                    yield router, None, layout, routing_map, torch.ones(routing_map.shape[0], dtype=torch.bool)
                    continue
                rows = mask.shape[0] // micro_batches
                part = slice(m * rows, (m + 1) * rows)
                positions = layout.pack(mask[part]) if layout is not None else mask[part]
                yield router, part, layout, routing_map, _tokens_of(router, positions.unsqueeze(-1)).squeeze(-1) > 0

    def agreement(self, routed_experts: torch.Tensor, mask: torch.Tensor, micro_batches: int,
                  layouts: list | None = None) -> torch.Tensor:
        """[matches, counted] summed over this rank's layers and micro-batches (all-reduce them for the global
        agreement). layouts: the micro-batches' PackedLayouts when the recorded forwards ran packed
        (megarl.losses.step.schedule_layouts): the engine's routing and the mask are packed the same way."""
        out = torch.zeros(2, dtype=torch.float64)
        for router, part, layout, routing_map, counted in self._recorded(mask, micro_batches, layouts):
            engine = routed_experts[part, :, router.layer_number - 1]
            if layout is not None:
                engine = layout.pack(engine, repeat_last=True)
            engine = _tokens_of(router, engine)
            used = routing_map.gather(1, engine.to(routing_map.device).long()).float()  # engine's experts used?
            out[0] += float(used[counted.to(used.device)].sum())
            out[1] += float(counted.sum()) * engine.shape[-1]
        return out

    def assignments(self, mask: torch.Tensor | None = None, micro_batches: int = 1,
                    layouts: list | None = None) -> torch.Tensor:
        """[expert slots filled, tokens x top-k] over the recorded forwards' tokens `mask` selects (as in
        `agreement`; None: every token): below top-k when tokens were dropped (moe_expert_capacity_factor)."""
        out = torch.zeros(2, dtype=torch.float64)
        for router, _, _, routing_map, counted in self._recorded(mask, micro_batches, layouts):
            out[0] += float(routing_map[counted.to(routing_map.device)].sum())
            out[1] += float(counted.sum()) * router.topk
        return out

    def load(self, num_layers: int, num_experts: int, mask: torch.Tensor | None = None, micro_batches: int = 1,
             layouts: list | None = None) -> torch.Tensor:
        """[layers, experts] tokens routed to each expert over the recorded forwards' tokens `mask` selects (as in
        `agreement`; None: every token; padding and placeholder positions would otherwise count, and under R3 they
        carry made-up experts). Rows of layers not on this pipeline stage stay 0: summing over ranks fills them."""
        out = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        for router, _, _, routing_map, counted in self._recorded(mask, micro_batches, layouts):
            out[router.layer_number - 1] += routing_map[counted.to(routing_map.device)].sum(0).double().cpu()
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
