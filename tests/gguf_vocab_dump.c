/* Test driver for tests/test_gguf_vocab.py: includes run.c, reads the
   vocabulary of a GGUF file with run.c's parser (2.1) and 5.3's
   load_gguf_tokenizer, and prints what the tokenizer computes.
     gguf_vocab_dump tokens FILE.gguf < hex lines
         per line (a text in hex): the ids of encode(text) without BOS or EOS
     gguf_vocab_dump info FILE.gguf
         bos, eos, the end tokens, end of turn, add_bos, add_eos and the chat
         template family, one "name value" line each
     gguf_vocab_dump chat FILE.gguf FIRST SYSTEM USER [FAMILY [REASONING]]
         the ids of one chat turn (FIRST: 1 for the first turn; SYSTEM "" for
         none; FAMILY one of chat_family_names overrides the file's, "" keeps
         it; REASONING show, hide or off as --reasoning)
     gguf_vocab_dump messages FILE.gguf REASONING ROLE CONTENT [ROLE CONTENT...]
         the ids of a conversation as serve renders a chat request's messages
     gguf_vocab_dump request FILE.gguf BODY.json
         the ids of the prompt of a chat request's body as serve renders it,
         its tools, calls and tool results included (11.1) */
#define TESTING
#include "../run.c"
#include "hex_lines.h"

/* Reads the vocabulary of the GGUF file at path with run.c's loader (the
   parse stays in g, the mapping in map, for the caller to free). */
static void load_vocab(Tokenizer *tok, const char *path, GGUF *g, size_t *size, void **map) {
    *map = (void *)map_file(path, size, "vocabulary");
    parse_gguf(g, *map, *size, path);
    load_gguf_vocabulary(tok, g);
}

static void dump_tokens(const Tokenizer *tok) {
    for (char *text; (text = next_hex_text()) != NULL; free(text)) {
        int *ids = xcalloc(encode_capacity(tok, strlen(text)), sizeof(int)), bad = 0;
        int n = encode(tok, text, 0, 0, ids, &bad);
        if (n < 0) printf("bad byte 0x%02X", bad);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
        free(ids);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: gguf_vocab_dump tokens FILE.gguf | info FILE.gguf | chat FILE.gguf FIRST SYSTEM USER [FAMILY [REASONING]] | "
                        "messages FILE.gguf REASONING ROLE CONTENT... | request FILE.gguf BODY.json\n");
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
    } else if (strcmp(argv[1], "chat") == 0 && argc >= 6 && argc <= 8) {
        if (argc >= 7 && argv[6][0] != '\0') {
            int f = -1;
            for (int i = 0; i < (int)(sizeof(chat_family_names) / sizeof(chat_family_names[0])); i++)
                if (strcmp(argv[6], chat_family_names[i]) == 0) f = i;
            if (f < 0) die(EXIT_USAGE, "unknown family %s", argv[6]);
            tok.chat_template = f;
        }
        if (argc == 8) tok.reasoning = strcmp(argv[7], "off") == 0 ? REASONING_OFF : strcmp(argv[7], "hide") == 0 ? REASONING_HIDE : REASONING_SHOW;
        int n = 0, *ids = chat_turn_tokens(&tok, argv[4], argv[5], atoi(argv[3]), 1 << 20, &n);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\nend_of_turn %d\n", turn_end_token(&tok));
        free(ids);
    } else if (strcmp(argv[1], "messages") == 0 && argc >= 6 && argc % 2 == 0) {
        tok.reasoning = strcmp(argv[3], "off") == 0 ? REASONING_OFF : strcmp(argv[3], "hide") == 0 ? REASONING_HIDE : REASONING_SHOW;
        int m = (argc - 4) / 2;
        char **roles = xcalloc((size_t)m, sizeof(char *)), **contents = xcalloc((size_t)m, sizeof(char *));
        for (int i = 0; i < m; i++) {
            roles[i] = argv[4 + 2 * i];
            contents[i] = argv[5 + 2 * i];
        }
        const char *why = NULL;
        int n = 0, *ids = chat_messages_tokens(&tok, roles, contents, m, 1 << 20, &n, &why);
        if (!ids) die(EXIT_USAGE, "%s", why);
        free(roles);
        free(contents);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(ids);
    } else if (strcmp(argv[1], "request") == 0 && argc == 4) {
        size_t n_body;
        const char *body = map_file(argv[3], &n_body, "request");
        ServeFields f = {0};
        f.chat = 1;
        f.vocab = tok.vocab_size;
        f.tools.parallel = 1;
        parse_request_body(&f, body, n_body);
        tool_messages(&f, &tok);
        const char *why = NULL;
        int n = 0, *ids = chat_prompt_tokens(&tok, &f, 1 << 20, &n, &why);
        if (!ids) die(EXIT_USAGE, "%s", why);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        free(ids);
        free_serve_fields(&f);
        unmap((void *)body, n_body);
    } else {
        fprintf(stderr, "gguf_vocab_dump: unknown command %s\n", argv[1]);
        return 2;
    }
    free_tokenizer(&tok);
    free_gguf(&g);
    unmap(map, size);
    return 0;
}
