/* Checks of run.c's encode() and decode() shared by the tokenizer and encode
   fuzz targets: token ids in range, the count within its documented bound,
   the same tokens as a naive reference (llama2.c's quadratic algorithm,
   written here from its description), and, for well-formed tokenizers, that
   decoding the tokens gives back the text. Include after fuzz_common.h. */
#ifndef ENCODE_CHECK_H
#define ENCODE_CHECK_H

/* The reference: split into code points (a byte and up to three following
   continuation bytes), each its own piece or else byte tokens; then, while
   some adjacent pair concatenates to a piece scoring above -1e10, merge the
   best-scoring pair, the leftmost among equals. Returns the count, or -1
   when a byte has no token. */
static int reference_encode(const Tokenizer *t, const char *text, int bos, int eos, int *out) {
    size_t len = strlen(text);
    char *buffer = xcalloc((size_t)t->max_token_length * 2 + 8, 1);
    int n = 0;
    if (bos) out[n++] = TOKEN_BOS;
    if (len > 0) {
        int id = lookup_piece(t, " ");
        if (id != -1) out[n++] = id;
    }
    for (size_t i = 0; i < len;) {
        size_t k = 1;
        while (i + k < len && k < 4 && ((unsigned char)text[i + k] & 0xC0) == 0x80) k++;
        memcpy(buffer, text + i, k);
        buffer[k] = '\0';
        int id = lookup_piece(t, buffer);
        if (id != -1) {
            out[n++] = id;
        } else {
            for (size_t j = 0; j < k; j++) {
                int byte_id = (unsigned char)text[i + j] + BYTE_TOKEN_OFFSET;
                if (byte_id >= t->vocab_size) { free(buffer); return -1; }
                out[n++] = byte_id;
            }
        }
        i += k;
    }
    for (;;) {
        float best_score = -1e10f;
        int best_at = -1, best_id = -1;
        for (int i = 0; i + 1 < n; i++) {
            strcpy(buffer, t->vocab[out[i]]);
            strcat(buffer, t->vocab[out[i + 1]]);
            int id = lookup_piece(t, buffer);
            if (id != -1 && t->vocab_scores[id] > best_score) {
                best_score = t->vocab_scores[id];
                best_at = i;
                best_id = id;
            }
        }
        if (best_at < 0) break;
        out[best_at] = best_id;
        memmove(out + best_at + 1, out + best_at + 2, (size_t)(n - best_at - 2) * sizeof(int));
        n--;
    }
    if (eos) out[n++] = TOKEN_EOS;
    free(buffer);
    return n;
}

/* Whether s[0..n) is well-formed UTF-8 (RFC 3629: no overlong forms, no
   surrogates, nothing above U+10FFFF). */
static int is_valid_utf8(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t len;
        unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c < 0x80) len = 1;
        else if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else return 0;
        if (i + len > n) return 0;
        if (len > 1 && (s[i + 1] < lo || s[i + 1] > hi)) return 0;
        for (size_t k = 2; k < len; k++)
            if ((s[i + k] & 0xC0) != 0x80) return 0;
        i += len;
    }
    return 1;
}

/* Checks what print_json_string writes for `text`: one JSON string, quotes
   and backslashes escaped, no raw control bytes, valid UTF-8 (so that any
   JSON parser reads it). */
static void check_json_string(const char *text) {
    char *out = NULL;
    size_t len = 0;
    FILE *saved = stdout;
    stdout = open_memstream(&out, &len);
    if (!stdout) abort();
    print_json_string(text);
    fclose(stdout);
    stdout = saved;
    const unsigned char *o = (const unsigned char *)out;
    CHECK(len >= 2 && o[0] == '"' && o[len - 1] == '"', "print_json_string output is not quoted");
    for (size_t i = 1; i + 1 < len; i++) {
        CHECK(o[i] >= 0x20, "raw control byte 0x%02X in a JSON string", o[i]);
        CHECK(o[i] != '"', "unescaped quote in a JSON string");
        if (o[i] == '\\') {
            i++;
            CHECK(i + 1 < len && strchr("\"\\/bfnrtu", o[i]), "bad escape in a JSON string");
            if (o[i] == 'u') {
                for (int k = 1; k <= 4; k++) CHECK(i + k + 1 < len && isxdigit(o[i + k]), "bad \\u escape");
                i += 4;
            }
        }
    }
    CHECK(is_valid_utf8(o, len), "print_json_string wrote invalid UTF-8 for a text of %zu bytes", strlen(text));
    free(out);
}

