#!/usr/bin/env python3
"""The generation controls of issue 12 (`--min-new-tokens`,
`--repetition-penalty`, `--no-repeat-ngram-size`, `--top-k`, `--min-p`,
`--stop`) and `-m tokenize`, end to end through $RUN, against the numpy
references: tests/ref_beam.py (greedy and beam search, with the processors
and stop strings; checked against a literal transcription of the library's
control flow by tests/beam_selfcheck.py, run first here) and
tests/ref_controls.py (sampling with the warpers and stop strings), on
stories260K + tok512 and the synthetic model of tests/beam_synth.py (EOS
endings).  `-m tokenize` is checked against ref_llama.Tokenizer.

Comparison rules as in tests/test_beam.py (tokens, stop reasons and ranks
equal; scores within 1e-3 relative); the JSON line of a hypothesis ended by
a stop string also has "stop":"string" and "stop_string", and its text is cut
before the stop string.  Sampled text output must equal the reference's
bytes exactly (the reference draws with llama2.c's coin, in float32).

Environment: RUN, MODELS_DIR, TEST_TMP, PYTHON as for tests/test_beam.py.
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True

import test_beam as tb  # noqa: E402  (its helpers; its main() does not run)
from verdicts import COUNTS, case  # noqa: E402

STORIES, SYNTH = tb.STORIES, tb.SYNTH

# name, target, prompt, n, B, lp, e, r, controls (greedy when B = 1)
SEARCH_CASES = [
    ('greedy_repetition_penalty', STORIES, 'Once upon a time', 120, 1, '1', '0', 1, {'repetition_penalty': 1.3}),
    ('greedy_repetition_penalty_below_1', STORIES, 'Lily', 100, 1, '1', '0', 1, {'repetition_penalty': 0.8}),
    ('greedy_no_repeat_ngram_3', STORIES, 'Once upon a time', 200, 1, '1', '0', 1, {'no_repeat_ngram_size': 3}),
    ('greedy_min_new_tokens', STORIES, 'Lily', 0, 1, '1', '0', 1, {'min_new_tokens': 260}),
    ('greedy_stop', STORIES, 'Once upon a time', 200, 1, '1', '0', 1, {'stops': [b'play']}),
    ('beam4_repetition_penalty', STORIES, 'Lily', 0, 4, '1', '0', 2, {'repetition_penalty': 1.2}),
    ('beam3_no_repeat_ngram_2', STORIES, 'One day', 160, 3, '1', '0', 3, {'no_repeat_ngram_size': 2}),
    ('beam4_min_new_tokens', STORIES, 'One day', 0, 4, '1', '0', 4, {'min_new_tokens': 360}),
    ('beam3_stop', STORIES, 'Once upon a time', 120, 3, '1', '0', 3, {'stops': [b'Tim', b'!']}),
    ('beam4_all_processors_and_stop', STORIES, 'The cat', 0, 4, '2', 'never', 2,
     {'repetition_penalty': 1.1, 'no_repeat_ngram_size': 3, 'min_new_tokens': 40, 'stops': [b'park']}),
    ('beam2_stop_never_met', STORIES, 'Sue', 60, 2, '1', '1', 2, {'stops': [b'zebra']}),
    ('synth_beam3_min_new_tokens', SYNTH, 'a dog ran', 0, 3, '1', '0', 3, {'min_new_tokens': 6}),
    ('synth_beam5_penalty_ngram', SYNTH, 'the cat', 0, 5, '1', '0', 5,
     {'repetition_penalty': 1.5, 'no_repeat_ngram_size': 2}),
    ('synth_greedy_min_new_tokens', SYNTH, 'the cat', 0, 1, '1', '0', 1, {'min_new_tokens': 5}),
]

# name, prompt, n, temperature, top-p, seed, controls (stories260K)
SAMPLE_CASES = [
    ('top_k', 'Once upon a time', 200, '1.0', '0.9', 7, {'top_k': 10}),
    ('top_k_no_top_p', 'Lily', 150, '1.0', '0', 11, {'top_k': 3}),
    ('min_p', 'One day', 200, '0.8', '0', 5, {'min_p': 0.1}),
    ('top_k_top_p_min_p', 'The dog', 200, '1.2', '0.8', 21, {'top_k': 20, 'min_p': 0.05}),
    ('repetition_penalty_top_k', 'Once upon a time', 200, '1.0', '0.9', 3, {'repetition_penalty': 1.2, 'top_k': 40}),
    ('processors_only', 'Tom', 200, '1.0', '0.9', 9,
     {'repetition_penalty': 1.3, 'no_repeat_ngram_size': 2, 'min_new_tokens': 50}),
    ('stop_held_back', 'Once upon a time', 250, '1.0', '0.9', 42, {'stops': [b'.\nThe', b'happy']}),
    ('greedy_t0_stop_ngram', 'Lily', 250, '0', '0.9', 1, {'stops': [b'ball'], 'no_repeat_ngram_size': 4}),
]


def control_args(c):
    a = []
    if c.get('min_new_tokens'):
        a += ['--min-new-tokens', str(c['min_new_tokens'])]
    if c.get('repetition_penalty') is not None:
        a += ['--repetition-penalty', str(c['repetition_penalty'])]
    if c.get('no_repeat_ngram_size'):
        a += ['--no-repeat-ngram-size', str(c['no_repeat_ngram_size'])]
    if c.get('top_k'):
        a += ['--top-k', str(c['top_k'])]
    if c.get('min_p'):
        a += ['--min-p', str(c['min_p'])]
    for s in c.get('stops') or ():
        a += ['--stop', s.decode('utf-8')]
    return a


def run_ok(args):
    status, out, err = tb.run(args)
    if status != 0:
        raise AssertionError('exit status %d; stderr: %s' % (status, tb.short(err)))
    return out


def check_stop_fields(got, exp):
    for i, (g, x) in enumerate(zip(got, exp)):
        if x['stop'] == 'string':
            want = x['stop_string'].decode('utf-8')
            if g.get('stop_string') != want:
                raise AssertionError('line %d: stop_string %r, expected %r' % (i + 1, g.get('stop_string'), want))
        elif 'stop_string' in g:
            raise AssertionError('line %d: stop_string %r without a stop string' % (i + 1, g['stop_string']))


def search_case(target, prompt, n, B, lp, e, r, controls):
    def fn():
        target.ensure()
        tb.need_run()
        out = run_ok(tb.beam_args(target, prompt, n, B, lp, e, r) + control_args(controls))
        got = tb.parse_json_lines(out)
        import ref_beam
        m, tok = target.ref()
        exp, res = ref_beam.reference(m, tok, prompt.encode('utf-8'), n, B, float(lp),
                                      ref_beam.parse_early_stopping(e), r, controls=controls)
        info = {'min_margin': res.min_margin if res.min_margin != float('inf') else None,
                'margin_where': res.margin_where}
        # the case must show its control at work: without it the reference differs
        plain, _ = ref_beam.reference(m, tok, prompt.encode('utf-8'), n, B, float(lp),
                                      ref_beam.parse_early_stopping(e), r)
        differs = [d['tokens'] for d in plain] != [d['tokens'] for d in exp]
        if not differs and not controls.get('stops') == [b'zebra']:
            raise AssertionError('case does not exercise its controls: the reference gives the same tokens without them')
        tb.compare(got, exp, info, check_score=B > 1)
        check_stop_fields(got, exp)
    return fn


def sample_case(prompt, n, T, P, seed, controls, fmt):
    def fn():
        STORIES.ensure()
        tb.need_run()
        import ref_controls
        m, tok = STORIES.ref()
        base = [STORIES.model, '-z', STORIES.tok, '-i', prompt, '-n', str(n), '-t', T, '-p', P, '-s', str(seed)]
        exp_text, exp = ref_controls.generate(m, tok, prompt, n, float(T), float(P), seed, controls)
        plain_text, _ = ref_controls.generate(m, tok, prompt, n, float(T), float(P), seed, None)
        if plain_text == exp_text:
            raise AssertionError('case does not exercise its controls: the reference prints the same without them')
        if fmt == 'text':
            out = run_ok(base + control_args(controls))
            if out != exp_text:
                j = next((j for j, (a, b) in enumerate(zip(out, exp_text)) if a != b), min(len(out), len(exp_text)))
                raise AssertionError('stdout differs at byte %d: expected %r, got %r' % (
                    j, exp_text[max(0, j - 30):j + 30], out[max(0, j - 30):j + 30]))
            return
        got = tb.parse_json_lines(run_ok(base + control_args(controls) + ['-f', 'json']))
        if len(got) != 1:
            raise AssertionError('expected 1 JSON line, got %d' % len(got))
        g = got[0]
        if g['tokens'] != exp['tokens'] or g['stop'] != exp['stop']:
            raise AssertionError('tokens/stop differ: got %d tokens stop %s, expected %d tokens stop %s' % (
                len(g['tokens']), g['stop'], len(exp['tokens']), exp['stop']))
        if exp['text'] not in tb.text_candidates(g['text']):
            raise AssertionError('text %r, expected %r' % (g['text'][-60:], exp['text'][-60:]))
        if abs(g['score'] - exp['score']) > 1e-3 * abs(exp['score']) + 2e-6:
            raise AssertionError('score %r, expected %.6f' % (g['score'], exp['score']))
        check_stop_fields(got, [exp])
    return fn


def controls_off_case():
    """Every control given at its 'off' value: llama2.c's output, unchanged."""
    STORIES.ensure()
    tb.need_run()
    base = [STORIES.model, '-z', STORIES.tok, '-i', 'Once upon a time', '-n', '200', '-s', '17']
    a = run_ok(base)
    b = run_ok(base + ['--top-k', '0', '--min-p', '0', '--repetition-penalty', '1', '--no-repeat-ngram-size', '0',
                       '--min-new-tokens', '0'])
    if a != b:
        raise AssertionError('output changed with every control off')
    import ref_llama
    m, tok = STORIES.ref()
    exp = ref_llama.generate(m, tok, b'Once upon a time', 200, ref_llama.F32(1.0), ref_llama.F32(0.9), 17)
    if a != exp:
        raise AssertionError('output differs from the llama2.c reference')


