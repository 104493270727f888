"""Megatron (TP=2 / PP=2) -> SGLang weight sync through a real SGLang server on CPU, over each transport, verified."""
import pytest
import torch

import ranks
from megarl.rollout import EngineClient, EngineError, ServerConfig, SGLangServer
from megarl.testing import RankFailure, run_ranks, tiny_model_dir

pytestmark = pytest.mark.engine


PROBE = [[5, 17, 42, 7, 9, 11], [3, 1, 4, 1, 5, 9]]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_engine):
    """The session's tiny Qwen2 server (megarl.testing.fixtures; the same model this module's own server used to be,
    one ~30 s start saved). The syncs here replace its weights: afterwards it serves the original ones again, checked
    on the prompt log-probs of a probe, for the tests after this module that only read it."""
    client = EngineClient(server=tiny_qwen2_engine)
    original = client.prompt_log_probs(PROBE)
    yield tiny_qwen2_engine
    client.call("/update_weights_from_disk", {"model_path": tiny_model_dir("qwen2"), "weight_version": "default"})
    restored = client.prompt_log_probs(PROBE)
    assert torch.tensor(restored).sub(torch.tensor(original)).abs().max() < 1e-4, "the session engine was not restored"


CASES = [("tp2", {"tp": 2}, 2, "tensor"), ("tp2", {"tp": 2}, 2, "distributed"), ("pp2", {"pp": 2}, 2, "tensor"),
         ("pp2", {"pp": 2}, 2, "distributed"), ("tp2pp2", {"tp": 2, "pp": 2}, 4, "disk"),
         ("tp2", {"tp": 2}, 2, "ranks:CountingTransport")]  # a user's transport by dotted path (tests/ranks.py)


@pytest.mark.parametrize("name,layout,world,transport", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_sync_makes_engine_match_trainer(engine, name, layout, world, transport):
    seed = 100 + CASES.index((name, layout, world, transport))
    results = run_ranks(world, ranks.sync_and_compare, tiny_model_dir("qwen2"), engine.url, layout, transport, seed)
    r = results[0]
    engine_lp, trainer_lp = torch.tensor(r["engine"]), torch.tensor(r["trainer"])
    assert engine_lp.shape == trainer_lp.shape == (2, 6)
    assert (engine_lp - trainer_lp).abs().max() < 1e-3
    before, after = torch.tensor(r["before"]), torch.tensor(r["after"])
    assert (before - after).abs().max() > 1e-2  # the sync really changed the engine
    assert r["stats"]["verified_tensors"] > 20 and r["stats"]["probe_max_abs_diff"] < 1e-3
    assert r["weight_versions"] == [r["stats"]["version"]] * 2  # completions are tagged with the synced version
    if transport != "disk":
        assert r["stats"]["buckets"] >= 2  # 256 KiB buckets: the model went over in several
    if transport.startswith("ranks:"):  # every bucket went through the user's push
        pushed = [x["user_transport_pushed"] for x in results]
        assert sum(map(len, pushed)) == r["stats"]["buckets"] and sum(map(sum, pushed)) == r["stats"]["pushed_bytes"]


def test_a_killed_trainers_open_window_is_taken_over(engine):
    """A trainer killed mid-push leaves the engine's weight-update window open; the run resumed on the same engine
    closes it at its first sync, pushes every weight and verifies them."""
    EngineClient(engine.url).begin_weight_update()  # the killed trainer's window
    r = run_ranks(2, ranks.sync_and_compare, tiny_model_dir("qwen2"), engine.url, {"tp": 2}, "tensor", 11)[0]
    assert torch.tensor(r["engine"]).sub(torch.tensor(r["trainer"])).abs().max() < 1e-3
    assert r["stats"]["verified_tensors"] > 20 and r["stats"]["probe_max_abs_diff"] < 1e-3
    with pytest.raises(EngineError, match="no weight-update session is open"):
        EngineClient(engine.url).end_weight_update()  # the sync closed its window


def test_a_window_opened_by_another_run_later_is_an_error():
    """After this process's first sync an open window is another run's: named, not taken over."""
    from types import SimpleNamespace

    from megarl.compat.sglang import WEIGHT_WINDOW_OPEN
    from megarl.reshard.sync import WeightSync

    class Engine:  # the two answers of SGLang's /begin_weight_update that matter here
        url, calls = "http://engine:1", []

        def begin_weight_update(self):
            self.calls.append("begin")
            if self.calls.count("begin") == 1:
                raise EngineError(f"SGLang rejected /begin_weight_update (HTTP 400): {WEIGHT_WINDOW_OPEN}; ...")

        def end_weight_update(self):
            self.calls.append("end")

    first = SimpleNamespace(client=Engine(), count=0)
    WeightSync._open_window(first)
    assert first.client.calls == ["begin", "end", "begin"]
    later = SimpleNamespace(client=Engine(), count=3)
    later.client.calls = []
    with pytest.raises(EngineError, match="another run pushes weights to it"):
        WeightSync._open_window(later)


def _corrupt_layer_2(transport):
    return ranks.ZeroSliceOf(transport, "model.layers.2.mlp.down_proj.weight")


def test_corrupted_tensor_is_detected_and_named(engine):
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, ranks.sync_and_compare, tiny_model_dir("qwen2"), engine.url, {"pp": 2}, "tensor", 7,
                  _corrupt_layer_2)
    message = str(failure.value)
    assert "WeightMismatchError" in message
    assert "engine tensor model.layers.2.mlp.down_proj.weight differs" in message


def test_wrong_sampling_param_is_named(engine):
    client = EngineClient(engine.url)
    with pytest.raises(EngineError) as error:
        client.generate([[5, 6, 7]], {"max_new_tokens": 2, "temprature": 0.5})
    assert "temprature" in str(error.value) and "HTTP 400" in str(error.value)


def test_generate_returns_tokens_and_log_probs(engine):
    client = EngineClient(engine.url)
    out = client.generate([[5, 6, 7], [8, 9]], {"max_new_tokens": 4, "temperature": 1.0})
    assert [len(c.output_ids) for c in out] == [4, 4] and [len(c.output_log_probs) for c in out] == [4, 4]
    assert all(c.finish_reason == "length" and max(c.output_log_probs) <= 0 for c in out)


def test_bad_model_path_quotes_the_engine_log(tmp_path):
    missing = str(tmp_path / "no-such-model")
    server = SGLangServer(ServerConfig(model_path=missing, log_dir=str(tmp_path / "log"), startup_timeout_s=180))
    with pytest.raises(EngineError) as error:
        server.start()
    message = str(error.value)
    assert "during start-up" in message and missing in message
    assert "OSError" in message  # SGLang's own error, quoted from its log
    assert not server.alive()
