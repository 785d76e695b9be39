"""``gpumon.atomic.write_atomic`` on a real full file system (a 64 KiB tmpfs; skipped where this
machine does not allow mounts): the old file stays whole and no temporary file is left."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from gpumon.atomic import write_atomic


def test_a_write_that_fails_for_space_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
    try:
        target = mnt / "report.json"
        write_atomic(target, "old")
        with pytest.raises(OSError) as err:
            write_atomic(target, b"x" * (256 * 1024))
        assert err.value.errno == errno.ENOSPC
        assert target.read_text() == "old"
        assert sorted(p.name for p in mnt.iterdir()) == ["report.json"]
        write_atomic(target, "new")  # room again once the big write gave its space back
        assert target.read_text() == "new"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
