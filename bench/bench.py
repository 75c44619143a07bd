#!/usr/bin/env python3
"""Benchmark of run.c: decode and prefill speed against the machine's memory
bandwidth (`make bench` runs it).

Decoding one token reads every weight once, so tokens/s x weight bytes per
token ("effective GB/s") is compared with a streaming read of a large buffer
(bench/bandwidth.c). For random checkpoints shaped like stories15M and
stories110M, in float32 and int8 (stories110M also in 4-bit, version 3),
with 1 and 2 threads, it measures (medians of --runs runs, greedy):
  decode   tok/s generating 128 tokens after a 16-token prompt
  prefill  tok/s reading a 128-token prompt
  peak RSS of the process, against checkpoint + key/value cache + 10%
and, with 2 threads, the time of a beam search step with 4 and 8 beams
relative to a greedy step (same 16-token prompt, 64 steps), and stories110M's
greedy decode under --json (the JSON mask each step) against plain greedy
decode (2 threads; the issue asks for at least 0.9x), and the same for tool
calls: 8 chat requests (--batch, one at a time, greedy) with a weather tool
and a calculator tool and tool_choice "required", their replies constrained
to the calls' schema, against the same requests with tool_choice "none"
cut at as many tokens as each call took (unconstrained, same prompts and
positions). bench/peak.c
measures the machine's peak float32 multiply-add rate and the matmul
kernels' rate on 64 rows; float32 prefill is reported as a fraction of it.
bench/batch.py adds the batching benchmark and bench/serve.py the serving one
(-m serve with 1, 4 and 16 clients at once).
The table goes to stdout and to bench/results.md.

Environment / options: RUN (binary, default ./runomp), MODELS_DIR (for
tokenizer.bin), PYTHON; --runs N, --cache DIR (checkpoints, default
build/bench), --bandwidth BIN (the compiled probe), --peak BIN (the
compiled bench/peak.c), --out FILE.
"""
import argparse
import json
import datetime
import os
import re
import statistics
import struct
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from batch import batch_bench  # noqa: E402
from speculative import speculative_bench  # noqa: E402
from serve import serve_bench  # noqa: E402

# A story to cut prompts from; the prompt of N tokens is its longest prefix of
# whole words with at most N tokens (BOS included), padded with " a".
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tall tree. She wanted to play with it, but it was stuck "
    "between two branches. Lily asked her friend Tom to help her. Tom was a kind boy who liked to climb trees. "
    "He climbed up the tree and reached for the ball, but the branch was too thin and it started to bend. "
    "Lily was scared and shouted, \"Tom, come down! It is not safe!\" Tom listened to Lily and climbed down "
    "carefully. Then they had an idea. They found a long stick near the pond and used it to push the ball. "
    "The ball fell down and bounced on the soft grass. Lily and Tom laughed and clapped their hands. They "
    "played with the ball all afternoon, kicking it and throwing it high in the sky. When the sun began to set, "
    "their moms called them home for dinner. Lily hugged Tom and said, \"Thank you for helping me today. You "
    "are my best friend.\" Tom smiled and said, \"We can play again tomorrow.\" That night, Lily dreamed of "
    "red balls, tall trees and sunny days in the park."
)

MODELS = [  # label, export.py shape, version
    ("stories15M f32", "stories15M", 1),
    ("stories15M int8", "stories15M", 2),
    ("stories110M f32", "stories110M", 1),
    ("stories110M int8", "stories110M", 2),
    ("stories110M 4-bit", "stories110M", 3),
]

STATS_RE = re.compile(r"stats: prompt (\d+) tokens, \d+ reused, ([\d.]+) tok/s; generated (\d+) tokens, ([\d.]+) tok/s")


