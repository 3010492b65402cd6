#!/bin/bash
#$ -N cr.hostile-a1b2c3.3
#$ -S /bin/bash
#$ -j y
#$ -l h_rt=14400
#$ -V
#$ -q gpu.q
#$ -l gpu=1
#$ -pe smp 4
# chainrun: segment 3 of its chain. The segment runner (chainrun/node/runner.py) reads
# the settings below; bash would die of the walltime signal until it catches it.
trap '' USR1 USR2 ALRM
command -v python3 >/dev/null || { echo 'chainrun: the segment runner needs python3 (3.8 or later) on the node' >&2; exit 127; }
exec python3 -I '/scratch/my runs/bob'"'"'s/.chainrun/runner-HASH.pyz' <<'CHAINRUN_SETTINGS'
{
 "chain": "hostile-a1b2c3",
 "run_id": "hostile-a1b2c3",
 "segment": 3,
 "seed": 3928624171,
 "walltime": 14400,
 "grace": 300,
 "adaptive": false,
 "signal": "USR1",
 "wrapper_signals": true,
 "started": "true",
 "granted": "",
 "preempting": "false",
 "run_dir": "/scratch/my runs/bob's/.chainrun/hostile-a1b2c3",
 "workdir": "/scratch/my runs/bob's",
 "code": "/scratch/my runs/bob's",
 "share": null,
 "checkpoint_dir": "/scratch/my runs/bob's/ckpt",
 "made_dirs": [],
 "progress_file": "",
 "progress_key": "",
 "target": 200,
 "env": {
  "MSG": "it's \"$(rm -rf /)\" `x`\nline2 $HOME",
  "SEED": "7"
 },
 "container": [],
 "tracking": [],
 "command": "python3 \"train.py\" --tag 'a b' $(whoami) `id` \\\n  --next\necho \"done $HOME\""
}
CHAINRUN_SETTINGS
