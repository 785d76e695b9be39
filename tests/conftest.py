"""Shared fixtures: the NVML injection library under the real nvidia-ml-py, host-root trees.

Nothing here patches pynvml or subprocess: in-process tests load the injection
library (pynvml then binds to it by soname) and drive it through a state file;
CLI tests run ``gpumon`` as a child process with LD_LIBRARY_PATH.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from deploy.image_build import ImageBuild, remove, status_file, tools
from hypothesis import settings

from gpumon.sim import nvml_inject
from gpumon.sim.nvml_state import NvmlNodeState, write_state

DATA = Path(__file__).parent / "data"
IMAGE_TESTS = "tests/deploy/test_container_image.py"
IMAGE_BUILD = pytest.StashKey["ImageBuild"]()

# CI machines are slow and shared: no per-example deadline, and a fixed seed so
# that a red CI run is reproducible (a found failure is still a failure).
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="session")
def inject_lib_dir() -> Path:
    lib_dir = nvml_inject.build_library()
    nvml_inject.preload(lib_dir)
    return lib_dir


@pytest.fixture
def nvml_state(inject_lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Path of a state file the injection library reads; write it with write_state."""
    path = tmp_path / "nvml-state.txt"
    write_state(NvmlNodeState.hgx(8), path)
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(path))
    yield path


# simulated nodes started without --sim-dir live under $XDG_STATE_HOME: the tests' own, not the user's
_STATE_HOME = tempfile.mkdtemp(prefix="gpumon-tests-state-")
atexit.register(shutil.rmtree, _STATE_HOME, True)


def need_tool(name: str, package: str) -> str:
    """The path of a tool a test drives; missing: a skip on a developer machine, a failure under CI
    (where .ci/run must have installed its Debian package)."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} missing: .ci/run must install the Debian package {package}")
        pytest.skip(f"{name} not installed (Debian package {package})")
    return path


def tls_web_config(where: Path, user: str, password: str) -> tuple[Path, Path]:
    """A throw-away certificate for 127.0.0.1/localhost and an exporter web config with TLS and one
    basic-auth user (bcrypt): (web config, certificate)."""
    import bcrypt

    key, crt = where / "tls.key", where / "tls.crt"
    subprocess.run([need_tool("openssl", "openssl"), "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    web = where / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n"
                   f"basic_auth_users:\n  {user}: '{hashed}'\n")
    return web, crt


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", nvml_inject.STATE_ENV, "NOTIFY_SOCKET")}
    env["XDG_STATE_HOME"] = _STATE_HOME
    env.update(extra)
    return env


def run_gpumon(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpumon", *args], capture_output=True, text=True,
                          env=env if env is not None else clean_env(), timeout=timeout, cwd=cwd)


Findings = dict[tuple[str, str], dict[str, Any]]


def report_findings(report: Path) -> Findings:
    """The findings of a daemon's report.json by (check, component); none while it is not written."""
    try:
        return {(f["check"], f["component"]): f for f in json.loads(report.read_text())["findings"]}
    except (OSError, ValueError):
        return {}


def daemon_until(args: list[str], report: Path, want: Callable[[Findings], bool], what: str, *,
                 env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``gpumon ARGS`` (a daemon, its ``--duration`` longer than ``timeout``) until the findings of its
    ``report`` (report.json, by (check, component)) satisfy ``want``; then stopped with SIGTERM as
    systemd stops it. Its exit code and stderr. A daemon's checks run at its pace, not the test's: on
    a busy machine a fixed ``--duration`` can end before a check has run."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "gpumon", *args], stdout=subprocess.DEVNULL,
                                stderr=err, text=True, env=env if env is not None else clean_env())
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    err.seek(0)
                    raise AssertionError(f"{what}: the daemon exited {proc.returncode} first\n"
                                         + err.read()[-3000:])
                if want(report_findings(report)):
                    break
                if time.monotonic() > deadline:
                    err.seek(0)
                    raise AssertionError(f"{what}: not within {timeout:g} s\n" + err.read()[-3000:])
                time.sleep(0.2)
            proc.terminate()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, "", err.read())


