/* Unit tests for run.c, which is included whole (with main() left out).

   Prints one line per case: "PASS <name>", "FAIL <name>: why" or
   "SKIP <name>: why"; exits 1 when any case failed.

   Environment:
     MODELS_DIR  real models (default ../shared/models): stories260K.bin,
                 tok512.bin, tokenizer.bin; the cases that need one SKIP
                 when it is absent
     TEST_TMP    scratch directory (default /tmp); the malformed files are
                 written to a fresh subdirectory and removed at the end

   Sections: tokenizer (known ids, round trips, byte fallback, a naive
   quadratic reference encoder), samplers, kernels against double-precision
   loops, forward consistency on stories260K, loader and tokenizer rejecting
   malformed files (each case in a forked child, since errors exit()), and a
   few command-line helpers. */
#define TESTING
/* run.c defines helpers that these tests do not all call (and other
   engineers add more); only for it, unused static functions are fine. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "../run.c"
#pragma GCC diagnostic pop

#include <dirent.h>
#include <float.h>
#include <sys/types.h>
#include <sys/wait.h>

/* ------------------------------------------------------------------------ */
/* A tiny test harness                                                      */
/* ------------------------------------------------------------------------ */

static int n_pass, n_fail, n_skip;
static char case_name[256];
static int case_failed;
static char case_why[1024];

static void begin(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(case_name, sizeof(case_name), fmt, ap);
    va_end(ap);
    case_failed = 0;
    case_why[0] = '\0';
}

/* Records the first failed expectation of the current case. */
static int expect(int ok, const char *fmt, ...) {
    if (!ok && !case_failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(case_why, sizeof(case_why), fmt, ap);
        va_end(ap);
        case_failed = 1;
    }
    return ok;
}

/* Packs a quantised matrix for the kernels, as pack_weights does for a
   checkpoint's, where this build packs (VNNI; elsewhere nothing is packed
   and NULL returned). Returns the memory to free afterwards. */
static void *pack_for_kernels(Matrix *m) {
    size_t bytes = matrix_packed_bytes(m);
    if (bytes == 0) return NULL;
    void *raw = xcalloc(bytes + 64, 1);
    pack_matrices(&m, 1, (uint8_t *)(((uintptr_t)raw + 63) & ~(uintptr_t)63), 0, NULL, NULL, NULL, NULL);
    return raw;
}

static void end(void) {
    if (case_failed) {
        printf("FAIL %s: %s\n", case_name, case_why);
        n_fail++;
    } else {
        printf("PASS %s\n", case_name);
        n_pass++;
    }
    fflush(stdout);
}

static void skip(const char *name, const char *why) {
    printf("SKIP %s: %s\n", name, why);
    n_skip++;
    fflush(stdout);
}

static const char *models_dir;
static char scratch[1024];

static char *model_path(const char *file) {
    static char buf[8][2048];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, sizeof(buf[0]), "%s/%s", models_dir, file);
    return p;
}

static char *tmp_path(const char *file) {
    static char buf[8][2048];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, sizeof(buf[0]), "%s/%s", scratch, file);
    return p;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* A deterministic generator for test data (splitmix64). */
static uint64_t data_rng = 0x1234567887654321ull;
static uint64_t next_u64(void) {
    uint64_t z = (data_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int rand_below(int n) { return (int)(next_u64() % (uint64_t)n); }
static float rand_uniform(float lo, float hi) { return lo + (hi - lo) * (float)((next_u64() >> 40) / 16777216.0); }

/* Runs fn(arg) in a forked child with stderr (and stdout) captured; returns
   the wait status. The child exits 0 when fn returns. */
typedef void (*ChildFn)(const void *arg);

static void read_all(int fd, char *buf, size_t cap) {
    size_t n = 0;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(fd, tmp, sizeof(tmp));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        for (ssize_t i = 0; i < r; i++)
            if (n + 1 < cap) buf[n++] = tmp[i];
    }
    buf[n] = '\0';
}

static int run_child(ChildFn fn, const void *arg, char *err, size_t err_cap, char *out, size_t out_cap) {
    int perr[2], pout[2];
    if (pipe(perr) != 0 || pipe(pout) != 0) { perror("pipe"); exit(3); }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) { perror("fork"); exit(3); }
    if (pid == 0) {
        dup2(perr[1], 2);
        dup2(pout[1], 1);
        close(perr[0]); close(perr[1]); close(pout[0]); close(pout[1]);
        fn(arg);
        fflush(stdout);
        fflush(stderr);
        _exit(0);
    }
    close(perr[1]);
    close(pout[1]);
    /* stdout of these children is small: read stderr, then stdout */
    read_all(perr[0], err, err_cap);
    read_all(pout[0], out, out_cap);
    close(perr[0]);
    close(pout[0]);
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    return status;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

/* Expects fn(arg) to exit with `want` (1 for bad files) after printing one
   line "run: ..." to stderr; and for want == 0, to return normally. */
static void expect_child_exit(ChildFn fn, const void *arg, int want) {
    char err[4096], out[4096];
    int status = run_child(fn, arg, err, sizeof(err), out, sizeof(out));
    if (WIFSIGNALED(status)) {
        expect(0, "killed by signal %d", WTERMSIG(status));
        return;
    }
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    char shown[300];
    size_t n_shown = strlen(err) < sizeof(shown) - 1 ? strlen(err) : sizeof(shown) - 1;
    memcpy(shown, err, n_shown);
    shown[n_shown] = '\0';
    for (char *c = shown; *c; c++) if (*c == '\n') *c = '|';
    expect(code == want, "exit status %d, expected %d (stderr: %s)", code, want, shown);
    if (want != 0) {
        expect(strncmp(err, "run: ", 5) == 0, "stderr does not start with 'run: ': %s", shown);
        expect(count_lines(err) == 1 && err[strlen(err) - 1] == '\n', "stderr is not exactly one line: %s", shown);
    }
}

/* ------------------------------------------------------------------------ */
/* Tokenizer                                                                */
/* ------------------------------------------------------------------------ */

static Tokenizer tok512, tok32k;
static int have_tok512, have_tok32k;

/* Encodes with BOS (no EOS) into a fresh array; returns the count. */
static int enc(const Tokenizer *t, const char *text, int **ids) {
    *ids = xcalloc(strlen(text) + 3, sizeof(int));
    int bad = -1;
    return encode(t, text, 1, 0, *ids, &bad);
}

/* Concatenates decode(prev, id) over ids[1..n): the text back. */
static char *decode_all(const Tokenizer *t, const int *ids, int n) {
    size_t cap = 1;
    for (int i = 1; i < n; i++) cap += strlen(t->vocab[ids[i]]);
    char *s = xcalloc(cap, 1), *at = s;
    for (int i = 1; i < n; i++) {
        const char *piece = decode(t, ids[i - 1], ids[i]);
        /* a byte piece may be NUL only for <0x00>, which text cannot hold */
        size_t len = strlen(piece);
        memcpy(at, piece, len);
        at += len;
    }
    *at = '\0';
    return s;
}

static void format_ids(char *buf, size_t cap, const int *ids, int n) {
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && at + 16 < cap; i++) at += (size_t)snprintf(buf + at, cap - at, i ? ",%d" : "[%d", ids[i]);
    if (at + 2 < cap) snprintf(buf + at, cap - at, "]");
}

/* Printable rendering of a test string for messages. */
static const char *show(const char *s) {
    static char buf[4][256];
    static int next;
    char *b = buf[next++ % 4];
    size_t at = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && at + 6 < sizeof(buf[0]); p++) {
        if (*p >= 0x20 && *p < 0x7f && *p != '\\') b[at++] = (char)*p;
        else at += (size_t)snprintf(b + at, sizeof(buf[0]) - at, "\\x%02x", *p);
    }
    b[at] = '\0';
    return b;
}

static void expect_ids(const Tokenizer *t, const char *text, const int *want, int n_want) {
    int *ids;
    int n = enc(t, text, &ids);
    int same = n == n_want;
    for (int i = 0; same && i < n; i++) same = ids[i] == want[i];
    char got_s[512], want_s[512];
    format_ids(got_s, sizeof(got_s), ids, n);
    format_ids(want_s, sizeof(want_s), want, n_want);
    expect(same, "encode(\"%s\") = %s, expected %s", show(text), got_s, want_s);
    /* the expected ids must themselves spell the text */
    int in_range = 1;
    for (int i = 0; i < n_want; i++) in_range &= want[i] >= 0 && want[i] < t->vocab_size;
    if (expect(in_range, "expected ids out of range")) {
        char *spelled = decode_all(t, want, n_want);
        expect(strcmp(spelled, text) == 0, "expected ids %s spell \"%s\"", want_s, show(spelled));
        free(spelled);
    }
    free(ids);
}

static void test_known_ids(void) {
    if (!have_tok32k) { skip("tokenizer known ids (tokenizer.bin)", "tokenizer.bin not found in MODELS_DIR"); return; }
    const Tokenizer *t = &tok32k;
    begin("tokenizer.bin vocabulary facts");
    expect(t->max_token_length == 27, "max_token_length %d", t->max_token_length);
    expect(strcmp(t->vocab[15043], " Hello") == 0, "vocab[15043] = '%s'", t->vocab[15043]);
    expect(strcmp(t->vocab[3186], " world") == 0, "vocab[3186] = '%s'", t->vocab[3186]);
    expect(strcmp(t->vocab[29871], " ") == 0, "vocab[29871] = '%s'", t->vocab[29871]);
    expect(strcmp(t->vocab[13], "<0x0A>") == 0, "vocab[13] = '%s'", t->vocab[13]);
    expect(lookup_piece(t, " Hello") == 15043, "lookup ' Hello' = %d", lookup_piece(t, " Hello"));
    expect(lookup_piece(t, "no such piece!") == -1, "lookup of a missing piece is not -1");
    end();

    /* Llama 2 SentencePiece encodings, as published with Meta's examples */
    begin("encode known ids: Hello world");
    expect_ids(t, "Hello world", (const int[]){1, 15043, 3186}, 3);
    end();
    begin("encode known ids: I believe the meaning of life is");
    expect_ids(t, "I believe the meaning of life is", (const int[]){1, 306, 4658, 278, 6593, 310, 2834, 338}, 8);
    end();
    begin("encode known ids: trailing space");
    expect_ids(t, "Simply put, the theory of relativity states that ",
               (const int[]){1, 3439, 17632, 1925, 29892, 278, 6368, 310, 14215, 537, 5922, 393, 29871}, 13);
    end();
    begin("encode known ids: newlines, space runs, UTF-8");
    expect_ids(t,
               "Translate English to French:\n\n        sea otter => loutre de mer\n        peppermint => menthe poivr\xc3\xa9" "e\n"
               "        plush girafe => girafe peluche\n        cheese =>",
               (const int[]){1, 4103, 9632, 4223, 304, 5176, 29901, 13, 13, 4706, 7205, 4932, 357, 1149, 301, 449, 276, 316, 2778,
                             13, 4706, 1236, 407, 837, 524, 1149, 6042, 354, 772, 440, 29878, 1318, 13, 4706, 715, 1878, 330,
                             3055, 1725, 1149, 330, 3055, 1725, 4639, 28754, 13, 4706, 923, 968, 1149},
               50);
    end();
    begin("encode empty text is just BOS");
    expect_ids(t, "", (const int[]){1}, 1);
    {
        int ids[32], bad = -1; /* room for strlen + 3 */
        int n = encode(t, "", 0, 0, ids, &bad);
        expect(n == 0, "no BOS, no EOS: %d tokens", n);
        n = encode(t, "", 1, 1, ids, &bad);
        expect(n == 2 && ids[0] == 1 && ids[1] == 2, "BOS+EOS: %d tokens [%d,%d]", n, ids[0], ids[1]);
        n = encode(t, "Hello world", 0, 1, ids, &bad);
        expect(n == 3 && ids[0] == 15043 && ids[1] == 3186 && ids[2] == 2, "no BOS + EOS: %d tokens", n);
    }
    end();
    begin("encode spaces only");
    /* dummy prefix + 3 spaces = 4 spaces, one piece (ties at -1e9 merge leftmost) */
    expect_ids(t, "   ", (const int[]){1, 268}, 2);
    expect_ids(t, " ", (const int[]){1, 259}, 2);
    end();
    begin("encode byte fallback (tokenizer.bin)");
    /* U+1F600 has no piece: its four bytes become <0xF0><0x9F><0x98><0x80> */
    expect_ids(t, "\xf0\x9f\x98\x80", (const int[]){1, 29871, 0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x80 + 3}, 6);
    end();
}

static void test_decode(void) {
    if (!have_tok32k) { skip("decode", "tokenizer.bin not found in MODELS_DIR"); return; }
    const Tokenizer *t = &tok32k;
    begin("decode strips the leading space after BOS only");
    expect(strcmp(decode(t, 1, 15043), "Hello") == 0, "after BOS: '%s'", decode(t, 1, 15043));
    expect(strcmp(decode(t, 3186, 15043), " Hello") == 0, "after a word: '%s'", decode(t, 3186, 15043));
    expect(strcmp(decode(t, 2, 15043), " Hello") == 0, "after EOS: '%s'", decode(t, 2, 15043));
    end();
    begin("decode byte tokens to raw bytes");
    expect(strcmp(decode(t, 5, 13), "\n") == 0, "<0x0A>: '%s'", show(decode(t, 5, 13)));
    expect(strcmp(decode(t, 1, 13), "\n") == 0, "<0x0A> after BOS: '%s'", show(decode(t, 1, 13)));
    int all_ok = 1;
    for (int b = 1; b < 256; b++) {
        const char *p = decode(t, 5, b + 3);
        if (!((unsigned char)p[0] == b && p[1] == '\0')) all_ok = 0;
    }
    expect(all_ok, "some byte token does not decode to its byte");
    end();
    begin("piece_is_printable");
    expect(!piece_is_printable(t, ""), "empty");
    expect(!piece_is_printable(t, "\x01"), "control byte");
    expect(!piece_is_printable(t, "\xe2"), "lone UTF-8 lead byte");
    expect(piece_is_printable(t, "a") && piece_is_printable(t, "\n") && piece_is_printable(t, " "), "a, newline, space");
    expect(piece_is_printable(t, "\xe2\x82\xac") && piece_is_printable(t, "ab"), "multi-byte pieces");
    end();
}

/* Texts whose encode/decode round trip must be exact. */
static const char *round_trip_texts[] = {
    "Once upon a time, there was a little girl named Lily.",
    "Hello world",
    "  leading and trailing spaces  ",
    "   ",
    " ",
    "a",
    "tabs\tand\nnewlines\r\n and \"quotes\" 'single' {braces} [x] (y) <z> #1 $2 %3 ^&*",
    "caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9 \xc3\xb6\xc3\xa4\xc3\xbc \xc3\x9f",
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xe4\xb8\xad\xe6\x96\x87 \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4",
    "emoji \xf0\x9f\x98\x80\xf0\x9f\x8e\x89 and \xe2\x82\xac 5",
    "invalid \xff\xfe\x80 UTF-8 \xc3 \xe2\x82 \x80\x80\x80\x80\x80\x80 end",
    "\x01\x02\x1f\x7f control bytes",
    "1234567890 3.14159 -42 +7 0x1F",
    "<0x41> <s> </s> <unk>",
};

static void test_round_trip(const char *label, const Tokenizer *t) {
    begin("round trip %s", label);
    for (size_t i = 0; i < sizeof(round_trip_texts) / sizeof(round_trip_texts[0]); i++) {
        const char *text = round_trip_texts[i];
        int *ids;
        int n = enc(t, text, &ids);
        expect(n >= 1 && ids[0] == TOKEN_BOS, "\"%s\": no BOS", show(text));
        for (int k = 0; k < n; k++) expect(ids[k] >= 0 && ids[k] < t->vocab_size, "\"%s\": id %d out of range", show(text), ids[k]);
        char *back = decode_all(t, ids, n);
        expect(strcmp(back, text) == 0, "\"%s\" came back as \"%s\"", show(text), show(back));
        free(back);
        free(ids);
    }
    end();
}

static int find_run(const int *ids, int n, const int *run, int n_run) {
    for (int i = 0; i + n_run <= n; i++) {
        int ok = 1;
        for (int k = 0; ok && k < n_run; k++) ok = ids[i + k] == run[k];
        if (ok) return 1;
    }
    return 0;
}

static void test_tok512(void) {
    if (!have_tok512) { skip("tok512 tokenizer", "tok512.bin not found in MODELS_DIR"); return; }
    const Tokenizer *t = &tok512;
    begin("tok512 byte fallback for characters without a piece");
    struct { const char *text; int bytes[4]; int n; } cases[] = {
        {"\xf0\x9f\x98\x80", {0xF0, 0x9F, 0x98, 0x80}, 4}, /* U+1F600 emoji */
        {"\xe6\x97\xa5", {0xE6, 0x97, 0xA5}, 3},            /* CJK */
        {"\xc3\xb6", {0xC3, 0xB6}, 2},                      /* o umlaut */
        {"\xff", {0xFF}, 1},                                /* invalid UTF-8 */
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        char text[64];
        snprintf(text, sizeof(text), "a%sb", cases[c].text);
        int *ids;
        int n = enc(t, text, &ids);
        int run[4];
        for (int k = 0; k < cases[c].n; k++) run[k] = cases[c].bytes[k] + BYTE_TOKEN_OFFSET;
        char got[256];
        format_ids(got, sizeof(got), ids, n);
        expect(find_run(ids, n, run, cases[c].n), "\"%s\" encodes as %s, no byte tokens", show(text), got);
        free(ids);
    }
    /* a character that has a piece is not split into bytes */
    int *ids;
    int n = enc(t, "\xe2\x82\xac", &ids);
    expect(n == 3 && ids[2] == lookup_piece(t, "\xe2\x82\xac"), "the euro sign has a piece but was not used");
    free(ids);
    end();
    begin("tok512 dummy prefix and empty text");
    n = enc(t, "", &ids);
    expect(n == 1 && ids[0] == 1, "empty text: %d tokens", n);
    free(ids);
    n = enc(t, "x", &ids);
    expect(n >= 2 && strncmp(t->vocab[ids[1]], " ", 1) == 0, "first piece does not start with the dummy space");
    free(ids);
    end();
}

/* A reference encoder written from llama2.c's algorithm: code points (a byte
   and up to three continuation bytes) looked up in a hash table of the
   vocabulary, else byte tokens; then, round after round, merge the adjacent
   pair whose concatenation has the strictly highest score (above -1e10),
   leftmost on ties. */
typedef struct {
    int *slots; /* token id or -1 */
    size_t cap;
} PieceHash;

static uint64_t fnv1a(const char *s, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) { h ^= (unsigned char)s[i]; h *= 1099511628211ull; }
    return h;
}

static void hash_build(PieceHash *h, const Tokenizer *t) {
    h->cap = 1;
    while (h->cap < (size_t)t->vocab_size * 4) h->cap *= 2;
    h->slots = malloc(h->cap * sizeof(int));
    for (size_t i = 0; i < h->cap; i++) h->slots[i] = -1;
    for (int id = 0; id < t->vocab_size; id++) {
        size_t at = fnv1a(t->vocab[id], strlen(t->vocab[id])) & (h->cap - 1);
        while (h->slots[at] != -1) {
            if (strcmp(t->vocab[h->slots[at]], t->vocab[id]) == 0) break; /* keep the first */
            at = (at + 1) & (h->cap - 1);
        }
        if (h->slots[at] == -1) h->slots[at] = id;
    }
}

static int hash_find(const PieceHash *h, const Tokenizer *t, const char *s, size_t len) {
    size_t at = fnv1a(s, len) & (h->cap - 1);
    while (h->slots[at] != -1) {
        const char *p = t->vocab[h->slots[at]];
        if (strlen(p) == len && memcmp(p, s, len) == 0) return h->slots[at];
        at = (at + 1) & (h->cap - 1);
    }
    return -1;
}

static int naive_encode(const Tokenizer *t, const PieceHash *h, const char *text, int *out) {
    int n = 0;
    out[n++] = TOKEN_BOS;
    size_t len = strlen(text);
    if (len > 0) {
        int sp = hash_find(h, t, " ", 1);
        if (sp >= 0) out[n++] = sp;
    }
    for (size_t i = 0; i < len;) {
        size_t j = i + 1;
        while (j < len && ((unsigned char)text[j] & 0xC0) == 0x80 && j - i < 4) j++;
        int id = hash_find(h, t, text + i, j - i);
        if (id >= 0) out[n++] = id;
        else
            for (size_t k = i; k < j; k++) out[n++] = (unsigned char)text[k] + BYTE_TOKEN_OFFSET;
        i = j;
    }
    char *buf = malloc((size_t)t->max_token_length * 2 + 1);
    for (;;) {
        float best = -1e10f;
        int best_i = -1, best_id = -1;
        for (int i = 0; i + 1 < n; i++) {
            size_t a = strlen(t->vocab[out[i]]), b = strlen(t->vocab[out[i + 1]]);
            memcpy(buf, t->vocab[out[i]], a);
            memcpy(buf + a, t->vocab[out[i + 1]], b);
            int id = hash_find(h, t, buf, a + b);
            if (id >= 0 && t->vocab_scores[id] > best) { best = t->vocab_scores[id]; best_i = i; best_id = id; }
        }
        if (best_i < 0) break;
        out[best_i] = best_id;
        memmove(out + best_i + 1, out + best_i + 2, (size_t)(n - best_i - 2) * sizeof(int));
        n--;
    }
    free(buf);
    return n;
}

/* Random test strings of several kinds; returns the length. */
static size_t random_text(char *s, size_t cap, int kind) {
    static const char *words[] = {"the", "a", "cat", "Once", "upon", "time", "Lily", "play", "ed", "ing", "un", "believ",
                                  "able", "x", "zz", "q", "ball", "park", ",", ".", "!", "?", "'", "\"", "\n", "\t", "-",
                                  "42", "7", "=>", "<", ">", "<0x", "<s>", "</s>", "http", "://", "www", "Hello"};
    static const char *cps[] = {"\xc3\xa9", "\xc3\xb6", "\xc3\x9f", "\xe2\x82\xac", "\xe2\x80\x94", "\xe6\x97\xa5", "\xe6\x9c\xac",
                                "\xf0\x9f\x98\x80", "\xf0\x9f\x8e\x89", "\xd0\xb6", "\xce\xbb", "\xe3\x81\x82"};
    size_t n = 0, want = (size_t)rand_below((int)cap - 16);
    while (n < want) {
        const char *piece;
        char one[2] = {0, 0};
        int r = rand_below(100);
        if (kind == 0) { /* arbitrary bytes 1..255: invalid UTF-8 and all */
            one[0] = (char)(1 + rand_below(255));
            piece = one;
        } else if (kind == 1) { /* words and separators */
            piece = r < 30 ? " " : words[rand_below((int)(sizeof(words) / sizeof(words[0])))];
        } else if (kind == 2) { /* runs of spaces: pieces whose scores tie */
            if (r < 60) piece = " ";
            else if (r < 70) piece = "\n";
            else { one[0] = (char)('a' + rand_below(26)); piece = one; }
        } else { /* valid multi-byte code points mixed with ASCII and stray bytes */
            if (r < 40) piece = cps[rand_below((int)(sizeof(cps) / sizeof(cps[0])))];
            else if (r < 50) { one[0] = (char)(0x80 + rand_below(128)); piece = one; }
            else if (r < 65) piece = " ";
            else { one[0] = (char)('a' + rand_below(26)); piece = one; }
        }
        size_t len = strlen(piece);
        if (n + len >= cap) break;
        memcpy(s + n, piece, len);
        n += len;
    }
    s[n] = '\0';
    return n;
}

static void test_against_naive(const char *label, const Tokenizer *t, int count) {
    PieceHash h;
    hash_build(&h, t);
    static const char *kinds[] = {"random bytes", "random words", "space runs", "UTF-8 mix"};
    for (int kind = 0; kind < 4; kind++) {
        begin("encode = naive quadratic merge, %s, %s (%d strings)", label, kinds[kind], count);
        char text[200];
        int fixed_done = 0, run = 0;
        for (int i = 0; i < count && !case_failed; i++) {
            if (kind == 2 && !fixed_done) {
                /* every run length up to 40 spaces, with and without letters */
                int len = run % 41;
                memset(text, ' ', (size_t)len);
                text[len] = '\0';
                if (run >= 41) { text[0] = 'a'; if (len > 1) text[len - 1] = 'b'; }
                if (++run >= 82) fixed_done = 1;
            } else {
                random_text(text, sizeof(text), kind);
            }
            int got[sizeof(text) + 3], want[sizeof(text) + 3];
            int bad = -1;
            int n = encode(t, text, 1, 0, got, &bad);
            int m = naive_encode(t, &h, text, want);
            int same = n == m;
            for (int k = 0; same && k < n; k++) same = got[k] == want[k];
            if (!same) {
                char gs[512], ws[512];
                format_ids(gs, sizeof(gs), got, n);
                format_ids(ws, sizeof(ws), want, m);
                expect(0, "\"%s\": encode %s, naive %s", show(text), gs, ws);
            }
            char *back = decode_all(t, got, n);
            expect(strcmp(back, text) == 0, "\"%s\" round trip gave \"%s\"", show(text), show(back));
            free(back);
        }
        end();
    }
    free(h.slots);
}

/* A small tokenizer written by hand, for merge order and the byte check. */
static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) { perror(path); exit(3); }
}

typedef struct {
    unsigned char data[1 << 16];
    size_t n;
} Buf;

static void put_i32(Buf *b, int32_t v) { memcpy(b->data + b->n, &v, 4); b->n += 4; }
static void put_f32(Buf *b, float v) { memcpy(b->data + b->n, &v, 4); b->n += 4; }
static void put_piece(Buf *b, float score, const char *s) {
    put_f32(b, score);
    put_i32(b, (int32_t)strlen(s));
    memcpy(b->data + b->n, s, strlen(s));
    b->n += strlen(s);
}

/* pieces 0..2 special, 3 " ", 4 "a", 5 "b", 6 "ab", 7 " a", 8 "ba", 9 "c" */
static void make_small_tokenizer_with(Buf *b, float score_ab, float score_space_a, const char *last) {
    b->n = 0;
    put_i32(b, 6);
    put_piece(b, 0, "<unk>");
    put_piece(b, 0, "\n<s>\n");
    put_piece(b, 0, "\n</s>\n");
    put_piece(b, -1, " ");
    put_piece(b, -2, "a");
    put_piece(b, -3, "b");
    put_piece(b, score_ab, "ab");
    put_piece(b, score_space_a, " a");
    put_piece(b, -4, "ba");
    put_piece(b, -5, last);
}

