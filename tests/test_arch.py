#!/usr/bin/env python3
"""The architectures beyond llama (run.c section 1's table: qwen3, gemma3,
phi3, smollm3, granite, llama whose heads are not dim / n_heads wide, and
the mixtures of experts qwen3moe, qwen2moe, olmoe, Mixtral, llama with
experts, gpt-oss, and deepseek2)
against today's llama.cpp itself, through npm's node-llama-cpp@3.21.1
(tests/llamacpp.py: its prebuilt libllama, teacher-forced).

Files: small random models of each architecture written here by
tests/arch_models.py (its docstring has the facts each one exercises:
QK-norm, post-norms, GELU, sliding windows and their RoPE base, LongRoPE
with partial rotary and its attention factor, fused tensors, layers
without RoPE, Granite's four scales, a head width set apart from
dim / n_heads, routers, renormalised or not, experts in 3-D tensors,
Qwen2-MoE's gated shared expert and q/k/v biases, OLMoE's whole-row q/k
norms; an all-zero router, where every expert ties and llama.cpp takes
the lowest indices; an expert_weights_scale that these archs' loaders
ignore; gpt-oss's biases everywhere, attention sinks, a window on every
other layer, YaRN, top-k-then-softmax routing and the clamped SwiGLU;
DeepSeek-V2's latent attention from both GGUF generations (attn_kv_b, and
attn_k_b / attn_v_b: one model in both gives the same tokens), q straight
or through a low rank, YaRN with its log multiplier, a leading dense
layer, softmax or sigmoid routing with exp_probs_b, renormalised or not and
scaled, shared experts, and a cache of one latent row a position whose
bytes the stats line shows), in float32, and quantised by llama.cpp's own quantiser
(llama_model_quantize: Q8_0 and Q4_K_M; IQ4_NL on qwen3 and, with IQ4_XS,
on a llama of rows of 256, IQ4_XS's super-block; MXFP4_MOE, the experts
in MXFP4 and the rest in Q8_0, on qwen3moe and mixtral).

A case runs run.c greedily (`-t 0 -f json`) from a prompt, then feeds the
prompt and run.c's tokens to llama.cpp, which gives the log-probability of
every token after each position. It passes when
  - at every generated position, run.c's token is llama.cpp's argmax, or
    within TOKEN_TOL of it in log-probability (a near tie), and
  - run.c's score (the sum of its tokens' log-probabilities, EOS included)
    is llama.cpp's sum of the same tokens' log-probabilities within
    SCORE_TOL per token.
Tolerances, in natural-log units:
  - float32: both programs compute in float32, in different orders:
    measured differences below 2e-4 a token; gemma3's GELU is exact in
    run.c, while llama.cpp's CPU kernel rounds its input to float16 and
    reads a float16 table: differences up to 2e-2 (the reference in
    arch_models.py measures the same against a float64 forward). So 2e-3,
    and 5e-2 for gemma3.
  - quantised (teacher-forced, not greedy: rounding moves a sharp random
    model's path): run.c's log-probabilities after each of 64 tokens
    (tests/.bin/llama3_dump) against llama.cpp's, every token above -8.
    The weights are the same blocks, but each program rounds the
    activations to int8 its own way (run.c by groups of 32 with a float32
    scale, llama.cpp by 32 with a float16 scale for Q8_0, IQ4_NL and MXFP4
    and by 256 for the K types and IQ4_XS). The bound is llama.cpp's own
    rounding noise: how far its log-probabilities move between the float32
    file and the quantised one. run.c's rounding is a second draw of the
    same noise, so it may be 3 x that from llama.cpp's (as
    tests/test_gguf.py bounds its cascades). A wrong block layout or scale
    moves the logits by far more. Not so for the 4-bit tables: there the
    weights' own rounding is most of that noise (10-16 nats against 0.5-1.2
    between run.c and llama.cpp), and a doubled MXFP4 scale or two IQ4 table
    entries swapped (22 and 12-15 nats) pass 3 x it; tests/test_gguf.py's
    live cases hold those types to the emulations instead (1e-4 nats or a
    rounding flip's cascade).
Phi-3's LongRoPE factors are chosen by the context: both programs run with
a context of 256 (short factors, the original context being 256) and, as
phi3_long, 512 (long ones).
Each architectural feature has a negative control: the same file with the
feature neutralised (arch_models.FEATURES: QK-norm weights 1, post-norms
1, no window, one RoPE base, no linear scaling, RoPE on every layer, short
LongRoPE factors, no scales, router rows permuted, one expert fewer a row,
no shared expert, its gate negated, no q/k/v biases, sinks at -30, no
gpt-oss biases, no YaRN, deepseek2's YaRN without its log multiplier, its
weights' renormalisation flipped, scale 1, selection bias 0, latent norm
1...), which llama.cpp must tell apart: run.c's
tokens, checked against the neutralised file's llama.cpp, must fail the
float32 check above. So the check is known to bite on every feature.
gpt-oss's two steps that no file key can turn off (the clamped SwiGLU, the
softmax over the k chosen logits) are checked instead through the float64
reference of arch_models.py: run.c's log-probabilities agree with it and
with llama.cpp, and are far from the reference with plain SwiGLU, with
the clamp removed, or with the softmax over all experts before the top k.

Env: RUN (default ./run), PYTHON, TEST_TMP. Prints PASS/FAIL/SKIP lines."""

