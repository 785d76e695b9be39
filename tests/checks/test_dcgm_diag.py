"""The dcgm_diag check on a simulated node, with DCGM played by small real programs.

``dcgmi`` is an executable on a temporary PATH (handed over through the ToolRunner's search_path)
that replays a real ``dcgmi diag`` capture from tests/data/dcgmi-diag (provenance in its SOURCES.md).
DCGM's Python bindings are played by a temporary bindings directory whose modules stand in for
DCGM's ``pydcgm``/``DcgmDiag``/``dcgm_structs``/``dcgm_fields`` with the names and the response layout
of DCGM 4 (``dcgmDiagResponse_v12``: tests[].resultIndices/errorIndices, results[].entity/result,
errors[].entity/msg/code); they test gpumon's child-process runner and its conversion, not DCGM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fake_tools import fake_dcgmi

from gpumon.hw import dcgm
from gpumon.hw.tools import ToolRunner
from gpumon.model import Action, Finding, Severity
from gpumon_checks.dcgm_diag import DcgmDiagCheck, DcgmDiagConfig, action_for

DATA = Path(__file__).resolve().parents[1] / "data" / "dcgmi-diag"


def run(sim: Callable[..., Any], tmp_path: Path, bin_dir: Path | None, gpus: int = 2,
        options: DcgmDiagConfig | None = None) -> list[Finding]:
    h = sim(f"name: dcgm\nsku: h100-sxm\ngpus: {gpus}\n")
    ctx = h.context(DcgmDiagCheck, 0.0)
    ctx.hw.tools = ToolRunner(30, search_path=str(bin_dir if bin_dir else tmp_path / "empty"))
    ctx.options = options or DcgmDiagConfig(bindings_dirs=[str(tmp_path / "no-bindings")])
    assert DcgmDiagCheck().supported(ctx.inventory) is None
    return DcgmDiagCheck().run(ctx)


def by(findings: list[Finding]) -> dict[str, Finding]:
    out: dict[str, Finding] = {}
    for f in findings:
        assert f.component not in out, f.component
        out[f.component] = f
    return out


def test_gpu_memory_failure_busy_gpu_dcgm_3_3(sim: Callable[..., Any], tmp_path: Path) -> None:
    text = (DATA / "issue_go-dcgm-52_dcgm3.3.1_t4_r2_gpu-memory-fail_cuda-busy_FRAGMENT.txt").read_text()
    bin_dir, log = fake_dcgmi(tmp_path, text, exit_code=226)
    f = by(run(sim, tmp_path, bin_dir))
    assert log.read_text() == "diag -r 2 -j\n"
    assert (f["gpu/0"].severity, f["gpu/0"].action) == (Severity.FAIL, Action.RESET_GPU)
    assert f["gpu/0"].message.startswith("GPU 0: DCGM diagnostic failed: GPU Memory (GPU 0 Error using CUDA "
                                         "API cuCtxCreate")
    assert f["gpu/0"].evidence["tests"] == {"GPU Memory": "fail"} and f["gpu/0"].evidence["exit_code"] == 226
    assert (f["gpu/1"].severity, f["gpu/1"].message) == (Severity.OK, "GPU 1: DCGM diagnostic passed "
                                                                      "(1 test(s) passed)")
    # a fragment: what came after the cut is not judged, and that is said
    assert f["node"].severity is Severity.UNKNOWN
    assert f["node"].message.startswith("DCGM's output is incomplete (no closing border after the last row")


def test_pcie_fail_all_with_nvlink_down_dcgm_2_4(sim: Callable[..., Any], tmp_path: Path) -> None:
    text = (DATA / "issue_dcgm-49_dcgm2.4.6_a100_r2_pcie-fail-all_nvlink-down-warnings_FRAGMENT.txt"
            ).read_text()
    bin_dir, _ = fake_dcgmi(tmp_path, text)
    f = by(run(sim, tmp_path, bin_dir))
    # "Fail - All": every GPU fails; the warnings name GPU 0's NVLinks down (as the nvlink check: reboot)
    assert (f["gpu/0"].severity, f["gpu/0"].action) == (Severity.FAIL, Action.REBOOT_NODE)
    assert "NvLink link 0 is currently down" in f["gpu/0"].message
    assert (f["gpu/1"].severity, f["gpu/1"].action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f["gpu/1"].message == "GPU 1: DCGM diagnostic failed: PCIe"
    assert f["node"].severity is Severity.UNKNOWN


def test_dcgm_4_table_passes_with_the_cut_reported(sim: Callable[..., Any], tmp_path: Path) -> None:
    text = (DATA / "issue_dcgm-253_dcgm4.2.3_l40s_r-table_new-4x-format_PARTIAL.txt").read_text()
    bin_dir, _ = fake_dcgmi(tmp_path, text)
    f = by(run(sim, tmp_path, bin_dir, gpus=4))
    for i in range(4):
        assert f[f"gpu/{i}"].severity is Severity.OK
        assert f[f"gpu/{i}"].evidence["tests"] == {"software": "pass", "memory": "pass"}
        assert f[f"gpu/{i}"].evidence["dcgm_version"] == "4.2.3"
    assert f["node"].severity is Severity.UNKNOWN


def test_json_fragment_is_unknown_with_the_reason(sim: Callable[..., Any], tmp_path: Path) -> None:
    text = (DATA / "issue_dcgm-139_dcgm3.3.1_t400_diag-r3-json_skip_FRAGMENT.txt").read_text()
    bin_dir, _ = fake_dcgmi(tmp_path, text)
    [f] = run(sim, tmp_path, bin_dir)
    assert (f.component, f.severity) == ("node", Severity.UNKNOWN)
    assert f.message.startswith("could not read the output of dcgmi diag -r 2 -j: not valid JSON (line 6, "
                                "column 10")


def test_every_test_skipped_is_skipped(sim: Callable[..., Any], tmp_path: Path) -> None:
    # the T400 JSON with the reporter's elision removed and the array closed: every test "Skip"
    text = (DATA / "issue_dcgm-139_dcgm3.3.1_t400_diag-r3-json_skip_FRAGMENT.txt").read_text()
    repaired = text.replace('\t\t\t{"..."},\n', "").rstrip().rstrip(",") + "\n\t\t]\n\t}\n}\n"
    bin_dir, _ = fake_dcgmi(tmp_path, repaired)
    findings = run(sim, tmp_path, bin_dir, gpus=1)
    [f] = findings
    assert (f.component, f.severity) == ("gpu/0", Severity.SKIPPED)
    assert f.message == "GPU 0: DCGM skipped every test (4): not supported on this GPU"


def test_dcgmi_that_cannot_reach_the_hostengine(sim: Callable[..., Any], tmp_path: Path) -> None:
    said = "Error: unable to establish a connection to the specified host: localhost\n"
    bin_dir, _ = fake_dcgmi(tmp_path, said, exit_code=255, stderr="Error: Unable to connect to host engine. "
                            "Host engine connection invalid/disconnected.")
    [f] = run(sim, tmp_path, bin_dir)
    assert (f.component, f.severity) == ("node", Severity.UNKNOWN)
    assert "no dcgmi diag table" in f.message and "Unable to connect to host engine" in f.message


def test_hung_dcgmi_is_a_failure(sim: Callable[..., Any], tmp_path: Path) -> None:
    bin_dir, _ = fake_dcgmi(tmp_path, "{}", sleep=10)
    [f] = run(sim, tmp_path, bin_dir, options=DcgmDiagConfig(bindings_dirs=[], diag_timeout_s=0.5))
    assert (f.component, f.severity) == ("node", Severity.FAIL)
    assert f.message.startswith("DCGM diagnostic did not finish within 0.5 s (killed)")


def test_no_dcgm_is_skipped_with_the_reason(sim: Callable[..., Any], tmp_path: Path) -> None:
    [f] = run(sim, tmp_path, None)
    assert (f.component, f.severity) == ("node", Severity.SKIPPED)
    assert f.message == ("DCGM is not installed: no dcgmi on PATH and no Python bindings in "
                         f"{tmp_path}/no-bindings")


# --------------------------------------------------------------------------- through DCGM's bindings

_STANDIN = {
    "dcgm_structs.py": """
