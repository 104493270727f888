"""On-policy distillation (algorithm.advantage_estimator: opd): A_t = teacher log-prob - student log-prob per sampled
token (+ opd_reward_weight x the task reward's GRPO advantage). The estimator against a naive per-token reference; the
config's one-line errors; the teacher log-probs carried per response token through the packed rollout and the dispatch's
receive buffers; a teacher with another tokenizer refused. With a real SGLang server on CPU serving the teacher (a tiny
model with the policy's tokenizer and other weights): the rollout's teacher log-probs equal transformers' log-probs of
the same tokens, and the advantages of the trainer's advantage step, on the DP ranks the dispatch sends the samples to,
equal teacher - student computed independently with transformers. With algorithm.opd_top_k: the top-k reverse KL
against a naive coarsening of full-vocabulary softmaxes (and the full KL at k = vocabulary), through the Megatron loss
adapter at TP=1 and TP=2 (value and gradient); the teacher's top-k from the engine equal transformers' and reach the
ranks' token batches at their tokens' positions."""
import types

import numpy as np
import pytest
import torch

from megarl.algorithms import compute_advantages
from megarl.algorithms.advantages import estimator
from megarl.errors import UserError
from megarl.testing import run_ranks, tiny_model_dir
from megarl.trainer.batching import PackedRollout, Sample
from megarl.trainer.dispatch import Shape


def text_checksum(response: str, answer, **_) -> float:
    """A reward that changes with any character of the response (a random model's texts all score differently)."""
    return (sum(map(ord, response)) % 997) / 997


def _naive_opd(teacher, student, mask, scores, groups, weight):
    adv = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        peers = [scores[k] for k in range(len(scores)) if groups[k] == groups[i]]
        mean = sum(peers) / len(peers)
        std = (sum((p - mean) ** 2 for p in peers) / max(len(peers) - 1, 1)) ** 0.5
        for t in range(mask.shape[1]):
            if mask[i, t]:
                adv[i, t] = teacher[i, t] - student[i, t] + weight * (scores[i] - mean) / (std + 1e-6)
    return adv


@pytest.mark.unit
@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_opd_matches_naive_reference(weight):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 7, generator=g) > 0.3).float()
    teacher, student = -3 * torch.rand(6, 7, generator=g), -3 * torch.rand(6, 7, generator=g)
    scores, groups = torch.tensor([0.0, 1.0, 1.0, 0.5, 0.3, 0.9]), torch.tensor([0, 0, 1, 1, 2, 2])
    adv, log_ratio = compute_advantages("opd", teacher_log_probs=teacher, student_log_probs=student, mask=mask,
                                        scores=scores, group_ids=groups, opd_reward_weight=weight)
    assert torch.allclose(adv, _naive_opd(teacher, student, mask, scores.tolist(), groups.tolist(), weight), atol=1e-6)
    assert torch.equal(log_ratio, (teacher - student) * mask)
    opd = estimator("opd")
    assert opd.needs_teacher and not opd.needs_groups  # pure distillation: one sample per prompt is fine
    assert opd.returns_teacher_log_ratio  # the trainer logs opd/reverse_kl from these returns
    with pytest.raises(ValueError, match="opd needs `teacher_log_probs`"):
        compute_advantages("opd", student_log_probs=student, mask=mask, teacher_log_probs=None)


def _cfg(*overrides):
    from megarl.trainer import load_train_config

    return load_train_config(None, [f"model.path={tiny_model_dir('qwen2')}", *overrides])


