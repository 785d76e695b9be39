"""``pip install gpumon-node`` installs light (issue 34): what a training image that imports
``gpumon.guard`` gets, and what a node gets when its config asks for a backend whose extra is missing.

One fresh venv for the module (``python -m venv``, nothing of the test interpreter's site-packages):
the wheel of this checkout installed by that venv's own pip without extras (its core dependencies
from the index, pip's cache allowed) and torch beside it, the two packages of a training image.
torch is pinned to the test interpreter's exact version (``2.13.0+cpu`` here, served by pip's
find-links): a pin with the local label cannot be met by the index's multi-GB CUDA build. The
module took 40-80 s on the shared 2-core test machine (load 7 to 12): the wheel ~4 s, the venv and
pip 17-40 s (torch's ~900 MB unpacked, not byte-compiled), the two ranks 10-30 s, the CLI runs ~5 s.

In that venv: a guarded DDP step on two gloo ranks over 127.0.0.1 (``Guard.step``, strict: any
internal error of the guard fails the step; it found that torch without numpy cannot run the guard,
hence numpy among gpumon-node's dependencies), the Kubernetes client and bcrypt absent (``pip list``,
``import``), and the CLI refusing a backend configured without its extra, naming the setting and
the extra, exit 3, no traceback.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import socket
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest
from wheel_build import build_wheel, copy_sources

from gpumon.distribution import ExtraMissing, install_hint, require

RANK_SCRIPT = r'''
import hashlib, importlib.util, json, os, sys
from pathlib import Path

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
import gpumon
from gpumon.guard import Guard

torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
guard = Guard(model, opt, weight_check_every=1, strict=True, timeout_s=60, spool_dir=out / "spool")
before = [p.detach().clone() for p in model.parameters()]
g = torch.Generator().manual_seed(100 + rank)  # each rank its own micro-batch: the all-reduce matters
x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
loss = torch.nn.functional.mse_loss(model(x), y)
loss.backward()
applied = guard.step(loss)
weights = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
loaded = sorted(m for m in ("kubernetes", "bcrypt") if m in sys.modules)
try:
    import kubernetes  # noqa: F401
    missing = None
except ModuleNotFoundError as exc:
    missing = exc.name
result = {"applied": applied, "steps": guard.steps, "disabled": guard.disabled,
          "verdicts": [str(p) for p in guard.verdict_files],
          "moved": any(not torch.equal(a, p) for a, p in zip(before, model.parameters())),
          "weights": weights, "loaded": loaded, "import_kubernetes_missing": missing,
          "bcrypt_spec": importlib.util.find_spec("bcrypt") is not None, "gpumon": gpumon.__file__}
(out / f"rank{rank}.json").write_text(json.dumps(result))
sys.stdout.flush()
# what is judged is written; gloo's threads are not torn down (tests/guard/ddp_ranks.py, "Known")
os._exit(0)
'''


def _run(*cmd: str | Path, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          **kw)  # type: ignore[call-overload]


def _env() -> dict[str, str]:
    # nothing of the checkout or the test interpreter's environment leaks into the fresh venv
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "GPUMON_GUARD_DIR", "SLURMD_NODENAME")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(copy_sources(tmp_path_factory.mktemp("src")), tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def light(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fresh venv: gpumon-node (no extras) and torch, installed by its own pip."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    proc = _run(sys.executable, "-m", "venv", venv, env=_env())
    assert proc.returncode == 0, proc.stderr
    # --no-compile: byte-compiling every file of torch was half of the install's time; only what the
    # ranks import is compiled, once, by this first import (two ranks importing at once compile it twice)
    proc = _run(venv / "bin" / "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", wheel,
                f"torch=={version('torch')}", timeout=600, cwd=venv, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    warm = "import torch.distributed, torch.nn.parallel, gpumon.guard.core"
    proc = _run(venv / "bin" / "python", "-c", warm, cwd=venv, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


def test_the_wheel_names_the_backends_libraries_as_extras(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        (member,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(whl.read(member).decode())
    requires = meta.get_all("Requires-Dist") or []
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"kubernetes", "basic-auth", "nvrx", "compute"} <= extras, extras
    for name, extra in (("kubernetes", "kubernetes"), ("bcrypt", "basic-auth")):
        lines = [r for r in requires if re.match(r"[\w.-]+", r)[0].lower() == name]  # type: ignore[index]
        # once for its extra, once for the test extra; never unconditional
        assert lines and all("extra ==" in r for r in lines), (name, lines)
        assert any(f'extra == "{extra}"' in r for r in lines), (name, lines)


def test_a_fresh_venv_with_gpumon_node_and_torch_runs_a_guarded_ddp_step(light: Path, tmp_path: Path) -> None:
    listed = _run(light / "bin" / "pip", "list", "--format=json", "--disable-pip-version-check", env=_env())
    assert listed.returncode == 0, listed.stderr
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"gpumon-node", "torch"} <= names, names
    assert not names & {"kubernetes", "bcrypt"}, names

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port, world = _free_port(), 2
    procs = [subprocess.Popen([str(light / "bin" / "python"), str(script), str(rank), str(world), str(port),
                               str(tmp_path)], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**_env(), "OMP_NUM_THREADS": "1"})
             for rank in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, logs, strict=True):
        assert p.returncode == 0, text[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert r["applied"] and r["steps"] == 1 and r["disabled"] is None and r["moved"], r
        assert r["verdicts"] == [], r
        assert r["loaded"] == [] and r["import_kubernetes_missing"] == "kubernetes", r
        assert not r["bcrypt_spec"], r
        assert Path(r["gpumon"]).is_relative_to(light), r  # the wheel's gpumon, not the checkout's
    # the guard did DDP's all-reduce (its own comm hook): the replicas, fed different data, agree
    assert results[0]["weights"] == results[1]["weights"]


def test_the_cli_runs_without_the_extras(light: Path, tmp_path: Path) -> None:
    gpumon = light / "bin" / "gpumon"
    proc = _run(gpumon, "--help", cwd=tmp_path, env=_env())
    assert proc.returncode == 0 and "daemon" in proc.stdout, proc.stdout + proc.stderr
    proc = _run(gpumon, "check", "--simulate", "healthy-8xh100", "--json", cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(proc.stdout)["status"] == "ok"


def _refused(proc: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a clean refusal (exit 3, no traceback)."""
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gpumon: configuration error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def _daemon(light: Path, tmp_path: Path, config: Path) -> subprocess.CompletedProcess[str]:
    # --duration: a daemon that did not refuse stops by itself (exit 0, which the test refuses)
    return _run(light / "bin" / "gpumon", "daemon", "--config", config, "--simulate", "healthy-8xh100",
                "--sim-dir", tmp_path / "sim", "--listen", f"127.0.0.1:{_free_port()}", "--duration", "10",
                cwd=tmp_path, env=_env())


