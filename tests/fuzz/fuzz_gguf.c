/* Fuzz target: a GGUF file of arbitrary bytes (section 2.1 and 2.2 of run.c).

   load_checkpoint() must either reject the file with an error or read every
   tensor inside it. The file is a heap copy of exactly its bytes
   (fuzz_common.h), so a tensor placed past the end, a string or array that
   runs off the file, or a block unpacked from beyond a tensor is an ASan
   report. A loaded model runs two positions of the forward pass (one batch
   of two rows, then one row) with the context cut to 4 positions, so that
   the metadata's context_length cannot ask for huge caches. */
#include "fuzz_common.h"

static Transformer t; /* static: read after longjmp */
static BlockTable table;

/* Loads the GGUF file at `path` and runs the forward pass on it; returns
   whether that went without an error. */
static int load_and_run(const char *path) {
    volatile int ok = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        load_checkpoint(&t, path);
        const Config *p = &t.config;
        CHECK(t.version == VERSION_GGUF, "a GGUF input loaded as checkpoint version %d", t.version);
        CHECK(p->dim % p->n_heads == 0 && p->n_heads % p->n_kv_heads == 0 && (p->dim / p->n_heads) % 2 == 0,
              "a loaded config has inconsistent heads");
        t.config.seq_len = 4; /* only the state's size depends on it now */
        alloc_run_state(&t.state, &t.config, 2, t.config.seq_len, 1, KV_F32);
        int tokens[3] = {0, t.config.vocab_size - 1, t.config.vocab_size / 2};
        forward_rows(&t, &table, tokens, 2, 0, 1);
        forward_rows(&t, &table, tokens + 2, 1, 2, 0);
        ok = 1;
    }
    error_trap = NULL;
    table_free(&t.state.cache, &table);
    free_run_state(&t.state);
    free_transformer(&t);
    release_mappings();
    return ok;
}

/* The valid seeds (FUZZ_CORPUS, default tests/fuzz/corpus) must load and
   run, or the harness is broken and the target stops at once. */
static void check_harness(const char *name) {
    const char *corpus = getenv("FUZZ_CORPUS");
    char path[4096];
    snprintf(path, sizeof(path), "%s/gguf/%s", corpus && corpus[0] ? corpus : "tests/fuzz/corpus", name);
    FILE *f = fopen(path, "rb");
    if (!f) return; /* not run from the repository root: no check */
    static uint8_t data[1 << 16];
    size_t n = fread(data, 1, sizeof(data), f);
    fclose(f);
    if (!load_and_run(input_file(data, n))) {
        fprintf(stderr, "fuzz_gguf: the valid seed %s does not load and run: the harness is broken\n", path);
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    check_harness("llama-f32");
    check_harness("qwen2-q8_0");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    load_and_run(input_file(data, size));
    return 0;
}
