"""Asynchronous RL (rl.max_staleness): weight versions per token, the producer's staleness bound, partial rollouts
(a weight update aborts generations in flight; they continue under the new weights, with real SGLang), the decoupled
PPO objective, and an asynchronous run that is killed and resumed without losing or repeating a sample."""
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from megarl.algorithms import AlgorithmConfig
from megarl.algorithms.config import MismatchConfig
from megarl.losses import TokenBatch, prepare_global_batch
from megarl.losses.rl import rl_objective
from megarl.rollout.client import Completion
from megarl.rollout.router import EngineRouter
from megarl.testing.fixtures import early_run_engine
from megarl.trainer.async_rollout import (RolloutBatch, RolloutProducer, lag_stats, token_versions, version_name,
                                          version_number)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/ (the shared helpers)


# ------------------------------------------------------------------------------------------------- versions
@pytest.mark.unit
def test_token_versions_and_lags():
    assert version_number(version_name(12)) == 12 and version_number("default") == -1 and version_number(None) == -1
    versions = token_versions([(2, "step-3"), (1, None), (3, "step-4")])
    assert versions.tolist() == [3, 3, -1, 4, 4, 4] and versions.dtype == np.int32
    # step 6 trains the policy of version 5: version 4 is 1 step stale, version 3 two (older than k = 1)
    v = torch.tensor([[3, 3, 0, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]])
    assert lag_stats(v, mask, step=6, max_lag=1).tolist() == [0.0, 2.0, 2.0]
    assert lag_stats(v, mask, step=5, max_lag=2).tolist() == [2.0, 2.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------------- producer
def _run_producer(k: int, fixed: bool, steps: int = 6):
    """A trainer loop around a RolloutProducer whose `collect` records the engines' version when each step's rollout
    starts; the trainer takes step t, (fixed schedule: waits for step t + k), then publishes version t."""
    state = {"version": 0}
    started = {}

    def collect(step):
        started[step] = state["version"]
        return RolloutBatch(step, [], None, None, {"step": step}, {}, {})

    producer = RolloutProducer(collect, 1, steps, k, version=0)
    try:
        for t in range(1, steps + 1):
            assert producer.take(t).stats == {"step": t}
            if fixed:
                producer.wait_generated(t + k)
            state["version"] = t  # the sync: the engines now hold version t
            producer.set_version(t)
    finally:
        producer.stop()
    return started


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2])
def test_producer_starts_a_step_only_when_its_weights_are_fresh_enough(k):
    started = _run_producer(k, fixed=False)
    assert sorted(started) == list(range(1, 7))
    assert all(version >= step - 1 - k for step, version in started.items())
    # the fixed schedule: step s is generated entirely by version max(0, s - 1 - k)
    assert _run_producer(k, fixed=True) == {s: max(0, s - 1 - k) for s in range(1, 7)}
    # synchronous steps (k = 0) through the same producer: every step from the weights before it
    assert _run_producer(0, fixed=True) == {s: s - 1 for s in range(1, 7)}


@pytest.mark.unit
def test_producer_drain_and_errors():
    gate, steps = threading.Event(), []

    def collect(step):
        steps.append(step)
        if step == 2:
            gate.wait()
        if step == 3:
            raise RuntimeError("engine died")
        return RolloutBatch(step, [], None, None, {}, {}, {})

    producer = RolloutProducer(collect, 1, 5, max_staleness=5, version=0)
    threading.Timer(0.2, gate.set).start()  # drain must wait for step 2, whenever it finishes
    ahead = producer.drain()
    assert [b.step for b in ahead] == [1, 2] and steps == [1, 2]  # nothing new starts while drained
    producer.release()
    producer.take(1)
    producer.take(2)
    with pytest.raises(RuntimeError, match="engine died"):
        producer.take(3)
    # a producer restored with finished rollouts hands them out first and continues after them
    restored = RolloutProducer(lambda s: RolloutBatch(s, [], None, None, {"new": s}, {}, {}), 4, 5, 1, version=3,
                               ready=ahead[:0] + [RolloutBatch(4, [], None, None, {"saved": 4}, {}, {})])
    assert restored.take(4).stats == {"saved": 4} and restored.take(5).stats == {"new": 5}
    restored.stop()


