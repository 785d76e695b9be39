"""A check's declared ``State`` through the real runner and store: loaded from the saved file and
checked once, refused (logged, file copied aside) when of another shape, saved as JSON (fields at
their omitted default left out), reset at a reboot keeping ``keep_across_boots``, set aside after
two raises on it, and ``save_state_now`` for a change a crash must not lose."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpumon.bootstate import OMIT_DEFAULT, BootState
from gpumon.check import Check, CheckContext
from gpumon.checkstate import CheckState, CheckStateStore
from gpumon.config import CheckSettings, Config
from gpumon.hw import Hardware
from gpumon.hw.inventory import Inventory
from gpumon.model import NODE, Finding
from gpumon.profiles import GENERIC
from gpumon.runner import Runner


@dataclass
class CountsState(BootState):
    runs: int = 0
    history: dict[str, int] = field(default_factory=dict)
    note: str | None = field(default=None, metadata=OMIT_DEFAULT)
    keep_across_boots = ("history",)

    def __post_init__(self) -> None:
        if self.runs < 0:
            raise ValueError("a negative run count")


class Counts(Check):
    name = "counts"
    State = CountsState
    loads = 0
    boom = False
    urgent = False

    def run(self, ctx: CheckContext) -> list[Finding]:
        state = ctx.state_as(CountsState)
        state.runs += 1
        state.history[ctx.state.name or "?"] = state.runs
        if Counts.boom:
            raise RuntimeError("a bug")
        if Counts.urgent:
            ctx.save_state_now()
        return [self.ok(NODE, f"run {state.runs}")]


def _boot(root: Path, boot: str) -> None:
    path = root / "proc" / "sys" / "kernel" / "random" / "boot_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot + "\n")


def _runner(root: Path, store: CheckStateStore) -> Runner:
    config = Config(check_settings={"counts": CheckSettings(timeout_s=5.0)})
    return Runner(Hardware(root), Inventory(), GENERIC, config, node="test", states=store)


def _message(runner: Runner) -> str:
    return runner.run([Counts()])[0].findings[0].message


@pytest.fixture(autouse=True)
def _reset() -> None:
    Counts.boom = Counts.urgent = False


def test_declared_state_is_kept_typed_saved_as_json_and_read_back(tmp_path: Path) -> None:
    _boot(tmp_path, "b1")
    store = CheckStateStore(tmp_path / "checks")
    runner = _runner(tmp_path, store)
    assert [_message(runner) for _ in range(3)] == ["run 1", "run 2", "run 3"]
    assert isinstance(store.get("counts").typed, CountsState)
    assert not (tmp_path / "checks" / "counts.json").exists()  # saved by the daemon's timer, not per run
    assert store.save("counts")
    saved = json.loads((tmp_path / "checks" / "counts.json").read_text())
    assert saved == {"boot_id": "b1", "runs": 3, "history": {"counts": 3}}  # note: None is left out
    assert store.get("counts") == saved  # the store's mapping holds what it saved
    restarted = _runner(tmp_path, CheckStateStore(tmp_path / "checks"))
    assert _message(restarted) == "run 4"


def test_a_reboot_resets_all_but_what_the_state_keeps(tmp_path: Path) -> None:
    _boot(tmp_path, "b1")
    store = CheckStateStore(tmp_path / "checks")
    runner = _runner(tmp_path, store)
    _message(runner)
    _message(runner)
    _boot(tmp_path, "b2")
    assert _message(runner) == "run 1"
    state = store.get("counts").typed
    assert isinstance(state, CountsState)
    assert (state.boot_id, state.history) == ("b2", {"counts": 1})  # kept across the boot, then run 1


def test_state_of_another_shape_is_refused_logged_and_copied_aside(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    _boot(tmp_path, "b1")
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "counts.json").write_text('{"boot_id": "b1", "runs": -4}')
    store = CheckStateStore(tmp_path / "checks")
    with caplog.at_level(logging.WARNING, logger="gpumon"):
        assert _message(_runner(tmp_path, store)) == "run 1"
    assert "saved state of check counts refused, starting afresh: state: a negative run count" in caplog.text
    (copy,) = (tmp_path / "checks").glob("counts.refused-*")
    assert copy.read_text() == '{"boot_id": "b1", "runs": -4}'
    assert store.save("counts")
    assert json.loads((tmp_path / "checks" / "counts.json").read_text())["runs"] == 1


def test_state_a_check_raises_on_twice_after_loading_is_set_aside(tmp_path: Path) -> None:
    _boot(tmp_path, "b1")
    (tmp_path / "checks").mkdir()
    (tmp_path / "checks" / "counts.json").write_text('{"boot_id": "b1", "runs": 40}')
    store = CheckStateStore(tmp_path / "checks")
    runner = _runner(tmp_path, store)
    Counts.boom = True
    assert "set aside" not in _message(runner)
    assert "set aside" in _message(runner)
    assert list((tmp_path / "checks").glob("counts.corrupt-*"))
    Counts.boom = False
    assert _message(runner) == "run 1"  # the typed state went with the file


def test_save_state_now_writes_the_typed_state_at_once(tmp_path: Path) -> None:
    _boot(tmp_path, "b1")
    store = CheckStateStore(tmp_path / "checks")
    Counts.urgent = True
    _message(_runner(tmp_path, store))
    assert json.loads((tmp_path / "checks" / "counts.json").read_text())["runs"] == 1


def test_a_context_built_by_hand_reads_a_plain_mapping_and_changes_nothing_in_it(tmp_path: Path) -> None:
    _boot(tmp_path, "b1")
    raw: dict[str, Any] = {"boot_id": "b1", "runs": 7, "history": {}}
    ctx = CheckContext(hw=Hardware(tmp_path), inventory=Inventory(), profile=GENERIC, options=None,
                       state=raw, kernel_log=None)  # type: ignore[arg-type]
    assert Counts().run(ctx)[0].message == "run 8"
    assert raw["runs"] == 7 and isinstance(ctx.state, CheckState)
    assert not ctx.save_state_now()  # nothing persists it
    with pytest.raises(TypeError):
        ctx.state_as(int)  # type: ignore[type-var]
