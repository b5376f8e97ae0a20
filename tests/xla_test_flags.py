"""The XLA flags of the test bench: for the pytest process (conftest.py) and every subprocess a test starts, so a
test that compares a subprocess's numbers with another's compares programs compiled alike (processes whose numbers
are compared must be started with the same `loop_run`)."""

# LLVM at -O0 for the CPU backend: the suite's cost is compiling many small programs, not running them (1.6x faster
# on tests/training/test_train_step.py on 2 cores). XLA's own HLO passes still run, and the results stay within every test's
# tolerance; runs and benchmarks outside the tests keep the default.
COMPILE_FAST = "--xla_backend_optimization_level=0"
# LLVM at -O1 for 1-process runs that load their programs from the persistent compilation cache and spend their time
# RUNNING them (xla_flags(loop_run=True)): the unit-scale smoke runs (tests/experiments/test_experiments_unit_scale.py:
# four runs of the same small programs; 92.5 s against 98.2 s for the file at -O0, one run each from an empty cache,
# quiet 2-core Intel Xeon) and test_judges' 20 Questions run and its resumption. Their prompts are long, and the float32
# prefill's dots are XLA's own loops (nlac_jax/parallel/xla_options.py keeps YNNPACK out of it), which -O0 leaves
# unoptimised: a 1536-token prefill of 4 rows takes 0.75 s at -O0, 0.11 s at -O2. -O1 runs about as fast as -O2 and
# compiles a little slower than -O0. Not for the runs compared with conftest.one_process_reference (the kill/resume
# chains, the disk-full run): they must be compiled like the 2-process runs, whose process 1 compiled everything
# at every launch when this was chosen (a 2-process run cost 187 CPU seconds at -O0, 237 at -O1; since 2026-12-07 each
# process writes its own cache entries, nlac_jax/cli/setup.py, enable_compilation_cache).
LOOP_RUN = "--xla_backend_optimization_level=1"
# XLA:CPU's MLIR fusion emitters (on by default in this jaxlib) compile a small program about twice as slowly as the
# older LLVM-IR emitters: tests/training/test_train_step.py, 18 tests from an empty cache, 2 cores (AMD EPYC): 73-78 s
# with them, 39-43 s without; a 2-iteration 1-device loop run at -O1, 102 s -> 90 s. Every test process gets it, so
# the programs whose numbers tests compare are still compiled alike; runs and benchmarks outside the tests keep
# XLA's default.
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int, loop_run: bool = False) -> str:
    """XLA_FLAGS for a process with `devices` simulated CPU devices; loop_run: for a 1-process run of the training
    loop that reuses its programs from the persistent cache (LOOP_RUN instead of COMPILE_FAST)."""
    return (f"--xla_force_host_platform_device_count={devices} {LOOP_RUN if loop_run else COMPILE_FAST} "
            f"{LEGACY_EMITTERS}")