@pytest.mark.unit
@pytest.mark.parametrize("overrides,field", [
    (["algorithm.advantage_estimator=opd"], "algorithm.advantage_estimator=opd"),
    (["teacher.urls=[http://x:1]"], "teacher.urls"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "teacher.urls=[http://x:1]"], "teacher.model"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "teacher.dtype=fp8"], "teacher.dtype"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "teacher.tp_size=0"], "teacher.tp_size"),
    (["algorithm.opd_reward_weight=0.5"], "algorithm.opd_reward_weight"),
    (["algorithm.opd_top_k=4"], "algorithm.opd_top_k"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "algorithm.opd_top_k=4", "algorithm.opd_top_k_kl=x"],
     "algorithm.opd_top_k_kl"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "algorithm.opd_top_k=-1"], "algorithm.opd_top_k"),
    (["algorithm.advantage_estimator=opd", "teacher.model=/m", "algorithm.opd_reward_weight=0.5",
      "rollout.n_samples=1"], "algorithm.opd_reward_weight"),
])
def test_config_errors_are_one_line_naming_the_field(overrides, field):
    with pytest.raises(UserError) as info:
        _cfg(*overrides)
    message = str(info.value)
    assert "\n" not in message and message.startswith(field), message
    assert "Fix:" in message or "choose one of" in message, message
    assert _cfg("algorithm.advantage_estimator=opd", "teacher.model=/m", "rollout.n_samples=1").teacher.enabled


@pytest.mark.unit
def test_teacher_log_probs_travel_with_their_sample():
    samples = [Sample(group=k // 2, prompt_index=k, prompt_ids=[1, 2, 3][: k % 3 + 1], response_ids=[4] * (k + 1),
                      rollout_log_probs=[-0.5] * (k + 1), finish_reason="stop",
                      loss_mask=[1, 0, 1] if k == 2 else None,
                      teacher_log_probs=[-(k + j / 10) for j in range(k + 1)]) for k in range(4)]
    packed = PackedRollout.from_samples(samples)
    assert packed.teacher_log_probs.dtype == torch.float32 and packed.teacher_log_probs.numel() == 10
    picked = PackedRollout.cat([packed.select([3, 1]), packed.select([2, 0])])
    assert torch.equal(picked.teacher_log_probs, packed.teacher_log_probs)
    grid = packed.per_token(packed.teacher_log_probs, rows=5, seq_len=8)
    for i, s in enumerate(samples):  # response token j is predicted at position prompt_len - 1 + j, masked
        for j, value in enumerate(s.teacher_log_probs):
            trained = s.loss_mask is None or s.loss_mask[j]
            assert grid[i, len(s.prompt_ids) - 1 + j] == pytest.approx(value if trained else 0.0)
    assert int((grid != 0).sum()) == sum(1 for s in samples for j in range(len(s.response_ids))
                                         if (s.loss_mask is None or s.loss_mask[j]) and s.teacher_log_probs[j])
    shape = Shape.of(packed.select([1]), rows=2, seq_len=8, num_microbatches=1)
    assert shape.optional == 0b01 and shape.empty().teacher_log_probs.shape == (2,)  # what a DP leader receives into
    assert PackedRollout.from_samples(samples, teacher=False).teacher_log_probs is None
    assert Shape.of(PackedRollout.from_samples(samples, teacher=False), 2, 8, 1).empty().teacher_log_probs is None
    with pytest.raises(ValueError, match="one teacher log-prob per response token"):
        PackedRollout.from_samples(samples[:1] + [Sample(0, 0, [1], [2, 3], [0.0, 0.0], "stop")])


@pytest.mark.unit
def test_teacher_with_another_tokenizer_is_refused():
    from megarl.rollout.teacher import TeacherTokenizerMismatch, check_same_tokenizer

    policy = tiny_model_dir("qwen2")
    check_same_tokenizer(policy, tiny_model_dir("qwen2", seed=1, num_hidden_layers=2))  # other size, same tokenizer
    other = tiny_model_dir("qwen2", tokenizer="char")
    with pytest.raises(TeacherTokenizerMismatch) as info:
        check_same_tokenizer(policy, other)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"teacher.model={other!r}") and "Fix:" in message


