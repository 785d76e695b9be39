"""HostFs.read_batch and read_attr: the cheap bounded reads of the 1 s InfiniBand sampler.

Each file must read exactly as ``read_many`` reads it (text, NotSupported, HwFailure),
and a read that hangs (a FIFO with no writer: ``open`` blocks, as a sysfs read behind a
dead device can) must cost only that file, within the timeout.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpumon.errors import HwCondition, HwFailure, HwTimeout, NotSupported
from gpumon.hw import Hardware
from gpumon.hw.calls import LaneHung
from gpumon.hw.hostfs import MAX_ATTR_BYTES, read_attr


def _same(a: str | HwCondition, b: str | HwCondition) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (type(a), str(a), a.call, a.component) == (type(b), str(b), b.call, b.component)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096 + 5, MAX_ATTR_BYTES, MAX_ATTR_BYTES + 10])
def test_read_attr_reads_what_a_buffered_read_does(tmp_path: Path, size: int) -> None:
    path = tmp_path / "attr"
    path.write_bytes(bytes(i % 251 for i in range(size)))
    with open(path, "rb") as fh:
        want = fh.read(MAX_ATTR_BYTES)
    assert read_attr(str(path)) == want
    assert len(want) == min(size, MAX_ATTR_BYTES)


def test_read_attr_reads_past_a_short_read(tmp_path: Path) -> None:
    # procfs seq_files answer a record at a time: a short read is not the end of the file.
    # A FIFO written in two parts gives the reader a short read first.
    path = tmp_path / "fifo"
    os.mkfifo(path)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b"4: ")
        time.sleep(0.05)
        os.write(fd, b"ACTIVE\n")
        os.close(fd)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert read_attr(str(path)) == b"4: ACTIVE\n"
    finally:
        writer.join()


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=9000))
def test_read_batch_text_is_read_many_text(data: bytes) -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "a").write_bytes(data)
        fs = Hardware(root).fs
        assert fs.read_batch(["a"]) == fs.read_many(["a"])


def test_read_batch_conditions_are_read_many_conditions(tmp_path: Path) -> None:
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "state").write_text("4: ACTIVE\n")
    (tmp_path / "sys" / "adir").mkdir()
    (tmp_path / "sys" / "noperm").write_text("x")
    os.chmod(tmp_path / "sys" / "noperm", 0)
    rels = ["sys/state", "sys/missing", "sys/adir", "sys/noperm"]
    fs = Hardware(tmp_path).fs
    many = fs.read_many(rels, "ib/mlx5_0/1")
    batch = fs.read_batch(rels, dict.fromkeys(rels, "ib/mlx5_0/1"))
    assert list(batch) == rels
    assert all(_same(batch[r], many[r]) for r in rels), (batch, many)
    assert batch["sys/state"] == "4: ACTIVE"
    assert isinstance(batch["sys/missing"], NotSupported)
    assert isinstance(batch["sys/adir"], HwFailure) and "Is a directory" in str(batch["sys/adir"])
    if os.geteuid() != 0:  # root reads a mode-000 file
        assert isinstance(batch["sys/noperm"], HwFailure)


def test_read_batch_gives_each_file_its_component(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    got = Hardware(tmp_path).fs.read_batch(["a", "b"], {"a": "ib/x/1", "b": "ib/y/1"})
    assert got["a"] == "1"
    assert isinstance(got["b"], NotSupported) and got["b"].component == "ib/y/1"


@pytest.fixture
def fifo_root(tmp_path: Path) -> Iterator[Path]:
    """A root whose sys/stuck is a FIFO nobody writes: reading it blocks until the test
    opens it for writing at the end (so the worker thread does not outlive the test)."""
    (tmp_path / "sys").mkdir()
    for name in ("before", "after"):
        (tmp_path / "sys" / name).write_text(name + "\n")
    os.mkfifo(tmp_path / "sys" / "stuck")
    yield tmp_path
    _release(tmp_path / "sys" / "stuck")


def _release(fifo: Path) -> None:
    """Let a reader blocked on ``fifo`` go (it reads end of file); nothing if none waits."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return
    os.close(fd)


