#!/usr/bin/env python3
"""Every mode of run.c on a GGUF model (issue 33, "Every mode works on it").

stories260K.bin with tok512.bin (MODELS_DIR) is written to GGUF by export.py
with --encoding f32. F32 tensors are read in place and the vocabulary is the
same tokens, scores and byte pieces, so `./run model.gguf ARGS` (the file's
own vocabulary, no -z) must print exactly what `./run stories260K.bin -z
tok512.bin ARGS` prints, byte for byte, in every mode: greedy and sampled
generation (and both against the publisher's documented outputs in
tests/golden), JSON, beam search, the generation controls, --batch, chat,
perplexity, tokenize, --draft and --lookup, --kv-type, --keep past the context
and -m serve. The .bin side is itself checked against the numpy references by
the other suites; this suite checks that the GGUF path changes nothing.

Also: the exported GGUF and a vocabulary-only GGUF (`export.py tokenizer
tok512.bin`) given with -z as the vocabulary of the .bin; and the q8_0 export
in every mode (exit 0, sane output; its numbers differ, so no comparison).

Env: RUN, PYTHON, TEST_TMP, MODELS_DIR, EXPORT_PY. Derived files go to TEST_TMP
only. Prints PASS/FAIL/SKIP lines.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get('RUN', './run')
PY = os.environ.get('PYTHON') or sys.executable
MODELS = os.environ.get('MODELS_DIR', os.path.join(ROOT, '..', 'shared', 'models'))
EXPORT = os.environ.get('EXPORT_PY', os.path.join(ROOT, 'export.py'))
WORK = os.path.join(os.environ.get('TEST_TMP', os.path.join('tests', '.tmp')), 'gguf_modes')
BIN = os.path.join(MODELS, 'stories260K.bin')
TOK = os.path.join(MODELS, 'tok512.bin')
GGUF = os.path.join(WORK, 'stories260K-f32.gguf')
GGUF_Q8 = os.path.join(WORK, 'stories260K-q8_0.gguf')
VOCAB = os.path.join(WORK, 'tok512-vocab.gguf')
STORY = os.path.join(HERE, 'story_perplexity.txt')
with open(STORY, encoding='utf-8') as f:
    LONG_PROMPT = f.read()[:600]  # 303 tokens, as test_kvcache.py's --keep prompt

# The modes: (name, arguments after the model, stdin). Every run has a fixed
# seed (or -t 0) so that its output is a function of its arguments.
BATCH_LINES = [
    {'prompt': 'Once upon a time', 'temperature': 0, 'steps': 60},
    {'id': 'b', 'prompt': 'Lily and Tom', 'temperature': 1.0, 'seed': 5, 'steps': 50},
    {'prompt': 'The cat', 'beams': 3, 'return': 2, 'steps': 30},
    {'prompt': 'One day', 'temperature': 0.9, 'top_k': 20, 'repetition_penalty': 1.3, 'seed': 9, 'steps': 50},
    {'prompt': 'A big dog', 'temperature': 0.8, 'seed': 2, 'stop': ['.'], 'steps': 60},
]
BATCH_FILE = os.path.join(WORK, 'batch.jsonl')
# text with an apostrophe, quotes and characters outside the 512 tokens (byte pieces)
TOKENIZE = ['-m', 'tokenize', '-f', 'json', '-i', 'Once upon a time, Lily\'s cat said "hi" \u00e9\U0001F600!']
CHAT_STDIN = b'Hello there\nTell me a story about a cat\n'
MODES = [
    ('greedy', ['-t', '0'], None),
    ('sampled', ['-t', '1', '-p', '0.9', '-s', '133742'], None),
    ('prompt_json', ['-t', '0.8', '-s', '7', '-i', 'Once upon a time', '-n', '80', '-f', 'json'], None),
    ('beam', ['-b', '4', '-r', '2', '-i', 'Lily saw', '-n', '40'], None),
    ('beam_json', ['-b', '4', '-r', '2', '-i', 'Lily saw', '-n', '40', '-f', 'json'], None),
    ('top_k', ['-t', '1', '-s', '11', '--top-k', '5', '-n', '80'], None),
    ('min_p_repetition_penalty', ['-t', '0.9', '-s', '3', '--min-p', '0.05', '--repetition-penalty', '1.3',
                                  '--no-repeat-ngram-size', '3', '-n', '100', '-f', 'json'], None),
    ('stop', ['-t', '0', '--stop', 'park', '--stop', 'ball', '-f', 'json'], None),
    ('max_new_tokens', ['-t', '0', '-i', 'The sun', '--max-new-tokens', '17', '--min-new-tokens', '10'], None),
    ('batch', ['--batch', BATCH_FILE, '--parallel', '3', '-n', '64'], None),
    ('batch_ordered', ['--batch', BATCH_FILE, '--parallel', '3', '--ordered', '-n', '64'], None),
    ('chat', ['-m', 'chat', '-y', 'You are kind.', '-t', '0', '--max-new-tokens', '30'], CHAT_STDIN),
    ('chat_sampled', ['-m', 'chat', '-y', 'Be brief.', '-t', '1', '-s', '4', '--max-new-tokens', '25'], CHAT_STDIN),
    ('perplexity', ['-m', 'perplexity', '-I', STORY], None),
    ('perplexity_json', ['-m', 'perplexity', '-I', STORY, '-f', 'json'], None),
    ('tokenize', TOKENIZE, None),
    ('tokenize_text', ['-m', 'tokenize', '-i', 'A big, red ball.'], None),
    ('lookup2', ['-t', '0', '--lookup', '2', '-i', LONG_PROMPT[:200], '-n', '200'], None),
    ('lookup2_sampled', ['-t', '1', '-s', '21', '--lookup', '2', '-n', '150'], None),
    ('kv_f16', ['-t', '1', '-s', '5', '--kv-type', 'f16', '-f', 'json'], None),
    ('kv_q8_0', ['-t', '0', '--kv-type', 'q8_0', '-i', 'Tom had a', '-n', '200'], None),
    ('keep', ['-t', '0', '-i', LONG_PROMPT, '-n', '700', '--keep', '4', '--min-new-tokens', '400', '-f', 'json'], None),
    ('keep_q8_0', ['-t', '1', '-s', '8', '-i', LONG_PROMPT, '-n', '650', '--keep', '4', '--kv-type', 'q8_0',
                   '--min-new-tokens', '300'], None),
]


def sh(cmd, stdin=None, timeout=120):
    p = subprocess.run(cmd, input=stdin, capture_output=True, timeout=timeout,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr.decode('utf-8', 'replace')


def need_models():
    for path in (BIN, TOK):
        if not os.path.isfile(path):
            raise Skip('%s not found (set MODELS_DIR)' % path)


def export(args, out):
    """export.py ARGS written to `out` once; the one line why not as a FAIL."""
    need_models()
    if not os.path.isfile(out):
        os.makedirs(WORK, exist_ok=True)
        code, _, err = sh([PY, EXPORT] + args + [out], timeout=120)
        assert code == 0 and os.path.isfile(out), 'export.py %s: exit %d: %s' % (
            ' '.join(args), code, err.strip().splitlines()[-1:] if err.strip() else '')
    return out


def model_gguf():
    return export(['model', BIN, '--encoding', 'f32', '--tokenizer', TOK], GGUF)


def q8_gguf():
    return export(['model', BIN, '--encoding', 'q8_0', '--tokenizer', TOK], GGUF_Q8)


def first_difference(a, b):
    """'at byte N: .bin ... | .gguf ...' with a few bytes of context."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, n - 20)
    return 'lengths %d and %d, first difference at byte %d: .bin %r | .gguf %r' % (
        len(a), len(b), n, a[lo:n + 30], b[lo:n + 30])


