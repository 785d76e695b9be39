"""A bundle another user could have written is not replayed with root's privileges.

Jobs keep replay bundles under the guard's spool, and a capture bundle names code to import: replayed
by root as it is, any local user's code would run as root. Real bundles (``capture`` of a model whose
factory writes the uid, gid and groups it runs under next to its code), really owned by ``nobody``
(``os.chown``: the tests run as root), replayed through the real CLI, runner and daemon check.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pwd
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import clean_env
from gpumon.model import Severity
from gpumon.sdc import cli as canary_cli
from gpumon.sdc.runner import CanaryError, Options, run
from gpumon_checks.sdc_canary import SdcCanaryCheck, SdcCanaryConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to nobody: needs root")

MODEL = '''\
import os
from pathlib import Path

import torch


def make():
    # who runs this code: the test reads it back from beside the code (out/uid)
    with open(Path(__file__).resolve().parent.parent / "out" / "uid", "a") as fh:
        fh.write(f"{os.getuid()} {os.geteuid()} {os.getgid()} {sorted(os.getgroups())}\\n")
    return torch.nn.Linear(4, 2)


def loss(model, batch):
    return model(batch["x"]).square().mean()
'''


def nobody() -> tuple[int, int]:
    pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def chown_tree(path: Path, uid: int, gid: int) -> None:
    os.chown(path, uid, gid)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(Path(root, name), uid, gid, follow_symlinks=False)


@dataclasses.dataclass
class Layout:
    """``base/code/<module>.py`` (the model), ``base/bundle`` (its captured step), ``base/out/uid``
    (what the model's factory writes: ``uid euid gid [groups]``, one line per run)."""

    base: Path

    @property
    def bundle(self) -> Path:
        return self.base / "bundle"

    @property
    def code(self) -> Path:
        return next((self.base / "code").glob("*.py"))

    @property
    def ran_as(self) -> list[str]:
        uid = self.base / "out" / "uid"
        return uid.read_text().splitlines() if uid.exists() else []


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One captured bundle, copied for each test (a capture replays the step twice)."""
    from gpumon.sdc import capture

    base = tmp_path_factory.mktemp("template")
    (base / "code").mkdir()
    (base / "out").mkdir()
    name = f"gpumon_trust_model_{os.getpid()}"
    file = base / "code" / f"{name}.py"
    file.write_text(MODEL)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # callable_ref finds the module's file through sys.modules
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.make()
    capture(base / "bundle", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            batch={"x": torch.randn(3, 4)}, loss_fn=module.loss, model_factory=module.make)
    del sys.modules[name]
    return base


@pytest.fixture
def layout(template: Path) -> Iterator[Layout]:
    """A copy of the template under a folder ``nobody`` can enter (pytest's own tmp is root's 0700),
    its manifest naming the copy's code file."""
    base = Path(tempfile.mkdtemp(prefix="gpumon-trust-test-"))
    try:
        base.chmod(0o755)
        for part in ("bundle", "code"):
            shutil.copytree(template / part, base / part)
        (base / "out").mkdir()
        manifest_file = base / "bundle" / "manifest.json"
        manifest = json.loads(manifest_file.read_text())
        copy = str(next((base / "code").glob("*.py")))
        for key in ("model_factory", "loss_fn"):
            manifest[key]["file"] = copy
        manifest_file.write_text(json.dumps(manifest))
        yield Layout(base)
    finally:
        shutil.rmtree(base)


def replay(layout: Layout, *flags: str) -> int:
    return canary_cli._standalone(["replay", str(layout.bundle), "--device", "cpu", "--workers", "1",
                                   "--state-dir", str(layout.base / "state"), *flags])


def test_root_refuses_a_bundle_of_another_user_and_trust_replays_it(
        layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    uid, gid = nobody()
    chown_tree(layout.bundle, uid, gid)
    chown_tree(layout.code.parent, uid, gid)
    assert replay(layout) == 3
    err = capsys.readouterr().err
    assert (f"gpumon: canary: refusing bundle {layout.bundle}: the bundle folder {layout.bundle} is owned by "
            f"uid {uid} (nobody), not by root") in err, err
    assert "--trust (as it is, with your privileges)" in err
    assert f"--as-owner (as its owner, uid {uid} (nobody), without them)" in err
    assert layout.ran_as == []  # nothing of the bundle ran
    # the operator looked at it: --trust replays it as it is, as root
    assert replay(layout, "--trust") == 0, capsys.readouterr()
    assert [line.split()[:2] for line in layout.ran_as] == [["0", "0"]]


def test_a_root_bundle_replays_and_one_world_writable_file_in_it_is_refused(
        layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay(layout) == 0, capsys.readouterr()
    assert len(layout.ran_as) == 1
    state = layout.bundle / "state.pt"
    state.chmod(0o666)
    assert replay(layout) == 3
    err = capsys.readouterr().err
    assert (f"the file {state} is writable by others (mode 0666): they could change it between this check "
            "and the replay") in err, err
    assert "--trust" in err
    assert len(layout.ran_as) == 1  # not run again


def test_code_another_user_can_change_is_refused_in_a_root_bundle(layout: Layout,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The bundle is root's; the code file its manifest names is not: ``canary replay`` and
    ``canary run --bundle`` refuse it, naming the file."""
    uid, gid = nobody()
    os.chown(layout.code, uid, gid)
    assert replay(layout) == 3
    err = capsys.readouterr().err
    assert f"the file {layout.code}, model_factory's code, is owned by uid {uid} (nobody), not by root" in err
    assert canary_cli._standalone(["run", "--bundle", str(layout.bundle), "--device", "cpu", "--workers", "1",
                                   "--state-dir", str(layout.base / "state")]) == 3
    assert f"model_factory's code, is owned by uid {uid} (nobody)" in capsys.readouterr().err
    # a .pyc planted beside root's code would be imported instead of it: the folder and the
    # compiled copies count as the code
    from gpumon.sdc.trust import UntrustedBundle, check_bundle

    os.chown(layout.code, 0, 0)
    cache = layout.code.parent / "__pycache__"
    cache.mkdir(exist_ok=True)
    planted = cache / f"{layout.code.stem}.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"
    planted.write_bytes(b"")
    os.chown(planted, uid, gid)
    with pytest.raises(UntrustedBundle, match="a compiled copy of model_factory's code, is owned by uid"):
        check_bundle(layout.bundle)
    assert layout.ran_as == []


def test_a_symlink_out_of_the_bundle_and_a_folder_above_it_of_another_user_are_refused(
        layout: Layout, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = layout.base / "elsewhere.pt"
    shutil.move(layout.bundle / "state.pt", elsewhere)
    (layout.bundle / "state.pt").symlink_to(elsewhere)
    assert replay(layout) == 3
    err = capsys.readouterr().err
    assert f"{layout.bundle / 'state.pt'} leads out of the bundle, to {elsewhere}" in err, err
    assert layout.ran_as == []
    from gpumon.sdc.trust import UntrustedBundle, check_bundle

    (layout.bundle / "state.pt").unlink()
    shutil.move(elsewhere, layout.bundle / "state.pt")
    (layout.bundle / "alias.pt").symlink_to("state.pt")  # inside the bundle: fine
    assert check_bundle(layout.bundle).folder == layout.bundle
    # a root bundle in a folder another user owns: they could swap it for theirs after the check
    uid, gid = nobody()
    os.chown(layout.base, uid, gid)
    with pytest.raises(UntrustedBundle, match=f"the folder {layout.base}, on the way to {layout.bundle}, is "
                                              f"owned by uid {uid}"):
        check_bundle(layout.bundle)


def test_a_module_name_is_refused_where_another_user_could_plant_it(layout: Layout,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest names the model's module too: found along sys.path, a folder searched before
    it where others can write would let them put theirs first."""
    from gpumon.sdc.trust import UntrustedBundle, check_bundle

    monkeypatch.syspath_prepend(str(layout.code.parent))
    checked = check_bundle(layout.bundle)
    assert "model_factory" not in checked.code  # imported by its module name, found in a checked place
    shared = layout.base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.syspath_prepend(str(shared))
    with pytest.raises(UntrustedBundle, match=f"the folder {shared}, on sys.path .*, is writable by "
                                              r"others \(mode 1777\): a module gpumon_trust_model_\d+ put "
                                              "there would be imported instead"):
        check_bundle(layout.bundle)


def test_the_runner_checks_bundles_itself(layout: Layout) -> None:
    """Every caller of the runner (benchmarks, the API) gets the check, not the CLI alone."""
    uid, gid = nobody()
    chown_tree(layout.bundle, uid, gid)
    with pytest.raises(CanaryError, match=f"refusing bundle {layout.bundle}: the bundle folder"):
        run(Options(workers=1, bundles=(layout.bundle,), device="cpu"))
    assert layout.ran_as == []


def test_the_daemon_check_refuses_an_untrusted_bundle_and_runs_the_rest(layout: Layout, sim: Any) -> None:
    uid, gid = nobody()
    chown_tree(layout.bundle, uid, gid)
    h = sim("name: t\nsku: h100-sxm\ngpus: 2\n")
    ctx = h.context(SdcCanaryCheck, 1.0)
    ctx.options = dataclasses.replace(SdcCanaryConfig(), iterations=1, device="cpu", workloads=["gemm_fp32"],
                                     bundles=[str(layout.bundle)], bundle_dir=str(layout.base / "kept"))
    found = SdcCanaryCheck().run(ctx)
    [refused] = [f for f in found if f.component == "node"]
    assert refused.severity is Severity.UNKNOWN
    assert f"refusing bundle {layout.bundle}: the bundle folder {layout.bundle} is owned by uid {uid}" in \
        refused.message
    assert f"gpumon canary replay --as-owner {layout.bundle}" in refused.message
    assert (refused.evidence["path"], refused.evidence["owner_uid"]) == (str(layout.bundle), uid)
    assert {(f.component, f.severity) for f in found if f.component != "node"} == {
        ("gpu/0", Severity.OK), ("gpu/1", Severity.OK)}
    assert layout.ran_as == []
    # without the built-in workload, the refused bundle was all there was to run: nothing runs
    ctx.options = dataclasses.replace(ctx.options, workloads=[])
    assert [(f.component, f.severity) for f in SdcCanaryCheck().run(ctx)] == [("node", Severity.UNKNOWN)]


# -- --as-owner ------------------------------------------------------------------------------------

def _runs_as_nobody(python: str) -> bool:
    uid, gid = nobody()
    try:
        proc = subprocess.run([python, "-c", "import gpumon, torch"], user=uid, group=gid, extra_groups=[],
                              cwd="/", capture_output=True, timeout=120)
    except PermissionError:
        return False
    return proc.returncode == 0


@pytest.fixture(scope="module")
def owner_python() -> Iterator[str]:
    """An interpreter with this one's packages that nobody can run too: --as-owner starts the
    owner's replay with ``sys.executable``. This one, unless it lives where nobody cannot go (a
    pyenv under /root): then the system's of the same version, seeing the same packages."""
    if _runs_as_nobody(sys.executable):
        yield sys.executable
        return
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(f"nobody cannot run {sys.executable}, and there is no {system}")
    venv = Path(tempfile.mkdtemp(prefix="gpumon-trust-venv-"))
    try:
        venv.chmod(0o755)
        subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        [lib] = (venv / "lib").glob("python3*")
        (lib / "site-packages" / "gpumon_test_packages.pth").write_text(
            "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
        python = str(venv / "bin" / "python")
        if not _runs_as_nobody(python):
            pytest.skip(f"nobody can run neither {sys.executable} nor {python} with gpumon and torch")
        yield python
    finally:
        shutil.rmtree(venv)


def test_as_owner_replays_as_the_owner_without_root(layout: Layout, owner_python: str) -> None:
    uid, gid = nobody()
    for path in (layout.bundle, layout.code.parent, layout.base / "out"):
        chown_tree(path, uid, gid)
    proc = subprocess.run([owner_python, "-m", "gpumon", "canary", "replay", str(layout.bundle), "--as-owner",
                           "--device", "cpu", "--workers", "1", "--json"],
                          capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"replaying {layout.bundle} as its owner, uid {uid} (nobody)" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok" and doc["findings"][0]["message"].startswith("bit-exact")
    # nobody's uid, group and no other group: not a bit of root's
    assert layout.ran_as == [f"{uid} {uid} {gid} []"]
