#!/usr/bin/env python3
"""Vet the cases of tests/test_beam.py (developer tool, no ./run needed).

For every case: run the reference in float64 and with float32 sums/log-probs
(how the C code and HF compute), report whether both give the same tokens and
stop reasons, the closest decision margin, steps, time, and a summary of the
returned hypotheses.  A case whose two variants differ hinges on rounding and
should not be in the suite.

Usage: python3 tests/beam_vet.py [MODELS_DIR] [name-substring]
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import ref_beam  # noqa: E402
import ref_llama  # noqa: E402
import test_beam  # noqa: E402


def main():
    mdir = sys.argv[1] if len(sys.argv) > 1 else test_beam.MODELS_DIR
    filt = sys.argv[2] if len(sys.argv) > 2 else ''
    m = ref_llama.Model.load(os.path.join(mdir, 'stories260K.bin'))
    tok = ref_llama.Tokenizer.load(os.path.join(mdir, 'tok512.bin'), m.config.vocab_size)
    cases = list(test_beam.CASES) + [
        ('b1_greedy', 'Once upon a time', 100, 1, '1', '0', 1),
        ('b1_greedy_never', 'Lily', 0, 1, '2', 'never', 1),
    ]
    total = 0.0
    bad = 0
    for (name, prompt, n, B, lp, e, r) in cases:
        if filt not in name:
            continue
        t0 = time.time()
        l64, r64 = ref_beam.reference(m, tok, prompt, n, B, float(lp),
                                      ref_beam.parse_early_stopping(e), r)
        dt = time.time() - t0
        total += dt
        l32, r32 = ref_beam.reference(m, tok, prompt, n, B, float(lp),
                                      ref_beam.parse_early_stopping(e), r, precision='float32')
        same = [(d['tokens'], d['stop']) for d in l64] == [(d['tokens'], d['stop']) for d in l32]
        sdiff = max([abs(a['score'] - b['score']) / max(1e-9, abs(a['score']))
                     for a, b in zip(l64, l32)] or [0])
        bad += not same
        print('%-34s %s %5.1fs steps %3d/%3d early %-5s margin %.2g (%s) f32 score rel diff %.1e' % (
            name, 'SAME' if same else 'DIFF', dt, r64.steps, r64.max_new, r64.done_early,
            r64.min_margin, r64.margin_where, sdiff))
        for d in l64:
            print('    %d %.6f %-6s %3d tokens %r' % (d['rank'], d['score'], d['stop'],
                                                    len(d['tokens']), d['text_bytes'][:60]))
        if B == 1:
            # would beam-search semantics at B=1 give something else?
            st = ref_beam.LlamaBatchStepper(m)
            pt = tok.encode(prompt.encode(), True, False)
            mx = ref_beam.max_new_tokens(n, m.config.seq_len, len(pt))
            alt = ref_beam.beam_search(st, pt, mx, 1, float(lp), ref_beam.parse_early_stopping(e), 1,
                                       greedy_for_one=False)
            print('    (beam machinery at B=1 would give: %s)' % alt.hyps[0])
    print('reference time %.1fs, %d case(s) differ in float32' % (total, bad))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
