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
    """A checkpoint with random weights: version 0 (legacy), 1 (ak42 float32),
    2 (ak42 int8, groups of `group` values with float32 scales) or 3 (ak42
    4-bit, two values per byte, then the scales)."""
    rng = random.Random(seed)
    head = dim // heads
    kv_dim = head * kv_heads

    def matrix(rows, cols):
        if version < 2:
            return floats(rng, rows * cols)
        q = bytes(rng.randrange(256) for _ in range(rows * cols // (2 if version == 3 else 1)))
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
    if version >= 2:
        header += struct.pack("<i", group)
    header += b"\0" * (256 - len(header))
    out = header + floats(rng, layers * dim) * 2 + floats(rng, dim)  # norms
    out += matrix(vocab, dim)
    out += layer_mats(dim, dim) + layer_mats(kv_dim, dim) * 2 + layer_mats(dim, dim)
    out += layer_mats(hidden, dim) + layer_mats(dim, hidden) + layer_mats(hidden, dim)
    if not shared:
        out += matrix(vocab, dim)
    return out


def model_v4(encoding, rope_scaling=0, **kw):
    """A version 4 checkpoint: version 1's (encoding 0, float32) or version 2's
    (encoding 1, int8) arrays under a header that also carries the weight
    encoding, the group size, norm_eps, rope_theta and llama3 RoPE scaling."""
    group = kw.get("group", 4)
    out = bytearray(model(1 if encoding == 0 else 2, **kw))
    out[4:8] = struct.pack("<i", 4)
    out[40:76] = struct.pack("<iiffifffi", encoding, group if encoding else 0, 1e-5, 500000.0, rope_scaling, 8.0, 1.0, 4.0, 64)
    return bytes(out)


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


def tk42(n_extra=40, ends=(257,), corrupt=None):
    """A byte-level BPE "tk42" tokenizer: the 256 bytes, BOS (256) and EOS
    (257) as specials, then merged pieces of letters; a few Unicode ranges.
    Its vocabulary size is 258 + n_extra."""
    pieces = [(0, bytes([b])) for b in range(256)] + [(1, b"<|begin_of_text|>"), (1, b"<|end_of_text|>")]
    merges = []
    words = [b"th", b"he", b"the", b" t", b" the", b"an", b"and", b" a", b"\xc3\xa9", b"  ", b"\n\n", b"12", b"123"]
    for w in words[:n_extra]:
        # split where both halves already are pieces
        ids = {p: i for i, (f, p) in enumerate(pieces) if f == 0}
        cut = next(k for k in range(len(w) - 1, 0, -1) if w[:k] in ids and w[k:] in ids)
        merges.append((ids[w[:cut]], ids[w[cut:]], len(pieces)))
        pieces.append((0, w))
    while len(pieces) < 258 + n_extra:
        pieces.append((0, b"p%d" % len(pieces)))
    max_len = max(len(p) for _, p in pieces)
    out = b"tk42" + struct.pack("<8i", 1, len(pieces), len(merges), max_len, 256, ends[0], 1, 1)
    out += struct.pack("<%di" % (1 + len(ends)), len(ends), *ends)
    for flags, p in pieces:
        out += struct.pack("<ii", flags, len(p)) + p
    for m in merges:
        out += struct.pack("<3i", *m)
    letters = [(0x41, 0x5A), (0x61, 0x7A), (0xAA, 0xAA), (0xC0, 0x24F), (0x4E00, 0x9FFF)]
    numbers = [(0x30, 0x39), (0xB2, 0xB3), (0x660, 0x669)]
    for ranges in (letters, numbers):
        out += struct.pack("<i", len(ranges)) + b"".join(struct.pack("<2i", a, b) for a, b in ranges)
    if corrupt:
        out = corrupt(out)
    return out


def main():
    # checkpoint
    write("checkpoint", "v0-shared", model(0))
    write("checkpoint", "v0-separate-classifier", model(0, shared=False, seed=2))
    write("checkpoint", "v0-gqa", model(0, dim=8, heads=4, kv_heads=2, layers=2, seed=3))
    write("checkpoint", "v1-shared", model(1, seed=4))
    write("checkpoint", "v1-separate", model(1, shared=False, layers=2, heads=4, kv_heads=1, seed=5))
    write("checkpoint", "v2-int8", model(2, seed=6))
    write("checkpoint", "v2-int8-separate", model(2, shared=False, group=8, seed=7))
    write("checkpoint", "v3-q4", model(3, seed=9))
    write("checkpoint", "v3-q4-separate", model(3, shared=False, group=8, layers=2, seed=10))
    write("checkpoint", "v3-q4-group2", model(3, group=2, seed=11))
    write("checkpoint", "v3-truncated-scales", model(3, seed=12)[:-3])
    write("checkpoint", "v3-odd-group", model(3, group=1, seed=13))
    write("checkpoint", "v4-f32-llama3-rope", model_v4(0, rope_scaling=1, seed=14))
    write("checkpoint", "v4-int8", model_v4(1, heads=4, kv_heads=2, seed=15))
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
    # tk42 (byte-level BPE) files: vocabulary 298
    write("tokenizer", "tk42-v298", struct.pack("<H", 297) + tk42())
    write("tokenizer", "tk42-v298-two-ends", struct.pack("<H", 297) + tk42(ends=(257, 256)))
    write("tokenizer", "tk42-v298-truncated", struct.pack("<H", 297) + tk42()[:700])
    write("tokenizer", "tk42-v298-bad-merge", struct.pack("<H", 297) + tk42(corrupt=lambda b: b.replace(
        struct.pack("<3i", 116, 104, 258), struct.pack("<3i", 104, 116, 258))))
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
        ["m.bin", "--batch", "-", "--parallel", "3", "--kv-mb", "2", "--ordered", "-f", "json"],
        ["m.bin", "--parallel", "0", "--kv-mb"],
        ["m.bin", "--version"],
        ["m.bin", "--top-k", "40", "--min-p", "0.05", "--repetition-penalty", "1.1", "--no-repeat-ngram-size", "3",
         "--min-new-tokens", "8", "--stop", "The end", "--stop", "\n"],
        ["m.bin", "-m", "tokenize", "-f", "json", "-i", "hello", "--stop", "", "--top-k", "-1"],
        ["m.bin", "--batch", "req.jsonl", "--parallel", "4", "--kv-mb", "64", "--ordered", "--min-p", "2"],
        ["m.bin", "--max-new-tokens", "10", "-m", "chat", "-n", "0"],
        ["m.bin", "--max-new-tokens", "0", "--max-new-tokens"],
        ["m.bin", "-m", "perplexity", "-I", "text.txt", "-f", "json"],
        ["m.bin", "-I", "-", "-i", "both"],
        ["m.bin", "--kv-type", "q8_0", "--kv-mb", "3", "--kv-type", "f16"],
        ["m.bin", "--kv-type", "", "--kv-type"],
        ["m.bin", "--keep", "4", "-n", "2000", "--kv-type", "q8_0", "--max-new-tokens", "900"],
        ["m.bin", "--keep", "-1", "--keep", "x", "-m", "chat", "--keep"],
        ["m.bin", "--batch", "-", "--keep", "0", "-b", "2", "--lookup", "2"],
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
        (["--batch", "-", "--parallel", "2", "-n", "60"],
         '{"prompt":"a b c d e f g h i j k l m n o p q r s","id":"x"}\n{"prompt":"a b c d e f g h i j k l m n o p q r t","beams":2}\n'
         '{"prompt":"z","steps":3,"seed":4}\n'),
        (["--batch", "-", "--kv-mb", "1", "--ordered"], '{"prompt":"long","beams":8,"steps":300}\n{"prompt":"ok"}\n'),
        (["-n", "60", "-s", "5", "--top-k", "4", "--min-p", "0.1", "--repetition-penalty", "1.3", "--stop", "e",
          "-i", "the"], ""),
        (["-b", "3", "-r", "3", "-n", "50", "--no-repeat-ngram-size", "2", "--min-new-tokens", "10", "--stop", "a",
          "--stop", "the", "-f", "json"], ""),
        (["-m", "chat", "-y", "", "-n", "200", "--stop", "o", "--repetition-penalty", "0.5"], "hi\nmore\nand more\n"),
        (["-m", "tokenize", "-i", "h\u00e9llo <0x41> \n", "-f", "json"], ""),
        (["-m", "chat", "-y", "sys", "-n", "40", "--max-new-tokens", "6", "-s", "2"], "hi\n" * 12),
        (["-b", "2", "--max-new-tokens", "3", "-i", "abc"], ""),
        (["-m", "chat", "-y", "sys", "-n", "30"], "x" * 200 + "\nhi\n"),
        (["-t", "0", "--lookup", "2", "-n", "90", "-i", "a b a b a b", "--stop", "b a c"], ""),
        (["-m", "chat", "-y", "", "-t", "0", "--lookup", "1", "--draft-max", "3", "-n", "100", "-f", "json"], "hi\nhi\n"),
        (["--keep", "2", "-n", "300", "-s", "3", "-i", "Once upon a time", "--kv-type", "f16"], ""),
        (["--batch", "-", "--keep", "4", "--kv-mb", "1", "-n", "200"],
         '{"prompt":"a b c d e f g h i j k l m n o p q r s","id":"x"}\n{"prompt":"a b c d e f g h i j k l m n o p q r s","seed":2}\n'),
    ]
    for i, (argv, stdin) in enumerate(runs):
        write("generate", "run%d" % i, b"\0".join(a.encode() for a in argv) + b"\0\0" + stdin.encode())
    # batch: the bytes of a batch file
    batches = [
        '{"prompt":"Once upon a time"}\n',
        '{"prompt":"a\\n\\"b\\u00e9\\ud83d\\ude00","id":"r1","steps":64,"temperature":0.5,"top_p":0.9,"seed":7}\n'
        '\n{"prompt":"c","beams":3,"return":2,"length_penalty":-0.5,"early_stopping":"never","id":12.5e3}\r\n',
        '{"prompt":"x","early_stopping":1} \n{"prompt":"y","early_stopping":0,"beams":2}',
        '{"prompt":"x","top_p":2}\n',
        '{"prompt":"x","colour":[1,{"a":2}]}\n',
        '{"prompt":"\\ud800"}\n',
        '',
        # good and bad lines interleaved: each bad one is refused alone
        '{"prompt":"a","id":1}\nnot json\n{"prompt":"b","stop":["x","y"],"steps":9}\n'
        '{"stop":["x"],"id":"s","prompt":"c","colour":1}\n  \n{"prompt":"d","top_k":3}\r\n'
        '{"prompt":"e","beams":9}\n{"prompt":"f","beams":2,"return":3}\n{"prompt":"g"',
        '\n\n{"prompt":5,"id":"late"}\n{"id":"early","prompt":5}\n{"prompt":"h","min_new_tokens":300}\n{}\n',
    ]
    for i, text in enumerate(batches):
        write("batch", "batch%d" % i, text.encode())
    # http: the bytes a client sends to -m serve
    def post(path, body):
        return ("POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (path, len(body.encode()), body))
    requests = [
        post("/v1/completions", '{"prompt":"Once upon a time","max_tokens":20,"temperature":0,"stream":true}'),
        post("/v1/completions", '{"prompt":"a\\u00e9","stop":["x","\\n"],"top_k":5,"min_p":0.1,"seed":3,"n":1,"user":"u",'
             '"logit_bias":{},"extra":[1,{"a":null}],"num_beams":2,"repetition_penalty":1.2,"min_new_tokens":1}'),
        post("/v1/chat/completions", '{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"},'
             '{"role":"assistant","content":"yo"},{"role":"user","content":"more"}],"max_tokens":5,"stop":null}'),
        post("/v1/completions", '{"prompt":5}'),
        post("/v1/completions", '{"prompt":"x",'),
        "GET /v1/models?x=1 HTTP/1.1\r\nAuthorization: Bearer k\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET /health HTTP/1.0\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab",
    ]
    for i, text in enumerate(requests):
        write("http", "http%d" % i, text.encode())

    gguf_seeds()


def gguf_seeds():
    """gguf: small random GGUF models written by tests/gguf_ref.py (which
    needs numpy; without it these seeds are left as they are): a float32
    llama and a q8_0 qwen2 (the seeds the target's harness check loads), a
    float model of each other float type, models of each 32-value block
    type, and one of each type of 256-value blocks (the K types, IQ4_XS) in
    ffn_down (rows of 256 values)."""
    try:
        import sys
        sys.path.insert(0, os.path.dirname(HERE))
        import gguf_ref
    except ImportError:
        print("make_seeds.py: no numpy: the gguf seeds are left as they are")
        return
    small = dict(dim=16, ffn=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab=8, ctx=16, vocab_meta=False)
    blocks = dict(small, dim=32)
    seeds = {
        "llama-f32": dict(small, rope_freqs=True),
        "qwen2-q8_0": dict(blocks, arch="qwen2", wtype="Q8_0", tied=True),
        "llama-f16": dict(small, wtype="F16", tied=True),
        "llama-bf16": dict(small, wtype="BF16"),
    }
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"):
        seeds["llama-" + t.lower()] = dict(blocks, wtype=t)
    for t in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
        seeds["llama-" + t.lower()] = dict(blocks, ffn=256, wtype="Q8_0", types={"ffn_down.weight": t})
    for name, kw in seeds.items():
        meta, tensors = gguf_ref.random_model(seed=len(name), **kw)
        write("gguf", name, gguf_ref.build_gguf(meta, tensors)[0])
    # one small file of each architecture beyond llama and qwen2 (tests/arch_models.py),
    # float16 to stay under the target's 32 KiB inputs
    import arch_models
    tiny = dict(dim=16, n_heads=2, n_kv_heads=1, ffn=32, n_layers=1, wtype="F16", vocab=8, ctx=16, vocab_meta=False)
    archs = {
        "qwen3": dict(head_dim=16), "phi3": dict(dim=32, n_rot=8, orig_ctx=8), "smollm3": dict(n_layers=4, ffn=8),
        "granite": {}, "gemma3": dict(head_dim=16, n_layers=2, window=2), "qwen3moe": dict(head_dim=16, n_expert=4, n_used=2, expert_ffn=8),
        "qwen2moe": dict(n_expert=4, n_used=2, expert_ffn=8, shared_ffn=8), "olmoe": dict(n_kv_heads=2, n_expert=4, n_used=2),
        "gpt-oss": dict(head_dim=8, n_layers=2, window=2, n_expert=4, n_used=2, expert_ffn=8, orig_ctx=8),
        "deepseek2": dict(n_layers=2, n_expert=4, n_used=2, expert_ffn=8, n_rot=8, kv_rank=8, nope=8, v_head=8, n_shared=1,
                          q_rank=8, generation="k_b", orig_ctx=8),
    }
    for arch, kw in archs.items():
        meta, tensors = arch_models.arch_model(arch, seed=len(arch), **dict(tiny, **kw))
        if arch == "gemma3":
            meta["gemma3.attention.sliding_window_pattern"] = 2
        write("gguf", arch + "-f16", gguf_ref.build_gguf(meta, tensors)[0])


if __name__ == "__main__":
    main()
