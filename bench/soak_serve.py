#!/usr/bin/env python3
"""The serving soak of `make soak`: `run -m serve` on stories260K under
mixed traffic for SECONDS (default 600), from the asyncio load generator of
the tests (tests/load_serve.py). Clients, each a loop:

- completions, streamed or not, 8 to 200 tokens, greedy or sampled;
- aborts: a stream read for a moment, then the connection closed;
- malformed requests: bytes that are not HTTP, bad JSON, a bad field
  (each must get its 4xx, or, not HTTP, a 400 and the close);
- slow readers: a stream read a few bytes at a time with pauses;
- large bodies: 1 KB to the body limit (the padding in a field the server
  ignores).

Every REPORT seconds one line: answered, refused (429/503), the expected
4xx, unexpected failures, the p50 and p99 latency of the completions in the
window, the server's resident memory and open descriptors. At the end the
server is left idle: its cache's free blocks must be all of them and its
descriptors what they were at the start; the exit status says whether
that held and nothing unexpected happened.

    python3 bench/soak_serve.py [--seconds N] [--clients N]   (RUN, MODELS_DIR as the tests)
"""
import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))
import load_serve as load  # noqa: E402

RUN = os.environ.get('RUN', './run')
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
BODY_KB = 1024  # the server's default --max-body-kb
PROMPTS = ['Once upon a time', 'The little dog', 'One day, a girl', 'Tom and Sue', 'The sun was', 'In the park']


class Tally:
    def __init__(self):
        self.counts = {'answered': 0, 'refused': 0, 'expected_4xx': 0, 'unexpected': 0}
        self.latencies = []
        self.failures = []

    def unexpected(self, what):
        self.counts['unexpected'] += 1
        if len(self.failures) < 10:
            self.failures.append(what)


def completion(stream):
    b = {'prompt': random.choice(PROMPTS), 'max_tokens': random.randint(8, 200), 'stream': stream}
    if random.random() < 0.5:
        b.update(temperature=0)
    else:
        b.update(temperature=1.0, seed=random.randint(1, 1000))
    return b


async def completions(port, tally, stop):
    while not stop.is_set():
        status, _, data, seconds = await load.request(port, 'POST', '/v1/completions', completion(random.random() < 0.5))
        if status == 200:
            tally.counts['answered'] += 1
            tally.latencies.append(seconds)
        elif status in (429, 503):
            tally.counts['refused'] += 1
            await asyncio.sleep(1)
        else:
            tally.unexpected('completion: %r %r' % (status, data[:100]))


async def aborts(port, tally, stop):
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(load.HOST, port)
            writer.write(load.request_bytes('POST', '/v1/completions', dict(completion(True), max_tokens=400)))
            await writer.drain()
            await asyncio.wait_for(reader.read(random.randint(1, 3000)), 10)
            writer.close()
        except (OSError, asyncio.TimeoutError) as e:
            tally.unexpected('abort: %s' % e)
        await asyncio.sleep(random.random())


MALFORMED = [
    (b'NONSENSE\r\n\r\n', 400),
    (b'GET /health HTTP/9.9\r\n\r\n', 400),
    (load.request_bytes('POST', '/v1/completions', None), 400),
    (b'POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nConnection: close\r\n\r\n{"a":', 400),
    (load.request_bytes('POST', '/v1/completions', {'prompt': 5}), 400),
    (load.request_bytes('POST', '/v1/completions', {'prompt': 'x', 'temperature': -1}), 400),
    (load.request_bytes('GET', '/nothing'), 404),
    (b'POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n', 501),
]


