#!/usr/bin/env python3
"""export.py - make checkpoints and tokenizers for run.c.

Subcommands:
  tokenizer IN.model OUT.bin
      SentencePiece tokenizer.model -> llama2.c tokenizer.bin
  tokenizer tokenizer.json OUT.bin
      Hugging Face byte-level BPE (Llama 3) -> "tk42" tokenizer file; BOS, end
      tokens and the chat template family from tokenizer_config.json (and
      generation_config.json) beside it
  model SRC OUT.bin [--version 0|1|2|3|4] [--encoding E] [--group-size N] [--seq-len N]
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
per-group float32 scales, 3 = 4-bit values with per-group float32 scales.

Version 3 layout: the version 2 header (group size at byte 37) and order
(norms in float32, then each matrix's values followed by its scales, one
float32 per group of group_size consecutive values of a row). Values q in
-8..7, value = q * scale, are stored as q + 8 in 0..15, two per byte: byte k
of a matrix holds value 2k in its low nibble and value 2k + 1 in its high
nibble. The group size is even and divides dim and hidden_dim. Quantisation
(as GGML's Q4_0): per group, m = the value of largest magnitude (its sign
kept), scale = m / -8, q = round-half-to-even(x / scale) clamped to -8..7
(so m itself becomes exactly -8 * scale); an all-zero group has scale 0, q 0.

`tokenizer` and `info` need only Python's standard library; `model` and
`random` also numpy; torch is imported only to read PyTorch pickles (.pt,
.pth, pytorch_model.bin).
"""

import argparse
import json
import math
import os
import struct
import sys
import tempfile
import time

# numpy, imported by need_numpy() for the commands that write checkpoints:
# the tokenizer needs nothing but the standard library
np = None

MAGIC = 0x616B3432  # "ak42"
HEADER_BYTES = 256
ROPE_THETA = 10000.0
NORM_EPS = 1e-5


class ExportError(Exception):
    """An error reported to the user as one line, exit status 1."""


def fail(msg):
    raise ExportError(msg)


def need_numpy(what):
    """Import numpy for `what`, or fail with one line saying how to get it."""
    global np
    if np is None:
        try:
            import numpy
        except ImportError:
            fail("%s needs numpy (apt-get install python3-numpy / pip install numpy)" % what)
        np = numpy
    return np


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


# ---------------------------------------------------------------------------
# tokenizer: a Hugging Face tokenizer.json with a byte-level BPE model
#
# The "tk42" tokenizer file (all integers int32 little-endian):
#   "tk42", format version 1
#   vocab_size, n_merges, max_token_length, bos, end_of_turn, chat template
#   (0 llama2, 1 llama3), pre-tokenizer (1: Llama 3 split), n_end, end[n_end]
#   per token: flags (1 = special: never produced from plain text), length,
#     the token's raw bytes (byte-level BPE's printable alphabet undone)
#   per merge, by rank: left id, right id, merged id
#   n_letter, (first, last) code point ranges of \p{L}; n_number, \p{N} ranges
# llama2.c's tokenizer.bin starts with max_token_length, a small positive
# int32; "tk42" read as an int32 is 842230644, far above any max_token_length
# run.c accepts (2^20), so the two cannot be confused.

