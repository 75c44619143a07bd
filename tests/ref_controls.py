#!/usr/bin/env python3
"""Numpy reference of the generation controls (issue 12), written from the
Hugging Face transformers generate() semantics, independently of run.c.

Controls (a plain dict, every key optional):
  min_new_tokens, repetition_penalty, no_repeat_ngram_size, top_k, min_p,
  stops (a list of byte strings).

Logits processors (transformers 4.38, generation/logits_process.py; applied
in the order `_get_logits_processor` builds them):
  1. RepetitionPenaltyLogitsProcessor: the scores of the token ids in
     input_ids are gathered, each becomes score * p when negative, else
     score / p, and they are scattered back (a repeated id is penalised once).
  2. NoRepeatNGramLogitsProcessor: with cur_len = len(input_ids), nothing
     when cur_len + 1 < n; else every n-gram of input_ids (prompt included)
     is recorded under its first n - 1 tokens, and the tokens recorded under
     the last n - 1 tokens of input_ids get -inf.
  3. MinNewTokensLengthLogitsProcessor: while fewer than N tokens were
     generated, every eos_token_id (here BOS 1 and EOS 2) gets -inf.
  In greedy search and sampling they act on the raw logits; in beam search on
  log_softmax(logits), and the processed scores are added to the beam scores.

Sampling warpers (applied after the processors, in the order temperature,
top-k, top-p, min-p; min-p arrived in the library after 4.38, the issue puts
it last):
  - temperature: logits / T, then the softmax (llama2.c's float32 softmax);
  - top-k: tokens whose probability is below the k-th largest are removed;
  - top-p: llama2.c's nucleus rule (the smallest set of likeliest tokens
    whose cumulative probability exceeds p), computed on the renormalised
    top-k probabilities: cumulative > p * (mass of the top-k tokens);
  - min-p: tokens with probability below min_p * (the largest) are removed;
  - the draw: llama2.c's coin (xorshift, ref_llama.Sampler) over the kept
    tokens in descending order of probability (stable among equals), with
    r = coin * (their total).
  With top-k 0 and min-p 0 the sampler is ref_llama.Sampler unchanged.

Stop strings (not in 4.38; the issue's rule): the generated text is the
concatenation of the printed pieces (ref_llama.safe_piece of each decoded
token, the first decoded after the last prompt token).  Generation ends at
the first token after which the text contains a stop string; the stop string
found is the one starting earliest (the first listed among those starting at
the same byte); the text reported is cut before it; the token stays among
the generated tokens.  Beam search treats a candidate whose text would
contain a stop string like an end-token candidate (finished hypothesis when
ranked below B, dropped otherwise), keeping its token.
"""
import numpy as np

import ref_llama

F32 = np.float32
BOS, EOS = 1, 2


def controls_off(c):
    return not c or all(not c.get(k) for k in ('min_new_tokens', 'no_repeat_ngram_size', 'top_k', 'min_p', 'stops')) \
        and float(c.get('repetition_penalty', 1.0)) == 1.0


# ----------------------------------------------------------------------------
# processors

def banned_ngram_tokens(seq, n):
    cur_len = len(seq)
    if cur_len + 1 < n:
        return set()
    table = {}
    for i in range(cur_len - n + 1):
        gram = tuple(seq[i:i + n])
        table.setdefault(gram[:-1], []).append(gram[-1])
    return set(table.get(tuple(seq[cur_len + 1 - n:]), []))


def process(c, seq, n_new, scores):
    """The processed copy of scores (float32 or float64 row) for the next
    token after seq (prompt included; the last n_new generated)."""
    if not c:
        return scores
    s = np.array(scores, copy=True)
    dt = s.dtype.type
    p = c.get('repetition_penalty', 1.0)
    if p is not None and float(p) != 1.0:
        pen = dt(F32(p))
        ids = np.asarray(seq, dtype=np.int64)
        g = s[ids]
        s[ids] = np.where(g < 0, g * pen, g / pen).astype(s.dtype)
    n = c.get('no_repeat_ngram_size') or 0
    if n > 0:
        for t in banned_ngram_tokens(list(seq), n):
            s[t] = -np.inf
    if n_new < (c.get('min_new_tokens') or 0):
        s[BOS] = -np.inf
        if len(s) > EOS:
            s[EOS] = -np.inf
    return s


# ----------------------------------------------------------------------------
# sampling

