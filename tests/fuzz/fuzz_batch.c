/* Fuzz target: the batch request parser (--batch FILE, JSON Lines).

   Input: the bytes of a batch file. read_batch_file() must reject it with a
   usage error (exit status 2) or return requests whose fields are within
   what the flags accept: a prompt, an id that is a JSON string or number,
   -r no more than the beams, and so on. The ids are then parsed back by the
   harness: each must be valid JSON text. */
#include "fuzz_common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

/* Whether s is one JSON string or number (the two forms an id takes). */
static int is_json_id(const char *s) {
    if (s[0] == '"') {
        JsonCursor j = {s + 1, s + strlen(s), "id"};
        free(json_string(&j, "id"));
        return j.p == s + strlen(s);
    }
    JsonCursor j = {s, s + strlen(s), "id"};
    return json_number_length(&j) == strlen(s);
}

static void check_line(const BatchLine *l, int vocab) {
    const Options *o = &l->o;
    CHECK(l->prompt != NULL && l->id != NULL, "a request without prompt or id");
    CHECK(o->temperature >= 0.0f && isfinite(o->temperature), "temperature %g", o->temperature);
    CHECK(o->topp >= 0.0f && o->topp <= 1.0f, "top_p %g", o->topp);
    CHECK(o->steps >= 0, "steps %d", o->steps);
    CHECK(o->beams >= 0 && o->beams <= vocab, "beams %d", o->beams);
    CHECK(isfinite(o->length_penalty), "length_penalty %g", o->length_penalty);
    CHECK(o->n_return >= 1 && o->n_return <= (o->beams > 0 ? o->beams : 1), "return %d with beams %d", o->n_return, o->beams);
    CHECK(o->seed <= (uint64_t)LLONG_MAX, "seed %llu", (unsigned long long)o->seed);
    const Controls *c = &o->controls;
    CHECK(c->top_k >= 0 && c->top_k <= vocab && c->min_p >= 0.0f && c->min_p <= 1.0f, "top_k %d, min_p %g", c->top_k, c->min_p);
    CHECK(c->repetition_penalty >= 0.0f && isfinite(c->repetition_penalty), "repetition_penalty %g", c->repetition_penalty);
    CHECK(c->n_stops >= 0 && c->n_stops <= MAX_STOPS, "%d stop strings", c->n_stops);
    for (int k = 0; k < c->n_stops; k++) CHECK(c->stops[k] == l->stops[k] && c->stops[k][0] != '\0', "stop string %d", k);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static Options defaults;
    defaults = (Options){.tokenizer = "tokenizer.bin", .mode = "generate", .temperature = 1.0f, .topp = 0.9f, .steps = 256,
                         .format = FORMAT_JSON, .length_penalty = 1.0f, .n_return = 1, .parallel = 8};
    defaults.batch_file = input_file(data, size);
    static BatchLine *lines;
    static int n;
    lines = NULL;
    n = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        lines = read_batch_file(&defaults, 300, 256, &n);
        CHECK(n >= 1, "no requests but no error");
        for (int i = 0; i < n; i++) {
            check_line(&lines[i], 300);
            CHECK(is_json_id(lines[i].id), "id %s is not a JSON string or number", lines[i].id);
        }
    } else {
        CHECK(error_status == EXIT_USAGE, "read_batch_file ended with status %d", error_status);
    }
    error_trap = NULL;
    if (lines)
        for (int i = 0; i < n; i++) {
            free(lines[i].prompt);
            free(lines[i].id);
            for (int k = 0; k < lines[i].o.controls.n_stops; k++) free(lines[i].stops[k]);
        }
    free(lines);
    return 0;
}
