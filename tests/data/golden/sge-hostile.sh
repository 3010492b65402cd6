#!/bin/bash
#$ -N cr.hostile-a1b2c3.3
#$ -S /bin/bash
#$ -j y
#$ -l h_rt=14400
#$ -V
#$ -q gpu.q
#$ -l gpu=1
#$ -pe smp 4
# ---- chainrun segment wrapper (generated; every value below is shell-quoted) ----
set -u
# What systemd gave the service is not the job's (--export=ALL and -V pass
# it on): a job answering NOTIFY_SOCKET would speak for the service.
unset NOTIFY_SOCKET WATCHDOG_PID WATCHDOG_USEC LISTEN_PID LISTEN_FDS LISTEN_FDNAMES \
    JOURNAL_STREAM INVOCATION_ID MANAGERPID
export CHAINRUN_CHAIN=hostile-a1b2c3
export CHAINRUN_SEGMENT=3
export CHAINRUN_SEED=3928624171 # the chain's own, the same in each segment; [env] may set another
export CHAINRUN_CHECKPOINT_DIR='/scratch/my runs/bob'"'"'s/ckpt'
export CHAINRUN_SIGNAL=USR1
export CHAINRUN_RUN_DIR='/scratch/my runs/bob'"'"'s/.chainrun/hostile-a1b2c3'
export CHAINRUN_WORKDIR='/scratch/my runs/bob'"'"'s'
# The walltime counts from when the scheduler started the job, before a prolog ran and
# this script began; from now where the scheduler does not tell (or tells nonsense).
now=$(date +%s)
started=$({ true; } 2>/dev/null) || started=""
case $started in '' | *[!0-9]*) started=$now ;; esac
if [ "$started" -gt "$now" ] || [ "$started" -le $((now - 14400)) ]; then started=$now; fi
export CHAINRUN_DEADLINE=$((started + 14400))
export USER="${USER:-$(id -un)}" # not every scheduler sets it; ch-run refuses to start without it
# The signals are caught from here on: Slurm may send --signal in the job's first
# seconds (when walltime - grace is under its 60 s check interval), and bash's own
# answer to SIGUSR1 is to die, before the command ran or any marker was written.
got=""
preempted="" # 1 once the scheduler is known to be preempting the job
child=""
child_started="" # the command's start (clock ticks after boot): with its PID, its identity
signalled=""     # every process signalled, as PID:START
timer=""
napping="" # the sleep of nap
sent=""          # when the walltime signal was passed on to the command
grace=300  # the job file's, or the default: the most an adaptive grace may be
# Without a grace in the job file, the one the service made of this chain's earlier
# stops (decide/grace.py, written to `grace` in the run directory), at most the default.
learned="$CHAINRUN_RUN_DIR/grace"
if [ -n "" ] && [ -f "$learned" ] && [ ! -L "$learned" ]; then
    learned=$(head -c 4096 -- "$learned" 2>/dev/null | sed -n 's/^grace=\([1-9][0-9]\{0,6\}\)$/\1/p' | head -n 1)
    if [ -n "$learned" ] && [ "$learned" -lt "$grace" ]; then grace=$learned; fi
