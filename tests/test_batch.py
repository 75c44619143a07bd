#!/usr/bin/env python3
"""The batch mode (--batch) and the engine under it: every request of a batch
file gives, byte for byte, the JSON lines that `$RUN -f json` prints for it
alone with the same flags and seed (the solo runs are themselves checked
against the numpy references by test_reference.py and test_beam.py), whatever
--parallel, --kv-mb and the other requests; requests with a common prefix
share its cache blocks; bad batch files get a one-line error.

Environment: RUN, MODELS_DIR, TEST_TMP, as the other suites.
"""
import json
import os
import re
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

try:
    import numpy as np
    import test_reference as tr
except ImportError as e:
    print('FAIL test_batch: cannot import numpy or the reference writers: %s' % e)
    sys.exit(1)

RUN = os.environ.get('RUN', './run')
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
WORK = os.path.join(os.environ.get('TEST_TMP', os.path.join('tests', '.tmp')), 'batch')
STATS_RE = re.compile(r'stats: prompt (\d+) tokens, (\d+) reused')


def run(args, stdin=None):
    p = subprocess.run([RUN] + args, input=stdin, capture_output=True, timeout=300)
    return p.returncode, p.stdout.decode('utf-8', 'replace'), p.stderr.decode('utf-8', 'replace')


def solo_args(req, defaults):
    """The command-line flags that run one request alone."""
    o = dict(defaults)
    o.update(req)
    args = ['-i', o['prompt'], '-f', 'json']
    for field, flag in (('steps', '-n'), ('temperature', '-t'), ('top_p', '-p'), ('seed', '-s'),
                        ('beams', '-b'), ('length_penalty', '-l'), ('early_stopping', '-e'), ('return', '-r')):
        if field in o:
            args += [flag, str(o[field])]
    return args


def expected_lines(model, tok, reqs, defaults, default_args):
    """{id: the JSON lines of its solo run, each with "id" first}."""
    want = {}
    for i, req in enumerate(reqs):
        code, out, err = run([model, '-z', tok] + default_args + solo_args(req, defaults))
        assert code == 0, 'solo run of request %d failed: %s' % (i + 1, err.strip()[-200:])
        rid = req.get('id', i + 1)
        want[json.dumps(rid)] = ['{"id":%s,%s' % (json.dumps(rid, separators=(',', ':')), line[1:])
                                 for line in out.splitlines()]
    return want


def check_batch(model, tok, reqs, defaults, default_args, extra, want, ordered=False):
    path = os.path.join(WORK, 'requests.jsonl')
    with open(path, 'w') as f:
        for r in reqs:
            f.write(json.dumps(r) + '\n')
    code, out, err = run([model, '-z', tok] + default_args + ['--batch', path] + extra + (['--ordered'] if ordered else []))
    assert code == 0, 'exit %d: %s' % (code, err.strip()[-300:])
    got = {}
    order = []
    for line in out.splitlines():
        rid = json.dumps(json.loads(line)['id'])
        got.setdefault(rid, []).append(line)
        if not order or order[-1] != rid:
            order.append(rid)
    for rid, lines in want.items():
        assert got.get(rid) == lines, 'request %s differs from its solo run:\n got  %s\n want %s' % (
            rid, (got.get(rid) or ['nothing'])[0][:300], lines[0][:300])
    assert len(got) == len(want), 'extra ids in the output: %s' % sorted(set(got) - set(want))
    if ordered:
        assert order == list(want.keys()), 'not in input order: %s' % order
    return err


def stats_of(err):
    m = STATS_RE.search(err)
    assert m, 'no stats line in: %s' % err.strip()[-200:]
    return int(m.group(1)), int(m.group(2))


STORY = ('Once upon a time, there was a little girl named Lily. She loved to play outside in the park '
         'with her friends. One day, she saw a big red ball under a tall tree.')


def real_requests():
    return [
        {'prompt': 'Once upon a time', 'temperature': 0},
        {'prompt': 'Once upon a time', 'temperature': 1.0, 'seed': 42, 'id': 'seeded'},
        {'prompt': 'The little dog', 'temperature': 0.8, 'top_p': 0.9, 'seed': 7, 'steps': 120},
        {'prompt': 'Lily and Tom', 'temperature': 1.2, 'top_p': 0, 'seed': 99, 'steps': 30},
        {'prompt': STORY, 'temperature': 0, 'steps': 200, 'id': 5.5},
        {'prompt': 'One day', 'beams': 3, 'early_stopping': 0, 'steps': 60},
        {'prompt': 'One day', 'beams': 4, 'early_stopping': 1, 'return': 2, 'steps': 80, 'id': 'b4'},
        {'prompt': 'A cat', 'beams': 2, 'early_stopping': 'never', 'length_penalty': 0.5, 'steps': 50},
        {'prompt': 'He was', 'steps': 3, 'temperature': 0},            # ends after 1 token
        {'prompt': STORY, 'steps': 5},                                 # shorter than its prompt
        {'prompt': 'Sam had a', 'beams': 1, 'steps': 256},             # -b 1: greedy, stops at EOS
        {'prompt': 'Once upon a time', 'seed': 3, 'steps': 256, 'temperature': 1.0, 'top_p': 0.95},
    ]


