"""An independent numpy reference for GGUF files (llama.cpp's format): a
reader, dequantisers, a writer of random test models and a forward pass for
the `llama` and `qwen2` architectures. Standard library and numpy only; it
shares no code with run.c.

Written from the format's facts as llama.cpp (snapshot of Feb 2025) states
them, read, not copied:
  - layout of the file: ggml/include/gguf.h (magic "GGUF", uint32 version,
    int64 tensor and KV counts, strings as uint64 length + bytes, arrays as
    element type + uint64 count, tensor infos name/n_dims/int64 ne[]/type/
    uint64 offset, the data section at the next multiple of
    `general.alignment` (uint32, default 32) after the infos, each tensor's
    offset relative to it and a multiple of the alignment);
  - value type and tensor type numbers and block sizes:
    gguf-py/gguf/constants.py (GGUFValueType, GGMLQuantizationType,
    GGML_QUANT_SIZES);
  - block structs: ggml/src/ggml-common.h; the arithmetic of each type:
    dequantize_row_* and get_scale_min_k4 in ggml/src/ggml-quants.c;
    IQ4_NL, IQ4_XS and MXFP4 from the Sep 2026 source (the same files,
    and ggml_e8m0_to_fp32_half in ggml/src/ggml-impl.h), MXFP4's values
    from the OCP E2M1 definition, not ggml's table of doubled values;
  - RoPE per architecture: llama_model_rope_type in src/llama-model.cpp
    (`llama` is LLAMA_ROPE_TYPE_NORM: adjacent pairs (x[2i], x[2i+1]);
    `qwen2` is LLAMA_ROPE_TYPE_NEOX: element i with i + n_rot/2), the
    rotation and its freq_factors in ggml_rope_cache_init
    (ggml/src/ggml-cpu/ggml-cpu.c: the angle of pair i is
    pos * base^(-2i/n_rot) / factor[i]); build_llama passes
    `rope_freqs.weight` as those factors, build_qwen2 passes none
    (src/llama.cpp), so qwen2 files carry no rope_freqs here;
  - tensors and shapes per architecture: load_tensors in
    src/llama-model.cpp (qwen2's q/k/v biases are required, llama's are
    optional; `output` absent means the classifier is token_embd).

Checked against llama.cpp itself (a scratch build of the same snapshot,
CPU, float32 KV cache, its logits for token ids at positions 0..n-1; not
part of the project, not needed by the tests). Errors are max |difference|
over all logits of 10 positions, relative to max |logit|:
  - files written by this module (dim 256, ffn 512, 2 layers, 4 heads with
    2 KV heads, vocab 300; llama untied with rope_freqs and theta 5e5,
    llama tied, qwen2 untied and tied), three random draws of each:
      F32: 1e-7 .. 3e-7 against forward() (both archs, tied and untied);
      every quantised type against forward(..., 'llamacpp'), which rounds
      the activations as llama.cpp's kernels do (matmul): 4e-8 .. 3e-7 for
      Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and BF16 when no
      activation lands on a rounding boundary; in the other draws one
      such flip of an int8 activation cascades through the later
      quantisations (3e-4 .. 2e-2, at most 1.1x the whole effect of the
      activation rounding, max |forward() - forward('llamacpp')|, which is
      5e-3 .. 2.6e-2). Against the exact forward() the quantised types
      differ by that effect, 3e-3 .. 2.6e-2.
      F16: 2e-4 from forward() and 4e-4 from the float16-activation
      emulation: llama.cpp's F16 path rounds somewhere this module does not
      model (not needed: run.c computes F16 weights in float32).
  - files made by llama.cpp's gguf-py writer and llama-quantize: of the
    29 first made (F32 .. Q6_K, Q4_K_S/M, Q5_K_S/M, with the Q5_0/Q5_1/Q8_0
    fallbacks), 27 within 3.5e-7 of forward(..., 'llamacpp') (F32, BF16
    and every quantised type), two (qwen2 Q4_K_M, Q5_K_S) 3e-3 and 1.4e-3
    (a flip, as above); the 9 kept in tests/gguf/ are all within 3.5e-7.
The emulation had to model llama.cpp's q8_1 blocks exactly for Q4_1/Q5_1:
their min term multiplies by float16(d * sum q), not by the sum of the
rounded activations (1.5e-2 apart otherwise).
"""

import struct

import numpy as np

# --- the numbers of the format -------------------------------------------------

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value types (GGUFValueType)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
SCALAR = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
          FLOAT32: "<f4", BOOL: "<u1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}

