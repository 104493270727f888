"""The trainer end to end: SFT label alignment, and RL under torchrun with the real SGLang engine on CPU — token ids
trained byte-identical to the engine's; a rank SIGKILLed mid-run restarted by torchrun and resumed exactly; an engine
SIGKILLed mid-run restarted and restored without a sample lost or trained on the wrong weights."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_run_engine
from megarl.trainer.rl import dumped_samples
from tiny_rl import TINY, write_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


# ------------------------------------------------------------------------------------------------------------ SFT
def _sft_copy_task(tmp):
    from megarl.trainer import load_train_config, run_sft

    letters = "abcdefghijklmnopqrstuvwxyz"
    data = os.path.join(tmp, "copy.jsonl")
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(400):
            c = rng.choice(letters)
            f.write(json.dumps({"messages": [{"role": "user", "content": c},
                                             {"role": "assistant", "content": c}]}) + "\n")
    # the shapes this convergence threshold was set with (tiny_rl's TINY has since become deliberately odd)
    tiny = dict(TINY, overrides=dict(TINY["overrides"], intermediate_size=128, num_key_value_heads=2, vocab_size=384))
    cfg = load_train_config(None, [f"run_dir={tmp}/run", f"model.tiny={json.dumps(tiny)}", f"sft.data={data}",
                                   "sft.steps=60", "sft.batch_size=32", "sft.lr=3e-3", "sft.warmup_steps=5",
                                   "logging.wandb=disabled", "logging.progress=false"])
    return run_sft(cfg)


@pytest.mark.e2e
def test_sft_learns_a_task_that_needs_aligned_labels(tmp_path):
    """The assistant must repeat the user's letter: only the position before the answer, trained to predict the
    answer token, can learn it. A label shift off by one would train position t on its own token instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = run_ranks(1, _sft_copy_task, str(tmp_path), timeout=600)[0]
    assert summary["steps"] == 60 and os.path.isdir(summary["checkpoint"])
    hf = tmp_path / "run" / "sft" / "hf"
    tok, model = AutoTokenizer.from_pretrained(hf), AutoModelForCausalLM.from_pretrained(hf).eval()
    correct = 0
    for c in "abcdefghijklmnopqrstuvwxyz":
        ids = tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        correct += tok.decode(out[0, ids.shape[1]:]) == c + "<|im_end|>"
    assert correct >= 24, f"copied {correct}/26 letters"
    nll = [json.loads(line)["nll"] for line in open(tmp_path / "run" / "sft" / "sft_metrics.jsonl")]
    assert nll[-1] < 0.2 * nll[0]


# ------------------------------------------------------------------------------------------------------------- RL
def _rl_config(tmp_path, name: str) -> str:
    # PPO with a critic (GAE) and KL-in-reward against the reference model: the most state a resume must restore
    # (policy, critic, both optimizers and schedules, reference, data cursor). tests/golden/rl_k0_pre_async.json holds
    # this run's metrics from the code before asynchronous RL: a change here needs that golden remade at commit abb3427
    return write_config(
        tmp_path, name, seed=3, data={"synthetic": {"num_eval": 6}},
        algorithm={"advantage_estimator": "gae", "use_critic": True, "kl_coef": 0.05, "kl_in_reward": True},
        rl={"steps": 4, "dump_rollouts": True, "critic_lr": 1e-3, "mini_batches": 2},
        reshard={"verify_every": 2}, checkpoint={"save_every": 1, "keep": 10})