static void make_small_tokenizer(Buf *b, float score_ab, float score_space_a) {
    make_small_tokenizer_with(b, score_ab, score_space_a, "c");
}

static void test_small_tokenizer(void) {
    struct { const char *name; float ab, space_a; const char *text; int want[6]; int n; } cases[] = {
        {"higher score merges first", -10, -20, "ab", {1, 3, 6}, 3},
        {"higher score merges first (other way)", -20, -10, "ab", {1, 7, 5}, 3},
        {"leftmost on equal scores", -10, -10, "ab", {1, 7, 5}, 3},
        {"scores at or below -1e10 never merge", -1e10f, -2e10f, "ab", {1, 3, 4, 5}, 4},
        {"merges repeat until none applies", -10, -20, "abab", {1, 7, 8, 5}, 4}, /* ba, then " a" */
        {"merges repeat (ba)", -20, -30, "bab", {1, 3, 8, 5}, 4},
    };
    Buf *b = malloc(sizeof(Buf));
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        begin("small tokenizer: %s", cases[c].name);
        make_small_tokenizer(b, cases[c].ab, cases[c].space_a);
        write_bytes(tmp_path("small_tok.bin"), b->data, b->n);
        Tokenizer t;
        load_tokenizer(&t, tmp_path("small_tok.bin"), 10);
        expect_ids(&t, cases[c].text, cases[c].want, cases[c].n);
        free_tokenizer(&t);
        end();
    }
    begin("small tokenizer: BOS merges with the text, as in llama2.c");
    make_small_tokenizer_with(b, -10, -20, "\n<s>\n "); /* piece 9: BOS and the dummy prefix, score -5 */
    write_bytes(tmp_path("small_tok.bin"), b->data, b->n);
    Tokenizer tb;
    load_tokenizer(&tb, tmp_path("small_tok.bin"), 10);
    expect_ids(&tb, "ab", (int[]){9, 6}, 2);
    free_tokenizer(&tb);
    end();
    begin("small tokenizer: a byte without a token is reported");
    make_small_tokenizer(b, -10, -20);
    write_bytes(tmp_path("small_tok.bin"), b->data, b->n);
    Tokenizer t;
    load_tokenizer(&t, tmp_path("small_tok.bin"), 10);
    int ids[16], bad = -1;
    int n = encode(&t, "abxc", 1, 0, ids, &bad);
    expect(n == -1 && bad == 'x', "encode returned %d, bad byte %d", n, bad);
    free_tokenizer(&t);
    end();
    free(b);
}

/* ------------------------------------------------------------------------ */
/* Samplers                                                                 */
/* ------------------------------------------------------------------------ */

/* xorshift64* spelled out: state ^= state >> 12; state ^= state << 25;
   state ^= state >> 27; output the top 32 bits of state * 0x2545F4914F6CDD1D. */
static uint32_t xorshift64star_ref(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return (uint32_t)((x * 2685821657736338717ull) >> 32);
}

static void test_rng(void) {
    begin("random_u32 seed 42: first values by hand");
    /* computed with arbitrary-precision integers from the definition above */
    const uint32_t want[6] = {1456360119u, 3359763283u, 3393612768u, 4054632243u, 3283045847u, 3589475362u};
    uint64_t s = 42;
    for (int i = 0; i < 6; i++) {
        uint32_t got = random_u32(&s);
        expect(got == want[i], "value %d: %u, expected %u", i, got, want[i]);
    }
    end();
    begin("random_u32 matches xorshift64* for 10000 draws and several seeds");
    const uint64_t seeds[] = {1, 42, 133742, 0xFFFFFFFFFFFFFFFFull, 1234567890123ull};
    for (size_t k = 0; k < sizeof(seeds) / sizeof(seeds[0]); k++) {
        uint64_t a = seeds[k], b = seeds[k];
        for (int i = 0; i < 10000; i++) {
            uint32_t x = random_u32(&a), y = xorshift64star_ref(&b);
            if (!expect(x == y, "seed %llu draw %d: %u vs %u", (unsigned long long)seeds[k], i, x, y)) break;
        }
    }
    end();
    begin("random_f32 is (u32 >> 8) / 2^24, in [0, 1)");
    uint64_t a = 7, b = 7;
    for (int i = 0; i < 10000; i++) {
        float f = random_f32(&a);
        uint32_t u = xorshift64star_ref(&b);
        if (!expect(f == (float)((u >> 8) / 16777216.0) && f >= 0.0f && f < 1.0f, "draw %d: %.9g", i, f)) break;
    }
    end();
}

/* a draw in 0..n-1 from its own xorshift64* state */
static int draw_below(uint64_t *state, int n) { return (int)(xorshift64star_ref(state) % (uint32_t)n); }

