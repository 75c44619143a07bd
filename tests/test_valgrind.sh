#!/usr/bin/env bash
# valgrind memcheck on short real runs of tests/.bin/run_g (run.c at -O2 with
# debug info and no -march, which valgrind can run): a generate, a chat of two
# user lines, a beam search, and the int8 dim-8 model of the fuzz corpus. A
# case fails on any memcheck error or any definite or indirect leak.
set -u
cd "$(dirname "$0")/.." || exit 1
VG_RUN="${VG_RUN:-tests/.bin/run_g}"
M="${MODELS_DIR:-../shared/models}"
T="${TEST_TMP:-/tmp}/valgrind"
rm -rf "$T" && mkdir -p "$T"

if ! command -v valgrind >/dev/null 2>&1; then
    echo "SKIP valgrind: valgrind is not installed"
    exit 0
fi
if [ ! -x "$VG_RUN" ]; then
    echo "SKIP valgrind: $VG_RUN not built (make tests/.bin/run_g)"
    exit 0
fi

n=0
# vg NAME STDIN STATUS ARGS...: memcheck exits 100 on an error or a leak of
# the kinds asked for, so run.c's own STATUS stays distinguishable
vg() {
    local name="$1" input="$2" want="$3"
    shift 3
    n=$((n + 1))
    local log="$T/$n.vg"
    valgrind --error-exitcode=100 --leak-check=full --errors-for-leak-kinds=definite,indirect \
        --show-leak-kinds=definite,indirect --log-file="$log" "$VG_RUN" "$@" <"$input" >"$T/$n.out" 2>"$T/$n.err"
    local status=$?
    local errors
    errors=$(grep -m1 'ERROR SUMMARY' "$log" | sed 's/^==[0-9]*== //')
    if [ "$status" -eq "$want" ] && [ -s "$log" ] && grep -q 'ERROR SUMMARY: 0 errors' "$log"; then
        echo "PASS valgrind $name ($errors)"
    else
        echo "FAIL valgrind $name: exit $status, $errors; first report:"
        grep -m8 -A6 -E 'Invalid|uninitialised|definitely lost|indirectly lost|Mismatched' "$log" | head -n 12 | sed 's/^/    /'
        echo "    (full log: $log)"
    fi
}

if [ -f "$M/stories260K.bin" ] && [ -f "$M/tok512.bin" ]; then
    MODEL=("$M/stories260K.bin" -z "$M/tok512.bin")
    printf 'hi\nmore\n' >"$T/chat.in"
    vg "generate -n 40" /dev/null 0 "${MODEL[@]}" -n 40 -s 1 -i "Once upon a time"
    vg "chat -n 120" "$T/chat.in" 0 "${MODEL[@]}" -m chat -y sys -n 120 -s 1
    vg "beam search -b 3 -n 40" /dev/null 0 "${MODEL[@]}" -b 3 -n 40 -i "Once upon a time"
    vg "chat with beams -b 2 -n 120 json" "$T/chat.in" 0 "${MODEL[@]}" -m chat -y sys -n 120 -b 2 -f json
    {
        printf '{"prompt":"Once upon a time, there was a little girl named Lily. She loved to play","id":"a"}\n'
        printf '{"prompt":"Once upon a time, there was a little girl named Lily. She loved to swim","seed":3}\n'
        printf '{"prompt":"One day","beams":3,"return":2,"steps":60}\n'
        printf '{"stop":["x","y"],"id":"r","prompt":"z","colour":1}\n'
        printf '{"prompt":"big","beams":4,"steps":512}\n'
    } >"$T/batch.jsonl"
    vg "perplexity of a story (two windows), -I" /dev/null 0 "${MODEL[@]}" -m perplexity -I tests/story_perplexity.txt -f json
    vg "batch --parallel 2 --kv-mb 1, one request too big, one line refused" /dev/null 1 "${MODEL[@]}" --batch "$T/batch.jsonl" --parallel 2 --kv-mb 1 -n 80
    for kv in f16 q8_0; do
        vg "--kv-type $kv generate -n 60" /dev/null 0 "${MODEL[@]}" --kv-type $kv -n 60 -s 1 -i "Once upon a time"
        vg "--kv-type $kv batch --parallel 2 --kv-mb 1" /dev/null 1 "${MODEL[@]}" --kv-type $kv --batch "$T/batch.jsonl" --parallel 2 --kv-mb 1 -n 80
    done
else
    echo "SKIP valgrind real model: $M/stories260K.bin or tok512.bin not found (set MODELS_DIR)"
fi

tail -c +3 tests/fuzz/corpus/tokenizer/v32 >"$T/tok32.bin"
vg "int8 dim-8 model, beams" /dev/null 0 tests/fuzz/corpus/checkpoint/v2-int8 -z "$T/tok32.bin" -n 12 -b 2 -r 2
vg "int8 dim-8 model, --keep 3 past its 16 positions" /dev/null 0 tests/fuzz/corpus/checkpoint/v2-int8 -z "$T/tok32.bin" -n 60 -s 1 --min-new-tokens 50 \
    --keep 3 --kv-type f16 -f json
printf '\001\002\003\004\005\006\007\010\011\012\013\014\015\016\017\020\021\022\023\024\025\026\027\030\031\032\033\034\001\002\003' >"$T/text.in" # bytes with tokens in v32
vg "4-bit dim-8 model, perplexity from stdin (-I -), many windows" "$T/text.in" 0 tests/fuzz/corpus/checkpoint/v3-q4-separate -z "$T/tok32.bin" -m perplexity -I -
tail -c +3 tests/fuzz/corpus/tokenizer/v300 >"$T/tok300.bin"
printf 'hi\nmore\nand more\n' >"$T/chat3.in"
vg "chat of 3 turns, dim-4 model" "$T/chat3.in" 0 tests/fuzz/corpus/checkpoint/v1-chat-v300 -z "$T/tok300.bin" -m chat -y sys -n 200 -s 1
vg "chat of 3 turns with beams, dim-4 model" "$T/chat3.in" 0 tests/fuzz/corpus/checkpoint/v1-chat-v300 -z "$T/tok300.bin" -m chat -y sys -n 200 -b 3
head -c 100 "$T/tok32.bin" >"$T/tok-truncated.bin"
vg "truncated tokenizer (an error exit)" /dev/null 1 tests/fuzz/corpus/checkpoint/v0-shared -z "$T/tok-truncated.bin"
