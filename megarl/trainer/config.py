"""The training configuration: one dataclass tree, read from a YAML preset in configs/ plus dotted overrides
(megarl.config.load_config). Every field has a default, so a preset only says what differs."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

from ..algorithms import AlgorithmConfig
from ..algorithms.advantages import estimator
from ..config import ConfigError, load_config
from ..errors import unknown_name
from ..models.lora import LoraConfig
from ..parallel import ModelShape, ParallelConfig


@dataclass
class TinyModelConfig:
    """A small random model written into the run folder (tests, the quickstart)."""
    family: str = "qwen2"
    tokenizer: str = "char"  # char: one token per byte (digits are single tokens) | bpe
    seed: int = 0
    overrides: dict = field(default_factory=dict)  # HF config fields, e.g. {hidden_size: 128}


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a local Hugging Face folder (architecture, tokenizer, initial weights)
    tiny: Optional[TinyModelConfig] = None  # instead of path: write a tiny random model into <run_dir>/base-model
    load: Optional[str] = None  # a megarl checkpoint (step or checkpoints/ folder); "sft": <run_dir>/sft/checkpoints
    # The model's dimensions for `megarl train CONFIG --dry-run` when model.path is not on this machine (a preset for a
    # model whose weights live elsewhere): keys of megarl.parallel.ModelShape, e.g. {num_layers: 48,
    # num_attention_heads: 32, num_key_value_heads: 4, ffn_hidden_size: 6144, num_experts: 128,
    # moe_ffn_hidden_size: 768}. The folder's config.json wins when it exists; training always reads config.json.
    shape: Optional[dict] = None
    # MoE RL options (declared and validated here; wiring into the model build is separate work):
    # moe_aux_loss_coeff: Megatron's load-balancing loss coefficient; None keeps the HF config's router_aux_loss_coef.
    # RL recipes usually set 0.0: the balancing loss would pull the policy gradient towards a uniform routing that the
    # pretrained model (and the rollout engine, which has no such loss) does not follow.
    moe_aux_loss_coeff: Optional[float] = None
    # freeze_router_bias: keep the aux-loss-free expert bias (DeepSeek-V3-style e_score_correction_bias) fixed during
    # RL instead of letting Megatron's bias-update rule move it by each small, skewed RL batch's expert load.
    freeze_router_bias: bool = False
    # LoRA adapters (megarl.models.lora.LoraConfig: rank, alpha, dropout, target_modules, seed, load); null: full
    # fine-tuning. With adapters the base weights are frozen and the optimizer holds the adapters only.
    lora: Optional[LoraConfig] = None

    def __post_init__(self):
        if isinstance(self.lora, dict):  # built in code rather than from YAML (megarl.config.build makes the dataclass)
            self.lora = LoraConfig(**self.lora)
        shape = model_shape_hint(self.shape) if self.shape is not None else None
        if self.moe_aux_loss_coeff is not None and self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff must be >= 0 (or null: the HF config's "
                              f"router_aux_loss_coef), got {self.moe_aux_loss_coeff}. Fix: e.g. 0.001, or null")
        if shape is not None and not shape.num_experts:
            # A dense model has no router; 0.0 / false are harmless no-ops and accepted.
            for name, active in (("moe_aux_loss_coeff", bool(self.moe_aux_loss_coeff)),
                                 ("freeze_router_bias", self.freeze_router_bias)):
                if active:
                    raise ConfigError(f"model.{name} is set but model.shape has no num_experts (a dense model has no "
                                      f"router). Fix: unset model.{name}, or add num_experts to model.shape")


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "constant"  # constant | linear | cosine (megatron OptimizerParamScheduler)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    clip_grad: float = 1.0
    distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks (megatron)

    def __post_init__(self):
        _check_schedule("optim", self)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)} must be in [0, 1). Fix: e.g. 0.9 / 0.999")
        if self.clip_grad < 0:
            raise ConfigError(f"optim.clip_grad={self.clip_grad} must be >= 0 (0: no clipping). Fix: e.g. 1.0")


@dataclass
class SyntheticConfig:
    """Built-in verifiable task: integer arithmetic "a+b=" with operands of up to `digits` digits (or 0..max_operand)."""
    task: str = "arithmetic"
    digits: int = 2
    max_operand: Optional[int] = None
    ops: list = field(default_factory=lambda: ["+"])
    num_train: int = 5000
    num_eval: int = 200
    seed: int = 1234  # the held-out set never overlaps the training set
    sft_answer_noise: float = 0.0  # share of SFT demonstrations with a wrong answer (imperfect cold-start data)
    sft_tool_share: float = 0.0  # share of SFT demonstrations that call the calculator tool (tool-use cold start)

    def __post_init__(self):
        if not 0.0 <= self.sft_tool_share <= 1.0:
            raise ConfigError(f"data.synthetic.sft_tool_share={self.sft_tool_share} must be in [0, 1]. Fix: e.g. 0.2")


@dataclass
class ReasoningGymConfig:
    """Procedural tasks from reasoning-gym (data.train / data.eval / sft.data: reasoning_gym), scored by reward.name:
    reasoning_gym with each task's own score_answer. One task (`task` + `config`) or several (`tasks`: [{name, weight,
    config}], reasoning-gym's composite). The held-out split comes from eval_seed and never shares a question with
    the training split (checked before training)."""
    task: Optional[str] = None
    config: dict = field(default_factory=dict)  # the task's config fields, e.g. {min_animals: 2, max_animals: 3}
    tasks: list = field(default_factory=list)
    size: int = 1000  # training problems
    seed: int = 0
    eval_size: int = 100  # held-out problems
    eval_seed: Optional[int] = None  # None: seed + 1000003
    system_prompt: Optional[str] = "default"  # a reasoning_gym.utils.SYSTEM_PROMPTS key, or the text; null: none


@dataclass
class DataConfig:
    # a JSONL/Parquet file or folder of prompts, or "synthetic" / "reasoning_gym" (sections below) / "humaneval"
    train: str = "synthetic"
    eval: Optional[str] = None  # held-out prompts; None with a procedural train source: its held-out split
    # without data.eval: hold out this fraction of a train file's prompts (chosen by a hash of the prompt's text, so
    # the split is the same on every run and machine and a prompt never lands on both sides); 0: no held-out set
    eval_fraction: float = 0.0
    prompt_key: str = "prompt"  # a string (user turn) ...
    messages_key: str = "messages"  # ... or a list of chat messages
    answer_key: str = "answer"
    answer_format: Optional[str] = None  # mbpp | apps | livecodebench: code tests from the dataset's own columns
    system_prompt: Optional[str] = None
    max_prompt_tokens: int = 1024
    shuffle: bool = True
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)

    def __post_init__(self):
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1). Fix: e.g. 0.05 (or 0: none)")
        if self.eval_fraction and self.eval:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction} holds out part of data.train, but "
                              f"data.eval={self.eval!r} is set too. Fix: one of them")
        if self.eval_fraction and self.train in ("synthetic", "reasoning_gym", "humaneval"):
            raise ConfigError(f"data.eval_fraction splits a data file, but data.train={self.train} has its own "
                              "held-out split. Fix: unset data.eval_fraction")


@dataclass
class EngineConfig:
    urls: list = field(default_factory=list)  # running SGLang servers; empty: start `num_engines` locally
    num_engines: int = 1
    tp_size: int = 1
    max_total_tokens: Optional[int] = 16384
    mem_fraction_static: Optional[float] = None
    # per start attempt: process start, /health and megarl's own 1-token warm-up (SGLang's 10 s warm-up is skipped)
    startup_timeout_s: float = 300.0
    startup_retries: int = 1  # start again this many times after a start-up that timed out (a loaded machine)
    router_policy: str = "least_loaded"
    dtype: Optional[str] = None  # the engine's weights: None = float32 on CPU, bfloat16 on GPU (bfloat16 | float32)
    extra_args: list = field(default_factory=list)
    # rollout.placement=disaggregated: how many nodes (the job's last ones) run only SGLang servers, each with
    # gpus_per_node / tp_size servers. 0 with colocated (the engines share the trainer's GPUs).
    nodes: int = 0
    # an engine this job started that dies is restarted, then gets the trainer's weights before it generates again
    # (megarl.rollout.client); one that dies more than max_restarts times within restart_window_s is retired
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    # a request unanswered this long is sent again; if the engine is then stopped (SIGSTOP) or does not answer
    # /health within 30 s, it is killed and restarted as a dead one is
    request_timeout_s: float = 600.0

    def __post_init__(self):
        if self.dtype is not None:
            _choice("rollout.engine.dtype", self.dtype, ("bfloat16", "float32"))
        _at_least("rollout.engine", self, ("tp_size", "num_engines"))
        _at_least("rollout.engine", self, ("nodes", "max_restarts"), 0)
        _at_least("rollout.engine", self, ("request_timeout_s",), 1)


@dataclass
class RolloutConfig:
    prompts_per_step: int = 32
    n_samples: int = 8  # responses per prompt (the GRPO group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list = field(default_factory=list)  # besides the tokenizer's EOS / chat end token
    deterministic: bool = True  # per-request sampling seeds (SGLang deterministic inference): exact resume
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, over-sample to refill
    max_sampling_rounds: int = 4
    overlong: str = "none"  # none | mask (truncated responses carry no loss) | penalty (DAPO soft overlong penalty)
    overlong_buffer: int = 0  # penalty: linear penalty over the last `overlong_buffer` tokens before the limit
    overlong_penalty: float = 1.0
    old_log_probs: str = "recompute"  # recompute (trainer forward) | rollout (engine log-probs + algorithm.mismatch)
    request_size: int = 64  # prompts per concurrent /generate request (rewards start as each returns)
    # Which ranks send the engine requests and score the rewards (megarl.trainer.dispatch): dp_leaders (one rollout
    # worker per data-parallel replica, each with its own reward pool: the step's prompts are split between them),
    # rank0 (rank 0 alone), or auto: the DP leaders that can reach the engines (all of them with rollout.engine.urls;
    # with engines this job starts, bound to 127.0.0.1, those on rank 0's node).
    workers: str = "auto"
    # Where the SGLang engines run (megarl.launch.topology, `--dry-run` prints the layout):
    #   colocated: on the trainer's GPUs, one engine per rollout.engine.tp_size GPUs; memory is released between the
    #     rollout and training phases; weights go over reshard.transport=tensor (shared memory, no copy).
    #   disaggregated: on their own nodes (rollout.engine.nodes, the job's last); the trainer gets the other nodes and
    #     pushes weights over reshard.transport=distributed (NCCL broadcast into the engines).
    placement: str = "colocated"
    # MoE: the engine reports which experts it routed every token to (SGLang --enable-return-routed-experts); the
    # trainer measures how often its own routing agrees (moe/routing_agreement).
    return_routed_experts: bool = False
    # Rollout routing replay (R3): the trainer's forward passes (old/ref log-probs, training) use the engine's
    # routing instead of their own, through megatron-core's RouterReplay. Implies return_routed_experts.
    routing_replay: bool = False
    # the run goes on while at least this many policy engines are not retired (an engine past its restart budget,
    # rollout.engine.max_restarts, is retired)
    min_engines: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        _choice("rollout.overlong", self.overlong, ("none", "mask", "penalty"))
        _choice("rollout.old_log_probs", self.old_log_probs, ("recompute", "rollout"))
        _choice("rollout.workers", self.workers, ("auto", "dp_leaders", "rank0"))
        _choice("rollout.placement", self.placement, ("colocated", "disaggregated"))
        _at_least("rollout", self, ("prompts_per_step", "n_samples", "max_new_tokens", "request_size",
                                    "min_engines"))
        engines = len(self.engine.urls) or self.engine.num_engines
        if self.min_engines > engines:
            raise ConfigError(f"rollout.min_engines={self.min_engines} is more than the {engines} policy engines "
                              f"(rollout.engine.num_engines / rollout.engine.urls). Fix: rollout.min_engines={engines} "
                              "or fewer")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer < self.max_new_tokens:
            raise ConfigError(f"rollout.overlong=penalty needs 0 < rollout.overlong_buffer < rollout.max_new_tokens="
                              f"{self.max_new_tokens}, got {self.overlong_buffer}. Fix: e.g. rollout.overlong_buffer="
                              f"{max(1, self.max_new_tokens // 4)}")

    @property
    def engine_routing(self) -> bool:
        """The engine returns the experts it routed each token to (for the agreement metric or for R3)."""
        return self.return_routed_experts or self.routing_replay


@dataclass
class PoolConfig:
    """An engine pool serving a model other than the policy (pools.<name>: a judge, verifier, meta-verifier; the
    teacher: section is one too): either `model` (rank 0 starts `num_engines` SGLang servers for it through the policy
    engines' ServerConfig builder, megarl.rollout.pools) or `urls` (running SGLang servers). Each pool has its own
    EngineRouter; it never receives weight syncs (only the policy's rollout.engine does)."""
    model: Optional[str] = None  # a local HF folder
    urls: list = field(default_factory=list)
    tp_size: int = 1  # each server's tensor-parallel size (model)
    dtype: Optional[str] = None  # the engines' weights: None = float32 on CPU, bfloat16 on GPU
    num_engines: int = 1  # servers started for `model`
    max_total_tokens: Optional[int] = None  # None: rollout.engine.max_total_tokens
    router_policy: str = "least_loaded"  # round_robin | least_loaded (megarl.rollout.router)
    # the tokenizer whose chat template renders the pool's prompts (a judge's); None: `model`, or with `urls` the
    # folder the server reports (SGLang /model_info), which must then be on this machine
    tokenizer: Optional[str] = None

    @property
    def enabled(self) -> bool:
        return bool(self.model or self.urls)


@dataclass
class TeacherConfig(PoolConfig):
    """On-policy distillation's teacher (algorithm.advantage_estimator: opd): a pool (see PoolConfig) whose model has
    the policy's tokenizer (any size) and whose log-probs of the sampled tokens the rollout asks for (prefill only).
    teacher.model: the trainer starts one SGLang server for it, like the policy's engines, and never syncs weights
    into it; teacher.urls: running SGLang servers of the teacher."""

    def __post_init__(self):
        if self.model and self.urls:
            raise ConfigError("teacher.model and teacher.urls are both set. Fix: set teacher.model (the trainer starts "
                              "the teacher engine) or teacher.urls (running teacher engines), not both")
        if self.tp_size < 1:
            raise ConfigError(f"teacher.tp_size must be >= 1, got {self.tp_size}. Fix: e.g. teacher.tp_size=1")
        if self.num_engines != 1:
            raise ConfigError(f"teacher.num_engines={self.num_engines}: the trainer starts one teacher server. Fix: "
                              "teacher.num_engines: 1, or start several yourself and list them in teacher.urls")
        if self.dtype is not None:
            _choice("teacher.dtype", self.dtype, ("bfloat16", "float32"))


@dataclass
class JudgeStage:
    """One generative-reward model call (megarl.rewards.judge): the prompt rendered with the judge model's chat
    template, n sampled judgements, each parsed to a score, reduced to one."""
    pool: str = "judge"  # the pools: entry that serves this model
    # the user message; {prompt} (the policy's prompt text), {response} (its final answer text), {answer} (the
    # reference, "" when none) and, for a meta-verifier, {analysis} (the verifier's text) are replaced; other braces
    # stay as written (\boxed{} needs no escaping). None: megarl.rewards.judge's VERIFIER_TEMPLATE / META_TEMPLATE
    template: Optional[str] = None
    system: Optional[str] = None  # a system message before it
    n: int = 1  # judgements sampled per response
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # text -> score: the last match of `pattern` (its first non-empty group, as a number; None: megarl.rewards.judge's
    # DEFAULT_PATTERN, the last \boxed{x} or "Score: x"), or `parser`, a "package.module:function" taking the text and
    # returning a number or None (unparseable)
    pattern: Optional[str] = None
    parser: Optional[str] = None
    # the judge's scale: a parsed number outside [low, high] counts as unparseable (e.g. [1, 10] for a 1-10 rating)
    score_range: list = field(default_factory=lambda: [0.0, 1.0])
    reduce: str = "mean"  # mean | majority (the most frequent score; ties: the lowest)
    # an unparseable judgement (counted in reward/judge_parse_errors): `score` counts it as parse_error_score, `skip`
    # leaves it out of the reduction (a response whose n judgements all fail scores parse_error_score)
    on_parse_error: str = "score"
    parse_error_score: float = 0.0


@dataclass
class SelfVerificationConfig:
    """reward.judge.self_verification (DeepSeekMath-V2): the policy writes its solution, then `marker`, then its own
    analysis ending in a self-score; reward = alpha * verifier score of the solution + beta * (1 - |self-score -
    verifier score|) * meta-verifier's score of the self-analysis (1 without a meta_verifier); 0 when the marker or the
    self-score is missing (megarl.rewards.judge)."""
    marker: str = "Self-evaluation:"
    pattern: Optional[str] = None  # the self-score in the analysis (None: the last \boxed{x} or "Score: x")
    alpha: float = 0.76  # the paper's weights
    beta: float = 0.24


@dataclass
class JudgeConfig(JudgeStage):
    """reward.name: judge. meta_verifier (DeepSeekMath-V2): a second model reads each parsed verifier analysis
    ({analysis}) and scores its faithfulness in [0, 1]; the response's score is then verifier x meta quality. With
    reward.name: verifier_agreement (training a verifier) only meta_verifier is read: it scores the policy's own
    analysis ({prompt}: the verification request, {analysis}: the response), and the reward becomes
    R_format x R_score x that quality."""
    meta_verifier: Optional[JudgeStage] = None
    self_verification: Optional[SelfVerificationConfig] = None


@dataclass
class EnvConfig:
    """Multi-turn rollouts (megarl.envs). name=None: one model turn per sample (single-turn RL)."""
    # tool: the model calls tools (env.tools) until it answers without a tool call; "package.module:Class": your own
    # environment (megarl.envs.base.Env)
    name: Optional[str] = None
    tools: list = field(default_factory=lambda: ["calculator"])
    tool_call_format: str = "qwen25"  # SGLang function-call parser matching the chat template's tool-call syntax
    tools_in_prompt: bool = True  # render the tools' JSON schemas into the prompt (the chat template's tools=)
    max_turns: int = 4  # model turns per episode
    max_response_tokens: int = 1024  # model + observation tokens per episode (rollout.max_new_tokens is per turn)
    kwargs: dict = field(default_factory=dict)  # extra arguments for the environment's constructor

    def __post_init__(self):
        _at_least("env", self, ("max_turns", "max_response_tokens"))
        if self.name is not None:
            from ..envs import ENVS, resolve_tools

            if ":" not in self.name:  # "package.module:Class": a user's environment, imported by the rollout
                _choice("env.name", self.name, sorted(ENVS))
            try:
                resolve_tools(list(self.tools))
            except ValueError as e:
                raise ConfigError(str(e)) from None


@dataclass
class RewardConfig:
    name: str = "math"  # math (math-verify) | exact_match | "package.module:function"
    # the held-out evaluation's reward (a registered name or "package.module:function", without kwargs); None: `name`.
    # Training on a generative or learned reward (judge), set a ground-truth checker here (e.g. exact_match): held-out
    # pass@1 then measures the task rather than the judge's opinion, and eval/train_reward_pass_at_1 and
    # eval/train_reward_false_pass (the training reward passes what this one fails: reward hacking) are logged too.
    eval_name: Optional[str] = None
    workers: int = 2  # reward processes (off the training ranks' critical path)
    timeout_s: float = 10.0
    kwargs: dict = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # reward.name: judge (a generative reward)

    def __post_init__(self):
        _at_least("reward", self, ("workers",))


@dataclass
class RLConfig:
    steps: int = 100
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per ppo epoch
    max_tokens_per_microbatch: int = 8192
    ref_model: Optional[bool] = None  # None: only when algorithm.kl_coef > 0
    critic_lr: float = 1e-5  # the critic's learning rate (algorithm.use_critic, PPO with gae)
    offload_ref: bool = True  # GPU: keep the reference model in host memory between uses (no-op on CPU)
    eval_every: int = 0  # 0: evaluate only before and after training
    eval_samples: int = 4  # samples per held-out prompt (pass@1 = mean correctness)
    eval_temperature: Optional[float] = None  # None: rollout.temperature
    # write <run_dir>/rollouts/: step_N.workerW.jsonl, the engine samples each rollout worker generated (read them with
    # megarl.trainer.rl.dumped_samples), and step_N.dpR.train.jsonl, the token rows each DP rank trained
    dump_rollouts: bool = False
    # RL dynamics: log dynamics/update_changed_frac, the fraction of parameters whose bf16 value the step's updates
    # changed (1 - update sparsity; megarl.algorithms.dynamics). Costs a bf16 copy of the parameters during the step.
    log_update_sparsity: bool = False
    # RL dynamics (forgetting): at every evaluation, eval/kl_to_initial, KL(policy || initial model) on one sampled
    # response per held-out prompt. Uses the reference model (the initial weights); without kl_coef > 0 this builds
    # it, i.e. one more frozen copy of the model in memory, and its log-probs are then also computed every step.
    forgetting_kl: bool = False
    # Asynchronous RL (megarl.trainer.async_rollout): the engines generate the next steps' rollouts while Megatron
    # trains. A token sampled by the weights of step v is trained at step t only if t - 1 - v <= max_staleness
    # (0: the synchronous step). partial_rollouts: a weight update aborts the generations in flight, which continue
    # under the new weights (every token records its version and log-prob); false: a fixed schedule (step t is
    # generated entirely by the weights of step t - 1 - max_staleness), reproducible with rollout.deterministic.
    max_staleness: int = 0
    partial_rollouts: bool = True
    # An optimizer step whose loss or gradient norm is not finite (NaN / inf on any rank) is skipped on every rank
    # (counted: skipped_updates); this many skipped in a row (optimizer steps: an RL step makes ppo_epochs x
    # mini_batches of them) stop the run with one line. 1: stop at the first. SFT and DPO read it too.
    max_skipped_steps: int = 3

    def __post_init__(self):
        _at_least("rl", self, ("steps", "ppo_epochs", "mini_batches", "max_tokens_per_microbatch",
                               "max_skipped_steps"))
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness must be an integer >= 0 (0: synchronous steps), "
                              f"got {self.max_staleness!r}. Fix: rl.max_staleness=0, or 1 (one step ahead)")


@dataclass
class SFTConfig:
    data: str = "synthetic"  # chat JSONL ({"messages": [...]}) or synthetic (the synthetic task's answers)
    max_samples: Optional[int] = None  # use only the first N samples (a small demonstration set before RL)
    weight_decay: float = 0.0
    steps: int = 200
    batch_size: int = 64  # sequences (before packing) per optimizer step
    max_seq_len: int = 512
    pack: bool = True
    lr: float = 1e-4
    min_lr: float = 0.0
    warmup_steps: int = 10
    decay_style: str = "cosine"
    max_tokens_per_microbatch: int = 8192

    def __post_init__(self):
        _check_schedule("sft", self)
        _at_least("sft", self, ("batch_size", "max_seq_len"))


@dataclass
class DPOConfig:
    """Offline preference training (`megarl dpo`): DPO or IPO against the frozen initial policy."""
    data: str = "synthetic"  # preference JSONL/Parquet ({"prompt", "chosen", "rejected"}) or synthetic (right vs wrong)
    max_samples: Optional[int] = None  # use only the first N pairs
    loss_type: str = "dpo"  # dpo (arXiv:2305.18290) | ipo (arXiv:2310.12036)
    beta: float = 0.1  # the KL strength: implicit reward = beta * (log pi - log ref) of a response
    label_smoothing: float = 0.0  # dpo only: the share of pairs assumed mislabelled (conservative DPO); 0: plain DPO
    steps: int = 100
    batch_size: int = 16  # pairs per optimizer step
    max_seq_len: int = 512  # prompt + response tokens of one row
    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "constant"
    weight_decay: float = 0.0
    max_tokens_per_microbatch: int = 8192
    fused_logprobs: bool = True  # log-probs from the final hidden states and the output weight (algorithm.*'s twin)

    def __post_init__(self):
        _check_schedule("dpo", self)
        _at_least("dpo", self, ("steps", "batch_size", "max_seq_len"))
        _choice("dpo.loss_type", self.loss_type, ("dpo", "ipo"))
        if not self.beta > 0:
            raise ConfigError(f"dpo.beta={self.beta} must be > 0 (the implicit reward scale; IPO's target margin is "
                              "1 / (2 beta)). Fix: e.g. dpo.beta=0.1")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5) (the share of pairs "
                              "assumed mislabelled). Fix: e.g. 0.0 (plain DPO) or 0.1")
        if self.label_smoothing and self.loss_type != "dpo":
            raise ConfigError(f"dpo.label_smoothing={self.label_smoothing} applies to dpo.loss_type=dpo only (IPO has "
                              "no labels to smooth). Fix: dpo.label_smoothing=0, or dpo.loss_type=dpo")

    @property
    def temperature(self) -> float:
        """The loss functions read log-probs at cfg.temperature: DPO compares the model's own distribution."""
        return 1.0


