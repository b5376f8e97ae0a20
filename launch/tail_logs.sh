#!/usr/bin/env bash
source "$(dirname "$0")/common.sh"
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --worker=0 --command "tail -f ~/nlac_train.log"
