#!/usr/bin/env bash
# Test runner: runs every suite in tests/ and totals their verdicts.
#
# A suite is any tests/test_*.sh (run with bash) or tests/test_*.py (run with
# $PYTHON). Each prints one line per case:  PASS <name> | FAIL <name>: why |
# SKIP <name>: why.  This script counts those lines and ends with the line
#   N passed, M failed, K skipped
# It exits non-zero when any case failed or a suite crashed.
#
# Environment given to suites:
#   RUN         the binary under test (default ./run)
#   MODELS_DIR  real models (default ../shared/models); suites SKIP when absent
#   PYTHON      interpreter with numpy (default python3)
#   TEST_TMP    scratch directory (tests/.tmp), wiped at the start
#   SUITES      optional space-separated list of suite names to run (e.g. "test_golden.sh")
set -u
cd "$(dirname "$0")/.."
export RUN="${RUN:-./run}"
export MODELS_DIR="${MODELS_DIR:-../shared/models}"
export PYTHON="${PYTHON:-python3}"
export TEST_TMP="${TEST_TMP:-tests/.tmp}"
rm -rf "$TEST_TMP" && mkdir -p "$TEST_TMP"

passed=0; failed=0; skipped=0
for suite in tests/test_*.sh tests/test_*.py; do
    [ -e "$suite" ] || continue
    name=$(basename "$suite")
    if [ -n "${SUITES:-}" ] && ! [[ " $SUITES " == *" $name "* ]]; then continue; fi
    echo "== $name"
    log="$TEST_TMP/$name.log"
    case "$suite" in
        *.sh) bash "$suite" >"$log" 2>&1 ;;
        *.py) "$PYTHON" "$suite" >"$log" 2>&1 ;;
    esac
    status=$?
    grep -E '^(PASS|FAIL|SKIP)' "$log"
    p=$(grep -c '^PASS' "$log"); f=$(grep -c '^FAIL' "$log"); s=$(grep -c '^SKIP' "$log")
    if [ "$status" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name: suite exited with status $status; last lines of its log:"
        tail -n 15 "$log" | sed 's/^/    /'
        f=1
    fi
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + s))
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