/* Texts longer than this skip the quadratic reference. */
#define REFERENCE_MAX_BYTES 300

/* Encodes `text` with run.c and checks the result as described above;
   `round_trip` when the tokenizer is well formed (byte tokens <0xNN> at
   3..258, a " " piece, no other piece starting "<0x", BOS unreachable by
   merges). Also runs the decoding helpers over the tokens. */
static void check_encode(const Tokenizer *t, const char *text, int bos, int eos, int round_trip) {
    size_t len = strlen(text);
    int *tokens = xcalloc(len + 3, sizeof(int));
    int bad_byte = -1;
    int n = encode(t, text, bos, eos, tokens, &bad_byte);
    int *expected = NULL;
    int n_expected = 0;
    if (len <= REFERENCE_MAX_BYTES) {
        expected = xcalloc(len + 3, sizeof(int));
        n_expected = reference_encode(t, text, bos, eos, expected);
    }
    if (n < 0) {
        CHECK(n == -1, "encode returned %d", n);
        CHECK(bad_byte >= 0 && bad_byte < 256 && bad_byte + BYTE_TOKEN_OFFSET >= t->vocab_size,
              "encode failed naming byte %d, which has a token", bad_byte);
        CHECK(memchr(text, bad_byte, len) != NULL, "encode failed on byte %d, not in the text", bad_byte);
        CHECK(!expected || n_expected == -1, "encode failed, the reference gave %d tokens", n_expected);
        free(expected);
        free(tokens);
        return;
    }
    CHECK((size_t)n <= len + 3, "%d tokens for %zu bytes", n, len);
    /* BOS merges with what follows if the vocabulary has that piece */
    CHECK(!bos || !round_trip || (n > 0 && tokens[0] == TOKEN_BOS), "no BOS first");
    CHECK(!eos || (n > 0 && tokens[n - 1] == TOKEN_EOS), "no EOS last");
    /* BOS and EOS are ids 1 and 2 whatever the vocabulary's size */
    int vocab_ok = t->vocab_size > TOKEN_EOS;
    for (int i = 0; i < n; i++)
        CHECK(tokens[i] >= 0 && (tokens[i] < t->vocab_size || tokens[i] == TOKEN_BOS || tokens[i] == TOKEN_EOS),
              "token %d at %d is outside the vocabulary of %d", tokens[i], i, t->vocab_size);
    if (expected) {
        CHECK(n_expected == n, "encode gave %d tokens, the reference %d", n, n_expected);
        for (int i = 0; i < n; i++)
            CHECK(tokens[i] == expected[i], "token %d: encode gave %d, the reference %d", i, tokens[i], expected[i]);
    }
    if (vocab_ok) {
        /* decode token by token, as generate streams them after BOS */
        int first = bos ? 1 : 0, last = eos ? n - 1 : n;
        size_t cap = 1;
        for (int i = first; i < last; i++) cap += strlen(t->vocab[tokens[i]]) + 1;
        char *joined = xcalloc(cap, 1);
        size_t at = 0;
        int prev = TOKEN_BOS;
        for (int i = first; i < last; i++) {
            const char *piece = decode(t, prev, tokens[i]);
            size_t piece_len = strlen(piece);
            CHECK(at + piece_len < cap, "decoded pieces overflow %zu bytes", cap);
            memcpy(joined + at, piece, piece_len);
            at += piece_len;
            (void)piece_is_printable(t, piece);
            prev = tokens[i];
        }
        if (round_trip)
            CHECK(at == len && memcmp(joined, text, len) == 0, "decoding %d tokens gives %zu bytes, not the %zu of the text", n,
                  at, len);
        free(joined);
        char *printable = decode_text(t, TOKEN_BOS, tokens + first, last - first);
        check_json_string(printable);
        free(printable);
    }
    free(expected);
    free(tokens);
}

#endif
