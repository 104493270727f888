"""DPO / IPO: the preference objective against a naive per-pair reference (value and gradient, padding pairs, a
simulated CP=2 split), the preference-pair loader and its one-line errors, and `megarl dpo` end to end: two
data-parallel ranks (the test harness's torchrun environment) give the single-rank run's losses and gradient norms
step for step, and the reward accuracy and margin grow."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from megarl.config import ConfigError
from megarl.data import DataError, load_preference_pairs
from megarl.losses import TokenBatch, prepare_global_batch, shift_sequences, vocab_parallel_logprob_entropy
from megarl.losses.rl import preference_objective
from megarl.testing import run_ranks
from megarl.trainer import load_train_config
from megarl.trainer.config import DPOConfig
from tiny_rl import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
V, PADDED, S = 40, 48, 12


def _pairs_batch(seed=0, pairs=3, padding=1):
    """`pairs` pairs (chosen, rejected: same prompt, different responses) and `padding` empty pairs, as adjacent
    rows; random logits and reference log-probs; weights from seq-mean-token-mean (a pair weighs 1 / pairs)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(pairs):
        prompt = torch.randint(0, V, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
        for _ in range(2):
            prompts.append(prompt)
            responses.append(torch.randint(0, V, (int(torch.randint(1, S - 4, (1,), generator=g)),),
                                           generator=g).tolist())
    prompts += [[0]] * (2 * padding)
    responses += [[]] * (2 * padding)
    ids, targets, mask = shift_sequences(prompts, responses, pad_id=0, seq_len=S)
    batch = TokenBatch(input_ids=ids, targets=targets, loss_mask=mask,
                       ref_log_probs=(-3 + 0.5 * torch.randn(len(prompts), S, generator=g)) * mask)
    return 2 * torch.randn(len(prompts), S, PADDED, generator=g), prepare_global_batch(batch, "seq-mean-token-mean")


def _naive(logits, batch, cfg, pairs):
    """Full-vocabulary log-softmax, one pair at a time, the papers' formulas, mean over the real pairs."""
    logits = logits.clone().requires_grad_(True)
    lp = torch.log_softmax(logits[..., :V], -1).gather(-1, batch.targets[..., None])[..., 0]
    losses = []
    for k in range(pairs):
        c, r = 2 * k, 2 * k + 1
        chosen = ((lp[c] - batch.ref_log_probs[c]) * batch.loss_mask[c]).sum()
        rejected = ((lp[r] - batch.ref_log_probs[r]) * batch.loss_mask[r]).sum()
        h = chosen - rejected
        if cfg.loss_type == "ipo":
            losses.append((h - 1 / (2 * cfg.beta)) ** 2)
        else:
            eps = cfg.label_smoothing
            losses.append(-(1 - eps) * F.logsigmoid(cfg.beta * h) - eps * F.logsigmoid(-cfg.beta * h))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), logits.grad


def _ours(logits, batch, cfg, cp_group=None):
    logits = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(logits, batch.targets, vocab_size=V, chunk_size=7)
    loss, metrics = preference_objective(lp, ent, batch, cfg, cp_group=cp_group)
    loss.backward()
    return loss.detach(), logits.grad, metrics


CASES = [DPOConfig(beta=0.1), DPOConfig(beta=0.5, label_smoothing=0.2), DPOConfig(loss_type="ipo", beta=0.3)]


