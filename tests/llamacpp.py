"""llama.cpp itself as an oracle for the tests, through the npm package
node-llama-cpp (pinned to 3.21.1), which ships prebuilt CPU binaries of
llama.cpp: its libllama shared library and a Node addon.

  ensure_oracle()            install it once under tests/.cache/node-llama-cpp
                             (raises verdicts.Skip when that is impossible:
                             no node/npm, no network, an unsupported platform)
  oracle(path, tokens, ...)  llama.cpp's next-token log-probs for the token
                             ids, teacher-forced (tests/llamacpp_oracle.mjs)
  quantize(src, dst, ftype)  llama.cpp's own quantiser (llama_model_quantize
                             through ctypes, in a child process so that an
                             abort in the library cannot take the test down)

Standard library only. Also a command line for trying things by hand:
  python3 tests/llamacpp.py oracle MODEL.gguf '[1,2,3]'
  python3 tests/llamacpp.py quantize SRC.gguf DST.gguf Q4_K_M
"""
import ctypes
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import Skip  # noqa: E402

VERSION = "3.21.1"
CACHE = os.path.join(HERE, ".cache", "node-llama-cpp")
ORACLE_JS = os.path.join(HERE, "llamacpp_oracle.mjs")

# llama_ftype numbers (include/llama.h of the llama.cpp this release bundles)
FTYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
    "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15,
    "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32,
    "MXFP4_MOE": 38,
}


class OracleError(Exception):
    """llama.cpp refused or failed (the file did not load, a bad token...)."""


def _platform_package():
    """The optional dependency that carries this platform's CPU binaries."""
    m = platform.machine().lower()
    m = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64"}.get(m, m)
    if sys.platform.startswith("linux") and m in ("x64", "arm64", "armv7l"):
        return "linux-" + m
    if sys.platform == "darwin" and m in ("x64", "arm64"):
        return "mac-arm64-metal" if m == "arm64" else "mac-x64"
    return None


def _bins_dir():
    pkg = _platform_package()
    return os.path.join(CACHE, "node_modules", "@node-llama-cpp", pkg, "bins", pkg) if pkg else None


def _installed():
    try:
        with open(os.path.join(CACHE, "node_modules", "node-llama-cpp", "package.json")) as f:
            if json.load(f).get("version") != VERSION:
                return False
    except (OSError, ValueError):
        return False
    b = _bins_dir()
    return bool(b) and os.path.isdir(b)


_state = {"ok": False, "why": None}


def ensure_oracle():
    """Install node-llama-cpp@3.21.1 (once; later calls reuse it) and return
    its folder. Raises Skip when node/npm are missing or the install fails."""
    if _state["ok"]:
        return CACHE
    if _state["why"]:
        raise Skip(_state["why"])
    why = None
    node, npm = shutil.which("node"), shutil.which("npm")
    pkg = _platform_package()
    if not node or not npm:
        why = "llama.cpp oracle needs node and npm (not found)"
    elif not pkg:
        why = "llama.cpp oracle: no prebuilt node-llama-cpp binaries for %s/%s" % (sys.platform, platform.machine())
    else:
        try:
            major = int(subprocess.run([node, "--version"], capture_output=True, text=True,
                                       timeout=30).stdout.strip().lstrip("v").split(".")[0])
        except (OSError, ValueError, subprocess.SubprocessError):
            major = 0
        if major < 20:
            why = "llama.cpp oracle needs node >= 20 (node-llama-cpp %s)" % VERSION
    if why is None and not _installed():
        why = _install(npm, pkg)
    if why is None and not _installed():
        why = "llama.cpp oracle: node-llama-cpp %s not usable after install" % VERSION
    if why:
        _state["why"] = why
        raise Skip(why)
    _state["ok"] = True
    return CACHE