DCGM_DIAG_RESULT_PASS, DCGM_DIAG_RESULT_SKIP, DCGM_DIAG_RESULT_WARN = 0, 1, 2
DCGM_DIAG_RESULT_FAIL, DCGM_DIAG_RESULT_NOT_RUN = 3, 4
""",
    "dcgm_fields.py": "DCGM_FE_GPU = 1\nDCGM_FE_CPU = 7\n",
    "pydcgm.py": """
import json, os
class DcgmHandle:
    def __init__(self, ipAddress=None):
        self.handle = 42
        self.mode = "standalone" if ipAddress else "embedded"
""",
    "DcgmDiag.py": """
import json, os
class _O:
    def __init__(self, **kw):
        self.__dict__.update(kw)
class DcgmDiag:
    def __init__(self, gpuIds=None, testNamesStr=""):
        with open(os.environ["GPUMON_TEST_DCGM_LOG"], "a") as fh:
            fh.write(json.dumps({"gpuIds": gpuIds, "level": testNamesStr}) + "\\n")
    def Execute(self, handle):
        gpu = lambda i: _O(entityGroupId=1, entityId=i)
        results = [_O(entity=gpu(0), result=0), _O(entity=gpu(1), result=3), _O(entity=_O(entityGroupId=7,
                   entityId=0), result=0)]
        errors = [_O(entity=gpu(1), msg="GPU 1 memory: 3 bad pages found", code=80)]
        tests = [_O(name="memory", result=3, numResults=3, resultIndices=[0, 1, 2], numErrors=1,
                    errorIndices=[0])]
        return _O(numTests=1, tests=tests, results=results, errors=errors)
