// Talks to a running `run -m serve` with the official `openai` npm package:
// a completion, a streamed completion, several prompts in one completion, a
// chat completion and a streamed one.
// Prints one JSON object with what it got, for tests/test_serve_openai.py.
//   OPENAI_PREFIX=<npm --prefix dir> node serve_openai_client.mjs BASE_URL
import { createRequire } from 'module';

const require = createRequire(process.env.OPENAI_PREFIX + '/package.json');
const mod = require('openai');
const OpenAI = mod.OpenAI || mod.default || mod;
const client = new OpenAI({ baseURL: process.argv[2], apiKey: 'test-key', maxRetries: 0 });
const model = 'stories260K.bin';
const out = {};

const c = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 30, temperature: 0 });
out.completion = c.choices[0].text;
out.completion_finish = c.choices[0].finish_reason;
out.usage = c.usage;

let streamed = '';
const cs = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 30, temperature: 0, stream: true });
for await (const chunk of cs) streamed += chunk.choices[0].text;
out.completion_streamed = streamed;

// several prompts in one request, as evaluation harnesses send them: each
// prompt's choices in order (index = prompt * n + choice)
const several = await client.completions.create({ model, prompt: ['Once upon a time', 'Lily went'], max_tokens: 12, temperature: 0, n: 2 });
out.several = several.choices.map((x) => [x.index, x.text]);
out.several_usage = several.usage;

const messages = [{ role: 'system', content: 'You are kind.' }, { role: 'user', content: 'hi there' }];
const ch = await client.chat.completions.create({ model, messages, max_tokens: 30, temperature: 0 });
out.chat = ch.choices[0].message.content;
out.chat_role = ch.choices[0].message.role;

let chatStreamed = '';
const chs = await client.chat.completions.create({ model, messages, max_tokens: 30, temperature: 0, stream: true });
for await (const chunk of chs) chatStreamed += chunk.choices[0].delta.content || '';
out.chat_streamed = chatStreamed;

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

try {
  await client.completions.create({ model, prompt: 5 });
  out.bad = 'accepted';
} catch (e) {
  out.bad = e.status;
}
console.log(JSON.stringify(out));
