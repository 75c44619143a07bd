#!/usr/bin/env python3
"""export.py - make checkpoints and tokenizers for run.c.

Subcommands:
  tokenizer IN.model OUT.bin
      SentencePiece tokenizer.model -> llama2.c tokenizer.bin
  model SRC OUT.bin [--version 0|1|2] [--group-size N] [--seq-len N]
      SRC is a Hugging Face Llama directory (safetensors, sharded safetensors
      or pytorch_model*.bin), a llama2.c/nanoGPT-style .pt checkpoint, a Meta
      consolidated.*.pth directory with params.json, or an existing run.c
      checkpoint (any version; converts between versions).
  random OUT.bin --shape SHAPE --seed N [--version V]
      deterministic random-weight checkpoint (for tests and benchmarks)
  info FILE
      print the header of a run.c checkpoint (any version) or a tokenizer.bin

Output versions: 0 = legacy llama2.c float32 (the default, readable by every
llama2.c-style runner), 1 = float32 "ak42" header, 2 = int8 "Q8_0" with
per-group float32 scales. Only the standard library and numpy are needed;
torch is imported only to read PyTorch pickles (.pt, .pth, pytorch_model.bin).
"""

import argparse
import json
import os
import struct
import sys
import tempfile

import numpy as np

MAGIC = 0x616B3432  # "ak42"
HEADER_BYTES = 256
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


class ExportError(Exception):
    """An error reported to the user as one line, exit status 1."""


def fail(msg):
    raise ExportError(msg)


# ---------------------------------------------------------------------------
# tokenizer: a minimal protobuf reader for SentencePiece's ModelProto

def _varint(buf, pos):
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            fail("truncated protobuf (varint runs past the end)")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            fail("malformed protobuf varint")


def _proto_fields(buf):
    """Yield (field_number, wire_type, value) for one protobuf message.
    value is an int for varint/fixed types and bytes for length-delimited."""
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > n:
                fail("truncated protobuf (64-bit field)")
            value = buf[pos:pos + 8]
            pos += 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > n:
                fail("truncated protobuf (length-delimited field)")
            value = buf[pos:pos + length]
            pos += length
        elif wire == 5:
            if pos + 4 > n:
                fail("truncated protobuf (32-bit field)")
            value = buf[pos:pos + 4]
            pos += 4
        else:
            fail("unsupported protobuf wire type %d" % wire)
        yield field, wire, value


