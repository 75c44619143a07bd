#!/usr/bin/env python3
"""Numpy reference of Hugging Face transformers' beam search (v4.38 semantics).

Independent re-implementation (no torch, no transformers) of what
`model.generate(num_beams=B, length_penalty=LP, early_stopping=E,
num_return_sequences=R, eos_token_id=[1, 2], do_sample=False)` does for one
prompt in transformers 4.38 (`GenerationMixin._beam_search` driving
`BeamSearchScorer` / `BeamHypotheses`), applied to a llama2.c model.  It is the
oracle for `./run -b B ...` (tests/test_beam.py).

Semantics (each point says where it comes from):

* End tokens are BOS (1) and EOS (2) (the issue; HF's eos_token_id list).
* Scores are sums of log-softmax values.  log-softmax is taken in float64 from
  the float32 logits and sums are kept in float64 (HF and the C code work in
  float32; the test compares scores with a relative tolerance and reports the
  closest decision margin, see `Result.min_margin`).
* The prompt (encoded with BOS, llama2.c `encode(prompt, bos=1, eos=0)`) is
  run once.  Step 1 expands only beam 0: the other B-1 beams start at -inf
  (HF uses -1e9; identical as long as B <= vocab - 2, i.e. beam 0 alone has at
  least B non-end tokens).
* Each step ranks all (beam, token) candidates by beam score + log-prob, in
  descending order; exact ties are ordered by (beam index, token id) (the
  order of torch.topk among equal values is unspecified).  HF only looks at
  the top max(2, 1 + n_eos) * B = 3B candidates, which always contain B
  non-end ones (each beam has only 2 end tokens), so walking the full ranking
  is the same thing.  The walk (HF `BeamSearchScorer.process`):
    - an end-token candidate at rank < B becomes a finished hypothesis: its
      tokens are the beam's tokens without the end token, its sum the
      candidate's score, and its generated length counts the end token
      (HF 4.38: `cur_len = input_ids.shape[-1] + 1`,
      `generated_len = cur_len - decoder_prompt_len`, since PR #27808 which
      is in 4.37+; the issue says the same).
    - an end-token candidate at rank >= B is dropped;
    - non-end candidates become the next beams, in rank order, until B are
      taken; the walk stops there (later end tokens are not looked at).
* Finished hypotheses live in a pool of B (HF `BeamHypotheses`):
  score = sum / generated_len ** length_penalty (prompt not counted).  While
  the pool holds fewer than B every hypothesis enters; when full a new one
  enters only if its score is strictly greater than the worst; then the worst
  is evicted (ties: the earliest added of the lowest goes).  `worst` starts at
  +1e9 and follows HF's bookkeeping exactly.
* Done test, after the step's adds (HF `BeamHypotheses.is_done(best_sum,
  cur_len, decoder_prompt_len)` with best_sum = the step's highest candidate
  score, end-token candidates included, and t = cur_len - prompt_len = the
  number of generated tokens including this step's):
    - pool not full -> not done (any early_stopping);
    - early_stopping True  -> done;
    - early_stopping False -> done iff worst >= best_sum / t ** lp;
    - early_stopping "never" -> done iff worst >= best_sum / T ** lp where T is
      max_new (the max number of new tokens, HF `max_length - prompt_len`) if
      lp > 0, else t.
  Once done, the search stops (HF breaks out of the loop when all batch
  entries are done; batch size is 1 here).
* Length limit: after the step that generated max_new tokens the search stops;
  unless it was already done, each running beam is added to the pool via the
  same add() with its sum and generated length = max_new (HF `finalize`:
  `generated_len = final_tokens.shape[-1] - decoder_prompt_len`).  These
  hypotheses have stop reason "length".
* Output: the best R pool entries by score, descending (HF: stable sort by
  score ascending, then pop() from the end, so among exactly equal scores the
  later-added entry comes first; mirrored here).
* max_new (llama2.c `-n` semantics): n = 0 or n > seq_len means seq_len; with
  a P-token prompt (BOS included) at most n - P + 1 new tokens (positions
  P-1 .. n-1 are forwarded).  A prompt that does not fit (max_new <= 0) gives
  no hypotheses here; the issue does not specify this case and the tests do
  not use it.
* B = 1 is plain greedy decoding (HF uses greedy search for num_beams=1):
  argmax of the logits (first index among equal maxima, like llama2.c's
  argmax), stop at the first end token or after max_new tokens.  Its score is
  reported as sum / generated_len ** lp with the same length convention
  (HF greedy has no sequence score; the test only checks tokens/stop for B=1).
* Generation controls (issue 12; tests/ref_controls.py states them):
  `controls` holds the logits processors (repetition penalty, no-repeat
  n-grams, min new tokens).  HF 4.38 `_beam_search` applies them to
  log_softmax(logits) of each beam row (input_ids = prompt + the beam's
  tokens) and adds the processed scores to the beam scores, so the sums,
  the done test and the returned scores all use processed values; greedy
  search applies them to the raw logits before the argmax (the greedy score
  here is then the log-softmax of the processed logits).  `stop_fn(tokens)`
  (stop strings, not in 4.38) names the stop string the text of a beam's
  tokens contains, or None: a non-end candidate whose text would contain
  one is walked like an end token (a finished hypothesis with stop "string"
  when ranked below B, its token kept and counted in its length; dropped
  otherwise).

Python API:
    res = beam_search(stepper, prompt_tokens, max_new, num_beams,
                      length_penalty=1.0, early_stopping=False, num_return=1)
    res.hyps: list of Hyp(score, sum_logprobs, tokens, gen_len, stop) best first
    res.min_margin / res.margin_where: closest decision seen (relative gap
      between the two scores a decision compared; pool comparisons only
      count when they could change the returned hypotheses)
    res.events: how often the rarer rules fired (end token dropped at rank
      >= B, best candidate an end token at a full-pool done test, evictions,
      rejections), used to choose test cases
    reference(model, tok, prompt, n, B, lp, e, r) -> list of dicts like the
      JSON lines of `./run -f json` plus 'text_bytes', and the Result.
Steppers: `LlamaBatchStepper(ref_llama.Model)` (batched over beams, bitwise
equal to Model.forward), `GenericStepper(model)` for any object with
new_cache() / forward(token, pos, cache) / cache.copy(), and
`NoisyStepper(stepper)` which perturbs logits (for vetting cases only).

CLI (prints JSON lines like `./run ... -f json`):
    python3 tests/ref_beam.py model.bin -z tok.bin -i PROMPT -n N -b B
        -l LENPEN -e 0|1|never -r R
"""
import json
import math
import os
import sys

