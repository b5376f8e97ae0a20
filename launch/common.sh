#!/usr/bin/env bash
# Shared settings for the launch scripts; override any of them in the environment.
# Every script takes --dry-run (or DRY_RUN=1): it prints each gcloud command it would run, one per line, and runs
# nothing (no gcloud needed, and the project falls back to $PROJECT or '<project>').
set -euo pipefail
DRY_RUN="${DRY_RUN:-0}"
ARGS=()
for a in "$@"; do
  if [[ "$a" == "--dry-run" ]]; then DRY_RUN=1; else ARGS+=("$a"); fi
done
set -- ${ARGS[@]+"${ARGS[@]}"}
: "${TPU_NAME:?set TPU_NAME}"
: "${ZONE:?set ZONE}"
SCRIPT="$(basename "$0" .sh)"
die() { echo "$SCRIPT: $1" >&2; exit 1; }
if [[ "$DRY_RUN" == 1 ]]; then
  PROJECT="${PROJECT:-<project>}"
else
  command -v gcloud >/dev/null 2>&1 || die "gcloud is not on PATH (install the Google Cloud CLI, or use --dry-run)"
  PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null || true)}"
  [[ -n "$PROJECT" ]] || die "no project: set PROJECT or run 'gcloud config set project ...'"
fi
ACCEL="${ACCEL:-v5p-8}"
RUNTIME="${RUNTIME:-v2-alpha-tpuv5}"
REMOTE_DIR="${REMOTE_DIR:-~/nlac_jax}"

# run "$@" (a gcloud command), or print it shell-quoted with --dry-run
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'; echo
  else
    "$@"
  fi
}
ssh_all() { run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --project "$PROJECT" --worker=all --command "$1"; }
