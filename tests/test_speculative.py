#!/usr/bin/env python3
"""Speculative decoding (--draft FILE, --lookup N, --draft-max K): the output
is byte for byte that of the same command without speculation (text, JSON
with its scores, chat, the generation controls, --batch), on many prompts
and -n values, with a draft that is almost always right (the int8 export of
the model), one that is almost always wrong (random weights, same
vocabulary) and prompt lookup of N = 1..4; greedy (-t 0), and sampled with
a seed (each token is drawn with the random number the plain run draws for
it). The plain runs it is compared with are themselves checked against the
numpy reference by test_reference.py, test_controls.py and test_batch.py.
Bad input gets a one-line error.

Environment: RUN, MODELS_DIR, TEST_TMP, PYTHON, as the other suites;
./runomp (vector kernels, threads) is checked too when it is built.
"""
import os
import re
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get('RUN', './run')
RUNOMP = './runomp' if os.path.exists('./runomp') and os.path.realpath(RUN) != os.path.realpath('./runomp') else None
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
PYTHON = os.environ.get('PYTHON', sys.executable)
WORK = os.path.join(os.environ.get('TEST_TMP', os.path.join('tests', '.tmp')), 'speculative')
MODEL = os.path.join(MODELS_DIR, 'stories260K.bin')
TOK = os.path.join(MODELS_DIR, 'tok512.bin')
Q8 = os.path.join(WORK, 'stories260K_q8.bin')
RANDOM = os.path.join(WORK, 'random_512.bin')
OTHER_VOCAB = os.path.join(WORK, 'random_300.bin')
BROKEN = os.path.join(WORK, 'broken.bin')
STATS_RE = re.compile(r'^stats: prompt \d+ tokens, \d+ reused, [0-9.]+ tok/s; generated (\d+) tokens, [0-9.]+ tok/s'
                      r'; drafted (\d+), accepted (\d+) \(([0-9.]+) tokens per target pass\)'
                      r', kv \S+ [0-9.]+ MB peak$', re.M)

PROMPTS = ['', 'a', 'Once upon a time', 'Lily and Tom',
           'The cat sat on the mat. The cat sat on the mat. The cat sat on the',
           'One day, a little girl named Lily went to the park. She saw a big tree. One day, a little girl']
STEPS = ['3', '12', '60', '200', '500', '512', '0']


def run(args, stdin=None, binary=None):
    p = subprocess.run([binary or RUN] + args, input=stdin, capture_output=True, timeout=300)
    return p.returncode, p.stdout, p.stderr.decode('utf-8', 'replace')


def export(args):
    p = subprocess.run([PYTHON, 'export.py'] + args, capture_output=True, timeout=300)
    assert p.returncode == 0, 'export.py %s: %s' % (' '.join(args), p.stderr.decode()[-300:])


def sources():
    named = {'lookup%d' % n: ['--lookup', str(n)] for n in (1, 2, 3, 4)}
    named.update({
        'draft_q8': ['--draft', Q8], 'draft_random': ['--draft', RANDOM],
        'lookup2_max1': ['--lookup', '2', '--draft-max', '1'], 'draft_q8_max3': ['--draft', Q8, '--draft-max', '3']})
    return named


def same_as_greedy(base, names, runs=None, binary=None):
    """Every source of drafts gives what `base` gives without them."""
    code, want, err = run(base, binary=binary)
    assert code == 0, 'plain run failed: %s' % err.strip()[-200:]
    for name in names:
        extra = sources()[name]
        code, got, err = run(base + extra, binary=binary)
        assert code == 0, '%s failed: %s' % (name, err.strip()[-200:])
        assert got == want, '%s differs from plain greedy with %s:\n got  %r\n want %r' % (
            name, ' '.join(base[2:]), got[-200:], want[-200:])
        m = STATS_RE.search(err)
        assert m, '%s: no speculation stats line in %r' % (name, err[-300:])
        if runs is not None:
            runs.append((name, int(m.group(2)), int(m.group(3))))
    return want


