"""User reward functions for the trainer tests (loaded by dotted path, reward.name: "reward_fns:...")."""


def digit_fraction(response: str, answer, **_) -> float:
    """Share of digits in the response: varies even for a random model, so advantages are never all zero."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def needs_missing_sandbox(response, answer, **_):
    """A code-executing reward on a machine without isolation."""
    from megarl.sandbox import SandboxUnavailable

    raise SandboxUnavailable("no namespaces here")
