#!/usr/bin/env bash
# Fuzz targets (tests/fuzz/, built by `make fuzz-build` with clang's
# libFuzzer): each replays its seed corpus, regression inputs included, then
# fuzzes for ${FUZZ_SECONDS:-5} seconds. One PASS/FAIL line per replay and per
# run; SKIP when the targets are not built (no libFuzzer). Scratch output in
# $TEST_TMP/fuzz.
set -u
cd "$(dirname "$0")/.." || exit 1
if ! ls tests/.bin/fuzz_* >/dev/null 2>&1 || [ ! -x tests/.bin/fuzz_options ]; then
    echo "SKIP fuzz: tests/.bin/fuzz_* not built (clang -fsanitize=fuzzer unavailable? run make fuzz-build)"
    exit 0
fi
exec bash tests/fuzz/run_fuzz.sh "${FUZZ_SECONDS:-5}" "${TEST_TMP:-tests/.tmp}/fuzz"