def test_a_hung_read_costs_only_that_file(fifo_root: Path) -> None:
    """Issue 14 #3: the files after a stuck one are read (on another worker), not "not attempted"."""
    fs = Hardware(fifo_root, fs_timeout=0.3).fs
    rels = ["sys/before", "sys/stuck", "sys/after"]
    comps = {"sys/before": "ib/a/1", "sys/stuck": "ib/b/1", "sys/after": "ib/c/1"}
    start = time.monotonic()
    got = fs.read_batch(rels, comps)
    assert time.monotonic() - start < 1.0
    assert (got["sys/before"], got["sys/after"]) == ("before", "after")
    stuck = got["sys/stuck"]
    assert isinstance(stuck, HwTimeout)
    assert (stuck.call, stuck.component, stuck.seconds) == ("read(sys/stuck)", "ib/b/1", 0.3)
    assert "did not return within 0.3 s" in str(stuck)


def test_a_file_still_stuck_is_refused_at_once_and_the_others_read(fifo_root: Path) -> None:
    fs = Hardware(fifo_root, fs_timeout=0.5).fs
    rels = ["sys/before", "sys/stuck", "sys/after"]
    fs.read_batch(rels, label="sample")
    start = time.monotonic()
    again = fs.read_batch(rels, label="sample")
    assert time.monotonic() - start < 0.25  # the stuck file is not waited for again (0.5 s)
    assert (again["sys/before"], again["sys/after"]) == ("before", "after")
    cond = again["sys/stuck"]
    assert isinstance(cond, LaneHung) and cond.call == "read(sys/stuck)" and cond.seconds == 0.5
    assert "not attempted" in str(cond)
    # read on its own: the same answer, at once; other files and listings are not held up
    with pytest.raises(LaneHung):
        fs.read_text("sys/stuck")
    assert fs.read_text("sys/after") == "after" and "stuck" in fs.listdir("sys")
    assert time.monotonic() - start < 0.4


def test_reads_of_different_files_do_not_wait_behind_a_stuck_one(fifo_root: Path) -> None:
    """Issue 14 #3: a read queued behind a stuck one (another thread's) moves to another worker."""
    fs = Hardware(fifo_root, fs_timeout=1.0).fs
    hung: list[BaseException] = []

    def stuck() -> None:
        try:
            fs.read_text("sys/stuck")
        except HwTimeout as exc:
            hung.append(exc)

    t = threading.Thread(target=stuck)
    t.start()
    time.sleep(0.1)  # the FIFO read is in progress, not yet past its bound
    start = time.monotonic()
    assert fs.read_text("sys/before") == "before" and fs.read_many(["sys/after"]) == {"sys/after": "after"}
    assert time.monotonic() - start < 0.5
    t.join(3)
    assert hung and "did not return within 1 s" in str(hung[0])


def test_a_hung_read_that_returns_lets_the_file_be_read_again(fifo_root: Path) -> None:
    fs = Hardware(fifo_root, fs_timeout=0.2).fs
    with pytest.raises(HwTimeout):
        fs.read_text("sys/stuck")
    _release(fifo_root / "sys" / "stuck")  # the stuck read returns (end of file)
    deadline = time.monotonic() + 2
    while fs._caller.known_hung("hostfs", "read(sys/stuck)") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fs._caller.known_hung("hostfs", "read(sys/stuck)") is None
    (fifo_root / "sys" / "stuck").unlink()
    (fifo_root / "sys" / "stuck").write_text("now a file\n")
    assert fs.read_text("sys/stuck") == "now a file"


def test_the_boot_id_survives_a_hung_read(tmp_path: Path) -> None:
    """Issue 14 #3: a hung boot-id read gives the id read before (a hung read is no reboot) and
    raises nothing: the daemon keys its state on it and must not stop for it."""
    boot = tmp_path / "proc" / "sys" / "kernel" / "random" / "boot_id"
    boot.parent.mkdir(parents=True)
    boot.write_text("boot-1\n")
    fs = Hardware(tmp_path, fs_timeout=0.2).fs
    assert fs.boot_id() == "boot-1"
    boot.unlink()
    os.mkfifo(boot)
    try:
        assert fs.boot_id() == "boot-1"  # hung: the id read last
        assert fs.boot_id() == "boot-1"  # still stuck: refused at once, same answer
        assert Hardware(tmp_path, fs_timeout=0.2).fs.boot_id() is None  # never read: unknown
    finally:
        _release(boot)
        _release(boot)


# -- read_text and read_many read through read_attr: the same text, conditions and bound as
# the buffered ``open(path, "rb").read(MAX_ATTR_BYTES)`` they used before


