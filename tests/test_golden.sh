#!/usr/bin/env bash
# Golden outputs: each line of tests/golden/cases.txt is
#   <expected file> | <arguments after the checkpoint, with $M for MODELS_DIR>
# The expected files are the outputs documented by the model's publisher
# (../shared/models/README.md), not outputs of run.c.
set -u
RUN="${RUN:-./run}"
M="${MODELS_DIR:-../shared/models}"
if [ ! -f "$M/stories260K.bin" ] || [ ! -f "$M/tok512.bin" ]; then
    echo "SKIP golden: $M/stories260K.bin or tok512.bin not found (set MODELS_DIR)"
    exit 0
fi
while IFS='|' read -r expected args; do
    case "$expected" in ''|'#'*) continue ;; esac
    expected=$(echo "$expected" | xargs)
    eval "set -- $args"
    out="${TEST_TMP:-/tmp}/golden_$expected"
    "$RUN" "$M/stories260K.bin" -z "$M/tok512.bin" "$@" >"$out" 2>/dev/null
    status=$?
    if [ $status -eq 0 ] && cmp -s "$out" "tests/golden/$expected"; then
        echo "PASS golden $expected ($args )"
    else
        echo "FAIL golden $expected ($args ): exit $status, output differs:"
        diff "$out" "tests/golden/$expected" | head -5
    fi
done < tests/golden/cases.txt