fi
export CHAINRUN_GRACE=$grace
signal_at=$((CHAINRUN_DEADLINE - grace))
# The command says it takes the signal (chainrun.checkpoint's SegmentClock writes the
# segment's number to `ready`). Once a chain's command has said so, the signal is held
# until it says so again: a Python still importing would die of it.
ready_file="$CHAINRUN_RUN_DIR/ready"
is_ready() { # read by bash itself: the timer, killed at the end, leaves no reader behind
    local said=""
    read -r -n 32 said 2>/dev/null <"$ready_file"
    [ "$said" = "3" ]
}
helper=""
if [ -f "$ready_file" ] && ! is_ready; then helper=1; fi
# Sends the walltime signal to ourselves (and so on to the command) at
# walltime minus grace, or once the command is ready, if later; a background
# loop, so a trap can start it too. Where we send the warning (SGE), the
# scheduler's walltime kill reaches only our process group, not the command's:
# SIGALRM a second before it ends the command.
# A second's sleep that a TERM to the (sub)shell napping ends, and reaps, before the
# shell exits: the timer and the carrier, killed at the segment's end, leave no sleep
# behind, not even an orphan for a moment.
nap() {
    sleep 1 &
    napping=$!
    wait "$napping"
}
start_timer() {
    [ -n "$timer" ] && return
    (
        trap 'kill "$napping" 2>/dev/null; wait "$napping" 2>/dev/null; exit 0' TERM
        until_then() {
            while [ "$(date +%s)" -lt "$1" ]; do
                nap
                kill -0 "$$" 2>/dev/null || exit 0
            done
        }
        until_then "$signal_at"
        if [ -n "$helper" ] && ! is_ready; then
            echo "chainrun: SIG$CHAINRUN_SIGNAL held: the command has not yet said it is ready for it"
            while ! is_ready && [ "$(date +%s)" -lt $((CHAINRUN_DEADLINE - 1)) ]; do
                nap
                kill -0 "$$" 2>/dev/null || exit 0
            done
        fi
        # Never ready: the walltime's own kill ends it, as it would have the signal.
        if [ -z "$helper" ] || is_ready; then kill -s "$CHAINRUN_SIGNAL" "$$"; fi
        [ -n "1" ] || exit 0
        until_then $((CHAINRUN_DEADLINE - 1))
        kill -s ALRM "$$"
    ) &
    timer=$!
}
# Whether the scheduler is preempting this job (it then sends the job's signal early,
# and ends or requeues the job at the end of its grace time).
preempting() { false; }
forward() {
    # Slurm may send --signal up to 60 s early (its limit checks are that
    # coarse), even before the command has set its handler: hold it until
    # the time asked for (a second or two early is clock granularity: passed
    # on), and until the command is ready for it; the timer sends it then, and
    # the scheduler's, when it comes after ours, is not passed on twice. A
    # signal that comes because the job is being preempted is never held, nor
    # is TERM: it may be a preemption or scancel.
    if [ "$1" = "$CHAINRUN_SIGNAL" ] && [ "$1" != TERM ]; then
        if [ -z "$preempted" ] && preempting; then preempted=1; fi
        [ -n "$sent" ] && return
        if [ -z "$preempted" ] && [ "$(date +%s)" -lt $((signal_at - 2)) ]; then
            echo "chainrun: SIG$1 came $((signal_at - $(date +%s)))s early; passing it on at walltime - grace"
            start_timer
            return
        fi
        if [ -z "$preempted" ] && [ -n "$helper" ] && ! is_ready; then
            start_timer
            return
        fi
    fi
    got=$1
    if [ -n "$child" ]; then
        [ -n "$sent" ] || sent=$(date +%s)
        local pids group=""
        pids=$(command_pids)
        signalled="$signalled ${pids//$'\n'/ }"
        if own_group; then group="-$child"; fi
        kill -s "$1" -- $group $(pids_of "$pids") 2>/dev/null || true
    fi
    # Where Slurm signals a preemption only at the end of its grace time, with SIGTERM.
    if [ "$1" = TERM ] && [ -z "$preempted" ] && preempting; then preempted=1; fi
}
# When a process started (clock ticks after boot; empty once it is gone). The kernel
# gives a PID again once its process is gone (within seconds where pid_max is 32768):
# a PID names one of ours only with the start it had then.
started_at() {
    local line fields
    { read -r line <"/proc/$1/stat"; } 2>/dev/null || return 0
    read -r -a fields <<<"${line##*) }" # state ppid pgrp ... starttime is the 20th
    printf '%s' "${fields[19]}"
}
# The command's process group is still its own: the kernel keeps a group's number
# from new processes while any member lives, but not once the group is empty.
own_group() {
    local now
    now=$(started_at "$child")
    [ -z "$now" ] || [ "$now" = "$child_started" ]
}
pids_of() { # the PIDs of PID:START words
    local p
    for p in $1; do printf '%s ' "${p%%:*}"; done
}
# The command's processes that have not ended (a zombie has: ranks orphaned
# by a launcher the signal killed are reaped by whoever adopts them, maybe
# never): its process group, and the descendants of the command and of every
# process signalled before, in whatever group or session; as PID:START lines.
command_pids() {
    local stat line pid up hops fields mine
    local -A parent=() group=() started=()
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue # it may end as we look
        pid=${line%% *}
        read -r -a fields <<<"${line##*) }" # state ppid pgrp ...
        [ "${fields[0]}" = Z ] && continue
        parent[$pid]=${fields[1]}
        group[$pid]=${fields[2]}
        started[$pid]=${fields[19]}
    done
    mine=""
    if own_group; then mine=$child; fi
    for pid in "${!parent[@]}"; do
        up=$pid
        hops=0
        while [ -n "$up" ] && [ "$up" != 0 ] && [ "$hops" -lt 64 ]; do
            if [ "$up" = "$mine" ] || { [ -n "$mine" ] && [ "${group[$up]:-}" = "$mine" ]; } ||
                [[ "$signalled " == *" $up:${started[$up]:-} "* ]]; then
                echo "$pid:${started[$pid]}"
                break
            fi
            up=${parent[$up]:-}
            hops=$((hops + 1))
        done
    done
}
# While the service is away the segment queues its own successor: the launcher the service
# leaves in the run directory when the chain may carry itself (chainrun.carry) says, now and
# then while the command runs and when it has ended, and prints when to ask again.
carrier=""
carry_once() { # running|ended
    "$CHAINRUN_RUN_DIR/carry" "$CHAINRUN_RUN_DIR" 3 "$job" "$1" </dev/null || true
}
carry_on() { # running|ended: asks until told not to ask again
    [ -x "$CHAINRUN_RUN_DIR/carry" ] || return 0
    local again
    again=$(carry_once "$1")
    while [ -n "$again" ] && [ "$again" -gt 0 ] 2>/dev/null; do
        while [ "$again" -gt 0 ]; do
            nap
            kill -0 "$$" 2>/dev/null || return 0
            again=$((again - 1))
        done
        again=$(carry_once "$1")
    done
}
trap 'forward USR1' USR1
trap 'forward USR2' USR2
trap 'forward TERM' TERM
# The timer's walltime kill where the scheduler's misses the command's group (SGE):
# in the end marker, exit 137 after SIGKILL, a timeout.
trap 'forward KILL' ALRM
# What the submitting shell had (inherit_env), then [env], which wins.