# ------------------------------------------------------------------------------------- partial rollouts
class _AbortingClient:
    """A stand-in engine whose first answer to each prompt stops after 2 tokens as aborted (a weight update paused
    it), under version step-0; continuations run under step-1."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, **kwargs):
        self.calls.append((prompts, params))
        first = len(self.calls) == 1
        out = []
        for p, sp in zip(prompts, params):
            n = 2 if first else sp["max_new_tokens"]
            ids = [100 + len(p) + i for i in range(n)]
            out.append(Completion(list(p), ids, [-0.5 if first else -1.5] * n, "abort" if first else "length",
                                  "step-0" if first else "step-1"))
        return out


@pytest.mark.unit
def test_router_continues_aborted_requests_from_their_own_tokens():
    client = _AbortingClient()
    router = EngineRouter([client], "round_robin")
    params = [{"max_new_tokens": 5, "sampling_seed": 11}, {"max_new_tokens": 2, "sampling_seed": 12}]
    out = router.generate([[1, 2], [3]], params, resume_aborted=True)
    # prompt 0: 2 tokens, aborted, continued from prompt + those tokens with the 3 tokens left and its own seed
    (prompts, cont), = client.calls[1:]
    assert prompts == [[1, 2, 102, 103]] and cont[0]["max_new_tokens"] == 3 and cont[0]["sampling_seed"] != 11
    assert out[0].output_ids == [102, 103, 104, 105, 106] and out[0].finish_reason == "length"
    assert out[0].output_log_probs == [-0.5, -0.5, -1.5, -1.5, -1.5]
    assert out[0].segments == [(2, "step-0"), (3, "step-1")] and out[0].weight_version == "step-1"
    # prompt 1 used its whole budget before the abort: done, not continued
    assert out[1].output_ids == [101, 102] and out[1].segments == [(2, "step-0")] and out[1].finish_reason == "length"
    plain = EngineRouter([_AbortingClient()], "round_robin").generate([[1, 2]], params[:1])
    assert plain[0].finish_reason == "abort" and len(plain[0].output_ids) == 2  # without resume_aborted: as it came


class _PausableClient:
    """A stand-in engine: a generation runs until /abort_request (then returns aborted after 1 token) or, once the
    weights changed, finishes; it records the control calls in order."""

    def __init__(self):
        self.events, self.aborted, self.version = [], threading.Event(), "step-0"

    def generate(self, prompts, params, **kwargs):
        version = self.version
        self.events.append(("generate", version))
        if version == "step-0":
            assert self.aborted.wait(60), "never aborted"
            return [Completion(list(p), [7], [-0.1], "abort", version) for p in prompts]
        return [Completion(list(p), [8] * sp["max_new_tokens"], [-0.2] * sp["max_new_tokens"], "length", version)
                for p, sp in zip(prompts, params)]

    def call(self, path, payload=None):
        self.events.append((path, payload))
        self.aborted.set()

    def pause(self, mode):
        self.events.append(("pause", mode))

    def resume(self):
        self.events.append(("resume",))


@pytest.mark.unit
def test_pause_for_update_aborts_waits_for_its_requests_and_holds_new_ones():
    """The fast pause: hold new requests, abort every request, wait for this router's to return, then SGLang's pause;
    a continuation asked for during the update waits for continue_after_update (so it runs on the new weights)."""
    client = _PausableClient()
    router = EngineRouter([client], "round_robin")
    result = {}
    worker = threading.Thread(target=lambda: result.update(c=router.generate(
        [[1, 2]], {"max_new_tokens": 4}, resume_aborted=True)[0]))
    worker.start()
    while not client.events:  # the generation is in flight
        time.sleep(0.01)
    router.pause_for_update()
    assert router.in_flight == [0]  # the aborted request came back before the engine was paused
    assert client.events == [("generate", "step-0"), ("/abort_request", {"abort_all": True}), ("pause", "abort")]
    worker.join(0.3)
    assert worker.is_alive()  # its continuation is held by the router while the weights change
    client.version = "step-1"
    router.continue_after_update()
    worker.join(60)
    assert client.events[3:] == [("resume",), ("generate", "step-1")]
    c = result["c"]
    assert c.output_ids == [7, 8, 8, 8] and c.segments == [(1, "step-0"), (3, "step-1")]


@pytest.fixture(scope="module")
def perturbed_model(tmp_path_factory):
    """The tiny Qwen2 the session engine serves, with every weight changed (another policy, same shapes)."""
    from transformers import AutoModelForCausalLM

    from megarl.testing import tiny_model_dir

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    folder = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(folder)
    return str(folder)


@pytest.mark.engine
def test_weight_update_during_a_generation_pauses_and_continues_it(tiny_qwen2_engine, perturbed_model):
    """A long generation is in flight when the trainer pauses the engine (abort), pushes other weights and resumes it:
    the sample continues under the new weights; its tokens carry both versions, each with the log-prob the engine's
    own weights of that version give them (teacher-forced), and the two versions' log-probs differ."""
    from megarl.rollout.client import EngineClient
    from megarl.testing import tiny_model_dir

    client = EngineClient(server=tiny_qwen2_engine)
    router = EngineRouter([client], "round_robin")
    original = tiny_model_dir("qwen2")
    prompt = [5, 17, 42, 7]
    params = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
    try:
        for attempt in range(6):  # the pause must find the request generating; a loaded machine only makes it likelier
            client.call("/update_weights_from_disk", {"model_path": original, "weight_version": "step-0"})
            result = {}
            worker = threading.Thread(target=lambda: result.update(c=router.generate([prompt], params,
                                                                                      resume_aborted=True)[0]))
            worker.start()
            while router.in_flight[0] == 0 and worker.is_alive():
                time.sleep(0.01)
            time.sleep(0.05 * attempt)
            router.pause_for_update()  # holds the router, aborts the request, waits for it, pauses the engine
            client.call("/update_weights_from_disk", {"model_path": perturbed_model, "weight_version": "step-1"})
            router.continue_after_update()
            worker.join()
            c = result["c"]
            if len(c.segments) > 1:
                break
        assert [v for _, v in c.segments] == ["step-0", "step-1"], c.segments
        split = c.segments[0][0]
        assert 0 < split < 200 and len(c.output_ids) == 200 == len(c.output_log_probs) and c.finish_reason == "length"
        forced_new = client.prompt_log_probs([prompt + c.output_ids])[0][len(prompt) - 1:]
        client.call("/update_weights_from_disk", {"model_path": original, "weight_version": "step-0"})
        forced_old = client.prompt_log_probs([prompt + c.output_ids])[0][len(prompt) - 1:]
        got = np.asarray(c.output_log_probs)
        np.testing.assert_allclose(got[:split], forced_old[:split], atol=1e-4)
        np.testing.assert_allclose(got[split:], forced_new[split:], atol=1e-4)
        assert np.abs(np.asarray(forced_old) - np.asarray(forced_new)).max() > 1e-2  # the versions differ
    finally:  # the session engine serves the original weights again
        client.resume()
        client.call("/update_weights_from_disk", {"model_path": original, "weight_version": "default"})


