#!/usr/bin/env python3
"""A mixture-of-experts model near the size of RAM (`make bench-moe-memory`):
the full-depth Qwen3-30B-A3B shape in Q4_K_M's layout, loaded and decoded,
with the peak resident memory against the file's size; then the throughput
of 16 requests at once (--batch) against one, on the 4-layer file of the
same shape. With --shape deepseek2, the full-depth DeepSeek-V2-Lite shape
instead (27 layers, the first dense, bench/arch.py's deepseek2 layers in
its Q4_K file's types: Q4_K, and Q5_0 where rows are not a multiple of 256;
about 9.4 GB), loaded and decoded with a cache of --ctx-size positions,
its peak RSS against the file plus 1 GB plus that cache.

The file: 48 layers of dim 2048, 32 query heads of 128, 4 key/value heads,
128 experts of 768 (top 8), vocabulary 151936, untied classifier, as
llama.cpp's Q4_K_M lays it out: Q4_K matrices, Q6_K for attn_v and
ffn_down_exps in the layers where llama.cpp gives them more bits (the first
and last eighth and every third between) and for the classifier. The
weights are random blocks written directly (a float file would need 60 GB);
one layer's blocks are written for every layer, which changes nothing for
memory or speed. It is written once into --cache (default build/bench/moe,
about 18.6 GB; the disk needs that much free).

Peak RSS is VmHWM of the process (file-backed pages it mapped and touched,
plus its own memory), polled from /proc while it runs; the target is the
file's size plus 1 GB plus the cache asked for.

The throughput: --batch with 16 copies of one request (a 16-token prompt,
128 tokens, different seeds, temperature 1) against the same with one,
generated tokens a second, in interleaved rounds (medians), with the
experts a step reads: with uniform routing, 16 rows pick about
128 x (1 - (120/128)^16) = 82 experts of a layer where one row picks 8.

Environment / options: RUN (default ./runomp); --cache DIR, --threads N,
--runs N, --skip-full (only the throughput), --shape qwen3moe|deepseek2,
--ctx-size N (deepseek2's cache; default 4096).
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

LAYERS = 48
VOCAB = 151936
DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FFN = 2048, 32, 4, 128, 128, 8, 768


def more_bits(i, n):
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_list(rng):
    """[(name, type, ne, raw)] of the full file; raw bytes shared between layers."""
    import numpy as np
    from gguf_ref import random_tensor
    q = lambda t, shape, std=0.02: random_tensor(t, int(np.prod(shape)), rng, std)  # noqa: E731
    qd, kvd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    ones = lambda n: np.ones(n, np.float32).tobytes()  # noqa: E731
    router = rng.normal(0, 1.0, EXPERTS * DIM).astype(np.float32).tobytes()
    shared = {
        "attn_norm": ("F32", [DIM], ones(DIM)), "ffn_norm": ("F32", [DIM], ones(DIM)),
        "attn_q_norm": ("F32", [HEAD_DIM], ones(HEAD_DIM)), "attn_k_norm": ("F32", [HEAD_DIM], ones(HEAD_DIM)),
        "attn_q": ("Q4_K", [DIM, qd], q("Q4_K", [DIM, qd])), "attn_k": ("Q4_K", [DIM, kvd], q("Q4_K", [DIM, kvd])),
        "attn_output": ("Q4_K", [qd, DIM], q("Q4_K", [qd, DIM])),
        "ffn_gate_inp": ("F32", [DIM, EXPERTS], router),
        "ffn_gate_exps": ("Q4_K", [DIM, EXPERT_FFN, EXPERTS], q("Q4_K", [DIM, EXPERT_FFN, EXPERTS])),
        "ffn_up_exps": ("Q4_K", [DIM, EXPERT_FFN, EXPERTS], q("Q4_K", [DIM, EXPERT_FFN, EXPERTS])),
    }
    by_bits = {t: {"attn_v": (t, [DIM, kvd], q(t, [DIM, kvd])),
                   "ffn_down_exps": (t, [EXPERT_FFN, DIM, EXPERTS], q(t, [EXPERT_FFN, DIM, EXPERTS]))}
               for t in ("Q4_K", "Q6_K")}
    tensors = [("token_embd.weight", "Q4_K", [DIM, VOCAB], q("Q4_K", [DIM, VOCAB])),
               ("output_norm.weight", "F32", [DIM], ones(DIM)),
               ("output.weight", "Q6_K", [DIM, VOCAB], q("Q6_K", [DIM, VOCAB]))]
    for i in range(LAYERS):
        parts = dict(shared, **by_bits["Q6_K" if more_bits(i, LAYERS) else "Q4_K"])
        for name, (t, ne, raw) in parts.items():
            tensors.append(("blk.%d.%s.weight" % (i, name), t, ne, raw))
    return tensors


def write_streamed(path, meta, tensors):
    """A GGUF file written a tensor at a time (gguf_ref's layout, without
    holding the whole file in memory)."""
    import gguf_ref as g
    align = g.DEFAULT_ALIGNMENT
    head = bytearray(g.MAGIC + struct.pack("<Iqq", 3, len(tensors), len(meta)))
    for key, v in meta.items():
        v = g._infer(v)
        head += g._string(key) + struct.pack("<I", v.vtype) + g._value(v.vtype, v.value, v.elem)
    offset = 0
    for name, t, ne, raw in tensors:
        head += g._string(name) + struct.pack("<I", len(ne)) + struct.pack("<%dq" % len(ne), *ne)
        head += struct.pack("<IQ", g.TYPES[t][0], offset)
        offset += -(-len(raw) // align) * align
    head += bytes(-len(head) % align)
    with open(path + ".part", "wb") as f:
        f.write(head)
        for _, _, _, raw in tensors:
            f.write(raw)
            f.write(bytes(-len(raw) % align))
    os.replace(path + ".part", path)


def write_full(path):
    import numpy as np
    import arch_models
    from arch import big_vocab
    rng = np.random.default_rng(3)
    meta, _ = arch_models.arch_model("qwen3moe", wtype="Q4_K", vocab=900, seed=1, ctx=4096, n_layers=1, dim=DIM,
                                     n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, ffn=6144, theta=1e6, eps=1e-6,
                                     n_expert=EXPERTS, n_used=USED, expert_ffn=EXPERT_FFN)
    meta["qwen3moe.block_count"] = LAYERS
    big_vocab(meta, VOCAB)
    write_streamed(path, meta, tensor_list(rng))


DEEPSEEK2_LAYERS = 27


def write_full_deepseek2(path):
    """The full-depth DeepSeek-V2-Lite shape: bench/arch.py's deepseek2
    model of 2 layers (the dense first, one with experts) in its Q4_K file's
    types, the second layer's blocks written for layers 1..26, and the
    embedding and classifier at the vocabulary's 102400 rows."""
    import numpy as np
    import arch_models
    from arch import SHAPES, big_vocab, file_types
    from gguf_ref import random_tensor
    arch, settings, _, vocab, _ = SHAPES["deepseek2"]
    wtype, types = file_types("deepseek2", "Q4_K")
    meta, tensors = arch_models.arch_model(arch, wtype=wtype, vocab=900, seed=1, tied=False, ctx=8192, n_layers=2,
                                           types=types, **settings)
    meta["deepseek2.block_count"] = DEEPSEEK2_LAYERS
    big_vocab(meta, vocab)
    dim = settings["dim"]
    rng = np.random.default_rng(2)
    out = [("token_embd.weight", wtype, [dim, vocab], random_tensor(wtype, vocab * dim, rng, 1.0 / np.sqrt(dim))),
           ("output.weight", wtype, [dim, vocab], random_tensor(wtype, vocab * dim, rng, arch_models.OUT_GAIN / np.sqrt(dim)))]
    out += [t for t in tensors if not t[0].startswith("blk.") and t[0] not in ("token_embd.weight", "output.weight")]
    out += [t for t in tensors if t[0].startswith("blk.0.")]
    moe = [t for t in tensors if t[0].startswith("blk.1.")]
    for i in range(1, DEEPSEEK2_LAYERS):
        out += [("blk.%d.%s" % (i, name[len("blk.1."):]), t, ne, raw) for name, t, ne, raw in moe]
    write_streamed(path, meta, out)