@pytest.mark.unit
def test_trainer_starts_one_teacher_server_through_the_engine_config(monkeypatch, tmp_path):
    """megarl.rollout.fleet.launch_teacher: the policy engines' ServerConfig builder with the teacher's model, TP size and dtype,
    its own log folder, on the GPUs after the policy engines'; the server is kept apart from the policy's (so the
    weight syncs, built from the policy's servers only, never reach it)."""
    from megarl.rollout.fleet import launch_teacher
    from megarl.rollout.server import SGLangServer
    from megarl.trainer.config import fleet_spec

    monkeypatch.setattr(SGLangServer, "launch", lambda self: self)  # the config only: no process
    cfg = _cfg(f"run_dir={tmp_path}", "algorithm.advantage_estimator=opd", "teacher.model=/teacher",
               "teacher.tp_size=2", "teacher.dtype=bfloat16", "rollout.engine.num_engines=2",
               "rollout.return_routed_experts=true")
    server = launch_teacher(fleet_spec(cfg), 0, now=True)
    c = server.cfg
    assert (c.model_path, c.tp_size, c.dtype, c.base_gpu_id) == ("/teacher", 2, "bfloat16", 2)
    assert c.log_dir == str(tmp_path / "engine" / "teacher") and "--enable-return-routed-experts" not in c.extra_args
    assert launch_teacher(fleet_spec(cfg), 1, now=True) is None  # rank 0 only
    no_model = _cfg("algorithm.advantage_estimator=opd", "teacher.urls=[http://t:1]")
    assert launch_teacher(fleet_spec(no_model), 0, now=True) is None


# ----------------------------------------------------------------------------------------- with a real engine
@pytest.fixture
def teacher_engine(tiny_qwen2_engine):
    # the teacher: the session's tiny Qwen2 server (megarl.testing.fixtures); the student has the same family and
    # tokenizer, other (seed 1) weights
    return tiny_qwen2_engine


def _hf_log_probs(model, prompt, response) -> list[float]:
    """transformers' log p(response[j] | prompt + response[:j]) in fp32."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) - 1 + j, int(t)]) for j, t in enumerate(response)]


def _hf_top_k(model, prompt, response, k):
    """transformers' k most likely tokens at each response position, and their log-probs (fp32)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    top_lp, top_ids = logp[len(prompt) - 1:len(prompt) - 1 + len(response)].topk(k, dim=-1)
    return top_ids, top_lp


def _opd_rank(samples, n, student_path, weight, top_k):
    """One DP rank of a DP=2 step: rank 0 (the rollout worker) dispatches the samples; each rank computes its rows'
    student (old) log-probs with transformers and runs the trainer's advantage phase (megarl.trainer.step)."""
    from transformers import AutoModelForCausalLM

    from megarl import parallel
    from megarl.trainer.batching import BatchPlan, RankBatch
    from megarl.trainer.dispatch import dispatch
    from megarl.trainer.step import advantages as advantages_phase

    parallel.initialize(parallel.ParallelConfig())
    groups = parallel.groups()
    packed = plan = None
    if torch.distributed.get_rank() == 0:
        packed = PackedRollout.from_samples(samples, routing=False, group_size=n, teacher=True, teacher_top_k=top_k)
        plan = BatchPlan.make(packed.seq_lens, packed.group, groups.dp_size, 1, 4096)
    got = dispatch(packed, plan, groups)
    rb = RankBatch(got.share.token_batch(got.rows, got.seq_len, 0), got.share, got.num_microbatches)
    model = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(rb.batch.input_ids).logits.float(), dim=-1)
    rb.batch.old_log_probs = logp.gather(-1, rb.batch.targets[..., None])[..., 0] * rb.batch.loss_mask
    cfg = _cfg("algorithm.advantage_estimator=opd", "teacher.urls=[http://unused:1]", f"rollout.n_samples={n}",
               f"algorithm.opd_reward_weight={weight}", f"algorithm.opd_top_k={top_k}")
    advantages, _ = advantages_phase(rb, cfg.algorithm, groups.mcore.dp)
    return {"sample_index": rb.sample_index, "prompt_lens": rb.samples.prompt_lens.tolist(),
            "advantages": advantages, "dp_rank": groups.dp_rank, "top_ids": rb.batch.teacher_top_ids}