# -------------------------------------------------------------------------------------- decoupled objective
@pytest.mark.unit
def test_tis_with_recomputed_old_log_probs_is_decoupled_ppo():
    """AReaL / Hilton et al.: loss_t = -min(pi_prox / pi_behav, cap) * min(r_t A_t, clip(r_t, 1 - e, 1 + e) A_t),
    r_t = pi_theta / pi_prox, averaged over tokens; value and gradient against that formula written out."""
    g = torch.Generator().manual_seed(0)
    b, s = 4, 7
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    behaviour = -torch.rand(b, s, generator=g) * 2  # the engine's log-probs (stale weights)
    proximal = behaviour + torch.randn(b, s, generator=g) * 0.5  # the current weights before the update
    log_prob = (proximal + torch.randn(b, s, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(b, s, generator=g)
    cfg = AlgorithmConfig(mismatch=MismatchConfig(mode="tis", cap=2.0)).validate()  # clip 0.2 both sides
    batch = prepare_global_batch(TokenBatch(input_ids=torch.zeros(b, s, dtype=torch.long),
                                            targets=torch.zeros(b, s, dtype=torch.long), loss_mask=mask,
                                            old_log_probs=proximal, rollout_log_probs=behaviour, advantages=adv),
                                 "token-mean", seq_multiple=1)
    loss, _ = rl_objective(log_prob, torch.zeros_like(log_prob), batch, cfg)
    loss.backward()
    lp = log_prob.detach().clone().requires_grad_(True)
    ratio = torch.exp(lp - proximal)
    weight = torch.exp(proximal - behaviour).clamp(max=2.0)
    naive = -(weight * torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * mask).sum() / mask.sum()
    naive.backward()
    assert math.isclose(loss.item(), naive.item(), rel_tol=1e-5)
    torch.testing.assert_close(log_prob.grad, lp.grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------ end to end (torchrun)
def _async_config(tmp_path, name: str, model: str) -> str:
    from tiny_rl import write_config

    # the fixed schedule (reproducible): step s is generated by the weights of step max(0, s - 2)
    return write_config(tmp_path, name, seed=5, model={"tiny": None, "path": model},
                        rl={"steps": 3, "dump_rollouts": True, "max_staleness": 1, "partial_rollouts": False},
                        checkpoint={"save_every": 1, "keep": 10})


def _train(config: str, port: int, log: str, url: str) -> subprocess.Popen:
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), "-m", "megarl.cli", "train", config, f"rollout.engine.urls=[{url}]"],
                            cwd=root, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: str) -> None:
    try:
        rc = proc.wait(600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("megarl train did not finish; log tail:\n" + open(log).read()[-4000:])
    assert rc == 0, f"megarl train failed ({rc}); log tail:\n" + open(log).read()[-4000:]


def _metrics(run_dir) -> dict:
    import json

    out: dict = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(row)
    return out


def _trained_rows(run_dir, step: int) -> list:
    import json

    return sorted((json.loads(line) for dp in (0, 1)
                   for line in open(os.path.join(run_dir, "rollouts", f"step_{step:06d}.dp{dp}.train.jsonl"))),
                  key=lambda r: r["sample"])


def _tiny_model(_=None) -> str:
    from megarl.testing import tiny_model_dir
    from tiny_rl import TINY

    return tiny_model_dir(TINY["family"], tokenizer=TINY["tokenizer"], **TINY["overrides"])


# the engine a run of this config would start itself, launched ahead (a start costs ~30 s, minutes on a loaded machine)
run_engine = early_run_engine(lambda folder, _: _async_config(folder, "engine", _tiny_model()), _tiny_model)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, run_engine):
    """A k = 1 run SIGKILLed (torchrun, which takes its workers with it) right after its first checkpoint, which holds
    the rollouts already generated for the next steps; then resumed to the end. Both runs use one engine
    (rollout.engine.urls): each run first pushes its own weights into it, the resumed one those of its checkpoint.
    That a killed run's own engine dies with it is tests/trainer/test_trainer_e2e.py's."""
    tmp = tmp_path_factory.mktemp("async")
    config = _async_config(tmp, "run", _tiny_model())
    run_dir, log = tmp / "run", str(tmp / "killed.log")
    proc = _train(config, 29771, log, run_engine.url)
    latest = run_dir / "checkpoints" / "latest"
    while not latest.exists():
        assert proc.poll() is None, "the run ended before it could be killed:\n" + open(log).read()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 120
    while subprocess.run(["pgrep", "-f", config], capture_output=True).stdout.strip():
        # the workers die with torchrun (PR_SET_PDEATHSIG): at once, but a loaded machine may take a while
        assert time.monotonic() < deadline, "the killed run's workers outlived their torchrun by 120 s"
        time.sleep(0.1)
    _finish(_train(config, 29772, log + ".resumed", run_engine.url), log + ".resumed")
    return run_dir, open(log + ".resumed").read()


