/* Shared by the test drivers that tokenize (tests/llama3_dump.c,
   tests/gguf_vocab_dump.c): their input is lines of hex, each line a text of
   any bytes (invalid UTF-8 and NUL-free control bytes included), so that a
   test can give any text without quoting. Include after run.c. */

static int hex_digit(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* The text of the next line of standard input (free it), or NULL at its end. */
static char *next_hex_text(void) {
    static char *line;
    static size_t cap;
    ssize_t len = getline(&line, &cap, stdin);
    if (len < 0) {
        free(line);
        line = NULL;
        return NULL;
    }
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
    char *text = xcalloc((size_t)len / 2 + 1, 1);
    for (ssize_t i = 0; i + 1 < len; i += 2) text[i / 2] = (char)(hex_digit(line[i]) * 16 + hex_digit(line[i + 1]));
    return text;
}
