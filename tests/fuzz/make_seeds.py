#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/.

Run from anywhere: python3 tests/fuzz/make_seeds.py. Only the standard
library. The seeds are small, deterministic files: a dim-8 model in each
checkpoint layout (and broken variants), tokenizer files, prompts and argument
lists. Files whose names start with "regress-" are inputs that once failed and
are kept by hand; this script never touches them.
"""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(rng, n):
    return struct.pack("<%df" % n, *[rng.uniform(-0.5, 0.5) for _ in range(n)])


def model(version, dim=8, hidden=16, layers=1, heads=2, kv_heads=2, vocab=32, seq=16, shared=True, group=4, seed=1):
    """A checkpoint with random weights: version 0 (legacy), 1 (ak42 float32)
    or 2 (ak42 int8, groups of `group` values with float32 scales)."""
    rng = random.Random(seed)
    head = dim // heads
    kv_dim = head * kv_heads

    def matrix(rows, cols):
        if version < 2:
            return floats(rng, rows * cols)
        q = bytes(rng.randrange(256) for _ in range(rows * cols))
        scales = struct.pack("<%df" % (rows * cols // group), *[rng.uniform(0.001, 0.01) for _ in range(rows * cols // group)])
        return q + scales

    def layer_mats(rows, cols):
        return b"".join(matrix(rows, cols) for _ in range(layers))

    if version == 0:
        out = struct.pack("<7i", dim, hidden, layers, heads, kv_heads, vocab if shared else -vocab, seq)
        out += floats(rng, vocab * dim)  # embedding
        out += floats(rng, layers * dim)  # rms_att
        out += floats(rng, layers * dim * dim) + floats(rng, layers * kv_dim * dim) * 2 + floats(rng, layers * dim * dim)
        out += floats(rng, layers * dim)  # rms_ffn
        out += floats(rng, layers * hidden * dim) + floats(rng, layers * dim * hidden) + floats(rng, layers * hidden * dim)
        out += floats(rng, dim)  # rms_final
        out += floats(rng, seq * head)  # the two RoPE tables
        if not shared:
            out += floats(rng, vocab * dim)
        return out
    header = struct.pack("<Ii7iB", 0x616B3432, version, dim, hidden, layers, heads, kv_heads, vocab, seq, 1 if shared else 0)
    if version == 2:
        header += struct.pack("<i", group)
    header += b"\0" * (256 - len(header))
    out = header + floats(rng, layers * dim) * 2 + floats(rng, dim)  # norms
    out += matrix(vocab, dim)
    out += layer_mats(dim, dim) + layer_mats(kv_dim, dim) * 2 + layer_mats(dim, dim)
    out += layer_mats(hidden, dim) + layer_mats(dim, hidden) + layer_mats(hidden, dim)
    if not shared:
        out += matrix(vocab, dim)
    return out


def chat_model(vocab=300, dim=4, c=4.0, seed=8):
    """A version 1 model for multi-turn chats with the v300 tokenizer: its
    separate classifier gives BOS and EOS the rows (c, 0, ...) and (-c, 0, ...),
    so that one of them is likely whatever the final state's first value is
    and replies are short."""
    rng = random.Random(seed)
    hidden, layers, heads, kv_heads, seq = 8, 1, 2, 2, 256
    header = struct.pack("<Ii7iB", 0x616B3432, 1, dim, hidden, layers, heads, kv_heads, vocab, seq, 0)
    header += b"\0" * (256 - len(header))
    out = header + floats(rng, layers * dim) * 2 + floats(rng, dim) + floats(rng, vocab * dim)
    out += floats(rng, layers * dim * dim) * 4 + floats(rng, layers * hidden * dim) * 3
    rows = [[rng.uniform(-0.5, 0.5) for _ in range(dim)] for _ in range(vocab)]
    rows[1] = [c] + [0.0] * (dim - 1)
    rows[2] = [-c] + [0.0] * (dim - 1)
    return out + struct.pack("<%df" % (vocab * dim), *[v for row in rows for v in row])


def tokenizer(pieces, max_len=None):
    max_len = max_len or max(len(p) for p in pieces)
    out = struct.pack("<i", max_len)
    for i, p in enumerate(pieces):
        out += struct.pack("<fi", -float(i), len(p)) + p
    return out


def small_pieces(n):
    """n pieces: the three specials, byte tokens, then letters and merges."""
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"]
    pieces += [b"<0x%02X>" % b for b in range(min(256, n - 3))]
    extra = [bytes([c]) for c in range(0x20, 0x7F)] + [b"th", b"he", b"the", b" the", b"an", b"and", b" a"]
    pieces += extra[: max(0, n - len(pieces))]
    while len(pieces) < n:
        pieces.append(b"p%d" % len(pieces))
    return pieces[:n]


def main():
    # checkpoint
    write("checkpoint", "v0-shared", model(0))
    write("checkpoint", "v0-separate-classifier", model(0, shared=False, seed=2))
    write("checkpoint", "v0-gqa", model(0, dim=8, heads=4, kv_heads=2, layers=2, seed=3))
    write("checkpoint", "v1-shared", model(1, seed=4))
    write("checkpoint", "v1-separate", model(1, shared=False, layers=2, heads=4, kv_heads=1, seed=5))
    write("checkpoint", "v2-int8", model(2, seed=6))
    write("checkpoint", "v2-int8-separate", model(2, shared=False, group=8, seed=7))
    write("checkpoint", "v1-chat-v300", chat_model())
    write("checkpoint", "v0-truncated", model(0)[:600])
    write("checkpoint", "v1-header-only", model(1)[:256])
    write("checkpoint", "v0-bad-heads", struct.pack("<7i", 8, 16, 1, 3, 3, 32, 16) + b"\0" * 64)
    write("checkpoint", "v9-unknown-version", struct.pack("<Ii", 0x616B3432, 9) + b"\0" * 248)
    # tokenizer: two bytes of vocabulary size, then the file
    write("tokenizer", "v32", struct.pack("<H", 31) + tokenizer(small_pieces(32)))
    write("tokenizer", "v300", struct.pack("<H", 299) + tokenizer(small_pieces(300)))
    write("tokenizer", "v3-empty-pieces", struct.pack("<H", 2) + tokenizer([b"", b"", b""], max_len=4))
    write("tokenizer", "v32-truncated", struct.pack("<H", 31) + tokenizer(small_pieces(32))[:100])
    write("tokenizer", "v32-extra", struct.pack("<H", 31) + tokenizer(small_pieces(40)))
    # encode: a settings byte (tokenizer, BOS, EOS), then the text
    texts = [
        b"Once upon a time, there was a little girl named Lily.",
        "h\u00e9llo w\u00f6rld \u2713 \U0001F600 \u4e2d\u6587 \u00e9\u00e9t\u00e9".encode(),
        b"bad utf-8: \xff\xfe \xc3 \x80\x80\x80\x80\x80\x80 \xf0\x9f\x98 end",
        b"the the the and and   aaaa ab ba abab eeeee xyxy zzqq",
        b"[INST] <<SYS>>\nsys\n<</SYS>>\n\nhi [/INST]",
        b"ABCABC abc \x7f\x01\x1f <0x41> \n<s>\n",
        b"a" * 3000,
    ]
    for i, text in enumerate(texts):
        write("encode", "text%d" % i, bytes([i % 16]) + text)
    # options: arguments separated by NUL
    argvs = [
        ["m.bin"],
        ["m.bin", "-t", "0.5", "-p", "0.9", "-s", "42", "-n", "64", "-i", "Once upon"],
        ["m.bin", "-z", "tok.bin", "-m", "chat", "-y", "You are kind.", "-f", "json"],
        ["m.bin", "-b", "4", "-l", "1.5", "-e", "never", "-r", "3", "-T", "2"],
        ["m.bin", "-b", "2", "-r", "3"],
        ["m.bin", "-t", "1e309"],
        ["m.bin", "-s", "-1", "-n", "99999999999999999999"],
        ["-h"],
        ["m.bin", "-x", "1"],
        ["m.bin", "-e", "1", "-m", "generate", "-f", "text", "-p", "nan"],
    ]
    for i, argv in enumerate(argvs):
        write("options", "argv%d" % i, b"\0".join(a.encode() for a in argv))
    # generate: arguments after the checkpoint, then an empty one, then stdin
    runs = [
        (["-n", "40", "-s", "3", "-i", "Once upon a time"], ""),
        (["-b", "3", "-r", "2", "-n", "60", "-f", "json", "-i", "the cat"], ""),
        (["-b", "4", "-e", "never", "-l", "-0.5", "-n", "30"], ""),
        (["-b", "1", "-n", "20", "-i", "abc"], ""),
        (["-m", "chat", "-y", "sys", "-n", "200", "-s", "1"], "hi\nmore\nand more\n"),
        (["-m", "chat", "-n", "200", "-b", "3", "-r", "3"], "system\nhi\nmore\n"),
        (["-m", "chat", "-i", "first", "-n", "120", "-b", "2", "-f", "json"], "x\ny\n"),
        (["-m", "chat", "-y", "", "-n", "48", "-t", "0"], "a much longer line that does not fit in the context at all\n"),
        (["-t", "0", "-n", "5", "-i", "a prompt longer than five tokens"], ""),
    ]
    for i, (argv, stdin) in enumerate(runs):
        write("generate", "run%d" % i, b"\0".join(a.encode() for a in argv) + b"\0\0" + stdin.encode())


if __name__ == "__main__":
    main()
