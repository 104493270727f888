"""Bad input ends as ONE line from rank 0 naming the field and the fix, exit code 2, no traceback: in-process for every
anticipated failure (and the same through --dry-run), and under megarl-torchrun with 2 ranks for the ones that stop
before, at and after torch.distributed starts."""
import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from tiny_rl import write_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_error(404)

    def log_message(self, *args):  # quiet: the test reads this process's stderr
        pass


@pytest.fixture(scope="module")
def not_sglang():
    """An HTTP server on loopback that is not SGLang (404 for everything)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def one_argument_reward(response):  # a user's reward that cannot take (response, answer)
    return 1.0


def tagged_reward(response, answer, *, tag):  # ... and one that takes only the keyword `tag`
    return float(tag in response)


def _bad_inputs(tmp, not_sglang_url):
    """(case, overrides or extra config, words the one line must hold)."""
    bad_record = tmp / "bad_record.jsonl"
    bad_record.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    not_json = tmp / "not_json.jsonl"
    not_json.write_text("{oops\n")
    empty_model = tmp / "empty_model"
    empty_model.mkdir(exist_ok=True)
    (tmp / "shards").mkdir(exist_ok=True)
    (tmp / "shards" / "part-0.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp / "shards" / "part-1.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" +
                                                 json.dumps({"question": "x"}) + "\n")
    return [
        ("model folder missing", [f"model.path={tmp}/nowhere", "model.tiny=null"], ["model.path", "does not exist"]),
        ("model folder without config", [f"model.path={empty_model}", "model.tiny=null"],
         ["model.path", "config.json"]),
        ("data file missing", [f"data.train={tmp}/missing.jsonl"],
         ["data.train", "does not exist", "Fix: correct the path"]),
        ("data file not JSON", [f"data.train={not_json}"],
         ["data.train", "line 1", "not valid JSON", "Fix: one JSON object per line"]),
        ("data record without prompt", [f"data.train={bad_record}"],
         ["data.train", "line 2", "Fix:", "data.prompt_key"]),
        ("unknown reward", ["reward.name=nope"], ["reward.name", "nope", "exact_match", "Fix:"]),
        ("misspelt reward", ["reward.name=exact_mach"], ["reward.name", "did you mean exact_match?",
                                                         "Fix: reward.name=exact_match"]),
        ("unknown reward module", ["reward.name=no_such_module:fn"], ["reward.name", "no_such_module", "Fix:"]),
        ("reward that cannot take the call", ["reward.name=test_errors:one_argument_reward"],
         ["reward.name", "one_argument_reward", "Fix: def fn(response, answer, **kwargs)"]),
        ("reward.kwargs the reward does not take", ["reward.name=test_errors:tagged_reward",
                                                    "reward.kwargs={tag: b, scale: 2}"],
         ["reward.name", "reward.kwargs=['scale', 'tag']"]),
        ("unknown transport", ["reshard.transport=nope"], ["reshard.transport", "disk", "Fix:"]),
        ("transport module missing", ["reshard.transport=no_such_module:T"], ["reshard.transport", "no_such_module",
                                                                                "Fix:"]),
        ("unknown estimator", ["algorithm.advantage_estimator=nope"],
         ["algorithm.advantage_estimator", "grpo", "Fix:"]),
        ("unknown loss", ["algorithm.policy_loss=nope"], ["algorithm.policy_loss", "ppo_clip", "Fix:"]),
        ("misspelt loss", ["algorithm.policy_loss=ppo_clp"], ["did you mean ppo_clip?",
                                                              "Fix: algorithm.policy_loss=ppo_clip"]),
        ("unreachable engine", [f"rollout.engine.urls=[http://127.0.0.1:{_closed_port()}]"],
         ["rollout.engine.urls[0]", "unreachable", "Fix"]),
        ("engine URL not SGLang", [f"rollout.engine.urls=[{not_sglang_url}]"],
         ["rollout.engine.urls[0]", "not as an SGLang server"]),
        ("unwritable run_dir", ["run_dir=/proc/megarl-run"], ["run_dir", "not writable"]),
        ("negative lr", ["optim.lr=-1"], ["optim.lr", "> 0"]),
        ("adam beta", ["optim.adam_beta2=1.5"], ["optim.adam_beta2", "[0, 1)"]),
        ("rloo with one sample", ["algorithm.advantage_estimator=rloo", "rollout.n_samples=1"],
         ["rollout.n_samples", ">= 2"]),
        ("model.load without checkpoint", [f"model.load={tmp}/no_ckpt"], ["model.load", "no checkpoint"]),
        ("model.load=sft before any SFT", ["model.load=sft"], ["model.load", "megarl sft"]),
        ("bad parallel size", ["parallel.tp=0"], ["parallel.tp", "positive", "Fix:"]),
        ("no RL steps", ["rl.steps=0"], ["rl.steps must be >= 1", "Fix: e.g. rl.steps=100"]),
        ("no SFT batch", ["sft.batch_size=0"], ["sft.batch_size must be >= 1", "Fix:"]),
        ("typo in a key", ["rollout.n_sample=4"], ["rollout.n_samples", "Fix: rename it to rollout.n_samples"]),
        ("unknown reasoning-gym task", ["data.train=reasoning_gym", "reward.name=reasoning_gym",
                                        "data.reasoning_gym.task=leg_countin"],
         ["data.reasoning_gym.task", "did you mean leg_counting", "Fix: data.reasoning_gym.task=leg_counting"]),
        ("bad reasoning-gym config", ["data.train=reasoning_gym", "reward.name=reasoning_gym",
                                      "data.reasoning_gym.task=leg_counting", "data.reasoning_gym.config={legs: 3}"],
         ["data.reasoning_gym.config", "legs", "Fix"]),
        ("reasoning-gym data, math reward", ["data.train=reasoning_gym", "data.reasoning_gym.task=leg_counting",
                                            "reward.name=math"],
         ["reward.name=math", "Fix: reward.name=reasoning_gym"]),
        ("bad record in a dataset folder", [f"data.train={tmp / 'shards'}"], ["shards", "part-1.jsonl:line 2",
                                                                             "data.prompt_key"]),
    ]


def _case_names():
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return [c[0] for c in _bad_inputs(pathlib.Path(tmp), "http://x")]


@pytest.mark.unit
@pytest.mark.parametrize("dry_run", [False, True], ids=["command", "dry-run"])
@pytest.mark.parametrize("case", _case_names())
def test_bad_input_is_one_line_with_the_field(tmp_path, capsys, not_sglang, case, dry_run):
    from megarl import cli

    name, overrides, words = next(c for c in _bad_inputs(tmp_path, not_sglang) if c[0] == case)
    config = write_config(tmp_path, "run")
    flags = ["--dry-run", "--check-engines"] if dry_run else []
    # The commands stop in the pre-flight checks, before torch.distributed or any engine starts.
    assert cli.main(["train", config, *flags, *overrides]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("megarl: error: ") and "Traceback" not in err[0]
    for word in words:
        assert word in err[0], (word, err[0])


@pytest.mark.unit
def test_dry_run_accepts_overrides_after_the_flags(tmp_path, capsys):
    from megarl import cli

    config = write_config(tmp_path, "run")
    assert cli.main(["train", config, "--dry-run", "rl.steps=3", "--verbose", "rollout.n_samples=1",
                     "algorithm.advantage_estimator=reinforce_plus_plus"]) == 0
    out = capsys.readouterr().out
    assert "checked   run_dir" in out and "data.train: synthetic" in out


def _torchrun(config, *overrides, module="megarl.cli"):
    return subprocess.run([sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "2",
                           "--master_port", str(_closed_port()), "-m", module, "train", config, *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests")))


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["every rank: unknown estimator", "every rank, rank 0 the slowest",
                                  "rank 0 only: unreachable engine",
                                  "after start-up: a bad record deep in the data file"])
def test_under_torchrun_one_line_from_rank0_exit_2(tmp_path, case):
    """Three places a failure can arise: in every rank's pre-flight, in rank 0's alone (the engine URLs; rank 1 is
    then waiting for the process group), and on rank 0 after torch.distributed and the model are up (the data file
    is read in full only then: megarl.errors.on_rank0 makes every rank stop together). "Rank 0 the slowest" starts
    rank 0 late (tests/slow_rank0.py), as a loaded machine does: rank 1 fails first and must not let the launcher stop
    rank 0 before it has said the error."""
    data = tmp_path / "prompts.jsonl"
    records = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)] + [{"prompt": ""}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = {"every rank: unknown estimator": ["algorithm.advantage_estimator=nope"],
                 "every rank, rank 0 the slowest": ["algorithm.advantage_estimator=nope"],
                 "rank 0 only: unreachable engine": [f"rollout.engine.urls=[http://127.0.0.1:{_closed_port()}]"],
                 "after start-up: a bad record deep in the data file": [f"data.train={data}"]}[case]
    module = "slow_rank0" if "slowest" in case else "megarl.cli"
    result = _torchrun(write_config(tmp_path, "run"), *overrides, module=module)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("megarl: error: "), errors
    if case.startswith("after"):
        assert "data.train=" in errors[0] and "line 41" in errors[0] and "'prompt'" in errors[0], errors


@pytest.mark.unit
def test_run_dir_check_is_safe_when_every_rank_runs_it(tmp_path):
    """Every rank checks run_dir at once. A run keeps the folder it made: removing it raced with another rank's write
    check (CI saw 'run_dir ... is not writable (No such file or directory)'). A dry run leaves nothing behind."""
    from concurrent.futures import ThreadPoolExecutor

    from megarl.launch.preflight import check_run_dir

    for attempt in range(20):
        run_dir = tmp_path / f"a{attempt}" / "run"
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: check_run_dir(str(run_dir), keep=True), range(8)))
        assert run_dir.is_dir() and not list(run_dir.iterdir())
    check_run_dir(str(tmp_path / "dry" / "run"))
    assert not (tmp_path / "dry").exists()
