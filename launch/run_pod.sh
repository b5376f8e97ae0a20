#!/usr/bin/env bash
# Run `python -m nlac_jax.train` on every worker. Usage: run_pod.sh [--dry-run] GIN_FILE [more train flags...]
source "$(dirname "$0")/common.sh"
gin_file="${1:?usage: run_pod.sh [--dry-run] GIN_FILE [train flags]}"; shift
# each flag quoted for the remote shell: a --gin_param value has spaces and quotes of its own
args="--gin_file=$(printf %q "$gin_file")"
for a in "$@"; do args+=" $(printf %q "$a")"; done
ssh_all "cd $REMOTE_DIR && nohup .venv/bin/python -m nlac_jax.train $args > ~/nlac_train.log 2>&1 &"
[[ "$DRY_RUN" == 1 ]] || echo "started on all workers; follow with launch/tail_logs.sh"
