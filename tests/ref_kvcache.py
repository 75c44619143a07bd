#!/usr/bin/env python3
"""Numpy reference for run.c's key/value cache types (--kv-type) and for
generation past the context with attention sinks (--keep).

The model is tests/ref_llama.py's; only the cache differs. A stored row
goes through the type's conversion, written here from the definitions (not
from run.c):
  f16   IEEE half precision, round to nearest even (numpy's float16 cast);
  q8_0  groups of 32 consecutive values: scale = max|x| / 127 in float32,
        q = x / scale (float32) rounded half away from zero, 0 where the
        scale is 0; the value read back is q * scale in float32.

API:
    store(x, kv_type) -> the float32 values a row x reads back as
    greedy(model, tokens, steps, kv_type) -> (generated tokens, sum of their
        log-probabilities, count): greedy decoding as `run -t 0 -n steps`
    greedy_keep(model, tokens, steps, kv_type, keep, min_new) -> the same
        for `run -t 0 -n steps --keep keep --min-new-tokens min_new`, which
        goes past the context (steps may exceed seq_len)

--keep N, from its definition: a sequence's cache holds seq_len positions;
when it is full, each new token first drops the oldest position after the
first N, and positions are renumbered by slot: the key in (logical) slot j
attends as position j, the new query is at slot seq_len - 1. The storage is
run's documented one (run.c, kv_slot): the slots after the first N are a
ring of W = seq_len - N physical slots, logical slot j >= N living in
physical slot N + (j - N + shift) % W (shift: drops so far, mod W), and a
key is stored in the cache type already rotated (RoPE) at its physical slot
P. Here the key of logical slot j is read back and turned by j - P, so that
it is the key rotated at j, as the definition says (run turns the query
instead: the same numbers, rounded differently).
"""
import sys

import numpy as np

import ref_llama

F32 = np.float32


def store_f16(x):
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def store_q8_0(x):
    x = np.asarray(x, dtype=F32)
    g = x.reshape(-1, 32)
    scale = (np.max(np.abs(g), axis=1) / F32(127)).astype(F32)[:, None]
    safe = np.where(scale == 0, F32(1), scale)
    r = (g / safe).astype(F32).astype(np.float64)
    q = np.where(scale == 0, 0.0, np.sign(r) * np.floor(np.abs(r) + 0.5))
    return (q.astype(F32) * scale).astype(F32).reshape(x.shape)


def store(x, kv_type):
    if kv_type == 'f16':
        return store_f16(x)
    if kv_type == 'q8_0':
        return store_q8_0(x)
    return np.asarray(x, dtype=F32)


class StoredArray:
    """An (n_layers, positions, kv_dim) array whose rows are converted to the
    cache type when written (ref_llama's forward writes `a[l, pos] = row`)."""

    def __init__(self, shape, kv_type):
        self.a = np.zeros(shape, dtype=F32)
        self.kv_type = kv_type

    def __setitem__(self, idx, row):
        self.a[idx] = store(row, self.kv_type)

    def __getitem__(self, idx):
        return self.a[idx]


def new_cache(model, kv_type):
    c = model.config
    shape = (c.n_layers, c.seq_len, c.kv_dim)
    return ref_llama.KVCache(StoredArray(shape, kv_type), StoredArray(shape, kv_type))


def log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.sum(np.exp(x - m)))


def greedy(model, tokens, steps, kv_type):
    """Greedy decoding from the prompt tokens (BOS first) for `steps`
    positions: the generated tokens (stopping before BOS as run does) and
    the sum of their log-probabilities (a final BOS's included, as in run's
    JSON score)."""
    cache = new_cache(model, kv_type)
    out, logprob = [], 0.0
    token = tokens[0]
    for pos in range(steps):
        logits = model.forward(token, pos, cache)
        if pos < len(tokens) - 1:
            nxt = tokens[pos + 1]
        else:
            nxt = int(np.argmax(logits))
            logprob += log_softmax(logits)[nxt]
            if nxt == 1:
                break
            out.append(nxt)
        token = nxt
    return out, logprob


