"""The container image is built from deploy/container/Containerfile and run: the real recipe, the real
builder (buildah, chroot isolation: what builds on a machine without a container runtime's rlimits).

The registry's python image cannot be pulled here, so the test makes a Debian base of its own with
mmdebstrap (python3, python3-venv, apt: what the Containerfile needs of its base) and passes it as
``BASE``; every RUN step of the recipe runs as written (image_build.py). The build costs about 2.2
minutes alone on 2 cores (105 s of CPU); it starts with the session at a lower CPU priority (nice 5) and
these tests run last, so it takes only the CPU the rest of the suite leaves idle. The compute target
(torch, several GB) is not built here — see "Container images" in docs/operators/deploy.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import IMAGE_BUILD, need_tool, xdist_run

from .image_build import BuildError, wait_for_other

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "container" / "Containerfile"


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> str:
    need_tool("buildah", "buildah")
    need_tool("mmdebstrap", "mmdebstrap")
    build = request.config.stash.get(IMAGE_BUILD, None)
    run = xdist_run(request.config)
    try:
        if build is None and run is not None:
            return wait_for_other(run[1], timeout=1200)  # worker gw0 builds it
        assert build is not None, "the session did not start the image build (tests/conftest.py)"
        return build.wait(timeout=1200)
    except BuildError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def container(image: str) -> Iterator[str]:
    ctr = _run(["buildah", "from", "-q", image], timeout=60).stdout.strip()
    yield ctr
    subprocess.run(["buildah", "rm", ctr], capture_output=True, timeout=60, check=False)


def test_image_labels_and_user(image: str) -> None:
    info = json.loads(_run(["buildah", "inspect", "--type", "image", image], timeout=60).stdout)
    config = info["OCIv1"]["config"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == "gpumon"
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    assert labels["org.opencontainers.image.revision"] == "test"
    assert config["Cmd"][:2] == ["gpumon", "daemon"]
    assert "9426/tcp" in config.get("ExposedPorts", {})


def test_check_simulated_node_passes_in_the_image(container: str) -> None:
    proc = subprocess.run(["buildah", "run", "--isolation", "chroot", container, "--",
                           "gpumon", "check", "--simulate", "healthy-8xh100", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["status"] == "ok"
    # the injection library was built into the image: no compiler there, yet the node is simulated
    which = subprocess.run(["buildah", "run", "--isolation", "chroot", container, "--", "sh", "-c",
                            "command -v cc gcc || echo none"], capture_output=True, text=True, timeout=60)
    assert which.stdout.strip() == "none"
    # the package inventory (pip inspect) the image carries for scanners
    inv = subprocess.run(["buildah", "run", "--isolation", "chroot", container, "--", "cat",
                          "/opt/gpumon/share/doc/gpumon-node/packages.json"],
                         capture_output=True, text=True, timeout=60, check=True)
    names = {p["metadata"]["name"].lower().replace("_", "-") for p in json.loads(inv.stdout)["installed"]}
    # the extras the DaemonSet's config may turn on (remediation.backend: kubernetes, basic auth): a
    # plain `pip install gpumon-node` brings neither
    assert {"gpumon-node", "nvidia-ml-py", "prometheus-client", "kubernetes", "bcrypt"} <= names


def test_daemon_in_the_image_serves_metrics(container: str, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # chroot isolation shares this machine's network: the daemon's port is reachable from here
    log = (tmp_path / "daemon.log").open("w")
    proc = subprocess.Popen(["buildah", "run", "--isolation", "chroot", container, "--",
                             "gpumon", "daemon", "--simulate", "healthy-8xh100", "--sim-dir", "/tmp/sim",
                             "--listen", f"127.0.0.1:{port}", "--duration", "60"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        body, deadline = "", time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                if "gpumon_health_state" in body:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            time.sleep(0.5)
        assert "gpumon_health_state" in body, body[-2000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_manifests_name_the_images_the_recipe_builds() -> None:
    """The DaemonSet runs the daemon target, the probe Job the compute target, under the tags the
    build commands of docs/operators/deploy.md give them."""
    import yaml

    page = (ROOT / "docs" / "operators" / "deploy.md").read_text()
    tags = {}
    for target in ("daemon", "compute"):
        line = next(ln for ln in page.splitlines()
                    if ln.startswith("buildah bud") and f"--target {target}" in ln.replace("  ", " "))
        tags[target] = line.split(" -t ")[1].split()[0]
    images = {}
    for name in ("daemonset.yaml", "fabric-probe.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / name).read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                images[name] = c["image"]
    assert images == {"daemonset.yaml": tags["daemon"], "fabric-probe.yaml": tags["compute"]}
    text = CONTAINERFILE.read_text()
    assert "AS daemon" in text and "AS compute" in text
