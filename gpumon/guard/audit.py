"""Check 2: the ring re-execution audit, and the reruns that tell transient from persistent from
application (imports torch; ``gpumon.guard.core`` uses it).

Every ``audit_every`` steps (steps 0, M, 2M, ...: step 0 too, so a wrong setup shows at once) each
rank recomputes the micro-batch of a rank on **another node** (a ring over nodes: rank r, the i-th
rank of its node, audits the i-th rank of the next node; with every rank on one node, rank r audits
rank r + 1, and the audit says so), from the same weights (before the update), the same buffers
(as the audited rank's forward saw them) and the same random seed, on the model's module itself
(``ddp.module``: DDP's reducer does not take part, nothing is reduced; the real gradients are set
aside and put back). It compares, bit for bit, the loss and a 128-bit fingerprint of every
parameter's gradient with what the audited rank computed for itself: the audited rank fingerprints
its **local** gradients in the comm hook, before the all-reduce. Only fingerprints travel: one
``all_gather`` of a small int64 tensor (``9 + 2 * parameters`` words per computation) on the guard's
gloo group.

A disagreement is settled in one more round: a rank on a third node computes the disputed
micro-batch, and both GPUs of the dispute compute their part again on the same GPU
(``gpumon.guard.rerun`` judges). The GPU whose result disagrees with the majority is named, on its
own micro-batch and on the one it audited. An alarm stops the update on every rank.

What the user hands in (``Guard(..., audit_every=M, batch_for=..., loss_fn=...)``):

- ``batch_for(rank, step)``: rank ``rank``'s micro-batch of step ``step``, rebuilt on any rank (a
  seeded ``DistributedSampler`` built with that rank, a callback into the data set), placed on this
  rank's device; a pure function of (rank, step);
- ``loss_fn(model, batch)``: the forward and loss, the same function the training loop uses with
  ``model`` the DDP model (the audit calls it with ``ddp.module``);
- ``backward(loss)`` (optional): how the loop calls backward (default ``loss.backward()``; with AMP,
  ``lambda loss: scaler.scale(loss).backward()``);
- randomness: if the forward draws random numbers (dropout), call ``guard.seed_step()`` right
  before the forward of every step: it seeds torch with ``step_seed(seed, rank, step)``, and the
  audit replays rank t's step with t's seed. The audit restores the caller's random state after.

Limits: one micro-batch per rank per step (no gradient accumulation under ``no_sync``); the same
GPU model, software and thread count on every rank (checked at start); a deterministic run
(``deterministic()``, checked at start).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gpumon.guard import rerun
from gpumon.guard.rerun import node_of, ring
from gpumon.guard.verdict import Identity
from gpumon.sdc.fingerprint import Fingerprint, fingerprint_tensor

log = logging.getLogger("gpumon.guard")

BatchFor = Callable[[int, int], Any]
LossFn = Callable[[Any, Any], torch.Tensor]
Backward = Callable[[torch.Tensor], Any]

CUBLAS_CONFIG = ":4096:8"
HOW_TO_FIX = ("call gpumon.guard.deterministic() at the start of every rank, before CUDA is initialised "
              "(it sets CUBLAS_WORKSPACE_CONFIG=:4096:8, torch.use_deterministic_algorithms(True), "
              "torch.backends.cudnn.deterministic=True, torch.backends.cudnn.benchmark=False)")

# row layout of one computation (int64 words)
_STATUS, _HAS_LOSS, _NONFINITE, _SIG, _IN, _LOSS, _LOSS_VALUE, _GRADS = 0, 1, 2, 3, 4, 6, 8, 9
OK, RAISED, OUT_OF_MEMORY = 0, 1, 2


class SettleFailed(RuntimeError):
    """The round that settles a disagreement failed (a peer gone, a timeout): ``blames`` name both
    GPUs of each disputed micro-batch, ``unknown`` (the guard skips the update and switches off)."""

    def __init__(self, blames: list[Blame], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.blames = blames


class AuditError(ValueError):
    """The audit cannot be run as set up (not deterministic, a rebuilt micro-batch of another shape
    or other contents, a ``batch_for``/``loss_fn`` that raised): raised on every rank at once."""


# -- setup -----------------------------------------------------------------------------------------

def deterministic(*, threads: int | None = None) -> None:
    """Make this process compute bit-exactly the same results as any other rank on the same GPU
    model and software. Call it at the start of every rank, **before CUDA is initialised** (the
    cuBLAS workspace setting is read when cuBLAS starts; set it in the job's environment to be sure).

    Sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set), ``torch.use_deterministic_algorithms
    (True)`` (torch then refuses a kernel that has no deterministic version: say which and fix or
    replace it), ``cudnn.deterministic = True``, ``cudnn.benchmark = False``, and, if ``threads`` is
    given, torch's intra-op thread count (on CPUs a reduction's rounding depends on it).
    """
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if started and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        raise AuditError("gpumon.guard.deterministic(): CUDA is already initialised, so cuBLAS would not "
                         f"see CUBLAS_WORKSPACE_CONFIG: call it before any CUDA work, or set "
                         f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_CONFIG} in the job's environment")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_CONFIG)
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C, "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(True)
    else:
        # the public call imports torch._inductor (a second or more per process) only to set
        # inductor's own flag; without inductor loaded, ATen's flag is the one that counts
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if threads is not None:
        torch.set_num_threads(threads)


def determinism_problems(device: torch.device) -> list[str]:
    """Why this process is not deterministic, in words (empty: it is, as far as torch says)."""
    out = []
    if not torch.are_deterministic_algorithms_enabled():
        out.append("torch.are_deterministic_algorithms_enabled() is False")
    elif torch.is_deterministic_algorithms_warn_only_enabled():
        out.append("torch.use_deterministic_algorithms(True, warn_only=True): non-deterministic kernels "
                   "still run")
    if device.type == "cuda":
        if not torch.backends.cudnn.deterministic:
            out.append("torch.backends.cudnn.deterministic is False")
        if torch.backends.cudnn.benchmark:
            out.append("torch.backends.cudnn.benchmark is True (it picks kernels by timing)")
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            out.append(f"CUBLAS_WORKSPACE_CONFIG is {os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}, not "
                       f"{CUBLAS_CONFIG!r} or ':16:8'")
    return out


def profile(device: torch.device) -> dict[str, Any]:
    """What must be equal on every rank for bit-equal results."""
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "device_type": device.type}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
        out["tf32"] = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    return out


def step_seed(seed: int, rank: int, step: int) -> int:
    """The random seed of rank ``rank``'s step ``step`` (``guard.seed_step()`` seeds torch with it)."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# -- micro-batches ---------------------------------------------------------------------------------

