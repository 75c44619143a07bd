"""Test fixtures for tests/test_export.py (not a test suite itself).

Everything here is written independently of export.py so that the tests do
not check export.py against itself: a safetensors writer, a bf16 encoder,
HF's forward q/k permutation, a llama2.c tokenizer writer, a reader for the
three run.c checkpoint layouts and a numpy forward pass in run.c's
conventions (adjacent-pair RoPE, RMSNorm eps 1e-5, SwiGLU, GQA).
"""

import json
import os
import struct

import numpy as np

MAGIC = 0x616B3432


# --- weights -----------------------------------------------------------------

def bf16_round(x):
    """float32 -> (uint16 bf16 bits, float32 values those bits stand for),
    rounding to nearest even (no NaNs expected here)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    bits = (u >> 16).astype(np.uint16)
    vals = (bits.astype(np.uint32) << 16).view(np.float32)
    return bits, vals


def hf_permute(w, n_heads):
    """What HF's Llama conversion does to Meta's q/k weights: within each head,
    rows (2i, 2i+1) -> rows (i, i + head_dim/2)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, hd // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def make_meta_weights(cfg, seed, scale=0.3, shared=True):
    """Random weights in Meta/llama2.c naming (adjacent-pair RoPE layout),
    float32. Row 1 (BOS) of the classifier is damped so greedy decoding
    rarely stops early."""
    rng = np.random.default_rng(seed)
    dim, hid, L = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"]
    hd = dim // cfg["n_heads"]
    kv = hd * cfg["n_kv_heads"]
    V = cfg["vocab_size"]

    def mat(r, c, s=None):
        return (rng.standard_normal((r, c)) * (s if s is not None else scale / np.sqrt(c) * 3)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    # a tied embedding is kept small next to what the layers add, or the
    # classifier just repeats the input token
    w = {"tok_embeddings.weight": mat(V, dim, 0.05 if shared else 1.0), "norm.weight": norm(dim)}
    for l in range(L):
        p = "layers.%d." % l
        w[p + "attention_norm.weight"] = norm(dim)
        w[p + "ffn_norm.weight"] = norm(dim)
        w[p + "attention.wq.weight"] = mat(dim, dim)
        w[p + "attention.wk.weight"] = mat(kv, dim)
        w[p + "attention.wv.weight"] = mat(kv, dim)
        w[p + "attention.wo.weight"] = mat(dim, dim)
        w[p + "feed_forward.w1.weight"] = mat(hid, dim)
        w[p + "feed_forward.w2.weight"] = mat(dim, hid)
        w[p + "feed_forward.w3.weight"] = mat(hid, dim)
    if shared:
        w["tok_embeddings.weight"][1] *= 0.01
    else:
        out = mat(V, dim, 1.0)
        out[1] *= 0.01
        w["output.weight"] = out
    return w


META_TO_HF = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def meta_to_hf(w, cfg):
    """Meta naming/layout -> HF naming/layout (q/k permuted for rotate-half)."""
    out = {}
    for k, v in w.items():
        if k.startswith("layers."):
            _, l, rest = k.split(".", 2)
            name = "model.layers.%s.%s" % (l, META_TO_HF[rest])
            if rest == "attention.wq.weight":
                v = hf_permute(v, cfg["n_heads"])
            elif rest == "attention.wk.weight":
                v = hf_permute(v, cfg["n_kv_heads"])
        else:
            name = META_TO_HF[k]
        out[name] = v
    return out


def hf_config(cfg, tied, **extra):
    c = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg["dim"],
        "intermediate_size": cfg["hidden_dim"],
        "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["n_heads"],
        "num_key_value_heads": cfg["n_kv_heads"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["seq_len"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    c.update(extra)
    return c


# --- safetensors writer --------------------------------------------------------

def safetensors_bytes(tensors, dtype="F32"):
    """tensors: name -> float32 array. dtype: F32, F16 or BF16 for all.
    Returns (file bytes, dict name -> float32 values actually stored)."""
    header = {"__metadata__": {"format": "pt"}}
    blobs = []
    stored = {}
    off = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        if dtype == "F32":
            raw, vals = a.astype("<f4").tobytes(), a
        elif dtype == "F16":
            h = a.astype("<f2")
            raw, vals = h.tobytes(), h.astype(np.float32)
        elif dtype == "BF16":
            bits, vals = bf16_round(a)
            raw = bits.astype("<u2").tobytes()
        else:
            raise ValueError(dtype)
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        stored[name] = vals.reshape(a.shape)
        off += len(raw)
    h = json.dumps(header).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs), stored


# --- tokenizer -----------------------------------------------------------------

def tokenizer_bytes(vocab_size):
    """A llama2.c tokenizer whose pieces are '<t%d>': unique, printable, no
    spaces, so generated text maps back to token ids."""
    pieces = [("<t%d>" % i).encode() for i in range(vocab_size)]
    out = [struct.pack("<i", max(len(p) for p in pieces))]
    for i, p in enumerate(pieces):
        out.append(struct.pack("<fi", float(-i), len(p)) + p)
    return b"".join(out)


def tokenizer_file(path, vocab_size):
    """tokenizer_bytes(vocab_size) written at path once; returns path."""
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(tokenizer_bytes(vocab_size))
    return path


# --- run.c checkpoint reader ---------------------------------------------------

def read_checkpoint(path):
    """Read any run.c checkpoint into (cfg, weights) with weights in float32
    (dequantised for version 2). Layer tensors are stacked (L, ...)."""
    data = open(path, "rb").read()
    if struct.unpack("<I", data[:4])[0] == MAGIC:
        version = struct.unpack("<i", data[4:8])[0]
        dim, hid, L, nh, nkv, V, seq = struct.unpack("<7i", data[8:36])
        shared = bool(data[36])
        gs = struct.unpack("<i", data[37:41])[0] if version == 2 else None
        pos = 256
    else:
        version = 0
        dim, hid, L, nh, nkv, V, seq = struct.unpack("<7i", data[:28])
        shared = V > 0
        V = abs(V)
        gs = None
        pos = 28
    cfg = dict(dim=dim, hidden_dim=hid, n_layers=L, n_heads=nh, n_kv_heads=nkv,
               vocab_size=V, seq_len=seq, shared=shared, version=version, group_size=gs)
    hd = dim // nh
    kv = hd * nkv
    shapes = {"emb": (V, dim), "rms_att": (L, dim), "rms_ffn": (L, dim), "rms_final": (dim,),
              "wq": (L, dim, dim), "wk": (L, kv, dim), "wv": (L, kv, dim), "wo": (L, dim, dim),
              "w1": (L, hid, dim), "w2": (L, dim, hid), "w3": (L, hid, dim), "cls": (V, dim)}
    w = {}

    def f32(name):
        nonlocal pos
        n = int(np.prod(shapes[name]))
        w[name] = np.frombuffer(data, dtype="<f4", count=n, offset=pos).reshape(shapes[name]).astype(np.float32)
        pos += 4 * n

    def q8(name, layered):
        nonlocal pos
        shp = shapes[name]
        parts = []
        for _ in range(shp[0] if layered else 1):
            one = shp[1:] if layered else shp
            n = int(np.prod(one))
            q = np.frombuffer(data, dtype=np.int8, count=n, offset=pos).astype(np.float32)
            pos += n
            s = np.frombuffer(data, dtype="<f4", count=n // gs, offset=pos)
            pos += 4 * (n // gs)
            parts.append((q.reshape(-1, gs) * s[:, None]).reshape(one))
        w[name] = np.stack(parts) if layered else parts[0]

    if version == 0:
        for name in ("emb", "rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3", "rms_final"):
            f32(name)
        pos += 2 * seq * (hd // 2) * 4
        if not shared:
            f32("cls")
    elif version == 1:
        for name in ("rms_att", "rms_ffn", "rms_final", "emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            f32(name)
        if not shared:
            f32("cls")
    elif version == 2:
        for name in ("rms_att", "rms_ffn", "rms_final"):
            f32(name)
        q8("emb", False)
        for name in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"):
            q8(name, True)
        if not shared:
            q8("cls", False)
    else:
        raise ValueError("version %d" % version)
    if pos != len(data):
        raise ValueError("%s: read %d bytes of %d" % (path, pos, len(data)))
    if shared:
        w["cls"] = w["emb"]
    return cfg, w


def meta_to_stacked(w, cfg):
    """Meta-named weights -> the stacked dict read_checkpoint returns."""
    L = cfg["n_layers"]

    def st(k):
        return np.stack([w["layers.%d.%s" % (l, k)] for l in range(L)])

    return {
        "emb": w["tok_embeddings.weight"], "rms_final": w["norm.weight"],
        "cls": w.get("output.weight", w["tok_embeddings.weight"]),
        "rms_att": st("attention_norm.weight"), "rms_ffn": st("ffn_norm.weight"),
        "wq": st("attention.wq.weight"), "wk": st("attention.wk.weight"), "wv": st("attention.wv.weight"),
        "wo": st("attention.wo.weight"), "w1": st("feed_forward.w1.weight"),
        "w2": st("feed_forward.w2.weight"), "w3": st("feed_forward.w3.weight"),
    }


# --- forward pass in run.c's conventions ---------------------------------------

def runc_forward(cfg, w, tokens, eps=1e-5):
    """Logits (T, vocab) in float64 for a token sequence, computed the way
    run.c does: RoPE on adjacent pairs (x[2i], x[2i+1]), theta 10000."""
    dim, nh, nkv = cfg["dim"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = dim // nh
    T = len(tokens)
    x = w["emb"][np.asarray(tokens)].astype(np.float64)
    freqs = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    ang = np.outer(np.arange(T), freqs)
    cos, sin = np.cos(ang), np.sin(ang)

    def rms(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    def rope(v):  # v (T, heads, hd)
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = a * cos[:, None, :] - b * sin[:, None, :]
        out[..., 1::2] = a * sin[:, None, :] + b * cos[:, None, :]
        return out

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["n_layers"]):
        h = rms(x, w["rms_att"][l])
        q = rope((h @ w["wq"][l].T).reshape(T, nh, hd))
        k = rope((h @ w["wk"][l].T).reshape(T, nkv, hd))
        v = (h @ w["wv"][l].T).reshape(T, nkv, hd)
        rep = nh // nkv
        k = np.repeat(k, rep, axis=1)
        v = np.repeat(v, rep, axis=1)
        att = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", att, v).reshape(T, dim)
        x = x + o @ w["wo"][l].T
        h = rms(x, w["rms_ffn"][l])
        g = h @ w["w1"][l].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w["w3"][l].T)) @ w["w2"][l].T
    x = rms(x, w["rms_final"])
    return x @ w["cls"].T


def greedy(forward, steps, bos=1):
    """Greedy decode from [BOS] the way llama2.c's generate does: stop at
    BOS or after `steps` forward passes. Returns (generated ids, top-2 logit
    gap at each step)."""
    toks = [bos]
    gaps = []
    while len(toks) - 1 < steps:
        logits = forward(toks)[-1]
        order = np.argsort(logits)
        nxt = int(order[-1])
        gaps.append(float(logits[order[-1]] - logits[order[-2]]))
        if nxt == bos:
            break
        toks.append(nxt)
    return toks[1:], gaps
