"""The fabric probe's options: ``checks.fabric.*`` in the config, ``checks: fabric:`` in a SKU profile.

The probe (``gpumon probe-fabric``) and the ``fabric`` check (which reports the last probe's result
on this node) read the same section, so a site sets the thresholds once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")
SENDRECV = "sendrecv"
ALL_OPS = (*COLLECTIVES, SENDRECV)


@dataclass(frozen=True)
class FabricCpu:
    """What the probe runs with device ``cpu`` (gloo over the node's Ethernet; CI, test hosts)."""

    max_bytes: int = field(default=1 << 20, metadata={
        "min": 8,
        "source": "argued: a few MiB at most on CPU (the issue's 'CI uses a few MiB'); 1 MiB keeps a "
                  "4-host sweep with one host shaped to 200 Mbit/s under 30 s on the 2-core CI VM"})
    step_factor: int = field(default=4, metadata={
        "min": 2, "source": "argued: sizes x4 on CPU: ten sizes from 8 B to 1 MiB keep the CI sweep short"})
    iterations: int = field(default=10, metadata={"min": 3})
    warmup: int = field(default=2, metadata={"min": 0})
    large_min_bytes: int = field(default=256 << 10, metadata={
        "min": 8, "source": "argued: the top of the CPU sweep is judged by bandwidth"})
    # Ranks that share a few cores (test hosts in network namespaces on one VM) time the scheduler as
    # much as the network, so the CPU path is judged with wider margins than a GPU fleet.
    slow_fraction: float = field(default=0.15, metadata={
        "min": 0.01, "max": 1.0,
        "source": "measurement, 2026-12-01, 4 test hosts x 1 gloo rank on the 2-core CI VM, 1 MiB "
                  "exchanges: healthy pairs 0.16-0.50 GB/s (3x spread at load 2-3; at load 8 a healthy "
                  "pair once fell below 0.25 of the reference), a host shaped to 200 Mbit/s 0.012 GB/s "
                  "(1/40 of the reference); 0.15 sits between the two"})
    latency_factor: float = field(default=10.0, metadata={
        "min": 1.0, "source": "measurement, same runs: 8 B p95 0.4-12 ms on healthy pairs (scheduler)"})
    latency_floor_us: float = field(default=100000.0, metadata={
        "min": 0.0,
        "source": "measurement, 2-core CI VM: healthy 8 B p95 up to 12 ms idle and up to 31 ms with one "
                  "core kept busy by another process, while a link down for 1-2 s stalls a call by "
                  "1-3 s; 100 ms is three times the busy figure and a tenth of the stall"})
    stall_factor: float = field(default=10.0, metadata={
        "min": 1.0, "source": "as checks.fabric.stall_factor"})
    stall_floor_s: float = field(default=0.5, metadata={
        "min": 0.0,
        "source": "argued, not yet measured as a distribution: a link down for 1-2 s stalls a call by "
                  "1-3 s (TCP retransmits back off from 200 ms), scheduler noise of test hosts sharing "
                  "two cores stays in tens of ms (healthy 8 B p95 up to 31 ms, cpu.latency_floor_us); "
                  "in the tests/fabric runs of 2026-12-02 no healthy call passed it once the first "
                  "call of an operation (one-time setup, 1.7 s) was left out"})


@dataclass(frozen=True)
class FabricConfig:
    collectives: list[str] = field(default_factory=lambda: list(COLLECTIVES), metadata={
        "source": "the issue's list: all_reduce, all_gather, reduce_scatter, alltoall; send/recv "
                  "between node pairs always runs (it isolates nodes and links)"})
    min_bytes: int = field(default=8, metadata={
        "min": 1, "source": "nccl-tests' smallest useful size; the LL protocol's latency-bound range"})
    max_bytes: int = field(default=2 << 30, metadata={
        "min": 8,
        "source": "2 GiB: the issue's sweep 8 B - 2 GiB (a fleet monitor's third layer); Google "
                  "cluster-health-scanner judges multi-node busbw at 2-8 GiB"})
    step_factor: int = field(default=2, metadata={"min": 2, "source": "sizes double (nccl-tests -f 2)"})
    iterations: int = field(default=20, metadata={
        "min": 3, "source": "nccl-tests default -n 20 timed iterations per size"})
    warmup: int = field(default=5, metadata={"min": 0, "source": "nccl-tests default -w 5"})
    size_budget_s: float = field(default=5.0, metadata={
        "min": 0.01,
        "source": "argued: a slow link must not stretch the sweep past its deadline; once a size has "
                  "taken this long (after at least 3 timed iterations) the rest of its iterations are "
                  "dropped, and the report says how many ran"})
    small_max_bytes: int = field(default=64 << 10, metadata={
        "min": 1,
        "source": "gpumon's choice: NCCL picks LL/LL128/Simple per call by its tuning model "
                  "(NVIDIA/nccl src/graph/tuning.cc; no fixed collective threshold since 2.16), but "
                  "point-to-point uses LL up to 16 KiB per channel (NCCL_P2P_LL_THRESHOLD=16384, "
                  "src/enqueue.cc @01e6dd91); up to 64 KiB the time is latency-bound, judged by p95"})
    large_min_bytes: int = field(default=1 << 30, metadata={
        "min": 1,
        "source": "NVIDIA maintainer, NVIDIA/nccl-tests#212: '256M is too small to reach peak "
                  "bandwidth'; Google cluster-health-scanner averages 2-8 GiB; so busbw is judged "
                  "from 1 GiB"})
    busbw_min_gbps: dict[str, float] = field(default_factory=dict, metadata={
        "source": "profile: per collective (all_reduce, all_gather, reduce_scatter, alltoall, sendrecv), "
                  "the floor of busbw at sizes >= large_min_bytes; none: judged against the group only"})
    latency_p95_us_max: dict[str, float] = field(default_factory=dict, metadata={
        "source": "profile: per collective, the ceiling of p95 latency at sizes <= small_max_bytes; "
                  "none: judged against the group only"})
    slow_fraction: float = field(default=0.7, metadata={
        "min": 0.01, "max": 1.0,
        "source": "argued: a 400G port trained at 200G halves a pair's bandwidth; run-to-run busbw "
                  "varies by ~5-10 % on a healthy fabric (NCCL issue reports), so 0.7 of the group's "
                  "reference separates the two"})
    latency_factor: float = field(default=3.0, metadata={
        "min": 1.0, "source": "argued: p95 three times the group's reference, and above it by at least "
                              "latency_floor_us, is far outside scheduling noise"})
    latency_floor_us: float = field(default=50.0, metadata={
        "min": 0.0, "source": "argued: tens of microseconds of jitter are normal for small messages"})
    confirm_partners: int = field(default=2, metadata={
        "min": 1, "source": "argued: a node is named only after it was slow with two different partners, "
                            "one of them known good (two-pass isolation, Google cluster-health-scanner)"})
    max_rounds: int = field(default=8, metadata={
        "min": 1, "source": "argued: the first pass (the coverage rounds) counts as one round; at most 7 "
                            "follow-up rounds re-test suspects (bench/fabric_isolation.md: 2-4 rounds were "
                            "enough up to 4,096 nodes)"})
    coverage_rounds: int = field(default=15, metadata={
        "min": 1,
        "source": "argued from the cost of a pair round: on GPUs about 1.7 s of transfers (8 B, 1 and 2 GiB "
                  "at 46 GB/s per rail, 25 calls each: docs/operators/fabric-probe.md, 'Budget'), so 15 "
                  "rounds are ~26 s, under a "
                  "tenth of deadline_s (300 s) next to the sweep; measured on CPU (gloo, 2-core VM, "
                  "2026-12-07, the report's coverage.seconds): 0.10-0.13 s a round with 4 test hosts, 0.15 s "
                  "with 8, 0.41 s with 16 (the whole 15-round tournament 6.2 s). 15 rounds "
                  "are a whole round-robin tournament of up to 16 nodes (N-1 rounds; odd N: N), so a group "
                  "of <= 16 nodes has every pair measured in every run; a larger group follows a rotation "
                  "kept on its nodes, every pair within ceil(rounds/15) runs (gpumon/fabric/schedule.py). "
                  "Simulated (tests/fabric/test_isolate.py's fabric, 200 seeds, 2026-12-07): with +/-5 % "
                  "and +/-10 % busbw noise, every pair of 16 or 40 healthy nodes named no false link; at "
                  "+/-20 % about 8 a run at 16 nodes (a node's best of 15 pairs lifts the reference)"})
    deadline_s: float = field(default=300.0, metadata={
        "min": 1.0,
        "source": "the issue's budget: the whole 8 B - 2 GiB sweep on 2 nodes x 8 GPUs in <= 5 min; "
                  "a probe still running then is ended, naming the ranks it lost"})
    heartbeat_s: float = field(default=1.0, metadata={
        "min": 0.05, "source": "argued: a rank that has not written its heartbeat for 3 periods is lost"})
    op_timeout_s: float = field(default=120.0, metadata={
        "min": 1.0, "source": "the process group's bound on one collective (torch.distributed timeout)"})
    stall_factor: float = field(default=10.0, metadata={
        "min": 1.0,
        "source": "argued: a call more than 10 x its own size's median (p99, the slowest warm-up call, "
                  "an agreement) is not run-to-run variance (busbw varies ~5-10 % on a healthy fabric) "
                  "but a stall: a link that went down and came back, a retransmit timeout"})
    stall_floor_s: float = field(default=0.2, metadata={
        "min": 0.0,
        "source": "Linux TCP_RTO_MIN = 200 ms (include/net/tcp.h): the shortest stall a lost packet "
                  "costs on a TCP path (gloo, NCCL's socket transport, the rendezvous store); a healthy "
                  "NCCL call of <= 2 GiB takes < 15 ms at the profiles' floors, so 0.2 s more than the "
                  "median is no GPU's jitter"})
    seed: int | None = field(default=None, metadata={
        "source": "None: rank 0 draws a new seed each run for the data patterns and the order of the "
                  "follow-up rounds (which pairs the coverage rounds measure is the schedule's, not the "
                  "seed's: gpumon/fabric/schedule.py); the report prints it, and --seed or this key "
                  "repeats them"})
    idle_max_utilization_pct: int = field(default=5, metadata={
        "min": 0, "max": 100,
        "source": "the SDC canary's idle gate: a GPU with a compute process or above this utilization "
                  "is busy, and the probe does not run on its node"})
    device: str = field(default="auto", metadata={
        "choices": ("auto", "cuda", "cpu"),
        "source": "auto: NCCL on the GPUs when torch sees CUDA, else gloo on CPU"})
    cpu: FabricCpu = field(default_factory=FabricCpu)

    def __post_init__(self) -> None:
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown:
            raise ValueError(f"collectives: {unknown[0]!r} is not one of {', '.join(COLLECTIVES)}")
        for name, table in (("busbw_min_gbps", self.busbw_min_gbps),
                            ("latency_p95_us_max", self.latency_p95_us_max)):
            for key, value in table.items():
                if key not in ALL_OPS:
                    raise ValueError(f"{name}: {key!r} is not one of {', '.join(ALL_OPS)}")
                if not value > 0:
                    raise ValueError(f"{name}.{key}: must be > 0, got {value}")
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"min_bytes {self.min_bytes} is above max_bytes {self.max_bytes}")
