"""Adapter-only weight sync (reshard.lora_sync=adapter): a LoRA run pushes its adapters, not merged full weights.

The policy engines start from the same HF folder as the trainer with LoRA enabled (megarl.rollout.server:
--enable-lora, model.lora's rank and target modules), so they hold the frozen base weights already. Each sync:

1. gathers the adapters in PEFT's layout (megarl.models.lora.peft_tensors: a collective over TP; each layer's owner
   holds its full A and B) and sends them to rank 0 (they are small: rank x (in + out) per adapted layer), which
   zero-pads them to the engine's layout (engine_layout);
2. rank 0 loads them into the engine from shared memory (SGLang's /load_lora_adapter_from_tensors, one serialised
   copy per engine TP rank, as the tensor transport sends buckets) under the sync's version name;
3. every rank's client names that adapter in its generation requests from then on (EngineClient.adapter), and rank 0
   unloads every other adapter the engine holds (SGLang waits for the requests still using one before it drops it),
   so the engine holds at most two: the previous one, finishing its requests, and the new one.

The tensors go through shared memory, so the engines must run on rank 0's host (colocated, or rollout.engine.urls on
that host); disaggregated engines take reshard.lora_sync=merged (megarl.trainer.config refuses the other).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import platform
from ..errors import on_rank0
from ..models.lora import LoraConfig, peft_tensors
from ..rollout.client import EngineClient, EngineUnavailable
from ..rollout.server import EngineError
from .buckets import ALIGN, BucketPacker
from .verify import EngineShapes, engine_shapes, shard_rule


def peft_config_dict(lora: LoraConfig) -> dict:
    """The adapter_config.json SGLang reads (sglang/srt/lora/lora_config.py: r, lora_alpha, target_modules), as
    export_peft writes it; dropout is a training-only setting."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": sorted(lora.target_modules), "bias": "none",
            "use_dora": False, "use_rslora": False}


def engine_layout(peft_name: str, tensor: torch.Tensor, shapes: EngineShapes) -> torch.Tensor:
    """A PEFT tensor in the engine's padded layout. SGLang sizes its LoRA buffers by the base layer's padded
    dimensions (the CPU engine zero-pads intermediate_size to a multiple of 32 x TP and head counts TP does not divide:
    megarl.reshard.verify.engine_shapes) and refuses another shape (sglang/srt/lora/mem_pool.py,
    load_lora_weight_tensor: "LoRA buffer shape ... does not match weight shape", an assertion that kills the
    scheduler). The padding sits at the end of the whole tensor, as in the base weight (verify.rank_slice): B's rows
    when the base weight is padded along its outputs, A's columns when along its inputs. Padded units are zero in the
    base weights, so zeros there leave the outputs unchanged."""
    module, kind = peft_name.rsplit(".lora_", 1)
    rule = shard_rule(module.removeprefix("base_model.model.") + ".weight", shapes)
    if rule is None:
        return tensor.contiguous()
    dim, padded = rule  # of the base weight [out, in]; lora_B is [out, r], lora_A [r, in]
    axis = 0 if kind.startswith("B") and dim == 0 else 1 if kind.startswith("A") and dim == 1 else None
    if axis is None or tensor.shape[axis] >= padded:
        return tensor.contiguous()
    pad = [0, 0, 0, 0]
    pad[1 if axis == 1 else 3] = padded - tensor.shape[axis]  # F.pad: (last dim left, right, first dim left, right)
    return torch.nn.functional.pad(tensor, pad).contiguous()