@dataclass
class ReshardConfig:
    # tensor (colocated) | distributed (NCCL/gloo broadcast) | disk | "package.module:Class" (a WeightTransport:
    # megarl.reshard.transports)
    transport: str = "tensor"
    bucket_mb: int = 512
    # Verification after a sync: the probe log-probs always, plus the per-tensor checksums below. Verified: the first
    # sync of a process (start or resume), then after every step divisible by `verify_every` (1: every sync; 0: the
    # first only), so a resumed run verifies on the same steps as an uninterrupted one.
    verify_every: int = 10
    # Compare SGLang's checksum of every engine tensor (per engine TP rank, in its padded layout, MoE experts
    # included) with the trainer's; a mismatch names the tensor. Costs one hash pass over the weights on both sides.
    verify_checksums: bool = True
    # the probe check's tolerance on engine vs trainer log-probs; None: 1e-3 for an fp32 engine, 5e-2 otherwise (a
    # bf16 engine serving an fp32 trainer, MoE routing flips included, may need more; the checksums stay exact)
    probe_atol: Optional[float] = None
    # transport=distributed: the address engines on other hosts use to join the weight-broadcast group (rank 0's
    # host). None: 127.0.0.1 for engines this run starts, else this host's name (socket.gethostname()).
    master_address: Optional[str] = None
    # A LoRA run (model.lora): adapter | merged; null: adapter where it can serve the run, else merged
    # (adapter_sync_blocker: model.load, disaggregated engines, MoE expert adapters). adapter: the engines start from
    # model.path's base weights with LoRA enabled and each sync loads the adapters alone as a new named adapter that
    # the generation requests name (megarl.reshard.adapter; `transport` is not used). merged: the merged full weights
    # go over `transport`, for engines or kernels without LoRA support.
    lora_sync: Optional[str] = None
    # full: every sync pushes every tensor. delta: only the values that changed in the engine's dtype since the last
    # sync (megarl.reshard.delta; pays for a bf16/FP8 engine at RL learning rates, not for an fp32 one, where every
    # value changes), over the tensor or distributed transport; the engines start with megarl's custom weight loader
    # (--custom-weight-loader megarl.compat.sglang.load_weight_delta: add it to engines given by urls). A full
    # sync is still sent at a process's first sync, when the engine does not hold the last pushed version (a
    # restart), after a failed verification, and every `full_every` syncs (0: never on a schedule).
    mode: str = "full"
    full_every: int = 20

    def __post_init__(self):
        if self.lora_sync is not None:
            _choice("reshard.lora_sync", self.lora_sync, ("adapter", "merged"))
        if ":" not in self.transport:  # "package.module:Class": a user's transport, imported when the sync starts
            _choice("reshard.transport", self.transport, ("tensor", "distributed", "disk"))
        _choice("reshard.mode", self.mode, ("full", "delta"))
        if self.mode == "delta" and self.transport == "disk":
            raise ConfigError("reshard.mode=delta sends the changed values in buckets, but reshard.transport=disk makes "
                              "the engine reload a whole folder. Fix: reshard.transport=tensor or distributed, or "
                              "reshard.mode=full")
        _at_least("reshard", self, ("bucket_mb",))
        _at_least("reshard", self, ("full_every",), low=0)