# tensor types: name -> (number, values per block, bytes per block)
QK_K = 256
TYPES = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q4_0": (2, 32, 2 + 16),
    "Q4_1": (3, 32, 2 + 2 + 16),
    "Q5_0": (6, 32, 2 + 4 + 16),
    "Q5_1": (7, 32, 2 + 2 + 4 + 16),
    "Q8_0": (8, 32, 2 + 32),
    "Q4_K": (12, QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": (13, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    "Q6_K": (14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    "BF16": (30, 1, 2),
    "IQ4_NL": (20, 32, 2 + 16),
    "IQ4_XS": (23, QK_K, 2 + 2 + QK_K // 64 + QK_K // 2),
    "MXFP4": (39, 32, 1 + 16),
}
TYPE_NAME = {v[0]: k for k, v in TYPES.items()}
EXACT_TYPES = ("F32", "F16", "BF16")

# The block structs of ggml-common.h as packed numpy records (field order is
# the struct's order; numpy records are unpadded, as these structs are).
BLOCK = {
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    "Q5_0": np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q5_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)]),
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_K": np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)]),
    "Q5_K": np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)]),
    "Q6_K": np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")]),
    "IQ4_NL": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "IQ4_XS": np.dtype([("d", "<f2"), ("scales_h", "<u2"), ("scales_l", "u1", 4), ("qs", "u1", 128)]),
    "MXFP4": np.dtype([("e", "u1"), ("qs", "u1", 16)]),
}
for _name, _dt in BLOCK.items():
    assert _dt.itemsize == TYPES[_name][2], _name


class GGUFError(Exception):
    pass


def type_of(t):
    """A tensor type as its name, from a name or a number."""
    if isinstance(t, str):
        return t
    if t not in TYPE_NAME:
        raise GGUFError("tensor type %d is not one this reference knows" % t)
    return TYPE_NAME[t]


def nbytes(t, n_values):
    _, bs, ts = TYPES[type_of(t)]
    if n_values % bs:
        raise GGUFError("%d values are not whole blocks of %s (%d)" % (n_values, type_of(t), bs))
    return n_values // bs * ts


# --- reading -------------------------------------------------------------------

class _Cursor:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, n, what):
        if n < 0 or self.pos + n > len(self.data):
            raise GGUFError("%s at byte %d runs past the end (%d bytes)" % (what, self.pos, len(self.data)))
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt, what):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def string(self, what):
        n = self.unpack("Q", what + " length")
        return bytes(self.take(n, what)).decode("utf-8", errors="surrogateescape")

    def value(self, vtype, what):
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            etype = self.unpack("I", what + " element type")
            count = self.unpack("Q", what + " count")
            if etype == STRING:
                return [self.string(what + "[%d]" % i) for i in range(count)]
            if etype == ARRAY:
                return [self.value(ARRAY, what + "[%d]" % i) for i in range(count)]
            if etype not in SCALAR:
                raise GGUFError("%s: unknown array element type %d" % (what, etype))
            dt = np.dtype(SCALAR[etype])
            arr = np.frombuffer(self.take(count * dt.itemsize, what), dtype=dt)
            return arr.astype(bool) if etype == BOOL else arr
        if vtype not in SCALAR:
            raise GGUFError("%s: unknown value type %d" % (what, vtype))
        v = np.frombuffer(self.take(np.dtype(SCALAR[vtype]).itemsize, what), dtype=SCALAR[vtype])[0]
        return bool(v) if vtype == BOOL else v.item()


class GGUF:
    """A parsed file: version, metadata {key: value}, types {key: value type},
    tensors {name: (type name, ne list, raw bytes)}, alignment, data_offset."""

    def __init__(self, version, metadata, types, tensors, alignment, data_offset, order):
        self.version, self.metadata, self.types = version, metadata, types
        self.tensors, self.alignment, self.data_offset, self.order = tensors, alignment, data_offset, order

    def array(self, name):
        """A tensor dequantised to float32, shaped (ne[-1], ..., ne[0])."""
        t, ne, raw = self.tensors[name]
        return dequantize(t, raw, int(np.prod(ne))).reshape(list(reversed(ne)))


