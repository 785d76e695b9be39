"""The simulated GPUs' device models: what the simulator writes for the scenario's compute faults, and
how the hardware layer reads it back (gpumon/sim/devices.py; carried out by the compute checks' CPU
stand-ins, tested end to end in tests/checks/test_burnin.py, test_nccl.py, test_p2p.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumon.errors import ConfigError, HwFailure
from gpumon.hw.inventory import Inventory
from gpumon.hw.placement import ComputeDevices
from gpumon.schema import load_yaml
from gpumon.sim.devices import SIM_DEVICES_FILE, DeviceModel, SimulatedDevices, link_share
from gpumon.sim.render import SimNode
from gpumon.sim.scenario import _build


def _node(tmp_path: Path, faults: str, gpus: int = 8) -> SimNode:
    data, src = load_yaml(f"name: t\nsku: h100-sxm\ngpus: {gpus}\nfaults:\n{faults or '  []'}\n",
                          "scenario.yaml")
    return SimNode(_build(data, src), tmp_path / "sim")


def _models(node: SimNode) -> dict[int, DeviceModel]:
    return SimulatedDevices(node.host_root).models()


def test_compute_faults_become_device_models_by_nvml_index(tmp_path: Path) -> None:
    node = _node(tmp_path, "  - {kind: compute_slow, gpu: 2, factor: 0.1}\n"
                           "  - {kind: compute_slow, gpu: 2, factor: 0.5}\n"   # the slower one wins
                           "  - {kind: allreduce_corrupt, gpu: 6}\n"
                           "  - {kind: p2p_slow, gpu: 3, peer: 5, factor: 0.2}\n"
                           "  - {kind: p2p_slow, gpu: 4, factor: 0.5, at_s: 100}\n"
                           "  - {kind: sdc, gpu: 1, dtype: bfloat16, rate: 0.5}\n")
    node.render(0)
    models = _models(node)
    assert models == {2: DeviceModel(speed=0.1), 6: DeviceModel(allreduce_wrong=1),
                      3: DeviceModel(links={5: 0.2}), 1: DeviceModel(sdc="dtype=bfloat16,rate=0.5")}
    assert link_share(models, 3, 5) == link_share(models, 5, 3) == 0.2  # a link is as slow as its slower end
    assert link_share(models, 0, 1) == 1.0
    node.render(100)  # the fault that starts at 100 s
    assert _models(node)[4] == DeviceModel(all_links=0.5)


def test_a_missing_gpu_shifts_the_models_as_nvml_shifts_the_indices(tmp_path: Path) -> None:
    node = _node(tmp_path, "  - {kind: gpu_missing, gpu: 0}\n"
                           "  - {kind: compute_slow, gpu: 2, factor: 0.1}\n"
                           "  - {kind: p2p_slow, gpu: 3, peer: 5, factor: 0.2}\n"
                           "  - {kind: allreduce_corrupt, gpu: 0}\n")  # on the GPU NVML does not see
    node.render(0)
    assert _models(node) == {1: DeviceModel(speed=0.1), 2: DeviceModel(links={4: 0.2})}


def test_a_healthy_node_has_no_models_and_a_real_node_reads_none(tmp_path: Path) -> None:
    node = _node(tmp_path, "", gpus=2)
    node.render(0)
    assert _models(node) == {}
    # a real node's devices have no stand-ins, whatever files its host root holds
    assert ComputeDevices().stand_ins(Inventory()) == ()


def test_garbage_in_the_models_file_is_a_hardware_failure(tmp_path: Path) -> None:
    node = _node(tmp_path, "", gpus=2)
    node.render(0)
    path = node.host_root / SIM_DEVICES_FILE
    for text in ("{", json.dumps({"x": {}}), json.dumps({"0": {"speed": 2.0}}),
                 json.dumps({"0": {"links": 3}})):
        path.write_text(text)
        with pytest.raises(HwFailure, match="simulated device models"):
            _models(node)


def test_models_round_trip_and_refuse_impossible_shares() -> None:
    m = DeviceModel(speed=0.5, allreduce_wrong=2, links={3: 0.25}, all_links=0.9, sdc="dtype=float16,rate=1")
    assert DeviceModel.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert DeviceModel().healthy and not m.healthy
    for bad in ({"speed": 0}, {"speed": -1}, {"all_links": 1.5}, {"links": {"1": 0}}, {"allreduce_wrong": -1},
                {"speed": "fast"}):
        with pytest.raises(ValueError, match="bad device model"):
            DeviceModel.from_json(bad)


def test_scenario_refuses_compute_faults_it_cannot_lay_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gpu 9 does not exist"):
        _node(tmp_path, "  - {kind: p2p_slow, gpu: 1, peer: 9, factor: 0.5}\n")
    with pytest.raises(ConfigError, match="peer must be another GPU"):
        _node(tmp_path, "  - {kind: p2p_slow, gpu: 1, peer: 1, factor: 0.5}\n")
    with pytest.raises(ConfigError, match="factor"):
        _node(tmp_path, "  - {kind: compute_slow, gpu: 1, factor: 0}\n")
    with pytest.raises(ConfigError, match="dtype"):
        _node(tmp_path, "  - {kind: sdc, gpu: 1, dtype: int4}\n")
    with pytest.raises(ConfigError, match="takes no 'factor'"):
        _node(tmp_path, "  - {kind: allreduce_corrupt, gpu: 1, factor: 0.5}\n")
