#!/usr/bin/env python3
"""How sharp is tests/test_beam.py?  (developer tool, no ./run needed)

Each mutant is a copy of tests/ref_beam.py with one rule changed the way an
implementation could plausibly get it wrong.  For every case of the suite the
mutant's result is compared with the true reference's (tokens and stop
reasons, and scores at the suite's tolerance); a mutant that no case tells
apart is a rule the suite does not pin down.

Usage: python3 tests/beam_mutants.py [MODELS_DIR] [mutant-name ...]
"""
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import beam_vet  # noqa: E402
import ref_beam  # noqa: E402
import test_beam  # noqa: E402

MUTANTS = {
    # length of a finished hypothesis without its end token
    'length_without_end_token': (
        "pool.add(beam_tokens[b], s, t, STOP_NAMES[v], t)",
        "pool.add(beam_tokens[b], s, max(1, t - 1), STOP_NAMES[v], t)"),
    # the prompt counted in the length (old HF behaviour); +5 stands in for P
    'prompt_in_length': (
        "        return sum_logprobs / (gen_len ** self.length_penalty)",
        "        return sum_logprobs / ((gen_len + 5) ** self.length_penalty)"),
    # done test with the length before this step's token (HF before PR #21993)
    'done_test_t_minus_1': (
        "            highest = best_sum / (t ** lp)",
        "            highest = best_sum / (max(1, t - 1) ** lp)"),
    # done test with the best running (non-end) candidate instead of the best one
    'done_test_best_non_end': (
        "        best_sum = float(flat[order[0]])",
        "        best_sum = max(float(flat[i]) for i in order[:4 * B] if int(i) % V not in END_TOKENS)"),
    # "never" computed like False
    'never_like_false': (
        "        if self.early_stopping == 'never' and lp > 0.0:",
        "        if False:"),
    # "never" with max_new + 1 as the attainable length
    'never_max_new_plus_1': (
        "highest = best_sum / (self.max_new ** lp)",
        "highest = best_sum / ((self.max_new + 1) ** lp)"),
    # early_stopping True treated like False
    'early_true_ignored': (
        "        if self.early_stopping is True:\n            return True\n        lp",
        "        lp"),
    # end tokens accepted at any rank / within 2B
    'end_token_any_rank': (
        "                if rank >= B:\n                    res.events",
        "                if False:\n                    res.events"),
    'end_token_rank_below_2B': (
        "                if rank >= B:\n                    res.events",
        "                if rank >= 2 * B:\n                    res.events"),
    # running beams join the pool at the end even when the search was done
    'finalize_even_when_done': (
        "    if not done:\n        # HF finalize",
        "    if True:\n        # HF finalize"),
    # -n off by one either way
    'max_new_minus_1': (
        "    return max(0, n - prompt_len + 1)",
        "    return max(0, n - prompt_len)"),
    'max_new_plus_1': (
        "    return max(0, n - prompt_len + 1)",
        "    return max(0, min(seq_len - prompt_len + 1, n - prompt_len + 2))"),
    # n above seq_len not clamped (only visible through 'never' here)
    'n_not_clamped': (
        "    if n <= 0 or n > seq_len:\n        n = seq_len",
        "    if n <= 0:\n        n = seq_len"),
    # B=1 through the beam rules instead of greedy
    'b1_beam_rules': (
        "    if B == 1 and greedy_for_one:",
        "    if False:"),
    # pool keeps hypotheses equal to the worst (only differs on exact ties)
    'pool_accepts_ties': (
        "or score > self.worst_score:",
        "or score >= self.worst_score:"),
}


def main():
    mdir = sys.argv[1] if len(sys.argv) > 1 else test_beam.MODELS_DIR
    names = sys.argv[2:] or list(MUTANTS)
    src = open(os.path.join(HERE, 'ref_beam.py')).read()
    models, cases = beam_vet.models_and_cases(mdir)
    base = {}
    for (label, name, prompt, n, B, lp, e, r) in cases:
        m, tok = models[label]
        base[name] = ref_beam.reference(m, tok, prompt, n, B, float(lp),
                                        ref_beam.parse_early_stopping(e), r)
    uncaught = []
    for mname in names:
        a, b = MUTANTS[mname]
        if a not in src:
            print('%-28s (pattern not found in ref_beam.py; update the mutant)' % mname)
            continue
        mod = types.ModuleType('mutant_' + mname)
        mod.__file__ = os.path.join(HERE, 'ref_beam.py')
        exec(compile(src.replace(a, b), 'mutant_' + mname, 'exec'), mod.__dict__)
        caught = []
        for (label, name, prompt, n, B, lp, e, r) in cases:
            m, tok = models[label]
            try:
                lines, _ = mod.reference(m, tok, prompt, n, B, float(lp),
                                         mod.parse_early_stopping(e), r)
            except Exception:   # e.g. running past seq_len: a crash is caught too
                caught.append(name + '(crash)')
                continue
            exp, res = base[name]
            got = [{'rank': d['rank'], 'score': d['score'], 'tokens': d['tokens'],
                    'stop': d['stop'], 'text': d['text_bytes'].decode('latin-1')} for d in lines]
            try:
                test_beam.compare(got, exp, {'min_margin': None}, check_score=B > 1)
            except AssertionError:
                caught.append(name)
        if not caught:
            uncaught.append(mname)
        print('%-28s caught by %2d/%d cases: %s' % (mname, len(caught), len(cases),
                                                   ' '.join(caught)), flush=True)
    print('%d mutant(s) not caught: %s' % (len(uncaught), ' '.join(uncaught)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
