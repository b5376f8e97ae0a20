#!/usr/bin/env bash
# One tiny NLAC iteration on each task (random tiny model, CPU, scripted oracle/user); prints rc and wall time.
#   bash benchmarks/smoke_tasks.sh [task ...]      (default: twenty_questions math tau_retail tau_airline)
cd "$(dirname "$0")/.."
tasks=${*:-twenty_questions math tau_retail tau_airline}
for t in $tasks; do
  extra=()
  case $t in tau_*) extra=(--gin_param="make_env_factory.user='scripted'");; esac
  rm -rf "runs/smoke_$t"
  XLA_FLAGS=--xla_force_host_platform_device_count=1 .venv/bin/python -m nlac_jax.train \
    --gin_file=gin/models/tiny_random.gin --gin_file="gin/tasks/$t.gin" --workdir="runs/smoke_$t" \
    --gin_param="LoopConfig.iterations=1" --gin_param="LoopConfig.episodes_per_iteration=2" \
    --gin_param="LoopConfig.env_pool=2" --gin_param="LoopConfig.critic_examples=2" \
    --gin_param="LoopConfig.policy_examples=2" --gin_param="LoopConfig.batch_size=4" \
    --gin_param="LoopConfig.train_steps=1" --gin_param="LoopConfig.eval_episodes=2" \
    --gin_param="LoopConfig.calibration_transitions=2" --gin_param="LoopConfig.max_len=1024" \
    --gin_param="LoopConfig.max_turns=2" \
    --gin_param="nlac.RoleSampling.max_new_tokens={'policy': 8, 'successor': 8, 'backup': 8, 'evaluator': 8, 'refiner': 8}" \
    "${extra[@]}" > "runs/smoke_$t.log" 2>&1
  echo "$t rc=$? $(grep 'wall time' "runs/smoke_$t.log")"
done