def test_kubernetes_remediation_without_the_extra_is_refused_naming_it(light: Path, tmp_path: Path) -> None:
    config = tmp_path / "gpumon.yaml"
    config.write_text("remediation:\n  mode: observe\n  backend: kubernetes\n")
    line = _refused(_daemon(light, tmp_path, config))
    assert line == (f"gpumon: configuration error: {config}:3: remediation.backend: kubernetes needs the "
                    "kubernetes client, which is not installed: pip install 'gpumon-node[kubernetes]'")

    proc = _run(light / "bin" / "gpumon", "why", "--k8s-job", "ml/train", cwd=tmp_path, env=_env())
    assert _refused(proc) == ("gpumon: configuration error: --k8s-job: reading the job from Kubernetes needs "
                              "the kubernetes client, which is not installed: "
                              "pip install 'gpumon-node[kubernetes]'")


def test_basic_auth_without_the_extra_is_refused_naming_it(light: Path, tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    # the shape of a bcrypt hash is all the web config's reader checks before it needs bcrypt
    web.write_text("basic_auth_users:\n  prometheus: '$2b$04$" + "a" * 53 + "'\n")
    config = tmp_path / "gpumon.yaml"
    config.write_text(f"exporter:\n  web_config_file: {web}\n")
    line = _refused(_daemon(light, tmp_path, config))
    assert line == (f"gpumon: configuration error: {web}:1: basic_auth_users: basic auth needs bcrypt, which "
                    "is not installed: pip install 'gpumon-node[basic-auth]'")


def test_require_tells_a_missing_library_from_a_broken_one(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Real imports from a folder on sys.path: a package that is not there, and one that is there
    but whose own dependency is not (a broken install is not reported as "not installed")."""
    (tmp_path / "zz_broken_lib").mkdir()
    (tmp_path / "zz_broken_lib" / "__init__.py").write_text("import zz_its_missing_dependency\n")
    (tmp_path / "zz_fine_lib.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert require("zz_fine_lib", extra="x", library="fine", needed_by="a test").VALUE == 7
    with pytest.raises(ExtraMissing) as absent:
        require("zz_absent_lib", extra="zz-extra", library="the absent library", needed_by="a backend")
    assert str(absent.value) == ("a backend needs the absent library, which is not installed: "
                                 f"{install_hint('zz-extra')}")
    with pytest.raises(ExtraMissing) as broken:
        require("zz_broken_lib", extra="zz-extra", library="the broken library", needed_by="a backend")
    assert str(broken.value) == ("a backend needs the broken library, which does not import (No module "
                                 f"named 'zz_its_missing_dependency'): {install_hint('zz-extra')}")
