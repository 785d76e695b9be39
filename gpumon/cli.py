"""The ``gpumon`` command. The only module that turns errors into exit codes.

Exit codes (Nagios / NHC convention that Slurm health checks and
node-problem-detector plugins read): 0 all OK, 1 warnings only, 2 at least one
failure, 3 could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gpumon import __version__
from gpumon.agent import Agent
from gpumon.check import Check
from gpumon.config import Config, load_config, with_profile
from gpumon.errors import ConfigError, GpumonError, StartupError
from gpumon.fabric import cli as fabric_cli
from gpumon.guard import cli as guard_cli
from gpumon.hw.kernellog import ReadOnce
from gpumon.machine import Machine
from gpumon.model import CheckRun, Phase, Status
from gpumon.registry import NotLoaded, load_registry
from gpumon.report import json_report, print_table
from gpumon.sdc import cli as canary_cli
from gpumon.sim.render import default_root
from gpumon.sim.scenario import Scenario, builtin_scenarios, load_scenario
from gpumon.sim.simulation import Simulation
from gpumon.usage import EXIT_USAGE, UsageParser
from gpumon.why import cli as why_cli

if TYPE_CHECKING:
    from gpumon.health import Health

EXIT_OK = 0
EXIT_WARN = 1
EXIT_FAIL = 2
EXIT_CANNOT_RUN = EXIT_USAGE

log = logging.getLogger("gpumon")


def _global_options(suppress: bool = False) -> UsageParser:
    # Global flags are accepted before and after the command. The command's
    # copy must not reset a value given before it, hence SUPPRESS there.
    p = UsageParser(add_help=False, argument_default=argparse.SUPPRESS if suppress else None)
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="config file (default /etc/gpumon/gpumon.yaml if present)")
    p.add_argument("--host-root", metavar="DIR", help="where the host's /sys, /proc, /dev are (default /)")
    p.add_argument("--profile", metavar="NAME", help="SKU profile (default: chosen from the GPU name)")
    p.add_argument("--simulate", metavar="SCENARIO",
                   help="run on a simulated node: a shipped scenario name "
                        f"({', '.join(builtin_scenarios())}) or a scenario YAML file; "
                        "the node and its health state are kept in --sim-dir")
    p.add_argument("--sim-at", type=float, metavar="SECONDS",
                   help="one-shot commands: the scenario's time to look at (default: check: after "
                        "every fault; others: the kept node as it is now, a new one after every fault)")
    p.add_argument("--sim-dir", type=Path, metavar="DIR",
                   help="keep the simulated node here (default: $XDG_STATE_HOME/gpumon/sim/SCENARIO, "
                        "i.e. ~/.local/state/gpumon/sim/SCENARIO, shared by daemon, status, "
                        "run-bootstrap, canary; check uses a private temporary node)")
    return p


def build_parser() -> UsageParser:
    parser = UsageParser(prog="gpumon", parents=[_global_options()],
                         description="GPU node health-check agent")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _global_options(suppress=True)

    p = sub.add_parser("check", parents=[common], help="one-shot run of the continuous checks",
                       description="One-shot run of the continuous checks. With --simulate: the "
                       "scenario is replayed on a private temporary node from time 0 to --sim-at "
                       "(default: after every fault), the checks run at 0, at every fault's start "
                       "and end, and at the end, as the daemon would have run them; the report is "
                       "the last run's, so a fault that is over (an IB port down for 9 s) shows as "
                       "it does in the daemon.")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these checks")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("-v", "--verbose", action="store_true", help="show ok findings too")
    p.add_argument("--kmsg-file", type=Path, metavar="FILE",
                   help="judge this saved kernel log (dmesg, journalctl -k, kern.log, a /dev/kmsg dump) "
                        "instead of the live one, as its own boot: its last boot, at the time of its "
                        "newest record")
    p.add_argument("--all-boots", action="store_true",
                   help="with --kmsg-file: judge every boot in the file, not only its last")

    p = sub.add_parser("run-bootstrap", parents=[common], help="run the bootstrap suite")
    p.add_argument("--only", metavar="N,..", help="run only these checks")
    p.add_argument("--skip", metavar="N,..", help="skip these checks")
    p.add_argument("--fail-fast", action="store_true", help="stop after the first check that fails")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("-v", "--verbose", action="store_true", help="show ok findings too")

    p = sub.add_parser("daemon", parents=[common], help="run as the node agent")
    p.add_argument("--duration", type=float, metavar="SECONDS",
                   help="stop after this long (tests, demos); default: until SIGTERM")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics here (default: exporter.listen, 0.0.0.0:9426)")

    sub.add_parser("list-checks", parents=[common], help="list the registered checks")

    p = sub.add_parser("config", parents=[common],
                       help="print the configuration and where each value came from",
                       description="Print the configuration a command would run with, as YAML a site "
                       "file accepts, each value followed by where it came from: the declared "
                       "default, the SKU profile (with --profile NAME: the profile is otherwise chosen "
                       "from the GPUs at start), the site file and line, or a flag.")
    p.add_argument("--defaults", action="store_true",
                   help="the declared defaults alone (every option, with its meaning)")

    canary_cli.add_parser(sub, [common])
    fabric_cli.add_parser(sub, [common])
    why_cli.add_parser(sub, [common])
    guard_cli.add_parser(sub, [common])

    p = sub.add_parser("status", parents=[common], help="health state: why, since when, history")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="default: state_dir of the config")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--history", type=int, default=10, metavar="N", help="events per component (10)")
    p.add_argument("-v", "--verbose", action="store_true", help="list healthy components too")

    p = sub.add_parser("set-healthy", parents=[common],
                       help="operator override: mark a component (default: the whole node) healthy")
    p.add_argument("component", nargs="?", default="node", help="node, gpu/<i>, nvlink/<gpu>/<link>, ...")
    p.add_argument("--reason", required=True, help="why (recorded with the event)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="default: state_dir of the config")

    p = sub.add_parser("record-reset", parents=[common],
                       help="record a GPU reset done by hand: its reset_gpu faults then await a retest")
    p.add_argument("component", help="gpu/<i> (the GPU reset), or node (every GPU reset, nvidia-smi -r)")
    p.add_argument("--reason", required=True, help="what was done (recorded with the event)")
    p.add_argument("--state-dir", type=Path, metavar="DIR", help="default: state_dir of the config")
    return parser


def _sim_root(args: argparse.Namespace, scenario: Scenario) -> Path:
    """The directory the simulated node is kept in: --sim-dir, else the user's own per scenario."""
    return Path(args.sim_dir) if args.sim_dir else default_root(scenario)