import json
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case as run_case  # noqa: E402

import arch_models  # noqa: E402
from gguf_ref import write_gguf  # noqa: E402
import llamacpp  # noqa: E402

RUN = os.environ.get("RUN", "./run")
NATIVE = os.path.join(os.path.dirname(HERE), "runomp")
DUMP = os.path.join(HERE, ".bin", "llama3_dump")
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "arch")
PROMPT = "e t a o i n s h r d l c u m w f g y p"
STEPS = 48
LONG_STEPS = 240  # the window cases': 15 windows of 16
CTX = 256
EOS = 2
BOS = 1   # run.c ends a text at BOS too ("stop": "bos"), its log-prob in the score
TOKEN_TOL = {"float": 2e-3, "gemma3": 5e-2}
# the files of each case: name -> (arch, arch_models keywords)
FILES = {
    "qwen3": ("qwen3", dict(seed=2)),
    "qwen3_tied": ("qwen3", dict(tied=True, seed=3)),
    "gemma3": ("gemma3", {}),
    "gemma3_softcap": ("gemma3", dict(softcap=8.0, seed=4)),
    "phi3": ("phi3", {}),
    "phi3_long": ("phi3", {}),
    "smollm3": ("smollm3", {}),
    "granite": ("granite", {}),
    "llama_key_length": ("llama", {}),
    "granite_rope_off": ("granite", dict(seed=6)),
    # mixtures of experts (mixtral: general.architecture llama with experts)
    "qwen3moe": ("qwen3moe", dict(seed=5)),
    "qwen2moe": ("qwen2moe", {}),
    "olmoe": ("olmoe", {}),
    "mixtral": ("mixtral", {}),
    # rows of 256, whole IQ4_XS super-blocks (llama.cpp writes a row of
    # fewer as IQ4_NL)
    "llama_256": ("llama", dict(dim=256, head_dim=None, ffn=512, seed=7)),
    # every router weight 0: all 8 experts tie; llama.cpp's CPU argsort
    # (std::sort, insertion sort below 17 elements) takes the lowest indices
    "qwen3moe_tie": ("qwen3moe", dict(router_gain=0.0)),
    # expert_weights_scale in the file: llama.cpp's qwen3moe (qwen2moe,
    # olmoe, llama) loader does not read it, so it changes nothing
    "qwen3moe_weights_scale": ("qwen3moe", dict(expert_weights_scale=2.5)),
    # gpt-oss: q/k/v/o biases, sinks, layers 0 and 2 windowed (4 positions),
    # YaRN (factor 4, original context 64), a router with a bias choosing by
    # logits, experts with biases and the clamped SwiGLU
    "gpt_oss": ("gpt-oss", {}),
    # the same without YaRN's scaling and with another draw of the weights
    "gpt_oss_plain_rope": ("gpt-oss", dict(yarn_factor=None, seed=7)),
    # deepseek2: latent attention from an older file's attn_kv_b, q from
    # attn_q, layer 0 dense, softmax routing renormalised and scaled 2.5,
    # two shared experts, YaRN with its log multiplier
    "deepseek2": ("deepseek2", {}),
    # the same draws in a newer file (attn_k_b, attn_v_b, key_length_mla)
    "deepseek2_k_b": ("deepseek2", dict(generation="k_b")),
    # newer, q through a rank of 48, sigmoid routing with exp_probs_b
    "deepseek2_mla": ("deepseek2", dict(generation="k_b", q_rank=48, gating=2, seed=8)),
    # no YaRN, weights neither renormalised nor scaled
    "deepseek2_plain": ("deepseek2", dict(generation="k_b", yarn_factor=None, weights_norm=False, expert_weights_scale=None,
                                          seed=9)),
}
# files whose controls would repeat another file's, or cannot apply (a
# tie file's router has no rows to permute)
NO_CONTROLS = {"qwen3moe_weights_scale": None, "qwen3moe_tie": ("routing",), "llama_256": None, "gpt_oss_plain_rope": ("yarn",),
               "deepseek2": ("probs_b",), "deepseek2_k_b": None, "deepseek2_plain": None}


# metadata beyond arch_models' of some files: Granite's switch that turns
# RoPE off in every layer (llama.cpp reads rope.scaling.finetuned so)
META = {"granite_rope_off": {"granite.rope.scaling.finetuned": False}}


