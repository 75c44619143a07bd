#!/usr/bin/env bash
# Windows under Wine: `make run.exe` (MinGW-w64) and `make run` (the host's
# compiler) from a copy of run.c and the Makefile in a scratch directory;
# run.exe must build without a warning, pass the golden suite under Wine, and
# print the same bytes as the Linux build, with the same exit status, for
# generation (sampled, greedy, JSON, beam search, chat from stdin) and for
# bad input (a missing or truncated checkpoint, a wrong tokenizer, a bad
# flag or value): stdout and stderr compared byte for byte, but for the
# timing line "stats: ..." that a good run ends with.
# SKIPs when the cross-compiler or Wine is absent (Debian: gcc-mingw-w64-x86-64,
# wine64 and wine).
set -u
cd "$(dirname "$0")/.."
# the builds here take no flags from a `make test` above them
unset MAKEFLAGS MFLAGS MAKELEVEL
MINGW_CC="${MINGW_CC:-x86_64-w64-mingw32-gcc}"
M="${MODELS_DIR:-../shared/models}"
WINE="${WINE:-}"
if [ -z "$WINE" ]; then
    for w in wine64 wine /usr/lib/wine/wine64; do
        if command -v "$w" >/dev/null 2>&1; then WINE=$w; break; fi
    done
fi
if ! command -v "$MINGW_CC" >/dev/null 2>&1 || [ -z "$WINE" ]; then
    echo "SKIP windows: $MINGW_CC or wine not found (Debian: gcc-mingw-w64-x86-64 wine64 wine)"
    exit 0
fi
if [ ! -f "$M/stories260K.bin" ] || [ ! -f "$M/tok512.bin" ]; then
    echo "SKIP windows: $M/stories260K.bin or tok512.bin not found (set MODELS_DIR)"
    exit 0
fi
# TEST_TMP absolute (/tmp/x) or relative to the repository
case "${TEST_TMP:-tests/.tmp}" in
    /*) WORK="$TEST_TMP/windows" ;;
    *) WORK="$(pwd)/${TEST_TMP:-tests/.tmp}/windows" ;;
esac
rm -rf "$WORK" && mkdir -p "$WORK/src"
# a fresh Wine configuration of our own, made once here (its first start
# prints to stderr); no debug channels
export WINEPREFIX="$WORK/wineprefix" WINEDEBUG=-all
start=$(date +%s)

pass() { echo "PASS windows $1"; }
fail() { echo "FAIL windows $1: $2"; }

cp run.c Makefile "$WORK/src/"
if ! make -s -C "$WORK/src" run.exe MINGW_CC="$MINGW_CC" >"$WORK/build.log" 2>&1 ||
   ! make -s -C "$WORK/src" run >>"$WORK/build.log" 2>&1; then
    fail "build" "$(head -c 400 "$WORK/build.log")"
    exit 0
fi
if grep -q -i warning "$WORK/build.log"; then fail "warning-free build" "$(grep -i -m 3 warning "$WORK/build.log")"
else pass "make run.exe builds without warnings"; fi
timeout 300 "$WINE" "$WORK/src/run.exe" --version >/dev/null 2>&1 # creates the configuration
printf '#!/bin/sh\nexec timeout 120 %s %s "$@"\n' "$WINE" "$WORK/src/run.exe" >"$WORK/run_wine"
chmod +x "$WORK/run_wine"
LINUX="$WORK/src/run"

# golden: the publisher's documented outputs
RUN="$WORK/run_wine" bash tests/test_golden.sh 2>&1 | sed -n -E 's/^(PASS|FAIL|SKIP) /\1 windows /p'

# JSON lines that are equal but for their scores, which may differ by 1e-5
# relative: the C libraries' expf, sinf and cosf round differently (glibc's
# are not correctly rounded; Wine's and Windows' are others), so the logits
# differ in their last bits, as llama2.c's own do between the two systems
close_json() {
    "${PYTHON:-python3}" - "$1" "$2" <<'EOF'
import json, sys
a, b = (open(p, 'rb').read().splitlines() for p in sys.argv[1:3])
def close(x, y):
    x, y = json.loads(x), json.loads(y)
    sx, sy = x.pop('score'), y.pop('score')
    return x == y and abs(sx - sy) <= 1e-5 * abs(sx)
sys.exit(0 if len(a) == len(b) and all(close(x, y) for x, y in zip(a, b)) else 1)
EOF
}

# same <name> <stdin file> -- <arguments>: run.exe under Wine and the Linux
# build print the same bytes and end with the same status
same() {
    local name=$1 input=$2; shift 3
    local d="$WORK/cases/$name" s_linux s_wine
    mkdir -p "$d"
    "$LINUX" "$@" <"$input" >"$d/out_linux" 2>"$d/err_linux"; s_linux=$?
    "$WORK/run_wine" "$@" <"$input" >"$d/out_wine" 2>"$d/err_wine"; s_wine=$?
    # the stats line's timings, and a seed taken from the clock (two runs
    # may straddle a second), differ from run to run
    sed -i -e '/^stats: /d' -e '/^run: seed [0-9]*$/d' "$d/err_linux" "$d/err_wine"
    if [ "$s_linux" != "$s_wine" ]; then fail "$name" "exit status $s_wine under Wine, $s_linux on Linux"
    elif ! cmp -s "$d/out_linux" "$d/out_wine" && ! close_json "$d/out_linux" "$d/out_wine"; then
        fail "$name" "stdout differs: $(cmp "$d/out_linux" "$d/out_wine" 2>&1)"
    elif ! cmp -s "$d/err_linux" "$d/err_wine"; then fail "$name" "stderr differs: $(head -c 200 "$d/err_wine" | tr '\n' '|')"
    else pass "$name = Linux (exit $s_linux, $(wc -c <"$d/out_linux") bytes of stdout)"; fi
}

S="$M/stories260K.bin"; T="$M/tok512.bin"
printf 'Tell me a story.\nAnd another one\n' >"$WORK/chat_input"
head -c 100000 "$S" >"$WORK/truncated.bin"
N=/dev/null
same "sampled, utf-8 prompt" $N -- "$S" -z "$T" -s 42 -t 0.8 -i "Lily héllo ☃" -n 200
same "greedy, 256 steps" $N -- "$S" -z "$T" -t 0 -n 0
same "json output (scores within 1e-5)" $N -- "$S" -z "$T" -s 7 -n 60 -f json -i "Lily"
same "beam search" $N -- "$S" -z "$T" -b 4 -r 2 -n 60 -i "Once upon a time"
same "chat from stdin" "$WORK/chat_input" -- "$S" -z "$T" -m chat -s 3 -n 200
cp "$T" "$WORK/tökenizer ☃.bin"
same "unicode file name" $N -- "$S" -z "$WORK/tökenizer ☃.bin" -t 0 -n 40
same "help" $N -- --help
same "missing checkpoint" $N -- "$WORK/no_such_model.bin" -z "$T"
same "truncated checkpoint" $N -- "$WORK/truncated.bin" -z "$T"
same "wrong tokenizer" $N -- "$S" -z "$S"
same "bad flag" $N -- "$S" -z "$T" -q 1
same "bad value" $N -- "$S" -z "$T" -t abc
same "flag without its value" $N -- "$S" -z "$T" -n
echo "windows: builds and suites in $(( $(date +%s) - start ))s"
