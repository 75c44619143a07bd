// Renders a chat template with npm's @huggingface/jinja (Hugging Face's
// JavaScript Jinja, as transformers.js applies chat templates). Usage:
//   node jinja_render.js JINJA_DIR TEMPLATE_FILE context.json > rendered.hex
// context.json holds the template's variables (messages, bos_token,
// eos_token, add_generation_prompt, enable_thinking...); the library
// gives strftime_now and raise_exception itself. The output is the
// rendered text as UTF-8 hex.
const fs = require('fs');
const path = require('path');
const { Template } = require(path.resolve(process.argv[2], 'dist/index.cjs'));
const source = fs.readFileSync(process.argv[3], 'utf8');
const context = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));
const text = new Template(source).render(context);
process.stdout.write(Buffer.from(text, 'utf8').toString('hex'));
