#!/usr/bin/env python3
"""-m serve, the OpenAI-compatible HTTP server, spoken to with Python's
standard library: completions and chat completions, streamed and not, each
text equal to the command line's (`-f json`) for the same prompt, settings
and seed (the command line is itself checked against the numpy references by
test_reference.py), also among 15 other requests at once; a client that goes
away mid-stream cancels its request and the server goes on; every bad request
gets its status and the OpenAI error body; keep-alive (several requests on one
connection, Connection: close, pipelining, the idle timeout, --max-conns);
--api-key; SIGTERM ends it with 0.

Environment: RUN, MODELS_DIR, TEST_TMP, as the other suites.
"""
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get('RUN', './run')
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
MODEL = os.path.join(MODELS_DIR, 'stories260K.bin')
TOK = os.path.join(MODELS_DIR, 'tok512.bin')


class Server:
    """A server on a free loopback port; its stderr is collected."""

    def __init__(self, *flags):
        self.proc = subprocess.Popen([RUN, MODEL, '-z', TOK, '-m', 'serve', '--port', '0'] + list(flags),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.log = []
        self.port = None
        deadline = time.time() + 30
        while time.time() < deadline:
            line = self.proc.stderr.readline().decode('utf-8', 'replace')
            if not line:
                break
            self.log.append(line)
            m = re.match(r'listening on http://[^:]+:(\d+)$', line.strip())
            if m:
                self.port = int(m.group(1))
                break
        assert self.port, 'no listening line: %s' % ''.join(self.log)[-300:]
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line.decode('utf-8', 'replace'))

    def request(self, method, path, body=None, headers=None, raw_body=None):
        """(status, headers, body bytes)."""
        c = http.client.HTTPConnection('127.0.0.1', self.port, timeout=60)
        data = raw_body if raw_body is not None else (json.dumps(body).encode() if body is not None else None)
        h = {'Content-Type': 'application/json'}
        h.update(headers or {})
        c.request(method, path, body=data, headers=h)
        r = c.getresponse()
        out = (r.status, dict(r.getheaders()), r.read())
        c.close()
        return out

    def post(self, path, body, **kw):
        status, _, data = self.request('POST', path, body, **kw)
        return status, json.loads(data)

    def stream(self, path, body):
        """The parsed events of a streamed answer, and whether [DONE] ended it."""
        status, headers, data = self.request('POST', path, dict(body, stream=True))
        assert status == 200, (status, data[:200])
        assert headers.get('Content-Type', '').startswith('text/event-stream'), headers
        events = [e for e in data.decode().split('\n\n') if e]
        assert all(e.startswith('data: ') for e in events), events[:3]
        done = events[-1] == 'data: [DONE]'
        return [json.loads(e[6:]) for e in events if e != 'data: [DONE]'], done

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