def rope_rows(model, x, positions):
    """Each row of x (T, n) rotated at its own position (RoPE, as ref_llama's
    _rope, which does one vector)."""
    n = x.shape[1]
    val = (np.asarray(positions, dtype=F32)[:, None] * model._freq[None, : n // 2]).astype(F32).astype(np.float64)
    fcr, fci = np.cos(val).astype(F32), np.sin(val).astype(F32)
    v0, v1 = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = v0 * fcr - v1 * fci
    out[:, 1::2] = v0 * fci + v1 * fcr
    return out


def forward_keep(model, token, pos, slots, cache):
    """ref_llama's forward for a token at logical position pos, whose
    logical slots 0..pos live in the physical slots `slots` (pos + 1 of them)
    of cache (k, v: StoredArray, physical slots)."""
    c = model.config
    w = model.w
    hs = c.head_size
    kvmul = c.n_heads // c.n_kv_heads
    x = w['emb'][token].astype(F32).copy()
    sqrt_hs = F32(np.sqrt(F32(hs)))
    slots = np.asarray(slots)
    turn = np.arange(pos + 1) - slots  # logical minus physical
    for l in range(c.n_layers):
        xb = ref_llama.rmsnorm(x, w['rms_att'][l])
        q = model._mv('wq', l, xb)
        k = model._mv('wk', l, xb)
        v = model._mv('wv', l, xb)
        q = model._rope(q, pos)
        cache.k[l, slots[pos]] = model._rope(k, slots[pos])
        cache.v[l, slots[pos]] = v
        keys = rope_rows(model, cache.k[l][slots], turn)       # (T, kv_dim), key j rotated at j
        values = cache.v[l][slots]
        qh = q.reshape(c.n_heads, hs)
        K = keys.reshape(pos + 1, c.n_kv_heads, hs)
        Vv = values.reshape(pos + 1, c.n_kv_heads, hs)
        kv_idx = np.arange(c.n_heads) // kvmul
        Kh = K[:, kv_idx, :].transpose(1, 0, 2)
        Vh = Vv[:, kv_idx, :].transpose(1, 0, 2)
        scores = (ref_llama._seqsum(qh[:, None, :] * Kh, axis=2) / sqrt_hs).astype(F32)
        att = ref_llama.softmax(scores)
        xb = ref_llama._seqsum(att[:, :, None] * Vh, axis=1).reshape(c.dim).astype(F32)
        x = (x + model._mv('wo', l, xb)).astype(F32)
        xb = ref_llama.rmsnorm(x, w['rms_ffn'][l])
        hb = model._mv('w1', l, xb)
        hb2 = model._mv('w3', l, xb)
        hb = (hb * (F32(1.0) / (F32(1.0) + ref_llama._expf(-hb)))).astype(F32)
        hb = (hb * hb2).astype(F32)
        x = (x + model._mv('w2', l, hb)).astype(F32)
    x = ref_llama.rmsnorm(x, w['rms_final'])
    return model._mv('wcls', None, x)


def greedy_keep(model, tokens, steps, kv_type, keep, min_new=0):
    """Greedy decoding past the context with `keep` attention sinks, for
    `steps` tokens in all (prompt included; the prompt fits the context).
    Until min_new tokens are generated, BOS and EOS (1, 2) are not chosen.
    Returns (generated tokens, sum of their log-probabilities, positions
    dropped)."""
    C = model.config.seq_len
    W = C - keep
    cache = new_cache(model, kv_type)
    out, logprob, shift, dropped = [], 0.0, 0, 0
    token = tokens[0]
    for i in range(steps):
        if i < C:
            pos = i
        else:
            shift, dropped, pos = (shift + 1) % W, dropped + 1, C - 1
        slots = [j if j < keep else keep + (j - keep + shift) % W for j in range(pos + 1)]
        logits = forward_keep(model, token, pos, slots, cache)
        if i < len(tokens) - 1:
            nxt = tokens[i + 1]
        else:
            logits = np.asarray(logits, dtype=F32).copy()
            if len(out) < min_new:
                logits[1] = logits[2] = -np.inf
            nxt = int(np.argmax(logits))
            logprob += log_softmax(logits)[nxt]
            if nxt == 1:
                break
            out.append(nxt)
        token = nxt
    return out, logprob, dropped


def main(argv):
    if len(argv) < 5:
        print('usage: ref_kvcache.py model.bin tok.bin kv_type steps [prompt]', file=sys.stderr)
        return 2
    m = ref_llama.Model.load(argv[1])
    tok = ref_llama.Tokenizer.load(argv[2], m.config.vocab_size)
    prompt = argv[5].encode() if len(argv) > 5 else b''
    toks, lp = greedy(m, tok.encode(prompt, bos=True, eos=False), int(argv[4]), argv[3])
    print(toks, lp)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