@dataclass
class CheckpointConfig:
    save_every: int = 0  # steps; 0: only at the end
    # the newest checkpoints kept; older ones are removed once a new one is complete (0: keep all). The disk must hold
    # keep + 1 of them while one is written.
    keep: int = 2
    resume: bool = True  # continue from <run_dir>/checkpoints/latest when it exists
    export_hf: bool = True  # write <run_dir>/hf at the end (servable HF folder)

    def __post_init__(self):
        _at_least("checkpoint", self, ("save_every", "keep"), low=0)


@dataclass
class LoggingConfig:
    wandb: str = "offline"  # offline | online | disabled
    project: str = "megarl"
    progress: bool = True

    def __post_init__(self):
        _choice("logging.wandb", self.wandb, ("offline", "online", "disabled"))


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    pools: dict = field(default_factory=dict)  # name -> PoolConfig: more models served by SGLang (judges, verifiers)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> "TrainConfig":
        """The rules that relate several sections (each section checked its own fields when it was built: its
        __post_init__), each naming the fields it relates. Nothing is changed: a default that depends on another
        section is resolved by the entry point that uses it (`rl_algorithm`)."""
        if (self.model.path is None) == (self.model.tiny is None):
            raise ConfigError("set exactly one of model.path (an HF folder) and model.tiny (a tiny random model). Fix: "
                              "model.path=FOLDER model.tiny=null (or the other way round)")
        self.algorithm.validate()
        self._validate_placement()
        if estimator(self.algorithm.advantage_estimator).needs_groups and self.rollout.n_samples < 2:
            raise ConfigError(f"algorithm.advantage_estimator={self.algorithm.advantage_estimator} compares the "
                              f"samples of one prompt, but rollout.n_samples={self.rollout.n_samples}. Fix: set "
                              "rollout.n_samples >= 2 (e.g. 8), or use reinforce_plus_plus")
        if self.rollout.prompts_per_step % self.rl.mini_batches:
            raise ConfigError(f"rollout.prompts_per_step={self.rollout.prompts_per_step} must be divisible by "
                              f"rl.mini_batches={self.rl.mini_batches} (each mini-batch takes whole groups). Fix: "
                              f"a multiple of {self.rl.mini_batches} for rollout.prompts_per_step, or fewer "
                              "rl.mini_batches")
        if self.rollout.old_log_probs == "rollout" and self.rl.ppo_epochs * self.rl.mini_batches > 1 \
                and mismatch_mode(self.algorithm, self.rl) == "none":
            raise ConfigError("rollout.old_log_probs=rollout with several updates per batch uses the engine's "
                              "log-probs as the PPO anchor. Fix: algorithm.mismatch.mode=tis (or another mode), or "
                              "rollout.old_log_probs=recompute")
        if self.rl.forgetting_kl and self.rl.ref_model is False:
            raise ConfigError("rl.forgetting_kl=true compares the policy with the initial model, which is the "
                              "reference model. Fix: rl.ref_model: true (or unset), or rl.forgetting_kl: false")
        if self.algorithm.high_entropy_only and self.rollout.old_log_probs != "recompute":
            raise ConfigError("algorithm.high_entropy_only selects tokens by the old policy's entropy, which only the "
                              "trainer's recompute pass gives. Fix: rollout.old_log_probs: recompute")
        if self.algorithm.pack_sequences and self.parallel.cp > 1:
            raise ConfigError(f"algorithm.pack_sequences=true is not wired for parallel.cp={self.parallel.cp} (THD "
                              "packing under context parallelism needs cu_seqlens padded per CP shard). Fix: "
                              "algorithm.pack_sequences: false (or unset: packed only without CP)")
        if self.algorithm.policy_loss == "fipo" and self.parallel.cp > 1:
            raise ConfigError(f"algorithm.policy_loss=fipo sums each sequence's future log-ratios, which "
                              f"parallel.cp={self.parallel.cp} splits over ranks. Fix: parallel.cp: 1")
        self._validate_lora_sync()
        self._validate_teacher()
        self._validate_pools()
        self._validate_eval_reward()
        if self.algorithm.temperature != self.rollout.temperature:
            raise ConfigError(f"algorithm.temperature={self.algorithm.temperature} must equal rollout.temperature="
                              f"{self.rollout.temperature}: the trainer's log-probs must be of the distribution the "
                              f"engine sampled from. Fix: algorithm.temperature={self.rollout.temperature}")
        return self

    def _validate_lora_sync(self) -> None:
        mode = self.reshard.lora_sync
        if mode is not None and self.model.lora is None:
            raise ConfigError(f"reshard.lora_sync={mode} is set but model.lora is not (a full fine-tuning run pushes "
                              "its full weights). Fix: unset reshard.lora_sync, or set model.lora")
        if self.reshard.mode == "delta" and adapter_sync(self) is not None:
            raise ConfigError("reshard.mode=delta changes the engine's full weights, but this LoRA run syncs its "
                              "adapters alone (reshard.lora_sync=adapter, or unset). Fix: reshard.mode=full, or "
                              "reshard.lora_sync=merged")
        blocker = adapter_sync_blocker(self)
        if mode == "adapter" and blocker:
            raise ConfigError(f"reshard.lora_sync=adapter: {blocker}. Fix: reshard.lora_sync=merged (merged full "
                              "weights), or leave it unset (a LoRA run then picks merged by itself)")

    def _validate_teacher(self) -> None:
        t, name = self.teacher, self.algorithm.advantage_estimator
        needs_teacher = estimator(name).needs_teacher
        if needs_teacher and not t.enabled:
            raise ConfigError(f"algorithm.advantage_estimator={name} distils from a teacher, but the teacher: "
                              "section is empty. Fix: set teacher.model (an HF folder with the policy's tokenizer) "
                              "or teacher.urls")
        if t.enabled and not needs_teacher:
            raise ConfigError(f"teacher.{'model' if t.model else 'urls'} is set but algorithm.advantage_estimator="
                              f"{name} does not use a teacher. Fix: advantage_estimator: opd, or unset teacher")
        if name == "opd" and self.algorithm.opd_reward_weight and self.rollout.n_samples < 2:
            raise ConfigError(f"algorithm.opd_reward_weight={self.algorithm.opd_reward_weight} mixes in the task "
                              f"reward's GRPO advantage, which needs rollout.n_samples >= 2 (got "
                              f"{self.rollout.n_samples}). Fix: rollout.n_samples: 4, or opd_reward_weight: 0")

    def _validate_eval_reward(self) -> None:
        """reward.eval_name, the held-out checker: a reward the reward workers can run; reasoning-gym prompts are
        checked by their tasks' scorers."""
        from ..data.code import check_answer_format

        check_answer_format(self.data.answer_format)
        # data whose answers only one built-in reward reads (another built-in one would score every response 0)
        # (the training prompts are scored by reward.name, the held-out ones by reward.eval_name or else reward.name)
        needs = {"reasoning_gym": "reasoning_gym", "humaneval": "code"}
        eval_source = self.data.eval or self.data.train
        eval_field = "reward.eval_name" if self.reward.eval_name else "reward.name"
        for source, field in ((self.data.train, "reward.name"), (eval_source, eval_field)):
            need = needs.get("humaneval" if self.data.answer_format else source)  # answer_format: code tests
            value = self._value(field)
            if need and value in ("math", "exact_match", "code", "reasoning_gym") and value != need:
                what = "data.answer_format" if self.data.answer_format else source
                raise ConfigError(f"{field}={value}: the answers of {what} are read by reward {need} only. Fix: "
                                  f"{field}={need}")
        if self.reward.eval_name is None:
            return
        if self.reward.eval_name == "judge":
            raise ConfigError("reward.eval_name=judge: held-out evaluation takes a checker run by the reward workers; "
                              "a judge is scored through its pool. Fix: e.g. reward.eval_name=exact_match, or leave "
                              "it unset")
        from ..rewards.functions import resolve_reward

        try:
            resolve_reward(self.reward.eval_name, "reward.eval_name")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _validate_pools(self) -> None:
        """pools.<name> -> PoolConfig (unknown keys and wrong types named by their dotted field), each checked; the
        judge reward's stages name existing pools."""
        from ..config import build
        from ..rollout.router import POLICIES

        if not isinstance(self.pools, dict):
            raise ConfigError(f"pools must be a mapping of pool name -> pool settings, got {self.pools!r}. Fix: e.g. "
                              "pools: {judge: {model: /path/to/judge}}")
        pools = {}
        for name, raw in self.pools.items():
            if name in ("policy", "teacher"):
                raise ConfigError(f"pools.{name} is reserved ({'rollout.engine' if name == 'policy' else 'teacher:'} "
                                  f"configures it). Fix: rename the pool, e.g. pools.judge")
            pool = raw if isinstance(raw, PoolConfig) else build(PoolConfig, raw, f"pools.{name}.")
            pools[name] = pool
            if pool.model and pool.urls:
                raise ConfigError(f"pools.{name}.model and pools.{name}.urls are both set. Fix: set model (the trainer "
                                  "starts the engines) or urls (running engines), not both")
            if not pool.enabled:
                raise ConfigError(f"pools.{name} has neither model nor urls. Fix: set pools.{name}.model (an HF "
                                  f"folder) or pools.{name}.urls (running SGLang servers)")
            for key in ("tp_size", "num_engines"):
                if getattr(pool, key) < 1:
                    raise ConfigError(f"pools.{name}.{key} must be >= 1, got {getattr(pool, key)}. Fix: e.g. 1")
            if pool.dtype is not None:
                _choice(f"pools.{name}.dtype", pool.dtype, ("bfloat16", "float32"))
            _choice(f"pools.{name}.router_policy", pool.router_policy, POLICIES)
        self.pools = pools
        meta = self.reward.judge.meta_verifier
        if self.reward.name == "verifier_agreement" and meta is not None:
            # verifier training weighted by a meta-verifier: it reads the verification request and the analysis
            _validate_judge_stage("reward.judge.meta_verifier", meta, pools, ("{prompt}", "{analysis}"))
        if self.reward.name == "judge":
            _validate_judge_stage("reward.judge", self.reward.judge, pools, ("{response}",))
            if meta is not None:
                _validate_judge_stage("reward.judge.meta_verifier", meta, pools, ("{response}", "{analysis}"))
            sv = self.reward.judge.self_verification
            if sv is not None:
                if not sv.marker.strip():
                    raise ConfigError("reward.judge.self_verification.marker is empty. Fix: the text that starts the "
                                      "policy's self-analysis, e.g. 'Self-evaluation:'")
                if sv.alpha < 0 or sv.beta < 0 or sv.alpha + sv.beta <= 0:
                    raise ConfigError(f"reward.judge.self_verification: alpha={sv.alpha} and beta={sv.beta} must be "
                                      ">= 0 and not both 0. Fix: e.g. the paper's alpha=0.76, beta=0.24")
                _check_score_parser("reward.judge.self_verification", sv.pattern)

    def _validate_placement(self) -> None:
        engine = self.rollout.engine
        if self.rollout.placement == "disaggregated":
            if engine.nodes < 1:
                raise ConfigError(f"rollout.placement=disaggregated needs rollout.engine.nodes >= 1 (the nodes that "
                                  f"run only SGLang servers), got {engine.nodes}. Fix: set rollout.engine.nodes=1 "
                                  "(or more), or use rollout.placement=colocated")
            if self.reshard.transport != "distributed":
                raise ConfigError(f"rollout.placement=disaggregated needs reshard.transport=distributed (the engines "
                                  f"are on other nodes; {self.reshard.transport!r} only reaches engines on the "
                                  "trainer's host). Fix: set reshard.transport=distributed")
        elif engine.nodes:
            raise ConfigError(f"rollout.engine.nodes={engine.nodes} is only used with rollout.placement=disaggregated "
                              "(colocated engines share the trainer's GPUs). Fix: set rollout.engine.nodes=0, or "
                              "rollout.placement=disaggregated")

    def _value(self, dotted: str):
        section, key = dotted.split(".")
        return getattr(getattr(self, section), key)


