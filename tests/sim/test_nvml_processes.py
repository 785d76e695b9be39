"""Compute processes in the NVML injection library: the state's ``process`` records, served through
nvmlDeviceGetComputeRunningProcesses_v3/_v2 to the real nvidia-ml-py (whose ctypes struct would read
wrong values if the C layout of nvmlProcessInfo_v2_t differed from it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumon.sim import nvml_inject
from gpumon.sim.nvml_state import (
    FORMAT_MAGIC,
    MAX_PROCESSES,
    GpuState,
    NvmlNodeState,
    StateFormatError,
    read_state,
    render_state,
    write_state,
)

NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE as unsigned long long
MIG_NONE = 0xFFFFFFFF


def _node(processes: list[tuple[int, int | None]]) -> NvmlNodeState:
    return NvmlNodeState(gpus=[GpuState(index=0), GpuState(index=1, compute_processes=processes)])


def _served(path: Path, state: NvmlNodeState, wrapper: str) -> list[tuple[int, int | None, int, int]]:
    write_state(state, path)
    pynvml.nvmlInit()
    try:
        procs = getattr(pynvml, wrapper)(pynvml.nvmlDeviceGetHandleByIndex(1))
        return [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in procs]
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.parametrize("wrapper", ["nvmlDeviceGetComputeRunningProcesses_v3",
                                     "nvmlDeviceGetComputeRunningProcesses_v2",
                                     "nvmlDeviceGetComputeRunningProcesses"])
def test_processes_reach_pynvml_field_by_field(nvml_state: Path, wrapper: str) -> None:
    state = _node([(4242, 81 << 30), (77, None), (1, 0)])
    assert _served(nvml_state, state, wrapper) == [
        (4242, 81 << 30, MIG_NONE, MIG_NONE), (77, None, MIG_NONE, MIG_NONE), (1, 0, MIG_NONE, MIG_NONE)]
    assert _served(nvml_state, _node([]), wrapper) == []


def test_sizing_follows_nvml(nvml_state: Path) -> None:
    """Count query with 0 and no buffer, a buffer too small, then one large enough (what pynvml relies on)."""
    write_state(_node([(10, 1), (11, 2), (12, 3)]), nvml_state)
    pynvml.nvmlInit()
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        handle = pynvml.nvmlDeviceGetHandleByIndex(1)
        count = ctypes.c_uint(0)
        assert fn(handle, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 3
        small = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
        count.value = 2
        assert fn(handle, ctypes.byref(count), small) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert count.value == 3 and small[0].pid == 0  # nothing written on failure
        big = (pynvml.c_nvmlProcessInfo_v3_t * 8)()
        count.value = 8
        assert fn(handle, ctypes.byref(count), big) == pynvml.NVML_SUCCESS
        assert count.value == 3 and [big[i].pid for i in range(3)] == [10, 11, 12]
        assert fn(handle, None, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
        count.value = 0
        assert fn(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(count), None) == pynvml.NVML_SUCCESS
    finally:
        pynvml.nvmlShutdown()


def test_state_round_trip_and_limits(tmp_path: Path) -> None:
    state = _node([(4242, 81 << 30), (77, None)])
    text = render_state(state)
    assert "process 4242 86973087744\nprocess 77 -\n" in text
    path = tmp_path / "s.txt"
    write_state(state, path)
    assert read_state(path).gpus[1].compute_processes == [(4242, 81 << 30), (77, None)]
    for bad in ([(5, 1), (5, 2)], [(1, NOT_AVAILABLE)], [(-1, 0)], [(1 << 32, 0)],
                [(p, 0) for p in range(MAX_PROCESSES + 1)]):
        with pytest.raises(StateFormatError):
            render_state(_node(bad))


@pytest.mark.parametrize("line", ["process 5 1\nprocess 5 2", "process 5", "process 5 1 2", "process x 1",
                                  "process 5 18446744073709551615", "process 5 -1",
                                  "\n".join(f"process {p} 0" for p in range(65))])
def test_library_rejects_bad_process_records(line: str, inject_lib_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(f"{FORMAT_MAGIC}\ngpu 0\n{line}\nend\n")
    monkeypatch.setenv(nvml_inject.STATE_ENV, str(path))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


_PROCS = st.lists(st.tuples(st.integers(0, 0xFFFFFFFF), st.none() | st.integers(0, NOT_AVAILABLE - 1)),
                  max_size=MAX_PROCESSES, unique_by=lambda p: p[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(procs=_PROCS)
def test_any_process_list_round_trips_through_the_file_and_the_library(nvml_state: Path,
                                                                       procs: list[tuple[int, int | None]]
                                                                       ) -> None:
    state = _node(procs)
    write_state(state, nvml_state)
    assert read_state(nvml_state).gpus[1].compute_processes == procs
    served = _served(nvml_state, state, "nvmlDeviceGetComputeRunningProcesses_v3")
    assert [(pid, used) for pid, used, _, _ in served] == procs