static void test_samplers(void) {
    begin("sample_argmax: first maximum on ties");
    expect(sample_argmax((const float[]){1, 3, 3, 2}, 4) == 1, "{1,3,3,2}");
    expect(sample_argmax((const float[]){5, 5, 5}, 3) == 0, "{5,5,5}");
    expect(sample_argmax((const float[]){-5, -1, -1, -3}, 4) == 1, "negatives");
    expect(sample_argmax((const float[]){0, 0, 0, 9}, 4) == 3, "last");
    expect(sample_argmax((const float[]){-INFINITY, -2}, 2) == 1, "-inf");
    expect(sample_argmax((const float[]){4}, 1) == 0, "single");
    end();

    /* vector builds search run by run (CANDIDATE_RUN values): rows of every
       length around the runs, the maximum (and its ties, NaNs, +-0, +-inf)
       put at run starts, run ends, in the tail and at random */
    begin("sample_argmax on long rows vs the first-maximum loop: runs, tails, ties, NaN, signed zeros, infinities");
    {
        static float x[4 * 256 + 40];
        const int lengths[] = {15, 16, 17, 255, 256, 257, 300, 511, 512, 513, 767, 1000, 4 * 256 + 40};
        const int spots[] = {0, 1, 15, 16, 17, 255, 256, 257, 511, 512, 767, 768, 1023, 1024, 1030, -1, -1, -1};
        int failed = 0;
        uint64_t state = 42; /* its own draws, leaving the shared ones to the tests after it */
        for (int li = 0; li < (int)(sizeof(lengths) / sizeof(lengths[0])) && !failed; li++) {
            const int n = lengths[li];
            for (int trial = 0; trial < 400 && !failed; trial++) {
                const int kind = trial % 8;
                for (int i = 0; i < n; i++) x[i] = kind == 7 ? (float)draw_below(&state, 3) : (float)(draw_below(&state, 2000001) - 1000000) * 1e-5f;
                /* 1 to 3 special values at chosen or random places */
                for (int k = 0, specials = 1 + draw_below(&state, 3); k < specials; k++) {
                    int spot = spots[draw_below(&state, (int)(sizeof(spots) / sizeof(spots[0])))];
                    if (spot < 0 || spot >= n) spot = draw_below(&state, n);
                    const float big = 10.5f, values[] = {big, big, NAN, 0.0f, -0.0f, INFINITY, -INFINITY};
                    x[spot] = values[kind < 7 ? kind : draw_below(&state, 7)];
                    if (kind == 3 || kind == 4) /* signed zeros as the maximum */
                        for (int i = 0; i < n; i++)
                            if (x[i] > 0) x[i] = -x[i];
                }
                int want = 0; /* the first index whose value is greater than every value before it that is not a NaN */
                for (int i = 1; i < n; i++)
                    if (x[i] > x[want]) want = i;
                int got = sample_argmax(x, n);
                failed = !expect(got == want, "length %d trial %d: %d (%g) vs %d (%g)", n, trial, got, x[got], want, x[want]);
            }
        }
    }
    end();

    begin("sample_mult on a hand-made distribution");
    const float p[4] = {0.1f, 0.2f, 0.3f, 0.4f};
    struct { float coin; int want; } mc[] = {{0.0f, 0}, {0.05f, 0}, {0.15f, 1}, {0.29f, 1}, {0.31f, 2}, {0.59f, 2},
                                            {0.61f, 3}, {0.9999f, 3}};
    for (size_t i = 0; i < sizeof(mc) / sizeof(mc[0]); i++) {
        int got = sample_mult(p, 4, mc[i].coin);
        expect(got == mc[i].want, "coin %g: %d, expected %d", mc[i].coin, got, mc[i].want);
    }
    expect(sample_mult((const float[]){0.25f, 0.25f}, 2, 0.9f) == 1, "mass below 1: rounding falls back to the last index");
    expect(sample_mult((const float[]){0.0f, 1.0f, 0.0f}, 3, 0.0f) == 1, "zero-probability tokens are never drawn");
    end();

    begin("sample_topp on a hand-made distribution");
    /* sorted: 0.5 (1), 0.25 (3), 0.2 (2), 0.05 (0). topp 0.7: the nucleus is
       {1, 3} (mass 0.75 > 0.7); coin scales to r = coin * 0.75. */
    const float q[4] = {0.05f, 0.5f, 0.2f, 0.25f};
    ProbIndex pi[8]; /* room for 2n: the tokens and the sort's scratch */
    struct { float coin; int want; } tc[] = {{0.0f, 1}, {0.5f, 1}, {0.66f, 1}, {0.67f, 3}, {0.7f, 3}, {0.9999f, 3}};
    for (size_t i = 0; i < sizeof(tc) / sizeof(tc[0]); i++) {
        int got = sample_topp(q, 4, 0.7f, pi, tc[i].coin);
        expect(got == tc[i].want, "coin %g: %d, expected %d", tc[i].coin, got, tc[i].want);
    }
    int hits[4] = {0, 0, 0, 0};
    for (int i = 0; i < 1000; i++) hits[sample_topp(q, 4, 0.7f, pi, i / 1000.0f)]++;
    expect(hits[0] == 0 && hits[2] == 0, "tokens outside the nucleus drawn: %d, %d", hits[0], hits[2]);
    expect(hits[1] >= 660 && hits[1] <= 670, "token 1 drawn %d / 1000 times, expected ~667", hits[1]);
    /* topp 0.99: everything is in the nucleus, in descending order */
    expect(sample_topp(q, 4, 0.99f, pi, 0.0f) == 1, "topp 0.99 coin 0");
    expect(sample_topp(q, 4, 0.99f, pi, 0.9999f) == 0, "topp 0.99 coin ~1 gives the least likely token");
    /* a tiny topp keeps only the most likely token */
    expect(sample_topp(q, 4, 0.05f, pi, 0.9999f) == 1, "topp 0.05 coin ~1");
    end();

    /* The cutoff (1 - topp) / (n - 1) assumes some token reaches it; with a
       flat distribution and topp < 1/n none does. The buffer has a sentinel
       before it so that a read of probindex[-1] is caught, not undefined. */
    begin("sample_topp with topp below 1/n on a flat distribution");
    {
        ProbIndex guard[5] = {{-1.0f, -12345}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
        int got = sample_topp((const float[]){0.5f, 0.5f}, 2, 0.01f, guard + 1, 0.3f);
        expect(got == 0 || got == 1, "returned %d (read before the buffer: no token passed the cutoff)", got);
    }
    end();

    begin("sampler: same seed, same samples");
    {
        const int n = 50;
        float logits[50], work[50];
        for (int i = 0; i < n; i++) logits[i] = rand_uniform(-3, 3);
        const float topps[] = {0.9f, 1.0f, 0.0f, 0.5f};
        for (size_t k = 0; k < 4; k++) {
            Sampler a, b, c;
            init_sampler(&a, n, 1.0f, topps[k], 133742);
            init_sampler(&b, n, 1.0f, topps[k], 133742);
            init_sampler(&c, n, 1.0f, topps[k], 133743);
            int diff_seed_differs = 0;
            for (int i = 0; i < 200; i++) {
                memcpy(work, logits, sizeof(work));
                int x = sample(&a, work);
                memcpy(work, logits, sizeof(work));
                int y = sample(&b, work);
                memcpy(work, logits, sizeof(work));
                int z = sample(&c, work);
                if (!expect(x == y, "topp %g draw %d: %d vs %d", topps[k], i, x, y)) break;
                expect(x >= 0 && x < n, "topp %g: token %d out of range", topps[k], x);
                diff_seed_differs |= x != z;
            }
            expect(diff_seed_differs, "topp %g: another seed gave the same 200 samples", topps[k]);
            free_sampler(&a); free_sampler(&b); free_sampler(&c);
        }
    }
    end();

    begin("sampler: temperature 0 is greedy and draws no random number");
    {
        Sampler s;
        init_sampler(&s, 4, 0.0f, 0.9f, 99);
        float l[4] = {0.5f, 2.0f, 2.0f, -1.0f};
        expect(sample(&s, l) == 1, "greedy pick");
        expect(s.rng_state == 99, "rng state changed");
        free_sampler(&s);
    }
    end();

    begin("sampler: one draw per sample, coin from random_f32");
    {
        Sampler s;
        init_sampler(&s, 4, 1.0f, 0.0f, 5);
        float l[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* uniform: token = floor(coin * 4) */
        uint64_t ref = 5;
        for (int i = 0; i < 100; i++) {
            float coin = random_f32(&ref);
            int want = coin < 0.25f ? 0 : coin < 0.5f ? 1 : coin < 0.75f ? 2 : 3;
            memset(l, 0, sizeof(l));
            int got = sample(&s, l);
            if (!expect(got == want, "draw %d: %d, expected %d (coin %g)", i, got, want, coin)) break;
        }
        free_sampler(&s);
    }
    end();

    /* A temperature small enough that logits / temperature overflows to inf
       gives NaN probabilities (inf - inf); the CLI accepts any t > 0. The
       expected behaviour is the limit t -> 0, i.e. greedy. */
    begin("sampler: tiny temperature (logits / t overflows) behaves greedily");
    {
        const float topps[] = {0.9f, 0.0f};
        for (int k = 0; k < 2; k++) {
            Sampler s;
            init_sampler(&s, 3, 1e-40f, topps[k], 5);
            ProbIndex guard[4] = {{-1.0f, -12345}, {0, 0}, {0, 0}, {0, 0}};
            ProbIndex *own = s.probindex;
            s.probindex = guard + 1;
            float l[3] = {2.0f, 1.0f, 0.5f};
            int got = sample(&s, l);
            expect(got == 0, "topp %g: token %d, expected 0 (probabilities: %g %g %g)", topps[k], got, l[0], l[1], l[2]);
            s.probindex = own;
            free_sampler(&s);
        }
    }
    end();

    begin("log_prob is log softmax");
    {
        float l[3] = {1.0f, 2.0f, 3.0f};
        double z = exp(1.0) + exp(2.0) + exp(3.0);
        for (int i = 0; i < 3; i++)
            expect(fabs(log_prob(l, 3, i) - (l[i] - log(z))) < 1e-6, "token %d: %g vs %g", i, log_prob(l, 3, i), l[i] - log(z));
        float big[2] = {1000.0f, 1001.0f};
        expect(fabs(log_prob(big, 2, 0) - (-1.0 - log1p(exp(-1.0)))) < 1e-6, "large logits");
    }
    end();
}

/* ------------------------------------------------------------------------ */
/* Kernels                                                                  */
/* ------------------------------------------------------------------------ */

static void test_kernels(void) {
    begin("rmsnorm vs double");
    for (int size = 1; size <= 300; size += 37) {
        float x[300], w[300], o[300];
        for (int i = 0; i < size; i++) { x[i] = rand_uniform(-4, 4); w[i] = rand_uniform(-2, 2); }
        double ss = 0;
        for (int i = 0; i < size; i++) ss += (double)x[i] * x[i];
        double scale = 1.0 / sqrt(ss / size + 1e-5);
        rmsnorm(o, x, w, size, 1e-5f);
        for (int i = 0; i < size; i++) {
            double ref = w[i] * scale * x[i];
            if (!expect(fabs(o[i] - ref) <= 1e-5 * (fabs(ref) + 1e-3), "size %d [%d]: %.9g vs %.9g", size, i, o[i], ref)) break;
        }
    }
    {
        float x[4] = {0, 0, 0, 0}, w[4] = {1, 1, 1, 1}, o[4];
        rmsnorm(o, x, w, 4, 1e-5f);
        expect(o[0] == 0 && isfinite(o[3]), "zero input gives zero (eps)");
    }
    {
        float x[4] = {3, 4, 5, 6}, w[4] = {1, 2, 3, 4};
        float ref[4];
        rmsnorm(ref, x, w, 4, 1e-5f);
        rmsnorm(x, x, w, 4, 1e-5f); /* the final norm is done in place */
        expect(memcmp(ref, x, sizeof(ref)) == 0, "in place differs");
    }
    end();

    begin("softmax vs double");
    for (int size = 1; size <= 600; size += 61) {
        float x[600];
        double ref[600], mx = -1e300, sum = 0;
        for (int i = 0; i < size; i++) { x[i] = rand_uniform(-20, 20); if (x[i] > mx) mx = x[i]; }
        for (int i = 0; i < size; i++) { ref[i] = exp(x[i] - mx); sum += ref[i]; }
        softmax(x, size);
        double total = 0;
        for (int i = 0; i < size; i++) {
            total += x[i];
            if (!expect(fabs(x[i] - ref[i] / sum) <= 1e-6 + 1e-5 * ref[i] / sum, "size %d [%d]: %.9g vs %.9g", size, i, x[i], ref[i] / sum)) break;
        }
        expect(fabs(total - 1.0) < 1e-5, "size %d: sums to %.9g", size, total);
    }
    {
        float x[3] = {1000.0f, 1001.0f, 999.0f};
        softmax(x, 3);
        expect(isfinite(x[0]) && isfinite(x[1]) && x[1] > x[0] && x[0] > x[2], "large inputs overflow");
        float one[1] = {-50.0f};
        softmax(one, 1);
        expect(one[0] == 1.0f, "single value: %g", one[0]);
    }
    end();

#ifdef SIMD_WIDTH
    begin("vf_exp vs exp in double on [-87, 0] and at 0: within 3 units in the last place");
    {
        double worst = 0;
        for (int i = 0; i <= 200000 && !case_failed; i += SIMD_WIDTH) {
            float x[SIMD_WIDTH], e[SIMD_WIDTH];
            for (int k = 0; k < SIMD_WIDTH; k++) x[k] = -87.0f * (float)(i + k > 200000 ? 200000 : i + k) / 200000.0f;
            vf_store(e, vf_exp(vf_load(x)));
            for (int k = 0; k < SIMD_WIDTH; k++) {
                double ref = exp((double)x[k]), err = fabs(e[k] - ref) / ref;
                if (err > worst) worst = err;
                if (!expect(err <= 3 * FLT_EPSILON / 2, "e^%.9g = %.9g, want %.9g (relative error %.3g)", x[k], e[k], ref, err)) break;
            }
        }
        float zero[SIMD_WIDTH] = {0}, one[SIMD_WIDTH];
        vf_store(one, vf_exp(vf_load(zero)));
        expect(one[0] == 1.0f, "e^0 = %.9g", one[0]);
        printf("  worst relative error %.3g\n", worst);
    }
    end();
#endif

    begin("attention softmax (vector e^x in vector builds) vs double, and the same wherever the row lies");
    for (int size = 1; size <= 600 && !case_failed; size += 23) {
        float x[600 + ATTENTION_PAD], y[600 + 2 * ATTENTION_PAD];
        double ref[600], mx = -1e300, sum = 0;
        /* spreads from 1 to 100: the smallest weights reach e^-100, below
           where vf_exp stops (e^-87) */
        const float spread = size % 2 ? 100.0f : 1.0f;
        for (int i = 0; i < size; i++) { x[i] = rand_uniform(-spread, spread); if (x[i] > mx) mx = x[i]; }
        const int shift = size % 7 + 1;
        memcpy(y + shift, x, (size_t)size * sizeof(float));
        for (int i = 0; i < size; i++) { ref[i] = exp(x[i] - mx); sum += ref[i]; }
        attention_softmax(x, size, -INFINITY);
        attention_softmax(y + shift, size, -INFINITY);
        double total = 0;
        for (int i = 0; i < size; i++) {
            total += x[i];
            if (!expect(fabs(x[i] - ref[i] / sum) <= 1e-30 + 2e-6 * ref[i] / sum, "size %d [%d]: %.9g vs %.9g", size, i, x[i], ref[i] / sum)) break;
        }
        expect(fabs(total - 1.0) < 1e-5, "size %d: sums to %.9g", size, total);
        expect(memcmp(x, y + shift, (size_t)size * sizeof(float)) == 0, "size %d: the row moved by %d floats gives other weights", size, shift);
    }
    {
        float x[1 + ATTENTION_PAD] = {-50.0f};
        attention_softmax(x, 1, -INFINITY);
        expect(x[0] == 1.0f, "single value: %g", x[0]);
    }
    /* a sink (gpt-oss): its logit joins the denominator only, below, among and above the scores */
    for (int size = 1; size <= 40; size += 13)
        for (int which = 0; which < 3; which++) {
            float x[40 + ATTENTION_PAD];
            double ref[40], mx = -1e300, sum = 0;
            for (int i = 0; i < size; i++) { x[i] = rand_uniform(-4.0f, 4.0f); if (x[i] > mx) mx = x[i]; }
            const float sink = which == 0 ? -30.0f : which == 1 ? 0.5f : 9.0f;
            const double m = mx > sink ? mx : sink;
            for (int i = 0; i < size; i++) { ref[i] = exp(x[i] - m); sum += ref[i]; }
            sum += exp(sink - m);
            attention_softmax(x, size, sink);
            for (int i = 0; i < size; i++)
                if (!expect(fabs(x[i] - ref[i] / sum) <= 1e-30 + 2e-6 * ref[i] / sum, "sink %g, size %d [%d]: %.9g vs %.9g", sink, size, i, x[i],
                            ref[i] / sum)) break;
        }
    end();

    begin("log_softmax (beam search's scores) vs double: sizes 1..32000, vectors and tails, flat and steep rows");
    {
        static float x[32000], out[32000];
        const int sizes[] = {1, 2, 15, 16, 17, 33, 1000, 31999, 32000};
        for (int s = 0; s < (int)(sizeof(sizes) / sizeof(sizes[0])) && !case_failed; s++) {
            const int n = sizes[s];
            const float spread = s % 2 ? 30.0f : 1.0f;
            double mx = -1e300, sum = 0;
            for (int i = 0; i < n; i++) { x[i] = rand_uniform(-spread, spread); if (x[i] > mx) mx = x[i]; }
            for (int i = 0; i < n; i++) sum += exp(x[i] - mx);
            log_softmax(out, x, n);
            for (int i = 0; i < n; i++) {
                double ref = x[i] - mx - log(sum);
                if (!expect(fabs(out[i] - ref) <= 4e-6 + 1e-6 * fabs(ref), "size %d [%d]: %.9g vs %.9g", n, i, out[i], ref)) break;
            }
        }
    }
    end();

    begin("quantize_groups: halves away from zero, edge values, vector and scalar group sizes");
    {
        /* a group whose largest magnitude is 127 has scale 1, and one of
           254 scale 2: the quotients are then exact whichever way the
           compiler divides, and rounding alone decides each value */
        const float edges[] = {0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.49999997f, 1e-40f, -0.0f,
                               3.0000002f, -2.9999998f, 64.5f, -100.49999f};
        const int sizes[] = {32, 48, 6, 1};
        for (int si = 0; si < 4 && !case_failed; si++)
            for (int scale2 = 0; scale2 < 2 && !case_failed; scale2++) {
                const int gs = sizes[si], count = 4 * gs;
                float x[4 * 48], xs[4];
                int16_t xq[4 * 48];
                for (int i = 0; i < count; i++) x[i] = edges[(i * 7 + si) % 16] * (scale2 ? 2.0f : 1.0f);
                for (int g = 0; g < 4; g++) x[g * gs + (g * 5) % gs] = (g % 2 ? -127.0f : 127.0f) * (scale2 ? 2.0f : 1.0f);
                quantize_groups(xq, xs, x, (size_t)count, gs);
                for (int i = 0; i < count; i++) {
                    double r = x[i] / (scale2 ? 2.0 : 1.0);
                    long want = (long)(r < 0 ? -floor(-r + 0.5) : floor(r + 0.5));
                    if (!expect(xs[i / gs] == (scale2 ? 2.0f : 1.0f) && xq[i] == want, "gs %d scale %d: x %.9g -> %d (scale %g), want %ld",
                                gs, scale2 + 1, x[i], xq[i], xs[i / gs], want)) break;
                }
            }
        /* zeros; an infinity (every value 0, the scale infinite); a NaN
           passed over by the maximum and quantised to 0 */
        for (int gs = 16; gs <= 20 && !case_failed; gs += 4) {
            float x[3 * 20], xs[3];
            int16_t xq[3 * 20];
            for (int i = 0; i < 3 * gs; i++) x[i] = i < gs ? 0.0f : (float)(i % 7) - 3.0f;
            x[gs + 3] = INFINITY;
            x[2 * gs + 5] = NAN;
            x[2 * gs + 1] = 63.5f; /* the largest: scale 0.5 */
            quantize_groups(xq, xs, x, (size_t)(3 * gs), gs);
            expect(xs[0] == 0.0f && isinf(xs[1]) && xs[2] == 0.5f, "gs %d: scales %g %g %g", gs, xs[0], xs[1], xs[2]);
            for (int i = 0; i < 3 * gs; i++) {
                long want = i < 2 * gs || i == 2 * gs + 5 ? 0 : (long)(2 * x[i]);
                if (!expect(xq[i] == want, "gs %d: x[%d] = %g -> %d, want %ld", gs, i, x[i], xq[i], want)) break;
            }
        }
    }
    end();

    begin("top_candidates vs a full sort: runs passed over, ties, -inf, vocabularies of runs and tails");
    {
        enum { B = 4, K = 12, MAXV = 1500 };
        static float rows[B * MAXV];
        static Candidate all[B * MAXV];
        const int vocabs[] = {1500, 256, 300, 17};
        for (int vi = 0; vi < 4 && !case_failed; vi++)
            for (int trial = 0; trial < 20 && !case_failed; trial++) {
                const int vocab = vocabs[vi];
                float beam_scores[B], *lp[B];
                for (int b = 0; b < B; b++) {
                    lp[b] = rows + b * vocab;
                    beam_scores[b] = -(float)rand_below(4) * 0.25f;
                    for (int v = 0; v < vocab; v++) /* coarse values: many ties; a few masked tokens; peaks in late runs */
                        lp[b][v] = rand_below(50) == 0 ? -INFINITY : -(float)rand_below(64) * 0.125f - (v < vocab / 2 ? 4.0f : 0.0f);
                }
                Candidate best[K];
                int n = top_candidates(beam_scores, lp, B, vocab, best, K), m = 0;
                for (int b = 0; b < B; b++)
                    for (int v = 0; v < vocab; v++) all[m++] = (Candidate){beam_scores[b] + lp[b][v], b, v};
                for (int i = 0; i < K && i < m; i++) /* selection: score down, then beam up, then token up */
                    for (int j = i + 1; j < m; j++) {
                        const Candidate a = all[i], c = all[j];
                        if (c.score > a.score || (c.score == a.score && (c.beam < a.beam || (c.beam == a.beam && c.token < a.token)))) {
                            all[i] = c;
                            all[j] = a;
                        }
                    }
                expect(n == (K < m ? K : m), "vocab %d: %d candidates", vocab, n);
                for (int i = 0; i < n; i++)
                    if (!expect(best[i].score == all[i].score && best[i].beam == all[i].beam && best[i].token == all[i].token,
                                "vocab %d trial %d: #%d is %d/%d %g, want %d/%d %g", vocab, trial, i, best[i].beam, best[i].token,
                                best[i].score, all[i].beam, all[i].token, all[i].score)) break;
            }
    }
    end();

    begin("matmul vs double, n = 1..5 rows");
    {
        enum { R = 37, C = 29, N = 5 };
        float w[R * C], x[N * C], out[N * R], one[R];
        for (int i = 0; i < R * C; i++) w[i] = rand_uniform(-1, 1);
        for (int i = 0; i < N * C; i++) x[i] = rand_uniform(-1, 1);
        Matrix m = {.w = w, .rows = R, .cols = C};
        for (int n = 1; n <= N; n++) {
            for (int i = 0; i < N * R; i++) out[i] = NAN;
            matmul(out, x, &m, n);
            for (int b = 0; b < n; b++)
                for (int i = 0; i < R; i++) {
                    double ref = 0, mag = 0;
                    for (int j = 0; j < C; j++) { ref += (double)w[i * C + j] * x[b * C + j]; mag += fabs((double)w[i * C + j] * x[b * C + j]); }
                    expect(fabs(out[b * R + i] - ref) <= 4e-6 * mag + 1e-7, "n %d row %d out %d: %.9g vs %.9g", n, b, i, out[b * R + i], ref);
                }
            /* each of the n rows equals a call with that row alone */
            for (int b = 0; b < n; b++) {
                matmul(one, x + b * C, &m, 1);
                for (int i = 0; i < R; i++) {
                    double mag = 0;
                    for (int j = 0; j < C; j++) mag += fabs((double)w[i * C + j] * x[b * C + j]);
                    expect(fabs(one[i] - out[b * R + i]) <= 4e-6 * mag + 1e-7, "n %d row %d out %d: batch %.9g, single %.9g", n, b, i, out[b * R + i], one[i]);
                }
            }
        }
    }
    end();

    /* batch independence: every output row of an n-row matmul is bitwise the
       row computed alone, for n = 1..70 and shapes whose rows are no multiple
       of the kernels' blocks (tails of columns and groups included); the
       quantised shapes as int8 and 4-bit, each with and without the GGUF
       offsets (value = q * scale + offset), past the 16 input rows that AMX
       builds take on tiles, so that tiles, the vector kernels for the rest
       and a lone row are all compared; the scales in turn float32, f16 values
       (a GGUF Q8_0's d) or an f16 d per run of groups times int8 multipliers
       (a K-quant's), which VNNI builds must pack in those forms; int8 values
       in -32..31 and -16..15 (GGUF's 6- and 5-bit types), which they pack
       as 6 and 5 bits */
    {
        const int shapes[][3] = {/* rows, cols, group size (0: float32) */
                                 {37, 64, 0},  {50, 48, 0},  {5, 288, 0},  {13, 100, 0},  {23, 64, 32},  {37, 96, 32},
                                 {9, 288, 32}, {30, 128, 64}, {11, 256, 128}, {7, 48, 16}, {19, 192, 96}, {6, 20, 4}};
        enum { MAXN = 70 };
        for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++)
            for (int variant = 0; variant < (shapes[si][2] ? 4 : 1); variant++) {
                const int R = shapes[si][0], C = shapes[si][1], gs = shapes[si][2], G = gs ? C / gs : 0;
                const int bits = variant & 1 ? 4 : 8, with_offsets = variant >> 1;
                int form = gs ? (int)(si + (size_t)variant) % 3 : SCALES_F32; /* shared: runs of 2 or 4 groups */
                if (form == SCALES_SHARED && G % 2 != 0) form = SCALES_F16;
                const int run = form != SCALES_SHARED ? form : G % 4 == 0 ? 4 : 2;
                const int narrow = gs && bits == 8 && variant == (si % 2 ? 2 : 0); /* values in -32..31, or -16..15 */
                const int six = narrow && si % 4 < 2, five = narrow && !six;
                const char *form_names[] = {"", ", f16 scales", ", shared scales"};
                begin("matmul (%s kernels): rows of a batch = rows alone, %d x %d, group %d%s%s%s%s, n = 1..%d", KERNEL_NAME, R, C, gs,
                      gs && bits == 4 ? ", 4-bit" : "", six ? ", values of 6 bits" : five ? ", values of 5 bits" : "", with_offsets ? ", offsets" : "", form_names[form], MAXN);
                float *w = xcalloc((size_t)R * C, sizeof(float)), *scales = xcalloc((size_t)R * C, sizeof(float));
                float *offsets = xcalloc((size_t)R * C, sizeof(float)); /* (groups, rows): offsets[g * R + i] */
                int8_t *q = xcalloc((size_t)R * C, 1);
                uint8_t *packed = xcalloc((size_t)R * C / 2 + 1, 1);
                float *x = xcalloc((size_t)MAXN * C, sizeof(float)), *out = xcalloc((size_t)MAXN * R, sizeof(float)), *one = xcalloc(R, sizeof(float));
                for (int i = 0; i < R * C; i++) {
                    w[i] = rand_uniform(-1, 1);
                    q[i] = (int8_t)(bits == 4 ? rand_below(16) - 8 : six ? rand_below(64) - 32 : five ? rand_below(32) - 16 : rand_uniform(0, 255) - 127);
                }
                for (int i = 0; bits == 4 && i < R * C / 2; i++) packed[i] = (uint8_t)((q[2 * i] + 8) | (q[2 * i + 1] + 8) << 4);
                for (int i = 0; i < R * G; i++) { scales[i] = rand_uniform(0.001f, 0.02f); offsets[i] = rand_uniform(-0.1f, 0.1f); }
                if (form == SCALES_F16)
                    for (int i = 0; i < R * G; i++) scales[i] = half_to_float(half_from_float(scales[i]));
                for (int i = 0; form == SCALES_SHARED && i < R * G; i += run) { /* d of either sign, k in -128..127 (zeros too) */
                    const float d = half_to_float(half_from_float(rand_uniform(-0.0002f, 0.0002f)));
                    for (int j = 0; j < run; j++) scales[i + j] = d * (float)(rand_below(256) - 128);
                }
                for (int i = 0; i < MAXN * C; i++) x[i] = rand_uniform(-3, 3) * (i % 7 == 0 ? 10 : 1);
                Matrix m = gs ? (Matrix){.scales = (const char *)scales, .rows = R, .cols = C, .group_size = gs}
                              : (Matrix){.w = w, .rows = R, .cols = C};
                if (gs && bits == 4) m.q4 = packed;
                else if (gs) m.q = q;
                if (with_offsets) m.offsets = offsets;
                m.scale_run = run;
                void *packing = pack_for_kernels(&m);
#ifdef PACKED_Q
                /* every build that packs takes the project's own int8 and
                   4-bit matrices whose groups it can (AVX2: multiples of 32) */
                if (gs && packs_groups(gs)) {
                    expect(m.packed != NULL, "not packed");
                    expect(m.scale_form == form, "scales packed in form %d, not %d", m.scale_form, form);
                    expect(m.packed_bits == (bits == 4 ? 4 : narrow && gs % SIX_BIT_COLS == 0 ? (six ? 6 : 5) : 8), "values packed as %d bits", m.packed_bits);
                }
#endif
                for (int n = 1; n <= MAXN && !case_failed; n++) {
                    int off = (n * 7) % (MAXN - n + 1); /* the batch is rows off..off+n-1 of x */
                    for (int i = 0; i < n * R; i++) out[i] = NAN;
                    matmul(out, x + (size_t)off * C, &m, n);
                    for (int b = 0; b < n && !case_failed; b++) {
                        matmul(one, x + (size_t)(off + b) * C, &m, 1);
                        if (memcmp(one, out + (size_t)b * R, (size_t)R * sizeof(float)) != 0) {
                            int i = 0;
                            while (one[i] == out[(size_t)b * R + i]) i++;
                            expect(0, "n %d, row %d, output %d: batched %.9g, alone %.9g", n, b, i, out[(size_t)b * R + i], one[i]);
                        }
                    }
                }
                /* and the outputs are the products: against double sums of the
                   weights' values times the inputs (quantised: the inputs as
                   quantised, plus each offset times its group's float sum) */
                int n = MAXN;
                matmul(out, x, &m, n);
                int16_t *xq = xcalloc((size_t)n * C, sizeof(int16_t));
                float *xs = xcalloc((size_t)n * C, sizeof(float));
                if (gs) quantize_groups(xq, xs, x, (size_t)n * C, gs);
                for (int b = 0; b < n && !case_failed; b++)
                    for (int i = 0; i < R && !case_failed; i++) {
                        double ref = 0, mag = 0, xsum = 0;
                        for (int j = 0; j < C; j++) {
                            size_t wj = (size_t)i * C + j, xj = (size_t)b * C + j;
                            double v = gs ? (double)q[wj] * scales[wj / gs] * xq[xj] * xs[xj / gs] : (double)w[wj] * x[xj];
                            ref += v;
                            mag += fabs(v);
                            xsum += x[xj];
                            if (with_offsets && (j + 1) % gs == 0) {
                                double o = (double)offsets[(size_t)(j / gs) * R + i] * xsum;
                                ref += o, mag += fabs(o), xsum = 0;
                            }
                        }
                        expect(fabs(out[(size_t)b * R + i] - ref) <= 1e-5 * mag + 1e-6, "row %d output %d: %.9g vs %.9g", b, i, out[(size_t)b * R + i], ref);
                    }
                free(xq); free(xs); free(w); free(scales); free(offsets); free(q); free(packed); free(x); free(out); free(one); free(packing);
                end();
            }
    }
#ifdef SIMD_WIDTH
    begin("vf_sums: lane q is vf_sum of vector q, bitwise");
    for (int trial = 0; trial < 200 && !case_failed; trial++) {
        float v[SIMD_WIDTH][SIMD_WIDTH], lanes[SIMD_WIDTH];
        vfloat vs[SIMD_WIDTH];
        for (int a = 0; a < SIMD_WIDTH; a++) {
            for (int k = 0; k < SIMD_WIDTH; k++) v[a][k] = rand_uniform(-1, 1) * powf(10.0f, rand_uniform(-6, 6));
            vs[a] = vf_load(v[a]);
        }
        vf_store(lanes, vf_sums(vs));
        for (int a = 0; a < SIMD_WIDTH; a++) {
            float one = vf_sum(vs[a]);
            expect(memcmp(&one, &lanes[a], sizeof(float)) == 0, "vector %d: %.9g vs %.9g", a, lanes[a], one);
        }
    }
    end();
#endif

    begin("rope vs naive formula");
    {
        const int configs[][3] = {{64, 32, 8}, {64, 64, 16}, {48, 12, 12}, {8, 8, 2}}; /* dim, kv_dim, head_size */
        const int positions[] = {0, 1, 2, 17, 255, 511};
        for (size_t c = 0; c < 4; c++) {
            int dim = configs[c][0], kv_dim = configs[c][1], hs = configs[c][2];
            for (size_t pi = 0; pi < sizeof(positions) / sizeof(positions[0]); pi++) {
                int pos = positions[pi];
                float q[64], k[64], q0[64], k0[64];
                for (int i = 0; i < dim; i++) { q0[i] = q[i] = rand_uniform(-1, 1); k0[i] = k[i] = rand_uniform(-1, 1); }
                rope(q, k, pos, dim, kv_dim, (Rope){hs, hs, 0, 1.0f, NULL});
                for (int i = 0; i < dim; i += 2) {
                    int j = (i % hs) / 2; /* pair index inside the head */
                    double theta = pos * pow(10000.0, -2.0 * j / hs);
                    double c_ = cos(theta), s_ = sin(theta);
                    double rq0 = q0[i] * c_ - q0[i + 1] * s_, rq1 = q0[i] * s_ + q0[i + 1] * c_;
                    double tol = 2e-5 * (1 + pos / 8.0);
                    expect(fabs(q[i] - rq0) <= tol && fabs(q[i + 1] - rq1) <= tol, "dim %d hs %d pos %d q[%d]: (%g,%g) vs (%g,%g)", dim, hs, pos, i, q[i], q[i + 1], rq0, rq1);
                    if (i < kv_dim) {
                        double rk0 = k0[i] * c_ - k0[i + 1] * s_, rk1 = k0[i] * s_ + k0[i + 1] * c_;
                        expect(fabs(k[i] - rk0) <= tol && fabs(k[i + 1] - rk1) <= tol, "dim %d hs %d pos %d k[%d]", dim, hs, pos, i);
                    } else {
                        expect(k[i] == k0[i] && k[i + 1] == k0[i + 1], "k[%d] beyond kv_dim %d was changed", i, kv_dim);
                    }
                }
                if (pos == 0) expect(memcmp(q, q0, sizeof(float) * dim) == 0, "pos 0 is not the identity");
            }
        }
    }
    end();

    /* partial rotary in halves (Phi-4-mini: 96 of 128), cosines and sines
       scaled (LongRoPE's attention factor): pair i of a head is
       (v[i], v[i + rot / 2]) for i < rot / 2, the rest of the head as it was */
    begin("rope partial halves with mscale vs naive formula");
    {
        enum { HS = 16, ROT = 12, DIM = 48, KV = 32 };
        float freqs[ROT / 2];
        for (int i = 0; i < ROT / 2; i++) freqs[i] = (float)pow(5000.0, -2.0 * i / ROT) / (1.0f + i);
        const int positions[] = {0, 3, 100};
        for (size_t pi = 0; pi < 3; pi++) {
            const int pos = positions[pi];
            float q[DIM], k[DIM], q0[DIM], k0[DIM];
            for (int i = 0; i < DIM; i++) { q0[i] = q[i] = rand_uniform(-1, 1); k0[i] = k[i] = rand_uniform(-1, 1); }
            rope(q, k, pos, DIM, KV, (Rope){HS, ROT, 1, 1.25f, freqs});
            for (int i = 0; i < DIM; i++) {
                const int d = i % HS, pair = d < ROT / 2 ? d : d - ROT / 2;
                double want_q = q0[i], want_k = k0[i];
                if (d < ROT) {
                    const double th = (double)pos * freqs[pair], c_ = 1.25 * cos(th), s_ = 1.25 * sin(th);
                    const int a = i - d + pair, b = a + ROT / 2; /* the pair's first and second element */
                    want_q = d < ROT / 2 ? q0[a] * c_ - q0[b] * s_ : q0[a] * s_ + q0[b] * c_;
                    want_k = d < ROT / 2 ? k0[a] * c_ - k0[b] * s_ : k0[a] * s_ + k0[b] * c_;
                }
                if (i >= KV) want_k = k0[i];
                const double tol = 2e-5 * (1 + pos / 8.0);
                expect(fabs(q[i] - want_q) <= tol, "pos %d q[%d]: %g vs %g", pos, i, q[i], want_q);
                expect(fabs(k[i] - want_k) <= tol, "pos %d k[%d]: %g vs %g", pos, i, k[i], want_k);
            }
        }
    }
    end();
}

/* a / b in float, correctly rounded, whatever the build's flags: the unit
   tests' vector builds have reciprocal math (-Ofast), under which a loop of
   divisions by one value may multiply by its reciprocal instead, a unit in
   the last place off (x / xs = -104.4999975 came out -104.49999 rather than
   -104.5, and rounded the other way). One division in a function of its
   own is left a division. */
static __attribute__((noinline)) float float_quotient(float a, float b) { return a / b; }

/* Quantised matmul (int8 version 2, 4-bit version 3) against a plain double
   reference written here from the documented formulas: inputs quantised per
   group (xs = max|x| / 127, xq = round half away from zero of x / xs), exact
   integer group sums, out = sum_g isum * ws * xs. Odd shapes: rows that are
   not a multiple of the kernels' block of rows, and every group size the
   format allows for the columns (every divisor; even ones for 4 bits). Each
   row of a batch must equal, bit for bit, the same row computed alone. */
static void test_quantised_matmul(void) {
    const int col_sizes[] = {2, 12, 32, 64, 96, 128, 160, 192};
    const int row_sizes[] = {1, 3, 6, 13};
    enum { MAXR = 13, MAXC = 192, N = 5 };
    for (int bits = 8; bits >= 4; bits -= 4) {
        begin("%s matmul vs double reference, every group size, n = 1..5", bits == 4 ? "4-bit" : "int8");
        int cases = 0;
        for (size_t ci = 0; ci < sizeof(col_sizes) / sizeof(col_sizes[0]); ci++)
            for (size_t ri = 0; ri < sizeof(row_sizes) / sizeof(row_sizes[0]); ri++)
                for (int gs = 1; gs <= col_sizes[ci]; gs++) {
                    const int C = col_sizes[ci], R = row_sizes[ri];
                    if (C % gs != 0 || (bits == 4 && gs % 2 != 0)) continue;
                    static int8_t qv[MAXR * MAXC];      /* the weights' integer values */
                    static uint8_t packed[MAXR * MAXC / 2];
                    static float scales[MAXR * MAXC], x[N * MAXC], out[N * MAXR], one[MAXR], row[MAXC];
                    for (int i = 0; i < R * C; i++) qv[i] = (int8_t)(bits == 4 ? rand_below(16) - 8 : rand_below(255) - 127);
                    for (int i = 0; bits == 4 && i < R * C / 2; i++) packed[i] = (uint8_t)((qv[2 * i] + 8) | (qv[2 * i + 1] + 8) << 4);
                    for (int i = 0; i < R * C / gs; i++) scales[i] = rand_uniform(-0.1f, 0.1f);
                    for (int i = 0; i < N * C; i++) x[i] = rand_uniform(-3, 3);
                    x[0] = 0.0f; /* an all-zero group where gs is 1 */
                    Matrix m = {.scales = (const char *)scales, .rows = R, .cols = C, .group_size = gs};
                    if (bits == 4) m.q4 = packed;
                    else m.q = qv;
                    void *packing = pack_for_kernels(&m);
#ifdef VNNI
                    expect((kernel_of(&m) == KERNEL_Q4_SIMD || kernel_of(&m) == KERNEL_Q8_SIMD) == (gs % 4 == 0),
                           "C %d gs %d: the VNNI kernel where the group size is a multiple of 4, and only there", C, gs);
#elif defined(HAVE_Q4_SIMD)
                    if (bits == 4)
                        expect((kernel_of(&m) == KERNEL_Q4_SIMD) == (gs % VI_COLS == 0),
                               "C %d gs %d: the 4-bit vector kernel where the group size is a multiple of %d, and only there", C, gs, VI_COLS);
#endif
                    cases++;
                    for (int i = 0; i < R; i++) {
                        matrix_row(row, &m, i);
                        for (int j = 0; j < C; j++)
                            if (!expect(row[j] == qv[i * C + j] * scales[(i * C + j) / gs], "C %d gs %d: matrix_row %d [%d]", C, gs, i, j)) break;
                    }
                    for (int n = 1; n <= N; n++) {
                        matmul(out, x, &m, n);
                        for (int b = 0; b < n; b++) {
                            matmul(one, x + b * C, &m, 1);
                            expect(memcmp(one, out + b * R, R * sizeof(float)) == 0, "C %d R %d gs %d n %d: row %d differs alone", C, R, gs, n, b);
                            for (int i = 0; i < R; i++) {
                                double ref = 0, mag = 0;
                                for (int g = 0; g < C / gs; g++) {
                                    const float *v = x + b * C + g * gs;
                                    float amax = 0;
                                    for (int j = 0; j < gs; j++) amax = fmaxf(amax, fabsf(v[j]));
                                    float xs = amax / 127.0f;
                                    long isum = 0, isum_abs = 0; /* the vector kernels' partial sums are within isum_abs */
                                    for (int j = 0; j < gs; j++) {
                                        double r = xs > 0 ? (double)float_quotient(v[j], xs) : 0.0;
                                        long xq = (long)(r < 0 ? -floor(-r + 0.5) : floor(r + 0.5));
                                        isum += xq * qv[i * C + g * gs + j];
                                        isum_abs += labs(xq * qv[i * C + g * gs + j]);
                                    }
                                    double ws = scales[(i * C) / gs + g];
                                    ref += (double)isum * ws * xs;
                                    mag += (double)isum_abs * fabs(ws * xs);
                                }
                                if (!expect(fabs(out[b * R + i] - ref) <= 2e-6 * mag + 1e-30, "C %d R %d gs %d n %d: [%d][%d] %.9g vs %.9g",
                                            C, R, gs, n, b, i, out[b * R + i], ref)) break;
                            }
                        }
                    }
                    free(packing);
                }
        expect(cases > 40, "only %d shapes", cases);
        end();
    }
}

#ifdef PACKED_Q
/* A random f16 value of magnitude in [lo, hi), either sign when `signed_`. */
static uint16_t random_half(float lo, float hi, int signed_) {
    float v = rand_uniform(lo, hi);
    return half_from_float(signed_ && rand_below(2) ? -v : v);
}
#endif

#ifdef PACKED_Q
/* One type (ggml number) of test_gguf_packing: its random blocks, or
   (extreme) its extremes; R rows, C columns, input rows n = 1..N. */
static void check_gguf_packing(int number, int extreme, int R, int C, int N) {
    const GGMLType *type = &ggml_types[number];
    const int per_row = C / type->block, groups = C / type->group;
    const size_t bytes = (size_t)R * per_row * type->block_bytes;
    uint8_t *blocks = xcalloc(bytes, 1);
    const int table = number == 20 || number == 23, mxfp4 = number == 39; /* IQ4_NL, IQ4_XS: code 0 is -127 */
    for (size_t i = 0; i < bytes; i++) blocks[i] = extreme ? (number == 8 ? 0x80 : table ? 0x00 : 0xFF) : (uint8_t)rand_below(256);
    for (int b = 0; b < R * per_row; b++) { /* the f16 fields: d (and dmin, or Q4_1's m); MXFP4's exponent byte */
        uint8_t *at = blocks + (size_t)b * type->block_bytes;
        uint16_t d = random_half(0.0005f, 0.004f, number == 8 || number == 14 || table), second = random_half(0.0005f, 0.004f, number == 3);
        if (mxfp4) at[0] = (uint8_t)(extreme ? 127 : 119 + rand_below(6)); /* 2^-9 .. 2^-4 a doubled E2M1 step */
        else memcpy(at + (number == 14 ? 208 : 0), &d, 2);
        if (type->offsets) memcpy(at + 2, &second, 2);
    }
    Matrix blockwise = {.rows = R, .cols = C, .group_size = type->group, .scale_run = type->block / type->group,
                        .blocks = blocks, .block_type = number};
    void *packing = pack_for_kernels(&blockwise);
    expect(blockwise.packed != NULL, "not packed");
    expect(blockwise.packed_bits == type->value_bits, "values packed as %d bits", blockwise.packed_bits);
    expect(blockwise.packed_table == type->table, "packed with%s a table", blockwise.packed_table ? "" : "out");
    expect(blockwise.scale_form == (type->e8m0 ? SCALES_E8M0 : !type->factors ? SCALES_F32 : type->block > type->group ? SCALES_SHARED : SCALES_F16),
           "scales in form %d", blockwise.scale_form);
    expect(blockwise.offset_form == (!type->offsets ? OFFSETS_NONE : type->block > type->group ? OFFSETS_MIN : OFFSETS_F32),
           "offsets in form %d", blockwise.offset_form);
    /* the same matrix unpacked, as non-VNNI builds hold it */
    int8_t *q = xcalloc((size_t)R * C, 1);
    float *scales = xcalloc((size_t)R * groups, sizeof(float)), *offsets = xcalloc((size_t)R * groups, sizeof(float));
    GGUFTensor tensor = {.n_dims = 2, .ne = {C, R, 1, 1}, .type = (uint32_t)number, .data = (const char *)blocks, .bytes = bytes};
    unpack_tensor(&tensor, type, q, scales, type->offsets ? offsets : NULL);
    int8_t *values = xcalloc((size_t)R * C, 1); /* section 1's int8 values (4-bit types: unpacked from the nibbles) */
    for (int i = 0; i < R * C; i++)
        values[i] = type->bits == 4 ? (int8_t)((((uint8_t *)q)[i / 2] >> (i % 2 * 4) & 15) - 8) : q[i];
    Matrix unpacked = {.scales = (const char *)scales, .rows = R, .cols = C, .group_size = type->group, .scale_run = type->block / type->group,
                       .offsets = type->offsets ? offsets : NULL};
    if (type->bits == 4) unpacked.q4 = (const uint8_t *)q;
    else unpacked.q = q;
    void *packing2 = pack_for_kernels(&unpacked);
    float *x = xcalloc((size_t)N * C, sizeof(float)), *out = xcalloc((size_t)N * R, sizeof(float));
    float *ref_out = xcalloc((size_t)N * R, sizeof(float)), *one = xcalloc(R, sizeof(float));
    for (int i = 0; i < N * C; i++) x[i] = extreme ? 1.0f : rand_uniform(-3, 3) * (i % 11 == 0 ? 8 : 1);
    for (int n = 1; n <= N && !case_failed; n++) {
        matmul(out, x, &blockwise, n);
#ifdef VNNI
        matmul(ref_out, x, &unpacked, n);
        if (memcmp(out, ref_out, (size_t)n * R * sizeof(float)) != 0) {
            int i = 0;
            while (out[i] == ref_out[i]) i++;
            expect(0, "n %d, output %d: from the blocks %.9g, unpacked %.9g", n, i, out[i], ref_out[i]);
        }
#endif
        for (int b = 0; b < n && !case_failed; b++) {
            matmul(one, x + (size_t)b * C, &blockwise, 1);
            expect(memcmp(one, out + (size_t)b * R, R * sizeof(float)) == 0, "n %d: row %d differs alone", n, b);
        }
        if (n < 2) continue;
        /* in one call beside others (matmul_many): the first two read the same inputs, the third rows of their own */
        float *many = xcalloc((size_t)3 * N * R, sizeof(float));
        const Product pr[3] = {{&blockwise, many, x, n}, {&blockwise, many + (size_t)N * R, x, n}, {&blockwise, many + (size_t)2 * N * R, x + C, n - 1}};
        matmul_many(pr, 3);
        expect(memcmp(many, out, (size_t)n * R * sizeof(float)) == 0 && memcmp(many + (size_t)N * R, out, (size_t)n * R * sizeof(float)) == 0,
               "n %d: a product sharing its inputs differs from matmul's", n);
        matmul(ref_out, x + C, &blockwise, n - 1);
        expect(memcmp(many + (size_t)2 * N * R, ref_out, (size_t)(n - 1) * R * sizeof(float)) == 0, "n %d: a product of its own rows differs", n);
        free(many);
    }
    int16_t *xq = xcalloc((size_t)N * C, sizeof(int16_t));
    float *xs = xcalloc((size_t)N * groups, sizeof(float));
    quantize_groups(xq, xs, x, (size_t)N * C, type->group);
    for (int b = 0; b < N && !case_failed; b++)
        for (int i = 0; i < R && !case_failed; i++) {
            double ref = 0, mag = 0;
            for (int g = 0; g < groups; g++) {
                double isum = 0, xsum = 0;
                for (int j = g * type->group; j < (g + 1) * type->group; j++) {
                    isum += (double)values[(size_t)i * C + j] * xq[(size_t)b * C + j];
                    xsum += x[(size_t)b * C + j];
                }
                const double t = isum * scales[(size_t)i * groups + g] * xs[(size_t)b * groups + g];
                const double o = type->offsets ? (double)offsets[(size_t)g * R + i] * xsum : 0.0;
                ref += t + o, mag += fabs(t) + fabs(o);
            }
            expect(fabs(out[(size_t)b * R + i] - ref) <= 1e-5 * mag + 1e-6, "row %d output %d: %.9g vs %.9g", b, i, out[(size_t)b * R + i], ref);
        }
    free(xq); free(xs); free(x); free(out); free(ref_out); free(one); free(values);
    free(q); free(scales); free(offsets); free(blocks); free(packing); free(packing2);
}
#endif

/* GGUF matrices of every block type that the build packs, packed straight
   from their blocks (as VNNI and AVX2 builds load them): each form the type stores is chosen (values of 4, 5, 6 or 8
   bits as such, a table's 4-bit codes with their table, f16, shared or (MXFP4) E8M0 scales, K-quants' offsets as minimums);
   (VNNI) every output is bit for bit the one of the same matrix unpacked as
   section 2.2 unpacks it (q, float32 scales and offsets) and packed from
   that; within 1e-5 of the double sum of its values times the quantised
   inputs plus the offsets times the float group sums, and each row of a
   batch is the row alone. Random blocks with realistic d, dmin and Q4_1's
   m; the rows leave a partial block, the columns two K-quant blocks. Then
   the extremes: every value the largest the type stores (Q8_0: -128) and
   every input 127 once quantised, so that the int16 pair sums of AVX2's
   kernel are as large as they can be between widenings (random values
   never come near; IQ4_NL, IQ4_XS: -127). */
static void test_gguf_packing(void) {
#ifdef PACKED_Q
    const int types[] = {2, 3, 6, 7, 8, 12, 13, 14, 20, 23, 39}; /* Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4 */
    enum { R = 21, C = 512, N = 20 };
    for (size_t ti = 0; ti < sizeof(types) / sizeof(types[0]); ti++) {
        const GGMLType *type = &ggml_types[types[ti]];
#ifdef VNNI
        begin("GGUF %s packed from its blocks = unpacked, bit for bit; vs double reference; rows alone, n = 1..%d", type->name, N);
#else
        begin("GGUF %s packed from its blocks (%s) vs double reference; rows alone, n = 1..%d", type->name, KERNEL_NAME, N);
#endif
        for (int extreme = 0; extreme < 2 && !case_failed; extreme++) check_gguf_packing(types[ti], extreme, R, C, N);
        end();
    }
    /* MXFP4's scales as the kernels widen their bytes (SCALES_E8M0): every
       e, the subnormal 2^-128 and 2^-127 and the largest, 2^127, included */
    begin("E8M0 scales widened (%s): 2^(e - 128) for every byte e, bit for bit", KERNEL_NAME);
    uint8_t bytes[256 + 16];
    float widened[256];
    for (int e = 0; e < 256 + 16; e++) bytes[e] = (uint8_t)e;
#if defined(VNNI)
    for (int e = 0; e < 256; e += 16) vf_store(widened + e, e8m0_16(bytes + e));
#elif defined(PACKED_AVX2)
    for (int e = 0; e < 256; e += 8) _mm256_storeu_ps(widened + e, e8m0_8(bytes + e));
#else
    for (int e = 0; e < 256; e += 4) vst1q_f32(widened + e, e8m0_4(bytes + e));
#endif
    for (int e = 0; e < 256 && !case_failed; e++) {
        const float want = ldexpf(1.0f, e - 128);
        expect(memcmp(&widened[e], &want, sizeof(float)) == 0, "e %d: %.9g, not %.9g", e, widened[e], want);
    }
    end();
#endif
}

/* out (n, rows) = x (n, cols) @ W^T for a float32 W: each output against
   the double-precision sum (within 4e-6 of the sum of the products'
   magnitudes), and each row bit-identical to that row computed alone (one:
   rows floats). */
static void expect_f32_batch(const Matrix *m, const float *x, int n, float *out, float *one) {
    const int R = m->rows, C = m->cols;
    for (int i = 0; i < n * R; i++) out[i] = NAN;
    matmul(out, x, m, n);
    for (int b = 0; b < n && !case_failed; b++) {
        matmul(one, x + (size_t)b * C, m, 1);
        for (int i = 0; i < R; i++) {
            double ref = 0, mag = 0;
            for (int j = 0; j < C; j++) {
                ref += (double)m->w[(size_t)i * C + j] * x[(size_t)b * C + j];
                mag += fabs((double)m->w[(size_t)i * C + j] * x[(size_t)b * C + j]);
            }
            expect(fabs(out[b * R + i] - ref) <= 4e-6 * mag + 1e-7, "n %d row %d out %d: %.9g vs %.9g", n, b, i, out[b * R + i], ref);
            expect(memcmp(&one[i], &out[b * R + i], sizeof(float)) == 0, "n %d row %d out %d: batch %.9g, alone %.9g", n, b, i,
                   out[b * R + i], one[i]);
        }
    }
}

/* The shapes the vector kernels take (columns a multiple of 16, int8 groups
   of 32 and 64; "plain C" builds run them too): against double-precision
   sums, and each row of a batch bit-identical to the same row alone, for
   n = 1..9 input rows and a row count that leaves a partial block. */
static void test_matmul_vector_shapes(void) {
    enum { R = 37, C = 128, N = 9 };
    static float w[R * C], x[N * C], out[N * R], one[R];
    static int8_t q[R * C];
    static float scales[R * C / 32];
    static int16_t xq[N * C];
    static float xs[N * C / 32];
    for (int i = 0; i < R * C; i++) { w[i] = rand_uniform(-1, 1); q[i] = (int8_t)(rand_below(256) - 128); }
    for (int i = 0; i < R * C / 32; i++) scales[i] = rand_uniform(0.001f, 0.02f);
    for (int i = 0; i < N * C; i++) x[i] = rand_uniform(-1, 1);

    begin("matmul float32 (%s), %d columns: vs double, each batch row = that row alone", KERNEL_NAME, C);
    {
        Matrix m = {.w = w, .rows = R, .cols = C};
        for (int n = 1; n <= N; n++) expect_f32_batch(&m, x, n, out, one);
    }
    end();

    for (int gs = 32; gs <= 64; gs *= 2) {
        begin("matmul int8 (%s), groups of %d: vs exact integer group sums, each batch row = that row alone", KERNEL_NAME, gs);
        const int groups = C / gs;
        Matrix m = {.q = q, .scales = (const char *)scales, .rows = R, .cols = C, .group_size = gs};
        void *packing = pack_for_kernels(&m);
        quantize_groups(xq, xs, x, (size_t)N * C, gs);
        for (int n = 1; n <= N; n++) {
            matmul(out, x, &m, n);
            for (int b = 0; b < n; b++) {
                matmul(one, x + b * C, &m, 1);
                for (int i = 0; i < R; i++) {
                    double ref = 0, mag = 0;
                    for (int g = 0; g < groups; g++) {
                        long long isum = 0, iabs = 0;
                        for (int j = g * gs; j < (g + 1) * gs; j++) {
                            isum += (long long)q[i * C + j] * xq[b * C + j];
                            iabs += llabs((long long)q[i * C + j] * xq[b * C + j]);
                        }
                        double scale = (double)scales[i * groups + g] * xs[b * groups + g];
                        ref += (double)isum * scale;
                        mag += (double)iabs * scale;
                    }
                    expect(fabs(out[b * R + i] - ref) <= 4e-6 * mag + 1e-7, "gs %d n %d row %d out %d: %.9g vs %.9g", gs, n, b, i, out[b * R + i], ref);
                    expect(memcmp(&one[i], &out[b * R + i], sizeof(float)) == 0, "gs %d n %d row %d out %d: batch %.9g, alone %.9g", gs, n, b, i, out[b * R + i], one[i]);
                }
            }
        }
        free(packing);
        end();
    }
}

/* float32 rows longer than a slice (F32_SLICE: the many-row kernel takes
   them in slices, its lane sums carried between them): 2096 columns are two
   slices and a 48-column rest, and n = 1..40 input rows cross F32_SLAB
   passes. Each batch row bit-identical to that row alone (which the one-row
   kernel computes in one pass), and against double-precision sums. The
   values come from draws of their own, so that later tests' data does not
   depend on this one. */
static void test_matmul_slices(void) {
    enum { R = 13, C = 2096, N = 40 };
    static float w[R * C], x[N * C], out[N * R], one[R];
    uint64_t state = 0x5eed5111ceULL;
    for (int i = 0; i < R * C; i++) w[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    for (int i = 0; i < N * C; i++) x[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    begin("matmul float32 (%s), %d columns in slices: vs double, each batch row = that row alone, n = 1..%d", KERNEL_NAME, C, N);
    Matrix m = {.w = w, .rows = R, .cols = C};
    for (int n = 1; n <= N && !case_failed; n++) expect_f32_batch(&m, x, n, out, one);
    end();
}

/* An IEEE half-precision value from its bits, by its definition: subnormal
   m * 2^-24, normal (1 + m / 1024) * 2^(e - 15) (no infinities or NaNs are
   drawn). */
static float half_by_definition(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1.0 + m / 1024.0, e - 15);
    return (float)(h & 0x8000 ? -v : v);
}

/* A random F16 (bf16 0) or BF16 value in *h, and in *w the float it
   widens to (a half's by its definition), exponents kept small (|w| < 4):
   a half's 1..16, a bfloat16's 120..128. */
static void draw_half(uint64_t *state, int bf16, uint16_t *h, float *w) {
    int e = bf16 ? 120 + (int)draw_below(state, 9) : 1 + (int)draw_below(state, 16);
    uint16_t sign = (uint16_t)(draw_below(state, 2) << 15);
    if (bf16) {
        *h = (uint16_t)(sign | e << 7 | (int)draw_below(state, 128));
        uint32_t bits = (uint32_t)*h << 16;
        memcpy(w, &bits, sizeof(float));
    } else {
        *h = (uint16_t)(sign | e << 10 | (int)draw_below(state, 1024));
        *w = half_by_definition(*h);
    }
}

/* GGUF F16 and BF16 matrices, read in place and widened by the kernels as
   they load (section 2.2): every output, for n = 1..40 input rows and rows
   long enough for slices, has the same bits as the float32 matrix of the
   widened values (each widened here by its definition). */
#if SIMD_WIDTH == 8 && defined(VF_HALF_LOADS)
#define F16_BLOCKS 2 /* AVX2 builds: F16 rows in blocks of 2 x 5 or 4 x 3 (f16_block_wide), each checked */
#else
#define F16_BLOCKS 1
#endif
static void test_matmul_half(void) {
    enum { R = 11, C = 2096, N = 40 };
    static uint16_t h[R * C];
    static float w[R * C], x[N * C], out[N * R], want[N * R];
    uint64_t state = 0x4a1f16b16ULL;
    for (int i = 0; i < N * C; i++) x[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    for (int form = 0; form <= F16_BLOCKS; form++) {
        const int bf16 = form == F16_BLOCKS;
#if F16_BLOCKS > 1
        f16_block_wide = form == 1;
#endif
        begin("matmul %s (%s%s): the bits of the float32 matrix it widens to, n = 1..%d", bf16 ? "BF16" : "F16", KERNEL_NAME,
              F16_BLOCKS == 1 || bf16 ? "" : form == 1 ? ", blocks of 4 x 3" : ", blocks of 2 x 5", N);
        for (int i = 0; i < R * C; i++) draw_half(&state, bf16, &h[i], &w[i]);
        if (!bf16) h[5] = 0x0201, w[5] = half_by_definition(0x0201); /* a subnormal */
        Matrix m16 = {.half = h, .bf16 = bf16, .rows = R, .cols = C}, m32 = {.w = w, .rows = R, .cols = C};
        for (int n = 1; n <= N && !case_failed; n++) {
            matmul(out, x, &m16, n);
            matmul(want, x, &m32, n);
            for (int k = 0; k < n * R; k++)
                if (!expect(memcmp(&out[k], &want[k], sizeof(float)) == 0, "n %d output %d: %.9g, float32 %.9g", n, k, out[k], want[k])) break;
        }
        float row[C];
        matrix_row(row, &m16, 3);
        expect(memcmp(row, w + 3 * C, sizeof(row)) == 0, "matrix_row differs from the widened values");
        end();
    }
#if F16_BLOCKS > 1
    begin("matmul F16 (%s) in the block a model's load measures this machine faster (choose_f16_block)", KERNEL_NAME);
    for (int i = 0; i < R * C; i++) draw_half(&state, 0, &h[i], &w[i]);
    Matrix m16 = {.half = h, .rows = R, .cols = C}, m32 = {.w = w, .rows = R, .cols = C}, *all[1] = {&m16};
    choose_f16_block(all, 1);
    for (int n = 2; n <= 13 && !case_failed; n++) {
        matmul(out, x, &m16, n);
        matmul(want, x, &m32, n);
        expect(memcmp(out, want, (size_t)n * R * sizeof(float)) == 0, "n %d: not the float32 matrix's bits", n);
    }
    end();
    f16_block_wide = 0;
#endif
#ifdef BF16_DOT
    /* rows of a multiple of 32 columns: bfloat16 dot products, the inputs
       rounded to bfloat16 (to nearest even) */
    begin("matmul BF16 (%s), 2080 columns: the double sums of the weights times the inputs in bfloat16; rows alone = in a batch, n = 1..%d",
          KERNEL_NAME, N);
    enum { C2 = 2080 };
    Matrix m = {.half = h, .bf16 = 1, .rows = R, .cols = C2};
    expect(kernel_of(&m) == KERNEL_BF16_DOT, "not multiplied by bfloat16 dot products");
    for (int i = 0; i < R * C2; i++) {
        h[i] = (uint16_t)(draw_below(&state, 2) << 15 | (120 + (int)draw_below(&state, 9)) << 7 | (int)draw_below(&state, 128));
        uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(&w[i], &bits, sizeof(float));
    }
    static float one[R];
    for (int n = 1; n <= N && !case_failed; n++) {
        matmul(out, x, &m, n);
        for (int b = 0; b < n && !case_failed; b++) {
            matmul(one, x + (size_t)b * C2, &m, 1);
            expect(memcmp(one, out + (size_t)b * R, sizeof(one)) == 0, "n %d: row %d differs alone", n, b);
            for (int i = 0; i < R; i++) {
                double ref = 0, mag = 0;
                for (int j = 0; j < C2; j++) {
                    uint32_t u;
                    memcpy(&u, &x[(size_t)b * C2 + j], 4);
                    u = (u + 0x7FFFu + (u >> 16 & 1u)) & 0xFFFF0000u; /* to bfloat16, ties to even */
                    float xb;
                    memcpy(&xb, &u, 4);
                    ref += (double)w[(size_t)i * C2 + j] * xb;
                    mag += fabs((double)w[(size_t)i * C2 + j] * xb);
                }
                if (!expect(fabs(out[(size_t)b * R + i] - ref) <= 1e-6 * mag, "n %d row %d output %d: %.9g vs %.9g", n, b, i, out[(size_t)b * R + i], ref))
                    break;
            }
        }
    }
    end();
#endif
}

/* Three 16-bit matrices of one call (as wq, wk and wv), tall enough for
   AVX2 builds to take them in chunks of rows shared between threads, of
   row counts that split into items unevenly (the first not a multiple of
   a block): every output has the bits of the float32 matrices they widen
   to, each multiplied alone, for n = 2..9 input rows. (BF16 rows taken
   by bfloat16 dot products, AVX-512 BF16 builds, round the inputs to
   bfloat16 instead: their outputs have the bits of each BF16 matrix
   multiplied alone, whose sums test_matmul_half checks.) */
static void test_matmul_shared_half(void) {
    enum { C = 256, N = 9 };
    const int rows[3] = {203, 72, 72};
    static uint16_t h[3][203 * C];
    static float w[3][203 * C], x[N * C], out[3][N * 203], want[N * 203];
    uint64_t state = 0x5a4ed16ULL;
    for (int i = 0; i < N * C; i++) x[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    for (int bf16 = 0; bf16 <= 1; bf16++) {
        begin("matmul_many %s (%s), 3 matrices of %d, %d and %d rows: the bits of the float32 matrices, n = 2..%d", bf16 ? "BF16" : "F16",
              KERNEL_NAME, rows[0], rows[1], rows[2], N);
        Matrix m16[3], m32[3];
        for (int m = 0; m < 3; m++) {
            for (int i = 0; i < rows[m] * C; i++) draw_half(&state, bf16, &h[m][i], &w[m][i]);
            m16[m] = (Matrix){.half = h[m], .bf16 = bf16, .rows = rows[m], .cols = C};
            m32[m] = (Matrix){.w = w[m], .rows = rows[m], .cols = C};
        }
        for (int n = 2; n <= N && !case_failed; n++) {
            const Product pr[3] = {{&m16[0], out[0], x, n}, {&m16[1], out[1], x, n}, {&m16[2], out[2], x, n}};
            matmul_many(pr, 3);
            for (int m = 0; m < 3 && !case_failed; m++) {
                const int dot = kernel_of(&m16[m]) == KERNEL_BF16_DOT;
                matmul(want, x, dot ? &m16[m] : &m32[m], n);
                for (int k = 0; k < n * rows[m]; k++)
                    if (!expect(memcmp(&out[m][k], &want[k], sizeof(float)) == 0, "n %d matrix %d output %d: %.9g, %s %.9g", n, m, k,
                                out[m][k], dot ? "alone" : "float32", want[k]))
                        break;
            }
        }
        end();
    }
}

/* matmul_many with products of their own input rows, enough of them for
   the inputs to be prepared on several threads (a layer's heads or
   experts): every output has the bits of its product multiplied alone by
   matmul, for float32, 16-bit and int8 matrices, 1 to 64 rows a product. */
static void test_matmul_many(void) {
    enum { C = 256, R = 72, P = 8, N = 64 };
    static float w[R * C], x[P * N * C], out[P * N * R], want[N * R];
    static uint16_t h[R * C];
    static int8_t q[R * C];
    static float scales[R * C / 32];
    uint64_t state = 0x3a2f1ULL;
    for (int i = 0; i < P * N * C; i++) x[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    for (int i = 0; i < R * C; i++) {
        draw_half(&state, 0, &h[i], &w[i]);
        q[i] = (int8_t)(draw_below(&state, 255) - 127);
    }
    for (int i = 0; i < R * C / 32; i++) scales[i] = (float)(draw_below(&state, 100) + 1) * 1e-3f;
    const Matrix forms[3] = {{.w = w, .rows = R, .cols = C}, {.half = h, .rows = R, .cols = C},
                             {.q = q, .scales = (const char *)scales, .rows = R, .cols = C, .group_size = 32}};
    static const char *names[3] = {"float32", "F16", "int8"};
    for (int f = 0; f < 3; f++) {
        begin("matmul_many (%s), %s: %d products of their own rows (1..%d), each as matmul alone", KERNEL_NAME, names[f], P, N);
        Matrix W = forms[f];
        void *packing = pack_for_kernels(&W);
        Product pr[P];
        for (int m = 0; m < P; m++) pr[m] = (Product){&W, out + (size_t)m * N * R, x + (size_t)m * N * C, m == 0 ? 1 : N - 3 * m};
        matmul_many(pr, P);
        for (int m = 0; m < P && !case_failed; m++) {
            matmul(want, pr[m].x, &W, pr[m].n);
            for (int k = 0; k < pr[m].n * R; k++)
                if (!expect(memcmp(&pr[m].out[k], &want[k], sizeof(float)) == 0, "product %d (%d rows) output %d: %.9g, alone %.9g", m, pr[m].n,
                            k, pr[m].out[k], want[k]))
                    break;
        }
        free(packing);
        end();
    }
}

#ifdef BF16_SPLIT
/* bfloat16 in 12 bits (section 3): a matrix whose values take 15 high
   bytes and zero, with planted values of other high bytes (exceptions:
   large, small, -0.0, in the first and last columns, two in one row, in
   the partial last block). Every output, n = 1..N, has the bits of the
   matrix read in place (KERNEL_BF16_DOT) with the exceptions as zeros plus
   each exception's product with its input in bfloat16, added in column
   order; and is within float32 rounding of the double sums of all the
   values. A matrix with too many exceptions stays as stored. */
static float bf16_input(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u + 0x7FFFu + (u >> 16 & 1u)) & 0xFFFF0000u; /* to nearest, ties to even */
    memcpy(&v, &u, 4);
    return v;
}

static float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

typedef struct {
    int row, col;
    uint16_t bits;
} Planted;

/* Packs h (R x C; the values at `planted` are its E exceptions, sorted by
   row and column) and checks it against z (h with those values zero) read
   in place, for n = 1..N inputs x. */
enum { SPLIT_R = 29, SPLIT_C = 384, SPLIT_N = 23 };
static void check_split(uint16_t *h, uint16_t *z, const Planted *planted, int E, const float *x) {
    enum { R = SPLIT_R, C = SPLIT_C, N = SPLIT_N };
    static float out[N * R], want[N * R], one[R];
    memcpy(z, h, sizeof(uint16_t) * R * C);
    for (int e = 0; e < E; e++) z[planted[e].row * C + planted[e].col] = 0;
    Matrix m = {.half = h, .bf16 = 1, .rows = R, .cols = C}, stored = {.half = z, .bf16 = 1, .rows = R, .cols = C};
    void *memory = pack_for_kernels(&m);
    expect(kernel_of(&m) == KERNEL_BF16_SPLIT, "not packed in 12 bits");
    expect(m.n_exceptions == (size_t)E, "%zu exceptions, not %d", m.n_exceptions, E);
    expect(kernel_of(&stored) == KERNEL_BF16_DOT, "the reference is not read in place");
    for (int n = 1; n <= N && !case_failed; n++) {
        matmul(out, x, &m, n);
        matmul(want, x, &stored, n);
        for (int b = 0; b < n; b++)
            for (int e = 0; e < E; e++)
                want[(size_t)b * R + planted[e].row] += bf16_value(planted[e].bits) * bf16_input(x[(size_t)b * C + planted[e].col]);
        for (int k = 0; k < n * R; k++)
            if (!expect(memcmp(&out[k], &want[k], sizeof(float)) == 0, "n %d output %d: %.9g, wanted %.9g", n, k, out[k], want[k])) break;
        for (int b = 0; b < n && !case_failed; b++) {
            matmul(one, x + (size_t)b * C, &m, 1);
            expect(memcmp(one, out + (size_t)b * R, sizeof(one)) == 0, "n %d: row %d differs alone", n, b);
            for (int i = 0; i < R && !case_failed; i++) {
                double ref = 0, mag = 0;
                for (int j = 0; j < C; j++) {
                    const double p = (double)bf16_value(h[i * C + j]) * bf16_input(x[(size_t)b * C + j]);
                    ref += p;
                    mag += fabs(p);
                }
                expect(fabs(out[(size_t)b * R + i] - ref) <= 1e-6 * mag, "n %d row %d output %d: %.9g vs %.9g", n, b, i, out[(size_t)b * R + i], ref);
            }
        }
    }
    free(memory);
}

static void test_matmul_bf16_split(void) {
    enum { R = SPLIT_R, C = SPLIT_C, N = SPLIT_N, E = 7 };
    static uint16_t h[R * C], z[R * C];
    static float x[N * C];
    static const Planted planted[E] = {{0, 0, 0x4A12}, {3, 200, 0xC9F0}, {3, 383, 0x3000}, {11, 64, 0x8000},
                                       {17, 127, 0xD280}, {28, 5, 0x5F00}, {28, 300, 0x0B01}};
    uint64_t state = 0x5b1f16ULL;
    begin("matmul BF16 in 12 bits (%s): the bits of the stored matrix read in place with its %d exceptions added; double sums; n = 1..%d",
          KERNEL_NAME, E, N);
    for (int i = 0; i < N * C; i++) x[i] = (float)(draw_below(&state, 2001) - 1000) * 1e-3f;
    for (int i = 0; i < R * C; i++) { /* high bytes 0x3B..0x42 and 0xBB..0xC1 (exponents 118..133): a full table; 1 in 16 zero */
        const int k = draw_below(&state, 15);
        h[i] = draw_below(&state, 16) == 0 ? 0 : (uint16_t)((k < 8 ? 0x3B + k : 0xBB + k - 8) << 8 | draw_below(&state, 256));
    }
    for (int e = 0; e < E; e++) h[planted[e].row * C + planted[e].col] = planted[e].bits;
    check_split(h, z, planted, E, x);
    end();
    /* the exception in row 1, which the table's count passes over (every SPLIT_SAMPLE-th row) */
    begin("matmul BF16 in 12 bits (%s): 3 high bytes, the table's other 12 codes 0x00; one exception", KERNEL_NAME);
    static const Planted lone[1] = {{1, 129, 0x4180}};
    for (int i = 0; i < R * C; i++) h[i] = (uint16_t)((0x3C + draw_below(&state, 3)) << 8 | draw_below(&state, 256));
    h[lone[0].row * C + lone[0].col] = lone[0].bits;
    check_split(h, z, lone, 1, x);
    end();
    begin("matmul BF16 in 12 bits (%s): a matrix spread over 256 high bytes stays as stored", KERNEL_NAME);
    for (int i = 0; i < R * C; i++) h[i] = (uint16_t)((i % 256) << 8 | 0x40);
    Matrix spread = {.half = h, .bf16 = 1, .rows = R, .cols = C};
    void *memory = pack_for_kernels(&spread);
    expect(memory == NULL && kernel_of(&spread) == KERNEL_BF16_DOT, "a matrix of %zu exceptions was packed", spread.n_exceptions);
    free(memory);
    end();
}
#endif

/* ------------------------------------------------------------------------ */
/* The paged cache's block allocator against a plain model of it            */
/* ------------------------------------------------------------------------ */

/* The model: each table is a list of block ids with, per position, the value
   last written there in its lineage; a block's reference count must be the
   number of table entries naming it. Tables 0, 1 and 2 are --keep rings of
   RING_SLOTS positions (5, 0 and 5 sinks): a write to a full one drops its
   oldest position after the sinks; copies are between tables of one kind,
   and rings end less often, so that they fill and turn. */
#define MODEL_TABLES 6
#define MODEL_POSITIONS 80
#define RING_SLOTS (MODEL_POSITIONS - 3)

typedef struct {
    int len;                          /* positions written */
    float value[MODEL_POSITIONS];     /* what each position must read back */
} TableModel;

/* Checks the invariants; returns a description of the first broken one. */
static const char *allocator_broken(const KVCache *c, BlockTable *tables, const TableModel *model, char *why, size_t cap) {
    int count[64] = {0}, in_list[64] = {0};
    for (int t = 0; t < MODEL_TABLES; t++)
        for (int i = 0; i < tables[t].n; i++) {
            int b = tables[t].ids[i];
            if (b < 0 || b >= c->n_blocks) { snprintf(why, cap, "table %d holds block %d", t, b); return why; }
            count[b]++;
        }
    for (int list = 0; list < 2; list++)
        for (int b = c->head[list], prev = -1, steps = 0; b >= 0; prev = b, b = c->next[b]) {
            if (++steps > c->n_blocks) { snprintf(why, cap, "free list %d has a cycle", list); return why; }
            if (c->prev[b] != prev) { snprintf(why, cap, "free list %d: bad back link at block %d", list, b); return why; }
            if (in_list[b]++) { snprintf(why, cap, "block %d is twice in the free lists", b); return why; }
            if ((c->state[b] == BLOCK_READY) != list) { snprintf(why, cap, "block %d (state %d) in free list %d", b, c->state[b], list); return why; }
        }
    for (int b = 0; b < c->n_blocks; b++) {
        if (c->ref[b] != count[b]) { snprintf(why, cap, "block %d: reference count %d, held %d times", b, c->ref[b], count[b]); return why; }
        if ((count[b] == 0) != (in_list[b] == 1)) { snprintf(why, cap, "block %d: held %d times, in a free list %d times", b, count[b], in_list[b]); return why; }
        if (c->state[b] != BLOCK_PLAIN) {
            const int *tokens = c->tokens + (size_t)b * KV_BLOCK;
            for (int l = 0; l < c->n_layers; l++)
                for (int j = 0; j < KV_BLOCK; j++) { /* an indexed block holds what it was indexed with (stamps as tokens) */
                    float k = ((const float *)(c->key + kv_block_offset(c, l, b) + (size_t)j * c->row_bytes))[0];
                    if (k != (float)tokens[j]) {
                        snprintf(why, cap, "indexed block %d layer %d row %d holds %g, indexed as %d", b, l, j, k, tokens[j]);
                        return why;
                    }
                }
            if (prefix_find(c, c->parent[b], tokens) != b && c->parent_generation[b] == (c->parent[b] >= 0 ? c->generation[c->parent[b]] : 0)) {
                snprintf(why, cap, "indexed block %d is not found under its own key", b);
                return why;
            }
        }
    }
    int held = 0;
    for (int b = 0; b < c->n_blocks; b++) held += count[b] > 0;
    if (held != c->held || c->peak_held < held) { snprintf(why, cap, "%d blocks held, the cache counts %d (peak %d)", held, c->held, c->peak_held); return why; }
    for (int t = 0; t < MODEL_TABLES; t++)
        for (int pos = 0; pos < model[t].len; pos++)
            for (int l = 0; l < c->n_layers; l++) {
                const float *k = (const float *)kv_load(c, l, &tables[t], pos, 0), *v = (const float *)kv_load(c, l, &tables[t], pos, 1);
                if (k[0] != model[t].value[pos] || v[3] != -model[t].value[pos]) {
                    snprintf(why, cap, "table %d position %d layer %d reads %g/%g, wrote %g", t, pos, l, k[0], v[3], model[t].value[pos]);
                    return why;
                }
            }
    return NULL;
}

static void test_block_allocator(void) {
    const Config p = {.dim = 8, .hidden_dim = 16, .n_layers = 2, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 10, .seq_len = 100, .head_size = 4}; /* kv_dim 4, 2 layers */
    KVCache c;
    BlockTable tables[MODEL_TABLES] = {{0}};
    TableModel model[MODEL_TABLES] = {{0}};
    char why[256];
    const char *broken = NULL;
    int op = 0;
    begin("block allocator: reference counts, free lists, copy on write, the prefix index and --keep rings against a model");
    kv_init(&c, &p, 37, 0, KV_F32); /* not a whole number of KV_RUN runs: the last run is padded */
    tables[0].slots = tables[1].slots = tables[2].slots = RING_SLOTS;
    tables[0].keep = tables[2].keep = 5;
    int drops = 0;
    float stamp = 1.0f;
    for (op = 0; op < 20000 && !broken; op++) {
        int t = rand_below(MODEL_TABLES), u = rand_below(MODEL_TABLES), kind = rand_below(10);
        /* blocks the tables could need at once stay within the pool: at
           most 5 blocks each, plus one for a copy on write */
        if (kind < 5 && (model[t].len < 5 * KV_BLOCK || tables[t].slots > 0)) { /* write the next position */
            int pos = model[t].len;
            if (tables[t].slots > 0 && pos == tables[t].slots) { /* a full ring drops its oldest position after the sinks */
                table_drop_oldest(&tables[t]);
                drops++;
                int keep = tables[t].keep;
                pos--;
                memmove(model[t].value + keep, model[t].value + keep + 1, (size_t)(pos - keep) * sizeof(float));
            } else {
                model[t].len++;
            }
            table_prepare_write(&c, &tables[t], pos);
            float k[4] = {stamp, 0, 0, 0}, v[4] = {0, 0, 0, -stamp};
            for (int l = 0; l < 2; l++) kv_store(&c, l, &tables[t], pos, k, v);
            model[t].value[pos] = stamp++;
        } else if (kind == 5 && t != u && tables[u].slots == tables[t].slots && tables[u].keep == tables[t].keep) {
            /* u becomes a copy of t (a beam reorder) */
            table_copy(&c, &tables[u], &tables[t]);
            tables[u].shift = tables[t].shift, tables[u].dropped = tables[t].dropped;
            model[u] = model[t];
        } else if (kind == 6 && (tables[t].slots == 0 || rand_below(40) == 0)) { /* t ends; a ring starts over */
            table_clear(&c, &tables[t]);
            tables[t].shift = 0, tables[t].dropped = 0;
            model[t].len = 0;
        } else if (kind == 7 && model[t].len >= KV_BLOCK && tables[t].dropped == 0) { /* index t's first full blocks (not after a drop, as the engine) */
            int tokens[KV_BLOCK], parent = -1;
            for (int i = 0; (i + 1) * KV_BLOCK <= model[t].len; i++) {
                for (int j = 0; j < KV_BLOCK; j++) tokens[j] = (int)model[t].value[i * KV_BLOCK + j];
                if (parent >= 0 && c.state[parent] == BLOCK_PLAIN) break;
                prefix_add(&c, tables[t].ids[i], parent, tokens, rand_below(2) ? BLOCK_READY : BLOCK_PENDING);
                if (c.state[tables[t].ids[i]] == BLOCK_PENDING) c.state[tables[t].ids[i]] = BLOCK_READY; /* computed */
                parent = tables[t].ids[i];
            }
        } else if (kind == 8 && model[u].len == 0 && model[t].len >= KV_BLOCK) { /* u finds t's first block by its tokens */
            int tokens[KV_BLOCK];
            for (int j = 0; j < KV_BLOCK; j++) tokens[j] = (int)model[t].value[j];
            int b = prefix_find(&c, -1, tokens);
            if (b >= 0 && b != tables[t].ids[0] && c.ref[b] > 0) {
                snprintf(why, sizeof(why), "prefix_find found block %d, not the holder's %d", b, tables[t].ids[0]);
                broken = why;
            } else if (b >= 0) {
                block_hold(&c, b);
                table_push(&tables[u], b);
                for (int j = 0; j < KV_BLOCK; j++) model[u].value[j] = (float)c.tokens[(size_t)b * KV_BLOCK + j]; /* what was indexed */
                model[u].len = KV_BLOCK;
            }
        }
        if (!broken) broken = allocator_broken(&c, tables, model, why, sizeof(why));
    }
    for (int t = 0; t < MODEL_TABLES; t++) table_free(&c, &tables[t]);
    int n_free = 0;
    for (int list = 0; list < 2; list++)
        for (int b = c.head[list]; b >= 0; b = c.next[b]) n_free++;
    expect(!broken, "after %d operations: %s", op, broken ? broken : "");
    expect(drops > 1000, "only %d positions dropped by the rings", drops);
    expect(n_free == c.n_blocks, "%d of %d blocks are free at the end (leaked blocks)", n_free, c.n_blocks);
    kv_free(&c);
    end();
}

/* The windowed layers' pool (run.c section 4, "Windowed layers") against
   the same kind of model: 3 layers, 0 and 1 windowed (window 24), 2 global.
   A table writes its next position and then leaves its window behind it, as
   a Sequence does; tables copy one another (beams), end, index their full
   blocks and start from the indexed prefix of another's positions or of an
   ended one's (engine_start's way, as far as window_resumable allows).
   After each operation: every position of
   a table reads back in the global layer, every position its window covers
   in the windowed ones; the pool's reference counts are the tables' holds
   of [wfirst, wend); partners are linked both ways; a free pool block is in
   the list of its state, linked only if kept for a prefix. */
#define WINDOW_TABLES 4
#define WINDOW_POSITIONS 80

static const char *window_pool_broken(const KVCache *c, BlockTable *tables, const TableModel *model, char *why, size_t cap) {
    const KVCache *w = c->win;
    int count[64] = {0}, in_list[64] = {0}, held = 0;
    for (int t = 0; t < WINDOW_TABLES; t++) {
        if (tables[t].wend > tables[t].n || tables[t].wfirst > tables[t].wend) {
            snprintf(why, cap, "table %d: window blocks %d..%d of %d", t, tables[t].wfirst, tables[t].wend, tables[t].n);
            return why;
        }
        for (int i = tables[t].wfirst; i < tables[t].wend; i++) {
            int p = c->partner[tables[t].ids[i]];
            if (p < 0 || w->partner[p] != tables[t].ids[i]) { snprintf(why, cap, "table %d block %d: partner %d not linked back", t, i, p); return why; }
            count[p]++;
        }
    }
    for (int list = 0; list < 2; list++)
        for (int p = w->head[list]; p >= 0; p = w->next[p]) {
            if (in_list[p]++) { snprintf(why, cap, "window block %d is twice in the free lists", p); return why; }
            if ((w->state[p] == BLOCK_READY) != list || (list == 1) != (w->partner[p] >= 0)) {
                snprintf(why, cap, "window block %d (state %d, partner %d) in free list %d", p, w->state[p], w->partner[p], list);
                return why;
            }
        }
    for (int p = 0; p < w->n_blocks; p++) {
        if (w->ref[p] != count[p]) { snprintf(why, cap, "window block %d: reference count %d, held %d times", p, w->ref[p], count[p]); return why; }
        if ((count[p] == 0) != (in_list[p] == 1)) { snprintf(why, cap, "window block %d: held %d times, in a free list %d times", p, count[p], in_list[p]); return why; }
        if (w->partner[p] >= 0 && c->partner[w->partner[p]] != p) { snprintf(why, cap, "window block %d: partner not linked back", p); return why; }
        held += count[p] > 0;
    }
    if (held != w->held) { snprintf(why, cap, "%d window blocks held, the pool counts %d", held, w->held); return why; }
    for (int t = 0; t < WINDOW_TABLES; t++)
        for (int pos = 0; pos < model[t].len; pos++)
            for (int l = pos / KV_BLOCK >= tables[t].wfirst ? 0 : 2; l < 3; l++) {
                const float *k = (const float *)kv_load(c, l, &tables[t], pos, 0), *v = (const float *)kv_load(c, l, &tables[t], pos, 1);
                if (k[0] != model[t].value[pos] || v[3] != -model[t].value[pos]) {
                    snprintf(why, cap, "table %d position %d layer %d reads %g/%g, wrote %g", t, pos, l, k[0], v[3], model[t].value[pos]);
                    return why;
                }
            }
    return NULL;
}

static void test_window_pool(void) {
    const Config p = {.dim = 8, .hidden_dim = 16, .n_layers = 3, .n_heads = 2, .n_kv_heads = 1, .vocab_size = 10, .seq_len = 100,
                      .head_size = 4, .window = 24, .window_period = 3};
    KVCache c;
    BlockTable tables[WINDOW_TABLES] = {{0}};
    TableModel model[WINDOW_TABLES] = {{0}}, ended[8] = {{0}};
    char why[256];
    const char *broken = NULL;
    int op = 0, left = 0, resumed = 0, cut = 0, n_ended = 0;
    begin("windowed layers' pool: partners, windows left behind, copies and prefixes against a model");
    /* 5 blocks a table and one for a copy on write; 3 window blocks a table
       (a window of 24 spans at most 3 blocks) and one */
    kv_init(&c, &p, 4 * 5 + 1, 4 * 3 + 1, KV_F32);
    expect(c.win && c.n_layers == 1 && c.win->n_layers == 2, "layers: %d here, %d windowed", c.n_layers, c.win ? c.win->n_layers : 0);
    float stamp = 1.0f;
    for (op = 0; op < 20000 && !broken && c.win; op++) {
        int t = rand_below(WINDOW_TABLES), u = rand_below(WINDOW_TABLES), kind = rand_below(10);
        if (kind < 5 && model[t].len < WINDOW_POSITIONS) { /* write the next position, then leave what the window has passed */
            int pos = model[t].len++, first = tables[t].wfirst;
            table_prepare_write(&c, &tables[t], pos);
            float k[4] = {stamp, 0, 0, 0}, v[4] = {0, 0, 0, -stamp};
            for (int l = 0; l < 3; l++) kv_store(&c, l, &tables[t], pos, k, v);
            model[t].value[pos] = stamp++;
            int i = pos / KV_BLOCK, parent = i > 0 ? tables[t].ids[i - 1] : -1;
            if (t != 3 && pos % KV_BLOCK == KV_BLOCK - 1 && (parent < 0 || c.state[parent] != BLOCK_PLAIN)) {
                int tokens[KV_BLOCK]; /* tables 0 to 2 index a block once full, as a Sequence does */
                for (int j = 0; j < KV_BLOCK; j++) tokens[j] = (int)model[t].value[i * KV_BLOCK + j];
                prefix_add(&c, tables[t].ids[i], parent, tokens, BLOCK_READY);
            }
            table_leave_window(&c, &tables[t], model[t].len);
            left += tables[t].wfirst - first;
        } else if (kind == 5 && t != u && rand_below(4) == 0) { /* u becomes a copy of t */
            table_copy(&c, &tables[u], &tables[t]);
            model[u] = model[t];
        } else if (kind == 6 && (model[t].len == WINDOW_POSITIONS || rand_below(10) == 0)) { /* t ends (the longer ones sooner) */
            table_clear(&c, &tables[t]);
            ended[n_ended++ % 8] = model[t];
            model[t].len = 0;
        } else if (kind == 7) { /* index t's full blocks */
            int tokens[KV_BLOCK], parent = -1;
            for (int i = 0; (i + 1) * KV_BLOCK <= model[t].len; i++) {
                for (int j = 0; j < KV_BLOCK; j++) tokens[j] = (int)model[t].value[i * KV_BLOCK + j];
                if (parent >= 0 && c.state[parent] == BLOCK_PLAIN) break;
                prefix_add(&c, tables[t].ids[i], parent, tokens, BLOCK_READY);
                parent = tables[t].ids[i];
            }
        } else if (kind == 8 && t != u && rand_below(3) == 0) { /* u starts again from the indexed prefix of t's positions, or of one
                                                                  of the 8 tables that ended last */
            int tokens[KV_BLOCK], matched[WINDOW_POSITIONS / KV_BLOCK], n = 0, parent = -1;
            const TableModel *from = rand_below(2) ? &ended[rand_below(8)] : &model[t];
            table_clear(&c, &tables[u]);
            for (; (n + 1) * KV_BLOCK <= from->len; n++) {
                for (int j = 0; j < KV_BLOCK; j++) tokens[j] = (int)from->value[n * KV_BLOCK + j];
                int b = prefix_find(&c, parent, tokens);
                if (b < 0) break;
                matched[n] = parent = b;
            }
            int found = n;
            n = window_resumable(&c, matched, n);
            cut += n < found;
            for (int i = 0; i < n; i++) {
                block_hold(&c, matched[i]);
                table_push(&tables[u], matched[i]);
            }
            tables[u].wfirst = window_first_block(&c, n * KV_BLOCK);
            tables[u].wend = n;
            for (int i = tables[u].wfirst; i < n; i++) block_hold(c.win, c.partner[matched[i]]);
            memcpy(model[u].value, from->value, (size_t)n * KV_BLOCK * sizeof(float));
            model[u].len = n * KV_BLOCK;
            resumed += n > 0;
        }
        if (!broken) broken = window_pool_broken(&c, tables, model, why, sizeof(why));
    }
    for (int t = 0; t < WINDOW_TABLES; t++) table_free(&c, &tables[t]);
    int n_free = 0;
    for (int list = 0; c.win && list < 2; list++)
        for (int b = c.win->head[list]; b >= 0; b = c.win->next[b]) n_free++;
    expect(!broken, "after %d operations: %s", op, broken ? broken : "");
    /* the counts follow the data generator's state, which the suites before
       this one leave differently in each build (114 to 190 blocks left
       behind seen): enough that windows are left, resumed and cut short
       many times over */
    expect(left > 50 && resumed > 10 && cut > 0, "only %d blocks left behind, %d prefixes resumed, %d cut short", left, resumed, cut);
    expect(c.win && n_free == c.win->n_blocks && c.win->held == 0, "%d of %d window blocks are free at the end (leaked blocks)", n_free,
           c.win ? c.win->n_blocks : 0);
    kv_free(&c);
    end();
}

/* ------------------------------------------------------------------------ */
/* Attention in tiles against attention row by row                          */
/* ------------------------------------------------------------------------ */

/* The attention of one row as it was computed before tiles: for each head,
   the scores of positions 0..pos by kv_dot, their softmax, then the values
   added by kv_axpy in position order, in chunks of ATTENTION_CHUNK
   positions, each from zero, whose sums are added in order; a --keep
   ring's stretches read with the turned queries (q_turned: 2 x dim).
   out: (dim). */
static void attention_row_reference(Transformer *t, const BlockTable *table, int layer, int pos, const float *q, const float *q_turned, float *out) {
    const Config *p = &t->config;
    const KVCache *c = &t->state.cache;
    const int head_size = p->dim / p->n_heads, kv_mul = p->n_heads / p->n_kv_heads;
    float *att = xcalloc((size_t)pos + 1 + ATTENTION_PAD, sizeof(float)); /* room for attention_softmax */
    float *sum = xcalloc((size_t)head_size, sizeof(float));
    for (int h = 0; h < p->n_heads; h++) {
        for (int tp = 0; tp <= pos; tp++) {
            int turn = kv_query_turn(table, tp);
            const float *query = turn == 0 ? q : q_turned + (size_t)(turn - 1) * p->dim;
            float score = kv_dot(c, kv_load(c, layer, table, tp, 0), h / kv_mul * head_size, query + h * head_size, head_size);
            att[tp] = attention_scale(score, t->state.att_scale);
        }
        attention_softmax(att, pos + 1, -INFINITY);
        memset(out + h * head_size, 0, head_size * sizeof(float));
        for (int c0 = 0; c0 <= pos; c0 += ATTENTION_CHUNK) {
            memset(sum, 0, head_size * sizeof(float));
            for (int tp = c0; tp <= pos && tp - c0 < ATTENTION_CHUNK; tp++)
                kv_axpy(c, kv_load(c, layer, table, tp, 1), h / kv_mul * head_size, att[tp], sum, head_size);
            for (int i = 0; i < head_size; i++) out[h * head_size + i] += sum[i];
        }
    }
    free(att);
    free(sum);
}

/* Random keys and values at positions 0..n-1 of table t, every layer. */
static void fill_cache(KVCache *c, const Config *p, BlockTable *t, int n) {
    const int kv_dim = p->dim / p->n_heads * p->n_kv_heads;
    float *k = xcalloc((size_t)kv_dim, sizeof(float)), *v = xcalloc((size_t)kv_dim, sizeof(float));
    for (int pos = 0; pos < n; pos++) {
        table_prepare_write(c, t, pos);
        for (int l = 0; l < p->n_layers; l++) {
            for (int i = 0; i < kv_dim; i++) {
                k[i] = rand_uniform(-2.0f, 2.0f);
                v[i] = rand_uniform(-1.0f, 1.0f);
            }
            kv_store(c, l, t, pos, k, v);
        }
    }
    free(k);
    free(v);
}

static void test_attention_tiles(void) {
    /* dim, n_heads, n_kv_heads: head sizes 64, 32, 16 and 8 (vector and
       plain loads), tiles of 32, 8, 4 and 48 rows (multi-head, grouped
       query heads, more heads than ATTENTION_SCORES), and 16 query heads of
       64 to one key head (latent attention's sharing: dot_rows_shared) */
    const int shapes[][3] = {{256, 4, 4}, {256, 8, 2}, {128, 8, 1}, {64, 8, 8}, {384, 48, 48}, {1024, 16, 1}};
    const char *type_names[] = {"f32", "f16", "q8_0"};
    for (int type = KV_F32; type <= KV_Q8_0; type++) {
        begin("attention (in tiles for f32): bit-identical to row by row, %s cache, with and without a --keep ring", type_names[type]);
        for (size_t sh = 0; sh < sizeof(shapes) / sizeof(shapes[0]) && !case_failed; sh++) {
            Config p = {.dim = shapes[sh][0], .hidden_dim = 8, .n_layers = 2, .n_heads = shapes[sh][1], .n_kv_heads = shapes[sh][2],
                        .vocab_size = 8, .seq_len = 300, .head_size = shapes[sh][0] / shapes[sh][1]};
            if (type == KV_Q8_0 && (p.dim / p.n_heads * p.n_kv_heads) % KV_GROUP != 0) continue;
            Transformer t;
            memset(&t, 0, sizeof(t));
            t.config = p;
            const int max_rows = 80, context = 300;
            alloc_run_state(&t.state, &p, max_rows, context, 3 * (context / KV_BLOCK + 1), 0, type);
            /* table 0: a long sequence whose chunk is attended; tables 1, 2:
               decoding sequences sharing the batch */
            BlockTable tables[3] = {{0}};
            const int filled[3] = {context, 40, 1};
            for (int i = 0; i < 3; i++) fill_cache(&t.state.cache, &p, &tables[i], filled[i]);
            /* chunks of n rows at positions start.., after two decoding rows or alone */
            /* (a lone row deep enough, {1, 250} and {1, 299}, is spread over threads by position: attention_lone_row) */
            const int chunks[][2] = {{1, 0}, {5, 0}, {31, 17}, {32, 100}, {33, 100}, {64, 0}, {64, 200}, {70, 229}, {3, 296}, {1, 250}, {1, 299}};
            for (size_t ch = 0; ch < 2 * sizeof(chunks) / sizeof(chunks[0]) && !case_failed; ch++) {
                /* the second time through, table 0 is a --keep ring: 4 sinks, turned by 37 */
                if (ch == sizeof(chunks) / sizeof(chunks[0])) {
                    tables[0].slots = context;
                    tables[0].keep = 4;
                    tables[0].shift = 37;
                }
                const int *chunk = chunks[ch % (sizeof(chunks) / sizeof(chunks[0]))];
                for (int decoding = 0; decoding <= 2 && !case_failed; decoding += 2) {
                    const int n = chunk[0], start = chunk[1], rows = n + decoding;
                    int pos[80], tokens[80] = {0};
                    const BlockTable *row_table[80];
                    for (int r = 0; r < decoding; r++) {
                        pos[r] = filled[1 + r] - 1;
                        row_table[r] = &tables[1 + r];
                    }
                    for (int r = 0; r < n; r++) {
                        pos[decoding + r] = start + r;
                        row_table[decoding + r] = &tables[0];
                    }
                    for (size_t i = 0; i < (size_t)rows * p.dim; i++) t.state.q[i] = rand_uniform(-1.0f, 1.0f);
                    for (size_t i = 0; i < (size_t)rows * 2 * p.dim; i++) t.state.q_turned[i] = rand_uniform(-1.0f, 1.0f);
                    Batch b = {rows, tokens, pos, row_table, NULL, 0};
                    const int layer = (int)(ch % 2);
                    attention(&t, &b, layer);
                    float *want = xcalloc((size_t)p.dim, sizeof(float));
                    for (int r = 0; r < rows && !case_failed; r++) {
                        attention_row_reference(&t, row_table[r], layer, pos[r], t.state.q + (size_t)r * p.dim,
                                                t.state.q_turned + (size_t)r * 2 * p.dim, want);
                        for (int i = 0; i < p.dim; i++)
                            if (!expect(memcmp(&want[i], &t.state.xb[(size_t)r * p.dim + i], sizeof(float)) == 0,
                                        "dim %d heads %d/%d, ring shift %d, %d decoding rows + %d rows from position %d: row %d (position %d) output %d is %.9g, row by row %.9g",
                                        p.dim, p.n_heads, p.n_kv_heads, tables[0].shift, decoding, n, start, r, pos[r], i, t.state.xb[(size_t)r * p.dim + i], want[i]))
                                break;
                    }
                    free(want);
                }
            }
            tables[0].shift = tables[0].keep = tables[0].slots = 0;
            for (int i = 0; i < 3; i++) table_free(&t.state.cache, &tables[i]);
            free_run_state(&t.state);
        }
        end();
    }
}

/* ------------------------------------------------------------------------ */
/* Forward pass on stories260K                                              */
/* ------------------------------------------------------------------------ */

static void test_forward(void) {
    const char *ckpt = model_path("stories260K.bin");
    if (!file_exists(ckpt) || !have_tok512) {
        skip("forward consistency (stories260K)", "stories260K.bin or tok512.bin not found in MODELS_DIR");
        return;
    }
    Transformer t;
    load_checkpoint(&t, ckpt);
    const Config *p = &t.config;
    begin("stories260K header");
    expect(p->dim == 64 && p->hidden_dim == 172 && p->n_layers == 5 && p->n_heads == 8 && p->n_kv_heads == 4 &&
               p->vocab_size == 512 && p->seq_len == 512 && t.version == 0,
           "config %d %d %d %d %d %d %d v%d", p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads, p->vocab_size, p->seq_len, t.version);
    end();

    alloc_run_state(&t.state, p, 64, p->seq_len, p->seq_len / KV_BLOCK + 2, 0, KV_F32);
    const int V = p->vocab_size;

    /* a prompt of 70 tokens: BOS + text, padded with repeats */
    int *text_ids;
    int n_text = enc(&tok512, "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends and her dog. One day", &text_ids);
    int tokens[70];
    for (int i = 0; i < 70; i++) tokens[i] = text_ids[i % n_text];
    tokens[0] = TOKEN_BOS;
    free(text_ids);

    /* token by token: the logits at every position */
    BlockTable table = {0};
    float *step = xcalloc(70 * (size_t)V, sizeof(float));
    for (int pos = 0; pos < 70; pos++) {
        float *l = forward_rows(&t, &table, tokens + pos, 1, pos, 0);
        memcpy(step + (size_t)pos * V, l, (size_t)V * sizeof(float));
    }

    begin("batched forward (blocks of 64 rows, paged cache) = token by token, bit for bit");
    {
        BlockTable other = {0};
        int worst_pos = -1;
        for (int start = 0; start < 70 && worst_pos < 0; start += 64) {
            int rows = 70 - start < 64 ? 70 - start : 64;
            float *l = forward_rows(&t, &other, tokens + start, rows, start, 1);
            for (int r = 0; r < rows && worst_pos < 0; r++)
                if (memcmp(l + (size_t)r * V, step + (size_t)(start + r) * V, (size_t)V * sizeof(float)) != 0) worst_pos = start + r;
        }
        expect(worst_pos < 0, "logits differ at position %d", worst_pos);
        table_free(&t.state.cache, &other);
    }
    end();

    begin("a prompt split at an arbitrary point = one batch");
    {
        BlockTable other = {0};
        float *l = forward_rows(&t, &other, tokens, 23, 0, 0);
        expect(memcmp(l, step + 22 * (size_t)V, (size_t)V * sizeof(float)) == 0, "logits after 23 tokens");
        l = forward_rows(&t, &other, tokens + 23, 47, 23, 0);
        expect(memcmp(l, step + 69 * (size_t)V, (size_t)V * sizeof(float)) == 0, "logits after 70 tokens");
        table_free(&t.state.cache, &other);
    }
    end();
    table_free(&t.state.cache, &table);

    begin("greedy generation starts as the publisher documents");
    {
        const char *want = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";
        char text[1024] = "";
        int token = TOKEN_BOS;
        for (int pos = 0; pos < 100 && strlen(text) < strlen(want); pos++) {
            float *l = forward_rows(&t, &table, &token, 1, pos, 0);
            int next = sample_argmax(l, V);
            if (next == TOKEN_BOS) break;
            const char *piece = decode(&tok512, token, next);
            if (piece_is_printable(&tok512, piece) && strlen(text) + strlen(piece) < sizeof(text)) strcat(text, piece);
            token = next;
        }
        expect(strncmp(text, want, strlen(want)) == 0, "got \"%s\"", show(text));
    }
    end();

    table_free(&t.state.cache, &table);
    free(step);
    free_run_state(&t.state);
    free_transformer(&t);
}

/* ------------------------------------------------------------------------ */
/* Malformed checkpoints and tokenizers                                     */
/* ------------------------------------------------------------------------ */

typedef struct { int32_t h[7]; } Header;

static uint64_t legacy_floats(const Header *c, int shared) {
    uint64_t dim = (uint64_t)c->h[0], hid = (uint64_t)c->h[1], L = (uint64_t)c->h[2];
    uint64_t hs = dim / (uint64_t)c->h[3], kv = hs * (uint64_t)c->h[4];
    uint64_t V = (uint64_t)(c->h[5] < 0 ? -c->h[5] : c->h[5]), seq = (uint64_t)c->h[6];
    return V * dim + 2 * L * dim + 2 * L * dim * dim + 2 * L * kv * dim + 3 * L * hid * dim + dim + seq * hs + (shared ? 0 : V * dim);
}

static uint64_t ak42_floats(const Header *c, int shared) {
    uint64_t dim = (uint64_t)c->h[0], hid = (uint64_t)c->h[1], L = (uint64_t)c->h[2];
    uint64_t hs = dim / (uint64_t)c->h[3], kv = hs * (uint64_t)c->h[4], V = (uint64_t)c->h[5];
    return 2 * L * dim + dim + V * dim + 2 * L * dim * dim + 2 * L * kv * dim + 3 * L * hid * dim + (shared ? 0 : V * dim);
}

/* Writes a checkpoint: the header, then n_floats small floats, cut to
   `keep` bytes when keep >= 0. */
static void write_checkpoint(const char *path, int ak42, int32_t version, const Header *c, int shared, uint64_t n_floats, long keep) {
    size_t header = ak42 ? 256 : 28;
    size_t size = header + (size_t)n_floats * 4;
    unsigned char *data = calloc(size, 1);
    if (ak42) {
        uint32_t magic = AK42_MAGIC;
        memcpy(data, &magic, 4);
        memcpy(data + 4, &version, 4);
        memcpy(data + 8, c->h, 28);
        data[36] = (unsigned char)shared;
    } else {
        memcpy(data, c->h, 28);
    }
    for (uint64_t i = 0; i < n_floats; i++) {
        float v = 0.02f * (float)((int)(i % 13) - 6) + (i % 5 == 0 ? 1.0f : 0.0f);
        memcpy(data + header + i * 4, &v, 4);
    }
    write_bytes(path, data, keep >= 0 && (size_t)keep < size ? (size_t)keep : size);
    free(data);
}

/* Loads a checkpoint and runs two tokens through it (child process). */
static void child_load_checkpoint(const void *arg) {
    Transformer t;
    load_checkpoint(&t, (const char *)arg);
    alloc_run_state(&t.state, &t.config, 4, t.config.seq_len, 1, 0, KV_F32);
    int tokens[2] = {1, 0};
    BlockTable table = {0};
    float *l = forward_rows(&t, &table, tokens, t.config.seq_len < 2 ? 1 : 2, 0, 0);
    for (int i = 0; i < t.config.vocab_size; i++)
        if (!isfinite(l[i])) { fprintf(stderr, "non-finite logit\n"); exit(9); }
    free_transformer(&t);
}

typedef struct {
    const char *path;
    int vocab_size;
} TokArg;

static void child_load_tokenizer(const void *arg) {
    const TokArg *a = arg;
    Tokenizer t;
    load_tokenizer(&t, a->path, a->vocab_size);
    free_tokenizer(&t);
}

static void test_bad_checkpoints(void) {
    const Header good = {{8, 16, 2, 2, 1, 10, 4}}; /* head size 4, kv_dim 4 */
    const char *f = tmp_path("model.bin");

    begin("loader accepts a valid tiny legacy checkpoint (shared classifier)");
    write_checkpoint(f, 0, 0, &good, 1, legacy_floats(&good, 1), -1);
    expect_child_exit(child_load_checkpoint, f, 0);
    end();
    begin("loader accepts a valid tiny legacy checkpoint (own classifier)");
    {
        Header c = good;
        c.h[5] = -10;
        write_checkpoint(f, 0, 0, &c, 0, legacy_floats(&c, 0), -1);
        expect_child_exit(child_load_checkpoint, f, 0);
        end();
        begin("loader rejects a legacy checkpoint missing its classifier");
        write_checkpoint(f, 0, 0, &c, 0, legacy_floats(&c, 1), -1);
        expect_child_exit(child_load_checkpoint, f, 1);
    }
    end();
    begin("loader accepts valid tiny ak42 version 1 checkpoints");
    write_checkpoint(f, 1, 1, &good, 1, ak42_floats(&good, 1), -1);
    expect_child_exit(child_load_checkpoint, f, 0);
    write_checkpoint(f, 1, 1, &good, 0, ak42_floats(&good, 0), -1);
    expect_child_exit(child_load_checkpoint, f, 0);
    end();
    begin("loader rejects an ak42 checkpoint missing its classifier");
    write_checkpoint(f, 1, 1, &good, 0, ak42_floats(&good, 1), -1);
    expect_child_exit(child_load_checkpoint, f, 1);
    end();

    static const char *names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    for (int ak42 = 0; ak42 <= 1; ak42++) {
        for (int field = 0; field < 7; field++) {
            const int32_t bad_values[] = {0, -1, INT32_MIN};
            for (int k = 0; k < 3; k++) {
                /* legacy: a negative vocab_size only means "own classifier" */
                if (!ak42 && field == 5 && bad_values[k] == -1) continue;
                Header c = good;
                c.h[field] = bad_values[k];
                begin("loader rejects %s header with %s = %d", ak42 ? "ak42" : "legacy", names[field], bad_values[k]);
                write_checkpoint(f, ak42, 1, &c, 1, 2048, -1);
                expect_child_exit(child_load_checkpoint, f, 1);
                end();
            }
        }
        struct { const char *what; Header c; } shapes[] = {
            {"dim not divisible by n_heads", {{8, 16, 2, 3, 1, 10, 4}}},
            {"n_heads not divisible by n_kv_heads", {{12, 16, 2, 6, 4, 10, 4}}},
            {"odd head size", {{6, 16, 2, 2, 1, 10, 4}}},
            {"n_kv_heads above n_heads", {{8, 16, 2, 2, 4, 10, 4}}},
            {"huge fields (file far too short)", {{2147483646, INT32_MAX, INT32_MAX, 1, 1, INT32_MAX, INT32_MAX}}},
            {"huge layer count", {{8, 16, 1 << 30, 2, 1, 10, 4}}},
            {"huge seq_len", {{8, 16, 2, 2, 1, 10, INT32_MAX}}},
        };
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            /* an ak42 file has no RoPE tables: a huge seq_len alone is not malformed */
            if (ak42 && s == 6) continue;
            begin("loader rejects %s header: %s", ak42 ? "ak42" : "legacy", shapes[s].what);
            /* the bad shapes come with as many floats as their (integer
               divided) sizes call for, so that only the header check can
               reject them; the huge ones with a few */
            uint64_t n = s < 4 ? (ak42 ? ak42_floats(&shapes[s].c, 1) : legacy_floats(&shapes[s].c, 1)) : 2048;
            write_checkpoint(f, ak42, 1, &shapes[s].c, 1, n, -1);
            expect_child_exit(child_load_checkpoint, f, 1);
            end();
        }
    }

    /* versions 2 (int8) and 3 (4-bit) are valid formats, read in their own tests */
    const int32_t versions[] = {0, 4, -1, 256, INT32_MIN};
    for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++) {
        begin("loader rejects ak42 version %d", versions[v]);
        write_checkpoint(f, 1, versions[v], &good, 1, ak42_floats(&good, 1), -1);
        expect_child_exit(child_load_checkpoint, f, 1);
        end();
    }

    /* truncation: inside the header, right after it, inside the weights, one
       byte short */
    for (int ak42 = 0; ak42 <= 1; ak42++) {
        uint64_t n = ak42 ? ak42_floats(&good, 1) : legacy_floats(&good, 1);
        long full = (long)(ak42 ? 256 : 28) + (long)n * 4;
        const long cuts[] = {1, 4, 27, 28, 100, 255, 256, 300, full / 2, full - 4, full - 1};
        for (size_t k = 0; k < sizeof(cuts) / sizeof(cuts[0]); k++) {
            if (cuts[k] >= full) continue;
            begin("loader rejects %s checkpoint truncated to %ld of %ld bytes", ak42 ? "ak42" : "legacy", cuts[k], full);
            write_checkpoint(f, ak42, 1, &good, 1, n, cuts[k]);
            expect_child_exit(child_load_checkpoint, f, 1);
            end();
        }
    }

    begin("loader rejects an empty file");
    write_bytes(tmp_path("empty.bin"), "", 0);
    expect_child_exit(child_load_checkpoint, tmp_path("empty.bin"), 1);
    end();
    begin("loader rejects a directory");
    expect_child_exit(child_load_checkpoint, scratch, 1);
    end();
    begin("loader rejects a missing file");
    expect_child_exit(child_load_checkpoint, tmp_path("no-such-file.bin"), 1);
    end();
    unlink(f);
}

static void test_bad_tokenizers(void) {
    Buf *b = malloc(sizeof(Buf)), *w = malloc(sizeof(Buf));
    const char *f = tmp_path("tok.bin");
    make_small_tokenizer(b, -10, -20);
    TokArg arg = {f, 10};

    begin("tokenizer loader accepts the small tokenizer");
    write_bytes(f, b->data, b->n);
    expect_child_exit(child_load_tokenizer, &arg, 0);
    end();

    /* truncated at every byte */
    begin("tokenizer loader rejects every truncation");
    for (size_t keep = 1; keep < b->n && !case_failed; keep++) {
        write_bytes(f, b->data, keep);
        expect_child_exit(child_load_tokenizer, &arg, 1);
        if (case_failed) snprintf(case_why + strlen(case_why), sizeof(case_why) - strlen(case_why), " (kept %zu bytes)", keep);
    }
    end();

    struct { const char *what; int32_t max_len; int token; int32_t len; } bad[] = {
        {"max_token_length 0", 0, -1, 0},
        {"negative max_token_length", -5, -1, 0},
        {"huge max_token_length", INT32_MAX, -1, 0},
        {"negative token length", 6, 4, -1},
        {"token length INT32_MIN", 6, 4, INT32_MIN},
        {"token length past the end of file", 6, 9, 5},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        begin("tokenizer loader rejects %s", bad[k].what);
        memcpy(w, b, sizeof(Buf));
        memcpy(w->data, &bad[k].max_len, 4);
        if (bad[k].token >= 0) {
            /* find the length field of that token */
            size_t at = 4;
            for (int i = 0; i < bad[k].token; i++) { int32_t len; memcpy(&len, w->data + at + 4, 4); at += 8 + (size_t)len; }
            memcpy(w->data + at + 4, &bad[k].len, 4);
        }
        write_bytes(f, w->data, w->n);
        expect_child_exit(child_load_tokenizer, &arg, 1);
        end();
    }
    begin("tokenizer loader rejects a token longer than max_token_length");
    /* the 7-byte token is really there: only the length check can catch it */
    make_small_tokenizer_with(w, -10, -20, "abcdefg");
    write_bytes(f, w->data, w->n);
    expect_child_exit(child_load_tokenizer, &arg, 1);
    end();
    begin("tokenizer loader rejects a file with more tokens than the model");
    write_bytes(f, b->data, b->n);
    arg.vocab_size = 9;
    expect_child_exit(child_load_tokenizer, &arg, 1);
    end();
    arg.vocab_size = 11;
    begin("tokenizer loader rejects a file with fewer tokens than the model");
    expect_child_exit(child_load_tokenizer, &arg, 1);
    end();
    begin("tokenizer loader rejects empty, directory, missing");
    write_bytes(f, "", 0);
    arg.vocab_size = 10;
    expect_child_exit(child_load_tokenizer, &arg, 1);
    arg.path = scratch;
    expect_child_exit(child_load_tokenizer, &arg, 1);
    arg.path = tmp_path("no-such-tokenizer.bin");
    expect_child_exit(child_load_tokenizer, &arg, 1);
    end();

    if (file_exists(model_path("tok512.bin"))) {
        begin("tok512.bin for a model of vocab 600 is truncated");
        TokArg a = {model_path("tok512.bin"), 600};
        expect_child_exit(child_load_tokenizer, &a, 1);
        end();
    } else {
        skip("tok512.bin for a model of vocab 600 is truncated", "tok512.bin not found in MODELS_DIR");
    }
    if (file_exists(model_path("tokenizer.bin"))) {
        begin("tokenizer.bin for a model of vocab 512 has too many tokens");
        TokArg a = {model_path("tokenizer.bin"), 512};
        expect_child_exit(child_load_tokenizer, &a, 1);
        end();
    } else {
        skip("tokenizer.bin for a model of vocab 512 has too many tokens", "tokenizer.bin not found in MODELS_DIR");
    }
    unlink(f);
    free(b);
    free(w);
}

/* ------------------------------------------------------------------------ */
/* Command-line helpers                                                     */
/* ------------------------------------------------------------------------ */

static void child_json_string(const void *arg) { print_json_string((const char *)arg); }

static void test_cli_helpers(void) {
    begin("parse_options reads every flag");
    {
        char *argv[] = {"run", "m.bin", "-t", "0.5", "-p", "0.8", "-s", "7", "-n", "20", "-i", "hi there", "-z", "tok.bin",
                        "-m", "chat", "-y", "sys", "-f", "json", "-T", "2", NULL};
        Options o = parse_options(22, argv);
        expect(strcmp(o.checkpoint, "m.bin") == 0, "checkpoint");
        expect(o.temperature == 0.5f && o.topp == 0.8f && o.seed == 7 && o.steps == 20, "numbers");
        expect(strcmp(o.prompt, "hi there") == 0 && strcmp(o.tokenizer, "tok.bin") == 0, "strings");
        expect(strcmp(o.mode, "chat") == 0 && strcmp(o.system_prompt, "sys") == 0 && o.format == FORMAT_JSON && o.threads == 2, "mode, system, format, threads");
    }
    {
        char *argv[] = {"run", "m.bin", NULL};
        Options o = parse_options(2, argv);
        expect(o.temperature == 1.0f && o.topp == 0.9f && o.steps == 256 && o.seed == 0 && o.prompt == NULL &&
                   o.tokenizer == NULL /* a GGUF model's own, else tokenizer.bin */ && strcmp(o.mode, "generate") == 0 && o.format == FORMAT_TEXT,
               "defaults");
    }
    end();

    begin("render_chat_turn uses the Llama 2 template");
    {
        char *a = render_chat_turn("Be brief.", "Hi");
        expect(strcmp(a, "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]") == 0, "with system: %s", show(a));
        char *b = render_chat_turn(NULL, "Hi");
        expect(strcmp(b, "[INST] Hi [/INST]") == 0, "without: %s", show(b));
        char *c = render_chat_turn("", "Hi");
        expect(strcmp(c, "[INST] Hi [/INST]") == 0, "empty system: %s", show(c));
        free(a); free(b); free(c);
    }
    end();

    begin("print_json_string escapes and replaces invalid UTF-8");
    {
        char err[256], out[256];
        int status = run_child(child_json_string, "a\"b\\\n\t\x01\xff\xc3\xa9z", err, sizeof(err), out, sizeof(out));
        expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status");
        expect(strcmp(out, "\"a\\\"b\\\\\\n\\t\\u0001\\ufffd\xc3\xa9z\"") == 0, "got %s", show(out));
    }
    end();

    if (have_tok512) {
        begin("encode_prompt refuses prompts that do not fit");
        int n = -1;
        int *ids = encode_prompt(&tok512, "Once upon a time", 100, &n);
        expect(ids != NULL && n > 3, "fits in 100");
        free(ids);
        ids = encode_prompt(&tok512, "Once upon a time", 3, &n);
        expect(ids == NULL, "does not fit in 3");
        free(ids);
        end();
    } else {
        skip("encode_prompt refuses prompts that do not fit", "tok512.bin not found in MODELS_DIR");
    }
}

/* ------------------------------------------------------------------------ */
/* Files of the wrong kind, and the conversation of a chat                  */
/* ------------------------------------------------------------------------ */

static void test_file_kinds(void) {
    begin("foreign_format names zip, pickle and safetensors by content, and not GGUF (read by section 2.1)");
    {
        unsigned char gguf[16] = "GGUF\3", zip[16] = "PK\3\4", pickle[16] = {0x80, 2, 0x8a, 10};
        unsigned char st[32] = {0};
        st[0] = 20; /* header length 20, then '{' */
        st[8] = '{';
        expect(foreign_format(gguf, sizeof(gguf)) == NULL, "GGUF");
        expect(foreign_format(zip, sizeof(zip)) && strstr(foreign_format(zip, sizeof(zip)), "zip"), "zip");
        expect(foreign_format(pickle, sizeof(pickle)) && strstr(foreign_format(pickle, sizeof(pickle)), "pickle"), "pickle");
        expect(foreign_format(st, sizeof(st)) && strstr(foreign_format(st, sizeof(st)), "safetensors"), "safetensors");
        st[0] = 40; /* a header longer than the file */
        expect(foreign_format(st, sizeof(st)) == NULL, "safetensors header past the end");
        /* a legacy header with dim 640 starts with 0x80 0x02 0x00: not a pickle */
        int32_t legacy[7] = {640, 1712, 2, 10, 10, 512, 256};
        expect(foreign_format((const unsigned char *)legacy, sizeof(legacy)) == NULL, "dim 640 taken for a pickle");
    }
    end();

    begin("looks_like_checkpoint: the shapes account for the file's size");
    {
        /* dim 8, hidden 16, 1 layer, 2 heads, 2 kv heads, vocab 260, seq 32 */
        int32_t h[7] = {8, 16, 1, 2, 2, 260, 32};
        size_t floats = 260 * 8 + 2 * 8 + 8 * (2 * 8 + 2 * 8) + 3 * 16 * 8 + 8 + 32 * 4;
        size_t size = 28 + 4 * floats;
        unsigned char *file = calloc(size + 4 * 260 * 8 + 4, 1);
        memcpy(file, h, sizeof(h));
        expect(looks_like_checkpoint(file, size), "shared classifier");
        expect(looks_like_checkpoint(file, size + 4 * 260 * 8), "separate classifier");
        expect(!looks_like_checkpoint(file, size + 4), "4 bytes more");
        expect(!looks_like_tokenizer(file, size), "taken for a tokenizer");
        uint32_t magic = AK42_MAGIC;
        memcpy(file, &magic, 4);
        expect(looks_like_checkpoint(file, 256), "ak42");
        free(file);
    }
    end();

    begin("looks_like_tokenizer: entries to the end of the file");
    {
        Buf *b = malloc(sizeof(Buf));
        make_small_tokenizer(b, -10, -20);
        expect(looks_like_tokenizer(b->data, b->n), "the small tokenizer");
        expect(!looks_like_tokenizer(b->data, b->n - 1), "one byte short");
        expect(!looks_like_checkpoint(b->data, b->n), "taken for a checkpoint");
        free(b);
    }
    end();
}

/* A tokenizer of the 3 special tokens and 256 byte tokens only: every byte
   of a text is one token (no dummy prefix: " " is not a piece), so a turn
   of rendered text T is 1 + strlen(T) tokens. */
static void load_byte_tokenizer(Tokenizer *t) {
    Buf *b = malloc(sizeof(Buf));
    b->n = 0;
    put_i32(b, 6);
    put_piece(b, 0, "<unk>");
    put_piece(b, 0, "\n<s>\n");
    put_piece(b, 0, "\n</s>\n");
    for (int i = 0; i < 256; i++) {
        char piece[8];
        snprintf(piece, sizeof(piece), "<0x%02X>", i);
        put_piece(b, 0, piece);
    }
    write_bytes(tmp_path("byte_tok.bin"), b->data, b->n);
    load_tokenizer(t, tmp_path("byte_tok.bin"), 259);
    free(b);
}

static int rendered_length(const char *system, const char *user) {
    char *text = render_chat_turn(system, user);
    int n = 1 + (int)strlen(text);
    free(text);
    return n;
}

/* A ThinkSink for test_think_split: the answer in ctx[0], the reasoning in ctx[1]. */
static void collect_think(void *ctx, int reasoning, const char *text, size_t n) { buf_add((ByteBuf *)ctx + reasoning, text, n); }

/* ThinkSplit on replies in Qwen3's form (<think>reasoning</think>, blank
   lines, the answer), fed in pieces of every size: what goes to
   reasoning_content and content, as llama-server and vLLM split it. */
static void test_think_split(void) {
    static const struct { const char *reply, *reasoning, *answer; } cases[] = {
        {"<think>\nabc\n</think>\n\nHello <b>world</b>", "\nabc\n", "Hello <b>world</b>"},
        {"\n<think>r</think>a", "r", "a"},
        {"Just an answer <think>x</think>", "", "Just an answer <think>x</think>"},
        {"<think>unfinished </thi", "unfinished </thi", ""},
        {"<thi", "", "<thi"},
        {"<think></think>", "", ""},
        /* Harmony (gpt-oss): the analysis channel, then the final one */
        {"<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi <|end|> there", "Think.", "Hi <|end|> there"},
        {"<|channel|>final<|message|>Only the answer", "", "Only the answer"},
        {"<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
         "<|start|>assistant<|channel|>final<|message|>c", "ab", "c"},
        {"<|channel|>analysis<|message|>cut short <|en", "cut short <|en", ""},
        {"<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary<|message|>y", "x",
         "<|start|>assistant<|channel|>commentary<|message|>y"},
        {"<|chan", "", "<|chan"},
    };
    begin("ThinkSplit: the reasoning and the answer of a reply (Qwen3's, Harmony's), whatever its pieces");
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        size_t len = strlen(cases[k].reply);
        for (size_t step = 1; step <= len; step++) {
            ByteBuf parts[2] = {{0}, {0}};
            ThinkSplit split = {THINK_START, {NULL, 0, 0}, 0};
            for (size_t at = 0; at < len; at += step)
                think_feed(&split, cases[k].reply + at, at + step <= len ? step : len - at, collect_think, parts);
            think_finish(&split, collect_think, parts);
            const char *answer = parts[0].data ? parts[0].data : "", *reasoning = parts[1].data ? parts[1].data : "";
            expect(strcmp(answer, cases[k].answer) == 0 && strcmp(reasoning, cases[k].reasoning) == 0,
                   "%s in pieces of %zu: reasoning '%s', answer '%s'", cases[k].reply, step, reasoning, answer);
            buf_free(&parts[0]);
            buf_free(&parts[1]);
        }
    }
    end();
}

/* buf_reply_message (11.1, shared by the server, --batch and -m chat
   --tools: 11.2): a reply's message members and finish reason, from its
   text, how it ended and how it makes calls. */
static void test_reply_message(void) {
    static const struct { const char *text, *stop; int mode, thinks; const char *want, *finish; } cases[] = {
        {"Hi<tool_call>\n[{\"name\":\"f\",\"arguments\":{\"a\":1}},{\"arguments\":{},\"name\":\"g\"}]", "json", CALLS_AT_MARKER, 0,
         "\"content\":\"Hi\",\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
         "\"{\\\"a\\\":1}\"}},{\"id\":\"call_7_1\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{}\"}}]", "tool_calls"},
        {"{\"name\":\"f\",\"arguments\":{}}", "json", CALLS_PREFILLED, 0,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]",
         "tool_calls"},
        /* a call cut short: all of it is content */
        {"Hi<tool_call>\n{\"name\":\"f\",\"argu", "length", CALLS_AT_MARKER, 0, "\"content\":\"Hi<tool_call>\\n{\\\"name\\\":\\\"f\\\",\\\"argu\"", "length"},
        {"<think>r</think>\n\nA", "eos", CALLS_NONE, 1, "\"content\":\"A\",\"reasoning_content\":\"r\"", "stop"},
        {"<think>r</think>A", "eos", CALLS_NONE, 0, "\"content\":\"<think>r</think>A\"", "stop"},
        /* Llama 3.1's "auto": a reply that is one call object (read as any JSON: white space anywhere) */
        {"<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": [1, 2]}}", "eos", CALLS_LEADING, 0,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
         "\"{\\\"a\\\": [1, 2]}\"}}]", "tool_calls"},
        {" \n{\"name\":\"g\" ,\n \"parameters\":{} } ", "eos", CALLS_LEADING, 0,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{}\"}}]",
         "tool_calls"},
        {"{\"name\": \"f\", \"parameters\": {}} then", "eos", CALLS_LEADING, 0, "\"content\":\"{\\\"name\\\": \\\"f\\\", \\\"parameters\\\": {}} then\"", "stop"},
        {"{\"name\": \"f\", \"parameters\": 3}", "eos", CALLS_LEADING, 0, "\"content\":\"{\\\"name\\\": \\\"f\\\", \\\"parameters\\\": 3}\"", "stop"},
        {"{\"name\": \"f\", \"param", "length", CALLS_LEADING, 0, "\"content\":\"{\\\"name\\\": \\\"f\\\", \\\"param\"", "length"},
        {"Hello", "eos", CALLS_LEADING, 0, "\"content\":\"Hello\"", "stop"},
        /* Mistral's: [TOOL_CALLS]NAME[ARGS]ARGUMENTS each, after the content (the text as prefilled_reply makes it) */
        {"[TOOL_CALLS]f[ARGS]{\"a\":1}", "json", CALLS_MISTRAL_PREFILLED, 0,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
         "\"{\\\"a\\\":1}\"}}]", "tool_calls"},
        {"Hi [TOOL_CALLS]f[ARGS]{\"a\": 1} [TOOL_CALLS]g[CALL_ID]abcdefghi[ARGS]{}\n", "eos", CALLS_MISTRAL, 0,
         "\"content\":\"Hi \",\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":"
         "\"{\\\"a\\\": 1}\"}},{\"id\":\"call_7_1\",\"type\":\"function\",\"function\":{\"name\":\"g\",\"arguments\":\"{}\"}}]", "tool_calls"},
        {"[TOOL_CALLS]f[ARGS]{\"a\":", "length", CALLS_MISTRAL_PREFILLED, 0, "\"content\":\"[TOOL_CALLS]f[ARGS]{\\\"a\\\":\"", "length"},
        {"[TOOL_CALLS]f[ARGS]{} then", "eos", CALLS_MISTRAL, 0, "\"content\":\"[TOOL_CALLS]f[ARGS]{} then\"", "stop"},
        {"[TOOL_CALLS][ARGS]{}", "eos", CALLS_MISTRAL, 0, "\"content\":\"[TOOL_CALLS][ARGS]{}\"", "stop"},
        {"[TOOL_CALLS]f[ARGS]3", "eos", CALLS_MISTRAL, 0, "\"content\":\"[TOOL_CALLS]f[ARGS]3\"", "stop"},
    };
    begin("buf_reply_message: a reply's content, reasoning and calls (server, --batch, chat --tools)");
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        Hypothesis h = {NULL, 0, 0.0, cases[k].stop, NULL};
        char *text = strdup(cases[k].text);
        ByteBuf b = {0};
        int n = -1;
        const char *finish = buf_reply_message(&b, text, &h, cases[k].mode, cases[k].thinks, "call_7_", &n);
        expect(strcmp(b.data, cases[k].want) == 0 && strcmp(finish, cases[k].finish) == 0 && (n > 0) == (strcmp(finish, "tool_calls") == 0),
               "case %zu: %s (%s, %d calls), not %s (%s)", k, b.data, finish, n, cases[k].want, cases[k].finish);
        buf_free(&b);
        free(text);
    }
    /* Harmony's (11.1): the call (after the text the prompt wrote, reply_prefill's), its message's header and the reasoning before it apart */
    static const struct { const char *text, *stop; int mode; const char *want, *finish; } harmony[] = {
        {"<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}",
         "json", CALLS_HARMONY_AUTO, "\"content\":null,\"reasoning_content\":\"think\",\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":"
         "{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}]", "tool_calls"},
        {"<|channel|>commentary to=functions.f<|channel|>commentary json<|message|>{}", "json", CALLS_HARMONY_AUTO,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]", "tool_calls"},
        {"<|channel|>commentary to=functions." "get_time <|constrain|>json<|message|>{}", "json", CALLS_HARMONY,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"arguments\":\"{}\"}}]", "tool_calls"},
        {"<|channel|>commentary to=functions.f <|constrain|>json<|message|>" "{\"a\":1}", "json", CALLS_HARMONY,
         "\"content\":null,\"tool_calls\":[{\"id\":\"call_7_0\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}}]", "tool_calls"},
        {"<|channel|>analysis<|message|>t<|end|><|start|>assistant<|channel|>final<|message|>Hi", "eos", CALLS_HARMONY_AUTO,
         "\"content\":\"Hi\",\"reasoning_content\":\"t\"", "stop"},
        {"<|channel|>commentary to=functions." "get_ti", "length", CALLS_HARMONY, "\"content\":\"<|channel|>commentary to=functions.get_ti\"", "length"},
    };
    for (size_t k = 0; k < sizeof(harmony) / sizeof(harmony[0]); k++) {
        Hypothesis h = {NULL, 0, 0.0, harmony[k].stop, NULL};
        char *text = strdup(harmony[k].text);
        ByteBuf b = {0};
        int n = -1;
        const char *finish = buf_reply_message(&b, text, &h, harmony[k].mode, 1, "call_7_", &n);
        expect(strcmp(b.data, harmony[k].want) == 0 && strcmp(finish, harmony[k].finish) == 0, "harmony case %zu: %s (%s), not %s (%s)", k,
               b.data, finish, harmony[k].want, harmony[k].finish);
        buf_free(&b);
        free(text);
    }
    ByteBuf b = {0};
    buf_tojson_indent(&b, "{\"a\": [], \"b\": {\"c\": [1, 2], \"e\": {}}, \"d\": \"x, y{\\\"\"}");
    expect(b.data && strcmp(b.data, "{\n    \"a\": [],\n    \"b\": {\n        \"c\": [\n            1,\n            2\n        ],\n        \"e\": {}\n    },\n"
                                 "    \"d\": \"x, y{\\\"\"\n}") == 0, "tojson(indent=4): %s", b.data);
    buf_free(&b);
    char prefix[16], other[16];
    calls_id_prefix(prefix, sizeof(prefix), "call_7", CALLS_AT_MARKER);
    expect(strcmp(prefix, "call_7_") == 0, "Hermes's id prefix: %s", prefix);
    calls_id_prefix(prefix, sizeof(prefix), "call_7", CALLS_MISTRAL);
    calls_id_prefix(other, sizeof(other), "call_8", CALLS_MISTRAL_PREFILLED);
    int alnum = strlen(prefix) == 8;
    for (int i = 0; prefix[i]; i++) alnum &= isalnum((unsigned char)prefix[i]) != 0;
    expect(alnum && strlen(other) == 8 && strcmp(prefix, other) != 0, "Mistral's id prefixes (8 letters and digits, then the call's digit): %s %s", prefix, other);
    ToolSet ts = {0};
    set_tool_choice(&ts, "required");
    expect(ts.choice == TOOLS_REQUIRED && calls_mode(&ts) == CALLS_NONE, "required without tools: %d", ts.choice);
    set_tool_choice(&ts, "get_weather");
    expect(ts.choice == TOOLS_NAMED && strcmp(ts.named, "get_weather") == 0, "a name: %d", ts.choice);
    set_tool_choice(&ts, NULL);
    expect(ts.choice == TOOLS_AUTO, "NULL is auto: %d", ts.choice);
    free_tools(&ts);
    end();
}

