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


def write_vocab(path, renamed):
    """tok512 as a GGUF vocabulary with ChatML's tokens in place of '[' and
    ']' (508, 509) and `renamed` {id: (text, type)}."""
    spec = importlib.util.spec_from_file_location("export_for_tests", EXPORT)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    v = ex.vocab_llama2c(TOK512)
    assert v["tokens"][508] == b"[" and v["tokens"][509] == b"]", v["tokens"][508:510]
    for i, (text, kind) in list({508: (b"<|im_start|>", CONTROL), 509: (b"<|im_end|>", CONTROL)}.items()) + list(renamed.items()):
        v["tokens"][i], v["types"][i] = text, kind
    v["chat_templates"] = [("tokenizer.chat_template", CHATML)]
    ex.write_gguf(path, [("general.architecture", ex.GV_STRING, "llama"), ("general.name", ex.GV_STRING, "t")] + ex.vocab_metadata(v), [])


def chat_json(vocab, *flags):
    p = subprocess.run([RUN, MODEL, "-z", vocab, "-m", "chat", "-f", "json", "-t", "0", "-n", "120", "-y", SYSTEM, "-i", USER] + list(flags),
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    return json.loads(p.stdout.decode().strip().split("\n")[-1])


def prompt_ids(vocab):
    p = subprocess.run([DUMP, "chat", vocab, "1", SYSTEM, USER], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode().split("\n")[0]


def thinking_vocab():
    """(vocab path, the reply's whole text) of the model made to think."""
    for f in (MODEL, TOK512):
        if not os.path.isfile(f):
            raise Skip("no %s" % f)
    if not os.path.isfile(DUMP):
        raise AssertionError("%s is missing (make tests/.bin/gguf_vocab_dump)" % DUMP)
    os.makedirs(TMP, exist_ok=True)
    plain, thinking = os.path.join(TMP, "chatml.gguf"), os.path.join(TMP, "thinking.gguf")
    write_vocab(plain, {})
    tokens, prompt = chat_json(plain)["tokens"], set(int(x) for x in prompt_ids(plain).split())
    first = tokens[0]
    assert first not in prompt, "the reply's first token %d is in the prompt" % first
    # </think>: the first later token, new in the reply and not in the prompt,
    # whose renaming leaves the prompt's tokens as they were (no merge of the
    # prompt's goes through it)
    for j, close in enumerate(tokens):
        if j < 2 or close in prompt or close in tokens[:j]:
            continue
        write_vocab(thinking, {first: (b"<think>", USER_DEFINED), close: (b"</think>", USER_DEFINED)})
        if prompt_ids(plain) == prompt_ids(thinking):
            break
    else:
        raise AssertionError("no token of the reply can become </think> without changing the prompt's tokens")
    reply = chat_json(thinking)
    assert reply["tokens"] == tokens, "the reply's tokens changed"
    assert reply["text"].startswith("<think>"), reply["text"][:40]
    return thinking, reply["text"]


def expected_split(text):
    """(reasoning_content, content): llama-server's and vLLM's split of a reply."""
    inner, _, rest = text[len("<think>"):].partition("</think>")
    return inner, rest.lstrip()


def test_serve():
    vocab, text = thinking_vocab()
    reasoning, content = expected_split(text)
    import test_serve as ts
    ts.MODEL, ts.TOK = MODEL, vocab
    srv = ts.Server("-n", "120")
    try:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], "temperature": 0}
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


def test_chat_hide():
    vocab, text = thinking_vocab()
    _, content = expected_split(text)
    p = subprocess.run([RUN, MODEL, "-z", vocab, "-m", "chat", "-t", "0", "-n", "120", "-y", SYSTEM, "-i", USER, "--reasoning", "hide"],
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    out = p.stdout.decode()
    assert "Assistant: " + content + "\n" in out, (out[-200:], content)


def main():
    case("serve_reasoning_content", test_serve)
    case("chat_reasoning_hide", test_chat_hide)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
