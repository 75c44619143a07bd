#!/usr/bin/env python3
"""-m serve's choices and log-probabilities, asked through the official
`openai` npm package (installed as test_serve_openai.py installs it):
completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset)
add up to the command line's JSON score (`-f json`, greedy and sampled, with
a logits processor); echo with logprobs and max_tokens 0 scores the prompt,
the mean being minus -m perplexity's nll (`-m perplexity -f json`) over the
same tokens; chat's logprobs.content (token, logprob, bytes, top_logprobs)
add up to the chat's JSON score; n choices at temperature 0 are identical
and equal the command line's text, n sampled choices with a seed are
reproducible and choice i is the command line's text with seed + i, also
streamed (each chunk under its choice's index); out-of-range values get
400 naming the field. Without node or npm the suite says SKIP.

Environment: RUN, MODELS_DIR, as the other suites.
"""
import json
import math
import os
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402
import test_serve as ts  # noqa: E402
import test_serve_openai as tso  # noqa: E402

PROMPTS = ['Once upon a time', 'Lily and Tom went to the park', 'The cat']
# the score the command line prints has 6 decimals
SCORE_TOLERANCE = 1e-6


def client(srv, requests):
    """What the openai client got for each {endpoint, body}."""
    p = subprocess.run(['node', os.path.join(HERE, 'serve_logprobs_client.mjs'), 'http://127.0.0.1:%d/v1' % srv.port],
                       input=json.dumps(requests).encode(), capture_output=True, timeout=300,
                       env=dict(os.environ, OPENAI_PREFIX=tso.PREFIX))
    assert p.returncode == 0, p.stderr.decode()[-400:]
    return json.loads(p.stdout.decode().strip().splitlines()[-1])


def completion(srv, **body):
    got = client(srv, [{'endpoint': 'completions', 'body': body}])[0]
    assert 'response' in got, (body, got)
    return got['response']


def check_legacy_logprobs(lp, k, text):
    """The shape of a completions logprobs object; returns its token count."""
    n = len(lp['tokens'])
    assert all(len(lp[f]) == n for f in ('token_logprobs', 'top_logprobs', 'text_offset')), lp
    for i in range(n):
        if lp['token_logprobs'][i] is None:
            assert lp['top_logprobs'][i] is None, (i, lp)
            continue
        top = lp['top_logprobs'][i]
        assert len(top) <= k and all(v <= 0 for v in top.values()), (i, top)
        values = list(top.values())
        assert values == sorted(values, reverse=True), top
        assert lp['token_logprobs'][i] <= 0
        if values:
            assert lp['token_logprobs'][i] <= values[0] + 1e-12, (i, lp['token_logprobs'][i], top)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-9, top
        off, tok = lp['text_offset'][i], lp['tokens'][i]
        assert i == 0 or off >= lp['text_offset'][i - 1], lp['text_offset']
        if off + len(tok) <= len(text) and tok:
            assert text[off:off + len(tok)] == tok or tok.startswith('\n'), (i, tok, text[off:off + len(tok)])
    return n


def test_completion_scores(srv):
    cases = [dict(prompt=p, max_tokens=40, temperature=0) for p in PROMPTS]
    cases += [dict(prompt='Lily and Tom', max_tokens=30, temperature=0.8, seed=7, top_k=20),
              dict(prompt='A big', max_tokens=30, temperature=0.9, repetition_penalty=1.3, seed=11),
              dict(prompt='One day', max_tokens=200, temperature=0),
              dict(prompt='The end', max_tokens=400, temperature=1.0, seed=6)]  # ends at BOS
    for c in cases:
        k = 5
        out = completion(srv, logprobs=k, **c)
        choice = out['choices'][0]
        args = ts.cli_args(c)
        want = ts.cli(args)
        assert choice['text'] == want['text'], (c, choice['text'], want['text'])
        lp = choice['logprobs']
        n = check_legacy_logprobs(lp, k, choice['text'])
        ended = want['stop'] in ('bos', 'eos')  # then the end token is the last entry
        assert n == len(want['tokens']) + ended, (c, n, len(want['tokens']), want['stop'])
        total = sum(lp['token_logprobs'])
        assert abs(total - want['score']) <= SCORE_TOLERANCE, (c, total, want['score'])
        if c['temperature'] == 0 and 'repetition_penalty' not in c:
            for i in range(n):  # greedy: the chosen token is the likeliest
                assert abs(max(lp['top_logprobs'][i].values()) - lp['token_logprobs'][i]) < 1e-12, (i, lp)
        if not ended:
            assert ''.join(lp['tokens']) == choice['text'], (lp['tokens'], choice['text'])
        assert all(len(t) == k for t in lp['top_logprobs']), lp['top_logprobs']