def stats_of(cmd):
    """Runs cmd (stdout discarded); returns the parsed stats line and the
    process's peak RSS in bytes."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = p.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit("bench: %s failed (%d): %s" % (" ".join(cmd), p.returncode, err.strip()[-300:]))
    m = None
    for m in STATS_RE.finditer(err):
        pass
    if not m:
        sys.exit("bench: no stats line from %s: %s" % (" ".join(cmd), err.strip()[-300:]))
    return (int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(4))), usage.ru_maxrss * 1024


def read_header(path):
    """(dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared, group_size) of an ak42 file."""
    with open(path, "rb") as f:
        h = f.read(41)
    magic, version = struct.unpack_from("<Ii", h, 0)
    if magic != 0x616B3432:
        sys.exit("bench: %s is not an ak42 checkpoint" % path)
    dims = struct.unpack_from("<7i", h, 8)
    gs = struct.unpack_from("<i", h, 37)[0] if version in (2, 3) else 0
    return dims + (h[36] != 0, gs, version)


def weight_bytes_per_token(path):
    """Bytes of the matrices read for one token: every layer matrix and the
    classifier (an int8 value costs 1 byte plus 4 / group_size of scale, a
    4-bit value half a byte plus the same)."""
    dim, hidden, layers, heads, kv_heads, vocab, seq, shared, gs, version = read_header(path)
    kv_dim = dim // heads * kv_heads
    values = layers * (2 * dim * dim + 2 * kv_dim * dim + 3 * dim * hidden) + vocab * dim
    return values * ((0.5 if version == 3 else 1) + 4 / gs if gs else 4)


def kv_cache_bytes(path):
    dim, hidden, layers, heads, kv_heads, vocab, seq, shared, gs, _version = read_header(path)
    return 2 * layers * seq * (dim // heads * kv_heads) * 4


def make_models(python, cache):
    os.makedirs(cache, exist_ok=True)
    paths = {}
    for label, shape, version in MODELS:
        path = os.path.join(cache, "%s_v%d.bin" % (shape, version))
        if not os.path.exists(path):
            print("bench: writing %s" % path, file=sys.stderr)
            subprocess.run([python, os.path.join(ROOT, "export.py"), "random", path, "--shape", shape,
                            "--seed", "1", "--version", str(version)], check=True, stdout=subprocess.DEVNULL)
        paths[label] = path
    return paths


def prompt_tokens(runbin, model, tok, text):
    """Tokens (BOS included) of text, as run.c counts them in its stats line
    (-m tokenize: the same encoding, without running the model)."""
    out = subprocess.run([runbin, model, "-z", tok, "-m", "tokenize", "-f", "json", "-i", text], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
    return len(json.loads(out)["tokens"])


def make_prompt(runbin, model, tok, n):
    words = STORY.split(" ")
    lo, hi = 0, len(words)  # largest prefix of words with <= n tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt_tokens(runbin, model, tok, " ".join(words[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    while prompt_tokens(runbin, model, tok, text) < n:
        text += " a"
    if prompt_tokens(runbin, model, tok, text) != n:
        sys.exit("bench: cannot make a prompt of %d tokens" % n)
    return text


# Tool calls: two tools shaped like tests/test_serve_tools.py's, and questions
# whose greedy calls the bench times (a call schema: anyOf of objects, each
# with a const name).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Adds a and b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                        "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
QUESTIONS = ["What is the weather in Paris, and what is 2 plus 3?", "Is it raining in Rome?", "Add 40 and 2.",
             "How warm is Oslo today?", "What is 7 plus 8?", "Weather in Lima, in fahrenheit?", "Sum 12 and 30 for me.",
             "Is Tokyo cold now?"]


def write_lines(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


def tool_call_files(runbin, model, tok, cache, name):
    """Two --batch files for model: the questions with the tools and
    tool_choice "required" (greedy), and the same with tool_choice "none",
    each cut at the tokens its call took (found by running the first once),
    so both decode as many tokens from the same positions. Returns their
    paths and the tokens of all the calls."""
    asked = [{"messages": [{"role": "user", "content": q}], "tools": TOOLS, "temperature": 0} for q in QUESTIONS]
    calls, free = os.path.join(cache, "%s_tool_calls.jsonl" % name), os.path.join(cache, "%s_tool_free.jsonl" % name)
    write_lines(calls, [dict(a, tool_choice="required") for a in asked])
    out = subprocess.run([runbin, model, "-z", tok, "-T", "2", "--batch", calls, "--parallel", "1", "-n", "0"], check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
    replies = [json.loads(line) for line in out.decode().splitlines()]
    if len(replies) != len(asked) or any(r.get("finish_reason") != "tool_calls" for r in replies):
        sys.exit("bench: %s: the tool-call requests did not all answer with calls" % model)
    counts = [len(replies[i]["tokens"]) for i in range(len(asked))]
    write_lines(free, [dict(a, tool_choice="none", max_new_tokens=n) for a, n in zip(asked, counts)])
    st, _ = stats_of([runbin, model, "-z", tok, "-T", "2", "--batch", free, "--parallel", "1", "-n", "0"])
    if st[2] != sum(counts):
        sys.exit("bench: %s: the unconstrained replies made %d tokens, not the calls' %d" % (model, st[2], sum(counts)))
    return calls, free, sum(counts)


def probe_bandwidth(binary, *args):
    """{threads: GB/s}; args: bandwidth.c's [MiB] [threads...] (default 1 and 2 threads)."""
    out = subprocess.run([binary, *args], check=True, stdout=subprocess.PIPE).stdout.decode()
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"threads (\d+): ([\d.]+) GB/s", out)}


