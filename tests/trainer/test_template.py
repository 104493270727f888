"""The README's own-model recipe, literally: configs/template.yaml with a model folder and a JSONL of prompts trains,
and the held-out number comes from data.eval_fraction."""
import json
import os
import subprocess
import sys

import pytest

from megarl.parallel.env import free_port
from megarl.rollout import EngineClient
from megarl.testing import tiny_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


@pytest.mark.e2e
def test_the_template_trains_a_model_folder_on_a_jsonl(tmp_path, tiny_qwen2_engine):
    """The session's tiny Qwen2 server serves the same folder (one engine start saved); its weights are put back."""
    model = tiny_model_dir("qwen2")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    run_dir = tmp_path / "mine"
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "-m", "megarl.cli", "train", "configs/template.yaml", f"model.path={model}", f"data.train={data}",
           f"run_dir={run_dir}",
           # the test's own: one step, the shared engine, no wandb files
           "rl.steps=1", f"rollout.engine.urls=[{tiny_qwen2_engine.url}]", "logging.wandb=disabled"]
    try:
        with open(log, "w") as out:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=900,
                                env=dict(os.environ, OMP_NUM_THREADS="1")).returncode
    finally:
        EngineClient(tiny_qwen2_engine.url).call("/update_weights_from_disk",
                                                 {"model_path": model, "weight_version": "default"})
    assert rc == 0, log.read_text()[-4000:]
    summary = json.loads((run_dir / "rl_summary.json").read_text())
    assert summary["steps"] == 1 and "held_out" not in summary
    assert summary["pass_at_1_before"] is not None and summary["pass_at_1_after"] is not None
    recorded = json.loads((run_dir / "run_config.json").read_text())
    assert recorded["data"]["eval_fraction"] == 0.05 and recorded["model"]["path"] == model