def run_on_json(check: Any, ctx: Any) -> Any:
    """``check.run(ctx)`` where ``ctx.state`` is a plain JSON mapping a test keeps between runs (or
    a store's ``CheckState``): read as the store reads a state file (a declared ``State`` loaded,
    checked, reset at a reboot), and left holding the JSON the store would save after the run, so
    that each run starts from what a restarted daemon would read."""
    from gpumon.checkstate import CheckState

    raw = ctx.state
    if isinstance(raw, CheckState):
        try:
            return check.run(ctx)
        finally:
            raw.sync()
    entry = ctx.state = CheckState(raw, name=check.name)
    try:
        return check.run(ctx)
    finally:
        entry.sync()
        raw.clear()
        raw.update(entry)
        ctx.state = raw


class SimHarness:
    """A simulated node driven step by step, with checks run against it through the real stack.

    ``render(t)`` lays the scenario out at time t (host-root tree, /dev/kmsg log,
    NVML state served by the injection library under the real nvidia-ml-py);
    ``run(check, t)`` runs a check at time t with the framework's own context:
    real ``Hardware``, inventory, profile, SKU-merged options, persisted state,
    and the kernel log read through the real follower and parser.
    """

    def __init__(self, scenario_text: str, root: Path, lib_dir: Path, config_text: str = "") -> None:
        from gpumon.config import load_config, with_profile
        from gpumon.registry import load_checks
        from gpumon.schema import load_yaml
        from gpumon.sim.render import SimNode
        from gpumon.sim.scenario import _build

        data, src = load_yaml(scenario_text, str(root / "scenario.yaml"))
        self.scenario = _build(data, src)
        self.node = SimNode(self.scenario, root, start_wall=1_800_000_000.0)
        self.root = root
        self.lib_dir = lib_dir
        root.mkdir(parents=True, exist_ok=True)
        cfg_path = root / "gpumon.yaml"
        cfg_path.write_text(config_text or "{}\n")
        self.registry = load_checks()
        self.config = load_config(cfg_path, self.registry, site_file=root / "absent.yaml")
        self.states: dict[str, dict[str, object]] = {}
        self.t = 0.0
        self._with_profile = with_profile
        self._sources: dict[str, Any] = {}  # check name -> its KernelLogSource

    def render(self, t: float) -> None:
        self.t = t
        self.node.render(t)
        os.environ[nvml_inject.STATE_ENV] = str(self.node.nvml_state_path)

    def context(self, check_cls: type, t: float | None = None):  # type: ignore[no-untyped-def]
        from gpumon.check import CheckContext
        from gpumon.hw.inventory import collect
        from gpumon.hw.kernellog import KernelLogSource
        from gpumon.profiles import builtin_profiles, select_profile
        from gpumon.sim.simulation import simulated_hardware

        if t is not None:
            self.render(t)
        hw = simulated_hardware(self.node.host_root)
        hw.nvml.init()
        inventory = collect(hw.nvml, hw.fs)
        profile = select_profile(builtin_profiles(), inventory.gpu_names, "auto")
        config = self._with_profile(self.config, self.registry, profile)
        name = check_cls.name
        if name not in self._sources:  # each check reads the whole log once, like the daemon
            self._sources[name] = KernelLogSource(self.node.kmsg_path, boot_time=self.node.boot_time)
        log = self._sources[name].read_log()
        return CheckContext(hw=hw, inventory=inventory, profile=profile,
                            options=config.settings(check_cls).options,
                            state=self.states.setdefault(name, {}), kernel_log=log,
                            clock=lambda: self.node.start_wall + self.t, node="sim")

    def run(self, check_cls: type, t: float | None = None):  # type: ignore[no-untyped-def]
        ctx = self.context(check_cls, t)
        return run_on_json(check_cls(), ctx)

    def close(self) -> None:
        for source in self._sources.values():
            source.close()


