"""Fault-injection harness: make one worker ("GPU") flip bits in the outputs of the ops it runs.

It models a marginal arithmetic unit as the SDC literature describes it: wrong bits only on one
dtype path, only for some values, at some rate per kernel call. Workload code is not touched: the
harness is a ``TorchDispatchMode`` wrapped around the workload, so it sees every ATen kernel the
workload runs (forward, the autograd backward kernels, optimizer kernels), which a
``TorchFunctionMode`` or module hooks do not (backward kernels run below the Python API). After a
matching kernel returns, the harness flips one random bit of one random element of its output.

Spec (``--inject``), comma-separated ``key=value``:

- ``worker=N`` (required): the worker made faulty;
- ``dtype=float32``: only outputs of this dtype (one dtype path);
- ``rate=1.0``: probability of a flip per matching kernel call;
- ``range=LO:HI``: only elements whose value lies in [LO, HI] (``-inf``/``inf`` allowed; NaN never
  matches a range);
- ``bits=LO:HI``: flip a bit in this inclusive range (default: any bit of the element);
- ``ops=mm|addmm``: only these ATen ops (overload packet names; default: every op but views, copies
  and allocations);
- ``seed=N``: the harness's own random stream (the workload's generators are left alone);
- ``max_flips=N``: stop after N flips in one workload run.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
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

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8)}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultSpecError(ValueError):
    """A bad ``--inject`` spec; names the key."""


@dataclass(frozen=True)
class FaultSpec:
    worker: int
    dtype: str = "float32"
    rate: float = 1.0
    low: float = -math.inf
    high: float = math.inf
    bits: tuple[int, int] | None = None
    ops: tuple[str, ...] = ()
    seed: int = 0
    max_flips: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise FaultSpecError(f"dtype: {self.dtype!r} is not one of {', '.join(_DTYPES)}")
        if not 0.0 <= self.rate <= 1.0:
            raise FaultSpecError(f"rate: {self.rate} is not a probability in [0, 1]")
        if self.low > self.high:
            raise FaultSpecError(f"range: {self.low}:{self.high} is empty")
        width = _DTYPES[self.dtype].itemsize * 8
        if self.bits is not None and not 0 <= self.bits[0] <= self.bits[1] < width:
            raise FaultSpecError(f"bits: {self.bits[0]}:{self.bits[1]} is outside 0:{width - 1}")
        if self.worker < 0:
            raise FaultSpecError("worker: must be >= 0")

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
                    kwargs["dtype"] = value.removeprefix("torch.")
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
                else:
                    raise FaultSpecError(f"unknown key {key!r} (known: worker, dtype, rate, range, bits, "
                                         "ops, seed, max_flips)")
            except ValueError as exc:
                if isinstance(exc, FaultSpecError):
                    raise
                raise FaultSpecError(f"{key}: bad value {value!r}") from None
        if "worker" not in kwargs:
            raise FaultSpecError("worker: required (the worker to make faulty)")
        return cls(**kwargs)


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
        self._rng = random.Random(spec.seed * 1_000_003 + spec.worker)
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
        out = func(*args, **(kwargs or {}))
        if self._quiet or getattr(func, "is_view", False):
            return out
        op = func.overloadpacket.__name__
        if self.spec.ops:
            if op not in self.spec.ops:
                return out
        elif op in _NOT_COMPUTE:
            return out
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, torch.Tensor) and t.dtype == self.spec.torch_dtype and t.numel()]
        if not tensors:
            return out
        self.calls += 1
        if self.spec.max_flips is not None and len(self.flips) >= self.spec.max_flips:
            return out
        if self._rng.random() >= self.spec.rate:
            return out
        self._flip(self._rng.choice(tensors), op)
        return out

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