def _install(npm, pkg):
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time
        if _installed():
            return None
        # only the platform's CPU binaries: the optional GPU packages are
        # hundreds of MB; no install scripts (the postinstall would try to
        # download or build llama.cpp; the prebuilt binaries need neither)
        with open(os.path.join(CACHE, "package.json"), "w") as f:
            json.dump({"name": "run-c-tests-llamacpp-oracle", "private": True,
                       "dependencies": {"node-llama-cpp": VERSION, "@node-llama-cpp/" + pkg: VERSION}}, f)
        cmd = [npm, "install", "--omit=optional", "--ignore-scripts", "--no-audit", "--no-fund",
               "--save-exact", "--fetch-timeout=60000", "--fetch-retries=1"]
        try:
            r = subprocess.run(cmd, cwd=CACHE, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            return "llama.cpp oracle: npm install failed (%s)" % e
        with open(os.path.join(CACHE, "install.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            first = [ln for ln in lines if ln.startswith("npm error code")] or lines[-1:] or ["exit %d" % r.returncode]
            return "llama.cpp oracle: npm install of node-llama-cpp@%s failed (%s; see %s)" \
                % (VERSION, first[0][:200], os.path.join(CACHE, "install.log"))
    return None


def oracle(path, tokens, ctx=256, top=5, full=False, threads=1, timeout=300):
    """llama.cpp's teacher-forced next-token distributions for the token ids
    (positions 0..n-1, no BOS added). One dict per position: pos, argmax,
    argmax_logprob, next (tokens[i+1] or None), next_logprob, margin
    (argmax's log-prob minus the runner-up's), top [[id,
    logprob]...] (best first), and with full=True 'logprobs', the whole
    vector (None where the probability underflowed float32). ctx: the
    context size asked for (llama.cpp rounds it up to a multiple of 256;
    it picks phi3's long rope factors when that exceeds
    rope.scaling.original_context_length). Raises Skip when the oracle
    cannot be installed, OracleError when llama.cpp fails."""
    cache = ensure_oracle()
    cmd = [shutil.which("node"), ORACLE_JS, "--nlc", cache, os.path.abspath(path), "-",
           "--ctx", str(ctx), "--top", str(top), "--threads", str(threads)]
    if full:
        cmd.append("--full")
    try:
        r = subprocess.run(cmd, input=json.dumps([int(t) for t in tokens]), capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise OracleError("llama.cpp oracle timed out on %s" % path)
    if r.returncode != 0:
        raise OracleError("llama.cpp oracle failed on %s (exit %d): %s"
                          % (path, r.returncode, r.stderr.strip()[-600:]))
    out = json.loads(r.stdout)
    res = out["positions"]
    for p in res:
        p["n_ctx"], p["n_vocab"] = out["n_ctx"], out["n_vocab"]
    return res


# --- the quantiser ----------------------------------------------------------------

class _QuantizeParams(ctypes.Structure):
    # struct llama_model_quantize_params, include/llama.h of the bundled
    # llama.cpp (node-llama-cpp 3.21.1, llama/gitRelease.bundle); checked
    # at run time against llama_model_quantize_default_params()
    _fields_ = [
        ("nthread", ctypes.c_int32),
        ("ftype", ctypes.c_int),                 # enum llama_ftype
        ("output_tensor_type", ctypes.c_int),    # enum ggml_type
        ("token_embedding_type", ctypes.c_int),  # enum ggml_type
        ("allow_requantize", ctypes.c_bool),
        ("quantize_output_tensor", ctypes.c_bool),
        ("only_copy", ctypes.c_bool),
        ("pure", ctypes.c_bool),
        ("keep_split", ctypes.c_bool),
        ("dry_run", ctypes.c_bool),
        ("imatrix", ctypes.c_void_p),
        ("kv_overrides", ctypes.c_void_p),
        ("tt_overrides", ctypes.c_void_p),
        ("prune_layers", ctypes.c_void_p),
        ("max_buf_size", ctypes.c_size_t),
    ]


_LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def _quantize_here(src, dst, ftype, nthread=1):
    """In this process: load libllama and quantize (the child's side)."""
    lib = ctypes.CDLL(os.path.join(_bins_dir(), _libllama_name()))
    log = []
    keep = _LOGGER(lambda level, text, _: log.append(text.decode("utf-8", "replace")))
    lib.llama_log_set.argtypes = [_LOGGER, ctypes.c_void_p]
    lib.llama_log_set(keep, None)
    lib.llama_backend_init()
    lib.llama_model_quantize_default_params.restype = _QuantizeParams
    p = lib.llama_model_quantize_default_params()
    # the defaults this release sets: a wrong layout would not read back so
    if not (p.nthread == 0 and p.ftype == FTYPES["Q8_0"] and p.allow_requantize is False
            and p.quantize_output_tensor is True and p.dry_run is False and p.imatrix is None
            and p.prune_layers is None and p.max_buf_size > 0):
        raise OracleError("llama_model_quantize_params layout mismatch (defaults read back wrong)")
    p.ftype = FTYPES[ftype]
    p.nthread = nthread
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    rc = lib.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(p))
    if rc != 0:
        raise OracleError("llama_model_quantize returned %d: %s" % (rc, "".join(log)[-600:]))


def _libllama_name():
    names = sorted(n for n in os.listdir(_bins_dir()) if n.startswith("libllama") and "common" not in n
                   and (n.endswith(".so") or n.endswith(".dylib")))
    if not names:
        raise OracleError("no libllama in %s" % _bins_dir())
    return names[0]


def quantize(src, dst, ftype, nthread=1, timeout=300):
    """Quantize GGUF src to dst with llama.cpp's llama_model_quantize, ftype
    one of FTYPES' names (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_S,
    Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, IQ4_NL, IQ4_XS, MXFP4_MOE, ...), with the
    library's default params otherwise (its K-mix rules, output.weight
    quantized, no imatrix).
    Runs in a child process. Raises Skip when the oracle is not installable,
    OracleError when llama.cpp fails."""
    if ftype not in FTYPES:
        raise ValueError("unknown ftype %r" % (ftype,))
    ensure_oracle()
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "_quantize", os.path.abspath(src),
                        os.path.abspath(dst), ftype, str(nthread)],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not os.path.exists(dst):
        raise OracleError("quantize %s -> %s (%s) failed (exit %d): %s"
                          % (src, dst, ftype, r.returncode, (r.stderr or r.stdout).strip()[-600:]))


def main(argv):
    if len(argv) >= 1 and argv[0] == "_quantize":
        try:
            _quantize_here(argv[1], argv[2], argv[3], int(argv[4]))
        except OracleError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    try:
        if len(argv) >= 3 and argv[0] == "oracle":
            for p in oracle(argv[1], json.loads(argv[2]), full=False):
                print(json.dumps(p))
            return 0
        if len(argv) == 4 and argv[0] == "quantize":
            quantize(argv[1], argv[2], argv[3])
            return 0
    except Skip as e:
        print("SKIP llamacpp: %s" % e)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
