"""Build and load the NVML injection library (a GPU-less ``libnvidia-ml.so.1`` for tests and simulation).

The library (``nvml_inject.c`` next to this file) implements the NVML C entry points gpumon uses and
answers them from the state file named by ``$GPUMON_NVML_INJECT_STATE`` (see :mod:`gpumon.sim.nvml_state`
for the format). The real nvidia-ml-py loads it in one of two ways:

* a subprocess: start it with ``LD_LIBRARY_PATH=<lib_dir>`` (see :func:`subprocess_env`); glibc reads
  LD_LIBRARY_PATH only at process start, so this cannot be used in-process;
* in-process: call :func:`preload` before pynvml's first ``nvmlInit``; the library is then already
  loaded under its soname ``libnvidia-ml.so.1`` and pynvml's ``CDLL("libnvidia-ml.so.1")`` binds to it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import secrets
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CFLAGS",
    "LIBRARY_NAME",
    "SOURCE",
    "STATE_ENV",
    "InjectionBuildError",
    "build_library",
    "default_cache_dir",
    "exported_symbols",
    "preload",
    "subprocess_env",
]

STATE_ENV = "GPUMON_NVML_INJECT_STATE"
LIBRARY_NAME = "libnvidia-ml.so.1"
SOURCE = Path(__file__).with_name("nvml_inject.c")
CFLAGS: tuple[str, ...] = (
    "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", f"-Wl,-soname,{LIBRARY_NAME}",
)
LIBS: tuple[str, ...] = ("-lpthread",)
_BUILD_TIMEOUT_S = 300

_preloaded: dict[Path, ctypes.CDLL] = {}


class InjectionBuildError(RuntimeError):
    """The injection library could not be compiled (no C compiler, or the compiler failed)."""


def default_cache_dir() -> Path:
    """``$GPUMON_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpumon``, else ``~/.cache/gpumon``."""
    if os.environ.get("GPUMON_CACHE_DIR"):
        return Path(os.environ["GPUMON_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "gpumon"
    return Path.home() / ".cache" / "gpumon"


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC") or "cc")
    return cc or ["cc"]


def build_library(cache_dir: Path | None = None) -> Path:
    """Compile the library (if not built yet) and return the directory holding ``libnvidia-ml.so.1``.

    The directory is ``<cache_dir>/nvml-inject-<hash>``, where the hash (16 hex digits of sha256) covers
    the C source, the compiler command (``$CC``, default ``cc``) and the flags, so an edited source gets a
    fresh build and an existing build is reused. The compiler writes a temporary file that is then
    renamed into place, so concurrent builders never expose a half-written library.
    """
    cc = _compiler()
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source)
    digest.update(b"\0" + "\0".join([*cc, *CFLAGS, *LIBS]).encode())
    out_dir = Path(cache_dir or default_cache_dir()) / f"nvml-inject-{digest.hexdigest()[:16]}"
    target = out_dir / LIBRARY_NAME
    if target.is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{LIBRARY_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    cmd = [*cc, *CFLAGS, "-o", str(tmp), str(SOURCE), *LIBS]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
    except FileNotFoundError as e:
        raise InjectionBuildError(
            f"cannot build the NVML injection library: C compiler {cc[0]!r} not found "
            "(install gcc or set $CC)") from e
    except subprocess.TimeoutExpired as e:
        tmp.unlink(missing_ok=True)
        raise InjectionBuildError(f"compiling {SOURCE.name} took more than {_BUILD_TIMEOUT_S} s") from e
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise InjectionBuildError(
            f"compiling {SOURCE.name} failed (exit {proc.returncode}): {shlex.join(cmd)}\n"
            f"{proc.stderr.strip()}")
    os.replace(tmp, target)
    return out_dir


def preload(lib_dir: Path) -> None:
    """Load ``lib_dir/libnvidia-ml.so.1`` RTLD_GLOBAL so that pynvml, in this process, binds to it.

    glibc matches an already-loaded object by soname, so pynvml's later ``CDLL("libnvidia-ml.so.1")``
    returns this library. Call it before the first ``pynvml.nvmlInit()`` of the process.
    """
    path = Path(lib_dir) / LIBRARY_NAME
    if path not in _preloaded:
        _preloaded[path] = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def subprocess_env(lib_dir: Path, state_path: Path | None = None,
                   base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process that should load the injection library as its NVML.

    ``LD_LIBRARY_PATH`` gets ``lib_dir`` in front; ``$GPUMON_NVML_INJECT_STATE`` is set if ``state_path``
    is given. ``base`` defaults to ``os.environ``.
    """
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{lib_dir}{os.pathsep}{old}" if old else str(lib_dir)
    if state_path is not None:
        env[STATE_ENV] = str(state_path)
    return env


def exported_symbols(lib_dir: Path) -> set[str]:
    """Names of the functions the library exports (``nm -D --defined-only``; ``$NM`` overrides ``nm``)."""
    nm = os.environ.get("NM") or "nm"
    if shutil.which(nm) is None:
        raise InjectionBuildError(f"{nm!r} (binutils) is needed to list the library's symbols")
    proc = subprocess.run([nm, "-D", "--defined-only", str(Path(lib_dir) / LIBRARY_NAME)],
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise InjectionBuildError(f"nm failed: {proc.stderr.strip()}")
    symbols: set[str] = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("T", "W", "i"):
            symbols.add(parts[2].split("@", 1)[0])
    return symbols
