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
