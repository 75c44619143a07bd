#!/usr/bin/env python3
"""The key/value cache types (--kv-type f32|f16|q8_0):
  - `--kv-type f32` prints exactly what no flag prints (text and JSON);
  - f16 and q8_0 give, on stories260K, the greedy tokens of the numpy
    reference (tests/ref_kvcache.py, which stores K/V the same way), and JSON
    scores (sums of log-probabilities) within SCORE_REL_TOL of it (f32
    too, where it is 3e-7);
  - batch mode with each type gives each request's solo run, byte for byte;
  - --kv-mb counts the chosen type's bytes (more blocks fit in f16, q8_0);
  - bad values and a model whose kv dimension is not a multiple of 32 (q8_0)
    are usage errors (exit 2, one line);
  - --keep N (generation past the context with N attention sinks), with each
    type: a prompt of 303 tokens and 500 new ones on stories260K's 512
    positions (291 dropped) gives the reference's greedy tokens
    (ref_kvcache.greedy_keep, which renumbers positions by slot) and its
    score within SCORE_REL_TOL; until the cache is full the output is the
    run's without --keep, byte for byte (text, JSON, sampled); --batch with
    --keep (requests sharing their prompt's blocks, a cache too small for
    two) gives each request's solo run.

Environment: RUN, MODELS_DIR, TEST_TMP, as the other suites.
"""
import json
import os
import re
import struct
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

try:
    import numpy as np
    import ref_kvcache
    import ref_llama
    import test_batch as tb
except ImportError as e:
    print('FAIL test_kvcache: cannot import numpy or the references: %s' % e)
    sys.exit(1)

RUN = os.environ.get('RUN', './run')
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
WORK = os.path.join(os.environ.get('TEST_TMP', os.path.join('tests', '.tmp')), 'kvcache')
MODEL = os.path.join(MODELS_DIR, 'stories260K.bin')
TOK = os.path.join(MODELS_DIR, 'tok512.bin')
# run's JSON score (the sum of log-probabilities, 6 decimals) against the
# reference's, relative: float32 keys and values computed in another order
# differ in the last bits, which moves an element across a rounding boundary
# of f16 (2^-11 relative) or q8_0 (one step of the scale) now and then; one
# such flip shifted a 217-token score by 1.3e-4 of it (./runomp, f16), where
# the float32 cache stays within 3e-7. Greedy tokens must be equal.
SCORE_REL_TOL = 5e-4
STATS_RE = re.compile(r'stats: prompt \d+ tokens, \d+ reused, [\d.]+ tok/s; generated \d+ tokens, [\d.]+ tok/s, '
                      r'kv (\S+) ([\d.]+) MB peak')

STORY = ('Once upon a time, there was a little girl named Lily. She loved to play outside in the park '
         'with her friends. One day, she saw a big red ball under a tall tree.')
PROMPTS = ['Once upon a time', 'The little dog', STORY, '']


def run(args, stdin=None):
    p = subprocess.run([RUN] + args, input=stdin, capture_output=True, timeout=300)
    return p.returncode, p.stdout.decode('utf-8', 'replace'), p.stderr.decode('utf-8', 'replace')


def need_model():
    if not (os.path.exists(MODEL) and os.path.exists(TOK)):
        raise Skip('stories260K.bin or tok512.bin not in MODELS_DIR')


def f32_is_default():
    need_model()
    for prompt in PROMPTS:
        for extra in (['-t', '0'], ['-t', '1', '-s', '5'], ['-f', 'json', '-t', '0'], ['-b', '3', '-n', '80']):
            base = [MODEL, '-z', TOK, '-i', prompt] + extra
            a = run(base)
            b = run(base + ['--kv-type', 'f32'])
            assert a[0] == 0 and a[1] == b[1] and a[0] == b[0], '%r %r: output differs with --kv-type f32' % (prompt[:20], extra)


def against_reference(kv_type, steps):
    need_model()
    m = ref_llama.Model.load(MODEL)
    tok = ref_llama.Tokenizer.load(TOK, m.config.vocab_size)
    for prompt in PROMPTS:
        code, out, err = run([MODEL, '-z', TOK, '-t', '0', '-n', str(steps), '-i', prompt, '-f', 'json', '--kv-type', kv_type])
        assert code == 0, err
        got = json.loads(out.splitlines()[0])
        want, logprob = ref_kvcache.greedy(m, tok.encode(prompt.encode(), bos=True, eos=False), steps, kv_type)
        assert got['tokens'] == want, '%s %r: tokens %s, reference %s' % (kv_type, prompt[:20], got['tokens'][:40], want[:40])
        assert abs(got['score'] - logprob) <= SCORE_REL_TOL * abs(logprob) + 1e-5, '%s %r: score %.6f, reference %.6f' % (
            kv_type, prompt[:20], got['score'], logprob)
        m_stats = STATS_RE.search(err)
        assert m_stats and m_stats.group(1) == kv_type, 'stats line: %s' % err.strip()[-200:]


