"""The install docs/operators/install.md documents, done for real on a root tree.

The wheel is built from this checkout (offline: no index, no build isolation) and its metadata read
as pip reads it: the distribution is ``gpumon-node`` (``gpumon`` on the package index is someone
else's project), the command is ``gpumon``, and every ``gpumon.checks`` entry point names a module
that is in the wheel. Then the layout the systemd units expect: ``python3 -m venv /opt/gpumon`` and
the wheel installed into it with that venv's own pip, under a temporary root; ``systemd-analyze
verify --root`` passes on exactly that tree and fails on the same tree without the venv.

What this does not do: download the wheel's dependencies. The venv gets them through a ``.pth`` line
naming the test interpreter's site-packages (after the venv's own, so gpumon itself is the wheel's
copy, which the tests assert); on a node ``/opt/gpumon/bin/pip install`` fetches them.
"""

from __future__ import annotations

import configparser
import email.parser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from wheel_build import ROOT, build_wheel, copy_sources

from conftest import need_tool
from gpumon.distribution import DISTRIBUTION

UNITS = ("gpumon.service", "gpumon-bootstrap.service")
VENV = Path("opt/gpumon")  # relative to a root tree; /opt/gpumon on a node
DOC = Path("opt/gpumon/share/doc/gpumon-node/README.md")
WRAPPER = ROOT / "contrib" / "slurm-healthcheck.sh"
# tomllib is 3.11+ and gpumon supports 3.10
_version = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
assert _version
VERSION = _version[1]


def _run(*cmd: str | Path, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120,
                          **kw)  # type: ignore[call-overload]


# A check package a newcomer adds to checks/, and a subpackage of gpumon: in the one wheel the tests
# build, with nothing else edited
NEW_CHECK = "zz_new_check"
NEW_CHECK_SOURCE = '''"""A widget watcher a newcomer writes: options, state, readings, kernel-log use."""

from dataclasses import dataclass, field

from gpumon.bootstate import BootState
from gpumon.check import Check, CheckContext, KernelLogNeeds
from gpumon.model import NODE, Action, Finding, Phase, ReadingSpec, Severity, reading


@dataclass(frozen=True)
class ZzConfig:  # checks.zz_new_check.* in gpumon.yaml
    marker: str = "zz-widget"
    max_lines: int = field(default=0, metadata={"min": 0, "source": "the test's choice"})


@dataclass
class ZzState(BootState):
    runs: int = 0
    lines: int = 0
    keep_across_boots = ("runs",)


class ZzNewCheck(Check):
    name = "zz_new_check"
    phase = Phase.CONTINUOUS
    description = "widget lines in the kernel log"
    readings = (
        ReadingSpec("zz_new_runs_total", "counter",
                    "Runs of the zz_new_check test check, kept across restarts.", unit="runs",
                    source="the check's own saved state"),
        ReadingSpec("zz_new_marker_lines_total", "counter", "Kernel-log lines with the configured marker.",
                    unit="lines", source="the kernel log (checks.zz_new_check.marker)"),
    )
    interval = 1.0
    timeout = 5.0
    Config = ZzConfig
    State = ZzState
    kernel_log = KernelLogNeeds()

    def run(self, ctx: CheckContext) -> list[Finding]:
        options = ctx.options_as(ZzConfig)
        state = ctx.state_as(ZzState)
        state.runs += 1
        state.lines += sum(options.marker in r.text for r in ctx.kernel_log.records)
        readings = [reading("zz_new_runs_total", state.runs),
                    reading("zz_new_marker_lines_total", state.lines)]
        if state.lines > options.max_lines:
            return [self.finding(NODE, Severity.WARN, f"{state.lines} lines with {options.marker}",
                                 Action.INSPECT_HARDWARE, readings=readings)]
        return [self.ok(NODE, f"no line with {options.marker}", readings=readings)]
'''
NEW_CHECK_FILES = {
    "__init__.py": '"""a check package of the test"""\n\nfrom .check import ZzNewCheck\n',
    "check.py": NEW_CHECK_SOURCE,
    "parts/__init__.py": '"""a subpackage of the check"""\n',
    "parts/logic.py": "VALUE = 1\n",
}


