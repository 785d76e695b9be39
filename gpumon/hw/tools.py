"""External tools (nvidia-smi, dcgmi, all_reduce_perf, ib_write_bw, ...).

One runner: an argv list, never a shell; a timeout after which the whole
process group is killed; output captured and capped. A missing tool is a
``ToolMissing`` condition (a ``skipped`` finding with the reason), and a tool
that hangs is an ``HwTimeout`` (a finding: NPD's plugin runner does the same).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpumon.errors import HwFailure, HwTimeout, ToolMissing

MAX_OUTPUT = 8 << 20


@dataclass(frozen=True)
class ToolResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class ToolRunner:
    def __init__(self, default_timeout: float, search_path: str | None = None) -> None:
        self.default_timeout = default_timeout
        self.search_path = search_path
        self._activity: dict[int, str] = {}

    def which(self, tool: str) -> str | None:
        return shutil.which(tool, path=self.search_path)

    def current_call(self, thread_ident: int) -> str | None:
        return self._activity.get(thread_ident)

    def run(self, argv: Sequence[str], *, timeout: float | None = None, component: str = "node",
            env: Mapping[str, str] | None = None, stdin: str | None = None) -> ToolResult:
        if not argv:
            raise ValueError("empty argv")
        label = " ".join(argv[:3]) + (" ..." if len(argv) > 3 else "")
        exe = self.which(argv[0])
        if exe is None:
            raise ToolMissing(f"{argv[0]} is not installed (not found on PATH)", call=label,
                              component=component)
        limit = timeout if timeout is not None else self.default_timeout
        start = time.monotonic()
        me = threading.get_ident()
        self._activity[me] = label
        try:
            proc = subprocess.Popen(
                [exe, *argv[1:]], stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                env=dict(env) if env is not None else None,
            )
        except OSError as exc:
            self._activity.pop(me, None)
            raise HwFailure(f"cannot start {argv[0]}: {exc.strerror}", call=label,
                            component=component) from None
        try:
            out, err = proc.communicate(stdin.encode() if stdin is not None else None, timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise HwTimeout(f"{label} did not finish within {limit:g} s (killed); "
                            f"last output: {_tail(out)!r}", call=label, component=component,
                            seconds=limit) from None
        finally:
            self._activity.pop(me, None)
        return ToolResult(tuple(argv), proc.returncode, _decode(out), _decode(err),
                          time.monotonic() - start)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _decode(data: bytes | None) -> str:
    return (data or b"")[:MAX_OUTPUT].decode("utf-8", errors="replace")


def _tail(data: bytes | None) -> str:
    return _decode(data)[-200:]