@dataclass(frozen=True)
class RolloutInputs:
    """What the rollout side of an RL run reads (megarl.trainer.workers: the rollout workers and the Rollout they
    build): its own config sections, and the run-wide values it needs, each named for what it does there.
    rollout_inputs(cfg) is the one place they are read off a TrainConfig."""
    rollout: RolloutConfig
    env: EnvConfig
    data: DataConfig  # the training prompts (data.train) and how they are read
    reward: RewardConfig  # the reward pools; reward.judge: a generative reward's models
    pools: dict  # name -> PoolConfig: the engine pools the judges are served by
    seed: int  # the prompt order and every request's sampling seed derive from it
    greedy_baseline: bool  # the advantage's baseline is a greedy rollout of each prompt (ReMax)
    teacher: bool  # opd: each sample carries the teacher's log-probs of its tokens (teacher.enabled)
    opd_top_k: int  # ... and the teacher's top-k at each response position (0: none)
    max_staleness: int  # rl.max_staleness > 0: a producer thread collects the next steps while earlier ones train
    partial: bool  # partial rollouts: requests a weight update aborts continue under the new weights
    steps: int  # rl.steps: the producer's last step
    mini_batches: int  # rl.mini_batches: the step's plan splits each DP rank's rows into a multiple of them
    max_tokens_per_microbatch: int  # the step's plan packs rows into micro-batches of at most this many tokens
    progress: bool  # a progress bar over each step's engine requests