def measure(jobs, runs, probe):
    """jobs: {key: (command, index of the stats field)}. Runs every command
    and the bandwidth probe `runs` times, round-robin, so that a slow spell
    of the machine (other processes, or other virtual machines using the
    memory) affects all of them alike. Returns {key: (median of the field,
    peak RSS)} and {threads: median GB/s of the probe}."""
    values = {key: [] for key in jobs}
    rss = dict.fromkeys(jobs, 0)
    probes = {}
    for i in range(runs):
        for key, (cmd, field) in jobs.items():
            st, peak = stats_of(cmd)
            values[key].append(st[field])
            rss[key] = max(rss[key], peak)
        for threads, gbs in probe_bandwidth(probe).items():
            probes.setdefault(threads, []).append(gbs)
        print("bench: round %d of %d done" % (i + 1, runs), file=sys.stderr)
    return ({key: (statistics.median(values[key]), rss[key]) for key in jobs},
            {threads: statistics.median(v) for threads, v in probes.items()})


def probe_peak(binary):
    """{threads: (peak GFLOP/s, f32 matmul GFLOP/s, int8 matmul GOP/s)}"""
    out = subprocess.run([binary], check=True, stdout=subprocess.PIPE).stdout.decode()
    pat = r"threads (\d+): peak ([\d.]+) GFLOP/s, f32 ([\d.]+) GFLOP/s, int8 ([\d.]+) GOP/s"
    return {int(m.group(1)): tuple(float(m.group(k)) for k in (2, 3, 4)) for m in re.finditer(pat, out)}


def flops_per_token(path):
    """Multiply-adds x 2 of the layer matrices for one prompt token (the
    classifier runs for the last token only; attention is left out)."""
    dim, hidden, layers, heads, kv_heads, vocab, seq, shared, gs, _version = read_header(path)
    kv_dim = dim // heads * kv_heads
    return 2 * layers * (2 * dim * dim + 2 * kv_dim * dim + 3 * dim * hidden)


def machine():
    name, cores = "unknown", str(os.cpu_count())
    try:
        out = subprocess.run(["lscpu"], stdout=subprocess.PIPE, check=True).stdout.decode()
        for line in out.splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "Model name":
                name = val.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "%s, %s cores" % (name, cores)


