"""Check 1 in mode ``"after"`` (imports torch): no comm hook, DDP's own C++ all-reduce untouched, one
fused NaN/Inf pass over the reduced gradients after the backward, and the two other jobs the comm
hook does in mode ``"hook"`` done without it.

NaN and Inf survive the all-reduce's sum (NaN + x is NaN, Inf + finite is Inf, Inf - Inf is NaN), so
every rank's reduced gradients show any rank's non-finite local value. What the pass cannot see is
whose it was: ``Guard`` names that rank afterwards (``StepVerdictMixin._judge_after``: the loss each
rank handed in, the reruns of ``batch_for`` and ``loss_fn``) and says so when it cannot.

- ``reduced_nonfinite``: per device and dtype, one ``torch._foreach_norm`` over every gradient (a
  fused multi-tensor kernel on CUDA, one C++ loop on a CPU), the per-tensor norms tested together on
  the device; the caller reads the one flag (the step's one host sync).
- The audit's own result (``AfterHooksMixin._capture``): on an audit step only, a post-accumulate-
  grad hook on each parameter fingerprints its LOCAL gradient (it runs before DDP's reducer copies
  that gradient into its bucket), removed again before the audit.
- The straggler scores' end of the backward (``_pace_forward``): a hook on the forward's output
  queues an autograd engine callback, which runs when this rank's backward is done and before DDP's
  own end-of-backward callback waits for the other ranks' all-reduce.
"""

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from gpumon.guard.audit import Auditor, grad_fingerprint
from gpumon.guard.base import GuardBase
from gpumon.guard.pace import PaceMeter

HALF = (torch.float16, torch.bfloat16)


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients to test: each parameter's ``.grad`` (a sparse one by its values)."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        out.append(g._values() if g.is_sparse else g)
    return out


def reduced_nonfinite(grads: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """0-d bool: does any of ``grads`` hold a NaN or an Inf? None: no gradient at all. One fused pass
    per device and dtype (``torch._foreach_norm``, L2; fp16 and bf16 accumulated in fp32, where a
    finite fp16 tensor cannot overflow), the norms tested on the device; several devices' flags are
    brought to the host (a module on one device, as DDP's are: no copy). A finite fp32 or bf16
    gradient element beyond ~1.8e19, whose square overflows, reads as non-finite (the exact
    per-parameter look, ``isfinite``, runs only on an alarm and names the parameters)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (_, dtype), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32 if dtype in HALF else None)
        flags.append(torch.isfinite(torch.stack(norms)).all())
    if not flags:
        return None
    if len({f.device for f in flags}) > 1:
        flags = [f.cpu() for f in flags]
    return torch.logical_not(torch.stack(flags).all()) if len(flags) > 1 else torch.logical_not(flags[0])


def first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a forward's output (a tensor, or one inside a tuple, list or dict) that
    the backward will go through."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    items: Any = ()
    if isinstance(output, dict):
        items = output.values()
    elif isinstance(output, (list, tuple)):
        items = output
    for item in items:
        found = first_grad_tensor(item)
        if found is not None:
            return found
    return None


class AfterHooksMixin(GuardBase):
    """``Guard``'s hooks in mode ``"after"``: the audit's local fingerprints on an audit step, the
    straggler meter's end of the backward. Both run inside the user's forward and backward and
    never raise into them (an error turns the guard off)."""

    pace: PaceMeter | None
    _auditor: Auditor | None
    _lock: threading.Lock
    _local: dict[int, torch.Tensor]
    _named: list[tuple[str, torch.nn.Parameter]]
    _capture_handles: list[RemovableHandle]

    # -- the audit's own result: the local gradients, on an audit step only ------------------------

    def _capture_pre_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        """A forward pre-hook: on an audit step's first forward, a post-accumulate-grad hook on every
        parameter (removed by ``_end_capture`` before the audit)."""
        auditor = self._auditor
        if (auditor is None or self._capture_handles or auditor._busy or not auditor.due(self.steps)
                or self.disabled is not None):
            return
        self._capture_handles = [p.register_post_accumulate_grad_hook(self._capture)  # type: ignore[no-untyped-call]
                                 for _, p in self._named]

    def _capture(self, param: torch.Tensor) -> None:
        """The local gradient of ``param``, fingerprinted on its device, before DDP's reducer copies it
        into its bucket (the reducer's hook runs after this one, on the same accumulator)."""
        auditor = self._auditor
        if auditor is None or auditor._busy or self.disabled is not None:
            return
        try:
            got = grad_fingerprint(param.grad)
            if got is not None:
                with self._lock:
                    self._local[id(param)] = got
        except Exception as exc:
            self._internal("the audit's look at the local gradients", exc, raise_strict=False)

    def _end_capture(self) -> None:
        handles, self._capture_handles = self._capture_handles, []
        for h in handles:
            h.remove()

    # -- the straggler scores: this rank's backward done, before waiting for the others -------------

    def _pace_forward(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        """A forward hook: the output's gradient hook queues a callback for the end of this
        backward, which marks it done."""
        pace = self.pace
        if pace is None or not pace.active or self.disabled is not None:
            return
        tensor = first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(self._pace_backward_started)  # type: ignore[no-untyped-call]

    def _pace_backward_started(self, grad: torch.Tensor) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._pace_backward_done)
        except Exception as exc:
            self._internal("the straggler meter's hook", exc, raise_strict=False)

    def _pace_backward_done(self) -> None:
        pace = self.pace
        if pace is not None and self.disabled is None:
            pace.backward_done()
