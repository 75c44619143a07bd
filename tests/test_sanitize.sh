#!/usr/bin/env bash
# run.c and the unit tests built with AddressSanitizer (+ LeakSanitizer) and
# UndefinedBehaviorSanitizer (make builds tests/.bin/run_asan and unit_asan):
# the unit tests, the golden outputs, beam search, chat, JSON output, the
# dim-8 models of the fuzz corpus (every checkpoint layout) and bad inputs.
# A case fails on any sanitizer report, whatever the exit status.
set -u
cd "$(dirname "$0")/.." || exit 1
ASAN_RUN="${ASAN_RUN:-tests/.bin/run_asan}"
UNIT_ASAN="${UNIT_ASAN:-tests/.bin/unit_asan}"
M="${MODELS_DIR:-../shared/models}"
T="${TEST_TMP:-/tmp}/sanitize"
rm -rf "$T" && mkdir -p "$T"
# reports exit with 99; huge allocations return NULL (run.c's own
# out-of-memory error) instead of being a report
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=1:exitcode=99:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:exitcode=99:${UBSAN_OPTIONS:-}"
REPORT='runtime error|AddressSanitizer|LeakSanitizer'

if [ ! -x "$ASAN_RUN" ]; then
    echo "SKIP asan: $ASAN_RUN not built (make tests/.bin/run_asan)"
    exit 0
fi

n=0
LAST_OUT=""
LAST_ERR=""
# check NAME WANT_STATUS CMD...: runs CMD with stdin from $STDIN (default
# /dev/null); fails (printing FAIL) on a sanitizer report in its stderr or
# another exit status. Leaves the outputs in $LAST_OUT and $LAST_ERR.
check() {
    local name="$1" want="$2"
    shift 2
    n=$((n + 1))
    LAST_OUT="$T/$n.out" LAST_ERR="$T/$n.err"
    "$@" <"${STDIN:-/dev/null}" >"$LAST_OUT" 2>"$LAST_ERR"
    local status=$?
    if grep -qE "$REPORT" "$LAST_ERR"; then
        echo "FAIL asan $name: sanitizer report (exit $status): $(grep -m1 -E "$REPORT" "$LAST_ERR" | cut -c1-200) (log: $LAST_ERR)"
        return 1
    fi
    if [ "$status" -ne "$want" ]; then
        echo "FAIL asan $name: exit $status, expected $want: $(head -c 200 "$LAST_ERR")"
        return 1
    fi
    return 0
}
pass() { echo "PASS asan $1"; }

# ---- unit tests ---------------------------------------------------------------
if [ -x "$UNIT_ASAN" ]; then
    if check "unit tests" 0 env TEST_TMP="$T" MODELS_DIR="$M" "$UNIT_ASAN"; then
        pass "unit tests ($(grep -c '^PASS' "$LAST_OUT") passed, $(grep -c '^SKIP' "$LAST_OUT") skipped)"
    fi
elif [ ! -f tests/unit.c ]; then
    echo "SKIP asan unit tests: tests/unit.c does not exist yet"
else
    echo "FAIL asan unit tests: $UNIT_ASAN not built (make tests/.bin/unit_asan)"
fi

# ---- the real model -------------------------------------------------------------
if [ -f "$M/stories260K.bin" ] && [ -f "$M/tok512.bin" ]; then
    MODEL=("$M/stories260K.bin" -z "$M/tok512.bin")
    # the documented outputs (tests/golden/cases.txt)
    while IFS='|' read -r expected args; do
        case "$expected" in '' | '#'*) continue ;; esac
        expected=$(echo "$expected" | xargs)
        eval "set -- $args"
        if check "golden $expected" 0 "$ASAN_RUN" "${MODEL[@]}" "$@"; then
            if cmp -s "$LAST_OUT" "tests/golden/$expected"; then pass "golden $expected"; else
                echo "FAIL asan golden $expected: output differs from tests/golden/$expected"
            fi
        fi
    done <tests/golden/cases.txt
    check "beam search -b 4 -n 60" 0 "$ASAN_RUN" "${MODEL[@]}" -b 4 -n 60 -i "Once upon a time" &&
        pass "beam search -b 4 -n 60"
    STDIN="$T/chat.in"
    printf 'hi\nmore\n' >"$STDIN"
    check "chat -n 120" 0 "$ASAN_RUN" "${MODEL[@]}" -m chat -y sys -n 120 && pass "chat -n 120"
    check "chat with beams -b 2 -n 160" 0 "$ASAN_RUN" "${MODEL[@]}" -m chat -y sys -n 160 -b 2 -f json &&
        pass "chat with beams -b 2 -n 160"
    STDIN=/dev/null
    check "chat at end of input" 0 "$ASAN_RUN" "${MODEL[@]}" -m chat -n 60 && pass "chat at end of input"
    if check "json beams -b 3 -r 3" 0 "$ASAN_RUN" "${MODEL[@]}" -f json -b 3 -r 3 -n 30 -i "Once upon"; then
        if [ "$(grep -c '^{"rank"' "$LAST_OUT")" -eq 3 ]; then pass "json beams -b 3 -r 3"; else
            echo "FAIL asan json beams -b 3 -r 3: not 3 JSON lines: $(head -c 200 "$LAST_OUT")"
        fi
    fi
    check "json sampled" 0 "$ASAN_RUN" "${MODEL[@]}" -f json -n 30 -s 5 -i $'caf\xc3\xa9 \xff "quoted"' &&
        pass "json sampled"
    check "prompt longer than -n" 0 "$ASAN_RUN" "${MODEL[@]}" -n 3 -i "Once upon a time there was" &&
        pass "prompt longer than -n"
