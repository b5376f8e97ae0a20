#!/usr/bin/env bash
# Create a TPU VM slice (optionally as a queued resource: QUEUED=1, SPOT=1).
source "$(dirname "$0")/common.sh"
if [[ "${QUEUED:-0}" == 1 ]]; then
  gcloud compute tpus queued-resources create "$TPU_NAME-qr" --node-id "$TPU_NAME" --zone "$ZONE" \
    --project "$PROJECT" --accelerator-type "$ACCEL" --runtime-version "$RUNTIME" ${SPOT:+--spot}
else
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" \
    --accelerator-type "$ACCEL" --version "$RUNTIME" ${SPOT:+--spot}
fi