@pytest.mark.engine
@pytest.mark.parametrize("top_k", [0, 4])
def test_teacher_log_probs_and_opd_advantages_equal_transformers(teacher_engine, tmp_path, top_k):
    """top_k 0: A_t = teacher - student (+ the reward share); top_k 4 (algorithm.opd_top_k): the samples also carry
    the teacher's top-4 at every response position, equal to transformers', through the dispatch to the ranks'
    token batches, and the advantage is the reward share alone (the distillation is the loss's top-k KL)."""
    from megarl.data import ChatTokenizer, load_prompts
    from megarl.rewards import RewardPool
    from megarl.rollout import EngineClient, EngineRouter
    from megarl.rollout.teacher import Teacher, TeacherTokenizerMismatch
    from megarl.trainer.config import rollout_inputs
    from megarl.trainer.rollout import PromptStream
    from megarl.trainer.workers import build_rollout

    student, teacher = tiny_model_dir("qwen2", seed=1), tiny_model_dir("qwen2")
    n, weight = 2, 0.5
    cfg = _cfg(f"model.path={student}", f"run_dir={tmp_path}", "algorithm.advantage_estimator=opd", f"teacher.urls=[{teacher_engine.url}]",
               f"rollout.n_samples={n}", "rollout.prompts_per_step=4", "rollout.request_size=1",
               "rollout.max_new_tokens=6", "reward.name=test_opd:text_checksum", "reward.workers=1",
               "data.synthetic.num_train=20", "logging.progress=false", f"algorithm.opd_reward_weight={weight}",
               f"algorithm.opd_top_k={top_k}")
    tok = ChatTokenizer.from_pretrained(student)
    client = EngineClient(teacher_engine.url)
    rewards = RewardPool(cfg.reward.name, cfg.reward.workers)
    # one engine in this test: it samples the responses and, as the teacher, scores them (a trainer samples from the
    # policy's engines; which engine sampled does not change the teacher's log-probs of the tokens)
    Teacher([client]).check_tokenizer(student)  # teacher.urls: the server's tokenizer (SGLang /model_info) is the same
    with pytest.raises(TeacherTokenizerMismatch, match=r"^teacher\.urls\[0\] .* Fix: "):
        Teacher([client]).check_tokenizer(tiny_model_dir("qwen2", tokenizer="char"))
    rollout = build_rollout(rollout_inputs(cfg), tok, EngineRouter([client]), rewards, teacher=Teacher([client]))
    try:
        samples, _ = rollout.collect(PromptStream(load_prompts("synthetic", tok, cfg.data), seed=0), step=1)
    finally:
        rollout.close()
        rewards.close()
    assert len(samples) == 4 * n and sum(len(s.response_ids) for s in samples) > 4 * n
    from transformers import AutoModelForCausalLM

    hf_teacher, hf_student = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
                              for p in (teacher, student))
    expected_teacher, expected_student, error = [], [], 0.0
    for s in samples:
        assert s.teacher_log_probs.dtype == np.float32 and len(s.teacher_log_probs) == len(s.response_ids)
        ref = _hf_log_probs(hf_teacher, s.prompt_ids, s.response_ids)
        error = max([error] + [abs(a - b) for a, b in zip(s.teacher_log_probs.tolist(), ref)])
        expected_teacher.append(ref)
        expected_student.append(_hf_log_probs(hf_student, s.prompt_ids, s.response_ids))
        if top_k:
            ids, lps = _hf_top_k(hf_teacher, s.prompt_ids, s.response_ids, top_k)
            assert s.teacher_top_ids.shape == (len(s.response_ids), top_k) == s.teacher_top_log_probs.shape
            assert np.abs(s.teacher_top_log_probs - lps.numpy()).max() < 1e-4
            # the same tokens, unless two of them tie to within the engine's rounding
            same = s.teacher_top_ids == ids.numpy()
            assert same.all() or np.abs(np.diff(lps.numpy(), axis=-1)).min() < 1e-4, (s.teacher_top_ids, ids)
        else:
            assert s.teacher_top_ids is None
    print(f"teacher engine vs transformers: max |diff| {error:.2e} over {sum(map(len, expected_teacher))} tokens")
    assert error < 1e-4
    gap = max(abs(a - b) for t, st in zip(expected_teacher, expected_student) for a, b in zip(t, st))
    assert gap > 0.05  # the teacher is another model: the advantages are not zero by construction

    results = run_ranks(2, _opd_rank, samples, n, student, weight, top_k)
    scores = torch.tensor([s.score for s in samples])
    seen = []
    for r in results:
        for row, (index, prompt_len) in enumerate(zip(r["sample_index"], r["prompt_lens"])):
            s = samples[index]
            peers = scores[[k for k, p in enumerate(samples) if p.group == s.group]]
            grpo = (s.score - peers.mean()) / (peers.std() + 1e-6)
            want = [(0 if top_k else t - st) + weight * float(grpo)
                    for t, st in zip(expected_teacher[index], expected_student[index])]
            got = r["advantages"][row, prompt_len - 1:prompt_len - 1 + len(want)].tolist()
            assert got == pytest.approx(want, abs=2e-4), index
            assert float(r["advantages"][row].abs().sum()) == pytest.approx(sum(map(abs, want)), abs=1e-3)
            if top_k:  # the teacher's top-k reached this rank's token batch at the tokens' positions
                got_ids = r["top_ids"][row, prompt_len - 1:prompt_len - 1 + len(want)]
                assert np.array_equal(got_ids.numpy(), s.teacher_top_ids.astype(np.int64)), index
            else:
                assert r["top_ids"] is None
            seen.append(index)
    assert sorted(seen) == list(range(len(samples))) and {r["dp_rank"] for r in results} == {0, 1}