def read_gguf(data):
    """Parse GGUF bytes (or a path). Raises GGUFError on anything malformed."""
    if isinstance(data, str):
        with open(data, "rb") as f:
            data = f.read()
    c = _Cursor(memoryview(data))
    if bytes(c.take(4, "magic")) != MAGIC:
        raise GGUFError("not a GGUF file (magic)")
    version = c.unpack("I", "version")
    if version not in (2, 3):
        raise GGUFError("GGUF version %d (2 and 3 are read)" % version)
    n_tensors = c.unpack("q", "tensor count")
    n_kv = c.unpack("q", "metadata count")
    if n_tensors < 0 or n_kv < 0:
        raise GGUFError("negative count")
    metadata, types = {}, {}
    for i in range(n_kv):
        key = c.string("key %d" % i)
        vtype = c.unpack("I", "type of " + key)
        if key in metadata:
            raise GGUFError("duplicated key " + key)
        metadata[key] = c.value(vtype, key)
        types[key] = vtype
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in types and types["general.alignment"] != UINT32:
        raise GGUFError("general.alignment is not a uint32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError("alignment %d is not a power of two" % alignment)
    infos, order = {}, []
    for i in range(n_tensors):
        name = c.string("tensor name %d" % i)
        n_dims = c.unpack("I", name + " n_dims")
        if n_dims > 4:
            raise GGUFError("%s has %d dimensions" % (name, n_dims))
        ne = [c.unpack("q", name + " ne") for _ in range(n_dims)]
        if any(n < 0 for n in ne):
            raise GGUFError("%s has a negative dimension" % name)
        ttype = c.unpack("I", name + " type")
        offset = c.unpack("Q", name + " offset")
        if name in infos:
            raise GGUFError("duplicated tensor " + name)
        infos[name] = (ttype, ne, offset)
        order.append(name)
    data_offset = -(-c.pos // alignment) * alignment
    tensors = {}
    for name in order:
        ttype, ne, offset = infos[name]
        if ttype not in TYPE_NAME:
            raise GGUFError("tensor %s has type %d, not one this reference reads" % (name, ttype))
        if offset % alignment:
            raise GGUFError("tensor %s offset %d is not a multiple of %d" % (name, offset, alignment))
        size = nbytes(ttype, int(np.prod(ne)) if ne else 1)
        start = data_offset + offset
        if start + size > len(data):
            raise GGUFError("tensor %s (%d bytes at %d) runs past the end (%d bytes)" % (name, size, start, len(data)))
        tensors[name] = (TYPE_NAME[ttype], ne, bytes(data[start:start + size]))
    return GGUF(version, metadata, types, tensors, alignment, data_offset, order)


# --- dequantising -----------------------------------------------------------------

def _f16(a):
    return a.astype(np.float32)


def _k4_scales(scales):
    """get_scale_min_k4 for all eight sub-blocks: (scale, min) arrays, each
    (n_blocks, 8), 6-bit values packed in 12 bytes."""
    q = scales.astype(np.uint8)
    sc, m = np.empty((len(q), 8), np.uint8), np.empty((len(q), 8), np.uint8)
    sc[:, :4] = q[:, 0:4] & 63
    m[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    m[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, m


def pack_k4_scales(sc, m):
    """The 12 bytes of eight 6-bit (scale, min) pairs, the inverse of
    _k4_scales: pairs 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
    (mins); pairs 4-7 as low nibbles in bytes 8-11 (scale low, min high)
    with their top two bits in the top bits of bytes 0-3 and 4-7."""
    sc, m = np.asarray(sc, np.uint8), np.asarray(m, np.uint8)
    q = np.empty((len(sc), 12), np.uint8)
    q[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    q[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    q[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return q


def _nibbles(qs):
    """(n, 16) bytes of 32-value blocks -> (n, 32): the low nibbles are values
    0..15, the high nibbles 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _k_quants(b, five_bits):
    """Q4_K and Q5_K: 4 chunks of 64 values; chunk c's 32 bytes give values
    0..31 (low nibbles, sub-block 2c) and 32..63 (high nibbles, sub-block
    2c+1); Q5_K's fifth bit of those is bit 2c resp. 2c+1 of qh[l]."""
    n = len(b)
    qs = b["qs"].reshape(n, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).astype(np.int32)  # (n, chunk, half, l)
    if five_bits:
        qh = b["qh"].reshape(n, 1, 1, 32).astype(np.int32)
        bit = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).reshape(1, 4, 2, 1)
        q = q + 16 * ((qh >> bit) & 1)
    sc, m = _k4_scales(b["scales"])
    d1 = _f16(b["d"])[:, None] * sc.astype(np.float32)          # d * sc, float32 as C does
    m1 = _f16(b["dmin"])[:, None] * m.astype(np.float32)
    y = d1.reshape(n, 4, 2, 1) * q.astype(np.float32) - m1.reshape(n, 4, 2, 1)
    return y.reshape(n, QK_K)


def _q6_k(b):
    """Q6_K: two halves of 128 values; in half h, for l < 32, the values l,
    l+32, l+64, l+96 are the low nibble of ql[l], low of ql[l+32], high of
    ql[l], high of ql[l+32], with bits 0-1, 2-3, 4-5, 6-7 of qh[l] on top,
    minus 32. Each run of 16 values has its own int8 scale."""
    n = len(b)
    ql = b["ql"].reshape(n, 2, 2, 32).astype(np.int32)    # (n, half, ql[l] / ql[l+32], l)
    qh = b["qh"].reshape(n, 2, 1, 32).astype(np.int32)
    lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    hi = (qh >> (2 * np.arange(4).reshape(1, 1, 4, 1))) & 3
    q = (lo | (hi << 4)) - 32                               # (n, half, quarter, l)
    sc = b["scales"].astype(np.float32).reshape(n, 16, 1)
    ds = _f16(b["d"]).reshape(n, 1, 1) * sc                  # (d * sc) first, as C does
    return (ds * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# IQ4_NL's and IQ4_XS's 16 values (kvalues_iq4nl in ggml-common.h)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_xs(b):
    """IQ4_XS: 8 runs of 32 codes, each as IQ4_NL's (16 bytes, low nibbles
    first); run g's 6-bit scale ls has its low 4 bits in nibble g % 2 of
    scales_l[g // 2] and its high 2 in bits 2g, 2g+1 of scales_h; value =
    (d * (ls - 32)) * table[code], the product d * (ls - 32) in float32 as
    dequantize_row_iq4_xs forms it."""
    n = len(b)
    g = np.arange(8)
    low = (b["scales_l"][:, g // 2].astype(np.int32) >> (4 * (g % 2))) & 15
    high = (b["scales_h"][:, None].astype(np.int32) >> (2 * g)) & 3
    dl = (_f16(b["d"])[:, None] * ((low | (high << 4)) - 32).astype(np.float32)).astype(np.float32)
    codes = _nibbles(b["qs"].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl[:, :, None] * IQ4_VALUES[codes]).reshape(n, QK_K)


def _e2m1(codes):
    """The OCP E2M1 value of 4-bit codes, from its definition: sign bit 3,
    exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 is subnormal
    (0 or 0.5). Values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    sign = np.where(codes & 8, -1.0, 1.0)
    exp, man = (codes >> 1) & 3, (codes & 1).astype(np.float64)
    mag = np.where(exp == 0, man * 0.5, np.ldexp(1.0 + man / 2, (exp - 1).astype(np.int32)))
    return sign * mag


def _mxfp4(b):
    """MXFP4: E8M0 byte e (the power of two 2^(e-127); e = 255, NaN to the
    OCP standard, is 2^127 to ggml, whose files these are), then 32 E2M1
    codes as IQ4_NL's; value = 2^(e-127) * E2M1(code), exact in float64,
    rounded once to float32 (so to infinity past float32's range, as ggml's
    float32 product does)."""
    scale = np.ldexp(1.0, b["e"].astype(np.int32) - 127)
    with np.errstate(over="ignore"):
        return (scale[:, None] * _e2m1(_nibbles(b["qs"]))).astype(np.float32)


def dequantize(t, raw, n_values):
    """float32 values of a tensor of type t (name or number) from its bytes."""
    t = type_of(t)
    raw = bytes(raw)
    if len(raw) != nbytes(t, n_values):
        raise GGUFError("%s: %d bytes for %d values" % (t, len(raw), n_values))
    if t == "F32":
        return np.frombuffer(raw, "<f4").astype(np.float32)
    if t == "F16":
        return np.frombuffer(raw, "<f2").astype(np.float32)
    if t == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    b = np.frombuffer(raw, BLOCK[t])
    n = len(b)
    if t == "Q8_0":
        y = _f16(b["d"])[:, None] * b["qs"].astype(np.float32)
    elif t in ("Q4_0", "Q4_1"):
        q = _nibbles(b["qs"]).astype(np.float32)
        if t == "Q4_0":
            y = (q - 8) * _f16(b["d"])[:, None]
        else:
            y = q * _f16(b["d"])[:, None] + _f16(b["m"])[:, None]
    elif t in ("Q5_0", "Q5_1"):
        high = ((b["qh"][:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)  # bit i: value i
        q = (_nibbles(b["qs"]).astype(np.int32) | (high << 4)).astype(np.float32)
        if t == "Q5_0":
            y = (q - 16) * _f16(b["d"])[:, None]
        else:
            y = q * _f16(b["d"])[:, None] + _f16(b["m"])[:, None]
    elif t in ("Q4_K", "Q5_K"):
        y = _k_quants(b, t == "Q5_K")
    elif t == "Q6_K":
        y = _q6_k(b)
    elif t == "IQ4_NL":
        y = _f16(b["d"])[:, None] * IQ4_VALUES[_nibbles(b["qs"])]
    elif t == "IQ4_XS":
        y = _iq4_xs(b)
    elif t == "MXFP4":
        y = _mxfp4(b)
    else:
        raise GGUFError("no dequantiser for " + t)
    assert y.shape[0] == n
    return y.astype(np.float32).reshape(-1)


# --- writing ---------------------------------------------------------------------

class Typed:
    """A metadata value with its GGUF type spelled out (elem for arrays)."""

    def __init__(self, vtype, value, elem=None):
        self.vtype, self.value, self.elem = vtype, value, elem


def _infer(value):
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(UINT32 if 0 <= value < 2 ** 32 else INT64, value)
    if isinstance(value, float):
        return Typed(FLOAT32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    if isinstance(value, (list, tuple, np.ndarray)):
        items = list(value)
        if items and all(isinstance(x, str) for x in items):
            return Typed(ARRAY, items, STRING)
        if items and all(isinstance(x, (float, np.floating)) for x in items):
            return Typed(ARRAY, items, FLOAT32)
        return Typed(ARRAY, items, INT32)
    raise TypeError("no GGUF type for %r" % (value,))


def _string(s):
    b = s.encode("utf-8", errors="surrogateescape") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _value(vtype, value, elem=None):
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        items = list(value)
        head = struct.pack("<IQ", elem, len(items))
        if elem == STRING:
            return head + b"".join(_string(x) for x in items)
        if elem == ARRAY:
            return head + b"".join(_value(ARRAY, x.value, x.elem) for x in items)
        return head + np.asarray(items).astype(SCALAR[elem]).tobytes()
    return np.asarray(value).astype(SCALAR[vtype]).tobytes()


def build_gguf(metadata, tensors, version=3, alignment=None):
    """GGUF bytes and their layout. metadata: {key: value or Typed} in
    order; tensors: [(name, type name, ne list, raw bytes)]. alignment:
    written as general.alignment when given. Returns (bytes, layout) where
    layout names the offsets the bad-input tests cut or patch: 'kv' (first
    key), 'infos' (first tensor info), 'data' (data section), and per
    tensor 'info:NAME' (its info), 'type:NAME' and 'offset:NAME' (those
    fields), 'tensor:NAME' (its bytes)."""
    align = alignment or DEFAULT_ALIGNMENT
    meta = dict(metadata)
    if alignment is not None:
        meta["general.alignment"] = Typed(UINT32, alignment)
    out = bytearray(MAGIC + struct.pack("<Iqq", version, len(tensors), len(meta)))
    layout = {"kv": len(out)}
    for key, v in meta.items():
        v = _infer(v)
        layout["key:" + key] = len(out)
        out += _string(key) + struct.pack("<I", v.vtype) + _value(v.vtype, v.value, v.elem)
    layout["infos"] = len(out)
    offset, offsets = 0, []
    for name, t, ne, raw in tensors:
        layout["info:" + name] = len(out)
        out += _string(name) + struct.pack("<I", len(ne)) + struct.pack("<%dq" % len(ne), *ne)
        layout["type:" + name] = len(out)
        out += struct.pack("<I", TYPES[t][0] if isinstance(t, str) else t)
        layout["offset:" + name] = len(out)
        out += struct.pack("<Q", offset)
        offsets.append(offset)
        offset += -(-len(raw) // align) * align
    out += bytes(-len(out) % align)
    layout["data"] = len(out)
    for (name, t, ne, raw), off in zip(tensors, offsets):
        layout["tensor:" + name] = len(out)
        assert len(out) == layout["data"] + off
        out += raw + bytes(-len(raw) % align)
    return bytes(out), layout


def write_gguf(path, metadata, tensors, version=3, alignment=None):
    data, layout = build_gguf(metadata, tensors, version, alignment)
    with open(path, "wb") as f:
        f.write(data)
    return layout


# --- random valid blocks ------------------------------------------------------------

def _f16s(rng, n, mean):
    """n positive float16 scales around mean (x0.5 .. x1.5)."""
    return (mean * rng.uniform(0.5, 1.5, n)).astype(np.float16)


def random_tensor(t, n_values, rng, std=0.05):
    """Raw bytes of n_values of type t: random quant bits, scales chosen so
    that the values have roughly the standard deviation std (a trained
    weight's magnitude); every bit pattern of the quants is fair game."""
    t = type_of(t)
    if t in EXACT_TYPES:
        x = rng.normal(0, std, n_values).astype(np.float32)
        if t == "F32":
            return x.tobytes()
        if t == "F16":
            return x.astype("<f2").tobytes()
        return (x.view(np.uint32) >> 16).astype("<u2").tobytes()  # truncated to bfloat16
    n = nbytes(t, n_values) // BLOCK[t].itemsize
    b = np.zeros(n, BLOCK[t])
    for field in BLOCK[t].names:
        if field in ("d", "m", "dmin", "e"):
            continue
        shape = b[field].shape
        top = 2 ** 32 if field == "qh" and t in ("Q5_0", "Q5_1") else 2 ** 16 if field == "scales_h" else 256
        bits = rng.integers(0, top, size=shape, dtype=np.uint64)
        b[field] = bits.astype(b[field].dtype)
    # quant spreads: q8 ~74, 4-bit ~4.6, 5-bit ~9.2, 6-bit ~18.5 (uniform);
    # K types multiply by 6-bit (0..63, ~32) or int8 (~74) sub-block scales
    if t == "Q8_0":
        b["d"] = _f16s(rng, n, std / 74)
    elif t in ("Q4_0", "Q5_0"):
        b["d"] = _f16s(rng, n, std / (4.6 if t == "Q4_0" else 9.2))
    elif t in ("Q4_1", "Q5_1"):
        span = 15 if t == "Q4_1" else 31
        d = _f16s(rng, n, std / (span / 3.46))
        b["d"] = d
        b["m"] = (-d.astype(np.float32) * span / 2 * rng.uniform(0.8, 1.2, n)).astype(np.float16)
    elif t in ("Q4_K", "Q5_K"):
        # as a quantiser leaves them: each sub-block's min near half its
        # scale's span (values about centred), so dmin = d * span / 2 and
        # the 6-bit min a few steps from the 6-bit scale
        span = 15 if t == "Q4_K" else 31
        d = _f16s(rng, n, std / (span / 3.46) / 40)
        b["d"] = d
        b["dmin"] = (d.astype(np.float32) * span / 2).astype(np.float16)
        sc = rng.integers(16, 64, (n, 8))
        m = np.clip(sc + rng.integers(-4, 5, (n, 8)), 0, 63)
        b["scales"] = pack_k4_scales(sc, m)
    elif t == "Q6_K":
        b["d"] = _f16s(rng, n, std / 18.5 / 74)
    elif t == "IQ4_NL":
        # the table's values spread ~68; a quantiser's d takes either sign
        b["d"] = _f16s(rng, n, std / 68) * rng.choice(np.array([-1, 1], np.float16), n)
    elif t == "IQ4_XS":
        # random 6-bit scales: ls - 32 spreads ~18
        b["d"] = _f16s(rng, n, std / 68 / 18)
    elif t == "MXFP4":
        # E2M1 values spread ~2.9: the power of two nearest std / 2.9, or one either side
        b["e"] = 127 + np.round(np.log2(std / 2.9)).astype(int) + rng.integers(-1, 2, n)
    return b.tobytes()


# --- a vocabulary llama.cpp accepts --------------------------------------------------

def spm_vocab(n_vocab):
    """A small SentencePiece ("llama") vocabulary of n_vocab >= 262 tokens:
    <unk>, <s>, </s>, the 256 byte tokens <0x00>..<0xFF> (type 6) and
    pieces of letters. Returns metadata entries."""
    assert n_vocab >= 262
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += ["<0x%02X>" % i for i in range(256)]
    types += [6] * 256
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pieces = ["\u2581" + c for c in letters] + list(letters)
    pieces += ["\u2581" + a + b for a in letters for b in letters]
    tokens += pieces[:n_vocab - len(tokens)]
    types += [1] * (n_vocab - len(types))
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(n_vocab - 259)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": Typed(ARRAY, tokens, STRING),
        "tokenizer.ggml.scores": Typed(ARRAY, scores, FLOAT32),
        "tokenizer.ggml.token_type": Typed(ARRAY, types, INT32),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


# --- random models ----------------------------------------------------------------------

def random_model(arch="llama", wtype="F32", dim=256, ffn=512, n_layers=2, n_heads=4, n_kv_heads=2,
                 vocab=300, ctx=128, theta=10000.0, eps=1e-5, tied=False, rope_freqs=False,
                 seed=0, types=None, vocab_meta=True, version=3, alignment=None):
    """(metadata, tensors) of a random model. wtype: every matrix's type;
    types: {tensor name or 'blk.*.suffix' pattern's suffix: type} overrides
    (a K mix); norms, biases and rope factors are float32 as llama.cpp
    stores them."""
    rng = np.random.default_rng(seed)
    head_dim = dim // n_heads
    types = types or {}
    meta = {
        "general.architecture": arch,
        "general.name": "gguf_ref random %s %s" % (arch, wtype),
        arch + ".context_length": ctx,
        arch + ".embedding_length": dim,
        arch + ".block_count": n_layers,
        arch + ".feed_forward_length": ffn,
        arch + ".attention.head_count": n_heads,
        arch + ".attention.head_count_kv": n_kv_heads,
        arch + ".rope.dimension_count": head_dim,
        arch + ".rope.freq_base": float(theta),
        arch + ".attention.layer_norm_rms_epsilon": float(eps),
    }
    if vocab_meta:
        meta.update(spm_vocab(vocab))
    tensors = []

    def mat(name, rows, cols, std=0.05):
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        t = types.get(name, types.get(suffix, wtype))
        tensors.append((name, t, [cols, rows], random_tensor(t, rows * cols, rng, std)))

    def vec(name, n, mean, std):
        tensors.append((name, "F32", [n], (mean + rng.normal(0, std, n)).astype("<f4").tobytes()))

    mat("token_embd.weight", vocab, dim, std=0.5)
    if rope_freqs:
        # Llama 3.1's factors are 1 for the high frequencies and up to 8 for
        # the low ones, whose angles a short test sequence barely turns: so
        # here every pair gets a factor in 1..8, that the first positions see
        f = rng.uniform(1.0, 8.0, head_dim // 2)
        tensors.append(("rope_freqs.weight", "F32", [head_dim // 2], f.astype("<f4").tobytes()))
    for l in range(n_layers):
        p = "blk.%d." % l
        vec(p + "attn_norm.weight", dim, 1.0, 0.1)
        mat(p + "attn_q.weight", n_heads * head_dim, dim)
        mat(p + "attn_k.weight", n_kv_heads * head_dim, dim)
        mat(p + "attn_v.weight", n_kv_heads * head_dim, dim)
        if arch == "qwen2":
            vec(p + "attn_q.bias", n_heads * head_dim, 0.0, 0.3)
            vec(p + "attn_k.bias", n_kv_heads * head_dim, 0.0, 0.3)
            vec(p + "attn_v.bias", n_kv_heads * head_dim, 0.0, 0.3)
        mat(p + "attn_output.weight", dim, n_heads * head_dim)
        vec(p + "ffn_norm.weight", dim, 1.0, 0.1)
        mat(p + "ffn_gate.weight", ffn, dim)
        mat(p + "ffn_up.weight", ffn, dim)
        mat(p + "ffn_down.weight", dim, ffn)
    vec("output_norm.weight", dim, 1.0, 0.1)
    if not tied:
        mat("output.weight", vocab, dim)
    return meta, tensors


# --- the forward pass ----------------------------------------------------------------------

def hparams(meta):
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise GGUFError("architecture %r is not llama or qwen2" % arch)
    g = lambda k, d=None: meta.get(arch + "." + k, d)
    dim, heads = g("embedding_length"), g("attention.head_count")
    return dict(arch=arch, dim=dim, ffn=g("feed_forward_length"), n_layers=g("block_count"), n_heads=heads,
                n_kv_heads=g("attention.head_count_kv", heads), head_dim=dim // heads,
                n_rot=g("rope.dimension_count", dim // heads), theta=g("rope.freq_base", 10000.0),
                eps=g("attention.layer_norm_rms_epsilon"), ctx=g("context_length"))


def quantize_groups(x, group, even=False, float32=False):
    """8-bit activations as the integer kernels make them: per group of
    `group` consecutive inputs, d = max|x| / 127 and q = round(x / d), half
    away from zero (or to even with even=True, llama.cpp's SIMD rounding;
    float32=True also computes in float32 as it does, x * (127 / max)).
    Returns (q, d): q shaped (rows, groups, group), d (rows, groups, 1); a
    group of zeros has d = 0 and q = 0."""
    g = x.reshape(len(x), -1, group)
    if float32:
        g = g.astype(np.float32)
        amax = np.abs(g).max(axis=-1, keepdims=True)
        d = amax / np.float32(127)
        r = g * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    else:
        g = g.astype(np.float64)
        d = np.abs(g).max(axis=-1, keepdims=True) / 127.0
        r = g / np.where(d > 0, d, 1.0)
    q = np.round(r) if even else np.sign(r) * np.floor(np.abs(r) + 0.5)
    return q.astype(np.float64), d.astype(np.float64)


def quantize_activation(x, group, scale_dtype=np.float64, even=False, float32=False):
    """x as the kernels see it after quantize_groups: q * d, with d stored
    as scale_dtype (llama.cpp's q8_0 and q8_1 blocks keep it as float16)."""
    q, d = quantize_groups(x, group, even, float32)
    return (q * d.astype(scale_dtype).astype(np.float64)).reshape(x.shape)


MIN_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")   # value = scale * n + min, n >= 0
MID = {"Q4_1": 8, "Q5_1": 16, "Q4_K": 8, "Q5_K": 16}


def group_scale_min(t, raw, rows):
    """The (rows, cols/32) scale and min of each 32-value group of a type
    with a minimum: value = scale * n + min, n unsigned."""
    b = np.frombuffer(raw, BLOCK[t])
    if t in ("Q4_1", "Q5_1"):
        scale, mn = _f16(b["d"])[:, None], _f16(b["m"])[:, None]
    else:
        sc, m = _k4_scales(b["scales"])
        scale = _f16(b["d"])[:, None] * sc.astype(np.float32)
        mn = -(_f16(b["dmin"])[:, None] * m.astype(np.float32))
    return scale.astype(np.float64).reshape(rows, -1), mn.astype(np.float64).reshape(rows, -1)


def _bf16_round(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16     # to nearest, ties to even
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def matmul(x, w, t, groups=None, kind=None):
    """x @ w.T for a weight of type t as an engine computes it, kind:
    None: exact (float64 throughout);
    'runc': run.c's integer kernels as the project states them: int8 per
      group of 32 (16 for Q6_K), float scale, half away from zero; the
      types with a minimum split each value as scale * (n - mid) + (min +
      mid * scale), mid the middle of n's range, the first part on the int8
      activations and the second on the float sum of the group's inputs;
      float weights see float32 activations;
    'runc_bf16': the same, but BF16 weights see bfloat16 activations (round
      to nearest even), as run.c's bfloat16 dot products (vdpbf16ps) take
      them where the machine has them;
    'llamacpp': llama.cpp's CPU kernels (ggml-cpu-quants.c): q8_0 blocks
      of 32 with float16 scales for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, q8_1 for
      Q4_1/Q5_1 whose min term takes the block's sum as float16(d * sum q),
      q8_K blocks of 256 with a float scale for the K types and IQ4_XS; round to even in float32; F16
      weights see float16 activations, BF16 ones bfloat16.
    groups: for the types with a minimum, group_scale_min's (scale, min)."""
    if kind is None:
        return x @ w.T
    if kind == "runc_bf16" and t == "BF16":
        return _bf16_round(x) @ w.T
    if kind in ("runc", "runc_bf16"):
        if t in EXACT_TYPES:
            return x.astype(np.float32).astype(np.float64) @ w.T
        xq = quantize_activation(x, 16 if t == "Q6_K" else 32)
        if t not in MIN_TYPES:
            return xq @ w.T
        offset = groups[1] + MID[t] * groups[0]
        sums = x.reshape(len(x), -1, 32).sum(axis=-1)
        return xq @ (w - np.repeat(offset, 32, axis=1)).T + sums @ offset.T
    if kind != "llamacpp":
        raise ValueError(kind)
    if t == "F32":
        return x.astype(np.float32).astype(np.float64) @ w.T
    if t == "F16":
        return x.astype(np.float16).astype(np.float64) @ w.T
    if t == "BF16":
        return _bf16_round(x) @ w.T
    if t.endswith("_K") or t == "IQ4_XS":
        return quantize_activation(x, QK_K, np.float32, even=True, float32=True) @ w.T
    q, d = quantize_groups(x, 32, even=True, float32=True)
    xq = (q * d.astype(np.float16).astype(np.float64)).reshape(x.shape)
    if t not in MIN_TYPES:
        return xq @ w.T
    # the scaled part without the minima, then each block's min times the
    # float16 sum the q8_1 block carries
    mins = groups[1]
    sums = (d[..., 0].astype(np.float32) * q.sum(axis=-1).astype(np.float32)).astype(np.float16)
    return xq @ (w - np.repeat(mins, 32, axis=1)).T + sums.astype(np.float64) @ mins.T


class Model:
    """The weights of a parsed GGUF, dequantised once (float64)."""

    def __init__(self, gguf):
        self.g = gguf
        self.hp = hparams(gguf.metadata)
        self.w, self.t, self.groups = {}, {}, {}
        for name, (t, ne, raw) in gguf.tensors.items():
            self.w[name] = gguf.array(name).astype(np.float64)
            self.t[name] = t
            if t in MIN_TYPES:
                self.groups[name] = group_scale_min(t, raw, ne[1])

    def has(self, name):
        return name in self.w


def _rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, hp, factors):
    """x: (T, heads, head_dim) rotated in place of its first n_rot dims."""
    n_rot = hp["n_rot"]
    i = np.arange(n_rot // 2)
    inv = hp["theta"] ** (-2.0 * i / n_rot)
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None] * inv[None, :]                   # (T, n_rot/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if hp["arch"] == "llama":                           # adjacent pairs
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    else:                                               # halves (NeoX)
        a, b = x[..., :n_rot // 2], x[..., n_rot // 2:n_rot]
        out[..., :n_rot // 2] = a * cos - b * sin
        out[..., n_rot // 2:n_rot] = a * sin + b * cos
    return out


def forward(model, tokens, activations=None):
    """Logits (len(tokens), vocab) for tokens at positions 0..n-1, causal.
    activations: None (exact float64), 'runc', 'runc_bf16' or 'llamacpp': each matmul
    as that engine's kernels compute it (see matmul)."""
    hp, w, wt = model.hp, model.w, model.t
    tokens = np.asarray(tokens)
    T, nh, nkv, hd = len(tokens), hp["n_heads"], hp["n_kv_heads"], hp["head_dim"]
    pos = np.arange(T, dtype=np.float64)

    def mm(x, name):
        y = matmul(x, w[name], wt[name], model.groups.get(name), activations)
        bias = name[:-len("weight")] + "bias"
        return y + w[bias] if bias in w else y

    factors = w.get("rope_freqs.weight") if hp["arch"] == "llama" else None
    x = w["token_embd.weight"][tokens]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(hp["n_layers"]):
        p = "blk.%d." % l
        h = _rmsnorm(x, w[p + "attn_norm.weight"], hp["eps"])
        q = _rope(mm(h, p + "attn_q.weight").reshape(T, nh, hd), pos, hp, factors)
        k = _rope(mm(h, p + "attn_k.weight").reshape(T, nkv, hd), pos, hp, factors)
        v = mm(h, p + "attn_v.weight").reshape(T, nkv, hd)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)   # head j reads kv head j // rep
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + mm(o, p + "attn_output.weight")
        h = _rmsnorm(x, w[p + "ffn_norm.weight"], hp["eps"])
        gate, up = mm(h, p + "ffn_gate.weight"), mm(h, p + "ffn_up.weight")
        x = x + mm(gate / (1 + np.exp(-gate)) * up, p + "ffn_down.weight")
    x = _rmsnorm(x, w["output_norm.weight"], hp["eps"])
    return mm(x, "output.weight" if "output.weight" in w else "token_embd.weight")


def logits_of(path_or_bytes, tokens, activations=None):
    return forward(Model(read_gguf(path_or_bytes)), tokens, activations)
