/* Fuzz target: encode() on arbitrary text, then decode() of every token.

   Input: one byte of settings (bits 0-1: the tokenizer, bit 2: BOS, bit 3:
   EOS), then the text up to its first NUL: any bytes, invalid UTF-8 and long
   inputs included. The tokenizers: two built here (a full one with the 256
   byte tokens and merges whose scores tie, and a small one that lacks the
   byte tokens above 0x5F, so that some texts cannot be encoded),
   and tok512.bin from $MODELS_DIR (default ../shared/models) when present.
   Checks (encode_check.h): ids in the vocabulary, the count bound, the same
   tokens as the naive reference, decoding back to the text, and valid JSON
   (strict UTF-8) from print_json_string for the decoded text and the input. */
#include "fuzz_common.h"
#include "encode_check.h"

#define MAX_TOKENIZERS 3
static Tokenizer tokenizers[MAX_TOKENIZERS];
static int n_tokenizers;

/* ---- building a tokenizer.bin ------------------------------------------- */

static unsigned char *tok_file;
static size_t tok_size, tok_cap;

static void put_bytes(const void *p, size_t n) {
    if (tok_size + n > tok_cap) {
        tok_cap = (tok_size + n) * 2;
        tok_file = realloc(tok_file, tok_cap);
        if (!tok_file) abort();
    }
    memcpy(tok_file + tok_size, p, n);
    tok_size += n;
}

static int n_pieces;

static void put_piece(const char *piece, float score) {
    int32_t len = (int32_t)strlen(piece);
    put_bytes(&score, 4);
    put_bytes(&len, 4);
    put_bytes(piece, (size_t)len);
    n_pieces++;
}

static void begin_file(int32_t max_token_length) {
    tok_size = 0;
    n_pieces = 0;
    put_bytes(&max_token_length, 4);
    put_piece("<unk>", 0.0f);
    put_piece("\n<s>\n", 0.0f);
    put_piece("\n</s>\n", 0.0f);
}

static void load_built(void) {
    const char *path = input_file(tok_file, tok_size);
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) != 0) {
        fprintf(stderr, "fuzz harness: a built tokenizer does not load\n");
        abort();
    }
    load_tokenizer(&tokenizers[n_tokenizers++], path, n_pieces);
    error_trap = NULL;
}

/* merges and their scores: equal scores test the leftmost-first rule, a
   NaN and a score below -1e10 are never merged */
static const struct { const char *piece; float score; } merges[] = {
    {" t", -1}, {" a", -1}, {" s", -2}, {"he", -1}, {"th", -3}, {"the", -2}, {" the", -1}, {"in", -4},
    {"ing", -5}, {" in", -5}, {"an", -4}, {"and", -6}, {" and", -6}, {"er", -7}, {"re", -7}, {"on", -7},
    {" o", -8}, {"ll", -2}, {"llo", -3}, {"hello", -9}, {" w", -3}, {"or", -3}, {"ld", -3}, {"wor", -9},
    {"world", -9}, {" world", -10}, {"  ", -1}, {"   ", -1}, {"aa", -1}, {"aaa", -1}, {"aaaa", -1},
    {"ab", -1}, {"ba", -1}, {"\xc3\xa9\xc3\xa9", -2}, {"\xc3\xa9t", -2}, {" \xe4\xb8\xad", -3},
    {"zz", -1e11f}, {"qq", NAN}, {"\n\n", -1}, {" \n", -1}, {"ee", 5}, {"eee", 5}, {"xy", 1e30f},
};

static const char *utf8_pieces[] = {"\xc3\xa9", "\xc3\xb6", "\xc3\xb1", "\xe2\x9c\x93", "\xf0\x9f\x98\x80", "\xe4\xb8\xad"};

static void build_full(void) {
    begin_file(16);
    char piece[8];
    for (int b = 0; b < 256; b++) {
        snprintf(piece, sizeof(piece), "<0x%02X>", b);
        put_piece(piece, 0.0f);
    }
    for (int c = 0x20; c < 0x7f; c++) {
        piece[0] = (char)c;
        piece[1] = '\0';
        put_piece(piece, -100.0f);
    }
    put_piece("\n", -100.0f);
    for (size_t i = 0; i < sizeof(utf8_pieces) / sizeof(utf8_pieces[0]); i++) put_piece(utf8_pieces[i], -100.0f);
    for (size_t i = 0; i < sizeof(merges) / sizeof(merges[0]); i++) put_piece(merges[i].piece, merges[i].score);
    load_built();
}

/* Only the byte tokens 0x00..0x5F: in a vocabulary smaller than 259, byte
   b's token is id b + 3 only if that id exists, and any other piece would
   take the id of a higher byte. */
static void build_small(void) {
    begin_file(6);
    char piece[8];
    for (int b = 0; b < 0x60; b++) {
        snprintf(piece, sizeof(piece), "<0x%02X>", b);
        put_piece(piece, 0.0f);
    }
    load_built();
}

static void load_real(void) {
    const char *dir = getenv("MODELS_DIR");
    char path[4096];
    snprintf(path, sizeof(path), "%s/tok512.bin", dir && dir[0] ? dir : "../shared/models");
    if (access(path, R_OK) != 0) return;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) != 0) {
        fprintf(stderr, "fuzz harness: %s does not load\n", path);
        abort();
    }
    load_tokenizer(&tokenizers[n_tokenizers++], path, 512);
    error_trap = NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    build_full();
    build_small();
    load_real();
    free(tok_file);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const Tokenizer *t = &tokenizers[(data[0] & 3) % n_tokenizers];
    int bos = (data[0] >> 2) & 1, eos = (data[0] >> 3) & 1;
    char *text = malloc(size);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = '\0';
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        check_encode(t, text, bos, eos, 1);
        check_json_string(text); /* the escaping of any bytes, not only decoded ones */
    }
    else abort(); /* encode and decode report no errors */
    error_trap = NULL;
    free(text);
    return 0;
}
