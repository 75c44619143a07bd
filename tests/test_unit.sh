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
status=0
# tests/.bin/unit_native: the same tests built as ./runomp (vector kernels);
# tests/.bin/unit_avx2 (x86-64): built as an AVX2 machine's ./runomp, run
# where this machine has AVX2, FMA and F16C; tests/.bin/unit_avxvnni: the
# same with AVX-VNNI, run where the machine has that too
has_avx2() { grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; }
for bin in "$BIN" tests/.bin/unit_native tests/.bin/unit_avx2 tests/.bin/unit_avxvnni; do
    if [ "$bin" = tests/.bin/unit_avx2 ] || [ "$bin" = tests/.bin/unit_avxvnni ]; then
        case "$(uname -m)" in x86_64 | amd64) ;; *) continue ;; esac
        if ! has_avx2; then
            echo "SKIP unit ${bin#tests/.bin/unit_}: this machine has no AVX2, FMA and F16C"
            continue
        fi
    fi
    if [ "$bin" = tests/.bin/unit_avxvnni ] && ! grep -qw avx_vnni /proc/cpuinfo; then
        echo "SKIP unit avxvnni: this machine has no AVX-VNNI (avx_vnni in /proc/cpuinfo)"
        continue
    fi
    if [ "$bin" != "$BIN" ] && [ ! -x "$bin" ]; then
        echo "SKIP unit ${bin#tests/.bin/unit_}: $bin is missing (build it with: make $bin)"
        continue
    fi
    timeout 120 "$bin"
    s=$?
    if [ $s -ge 124 ]; then
        echo "FAIL unit: $bin ended with status $s (timeout or signal)"
    fi
    [ $s -ne 0 ] && status=$s
done
exit $status
