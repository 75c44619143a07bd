#!/usr/bin/env python3
"""Tool calls from the command line (issue #57, run.c 11.2): -m chat with
--tools, --tool-choice and --tool-results, and --batch lines with
"messages", "tools", "tool_choice" and "parallel_tool_calls".

The server's tool calls are checked against independent renderings of the
templates (tests/test_serve_tools.py); here the command line is checked
against the server: for the same conversation, tools, choice and greedy
settings, -m chat -f json's replies (the call, then the answer to the
results that --tool-results feeds back) and a --batch line's answer carry
the same message (content, calls' names and arguments) and finish_reason as
/v1/chat/completions returns, and every call's arguments parse and validate
against its tool's parameters (Debian's python3-jsonschema). A --batch
line with the conversation of the chat's first reply prints the chat's JSON
line (with its "id"). Text mode shows each call as one JSON line; results
typed on stdin give the replies of --tool-results. A batch line without
"tools" takes --tools, and a named choice with parallel_tool_calls false
makes one call of that tool.
On the models of test_serve_tools.py: stories260K with tok512 (MODELS_DIR;
SKIP when absent), the random Qwen3 and Llama 3 GGUF files (Llama 3 also
with Llama 3.1's template: its format, and "auto" free; the random model
with Mistral Small 3.2's vocabulary and template, whose prompts hold the
calls' ids: the server answers the results under the chat's ids, and its
marker model that writes [TOOL_CALLS] again after each call's arguments:
4 parallel calls from -m chat, chat and --batch equal to the server), the random
gpt-oss-layout model with gpt-oss's Harmony template and its own tools
(test_serve_tools.H_TOOLS), and the model
that writes "Hello" and then Qwen's <tool_call> marker itself ("auto": the
constraint from the model's own marker on).
Bad input: a tools file that is not a JSON array of tools (not JSON, an
object, a tool without a name, a name twice, a schema keyword 6.1 does not
take, text after the array), an unknown --tool-choice name, --tools outside
chat and --batch, --tool-choice without --tools, --tool-results with
--batch: one line on stderr naming the problem, exit status 2; batch lines
with tools but no messages, with both prompt and messages, or a
tool_choice naming no tool: refused alone.

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
import test_serve_tools as st  # noqa: E402

RUN = os.environ.get("RUN", "./run")
TMP = os.path.join(os.environ.get("TEST_TMP", "tests/.tmp"), "cli_tools")
STORIES, TOK512 = ts.MODEL, ts.TOK
TOOLS, USER = st.TOOLS, st.USER
RESULTS = ['{"temperature": 21}', "5", "6", "7"]  # one a call: 4 at most a reply


def files(tool_list=TOOLS):
    os.makedirs(TMP, exist_ok=True)
    tools, results = os.path.join(TMP, "tools.json"), os.path.join(TMP, "results.txt")
    json.dump(tool_list, open(tools, "w"))
    open(results, "w").write("\n".join(RESULTS) + "\n")
    return tools, results


def run(args, stdin=b"", timeout=600):
    return subprocess.run([RUN] + args, input=stdin, capture_output=True, timeout=timeout)


def shape(message, finish):
    """What must agree: the content, each call's name and arguments, the finish reason."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return {"content": message.get("content"), "calls": calls, "finish": finish}


def validated(name, message, only=None, tool_list=TOOLS):
    """Checks the calls of `message` as test_serve_tools.check_calls does."""
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.get("tool_calls") or []]
    st.check_calls(name, {"calls": calls, "finish": "tool_calls" if calls else None}, only, tool_list)
    for c in message.get("tool_calls") or []:
        assert c["type"] == "function", c
    return len(calls)


def server_turns(srv, choice, max_tokens, parallel=True, tool_list=TOOLS, ids=None):
    """The server's first reply to USER and, when it called, its reply to
    RESULTS (asked with "auto", as the command line asks it): [(message, finish)], and the second request's messages.
    ids: the calls' ids in those messages instead of the server's (Mistral's prompt has them)."""
    body = {"messages": [{"role": "user", "content": USER}], "tools": tool_list, "tool_choice": choice, "max_tokens": max_tokens,
            "temperature": 0, "parallel_tool_calls": parallel}
    status, answer = srv.post("/v1/chat/completions", body)
    assert status == 200, answer
    first = answer["choices"][0]
    turns, history = [(first["message"], first["finish_reason"])], None
    calls = first["message"].get("tool_calls") or []
    if calls:
        if ids:
            calls = [dict(c, id=i) for c, i in zip(calls, ids)]
            first["message"] = dict(first["message"], tool_calls=calls)
        history = body["messages"] + [first["message"]] + [
            {"role": "tool", "tool_call_id": c["id"], "content": RESULTS[k]} for k, c in enumerate(calls)]
        status, answer = srv.post("/v1/chat/completions", dict(body, messages=history, tool_choice="auto"))
        if status == 400 and "do not fit" in answer["error"]["message"]:  # stories260K's 512 positions after 4 calls
            turns.append(None)
        else:
            assert status == 200, answer
            turns.append((answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]))
    return turns, history


