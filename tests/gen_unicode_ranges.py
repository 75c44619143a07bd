#!/usr/bin/env python3
"""Writes (or, with --check, verifies) the table of Unicode general categories
that run.c's byte-level pre-tokenizers need for GGUF vocabularies, which carry
no Unicode data: the runs of code points in \\p{L} (letters, by case: 'u' for
Lu and Lt, 'l' for Ll, 'L' for Lm and Lo, as GPT-4o's expression tells them
apart), \\p{M} (marks), \\p{N} (numbers), \\p{P} (punctuation) and \\p{S}
(symbols), from Python's own unicodedata.

    python3 tests/gen_unicode_ranges.py          # rewrites the table in run.c
    python3 tests/gen_unicode_ranges.py --check  # exit 1 if run.c's differs

The table sits in run.c between the lines containing BEGIN_UNICODE_RANGES and
END_UNICODE_RANGES. Standard library only."""

import os
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_C = os.path.join(ROOT, "run.c")
# the table's class of each general category (none: not in the table)
CLASSES = {"Lu": "u", "Lt": "u", "Ll": "l", "Lm": "L", "Lo": "L", "Mn": "M", "Mc": "M", "Me": "M",
           "Nd": "N", "Nl": "N", "No": "N", "Pc": "P", "Pd": "P", "Ps": "P", "Pe": "P", "Pi": "P", "Pf": "P",
           "Po": "P", "Sm": "S", "Sc": "S", "Sk": "S", "So": "S"}


def ranges():
    """[(first, last, class letter)] ascending, maximal runs of one class."""
    out, start, cls = [], 0, None
    for cp in range(0x110001):
        c = CLASSES.get(unicodedata.category(chr(cp))) if cp <= 0x10FFFF else None
        if c != cls:
            if cls is not None:
                out.append((start, cp - 1, cls))
            start, cls = cp, c
    return out


def table():
    r = ranges()
    lines = ["/* BEGIN_UNICODE_RANGES: Unicode %s (Python %d.%d's unicodedata), written by"
             % (unicodedata.unidata_version, sys.version_info[0], sys.version_info[1]),
             "   tests/gen_unicode_ranges.py: %d runs of \\p{L} by case (u, l, L), \\p{M}, \\p{N}, \\p{P} and \\p{S} */" % len(r),
             "static const UnicodeRange unicode_ranges[] = {"]
    row = []
    for first, last, c in r:
        row.append("{0x%X, 0x%X, '%s'}" % (first, last, c))
        if len(row) == 6:
            lines.append("    " + ", ".join(row) + ",")
            row = []
    if row:
        lines.append("    " + ", ".join(row) + ",")
    lines.append("}; /* END_UNICODE_RANGES */")
    return "\n".join(lines) + "\n"


def main():
    src = open(RUN_C, encoding="utf-8").read()
    lines = src.splitlines(keepends=True)
    begin = next(i for i, l in enumerate(lines) if "BEGIN_UNICODE_RANGES" in l)
    end = next(i for i, l in enumerate(lines) if "END_UNICODE_RANGES" in l and i >= begin)
    new = "".join(lines[:begin]) + table() + "".join(lines[end + 1:])
    if "--check" in sys.argv[1:]:
        if new != src:
            print("run.c's Unicode table differs from this Python's unicodedata %s" % unicodedata.unidata_version)
            return 1
        print("run.c's Unicode table is current")
        return 0
    if new != src:
        open(RUN_C, "w", encoding="utf-8").write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
