#!/usr/bin/env python3
"""GGUF models: run.c's logits on small random GGUF files of every weight
type and both architectures against the independent numpy reference
tests/gguf_ref.py (which agrees with llama.cpp itself to 1e-7, see its
docstring), generation smoke runs, and malformed files; and the files
made by llama.cpp's own tools in tests/gguf/ (every weight type, both
architectures, a K mix) against llama.cpp's logits and greedy tokens, the
reference's emulation of llama.cpp and of run.c (see "files made by
llama.cpp" below for their tolerances).

Files: written here by gguf_ref (random quant bits with realistic scales;
dim 256 so the K types fit, ffn 512, 4 heads, vocab 300 with a small
SentencePiece vocabulary). Logits from tests/.bin/llama3_dump (make
tests/.bin/llama3_dump), and again from tests/.bin/llama3_dump_native, the
same driver built as ./runomp (vector kernels; with VNNI, the block types
packed straight from their blocks): cases ending in _vector, SKIP without
it; the sanitizer cases use tests/.bin/run_asan (make
tests/.bin/run_asan) and SKIP without it.

Tolerances (errors: max |run.c - reference| over all logits, relative to
max |logit|):
  - F32, F16, BF16: run.c computes in float32 what the reference computes
    in float64 from the same dequantised weights; float32 rounding of sums
    of <= 512 products through two layers stays near 1e-6 (llama.cpp's
    float32 path: 3e-7), so EXACT_TOL = 2e-5. A build with bfloat16 dot
    products (`llama3_dump kernels` says so) rounds a BF16 matrix's inputs
    to bfloat16: such files are held, as the quantised ones below, to the
    emulation of that rounding (forward(..., 'runc_bf16')).
  - quantised types: run.c's integer kernels round each matmul's input to
    int8 per group (32 values, 16 for Q6_K) with scale max|x|/127, half
    away from zero; for the types with a minimum (Q4_1, Q5_1, Q4_K, Q5_K)
    each value is split as scale * (n - mid) + (min + mid * scale), mid the
    middle of n's range, the first part on the int8 inputs and the second
    on the float sum of the group's inputs (the centred split keeps the
    int8 rounding's effect as small as llama.cpp's). The reference does
    the same (forward(..., 'runc')), so
    the two agree to float32 rounding (QUANT_TIGHT = 2e-4, a little above
    what llama.cpp reaches with its own rounding emulated: 3e-7) unless an
    activation lies within float32 rounding of a half-way point: then the
    two round it differently and the difference cascades through the later
    roundings. Such a cascade is a second draw of the same rounding noise,
    so it is bounded by the size of that noise, NOISE = max |exact forward
    - forward('runc')| (5e-3 .. 3e-2 here); with llama.cpp against its
    emulation the cascades reached 1.1 x NOISE. We allow 3 x NOISE, and
    print which regime each case is in. A wrong block layout, scale or
    RoPE pairing moves logits by tens of percent, far beyond both.

Env: RUN, PYTHON, TEST_TMP. Prints PASS/FAIL/SKIP lines."""

import json
import os
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip  # noqa: E402

import numpy as np  # noqa: E402

import gguf_ref as ref  # noqa: E402
import llamacpp  # noqa: E402

RUN = os.environ.get("RUN", "./run")
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "gguf")
DUMP = os.path.join(HERE, ".bin", "llama3_dump")
# the same driver built as ./runomp (vector kernels; where the machine has
# VNNI, the block types packed straight from their blocks): the logits cases
# run on both, the second with names ending in _vector
NATIVE_DUMP = os.path.join(HERE, ".bin", "llama3_dump_native")
ASAN = os.path.join(HERE, ".bin", "run_asan")
IDS = [1, 5, 17, 42, 3, 77, 260, 299]
EXACT_TOL = 2e-5
QUANT_TIGHT = 2e-4
CASCADE = 3.0
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
# name -> random_model settings: every architecture's features in four files per type
VARIANTS = {
    "llama_untied_gqa_ropefreqs": dict(arch="llama", tied=False, rope_freqs=True, theta=500000.0),
    "llama_tied_mha": dict(arch="llama", tied=True, n_kv_heads=4, n_layers=1),
    "qwen2_untied_gqa": dict(arch="qwen2", tied=False, theta=1000000.0, eps=1e-6),
    "qwen2_tied_mqa": dict(arch="qwen2", tied=True, n_kv_heads=1, n_layers=1),
}


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, timeout=kw.pop("timeout", 120), **kw)


def path(name):
    os.makedirs(TMP, exist_ok=True)
    return os.path.join(TMP, name + ".gguf")


def write(name, seed, **settings):
    meta, tensors = ref.random_model(seed=seed, **settings)
    p = path(name)
    ref.write_gguf(p, meta, tensors, version=settings.get("version", 3))
    return p