def rollout_inputs(cfg: TrainConfig) -> RolloutInputs:
    """The rollout side's inputs from a run's config (RLTrainer and megarl eval alike)."""
    return RolloutInputs(
        rollout=cfg.rollout, env=cfg.env, data=cfg.data, reward=cfg.reward, pools=cfg.pools, seed=cfg.seed,
        greedy_baseline=estimator(cfg.algorithm.advantage_estimator).greedy_baseline, teacher=cfg.teacher.enabled,
        opd_top_k=cfg.algorithm.opd_top_k, max_staleness=cfg.rl.max_staleness,
        partial=cfg.rl.max_staleness > 0 and cfg.rl.partial_rollouts, steps=cfg.rl.steps,
        mini_batches=cfg.rl.mini_batches, max_tokens_per_microbatch=cfg.rl.max_tokens_per_microbatch,
        progress=cfg.logging.progress)


def mismatch_mode(algorithm: AlgorithmConfig, rl: RLConfig) -> str:
    """algorithm.mismatch.mode, or its default when unset: tis with rl.max_staleness > 0, else none. Stale tokens
    trained as if on-policy learn worse (benchmarks/async_rl.py: 4-21 points of pass@1 behind the synchronous run),
    so asynchronous steps get PPO's decoupled objective unless a mode is chosen."""
    if algorithm.mismatch.mode is not None:
        return algorithm.mismatch.mode
    return "tis" if rl.max_staleness else "none"


