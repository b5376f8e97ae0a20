#!/usr/bin/env bash
# Follow worker 0's training log. --dry-run: print the command only.
source "$(dirname "$0")/common.sh"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --worker=0 --command "tail -f ~/nlac_train.log"
