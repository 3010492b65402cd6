#!/usr/bin/env bash
# One segment of a Ray Tune experiment across the Slurm allocation: a Ray head
# on this (the batch) node, a Ray worker on each other node through srun, then
# the driver, train.py. On the walltime signal the driver stops the experiment
# (Tune saves its state and every trial's last checkpoint); the next segment
# runs this again and train.py resumes the same experiment. Every Ray process of
# the segment is stopped before it ends, on every node.
#
# This script and Ray's own processes ignore the walltime signal (an ignored
# signal is inherited): only the driver acts on it, while the cluster runs.
set -u
signal=${CHAINRUN_SIGNAL:-USR1}
port=${RAY_PORT:-6379}
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head=${nodes[0]}
# Node-local temporary files, as /tmp is on most clusters.
tmp=${RAY_TMP:-/tmp}/ray-$SLURM_JOB_ID
common=(--num-cpus="${SLURM_CPUS_ON_NODE:-1}" --disable-usage-stats --block)

trap '' "$signal"
ray start --head --node-ip-address="$head" --port="$port" --include-dashboard=false \
    --temp-dir="$tmp-$head" "${common[@]}" &
head_pid=$!
workers_pid=
if ((${#nodes[@]} > 1)); then
    # One task per other node; its processes are the step's, so Slurm ends them with it.
    others=$((${#nodes[@]} - 1))
    srun --nodes=$others --ntasks=$others --ntasks-per-node=1 --exclude="$head" \
        bash -c 'trap "" "$0"; exec ray start --address="$1" --temp-dir="$2-$(hostname)" "${@:3}"' \
        "$signal" "$head:$port" "$tmp" "${common[@]}" &
    workers_pid=$!
fi

python3 train.py --address "$head:$port" --nodes "${#nodes[@]}" "$@"
rc=$?

# Nothing of Ray outlives the segment: the workers' step, then the head.
[[ $workers_pid ]] && kill "$workers_pid" 2>/dev/null
kill "$head_pid" 2>/dev/null
wait
exit "$rc"