def case(name):
    """Runs the function it decorates as the case `name` (verdicts.case)."""
    return lambda fn: run_case(name, fn)


def sh(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def write(name, neutralise=None, **extra):
    arch, kw = FILES[name]
    kw = dict(kw, **extra)
    path = os.path.join(TMP, "%s%s.gguf" % (name, "_no_" + neutralise if neutralise else ""))
    if not os.path.exists(path):
        meta, tensors = arch_models.arch_model(arch, neutralise=neutralise, **kw)
        meta.update(META.get(name, {}))
        write_gguf(path, meta, tensors)
    return path


def context(name):
    """The context both programs run with: phi3_long's is its file's 512,
    past the original 256 (LongRoPE's long factors); the others' CTX."""
    return 512 if name == "phi3_long" else CTX


def generate(binary, path, ctx, extra=(), steps=STEPS):
    """(prompt ids, generated ids with the EOS or BOS it ended at, score)."""
    r = sh([binary, path, "-m", "tokenize", "-f", "json", "-i", PROMPT])
    if r.returncode != 0:
        raise AssertionError("tokenize: %s" % r.stderr.strip()[-300:])
    prompt = json.loads(r.stdout)["tokens"]
    r = sh([binary, path, "-t", "0", "-n", str(len(prompt) + steps), "--ctx-size", str(ctx), "-i", PROMPT, "-f", "json", *extra])
    if r.returncode != 0:
        raise AssertionError("%s exited %d: %s" % (binary, r.returncode, r.stderr.strip()[-300:]))
    out = json.loads(r.stdout.strip().splitlines()[0])
    gen = out["tokens"] + {"eos": [EOS], "bos": [BOS]}.get(out["stop"], [])
    return prompt, gen, out["score"]


def disagreement(path, prompt, gen, score, tol, ctx):
    """None when llama.cpp agrees with run.c's tokens and score, else why
    not: each token within tol of llama.cpp's argmax, the score within tol a
    token."""
    got = llamacpp.oracle(path, prompt + gen, ctx=ctx)
    total = 0.0
    for i, token in enumerate(gen):
        at = got[len(prompt) - 1 + i]
        lp = at["next_logprob"]
        if lp is None:
            return "token %d (%d): llama.cpp gives it probability 0" % (i, token)
        total += lp
        if at["argmax_logprob"] - lp > tol:
            return "token %d: run.c chose %d, llama.cpp's argmax is %d (log-prob %.5f against %.5f)" % (
                i, token, at["argmax"], lp, at["argmax_logprob"])
    if abs(score - total) > tol * len(gen):
        return "score %.6f, llama.cpp's %.6f over %d tokens" % (score, total, len(gen))
    return None


def log_softmax_rows(rows):
    out = []
    for row in rows:
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        out.append([v - lse for v in row])
    return out


def runc_logprobs(path, tokens):
    """run.c's log-probabilities after each of the tokens (tests/.bin/llama3_dump's
    logits, the same forward pass, one row at a time)."""
    r = sh([DUMP, "logits", path] + [str(t) for t in tokens])
    if r.returncode != 0:
        raise AssertionError("llama3_dump: %s" % r.stderr.strip()[-300:])
    return log_softmax_rows([[float(v) for v in line.split()] for line in r.stdout.strip().splitlines()])


def gap(a, b, cut=-8.0):
    """The largest |a - b| over the log-probabilities either gives above cut
    (the tokens that matter; the far tails only carry rounding), all rows."""
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb) if (x > cut or y > cut) and x is not None and y is not None)


def check_quantised(name, path, f32):
    """run.c's log-probabilities on the quantised file against llama.cpp's, on
    the prompt and run.c's float32 tokens, within 3 x llama.cpp's own
    rounding noise (the gap between its float32 and quantised outputs)."""
    if not os.path.exists(DUMP):
        raise Skip("%s is missing (make %s)" % (DUMP, DUMP))
    prompt, gen, _ = generate(RUN, f32, context(name))
    tokens = (prompt + gen)[:64]
    ctx = 512 if FILES[name][0] == "phi3" else CTX  # llama3_dump runs phi3 at its file's context: long factors
    exact = [at["logprobs"] for at in llamacpp.oracle(f32, tokens, ctx=ctx, full=True)]
    theirs = [at["logprobs"] for at in llamacpp.oracle(path, tokens, ctx=ctx, full=True)]
    ours = runc_logprobs(path, tokens)
    noise, err = gap(exact, theirs), gap(ours, theirs)
    print("    (run.c against llama.cpp: %.4f; llama.cpp's rounding noise: %.4f)" % (err, noise))
    if err > 3 * noise:
        raise AssertionError("run.c's log-probabilities are %.4f from llama.cpp's, more than 3 x its rounding noise %.4f" % (err, noise))


