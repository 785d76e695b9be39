#!/bin/sh
# gpumon as a Slurm HealthCheckProgram (docs/operators/slurm-healthcheck.md).
#
# Slurm ignores a health check's exit code: the program must drain the node
# itself. This wrapper runs `gpumon check --json` and acts on its exit code
# (the Nagios/NHC convention gpumon follows):
#   0 ok, 1 warnings only  -> leave the node as it is (no RPC to slurmctld)
#   2 a check failed        -> drain with "gpumon: <worst action>: <first failing finding>",
#                              unless the node is already out with someone else's reason;
#                              only with gpumon's failing JSON report on stdout: an exit 2 without
#                              one (a usage error of another program or an older gpumon) is
#                              treated as 3
#   3 (or a timeout, or gpumon missing) gpumon could not run, or its arguments are wrong (a
#     usage error is 3: a typo in GPUMON_ARGS never drains)
#                           -> leave the node, exit 1 so slurmd logs it; drain only if
#                              GPUMON_HC_DRAIN_ON_ERROR=1
# gpumon never resumes from here: the daemon (remediation.mode=enforce) or an operator
# lifts a gpumon drain after `gpumon run-bootstrap` passes.
#
# Settings (environment, or the file named by GPUMON_HC_DEFAULTS, default
# /etc/default/gpumon-healthcheck, since slurmd passes no environment):
#   GPUMON                    gpumon command (default: gpumon on PATH, else
#                             /opt/gpumon/bin/gpumon, the venv of docs/operators/install.md)
#   GPUMON_ARGS               extra arguments for `gpumon check`, e.g. "--config /etc/gpumon/gpumon.yaml"
#   GPUMON_HC_TIMEOUT         seconds for gpumon check (default 40; slurmd kills us at 60)
#   GPUMON_HC_DRAIN_ON_ERROR  1: drain when gpumon cannot run (default 0)
#   GPUMON_HC_MAX_PERCENT     circuit breaker: no new drain while more than this percentage
#                             of the cluster's nodes is drained by gpumon (default 20)
#   GPUMON_SLURM_NODE         node name (default $SLURMD_NODENAME, then hostname -s)
set -u

# slurmd starts the health check with an empty environment except
# SLURMD_NODENAME: no PATH at all. Keep a caller's PATH first (tests, manual runs).
PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH

defaults=${GPUMON_HC_DEFAULTS:-/etc/default/gpumon-healthcheck}
if [ -r "$defaults" ]; then
    # shellcheck source=/dev/null
    . "$defaults"
fi

# The documented layout (docs/operators/install.md) is a venv at /opt/gpumon; the /usr/local/bin
# link to it is optional.
if [ -z "${GPUMON:-}" ]; then
    if command -v gpumon >/dev/null 2>&1; then GPUMON=gpumon; else GPUMON=/opt/gpumon/bin/gpumon; fi
fi
GPUMON_ARGS=${GPUMON_ARGS:-}
GPUMON_HC_TIMEOUT=${GPUMON_HC_TIMEOUT:-40}
GPUMON_HC_DRAIN_ON_ERROR=${GPUMON_HC_DRAIN_ON_ERROR:-0}
GPUMON_HC_MAX_PERCENT=${GPUMON_HC_MAX_PERCENT:-20}
# Slurm clients give up on a dead controller after ~9 s; bound them anyway.
slurm_timeout=15
max_reason_bytes=200

say() {
    printf 'gpumon-healthcheck: %s\n' "$*"
    # syslog too: slurmd shows our output only for a non-zero exit
    logger -t gpumon-healthcheck -- "$*" 2>/dev/null || :
}

# Run "$@" for at most $1 seconds when coreutils timeout exists (exit 124 on expiry).
bounded() {
    limit=$1
    shift
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 5 "$limit" "$@"
    else
        "$@"
    fi
}

node=${GPUMON_SLURM_NODE:-${SLURMD_NODENAME:-$(hostname -s)}}
# NodeName= takes lists and hostlist ranges: a bad name could drain many nodes.
case $node in
    '' | -* | *[!A-Za-z0-9._-]*)
        say "refusing to act on node name '$node'"
        exit 1
        ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpumon-hc.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
trap 'exit 1' HUP INT TERM

