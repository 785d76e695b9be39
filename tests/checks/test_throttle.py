"""The throttle check: shares of a window on a simulated node stepped through time, and the window math."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import run_on_json
from gpumon.bootstate import dump_state, load_state
from gpumon.check import CheckContext
from gpumon.config import load_config, with_profile
from gpumon.errors import ConfigError
from gpumon.model import Finding, Severity
from gpumon.profiles import builtin_profiles
from gpumon.registry import load_checks
from gpumon.schema import Source, build
from gpumon.sim.nvml_state import read_state, write_state
from gpumon_checks.throttle import (
    ThrottleCheck,
    ThrottleConfig,
    counter_share,
    sampled_shares,
    window_shares,
)

HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, SW_POWER_CAP = 0x8, 0x20, 0x40, 0x4


class _Daemon:
    """The throttle check run the way the daemon runs it: one hardware session, state kept, clock stepping.

    ``step(t)`` runs the check at scenario time t; the node is re-rendered only when asked (a render
    writes the whole host tree; between fault boundaries of a mask-only fault nothing changes).
    """

    def __init__(self, h: Any, t0: float = 0.0) -> None:
        self.h = h
        self.t = t0
        self.ctx: CheckContext = h.context(ThrottleCheck, t0)
        self.ctx.clock = lambda: h.node.start_wall + self.t

    def step(self, t: float, *, render: bool = False) -> dict[str, Finding]:
        if render:
            self.h.render(t)
        self.t = t
        findings = run_on_json(ThrottleCheck(), self.ctx)
        state = self.h.states["throttle"]
        assert json.loads(json.dumps(state)) == state  # JSON types only (CheckStateStore)
        return {f.component: f for f in findings}


def _scenario(*faults: str) -> str:
    return "name: t\nsku: h100-sxm\ngpus: 8\nfaults:\n" + "".join(f"  - {f}\n" for f in faults)


def test_held_half_the_window_fails_a_blip_does_not(sim: Any) -> None:
    h = sim(_scenario(
        "{at_s: 300, kind: throttle, gpu: 1, reasons: [hw_slowdown]}",               # 50 % at t = 600
        "{at_s: 300, kind: throttle, gpu: 2, reasons: [hw_slowdown], duration_s: 12}",  # 2 %
        "{at_s: 0, kind: throttle, gpu: 3, reasons: [sw_power_cap]}",                  # 100 %, normal
        "{at_s: 590, kind: throttle, gpu: 5, reasons: [hw_power_brake_slowdown]}",     # active now, 10 s
    ))
    d = _Daemon(h)
    boundaries = {300, 320, 590}  # the first step at or after each fault boundary renders
    for t in range(10, 591, 10):
        found = d.step(t, render=t in boundaries)
        if t == 30:  # under min_history_s: the current reading decides (sw_power_cap is normal)
            assert "current reading" in found["gpu/3"].evidence["judged_by"]
            assert {f.severity for f in found.values()} == {Severity.OK}
        if t == 300:
            # in HW slowdown right now, but for 5 s of a 290 s history: not (yet) a fault
            assert found["gpu/1"].severity is Severity.OK and found["gpu/1"].evidence["active"] == [
                "hw_slowdown"]
    found = d.step(600)
    held = found["gpu/1"]
    assert (held.severity, held.action.value) == (Severity.FAIL, "inspect_hardware")
    assert held.evidence["fractions"]["hw_slowdown"] == pytest.approx(0.5, abs=0.02)
    assert "of the last 10 min" in held.message and held.evidence["observed_s"] == 590.0
    blip = found["gpu/2"]
    assert blip.severity is Severity.OK and 0 < blip.evidence["fractions"]["hw_slowdown"] < 0.05
    capped = found["gpu/3"]
    assert capped.severity is Severity.OK and capped.evidence["fractions"]["sw_power_cap"] == 1.0
    brake = found["gpu/5"]
    assert brake.severity is Severity.OK and brake.evidence["active"] == ["hw_power_brake_slowdown"]
    assert "active now: hw_power_brake_slowdown" in brake.message


def test_sw_thermal_warns_and_a_counter_that_restarts_never_gives_a_negative_share(sim: Any) -> None:
    h = sim(_scenario(
        "{at_s: 0, kind: throttle, gpu: 4, reasons: [sw_thermal_slowdown]}",
        "{at_s: 0, kind: throttle, gpu: 6, reasons: [hw_thermal_slowdown], duration_s: 50}",
        "{at_s: 70, kind: throttle, gpu: 6, reasons: [hw_thermal_slowdown]}",
    ), "checks:\n  throttle:\n    window_s: 120\n    min_history_s: 30\n")
    d = _Daemon(h)
    for t in (20, 40, 60, 80):
        if t == 80:
            # a driver reload between two readings: NVML's THERMAL counter of GPU 6 starts again
            h.render(t)
            state = read_state(h.node.nvml_state_path)
            state.gpus[6].violation_ns[1] = 5 * 10**9
            write_state(state, h.node.nvml_state_path)
            found = d.step(t)
            continue
        found = d.step(t, render=True)
        for f in found.values():
            assert all(0.0 <= v <= 1.0 for v in f.evidence["fractions"].values()), f
            assert all(0.0 <= v <= 1.0 for v in f.evidence.get("violation_fraction", {}).values()), f
    hot = found["gpu/4"]
    assert (hot.severity, hot.action.value) == (Severity.WARN, "none")
    assert hot.evidence["fractions"]["sw_thermal_slowdown"] == 1.0
    assert hot.evidence["violation_fraction"]["thermal"] == pytest.approx(1.0)
    hw = found["gpu/6"]
    assert hw.evidence["counter_resets"] == 1
    assert (hw.severity, hw.action.value) == (Severity.FAIL, "inspect_hardware")


def test_a_single_reading_decides_when_there_is_no_history(sim: Any) -> None:
    # what a one-shot `gpumon check` sees: fresh state, one reading
    h = sim(_scenario("{at_s: 10, kind: throttle, gpu: 1, reasons: [hw_slowdown]}",
                      "{at_s: 10, kind: throttle, gpu: 4, reasons: [sw_thermal_slowdown]}"))
    found = {f.component: f for f in h.run(ThrottleCheck, t=11)}
    slow = found["gpu/1"]
    assert (slow.severity, slow.action.value) == (Severity.FAIL, "inspect_hardware")
    assert slow.evidence["active"] == ["hw_slowdown"] and "no window history" in slow.message
    assert found["gpu/4"].severity is Severity.WARN
    assert found["gpu/0"].severity is Severity.OK


def test_lost_gpu_needs_a_reboot(sim: Any) -> None:
    h = sim(_scenario(
        "{at_s: 5, kind: xid, gpu: 3, code: 79}",  # every NVML call for GPU 3: GPU_IS_LOST
        "{at_s: 5, kind: nvml_error, gpu: 6, function: nvmlDeviceGetCurrentClocksEventReasons, "
        "error: gpu_is_lost}"))
    found = {f.component: f for f in h.run(ThrottleCheck, t=6)}
    for comp in ("gpu/3", "gpu/6"):
        assert (found[comp].severity, found[comp].action.value) == (Severity.FAIL, "reboot_node"), comp
    assert "GPU lost" in found["gpu/3"].message


# -- configuration --------------------------------------------------------------------------


def test_partial_fraction_tables_keep_the_other_defaults() -> None:
    cfg = build(ThrottleConfig, {"fail_fraction": {"hw_slowdown": 0.5}}, Source("t.yaml"))
    assert cfg.fail_fraction["hw_slowdown"] == 0.5
    assert cfg.fail_fraction["hw_power_brake_slowdown"] == ThrottleConfig().fail_fraction[
        "hw_power_brake_slowdown"]


@pytest.mark.parametrize(("data", "words"), [
    ({"warn_fraction": {"hw_slowdwn": 0.1}}, "hw_slowdwn"),
    ({"fail_fraction": {"hw_slowdown": 0.0}}, "(0, 1]"),
    ({"fail_fraction": {"hw_slowdown": 1.5}}, "(0, 1]"),
    ({"warn_fraction": {"hw_slowdown": 0.5}, "fail_fraction": {"hw_slowdown": 0.3}}, "above"),
    ({"fail_reasons": ["sw_power_cap"]}, "needs a fail_fraction"),
    ({"warn_reasons": ["applications_clocks_setting"]}, "needs a warn_fraction"),
    ({"window_s": 60, "min_history_s": 120}, "min_history_s"),
])
def test_bad_options_are_refused(data: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build(ThrottleConfig, data, Source("t.yaml"))


def test_sku_profile_can_set_the_fractions(tmp_path: Path) -> None:
    registry = load_checks()
    site = tmp_path / "gpumon.yaml"
    site.write_text("{}\n")
    config = load_config(site, registry, site_file=tmp_path / "absent.yaml")
    option = {"value": {"hw_power_brake_slowdown": 0.4}, "source": "test: a SKU that duty-cycles its brake"}
    profile = dataclasses.replace(builtin_profiles()["h100-sxm"],
                                  checks={"throttle": {"fail_fraction": option}})
    options = with_profile(config, registry, profile).settings(ThrottleCheck).options
    assert options.fail_fraction["hw_power_brake_slowdown"] == 0.4
    assert options.fail_fraction["hw_slowdown"] == 0.25


# -- window math -----------------------------------------------------------------------------


def test_readings_split_each_gap_at_its_middle() -> None:
    samples = [[0, 0], [10, HW_SLOWDOWN], [20, HW_SLOWDOWN], [30, 0]]
    observed, active = sampled_shares(samples, 0, 30, max_gap=15)
    assert observed == 30 and active["hw_slowdown"] == 20
    # a gap longer than max_gap is nobody's
    observed, active = sampled_shares([[0, HW_SLOWDOWN], [100, HW_SLOWDOWN]], 0, 100, max_gap=15)
    assert observed == 0 and active["hw_slowdown"] == 0
    # only the part inside the window counts
    observed, active = sampled_shares(samples, 15, 30, max_gap=15)
    assert observed == 15 and active["hw_slowdown"] == 10


def test_thermal_counter_goes_to_the_thermal_reason_the_readings_saw() -> None:
    spans = {"thermal": [[0, 100, 60e9]]}  # 60 % of the window, mostly between readings
    hw = window_shares([[0, 0], [10, HW_THERMAL], [20, 0]], spans, 100, 100, max_gap=200)
    assert hw.fractions["hw_thermal_slowdown"] == pytest.approx(0.6)
    assert hw.basis["hw_thermal_slowdown"] == "THERMAL violation counter"
    unseen = window_shares([[0, 0], [100, 0]], spans, 100, 100, max_gap=200)
    # no reading saw which thermal reason: the milder one, so a counter alone never fails a GPU
    assert unseen.fractions["sw_thermal_slowdown"] == pytest.approx(0.6)
    assert unseen.fractions["hw_thermal_slowdown"] == 0


def test_counter_share_prorates_spans_cut_by_the_window() -> None:
    assert counter_share([[0, 10, 10e9], [10, 20, 0]], 5, 20) == pytest.approx(5 / 15)
    assert counter_share([[0, 10, 5e9]], 20, 30) is None


_masks = st.integers(min_value=0, max_value=(1 << 64) - 1)
_times = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(st.tuples(_times, _masks), max_size=40),
       st.lists(st.tuples(_times, _times, st.floats(min_value=0, max_value=1e15)), max_size=20),
       _times, st.floats(min_value=1, max_value=1e5), st.floats(min_value=1, max_value=1e4))
def test_shares_stay_between_0_and_1_on_any_history(samples: list[tuple[float, int]],
                                                    spans: list[tuple[float, float, float]],
                                                    now: float, window: float, gap: float) -> None:
    ordered = [list(s) for s in sorted(samples)]
    win = window_shares(ordered, {"thermal": [list(s) for s in spans]}, now, window, gap)
    assert 0 <= win.observed_s <= window + 1e-6 * window
    assert all(0.0 <= f <= 1.0 for f in win.fractions.values())
    assert all(0.0 <= f <= 1.0 for f in win.counter_fractions.values())


@given(st.lists(st.tuples(st.floats(min_value=0, max_value=5000, allow_nan=False), _masks,
                          st.integers(min_value=-(1 << 40), max_value=1 << 62),
                          st.integers(min_value=-(1 << 40), max_value=1 << 62)), max_size=30))
def test_recording_garbage_counters_and_clock_steps_never_breaks_the_window(
        readings: list[tuple[float, int, int, int]]) -> None:
    from gpumon_checks.throttle import _History, _record  # the state update the check runs per reading

    options = ThrottleConfig(window_s=600, min_history_s=0, max_sample_gap_s=120)
    history = _History()
    for now, mask, thermal, power in readings:
        _record(history, now, mask, {"thermal": thermal, "power": power}, options)
        win = window_shares(history.samples, history.spans, now, 600, 120)
        assert all(0.0 <= f <= 1.0 for f in [*win.fractions.values(), *win.counter_fractions.values()])
        assert all(s[2] >= 0 for spans in history.spans.values() for s in spans)  # never negative
        saved = dump_state(history)
        assert json.loads(json.dumps(saved)) == saved
        assert load_state(_History, saved) == history  # and it reads back (the ns of a span may be a float)


# -- saved state: the previous release's file, and files that do not fit ---------------------------

STATE_DATA = Path(__file__).resolve().parents[1] / "data" / "checkstate"
_SAVED = _scenario("{at_s: 0, kind: throttle, gpu: 4, reasons: [sw_thermal_slowdown]}",
                   "{at_s: 0, kind: throttle, gpu: 6, reasons: [hw_thermal_slowdown], duration_s: 50}",
                   "{at_s: 70, kind: throttle, gpu: 6, reasons: [hw_thermal_slowdown]}",
                   "{at_s: 30, kind: throttle, gpu: 1, reasons: [hw_slowdown]}")
_SAVED_CFG = "checks:\n  throttle:\n    window_s: 120\n    min_history_s: 30\n"


def _restart_thermal_counter(h: Any, t: float) -> None:
    """A driver reload between two readings: NVML's THERMAL counter of GPU 6 starts again."""
    h.render(t)
    state = read_state(h.node.nvml_state_path)
    state.gpus[6].violation_ns[1] = 5 * 10**9
    write_state(state, h.node.nvml_state_path)