def one_buffer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as views of one flat buffer (BucketPacker's layout, one bucket): torch's multiprocessing pickler
    shares a storage once, so the serialised adapter is one shared-memory file instead of one per tensor (a
    SmolLM2-135M adapter on 7 modules has 420 tensors: serialising them one by one took 0.08 s of its 0.28 s sync)."""
    size = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors.values())
    (bucket,) = BucketPacker(max(size, 1)).pack(tensors.items())
    return {name: bucket.tensor(name) for name in tensors}


class AdapterTransport:
    """A WeightTransport (megarl.reshard.transports) that sends the LoRA adapters only; WeightSync then leaves the
    engine's weight-update window closed (`adapter_only`) and verifies with probes through the adapter."""

    adapter_only = True
    shared_memory = False

    def __init__(self, client: EngineClient, lora: LoraConfig, engine_tp: int = 1):
        self.client, self.lora, self.engine_tp = client, lora, engine_tp
        self.shapes: EngineShapes | None = None

    def setup(self, owners: list[int]) -> None:
        # SGLang on CPU: CPU tensors must be shared through files, or its scheduler rejects the handle.
        if not platform.on_gpu():
            torch.multiprocessing.set_sharing_strategy("file_system")

    def send(self, source, version: str) -> tuple[int, int]:
        """Gather the adapters on rank 0, load them into the engine under `version`, name it on every rank's client.
        Returns (adapter bytes, 1) on rank 0, (0, 0) elsewhere."""
        # a collective over TP: every rank calls it. Expert adapters (the second part) never come here: the trainer's
        # config leaves such runs on the merged sync (megarl.trainer.config.adapter_sync_blocker)
        mine, _ = peft_tensors(source.chunks, source.bridge)
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everyone, dst=0)

        def load() -> int:
            shapes = self._engine_shapes(source.bridge.hf.config)
            tensors = one_buffer({name: engine_layout(name, t.to(source.dtype(name)), shapes)
                                  for part in everyone for name, t in part.items()})
            self._load(version, tensors)
            return sum(t.numel() * t.element_size() for t in tensors.values())

        pushed = on_rank0(load)  # an engine's refusal reaches every rank
        self.client.adapter = version  # every rank's client: the rollout workers' requests name it from now on
        # Unloaded once every rank names the new adapter. The trainer's flows send no request across a sync (a
        # synchronous step's rollout is done; asynchronous ones wait for it or pause the engines), and a request
        # still running on the old adapter is waited for by SGLang before it drops the adapter.
        dist.barrier()
        on_rank0(lambda: self._unload_all_but(version))
        return (pushed, 1) if dist.get_rank() == 0 else (0, 0)

    def _engine_shapes(self, hf_config) -> EngineShapes:
        """The engine's padded layout (megarl.reshard.verify.engine_shapes), its TP size and device as it reports
        them (/server_info), asked once."""
        if self.shapes is None:
            info = self.client.call("/server_info", method="GET")
            self.shapes = engine_shapes(hf_config, int(info.get("tp_size") or self.engine_tp),
                                        cpu=info.get("device", "cpu") == "cpu")
        return self.shapes

    def _load(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        if name in self.loaded():  # the same version loaded before (a resumed run, an evaluation): replaced
            self._unload(name)
        # one serialisation per engine TP rank (see TensorTransport.push: each takes one reference on the shared
        # memory that exactly one rank's deserialisation gives back)
        payloads = [MultiprocessingSerializer.serialize(tensors, output_str=True) for _ in range(self.engine_tp)]
        result = self.client.call("/load_lora_adapter_from_tensors", {
            "lora_name": name, "config_dict": peft_config_dict(self.lora), "serialized_named_tensors": payloads})
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"SGLang /load_lora_adapter_from_tensors failed for adapter {name!r} "
                              f"({len(tensors)} tensors): {result.get('error_message') or result.get('message')}")

    def holds(self, version: str | None) -> bool:
        """Rank 0: whether the engine serves adapter `version` (False when it restarted or is unreachable: a restarted
        engine holds no adapter)."""
        if self.client.stale:
            return False
        try:
            return version in self.loaded()
        except EngineUnavailable:
            return False

    def loaded(self) -> list[str]:
        """The adapters the engine holds (SGLang lists them in /v1/models, after the base model)."""
        models = self.client.call("/v1/models", method="GET").get("data") or []
        return [m["id"] for m in models if m.get("parent")]

    def _unload_all_but(self, name: str) -> None:
        """The previous sync's adapter, and any a killed run left in the engine."""
        for other in self.loaded():
            if other != name:
                self._unload(other)

    def _unload(self, name: str) -> None:
        result = self.client.call("/unload_lora_adapter", {"lora_name": name})
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"SGLang /unload_lora_adapter failed for adapter {name!r}: "
                              f"{result.get('error_message')}")

    def close(self) -> None:
        pass