def suite_real():
    model = os.path.join(MODELS_DIR, 'stories260K.bin')
    tok = os.path.join(MODELS_DIR, 'tok512.bin')
    if not (os.path.exists(model) and os.path.exists(tok)):
        case('batch_real', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    reqs = real_requests()
    defaults = {'steps': 100, 'seed': 11}
    default_args = ['-n', '100', '-s', '11']
    want = expected_lines(model, tok, reqs, defaults, default_args)
    for extra, name in ((['--parallel', '1'], 'parallel1'), (['--parallel', '3'], 'parallel3'),
                        ([], 'parallel_default'), (['--parallel', '64'], 'parallel64'),
                        (['--parallel', '8', '--kv-mb', '1'], 'kv_cap_waits')):
        case('batch_real_%s' % name, lambda extra=extra: check_batch(model, tok, reqs, defaults, default_args, extra, want))
    case('batch_real_ordered', lambda: check_batch(model, tok, reqs, defaults, default_args, ['--parallel', '5'], want, True))

    def stdin_batch():
        text = ''.join(json.dumps(r) + '\n' for r in reqs[:3])
        code, out, err = run([model, '-z', tok, '--batch', '-', '-n', '100', '-s', '11'], stdin=text.encode())
        assert code == 0, err
        assert len(out.splitlines()) == 3, out
    case('batch_real_stdin', stdin_batch)

    # prefix sharing: a long common preamble, different endings
    preamble = STORY + ' ' + STORY.replace('Lily', 'Anna')
    endings = ['Then', 'Later that day', 'The ball', 'Anna said', 'Suddenly', 'The sun', 'Tom', 'At night']
    shared = [{'prompt': preamble + ' ' + e, 'temperature': 0, 'steps': 160} for e in endings]

    want_shared = expected_lines(model, tok, shared, {}, [])

    def prefix(extra):
        err = check_batch(model, tok, shared, {}, [], extra, want_shared)
        computed, reused = stats_of(err)
        # the preamble's whole blocks of 16 positions, but for the last (its
        # last token may merge with the ending), are computed once
        blocks = (prompt_len(model, tok, preamble) - 1) // 16 - 1
        assert reused >= (len(shared) - 1) * blocks * 16, 'reused %d tokens, want >= %d' % (
            reused, (len(shared) - 1) * blocks * 16)
    case('batch_prefix_shared_together', lambda: prefix(['--parallel', '8']))
    case('batch_prefix_shared_one_after_another', lambda: prefix(['--parallel', '1']))


def prompt_len(model, tok, text):
    """Tokens of text (BOS included): the prompt tokens a lone run computes."""
    code, out, err = run([model, '-z', tok, '-f', 'json', '-i', text, '-t', '0', '-n', '0'])
    m = re.search(r'stats: prompt (\d+) tokens', err)
    assert m, err
    return int(m.group(1))


def suite_random():
    os.makedirs(WORK, exist_ok=True)
    pieces, scores = tr.make_tokenizer512()
    tok = os.path.join(WORK, 'tok512.bin')
    tr.write_tokenizer(tok, pieces, scores)
    reqs = [
        {'prompt': 'once upon a time', 'temperature': 0},
        {'prompt': 'the happy dog', 'seed': 5, 'temperature': 1.0, 'top_p': 0.9},
        {'prompt': 'hello world', 'beams': 3, 'steps': 40},
        {'prompt': 'she saw a big red ball', 'seed': 8, 'steps': 20},
        {'prompt': 'lily', 'beams': 2, 'early_stopping': 'never', 'return': 2, 'steps': 30},
    ]
    for name, (dim, hidden, L, H, KV), version in (('gqa_f32', (64, 96, 2, 8, 2), 1), ('mqa_int8', (64, 96, 2, 4, 1), 2),
                                                   ('mha_f32', (48, 64, 2, 4, 4), 1)):
        rng = np.random.default_rng(len(name))
        w = tr.random_weights(rng, dim, hidden, L, H, KV, 512, False)
        path = os.path.join(WORK, 'rand_%s.bin' % name)
        cfg = (dim, hidden, L, H, KV, 512)
        if version == 1:
            tr.write_v1(path, cfg, w, 128, False)
        else:
            tr.write_v2(path, cfg, w, 128, False, 32)

        def check(path=path):
            want = expected_lines(path, tok, reqs, {'steps': 64}, ['-n', '64'])
            for extra in (['--parallel', '2'], ['--parallel', '16']):
                check_batch(path, tok, reqs, {'steps': 64}, ['-n', '64'], extra, want)
        case('batch_random_%s' % name, check)


def suite_bad():
    model = os.path.join(MODELS_DIR, 'stories260K.bin')
    tok = os.path.join(MODELS_DIR, 'tok512.bin')
    if not (os.path.exists(model) and os.path.exists(tok)):
        case('batch_bad', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    path = os.path.join(WORK, 'bad.jsonl')

    def usage(text, want_in_error, name):
        def fn():
            with open(path, 'wb') as f:
                f.write(text)
            code, out, err = run([model, '-z', tok, '--batch', path])
            assert code == 2, 'exit %d, want 2 (%s)' % (code, err.strip()[-200:])
            assert out == '', 'something ran: %r' % out[:200]
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith('run: '), 'not one error line: %r' % err[:300]
            assert want_in_error in lines[0], '%r does not name %r' % (lines[0], want_in_error)
        case('batch_bad_%s' % name, fn)

    good = b'{"prompt":"Once"}\n'
    usage(good + b'not json\n', ':2:', 'not_json')
    usage(good + b'{"prompt":"a","colour":"red"}\n', "'colour'", 'unknown_field')
    usage(b'{"prompt":5}\n', "'prompt'", 'prompt_not_string')
    usage(good * 2 + b'{"prompt":"a","temperature":"hot"}\n', ':3: field \'temperature\'', 'wrong_type')
    usage(b'{"prompt":"a","top_p":1.5}\n', "'top_p'", 'out_of_range')
    usage(b'{"prompt":"a","steps":2.5}\n', "'steps'", 'not_integer')
    usage(b'{"prompt":"a","beams":2,"return":3}\n', "'return'", 'return_above_beams')
    usage(b'{"prompt":"a","early_stopping":2}\n', "'early_stopping'", 'early_stopping')
    usage(b'{"prompt":"a","prompt":"b"}\n', 'twice', 'duplicate')
    usage(b'{"temperature":0}\n', "'prompt'", 'missing_prompt')
    usage(b'{"prompt":"a","seed":[1]}\n', "'seed'", 'array_value')
    usage(b'{"prompt":"a\\q"}\n', 'escape', 'bad_escape')
    usage(b'{"prompt":"a"} x\n', 'after', 'trailing_text')
    usage(b'', 'no requests', 'empty_file')
    usage(b'\n  \n', 'no requests', 'blank_lines')
    usage(b'[1,2]\n', 'object', 'array_line')

    def file_error(target, want, name):
        def fn():
            code, out, err = run([model, '-z', tok, '--batch', target])
            assert code == 1 and want in err and len(err.strip().splitlines()) == 1, 'exit %d: %r' % (code, err[:300])
        case('batch_bad_%s' % name, fn)
    file_error(os.path.join(WORK, 'missing.jsonl'), 'cannot open', 'missing_file')
    file_error(WORK, 'directory', 'directory')

    def per_request(text, n_ok, name, extra=()):
        def fn():
            with open(path, 'wb') as f:
                f.write(text)
            code, out, err = run([model, '-z', tok, '--batch', path, '-n', '64'] + list(extra))
            lines = [json.loads(l) for l in out.splitlines()]
            errors = [l for l in lines if 'error' in l]
            assert code == 1, 'exit %d, want 1' % code
            assert len(errors) == 1 and len(lines) - 1 == n_ok, 'output: %r' % out[:400]
            assert 'failed' in err, err
        case('batch_bad_%s' % name, fn)
    huge = b'{"prompt":"' + b'Once upon a time ' * (10 * 1024 * 1024 // 17) + b'","id":"huge"}\n'
    per_request(good + huge + good, 2, 'ten_mb_line_too_long')
    per_request(good + b'{"prompt":"' + b'a b ' * 400 + b'"}\n' + good, 2, 'prompt_over_context')
    per_request(good + b'{"prompt":"big","steps":512,"beams":8}\n', 1, 'never_fits_kv_cap', ['--kv-mb', '1'])

    def text_format():
        with open(path, 'wb') as f:
            f.write(good)
        code, out, err = run([model, '-z', tok, '--batch', path, '-f', 'text'])
        assert code == 2 and 'json' in err, 'exit %d: %r' % (code, err[:200])
    case('batch_bad_text_format', text_format)


def main():
    os.makedirs(WORK, exist_ok=True)
    for suite in (suite_real, suite_random, suite_bad):
        try:
            suite()
        except Exception as e:
            case(suite.__name__, lambda e=e: (_ for _ in ()).throw(e))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
