#!/usr/bin/env python3
"""export.py - make checkpoints and tokenizers for run.c.

Subcommands:
  tokenizer IN.model OUT.bin
      SentencePiece tokenizer.model -> llama2.c tokenizer.bin
  tokenizer tokenizer.json OUT.bin
      Hugging Face byte-level BPE (Llama 3) -> "tk42" tokenizer file; BOS, end
      tokens and the chat template family from tokenizer_config.json (and
      generation_config.json) beside it
  tokenizer tokenizer.model|tokenizer.json|tokenizer.bin OUT.gguf
      a vocabulary-only GGUF (as llama.cpp's models/ggml-vocab-*.gguf)
  model SRC OUT.bin [--version 0|1|2|3|4] [--encoding E] [--group-size N] [--seq-len N]
      SRC is a Hugging Face Llama directory (safetensors, sharded safetensors
      or pytorch_model*.bin), a llama2.c/nanoGPT-style .pt checkpoint, a Meta
      consolidated.*.pth directory with params.json, or an existing run.c
      checkpoint (any version; converts between versions). Without
      --version: 4 when the model needs it (RoPE theta, llama3 scaling, norm
      eps other than llama2.c's) or --encoding is given, else 0.
  model SRC OUT.gguf [--encoding f32|f16|bf16|q8_0|q4_0] [--tokenizer FILE] [--seq-len N]
      GGUF (llama.cpp's format, version 3): architecture "llama" (Llama,
      Mistral, TinyLlama, SmolLM2; Q and K permuted to adjacent RoPE pairs as
      llama.cpp's converter does) or "qwen2" (Qwen2/2.5: q/k/v biases, HF's
      layout); norms and biases float32, other weights as --encoding
      (default f16). The vocabulary from the HF directory's tokenizer.model
      or tokenizer.json, or from --tokenizer FILE.
  random OUT.bin|OUT.gguf --shape SHAPE --seed N [--version V]
      deterministic random-weight checkpoint (for tests and benchmarks)
  info FILE
      print the header of a run.c checkpoint (any version) or a tokenizer.bin

Output versions: 0 = legacy llama2.c float32 (readable by every llama2.c-style
runner), 1 = float32 "ak42" header, 2 = int8 "Q8_0" with per-group float32
scales, 3 = 4-bit values with per-group float32 scales, 4 = the "ak42"
header with RoPE theta and scaling and the norm eps, weights as --encoding:
float32, int8 (version 2's layout) or q4 (version 3's).

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
    if args.output.lower().endswith(".gguf"):
        return cmd_tokenizer_gguf(args)
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
# 2 4-bit as version 3), int32 group size at 44 (0 for float32), float32
# norm_eps at 48, float32 rope_theta at 52, int32 rope scaling at 56 (0 none,
# 1 llama3), float32 factor, low_freq_factor, high_freq_factor at 60, 64, 68,
# int32 original_max_position_embeddings at 72. Arrays as in version 1, 2
# or (encoding 2) 3.
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


def choose_version(cfg, version, encoding):
    """The checkpoint version: as asked, else 4 when the model needs it (or
    an --encoding asks for it: only version 4 names one), else 0."""
    why = needs_v4(cfg)
    if version is None:
        if why or encoding is not None:
            print("writing version 4 (%s)" % ("needed for " + why if why else "--encoding " + encoding),
                  file=sys.stderr)
            return 4
        return 0
    if why and version != 4:
        fail("%s needs checkpoint version 4 (versions 0 to 3 have RoPE base 10000 and eps 1e-5): "
             "leave out --version, or give --version 4" % why)
    if encoding is not None and version != 4:
        fail("--encoding is for version 4 (--version %d fixes the weights' format)" % version)
    return version


def write_checkpoint(src, out, version, group_size, encoding=None):
    check_config(src.cfg)
    if src.cfg.get("arch", "llama") != "llama":
        fail("a %s model is written only as GGUF (name the output .gguf): run.c checkpoints have no biases "
             "and rotate adjacent RoPE pairs" % src.cfg["arch"])
    if encoding not in (None,) + tuple(ENCODINGS):
        fail("--encoding %s is for GGUF output; a .bin checkpoint takes %s" % (encoding, ", ".join(ENCODINGS)))
    version = choose_version(src.cfg, version, encoding)
    encoding = encoding or "float32"
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
            elif version == 4 and encoding == "q4":  # version 3's layout under a version 4 header
                summary = write_v2(src, f, 32 if group_size is None else group_size, version=3,
                                   header=lambda gs: header_v4(src.cfg, ENCODINGS["q4"], gs))
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
    print("wrote %s: version %d%s, dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
          "vocab_size %d, seq_len %d, %s classifier"
          % (out, version, " (%s)" % encoding if version == 4 else "", c["dim"], c["hidden_dim"], c["n_layers"], c["n_heads"], c["n_kv_heads"],
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
            if encoding not in (0, 1, 2):
                fail("%s: unknown weight encoding %d (0 float32, 1 int8, 2 4-bit)" % (path, encoding))
            layout, gs = {0: (1, None), 1: (2, gs), 2: (3, gs)}[encoding]
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
        version = info["layout"]  # 0, 1 (float32), 2 (int8) or 3 (4-bit)

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


HF_BIASES = {
    "wq": "model.layers.%d.self_attn.q_proj.bias",
    "wk": "model.layers.%d.self_attn.k_proj.bias",
    "wv": "model.layers.%d.self_attn.v_proj.bias",
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
        arch = self.check_arch(hf, cfg_path)
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
            "arch": arch,
        }
        check_config(self.cfg)
        self.dir = d
        self.tensors = {}  # name -> loader callable
        self.find_weights(d)
        # qwen2 has q, k and v biases (GGUF only); any other bias is refused
        allowed = HF_BIASES.values() if arch == "qwen2" else ()
        for name in self.tensors:
            if name.endswith(".bias") and not any(name == b % l for b in allowed for l in range(self.cfg["n_layers"])):
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
        for key in (HF_BIASES if arch == "qwen2" else ()):
            need += [HF_BIASES[key] % l for l in range(self.cfg["n_layers"])]
        missing = [n for n in need if n not in self.tensors]
        if missing:
            more = " (and %d more)" % (len(missing) - 1) if len(missing) > 1 else ""
            fail("%s: missing tensor %s%s" % (d, missing[0], more))

    @staticmethod
    def check_arch(hf, where):
        """Refuse what run.c cannot compute; returns the GGUF architecture:
        "llama" (Llama, Mistral) or "qwen2"."""
        mt = hf.get("model_type")
        if mt not in ("llama", "mistral", "qwen2"):
            fail("%s: unsupported model_type %r (supported: \"llama\", \"mistral\", \"qwen2\")" % (where, mt))
        window = hf.get("sliding_window")
        if mt == "qwen2" and hf.get("use_sliding_window"):
            fail("%s: use_sliding_window is true; sliding-window attention is not supported" % where)
        if mt == "mistral" and isinstance(window, int) and window < hf.get("max_position_embeddings", 0):
            # as llama.cpp does: attention over the whole context, the same up to the window
            print("note: %s: sliding_window %d is ignored (attention sees the whole context, the same as the "
                  "model's up to %d tokens)" % (where, window, window), file=sys.stderr)
        theta = hf.get("rope_theta", ROPE_THETA)
        if not isinstance(theta, (int, float)) or not 0 < theta < 3.4e38:
            fail("%s: rope_theta %r must be a positive number" % (where, theta))
        sc = hf.get("rope_scaling")
        if sc is not None:
            kind = sc.get("rope_type", sc.get("type")) if isinstance(sc, dict) else None
            if kind != "llama3" or mt == "qwen2":
                fail("%s: rope_scaling of type %r is not supported (only \"llama3\", for Llama)" % (where, kind))
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            if any(not isinstance(sc.get(k), (int, float)) or sc.get(k) <= 0 for k in keys):
                fail("%s: llama3 rope_scaling needs positive %s, got %r" % (where, ", ".join(keys), sc))
            if sc["high_freq_factor"] <= sc["low_freq_factor"]:
                fail("%s: llama3 rope_scaling needs high_freq_factor > low_freq_factor, got %r" % (where, sc))
        for k in ("attention_bias", "mlp_bias"):
            if hf.get(k) and mt != "qwen2":
                fail("%s: %s is true; biases are not supported by run.c" % (where, k))
        eps = hf.get("rms_norm_eps", 1e-6)  # LlamaConfig's default when absent
        if not isinstance(eps, (int, float)) or not 0 <= eps < 1:
            fail("%s: rms_norm_eps %r must be in [0, 1)" % (where, eps))
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            fail("%s: hidden_act %r is not supported (run.c uses SiLU)" % (where, act))
        return "qwen2" if mt == "qwen2" else "llama"

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
        if self.cfg["arch"] == "qwen2":
            return w  # GGUF's qwen2 keeps HF's layout: llama.cpp rotates halves for it
        if name == "wq":
            w = unpermute_hf(w, self.cfg["n_heads"])
        elif name == "wk":
            w = unpermute_hf(w, self.cfg["n_kv_heads"])
        return w

    def bias(self, name, layer):
        """qwen2's q, k or v bias of a layer, float32, HF's layout."""
        hf_name = HF_BIASES[name] % layer
        loader, shape = self.tensors[hf_name]
        want = (expected_shape(self.cfg, name)[0],)
        if tuple(shape) != want:
            fail("tensor %s has shape %s, expected %s" % (hf_name, tuple(shape), want))
        if Progress.current is not None:
            Progress.current.tensor_started()
        return np.ascontiguousarray(loader(), dtype=np.float32)


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
# GGUF output (llama.cpp's format)
#
# Written from the format's facts as llama.cpp (Feb 2025) states them: the
# file is "GGUF", uint32 version 3, uint64 tensor count, uint64 metadata
# count; each metadata entry a string key (uint64 length + UTF-8 bytes), a
# uint32 value type and the value (arrays: uint32 element type, uint64
# count, the elements); then per tensor its name, uint32 n_dims, uint64
# ne[n_dims] (ne[0] the length of a row, so an (out, in) matrix is
# ne = [in, out]), uint32 type and uint64 offset from the start of the data
# section, which begins at the next multiple of general.alignment (32) after
# the infos; every offset is a multiple of the alignment too.
#
# Tensor types: F32 0, F16 1, Q4_0 2, Q8_0 8, BF16 30. Q8_0 and Q4_0 are
# blocks of 32 values of a row: Q8_0 a float16 scale d then 32 int8 q
# (value = d * q); Q4_0 a float16 d then 16 bytes, byte j holding value j in
# its low nibble and value j + 16 in its high nibble, each as q + 8 for q in
# -8..7 (value = d * q). The quantisers follow llama.cpp's reference ones
# (quantize_row_q8_0_ref, quantize_row_q4_0_ref): see gguf_q8_0, gguf_q4_0.

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
GGUF_ALIGNMENT = 32
# metadata value types
GV_UINT32, GV_INT32, GV_FLOAT32, GV_BOOL, GV_STRING, GV_ARRAY = 4, 5, 6, 7, 8, 9
# --encoding for GGUF: (tensor type, bytes per block of 32 values, general.file_type)
GGUF_ENCODINGS = {"f32": (0, 128, 0), "f16": (1, 64, 1), "bf16": (30, 64, 32), "q8_0": (8, 34, 7),
                  "q4_0": (2, 18, 2)}
GGML_F32, GGML_F16 = 0, 1
# token types (tokenizer.ggml.token_type), the numbers SentencePiece uses too
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_USER_DEFINED, TOK_UNUSED, TOK_BYTE = 1, 2, 3, 4, 5, 6
# Qwen2's pre-tokenizer split (tokenizer.json): Llama 3's with single digits
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# DeepSeek's sequences of splits, as llama.cpp lists them for "deepseek-llm"
# and "deepseek-coder" (their digit rule is a Digits pre-tokenizer in
# tokenizer.json)
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
)
DEEPSEEK_CODER_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+")
# end-of-turn and end-of-message tokens, by their text (Llama 3, ChatML, Phi-3)
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>")
EOM_TEXTS = ("<|eom_id|>",)


def gguf_str(s):
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, vtype, value):
    """One metadata entry; vtype is a GV_ scalar type or ("array", GV_ type)."""
    out = [gguf_str(key)]
    if isinstance(vtype, tuple):
        elem = vtype[1]
        out.append(struct.pack("<IIQ", GV_ARRAY, elem, len(value)))
        if elem == GV_STRING:
            out.extend(gguf_str(v) for v in value)
        else:
            out.append(struct.pack("<%d%s" % (len(value), {GV_FLOAT32: "f", GV_INT32: "i", GV_UINT32: "I"}[elem]), *value))
    elif vtype == GV_STRING:
        out.append(struct.pack("<I", vtype) + gguf_str(value))
    elif vtype == GV_BOOL:
        out.append(struct.pack("<IB", vtype, 1 if value else 0))
    else:
        out.append(struct.pack("<I" + {GV_UINT32: "I", GV_INT32: "i", GV_FLOAT32: "f"}[vtype], vtype, value))
    return b"".join(out)


def gguf_q8_0(w):
    """Q8_0 blocks of a float32 array whose size is a multiple of 32, as
    llama.cpp's reference quantiser makes them: d = max|x| / 127 (float32,
    stored as float16), q = x * (1 / d) rounded half away from zero."""
    g = w.reshape(-1, 32).astype(np.float32)
    d = (np.abs(g).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    x = (g * inv[:, None]).astype(np.float64)  # the float32 products, exactly
    q = np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5)).astype(np.int8)
    blocks = np.empty(g.shape[0], dtype=[("d", "<f2"), ("qs", "i1", 32)])
    blocks["d"], blocks["qs"] = d.astype(np.float16), q
    return blocks.tobytes()


def gguf_q4_0(w):
    """Q4_0 blocks, as llama.cpp's reference quantiser makes them: m = the
    first value of largest magnitude (sign kept), d = m / -8 (float32, stored
    as float16), q + 8 = min(15, truncate(x * (1 / d) + 8.5)) in float32."""
    g = w.reshape(-1, 32).astype(np.float32)
    m = g[np.arange(g.shape[0]), np.abs(g).argmax(axis=1)] if g.size else np.zeros(0, np.float32)
    d = (m / np.float32(-8)).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    u = np.minimum(np.trunc((g * inv[:, None]).astype(np.float32) + np.float32(8.5)), 15).astype(np.uint8)
    blocks = np.empty(g.shape[0], dtype=[("d", "<f2"), ("qs", "u1", 16)])
    blocks["d"], blocks["qs"] = d.astype(np.float16), u[:, :16] | (u[:, 16:] << 4)
    return blocks.tobytes()


def gguf_bf16(w):
    """bfloat16 bits of float32 values, rounded to nearest even."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()