TK42_MAGIC = b"tk42"
TK42_VERSION = 1
# the split pattern of Llama 3's pre-tokenizer, the only one run.c implements
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def gpt2_byte_alphabet():
    """GPT-2's map from the 256 bytes to printable characters, inverted:
    character -> byte. Printable Latin-1 bytes stand for themselves; the
    others take the characters from U+0100 on, in byte order."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(0x100 + extra)] = b
            extra += 1
    return chars


def unicode_ranges(category_prefix):
    """(first, last) ranges of the code points whose general category starts
    with category_prefix ("L" letters, "N" numbers), from Python's tables."""
    import unicodedata
    ranges, start = [], None
    for cp in range(0x110000 + 1):
        inside = cp < 0x110000 and unicodedata.category(chr(cp)).startswith(category_prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            ranges.append((start, cp - 1))
            start = None
    return ranges


def _read_json(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail("%s: cannot read JSON: %s" % (path, e))


def _split_pattern(pre):
    """The Split regex of a pre_tokenizer (alone or in a Sequence), or None."""
    items = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for p in items:
        if isinstance(p, dict) and p.get("type") == "Split":
            pat = p.get("pattern") or {}
            return pat.get("Regex") if isinstance(pat, dict) else None
    return None


def _token_text(value):
    """A special token named in tokenizer_config.json: a string or an
    AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def cmd_tokenizer_json(args):
    path = args.input
    tj = _read_json(path)
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict):
        fail("%s: no \"model\" object (not a Hugging Face tokenizer.json)" % path)
    mtype = model.get("type")
    if mtype != "BPE":
        fail("%s: model type %r is not supported (only byte-level BPE)" % (path, mtype))
    pre = tj.get("pre_tokenizer") or {}
    pattern = _split_pattern(pre) if isinstance(pre, dict) else None
    if pattern != LLAMA3_SPLIT:
        fail("%s: pre-tokenizer split %r is not supported (only Llama 3's pattern)" % (path, pattern))
    if model.get("byte_fallback") or tj.get("normalizer"):
        fail("%s: a normalizer or byte fallback is not supported (not a byte-level BPE like Llama 3)" % path)
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        fail("%s: model has no vocab object or merges list" % path)
    alphabet = gpt2_byte_alphabet()
    n = 0
    pieces = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or i < 0:
            fail("%s: token %r has id %r" % (path, text, i))
        try:
            pieces[i] = (0, bytes(alphabet[c] for c in text))
        except KeyError as e:
            fail("%s: token %r has the character %r outside the byte-level alphabet" % (path, text, e.args[0]))
    for added in tj.get("added_tokens") or []:
        i, text = added.get("id"), added.get("content")
        if not isinstance(i, int) or i < 0 or not isinstance(text, str):
            fail("%s: bad added token %r" % (path, added))
        pieces[i] = (1, text.encode("utf-8"))
    n = max(pieces) + 1
    missing = [i for i in range(n) if i not in pieces]
    if missing:
        fail("%s: token ids are not contiguous: no token %d" % (path, missing[0]))
    ids = {}
    for i in range(n):
        if pieces[i][0] == 0:
            ids[pieces[i][1]] = i
    for b in range(256):
        if bytes([b]) not in ids:
            fail("%s: no token for the byte 0x%02X (not a byte-level BPE)" % (path, b))
    merge_ids = []
    for rank, m in enumerate(merges):
        pair = m.split(" ") if isinstance(m, str) else m
        if not isinstance(pair, list) or len(pair) != 2:
            fail("%s: merge %d is %r, not a pair" % (path, rank, m))
        try:
            left, right = (bytes(alphabet[c] for c in p) for p in pair)
        except (KeyError, TypeError):
            fail("%s: merge %d (%r) names a character outside the byte-level alphabet" % (path, rank, m))
        for part in (left, right, left + right):
            if part not in ids:
                fail("%s: merge %d (%r) names an unknown token" % (path, rank, m))
        merge_ids.append((ids[left], ids[right], ids[left + right]))

    # BOS, ends and the chat template from tokenizer_config.json beside it
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    by_text = {pieces[i][1].decode("utf-8", "replace"): i for i in range(n) if pieces[i][0] == 1}

    def special(name, text):
        if text not in by_text:
            fail("%s: %s %r is not a special token of %s" % (cfg_path, name, text, path))
        return by_text[text]

    bos_text, eos_text = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if bos_text is None or eos_text is None:
        fail("%s: needs bos_token and eos_token (from tokenizer_config.json beside %s)" % (cfg_path, path))
    bos, eos = special("bos_token", bos_text), special("eos_token", eos_text)
    template = cfg.get("chat_template") or ""
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    family = 1 if "<|start_header_id|>" in template else 0
    ends, end_of_turn = [eos], eos
    if family == 1:
        end_of_turn = special("end-of-turn token", "<|eot_id|>")
    # generation_config.json, when present, lists every token that ends a reply
    gen_path = os.path.join(os.path.dirname(os.path.abspath(path)), "generation_config.json")
    more = _read_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
    for i in ([end_of_turn] + (more if isinstance(more, list) else [more] if isinstance(more, int) else [])):
        if not isinstance(i, int) or not 0 <= i < n:
            fail("%s: end token %r is not a token id" % (gen_path, i))
        if i not in ends:
            ends.append(i)
    if len(ends) > 8:
        fail("%s: %d end tokens; run.c keeps at most 8" % (path, len(ends)))

    letters, numbers = unicode_ranges("L"), unicode_ranges("N")
    max_len = max(len(pieces[i][1]) for i in range(n))
    out = [TK42_MAGIC, struct.pack("<8i", TK42_VERSION, n, len(merge_ids), max_len, bos, end_of_turn, family, 1)]
    out.append(struct.pack("<%di" % (1 + len(ends)), len(ends), *ends))
    for i in range(n):
        flags, data = pieces[i]
        out.append(struct.pack("<ii", flags, len(data)))
        out.append(data)
    out.append(b"".join(struct.pack("<3i", *m) for m in merge_ids))
    for ranges in (letters, numbers):
        out.append(struct.pack("<i", len(ranges)))
        out.append(b"".join(struct.pack("<2i", a, b) for a, b in ranges))
    with atomic_output(args.output) as f:
        f.write(b"".join(out))
    names = ", ".join(pieces[i][1].decode("utf-8", "replace") for i in ends)
    print("wrote %s: byte-level BPE, %d tokens, %d merges, BOS %d, end tokens %s, %s chat template"
          % (args.output, n, len(merge_ids), bos, names, ("llama2", "llama3")[family]))


def cmd_tokenizer(args):
    if args.input.endswith(".json"):
        return cmd_tokenizer_json(args)
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


class Progress:
    """Tensors done of the total, bytes written and the rate, on one stderr
    line rewritten in place while a checkpoint is written; only when stderr
    is a terminal (a log or a pipe gets nothing)."""

    current = None  # the checkpoint being written, for fetch()

    def __init__(self, f, total):
        self.f, self.total, self.started = f, total, 0
        self.start = time.monotonic()
        self.shown = sys.stderr.isatty()

    def show(self, done):
        if not self.shown:
            return
        written = self.f.tell()
        rate = written / max(time.monotonic() - self.start, 1e-6)
        sys.stderr.write("\rexport.py: %d of %d tensors, %.1f MB written, %.1f MB/s "
                         % (done, self.total, written / 1e6, rate / 1e6))
        sys.stderr.flush()

    def tensor_started(self):
        self.show(self.started)  # those before it are written
        self.started += 1

    def finish(self, complete):
        if complete:
            self.show(self.started)
        if self.shown and self.started:
            sys.stderr.write("\n")


def fetch(src, name, layer=None):
    """Get a tensor from a source, as contiguous float32 of the right shape."""
    if Progress.current is not None:
        Progress.current.tensor_started()
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
    if version in (2, 3):
        h += struct.pack("<i", group_size)
    return h + b"\0" * (HEADER_BYTES - len(h))


def write_v1(src, f, header=None):
    cfg = src.cfg
    L = cfg["n_layers"]
    f.write(header or versioned_header(cfg, 1))
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


def quantize_q4(w, gs):
    """4-bit quantisation in groups of gs consecutive values (see the module
    doc). Returns (packed uint8 bytes, float32 scales, max abs error)."""
    g = w.reshape(-1, gs).astype(np.float32)
    idx = np.abs(g).argmax(axis=1) if g.size else np.zeros(0, dtype=np.int64)
    m = g[np.arange(g.shape[0]), idx]
    scale = (m / np.float32(-8.0)).astype(np.float32)
    safe = np.where(scale != 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.round(g / safe[:, None]), -8, 7).astype(np.int16)
    q[scale == 0] = 0
    err = float(np.abs(q.astype(np.float32) * scale[:, None] - g).max()) if g.size else 0.0
    u = (q.reshape(-1) + 8).astype(np.uint8)
    packed = (u[0::2] | (u[1::2] << 4)).astype(np.uint8)
    return packed, scale, err


def write_v2(src, f, group_size, version=2, header=None):
    """Version 2 (int8) or, with version=3, 4-bit matrices; `header`, when
    given, writes the header for the chosen group size (version 4)."""
    cfg = src.cfg
    L = cfg["n_layers"]
    gs = choose_group_size(cfg, group_size)
    if version == 3 and gs % 2:
        fail("group size %d is odd: 4-bit values are stored in pairs" % gs)
    if gs != group_size:
        print("group size %d does not divide dim %d and hidden_dim %d; using %d"
              % (group_size, cfg["dim"], cfg["hidden_dim"], gs), file=sys.stderr)
    f.write(header(gs) if header else versioned_header(cfg, version, gs))
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
        quantize = quantize_q4 if version == 3 else quantize_q80
        q, s, err = quantize(fetch(src, name, l), gs)
        f.write(q.tobytes())
        f.write(s.tobytes())
        if err >= worst[0]:
            worst = (err, name if l is None else "%s[%d]" % (name, l))
    return "group size %d; largest quantisation error %.6g (in %s)" % (gs, worst[0], worst[1])


# Version 4: the "ak42" header of versions 1 and 2 plus, after the shared
# classifier byte at 36: int32 weight encoding at 40 (0 float32, 1 int8 Q8_0,
# 2 4-bit: reserved), int32 group size at 44 (0 for float32), float32
# norm_eps at 48, float32 rope_theta at 52, int32 rope scaling at 56 (0 none,
# 1 llama3), float32 factor, low_freq_factor, high_freq_factor at 60, 64, 68,
# int32 original_max_position_embeddings at 72. Arrays as in version 1 or 2.
ENCODINGS = {"float32": 0, "int8": 1, "q4": 2}


def header_v4(cfg, encoding, group_size):
    h = struct.pack("<Ii", MAGIC, 4) + header_ints(cfg, cfg["vocab_size"])
    h += struct.pack("<B", 1 if cfg["shared"] else 0) + b"\0\0\0"
    sc = cfg.get("rope_scaling")
    h += struct.pack("<iiffi", encoding, group_size, cfg.get("norm_eps", NORM_EPS),
                     cfg.get("rope_theta", ROPE_THETA), 1 if sc else 0)
    h += struct.pack("<fffi", *((sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                                 sc["original_max_position_embeddings"]) if sc else (0, 0, 0, 0)))
    return h + b"\0" * (HEADER_BYTES - len(h))


def needs_v4(cfg):
    """Why cfg cannot be written as version 0 to 2, or None."""
    if cfg.get("rope_theta", ROPE_THETA) != ROPE_THETA:
        return "rope_theta %r" % cfg["rope_theta"]
    if cfg.get("rope_scaling"):
        return "llama3 rope_scaling"
    if not _eps_ok(cfg.get("norm_eps", NORM_EPS)):
        return "rms_norm_eps %r" % cfg["norm_eps"]
    return None


def write_checkpoint(src, out, version, group_size, encoding="float32"):
    check_config(src.cfg)
    why = needs_v4(src.cfg)
    if why and version != 4:
        fail("%s needs checkpoint version 4 (versions 0 to 3 have RoPE base 10000 and eps 1e-5): add --version 4"
             % why)
    if version == 4 and encoding == "q4":
        fail("--encoding q4: 4-bit weights with version 4 headers are not written by this export.py (use --version 3)")
    # every layout fetches tok_emb, rms_final, 9 tensors per layer and the classifier
    tensors = 9 * src.cfg["n_layers"] + 2 + (0 if src.cfg["shared"] else 1)
    with atomic_output(out) as f:
        Progress.current = Progress(f, tensors)
        complete, summary = False, None
        try:
            if version == 0:
                write_v0(src, f)
            elif version == 1:
                write_v1(src, f)
            elif version == 2:
                summary = write_v2(src, f, 64 if group_size is None else group_size)
            elif version == 3:
                summary = write_v2(src, f, 32 if group_size is None else group_size, version=3)
            elif version == 4 and encoding == "float32":
                write_v1(src, f, header_v4(src.cfg, 0, 0))
            elif version == 4:
                summary = write_v2(src, f, 64 if group_size is None else group_size,
                                   header=lambda gs: header_v4(src.cfg, 1, gs))
            else:
                fail("unknown output version %r (want 0, 1, 2, 3 or 4)" % version)
            complete = True
        finally:
            Progress.current.finish(complete)
            Progress.current = None
    if summary:
        print(summary)
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
        gs = struct.unpack("<i", head[37:41])[0] if version in (2, 3) else None
        if version not in (1, 2, 3, 4):
            fail("%s: unsupported checkpoint version %d" % (path, version))
        offset = HEADER_BYTES
        extra = {}
        layout = version
        if version == 4:  # see header_v4
            encoding, gs, eps, theta, scaling = struct.unpack("<iiffi", head[40:60])
            factor, low, high, ctx = struct.unpack("<fffi", head[60:76])
            if encoding not in (0, 1):
                fail("%s: weight encoding %d is not readable here (0 float32, 1 int8)" % (path, encoding))
            layout, gs = (2, gs) if encoding == 1 else (1, None)
            extra = {"norm_eps": eps, "rope_theta": theta, "rope_scaling": None if not scaling else {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": ctx}}
    else:
        version = 0
        vals = struct.unpack("<7i", head[:28])
        shared = vals[5] > 0
        vals = vals[:5] + (abs(vals[5]),) + vals[6:]
        gs = None
        offset = 28
        extra = {}
        layout = 0
    keys = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
    cfg = dict(zip(keys, vals))
    cfg["shared"] = bool(shared)
    cfg.update(extra)
    for k in keys:
        if cfg[k] <= 0:
            fail("%s: not a run.c checkpoint (%s = %d)" % (path, k, cfg[k]))
    check_config(cfg)
    info = {"version": version, "layout": layout, "group_size": gs, "offset": offset, "size": size}
    if layout in (2, 3) and (gs is None or gs <= 0 or cfg["dim"] % gs or cfg["hidden_dim"] % gs
                             or (layout == 3 and gs % 2)):
        fail("%s: bad group size %r" % (path, gs))
    info["expected_size"] = offset + payload_bytes(cfg, layout, gs)
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
        cnt = math.prod(expected_shape(cfg, name))
        if version == 2:
            n += cnt + cnt // gs * 4
        elif version == 3:
            n += cnt // 2 + cnt // gs * 4
        else:
            n += cnt * 4
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
        version = info["layout"]  # 0, 1 (float32) or 2 (int8)

        def count(name):
            return math.prod(expected_shape(cfg, name))

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
                elif version == 2:
                    self.index[key] = ("q8", off)
                    off += n + n // gs * 4
                else:
                    self.index[key] = ("q4", off)
                    off += n // 2 + n // gs * 4

    def get(self, name, layer):
        if name == "cls" and self.cfg["shared"]:
            name = "tok_emb"
        kind, off = self.index[(name, layer)]
        shape = expected_shape(self.cfg, name)
        n = int(np.prod(shape))
        if kind == "f32":
            return self.mm[off:off + n * 4].view(np.float32).reshape(shape)
        gs = self.info["group_size"]
        if kind == "q4":
            packed = self.mm[off:off + n // 2]
            q = np.empty(n, dtype=np.float32)
            q[0::2] = (packed & 15).astype(np.float32) - 8
            q[1::2] = (packed >> 4).astype(np.float32) - 8
            s = self.mm[off + n // 2:off + n // 2 + n // gs * 4].view(np.float32)
            return (q.reshape(-1, gs) * s[:, None]).reshape(shape)
        q = self.mm[off:off + n].view(np.int8).astype(np.float32)
        s = self.mm[off + n:off + n + n // gs * 4].view(np.float32)
        return (q.reshape(-1, gs) * s[:, None]).reshape(shape)


# ---------------------------------------------------------------------------
# safetensors (read directly, no package)

# safetensors dtype -> (numpy dtype name, bytes per value)
ST_DTYPES = {"F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("uint16", 2), "F64": ("float64", 8)}


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
                nbytes = math.prod(shape) * ST_DTYPES[dtype][1]
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
        npdt = np.dtype(ST_DTYPES[dtype][0])
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
            fail("%s: head_dim %r != hidden_size / num_attention_heads; run.c supports only head_dim = "
                 "hidden_size / num_attention_heads" % (cfg_path, hf.get("head_dim")))
        self.cfg = {
            "dim": dim,
            "hidden_dim": hf.get("intermediate_size"),
            "n_layers": hf.get("num_hidden_layers"),
            "n_heads": n_heads,
            "n_kv_heads": n_kv,
            "vocab_size": hf.get("vocab_size"),
            "seq_len": hf.get("max_position_embeddings"),
            "rope_theta": float(hf.get("rope_theta", ROPE_THETA)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_scaling": hf.get("rope_scaling"),
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
        if not isinstance(theta, (int, float)) or not 0 < theta < 3.4e38:
            fail("%s: rope_theta %r must be a positive number" % (where, theta))
        sc = hf.get("rope_scaling")
        if sc is not None:
            kind = sc.get("rope_type", sc.get("type")) if isinstance(sc, dict) else None
            if kind != "llama3":
                fail("%s: rope_scaling of type %r is not supported (only \"llama3\")" % (where, kind))
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if any(not isinstance(sc.get(k), (int, float)) or sc.get(k) <= 0 for k in keys):
                fail("%s: llama3 rope_scaling needs positive %s, got %r" % (where, ", ".join(keys), sc))
            if sc["high_freq_factor"] <= sc["low_freq_factor"]:
                fail("%s: llama3 rope_scaling needs high_freq_factor > low_freq_factor, got %r" % (where, sc))
        for k in ("attention_bias", "mlp_bias"):
            if hf.get(k):
                fail("%s: %s is true; biases are not supported by run.c" % (where, k))
        eps = hf.get("rms_norm_eps", 1e-6)  # LlamaConfig's default when absent
        if not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            fail("%s: rms_norm_eps %r must be in [0, 1)" % (where, eps))
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
    "llama32_1b": (2048, 8192, 16, 32, 8, 128256, 2048, True),
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
    need_numpy("export.py model")
    src = open_source(args.src, args)
    if args.seq_len and isinstance(src, (HFSource, RuncSource)):
        src.cfg["seq_len"] = args.seq_len
    write_checkpoint(src, args.output, args.version, args.group_size, args.encoding)


def cmd_random(args):
    need_numpy("export.py random")
    tied = True if args.tied else (False if args.untied else None)
    src = RandomSource(args.shape, args.seed, tied)
    write_checkpoint(src, args.output, args.version, args.group_size, args.encoding)


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
        names = {0: "legacy llama2.c (float32)", 1: "ak42 version 1 (float32)", 2: "ak42 version 2 (int8 Q8_0)",
                 3: "ak42 version 3 (4-bit)",
                 4: "ak42 version 4 (%s)" % ("int8 Q8_0" if info["layout"] == 2 else "float32")}
        print("%s: run.c checkpoint, %s" % (path, names[v]))
        for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            print("  %-18s %d" % (k, cfg[k]))
        print("  %-18s %d" % ("head_size", cfg["dim"] // cfg["n_heads"]))
        print("  %-18s %s" % ("classifier", "shared with embedding" if cfg["shared"] else "separate"))
        if info["layout"] in (2, 3):
            print("  %-18s %d" % ("group_size", info["group_size"]))
        if v == 4:
            print("  %-18s %g" % ("norm_eps", cfg["norm_eps"]))
            print("  %-18s %g" % ("rope_theta", cfg["rope_theta"]))
            sc = cfg["rope_scaling"]
            print("  %-18s %s" % ("rope_scaling", "none" if not sc else
                                  "llama3, factor %g, low_freq_factor %g, high_freq_factor %g, original context %d"
                                  % (sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"],
                                     sc["original_max_position_embeddings"])))
        nparams = (2 * cfg["n_layers"] + 1) * cfg["dim"]
        for name, _l in _tensor_list(cfg, info["layout"]):
            nparams += math.prod(expected_shape(cfg, name))
        print("  %-18s %d" % ("parameters", nparams))
        print("  %-18s %d" % ("file bytes", info["size"]))
        if info["size"] != info["expected_size"]:
            print("  WARNING: header implies %d bytes; file is %s"
                  % (info["expected_size"], "truncated" if info["size"] < info["expected_size"] else "longer"))
        return
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] == TK42_MAGIC and len(data) >= 36:
        version, n, n_merges, max_len, bos, eot, family, _pre = struct.unpack("<8i", data[4:36])
        print("%s: byte-level BPE tokenizer (tk42 version %d)" % (path, version))
        for k, v in (("vocab_size", n), ("merges", n_merges), ("max_token_length", max_len), ("bos", bos),
                     ("end_of_turn", eot), ("chat template", ("llama2", "llama3")[family] if family in (0, 1) else family)):
            print("  %-18s %s" % (k, v))
        return
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

    t = sub.add_parser("tokenizer", help="tokenizer.model or tokenizer.json -> run.c tokenizer file")
    t.add_argument("input", metavar="IN.model|tokenizer.json")
    t.add_argument("output", metavar="OUT.bin")
    t.set_defaults(func=cmd_tokenizer)

    def out_opts(sp):
        sp.add_argument("--version", type=int, choices=(0, 1, 2, 3, 4), default=0,
                        help="output format: 0 legacy float32 (default), 1 ak42 float32, 2 ak42 int8, 3 ak42 4-bit, "
                             "4 ak42 with RoPE theta/scaling and norm eps (weights as --encoding)")
        sp.add_argument("--encoding", choices=tuple(ENCODINGS), default="float32",
                        help="version 4 weights: float32 (default), int8 (Q8_0, --group-size), q4 (reserved)")
        sp.add_argument("--group-size", type=int, default=None,
                        help="group size for versions 2, 3 and 4 int8 (default 64 for int8, 32 for version 3; "
                             "halved until it divides dim and hidden_dim)")

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