static void test_conversation(void) {
    Tokenizer tok;
    load_byte_tokenizer(&tok);
    const char *sys = "Be kind.";
    const int reply[5] = {40, 41, 42, 43, 44};
    Conversation c = {sys, NULL, 0, 200};

    begin("conversation: the first turn takes the system prompt, later ones do not");
    Turn a = conversation_new_turn(&c, &tok, "first");
    expect(a.n_prompt == rendered_length(sys, "first") && a.tokens[0] == TOKEN_BOS, "first turn %d tokens", a.n_prompt);
    turn_set_reply(&a, reply, 5, TOKEN_EOS);
    expect(a.n_tokens == a.n_prompt + 6 && a.tokens[a.n_tokens - 1] == TOKEN_EOS && a.tokens[a.n_prompt] == 40, "reply and EOS");
    conversation_append(&c, a);
    Turn b = conversation_new_turn(&c, &tok, "second message");
    expect(b.n_prompt == rendered_length(NULL, "second message"), "second turn %d tokens", b.n_prompt);
    int dropped = conversation_make_room(&c, &tok, &b, 10);
    expect(dropped == 0 && c.n_turns == 1, "room enough: dropped %d", dropped);
    int last[4];
    expect(conversation_tokens(&c, conversation_length(&c) - 2, last) == 2 && last[0] == 44 && last[1] == TOKEN_EOS,
           "the conversation ends with the reply and its end token");
    turn_set_reply(&b, reply, 3, TOKEN_EOS);
    conversation_append(&c, b);
    end();

    begin("conversation: a message that does not fit drops the oldest turns");
    {
        int before = conversation_length(&c);
        Turn m = conversation_new_turn(&c, &tok, "third one, a little longer than the others");
        int need = m.n_prompt;
        dropped = conversation_make_room(&c, &tok, &m, 200 - before - need + 1); /* one position short */
        expect(dropped == 1 && c.n_turns == 1, "dropped %d, %d kept", dropped, c.n_turns);
        /* the kept turn is rendered again, now with the system prompt */
        Turn *k = &c.turns[0];
        expect(k->n_prompt == rendered_length(sys, "second message"), "kept turn %d tokens", k->n_prompt);
        expect(k->n_tokens == k->n_prompt + 4 && k->tokens[k->n_prompt] == 40 && k->tokens[k->n_tokens - 1] == TOKEN_EOS,
               "its reply follows");
        int *all = calloc((size_t)conversation_length(&c), sizeof(int));
        char *text = render_chat_turn(sys, "second message");
        int n = conversation_tokens(&c, 0, all);
        int same = n == conversation_length(&c) && all[0] == TOKEN_BOS;
        for (size_t i = 0; same && i < strlen(text); i++) same = all[1 + i] == (unsigned char)text[i] + 3;
        expect(same, "the tokens to read again are the re-rendered turn");
        free(all);
        free(text);
        free_turn(&m);
    }
    end();

    begin("conversation: when every old turn goes, the message takes the system prompt");
    {
        Turn m = conversation_new_turn(&c, &tok, "x");
        dropped = conversation_make_room(&c, &tok, &m, 199 - m.n_prompt);
        expect(dropped == 1 && c.n_turns == 0, "dropped %d, %d kept", dropped, c.n_turns);
        expect(m.n_prompt == rendered_length(sys, "x"), "message %d tokens", m.n_prompt);
        conversation_append(&c, m);
    }
    end();

    begin("conversation: a message longer than the context drops nothing");
    {
        char long_text[400];
        memset(long_text, 'y', sizeof(long_text) - 1);
        long_text[sizeof(long_text) - 1] = '\0';
        Turn m = conversation_new_turn(&c, &tok, long_text);
        int kept = c.n_turns, length = conversation_length(&c);
        expect(conversation_make_room(&c, &tok, &m, 10) == -1, "not refused");
        expect(c.n_turns == kept && conversation_length(&c) == length, "the conversation changed");
        free_turn(&m);
    }
    end();

    begin("reply_end_token: the one a reply ended with, EOS for one cut short");
    {
        int t3[3] = {5, 6, 7};
        Hypothesis cut = {0}, bos = {0}, stopped = {0};
        cut.tokens = bos.tokens = stopped.tokens = t3;
        cut.stop = "length", bos.stop = "bos", stopped.stop = "interrupted";
        Tokenizer llama2 = {.bos = TOKEN_BOS, .end_of_turn = TOKEN_EOS};
        expect(reply_end_token(&llama2, &cut) == TOKEN_EOS && reply_end_token(&llama2, &bos) == TOKEN_BOS &&
                   reply_end_token(&llama2, &stopped) == TOKEN_EOS,
               "end tokens");
    }
    end();
    free_conversation(&c);
    free_tokenizer(&tok);
}