def gguf_tensor_bytes(w, ttype):
    if ttype == 0:
        return np.ascontiguousarray(w, dtype="<f4").tobytes()
    if ttype == 1:
        return np.ascontiguousarray(w).astype("<f2").tobytes()
    if ttype == 30:
        return gguf_bf16(w)
    return gguf_q8_0(w) if ttype == 8 else gguf_q4_0(w)


def gguf_nbytes(ttype, count):
    if ttype == 0:
        return 4 * count
    if ttype in (1, 30):
        return 2 * count
    return count // 32 * (34 if ttype == 8 else 18)


def _pad(n, align=GGUF_ALIGNMENT):
    return -n % align


def write_gguf(path, metadata, tensors):
    """metadata: [(key, vtype, value)]; tensors: [(name, ne, type, produce)]
    where produce() returns the float32 values (row-major, rows of ne[0]).
    The infos are written first, so sizes come from ne and type alone; each
    tensor is produced, converted and written in turn. Returns a summary."""
    head = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    head += [gguf_kv(*kv) for kv in metadata]
    offset = 0
    for name, ne, ttype, _ in tensors:
        head.append(gguf_str(name) + struct.pack("<I%dQ" % len(ne), len(ne), *ne))
        head.append(struct.pack("<IQ", ttype, offset))
        offset += gguf_nbytes(ttype, math.prod(ne))
        offset += _pad(offset)
    with atomic_output(path) as f:
        Progress.current = Progress(f, len(tensors))
        complete = False
        try:
            head = b"".join(head)
            f.write(head + b"\0" * _pad(len(head)))
            for name, ne, ttype, produce in tensors:
                w = produce()
                data = gguf_tensor_bytes(w, ttype)
                if len(data) != gguf_nbytes(ttype, math.prod(ne)):
                    fail("tensor %s: %d bytes for shape %s (internal error)" % (name, len(data), ne))
                f.write(data + b"\0" * _pad(len(data)))
            complete = True
        finally:
            Progress.current.finish(complete)
            Progress.current = None


