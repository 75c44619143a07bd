"""A numpy forward pass of a Hugging Face Llama model, following HF's
conventions on the ORIGINAL (un-permuted) weights: rotate-half RoPE
(dimension i paired with i + head_dim/2) with the config's rope_theta and,
for rope_scaling of type "llama3", Llama 3.1's rescaled inverse frequencies,
RMSNorm with the config's rms_norm_eps, SwiGLU MLP (down(silu(gate(x)) * up(x))), grouped-query
attention with each key/value head shared by n_heads / n_kv_heads
consecutive query heads, q/k/v biases where the state dict has them (Qwen2:
added after the projection, before RoPE), and lm_head (or the tied
embedding) on top.

Used by tests/test_export.py and tests/test_llama3.py to check that export.py's un-permutation of
q_proj/k_proj makes run.c's adjacent-pair RoPE compute the same function.
"""

import numpy as np


def llama3_inv_freq(inv_freq, sc):
    """Llama 3.1's RoPE frequency rescaling (transformers'
    _compute_llama3_parameters): long wavelengths (beyond the original
    context / low_freq_factor) are slowed by `factor`, short ones (below
    original context / high_freq_factor) kept, and those between
    interpolated linearly in original_context / wavelength."""
    assert sc.get("rope_type", sc.get("type")) == "llama3"
    factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    ctx = sc["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    slow = wavelen > ctx / low
    fast = wavelen < ctx / high
    smooth = (ctx / wavelen - low) / (high - low)
    between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(slow, inv_freq / factor, np.where(fast, inv_freq, between))


def hf_forward(config, sd, tokens):
    """config: parsed config.json; sd: name -> float array (as stored, e.g.
    bf16 values widened to float32). Returns logits (T, vocab) in float64."""
    dim = config["hidden_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads") or nh
    hd = dim // nh
    eps = config.get("rms_norm_eps", 1e-6)
    theta = config.get("rope_theta", 10000.0)
    T = len(tokens)

    def W(name):
        return np.asarray(sd[name], dtype=np.float64)

    def proj(h, name):  # h @ W.T, plus the bias when there is one
        y = h @ W(name + ".weight").T
        return y + W(name + ".bias") if name + ".bias" in sd else y

    def rmsnorm(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    scaling = config.get("rope_scaling")
    if scaling:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = np.outer(np.arange(T), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, hd)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rotate_half(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([-x2, x1], axis=-1)

    def apply_rope(x):  # (T, heads, hd)
        return x * cos + rotate_half(x) * sin

    x = W("model.embed_tokens.weight")[np.asarray(tokens)]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(config["num_hidden_layers"]):
        p = "model.layers.%d." % l
        h = rmsnorm(x, W(p + "input_layernorm.weight"))
        q = apply_rope(proj(h, p + "self_attn.q_proj").reshape(T, nh, hd))
        k = apply_rope(proj(h, p + "self_attn.k_proj").reshape(T, nkv, hd))
        v = proj(h, p + "self_attn.v_proj").reshape(T, nkv, hd)
        n_rep = nh // nkv
        # HF repeat_kv: kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1
        k = np.repeat(k, n_rep, axis=1)
        v = np.repeat(v, n_rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(T, dim)
        x = x + attn @ W(p + "self_attn.o_proj.weight").T
        h = rmsnorm(x, W(p + "post_attention_layernorm.weight"))
        gate = h @ W(p + "mlp.gate_proj.weight").T
        up = h @ W(p + "mlp.up_proj.weight").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ W(p + "mlp.down_proj.weight").T
    x = rmsnorm(x, W("model.norm.weight"))
    head = sd.get("lm_head.weight") if not config.get("tie_word_embeddings") else None
    head = W("lm_head.weight") if head is not None else W("model.embed_tokens.weight")
    return x @ head.T
