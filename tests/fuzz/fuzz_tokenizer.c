/* Fuzz target: a tokenizer file of arbitrary bytes, llama2.c's tokenizer.bin
   or a byte-level BPE "tk42" file.

   Input: two bytes giving the model's vocabulary size (1..1024), then the
   file. load_tokenizer() must reject it with an error or load exactly that
   many pieces, each within max_token_length, each found by lookup. A loaded
   tokenizer then encodes a few fixed texts (ASCII, UTF-8, invalid UTF-8):
   tokenizer.bin's checked against the naive reference encoder; tk42's
   checked to be ordinary tokens in range that spell the text back, with
   ill-formed UTF-8 as U+FFFD. Then the tokens are decoded. */
#include "fuzz_common.h"
#include "encode_check.h"

static Tokenizer tok; /* static: read after longjmp */

static const char *texts[] = {
    "",
    "Once upon a time, there was a little girl.",
    "h\xc3\xa9llo w\xc3\xb6rld \xe2\x9c\x93 \xf0\x9f\x98\x80 \xe4\xb8\xad",
    "bad \xff\xfe \x80\x80\x80\x80\x80 \xc3 end",
    "  aa  bb\n\tcc  ",
    "the theand 123456 \xc3\xa9t\xc3\xa9's\r\n\n  x . ...!\n",
};

/* The checks of a loaded tk42 tokenizer and of its encoding of `text`. */
static void check_byte_level(const Tokenizer *t, const char *text) {
    for (int b = 0; b < 256; b++) {
        int id = t->byte_token[b];
        CHECK(id >= 0 && id < t->vocab_size && t->piece_len[id] == 1 && (unsigned char)t->vocab[id][0] == b && !t->special[id],
              "byte_token[%d] = %d is not that byte's piece", b, id);
    }
    for (int i = 0; i < t->vocab_size; i++)
        CHECK(t->piece_len[i] >= 0 && t->piece_len[i] <= t->max_token_length && t->vocab[i][t->piece_len[i]] == '\0',
              "piece %d: length %d (max_token_length %d)", i, t->piece_len[i], t->max_token_length);
    for (int i = 0; i < t->vocab_size; i++) { /* the index finds each ordinary piece: it or a later one of its bytes */
        int id = lookup_bytes(t, t->vocab[i], t->piece_len[i]);
        CHECK(t->special[i] || (id >= i && id < t->vocab_size && !t->special[id] && t->piece_len[id] == t->piece_len[i] &&
                                memcmp(t->vocab[id], t->vocab[i], (size_t)t->piece_len[i]) == 0),
              "piece %d found as %d by its bytes", i, id);
    }
    CHECK(t->bos >= 0 && t->bos < t->vocab_size && t->n_end >= 1 && t->n_end <= MAX_END_TOKENS, "bos %d, n_end %d", t->bos, t->n_end);
    for (int i = 0; i < t->n_end; i++) CHECK(t->end[i] >= 0 && t->end[i] < t->vocab_size, "end token %d", t->end[i]);
    size_t len = strlen(text);
    int *ids = xcalloc(encode_capacity(t, len), sizeof(int)), bad = 0;
    int n = encode(t, text, 1, 1, ids, &bad);
    CHECK(n >= 2 && (size_t)n <= encode_capacity(t, len), "encode gave %d ids for %zu bytes", n, len);
    CHECK(ids[0] == t->bos && ids[n - 1] == t->eos, "no BOS or EOS around the text");
    /* the pieces spell the text, ill-formed sequences replaced by U+FFFD */
    CodePoints c = decode_code_points(t, text);
    size_t at = 0;
    for (int i = 1; i < n - 1; i++) {
        CHECK(ids[i] >= 0 && ids[i] < t->vocab_size && !t->special[ids[i]], "id %d at %d is special or out of range", ids[i], i);
        int pl = t->piece_len[ids[i]];
        CHECK(at + (size_t)pl <= (size_t)c.offset[c.n] && memcmp(c.bytes + at, t->vocab[ids[i]], (size_t)pl) == 0,
              "piece %d does not spell the text at byte %zu", i, at);
        at += (size_t)pl;
        piece_is_printable(t, decode(t, ids[i - 1], ids[i]));
    }
    CHECK(at == (size_t)c.offset[c.n], "the pieces spell %zu of the text's %d bytes", at, c.offset[c.n]);
    if (is_valid_utf8((const unsigned char *)text, len))
        CHECK((size_t)c.offset[c.n] == len && memcmp(c.bytes, text, len) == 0, "well-formed text changed by decoding");
    free_code_points(&c);
    free(ids);
}

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
        if (tok.byte_level) {
            for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) check_byte_level(&tok, texts[i]);
        }
        for (int i = 0; i < vocab_size && !tok.byte_level; i++) {
            CHECK(tok.vocab[i] != NULL, "piece %d missing", i);
            CHECK(strlen(tok.vocab[i]) <= (size_t)tok.max_token_length, "piece %d longer than max_token_length", i);
            CHECK(i == 0 || strcmp(tok.sorted_vocab[i - 1].str, tok.sorted_vocab[i].str) <= 0, "sorted_vocab unsorted at %d", i);
            int id = tok.sorted_vocab[i].id;
            CHECK(id >= 0 && id < vocab_size && tok.sorted_vocab[i].str == tok.vocab[id], "sorted_vocab[%d] is wrong", i);
        }
        for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]) && !tok.byte_level; i++) {
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