def sample_truncated(probs, top_k, topp, min_p, coin):
    probs = np.asarray(probs, dtype=F32)
    n = len(probs)
    floor = F32(0.0)
    if 0 < top_k < n:
        floor = np.sort(probs)[::-1][top_k - 1]
    keep = np.nonzero(probs >= floor)[0]
    mass = F32(1.0) if floor == 0 else np.cumsum(probs[keep], dtype=F32)[-1]
    order = keep[np.argsort(-probs[keep], kind='stable')]
    p = probs[order]
    last = len(order) - 1
    topp = F32(topp)
    if 0 < topp < 1:
        over = np.nonzero(np.cumsum(p, dtype=F32) > F32(topp * mass))[0]
        if over.size:
            last = int(over[0])
    if min_p > 0:
        ok = np.nonzero(p[:last + 1] >= F32(F32(min_p) * p[0]))[0]
        last = int(ok[-1]) if ok.size else 0
    cdf = np.cumsum(p[:last + 1], dtype=F32)
    r = F32(coin * cdf[-1])
    hit = np.nonzero(r < cdf)[0]
    return int(order[hit[0]]) if hit.size else int(order[last])


def sample(sampler, c, logits):
    """sampler: ref_llama.Sampler (its coin); c: the controls."""
    top_k = (c or {}).get('top_k') or 0
    min_p = float((c or {}).get('min_p') or 0.0)
    if top_k == 0 and min_p == 0.0:
        return sampler.sample(logits)
    logits = np.asarray(logits, dtype=F32)
    if sampler.temperature == F32(0.0):
        return int(np.argmax(logits))
    probs = ref_llama.softmax((logits / sampler.temperature).astype(F32))
    coin = sampler.random_f32()
    return sample_truncated(probs, top_k, sampler.topp, min_p, coin)


# ----------------------------------------------------------------------------
# stop strings

def find_stop(stops, text):
    """(position, stop) of the stop string starting earliest in text, the
    first listed among equals; None when there is none."""
    best = None
    for s in stops or ():
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_checker(tok, prev, stops):
    """A function tokens -> matched stop string (bytes) or None, for the text
    of the generated tokens decoded after the last prompt token `prev`."""
    if not stops:
        return None

    def fn(tokens):
        text = bytearray()
        pt = prev
        for t in tokens:
            text += ref_llama.safe_piece(tok.decode(pt, t))
            pt = t
        hit = find_stop(stops, bytes(text))
        return hit[1] if hit else None
    return fn


def cut_text(text, stop):
    if stop is None:
        return text
    i = text.find(stop)
    return text if i < 0 else text[:i]


# ----------------------------------------------------------------------------
# sampled generation (`./run -t T -p P -s S` with the controls)

def generate(model, tok, prompt, steps, temperature, topp, seed, c=None, stop_on_eos=False):
    """Returns (text-mode stdout bytes, dict like the JSON line of -f json:
    tokens, stop, stop_string, text (bytes), score (sum of log-softmax of the
    processed logits, float64))."""
    cfg = model.config
    if isinstance(prompt, str):
        prompt = prompt.encode('utf-8')
    if steps == 0 or steps > cfg.seq_len:
        steps = cfg.seq_len
    c = c or {}
    sampler = ref_llama.Sampler(cfg.vocab_size, temperature, topp, seed)
    ptoks = tok.encode(prompt, bos=True, eos=False)
    cache = model.new_cache()
    logits = None
    for pos, t in enumerate(ptoks):
        logits = model.forward(t, pos, cache)
    max_new = max(0, steps - len(ptoks) + 1)
    seq = list(ptoks)
    gen = []
    stop, stop_string, score = 'length', None, 0.0
    text = bytearray()
    prev = ptoks[-1]
    while len(gen) < max_new:
        row = process(c, seq, len(gen), np.asarray(logits, dtype=F32))
        nxt = sample(sampler, c, row.copy())
        x = row.astype(np.float64)
        m = np.max(x)
        score += float(x[nxt] - m - np.log(np.sum(np.exp(x - m))))
        if nxt == BOS or (stop_on_eos and nxt == EOS):
            stop = 'bos' if nxt == BOS else 'eos'
            break
        gen.append(nxt)
        seq.append(nxt)
        text += ref_llama.safe_piece(tok.decode(prev, nxt))
        prev = nxt
        hit = find_stop(c.get('stops'), bytes(text))
        if hit:
            stop, stop_string = 'string', hit[1]
            del text[hit[0]:]
            break
        if len(gen) == max_new:
            break
        logits = model.forward(nxt, len(seq) - 1, cache)
    prompt_text = bytearray()
    pt = ptoks[0]
    for t in ptoks[1:steps + 1]:
        prompt_text += ref_llama.safe_piece(tok.decode(pt, t))
        pt = t
    out = bytes(prompt_text) + bytes(text) + b'\n'
    return out, {'tokens': gen, 'stop': stop, 'stop_string': stop_string, 'text': bytes(text), 'score': score}