def rl_algorithm(cfg: TrainConfig) -> AlgorithmConfig:
    """The algorithm section an RL run's step uses: cfg.algorithm with the defaults that depend on other sections
    resolved (mismatch_mode). A copy: the config itself is not changed."""
    return replace(cfg.algorithm, mismatch=replace(cfg.algorithm.mismatch, mode=mismatch_mode(cfg.algorithm, cfg.rl)))


def _validate_judge_stage(name: str, stage: JudgeStage, pools: dict, required: tuple[str, ...]) -> None:
    """One judge stage's settings; a template of its own must hold the `required` placeholders."""
    if stage.pool not in pools:
        raise ConfigError(f"{name}.pool={stage.pool!r} names no pool (pools: {sorted(pools)}). Fix: add "
                          f"pools.{stage.pool}.model (or .urls), or set {name}.pool to one of them")
    for key in ("n", "max_new_tokens"):
        if getattr(stage, key) < 1:
            raise ConfigError(f"{name}.{key} must be >= 1, got {getattr(stage, key)}. Fix: e.g. {name}.{key}=1")
    if stage.temperature < 0 or not 0 < stage.top_p <= 1:
        raise ConfigError(f"{name}: temperature={stage.temperature} must be >= 0 and top_p={stage.top_p} in (0, 1]. "
                          f"Fix: e.g. {name}.temperature=1.0, {name}.top_p=1.0")
    _choice(f"{name}.reduce", stage.reduce, ("mean", "majority"))
    _choice(f"{name}.on_parse_error", stage.on_parse_error, ("score", "skip"))
    missing = [p for p in required if stage.template is not None and p not in stage.template]
    if missing:
        raise ConfigError(f"{name}.template has no {' or '.join(missing)} placeholder: the judge would not see what "
                          f"it judges. Fix: put {' and '.join(missing)} into the template (or unset it: the default)")
    _check_score_parser(name, stage.pattern, stage.parser)
    r = stage.score_range
    if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, (int, float)) for x in r)
            and r[0] < r[1]):
        raise ConfigError(f"{name}.score_range={r!r} must be [low, high] with low < high. Fix: e.g. [0, 1] (the "
                          "DeepSeekMath-V2 verifier's 0 / 0.5 / 1) or [1, 10] for a 1-10 rating")


