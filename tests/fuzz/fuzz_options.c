/* Fuzz target: the command line.

   Input: the arguments after the program name, separated by NUL bytes (at
   most 64). parse_options() must reject them with a usage error (or exit 0
   for -h) or return options within their documented ranges, the long ones
   (generation controls, batch settings) included. The chat template is
   then rendered with the prompt and system prompt given. */
#include "fuzz_common.h"

#define MAX_ARGS 64

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

static void check_options(const Options *o, int argc, char **argv) {
    CHECK(argc >= 2 && o->checkpoint == argv[1] && argv[1][0] != '-', "the checkpoint is not the first argument");
    CHECK(o->mode != NULL, "no mode"); /* no tokenizer: a GGUF model's own, else tokenizer.bin */
    CHECK(strcmp(o->mode, "generate") == 0 || strcmp(o->mode, "chat") == 0 || strcmp(o->mode, "tokenize") == 0 ||
              strcmp(o->mode, "perplexity") == 0 || strcmp(o->mode, "serve") == 0,
          "mode '%s'", o->mode);
    CHECK(!(o->prompt && o->prompt_file), "both -i and -I were accepted");
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
    const Controls *c = &o->controls;
    CHECK(c->min_new_tokens >= 0, "--min-new-tokens %d", c->min_new_tokens);
    CHECK(c->repetition_penalty >= 0.0f && isfinite(c->repetition_penalty), "--repetition-penalty %g", c->repetition_penalty);
    CHECK(c->no_repeat_ngram_size >= 0, "--no-repeat-ngram-size %d", c->no_repeat_ngram_size);
    CHECK(c->top_k >= 0, "--top-k %d", c->top_k);
    CHECK(c->min_p >= 0.0f && c->min_p <= 1.0f, "--min-p %g", c->min_p);
    CHECK(c->n_stops >= 0 && c->n_stops <= MAX_STOPS, "%d stop strings", c->n_stops);
    for (int s = 0; s < c->n_stops; s++) {
        int from_argv = 0;
        for (int i = 2; i < argc; i++) from_argv |= c->stops[s] == argv[i] && strcmp(argv[i - 1], "--stop") == 0;
        CHECK(from_argv && c->stops[s][0] != '\0', "stop string %d is empty or not an argument after --stop", s);
    }
    CHECK(o->parallel >= 1 && o->parallel <= 4096, "--parallel %d", o->parallel);
    CHECK(o->kv_mb >= 0 && o->kv_mb <= (1 << 24), "--kv-mb %d", o->kv_mb);
    CHECK(o->kv_type == KV_F32 || o->kv_type == KV_F16 || o->kv_type == KV_Q8_0, "--kv-type %d", o->kv_type);
    CHECK(!o->batch_file || !o->format_given || o->format == FORMAT_JSON, "--batch with text output");
    CHECK(o->max_new_tokens >= 0, "--max-new-tokens %d", o->max_new_tokens);
    CHECK(o->steps_given || o->steps == 256, "-n not given but steps %d", o->steps);
    CHECK(o->keep >= -1 && o->keep < INT_MAX, "--keep %d", o->keep);
    CHECK(o->keep < 0 || (o->beams == 0 && !o->draft_file && !o->lookup &&
                          (o->batch_file || strcmp(o->mode, "generate") == 0)), "--keep accepted with -b, a draft or -m %s", o->mode);
    /* the positions a run uses stay within the context, whatever the options */
    for (int seq_len = 1; seq_len <= 4096; seq_len *= 8) {
        int steps = context_positions(o, seq_len);
        CHECK(steps >= 1 && steps <= seq_len, "context_positions %d for seq_len %d", steps, seq_len);
        int run = run_positions(o, seq_len);
        CHECK(o->keep >= 0 ? run >= 1 : run == steps, "run_positions %d for seq_len %d", run, seq_len);
    }
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
