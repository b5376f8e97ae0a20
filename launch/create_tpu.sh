#!/usr/bin/env bash
# Create a TPU VM slice (optionally as a queued resource: QUEUED=1, SPOT=1). --dry-run: print the command only.
source "$(dirname "$0")/common.sh"
if [[ "${QUEUED:-0}" == 1 ]]; then
  run gcloud compute tpus queued-resources create "$TPU_NAME-qr" --node-id "$TPU_NAME" --zone "$ZONE" \
    --project "$PROJECT" --accelerator-type "$ACCEL" --runtime-version "$RUNTIME" ${SPOT:+--spot}
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --accelerator-type "$ACCEL" --version "$RUNTIME" ${SPOT:+--spot}
fi
