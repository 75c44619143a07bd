/* Test driver for tests/test_json_schema.py: includes run.c, compiles a
   schema file with 6.1's compiler and prints the JSON mask, so that the test
   can hold it against a reference of its own.
     json_mask_dump SCHEMA TOKENIZER VOCAB_SIZE < hex lines
         per line (a text in hex: the start of an answer), the ids of the
         tokens the mask allows after it, end tokens included once the value
         is complete, ascending, or "dead" when the text is no valid start */
#define TESTING
#include "../run.c"
#include "hex_lines.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: json_mask_dump SCHEMA TOKENIZER VOCAB_SIZE < hex lines\n");
        return 2;
    }
    size_t len;
    char *text = read_whole_file(argv[1], "JSON schema", &len), err[256];
    JsonSchema *s = compile_schema(text, len, err, sizeof(err));
    free(text);
    if (!s) die(EXIT_USAGE, "%s: %s", argv[1], err);
    Tokenizer tok;
    load_tokenizer(&tok, argv[2], atoi(argv[3]));
    TokenTrie *t = token_trie_new(&tok);
    JsonMatch *m = json_match_new(s, t, tok.vocab_size);
    float *logits = xcalloc((size_t)tok.vocab_size, sizeof(float));
    static JsonState next;
    for (char *answer; (answer = next_hex_text()) != NULL; free(answer)) {
        json_start(&m->state);
        for (const char *p = answer; *p && m->state.n > 0; p++) {
            json_feed(s, &m->state, (unsigned char)*p, &next);
            m->state = next;
        }
        if (m->state.n == 0) {
            puts("dead");
            continue;
        }
        for (int i = 0; i < tok.vocab_size; i++) logits[i] = 0.0f;
        json_mask(m, t, &tok, logits);
        for (int i = 0, first = 1; i < tok.vocab_size; i++)
            if (logits[i] == 0.0f) {
                printf(first ? "%d" : " %d", i);
                first = 0;
            }
        putchar('\n');
    }
    free(logits);
    json_match_free(m);
    token_trie_free(t);
    free_schema(s);
    free_tokenizer(&tok);
    return 0;
}
