"""What machine a benchmark ran on, printed with every figure."""

from __future__ import annotations

import os
import platform


def describe() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"CPU: {cpu}; cores: {os.cpu_count()} ({usable} usable); "
            f"Python {platform.python_version()} ({platform.python_implementation()}); "
            f"{platform.system()} {platform.release()}")