# ------------------------------------------------------------------------------- top-k distillation (opd_top_k)
V_TOP, PADDED_TOP = 30, 32  # 2 padded columns, as Megatron's vocabulary padding leaves


def _naive_coarse_kl(student_logits, teacher_logits, top_ids, direction="reverse"):
    """KL(student || teacher) (reverse) or KL(teacher || student) (forward) of the distributions coarsened to (each of
    the ids, everything else), one position at a time from full-vocabulary softmaxes: [V] logits each, [k] ids."""
    p, q = torch.softmax(student_logits, -1), torch.softmax(teacher_logits, -1)
    outside = torch.ones_like(p, dtype=torch.bool)
    outside[top_ids] = False
    p_buckets = torch.cat([p[top_ids], p[outside].sum()[None]])
    q_buckets = torch.cat([q[top_ids], q[outside].sum()[None]])
    if direction == "forward":
        p_buckets, q_buckets = q_buckets, p_buckets
    return (p_buckets * (p_buckets.clamp(min=1e-8).log() - q_buckets.clamp(min=1e-8).log())).sum()


@pytest.mark.unit
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_kl_is_the_coarsened_kl_and_the_full_kl_at_k_equal_vocab(direction):
    from megarl.algorithms import topk_kl

    g = torch.Generator().manual_seed(0)
    student, teacher = 2 * torch.randn(5, V_TOP, generator=g), 2 * torch.randn(5, V_TOP, generator=g)
    for k in (1, 4, V_TOP):
        top_lp, top_ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
        s = student.clone().requires_grad_(True)
        ours = topk_kl(torch.log_softmax(s, -1).gather(-1, top_ids), top_lp, direction)
        ours.sum().backward()
        n = student.clone().requires_grad_(True)
        naive = torch.stack([_naive_coarse_kl(n[i], teacher[i], top_ids[i], direction) for i in range(5)])
        naive.sum().backward()
        assert torch.allclose(ours, naive, atol=1e-5) and torch.allclose(s.grad, n.grad, atol=1e-5), k
        log_p, log_q = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
        full = (log_p.exp() * (log_p - log_q) if direction == "reverse" else log_q.exp() * (log_q - log_p)).sum(-1)
        if k == V_TOP:  # every token is its own bucket: the full-vocabulary KL
            assert torch.allclose(ours, full, atol=1e-5)
        else:  # coarsening loses information: never more than the full KL
            assert torch.all(ours <= full + 1e-6) and torch.all(ours > 0)
    with pytest.raises(ValueError, match="opd_top_k_kl='both' is unknown"):
        topk_kl(top_lp, top_lp, "both")
    # the top-k advantage: only the task reward's share remains (the distillation is in the loss)
    mask, lp = torch.ones(4, 3), -torch.rand(4, 3, generator=g)
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    adv, log_ratio = compute_advantages("opd", teacher_log_probs=lp, student_log_probs=lp + 0.3, mask=mask,
                                        scores=scores, group_ids=groups, opd_reward_weight=0.5, opd_top_k=4)
    grpo, _ = compute_advantages("grpo", scores=scores, group_ids=groups, mask=mask)
    assert torch.allclose(adv, 0.5 * grpo) and torch.allclose(log_ratio, -0.3 * mask)


