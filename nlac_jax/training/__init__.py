"""Training: train state, the jitted sharded NLAC step (L1 + L2), optimiser, EMA target, orbax checkpoints.

    from nlac_jax import training
    opt = training.make_optimizer()                                   # gin: make_optimizer.*, make_schedule.*
    state = training.create_train_state(cfg, mesh, opt, params=model.params)
    step = training.make_train_step(cfg, mesh, opt)                   # gin: make_train_step.*
    state, metrics = step(state, batch)                               # batch: token-batch contract (ARCHITECTURE.md)
    ckpt = training.Checkpointer("runs/x/ckpt")                       # gin: Checkpointer.*
    ckpt.save(state, loop_state={...}); restored = ckpt.restore(training.abstract_train_state(cfg, mesh, opt))
"""

from nlac_jax.training.checkpoint import (Checkpointer, CheckpointMismatchError, CheckpointRestoreError,
                                         CheckpointSpaceError, Restored, run_fingerprint)
from nlac_jax.training.export import export_hf
from nlac_jax.training.loss import NORMALISATIONS, loss_coefficients, shift_targets, token_nll
from nlac_jax.training.optim import Optimizer, decay_mask, make_optimizer, make_schedule
from nlac_jax.training.state import (TrainState, abstract_train_state, create_train_state, state_shardings)
from nlac_jax.training.step import (METRIC_KEYS, NonFiniteError, StepConfig, Throughput, TrainStep, check_finite,
                                    loss_and_grads, make_grad_fn, make_train_step, tokens_per_second, train_step)

__all__ = ["Checkpointer", "CheckpointMismatchError", "CheckpointRestoreError", "CheckpointSpaceError", "Restored",
           "export_hf",
           "run_fingerprint", "NORMALISATIONS", "loss_coefficients",
           "shift_targets", "token_nll", "Optimizer", "decay_mask", "make_optimizer", "make_schedule", "TrainState",
           "abstract_train_state", "create_train_state", "state_shardings", "METRIC_KEYS", "NonFiniteError",
           "StepConfig", "Throughput", "TrainStep", "check_finite", "loss_and_grads", "make_grad_fn",
           "make_train_step", "tokens_per_second", "train_step"]
