/* Fuzz target: a checkpoint file of arbitrary bytes.

   load_checkpoint() must either reject the file with an error or map every
   weight inside it. The file is given to run.c as a heap copy of exactly its
   bytes (fuzz_common.h), so a weight mapped past the end is caught by ASan
   when the forward pass reads it (load_and_run: two positions, the context
   cut to 4 so that a header's seq_len cannot ask for huge caches). */
#include "fuzz_common.h"

/* What a loaded checkpoint must satisfy beyond a sane config. */
static void check_checkpoint(const Transformer *t, size_t size) {
    const Config *p = &t->config;
    /* every weight value is at least 1 byte of the file (half a byte at 4 bits; GGUF's
       4-bit blocks take more than half a byte) */
    uint64_t per_byte = t->weight_bits == 4 || t->version == VERSION_GGUF ? 2 : 1;
    CHECK((uint64_t)p->vocab_size * (uint64_t)p->dim <= per_byte * (uint64_t)size, "the embedding cannot fit in %zu bytes", size);
    CHECK(t->version != 3 || (t->group_size > 0 && t->group_size % 2 == 0 && p->dim % t->group_size == 0 &&
                              p->hidden_dim % t->group_size == 0),
          "a loaded version 3 model has group size %d", t->group_size);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    const char *seeds[] = {"v0-shared", "v1-separate", "v2-int8", "v3-q4", "v3-q4-separate", "v4-f32-llama3-rope", "v4-int8"};
    for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); i++) check_model_seed("checkpoint", seeds[i], check_checkpoint);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    load_and_run(input_file(data, size), size, check_checkpoint);
    return 0;
}
