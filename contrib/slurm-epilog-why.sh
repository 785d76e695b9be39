#!/bin/sh
# gpumon why as a Slurm EpilogSlurmctld: a post-mortem of every failed job (README, "gpumon why").
#
# For a job that failed (SLURM_JOB_EXIT_CODE or SLURM_JOB_DERIVED_EC not 0: the controller sets
# both, for EpilogSlurmctld only), runs `gpumon why --job $SLURM_JOB_ID --json` and
#   - writes the verdict's one-line summary (gpumon's `admin_comment`, at most 400 bytes) into the
#     job's AdminComment (`sacct -o AdminComment`): `scontrol update job=`, which Slurm refuses
#     for a finished job, then `sacctmgr modify job` (the accounting database: needs slurmdbd);
#     and logs it (stdout and syslog) in any case;
#   - drains each culprit node with gpumon's reason ("gpumon: <action>: why: ...", as gpumon's own
#     Slurm remediation writes it) only when the verdict is `infrastructure` and that node's
#     suspect is tier-1 hardware (a lost GPU, a hardware Xid, an IB outage longer than NCCL's retry
#     window, an NVLink link down): gpumon's `culprits`. Never on `inconclusive`, never for a
#     tier-2 "may explain it", never a node someone else already took out, and not past the
#     circuit breaker. The reason's "gpumon:" prefix is gpumon's ownership mark: the node's gpumon
#     daemon (remediation.mode=enforce) may lift that drain once its retest passes, and never lifts
#     anyone else's.
#
# Run it as EpilogSlurmctld (once per job, on the controller), not as Epilog: slurmd runs an
# Epilog on every node of the job (N post-mortems of one job), without the job's exit code, and
# an Epilog that exits non-zero DRAINS THE NODE IT RAN ON (Slurm's Prolog and Epilog Guide).
# So this script exits 0 whatever goes wrong (gpumon missing, Slurm unreachable, bad JSON),
# logging why to stdout and syslog (tag gpumon-why-epilog); it never fails the epilog.
#
# Settings (environment, or the file named by GPUMON_WHY_DEFAULTS, default
# /etc/default/gpumon-why, since slurmctld passes the epilog no PATH and little else):
#   GPUMON                    gpumon command (default: gpumon on PATH, else /opt/gpumon/bin/gpumon)
#   GPUMON_WHY_ARGS           extra arguments for `gpumon why`, e.g.
#                             "--api-url https://{node}.cluster:9426 --cacert /etc/gpumon/ca.crt
#                              --user prometheus --password-file /etc/gpumon/why.password"
#   GPUMON_WHY_TIMEOUT        seconds for gpumon why (default 120)
#   GPUMON_WHY_METRICS_FILE   node_exporter textfile for gpumon_why_verdicts_total (default: none)
#   GPUMON_WHY_DRAIN          0: never drain, only comment (default 1)
#   GPUMON_WHY_MAX_PERCENT    circuit breaker: no new drain while more than this percentage of the
#                             cluster's nodes is drained by gpumon (default 20)
#   GPUMON_WHY_ALL            1: a post-mortem of every job, failed or not (default 0)
#   GPUMON_WHY_COMMENT_TRIES  how often sacctmgr is asked to store the AdminComment while the
#                             job's record has not reached the database yet, 2 s apart (default 10)
#   SLURM_CONF                where Slurm's clients find slurm.conf, when not in the default place
#                             (slurmctld does not pass its own on to the epilog)
# Needs jq (Debian package jq) to read the verdict.
set -u

PATH="${PATH:+$PATH:}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH

say() {
    printf 'gpumon-why-epilog: job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*"
    logger -t gpumon-why-epilog -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || :
}

defaults=${GPUMON_WHY_DEFAULTS:-/etc/default/gpumon-why}
if [ -r "$defaults" ]; then
    # shellcheck source=/dev/null
    . "$defaults"
fi

if [ -n "${SLURM_CONF:-}" ]; then
    export SLURM_CONF
fi
if [ -z "${GPUMON:-}" ]; then
    if command -v gpumon >/dev/null 2>&1; then GPUMON=gpumon; else GPUMON=/opt/gpumon/bin/gpumon; fi
