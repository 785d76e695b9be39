"""The ``gpumon`` command. The only module that turns errors into exit codes.

Exit codes (Nagios / NHC convention that Slurm health checks and
node-problem-detector plugins read): 0 all OK, 1 warnings only, 2 at least one
failure, 3 could not run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from gpumon import __version__
from gpumon.agent import Agent, Simulation
from gpumon.check import Check
from gpumon.config import Config, load_config
from gpumon.errors import ConfigError, GpumonError, StartupError
from gpumon.fabric import cli as fabric_cli
from gpumon.model import Phase, Status
from gpumon.registry import load_checks
from gpumon.report import json_report, print_table
from gpumon.sdc import cli as canary_cli
from gpumon.sim.scenario import load_scenario

EXIT_OK = 0
EXIT_WARN = 1
EXIT_FAIL = 2
EXIT_CANNOT_RUN = 3

log = logging.getLogger("gpumon")


def _global_options(suppress: bool = False) -> argparse.ArgumentParser:
    # Global flags are accepted before and after the command. The command's
    # copy must not reset a value given before it, hence SUPPRESS there.
    p = argparse.ArgumentParser(add_help=False,
                                argument_default=argparse.SUPPRESS if suppress else None)
    p.add_argument("--config", type=Path, metavar="FILE",
                   help="config file (default /etc/gpumon/gpumon.yaml if present)")
    p.add_argument("--host-root", metavar="DIR", help="where the host's /sys, /proc, /dev are (default /)")
    p.add_argument("--profile", metavar="NAME", help="SKU profile (default: chosen from the GPU name)")
    p.add_argument("--simulate", metavar="SCENARIO",
                   help="run on a simulated node: a shipped scenario name or a scenario YAML file")
    p.add_argument("--sim-at", type=float, metavar="SECONDS",
                   help="one-shot commands: render the scenario at this time "
                        "(default: after every fault has started)")
    p.add_argument("--sim-dir", type=Path, metavar="DIR",
                   help="render the simulated node here instead of a temporary directory")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumon", parents=[_global_options()],
                                     description="GPU node health-check agent")
    parser.add_argument("--version", action="version", version=f"gpumon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _global_options(suppress=True)

    p = sub.add_parser("check", parents=[common], help="one-shot run of the continuous checks")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these checks")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("-v", "--verbose", action="store_true", help="show ok findings too")

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

    canary_cli.add_parser(sub, [common])
    fabric_cli.add_parser(sub, [common])

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
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, object] = {"host_root": args.host_root, "profile": args.profile}
    if getattr(args, "listen", None):
        out["exporter"] = {"listen": args.listen}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # `gpumon status | head`: the reader left; not an error of ours
        sys.stderr.close()
        return EXIT_OK


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s gpumon %(levelname)s %(message)s")
    try:
        if args.command == "canary":
            return int(canary_cli.main(args))
        checks = load_checks()
        config = load_config(args.config, checks, overrides=_overrides(args))
        logging.getLogger().setLevel(config.log_level.upper())
        if args.command == "list-checks":
            return _list_checks(checks, config)
        if args.command == "status":
            return _status(config, args)
        if args.command == "set-healthy":
            return _set_healthy(config, args)
        simulation = None
        if args.simulate:
            scenario = load_scenario(args.simulate)
            simulation = Simulation.start(scenario, args.sim_at, args.sim_dir,
                                          live=args.command == "daemon")
        if args.command == "probe-fabric":
            try:
                return fabric_cli.main(args, config, checks, simulation)
            finally:
                if simulation is not None:
                    simulation.close()
        agent = Agent(config, checks, simulation, persist_state=args.command == "daemon")
        try:
            agent.start()
            if args.command == "check":
                return _check(agent, args)
            if args.command == "run-bootstrap":
                return _bootstrap(agent, args)
            if args.command == "daemon":
                from gpumon.daemon import Daemon
                return Daemon(agent).serve(duration=args.duration)
        finally:
            if simulation is not None:
                simulation.close()
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


def _list_checks(checks: dict[str, type[Check]], config: Config) -> int:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="gpumon checks", title_justify="left")
    for col in ("name", "phase", "interval", "timeout", "enabled", "description"):
        table.add_column(col, overflow="fold")
    for name, cls in checks.items():
        s = config.settings(cls)
        table.add_row(name, cls.phase.value, f"{s.interval_s:g}s", f"{s.timeout_s:g}s",
                      "yes" if s.enabled else "no", cls.description)
    Console(highlight=False).print(table)
    return EXIT_OK


def _emit(agent: Agent, runs: list, args: argparse.Namespace) -> int:  # type: ignore[type-arg]
    extra = {"simulated": agent.simulation.scenario.name} if agent.simulation else None
    if args.json:
        doc = json_report(runs, node=agent.node, profile=agent.profile.name, verbose=args.verbose,
                          extra=extra)
        print(json.dumps(doc, indent=2))
        return Status(doc["status"]).exit_code
    return print_table(runs, node=agent.node, profile=agent.profile.name, verbose=args.verbose).exit_code


def _check(agent: Agent, args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in agent.checks]
    if unknown:
        raise ConfigError(f"unknown check {unknown[0]!r} (registered: {', '.join(agent.checks)})",
                          key="check")
    checks = agent.selected(Phase.CONTINUOUS, args.names)
    runs = agent.run_once(checks)
    return _emit(agent, runs, args)


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


def _state_dir(config: Config, args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else Path(config.state_dir)


def _status(config: Config, args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from rich.console import Console
    from rich.table import Table

    from gpumon.health import StoreError, load_view

    try:
        view = load_view(_state_dir(config, args))
    except StoreError as exc:
        raise StartupError(f"no health state: {exc}") from None
    code = _LEVEL_EXIT[view.node.level.value]
    if args.json:
        print(json.dumps(view.to_json(history=args.history), indent=2))
        return code

    def when(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"

    console = Console(highlight=False)
    node = view.node
    console.print(f"node: [bold]{node.level.value}[/] (action {node.action.value}) since {when(node.since)}")
    if node.quarantine is not None:
        console.print(f"quarantined by {node.quarantine.by} since {when(node.quarantine.since)}: "
                      f"{node.quarantine.reason}")
    table = Table(title_justify="left")
    for col in ("component", "state", "action", "since", "why"):
        table.add_column(col, overflow="fold")
    shown = {n: c for n, c in view.components.items() if args.verbose or c.level.value != "healthy"}
    for name, comp in sorted(shown.items()):
        why = "; ".join(f"{f.check}: {f.message}" for f in comp.why)
        table.add_row(name, comp.level.value, comp.action.value, when(comp.since), why)
    console.print(table)
    healthy = len(view.components) - len(shown)
    if healthy:
        console.print(f"{healthy} more components healthy (-v lists them)")
    for name, events in sorted(view.history.items()):
        if name not in shown:
            continue
        for e in events[-args.history:]:
            console.print(f"  {when(e.time)} {name} {e.kind.value} {e.check} "
                          f"{e.payload.get('message', e.payload.get('reason', ''))}")
    return code


def _set_healthy(config: Config, args: argparse.Namespace) -> int:
    import getpass

    from gpumon.health import Health, StoreError
    from gpumon.hw.calls import BoundedCaller
    from gpumon.hw.hostfs import HostFs

    boot = HostFs(Path(config.host_root), BoundedCaller(), config.timeouts.sysfs_read_s).boot_id()
    health = Health.open(_state_dir(config, args), boot_id=boot)
    try:
        health.set_healthy(args.component, who=getpass.getuser(), reason=args.reason)
    except ValueError as exc:
        raise ConfigError(str(exc), key="set-healthy") from None
    except StoreError as exc:
        raise StartupError(f"could not record the override: {exc}") from None
    finally:
        health.close()
    print(f"gpumon: {args.component} marked healthy ({args.reason})")
    return EXIT_OK
