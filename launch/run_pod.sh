#!/usr/bin/env bash
# Run `python -m nlac_jax.train` on every worker. Usage: run_pod.sh GIN_FILE [more train flags...]
source "$(dirname "$0")/common.sh"
gin_file="${1:?usage: run_pod.sh GIN_FILE [train flags]}"; shift
args="--gin_file=$gin_file $*"
ssh_all "cd $REMOTE_DIR && nohup .venv/bin/python -m nlac_jax.train $args > ~/nlac_train.log 2>&1 &"
echo "started on all workers; follow with launch/tail_logs.sh"
