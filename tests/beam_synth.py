#!/usr/bin/env python3
"""A small synthetic llama2.c checkpoint + tokenizer for the beam tests.

stories260K almost never makes EOS (id 2) likely, and its BOS candidates
rarely pile up, so some rules of the beam search (stop reason "eos", an
end-token candidate ranked B or later being dropped, many evictions) are
not exercised by it.  This writes a random-weight model (legacy v0 format,
shared classifier) whose BOS and EOS embedding rows are scaled up, which
makes end tokens frequent and context dependent, plus a 64-piece tokenizer.
Files are written from a fixed seed, so they are identical on every run.

    write_synth(dirpath) -> (model_path, tokenizer_path)
"""
import os
import struct

import numpy as np

VOCAB = 64
DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, SEQ_LEN = 32, 48, 2, 4, 2, 96
SEED = 2
END_SCALE = 2.0
WSCALE = 2.0


def pieces64():
    p = [b'<unk>', b'\n<s>\n', b'\n</s>\n', b' ']
    p += [bytes([c]) for c in range(ord('a'), ord('z') + 1)]
    p += [b' the', b' cat', b' dog', b' sat', b' ran', b' and', b' a', b'.', b',', b'!']
    p += [b' Lily', b' Tom', b' sun', b' big', b' red', b' sky', b' toy', b' play', b' home',
          b' saw', b' said', b' was', b' is', b' it', b' he', b' she', b' day', b'\n',
          b' one', b' fun', b' sad', b' hat', b' box', b' cup']
    assert len(p) == VOCAB, len(p)
    return p


def write_tokenizer(path):
    pieces = pieces64()
    with open(path, 'wb') as f:
        f.write(struct.pack('<i', max(len(x) for x in pieces)))
        for i, x in enumerate(pieces):
            # merged pieces get higher scores than single characters
            score = 0.0 if len(x) <= 1 else -float(i) / 100.0 + 1.0
            f.write(struct.pack('<fi', score, len(x)))
            f.write(x)


def write_model(path, seed=None, end_scale=None, wscale=None):
    seed = SEED if seed is None else seed
    end_scale = END_SCALE if end_scale is None else end_scale
    wscale = WSCALE if wscale is None else wscale
    rng = np.random.default_rng(seed)
    D, H, L, NH, KVH, V, S = DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ_LEN
    hs = D // NH
    kv = D * KVH // NH

    def rnd(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype('<f4')

    emb = rnd(V, D, scale=1.0)
    emb[1] *= end_scale
    emb[2] *= end_scale
    arrays = [
        emb,
        (1.0 + rnd(L, D, scale=0.1)).astype('<f4'),       # rms_att
        rnd(L, D, D, scale=wscale * D ** -0.5),  # wq
        rnd(L, kv, D, scale=wscale * D ** -0.5),  # wk
        rnd(L, kv, D, scale=wscale * D ** -0.5),  # wv
        rnd(L, D, D, scale=wscale * D ** -0.5),  # wo
        (1.0 + rnd(L, D, scale=0.1)).astype('<f4'),       # rms_ffn
        rnd(L, H, D, scale=wscale * D ** -0.5),  # w1
        rnd(L, D, H, scale=wscale * H ** -0.5),  # w2
        rnd(L, H, D, scale=wscale * D ** -0.5),  # w3
        (1.0 + rnd(D, scale=0.1)).astype('<f4'),          # rms_final
        np.zeros(S * hs // 2, dtype='<f4'),                # unused RoPE tables
        np.zeros(S * hs // 2, dtype='<f4'),
    ]
    with open(path, 'wb') as f:
        f.write(struct.pack('<7i', D, H, L, NH, KVH, V, S))   # V > 0: shared classifier
        for a in arrays:
            f.write(np.ascontiguousarray(a, dtype='<f4').tobytes())


def write_synth(dirpath):
    os.makedirs(dirpath, exist_ok=True)
    mp = os.path.join(dirpath, 'beam_synth_model.bin')
    tp = os.path.join(dirpath, 'beam_synth_tok.bin')
    write_model(mp)
    write_tokenizer(tp)
    return mp, tp


if __name__ == '__main__':
    import sys
    print(write_synth(sys.argv[1] if len(sys.argv) > 1 else '.'))