# --- the vocabulary ---------------------------------------------------------

def _special_ids(vocab, cfg_dir):
    """bos/eos/unk/sep/pad ids as llama.cpp's converter finds them: the
    tokens tokenizer_config.json names (looked up by their text), then the
    *_token_id fields of config.json for those still unset."""
    tcfg_path = os.path.join(cfg_dir, "tokenizer_config.json")
    tcfg = _read_json(tcfg_path) if os.path.isfile(tcfg_path) else {}
    cfg_path = os.path.join(cfg_dir, "config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    by_text = {}
    for i, t in enumerate(vocab["tokens"]):
        by_text.setdefault(t, i)
    ids = {}
    for kind in ("bos", "eos", "unk", "sep", "pad"):
        text = _token_text(tcfg.get(kind + "_token"))
        if isinstance(text, str) and text.encode("utf-8") in by_text:
            ids[kind] = by_text[text.encode("utf-8")]
        elif isinstance(cfg.get(kind + "_token_id"), int) and 0 <= cfg[kind + "_token_id"] < len(vocab["tokens"]):
            ids[kind] = cfg[kind + "_token_id"]
    for kind, texts in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS)):
        for text in texts:
            if text.encode("utf-8") in by_text:
                ids[kind] = by_text[text.encode("utf-8")]
                break
    vocab["ids"] = ids
    for kind in ("bos", "eos"):
        if isinstance(tcfg.get("add_%s_token" % kind), bool):
            vocab["add_" + kind] = tcfg["add_%s_token" % kind]
    if isinstance(tcfg.get("add_prefix_space"), bool):
        vocab["add_space_prefix"] = tcfg["add_prefix_space"]
    template = tcfg.get("chat_template")
    if isinstance(template, str):
        vocab["chat_templates"] = [("tokenizer.chat_template", template)]
    elif isinstance(template, list):  # named templates: "default" and the others by name
        vocab["chat_templates"] = [("tokenizer.chat_template" + ("" if t.get("name") == "default" else "." + str(t.get("name"))),
                                    t.get("template", "")) for t in template if isinstance(t, dict)]
    return vocab