def generate_case(fmt):
    def check():
        runs = []
        for prompt in PROMPTS:
            for steps in STEPS:
                same_as_greedy([MODEL, '-z', TOK, '-t', '0', '-n', steps, '-i', prompt] + fmt, sources(), runs)
        drafted = {}
        for name, d, a in runs:
            assert 0 <= a <= d, '%s: accepted %d of %d drafted' % (name, a, d)
            dd, aa = drafted.get(name, (0, 0))
            drafted[name] = (dd + d, aa + a)
        d, a = drafted['draft_q8']
        assert a >= 0.8 * d, 'the int8 draft had only %d of %d drafts accepted' % (a, d)
        d, a = drafted['draft_random']
        assert d > 0 and a < 0.2 * d, 'the random draft had %d of %d drafts accepted' % (a, d)
        assert drafted['lookup2'][0] > 0 and drafted['lookup2'][1] > 0, 'lookup drafted or accepted nothing'
    return check


def controls_case():
    all_sources = sources()
    for extra in (['--repetition-penalty', '1.3'], ['--no-repeat-ngram-size', '3'], ['--stop', 'park'],
                  ['--min-new-tokens', '150', '--stop', '.'], ['--max-new-tokens', '17'], ['--top-k', '5'],
                  ['--stop', 'Lily', '-f', 'json']):
        for prompt in PROMPTS[2:]:
            same_as_greedy([MODEL, '-z', TOK, '-t', '0', '-n', '300', '-i', prompt] + extra, all_sources)


def chat_case():
    lines = b'Hello there\nTell me a story about a cat\nAnd another one\n'
    for fmt in ([], ['-f', 'json']):
        for steps in ('0', '120'):
            same_as_greedy([MODEL, '-z', TOK, '-t', '0', '-m', 'chat', '-y', 'You tell stories.', '-n', steps] + fmt,
                           ['lookup1', 'lookup3', 'draft_q8', 'draft_random'])
            base = [MODEL, '-z', TOK, '-t', '0', '-m', 'chat', '-y', '', '-n', steps] + fmt
            code, want, err = run(base, lines)
            assert code == 0, err[-200:]
            for name in ('lookup2', 'draft_q8', 'draft_random'):
                code, got, err = run(base + sources()[name], lines)
                assert code == 0 and got == want, 'chat with %s differs:\n got  %r\n want %r' % (name, got[-200:], want[-200:])


def int8_target_case():
    """The int8 model as the target: its many-row kernels give each row what one row alone gets."""
    for prompt in PROMPTS[2:]:
        for steps in ('100', '512'):
            code, want, err = run([Q8, '-z', TOK, '-t', '0', '-n', steps, '-i', prompt])
            assert code == 0, err[-200:]
            for extra in (['--lookup', '1'], ['--lookup', '3'], ['--draft', MODEL], ['--draft', RANDOM]):
                code, got, err = run([Q8, '-z', TOK, '-t', '0', '-n', steps, '-i', prompt] + extra)
                assert code == 0 and got == want, 'int8 target with %s differs' % ' '.join(extra)


SAMPLINGS = [['-t', '0.8', '-s', '7'], ['-t', '1', '-p', '0.9', '-s', '3', '-f', 'json'],
             ['-t', '0.5', '-p', '1', '-s', '11', '--top-k', '20', '--stop', 'park']]


def sampled_case(binary, prompts, samplings):
    """-t > 0 with a seed: every token is the plain run's draw."""
    def check():
        runs = []
        for prompt in prompts:
            for sampling in samplings:
                for steps in ('40', '300'):
                    same_as_greedy([MODEL, '-z', TOK, '-n', steps, '-i', prompt] + sampling,
                                   ['lookup1', 'lookup3', 'draft_q8', 'draft_random'], runs, binary)
        accepted = sum(a for name, d, a in runs if name == 'draft_q8')
        assert accepted > 0, 'no sampled draft of the int8 model was accepted'
    return check


BATCH_LINES = [
    '{"prompt":"Once upon a time","steps":200,"temperature":0}',
    '{"prompt":"Lily and Tom","steps":120,"temperature":0.8,"seed":5}',
    '{"prompt":"The cat sat on the mat. The cat sat on the mat. The cat sat on the","steps":300,"temperature":0}',
    '{"prompt":"Hi","beams":3,"steps":40,"return":2}',
    '{"id":"x","prompt":"","steps":60,"temperature":1.0,"top_p":0.9,"seed":11}',
    '{"prompt":"One day","steps":512,"temperature":0,"stop":["park"]}',
    '{"prompt":"Once upon a time","steps":90,"temperature":0,"repetition_penalty":1.3}',
    '{"prompt":"Tom had a red ball","steps":0,"temperature":0}',
]


