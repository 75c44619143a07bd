"""The verdict lines the runner counts (tests/run_tests.sh), for Python suites.

case(name, fn) runs one test case and prints exactly one line for it:
`PASS name`, `SKIP name: why` (fn raised Skip) or `FAIL name: why` (an
assertion or any other exception), so that a crash never goes uncounted.
COUNTS totals them for the suite's own summary and exit status.
"""
import traceback

COUNTS = {'PASS': 0, 'FAIL': 0, 'SKIP': 0}


class Skip(Exception):
    pass


def verdict(kind, name, reason=None):
    COUNTS[kind] += 1
    line = '%s %s' % (kind, name) if reason is None else '%s %s: %s' % (kind, name, reason)
    print(line.replace('\n', '\\n'), flush=True)  # one line per verdict


def case(name, fn):
    try:
        fn()
        verdict('PASS', name)
    except Skip as e:
        verdict('SKIP', name, str(e))
    except AssertionError as e:
        verdict('FAIL', name, str(e))
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()
        where = tb[-3].strip() if len(tb) >= 3 else ''
        verdict('FAIL', name, 'exception %s: %s (%s)' % (type(e).__name__, e, where))
