"""Parsers of dcgmi diag, perftest ib_*_bw and nccl-tests output, on every real capture.

Captures: tests/data/dcgmi-diag, tests/data/perftest, tests/data/nccl-tests (byte-for-byte copies of
shared/realdata, provenance in each folder's SOURCES.md). Each one either parses to the exact values
read from the file here, or gives a clear error / an incompleteness reason; none may crash.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.hw import dcgm, nccltests, perftest

DATA = Path(__file__).resolve().parents[1] / "data"
DCGM = DATA / "dcgmi-diag"
PERF = DATA / "perftest"
NCCL = DATA / "nccl-tests"


def _read(folder: Path, name: str) -> str:
    return (folder / name).read_text()


def _all(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix == ".txt")


def test_every_capture_is_listed_in_its_sources_file() -> None:
    for folder in (DCGM, PERF, NCCL):
        sources = (folder / "SOURCES.md").read_text()
        names = [p.name for p in _all(folder)]
        assert names and all(f"`{folder.name}/{n}`" in sources for n in names), folder


# --------------------------------------------------------------------------- perftest


def test_perftest_write_bw_gbits_partial() -> None:
    r = perftest.parse_bw(_read(PERF, "issue_perftest-132_ib_write_bw_-a_IB_mlx5_0_gbits_PARTIAL.txt"))
    assert (r.test, r.device, r.link_type, r.unit) == ("RDMA_Write BW Test", "mlx5_0", "IB", "Gb/sec")
    assert r.settings["Number of qps"] == "1" and r.settings["Mtu"] == "4096[B]"
    assert r.settings["rdma_cm QPs"] == "OFF"  # "rdma_cm QPs\t : OFF": a tab before the colon
    assert [(x.size, x.iterations, x.peak_gbps, x.average_gbps, x.msg_rate_mpps) for x in r.rows] == [
        (2, 5000, 0.042350, 0.042185, 2.636533),
        (4, 5000, 0.084507, 0.084457, 2.639276),
        (8, 5000, 0.17, 0.17, 2.641399),  # the 2-decimal row with tabs inside, as perftest prints it
    ]
    assert r.largest.size == 8
    assert not r.complete  # the paste ends after three rows: no closing rule


def test_perftest_post_list_roce_complete_table() -> None:
    r = perftest.parse_bw((PERF / "issue_perftest-273_ib_write_bw_postlist_8B_60s_gbits_complete-table.txt")
                          .read_text())
    assert (r.test, r.device, r.link_type) == ("RDMA_Write Post List BW Test", "ib0", "Ethernet")
    assert r.settings["GID index"] == "2" and r.settings["Post List"] == "128"
    [row] = r.rows
    assert (row.size, row.iterations, row.peak_gbps, row.average_gbps, row.msg_rate_mpps) == (
        8, 224958464, 0.0, 0.48, 7.498617)
    assert r.complete


def test_perftest_mb_per_second_is_converted_to_gbits() -> None:
    r = perftest.parse_bw((PERF / "issue_ucx-8852_ib_read_bw_-a_IB_mlx5_1_MBsec_PARTIAL.txt").read_text())
    assert (r.test, r.device, r.unit) == ("RDMA_Read BW Test", "mlx5_1", "MB/sec")
    assert [x.size for x in r.rows] == [2, 4, 8, 16, 32, 64, 128]
    last = r.rows[-1]
    # perftest's MB/sec is 2^20 bytes/s (format_factor 0x100000): 310.05 MB/s = 2.6009 Gb/s
    assert last.average_gbps == pytest.approx(310.05 * 1048576 * 8 / 1e9)
    assert last.peak_gbps == pytest.approx(310.13 * 1048576 * 8 / 1e9)
    # consistent with the message rate perftest printed on the same row: 2 B x 2.450225 Mpps
    first = r.rows[0]
    assert first.average_gbps == pytest.approx(2 * 2.450225e6 * 8 / 1e9, rel=0.05)


def test_perftest_without_a_result_table_is_a_clear_error() -> None:
    text = (" Couldn't connect to localhost:18515\n Unable to open file descriptor for socket connection"
            " Unable to init the socket connection\n")
    with pytest.raises(perftest.PerftestParseError, match=r"no bandwidth table.*Couldn't connect"):
        perftest.parse_bw(text)
    header_only = (PERF / "issue_perftest-132_ib_write_bw_-a_IB_mlx5_0_gbits_PARTIAL.txt").read_text()
    cut = header_only[: header_only.index(" 2          5000")]
    with pytest.raises(perftest.PerftestParseError, match="header but no result rows"):
        perftest.parse_bw(cut)


# --------------------------------------------------------------------------- nccl-tests


def test_nccl_modern_table_gcp_a3mega() -> None:
    [r] = nccltests.parse_all((NCCL / "all_reduce_perf_gcp-a3mega_h100x16_2node_tcp.txt").read_text())
    assert r.collective == "all_reduce_perf"  # from the mpirun command line above the output
    assert r.settings["nGpus"] == "1" and r.settings["maxBytes"] == "8589934592"
    assert (r.settings["warmup iters"], r.settings["iters"], r.settings["agg iters"]) == ("5", "20", "1")
    assert len(r.ranks) == 16
    assert r.ranks[15] == nccltests.NcclRank(15, "ztan-mig-gq73", 7, "0000:8c:00", "NVIDIA H100 80GB HBM3")
    assert len(r.rows) == 31 and r.rows[0].size == 8 and r.rows[-1].size == 8589934592
    last = r.rows[-1]
    assert (last.count, last.dtype, last.redop, last.root) == (2147483648, "float", "sum", -1)
    assert last.out_of_place == nccltests.NcclPoint(47535.0, 180.71, 338.82, wrong=0)
    assert last.in_place == nccltests.NcclPoint(47743.0, 179.92, 337.35, wrong=0)
    assert r.busbw_at(1073741824) == 298.82 and r.peak_busbw_gbs == 338.82
    assert r.wrong_elements == 0 and not r.legacy
    assert (r.out_of_bounds, r.out_of_bounds_ok, r.avg_busbw_gbs) == (0, True, 70.742)
    assert r.complete and r.problem is None


def test_nccl_legacy_error_column_and_the_next_test_after_it() -> None:
    first, second = nccltests.parse_all((NCCL / "issue_nccl-340_legacy-format_2gpu_rtx2080ti_PARTIAL.txt")
                                        .read_text())
    assert first.legacy and len(first.rows) == 12
    row = first.rows[0]
    assert (row.size, row.count, row.dtype, row.redop, row.root) == (65536, 8192, "float", None, None)
    assert row.out_of_place == nccltests.NcclPoint(16.57, 1.98, 1.98, error=0.0)
    assert row.wrong is None and first.wrong_elements is None  # legacy rows carry a deviation, not a count
    assert first.rows[-1].busbw_gbs == 21.86
    assert (first.out_of_bounds, first.out_of_bounds_ok, first.avg_busbw_gbs) == (0, True, 6.6972)
    assert first.problem is None
    # the paste goes on into broadcast_perf's header: a second test with no rows, said so
    assert second.collective == "broadcast_perf" and second.settings["nGpus"] == "2"
    assert second.problem == "no result rows (the output ends after the settings line)"
    assert nccltests.parse(_read(NCCL, "issue_nccl-340_legacy-format_2gpu_rtx2080ti_PARTIAL.txt")) == first


def test_nccl_table_without_footer_says_it_was_cut_off() -> None:
    r = nccltests.parse((NCCL / "issue_nccl-1435_all_gather_perf_bf16_2gpu_table_PARTIAL.txt").read_text())
    assert not r.legacy and len(r.rows) == 7
    assert (r.rows[0].dtype, r.rows[0].redop, r.rows[0].root) == ("bfloat16", "none", -1)
    assert r.rows[3].in_place == nccltests.NcclPoint(256.5, 261.63, 130.82, wrong=0)
    assert r.problem == ("no '# Avg bus bandwidth' footer after 7 row(s): the output was cut off at "
                         "117440512 bytes")


def test_nccl_header_only_capture_of_nccl_tests_2_19() -> None:
    r = nccltests.parse(_read(NCCL, "issue_nccl-tests-389_b200x16_2node_all_reduce_header_PARTIAL.txt"))
    assert (r.version, r.collective) == ("2.19.6", "all_reduce_perf")
    assert r.settings["unalign"] == "0" and r.settings["minBytes"] == "536870912"
    assert [k.rank for k in r.ranks] == list(range(8)) and r.ranks[7].bus_id == "0000:00:0c"
    assert r.problem == "no result rows (the output ends after the rank list)"


def test_nccl_wrong_elements_and_out_of_bounds_failure() -> None:
    # the modern capture's own last row with 3 wrong elements in place, and its footer as a failed
    # run prints it
    text = (NCCL / "all_reduce_perf_gcp-a3mega_h100x16_2node_tcp.txt").read_text()
    text = text.replace("337.35      0\n", "337.35      3\n").replace("values : 0 OK", "values : 3 FAILED")
    r = nccltests.parse(text)
    assert r.rows[-1].wrong == 3 and r.wrong_elements == 3
    assert (r.out_of_bounds, r.out_of_bounds_ok) == (3, False)


def test_nccl_text_without_output_is_a_clear_error() -> None:
    with pytest.raises(nccltests.NcclParseError, match="no nccl-tests output"):
        nccltests.parse("mpirun: command not found\n")


# --------------------------------------------------------------------------- dcgmi diag


def test_dcgm_json_fragment_is_a_clear_error() -> None:
    # the reporter elided the first category as {"..."} and the paste ends mid-array
    with pytest.raises(dcgm.DcgmParseError, match=r"not valid JSON \(line 6, column 10"):
        dcgm.parse_diag((DCGM / "issue_dcgm-139_dcgm3.3.1_t400_diag-r3-json_skip_FRAGMENT.txt").read_text())


def test_dcgm_json_of_dcgm_3_from_the_fragment_repaired() -> None:
    # the same document with the elision removed and the array closed: DCGM 3.x's real field names
    text = (DCGM / "issue_dcgm-139_dcgm3.3.1_t400_diag-r3-json_skip_FRAGMENT.txt").read_text()
    repaired = text.replace('\t\t\t{"..."},\n', "").rstrip().rstrip(",") + "\n\t\t]\n\t}\n}\n"
    r = dcgm.parse_diag(repaired)
    assert r.source == "json"
    assert [(t.category, t.name) for t in r.tests] == [("Integration", "PCIe"), ("Hardware", "GPU Memory"),
                                                         ("Hardware", "Diagnostic"), ("Hardware", "EUD Test")]
    assert all(t.results == [dcgm.DiagResult(0, dcgm.SKIP)] for t in r.tests)


def test_dcgm_json_of_dcgm_4_schema() -> None:
    # shaped by NVIDIA/DCGM testing/python3/dcgm_diag_schema.json (DCGM 4), values invented
    doc = {"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
        {"name": "memory", "test_summary": {"status": "Fail"}, "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
             "warnings": [{"warning": "GPU 1 memory error", "error_id": 80, "error_category": 3,
                           "error_severity": 2}]},
            {"entity_group": "CPU", "entity_group_id": 7, "entity_id": 0, "status": "Pass"}]}]}]},
        "metadata": {"version": "4.2.3"}}
    r = dcgm.parse_diag(json.dumps(doc))
    [t] = r.tests
    assert t.summary == dcgm.FAIL and t.status_for(0) == dcgm.PASS and t.status_for(1) == dcgm.FAIL
    assert t.warnings == [dcgm.DiagMessage(1, "GPU 1 memory error", 80)]
    assert r.version == "4.2.3" and r.gpus == [0, 1]


def test_dcgm_table_3x_header_metadata_and_deployment() -> None:
    r = dcgm.parse_diag((DCGM / "issue_go-dcgm-52_dcgm3.3.1_t4_r2_header_PARTIAL.txt").read_text())
    assert r.metadata == {"DCGM Version": "3.3.1", "Driver Version Detected": "535.129.03",
                          "GPU Device IDs Detected": "1eb8"}
    assert [t.name for t in r.tests] == ["Denylist", "NVML Library", "CUDA Main Library",
                                         "Permissions and OS Blocks", "Persistence Mode",
                                         "Environment Variables", "Page Retirement/Row Remap"]
    assert all(t.category == "Deployment" and t.status_for(0) == dcgm.PASS for t in r.tests)
    assert r.truncated == "no closing border after the last row: the output was cut off"


def test_dcgm_table_after_kubectl_line_dcgm_3_3_5() -> None:
    r = dcgm.parse_diag(_read(DCGM, "issue_autopilot-68_dcgm3.3.5_a100-pcie-80gb_r3_header_PARTIAL.txt"))
    assert r.version == "3.3.5" and r.metadata["GPU Device IDs Detected"] == "20b5,20b5,20b5,20b5"
    assert [t.name for t in r.tests] == ["Denylist", "NVML Library", "CUDA Main Library",
                                         "Permissions and OS Blocks"]
    assert r.truncated is not None


def test_dcgm_table_after_another_command_and_cut_mid_row() -> None:
    # `dcgmi nvlink --link-status` output first (its own one-cell table), then the diag table cut mid-row
    r = dcgm.parse_diag(_read(DCGM, "issue_dcgm-198_h100nvl_nvlink-link-status-all-down_and_r2-header_"
                                    "PARTIAL.txt"))
    assert r.version == "3.3.7" and r.metadata["GPU Device IDs Detected"] == "2321,2321"
    assert [t.name for t in r.tests] == ["Denylist"]
    assert r.truncated == "table row cut off: '| NVML Library              | Pass'"


def test_dcgm_table_dcgm_4_per_gpu_lines() -> None:
    r = dcgm.parse_diag(_read(DCGM, "issue_dcgm-253_dcgm4.2.3_l40s_r-table_new-4x-format_PARTIAL.txt"))
    assert r.version == "4.2.3"
    software, memory = r.tests
    assert (software.category, software.name, software.summary) == ("Deployment", "software", dcgm.PASS)
    # the summary on the test's row is dropped once the per-GPU lines are known
    assert software.results == [dcgm.DiagResult(g, dcgm.PASS) for g in range(4)]
    assert (memory.category, memory.name, memory.results) == ("Hardware", "memory",
                                                              [dcgm.DiagResult(None, dcgm.PASS)])
    assert r.truncated is not None


def test_dcgm_table_2x_fail_all_with_wrapped_warning_rejoined() -> None:
    r = dcgm.parse_diag(_read(DCGM, "issue_dcgm-49_dcgm2.4.6_a100_r2_pcie-fail-all_nvlink-down-warnings_"
                                    "FRAGMENT.txt"))
    [pcie] = r.tests
    assert (pcie.category, pcie.name) == ("Integration", "PCIe")
    assert pcie.results == [dcgm.DiagResult(None, dcgm.FAIL)]
    [w] = pcie.warnings
    # slices cut mid-word ("Run a fie" / "ld diagnostic") are joined back exactly
    assert w.text.startswith("GPU 0GPU 0's NvLink link 0 is currently down Run a field diagnostic on the "
                             "GPU., GPU 0GPU 0's NvLink link 1 is currently down Run a field diagnostic on "
                             "the GPU.")
    assert "link 4 is curren" in w.text and w.gpu == 0
    assert r.truncated is not None and r.truncated.startswith("table row cut off")


def test_dcgm_table_3x_mixed_result_cell_and_orphan_rows() -> None:
    r = dcgm.parse_diag((DCGM / "issue_go-dcgm-52_dcgm3.3.1_t4_r2_gpu-memory-fail_cuda-busy_FRAGMENT.txt")
                        .read_text())
    [mem] = r.tests
    assert (mem.category, mem.name) == ("Hardware", "GPU Memory")
    assert mem.results == [dcgm.DiagResult(1, dcgm.PASS), dcgm.DiagResult(0, dcgm.FAIL)]
    [w] = mem.warnings
    assert w.gpu == 0 and w.text == ("GPU 0 Error using CUDA API cuCtxCreate Check DCGM and system logs "
                                     "for errors. Reset GPU. Restart DCGM. Rerun diagnostics. Unable to "
                                     "create CUDA context: 'CUDA-capable device(s) is/are busy or "
                                     "unavailable'.")
    # rows of the PCIe test above the fragment's start belong to no test here; kept, not dropped
    assert r.orphans[2] == ("GPU 0 API call cudaStreamCreate failed: 'CUDA-capable device(s) is/are busy "
                            "or unavailable' Check DCGM and system logs for errors. Reset GPU. Restart DCGM. "
                            "Rerun diagnostics.")
    assert r.orphans[3].startswith("GPU 1 GPU to Host bandwidth:  12.33 GB/s, GPU 1 Host to GPU bandwidth:")


@pytest.mark.parametrize("path", _all(DCGM), ids=lambda p: p.name)
def test_every_dcgm_capture_parses_or_says_why(path: Path) -> None:
    try:
        r = dcgm.parse_diag(path.read_text())
    except dcgm.DcgmParseError as exc:
        assert str(exc)
        return
    assert r.tests and (r.truncated or "PARTIAL" not in path.name)


def test_dcgm_no_table_is_a_clear_error() -> None:
    with pytest.raises(dcgm.DcgmParseError, match="no dcgmi diag table"):
        dcgm.parse_diag("Error: unable to establish a connection to the specified host: localhost\n")


# --------------------------------------------------------------------------- never a crash

_CAPTURES = [p.read_text() for folder in (DCGM, PERF, NCCL) for p in _all(folder)]


@st.composite
def _mangled(draw: st.DrawFn) -> str:
    """A real capture cut, with lines dropped or repeated and characters replaced: what a killed run, a
    paste or a broken pipe leaves."""
    lines = draw(st.sampled_from(_CAPTURES)).splitlines(keepends=True)
    kept = [ln for ln in lines if draw(st.booleans()) or len(lines) < 3]
    if kept and draw(st.booleans()):
        kept.insert(draw(st.integers(0, len(kept))), draw(st.sampled_from(kept)))
    text = "".join(kept)
    for _ in range(draw(st.integers(0, 4))):
        if not text:
            break
        i = draw(st.integers(0, len(text) - 1))
        token = draw(st.sampled_from(["|", "+", "-", " ", "\t", "{", "9", "1e400", "inf", "nan", "N/A", "x"]))
        text = text[:i] + token + text[i + 1:]
    return text[: draw(st.integers(0, len(text)))]


_KEYS = ["test_categories", "tests", "category", "name", "results", "status", "gpu_id", "gpu_ids",
         "entity_group", "entity_id", "warnings", "info", "warning", "error_id", "test_summary",
         "runtime_error"]
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
                     | st.sampled_from(["Pass", "Fail", "GPU", "0", "1,2"]),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.sampled_from(_KEYS), inner, max_size=5), max_leaves=20)


@given(_JSON)
@settings(max_examples=300)
def test_dcgm_json_of_any_shape_is_read_or_refused(value: object) -> None:
    for doc in ({"DCGM Diagnostic": value}, {"DCGM GPU Diagnostic": {"test_categories": value}}):
        try:
            dcgm.diag_from_json(doc)
        except dcgm.DcgmParseError as exc:
            assert str(exc)


@given(st.one_of(_mangled(), st.text(max_size=300)))
@settings(max_examples=300)
def test_parsers_raise_only_their_own_error(text: str) -> None:
    parsers = ((dcgm.parse_diag, dcgm.DcgmParseError), (perftest.parse_bw, perftest.PerftestParseError),
               (nccltests.parse_all, nccltests.NcclParseError))
    for parse, error in parsers:
        try:
            parse(text)
        except error as exc:
            assert str(exc)