@pytest.mark.e2e
def test_async_run_trains_no_token_older_than_allowed(async_run):
    from megarl.trainer.rl import dumped_samples

    run_dir, _ = async_run
    metrics = _metrics(run_dir)
    for step in (1, 2, 3):
        expected = max(0, step - 2)  # the fixed schedule with k = 1
        samples = dumped_samples(run_dir, step)
        assert len(samples) == 16
        for s in samples:  # per-token versions from the dumps: every token sampled by exactly that version
            assert s["token_versions"] == [expected] * len(s["response_ids"]), (step, s["token_versions"])
        m = metrics[step]
        assert m["async/max_lag"] == step - 1 - expected <= 1 and m["async/stale_token_frac"] == 0.0
        assert m[f"async/lag{step - 1 - expected}_token_frac"] == 1.0 and m["async/partial_sample_frac"] == 0.0
    # trained against stale weights, the trainer's recomputed log-probs no longer equal the engine's (lag 1), while
    # step 1 (lag 0) agrees to numerics
    assert metrics[1]["mismatch/logprob_abs_diff_lag0"] < 1e-4 < metrics[3]["mismatch/logprob_abs_diff_lag1"]
    # algorithm.mismatch.mode unset with rl.max_staleness=1: the step corrects with tis (pi_old / pi_engine, capped),
    # whose mean weight leaves 1 once the engine's tokens are stale (unset as "none" would keep it exactly 1)
    assert abs(metrics[1]["is_weight"] - 1.0) < 1e-3 and metrics[3]["is_weight"] != 1.0


@pytest.mark.e2e
def test_async_run_killed_and_resumed_loses_and_repeats_no_sample(async_run):
    """The resumed run trained the rollouts saved with the checkpoint, and over the whole run every step trained its
    own prompts of the stream, each sample once: none lost, none twice."""
    import re

    from megarl.trainer.rollout import PromptStream
    from megarl.trainer.rl import dumped_samples

    run_dir, resumed_log = async_run
    assert re.search(r"resumed from .*step_00000[12] \(step [12], [12] rollouts ahead\)", resumed_log), resumed_log
    stream = PromptStream(list(range(60)), seed=5)  # the synthetic task's 60 training prompts, in the run's order
    for step in (1, 2, 3):
        rows = _trained_rows(run_dir, step)
        assert [r["sample"] for r in rows] == list(range(16))  # every sample of the step trained once
        prompts = [s["prompt_index"] for s in dumped_samples(run_dir, step)]
        assert prompts == [p for p in stream.take(4) for _ in range(4)], step
    assert sorted(_metrics(run_dir)) == [0, 1, 2, 3]