def _add_new_packages(src: Path) -> Path:
    for rel, text in NEW_CHECK_FILES.items():
        path = src / "checks" / NEW_CHECK / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sub = src / "gpumon" / "zz_new_sub"
    sub.mkdir()
    (sub / "__init__.py").write_text('"""a package of the test"""\n')
    (sub / "logic.py").write_text("VALUE = 1\n")
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _add_new_packages(copy_sources(tmp_path_factory.mktemp("src")))
    return build_wheel(src, tmp_path_factory.mktemp("dist"))


def _dist_info(whl: zipfile.ZipFile, name: str) -> str:
    (member,) = [n for n in whl.namelist() if n.endswith(f".dist-info/{name}") and n.count("/") == 1]
    return whl.read(member).decode()


def _site(venv: Path) -> Path:
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(_run(venv / "bin" / "python", "-c", purelib).stdout.strip())


def _venv(venv: Path, wheel: Path) -> Path:
    """The documented venv with the wheel in it (offline: the dependencies lent by a .pth line naming
    the test interpreter's site-packages, after the venv's own)."""
    proc = _run(sys.executable, "-m", "venv", venv)
    assert proc.returncode == 0, proc.stderr
    proc = _run(venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (_site(venv) / "zz_test_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    return venv


def _clean_env() -> dict[str, str]:
    # away from the checkout: `python -c` puts the working directory first on sys.path
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def test_the_wheel_is_gpumon_node_with_the_gpumon_command(wheel: Path) -> None:
    version = VERSION
    assert wheel.name == f"gpumon_node-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        meta = email.parser.Parser().parsestr(_dist_info(whl, "METADATA"))
        eps = configparser.ConfigParser(delimiters=("=",))
        eps.optionxform = str  # type: ignore[assignment,method-assign]
        eps.read_string(_dist_info(whl, "entry_points.txt"))
        names = set(whl.namelist())
        doc = whl.read(f"gpumon_node-{version}.data/data/share/doc/gpumon-node/README.md").decode()
    assert meta["Name"] == DISTRIBUTION == "gpumon-node"
    assert meta["Version"] == version
    assert dict(eps["console_scripts"]) == {"gpumon": "gpumon.cli:main"}
    # the file the units' Documentation= names once installed into the venv
    assert doc == (ROOT / "README.md").read_text()

    checks = dict(eps["gpumon.checks"])
    assert len(checks) >= 19
    missing = []
    for name, target in checks.items():
        module = target.partition(":")[0].replace(".", "/")
        if f"{module}.py" not in names and f"{module}/__init__.py" not in names:
            missing.append(f"{name} = {target}")
    assert not missing, f"entry points naming modules the wheel lacks: {missing}"
    # a subpackage the build did not find is a module missing from every install, not only a check
    lost = sorted(name for folder, package in (("gpumon", "gpumon"), ("checks", "gpumon_checks"))
                  for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
                  if (name := f"{package}/{p.relative_to(ROOT / folder).as_posix()}") not in names)
    assert not lost, f"modules not in the wheel: {lost}"


def _host_tree(root: Path) -> Path:
    """A fresh host for ``systemd-analyze --root``: the host's own unit directory (sysinit.target &
    co.), gpumon's units copied where the install page copies them, and nothing of gpumon else."""
    need_tool("systemd-analyze", "systemd")
    unit_dir = next((d for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                     if (d / "sysinit.target").exists()), None)
    if unit_dir is None:
        pytest.fail("systemd-analyze is installed but no sysinit.target in /usr/lib/systemd/system")
    shutil.copytree(unit_dir, root / "usr" / "lib" / "systemd" / "system", symlinks=True)
    (root / "lib").symlink_to("usr/lib")  # absolute links in the copy point at /lib/systemd/...
    etc = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True)
    for name in UNITS:
        shutil.copy2(ROOT / "systemd" / name, etc / name)
    return root


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    return _run(need_tool("systemd-analyze", "systemd"), "verify", f"--root={root}", *UNITS)


def test_documented_install_commands_are_the_ones_tested() -> None:
    page = (ROOT / "docs" / "operators" / "install.md").read_text()
    for line in ("python3 -m venv /opt/gpumon",
                 "/opt/gpumon/bin/pip install ./dist/gpumon_node-*.whl",
                 "ln -s /opt/gpumon/bin/gpumon /usr/local/bin/gpumon",
                 "install -m 0644 systemd/gpumon.service systemd/gpumon-bootstrap.service "
                 "/etc/systemd/system/"):
        assert line in page, line


def test_units_verify_on_the_documented_layout_and_not_without_it(wheel: Path, tmp_path: Path) -> None:
    root = _host_tree(tmp_path / "root")
    # a fresh host: the units name a binary that is not there yet
    before = _verify(root)
    for name in UNITS:
        assert f"{name}: Command /opt/gpumon/bin/gpumon is not executable" in before.stderr, before.stderr

    # the install page's commands, under the root tree (and offline: --no-index, dependencies below)
    venv = _venv(root / VENV, wheel)
    (root / "usr" / "local" / "bin").mkdir(parents=True)
    (root / "usr" / "local" / "bin" / "gpumon").symlink_to("/opt/gpumon/bin/gpumon")

    after = _verify(root)
    assert after.returncode == 0 and after.stderr.strip() == "" and after.stdout.strip() == "", (
        after.stdout + after.stderr)
    for name in UNITS:
        text = (root / "etc" / "systemd" / "system" / name).read_text()
        docs = [line.partition("=")[2] for line in text.splitlines() if line.startswith("Documentation=")]
        assert docs == [f"file:///{DOC}"], name
    assert (root / DOC).read_text() == (ROOT / "README.md").read_text()

    # the command the units start is the venv's: its interpreter, the wheel's gpumon
    script = venv / "bin" / "gpumon"
    shebang = script.read_text().splitlines()[0]
    assert shebang.startswith("#!") and Path(shebang[2:]).parent == venv / "bin", shebang
    site = _site(venv)
    clean = _clean_env()
    proc = _run(script, "--version", cwd=tmp_path, env=clean)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpumon {VERSION}", proc.stdout + proc.stderr
    probe = ("import gpumon, gpumon_checks; from gpumon.registry import load_checks; "
             "print(gpumon.__file__); print(gpumon_checks.__file__); print(' '.join(load_checks()))")
    proc = _run(venv / "bin" / "python", "-c", probe, cwd=tmp_path, env=clean)
    assert proc.returncode == 0, proc.stderr
    where, checks_where, loaded = proc.stdout.splitlines()
    assert Path(where).is_relative_to(site) and Path(checks_where).is_relative_to(site), proc.stdout
    with zipfile.ZipFile(wheel) as whl:
        group = _dist_info(whl, "entry_points.txt").partition("[gpumon.checks]")[2].partition("[")[0]
    declared = re.findall(r"^(\w+) = ", group, re.M)
    assert sorted(loaded.split()) == sorted(declared) and len(declared) >= 19


def test_slurm_wrapper_finds_the_venv_without_the_link(tmp_path: Path) -> None:
    """slurmd gives the health check no PATH: without the optional /usr/local/bin link the
    wrapper must still find /opt/gpumon/bin/gpumon. The test's /opt and /usr/local/bin are bind
    mounts in a private mount namespace (root only), so the host's stay untouched."""
    unshare = need_tool("unshare", "util-linux")
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("needs root for a private mount namespace")
        pytest.skip("needs root for a private mount namespace")
    opt = tmp_path / "opt"
    (opt / "gpumon" / "bin").mkdir(parents=True)
    local_bin = tmp_path / "local-bin"
    local_bin.mkdir()
    on_path = tmp_path / "path"
    on_path.mkdir()
    mark = tmp_path / "ran"
    stub = '#!/bin/sh\nprintf "%s\\n" "$0" >"$GPUMON_TEST_MARK"\necho \'{"status": "ok"}\'\nexit 0\n'
    (opt / "gpumon" / "bin" / "gpumon").write_text(stub)
    (opt / "gpumon" / "bin" / "gpumon").chmod(0o755)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURMD_NODENAME": "gpu03",
           "GPUMON_HC_DEFAULTS": str(tmp_path / "no-defaults"), "TMPDIR": str(tmp_path),
           "GPUMON_TEST_MARK": str(mark)}
    inner = ('mount --bind "$1" /opt && mount --bind "$2" /usr/local/bin || exit 99\n'
             'PATH=$3; export PATH; exec /bin/sh "$4"')

    def wrapper() -> subprocess.CompletedProcess[str]:
        mark.unlink(missing_ok=True)
        return _run(unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", inner, "sh",
                    opt, local_bin, on_path, WRAPPER, env=env)

    proc = wrapper()
    if proc.returncode == 99:
        why = f"cannot bind-mount in a private mount namespace here: {proc.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(why)  # CI runs as root, where this works: a skip there would hide the test
        pytest.skip(why)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mark.read_text().strip() == "/opt/gpumon/bin/gpumon"

    # a gpumon on PATH (the link, a site's own) comes first
    (on_path / "gpumon").write_text(stub)
    (on_path / "gpumon").chmod(0o755)
    proc = wrapper()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert mark.read_text().strip() == str(on_path / "gpumon")

    # neither: the wrapper says which command it could not start
    (on_path / "gpumon").unlink()
    (opt / "gpumon" / "bin" / "gpumon").unlink()
    proc = wrapper()
    assert proc.returncode == 1 and "/opt/gpumon/bin/gpumon" in proc.stdout, proc.stdout + proc.stderr
    assert not mark.exists()


