/* Fuzz target: a tokenizer.bin of arbitrary bytes.

   Input: two bytes giving the model's vocabulary size (1..1024), then the
   file. load_tokenizer() must reject it with an error or load exactly that
   many pieces, each within max_token_length, sorted for lookup. A loaded
   tokenizer then encodes a few fixed texts (ASCII, UTF-8, invalid UTF-8),
   checked against the naive reference encoder, and decodes the tokens. */
#include "fuzz_common.h"
#include "encode_check.h"

static Tokenizer tok; /* static: read after longjmp */

static const char *texts[] = {
    "",
    "Once upon a time, there was a little girl.",
    "h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xf0\x9f\x98\x80 \xe4\xb8\xad",
    "bad \xff\xfe \x80\x80\x80\x80\x80 \xc3 end",
    "  aa  bb\n\tcc  ",
};

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int vocab_size = 1 + (int)((data[0] | (unsigned)data[1] << 8) % 1024);
    const char *path = input_file(data + 2, size - 2);
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        load_tokenizer(&tok, path, vocab_size);
        CHECK(tok.vocab_size == vocab_size, "vocab_size %d, asked for %d", tok.vocab_size, vocab_size);
        CHECK(tok.max_token_length > 0, "max_token_length %d", tok.max_token_length);
        for (int i = 0; i < vocab_size; i++) {
            CHECK(tok.vocab[i] != NULL, "piece %d missing", i);
            CHECK(strlen(tok.vocab[i]) <= (size_t)tok.max_token_length, "piece %d longer than max_token_length", i);
            CHECK(i == 0 || strcmp(tok.sorted_vocab[i - 1].str, tok.sorted_vocab[i].str) <= 0, "sorted_vocab unsorted at %d", i);
            int id = tok.sorted_vocab[i].id;
            CHECK(id >= 0 && id < vocab_size && tok.sorted_vocab[i].str == tok.vocab[id], "sorted_vocab[%d] is wrong", i);
        }
        for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
            check_encode(&tok, texts[i], 1, 0, 0);
            check_encode(&tok, texts[i], 0, 1, 0);
        }
    }
    error_trap = NULL;
    if (tok.vocab) free_tokenizer(&tok); /* free_tokenizer needs the vocab array */
    memset(&tok, 0, sizeof(tok));
    release_mappings();
    return 0;
}