def _start_simulation(args: argparse.Namespace, scenario: Scenario) -> Simulation:
    """The simulated node of --simulate, said on stderr. ``check`` replays the scenario on a node of
    its own (a temporary one unless --sim-dir): it must not step a node a daemon is running."""
    replay = args.command == "check"
    root = None if replay and not args.sim_dir else _sim_root(args, scenario)
    # the daemon boots the node kept per user again (scenario time 0, its health state kept, as a
    # real node's across a reboot); a --sim-dir node resumes, like a restarted daemon on a node
    new_boot = args.command == "daemon" and not args.sim_dir
    try:
        sim = Simulation.start(scenario, args.sim_at, root, live=args.command == "daemon",
                               new_boot=new_boot, replay=replay)
    except OSError as exc:
        raise StartupError(f"cannot keep the simulated node in {root}: {exc.strerror or exc} "
                           "(--sim-dir DIR puts it elsewhere)") from None
    if root is not None:
        if args.command == "daemon":
            how = f"resumed at t={sim.at_s:.0f} s" if sim.node.resumed else "new boot"
        else:
            how = f"at t={sim.at_s:.0f} s of its scenario"
        print(f"gpumon: simulated node {scenario.name} ({how}) in {root}", file=sys.stderr)
    return sim


def _canary_on_simulated_node(args: argparse.Namespace, scenario: Scenario) -> Simulation:
    """``canary --simulate``: on the node kept per user (as run-bootstrap), its replay bundles under
    that node's state directory unless --state-dir says otherwise."""
    root = _sim_root(args, scenario)
    print(f"gpumon: simulated node {scenario.name} in {root}", file=sys.stderr)
    return Simulation.start(scenario, args.sim_at, root)


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {"host_root": args.host_root, "profile": args.profile}
    if getattr(args, "listen", None):
        out["exporter"] = {"listen": args.listen}
    return out


