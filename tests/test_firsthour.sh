#!/usr/bin/env bash
# The first hour of a new user, end to end through the $RUN binary: files of
# the wrong kind named as what they are, a prompt longer than -n, a clock
# seed that replays, --max-new-tokens, a chat that outlives its context (a
# script of messages on a pipe), Ctrl-C, and export.py without numpy.
# Models are made here ($PYTHON writes the tokenizers, export.py random the
# weights), so nothing depends on MODELS_DIR.
set -u
RUN="${RUN:-./run}"
PY="${PYTHON:-python3}"
TMP="${TEST_TMP:-/tmp}/firsthour.$$"
mkdir -p "$TMP"
cleanup() {
    [ -n "${bg_pid:-}" ] && kill "$bg_pid" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT

failures=0
pass() { echo "PASS firsthour $1"; }
fail() { echo "FAIL firsthour $1: $2"; failures=$((failures + 1)); }
if [ ! -x "$RUN" ]; then
    echo "FAIL firsthour: the binary $RUN is missing (make run)"
    exit 1
fi

# tok512.bin: <unk>, BOS, EOS, 256 byte tokens, then printable characters
# and pieces that never merge (so a prompt of k characters is BOS, the
# dummy-prefix space and k tokens); tok32k.bin: the same padded to 32000 pieces. tiny.model: a
# SentencePiece model (protobuf) of 6 pieces, with the tokenizer.bin that
# export.py must make of it written here independently.
"$PY" - "$TMP" <<'EOF' || { echo "FAIL firsthour: cannot write the test files with $PY"; exit 1; }
import struct, sys
d = sys.argv[1]
def write_tok(path, pieces):
    with open(path, "wb") as f:
        f.write(struct.pack("<i", max(len(p) for p in pieces)))
        for i, p in enumerate(pieces):
            f.write(struct.pack("<fi", -float(i), len(p)) + p)
base = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % i for i in range(256)]
extra = [bytes([c]) for c in range(0x20, 0x7f)]
tok512 = (base + extra + [b" w%d" % i for i in range(512)])[:512]
write_tok(d + "/tok512.bin", tok512)
write_tok(d + "/tok32k.bin", tok512 + [b" x%d" % i for i in range(32000 - 512)])
def varint(n):
    out = b""
    while True:
        b = n & 0x7f
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])
def field(num, wire, payload):
    key = varint(num << 3 | wire)
    return key + (varint(len(payload)) + payload if wire == 2 else payload)
sp = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3), ("\u2581the", -1.0, 1), ("h\u00e9", -2.5, 1), ("\u2581", -3.0, 1)]
model = b"".join(field(1, 2, field(1, 2, p.encode()) + field(2, 5, struct.pack("<f", s)) + field(3, 0, varint(t)))
                 for p, s, t in sp)
open(d + "/tiny.model", "wb").write(model)
pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n", b" the", "hé".encode(), b" "]
with open(d + "/tiny.expected.bin", "wb") as f:
    f.write(struct.pack("<i", max(len(p) for p in pieces)))
    for (_, s, _), p in zip(sp, pieces):
        f.write(struct.pack("<fi", s, len(p)) + p)
