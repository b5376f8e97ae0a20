#!/usr/bin/env bash
# Shared settings for the launch scripts; override any of them in the environment.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}"
: "${ZONE:?set ZONE}"
PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null)}"
ACCEL="${ACCEL:-v5p-8}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
REMOTE_DIR="${REMOTE_DIR:-~/nlac_jax}"
JAX_TPU_SPEC="${JAX_TPU_SPEC:-jax[tpu]==0.10.2}"
ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --worker=all --command "$1"; }
