"""A checkpoint that does not fit (disk full): one line saying so and where, the last good step intact, and the rerun
resumes from it. The checkpoints live on a real, small filesystem: a tmpfs mounted in a private mount namespace
(`unshare -m`, root only), filled up while the run waits at the test hold point of iteration 2, after step 1 is saved.
"""

import os
import shlex
import subprocess
import sys

import pytest

import test_multihost as tm

REPO = tm.REPO


def _can_mount() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount(), reason="needs a private mount namespace (root: unshare -m, mount tmpfs)")
def test_checkpoint_that_does_not_fit_is_one_line_and_the_rerun_resumes(tmp_path):
    workdir, marker = tmp_path / "run", tmp_path / "hold"
    ckdir = workdir / "checkpoints"
    ckdir.mkdir(parents=True)
    # conftest.one_process_reference's command: in `make test` its programs are in the persistent compilation cache
    # by the time this file runs (conftest.LONGEST_FIRST starts the two chains that build the reference first); alone,
    # this file compiles them itself
    cmd = " ".join(shlex.quote(c) for c in tm._cmd(str(workdir)))
    fill = (f"{shlex.quote(sys.executable)} -c \"import os; s = os.statvfs('{ckdir}'); "
            f"open('{ckdir}/ballast', 'wb').write(bytes(s.f_bavail * s.f_frsize))\"")
    script = f"""
set -u
mount -t tmpfs -o size=64m tmpfs {ckdir}
NLAC_TEST_HOLD_AT=2:targets NLAC_TEST_HOLD_FILE={marker} {cmd} > {tmp_path}/first.out 2> {tmp_path}/first.err &
pid=$!
# the run waits at its marker; step 1 is complete once orbax has renamed its directory to the final name
while ! {{ [ -e {marker} ] && [ -d {ckdir}/1 ]; }}; do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
{fill}
ls {ckdir} > {tmp_path}/full.ls
rm -f {marker}
wait $pid
echo $? > {tmp_path}/first.rc
rm -f {ckdir}/ballast
{cmd} > {tmp_path}/second.out 2> {tmp_path}/second.err
echo $? > {tmp_path}/second.rc
"""
    env = tm._env(2)
    subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, env=env, timeout=1200)
    first_err = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert "1" in (tmp_path / "full.ls").read_text().split(), "step 1 was not saved before the disk filled up"
    last = first_err.strip().splitlines()[-1]
    assert last.startswith("python -m nlac_jax.train: error: CheckpointSpaceError: checkpoint step 2 did not fit in "
                           f"{ckdir} (No space left on device); the last good step, 1, is intact"), last
    assert "Traceback" not in first_err, first_err[-3000:]
    assert (tmp_path / "second.rc").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-3000:]
    second = (tmp_path / "second.err").read_text()
    assert "resumed from" in second and "step 1" in second
    assert [m["iteration"] for m in tm._metrics(str(workdir))] == [1, 2]