def _buffered(root: Path, rel: str, comp: str) -> str | HwCondition:
    """What read_text and read_many gave for one file when they read it buffered."""
    path = f"{root}/{rel}"
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_ATTR_BYTES)
    except FileNotFoundError:
        return NotSupported(f"{path} does not exist", call=f"read({rel})", component=comp)
    except OSError as exc:
        return HwFailure(f"cannot read {path}: {exc.strerror}", call=f"read({rel})", component=comp)
    return data.decode("utf-8", errors="replace").strip()


def _text(root: Path, rel: str, comp: str) -> str | HwCondition:
    try:
        return Hardware(root).fs.read_text(rel, comp)
    except HwCondition as cond:
        return cond


@settings(max_examples=50, deadline=None)
@given(st.builds(lambda head, pad, tail: head + b"7" * pad + tail,  # past a 4 KiB chunk, often
                 st.binary(max_size=64) | st.text(max_size=64).map(lambda s: f" \n{s}".encode()),
                 st.integers(0, 9000), st.binary(max_size=64)))
def test_read_text_and_read_many_give_the_buffered_text(data: bytes) -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        (root / "a").write_bytes(data)
        want = _buffered(root, "a", "node")
        assert _text(root, "a", "node") == want
        assert Hardware(root).fs.read_many(["a"]) == {"a": want}


@pytest.mark.parametrize("size", [0, 4096, 4097, MAX_ATTR_BYTES, MAX_ATTR_BYTES + 10])
def test_read_text_and_read_many_stop_at_the_same_bound(tmp_path: Path, size: int) -> None:
    (tmp_path / "a").write_bytes(b"7" * size)
    want = _buffered(tmp_path, "a", "node")
    assert isinstance(want, str) and len(want) == min(size, MAX_ATTR_BYTES)
    assert _text(tmp_path, "a", "node") == want
    assert Hardware(tmp_path).fs.read_many(["a"])["a"] == want


def test_read_text_and_read_many_give_the_buffered_conditions(tmp_path: Path) -> None:
    sys_dir = tmp_path / "sys"
    sys_dir.mkdir()
    (sys_dir / "state").write_text("4: ACTIVE\n")
    (sys_dir / "adir").mkdir()
    (sys_dir / "noperm").write_text("x")
    os.chmod(sys_dir / "noperm", 0)
    os.symlink("nowhere", sys_dir / "dangling")
    os.symlink("loop", sys_dir / "loop")
    rels = ["sys/state", "sys/missing", "sys/adir", "sys/noperm", "sys/state/under", "sys/dangling",
            "sys/loop"]
    comp = "ib/mlx5_0/1"
    want = {rel: _buffered(tmp_path, rel, comp) for rel in rels}
    many = Hardware(tmp_path).fs.read_many(rels, comp)
    assert list(many) == rels
    for rel in rels:
        assert _same(many[rel], want[rel]), (rel, many[rel], want[rel])
        assert _same(_text(tmp_path, rel, comp), want[rel]), rel
    # what the reference gives is what these cases must be
    assert want["sys/state"] == "4: ACTIVE"
    assert isinstance(want["sys/missing"], NotSupported) and isinstance(want["sys/dangling"], NotSupported)
    for rel, why in (("sys/adir", "Is a directory"), ("sys/state/under", "Not a directory"),
                     ("sys/loop", "Too many levels of symbolic links")):
        assert isinstance(want[rel], HwFailure) and why in str(want[rel]), rel


def test_read_text_reads_past_a_short_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")

    def write() -> None:
        fd = os.open(tmp_path / "fifo", os.O_WRONLY)
        os.write(fd, b"4: ")
        time.sleep(0.05)
        os.write(fd, b"ACTIVE\n")
        os.close(fd)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert Hardware(tmp_path).fs.read_text("fifo") == "4: ACTIVE"
    finally:
        writer.join()


def test_a_hung_read_text_is_a_timeout_within_its_bound(fifo_root: Path) -> None:
    fs = Hardware(fifo_root, fs_timeout=0.3).fs
    start = time.monotonic()
    with pytest.raises(HwTimeout) as info:
        fs.read_text("sys/stuck", "ib/b/1")
    assert time.monotonic() - start < 1.0
    assert info.value.component == "ib/b/1"
