#!/usr/bin/env python3
"""Tests for export.py. Prints one line per case: PASS name | FAIL name: why |
SKIP name: why. Run from the repo root (tests/run_tests.sh does) with env
RUN (run.c binary), MODELS_DIR (real models), PYTHON, TEST_TMP (scratch)."""

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

try:
    import numpy as np
    import export_fixtures as fx
    from export_hf_reference import hf_forward
except Exception as _e:  # report a broken setup as a failure, not a crash
    print("FAIL test_export_setup: cannot import numpy or the test helpers: %s" % _e)
    sys.exit(1)

RUN = os.environ.get("RUN", "./run")
MODELS = os.environ.get("MODELS_DIR", "../shared/models")
PY = os.environ.get("PYTHON") or sys.executable
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "export")
EXPORT = os.path.join(ROOT, "export.py")
TOKENIZER_SHA = "50a52ef822ee9e83de5ce9d0be0a025a773d019437f58b5ff9dcafb063ece361"

# the tiny model used by most cases: GQA (4 query heads, 2 kv heads)
TINY = dict(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=64)
STEPS = 24          # greedy steps given to run -n
PROBE = [1, 5, 17, 42, 3, 77, 60, 9, 31, 88, 12, 50]  # tokens for logits comparison


class Skip(Exception):
    pass


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


# --- helpers --------------------------------------------------------------------

def p(*parts):
    return os.path.join(TMP, *parts)


def export(*args, timeout=300, env=None):
    return subprocess.run([PY, EXPORT] + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, cwd=os.getcwd(), env=env)


def export_ok(*args):
    r = export(*args)
    if r.returncode != 0:
        raise Fail("export.py %s failed (%d): %s" % (" ".join(map(str, args)), r.returncode,
                                                     r.stderr.strip()[-400:]))
    return r


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def have_run():
    return os.path.isfile(RUN) and os.access(RUN, os.X_OK)


def need_run():
    if not have_run():
        raise Skip("no run binary at %s (build it with make)" % RUN)


def run_c(ckpt, tok, steps=STEPS, extra=()):
    cmd = [RUN, ckpt, "-z", tok, "-t", "0", "-n", str(steps)] + list(extra)
    return subprocess.run(cmd, capture_output=True, timeout=120)


def v2_unsupported(r):
    err = r.stderr.decode("utf-8", "replace").lower()
    return r.returncode != 0 and ("version 2" in err or "int8" in err or "not supported" in err
                                  or "unsupported" in err)


def run_tokens(ckpt, tok, steps=STEPS):
    r = run_c(ckpt, tok, steps)
    if r.returncode != 0:
        raise Fail("run exited %d: %s" % (r.returncode, r.stderr.decode("utf-8", "replace").strip()[-300:]))
    return [int(m) for m in re.findall(r"<t(\d+)>", r.stdout.decode("utf-8", "replace"))]


def have_torch():
    try:
        import importlib
        importlib.import_module("torch")
        return True
    except Exception:
        return False


def need_torch():
    if not have_torch():
        raise Skip("torch not importable by this Python")


def model_file(name):
    path = os.path.join(MODELS, name)
    if not os.path.isfile(path):
        raise Skip("%s absent" % path)
    return path


def tiny_tokenizer(vocab):
    """A llama2.c tokenizer.bin of `vocab` pieces (export_fixtures)."""
    return fx.tokenizer_file(p("tok%d.bin" % vocab), vocab)


def round_dtype(w, dtype):
    if dtype == "F32":
        return {k: v.copy() for k, v in w.items()}
    if dtype == "F16":
        return {k: v.astype(np.float16).astype(np.float32) for k, v in w.items()}
    return {k: fx.bf16_round(v)[1].reshape(v.shape) for k, v in w.items()}