def cli(args):
    """The text of `run -f json` with these flags."""
    p = subprocess.run([RUN, MODEL, '-z', TOK, '-f', 'json'] + args, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    return json.loads(p.stdout.decode().splitlines()[0])


def cli_args(req):
    """The command-line flags of a completion request."""
    args = ['-i', req['prompt'], '--max-new-tokens', str(req['max_tokens'])]
    for field, flag in (('temperature', '-t'), ('top_p', '-p'), ('seed', '-s'), ('top_k', '--top-k'), ('min_p', '--min-p'),
                        ('repetition_penalty', '--repetition-penalty'), ('num_beams', '-b')):
        if field in req:
            args += [flag, str(req[field])]
    for s in ([req['stop']] if isinstance(req.get('stop'), str) else req.get('stop', [])):
        args += ['--stop', s]
    return args


def check_completion(srv, req):
    status, out = srv.post('/v1/completions', req)
    assert status == 200, out
    want = cli(cli_args(req))
    choice = out['choices'][0]
    assert choice['text'] == want['text'], 'request %r: %r, the command line %r' % (req, choice['text'], want['text'])
    assert choice['finish_reason'] == ('length' if want['stop'] == 'length' else 'stop'), (choice, want['stop'])
    assert out['object'] == 'text_completion' and out['model'] == 'stories260K.bin' and out['id']
    assert out['usage']['completion_tokens'] == len(want['tokens']), (out['usage'], len(want['tokens']))
    assert out['usage']['total_tokens'] == out['usage']['prompt_tokens'] + out['usage']['completion_tokens']
    return out


REQUESTS = [
    {'prompt': 'Once upon a time', 'max_tokens': 40, 'temperature': 0},
    {'prompt': 'Lily and Tom', 'max_tokens': 30, 'temperature': 1.0, 'seed': 42},
    {'prompt': 'The cat', 'max_tokens': 50, 'temperature': 0.8, 'top_p': 0.9, 'seed': 7, 'stop': '.'},
    {'prompt': 'One day', 'max_tokens': 25, 'temperature': 1.0, 'top_k': 20, 'seed': 3, 'stop': ['dog', ' sad']},
    {'prompt': 'A big', 'max_tokens': 30, 'temperature': 0.9, 'min_p': 0.05, 'repetition_penalty': 1.3, 'seed': 11},
]


def test_completions(srv):
    for req in REQUESTS:
        check_completion(srv, req)


def test_beams(srv):
    check_completion(srv, {'prompt': 'Once upon a time', 'max_tokens': 20, 'num_beams': 2})


def test_stream(srv):
    for req in REQUESTS[:4]:
        _, whole = srv.post('/v1/completions', req)
        events, done = srv.stream('/v1/completions', req)
        assert done, 'no [DONE]'
        text = ''.join(e['choices'][0]['text'] for e in events)
        assert text == whole['choices'][0]['text'], (text, whole['choices'][0]['text'])
        assert events[-1]['choices'][0]['finish_reason'] == whole['choices'][0]['finish_reason']
        assert all(e['choices'][0]['finish_reason'] is None for e in events[:-1])


def test_chat(srv):
    req = {'messages': [{'role': 'system', 'content': 'You are kind.'}, {'role': 'user', 'content': 'hi there'}],
           'max_tokens': 30, 'temperature': 0}
    status, out = srv.post('/v1/chat/completions', req)
    assert status == 200, out
    msg = out['choices'][0]['message']
    want = cli(['-m', 'chat', '-y', 'You are kind.', '-i', 'hi there', '--max-new-tokens', '30', '-t', '0'])
    assert msg == {'role': 'assistant', 'content': want['text']}, (msg, want['text'])
    assert out['object'] == 'chat.completion'
    events, done = srv.stream('/v1/chat/completions', req)
    assert done
    assert events[0]['choices'][0]['delta'].get('role') == 'assistant'
    assert ''.join(e['choices'][0]['delta'].get('content', '') for e in events) == msg['content']
    assert all(e['object'] == 'chat.completion.chunk' for e in events)
    # a longer conversation renders and runs; a bad one is refused
    req['messages'] += [{'role': 'assistant', 'content': 'Hello.'}, {'role': 'user', 'content': 'Tell me a story.'}]
    status, out = srv.post('/v1/chat/completions', req)
    assert status == 200 and out['usage']['prompt_tokens'] > 20, out
    status, out = srv.post('/v1/chat/completions', {'messages': [{'role': 'assistant', 'content': 'x'}]})
    assert status == 400, out


def test_concurrent(srv):
    reqs = []
    for i in range(16):
        r = dict(REQUESTS[i % len(REQUESTS)])
        r['seed'] = 100 + i
        r['max_tokens'] = 20 + 7 * (i % 5)
        r['prompt'] = r['prompt'] + ' ' * (i % 3)
        reqs.append(r)
    results = [None] * 16

    def one(i):
        try:
            results[i] = srv.post('/v1/completions', reqs[i])
        except Exception as e:  # noqa: BLE001
            results[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        assert isinstance(r, tuple) and r[0] == 200, 'request %d: %r' % (i, r)
        want = cli(cli_args(reqs[i]))
        assert r[1]['choices'][0]['text'] == want['text'], 'request %d differs from its solo run' % i


def metric(srv, name):
    _, _, data = srv.request('GET', '/metrics')
    m = re.search(r'^%s (\d+)$' % name, data.decode(), re.M)
    assert m, data
    return int(m.group(1))


def test_disconnect(srv):
    s = socket.create_connection(('127.0.0.1', srv.port))
    body = json.dumps({'prompt': 'Once upon a time', 'max_tokens': 10000, 'temperature': 1.0, 'seed': 5,
                       'stream': True}).encode()
    s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n'
              % len(body) + body)
    got = s.recv(4096)  # the stream has begun (the generation of 500 tokens takes longer)
    assert got.startswith(b'HTTP/1.1 200'), got[:100]
    s.close()
    deadline = time.time() + 10
    while time.time() < deadline and metric(srv, 'run_running_requests') != 0:
        time.sleep(0.05)
    assert metric(srv, 'run_running_requests') == 0, 'the request still runs'
    # the log is read from the server's stderr by another thread: give the line time to arrive
    while time.time() < deadline and not any('cancelled' in line for line in srv.log):
        time.sleep(0.05)
    assert any('cancelled' in line for line in srv.log), 'no cancel in the log'
    check_completion(srv, REQUESTS[0])


def test_bad_requests(srv):
    def expect(status, got, what):
        code, _, data = got
        assert code == status, '%s: %d, not %d (%r)' % (what, code, status, data[:200])
        err = json.loads(data)['error']
        assert isinstance(err['message'], str) and err['type'] and err['code'] == status, (what, err)
    cases = [
        (400, ('POST', '/v1/completions', None, None, b'{"prompt": "x",'), 'malformed JSON'),
        (400, ('POST', '/v1/completions', None, None, b'[1,2]'), 'not an object'),
        (400, ('POST', '/v1/completions', {'prompt': 5}), 'prompt not a string'),
        (400, ('POST', '/v1/completions', {'prompt': ['a', {'b': 1}]}), 'a prompt of the list an object'),
        (400, ('POST', '/v1/completions', {'prompt': 'x', 'max_tokens': 'ten'}), 'max_tokens a string'),
        (400, ('POST', '/v1/completions', {'prompt': 'x', 'temperature': -1}), 'temperature below 0'),
        (400, ('POST', '/v1/completions', {'prompt': 'x', 'stream': 1}), 'stream a number'),
        (400, ('POST', '/v1/completions', {}), 'no prompt'),
        (400, ('POST', '/v1/completions', {'prompt': 'x ' * 900}), 'prompt too long'),
        (400, ('POST', '/v1/completions', {'prompt': 'x', 'n': 17}), 'n = 17'),
        (400, ('POST', '/v1/completions', {'prompt': 'x', 'num_beams': 2, 'stream': True}), 'beams streamed'),
        (400, ('POST', '/v1/chat/completions', {'messages': 'hi'}), 'messages a string'),
        (400, ('POST', '/v1/chat/completions', {'messages': [{'role': 'user'}]}), 'message without content'),
        (413, ('POST', '/v1/completions', {'prompt': 'x' * 3000}), 'body over --max-body-kb'),
        (404, ('GET', '/v2/nothing'), 'unknown path'),
        (405, ('GET', '/v1/completions'), 'wrong method'),
        (405, ('POST', '/health', {}), 'wrong method'),
    ]
    for status, args, what in cases:
        expect(status, srv.request(*args), what)
    # harmless and unknown fields
    status, out = srv.post('/v1/completions', {'prompt': 'x', 'max_tokens': 3, 'user': 'me', 'n': 1, 'logit_bias': {},
                                               'whatever': [1, {'a': None}], 'stop': None, 'model': 'any'})
    assert status == 200, out
    # malformed HTTP, an oversized header, a slow client: the server goes on
    for raw in (b'NONSENSE\r\n\r\n', b'GET /health HTTP/9.9\r\n\r\n', b'GET /health HTTP/1.1\r\nX: ' + b'a' * 20000 + b'\r\n\r\n'):
        s = socket.create_connection(('127.0.0.1', srv.port))
        s.sendall(raw)
        data = s.recv(4096)
        s.close()
        assert re.match(rb'HTTP/1.1 4\d\d ', data), (raw[:30], data[:100])
    slow = socket.create_connection(('127.0.0.1', srv.port))
    slow.sendall(b'POST /v1/completions HTTP/1.1\r\n')
    status, _, _ = srv.request('GET', '/health')
    assert status == 200
    slow.close()
    check_completion(srv, REQUESTS[1])


def test_models_health(srv):
    status, _, data = srv.request('GET', '/health')
    assert status == 200
    status, _, data = srv.request('GET', '/v1/models')
    out = json.loads(data)
    assert status == 200 and out['data'][0]['id'] == 'stories260K.bin', out
    for name in ('run_requests_total', 'run_generated_tokens_total', 'run_prompt_tokens_reused_total', 'run_queue_length',
                 'run_running_requests'):
        metric(srv, name)


def test_connection_limit(srv):
    """Connections beyond --max-conns 64 get 503 when none is idle; a client
    that sends a header and half a body is dropped --header-timeout (5 s)
    after the header; the server goes on."""
    idle = [socket.create_connection(('127.0.0.1', srv.port)) for _ in range(64)]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(('127.0.0.1', srv.port))
        data = extra.recv(4096)
        extra.close()
        assert data.startswith(b'HTTP/1.1 503 '), data[:100]
        idle[0].sendall(b'POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{')
        idle[0].settimeout(20)
        t0 = time.time()
        assert idle[0].recv(4096) == b'', 'the slow client got an answer'
        assert 4 < time.time() - t0 < 9, 'dropped after %.1f s' % (time.time() - t0)
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    check_completion(srv, REQUESTS[0])


def read_until_closed(s, timeout=20):
    """Everything the server sends on raw socket s until it closes."""
    s.settimeout(timeout)
    data = b''
    while True:
        got = s.recv(65536)
        if not got:
            return data
        data += got


def test_keep_alive(srv):
    """Several requests on one connection (http.client reusing it): plain,
    streamed (chunked), an error that keeps it, each answer as on a fresh
    connection; Connection: close, pipelined requests and HTTP/1.0 end it."""
    c = http.client.HTTPConnection('127.0.0.1', srv.port, timeout=60)
    c.connect()
    sock = c.sock
    port = sock.getsockname()[1]

    def exchange(method, path, body=None, headers=None):
        h = {'Content-Type': 'application/json'}
        h.update(headers or {})
        c.request(method, path, body=json.dumps(body) if body is not None else None, headers=h)
        r = c.getresponse()
        return r.status, r.getheader('Connection'), r.read()
    for _ in range(2):
        assert exchange('GET', '/health')[:2] == (200, 'keep-alive')
        for req in REQUESTS[:3]:
            status, conn, data = exchange('POST', '/v1/completions', req)
            assert (status, conn) == (200, 'keep-alive'), (status, conn, data[:200])
            want = cli(cli_args(req))
            assert json.loads(data)['choices'][0]['text'] == want['text'], req
            status, conn, data = exchange('POST', '/v1/completions', dict(req, stream=True))
            assert (status, conn) == (200, 'keep-alive'), (status, conn)
            events = [e for e in data.decode().split('\n\n') if e]
            assert events[-1] == 'data: [DONE]', events[-2:]
            assert ''.join(json.loads(e[6:])['choices'][0]['text'] for e in events[:-1]) == want['text'], req
        status, conn, data = exchange('GET', '/v2/nothing')
        assert (status, conn) == (404, 'keep-alive') and json.loads(data)['error']['code'] == 404
        status, conn, _ = exchange('POST', '/v1/completions', {'prompt': 5})
        assert (status, conn) == (400, 'keep-alive')
        assert c.sock is sock and sock.getsockname()[1] == port, 'http.client had to reconnect'
    status, conn, _ = exchange('GET', '/health', headers={'Connection': 'close'})
    assert (status, conn) == (200, 'close')
    assert c.sock is None, 'http.client kept a connection the server closes'
    c.close()
    # pipelined: both answered in order, the second closes
    s = socket.create_connection(('127.0.0.1', srv.port))
    body = json.dumps(REQUESTS[0]).encode()
    s.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s' % (len(body), body) +
              b'GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
    data = read_until_closed(s)
    s.close()
    answers = re.findall(rb'HTTP/1.1 (\d+) [^\r]*\r\n(?:[^\r]+\r\n)*?Connection: (\S+)\r\n', data)
    assert answers == [(b'200', b'keep-alive'), (b'200', b'close')], data[:300]
    head, rest = data.split(b'\r\n\r\n', 1)
    length = int(re.search(rb'Content-Length: (\d+)', head).group(1))
    assert json.loads(rest[:length])['choices'][0]['text'] == cli(cli_args(REQUESTS[0]))['text']
    assert data.rstrip().endswith(b'"owned_by":"run"}]}'), data[-100:]
    # HTTP/1.0: closed after the answer
    s = socket.create_connection(('127.0.0.1', srv.port))
    s.sendall(b'GET /health HTTP/1.0\r\n\r\n')
    data = read_until_closed(s)
    s.close()
    assert data.startswith(b'HTTP/1.1 200 ') and b'Connection: close\r\n' in data, data[:200]


def test_keep_alive_limits(srv):
    """A connection idle between requests is closed after 5 s; connections
    stay open between requests (33 here, no cap but --max-conns); a new
    client when all 64 connections are taken pushes out the idlest."""
    time.sleep(0.5)  # earlier tests' connections, closed by their clients, are gone
    s = socket.create_connection(('127.0.0.1', srv.port))
    s.sendall(b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n')
    s.settimeout(20)
    first = s.recv(4096)
    assert first.startswith(b'HTTP/1.1 200 ') and b'keep-alive' in first, first[:200]
    t0 = time.time()
    assert s.recv(4096) == b'', 'an idle connection got bytes'
    assert 4 < time.time() - t0 < 9, 'idle connection closed after %.1f s' % (time.time() - t0)
    s.close()
    kept = []
    try:
        for i in range(33):
            c = http.client.HTTPConnection('127.0.0.1', srv.port, timeout=60)
            c.request('GET', '/health')
            r = c.getresponse()
            r.read()
            kept.append((c, r.getheader('Connection')))
        states = [conn for _, conn in kept]
        assert states == ['keep-alive'] * 33, states
        fresh = [socket.create_connection(('127.0.0.1', srv.port)) for _ in range(31)]
        try:
            time.sleep(0.3)
            status, _, _ = srv.request('GET', '/health')
            assert status == 200, 'a new client with every connection taken: %d' % status
            first = kept[0][0].sock
            first.settimeout(10)
            assert first.recv(10) == b'', 'the idlest connection was not closed for the new client'
        finally:
            for f in fresh:
                f.close()
    finally:
        for c, _ in kept:
            c.close()
    time.sleep(0.3)
    check_completion(srv, REQUESTS[0])


def test_api_key():
    srv = Server('--api-key', 'sekret')
    try:
        req = {'prompt': 'x', 'max_tokens': 2}
        assert srv.post('/v1/completions', req)[0] == 401
        assert srv.post('/v1/completions', req, headers={'Authorization': 'Bearer wrong!'})[0] == 401
        assert srv.post('/v1/completions', req, headers={'Authorization': 'Bearer sekre'})[0] == 401
        assert srv.post('/v1/completions', req, headers={'Authorization': 'Bearer sekret'})[0] == 200
        assert srv.request('GET', '/v1/models')[0] == 401
        assert srv.request('GET', '/health')[0] == 200
    finally:
        assert srv.stop() == 0


def test_stop_default():
    """--stop is the default of every request; a request's "stop" replaces it."""
    srv = Server('--stop', 'the')
    try:
        base = {'prompt': 'Once upon a time', 'max_tokens': 60, 'temperature': 0}
        for given, stops in (({}, ['--stop', 'the']), ({'stop': 'girl'}, ['--stop', 'girl']),
                             ({'stop': ['.', 'girl']}, ['--stop', '.', '--stop', 'girl'])):
            req = dict(base, **given)
            status, out = srv.post('/v1/completions', req)
            assert status == 200, out
            want = cli(['-i', req['prompt'], '--max-new-tokens', '60', '-t', '0'] + stops)['text']
            assert out['choices'][0]['text'] == want, (req, out['choices'][0]['text'], want)
    finally:
        assert srv.stop() == 0


def test_sigterm():
    srv = Server()
    srv.post('/v1/completions', {'prompt': 'x', 'max_tokens': 2})
    code = srv.stop()
    assert code == 0, 'exit status %r' % code


def test_log_once():
    """An empty "messages" says it is empty; the log has one line for a 400
    and one for a completion of 2 choices."""
    srv = Server()
    try:
        status, data = srv.post('/v1/chat/completions', {'messages': []})
        assert status == 400, status
        message = data['error']['message']
        assert 'empty' in message and 'missing' not in message, message
        status, _ = srv.post('/v1/completions', {'prompt': 'Once', 'max_tokens': 3, 'n': 2, 'temperature': 0})
        assert status == 200, status
        time.sleep(0.3)
    finally:
        code = srv.stop()
    assert code == 0, 'exit %r' % code
    log = ''.join(srv.log)
    said = [l for l in log.splitlines() if 'the list is empty' in l]
    assert len(said) == 1, 'the 400 is logged %d times: %r' % (len(said), said)
    done = [l for l in log.splitlines() if re.match(r'run: serve: cmpl-\d+ \d+ tokens in', l)]
    assert len(done) == 1 and done[0].endswith('(2 choices)') and ' 6 out' in done[0], 'the n: 2 request is logged as %r' % done


def test_prompt_ids():
    """"prompt" as token ids (and a list of one such list): the completion of
    the same tokens as text; several prompts, an empty list and an id out
    of the vocabulary are 400 naming the field."""
    srv = Server()
    try:
        ids = [1, 403, 407, 261, 378]  # "Once upon a time", BOS first, as -m tokenize gives them
        want = srv.post('/v1/completions', {'prompt': 'Once upon a time', 'max_tokens': 12, 'temperature': 0, 'echo': True})
        for prompt in (ids, [ids]):
            status, got = srv.post('/v1/completions', {'prompt': prompt, 'max_tokens': 12, 'temperature': 0, 'echo': True})
            assert status == 200 and got['choices'][0]['text'] == want[1]['choices'][0]['text'], (status, got, want)
            assert got['usage'] == want[1]['usage'], (got['usage'], want[1]['usage'])
        for prompt, words in (([], 'empty'), ([1, 512], 'outside'), ([1, 'a'], "'prompt'"), (['a', 3], 'each prompt'),
                              ([ids, [1, 512]], 'outside'), (['a'] * 17, '16 prompts at most'), ([[]], 'empty')):
            status, out = srv.post('/v1/completions', {'prompt': prompt})
            assert status == 400 and words in out['error']['message'] and 'prompt' in out['error']['message'], (prompt, out)
        status, out = srv.post('/v1/completions', {'prompt': ['a'] * 5, 'n': 4})
        assert status == 400 and '16 at most' in out['error']['message'], out
    finally:
        code = srv.stop()
    assert code == 0, 'exit %r' % code


def test_several_prompts():
    """A list of prompts (strings and token-id lists) in one completion:
    choice p * n + i is what prompt p alone gives as its choice i, text,
    echo, log-probabilities and seeds alike, streamed or not; usage counts
    each prompt once."""
    srv = Server('--parallel', '3')
    try:
        prompts = ['Once upon a time', [1, 403, 407, 261, 378], 'Lily went', 'The cat']
        base = {'max_tokens': 9, 'temperature': 1.0, 'seed': 7, 'n': 2, 'echo': True, 'logprobs': 2}
        alone = []
        for p in prompts:
            status, out = srv.post('/v1/completions', dict(base, prompt=p))
            assert status == 200, out
            alone.append(out)
        status, got = srv.post('/v1/completions', dict(base, prompt=prompts))
        assert status == 200, got
        want = [dict(c, index=p * 2 + c['index']) for p, out in enumerate(alone) for c in out['choices']]
        assert got['choices'] == want, (got['choices'], want)
        assert got['usage']['prompt_tokens'] == sum(o['usage']['prompt_tokens'] for o in alone), got['usage']
        assert got['usage']['completion_tokens'] == sum(o['usage']['completion_tokens'] for o in alone), got['usage']
        events, done = srv.stream('/v1/completions', dict(base, prompt=prompts, logprobs=None))
        streamed = {}
        for event in events:
            for c in event['choices']:
                streamed[c['index']] = streamed.get(c['index'], '') + c['text']
        assert done and streamed == {c['index']: c['text'] for c in want}, (streamed, want)
        return '%d prompts x n 2: %d choices, whole and streamed, equal to each prompt alone' % (len(prompts), len(want))
    finally:
        code = srv.stop()
        assert code == 0, 'exit %r' % code


def main():
    if not (os.path.exists(MODEL) and os.path.exists(TOK)):
        case('serve', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    srv = Server('--max-body-kb', '2', '--parallel', '16', '--max-conns', '64')
    try:
        case('serve_completions_equal_cli', lambda: test_completions(srv))
        case('serve_beams_equal_cli', lambda: test_beams(srv))
        case('serve_stream_equals_whole', lambda: test_stream(srv))
        case('serve_chat', lambda: test_chat(srv))
        case('serve_16_concurrent_equal_solo', lambda: test_concurrent(srv))
        case('serve_disconnect_cancels', lambda: test_disconnect(srv))
        case('serve_bad_requests', lambda: test_bad_requests(srv))
        case('serve_models_health_metrics', lambda: test_models_health(srv))
        case('serve_connection_limit_and_timeout', lambda: test_connection_limit(srv))
        case('serve_keep_alive', lambda: test_keep_alive(srv))
        case('serve_keep_alive_limits', lambda: test_keep_alive_limits(srv))
    finally:
        code = srv.stop()
    case('serve_sigterm_exit_0', lambda: (test_sigterm(), None)[1])
    case('serve_first_server_exit_0', lambda: (_ for _ in ()).throw(AssertionError('exit %r' % code)) if code != 0 else None)
    case('serve_api_key', test_api_key)
    case('serve_stop_default_replaced', test_stop_default)
    case('serve_errors_and_choices_logged_once', test_log_once)
    case('serve_prompt_as_token_ids', test_prompt_ids)
    case('serve_several_prompts', test_several_prompts)


if __name__ == '__main__':
    main()
    sys.exit(1 if COUNTS['FAIL'] else 0)