def read_sentencepiece(path):
    """Return a list of (piece: str, score: float, type: int)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    pieces = []
    for field, wire, value in _proto_fields(data):
        if field != 1 or wire != 2:
            continue  # trainer_spec, normalizer_spec, ... are not needed
        piece, score, ptype = None, 0.0, 1
        for f2, w2, v2 in _proto_fields(value):
            if f2 == 1 and w2 == 2:
                piece = bytes(v2).decode("utf-8")
            elif f2 == 2 and w2 == 5:
                score = struct.unpack("<f", v2)[0]
            elif f2 == 3 and w2 == 0:
                ptype = v2
        if piece is None:
            fail("%s: SentencePiece entry %d has no piece string" % (path, len(pieces)))
        pieces.append((piece, score, ptype))
    if not pieces:
        fail("%s: no SentencePiece entries found (not a tokenizer.model?)" % path)
    return pieces


def cmd_tokenizer(args):
    pieces = read_sentencepiece(args.input)
    entries = []
    for i, (piece, score, _ptype) in enumerate(pieces):
        if i == 1:
            piece = "\n<s>\n"
        elif i == 2:
            piece = "\n</s>\n"
        data = piece.replace("\u2581", " ").encode("utf-8")
        entries.append((score, data))
    max_len = max(len(d) for _, d in entries)
    out = [struct.pack("<i", max_len)]
    for score, data in entries:
        out.append(struct.pack("<fi", score, len(data)))
        out.append(data)
    with atomic_output(args.output) as f:
        f.write(b"".join(out))
    print("wrote %s: %d tokens, max_token_length %d" % (args.output, len(entries), max_len))


# ---------------------------------------------------------------------------
# atomic output

class atomic_output:
    """Write to a temporary file next to `path`; rename it over `path` only
    when the with-block finishes without an exception."""

    def __init__(self, path):
        self.path = path
        self.tmp = None
        self.f = None

    def __enter__(self):
        d = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(d):
            fail("output directory %s does not exist" % d)
        fd, self.tmp = tempfile.mkstemp(prefix=".export-", suffix=".tmp", dir=d)
        self.f = os.fdopen(fd, "wb")
        return self.f

    def __exit__(self, exc_type, exc, tb):
        try:
            self.f.close()
        except Exception:
            if exc_type is None:
                raise
        if exc_type is None:
            try:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(self.tmp, 0o666 & ~umask)
                os.replace(self.tmp, self.path)
            except OSError as e:
                try:
                    os.unlink(self.tmp)
                except OSError:
                    pass
                fail("cannot write %s: %s" % (self.path, e.strerror))
        else:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
        return False


# ---------------------------------------------------------------------------
# the in-memory model description shared by all sources
#
# A source is an object with .cfg (dict: dim, hidden_dim, n_layers, n_heads,
# n_kv_heads, vocab_size, seq_len, shared) and .get(name, layer) returning a
# float32 array in run.c's conventions (adjacent-pair RoPE, (out, in)).

LAYER_TENSORS = ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3")


def expected_shape(cfg, name):
    dim, hid = cfg["dim"], cfg["hidden_dim"]
    kv_dim = dim // cfg["n_heads"] * cfg["n_kv_heads"]
    return {
        "tok_emb": (cfg["vocab_size"], dim),
        "cls": (cfg["vocab_size"], dim),
        "rms_final": (dim,),
        "rms_att": (dim,),
        "rms_ffn": (dim,),
        "wq": (dim, dim),
        "wk": (kv_dim, dim),
        "wv": (kv_dim, dim),
        "wo": (dim, dim),
        "w1": (hid, dim),
        "w2": (dim, hid),
        "w3": (hid, dim),
    }[name]


def check_config(cfg):
    for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
        v = cfg.get(k)
        if not isinstance(v, int) or v <= 0:
            fail("bad or missing model parameter %s = %r" % (k, v))
        if v >= 2 ** 31:
            fail("model parameter %s = %d does not fit in int32" % (k, v))
    if cfg["dim"] % cfg["n_heads"]:
        fail("dim %d is not a multiple of n_heads %d" % (cfg["dim"], cfg["n_heads"]))
    if (cfg["dim"] // cfg["n_heads"]) % 2:
        fail("head size %d is odd; RoPE needs an even head size" % (cfg["dim"] // cfg["n_heads"]))
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        fail("n_heads %d is not a multiple of n_kv_heads %d" % (cfg["n_heads"], cfg["n_kv_heads"]))


def fetch(src, name, layer=None):
    """Get a tensor from a source, as contiguous float32 of the right shape."""
    w = src.get(name, layer)
    want = expected_shape(src.cfg, name)
    w = np.asarray(w)
    if tuple(w.shape) != want:
        label = name if layer is None else "%s of layer %d" % (name, layer)
        fail("tensor %s has shape %s, expected %s" % (label, tuple(w.shape), want))
    return np.ascontiguousarray(w, dtype=np.float32)


def rope_tables(cfg):
    head_size = cfg["dim"] // cfg["n_heads"]
    freqs = 1.0 / (ROPE_THETA ** (np.arange(0, head_size, 2)[: head_size // 2].astype(np.float32) / head_size))
    t = np.arange(cfg["seq_len"], dtype=np.float32)
    f = np.outer(t, freqs).astype(np.float32)
    return np.cos(f).astype(np.float32), np.sin(f).astype(np.float32)


# ---------------------------------------------------------------------------
# writers

def header_ints(cfg, vocab):
    return struct.pack("<7i", cfg["dim"], cfg["hidden_dim"], cfg["n_layers"], cfg["n_heads"],
                       cfg["n_kv_heads"], vocab, cfg["seq_len"])


def write_v0(src, f):
    cfg = src.cfg
    L = cfg["n_layers"]
    vocab = cfg["vocab_size"] if cfg["shared"] else -cfg["vocab_size"]
    f.write(header_ints(cfg, vocab))
    f.write(fetch(src, "tok_emb").tobytes())
    for name in LAYER_TENSORS:
        for l in range(L):
            f.write(fetch(src, name, l).tobytes())
    f.write(fetch(src, "rms_final").tobytes())
    cos, sin = rope_tables(cfg)
    f.write(cos.tobytes())
    f.write(sin.tobytes())
    if not cfg["shared"]:
        f.write(fetch(src, "cls").tobytes())


def versioned_header(cfg, version, group_size=None):
    h = struct.pack("<Ii", MAGIC, version) + header_ints(cfg, cfg["vocab_size"])
    h += struct.pack("<B", 1 if cfg["shared"] else 0)
    if version == 2:
        h += struct.pack("<i", group_size)
    return h + b"\0" * (HEADER_BYTES - len(h))


def write_v1(src, f):
    cfg = src.cfg
    L = cfg["n_layers"]
    f.write(versioned_header(cfg, 1))
    for name in ("rms_att", "rms_ffn"):
        for l in range(L):
            f.write(fetch(src, name, l).tobytes())
    f.write(fetch(src, "rms_final").tobytes())
    f.write(fetch(src, "tok_emb").tobytes())
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        for l in range(L):
            f.write(fetch(src, name, l).tobytes())
    if not cfg["shared"]:
        f.write(fetch(src, "cls").tobytes())


def choose_group_size(cfg, requested):
    gs = requested
    if gs <= 0:
        fail("group size must be positive, got %d" % gs)
    while cfg["dim"] % gs or cfg["hidden_dim"] % gs:
        gs //= 2
    return gs


def quantize_q80(w, gs):
    """Symmetric int8 quantisation in groups of gs consecutive values.
    Returns (int8 values, float32 scales, max abs error)."""
    g = w.reshape(-1, gs)
    scale = np.abs(g).max(axis=1) / np.float32(127.0)
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(g / safe[:, None]), -127, 127).astype(np.int8)
    err = float(np.abs(q.astype(np.float32) * scale[:, None] - g).max()) if g.size else 0.0
    return q.reshape(-1), scale.astype(np.float32), err


def write_v2(src, f, group_size):
    cfg = src.cfg
    L = cfg["n_layers"]
    gs = choose_group_size(cfg, group_size)
    if gs != group_size:
        print("group size %d does not divide dim %d and hidden_dim %d; using %d"
              % (group_size, cfg["dim"], cfg["hidden_dim"], gs), file=sys.stderr)
    f.write(versioned_header(cfg, 2, gs))
    for name in ("rms_att", "rms_ffn"):
        for l in range(L):
            f.write(fetch(src, name, l).tobytes())
    f.write(fetch(src, "rms_final").tobytes())
    worst = (0.0, "")
    todo = [("tok_emb", None)]
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        todo += [(name, l) for l in range(L)]
    if not cfg["shared"]:
        todo.append(("cls", None))
    for name, l in todo:
        q, s, err = quantize_q80(fetch(src, name, l), gs)
        f.write(q.tobytes())
        f.write(s.tobytes())
        if err >= worst[0]:
            worst = (err, name if l is None else "%s[%d]" % (name, l))
    print("group size %d; largest quantisation error %.6g (in %s)" % (gs, worst[0], worst[1]))


def write_checkpoint(src, out, version, group_size):
    check_config(src.cfg)
    with atomic_output(out) as f:
        if version == 0:
            write_v0(src, f)
        elif version == 1:
            write_v1(src, f)
        elif version == 2:
            write_v2(src, f, group_size)
        else:
            fail("unknown output version %r (want 0, 1 or 2)" % version)
    c = src.cfg
    print("wrote %s: version %d, dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
          "vocab_size %d, seq_len %d, %s classifier"
          % (out, version, c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"],
             c["vocab_size"], c["seq_len"], "shared" if c["shared"] else "separate"))


# ---------------------------------------------------------------------------
# reading run.c checkpoints

def read_runc_header(path):
    """Return (cfg, info) for a run.c checkpoint, or raise ExportError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    if len(head) < 28:
        fail("%s: too short to be a checkpoint (%d bytes)" % (path, size))
    magic = struct.unpack("<I", head[:4])[0]
    if magic == MAGIC:
        if len(head) < HEADER_BYTES:
            fail("%s: truncated header" % path)
        version = struct.unpack("<i", head[4:8])[0]
        vals = struct.unpack("<7i", head[8:36])
        shared = head[36]
        gs = struct.unpack("<i", head[37:41])[0] if version == 2 else None
        if version not in (1, 2):
            fail("%s: unsupported checkpoint version %d" % (path, version))
        offset = HEADER_BYTES
    else:
        version = 0
        vals = struct.unpack("<7i", head[:28])
        shared = vals[5] > 0
        vals = vals[:5] + (abs(vals[5]),) + vals[6:]
        gs = None
        offset = 28
    keys = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    cfg = dict(zip(keys, vals))
    cfg["shared"] = bool(shared)
    for k in keys:
        if cfg[k] <= 0:
            fail("%s: not a run.c checkpoint (%s = %d)" % (path, k, cfg[k]))
    check_config(cfg)
    info = {"version": version, "group_size": gs, "offset": offset, "size": size}
    if version == 2 and (gs is None or gs <= 0 or cfg["dim"] % gs or cfg["hidden_dim"] % gs):
        fail("%s: bad group size %r" % (path, gs))
    info["expected_size"] = offset + payload_bytes(cfg, version, gs)
    return cfg, info


