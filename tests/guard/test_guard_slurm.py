"""gpumon.guard in a job that Slurm started: ``srun`` on a real Slurm cluster whose nodes are test
hosts in network namespaces (tests/fabric/slurm_cluster.py: one slurmd each, its own host name), two
nodes of two tasks each, gloo over the hosts' eth0. The ranks know only what a Slurm step gives them
(``SLURMD_NODENAME``, ``SLURM_LOCALID``; a ``NODE_NAME`` left in the environment is not the node's
name there), and a verdict names the Slurm node, its host and the local rank on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fabric.netns import TestNet
from fabric.probe_run import rank_env
from fabric.slurm_cluster import SlurmCluster, require_slurm

from gpumon.guard import verdict as vf

RANKS = Path(__file__).with_name("slurm_ranks.py")
BAD_NODE = "node1"
PORT = 29880


@pytest.fixture(scope="module")
def srun_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], str]:
    require_slurm()
    base = tmp_path_factory.mktemp("guardslurm")
    out = base / "out"
    out.mkdir()
    with TestNet(2) as net, SlurmCluster(net) as cluster:
        for h in net.hosts:
            (base / h.name / "spool").mkdir(parents=True)
        # every node's spool at a path of its own, as /var/lib/gpumon/guard is on a real node
        script = (f'GPUMON_GUARD_DIR={base}/"$SLURMD_NODENAME"/spool RANK=$SLURM_PROCID '
                  f"WORLD_SIZE=$SLURM_NTASKS exec {sys.executable} {RANKS} {out} {BAD_NODE}")
        env = rank_env(MASTER_ADDR=net.hosts[0].ip, MASTER_PORT=str(PORT), NODE_NAME="not-the-slurm-node")
        proc = cluster.srun(["-w", ",".join(h.name for h in net.hosts), "/bin/sh", "-c", script],
                            nodes=2, ntasks_per_node=2, env=env, timeout=240)
        log = f"srun rc {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, log
    return base, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)], log


def test_each_rank_knows_its_slurm_node_host_and_local_rank_from_slurm_alone(
        srun_job: tuple[Path, list[dict[str, Any]], str]) -> None:
    _, ranks, log = srun_job
    # srun's block distribution: tasks 0, 1 on the first node, 2, 3 on the second
    assert [r["where"][r["rank"]] for r in ranks] == [["node0", 0], ["node0", 1], ["node1", 0],
                                                      ["node1", 1]], log
    for r in ranks:
        me = r["identity"]
        assert (me["node_name"], me["node_name_source"]) == (me["host"], "SLURMD_NODENAME"), me
        assert me["world_size"] == 4 and me["rank"] == r["rank"], me


def test_the_verdict_names_the_slurm_node_and_local_rank_and_lands_in_that_nodes_spool(
        srun_job: tuple[Path, list[dict[str, Any]], str]) -> None:
    base, ranks, log = srun_job
    bad = ranks[0]["bad"]
    assert bad == 3, log
    for r in ranks:
        (alarm,) = r["nan"]["alarms"]
        assert alarm["step"] == 3 and alarm["ranks"] == [bad] and alarm["unchanged"], alarm
        (v,) = alarm["verdicts"]
        who = v["subject"]
        assert (who["rank"], who["node_name"], who["node_name_source"], who["host"], who["local_rank"]) == (
            bad, BAD_NODE, "SLURMD_NODENAME", BAD_NODE, 1), who
    (path,) = (base / BAD_NODE / "spool").glob("*.json")
    written = vf.read(path)
    assert (written.check, written.step, written.subject.node_name, written.subject.local_rank) == (
        "nonfinite_grad", 3, BAD_NODE, 1)
    assert written.job is not None and written.job.startswith("slurm"), written.job
    assert not list((base / "node0" / "spool").glob("*.json"))  # node0 named nothing