def assert_same(name, want, got):
    """Two (exit, stdout, stderr) results with the same exit and stdout."""
    assert want[0] == 0, '%s: the .bin run exits %d: %s' % (name, want[0], want[2].strip()[-200:])
    assert got[0] == 0, '%s: the .gguf run exits %d: %s' % (name, got[0], got[2].strip()[-200:])
    assert want[1], '%s: no output' % name
    assert got[1] == want[1], '%s: %s' % (name, first_difference(want[1], got[1]))


def same_as_bin(name, args, stdin=None, model=None, bin_args=None):
    """`run GGUF args` prints what `run stories260K.bin -z tok512.bin args` prints."""
    model = model or model_gguf()
    want = sh([RUN, BIN, '-z', TOK] + (bin_args if bin_args is not None else args), stdin)
    got = sh([RUN, model] + args, stdin)
    assert_same(name, want, got)
    return got[1]


def golden(name, args, expected):
    out = same_as_bin(name, args)
    with open(os.path.join(HERE, 'golden', expected), 'rb') as f:
        want = f.read()
    assert out == want, '%s against tests/golden/%s (the publisher\'s): %s' % (name, expected, first_difference(want, out))


def write_batch():
    os.makedirs(WORK, exist_ok=True)
    with open(BATCH_FILE, 'w') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in BATCH_LINES))