fi
GPUMON_WHY_ARGS=${GPUMON_WHY_ARGS:-}
GPUMON_WHY_TIMEOUT=${GPUMON_WHY_TIMEOUT:-120}
GPUMON_WHY_METRICS_FILE=${GPUMON_WHY_METRICS_FILE:-}
GPUMON_WHY_DRAIN=${GPUMON_WHY_DRAIN:-1}
GPUMON_WHY_MAX_PERCENT=${GPUMON_WHY_MAX_PERCENT:-20}
GPUMON_WHY_ALL=${GPUMON_WHY_ALL:-0}
GPUMON_WHY_COMMENT_TRIES=${GPUMON_WHY_COMMENT_TRIES:-10}
slurm_timeout=15

job=${SLURM_JOB_ID:-}
case $job in
    '' | *[!0-9_+]*)
        say "no usable SLURM_JOB_ID ('$job'): nothing done"
        exit 0
        ;;
esac

# The controller's exit codes: SLURM_JOB_EXIT_CODE is the batch script's wait status,
# SLURM_JOB_DERIVED_EC the highest of its steps' (an srun job's failure is there).
ec=${SLURM_JOB_EXIT_CODE:-}
dec=${SLURM_JOB_DERIVED_EC:-}
if [ "$GPUMON_WHY_ALL" != 1 ]; then
    if [ -z "$ec" ] && [ -z "$dec" ]; then
        say "no SLURM_JOB_EXIT_CODE nor SLURM_JOB_DERIVED_EC (is this EpilogSlurmctld?): the job is" \
            "taken as failed"
    elif [ "${ec:-0}" = 0 ] && [ "${dec:-0}" = 0 ]; then
        exit 0 # a job that succeeded needs no post-mortem
    fi
fi

if ! command -v jq >/dev/null 2>&1; then
    say "jq not installed (Debian package jq): no post-mortem"
    exit 0
fi

bounded() {
    limit=$1
    shift
    if command -v timeout >/dev/null 2>&1; then
        timeout -k 5 "$limit" "$@"
    else
        "$@"
    fi
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpumon-why.XXXXXX") || {
    say "cannot make a temporary directory: no post-mortem"
    exit 0
}
trap 'rm -rf "$tmp"' EXIT
trap 'exit 0' HUP INT TERM

# The allocation: at an EpilogSlurmctld `scontrol show job` lists only the nodes still completing
nodes=
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    nodes="--job-nodes $SLURM_JOB_NODELIST"
fi
metrics=
if [ -n "$GPUMON_WHY_METRICS_FILE" ]; then
    metrics="--metrics-file $GPUMON_WHY_METRICS_FILE"
fi
# GPUMON_WHY_ARGS, nodes and metrics are split into words on purpose (options and their values;
# a hostlist holds no blank).
# shellcheck disable=SC2086
bounded "$GPUMON_WHY_TIMEOUT" "$GPUMON" why --job "$job" --json $nodes $metrics $GPUMON_WHY_ARGS \
    >"$tmp/verdict" 2>"$tmp/err"
rc=$?

# exit 0..3 with the JSON verdict on stdout is gpumon's answer; anything else is gpumon failing
verdict=$(jq -r '.verdict // empty' "$tmp/verdict" 2>/dev/null)
if [ -z "$verdict" ]; then
    say "gpumon why gave no verdict (exit $rc): $(tail -n 1 "$tmp/err" 2>/dev/null)"
    exit 0
fi
if [ "$verdict" = cannot_answer ]; then
    say "job as read: $(jq -c '.job' "$tmp/verdict" 2>/dev/null); notes: $(jq -c '.notes' "$tmp/verdict" 2>/dev/null)"
fi
comment=$(jq -r '.admin_comment // empty' "$tmp/verdict" | tr -d '[:cntrl:]' | cut -b 1-400)
say "$comment"

# the nodes that did not answer, and why: in the log, where an operator reads why it is inconclusive
jq -r '.nodes[]? | select(.reachable | not) | "unreachable: \(.node) (\(.url)): \(.error)"' \
    "$tmp/verdict" 2>/dev/null | while IFS= read -r line; do say "$line"; done

