#!/usr/bin/env bash
# Copy the repo (and optionally a local HF model directory) to every worker and build the venv with jax[tpu].
# --dry-run: print the gcloud commands only (the tarball is not built either).
source "$(dirname "$0")/common.sh"
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [[ "$DRY_RUN" != 1 ]]; then
  tar -C "$repo" --exclude=.venv --exclude=runs --exclude=.git -czf /tmp/nlac_jax.tgz .
fi
run gcloud compute tpus tpu-vm scp /tmp/nlac_jax.tgz "$TPU_NAME":/tmp/ --zone "$ZONE" --project "$PROJECT" --worker=all
ssh_all "mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf /tmp/nlac_jax.tgz && cd $REMOTE_DIR && \
python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt '$JAX_TPU_SPEC' && \
.venv/bin/pip install -q --no-deps -e ."
if [[ -n "${MODEL_DIR:-}" ]]; then
  run gcloud compute tpus tpu-vm scp --recurse "$MODEL_DIR" "$TPU_NAME":~/models/ --zone "$ZONE" --project "$PROJECT" --worker=all
fi
