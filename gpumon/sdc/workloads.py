"""Canary workloads: deterministic computations that fingerprint named tensors as they go.

Faulty arithmetic units fail on specific kernels, dtypes and value ranges (ByteDance's SDC study:
GEMM, attention, MoE routing; FP64/FP32 CUDA cores more often than tensor cores), so each workload
exercises one kernel family with inputs spread over a wide range of magnitudes, and records every
intermediate it computes, in computation order, so that a mismatch names the first tensor that
differs (as SDCHunter does) instead of only "the result differs".

Inputs are generated on the CPU from a fixed seed and then moved to the device, so every device of
every kind starts from the same bits; the computation itself runs on the device. Bit-exact
repeatability needs ``deterministic()`` to have run in the process first.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpumon.sdc.fingerprint import Fingerprint, fingerprint_many, fingerprint_tensor

if TYPE_CHECKING:
    from gpumon.sdc.inject import FaultInjector


@dataclass(frozen=True)
class Point:
    """One fingerprinted tensor: name, dtype, shape and fingerprint."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    fp: Fingerprint

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.fp.hex()]

    @classmethod
    def from_json(cls, row: Any) -> Point:
        name, dtype, shape, fp = row
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), Fingerprint.from_hex(str(fp)))

    def same(self, other: Point) -> bool:
        return (self.name, self.dtype, self.shape, self.fp) == (
            other.name, other.dtype, other.shape, other.fp)


class Recorder:
    """Collects the fingerprints of a workload's named tensors, on the device, in order.

    A workload runs its device computation inside ``with rec.compute():``, which is where a fault
    harness (``gpumon.sdc.inject``), when one is attached, does its work: input generation on the
    host stays clean, as it is on a real GPU node. Fingerprinting itself runs under the harness's
    ``quiet()``, so faults land in the workload, not in the sums. With ``keep`` the recorder also
    keeps a device copy of every tensor, for a replay bundle.
    """

    def __init__(self, *, keep: bool = False, harness: Harness | None = None) -> None:
        self.keep = keep
        self.harness = harness
        self._names: list[str] = []
        self._meta: list[tuple[str, tuple[int, ...]]] = []
        self._sums: list[torch.Tensor] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def compute(self) -> contextlib.AbstractContextManager[Any]:
        return self.harness if self.harness is not None else contextlib.nullcontext()

    def _quiet(self) -> contextlib.AbstractContextManager[Any]:
        return self.harness.quiet() if self.harness is not None else contextlib.nullcontext()

    def point(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"point {name!r} recorded twice")
        with self._quiet(), torch.no_grad():
            t = tensor.detach()
            self._sums.append(fingerprint_tensor(t))
            if self.keep:
                self.tensors[name] = t.clone()
        self._names.append(name)
        self._meta.append((str(t.dtype).removeprefix("torch."), tuple(t.shape)))

    def __len__(self) -> int:
        return len(self._names)

    def points(self) -> list[Point]:
        """The fingerprints, brought to the host in one transfer."""
        with self._quiet():
            fps = fingerprint_many(self._sums)
        return [Point(n, d, s, fp) for n, (d, s), fp in zip(self._names, self._meta, fps, strict=True)]


class Harness(Protocol):
    """What a recorder needs of a fault harness: a context to compute in, and a quiet one."""

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any: ...

    def quiet(self) -> contextlib.AbstractContextManager[Any]: ...


WorkloadFn = Callable[[Recorder, torch.device], None]


@dataclass(frozen=True)
class Workload:
    """A named deterministic computation; ``params`` enter the golden key (other sizes, other bits)."""

    name: str
    fn: WorkloadFn
    params: str
    description: str = ""
    tensors: Mapping[str, Any] = field(default_factory=dict)

    def run(self, rec: Recorder, device: torch.device) -> None:
        self.fn(rec, device)


def deterministic(threads: int = 1, *, interop: bool = True) -> None:
    """Make this process bit-exactly repeatable: call once, before any CUDA work.

    One intra-op thread on CPU: with more, a reduction's split (and so its rounding) depends on the
    thread count. cuBLAS needs a fixed workspace configuration to be deterministic (NVIDIA cuBLAS
    docs, "Results reproducibility"); torch refuses non-deterministic kernels from then on.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if "torch._inductor.config" in sys.modules or not hasattr(torch._C, "_set_deterministic_algorithms"):
        torch.use_deterministic_algorithms(True)
    else:
        # The public call imports torch._inductor (1 s per worker process, twice the import of torch
        # itself) only to set inductor's own flag; nothing here compiles, so set the ATen flag alone.
        torch._C._set_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.set_num_threads(threads)
    if interop:
        with contextlib.suppress(RuntimeError):  # only allowed before the first inter-op work
            torch.set_num_interop_threads(1)


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """TF32 on or off for matmuls on GPUs (CPUs have no TF32: the same fp32 kernels run)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    # "highest" keeps CPU fp32 matmuls in fp32 (other precisions may use bf16 on some CPUs)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.set_float32_matmul_precision(precision)


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