# The AdminComment: scontrol updates the controller's record of a job not yet finished; Slurm
# (22.05) refuses it for a finished one ("Job has already finished"), which is what an
# EpilogSlurmctld sees. A finished job's AdminComment is changed in the accounting database
# (sacctmgr(1): "DerivedExitCode, AdminComment, Comment, SystemComment, and WCKey [...] can be
# modified after job completion"), so it needs slurmdbd; without one the verdict is only logged.
# slurmctld sends a job's records to slurmdbd through a queue, so the record may reach the
# database a few seconds after the epilog starts: until then sacctmgr says "Nothing modified",
# and it is asked again (GPUMON_WHY_COMMENT_TRIES times, 2 s apart). sacctmgr (22.05) stores the
# value lower-cased, turns a ' into a ` and cuts it at a ": the quotes are left out there.
store_comment() {
    if bounded "$slurm_timeout" scontrol update "job=$job" "AdminComment=$comment" 2>"$tmp/scontrol.err"; then
        return 0
    fi
    unquoted=$(printf '%s' "$comment" | tr -d "\"'")
    try=1
    while :; do
        if bounded "$slurm_timeout" sacctmgr -i modify job where "jobid=$job" set "AdminComment=$unquoted" \
            >"$tmp/sacctmgr.out" 2>&1; then
            return 0
        fi
        grep -q 'Nothing modified' "$tmp/sacctmgr.out" || break
        [ "$try" -lt "$GPUMON_WHY_COMMENT_TRIES" ] || break
        try=$((try + 1))
        sleep 2
    done
    say "AdminComment not stored: scontrol: $(tail -n 1 "$tmp/scontrol.err");" \
        "sacctmgr: $(tr '\n' ' ' <"$tmp/sacctmgr.out" | cut -b 1-300)"
}
if [ -n "$comment" ]; then
    store_comment
fi

[ "$verdict" = infrastructure ] || exit 0
[ "$GPUMON_WHY_DRAIN" = 1 ] || exit 0

# Circuit breaker, as the daemon's and contrib/slurm-healthcheck.sh's: a fleet-wide false
# positive must not drain the cluster. Every gpumon drain counts, however old.
breaker_open() {
    if bounded "$slurm_timeout" sinfo --noheader --Node --all --format='%N|%E' >"$tmp/fleet" \
        2>"$tmp/fleet.err"; then
        :
    else
        say "cannot read the cluster from Slurm: $(tail -n 1 "$tmp/fleet.err"); not drained: $1"
        return 0
    fi
    total=$(cut -d'|' -f1 "$tmp/fleet" | sort -u | wc -l)
    ours=$(awk -F'|' '$2 ~ /^gpumon:/ { print $1 }' "$tmp/fleet" | sort -u | wc -l)
    if [ $(((ours + 1) * 100)) -gt $((GPUMON_WHY_MAX_PERCENT * total)) ]; then
        say "circuit breaker: $ours of $total nodes drained by gpumon; one more is over" \
            "${GPUMON_WHY_MAX_PERCENT}%: not drained: $1"
        return 0
    fi
    return 1
}

drain() {
    node=$1
    reason=$(printf '%s' "$2" | tr -d '[:cntrl:]' | cut -b 1-200)
    # NodeName= takes lists and hostlist ranges: a bad name could drain many nodes.
    case $node in
        '' | -* | *[!A-Za-z0-9._-]*)
            say "refusing to act on node name '$node'"
            return
            ;;
    esac
    if bounded "$slurm_timeout" sinfo --noheader --Node --all --nodes="$node" \
        --format='%T|%H|%E' >"$tmp/sinfo" 2>"$tmp/sinfo.err"; then
        :
    else
        say "cannot read node $node from Slurm: $(tail -n 1 "$tmp/sinfo.err"); not drained: $reason"
        return
    fi
    line=$(sed -n 1p "$tmp/sinfo")
    if [ -z "$line" ]; then
        say "node $node is not known to Slurm; not drained: $reason"
        return
    fi
    rest=${line#*|}
    stamp=${rest%%|*}
    current=${rest#*|}
    if [ "$current" = none ] && [ "$stamp" = Unknown ]; then
        current=
    fi
    case $current in
        '') ;;
        gpumon:*)
            say "node $node is already drained by gpumon ('$current'); left as it is"
            return
            ;;
        *)
            say "node $node is already out with reason '$current'; left alone (would have been: $reason)"
            return
            ;;
    esac
    if breaker_open "$reason"; then
        return
    fi
    if bounded "$slurm_timeout" scontrol update NodeName="$node" State=DRAIN Reason="$reason" \
        2>"$tmp/drain.err"; then
        say "drained $node: $reason"
    else
        say "drain of $node failed: $(tail -n 1 "$tmp/drain.err"); wanted: $reason"
    fi
}

jq -r '.culprits[]? | [.node, .drain_reason] | @tsv' "$tmp/verdict" >"$tmp/culprits" 2>/dev/null
tab=$(printf '\t')
while IFS="$tab" read -r node reason; do
    drain "$node" "$reason"
done <"$tmp/culprits"
exit 0
