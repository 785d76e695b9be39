"""Benchmark: kernel-log parsing throughput (gpumon.hw.kmsg_parse + gpumon.hw.nvrm). Not a test.

Measures lines/s of ``parse_line`` alone and of ``parse_line`` + ``NvrmParser.feed``:

1. on the largest real capture in tests/data/kmsg-xid (a healthy 8-GPU boot
   log: almost no NVRM lines, so this is the prefilter's case), repeated until
   at least ``--min-seconds`` of work, and on the Xid 13 storm capture (every
   line an Xid: the regex path's worst case);
2. on a synthetic log of ``--lines`` lines (default 1M) written to a temp dir:
   kernel noise taken from the real boot capture, with ~1% NVRM lines in the
   formats of the real captures (modern pid/name, legacy, pid-only, NVLink5
   144-150, Xid 154/45/74/79, SXid, identity and fallen-off-the-bus blocks).
   It is written as raw /dev/kmsg records (what the daemon reads) and, for the
   wrapper comparison, re-wrapped in other formats. The file is also read end
   to end through ``KernelLogFollower`` (read, decode, split, parse).

Usage: .venv/bin/python bench/kmsg_parse.py [--lines N] [--min-seconds S] [--seed N]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpumon.hw.kmsg_follow import KernelLogFollower  # noqa: E402
from gpumon.hw.kmsg_parse import parse_line  # noqa: E402
from gpumon.hw.nvrm import NvrmParser, SXidEvent, XidEvent  # noqa: E402

DATA = REPO / "tests" / "data" / "kmsg-xid"


def machine() -> str:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    return (
        f"CPU: {cpu}; cores: {os.cpu_count()} ({usable} usable); "
        f"Python {platform.python_version()} ({platform.python_implementation()}); "
        f"{platform.system()} {platform.release()}"
    )


def rate(lines: Sequence[str], min_seconds: float, with_nvrm: bool) -> tuple[float, int, float, int]:
    """Parse ``lines`` repeatedly for at least ``min_seconds``: (lines/s, lines, seconds, events)."""
    done = 0
    events = 0
    gc.collect()
    start = time.perf_counter()
    while True:
        if with_nvrm:
            parser = NvrmParser()
            feed = parser.feed
            for line in lines:
                events += len(feed(parse_line(line)))
            events += len(parser.flush())
        else:
            for line in lines:
                parse_line(line)
        done += len(lines)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done / elapsed, done, elapsed, events


# -- synthetic log ----------------------------------------------------------------


def _noise_messages() -> list[str]:
    """Messages (wrapper stripped) of the real healthy boot log, minus NVIDIA lines."""
    out = []
    text = (DATA / "dmesg-decode-iso_boot_8gpu_nvswitch_550.90.07.log").read_text(encoding="utf-8")
    for line in text.splitlines():
        msg = parse_line(line).text
        if msg and "NVRM" not in msg and "nvswitch" not in msg:
            out.append(msg)
    return out


def _nvrm_blocks(rng: random.Random) -> list[list[str]]:
    """One NVIDIA event as it prints: a list of consecutive messages, formats as in the captures."""
    pci = rng.choice(["0000:18:00", "0000:2a:00", "0000:38:00", "0000:9b:00", "0000:ba:00", "0000:db:00"])
    gb = rng.choice(["0008:01:00", "0009:01:00", "0018:01:00", "0019:01:00"])
    pid = rng.randint(1000, 4_000_000)
    link = rng.randint(0, 17)
    w = rng.getrandbits(32)
    return [
        [
            f"NVRM: Xid (PCI:{pci}): 13, pid='<unknown>', name=<unknown>, "
            f"Graphics SM Warp Exception on (GPC {link % 8}, TPC 5, SM 0): Out Of Range Address"
        ],
        [f"NVRM: Xid (PCI:{pci}): 43, pid={pid}, name=pt_main_thread, Ch 00000008"],
        [
            f"NVRM: Xid (PCI:{pci}): 31, pid={pid}, name=python3, channel 0x0000000c, intr 00000000. "
            "MMU Fault: ENGINE GRAPHICS GPC2 GPCCLIENT_PROP_0 faulted @ 0x0_00000000. "
            "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
        ],
        [f"NVRM: Xid (PCI:{pci}): 31, Ch 0000005a, intr 10000000. MMU Fault: ENGINE GRAPHICS faulted"],
        [f"NVRM: Xid (PCI:{pci}): 31, pid={pid}, Ch 0000003b, intr 00000000. MMU Fault: ENGINE HOST0"],
        [
            f"NVRM: Xid (PCI:{pci}): 119, pid={pid}, name=nvidia-smi, Timeout after 6s of waiting for "
            "RPC response from GPU4 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20801813 0x4c)."
        ],
        [
            f"NVRM: Xid (PCI:{gb}): 145, pid={pid}, name=ray::WorkerDict, RLW_RXPIPE Nonfatal XC0 i0 "
            f"Link {link:02d} (0x{w:08x} 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"
        ],
        [
            f"NVRM: Xid (PCI:{gb}): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link {link:02d} "
            f"(0x{w:08x} 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
        ],
        [
            f"NVRM: Xid (PCI:{gb}): 154, GPU recovery action changed from 0x4 (Drain and Reset) "
            "to 0x1 (GPU Reset Required)"
        ],
        [f"NVRM: Xid (PCI:{pci}): 45, pid={pid}, name=python3, Ch 00000001 caused by previous Xid 149"],
        [
            f"NVRM: Xid (PCI:{pci}): 74, pid='<unknown>', name=<unknown>, NVLink: fatal error detected on "
            f"link {link}(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"
        ],
        [
            f"NVRM: GPU at PCI:{pci}: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
            "NVRM: GPU Board Serial Number: 1653723052734",
            f"NVRM: Xid (PCI:{pci}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        ],
        [
            f"nvidia-nvswitch{link % 4}: SXid (PCI:0000:0{5 + link % 4}:00.0): 20034, "
            f"Fatal, Link {link} LTSSM Fault Up"
        ],
        [
            f"nvidia-nvswitch{link % 4}: SXid (PCI:0000:84:00.0): 12028, Data {{0x000001c0, 0x00bd5c8a, "
            "0x00000500, 0x00000064, 0x00000000, 0x40008000, 0x5a001100, 0x00000000, 0x00000000}"
        ],
        [
            f"NVRM: The NVIDIA GPU {pci}.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this system has"
            "\\x0aNVRM: fallen off the bus and is not responding to commands."
        ],
    ]


# XidEvent/SXidEvent per block above, in order: what the parser must find
_EXPECTED_EVENTS = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]


def synthetic_messages(n: int, seed: int) -> tuple[list[str], int]:
    """``n`` kernel messages, ~1% NVIDIA; returns (messages, expected Xid+SXid events)."""
    rng = random.Random(seed)
    noise = _noise_messages()
    out: list[str] = []
    expected = 0
    while len(out) < n:
        if rng.random() < 0.0085:  # blocks average ~1.2 lines: ~1% of lines
            blocks = _nvrm_blocks(rng)
            i = rng.randrange(len(blocks))
            if len(out) + len(blocks[i]) > n:
                continue
            out.extend(blocks[i])
            expected += _EXPECTED_EVENTS[i]
        else:
            out.append(rng.choice(noise))
    return out, expected


_T0 = datetime(2025, 1, 21, 0, 0, 0, tzinfo=timezone.utc)


def _at(us: int, fmt: str) -> str:
    return (_T0 + timedelta(microseconds=us)).strftime(fmt)


WRAPPERS: dict[str, Callable[[int, int, str], str]] = {
    "/dev/kmsg record": lambda i, us, m: f"4,{i},{us},-;{m}",
    "dmesg [mono]": lambda i, us, m: f"[{us // 1_000_000:5d}.{us % 1_000_000:06d}] {m}",
    "dmesg --decode iso": lambda i, us, m: f"kern  :warn  : {_at(us, '%Y-%m-%dT%H:%M:%S,%f')}+00:00 {m}",
    "dmesg -T": lambda i, us, m: f"[{_at(us, '%a %b %d %H:%M:%S %Y')}] {m}",
    "journalctl short": lambda i, us, m: f"{_at(us, '%b %d %H:%M:%S')} node07 kernel: {m}",
    "journalctl short-iso": lambda i, us, m: f"{_at(us, '%Y-%m-%dT%H:%M:%S+0000')} node07 kernel: {m}",
    "talos": lambda i, us, m: f"10.0.0.7: kern: warning: [{_at(us, '%Y-%m-%dT%H:%M:%S.%f')}123Z]: {m}",
}


def wrap(messages: Sequence[str], style: str) -> list[str]:
    fmt = WRAPPERS[style]
    return [fmt(i, 5_000_000 + i * 1500, m) for i, m in enumerate(messages)]


def count_events(lines: Sequence[str]) -> int:
    parser = NvrmParser()
    n = 0
    for line in lines:
        n += sum(isinstance(e, (XidEvent, SXidEvent)) for e in parser.feed(parse_line(line)))
    return n


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    print("machine:", machine())
    print(
        f"conditions: single thread, no other load requested, GC on, min {args.min_seconds:.1f} s per figure"
    )
    print()

    rate(wrap(_noise_messages()[:2000], "/dev/kmsg record"), 0.2, True)  # warm-up: regex caches, allocator

    print("== real captures (tests/data/kmsg-xid), repeated to >= min-seconds")
    largest = max(DATA.glob("*.log"), key=lambda p: p.stat().st_size)
    storm = DATA / "dmesg-decode-iso_xid13-storm_then_xid43.log"
    for path in (largest, storm):
        lines = path.read_text(encoding="utf-8").splitlines()
        print(f"  {path.name}: {len(lines)} lines, {path.stat().st_size} bytes")
        for with_nvrm in (False, True):
            r, done, secs, events = rate(lines, args.min_seconds, with_nvrm)
            what = "parse_line + NvrmParser" if with_nvrm else "parse_line          "
            extra = f", {events // (done // len(lines))} events per pass" if with_nvrm else ""
            print(f"    {what}: {r:>10,.0f} lines/s ({done:,} lines in {secs:.2f} s{extra})")
    print()

    print(f"== synthetic log: {args.lines:,} lines, ~1% NVIDIA lines, seed {args.seed}")
    t = time.perf_counter()
    messages, expected = synthetic_messages(args.lines, args.seed)
    nv = sum(("NVRM" in m or "nvswitch" in m) for m in messages)
    print(f"  generated in {time.perf_counter() - t:.1f} s: {nv:,} NVIDIA lines ({nv / len(messages):.2%}), "
          f"{expected:,} Xid/SXid events expected")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpumon-bench-") as tmp:
        path = Path(tmp) / "kmsg.log"
        kmsg_lines = wrap(messages, "/dev/kmsg record")
        path.write_text("\n".join(kmsg_lines) + "\n", encoding="utf-8")
        size = path.stat().st_size
        print(f"  written as /dev/kmsg records: {path} ({size / 1e6:.1f} MB)")

        for with_nvrm in (False, True):
            r, done, secs, _ = rate(kmsg_lines, args.min_seconds, with_nvrm)
            what = "parse_line + NvrmParser" if with_nvrm else "parse_line          "
            print(f"    {what}: {r:>10,.0f} lines/s ({done:,} lines in {secs:.2f} s)")

        found = count_events(kmsg_lines)
        print(f"    check: {found:,} Xid/SXid events found, {expected:,} expected -> "
              f"{'OK' if found == expected else 'MISMATCH'}")  # fmt: skip
        if found != expected:
            return 1

        gc.collect()
        t = time.perf_counter()
        with KernelLogFollower(path) as follower:
            records = follower.read_available()
            parser = NvrmParser()
            found_events = [e for rec in records for e in parser.feed(rec)]
            found_events.extend(parser.flush())
        secs = time.perf_counter() - t
        print("    KernelLogFollower.read_available + NvrmParser (read, decode, split, parse): "
              f"{len(records) / secs:>10,.0f} lines/s ({len(records):,} records, "
              f"{size / secs / 1e6:.0f} MB/s, {secs:.2f} s, {len(found_events):,} events)")  # fmt: skip
        del records, found_events

    print()
    print("== parse_line + NvrmParser per wrapper, same synthetic messages (first 200,000)")
    sample = messages[:200_000]
    for style in WRAPPERS:
        lines = wrap(sample, style)
        r, done, secs, _ = rate(lines, args.min_seconds, True)
        print(f"    {style:<20}: {r:>10,.0f} lines/s ({done:,} lines in {secs:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
