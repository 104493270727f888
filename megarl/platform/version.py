"""The versions megarl is tested with, checked when megarl starts."""
from __future__ import annotations

from importlib import metadata

from ..errors import UserError

PINNED = {"megatron-core": "0.19.2"}


class VersionMismatchError(UserError, RuntimeError):
    pass


def check_versions(installed: dict[str, str | None] | None = None) -> None:
    """Stop with a clear message when an installed package differs from the tested pin.

    The megatron-core CPU shims patch specific lines of 0.19.2 (see megarl/compat/megatron.py); another release may
    move them and fail in a far less obvious place, so a mismatch is an error, not a warning.
    """
    lookup = installed.get if installed is not None else _installed
    for package, pinned in PINNED.items():
        found = lookup(package)
        if found != pinned:
            have = f"{package} {found} is installed" if found else f"{package} is not installed"
            raise VersionMismatchError(
                f"{have}, but megarl is tested with {package}=={pinned} only (its CPU shims patch that release). "
                f"Fix: run `bash launchers/install.sh`, or `pip install --no-deps --ignore-requires-python "
                f"{package}=={pinned}`.")


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
