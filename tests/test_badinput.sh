#!/usr/bin/env bash
# Bad input, end to end through the $RUN binary. Every case checks:
#   - the exit status: 1 for a bad file, 2 for bad usage, 0 where the input is
#     odd but acceptable; never death by a signal (status >= 128) or a hang
#     (each run is under `timeout 10`);
#   - stderr: exactly one line "run: ..." for a file error; for a usage error
#     exactly one line "run: <the problem>; see 'run --help'" (the whole usage
#     only for no arguments at all, and for -h on stdout).
# Malformed files are made here (a tiny valid model and tokenizer written by
# $PYTHON, then damaged); the cases that need the real stories260K model SKIP
# when MODELS_DIR does not have it.
set -u
RUN="${RUN:-./run}"
M="${MODELS_DIR:-../shared/models}"
PY="${PYTHON:-python3}"
TMP="${TEST_TMP:-/tmp}/badinput.$$"
mkdir -p "$TMP"
trap 'rm -rf "$TMP"' EXIT

if [ ! -x "$RUN" ]; then
    echo "FAIL badinput: the binary $RUN is missing (make run)"
    exit 1
fi

# A tiny valid legacy checkpoint (vocab 260: <unk>, BOS, EOS, 256 bytes, " ")
# and its tokenizer, plus damaged copies.
"$PY" - "$TMP" <<'EOF' || { echo "FAIL badinput: cannot write the test files with $PY"; exit 1; }
import struct, sys
d = sys.argv[1]
dim, hidden, layers, heads, kv, vocab, seq = 8, 16, 1, 2, 2, 260, 32
hs = dim // heads
n = (vocab * dim + layers * dim + 4 * layers * dim * dim + layers * dim
     + 3 * layers * hidden * dim + dim + seq * hs)