# Worst action and a one-line summary from the JSON report (indented by
# json.dumps, one key per line). Prints two lines: action, summary.
summarise() {
    awk '
        function val(line) {
            sub(/^[^:]*:[ \t]*"/, "", line)
            sub(/",?[ \t]*$/, "", line)
            gsub(/\\"/, "\"", line)
            gsub(/\\\\/, "\\", line)
            return line
        }
        BEGIN {
            rank["none"] = 0; rank["restart_app"] = 1; rank["check_cables"] = 2; rank["confirm_sdc"] = 3
            rank["reset_gpu"] = 4; rank["reboot_node"] = 5; rank["inspect_hardware"] = 6
            best = -1; n = 0
        }
        /"check": "/     { check = val($0); comp = ""; sev = ""; act = "" }
        /"component": "/ { comp = val($0) }
        /"severity": "/  { sev = val($0) }
        /"action": "/    { act = val($0) }
        /"message": "/ {
            if (sev != "fail") next
            n++
            r = (act in rank) ? rank[act] : 0
            if (r > best) { best = r; bact = act; bsum = check " " comp ": " val($0) }
            sev = ""  # an evidence key named "message" must not count twice
        }
        END {
            if (n == 0) exit 1
            if (n > 1) bsum = bsum " (+" (n - 1) " more failing)"
            print bact
            print bsum
        }
    '
}

# Circuit breaker for a new drain, as the daemon has (DESIGN.md): a fleet-wide
# false positive (say a driver update that makes every node report an Xid)
# must not drain the cluster. Counts every gpumon drain, however old: the
# reason time is not portable to compare in sh, and this errs on the safe side.
breaker() {
    if bounded "$slurm_timeout" sinfo --noheader --Node --all --format='%N|%E' >"$tmp/fleet" \
        2>"$tmp/fleet.err"; then
        :
    else
        say "cannot read the cluster from Slurm: $(tail -n 1 "$tmp/fleet.err"); not drained: $1"
        exit 1
    fi
    # a node in several partitions is listed once per partition
    total=$(cut -d'|' -f1 "$tmp/fleet" | sort -u | wc -l)
    ours=$(awk -F'|' '$2 ~ /^gpumon:/ { print $1 }' "$tmp/fleet" | sort -u | wc -l)
    if [ $((ours * 100)) -gt $((GPUMON_HC_MAX_PERCENT * total)) ]; then
        say "circuit breaker: $ours of $total nodes already drained by gpumon (over ${GPUMON_HC_MAX_PERCENT}%);" \
            "node $node not drained: $1"
        exit 1
    fi
}

drain() {
    # one line, capped; the report is JSON with ensure_ascii, so a byte cut splits no character
    reason=$(printf '%s' "$1" | tr -d '[:cntrl:]' | cut -b "1-$max_reason_bytes")
    if bounded "$slurm_timeout" sinfo --noheader --Node --all --nodes="$node" \
        --format='%T|%H|%E' >"$tmp/sinfo" 2>"$tmp/sinfo.err"; then
        :
    else
        say "cannot read node $node from Slurm: $(tail -n 1 "$tmp/sinfo.err"); not drained: $reason"
        exit 1
    fi
    line=$(sed -n 1p "$tmp/sinfo")
    if [ -z "$line" ]; then
        say "node $node is not known to Slurm; not drained: $reason"
        exit 1
    fi
    state=${line%%|*}
    rest=${line#*|}
    stamp=${rest%%|*}
    current=${rest#*|}
    # sinfo prints reason "none" with time "Unknown" for a node without one
    if [ "$current" = none ] && [ "$stamp" = Unknown ]; then
        current=
    fi
    case $current in
        gpumon:*) ;; # gpumon's own drain: only the reason is brought up to date
        '') breaker "$reason" ;;
        *)
            # Draining would replace their reason with ours, and gpumon would
            # later resume a node an operator took out.
            say "node $node is already out ($state) with reason '$current'; left alone" \
                "(would have been: $reason)"
            exit 0
            ;;
    esac
    if bounded "$slurm_timeout" scontrol update NodeName="$node" State=DRAIN Reason="$reason" \
        2>"$tmp/scontrol.err"; then
        say "drained $node: $reason"
        exit 0
    fi
    say "drain of $node failed: $(tail -n 1 "$tmp/scontrol.err"); wanted: $reason"
    exit 1
}

# GPUMON_ARGS is split into words on purpose (several options).
# shellcheck disable=SC2086
bounded "$GPUMON_HC_TIMEOUT" "$GPUMON" check --json $GPUMON_ARGS >"$tmp/report" 2>"$tmp/err"
rc=$?

case $rc in
    0) exit 0 ;;
    1)
        say "gpumon check: warnings only; node left in service"
        exit 0
        ;;
    2)
        # Exit 2 drains only with gpumon's own failing report on stdout: argparse in older
        # gpumon releases, sh and python also exit 2 on a usage error, and one bad GPUMON_ARGS
        # rolled out must not drain the fleet.
        if ! grep -q '^  "status": "fail",\{0,1\}$' "$tmp/report"; then
            detail=$(tail -n 1 "$tmp/err")
            say "gpumon check exited 2 without a failing gpumon report (a usage error?)${detail:+: $detail};" \
                "node left as it is"
            if [ "$GPUMON_HC_DRAIN_ON_ERROR" = 1 ]; then
                drain "gpumon: unknown: gpumon check exited 2 without a report"
            fi
            exit 1
        fi
        if summarise <"$tmp/report" >"$tmp/summary"; then
            action=$(sed -n 1p "$tmp/summary")
            summary=$(sed -n 2p "$tmp/summary")
            drain "gpumon: $action: $summary"
        fi
        drain "gpumon: unknown: gpumon check failed (exit 2) but its report could not be read"
        ;;
    *)
        case $rc in
            124 | 137) why="did not finish within ${GPUMON_HC_TIMEOUT} s" ;;
            126 | 127) why="could not be started ($GPUMON: exit $rc)" ;;
            *) why="could not run (exit $rc)" ;;
        esac
        detail=$(tail -n 1 "$tmp/err")
        say "gpumon check $why${detail:+: $detail}; node left as it is"
        if [ "$GPUMON_HC_DRAIN_ON_ERROR" = 1 ]; then
            drain "gpumon: unknown: gpumon check $why"
        fi
        exit 1
        ;;
esac