def chat_stop_case():
    """A chat reply ended by a stop string: the reply's text stops before it,
    "stop":"string", and the chat goes on to the next turn."""
    STORIES.ensure()
    tb.need_run()
    args = [STORIES.model, '-z', STORIES.tok, '-m', 'chat', '-y', '', '-n', '400', '-t', '0', '-f', 'json',
            '--stop', 'the']
    p = subprocess.run([tb.RUN] + args, input=b'Once upon a time\nLily\n', stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=tb.RUN_TIMEOUT)
    if p.returncode != 0:
        raise AssertionError('exit status %d: %s' % (p.returncode, tb.short(p.stderr)))
    got = tb.parse_json_lines(p.stdout)
    if len(got) != 2:
        raise AssertionError('expected 2 replies, got %d' % len(got))
    m, tok = STORIES.ref()
    import ref_controls
    for g in got:
        if g['stop'] != 'string' or g.get('stop_string') != 'the':
            raise AssertionError('reply stop %r / %r, expected string / the' % (g['stop'], g.get('stop_string')))
        if 'the' in g['text']:
            raise AssertionError('the stop string is in the reply: %r' % g['text'])
        full = ref_controls.stop_checker(tok, 0, [b'the'])  # text of the tokens, after a non-BOS token
        if full(g['tokens']) != b'the':
            raise AssertionError('the reply tokens do not contain the stop string')
        if full(g['tokens'][:-1]) is not None:
            raise AssertionError('the reply goes past the token that completed the stop string')


