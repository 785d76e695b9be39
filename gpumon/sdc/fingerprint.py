"""Bit fingerprints of tensors, computed on the tensor's own device.

A fingerprint is two sums modulo 2^64 over the tensor's raw bit patterns, each
element read as an unsigned integer of its own width (8, 16, 32 or 64 bits),
in row-major logical order (the order of ``tensor.flatten()``, whatever the
strides):

- ``plain    = sum(u[i])``
- ``weighted = sum((i + 1) * m(u[i]))``

where ``m`` is the identity for elements of up to 32 bits. Equal bits give
equal fingerprints; different bits give different ones with high probability,
and always when one element changed. For elements of up to 32 bits, also always
when two elements changed, in a tensor of fewer than 2^33 elements: the sums stay
equal only if ``d1 = -d2`` and ``(i - j) * d1 = 0 mod 2^64``, which needs
``|i - j| >= 2^33`` because ``0 < |d1| < 2^32``.

Why ``m`` is not the identity for 64-bit elements: with 64-bit words the
literal scheme has blind spots that real data hits. Swapping +0.0 and -0.0
between positions 0 and 2 of an fp64 tensor changes the words by +2^63 and
-2^63: the plain sum is unchanged and the weighted one changes by
``(1 - 3) * 2^63 = -2^64 = 0 mod 2^64``. No pair of sums linear in 64-bit
words avoids this (every two positions would need weights whose difference is
odd, which at most two positions can have). An earlier fold,
``u XOR (u >> 32)``, closed that case but stayed nearly linear for small
changes: a property test found words at positions 0 and 2 changed by +2 and -2
whose folded differences were 6 and -2 (``1*6 + 3*(-2) = 0``); about 1 % of
small compensating changes at nearby positions collided. So for 64-bit elements
``m`` is splitmix64's finalizer (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014): a bijection whose output
differences behave like random 64-bit numbers, so a change that leaves the
plain sum equal also leaves the weighted sum equal only with probability about
2^-64, whatever its size or position. Golden files recorded with the fold are
refused (format ``gpumon-sdc-golden/1``): record them again.

How the sums stay on the device: the tensor is reinterpreted with
``Tensor.view(int dtype)`` (no copy), widened chunk by chunk on its own device
(torch has no uint64 arithmetic on every backend; int64 addition and
multiplication wrap modulo 2^64 exactly like uint64), and reduced there. The
only data that leaves the device is the final pair of int64 sums (16 bytes), and
``fingerprint_many`` brings the pairs of a whole workload over in one transfer.
A chunk is reduced as a (rows, 1024) matrix: with row sums R and column sums C,
``sum(w * y) = offset * sum(y) + 1024 * sum(r * R[r]) + sum((k + 1) * C[k])``,
two reductions instead of a multiply by a weight vector and a third pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Chunk sizes: on a CPU a chunk's widened buffer (4 MiB: 2^20 int32 or 2^19 int64
# words; measured best of 2^16..2^20 on an EPYC, bench/sdc_fingerprint.py) should
# stay in the cache while it is reduced twice; on a GPU a chunk (in elements) must
# be large enough that kernel launches (~5 us each) do not dominate.
_CHUNK_CPU_BYTES = 4 << 20
_CHUNK_GPU = 1 << 24
# A chunk is reduced as a (rows, _ROW) matrix: row sums and column sums give both
# sums in two cheap reductions (an int64 dot product is 5x slower on CPUs and
# integer matmul does not exist on GPUs).
_ROW = 1024

# splitmix64's finalizer constants, as the signed int64 torch multiplies with (wrapping mod 2^64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift_xor(y: torch.Tensor, k: int, tmp: torch.Tensor) -> None:
    """y ^= y >>> k (a logical shift: torch's right shift of int64 is arithmetic)."""
    torch.bitwise_right_shift(y, k, out=tmp)
    tmp.bitwise_and_((1 << (64 - k)) - 1)
    y.bitwise_xor_(tmp)


def _mix64(x: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of every word of ``x``, into ``out`` (see the module docstring)."""
    out.copy_(x)
    _shift_xor(out, 30, tmp)
    out.mul_(_MIX1)
    _shift_xor(out, 27, tmp)
    out.mul_(_MIX2)
    _shift_xor(out, 31, tmp)
    return out

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Unsigned views: widening them gives the unsigned value in one pass. Not every
# backend can copy from them, hence the masked fallback in _widen.
_UINT_VIEW = {2: torch.uint16, 4: torch.uint32}

_arange_cache: dict[tuple[str, int, int], torch.Tensor] = {}


@dataclass(frozen=True, order=True)
class Fingerprint:
    """The two sums, as unsigned 64-bit integers."""

    plain: int
    weighted: int

    def hex(self) -> str:
        return f"{self.plain:016x}:{self.weighted:016x}"

    @classmethod
    def from_hex(cls, text: str) -> Fingerprint:
        plain, _, weighted = text.partition(":")
        if not weighted:
            raise ValueError(f"not a fingerprint: {text!r} (want PLAIN:WEIGHTED in hex)")
        return cls(int(plain, 16), int(weighted, 16))

    def __str__(self) -> str:
        return self.hex()


def words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's elements as signed integers of their own width, flat, and the width in bits.

    A view wherever the layout allows (``Tensor.view(dtype)`` keeps every bit, NaN payloads and
    -0.0 included); a non-contiguous tensor is made contiguous as integers, on its device.
    """
    if t.is_sparse or t.is_quantized:
        raise TypeError(f"cannot fingerprint a {t.layout} / quantized tensor")
    if t.is_complex():
        t = torch.view_as_real(t)  # (real, imag) pairs: two words per element
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    size = t.element_size()
    if size not in _INT_VIEW:
        raise TypeError(f"cannot fingerprint dtype {t.dtype} ({size}-byte elements)")
    as_int = t if t.dtype == _INT_VIEW[size] else t.view(_INT_VIEW[size])
    return as_int.reshape(-1), size * 8


def _arange(device: torch.device, start: int, n: int) -> torch.Tensor:
    key = (str(device), start, n)
    cached = _arange_cache.get(key)
    if cached is None:
        cached = torch.arange(start, start + n, dtype=torch.int64, device=device)
        _arange_cache[key] = cached
    return cached


_unsigned_copy_ok: dict[tuple[str, int], bool] = {}


def _widen(part: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """``part`` (signed ints of ``bits``) as their unsigned values, written into ``out`` (wider)."""
    if bits == 8:
        return out.copy_(part)  # uint8 already
    key = (part.device.type, bits)
    if _unsigned_copy_ok.get(key, True):
        try:
            out.copy_(part.view(_UINT_VIEW[bits // 8]))
            _unsigned_copy_ok[key] = True
            return out
        except (RuntimeError, NotImplementedError):
            _unsigned_copy_ok[key] = False
    out.copy_(part)  # sign-extended ...
    return out.bitwise_and_((1 << bits) - 1)  # ... back to the unsigned value


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.dot(a, b) if a.device.type == "cpu" else (a * b).sum()


def fingerprint_tensor(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint as a 2-element int64 tensor on ``t``'s device (plain, weighted), no host sync."""
    flat, bits = words(t.detach())
    device = flat.device
    n = flat.numel()
    plain = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    if n == 0:
        return torch.stack((plain, weighted))
    # Words of up to 16 bits are summed in int32, which halves the memory traffic: a row sum is
    # at most 1024 * 65535 < 2^27 and a column sum at most (2^24 / 1024) * 65535 < 2^31.
    acc = torch.int32 if bits <= 16 else torch.int64
    per_chunk = _CHUNK_CPU_BYTES // acc.itemsize if device.type == "cpu" else _CHUNK_GPU
    chunk = min(n, per_chunk)
    buf = torch.empty(chunk, dtype=acc, device=device)
    tmp = torch.empty(chunk, dtype=torch.int64, device=device) if bits == 64 else buf
    row_index = _arange(device, 0, max(chunk // _ROW, 1))
    col_weight = _arange(device, 1, _ROW)
    for start in range(0, n, chunk):
        part = flat[start:start + chunk]
        size = part.numel()
        if bits < 64:
            x = y = _widen(part, bits, buf[:size])
        else:
            x = part
            y = _mix64(x, buf[:size], tmp[:size])
        full = size - size % _ROW
        if full:
            rows = y[:full].view(-1, _ROW)
            row_sums = rows.sum(1, dtype=acc).to(torch.int64)
            col_sums = rows.sum(0, dtype=acc).to(torch.int64)
            # element (r, k) of the chunk sits at position start + r * _ROW + k
            chunk_y = row_sums.sum()
            weighted += _dot(row_sums, row_index[:row_sums.numel()]) * _ROW
            weighted += _dot(col_sums, col_weight)
            if start:
                weighted += chunk_y * start
            plain += chunk_y if bits < 64 else x[:full].sum()
        if full < size:
            tail_y = y[full:].to(torch.int64)
            tail_sum = tail_y.sum()
            weighted += _dot(tail_y, col_weight[:size - full]) + tail_sum * (start + full)
            plain += tail_sum if bits < 64 else x[full:].sum()
    return torch.stack((plain, weighted))


def _unsigned(value: int) -> int:
    return value & 0xFFFFFFFFFFFFFFFF


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """The fingerprint of one tensor (one 16-byte transfer to the host)."""
    plain, weighted = fingerprint_tensor(t).tolist()
    return Fingerprint(_unsigned(plain), _unsigned(weighted))


def fingerprint_many(pairs: Sequence[torch.Tensor]) -> list[Fingerprint]:
    """Fingerprints from ``fingerprint_tensor`` results on one device, in one transfer."""
    if not pairs:
        return []
    rows = torch.stack(list(pairs)).tolist()
    return [Fingerprint(_unsigned(p), _unsigned(w)) for p, w in rows]
