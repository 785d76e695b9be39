"""Which rank this process is, from the environment of the launcher that started it.

gpumon never starts the ranks itself: torchrun, Slurm's srun, a Kubernetes Indexed Job or Open MPI's
mpirun do, and each says who a process is in its own variables. Checked in this order:

- **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``; with c10d rendezvous the agent hosts the store, ``TORCHELASTIC_USE_AGENT_STORE``);
- **Slurm** (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
  ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``): the rendezvous host is the first node of
  ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded by ``scontrol show hostnames`` and
  addressed by its ``NodeAddr`` (``scontrol show node``), so it works where node names do not resolve;
- **Open MPI** (``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/``LOCAL_SIZE``; the rendezvous host
  from ``MASTER_ADDR``, which mpirun passes with ``-x``);
- **Kubernetes Indexed Job**, one rank per pod (``JOB_COMPLETION_INDEX``, ``GPUMON_FABRIC_WORLD_SIZE``,
  ``MASTER_ADDR``); with several GPUs per pod the manifest runs torchrun inside the pod instead.

The port: ``--port``, else ``MASTER_PORT``, else 29500 (Slurm: 29500 + job id mod 2000, so two probe
jobs that share a first node do not collide).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpumon.errors import StartupError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Launch:
    launcher: str  # torchrun | slurm | openmpi | kubernetes
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; elsewhere rank 0 hosts it
    agent_store: bool = False

    def to_json(self) -> dict[str, object]:
        return {"launcher": self.launcher, "rank": self.rank, "world": self.world,
                "local_rank": self.local_rank, "local_world": self.local_world,
                "master": f"{self.master_addr}:{self.master_port}"}


def _int(env: Mapping[str, str], key: str) -> int:
    raw = env.get(key, "")
    try:
        value = int(raw)
    except ValueError:
        raise StartupError(f"launcher variable {key}={raw!r} is not an integer") from None
    if value < 0:
        raise StartupError(f"launcher variable {key}={raw!r} is negative")
    return value


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts: ``"8(x2),4"`` -> ``[8, 8, 4]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise StartupError(f"cannot read Slurm tasks per node {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _port(env: Mapping[str, str], port: int | None, default: int = DEFAULT_PORT) -> int:
    if port is not None:
        return port
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    return default


# run(argv) -> stdout; raises StartupError when the tool fails (bounded by the caller)
ToolRunner = Callable[[list[str]], str]


def detect(env: Mapping[str, str], *, port: int | None = None, master_addr: str | None = None,
           run_tool: ToolRunner | None = None) -> Launch:
    """The rank of this process. Raises ``StartupError`` when no launcher's variables are set."""
    if env.get("RANK") and env.get("WORLD_SIZE") and env.get("MASTER_ADDR"):
        world = _int(env, "WORLD_SIZE")
        return _checked(Launch(
            "torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else 0,
            _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else 1,
            master_addr or env["MASTER_ADDR"], _port(env, port),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and port is None))
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        return _slurm(env, port, master_addr, run_tool)
    if env.get("OMPI_COMM_WORLD_RANK") and env.get("OMPI_COMM_WORLD_SIZE"):
        addr = master_addr or env.get("MASTER_ADDR")
        if not addr:
            raise StartupError("Open MPI launch without a rendezvous host: pass -x MASTER_ADDR=<first host> "
                               "to mpirun, or --master-addr")
        return _checked(Launch(
            "openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if env.get("OMPI_COMM_WORLD_LOCAL_RANK") else 0,
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if env.get("OMPI_COMM_WORLD_LOCAL_SIZE") else 1,
            addr, _port(env, port)))
    if env.get("JOB_COMPLETION_INDEX"):
        addr = master_addr or env.get("MASTER_ADDR")
        if not env.get("GPUMON_FABRIC_WORLD_SIZE") or not addr:
            raise StartupError("Kubernetes Indexed Job without GPUMON_FABRIC_WORLD_SIZE and MASTER_ADDR "
                               "(see deploy/kubernetes/fabric-probe.yaml)")
        return _checked(Launch("kubernetes", _int(env, "JOB_COMPLETION_INDEX"),
                               _int(env, "GPUMON_FABRIC_WORLD_SIZE"), 0, 1, addr, _port(env, port)))
    raise StartupError("not started by a launcher: run one gpumon probe-fabric per rank under torchrun, "
                       "srun, mpirun or a Kubernetes Indexed Job (docs/operators/fabric-probe-launch.md)")


def _slurm(env: Mapping[str, str], port: int | None, master_addr: str | None,
           run_tool: ToolRunner | None) -> Launch:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local = _int(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0
    counts_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    node_id = _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    local_world = 1
    if counts_spec:
        counts = tasks_per_node(counts_spec)
        if node_id >= len(counts):
            raise StartupError(f"SLURM_NODEID {node_id} outside the tasks per node {counts_spec!r}")
        local_world = counts[node_id]
    addr = master_addr or env.get("MASTER_ADDR") or ""
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if not nodelist:
            raise StartupError("Slurm launch without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST")
        if run_tool is None:
            raise StartupError("Slurm launch: no way to run scontrol to find the rendezvous host")
        hosts = run_tool(["scontrol", "show", "hostnames", nodelist]).split()
        if not hosts:
            raise StartupError(f"scontrol show hostnames {nodelist!r} printed no host")
        addr = node_addr(run_tool(["scontrol", "show", "node", hosts[0]]), hosts[0])
    job = env.get("SLURM_JOB_ID", "")
    default = DEFAULT_PORT + (int(job) % 2000 if job.isdigit() else 0)
    return _checked(Launch("slurm", rank, world, local, local_world, addr, _port(env, port, default)))


def node_addr(show_node: str, name: str) -> str:
    """``NodeAddr=`` of ``scontrol show node NAME`` output (the name itself when Slurm has none)."""
    m = re.search(r"\bNodeAddr=(\S+)", show_node)
    return m.group(1) if m else name


def _checked(launch: Launch) -> Launch:
    if launch.world < 1 or launch.rank >= launch.world:
        raise StartupError(f"{launch.launcher}: rank {launch.rank} outside a world of {launch.world}")
    if launch.local_world < 1 or launch.local_rank >= launch.local_world:
        raise StartupError(f"{launch.launcher}: local rank {launch.local_rank} outside "
                           f"{launch.local_world} ranks on this node")
    if not 0 < launch.master_port < 65536:
        raise StartupError(f"{launch.launcher}: rendezvous port {launch.master_port} is not a TCP port")
    return launch