def cli_chat(model, tok, choice, max_tokens, fmt="json", tool_list=TOOLS):
    tools, results = files(tool_list)
    p = run([model, "-z", tok, "-m", "chat", "-f", fmt, "-y", "", "-i", USER, "--tools", tools, "--tool-choice", choice, "-t", "0",
             "--max-new-tokens", str(max_tokens), "--tool-results", results])
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-600:]
    return p.stdout.decode(), p.stderr.decode()


def against_server(model, tok, max_tokens, choices=("required", "get_weather", "calculate"), tool_list=TOOLS, mistral=False):
    """-m chat and --batch against the server, for each choice (the last
    tool of tool_list also named with one call; mistral: the calls' ids are
    Mistral's, 9 letters and digits)."""
    tools, _ = files(tool_list)
    single = tool_list[-1]["function"]["name"]
    ts.MODEL, ts.TOK = model, tok
    try:
        srv = ts.Server()
    finally:
        ts.MODEL, ts.TOK = STORIES, TOK512
    lines, expected, report, chat_lines = [], [], [], []
    try:
        for choice in choices:
            api_choice = choice if choice in ("auto", "none", "required") else {"type": "function", "function": {"name": choice}}
            turns, history = server_turns(srv, api_choice, max_tokens, tool_list=tool_list)
            only = None if choice in ("auto", "required") else choice
            n = validated("server " + choice, turns[0][0], only, tool_list)
            assert choice == "auto" or n > 0, "server %s: no call: %s" % (choice, turns[0])
            out, err = cli_chat(model, tok, choice, max_tokens, tool_list=tool_list)
            got = [json.loads(line) for line in out.splitlines()]
            if mistral and got[0]["message"].get("tool_calls"):  # the results answer the chat's ids, which its prompt has
                turns, history = server_turns(srv, api_choice, max_tokens, tool_list=tool_list,
                                              ids=[c["id"] for c in got[0]["message"]["tool_calls"]])
            chat_lines.append(got[0])
            replies = [t for t in turns if t is not None]
            if turns[-1] is None:  # the reply to the results does not fit: the server refuses it, the chat ends
                assert "do not fit the model's context" in err and "the chat ends" in err, err
            assert len(got) == len(replies), "chat %s: %d replies, the server %d: %s" % (choice, len(got), len(replies), got)
            for k, (g, (message, finish)) in enumerate(zip(got, replies)):
                validated("chat %s reply %d" % (choice, k), g["message"], only if k == 0 else None, tool_list)
                assert shape(g["message"], g["finish_reason"]) == shape(message, finish), \
                    "chat %s reply %d: run -m chat %s, the server %s" % (choice, k, shape(g["message"], g["finish_reason"]), shape(message, finish))
            # the same requests as --batch lines (the first without "tools": --tools stands for them)
            base = {"temperature": 0, "max_new_tokens": max_tokens, "tool_choice": api_choice}
            lines.append(dict(base, id="%s-1" % choice, messages=[{"role": "user", "content": USER}]))
            expected.append(turns[0])
            if history:
                lines.append(dict(base, id="%s-2" % choice, messages=history, tools=tool_list, tool_choice="auto"))
                expected.append(turns[1])
            report.append("%s: %d calls, then %s" % (choice, n, repr((turns[1][0].get("content") or "")[:30]) if len(turns) > 1 and turns[1]
                                                      else "no room for the answer"))
        # a named tool, one call (not a list)
        turns, _ = server_turns(srv, {"type": "function", "function": {"name": single}}, max_tokens, parallel=False, tool_list=tool_list)
        assert len(turns[0][0].get("tool_calls") or []) == 1, turns[0]
        lines.append({"id": "single", "messages": [{"role": "user", "content": USER}], "tools": tool_list, "parallel_tool_calls": False,
                      "tool_choice": {"type": "function", "function": {"name": single}}, "temperature": 0, "max_new_tokens": max_tokens})
        expected.append(turns[0])
    finally:
        code = srv.stop()
    assert code == 0, "the server exited with %r" % code
    batch = os.path.join(TMP, "batch.jsonl")
    open(batch, "w").write("".join(json.dumps(line) + "\n" for line in lines))
    p = run([model, "-z", tok, "--batch", batch, "--tools", tools, "--ordered"])
    assert p.returncode == (1 if None in expected else 0), p.stderr.decode(errors="replace")[-600:]  # 1: a request failed
    got = [json.loads(line) for line in p.stdout.decode().splitlines()]
    assert [g["id"] for g in got] == [line["id"] for line in lines], got
    for g, line, want in zip(got, lines, expected):
        if want is None:
            assert "do not fit" in g.get("error", ""), g
            continue
        message, finish = want
        validated("batch " + line["id"], g["message"], None, tool_list)
        assert shape(g["message"], g["finish_reason"]) == shape(message, finish), \
            "batch %s: run %s, the server %s" % (line["id"], shape(g["message"], g["finish_reason"]), shape(message, finish))
        for c in g["message"].get("tool_calls") or []:
            assert (len(c["id"]) == 9 and c["id"].isalnum()) if mistral else c["id"].startswith("call_%d_" % (lines.index(line) + 1)), g
    # line 1 is the chat's first reply, whose calls are named call_1_K too: the same line, with the batch's "id"
    assert dict(got[0], id=None) == dict(chat_lines[0], id=None), "batch line 1 %s, -m chat -f json %s" % (got[0], chat_lines[0])
    assert len(got[-1]["message"]["tool_calls"]) == 1 and got[-1]["message"]["tool_calls"][0]["function"]["name"] == single, got[-1]
    print("# %s: %s" % (os.path.basename(model), "; ".join(report)), flush=True)


