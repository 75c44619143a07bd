#!/usr/bin/env python3
"""The architectures beyond llama: run.c against today's llama.cpp on the
very same files (`make bench-arch`).

Shapes (random weights, seed 1, written by tests/arch_models.py with a
vocabulary of the model's size):
  qwen3   Qwen3-0.6B: dim 1024, 16 query heads of 128 (a query row of 2048
          beside the embedding's 1024), 8 key/value heads, FFN 3072, QK-norm,
          vocabulary 151936, tied; --layers of its 28 (default 8)
  gemma3  Gemma 3 1B: dim 1152, 4 heads of 256, 1 key/value head, FFN 6912,
          GELU, post-norms, a sliding window of 512 on 5 layers of 6,
          vocabulary 262144, tied; --layers of its 26 (default 6)
  qwen3moe Qwen3-30B-A3B: dim 2048, 32 query heads of 128, 4 key/value
          heads, 128 experts of 768 (top 8), vocabulary 151936, tied;
          --layers of its 48 (default 4)
  gptoss  gpt-oss-20b: dim 2880, 64 query heads of 64, 8 key/value heads,
          32 experts of 2880 (top 4) with biases, a router bias, sinks,
          q/k/v/o biases, a window of 128 on every second layer (0, 2,
          ..), YaRN factor 32 over 4096, rope base 150000, vocabulary
          201088, untied; --layers of its 24 (default 2)
  deepseek2 DeepSeek-V2-Lite: dim 2048, 16 heads, latent attention (kv
          rank 512, nope 128 + rope 64, v 128, no q rank; attn_k_b /
          attn_v_b as today's converter writes them), 64 experts of 1408
          (top 6, softmax, unnormalised) and 2 shared ones, layer 0 dense
          with FFN 10944, YaRN factor 40 over 4096 with log multiplier
          0.0707, vocabulary 102400, untied; --layers of its 27 (default 3;
          1 is the dense layer alone)
in the types of --types (qwen3, gemma3), --moe-types (qwen3moe, deepseek2)
and --oss-types (gptoss): F16, Q8_0, Q4_K and MXFP4 written here, the
quantised ones as random blocks (Q4_K files: a matrix whose rows are not a
multiple of 256 in Q5_0, llama.cpp's quantiser's fallback: deepseek2's
ffn_down_exps, ffn_down and attn_k_b / attn_v_b; MXFP4 files: the experts
in MXFP4 and every other matrix in Q8_0, as ggml-org's
gpt-oss-20b-mxfp4.gguf, whose 12.1 GB that mix accounts for); Q4_K_M made
from the F16 file by llama.cpp's own quantiser, llama_model_quantize
through tests/llamacpp.py. In interleaved rounds (medians),
for each file, the two programs in turn (which goes first alternates):
  run.c      tg128: generated tok/s of 128 tokens after a 16-token prompt;
             pp128: prompt tok/s of a 128-token prompt; for the mixtures
             (qwen3moe, gptoss, deepseek2) also
             pp512: prompt tok/s of a 512-token prompt; for gemma3 and
             deepseek2 also
             d4096: generated tok/s of 32 tokens after a 4096-token prompt
             (2 threads unless --threads says)
  llama.cpp  llama-bench -p 128 -n 128 -t 2 -r 1, for the mixtures -p 512
             -n 0 (its pp512), and for gemma3 and deepseek2 -p 0 -n 32
             -d 4096 (its tg32 at depth 4096)
then the ratios (each the median of the rounds' ratios), the bytes one token
reads (the layers' and the classifier's tensors as stored), and each
program's tg128 x those bytes as a fraction of the streaming-read probe
(bench/bandwidth.c).

LLAMA_CPP names a llama.cpp build directory holding bin/llama-bench and
bin/llama-quantize, built from the source that npm's node-llama-cpp@3.21.1
carries (bench/llamacpp.md says how). Environment / options: RUN (default
./runomp), PYTHON; --runs N, --threads N, --shapes, --types, --moe-types,
--oss-types, --layers,
--cache DIR (default build/bench/arch), --out FILE (default
bench/arch-results.md).
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from bench import machine, probe_bandwidth, prompt_tokens, stats_of, write_report  # noqa: E402
from gguf import llama_bench  # noqa: E402

# name: (arch, arch_models settings, default layers, vocabulary, tied)
SHAPES = {
    "qwen3": ("qwen3", dict(dim=1024, n_heads=16, n_kv_heads=8, head_dim=128, ffn=3072, theta=1e6, eps=1e-6), 8, 151936, True),
    "gemma3": ("gemma3", dict(dim=1152, n_heads=4, n_kv_heads=1, head_dim=256, ffn=6912, theta=1e6, eps=1e-6, window=512,
                              rope_scale=None, softcap=None, swa_base=None), 6, 262144, True),
    "qwen3moe": ("qwen3moe", dict(dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, ffn=6144, theta=1e6, eps=1e-6, n_expert=128,
                                  n_used=8, expert_ffn=768), 4, 151936, True),
    "gptoss": ("gpt-oss", dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn=2880, theta=150000.0, eps=1e-5, n_expert=32,
                               n_used=4, expert_ffn=2880, window=128, yarn_factor=32.0, orig_ctx=4096), 2, 201088, False),
    "deepseek2": ("deepseek2", dict(dim=2048, n_heads=16, n_kv_heads=16, head_dim=None, ffn=10944, theta=1e4, eps=1e-6,
                                    n_expert=64, n_used=6, expert_ffn=1408, expert_weights_scale=1.0, n_rot=64, kv_rank=512,
                                    nope=128, v_head=128, q_rank=0, generation="k_b", leading=1, n_shared=2,
                                    weights_norm=False, gating=1, yarn_factor=40.0, orig_ctx=4096, yarn_log_mul=0.0707),
                  3, 102400, False),
}
WRITTEN = ["F16", "Q8_0", "Q4_K", "MXFP4"]  # written here, quantised blocks straight from random bits (too large as floats)
QUANTIZED = ["Q4_K_M"]  # made from the F16 file by llama.cpp's own quantiser (tests/llamacpp.py)
DEPTH = 4096
DEEP = ("gemma3", "deepseek2")  # the shapes also measured at depth DEPTH: a windowed cache, a latent one
LONG = 512
MIXTURES = ("qwen3moe", "gptoss", "deepseek2")  # the shapes also measured with a LONG-token prompt (experts shared by more rows)
# each shape's option and the types it takes
TYPE_OPTION = {"qwen3": "types", "gemma3": "types", "qwen3moe": "moe_types", "deepseek2": "moe_types", "gptoss": "oss_types"}
TYPE_CHOICES = {"types": WRITTEN[:3] + QUANTIZED, "moe_types": ["Q8_0", "Q4_K"], "oss_types": ["MXFP4", "Q8_0"]}


def big_vocab(meta, n):
    """meta's small SentencePiece vocabulary grown to n tokens (the model's
    own size, so that the classifier reads what the real one reads)."""
    from gguf_ref import ARRAY, FLOAT32, INT32, STRING, Typed
    tokens = list(meta["tokenizer.ggml.tokens"].value)
    scores = list(meta["tokenizer.ggml.scores"].value)
    types = list(meta["tokenizer.ggml.token_type"].value)
    extra = n - len(tokens)
    tokens += ["<unused%d>" % i for i in range(extra)]
    scores += [-1e4] * extra
    types += [1] * extra
    meta["tokenizer.ggml.tokens"] = Typed(ARRAY, tokens, STRING)
    meta["tokenizer.ggml.scores"] = Typed(ARRAY, scores, FLOAT32)
    meta["tokenizer.ggml.token_type"] = Typed(ARRAY, types, INT32)


def file_types(shape, wtype):
    """(the matrices' type, arch_model's overrides) of shape's wtype file:
    MXFP4 is the experts' alone (the rest Q8_0); in a Q4_K file a matrix
    whose rows are not a multiple of 256 is Q5_0, as llama.cpp's quantiser
    makes it (deepseek2's attn_kv_b override is attn_k_b's and attn_v_b's)."""
    if wtype == "MXFP4":
        return "Q8_0", {n: "MXFP4" for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}
    if wtype == "Q4_K" and shape == "deepseek2":
        return wtype, {n: "Q5_0" for n in ("ffn_down_exps.weight", "ffn_down.weight", "attn_kv_b.weight")}
    return wtype, None


def write_model(path, shape, wtype, layers):
    import arch_models
    from gguf_ref import write_gguf
    arch, settings, _, vocab, tied = SHAPES[shape]
    wtype, types = file_types(shape, wtype)
    meta, tensors = arch_models.arch_model(arch, wtype=wtype, vocab=900, seed=1, tied=tied, ctx=2 * DEPTH, n_layers=layers,
                                           types=types, **settings)
    # the token embedding and the classifier at the model's vocabulary
    tensors = [t for t in tensors if t[0] not in ("token_embd.weight", "output.weight")]
    import numpy as np
    from gguf_ref import random_tensor
    rng = np.random.default_rng(2)
    dim = settings["dim"]
    tensors.append(("token_embd.weight", wtype, [dim, vocab], random_tensor(wtype, vocab * dim, rng, 1.0 / np.sqrt(dim))))
    if not tied:  # as arch_model's: logits of std OUT_GAIN
        tensors.append(("output.weight", wtype, [dim, vocab], random_tensor(wtype, vocab * dim, rng,
                                                                            arch_models.OUT_GAIN / np.sqrt(dim))))
    big_vocab(meta, vocab)
    write_gguf(path, meta, tensors)


def make_files(cache, shape, types, layers):
    import llamacpp
    os.makedirs(cache, exist_ok=True)
    paths = {}
    for t in WRITTEN:
        path = os.path.join(cache, "%s-%dL.%s.gguf" % (shape, layers, t))
        if (t in types or (t == "F16" and set(types) & set(QUANTIZED))) and not os.path.exists(path):
            print("bench: writing %s" % path, file=sys.stderr)
            write_model(path, shape, t, layers)
        paths[t] = path
    for t in QUANTIZED:
        path = os.path.join(cache, "%s-%dL.%s.gguf" % (shape, layers, t))
        if t in types and not os.path.exists(path):
            print("bench: quantizing %s" % path, file=sys.stderr)
            llamacpp.ensure_oracle()
            llamacpp.quantize(paths["F16"], path, t, nthread=2)
        paths[t] = path
    return {t: paths[t] for t in types if t in paths}


def bytes_per_token(path, shape):
    """The bytes one token reads: every matrix but the token embedding (of
    which it reads one row) or the embedding itself when it is the
    classifier too; of the experts' tensors (the 3-D matrices, gpt-oss's
    2-D bias rows), the share of the experts a row takes (n_used of
    n_expert; every layer's router picks its own); shared experts and dense
    layers in full. Read in a child process, as bench/gguf.py does."""
    used = SHAPES[shape][1].get("n_used", 1) / SHAPES[shape][1].get("n_expert", 1)
    code = ("import sys; sys.path.insert(0, %r); from gguf_ref import read_gguf; g = read_gguf(%r); "
            "s = {n: len(r) * (%r if len(ne) == 3 or '_exps.' in n else 1) for n, (t, ne, r) in g.tensors.items() "
            "if len(ne) >= 2}; "
            "print(int(sum(b for n, b in s.items() if n != 'token_embd.weight' or 'output.weight' not in s)))") % (
                os.path.join(ROOT, "tests"), path, used)
    return int(subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE).stdout)


