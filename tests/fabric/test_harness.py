"""The multi-node test harness itself, proven without gpumon's probe: real gloo, torchrun and Slurm
across test hosts in network namespaces (DESIGN.md, Testing without GPUs, 4 and 6).

What ranks need to talk across the namespaces (found here, with torch 2.13 and Slurm 22.05.8):

* gloo: ``GLOO_SOCKET_IFNAME=eth0``. Without it gloo picks its address from the hostname; a name that
  does not resolve (a host's own UTS name ``node<i>``) makes it fall back to 127.0.0.1, and the
  ranks time out connecting to each other's loopback. With ``TestNet(n, hosts_file=True)`` the names
  resolve to the eth0 addresses and gloo works without the variable.
* Plain ``init_process_group(init_method="env://")``: ``MASTER_ADDR`` must be an address (or a name
  that resolves in every namespace), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``.
* torchrun with ``--rdzv-backend=c10d --rdzv-endpoint=<host0 ip>:<port>``: the agent decides whether
  it hosts the rendezvous store by resolving its own hostname (``getaddrinfo(gethostname())``, which
  raises if the name does not resolve) and comparing the addresses with the endpoint. Two ways work:
  (a) names resolve (``hosts_file=True``, each agent with hostname ``node<i>``): nothing else needed,
  the workers get ``MASTER_ADDR=node0``; (b) names do not resolve: pass ``--rdzv-conf=is_host=1`` on
  the endpoint's host and ``is_host=0`` elsewhere, and ``--local-addr=<own ip>`` (otherwise the
  workers' ``MASTER_ADDR`` is rank 0's unresolvable hostname). Both need ``GLOO_SOCKET_IFNAME=eth0``
  (or resolvable names). When the store's host finishes first, the other agent logs a
  ``RendezvousConnectionError`` while shutting down and still exits 0.
* Slurm: node names (``node<i>``) do not resolve in the tasks (slurmd runs with the root mount
  namespace, so no ``/etc/netns`` hosts file applies, and there is no DNS). ``MASTER_ADDR`` must be the
  first node's ``NodeAddr``: first name of ``scontrol show hostnames $SLURM_JOB_NODELIST``, then
  ``scontrol show node -o <name>`` -> ``NodeAddr=``. ``scontrol`` reaches slurmctld from a task (the
  task inherits ``SLURM_CONF`` from srun's environment). srun and every client command run in the
  switch namespace (``SlurmCluster.client``); ``SLURM_LAUNCH_NODE_IPADDR`` in a task is the switch's
  address, not a node's.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from .netns import TestNet, list_namespaces, unavailable
from .slurm_cluster import SlurmCluster

PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
ALLREDUCE = str(Path(__file__).with_name("allreduce.py"))
PORT = 29500
GLOO_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}
# what a launcher sets for its ranks: never inherited from the environment pytest runs in
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

NetFactory = Callable[..., TestNet]


def rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_", "PYTEST_"))}
    return {**env, **GLOO_ENV, "OMP_NUM_THREADS": "1", **extra}


def _lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def start_ranks(net: TestNet, hosts: Sequence[int], *args: str, master: int | None = None,
                env: Mapping[str, str] | None = None, wait_stdin: bool = False,
                ) -> list[subprocess.Popen[str]]:
    """One allreduce.py rank per host in ``hosts`` (rank = position), hostname = the host's name."""
    master_ip = net.hosts[hosts[0] if master is None else master].ip
    procs = []
    for rank, i in enumerate(hosts):
        env_i = rank_env(**(env or {}), MASTER_ADDR=master_ip, MASTER_PORT=str(PORT), RANK=str(rank),
                         WORLD_SIZE=str(len(hosts)))
        argv = [PY, ALLREDUCE, *args, *(["--wait-stdin"] if wait_stdin else [])]
        procs.append(net.popen(i, argv, env=env_i, hostname=net.hosts[i].name, text=True,
                               stdin=subprocess.PIPE if wait_stdin else subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def finish(procs: Sequence[subprocess.Popen[str]], timeout: float = 60) -> list[dict[str, Any]]:
    """Wait for every rank (bounded), assert it exited 0, return its result line."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, f"{p.args!r}: exit {p.returncode}\n{out}\n{err[-3000:]}"
        [result] = [r for r in _lines(out) if "sum" in r]
        results.append(result)
    return results


def read_line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no line from {proc.args!r} within {timeout} s")
    line = proc.stdout.readline()
    assert line, f"{proc.args!r} exited {proc.poll()}"
    return dict(json.loads(line))


def assert_gone(net: TestNet, procs: Sequence[subprocess.Popen[Any]], pids: Sequence[int]) -> None:
    """After ``net.close()``: every process started is reaped, none of the pids seen runs, no namespace
    of this TestNet is left."""
    assert all(p.returncode is not None for p in procs)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]]
    assert not alive, f"still running after close: {alive}"
    left = [ns for ns in list_namespaces() if ns.startswith(net.prefix)]
    assert not left, f"namespaces left after close: {left}"


# -- the namespaces themselves -------------------------------------------------------------------


def test_hosts_reach_each_other_and_nothing_lands_in_the_root_namespace(testnet: NetFactory) -> None:
    def root_view() -> str:
        return "".join(subprocess.run(["ip", "-o", *a], capture_output=True, text=True, timeout=10).stdout
                       for a in (["link"], ["addr"], ["route"]))

    before = root_view()
    net = testnet(3)
    assert [h.ip for h in net.hosts] == [f"{net.switch_ip.rsplit('.', 1)[0]}.{i}" for i in (1, 2, 3)]
    assert root_view() == before, "TestNet changed the root namespace"
    addrs = net.run(2, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
    assert f"inet {net.hosts[2].ip}/24" in addrs
    # connect to the discard port: ECONNREFUSED (111) is a reset from the peer, i.e. it is reachable
    # (an unreachable one would time out: 11)
    connect = ("import socket, sys\n"
               "for ip in sys.argv[1:]:\n"
               "    s = socket.socket(); s.settimeout(2); print(ip, s.connect_ex((ip, 9))); s.close()\n")
    out = net.run(0, [PY, "-c", connect, net.hosts[1].ip, net.hosts[2].ip, net.switch_ip])
    assert out.returncode == 0 and out.stdout.split() == [
        net.hosts[1].ip, "111", net.hosts[2].ip, "111", net.switch_ip, "111"], out
    assert net.run(1, ["hostname"], hostname="node1").stdout.strip() == "node1"
    net.close()
    assert root_view() == before


def test_stale_namespaces_of_a_dead_run_are_removed(testnet: NetFactory) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"gpmf{dead.pid}n0h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, capture_output=True, timeout=10)
    try:
        testnet(1)
        assert stale not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=10)


def test_a_missing_capability_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no bridge here"):
        unavailable("no bridge here")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no bridge here"):
        unavailable("no bridge here")


# -- gloo across namespaces ----------------------------------------------------------------------


def test_gloo_allreduce_one_rank_per_namespace(testnet: NetFactory) -> None:
    net = testnet(4)
    procs = start_ranks(net, range(4), "--timeout", "30")
    results = finish(procs)
    assert [r["sum"] for r in results] == [10.0] * 4
    assert all(r["ok"] for r in results)
    assert sorted(r["host"] for r in results) == ["node0", "node1", "node2", "node3"]
    assert net.pids() == [], "a rank outlived its process"
    net.close()
    assert_gone(net, procs, [p.pid for p in procs])


def test_tbf_really_slows_a_host(testnet: NetFactory) -> None:
    # two 2-rank jobs side by side: hosts 0-1 unshaped, hosts 2-3 with host 3 at 20 Mbit/s both ways.
    # 2 MiB ring all_reduce: each rank sends and receives ~2 MiB = 16.8 Mbit -> ~0.85 s shaped
    net = testnet(4)
    net.shape(3, rate="20mbit")
    assert net.qdiscs(3).count("tbf") == 2 and "tbf" not in net.qdiscs(2)
    fast = start_ranks(net, [0, 1], "--mib", "2", "--timeout", "30")
    slow = start_ranks(net, [2, 3], "--mib", "2", "--timeout", "30")
    t_fast = max(r["elapsed_s"] for r in finish(fast))
    t_slow = max(r["elapsed_s"] for r in finish(slow))
    print(f"2 MiB all_reduce: unshaped {t_fast * 1000:.1f} ms, shaped (20mbit) {t_slow * 1000:.1f} ms, "
          f"ratio {t_slow / t_fast:.0f}x")
    assert t_slow > 0.5, "the shaped pair was not limited to ~20 Mbit/s"
    assert t_slow > 5 * t_fast
    net.unshape(3)
    assert "tbf" not in net.qdiscs(3)


def test_link_down_stalls_a_collective_and_close_kills_everything(testnet: NetFactory) -> None:
    net = testnet(2)
    procs = start_ranks(net, [0, 1], "--timeout", "60", wait_stdin=True)
    for p in procs:
        assert read_line(p, timeout=60) == {"rank": procs.index(p), "ready": True}
    net.link_down(1)  # host 1 loses the network between two collectives
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    time.sleep(3)
    assert [p.poll() for p in procs] == [None, None], "an all_reduce with a cut-off peer finished"
    pids = net.pids()
    assert {p.pid for p in procs} <= set(pids)
    net.close()
    assert_gone(net, procs, pids)


# -- torchrun ------------------------------------------------------------------------------------


@pytest.mark.parametrize("names_resolve", [True, False], ids=["names-resolve", "addresses-only"])
def test_torchrun_c10d_rendezvous_across_namespaces(testnet: NetFactory, names_resolve: bool) -> None:
    net = testnet(2, hosts_file=names_resolve)
    endpoint = f"{net.hosts[0].ip}:29400"
    procs = []
    for h in net.hosts:
        argv = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", "--rdzv-id=harness", "--max-restarts=0",
                "--monitor-interval=0.5"]
        if not names_resolve:
            argv += [f"--rdzv-conf=is_host={int(h.index == 0)}", f"--local-addr={h.ip}"]
        procs.append(net.popen(h.index, [*argv, ALLREDUCE, "--timeout", "30"], env=rank_env(),
                               hostname=h.name, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = finish(procs, timeout=90)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert sorted(r["host"] for r in results) == ["node0", "node1"]
    assert {r["master"] for r in results} == {"node0" if names_resolve else net.hosts[0].ip}
    net.close()
    assert_gone(net, procs, [p.pid for p in procs])


# -- Slurm across namespaces ---------------------------------------------------------------------


def test_srun_runs_on_two_named_nodes(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.srun(["hostname"], nodes=2, ntasks_per_node=1, timeout=30)
    assert proc.returncode == 0, proc.stderr + slurm_cluster.logs()
    names = proc.stdout.split()
    assert len(names) == 2 and len(set(names)) == 2 and set(names) <= set(slurm_cluster.nodes), names


def test_node_names_do_not_resolve_in_slurm_tasks(slurm_cluster: SlurmCluster) -> None:
    # why the probe must take MASTER_ADDR from NodeAddr, not from the node name
    proc = slurm_cluster.srun(["sh", "-c", 'getent hosts node0 || echo "unresolved $?"'], nodes=1, timeout=30)
    assert proc.stdout.strip() == "unresolved 2", proc


def test_srun_gloo_allreduce_across_two_slurm_nodes(slurm_cluster: SlurmCluster) -> None:
    proc = slurm_cluster.srun([PY, ALLREDUCE, "--timeout", "30", "--master-from", "nodeaddr"],
                              nodes=2, ntasks_per_node=1, env={**GLOO_ENV, "MASTER_PORT": str(PORT),
                                                                "OMP_NUM_THREADS": "1"},
                              timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    results = sorted(_lines(proc.stdout), key=lambda r: r["rank"])
    assert [(r["rank"], r["sum"], r["ok"]) for r in results] == [(0, 3.0, True), (1, 3.0, True)]
    assert len({r["host"] for r in results}) == 2
    first = results[0]["host"]
    assert results[0]["master"] == slurm_cluster.net.hosts[slurm_cluster.nodes.index(first)].ip


def test_drain_reason_is_read_back(slurm_cluster: SlurmCluster) -> None:
    try:
        proc = slurm_cluster.scontrol("update", "NodeName=node1", "State=DRAIN", "Reason=gpumon: test")
        assert proc.returncode == 0, proc.stderr
        assert slurm_cluster.sinfo_reasons() == {"node1": ("drained", "gpumon: test")}
    finally:
        slurm_cluster.resume("node1")
    assert slurm_cluster.sinfo_reasons() == {}