@pytest.mark.unit
@pytest.mark.parametrize("cfg", CASES, ids=["dpo", "cdpo", "ipo"])
def test_preference_objective_matches_naive_per_pair(cfg):
    logits, batch = _pairs_batch()
    ref_loss, ref_grad = _naive(logits, batch, cfg, pairs=3)
    loss, grad, m = _ours(logits, batch, cfg)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-5)
    assert torch.allclose(grad, ref_grad, atol=1e-6) and ref_grad.abs().max() > 1e-3
    assert torch.all(grad[6:] == 0)  # the padding pair: no loss, no gradient
    # metrics over the 3 real pairs: implicit rewards beta * (log pi - log ref) of each response
    with torch.no_grad():
        lp = torch.log_softmax(logits[..., :V], -1).gather(-1, batch.targets[..., None])[..., 0]
        rewards = cfg.beta * ((lp - batch.ref_log_probs) * batch.loss_mask).sum(-1)[:6].view(3, 2)
    mean = lambda k: (m[k][0] / m[k][1]).item()  # noqa: E731
    assert m["mean/margin"][1].item() == 3
    assert mean("mean/chosen_reward") == pytest.approx(rewards[:, 0].mean().item(), abs=1e-5)
    assert mean("mean/rejected_reward") == pytest.approx(rewards[:, 1].mean().item(), abs=1e-5)
    assert mean("mean/margin") == pytest.approx((rewards[:, 0] - rewards[:, 1]).mean().item(), abs=1e-5)
    assert mean("mean/reward_accuracy") == pytest.approx((rewards[:, 0] > rewards[:, 1]).float().mean().item())
    assert mean("mean/pair_loss") == pytest.approx(ref_loss.item(), abs=1e-5)


@pytest.mark.unit
def test_policy_equal_to_reference_gives_log_2():
    logits, batch = _pairs_batch(seed=1)
    with torch.no_grad():
        lp, _ = vocab_parallel_logprob_entropy(logits, batch.targets, vocab_size=V)
    batch.ref_log_probs = lp * batch.loss_mask
    loss, _, m = _ours(logits, batch, DPOConfig())
    assert loss.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    assert m["mean/reward_accuracy"][0].item() == 0 and abs(m["mean/margin"][0].item()) < 1e-6


def _cp_columns(rank):  # CP=2 as Megatron balances it: 4 chunks, rank 0 holds chunks 0 and 3, rank 1 holds 1 and 2
    chunk = S // 4
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in ([0, 3] if rank == 0 else [1, 2])])


def _cp_rank(logits, batch, cfg):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    cols = _cp_columns(dist.get_rank())
    shard = TokenBatch(**{k: (v[:, cols] if torch.is_tensor(v) else v) for k, v in vars(batch).items()})
    loss, grad, _ = _ours(logits[:, cols], shard, cfg, cp_group=dist.group.WORLD)
    return loss, grad