""",
}


def standin_bindings(tmp_path: Path, broken: bool = False) -> Path:
    d = tmp_path / "bindings" / "python3"
    d.mkdir(parents=True)
    for name, text in _STANDIN.items():
        (d / name).write_text(text)
    if broken:
        (d / "pydcgm.py").write_text("raise OSError('libdcgm.so.4: cannot open shared object file')\n")
    return d


def test_bindings_run_in_a_child_and_are_read_as_dcgm_4_json(sim: Callable[..., Any], tmp_path: Path,
                                                             monkeypatch: Any) -> None:
    log = tmp_path / "bindings.log"
    monkeypatch.setenv("GPUMON_TEST_DCGM_LOG", str(log))
    bindings = standin_bindings(tmp_path)
    assert dcgm.find_bindings([str(tmp_path / "nowhere"), str(bindings)]) == bindings
    f = by(run(sim, tmp_path, None, options=DcgmDiagConfig(bindings_dirs=[str(bindings)])))
    assert json.loads(log.read_text()) == {"gpuIds": [0, 1], "level": "2"}
    assert f["gpu/0"].severity is Severity.OK
    assert (f["gpu/1"].severity, f["gpu/1"].action) == (Severity.FAIL, Action.INSPECT_HARDWARE)
    assert f["gpu/1"].message == "GPU 1: DCGM diagnostic failed: memory (GPU 1 memory: 3 bad pages found)"
    assert f["gpu/1"].evidence["source"] == f"DCGM Python bindings ({bindings})"


def test_unusable_bindings_fall_back_to_dcgmi(sim: Callable[..., Any], tmp_path: Path) -> None:
    bindings = standin_bindings(tmp_path, broken=True)
    text = (DATA / "issue_dcgm-253_dcgm4.2.3_l40s_r-table_new-4x-format_PARTIAL.txt").read_text()
    bin_dir, log = fake_dcgmi(tmp_path, text)
    f = by(run(sim, tmp_path, bin_dir, gpus=4, options=DcgmDiagConfig(bindings_dirs=[str(bindings)])))
    assert log.read_text() == "diag -r 2 -j\n"
    assert f["gpu/0"].severity is Severity.OK and f["gpu/0"].evidence["source"] == "dcgmi diag -r 2 -j"
    [note] = f["gpu/0"].evidence["notes"]
    assert note.startswith(f"DCGM's bindings in {bindings} not usable here: gpumon-dcgm: cannot import "
                           "DCGM's bindings: OSError: libdcgm.so.4")


def test_actions_follow_what_failed() -> None:
    def t(name: str) -> dcgm.DiagTest:
        return dcgm.DiagTest("Deployment", name)

    assert action_for(t("Persistence Mode"), []) is Action.NONE
    assert action_for(t("software"), []) is Action.NONE
    assert action_for(t("Graphics Processes"), []) is Action.RESTART_APP
    assert action_for(t("Page Retirement/Row Remap"), []) is Action.RESET_GPU
    assert action_for(t("Inforom"), []) is Action.INSPECT_HARDWARE
    assert action_for(t("Diagnostic"), []) is Action.INSPECT_HARDWARE
    busy = ["CUDA-capable device(s) is/are busy or unavailable"]
    assert action_for(t("Diagnostic"), busy) is Action.RESET_GPU
