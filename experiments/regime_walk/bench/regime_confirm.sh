#!/usr/bin/env bash
# Rule 3's confirmation (docs/regime.md, "Rule 3's cost gate on the budget's own terms"): from an
# empty results/ in a clean clone, time `table1.csv` and then `all` with the regime's config on an
# idle machine, and keep what the run measured. The install is not timed (the budget is the
# pipeline's). Run it on an idle machine; it took 2 hours on the 2-core machine.
#
#   bash bench/regime_confirm.sh [COMMIT]      # default: HEAD
#
# Writes bench/results/regime_confirm.json (wall times, load averages, the commit) and copies the
# run's tables, claims, RPB readings and diagnostics to bench/results/regime_rule3_run/.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
work="$(mktemp -d /tmp/regime_confirm.XXXX)"
git clone --quiet "$repo" "$work/rpb"
cd "$work/rpb"
git checkout --quiet "$commit"
make install >/dev/null
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
config=(--configfile config/config.yaml config/regime_rule3.yaml)

load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
t0="$(date +%s)"
snakemake --cores 2 "${config[@]}" -- results/table1.csv >"$work/table1.log" 2>&1
t1="$(date +%s)"
snakemake --cores 2 "${config[@]}" -- all >"$work/all.log" 2>&1
t2="$(date +%s)"
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"

jobs_all="$(grep -oE '[0-9]+ of [0-9]+ steps' "$work/all.log" | tail -1 | cut -d' ' -f3)"
out="$repo/bench/results"
mkdir -p "$out/regime_rule3_run"
cp results/table*.csv results/table*.md results/claims.csv results/claims.md results/rpb_readings.csv \
    results/rpb_readings.md results/router_swap.md results/diagnostic_table1.md "$out/regime_rule3_run/"
cat >"$out/regime_confirm.json" <<EOF
{
  "commit": "$commit",
  "config": "config/config.yaml + config/regime_rule3.yaml",
  "cores": 2,
  "table1_s": $((t1 - t0)),
  "all_after_table1_s": $((t2 - t1)),
  "sum_s": $((t2 - t0)),
  "budget_table1_s": 900,
  "budget_sum_s": 5400,
  "table1_within_budget": $([ $((t1 - t0)) -le 900 ] && echo true || echo false),
  "sum_within_budget": $([ $((t2 - t0)) -le 5400 ] && echo true || echo false),
  "jobs_in_all_after_table1": $jobs_all,
  "loadavg_before": "$load_before",
  "loadavg_after": "$load_after",
  "started_utc": "$(date -u -d @"$t0" +%FT%TZ)",
  "finished_utc": "$(date -u -d @"$t2" +%FT%TZ)"
}
EOF
cat "$out/regime_confirm.json"
echo "logs and results: $work"
