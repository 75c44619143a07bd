/* Fuzz target: a checkpoint file of arbitrary bytes.

   load_checkpoint() must either reject the file with an error or map every
   weight inside it. The file is given to run.c as a heap copy of exactly its
   bytes (fuzz_common.h), so a weight mapped past the end is caught by ASan
   when the forward pass below reads it. A loaded model runs two positions of
   the forward pass (one batch of two rows, then one row), with the context
   set to 4 positions so that a header's seq_len cannot ask for huge caches. */
#include "fuzz_common.h"

static Transformer t; /* static: read after longjmp */
static BlockTable table;

/* Loads the checkpoint at `path` and runs the forward pass on it; returns
   whether that went without an error. */
static int load_and_run(const char *path, size_t size) {
    volatile int ok = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        load_checkpoint(&t, path);
        const Config *p = &t.config;
        CHECK(p->dim > 0 && p->hidden_dim > 0 && p->n_layers > 0 && p->n_heads > 0 && p->n_kv_heads > 0 &&
                  p->vocab_size > 0 && p->seq_len > 0,
              "a loaded config has a non-positive field");
        CHECK(p->dim % p->n_heads == 0 && p->n_heads % p->n_kv_heads == 0 && (p->dim / p->n_heads) % 2 == 0,
              "a loaded config has inconsistent heads");
        /* every weight value is at least 1 byte of the file (half a byte at 4 bits; GGUF's
           4-bit blocks take more than half a byte) */
        uint64_t per_byte = t.version == 3 || t.weight_bits == 4 || t.version == VERSION_GGUF ? 2 : 1;
        CHECK((uint64_t)p->vocab_size * (uint64_t)p->dim <= per_byte * (uint64_t)size, "the embedding cannot fit in %zu bytes", size);
        CHECK(t.version != 3 || (t.group_size > 0 && t.group_size % 2 == 0 && p->dim % t.group_size == 0 &&
                                 p->hidden_dim % t.group_size == 0),
              "a loaded version 3 model has group size %d", t.group_size);
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

/* The harness itself must work: the valid seeds (FUZZ_CORPUS, default
   tests/fuzz/corpus) load and run, or the target stops at once instead of
   rejecting every input without a word (as when run.c starts mapping memory
   in a new way). */
static void check_harness(const char *name) {
    const char *corpus = getenv("FUZZ_CORPUS");
    char path[4096];
    snprintf(path, sizeof(path), "%s/checkpoint/%s", corpus && corpus[0] ? corpus : "tests/fuzz/corpus", name);
    FILE *f = fopen(path, "rb");
    if (!f) return; /* not run from the repository root: no check */
    static uint8_t data[1 << 16];
    size_t n = fread(data, 1, sizeof(data), f);
    fclose(f);
    if (!load_and_run(input_file(data, n), n)) {
        fprintf(stderr, "fuzz_checkpoint: the valid seed %s does not load and run: the harness is broken\n", path);
        abort();
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    check_harness("v0-shared");
    check_harness("v1-separate");
    check_harness("v2-int8");
    check_harness("v3-q4");
    check_harness("v3-q4-separate");
    check_harness("v4-f32-llama3-rope");
    check_harness("v4-int8");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    load_and_run(input_file(data, size), size);
    return 0;
}
