#!/usr/bin/env python3
"""A thinking model's reply in serve: message.reasoning_content and
delta.reasoning_content, never in content (as llama-server and vLLM send a
Qwen3 reply), and --reasoning hide in chat.

No model that thinks is small enough for the tests, so one is made to: the
stories260K model with its tok512 vocabulary written as a GGUF vocabulary
(export.py's own reader of tokenizer.bin) with ChatML's <|im_start|> and
<|im_end|> in two byte tokens the conversation never uses, is asked a
question greedily; then the first token of its reply becomes <think> and a
later one </think> (user-defined tokens, as in Qwen3's vocabulary), tokens
that the prompt does not use. The prompt
tokens stay the same (checked), so the model gives the same tokens, now
reading <think>X</think>... The split expected is the rule llama-server and
vLLM apply to such a reply, applied here by Python to the reply's whole
text (./run -m chat -f json): reasoning_content the text between the
markers, content what follows </think> without its leading white space.
The same for gpt-oss's Harmony: tok512 with <|start|>, <|message|> and
<|end|> in '[', ']' and '~', a template naming <|channel|>, the message
"Once upon a time" (whose reply opens with a token the long Harmony prompt
does not use), its first token made <|channel|>analysis<|message|> and a
later one <|end|><|start|>assistant<|channel|>final<|message|>:
reasoning_content the analysis channel's text, content the final one's.

Env: RUN, PYTHON, MODELS_DIR, TEST_TMP, EXPORT_PY. Prints PASS/FAIL/SKIP lines."""

import importlib.util
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get("RUN", "./run")
MODELS = os.environ.get("MODELS_DIR", os.path.join(ROOT, "..", "shared", "models"))
MODEL, TOK512 = os.path.join(MODELS, "stories260K.bin"), os.path.join(MODELS, "tok512.bin")
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "serve_reasoning")
EXPORT = os.environ.get("EXPORT_PY", os.path.join(ROOT, "export.py"))
DUMP = os.path.join(HERE, ".bin", "gguf_vocab_dump")
SYSTEM, USER = "Be brief.", "Tell me about a cat."
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
CONTROL, USER_DEFINED = 3, 4
# Harmony (gpt-oss): run.c renders it itself; the template's <|channel|> names the family
HARMONY = "{{- '<|start|>system<|message|>' }}{# <|channel|>analysis, final #}"
FAMILIES = {"chatml": (CHATML, {508: (b"<|im_start|>", CONTROL), 509: (b"<|im_end|>", CONTROL)}),
            "harmony": (HARMONY, {508: (b"<|start|>", CONTROL), 509: (b"<|message|>", CONTROL), 510: (b"<|end|>", CONTROL)})}
# the markers a made-up Harmony reply gets in two of its tokens (ThinkSplit reads the text)
HARMONY_OPEN = b"<|channel|>analysis<|message|>"
HARMONY_FINAL = b"<|end|><|start|>assistant<|channel|>final<|message|>"


def write_vocab(path, renamed, family="chatml"):
    """tok512 as a GGUF vocabulary with the family's tokens in place of '[',
    ']' (508, 509) and, for Harmony, '~' (510), and `renamed` {id: (text, type)}."""
    spec = importlib.util.spec_from_file_location("export_for_tests", EXPORT)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    v = ex.vocab_llama2c(TOK512)
    assert v["tokens"][508:511] == [b"[", b"]", b"~"], v["tokens"][508:511]
    template, tokens = FAMILIES[family]
    for i, (text, kind) in list(tokens.items()) + list(renamed.items()):
        v["tokens"][i], v["types"][i] = text, kind
    v["chat_templates"] = [("tokenizer.chat_template", template)]
    ex.write_gguf(path, [("general.architecture", ex.GV_STRING, "llama"), ("general.name", ex.GV_STRING, "t")] + ex.vocab_metadata(v), [])


def steps(vocab):
    """The context: Harmony's system message alone is 230 tokens of tok512."""
    return "400" if "harmony" in os.path.basename(vocab) else "120"


def user(vocab):
    """The message: under Harmony's long prompt, one whose reply opens with
    a token the prompt does not use (the one to become the opening marker)."""
    return "Once upon a time" if "harmony" in os.path.basename(vocab) else USER