def peak_rss(cmd):
    """(exit status, stdout, stderr, peak VmHWM in bytes) of cmd, polled."""
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    p = subprocess.Popen(cmd, stdout=out, stderr=err)
    hwm = 0
    while p.poll() is None:
        try:
            with open("/proc/%d/status" % p.pid) as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.05)
    out.seek(0)
    err.seek(0)
    return p.returncode, out.read().decode(), err.read().decode(), hwm


def batch_rate(runbin, path, prompt, n, threads):
    """Generated tok/s of --batch with n requests of 128 tokens."""
    lines = "".join(json.dumps({"prompt": prompt, "max_new_tokens": 128, "min_new_tokens": 128, "temperature": 1.0,
                                "seed": 100 + i}) + "\n" for i in range(n))
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(lines)
    try:
        p = subprocess.run([runbin, path, "--batch", f.name, "--parallel", str(n), "-T", str(threads)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True)
    finally:
        os.unlink(f.name)
    stats = [line for line in p.stderr.decode().splitlines() if line.startswith("stats:")][-1]
    generated = int(stats.split("generated ")[1].split(" tokens")[0])
    rate = float(stats.split("tokens, ")[2].split(" tok/s")[0])
    assert generated == 128 * n, stats
    return rate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(ROOT, "build", "bench", "moe"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--shape", choices=("qwen3moe", "deepseek2"), default="qwen3moe")
    ap.add_argument("--ctx-size", type=int, default=4096)
    args = ap.parse_args()
    runbin = os.environ.get("RUN", os.path.join(ROOT, "runomp"))
    os.makedirs(args.cache, exist_ok=True)
    if args.shape == "deepseek2":
        deepseek2_memory(runbin, args)
        return
    if not args.skip_full:
        full = os.path.join(args.cache, "qwen3moe-48L.Q4_K_M.gguf")
        if not os.path.exists(full):
            print("bench: writing %s" % full, file=sys.stderr)
            write_full(full)
        size = os.path.getsize(full)
        cmd = [runbin, full, "-n", "48", "-i", "etaoinshrdlcumwfgypb", "-t", "0", "-T", str(args.threads), "--ctx-size", "64"]
        code, _, err, hwm = peak_rss(cmd)
        if code != 0:
            sys.exit("bench: the full-depth file did not run: %s" % err.strip().splitlines()[-1:])
        stats = [line for line in err.splitlines() if line.startswith("stats:")][-1]
        print("full depth: file %.2f GB, peak RSS %.2f GB (file + %.2f GB); %s" % (size / 1e9, hwm / 1e9, (hwm - size) / 1e9,
                                                                                    stats))
    small = os.path.join(ROOT, "build", "bench", "arch", "qwen3moe-4L.Q4_K.gguf")
    if not os.path.exists(small):
        sys.exit("bench: %s is missing: run `make bench-arch` first (it writes it)" % small)
    prompt = "etaoinshrdlcumw"
    ones, sixteens = [], []
    for r in range(args.runs):
        for n in ((1, 16) if r % 2 == 0 else (16, 1)):
            (ones if n == 1 else sixteens).append(batch_rate(runbin, small, prompt, n, args.threads))
    one, sixteen = statistics.median(ones), statistics.median(sixteens)
    print("throughput, qwen3moe 4 layers Q4_K: 1 request %.1f tok/s, 16 at once %.1f tok/s (%.2fx)" % (one, sixteen,
                                                                                                      sixteen / one))


def deepseek2_memory(runbin, args):
    """The full-depth DeepSeek-V2-Lite shape: a prompt, then decoding up to
    --ctx-size positions, peak RSS against the file, 1 GB and the cache
    (576 float32 values a position and layer: stats: reports its peak)."""
    full = os.path.join(args.cache, "deepseek2-%dL.Q4_K.gguf" % DEEPSEEK2_LAYERS)
    if not os.path.exists(full):
        print("bench: writing %s" % full, file=sys.stderr)
        write_full_deepseek2(full)
    size = os.path.getsize(full)
    cache = 576 * 4 * DEEPSEEK2_LAYERS * args.ctx_size
    cmd = [runbin, full, "-n", str(args.ctx_size), "-i", "etaoinshrdlcumwfgypb", "-t", "0", "-T", str(args.threads),
           "--ctx-size", str(args.ctx_size), "--max-new-tokens", "32"]
    code, _, err, hwm = peak_rss(cmd)
    if code != 0:
        sys.exit("bench: the full-depth file did not run: %s" % err.strip().splitlines()[-1:])
    stats = [line for line in err.splitlines() if line.startswith("stats:")][-1]
    print("deepseek2 full depth: file %.2f GB, peak RSS %.2f GB (file + %.2f GB; target file + 1 GB + the cache's %.2f GB "
          "at %d positions); %s" % (size / 1e9, hwm / 1e9, (hwm - size) / 1e9, cache / 1e9, args.ctx_size, stats))


if __name__ == "__main__":
    main()