def dump_logits(p, ids, dump=DUMP):
    if not os.path.isfile(dump):
        if dump == NATIVE_DUMP:
            raise Skip("%s is missing (make tests/.bin/llama3_dump_native)" % dump)
        raise AssertionError("%s is missing (make tests/.bin/llama3_dump)" % dump)
    r = sh([dump, "logits", p] + [str(i) for i in ids])
    assert r.returncode == 0, "llama3_dump logits failed (%d): %s" % (r.returncode, r.stderr.decode(errors="replace").strip()[-300:])
    got = np.array([[float(x) for x in line.split()] for line in r.stdout.decode().splitlines()])
    assert got.shape[0] == len(ids), "llama3_dump printed %d lines for %d ids" % (got.shape[0], len(ids))
    return got


def relative_errors(a, b, scale):
    """max |a - b| at each position, relative to scale (max |logit|)."""
    return np.abs(a - b).max(axis=1) / scale


def within(per_pos, tight, noise, what):
    """The verdict of an engine against an emulation of its arithmetic:
    within `tight` (float rounding), or else, with noise given, a rounding
    flip cascading, bounded by CASCADE x noise (the whole effect of the
    activation rounding). Returns the detail; raises AssertionError."""
    err = float(per_pos.max())
    if err <= tight:
        return "max error %.2g" % err
    first = int(np.nonzero(per_pos > tight)[0][0])
    assert noise is not None, "%s: max error %.3g (limit %g), first from position %d of %d" % (
        what, err, tight, first, len(per_pos))
    assert err <= CASCADE * noise, ("%s: max error %.3g, from position %d of %d; the activation rounding's own "
                                    "effect is %.3g, limit %.3g" % (what, err, first, len(per_pos), noise,
                                                                    CASCADE * noise))
    return "max error %.2g from position %d (a rounding flip cascading; noise %.2g, limit %.2g)" % (
        err, first, noise, CASCADE * noise)


def against_reference(model, got, ids, quantised, exact=None, emu=None, emulation="runc"):
    """run.c's logits `got` against the reference: the exact forward for
    the float types, forward(..., emulation) for the quantised ones (exact and
    emu: those forwards, when already computed)."""
    exact = ref.forward(model, ids) if exact is None else exact
    assert got.shape == exact.shape, "run.c gives %s logits, the reference %s" % (got.shape, exact.shape)
    scale = float(np.abs(exact).max())
    if not quantised:
        return within(relative_errors(got, exact, scale), EXACT_TOL, None, "against the exact forward")
    emu = ref.forward(model, ids, emulation) if emu is None else emu
    noise = float(np.abs(exact - emu).max()) / scale
    what = "against the int8 emulation (error against the exact forward %.3g)" % (
        float(np.abs(got - exact).max()) / scale)
    return within(relative_errors(got, emu, scale), QUANT_TIGHT, noise, what) + " against the int8 emulation"


def bf16_dot(dump):
    """Whether the build of `dump` multiplies BF16 weights by bfloat16 dot
    products (its inputs rounded to bfloat16)."""
    r = sh([dump, "kernels"]) if os.path.isfile(dump) else None
    return bool(r and r.returncode == 0 and b"BF16 dot products" in r.stdout)


def compare(p, quantised, ids=IDS, dump=DUMP):
    """The verdict's details for one file; raises AssertionError when out of
    tolerance. Returns a short description of the error seen. A build with
    bfloat16 dot products is held to the emulation of its bfloat16 inputs
    wherever the file has BF16 matrices."""
    model = ref.Model(ref.read_gguf(p))
    got = dump_logits(p, ids, dump)
    if bf16_dot(dump) and "BF16" in model.t.values():
        return against_reference(model, got, ids, True, emulation="runc_bf16") + " (bfloat16 inputs)"
    return against_reference(model, got, ids, quantised)


def verdict_with_detail(name, fn):
    """verdicts.case() with the function's result (the errors seen) in the
    PASS line."""
    try:
        detail = fn()
    except Skip as e:
        print("SKIP %s: %s" % (name, e), flush=True)
        COUNTS["SKIP"] += 1
        return
    except AssertionError as e:
        print(("FAIL %s: %s" % (name, e)).replace("\n", "\\n"), flush=True)
        COUNTS["FAIL"] += 1
        return
    except Exception as e:  # a crash is a failure with its reason
        print(("FAIL %s: exception %s: %s" % (name, type(e).__name__, e)).replace("\n", "\\n"), flush=True)
        COUNTS["FAIL"] += 1
        return
    print("PASS %s (%s)" % (name, detail), flush=True)
    COUNTS["PASS"] += 1


# --- the reference has teeth ------------------------------------------------------

def test_reference_sensitivity():
    """The comparisons see what they claim to: the RoPE pairing, the
    rope_freqs factors and qwen2's biases each move the reference's logits."""
    meta, tensors = ref.random_model(arch="llama", rope_freqs=True, theta=500000.0, seed=3, n_layers=1)
    g = ref.read_gguf(ref.build_gguf(meta, tensors)[0])
    m = ref.Model(g)
    base = ref.forward(m, IDS)
    scale = np.abs(base).max()
    m.hp = dict(m.hp, arch="qwen2")
    assert np.abs(ref.forward(m, IDS) - base).max() > 1e-2 * scale, "RoPE pairs do not matter"
    m.hp = dict(m.hp, arch="llama")
    del m.w["rope_freqs.weight"]
    assert np.abs(ref.forward(m, IDS) - base).max() > 1e-2 * scale, "rope_freqs do not matter"
    meta, tensors = ref.random_model(arch="qwen2", seed=4, n_layers=1)
    m = ref.Model(ref.read_gguf(ref.build_gguf(meta, tensors)[0]))
    base = ref.forward(m, IDS)
    for b in [k for k in m.w if k.endswith(".bias")]:
        del m.w[b]
    assert np.abs(ref.forward(m, IDS) - base).max() > 1e-2 * np.abs(base).max(), "the biases do not matter"
    return "RoPE pairing, rope_freqs and biases each move the logits by > 1%"


