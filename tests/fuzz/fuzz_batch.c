/* Fuzz target: the batch input (--batch FILE, JSON Lines), line by line.

   Input: the bytes of a batch file. BatchInput cuts them into lines (their
   bytes and newlines must give back the input) and parse_line() reads each:
   a blank line, a request whose fields are within what the flags accept (a
   prompt, an id that is a JSON string or number, -r no more than the beams,
   and so on), or a refusal with a message and nothing else left of the line
   but its id. A bad line costs only itself: every line is also parsed
   alone, and between lines that fail after they have allocated strings (stop
   strings, an id, a prompt), and must come out the same each time. */
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

static void check_line(const BatchLine *l, const BatchLimits *lim) {
    const Options *o = &l->o;
    CHECK(l->prompt || l->ids || l->chat, "a request without a prompt");
    CHECK(!l->chat || (l->chat->n_messages > 0 && !l->prompt && !l->ids), "a chat line without messages, or with a prompt too");
    CHECK(!l->id || is_json_id(l->id), "id %s is not a JSON string or number", l->id);
    CHECK(o->temperature >= 0.0f && isfinite(o->temperature), "temperature %g", o->temperature);
    CHECK(o->topp >= 0.0f && o->topp <= 1.0f, "top_p %g", o->topp);
    CHECK(o->steps >= 0, "steps %d", o->steps);
    CHECK(o->beams >= 0 && o->beams <= lim->max_beams, "beams %d", o->beams);
    CHECK(isfinite(o->length_penalty), "length_penalty %g", o->length_penalty);
    CHECK(o->n_return >= 1 && o->n_return <= (o->beams > 0 ? o->beams : 1), "return %d with beams %d", o->n_return, o->beams);
    CHECK(o->seed <= (uint64_t)LLONG_MAX, "seed %llu", (unsigned long long)o->seed);
    const Controls *c = &o->controls;
    CHECK(c->top_k >= 0 && c->top_k <= lim->vocab && c->min_p >= 0.0f && c->min_p <= 1.0f, "top_k %d, min_p %g", c->top_k, c->min_p);
    CHECK(c->repetition_penalty >= 0.0f && isfinite(c->repetition_penalty), "repetition_penalty %g", c->repetition_penalty);
    CHECK(c->n_stops >= 0 && c->n_stops <= MAX_STOPS, "%d stop strings", c->n_stops);
    for (int k = 0; k < c->n_stops; k++) CHECK(c->stops[k] == l->stops[k] && c->stops[k][0] != '\0', "stop string %d", k);
}

/* What a line became, to compare parses of it: kind, message, and the
   request's fields. */
typedef struct {
    int kind;
    char message[sizeof(error_text)];
    BatchLine line;
} Parsed;

/* a chat line's template: tool_messages reads only its family (llama2's) */
static const Tokenizer chat_tokenizer;
static const BatchLimits limits = {300, 256, 4, 0, &chat_tokenizer};
static Options defaults;

/* Lines that fail after allocating: stop strings, an id and a prompt. */
static const char *const bad_lines[] = {
    "{\"stop\":[\"a\",\"b\"],\"id\":\"z\",\"prompt\":\"p\",\"colour\":1}",
    "{\"prompt\":\"q\",\"stop\":\"c\",\"steps\":-1}",
    "{\"id\":7,\"prompt\":\"r\",\"beams\":5}",
    "not json",
    "{\"messages\":[{\"role\":\"user\",\"content\":\"u\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"sometimes\"}",
};

static void parse(Parsed *p, const char *text, size_t n, JsonTemps *tmp) {
    memset(p, 0, sizeof(*p));
    p->line = (BatchLine){.o = defaults};
    p->kind = parse_line(text, n, "fuzz:1", &p->line, tmp, &limits);
    if (p->kind < 0) snprintf(p->message, sizeof(p->message), "%s", error_text);
}

static void free_parsed(Parsed *p) {
    free(p->line.prompt);
    free(p->line.id);
    free_batch_stops(&p->line);
    free_schema(p->line.schema);
    free_batch_chat(&p->line);
}

