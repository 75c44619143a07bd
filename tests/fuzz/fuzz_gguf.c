/* Fuzz target: a GGUF file of arbitrary bytes (sections 2.1 and 2.2 of
   run.c).

   load_checkpoint() must either reject the file with an error or read every
   tensor inside it. The file is a heap copy of exactly its bytes
   (fuzz_common.h), so a tensor placed past the end, a string or array that
   runs off the file, or a block unpacked from beyond a tensor is an ASan
   report. A loaded model runs two positions of the forward pass
   (load_and_run). */
#include "fuzz_common.h"

static void check_gguf(const Transformer *t, size_t size) {
    (void)size;
    CHECK(t->version == VERSION_GGUF, "a GGUF input loaded as checkpoint version %d", t->version);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    check_model_seed("gguf", "llama-f32", check_gguf);
    check_model_seed("gguf", "qwen2-q8_0", check_gguf);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    load_and_run(input_file(data, size), size, NULL); /* a mutated magic makes it another format */
    return 0;
}