# --- logits --------------------------------------------------------------------------

def logits_fn(name, wtype, seed, settings, dump=DUMP):
    def fn():
        p = write(name, seed, wtype=wtype, **settings)
        return compare(p, wtype not in ref.EXACT_TYPES, dump=dump)
    return fn


def mix_fn(name, seed, settings, types, wtype, dump=DUMP):
    """Mixed types in one file, as llama-quantize's K mixes write them."""
    def fn():
        p = write(name, seed, wtype=wtype, types=types, **settings)
        return compare(p, True, dump=dump)
    return fn


def format_variants_fn():
    """GGUF version 2, general.alignment 64, and metadata of every value
    type that a reader must skip (arrays of arrays, int64, bool, float64)."""
    def fn():
        meta, tensors = ref.random_model(arch="llama", wtype="Q8_0", seed=21, n_layers=1)
        meta = dict(meta)
        meta["test.u8"] = ref.Typed(ref.UINT8, 7)
        meta["test.i16"] = ref.Typed(ref.INT16, -3)
        meta["test.u64"] = ref.Typed(ref.UINT64, 2 ** 40)
        meta["test.i64"] = ref.Typed(ref.INT64, -2 ** 40)
        meta["test.f64"] = ref.Typed(ref.FLOAT64, 0.25)
        meta["test.bool"] = ref.Typed(ref.BOOL, True)
        meta["test.strings"] = ref.Typed(ref.ARRAY, ["", "x", "\u00e9t\u00e9"], ref.STRING)
        meta["test.nested"] = ref.Typed(ref.ARRAY, [ref.Typed(ref.ARRAY, [1, 2], ref.INT8)], ref.ARRAY)
        meta["test.empty"] = ref.Typed(ref.ARRAY, [], ref.FLOAT64)
        details = []
        for version, align in ((2, None), (3, 64), (2, 128)):
            p = path("format_v%d_a%s" % (version, align))
            ref.write_gguf(p, meta, tensors, version=version, alignment=align)
            details.append("v%d/%s: %s" % (version, align or 32, compare(p, True)))
        return "; ".join(details)
    return fn


# --- dequantisation at the format's edges ------------------------------------------------

def edge_blocks(t):
    """Blocks of type t (IQ4_NL, IQ4_XS, MXFP4) at the edges of the format,
    whole rows of 256 values: every code in both nibbles of a block;
    MXFP4's exponent byte 0 and 1 (subnormal float32 scales), 254 and 255
    (values past float32's range: infinity), 127, 128 and others; IQ4's f16
    d zero, -0, negative, +-65504, subnormal, and IQ4_XS's 6-bit scales 0
    (-32), 63 (+31), 32 (0) and between."""
    codes = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    halves = lambda bits: np.array(bits, np.uint16).view(np.float16)
    if t == "MXFP4":
        b = np.zeros(16, ref.BLOCK[t])
        b["e"] = [0, 1, 2, 126, 127, 128, 254, 255, 3, 64, 100, 125, 129, 130, 190, 253]
        b["qs"] = codes
    elif t == "IQ4_NL":
        b = np.zeros(16, ref.BLOCK[t])
        b["d"] = halves([0x0000, 0x8000, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x0001, 0x8001,
                         0x0400, 0x8400, 0x3555, 0xB555, 0x2E66, 0xAE66, 0x5640, 0xD640])
        b["qs"] = codes
    else:
        b = np.zeros(4, ref.BLOCK[t])
        b["d"] = halves([0x3C00, 0xFBFF, 0x0001, 0x0000])
        ls = np.array([[0, 63, 32, 31, 1, 62, 16, 48], [63] * 8, [0] * 8, [5] * 8])
        b["scales_l"] = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
        b["scales_h"] = sum(((ls[:, g] >> 4) & 3) << (2 * g) for g in range(8))
        b["qs"] = np.tile(codes, 8)
    return b.tobytes()