def test_every_package_of_the_checkout_is_in_the_wheel(wheel: Path) -> None:
    """A package pyproject does not list is silently left out of the wheel (it imports from a
    checkout, not on a node): every folder with an __init__.py under gpumon/ and checks/ must be there."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    missing = []
    for top, installed_as in (("gpumon", "gpumon"), ("checks", "gpumon_checks")):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.relative_to(ROOT / top).as_posix()
            if f"{installed_as}/{rel}" not in names:
                missing.append(f"{top}/{rel}")
    assert not missing, f"packages missing from the wheel (setup.py finds them): {missing}"
    # the data the packages read at run time (importlib.resources): the config, profiles, scenarios
    data = {p.relative_to(ROOT / "config").as_posix() for p in (ROOT / "config").rglob("*")
            if p.is_file() and p.suffix in (".yaml", ".json")}
    assert data and not {f"gpumon_config/{d}" for d in data} - names
    assert "gpumon/sim/nvml_inject/nvml_inject.c" in names and "gpumon/export/nvhcd/nvhcd.proto" in names
    # the query API's OpenAPI document the daemon serves at /api/v1/openapi.json
    assert "gpumon/export/openapi-v1.json" in names
    # the verdict schema the node's guard check validates every spool file against
    schemas = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gpumon").rglob("*.schema.json")}
    assert "gpumon/guard/schema/verdict-v1.schema.json" in schemas and not schemas - names


def test_a_new_check_package_is_in_the_wheel_and_registered_without_listing_it(wheel: Path) -> None:
    """A ``checks/<x>/`` package added to the checkout, and a subpackage of gpumon, are in the
    wheel, and the check's entry point with them, with nothing else edited (a package list written
    by hand left one out once; setup.py finds both)."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        entry_points = _dist_info(whl, "entry_points.txt")
    files = [f"gpumon_checks/{NEW_CHECK}/{rel}" for rel in NEW_CHECK_FILES]
    for path in (*files, "gpumon/zz_new_sub/logic.py"):
        assert path in names, path
    registered = f"{NEW_CHECK} = gpumon_checks.{NEW_CHECK}.check:ZzNewCheck"
    assert registered in entry_points.splitlines(), entry_points