def _added_tokens_config(vocab, cfg_dir):
    """tokenizer_config.json's added_tokens_decoder replaces the pieces it
    names, as llama.cpp's converter does for SentencePiece vocabularies."""
    path = os.path.join(cfg_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return
    for key, tok in (_read_json(path).get("added_tokens_decoder") or {}).items():
        try:
            i, text = int(key), tok["content"]
        except (ValueError, KeyError, TypeError):
            fail("%s: bad added_tokens_decoder entry %r" % (path, key))
        if not 0 <= i < len(vocab["tokens"]):
            continue
        special = tok.get("special") or _looks_special(text)
        vocab["tokens"][i] = (text if special else text.replace("\u2581", " ")).encode("utf-8")
        vocab["types"][i] = TOK_CONTROL if special else TOK_USER_DEFINED
        vocab["scores"][i] = -1000.0


def _looks_special(text):
    """Added tokens some models leave unmarked that llama.cpp's converter
    still makes control tokens: <|...|>, DeepSeek's full-width <｜...｜>,
    <pad>, Gemma's <unused...>, <mask>, <2mass>, [@BOS@]."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def vocab_sentencepiece(path, cfg_dir):
    """tokenizer.model -> tokenizer.ggml.model "llama": the pieces as
    stored (with U+2581 for spaces), scores, and SentencePiece's own piece
    types (normal, unknown, control, user-defined, unused, byte)."""
    pieces = read_sentencepiece(path)
    vocab = {"model": "llama", "pre": "default", "tokens": [p.encode("utf-8") for p, _, _ in pieces],
             "scores": [s for _, s, _ in pieces], "types": [t for _, _, t in pieces],
             "add_bos": True, "add_eos": False}
    _added_tokens_config(vocab, cfg_dir)
    _special_ids(vocab, cfg_dir)
    ids = vocab["ids"]
    for kind, text in (("bos", b"<s>"), ("eos", b"</s>")):
        if kind not in ids and text in vocab["tokens"]:
            ids[kind] = vocab["tokens"].index(text)
    if "unk" not in ids and TOK_UNKNOWN in vocab["types"]:
        ids["unk"] = vocab["types"].index(TOK_UNKNOWN)
    return vocab


def vocab_llama2c(path):
    """A llama2.c tokenizer.bin -> a SentencePiece-style vocabulary. The file
    keeps pieces and scores only: spaces are turned back into U+2581, ids 0,
    1 and 2 are <unk>, <s> and </s> (llama2.c's convention), "<0xHH>" pieces
    are byte tokens."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    if data[:4] == TK42_MAGIC:
        fail("%s: a byte-level BPE tokenizer written by this tool; give the tokenizer.json it was made from" % path)
    if tokenizer_entries(data) is None:
        fail("%s: not a llama2.c tokenizer.bin" % path)
    tokens, scores, types = [], [], []
    pos = 4
    while pos < len(data):
        score, ln = struct.unpack("<fi", data[pos:pos + 8])
        piece = data[pos + 8:pos + 8 + ln]
        pos += 8 + ln
        i = len(tokens)
        kind = TOK_NORMAL
        if i in (0, 1, 2):
            piece, kind = (b"<unk>", b"<s>", b"</s>")[i], (TOK_UNKNOWN, TOK_CONTROL, TOK_CONTROL)[i]
        elif len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            kind = TOK_BYTE
        else:
            piece = piece.replace(b" ", "\u2581".encode("utf-8"))
        tokens.append(piece)
        scores.append(score)
        types.append(kind)
    return {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "types": types,
            "ids": {"unk": 0, "bos": 1, "eos": 2}, "add_bos": True, "add_eos": False}


def _pre_tokenizer_steps(pre, path):
    """The pre_tokenizer of a tokenizer.json as a tuple of steps:
    ("split", regex), ("digits", individual), ("bytelevel", use_regex)."""
    items = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    steps = []
    for p in items:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "Split":
            pat = p.get("pattern") or {}
            steps.append(("split", pat.get("Regex") if isinstance(pat, dict) else None))
        elif kind == "Digits":
            steps.append(("digits", bool(p.get("individual_digits"))))
        elif kind == "ByteLevel":
            if p.get("add_prefix_space"):
                fail("%s: a ByteLevel pre-tokenizer with add_prefix_space is not one llama.cpp names" % path)
            steps.append(("bytelevel", p.get("use_regex", True)))
        else:
            fail("%s: pre-tokenizer step %r is not one llama.cpp names" % (path, kind))
    return tuple(steps)


def choose_pre(tj, path):
    """tokenizer.ggml.pre: the name llama.cpp gives this pre-tokenizer,
    recognised from tokenizer.json's pre_tokenizer (its split regexes)."""
    pre = tj.get("pre_tokenizer")
    if not isinstance(pre, dict):
        fail("%s: no pre_tokenizer (not a byte-level BPE tokenizer llama.cpp names)" % path)
    steps = _pre_tokenizer_steps(pre, path)
    known = {
        (("split", LLAMA3_SPLIT), ("bytelevel", False)): "llama-bpe",
        (("split", QWEN2_SPLIT), ("bytelevel", False)): "qwen2",
        (("bytelevel", True),): "gpt-2",
        (("digits", True), ("bytelevel", True)): "smollm",
    }
    if steps in known:
        return known[steps]
    splits = tuple(r for kind, r in steps if kind == "split")
    # DeepSeek's digit rule: a Digits step, or a last split of \p{N}+ / \p{N}
    digits = any(kind == "digits" for kind, _ in steps) or splits[-1:] in (("\\p{N}+",), ("\\p{N}",))
    if splits[-1:] in (("\\p{N}+",), ("\\p{N}",)):
        splits = splits[:-1]
    if digits and steps[-1] == ("bytelevel", False):
        if splits == DEEPSEEK_LLM_SPLITS:
            return "deepseek-llm"
        if splits == DEEPSEEK_CODER_SPLITS:
            return "deepseek-coder"
    splits = tuple(r for kind, r in steps if kind == "split")
    if splits:
        fail("%s: pre-tokenizer split regex %r is not one llama.cpp names (known: Llama 3, Qwen2, DeepSeek LLM "
             "and Coder; GPT-2 and SmolLM byte-level)" % (path, splits[0] if len(splits) == 1 else list(splits)))
    fail("%s: pre-tokenizer %s is not one llama.cpp names" % (path, [s[0] for s in steps]))


def vocab_bpe(path, cfg_dir):
    """tokenizer.json (byte-level BPE) -> tokenizer.ggml.model "gpt2": the
    tokens in their stored form (bytes mapped to GPT-2's printable
    characters), merges as "left right", token types (added tokens are
    control when special, else user-defined; ids with no token are
    "[PADn]", unused)."""
    tj = _read_json(path)
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict):
        fail("%s: no \"model\" object (not a Hugging Face tokenizer.json)" % path)
    if model.get("type") != "BPE":
        fail("%s: model type %r is not supported (only byte-level BPE)" % (path, model.get("type")))
    if model.get("byte_fallback"):
        fail("%s: a SentencePiece-style BPE (byte fallback); give its tokenizer.model instead" % path)
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        fail("%s: model has no vocab object or merges list" % path)
    pre = choose_pre(tj, path)
    entries = {}
    for text, i in vocab.items():
        if not isinstance(i, int) or i < 0:
            fail("%s: token %r has id %r" % (path, text, i))
        entries[i] = (text, TOK_NORMAL)
    for added in tj.get("added_tokens") or []:
        i, text = added.get("id"), added.get("content")
        if not isinstance(i, int) or i < 0 or not isinstance(text, str):
            fail("%s: bad added token %r" % (path, added))
        special = added.get("special") or _looks_special(text)
        entries[i] = (text if special else text.replace("\u2581", " "), TOK_CONTROL if special else TOK_USER_DEFINED)
    if not entries:
        fail("%s: no tokens" % path)
    n = max(entries) + 1
    tokens, types = [], []
    for i in range(n):
        text, kind = entries.get(i, ("[PAD%d]" % i, TOK_UNUSED))
        tokens.append(text.encode("utf-8"))
        types.append(kind)
    merged = []
    for rank, m in enumerate(merges):
        if isinstance(m, str):
            merged.append(m)
        elif isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m):
            # the pair form (transformers 4.45+) may hold spaces: stored as U+0120, GPT-2's space
            merged.append(" ".join(s.replace(" ", "\u0120") for s in m))
        else:
            fail("%s: merge %d is %r, not a pair" % (path, rank, m))
    v = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merged,
         "add_bos": pre == "llama-bpe", "add_eos": False}
    _special_ids(v, cfg_dir)
    # a post-processor that puts BOS first adds it (Llama 3's TemplateProcessing)
    tcfg = os.path.join(cfg_dir, "tokenizer_config.json")
    said = os.path.isfile(tcfg) and isinstance(_read_json(tcfg).get("add_bos_token"), bool)
    template = _template_processing(tj.get("post_processor"))
    first = _first_template_token(template)
    if "bos" not in v["ids"] and first:
        # no configuration names a BOS: the token the post-processor puts
        # first is the one (Llama 3's tokenizer.json alone)
        bos = _template_token_id(template, first, tokens)
        if bos is not None:
            v["ids"]["bos"] = bos
    if not said and "bos" in v["ids"] and first is not None:
        v["add_bos"] = first == tokens[v["ids"]["bos"]].decode("utf-8", "replace")
    if v["add_bos"] and "bos" not in v["ids"]:
        # a file that adds a BOS it does not name is refused by run.c
        print("export.py: warning: %s: neither tokenizer_config.json, config.json nor a TemplateProcessing "
              "names a BOS token: the file adds none" % path, file=sys.stderr)
        v["add_bos"] = False
    return v