def _check_score_parser(name: str, pattern: Optional[str], parser: Optional[str] = None) -> None:
    """{name}.pattern compiles and {name}.parser imports (megarl.rewards.judge.make_parser), or one line naming it."""
    from ..rewards.judge import make_parser

    try:
        make_parser(pattern, parser)
    except ValueError as e:
        raise ConfigError(f"{name}.{'parser' if parser else 'pattern'}: {e}") from None


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(unknown_name(name, value, list(choices)))


def _at_least(section: str, values, names: tuple, low: int = 1) -> None:
    for name in names:
        if getattr(values, name) < low:
            default = next((f.default for f in fields(values) if f.name == name), None)
            example = f"e.g. {section}.{name}={default} (the default)" if isinstance(default, int) and \
                default >= low else f"{section}.{name}={low}"
            raise ConfigError(f"{section}.{name} must be >= {low}, got {getattr(values, name)}. Fix: {example}, or "
                              f"any integer >= {low}")


def _check_schedule(section: str, o) -> None:
    """The learning-rate schedule fields optim, sft and dpo share."""
    _choice(f"{section}.decay_style", o.decay_style, ("constant", "linear", "cosine"))
    if not o.lr > 0:
        raise ConfigError(f"{section}.lr={o.lr} must be > 0. Fix: e.g. {section}.lr=1e-6")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"{section}.min_lr={o.min_lr} must be in [0, {section}.lr={o.lr}]. Fix: e.g. "
                          f"{section}.min_lr=0")
    if o.warmup_steps < 0:
        raise ConfigError(f"{section}.warmup_steps={o.warmup_steps} must be >= 0. Fix: e.g. {section}.warmup_steps=0")
    if o.weight_decay < 0:
        raise ConfigError(f"{section}.weight_decay={o.weight_decay} must be >= 0. Fix: e.g. 0.0 or 0.01")


