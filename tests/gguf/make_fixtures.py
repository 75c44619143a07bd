#!/usr/bin/env python3
"""Write the tiny random-weight F32 GGUF models that the fixtures in tests/gguf/ come from.

The files are written with llama.cpp's own Python GGUF writer (gguf-py), so that what run.c
reads is what llama.cpp's tools write; the quantised variants are then made from these with
llama.cpp's `llama-quantize` (commands in README.md). This script only *imports* gguf-py from
a llama.cpp checkout named on the command line; it never builds or ships llama.cpp.

    python3 make_fixtures.py --gguf-py /path/to/llama.cpp/gguf-py --out DIR [--seed N]

Four models (shapes chosen so every quantised file stays under 512 KB):
  llama-s  dim 64,  2 layers, 4 heads / 2 KV heads, ffn 128, untied output, rope_freqs
  llama-k  dim 256, 1 layer,  8 heads / 2 KV heads, ffn 256, tied output (rows of 256: K-quants)
  qwen2-s  dim 64,  2 layers, 4 heads / 2 KV heads, ffn 128, tied output, q/k/v biases
  qwen2-k  dim 256, 1 layer,  8 heads / 2 KV heads, ffn 384, tied output, q/k/v biases
           (ffn_down rows are 384 long: not a multiple of 256, so K-quants fall back there)
"""
import argparse
import math
import os
import sys

import numpy as np


# ---- vocabularies -------------------------------------------------------------------------

# SentencePiece-style pieces ("▁" marks a preceding space), best score first. Single letters
# are included so that any lowercase text tokenises without falling back to byte tokens.
SPM_PIECES = ["▁t", "▁a", "he", "in", "er", "▁the", "on", "▁s", "▁w", "▁o", "ll", "▁h",
              "▁he", "▁hello", "▁world", "or", "ld", "▁wor", "at", "en", "▁b", "▁c", "is",
              "▁is", "▁it", "▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
SPM_CONTROL = ["<|user|>", "<|assistant|>"]  # extra control tokens, as chat models have


def spm_vocab():
    """tokens, scores, types of a tiny Llama-1/2-style SentencePiece vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    scores = [0.0] * len(tokens)
    types = [2, 3, 3] + [6] * 256          # unknown, control, control, 256 byte tokens
    for i, piece in enumerate(SPM_PIECES):
        tokens.append(piece)
        scores.append(-float(i + 1))       # SentencePiece scores: higher merges first
        types.append(1)
    for piece in SPM_CONTROL:
        tokens.append(piece)
        scores.append(0.0)
        types.append(3)
    return tokens, scores, types


def gpt2_byte_chars():
    """GPT-2's byte-to-unicode table, as a list in its token order (printable bytes first)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


# merges in rank order; "Ġ" is the mapped space, "Ċ" the mapped newline
BPE_MERGES = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "l l", "Ġ w",
              "o r", "l d", "Ġw or", "Ġwor ld", "Ġ h", "he ll", "hell o", "Ġh ello", "i s",
              "Ġ i", "Ġi s", "Ġ c", "Ġ b", "a t", "e n", "Ġ o", "Ċ Ċ", "Ġ Ġ", "1 2", "12 3"]
BPE_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_vocab():
    """tokens, types, merges of a tiny Qwen2-style byte-level BPE vocabulary."""
    tokens = gpt2_byte_chars()
    for m in BPE_MERGES:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    for s in BPE_SPECIAL:
        tokens.append(s)
        types.append(3)
    return tokens, types, list(BPE_MERGES)


LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                   "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
                   "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                   "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---- weights ------------------------------------------------------------------------------