floats = [0.01 * ((i % 11) - 5) + (1.0 if i % 7 == 0 else 0.0) for i in range(n)]
model = struct.pack("<7i", dim, hidden, layers, heads, kv, vocab, seq) + struct.pack("<%df" % n, *floats)
open(d + "/tiny.bin", "wb").write(model)
open(d + "/truncated_weights.bin", "wb").write(model[:28 + 4000])
open(d + "/truncated_header.bin", "wb").write(model[:20])
open(d + "/one_byte_short.bin", "wb").write(model[:-1])
# the stories260K header and nothing after it
open(d + "/header_only.bin", "wb").write(struct.pack("<7i", 64, 172, 5, 8, 4, 512, 512))
open(d + "/garbage.bin", "wb").write(b"this is not a checkpoint, only some text in a file\n" * 20)
open(d + "/zero_dim.bin", "wb").write(struct.pack("<7i", 0, 16, 1, 2, 2, 260, 32) + model[28:])
open(d + "/odd_head.bin", "wb").write(struct.pack("<7i", 6, 16, 1, 2, 2, 260, 32) + model[28:])
ak42 = struct.pack("<Ii7iB", 0x616b3432, 7, dim, hidden, layers, heads, kv, vocab, seq, 1)
open(d + "/ak42_v7.bin", "wb").write(ak42 + bytes(256 - len(ak42)) + model[28:])
pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)] + [b" "]
tok = struct.pack("<i", 6) + b"".join(struct.pack("<fi", -float(i), len(p)) + p for i, p in enumerate(pieces))
open(d + "/tiny_tok.bin", "wb").write(tok)
open(d + "/tok_truncated.bin", "wb").write(tok[:len(tok) // 2])
# vocab_size 1: no room for BOS (id 1), which every prompt starts with
n1 = n - (vocab - 1) * dim
open(d + "/vocab1.bin", "wb").write(struct.pack("<7i", dim, hidden, layers, heads, kv, 1, seq) + struct.pack("<%df" % n1, *floats[:n1]))
open(d + "/vocab1_tok.bin", "wb").write(struct.pack("<ifi", 6, 0.0, 1) + b"a")
open(d + "/tok_negative_len.bin", "wb").write(tok[:4] + struct.pack("<fi", 0.0, -3) + tok[12:])
EOF
MODEL="$TMP/tiny.bin"
TOK="$TMP/tiny_tok.bin"

failures=0
pass() { echo "PASS badinput $1"; }
fail() { echo "FAIL badinput $1: $2"; failures=$((failures + 1)); }

# check NAME WANT_STATUS KIND -- ARGS...   (stdin from /dev/null)
#   KIND: file  - stderr is exactly one line starting with "run: "
#         usage - stderr is one line "run: ...; see 'run --help'"
#         fullusage - stderr is the usage text
#         line  - first stderr line starts with "run: "
#         ok    - no "run: " error on stderr
#         any   - stderr not checked
check() {
    local name="$1" want="$2" kind="$3"
    shift 4
    local out="$TMP/out" err="$TMP/err" start end status
    start=$(date +%s)
    timeout "${LIMIT:-10}" "$RUN" "$@" >"$out" 2>"$err" </dev/null
    status=$?
    end=$(date +%s)
    local first
    first=$(head -n 1 "$err")
    if [ "$status" -eq 124 ]; then fail "$name" "timed out after ${LIMIT:-10} s"; return; fi
    if [ "$status" -ge 128 ]; then fail "$name" "killed by signal $((status - 128)); stderr: $first"; return; fi
    if [ "$status" -ne "$want" ]; then fail "$name" "exit status $status, expected $want; stderr: $first"; return; fi
    if [ $((end - start)) -gt 5 ]; then fail "$name" "took $((end - start)) s"; return; fi
    local lines
    lines=$(wc -l <"$err")
    case "$kind" in
    file)
        if [ "$lines" -ne 1 ] || [ "$(wc -c <"$err")" -ne $((${#first} + 1)) ] || [[ "$first" != "run: "* ]]; then
            fail "$name" "stderr is not one line 'run: ...': $(head -c 300 "$err" | tr '\n' '|')"; return
        fi ;;
    usage)
        if [ "$lines" -ne 1 ] || [ "$(wc -c <"$err")" -ne $((${#first} + 1)) ] || [[ "$first" != "run: "*"; see 'run --help'" ]]; then
            fail "$name" "stderr is not one line 'run: ...; see 'run --help'': $(head -c 300 "$err" | tr '\n' '|')"; return
        fi ;;
    fullusage)
        if ! head -n 1 "$err" | grep -q '^Usage:' || ! grep -q -- '-t <float>' "$err"; then
            fail "$name" "stderr is not the usage: $(head -c 300 "$err" | tr '\n' '|')"; return
        fi ;;
    line)
        if [[ "$first" != "run: "* ]]; then fail "$name" "first stderr line: $first"; return; fi ;;
    ok)
        if grep '^run: ' "$err" | grep -qv '^run: \(note:\|seed \)'; then
            fail "$name" "error on stderr: $(grep '^run: ' "$err" | head -n 1)"; return
        fi ;;
    esac
    pass "$name"
}

# says NAME WANT_STATUS "FIRST WORDS" -- ARGS...   (stdin from /dev/null)
#   the exit status, and the error's line (the first stderr line that is not
#   "run: seed", a note or a warning) starts with "run: FIRST WORDS"
says() {
    local name="$1" want="$2" words="$3"
    shift 4
    timeout "${LIMIT:-10}" "$RUN" "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    local status=$? line
    line=$(grep -v '^run: \(seed \|note:\|warning:\)' "$TMP/err" | head -n 1)
    if [ "$status" -ne "$want" ]; then fail "$name" "exit status $status, expected $want; stderr: $line"; return; fi
    if [[ "$line" != "run: $words"* ]]; then fail "$name" "stderr does not start 'run: $words': $line"; return; fi
    pass "$name"
}

# --- bad files (exit 1, one line) -------------------------------------------
check "sanity: the tiny test model runs" 0 ok -- "$MODEL" -z "$TOK" -n 8 -s 1
check "missing checkpoint" 1 file -- "$TMP/no-such-model.bin" -z "$TOK"
check "checkpoint is a directory" 1 file -- "$TMP" -z "$TOK"
check "empty checkpoint" 1 file -- /dev/null -z "$TOK"
: >"$TMP/empty.bin"
check "empty checkpoint file" 1 file -- "$TMP/empty.bin" -z "$TOK"
check "checkpoint truncated in the header" 1 file -- "$TMP/truncated_header.bin" -z "$TOK"
check "checkpoint with a header only" 1 file -- "$TMP/header_only.bin" -z "$TOK"
check "checkpoint truncated in the weights" 1 file -- "$TMP/truncated_weights.bin" -z "$TOK"
check "checkpoint one byte short" 1 file -- "$TMP/one_byte_short.bin" -z "$TOK"
check "garbage header" 1 file -- "$TMP/garbage.bin" -z "$TOK"
check "header with dim 0" 1 file -- "$TMP/zero_dim.bin" -z "$TOK"
check "header with an odd head size" 1 file -- "$TMP/odd_head.bin" -z "$TOK"
check "ak42 header of an unknown version" 1 file -- "$TMP/ak42_v7.bin" -z "$TOK"
# a FIFO with no writer: opening it for reading would wait for one forever
if mkfifo "$TMP/fifo" 2>/dev/null; then
    LIMIT=3 check "checkpoint is a FIFO" 1 file -- "$TMP/fifo" -z "$TOK"
    LIMIT=3 check "tokenizer is a FIFO" 1 file -- "$MODEL" -z "$TMP/fifo"
else
    echo "SKIP badinput checkpoint is a FIFO: mkfifo failed"
fi
check "model with vocab_size 1 (no BOS id)" 1 file -- "$TMP/vocab1.bin" -z "$TMP/vocab1_tok.bin" -i a -n 4 -s 1
check "missing tokenizer" 1 file -- "$MODEL" -z "$TMP/no-such-tokenizer.bin"
check "tokenizer is a directory" 1 file -- "$MODEL" -z "$TMP"
check "empty tokenizer" 1 file -- "$MODEL" -z "$TMP/empty.bin"
check "truncated tokenizer" 1 file -- "$MODEL" -z "$TMP/tok_truncated.bin"
check "tokenizer with a negative length" 1 file -- "$MODEL" -z "$TMP/tok_negative_len.bin"
if [ -f "$M/tok512.bin" ]; then
    check "tokenizer with more tokens than the model" 1 file -- "$MODEL" -z "$M/tok512.bin"
else
    echo "SKIP badinput tokenizer with more tokens than the model: $M/tok512.bin not found"
fi
if [ -f "$M/stories260K.bin" ] && [ -f "$M/tokenizer.bin" ]; then
    check "stories260K with the 32000-token tokenizer" 1 file -- "$M/stories260K.bin" -z "$M/tokenizer.bin"
else
    echo "SKIP badinput stories260K with the 32000-token tokenizer: models not found in $M"
fi

# files of the wrong kind are named, with what to do
printf '# A README\n\nSome text, not a model.\n' >"$TMP/readme.md"
printf '{"model_type": "llama"}\n' >"$TMP/config.json"
says "a text file as the checkpoint" 1 "$TMP/readme.md: is a text file, not a checkpoint" -- "$TMP/readme.md" -z "$TOK"
says "a JSON file as the checkpoint" 1 "$TMP/config.json: is a JSON file, not a checkpoint" -- "$TMP/config.json" -z "$TOK"
says "a text file as the tokenizer" 1 "$TMP/readme.md: is a text file, not a tokenizer" -- "$MODEL" -z "$TMP/readme.md"
says "a JSON file as the tokenizer" 1 "$TMP/config.json: is a JSON file, which -z does not read" -- "$MODEL" -z "$TMP/config.json"
if [ -f "$M/tokenizer.model" ]; then
    says "tokenizer.model as the checkpoint" 1 "$M/tokenizer.model: is a SentencePiece tokenizer.model, not a checkpoint" -- "$M/tokenizer.model"
    says "tokenizer.model as -z" 1 "$M/tokenizer.model: is a SentencePiece tokenizer.model, which -z does not read" -- "$MODEL" -z "$M/tokenizer.model"
else
    echo "SKIP badinput tokenizer.model as the checkpoint or -z: $M/tokenizer.model not found"
fi
# a whole tokenizer of fewer tokens than the model: another model's
head -c "$("$PY" -c "
import struct, sys
d = open(sys.argv[1], 'rb').read(); at = 4
for _ in range(200): at += 8 + struct.unpack('<i', d[at + 4:at + 8])[0]
print(at)" "$TOK")" "$TOK" >"$TMP/tok200.bin"
says "tokenizer with fewer tokens than the model" 1 "$TMP/tok200.bin: tokenizer has 200 tokens, the model has 260: wrong tokenizer" -- "$MODEL" -z "$TMP/tok200.bin"
# no -z and no ./tokenizer.bin
mkdir -p "$TMP/empty_dir"
model_abs=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
run_abs=$(cd "$(dirname "$RUN")" && pwd)/$(basename "$RUN")
tmp_abs=$(cd "$TMP" && pwd)
(cd "$TMP/empty_dir" && TMP="$tmp_abs" RUN="$run_abs" says "no -z and no ./tokenizer.bin" 2 "no tokenizer: a llama2.c checkpoint needs the tokenizer" -- "$model_abs")

# --- bad usage (exit 2, one line "run: ...; see 'run --help'") --------------
check "no arguments" 2 fullusage --
check "flag before the checkpoint" 2 usage -- -t 1 "$MODEL"
for flag in -t -p -s -n -i -z -m -y -f -T -b -l -e -r; do
    check "$flag without a value" 2 usage -- "$MODEL" -z "$TOK" "$flag"
done
check "-t abc" 2 usage -- "$MODEL" -z "$TOK" -t abc
check "-t empty" 2 usage -- "$MODEL" -z "$TOK" -t ""
check "-t nan" 2 usage -- "$MODEL" -z "$TOK" -t nan
check "-t inf" 2 usage -- "$MODEL" -z "$TOK" -t inf
check "-t 1e999" 2 usage -- "$MODEL" -z "$TOK" -t 1e999
check "-p x" 2 usage -- "$MODEL" -z "$TOK" -p x
check "-n 1.5" 2 usage -- "$MODEL" -z "$TOK" -n 1.5
check "-n 12abc" 2 usage -- "$MODEL" -z "$TOK" -n 12abc
check "-n 99999999999999999999" 2 usage -- "$MODEL" -z "$TOK" -n 99999999999999999999
check "-s -1" 2 usage -- "$MODEL" -z "$TOK" -s -1
check "-s 1.5" 2 usage -- "$MODEL" -z "$TOK" -s 1.5
check "-T two" 2 usage -- "$MODEL" -z "$TOK" -T two
check "-t -1" 2 usage -- "$MODEL" -z "$TOK" -t -1
check "-p 1.5" 2 usage -- "$MODEL" -z "$TOK" -p 1.5
check "-p -0.1" 2 usage -- "$MODEL" -z "$TOK" -p -0.1
check "-n -3" 2 usage -- "$MODEL" -z "$TOK" -n -3
check "-T 0" 2 usage -- "$MODEL" -z "$TOK" -T 0
check "-b 0" 2 usage -- "$MODEL" -z "$TOK" -b 0
check "-r 0" 2 usage -- "$MODEL" -z "$TOK" -r 0
check "-m foo" 2 usage -- "$MODEL" -z "$TOK" -m foo
check "-f xml" 2 usage -- "$MODEL" -z "$TOK" -f xml
check "-e sometimes" 2 usage -- "$MODEL" -z "$TOK" -e sometimes
check "unknown flag -x" 2 usage -- "$MODEL" -z "$TOK" -x 1
# --keep N: 0 .. context - 1 (the tiny model's context is 32), generate and --batch only, sampling only
check "--keep without a value" 2 usage -- "$MODEL" -z "$TOK" --keep
for v in -1 abc "" 1.5 32 99 99999999999999999999; do
    check "--keep '$v'" 2 usage -- "$MODEL" -z "$TOK" --keep "$v" -n 40
done
check "--keep in chat" 2 usage -- "$MODEL" -z "$TOK" --keep 4 -m chat -y s
check "--keep with serve" 2 usage -- "$MODEL" -z "$TOK" --keep 4 -m serve
# the server's limits: out of range or not numbers, refused before it listens
check "--max-conns 0" 2 usage -- "$MODEL" -z "$TOK" -m serve --max-conns 0
check "--max-queue -1" 2 usage -- "$MODEL" -z "$TOK" -m serve --max-queue -1
check "--header-timeout 0" 2 usage -- "$MODEL" -z "$TOK" -m serve --header-timeout 0
check "--drain-seconds abc" 2 usage -- "$MODEL" -z "$TOK" -m serve --drain-seconds abc
check "--keep with -m perplexity" 2 usage -- "$MODEL" -z "$TOK" --keep 4 -m perplexity -i a
check "--keep with beams" 2 usage -- "$MODEL" -z "$TOK" --keep 4 -b 2
check "--keep with --lookup" 2 usage -- "$MODEL" -z "$TOK" --keep 4 --lookup 2 -t 0
check "--keep with a prompt longer than the context" 2 file -- "$MODEL" -z "$TOK" --keep 4 -n 100 -s 1 -i "$(printf 'a%.0s' $(seq 1 40))"
check "--keep 4 past the context" 0 ok -- "$MODEL" -z "$TOK" --keep 4 -n 100 -s 1
check "--keep 31: a ring of one slot" 0 ok -- "$MODEL" -z "$TOK" --keep 31 -n 70 -s 1 -f json
check "--keep 0 with a prompt of the whole context" 0 ok -- "$MODEL" -z "$TOK" --keep 0 -n 70 -s 1 -i "$(printf 'a%.0s' $(seq 1 30))"
check "unknown flag --foo" 2 usage -- "$MODEL" -z "$TOK" --foo
check "unknown flag -tt" 2 usage -- "$MODEL" -z "$TOK" -tt 1
check "stray argument" 2 usage -- "$MODEL" -z "$TOK" extra
check "lone dash" 2 usage -- "$MODEL" -z "$TOK" -
# a bare prompt and other programs' spellings: the option meant is named
says "a bare prompt after the model" 2 "unexpected argument 'Once upon a time': a prompt goes after -i" -- "$MODEL" -z "$TOK" "Once upon a time"
says "--temperature" 2 "unknown option '--temperature' (did you mean -t?)" -- "$MODEL" -z "$TOK" --temperature 0.5
says "--seed=3" 2 "unknown option '--seed=3' (did you mean -s?)" -- "$MODEL" -z "$TOK" --seed=3
says "--max-tokens" 2 "unknown option '--max-tokens' (did you mean --max-new-tokens?)" -- "$MODEL" -z "$TOK" --max-tokens 5
says "--prompt" 2 "unknown option '--prompt' (did you mean -i?)" -- "$MODEL" -z "$TOK" --prompt hi
says "-i twice" 2 "-i given twice" -- "$MODEL" -z "$TOK" -i A -i B
says "--prompt-ids with a word" 2 "--prompt-ids: 'x' is not a token id" -- "$MODEL" -z "$TOK" --prompt-ids 1,x
says "--prompt-ids beyond the vocabulary" 2 "--prompt-ids: '260' is not a token id" -- "$MODEL" -z "$TOK" --prompt-ids 1,260
says "--prompt-ids empty" 2 "--prompt-ids: no token ids" -- "$MODEL" -z "$TOK" --prompt-ids ,
says "--prompt-ids with -i" 2 "--prompt-ids and -i or -I all give the prompt" -- "$MODEL" -z "$TOK" --prompt-ids 1 -i a
says "--prompt-ids in chat" 2 "--prompt-ids applies to -m generate" -- "$MODEL" -z "$TOK" --prompt-ids 1 -m chat
# the generation controls (tiny.bin: vocabulary 260, context 32)
for flag in --min-new-tokens --repetition-penalty --no-repeat-ngram-size --top-k --min-p --stop; do
    check "$flag without a value" 2 usage -- "$MODEL" -z "$TOK" "$flag"
done
check "--top-k -1" 2 usage -- "$MODEL" -z "$TOK" --top-k -1
check "--top-k abc" 2 usage -- "$MODEL" -z "$TOK" --top-k abc
check "--top-k above the vocabulary" 2 usage -- "$MODEL" -z "$TOK" --top-k 261
check "--min-p -0.1" 2 usage -- "$MODEL" -z "$TOK" --min-p -0.1
check "--min-p 1.5" 2 usage -- "$MODEL" -z "$TOK" --min-p 1.5
check "--min-p nan" 2 usage -- "$MODEL" -z "$TOK" --min-p nan
check "--repetition-penalty 0" 2 usage -- "$MODEL" -z "$TOK" --repetition-penalty 0
check "--repetition-penalty -1" 2 usage -- "$MODEL" -z "$TOK" --repetition-penalty -1
check "--repetition-penalty x" 2 usage -- "$MODEL" -z "$TOK" --repetition-penalty x
check "--no-repeat-ngram-size -2" 2 usage -- "$MODEL" -z "$TOK" --no-repeat-ngram-size -2
check "--no-repeat-ngram-size 1.5" 2 usage -- "$MODEL" -z "$TOK" --no-repeat-ngram-size 1.5
check "--min-new-tokens -1" 2 usage -- "$MODEL" -z "$TOK" --min-new-tokens -1
check "--min-new-tokens above the steps" 2 usage -- "$MODEL" -z "$TOK" -n 16 --min-new-tokens 17
check "--min-new-tokens above the context" 2 usage -- "$MODEL" -z "$TOK" --min-new-tokens 33
check "--stop empty" 2 usage -- "$MODEL" -z "$TOK" --stop ""
stops=()
for i in $(seq 17); do stops+=(--stop "s$i"); done
check "17 stop strings" 2 usage -- "$MODEL" -z "$TOK" "${stops[@]}"
check "-m tokenize with a bad -f" 2 usage -- "$MODEL" -z "$TOK" -m tokenize -f xml

# --- help --------------------------------------------------------------------
for h in -h --help; do
    timeout 10 "$RUN" "$h" >"$TMP/out" 2>"$TMP/err" </dev/null
    status=$?
    if [ $status -eq 0 ] && head -n 1 "$TMP/out" | grep -q '^Usage:' && grep -q -- '-t <float>' "$TMP/out" && [ ! -s "$TMP/err" ]; then
        pass "$h prints the usage on stdout"
    else
        fail "$h prints the usage on stdout" "exit $status, stdout: $(head -c 80 "$TMP/out" | tr '\n' '|'), stderr: $(head -c 80 "$TMP/err")"
    fi
done
check "-h after other options" 0 ok -- "$MODEL" -z "$TOK" -t 0.5 -h

# --- the real model ----------------------------------------------------------
if [ ! -f "$M/stories260K.bin" ] || [ ! -f "$M/tok512.bin" ]; then
    echo "SKIP badinput stories260K cases: $M/stories260K.bin or tok512.bin not found (set MODELS_DIR)"
    exit $((failures > 0))
fi
S="$M/stories260K.bin"
T="$M/tok512.bin"

long_prompt=$(for i in $(seq 3000); do printf 'hello '; done)
# llama2.c prints what fits; run does the same and warns (tests/test_firsthour.sh checks the text)
check "prompt longer than the context" 0 any -- "$S" -z "$T" -i "$long_prompt"
if grep -q '^run: warning: the prompt is [0-9]* tokens' "$TMP/err"; then pass "prompt longer than the context: warned"
else fail "prompt longer than the context: warned" "stderr: $(head -c 200 "$TMP/err")"; fi
# a long prompt that does fit the context must run
check "long prompt that fits" 0 ok -- "$S" -z "$T" -i "$(for i in $(seq 60); do printf 'the cat '; done)" -n 0 -s 1
check "invalid UTF-8 prompt" 0 ok -- "$S" -z "$T" -i "$(printf '\xff\xfe\x80abc')" -n 32 -s 1
check "empty prompt" 0 ok -- "$S" -z "$T" -i "" -n 32 -s 1
check "control bytes in the prompt" 0 ok -- "$S" -z "$T" -i "$(printf 'a\001\002\033[0m b\tc\r\n')" -n 32 -t 0
check "-n 1 (shorter than the prompt; a warning)" 0 any -- "$S" -z "$T" -i "Once upon a time" -n 1 -s 1
check "-p 0 and -p 1 sample from all tokens" 0 ok -- "$S" -z "$T" -p 0 -n 16 -s 1
check "-p 1" 0 ok -- "$S" -z "$T" -p 1 -n 16 -s 1
check "huge temperature" 0 ok -- "$S" -z "$T" -t 1e30 -p 0.001 -n 16 -s 1
check "chat with stdin closed at once" 0 ok -- "$S" -z "$T" -m chat -n 64 -s 1
check "chat with -y and -i, then end of input" 0 any -- "$S" -z "$T" -m chat -y "Be kind." -i "Hi" -n 128 -s 1
check "chat whose first turn fills the context" 0 line -- "$S" -z "$T" -m chat -y "" -i "$(for i in $(seq 40); do printf 'hello '; done)" -n 16 -s 1
check "json output" 0 ok -- "$S" -z "$T" -f json -n 16 -s 1
# --prompt-ids: the tokens of -i, the same output
a=$(timeout 10 "$RUN" "$S" -z "$T" -t 0 -n 40 -i "Once upon a time" 2>/dev/null)
b=$(timeout 10 "$RUN" "$S" -z "$T" -t 0 -n 40 --prompt-ids 1,403,407,261,378 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "--prompt-ids prints what -i of the same tokens prints"
else fail "--prompt-ids prints what -i of the same tokens prints" "'$a' vs '$b'"; fi
# a request the whole cache cannot hold: an error, never nothing and exit 0
for f in text json; do
    says "beam search larger than --kv-mb ($f)" 2 "the key/value cache is too small for this request" -- \
        "$S" -z "$T" -i Lily -n 400 -b 4 --kv-mb 1 -f "$f"
    if [ -s "$TMP/out" ]; then fail "beam search larger than --kv-mb ($f): nothing on stdout" "$(head -c 80 "$TMP/out")"
    else pass "beam search larger than --kv-mb ($f): nothing on stdout"; fi
done
printf '\nHi\n' >"$TMP/chat_in"
timeout 10 "$RUN" "$S" -z "$T" -m chat -n 400 -b 4 --kv-mb 1 <"$TMP/chat_in" >"$TMP/out" 2>"$TMP/err"
status=$?
if [ "$status" -eq 2 ] && grep -q '^run: the key/value cache is too small' "$TMP/err"; then pass "chat beams larger than --kv-mb"
else fail "chat beams larger than --kv-mb" "exit $status; stderr: $(tail -n 1 "$TMP/err")"; fi

# --- version 3 (4-bit) checkpoints, -I, -m perplexity ------------------------
# A tiny valid version 3 model (group size 4) and damaged copies.
"$PY" - "$TMP" <<'EOF' || { echo "FAIL badinput: cannot write the version 3 files with $PY"; exit 1; }
import struct, sys
d = sys.argv[1]
dim, hidden, layers, heads, kv, vocab, seq, gs = 8, 16, 1, 2, 2, 260, 32, 4
def header(group):
    h = struct.pack("<Ii7iBi", 0x616b3432, 3, dim, hidden, layers, heads, kv, vocab, seq, 1, group)
    return h + bytes(256 - len(h))
def matrix(rows, cols, i):
    n = rows * cols
    return bytes(((i + k) * 37) % 256 for k in range(n // 2)) + struct.pack("<%df" % (n // gs), *[0.01] * (n // gs))
norms = struct.pack("<%df" % ((2 * layers + 1) * dim), *[1.0] * ((2 * layers + 1) * dim))
body = norms + matrix(vocab, dim, 0) + b"".join(matrix(r, c, i) for i, (r, c) in
       enumerate([(dim, dim), (dim, dim), (dim, dim), (dim, dim), (hidden, dim), (dim, hidden), (hidden, dim)]))
open(d + "/v3.bin", "wb").write(header(gs) + body)
open(d + "/v3_gs_odd.bin", "wb").write(header(1) + body)
open(d + "/v3_gs_not_dividing.bin", "wb").write(header(6) + body)
open(d + "/v3_gs_zero.bin", "wb").write(header(0) + body)
open(d + "/v3_gs_huge.bin", "wb").write(header(1 << 30) + body)
open(d + "/v3_truncated_scales.bin", "wb").write((header(gs) + body)[:-6])
open(d + "/v3_no_scales.bin", "wb").write((header(gs) + body)[:-(hidden * dim // gs * 4)])
open(d + "/empty.txt", "wb").write(b"")
open(d + "/story.txt", "wb").write(b"a b a b a b\n" * 20)
open(d + "/short.txt", "wb").write(b"a b\n")
EOF
V3="$TMP/v3.bin"
check "sanity: the tiny version 3 model runs" 0 ok -- "$V3" -z "$TOK" -n 8 -s 1
check "version 3: odd group size" 1 file -- "$TMP/v3_gs_odd.bin" -z "$TOK"
check "version 3: group size not dividing dim" 1 file -- "$TMP/v3_gs_not_dividing.bin" -z "$TOK"
check "version 3: group size 0" 1 file -- "$TMP/v3_gs_zero.bin" -z "$TOK"
check "version 3: group size 2^30" 1 file -- "$TMP/v3_gs_huge.bin" -z "$TOK"
check "version 3: truncated scales" 1 file -- "$TMP/v3_truncated_scales.bin" -z "$TOK"
check "version 3: last matrix without scales" 1 file -- "$TMP/v3_no_scales.bin" -z "$TOK"
if timeout 10 "$RUN" "$TMP/v3_truncated_scales.bin" -z "$TOK" 2>&1 | grep -q "scales"; then
    pass "version 3: the truncation error names the scales"
else
    fail "version 3: the truncation error names the scales" "$(timeout 10 "$RUN" "$TMP/v3_truncated_scales.bin" -z "$TOK" 2>&1 | head -n 1)"
fi
check "-I of a missing file" 1 file -- "$MODEL" -z "$TOK" -I "$TMP/no-such-prompt.txt"
check "-I of a directory" 1 file -- "$MODEL" -z "$TOK" -I "$TMP"
check "-I with -i" 2 usage -- "$MODEL" -z "$TOK" -I "$TMP/story.txt" -i "hello"
check "-I without its value" 2 usage -- "$MODEL" -z "$TOK" -I
check "-I of a file" 0 ok -- "$MODEL" -z "$TOK" -I "$TMP/short.txt" -n 8 -s 1
check "-I - reads stdin (here empty)" 0 ok -- "$MODEL" -z "$TOK" -I - -n 8 -s 1
check "perplexity of an empty text (-I)" 1 file -- "$MODEL" -z "$TOK" -m perplexity -I "$TMP/empty.txt"
check "perplexity without a text" 1 file -- "$MODEL" -z "$TOK" -m perplexity
check "perplexity of an empty stdin" 1 file -- "$MODEL" -z "$TOK" -m perplexity -I -
check "perplexity, version 3, text longer than the context" 0 ok -- "$V3" -z "$TOK" -m perplexity -I "$TMP/story.txt"
check "perplexity, json" 0 ok -- "$V3" -z "$TOK" -m perplexity -I "$TMP/story.txt" -f json
check "-m with an unknown mode" 2 usage -- "$MODEL" -z "$TOK" -m perplexitee

# stdout closed early: the reader goes away after 5 bytes; run must end
# promptly (by a write error, by SIGPIPE, or by finishing first)
start=$(date +%s)
timeout 10 "$RUN" "$S" -z "$T" -n 0 -s 1 2>"$TMP/err" </dev/null | head -c 5 >"$TMP/out"
status=${PIPESTATUS[0]}
end=$(date +%s)
if [ "$status" -eq 124 ]; then
    fail "stdout closed early" "did not end within 10 s"
elif [ "$status" -ne 0 ] && [ "$status" -ne 1 ] && [ "$status" -ne 141 ]; then
    fail "stdout closed early" "exit status $status; stderr: $(head -c 200 "$TMP/err")"
elif [ "$(wc -c <"$TMP/out")" -ne 5 ]; then
    fail "stdout closed early" "head read $(wc -c <"$TMP/out") bytes"
elif [ $((end - start)) -gt 5 ]; then
    fail "stdout closed early" "took $((end - start)) s"
else
    pass "stdout closed early (exit $status)"
fi
# stdout closed before the start
timeout 10 "$RUN" "$S" -z "$T" -n 16 -s 1 >&- 2>"$TMP/err" </dev/null
status=$?
if [ "$status" -eq 0 ] || [ "$status" -eq 1 ]; then
    pass "stdout closed from the start (exit $status)"
else
    fail "stdout closed from the start" "exit status $status; stderr: $(head -c 200 "$TMP/err")"
fi

exit $((failures > 0))
