/* Fuzz target: the generation loops (generate, chat, sampling and beam
   search) on a dim-4 model with a 300-token vocabulary
   (corpus/checkpoint/v1-chat-v300, whose replies end early so that chats
   have several turns, with corpus/tokenizer/v300).

   Input: command-line arguments after the checkpoint, separated by NUL
   bytes; after the first empty argument (two NULs in a row), the text that
   chat (or --batch -) reads from stdin (chat from the stream stdin, --batch
   from the descriptor 0 as the bytes arrive: both get it). The arguments go through
   parse_options(), then run_program() as main() in run.c calls it, except
   that the clock seed is 1, more than 8 beams or --parallel are skipped
   (slow, not different), as are --keep runs of more than 2000 positions
   and --kv-mb above 1024 (libFuzzer stops at a 2 GB malloc; a larger cache
   only holds more of the same blocks), and so is -m serve (it would listen for ever). Errors that
   main() would report (a prompt beyond the context, a byte without a token)
   are caught. Set FUZZ_CORPUS to the corpus directory when not running from
   the repository root. */
#include "fuzz_common.h"

#define MAX_ARGS 64
#define MAX_BEAMS 8
#define MAX_KEEP_POSITIONS 2000 /* --keep runs as long as -n says: longer ones are skipped (slow, not different) */
#define MAX_KV_MB 1024         /* the cache's metadata for --kv-mb 14444 on the dim-4 model is a 7.5 GB malloc */

static Transformer model;
static Tokenizer tok;
static char model_path[4096];

static int run_input(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    const char *corpus = getenv("FUZZ_CORPUS");
    if (!corpus || !corpus[0]) corpus = "tests/fuzz/corpus";
    snprintf(model_path, sizeof(model_path), "%s/checkpoint/v1-chat-v300", corpus);
    char tok_path[4096];
    snprintf(tok_path, sizeof(tok_path), "%s/tokenizer/v300", corpus);
    /* the tokenizer seed starts with two bytes of vocabulary size */
    FILE *f = fopen(tok_path, "rb");
    if (!f) { fprintf(stderr, "fuzz_generate: cannot open %s (set FUZZ_CORPUS)\n", tok_path); abort(); }
    static unsigned char buffer[1 << 16];
    size_t n = fread(buffer, 1, sizeof(buffer), f);
    fclose(f);
    if (n < 2) abort();
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) != 0) {
        fprintf(stderr, "fuzz_generate: %s or %s does not load\n", model_path, tok_path);
        abort();
    }
    load_checkpoint(&model, model_path);
    load_tokenizer(&tok, input_file(buffer + 2, n - 2), model.config.vocab_size);
    error_trap = NULL;
    /* the harness itself must work: valid runs of each kind end without an
       error, or the target stops at once instead of rejecting every input */
#define VALID_RUN(text) {text, sizeof(text) - 1}
    static const struct { const char *data; size_t size; } valid[] = {
        VALID_RUN("-n\0" "30\0-i\0Once"),
        VALID_RUN("-b\0" "3\0-n\0" "40\0-f\0json"),
        VALID_RUN("-m\0chat\0-y\0sys\0-n\0" "200\0-b\0" "2\0\0hi\nmore\n"),
    };
    for (size_t i = 0; i < sizeof(valid) / sizeof(valid[0]); i++)
        if (!run_input((const uint8_t *)valid[i].data, valid[i].size)) {
            fprintf(stderr, "fuzz_generate: valid run %zu ends with an error: the harness is broken\n", i);
            abort();
        }
    return 0;
}

static Engine engine;
static Speculator *spec; /* --lookup */
static FILE *chat_input;

/* Descriptor 0 reads `n` bytes of `text` (--batch -) until restore_fd0(). */
static int saved_fd0 = -1;
static void text_as_fd0(const char *text, size_t n) {
    static FILE *file;
    if (!file && !(file = tmpfile())) abort();
    int fd = fileno(file);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text, n, 0) != (ssize_t)n || lseek(fd, 0, SEEK_SET) != 0) abort();
    saved_fd0 = dup(0);
    if (dup2(fd, 0) < 0) abort();
}

static void restore_fd0(void) {
    if (saved_fd0 < 0 || dup2(saved_fd0, 0) < 0) abort();
    close(saved_fd0);
    saved_fd0 = -1;
}

/* Runs the arguments and stdin text in `data` (see above); returns whether
   that went without an error. */
static int run_input(const uint8_t *data, size_t size) {
    char *buffer = malloc(size + 1);
    if (!buffer) abort();
    memcpy(buffer, data, size);
    buffer[size] = '\0';
    static char *argv[MAX_ARGS + 2];
    argv[0] = "run";
    argv[1] = model_path;
    int argc = 2;
    const char *stdin_text = "";
    size_t stdin_len = 0;
    for (char *p = buffer; p < buffer + size && argc <= MAX_ARGS; p += strlen(p) + 1) {
        if (p[0] == '\0') { /* an empty argument: the rest is stdin */
            stdin_text = p + 1;
            stdin_len = size - (size_t)(p + 1 - buffer);
            break;
        }
        argv[argc++] = p;
    }
    argv[argc] = NULL;
    FILE *saved_stdin = stdin;
    chat_input = stdin_len > 0 ? fmemopen((void *)stdin_text, stdin_len, "r") : fopen("/dev/null", "r");
    if (!chat_input) abort();
    stdin = chat_input;
    text_as_fd0(stdin_text, stdin_len);

    volatile int ok = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        Options o = parse_options(argc, argv);
        /* prompt lookup runs; a draft file is not read (the input names no files) */
        if (o.lookup) spec = speculator_new(o.lookup, o.draft_max, NULL);
        /* -m serve would listen for ever: tests/fuzz/fuzz_http.c covers the server's input */
        if (o.beams <= MAX_BEAMS && o.parallel <= MAX_BEAMS && o.kv_mb <= MAX_KV_MB && !o.draft_file &&
            strcmp(o.mode, "serve") != 0 &&
            (o.keep < 0 || run_positions(&o, model.config.seq_len) <= MAX_KEEP_POSITIONS))
            run_program(&engine, &model, &tok, &o, 1, spec);
        ok = 1;
    }
    error_trap = NULL;
    engine_free(&engine);
    speculator_free(spec);
    spec = NULL;
    free_run_state(&model.state);
    stdin = saved_stdin;
    restore_fd0();
    fclose(chat_input);
    free(buffer);
    return ok;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    run_input(data, size);
    return 0;
}
