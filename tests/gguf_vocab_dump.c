/* Test driver for tests/test_gguf_vocab.py: includes run.c, reads the
   vocabulary of a GGUF file with run.c's parser (2.1) and 5.3's
   load_gguf_tokenizer, and prints what the tokenizer computes.
     gguf_vocab_dump tokens FILE.gguf < hex lines
         per line (a text in hex): the ids of encode(text) without BOS or EOS
     gguf_vocab_dump info FILE.gguf
         bos, eos, the end tokens, end of turn, add_bos, add_eos and the chat
         template family, one "name value" line each
     gguf_vocab_dump chat FILE.gguf FIRST SYSTEM USER [FAMILY]
         the ids of one chat turn (FIRST: 1 for the first turn; SYSTEM "" for
         none; FAMILY llama2, llama3, chatml or phi3 overrides the file's) */
#define TESTING
#include "../run.c"

/* The array `key` of `type` elements, or NULL. */
static const GGUFValue *array_of(const GGUF *g, const char *key, uint32_t type) {
    const GGUFValue *v = gguf_value(g, key);
    if (v && (v->type != GGUF_ARRAY || v->elem != type)) die(EXIT_BAD_FILE, "%s: %s is not an array of type %u", g->path, key, type);
    return v;
}

/* NUL-terminated copies of the strings of an array; lens gets their lengths. */
static char **strings_of(const GGUFValue *v, int **lens) {
    char **out = xcalloc((size_t)v->count + 1, sizeof(char *));
    *lens = xcalloc((size_t)v->count + 1, sizeof(int));
    const char *at = v->at;
    for (uint64_t i = 0; i < v->count; i++) {
        uint64_t len;
        memcpy(&len, at, 8);
        out[i] = xcalloc((size_t)len + 1, 1);
        memcpy(out[i], at + 8, (size_t)len);
        (*lens)[i] = (int)len;
        at += 8 + len;
    }
    return out;
}

static void load_vocab(Tokenizer *tok, const char *path, GGUF *g, size_t *size, void **map) {
    *map = (void *)map_file(path, size, "vocabulary");
    parse_gguf(g, *map, *size, path);
    GGUFVocab v = {0};
    char *model = gguf_string(g, "tokenizer.ggml.model"), *pre = gguf_string(g, "tokenizer.ggml.pre");
    char *tmpl = gguf_string(g, "tokenizer.chat_template");
    v.model = model;
    v.pre = pre;
    v.chat_template = tmpl;
    const GGUFValue *tokens = array_of(g, "tokenizer.ggml.tokens", GGUF_STRING);
    if (!tokens) die(EXIT_BAD_FILE, "%s: no tokenizer.ggml.tokens", path);
    v.n_tokens = (int)tokens->count;
    v.tokens = strings_of(tokens, &v.token_lens);
    const GGUFValue *scores = array_of(g, "tokenizer.ggml.scores", GGUF_FLOAT32);
    float *sc = NULL;
    if (scores) {
        sc = xcalloc((size_t)scores->count, sizeof(float));
        memcpy(sc, scores->at, (size_t)scores->count * 4);
        v.scores = sc;
    }
    const GGUFValue *types = array_of(g, "tokenizer.ggml.token_type", GGUF_INT32);
    int *ty = NULL;
    if (types) {
        ty = xcalloc((size_t)types->count, sizeof(int));
        memcpy(ty, types->at, (size_t)types->count * 4);
        v.types = ty;
    }
    const GGUFValue *merges = array_of(g, "tokenizer.ggml.merges", GGUF_STRING);
    int *merge_lens = NULL;
    if (merges) {
        v.n_merges = (int)merges->count;
        v.merges = strings_of(merges, &merge_lens);
    }
    v.bos = gguf_int(g, "tokenizer.ggml.bos_token_id", -1, -1, INT_MAX);
    v.eos = gguf_int(g, "tokenizer.ggml.eos_token_id", -1, -1, INT_MAX);
    v.eot = gguf_int(g, "tokenizer.ggml.eot_token_id", -1, -1, INT_MAX);
    v.eom = gguf_int(g, "tokenizer.ggml.eom_token_id", -1, -1, INT_MAX);
    v.unk = gguf_int(g, "tokenizer.ggml.unknown_token_id", -1, -1, INT_MAX);
    v.pad = gguf_int(g, "tokenizer.ggml.padding_token_id", -1, -1, INT_MAX);
    v.add_bos = gguf_int(g, "tokenizer.ggml.add_bos_token", -1, -1, 1);
    v.add_eos = gguf_int(g, "tokenizer.ggml.add_eos_token", -1, -1, 1);
    load_gguf_tokenizer(tok, &v, path);
    for (int i = 0; i < v.n_tokens; i++) free(v.tokens[i]);
    for (int i = 0; i < v.n_merges; i++) free(v.merges[i]);
    free(v.tokens); free(v.token_lens); free(v.merges); free(merge_lens); free(sc); free(ty);
    free(model); free(pre); free(tmpl);
}

static int hex_digit(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

static void dump_tokens(const Tokenizer *tok) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, stdin)) >= 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
        char *text = xcalloc((size_t)len / 2 + 1, 1);
        for (ssize_t i = 0; i + 1 < len; i += 2) text[i / 2] = (char)(hex_digit(line[i]) * 16 + hex_digit(line[i + 1]));
        int *ids = xcalloc(encode_capacity(tok, strlen(text)), sizeof(int)), bad = 0;
        int n = encode(tok, text, 0, 0, ids, &bad);
        if (n < 0) printf("bad byte 0x%02X", bad);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
        free(ids);
        free(text);
    }
    free(line);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: gguf_vocab_dump tokens FILE.gguf | info FILE.gguf | chat FILE.gguf FIRST SYSTEM USER [FAMILY]\n");
        return 2;
    }
    Tokenizer tok;
    GGUF g = {0};
    size_t size;
    void *map;
    load_vocab(&tok, argv[2], &g, &size, &map);
    if (strcmp(argv[1], "tokens") == 0) dump_tokens(&tok);
    else if (strcmp(argv[1], "info") == 0) {
        printf("bos %d\neos %d\nend", tok.bos, tok.eos);
        for (int i = 0; i < tok.n_end; i++) printf(" %d", tok.end[i]);
        printf("\nend_of_turn %d\nadd_bos %d\nadd_eos %d\nchat %s\n", tok.end_of_turn, tok.add_bos, tok.add_eos,
               chat_family_names[tok.chat_template]);
    } else if (strcmp(argv[1], "chat") == 0 && (argc == 6 || argc == 7)) {
        if (argc == 7) {
            int f = -1;
            for (int i = 0; i < 4; i++)
                if (strcmp(argv[6], chat_family_names[i]) == 0) f = i;
            if (f < 0) die(EXIT_USAGE, "unknown family %s", argv[6]);
            tok.chat_template = f;
        }
        int n = 0, *ids = chat_turn_tokens(&tok, argv[4], argv[5], atoi(argv[3]), 1 << 20, &n);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\nend_of_turn %d\n", turn_end_token(&tok));
        free(ids);
    } else {
        fprintf(stderr, "gguf_vocab_dump: unknown command %s\n", argv[1]);
        return 2;
    }
    free_tokenizer(&tok);
    free_gguf(&g);
    unmap(map, size);
    return 0;
}
