#!/usr/bin/env bash
# run.c and the unit tests built with AddressSanitizer (+ LeakSanitizer) and
# UndefinedBehaviorSanitizer (make builds tests/.bin/run_asan, unit_asan and
# unit_asan_native): the unit tests (also on this machine's vector kernels),
# the golden outputs, beam search, chat, JSON output, the dim-8 models of the
# fuzz corpus (every checkpoint layout), metadata mutants of the GGUF
# architectures' random files and bad inputs.
# A case fails on any sanitizer report, whatever the exit status.
set -u
cd "$(dirname "$0")/.." || exit 1
ASAN_RUN="${ASAN_RUN:-tests/.bin/run_asan}"
UNIT_ASAN="${UNIT_ASAN:-tests/.bin/unit_asan}"
UNIT_ASAN_NATIVE="${UNIT_ASAN_NATIVE:-tests/.bin/unit_asan_native}"
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
# the vector kernels this machine has (-march=native; with VNNI, the packed
# weights). Without the leak checker: in the children that the tests fork
# after a forward pass it finds a thread of the parent in its registry and
# says so on stderr, which the one-line checks count; unit_asan checks leaks.
if [ -x "$UNIT_ASAN_NATIVE" ]; then
    if check "unit tests, -march=native" 0 env ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" TEST_TMP="$T" MODELS_DIR="$M" "$UNIT_ASAN_NATIVE"; then
        pass "unit tests, -march=native ($(grep -c '^PASS' "$LAST_OUT") passed, $(grep -c '^SKIP' "$LAST_OUT") skipped)"
    fi
elif [ -f tests/unit.c ]; then
    echo "FAIL asan unit tests, -march=native: $UNIT_ASAN_NATIVE not built (make tests/.bin/unit_asan_native)"
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
    # a batch: shared prefixes, beams, a request that waits for cache room,
    # one that never fits, a line refused after its stop strings and id were
    # read
    {
        printf '{"prompt":"Once upon a time, there was a little girl named Lily. She loved to play","id":"a"}\n'
        printf '{"prompt":"Once upon a time, there was a little girl named Lily. She loved to swim","seed":3}\n'
        printf '{"stop":["x","y"],"id":"r","prompt":"z","colour":1}\n'
        printf '{"prompt":"One day","beams":3,"return":2,"steps":60}\n'
        printf '{"prompt":"The cat \\u00e9\\ud83d\\ude00","steps":4}\n'
        printf '{"prompt":"big","beams":4,"steps":512}\n'
    } >"$T/batch.jsonl"
    check "batch --parallel 3 --kv-mb 1" 1 "$ASAN_RUN" "${MODEL[@]}" --batch "$T/batch.jsonl" --parallel 3 --kv-mb 1 -n 100 &&
        if [ "$(grep -c '"error"' "$LAST_OUT")" -eq 2 ] && [ "$(grep -c '"rank"' "$LAST_OUT")" -eq 5 ]; then
            pass "batch --parallel 3 --kv-mb 1"
        else echo "FAIL asan batch: want 5 results and 2 errors: $(head -c 300 "$LAST_OUT")"; fi
    check "generation controls, sampled" 0 "$ASAN_RUN" "${MODEL[@]}" -n 120 -s 3 --top-k 9 --min-p 0.05 \
        --repetition-penalty 1.2 --no-repeat-ngram-size 3 --min-new-tokens 20 --stop "Lily" --stop "." &&
        pass "generation controls, sampled"
    check "generation controls, beams" 0 "$ASAN_RUN" "${MODEL[@]}" -n 120 -b 4 -r 4 -f json --stop "," \
        --stop "the" --repetition-penalty 1.2 --no-repeat-ngram-size 2 &&
        pass "generation controls, beams"
    check "tokenize" 0 "$ASAN_RUN" "${MODEL[@]}" -m tokenize -f json -i $'caf\xc3\xa9 \xff "quoted"' &&
        pass "tokenize"
    check "prompt longer than -n" 0 "$ASAN_RUN" "${MODEL[@]}" -n 3 -i "Once upon a time there was" &&
        pass "prompt longer than -n"
    # every cache type: generate, beams, chat and a batch that waits for room
    for kv in f32 f16 q8_0; do
        check "--kv-type $kv generate" 0 "$ASAN_RUN" "${MODEL[@]}" --kv-type $kv -n 200 -s 2 -i "Once upon a time" &&
            pass "--kv-type $kv generate"
        check "--kv-type $kv beams" 0 "$ASAN_RUN" "${MODEL[@]}" --kv-type $kv -b 3 -r 2 -n 60 -f json -i "One day" &&
            pass "--kv-type $kv beams"
        STDIN="$T/chat.in"
        check "--kv-type $kv chat" 0 "$ASAN_RUN" "${MODEL[@]}" --kv-type $kv -m chat -y sys -n 120 && pass "--kv-type $kv chat"
        STDIN=/dev/null
        check "--kv-type $kv batch" 1 "$ASAN_RUN" "${MODEL[@]}" --kv-type $kv --batch "$T/batch.jsonl" --parallel 3 --kv-mb 1 -n 100 &&
            pass "--kv-type $kv batch"
    done
    # --keep past the context (512 positions): two requests share the blocks
    # of a 288-token prompt, and their rings copy them before writing
    P=$(for i in $(seq 1 48); do printf 'the cat sat. '; done)
    printf '{"prompt":"%s","seed":1,"id":"a"}\n{"prompt":"%s","seed":2,"id":"b"}\n' "$P" "$P" >"$T/keep.jsonl"
    check "--keep batch past the context" 0 "$ASAN_RUN" "${MODEL[@]}" --keep 4 --kv-type q8_0 --batch "$T/keep.jsonl" -n 620 \
        --min-new-tokens 300 && if grep -q "positions dropped" "$LAST_ERR" && [ "$(grep -c '"id"' "$LAST_OUT")" -eq 2 ]; then
            pass "--keep batch past the context"
        else echo "FAIL asan --keep batch: want 2 results and dropped positions: $(tail -c 300 "$LAST_ERR")"; fi
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
for opts in "-s 1" "-t 0" "-b 3" "-b 2 -f json" "-s 2 --stop e --top-k 5 --repetition-penalty 1.3" \
    "-b 3 --stop a --stop the --no-repeat-ngram-size 2 --min-new-tokens 3 -f json"; do
    # shellcheck disable=SC2086
    check "tiny chat, 3 turns, $opts" 0 "$ASAN_RUN" "$SEEDS/v1-chat-v300" -z "$T/tok300.bin" -m chat -y sys -n 200 $opts &&
        pass "tiny chat, 3 turns, $opts"
