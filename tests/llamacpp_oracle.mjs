// Teacher-forced next-token distributions from llama.cpp itself, through
// node-llama-cpp 3.21.1 (its prebuilt CPU binaries), for comparing run.c's
// logits on GGUF files. Used by tests/llamacpp.py; not a test on its own.
//
//   node tests/llamacpp_oracle.mjs --nlc DIR MODEL.gguf '[1, 5, 9]' [options]
//   (or the token list on stdin as JSON when the third argument is '-')
//
// DIR holds node_modules/node-llama-cpp (tests/.cache/node-llama-cpp).
// Options: --ctx N (context size, default 256: it matters for phi3, whose
// LongRoPE factors switch on n_ctx), --top K (top-K list per position,
// default 5), --full (each position's whole log-prob vector), --threads N
// (default 1), --log LEVEL (llama.cpp's log level on stderr: error, warn
// (default), info, debug).
//
// The tokens go in exactly as given (no BOS added, no chat template: token
// ids, not text), as one sequence at positions 0..n-1, in a context with a
// float32 KV cache, no flash attention and a full (non-sliding) SWA cache,
// on the CPU. For every position the library's greedy sampler is asked for
// its probabilities: with temperature 0 the chain is the greedy sampler
// alone, which keeps the whole vocabulary, and the addon then takes
// softmax(logits) in float32 over all of it (llama/addon/AddonContext.cpp,
// SampleToken). So log(p) = logit - logsumexp(logits), exact to float32
// rounding while p stays a normal float (p > ~1e-37; smaller ones print as
// null).
//
// Prints one JSON object: {"n_ctx" (llama.cpp's, after its padding), "n_vocab", "positions": [{"pos",
// "argmax", "argmax_logprob", "next" (token i+1 or null), "next_logprob",
// "margin" (argmax's log-prob minus the runner-up's),
// "top": [[id, logprob], ...], "logprobs" (with --full)}]}.

import {readFileSync} from "node:fs";
import {join, resolve} from "node:path";
import {pathToFileURL} from "node:url";

function fail(msg) {
    process.stderr.write("llamacpp_oracle: " + msg + "\n");
    process.exit(2);
}

const args = process.argv.slice(2);
const opt = {nlc: null, ctx: 256, top: 5, full: false, threads: 1, log: "warn"};
const pos = [];
for (let i = 0; i < args.length; i++) {
    const a = args[i];
    if (a === "--nlc") opt.nlc = args[++i];
    else if (a === "--ctx") opt.ctx = parseInt(args[++i], 10);
    else if (a === "--top") opt.top = parseInt(args[++i], 10);
    else if (a === "--threads") opt.threads = parseInt(args[++i], 10);
    else if (a === "--full") opt.full = true;
    else if (a === "--log") opt.log = args[++i];
    else pos.push(a);
}
if (!opt.nlc || pos.length !== 2) fail("usage: --nlc DIR MODEL.gguf TOKENS_JSON|- [--ctx N] [--top K] [--full] [--threads N]");
const tokens = JSON.parse(pos[1] === "-" ? readFileSync(0, "utf8") : pos[1]);
if (!Array.isArray(tokens) || tokens.length === 0 || !tokens.every(t => Number.isInteger(t) && t >= 0))
    fail("tokens must be a non-empty JSON list of token ids");
if (tokens.length > opt.ctx) fail("more tokens than --ctx");

const entry = join(resolve(opt.nlc), "node_modules", "node-llama-cpp", "dist", "index.js");
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);

const llama = await getLlama({
    gpu: false,
    build: "never",          // prebuilt binaries only; never compile
    usePrebuiltBinaries: true,
    skipDownload: true,
    progressLogs: false,
    logLevel: LlamaLogLevel[opt.log] ?? LlamaLogLevel.warn,
    maxThreads: opt.threads,
});
const model = await llama.loadModel({
    modelPath: resolve(pos[0]),
    gpuLayers: 0,
    useMmap: false,
    checkTensors: true,
});
const context = await model.createContext({
    contextSize: opt.ctx,
    batchSize: Math.max(tokens.length, 1),
    sequences: 1,
    threads: opt.threads,
    flashAttention: false,
    experimentalKvCacheKeyType: "F32",
    experimentalKvCacheValueType: "F32",
    swaFullCache: true,
    ignoreMemorySafetyChecks: true,
    failedCreationRemedy: false,
});
const seq = context.getSequence();
const input = tokens.map(t => [t, {generateNext: {probabilities: true, options: {temperature: 0}}}]);
const out = await seq.controlledEvaluate(input);

const positions = [];
let vocabSize = null;
for (let i = 0; i < tokens.length; i++) {
    const probs = out[i]?.next?.probabilities;
    if (!probs) fail("no probabilities at position " + i);
    if (vocabSize === null) vocabSize = probs.size;
    else if (probs.size !== vocabSize) fail("probability list sizes differ: " + probs.size + " vs " + vocabSize);
    const lp = p => (p > 0 && Number.isFinite(Math.log(p))) ? Math.log(p) : null;
    const it = probs.entries();
    const top = [];
    let best = null;
    for (const [id, p] of it) {
        if (best === null) best = [id, p];
        if (top.length >= opt.top) break;
        top.push([id, lp(p)]);
    }
    // the Map is sorted by probability; ties keep the sort's order, so take
    // the lowest id among the tokens equal to the top probability
    for (const [id, p] of probs) {
        if (p < best[1]) break;
        if (id < best[0]) best = [id, p];
    }
    const next = i + 1 < tokens.length ? tokens[i + 1] : null;
    const rec = {
        pos: i,
        argmax: best[0],
        argmax_logprob: lp(best[1]),
        next,
        next_logprob: next === null ? null : lp(probs.get(next) ?? 0),
        margin: null,
        top,
    };
    // how far the argmax leads the runner-up, in log-prob (null: one token)
    {
        let second = null;
        for (const [id, p] of probs) { if (id !== best[0]) { second = p; break; } }
        if (second !== null && lp(best[1]) !== null && lp(second) !== null) rec.margin = lp(best[1]) - lp(second);
    }
    if (opt.full) {
        const v = new Array(probs.size).fill(null);
        for (const [id, p] of probs) v[id] = lp(p);
        rec.logprobs = v;
    }
    positions.push(rec);
}
// llama.cpp's own n_ctx (llama_n_ctx: it pads the size asked for to a
// multiple of 256), which is what phi3's long/short choice compares
let nCtx = context.contextSize;
try { nCtx = context._ctx.getContextSize(); } catch (e) { /* keep the asked size */ }
process.stdout.write(JSON.stringify({n_ctx: nCtx, n_vocab: vocabSize, positions}) + "\n");
await context.dispose();
await model.dispose();
await llama.dispose();
