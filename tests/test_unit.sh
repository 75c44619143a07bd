#!/usr/bin/env bash
# Runs the C unit tests (tests/unit.c, built by `make tests/.bin/unit`), which
# print their own PASS/FAIL/SKIP lines. MODELS_DIR and TEST_TMP pass through.
set -u
cd "$(dirname "$0")/.."
BIN=tests/.bin/unit
if [ ! -x "$BIN" ]; then
    echo "FAIL unit: $BIN is missing (build it with: make tests/.bin/unit)"
    exit 1
fi
export MODELS_DIR="${MODELS_DIR:-../shared/models}"
export TEST_TMP="${TEST_TMP:-/tmp}"
mkdir -p "$TEST_TMP"
timeout 120 "$BIN"
status=$?
if [ $status -ge 124 ]; then
    echo "FAIL unit: $BIN ended with status $status (timeout or signal)"
fi
exit $status
