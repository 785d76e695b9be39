"""One rank of ``gpumon probe-fabric``: rendezvous, idle gate, sweep, pair rounds, verdict, record.

Coordination goes through the launcher's rendezvous store (torch.distributed's ``TCPStore``: the
torchrun agent's, else one hosted by rank 0), never through the data path under test: who is on
which node, the idle gate, heartbeats, the sweep's agreements (iterations per size, whether a sum
was wrong), the pair plan of each round, every rank's results and rank 0's verdict are keys in it.
The data path is the process group (NCCL on GPUs, gloo on CPU).

**Coverage.** The first pair rounds are the group's coverage rounds (``gpumon.fabric.schedule``): every
pair of a group of up to 16 nodes, the next rounds of a kept round-robin rotation above that. Every
node keeps a copy of the rotation in its state directory (rank 0 may be another node each run): each
node's local rank 0 reads its copy and posts it, rank 0 continues from the copy with the most runs
(an unreadable copy is named in the report and skipped; none left: a fresh rotation), and after the
run every node writes the new state, even when the run ended early (the rounds measured count).

**Bounded.** A heartbeat thread writes ``hb/<rank>`` every ``heartbeat_s`` with the phase the rank
is in; rank 0 watches them. A watchdog ends every rank at the deadline: rank 0 names the ranks
whose heartbeat stopped (and what they were doing), judges what was measured, posts the verdict
and writes the report; every other rank waits a short grace for the verdict, records its node's
finding and exits. A collective that raises (a peer died) takes the same path at once. Nothing
tears down a process group after a failure (that can hang); the process exits.

**Exit.** A rank never returns through the interpreter's teardown: the process group is not destroyed
(that can hang after a failure) and torch's C++ communication threads abort a process whose Python
objects are torn down under them (seen as SIGABRT at exit), so ``gpumon probe-fabric`` flushes its
output and leaves with ``os._exit``.

**Exit codes**: rank 0 exits with the group's status (0 ok, 1 warn/unknown, 2 fail; srun passes
it on, torchrun exits 1 for any rank that failed and logs the rank's code); other ranks exit 0 once
their node's finding is recorded, 3 when they could not run at all, 2 when they lost the group.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumon.fabric.isolate import IsolationSettings, Isolator, PairResult
from gpumon.fabric.judge import CHECK, Probe, RankInfo, Verdict, judge
from gpumon.fabric.launch import Launch
from gpumon.fabric.schedule import Coverage, Plan, Rotation, RotationError, preference
from gpumon.fabric.settings import FabricConfig
from gpumon.fabric.sweep import OpResult, Rank, SweepPlan, collective_sweep, pair_exchange, sizes
from gpumon.model import NODE, Action, Finding, Severity

log = logging.getLogger("gpumon.fabric")

PREFIX = "gpumon-fabric/"
STALE_BEATS = 3  # heartbeats missed before a rank counts as lost
AGREE_TURN_S = 0.5  # a rank waiting for the others' agreement looks for a lost rank this often
ABORT_GRACE_S = 4.0  # after the deadline: the most a rank takes to report, record and exit
EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_CANNOT_RUN = 0, 1, 2, 3


@dataclass(frozen=True)
class Gate:
    busy: str | None
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RankSetup:
    """What the CLI hands a rank: who it is, what to run, and where its node keeps its state."""

    launch: Launch
    settings: FabricConfig
    node: str
    device: str  # auto | cuda | cpu
    deadline_s: float
    gate: Callable[[int], Gate]  # local GPU index -> idle or busy
    record: Callable[[Finding, dict[str, Any]], None]  # this node's finding + group summary
    report: Callable[[dict[str, Any], Verdict | None], None]  # rank 0: the group report
    max_bytes: int | None = None
    # this rank's GPU index -> enter what its device does differently (a simulated node's device
    # model: the CPU rank standing in for a simulated GPU carries out that GPU's faults)
    enter_device: Callable[[int], None] | None = None
    profile: str = ""  # the SKU profile whose floors judge NCCL on GPUs (named in the findings)
    seed: int | None = None  # --seed: the data patterns and follow-up rounds of an earlier run (rank 0's)
    # this node's copy of the group's pair rotation (None: none yet; RotationError: unreadable), and
    # where the new state goes after the run
    load_rotation: Callable[[], Rotation | None] | None = None
    save_rotation: Callable[[str], None] | None = None


class _Store:
    """A client of the rendezvous store (one per thread: TCPStore clients are not shared)."""

    def __init__(self, launch: Launch, timeout_s: float, *, master: bool = False) -> None:
        from torch._C._distributed_c10d import PrefixStore, TCPStore

        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=max(1.0, timeout_s))}
        if master:
            raw = TCPStore(launch.master_addr, launch.master_port, launch.world, is_master=True,
                                wait_for_workers=False, **kwargs)
        else:
            raw = TCPStore(launch.master_addr, launch.master_port, is_master=False, **kwargs)
        self.raw = raw
        self.store = PrefixStore(PREFIX, raw)

    def set(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        return json.loads(self.store.get(key).decode())

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def wait(self, keys: list[str], timeout_s: float) -> None:
        if keys:
            self.store.wait(keys, datetime.timedelta(seconds=max(0.01, timeout_s)))


class RankRun:
    def __init__(self, setup: RankSetup) -> None:
        self.s = setup
        self.launch = setup.launch
        self.rank = setup.launch.rank
        self.world = setup.launch.world
        self.start = time.monotonic()
        self.started_wall = time.time()
        # the deadline counts from the process's start (imports and NVML setup included), which is
        # what a launcher or an operator waiting for the probe sees
        self.deadline = self.start + setup.deadline_s - max(0.0, self.started_wall - _process_start())
        self.phase = "rendezvous"
        self.collectives: list[OpResult] = []
        self.ranks: dict[int, RankInfo] = {}
        self.probe: Probe | None = None  # rank 0
        self._abort_lock = threading.Lock()
        self._aborting = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []  # heartbeat, watch: joined before a normal exit
        self._heard: dict[int, tuple[str, float]] = {}  # rank 0: rank -> (last beat, when it changed)
        self.store: _Store | None = None
        self.iso: Isolator | None = None  # rank 0, once the pair rounds start
        self._confirm: list[tuple[str, str]] | None = None  # rank 0: link faults still to re-measure
        self._agreed: dict[str, int] = {}  # agreements made so far, per group of ranks
        self.cpu = True  # gloo on CPU (judged without the profile's GPU floors); set with the device
        self.seed = 0  # the run's seed: rank 0's choice, read by every rank from the store
        # rank 0: heartbeat silences that ended (a rank cut off for a moment and back): rank ->
        # [(seconds silent, what it said before, what it said after)]
        self.silences: dict[int, list[tuple[float, str, str]]] = {}
        self.rounds_done: list[tuple[int, list[tuple[str, str]]]] = []  # rank 0: round -> pairs
        # rank 0: the group's rotation, this run's coverage rounds, the copies it could not read
        self.rotation: Rotation | None = None
        self.coverage_plan: Plan | None = None
        self.rotation_errors: list[str] = []
        self.coverage: Coverage | None = None  # rank 0, once the run's rounds are recorded
        self.coverage_s: float | None = None  # rank 0: time in the coverage rounds
        self.rotation_doc: dict[str, Any] | None = None  # the state every node writes after the run
        self._rotation_source: str | None = None

    # -- helpers -----------------------------------------------------------------------------

    def remaining(self) -> float:
        return max(0.01, self.deadline - time.monotonic())

    def progress(self, phase: str) -> None:
        # logged when the step changes: the collective ("all_gather 8 B warm-up" -> all_gather), or
        # what comes before a colon ("round 2: pairs with node1" -> round 2)
        def step(text: str) -> str:
            return text.split(":", 1)[0] if ":" in text else text.split(" ", 1)[0]

        if step(phase) != step(self.phase):
            log.info("rank %d: %s", self.rank, phase)
        self.phase = phase

    def _agree(self, ranks: Sequence[int], value: float) -> float:
        """The largest ``value`` of ``ranks``, through the rendezvous store (never the data path under
        test). Every rank of ``ranks`` makes the same agreements in the same order, so the n-th one of
        a group is the same key everywhere. Waits in short turns: rank 0 gives up once a rank of the
        group has been silent for ``op_timeout_s``, the others as soon as rank 0 has ended the probe.

        Not sooner: a rank silent for a few heartbeats may be cut off only for a moment (a link that
        flaps, its path to the store alone, a rank starved of CPU). A collective waits
        ``op_timeout_s`` on such a peer, so its agreement must too: giving up after ``STALE_BEATS``
        heartbeats turned a 2 s flap that fell on an agreement into an incomplete probe with the host
        "lost" and no stall, where the same flap in a collective is a stall naming the host."""
        assert self.store is not None
        store, group = self.store, list(ranks)
        name = "all" if group == list(range(self.world)) else "-".join(map(str, group))
        n = self._agreed[name] = self._agreed.get(name, 0) + 1
        keys = [f"agree/{name}/{n}/{q}" for q in group]
        store.set(f"agree/{name}/{n}/{self.rank}", value)
        while True:
            try:
                store.wait(keys, min(AGREE_TURN_S, self.remaining()))
                break
            except Exception:
                if time.monotonic() >= self.deadline:
                    raise
                silent = self.lost(self.s.settings.op_timeout_s) if self.rank == 0 else {}
                gone = sorted(set(silent) & set(group))
                if gone:
                    raise RuntimeError(f"rank(s) {', '.join(map(str, gone))} stopped answering") from None
                if self.rank != 0 and store.has("verdict"):
                    raise RuntimeError("rank 0 ended the probe") from None
        return max(float(store.get(k)) for k in keys)

    def _mine(self) -> list[int]:
        return sorted(r for r, i in self.ranks.items() if i.node == self.s.node)

    # -- threads -----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        beat = 0
        client: _Store | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = _Store(self.launch, min(5.0, self.remaining()))
                beat += 1
                client.set(f"hb/{self.rank}", f"{beat}|{self.phase}")
            except Exception as exc:  # the store is gone (network cut, rank 0 dead): keep trying
                log.debug("heartbeat: %s", exc)
                client = None
            self._stop.wait(self.s.settings.heartbeat_s)

    def _watch(self) -> None:
        """Rank 0: when each rank's heartbeat last changed (on this clock; the nodes' may differ)."""
        client: _Store | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = _Store(self.launch, min(5.0, self.remaining()))
                now = time.monotonic()
                limit = self._silence_limit()
                for r in range(self.world):
                    key = f"hb/{r}"
                    if client.has(key):
                        beat = str(client.get(key))
                        before, when = self._heard.get(r, ("", 0.0))
                        if before != beat:
                            if before and now - when > limit:
                                # silent, then back: a link that went down and came up (a flap)
                                self.silences.setdefault(r, []).append(
                                    (round(now - when, 2), before.split("|", 1)[-1], beat.split("|", 1)[-1]))
                            self._heard[r] = (beat, now)
            except Exception as exc:
                log.debug("watch: %s", exc)
                client = None
            self._stop.wait(self.s.settings.heartbeat_s)

    def _silence_limit(self) -> float:
        """How long a heartbeat may stay unchanged before the silence is a stall: two periods (a
        beat and rank 0's look at it are each up to one period apart) plus the stall floor."""
        s = self.s.settings
        floor = s.cpu.stall_floor_s if self.cpu else s.stall_floor_s
        return 2 * s.heartbeat_s + floor

    def lost(self, silent_s: float | None = None) -> dict[int, str]:
        """Ranks not heard from for ``silent_s`` (default ``STALE_BEATS`` heartbeats): rank -> what
        they last said."""
        now = time.monotonic()
        limit = STALE_BEATS * self.s.settings.heartbeat_s if silent_s is None else silent_s
        out = {}
        for r in range(self.world):
            beat, when = self._heard.get(r, ("0|never heard from", self.start))
            if now - when > limit:
                out[r] = beat.split("|", 1)[-1]
        return out

    def _preempted(self, signum: int, frame: object) -> None:
        # a job preempts the probe (PriorityClass, Slurm QOS): it measured nothing about the nodes
        log.warning("rank %d: preempted (signal %d) in %s; nothing recorded", self.rank, signum, self.phase)
        logging.shutdown()
        os._exit(EXIT_WARN)

    def _watchdog(self) -> None:
        if not self._stop.wait(self.remaining()):
            self.abort(f"deadline of {self.s.deadline_s:g} s reached in {self.phase}")

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._preempted)
        threading.Thread(target=self._watchdog, name="fabric-watchdog", daemon=True).start()
        try:
            code = self._run()
        except Exception as exc:
            log.debug("rank %d failed", self.rank, exc_info=True)
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.abort(f"{type(exc).__name__} in {self.phase}: {first}")
            return EXIT_FAIL  # not reached: abort exits
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.s.settings.heartbeat_s + 1.0)
        return code

    def _run(self) -> int:
        import torch
        import torch.distributed as dist
        from torch._C._distributed_c10d import PrefixStore

        s, launch = self.s.settings, self.launch
        host = self.rank == 0 and not launch.agent_store
        self.store = store = _Store(launch, self.remaining(), master=host)
        self._threads.append(threading.Thread(target=self._heartbeat, name="fabric-heartbeat", daemon=True))
        if self.rank == 0:
            self._threads.append(threading.Thread(target=self._watch, name="fabric-watch", daemon=True))
        for t in self._threads:
            t.start()
        device = self._device(torch)
        self.cpu = not device.startswith("cuda")
        gate = self.s.gate(self._gpu_index())
        if self.s.enter_device is not None:
            self.s.enter_device(self._gpu_index())
        store.set(f"rank/{self.rank}", {"node": self.s.node, "local_rank": launch.local_rank,
                                        "pid": os.getpid(), "busy": gate.busy, "gate": gate.evidence,
                                        "rotation": self._post_rotation(store)})
        self.progress("rendezvous: waiting for every rank")
        if self.rank == 0:
            store.wait([f"rank/{r}" for r in range(self.world)], self.remaining())
            table = {str(r): store.get(f"rank/{r}") for r in range(self.world)}
            # a new seed each run unless one is asked for: other data patterns every run
            chosen = self.s.seed if self.s.seed is not None else s.seed
            self.seed = chosen if chosen is not None else int.from_bytes(os.urandom(4), "big") >> 1
            store.set("seed", self.seed)
            store.set("table", table)
        else:
            store.wait(["table"], self.remaining())
            table = store.get("table")
            self.seed = int(store.get("seed"))
        self.ranks = {int(r): RankInfo(int(r), str(v["node"]), int(v["local_rank"]), int(v["pid"]))
                      for r, v in table.items()}
        busy = {v["node"]: v["busy"] for v in table.values() if v.get("busy")}
        if busy:
            return self._skipped(busy)
        if self.rank == 0:
            self._plan_coverage(store, table)
        self.progress("process group")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=PrefixStore(PREFIX + "pg/", store.raw), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=s.op_timeout_s),
                                device_id=torch.device(device) if backend == "nccl" else None)
        r = Rank(dist, self.rank, self.world, device, self.progress, agree=self._agree)
        cpu = self.cpu
        max_bytes = self.s.max_bytes or (s.cpu.max_bytes if cpu else s.max_bytes)
        plan = SweepPlan(ops=tuple(s.collectives),
                         sizes=sizes(s.min_bytes, max_bytes, s.cpu.step_factor if cpu else s.step_factor),
                         iterations=s.cpu.iterations if cpu else s.iterations,
                         warmup=s.cpu.warmup if cpu else s.warmup, size_budget_s=s.size_budget_s,
                         seed=self.seed)
        large_min = min(s.cpu.large_min_bytes if cpu else s.large_min_bytes, plan.sizes[-1])
        if self.rank == 0:
            self.probe = Probe(settings=s, ranks=self.ranks, world=self.world, large_min_bytes=large_min,
                               cpu=cpu, profile=self.s.profile)
        if self.world > 1:
            collective_sweep(r, plan, self.collectives)
        self._pair_rounds(r, plan, large_min)
        self.progress("results")
        store.set(f"result/{self.rank}", [x.to_json() for x in self.collectives])
        if self.rank == 0:
            assert self.probe is not None
            store.wait([f"result/{q}" for q in range(self.world)], self.remaining())
            self.probe.collectives = {q: [OpResult.from_json(x) for x in store.get(f"result/{q}")]
                                      for q in range(self.world)}
            verdict = self._publish(self.probe)
            self._record_own(verdict.findings.get(self.s.node))
            self.progress("waiting for every node to record its finding")
            with contextlib.suppress(Exception):
                store.wait([f"done/{q}" for q in range(1, self.world)], self.remaining())
            self._stop.set()
            return verdict.status.exit_code
        store.wait(["verdict"], self.remaining())
        found = store.get("verdict")["findings"].get(self.s.node)
        self._take_rotation(store)
        self._record_own(Finding.from_json(found) if found else None)
        store.set(f"done/{self.rank}", 1)
        self._stop.set()
        return EXIT_OK

    def _device(self, torch: Any) -> str:
        choice = self.s.device
        if choice == "auto":
            choice = "cuda" if torch.cuda.is_available() else "cpu"
        if choice == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("device cuda asked for, but torch sees no CUDA device")
            index = self.launch.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return f"cuda:{index}"
        torch.set_num_threads(1)  # several ranks per host share its cores
        return "cpu"

    def _gpu_index(self) -> int:
        """The NVML index of this rank's GPU (CUDA_VISIBLE_DEVICES maps local ranks to GPUs)."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if ids and self.launch.local_rank < len(ids) and ids[self.launch.local_rank].isdigit():
            return int(ids[self.launch.local_rank])
        return self.launch.local_rank

    def _skipped(self, busy: dict[str, str]) -> int:
        """A node is busy: nobody measures anything (a probe must not steal a job's network or GPUs)."""
        reason = "; ".join(f"{n}: {why}" for n, why in sorted(busy.items()))
        if self.rank == 0:
            self.s.report({"outcome": "skipped", "status": "ok", "reason": f"busy nodes: {reason}",
                           **self._summary()}, None)
        self._stop.set()
        return EXIT_OK

    # -- pair rounds -------------------------------------------------------------------------

    def _pair_rounds(self, r: Rank, plan: SweepPlan, large_min: int) -> None:
        assert self.store is not None
        store, s = self.store, self.s.settings
        nodes = sorted({i.node for i in self.ranks.values()})
        iso = None
        if self.rank == 0 and len(nodes) > 1:
            margins = s.cpu if not r.cuda else s
            first = ([list(pairs) for _, pairs in self.coverage_plan.rounds]
                     if self.coverage_plan is not None else None)
            iso = self.iso = Isolator(nodes, IsolationSettings(
                slow_fraction=margins.slow_fraction, latency_factor=margins.latency_factor,
                latency_floor_us=margins.latency_floor_us, confirm_partners=s.confirm_partners,
                max_rounds=s.max_rounds), seed=self.seed, first=first)
        pair_plan = SweepPlan(ops=(), sizes=(plan.sizes[0], *[x for x in plan.sizes if x >= large_min]),
                              iterations=plan.iterations, warmup=plan.warmup,
                              size_budget_s=plan.size_budget_s, seed=plan.seed)
        by_node_local = {(i.node, i.local_rank): q for q, i in self.ranks.items()}
        k = 0
        started = time.monotonic()
        while True:
            k += 1
            if self.rank == 0:
                pairs = iso.next_round() if iso is not None else []
                if not pairs and iso is not None:
                    pairs = self._confirmation_round(iso)
                store.set(f"plan/{k}", [list(p) for p in pairs])
            else:
                store.wait([f"plan/{k}"], self.remaining())
                pairs = [tuple(p) for p in store.get(f"plan/{k}")]
            if not pairs:
                return
            mine: list[OpResult] = []
            me = self.ranks[self.rank]
            for a, b in pairs:
                if me.node in (a, b):
                    other = b if me.node == a else a
                    peer = by_node_local.get((other, me.local_rank))
                    if peer is not None:
                        self.progress(f"round {k}: pairs with {other}")
                        pair_exchange(r, peer, pair_plan, mine)
            store.set(f"pair/{k}/{self.rank}", [x.to_json() for x in mine])
            if self.rank == 0:
                assert iso is not None and self.probe is not None
                self.progress(f"round {k}: waiting for every rank's pair results")
                store.wait([f"pair/{k}/{q}" for q in range(self.world)], self.remaining())
                got = {q: [OpResult.from_json(x) for x in store.get(f"pair/{k}/{q}")]
                       for q in range(self.world)}
                for q, rs in got.items():
                    self.probe.pair_results.setdefault(q, []).extend(rs)
                results = [pair_result(a, b, got, self.ranks) for a, b in pairs]
                self.probe.pairs.extend(results)
                self.rounds_done.append((k, [(a, b) for a, b in pairs]))
                iso.add(results)
                if k == iso.first_pass:
                    self.coverage_s = round(time.monotonic() - started, 3)

    # -- coverage ----------------------------------------------------------------------------

    def _post_rotation(self, store: _Store) -> dict[str, Any] | None:
        """Local rank 0: this node's copy of the group's rotation, whole under ``rotation/<node>``, in
        short (its runs, or why it cannot be used) for the rank table."""
        if self.launch.local_rank != 0 or self.s.load_rotation is None:
            return None
        try:
            rot = self.s.load_rotation()
        except (RotationError, OSError) as exc:
            log.warning("rank %d: the pair rotation kept on %s cannot be used: %s", self.rank, self.s.node,
                        exc)
            return {"error": str(exc)}
        if rot is None:
            return None
        store.set(f"rotation/{self.s.node}", rot.to_json())
        return {"runs": rot.runs}

    def _plan_coverage(self, store: _Store, table: dict[str, Any]) -> None:
        """Rank 0: continue the group's rotation from the best copy, and plan this run's coverage rounds."""
        runs: dict[str, int] = {}
        errors: list[str] = []
        for v in table.values():
            info = v.get("rotation") or {}
            if "error" in info:
                errors.append(f"{v['node']}: {info['error']}")
            elif isinstance(info.get("runs"), int):
                runs[str(v["node"])] = int(info["runs"])
        rot, source = None, None
        for node in preference(runs):
            try:
                rot, source = Rotation.from_json(store.get(f"rotation/{node}")), node
                break
            except (RotationError, ValueError) as exc:
                errors.append(f"{node}: {exc}")
        if errors:
            log.warning("rank 0: pair rotation copies not used: %s; %s", "; ".join(errors),
                        f"continuing from {source}'s" if source else "a fresh rotation")
        self.rotation = rot or Rotation()
        self.rotation_errors = errors
        self._rotation_source = source
        nodes = sorted({str(v["node"]) for v in table.values()})
        self.coverage_plan = self.rotation.begin(nodes, self.s.settings.coverage_rounds)

    def _end_coverage(self) -> Coverage | None:
        """Rank 0, once: record in the rotation the coverage rounds that finished (a prefix of the
        plan: the isolator measures them first, in order), and what the group's coverage now is."""
        if self.coverage is not None or self.rotation is None or self.coverage_plan is None:
            return self.coverage
        plan, done, played = self.coverage_plan, len(self.rounds_done), 0
        for _, pairs in plan.rounds:
            if pairs:
                if done == 0:
                    break
                done -= 1
            played += 1
        self.coverage = self.rotation.end(plan, played, time.time(), per_run=self.s.settings.coverage_rounds,
                                          errors=self.rotation_errors, seconds=self.coverage_s,
                                          source=self._rotation_source)
        self.rotation_doc = self.rotation.to_json()
        return self.coverage

    def _take_rotation(self, client: _Store) -> None:
        """The rotation rank 0 posted with the verdict, for this node's copy."""
        with contextlib.suppress(Exception):
            if client.has("rotation"):
                self.rotation_doc = client.get("rotation")

    def _confirmation_round(self, iso: Isolator) -> list[tuple[str, str]]:
        """Rank 0, once the rounds are over: measure every pair judged a link fault once more
        (bandwidth varies run to run, and a path fault names two nodes that are fast elsewhere, so it
        must be slow twice; the isolator keeps a pair's best figure). Disjoint pairs per round."""
        if self._confirm is None:
            self._confirm = sorted({(min(lf.a, lf.b), max(lf.a, lf.b)) for lf in iso.verdict().link_faults})
        busy: set[str] = set()
        chosen = []
        for a, b in list(self._confirm):
            if a not in busy and b not in busy:
                chosen.append((a, b))
                busy.update((a, b))
                self._confirm.remove((a, b))
        return chosen

    # -- verdict, report, record -------------------------------------------------------------

    def _summary(self) -> dict[str, Any]:
        return {"nodes": sorted({i.node for i in self.ranks.values()}), "ranks": self.world,
                "launch": self.launch.to_json(), "started": self.started_wall,
                "seconds": round(time.monotonic() - self.start, 3), "seed": self.seed}

    def _pairs_doc(self, probe: Probe) -> list[dict[str, Any]]:
        """Which node pairs were measured, round by round, with their figures (the report says
        what this run covered: a link never paired was not measured)."""
        out: list[dict[str, Any]] = []
        results = iter(probe.pairs)
        # which tournament round each of the first rounds was (None: a follow-up or confirmation)
        plan = self.coverage_plan
        tournament = [r for r, pairs in plan.rounds if pairs] if plan is not None else []
        for k, pairs in self.rounds_done:
            for a, b in pairs:
                pr = next(results, None)
                out.append({"round": k, "a": a, "b": b,
                            "coverage_round": tournament[k - 1] if k <= len(tournament) else None,
                            "busbw_gbps": pr.busbw_gbps if pr else None,
                            "p95_latency_us": pr.p95_latency_us if pr else None,
                            "failed": pr.failed if pr else None})
        return out

    def _publish(self, probe: Probe) -> Verdict:
        """Rank 0: judge, post the verdict for the other ranks, write the group report."""
        assert self.store is not None
        probe.time = time.time()
        if self.iso is not None:
            probe.isolation = self.iso.verdict()
        probe.coverage = self._end_coverage()
        probe.silences = {q: list(v) for q, v in self.silences.items()}
        verdict = judge(probe)
        doc = {"outcome": "completed" if verdict.complete else "incomplete",
               "status": verdict.status.value, **self._summary(),
               "findings": {n: f.to_json() for n, f in verdict.findings.items()},
               "isolation": probe.isolation.to_json() if probe.isolation is not None else None,
               "lost": {str(q): {"node": probe.node_of(q), "last_heard": what}
                        for q, what in probe.lost.items()},
               "errors": {str(q): e for q, e in probe.errors.items()},
               "stopped": probe.hung,
               "pairs": self._pairs_doc(probe),
               "coverage": probe.coverage.to_json() if probe.coverage is not None else None,
               "stalls": [st.to_json() for st in verdict.stalls],
               "corrupted_from_ranks": {str(q): {"node": probe.node_of(q), "wrong_elements": n}
                                        for q, n in sorted(verdict.corrupt.items())}}
        with contextlib.suppress(Exception):
            if self.rotation_doc is not None:
                # before the verdict: a rank that sees the verdict sees the rotation to keep
                self.store.set("rotation", self.rotation_doc)
            self.store.set("verdict", doc)
        self.s.report(doc, verdict)
        return verdict

    def _record_own(self, finding: Finding | None) -> None:
        """The lowest rank of each node records the node's finding (one writer per node)."""
        mine = self._mine()
        if mine and mine[0] != self.rank:
            return
        if finding is None:
            finding = Finding(CHECK, NODE, Severity.UNKNOWN,
                              f"the fabric probe's verdict did not reach {self.s.node} "
                              f"(last phase: {self.phase})", Action.NONE, {"phase": self.phase})
        try:
            self.s.record(finding, self._summary())
        except Exception as exc:  # the report stands; say why this node's state was not written
            log.error("could not record the fabric finding of %s: %s", self.s.node, exc)
        if self.rotation_doc is not None and self.s.save_rotation is not None:
            try:
                self.s.save_rotation(json.dumps(self.rotation_doc, separators=(",", ":")) + "\n")
            except Exception as exc:  # the finding stands; the next run continues from another copy
                log.error("could not keep the pair rotation on %s: %s", self.s.node, exc)

    def abort(self, reason: str) -> None:
        """End this rank now: name the lost ranks (rank 0), record what is known, exit, all within
        ``ABORT_GRACE_S``."""
        with self._abort_lock:
            if self._aborting:
                return
            self._aborting = True
        log.warning("rank %d: %s", self.rank, reason)
        end = time.monotonic() + ABORT_GRACE_S
        code = EXIT_FAIL
        try:
            code = self._abort_rank0(reason, end) if self.rank == 0 else self._abort_other(reason, end)
        except Exception as exc:  # nothing may keep a rank from ending
            log.error("rank %d: ending after %s: %s", self.rank, reason, exc)
        finally:
            logging.shutdown()
            os._exit(code)

    def _client(self, end: float) -> _Store | None:
        try:
            return _Store(self.launch, max(0.1, end - time.monotonic()))
        except Exception as exc:
            log.debug("store unreachable: %s", exc)
            return None

    def _abort_rank0(self, reason: str, end: float) -> int:
        client = self._client(end)
        ranks = dict(self.ranks)
        if client is not None and not ranks:
            # ended before the rank table was complete: who registered, on which node
            for q in range(self.world):
                with contextlib.suppress(Exception):
                    if client.has(f"rank/{q}"):
                        v = client.get(f"rank/{q}")
                        ranks[q] = RankInfo(q, str(v["node"]), int(v["local_rank"]), int(v["pid"]))
        ranks.setdefault(0, RankInfo(0, self.s.node, self.launch.local_rank, os.getpid()))
        self.ranks = ranks
        probe = self.probe or Probe(settings=self.s.settings, ranks=ranks, world=self.world,
                                    large_min_bytes=1, cpu=self.cpu, profile=self.s.profile)
        probe.ranks = ranks
        # a peer that died a moment ago: let its heartbeat go stale before naming it
        settle = min(end - 1.5, time.monotonic() + STALE_BEATS * self.s.settings.heartbeat_s + 0.2)
        while time.monotonic() < settle and not self.lost():
            time.sleep(0.05)
        probe.lost = {q: w for q, w in self.lost().items() if q != 0}
        probe.hung = reason
        if client is not None:
            for q in range(1, self.world):
                with contextlib.suppress(Exception):
                    if client.has(f"error/{q}"):
                        probe.errors[q] = str(client.get(f"error/{q}"))
                    if client.has(f"result/{q}"):
                        probe.collectives[q] = [OpResult.from_json(x) for x in client.get(f"result/{q}")]
        probe.collectives[0] = list(self.collectives)
        verdict = self._publish(probe)
        self._record_own(verdict.findings.get(self.s.node))
        if client is not None:
            alive = [q for q in range(1, self.world) if q not in probe.lost]
            with contextlib.suppress(Exception):
                client.wait([f"done/{q}" for q in alive], max(0.05, end - time.monotonic()))
        return max(verdict.status.exit_code, EXIT_WARN)

    def _abort_other(self, reason: str, end: float) -> int:
        found = None
        # cut off, a connect can take the whole grace: keep half of it for recording
        client = self._client(min(end, time.monotonic() + ABORT_GRACE_S / 2))
        if client is not None:
            with contextlib.suppress(Exception):
                client.set(f"error/{self.rank}", reason)
                client.wait(["verdict"], max(0.05, end - time.monotonic()))
                found = client.get("verdict")["findings"].get(self.s.node)
                self._take_rotation(client)
        if found is None:
            self._record_own(Finding(
                CHECK, NODE, Severity.UNKNOWN,
                f"the fabric probe did not complete on {self.s.node}: {reason}; lost the group "
                f"(rendezvous {self.launch.master_addr}:{self.launch.master_port})",
                Action.NONE, {"phase": self.phase, "reason": reason}))
            code = EXIT_FAIL
        else:
            self._record_own(Finding.from_json(found))
            code = EXIT_WARN
        if client is not None:
            with contextlib.suppress(Exception):
                client.set(f"done/{self.rank}", 1)
        return code


def _process_start() -> float:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


def pair_result(a: str, b: str, got: dict[int, list[OpResult]], ranks: dict[int, RankInfo]) -> PairResult:
    """One node pair from its ranks' exchanges: the slowest rail's bandwidth, the worst rail's p95."""
    on_a = {q for q, i in ranks.items() if i.node == a}
    on_b = {q for q, i in ranks.items() if i.node == b}
    rails = [(q, x) for q in on_a | on_b for x in got.get(q, []) if x.peer in (on_a if q in on_b else on_b)]
    if not rails:
        return PairResult(a, b, None, None, failed="no rank of the pair reported a result")
    wrong = sum(x.wrong for _, x in rails)
    small = min(x.nbytes for _, x in rails)
    # the largest size is the bandwidth figure (the pair plan holds the smallest size and the large ones)
    size = max(x.nbytes for _, x in rails)
    bw: float | None = None
    per_rail: dict[tuple[int, int], float] = {}
    for q, x in rails:
        if x.nbytes == size and x.p50_s == x.p50_s and x.p50_s > 0:
            key = (min(q, x.peer or 0), max(q, x.peer or 0))
            per_rail[key] = max(per_rail.get(key, 0.0), x.p50_s)
    if per_rail:
        bw = min(size / t / 1e9 for t in per_rail.values())
    lats = [x.p95_s for _, x in rails if x.nbytes == small and x.p95_s == x.p95_s]
    lat = max(lats) * 1e6 if lats else None
    failed = f"{wrong} wrong elements received" if wrong else None
    return PairResult(a, b, bw, lat, failed=failed)