else
    echo "SKIP asan real model: $M/stories260K.bin or tok512.bin not found (set MODELS_DIR)"
fi

# ---- the dim-8 models of the fuzz corpus (no MODELS_DIR needed) ----------------
SEEDS=tests/fuzz/corpus/checkpoint
tail -c +3 tests/fuzz/corpus/tokenizer/v32 >"$T/tok32.bin" # the vocabulary-32 tokenizer
for model in v0-shared v0-separate-classifier v0-gqa v1-shared v1-separate v2-int8 v2-int8-separate; do
    if [ ! -f "$SEEDS/$model" ]; then
        echo "FAIL asan tiny $model: $SEEDS/$model missing"
        continue
    fi
    check "tiny $model sampled" 0 "$ASAN_RUN" "$SEEDS/$model" -z "$T/tok32.bin" -n 12 -s 7 && pass "tiny $model sampled"
    if check "tiny $model beams json" 0 "$ASAN_RUN" "$SEEDS/$model" -z "$T/tok32.bin" -n 12 -b 3 -r 2 -f json; then
        if [ "$(grep -c '^{"rank"' "$LAST_OUT")" -eq 2 ]; then pass "tiny $model beams json"; else
            echo "FAIL asan tiny $model beams json: not 2 JSON lines"
        fi
    fi
done
# multi-turn chats: this model's replies end early (see make_seeds.py)
tail -c +3 tests/fuzz/corpus/tokenizer/v300 >"$T/tok300.bin"
printf 'hi\nmore\nand more\n' >"$T/chat3.in"
STDIN="$T/chat3.in"
for opts in "-s 1" "-t 0" "-b 3" "-b 2 -f json"; do
    # shellcheck disable=SC2086
    check "tiny chat, 3 turns, $opts" 0 "$ASAN_RUN" "$SEEDS/v1-chat-v300" -z "$T/tok300.bin" -m chat -y sys -n 200 $opts &&
        pass "tiny chat, 3 turns, $opts"
done
STDIN=/dev/null
# regression: an int8 model with a NaN norm weight (its NaN activations were
# converted to int16, undefined behaviour)
check "regress int8 NaN norm" 0 "$ASAN_RUN" "$SEEDS/regress-int8-nan-norm" -z "$T/tok32.bin" -n 6 -t 0 &&
    pass "regress int8 NaN norm"

# ---- bad inputs: the documented status, a "run: " error, no report --------------
head -c 600 "$SEEDS/v0-shared" >"$T/truncated.bin"
: >"$T/empty.bin"
head -c 100 "$T/tok32.bin" >"$T/tok-truncated.bin"
TINY="$SEEDS/v0-shared"
bad() { # bad NAME STATUS ARGS...
    local name="$1" want="$2"
    shift 2
    check "bad input: $name" "$want" "$ASAN_RUN" "$@" || return
    if [ "$(head -c 5 "$LAST_ERR")" != "run: " ]; then
        echo "FAIL asan bad input: $name: stderr does not start with 'run: ': $(head -c 200 "$LAST_ERR")"
    else
        pass "bad input: $name"
    fi
}
bad "truncated checkpoint" 1 "$T/truncated.bin" -z "$T/tok32.bin"
bad "empty checkpoint" 1 "$T/empty.bin" -z "$T/tok32.bin"
bad "checkpoint is a directory" 1 "$T" -z "$T/tok32.bin"
bad "missing checkpoint" 1 "$T/none.bin" -z "$T/tok32.bin"
bad "header only" 1 "$SEEDS/v1-header-only" -z "$T/tok32.bin"
bad "bad heads" 1 "$SEEDS/v0-bad-heads" -z "$T/tok32.bin"
bad "unknown version" 1 "$SEEDS/v9-unknown-version" -z "$T/tok32.bin"
bad "truncated tokenizer" 1 "$TINY" -z "$T/tok-truncated.bin"
bad "missing tokenizer" 1 "$TINY" -z "$T/none.bin"
if [ -f "$M/tok512.bin" ]; then bad "wrong tokenizer" 1 "$TINY" -z "$M/tok512.bin"; fi
bad "byte without a token" 1 "$TINY" -z "$T/tok32.bin" -i "x"
bad "no arguments" 2
bad "flag first" 2 -t 1
bad "unknown flag" 2 "$TINY" -q 1
bad "flag without value" 2 "$TINY" -n
bad "bad number" 2 "$TINY" -t abc
bad "negative steps" 2 "$TINY" -n -1
bad "top-p above 1" 2 "$TINY" -p 2
bad "bad mode" 2 "$TINY" -m foo
bad "bad format" 2 "$TINY" -f xml
bad "-r above -b" 2 "$TINY" -b 2 -r 3
bad "more beams than tokens" 2 "$TINY" -z "$T/tok32.bin" -b 33
bad "seed overflow" 2 "$TINY" -s 99999999999999999999
bad "prompt beyond the context" 2 "$TINY" -z "$T/tok32.bin" -n 16 -i "$(printf '\001%.0s' $(seq 40))"