def _torchrun(config: str, port: int, log: str, url: str | None = None, max_restarts: int = 0) -> subprocess.Popen:
    """`megarl train config` on 2 ranks; with `url`, on that engine (rollout.engine.urls), else on its own; torchrun
    starts the workers again after a failure, `max_restarts` times."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), env_path()]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    engine = [f"rollout.engine.urls=[{url}]"] if url else []
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), "--max-restarts", str(max_restarts), "-m", "megarl.cli", "train", config,
                             *engine], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")


def _metrics(run_dir) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    by_step: dict = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
    return by_step


def _deterministic(metrics: dict) -> dict:
    skip = ("time/", "perf/", "reshard/sync_s", "reshard/verify_s")
    return {k: v for k, v in metrics.items() if not k.startswith(skip)}


def _wait(proc: subprocess.Popen, log: str, timeout: float = 600) -> None:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"megarl train did not finish in {timeout}s; log tail:\n" + open(log).read()[-4000:])
    assert rc == 0, f"megarl train failed ({rc}); log tail:\n" + open(log).read()[-4000:]


def _tiny_model(_=None) -> str:
    return tiny_model_dir(TINY["family"], tokenizer=TINY["tokenizer"], **TINY["overrides"])


# The engine this config's run would start itself, launched ahead (a start costs ~25 s): the uninterrupted run uses
# it (it first pushes its own weights into it, verified); the run with a killed rank starts its own, whose death with
# the killed workers test_a_killed_rank_is_restarted_by_torchrun_and_resumes_exactly checks, and the run whose engine
# is killed starts its own too.
run_engine = early_run_engine(lambda folder, _: _rl_config(folder, "engine"), _tiny_model)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, run_engine):
    tmp = tmp_path_factory.mktemp("rl")
    config = _rl_config(tmp, "full")
    log = str(tmp / "full.log")
    _wait(_torchrun(config, 29731, log, run_engine.url), log)
    return tmp / "full"


@pytest.mark.e2e
def test_rl_run_trains_the_engine_tokens(uninterrupted):
    metrics = _metrics(uninterrupted)
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    for step in range(1, 5):
        m = metrics[step]
        assert m["rollout/samples"] == 16 and m["rollout/stale_weight_frac"] == 0.0
        assert m["grad_norm"] > 0 and m["update_successful"] == 1.0
        assert m["critic/grad_norm"] > 0 and "critic/value_loss" in m and "kl" in m
        assert m["mismatch/logprob_abs_diff"] < 1e-4  # trainer and engine agree on the sampled tokens' log-probs
        assert 0 < m["mismatch/logprob_abs_diff_max"] < 1e-3
        assert m["dynamics/entropy_top20"] > m["dynamics/entropy_rest80"]
        samples = dumped_samples(uninterrupted, step)
        rows = [json.loads(line) for dp in (0, 1)
                for line in open(uninterrupted / "rollouts" / f"step_{step:06d}.dp{dp}.train.jsonl")]
        assert sorted(r["sample"] for r in rows) == list(range(16))  # every sample trained once, on one DP rank
        for r in rows:
            s = samples[r["sample"]]
            assert r["input_ids"] == s["prompt_ids"] + s["response_ids"]  # byte-identical, no re-tokenisation
            assert r["trained"] == s["response_ids"]  # exactly the engine's response tokens carry loss
    assert "eval/pass_at_1" in metrics[0] and "eval/pass_at_1" in metrics[4]
    assert metrics[4]["reward/mean"] != metrics[1]["reward/mean"]  # the policy moved
    ckpts = sorted(os.listdir(uninterrupted / "checkpoints"))
    assert ckpts == ["latest", "step_000001", "step_000002", "step_000003", "step_000004"]


@pytest.mark.e2e
def test_synchronous_run_equals_the_code_before_async_rl(uninterrupted):
    """rl.max_staleness: 0 (the default) is the synchronous step as it was before asynchronous RL existed: the same
    config run by that code (commit abb3427) sampled the same tokens from the same prompts, bit for bit, and logged the
    same per-step metrics to float rounding (tests/golden/rl_k0_pre_async.json). Metrics are compared to 1e-5 relative:
    a CI machine whose CPU sampled every token identically still reduced the training log-probs in another order
    (grad_norm 0.16914969266 vs the golden's 0.16914968739); a changed algorithm moves them by far more. Fractions
    of tokens past a threshold may differ by one token."""
    golden = json.load(open(os.path.join(ROOT, "tests", "golden", "rl_k0_pre_async.json")))
    samples = {str(s): [[d["prompt_ids"], d["response_ids"]] for d in dumped_samples(uninterrupted, s)]
               for s in range(1, 5)}
    # the prompt stream does not depend on floating point: every step took the same prompts in the same order
    for step, rows in golden["samples"].items():
        assert [p for p, _ in samples[step]] == [p for p, _ in rows], step
    if samples["1"] != golden["samples"]["1"]:
        # step 1 samples from the initial weights only: different tokens there mean this CPU's kernels round
        # differently from the machine the golden was made on, and nothing after it can be compared bit for bit
        pytest.skip("this CPU samples differently from the golden's machine at step 1 (floating-point kernels)")
    assert samples == golden["samples"]
    metrics = _metrics(uninterrupted)
    for step, expected in golden["metrics"].items():
        got = _deterministic(metrics[int(step)])
        assert got.keys() >= expected.keys(), (step, sorted(expected.keys() - got.keys()))
        # a fraction of the step's response tokens (clip_frac, vf_clip_frac) counts values against a threshold: one
        # that sits at the boundary to rounding may fall on the other side (measured: vf_clip_frac 2/96 vs 1/96)
        one_token = 1 / max(round(expected.get("response_len/mean", 0) * expected.get("rollout/samples", 0)), 1)
        for key, value in expected.items():
            if key == "dispatch/bytes_received":  # the wire format, not the step: its header grew a field (top_k)
                continue
            slack = one_token if key.endswith("frac") else 1e-5 * abs(value) + 1e-6
            assert abs(got[key] - value) <= slack + 1e-9, (step, key, got[key], value)


@pytest.mark.e2e
def test_a_killed_rank_is_restarted_by_torchrun_and_resumes_exactly(uninterrupted, tmp_path):
    """A trainer rank SIGKILLed somewhere inside step 3 (or its checkpoint): torchrun (--max-restarts 1) starts the
    workers again, they resume from the latest checkpoint by themselves, and the run's per-step metrics equal the
    uninterrupted run's. The engine the first workers started died with them (PR_SET_PDEATHSIG): no orphan."""
    config = _rl_config(tmp_path, "killed")
    run_dir = tmp_path / "killed"
    log = str(tmp_path / "killed.log")
    proc = _torchrun(config, 29741, log, max_restarts=1)  # its own engine: its death with the workers is checked
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() >= "step_000002"):
        assert proc.poll() is None, "the run ended before it could be killed:\n" + open(log).read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 600 s:\n" + open(log).read()[-3000:]
        time.sleep(0.2)
    time.sleep(random.Random().uniform(0.0, 1.5))  # somewhere inside step 3 (or its checkpoint)
    listed = subprocess.run(["pgrep", "-af", f"megarl.cli train {config}"], capture_output=True, text=True).stdout
    workers = [int(line.split()[0]) for line in listed.splitlines() if "torch.distributed.run" not in line]
    assert len(workers) == 2, listed
    first_engine = subprocess.run(["pgrep", "-f", str(run_dir / "base-model")], capture_output=True,
                                  text=True).stdout.split()
    os.kill(random.Random().choice(workers), signal.SIGKILL)
    _wait(proc, log)
    assert "resumed from" in open(log).read()
    resumed, reference = _metrics(run_dir), _metrics(uninterrupted)
    assert sorted(resumed) == sorted(reference)
    for step in reference:
        a, b = _deterministic(reference[step]), _deterministic(resumed[step])
        assert a.keys() == b.keys(), step
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (step, key, a[key], b[key])
    # the engine started by the killed workers died with them, no orphan keeps a core busy
    out = subprocess.run(["pgrep", "-f", str(run_dir / "base-model")], capture_output=True, text=True).stdout
    assert first_engine and not out.strip(), f"orphan processes: {out}"