def chat_json(vocab, *flags):
    p = subprocess.run([RUN, MODEL, "-z", vocab, "-m", "chat", "-f", "json", "-t", "0", "-n", steps(vocab), "-y", SYSTEM, "-i", user(vocab)] + list(flags),
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    return json.loads(p.stdout.decode().strip().split("\n")[-1])


def prompt_ids(vocab):
    """The first turn's ids (the family the vocabulary's template names)."""
    p = subprocess.run([DUMP, "chat", vocab, "1", SYSTEM, user(vocab)], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().split("\n")[0]


def thinking_vocab(family="chatml"):
    """(vocab path, the reply's whole text) of the model made to think:
    Qwen3's <think>...</think> (chatml), or Harmony's analysis channel then
    its final one (harmony)."""
    for f in (MODEL, TOK512):
        if not os.path.isfile(f):
            raise Skip("no %s" % f)
    if not os.path.isfile(DUMP):
        raise AssertionError("%s is missing (make tests/.bin/gguf_vocab_dump)" % DUMP)
    os.makedirs(TMP, exist_ok=True)
    plain, thinking = os.path.join(TMP, family + ".gguf"), os.path.join(TMP, family + "-thinking.gguf")
    write_vocab(plain, {}, family)
    markers = (b"<think>", b"</think>") if family == "chatml" else (HARMONY_OPEN, HARMONY_FINAL)
    tokens, prompt = chat_json(plain)["tokens"], set(int(x) for x in prompt_ids(plain).split())
    first = tokens[0]
    assert first not in prompt, "the reply's first token %d is in the prompt" % first
    # </think>: the first later token, new in the reply and not in the prompt,
    # whose renaming leaves the prompt's tokens as they were (no merge of the
    # prompt's goes through it)
    for j, close in enumerate(tokens):
        if j < 2 or close in prompt or close in tokens[:j]:
            continue
        write_vocab(thinking, {first: (markers[0], USER_DEFINED), close: (markers[1], USER_DEFINED)}, family)
        if prompt_ids(plain) == prompt_ids(thinking):
            break
    else:
        raise AssertionError("no token of the reply can become </think> without changing the prompt's tokens")
    reply = chat_json(thinking)
    assert reply["tokens"] == tokens, "the reply's tokens changed"
    assert reply["text"].startswith(markers[0].decode()), reply["text"][:40]
    return thinking, reply["text"]


def expected_split(text):
    """(reasoning_content, content): llama-server's and vLLM's split of a
    reply; Harmony's: the analysis channel's text, the final channel's."""
    if text.startswith(HARMONY_OPEN.decode()):
        inner, _, rest = text[len(HARMONY_OPEN):].partition(HARMONY_FINAL.decode())
        return inner, rest
    inner, _, rest = text[len("<think>"):].partition("</think>")
    return inner, rest.lstrip()


def test_serve(family="chatml"):
    vocab, text = thinking_vocab(family)
    reasoning, content = expected_split(text)
    import test_serve as ts
    ts.MODEL, ts.TOK = MODEL, vocab
    srv = ts.Server("-n", steps(vocab))
    try:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user(vocab)}], "temperature": 0}
        status, answer = srv.post("/v1/chat/completions", body)
        assert status == 200, answer
        msg = answer["choices"][0]["message"]
        assert msg.get("reasoning_content") == reasoning and msg["content"] == content, (msg, reasoning, content)
        events, done = srv.stream("/v1/chat/completions", body)
        assert done
        deltas = [e["choices"][0]["delta"] for e in events]
        got_r = "".join(d.get("reasoning_content", "") for d in deltas)
        got_c = "".join(d.get("content", "") for d in deltas)
        assert got_r == reasoning and got_c == content, (got_r, got_c, reasoning, content)
        assert not any("content" in d and "reasoning_content" in d for d in deltas), deltas
    finally:
        srv.stop()
    print("# reasoning %r, content %r..." % (reasoning, content[:30]), flush=True)


def test_chat_hide(family="chatml"):
    vocab, text = thinking_vocab(family)
    _, content = expected_split(text)
    p = subprocess.run([RUN, MODEL, "-z", vocab, "-m", "chat", "-t", "0", "-n", steps(vocab), "-y", SYSTEM, "-i", user(vocab), "--reasoning", "hide"],
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    out = p.stdout.decode()
    assert "Assistant: " + content + "\n" in out, (out[-200:], content)


def main():
    case("serve_reasoning_content", test_serve)
    case("chat_reasoning_hide", test_chat_hide)
    case("serve_reasoning_content_harmony", lambda: test_serve("harmony"))
    case("chat_reasoning_hide_harmony", lambda: test_chat_hide("harmony"))
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