def text_mode():
    """Text mode: the calls as JSON lines after "Tool call: ", the results echoed."""
    out, _ = cli_chat(STORIES, TOK512, "required", 250, fmt="text")
    calls = [json.loads(line[len("Tool call: "):]) for line in out.splitlines() if line.startswith("Tool call: ")]
    assert calls, out
    validated("text", {"tool_calls": calls})
    assert [c["id"] for c in calls] == ["call_1_%d" % k for k in range(len(calls))], calls
    for k, c in enumerate(calls):
        assert "Tool result (%s): %s" % (c["id"], RESULTS[k]) in out, out
    assert out.count("Assistant: ") == 1, out  # (the answer to 4 results does not fit stories260K's context)


def results_from_stdin():
    """Without --tool-results the results are read as input lines: the same replies."""
    tools, _ = files()
    model, vocab = st.marker_model()
    args = [model, "-z", vocab, "-m", "chat", "-f", "json", "-y", "", "-i", USER, "--tools", tools, "-t", "0", "--max-new-tokens", "200"]
    typed = run(args, stdin=("\n".join(RESULTS) + "\n").encode())
    filed, _ = cli_chat(model, vocab, "auto", 200)
    assert typed.returncode == 0, typed.stderr.decode(errors="replace")
    replies = typed.stdout.decode().splitlines()
    assert len(replies) == 2 and replies == filed.splitlines(), (replies, filed)
    assert json.loads(replies[0])["finish_reason"] == "tool_calls" and json.loads(replies[1])["message"]["content"] == "Hello", replies


def auto_marker():
    """"auto" on the model that writes Hello<tool_call>: the constraint from its own marker, as the server's."""
    model, vocab = st.marker_model()
    against_server(model, vocab, 200, choices=("auto",))


def mistral_parallel():
    """Mistral's parallel calls from the command line (the model of
    test_serve_tools.mistral_parallel_model, which writes [TOOL_CALLS] again
    after each call's arguments): -m chat's "required" reply makes 4 calls,
    each valid with a 9-character id; chat and --batch equal the server's
    replies, "required" and "auto"; a line with parallel_tool_calls false
    makes one call."""
    model, vocab = st.mistral_parallel_model()
    out, _ = cli_chat(model, vocab, "required", 300)
    first = json.loads(out.splitlines()[0])["message"]
    assert validated("chat parallel", first) == 4 and all(len(c["id"]) == 9 for c in first["tool_calls"]), first
    against_server(model, vocab, 300, choices=("required", "auto"), mistral=True)