static void test_context_positions(void) {
    begin("context_positions: 256 for generate, the context for chat and --max-new-tokens, else -n");
    {
        char *gen[] = {"run", "m.bin", NULL}, *chat_[] = {"run", "m.bin", "-m", "chat", NULL};
        char *chat_n[] = {"run", "m.bin", "-m", "chat", "-n", "100", NULL}, *maxnew[] = {"run", "m.bin", "--max-new-tokens", "5", NULL};
        Options o = parse_options(2, gen);
        expect(context_positions(&o, 512) == 256 && context_positions(&o, 100) == 100, "generate");
        o = parse_options(4, chat_);
        expect(context_positions(&o, 512) == 512, "chat");
        o = parse_options(6, chat_n);
        expect(context_positions(&o, 512) == 100, "chat -n 100");
        o = parse_options(4, maxnew);
        expect(o.max_new_tokens == 5 && context_positions(&o, 512) == 512, "--max-new-tokens 5");
        Decoding d = {.temperature = 1.0f, .topp = 0.9f, .seed = 1, .n_return = 1, .format = FORMAT_TEXT, .max_new_tokens = 5};
        expect(cap_new_tokens(&d, 3) == 3 && cap_new_tokens(&d, 30) == 5, "cap_new_tokens");
    }
    end();
}