def mode_case(name, args, stdin):
    if name == 'greedy':
        return golden(name, args, 'stories260K_greedy.txt')
    if name == 'sampled':
        return golden(name, args, 'stories260K_t1_p0.9_s133742.txt')
    same_as_bin(name, args, stdin)


def draft_cases():
    """--draft: the .gguf drafting for itself, for the .bin, and the .bin for
    the .gguf; each prints what the .bin alone prints."""
    g = model_gguf()
    for args in (['-t', '0', '-i', 'Once upon a time', '-n', '150'], ['-t', '1', '-s', '17', '-n', '150']):
        alone = sh([RUN, BIN, '-z', TOK] + args)
        assert_same('gguf drafting for itself %s' % args, alone, sh([RUN, g, '--draft', g] + args))
        assert_same('gguf drafting for the bin %s' % args, alone, sh([RUN, BIN, '-z', TOK, '--draft', g] + args))
        assert_same('bin drafting for the gguf %s' % args, alone, sh([RUN, g, '--draft', BIN] + args))


def vocab_from_model_gguf():
    """-z model.gguf: the .bin with the exported GGUF's vocabulary."""
    g = model_gguf()
    for name, args in (('greedy', ['-t', '0', '-i', 'Lily went']), ('tokenize', TOKENIZE)):
        assert_same('-z gguf %s' % name, sh([RUN, BIN, '-z', TOK] + args), sh([RUN, BIN, '-z', g] + args))


def vocab_only_gguf():
    """-z vocab.gguf (export.py tokenizer tok512.bin), and -m tokenize on it alone."""
    need_models()
    code, _, err = sh([PY, EXPORT, 'tokenizer', TOK, VOCAB])
    if code != 0:
        raise Skip('export.py tokenizer does not take tok512.bin: %s' % err.strip().splitlines()[-1:])
    for name, args in (('sampled', ['-t', '1', '-s', '5', '-i', 'Lily went', '-f', 'json']), ('tokenize', TOKENIZE)):
        assert_same('-z vocab.gguf %s' % name, sh([RUN, BIN, '-z', TOK] + args), sh([RUN, BIN, '-z', VOCAB] + args))
    args = TOKENIZE
    assert_same('vocab.gguf -m tokenize alone', sh([RUN, BIN, '-z', TOK] + args), sh([RUN, VOCAB] + args))


# -m serve ------------------------------------------------------------------

