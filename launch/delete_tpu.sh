#!/usr/bin/env bash
# Delete the slice. --dry-run: print the command only.
source "$(dirname "$0")/common.sh"
run gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --quiet