def tolerance(arch):
    return TOKEN_TOL["gemma3" if arch == "gemma3" else "float"]


def check(name, binary, path):
    """run.c's greedy tokens on `path` against llama.cpp's."""
    ctx = context(name)
    prompt, gen, score = generate(binary, path, ctx)
    if len(gen) < 8:
        raise AssertionError("only %d tokens generated: too few to tell" % len(gen))
    why = disagreement(path, prompt, gen, score, tolerance(FILES[name][0]), ctx)
    if why:
        raise AssertionError(why)
    return prompt, gen, score


def main():
    os.makedirs(TMP, exist_ok=True)
    try:
        llamacpp.ensure_oracle()
    except Skip as e:
        print("SKIP arch: %s" % e)
        return 0
    runs = {}
    for name in FILES:
        @case("arch_%s_f32" % name)
        def _(name=name):
            runs[name] = check(name, RUN, write(name))

        if os.path.exists(NATIVE):
            @case("arch_%s_f32_vector" % name)
            def _(name=name):
                check(name, NATIVE, write(name))

    # every feature neutralised: llama.cpp must tell the file apart, so that
    # run.c's tokens fail the same check against it
    for name in FILES:
        arch = FILES[name][0]
        for feature in arch_models.FEATURES[arch]:
            if feature == "softcap" and name != "gemma3_softcap":
                continue
            if name in NO_CONTROLS and (NO_CONTROLS[name] is None or feature in NO_CONTROLS[name]):
                continue

            @case("arch_%s_control_%s" % (name, feature))
            def _(name=name, feature=feature):
                if name not in runs:
                    raise Skip("the float32 case did not run")
                prompt, gen, score = runs[name]
                why = disagreement(write(name, feature), prompt, gen, score, tolerance(arch), context(name))
                if why is None:
                    raise AssertionError("llama.cpp cannot tell the file without %s apart: the check would not bite" % feature)
                print("    (without %s: %s)" % (feature, why))

    @case("arch_granite_rope_off_control_rope")
    def _():
        if "granite_rope_off" not in runs:
            raise Skip("the float32 case did not run")
        prompt, gen, score = runs["granite_rope_off"]
        meta, tensors = arch_models.arch_model("granite", **FILES["granite_rope_off"][1])
        path = os.path.join(TMP, "granite_rope_on.gguf")
        write_gguf(path, meta, tensors)
        why = disagreement(path, prompt, gen, score, tolerance("granite"), CTX)
        if why is None:
            raise AssertionError("llama.cpp cannot tell RoPE on from off: the check would not bite")
        print("    (with RoPE: %s)" % why)

    # gpt-oss's steps that no file key names (the clamped SwiGLU, the
    # softmax over the chosen experts only): run.c's log-probabilities on its
    # own tokens agree with the reference of arch_models (which agrees with
    # llama.cpp), and are far from the reference's variants of those steps
    @case("arch_gpt_oss_variants")
    def _():
        if not os.path.exists(DUMP):
            raise Skip("%s is missing (make %s)" % (DUMP, DUMP))
        if "gpt_oss" not in runs:
            raise Skip("the float32 case did not run")
        prompt, gen, _ = runs["gpt_oss"]
        path = write("gpt_oss")
        tokens = (prompt + gen)[:64]
        ours = runc_logprobs(path, tokens)
        theirs = [at["logprobs"] for at in llamacpp.oracle(path, tokens, ctx=CTX, full=True)]
        ref = arch_models.log_softmax(arch_models.reference_logits(path, tokens)).tolist()
        print("    (run.c against llama.cpp %.1e, against the reference %.1e)" % (gap(ours, theirs), gap(ours, ref)))
        if gap(ours, theirs) > TOKEN_TOL["float"] or gap(ours, ref) > TOKEN_TOL["float"]:
            raise AssertionError("run.c is %.4f from llama.cpp, %.4f from the reference" % (gap(ours, theirs), gap(ours, ref)))
        for variant in arch_models.GPT_OSS_VARIANTS:
            other = arch_models.log_softmax(arch_models.reference_logits(path, tokens, variant=variant)).tolist()
            d = gap(ours, other)
            print("    (the reference with %s: %.2f from run.c)" % (variant, d))
            if d < 0.1:
                raise AssertionError("run.c cannot be told from the reference with %s (%.4f)" % (variant, d))

    # the two GGUF generations of one deepseek2 model give run.c the same tokens
    @case("arch_deepseek2_generations_agree")
    def _():
        if "deepseek2" not in runs or "deepseek2_k_b" not in runs:
            raise Skip("the float32 cases did not run")
        if runs["deepseek2"][1] != runs["deepseek2_k_b"][1]:
            raise AssertionError("attn_kv_b: %s, attn_k_b/attn_v_b: %s" % (runs["deepseek2"][1][:12], runs["deepseek2_k_b"][1][:12]))

    # the cache holds one row a position and layer: the latent and the RoPE
    # key, kv_lora_rank + rope.dimension_count values (96 here), in each type
    @case("arch_deepseek2_cache_bytes")
    def _():
        p = dict(arch_models.DEFAULTS["deepseek2"])
        row = p["kv_rank"] + p["n_rot"]
        for kv_type, size in (("f32", 4 * row), ("f16", 2 * row), ("q8_0", row + row // 32 * 4)):
            for path in (write("deepseek2"), write("deepseek2_mla")):
                r = sh([RUN, path, "-t", "0", "-n", "200", "-i", PROMPT, "--kv-type", kv_type, "-f", "json"])
                stats = [ln for ln in r.stderr.splitlines() if ln.startswith("stats:")]
                if r.returncode != 0 or not stats:
                    raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()[-300:]))
                out = json.loads(r.stdout.strip().splitlines()[0])
                prompt = len(json.loads(sh([RUN, path, "-m", "tokenize", "-f", "json", "-i", PROMPT]).stdout)["tokens"])
                positions = prompt + len(out["tokens"])
                blocks = (positions + 15) // 16
                mb = float(stats[0].split(" MB peak")[0].rsplit(" ", 1)[1])
                want = blocks * 16 * size * p["n_layers"] / 1e6
                print("    (%s: %.2f MB for %d positions: %.0f bytes a position, %d x %d layers)"
                      % (kv_type, mb, positions, mb * 1e6 / (blocks * 16), size, p["n_layers"]))
                if mb > want + 0.005 + 1e-9:
                    raise AssertionError("%s: %.2f MB peak, more than %.4f (%d bytes a position a layer)" % (kv_type, mb, want, size))

    @case("arch_deepseek2_missing_tensor_named")
    def _():
        for name, gone in (("deepseek2", "blk.1.attn_kv_a_norm.weight"), ("deepseek2", "blk.2.attn_kv_b.weight"),
                           ("deepseek2", "blk.0.ffn_gate.weight"), ("deepseek2", "blk.1.ffn_gate_shexp.weight"),
                           ("deepseek2_mla", "blk.2.attn_k_b.weight"), ("deepseek2_mla", "blk.1.attn_q_a_norm.weight"),
                           ("deepseek2_mla", "blk.0.attn_kv_a_mqa.weight"), ("deepseek2_mla", "blk.2.ffn_gate_inp.weight")):
            arch, kw = FILES[name]
            meta, tensors = arch_models.arch_model(arch, **kw)
            path = os.path.join(TMP, "deepseek2_without.gguf")
            write_gguf(path, meta, [x for x in tensors if x[0] != gone])
            r = sh([RUN, path, "-n", "4"])
            if r.returncode != 1 or gone not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
                raise AssertionError("without %s: exit %d: %s" % (gone, r.returncode, r.stderr.strip()))

    @case("arch_deepseek2_bad_shape_named")
    def _():
        arch, kw = FILES["deepseek2_mla"]
        meta, tensors = arch_models.arch_model(arch, **kw)
        bad = "blk.1.attn_v_b.weight"
        tensors = [(n, t, [64, 32, 2] if n == bad else ne, b[:64 * 32 * 2 * 4] if n == bad else b) for n, t, ne, b in tensors]
        path = os.path.join(TMP, "deepseek2_bad_shape.gguf")
        write_gguf(path, meta, tensors)
        r = sh([RUN, path, "-n", "4"])
        if r.returncode != 1 or bad not in r.stderr or "[64, 32, 2" not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()))

    @case("arch_gpt_oss_missing_tensor_named")
    def _():
        for gone in ("blk.1.attn_sinks.weight", "blk.2.ffn_up_exps.bias", "blk.0.ffn_gate_inp.bias", "blk.3.attn_output.bias",
                     "blk.1.post_attention_norm.weight"):
            meta, tensors = arch_models.arch_model("gpt-oss")
            path = os.path.join(TMP, "gpt_oss_without.gguf")
            write_gguf(path, meta, [x for x in tensors if x[0] != gone])
            r = sh([RUN, path, "-n", "4"])
            if r.returncode != 1 or gone not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
                raise AssertionError("without %s: exit %d: %s" % (gone, r.returncode, r.stderr.strip()))

    @case("arch_gpt_oss_keys_refused")
    def _():
        for key, value, named in (("gpt-oss.expert_count", None, "gpt-oss.expert_count"),
                                  ("gpt-oss.rope.scaling.yarn_log_multiplier", 0.1, "yarn_log_multiplier")):
            meta, tensors = arch_models.arch_model("gpt-oss")
            if value is None:
                meta.pop(key)
            else:
                meta[key] = value
            path = os.path.join(TMP, "gpt_oss_bad_key.gguf")
            write_gguf(path, meta, tensors)
            r = sh([RUN, path, "-n", "4"])
            if r.returncode != 1 or named not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
                raise AssertionError("%s %s: exit %d: %s" % (key, value, r.returncode, r.stderr.strip()))

    @case("arch_gpt_oss_bad_shape_named")
    def _():
        meta, tensors = arch_models.arch_model("gpt-oss")
        bad = "blk.2.ffn_down_exps.bias"
        tensors = [(n, t, [64, 4] if n == bad else ne, b[:64 * 4 * 4] if n == bad else b) for n, t, ne, b in tensors]
        path = os.path.join(TMP, "gpt_oss_bad_shape.gguf")
        write_gguf(path, meta, tensors)
        r = sh([RUN, path, "-n", "4"])
        if r.returncode != 1 or bad not in r.stderr or "[64, 4" not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()))

    # quantised by llama.cpp's own quantiser
    quantised = [(name, ftype) for name in ("qwen3", "gemma3", "phi3", "smollm3", "granite", "llama_key_length", "qwen3moe", "qwen2moe",
                                            "olmoe", "mixtral", "gpt_oss", "deepseek2",
                                            "deepseek2_mla") for ftype in ("Q8_0", "Q4_K_M")]
    quantised += [("qwen3", "IQ4_NL"), ("llama_256", "IQ4_NL"), ("llama_256", "IQ4_XS"), ("qwen3moe", "MXFP4_MOE"), ("mixtral", "MXFP4_MOE")]
    for name, ftype in quantised:
        @case("arch_%s_%s" % (name, ftype.lower()))
        def _(name=name, ftype=ftype):
            path = os.path.join(TMP, "%s.%s.gguf" % (name, ftype.lower()))
            if not os.path.exists(path):
                llamacpp.quantize(write(name), path, ftype)
            check_quantised(name, path, write(name))

    # the other drivers of the same forward pass on a windowed model and on
    # mixtures of experts (rows of several sequences routed in one step): a
    # prompt past the window, in one batch of rows (prefill), by --batch
    # and by the server's engine, give the same tokens as generate
    for name in ("gemma3", "qwen2moe", "mixtral", "gpt_oss", "deepseek2_mla"):
        @case("arch_%s_batch_same_tokens" % name)
        def _(name=name):
            path = write(name)
            if name not in runs:
                raise Skip("the float32 case did not run")
            _, gen, _ = runs[name]
            lines = "\n".join(json.dumps({"prompt": PROMPT, "id": i}) for i in range(3)) + "\n"
            r = subprocess.run([RUN, path, "-t", "0", "-n", "80", "--batch", "-", "-f", "json", "--parallel", "3"], input=lines,
                               capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise AssertionError(r.stderr.strip()[-300:])
            for line in r.stdout.strip().splitlines():
                got = json.loads(line)
                want = gen[:-1] if gen and gen[-1] in (EOS, BOS) and got.get("stop") in ("eos", "bos") else gen
                if got["tokens"][:len(want)] != want[:len(got["tokens"])]:
                    raise AssertionError("--batch request %s: %s, generate: %s" % (got.get("id"), got["tokens"][:12], want[:12]))

    # the windowed layers' pool (run.c section 4, "Windowed layers"): a
    # window of 16 and a generation of 200+ tokens past it, so that blocks
    # leave the windows and are taken again many times over; llama.cpp
    # agrees with generate, and --batch (rows of several sequences in one
    # step, a beam search among them), beam search and speculative decoding
    # give generate's tokens
    long_kw = dict(window=16, ctx=1024, seed=7)

    def long_file(neutralise=None):
        path = os.path.join(TMP, "gemma3_window16%s.gguf" % ("_no_" + neutralise if neutralise else ""))
        if not os.path.exists(path):
            write_gguf(path, *arch_models.arch_model("gemma3", neutralise=neutralise, **long_kw))
        return path

    long_runs = {}

    @case("arch_gemma3_window_past_it")
    def _():
        prompt, gen, score = generate(RUN, long_file(), 512, steps=LONG_STEPS)
        if len(gen) < 200:
            raise AssertionError("only %d tokens generated: the window is not passed often enough" % len(gen))
        why = disagreement(long_file(), prompt, gen, score, tolerance("gemma3"), 512)
        if why:
            raise AssertionError(why)
        control = disagreement(long_file("window"), prompt, gen, score, tolerance("gemma3"), 512)
        if control is None:
            raise AssertionError("llama.cpp cannot tell the file without its window apart: the check would not bite")
        print("    (%d tokens; without the window: %s)" % (len(gen), control))
        long_runs["gen"] = (prompt, gen)

    @case("arch_gemma3_window_drivers_same_tokens")
    def _():
        if "gen" not in long_runs:
            raise Skip("arch_gemma3_window_past_it did not pass")
        prompt, gen = long_runs["gen"]
        n = str(len(prompt) + LONG_STEPS)
        want = gen[:-1] if gen[-1] in (EOS, BOS) else gen
        for extra in (["--lookup", "2"], ["--draft", long_file()], ["--kv-type", "f32", "--kv-mb", "1"]):
            _, got, _ = generate(RUN, long_file(), 512, steps=LONG_STEPS, extra=extra)
            if got != gen:
                raise AssertionError("%s: %s..., generate: %s..." % (" ".join(extra), got[:12], gen[:12]))
        # beam search alone and in a batch with sampled rows of other lengths
        beam = sh([RUN, long_file(), "-b", "3", "-n", n, "--ctx-size", "512", "-i", PROMPT, "-f", "json"])
        if beam.returncode != 0:
            raise AssertionError(beam.stderr.strip()[-300:])
        beam = json.loads(beam.stdout.strip().splitlines()[0])
        # prompts of other lengths put rows of other positions, whose windows
        # start elsewhere, in one step
        prompts = [PROMPT + " e t a" * (15 * i) for i in range(4)]
        steps = [int(n)] + [400 - 30 * i for i in range(1, 4)]
        solo = []
        for i, text in enumerate(prompts):
            r = sh([RUN, long_file(), "-t", "0", "-n", str(steps[i]), "--ctx-size", "512", "-i", text, "-f", "json"])
            if r.returncode != 0:
                raise AssertionError(r.stderr.strip()[-300:])
            solo.append(json.loads(r.stdout.strip().splitlines()[0])["tokens"])
        if solo[0] != want:
            raise AssertionError("-n %s: %s, generate: %s" % (n, solo[0][:12], want[:12]))
        lines = [{"prompt": text, "id": i, "steps": steps[i]} for i, text in enumerate(prompts)]
        lines.append({"prompt": PROMPT, "id": "beam", "beams": 3, "steps": int(n)})
        # --kv-mb 2: main blocks to spare, windows for the 4 sequences only, so
        # that blocks left behind are taken again at once
        for flags, rows in ((["--parallel", "5"], lines), (["--parallel", "2"], lines), (["--parallel", "4", "--kv-mb", "2"], lines[:4])):
            r = subprocess.run([RUN, long_file(), "-t", "0", "--ctx-size", "512", "--batch", "-", "-f", "json"] + flags,
                               input="".join(json.dumps(x) + "\n" for x in rows), capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise AssertionError(r.stderr.strip()[-300:])
            for line in r.stdout.strip().splitlines():
                got = json.loads(line)
                if got["id"] == "beam":
                    if got.get("rank") == 1 and (got["tokens"], got["score"]) != (beam["tokens"], beam["score"]):
                        raise AssertionError("--batch beam search: %s, -b 3: %s" % (got["tokens"][:12], beam["tokens"][:12]))
                elif got["tokens"] != solo[got["id"]]:
                    raise AssertionError("--batch request %s: %s, alone: %s" % (got["id"], got["tokens"][:12], solo[got["id"]][:12]))

    # the memory: the windowed file keeps its global layer for every position
    # and the windowed ones for about a window, so a budget that cannot hold
    # every layer of every position holds it, while the copy without its
    # window (every layer global) is refused the same budget
    @case("arch_gemma3_window_cache_bytes")
    def _():
        args = ["-t", "0", "-n", "1000", "--min-new-tokens", "960", "-i", PROMPT, "-f", "json"]
        peaks = {}
        for label, path in (("window 16", long_file()), ("no window", long_file("window"))):
            r = sh([RUN, path] + args)
            if r.returncode != 0:
                raise AssertionError("%s: %s" % (label, r.stderr.strip()[-300:]))
            peaks[label] = float(re.search(r"kv f32 ([\d.]+) MB peak", r.stderr).group(1))
            if label == "window 16":
                tokens = json.loads(r.stdout.strip().splitlines()[0])["tokens"]
        small = sh([RUN, long_file(), "--kv-mb", "1"] + args)
        if small.returncode != 0 or json.loads(small.stdout.strip().splitlines()[0])["tokens"] != tokens:
            raise AssertionError("--kv-mb 1 with the window: exit %d, %s" % (small.returncode, small.stderr.strip()[-300:]))
        refused = sh([RUN, long_file("window"), "--kv-mb", "1"] + args)
        if refused.returncode != 2 or "too small" not in refused.stderr:
            raise AssertionError("--kv-mb 1 without the window: exit %d, %s" % (refused.returncode, refused.stderr.strip()[-300:]))
        # 6 layers, key/value rows of 64 floats: 3 KiB a position for all of
        # them, 512 B for the global one
        per_token = {k: v * 1e6 / 1000 for k, v in peaks.items()}
        print("    (1000 positions, peak: window 16 %.3f MB (%.0f B a position), no window %.3f MB (%.0f B))"
              % (peaks["window 16"], per_token["window 16"], peaks["no window"], per_token["no window"]))
        if not peaks["window 16"] * 3 < peaks["no window"]:
            raise AssertionError("the windowed file's peak %.3f MB is not a third of the other's %.3f MB" % (peaks["window 16"], peaks["no window"]))

    # the server's turns (run.c section 7, "Turns") on the windowed pool: a
    # long sampled request pauses for each short one that comes (its blocks
    # and its windows given back), resumes from the prefix index and its
    # window, and ends with the command line's text, as the short ones do
    @case("arch_gemma3_window_serve_turns")
    def _():
        import http.client
        import threading
        proc = subprocess.Popen([RUN, long_file(), "-m", "serve", "--port", "0", "--parallel", "1", "--ctx-size", "1024"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            port = None
            for line in proc.stderr:
                m = re.match(r"listening on http://[^:]+:(\d+)$", line.strip())
                if m:
                    port = int(m.group(1))
                    break
            if not port:
                raise AssertionError("the server did not start")
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()

            def ask(method, path, body=None):
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                c.request(method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"})
                return c.getresponse().read().decode()
            long_body = {"prompt": PROMPT, "max_tokens": 900, "min_new_tokens": 900, "temperature": 0.9, "seed": 5}
            answers = {}
            waiter = threading.Thread(target=lambda: answers.setdefault("long", json.loads(ask("POST", "/v1/completions", long_body))))
            waiter.start()
            shorts = []
            for i in range(5):
                shorts.append(json.loads(ask("POST", "/v1/completions", {"prompt": "q r", "max_tokens": 20, "temperature": 0})))
            waiter.join()
            paused = int(re.search(r"run_requests_paused_total (\d+)", ask("GET", "/metrics")).group(1))
        finally:
            proc.terminate()
            proc.wait(timeout=30)

        def cli(args):
            r = sh([RUN, long_file(), "--ctx-size", "1024", "-n", "0", "-f", "json"] + args)
            return json.loads(r.stdout.strip().splitlines()[0])["text"]
        want = cli(["-i", PROMPT, "--max-new-tokens", "900", "--min-new-tokens", "900", "-t", "0.9", "-s", "5"])
        short = cli(["-i", "q r", "--max-new-tokens", "20", "-t", "0"])
        if paused < 1:
            raise AssertionError("the long request never paused (the check would not bite)")
        if answers["long"]["choices"][0]["text"] != want:
            raise AssertionError("the long request differs from the command line after %d pauses" % paused)
        if any(s["choices"][0]["text"] != short for s in shorts):
            raise AssertionError("a short request differs from the command line")
        print("    (the long request paused %d times; its text and the short ones' the command line's)" % paused)

    @case("arch_gemma3_keep_refused")
    def _():
        r = sh([RUN, write("gemma3"), "--keep", "4", "-n", "8"])
        if r.returncode != 2 or "sliding-window" not in r.stderr:
            raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()))
        lines = json.dumps({"prompt": PROMPT, "keep": 4}) + "\n" + json.dumps({"prompt": PROMPT, "steps": 48}) + "\n"
        r = subprocess.run([RUN, write("gemma3"), "-t", "0", "--batch", "-", "--ordered"], input=lines, capture_output=True, text=True,
                           timeout=300)
        got = [json.loads(line) for line in r.stdout.strip().splitlines()]
        if len(got) != 2 or "keep" not in got[0].get("error", "") or "tokens" not in got[1]:
            raise AssertionError("--batch with a line's keep: %s" % r.stdout.strip()[-300:])

    @case("arch_unknown_named")
    def _():
        meta, tensors = arch_models.arch_model("llama")
        meta["general.architecture"] = "qwen3next"
        path = os.path.join(TMP, "qwen3next.gguf")
        write_gguf(path, meta, tensors)
        r = sh([RUN, path, "-n", "4"])
        if r.returncode != 1 or "'qwen3next'" not in r.stderr or "hybrid" not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()))

    @case("arch_bad_norm_shape_named")
    def _():
        meta, tensors = arch_models.arch_model("qwen3")
        tensors = [(n, t, [16] if n == "blk.1.attn_k_norm.weight" else ne, b[:64] if n == "blk.1.attn_k_norm.weight" else b)
                   for n, t, ne, b in tensors]
        path = os.path.join(TMP, "qwen3_bad_norm.gguf")
        write_gguf(path, meta, tensors)
        r = sh([RUN, path, "-n", "4"])
        if r.returncode != 1 or "blk.1.attn_k_norm.weight" not in r.stderr or "[16" not in r.stderr:
            raise AssertionError("exit %d: %s" % (r.returncode, r.stderr.strip()))

    return 0 if COUNTS["FAIL"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