def _template_processing(pp):
    """The TemplateProcessing post-processor of a tokenizer.json (alone or in
    a Sequence), or None."""
    if not isinstance(pp, dict):
        return None
    items = (pp.get("processors") or []) if pp.get("type") == "Sequence" else [pp]
    return next((p for p in items if isinstance(p, dict) and p.get("type") == "TemplateProcessing"), None)


def _first_template_token(template):
    """The special token a TemplateProcessing puts before a single sequence,
    "" when it puts none, or None when there is no TemplateProcessing."""
    if template is None:
        return None
    single = template.get("single") or []
    if single and isinstance(single[0], dict) and isinstance(single[0].get("SpecialToken"), dict):
        text = single[0]["SpecialToken"].get("id")
        return text if isinstance(text, str) else ""
    return ""


def _template_token_id(template, text, tokens):
    """The id of a TemplateProcessing's special token: its special_tokens
    entry's id, else the first token of that text; None if neither."""
    entry = (template.get("special_tokens") or {}).get(text)
    ids = entry.get("ids") if isinstance(entry, dict) else None
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int) and 0 <= ids[0] < len(tokens):
        return ids[0]
    return tokens.index(text.encode("utf-8")) if text.encode("utf-8") in tokens else None


def read_vocab(path, cfg_dir=None):
    """A vocabulary for GGUF from tokenizer.model, tokenizer.json or a
    llama2.c tokenizer.bin (by content, whatever the name)."""
    if not os.path.isfile(path):
        fail("%s: no such file" % path)
    cfg_dir = cfg_dir or os.path.dirname(os.path.abspath(path))
    with open(path, "rb") as f:
        head = f.read(64)
    if path.endswith(".json") or head.lstrip()[:1] == b"{":
        return vocab_bpe(path, cfg_dir)
    if path.endswith(".model"):
        return vocab_sentencepiece(path, cfg_dir)
    return vocab_llama2c(path)