def test_state_saved_by_the_previous_release_loads_unchanged_and_judges_the_same(sim: Any) -> None:
    # tests/data/checkstate/throttle-release.json: ctx.state after these same runs, written by the release
    # before the state was typed (an untyped dict kept by hand)
    saved = json.loads((STATE_DATA / "throttle-release.json").read_text(encoding="utf-8"))
    h = sim(_SAVED, _SAVED_CFG)
    d = _Daemon(h)
    check = ThrottleCheck()
    for t in (20, 40, 60, 80):
        if t == 80:
            _restart_thermal_counter(h, t)
        else:
            h.render(t)
        d.t = t
        run_on_json(check, d.ctx)  # one instance all along, as the daemon keeps it
    before = {**saved, "boot_id": d.ctx.hw.fs.boot_id()}  # each simulated node boots with an id of its own
    assert h.states["throttle"] == before  # the same JSON, key for key
    later = {t: d.step(t, render=True) for t in (100, 150)}  # _Daemon.step: a new instance each run
    # the counter went back at 80 and, the node rendered afresh, jumped past the wall clock at 100
    assert later[100]["gpu/6"].evidence["counter_resets"] == 2
    assert {c: f.severity for c, f in later[150].items() if f.severity is not Severity.OK} == {
        "gpu/1": Severity.FAIL, "gpu/4": Severity.WARN, "gpu/6": Severity.FAIL}
    # the file read back by a new instance (a daemon restart): every verdict as if never stopped
    check = ThrottleCheck()
    d.ctx.state.clear()
    d.ctx.state.update(json.loads(json.dumps(before)))
    for t in (100, 150):  # the first run reads the file, the second runs on what it kept
        h.render(t)
        d.t = t
        assert [f.to_json() for f in run_on_json(check, d.ctx)] == [f.to_json() for f in later[t].values()]
    # a reboot since: nothing of the last boot is kept (gpumon.bootstate.enter_boot)
    d.ctx.state.clear()
    d.ctx.state.update({**json.loads(json.dumps(before)), "boot_id": "an-earlier-boot"})
    found = {f.component: f for f in run_on_json(ThrottleCheck(), d.ctx)}
    assert "current reading" in found["gpu/6"].evidence["judged_by"]
    assert d.ctx.state["boot_id"] == before["boot_id"]
    assert [len(g["samples"]) for g in d.ctx.state["gpus"].values()] == [1] * 8