static int same_text(const char *a, const char *b) { return (!a && !b) || (a && b && strcmp(a, b) == 0); }

static void check_same(const Parsed *a, const Parsed *b) {
    CHECK(a->kind == b->kind, "kind %d, then %d after bad lines", a->kind, b->kind);
    CHECK(strcmp(a->message, b->message) == 0, "message '%s', then '%s'", a->message, b->message);
    CHECK(same_text(a->line.prompt, b->line.prompt) && same_text(a->line.id, b->line.id), "prompt or id differs");
    CHECK(!a->line.chat == !b->line.chat && (!a->line.chat || (a->line.chat->n_messages == b->line.chat->n_messages &&
                                                               a->line.chat->tools.n == b->line.chat->tools.n)),
          "chat fields differ after bad lines");
    const Options *x = &a->line.o, *y = &b->line.o;
    CHECK(x->steps == y->steps && x->temperature == y->temperature && x->topp == y->topp && x->seed == y->seed &&
              x->beams == y->beams && x->length_penalty == y->length_penalty && x->early_stopping == y->early_stopping &&
              x->n_return == y->n_return && x->max_new_tokens == y->max_new_tokens,
          "options differ after bad lines");
    const Controls *c = &x->controls, *d = &y->controls;
    CHECK(c->min_new_tokens == d->min_new_tokens && c->repetition_penalty == d->repetition_penalty &&
              c->no_repeat_ngram_size == d->no_repeat_ngram_size && c->top_k == d->top_k && c->min_p == d->min_p &&
              c->n_stops == d->n_stops,
          "controls differ after bad lines");
    for (int k = 0; k < c->n_stops; k++) CHECK(strcmp(c->stops[k], d->stops[k]) == 0, "stop string %d differs", k);
}

/* One line: alone, then after each bad line with the same temps (as in a
   run), each time the same. */
static void check_one_line(const char *text, size_t n) {
    static JsonTemps tmp;
    static Parsed alone, after, bad;
    parse(&alone, text, n, &tmp);
    if (alone.kind < 0) CHECK(alone.message[0] != '\0' && !alone.line.prompt && !alone.line.chat && alone.line.o.controls.n_stops == 0,
                                "refusal left state");
    if (alone.kind > 0) check_line(&alone.line, &limits);
    for (size_t i = 0; i < sizeof(bad_lines) / sizeof(bad_lines[0]); i++) {
        parse(&bad, bad_lines[i], strlen(bad_lines[i]), &tmp);
        CHECK(bad.kind == -1, "bad line %zu accepted", i);
        free_parsed(&bad);
        parse(&after, text, n, &tmp);
        check_same(&alone, &after);
        free_parsed(&after);
    }
    free_parsed(&alone);
    json_temps_free(&tmp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    defaults = (Options){.tokenizer = "tokenizer.bin", .mode = "generate", .temperature = 1.0f, .topp = 0.9f, .steps = 256,
                         .format = FORMAT_JSON, .length_penalty = 1.0f, .n_return = 1, .parallel = 8};
    static BatchInput in;
    static size_t at; /* bytes of the input given back by the lines so far */
    at = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        batch_input_open(&in, input_file(data, size));
        for (;;) {
            size_t n;
            const char *text = batch_input_line(&in, &n);
            if (!text && batch_input_done(&in)) break;
            if (!text) {
                batch_input_fill(&in, 0);
                continue;
            }
            CHECK(at + n <= size && memcmp(text, data + at, n) == 0, "line %d is not the input's bytes", in.line_no);
            at += n;
            CHECK(at == size || data[at] == '\n', "line %d does not end at a newline", in.line_no);
            at += at < size;
            check_one_line(text, n);
        }
        CHECK(at == size, "the lines give back %zu of %zu bytes", at, size);
    } else {
        CHECK(0, "an error that is not a line's (status %d): %s", error_status, error_text);
    }
    error_trap = NULL;
    batch_input_close(&in);
    return 0;
}