@pytest.mark.multirank
@pytest.mark.parametrize("cfg", [CASES[0], CASES[2]], ids=["dpo", "ipo"])
def test_simulated_context_parallel_gives_the_same_loss_and_gradient(cfg):
    logits, batch = _pairs_batch(seed=2)
    full_loss, full_grad, _ = _ours(logits, batch, cfg)
    results = run_ranks(2, _cp_rank, logits, batch, cfg)
    assert sum(r[0].item() for r in results) == pytest.approx(full_loss.item(), rel=1e-6)
    for rank, (_, grad) in enumerate(results):
        assert torch.allclose(grad, full_grad[:, _cp_columns(rank)], rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------------- data
@pytest.mark.unit
def test_preference_pairs_from_strings_and_chat_messages(tmp_path, tiny_model):
    from megarl.data import ChatTokenizer

    model = tiny_model("qwen2")
    tok = ChatTokenizer.from_pretrained(model)
    path = tmp_path / "pairs.jsonl"
    user = [{"role": "user", "content": "2+2="}]
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"},
        {"messages": user, "chosen": "4", "rejected": "5"}]) + "\n")
    cfg = load_train_config(None, [f"run_dir={tmp_path}/run", f"model.path={model}", "data.synthetic.num_train=30"])
    pairs = load_preference_pairs(str(path), tok, cfg.data)
    assert len(pairs) == 3 and all(p == pairs[0] for p in pairs)  # the three spellings of one pair
    assert pairs[0].prompt_ids == tok.prompt_ids(user)
    assert pairs[0].chosen_ids == tok.response_ids(user, "4") and pairs[0].rejected_ids == tok.response_ids(user, "5")
    synthetic = load_preference_pairs("synthetic", tok, cfg.data)
    assert len(synthetic) == cfg.data.synthetic.num_train and all(p.chosen_ids != p.rejected_ids for p in synthetic)

    path.write_text(json.dumps({"prompt": "2+2=", "chosen": "4"}) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl:line 1: field 'rejected' must be a non-empty string"):
        load_preference_pairs(str(path), tok, cfg.data)


@pytest.mark.unit
def test_megarl_dpo_bad_record_is_one_line_before_anything_starts(tmp_path, capsys):
    from megarl.cli import main

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "4"}) + "\n")
    assert main(["dpo", CONFIG, f"dpo.data={path}", *_args(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megarl: error: dpo.data={path}: {path}:line 1: 'chosen' and 'rejected' are the same text, so "
                   "the pair prefers nothing"], err


@pytest.mark.unit
@pytest.mark.parametrize("override,needle", [
    ("dpo.loss_type=kto", "dpo.loss_type='kto' is unknown"), ("dpo.beta=0", "dpo.beta=0.0 must be > 0"),
    ("dpo.label_smoothing=0.7", "dpo.label_smoothing=0.7 must be in [0, 0.5)"),
    ("dpo.batch_size=0", "dpo.batch_size must be >= 1")])
def test_bad_dpo_config_names_the_field(override, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_train_config(None, [f"run_dir={tmp_path}", f"model.tiny={json.dumps(TINY)}", override])
    with pytest.raises(ConfigError, match="dpo.label_smoothing=0.1 applies to dpo.loss_type=dpo only"):
        load_train_config(None, [f"run_dir={tmp_path}", f"model.tiny={json.dumps(TINY)}", "dpo.loss_type=ipo",
                                 "dpo.label_smoothing=0.1"])


# ---------------------------------------------------------------------------------------------- end to end
# 13 synthetic pairs (right answer chosen, a wrong one rejected), all of them every step; with 2 DP ranks, rank 0
# trains 7 pairs and rank 1 6 pairs and a padding pair.
CONFIG = os.path.join(ROOT, "configs", "dpo_tiny.yaml")
DPO_ARGS = ["dpo.steps=5", "dpo.batch_size=13", "dpo.max_samples=13", "dpo.lr=1e-3", "dpo.beta=0.5",
            "data.synthetic.max_operand=9", "data.synthetic.num_train=20", "data.synthetic.num_eval=4",
            "checkpoint.export_hf=false", "logging.wandb=disabled", "logging.progress=false"]


def _args(run_dir):
    return [f"run_dir={run_dir}", f"model.tiny={json.dumps(TINY)}", *DPO_ARGS]


def _cli_dpo(run_dir):
    from megarl.cli import main

    return main(["dpo", CONFIG, *_args(run_dir)])


def _metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "dpo", "dpo_metrics.jsonl"))]


@pytest.mark.e2e
def test_dpo_two_ranks_match_one_and_learn_the_preference(tmp_path):
    # `megarl dpo` itself (megarl.cli.main) on ranks with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    # forked by the test harness after one import: ~2 s here instead of ~40 s for two fresh torchrun interpreters
    assert run_ranks(2, _cli_dpo, str(tmp_path / "dp2"), timeout=300) == [0, 0]
    assert run_ranks(1, _cli_dpo, str(tmp_path / "one"), timeout=300) == [0]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "dp2")
    assert [m["step"] for m in one] == [m["step"] for m in two] == list(range(1, 6))
    for a, b in zip(one, two):  # the layout changes neither the loss nor the gradient
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["margin"] == pytest.approx(b["margin"], abs=1e-5)
        assert a["reward_accuracy"] == b["reward_accuracy"]
    assert one[0]["loss"] == pytest.approx(0.693147, abs=1e-5) and one[0]["reward_accuracy"] == 0  # policy == ref
    # the same 13 pairs every step: the loss falls and the margin grows step after step, the accuracy reaches ~all
    assert all(b["loss"] < a["loss"] and b["margin"] > a["margin"] for a, b in zip(one, one[1:])), one
    assert one[-1]["loss"] < 0.4 and one[-1]["margin"] > 1.0 and one[-1]["reward_accuracy"] >= 0.9, one[-1]
    assert one[-1]["chosen_reward"] > one[-1]["rejected_reward"]
    summary = json.load(open(tmp_path / "one" / "dpo" / "dpo_summary.json"))
    assert summary["steps"] == 5 and summary["pairs"] == 13