def llama31_rope_factors(head_dim, base, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_ctx=64):
    """rope_freqs as llama.cpp's converter computes them for Llama 3.1 (the angle of pair i is
    divided by factors[i]), but with a tiny original context so that at a few positions the
    divided angles differ visibly: with Llama 3.1's 8192 they would matter only far out."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = original_ctx / low_freq_factor
    high_wavelen = original_ctx / high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gaussian(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


def norm_weight(rng, n):
    """RMSNorm gains near 1, as trained models have."""
    return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)


def add_weights(w, rng, cfg, n_vocab):
    """Random weights with the shapes llama.cpp expects; numpy shape (rows, cols) is GGUF's
    ne = (cols, rows). Projections have std 1/sqrt(fan_in) so activations stay near unit
    size and the logits are spread out rather than all equal."""
    dim, hd, nh, nkv, ffn = cfg["dim"], cfg["head_dim"], cfg["heads"], cfg["kv_heads"], cfg["ffn"]
    w.add_tensor("token_embd.weight", gaussian(rng, (n_vocab, dim), 0.1))
    if cfg.get("rope_freqs"):
        w.add_tensor("rope_freqs.weight", llama31_rope_factors(hd, cfg["rope_base"]))
    for i in range(cfg["layers"]):
        p = "blk.%d." % i
        w.add_tensor(p + "attn_norm.weight", norm_weight(rng, dim))
        w.add_tensor(p + "attn_q.weight", gaussian(rng, (nh * hd, dim), dim ** -0.5))
        w.add_tensor(p + "attn_k.weight", gaussian(rng, (nkv * hd, dim), dim ** -0.5))
        w.add_tensor(p + "attn_v.weight", gaussian(rng, (nkv * hd, dim), dim ** -0.5))
        if cfg.get("qkv_bias"):
            w.add_tensor(p + "attn_q.bias", gaussian(rng, nh * hd, 0.2))
            w.add_tensor(p + "attn_k.bias", gaussian(rng, nkv * hd, 0.2))
            w.add_tensor(p + "attn_v.bias", gaussian(rng, nkv * hd, 0.2))
        w.add_tensor(p + "attn_output.weight", gaussian(rng, (dim, nh * hd), (nh * hd) ** -0.5))
        w.add_tensor(p + "ffn_norm.weight", norm_weight(rng, dim))
        w.add_tensor(p + "ffn_gate.weight", gaussian(rng, (ffn, dim), dim ** -0.5))
        w.add_tensor(p + "ffn_up.weight", gaussian(rng, (ffn, dim), dim ** -0.5))
        w.add_tensor(p + "ffn_down.weight", gaussian(rng, (dim, ffn), ffn ** -0.5))
    w.add_tensor("output_norm.weight", norm_weight(rng, dim))
    if not cfg["tied"]:
        w.add_tensor("output.weight", gaussian(rng, (n_vocab, dim), dim ** -0.5))


# ---- files --------------------------------------------------------------------------------

MODELS = {
    "llama-s": dict(arch="llama", dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                    tied=False, rope_freqs=True, rope_base=10000.0, eps=1e-5),
    "llama-k": dict(arch="llama", dim=256, layers=1, heads=8, kv_heads=2, head_dim=32, ffn=256,
                    tied=True, rope_freqs=False, rope_base=10000.0, eps=1e-5),
    "qwen2-s": dict(arch="qwen2", dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128,
                    tied=True, qkv_bias=True, rope_base=10000.0, eps=1e-6),
    "qwen2-k": dict(arch="qwen2", dim=256, layers=1, heads=8, kv_heads=2, head_dim=32, ffn=384,
                    tied=True, qkv_bias=True, rope_base=10000.0, eps=1e-6),
}


def write_model(gguf, path, name, cfg, seed):
    arch = cfg["arch"]
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny random %s (%s)" % (arch, name))
    w.add_file_type(0)                                  # LLAMA_FTYPE_ALL_F32
    w.add_context_length(256)
    w.add_embedding_length(cfg["dim"])
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_base"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    if arch == "llama":
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template(LLAMA2_TEMPLATE)
    else:
        tokens, types, merges = bpe_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        endoftext = tokens.index("<|endoftext|>")
        w.add_bos_token_id(endoftext)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(endoftext)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML_TEMPLATE)
    # one generator per model, seeded from the model's name, so models do not depend on
    # each other's order
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    add_weights(w, rng, cfg, len(tokens))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf-py", default=os.environ.get("GGUF_PY"),
                    help="llama.cpp's gguf-py directory (or env GGUF_PY)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=33)
    ap.add_argument("models", nargs="*", default=sorted(MODELS), help="subset of: " + " ".join(sorted(MODELS)))
    args = ap.parse_args()
    if not args.gguf_py:
        sys.exit("make_fixtures.py: give --gguf-py DIR (llama.cpp's gguf-py)")
    sys.path.insert(0, args.gguf_py)
    import gguf  # llama.cpp's writer: the point is that the file comes from llama.cpp's code
    os.makedirs(args.out, exist_ok=True)
    for name in args.models:
        path = os.path.join(args.out, name + ".f32.gguf")
        write_model(gguf, path, name, MODELS[name], args.seed)
        print(path, os.path.getsize(path))


if __name__ == "__main__":
    main()