/* ------------------------------------------------------------------------ */

static void remove_scratch(void) {
    DIR *d = opendir(scratch);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) unlink(tmp_path(e->d_name));
    closedir(d);
    rmdir(scratch);
}

/* ------------------------------------------------------------------------ */
/* Generation controls: processors, truncated sampling, stop strings        */
/* ------------------------------------------------------------------------ */

/* Feeds pieces to a StopMatcher and returns the concatenated safe text. */
static void feed_all(StopMatcher *m, const char *const *pieces, int n, char *out, size_t cap) {
    out[0] = '\0';
    for (int i = 0; i < n && !m->matched; i++) {
        size_t n_safe;
        const char *safe = stop_feed(m, pieces[i], &n_safe);
        strncat(out, safe, n_safe < cap - strlen(out) - 1 ? n_safe : cap - strlen(out) - 1);
    }
}

static void test_controls(void) {
    const Tokenizer llama2_ends = {.bos = TOKEN_BOS, .end = {TOKEN_EOS}, .n_end = 1};
    begin("repetition penalty: CTRL rule, once per id, prompt included");
    float s[6] = {2.0f, -2.0f, 0.5f, -0.5f, 4.0f, 0.0f};
    Controls c = {0};
    c.repetition_penalty = 2.0f;
    process_logits(&c, &llama2_ends, (const int[]){0, 1, 1, 3, 0, 5}, 6, 0, s);
    expect(s[0] == 1.0f && s[1] == -4.0f && s[3] == -1.0f && s[5] == 0.0f, "penalised: %g %g %g %g", s[0], s[1], s[3], s[5]);
    expect(s[2] == 0.5f && s[4] == 4.0f, "untouched: %g %g", s[2], s[4]);
    end();

    begin("no-repeat n-grams: tokens completing a seen n-gram are masked");
    float z[8] = {0};
    c = (Controls){0};
    c.no_repeat_ngram_size = 3;
    /* 3-grams (4,5,6) and (4,5,7) seen; the sequence ends in 4,5 */
    process_logits(&c, &llama2_ends, (const int[]){4, 5, 6, 1, 4, 5, 7, 4, 5}, 9, 0, z);
    for (int i = 0; i < 8; i++)
        expect((i == 6 || i == 7) ? z[i] == -INFINITY : z[i] == 0.0f, "token %d: %g", i, z[i]);
    float y[8] = {0};
    process_logits(&c, &llama2_ends, (const int[]){4, 5}, 2, 0, y);
    for (int i = 0; i < 8; i++) expect(y[i] == 0.0f, "too short a sequence masks nothing (token %d)", i);
    end();

    begin("min new tokens: BOS and EOS masked until enough are generated");
    float w[4] = {1, 1, 1, 1};
    c = (Controls){0};
    c.min_new_tokens = 2;
    process_logits(&c, &llama2_ends, (const int[]){1, 3}, 2, 1, w);
    expect(w[1] == -INFINITY && w[2] == -INFINITY && w[0] == 1 && w[3] == 1, "after 1 new: %g %g %g %g", w[0], w[1], w[2], w[3]);
    float v[4] = {1, 1, 1, 1};
    process_logits(&c, &llama2_ends, (const int[]){1, 3, 3}, 3, 2, v);
    expect(v[1] == 1 && v[2] == 1, "after 2 new: nothing masked");
    end();

    begin("kth_largest and sample_truncated");
    float scratch[200], sorted[200], x[200];
    expect(kth_largest((const float[]){0.1f, 0.4f, 0.2f, 0.3f}, 4, 2, scratch) == 0.3f, "2nd largest");
    expect(kth_largest((const float[]){0.5f, 0.5f, 0.5f}, 3, 3, scratch) == 0.5f, "ties");
    uint64_t rng = 99;
    for (int trial = 0; trial < 300; trial++) {
        int n = 1 + (int)(random_u32(&rng) % 200), levels = 1 + (int)(random_u32(&rng) % 50);
        for (int i = 0; i < n; i++) x[i] = sorted[i] = (float)(random_u32(&rng) % levels) - (trial % 3 == 0 ? INFINITY : 0);
        for (int i = 1; i < n; i++) /* descending insertion sort: the naive answer */
            for (int j = i; j > 0 && sorted[j] > sorted[j - 1]; j--) { float t = sorted[j]; sorted[j] = sorted[j - 1]; sorted[j - 1] = t; }
        int k = 1 + (int)(random_u32(&rng) % n);
        float got = kth_largest(x, n, k, scratch);
        if (!expect(got == sorted[k - 1], "trial %d: n %d k %d: %g, expected %g", trial, n, k, got, sorted[k - 1])) break;
    }
    ProbIndex pi[10]; /* room for 2n: the tokens and the sort's scratch */
    const float p[5] = {0.1f, 0.3f, 0.05f, 0.35f, 0.2f};
    expect(sample_truncated(p, 5, 1, 0.0f, 0.0f, pi, 0.99f) == 3, "top-k 1 is the argmax");
    /* top-k 2: {3: 0.35, 1: 0.3}; r = coin * 0.65 */
    expect(sample_truncated(p, 5, 2, 0.0f, 0.0f, pi, 0.5f) == 3, "top-k 2, low coin");
    expect(sample_truncated(p, 5, 2, 0.0f, 0.0f, pi, 0.6f) == 1, "top-k 2, high coin");
    /* min-p 0.6: keep p >= 0.21: {3, 1} */
    expect(sample_truncated(p, 5, 0, 0.0f, 0.6f, pi, 0.99f) == 1, "min-p keeps 0.35 and 0.3");
    /* top-k 3 (mass 0.85) then top-p 0.5: cumulative 0.35, 0.65 > 0.425: {3, 1} */
    expect(sample_truncated(p, 5, 3, 0.5f, 0.0f, pi, 0.99f) == 1, "top-p on the renormalised top-k");
    /* top-p 0.4 of the top-3 mass 0.85 is 0.34: the first token (0.35) exceeds it alone */
    expect(sample_truncated(p, 5, 3, 0.4f, 0.0f, pi, 0.99f) == 3, "top-p 0.4 on the top-3 keeps one token");
    end();

    begin("stop strings: held back only while they can still match");
    char out[64];
    c = (Controls){0};
    c.n_stops = 2;
    c.stops[0] = "abc";
    c.stops[1] = "xyz";
    StopMatcher m = stop_matcher(&c);
    size_t n_safe;
    stop_feed(&m, "12a", &n_safe);
    expect(n_safe == 2 && !m.matched, "'12a': %zu safe", n_safe);
    stop_feed(&m, "b", &n_safe);
    expect(n_safe == 0 && !m.matched, "'ab' held: %zu safe", n_safe);
    stop_feed(&m, "d", &n_safe);
    expect(n_safe == 3 && !m.matched, "'abd' released: %zu safe", n_safe);
    stop_feed(&m, "xy-ab", &n_safe);
    expect(n_safe == 3 && !m.matched, "'xy-ab': '-' and 'xy' released, 'ab' held: %zu safe", n_safe);
    stop_feed(&m, "c tail", &n_safe);
    expect(n_safe == 0 && m.matched == c.stops[0], "'abc' matched, nothing of it released: %zu safe", n_safe);
    free_stop_matcher(&m);
    m = stop_matcher(&c);
    feed_all(&m, (const char *const[]){"one ", "xyabc", "z"}, 3, out, sizeof(out));
    expect(m.matched == c.stops[0] && strcmp(out, "one xy") == 0, "abc inside one piece: '%s'", out);
    free_stop_matcher(&m);
    m = stop_matcher(&c);
    c.stops[1] = "ab";
    feed_all(&m, (const char *const[]){"zz", "abc"}, 2, out, sizeof(out));
    expect(m.matched == c.stops[0] && strcmp(out, "zz") == 0, "same start: the first listed wins ('%s')", m.matched ? m.matched : "none");
    free_stop_matcher(&m);
    m = stop_matcher(&c);
    feed_all(&m, (const char *const[]){"a", "a", "b"}, 3, out, sizeof(out));
    expect(m.matched == c.stops[1] && strcmp(out, "a") == 0, "overlapping start: '%s'", out);
    size_t n_rest;
    stop_rest(&m, &n_rest);
    expect(n_rest == 0, "nothing left to print after a match");
    free_stop_matcher(&m);
    m = stop_matcher(&c);
    feed_all(&m, (const char *const[]){"tail a"}, 1, out, sizeof(out));
    const char *rest = stop_rest(&m, &n_rest);
    expect(strcmp(out, "tail ") == 0 && n_rest == 1 && rest[0] == 'a', "at the end the held 'a' is printed");
    free_stop_matcher(&m);
    end();
}