def batch_case(binary, parallels):
    """--batch: every request (greedy, sampled, beam search: which does not
    speculate) as without speculation, however many run at once."""
    def check():
        path = os.path.join(WORK, 'batch.jsonl')
        with open(path, 'w') as f:
            f.write('\n'.join(BATCH_LINES) + '\n')
        for parallel in parallels:
            same_as_greedy([MODEL, '-z', TOK, '--batch', path, '--ordered', '--parallel', parallel],
                           ['lookup1', 'lookup3', 'draft_q8', 'draft_random', 'draft_q8_max3'], None, binary)
    return check


def bad_input_case():
    cases = [
        (['--draft', OTHER_VOCAB, '-t', '0'], 1, 'the draft\'s vocabulary has 300 tokens, the model\'s 512'),
        (['--draft', BROKEN, '-t', '0'], 1, BROKEN),
        (['--draft', os.path.join(WORK, 'missing.bin'), '-t', '0'], 1, 'missing.bin'),
        (['--lookup', '0', '-t', '0'], 2, '--lookup'),
        (['--lookup', '-1', '-t', '0'], 2, '--lookup'),
        (['--lookup', 'x', '-t', '0'], 2, '--lookup'),
        (['--lookup', '2', '--draft-max', '0', '-t', '0'], 2, '--draft-max'),
        (['--draft', Q8, '-t', '0', '-b', '2'], 2, 'beam'),
        (['--draft', Q8, '-t', '0', '--batch', os.path.join(WORK, 'missing.jsonl')], 1, 'missing.jsonl'),
        (['--draft', Q8, '--lookup', '2', '-t', '0'], 2, 'use one'),
        (['--lookup', '2', '-t', '0', '-m', 'perplexity'], 2, 'generate, chat and --batch'),
        (['--lookup', '2', '-m', 'serve'], 2, 'generate, chat and --batch'),
        (['--draft'], 2, 'needs a value'),
    ]
    for extra, status, words in cases:
        code, out, err = run([MODEL, '-z', TOK, '-i', 'Hi'] + extra)
        assert code == status, '%s: exit %d, wanted %d (%s)' % (' '.join(extra), code, status, err.strip())
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith('run: ') and words in lines[0], \
            '%s: stderr %r' % (' '.join(extra), err)


def main():
    if not (os.path.exists(MODEL) and os.path.exists(TOK)):
        case('speculative', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    os.makedirs(WORK, exist_ok=True)
    export(['model', MODEL, Q8, '--version', '2', '--group-size', '4'])
    export(['random', RANDOM, '--shape', 'tiny=32,64,2,4,4,512,512', '--seed', '3', '--version', '1'])
    export(['random', OTHER_VOCAB, '--shape', 'tiny=32,64,2,4,4,300,512', '--seed', '3', '--version', '1'])
    with open(BROKEN, 'wb') as f:
        f.write(open(Q8, 'rb').read()[:1000])
    case('speculative_generate_text', generate_case([]))
    case('speculative_generate_json', generate_case(['-f', 'json']))
    case('speculative_controls', controls_case)
    case('speculative_chat', chat_case)
    case('speculative_int8_target', int8_target_case)
    case('speculative_sampled', sampled_case(None, PROMPTS[1:], SAMPLINGS))
    case('speculative_batch', batch_case(None, ('1', '3', '8')))
    if RUNOMP:
        case('speculative_runomp_generate', lambda: [same_as_greedy(
            [MODEL, '-z', TOK, '-t', '0', '-n', steps, '-i', prompt, '-f', 'json'], sources(), None, RUNOMP)
            for prompt in PROMPTS[3:] for steps in ('60', '512')])
        case('speculative_runomp_sampled', sampled_case(RUNOMP, PROMPTS[3:], SAMPLINGS[1:2]))
        case('speculative_runomp_batch', batch_case(RUNOMP, ('4',)))
    else:
        case('speculative_runomp', lambda: (_ for _ in ()).throw(Skip('./runomp not built')))
    case('speculative_bad_input', bad_input_case)


if __name__ == '__main__':
    main()
    sys.exit(1 if COUNTS['FAIL'] else 0)
