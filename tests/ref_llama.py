#!/usr/bin/env python3
"""Plain numpy reference for llama2.c-style inference (float32 semantics).

Independent re-implementation of the behaviour of karpathy's llama2.c `run.c`
(forward pass, BPE tokenizer, sampler, generate loop), used by the test suites
to compute the exact stdout bytes `./run` is expected to print.

API (kept stable; other tests build on it):
    m = Model.load(path)            # legacy v0, "ak42" v1 (float32), v2 (int8, dequantised)
    m.config.dim, .hidden_dim, .n_layers, .n_heads, .n_kv_heads, .vocab_size, .seq_len
    cache = m.new_cache()           # cache.k / cache.v: (n_layers, seq_len, kv_dim) float32
    cache2 = cache.copy()
    logits = m.forward(token, pos, cache)   # float32 (vocab,), writes k/v at pos
    tok = Tokenizer.load(path, vocab_size)
    tok.encode(text_bytes, bos, eos) -> list of ids
    tok.decode(prev, token) -> bytes ; safe_piece(bytes) -> bytes actually printed
    s = Sampler(vocab_size, temperature, topp, seed); s.sample(logits)
    generate(model, tok, prompt_bytes, steps, temperature, topp, seed) -> stdout bytes

Accumulation order mimics the naive C loops (sequential float32 sums, done with
np.cumsum which accumulates left to right); transcendental functions are
evaluated in float64 and rounded to float32 (what a correctly rounded libm
gives).  Bit-exactness with an optimised C build is not expected, only equality
of the generated tokens away from near-ties.

CLI: python3 tests/ref_llama.py model.bin tokenizer.bin [-t T] [-p P] -s SEED [-n N] [-i prompt]
"""
import os
import struct
import sys

import numpy as np

F32 = np.float32


# ----------------------------------------------------------------------------
# float32 helpers mirroring the C loops

def _seqsum(a, axis=-1):
    """Sequential (left-to-right) float32 sum along axis, like `s += a[i]`."""
    a = np.asarray(a, dtype=F32)
    if BLAS_ORDER:
        return np.sum(a, axis=axis, dtype=F32)
    if a.shape[axis] == 0:
        shp = list(a.shape)
        del shp[axis]
        return np.zeros(shp, dtype=F32)
    return np.take(np.cumsum(a, axis=axis, dtype=F32), -1, axis=axis)


# REF_LLAMA_BLAS=1 switches matvec/attention sums to numpy's own (pairwise /
# BLAS) summation order: useful to see how sensitive a case is to rounding.
BLAS_ORDER = os.environ.get('REF_LLAMA_BLAS', '') not in ('', '0')


def matvec(w, x):
    """xout[i] = sum_j w[i, j] * x[j], accumulated sequentially in float32."""
    if BLAS_ORDER:
        return np.dot(w, x).astype(F32)
    return _seqsum(w * x[None, :], axis=1)


def q8_quantize(x, gs):
    """runq.c quantize(): per group scale = max|x| / 127, q = (int8) round(x / scale)."""
    g = x.reshape(-1, gs).astype(F32)
    wmax = np.abs(g).max(axis=1)
    scale = (wmax / F32(127.0)).astype(F32)
    with np.errstate(divide='ignore', invalid='ignore'):
        v = (g / scale[:, None]).astype(F32).astype(np.float64)
    v = np.where(np.isfinite(v), v, 0.0)
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int64)   # C round(): half away from 0
    return q, scale


