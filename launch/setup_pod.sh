#!/usr/bin/env bash
# Copy the repo (and optionally a local HF model directory, $MODEL_DIR) to every worker and build its venv there:
# launch/worker_setup.sh on each worker brings uv and Python 3.11 (the TPU VM images ship 3.10) and installs
# requirements-tpu.txt (jax[tpu], libtpu) and requirements-envs.txt (τ-bench, math), pinned. A worker that cannot
# prints one line naming the host and the step (its log: ~/nlac_setup.log there); this script then exits 1.
# --dry-run: print the gcloud commands only (the tarball is not built either).
source "$(dirname "$0")/common.sh"
repo="$(cd "$(dirname "$0")/.." && pwd)"
tgz="${TGZ:-/tmp/nlac_jax.tgz}"
if [[ "$DRY_RUN" != 1 ]]; then
  # what .gitignore ignores (venv, caches, runs) stays here; uncommitted edits to tracked or new files travel
  tar -C "$repo" --exclude=./.git --exclude=./.venv --exclude=./runs --exclude=./build --exclude=./.jax_cache \
    --exclude=./.gl --exclude=__pycache__ --exclude=.pytest_cache --exclude='*.egg-info' --exclude='*.tmp' \
    -czf "$tgz" . || die "could not pack $repo into $tgz"
fi
run gcloud compute tpus tpu-vm scp "$tgz" "$TPU_NAME":/tmp/nlac_jax.tgz --zone "$ZONE" --project "$PROJECT" \
  --worker=all || die "copying $tgz to the workers of $TPU_NAME failed"
ssh_all "mkdir -p $REMOTE_DIR && tar -C $REMOTE_DIR -xzf /tmp/nlac_jax.tgz && bash $REMOTE_DIR/launch/worker_setup.sh" \
  || die "the set-up failed on at least one worker of $TPU_NAME (its line is above)"
if [[ -n "${MODEL_DIR:-}" ]]; then
  run gcloud compute tpus tpu-vm scp --recurse "$MODEL_DIR" "$TPU_NAME":~/models/ --zone "$ZONE" --project "$PROJECT" \
    --worker=all || die "copying $MODEL_DIR to the workers failed"
fi
[[ "$DRY_RUN" == 1 ]] || echo "$SCRIPT: every worker of $TPU_NAME is set up; start a run with launch/run_pod.sh"
