"""Files of the host: sysfs, procfs and /dev, always under the host root.

gpumon may run in a container with the host mounted at /host, and tests point
it at a directory tree, so no code outside this module builds a path to
/sys or /proc. Reads are bounded: a sysfs attribute behind a dead PCIe link
can block in the kernel.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpumon.errors import HwCondition, HwFailure, NotSupported
from gpumon.hw.calls import BoundedCaller

MAX_ATTR_BYTES = 1 << 20


class HostFs:
    def __init__(self, root: Path, caller: BoundedCaller, timeout: float) -> None:
        self.root = root
        self._root = str(root).rstrip("/")
        self._caller = caller
        self._timeout = timeout

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def _abs(self, rel: str) -> str:
        # plain strings: pathlib costs more than the read itself on the 1 s sampling path
        return f"{self._root}/{rel.lstrip('/')}"

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def listdir(self, rel: str) -> list[str]:
        p = self.path(rel)
        try:
            return sorted(self._caller.call("hostfs", f"listdir({rel})", lambda: os.listdir(p),
                                            self._timeout))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise HwFailure(f"cannot list {p}: {exc.strerror}", call=f"listdir({rel})") from None

    def read_text(self, rel: str, component: str = "node") -> str:
        """The stripped text of a file; NotSupported if it is absent, HwFailure if unreadable."""
        p = self.path(rel)
        label = f"read({rel})"

        def read() -> bytes:
            with open(p, "rb") as fh:
                return fh.read(MAX_ATTR_BYTES)

        try:
            data = self._caller.call("hostfs", label, read, self._timeout, component)
        except FileNotFoundError:
            raise NotSupported(f"{p} does not exist", call=label, component=component) from None
        except OSError as exc:
            raise HwFailure(f"cannot read {p}: {exc.strerror}", call=label,
                            component=component) from None
        return data.decode("utf-8", errors="replace").strip()

    def read_many(self, rels: list[str], component: str = "node") -> dict[str, str | HwCondition]:
        """Several small files in ONE bounded call: text, or the condition reading it raised.

        Each bounded call is a hand-off to a worker thread; a check sampling dozens
        of sysfs attributes every second should pay for one, not dozens.
        """
        label = f"read({rels[0]} +{len(rels) - 1} more)" if rels else "read()"

        def read_all() -> dict[str, bytes | OSError]:
            out: dict[str, bytes | OSError] = {}
            for rel in rels:
                try:
                    with open(self._abs(rel), "rb") as fh:
                        out[rel] = fh.read(MAX_ATTR_BYTES)
                except OSError as exc:
                    out[rel] = exc
            return out

        raw = self._caller.call("hostfs", label, read_all, self._timeout, component)
        result: dict[str, str | HwCondition] = {}
        for rel, data in raw.items():
            if isinstance(data, FileNotFoundError):
                result[rel] = NotSupported(f"{self._abs(rel)} does not exist", call=f"read({rel})",
                                           component=component)
            elif isinstance(data, OSError):
                result[rel] = HwFailure(f"cannot read {self._abs(rel)}: {data.strerror}", call=f"read({rel})",
                                        component=component)
            else:
                result[rel] = data.decode("utf-8", errors="replace").strip()
        return result

    def read_int(self, rel: str, component: str = "node", base: int = 0) -> int:
        text = self.read_text(rel, component)
        try:
            return int(text.split()[0], base) if text else int("")
        except ValueError:
            raise HwFailure(f"{self.path(rel)}: expected an integer, read {text[:40]!r}",
                            call=f"read({rel})", component=component) from None

    def boot_id(self) -> str | None:
        try:
            return self.read_text("proc/sys/kernel/random/boot_id") or None
        except (NotSupported, HwFailure):
            return None

    def boot_time(self) -> float | None:
        """Boot time (epoch seconds) from /proc/stat ``btime``; None when unknown."""
        try:
            text = self.read_text("proc/stat")
        except (NotSupported, HwFailure):
            return None
        for line in text.splitlines():
            if line.startswith("btime "):
                try:
                    return float(line.split()[1])
                except (IndexError, ValueError):
                    return None
        return None