def _top_k_case(k=4, seed=1):
    """Logits of a student over a padded vocabulary, a teacher's top-k at every position, a token batch of random
    prompts/responses carrying them (advantages 0: the loss is the distillation term alone)."""
    from megarl.losses import TokenBatch, prepare_global_batch, shift_sequences

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [[1, 2], [3], [4, 5, 6]], [[7, 8, 9], [10, 11, 12, 13], [14]]
    ids, targets, mask = shift_sequences(prompts, responses, pad_id=0, seq_len=8)
    logits = 2 * torch.randn(3, 8, PADDED_TOP, generator=g)
    logits[..., V_TOP:] = 4.0  # padded columns must not count
    teacher = 2 * torch.randn(3, 8, V_TOP, generator=g)
    top_lp, top_ids = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    with torch.no_grad():
        old = torch.log_softmax(logits[..., :V_TOP], -1).gather(-1, targets[..., None])[..., 0] * mask
    batch = TokenBatch(input_ids=ids, targets=targets, loss_mask=mask, advantages=torch.zeros_like(mask),
                       old_log_probs=old, rollout_log_probs=old, teacher_top_ids=top_ids * mask.long()[..., None],
                       teacher_top_log_probs=top_lp * mask[..., None])
    return logits, teacher, prepare_global_batch(batch, "token-mean", seq_multiple=1)


def _top_k_loss(logits, batch, tp_group=None, rank=0, tp=1, direction="reverse"):
    """make_loss_func (the Megatron adapter) with opd_top_k on this TP rank's vocabulary slice: (loss, grad)."""
    from megarl.algorithms import AlgorithmConfig

    one = types.SimpleNamespace(size=lambda: 1)
    pg = types.SimpleNamespace(tp=tp_group or one, cp=one, dp=one)
    cfg = AlgorithmConfig(advantage_estimator="opd", opd_top_k=batch.teacher_top_ids.shape[-1], kl_coef=0.0,
                          entropy_coef=0.0, opd_top_k_kl=direction).validate()
    from megarl.losses.rl import make_loss_func

    width = PADDED_TOP // tp
    shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    loss, metrics = make_loss_func(batch, cfg, num_microbatches=1, vocab_size=V_TOP, pg=pg, tp_group=tp_group)(shard)
    loss.backward()
    return loss.detach(), shard.grad, metrics


def _top_k_tp2(direction):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    logits, _, batch = _top_k_case()
    return _top_k_loss(logits, batch, dist.group.WORLD, dist.get_rank(), tp=2, direction=direction)[:2]


