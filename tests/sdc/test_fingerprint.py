"""Fingerprints: equal bits give equal fingerprints, one or two changed elements always change them.

Tensors are built from raw bit patterns (integers reinterpreted as the float dtype), so every
pattern is reachable: NaNs with any payload, both zeros, subnormals, infinities. The chunked,
on-device computation is checked against a plain Python reading of the definition.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpumon.sdc import fingerprint as fp_mod
from gpumon.sdc.fingerprint import Fingerprint, fingerprint, fingerprint_many, fingerprint_tensor, words

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}
M64 = (1 << 64) - 1


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # small chunks so that a few thousand elements cross chunk, row and tail boundaries
    monkeypatch.setattr(fp_mod, "_CHUNK_CPU_BYTES", 3 * fp_mod._ROW * 8)
    yield


def reference(t: torch.Tensor) -> Fingerprint:
    """The definition, element by element, in Python integers."""
    flat, bits = words(t)
    values = [v & ((1 << bits) - 1) for v in flat.tolist()]

    def m(u: int) -> int:
        if bits != 64:
            return u
        # splitmix64's finalizer (Steele, Lea, Flood, OOPSLA 2014), in Python integers
        u ^= u >> 30
        u = (u * 0xBF58476D1CE4E5B9) & M64
        u ^= u >> 27
        u = (u * 0x94D049BB133111EB) & M64
        return u ^ (u >> 31)

    return Fingerprint(sum(values) & M64, sum((i + 1) * m(u) for i, u in enumerate(values)) & M64)


def from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    width = torch.empty((), dtype=dtype).element_size() * 8
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=INT_OF[dtype]).view(dtype)


def random_bits(n: int, dtype: torch.dtype, seed: int) -> list[int]:
    width = torch.empty((), dtype=dtype).element_size() * 8
    gen = torch.Generator().manual_seed(seed)
    # two 32-bit halves: randint cannot draw a full 64-bit range
    lo = torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.int64).tolist()
    hi = torch.randint(0, 1 << 32, (n,), generator=gen, dtype=torch.int64).tolist()
    return [((h << 32) | lo_) & ((1 << width) - 1) for lo_, h in zip(lo, hi, strict=True)]


dtypes = st.sampled_from(FLOATS)
Case = tuple[torch.dtype, list[int], list[int]]


@st.composite
def tensor_and_changes(draw: st.DrawFn, changes: int) -> Case:
    dtype = draw(dtypes)
    width = torch.empty((), dtype=dtype).element_size() * 8
    n = draw(st.integers(min_value=changes, max_value=7000))
    base = random_bits(n, dtype, draw(st.integers(0, 2**31)))
    positions = draw(st.lists(st.integers(0, n - 1), min_size=changes, max_size=changes, unique=True))
    changed = list(base)
    for p in positions:
        # any other bit pattern: one flipped bit, the sign, a NaN payload, -0.0, or anything at all
        new = draw(st.one_of(
            st.integers(0, width - 1).map(lambda b, old=base[p]: old ^ (1 << b)),
            st.integers(0, (1 << width) - 1),
            st.sampled_from(_specials(dtype)),
        ))
        if new == base[p]:
            new = base[p] ^ 1
        changed[p] = new
    return dtype, base, changed


def _specials(dtype: torch.dtype) -> list[int]:
    """Bit patterns of +0, -0, +inf, a quiet NaN, NaNs with other payloads, the smallest subnormal."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    exp_bits = {16: 5, 32: 8, 64: 11}[width] if dtype != torch.bfloat16 else 8
    mant = width - 1 - exp_bits
    exp_all = ((1 << exp_bits) - 1) << mant
    sign = 1 << (width - 1)
    return [0, sign, exp_all, exp_all | (1 << (mant - 1)), exp_all | 1, sign | exp_all | 3, 1]


@settings(max_examples=150)
@given(tensor_and_changes(changes=1))
def test_any_single_changed_element_changes_the_fingerprint(case: Case) -> None:
    dtype, base, changed = case
    a, b = from_bits(base, dtype), from_bits(changed, dtype)
    assert fingerprint(a) != fingerprint(b)


@settings(max_examples=150)
@given(tensor_and_changes(changes=2))
def test_any_two_changed_elements_change_the_fingerprint(case: Case) -> None:
    dtype, base, changed = case
    a, b = from_bits(base, dtype), from_bits(changed, dtype)
    assert fingerprint(a) != fingerprint(b)


@st.composite
def compensating_pair(draw: st.DrawFn, dtype: torch.dtype) -> Case:
    """Two elements changed by +d and -d (mod 2^width): the plain sum cannot see it, the weighted
    sum must. d: the top bits (sign, exponent: the hardest case for 64-bit words), one bit, or
    anything."""
    width = torch.empty((), dtype=dtype).element_size() * 8
    n = draw(st.integers(2, 7000))
    base = random_bits(n, dtype, draw(st.integers(0, 2**31)))
    i, j = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    d = draw(st.one_of(st.sampled_from([width - 1, width - 2, width - 3]).map(lambda b: 1 << b),
                       st.integers(0, width - 1).map(lambda b: 1 << b),
                       st.integers(1, (1 << width) - 1)))
    changed = list(base)
    changed[i] = (base[i] + d) % (1 << width)
    changed[j] = (base[j] - d) % (1 << width)
    return dtype, base, changed


