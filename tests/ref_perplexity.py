#!/usr/bin/env python3
"""Plain numpy reference for checkpoint version 3 (4-bit weights) and for the
perplexity that `./run -m perplexity` prints.

Written from the format and the rule as documented (run.c's loader comment,
export.py's module doc, README), not from run.c's code:

  version 3 file: the 256-byte "ak42" header (magic, version 3, seven int32
  fields, the shared-classifier byte at 36, the int32 group size at 37), the
  norms in float32 (rms_att, rms_ffn, rms_final), then the embedding, wq, wk,
  wv, wo, w1, w2, w3 (per layer) and a separate classifier if not shared; each
  matrix is rows * cols / 2 bytes (byte k: value 2k in the low nibble, value
  2k + 1 in the high nibble, stored as q + 8) followed by rows * cols /
  group_size float32 scales; value = q * scale.

  perplexity: the text's tokens t_1..t_N after BOS; windows of seq_len - 1
  tokens, each run from position 0 as BOS + its tokens; every token is scored
  with log softmax of the logits at the position before it (float64);
  nll = mean of -log p, perplexity = exp(nll).

The forward pass is tests/ref_llama.py's (float32, with int8 activations per
group before every matmul for quantised files, as runq.c does).

API: load(path) -> ref_llama.Model (versions 0-3);
     dequantize_v3(path) -> dict name -> float32 array (for the format test);
     perplexity(model, tokens) -> (perplexity, n_tokens, nll)
CLI: ref_perplexity.py model.bin tokenizer.bin textfile  -> one JSON line
"""
import json
import struct
import sys

import numpy as np

import ref_llama as ref

F32 = np.float32


def _unpack_q4(data, off, rows, cols, gs):
    """(q int8 (rows, cols), scales float32 (rows * cols / gs), next offset)."""
    n = rows * cols
    packed = np.frombuffer(data, dtype=np.uint8, count=n // 2, offset=off)
    q = np.empty(n, dtype=np.int8)
    q[0::2] = (packed & 0x0F).astype(np.int8) - 8
    q[1::2] = (packed >> 4).astype(np.int8) - 8
    off += n // 2
    s = np.frombuffer(data, dtype='<f4', count=n // gs, offset=off).astype(F32)
    off += 4 * (n // gs)
    return q.reshape(rows, cols), s, off


def _read_v3(data):
    """Returns (Config, shared, gs, norms dict, list of (name, layer, q, s))."""
    magic, version = struct.unpack_from('<Ii', data, 0)
    assert magic == 0x616b3432 and version == 3, (magic, version)
    c = ref.Config(*struct.unpack_from('<7i', data, 8))
    shared = data[36] != 0
    gs = struct.unpack_from('<i', data, 37)[0]
    assert gs > 0 and gs % 2 == 0 and c.dim % gs == 0 and c.hidden_dim % gs == 0, gs
    L, D, H, V, KV = c.n_layers, c.dim, c.hidden_dim, c.vocab_size, c.kv_dim
    off = 256
    norms = {}
    for name, n in (('rms_att', L * D), ('rms_ffn', L * D), ('rms_final', D)):
        norms[name] = np.frombuffer(data, dtype='<f4', count=n, offset=off).astype(F32)
        off += 4 * n
    mats = []
    q, s, off = _unpack_q4(data, off, V, D, gs)
    mats.append(('emb', None, q, s))
    for name, rows, cols in (('wq', D, D), ('wk', KV, D), ('wv', KV, D), ('wo', D, D),
                             ('w1', H, D), ('w2', D, H), ('w3', H, D)):
        for layer in range(L):
            q, s, off = _unpack_q4(data, off, rows, cols, gs)
            mats.append((name, layer, q, s))
    if not shared:
        q, s, off = _unpack_q4(data, off, V, D, gs)
        mats.append(('wcls', None, q, s))
    assert off == len(data), 'file is %d bytes, layout ends at %d' % (len(data), off)
    return c, shared, gs, norms, mats


def _dequant(q, s, gs):
    rows, cols = q.shape
    return (q.astype(F32).reshape(-1, gs) * s[:, None]).astype(F32).reshape(rows, cols)


def dequantize_v3(path):
    """name (with [layer]) -> dequantised float32 matrix, straight from the file."""
    with open(path, 'rb') as f:
        data = f.read()
    _c, _shared, gs, _norms, mats = _read_v3(data)
    return {(n if l is None else '%s[%d]' % (n, l)): _dequant(q, s, gs) for n, l, q, s in mats}


def load(path):
    """A ref_llama.Model for any version; quantised files use int8 activations."""
    with open(path, 'rb') as f:
        data = f.read()
    if struct.unpack_from('<I', data, 0)[0] != 0x616b3432 or struct.unpack_from('<i', data, 4)[0] != 3:
        m = ref.Model.load(path)
        if m.version == 2:
            m.q8_activations = True
        return m
    c, shared, gs, norms, mats = _read_v3(data)
    L, D = c.n_layers, c.dim
    w = {'rms_att': norms['rms_att'].reshape(L, D), 'rms_ffn': norms['rms_ffn'].reshape(L, D),
         'rms_final': norms['rms_final']}
    qt = {}
    for name, layer, q, s in mats:
        if layer is None:
            w[name] = _dequant(q, s, gs)
            qt[name] = (q, s)
        else:
            w.setdefault(name, []).append(_dequant(q, s, gs))
            qt.setdefault(name, []).append((q, s))
    for name in ('wq', 'wk', 'wv', 'wo', 'w1', 'w2', 'w3'):
        w[name] = np.stack(w[name])
    if shared:
        w['wcls'], qt['wcls'] = w['emb'], qt['emb']
    # version 2 in ref_llama's terms: integer weights, per-group scales
    m = ref.Model(c, w, version=2)
    m.group_size = gs
    m.q = qt
    m.q8_activations = True
    return m


def log_prob(logits, token):
    x = logits.astype(np.float64)
    mx = x.max()
    return x[token] - mx - np.log(np.exp(x - mx).sum())


def perplexity(model, tokens):
    """tokens: the text's ids after BOS (BOS not included)."""
    window = model.config.seq_len - 1  # tokens per window after its BOS
    nll, n = 0.0, 0
    for start in range(0, len(tokens), window):
        chunk = [1] + list(tokens[start:start + window])
        cache = model.new_cache()
        for pos in range(len(chunk) - 1):
            logits = model.forward(chunk[pos], pos, cache)
            nll -= log_prob(logits, chunk[pos + 1])
            n += 1
    return float(np.exp(nll / n)), n, nll / n


def main(argv):
    model = load(argv[1])
    tok = ref.Tokenizer.load(argv[2], model.config.vocab_size)
    with open(argv[3], 'rb') as f:
        text = f.read()
    ids = tok.encode(text, bos=True, eos=False)
    ppl, n, nll = perplexity(model, ids[1:])
    print(json.dumps({'perplexity': ppl, 'tokens': n, 'nll': nll}))


if __name__ == '__main__':
    main(sys.argv)
