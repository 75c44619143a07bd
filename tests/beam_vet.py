#!/usr/bin/env python3
"""Vet the cases of tests/test_beam.py (developer tool, no ./run needed).

For every case the reference is run four ways: float64 (the reference
proper), float32 sums/log-probs (how the C code and HF compute), and float32
with every logit perturbed by up to 5e-7 relative (two seeds; a stand-in for
another float32 summation order in C).  A case whose variants disagree on
tokens or stop reasons hinges on rounding and should not be in the suite.
Also prints the closest decision margin, steps, CPU time and the returned
hypotheses.

Usage: python3 tests/beam_vet.py [MODELS_DIR] [name-substring]
(synthetic-model cases are named synth_*; their files go to $TEST_TMP or /tmp)
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ref_beam  # noqa: E402
import ref_llama  # noqa: E402
import test_beam  # noqa: E402

clock = time.process_time


def models_and_cases(mdir):
    """The two models of tests/test_beam.py (stories260K from mdir and the
    synthetic EOS model, written to $TEST_TMP or /tmp) and every case of the
    suite as (model label, name, prompt, n, B, lp, e, r)."""
    import beam_synth
    sdir = os.path.join(os.environ.get('TEST_TMP', '/tmp'), 'beam_synth')
    smodel, stok = beam_synth.write_synth(sdir)
    models = {}
    for label, mp, tp in (('stories', os.path.join(mdir, 'stories260K.bin'),
                           os.path.join(mdir, 'tok512.bin')), ('synth', smodel, stok)):
        mm = ref_llama.Model.load(mp)
        models[label] = (mm, ref_llama.Tokenizer.load(tp, mm.config.vocab_size))
    cases = [('stories',) + c for c in test_beam.CASES] + [
        ('stories', 'b1_json_is_greedy', 'Once upon a time', 100, 1, '1', '0', 1),
        ('stories', 'b1_json_is_greedy_even_with_never', 'Lily', 0, 1, '2', 'never', 1),
    ] + [('synth', 'synth_' + c[0]) + tuple(c[1:]) for c in test_beam.SYNTH_CASES] + [
        ('synth', 'synth_b1_json_is_greedy_eos', 'a dog ran', 0, 1, '1', '0', 1)]
    return models, cases


def main():
    mdir = sys.argv[1] if len(sys.argv) > 1 else test_beam.MODELS_DIR
    filt = sys.argv[2] if len(sys.argv) > 2 else ''
    models, cases = models_and_cases(mdir)
    total = 0.0
    bad = 0
    for (label, name, prompt, n, B, lp, e, r) in cases:
        if filt not in name:
            continue
        m, tok = models[label]
        es = ref_beam.parse_early_stopping(e)
        t0 = clock()
        l64, r64 = ref_beam.reference(m, tok, prompt, n, B, float(lp), es, r)
        dt = clock() - t0
        total += dt
        key = [(d['tokens'], d['stop']) for d in l64]
        verdicts = []
        worst = 0.0
        for label, kw in (('f32', {}),
                          ('noise1', {'stepper': ref_beam.NoisyStepper(ref_beam.LlamaBatchStepper(m), seed=1)}),
                          ('noise2', {'stepper': ref_beam.NoisyStepper(ref_beam.LlamaBatchStepper(m), seed=2)})):
            lx, _ = ref_beam.reference(m, tok, prompt, n, B, float(lp), es, r, precision='float32', **kw)
            same = key == [(d['tokens'], d['stop']) for d in lx]
            if same:
                worst = max([worst] + [abs(a['score'] - b['score']) / abs(a['score']) for a, b in zip(l64, lx)])
            verdicts.append(label + ('=' if same else '!'))
        ok = all(v.endswith('=') for v in verdicts)
        bad += not ok
        print('%-32s %-4s %s %5.1fs steps %3d/%3d early %-5s margin %.2g (%s) max score rel diff %.1e' % (
            name, 'OK' if ok else 'BAD', ' '.join(verdicts), dt, r64.steps, r64.max_new, r64.done_early,
            r64.min_margin, r64.margin_where, worst), flush=True)
        for d in l64:
            print('    %d %.6f %-6s %3d tokens %r' % (d['rank'], d['score'], d['stop'],
                                                    len(d['tokens']), d['text_bytes'][:60]))
        if B == 1:
            # would beam-search semantics at B=1 give something else?
            st = ref_beam.LlamaBatchStepper(m)
            pt = tok.encode(prompt.encode(), True, False)
            mx = ref_beam.max_new_tokens(n, m.config.seq_len, len(pt))
            alt = ref_beam.beam_search(st, pt, mx, 1, float(lp), es, 1, greedy_for_one=False)
            h = alt.hyps[0]
            print('    (beam machinery at B=1 would give: score %.6f stop %s %d tokens, %s)' % (
                h.score, h.stop, len(h.tokens),
                'same tokens' if h.tokens == l64[0]['tokens'] else 'different tokens'))
    print('reference CPU time %.1fs, %d case(s) not robust' % (total, bad))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