def _tensor_list(cfg, version):
    """(name, layer) in file order for the big matrices of v1/v2."""
    L = cfg["n_layers"]
    todo = [("tok_emb", None)]
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
        todo += [(name, l) for l in range(L)]
    if not cfg["shared"]:
        todo.append(("cls", None))
    return todo


def payload_bytes(cfg, version, gs):
    L = cfg["n_layers"]
    n = 0
    norms = (2 * L + 1) * cfg["dim"] * 4
    for name, _l in _tensor_list(cfg, version):
        cnt = int(np.prod(expected_shape(cfg, name)))
        n += cnt * 4 if version != 2 else cnt + cnt // gs * 4
    n += norms
    if version == 0:
        n += 2 * cfg["seq_len"] * (cfg["dim"] // cfg["n_heads"] // 2) * 4
    return n


class RuncSource:
    def __init__(self, path):
        cfg, info = read_runc_header(path)
        if info["size"] != info["expected_size"]:
            fail("%s: file is %d bytes but its header implies %d (truncated or not a version %d checkpoint)"
                 % (path, info["size"], info["expected_size"], info["version"]))
        self.cfg = cfg
        self.info = info
        self.mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.index = {}
        L = cfg["n_layers"]
        dim = cfg["dim"]
        off = info["offset"]
        version = info["version"]

        def count(name):
            return int(np.prod(expected_shape(cfg, name)))

        if version == 0:
            order = [("tok_emb", None)]
            for name in LAYER_TENSORS:
                order += [(name, l) for l in range(L)]
            order.append(("rms_final", None))
            for key in order:
                self.index[key] = ("f32", off)
                off += count(key[0]) * 4
            off += 2 * cfg["seq_len"] * (dim // cfg["n_heads"] // 2) * 4
            if not cfg["shared"]:
                self.index[("cls", None)] = ("f32", off)
        else:
            for name in ("rms_att", "rms_ffn"):
                for l in range(L):
                    self.index[(name, l)] = ("f32", off)
                    off += dim * 4
            self.index[("rms_final", None)] = ("f32", off)
            off += dim * 4
            gs = info["group_size"]
            for key in _tensor_list(cfg, version):
                n = count(key[0])
                if version == 1:
                    self.index[key] = ("f32", off)
                    off += n * 4
                else:
                    self.index[key] = ("q8", off)
                    off += n + n // gs * 4

    def get(self, name, layer):
        if name == "cls" and self.cfg["shared"]:
            name = "tok_emb"
        kind, off = self.index[(name, layer)]
        shape = expected_shape(self.cfg, name)
        n = int(np.prod(shape))
        if kind == "f32":
            return self.mm[off:off + n * 4].view(np.float32).reshape(shape)
        gs = self.info["group_size"]
        q = self.mm[off:off + n].view(np.int8).astype(np.float32)
        s = self.mm[off + n:off + n + n // gs * 4].view(np.float32)
        return (q.reshape(-1, gs) * s[:, None]).reshape(shape)


# ---------------------------------------------------------------------------
# safetensors (read directly, no package)

ST_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2), "F64": (np.float64, 8)}


class SafetensorsFile:
    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    fail("%s: truncated safetensors file (no header)" % path)
                hlen = struct.unpack("<Q", raw)[0]
                if hlen > size - 8 or hlen > 100 * 1024 * 1024:
                    fail("%s: truncated or corrupt safetensors file (header length %d, file %d bytes)"
                         % (path, hlen, size))
                header = f.read(hlen)
        except OSError as e:
            fail("cannot read %s: %s" % (path, e.strerror))
        try:
            meta = json.loads(header.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            fail("%s: corrupt safetensors header (not JSON)" % path)
        if not isinstance(meta, dict):
            fail("%s: corrupt safetensors header" % path)
        meta.pop("__metadata__", None)
        self.base = 8 + hlen
        data_size = size - self.base
        self.tensors = {}
        for name, t in meta.items():
            try:
                dtype, shape, (start, end) = t["dtype"], [int(x) for x in t["shape"]], t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                fail("%s: corrupt safetensors entry for %s" % (path, name))
            if end > data_size or start > end or start < 0:
                fail("%s: truncated safetensors file: tensor %s needs bytes %d..%d of data but only %d present"
                     % (path, name, start, end, data_size))
            if dtype in ST_DTYPES:
                nbytes = int(np.prod(shape, dtype=np.int64)) * ST_DTYPES[dtype][1]
                if end - start != nbytes:
                    fail("%s: tensor %s: %d bytes for shape %s %s" % (path, name, end - start, shape, dtype))
            self.tensors[name] = (dtype, tuple(shape), start, end)
        self.mm = None

    def load(self, name):
        dtype, shape, start, end = self.tensors[name]
        if dtype not in ST_DTYPES:
            fail("%s: tensor %s has unsupported dtype %s" % (self.path, name, dtype))
        if self.mm is None:
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self.mm[self.base + start:self.base + end]
        npdt = ST_DTYPES[dtype][0]
        a = np.frombuffer(raw, dtype=np.dtype(npdt).newbyteorder("<"))
        if dtype == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32, copy=False).reshape(shape)


# ---------------------------------------------------------------------------
# PyTorch pickles (torch imported lazily)

_PICKLE_ALLOWED = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_from_type_v2"),
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


def _restricted_pickle_module():
    """A stand-in for the pickle module whose Unpickler only builds tensors
    and plain containers: loading a checkpoint must not run arbitrary code.
    (torch's own weights_only mode in 1.13 rejects floats, which llama2.c
    checkpoints contain.)"""
    import pickle
    import types
    import torch

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _PICKLE_ALLOWED:
                return super().find_class(module, name)
            if module == "torch" and (name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError("refusing to unpickle %s.%s (only tensors and plain data are loaded)"
                                         % (module, name))

    mod = types.ModuleType("export_restricted_pickle")
    mod.Unpickler = Unpickler
    mod.UnpicklingError = pickle.UnpicklingError
    mod.load = lambda f, **kw: Unpickler(f, **kw).load()
    mod.loads = lambda b, **kw: Unpickler(__import__("io").BytesIO(b), **kw).load()
    mod.__name__ = "pickle"
    return mod


def torch_load(path):
    try:
        import torch
    except ImportError:
        fail("reading %s needs PyTorch (import torch failed); install python3-torch or convert to safetensors"
             % path)
    import torch.serialization as ts
    pm = _restricted_pickle_module()
    saved = getattr(ts, "pickle", None)
    try:
        # torch 1.13 ignores pickle_module unless weights_only, and uses its
        # module-global `pickle` instead: point that at the restricted one too
        if saved is not None:
            ts.pickle = pm
        try:
            return torch.load(path, map_location="cpu", pickle_module=pm, weights_only=False)
        except TypeError:  # torch older than 1.13 has no weights_only
            return torch.load(path, map_location="cpu", pickle_module=pm)
    except ExportError:
        raise
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail("cannot load %s with torch: %s" % (path, msg))
    finally:
        if saved is not None:
            ts.pickle = saved


def to_numpy(t):
    """torch tensor (any float dtype) -> float32 numpy."""
    import torch
    if not isinstance(t, torch.Tensor):
        fail("expected a tensor, got %s" % type(t).__name__)
    return t.detach().to(torch.float32).cpu().numpy()


# ---------------------------------------------------------------------------
# Hugging Face Llama directories

HF_NAMES = {
    "rms_att": "model.layers.%d.input_layernorm.weight",
    "wq": "model.layers.%d.self_attn.q_proj.weight",
    "wk": "model.layers.%d.self_attn.k_proj.weight",
    "wv": "model.layers.%d.self_attn.v_proj.weight",
    "wo": "model.layers.%d.self_attn.o_proj.weight",
    "rms_ffn": "model.layers.%d.post_attention_layernorm.weight",
    "w1": "model.layers.%d.mlp.gate_proj.weight",
    "w2": "model.layers.%d.mlp.down_proj.weight",
    "w3": "model.layers.%d.mlp.up_proj.weight",
    "tok_emb": "model.embed_tokens.weight",
    "rms_final": "model.norm.weight",
    "cls": "lm_head.weight",
}


def unpermute_hf(w, n_heads):
    """Undo the permutation HF's Llama conversion applies to q/k weights
    (rotate-half RoPE layout -> adjacent-pair layout used by run.c)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _eps_ok(eps):
    return eps is not None and abs(float(eps) - NORM_EPS) <= 1e-3 * NORM_EPS


class HFSource:
    def __init__(self, d):
        cfg_path = os.path.join(d, "config.json")
        if not os.path.isfile(cfg_path):
            fail("%s: no config.json (not a Hugging Face model directory)" % d)
        try:
            with open(cfg_path, "r", encoding="utf-8") as f:
                hf = json.load(f)
        except (OSError, ValueError) as e:
            fail("%s: cannot parse: %s" % (cfg_path, e))
        self.check_arch(hf, cfg_path)
        dim = hf.get("hidden_size")
        n_heads = hf.get("num_attention_heads")
        n_kv = hf.get("num_key_value_heads") or n_heads
        if hf.get("head_dim") not in (None, (dim // n_heads) if dim and n_heads else None):
            fail("%s: head_dim %r != hidden_size / num_attention_heads; not supported"
                 % (cfg_path, hf.get("head_dim")))
        self.cfg = {
            "dim": dim,
            "hidden_dim": hf.get("intermediate_size"),
            "n_layers": hf.get("num_hidden_layers"),
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "vocab_size": hf.get("vocab_size"),
            "seq_len": hf.get("max_position_embeddings"),
        }
        check_config(self.cfg)
        self.dir = d
        self.tensors = {}  # name -> loader callable
        self.find_weights(d)
        for name in self.tensors:
            if name.endswith(".bias"):
                fail("tensor %s: bias tensors are not supported by run.c" % name)
        has_lm_head = "lm_head.weight" in self.tensors
        tie = hf.get("tie_word_embeddings")
        if tie or not has_lm_head:
            if not has_lm_head and tie is False:
                print("note: lm_head.weight absent although tie_word_embeddings is false; "
                      "using the tied embedding", file=sys.stderr)
            self.cfg["shared"] = True
        else:
            self.cfg["shared"] = False
        # all required tensors present?
        need = [HF_NAMES["tok_emb"], HF_NAMES["rms_final"]]
        for key in LAYER_TENSORS:
            need += [HF_NAMES[key] % l for l in range(self.cfg["n_layers"])]
        missing = [n for n in need if n not in self.tensors]
        if missing:
            more = " (and %d more)" % (len(missing) - 1) if len(missing) > 1 else ""
            fail("%s: missing tensor %s%s" % (d, missing[0], more))

    @staticmethod
    def check_arch(hf, where):
        mt = hf.get("model_type")
        if mt != "llama":
            fail("%s: unsupported model_type %r (only \"llama\" is supported)" % (where, mt))
        theta = hf.get("rope_theta", ROPE_THETA)
        if theta is None or float(theta) != ROPE_THETA:
            fail("%s: rope_theta %r is not supported (run.c uses 10000)" % (where, theta))
        if hf.get("rope_scaling") is not None:
            fail("%s: rope_scaling %r is not supported" % (where, hf.get("rope_scaling")))
        for k in ("attention_bias", "mlp_bias"):
            if hf.get(k):
                fail("%s: %s is true; biases are not supported by run.c" % (where, k))
        eps = hf.get("rms_norm_eps", 1e-6)  # LlamaConfig's default when absent
        if not _eps_ok(eps):
            fail("%s: rms_norm_eps %r is not supported (run.c uses 1e-5)" % (where, eps))
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            fail("%s: hidden_act %r is not supported (run.c uses SiLU)" % (where, act))

    def find_weights(self, d):
        files = sorted(os.listdir(d))
        st_index = os.path.join(d, "model.safetensors.index.json")
        pt_index = os.path.join(d, "pytorch_model.bin.index.json")
        if os.path.isfile(st_index):
            shards = self.index_shards(st_index)
            for s in shards:
                self.add_safetensors(os.path.join(d, s))
        elif os.path.isfile(os.path.join(d, "model.safetensors")):
            self.add_safetensors(os.path.join(d, "model.safetensors"))
        elif any(f.endswith(".safetensors") for f in files):
            for fn in files:
                if fn.endswith(".safetensors"):
                    self.add_safetensors(os.path.join(d, fn))
        elif os.path.isfile(pt_index):
            for s in self.index_shards(pt_index):
                self.add_torch(os.path.join(d, s))
        elif any(f.startswith("pytorch_model") and f.endswith(".bin") for f in files):
            for fn in files:
                if fn.startswith("pytorch_model") and fn.endswith(".bin"):
                    self.add_torch(os.path.join(d, fn))
        else:
            fail("%s: no model.safetensors, model.safetensors.index.json or pytorch_model*.bin" % d)

    def index_shards(self, path):
        try:
            with open(path, "r", encoding="utf-8") as f:
                idx = json.load(f)
            wm = idx["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            fail("%s: cannot parse index: %s" % (path, e))
        shards = sorted(set(wm.values()))
        for s in shards:
            if not os.path.isfile(os.path.join(os.path.dirname(path), s)):
                fail("%s: shard %s listed in the index is missing" % (path, s))
        return shards

    def add_safetensors(self, path):
        st = SafetensorsFile(path)
        for name in st.tensors:
            self.tensors[name] = (lambda st=st, name=name: st.load(name), st.tensors[name][1])

    def add_torch(self, path):
        sd = torch_load(path)
        if not isinstance(sd, dict):
            fail("%s: not a state dict" % path)
        for name, t in sd.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            self.tensors[name] = (lambda t=t: to_numpy(t), tuple(t.shape))

    def get(self, name, layer):
        if name == "cls" and self.cfg["shared"]:
            name = "tok_emb"
        hf_name = HF_NAMES[name] % layer if layer is not None else HF_NAMES[name]
        loader, shape = self.tensors[hf_name]
        want = expected_shape(self.cfg, name)
        if tuple(shape) != want:
            fail("tensor %s has shape %s, expected %s" % (hf_name, tuple(shape), want))
        w = loader()
        if name == "wq":
            w = unpermute_hf(w, self.cfg["n_heads"])
        elif name == "wk":
            w = unpermute_hf(w, self.cfg["n_kv_heads"])
        return w


# ---------------------------------------------------------------------------
# llama2.c / nanoGPT-style .pt checkpoints and Meta consolidated.*.pth

META_NAMES = {
    "tok_emb": "tok_embeddings.weight",
    "rms_final": "norm.weight",
    "cls": "output.weight",
    "rms_att": "layers.%d.attention_norm.weight",
    "wq": "layers.%d.attention.wq.weight",
    "wk": "layers.%d.attention.wk.weight",
    "wv": "layers.%d.attention.wv.weight",
    "wo": "layers.%d.attention.wo.weight",
    "rms_ffn": "layers.%d.ffn_norm.weight",
    "w1": "layers.%d.feed_forward.w1.weight",
    "w2": "layers.%d.feed_forward.w2.weight",
    "w3": "layers.%d.feed_forward.w3.weight",
}


def meta_key(name, layer):
    return META_NAMES[name] % layer if layer is not None else META_NAMES[name]


class StateDictSource:
    """Weights in Meta/llama2.c naming, adjacent-pair RoPE (no permutation).
    `parts` is a list of state dicts (one per model-parallel shard)."""

    def __init__(self, where, parts, args, seq_len):
        self.where = where
        self.parts = parts
        sd = parts[0]
        if "tok_embeddings.weight" not in sd:
            fail("%s: missing tensor tok_embeddings.weight" % where)
        for name in sd:
            if name.endswith(".bias"):
                fail("%s: tensor %s: bias tensors are not supported by run.c" % (where, name))
        n_layers = args.get("n_layers")
        n_heads = args.get("n_heads")
        n_kv = args.get("n_kv_heads") or n_heads
        emb = self.concat("tok_emb", None)
        vocab = args.get("vocab_size")
        if vocab is None or vocab <= 0:
            vocab = emb.shape[0]
        w1 = self.concat("w1", 0) if n_layers else None
        hidden = w1.shape[0] if w1 is not None and w1.ndim == 2 else args.get("hidden_dim")
        self.cfg = {
            "dim": args.get("dim"),
            "hidden_dim": hidden,
            "n_layers": n_layers,
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "vocab_size": vocab,
            "seq_len": seq_len,
        }
        check_config(self.cfg)
        if "output.weight" in sd:
            out = self.concat("cls", None)
            self.cfg["shared"] = out.shape == emb.shape and np.array_equal(out, emb)
        else:
            self.cfg["shared"] = True
        for key in LAYER_TENSORS:
            for l in range(n_layers):
                self.key_present(meta_key(key, l))
        self.key_present("norm.weight")

    def key_present(self, k):
        for p in self.parts:
            if k not in p:
                fail("%s: missing tensor %s" % (self.where, k))

    def concat(self, name, layer):
        k = meta_key(name, layer)
        self.key_present(k)
        arrs = [to_numpy(p[k]) for p in self.parts]
        if len(arrs) == 1 or name in ("rms_att", "rms_ffn", "rms_final"):
            return arrs[0]
        axis = 1 if name in ("tok_emb", "wo", "w2") else 0
        try:
            return np.concatenate(arrs, axis=axis)
        except ValueError:
            fail("%s: shards of %s have incompatible shapes %s" % (self.where, k, [a.shape for a in arrs]))

    def get(self, name, layer):
        if name == "cls" and self.cfg["shared"]:
            name = "tok_emb"
        return self.concat(name, layer)


def _eps_check(eps, where):
    if eps is not None and not _eps_ok(eps):
        fail("%s: norm_eps %r is not supported (run.c uses 1e-5)" % (where, eps))


def pt_source(path, opts):
    ck = torch_load(path)
    if not isinstance(ck, dict) or "model_args" not in ck or "model" not in ck:
        fail("%s: not a llama2.c-style checkpoint (needs 'model_args' and 'model')" % path)
    args = dict(ck["model_args"])
    _eps_check(args.get("norm_eps"), path)
    sd = {}
    for k, v in ck["model"].items():
        if k.startswith("_orig_mod."):
            k = k[len("_orig_mod."):]
        sd[k] = v
    seq = opts.seq_len or args.get("max_seq_len")
    return StateDictSource(path, [sd], args, seq)


def meta_source(d, opts):
    params_path = os.path.join(d, "params.json")
    try:
        with open(params_path, "r", encoding="utf-8") as f:
            params = json.load(f)
    except (OSError, ValueError) as e:
        fail("%s: cannot read params.json: %s" % (d, e))
    _eps_check(params.get("norm_eps"), params_path)
    theta = params.get("rope_theta", ROPE_THETA)
    if float(theta) != ROPE_THETA:
        fail("%s: rope_theta %r is not supported (run.c uses 10000)" % (params_path, theta))
    if params.get("use_scaled_rope"):
        fail("%s: scaled RoPE is not supported" % params_path)
    shards = sorted(fn for fn in os.listdir(d) if fn.startswith("consolidated.") and fn.endswith(".pth"))
    if not shards:
        fail("%s: no consolidated.*.pth files" % d)
    parts = [torch_load(os.path.join(d, s)) for s in shards]
    for s, p in zip(shards, parts):
        if not isinstance(p, dict):
            fail("%s: not a state dict" % os.path.join(d, s))
    seq = opts.seq_len or params.get("max_seq_len") or 2048
    return StateDictSource(d, parts, params, seq)


# ---------------------------------------------------------------------------
# random checkpoints

SHAPES = {
    # name: dim, hidden, layers, heads, kv_heads, vocab, seq, shared
    "stories15M": (288, 768, 6, 6, 6, 32000, 256, True),
    "stories42M": (512, 1376, 8, 8, 8, 32000, 1024, True),
    "stories110M": (768, 2048, 12, 12, 12, 32000, 1024, True),
    "tinyllama1b": (2048, 5632, 22, 32, 4, 32000, 2048, False),
}

RANDOM_IDS = {n: i for i, n in enumerate(("tok_emb", "cls", "rms_final") + LAYER_TENSORS)}


class RandomSource:
    def __init__(self, shape, seed, tied):
        if shape in SHAPES:
            vals = SHAPES[shape]
        else:
            name, eq, rest = shape.partition("=")
            try:
                nums = tuple(int(x) for x in rest.split(","))
            except ValueError:
                nums = ()
            if not eq or len(nums) != 7:
                fail("bad --shape %r: use one of %s or NAME=dim,hidden,layers,heads,kv_heads,vocab,seq"
                     % (shape, ", ".join(SHAPES)))
            vals = nums + (True,)
        keys = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "shared")
        self.cfg = dict(zip(keys, vals))
        if tied is not None:
            self.cfg["shared"] = tied
        self.seed = seed
        check_config(self.cfg)

    def get(self, name, layer):
        rng = np.random.default_rng([self.seed, RANDOM_IDS[name], 0 if layer is None else layer + 1])
        shape = expected_shape(self.cfg, name)
        w = rng.standard_normal(shape, dtype=np.float32)
        if name.startswith("rms"):
            w *= np.float32(0.1)
            w += np.float32(1.0)
        else:
            w *= np.float32(0.02)
        return w


# ---------------------------------------------------------------------------
# commands

def open_source(src, opts):
    if not os.path.exists(src):
        fail("%s: no such file or directory" % src)
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, "config.json")):
            return HFSource(src)
        if os.path.isfile(os.path.join(src, "params.json")):
            return meta_source(src, opts)
        fail("%s: directory has neither config.json (Hugging Face) nor params.json (Meta)" % src)
    with open(src, "rb") as f:
        head = f.read(8)
    # torch.save writes a zip archive (torch >= 1.6) or, in the legacy format,
    # starts with a pickled magic number (protocol 2, LONG1 of 10 bytes)
    if head[:4] == b"PK\x03\x04" or head[:3] == b"\x80\x02\x8a":
        return pt_source(src, opts)
    if src.endswith(".safetensors"):
        fail("%s: give the directory holding config.json, not the .safetensors file" % src)
    return RuncSource(src)


def cmd_model(args):
    src = open_source(args.src, args)
    if args.seq_len and isinstance(src, (HFSource, RuncSource)):
        src.cfg["seq_len"] = args.seq_len
    write_checkpoint(src, args.output, args.version, args.group_size)


def cmd_random(args):
    tied = True if args.tied else (False if args.untied else None)
    src = RandomSource(args.shape, args.seed, tied)
    write_checkpoint(src, args.output, args.version, args.group_size)


def tokenizer_entries(data):
    """Walk a tokenizer.bin; return (max_token_length, n_entries, max_seen) or None."""
    if len(data) < 4:
        return None
    max_len = struct.unpack("<i", data[:4])[0]
    if max_len <= 0 or max_len > 1 << 16:
        return None
    pos, n, seen = 4, 0, 0
    while pos < len(data):
        if pos + 8 > len(data):
            return None
        _score, ln = struct.unpack("<fi", data[pos:pos + 8])
        if ln < 0 or ln > max_len or pos + 8 + ln > len(data):
            return None
        seen = max(seen, ln)
        pos += 8 + ln
        n += 1
    return max_len, n, seen


def cmd_info(args):
    path = args.file
    if not os.path.isfile(path):
        fail("%s: no such file" % path)
    err = None
    try:
        cfg, info = read_runc_header(path)
    except ExportError as e:
        cfg, err = None, str(e)
    if cfg is not None and (info["size"] == info["expected_size"] or info["version"] > 0):
        v = info["version"]
        names = {0: "legacy llama2.c (float32)", 1: "ak42 version 1 (float32)", 2: "ak42 version 2 (int8 Q8_0)"}
        print("%s: run.c checkpoint, %s" % (path, names[v]))
        for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            print("  %-18s %d" % (k, cfg[k]))
        print("  %-18s %d" % ("head_size", cfg["dim"] // cfg["n_heads"]))
        print("  %-18s %s" % ("classifier", "shared with embedding" if cfg["shared"] else "separate"))
        if v == 2:
            print("  %-18s %d" % ("group_size", info["group_size"]))
        nparams = (2 * cfg["n_layers"] + 1) * cfg["dim"]
        for name, _l in _tensor_list(cfg, v):
            nparams += int(np.prod(expected_shape(cfg, name)))
        print("  %-18s %d" % ("parameters", nparams))
        print("  %-18s %d" % ("file bytes", info["size"]))
        if info["size"] != info["expected_size"]:
            print("  WARNING: header implies %d bytes; file is %s"
                  % (info["expected_size"], "truncated" if info["size"] < info["expected_size"] else "longer"))
        return
    with open(path, "rb") as f:
        data = f.read()
    tok = tokenizer_entries(data)
    if tok is not None:
        max_len, n, seen = tok
        print("%s: llama2.c tokenizer" % path)
        print("  %-18s %d" % ("max_token_length", max_len))
        print("  %-18s %d" % ("entries", n))
        print("  %-18s %d" % ("longest entry", seen))
        if n > 2:
            pieces = []
            pos = 4
            for _ in range(min(n, 3)):
                _s, ln = struct.unpack("<fi", data[pos:pos + 8])
                pieces.append(data[pos + 8:pos + 8 + ln])
                pos += 8 + ln
            print("  %-18s %s" % ("first pieces", ", ".join(repr(p.decode("utf-8", "replace")) for p in pieces)))
        return
    if cfg is not None:
        fail("%s: file is %d bytes but a legacy checkpoint with this header would be %d (truncated?)"
             % (path, info["size"], info["expected_size"]))
    fail(err or "%s: neither a run.c checkpoint nor a tokenizer.bin" % path)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # one line, exit status 1, like every other error of this tool
        print("export.py: error: %s (see export.py --help)" % message, file=sys.stderr)
        sys.exit(1)


def build_parser():
    p = Parser(prog="export.py", description=__doc__.split("\n", 1)[0],
               epilog=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True

    t = sub.add_parser("tokenizer", help="SentencePiece tokenizer.model -> tokenizer.bin")
    t.add_argument("input", metavar="IN.model")
    t.add_argument("output", metavar="OUT.bin")
    t.set_defaults(func=cmd_tokenizer)

    def out_opts(sp):
        sp.add_argument("--version", type=int, choices=(0, 1, 2), default=0,
                        help="output format: 0 legacy float32 (default), 1 ak42 float32, 2 ak42 int8")
        sp.add_argument("--group-size", type=int, default=64,
                        help="int8 group size for version 2 (default 64; halved until it divides dim and hidden_dim)")

    m = sub.add_parser("model", help="convert a model to a run.c checkpoint")
    m.add_argument("src", metavar="SRC", help="HF dir, Meta dir, llama2.c .pt, or run.c checkpoint")
    m.add_argument("output", metavar="OUT.bin")
    out_opts(m)
    m.add_argument("--seq-len", type=int, default=None, help="override the context length written in the header")
    m.set_defaults(func=cmd_model)

    r = sub.add_parser("random", help="deterministic random-weight checkpoint")
    r.add_argument("output", metavar="OUT.bin")
    r.add_argument("--shape", required=True,
                   help="%s or NAME=dim,hidden,layers,heads,kv_heads,vocab,seq" % "|".join(SHAPES))
    r.add_argument("--seed", type=int, default=0)
    g = r.add_mutually_exclusive_group()
    g.add_argument("--tied", action="store_true", help="share the classifier with the embedding")
    g.add_argument("--untied", action="store_true", help="write a separate classifier")
    out_opts(r)
    r.set_defaults(func=cmd_random)

    i = sub.add_parser("info", help="print the header of a checkpoint or tokenizer.bin")
    i.add_argument("file", metavar="FILE")
    i.set_defaults(func=cmd_info)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ExportError as e:
        print("export.py: error: %s" % e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("export.py: error: interrupted", file=sys.stderr)
        return 1
    except MemoryError:
        print("export.py: error: out of memory", file=sys.stderr)
        return 1
    except OSError as e:
        print("export.py: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