export MSG='it'"'"'s "$(rm -rf /)" `x`'$'\n''line2 $HOME'
export SEED=7
target=200
marker="$CHAINRUN_RUN_DIR/seg-0003"
# An array task's id as the scheduler lists it (its script exports it), not the job's own.
job="${CHAINRUN_JOB_ID:-${SLURM_JOB_ID:-${JOB_ID:-${CHAINRUN_LOCAL_JOB_ID:-}}}}"
unset CHAINRUN_JOB_ID

# The end marker is how chainrun learns the real exit code and whether the
# walltime signal came first; it is written atomically (temp + mv).
# A command that failed leaves the last lines of its output there too (the
# last part of each line a progress bar redrew with CR), so its failure
# explains itself without a second command; the tail lines come last.
end_marker() { # exit-code original-code skipped
    (
        umask 077
        {
            printf 'exit=%s\noriginal=%s\nsignal=%s\nsignalled_at=%s\nskipped=%s\npreempted=%s\njob=%s\nat=%s\npath=%s\n' \
                "$1" "$2" "$got" "$sent" "$3" "$preempted" "$job" "$(date +%s)" "${PATH//$'\n'/ }"
            # ready: 1 the command said it was; 0 it had before, but not in this segment
            printf 'grace=%s\nready=%s\n' "$grace" \
                "$(if is_ready; then echo 1; elif [ -n "$helper" ]; then echo 0; fi)"
            snapshot
            if [ "$2" != 0 ] && [ -f "$marker.log" ]; then
                tail -c 8192 -- "$marker.log" 2>/dev/null | tr '\r' '\n' |
                    grep -av -e '^[[:space:]]*$' -e '^chainrun: segment ' |
                    tail -n 5 | cut -c 1-300 | sed 's/^/tail=/' || true
            fi
        } >"$marker.end.tmp"
    ) && mv -f "$marker.end.tmp" "$marker.end"
}