def chat_processors_case():
    """Greedy chat replies with a repetition penalty and no-repeat n-grams,
    ended by a stop string (stories260K never says EOS): the processors see
    the whole conversation (the previous turn and reply included), so each
    reply is the reference's greedy continuation of the conversation's tokens
    (Llama 2 template; a reply ended by a stop string keeps its last token and
    is followed by EOS)."""
    STORIES.ensure()
    tb.need_run()
    import ref_beam
    m, tok = STORIES.ref()
    import ref_controls
    c = {'repetition_penalty': 1.5, 'no_repeat_ngram_size': 2, 'stops': [b'.']}
    n, users = 300, [b'Once upon a time', b'Lily']
    args = [STORIES.model, '-z', STORIES.tok, '-m', 'chat', '-y', '', '-n', str(n), '-t', '0', '-f', 'json'] + \
        control_args(c)
    p = subprocess.run([tb.RUN] + args, input=b'\n'.join(users) + b'\n', stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, timeout=tb.RUN_TIMEOUT)
    if p.returncode != 0:
        raise AssertionError('exit status %d: %s' % (p.returncode, tb.short(p.stderr)))
    got = tb.parse_json_lines(p.stdout)
    if len(got) != 2:
        raise AssertionError('expected 2 replies, got %d' % len(got))
    conversation = []
    for turn, user in enumerate(users):
        turn_tokens = tok.encode(b'[INST] ' + user + b' [/INST]', True, False)
        conversation += turn_tokens
        mx = ref_beam.max_new_tokens(n, m.config.seq_len, len(conversation))
        stop_fn = ref_controls.stop_checker(tok, conversation[-1], c['stops'])
        res = ref_beam.greedy(ref_beam.LlamaBatchStepper(m), conversation, mx, controls=c, stop_fn=stop_fn)
        exp = res.hyps[0]
        if turn == 1:
            alone = ref_beam.greedy(ref_beam.LlamaBatchStepper(m), turn_tokens, mx, controls=c,
                                    stop_fn=stop_fn).hyps[0]
            if alone.tokens == exp.tokens:
                raise AssertionError('case does not tell the conversation from the turn alone')
        if got[turn]['tokens'] != exp.tokens or got[turn]['stop'] != exp.stop:
            raise AssertionError('turn %d: got %d tokens stop %s, expected %d tokens stop %s' % (
                turn + 1, len(got[turn]['tokens']), got[turn]['stop'], len(exp.tokens), exp.stop))
        conversation += exp.tokens + [1 if exp.stop == 'bos' else 2]


