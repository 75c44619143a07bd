// Sends requests to a running `run -m serve` with the official `openai` npm
// package and prints what came back, for tests/test_serve_logprobs.py.
// Reads a JSON list of {endpoint: "completions" | "chat", body} on stdin;
// prints a JSON list with, for each, {response} (a streamed one: {chunks}, the
// events in order) or {status, message} when the client threw.
//   OPENAI_PREFIX=<npm --prefix dir> node serve_logprobs_client.mjs BASE_URL < requests.json
import { createRequire } from 'module';
import { readFileSync } from 'fs';

const require = createRequire(process.env.OPENAI_PREFIX + '/package.json');
const mod = require('openai');
const OpenAI = mod.OpenAI || mod.default || mod;
const client = new OpenAI({ baseURL: process.argv[2], apiKey: 'test-key', maxRetries: 0 });
const requests = JSON.parse(readFileSync(0, 'utf8'));
const out = [];
for (const { endpoint, body } of requests) {
  const api = endpoint === 'chat' ? client.chat.completions : client.completions;
  try {
    const got = await api.create({ model: 'stories260K.bin', ...body });
    if (body.stream) {
      const chunks = [];
      for await (const chunk of got) chunks.push(chunk);
      out.push({ chunks });
    } else {
      out.push({ response: got });
    }
  } catch (e) {
    out.push({ status: e.status, message: e.error ? e.error.message : String(e) });
  }
}
console.log(JSON.stringify(out));