def batch_equals_solo(kv_type):
    need_model()
    reqs = tb.real_requests()
    defaults = {'steps': 100, 'seed': 11}
    default_args = ['-n', '100', '-s', '11', '--kv-type', kv_type]
    want = tb.expected_lines(MODEL, TOK, reqs, defaults, default_args)
    for extra in (['--parallel', '4'], ['--parallel', '8', '--kv-mb', '1']):
        tb.check_batch(MODEL, TOK, reqs, defaults, default_args, extra, want)


def kv_mb_counts_type_bytes():
    """Eight requests of 512 positions against a 1 MiB cap: the cache holds
    more blocks at once in f16 than in f32, and more again in q8_0; the peak
    never passes the cap."""
    need_model()
    path = os.path.join(WORK, 'cap.jsonl')
    with open(path, 'w') as f:
        for i in range(8):
            f.write(json.dumps({'prompt': 'Once upon a time %d' % i, 'temperature': 0, 'steps': 512}) + '\n')
    c = ref_llama.Model.load(MODEL).config
    row = {'f32': 4 * c.kv_dim, 'f16': 2 * c.kv_dim, 'q8_0': c.kv_dim + c.kv_dim // 32 * 4}
    blocks = {}
    for kv_type in ('f32', 'f16', 'q8_0'):
        code, out, err = run([MODEL, '-z', TOK, '--batch', path, '--parallel', '8', '--kv-mb', '1', '--kv-type', kv_type])
        assert code == 0, err
        m = STATS_RE.search(err)
        assert m and m.group(1) == kv_type, err.strip()[-200:]
        mb = float(m.group(2))
        assert mb <= 1048576 / 1e6 + 0.01, '%s: peak %.2f MB over the 1 MiB cap' % (kv_type, mb)
        blocks[kv_type] = mb * 1e6 / (2 * row[kv_type] * c.n_layers * 16)
    assert blocks['f32'] * 1.5 < blocks['f16'] < blocks['q8_0'], 'blocks held at peak: %s' % blocks


def write_legacy_checkpoint(path, dim, hidden, layers, heads, kv_heads, vocab, seq_len):
    """A llama2.c (version 0) checkpoint of small random weights."""
    rng = np.random.default_rng(1)
    hs, kv = dim // heads, dim // heads * kv_heads
    counts = [vocab * dim, layers * dim, layers * dim * dim, layers * kv * dim, layers * kv * dim,
              layers * dim * dim, layers * dim, layers * hidden * dim, layers * dim * hidden,
              layers * hidden * dim, dim, seq_len * hs // 2, seq_len * hs // 2]
    with open(path, 'wb') as f:
        f.write(struct.pack('7i', dim, hidden, layers, heads, kv_heads, vocab, seq_len))
        for n in counts:
            f.write((rng.standard_normal(n) * 0.1).astype(np.float32).tobytes())


def bad_input():
    need_model()
    for value in ('q4', '', 'F16', 'f16 '):
        code, out, err = run([MODEL, '-z', TOK, '--kv-type', value])
        assert code == 2 and len(err.strip().splitlines()) == 1 and '--kv-type' in err, '%r: exit %d %r' % (value, code, err)
    code, out, err = run([MODEL, '-z', TOK, '--kv-type'])
    assert code == 2 and '--kv-type' in err, 'no value: exit %d %r' % (code, err)
    path = os.path.join(WORK, 'kv48.bin')
    write_legacy_checkpoint(path, 48, 64, 1, 2, 2, 512, 32)  # kv_dim 48
    code, out, err = run([path, '-z', TOK, '--kv-type', 'q8_0', '-n', '8'])
    assert code == 2 and 'multiple of 32' in err and len(err.strip().splitlines()) == 1, 'kv_dim 48: exit %d %r' % (code, err)
    for kv_type in ('f32', 'f16'):
        code, out, err = run([path, '-z', TOK, '--kv-type', kv_type, '-n', '8'])
        assert code == 0, '%s on kv_dim 48: exit %d %r' % (kv_type, code, err)


# --keep: a prompt of 303 tokens (the first 600 bytes of the story) and 500
# new tokens. Greedy decoding on stories260K ends its story (BOS) after some
# 50 tokens, so BOS and EOS are barred for the 500 (--min-new-tokens).
with open(os.path.join(HERE, 'story_perplexity.txt')) as f:
    KEEP_PROMPT = f.read()[:600]
KEEP_STEPS, KEEP_NEW = 803, 500
# sinks per type: 4 (the usual), 0 (a plain sliding window) and 500 (a ring
# of 12 slots, which turns round 24 times)
KEEP_SINKS = {'f32': 4, 'f16': 0, 'q8_0': 500}
DROPPED_RE = re.compile(r'; (\d+) positions dropped \(--keep\)')


def keep_reference(kv_type):
    need_model()
    keep = KEEP_SINKS[kv_type]
    m = ref_llama.Model.load(MODEL)
    tok = ref_llama.Tokenizer.load(TOK, m.config.vocab_size)
    prompt = tok.encode(KEEP_PROMPT.encode(), bos=True, eos=False)
    code, out, err = run([MODEL, '-z', TOK, '-t', '0', '-n', str(KEEP_STEPS), '-i', KEEP_PROMPT, '-f', 'json', '--kv-type', kv_type,
                          '--keep', str(keep), '--min-new-tokens', str(KEEP_NEW)])
    assert code == 0, err
    got = json.loads(out.splitlines()[0])
    want, logprob, dropped = ref_kvcache.greedy_keep(m, prompt, KEEP_STEPS, kv_type, keep, KEEP_NEW)
    assert len(prompt) == 303 and dropped == KEEP_STEPS - m.config.seq_len, (len(prompt), dropped)
    assert got['tokens'] == want, '%s --keep %d: tokens differ from the reference at %d of %d' % (
        kv_type, keep, next((i for i, (a, b) in enumerate(zip(got['tokens'], want)) if a != b), min(len(want), len(got['tokens']))), len(want))
    assert abs(got['score'] - logprob) <= SCORE_REL_TOL * abs(logprob), '%s: score %.6f, reference %.6f' % (kv_type, got['score'], logprob)
    d = DROPPED_RE.search(err)
    assert d and int(d.group(1)) == dropped, 'stats line: %s' % err.strip()[-200:]


def keep_same_until_full(kv_type):
    """Until the cache is full, --keep changes nothing: a run that stops at
    the context prints exactly what it prints without --keep, and a run past
    it starts with that text."""
    need_model()
    new = 512 - 303 + 1  # the new tokens that fill the context
    for extra in (['-t', '0'], ['-t', '1', '-s', '7'], ['-t', '0', '-f', 'json']):
        base = [MODEL, '-z', TOK, '-i', KEEP_PROMPT, '--kv-type', kv_type, '--min-new-tokens', str(new)] + extra
        plain = run(base + ['-n', '512'])
        kept = run(base + ['-n', '512', '--keep', '4'])
        assert plain[0] == 0 and kept[0] == 0, plain[2] + kept[2]
        assert kept[1] == plain[1], '%s %s: -n 512 --keep 4 differs from -n 512' % (kv_type, extra)
        if '-f' in extra:
            continue
        past = run(base + ['-n', '700', '--keep', '4'])
        assert past[0] == 0, past[2]
        head = plain[1][:-1] if plain[1].endswith('\n') else plain[1]  # the line that ends the output
        assert past[1].startswith(head) and len(past[1]) > len(plain[1]), '%s %s: -n 700 --keep 4 does not start with -n 512' % (
            kv_type, extra)


def keep_batch_equals_solo(kv_type):
    """Three requests with the same long prompt (the later ones share its
    blocks, which each copies before its ring overwrites them) and a short
    one, past the context."""
    need_model()
    reqs = [{'prompt': KEEP_PROMPT, 'temperature': 1.0, 'seed': s, 'steps': 760} for s in (1, 2, 3)]
    reqs.append({'prompt': 'Once upon a time', 'temperature': 0, 'steps': 600})
    default_args = ['--keep', '4', '--kv-type', kv_type, '-n', '800', '--min-new-tokens', '400']
    want = tb.expected_lines(MODEL, TOK, reqs, {}, default_args)
    for extra in (['--parallel', '4'], ['--parallel', '4', '--kv-mb', '1']):
        tb.check_batch(MODEL, TOK, reqs, {}, default_args, extra, want)


def main():
    os.makedirs(WORK, exist_ok=True)
    os.makedirs(tb.WORK, exist_ok=True)
    case('kvcache_f32_is_default', f32_is_default)
    for kv_type in ('f32', 'f16', 'q8_0'):
        case('kvcache_%s_reference' % kv_type, lambda t=kv_type: against_reference(t, 256))
    for kv_type in ('f32', 'f16', 'q8_0'):
        case('kvcache_%s_batch_equals_solo' % kv_type, lambda t=kv_type: batch_equals_solo(t))
    case('kvcache_kv_mb_counts_type_bytes', kv_mb_counts_type_bytes)
    case('kvcache_bad_input', bad_input)
    for kv_type in ('f32', 'f16', 'q8_0'):
        case('kvcache_keep_%s_reference' % kv_type, lambda t=kv_type: keep_reference(t))
        case('kvcache_keep_%s_same_until_full' % kv_type, lambda t=kv_type: keep_same_until_full(t))
        case('kvcache_keep_%s_batch_equals_solo' % kv_type, lambda t=kv_type: keep_batch_equals_solo(t))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
