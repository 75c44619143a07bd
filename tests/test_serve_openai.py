#!/usr/bin/env python3
"""-m serve spoken to by the official `openai` npm package under Node: a
completion, chat completion, both streamed, the model list and a refused
request, each text equal to the command line's (`-f json`). The package is
installed at test time into tests/.cache/openai (nothing global); without
node, npm or the registry the suite says SKIP.

Environment: RUN, MODELS_DIR, as the other suites.
"""
import json
import os
import shutil
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402
import test_serve as ts  # noqa: E402

PREFIX = os.path.join(HERE, '.cache', 'openai')


def install():
    if not shutil.which('node') or not shutil.which('npm'):
        raise Skip('node or npm not installed')
    if not os.path.isdir(os.path.join(PREFIX, 'node_modules', 'openai')):
        os.makedirs(PREFIX, exist_ok=True)
        try:
            p = subprocess.run(['npm', 'install', '--prefix', PREFIX, '--no-audit', '--no-fund', 'openai'],
                               capture_output=True, timeout=180)
        except subprocess.TimeoutExpired:
            raise Skip('npm install openai timed out (registry unreachable?)')
        if p.returncode != 0:
            raise Skip('npm install openai failed (registry unreachable?): %s' % p.stderr.decode()[-200:].strip())


def test_client():
    install()
    srv = ts.Server('--api-key', 'test-key')
    try:
        p = subprocess.run(['node', os.path.join(HERE, 'serve_openai_client.mjs'), 'http://127.0.0.1:%d/v1' % srv.port],
                           capture_output=True, timeout=120, env=dict(os.environ, OPENAI_PREFIX=PREFIX))
        assert p.returncode == 0, p.stderr.decode()[-400:]
        got = json.loads(p.stdout.decode().strip().splitlines()[-1])
    finally:
        code = srv.stop()
    want = ts.cli(['-i', 'Once upon a time', '--max-new-tokens', '30', '-t', '0'])['text']
    assert got['completion'] == want, (got['completion'], want)
    assert got['completion_streamed'] == want, got['completion_streamed']
    assert got['completion_finish'] == 'length' and got['usage']['completion_tokens'] == 30, got
    lily = ts.cli(['-i', 'Lily went', '--max-new-tokens', '12', '-t', '0'])
    once = ts.cli(['-i', 'Once upon a time', '--max-new-tokens', '12', '-t', '0'])
    assert got['several'] == [[0, once['text']], [1, once['text']], [2, lily['text']], [3, lily['text']]], got['several']
    assert got['several_usage']['completion_tokens'] == 48, got['several_usage']
    chat = ts.cli(['-m', 'chat', '-y', 'You are kind.', '-i', 'hi there', '--max-new-tokens', '30', '-t', '0'])['text']
    assert got['chat'] == chat and got['chat_role'] == 'assistant', (got['chat'], chat)
    assert got['chat_streamed'] == chat, got['chat_streamed']
    assert got['models'] == ['stories260K.bin'], got['models']
    assert got['bad'] == 400, got['bad']
    assert code == 0, 'the server exited with %r' % code


if __name__ == '__main__':
    if not (os.path.exists(ts.MODEL) and os.path.exists(ts.TOK)):
        case('serve_openai_npm', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
    else:
        case('serve_openai_npm', test_client)
    sys.exit(1 if COUNTS['FAIL'] else 0)
