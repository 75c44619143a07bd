#!/usr/bin/env python3
"""Self-checks of tests/ref_beam.py (no ./run involved).

1. A toy model with the ref_llama Model API (logits from a fixed random table
   indexed by (previous token, pos) plus a term that depends on the whole
   cached history, so mixed-up caches show) is searched by ref_beam and by
   `literal_hf_beam_search` below, a second, deliberately literal transcription
   of the transformers 4.38 control flow (input_ids matrix re-run from scratch
   every step without caches, beam scores initialised to -1e9, top-3B
   candidates, process() / BeamHypotheses / finalize()).  Both must agree on
   tokens, scores and stop reasons over many random configurations.
2. LlamaBatchStepper must give bitwise the logits of ref_llama.Model.forward.
3. The same toy comparison with the generation controls of issue 12: the
   literal transcription applies HF-style processor objects (written here
   again, apart from tests/ref_controls.py) to each row of input_ids and its
   log-softmax scores (or to the logits, for greedy search) at the place the
   library calls logits_processor, and ends a beam on a stop string (in the
   toy's text: token t is the letter 'a' + t) as the issue's rule says.

Usage: python3 tests/beam_selfcheck.py [N_CONFIGS]   (exit 0 when all agree)
Also imported by tests/test_beam.py.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ref_beam  # noqa: E402


# ----------------------------------------------------------------------------
# toy model with the ref_llama API

class _Cfg:
    def __init__(self, vocab_size, seq_len):
        self.vocab_size = vocab_size
        self.seq_len = seq_len


class ToyCache:
    def __init__(self, seq_len):
        self.tokens = np.full(seq_len, -1, dtype=np.int64)

    def copy(self):
        c = ToyCache(0)
        c.tokens = self.tokens.copy()
        return c


class ToyModel:
    def __init__(self, vocab_size=12, seq_len=24, seed=0, end_bias=0.0, sharp=2.0):
        rng = np.random.default_rng(seed)
        self.config = _Cfg(vocab_size, seq_len)
        self.table = (rng.normal(size=(vocab_size, seq_len, vocab_size)) * sharp).astype(np.float32)
        # end tokens become likelier with position
        ramp = (np.arange(seq_len, dtype=np.float32) / seq_len * 3.0 + end_bias).astype(np.float32)
        self.table[:, :, 1] += ramp[None, :]
        self.table[:, :, 2] += ramp[None, :] - 0.5
        self.hist = (rng.normal(size=(97, vocab_size)) * 0.7).astype(np.float32)

    def new_cache(self):
        return ToyCache(self.config.seq_len)

    def forward(self, token, pos, cache):
        cache.tokens[pos] = token
        h = int(np.sum(cache.tokens[:pos + 1] * (np.arange(pos + 1) + 3))) % 97
        return (self.table[token, pos] + self.hist[h]).astype(np.float32)


# ----------------------------------------------------------------------------
# literal transcription of the HF 4.38 control flow

class LiteralHypotheses:
    def __init__(self, num_beams, length_penalty, early_stopping, max_length):
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_length = max_length
        self.num_beams = num_beams
        self.beams = []
        self.worst_score = 1e9

    def __len__(self):
        return len(self.beams)

    def add(self, hyp, sum_logprobs, generated_len, stop):
        # (HF keeps beam_indices where `stop` is kept here)
        score = sum_logprobs / (generated_len ** self.length_penalty)
        if len(self) < self.num_beams or score > self.worst_score:
            self.beams.append((score, hyp, stop))
            if len(self) > self.num_beams:
                srt = sorted([(s, idx) for idx, (s, _, _) in enumerate(self.beams)])
                del self.beams[srt[0][1]]
                self.worst_score = srt[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs, cur_len, decoder_prompt_len):
        if len(self) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping is False:
            hi = best_sum_logprobs / (cur_len - decoder_prompt_len) ** self.length_penalty
            return self.worst_score >= hi
        if self.length_penalty > 0.0:
            hi = best_sum_logprobs / (self.max_length - decoder_prompt_len) ** self.length_penalty
        else:
            hi = best_sum_logprobs / (cur_len - decoder_prompt_len) ** self.length_penalty
        return self.worst_score >= hi


def _full_logits(model, seq):
    cache = model.new_cache()
    out = None
    for pos, t in enumerate(seq):
        out = model.forward(int(t), pos, cache)
    return out


class LiteralRepetitionPenalty:
    def __init__(self, penalty):
        self.penalty = penalty

    def __call__(self, input_ids, scores):
        for i in range(scores.shape[0]):
            for tok in set(int(x) for x in input_ids[i]):
                sc = scores[i, tok]
                scores[i, tok] = sc * self.penalty if sc < 0 else sc / self.penalty
        return scores


class LiteralNoRepeatNGram:
    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores):
        cur_len = input_ids.shape[1]
        if cur_len + 1 < self.n:
            return scores
        for i in range(scores.shape[0]):
            row = [int(x) for x in input_ids[i]]
            gens = {}
            for ng in zip(*[row[j:] for j in range(self.n)]):
                gens[tuple(ng[:-1])] = gens.get(tuple(ng[:-1]), []) + [ng[-1]]
            key = tuple(row[cur_len + 1 - self.n:cur_len])
            for tok in gens.get(key, []):
                scores[i, tok] = -np.inf
        return scores


class LiteralMinNewTokens:
    def __init__(self, prompt_len, min_new, eos):
        self.prompt_len, self.min_new, self.eos = prompt_len, min_new, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[-1] - self.prompt_len < self.min_new:
            for e in self.eos:
                scores[:, e] = -np.inf
        return scores


def literal_processors(controls, prompt_len, eos=(1, 2)):
    procs = []
    if not controls:
        return procs
    if controls.get('repetition_penalty', 1.0) != 1.0:
        procs.append(LiteralRepetitionPenalty(np.float32(controls['repetition_penalty'])))
    if controls.get('no_repeat_ngram_size'):
        procs.append(LiteralNoRepeatNGram(controls['no_repeat_ngram_size']))
    if controls.get('min_new_tokens'):
        procs.append(LiteralMinNewTokens(prompt_len, controls['min_new_tokens'], eos))
    return procs


def apply_all(procs, input_ids, scores):
    for p in procs:
        scores = p(input_ids, scores)
    return scores


def toy_text(tokens):
    return bytes(ord('a') + t % 26 for t in tokens)


def toy_stop(stops, tokens):
    """The stop string the toy text of tokens holds (earliest; first listed
    among equals), or None."""
    text = toy_text(tokens)
    hits = [(text.find(s), k, s) for k, s in enumerate(stops or ()) if text.find(s) >= 0]
    return min(hits)[2] if hits else None


def literal_hf_beam_search(model, prompt, max_new, num_beams, length_penalty,
                           early_stopping, num_return, eos=(1, 2), controls=None):
    """Returns list of (score, generated tokens without end, stop)."""
    procs = literal_processors(controls, len(prompt), eos)
    stops = (controls or {}).get('stops')
    B = num_beams
    P = len(prompt)
    max_length = P + max_new
    input_ids = np.tile(np.asarray(prompt, dtype=np.int64), (B, 1))
    beam_scores = np.zeros(B, dtype=np.float64)
    beam_scores[1:] = -1e9
    hyps = LiteralHypotheses(B, length_penalty, early_stopping, max_length)
    done = False
    while True:
        logits = np.stack([_full_logits(model, row) for row in input_ids])
        scores = apply_all(procs, input_ids, ref_beam.log_softmax64(logits)) + beam_scores[:, None]
        V = scores.shape[1]
        flat = scores.reshape(-1)
        k = max(2, 1 + len(eos)) * B if not stops else flat.size
        order = np.lexsort((np.arange(flat.size), -flat))[:k]
        next_scores = flat[order]
        next_tokens = order % V
        next_indices = order // V
        # process()
        cur_len = input_ids.shape[-1] + 1
        nb_scores = np.zeros(B)
        nb_tokens = np.zeros(B, dtype=np.int64)
        nb_idx = np.zeros(B, dtype=np.int64)
        beam_idx = 0
        for rank, (tok, sc, ind) in enumerate(zip(next_tokens, next_scores, next_indices)):
            stop = None if int(tok) in eos else toy_stop(stops, [int(x) for x in input_ids[ind][P:]] + [int(tok)])
            if int(tok) in eos:
                if rank >= B:
                    continue
                hyps.add(input_ids[ind].copy(), float(sc), cur_len - P,
                         'bos' if int(tok) == 1 else 'eos')
            elif stop is not None:
                if rank >= B:
                    continue
                hyps.add(np.append(input_ids[ind], tok), float(sc), cur_len - P, 'string')
            else:
                nb_scores[beam_idx] = sc
                nb_tokens[beam_idx] = tok
                nb_idx[beam_idx] = ind
                beam_idx += 1
            if beam_idx == B:
                break
        assert beam_idx == B
        done = done or hyps.is_done(float(next_scores.max()), cur_len, P)
        beam_scores = nb_scores
        input_ids = np.concatenate([input_ids[nb_idx], nb_tokens[:, None]], axis=1)
        if done or input_ids.shape[-1] >= max_length:
            break
    if not done:
        for i in range(B):
            hyps.add(input_ids[i], float(beam_scores[i]), input_ids.shape[-1] - P, 'length')
    srt = sorted(hyps.beams, key=lambda x: x[0])
    out = []
    for _ in range(num_return):
        s, h, stop = srt.pop()
        out.append((s, [int(x) for x in h[P:]], stop))
    return out


def literal_greedy(model, prompt, max_new, length_penalty, controls=None):
    procs = literal_processors(controls, len(prompt))
    stops = (controls or {}).get('stops')
    seq = list(prompt)
    total = 0.0
    for t in range(1, max_new + 1):
        logits = _full_logits(model, seq)
        logits = apply_all(procs, np.asarray([seq]), logits[None, :].copy())[0]
        tok = int(np.argmax(logits))
        total += float(ref_beam.log_softmax64(logits)[tok])
        if tok in (1, 2):
            return [(total / t ** length_penalty, seq[len(prompt):], 'bos' if tok == 1 else 'eos')]
        seq.append(tok)
        if toy_stop(stops, seq[len(prompt):]) is not None:
            return [(total / t ** length_penalty, seq[len(prompt):], 'string')]
    return [(total / max_new ** length_penalty, seq[len(prompt):], 'length')]


def random_controls(rng, V):
    """Generation controls for a toy config: each one on or off at random."""
    c = {}
    if rng.random() < 0.5:
        c['repetition_penalty'] = float(rng.choice([1.3, 2.0, 0.7]))
    if rng.random() < 0.4:
        # (size 1 on a toy vocabulary soon bans every token: all scores
        # -inf, where the order among equal candidates is all that decides)
        c['no_repeat_ngram_size'] = int(rng.integers(2, 4))
    if rng.random() < 0.4:
        c['min_new_tokens'] = int(rng.integers(1, 8))
    if rng.random() < 0.4:
        c['stops'] = [toy_text([int(x) for x in rng.integers(3, V, size=int(rng.integers(1, 3)))])
                      for _ in range(int(rng.integers(1, 3)))]
    return c


def compare_toy(n_configs=150, seed=1234, verbose=False, with_controls=False):
    """Returns (n_compared, list of mismatch descriptions)."""
    rng = np.random.default_rng(seed)
    bad = []
    done = 0
    for ci in range(n_configs):
        V = int(rng.integers(6, 20))
        S = int(rng.integers(6, 30))
        model = ToyModel(V, S, seed=int(rng.integers(1 << 30)), end_bias=float(rng.uniform(-3, 1)),
                         sharp=float(rng.uniform(0.5, 3.0)))
        P = int(rng.integers(1, min(5, S)))
        prompt = [1] + [int(x) for x in rng.integers(3, V, size=P - 1)]
        B = int(rng.choice([1, 2, 3, 4, 5]))
        B = min(B, V - 2)
        R = int(rng.integers(1, B + 1))
        lp = float(rng.choice([0.0, 1.0, 2.0, 0.5, -1.0]))
        es = [False, True, 'never'][int(rng.integers(3))]
        n = int(rng.integers(P, S + 1))
        mx = ref_beam.max_new_tokens(n, S, P)
        ctl = random_controls(rng, V) if with_controls else None
        stop_fn = (lambda toks, c=ctl: toy_stop(c['stops'], toks)) if ctl and ctl.get('stops') else None
        res = ref_beam.beam_search(ref_beam.GenericStepper(model), prompt, mx, B, lp, es, R,
                                   controls=ctl, stop_fn=stop_fn)
        got = [(h.score, h.tokens, h.stop) for h in res.hyps]
        if B == 1:
            exp = literal_greedy(model, prompt, mx, lp, ctl)
        else:
            exp = literal_hf_beam_search(model, prompt, mx, B, lp, es, R, controls=ctl)
        ok = len(got) == len(exp) and all(
            g[1] == e[1] and g[2] == e[2] and (g[0] == e[0] or abs(g[0] - e[0]) <= 1e-9 * max(1, abs(e[0])))
            for g, e in zip(got, exp))
        done += 1
        if not ok:
            bad.append('config %d (V=%d S=%d P=%d n=%d B=%d R=%d lp=%s es=%s controls=%s): ref %s literal %s' % (
                ci, V, S, P, n, B, R, lp, es, ctl, got, exp))
        elif verbose:
            print('ok', ci, B, es, lp, [(round(s, 4), t, st) for s, t, st in got])
    return done, bad


def check_batch_stepper(model, prompt_tokens, steps=6, beams=3, seed=5):
    """LlamaBatchStepper vs per-beam ref_llama forward: returns max |diff|."""
    rng = np.random.default_rng(seed)
    bs = ref_beam.LlamaBatchStepper(model)
    gs = ref_beam.GenericStepper(model)
    st_b, lb = bs.prefill(prompt_tokens)
    st_g, lg = gs.prefill(prompt_tokens)
    worst = float(np.max(np.abs(lb - lg)))
    rows = 1
    pos = len(prompt_tokens) - 1
    for _ in range(steps):
        parents = [int(x) for x in rng.integers(0, rows, size=beams)]
        toks = [int(x) for x in rng.integers(3, model.config.vocab_size, size=beams)]
        pos += 1
        st_b, lb = bs.step(st_b, parents, toks, pos)
        st_g, lg = gs.step(st_g, parents, toks, pos)
        worst = max(worst, float(np.max(np.abs(lb - lg))))
        rows = beams
    return worst


if __name__ == '__main__':
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    cnt, bad = compare_toy(n, verbose='-v' in sys.argv)
    cnt2, bad2 = compare_toy(n, seed=4321, verbose='-v' in sys.argv, with_controls=True)
    for b in bad + bad2:
        print('MISMATCH', b)
    print('%d configs compared, %d mismatches; with controls %d, %d mismatches' % (cnt, len(bad), cnt2, len(bad2)))
    sys.exit(1 if bad or bad2 else 0)
