"""The XLA flags of the test bench: for the pytest process (conftest.py) and every subprocess a test starts, so a
test that compares a subprocess's numbers with another's compares programs compiled alike."""

# LLVM at -O0 for the CPU backend: the suite's cost is compiling many small programs, not running them (1.6x faster
# on tests/test_train_step.py on 2 cores). XLA's own HLO passes still run, and the results stay within every test's
# tolerance; runs and benchmarks outside the tests keep the default.
COMPILE_FAST = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` simulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {COMPILE_FAST}"
