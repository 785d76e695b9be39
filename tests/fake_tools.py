"""Small real programs that play external tools for the tests: perftest's ``ib_write_bw`` and
DCGM's ``dcgmi``, replaying real captures (tests/data/perftest, tests/data/dcgmi-diag; provenance in
their SOURCES.md). Put their directory on the ToolRunner's search path, or on PATH for the CLI.
"""

from __future__ import annotations

from pathlib import Path

PERFTEST_DATA = Path(__file__).resolve().parent / "data" / "perftest"
DCGMI_DATA = Path(__file__).resolve().parent / "data" / "dcgmi-diag"
WRITE_BW = (PERFTEST_DATA / "issue_perftest-132_ib_write_bw_-a_IB_mlx5_0_gbits_PARTIAL.txt").read_text()
POST_LIST = (PERFTEST_DATA
             / "issue_perftest-273_ib_write_bw_postlist_8B_60s_gbits_complete-table.txt").read_text()
RULE = "-" * 87


def replay_with_row(avg: float, size: int = 8388608) -> str:
    """The real ib_write_bw capture's header and column layout, with one result row of ``size`` bytes."""
    head = WRITE_BW[: WRITE_BW.index(" 2          5000")]
    return f"{head} {size}    5000           {avg + 1:.2f}            {avg:.2f}            0.005839\n{RULE}\n"


def fake_perftest(tmp_path: Path, outputs: dict[str, str], *, cuda: bool = True, client_sleep: float = 0,
                  refuse_first: bool = False) -> tuple[Path, Path]:
    """A directory holding an ib_write_bw that replays ``outputs[<device>[-gpu<N>]]`` (or ``default``)."""
    bin_dir = tmp_path / "bin"
    out_dir = tmp_path / "outputs"
    bin_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        (out_dir / f"{name}.txt").write_text(text)
    log = tmp_path / "argv.log"
    refused = tmp_path / "refused-once"
    usage = ("echo '      --use_cuda=<cuda device id>  Use CUDA specific device for GPUDirect RDMA testing'"
             if cuda else "echo '  -d, --ib-dev=<dev>  Use IB device <dev> (default first device found)'")
    script = bin_dir / "ib_write_bw"
    script.write_text(f"""#!/bin/sh
# replays a perftest capture (tests/fake_tools.py)
prev=""; dev=""; gpu=""; last=""
for a in "$@"; do
  [ "$prev" = "-d" ] && dev="$a"
  case "$a" in --use_cuda=*) gpu="${{a#--use_cuda=}}";; --help) {usage}; exit 0;; esac
  prev="$a"; last="$a"
done
echo "$CUDA_DEVICE_ORDER $*" >> {log}
if [ "$last" != "localhost" ]; then sleep {0.8 if refuse_first else 0.05}; exit 0; fi
if [ {int(refuse_first)} = 1 ] && [ ! -e {refused} ]; then
  touch {refused}
  echo " Couldn't connect to localhost:18515"
  echo " Unable to open file descriptor for socket connection Unable to init the socket connection"
  exit 1
fi
sleep {client_sleep}
f={out_dir}/$dev${{gpu:+-gpu$gpu}}.txt
[ -f "$f" ] || f={out_dir}/default.txt
[ -f "$f" ] && exec cat "$f"
echo " Couldn't allocate MR" >&2
echo " Failed to create MR" >&2
exit 1
""")
    script.chmod(0o755)
    return bin_dir, log


def fake_dcgmi(tmp_path: Path, capture: str | None, *, exit_code: int = 0, sleep: float = 0,
               stderr: str = "") -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "dcgmi.log"
    out = tmp_path / "dcgmi-output.txt"
    out.write_text(capture or "")
    script = bin_dir / "dcgmi"
    err = f"echo '{stderr}' >&2\n" if stderr else ""
    script.write_text(f"#!/bin/sh\n# replays a dcgmi capture (tests/fake_tools.py)\n"
                      f"echo \"$*\" >> {log}\nsleep {sleep}\ncat {out}\n{err}exit {exit_code}\n")
    script.chmod(0o755)
    return bin_dir, log
