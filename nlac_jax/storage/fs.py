"""One filesystem layer for every path a run reads or writes: local paths and `gs://` URLs alike.

    from nlac_jax.storage import fs
    fs.join(workdir, "metrics.jsonl"); fs.exists(p); fs.isdir(p); fs.makedirs(p); fs.listdir(p)
    fs.open(p, "w"); fs.read_text(p); fs.write_atomic(p, text_or_bytes); fs.read_range(p, start, end)
    fs.remove(p); fs.rmtree(p); fs.rename(src, dst); fs.create_exclusive(p, data)

Local paths go to `os` and `open` (what the tests and a laptop use); `gs://bucket/key` goes to fsspec's gcsfs. The
checkpoint arrays do not pass through here: orbax writes them with tensorstore, which speaks `gs://` itself, and
orbax's own file operations use etils.epath, which `configure()` points at the same gcsfs.

GCS has no directories (a "directory" is a key prefix: `makedirs` is a no-op there), no append (`append_text`
rewrites the object: fine for the run's small files) and no rename (`rename` copies and deletes; only `write_atomic`
and `create_exclusive` are atomic there: an object appears whole or not at all).

`STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT` (the standard variable of Google's clients) is the one switch for a GCS
emulator; `configure()`, run on import, maps it to every library's own setting, and with it set nothing looks for
credentials or a metadata server (every request stays on that host):
  * gcsfs (this module, etils.epath / orbax's metadata): the emulator's URL, anonymous (token='anon');
  * tensorstore (orbax's arrays): TENSORSTORE_GCS_HTTP_URL, and a fixed test token (GOOGLE_AUTH_TOKEN_FOR_TESTING)
    instead of its credential search, which would ask the GCE metadata server;
  * google-auth: GCE_METADATA_HOST / GCE_METADATA_ROOT / GCE_METADATA_IP to a closed local port, NO_GCE_CHECK.
Always (emulator or not): etils.epath uses gcsfs, not TensorFlow's gfile (installed with the seqio extra, another GCS
client with its own credential rules), and gcsfs's experimental zonal-bucket probe (a gRPC call to the storage control
API for every bucket) is off. Both are environment settings, so they must be in place before gcsfs is imported:
import this module first (nlac_jax/__init__ does). gcsfs keeps no listings cache (other hosts and tensorstore write
objects it would not see).
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import posixpath
import re
import shutil
import uuid

EMULATOR_VAR = "STORAGE_EMULATOR_HOST"
_SCHEME = "gs://"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# an address on this host where nothing listens: a stray metadata-server look-up fails at once instead of waiting
_CLOSED_LOCAL = "127.0.0.1:9"


def configure(environ=os.environ) -> None:
    """Map STORAGE_EMULATOR_HOST to each library's setting and fix the GCS backends (module docstring). Idempotent;
    settings already in the environment are kept, except that an emulator always wins over a real endpoint."""
    environ.setdefault("EPATH_USE_TF", "false")
    environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    if environ is os.environ:
        import fsspec
        # no cached listings: tensorstore writes the checkpoints' objects behind gcsfs's back, and other hosts write
        # too, so a listing remembered by this process would hide new steps (a lock epoch, a finished run)
        fsspec.config.conf.setdefault("gcs", {})["use_listings_cache"] = False
    url = environ.get(EMULATOR_VAR, "")
    if not url or url == "default":
        return
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
        environ[EMULATOR_VAR] = url
    environ["TENSORSTORE_GCS_HTTP_URL"] = url
    environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    for var in ("GCE_METADATA_HOST", "GCE_METADATA_ROOT", "GCE_METADATA_IP"):
        environ[var] = _CLOSED_LOCAL
    environ["NO_GCE_CHECK"] = "true"
    if environ is os.environ:
        import fsspec
        fsspec.config.conf.setdefault("gcs", {})["token"] = "anon"


def emulator() -> str | None:
    """The GCS emulator's URL when STORAGE_EMULATOR_HOST is set, else None."""
    url = os.environ.get(EMULATOR_VAR, "")
    return url if url and url != "default" else None


configure()
# fsspec logs one INFO line per gs:// file opened (its read-ahead cache's settings): noise in the run's log
logging.getLogger("fsspec.caching").setLevel(logging.WARNING)


# ----------------------------------------------------------------------------- paths
def is_remote(path) -> bool:
    """Whether `path` is a gs:// URL (every other `scheme://` is refused by name, not taken for a local path)."""
    p = os.fspath(path)
    m = _URL.match(p)
    if m is None:
        return False
    if m.group(1) != "gs":
        raise ValueError(f"{p}: unsupported storage scheme {m.group(1)}:// (local paths and gs:// only)")
    return True


def abspath(path) -> str:
    """A local path made absolute; a gs:// URL as it is (without a trailing '/')."""
    p = os.fspath(path)
    return p.rstrip("/") if is_remote(p) else os.path.abspath(p)


def join(path, *parts) -> str:
    p = os.fspath(path)
    return posixpath.join(p, *parts) if is_remote(p) else os.path.join(p, *parts)


def basename(path) -> str:
    p = os.fspath(path).rstrip("/")
    return posixpath.basename(p) if is_remote(p) else os.path.basename(p)


def dirname(path) -> str:
    p = os.fspath(path).rstrip("/")
    if is_remote(p):
        d = posixpath.dirname(p)
        return d if len(d) > len(_SCHEME) else p  # the bucket is its own parent
    return os.path.dirname(p)


def _gcs():
    import fsspec
    return fsspec.filesystem("gs")


