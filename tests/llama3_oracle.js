// Oracle for tests/test_llama3.py: Hugging Face's tokenizer as ported to
// JavaScript by @lenml/tokenizers. Usage:
//   node llama3_oracle.js TOKENIZERS_DIR MODELS_DIR texts.json > ids.json
//   node llama3_oracle.js TOKENIZERS_DIR MODELS_DIR --chat messages.json > ids.json
// texts.json is an array of hex strings (any bytes); each is decoded as UTF-8
// with U+FFFD for ill-formed sequences (the WHATWG decoder, as a program
// reading bytes would do before calling the tokenizer) and encoded without
// BOS/EOS. The output holds, for each text, its ids and the UTF-8 hex of
// the oracle's decode of those ids.
const fs = require('fs');
const path = require('path');
const { TokenizerLoader } = require(path.resolve(process.argv[2], 'dist/main.js'));
const models = process.argv[3];
const tok = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(path.join(models, 'tokenizer.json'), 'utf8')),
  tokenizerConfig: JSON.parse(fs.readFileSync(path.join(models, 'tokenizer_config.json'), 'utf8')),
});
if (process.argv[4] === '--chat') {
  // the chat template of tokenizer_config.json applied to a list of messages
  const messages = JSON.parse(fs.readFileSync(process.argv[5], 'utf8'));
  process.stdout.write(JSON.stringify(tok.apply_chat_template(messages, { tokenize: true, add_generation_prompt: true, return_tensor: false })));
  process.exit(0);
}
const texts = JSON.parse(fs.readFileSync(process.argv[4], 'utf8'));
const decoder = new TextDecoder('utf-8', { ignoreBOM: true }); // keeps a leading U+FEFF
const out = texts.map((hex) => {
  const text = decoder.decode(Buffer.from(hex, 'hex'));
  const ids = tok.encode(text, { add_special_tokens: false });
  const decoded = ids.length ? tok.decode(ids, { clean_up_tokenization_spaces: false }) : '';
  const back = Buffer.from(decoded, 'utf8').toString('hex');
  return [ids, back];
});
process.stdout.write(JSON.stringify(out));
