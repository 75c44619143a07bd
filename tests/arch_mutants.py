"""Metadata mutants of every architecture's random GGUF file, run by a
sanitizer build of run.c (tests/test_sanitize.sh).

Usage: arch_mutants.py RUN_BINARY TMP_DIR

For each architecture of tests/arch_models.py (and deepseek2), each numeric
metadata key of its file is set in turn to values a malformed or hostile
file could hold: 0, -1, 1, 2^31 - 1, 2^32 + 1, 2^63 - 1 and 1.5 (a float
where an integer belongs) for integer keys; 0, -0.5, 1e30, NaN and
infinity for float keys; and every key, whatever its type, in turn a
string, an empty array and an array of 3 integers (a vocabulary's token
types or scores shorter than its tokens, say). run.c must either run the
file (exit 0) or refuse it with one line on stderr that starts with
"run: " (exit 1), within 60 seconds, and the sanitizers must report
nothing (their reports exit with 99 under test_sanitize.sh's options).
Prints one PASS line an architecture (with the count of files run) or a
FAIL line for each file that broke the rule (at most 5 an architecture)."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import arch_models  # noqa: E402
from gguf_ref import write_gguf  # noqa: E402

INT_VALUES = (0, -1, 1, 2 ** 31 - 1, 2 ** 32 + 1, 2 ** 63 - 1, 1.5)
FLOAT_VALUES = (0.0, -0.5, 1e30, float("nan"), float("inf"))
ANY_VALUES = ("x", [], [1, 2, 3])
REPORT = ("runtime error", "AddressSanitizer", "LeakSanitizer")


def mutants(arch):
    """(key, value, metadata, tensors) for each mutant of arch's file."""
    meta, tensors = arch_models.arch_model(arch)
    for key, value in meta.items():
        numeric = not isinstance(value, bool) and isinstance(value, (int, float))
        for v in (() if not numeric else INT_VALUES if isinstance(value, int) else FLOAT_VALUES) + ANY_VALUES:
            changed = dict(meta)
            changed[key] = v
            yield key, v, changed, tensors


def verdict(run, path):
    """None if run.c ran or refused the file as it should, else why not."""
    try:
        r = subprocess.run([run, path, "-n", "8", "-i", "ab"], capture_output=True, text=True, errors="replace", timeout=60)
    except subprocess.TimeoutExpired:
        return "no exit within 60 s"
    lines = r.stderr.strip().splitlines()
    if any(word in r.stderr for word in REPORT):
        return "a sanitizer report (exit %d): %s" % (r.returncode, next(x for x in lines if any(w in x for w in REPORT))[:200])
    if r.returncode == 0:
        return None
    if r.returncode == 1 and len(lines) == 1 and lines[0].startswith("run: "):
        return None
    return "exit %d, stderr: %s" % (r.returncode, " / ".join(lines[-3:])[:300])


def main():
    run, tmp = sys.argv[1], sys.argv[2]
    os.makedirs(tmp, exist_ok=True)
    for arch in arch_models.ARCHS + ("deepseek2",):
        cases = []
        for i, (key, v, meta, tensors) in enumerate(mutants(arch)):
            path = os.path.join(tmp, "%s-%d.gguf" % (arch, i))
            write_gguf(path, meta, tensors)
            cases.append((key, v, path))
        with ThreadPoolExecutor(2) as pool:
            found = list(pool.map(lambda c: verdict(run, c[2]), cases))
        bad = [(key, v, why) for (key, v, _), why in zip(cases, found) if why]
        for key, v, why in bad[:5]:
            print("FAIL asan metadata mutant %s: %s = %r: %s" % (arch, key, v, why))
        if not bad:
            print("PASS asan metadata mutants of %s (%d files)" % (arch, len(cases)))
        for _, _, path in cases:
            os.remove(path)


if __name__ == "__main__":
    main()