def write_hf_dir(d, cfg, meta_w, dtype, tied, sharded, extra_cfg=None, drop=(), mutate=None):
    """Write a HF Llama dir. Returns (config dict, HF state dict as stored)."""
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    conf = fx.hf_config(cfg, tied, **(extra_cfg or {}))
    sd = fx.meta_to_hf(meta_w, cfg)
    for k in drop:
        sd.pop(k, None)
    if mutate:
        mutate(sd)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f, indent=1)
    stored = {}
    if not sharded:
        data, stored = fx.safetensors_bytes(sd, dtype)
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(data)
    else:
        names = sorted(sd)
        halves = [names[: len(names) // 2], names[len(names) // 2:]]
        wm = {}
        total = 0
        for i, part in enumerate(halves):
            fn = "model-%05d-of-%05d.safetensors" % (i + 1, len(halves))
            data, st = fx.safetensors_bytes({k: sd[k] for k in part}, dtype)
            stored.update(st)
            total += len(data)
            with open(os.path.join(d, fn), "wb") as f:
                f.write(data)
            wm.update({k: fn for k in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)
    return conf, stored


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def compare_weights(got, want, tol=0.0, what=""):
    for k in want:
        check(got[k].shape == want[k].shape, "%s%s shape %s != %s" % (what, k, got[k].shape, want[k].shape))
        d = max_diff(got[k], want[k])
        check(d <= tol, "%s%s differs by %g" % (what, k, d))


def compare_greedy(got, ref, gaps, label):
    """run.c's greedy ids vs the reference's, up to the first near-tie."""
    n = len(ref)
    for i, g in enumerate(gaps):
        if g < 1e-3:
            n = min(n, i)
            break
    check(n >= 8 or n == len(ref), "%s: reference has a near-tie at step %d; pick another seed" % (label, n))
    check(len(got) >= min(n, len(ref)),
          "%s: run printed %d tokens, reference %d: got %s want %s" % (label, len(got), len(ref), got, ref))
    check(got[:n] == ref[:n], "%s: greedy tokens differ:\n  run %s\n  ref %s" % (label, got[:n], ref[:n]))


# --- cases ------------------------------------------------------------------------

CASES = []


def case(name):
    def deco(fn):
        CASES.append((name, fn))
        return fn
    return deco


@case("tokenizer_byte_identical")
def t_tokenizer():
    src = model_file("tokenizer.model")
    ref = model_file("tokenizer.bin")
    out = p("tokenizer.bin")
    export_ok("tokenizer", src, out)
    check(sha256(ref) == TOKENIZER_SHA, "reference tokenizer.bin has an unexpected sha256")
    got = sha256(out)
    check(got == TOKENIZER_SHA, "sha256 %s != %s" % (got, TOKENIZER_SHA))


@case("info_tokenizer")
def t_info_tok():
    path = model_file("tok512.bin")
    r = export_ok("info", path)
    check("tokenizer" in r.stdout and re.search(r"entries\s+512\b", r.stdout), "bad info output:\n" + r.stdout)


@case("info_version0_checkpoint")
def t_info_v0():
    # a legacy (version 0) checkpoint ended in a KeyError traceback
    r = export_ok("info", model_file("stories260K.bin"))
    check("legacy llama2.c" in r.stdout and re.search(r"dim\s+64\b", r.stdout)
          and re.search(r"parameters\s+\d+", r.stdout), "info output:\n" + r.stdout + r.stderr)


@case("info_gguf")
def t_info_gguf():
    # a GGUF was called "not a run.c checkpoint (n_heads = 0)"
    r = export_ok("info", os.path.join(HERE, "gguf", "llama-k.q4_k_m.gguf"))
    for want in (r"GGUF version 3, architecture llama", r"embedding_length\s+256\b", r"Q4_K",
                 r"token_embd\.weight\s+Q6_K 256x313", r"vocabulary\s+llama, 313 tokens",
                 r"bos_token_id\s+1 '<s>'", r"chat template\s+199 characters"):
        check(re.search(want, r.stdout), "no %r in info output:\n%s" % (want, r.stdout))


HF_VARIANTS = [
    # name, dtype, n_kv_heads, tied, sharded, seed
    ("f32_gqa_tied", "F32", 2, True, False, 11),
    ("bf16_gqa_untied", "BF16", 2, False, False, 12),
    ("bf16_mha_tied_sharded", "BF16", 4, True, True, 13),
    ("f16_gqa_untied_sharded", "F16", 2, False, True, 14),
]


def hf_variant(name, dtype, nkv, tied, sharded, seed):
    cfg = dict(TINY, n_kv_heads=nkv)
    meta = round_dtype(fx.make_meta_weights(cfg, seed, shared=tied), dtype)
    d = p("hf_" + name)
    conf, stored = write_hf_dir(d, cfg, meta, dtype, tied, sharded)
    return cfg, meta, d, conf, stored


def make_hf_cases(name, dtype, nkv, tied, sharded, seed):
    state = {}

    def exported():
        if "out" not in state:
            cfg, meta, d, conf, stored = hf_variant(name, dtype, nkv, tied, sharded, seed)
            out = p("hf_%s.bin" % name)
            export_ok("model", d, out)
            state.update(cfg=cfg, meta=meta, conf=conf, stored=stored, out=out)
        return state

    @case("hf_%s_export_matches_hf_forward" % name)
    def t_logits():
        s = exported()
        ccfg, w = fx.read_checkpoint(s["out"])
        for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            check(ccfg[k] == s["cfg"][k], "header %s = %d, want %d" % (k, ccfg[k], s["cfg"][k]))
        check(ccfg["shared"] == tied, "shared classifier flag %s, want %s" % (ccfg["shared"], tied))
        # weights are exactly the un-permuted (Meta-layout) values
        compare_weights(w, fx.meta_to_stacked(s["meta"], s["cfg"]))
        ref = hf_forward(s["conf"], s["stored"], PROBE)
        got = fx.runc_forward(ccfg, w, PROBE)
        d = max_diff(got, ref)
        check(d < 1e-4, "logits differ from the HF-convention forward by %g" % d)
        # the check is sensitive: without un-permuting q/k the logits differ
        if name == "f32_gqa_tied":
            bad = dict(w)
            bad["wq"] = np.stack([fx.hf_permute(x, ccfg["n_heads"]) for x in w["wq"]])
            bad["wk"] = np.stack([fx.hf_permute(x, ccfg["n_kv_heads"]) for x in w["wk"]])
            check(max_diff(fx.runc_forward(ccfg, bad, PROBE), ref) > 1e-2,
                  "test is insensitive to the q/k permutation")

    @case("hf_%s_run_greedy_matches_hf" % name)
    def t_run():
        need_run()
        s = exported()
        tok = tiny_tokenizer(s["cfg"]["vocab_size"])
        ref, gaps = fx.greedy(lambda t: hf_forward(s["conf"], s["stored"], t), STEPS)
        got = run_tokens(s["out"], tok)
        compare_greedy(got, ref, gaps, name)


for _v in HF_VARIANTS:
    make_hf_cases(*_v)


@case("hf_pytorch_model_bin_same_as_safetensors")
def t_hf_torch_bin():
    need_torch()
    import torch
    cfg = dict(TINY)
    meta = round_dtype(fx.make_meta_weights(cfg, 21, shared=False), "BF16")
    d1, d2 = p("hf_st_bf16"), p("hf_pt_bf16")
    write_hf_dir(d1, cfg, meta, "BF16", False, False)
    if os.path.isdir(d2):
        shutil.rmtree(d2)
    os.makedirs(d2)
    shutil.copy(os.path.join(d1, "config.json"), d2)
    sd = {k: torch.from_numpy(v.copy()).to(torch.bfloat16) for k, v in fx.meta_to_hf(meta, cfg).items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    torch.save(sd, os.path.join(d2, "pytorch_model.bin"))
    export_ok("model", d1, p("hf_st_bf16.bin"))
    export_ok("model", d2, p("hf_pt_bf16.bin"))
    check(sha256(p("hf_st_bf16.bin")) == sha256(p("hf_pt_bf16.bin")),
          "pytorch_model.bin and model.safetensors exports differ")


def llama2c_pt(path, cfg, meta, n_kv_none=False, legacy=False):
    import torch
    args = dict(dim=cfg["dim"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"],
                n_kv_heads=None if n_kv_none else cfg["n_kv_heads"], vocab_size=cfg["vocab_size"],
                multiple_of=32, norm_eps=1e-5, max_seq_len=cfg["seq_len"], dropout=0.0, hidden_dim=None)
    sd = {}
    for k, v in meta.items():
        sd["_orig_mod." + k] = torch.from_numpy(v.copy())
    if "_orig_mod.output.weight" not in sd:  # llama2.c ties by sharing the tensor
        sd["_orig_mod.output.weight"] = sd["_orig_mod.tok_embeddings.weight"]
    torch.save({"model_args": args, "model": sd, "iter_num": 7, "best_val_loss": 1.5,
                "config": {"batch_size": 8}}, path, _use_new_zipfile_serialization=not legacy)


@case("pt_llama2c_checkpoint")
def t_pt():
    need_torch()
    cfg = dict(TINY)
    meta = fx.make_meta_weights(cfg, 31, shared=True)
    path = p("ckpt.pt")
    llama2c_pt(path, cfg, meta)
    out = p("from_pt.bin")
    export_ok("model", path, out)
    ccfg, w = fx.read_checkpoint(out)
    check(ccfg["shared"], "tied llama2.c checkpoint exported with a separate classifier")
    check(ccfg["hidden_dim"] == cfg["hidden_dim"] and ccfg["n_kv_heads"] == 2, "bad header %s" % ccfg)
    compare_weights(w, fx.meta_to_stacked(meta, cfg))
    # the same weights through the HF path (permuted on the way in) give the same file
    write_hf_dir(p("hf_same"), cfg, meta, "F32", True, False)
    export_ok("model", p("hf_same"), p("from_hf_same.bin"))
    check(sha256(out) == sha256(p("from_hf_same.bin")), "llama2.c .pt and HF exports of one model differ")
    # n_kv_heads None means n_heads; torch's pre-1.6 (non-zip) file format
    cfg2 = dict(TINY, n_kv_heads=4)
    meta2 = fx.make_meta_weights(cfg2, 32, shared=True)
    llama2c_pt(p("ckpt2.pt"), cfg2, meta2, n_kv_none=True, legacy=True)
    export_ok("model", p("ckpt2.pt"), p("from_pt2.bin"))
    c2, w2 = fx.read_checkpoint(p("from_pt2.bin"))
    check(c2["n_kv_heads"] == 4, "n_kv_heads None exported as %d" % c2["n_kv_heads"])
    compare_weights(w2, fx.meta_to_stacked(meta2, cfg2))
    # pickles are loaded without running arbitrary code: other classes are refused
    import fractions
    import torch
    torch.save({"model_args": {"dim": 8}, "model": {}, "evil": fractions.Fraction(1, 3)}, p("evil.pt"))
    expect_error(p("bad.bin"), "model", p("evil.pt"), p("bad.bin"), want="refusing")


@case("meta_consolidated_two_shards")
def t_meta():
    need_torch()
    import torch
    cfg = dict(TINY)
    meta = fx.make_meta_weights(cfg, 41, shared=False)
    d = p("meta")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    with open(os.path.join(d, "params.json"), "w") as f:
        json.dump({"dim": cfg["dim"], "n_layers": cfg["n_layers"], "n_heads": cfg["n_heads"],
                   "n_kv_heads": cfg["n_kv_heads"], "multiple_of": 32, "norm_eps": 1e-5,
                   "vocab_size": -1}, f)
    # Meta's model parallel layout: column-parallel (wq wk wv w1 w3 output)
    # split on dim 0, row-parallel (wo w2) and the embedding on dim 1,
    # norms replicated
    shards = [{}, {}]
    for k, v in meta.items():
        if "norm" in k:
            parts = [v, v]
        elif any(s in k for s in ("tok_embeddings", "attention.wo", "feed_forward.w2")):
            parts = np.split(v, 2, axis=1)
        else:
            parts = np.split(v, 2, axis=0)
        for i in range(2):
            shards[i][k] = torch.from_numpy(np.ascontiguousarray(parts[i]))
    shards[0]["rope.freqs"] = torch.ones(8)
    for i in range(2):
        torch.save(shards[i], os.path.join(d, "consolidated.%02d.pth" % i))
    out = p("from_meta.bin")
    export_ok("model", d, out, "--seq-len", cfg["seq_len"])
    ccfg, w = fx.read_checkpoint(out)
    check(not ccfg["shared"], "separate output exported as shared")
    check(ccfg["vocab_size"] == cfg["vocab_size"] and ccfg["seq_len"] == cfg["seq_len"], "bad header %s" % ccfg)
    compare_weights(w, fx.meta_to_stacked(meta, cfg))


@case("roundtrip_v0_v1_v0_stories260K")
def t_rt01():
    src = model_file("stories260K.bin")
    export_ok("model", src, p("s260_v1.bin"), "--version", 1)
    export_ok("model", p("s260_v1.bin"), p("s260_v0.bin"), "--version", 0)
    c0, w0 = fx.read_checkpoint(src)
    c1, w1 = fx.read_checkpoint(p("s260_v1.bin"))
    c2, w2 = fx.read_checkpoint(p("s260_v0.bin"))
    check(c1["version"] == 1 and c2["version"] == 0, "wrong versions written")
    for c in (c1, c2):
        for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len", "shared"):
            check(c[k] == c0[k], "%s changed: %r -> %r" % (k, c0[k], c[k]))
    compare_weights(w1, w0, what="v1 ")
    compare_weights(w2, w0, what="v0 ")
    # bytes identical outside the unused RoPE tables
    a, b = open(src, "rb").read(), open(p("s260_v0.bin"), "rb").read()
    check(len(a) == len(b), "size %d != %d" % (len(b), len(a)))
    rope_start = len(a) - 2 * c0["seq_len"] * (c0["dim"] // c0["n_heads"] // 2) * 4
    check(a[:rope_start] == b[:rope_start], "weights bytes differ")
    ra = np.frombuffer(a[rope_start:], "<f4")
    rb = np.frombuffer(b[rope_start:], "<f4")
    check(max_diff(ra, rb) < 1e-5, "RoPE tables differ by %g" % max_diff(ra, rb))


@case("roundtrip_v1_run_same_output_stories260K")
def t_rt01_run():
    need_run()
    src = model_file("stories260K.bin")
    tok = model_file("tok512.bin")
    if not os.path.exists(p("s260_v1.bin")):
        export_ok("model", src, p("s260_v1.bin"), "--version", 1)
    a = run_c(src, tok, 200)
    b = run_c(p("s260_v1.bin"), tok, 200)
    check(a.returncode == 0, "run on v0 failed: %s" % a.stderr[-300:])
    check(b.returncode == 0, "run on v1 failed: %s" % b.stderr[-300:])
    check(len(a.stdout) > 100, "v0 output too short: %r" % a.stdout)
    check(a.stdout == b.stdout, "v0 and v1 outputs differ:\n%r\n%r" % (a.stdout[:200], b.stdout[:200]))


def check_q8(w2, w0, cfg, what):
    """Every dequantised weight within half a quantisation step of the original."""
    gs = cfg["group_size"]
    for k in ("emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "cls"):
        a = w0[k].reshape(-1, gs).astype(np.float64)
        step = np.abs(a).max(axis=1, keepdims=True) / 127.0
        err = np.abs(w2[k].reshape(-1, gs) - a)
        check(np.all(err <= step * 0.5 + 1e-7), "%s%s: error %g above half a step" % (what, k, float(err.max())))
    for k in ("rms_att", "rms_ffn", "rms_final"):
        check(np.array_equal(w2[k], w0[k]), "%s%s: norms must stay float32" % (what, k))


@case("roundtrip_v0_v2_dequantised_close")
def t_rt02():
    src = model_file("stories260K.bin")
    r = export_ok("model", src, p("s260_v2.bin"), "--version", 2)
    check("error" in r.stdout.lower(), "no quantisation error printed: %r" % r.stdout)
    c0, w0 = fx.read_checkpoint(src)
    c2, w2 = fx.read_checkpoint(p("s260_v2.bin"))
    check(c2["version"] == 2, "version %d" % c2["version"])
    gs = c2["group_size"]
    check(c2["dim"] % gs == 0 and c2["hidden_dim"] % gs == 0, "group size %d does not divide dims" % gs)
    check(gs == 4, "group size %d, expected 4 (64 halved until it divides 64 and 172)" % gs)
    check_q8(w2, w0, c2, "")
    r = export_ok("info", p("s260_v2.bin"))
    check("version 2" in r.stdout and re.search(r"group_size\s+4\b", r.stdout), "info output:\n" + r.stdout)
    # v2 -> v1 -> v2 is lossless on the dequantised values
    export_ok("model", p("s260_v2.bin"), p("s260_v2_v1.bin"), "--version", 1)
    _, w1 = fx.read_checkpoint(p("s260_v2_v1.bin"))
    compare_weights(w1, w2, what="v2->v1 ")


@case("v2_run_stories260K")
def t_v2_run():
    need_run()
    tok = model_file("tok512.bin")
    if not os.path.exists(p("s260_v2.bin")):
        export_ok("model", model_file("stories260K.bin"), p("s260_v2.bin"), "--version", 2)
    r = run_c(p("s260_v2.bin"), tok, 64)
    if v2_unsupported(r):
        raise Skip("run does not read version 2 yet: %s" % r.stderr.decode("utf-8", "replace").strip()[:120])
    check(r.returncode == 0, "run exited %d: %s" % (r.returncode, r.stderr[-300:]))
    check(r.stdout.startswith(b"Once upon a time"), "unexpected output %r" % r.stdout[:100])


@case("untied_random_v0_v1_v2")
def t_untied():
    shape = "tiny=%d,%d,%d,%d,%d,%d,%d" % (TINY["dim"], TINY["hidden_dim"], TINY["n_layers"], TINY["n_heads"],
                                          TINY["n_kv_heads"], TINY["vocab_size"], TINY["seq_len"])
    export_ok("random", p("r0.bin"), "--shape", shape, "--seed", 5, "--untied")
    with open(p("r0.bin"), "rb") as f:
        vocab = struct.unpack("<7i", f.read(28))[5]
    check(vocab == -TINY["vocab_size"], "legacy header vocab %d, want negative" % vocab)
    export_ok("model", p("r0.bin"), p("r1.bin"), "--version", 1)
    export_ok("model", p("r0.bin"), p("r2.bin"), "--version", 2, "--group-size", 64)
    c0, w0 = fx.read_checkpoint(p("r0.bin"))
    c1, w1 = fx.read_checkpoint(p("r1.bin"))
    c2, w2 = fx.read_checkpoint(p("r2.bin"))
    check(not c1["shared"] and not c2["shared"], "shared flag lost")
    check(not np.array_equal(w0["cls"], w0["emb"]), "classifier equals embedding")
    compare_weights(w1, w0)
    check(c2["group_size"] == 32, "group size %d, want 32 (64 does not divide hidden 96)" % c2["group_size"])
    check_q8(w2, w0, c2, "")
    if have_run():
        tok = tiny_tokenizer(TINY["vocab_size"])
        a, b = run_c(p("r0.bin"), tok), run_c(p("r1.bin"), tok)
        check(a.returncode == 0 and b.returncode == 0, "run failed: %s %s" % (a.stderr[-200:], b.stderr[-200:]))
        check(a.stdout == b.stdout and len(a.stdout) > 0, "run outputs differ for v0 and v1")


@case("random_deterministic_and_shapes")
def t_random():
    t0 = time.time()
    export_ok("random", p("s15a.bin"), "--shape", "stories15M", "--seed", 3)
    dt = time.time() - t0
    export_ok("random", p("s15b.bin"), "--shape", "stories15M", "--seed", 3)
    check(sha256(p("s15a.bin")) == sha256(p("s15b.bin")), "same seed, different files")
    export_ok("random", p("s15c.bin"), "--shape", "stories15M", "--seed", 4, "--version", 1)
    c, w = fx.read_checkpoint(p("s15c.bin"))
    want = dict(dim=288, hidden_dim=768, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, seq_len=256)
    for k, v in want.items():
        check(c[k] == v, "stories15M %s = %d, want %d" % (k, c[k], v))
    _, wa = fx.read_checkpoint(p("s15a.bin"))
    check(not np.array_equal(wa["wq"], w["wq"]), "different seeds, same weights")
    check(abs(float(w["wq"].std()) - 0.02) < 0.005, "weight std %g" % float(w["wq"].std()))
    check(abs(float(w["rms_att"].mean()) - 1.0) < 0.05, "norm mean %g" % float(w["rms_att"].mean()))
    check(dt < 20, "stories15M took %.1f s" % dt)
    r = export_ok("info", p("s15c.bin"))
    check("version 1" in r.stdout and re.search(r"dim\s+288\b", r.stdout), "info output:\n" + r.stdout)
    for f in ("s15a.bin", "s15b.bin", "s15c.bin"):
        os.unlink(p(f))


# --- bad input: exit 1, one line on stderr, no output file ------------------------

def expect_error(out, *args, want=None):
    if os.path.exists(out):
        os.unlink(out)
    r = export(*args)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    check(r.returncode == 1, "exit status %d (stderr %r)" % (r.returncode, r.stderr[-300:]))
    check(len(lines) == 1, "want one stderr line, got %d: %r" % (len(lines), r.stderr[-400:]))
    check(lines[0].startswith("export.py: error: "), "bad error line %r" % lines[0])
    if want:
        check(re.search(want, lines[0], re.I), "error %r does not mention %r" % (lines[0], want))
    check(not os.path.exists(out), "output file left behind")
    left = [f for f in os.listdir(os.path.dirname(out) or ".") if f.startswith(".export-")]
    check(not left, "temporary files left behind: %s" % left)
    return lines[0]


def bad_hf(name, **kw):
    cfg = dict(TINY)
    meta = fx.make_meta_weights(cfg, 51, shared=True)
    d = p("bad_" + name)
    write_hf_dir(d, cfg, meta, kw.pop("dtype", "F32"), True, kw.pop("sharded", False), **kw)
    return d


@case("error_missing_directory")
def t_err_dir():
    expect_error(p("bad.bin"), "model", p("no_such_dir"), p("bad.bin"), want="no such")


@case("error_missing_tensor")
def t_err_missing():
    d = bad_hf("missing", drop=["model.layers.1.mlp.up_proj.weight"])
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="up_proj")


@case("error_wrong_shape")
def t_err_shape():
    def mutate(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:16]
    d = bad_hf("shape", mutate=mutate)
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="shape")


@case("error_unsupported_model_type")
def t_err_type():
    d = bad_hf("type", extra_cfg={"model_type": "phi3"})
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="model_type")


@case("error_unsupported_rope_and_bias")
def t_err_rope():
    d = bad_hf("rope", extra_cfg={"rope_scaling": {"type": "linear", "factor": 2.0}})
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="rope_scaling")
    # theta and eps need version 4 (chosen by itself without --version:
    # tests/test_export_gguf.py); an explicit older version is refused
    d = bad_hf("theta", extra_cfg={"rope_theta": 500000.0})
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), "--version", 1, want="rope_theta.*version 4")
    d = bad_hf("eps", extra_cfg={"rms_norm_eps": 1e-6})
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), "--version", 2, want="eps.*version 4")

    def add_bias(sd):
        sd["model.layers.0.self_attn.q_proj.bias"] = np.zeros(TINY["dim"], np.float32)
    d = bad_hf("bias", mutate=add_bias)
    expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="bias")