# ----------------------------------------------------------------------------- queries
def exists(path) -> bool:
    return _gcs().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path) -> bool:
    """A local directory, or a gs:// prefix that holds at least one object (or the bucket itself)."""
    return _gcs().isdir(path) if is_remote(path) else os.path.isdir(path)


def isfile(path) -> bool:
    return _gcs().isfile(path) if is_remote(path) else os.path.isfile(path)


def listdir(path) -> list[str]:
    """Names (not paths) of the entries directly under `path`, sorted; FileNotFoundError when there are none."""
    if not is_remote(path):
        return sorted(os.listdir(path))
    gcs = _gcs()
    names = sorted({posixpath.basename(p.rstrip("/")) for p in gcs.ls(path, detail=False, refresh=True)})
    if not names and not gcs.isdir(path):
        raise FileNotFoundError(errno.ENOENT, "no such directory", os.fspath(path))
    return [n for n in names if n]


def size(path) -> int:
    return int(_gcs().size(path)) if is_remote(path) else os.path.getsize(path)


def info(path) -> dict:
    """gs://: the object's metadata (generation, updated, size, ...); local: {'size', 'mtime'}."""
    if is_remote(path):
        return _gcs().info(path, refresh=True)
    st = os.stat(path)
    return {"size": st.st_size, "mtime": st.st_mtime}


# ----------------------------------------------------------------------------- reads
def open(path, mode: str = "r", encoding: str | None = None):  # noqa: A001  (the module's open, like os.open)
    """A file object for `path`. 'a' on gs:// is refused (GCS has no append: use append_text)."""
    if not is_remote(path):
        return builtins.open(path, mode, encoding=encoding if "b" not in mode else None)
    if "a" in mode or "+" in mode:
        raise ValueError(f"{path}: mode {mode!r} is not supported on gs:// (objects are written whole)")
    kw = {} if "b" in mode else {"encoding": encoding or "utf-8"}
    return _gcs().open(path, mode, **kw)


def read_bytes(path) -> bytes:
    if is_remote(path):
        return _gcs().cat_file(path)
    with builtins.open(path, "rb") as f:
        return f.read()


def read_text(path, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def read_jsonl(path) -> list[tuple[int, object]]:
    """(1-based line number, decoded value) for every non-blank line of a JSON-lines file; ValueError naming the
    file and line of the first one that is not valid JSON."""
    import json
    rows = []
    for n, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None
    return rows


def read_range(path, start: int, end: int) -> bytes:
    """Bytes [start, end) of the file: on gs:// one ranged GET, so a reader fetches only what it needs."""
    if end <= start:
        return b""
    if is_remote(path):
        return _gcs().cat_file(path, start=start, end=end)
    with builtins.open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


# ----------------------------------------------------------------------------- writes
def makedirs(path) -> None:
    """os.makedirs(exist_ok=True) locally; nothing on gs:// (prefixes exist as soon as an object is under them)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def write_atomic(path, data: str | bytes) -> None:
    """Write `data` so that `path` holds either its old content or all of `data`, never part of it: locally a
    temporary file renamed over it, on gs:// one upload (an object is visible only once complete)."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if is_remote(path):
        _gcs().pipe_file(path, raw)
        return
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with builtins.open(tmp, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def append_text(path, text: str) -> None:
    """Append `text`: locally an append; on gs:// the object is rewritten whole (GCS has no append)."""
    if not is_remote(path):
        with builtins.open(path, "a", encoding="utf-8") as f:
            f.write(text)
        return
    old = read_text(path) if exists(path) else ""
    write_atomic(path, old + text)


def create_exclusive(path, data: str | bytes) -> bool:
    """Create `path` holding `data` only if nothing is there: True if this call created it, False if it existed.
    Locally O_CREAT|O_EXCL; on gs:// an upload with ifGenerationMatch=0 (GCS refuses it when the object exists), so
    of several callers racing exactly one gets True."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if is_remote(path):
        try:
            _gcs().pipe_file(path, raw, mode="create")
        except FileExistsError:
            return False
        return True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return True


def remove(path) -> None:
    if is_remote(path):
        _gcs().rm_file(path)
    else:
        os.remove(path)


def rmtree(path) -> None:
    if is_remote(path):
        if _gcs().exists(path):
            _gcs().rm(path, recursive=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def rename(src, dst) -> None:
    """Rename a file or directory. Local: os.rename (atomic). gs://: copy every object, then delete the originals
    (not atomic: an interrupted rename leaves both, never neither)."""
    if is_remote(src) != is_remote(dst):
        raise ValueError(f"rename {src} -> {dst}: both must be local or both gs://")
    if is_remote(src):
        _gcs().mv(src, dst, recursive=True)
    else:
        os.rename(src, dst)


# what local_copy_of_small_files leaves on gs://: the weights, read in place (ranged reads) by their loader
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_local_copies: dict[str, str] = {}


def local_copy_of_small_files(src_dir) -> str:
    """A local directory holding the files of the gs:// directory `src_dir` except the weights (config, tokenizer,
    chat template: what libraries that read only local files need), copied once per process; FileNotFoundError
    naming `src_dir` when it holds nothing."""
    src = abspath(src_dir)
    if src not in _local_copies:
        import tempfile
        names = [n for n in listdir(src) if not n.endswith(_WEIGHT_SUFFIXES)]
        dst = tempfile.mkdtemp(prefix="nlac_model_dir_")
        for name in names:
            path = join(src, name)
            if isfile(path):
                write_atomic(os.path.join(dst, name), read_bytes(path))
        _local_copies[src] = dst
    return _local_copies[src]
