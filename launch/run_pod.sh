#!/usr/bin/env bash
# Run `python -m nlac_jax.train` on every worker. Usage: run_pod.sh [--dry-run] GIN_FILE [more train flags...]
# Each worker gets --multihost (added when missing) and JAX_NUM_PROCESSES = the slice's worker count (read once
# with `gcloud ... describe`; NUM_WORKERS overrides it), which nlac_jax.parallel.distributed checks against; the coordinator
# address and each worker's process id come from the TPU VM metadata (jax.distributed's auto-detection).
source "$(dirname "$0")/common.sh"
gin_file="${1:?usage: run_pod.sh [--dry-run] GIN_FILE [train flags]}"; shift
# each flag quoted for the remote shell: a --gin_param value has spaces and quotes of its own
args="--gin_file=$(printf %q "$gin_file")"
multihost=0
for a in "$@"; do
  args+=" $(printf %q "$a")"
  [[ "$a" == --multihost ]] && multihost=1
done
[[ "$multihost" == 1 ]] || args+=" --multihost"
if [[ -n "${NUM_WORKERS:-}" ]]; then
  workers="$NUM_WORKERS"
elif [[ "$DRY_RUN" == 1 ]]; then
  run gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --format='value(networkEndpoints.len())'
  workers='<workers>'
else
  workers="$(gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --format='value(networkEndpoints.len())')" || die "could not describe $TPU_NAME (zone $ZONE)"
fi
[[ "$DRY_RUN" == 1 && -z "${NUM_WORKERS:-}" ]] || [[ "$workers" =~ ^[1-9][0-9]*$ ]] \
  || die "the worker count of $TPU_NAME is '$workers', not a positive integer (set NUM_WORKERS)"
ssh_all "cd $REMOTE_DIR && { test -x .venv/bin/python || { echo \"run_pod: \$(hostname): no $REMOTE_DIR/.venv: \
run launch/setup_pod.sh first\" >&2; exit 1; }; } && { JAX_NUM_PROCESSES=$workers nohup .venv/bin/python -m \
nlac_jax.train $args > ~/nlac_train.log 2>&1 & }" || die "starting the run failed on at least one worker"
[[ "$DRY_RUN" == 1 ]] || echo "$SCRIPT: started on all $workers workers; follow with launch/tail_logs.sh"