def vocab_metadata(vocab, n_vocab=None):
    """The tokenizer.* entries; pads the token list to n_vocab (the model's
    embedding rows) with unused "[PADn]" tokens, as llama.cpp's converter."""
    tokens, types = list(vocab["tokens"]), list(vocab["types"])
    scores = list(vocab["scores"]) if "scores" in vocab else None
    if n_vocab is not None:
        if len(tokens) > n_vocab:
            fail("the tokenizer has %d tokens but the model's embedding only %d rows" % (len(tokens), n_vocab))
        for i in range(len(tokens), n_vocab):
            tokens.append(b"[PAD%d]" % i)
            types.append(TOK_UNUSED)
            if scores is not None:
                scores.append(-1000.0)
    md = [("tokenizer.ggml.model", GV_STRING, vocab["model"]), ("tokenizer.ggml.pre", GV_STRING, vocab["pre"]),
          ("tokenizer.ggml.tokens", ("array", GV_STRING), tokens)]
    if scores is not None:
        md.append(("tokenizer.ggml.scores", ("array", GV_FLOAT32), scores))
    md.append(("tokenizer.ggml.token_type", ("array", GV_INT32), types))
    if vocab.get("merges"):
        md.append(("tokenizer.ggml.merges", ("array", GV_STRING), vocab["merges"]))
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
             "pad": "padding_token_id", "eot": "eot_token_id", "eom": "eom_token_id"}
    for kind, key in names.items():  # "seperator" is llama.cpp's spelling of the key
        if kind in vocab["ids"]:
            md.append(("tokenizer.ggml." + key, GV_UINT32, vocab["ids"][kind]))
    md.append(("tokenizer.ggml.add_bos_token", GV_BOOL, vocab["add_bos"]))
    md.append(("tokenizer.ggml.add_eos_token", GV_BOOL, vocab["add_eos"]))
    if "add_space_prefix" in vocab:
        md.append(("tokenizer.ggml.add_space_prefix", GV_BOOL, vocab["add_space_prefix"]))
    for key, template in vocab.get("chat_templates", []):
        md.append((key, GV_STRING, template))
    return md


def vocab_summary(vocab):
    ids = ", ".join("%s %d" % (k, v) for k, v in sorted(vocab["ids"].items()))
    return "%s vocabulary (pre-tokenizer %s), %d tokens%s; %s" % (
        "SentencePiece" if vocab["model"] == "llama" else "byte-level BPE", vocab["pre"], len(vocab["tokens"]),
        ", %d merges" % len(vocab["merges"]) if vocab.get("merges") else "", ids or "no special tokens")


def cmd_tokenizer_gguf(args):
    """A vocabulary-only GGUF (as llama.cpp's models/ggml-vocab-*.gguf):
    general.architecture "llama", a name, the tokenizer.* entries."""
    vocab = read_vocab(args.input)
    name = os.path.basename(os.path.dirname(os.path.abspath(args.input))) or "vocab"
    md = [("general.architecture", GV_STRING, "llama"), ("general.name", GV_STRING, name)]
    md += vocab_metadata(vocab)
    write_gguf(args.output, md, [])
    print("wrote %s: vocabulary only, %s" % (args.output, vocab_summary(vocab)))


# --- models ---------------------------------------------------------------------

GGUF_LAYER = (("attn_norm", "rms_att"), ("attn_q", "wq"), ("attn_k", "wk"), ("attn_v", "wv"),
              ("attn_output", "wo"), ("ffn_norm", "rms_ffn"), ("ffn_gate", "w1"), ("ffn_down", "w2"),
              ("ffn_up", "w3"))


