"""HF <-> Megatron-Core: build the sharded GPTModel for an HF folder, load HF weights into it, export it back.

What comes from mbridge (0.15.1): the HF config -> TransformerConfig mapping and every per-tensor rule — which HF
tensors make one Megatron tensor (QKV fused per query group, gate/up fused for the gated MLP, per-expert names), the
HF <-> Megatron layout conversion, vocabulary padding, and the TP split/merge rules.

What is written here, and why:
- Model construction. mbridge's get_model() hard-codes the TransformerEngine spec and `.cuda()`; on CPU megarl builds
  GPTModel with megatron-core's local spec and the CPU flags from megarl.platform.
- Names. mbridge's tables use TE-spec names; the local spec names two norms differently and keeps experts in a
  SequentialMLP (`experts.local_experts.{i}.linear_fc1.weight` instead of `experts.linear_fc1.weight{i}`).
  `canonical_name` translates local/TE names to mbridge's global names (global layer index, global expert index).
- The distributed part. mbridge's load scatters from TP rank 0 and its export broadcasts every tensor to every
  pipeline rank. Here every rank reads only its own slices from the safetensors files (no communication on load), and
  export gathers only within the TP / expert-TP group and yields each HF tensor on exactly one owner rank, so the
  whole model is never materialised on one rank (the reshard step streams from this generator).
- mbridge's Qwen2/Qwen3 bridges rewrite the class-level name table for tied embeddings (a tied model built first
  would make a later untied one export lm_head as embed_tokens); the tables are copied per instance.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Iterator

import torch
import torch.distributed as dist

from .. import parallel, platform
from ..compat import mbridge as mbridge_compat
from ..compat.megatron import mla_core_attention
from ..parallel.config import ParallelConfigError
from .checkpoint import publish_dir
from .hf import HFModelFolder, open_model_folder
from .lora import is_adapter_param, merged_weight

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _deepseek_router_without_mtp(c) -> dict:
    """DeepSeek-V3's router as GLM-4.5 reuses it (megarl.models.hf.SIGMOID_GROUP_ROUTED): group-limited routing from
    n_group / topk_group, and no MTP layer (see deepseek_v3 below)."""
    return dict(moe_router_num_groups=c.n_group, moe_router_group_topk=c.topk_group, mtp_num_layers=None,
                mtp_loss_scaling_factor=None)


# TransformerConfig fields a family needs beyond what its mbridge bridge sets (a function of the HF config).
_FAMILY_CONFIG = {
    # Qwen2-MoE scales its shared expert by sigmoid(x @ shared_expert_gate): megatron-core's SharedExpertMLP gate.
    # mbridge maps the gate tensor (shared_experts.gate_weight) but leaves the gate off. q/k/v biases come from
    # qkv_bias (mbridge: always on).
    "qwen2_moe": lambda c: dict(moe_shared_expert_gate=True, add_qkv_bias=bool(c.qkv_bias)),
    # DeepSeek-V3. Group-limited routing (n_group groups, the best topk_group of them; a group scores the sum of its
    # best topk/topk_group experts, which is DeepSeek's top-2 for V3's 8 of 4 groups): mbridge does not set it.
    # Router probabilities from sigmoid scores are renormalised over the top-k (norm_topk_prob) and multiplied by
    # routed_scaling_factor (mbridge: moe_router_topk_scaling_factor). The MTP layer (num_nextn_predict_layers) is
    # skipped: megarl trains the next-token loss only, transformers builds no MTP layer to compare against, and its
    # tensors (model.layers.{num_hidden_layers}.*) are neither loaded nor exported. attention_backend: mbridge asks
    # for TE's fused attention, which the GPU (TE spec) keeps; on CPU it is megatron-core's default, as for every other
    # family (the local spec's attention does not read it, but GPTModel exports it as process-wide NVTE_* variables and
    # asserts that every model built in the process agrees).
    "deepseek_v3": lambda c: dict(**_deepseek_router_without_mtp(c),
                                  **({} if platform.on_gpu() else {"attention_backend": "auto"})),
    # GLM-4.5 (mbridge's GLM4MoEBridge builds on its Qwen2-MoE one). Its router is DeepSeek-V3's, so group-limited
    # routing is set as above (mbridge leaves it off; GLM-4.5 ships n_group 1). Where mbridge 0.15.1 does not follow
    # the HF config: q/k/v biases come from attention_bias (mbridge: always on), and the shared experts are
    # n_shared_experts x moe_intermediate_size wide (mbridge: one expert's width), as transformers' Glm4MoeMoE builds
    # them. The MTP layer (num_nextn_predict_layers, model.layers.{num_hidden_layers}.*) is skipped as for DeepSeek-V3.
    # Partial RoPE (partial_rotary_factor) is GPTModel's rotary_percent (ModelBridge.build).
    "glm4_moe": lambda c: dict(**_deepseek_router_without_mtp(c), add_qkv_bias=bool(c.attention_bias),
                               moe_shared_expert_intermediate_size=c.moe_intermediate_size * c.n_shared_experts),
}


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name and ".shared_experts." not in name


def te_norm_name(name: str, multi_latent_attention: bool, mb) -> str:
    """A local-spec norm name -> the TE name mbridge maps (TE fuses these norms into the next linear layer)."""
    if multi_latent_attention:
        # MLA (DeepSeek-V3): the local spec's q/kv norms after the down projections are fused into the up
        # projections in TE. (Without MLA, q_layernorm is Qwen3's QK-norm, which mbridge maps under that name.)
        name = name.replace(".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight")
        name = name.replace(".self_attention.kv_layernorm.weight",
                            ".self_attention.linear_kv_up_proj.layer_norm_weight")
    # (mbridge's DeepSeek table maps input_layernorm itself)
    if "input_layernorm.weight" not in mbridge_compat.attention_mapping(mb):
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    if "pre_mlp_layernorm" not in mbridge_compat.mlp_mapping(mb):
        name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return name


class ModelBridge:
    """One HF model folder, bound to a parallel layout: `pg`, megatron-core's ProcessGroupCollection
    (megarl.parallel.groups().mcore, or megarl.parallel.user_groups() in a user's own Megatron loop), used for every
    collective and passed to the GPTModels it builds.

        bridge = ModelBridge("path/to/hf_folder", pg=megarl.parallel.groups().mcore)   # after megarl.parallel.initialize
        chunks = bridge.build()                              # list[GPTModel], one per virtual pipeline stage
        bridge.load_hf_weights(chunks)
        for hf_name, tensor in bridge.export_hf_weights(chunks): ...   # each HF tensor on one owner rank
    """

    def __init__(self, hf: str | HFModelFolder, dtype: torch.dtype | None = None,
                 make_vocab_size_divisible_by: int = 128, config_overrides: dict | None = None, *, pg):
        if pg is None:
            raise TypeError("ModelBridge needs pg, megatron-core's ProcessGroupCollection: "
                            "megarl.parallel.groups().mcore after megarl.parallel.initialize(), or "
                            "megarl.parallel.user_groups() in your own loop")
        self.pg = pg
        self.hf = hf if isinstance(hf, HFModelFolder) else open_model_folder(hf)
        self.dtype = dtype or (torch.bfloat16 if platform.on_gpu() else torch.float32)
        hf_config = self.hf.config
        mbridge_compat.prepare_hf_config(hf_config, self.hf.rope_theta)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        extras = self._config_extras(config_overrides or {})
        self.mb = mbridge_compat.bridge_class(hf_config.model_type, extras)(hf_config, dtype=self.dtype)
        mbridge_compat.isolate_name_tables(self.mb, self.tied)
        mbridge_compat.set_extra_args(self.mb, extras)
        self.config = self.mb.config

        pg = self.pg
        self.tp, self.tp_rank = pg.tp.size(), pg.tp.rank()
        self.etp, self.etp_rank = pg.expt_tp.size(), pg.expt_tp.rank()
        self.ep, self.ep_rank = pg.ep.size(), pg.ep.rank()
        if self.config.multi_latent_attention and self.tp > 1 and not self.config.sequence_parallel \
                and not platform.on_gpu():
            # The CPU shim mla_rope_key_grad makes the local MLA's gradients exact with sequence parallelism only (the
            # layout mbridge sets whenever tp > 1); without it the RoPE key and q_a_layernorm gradients lose the other
            # TP ranks' share (measured against tp=1).
            raise ParallelConfigError(
                f"parallel.tp={self.tp}: {hf_config.model_type} (multi-latent attention) needs sequence parallelism "
                "at tp > 1 on CPU. Fix: leave sequence_parallel on (the default) or set parallel.tp: 1.")
        self.vocab_size = hf_config.vocab_size
        multiple = make_vocab_size_divisible_by * self.tp
        self.padded_vocab_size = int(math.ceil(self.vocab_size / multiple) * multiple)
        mbridge_compat.set_vocab_padding(self.mb, multiple, self.vocab_size, self.padded_vocab_size)

    # ------------------------------------------------------------------------------------------------ config
    def _config_extras(self, overrides: dict) -> dict:
        c = self.hf.config
        extras = dict(platform.transformer_config_overrides())
        extras.update(hidden_dropout=0.0, attention_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0))
        # Uneven pipeline stages (num_layers_in_first/last_pipeline_stage, account_for_*_in_pipeline_split): megatron
        # places the layers from these (get_transformer_layer_offset), so layer numbers, and with them canonical
        # names and dist-checkpoint keys, stay global.
        extras.update(parallel.pipeline_split(c.num_hidden_layers))
        if self.hf.is_moe:
            # Qwen3-MoE renormalises the top-k probabilities when norm_topk_prob is set: that is Megatron's softmax
            # over the top-k logits (pre_softmax=False). Without it, probabilities come from a softmax over all
            # experts (pre_softmax=True). mbridge always sets False.
            # Mixtral has no norm_topk_prob and always renormalises (a softmax over the top-k logits). At top-k 1 only
            # the pre-softmax router exists in megatron-core (renormalised top-1 routers are refused: megarl.models.hf).
            extras.update(moe_router_pre_softmax=not getattr(c, "norm_topk_prob", True),
                          moe_token_dispatcher_type="alltoall",
                          moe_aux_loss_coeff=float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0))
        if self.hf.model_type in _FAMILY_CONFIG:
            extras.update(_FAMILY_CONFIG[self.hf.model_type](c))
        extras.update(overrides)
        return extras

    # -------------------------------------------------------------------------------------------------- build
    def layer_spec(self, vp_stage: int | None = None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        if platform.on_gpu():
            return get_gpt_decoder_block_spec(self.config, use_transformer_engine=True, vp_stage=vp_stage)
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm",
                                          vp_stage=vp_stage)
        if self.config.multi_latent_attention:
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
        return spec

    def build(self, value_head: bool = False) -> list:
        """The GPTModel chunks this rank holds (one per virtual pipeline stage), randomly initialised.

        value_head=True builds a critic: the same network with the LM head replaced by a ValueHead (zero-initialised)
        and untied from the embedding."""
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt import GPTModel

        vpp = self.config.virtual_pipeline_model_parallel_size or 1
        first_stage, last_stage = self.pg.pp.rank() == 0, self.pg.pp.rank() == self.pg.pp.size() - 1
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            model = GPTModel(
                config=self.config,
                transformer_layer_spec=self.layer_spec(vp_stage),
                vocab_size=self.padded_vocab_size,
                max_sequence_length=self.hf.config.max_position_embeddings,
                pre_process=first_stage and stage == 0, post_process=last_stage and stage == vpp - 1,
                parallel_output=True,
                share_embeddings_and_output_weights=self.tied and not value_head,
                position_embedding_type="rope",
                rotary_base=self.hf.rope_theta,
                rotary_percent=self.hf.rotary_percent,
                vp_stage=vp_stage,
                pg_collection=self.pg,
            )
            model.model_type = ModelType.encoder_or_decoder
            if value_head and model.post_process:
                model.output_layer = self._value_head()
            if not platform.on_gpu():
                model.to(self.dtype)
            else:
                model.cuda(torch.cuda.current_device())
            chunks.append(model)
        return chunks

    def _value_head(self):
        return ValueHead(self.config.hidden_size, bool(self.config.sequence_parallel), self.dtype, self.pg.tp)

    # ---------------------------------------------------------------------------------------------- names
    def canonical_name(self, model, local_name: str) -> str:
        """Local parameter name -> mbridge's global Megatron name (global layer, global expert, TE norm names)."""
        name = local_name
        match = _LAYER.match(name)
        if match:
            layer = _unwrap(model).decoder.layers[int(match.group(2))]
            name = f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"
        experts_per_rank = (self.config.num_moe_experts or 0) // self.ep
        match = _LOCAL_EXPERT.search(name)
        if match:
            expert = self.ep_rank * experts_per_rank + int(match.group(1))
            name = name[: match.start()] + f".mlp.experts.{match.group(2)}.weight{expert}"
        else:
            match = _GROUPED_EXPERT.search(name)
            if match:
                expert = self.ep_rank * experts_per_rank + int(match.group(2))
                name = name[: match.start()] + f".mlp.experts.{match.group(1)}.weight{expert}"
        return te_norm_name(name, self.config.multi_latent_attention, self.mb)

    def hf_names(self, canonical: str) -> list[str]:
        if canonical == "output_layer.weight":
            # The per-instance table (mbridge_compat.isolate_name_tables) knows tied embeddings; mbridge's GLM-4.5
            # bridge hard-codes lm_head.weight, which a tied model's last pipeline stage would read.
            return [mbridge_compat.direct_mapping(self.mb)[canonical]]
        return mbridge_compat.hf_names(self.mb, canonical)

    def _tensors(self, model, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(local name, tensor) for every weight of a chunk, including router expert-bias buffers."""
        seen = set()
        for name, param in _unwrap(model).named_parameters():
            seen.add(name)
            if is_adapter_param(name):  # LoRA A/B: no HF tensor of their own (merged below; PEFT: models.lora)
                continue
            if grads:
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                yield name, param, (torch.zeros_like(param) if grad is None else grad)
            else:
                # a LoRA-adapted layer exports its merged weight (what the rollout engine and an HF folder need)
                yield name, param, merged_weight(param)
        if not grads:
            for name, value in _unwrap(model).state_dict().items():
                if name not in seen and "expert_bias" in name and torch.is_tensor(value):
                    yield name, value, value

    # ----------------------------------------------------------------------------------------------- load
    @torch.no_grad()
    def load_hf_weights(self, chunks: list, skip_output_layer: bool = False) -> None:
        """Copy the HF weights into this rank's shards. Each rank reads only the tensors it holds.
        skip_output_layer: leave the output layer alone (a critic's value head)."""
        for model in chunks:
            for local_name, param, _ in self._tensors(model):
                canonical = self.canonical_name(model, local_name)
                if skip_output_layer and canonical == "output_layer.weight":
                    continue
                full = mbridge_compat.to_mcore_format(self.mb, canonical, self.hf.read(self.hf_names(canonical)))
                expert = is_expert_param(canonical)
                size, rank = (self.etp, self.etp_rank) if expert else (self.tp, self.tp_rank)
                shard = mbridge_compat.split_across_tp(self.mb, canonical, full, param, size)[rank]
                if shard.shape != param.shape:
                    raise ValueError(f"{local_name}: HF tensor(s) {self.hf_names(canonical)} give shape "
                                     f"{tuple(shard.shape)} for this rank, the model expects {tuple(param.shape)}")
                param.copy_(shard)

    # --------------------------------------------------------------------------------------------- export
    def owner_rank(self, canonical: str) -> int | None:
        """Global rank that yields this tensor in export_hf_weights (rank 0 of its TP / expert-TP group in data-parallel
        replica 0), or None when this rank's replica does not export it."""
        if is_expert_param(canonical):
            if self.pg.expt_dp.rank() != 0:
                return None
            return dist.get_global_rank(self.pg.expt_tp, 0)
        if self.pg.dp_cp.rank() != 0:
            return None
        return dist.get_global_rank(self.pg.tp, 0)

    def owner_ranks(self, chunks: list) -> list[int]:
        """Every rank that owns at least one HF tensor (a collective; the same sorted list on all ranks)."""
        mine = {self.owner_rank(self.canonical_name(m, n)) for m in chunks for n, _, _ in self._tensors(m)}
        mine.discard(None)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        return sorted({r for ranks in everyone for r in ranks})

    @torch.no_grad()
    def export_hf_weights(self, chunks: list, grads: bool = False, owner: int | None = None,
                          copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) for the HF tensors this rank owns; every rank must iterate to the end.

        TP shards are all-gathered in the TP group (expert shards in the expert-TP group); the tensor is then owned
        by TP rank 0 of data-parallel replica 0. Pipeline stages and expert-parallel ranks export their own layers and
        experts, so each HF tensor is yielded on exactly one rank. grads=True exports gradients (main_grad under
        Megatron DDP, after finalize_model_grads has reduced them) under the same names. owner=R restricts the pass to
        the tensors rank R owns (only R and its TP / expert-TP peers do any work), so owners can take turns.
        copy=False lets the yielded tensors alias the live parameters (the reshard step copies them into its buckets
        at once); the default copies.
        """
        for model in chunks:
            for local_name, param, value in self._tensors(model, grads):
                canonical = self.canonical_name(model, local_name)
                if self.tied and canonical == "output_layer.weight" and self.pg.pp.size() > 1:
                    continue  # the first stage's embedding is the one HF tensor
                owner_rank = self.owner_rank(canonical)
                if owner_rank is None or (owner is not None and owner_rank != owner):
                    continue
                expert = is_expert_param(canonical)
                size = self.etp if expert else self.tp
                group = self.pg.expt_tp if expert else self.pg.tp
                is_owner = dist.get_rank() == owner_rank
                gathered = size > 1 and getattr(param, "tensor_model_parallel", False)
                if gathered:  # only the owner receives (and merges) the shards
                    # Point to point rather than dist.gather: gloo's gather stages the shards in a flat buffer of its
                    # own that its worker thread may free late, so the owner's peak memory depended on timing.
                    if not is_owner:
                        dist.send(value.contiguous(), dst=owner_rank, group=group)
                        continue
                    parts = [value if r == owner_rank else torch.empty_like(value)
                             for r in dist.get_process_group_ranks(group)]
                    for r, part in zip(dist.get_process_group_ranks(group), parts):
                        if r != owner_rank:
                            dist.recv(part, src=r, group=group)
                    full = mbridge_compat.merge_across_tp(self.mb, canonical, parts, param)
                    del parts
                else:
                    full = value
                if not is_owner:
                    continue
                names, tensors = mbridge_compat.to_hf_format(self.mb, canonical, full)
                del full
                for hf_name, tensor in zip(names, tensors):
                    # a merged tensor is already a fresh copy; an ungathered one is the live parameter
                    yield hf_name, tensor.detach().clone() if copy and not gathered else tensor.detach()

    # ----------------------------------------------------------------------------------------------- save
    def save_hf(self, chunks: list, out_dir: str) -> None:
        """Write an HF folder (config, tokenizer files, sharded safetensors + index) atomically.

        Each owner rank writes its own shard into a temporary folder next to out_dir; rank 0 writes the index and
        publishes the folder last (publish_dir), so a crash never leaves a half-written model at out_dir.
        """
        from safetensors.torch import save_file

        rank = dist.get_rank()
        parent = os.path.dirname(os.path.abspath(out_dir)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = [tempfile.mkdtemp(prefix=".megarl-export-", dir=parent) if rank == 0 else None]
        dist.broadcast_object_list(tmp, src=0)
        tmp_dir = tmp[0]
        tensors = {name: t.to(self.dtype).contiguous() for name, t in self.export_hf_weights(chunks)}
        shard = f"model-rank{rank:05d}.safetensors"
        if tensors:
            save_file(tensors, os.path.join(tmp_dir, shard), metadata={"format": "pt"})
        listing = [None] * dist.get_world_size()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dist.all_gather_object(listing, (shard, sorted(tensors), nbytes))
        if rank == 0:
            weight_map = {n: file for file, names, _ in listing for n in names}
            total = sum(size for _, _, size in listing)
            with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                          f, indent=1)
            for name in os.listdir(self.hf.path):  # config, generation config, tokenizer files
                if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
                    src = os.path.join(self.hf.path, name)
                    if os.path.isfile(src):
                        shutil.copy2(src, os.path.join(tmp_dir, name))
            if self.hf.fp8_block:  # an FP8 checkpoint was loaded dequantised: the export holds unquantised weights
                with open(os.path.join(tmp_dir, "config.json")) as f:
                    hf_config = json.load(f)
                hf_config.pop("quantization_config", None)
                with open(os.path.join(tmp_dir, "config.json"), "w") as f:
                    json.dump(hf_config, f, indent=2)
            publish_dir(tmp_dir, out_dir)
        dist.barrier()


class ValueHead(torch.nn.Module):
    """A critic's value head in place of GPTModel's output layer: one linear unit, replicated on every TP rank.

    Replicated rather than split over TP so that training (Adam included) is the same at every TP size. Under
    sequence parallelism each rank sees its slice of the sequence: values are all-gathered along the sequence with a
    backward that only takes the rank's own slice (no sum over ranks), and the weight is tagged `sequence_parallel` so
    Megatron's finalize_model_grads all-reduces its gradient over TP, as for the norms. Output [s, b, 1] like logits.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, tp_group=None):
        super().__init__()
        self.tp_group = tp_group  # the model's TP group (sequence parallelism gathers over it)
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        values = torch.nn.functional.linear(hidden_states, self.weight)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return values, None


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model