def dequant_fn(t):
    """run.c's values of type t, the token embedding's rows as the forward
    pass reads them (llama3_dump rows), equal to gguf_ref's dequantisation
    written from the format's definition: the edge blocks, then random rows."""
    def fn():
        meta, tensors = ref.random_model(arch="llama", wtype="Q8_0", types={"token_embd.weight": t}, seed=41, n_layers=1)
        edges = edge_blocks(t)
        rows = len(edges) // ref.nbytes(t, 256)
        tensors = [(n, ty, ne, edges + raw[len(edges):] if n == "token_embd.weight" else raw) for n, ty, ne, raw in tensors]
        p = path("dequant_" + t)
        ref.write_gguf(p, meta, tensors)
        ids = list(range(rows)) + [17, 42, 299]
        raw = ref.read_gguf(open(p, "rb").read()).tensors["token_embd.weight"][2]
        want = ref.dequantize(t, raw, 300 * 256).reshape(300, 256)[ids]
        r = sh([DUMP, "rows", p] + [str(i) for i in ids])
        assert r.returncode == 0, "llama3_dump rows failed (%d): %s" % (r.returncode, r.stderr.decode(errors="replace")[-300:])
        # printed with 9 digits: each float32 read back exactly
        got = np.array([[float(x) for x in line.split()] for line in r.stdout.decode().splitlines()]).astype(np.float32)
        assert got.shape == want.shape, "%s values for %s" % (got.shape, want.shape)
        bad = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))))
        assert not bad.size, "%d of %d values differ, first at %s: run.c %r, reference %r" % (
            bad.size, want.size, np.unravel_index(bad[0], want.shape), got.flat[bad[0]], want.flat[bad[0]])
        edge = want[:rows]
        subnormal = (np.abs(edge) < np.finfo(np.float32).tiny) & (edge != 0)
        return "%d values equal (%d edge rows: %d infinite, %d zero, %d subnormal)" % (
            want.size, rows, np.isinf(edge).sum(), (edge == 0).sum(), subnormal.sum())
    return fn


# --- generation ------------------------------------------------------------------------

def smoke_fn(name, wtype, settings):
    def fn():
        p = write("smoke_" + name, 31, wtype=wtype, **settings)
        r = sh([RUN, p, "-t", "0", "-n", "8", "-i", "tea"])
        err = r.stderr.decode(errors="replace").strip()
        assert r.returncode == 0, "exit %d: %s" % (r.returncode, err[-300:])
        out = r.stdout.decode(errors="replace")
        assert out.startswith("tea") and len(out.strip()) > len("tea"), "output %r" % out[:200]
        # the same with JSON output
        r = sh([RUN, p, "-t", "0", "-n", "6", "-i", "tea", "-f", "json"])
        assert r.returncode == 0, "json: exit %d: %s" % (r.returncode, r.stderr.decode(errors="replace")[-300:])
        return "exit 0, %d bytes of text" % len(out)
    return fn


# --- files made by llama.cpp (tests/gguf/, README.md there) ---------------------------------
#
# Each fixture was written by llama.cpp's gguf-py and llama-quantize; its
# .logits golden is llama.cpp's own output (8 positions, float32 KV cache).
# Three checks per file, errors relative to max |golden logit|:
#  (a) run.c against llama.cpp. F32: within F32_TOL = 1e-5 (seen 6e-7 and
#      9e-7; both compute in float32). This proves the RoPE pairing per
#      architecture, qwen2's biases, the tied classifier and rope_freqs on
#      files llama.cpp wrote: gguf_ref's forward with one of them wrong
#      misses the golden by 0.60 (llama-s, halves), 0.59 (qwen2-s, adjacent
#      pairs), 0.25 (no rope_freqs), 0.61 (no biases).
#      Every other type: the two engines round the matmul inputs
#      differently (run.c: int8 per 32, 16 for Q6_K, float32 for F16/BF16
#      weights; llama.cpp: q8_0 per 32, q8_1 for Q4_1/Q5_1, q8_K per 256,
#      float16 for F16, bfloat16 for BF16), so they differ by up to the sum
#      of both roundings' effects, each measured with gguf_ref as
#      max |exact forward - that engine's emulation|. Limit: F32_TOL +
#      ROUNDING_MARGIN x that sum, the margin 1.5 for the cascades that a
#      rounding flip starts (up to 1.1x the effect, see gguf_ref's
#      docstring). Seen: 0.4 .. 1.0 x the sum (2.4e-4 for F16, 4.7e-3 for
#      BF16, 1.4e-2 .. 3.3e-2 for the quantised files). A misread block
#      layout or scale moves logits by tens of percent.
#  (b) gguf_ref's 'llamacpp' emulation against the golden: within
#      LLAMACPP_TIGHT = 1e-5 (seen <= 4.1e-7: float32 against float64, and
#      the golden's 7 printed digits), or (not for F32) a rounding flip's
#      cascade as in within(). This shows that the reference reproduces
#      llama.cpp on llama.cpp's files. F16 is the exception: gguf_ref does
#      not model llama.cpp's F16 path (its docstring), so there the golden
#      must lie within the effect of rounding the activations to float16
#      (from the exact forward).
#  (c) run.c against gguf_ref's 'runc' emulation, as for the random files
#      (against_reference).
#  Greedy generation from text on the two F32 files: the prompt's ids and
#  12 greedy tokens as llama.cpp's (llamacpp_greedy_fn).

