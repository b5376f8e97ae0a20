#!/usr/bin/env bash
# Evidence for the start-up rule (issue 23, item 3): the 2-process test run N times in a row (default 20), each run
# a fresh pytest process. Prints one line per run and the count of failures at the end; exits non-zero if any failed.
# Not in CI (about 4-5 minutes a run on 2 cores: three 2-process launches on a gs:// emulator). Usage: bash benchmarks/repeat_multihost.sh [N] [pytest -k expr]
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-20}
expr=${2:-two_processes_preempted_killed_and_resumed}
py=${PYTHON:-.venv/bin/python}
fails=0
for i in $(seq 1 "$n"); do
  log=$(mktemp)
  if "$py" -m pytest -q -p no:cacheprovider tests/runner/test_gcs_run.py -k "$expr" >"$log" 2>&1; then
    echo "run $i/$n: passed ($(tail -n 1 "$log"))"
  else
    fails=$((fails + 1))
    echo "run $i/$n: FAILED; log kept at $log"
    grep -m 3 -e "name mismatch" -e "Error" "$log" | sed 's/^/    /'
    continue
  fi
  rm -f "$log"
done
echo "$((n - fails)) passed, $fails failed"
[ "$fails" -eq 0 ]