def q8_matvec(qw, gs, x):
    """runq.c matmul(): per group int32 dot, val += (float)ival * ws * xs (sequential)."""
    wq, ws = qw
    d, n = wq.shape
    if n % gs:
        raise NotImplementedError('q8 activations need n %% group_size == 0 (n=%d, gs=%d)' % (n, gs))
    xq, xs = q8_quantize(x, gs)
    ival = (wq.astype(np.int64).reshape(d, n // gs, gs) * xq[None, :, :]).sum(axis=2)
    ws = ws.reshape(d, n // gs)
    terms = ((ival.astype(F32) * ws).astype(F32) * xs[None, :]).astype(F32)
    return _seqsum(terms, axis=1)


def rmsnorm(x, w):
    ss = _seqsum(x * x)
    ss = F32(ss / F32(x.shape[0]))
    ss = F32(ss + F32(1e-5))
    ss = F32(F32(1.0) / F32(np.sqrt(ss)))
    return (w * (ss * x)).astype(F32)


def _expf(x):
    return np.exp(np.asarray(x, dtype=np.float64)).astype(F32)


def softmax(x):
    x = np.asarray(x, dtype=F32)
    m = x.max(axis=-1, keepdims=True)
    e = _expf((x - m).astype(F32))
    s = _seqsum(e, axis=-1)
    return (e / np.expand_dims(s, -1)).astype(F32)


# ----------------------------------------------------------------------------
# model

class Config:
    def __init__(self, dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len):
        self.dim = dim
        self.hidden_dim = hidden_dim
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.vocab_size = vocab_size
        self.seq_len = seq_len

    @property
    def head_size(self):
        return self.dim // self.n_heads

    @property
    def kv_dim(self):
        return self.dim * self.n_kv_heads // self.n_heads

    def __repr__(self):
        return ("Config(dim=%d, hidden_dim=%d, n_layers=%d, n_heads=%d, n_kv_heads=%d, "
                "vocab_size=%d, seq_len=%d)" % (self.dim, self.hidden_dim, self.n_layers,
                                                 self.n_heads, self.n_kv_heads, self.vocab_size,
                                                 self.seq_len))


class KVCache:
    def __init__(self, k, v):
        self.k = k
        self.v = v

    def copy(self):
        return KVCache(self.k.copy(), self.v.copy())


class _Reader:
    def __init__(self, data, off):
        self.data = data
        self.off = off

    def f32(self, *shape):
        n = int(np.prod(shape))
        a = np.frombuffer(self.data, dtype='<f4', count=n, offset=self.off)
        self.off += 4 * n
        return a.astype(F32).reshape(shape)

    def q8(self, gs, *shape, raw=None):
        n = int(np.prod(shape))
        q = np.frombuffer(self.data, dtype=np.int8, count=n, offset=self.off)
        self.off += n
        s = np.frombuffer(self.data, dtype='<f4', count=n // gs, offset=self.off).astype(F32)
        self.off += 4 * (n // gs)
        if raw is not None:
            raw.append((q.reshape(shape), s))
        return (q.astype(F32).reshape(-1, gs) * s[:, None]).astype(F32).reshape(shape)

    def skip(self, nbytes):
        self.off += nbytes


class Model:
    # For version 2 files: False = weights dequantised to float32, float
    # activations (what the brief asks); True = llama2.c runq.c semantics
    # (activations quantised per group to int8 before every matmul).
    q8_activations = False

    def __init__(self, config, weights, version=0):
        self.config = config
        self.version = version
        self.w = weights
        c = config
        hs = c.head_size
        # RoPE frequencies, per element pair of q (over dim) - computed as in C
        i = np.arange(0, c.dim, 2)
        head_dim = (i % hs).astype(F32)
        expo = (head_dim / F32(hs)).astype(F32)
        self._freq = (F32(1.0) / np.power(10000.0, expo.astype(np.float64)).astype(F32)).astype(F32)

    # -- loading -------------------------------------------------------------
    @classmethod
    def load(cls, path):
        with open(path, 'rb') as f:
            data = f.read()
        magic = struct.unpack_from('<I', data, 0)[0]
        if magic == 0x616b3432:
            version = struct.unpack_from('<i', data, 4)[0]
            hdr = struct.unpack_from('<7i', data, 8)
            shared = data[36] != 0
            c = Config(*hdr)
            if version == 1:
                return cls._load_v1(data, c, shared)
            if version == 2:
                gs = struct.unpack_from('<i', data, 37)[0]
                return cls._load_v2(data, c, shared, gs)
            raise ValueError('unsupported ak42 version %d' % version)
        hdr = struct.unpack_from('<7i', data, 0)
        c = Config(*hdr)
        shared = c.vocab_size > 0
        c.vocab_size = abs(c.vocab_size)
        return cls._load_v0(data, c, shared)

    @classmethod
    def _load_v0(cls, data, c, shared):
        r = _Reader(data, 28)
        L, D, H, V, KV = c.n_layers, c.dim, c.hidden_dim, c.vocab_size, c.kv_dim
        w = {}
        w['emb'] = r.f32(V, D)
        w['rms_att'] = r.f32(L, D)
        w['wq'] = r.f32(L, D, D)
        w['wk'] = r.f32(L, KV, D)
        w['wv'] = r.f32(L, KV, D)
        w['wo'] = r.f32(L, D, D)
        w['rms_ffn'] = r.f32(L, D)
        w['w1'] = r.f32(L, H, D)
        w['w2'] = r.f32(L, D, H)
        w['w3'] = r.f32(L, H, D)
        w['rms_final'] = r.f32(D)
        r.skip(4 * c.seq_len * c.head_size // 2 * 2)
        w['wcls'] = w['emb'] if shared else r.f32(V, D)
        return cls(c, w, version=0)

    @classmethod
    def _load_v1(cls, data, c, shared):
        r = _Reader(data, 256)
        L, D, H, V, KV = c.n_layers, c.dim, c.hidden_dim, c.vocab_size, c.kv_dim
        w = {}
        w['rms_att'] = r.f32(L, D)
        w['rms_ffn'] = r.f32(L, D)
        w['rms_final'] = r.f32(D)
        w['emb'] = r.f32(V, D)
        w['wq'] = r.f32(L, D, D)
        w['wk'] = r.f32(L, KV, D)
        w['wv'] = r.f32(L, KV, D)
        w['wo'] = r.f32(L, D, D)
        w['w1'] = r.f32(L, H, D)
        w['w2'] = r.f32(L, D, H)
        w['w3'] = r.f32(L, H, D)
        w['wcls'] = w['emb'] if shared else r.f32(V, D)
        return cls(c, w, version=1)

    @classmethod
    def _load_v2(cls, data, c, shared, gs):
        # NOTE: dequantised to float32; runq.c additionally quantises activations.
        r = _Reader(data, 256)
        L, D, H, V, KV = c.n_layers, c.dim, c.hidden_dim, c.vocab_size, c.kv_dim
        w = {}
        qt = {}
        w['rms_att'] = r.f32(L, D)
        w['rms_ffn'] = r.f32(L, D)
        w['rms_final'] = r.f32(D)
        raw = []
        w['emb'] = r.q8(gs, V, D, raw=raw)
        qt['emb'] = raw[-1]
        for name, rows, cols in (('wq', D, D), ('wk', KV, D), ('wv', KV, D), ('wo', D, D),
                                 ('w1', H, D), ('w2', D, H), ('w3', H, D)):
            raw = []
            w[name] = np.stack([r.q8(gs, rows, cols, raw=raw) for _ in range(L)])
            qt[name] = raw
        if shared:
            w['wcls'] = w['emb']
            qt['wcls'] = qt['emb']
        else:
            raw = []
            w['wcls'] = r.q8(gs, V, D, raw=raw)
            qt['wcls'] = raw[-1]
        m = cls(c, w, version=2)
        m.group_size = gs
        m.q = qt
        return m

    # -- inference -----------------------------------------------------------
    def new_cache(self):
        c = self.config
        shape = (c.n_layers, c.seq_len, c.kv_dim)
        return KVCache(np.zeros(shape, dtype=F32), np.zeros(shape, dtype=F32))

    def _rope(self, vec, pos):
        n = vec.shape[0]
        val = (F32(pos) * self._freq[: n // 2]).astype(F32).astype(np.float64)
        fcr = np.cos(val).astype(F32)
        fci = np.sin(val).astype(F32)
        v0 = vec[0::2].copy()
        v1 = vec[1::2].copy()
        out = np.empty_like(vec)
        out[0::2] = v0 * fcr - v1 * fci
        out[1::2] = v0 * fci + v1 * fcr
        return out

    def _mv(self, name, layer, x):
        w = self.w[name] if layer is None else self.w[name][layer]
        if self.version == 2 and self.q8_activations:
            q = self.q[name] if layer is None else self.q[name][layer]
            return q8_matvec(q, self.group_size, x)
        return matvec(w, x)

    def forward(self, token, pos, cache):
        c = self.config
        w = self.w
        hs = c.head_size
        kvmul = c.n_heads // c.n_kv_heads
        if not (0 <= token < c.vocab_size):
            raise ValueError('token %d out of range' % token)
        if not (0 <= pos < c.seq_len):
            raise ValueError('pos %d out of range' % pos)
        x = w['emb'][token].astype(F32).copy()
        sqrt_hs = F32(np.sqrt(F32(hs)))
        for l in range(c.n_layers):
            xb = rmsnorm(x, w['rms_att'][l])
            q = self._mv('wq', l, xb)
            k = self._mv('wk', l, xb)
            v = self._mv('wv', l, xb)
            q = self._rope(q, pos)
            k = self._rope(k, pos)
            cache.k[l, pos] = k
            cache.v[l, pos] = v
            # attention, all heads at once
            qh = q.reshape(c.n_heads, hs)                              # (H, hs)
            K = cache.k[l, :pos + 1].reshape(pos + 1, c.n_kv_heads, hs)  # (T, KVH, hs)
            Vv = cache.v[l, :pos + 1].reshape(pos + 1, c.n_kv_heads, hs)
            kv_idx = np.arange(c.n_heads) // kvmul
            Kh = K[:, kv_idx, :].transpose(1, 0, 2)                    # (H, T, hs)
            Vh = Vv[:, kv_idx, :].transpose(1, 0, 2)                   # (H, T, hs)
            scores = _seqsum(qh[:, None, :] * Kh, axis=2)              # (H, T)
            scores = (scores / sqrt_hs).astype(F32)
            att = softmax(scores)                                      # (H, T)
            xo = _seqsum(att[:, :, None] * Vh, axis=1)                 # (H, hs)
            xb = xo.reshape(c.dim).astype(F32)
            x = (x + self._mv('wo', l, xb)).astype(F32)
            xb = rmsnorm(x, w['rms_ffn'][l])
            hb = self._mv('w1', l, xb)
            hb2 = self._mv('w3', l, xb)
            hb = (hb * (F32(1.0) / (F32(1.0) + _expf(-hb)))).astype(F32)
            hb = (hb * hb2).astype(F32)
            x = (x + self._mv('w2', l, hb)).astype(F32)
        x = rmsnorm(x, w['rms_final'])
        return self._mv('wcls', None, x)


# ----------------------------------------------------------------------------
# tokenizer

def _cstr(b):
    i = b.find(b'\0')
    return b if i < 0 else b[:i]


def _sscanf_hex_byte(piece):
    """C sscanf(piece, "<0x%02hhX>", &b) == 1 -> byte value, else None.

    Simplified glibc semantics: literal "<0x", then the %X conversion skips
    white space, takes an optional sign and up to 2 chars (incl. sign) of hex
    digits.  The trailing '>' is not required for a return value of 1.
    """
    if not piece.startswith(b'<0x'):
        return None
    s = piece[3:]
    i = 0
    while i < len(s) and s[i] in b' \t\n\v\f\r':
        i += 1
    s = s[i:]
    width = 2
    neg = False
    j = 0
    if s[:1] in (b'+', b'-'):
        neg = s[:1] == b'-'
        j = 1
    digits = b''
    while j < width and j < len(s) and s[j:j + 1] in b'0123456789abcdefABCDEF' and s[j:j + 1] != b'':
        digits += s[j:j + 1]
        j += 1
    if not digits:
        return None
    val = int(digits, 16)
    if neg:
        val = -val
    return val & 0xFF


class Tokenizer:
    def __init__(self, vocab, scores, max_token_length):
        self.vocab = vocab                          # raw bytes as stored
        self.cvocab = [_cstr(p) for p in vocab]     # as C strings
        self.scores = np.asarray(scores, dtype=F32)
        self.max_token_length = max_token_length
        self.vocab_size = len(vocab)
        self.lookup = {}
        self.duplicates = []
        for i, p in enumerate(self.cvocab):
            if p in self.lookup:
                self.duplicates.append((p, self.lookup[p], i))
                continue
            self.lookup[p] = i

    @classmethod
    def load(cls, path, vocab_size):
        with open(path, 'rb') as f:
            data = f.read()
        max_len = struct.unpack_from('<i', data, 0)[0]
        off = 4
        vocab, scores = [], []
        for _ in range(vocab_size):
            s, n = struct.unpack_from('<fi', data, off)
            off += 8
            vocab.append(data[off:off + n])
            off += n
            scores.append(s)
        return cls(vocab, scores, max_len)

    def str_lookup(self, b):
        return self.lookup.get(b, -1)

    def encode(self, text, bos=True, eos=False):
        if isinstance(text, str):
            text = text.encode('utf-8')
        text = _cstr(text)
        tokens = []
        if bos:
            tokens.append(1)
        if len(text) > 0:
            tokens.append(self.str_lookup(b' '))
        buf = bytearray()
        n = len(text)
        for idx in range(n):
            buf.append(text[idx])
            nxt = text[idx + 1] if idx + 1 < n else 0
            if (nxt & 0xC0) == 0x80 and len(buf) < 4:
                continue
            tid = self.str_lookup(bytes(buf))
            if tid != -1:
                tokens.append(tid)
            else:
                tokens.extend(b + 3 for b in buf)
            buf = bytearray()
        # BPE merges: best score wins, leftmost among equals
        scores = self.scores
        while True:
            best_score = F32(-1e10)
            best_id = -1
            best_idx = -1
            for i in range(len(tokens) - 1):
                a, b = tokens[i], tokens[i + 1]
                if a < 0 or b < 0:
                    continue
                tid = self.lookup.get(self.cvocab[a] + self.cvocab[b], -1)
                if tid != -1 and scores[tid] > best_score:
                    best_score = scores[tid]
                    best_id = tid
                    best_idx = i
            if best_idx == -1:
                break
            tokens[best_idx:best_idx + 2] = [best_id]
        if eos:
            tokens.append(2)
        return tokens

    def decode(self, prev_token, token):
        piece = self.cvocab[token]
        if prev_token == 1 and piece[:1] == b' ':
            piece = piece[1:]
        bv = _sscanf_hex_byte(piece)
        if bv is not None:
            piece = bytes([bv])
        return piece


def _c_isprint_or_space(b):
    return 0x20 <= b <= 0x7E or b in (0x09, 0x0A, 0x0B, 0x0C, 0x0D)


def safe_piece(piece):
    """Bytes that llama2.c's safe_printf writes for this piece."""
    if not piece or piece[0] == 0:
        return b''
    if len(piece) == 1 or piece[1] == 0:
        if not _c_isprint_or_space(piece[0]):
            return b''
    return _cstr(piece)


# ----------------------------------------------------------------------------
# sampler

MASK64 = (1 << 64) - 1


class Sampler:
    def __init__(self, vocab_size, temperature, topp, seed):
        self.vocab_size = vocab_size
        self.temperature = F32(temperature)
        self.topp = F32(topp)
        self.state = int(seed) & MASK64

    def random_u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK64
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & MASK64) >> 32

    def random_f32(self):
        return F32((self.random_u32() >> 8) / 16777216.0)

    def sample(self, logits):
        logits = np.asarray(logits, dtype=F32)
        if self.temperature == F32(0.0):
            return int(np.argmax(logits))
        probs = softmax((logits / self.temperature).astype(F32))
        coin = self.random_f32()
        if self.topp <= 0 or self.topp >= 1:
            return sample_mult(probs, coin)
        return sample_topp(probs, self.topp, coin)


def sample_mult(probs, coin):
    cdf = np.cumsum(probs, dtype=F32)
    hit = np.nonzero(coin < cdf)[0]
    return int(hit[0]) if hit.size else len(probs) - 1


def sample_topp(probs, topp, coin):
    n = len(probs)
    topp = F32(topp)
    cutoff = F32((F32(1.0) - topp) / F32(n - 1))
    cand = np.nonzero(probs >= cutoff)[0]
    order = np.argsort(-probs[cand], kind='stable')
    idx = cand[order]
    p = probs[idx]
    cum = np.cumsum(p, dtype=F32)
    over = np.nonzero(cum > topp)[0]
    last = int(over[0]) if over.size else len(idx) - 1
    r = F32(coin * cum[last])
    cdf = cum[:last + 1]
    hit = np.nonzero(r < cdf)[0]
    return int(idx[hit[0]]) if hit.size else int(idx[last])


# ----------------------------------------------------------------------------
# generation

def generate(model, tok, prompt, steps, temperature, topp, seed, return_tokens=False,
             stop_on_eos=False):
    """Exact stdout bytes of `run model -z tok -t T -p P -s S -n steps -i prompt`.

    temperature/topp/steps are taken as already validated by main()
    (use normalize_args() for the CLI clamping rules).  llama2.c stops only
    when BOS (1) is sampled; stop_on_eos=True also stops on EOS (2), a
    sampled EOS then being neither printed nor counted."""
    c = model.config
    if prompt is None:
        prompt = b''
    if isinstance(prompt, str):
        prompt = prompt.encode('utf-8')
    if steps == 0 or steps > c.seq_len:
        steps = c.seq_len
    sampler = Sampler(c.vocab_size, temperature, topp, seed)
    tokens = tok.encode(prompt, bos=True, eos=False)
    cache = model.new_cache()
    out = bytearray()
    emitted = []
    token = tokens[0]
    pos = 0
    while pos < steps:
        logits = model.forward(token, pos, cache)
        forced = pos < len(tokens) - 1
        if forced:
            nxt = tokens[pos + 1]
        else:
            nxt = sampler.sample(logits)
        pos += 1
        if nxt == 1 or (stop_on_eos and nxt == 2 and not forced):
            break
        out += safe_piece(tok.decode(token, nxt))
        emitted.append(nxt)
        token = nxt
    out += b'\n'
    if return_tokens:
        return bytes(out), emitted
    return bytes(out)


def normalize_args(temperature, topp, steps):
    """main()'s clamping in llama2.c."""
    temperature = F32(temperature)
    topp = F32(topp)
    if temperature < 0:
        temperature = F32(0.0)
    if topp < 0 or topp > 1:
        topp = F32(0.9)
    if steps < 0:
        steps = 0
    return temperature, topp, steps


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 1
    model_path = argv[1]
    tok_path = None
    temperature, topp, seed, steps, prompt = 1.0, 0.9, 0, 256, b''
    i = 2
    if i < len(argv) and not argv[i].startswith('-'):
        tok_path = argv[i]
        i += 1
    while i < len(argv):
        flag = argv[i]
        if i + 1 >= len(argv):
            sys.stderr.write('missing value for %s\n' % flag)
            return 1
        val = argv[i + 1]
        if flag == '-t':
            temperature = float(val)
        elif flag == '-p':
            topp = float(val)
        elif flag == '-s':
            seed = int(val)
        elif flag == '-n':
            steps = int(val)
        elif flag == '-i':
            prompt = val.encode('utf-8', 'surrogateescape')
        elif flag == '-z':
            tok_path = val
        else:
            sys.stderr.write('unknown flag %s\n' % flag)
            return 1
        i += 2
    if tok_path is None:
        tok_path = 'tokenizer.bin'
    if seed == 0:
        sys.stderr.write('ref_llama: a nonzero seed (-s) is required\n')
        return 1
    temperature, topp, steps = normalize_args(temperature, topp, steps)
    model = Model.load(model_path)
    tok = Tokenizer.load(tok_path, model.config.vocab_size)
    out = generate(model, tok, prompt, steps, temperature, topp, seed)
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
