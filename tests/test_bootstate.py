"""gpumon.bootstate: boot reset, the repeat-after-reboot rule, typed check state."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpumon.bootstate import (
    REPEAT_WINDOW_S,
    RepeatHistory,
    StateError,
    dump_state,
    enter_boot,
    load_state,
    restore,
    start_boot,
)
from gpumon.checkstate import CheckStateStore

DAY = 86400.0


def test_start_boot_clears_all_but_what_survives_a_reboot() -> None:
    state: dict[str, Any] = {}
    assert start_boot(state, "b1")
    assert state == {"boot_id": "b1"}
    state.update({"counters": {"x": 1}, "history": {"k": {"b1": 5.0}}})
    assert not start_boot(state, "b1", keep=("history",))  # same boot: untouched
    assert state["counters"] == {"x": 1}
    assert start_boot(state, "b2", keep=("history", "absent"))
    assert state == {"boot_id": "b2", "history": {"k": {"b1": 5.0}}}


def test_start_boot_with_an_unreadable_boot_id_keeps_one_state() -> None:
    state: dict[str, Any] = {"x": 1}
    assert not start_boot(state, None)  # no boot id ever read: nothing to tell apart
    assert state == {"x": 1}
    assert start_boot({"boot_id": "b1"}, None)


@dataclass
class _Outages:
    boot_id: str | None = None
    open_since: float | None = None
    closed: list[float] = field(default_factory=list)

    def new_boot(self) -> bool:
        if self.open_since is None:
            return False
        self.closed.append(self.open_since)
        self.open_since = None
        return True


def test_enter_boot_lets_a_typed_state_keep_what_outlives_the_reboot() -> None:
    state = _Outages(boot_id="b1", open_since=10.0)
    assert not enter_boot(state, "b1")  # same boot: untouched
    assert state.open_since == 10.0
    assert enter_boot(state, "b2")  # the open outage is closed, not dropped
    assert (state.boot_id, state.open_since, state.closed) == ("b2", None, [10.0])
    assert not enter_boot(state, "b3")  # nothing to carry: nothing worth saving at once
    assert state.boot_id == "b3"


def test_a_fault_again_after_a_reboot_within_the_window_escalates() -> None:
    data: dict[str, Any] = {}
    h = RepeatHistory(data)
    assert not h.record("nvswitch/0|12028", "b1", 0.0, REPEAT_WINDOW_S)
    assert not h.record("nvswitch/0|12028", "b1", 60.0, REPEAT_WINDOW_S)  # same boot: no repeat
    assert h.record("nvswitch/0|12028", "b2", 2 * DAY, REPEAT_WINDOW_S)
    assert not h.record("nvswitch/1|12028", "b2", 2 * DAY, REPEAT_WINDOW_S)  # another switch
    # beyond the window the earlier boot no longer counts
    assert not h.record("gpu/0|x", "b1", 0.0, REPEAT_WINDOW_S)
    assert not h.record("gpu/0|x", "b2", 8 * DAY, REPEAT_WINDOW_S)
    assert json.loads(json.dumps(data)) == data


def test_repeat_history_without_boot_id_records_nothing() -> None:
    data: dict[str, Any] = {}
    assert not RepeatHistory(data).record("k", None, 0.0, DAY)
    assert data == {}


def test_repeat_history_is_bounded_and_forgets_the_old() -> None:
    data: dict[str, Any] = {}
    h = RepeatHistory(data, max_keys=3)
    for boot in range(20):
        h.record("k", f"b{boot}", float(boot), REPEAT_WINDOW_S)
    assert len(data["k"]) == 8 and "b19" in data["k"]
    for i in range(5):
        h.record(f"k{i}", "b", 100.0 + i, REPEAT_WINDOW_S)
    assert set(data) == {"k2", "k3", "k4"}  # the oldest faults go first
    h.forget(103.0 + REPEAT_WINDOW_S + 1, REPEAT_WINDOW_S)
    assert set(data) == {"k4"}


def test_repeat_history_reads_what_nvswitch_saved_before_it_and_junk() -> None:
    data: dict[str, Any] = {"a": [["b1", 10.0], ["b2", 20.0]], "junk": 5,
                            "b": {"b1": "x", "b2": float("nan")}}
    h = RepeatHistory(data)
    assert h.record("a", "b3", 30.0, DAY)
    assert data["a"] == {"b1": 10.0, "b2": 20.0, "b3": 30.0}
    assert not h.record("b", "b3", 30.0, DAY)
    assert not h.record("junk", "b3", 30.0, DAY)


# -- typed state ------------------------------------------------------------------------------


@dataclass
class _Rec:
    start: float
    n: int
    kind: str


@dataclass
class _State:
    version: int = 1
    boot_id: str | None = None
    seen: bool = False
    recs: list[_Rec] = field(default_factory=list)
    by_key: dict[str, _Rec] = field(default_factory=dict)
    rate: tuple[float, int | None] | None = None
    buckets: dict[str, list[list[float]]] = field(default_factory=dict)
    extra: Any = None

    def __post_init__(self) -> None:
        if self.version != 1:
            raise ValueError(f"version {self.version}")


def test_typed_state_round_trips_unchanged() -> None:
    raw = {"version": 1, "boot_id": "b", "seen": True,
           "recs": [{"start": 1, "n": 2, "kind": "state"}, {"start": 1.5, "n": 0, "kind": "merged"}],
           "by_key": {"a/1": {"start": 3.25, "n": 1, "kind": "x"}}, "rate": [400.0, None],
           "buckets": {"c": [[60.0, 2.0]]}, "extra": {"any": ["thing"]}}
    state = load_state(_State, raw)
    assert state.recs[0] == _Rec(1, 2, "state") and state.rate == (400.0, None)
    assert dump_state(state) == raw
    assert json.dumps(dump_state(state), sort_keys=True) == json.dumps(raw, sort_keys=True)


def test_missing_fields_take_their_defaults() -> None:
    assert load_state(_State, {"boot_id": "b"}) == _State(boot_id="b")


@pytest.mark.parametrize(("raw", "why"), [
    ({"version": 2}, "state: version 2"),
    ({"junk": 1}, "state: unknown key(s) junk"),
    ({"boot_id": 3}, "state.boot_id: expected a string, got 3 / expected null, got 3"),
    ({"seen": "yes"}, "state.seen: expected a boolean, got 'yes'"),
    ({"recs": [{"start": 1, "n": 1.5, "kind": "x"}]}, "state.recs[0].n: expected an integer, got 1.5"),
    ({"recs": [{"start": True, "n": 1, "kind": "x"}]},
     "state.recs[0].start: expected a finite number, got True"),
    ({"recs": [{"start": float("inf"), "n": 1, "kind": "x"}]}, "expected a finite number, got inf"),
    ({"recs": [{"start": 1, "kind": "x"}]}, "state.recs[0]:"),
    ({"recs": {}}, "state.recs: expected a list, got {}"),
    ({"by_key": {"a": None}}, "state.by_key['a']: expected a mapping, got None"),
    ({"rate": [1.0]}, "state.rate: expected a list of 2"),
    ({"buckets": {"c": [[1.0, "x"]]}}, "state.buckets['c'][0][1]: expected a finite number"),
])
def test_state_of_another_shape_is_refused_with_its_reason(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(StateError) as err:
        load_state(_State, raw)
    assert why in str(err.value)


def test_restore_starts_afresh_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    raw: dict[str, Any] = {"version": 1, "seen": "yes"}
    with caplog.at_level(logging.WARNING, logger="gpumon.bootstate"):
        state = restore(_State, raw, check="t")
    assert state == _State()
    assert raw == dump_state(_State())  # the mapping follows: what is saved next is the fresh state
    assert "saved state of check t refused, starting afresh: state.seen: expected a boolean" in caplog.text
    good = {**dump_state(_State(boot_id="b")), "recs": [{"start": 1.0, "n": 1, "kind": "k"}]}
    assert restore(_State, dict(good), check="t") == load_state(_State, good)
    assert restore(_State, {}, check="t") == _State()


def test_dump_refuses_what_is_not_a_dataclass() -> None:
    with pytest.raises(TypeError):
        dump_state({"a": 1})


def test_a_refused_state_file_is_copied_aside_before_the_fresh_state_replaces_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "demo.json").write_text('{"recs": 5}')
    state = CheckStateStore(tmp_path).get("demo")
    with caplog.at_level(logging.WARNING, logger="gpumon"):
        fresh = restore(_State, state, check="demo")
    assert fresh == _State()
    (copy,) = tmp_path.glob("demo.refused-*")
    assert copy.read_text() == '{"recs": 5}' and str(copy) in caplog.text