@case("error_truncated_safetensors")
def t_err_trunc():
    for sharded in (False, True):
        d = bad_hf("trunc%d" % sharded, sharded=sharded)
        fn = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
        path = os.path.join(d, fn)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 100)
        expect_error(p("bad.bin"), "model", d, p("bad.bin"), want="truncated")


@case("error_keeps_existing_output")
def t_err_keep():
    out = p("keep.bin")
    with open(out, "wb") as f:
        f.write(b"old contents")
    d = bad_hf("keep", extra_cfg={"model_type": "gpt2"})
    r = export("model", d, out)
    check(r.returncode == 1, "exit status %d" % r.returncode)
    check(open(out, "rb").read() == b"old contents", "existing output was overwritten on error")


@case("error_truncated_checkpoint")
def t_err_trunc_ckpt():
    src = model_file("stories260K.bin")
    bad = p("trunc260K.bin")
    with open(src, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(data[:-1000])
    expect_error(p("bad.bin"), "model", bad, p("bad.bin"), want="truncated")


@case("torch_is_optional")
def t_no_torch():
    # a torch that fails to import: safetensors and run.c inputs still work,
    # pickles give a one-line error
    fake = p("notorch")
    os.makedirs(os.path.join(fake, "torch"), exist_ok=True)
    with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
        f.write("raise ImportError('torch disabled for this test')\n")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(fake))
    d = bad_hf("notorch_ok")
    r = export("model", d, p("notorch.bin"), env=env)
    check(r.returncode == 0, "safetensors export needs torch? %s" % r.stderr.strip()[-300:])
    with open(p("fake.pt"), "wb") as f:
        f.write(b"PK\x03\x04" + b"\0" * 100)
    out = p("bad.bin")
    r = export("model", p("fake.pt"), out, env=env)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    check(r.returncode == 1 and len(lines) == 1 and "torch" in lines[0].lower(),
          "want a one-line error about torch, got %d: %r" % (r.returncode, r.stderr[-300:]))
    check(not os.path.exists(out), "output file left behind")


# --- main ---------------------------------------------------------------------------

def main():
    try:
        os.makedirs(TMP, exist_ok=True)
    except OSError as e:
        print("FAIL test_export_setup: cannot create %s: %s" % (TMP, e))
        return 1
    only = sys.argv[1:]
    failed = 0
    for name, fn in CASES:
        if only and not any(o in name for o in only):
            continue
        t0 = time.time()
        try:
            fn()
        except Skip as e:
            print("SKIP %s: %s" % (name, e), flush=True)
            continue
        except Fail as e:
            failed += 1
            print("FAIL %s: %s" % (name, " | ".join(str(e).splitlines())), flush=True)
            continue
        except Exception as e:  # a crash in a case is a failure of that case
            failed += 1
            tb = traceback.format_exc().strip().splitlines()
            where = tb[-3].strip() if len(tb) > 2 else ""
            print("FAIL %s: %s: %s (%s)" % (name, type(e).__name__, " | ".join(str(e).splitlines()), where),
                  flush=True)
            continue
        print("PASS %s" % name, flush=True)
        if os.environ.get("EXPORT_TEST_TIMES"):
            print("  %.2f s" % (time.time() - t0), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