done
STDIN=/dev/null
# a byte-level BPE (tk42) tokenizer with a version 4 model of its vocabulary
tail -c +3 tests/fuzz/corpus/tokenizer/tk42-v298 >"$T/tok298.tk42"
if "${PYTHON:-python3}" export.py random "$T/v4-298.bin" --shape "t=16,32,1,2,1,298,64" --seed 2 --version 4 \
    --encoding int8 --group-size 16 >/dev/null 2>&1; then
    TK=("$T/v4-298.bin" -z "$T/tok298.tk42")
    check "tk42 sampled" 0 "$ASAN_RUN" "${TK[@]}" -n 30 -s 3 -i $'the theand 123456 \xc3\xa9t\xff\r\n' && pass "tk42 sampled"
    check "tk42 beams json" 0 "$ASAN_RUN" "${TK[@]}" -n 20 -b 3 -r 2 -f json -i "and the" && pass "tk42 beams json"
    STDIN="$T/chat3.in"
    check "tk42 chat (llama2 template)" 0 "$ASAN_RUN" "${TK[@]}" -m chat -y sys -n 60 --chat-template llama2 &&
        pass "tk42 chat (llama2 template)"
    check "tk42 chat, llama3 template without its tokens" 2 "$ASAN_RUN" "${TK[@]}" -m chat -y sys -n 60 &&
        pass "tk42 chat, llama3 template without its tokens"
    STDIN=/dev/null
else
    echo "FAIL asan tk42: export.py random failed (PYTHON=${PYTHON:-python3} needs numpy)"
fi
STDIN=/dev/null
# regression: an int8 model with a NaN norm weight (its NaN activations were
# converted to int16, undefined behaviour)
check "regress int8 NaN norm" 0 "$ASAN_RUN" "$SEEDS/regress-int8-nan-norm" -z "$T/tok32.bin" -n 6 -t 0 &&
    pass "regress int8 NaN norm"

# ---- GGUF architectures: each metadata key of each architecture's random
# file set to 0, -1, 2^31 - 1, NaN, a string, short arrays and the like
# (tests/arch_mutants.py): run or refused in one "run: " line, no report ----------
"${PYTHON:-python3}" tests/arch_mutants.py "$ASAN_RUN" "$T/mutants" ||
    echo "FAIL asan metadata mutants: tests/arch_mutants.py failed (PYTHON=${PYTHON:-python3} needs numpy)"

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
if check "bad input: no arguments" 2 "$ASAN_RUN"; then
    if head -n 1 "$LAST_ERR" | grep -q '^Usage:'; then pass "bad input: no arguments (the usage)"
    else echo "FAIL asan bad input: no arguments: stderr is not the usage: $(head -c 200 "$LAST_ERR")"; fi
fi
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
# a prompt beyond -n: what fits is printed, with a warning
if check "prompt beyond the context" 0 "$ASAN_RUN" "$TINY" -z "$T/tok32.bin" -n 16 -i "$(printf '\001%.0s' $(seq 40))"; then
    if grep -q '^run: warning: the prompt is' "$LAST_ERR"; then pass "prompt beyond the context (a warning)"
    else echo "FAIL asan prompt beyond the context: no warning: $(head -c 200 "$LAST_ERR")"; fi
fi