class _PipeGuard:
    """sys.stdout while a command runs: when the reader of a pipe leaves (`gpumon status | head`),
    the rest of the output goes to /dev/null and the command finishes, so that its exit code is
    the same wherever stdout goes."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.broken = False

    def _gone(self) -> None:
        if not self.broken:
            self.broken = True
            # what is still buffered, and every later write, goes to /dev/null: at exit Python
            # flushes stdout again, and a failing flush there would turn the exit code into 120
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._out.fileno())
            finally:
                os.close(devnull)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return int(self._out.write(text))
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._out.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def main(argv: Sequence[str] | None = None) -> int:
    real = sys.stdout
    guard = _PipeGuard(real)
    sys.stdout = guard
    try:
        code = _main(argv)
        guard.flush()
        return code
    finally:
        sys.stdout = real


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s gpumon %(levelname)s %(message)s")
    if args.command == "guard":  # reads the guard's files: no config, node or NVML involved
        return guard_cli.main(args)
    try:
        if args.command == "why":
            # reads other nodes' history: no machine, no checks, no node config needed here
            return why_cli.main(args)
        scenario = load_scenario(args.simulate) if args.simulate else None
        # a check that does not load is left out and reported by each command that runs checks
        registry = load_registry()
        checks, not_loaded = registry.checks, registry.not_loaded
        config = load_config(args.config, checks, overrides=_overrides(args), not_loaded=not_loaded)
        if args.command == "canary":
            return _canary(args, config, checks, scenario, not_loaded)
        logging.getLogger().setLevel(config.log_level.upper())
        if args.command == "list-checks":
            return _list_checks(checks, config, not_loaded)
        if args.command == "config":
            return _config(args, config, checks, not_loaded)
        if args.command == "status":
            return _status(config, args, scenario)
        if args.command == "set-healthy":
            return _set_healthy(config, args, scenario)
        if args.command == "record-reset":
            return _record_reset(config, args, scenario)
        # the one place that knows what kind of node this is: everything past it asks the machine
        machine: Machine = _start_simulation(args, scenario) if scenario is not None else Machine()
        agent = Agent(config, checks, machine, persist_state=args.command == "daemon", not_loaded=not_loaded)
        if args.command == "probe-fabric":
            try:
                agent.start(require_nvml=False)
                code = fabric_cli.main(args, agent)
            finally:
                machine.close()
            # not through the interpreter's teardown: torch's communication threads are still
            # alive (gpumon/fabric/probe.py, "Exit")
            _flush_and_exit(code)
        try:
            # a saved kernel log is judged on any machine (a laptop, for a reimaged node's log): no
            # NVML needed, and this host's GPUs are not what the log is about
            agent.start(require_nvml=not (args.command == "check" and args.kmsg_file))
            if args.command == "check":
                return _check(agent, args)
            if args.command == "run-bootstrap":
                return _bootstrap(agent, args)
            if args.command == "daemon":
                from gpumon.daemon import Daemon
                return Daemon(agent).serve(duration=args.duration)
        finally:
            machine.close()
    except ConfigError as exc:
        print(f"gpumon: configuration error: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except StartupError as exc:
        print(f"gpumon: cannot run: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except GpumonError as exc:
        print(f"gpumon: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    parser.error(f"unknown command {args.command}")
    return EXIT_CANNOT_RUN


# the phases the daemon runs on a schedule; the others run when asked (run-bootstrap, probe-fabric)
_SCHEDULED = (Phase.CONTINUOUS, Phase.CANARY)


def _flush_and_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def _list_checks(checks: dict[str, type[Check]], config: Config, not_loaded: dict[str, NotLoaded]) -> int:
    from rich.table import Table

    from gpumon.report import console_for
    console = console_for()
    table = Table()
    for col in ("name", "phase", "interval", "timeout", "enabled", "description"):
        table.add_column(col)
    for name, cls in checks.items():
        s = config.settings(cls)
        interval = f"{s.interval_s:g}s" if cls.phase in _SCHEDULED else "-"
        table.add_row(name, cls.phase.value, interval, f"{s.timeout_s:g}s",
                      "yes" if s.enabled else "no", cls.description)
    for name, bad in not_loaded.items():
        table.add_row(name, "-", "-", "-", "NOT LOADED", f"{bad.target}: {bad.error}")
    console.print("gpumon checks")
    console.print(table)
    console.print("interval: how often the daemon runs the check; - : run on demand (gpumon run-bootstrap)")
    return EXIT_OK


def _config(args: argparse.Namespace, config: Config, checks: dict[str, type[Check]],
            not_loaded: dict[str, NotLoaded]) -> int:
    from gpumon.config_show import render
    from gpumon.profiles import all_profiles, select_profile

    if args.defaults:
        config = load_config(None, checks, site_file=None)
        print(render(config, checks, origins=False), end="")
        return EXIT_OK
    profile = None
    if config.profile != "auto":
        chosen = select_profile(all_profiles([Path(d) for d in config.profile_dirs]), [], config.profile)
        config = with_profile(config, checks, chosen, not_loaded=not_loaded)
        profile = chosen.name
    print(render(config, checks, profile=profile), end="")
    return EXIT_OK


def _canary(args: argparse.Namespace, config: Config, checks: dict[str, type[Check]],
            scenario: Scenario | None, not_loaded: dict[str, NotLoaded]) -> int:
    """``gpumon canary``: through the agent like every command, on a machine without NVML too (a
    CPU run)."""
    machine: Machine = _canary_on_simulated_node(args, scenario) if scenario is not None else Machine()
    try:
        agent = Agent(config, checks, machine, not_loaded=not_loaded)
        agent.start(require_nvml=False)
        try:
            return int(canary_cli.main(args, agent))
        finally:
            agent.stop()
    finally:
        machine.close()


def _emit(agent: Agent, runs: list, args: argparse.Namespace) -> int:  # type: ignore[type-arg]
    extra = {"simulated": label} if (label := agent.machine.label()) else None
    if args.json:
        doc = json_report(runs, node=agent.node, profile=agent.profile.name, verbose=args.verbose,
                          extra=extra)
        print(json.dumps(doc, indent=2))
        return Status(doc["status"]).exit_code
    return print_table(runs, node=agent.node, profile=agent.profile.name, verbose=args.verbose).exit_code


def _check(agent: Agent, args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in agent.checks and n not in agent.not_loaded]
    if unknown:
        raise ConfigError(f"unknown check {unknown[0]!r} (registered: {', '.join(agent.checks)})",
                          key="check")
    # a check that did not load is in the report as a check that could not say (unknown)
    not_loaded = agent.not_loaded_runs(args.names)
    checks = agent.selected(Phase.CONTINUOUS, args.names)
    if args.all_boots and not args.kmsg_file:
        raise ConfigError("--all-boots judges a saved log: give it with --kmsg-file FILE", key="check")
    if args.kmsg_file:  # a saved log judged on purpose, as its own boot (Agent.kernel_log_snapshot)
        if not args.names:
            # the log's checks only: this machine's live readings say nothing about the log's node
            checks = [c for c in checks if c.kernel_log is not None]
        if not args.kmsg_file.is_file():
            raise ConfigError("kernel log file not found", file=str(args.kmsg_file))
        log = agent.kernel_log_snapshot(args.kmsg_file, all_boots=args.all_boots)
        # no NVML here (a laptop): this machine's inventory cannot say whether the log's node had
        # GPUs or NVSwitches, so the log's checks are not gated on it; lines name PCI bus ids
        no_gpus_here = agent.inventory.nvml_error is not None and not agent.inventory.gpus
        gate = not no_gpus_here
        return _emit(agent, agent.runner.run(checks, log, gate=gate) + not_loaded, args)
    runs = _replay(agent, checks) if agent.machine.replays else agent.run_once(checks)
    return _emit(agent, runs + not_loaded, args)


def _replay(agent: Agent, checks: list[Check]) -> list[CheckRun]:
    """``check --simulate``: the scenario's timeline read as the daemon would have read it: the
    checks run at each of the replay's times, in scenario time, keeping their state from run to
    run, each run handed the kernel-log records logged since the one before; the last run's
    findings are the report (see ``check --help``)."""
    agent.runner.clock = agent.machine.clock
    source = agent.kernel_log_source()  # opened at its first read

    def step() -> list[CheckRun]:
        return agent.runner.run(checks, ReadOnce(source.read_log))

    try:
        return agent.machine.replay(step)
    finally:
        source.close()


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _bootstrap(agent: Agent, args: argparse.Namespace) -> int:
    from rich.console import Console

    from gpumon.bootstrap import print_suite, record_health, run_suite, select
    from gpumon.health import Health

    checks = select(agent, _split(args.only), _split(args.skip))  # ConfigError on unknown names
    if not checks:
        raise StartupError("no bootstrap checks to run (none registered or all skipped)")
    # progress on stderr, so that stdout is the report
    result = run_suite(agent, checks, fail_fast=args.fail_fast, console=Console(stderr=True, highlight=False))
    health = Health.open(agent.state_dir, boot_id=agent.hw.fs.boot_id())
    try:
        record_health(result, health)  # every run; retest_passed(by="bootstrap") when the suite passed
    finally:
        health.close()
    if args.json:
        print(json.dumps(result.report(verbose=args.verbose), indent=2))
    else:
        print_suite(result, Console(highlight=False), verbose=args.verbose)
    return int(result.exit_code)


_LEVEL_EXIT = {"healthy": EXIT_OK, "degraded": EXIT_WARN, "unhealthy": EXIT_FAIL, "quarantined": EXIT_FAIL}


def _state_dir(config: Config, args: argparse.Namespace, scenario: Scenario | None) -> Path:
    """--state-dir, else the simulated node's (--simulate), else the config's state_dir."""
    if args.state_dir:
        return Path(args.state_dir)
    if scenario is not None:
        return _sim_root(args, scenario) / "state"
    return Path(config.state_dir)


def _status(config: Config, args: argparse.Namespace, scenario: Scenario | None) -> int:
    from datetime import datetime, timezone

    from gpumon.health import StoreError, load_view
    from gpumon.report import console_for, print_records

    state_dir = _state_dir(config, args, scenario)
    try:
        view = load_view(state_dir)
    except StoreError as exc:
        hint = ""
        if scenario is not None and not args.state_dir:
            hint = (f" (`gpumon daemon --simulate {args.simulate}` runs the simulated node that "
                    "keeps its health there)")
        if exc.corrupt:
            hint += _CORRUPT_HINT
        raise StartupError(f"no health state: {exc}{hint}") from None
    if scenario is not None:
        print(f"gpumon: simulated node {scenario.name}: health state in {state_dir}", file=sys.stderr)
    code = _LEVEL_EXIT[view.node.level.value]
    if args.json:
        print(json.dumps(view.to_json(history=args.history), indent=2))
        return code

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"

    console = console_for()
    node = view.node
    console.print(f"node: [bold]{node.level.value}[/] (action {node.action.value}) since {when(node.since)}")
    if node.quarantine is not None:
        console.print(f"quarantined by {node.quarantine.by} since {when(node.quarantine.since)}: "
                      f"{node.quarantine.reason}")
    # a healthy component is listed too while a check still reports a finding on it that
    # set-healthy accepted: /metrics shows that finding's severity (and gpumon_finding_accepted)
    shown = {n: c for n, c in view.components.items()
             if args.verbose or c.level.value != "healthy" or c.accepted}
    rows = []
    for name, comp in sorted(shown.items()):
        why = [f"{f.check}: {f.message}" for f in comp.why]
        why += [f"accepted, still reported: {a.check}: {a.severity.value}: {a.message}"
                for a in comp.accepted]
        rows.append(((name, comp.level.value, comp.action.value, when(comp.since)), why))
    if shown:
        print_records(console, ("component", "state", "action", "since", "why"), rows, wrap={3})
    healthy = len(view.components) - len(shown)
    if healthy:
        console.print(f"{healthy} more components healthy (-v lists them)")
    for name, events in sorted(view.history.items()):
        if name not in shown:
            continue
        for e in events[-args.history:]:
            said = e.payload.get("message", e.payload.get("reason", ""))
            # an event with no check or no words (a boot) leaves no blank field at the end of its line
            words = [when(e.time), name, e.kind.value, e.check, "" if said is None else str(said)]
            console.print("  " + " ".join(w for w in words if w), markup=False)
    return code


_CORRUPT_HINT = (" (the daemon moves a corrupt store aside, as health.db.corrupt-<time>, and starts a "
                 "fresh one when it starts)")


def _operator_event(config: Config, args: argparse.Namespace, scenario: Scenario | None, what: str,
                    record: Callable[[Health], object]) -> None:
    """Append an operator's event to the node's health store (the daemon, if it runs, reads it
    from there); ``what`` names it in the error when it cannot be stored."""
    from gpumon.health import Health, StoreError
    from gpumon.hw.calls import BoundedCaller
    from gpumon.hw.hostfs import HostFs

    host_root = _sim_root(args, scenario) / "host" if scenario is not None else Path(config.host_root)
    boot = HostFs(host_root, BoundedCaller(), config.timeouts.sysfs_read_s).boot_id()
    health = Health.open(_state_dir(config, args, scenario), boot_id=boot)
    try:
        record(health)
    except ValueError as exc:
        raise ConfigError(str(exc), key=args.command) from None
    except StoreError as exc:
        raise StartupError(f"could not record {what}: {exc}"
                           + (_CORRUPT_HINT if exc.corrupt else "")) from None
    finally:
        health.close()


def _set_healthy(config: Config, args: argparse.Namespace, scenario: Scenario | None) -> int:
    import getpass

    _operator_event(config, args, scenario, "the override",
                    lambda h: h.set_healthy(args.component, who=getpass.getuser(), reason=args.reason))
    print(f"gpumon: {args.component} marked healthy ({args.reason}): its recorded faults are closed; a "
          "finding a check still repeats word for word is accepted (gpumon status lists it, /metrics "
          "gpumon_finding_accepted), and its fault is raised again as soon as the check says "
          "anything else about it")
    return EXIT_OK


def _record_reset(config: Config, args: argparse.Namespace, scenario: Scenario | None) -> int:
    """A GPU reset gpumon did not do (``nvidia-smi -r``): its ``reset_gpu`` faults are then
    remediated and close at the next passing retest, as after a reboot. A reset is recorded, not
    proven: the retest is what brings the GPU back."""
    import getpass

    from gpumon.model import NODE, Action, is_component

    component = args.component.strip()
    if component != NODE and not (component.startswith("gpu/") and is_component(component)):
        raise ConfigError(f"record-reset names gpu/<i> or node, not {component!r}", key="component")
    if not args.reason.strip():
        raise ConfigError("record-reset needs a reason", key="--reason")
    _operator_event(config, args, scenario, "the reset",
                    lambda h: h.remediation(Action.RESET_GPU, component, by=getpass.getuser(),
                                            detail=args.reason))
    which = "every GPU" if component == NODE else component
    print(f"gpumon: reset of {which} recorded ({args.reason}): its reset_gpu faults await a retest; "
          "they close when `gpumon run-bootstrap` passes, or when the check that raised them passes "
          "again (`gpumon status` shows `remediated: awaiting retest` until then)")
    return EXIT_OK