# files of other programs: safetensors, a PyTorch zip and a pickle; and a GGUF file that holds nothing
open(d + "/model.gguf", "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + bytes(64))
header = b'{"model.embed_tokens.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}'
open(d + "/model.safetensors", "wb").write(struct.pack("<Q", len(header)) + header + bytes(16))
import zipfile, pickle
with zipfile.ZipFile(d + "/model.pt", "w") as z:
    z.writestr("archive/data.pkl", pickle.dumps({"a": 1}, protocol=2))
open(d + "/model.pkl", "wb").write(pickle.dumps({"model": [1.0, 2.0]}, protocol=2))
EOF
T="$TMP/tok512.bin"
MODEL="$TMP/small.bin"   # dim 64, 2 layers, vocab 512, context 256
BIG="$TMP/s15m1k.bin"    # stories15M's shape with a 1024-position context
if ! "$PY" export.py random "$MODEL" --shape "small=64,172,2,8,4,512,256" --seed 3 >/dev/null 2>"$TMP/export.err" ||
   ! "$PY" export.py random "$BIG" --shape "s15m1k=288,768,6,6,6,32000,1024" --seed 4 >/dev/null 2>>"$TMP/export.err"; then
    echo "FAIL firsthour: export.py random failed: $(head -c 300 "$TMP/export.err")"
    exit 1
fi

# one_line NAME STATUS PATTERN -- ARGS: exit STATUS, stderr one line matching PATTERN
one_line() {
    local name="$1" want="$2" pattern="$3"
    shift 4
    timeout 10 "$RUN" "$@" >"$TMP/out" 2>"$TMP/err" </dev/null
    local status=$? lines
    lines=$(wc -l <"$TMP/err")
    if [ "$status" -ne "$want" ]; then fail "$name" "exit status $status, expected $want; stderr: $(head -c 200 "$TMP/err")"
    elif [ "$lines" -ne 1 ]; then fail "$name" "$lines stderr lines: $(head -c 300 "$TMP/err" | tr '\n' '|')"
    elif ! grep -q -- "$pattern" "$TMP/err"; then fail "$name" "stderr lacks '$pattern': $(cat "$TMP/err")"
    else pass "$name"; fi
}

# --- files of the wrong kind: one line naming what the file is, exit 1 -------
one_line "tokenizer given as the checkpoint" 1 "is a tokenizer, not a checkpoint" -- "$T" -z "$T"
one_line "checkpoint given as the tokenizer" 1 "is a checkpoint, not a tokenizer" -- "$MODEL" -z "$MODEL"
one_line "GGUF with no tensors as the checkpoint" 1 "GGUF file with no tensors.*export.py model" -- "$TMP/model.gguf" -z "$T"
one_line "GGUF with no vocabulary as the tokenizer" 1 "GGUF file holds no vocabulary.*export.py tokenizer" -- "$MODEL" -z "$TMP/model.gguf"
one_line "safetensors checkpoint" 1 "safetensors.*export.py model DIR out.bin" -- "$TMP/model.safetensors" -z "$T"
one_line "PyTorch zip checkpoint" 1 "zip.*PyTorch.*export.py model" -- "$TMP/model.pt" -z "$T"
one_line "PyTorch pickle checkpoint" 1 "pickle.*export.py model" -- "$TMP/model.pkl" -z "$T"
mkdir -p "$TMP/hf-llama" "$TMP/plain-dir"
echo '{"architectures": ["LlamaForCausalLM"]}' >"$TMP/hf-llama/config.json"
one_line "Hugging Face directory as the checkpoint" 1 "Hugging Face model directory.*export.py model $TMP/hf-llama out.bin" -- "$TMP/hf-llama" -z "$T"
one_line "directory as the checkpoint" 1 "is a directory, not a checkpoint" -- "$TMP/plain-dir" -z "$T"
one_line "directory as the tokenizer" 1 "is a directory, not a tokenizer" -- "$MODEL" -z "$TMP/plain-dir"
: >"$TMP/empty"
one_line "empty checkpoint" 1 "empty" -- "$TMP/empty" -z "$T"
one_line "empty tokenizer" 1 "empty" -- "$MODEL" -z "$TMP/empty"
# the renamed file is judged by its content, not its name
cp "$TMP/model.gguf" "$TMP/model.bin"
one_line "GGUF named .bin" 1 "GGUF" -- "$TMP/model.bin" -z "$T"

# --- usage errors: one line and the pointer to --help, exit 2 ----------------
one_line "usage error names --help" 2 "^run: unknown option '--frobnicate'; see 'run --help'$" -- "$MODEL" -z "$T" --frobnicate
one_line "--max-new-tokens 0 is a usage error" 2 "max-new-tokens.*see 'run --help'" -- "$MODEL" -z "$T" --max-new-tokens 0

# --- a prompt longer than -n: what fits is printed, one warning --------------
# BOS, " ", a..h: 10 tokens; llama2.c prints the 4 after BOS (the space
# after BOS is dropped)
"$RUN" "$MODEL" -z "$T" -t 0 -n 4 -i "abcdefgh" >"$TMP/out" 2>"$TMP/err"
status=$?
if [ $status -ne 0 ]; then fail "prompt longer than -n" "exit status $status"
elif [ "$(cat "$TMP/out")" != "abc" ]; then fail "prompt longer than -n" "stdout '$(cat "$TMP/out")', expected 'abc'"
elif [ "$(grep -c '^run: warning: the prompt is 10 tokens .*-n allows 4' "$TMP/err")" -ne 1 ]; then fail "prompt longer than -n" "stderr: $(cat "$TMP/err")"
elif ! grep -q '^stats: prompt 4 tokens, .*generated 0 tokens' "$TMP/err"; then fail "prompt longer than -n" "stats: $(grep stats "$TMP/err")"
else pass "prompt longer than -n: prints what fits, warns once, counts 4 prompt tokens"; fi
# with -n 0 the limit is the model's context, and the warning names it
"$RUN" "$MODEL" -z "$T" -t 0 -n 0 -i "$(for i in $(seq 600); do printf 'a '; done)" >"$TMP/out" 2>"$TMP/err"
if grep -q "^run: warning: the prompt is [0-9]* tokens (BOS included) but the model's context allows [0-9]* positions" "$TMP/err"; then
    pass "prompt longer than the context with -n 0: the warning names the context"
else fail "prompt longer than the context with -n 0: the warning names the context" "$(grep warning "$TMP/err")"; fi

# --- --max-new-tokens N = -n (prompt tokens with BOS) + N - 1 ----------------
for mode in "-t 0" "-s 9" "-b 3"; do
    "$RUN" "$MODEL" -z "$T" $mode -i "abc" --max-new-tokens 10 >"$TMP/a" 2>/dev/null
    "$RUN" "$MODEL" -z "$T" $mode -i "abc" -n 14 >"$TMP/b" 2>/dev/null # BOS, " ", a, b, c + 9
    "$RUN" "$MODEL" -z "$T" $mode -i "abc" -n 15 >"$TMP/c" 2>/dev/null
    if cmp -s "$TMP/a" "$TMP/b" && ! cmp -s "$TMP/a" "$TMP/c"; then pass "--max-new-tokens 10 = -n 14 ($mode)"
    else fail "--max-new-tokens 10 = -n 14 ($mode)" "'$(head -c 100 "$TMP/a")' vs '$(head -c 100 "$TMP/b")' (-n 15: '$(head -c 100 "$TMP/c")')"; fi
done

# the batch request field max_new_tokens: the same tokens as "steps"
printf '{"id":"a","prompt":"abc","temperature":0,"max_new_tokens":10}\n{"id":"b","prompt":"abc","temperature":0,"steps":14}\n' >"$TMP/batch.jsonl"
"$RUN" "$MODEL" -z "$T" --batch "$TMP/batch.jsonl" --ordered >"$TMP/out" 2>"$TMP/err"
a=$(sed -n 's/^{"id":"a",.*"tokens":\(\[[^]]*\]\).*/\1/p' "$TMP/out")
b=$(sed -n 's/^{"id":"b",.*"tokens":\(\[[^]]*\]\).*/\1/p' "$TMP/out")
if [ -n "$a" ] && [ "$a" = "$b" ] && [ "$(echo "$a" | tr ',' '\n' | wc -l)" -eq 10 ]; then pass "batch field max_new_tokens 10 = steps 14"
else fail "batch field max_new_tokens 10 = steps 14" "'$a' vs '$b'; $(head -c 200 "$TMP/err")"; fi

# --- a seed from the clock is printed, and -s replays it ----------------------
printf 'the cat\nthe dog ran\n' >"$TMP/script"
replay() {
    local name="$1"
    shift
    "$RUN" "$@" >"$TMP/first" 2>"$TMP/err" <"$TMP/script"
    local seed
    seed=$(sed -n 's/^run: seed \([0-9][0-9]*\)$/\1/p' "$TMP/err")
    if [ -z "$seed" ]; then fail "$name" "no 'run: seed N' line: $(head -c 200 "$TMP/err")"; return; fi
    "$RUN" "$@" -s "$seed" >"$TMP/again" 2>"$TMP/err2" <"$TMP/script"
    if grep -q '^run: seed' "$TMP/err2"; then fail "$name" "-s $seed printed a seed again"
    elif ! cmp -s "$TMP/first" "$TMP/again" || [ ! -s "$TMP/first" ]; then fail "$name" "-s $seed gave other output"
    else pass "$name (seed $seed)"; fi
}
replay "clock seed replayed: generate" "$MODEL" -z "$T" -n 100 -t 1.5
replay "clock seed replayed: chat" "$MODEL" -z "$T" -m chat -y "Be kind." -n 200 -t 1.5
# no seed is named where none is used: greedy, beam search, a greedy batch
for args in "-n 40 -b 3 -r 2" "-n 40 -t 0" "-m tokenize -i hello" "--batch $TMP/batch.jsonl"; do
    # shellcheck disable=SC2086
    "$RUN" "$MODEL" -z "$T" $args >"$TMP/out" 2>"$TMP/err" </dev/null
    if grep -q '^run: seed' "$TMP/err"; then fail "no seed named: $args" "$(grep '^run: seed' "$TMP/err")"
    else pass "no seed named: $args"; fi
done
# nor where the prompt leaves no position to sample (-n 0: the context)
"$RUN" "$MODEL" -z "$T" -n 0 -t 1 -i "$(for i in $(seq 600); do printf 'a '; done)" >"$TMP/out" 2>"$TMP/err" </dev/null
if grep -q '^run: seed' "$TMP/err" || ! grep -q 'generated 0 tokens' "$TMP/err"; then fail "no seed named: a prompt past the context" "$(head -c 300 "$TMP/err")"
else pass "no seed named: a prompt past the context"; fi

# --- chat on a terminal: Ctrl-D after half a line sends it -----------------
# (a pseudo-terminal; before, a second Ctrl-D was needed, and the reply
# followed the typed text on its line)
if out=$("$PY" - "$RUN" "$MODEL" "$T" <<'EOF'
import os, pty, select, sys, time
run, model, tok = sys.argv[1:4]
pid, fd = pty.fork()
if pid == 0:
    os.execv(run, [run, model, '-z', tok, '-m', 'chat', '-y', '', '-s', '1', '-n', '100'])
def read_for(seconds, until=None):
    out, end = b'', time.time() + seconds
    while time.time() < end and not (until and until in out):
        if select.select([fd], [], [], 0.1)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out
read_for(10, b'User: ')
os.write(fd, b'Hi there\x04')
out = read_for(10, b'Assistant: ')
os.kill(pid, 9)
os.waitpid(pid, 0)
sys.stdout.write(repr(out))
sys.exit(0 if b'Hi there\r\nAssistant: ' in out else 1)
EOF
); then pass "chat on a terminal: Ctrl-D after half a line sends it, the reply on its own line"
else fail "chat on a terminal: Ctrl-D after half a line sends it, the reply on its own line" "terminal: $out"; fi

# --- chat: a script on a pipe, many more turns than the context holds --------
for i in $(seq 40); do echo "the cat saw the dog in the park on day $i"; done >"$TMP/many"
timeout 60 "$RUN" "$MODEL" -z "$T" -m chat -y "Be kind." -s 5 -n 160 --max-new-tokens 40 <"$TMP/many" >"$TMP/out" 2>"$TMP/err"
status=$?
answers=$(grep -o 'Assistant:' "$TMP/out" | wc -l)
shifts=$(grep -c '^run: note: the context of 160 positions is full: dropped the [0-9]* oldest turns\?, [0-9]* kept' "$TMP/err")
others=$(grep -v '^run: note: the context\|^stats: ' "$TMP/err" | head -n 3)
if [ $status -ne 0 ]; then fail "chat over 40 turns" "exit status $status; stderr: $(tail -n 2 "$TMP/err")"
elif [ "$answers" -ne 40 ]; then fail "chat over 40 turns" "$answers answers, expected 40"
elif [ "$shifts" -lt 5 ]; then fail "chat over 40 turns" "only $shifts context shifts reported"
elif [ -n "$others" ]; then fail "chat over 40 turns" "other stderr lines: $others"
else pass "chat over 40 turns through a pipe: all answered, $shifts context shifts"; fi
# the same in JSON: one reply line per message
timeout 60 "$RUN" "$MODEL" -z "$T" -m chat -y "Be kind." -s 5 -n 160 -f json <"$TMP/many" >"$TMP/out" 2>"$TMP/err"
if [ $? -eq 0 ] && [ "$(grep -c '^{"rank":1,' "$TMP/out")" -eq 40 ]; then pass "chat over 40 turns, json"
else fail "chat over 40 turns, json" "$(grep -c '^{' "$TMP/out") reply lines; stderr: $(tail -n 2 "$TMP/err")"; fi
# beam search replies after context shifts
timeout 60 "$RUN" "$MODEL" -z "$T" -m chat -y "Be kind." -b 2 -n 160 <"$TMP/many" >"$TMP/out" 2>"$TMP/err"
if [ $? -eq 0 ] && [ "$(grep -o 'Assistant:' "$TMP/out" | wc -l)" -eq 40 ] && grep -q 'is full: dropped' "$TMP/err"; then
    pass "chat over 40 turns with beam search"
else fail "chat over 40 turns with beam search" "stderr: $(tail -n 2 "$TMP/err")"; fi

# the first turn of a chat is what it was before any of this: as generate with
# the same tokens (the template rendered by hand)
printf 'hi there\n' | "$RUN" "$MODEL" -z "$T" -m chat -y "" -t 0 -n 100 >"$TMP/out" 2>/dev/null
"$RUN" "$MODEL" -z "$T" -t 0 -n 100 -i "[INST] hi there [/INST]" >"$TMP/gen" 2>/dev/null
reply=$(sed -n 's/^User: Assistant: //p' "$TMP/out")
if [ -n "$reply" ] && grep -qF -- "$reply" "$TMP/gen"; then pass "first chat turn as generate"
else fail "first chat turn as generate" "reply '$reply' not in '$(head -c 200 "$TMP/gen")'"; fi

# a message too long for the context, then a normal one
long=$(for i in $(seq 200); do printf 'the cat '; done)
printf '%s\nthe dog\n' "$long" >"$TMP/two"
timeout 20 "$RUN" "$MODEL" -z "$T" -m chat -y "Be kind." -s 5 -n 64 <"$TMP/two" >"$TMP/out" 2>"$TMP/err"
status=$?
if [ $status -ne 0 ]; then fail "over-long message, then a normal one" "exit status $status"
elif ! grep -q '^run: the message is [0-9]* tokens .*the 64 positions of the context' "$TMP/err"; then
    fail "over-long message, then a normal one" "no error line naming the length and the room: $(head -c 200 "$TMP/err")"
elif [ "$(grep -o 'Assistant:' "$TMP/out" | wc -l)" -ne 1 ]; then fail "over-long message, then a normal one" "the second message was not answered"
else pass "over-long message refused in one line, the next one answered"; fi

# --- Ctrl-C ---------------------------------------------------------------------
# wait_for FILE PATTERN SECONDS [COUNT]: until FILE holds PATTERN (grep -o)
# COUNT times (default 1)
wait_for() {
    local i
    for i in $(seq $((${3} * 20))); do
        [ "$(grep -o -- "$2" "$1" 2>/dev/null | wc -l)" -ge "${4:-1}" ] && return 0
        sleep 0.05
    done
    return 1
}
"$RUN" "$BIG" -z "$TMP/tok32k.bin" -n 1024 -s 1 >"$TMP/out" 2>"$TMP/err" </dev/null &
bg_pid=$!
if wait_for "$TMP/out" . 30; then
    seen=$(wc -c <"$TMP/out")
    kill -INT $bg_pid
    wait $bg_pid
    status=$?
    bg_pid=
    generated=$(sed -n 's/^stats: prompt [0-9]* tokens, .*generated \([0-9]*\) tokens.*/\1/p' "$TMP/err")
    if [ $status -ne 130 ]; then fail "Ctrl-C during generation" "exit status $status, expected 130"
    elif [ -z "$generated" ]; then fail "Ctrl-C during generation" "no stats line: $(head -c 200 "$TMP/err")"
    elif [ "$generated" -ge 1023 ]; then fail "Ctrl-C during generation" "it ran to the end ($generated tokens): the model is too fast for this test"
    elif [ "$(wc -c <"$TMP/out")" -lt "$seen" ] || [ "$(tail -c 1 "$TMP/out" | od -An -c | tr -d ' ')" != '\n' ]; then
        fail "Ctrl-C during generation" "stdout not flushed with its end of line"
    else pass "Ctrl-C during generation: exit 130, $generated tokens kept, stats printed"; fi
else
    fail "Ctrl-C during generation" "no output within 30 s"
fi
# two in a row: the second ends it at once
"$RUN" "$BIG" -z "$TMP/tok32k.bin" -n 1024 -s 1 >"$TMP/out" 2>"$TMP/err" </dev/null &
bg_pid=$!
wait_for "$TMP/out" . 30
kill -INT $bg_pid; kill -INT $bg_pid
wait $bg_pid
status=$?
bg_pid=
if [ $status -eq 130 ]; then pass "two Ctrl-C: exit 130"; else fail "two Ctrl-C" "exit status $status"; fi
# chat: Ctrl-C ends the reply, the next message is answered, end of input ends it
rm -f "$TMP/fifo"
if mkfifo "$TMP/fifo"; then
    "$RUN" "$BIG" -z "$TMP/tok32k.bin" -m chat -y sys -s 1 <"$TMP/fifo" >"$TMP/out" 2>"$TMP/err" &
    bg_pid=$!
    exec 7>"$TMP/fifo"
    echo "hello" >&7
    if wait_for "$TMP/out" "Assistant: ." 30; then
        kill -INT $bg_pid
        if wait_for "$TMP/out" "User: " 10 2; then
            echo "again" >&7
            wait_for "$TMP/out" "Assistant: ." 30 2
            kill -INT $bg_pid # ends the second reply
            sleep 0.5
            exec 7>&-
            wait $bg_pid
            status=$?
            bg_pid=
            if [ $status -eq 0 ] && [ "$(grep -o 'Assistant:' "$TMP/out" | wc -l)" -eq 2 ] && grep -q '^stats: ' "$TMP/err"; then
                pass "Ctrl-C in a chat reply returns to the prompt; end of input ends it (exit 0)"
            else fail "Ctrl-C in chat" "exit status $status; stdout: $(tail -c 200 "$TMP/out" | tr '\n' '|')"; fi
        else
            exec 7>&-
            fail "Ctrl-C in chat" "the reply did not end: $(tail -c 200 "$TMP/out" | tr '\n' '|')"
        fi
    else
        exec 7>&-
        fail "Ctrl-C in chat" "no reply within 30 s"
    fi
    [ -n "${bg_pid:-}" ] && { kill $bg_pid 2>/dev/null; wait $bg_pid 2>/dev/null; bg_pid=; }
    # at the prompt, Ctrl-C ends the chat with the stats and exit 130
    rm -f "$TMP/fifo"; mkfifo "$TMP/fifo"
    "$RUN" "$MODEL" -z "$T" -m chat -y sys -s 1 <"$TMP/fifo" >"$TMP/out" 2>"$TMP/err" &
    bg_pid=$!
    exec 7>"$TMP/fifo"
    wait_for "$TMP/out" "User: " 10
    sleep 0.2
    kill -INT $bg_pid
    wait $bg_pid
    status=$?
    bg_pid=
    exec 7>&-
    if [ $status -eq 130 ] && grep -q '^stats: ' "$TMP/err"; then pass "Ctrl-C at the chat prompt ends the chat (exit 130)"
    else fail "Ctrl-C at the chat prompt" "exit status $status; stderr: $(head -c 200 "$TMP/err")"; fi
else
    echo "SKIP firsthour Ctrl-C in chat: mkfifo failed"
fi

# --- export.py without numpy (python3 -S: no site packages) -------------------
if "$PY" -S -c 'import numpy' 2>/dev/null; then
    echo "SKIP firsthour export.py without numpy: numpy imports even under $PY -S"
else
    "$PY" -S export.py tokenizer "$TMP/tiny.model" "$TMP/tiny.bin" >"$TMP/out" 2>"$TMP/err"
    if [ $? -eq 0 ] && cmp -s "$TMP/tiny.bin" "$TMP/tiny.expected.bin"; then pass "export.py tokenizer under python3 -S"
    else fail "export.py tokenizer under python3 -S" "$(head -c 300 "$TMP/err")"; fi
    for cmd in "random $TMP/r.bin --shape stories15M" "model $TMP/hf-llama $TMP/r.bin"; do
        "$PY" -S export.py $cmd >"$TMP/out" 2>"$TMP/err"
        status=$?
        if [ $status -eq 1 ] && [ "$(wc -l <"$TMP/err")" -eq 1 ] &&
           grep -q "^export.py: error: .*needs numpy (apt-get install python3-numpy / pip install numpy)$" "$TMP/err" &&
           [ ! -e "$TMP/r.bin" ] && ! ls -a "$TMP" | grep -q '^\.export-'; then
            pass "export.py ${cmd%% *} without numpy: one line, exit 1, no output"
        else fail "export.py ${cmd%% *} without numpy" "exit $status: $(head -c 300 "$TMP/err")"; fi
    done
fi

# --- make: gcc unless CC is given ---------------------------------------------
if command -v make >/dev/null && [ -f Makefile ]; then
    first=$(env -u CC -u MAKELEVEL -u MAKEFLAGS -u MFLAGS make --no-print-directory -n -B run 2>/dev/null | head -n 1)
    if [[ "$first" == gcc\ * ]]; then pass "make builds with gcc by default"
    else fail "make builds with gcc by default" "make -n run: $first"; fi
fi

exit $((failures > 0))
