"""The shipped SKU profiles (config/profiles/*.yaml): every check threshold in a profile's ``checks:``
section loads into that check's own Config class through the real path the agent takes
(``with_profile``), carries a source note, and agrees with the facts the same profile states (GPU
count, NVLink, PCIe link, IB rate). A threshold without a source, or one its check's Config
rejects, is refused where it is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumon.config import Config, load_config, with_profile
from gpumon.errors import ConfigError
from gpumon.profiles import Profile, builtin_profiles, load_profile_file
from gpumon.registry import load_checks

PROFILES = builtin_profiles()
REGISTRY = load_checks()

# The bootstrap thresholds each shipped profile sources today (README of the profiles: a value
# nobody could source is left out). A profile may gain keys; losing one is a regression.
SOURCED = {
    "h100-sxm": {"burnin.baseline_tflops", "burnin.memory_bandwidth_gbps", "nccl.busbw_min_gbps",
                 "p2p.min_gbps", "host_bandwidth.min_gbps", "collective_hang.max_power_w"},
    "h200-sxm": {"burnin.baseline_tflops", "burnin.memory_bandwidth_gbps", "nccl.busbw_min_gbps",
                 "p2p.min_gbps", "host_bandwidth.min_gbps", "rdma.gdr_efficiency",
                 "collective_hang.max_power_w"},
    "a100-sxm-80gb": {"burnin.baseline_tflops", "burnin.memory_bandwidth_gbps", "nccl.busbw_min_gbps",
                      "host_bandwidth.min_gbps", "rdma.gdr_efficiency", "collective_hang.max_power_w"},
    "gb200": {"nccl.busbw_min_gbps", "p2p.min_gbps", "host_bandwidth.min_gbps", "rdma.gdr_efficiency",
              "collective_hang.max_power_w"},
    "h100-pcie": {"burnin.baseline_tflops", "burnin.memory_bandwidth_gbps", "collective_hang.max_power_w"},
    "b200": {"collective_hang.max_power_w"},
}

# PCI-SIG signalling rate per lane (GT/s) by generation; rate / 8 bits is an upper bound on the
# GB/s a lane can carry in one direction (line encoding only lowers it)
PCIE_GTS = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0, 7: 128.0}


def _applied(profile: Profile, tmp_path: Path) -> Config:
    config = load_config(None, REGISTRY, site_file=tmp_path / "absent.yaml")
    return with_profile(config, REGISTRY, profile)


def _value(profile: Profile, check: str, option: str) -> Any:
    return profile.checks.get(check, {}).get(option, {}).get("value")


def test_every_shipped_profile_is_covered_here() -> None:
    assert set(PROFILES) == set(SOURCED)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_check_thresholds_load_into_the_checks_config_with_their_source(name: str, tmp_path: Path) -> None:
    profile = PROFILES[name]
    config = _applied(profile, tmp_path)
    seen = set()
    for check, tuned in profile.checks.items():
        cls = REGISTRY[check]
        assert cls.Config is not None, f"{name}: check {check} takes no options"
        options = config.settings(cls).options
        assert isinstance(options, cls.Config)
        for option, entry in tuned.items():
            assert getattr(options, option) == entry["value"], f"{name}: checks.{check}.{option}"
            source = profile.source_of(f"checks.{check}.{option}")
            assert source is not None and source.strip(), f"{name}: checks.{check}.{option} has no source"
            assert source == entry["source"]
            seen.add(f"{check}.{option}")
    assert SOURCED[name] <= seen, f"{name} lost {sorted(SOURCED[name] - seen)}"


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_thresholds_agree_with_the_profiles_own_facts(name: str) -> None:
    profile = PROFILES[name]
    nvlink, pcie, gpus = profile.nvlink, profile.pcie, profile.gpu.count

    if _value(profile, "nccl", "busbw_min_gbps") is not None and gpus is not None:
        assert gpus >= 2, "an all-reduce floor needs two GPUs or more"

    p2p = _value(profile, "p2p", "min_gbps")
    if p2p is not None:
        # the floor comes from NVLink copies; without NVLink it would judge PCIe against it
        assert nvlink.links_per_gpu is not None and nvlink.links_per_gpu > 0
        if nvlink.bandwidth_gbps_per_gpu is not None:
            # one copy runs in one direction: at most half the bidirectional total
            assert p2p <= nvlink.bandwidth_gbps_per_gpu / 2

    host = _value(profile, "host_bandwidth", "min_gbps")
    if host is not None and pcie.generation is not None and pcie.width is not None:
        assert host < pcie.width * PCIE_GTS[pcie.generation] / 8, "host copy floor above the PCIe link"

    if _value(profile, "rdma", "gdr_efficiency") is not None:
        # the efficiency multiplies the profile's IB rate; without one it would scale the port's own
        assert profile.network.ib_rate_gbps is not None and profile.network.ib_ports

    hang = _value(profile, "collective_hang", "max_power_w")
    if hang is not None and profile.gpu.tdp_w is not None:
        # the hung-collective signature is a GPU at full utilization drawing little power: a
        # ceiling at half the board power or more would take working GPUs for hung ones
        assert hang < profile.gpu.tdp_w / 2

    peaks = _value(profile, "burnin", "baseline_tflops")
    if peaks is not None:
        # dense tensor-core rates on every SKU here: TF32 is half of BF16/FP16, FP32 and FP64 below
        assert peaks.get("bf16") == peaks.get("fp16")
        if "tf32" in peaks and "bf16" in peaks:
            assert peaks["tf32"] == pytest.approx(peaks["bf16"] / 2, rel=0.01)
        for lower in ("fp32", "fp64"):
            if lower in peaks and "tf32" in peaks:
                assert peaks[lower] < peaks["tf32"]


PROFILE_HEAD = 'name: t\nmatch: ["^T$"]\n'


def test_a_threshold_without_a_source_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(PROFILE_HEAD + "checks:\n  nccl:\n    busbw_min_gbps: 460\n")
    with pytest.raises(ConfigError) as info:
        load_profile_file(path)
    assert info.value.key == "checks.nccl.busbw_min_gbps"
    assert "source" in info.value.reason

    path.write_text(PROFILE_HEAD + 'checks:\n  nccl:\n    busbw_min_gbps: {value: 460, source: "  "}\n')
    with pytest.raises(ConfigError) as info:
        load_profile_file(path)
    assert info.value.key == "checks.nccl.busbw_min_gbps.source"


@pytest.mark.parametrize(("check", "option", "value"), [
    ("burnin", "baseline_tflops", "{fp8: 1979}"),  # not a dtype burnin runs
    ("nccl", "busbw_min_gbps", "-1"),
    ("rdma", "gdr_efficiency", "1.5"),
])
def test_a_threshold_its_check_rejects_is_refused_where_written(check: str, option: str, value: str,
                                                                 tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    entry = f'{{value: {value}, source: "a datasheet"}}'
    path.write_text(PROFILE_HEAD + f"checks:\n  {check}:\n    {option}: {entry}\n")
    profile = load_profile_file(path)
    with pytest.raises(ConfigError) as info:
        _applied(profile, tmp_path)
    assert info.value.file == str(path)
    assert info.value.key is not None and info.value.key.startswith(f"checks.{check}")