async def malformed(port, tally, stop):
    while not stop.is_set():
        raw, want = random.choice(MALFORMED)
        try:
            reader, writer = await asyncio.open_connection(load.HOST, port)
            writer.write(raw)
            await writer.drain()
            status, _, _ = await asyncio.wait_for(load.read_response(reader), 30)
            writer.close()
            if status == want:
                tally.counts['expected_4xx'] += 1
            else:
                tally.unexpected('malformed %r: %d, not %d' % (raw[:30], status, want))
        except (OSError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            tally.unexpected('malformed %r: %s' % (raw[:30], e))
        await asyncio.sleep(random.random() * 0.5)


async def slow_readers(port, tally, stop):
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(load.HOST, port)
            writer.write(load.request_bytes('POST', '/v1/completions', completion(True)))
            await writer.drain()
            while not stop.is_set():
                got = await asyncio.wait_for(reader.read(200), 30)
                if not got or got.endswith(b'0\r\n\r\n'):
                    break
                await asyncio.sleep(0.2)
            writer.close()
            tally.counts['answered'] += 1
        except (OSError, asyncio.TimeoutError) as e:
            tally.unexpected('slow reader: %s' % e)


async def large_bodies(port, tally, stop):
    while not stop.is_set():
        size = random.randint(1, BODY_KB - 1) * 1024
        b = dict(completion(False), max_tokens=16, padding='x' * (size - 200))
        status, _, data, seconds = await load.request(port, 'POST', '/v1/completions', b)
        if status == 200:
            tally.counts['answered'] += 1
            tally.latencies.append(seconds)
        elif status in (429, 503):
            tally.counts['refused'] += 1
        else:
            tally.unexpected('large body of %d KB: %r %r' % (size // 1024, status, data[:100]))
        await asyncio.sleep(random.random())


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100.0 * len(values)))] if values else float('nan')


async def soak(port, pid, seconds, clients, report):
    tally, stop = Tally(), asyncio.Event()
    kinds = [completions] * (clients // 2) + [aborts, malformed, slow_readers, large_bodies] * max(1, clients // 8)
    tasks = [asyncio.ensure_future(k(port, tally, stop)) for k in kinds]
    print('%6s %9s %8s %6s %10s %8s %8s %9s %5s' % ('t (s)', 'answered', 'refused', '4xx', 'unexpected', 'p50 (s)', 'p99 (s)',
                                                    'RSS (KiB)', 'fds'), flush=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(min(report, seconds - (time.monotonic() - t0)))
        window, tally.latencies = tally.latencies, []
        rss, fds = load.server_usage(pid)
        c = tally.counts
        print('%6.0f %9d %8d %6d %10d %8.3f %8.3f %9d %5d' % (time.monotonic() - t0, c['answered'], c['refused'],
                                                              c['expected_4xx'], c['unexpected'], percentile(window, 50),
                                                              percentile(window, 99), rss, fds), flush=True)
    stop.set()
    await asyncio.gather(*tasks)
    return tally


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--seconds', type=float, default=600)
    ap.add_argument('--clients', type=int, default=48)
    ap.add_argument('--report', type=float, default=30)
    args = ap.parse_args()
    model, tok = os.path.join(MODELS_DIR, 'stories260K.bin'), os.path.join(MODELS_DIR, 'tok512.bin')
    if not (os.path.exists(model) and os.path.exists(tok)):
        print('soak: stories260K.bin or tok512.bin not in MODELS_DIR (%s)' % MODELS_DIR)
        return 0
    load.raise_nofile()
    proc = subprocess.Popen([RUN, model, '-z', tok, '-m', 'serve', '--port', '0'], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    port = None
    for line in proc.stderr:
        m = re.match(r'listening on http://[^:]+:(\d+)$', line.decode().strip())
        if m:
            port = int(m.group(1))
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    try:
        load.settle(port)
        fds0 = load.server_usage(proc.pid)[1]
        tally = asyncio.run(soak(port, proc.pid, args.seconds, args.clients, args.report))
        m = load.settle(port, timeout=30)
        fds1 = load.server_usage(proc.pid)[1]
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    ok = tally.counts['unexpected'] == 0 and m['run_cache_blocks_free'] == m['run_cache_blocks'] and fds1 == fds0 and code == 0
    print('idle again: cache blocks free %d of %d, descriptors %d (at the start %d), exit %d: %s' % (
        m['run_cache_blocks_free'], m['run_cache_blocks'], fds1, fds0, code, 'ok' if ok else 'NOT OK'))
    for f in tally.failures:
        print('  unexpected: %s' % f)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
