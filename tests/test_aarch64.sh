#!/usr/bin/env bash
# aarch64 Linux under emulation: run.c cross-compiled with aarch64-linux-gnu-gcc
# through the Makefile (a copy of run.c, Makefile and tests/unit.c in a
# scratch directory, so the host's builds are left alone), run by qemu-aarch64
# (-cpu max: every extension, dotprod included). Three builds:
#   plain     make run                                    plain C, llama2.c's sums
#   neon      make runfast EXTRA_CFLAGS=-march=armv8-a    NEON, int16 multiplies
#   dotprod   make runfast EXTRA_CFLAGS="-march=armv8.2-a+dotprod -fopenmp"
#                                                         NEON sdot, 2 threads
# For each: built without a warning, `--version` names its kernels, and the
# golden, reference (tests/test_reference.py, which applies to ./runfast the
# checks it applies to every vector build), GGUF (tests/test_gguf.py: every
# type's logits against its references through the build's kernels, NEON's
# 4-bit one included) and unit suites pass, run whole.
# SKIPs when the cross-compiler or qemu is absent (Debian: gcc-aarch64-linux-gnu,
# libgomp1-arm64-cross, qemu-user).
set -u
cd "$(dirname "$0")/.."
# the builds here take no flags from a `make test` above them
unset MAKEFLAGS MFLAGS MAKELEVEL
CROSS_CC="${AARCH64_CC:-aarch64-linux-gnu-gcc}"
QEMU="${QEMU_AARCH64:-qemu-aarch64}"
SYSROOT="${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
PYTHON="${PYTHON:-python3}"
for tool in "$CROSS_CC" "$QEMU"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "SKIP aarch64: $tool not found (Debian: gcc-aarch64-linux-gnu libgomp1-arm64-cross qemu-user)"
        exit 0
    fi
done
# TEST_TMP absolute (/tmp/x) or relative to the repository
case "${TEST_TMP:-tests/.tmp}" in
    /*) WORK="$TEST_TMP/aarch64" ;;
    *) WORK="$(pwd)/${TEST_TMP:-tests/.tmp}/aarch64" ;;
esac
rm -rf "$WORK" && mkdir -p "$WORK"

pass() { echo "PASS $1"; }
fail() { echo "FAIL $1: $2"; }
# runs a suite, prefixing its verdicts with the build; a suite that ends
# with a non-zero status and no FAIL line (a crash) is a FAIL with its tail
suite() {
    local label=$1 log="$WORK/suite.log" status; shift
    "$@" >"$log" 2>&1; status=$?
    sed -n -E "s/^(PASS|FAIL|SKIP) /\1 aarch64 $label: /p" "$log"
    if [ "$status" -ne 0 ] && ! grep -q '^FAIL' "$log"; then
        fail "aarch64 $label" "exited with status $status; last lines: $(tail -n 3 "$log" | tr '\n' '|')"
    fi
}
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

# build <label> <target> <expected kernels> <EXTRA_CFLAGS>
build() {
    local label=$1 target=$2 kernels=$3 extra=$4 dir="$WORK/$1"
    mkdir -p "$dir/src/tests" "$dir/bin"
    cp run.c Makefile "$dir/src/" && cp tests/unit.c "$dir/src/tests/"
    # -DRUN_SIMD for the unit tests of a fast build: the kernels it runs
    local unit_extra=$extra
    [ "$target" = run ] || unit_extra="$extra -DRUN_SIMD"
    if ! make -s -C "$dir/src" "$target" CC="$CROSS_CC" EXTRA_CFLAGS="$extra" >"$dir/build.log" 2>&1 ||
       ! make -s -C "$dir/src" tests/.bin/unit CC="$CROSS_CC" EXTRA_CFLAGS="$unit_extra" >>"$dir/build.log" 2>&1; then
        fail "aarch64 $label: build" "$(head -c 400 "$dir/build.log")"
        return 1
    fi
    if grep -q -i warning "$dir/build.log"; then fail "aarch64 $label: warning-free build" "$(grep -i -m 3 warning "$dir/build.log")"
    else pass "aarch64 $label: make $target EXTRA_CFLAGS='$extra' builds without warnings"; fi
    # the wrapper keeps the target's name: tests/test_reference.py tells the
    # exact build (./run) from the vector builds by it
    printf '#!/bin/sh\nOMP_NUM_THREADS=2 exec timeout 300 %s -cpu max -L %s %s "$@"\n' "$QEMU" "$SYSROOT" "$dir/src/$target" >"$dir/bin/$target"
    printf '#!/bin/sh\nexec timeout 300 %s -cpu max -L %s %s "$@"\n' "$QEMU" "$SYSROOT" "$dir/src/tests/.bin/unit" >"$dir/bin/unit"
    chmod +x "$dir/bin/$target" "$dir/bin/unit"
    local got
    got=$("$dir/bin/$target" --version 2>&1 | sed -n 's/^kernels: //p')
    if [ "$got" = "$kernels" ]; then pass "aarch64 $label: --version names kernels '$kernels'"
    else fail "aarch64 $label: --version" "kernels '$got', expected '$kernels'"; fi
}

# check <label> <target>: the suites with the build's wrapper as RUN
check() {
    local label=$1 target=$2 dir="$WORK/$1" t0
    local run="$dir/bin/$target"
    t0=$(date +%s)
    suite "$label golden" env RUN="$run" bash tests/test_golden.sh
    suite "$label unit" env TEST_TMP="$dir" "$dir/bin/unit"
    suite "$label reference" env RUN="$run" TEST_TMP="$dir" "$PYTHON" tests/test_reference.py
    suite "$label gguf" env RUN="$run" TEST_TMP="$dir" "$PYTHON" tests/test_gguf.py
    echo "aarch64 $label: golden, unit, reference and GGUF suites in $(elapsed "$t0")"
}

start=$(date +%s)
build plain run "plain C" "" && check plain run
build neon runfast "NEON" "-march=armv8-a" && check neon runfast
build dotprod runfast "NEON dotprod" "-march=armv8.2-a+dotprod -fopenmp" && check dotprod runfast
echo "aarch64: all builds and suites in $(elapsed "$start")"