def llama3_rope_factors(cfg):
    """rope_freqs.weight for Llama 3.1 scaling, as llama.cpp's converter
    computes it: per pair i, with the float32 frequency base^(-2i/d) and its
    wavelength 2 pi / freq: 1 below original_context / high_freq_factor,
    `factor` above original_context / low_freq_factor, and between them
    1 / ((1 - s) / factor + s) with s = (original_context / wavelength -
    low) / (high - low). llama.cpp divides each angle by its factor."""
    sc = cfg["rope_scaling"]
    hd = cfg["dim"] // cfg["n_heads"]
    base = cfg.get("rope_theta", ROPE_THETA)
    # in float32, as torch computes base ** (arange(0, d, 2) / d) there
    freqs = np.float32(1.0) / (np.float32(base) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    ctx = sc["original_max_position_embeddings"]
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            s = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def model_vocab(src, tokenizer):
    """The vocabulary for a model's GGUF: --tokenizer FILE, else the HF
    directory's tokenizer.model (preferred, as llama.cpp's converter) or
    tokenizer.json."""
    if tokenizer:
        return read_vocab(tokenizer)
    d = getattr(src, "dir", None)
    if d is None:
        fail("GGUF output needs a vocabulary: add --tokenizer FILE (tokenizer.model, tokenizer.json or tokenizer.bin)")
    for fn in ("tokenizer.model", "tokenizer.json"):
        if os.path.isfile(os.path.join(d, fn)):
            return read_vocab(os.path.join(d, fn), d)
    fail("%s: no tokenizer.model or tokenizer.json; add --tokenizer FILE" % d)


def write_gguf_model(src, out, encoding, tokenizer, name):
    cfg = src.cfg
    check_config(cfg)
    arch = cfg.get("arch", "llama")
    wtype, _, file_type = GGUF_ENCODINGS[encoding]
    vocab = model_vocab(src, tokenizer)
    dim, L = cfg["dim"], cfg["n_layers"]
    hd = dim // cfg["n_heads"]
    kv_dim = hd * cfg["n_kv_heads"]
    md = [("general.architecture", GV_STRING, arch), ("general.name", GV_STRING, name),
          ("general.alignment", GV_UINT32, GGUF_ALIGNMENT), ("general.file_type", GV_UINT32, file_type),
          ("general.quantization_version", GV_UINT32, 2)]
    for key, vtype, value in (("context_length", GV_UINT32, cfg["seq_len"]), ("embedding_length", GV_UINT32, dim),
                              ("feed_forward_length", GV_UINT32, cfg["hidden_dim"]), ("block_count", GV_UINT32, L),
                              ("attention.head_count", GV_UINT32, cfg["n_heads"]),
                              ("attention.head_count_kv", GV_UINT32, cfg["n_kv_heads"]),
                              ("rope.dimension_count", GV_UINT32, hd),
                              ("rope.freq_base", GV_FLOAT32, cfg.get("rope_theta", ROPE_THETA)),
                              ("attention.layer_norm_rms_epsilon", GV_FLOAT32, cfg.get("norm_eps", NORM_EPS)),
                              ("vocab_size", GV_UINT32, cfg["vocab_size"])):
        md.append(("%s.%s" % (arch, key), vtype, value))
    md += vocab_metadata(vocab, cfg["vocab_size"])

    fallback = []

    def matrix(gguf_name, name, layer, rows, cols):
        # a row that is not a whole number of 32-value blocks stays F16, as in llama.cpp's converter
        t = wtype
        if t in (2, 8) and cols % 32:
            t = GGML_F16
            fallback.append(gguf_name)
        return (gguf_name, [cols, rows], t, lambda: fetch(src, name, layer))

    def vector(gguf_name, produce, n):
        return (gguf_name, [n], GGML_F32, produce)

    tensors = [matrix("token_embd.weight", "tok_emb", None, cfg["vocab_size"], dim)]
    if cfg.get("rope_scaling"):
        tensors.append(vector("rope_freqs.weight", lambda: llama3_rope_factors(cfg), hd // 2))
    shapes = {"wq": (dim, dim), "wk": (kv_dim, dim), "wv": (kv_dim, dim), "wo": (dim, dim),
              "w1": (cfg["hidden_dim"], dim), "w2": (dim, cfg["hidden_dim"]), "w3": (cfg["hidden_dim"], dim)}
    for l in range(L):
        for gname, name in GGUF_LAYER:
            full = "blk.%d.%s.weight" % (l, gname)
            if name.startswith("rms"):
                tensors.append(vector(full, lambda name=name, l=l: fetch(src, name, l), dim))
            else:
                tensors.append(matrix(full, name, l, *shapes[name]))
            if arch == "qwen2" and name in ("wq", "wk", "wv"):
                n = shapes[name][0]
                tensors.append(vector("blk.%d.%s.bias" % (l, gname), lambda name=name, l=l: src.bias(name, l), n))
    tensors.append(vector("output_norm.weight", lambda: fetch(src, "rms_final"), dim))
    if not cfg["shared"]:
        tensors.append(matrix("output.weight", "cls", None, cfg["vocab_size"], dim))
    if fallback:
        print("note: %d tensors have rows of %d or %d values, not a multiple of 32: written as F16"
              % (len(fallback), dim, cfg["hidden_dim"]), file=sys.stderr)
    write_gguf(out, md, tensors)
    print("wrote %s: GGUF, arch %s, %s weights, dim %d, hidden_dim %d, n_layers %d, n_heads %d, n_kv_heads %d, "
          "vocab_size %d, context %d, %s classifier%s\n  %s"
          % (out, arch, encoding.upper(), dim, cfg["hidden_dim"], L, cfg["n_heads"], cfg["n_kv_heads"],
             cfg["vocab_size"], cfg["seq_len"], "shared" if cfg["shared"] else "separate",
             ", rope_freqs (llama3 scaling)" if cfg.get("rope_scaling") else "", vocab_summary(vocab)))


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


def is_gguf_output(path):
    return path.lower().endswith(".gguf")


def write_output(src, args, name):
    """A .gguf output name writes GGUF; any other a run.c checkpoint."""
    if not is_gguf_output(args.output):
        if args.tokenizer:
            fail("--tokenizer is for GGUF output (a .bin checkpoint holds no vocabulary)")
        return write_checkpoint(src, args.output, args.version, args.group_size, args.encoding)
    if args.version is not None or args.group_size is not None:
        fail("--version and --group-size are for .bin checkpoints (GGUF output: --encoding %s)"
             % "|".join(GGUF_ENCODINGS))
    encoding = args.encoding or "f16"
    if encoding not in GGUF_ENCODINGS:
        fail("--encoding %s is for .bin checkpoints; GGUF takes %s" % (encoding, ", ".join(GGUF_ENCODINGS)))
    write_gguf_model(src, args.output, encoding, args.tokenizer, name)


def cmd_model(args):
    need_numpy("export.py model")
    src = open_source(args.src, args)
    if args.seq_len and isinstance(src, (HFSource, RuncSource)):
        src.cfg["seq_len"] = args.seq_len
    name = os.path.basename(os.path.normpath(args.src))
    write_output(src, args, name if os.path.isdir(args.src) else os.path.splitext(name)[0])


def cmd_random(args):
    need_numpy("export.py random")
    tied = True if args.tied else (False if args.untied else None)
    src = RandomSource(args.shape, args.seed, tied)
    write_output(src, args, "random-%s-seed%d" % (args.shape.partition("=")[0], args.seed))


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


# GGUF metadata value types beyond those written above, for reading: the
# struct format of each scalar type (7 bool, 8 string and 9 array apart)
GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tensor type names (llama.cpp's ggml_type numbers)
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


def read_gguf_infos(path):
    """A GGUF's version, metadata {key: value} and tensors [(name, type, ne)],
    read without numpy (arrays of numbers are skipped and kept as their
    length, strings arrays kept whole); raises ExportError if malformed."""
    with open(path, "rb") as f:
        data = f.read()
    pos = [4]

    def take(fmt):
        n = struct.calcsize("<" + fmt)
        if pos[0] + n > len(data):
            fail("%s: GGUF file truncated at byte %d" % (path, pos[0]))
        v = struct.unpack_from("<" + fmt, data, pos[0])
        pos[0] += n
        return v[0]

    def string():
        n = take("Q")
        if pos[0] + n > len(data):
            fail("%s: GGUF file truncated at byte %d" % (path, pos[0]))
        pos[0] += n
        return data[pos[0] - n:pos[0]].decode("utf-8", "replace")

    def value(vtype):
        if vtype == GV_STRING:
            return string()
        if vtype == GV_ARRAY:
            etype, count = take("I"), take("Q")
            if etype in GGUF_SCALAR:  # numbers: skipped, their count kept
                pos[0] += count * struct.calcsize("<" + GGUF_SCALAR[etype])
                return count
            return [value(etype) for _ in range(count)]
        if vtype not in GGUF_SCALAR:
            fail("%s: unknown GGUF value type %d" % (path, vtype))
        return take(GGUF_SCALAR[vtype])

    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        ne = [take("Q") for _ in range(take("I"))]
        tensors.append((name, take("I"), ne))
        take("Q")  # offset
    return version, meta, tensors


def gguf_info(path):
    """Describe a GGUF file: architecture, shapes, weight types, vocabulary, template."""
    version, meta, tensors = read_gguf_infos(path)
    arch = meta.get("general.architecture", "?")
    print("%s: GGUF version %d, architecture %s%s" % (path, version, arch,
          ", name %s" % meta["general.name"] if "general.name" in meta else ""))
    for k in ("embedding_length", "feed_forward_length", "block_count", "attention.head_count",
              "attention.head_count_kv", "context_length", "rope.freq_base", "attention.layer_norm_rms_epsilon"):
        if "%s.%s" % (arch, k) in meta:
            v = meta["%s.%s" % (arch, k)]
            print("  %-34s %s" % (k, "%g" % v if isinstance(v, float) else v))
    counts = {}
    for _name, t, _ne in tensors:
        tname = GGML_TYPE_NAMES.get(t, "type %d" % t)
        counts[tname] = counts.get(tname, 0) + 1
    print("  %-34s %d (%s)" % ("tensors", len(tensors), ", ".join("%d %s" % (n, t) for t, n in sorted(counts.items()))))
    for name, t, ne in tensors:
        if name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
            print("  %-34s %s %s" % (name, GGML_TYPE_NAMES.get(t, "type %d" % t), "x".join(map(str, ne))))
    print("  %-34s %s" % ("parameters", sum(math.prod(ne) for _n, _t, ne in tensors)))
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        print("  %-34s %s, %d tokens" % ("vocabulary", meta.get("tokenizer.ggml.model", "?"), len(tokens)))
        for k in ("bos_token_id", "eos_token_id", "eot_token_id"):
            if "tokenizer.ggml." + k in meta:
                i = meta["tokenizer.ggml." + k]
                print("  %-34s %d %r" % (k, i, tokens[i] if 0 <= i < len(tokens) else "?"))
    else:
        print("  %-34s none (run.c needs one: a vocabulary GGUF or -z)" % "vocabulary")
    tmpl = meta.get("tokenizer.chat_template")
    print("  %-34s %s" % ("chat template", "none" if tmpl is None else "%d characters: %r"
                          % (len(tmpl), tmpl if len(tmpl) <= 60 else tmpl[:57] + "...")))


def cmd_info(args):
    path = args.file
    if not os.path.isfile(path):
        fail("%s: no such file" % path)
    with open(path, "rb") as f:
        if f.read(4) == GGUF_MAGIC:
            return gguf_info(path)
    err = None
    try:
        cfg, info = read_runc_header(path)
    except ExportError as e:
        cfg, err = None, str(e)
    if cfg is not None and (info["size"] == info["expected_size"] or info["version"] > 0):
        v = info["version"]
        # version 4 names its encoding by layout; the others' layout is their version
        encodings = {0: "float32", 1: "float32", 2: "int8 Q8_0", 3: "4-bit"}
        name = ("legacy llama2.c (float32)" if v == 0 else
                "ak42 version %d (%s)" % (v, encodings[info["layout"]]))
        print("%s: run.c checkpoint, %s" % (path, name))
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

    t = sub.add_parser("tokenizer", help="tokenizer.model or tokenizer.json -> run.c tokenizer file "
                                         "or (OUT.gguf) a vocabulary-only GGUF")
    t.add_argument("input", metavar="IN.model|tokenizer.json|tokenizer.bin")
    t.add_argument("output", metavar="OUT.bin|OUT.gguf")
    t.set_defaults(func=cmd_tokenizer)

    def out_opts(sp):
        sp.add_argument("--version", type=int, choices=(0, 1, 2, 3, 4), default=None,
                        help=".bin format: 0 legacy float32, 1 ak42 float32, 2 ak42 int8, 3 ak42 4-bit, "
                             "4 ak42 with RoPE theta/scaling and norm eps (weights as --encoding); default: 4 when "
                             "the model needs it or --encoding is given, else 0")
        sp.add_argument("--encoding", choices=tuple(ENCODINGS) + tuple(GGUF_ENCODINGS), default=None,
                        help="version 4 weights: float32 (default), int8 (Q8_0, --group-size), q4 (4-bit as "
                             "version 3); GGUF weights: f32, f16 (default), bf16, q8_0, q4_0")
        sp.add_argument("--group-size", type=int, default=None,
                        help="group size for versions 2, 3 and 4 int8/q4 (default 64 for int8, 32 for 4-bit; "
                             "halved until it divides dim and hidden_dim)")
        sp.add_argument("--tokenizer", metavar="FILE", default=None,
                        help="GGUF output: the vocabulary from tokenizer.model, tokenizer.json or a llama2.c "
                             "tokenizer.bin (default: the Hugging Face directory's own)")

    m = sub.add_parser("model", help="convert a model to a run.c checkpoint or (OUT.gguf) a GGUF model")
    m.add_argument("src", metavar="SRC", help="HF dir, Meta dir, llama2.c .pt, or run.c checkpoint")
    m.add_argument("output", metavar="OUT.bin|OUT.gguf")
    out_opts(m)
    m.add_argument("--seq-len", type=int, default=None, help="override the context length written in the header")
    m.set_defaults(func=cmd_model)

    r = sub.add_parser("random", help="deterministic random-weight checkpoint")
    r.add_argument("output", metavar="OUT.bin|OUT.gguf")
    r.add_argument("--shape", required=True,
                   help="%s or NAME=dim,hidden,layers,heads,kv_heads,vocab,seq" % "|".join(SHAPES))
    r.add_argument("--seed", type=int, default=0)
    g = r.add_mutually_exclusive_group()
    g.add_argument("--tied", action="store_true", help="share the classifier with the embedding")
    g.add_argument("--untied", action="store_true", help="write a separate classifier")
    out_opts(r)
    r.set_defaults(func=cmd_random)

    i = sub.add_parser("info", help="print the header of a checkpoint or tokenizer.bin, or describe a GGUF")
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
