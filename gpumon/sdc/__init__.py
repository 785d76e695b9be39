"""SDC canaries: replay workloads bit-exactly against a golden run and across GPUs.

``capture`` (a real training step into a replay bundle) is the public API; ``gpumon canary ...``
(``gpumon.sdc.cli``) and the ``sdc_canary`` check run the canaries.

The names are loaded on first use: importing ``gpumon.sdc.cli`` (which every ``gpumon`` command
does, to build its parser) must not import torch, which takes over a second and is an optional
dependency (the ``compute`` extra: ``gpumon-node[compute]``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpumon.sdc.bundle import BundleError, capture
    from gpumon.sdc.fingerprint import Fingerprint, fingerprint

_LAZY = {
    "capture": "gpumon.sdc.bundle",
    "BundleError": "gpumon.sdc.bundle",
    "Fingerprint": "gpumon.sdc.fingerprint",
    "fingerprint": "gpumon.sdc.fingerprint",
}

__all__ = ["BundleError", "Fingerprint", "capture", "fingerprint"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumon.sdc' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
