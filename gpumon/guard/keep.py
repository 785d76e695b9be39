"""The failing step, kept by the rank a verdict names (imports torch).

Where the step fits a replay bundle (``gpumon.sdc.bundle.capture``: a module-level
``model_factory`` that rebuilds the model from JSON ``model_kwargs``, a module-level
``loss_fn(model, batch)``, a micro-batch that is a dict of tensors, an optimizer over exactly
``model.parameters()``), it is kept as one: ``gpumon canary replay <bundle>`` replays it offline on
any GPU (``--gpus``, ``--workers``) from the weights, optimizer state, micro-batch and random seed
of the failing step, before its update. Where it does not fit, what can be replayed is kept with
``torch.save`` (``step.pt``: the module's ``state_dict``, the optimizer's, the micro-batch, the seed)
and ``note.json`` says why it is not a replay bundle.

The bundle's own expected fingerprints are those of its capture-time replays on the named GPU
(``capture`` runs the step twice there to check it is deterministic): replay it on another GPU or
node, or on several workers at once, to see whether the named GPU's bits were wrong.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gpumon.atomic import write_atomic

log = logging.getLogger("gpumon.guard")

STATE = "step.pt"
NOTE = "note.json"


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


def why_not_a_bundle(batch: Any, loss_fn: Callable[..., Any], model_factory: Callable[..., Any] | None,
                     model_kwargs: Mapping[str, Any] | None) -> str | None:
    """Why the step cannot be a replay bundle (None: it can)."""
    if model_factory is None:
        return ("no model_factory was given to Guard(...): a replay bundle rebuilds the model with "
                "model_factory(**model_kwargs), a module-level function")
    if not isinstance(batch, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                 for k, v in batch.items()):
        return (f"the micro-batch is a {type(batch).__name__}, not a dict of tensors (a replay bundle "
                "holds a batch as {name: tensor})")
    try:
        json.dumps(dict(model_kwargs or {}))
    except TypeError as exc:
        return f"model_kwargs are not JSON values: {exc}"
    return None


def keep_step(folder: Path, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
              loss_fn: Callable[..., Any], seed: int, model_factory: Callable[..., Any] | None,
              model_kwargs: Mapping[str, Any] | None, name: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    """Keep the step at ``folder``; return what the verdict's evidence says about it. Never raises
    for a step that cannot be kept: the evidence says why (``bundle_error``)."""
    reason = why_not_a_bundle(batch, loss_fn, model_factory, model_kwargs)
    if reason is None and model_factory is not None:
        from gpumon.sdc.bundle import capture

        try:
            capture(folder, model=module, optimizer=optimizer, batch=batch, loss_fn=loss_fn,
                    model_factory=model_factory, model_kwargs=dict(model_kwargs or {}), seed=seed, name=name)
            return {"bundle": str(folder), "bundle_kind": "replay",
                    "bundle_replay": f"gpumon canary replay {folder}"}
        except Exception as exc:  # the user's loss_fn or factory may raise anything: keep the state
            reason = f"capture as a replay bundle failed: {exc}"
            shutil.rmtree(folder, ignore_errors=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"model": _cpu(module.state_dict()), "optimizer": _cpu(optimizer.state_dict()),
                    "batch": _cpu(batch), "seed": int(seed)}, folder / STATE)
        note = {"what": "the failing step of a gpumon.guard verdict, before its update",
                "not_a_replay_bundle_because": reason,
                "replay_by_hand": ("model.load_state_dict(s['model']); optimizer.load_state_dict("
                                   "s['optimizer']); torch.manual_seed(s['seed']); loss = loss_fn(model, "
                                   "s['batch']); loss.backward()  with s = torch.load('step.pt', "
                                   "weights_only=True)"),
                **facts}
        write_atomic(folder / NOTE, json.dumps(note, indent=1, default=str) + "\n")
    except Exception as exc:
        log.error("gpumon.guard: could not keep the failing step in %s: %s", folder, exc)
        return {"bundle": None, "bundle_error": f"{type(exc).__name__}: {exc}"}
    return {"bundle": str(folder), "bundle_kind": "state", "bundle_note": reason}