def bad_input():
    tools, results = files()
    bad = os.path.join(TMP, "bad.json")
    base = [STORIES, "-z", TOK512]
    cases = [
        ('{"type": "function"}', [], "not a JSON array"),
        ("[{\"type\": \"function\"", [], "--tools"),
        ("not json", [], "not a JSON array"),
        ('[{"type": "function", "function": {"parameters": {}}}]', [], "tools[0].function.name"),
        (json.dumps(TOOLS + TOOLS[:1]), [], "'get_weather' is given twice"),
        (json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "s": {"type": "string", "pattern": "a+"}}}}}]), [], "pattern"),
        (json.dumps(TOOLS) + " []", [], "text after the array"),
        ("[]", [], "empty"),
        (json.dumps(TOOLS), ["--tool-choice", "nope"], "no tool of that name"),
    ]
    for text, extra, want in cases:
        open(bad, "w").write(text)
        p = run(base + ["-m", "chat", "--tools", bad] + extra)
        err = p.stderr.decode()
        assert p.returncode == 2 and want in err and err.count("\n") == 1, "%r %s: status %d, %r" % (text, extra, p.returncode, err)
        assert "JSON array of tools" in err or "auto, none, required" in err, err  # what to give
    for args, want in [(["-i", "x", "--tools", tools], "applies to -m chat and --batch"),
                       (["-m", "serve", "--tools", tools], "applies to -m chat and --batch"),
                       (["-m", "chat", "--tool-choice", "required"], "need --tools"),
                       (["--batch", "-", "--tools", tools, "--tool-results", results], "--tool-results applies to -m chat")]:
        p = run(base + args)
        err = p.stderr.decode()
        assert p.returncode == 2 and want in err and err.count("\n") == 1, "%s: status %d, %r" % (args, p.returncode, err)
    user = [{"role": "user", "content": USER}]
    lines = [{"id": "a", "prompt": "x", "tools": TOOLS},
             {"id": "b", "prompt": "x", "messages": user},
             {"id": "c", "messages": user, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             {"id": "d", "messages": user, "tool_choice": "required"},
             {"id": "e", "messages": user, "max_new_tokens": 3}]
    batch = os.path.join(TMP, "bad.jsonl")
    open(batch, "w").write("".join(json.dumps(line) + "\n" for line in lines))
    p = run(base + ["--batch", batch, "--ordered"])
    got = [json.loads(line) for line in p.stdout.decode().splitlines()]
    assert p.returncode == 1, (p.returncode, p.stderr.decode())
    for g, want in zip(got, ["need 'messages'", "both give the prompt", "no tool named 'nope'", "\"required\" needs 'tools'"]):
        assert want in g.get("error", ""), (want, g)
    assert got[4]["id"] == "e" and "message" in got[4] and got[4]["finish_reason"] == "length", got[4]


def need_stories(f):
    def run_case():
        if not (os.path.exists(STORIES) and os.path.exists(TOK512)):
            raise Skip("stories260K.bin or tok512.bin not in MODELS_DIR")
        f()
    return run_case


def main():
    case("cli_tools_bad_input", need_stories(bad_input))
    case("cli_tools_text_mode", need_stories(text_mode))
    case("cli_tools_stories260K", need_stories(lambda: against_server(STORIES, TOK512, 250, choices=("required", "calculate"))))
    case("cli_tools_auto_marker", auto_marker)
    case("cli_tools_results_from_stdin", results_from_stdin)
    case("cli_tools_random_qwen3", lambda: against_server(*st.random_gguf("qwen3"), 200, choices=("required", "get_weather")))
    case("cli_tools_random_llama3", lambda: against_server(*st.random_gguf("llama3"), 200, choices=("required", "calculate")))
    case("cli_tools_random_llama3_1", lambda: against_server(st.random_gguf("llama3")[0], st.llama31_vocab()[0], 200,
                                                             choices=("required", "calculate", "auto")))
    case("cli_tools_mistral_parallel", mistral_parallel)
    case("cli_tools_random_mistral", lambda: against_server(*st.mistral_model(), 200, choices=("required", "calculate", "auto"), mistral=True))
    case("cli_tools_random_harmony", lambda: against_server(st.harmony_random_gguf(), st.cf.harmony_gguf()[0], 200,
                                                            choices=("required", "plan_route", "auto"), tool_list=st.H_TOOLS))
    return 1 if COUNTS["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