FIXTURES = os.path.join(HERE, "gguf")
F32_TOL = 1e-5
LLAMACPP_TIGHT = 1e-5
ROUNDING_MARGIN = 1.5
# name -> what it carries (README.md lists the type of every tensor)
LLAMACPP_FILES = {
    "llama-s.f32": "F32; llama, untied output, rope_freqs",
    "qwen2-s.f32": "F32; qwen2, q/k/v biases, tied",
    "llama-s.bf16": "BF16",
    "qwen2-s.f16": "F16",
    "llama-s.q4_0": "Q4_0, Q8_0 output",
    "qwen2-s.q4_1": "Q4_1, Q8_0 token_embd (tied)",
    "qwen2-s.q5_1": "Q5_1, Q8_0 token_embd (tied)",
    "llama-k.q4_k_m": "Q4_K_M: Q4_K, Q6_K",
    "qwen2-k.q4_k_s": "Q4_K_S: Q4_K, Q5_K, Q6_K, Q5_0 for rows of 384",
}
_fixture_cache = {}


def goldens():
    if "goldens" not in _fixture_cache:
        with open(os.path.join(FIXTURES, "goldens.json")) as f:
            _fixture_cache["goldens"] = json.load(f)
    return _fixture_cache["goldens"]


def fixture(name):
    """run.c's logits, llama.cpp's, the reference's (exact and both
    emulations) for one fixture, computed once for its three checks."""
    if name not in _fixture_cache:
        p = os.path.join(FIXTURES, name + ".gguf")
        ids = goldens()[name]["ids"]
        gold = np.loadtxt(os.path.join(FIXTURES, name + ".logits"), ndmin=2)
        model = ref.Model(ref.read_gguf(p))
        assert gold.shape == (len(ids), model.w["token_embd.weight"].shape[0]), "golden shape %s" % (gold.shape,)
        d = dict(model=model, ids=ids, gold=gold, scale=float(np.abs(gold).max()),
                 exact=ref.forward(model, ids), llamacpp=ref.forward(model, ids, "llamacpp"),
                 types=set(model.t[n] for n in model.t if model.w[n].ndim == 2))
        d["quantised"] = not d["types"] <= set(ref.EXACT_TYPES)
        d["runc"] = ref.forward(model, ids, "runc") if d["quantised"] else d["exact"]
        d["got"] = dump_logits(p, ids)
        _fixture_cache[name] = d
    return _fixture_cache[name]


def effect(d, kind):
    """The activation rounding's whole effect in one engine's emulation."""
    return float(np.abs(d["exact"] - d[kind]).max()) / d["scale"]


def runc_vs_llamacpp_fn(name, what):
    def fn():
        d = fixture(name)
        per_pos = relative_errors(d["got"], d["gold"], d["scale"])
        if d["types"] == {"F32"}:
            return what + ": " + within(per_pos, F32_TOL, None, "run.c against llama.cpp")
        ours, theirs = effect(d, "runc"), effect(d, "llamacpp")
        limit = F32_TOL + ROUNDING_MARGIN * (ours + theirs)
        err = float(per_pos.max())
        assert err <= limit, ("run.c against llama.cpp: max error %.3g at position %d, limit %.3g (the activation "
                              "roundings' effects: run.c %.3g, llama.cpp %.3g)"
                              % (err, int(per_pos.argmax()), limit, ours, theirs))
        return "%s: max error %.2g, limit %.2g = 1e-5 + %g x (run.c's rounding %.2g + llama.cpp's %.2g)" % (
            what, err, limit, ROUNDING_MARGIN, ours, theirs)
    return fn


def reference_vs_llamacpp_fn(name):
    def fn():
        d = fixture(name)
        theirs = effect(d, "llamacpp")
        if "F16" in d["types"]:
            err = float(relative_errors(d["exact"], d["gold"], d["scale"]).max())
            assert err <= theirs, ("F16: llama.cpp %.3g from the exact forward, more than rounding the activations "
                                   "to float16 moves it (%.3g)" % (err, theirs))
            return "F16 (not emulated): llama.cpp %.2g from the exact forward, float16 activations move it %.2g" % (
                err, theirs)
        per_pos = relative_errors(d["llamacpp"], d["gold"], d["scale"])
        return within(per_pos, LLAMACPP_TIGHT, theirs if d["types"] != {"F32"} else None,
                      "gguf_ref's llama.cpp emulation against llama.cpp")
    return fn


def runc_vs_reference_fn(name):
    def fn():
        d = fixture(name)
        return against_reference(d["model"], d["got"], d["ids"], d["quantised"], d["exact"], d["runc"])
    return fn


def run_json(args):
    """run.c's first JSON object on stdout, with its exit status."""
    r = sh([RUN] + args)
    out = r.stdout.decode(errors="replace").strip()
    obj = json.JSONDecoder().raw_decode(out)[0] if r.returncode == 0 and out.startswith("{") else None
    return r, obj


