#!/usr/bin/env bash
# Run the smoke pipeline (config/smoke.yaml, table 1) through profiles/slurm and a real one-node
# Slurm on this machine: every non-local rule becomes an sbatch job. Starts Slurm with
# start_slurm.sh when it is not up (and stops it again at the end in that case).
#
#   bench/slurm_localhost/run_smoke.sh        # from anywhere; needs root and .venv
#
# Writes bench/results/slurm_smoke.log (Snakemake's output, then this run's Slurm job records)
# and bench/results/slurm_smoke.json (versions, sbatch job count, wall time, exit code).
# Outputs go to results/slurm_smoke (removed first, so every job is submitted again).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/bench/slurm_localhost
cd "$ROOT"
RESULTS=results/slurm_smoke
LOG=bench/results/slurm_smoke.log
SUMMARY=bench/results/slurm_smoke.json
JOBCOMP_LOG=/var/log/slurm/jobcomp.log
PARTITION=${RPB_SLURM_PARTITION:-local}
PY=$ROOT/.venv/bin/python

export PATH=$ROOT/.venv/bin:$PATH
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

started_here=0
if ! sinfo -h >/dev/null 2>&1; then
    "$HERE/start_slurm.sh" || exit 1
    started_here=1
fi
trap '[[ $started_here -eq 1 ]] && "$HERE/stop_slurm.sh"' EXIT

mkdir -p bench/results
rm -rf "$RESULTS"
# Slurm's own record of finished jobs; only lines past this offset belong to this run.
jobcomp_before=$(wc -l <"$JOBCOMP_LOG" 2>/dev/null || echo 0)

# The profile's sizes are for 8 x 80 GB GPU nodes. A resource option given on the command line
# replaces the profile's whole mapping (it does not merge), so every rule the profile sizes is
# listed again here, without GPUs and small enough for 2 CPUs. No slurmdbd here: sacct cannot
# answer, so the plugin polls squeue (start_slurm.sh sets MinJobAge=900 for that) and takes no
# account. Jobs take seconds, so the first status check comes after 5 s instead of 40 s.
resources=()
for rule in posttrain extract_prior evaluate analyze table1; do
    resources+=("$rule:gpu=0" "$rule:cpus_per_task=1" "$rule:mem_mb=2000" "$rule:runtime=30")
done
cmd=(
    snakemake --profile profiles/slurm --configfile config/smoke.yaml
    --config "results_dir=$RESULTS"
    --default-resources "slurm_partition=$PARTITION" runtime=30 mem_mb=2000 cpus_per_task=1
    --set-resources "${resources[@]}"
    --slurm-status-command squeue --slurm-no-account
    --slurm-init-seconds-before-status-checks 5
    --slurm-logdir "$RESULTS/logs/slurm" --slurm-keep-successful-logs
    -- "$RESULTS/table1.csv"
)
start=$(date +%s.%N)
{
    printf '$'
    printf ' %q' "${cmd[@]}"
    printf '\n'
    "${cmd[@]}"
} >"$LOG" 2>&1
rc=$?
end=$(date +%s.%N)

records=$(tail -n +"$((jobcomp_before + 1))" "$JOBCOMP_LOG" 2>/dev/null || true)
{
    echo
    echo "=== Slurm job completion records of this run ($JOBCOMP_LOG) ==="
    [[ -n $records ]] && echo "$records"
} >>"$LOG"

RC=$rc START=$start END=$end RESULTS=$RESULTS RECORDS=$records LOG=$LOG "$PY" - "$SUMMARY" <<'PYEOF'
"""Summarise the run as JSON: versions, sbatch jobs (Slurm's records), wall time, outcome."""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from importlib.metadata import version
from pathlib import Path

records = [line for line in os.environ["RECORDS"].splitlines() if line.startswith("JobId=")]
states = Counter(re.search(r"JobState=(\S+)", line).group(1) for line in records)
names = {re.search(r"Name=(\S+)", line).group(1) for line in records}
log = Path(os.environ["LOG"]).read_text()
results = Path(os.environ["RESULTS"])
summary = {
    "slurm_version": subprocess.run(
        ["sinfo", "--version"], capture_output=True, text=True
    ).stdout.strip(),
    "snakemake_version": version("snakemake"),
    "plugin_version": version("snakemake-executor-plugin-slurm"),
    "jobstep_plugin_version": version("snakemake-executor-plugin-slurm-jobstep"),
    # Slurm's job completion log (jobcomp/filetxt) has one record per finished sbatch job.
    "sbatch_jobs": len(records),
    "sbatch_job_states": dict(states),
    "sbatch_job_names": sorted(names),
    # Cross-checks: Snakemake's own submission messages and the kept sbatch log files.
    "snakemake_submissions": len(re.findall(r"has been submitted with SLURM jobid", log)),
    "sbatch_log_files": len(list((results / "logs" / "slurm").rglob("*.log"))),
    "wall_time_s": round(float(os.environ["END"]) - float(os.environ["START"]), 1),
    "exit_code": int(os.environ["RC"]),
    "table1_csv_produced": (results / "table1.csv").is_file(),
}
Path(sys.argv[1]).write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PYEOF
exit "$rc"
