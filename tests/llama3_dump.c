/* Test driver for tests/test_llama3.py: includes run.c and prints what its
   internals compute, for comparison with independent references.
     llama3_dump tokens TOKENIZER VOCAB_SIZE < hex lines
         per line (a text in hex: any bytes, invalid UTF-8 included): the ids
         of encode(text) without BOS or EOS, a tab, the hex of the bytes
         their pieces decode to
     llama3_dump chat TOKENIZER VOCAB_SIZE FIRST SYSTEM USER
         the ids of one chat turn in the tokenizer's template (FIRST: 1 for
         the first turn of a conversation, else 0; SYSTEM "" for none)
     llama3_dump logits CHECKPOINT ID...
         the logits after each of the ids (fed at positions 0, 1, ...), one
         line of vocab_size numbers per position
     llama3_dump rows CHECKPOINT ID...
         the token embedding's rows of the ids as the forward pass reads
         them (a block type's unpacked from its blocks), one line each
     llama3_dump kernels
         the matmul kernels of this build (as --version names them) */
#define TESTING
#include "../run.c"
#include "hex_lines.h"

static void dump_tokens(const Tokenizer *tok) {
    for (char *text; (text = next_hex_text()) != NULL; free(text)) {
        int *ids = xcalloc(encode_capacity(tok, strlen(text)), sizeof(int)), bad = 0;
        int n = encode(tok, text, 0, 0, ids, &bad);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        putchar('\t');
        for (int i = 0; i < n; i++)
            for (int j = 0; j < tok->piece_len[ids[i]]; j++) printf("%02x", (unsigned char)tok->vocab[ids[i]][j]);
        putchar('\n');
        free(ids);
    }
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "tokens") == 0) {
        Tokenizer tok;
        load_tokenizer(&tok, argv[2], atoi(argv[3]));
        dump_tokens(&tok);
        free_tokenizer(&tok);
        return 0;
    }
    if (argc == 7 && strcmp(argv[1], "chat") == 0) {
        Tokenizer tok;
        load_tokenizer(&tok, argv[2], atoi(argv[3]));
        int n = 0, *ids = chat_turn_tokens(&tok, argv[5], argv[6], atoi(argv[4]), 1 << 20, &n);
        for (int i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
        putchar('\n');
        free(ids);
        free_tokenizer(&tok);
        return 0;
    }
    if (argc >= 4 && strcmp(argv[1], "logits") == 0) {
        Transformer t;
        load_checkpoint(&t, argv[2]);
        int n = argc - 3;
        alloc_run_state(&t.state, &t.config, 1, n, n / KV_BLOCK + 2, 0, KV_F32);
        BlockTable table = {0};
        const BlockTable *tables[1] = {&table};
        for (int i = 0; i < n; i++) {
            int token = atoi(argv[3 + i]), row = 0;
            table_prepare_write(&t.state.cache, &table, i);
            Batch b = {1, &token, &i, tables, &row, 1};
            float *logits = forward(&t, &b);
            for (int v = 0; v < t.config.vocab_size; v++) printf(v ? " %.9g" : "%.9g", logits[v]);
            putchar('\n');
        }
        table_free(&t.state.cache, &table);
        free_run_state(&t.state);
        free_transformer(&t);
        return 0;
    }
    if (argc >= 4 && strcmp(argv[1], "rows") == 0) {
        Transformer t;
        load_checkpoint(&t, argv[2]);
        float *row = xcalloc((size_t)t.config.dim, sizeof(float));
        for (int i = 3; i < argc; i++) {
            matrix_row(row, &t.weights.token_embedding, atoi(argv[i]));
            for (int j = 0; j < t.config.dim; j++) printf(j ? " %.9g" : "%.9g", row[j]);
            putchar('\n');
        }
        free(row);
        free_transformer(&t);
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "kernels") == 0) {
        printf("%s\n", KERNEL_NAME);
        return 0;
    }
    fprintf(stderr, "usage: llama3_dump tokens TOKENIZER VOCAB | chat TOKENIZER VOCAB FIRST SYSTEM USER | logits CHECKPOINT ID... | rows CHECKPOINT ID... | kernels\n");
    return 2;
}