import numpy as np

END_TOKENS = (1, 2)
STOP_NAMES = {1: 'bos', 2: 'eos'}
NEG_INF = float('-inf')


# ----------------------------------------------------------------------------
# small helpers

def log_softmax64(logits):
    """log-softmax in float64 of float32 logits; works on (..., V)."""
    x = np.asarray(logits, dtype=np.float32).astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def log_softmax32(logits):
    """log-softmax done in float32 throughout (what a float32 C/torch does, up
    to summation order); only used to probe how fragile a case is."""
    x = np.asarray(logits, dtype=np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    z = (x - m).astype(np.float32)
    s = np.sum(np.exp(z), axis=-1, keepdims=True, dtype=np.float32)
    return (z - np.log(s).astype(np.float32)).astype(np.float32)


def max_new_tokens(n, seq_len, prompt_len):
    """Number of new tokens allowed by llama2.c-style `-n n`."""
    if n <= 0 or n > seq_len:
        n = seq_len
    return max(0, n - prompt_len + 1)


def parse_early_stopping(s):
    """'0' -> False, '1' -> True, 'never' -> 'never' (also accepts bools)."""
    if s is True or s is False or s == 'never':
        return s
    s = str(s).strip()
    if s in ('0', 'false', 'False'):
        return False
    if s in ('1', 'true', 'True'):
        return True
    if s == 'never':
        return 'never'
    raise ValueError('early_stopping must be 0, 1 or never, not %r' % s)


def _rel_gap(a, b):
    """Gap between two scores relative to their size (inf when not finite).
    Float32 rounding of a sum of log-probs is relative to the sum, hence
    relative (a length-normalised score like -0.0013 has the same relative
    error as its sum)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


class Hyp:
    __slots__ = ('score', 'sum_logprobs', 'tokens', 'gen_len', 'stop', 'stop_string')

    def __init__(self, score, sum_logprobs, tokens, gen_len, stop, stop_string=None):
        self.score = score
        self.sum_logprobs = sum_logprobs
        self.tokens = list(tokens)
        self.gen_len = gen_len
        self.stop = stop
        self.stop_string = stop_string

    def __repr__(self):
        return 'Hyp(score=%.6f, sum=%.6f, len=%d, stop=%s, tokens=%s)' % (
            self.score, self.sum_logprobs, self.gen_len, self.stop, self.tokens)


class Result:
    def __init__(self):
        self.hyps = []          # returned hypotheses, best first
        self.min_margin = math.inf
        self.margin_where = ''
        self.steps = 0          # generation steps performed
        self.done_early = False  # pool declared done before the length limit
        self.forwards = 0
        self.pool_events = []
        # how often the rarer rules were exercised (for vetting test cases)
        self.events = {'end_hyp': 0, 'end_dropped_rank_ge_B': 0,
                       'best_is_end_at_full_pool': 0, 'pool_rejected': 0, 'pool_evicted': 0}

    def note(self, margin, where):
        if margin < self.min_margin:
            self.min_margin = margin
            self.margin_where = where

    def pool_event(self, a, b, where):
        """A pool comparison between two scores.  Which of two nearly equal
        hypotheses survives only matters if they could be returned, so these
        are noted at the end, and only when max(a, b) reaches the lowest
        returned score."""
        self.pool_events.append((a, b, where))

    def settle_pool_events(self):
        if not self.hyps:
            return
        lowest = min(h.score for h in self.hyps)
        slack = 1e-6 * max(1.0, abs(lowest))
        for a, b, where in self.pool_events:
            if max(a, b) >= lowest - slack:
                self.note(_rel_gap(a, b), where)


# ----------------------------------------------------------------------------
# the finished-hypotheses pool (mirrors HF BeamHypotheses)

class Pool:
    def __init__(self, num_beams, length_penalty, early_stopping, max_new, result):
        self.num_beams = num_beams
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.max_new = max_new
        self.entries = []       # Hyp, in insertion order (HF self.beams)
        self.worst_score = 1e9  # HF's initial value
        self.res = result

    def __len__(self):
        return len(self.entries)

    def normalise(self, sum_logprobs, gen_len):
        return sum_logprobs / (gen_len ** self.length_penalty)

    def add(self, tokens, sum_logprobs, gen_len, stop, step, stop_string=None):
        score = self.normalise(sum_logprobs, gen_len)
        if len(self.entries) >= self.num_beams:
            self.res.pool_event(score, self.worst_score,
                                'step %d: new hypothesis vs worst in full pool' % step)
        if not (len(self.entries) < self.num_beams or score > self.worst_score):
            self.res.events['pool_rejected'] += 1
        if len(self.entries) < self.num_beams or score > self.worst_score:
            self.entries.append(Hyp(score, sum_logprobs, tokens, gen_len, stop, stop_string))
            if len(self.entries) > self.num_beams:
                order = sorted(range(len(self.entries)),
                               key=lambda i: (self.entries[i].score, i))
                lo, nxt = self.entries[order[0]], self.entries[order[1]]
                self.res.pool_event(lo.score, nxt.score,
                                    'step %d: choice of the evicted hypothesis' % step)
                del self.entries[order[0]]
                self.res.events['pool_evicted'] += 1
                self.worst_score = nxt.score
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum, t, step):
        if len(self.entries) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        lp = self.length_penalty
        if self.early_stopping == 'never' and lp > 0.0:
            highest = best_sum / (self.max_new ** lp)
        else:
            highest = best_sum / (t ** lp)
        if self.worst_score != highest:
            # (exact equality is structural, not a near-tie: the step's best
            # candidate is the end token whose hypothesis just became the
            # worst in the pool, so both sides are the same computation)
            self.res.note(_rel_gap(self.worst_score, highest), 'step %d: done test' % step)
        return self.worst_score >= highest

    def best(self, r):
        # HF: sorted(beams, key=score) (stable), then pop() from the end.
        asc = sorted(range(len(self.entries)), key=lambda i: self.entries[i].score)
        order = asc[::-1]
        out = [self.entries[i] for i in order[:r]]
        for i in range(min(r, len(order) - 1)):
            self.res.note(_rel_gap(self.entries[order[i]].score,
                                   self.entries[order[i + 1]].score),
                          'final ranking %d/%d' % (i + 1, i + 2))
        return out


# ----------------------------------------------------------------------------
# steppers: run the model for a set of beams

class NoisyStepper:
    """Wraps a stepper and perturbs every logit by a random relative amount
    of at most `scale` (in float32): a stand-in for a different float32
    summation order in the C code.  Only used to vet test cases."""

    def __init__(self, base, scale=5e-7, seed=1):
        self.base = base
        self.vocab_size = base.vocab_size
        self.rng = np.random.default_rng(seed)
        self.scale = scale

    @property
    def forwards(self):
        return self.base.forwards

    def _noise(self, logits):
        f = 1.0 + self.rng.uniform(-self.scale, self.scale, size=logits.shape)
        return (logits.astype(np.float64) * f).astype(np.float32)

    def prefill(self, tokens):
        st, lg = self.base.prefill(tokens)
        return st, self._noise(lg)

    def step(self, state, parents, tokens, pos):
        st, lg = self.base.step(state, parents, tokens, pos)
        return st, self._noise(lg)


class GenericStepper:
    """Per-beam caches over any model with new_cache/forward/cache.copy."""

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.forwards = 0

    def prefill(self, tokens):
        cache = self.model.new_cache()
        logits = None
        for pos, t in enumerate(tokens):
            logits = self.model.forward(t, pos, cache)
            self.forwards += 1
        return [cache], np.asarray(logits, dtype=np.float32)[None, :]

    def step(self, state, parents, tokens, pos):
        new = []
        used = set()
        for p in parents:
            # reuse a parent's cache object the first time, copy afterwards
            new.append(state[p] if p not in used else state[p].copy())
            used.add(p)
        # a cache reused in place must not be shared with a later copy source:
        # copies were taken before any forward below, so this is safe.
        out = np.empty((len(parents), self.vocab_size), dtype=np.float32)
        for i, (c, t) in enumerate(zip(new, tokens)):
            out[i] = self.model.forward(t, pos, c)
            self.forwards += 1
        return new, out


class LlamaBatchStepper:
    """ref_llama.Model run for all beams at once (same float32 operations and
    accumulation order as ref_llama.Model.forward, so bitwise equal logits;
    checked by tests/test_beam.py's self-check)."""

    def __init__(self, model):
        import ref_llama  # noqa: F401  (same directory)
        self.R = ref_llama
        self.model = model
        self.c = model.config
        self.vocab_size = self.c.vocab_size
        self.forwards = 0
        self._tcache = {}

    def prefill(self, tokens):
        cache = self.model.new_cache()
        logits = None
        for pos, t in enumerate(tokens):
            logits = self.model.forward(t, pos, cache)
            self.forwards += 1
        state = (cache.k[None].copy(), cache.v[None].copy())
        return state, np.asarray(logits, dtype=np.float32)[None, :]

    def _t(self, mat):
        """Contiguous transpose of a weight matrix, cached by identity."""
        key = id(mat)
        hit = self._tcache.get(key)
        if hit is None or hit[0] is not mat:
            hit = (mat, np.ascontiguousarray(mat.T))
            self._tcache[key] = hit
        return hit[1]

    def _rope(self, vec, pos):
        # vec (N, n): same arithmetic as ref_llama.Model._rope, batched
        F32 = np.float32
        n = vec.shape[1]
        val = (F32(pos) * self.model._freq[: n // 2]).astype(F32).astype(np.float64)
        fcr = np.cos(val).astype(F32)
        fci = np.sin(val).astype(F32)
        v0 = vec[:, 0::2].copy()
        v1 = vec[:, 1::2].copy()
        out = np.empty_like(vec)
        out[:, 0::2] = v0 * fcr - v1 * fci
        out[:, 1::2] = v0 * fci + v1 * fcr
        return out

    def step(self, state, parents, tokens, pos):
        R = self.R
        F32 = np.float32
        seqsum = R._seqsum
        c = self.c
        w = self.model.w
        idx = np.asarray(parents, dtype=np.int64)
        K = state[0][idx]          # (N, L, S, kv) fresh copies (fancy indexing)
        V = state[1][idx]
        N = len(parents)
        hs = c.head_size
        kvh = c.n_kv_heads
        kvmul = c.n_heads // kvh   # query head h uses kv head h // kvmul

        def rms(x, weight):
            ss = seqsum(x * x, axis=1)
            ss = (ss / F32(x.shape[1])).astype(F32)
            ss = (ss + F32(1e-5)).astype(F32)
            ss = (F32(1.0) / np.sqrt(ss).astype(F32)).astype(F32)
            return (weight[None, :] * (ss[:, None] * x)).astype(F32)

        def mv(mat, x):
            # xout[n, i] = sum_j mat[i, j] * x[n, j], summed left to right in
            # float32 like ref_llama.matvec (cumsum), as vector adds over j
            p = self._t(mat)[:, None, :] * x.T[:, :, None]       # (in, N, out)
            s = p[0].copy()
            for j in range(1, p.shape[0]):
                s += p[j]
            return s

        x = w['emb'][np.asarray(tokens)].astype(F32).copy()     # (N, D)
        sqrt_hs = F32(np.sqrt(F32(hs)))
        T = pos + 1
        for l in range(c.n_layers):
            xb = rms(x, w['rms_att'][l])
            q = mv(w['wq'][l], xb)
            k = mv(w['wk'][l], xb)
            v = mv(w['wv'][l], xb)
            q = self._rope(q, pos)
            k = self._rope(k, pos)
            K[:, l, pos] = k
            V[:, l, pos] = v
            # attention; same products and left-to-right float32 sums as
            # ref_llama (over the head dim for scores, over time for the
            # output), grouped as (N, T, kv head, query head in group, hs)
            K5 = K[:, l, :T].reshape(N, T, kvh, 1, hs)
            V5 = V[:, l, :T].reshape(N, T, kvh, 1, hs)
            prod = q.reshape(N, 1, kvh, kvmul, hs) * K5
            sc = prod[..., 0].copy()
            for j in range(1, hs):
                sc += prod[..., j]
            scores = sc.reshape(N, T, c.n_heads).transpose(0, 2, 1)     # (N, H, T)
            scores = (scores / sqrt_hs).astype(F32)
            att = R.softmax(scores)
            p = att.transpose(0, 2, 1).reshape(N, T, kvh, kvmul, 1) * V5
            xo = np.add.accumulate(p, axis=1, dtype=F32)[:, -1]         # (N, kvh, kvmul, hs)
            xb = xo.reshape(N, c.dim).astype(F32)
            x = (x + mv(w['wo'][l], xb)).astype(F32)
            xb = rms(x, w['rms_ffn'][l])
            hb = mv(w['w1'][l], xb)
            hb2 = mv(w['w3'][l], xb)
            hb = (hb * (F32(1.0) / (F32(1.0) + R._expf(-hb)))).astype(F32)
            hb = (hb * hb2).astype(F32)
            x = (x + mv(w['w2'][l], hb)).astype(F32)
        x = rms(x, w['rms_final'])
        self.forwards += N
        return (K, V), mv(w['wcls'], x)


# ----------------------------------------------------------------------------
# the searches

def _process(controls, prompt_tokens, tokens, row):
    if not controls:
        return row
    import ref_controls
    return ref_controls.process(controls, list(prompt_tokens) + list(tokens), len(tokens), row)


def greedy(stepper, prompt_tokens, max_new, length_penalty=1.0, precision='float64', controls=None, stop_fn=None):
    res = Result()
    if max_new <= 0:
        return res
    state, logits = stepper.prefill(prompt_tokens)
    P = len(prompt_tokens)
    tokens = []
    total = 0.0
    stop = 'length'
    stop_string = None
    gen_len = max_new
    for t in range(1, max_new + 1):
        res.steps = t
        row = _process(controls, prompt_tokens, tokens, np.asarray(logits[0], dtype=np.float32))
        tok = int(np.argmax(row))
        srt = np.sort(row)
        if srt.size > 1:
            res.note(float(srt[-1] - srt[-2]) / max(1.0, abs(float(srt[-1]))),
                     'step %d: argmax' % t)
        if precision == 'float32':
            total = float(np.float32(total) + log_softmax32(row)[tok])
        else:
            total += float(log_softmax64(row)[tok])
        if tok in END_TOKENS:
            stop = STOP_NAMES[tok]
            gen_len = t
            break
        tokens.append(tok)
        stop_string = stop_fn(tokens) if stop_fn else None
        if stop_string is not None:
            stop = 'string'
            gen_len = t
            break
        if t == max_new:
            break
        state, logits = stepper.step(state, [0], [tok], P - 1 + t)
    score = total / (gen_len ** float(length_penalty))
    res.hyps = [Hyp(score, total, tokens, gen_len, stop, stop_string)]
    res.done_early = stop != 'length'
    res.forwards = stepper.forwards
    return res


def beam_search(stepper, prompt_tokens, max_new, num_beams, length_penalty=1.0,
                early_stopping=False, num_return=1, precision='float64', greedy_for_one=True,
                controls=None, stop_fn=None):
    """HF 4.38 beam search for one prompt; see the module docstring.

    greedy_for_one=False runs the beam machinery even for B=1 (not what HF or
    the issue do; only used to show that the B=1 tests can tell the two apart).

    precision='float32' keeps log-probs and beam sums in float32 (like HF and
    the C code); the default float64 is the reference proper.  Comparing the
    two tells whether a case hinges on rounding."""
    B = int(num_beams)
    early_stopping = parse_early_stopping(early_stopping)
    if B < 1:
        raise ValueError('num_beams must be >= 1')
    if num_return > B:
        raise ValueError('num_return must be <= num_beams')
    if B == 1 and greedy_for_one:
        return greedy(stepper, prompt_tokens, max_new, length_penalty, precision, controls, stop_fn)
    res = Result()
    if max_new <= 0:
        return res
    P = len(prompt_tokens)
    V = stepper.vocab_size
    pool = Pool(B, length_penalty, early_stopping, max_new, res)

    state, logits = stepper.prefill(prompt_tokens)
    # step 1: B identical beams, all but beam 0 at -inf
    beam_tokens = [[] for _ in range(B)]
    acc = np.float32 if precision == 'float32' else np.float64
    lsm_fn = log_softmax32 if precision == 'float32' else log_softmax64
    beam_scores = np.full(B, NEG_INF, dtype=acc)
    beam_scores[0] = 0.0
    beam_parent_state = [0] * B     # row of `logits`/`state` each beam uses

    done = False
    t = 0
    for t in range(1, max_new + 1):
        res.steps = t
        lsm = lsm_fn(logits)                               # (rows, V)
        lsm = lsm[np.asarray(beam_parent_state)]           # (B, V)
        if controls:
            lsm = np.stack([_process(controls, prompt_tokens, beam_tokens[b], lsm[b]) for b in range(B)])
        with np.errstate(invalid='ignore'):
            cand = beam_scores[:, None] + lsm              # (B, V)
        flat = cand.reshape(-1)
        # descending; exact ties by flat index = (beam, token) ascending
        order = np.lexsort((np.arange(flat.size), -flat))
        best_sum = float(flat[order[0]])

        chosen = []     # (beam, token, score)
        last_rank = -1
        for rank in range(flat.size):
            fi = int(order[rank])
            b, v = divmod(fi, V)
            s = float(flat[fi])
            last_rank = rank
            stop_string = None if v in END_TOKENS or stop_fn is None else stop_fn(beam_tokens[b] + [v])
            if v in END_TOKENS:
                if rank >= B:
                    res.events['end_dropped_rank_ge_B'] += 1
                    continue
                res.events['end_hyp'] += 1
                pool.add(beam_tokens[b], s, t, STOP_NAMES[v], t)
            elif stop_string is not None:
                if rank < B:
                    pool.add(beam_tokens[b] + [v], s, t, 'string', t, stop_string)
            else:
                chosen.append((b, v, s))
                if len(chosen) == B:
                    break
        if len(chosen) < B:
            raise RuntimeError('fewer than B non-end candidates (B too large for vocab)')
        # decision margins of the walk (which candidates were taken/added)
        k = last_rank     # rank of the B-th non-end candidate
        nxt = None
        for rank in range(k + 1, flat.size):
            if int(order[rank]) % V not in END_TOKENS:
                nxt = rank
                break
        if nxt is not None:
            res.note(_rel_gap(float(flat[order[k]]), float(flat[order[nxt]])),
                     'step %d: last kept vs first dropped beam candidate' % t)
        if flat.size > B:
            a, c2 = int(order[B - 1]), int(order[B])
            if (a % V in END_TOKENS) or (c2 % V in END_TOKENS):
                if B - 1 <= k:
                    res.note(_rel_gap(float(flat[a]), float(flat[c2])),
                             'step %d: end-token candidate at the rank-B boundary' % t)

        if int(order[0]) % V in END_TOKENS and len(pool) == B:
            res.events['best_is_end_at_full_pool'] += 1
        done = pool.is_done(best_sum, t, t)

        parents = [b for (b, _, _) in chosen]
        beam_tokens = [beam_tokens[b] + [v] for (b, v, _) in chosen]
        beam_scores = np.array([s for (_, _, s) in chosen], dtype=acc)
        if done or t == max_new:
            break
        rows = [beam_parent_state[p] for p in parents]
        state, logits = stepper.step(state, rows, [v for (_, v, _) in chosen], P - 1 + t)
        beam_parent_state = list(range(B))

    res.done_early = done
    if not done:
        # HF finalize: running beams join the pool via add()
        for i in range(B):
            pool.add(beam_tokens[i], float(beam_scores[i]), len(beam_tokens[i]), 'length', t)
    res.hyps = pool.best(num_return)
    res.settle_pool_events()
    res.forwards = stepper.forwards
    return res


# ----------------------------------------------------------------------------
# tokenizer glue and the whole CLI-equivalent computation

def decode_tokens(tok, prev, tokens):
    """(raw bytes, bytes after llama2.c safe_printf filtering)."""
    import ref_llama
    raw = bytearray()
    safe = bytearray()
    for t in tokens:
        piece = tok.decode(prev, t)
        raw += piece
        safe += ref_llama.safe_piece(piece)
        prev = t
    return bytes(raw), bytes(safe)


def reference(model, tok, prompt, n, num_beams, length_penalty=1.0, early_stopping=False,
              num_return=1, stepper=None, precision='float64', controls=None):
    """Expected hypotheses of `run model -z tok -i prompt -n n -b B -l lp -e E -r R -f json`.

    Returns (lines, result): lines is a list of dicts with rank, score,
    tokens, stop, text_bytes (raw decode) and text_safe (safe_printf filtered).
    """
    if isinstance(prompt, str):
        prompt = prompt.encode('utf-8')
    prompt_tokens = tok.encode(prompt, True, False)
    seq_len = model.config.seq_len
    mx = max_new_tokens(n, seq_len, len(prompt_tokens))
    if stepper is None:
        stepper = LlamaBatchStepper(model)
    stop_fn = None
    if controls and controls.get('stops'):
        import ref_controls
        stop_fn = ref_controls.stop_checker(tok, prompt_tokens[-1], controls['stops'])
    res = beam_search(stepper, prompt_tokens, mx, num_beams, length_penalty,
                      early_stopping, num_return, precision, controls=controls, stop_fn=stop_fn)
    lines = []
    for i, h in enumerate(res.hyps):
        raw, safe = decode_tokens(tok, prompt_tokens[-1], h.tokens)
        if h.stop_string is not None:
            import ref_controls
            raw, safe = ref_controls.cut_text(raw, h.stop_string), ref_controls.cut_text(safe, h.stop_string)
        lines.append({'rank': i + 1, 'score': h.score, 'tokens': h.tokens, 'stop': h.stop,
                      'stop_string': h.stop_string, 'text_bytes': raw, 'text_safe': safe})
    res.prompt_tokens = prompt_tokens
    res.max_new = mx
    return lines, res


def _main(argv):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ref_llama
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    model_path = argv[1]
    opts = {'-z': 'tokenizer.bin', '-i': '', '-n': '256', '-b': '2', '-l': '1.0',
            '-e': '0', '-r': '1'}
    i = 2
    while i < len(argv):
        if argv[i] not in opts or i + 1 >= len(argv):
            sys.stderr.write('bad argument %s\n' % argv[i])
            return 2
        opts[argv[i]] = argv[i + 1]
        i += 2
    model = ref_llama.Model.load(model_path)
    tok = ref_llama.Tokenizer.load(opts['-z'], model.config.vocab_size)
    lines, res = reference(model, tok, opts['-i'].encode('utf-8', 'surrogateescape'),
                           int(opts['-n']), int(opts['-b']), float(opts['-l']),
                           parse_early_stopping(opts['-e']), int(opts['-r']))
    for d in lines:
        obj = {'rank': d['rank'], 'score': round(d['score'], 6), 'tokens': d['tokens'],
               'text': d['text_bytes'].decode('utf-8', 'replace'), 'stop': d['stop']}
        print(json.dumps(obj, ensure_ascii=False))
    sys.stderr.write('steps %d, forwards %d, done_early %s, min margin %.3g (%s)\n' % (
        res.steps, res.forwards, res.done_early, res.min_margin, res.margin_where))
    return 0


if __name__ == '__main__':
    sys.exit(_main(sys.argv))
