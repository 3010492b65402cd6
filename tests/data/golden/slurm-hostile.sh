#!/bin/bash
#SBATCH --job-name=cr.hostile-1a2b3c.3
#SBATCH --comment=cr.hostile-1a2b3c.3
#SBATCH --time=0-03:01:00
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --export=ALL
#SBATCH --partition=gpu
#SBATCH --gres=gpu:1
#SBATCH --mem=16G
# chainrun: segment 3 of its chain. The segment runner (chainrun/node/runner.py) reads
# the settings below; bash would die of the walltime signal until it catches it.
trap '' USR1 USR2 ALRM
command -v python3 >/dev/null || { echo 'chainrun: the segment runner needs python3 (3.8 or later) on the node' >&2; exit 127; }
exec python3 -I '/scratch/my run'"'"'s dir $x/.chainrun/runner-HASH.pyz' <<'CHAINRUN_SETTINGS'
{
 "chain": "hostile-1a2b3c",
 "run_id": "hostile-1a2b3c",
 "segment": 3,
 "seed": 2704554860,
 "walltime": 10801,
 "grace": 300,
 "adaptive": false,
 "signal": "USR1",
 "wrapper_signals": false,
 "started": "echo \"${SLURM_JOB_START_TIME:-$([ -n \"${SLURM_JOB_ID:-}\" ] && SLURM_TIME_FORMAT=%s timeout 20 squeue --noheader --jobs=\"${CHAINRUN_JOB_ID:-$SLURM_JOB_ID}\" --format=%S)}\"",
 "granted": "",
 "preempting": "[ -n \"${SLURM_JOB_ID:-}\" ] && timeout 20 scontrol show job \"${CHAINRUN_JOB_ID:-$SLURM_JOB_ID}\" 2>/dev/null | grep -Eq \"(^|[[:space:]])PreemptTime=[0-9]\"",
 "run_dir": "/scratch/my run's dir $x/.chainrun/hostile-1a2b3c",
 "workdir": "/scratch/my run's dir $x",
 "code": "/scratch/my run's dir $x",
 "share": null,
 "checkpoint_dir": "/scratch/my run's dir $x/ckpt 'x'",
 "made_dirs": [],
 "progress_file": "",
 "progress_key": "",
 "target": 30,
 "env": {
  "NOTE": "a'b\"c $(id) `id` ${X}\nline two",
  "EMPTY": ""
 },
 "container": [],
 "tracking": [],
 "command": "python3 train.py --note \"it's $(rm -rf ~) `id` ${HOME}\" \\\n  --lr 1e-3; echo 'done' # end"
}
CHAINRUN_SETTINGS