def llamacpp_greedy_fn(name):
    """./run FILE -t 0 on a text prompt gives llama.cpp's greedy tokens
    (llama-logits -g 12 on llama.cpp's tokenisation of the same text;
    the smallest top-2 gap on that path is in the golden, >= 1e-2, far
    above F32_TOL, so a greedy choice cannot flip)."""
    def fn():
        g = goldens()[name]["generate"]
        p = os.path.join(FIXTURES, name + ".gguf")
        r, obj = run_json([p, "-m", "tokenize", "-f", "json", "-i", g["text"]])
        err = r.stderr.decode(errors="replace").strip()
        if r.returncode == 1:
            raise Skip("run.c does not tokenize with this file's vocabulary yet: %s" % (err.splitlines() or [""])[-1])
        assert r.returncode == 0 and obj, "-m tokenize: exit %d: %s" % (r.returncode, err[-300:])
        assert obj["tokens"] == g["ids"], "%r tokenizes to %s, llama.cpp: %s" % (g["text"], obj["tokens"], g["ids"])
        want = g["greedy12"]
        r, obj = run_json([p, "-t", "0", "-n", str(len(g["ids"]) + len(want) - 1), "-f", "json", "-i", g["text"]])
        assert r.returncode == 0 and obj, "generate: exit %d: %s" % (r.returncode, r.stderr.decode(errors="replace")[-300:])
        assert obj["tokens"][:len(want)] == want, "greedy tokens %s, llama.cpp's %s" % (obj["tokens"], want)
        return "%r -> %d prompt ids, %d greedy tokens as llama.cpp's" % (g["text"], len(g["ids"]), len(want))
    return fn


def llamacpp_fixture_cases():
    for name, what in LLAMACPP_FILES.items():
        tag = name.replace("-", "_").replace(".", "_")
        verdict_with_detail("gguf_llamacpp_%s_runc_vs_llamacpp" % tag, runc_vs_llamacpp_fn(name, what))
        verdict_with_detail("gguf_llamacpp_%s_reference_vs_llamacpp" % tag, reference_vs_llamacpp_fn(name))
        verdict_with_detail("gguf_llamacpp_%s_runc_vs_reference" % tag, runc_vs_reference_fn(name))
    for name in ("llama-s.f32", "qwen2-s.f32"):
        verdict_with_detail("gguf_llamacpp_%s_greedy" % name.replace("-", "_").replace(".", "_"),
                            llamacpp_greedy_fn(name))


# --- IQ4_NL, IQ4_XS and MXFP4 against today's llama.cpp, live -------------------------------
#
# No fixture in tests/gguf/ carries these types: the files are made here
# and llama.cpp (npm node-llama-cpp, tests/llamacpp.py; SKIP without it)
# reads them now. IQ4_NL and IQ4_XS: a random F32 file quantised by
# llama.cpp's llama_model_quantize (its blocks, its choice of types for
# token_embd and output); MXFP4: random blocks written by gguf_ref, as
# llama.cpp's quantiser writes MXFP4 only for experts (MXFP4_MOE; see
# tests/test_arch.py for those). The same three checks as the fixtures',
# on log-probabilities (nats, every token; llama.cpp's oracle gives
# log-probabilities, not logits): (a) run.c against llama.cpp within
# LIVE_TOL + ROUNDING_MARGIN x the two engines' activation-rounding
# effects, (b) gguf_ref's 'llamacpp' emulation against llama.cpp within
# LIVE_TOL or a rounding flip's cascade, (c) run.c against the 'runc'
# emulation (against_reference, on logits). (b) and (c) are the tight
# ones: a misread block moves the log-probabilities by whole nats.

LIVE_TOL = 1e-4
LIVE_FILES = {"IQ4_NL": "llama_untied_gqa_ropefreqs", "IQ4_XS": "qwen2_untied_gqa", "MXFP4": "llama_untied_gqa_ropefreqs"}


def log_softmax(logits):
    m = logits.max(axis=-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))


def live(t):
    """The file of type t for the live checks, and the log-probabilities of
    llama.cpp, run.c and gguf_ref (exact and both emulations), once."""
    key = "live_" + t
    if key not in _fixture_cache:
        settings = VARIANTS[LIVE_FILES[t]]
        p = path("live_" + t.lower())
        if t == "MXFP4":
            write("live_" + t.lower(), 61, wtype=t, **settings)
        else:
            src = write("live_%s_f32" % t.lower(), 62, wtype="F32", **settings)
            if not os.path.exists(p):
                llamacpp.quantize(src, p, t)
        model = ref.Model(ref.read_gguf(open(p, "rb").read()))
        theirs = llamacpp.oracle(p, IDS, full=True)
        gold = np.array([[-np.inf if v is None else v for v in at["logprobs"]] for at in theirs])
        got = dump_logits(p, IDS)
        d = dict(model=model, got=got, gold=gold, exact=ref.forward(model, IDS), types=sorted(set(model.t.values())))
        d["llamacpp"], d["runc"] = ref.forward(model, IDS, "llamacpp"), ref.forward(model, IDS, "runc")
        _fixture_cache[key] = d
    return _fixture_cache[key]


def nats(a, b):
    """max |a - b| at each position, over the tokens both give a finite
    log-probability (llama.cpp's underflow to 0 in the far tail)."""
    both = np.isfinite(a) & np.isfinite(b)
    return np.where(both, np.abs(a - b), 0.0).max(axis=1)


