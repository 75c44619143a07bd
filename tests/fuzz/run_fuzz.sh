#!/usr/bin/env bash
# Runs the libFuzzer targets built by `make fuzz-build` (tests/.bin/fuzz_*).
#
#   bash tests/fuzz/run_fuzz.sh SECONDS OUT_DIR [TARGET...]
#
# For each target (default: all eight): first replays every file of its seed
# corpus tests/fuzz/corpus/<target>/ (the regress-* files are inputs that once
# failed), then fuzzes for SECONDS seconds starting from that corpus. New
# corpus entries and any crashing input go to OUT_DIR/<target>/, never to the
# committed corpus. Prints PASS/FAIL/SKIP lines in the test runner's format;
# a failure names the saved input and how to reproduce it.
#
# Environment: FUZZ_BIN (default tests/.bin), MODELS_DIR (the encode target
# also uses tok512.bin from there when present).
set -u
cd "$(dirname "$0")/../.." || exit 1
seconds="${1:-5}"
out="${2:-tests/fuzz/.out}"
shift 2 2>/dev/null || shift $#
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(checkpoint tokenizer encode options generate batch http gguf schema)
bin_dir="${FUZZ_BIN:-tests/.bin}"
export MODELS_DIR="${MODELS_DIR:-../shared/models}"
# leaks after a caught error are expected (see fuzz_common.h); every
# sanitizer report is fatal
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"

max_len() {
    case "$1" in
        options | generate) echo 1024 ;;
        schema) echo 4096 ;;
        checkpoint) echo 16384 ;;
        gguf) echo 32768 ;;
        *) echo 8192 ;;
    esac
}

# the failing check or sanitizer report in a log, in one line
why() {
    grep -m1 -E 'fuzz check failed|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error|SUMMARY' "$1" |
        cut -c1-300
}

for t in "${targets[@]}"; do
    bin="$bin_dir/fuzz_$t"
    seeds="tests/fuzz/corpus/$t"
    if [ ! -x "$bin" ]; then
        echo "SKIP fuzz $t: $bin not built (clang's libFuzzer unavailable? see make fuzz-build)"
        continue
    fi
    dir="$out/$t"
    rm -rf "$dir" && mkdir -p "$dir/new"
    n_seeds=$(find "$seeds" -type f | wc -l)
    # files given one by one run once each, without fuzzing
    if find "$seeds" -type f -print0 | xargs -0 "$bin" >"$dir/replay.log" 2>&1; then
        echo "PASS fuzz-replay $t ($n_seeds seeds)"
    else
        echo "FAIL fuzz-replay $t: a seed fails: $(why "$dir/replay.log") (log: $dir/replay.log)"
        echo "SKIP fuzz $t: not fuzzed while a seed fails (fuzz-replay $t)"
        continue
    fi
    "$bin" -max_total_time="$seconds" -timeout=10 -max_len="$(max_len "$t")" -print_final_stats=1 \
        -artifact_prefix="$dir/" "$dir/new" "$seeds" >"$dir/fuzz.log" 2>&1
    status=$?
    runs=$(grep -m1 '^stat::number_of_executed_units' "$dir/fuzz.log" | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+' "$dir/fuzz.log" | tail -n1 | grep -o 'cov: [0-9]*')
    crash=$(find "$dir" -maxdepth 1 -type f \( -name "crash-*" -o -name "leak-*" -o -name "timeout-*" -o -name "oom-*" \) | head -n1)
    if [ "$status" -eq 0 ] && [ -z "$crash" ]; then
        echo "PASS fuzz $t (${runs:-?} inputs in ${seconds} s, ${cov:-cov: ?})"
    else
        # the input itself goes into the line too, for logs that outlive the
        # scratch directory (CI prints only the PASS/FAIL/SKIP lines)
        b64=""
        if [ -n "$crash" ] && [ "$(wc -c <"$crash")" -le 8192 ]; then b64="; input as base64: $(base64 -w0 "$crash")"; fi
        echo "FAIL fuzz $t: exit $status: $(why "$dir/fuzz.log"); input saved as ${crash:-?};" \
            "reproduce: $bin ${crash:-<input>} (log: $dir/fuzz.log)$b64"
    fi
done
