"""Hugging Face checkpoint import/export: safetensors only (never pickle), no torch.

The mapping between HF tensor names and our parameter paths is the family's declarative key map
(`models/families/`): each row is (our path, HF name, transform) where transform "T" means our array = HF weight
transposed and reshaped (HF Linear weights are [out, in]), and "R" means reshaped only. Our shapes come from the
model itself (`decoder.abstract_params`), so nothing here restates the architecture. Loading places each tensor straight into its target
sharding with `jax.make_array_from_callback`, reading only the rows (layers) a device needs, so a 7B/32B model
is never materialised whole on one host.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from nlac_jax.models import decoder, families
from nlac_jax.models.config import ModelConfig
from nlac_jax.storage import fs

# safetensors dtype names <-> numpy dtypes (bfloat16 via ml_dtypes, which jax already depends on)
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}

# gs:// reads: the bytes of recently read tensors a SafetensorsFile keeps, so the devices of a host that share a
# tensor fetch it once
REMOTE_CACHE_BYTES = 1 << 30


class CheckpointError(ValueError):
    """Missing/unexpected/mis-shaped tensors or unreadable files; the message names the tensor or file."""


# ----------------------------------------------------------------------------- layout
def _our_shapes(cfg: ModelConfig) -> dict[str, dict[tuple, tuple]]:
    """Our parameter shapes from the model itself (no allocation): {'layer': path -> shape of ONE layer (no
    leading 'layers' axis), 'top': path -> shape}."""
    flat = {}
    tree = decoder.abstract_params(cfg.replace(scan_layers=True))

    def walk(t, path):
        if isinstance(t, dict):
            for k, v in t.items():
                walk(v, path + (k,))
        else:
            flat[path] = tuple(t.shape)
    walk(tree, ())
    layer = {p[1:]: s[1:] for p, s in flat.items() if p[0] == "layers"}
    top = {p: s for p, s in flat.items() if p[0] != "layers"}
    return {"layer": layer, "top": top}


def key_map(cfg: ModelConfig) -> tuple[tuple, tuple]:
    """(top rows, layer rows) of the family's HF key map that this config has parameters for; every parameter
    must be covered (a family file that forgets a tensor fails here, by name)."""
    fam = families.FAMILIES[cfg.model_type]
    shapes = _our_shapes(cfg)
    top = tuple(r for r in fam.top_keys if r[0] in shapes["top"])
    layer = tuple(r for r in fam.layer_keys if r[0] in shapes["layer"])
    for kind, rows in (("top", top), ("layer", layer)):
        missing = set(shapes[kind]) - {r[0] for r in rows}
        if missing:
            raise CheckpointError(f"family {fam.name!r} has no HF key for parameter(s) {sorted(missing)}")
    return top, layer


def _hf_shape(our_shape: tuple, transform: str, path: tuple) -> tuple:
    """HF tensor shape for our array shape. "T" rows: o_proj folds (H, D) on the input side, q/k/v on the output."""
    if transform == "R":
        return (math.prod(our_shape),) if path[-1] == "bias" else tuple(our_shape)  # biases: [H, D] <- [H*D]
    if path[-2:] == ("o_proj", "kernel"):  # ours [H, D, E] <- HF [E, H*D]
        return (our_shape[-1], math.prod(our_shape[:-1]))
    return (math.prod(our_shape[1:]), our_shape[0])  # ours [E, ...out] <- HF [out, E]


def _hf_to_ours(w: np.ndarray, our_shape: tuple, transform: str) -> np.ndarray:
    return (w.T if transform == "T" else w).reshape(our_shape)


def _ours_to_hf(a: np.ndarray, hf_shape: tuple, transform: str) -> np.ndarray:
    return a.reshape(hf_shape[::-1]).T if transform == "T" else a.reshape(hf_shape)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple, tuple, str, int | None]]:
    """HF name -> (HF shape, our path relative to its layer, transform, layer index or None)."""
    shapes = _our_shapes(cfg)
    top, layer = key_map(cfg)
    out = {}
    for path, name, tr in top:
        out[name] = (_hf_shape(shapes["top"][path], tr, path), path, tr, None)
    for i in range(cfg.num_layers):
        for path, name, tr in layer:
            out[f"model.layers.{i}.{name}"] = (_hf_shape(shapes["layer"][path], tr, path), path, tr, i)
    return out


# ----------------------------------------------------------------------------- safetensors (no torch, mmap)
class SafetensorsFile:
    """Reader of one .safetensors file: header parsed once, tensors read lazily. A local file is memory-mapped; on
    gs:// each tensor is one ranged read of its own bytes, so a host fetches only the tensors it places."""

    def __init__(self, path: str):
        self.path = path
        self._remote = fs.is_remote(path)
        try:
            size = fs.size(path)
            n = struct.unpack("<Q", fs.read_range(path, 0, 8))[0]
            if 8 + n > size:
                raise CheckpointError(f"{path}: the safetensors header claims {n} bytes but the file has only "
                                      f"{size} bytes (truncated file?)")
            header = json.loads(fs.read_range(path, 8, 8 + n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a readable safetensors file (the header is not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._base = 8 + n
        self._mm = None
        self._cached: dict[str, np.ndarray] = {}  # gs:// only: the latest tensors read, oldest first
        self._check_offsets(size - self._base)

    def _check_offsets(self, data_bytes: int) -> None:
        """Every tensor's byte range must lie in the file and match its dtype and shape: a truncated or damaged
        file is named here, with its first tensor that does not fit, instead of failing later in a reshape."""
        def start(item):
            offsets = item[1].get("data_offsets") if isinstance(item[1], dict) else None
            return offsets[0] if isinstance(offsets, list) and offsets and isinstance(offsets[0], int) else -1

        for name, info in sorted(self.header.items(), key=start):  # file order: the first one cut off is named
            try:
                lo, hi = (int(v) for v in info["data_offsets"])
                shape = [int(d) for d in info["shape"]]
                dtype = info["dtype"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has a malformed header entry {info!r}") from None
            if not 0 <= lo <= hi <= data_bytes:
                raise CheckpointError(f"{self.path}: tensor {name!r} needs bytes {lo}..{hi} of the data section, "
                                      f"but the file holds only {data_bytes} data bytes (truncated file?)")
            if dtype in _ST_DTYPES:
                need = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize
                if hi - lo != need:
                    raise CheckpointError(f"{self.path}: tensor {name!r} has {hi - lo} bytes in the file, but "
                                          f"{dtype} {tuple(shape)} needs {need}")

    def keys(self):
        return self.header.keys()

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if self._remote:
            raw = self._cached.pop(name, None)
            if raw is None:
                raw = np.frombuffer(fs.read_range(self.path, self._base + start, self._base + end), dtype=np.uint8)
            # the devices of one host that share a tensor ask for it one after another: keep the latest ones
            self._cached[name] = raw
            while sum(r.nbytes for r in self._cached.values()) > REMOTE_CACHE_BYTES and len(self._cached) > 1:
                self._cached.pop(next(iter(self._cached)))
        else:
            if self._mm is None:
                self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
            raw = self._mm[self._base + start:self._base + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write tensors (numpy, incl. ml_dtypes.bfloat16) as one safetensors file, 8-byte aligned like the reference."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NP_TO_ST:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": _NP_TO_ST[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    def write(f):
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())

    if fs.is_remote(path):  # one upload: the object appears only once complete
        with fs.open(path, "wb") as f:
            write(f)
        return
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)  # never leave a half-written checkpoint under the final name


class HFCheckpoint:
    """All tensors of an HF directory (local or gs://): `model.safetensors`, or shards listed in
    `model.safetensors.index.json`."""

    def __init__(self, model_dir: str):
        single = fs.join(model_dir, "model.safetensors")
        index = fs.join(model_dir, "model.safetensors.index.json")
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        if fs.isfile(index):
            try:
                weight_map = json.loads(fs.read_text(index))["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: unreadable shard index ({e!r})") from None
            for name, fname in weight_map.items():
                path = fs.join(model_dir, fname)
                if fname not in self.files:
                    if not fs.isfile(path):
                        raise CheckpointError(f"{path}: shard listed in {index} (for tensor {name!r}) is missing")
                    self.files[fname] = SafetensorsFile(path)
                if name not in self.files[fname].header:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in {index} is not in this shard")
                self.where[name] = fname
        elif fs.isfile(single):
            self.files["model.safetensors"] = SafetensorsFile(single)
            self.where = {k: "model.safetensors" for k in self.files["model.safetensors"].keys()}
        else:
            if any(f.endswith((".bin", ".pt", ".pth")) for f in fs.listdir(model_dir)):
                raise CheckpointError(f"{model_dir}: only pickle weights (.bin/.pt) found; we load safetensors only "
                                      "(convert with transformers' save_pretrained(safe_serialization=True))")
            raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")

    def shape(self, name):
        return self.files[self.where[name]].shape(name)

    def get(self, name):
        return self.files[self.where[name]].get(name)


# ----------------------------------------------------------------------------- load
def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def load_params(model_dir: str, cfg: ModelConfig, shardings=None, strict: bool = True) -> dict:
    """Read HF safetensors from `model_dir` into our parameter tree (layout per cfg.scan_layers).

    shardings: optional tree (same structure as the params) of jax.sharding.Sharding; each leaf is created
      directly in its sharding, each device reading only its slice. None: default device placement.
    Errors (CheckpointError) name the tensor: missing, unexpected (if strict), or shape mismatch with both shapes.
    Tied models ignore a stored `lm_head.weight` (transformers writes none for them).
    """
    ckpt = HFCheckpoint(model_dir)
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in ckpt.where]
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [n for n in ckpt.where if n not in expected and n not in ignorable
                  and not n.endswith("rotary_emb.inv_freq")]
    if unexpected and strict:
        raise CheckpointError(f"{model_dir}: unexpected tensor {unexpected[0]!r} (not in a "
                              f"{cfg.model_type} model with this config)"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, (hf_shape, _, _, _) in expected.items():
        got = ckpt.shape(name)
        if tuple(got) != tuple(hf_shape):
            raise CheckpointError(f"{model_dir}: tensor {name!r} has shape {tuple(got)}, the config expects "
                                  f"{tuple(hf_shape)}")

    pdt = np.dtype(jax.numpy.dtype(cfg.param_dtype))
    shapes = _our_shapes(cfg)
    top_rows, layer_rows = key_map(cfg)
    params: dict = {}

    def place(path: tuple, global_shape: tuple, read: Callable[[tuple], np.ndarray]):
        sh = _get(shardings, path) if shardings is not None else None
        if sh is None:
            _set(params, path, jax.numpy.asarray(read(tuple(slice(None) for _ in global_shape))))
            return
        _set(params, path, jax.make_array_from_callback(global_shape, sh, read))

    for path, name, tr in top_rows:
        our_shape = shapes["top"][path]
        place(path, our_shape, lambda idx, n=name, s=our_shape, t=tr: _hf_to_ours(ckpt.get(n), s, t)[idx].astype(pdt))

    for path, name, tr in layer_rows:
        our_shape = shapes["layer"][path]

        def read_layers(idx, n=name, s=our_shape, t=tr):
            layers = range(cfg.num_layers)[idx[0]]  # only the layers this device holds
            rows = [_hf_to_ours(ckpt.get(f"model.layers.{i}.{n}"), s, t)[idx[1:]] for i in layers]
            return np.stack(rows).astype(pdt)

        if cfg.scan_layers:
            place(("layers",) + path, (cfg.num_layers,) + our_shape, read_layers)
        else:
            for i in range(cfg.num_layers):
                place((f"layers_{i}",) + path, our_shape,
                      lambda idx, n=name, s=our_shape, t=tr, i=i:
                      _hf_to_ours(ckpt.get(f"model.layers.{i}.{n}"), s, t)[idx].astype(pdt))
    return params


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# ----------------------------------------------------------------------------- save
def _to_host(a) -> np.ndarray:
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        a = multihost_utils.process_allgather(a, tiled=True)
    return np.asarray(jax.device_get(a))


def save_params(out_dir: str, cfg: ModelConfig, params: dict, max_shard_bytes: int = 2 * 1024 ** 3,
                dtype: str | None = None) -> list[str]:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`). Returns the files written.

    Only process 0 writes (every process must call: gathering sharded arrays is collective).
    dtype: on-disk dtype (default cfg.param_dtype).
    """
    out_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
    tensors: dict[str, np.ndarray] = {}
    for name, (hf_shape, path, tr, layer) in expected_tensors(cfg).items():
        if layer is None:
            a = _get(params, path)
        elif cfg_layers_scanned(params):
            a = _get(params, ("layers",) + path)[layer]
        else:
            a = _get(params, (f"layers_{layer}",) + path)
        tensors[name] = _ours_to_hf(_to_host(a), hf_shape, tr).astype(out_dtype)
    if jax.process_index() != 0:
        return []
    fs.makedirs(out_dir)
    hf_cfg = cfg.replace(param_dtype=str(jax.numpy.dtype(out_dtype))).to_hf_dict()
    fs.write_atomic(fs.join(out_dir, "config.json"), json.dumps(hf_cfg, indent=2))
    total = sum(a.nbytes for a in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(fs.join(out_dir, "model.safetensors"), tensors)
        return ["config.json", "model.safetensors"]
    shards, cur, size = [], {}, 0
    for name in expected_tensors(cfg):  # keep layers together, in model order
        if cur and size + tensors[name].nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = tensors[name]
        size += tensors[name].nbytes
    shards.append(cur)
    weight_map, files = {}, ["config.json"]
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(fs.join(out_dir, fname), shard)
        weight_map.update({n: fname for n in shard})
        files.append(fname)
    fs.write_atomic(fs.join(out_dir, "model.safetensors.index.json"),
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files + ["model.safetensors.index.json"]


def save_tokenizer(tokenizer, out_dir: str) -> None:
    """tokenizer.save_pretrained(out_dir) for a local or gs:// directory (transformers writes local files only: on
    gs:// they are written to a temporary directory and uploaded). Call on one process."""
    if not fs.is_remote(out_dir):
        tokenizer.save_pretrained(out_dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            fs.write_atomic(fs.join(out_dir, name), fs.read_bytes(os.path.join(tmp, name)))


def cfg_layers_scanned(params: dict) -> bool:
    return "layers" in params