# The checkpoint as this segment finds and leaves it, in its markers: each
# segment is judged on its own progress, also when several end while the
# service is away. Only a regular file is read, and at most 1 MiB of it: a
# FIFO or a link to a device planted as the sidecar never blocks the job.
progress="$CHAINRUN_CHECKPOINT_DIR/chainrun-progress.json"
own='' # progress = "FILE:KEY": the script's own JSON file and its epoch's key
own_key=''
readable() { [ -f "$1" ] && [ ! -L "$1" ] && head -c 1048576 -- "$1" 2>/dev/null; }
sidecar() { readable "$progress"; }
field() { # name pattern: the value of a top-level sidecar field
    printf '%s' "$text" | grep -o "\"$1\": *$2" | head -n 1 | sed 's/^[^:]*: *//' || true
}
epoch_now() { # the epoch from the sidecar ($text), or at the key in the script's own file
    if [ -z "$own" ]; then
        field epoch '[0-9][0-9]*'
    else
        readable "$own" | python3 -I -c '
import json, sys
try:
    value = json.load(sys.stdin)
    for part in sys.argv[1].split("."):
        value = value[part]
    if type(value) is int and value >= 0:
        print(value)
except Exception:
    pass' "$own_key" 2>/dev/null || true
    fi
}
saved_now() { # when the checkpoint was saved: the sidecar's word, or the own file's mtime
    if [ -z "$own" ]; then
        field saved_at '[0-9][0-9.eE+-]*'
    elif [ -f "$own" ]; then
        find "$own" -maxdepth 0 -printf '%T@' 2>/dev/null || true
    fi
}
snapshot() {
    local text
    text=$(sidecar | tr -d '\n' || true)
    printf 'ckpt_epoch=%s\nckpt_step=%s\nckpt_saved=%s\nckpt_done=%s\nckpt_save=%s\nckpt_mtime=%s\n' \
        "$(epoch_now)" "$(field step '[0-9][0-9]*')" \
        "$(saved_now)" "$(field done true)" "$(field save_seconds '[0-9][0-9.eE+-]*')" \
        "$(find "$CHAINRUN_CHECKPOINT_DIR" -maxdepth 1 -type f ! -name '.*' ! -name '*.tmp' \
            ! -name '*.partial' ! -name '*.lock' ! -name '*~' -printf '%T@\n' 2>/dev/null |
            sort -n | tail -n 1)"
}

# A job the scheduler requeued (preempted, its node lost) runs this script again: the
# end marker of its earlier run is not this run's.
rm -f -- "$marker.end"
(umask 077 && {
    printf 'job=%s\nhost=%s\nat=%s\n' "$job" "$(hostname)" "$(date +%s)"
    snapshot
} >"$marker.start")

# A successor queued ahead must never burn an allocation once the goal is met,
# also when it starts before the service has noticed.
skip=""
text=$(sidecar | tr -d '\n' || true)
before="$CHAINRUN_RUN_DIR/seg-0002.end"
if [ -e "$CHAINRUN_RUN_DIR/final" ]; then
    skip="the chain has already ended"
elif [ -f "$before" ] && grep -qx 'skipped=1' "$before"; then
    skip="segment 2 found the goal already reached"
elif [ -f "$before" ] && grep -qx 'original=0' "$before" && grep -qx 'signal=' "$before" &&
    { [ -z "$target" ] || grep -qx 'ckpt_epoch=' "$before"; }; then
    # Exit 0 before the walltime, and no target (or no epoch to compare with it): done.
    skip="segment 2 finished on its own (exit 0 before its walltime)"
elif [ "$(field done true)" = true ]; then
    skip="the checkpoint says training is done"
elif [ -n "$target" ]; then
    epoch=$(epoch_now)
    if [ -n "$epoch" ] && [ "$epoch" -ge "$target" ]; then
        skip="epoch $epoch already reached target_epoch $target"
    fi
fi
if [ -n "$skip" ]; then
    echo "chainrun: segment 3 skipped: $skip"
    end_marker 0 0 1
    exit 0
fi

codedir='/scratch/my runs/bob'"'"'s' # where the command starts: the workdir, or a snapshot chain's code
if ! cd "$codedir"; then
    echo "chainrun: cannot enter workdir $codedir" >&2
    end_marker 2 2 0
    exit 2
