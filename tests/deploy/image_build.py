"""The container image build of test_container_image.py, started when the session starts and run at
a lower CPU priority than the tests beside it (``nice -n 5``).

The build costs about 105 s of CPU on 2 cores (2.2 minutes alone); in the background, behind the
suite's waits, it is ready when the image tests run, last (``tests/conftest.py`` orders them so).
Not ``nice -n 19``: that takes only the CPU nothing else wants, and with another process keeping a
core busy all along (a CI run beside a CPU hog) mmdebstrap alone passed its 900 s timeout. At nice 5
(weight 335 against a neighbour's 1024) it keeps a quarter of a core it has to share.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"
# what the Containerfile needs of a base image (python3 >= 3.10 with venv, apt for the build stage)
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
CA = Path("/etc/ssl/certs/ca-certificates.crt")
NICE = ["nice", "-n", "5"]


class BuildError(Exception):
    pass


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run([*NICE, *cmd], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


class ImageBuild:
    """A Debian base made with mmdebstrap (the registry's python image cannot be pulled here), then
    the recipe's ``daemon`` target on it with ``buildah bud --isolation chroot``: every RUN step as
    written. ``wait`` gives the built image's name or raises what failed."""

    def __init__(self, buildah: str, mmdebstrap: str, tag: str | None = None,
                 status: Path | None = None) -> None:
        self.buildah, self.mmdebstrap = buildah, mmdebstrap
        tag = tag or secrets.token_hex(4)
        self.base, self.image = names(tag)
        # under pytest-xdist one worker builds and the others wait on this file: "ok" or the error
        self.status = status
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="image-build", daemon=True)

    def start(self) -> ImageBuild:
        self._thread.start()
        return self

    def _build(self) -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="gpumon-image-") as work:
                tar = Path(work) / "base.tar"
                _run([self.mmdebstrap, "--variant=apt", f"--include={BASE_PACKAGES}", "--components=main",
                      "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                      "--dpkgopt=path-exclude=/usr/share/locale/*", "bookworm", str(tar)], timeout=900)
                ctr = _run([self.buildah, "from", "scratch"], timeout=60).strip()
                try:
                    _run([self.buildah, "add", ctr, str(tar), "/"], timeout=300)
                    _run([self.buildah, "commit", "-q", ctr, self.base], timeout=300)
                finally:
                    subprocess.run([self.buildah, "rm", ctr], capture_output=True, timeout=60, check=False)
            cmd = [self.buildah, "bud", "--isolation", "chroot", "-q", "-f", str(CONTAINERFILE),
                   "--target", "daemon", "--build-arg", f"BASE={self.base}", "--build-arg", "REVISION=test",
                   "-t", self.image]
            if CA.is_file():  # this machine's proxy re-signs TLS: the build's pip trusts what the host trusts
                cmd += ["--secret", f"id=ca-certificates,src={CA}"]
            _run([*cmd, str(ROOT)], timeout=1200)
        except BaseException as exc:  # handed to the test that waits for the image
            self._error = exc
        if self.status is not None:
            text = "ok" if self._error is None else f"error\n{type(self._error).__name__}: {self._error}"
            tmp = self.status.with_name(self.status.name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.status)

    def wait(self, timeout: float) -> str:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise BuildError(f"the image build did not finish within {timeout} s of the image tests' start")
        if self._error is not None:
            raise self._error
        return self.image

    def remove(self) -> None:
        if self._thread.is_alive():
            self._thread.join(60)
        subprocess.run([self.buildah, "rmi", "-f", self.image, self.base], capture_output=True, timeout=120,
                       check=False)


def names(tag: str) -> tuple[str, str]:
    """The base image's and the built image's names for one build."""
    return f"localhost/gpumon-test-base:{tag}", f"localhost/gpumon-test:{tag}"


def status_file(run: str) -> Path:
    """Where one test run's image build says how it ended, for the workers that did not build it."""
    return Path(tempfile.gettempdir()) / f"gpumon-image-{run}.status"


def wait_for_other(run: str, timeout: float) -> str:
    """The image another pytest-xdist worker of this run builds: its name once built, else raises."""
    path = status_file(run)
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if time.monotonic() > deadline:
            raise BuildError(f"the image build (another worker's) did not finish within {timeout} s")
        time.sleep(1.0)
    text = path.read_text()
    if text != "ok":
        raise BuildError(f"the image build failed: {text.removeprefix('error').strip()}")
    return names(run[:8])[1]


def remove(run: str, buildah: str) -> None:
    """Remove one run's images and its status file (the controller of a pytest-xdist run)."""
    subprocess.run([buildah, "rmi", "-f", *names(run[:8])], capture_output=True, timeout=120, check=False)
    status_file(run).unlink(missing_ok=True)


def tools() -> tuple[str | None, str | None]:
    return shutil.which("buildah"), shutil.which("mmdebstrap")