# Per dtype, the range of power-of-two exponents the inputs span: wide, towards both ends of the
# format, but such that products summed over the GEMM depth stay finite (an inf output would hide
# later faults in the same element). fp16: max 65504, subnormals below 2^-14.
_EXPONENTS = {
    torch.float64: (-400, 400),
    torch.float32: (-50, 50),
    torch.bfloat16: (-50, 50),
    torch.float16: (-9, 4),
}


def adversarial(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator, *,
                by_rows: bool = True) -> torch.Tensor:
    """Normal values scaled per row (or column) by powers of two across the dtype's range.

    Also plants exact zeros, negative zeros and values one ulp apart: the cases where a wrong
    sign, a flushed subnormal or a lost rounding bit shows.
    """
    lo, hi = _EXPONENTS.get(dtype, (-20, 20))
    rows, cols = shape
    base = torch.randn(shape, generator=gen, dtype=torch.float64)
    count = rows if by_rows else cols
    exps = torch.linspace(lo, hi, count, dtype=torch.float64)
    exps = exps[torch.randperm(count, generator=gen)]
    scale = torch.pow(2.0, exps)
    base = base * (scale[:, None] if by_rows else scale[None, :])
    out = base.to(dtype)
    flat = out.view(-1)
    n = flat.numel()
    picks = torch.randperm(n, generator=gen)[: max(3, n // 64)]
    third = picks.numel() // 3
    flat[picks[:third]] = 0.0
    flat[picks[third:2 * third]] = -0.0
    neighbours = picks[2 * third:]
    flat[neighbours] = torch.nextafter(flat[neighbours - 1], torch.full_like(flat[neighbours], math.inf))
    return out


@dataclass(frozen=True)
class GemmSpec:
    dtype: torch.dtype
    tf32: bool = False


def _gemm(spec: GemmSpec, m: int, k: int, n: int, batch: int) -> WorkloadFn:
    def run(rec: Recorder, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed_of(f"gemm-{spec.dtype}-{spec.tf32}"))
        a = adversarial((m, k), spec.dtype, gen).to(device)
        b = adversarial((k, n), spec.dtype, gen, by_rows=False).to(device)
        bias = adversarial((1, n), spec.dtype, gen, by_rows=False).to(device)
        ab = adversarial((batch * m, k), spec.dtype, gen).to(device).view(batch, m, k)
        bb = adversarial((batch * k, n), spec.dtype, gen, by_rows=False).to(device).view(batch, k, n)
        rec.point("a", a)
        rec.point("b", b)
        with _tf32(spec.tf32), rec.compute():
            c = a @ b
            rec.point("mm", c)
            rec.point("addmm", torch.addmm(bias, a, b))
            # a second GEMM over the first one's output: its values span the products' range
            rec.point("mm_chain", c.t() @ a if m == k else c @ b.t())
            rec.point("ab", ab)
            rec.point("bb", bb)
            rec.point("bmm", torch.bmm(ab, bb))
    return run


def _sdpa(batch: int, heads: int, seq: int, dim: int, dtype: torch.dtype) -> WorkloadFn:
    def run(rec: Recorder, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed_of("sdpa"))
        # scaled so that softmax sees both peaked and flat rows
        q = (torch.randn(batch, heads, seq, dim, generator=gen) * torch.linspace(0.1, 4.0, seq)[:, None])
        k = torch.randn(batch, heads, seq, dim, generator=gen)
        v = adversarial((batch * heads * seq, dim), torch.float32, gen).view(batch, heads, seq, dim)
        v = v.clamp(-1e4, 1e4)  # bf16/fp16 attention outputs must stay finite
        q, k, v = (x.to(dtype).to(device) for x in (q, k, v))
        rec.point("q", q)
        rec.point("k", k)
        rec.point("v", v)
        with rec.compute():
            rec.point("attn", F.scaled_dot_product_attention(q, k, v))
            rec.point("attn_causal", F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return run


class TinyTransformer(nn.Module):
    """A small decoder-style language model: embedding, pre-norm attention blocks, head."""

    def __init__(self, vocab: int = 97, d_model: int = 32, heads: int = 4, layers: int = 2,
                 ff: int = 64, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = self.mask[: tokens.shape[1], : tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy, written with a one-hot mask.

    ``F.cross_entropy`` goes through NLLLoss, which has no deterministic CUDA kernel: torch raises
    under ``use_deterministic_algorithms(True)``. Log-softmax, a product and sums are deterministic
    on every backend.
    """
    logp = torch.log_softmax(logits, dim=-1)
    picked = (logp * F.one_hot(targets, logits.shape[-1]).to(logp.dtype)).sum(-1)
    return -picked.mean()


def lm_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross entropy over ``batch["tokens"]``."""
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def training_step(rec: Recorder, model: nn.Module, optimizer: torch.optim.Optimizer,
                  batch: Mapping[str, torch.Tensor], loss_fn: Callable[..., torch.Tensor],
                  watch: tuple[str, ...] = ()) -> None:
    """One step (forward, backward, optimizer step) with every tensor of interest fingerprinted.

    Order: the batch, the outputs of the ``watch`` modules as the forward computes them, the loss,
    every gradient in the order backward produces them (last parameter first), the optimizer state,
    the updated parameters.
    """
    for key in sorted(batch):
        rec.point(f"batch.{key}", batch[key])
    modules = dict(model.named_modules())
    handles = []
    for name in watch:
        if name not in modules:
            raise KeyError(f"no module {name!r} to watch (have: {', '.join(list(modules)[1:8])}...)")

        def hook(_mod: nn.Module, _inp: Any, out: Any, name: str = name) -> None:
            rec.point(f"out.{name}", out[0] if isinstance(out, tuple) else out)
        handles.append(modules[name].register_forward_hook(hook))
    params = list(model.named_parameters())
    with rec.compute():
        try:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
        finally:
            for h in handles:
                h.remove()
        rec.point("loss", loss)
        torch.autograd.backward(loss)
        for name, p in reversed(params):
            if p.grad is not None:
                rec.point(f"grad.{name}", p.grad)
        optimizer.step()
    by_param = {id(p): n for n, p in params}
    for param, state in optimizer.state.items():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                rec.point(f"optim.{by_param.get(id(param), '?')}.{key}", value)
    for name, p in params:
        rec.point(f"param.{name}", p)


def _transformer_step(batch_size: int, seq: int) -> WorkloadFn:
    def run(rec: Recorder, device: torch.device) -> None:
        seed = seed_of("transformer_step")
        torch.manual_seed(seed)  # parameter initialisation draws from the global CPU generator
        model = TinyTransformer(seq=seq)
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 97, (batch_size, seq + 1), generator=gen)
        with torch.no_grad():
            # pre-trained-looking weights: a spread of magnitudes instead of the init's narrow one
            for p in model.parameters():
                p.mul_(torch.pow(2.0, torch.randint(-3, 4, p.shape, generator=gen)).to(p.dtype))
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        with _tf32(False):
            training_step(rec, model, opt, {"tokens": tokens.to(device)}, lm_loss,
                          watch=("embed", "blocks.0", "blocks.1", "head"))
    return run


def _moe(tokens: int, d_model: int, experts: int, top_k: int, dtype: torch.dtype) -> WorkloadFn:
    def run(rec: Recorder, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed_of("moe"))
        x = torch.randn(tokens, d_model, generator=gen).to(dtype).to(device)
        gate = (torch.randn(d_model, experts, generator=gen) / math.sqrt(d_model)).to(dtype).to(device)
        w1 = (torch.randn(experts, d_model, 2 * d_model, generator=gen) / math.sqrt(d_model)).to(dtype)
        w2 = (torch.randn(experts, 2 * d_model, d_model, generator=gen) / math.sqrt(2 * d_model)).to(dtype)
        w1, w2 = w1.to(device), w2.to(device)
        rec.point("tokens", x)
        with _tf32(False), rec.compute():
            logits = x @ gate
            rec.point("gate_logits", logits)
            probs = torch.softmax(logits.float(), dim=-1)
            weights, chosen = torch.topk(probs, top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
            rec.point("topk_weights", weights)
            rec.point("topk_experts", chosen)
            flat = chosen.reshape(-1)
            # token counts per expert: integers that size the dispatch buffers below (a wrong count
            # crashed a later split in ByteDance's report); one_hot + sum has no atomics
            counts = F.one_hot(flat, experts).sum(0)
            rec.point("expert_counts", counts)
            order = torch.argsort(flat, stable=True)
            dispatched = x[order // top_k]
            rec.point("dispatched", dispatched)
            sizes = [int(c) for c in counts.tolist()]  # the host sees the counts, as real MoE code does
            outs = []
            for e, part in enumerate(torch.split(dispatched, sizes)):
                outs.append(F.gelu(part @ w1[e]) @ w2[e])
            expert_out = torch.cat(outs)
            rec.point("expert_out", expert_out)
            # gather back to (token, slot) order with the inverse permutation: no scatter-add
            slots = expert_out[torch.argsort(order)].view(tokens, top_k, d_model)
            combined = (slots.float() * weights[..., None]).sum(1)
            rec.point("combined", combined)
    return run


def builtin_workloads(device_type: str) -> dict[str, Workload]:
    """The built-in canaries, sized for the device kind (small on CPUs: they stand in for GPUs in CI)."""
    big = device_type == "cuda"
    m = 2048 if big else 48
    batch = 8 if big else 2
    out: dict[str, Workload] = {}
    for name, spec in (("gemm_fp64", GemmSpec(torch.float64)), ("gemm_fp32", GemmSpec(torch.float32)),
                       ("gemm_tf32", GemmSpec(torch.float32, tf32=True)),
                       ("gemm_bf16", GemmSpec(torch.bfloat16)), ("gemm_fp16", GemmSpec(torch.float16))):
        mm = m // 2 if spec.dtype == torch.float64 and big else m
        out[name] = Workload(name, _gemm(spec, mm, mm, mm, batch), f"m=k=n={mm},batch={batch}",
                             f"GEMM {name.removeprefix('gemm_')}: mm, addmm, chained mm, bmm")
    b, h, s, d = (8, 16, 1024, 128) if big else (1, 2, 32, 16)
    sdpa_dtype = torch.bfloat16
    out["sdpa"] = Workload("sdpa", _sdpa(b, h, s, d, sdpa_dtype), f"b={b},h={h},s={s},d={d},bf16",
                           "scaled_dot_product_attention (flash on GPUs), plain and causal")
    bs, seq = (16, 128) if big else (2, 12)
    out["transformer_step"] = Workload(
        "transformer_step", _transformer_step(bs, seq), f"batch={bs},seq={seq},d=32,layers=2",
        "2-layer transformer LM training step: forward, backward, AdamW")
    t, dm, e, k = (8192, 512, 8, 2) if big else (64, 16, 8, 2)
    out["moe_routing"] = Workload("moe_routing", _moe(t, dm, e, k, torch.float32),
                                  f"tokens={t},d={dm},experts={e},top_k={k}",
                                  "MoE step: top-k gating, token counts per expert, dispatch, experts, "
                                  "combine")
    return out


@dataclass
class WorkloadRun:
    workload: str
    params: str
    points: list[Point]
    error: str | None = None
    seconds: float = 0.0
    flips: list[dict[str, Any]] = field(default_factory=list)

    def signature(self) -> tuple[Any, ...]:
        return (tuple((p.name, p.dtype, p.shape, p.fp) for p in self.points), self.error)


def run_workload(workload: Workload, device: torch.device, injector: FaultInjector | None = None,
                 keep: bool = False) -> tuple[WorkloadRun, dict[str, torch.Tensor]]:
    """One run of one workload in this process (``deterministic()`` must have run)."""
    rec = Recorder(keep=keep, harness=injector)
    if injector is not None:
        injector.reset()
        injector.progress = lambda: len(rec)
    error = None
    start = time.perf_counter()
    try:
        workload.run(rec, device)
    except Exception as exc:  # a corrupted value may crash the workload: that is a result too
        error = f"{type(exc).__name__}: {exc}"[:500]
    points: list[Point] = []
    try:
        points = rec.points()
    except Exception as exc:  # the device itself failed (e.g. CUDA error): report the first error
        error = error or f"{type(exc).__name__}: {exc}"[:500]
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    flips = []
    if injector is not None:
        names = [p.name for p in points]
        for f in injector.flips:
            flips.append({"op": f.op, "call": f.call, "element": f.element, "bit": f.bit,
                          "next_point": names[f.before_point] if f.before_point < len(names) else None})
    return (WorkloadRun(workload.name, workload.params, points, error, seconds, flips), rec.tensors)


WORKLOAD_NAMES = ("gemm_fp64", "gemm_fp32", "gemm_tf32", "gemm_bf16", "gemm_fp16", "sdpa",
                  "transformer_step", "moe_routing")