def tokenize_case(target, prompt):
    def fn():
        target.ensure()
        tb.need_run()
        m, tok = target.ref()
        ids = tok.encode(prompt.encode('utf-8'), True, False)

        def piece(i):
            return {1: b'<s>', 2: b'</s>'}.get(i, tok.cvocab[i])
        out = run_ok([target.model, '-z', target.tok, '-i', prompt, '-m', 'tokenize'])
        exp = b''.join(b"%6d -> '%s'\n" % (i, piece(i)) for i in ids)
        if out != exp:
            raise AssertionError('text output %r, expected %r' % (out[:200], exp[:200]))
        got = tb.parse_json_lines(run_ok([target.model, '-z', target.tok, '-i', prompt, '-m', 'tokenize', '-f', 'json']))
        if len(got) != 1 or got[0].get('tokens') != ids:
            raise AssertionError('JSON tokens %r, expected %r' % (got[0].get('tokens') if got else None, ids))
        pieces = got[0].get('pieces')
        if not isinstance(pieces, list) or len(pieces) != len(ids) or \
                any(piece(i) not in tb.text_candidates(p) for i, p in zip(ids, pieces)):
            raise AssertionError('JSON pieces %r' % pieces)
    return fn


def usage_case(args_tail):
    def fn():
        STORIES.ensure()
        tb.need_run()
        status, out, err = tb.run([STORIES.model, '-z', STORIES.tok, '-i', 'Once', '-n', '16'] + args_tail)
        if status != 2 or out.strip():
            raise AssertionError('exit status %d (expected 2), stdout %r, stderr %r' % (status, out[:80], err[:120]))
    return fn


def main():
    import beam_selfcheck

    def selfcheck():
        cnt, bad = beam_selfcheck.compare_toy(200, seed=4321, with_controls=True)
        assert not bad, '%d of %d toy configs with controls differ between ref_beam and the literal HF ' \
                        'transcription; first: %s' % (len(bad), cnt, bad[0])
    case('controls_selfcheck_toy_vs_literal_hf', selfcheck)
    for (name, target, prompt, n, B, lp, e, r, c) in SEARCH_CASES:
        case('controls_' + name, search_case(target, prompt, n, B, lp, e, r, c))
    for (name, prompt, n, T, P, seed, c) in SAMPLE_CASES:
        case('controls_sample_' + name, sample_case(prompt, n, T, P, seed, c, 'text'))
    case('controls_sample_json_top_k_stop', sample_case('Lily', 200, '1.0', '0.9', 8,
                                                        {'top_k': 5, 'stops': [b'her']}, 'json'))
    case('controls_sample_json_processors', sample_case('One day', 150, '0.9', '0.95', 13,
                                                        {'repetition_penalty': 1.4, 'min_p': 0.02}, 'json'))
    case('controls_all_off_is_llama2c', controls_off_case)
    case('controls_chat_stop_string', chat_stop_case)
    case('controls_chat_processors_see_the_conversation', chat_processors_case)
    case('tokenize_stories', tokenize_case(STORIES, 'Once upon a time, Lily said "hi!"\n'))
    case('tokenize_empty_prompt', tokenize_case(STORIES, ''))
    case('tokenize_utf8_byte_fallback', tokenize_case(STORIES, 'héllo ☃ 日本'))
    case('tokenize_synth', tokenize_case(SYNTH, 'the cat ran'))
    for name, tail in [('top_k_above_vocab', ['--top-k', '513']), ('top_k_negative', ['--top-k', '-1']),
                       ('min_new_tokens_above_steps', ['--min-new-tokens', '17']),
                       ('repetition_penalty_zero', ['--repetition-penalty', '0']),
                       ('min_p_above_1', ['--min-p', '1.5']), ('stop_empty', ['--stop', '']),
                       ('ngram_abc', ['--no-repeat-ngram-size', 'abc']), ('stop_missing_value', ['--stop'])]:
        case('controls_usage_' + name, usage_case(tail))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
