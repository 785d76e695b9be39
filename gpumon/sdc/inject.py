"""Fault-injection harness: make one worker ("GPU") flip bits in the outputs of the ops it runs.

It models a marginal arithmetic unit as the SDC literature describes it: wrong bits only on one
dtype path, only for some values, at some rate per kernel call. Workload code is not touched: the
harness is a ``TorchDispatchMode`` wrapped around the workload, so it sees every ATen kernel the
workload runs (forward, the autograd backward kernels, optimizer kernels), which a
``TorchFunctionMode`` or module hooks do not (backward kernels run below the Python API). After a
matching kernel returns, the harness flips one random bit of one random element of its output.

Spec (``--inject``), comma-separated ``key=value``:

- ``worker=N`` (required): the worker made faulty;
- ``dtype=fp32``: only outputs of this dtype (one dtype path): ``fp64``, ``fp32``, ``bf16``,
  ``fp16`` (the names in the workloads' names, gemm_fp32 ...) or an integer type (``int64`` ...
  ``uint8``); torch's names (``float32``, ``torch.bfloat16``, ``half``) mean the same. TF32 is not a
  dtype: a TF32 matmul outputs fp32;
- ``rate=1.0``: probability of a flip per matching kernel call;
- ``range=LO:HI``: only elements whose value lies in [LO, HI] (``-inf``/``inf`` allowed; NaN never
  matches a range);
- ``bits=LO:HI``: flip a bit in this inclusive range (default: any bit of the element);
- ``ops=mm|addmm``: only these ATen ops (overload packet names; default: every op but views, copies
  and allocations);
- ``seed=N``: the harness's own random stream (the workload's generators are left alone);
- ``stream=N``: which of the seed's streams (default: the worker's number, so that two faulty
  workers do not flip the same bits); ``canary replay --with-injection`` sets it to the captured
  worker's number, so that the replay's worker flips as that worker did;
- ``max_flips=N``: stop after N flips in one workload run;
- ``where=output`` (default): flip a bit of what a kernel computed; ``where=input``: flip a bit of a
  tensor the op is handed, before it runs: what a rank *sends* (its contribution to a collective, a
  send), the fault of a GPU, NIC or PCIe path that corrupts outgoing data. With ``ops=`` naming
  torch.distributed's ops (``allreduce_``, ``_allgather_base_``, ``alltoall_base_``, ``send``, ...)
  this is the fabric probe's corrupted-contribution fault.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that move or allocate data rather than compute it: a fault there is a copy-engine or
# allocator fault, not the arithmetic fault this harness models.
_NOT_COMPUTE = frozenset({
    "_to_copy", "copy_", "clone", "detach", "alias", "lift_fresh", "lift_fresh_copy", "empty",
    "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "zero_", "fill_",
    "_local_scalar_dense", "set_", "resize_", "arange", "scalar_tensor", "_unsafe_view",
})

# One vocabulary: the short names the workloads are named with (gemm_fp32, gemm_bf16, ...), the
# canonical spelling; torch's names ("float32", "torch.float32", torch aliases such as "half") are
# accepted for them. No "tf32": TF32 is a matmul mode, not a tensor dtype (a TF32 matmul's output is
# float32), so a tf32 fault is dtype=fp32 (with ops=mm|addmm|bmm for the matmuls alone).
_DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8,
}
_SHORT = {d: name for name, d in _DTYPES.items()}
_TORCH_NAMES = {str(d).removeprefix("torch."): d for d in _DTYPES.values()}

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultSpecError(ValueError):
    """A bad ``--inject`` spec; names the key."""


def dtype_name(text: str) -> str:
    """The canonical (short) name of a dtype given by its short or its torch name; raises
    FaultSpecError listing what is accepted."""
    name = text.strip().lower().removeprefix("torch.")
    if name in _DTYPES:
        return name
    found = getattr(torch, name, None) if name.isidentifier() else None
    if isinstance(found, torch.dtype) and found in _SHORT:
        return _SHORT[found]  # float32, bfloat16, and torch's aliases (float, double, half, long, ...)
    if name == "tf32":
        raise FaultSpecError("dtype: 'tf32' is not a tensor dtype: a TF32 matmul computes float32 "
                             "tensors, so its faults are dtype=fp32 (add ops=mm|addmm|bmm for the "
                             "matmuls alone)")
    raise FaultSpecError(f"dtype: {text!r} is not one of {', '.join(_DTYPES)} (torch's names are "
                         f"accepted too: {', '.join(_TORCH_NAMES)})")


@dataclass(frozen=True)
class FaultSpec:
    worker: int
    dtype: str = "fp32"  # canonical short name; a torch name given here is turned into it
    rate: float = 1.0
    low: float = -math.inf
    high: float = math.inf
    bits: tuple[int, int] | None = None
    ops: tuple[str, ...] = ()
    seed: int = 0
    max_flips: int | None = None
    where: str = "output"
    stream: int | None = None  # None: the worker's number

    @property
    def random_stream(self) -> int:
        return self.worker if self.stream is None else self.stream

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(str(self.dtype)))
        if self.where not in ("output", "input"):
            raise FaultSpecError(f"where: {self.where!r} is not one of output, input")
        if not 0.0 <= self.rate <= 1.0:
            raise FaultSpecError(f"rate: {self.rate} is not a probability in [0, 1]")
        if self.low > self.high:
            raise FaultSpecError(f"range: {self.low}:{self.high} is empty")
        width = _DTYPES[self.dtype].itemsize * 8
        if self.bits is not None and not 0 <= self.bits[0] <= self.bits[1] < width:
            raise FaultSpecError(f"bits: {self.bits[0]}:{self.bits[1]} is outside 0:{width - 1}")
        if self.worker < 0:
            raise FaultSpecError("worker: must be >= 0")
        if self.stream is not None and self.stream < 0:
            raise FaultSpecError("stream: must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_text(self) -> str:
        parts = [f"worker={self.worker}", f"dtype={self.dtype}", f"rate={self.rate:g}",
                 f"range={self.low:g}:{self.high:g}", f"seed={self.seed}"]
        if self.bits is not None:
            parts.append(f"bits={self.bits[0]}:{self.bits[1]}")
        if self.ops:
            parts.append("ops=" + "|".join(self.ops))
        if self.max_flips is not None:
            parts.append(f"max_flips={self.max_flips}")
        if self.where != "output":
            parts.append(f"where={self.where}")
        if self.stream is not None:
            parts.append(f"stream={self.stream}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        kwargs: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise FaultSpecError(f"{item!r}: want key=value")
            try:
                if key == "worker":
                    kwargs["worker"] = int(value)
                elif key == "dtype":
                    kwargs["dtype"] = dtype_name(value)
                elif key == "rate":
                    kwargs["rate"] = float(value)
                elif key == "range":
                    lo, _, hi = value.partition(":")
                    kwargs["low"], kwargs["high"] = float(lo), float(hi)
                elif key == "bits":
                    lo, _, hi = value.partition(":")
                    kwargs["bits"] = (int(lo), int(hi or lo))
                elif key == "ops":
                    kwargs["ops"] = tuple(o for o in value.split("|") if o)
                elif key == "seed":
                    kwargs["seed"] = int(value)
                elif key == "max_flips":
                    kwargs["max_flips"] = int(value)
                elif key == "where":
                    kwargs["where"] = value
                elif key == "stream":
                    kwargs["stream"] = int(value)
                else:
                    raise FaultSpecError(f"unknown key {key!r} (known: worker, dtype, rate, range, bits, "
                                         "ops, seed, max_flips, where, stream)")
            except ValueError as exc:
                if isinstance(exc, FaultSpecError):
                    raise
                raise FaultSpecError(f"{key}: bad value {value!r}") from None
        if "worker" not in kwargs:
            raise FaultSpecError("worker: required (the worker to make faulty)")
        return cls(**kwargs)


def stand_in_fault(sdc_of: Mapping[int, str], gpus: Sequence[int]) -> FaultSpec | None:
    """The harness spec for the worker of the first of ``gpus`` (in worker order) whose stand-in
    computes wrong bits: ``sdc_of`` maps a GPU index to its spec without the worker
    ("dtype=float32,rate=1", ``StandIn.sdc``); None if none."""
    for worker, index in enumerate(gpus):
        spec = sdc_of.get(index, "")
        if spec:
            return FaultSpec.parse(f"worker={worker},{spec}")
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (lists of tensors, as collectives take, included)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


@dataclass
class Flip:
    """One injected fault, for the record (tests and the detection benchmark use it as truth)."""

    op: str
    call: int
    element: int
    bit: int
    before_point: int
    point_name: str | None = None


class FaultInjector(TorchDispatchMode):
    """The harness for one worker. Enter it around device computation (``Recorder.compute()``)."""

    def __init__(self, spec: FaultSpec) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.spec = spec
        self.flips: list[Flip] = []
        self.calls = 0
        # how many points the workload has recorded: dates each flip against the recording order
        self.progress: Callable[[], int] = lambda: 0
        self._rng = random.Random(spec.seed * 1_000_003 + spec.random_stream)
        self._quiet = 0

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No injection inside (fingerprinting must sum the workload's bits, not add its own faults)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def reset(self) -> None:
        self.flips = []
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.spec.where == "input":
            self._maybe_flip(func, _tensors(args))
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self._maybe_flip(func, _tensors(out))
        return out

    def _maybe_flip(self, func: Any, candidates: list[torch.Tensor]) -> None:
        if self._quiet or getattr(func, "is_view", False):
            return
        op = func.overloadpacket.__name__
        if self.spec.ops:
            if op not in self.spec.ops:
                return
        elif op in _NOT_COMPUTE:
            return
        tensors = [t for t in candidates if t.dtype == self.spec.torch_dtype and t.numel()]
        if not tensors:
            return
        self.calls += 1
        if self.spec.max_flips is not None and len(self.flips) >= self.spec.max_flips:
            return
        if self._rng.random() >= self.spec.rate:
            return
        self._flip(self._rng.choice(tensors), op)

    def _flip(self, t: torch.Tensor, op: str) -> None:
        with torch.no_grad():
            values = t.detach()
            if values.is_floating_point():
                eligible = (values >= self.spec.low) & (values <= self.spec.high)
            else:
                eligible = (values.double() >= self.spec.low) & (values.double() <= self.spec.high)
            where = eligible.reshape(-1).nonzero().reshape(-1)
            count = where.numel()
            if count == 0:
                return
            element = int(where[self._rng.randrange(count)])
            width = t.element_size() * 8
            lo, hi = self.spec.bits if self.spec.bits is not None else (0, width - 1)
            bit = self._rng.randint(lo, hi)
            # the top bit of a signed view is negative: -(2^(w-1)) has exactly that bit set
            mask = -(1 << bit) if bit == width - 1 else 1 << bit
            ints = values.view(_INT_OF_SIZE[t.element_size()])
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(element), t.shape))
            ints[index] = ints[index] ^ mask
            self.flips.append(Flip(op=op, call=self.calls, element=element, bit=bit,
                                   before_point=self.progress()))