/* ------------------------------------------------------------------------ */
/* The key/value cache's element types                                      */
/* ------------------------------------------------------------------------ */

/* The half nearest to x (ties to even), as a double, from the definition:
   halves are multiples of 2^(e-10) for x in [2^e, 2^(e+1)), e >= -14, and of
   2^-24 below 2^-14; from 65520 up, infinity. */
static double ref_half(float x) {
    double a = fabs((double)x);
    if (isnan(x)) return x;
    if (a >= 65520.0) return copysign(INFINITY, x);
    int e;
    frexp(a, &e); /* a in [2^(e-1), 2^e) */
    if (a == 0.0 || e - 1 < -14) e = -13;
    double ulp = ldexp(1.0, e - 1 - 10), n = a / ulp, r = floor(n);
    if (n - r > 0.5 || (n - r == 0.5 && fmod(r, 2.0) != 0.0)) r += 1.0;
    return copysign(r * ulp, x);
}

/* A cache of one layer and one block whose rows are n values of `type`. */
static void tiny_cache(KVCache *c, int type, int n) {
    const Config p = {.dim = n, .hidden_dim = n, .n_layers = 1, .n_heads = 1, .n_kv_heads = 1, .vocab_size = 4, .seq_len = 16, .head_size = n};
    kv_init(c, &p, 1, 0, type);
}

/* Stores x as a row of c's type and reads it back through kv_axpy (1 * v + 0
   is v exactly). */
static void round_trip(KVCache *c, const float *x, float *back, int n) {
    unsigned char *row = xcalloc(1, c->row_bytes);
    kv_encode(c, row, x, n);
    for (int i = 0; i < n; i++) back[i] = 0.0f;
    kv_axpy(c, row, 0, 1.0f, back, n);
    free(row);
}

static int same_float(float a, float b) { return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b)); }

static void test_kv_f16(void) {
    begin("kv f16: round to nearest even against a definition in doubles (ties, overflow, subnormal halves, NaN), plain C = F16C bit for bit");
    enum { N = 64 };
    KVCache c;
    tiny_cache(&c, KV_F16, N);
    float xs[200000];
    int n = 0;
    /* every finite half, and the midpoints between neighbours (ties) and a
       float either side of them */
    for (uint32_t h = 0; h < 0x7c00 && n + 8 < 200000; h += 1) {
        float v = half_to_float_plain((uint16_t)h), w = half_to_float_plain((uint16_t)(h + 1));
        float mid = (float)(((double)v + (double)w) / 2);
        if (h % 2 == 0 || h < 0x400 || h > 0x7b00) {
            xs[n++] = v; xs[n++] = -mid; xs[n++] = mid;
            xs[n++] = nextafterf(mid, 0.0f); xs[n++] = nextafterf(mid, INFINITY);
        }
    }
    const float edges[] = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e9f, FLT_MAX, -FLT_MAX, INFINITY, -INFINITY, NAN,
                           5.9604645e-8f /* 2^-24 */, 2.9802322e-8f /* 2^-25: a tie to 0 */, 2.9802326e-8f, 4.4703484e-8f /* 1.5 * 2^-24 */,
                           6.1035156e-5f /* 2^-14 */, 6.1035149e-5f, FLT_MIN, 1e-45f, -1e-45f, 1.0f, 1.00048828125f /* 1 + 2^-11: tie */, 1.0014648f};
    for (size_t i = 0; i < sizeof(edges) / sizeof(edges[0]); i++) xs[n++] = edges[i];
    uint64_t state = 42;
    while (n < 200000) { /* random bit patterns */
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t bits = (uint32_t)(state >> 32);
        memcpy(&xs[n++], &bits, sizeof(float));
    }
    for (int i = 0; i < n && !case_failed; i++) {
        uint16_t h = half_from_float_plain(xs[i]);
        float got = half_to_float_plain(h), want = (float)ref_half(xs[i]);
        expect(same_float(got, want), "%.9g -> half %04x = %.9g, want %.9g", xs[i], h, got, want);
        expect(half_from_float(xs[i]) == h, "%.9g: plain C gives %04x, the build's conversion %04x", xs[i], h, half_from_float(xs[i]));
        expect(same_float(half_to_float(h), got), "half %04x reads %.9g, plain C %.9g", h, half_to_float(h), got);
    }
    float row[N], back[N];
    for (int i = 0; i < N; i++) row[i] = xs[(i * 7919) % n];
    round_trip(&c, row, back, N);
    for (int i = 0; i < N; i++) expect(back[i] == (float)ref_half(row[i]) || (isnan(back[i]) && isnan(row[i])), "row value %d: %.9g read back as %.9g", i, row[i], back[i]);
    kv_free(&c);
    end();
}