def test_every_check_entry_point_loads_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    """Each ``gpumon.checks`` entry point of the wheel, imported from the unpacked wheel (not the
    checkout: the interpreter is isolated from it, the test venv lends only the dependencies) is
    the gpumon Check class of that name."""
    unpacked = tmp_path / "whl"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(unpacked)
    (info,) = unpacked.glob("*.dist-info")
    # -I: no PYTHONPATH, no user site, no working directory on sys.path; -S: no site-packages (the
    # checkout's editable install is there), which come back last, as plain paths, for the
    # dependencies only
    deps = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    probe = f"""
import sys
from importlib.metadata import PathDistribution
from pathlib import Path
sys.path[:0] = [{str(unpacked)!r}]
sys.path += {deps!r}
from gpumon.check import Check
bad = []
eps = [ep for ep in PathDistribution(Path({str(info)!r})).entry_points if ep.group == "gpumon.checks"]
for ep in eps:
    try:
        obj = ep.load()
    except Exception as exc:
        bad.append(f"{{ep.name}}: {{type(exc).__name__}}: {{exc}}")
        continue
    where = sys.modules[obj.__module__].__file__ or ""
    if not (isinstance(obj, type) and issubclass(obj, Check) and obj.name == ep.name):
        bad.append(f"{{ep.name}}: {{obj!r}} is not the Check named {{ep.name}}")
    elif not where.startswith({str(unpacked)!r}):
        bad.append(f"{{ep.name}}: loaded from {{where}}, not the wheel")
print(len(eps))
print("\\n".join(bad))
"""
    proc = _run(sys.executable, "-I", "-S", "-c", probe, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    count, _, bad = proc.stdout.partition("\n")
    assert int(count) >= 20 and not bad.strip(), proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metrics(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())
    except OSError:
        return ""


def _value(text: str, family: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"gpumon_{family}{{"):
            return float(line.rpartition(" ")[2])
    return None


def _daemon_until(venv: Path, tmp_path: Path, want: Callable[[str], bool]) -> str:
    """The wheel's ``gpumon daemon`` on a simulated node (its widget line 1 s in) until its
    /metrics satisfy ``want``; then SIGTERM, which saves every check's state on the way out."""
    port = _free_port()
    scenario = tmp_path / "widget.yaml"
    scenario.write_text("name: widget\nsku: h100-sxm\nfaults:\n"
                        "  - {at_s: 1, kind: kernel_line, text: 'zz-gadget 3: stuck'}\n")
    config = tmp_path / "gpumon.yaml"
    config.write_text(f"checks:\n  {NEW_CHECK}:\n    marker: zz-gadget\n")
    cmd = [venv / "bin" / "gpumon", "daemon", "--config", config, "--simulate", scenario,
           "--sim-dir", tmp_path / "sim", "--listen", f"127.0.0.1:{port}"]
    with subprocess.Popen([str(c) for c in cmd], cwd=tmp_path, env=_clean_env(), text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            text, deadline = "", time.monotonic() + 60
            while time.monotonic() < deadline and not want(text) and proc.poll() is None:
                time.sleep(0.3)
                text = _metrics(port)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            assert proc.stderr is not None
            err = proc.stderr.read()
    assert want(text), err[-3000:]
    return text


def test_a_new_check_folder_loads_runs_exports_and_keeps_its_state_from_the_wheel(
        wheel: Path, tmp_path: Path) -> None:
    """The issue's acceptance: a continuous check package added to checks/ (options, saved state,
    readings, kernel-log use; NEW_CHECK_SOURCE) and nothing else edited; installed from the wheel,
    the daemon loads it, hands it its option and the kernel line it declared, exports its readings
    with their declared HELP, saves its state and reads it back after a restart."""
    venv = _venv(tmp_path / "venv", wheel)

    def seen(text: str) -> bool:
        return (_value(text, "zz_new_marker_lines_total") == 1.0
                and (_value(text, "zz_new_runs_total") or 0) >= 3)

    text = _daemon_until(venv, tmp_path, seen)
    lines = text.splitlines()
    assert ("# HELP gpumon_zz_new_runs_total Runs of the zz_new_check test check, kept across restarts. "
            "Unit: runs. Source: the check's own saved state.") in lines
    assert "# TYPE gpumon_zz_new_marker_lines_total counter" in lines
    assert f'gpumon_finding_severity{{check="{NEW_CHECK}",component="node"}} 3.0' in lines  # warn
    saved = json.loads((tmp_path / "sim" / "state" / "checks" / f"{NEW_CHECK}.json").read_text())
    assert saved["lines"] == 1 and saved["runs"] >= 3, saved

    # restarted: the state read back (runs go on from the saved count, the line is not counted again)
    def resumed(text: str) -> bool:
        return (_value(text, "zz_new_runs_total") or 0) > saved["runs"]

    text = _daemon_until(venv, tmp_path, resumed)
    assert _value(text, "zz_new_marker_lines_total") == 1.0, text
