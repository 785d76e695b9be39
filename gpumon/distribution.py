"""The name gpumon is installed under, for every hint that tells a user what to install.

The import package and the command are ``gpumon``; the distribution on the package index is
``gpumon-node``, because ``gpumon`` there is an unrelated GPU monitor (a hint saying
``pip install gpumon`` would install someone else's project).
"""

from __future__ import annotations

DISTRIBUTION = "gpumon-node"


def install_hint(extra: str | None = None) -> str:
    """The pip command that brings in ``extra`` (e.g. ``compute``: torch and numpy)."""
    target = f"{DISTRIBUTION}[{extra}]" if extra else DISTRIBUTION
    return f"pip install '{target}'"