@pytest.mark.multirank
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_opd_top_k_loss_equals_the_naive_coarsened_kl_at_tp1_and_tp2(direction):
    """The loss make_loss_func builds with the teacher's top-k in the batch: token-mean of the coarsened reverse KL
    over the response tokens (advantages 0), value and gradient against full-vocabulary softmaxes, and the same split
    over two vocabulary-parallel ranks."""
    logits, teacher, batch = _top_k_case()
    n = logits.clone().requires_grad_(True)
    per_token = torch.zeros(batch.loss_mask.shape)
    for i, t in zip(*torch.nonzero(batch.loss_mask, as_tuple=True)):
        per_token[i, t] = _naive_coarse_kl(n[i, t, :V_TOP], teacher[i, t], batch.teacher_top_ids[i, t], direction)
    naive = (per_token * batch.loss_mask).sum() / batch.loss_mask.sum()
    naive.backward()
    loss, grad, metrics = _top_k_loss(logits, batch, direction=direction)
    assert float(loss) == pytest.approx(float(naive), abs=1e-6) and float(naive) > 0.05
    assert torch.allclose(grad, n.grad, atol=1e-6) and torch.all(grad[..., V_TOP:] == 0)
    kl_sum, count = metrics["mean/opd_topk_kl"]
    assert float(kl_sum / count) == pytest.approx(float(naive), abs=1e-5)
    results = run_ranks(2, _top_k_tp2, direction)
    assert all(float(r[0]) == pytest.approx(float(loss), abs=1e-6) for r in results)
    assert torch.allclose(torch.cat([r[1] for r in results], dim=-1), grad, atol=1e-6)


@pytest.mark.unit
def test_teacher_top_k_travels_with_its_sample():
    k = 3
    samples = [Sample(group=i, prompt_index=i, prompt_ids=[1] * (i + 1), response_ids=[4] * (i + 2),
                      rollout_log_probs=[-0.5] * (i + 2), finish_reason="stop", teacher_log_probs=[-1.0] * (i + 2),
                      teacher_top_ids=np.arange((i + 2) * k, dtype=np.int32).reshape(i + 2, k) + 100 * i,
                      teacher_top_log_probs=-np.arange((i + 2) * k, dtype=np.float32).reshape(i + 2, k) / 10)
               for i in range(3)]
    packed = PackedRollout.from_samples(samples)
    assert packed.teacher_top_ids.shape == (2 + 3 + 4, k) and packed.teacher_top_ids.dtype == torch.int32
    picked = PackedRollout.cat([packed.select([2]), packed.select([0, 1])])
    assert torch.equal(picked.teacher_top_ids, packed.teacher_top_ids)
    shape = Shape.of(packed.select([1, 2]), rows=2, seq_len=8, num_microbatches=1)
    empty = shape.empty()  # what a DP leader receives into
    assert shape.top_k == k and empty.teacher_top_ids.shape == (7, k) and empty.teacher_top_log_probs.shape == (7, k)
    batch = packed.token_batch(rows=4, seq_len=8, pad_id=0)
    assert batch.teacher_top_ids.shape == (4, 8, k) and batch.teacher_top_ids.dtype == torch.long
    for i, s in enumerate(samples):  # response token j at position prompt_len - 1 + j
        start = len(s.prompt_ids) - 1
        assert batch.teacher_top_ids[i, start:start + len(s.response_ids)].tolist() == s.teacher_top_ids.tolist()
        assert torch.equal(batch.teacher_top_log_probs[i, start:start + len(s.response_ids)],
                           torch.from_numpy(s.teacher_top_log_probs))
    assert int(batch.teacher_top_ids.count_nonzero(-1).count_nonzero()) == sum(len(s.response_ids) for s in samples)
    assert PackedRollout.from_samples(samples, teacher_top_k=0).teacher_top_ids is None
    with pytest.raises(ValueError, match="top-3 ids and log-probs per response token"):
        PackedRollout.from_samples(samples + [Sample(9, 9, [1], [2], [0.0], "stop", teacher_log_probs=[0.0])])