def write_report(lines, out):
    """The table's lines to stdout and to the file out."""
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    with open(out, "w") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cache", default=os.path.join(ROOT, "build", "bench"))
    ap.add_argument("--bandwidth", default=os.path.join(ROOT, "build", "bench", "bandwidth"))
    ap.add_argument("--peak", default=os.path.join(ROOT, "build", "bench", "peak"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.md"))
    args = ap.parse_args()
    runbin = os.environ.get("RUN", "./runomp")
    tok = os.path.join(os.environ.get("MODELS_DIR", "../shared/models"), "tokenizer.bin")
    python = os.environ.get("PYTHON", sys.executable)
    if not os.path.exists(tok):
        sys.exit("bench: %s not found (set MODELS_DIR)" % tok)

    paths = make_models(python, args.cache)
    first = paths[MODELS[0][0]]
    p16, p128 = make_prompt(runbin, first, tok, 16), make_prompt(runbin, first, tok, 128)
    p256 = make_prompt(runbin, first, tok, 256)

    jobs = {}
    for label, _, _ in MODELS:
        for threads in (1, 2):
            base = [runbin, paths[label], "-z", tok, "-t", "0", "-T", str(threads)]
            jobs[(label, threads, "decode")] = (base + ["-n", "143", "-i", p16], 3)
            jobs[(label, threads, "prefill")] = (base + ["-n", "129", "-i", p128], 1)
    # beam search: a step with B beams against a greedy step (64 of each)
    for label in ("stories110M f32", "stories110M int8"):
        base = [runbin, paths[label], "-z", tok, "-t", "0", "-T", "2", "-n", "80", "-i", p16]
        jobs[(label, 1, "beam")] = (base, 3)
        for beams in (4, 8):
            jobs[(label, beams, "beam")] = (base + ["-b", str(beams), "-e", "never"], 3)
    # constrained decoding: the same decode as above under --json
    for label in ("stories110M f32", "stories110M int8"):
        jobs[(label, 2, "json")] = ([runbin, paths[label], "-z", tok, "-t", "0", "-T", "2", "-n", "143", "-i", p16, "--json"], 3)
    # constrained tool calls: the calls' decode against as many free tokens
    call_tokens = {}
    for label in ("stories110M f32", "stories110M int8"):
        calls, free, call_tokens[label] = tool_call_files(runbin, paths[label], tok, args.cache, label.split()[1])
        for key, path in (("tools", calls), ("tools free", free)):
            jobs[(label, 2, key)] = ([runbin, paths[label], "-z", tok, "-T", "2", "--batch", path, "--parallel", "1", "-n", "0"], 3)
    got, bw = measure(jobs, args.runs, args.bandwidth)
    peak = probe_peak(args.peak)
    batch_lines, batch_checks = batch_bench(runbin, paths["stories110M f32"], tok, p16, p256, args.cache, args.runs)
    spec_lines, spec_checks = speculative_bench(runbin, paths["stories110M f32"], paths["stories110M int8"], tok, args.runs)
    batch_lines, batch_checks = batch_lines + [""] + spec_lines, batch_checks + spec_checks
    p64 = make_prompt(runbin, first, tok, 64)
    serve_lines, serve_checks = serve_bench(runbin, paths["stories110M f32"], tok, (p16, p64, p128), args.runs)

    rows, results = [], {}
    for label, _, _ in MODELS:
        path = paths[label]
        wbytes = weight_bytes_per_token(path)
        budget = (os.path.getsize(path) + kv_cache_bytes(path)) * 1.1
        for threads in (1, 2):
            (decode, rss1), (prefill, rss2) = got[(label, threads, "decode")], got[(label, threads, "prefill")]
            gbs = wbytes * decode / 1e9
            rss = max(rss1, rss2)
            results[(label, threads)] = (decode, prefill, rss, budget)
            rows.append("| %s | %d | %.0f | %.1f | %.1f | %.1fx | %.1f | %.0f%% | %.0f | %.0f |" % (
                label, threads, wbytes / 1e6, decode, prefill, prefill / decode, gbs, 100 * gbs / bw[threads],
                rss / 1e6, budget / 1e6))
    beam_rows = []
    for label in ("stories110M f32", "stories110M int8"):
        greedy = got[(label, 1, "beam")][0]
        beam_rows.append("| %s | %.1f | %.2fx | %.2fx |" % (
            label, greedy, greedy / got[(label, 4, "beam")][0], greedy / got[(label, 8, "beam")][0]))

    constrained_rows = []
    for label in ("stories110M f32", "stories110M int8"):
        plain, js = got[(label, 2, "decode")][0], got[(label, 2, "json")][0]
        calls, free = got[(label, 2, "tools")][0], got[(label, 2, "tools free")][0]
        constrained_rows.append("| %s | %.1f | %.1f | %.2fx | %d | %.1f | %.1f | %.2fx |" % (
            label, plain, js, js / plain, call_tokens[label], calls, free, calls / free))

    f32, q8, q4 = results[("stories110M f32", 2)], results[("stories110M int8", 2)], results[("stories110M 4-bit", 2)]
    s15 = (results[("stories15M f32", 1)], results[("stories15M f32", 2)])
    s15q = (results[("stories15M int8", 1)], results[("stories15M int8", 2)])
    eff = weight_bytes_per_token(paths["stories110M f32"]) * f32[0] / 1e9 / bw[2]
    big = [r for (label, _), r in results.items() if label.startswith("stories110M")]
    prefill_peak = f32[1] * flops_per_token(paths["stories110M f32"]) / 1e9 / peak[2][0]
    checks = [
        ("float32 decode >= 85% of the 2-thread read bandwidth", eff >= 0.85, "%.0f%%" % (100 * eff)),
        ("int8 decode >= 3x float32 decode", q8[0] >= 3 * f32[0], "%.2fx" % (q8[0] / f32[0])),
        ("version 3 (4-bit) decode >= 1.6x int8 decode", q4[0] >= 1.6 * q8[0], "%.2fx" % (q4[0] / q8[0])),
        ("prefill (128 tokens) >= 8x decode, float32", f32[1] >= 8 * f32[0], "%.1fx" % (f32[1] / f32[0])),
        ("peak RSS <= checkpoint + KV cache + 10%, stories110M", all(r[2] <= r[3] for r in big),
         "at most %.0f%% of the budget" % max(100 * r[2] / r[3] for r in big)),
        ("--json greedy decode >= 0.9x plain greedy decode, stories110M (2 threads)",
         all(got[(label, 2, "json")][0] >= 0.9 * got[(label, 2, "decode")][0] for label in ("stories110M f32", "stories110M int8")),
         ", ".join("%s %.2fx" % (label.split()[1], got[(label, 2, "json")][0] / got[(label, 2, "decode")][0])
                   for label in ("stories110M f32", "stories110M int8"))),
        ("tool calls (tool_choice required) decode >= 0.9x unconstrained decode, stories110M (2 threads)",
         all(got[(label, 2, "tools")][0] >= 0.9 * got[(label, 2, "tools free")][0] for label in ("stories110M f32", "stories110M int8")),
         ", ".join("%s %.2fx" % (label.split()[1], got[(label, 2, "tools")][0] / got[(label, 2, "tools free")][0])
                   for label in ("stories110M f32", "stories110M int8"))),
        ("stories15M no slower with 2 threads than 1", s15[1][0] >= s15[0][0] and s15q[1][0] >= s15q[0][0],
         "f32 %.0f vs %.0f, int8 %.0f vs %.0f tok/s" % (s15[1][0], s15[0][0], s15q[1][0], s15q[0][0])),
    ]

    lines = [
        "# run.c benchmark",
        "",
        "%s; %s; `%s`, medians of %d runs, greedy." % (
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), machine(), runbin, args.runs),
        "",
        "Streaming read bandwidth (bench/bandwidth.c, median of one probe per round): %s." % ", ".join(
            "%.1f GB/s with %d thread%s" % (v, k, "s" if k > 1 else "") for k, v in sorted(bw.items())),
        "Random checkpoints (export.py random, seed 1): float32 = version 1, int8 = version 2 (Q8_0), "
        "4-bit = version 3 (group size 32).",
        "Decode: 128 tokens after a 16-token prompt. Prefill: a 128-token prompt.",
        "Effective GB/s = weight bytes read per token x decode tok/s; % of the probe with as many threads.",
        "Peak float32 multiply-add rate (bench/peak.c, FMA loop): %s; matmul kernels on 64 rows of a "
        "stories110M layer: %s. float32 prefill (2 threads) runs at %.0f%% of the 2-thread peak." % (
            ", ".join("%.0f GFLOP/s with %d thread%s" % (v[0], k, "s" if k > 1 else "") for k, v in sorted(peak.items())),
            ", ".join("float32 %.0f GFLOP/s (%.0f%% of peak), int8 %.0f GOP/s with %d thread%s" % (
                v[1], 100 * v[1] / v[0], v[2], k, "s" if k > 1 else "") for k, v in sorted(peak.items())),
            100 * prefill_peak),
        "",
        "| model | threads | weights MB/token | decode tok/s | prefill tok/s | prefill/decode | effective GB/s "
        "| % of read bandwidth | peak RSS MB | RSS budget MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ] + rows + [
        "",
        "Beam search, 2 threads, 64 steps after the 16-token prompt (`-b B -e never`): time per step relative to greedy.",
        "All runs round-robin, so that a slow spell of the machine hits every configuration alike.",
        "",
        "| model | greedy tok/s | B=4 step / greedy | B=8 step / greedy |",
        "| --- | --- | --- | --- |",
    ] + beam_rows + [
        "",
        "Constrained decoding, 2 threads, greedy: --json (128 tokens after the 16-token prompt) against plain "
        "decode; tool calls (8 chat requests with a weather and a calculator tool, tool_choice \"required\", "
        "--batch --parallel 1) against the same requests with tool_choice \"none\" cut at each call's tokens.",
        "",
        "| model | decode tok/s | --json tok/s | ratio | call tokens | calls tok/s | unconstrained tok/s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ] + constrained_rows + [""] + batch_lines + [""] + serve_lines + [
        "",
        "| target | met | measured |",
        "| --- | --- | --- |",
    ] + ["| %s | %s | %s |" % (name, "yes" if ok else "NO", value) for name, ok, value in checks + batch_checks + serve_checks]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
