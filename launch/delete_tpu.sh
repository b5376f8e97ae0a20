#!/usr/bin/env bash
source "$(dirname "$0")/common.sh"
gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --quiet