def live_fn(t, check):
    def fn():
        d = live(t)
        lp = {k: log_softmax(d[k]) for k in ("got", "exact", "llamacpp", "runc")}
        ours, theirs = float(nats(lp["exact"], lp["runc"]).max()), float(nats(lp["exact"], lp["llamacpp"]).max())
        if check == "runc_vs_llamacpp":
            err, limit = float(nats(lp["got"], d["gold"]).max()), LIVE_TOL + ROUNDING_MARGIN * (ours + theirs)
            assert err <= limit, ("run.c against llama.cpp: %.3g nats, limit %.3g (the activation roundings' effects: "
                                  "run.c %.3g, llama.cpp %.3g)" % (err, limit, ours, theirs))
            return "%s: %.2g nats, limit %.2g = 1e-4 + %g x (run.c's rounding %.2g + llama.cpp's %.2g)" % (
                "/".join(d["types"]), err, limit, ROUNDING_MARGIN, ours, theirs)
        if check == "reference_vs_llamacpp":
            return within(nats(lp["llamacpp"], d["gold"]), LIVE_TOL, theirs, "gguf_ref's llama.cpp emulation against llama.cpp")
        return against_reference(d["model"], d["got"], IDS, True, d["exact"], d["runc"])
    return fn


def llamacpp_live_cases():
    for t in LIVE_FILES:
        for check in ("runc_vs_llamacpp", "reference_vs_llamacpp", "runc_vs_reference"):
            verdict_with_detail("gguf_llamacpp_live_%s_%s" % (t.lower(), check), live_fn(t, check))


# --- bad input ---------------------------------------------------------------------------

def base_model(**kw):
    settings = dict(arch="llama", wtype="Q4_0", n_layers=1, seed=41)
    settings.update(kw)
    return ref.random_model(**settings)


