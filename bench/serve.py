#!/usr/bin/env python3
"""The serving benchmark of `make bench` (bench/bench.py calls it): `run -m
serve --parallel 16` on the stories110M shape, with N = 1, 4 and 16 clients
at once, each sending PER_CLIENT streamed completions one after another,
drawn from a mix of 16 (prompts of 16, 64 and 128 tokens, max_tokens 32, 64
and 128, seeds 1..16, temperature 1, top_p 0.9), each client starting at
another place of the mix. So N requests are in flight most of the time, as
with N users, rather than a batch of 16 draining to its longest request.
Reported: generated tokens per second of wall time (all clients), and the
median time to the first token. Medians over `runs` rounds.

Side by side, llama.cpp's `llama-server -np N` (N = the clients; 512
positions a slot) on the same weights as GGUF files, with the same requests,
when LLAMA_SERVER names its binary and LLAMA_GGUFS its models (comma
separated), or from the command line; run's k-th checkpoint is checked
against the k-th GGUF (f32 against F32, int8 with groups of 32 against Q8_0):

    python3 bench/serve.py MODEL[,MODEL...] TOKENIZER [--runs N] [--llama-server PATH --gguf FILE [--gguf FILE]]
    (RUN: the binary, default ./runomp)
"""
import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

CLIENTS = (1, 4, 16)
PER_CLIENT = 6  # requests each client sends in turn
LLAMA_SLOT_POSITIONS = 512  # the GGUFs say 128 (n_ctx_train); llama-server only warns past it


def start_server(runbin, model, tok, threads):
    proc = subprocess.Popen([runbin, model, "-z", tok, "-m", "serve", "--port", "0", "--parallel", "16", "-T", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for line in proc.stderr:
        m = re.match(r"listening on http://[^:]+:(\d+)", line.decode())
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, int(m.group(1))
    sys.exit("bench: the server did not start")


def streamed(port, req):
    """(seconds to the first token, tokens) of one streamed completion."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(dict(req, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    first, tokens = None, 0
    for line in r:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            if json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - t0
    c.close()
    return first, tokens


def one_round(port, requests, n_clients):
    """(generated tok/s, median time to first token) with n_clients at once."""
    results = []
    lock = threading.Lock()

    def client(k):
        for j in range(PER_CLIENT):  # a stride of 7 (prime to 16) walks the mix of lengths
            got = streamed(port, requests[(k * len(requests) // n_clients + 7 * j) % len(requests)])
            with lock:
                results.append(got)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return sum(n for _, n in results) / wall, statistics.median(f for f, _ in results if f is not None)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_llama_server(server, gguf, slots, threads):
    """llama-server with `slots` parallel slots, once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen([server, "-m", gguf, "-np", str(slots), "-c", str(LLAMA_SLOT_POSITIONS * slots), "-t", str(threads),
                             "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("bench: llama-server did not start")


def bench_requests():
    return [{"prompt_index": i % 3, "max_tokens": (32, 64, 128)[(i // 3) % 3], "seed": i + 1, "temperature": 1.0,
             "top_p": 0.9} for i in range(16)]


def with_prompts(requests, prompts):
    return [dict({k: v for k, v in r.items() if k != "prompt_index"}, prompt=prompts[r["prompt_index"]]) for r in requests]


def run_rounds(requests, runs, start):
    """{clients: (tok/s, time to first token)}, medians; start(clients)
    gives a server (process, port) for that many clients, or the same one."""
    got = {n: [] for n in CLIENTS}
    server = None
    for i in range(runs):
        for n in CLIENTS:
            fresh = start(n, server)
            if fresh is not server and server:
                server[0].terminate()
                server[0].wait()
            server = fresh
            got[n].append(one_round(server[1], requests, n))
        print("bench: serve round %d of %d done" % (i + 1, runs), file=sys.stderr)
    server[0].terminate()
    server[0].wait()
    return {n: (statistics.median(r[0] for r in got[n]), statistics.median(r[1] for r in got[n])) for n in CLIENTS}


def serve_bench(runbin, model, tok, prompts, runs, threads=2, models=None, llama=None):
    """Returns (table lines, checks) for bench.py's report; prompts: texts of
    16, 64 and 128 tokens; models: more checkpoints for run; llama: (the
    llama-server binary, [GGUF files]), by default from LLAMA_SERVER and
    LLAMA_GGUFS."""
    requests = with_prompts(bench_requests(), prompts)
    if llama is None and os.environ.get("LLAMA_SERVER") and os.environ.get("LLAMA_GGUFS"):
        llama = (os.environ["LLAMA_SERVER"], os.environ["LLAMA_GGUFS"].split(","))
    results = []
    for m in [model] + list(models or []):
        results.append(("run -m serve --parallel 16", os.path.basename(m),
                        run_rounds(requests, runs, lambda n, s, m=m: s or start_server(runbin, m, tok, threads))))
    ours = results[0][2]
    for gguf in (llama[1] if llama else []):
        results.append(("llama-server -np N", os.path.basename(gguf),
                        run_rounds(requests, runs, lambda n, s, g=gguf: start_llama_server(llama[0], g, n, threads))))
    lines = ["Serving, %d threads, N clients at once, each sending %d streamed completions in turn from a mix of 16 "
             "(prompts of 16/64/128 tokens, max_tokens 32/64/128, temperature 1, top_p 0.9), medians of %d rounds; "
             "generated tok/s of wall time (time to first token, median):" % (threads, PER_CLIENT, runs), "",
             "| server | weights | " + " | ".join("%d client%s" % (n, "s" if n > 1 else "") for n in CLIENTS) + " | 16 vs 1 |",
             "| --- | --- | " + " | ".join("---" for _ in CLIENTS) + " | --- |"]
    for server, weights, r in results:
        lines.append("| %s | %s | " % (server, weights) + " | ".join("%.1f (%.0f ms)" % (r[n][0], 1000 * r[n][1]) for n in CLIENTS)
                     + " | %.2fx |" % (r[16][0] / r[1][0]))
    checks = [("serve: 16 clients >= 6x the tokens/s of 1 client", ours[16][0] >= 6 * ours[1][0], "%.2fx" % (ours[16][0] / ours[1][0]))]
    n_run = len(results) - len(llama[1] if llama else [])
    for (_, mine, r1), (server, weights, r2) in zip(results[:n_run], results[n_run:]):  # run's k-th checkpoint against the k-th GGUF
        checks.append(("serve: 16 clients: %s more tokens/s than %s on %s" % (mine, server, weights), r1[16][0] > r2[16][0],
                       "%.1f vs %.1f" % (r1[16][0], r2[16][0])))
    return lines, checks


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    args = sys.argv[1:]

    def values(flag):
        return [args[i + 1] for i in range(len(args) - 1) if args[i] == flag]
    runs = int(values("--runs")[0]) if values("--runs") else 1
    words = "Once upon a time there was a little girl named Lily who loved to play outside in the park".split()
    texts = [" ".join((words * 20)[:n // 2]) for n in (16, 64, 128)]
    checkpoints = args[0].split(",")
    llama = (values("--llama-server")[0], values("--gguf")) if values("--llama-server") else None
    lines, checks = serve_bench(os.environ.get("RUN", "./runomp"), checkpoints[0], args[1], texts, runs, models=checkpoints[1:],
                                llama=llama)
    print("\n".join(lines))
    for name, ok, value in checks:
        print("%s %s: %s" % ("PASS" if ok else "FAIL", name, value))