_MALFORMED = {
    "a GPU's history is a string": {"gpus": {"0": "x"}},
    "gpus is a list": {"gpus": []},
    "a number where the readings are": {"gpus": {"0": {"samples": 5, "spans": {}, "counters": {}}}},
    "a reading of one value": {"gpus": {"0": {"samples": [[1.0]], "spans": {}, "counters": {}}}},
    "a span time that is a string": {"gpus": {"1": {"samples": [], "spans": {"thermal": [["a", 2.0, 0]]},
                                                    "counters": {}}}},
    "a counter in fractional ns": {"gpus": {"1": {"samples": [], "spans": {},
                                                  "counters": {"thermal": [1.0, 2.5]}}}},
    "resets a string": {"gpus": {"1": {"samples": [], "spans": {}, "counters": {}, "resets": "1"}}},
    "a key of another release": {"gpus": {}, "window": 600},
}


@pytest.mark.parametrize("name", list(_MALFORMED))
def test_saved_state_that_does_not_fit_is_logged_once_and_started_afresh(
        name: str, sim: Any, caplog: pytest.LogCaptureFixture) -> None:
    # what the release before typed state did: AttributeError, TypeError... on every run, forever
    h = sim(_scenario("{at_s: 10, kind: throttle, gpu: 1, reasons: [hw_slowdown]}"))
    expected = [f.to_json() for f in h.run(ThrottleCheck, t=11)]
    assert [f["severity"] for f in expected].count("fail") == 1
    ctx = h.context(ThrottleCheck, 11)
    ctx.state.clear()
    ctx.state.update(json.loads(json.dumps(_MALFORMED[name])))
    check = ThrottleCheck()
    with caplog.at_level("WARNING", logger="gpumon.bootstate"):
        assert [f.to_json() for f in run_on_json(check, ctx)] == expected
        run_on_json(check, ctx)  # the next run goes on from what the first left: nothing is refused again
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "saved state of check throttle refused, starting afresh"]
    assert [len(g["samples"]) for g in ctx.state["gpus"].values()] == [2] * 8
