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
import select
import subprocess
import sys
import time

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

    def stops_from_command_line():
        # --stop on the command line is each line's default, and a line's
        # "stop" (a string or a list) replaces it, as any field given does;
        # each request equals its solo run with its own stop strings (a
        # refused line and a blank one between them take nothing with them)
        lines = [({'prompt': 'Once upon a time', 'temperature': 0}, ['--stop', 'the']),
                 ({'prompt': 'Once upon a time', 'temperature': 0, 'stop': 'girl', 'id': 'own'}, ['--stop', 'girl']),
                 ({'prompt': 'Lily and Tom', 'temperature': 1.0, 'seed': 5, 'stop': ['.', 'was'], 'id': 'list'},
                  ['--stop', '.', '--stop', 'was'])]
        want = {}
        for req, stops in lines:
            want.update(expected_lines(model, tok, [dict(req, id=req.get('id', 1))], {}, ['-n', '100'] + stops))
        path = os.path.join(WORK, 'stops.jsonl')
        with open(path, 'w') as f:
            f.write(json.dumps(lines[0][0]) + '\n{"prompt":"x","stop":"y","stop":"z"}\n  \n')
            f.write(''.join(json.dumps(req) + '\n' for req, _ in lines[1:]))
        code, out, err = run([model, '-z', tok, '-n', '100', '--stop', 'the', '--batch', path, '--ordered'])
        assert code == 1, 'exit %d (a line was refused: want 1): %s' % (code, err.strip()[-300:])
        got = out.splitlines()
        refusal = json.loads(got[1])
        assert sorted(refusal) == ['error', 'line'] and refusal['line'] == 2 and 'twice' in refusal['error'], got[1]
        assert [got[0]] + got[2:] == [line for lines_of in want.values() for line in lines_of], (got, want)
    case('batch_stop_from_command_line', stops_from_command_line)

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
    good_reqs = [{'prompt': 'Once upon a time', 'temperature': 0, 'steps': 40, 'id': 'g1'},
                 {'prompt': 'The little dog', 'seed': 5, 'steps': 50, 'id': 'g2'},
                 {'prompt': 'One day', 'beams': 2, 'steps': 30, 'id': 'g3'}]
    want = expected_lines(model, tok, good_reqs, {}, [])
    good = [json.dumps(r).encode() + b'\n' for r in good_reqs]

    def refused(bad, want_in_error, name, want_id=None):
        """good, bad, good, bad, good: each bad line refused alone (its line
        number, its id when read, the message on stdout and on stderr after
        path:N), the good ones as their solo runs; exit 1."""
        def fn():
            with open(path, 'wb') as f:
                f.write(good[0] + bad + b'\n' + good[1] + bad + b'\n' + good[2])
            code, out, err = run([model, '-z', tok, '--batch', path])
            assert code == 1, 'exit %d, want 1 (%s)' % (code, err.strip()[-200:])
            records = [json.loads(l) for l in out.splitlines()]
            errors = [r for r in records if 'error' in r]
            assert [e['line'] for e in errors] == [2, 4], 'error lines: %r' % errors
            for e in errors:
                assert want_in_error in e['error'], '%r does not name %r' % (e['error'], want_in_error)
                assert e.get('id') == want_id, 'id %r, want %r' % (e.get('id'), want_id)
                assert set(e) == ({'line', 'error', 'id'} if want_id is not None else {'line', 'error'}), e
                line = 'run: %s:%d: %s' % (path, e['line'], e['error'])
                assert line in err.splitlines(), 'stderr lacks %r: %r' % (line, err[:400])
            got = {}
            for l in out.splitlines():
                if 'error' not in json.loads(l):
                    got.setdefault(json.dumps(json.loads(l)['id']), []).append(l)
            assert got == want, 'the good lines differ from their solo runs:\n got  %r\n want %r' % (got, want)
            assert 'run: 2 of 5 lines refused' in err, err[-300:]
        case('batch_refused_%s' % name, fn)

    refused(b'not json', 'not a JSON object', 'not_json')
    refused(b'{"prompt":"a","colour":"red"}', "unknown field 'colour'", 'unknown_field')
    refused(b'{"id":"u","prompt":"a","colour":"red"}', "unknown field 'colour'", 'unknown_field_after_id', 'u')
    refused(b'{"prompt":"a","json":true}', "unknown field 'json' (did you mean 'response_format'?)", 'json_names_response_format')
    refused(b'{"prompt":"a","max_tokens":5}', "unknown field 'max_tokens' (did you mean 'max_new_tokens'?)",
            'max_tokens_names_max_new_tokens')
    refused(b'{"prompt":5}', "'prompt'", 'prompt_not_string')
    refused(b'{"prompt_ids":[]}', "field 'prompt_ids': an empty list", 'prompt_ids_empty')
    refused(b'{"prompt_ids":[1,512]}', "field 'prompt_ids': 512 is outside", 'prompt_ids_out_of_vocabulary')
    refused(b'{"prompt":"a","prompt_ids":[1]}', "both give the prompt", 'prompt_and_prompt_ids')

    def ids_equal_text():
        """a line's prompt_ids: the same answer as its text's tokens."""
        lines = [{'id': 't', 'prompt': 'Once upon a time', 'temperature': 0, 'steps': 40},
                 {'id': 'i', 'prompt_ids': [1, 403, 407, 261, 378], 'temperature': 0, 'steps': 40}]
        code, out, err = run([model, '-z', tok, '--batch', '-', '--ordered'],
                             stdin=''.join(json.dumps(x) + '\n' for x in lines).encode())
        assert code == 0, err[-300:]
        t, i = [json.loads(l) for l in out.splitlines()]
        assert (t['tokens'], t['text'], t['score']) == (i['tokens'], i['text'], i['score']), (t, i)
    case('batch_prompt_ids_equal_text', ids_equal_text)
    refused(b'{"id":7,"prompt":"a","temperature":"hot"}', "field 'temperature'", 'wrong_type', 7)
    refused(b'{"prompt":"a","top_p":1.5}', "'top_p'", 'out_of_range')
    refused(b'{"prompt":"a","steps":2.5}', "'steps'", 'not_integer')
    refused(b'{"prompt":"a","steps":-1}', "'steps'", 'negative')
    refused(b'{"prompt":"a","beams":2,"return":3}', "'return'", 'return_above_beams')
    refused(b'{"prompt":"a","beams":5}', "'beams'", 'beams_above_batch')
    refused(b'{"prompt":"a","early_stopping":2}', "'early_stopping'", 'early_stopping')
    refused(b'{"prompt":"a","prompt":"b"}', 'twice', 'duplicate')
    refused(b'{"temperature":0}', "'prompt'", 'missing_prompt')
    refused(b'{"prompt":"a","seed":[1]}', "'seed'", 'array_value')
    refused(b'{"stop":["x","y"],"prompt":"a","stop":"z"}', 'twice', 'stop_then_duplicate')
    refused(b'{"prompt":"a\\q"}', 'escape', 'bad_escape')
    refused(b'{"prompt":"a"} x', 'after', 'trailing_text')
    refused(b'[1,2]', 'object', 'array_line')
    refused(b'{"prompt":"a","min_new_tokens":9999}', "'min_new_tokens'", 'min_new_above_steps')

    def blank_input(text, name):
        def fn():
            with open(path, 'wb') as f:
                f.write(text)
            code, out, err = run([model, '-z', tok, '--batch', path])
            assert code == 0 and out == '', 'exit %d, out %r' % (code, out[:200])
            assert 'no requests' in err, err
        case('batch_empty_%s' % name, fn)
    blank_input(b'', 'file')
    blank_input(b'\n  \n\r\n', 'blank_lines')

    def blank_lines_skipped():
        # blank lines are skipped but counted: the bad line is line 4
        with open(path, 'wb') as f:
            f.write(b'\n' + good[0] + b'  \t\n' + b'oops\n\n' + good[1].rstrip(b'\n'))
        code, out, err = run([model, '-z', tok, '--batch', path, '--ordered'])
        records = [json.loads(l) for l in out.splitlines()]
        assert code == 1, code
        assert [r.get('line', r.get('id')) for r in records if r.get('rank', 1) == 1] == ['g1', 4, 'g2'], records
    case('batch_blank_lines_skipped_and_counted', blank_lines_skipped)

    def ordered_with_errors():
        lines = [b'bad 1', good[0].rstrip(b'\n'), b'{"prompt":"x","top_p":3}', b'{"prompt":"big","steps":512}',
                 good[2].rstrip(b'\n'), b'{"id":"last","prompt":1}', good[1].rstrip(b'\n'), b'{"prompt":"y","id":"end"']
        with open(path, 'wb') as f:
            f.write(b'\n'.join(lines) + b'\n')
        for parallel in ('1', '3'):
            code, out, err = run([model, '-z', tok, '--batch', path, '--ordered', '-n', '64', '--parallel', parallel])
            assert code == 1, code
            order = []
            for l in out.splitlines():
                r = json.loads(l)
                key = ('line', r['line']) if 'line' in r else ('id', r['id'])
                if not order or order[-1] != key:
                    order.append(key)
            assert order == [('line', 1), ('id', 'g1'), ('line', 3), ('id', 4), ('id', 'g3'), ('line', 6),
                             ('id', 'g2'), ('line', 8)], order
            for l in out.splitlines():
                r = json.loads(l)
                if r.get('id') in ('g1', 'g2', 'g3'):
                    assert l in want[json.dumps(r['id'])], 'request %s differs from its solo run' % r['id']
    case('batch_ordered_with_errors', ordered_with_errors)

    def exit_statuses():
        with open(path, 'wb') as f:
            f.write(b''.join(good))
        code, out, err = run([model, '-z', tok, '--batch', path])
        assert code == 0 and len(out.splitlines()) == 3, (code, err[-200:])
        for args, why in ((['-f', 'text'], 'json'), (['--parallel', '0'], 'parallel'), (['--colour'], 'colour')):
            code, out, err = run([model, '-z', tok, '--batch', path] + args)
            assert code == 2 and out == '' and why in err and len(err.strip().splitlines()) == 1, (args, code, err[:200])
    case('batch_exit_statuses', exit_statuses)

    def long_line():
        # 4 MB of spaces inside a good line: read whole, run as its solo run
        with open(path, 'wb') as f:
            f.write(good[1] + good[0].rstrip(b'}\n') + b' ' * (4 << 20) + b'}\n' + good[2])
        code, out, err = run([model, '-z', tok, '--batch', path, '--ordered'])
        assert code == 0, err[-200:]
        assert out.splitlines() == want['"g2"'] + want['"g1"'] + want['"g3"'], out[:300]
    case('batch_long_line', long_line)

    def unencodable_prompt():
        # a vocabulary without byte tokens (a GGUF file written by
        # tests/gguf_ref.py): a prompt byte it has no token for fails that
        # request alone; the lines around it run as alone
        import gguf_ref
        meta, tensors = gguf_ref.random_model(dim=32, ffn=64, n_layers=1, n_heads=2, n_kv_heads=1, vocab=40, vocab_meta=False)
        tokens = ['<unk>', '<s>', '</s>'] + ['\u2581' + c for c in 'abcdefghijklmnopq'] + list('abcdefghijklmnopqrst')
        meta.update({'tokenizer.ggml.model': 'llama', 'tokenizer.ggml.tokens': gguf_ref.Typed(gguf_ref.ARRAY, tokens, gguf_ref.STRING),
                     'tokenizer.ggml.scores': gguf_ref.Typed(gguf_ref.ARRAY, [0.0] * 3 + [-float(i) for i in range(37)], gguf_ref.FLOAT32),
                     'tokenizer.ggml.token_type': gguf_ref.Typed(gguf_ref.ARRAY, [2, 3, 3] + [1] * 37, gguf_ref.INT32)})
        gguf = os.path.join(WORK, 'nobytes.gguf')
        gguf_ref.write_gguf(gguf, meta, tensors)
        lines = [b'{"id":"a","prompt":"abc","steps":8,"temperature":0}\n', b'{"id":"x","prompt":"ab\xc3\xa9","steps":8}\n',
                 b'{"id":"b","prompt":"bad","steps":8,"temperature":0}\n']
        with open(path, 'wb') as f:
            f.write(b''.join(lines))
        code, out, err = run([gguf, '--batch', path, '--ordered'])
        got = out.splitlines()
        assert code == 1 and len(got) == 3, (code, out[:300], err[-300:])
        assert json.loads(got[1]) == {'id': 'x', 'error': 'the tokenizer has no token for a byte of the prompt'}, got[1]
        assert 'no token for the byte 0xC3' in err, err[-300:]
        for i, line in ((0, 0), (2, 2)):
            req = json.loads(lines[line])
            c, solo, e = run([gguf, '-i', req['prompt'], '-n', '8', '-t', '0', '-f', 'json'])
            assert c == 0 and json.dumps(dict(id=req['id'], **json.loads(solo)), separators=(',', ':')) == got[i], (got[i], solo)
    case('batch_unencodable_prompt_alone', unencodable_prompt)

    def file_error(target, want_text, name):
        def fn():
            code, out, err = run([model, '-z', tok, '--batch', target])
            assert code == 1 and want_text in err and len(err.strip().splitlines()) == 1, 'exit %d: %r' % (code, err[:300])
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
    g = good[0]
    huge = b'{"prompt":"' + b'Once upon a time ' * (10 * 1024 * 1024 // 17) + b'","id":"huge"}\n'
    per_request(g + huge + g, 2, 'ten_mb_line_too_long')
    per_request(g + b'{"prompt":"' + b'a b ' * 400 + b'"}\n' + g, 2, 'prompt_over_context')
    per_request(g + b'{"prompt":"big","steps":512,"beams":4}\n', 1, 'never_fits_kv_cap', ['--kv-mb', '1'])


def read_line_within(stream, seconds):
    """A line of stream, or None when none comes within `seconds`."""
    ready, _, _ = select.select([stream], [], [], seconds)
    return stream.readline() if ready else None


def suite_stream():
    model = os.path.join(MODELS_DIR, 'stories260K.bin')
    tok = os.path.join(MODELS_DIR, 'tok512.bin')
    if not (os.path.exists(model) and os.path.exists(tok)):
        case('batch_stream', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    reqs = [{'prompt': 'Once upon a time', 'temperature': 0, 'steps': 60, 'id': 's1'},
            {'prompt': 'The little dog', 'seed': 5, 'steps': 200, 'id': 's2'},
            {'prompt': 'One day', 'beams': 3, 'steps': 40, 'id': 's3'}]
    want = expected_lines(model, tok, reqs, {}, [])

    def pipe(extra):
        """A writer that sends a line and waits for its answer, with stdin
        held open; then a bad line, whose refusal comes at once too."""
        p = subprocess.Popen([RUN, model, '-z', tok, '--batch', '-'] + extra, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        latencies = []
        try:
            for r in reqs:
                t0 = time.monotonic()
                p.stdin.write(json.dumps(r).encode() + b'\n')
                p.stdin.flush()
                got = []
                while len(got) < len(want[json.dumps(r['id'])]):
                    line = read_line_within(p.stdout, 30)
                    assert line, 'no answer to %s within 30 s with stdin open' % r['id']
                    got.append(line.decode().rstrip('\n'))
                latencies.append(time.monotonic() - t0)
                assert got == want[json.dumps(r['id'])], 'request %s differs from its solo run: %r' % (r['id'], got[0][:200])
            p.stdin.write(b'{"prompt":"x","id":"b","steps":"many"}\n')
            p.stdin.flush()
            line = read_line_within(p.stdout, 30)
            assert line and json.loads(line) == {'line': 4, 'id': 'b', 'error': "field 'steps': must be an integer"}, line
            p.stdin.close()
            code = p.wait(timeout=60)
            err = p.stderr.read().decode()
            assert code == 1 and 'run: -:4: field \'steps\': must be an integer' in err, (code, err[-300:])
            assert p.stdout.read() == b''
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        print('# batch through a pipe %s: each answer %s ms after its line' % (
            ' '.join(extra) or '(unordered)', ', '.join('%.1f' % (1000 * t) for t in latencies)))
    case('batch_stream_pipe', lambda: pipe([]))
    case('batch_stream_pipe_ordered', lambda: pipe(['--ordered', '--parallel', '2']))

    def pipe_while_running():
        """A long request runs while a short one arrives: the short one's
        answer comes before the long one's (it was admitted mid-run)."""
        p = subprocess.Popen([RUN, model, '-z', tok, '--batch', '-', '--parallel', '2'], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            p.stdin.write(b'{"prompt":"Once","id":"long","steps":512,"temperature":0,"beams":4,"early_stopping":"never"}\n')
            p.stdin.flush()
            time.sleep(0.05)
            p.stdin.write(b'{"prompt":"Once","id":"short","steps":3}\n')
            p.stdin.flush()
            first = read_line_within(p.stdout, 60)
            assert first and json.loads(first)['id'] == 'short', first
            p.stdin.close()
            rest = p.stdout.read().decode().splitlines()
            assert p.wait(timeout=60) == 0 and rest and json.loads(rest[0])['id'] == 'long', rest[:1]
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    case('batch_stream_admits_while_running', pipe_while_running)


def main():
    os.makedirs(WORK, exist_ok=True)
    for suite in (suite_real, suite_random, suite_bad, suite_stream):
        try:
            suite()
        except Exception as e:
            case(suite.__name__, lambda e=e: (_ for _ in ()).throw(e))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
