"""User reward functions for the trainer tests (loaded by dotted path, reward.name: "reward_fns:...")."""


def digit_fraction(response: str, answer, **_) -> float:
    """Share of digits in the response: varies even for a random model, so advantages are never all zero."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def needs_missing_sandbox(response, answer, **_):
    """A code-executing reward on a machine without isolation."""
    from megarl.sandbox import SandboxUnavailable

    raise SandboxUnavailable("no namespaces here")


def hangs_on_hang(response: str, answer, **_) -> float:
    """Hangs (signals blocked, in a sleep) when the response says "hang"; 1.0 otherwise."""
    if response == "hang":
        import signal
        import time

        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM, signal.SIGALRM])
        time.sleep(10_000)
    return 1.0


def kills_its_worker_once(response: str, answer, marker: str, **_) -> float:
    """The first call SIGKILLs the reward pool worker it runs under (as an OOM kill would), later calls score: 1.0
    for "ok". Runs in the per-response child the worker forked, so the worker is its parent."""
    import os
    import signal
    import time

    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)
    return 1.0 if response == "ok" else 0.0
