"""The batching benchmark of `make bench` (bench/bench.py calls it): many
requests served together by one engine (--batch), against the same requests
run one after another (--parallel 1), on the stories110M shape.

  throughput  32 requests, each a 16-token prompt and 128 new tokens,
              greedy, and sampled (temperature 1, top-p 0.9, seeds 1..32):
              generated tokens per second of wall time, with --parallel 16
              and with --parallel 1
  prefix      16 requests whose prompts share their first 256 tokens (and
              then differ), 16 new tokens each, --parallel 16: prompt tokens
              computed and reused, as the stats line reports them

Each configuration runs `runs` times, round-robin; medians are reported.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

STATS_RE = re.compile(r"stats: prompt (\d+) tokens, (\d+) reused")


def timed(cmd):
    """Runs cmd; returns (wall seconds, stderr)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        sys.exit("bench: %s failed (%d): %s" % (" ".join(cmd), p.returncode, err.strip()[-300:]))
    return wall, err


def write_requests(path, requests):
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")


def batch_bench(runbin, model, tok, p16, p256, cache, runs):
    """Returns (table lines, checks) for bench.py's report."""
    sampled = os.path.join(cache, "batch_32x128.jsonl")
    write_requests(sampled, [{"prompt": p16, "steps": 16 + 128 - 1, "seed": i + 1, "temperature": 1.0}
                             for i in range(32)])
    greedy = os.path.join(cache, "batch_32x128_greedy.jsonl")
    write_requests(greedy, [{"prompt": p16, "steps": 16 + 128 - 1, "temperature": 0} for i in range(32)])
    shared = os.path.join(cache, "batch_prefix256.jsonl")
    endings = ["Then", "Later", "The ball", "Anna said", "Suddenly", "The sun", "Tom", "At night",
               "The dog", "Mom", "A bird", "It rained", "The park", "Lily's friend", "After lunch", "The end"]
    write_requests(shared, [{"prompt": p256 + " " + e, "steps": 300, "temperature": 0} for e in endings])
    base = [runbin, model, "-z", tok, "-T", "2"]
    jobs = {
        "parallel16": base + ["--batch", greedy, "--parallel", "16"],
        "sequential": base + ["--batch", greedy, "--parallel", "1"],
        "sampled16": base + ["--batch", sampled, "--parallel", "16"],
        "sampled1": base + ["--batch", sampled, "--parallel", "1"],
        "prefix": base + ["--batch", shared, "--parallel", "16", "-n", "0"],
    }
    walls = {k: [] for k in jobs}
    reuse = None
    for i in range(runs):
        for key, cmd in jobs.items():
            wall, err = timed(cmd)
            walls[key].append(wall)
            if key == "prefix":
                m = None
                for m in STATS_RE.finditer(err):
                    pass
                reuse = (int(m.group(1)), int(m.group(2)))
        print("bench: batch round %d of %d done" % (i + 1, runs), file=sys.stderr)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    generated = 32 * 128
    par, seq = generated / wall["parallel16"], generated / wall["sequential"]
    spar, sseq = generated / wall["sampled16"], generated / wall["sampled1"]
    computed, reused = reuse
    want_reused = 15 * (256 // 16) * 16
    lines = [
        "Batching (`--batch`), stories110M f32, 2 threads, medians of %d runs of whole processes (wall time):" % runs,
        "",
        "| requests | --parallel | wall s | generated tok/s |",
        "| --- | --- | --- | --- |",
        "| 32 x (16-token prompt + 128 greedy) | 1 | %.1f | %.1f |" % (wall["sequential"], seq),
        "| 32 x (16-token prompt + 128 greedy) | 16 | %.1f | %.1f |" % (wall["parallel16"], par),
        "| 32 x (16-token prompt + 128 sampled) | 1 | %.1f | %.1f |" % (wall["sampled1"], sseq),
        "| 32 x (16-token prompt + 128 sampled) | 16 | %.1f | %.1f |" % (wall["sampled16"], spar),
        "",
        "Sampling (softmax, then top-p's sort of the tokens that can be in the nucleus) runs on one thread per",
        "request; on random weights the distribution is nearly flat, so top-p sorts about all 32000 tokens",
        "(milliseconds a token), which a trained model's peaked distribution does not cost.",
        "",
        "16 requests sharing a 256-token prefix, `--parallel 16`: %d prompt tokens computed, %d reused (%.1f s)."
        % (computed, reused, wall["prefix"]),
    ]
    checks = [
        ("batch: --parallel 16 >= 6x the tokens/s of one request after another (greedy)", par >= 6 * seq,
         "%.2fx (sampled: %.2fx)" % (par / seq, spar / sseq)),
        ("batch: shared 256-token prefix reused >= 15 x 256 tokens", reused >= want_reused,
         "%d reused (want >= %d)" % (reused, want_reused)),
    ]
    return lines, checks