/* q8_0 from its definition: scale = amax / 127 in float32, q = x / scale
   rounded half away from zero, 0 where the scale is 0; read back q * scale. */
static void ref_q8(const float *x, float *out, int n) {
    for (int g = 0; g < n; g += 32) {
        float amax = 0.0f;
        for (int i = g; i < g + 32; i++) if (fabsf(x[i]) > amax) amax = fabsf(x[i]);
        float scale = amax / 127.0f;
        for (int i = g; i < g + 32; i++) {
            double r = scale == 0.0f ? 0.0 : (double)(x[i] / scale); /* the float32 quotient */
            double q = r >= 0 ? floor(r + 0.5) : -floor(-r + 0.5);
            out[i] = (float)q * scale;
        }
    }
}

static void test_kv_q8_0(void) {
    begin("kv q8_0: groups of 32 against the definition (zero groups, ties, largest and smallest magnitudes)");
    enum { N = 256 };
    KVCache c;
    tiny_cache(&c, KV_Q8_0, N);
    float x[N], back[N], want[N];
    for (int i = 0; i < N; i++) x[i] = 0.0f;                                   /* group 0: all zero */
    for (int i = 32; i < 64; i++) x[i] = (float)(i - 48) + 0.5f;               /* group 1: amax 15.5 */
    x[32] = 127.0f;                                                            /* ... now scale 1: x.5 are ties */
    for (int i = 64; i < 96; i++) x[i] = (i % 2 ? -1 : 1) * (i - 64) * 1e37f;  /* group 2: huge */
    x[64] = FLT_MAX;
    for (int i = 96; i < 128; i++) x[i] = (i % 3 - 1) * 1e-45f;                /* group 3: the smallest: scale 0 */
    for (int i = 128; i < 160; i++) x[i] = (i - 144) * 1e-38f;                 /* group 4: a subnormal scale */
    for (int i = 160; i < 192; i++) x[i] = -0.0f;                              /* group 5: negative zeros */
    x[170] = -3.0f;
    uint64_t state = 7;
    for (int i = 192; i < N; i++) {                                            /* groups 6, 7: random */
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = ((float)(state >> 40) / 16777216.0f - 0.5f) * 8.0f;
    }
    ref_q8(x, want, N);
    round_trip(&c, x, back, N);
    for (int i = 0; i < N; i++) expect(back[i] == want[i], "value %d: %.9g read back as %.9g, want %.9g", i, x[i], back[i], want[i]);
    expect(back[33] == -15.0f && back[34] == -14.0f && back[47] == -1.0f && back[48] == 1.0f && back[50] == 3.0f,
           "ties at scale 1: -14.5 -13.5 -0.5 0.5 2.5 read %g %g %g %g %g (want -15 -14 -1 1 3 rounded away from zero)",
           back[33], back[34], back[47], back[48], back[50]);
    /* rows whose kv dimension is not a multiple of 32 are refused */
    jmp_buf trap;
    error_trap = &trap;
    int status = -1;
    if (setjmp(trap) == 0) { KVCache bad; tiny_cache(&bad, KV_Q8_0, 48); kv_free(&bad); }
    else status = error_status;
    error_trap = NULL;
    expect(status == EXIT_USAGE, "kv_dim 48 with q8_0: status %d, want %d", status, EXIT_USAGE);
    kv_free(&c);
    end();
}

/* kv_dot and kv_axpy of every type against double-precision sums of the
   values as read back, on head slices at every offset. Not inlined: inlined
   into main, gcc 12 (-Ofast -march=native -fopenmp) placed its arrays off
   the 32-byte alignment that its aligned vector loads assume in main's
   realigned frame, and they faulted (as test_json_mask's did, below). */
static __attribute__((noinline)) void test_kv_reads(void) {
    begin("kv reads: kv_dot and kv_axpy of f32, f16, q8_0 rows against double sums, every head offset");
    enum { N = 128 };
    float x[N], q[N];
    for (int i = 0; i < N; i++) { x[i] = sinf(i * 0.37f) * 3.0f; q[i] = cosf(i * 0.11f); }
    for (int type = KV_F32; type <= KV_Q8_0; type++) {
        KVCache c;
        tiny_cache(&c, type, N);
        unsigned char *row = xcalloc(1, c.row_bytes);
        float vals[N];
        kv_encode(&c, row, x, N);
        round_trip(&c, x, vals, N);
        for (int hs = 8; hs <= 64; hs *= 2)
            for (int off = 0; off < N; off += hs) {
                double want = 0;
                for (int i = 0; i < hs; i++) want += (double)q[i] * vals[off + i];
                float got = kv_dot(&c, row, off, q, hs);
                expect(fabs(got - want) <= 1e-5 * (1 + fabs(want)), "%s head %d at %d: dot %.9g, want %.9g", kv_type_names[type], hs, off, got, want);
                float xb[N];
                for (int i = 0; i < hs; i++) xb[i] = q[i];
                kv_axpy(&c, row, off, 0.75f, xb, hs);
                for (int i = 0; i < hs; i++)
                    expect(fabs(xb[i] - (q[i] + 0.75 * vals[off + i])) <= 1e-6, "%s axpy %d at %d: %.9g", kv_type_names[type], hs, off, xb[i]);
            }
        free(row);
        kv_free(&c);
    }
    end();
}

/* engine_cancel (a server's client that went away): a running and a waiting
   request dropped mid-way give back every cache block, and the request left
   running gets exactly what it gets alone. */
static void test_engine_cancel(void) {
    const char *ckpt = model_path("stories260K.bin");
    if (!file_exists(ckpt) || !have_tok512) {
        skip("engine_cancel", "stories260K.bin or tok512.bin not found in MODELS_DIR");
        return;
    }
    Transformer t;
    load_checkpoint(&t, ckpt);
    Engine e;
    engine_setup(&e, &t, &tok512, 2, 1, t.config.seq_len, 0, KV_F32, NULL);
    Decoding d = {.temperature = 1.0f, .topp = 0.9f, .seed = 7, .n_return = 1, .format = FORMAT_TEXT};
    const char *prompts[3] = {"Once upon a time, there was a little girl named Lily.", "The dog ran", "One day"};
    Request *r[3];
    for (int i = 0; i < 3; i++) {
        int n = 0, *tokens = encode_prompt(&tok512, prompts[i], t.config.seq_len, &n);
        r[i] = request_new(tokens, n, 60, 0, &d);
        engine_submit(&e, r[i]);
    }
    for (int k = 0; k < 8; k++) engine_step(&e);
    begin("engine_cancel: a running and a waiting request give back every block; the other one is as alone");
    expect(r[0]->state == REQUEST_RUNNING && r[2]->state == REQUEST_WAITING, "states %d %d", r[0]->state, r[2]->state);
    engine_cancel(&e, r[0]);
    engine_cancel(&e, r[2]);
    engine_run(&e);
    KVCache *c = &t.state.cache;
    int n_free = 0;
    for (int list = 0; list < 2; list++)
        for (int b = c->head[list]; b >= 0; b = c->next[b]) n_free++;
    expect(n_free == c->n_blocks && c->promised == 0, "%d of %d blocks free, %lld promised", n_free, c->n_blocks, (long long)c->promised);
    int n = 0, *tokens = encode_prompt(&tok512, prompts[1], t.config.seq_len, &n);
    Request *alone = request_new(tokens, n, 60, 0, &d);
    engine_submit(&e, alone);
    engine_run(&e);
    expect(r[1]->state == REQUEST_DONE && alone->hyps[0].n_tokens == r[1]->hyps[0].n_tokens &&
               memcmp(alone->hyps[0].tokens, r[1]->hyps[0].tokens, (size_t)alone->hyps[0].n_tokens * sizeof(int)) == 0,
           "the request left running differs from its run alone");
    end();
    for (int i = 0; i < 3; i++) request_free(r[i]);
    request_free(alone);
    engine_free(&e);
    free_run_state(&t.state);
    free_transformer(&t);
}

/* The server's HTTP request parser: whole, partial and refused requests. */
static void test_http_parse(void) {
    HttpRequest h;
    const char *ok = "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\ncontent-length:  5 \r\nAuthorization: Bearer k\r\n\r\nhello";
    begin("http_parse: a whole request, its parts, and each refusal");
    expect(http_parse(ok, strlen(ok), 100, &h) == 1 && strcmp(h.method, "POST") == 0 && strcmp(h.path, "/v1/completions") == 0 &&
               h.body_len == 5 && memcmp(h.body, "hello", 5) == 0 && h.auth_len == 8 && memcmp(h.auth, "Bearer k", 8) == 0,
           "the whole request");
    expect(http_parse(ok, strlen(ok) - 1, 100, &h) == 0, "a body not all there");
    expect(http_parse(ok, 20, 100, &h) == 0, "a header not all there");
    const char *cont = "POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n";
    expect(http_parse(cont, strlen(cont), 100, &h) == 0 && h.expect_continue, "Expect: 100-continue before the body");
    expect(http_parse(ok, strlen(ok), 4, &h) == 413, "a body over the limit");
    expect(http_parse("GET / HTTP/2.0\r\n\r\n", 18, 100, &h) == 400, "HTTP/2.0");
    expect(http_parse("get / HTTP/1.1\r\n\r\n", 18, 100, &h) == 400, "a lower-case method");
    expect(http_parse("GET x HTTP/1.1\r\n\r\n", 18, 100, &h) == 400, "a path without /");
    expect(http_parse("GET / HTTP/1.1\r\nNoColon\r\n\r\n", 27, 100, &h) == 400, "a header line without ':'");
    expect(http_parse("GET / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n", 38, 100, &h) == 400, "a bad Content-Length");
    expect(http_parse("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 47, 100, &h) == 501, "a chunked body");
    char *big = xcalloc(HTTP_MAX_HEADER + 1, 1);
    memset(big, 'a', HTTP_MAX_HEADER);
    expect(http_parse(big, HTTP_MAX_HEADER, 100, &h) == 431, "a header over HTTP_MAX_HEADER");
    free(big);
    end();
}

/* The JSON mask (6.1) walks the vocabulary as a trie and skips reading plain
   tokens inside strings: its allowed set must equal the brute-force one, each
   token's bytes fed one by one to the state from scratch, for states along
   several answers under several schemas (tokenizer.bin's 32000 tokens and
   tok512's). */
static void check_mask_states(const char *label, const Tokenizer *tok, const char *schema_text, const char *answer) {
    char err[256];
    JsonSchema *s = compile_schema(schema_text, strlen(schema_text), err, sizeof(err));
    if (!expect(s != NULL, "%s: the schema does not compile: %s", label, err)) return;
    TokenTrie *t = token_trie_new(tok);
    JsonMatch *m = json_match_new(s, t, tok->vocab_size);
    float *logits = xcalloc((size_t)tok->vocab_size, sizeof(float));
    static JsonState a, b;
    for (size_t at = 0; at <= strlen(answer); at++) {
        json_start(&m->state);
        for (size_t i = 0; i < at; i++) {
            json_feed(s, &m->state, (unsigned char)answer[i], &a);
            m->state = a;
        }
        if (!expect(m->state.n > 0, "%s: the answer is refused at byte %zu", label, at)) break;
        for (int i = 0; i < tok->vocab_size; i++) logits[i] = 0.0f;
        json_mask(m, t, tok, logits);
        int complete = json_complete(s, &m->state), bad = -1;
        for (int i = 0; i < tok->vocab_size && bad < 0; i++) {
            int want = 0;
            if (is_eos_token(tok, i)) want = complete;
            else if (t->bytes[i]) {
                a = m->state;
                for (int k = 0; k < t->len[i] && a.n > 0; k++) {
                    json_feed(s, &a, (unsigned char)t->bytes[i][k], &b);
                    a = b;
                }
                want = a.n > 0;
            }
            if (want != (logits[i] == 0.0f)) bad = i;
        }
        if (!expect(bad < 0, "%s: after '%.*s' token %d ('%s') is %s by the mask", label, (int)at, answer, bad,
                    bad >= 0 ? tok->vocab[bad] : "", bad >= 0 && logits[bad] == 0.0f ? "allowed" : "refused"))
            break;
    }
    free(logits);
    json_match_free(m);
    token_trie_free(t);
    free_schema(s);
}

/* Not inlined: inlined into main, gcc 12 (-Ofast -march=native -fopenmp)
   laid out main's realigned frame so that an aligned vector load in
   test_kv_reads faulted. */
static __attribute__((noinline)) void test_json_mask(void) {
    static const char *const cases[][2] = {
        {"{\"type\":\"object\"}", "{\"a b\":\"x\\\"y\\u00e9\",\"n\":[1,-2.5e3,true,null,{}]}"},
        {"{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":5},\"age\":{\"type\":\"integer\","
         "\"minimum\":-20,\"maximum\":150},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"bc\",12]},\"maxItems\":2}},"
         "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}",
         "{\"age\":-17,\"name\":\"ab c\",\"tags\":[\"bc\",12]}"},
        {"{\"anyOf\":[{\"type\":\"string\",\"minLength\":2,\"maxLength\":3},{\"type\":\"array\",\"items\":{\"$ref\":\"#\"}}]}",
         "[\"ab\",[\"xyz\"],[]]"},
    };
    for (int k = 0; k < 2; k++) {
        const char *name = k == 0 ? "tokenizer.bin" : "tok512.bin";
        if (!(k == 0 ? have_tok32k : have_tok512)) { skip("json mask = brute force", "a tokenizer is missing from MODELS_DIR"); continue; }
        begin("json mask = brute force over %s", name);
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) check_mask_states(name, k == 0 ? &tok32k : &tok512, cases[c][0], cases[c][1]);
        end();
    }
}

/* Call heads (6.1): while a head is written, the mask allows exactly the
   tokens whose bytes keep the text a prefix of some head still possible
   (brute force over tokenizer.bin's 32000), no end token; head_take follows
   the text and names the head it completes, whose schema then reads on. */
/* Walks m along `target` (one of the n texts m matches, each `before`
   and a head), a longest allowed token at a time, checking head_mask
   against brute force at each step: a token is allowed when its bytes go
   on with some text still begun, or when it is an end token and m may end
   there (again, before any byte). Returns the head completed. */
static int walk_heads(HeadMatch *m, const TokenTrie *t, const char *before, const char *const *heads, int n, int target_head,
                      float *logits) {
    char texts[8][64], *target = texts[target_head];
    for (int h = 0; h < n; h++) snprintf(texts[h], sizeof(texts[h]), "%s%s", before, heads[h]);
    int done = -1, steps = 0;
    while (done < 0 && steps++ < 30) {
        for (int i = 0; i < tok32k.vocab_size; i++) logits[i] = 0.0f;
        head_mask(m, t, &tok32k, logits);
        int bad = -1, longest = -1;
        for (int i = 0; i < tok32k.vocab_size && bad < 0; i++) {
            int want = m->again && m->at == 0 && is_eos_token(&tok32k, i);
            for (int h = 0; h < n && t->bytes[i]; h++)
                want |= strncmp(texts[h], target, (size_t)m->at) == 0 && m->at + t->len[i] <= (int)strlen(texts[h]) &&
                        memcmp(texts[h] + m->at, t->bytes[i], (size_t)t->len[i]) == 0;
            if (want != (logits[i] == 0.0f)) bad = i;
            if (want && t->bytes[i] && memcmp(target + m->at, t->bytes[i], (size_t)t->len[i]) == 0 &&
                m->at + t->len[i] <= (int)strlen(target) && (longest < 0 || t->len[i] > t->len[longest]))
                longest = i;
        }
        if (!expect(bad < 0, "after '%.*s' token %d ('%s') is %s by the mask", m->at, target, bad, bad >= 0 ? tok32k.vocab[bad] : "",
                    bad >= 0 && logits[bad] == 0.0f ? "allowed" : "refused") || !expect(longest >= 0, "no token goes on with %s", target))
            break;
        done = head_take(m, longest, t->bytes[longest], t->len[longest]);
    }
    expect(done == target_head && m->at == (int)strlen(target), "head %d completed after %d bytes, not head %d (%s)", done, m->at,
           target_head, target);
    return done;
}

static void test_call_heads(void) {
    if (!have_tok32k) { skip("call heads", "tokenizer.bin is missing from MODELS_DIR"); return; }
    begin("call heads: the mask = brute force along a head, and the head completed");
    static const char *const heads[] = {"get_weather(", "get_time(", "set_timer("};
    char err[256];
    JsonSchema *s = call_heads_new();
    for (int h = 0; h < 3; h++) call_heads_add(s, heads[h], compile_schema("{\"type\":\"integer\"}", 19, err, sizeof(err)));
    TokenTrie *t = token_trie_new(&tok32k);
    HeadMatch *m = head_match_new(s, &tok32k, 0);
    float *logits = xcalloc((size_t)tok32k.vocab_size, sizeof(float));
    walk_heads(m, t, "", heads, 3, 1, logits);
    expect(head_take(m, -1, "x", 1) == -2, "a byte past the head is refused");
    head_match_free(m);
    HeadMatch *fresh = head_match_new(s, &tok32k, 0);
    expect(head_take(fresh, -1, "set_", 4) == -1 && head_take(fresh, -1, "timer(", 6) == 2, "text fed to the heads completes set_timer(");
    head_match_free(fresh);
    HeadMatch *wrong = head_match_new(s, &tok32k, 0);
    expect(head_take(wrong, -1, "get_x", 5) == -2, "text that begins no head is refused");
    head_match_free(wrong);
    end();
    /* heads that repeat: after a finished value, `between` then a head,
       or the end (there only); max_values values in all */
    begin("call heads that repeat: the end or between and a head, brute force; max_values; the first head written");
    call_heads_repeat(s, "; ", 2);
    Engine e = {0};
    e.tok = &tok32k;
    e.trie = t;
    Request r = {0};
    r.d.schema = s;
    r.json = json_match_new(s->after[1], t, tok32k.vocab_size);
    expect(heads_again(&e, &r) && !r.json && r.head && r.head->again && r.values == 1, "a first value is followed by the heads again");
    if (r.head) walk_heads(r.head, t, "; ", heads, 3, 2, logits);
    head_match_free(r.head);
    r.head = NULL;
    expect(!heads_again(&e, &r) && r.values == 2, "the second value (max_values 2) ends the reply");
    HeadMatch *again = head_match_new(s, &tok32k, 1);
    expect(head_take(again, -1, "get_time(", 9) == -2, "again, a head without `between` first is refused");
    head_match_free(again);
    Transformer tr = {0};
    tr.config.vocab_size = tok32k.vocab_size;
    e.t = &tr;
    s->first_written = 1; /* the prompt wrote head 0: the reply starts in its value */
    Request w = {0};
    w.d.schema = s;
    constraint_start(&e, &w);
    expect(!w.head && w.json && w.json->schema == s->after[0], "with the first head written, the reply starts in head 0's value");
    json_match_free(w.json);
    json_match_free(r.json);
    free(logits);
    token_trie_free(t);
    free_schema(s);
    end();
}

/* Llama 3.1's "auto" calls (Decoding's constrain_leading, 11.1): where a
   reply's lead ends (lead_after), and lead_mask over tokenizer.bin's 32000
   tokens against a plain rule: a token whose text, after the reply's lead
   so far and its own white space (before any of <|python_tag|>), starts
   with '{' is allowed only when that rest begins one of the call's two
   spellings (its keys in either order); every other token is untouched. */
static __attribute__((noinline)) void test_lead_mask(void) {
    begin("lead_after: the lead of a Llama 3.1 auto reply");
    static const struct { const char *text; int lead, want, at; } cases[] = {
        {" \n\t", 0, 0, 3}, {" <|python_tag|>", 0, 14, 15}, {"<|python_tag|>{\"", 0, LEAD_VALUE, 14}, {" \n{", 0, LEAD_VALUE, 2},
        {"<|python_tag|> {", 0, LEAD_FREE, 15}, {" x{", 0, LEAD_FREE, 2}, {"<|py{", 0, LEAD_FREE, 5}, {"thon_tag|>{", 4, LEAD_VALUE, 10},
        {" {", 3, LEAD_FREE, 1}, {"", 14, 14, 0},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        int at, got = lead_after(PYTHON_TAG, cases[k].lead, cases[k].text, (int)strlen(cases[k].text), &at);
        expect(got == cases[k].want && (got == LEAD_VALUE ? at == cases[k].at : 1), "'%s' from %d: %d at %d, not %d at %d",
               cases[k].text, cases[k].lead, got, at, cases[k].want, cases[k].at);
    }
    end();
    if (!have_tok32k) { skip("lead_mask", "tokenizer.bin not found in MODELS_DIR"); return; }
    begin("lead_mask: a leading '{' only as the call's, over tokenizer.bin");
    const char *text = "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"f\"},\"parameters\":{\"type\":\"object\"}},"
                       "\"required\":[\"name\",\"parameters\"],\"additionalProperties\":false}";
    const char *spellings[2] = {"{\"name\":\"f\",\"parameters\":{}}", "{\"parameters\":{},\"name\":\"f\"}"};
    char err[256];
    JsonSchema *s = compile_schema(text, strlen(text), err, sizeof(err));
    Engine e = {0};
    e.tok = &tok32k;
    e.trie = token_trie_new(&tok32k);
    Request r = {0};
    r.d.schema = s;
    r.d.constrain_leading = PYTHON_TAG;
    float *logits = xcalloc((size_t)tok32k.vocab_size, sizeof(float));
    static const int leads[] = {0, 5, 14};
    for (size_t l = 0; l < sizeof(leads) / sizeof(leads[0]); l++) {
        r.lead = leads[l];
        for (int i = 0; i < tok32k.vocab_size; i++) logits[i] = 0.0f;
        lead_mask(&e, &r, logits);
        int refused = 0, allowed_brace = 0, bad = -1;
        for (int i = 0; i < tok32k.vocab_size && bad < 0; i++) {
            const char *p = e.trie->bytes[i];
            int want = 1;
            if (p) {
                int n = e.trie->len[i], k = 0;
                while (r.lead == 0 && k < n && isspace((unsigned char)p[k])) k++;
                if (k < n && p[k] == '{' && (r.lead == 0 || r.lead == 14)) {
                    want = 0;
                    for (int sp = 0; sp < 2; sp++)
                        if ((size_t)(n - k) <= strlen(spellings[sp]) && memcmp(p + k, spellings[sp], (size_t)(n - k)) == 0) want = 1;
                    allowed_brace += want;
                }
            }
            refused += !want;
            if (want != (logits[i] == 0.0f)) bad = i;
        }
        expect(bad < 0, "lead %d: token %d ('%s') is %s", r.lead, bad, bad >= 0 ? tok32k.vocab[bad] : "",
               bad >= 0 && logits[bad] == 0.0f ? "allowed" : "refused");
        expect(leads[l] == 5 ? refused == 0 : refused > 0 && allowed_brace > 0, "lead %d: %d refused, %d allowed with '{'", leads[l], refused,
               allowed_brace);
    }
    free(logits);
    token_trie_free(e.trie);
    free_schema(s);
    end();
}

int main(void) {
    models_dir = getenv("MODELS_DIR");
    if (!models_dir || !*models_dir) models_dir = "../shared/models";
    const char *tmp = getenv("TEST_TMP");
    if (!tmp || !*tmp) tmp = "/tmp";
    snprintf(scratch, sizeof(scratch), "%s/unit.XXXXXX", tmp);
    if (!mkdtemp(scratch)) { perror(scratch); return 3; }

    if (file_exists(model_path("tok512.bin"))) { load_tokenizer(&tok512, model_path("tok512.bin"), 512); have_tok512 = 1; }
    if (file_exists(model_path("tokenizer.bin"))) { load_tokenizer(&tok32k, model_path("tokenizer.bin"), 32000); have_tok32k = 1; }

    test_known_ids();
    test_decode();
    if (have_tok32k) test_round_trip("tokenizer.bin", &tok32k);
    else skip("round trip tokenizer.bin", "tokenizer.bin not found in MODELS_DIR");
    if (have_tok512) test_round_trip("tok512.bin", &tok512);
    else skip("round trip tok512.bin", "tok512.bin not found in MODELS_DIR");
    test_tok512();
    if (have_tok32k) test_against_naive("tokenizer.bin", &tok32k, 1500);
    else skip("encode = naive quadratic merge, tokenizer.bin", "tokenizer.bin not found in MODELS_DIR");
    if (have_tok512) test_against_naive("tok512.bin", &tok512, 500);
    else skip("encode = naive quadratic merge, tok512.bin", "tok512.bin not found in MODELS_DIR");
    test_small_tokenizer();
    test_rng();
    test_samplers();
    test_controls();
    test_kernels();
    test_quantised_matmul();
    test_gguf_packing();
    test_matmul_vector_shapes();
    test_matmul_slices();
    test_matmul_half();
    test_matmul_shared_half();
    test_matmul_many();
#ifdef BF16_SPLIT
    test_matmul_bf16_split();
#endif
    test_block_allocator();
    test_window_pool();
    test_attention_tiles();
    test_kv_f16();
    test_kv_q8_0();
    test_kv_reads();
    test_forward();
    test_bad_checkpoints();
    test_bad_tokenizers();
    test_cli_helpers();
    test_file_kinds();
    test_conversation();
    test_think_split();
    test_reply_message();
    test_context_positions();
    test_engine_cancel();
    test_http_parse();
    test_json_mask();
    test_call_heads();
    test_lead_mask();

    if (have_tok512) free_tokenizer(&tok512);
    if (have_tok32k) free_tokenizer(&tok32k);
    remove_scratch();
    printf("unit: %d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
