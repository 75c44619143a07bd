// Structured outputs through the official `openai` npm package against a
// running `run -m serve`: a chat completion with response_format
// json_schema (the schema read from a file) and one in JSON mode, and a
// schema outside the subset (refused). Prints one JSON object with what it
// got, for tests/test_json_schema.py.
//   OPENAI_PREFIX=<npm --prefix dir> node serve_openai_json.mjs BASE_URL SCHEMA_FILE
import { createRequire } from 'module';
import { readFileSync } from 'fs';

const require = createRequire(process.env.OPENAI_PREFIX + '/package.json');
const mod = require('openai');
const OpenAI = mod.OpenAI || mod.default || mod;
const client = new OpenAI({ baseURL: process.argv[2], apiKey: 'none', maxRetries: 0 });
const model = 'stories260K.bin';
const schema = JSON.parse(readFileSync(process.argv[3], 'utf8'));
const messages = [{ role: 'user', content: 'Tell me about a person.' }];
const out = {};

const s = await client.chat.completions.create({
  model, messages, max_tokens: 300, temperature: 0,
  response_format: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } },
});
out.schema_text = s.choices[0].message.content;
out.schema_finish = s.choices[0].finish_reason;

const o = await client.chat.completions.create({
  model, messages, max_tokens: 300, seed: 4, response_format: { type: 'json_object' },
});
out.object_text = o.choices[0].message.content;
out.object_finish = o.choices[0].finish_reason;

try {
  await client.chat.completions.create({
    model, messages, response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: 'a' } } },
  });
  out.bad = 'accepted';
} catch (e) {
  out.bad = e.status;
}
console.log(JSON.stringify(out));
