/* Fuzz target: the command line.

   Input: the arguments after the program name, separated by NUL bytes (at
   most 64). parse_options() must reject them with a usage error (or exit 0
   for -h) or return options within their documented ranges. The chat
   template is then rendered with the prompt and system prompt given. */
#include "fuzz_common.h"

#define MAX_ARGS 64

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

static void check_options(const Options *o, int argc, char **argv) {
    CHECK(argc >= 2 && o->checkpoint == argv[1] && argv[1][0] != '-', "the checkpoint is not the first argument");
    CHECK(o->tokenizer != NULL && o->mode != NULL, "no tokenizer or mode");
    CHECK(strcmp(o->mode, "generate") == 0 || strcmp(o->mode, "chat") == 0, "mode '%s'", o->mode);
    CHECK(o->temperature >= 0.0f && isfinite(o->temperature), "temperature %g", o->temperature);
    CHECK(o->topp >= 0.0f && o->topp <= 1.0f, "top-p %g", o->topp);
    CHECK(o->steps >= 0, "steps %d", o->steps);
    CHECK(o->format == FORMAT_TEXT || o->format == FORMAT_JSON, "format %d", (int)o->format);
    CHECK(o->threads >= 0 && o->threads <= 1024, "threads %d", o->threads);
    CHECK(o->beams >= 0, "beams %d", o->beams);
    CHECK(isfinite(o->length_penalty), "length penalty %g", o->length_penalty);
    CHECK(o->early_stopping == STOP_HEURISTIC || o->early_stopping == STOP_EARLY || o->early_stopping == STOP_NEVER,
          "early stopping %d", (int)o->early_stopping);
    CHECK(o->n_return >= 1 && o->n_return <= (o->beams > 0 ? o->beams : 1), "-r %d with -b %d", o->n_return, o->beams);
    CHECK(o->seed <= (uint64_t)LLONG_MAX, "seed %llu", (unsigned long long)o->seed);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* a copy with a NUL after the last argument; argv points into it */
    char *buffer = malloc(size + 1);
    if (!buffer) return 0;
    memcpy(buffer, data, size);
    buffer[size] = '\0';
    static char *argv[MAX_ARGS + 2];
    static char program[] = "run";
    int argc = 0;
    argv[argc++] = program;
    if (size > 0)
        for (char *p = buffer; argc <= MAX_ARGS; p += strlen(p) + 1) {
            argv[argc++] = p;
            if (p + strlen(p) >= buffer + size) break;
        }
    argv[argc] = NULL;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        Options o = parse_options(argc, argv);
        check_options(&o, argc, argv);
        char *turn = render_chat_turn(o.system_prompt, o.prompt ? o.prompt : "");
        CHECK(strstr(turn, o.prompt ? o.prompt : "") != NULL, "the rendered turn lacks the prompt");
        free(turn);
    } else {
        CHECK(error_status == 0 || error_status == EXIT_USAGE, "parse_options ended with status %d", error_status);
    }
    error_trap = NULL;
    free(buffer);
    return 0;
}