fi
(umask 077 && mkdir -p -- "$CHAINRUN_CHECKPOINT_DIR" )
# The code of a snapshot chain holds only the snapshot (its paths in $names, NUL-separated):
# everything else of the workdir is reachable there under its own name, as a link to the
# workdir's entry (within a directory both have, likewise), made before each segment. What the
# command made there beside the snapshot's own files moves to the workdir before and after each
# segment: a new directory where the workdir has none, a file always (an atomic save replaces
# the link to the workdir's file with a file of its own), so no output stays hidden in the code.
share() { # code-dir workdir-dir path-in-the-tree/
    local entry name
    for entry in "$1"/* "$1"/.[!.]* "$1"/..?*; do
        name=${entry##*/}
        case $name in .git | .chainrun* | __pycache__) continue ;; esac
        if [ -L "$entry" ] || [ ! -e "$entry" ] || grep -qzxF -- "$3$name" "$names"; then
            continue
        elif [ -f "$entry" ]; then
            mv -f -- "$entry" "$2/$name" 2>/dev/null || true
        elif [ ! -e "$2/$name" ] && [ ! -L "$2/$name" ]; then
            mv -- "$entry" "$2/$name" 2>/dev/null || true
        fi
    done
    for entry in "$2"/* "$2"/.[!.]* "$2"/..?*; do
        [ -e "$entry" ] || [ -L "$entry" ] || continue
        name=${entry##*/}
        case $name in .git | .chainrun* | __pycache__) continue ;; esac
        if [ ! -e "$1/$name" ] && [ ! -L "$1/$name" ]; then
            ln -s -- "$entry" "$1/$name" 2>/dev/null || true
        elif [ -d "$1/$name" ] && [ ! -L "$1/$name" ] && [ -d "$entry" ] && [ ! -L "$entry" ]; then
            share "$1/$name" "$entry" "$3$name/"
        fi
    done
}
names=''
shared() { # a snapshot chain's code (unpacked by a chainrun that lists its paths), with its workdir
    if [ "$codedir" != "$CHAINRUN_WORKDIR" ] && [ -f "$names" ]; then
        share "$codedir" "$CHAINRUN_WORKDIR" ''
    fi
}
shared

# bash runs traps only between commands, so the command runs in the
# background and the wrapper waits; signals are forwarded to it. It runs in
# a process group of its own (set -m), and the signals go to every process of
# the command: that group and all the command started, in whatever group or
# session (torchrun starts each rank in a session of its own and dies of
# SIGUSR1 without passing it on), and the program behind a shell
# (`python train.py; echo done`).
echo "chainrun: segment 3 of chain $CHAINRUN_CHAIN starting on $(hostname) as job ${job:-?}"
set -m
bash -c 'python3 "train.py" --tag '"'"'a b'"'"' $(whoami) `id` \'$'\n''  --next'$'\n''echo "done $HOME"' &
child=$!
child_started=$(started_at "$child")
set +m
if [ -n "$got" ]; then forward "$got"; fi # it came before the command
# Our own timer sends the walltime signal: a scheduler's warning (Slurm's --signal,
# up to 60 s early) is held until then; one that sends none (SGE) gets only ours.
start_timer
(
    trap '' USR1 USR2 ALRM # the walltime signal is the command's
    trap 'kill "$napping" 2>/dev/null; wait "$napping" 2>/dev/null; exit 0' TERM
    carry_on running
) &
carrier=$!
while :; do
    wait "$child"
    kill -0 "$child" 2>/dev/null || break
done
wait "$child"
rc=$?
# The segment ends when the whole command has: a launcher that the signal
# killed leaves its ranks still saving. What a command that ended on its own
# left running is ended, as a scheduler would at the job's end.
left=$(command_pids)
if [ -n "$left" ]; then
    if [ -z "$got" ]; then kill -s TERM $(pids_of "$left") 2>/dev/null || true; fi
    echo "chainrun: segment 3 waiting for the rest of the command's processes to end"
    waited=0
    while left=$(command_pids) && [ -n "$left" ]; do
        sleep 1
        waited=$((waited + 1))
        if [ -z "$got" ] && [ "$waited" = 30 ]; then kill -s KILL $(pids_of "$left") 2>/dev/null || true; fi
    done
fi
if [ -n "$timer" ]; then kill "$timer" 2>/dev/null || true; fi
if [ -n "$carrier" ]; then kill "$carrier" 2>/dev/null || true; fi
shared
code=$rc
# SGE reschedules a job that exits 99 and puts one that exits 100 in error
# state: never pass those on by accident. The original is in the marker.
case $rc in 99 | 100) code=1 ;; esac
echo "chainrun: segment 3 command exited $rc${got:+ after SIG$got}"
end_marker "$code" "$rc" 0
# Held to the end and never ready: the command no longer says so, and the next
# segment's gets the signal at its time again.
if [ -n "$helper" ] && ! is_ready; then rm -f -- "$ready_file"; fi
if [ -n "$preempted" ] && [ "$got" != TERM ]; then
    # The scheduler ends the job as preempted, or requeues it, at the end of its grace
    # time (SIGTERM); a job that ended first would count as completed, and never be requeued.
    echo "chainrun: segment 3 preempted: waiting for the scheduler to end or requeue the job"
    trap 'exit "$code"' TERM
    while [ "$(date +%s)" -lt "$CHAINRUN_DEADLINE" ]; do sleep 1; done
fi
carry_on ended # with this segment's end known (a preempted job never gets here)
exit "$code"