_SHAPE_REQUIRED = ("num_layers", "num_attention_heads", "ffn_hidden_size")


def model_shape_hint(hint: dict) -> ModelShape:
    """model.shape (a preset's hint for a model folder that is not on this machine) -> ModelShape, checked."""
    valid = [f.name for f in fields(ModelShape)]
    unknown = sorted(set(hint) - set(valid))
    if unknown:
        raise ConfigError(f"model.shape has unknown key(s) {unknown}; valid keys: {valid}. Fix: rename or remove them")
    missing = [k for k in _SHAPE_REQUIRED if k not in hint]
    if missing:
        raise ConfigError(f"model.shape needs {missing}. Fix: copy them from the model's config.json "
                          "(num_hidden_layers, num_attention_heads, intermediate_size)")
    for key, value in hint.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"model.shape.{key} must be a positive integer, got {value!r}. Fix: copy it from the "
                              "model's config.json")
    values = dict(hint)
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]  # no GQA: as many KV heads as heads
    return ModelShape(**values)


def load_train_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    return load_config(TrainConfig, path, overrides).validate()


def adapter_sync(cfg: TrainConfig) -> Optional[LoraConfig]:
    """model.lora when the run syncs its LoRA adapters only: reshard.lora_sync=adapter, or unset in a LoRA run the
    adapter sync can serve (adapter_sync_blocker); None when the engines get full weights (no LoRA, merged)."""
    if cfg.model.lora is None or cfg.reshard.lora_sync == "merged":
        return None
    if cfg.reshard.lora_sync is None and adapter_sync_blocker(cfg):
        return None
    return cfg.model.lora


def adapter_sync_blocker(cfg: TrainConfig) -> Optional[str]:
    """Why this LoRA run's engines cannot take its adapters alone (megarl.reshard.adapter), or None."""
    from ..models import lora_moe

    if cfg.model.lora is None:
        return None
    if cfg.rollout.placement == "disaggregated":
        return ("the adapters go through shared memory on the trainer's host, but rollout.placement=disaggregated "
                "runs the engines on other nodes")
    if cfg.model.load is not None:
        return (f"the engines serve model.path's base weights, but model.load={cfg.model.load} may give the trainer "
                "other ones (a full fine-tuning or SFT checkpoint)")
    experts = [t for t in cfg.model.lora.target_modules if lora_moe.is_expert_target(t)]
    if experts:
        return (f"model.lora.target_modules {experts} adapt MoE experts, which the adapter sync does not serve (its "
                "adapters are attention and dense MLP ones)")
    return None


def fleet_spec(cfg: TrainConfig) -> "FleetSpec":
    """The run's SGLang servers (megarl.rollout.server.FleetSpec) from its sections: rollout.engine, teacher (when
    enabled), pools, with the seed, <run_dir>/engine, rollout.deterministic, the MoE routing flag
    (rollout.engine_routing), the plain event loop partial rollouts need (rl.max_staleness > 0 with
    rl.partial_rollouts), LoRA serving for an adapter-only sync (adapter_sync) and the delta sync's weight loader
    (reshard.mode=delta)."""
    import os

    from ..rollout.server import FleetSpec

    return FleetSpec(engine=cfg.rollout.engine, log_dir=os.path.join(cfg.run_dir, "engine"), seed=cfg.seed,
                     seeded_sampling=cfg.rollout.deterministic, routed_experts=cfg.rollout.engine_routing,
                     plain_event_loop=cfg.rl.max_staleness > 0 and cfg.rl.partial_rollouts,
                     teacher=cfg.teacher if cfg.teacher.enabled else None, pools=dict(cfg.pools),
                     lora=adapter_sync(cfg), delta_sync=cfg.reshard.mode == "delta")