def make_prompt(runbin, path, n):
    """A prompt of n tokens (BOS included) in these files' vocabulary, where
    each letter without a space is a token of its own."""
    text = ("etaoinshrdlcumwfgypbvkjxqz" * (n // 26 + 1))[:n - 1]
    if prompt_tokens(runbin, path, path, text) != n:
        sys.exit("bench: cannot make a prompt of %d tokens" % n)
    return text


def llama_ts(binary, path, threads, *flags):
    """llama-bench's tok/s (avg_ts) of one test (-r 1) that flags name."""
    import csv
    import io
    out = subprocess.run([binary, "-m", path, *flags, "-t", str(threads), "-r", "1", "-o", "csv"],
                         check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()
    return float(next(csv.DictReader(io.StringIO(out)))["avg_ts"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--types", default="F16,Q8_0,Q4_K_M", help="dense shapes' types (default F16,Q8_0,Q4_K_M)")
    ap.add_argument("--moe-types", default="Q8_0,Q4_K", help="qwen3moe's and deepseek2's types (default Q8_0,Q4_K)")
    ap.add_argument("--oss-types", default="MXFP4", help="gptoss's types: MXFP4 (the experts; the rest Q8_0), Q8_0 "
                    "(default MXFP4)")
    ap.add_argument("--layers", type=int, help="layers of each shape (default: qwen3 8, gemma3 6, qwen3moe 4, gptoss 2, "
                    "deepseek2 3)")
    ap.add_argument("--cache", default=os.path.join(ROOT, "build", "bench", "arch"))
    ap.add_argument("--bandwidth", default=os.path.join(ROOT, "build", "bench", "bandwidth"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "arch-results.md"))
    args = ap.parse_args()
    runbin = os.environ.get("RUN", "./runomp")
    llama = os.environ.get("LLAMA_CPP")
    lbench = llama and os.path.join(llama, "bin", "llama-bench")
    if not lbench or not os.path.exists(lbench):
        sys.exit("bench: LLAMA_CPP must name a llama.cpp build with bin/llama-bench (bench/llamacpp.md)")
    shapes = args.shapes.split(",")
    chosen = {o: getattr(args, o).split(",") for o in TYPE_CHOICES}
    if set(shapes) - set(SHAPES) or any(set(chosen[o]) - set(c) for o, c in TYPE_CHOICES.items()):
        sys.exit("bench: --shapes of %s, %s" % (", ".join(SHAPES), ", ".join(
            "--%s of %s" % (o.replace("_", "-"), ", ".join(c)) for o, c in TYPE_CHOICES.items())))
    files = {}
    for shape in shapes:
        layers = args.layers or SHAPES[shape][2]
        for t, path in make_files(args.cache, shape, chosen[TYPE_OPTION[shape]], layers).items():
            files[(shape, t)] = path
    prompts = {}
    for shape in shapes:
        smallest = min((p for (s, _), p in files.items() if s == shape), key=os.path.getsize)
        lengths = (16, 128) + ((LONG,) if shape in MIXTURES else ()) + ((DEPTH,) if shape in DEEP else ())
        prompts[shape] = {n: make_prompt(runbin, smallest, n) for n in lengths}
    per_token = {k: bytes_per_token(p, k[0]) for k, p in files.items()}
    runs = {k: {"tg": [], "pp": [], "ltg": [], "lpp": [], "long": [], "llong": [], "d": [], "ld": []} for k in files}
    probes = []

    def run_c(k, path):
        base = [runbin, path, "-t", "0", "-T", str(args.threads)]
        p = prompts[k[0]]
        (_, _, _, tg), _ = stats_of(base + ["-n", "144", "-i", p[16]])
        (_, pp, _, _), _ = stats_of(base + ["-n", "129", "-i", p[128]])
        runs[k]["tg"].append(tg)
        runs[k]["pp"].append(pp)
        if LONG in p:
            (_, pp, _, _), _ = stats_of(base + ["-n", str(LONG + 1), "-i", p[LONG]])
            runs[k]["long"].append(pp)
        if DEPTH in p:
            (_, _, _, d), _ = stats_of(base + ["-n", str(DEPTH + 32), "-i", p[DEPTH]])
            runs[k]["d"].append(d)

    def llama_cpp(k, path):
        lpp, ltg = llama_bench(lbench, path, args.threads)
        runs[k]["lpp"].append(lpp)
        runs[k]["ltg"].append(ltg)
        if k[0] in MIXTURES:
            runs[k]["llong"].append(llama_ts(lbench, path, args.threads, "-p", str(LONG), "-n", "0"))
        if k[0] in DEEP:
            runs[k]["ld"].append(llama_ts(lbench, path, args.threads, "-p", "0", "-n", "32", "-d", str(DEPTH)))

    for r in range(args.runs):
        for k, path in files.items():
            for side in ((run_c, llama_cpp) if r % 2 == 0 else (llama_cpp, run_c)):
                side(k, path)
        probes.append(probe_bandwidth(args.bandwidth, "1024", str(args.threads))[args.threads])
        print("bench: round %d of %d done" % (r + 1, args.runs), file=sys.stderr)
    bw = statistics.median(probes)
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    paired = lambda a, b: med([x / y for x, y in zip(a, b)]) if a and b else float("nan")  # noqa: E731
    rows = []
    for k, path in files.items():
        x = runs[k]
        tg, ltg = med(x["tg"]), med(x["ltg"])
        rows.append("| %s | %s | %.0f | %.0f | %.1f | %.1f | %.2fx | %.0f%% | %.0f%% | %.1f | %.1f | %.2fx | %s | %s |" % (
            k[0], k[1], os.path.getsize(path) / 1e6, per_token[k] / 1e6, tg, ltg, paired(x["tg"], x["ltg"]),
            100 * tg * per_token[k] / 1e9 / bw, 100 * ltg * per_token[k] / 1e9 / bw, med(x["pp"]), med(x["lpp"]),
            paired(x["pp"], x["lpp"]),
            "%.1f / %.1f = %.2fx" % (med(x["long"]), med(x["llong"]), paired(x["long"], x["llong"])) if x["long"] else "-",
            "%.1f / %.1f = %.2fx" % (med(x["d"]), med(x["ld"]), paired(x["d"], x["ld"])) if x["d"] else "-"))
    lines = [
        "# New architectures: run.c and llama.cpp on the same files",
        "",
        "%s; %s; `%s` and llama-bench (%s), medians of %d interleaved rounds (a ratio is the median of the rounds' "
        "ratios), %d threads, greedy. Streaming-read probe: %.1f GB/s (bench/bandwidth.c, %d threads)." % (
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), machine(), runbin, llama, args.runs, args.threads, bw,
            args.threads),
        "",
        "Random weights, seed 1: qwen3 = Qwen3-0.6B's layer shape (dim 1024, 16 x 128 query heads, 8 key/value heads, "
        "FFN 3072, vocabulary 151936, tied), gemma3 = Gemma 3 1B's (dim 1152, 4 x 256 query heads, 1 key/value head, "
        "FFN 6912, window 512 on 5 layers of 6, vocabulary 262144, tied), qwen3moe = Qwen3-30B-A3B's (dim 2048, 32 x 128 "
        "query heads, 4 key/value heads, 128 experts of 768, top 8, vocabulary 151936, tied), gptoss = gpt-oss-20b's (dim "
        "2880, 64 x 64 query heads, 8 key/value heads, 32 experts of 2880, top 4, biases, sinks, window 128 on every second "
        "layer, YaRN 32, vocabulary 201088, untied; an MXFP4 file's other matrices Q8_0), deepseek2 = DeepSeek-V2-Lite's "
        "(dim 2048, 16 heads of latent attention, kv rank 512, nope 128 + rope 64, v 128, 64 experts of 1408, top 6, 2 "
        "shared, layer 0 dense with FFN 10944, YaRN 40, vocabulary 102400, untied; in a Q4_K file the matrices of rows not "
        "a multiple of 256 Q5_0); layers as the file names say. "
        "Bytes per token: every matrix once (for the mixtures: the attention, the router, the chosen experts of each layer, "
        "the shared experts and dense layers in full, and the classifier).",
        "",
        "| shape | type | file MB | bytes/token MB | tg128 run.c | tg128 llama.cpp | tg ratio | probe run.c | probe llama.cpp "
        "| pp128 run.c | pp128 llama.cpp | pp ratio | pp%d run.c / llama.cpp | depth %d tg32 run.c / llama.cpp |" % (LONG, DEPTH),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ] + rows
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
