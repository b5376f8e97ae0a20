#!/usr/bin/env bash
# Build the virtual environment of this checkout on one TPU VM worker; setup_pod.sh runs it on every worker, in the
# unpacked repository. Needs bash, python3 with pip (the TPU VM images have both, Python 3.10) and the network:
# PyPI (uv, the packages) and GitHub (uv's Python builds, python-build-standalone).
#   1. uv $UV_VERSION from PyPI (`python3 -m pip install --user`), unless $UV names a uv binary;
#   2. CPython $PYTHON_VERSION through uv (the project needs 3.11), unless uv already finds it;
#   3. $VENV with that Python, then, as the Makefile does: requirements-tpu.txt (requirements.txt + jax[tpu] +
#      libtpu, with their dependencies), requirements-envs.txt with --no-deps (τ-bench's tau2 and the math
#      grader's math-verify: every shipped task's needs; see that file for why --no-deps), the package itself;
#   4. an import check of what the runs use (jax with libtpu, nlac_jax, tau2, math_verify).
# A step that fails prints ONE line, `worker_setup: <host>: <step> failed (exit N): <its last output line>; log:
# <file>`, on stderr and exits 1; the full output of every step is in $SETUP_LOG.
# --dry-run (or DRY_RUN=1): print each command, shell-quoted, one per line, and run nothing.
# PIP_DRY_RUN=1: run everything, but the three installs only resolve against the index (`uv pip install --dry-run`)
# and the import check is skipped (it would find nothing installed): a check of the pins without downloading them.
set -euo pipefail
DRY_RUN="${DRY_RUN:-0}"
for a in "$@"; do
  case "$a" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "worker_setup: unknown argument '$a' (usage: worker_setup.sh [--dry-run])" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
UV_VERSION="${UV_VERSION:-0.13.9}"
PYTHON_VERSION="${PYTHON_VERSION:-3.11.18}"
VENV="${VENV:-.venv}"
SETUP_LOG="${SETUP_LOG:-$HOME/nlac_setup.log}"
HOST="$(hostname)"

fail() { echo "worker_setup: $HOST: $1" >&2; exit 1; }

# step WHAT CMD...: run CMD with its output appended to the log; on failure, the one line and exit 1
step() {
  local what="$1"; shift
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'; echo
    return 0
  fi
  printf '+' >>"$SETUP_LOG"; printf ' %q' "$@" >>"$SETUP_LOG"; echo >>"$SETUP_LOG"
  local rc=0
  "$@" >>"$SETUP_LOG" 2>&1 || rc=$?
  if [[ "$rc" != 0 ]]; then
    local last; last="$(grep -v '^[[:space:]]*$' "$SETUP_LOG" | tail -n 1 | cut -c1-200)"
    fail "$what failed (exit $rc): $last; log: $SETUP_LOG"
  fi
}

if [[ "$DRY_RUN" != 1 ]]; then
  mkdir -p "$(dirname "$SETUP_LOG")" && : >"$SETUP_LOG" || fail "cannot write the log $SETUP_LOG"
  for f in requirements-tpu.txt requirements-envs.txt pyproject.toml; do
    [[ -f "$f" ]] || fail "no $f in $(pwd): not an nlac_jax checkout"
  done
fi

# 1. uv
if [[ -n "${UV:-}" ]]; then
  uv="$UV"
elif command -v uv >/dev/null 2>&1 && [[ "$(uv --version 2>/dev/null)" == "uv $UV_VERSION"* ]]; then
  uv="$(command -v uv)"
else
  # PIP_BREAK_SYSTEM_PACKAGES: an image whose python3 is "externally managed" (PEP 668) still takes a --user
  # install of one self-contained binary; older pips ignore the variable.
  step "installing uv $UV_VERSION from PyPI (python3 -m pip install --user)" \
    env PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --quiet --disable-pip-version-check \
    "uv==$UV_VERSION"
  if [[ "$DRY_RUN" == 1 ]]; then
    uv="$HOME/.local/bin/uv"
  else
    uv="$(python3 -m site --user-base)/bin/uv"
    [[ -x "$uv" ]] || fail "pip installed uv $UV_VERSION but $uv is not there"
  fi
fi

# 2. Python
if [[ "$DRY_RUN" == 1 ]] || ! "$uv" python find "$PYTHON_VERSION" >/dev/null 2>&1; then
  step "installing Python $PYTHON_VERSION with uv (from python-build-standalone on GitHub)" \
    "$uv" python install "$PYTHON_VERSION"
fi

# 3. the venv and the packages
py="$VENV/bin/python"
pip_dry=()
[[ "${PIP_DRY_RUN:-0}" == 1 ]] && pip_dry=(--dry-run)
step "creating $VENV with Python $PYTHON_VERSION" "$uv" venv --quiet --allow-existing --python "$PYTHON_VERSION" "$VENV"
step "installing requirements-tpu.txt (jax[tpu], libtpu and the core pins)" \
  "$uv" pip install --python "$py" ${pip_dry[@]+"${pip_dry[@]}"} -r requirements-tpu.txt
step "installing requirements-envs.txt (tau2, math-verify; --no-deps)" \
  "$uv" pip install --python "$py" ${pip_dry[@]+"${pip_dry[@]}"} --no-deps -r requirements-envs.txt
step "installing nlac_jax itself (-e, --no-deps)" \
  "$uv" pip install --python "$py" ${pip_dry[@]+"${pip_dry[@]}"} --no-deps -e .

# 4. what the runs import (not jax.devices(): on a pod the TPU runtime waits for every host)
if [[ "${PIP_DRY_RUN:-0}" != 1 ]]; then
  step "checking the imports (jax, libtpu, nlac_jax, tau2, math_verify)" "$py" -c \
    "import importlib.util as u, sys; m = [n for n in ('jax', 'libtpu', 'nlac_jax', 'tau2', 'math_verify') if u.find_spec(n) is None]; sys.exit('missing: ' + ', '.join(m) if m else 0)"
fi
[[ "$DRY_RUN" == 1 ]] || echo "worker_setup: $HOST: $VENV ready (Python $PYTHON_VERSION, uv $UV_VERSION); log: $SETUP_LOG"