def perplexity(text):
    p = subprocess.run([ts.RUN, ts.MODEL, '-z', ts.TOK, '-m', 'perplexity', '-f', 'json', '-i', text],
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    return json.loads(p.stdout.decode().splitlines()[0])


def test_echo_perplexity(srv):
    story = open(os.path.join(HERE, 'story_perplexity.txt')).read()[:900]
    for text in PROMPTS + [story]:
        want = perplexity(text)
        out = completion(srv, prompt=text, max_tokens=0, echo=True, logprobs=3, n=2)
        for choice in out['choices']:
            lp = choice['logprobs']
            assert choice['text'] == text and choice['finish_reason'] == 'length', choice['text'][:80]
            check_legacy_logprobs(lp, 3, text)
            scored = lp['token_logprobs'][1:]
            assert lp['token_logprobs'][0] is None and lp['tokens'][0] == '\n<s>\n', lp['tokens'][:2]
            assert len(scored) == want['tokens'], (len(scored), want['tokens'])
            mean = sum(scored) / len(scored)
            assert abs(mean + want['nll']) <= 1e-12, (text[:30], mean, want['nll'])
        assert out['usage']['completion_tokens'] == 0 and out['usage']['prompt_tokens'] == want['tokens'] + 1, out['usage']
    # echo with new tokens: the prompt is scored the same, the new tokens as without echo
    alone = completion(srv, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=2)['choices'][0]['logprobs']
    both = completion(srv, prompt=PROMPTS[0], max_tokens=20, temperature=0, echo=True, logprobs=2)['choices'][0]
    plain = completion(srv, prompt=PROMPTS[0], max_tokens=20, temperature=0, logprobs=2)['choices'][0]
    n_prompt = len(alone['tokens'])
    assert both['logprobs']['token_logprobs'][:n_prompt] == alone['token_logprobs'], both['logprobs']
    assert both['logprobs']['token_logprobs'][n_prompt:] == plain['logprobs']['token_logprobs']
    assert both['text'] == PROMPTS[0] + plain['text'], both['text']
    assert both['logprobs']['text_offset'][n_prompt] == len(PROMPTS[0]), both['logprobs']['text_offset']


def test_chat_logprobs(srv):
    messages = [{'role': 'system', 'content': 'You are kind.'}, {'role': 'user', 'content': 'hi there'}]
    for settings, flags in (({'temperature': 0}, ['-t', '0']), ({'temperature': 1.0, 'seed': 5}, ['-t', '1.0', '-s', '5'])):
        got = client(srv, [{'endpoint': 'chat', 'body': dict(messages=messages, max_tokens=30, logprobs=True, top_logprobs=3,
                                                               **settings)}])[0]['response']
        choice = got['choices'][0]
        want = ts.cli(['-m', 'chat', '-y', 'You are kind.', '-i', 'hi there', '--max-new-tokens', '30'] + flags)
        assert choice['message']['content'] == want['text'], (choice['message'], want['text'])
        content = choice['logprobs']['content']
        assert len(content) == len(want['tokens']), (len(content), want)
        assert ''.join(t['token'] for t in content) == want['text']
        for t in content:
            assert t['bytes'] == list(t['token'].encode()), t
            assert len(t['top_logprobs']) == 3 and all(a['bytes'] == list(a['token'].encode()) for a in t['top_logprobs']), t
            values = [a['logprob'] for a in t['top_logprobs']]
            assert values == sorted(values, reverse=True) and t['logprob'] <= values[0] + 1e-12, t
        if want['stop'] == 'length':  # an end token's log-probability is in the score, not in the reply
            total = sum(t['logprob'] for t in content)
            assert abs(total - want['score']) <= SCORE_TOLERANCE, (total, want['score'])
    got = client(srv, [{'endpoint': 'chat', 'body': dict(messages=messages, max_tokens=5, logprobs=True)}])[0]['response']
    assert all(t['top_logprobs'] == [] for t in got['choices'][0]['logprobs']['content']), got
    got = client(srv, [{'endpoint': 'chat', 'body': dict(messages=messages, max_tokens=5)}])[0]['response']
    assert got['choices'][0]['logprobs'] is None, got


def test_n_greedy(srv):
    for prompt in PROMPTS[:2]:
        out = completion(srv, prompt=prompt, max_tokens=30, temperature=0, n=4)
        want = ts.cli(ts.cli_args({'prompt': prompt, 'max_tokens': 30, 'temperature': 0}))
        assert [c['index'] for c in out['choices']] == [0, 1, 2, 3], out['choices']
        assert all(c['text'] == want['text'] for c in out['choices']), (out['choices'], want['text'])
        assert out['usage']['completion_tokens'] == 4 * len(want['tokens']), out['usage']
        assert out['usage']['total_tokens'] == out['usage']['prompt_tokens'] + out['usage']['completion_tokens']
    messages = [{'role': 'system', 'content': 'You are kind.'}, {'role': 'user', 'content': 'hi there'}]
    got = client(srv, [{'endpoint': 'chat', 'body': dict(messages=messages, max_tokens=20, temperature=0, n=3)}])[0]['response']
    want = ts.cli(['-m', 'chat', '-y', 'You are kind.', '-i', 'hi there', '--max-new-tokens', '20', '-t', '0'])
    assert [c['message']['content'] for c in got['choices']] == [want['text']] * 3, (got['choices'], want['text'])


def test_n_seeded(srv):
    body = dict(prompt='Once upon a time', max_tokens=25, temperature=1.0, seed=42, n=3)
    got = client(srv, [{'endpoint': 'completions', 'body': body}, {'endpoint': 'completions', 'body': body},
                       {'endpoint': 'completions', 'body': dict(body, stream=True)},
                       {'endpoint': 'completions', 'body': dict(body, n=1, seed=43)}])
    first, again, streamed, single = got[0]['response'], got[1]['response'], got[2]['chunks'], got[3]['response']
    texts = [c['text'] for c in first['choices']]
    assert texts == [c['text'] for c in again['choices']], 'the same seed gave other choices'
    assert len(set(texts)) > 1, texts
    for i, text in enumerate(texts):
        want = ts.cli(ts.cli_args(dict(body, seed=42 + i)))
        assert text == want['text'], (i, text, want['text'])
    assert single['choices'][0]['text'] == texts[1], (single['choices'][0]['text'], texts[1])
    joined, finish = ['', '', ''], [None, None, None]
    for chunk in streamed:
        for c in chunk['choices']:
            joined[c['index']] += c['text']
            if c['finish_reason']:
                assert finish[c['index']] is None, 'two finish reasons'
                finish[c['index']] = c['finish_reason']
    assert joined == texts and finish == ['length'] * 3, (joined, finish)
    # echo, streamed: each choice starts with the prompt
    events, done = srv.stream('/v1/completions', dict(body, echo=True))
    assert done, 'no [DONE]'
    joined = ['', '', '']
    for e in events:
        for c in e['choices']:
            joined[c['index']] += c['text']
    assert joined == [body['prompt'] + t for t in texts], joined


def test_bad_values(srv):
    messages = [{'role': 'user', 'content': 'hi'}]
    cases = [
        ('completions', dict(prompt='x', logprobs=21), 'logprobs'),
        ('completions', dict(prompt='x', logprobs=-1), 'logprobs'),
        ('completions', dict(prompt='x', logprobs=True), 'logprobs'),
        ('completions', dict(prompt='x', n=0), "'n'"),
        ('completions', dict(prompt='x', n=17), "'n'"),
        ('completions', dict(prompt='x', n=2.5), "'n'"),
        ('completions', dict(prompt='x', echo='yes'), 'echo'),
        ('completions', dict(prompt='x', max_tokens=0), 'max_tokens'),
        ('completions', dict(prompt='x', max_tokens=-1), 'max_tokens'),
        ('completions', dict(prompt='x', logprobs=2, stream=True), 'logprobs'),
        ('completions', dict(prompt='x', logprobs=2, num_beams=2), 'logprobs'),
        ('completions', dict(prompt='x', top_logprobs=2), 'top_logprobs'),
        ('completions', dict(prompt='x', best_of=2), 'best_of'),
        ('chat', dict(messages=messages, top_logprobs=2), 'top_logprobs'),
        ('chat', dict(messages=messages, logprobs=True, top_logprobs=21), 'top_logprobs'),
        ('chat', dict(messages=messages, logprobs=1), 'logprobs'),
        ('chat', dict(messages=messages, n=99), "'n'"),
        ('chat', dict(messages=messages, echo=True), 'echo'),
    ]
    got = client(srv, [{'endpoint': e, 'body': b} for e, b, _ in cases])
    for (endpoint, body, field), g in zip(cases, got):
        assert g.get('status') == 400, (endpoint, body, g)
        assert field in g['message'], (endpoint, body, g['message'])
    # the error body is OpenAI's
    status, out = srv.post('/v1/completions', {'prompt': 'x', 'n': 17})
    assert status == 400 and out['error']['type'] == 'invalid_request_error' and out['error']['code'] == 400, out
    # null is an absent field; n 1, logprobs false and echo false change nothing
    out = completion(srv, prompt='x', max_tokens=3, temperature=0, n=None, logprobs=None, echo=False)
    assert out['choices'][0]['logprobs'] is None and len(out['choices']) == 1, out


def main():
    if not (os.path.exists(ts.MODEL) and os.path.exists(ts.TOK)):
        case('serve_logprobs', lambda: (_ for _ in ()).throw(Skip('stories260K.bin or tok512.bin not in MODELS_DIR')))
        return
    try:
        tso.install()
    except Skip as e:
        case('serve_logprobs', lambda: (_ for _ in ()).throw(e))
        return
    srv = ts.Server('--parallel', '8')
    try:
        case('serve_logprobs_sum_to_cli_score', lambda: test_completion_scores(srv))
        case('serve_echo_logprobs_equal_perplexity', lambda: test_echo_perplexity(srv))
        case('serve_chat_logprobs', lambda: test_chat_logprobs(srv))
        case('serve_n_greedy_identical', lambda: test_n_greedy(srv))
        case('serve_n_seeded_equal_cli_seed_plus_i', lambda: test_n_seeded(srv))
        case('serve_logprobs_bad_values_400', lambda: test_bad_values(srv))
    finally:
        code = srv.stop()
    case('serve_logprobs_server_exit_0', lambda: (_ for _ in ()).throw(AssertionError('exit %r' % code)) if code != 0 else None)


if __name__ == '__main__':
    main()
    sys.exit(1 if COUNTS['FAIL'] else 0)
