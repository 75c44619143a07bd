// Tool calls (issue #57) through the official `openai` npm package: for
// the tools in TOOLS.json, tool_choice required, named and auto, streamed
// and not, one call and parallel calls, then the calls' results sent back
// and a final answer. Prints one JSON object: per case its finish reason,
// content and calls ({id, name, arguments}), for tests/test_serve_tools.py.
//   OPENAI_PREFIX=<npm --prefix dir> node serve_tools_client.mjs BASE_URL MODEL TOOLS.json MAX_TOKENS HISTORY
// HISTORY: the case whose calls are answered (required_one where the
// context is short, required_parallel)
import { createRequire } from 'module';
import fs from 'fs';

const require = createRequire(process.env.OPENAI_PREFIX + '/package.json');
const mod = require('openai');
const OpenAI = mod.OpenAI || mod.default || mod;
const client = new OpenAI({ baseURL: process.argv[2], apiKey: 'none', maxRetries: 0 });
const model = process.argv[3];
const tools = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));
const max_tokens = Number(process.argv[5]);
const messages = [{ role: 'user', content: 'What is the weather in Paris, and what is 2 plus 3?' }];
const out = {};

// One completion, streamed or not, as {finish, content, calls}; a stream's
// tool_calls deltas are put together by index, as a client does.
async function ask(name, extra, stream) {
  const body = { model, messages, tools, max_tokens, seed: 7, temperature: 1, ...extra };
  if (!stream) {
    const r = await client.chat.completions.create(body);
    const m = r.choices[0].message;
    out[name] = { finish: r.choices[0].finish_reason, content: m.content,
                  calls: (m.tool_calls || []).map((c) => ({ id: c.id, type: c.type, name: c.function.name, arguments: c.function.arguments })) };
    return out[name];
  }
  const s = await client.chat.completions.create({ ...body, stream: true });
  let content = '', finish = null;
  const calls = [];
  for await (const chunk of s) {
    const ch = chunk.choices[0];
    if (ch.delta.content) content += ch.delta.content;
    for (const d of ch.delta.tool_calls || []) {
      if (!calls[d.index]) calls[d.index] = { id: d.id, type: d.type, name: d.function.name, arguments: '' };
      calls[d.index].arguments += d.function.arguments || '';
    }
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  out[name] = { finish, content, calls };
  return out[name];
}

const names = tools.map((t) => t.function.name);
for (const stream of [false, true]) {
  const tag = stream ? '_streamed' : '';
  await ask('required_one' + tag, { tool_choice: 'required', parallel_tool_calls: false }, stream);
  await ask('required_parallel' + tag, { tool_choice: 'required' }, stream);
  for (const n of names) await ask('named_' + n + tag, { tool_choice: { type: 'function', function: { name: n } } }, stream);
  await ask('auto' + tag, {}, stream);
}

// the calls' results, then the final answer
const first = out[process.argv[6]];
const history = [...messages, { role: 'assistant', content: null,
  tool_calls: first.calls.map((c) => ({ id: c.id, type: 'function', function: { name: c.name, arguments: c.arguments } })) }];
for (const c of first.calls) history.push({ role: 'tool', tool_call_id: c.id, content: c.name === names[0] ? '{"temperature": 21}' : '5' });
const fin = await client.chat.completions.create({ model, messages: history, tools, max_tokens: 20, seed: 7 });
out.final = { finish: fin.choices[0].finish_reason, content: fin.choices[0].message.content, calls: fin.choices[0].message.tool_calls || [] };
const again = await client.chat.completions.create({ model, messages: history, tools, max_tokens, seed: 7, tool_choice: 'required',
  parallel_tool_calls: false });
out.after_results = { finish: again.choices[0].finish_reason,
  calls: (again.choices[0].message.tool_calls || []).map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments })) };
process.stdout.write(JSON.stringify(out) + '\n');