def start_server(cmd):
    """(process, port) of `cmd -m serve --port 0`, once it says where it listens."""
    proc = subprocess.Popen(cmd + ['-m', 'serve', '--port', '0', '--parallel', '2'],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log, deadline = [], time.time() + 30
    while time.time() < deadline:
        line = proc.stderr.readline().decode('utf-8', 'replace')
        if not line:
            break
        log.append(line)
        m = re.match(r'listening on http://[^:]+:(\d+)$', line.strip())
        if m:
            # keep reading stderr so that the server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, int(m.group(1))
    stop_server(proc)
    raise AssertionError('%s: no listening line: %s' % (cmd[1], ''.join(log)[-300:]))


def stop_server(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


def post(port, path, body):
    c = http.client.HTTPConnection('127.0.0.1', port, timeout=60)
    c.request('POST', path, body=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    r = c.getresponse()
    status, data = r.status, r.read()
    c.close()
    assert status == 200, '%s: status %d: %r' % (path, status, data[:200])
    return json.loads(data)


SERVE_REQUESTS = [
    ('/v1/completions', {'prompt': 'Once upon a time', 'max_tokens': 40, 'temperature': 0}),
    ('/v1/completions', {'prompt': 'Lily and Tom', 'max_tokens': 30, 'temperature': 1.0, 'seed': 42}),
    ('/v1/chat/completions', {'messages': [{'role': 'system', 'content': 'You are kind.'},
                                           {'role': 'user', 'content': 'Tell me a story.'}],
                              'max_tokens': 40, 'temperature': 0}),
]


def serve_answers(cmd):
    """What the server of `cmd` answers to SERVE_REQUESTS: the text, why it
    ended and the token counts (the id, time and model name differ)."""
    proc, port = start_server(cmd)
    try:
        out = []
        for path, req in SERVE_REQUESTS:
            choice = post(port, path, req)
            c = choice['choices'][0]
            out.append((c.get('text', c.get('message', {}).get('content')), c['finish_reason'], choice['usage']))
    finally:
        code = stop_server(proc)
    assert code == 0, '%s: SIGTERM ended the server with %s' % (cmd[1], code)
    return out


def serve_same():
    g = model_gguf()
    want = serve_answers([RUN, BIN, '-z', TOK])
    got = serve_answers([RUN, g])
    for (path, req), w, h in zip(SERVE_REQUESTS, want, got):
        assert w[0], '%s %r: empty text' % (path, req)
        assert h == w, '%s %r: the .gguf server %r, the .bin server %r' % (path, req, h, w)


# q8_0: every mode runs ----------------------------------------------------------

def sane(name, result, args):
    code, out, err = result
    assert code == 0, 'q8_0 %s: exit %d: %s' % (name, code, err.strip()[-200:])
    text = out.decode('utf-8')  # raises on bytes that are not UTF-8
    assert text.strip(), 'q8_0 %s: no output' % name
    if '-f' in args and 'json' in args or '--batch' in args:
        for line in text.strip().splitlines():
            json.loads(line)
    if name == 'greedy':
        assert text.startswith('Once upon a time'), 'q8_0 greedy: %r' % text[:80]


def q8_every_mode():
    q8 = q8_gguf()
    for name, args, stdin in MODES:
        sane(name, sh([RUN, q8] + args, stdin), args)
    sane('draft', sh([RUN, q8, '--draft', model_gguf(), '-t', '0', '-n', '100']), [])
    proc, port = start_server([RUN, q8])
    try:
        for path, req in SERVE_REQUESTS:
            choice = post(port, path, req)['choices'][0]
            assert choice.get('text', choice.get('message', {}).get('content')), 'q8_0 serve %s: empty' % path
    finally:
        assert stop_server(proc) == 0, 'q8_0 serve: SIGTERM did not end it with 0'


def main():
    if not (os.path.isfile(BIN) and os.path.isfile(TOK)):
        case('gguf_modes', lambda: (_ for _ in ()).throw(Skip('%s or %s not found (set MODELS_DIR)' % (BIN, TOK))))
        return 0
    os.makedirs(WORK, exist_ok=True)
    write_batch()
    started = time.time()
    for name, args, stdin in MODES:
        case('gguf_modes_%s' % name, lambda n=name, a=args, s=stdin: mode_case(n, a, s))
    case('gguf_modes_draft', draft_cases)
    case('gguf_modes_serve', serve_same)
    case('gguf_modes_vocab_from_model_gguf', vocab_from_model_gguf)
    case('gguf_modes_vocab_only_gguf', vocab_only_gguf)
    case('gguf_modes_q8_0_every_mode', q8_every_mode)
    print('# %.1f s' % (time.time() - started))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