def bad_files():
    """{case name: (bytes, words the one-line error must contain)}"""
    meta, tensors = base_model()
    good, lay = ref.build_gguf(meta, tensors)
    files = {}

    def patch(data, at, fmt, value):
        b = bytearray(data)
        struct.pack_into("<" + fmt, b, at, value)
        return bytes(b)

    # truncations: in the magic, the header, the KV section (inside the token
    # list), the tensor infos, at the data section and inside it, one byte short
    for label, at in (("magic", 3), ("header", 15), ("kv", lay["kv"] + 30),
                      ("token_list", lay["key:tokenizer.ggml.tokens"] + 200),
                      ("infos", lay["infos"] + 9), ("info_offset", lay["offset:blk.0.attn_q.weight"] + 3),
                      ("data_start", lay["data"]), ("data", (lay["data"] + len(good)) // 2),
                      ("one_byte_short", len(good) - 1)):
        files["truncated_" + label] = (good[:at], [])
    # lengths and counts past the end
    k0 = lay["kv"]
    files["key_length_huge"] = (patch(good, k0, "Q", 2 ** 40), [])
    files["key_length_past_end"] = (patch(good, k0, "Q", len(good)), [])
    tok = lay["key:tokenizer.ggml.tokens"] + 8 + len("tokenizer.ggml.tokens") + 4 + 4
    files["array_count_huge"] = (patch(good, tok, "Q", 2 ** 61), [])
    files["string_in_array_past_end"] = (patch(good, tok + 8, "Q", 2 ** 33), [])
    files["tensor_count_huge"] = (patch(good, 8, "q", 2 ** 60), [])
    files["kv_count_huge"] = (patch(good, 16, "q", 2 ** 60), [])
    files["tensor_count_negative"] = (patch(good, 8, "q", -1), [])
    # tensor offsets
    name = "output_norm.weight"
    files["offset_past_end"] = (patch(good, lay["offset:" + name], "Q", 2 ** 40), [])
    files["offset_overflow"] = (patch(good, lay["offset:" + name], "Q", 2 ** 64 - 32), [])
    last = tensors[-1][0]
    files["last_tensor_past_end"] = (patch(good, lay["offset:" + last], "Q",
                                           lay["tensor:" + last] - lay["data"] + 64), [])
    files["offset_misaligned"] = (patch(good, lay["offset:" + name], "Q",
                                        lay["tensor:" + name] - lay["data"] + 4), [])
    # an unknown tensor type (16 is IQ2_XXS): the error names the type and the tensor
    files["unknown_type"] = (patch(good, lay["type:blk.0.attn_q.weight"], "I", 16),
                             ["blk.0.attn_q.weight", ("16", "IQ2_XXS")])
    files["type_out_of_range"] = (patch(good, lay["type:blk.0.attn_k.weight"], "I", 4000),
                                  ["blk.0.attn_k.weight"])
    files["version_1"] = (patch(good, 4, "I", 1), [])
    files["version_4"] = (patch(good, 4, "I", 4), [])
    files["n_dims_5"] = (patch(good, lay["info:blk.0.attn_q.weight"] + 8 + len("blk.0.attn_q.weight"), "I", 5), [])
    # unknown architecture: the error names it
    m2 = {k.replace("llama.", "mamba."): v for k, v in meta.items()}
    m2["general.architecture"] = "mamba"
    files["unknown_arch"] = (ref.build_gguf(m2, tensors)[0], ["mamba"])
    # shape against the hyperparameters: attn_q with 128 rows for dim 256
    t2 = [(n, t, ne if n != "blk.0.attn_q.weight" else [ne[0], 128],
           raw if n != "blk.0.attn_q.weight" else raw[:len(raw) // 2]) for n, t, ne, raw in tensors]
    files["shape_contradicts"] = (ref.build_gguf(meta, t2)[0], [])
    m3 = dict(meta)
    m3["llama.embedding_length"] = 128
    files["embedding_length_contradicts"] = (ref.build_gguf(m3, tensors)[0], [])
    files["missing_tensor"] = (ref.build_gguf(meta, [x for x in tensors if x[0] != "blk.0.ffn_down.weight"])[0], [])
    files["missing_layer"] = (ref.build_gguf(dict(meta, **{"llama.block_count": 2}), tensors)[0], [])
    dup = [x for x in tensors] + [x for x in tensors if x[0] == "output_norm.weight"]
    files["duplicated_tensor"] = (ref.build_gguf(meta, dup)[0], [])
    # a vocabulary-only file given as a model
    files["vocab_only"] = (ref.build_gguf(meta, [])[0], [])
    return files


def check_bad(binary, name, data, words):
    p = path("bad_" + name)
    with open(p, "wb") as f:
        f.write(data)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1:exitcode=99",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=99")
    try:
        r = sh([binary, p, "-t", "0", "-n", "4", "-i", "tea"], env=env, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("%s: hangs (60 s)" % name)
    err = r.stderr.decode(errors="replace")
    lines = err.splitlines()
    assert r.returncode == 1, "%s: exit %d, stderr %r" % (name, r.returncode, err[-400:])
    assert len(lines) == 1 and lines[0].startswith("run: "), "%s: stderr is not one 'run: ' line: %r" % (name, err[-400:])
    for w in words:
        alts = w if isinstance(w, tuple) else (w,)
        assert any(a in lines[0] for a in alts), "%s: the error does not name %s: %r" % (name, " or ".join(alts), lines[0])
    return lines[0]


def bad_fn(binary, files):
    def fn():
        if not os.path.isfile(binary):
            raise Skip("%s is missing (make %s)" % (binary, binary))
        failures = []
        for name, (data, words) in files.items():
            try:
                check_bad(binary, name, data, words)
            except AssertionError as e:
                failures.append(str(e))
        assert not failures, "%d of %d bad files: %s" % (len(failures), len(files), " | ".join(failures))
        return "%d files, each one 'run: ' line and exit 1" % len(files)
    return fn


def bad_each(binary, files, prefix):
    for name, (data, words) in files.items():
        def fn(name=name, data=data, words=words):
            if not os.path.isfile(binary):
                raise Skip("%s is missing (make %s)" % (binary, binary))
            return check_bad(binary, name, data, words)
        verdict_with_detail("%s_%s" % (prefix, name), fn)


def main():
    verdict_with_detail("gguf_reference_sensitivity", test_reference_sensitivity)
    for suffix, dump in (("", DUMP), ("_vector", NATIVE_DUMP)):
        seed = 100
        for wtype in TYPES:
            for vname, settings in VARIANTS.items():
                seed += 1
                name = "%s_%s" % (wtype, vname)
                verdict_with_detail("gguf_logits_" + name + suffix, logits_fn(name, wtype, seed, settings, dump))
        # llama-quantize's Q4_K_M: attn_v, ffn_down and output in Q6_K, the rest Q4_K;
        # and the fallbacks for rows that are not whole 256-blocks
        verdict_with_detail("gguf_logits_mix_q4_k_m" + suffix, mix_fn("mix_q4_k_m", 7, VARIANTS["llama_untied_gqa_ropefreqs"],
                                                                       {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q6_K",
                                                                        "output.weight": "Q6_K"}, "Q4_K", dump))
        verdict_with_detail("gguf_logits_mix_fallbacks" + suffix, mix_fn("mix_fallbacks", 8, VARIANTS["qwen2_untied_gqa"],
                                                                         {"attn_q.weight": "Q5_0", "attn_k.weight": "Q5_1",
                                                                          "attn_v.weight": "Q8_0", "ffn_up.weight": "Q4_1",
                                                                          "ffn_gate.weight": "Q4_0", "token_embd.weight": "Q6_K",
                                                                          "output.weight": "F16", "ffn_down.weight": "BF16"}, "Q5_K",
                                                                         dump))
    for t in ("IQ4_NL", "IQ4_XS", "MXFP4"):
        verdict_with_detail("gguf_dequant_edges_" + t, dequant_fn(t))
    verdict_with_detail("gguf_format_versions_alignment_metadata", format_variants_fn())
    verdict_with_detail("gguf_generate_llama_q4_k", smoke_fn("llama_q4_k", "Q4_K", VARIANTS["llama_untied_gqa_ropefreqs"]))
    verdict_with_detail("gguf_generate_qwen2_q8_0", smoke_fn("qwen2_q8_0", "Q8_0", VARIANTS["qwen2_tied_mqa"]))
    llamacpp_fixture_cases()
    llamacpp_live_cases()
    files = bad_files()
    bad_each(RUN, files, "gguf_bad")
    verdict_with_detail("gguf_bad_asan", bad_fn(ASAN, files))
    print("%d passed, %d failed, %d skipped" % (COUNTS["PASS"], COUNTS["FAIL"], COUNTS["SKIP"]))
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