@pytest.mark.e2e
def test_an_engine_killed_mid_run_changes_nothing_that_is_trained(uninterrupted, tmp_path):
    """The run's SGLang server is SIGKILLed after step 1 (in step 2's rollout, or wherever the run is by then): it is
    restarted and gets the trainer's weights, verified, before it generates again. Every sample is generated by the
    weights recorded for it (today's code sampled the steps after a restart from the base model's weights, tagged as
    current), none is lost, and as the engine samples with per-request seeds, the run's metrics equal the
    uninterrupted run's."""
    config = _rl_config(tmp_path, "engine-killed")
    run_dir = tmp_path / "engine-killed"
    log = str(tmp_path / "engine-killed.log")
    proc = _torchrun(config, 29751, log)  # its own engine: the test kills it
    deadline = time.monotonic() + 600
    while not ((run_dir / "metrics.jsonl").exists() and '"step": 1' in (run_dir / "metrics.jsonl").read_text()):
        assert proc.poll() is None, "the run ended before its engine could be killed:\n" + open(log).read()[-3000:]
        assert time.monotonic() < deadline, "no step within 600 s:\n" + open(log).read()[-3000:]
        time.sleep(0.1)
    engine = subprocess.run(["pgrep", "-f", "sglang.launch_server"], capture_output=True, text=True).stdout.split()
    mine = {os.getpgid(int(pid)) for pid in engine
            if str(run_dir) in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")}
    assert len(mine) == 1, (engine, mine)  # the launcher and its guard (megarl.lifetime), one process group
    os.killpg(mine.pop(), signal.SIGKILL)  # the engine's whole process group
    _wait(proc, log)
    text = open(log).read()
    assert "died during" in text and "restarting it (it then waits for the trainer's weights)" in text, text[-3000:]
    killed, reference = _metrics(run_dir), _metrics(uninterrupted)
    assert sorted(killed) == sorted(reference) and killed[4]["engine/retired"] == 0
    for step in reference:
        a, b = _deterministic(reference[step]), _deterministic(killed[step])
        for key in a.keys() - {"engine/restores"}:
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (step, key, a[key], b[key])
    for step in range(1, 5):
        samples = dumped_samples(run_dir, step)
        assert len(samples) == 16  # prompts_per_step x n_samples: none lost
        assert all(set(s["token_versions"]) == {step - 1} for s in samples), step  # the weights after step - 1


@pytest.mark.e2e
def test_report_renders_the_run(uninterrupted):
    from megarl import cli

    assert cli.main(["report", str(uninterrupted)]) == 0
    png, md = uninterrupted / "report.png", (uninterrupted / "report.md").read_text()
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "| rl: reward/mean |" in md and "| rl: eval/pass_at_1 |" in md


@pytest.mark.unit
def test_cli_config_errors_exit_cleanly(tmp_path, capsys):
    from megarl import cli

    path = tmp_path / "typo.yaml"
    path.write_text("model: {path: x}\nrollout: {n_sample: 4}\n")
    assert cli.main(["train", str(path)]) == 2
    assert "Did you mean 'rollout.n_samples'" in capsys.readouterr().err