def leaves(batch: Any) -> list[Any]:
    if isinstance(batch, dict):
        return [v for k in sorted(batch, key=str) for v in leaves(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [v for item in batch for v in leaves(item)]
    return [batch]


def signature(batch: Any) -> str:
    """The micro-batch's structure, dtypes and shapes: ``(x: float32[8, 16], y: float32[8, 4])``."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, dict):
        return "{" + ", ".join(f"{k}: {signature(batch[k])}" for k in sorted(batch, key=str)) + "}"
    if isinstance(batch, (list, tuple)):
        inner = ", ".join(signature(v) for v in batch)
        return f"[{inner}]" if isinstance(batch, list) else f"({inner})"
    if isinstance(batch, (int, float, str, bool)) or batch is None:
        return repr(batch)[:40]
    return type(batch).__name__


def _hash63(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _inputs_fingerprint(batch: Any) -> tuple[int, int]:
    """Two 63-bit words over the bits of every tensor of the micro-batch (and the other leaves)."""
    parts = [fingerprint_tensor(t) for t in leaves(batch) if isinstance(t, torch.Tensor)]
    raw = torch.stack(parts).cpu().numpy().tobytes() if parts else b""
    others = repr([v for v in leaves(batch) if not isinstance(v, torch.Tensor)]).encode()
    digest = hashlib.blake2b(raw + others, digest_size=16).digest()
    return (int.from_bytes(digest[:8], "little") & ((1 << 63) - 1),
            int.from_bytes(digest[8:], "little") & ((1 << 63) - 1))


# -- one computation -------------------------------------------------------------------------------

@dataclass
class Result:
    """One computation of one micro-batch, as it travels (``row``) and as it is judged."""

    status: int = OK
    has_loss: bool = False
    nonfinite: bool = False
    sig: int = 0
    inputs: tuple[int, int] = (0, 0)
    loss: tuple[int, int] = (0, 0)
    loss_value: float = 0.0
    grads: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))
    error: str = ""  # local only: what raised
    signature: str = ""  # local only

    def row(self, params: int) -> torch.Tensor:
        out = torch.zeros(_GRADS + 2 * params, dtype=torch.int64)
        out[_STATUS], out[_HAS_LOSS], out[_NONFINITE] = self.status, int(self.has_loss), int(self.nonfinite)
        out[_SIG] = self.sig
        out[_IN], out[_IN + 1] = self.inputs
        out[_LOSS], out[_LOSS + 1] = self.loss
        value = torch.tensor([self.loss_value], dtype=torch.float64)
        out[_LOSS_VALUE:_LOSS_VALUE + 1] = value.view(torch.int64)
        if self.grads.numel():
            out[_GRADS:] = self.grads.reshape(-1)
        return out

    @classmethod
    def from_row(cls, row: torch.Tensor) -> Result:
        return cls(status=int(row[_STATUS]), has_loss=bool(row[_HAS_LOSS]), nonfinite=bool(row[_NONFINITE]),
                   sig=int(row[_SIG]), inputs=(int(row[_IN]), int(row[_IN + 1])),
                   loss=(int(row[_LOSS]), int(row[_LOSS + 1])),
                   loss_value=float(row[_LOSS_VALUE:_LOSS_VALUE + 1].view(torch.float64)[0]),
                   grads=row[_GRADS:].reshape(-1, 2).clone())

    def key(self, with_loss: bool) -> bytes:
        """Equal keys: equal bits (the loss only when the audited rank handed its loss in)."""
        loss = torch.tensor(self.loss, dtype=torch.int64).numpy().tobytes() if with_loss else b""
        return loss + self.grads.numpy().tobytes()

    def grads_digest(self) -> str:
        return hashlib.blake2b(self.grads.numpy().tobytes(), digest_size=16).hexdigest()

    def loss_bits(self) -> str:
        return f"{self.loss[0] & 0xFFFFFFFFFFFFFFFF:x}"


def _fp_hex(row: torch.Tensor) -> str:
    plain, weighted = (int(v) & 0xFFFFFFFFFFFFFFFF for v in row.tolist())
    return Fingerprint(plain, weighted).hex()


def grad_fingerprint(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's fingerprint, on its device; -0.0 counts as +0.0 (``x + 0.0``): a gradient
    accumulated into a zeroed ``.grad`` (``zero_grad(set_to_none=False)``) is +0.0 where a fresh one
    is -0.0, the same value. None: no gradient (the fingerprint of zeros is (0, 0))."""
    if grad is None:
        return None
    return fingerprint_tensor(torch.add(grad.detach(), 0.0) if grad.is_floating_point() else grad)


@dataclass
class Blame:
    """What the audit or a rerun found about one rank: its verdict's parts (``core`` writes it)."""

    rank: int
    check: str
    fault: str
    message: str
    evidence: dict[str, Any]
    owner: int  # whose micro-batch the failing computation was (for the replay bundle)


# -- the protocol ----------------------------------------------------------------------------------

class Auditor:
    """The audit and the reruns of one Guard (every rank has one; every collective on ``group``)."""

    def __init__(self, module: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]],
                 device: torch.device, identities: list[Identity], rank: int, group: Any, *,
                 every: int, batch_for: BatchFor, loss_fn: LossFn, backward: Backward | None,
                 seed: int) -> None:
        self.module = module
        self.named = named
        self.device = device
        self.identities = identities
        self.rank = rank
        self.world = len(identities)
        self.group = group
        self.every = every
        self.batch_for = batch_for
        self.loss_fn = loss_fn
        self.backward = backward
        self.seed = seed
        self.targets, self.note = ring(identities)
        if self.note and every:
            log.warning("gpumon.guard: audit: %s", self.note)
        self._buffers: dict[str, torch.Tensor] | None = None
        self._busy = False
        self._snap_step: int | None = None
        self.step_now: Callable[[], int] = lambda: -1

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    # -- buffers: the audited rank's forward saw them as they were before it ---------------------

    def pre_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        """A forward pre-hook on the module: on an audit step, keep the buffers as the forward sees
        them (after DDP's broadcast), so that the recomputation starts from the same."""
        step = self.step_now()
        if self._busy or not self.due(step) or self._snap_step == step:
            return
        self._snap_step = step
        self._buffers = {n: b.detach().clone() for n, b in self.module.named_buffers()}

    @contextlib.contextmanager
    def _isolated(self, step: int) -> Iterator[None]:
        """The module's buffers as the step's forward saw them, its gradients set aside, the caller's
        random state kept; all put back after."""
        buffers = dict(self.module.named_buffers())
        now = {n: b.detach().clone() for n, b in buffers.items()}
        snap = self._buffers if self._snap_step == step else None
        saved = [p.grad for _, p in self.named]
        devices = [self.device] if self.device.type == "cuda" else []
        self._busy = True
        try:
            with torch.no_grad():
                if snap is not None:
                    for n, b in buffers.items():
                        if n in snap:
                            b.copy_(snap[n])
            for _, p in self.named:
                p.grad = None
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            self._busy = False
            with torch.no_grad():
                for n, b in buffers.items():
                    b.copy_(now[n])
            for (_, p), g in zip(self.named, saved, strict=True):
                p.grad = g

    def compute(self, owner: int, step: int, batch: Any = None) -> Result:
        """Rank ``owner``'s micro-batch of ``step`` computed here: loss, gradients' fingerprints."""
        out = Result()
        try:
            if batch is None:
                batch = self.batch_for(owner, step)
            out.signature = signature(batch)
            out.sig = _hash63(out.signature.encode())
            out.inputs = _inputs_fingerprint(batch)
            with self._isolated(step):
                torch.manual_seed(step_seed(self.seed, owner, step))
                loss = self.loss_fn(self.module, batch)
                if self.backward is not None:
                    self.backward(loss)
                else:
                    loss.backward()  # type: ignore[no-untyped-call]
                pairs = [grad_fingerprint(p.grad) for _, p in self.named]
                zero = torch.zeros(2, dtype=torch.int64, device=self.device)
                grads = torch.stack([z if z is not None else zero for z in pairs]) if pairs else \
                    torch.zeros(0, 2, dtype=torch.int64)
                finite = [torch.isfinite(p.grad).all() for _, p in self.named if p.grad is not None]
                bad = torch.logical_not(torch.stack(finite).all()) if finite else torch.tensor(False)
                lossfp = fingerprint_tensor(loss.detach())
                out.grads = grads.cpu()
                out.loss = (int(lossfp[0]), int(lossfp[1]))
                out.loss_value = float(loss.detach().double())
                out.has_loss = True
                out.nonfinite = bool(bad) or not bool(torch.isfinite(loss.detach()))
        except torch.OutOfMemoryError as exc:
            out.status, out.error = OUT_OF_MEMORY, f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            out.status = RAISED
            out.error = f"computing rank {owner}'s micro-batch of step {step}: {type(exc).__name__}: {exc}"
        if out.grads.shape[0] != len(self.named):
            out.grads = torch.zeros(len(self.named), 2, dtype=torch.int64)
        return out

    def own(self, loss: torch.Tensor | None, local: dict[int, torch.Tensor]) -> Result:
        """This rank's own computation of its step: the local gradients' fingerprints taken in the
        comm hook and the loss the loop handed in (None: the audit compares the gradients only)."""
        out = Result()
        zero = torch.zeros(2, dtype=torch.int64, device=self.device)
        rows = [local.get(id(p), zero) for _, p in self.named]
        out.grads = (torch.stack(rows).cpu() if rows else torch.zeros(0, 2, dtype=torch.int64))
        if loss is not None:
            lossfp = fingerprint_tensor(loss.detach())
            out.loss = (int(lossfp[0]), int(lossfp[1]))
            out.loss_value = float(loss.detach().double())
            out.has_loss = True
            out.nonfinite = not bool(torch.isfinite(loss.detach()))
        return out

    # -- rounds ------------------------------------------------------------------------------------

    def _round(self, jobs: list[tuple[int, int]], step: int, extra: Result | None = None,
               done: dict[tuple[int, int], Result] | None = None,
               ) -> tuple[dict[tuple[int, int], Result], list[Result]]:
        """Every rank computes its jobs (worker, owner; ``done``: computed already); one all_gather
        brings every result to every rank. ``extra``: this rank's own computation, sent first."""
        done = done or {}
        width = max(sum(1 for j in jobs if j[0] == r) for r in range(self.world)) if jobs else 0
        results = [done[j] if j in done else self.compute(j[1], step) for j in jobs if j[0] == self.rank]
        rows = ([extra] if extra is not None else []) + results
        params = len(self.named)
        slots = width + (1 if extra is not None else 0)
        local = torch.zeros(max(slots, 1), _GRADS + 2 * params, dtype=torch.int64)
        for i, res in enumerate(rows):
            local[i] = res.row(params)
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=self.group)
        self._raise_on_errors(rows, gathered, slots)
        out: dict[tuple[int, int], Result] = {}
        extras: list[Result] = []
        for r in range(self.world):
            start = 0
            if extra is not None:
                extras.append(Result.from_row(gathered[r][0]))
                start = 1
            theirs = [j for j in jobs if j[0] == r]
            for i, job in enumerate(theirs):
                out[job] = Result.from_row(gathered[r][start + i])
        return out, extras

    def _raise_on_errors(self, rows: list[Result], gathered: list[torch.Tensor], slots: int) -> None:
        status = [int(g[i, _STATUS]) for g in gathered for i in range(slots)]
        if not any(status):
            return
        said: list[Any] = [None] * self.world
        dist.all_gather_object(said, [(r.error, r.signature) for r in rows], group=self.group)
        words = [f"rank {r}: {err} (micro-batch {sig or 'not built'})" for r, items in enumerate(said)
                 for err, sig in (items or []) if err]
        if all(s in (OK, OUT_OF_MEMORY) for s in status):
            raise MemoryError("the audit's recomputation ran out of memory: " + "; ".join(words))
        raise AuditError("gpumon.guard: audit: batch_for/loss_fn raised: " + "; ".join(words))

    # -- the audit ---------------------------------------------------------------------------------

    def _prepare(self, owner: int, step: int, batch: Any) -> tuple[Any, str, list[int]]:
        """(the micro-batch, its signature, [status, signature hash, inputs' fingerprint])."""
        try:
            if batch is None:
                batch = self.batch_for(owner, step)
            sig = signature(batch)
            return batch, sig, [OK, _hash63(sig.encode()), *_inputs_fingerprint(batch)]
        except Exception as exc:
            return None, f"batch_for({owner}, {step}) raised {type(exc).__name__}: {exc}", [RAISED, 0, 0, 0]

    def audit(self, step: int, own: Result, batch: Any = None) -> list[Blame]:
        """Check 2 at ``step`` (after backward, before optimizer.step()); [] when every audit agrees.
        ``own``: this rank's own computation (``own()``); ``batch``: the micro-batch it trained on
        (None: rebuilt with ``batch_for``). Raises AuditError (the same on every rank) when the audit
        cannot judge: a rebuilt micro-batch of another shape or other contents than the audited
        rank's, a batch_for or loss_fn that raised."""
        target = self.targets[self.rank]
        _, own_sig, own_row = self._prepare(self.rank, step, batch)
        rebuilt, aud_sig, aud_row = self._prepare(target, step, None)
        # round 0: shapes and contents first, so that no rank computes a micro-batch of another shape
        local = torch.tensor([own_row, aud_row], dtype=torch.int64)
        pre = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(pre, local, group=self.group)
        self._check_inputs(step, pre, own_sig, aud_sig)
        jobs = [(r, self.targets[r]) for r in range(self.world)]
        mine = self.compute(target, step, rebuilt)
        first, owns = self._round(jobs, step, extra=own, done={(self.rank, target): mine})
        disputes = []
        for r, t in jobs:
            with_loss = owns[t].has_loss
            if first[(r, t)].key(with_loss) != owns[t].key(with_loss):
                disputes.append((r, t))
        if not disputes:
            return []
        log.error("gpumon.guard: audit at step %d: %s", step, "; ".join(
            f"rank {r}'s computation of rank {t}'s micro-batch differs from rank {t}'s own"
            for r, t in disputes))
        try:
            return self._settle(step, disputes, first, owns)
        except AuditError:
            raise
        except Exception as exc:
            blames = [Blame(g, "audit", rerun.UNKNOWN,
                            f"step {step}: rank {r}'s computation of rank {t}'s micro-batch differs from "
                            f"rank {t}'s own ({self.identities[g].describe()}); the round that would settle "
                            f"it failed ({type(exc).__name__}: {exc}): which GPU is wrong is unknown; the "
                            "update is skipped on every rank",
                            {"disputes": [{"step": step, "micro_batch_of": t, "audited_by": r,
                                           "judgement": "not settled: the round that would settle it "
                                                        "failed"}],
                             "settle_error": f"{type(exc).__name__}: {exc}", **self._ring_evidence(g)}, t)
                      for r, t in disputes for g in (t, r)]
            raise SettleFailed(blames, exc) from exc

    def _check_inputs(self, step: int, pre: list[torch.Tensor], own_sig: str, aud_sig: str) -> None:
        status = [int(p[i, 0]) for p in pre for i in (0, 1)]
        pairs = [(r, self.targets[r]) for r in range(self.world)]
        shape = [(r, t) for r, t in pairs if int(pre[r][1, 1]) != int(pre[t][0, 1])]
        if any(status) or shape:
            said: list[Any] = [None] * self.world
            dist.all_gather_object(said, (own_sig, aud_sig), group=self.group)
            if any(status):
                words = [f"rank {r}: {said[r][i]}" for r in range(self.world) for i in (0, 1)
                         if int(pre[r][i, 0])]
                raise AuditError("gpumon.guard: audit: cannot rebuild the micro-batches: " + "; ".join(words))
            words = [f"rank {r} rebuilt rank {t}'s micro-batch of step {step} as {said[r][1]}, but rank {t} "
                     f"trained on {said[t][0]}" for r, t in shape]
            raise AuditError("gpumon.guard: audit: a rebuilt micro-batch has another shape than the audited "
                             "rank's: " + "; ".join(words) + " (batch_for(rank, step) must rebuild exactly "
                             "that rank's micro-batch, on any rank)")
        other = [(r, t) for r, t in pairs if pre[r][1, 2:].tolist() != pre[t][0, 2:].tolist()]
        if other:
            raise AuditError("gpumon.guard: audit: a rebuilt micro-batch has the audited rank's shape but "
                             "other contents: " + "; ".join(
                                 f"rank {r}'s batch_for({t}, {step}) differs from what rank {t} trained on"
                                 for r, t in other) + " (input fingerprints differ; batch_for must be a pure "
                             "function of (rank, step), e.g. a DistributedSampler built with that rank, "
                             "shuffling from a fixed seed)")

    def _referee(self, r: int, t: int, busy: set[int]) -> int | None:
        avoid = {node_of(self.identities[r]), node_of(self.identities[t])}
        order = [(t + 1 + i) % self.world for i in range(self.world)]
        third = [j for j in order if node_of(self.identities[j]) not in avoid]
        if self.note:  # every rank on one node: another GPU of it is the best referee there is
            third = [j for j in order if j not in (r, t)]
        calm = [j for j in third if j not in busy]
        chosen = calm or third
        return chosen[0] if chosen else None

    def _settle(self, step: int, disputes: list[tuple[int, int]], first: dict[tuple[int, int], Result],
                owns: list[Result]) -> list[Blame]:
        busy = {x for d in disputes for x in d}
        referees = {d: self._referee(*d, busy) for d in disputes}
        jobs: list[tuple[int, int]] = []
        for (r, t), j in referees.items():
            for job in ((t, t), (r, t)) + (((j, t),) if j is not None else ()):
                if job not in jobs:
                    jobs.append(job)
        second, _ = self._round(jobs, step)
        named: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        blames: list[Blame] = []
        for (r, t), j in referees.items():
            with_loss = owns[t].has_loss
            runs = [rerun.Computation(t, "own", owns[t].key(with_loss), second[(t, t)].key(with_loss)),
                    rerun.Computation(r, "audit", first[(r, t)].key(with_loss),
                                      second[(r, t)].key(with_loss))]
            if j is not None:
                runs.append(rerun.Computation(j, "referee", second[(j, t)].key(with_loss)))
            verdict = rerun.judge(t, runs)
            results = {"own": owns[t], "audit": first[(r, t)], "referee": second.get((j, t)) if j is not None
                       else None}
            again = {"own": second[(t, t)], "audit": second[(r, t)]}
            evidence = self._dispute_evidence(step, r, t, j, verdict, results, again, with_loss)
            if verdict.application:
                blames.append(Blame(
                    t, "audit", rerun.APPLICATION,
                    f"step {step}: the audit of rank {t}'s micro-batch disagreed, and it is not a GPU's "
                    f"fault: {verdict.why} ({self.identities[t].describe()}); the update is skipped on "
                    "every rank", {"disputes": [evidence], **self._ring_evidence(t)}, t))
                continue
            for g, fault in verdict.culprits.items():
                role = "own micro-batch" if g == t else f"rank {t}'s micro-batch, which it audited"
                named.setdefault(g, []).append((fault, {**evidence, "role_of_named": role}))
        # Several GPUs whose own step differs from every recomputation, their own GPU's included, at
        # the same step: not several faulty GPUs at once, but a loop that computes something else
        # than the audit recomputes (dropout without seed_step(), a backward of its own, ...).
        systematic = sorted(g for g, items in named.items()
                            if all(f == rerun.TRANSIENT and e["micro_batch_of"] == g for f, e in items))
        if len(systematic) >= 2:
            for g in systematic:
                blames.append(Blame(
                    g, "audit", rerun.APPLICATION,
                    f"step {step}: the audit found the own computations of ranks "
                    f"{', '.join(map(str, systematic))} different from every recomputation of them, on "
                    f"their own GPUs too: the training loop computes something other than the audit "
                    "recomputes (a forward that draws random numbers without guard.seed_step() right "
                    "before it? a backward other than the one given to the Guard? gradient "
                    "accumulation?); not a GPU fault; the update is skipped on every rank",
                    {"disputes": [e for _, e in named.pop(g)], "ranks_alike": systematic,
                     **self._ring_evidence(g)}, g))
        for g, items in sorted(named.items()):
            fault = rerun.combine([f for f, _ in items])
            roles = " and ".join(dict.fromkeys(e["role_of_named"] for _, e in items))
            why = {rerun.PERSISTENT: "it computed the same wrong bits again when rerun on the same GPU, "
                                     "GPUs of other nodes computed the majority's",
                   rerun.TRANSIENT: "its rerun on the same GPU computed a different result: a transient "
                                    "fault",
                   rerun.UNKNOWN: "with two nodes, which of the two GPUs is wrong is unknown"}[fault]
            owner = next((e["micro_batch_of"] for _, e in items), g)
            blames.append(Blame(
                g, "audit", fault,
                f"step {step}: the audit names rank {g} ({self.identities[g].describe()}): its results "
                f"disagree with the majority on its {roles}; {fault}: {why}; the update is skipped on "
                "every rank", {"disputes": [e for _, e in items], **self._ring_evidence(g)}, owner))
        return blames

    def _ring_evidence(self, g: int) -> dict[str, Any]:
        auditors = [r for r in range(self.world) if self.targets[r] == g]
        out: dict[str, Any] = {"audits": self.targets[g], "audited_by": auditors}
        if self.note:
            out["ring_note"] = self.note
        return out

    def _describe(self, role: str, rank: int, res: Result, with_loss: bool,
                  again: Result | None = None) -> dict[str, Any]:
        row: dict[str, Any] = {"role": role, "rank": rank, "node": node_of(self.identities[rank]),
                               "loss": res.loss_value if res.has_loss else None,
                               "loss_bits": res.loss_bits() if res.has_loss else None,
                               "grads_fingerprint": res.grads_digest()}
        if again is not None:
            row["rerun_same_gpu"] = {"loss": again.loss_value, "loss_bits": again.loss_bits(),
                                     "grads_fingerprint": again.grads_digest(),
                                     "same_as_first": again.key(with_loss) == res.key(with_loss)}
        return row

    def _dispute_evidence(self, step: int, r: int, t: int, j: int | None, verdict: rerun.Dispute,
                          results: dict[str, Result | None], again: dict[str, Result],
                          with_loss: bool) -> dict[str, Any]:
        rows = [self._describe("own", t, results["own"] or Result(), with_loss, again["own"]),
                self._describe("audit", r, results["audit"] or Result(), with_loss, again["audit"])]
        ref = results["referee"]
        if j is not None and ref is not None:
            rows.append(self._describe("referee", j, ref, with_loss))
        own, aud = results["own"] or Result(), results["audit"] or Result()
        diff = (own.grads != aud.grads).any(dim=1).nonzero().reshape(-1).tolist()
        return {"step": step, "micro_batch_of": t, "audited_by": r, "referee": j,
                "loss_compared": with_loss, "computations": rows, "majority_ranks": verdict.majority,
                "judgement": verdict.why,
                "parameters_differing": len(diff),
                "differing_parameters": [{"parameter": self.named[i][0], "own": _fp_hex(own.grads[i]),
                                          "audit": _fp_hex(aud.grads[i])} for i in diff[:10]]}

    # -- check 1's reruns ---------------------------------------------------------------------------

    def elsewhere(self, t: int, bad: Sequence[int]) -> int | None:
        """A rank on another node to compute rank t's micro-batch (its auditor where possible)."""
        mine = node_of(self.identities[t])
        order = [r for r in range(self.world) if self.targets[r] == t] + \
            [(t + 1 + i) % self.world for i in range(self.world)]
        other = [r for r in order if r != t and node_of(self.identities[r]) != mine]
        if not other and self.note:
            other = [r for r in order if r != t]  # one node: another GPU of it
        calm = [r for r in other if r not in bad]
        chosen = calm or other
        return chosen[0] if chosen else None

    def rerun_nonfinite(self, step: int, bad: Sequence[int]) -> dict[int, tuple[str, str, dict[str, Any]]]:
        """Check 1 named ranks ``bad`` (NaN/Inf in their local gradients): each computes its
        micro-batch again, and a rank of another node computes it too. rank -> (fault, why, evidence)."""
        helpers = {t: self.elsewhere(t, bad) for t in bad}
        jobs: list[tuple[int, int]] = []
        for t, h in helpers.items():
            for job in ((t, t),) + (((h, t),) if h is not None else ()):
                if job not in jobs:
                    jobs.append(job)
        done, _ = self._round(jobs, step)
        out = {}
        for t, h in helpers.items():
            again = done[(t, t)]
            there = done[(h, t)] if h is not None else None
            fault, why = rerun.nonfinite_fault(again.nonfinite,
                                               there.nonfinite if there is not None else None)
            rows = self._rerun_rows(t, again, h, there)
            out[t] = (fault, why, {"reruns": rows, "rerun_judgement": why})
        return out

    def _rerun_rows(self, t: int, again: Any, h: int | None, there: Any) -> list[dict[str, Any]]:
        """The verdict's ``reruns``: rank ``t``'s micro-batch computed again on its own GPU, and by
        rank ``h`` (another node's GPU) where one computed it."""
        rows = [{"role": "rerun_same_gpu", "rank": t, "node": node_of(self.identities[t]),
                 "nonfinite": again.nonfinite, "loss": again.loss_value, "loss_bits": again.loss_bits(),
                 "grads_fingerprint": again.grads_digest()}]
        if h is not None and there is not None:
            rows.append({"role": "other_node", "rank": h, "node": node_of(self.identities[h]),
                         "nonfinite": there.nonfinite, "loss": there.loss_value,
                         "loss_bits": there.loss_bits(), "grads_fingerprint": there.grads_digest()})
        return rows

    def rerun_every(self, step: int) -> dict[int, tuple[bool, bool | None, list[dict[str, Any]]]]:
        """Check 1 in mode "after" saw NaN/Inf in the reduced gradients, whose rank it cannot see:
        every rank computes its own micro-batch again on its own GPU and one other rank's (the one it
        audits: a GPU of another node where there is one), in one round. rank -> (its rerun on the
        same GPU is non-finite, the other node's computation of its micro-batch is (None: nobody
        else computed it), the rows for the verdict's ``reruns``)."""
        helpers = {t: self.elsewhere(t, ()) for t in range(self.world)}
        jobs: list[tuple[int, int]] = [(t, t) for t in range(self.world)]
        jobs += [(h, t) for t, h in helpers.items() if h is not None]
        done, _ = self._round(jobs, step)
        out: dict[int, tuple[bool, bool | None, list[dict[str, Any]]]] = {}
        for t, h in helpers.items():
            again = done[(t, t)]
            there = done[(h, t)] if h is not None else None
            rows = self._rerun_rows(t, again, h, there)
            out[t] = (again.nonfinite, there.nonfinite if there is not None else None, rows)
        return out