@pytest.fixture
def sim(inject_lib_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``sim(scenario_yaml_text, config_yaml_text="")`` -> SimHarness (see its docstring)."""
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(tmp_path / "unset"))
    made: list[SimHarness] = []

    def make(scenario_text: str, config_text: str = "") -> SimHarness:
        h = SimHarness(scenario_text, tmp_path / f"sim{len(made)}", inject_lib_dir, config_text)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# The suite's slow files (`pytest -m "not slow"` leaves them out: the developers' inner loop): test
# hosts in network namespaces and Slurm clusters, image and wheel builds, daemons run for a while, and
# multi-rank training jobs. Measured: each holds tests of several seconds to a minute (--durations).
SLOW = (
    "tests/bootstrap/test_run_bootstrap.py",
    "tests/deploy/test_container_image.py",
    "tests/export/test_nvhcd.py",
    "tests/export/test_openapi.py",
    "tests/fabric/test_coverage.py",
    "tests/fabric/test_flaps.py",
    "tests/fabric/test_harness.py",
    "tests/fabric/test_one_node.py",
    "tests/fabric/test_probe.py",
    "tests/fabric/test_probe_slurm.py",
    "tests/guard/test_example.py",
    "tests/guard/test_guard_audit.py",
    "tests/guard/test_guard_close.py",
    "tests/guard/test_guard_confirm.py",
    "tests/guard/test_guard_ddp.py",
    "tests/guard/test_guard_fsdp.py",
    "tests/guard/test_guard_netns.py",
    "tests/guard/test_guard_overhead_bench.py",
    "tests/guard/test_guard_pace.py",
    "tests/guard/test_guard_slurm.py",
    "tests/guard/test_guard_spool_bounds.py",
    "tests/integration/test_prometheus_scrape.py",
    "tests/sdc/test_canary.py",
    "tests/sdc/test_canary_gpu_identity.py",
    "tests/sdc/test_canary_replay_injection.py",
    "tests/test_daemon.py",
    "tests/test_daemon_health.py",
    "tests/test_daemon_intake.py",
    "tests/test_first_hour.py",
    "tests/test_hung_host_files.py",
    "tests/test_install_layout.py",
    "tests/test_light_install.py",
    "tests/test_lint.py",
    "tests/why/test_flight_recorder.py",
    "tests/why/test_why_e2e.py",
    "tests/why/test_why_edges_netns.py",
    "tests/why/test_why_prometheus.py",
    "tests/why/test_why_slurm.py",
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_itemcollected(item: pytest.Item) -> None:
    if item.nodeid.split("::", 1)[0] in SLOW:
        item.add_marker(pytest.mark.slow)


def xdist_run(config: pytest.Config) -> tuple[str, str] | None:
    """(this worker's id, the run's id) in a pytest-xdist worker; None in a plain run or the controller."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    return str(workerinput["workerid"]), str(workerinput["testrunuid"])


def _xdist_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and xdist_run(config) is None


def pytest_configure(config: pytest.Config) -> None:
    if _xdist_controller(config) and not getattr(config.option, "testrunuid", None):
        import uuid

        config.option.testrunuid = uuid.uuid4().hex  # the workers' testrunuid: the image build's name


@pytest.hookimpl(trylast=True)  # after -k/-m have deselected: only a selected image test builds
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """The container image tests run last, and their image is built from the start of the session in
    the background at the lowest CPU priority (tests/deploy/image_build.py): ~2 minutes of CPU that
    the rest of the suite's waits leave idle, not 2 minutes of the suite's wall time. Under
    pytest-xdist worker gw0 builds it (every worker collects every test; the controller then hands
    the image tests to one of them), and a worker that runs them without having built it waits for
    gw0's build (``deploy.image_build.wait_for_other``); the controller removes the image."""
    image = [i for i in items if i.nodeid.startswith(IMAGE_TESTS)]
    if not image:
        return
    items[:] = [i for i in items if not i.nodeid.startswith(IMAGE_TESTS)] + image
    buildah, mmdebstrap = tools()
    if not (buildah and mmdebstrap and os.geteuid() == 0 and not config.option.collectonly):
        return
    run = xdist_run(config)
    if run is None:
        config.stash[IMAGE_BUILD] = ImageBuild(buildah, mmdebstrap).start()
    elif run[0] == "gw0":
        config.stash[IMAGE_BUILD] = ImageBuild(buildah, mmdebstrap, tag=run[1][:8],
                                               status=status_file(run[1])).start()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    build = config.stash.get(IMAGE_BUILD, None)
    if build is not None:
        if xdist_run(config) is None:
            build.remove()
        elif build.status is not None:
            # another worker may run the image tests: this process must outlive the build
            with contextlib.suppress(Exception):
                build.wait(timeout=1200)
    if _xdist_controller(config):
        buildah, _ = tools()
        if buildah and os.geteuid() == 0:
            remove(config.option.testrunuid, buildah)