@pytest.mark.parametrize("dtype", FLOATS)
@settings(max_examples=100)
@given(data=st.data())
def test_two_changes_that_cancel_in_the_plain_sum_change_the_fingerprint(dtype: torch.dtype,
                                                                         data: st.DataObject) -> None:
    _, base, changed = data.draw(compensating_pair(dtype))
    assert fingerprint(from_bits(base, dtype)) != fingerprint(from_bits(changed, dtype))


@settings(max_examples=60)
@given(dtypes, st.integers(0, 7000), st.integers(0, 2**31))
def test_matches_the_definition(dtype: torch.dtype, n: int, seed: int) -> None:
    t = from_bits(random_bits(n, dtype, seed), dtype)
    assert fingerprint(t) == reference(t)


@settings(max_examples=40)
@given(dtypes, st.integers(1, 60), st.integers(1, 60), st.integers(0, 2**31))
def test_equal_bits_equal_fingerprint_whatever_the_layout(dtype: torch.dtype, rows: int, cols: int,
                                                         seed: int) -> None:
    t = from_bits(random_bits(rows * cols, dtype, seed), dtype).view(rows, cols)
    # a transposed view (non-contiguous) and its contiguous copy hold the same logical elements
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())
    assert fingerprint(t) == fingerprint(t.clone())


@pytest.mark.parametrize("dtype", FLOATS)
def test_negative_zero_differs_from_positive_zero(dtype: torch.dtype) -> None:
    pos = torch.zeros(5, dtype=dtype)
    neg = pos.clone()
    neg[3] = -0.0
    assert torch.equal(pos, neg)  # equal as numbers ...
    assert fingerprint(pos) != fingerprint(neg)  # ... not as bits


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_payloads_are_told_apart_and_kept(dtype: torch.dtype) -> None:
    specials = _specials(dtype)
    quiet, other, negative = specials[3], specials[4], specials[5]
    a, b, c = (from_bits([7, p, 9], dtype) for p in (quiet, other, negative))
    assert all(torch.isnan(x[1]) for x in (a, b, c))
    fps = {fingerprint(a), fingerprint(b), fingerprint(c)}
    assert len(fps) == 3
    # the sums read the payload bits exactly as stored
    assert fingerprint(b) == reference(b)


def test_fp64_sign_swap_that_defeats_plain_weighted_sums_is_caught() -> None:
    """[+0, x, -0] -> [-0, x, +0]: words change by +2^63 and -2^63.

    With the literal weighted sum over 64-bit words both sums stay equal (the weighted one changes
    by (1 - 3) * 2^63 = -2^64); the splitmix64 mix of 64-bit words in the weighted term catches it.
    """
    a = torch.tensor([0.0, 1.5, -0.0], dtype=torch.float64)
    b = torch.tensor([-0.0, 1.5, 0.0], dtype=torch.float64)
    ua = [v & M64 for v in words(a)[0].tolist()]
    ub = [v & M64 for v in words(b)[0].tolist()]
    assert sum(ua) & M64 == sum(ub) & M64
    literal = [sum((i + 1) * u for i, u in enumerate(w)) & M64 for w in (ua, ub)]
    assert literal[0] == literal[1]
    assert fingerprint(a) != fingerprint(b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_other_dtypes(dtype: torch.dtype) -> None:
    t = (torch.arange(3000) % 7 == 0) if dtype == torch.bool else (torch.arange(3000) * 37 % 251).to(dtype)
    assert fingerprint(t) == reference(t)
    u = t.clone()
    u[1234] = (not bool(u[1234])) if dtype == torch.bool else u[1234] + 1
    assert fingerprint(t) != fingerprint(u)


def test_empty_tensor() -> None:
    assert fingerprint(torch.empty(0)) == Fingerprint(0, 0)


def test_hex_round_trip() -> None:
    fp = fingerprint(torch.arange(10, dtype=torch.float32))
    assert Fingerprint.from_hex(fp.hex()) == fp
    assert fingerprint_many([fingerprint_tensor(torch.arange(10, dtype=torch.float32))]) == [fp]


class _DeviceLog(TorchDispatchMode):
    """Records the device of every tensor every ATen op reads or writes."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.devices: set[str] = set()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket.__name__)
        for leaf in tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor):
                self.devices.add(leaf.device.type)
        return out


@pytest.mark.parametrize("dtype", FLOATS)
def test_computed_on_the_tensors_device_without_a_host_copy(dtype: torch.dtype) -> None:
    """How "no copy to the host" is shown without a GPU: the fingerprint of a tensor on the ``meta``
    device (a device with no data, standing in for any non-host device) is computed by ATen ops
    every one of whose inputs and outputs is on ``meta``: not one op touches a CPU tensor, so no
    element is ever copied to the host. The result is itself a device tensor; on a real device only
    its 16 bytes are read back (``fingerprint`` / ``fingerprint_many``)."""
    t = torch.empty(5 * fp_mod._ROW + 17, dtype=dtype, device="meta")
    log = _DeviceLog()
    with log:
        result = fingerprint_tensor(t)
    assert result.device.type == "meta" and result.shape == (2,)
    assert log.devices == {"meta"}, log.devices
    assert "sum" in log.ops
