"""The speculative decoding benchmark of `make bench` (bench/bench.py calls
it; `python3 bench/speculative.py` runs it alone): 256 greedy tokens on the
stories110M shape, float32 target, 2 threads, generated tokens per second
from the stats line, against the same command without speculation.

  draft     --draft with the int8 (version 2) export of the target
  repeat    --lookup 3 on a prompt whose continuation repeats text from the
            prompt (the target's own greedy continuation of a story opening,
            given once as the prompt, then asked for again)
  nothing   --lookup 3 with --no-repeat-ngram-size 3 on both sides: no
            3-gram occurs twice, so there is never anything to look up (the
            cost of looking)
  sampled   --draft with the int8 export, sampling at -t 0.8 with a fixed
            seed (the same text as without it; a draft pays only when the
            model draws that very token)

Each configuration runs `runs` times, round-robin; medians are reported.
"""
import os
import re
import statistics
import subprocess
import sys

STATS_RE = re.compile(r"generated (\d+) tokens, ([\d.]+) tok/s(?:; drafted (\d+), accepted (\d+) \(([\d.]+) tokens per target pass\))?")
STORY_START = "Once upon a time, there was a little girl named Lily. She liked to play"


def stats(cmd):
    """Runs cmd; returns (stdout, generated tok/s, drafted, accepted, tokens per target pass)."""
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        sys.exit("bench: %s failed (%d): %s" % (" ".join(cmd), p.returncode, err.strip()[-300:]))
    m = STATS_RE.search(err)
    extra = tuple(float(m.group(k)) if m.group(k) else 0.0 for k in (3, 4, 5))
    return (p.stdout.decode(errors="replace"), float(m.group(2))) + extra


def speculative_bench(runbin, model_f32, model_q8, tok, runs):
    """Returns (table lines, checks) for bench.py's report."""
    base = [runbin, model_f32, "-z", tok, "-t", "0", "-T", "2", "--max-new-tokens", "256"]
    # a prompt whose continuation repeats it: the story opening and the
    # target's own continuation of it, then the opening again
    text = stats(base[:-2] + ["-n", "64", "-i", STORY_START])[0]
    repeat_prompt = text + " " + STORY_START
    jobs = {
        "draft": (base + ["-i", STORY_START], ["--draft", model_q8]),
        "repeat": (base + ["-i", repeat_prompt], ["--lookup", "3"]),
        "nothing": (base + ["-i", STORY_START, "--no-repeat-ngram-size", "3"], ["--lookup", "3"]),
        "sampled": (base + ["-i", STORY_START, "-t", "0.8", "-s", "1"], ["--draft", model_q8]),
    }
    got = {(k, s): [] for k in jobs for s in (0, 1)}
    for i in range(runs):
        for key, (cmd, extra) in jobs.items():
            plain, spec = stats(cmd), stats(cmd + extra)
            if plain[0] != spec[0]:
                sys.exit("bench: speculation (%s) changed the output" % key)
            got[(key, 0)].append(plain)
            got[(key, 1)].append(spec)
        print("bench: speculative round %d of %d done" % (i + 1, runs), file=sys.stderr)
    med = {k: statistics.median(r[1] for r in v) for k, v in got.items()}
    last = {k: v[-1] for k, v in got.items()}
    names = {"draft": "`--draft` int8 export", "repeat": "`--lookup 3`, continuation repeats the prompt",
             "nothing": "`--lookup 3`, nothing to look up", "sampled": "`--draft` int8 export, `-t 0.8 -s 1`"}
    lines = [
        "Speculative decoding, stories110M f32 target, 256 greedy tokens, 2 threads, medians of %d runs "
        "(generated tok/s from the stats line; output identical with and without; the last row samples):" % runs,
        "",
        "| case | plain tok/s | speculative tok/s | speedup | drafted | accepted | tokens per target pass |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ] + ["| %s | %.1f | %.1f | %.2fx | %d | %d | %.2f |" % (
        names[k], med[(k, 0)], med[(k, 1)], med[(k, 1)] / med[(k, 0)], last[(k, 1)][2], last[(k, 1)][3], last[(k, 1)][4])
        for k in jobs]
    ratio = {k: med[(k, 1)] / med[(k, 0)] for k in jobs}
    checks = [
        ("speculation: --draft (int8 export) >= 1.5x greedy", ratio["draft"] >= 1.5, "%.2fx" % ratio["draft"]),
        ("speculation: --lookup 3 on repeating text >= 2x greedy", ratio["repeat"] >= 2, "%.2fx" % ratio["repeat"]),
        ("speculation: --lookup 3 with nothing to look up >= 0.95x greedy", ratio["nothing"] >= 0.95,
         "%.2fx" % ratio["nothing"]),
    ]
    return lines, checks


if __name__ == "__main__":
    # python3 bench/speculative.py RUN F32 Q8 TOKENIZER [RUNS]
    lines, checks = speculative_bench(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4],
                                      int(sys.argv[5]) if len(sys.argv) > 5 else 3)
    print("\n".join(lines + [""] + ["%s: %s (%s)" % (n, "met" if ok else "NOT met", v) for n, ok, v in checks]))
