/* Fuzz target: the server's HTTP request parser and request JSON (-m serve).

   Input: the bytes a client sends. http_parse() must ask for more, refuse
   with a 4xx/5xx status, or return a request whose parts lie inside the
   input; a whole request's body is then read as a completion (or, for
   /v1/chat/completions, a chat completion) by parse_request_body(), which
   must fail with a usage error (the server's 400) or return fields within
   what the command line accepts. The server's --header-timeout reads, from
   a request still arriving, whether its header is whole (header_len set
   while asking for more): every prefix of the input must say so from the
   header's end on, with the whole input's header length, and never before. */
#include "fuzz_common.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

static void check_fields(const ServeFields *f) {
    const Options *o = &f->line.o;
    CHECK(f->chat ? f->n_messages > 0 : f->line.prompt != NULL || f->line.ids != NULL || f->n_prompts > 0, "no prompt or messages but no error");
    for (int i = 0; i < f->n_messages; i++) CHECK(f->roles[i] && f->contents[i], "message %d without role or content", i);
    CHECK(o->temperature >= 0.0f && isfinite(o->temperature), "temperature %g", o->temperature);
    CHECK(o->topp >= 0.0f && o->topp <= 1.0f, "top_p %g", o->topp);
    CHECK(o->beams >= 0 && f->max_tokens >= 0, "beams %d, max_tokens %d", o->beams, f->max_tokens);
    const Controls *c = &o->controls;
    CHECK(c->top_k >= 0 && c->top_k <= f->vocab && c->min_p >= 0.0f && c->min_p <= 1.0f, "top_k %d, min_p %g", c->top_k, c->min_p);
    CHECK(c->n_stops >= 0 && c->n_stops <= MAX_STOPS, "%d stop strings", c->n_stops);
    for (int k = 0; k < c->n_stops; k++) CHECK(c->stops[k] == f->line.stops[k] && c->stops[k][0] != '\0', "stop string %d", k);
}

/* The prefixes of buf (n bytes) at a few lengths, against the whole input's
   parse `whole` (status) and h. */
static void check_prefixes(const char *buf, size_t n, int whole, const HttpRequest *h) {
    size_t cuts[] = {n / 3, n / 2, n - 1, h->header_len - 1, h->header_len, h->header_len + 1};
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        size_t k = cuts[i];
        if (k == 0 || k >= n) continue;
        char *prefix = malloc(k);
        memcpy(prefix, buf, k);
        HttpRequest p;
        int status = http_parse(prefix, k, 4096, &p);
        free(prefix);
        if (status != 0) continue; /* refused early: the server answers at once */
        if (whole == 1 || (whole == 0 && h->header_len > 0)) {
            CHECK(p.header_len == (k >= h->header_len ? h->header_len : 0), "a prefix of %zu bytes: header %zu, the whole's %zu", k,
                  p.header_len, h->header_len);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size + 1); /* exactly the input: reads past it are caught */
    memcpy(buf, data, size);
    HttpRequest h;
    int status = http_parse(buf, size, 4096, &h);
    check_prefixes(buf, size, status, &h);
    CHECK(status == 0 || status == 1 || status == 400 || status == 413 || status == 431 || status == 501, "status %d", status);
    if (status == 0) CHECK(size < HTTP_MAX_HEADER + 4096, "a whole request's bytes and still asking for more");
    if (status == 1) {
        CHECK(h.path[0] == '/' && h.method[0] != '\0' && strchr(h.path, '?') == NULL, "method %s path %s", h.method, h.path);
        CHECK(h.header_len + h.body_len <= size && h.body == buf + h.header_len && h.body_len <= 4096, "body outside the input");
        CHECK(!h.auth || (h.auth >= buf && h.auth + h.auth_len <= buf + h.header_len), "Authorization outside the header");
        static ServeFields *f;
        f = calloc(1, sizeof(ServeFields));
        f->line.o = (Options){.temperature = 1.0f, .topp = 0.9f, .steps = 256, .n_return = 1, .parallel = 8};
        f->chat = strcmp(h.path, "/v1/chat/completions") == 0;
        f->vocab = 300;
        error_trap = &fuzz_trap;
        if (setjmp(fuzz_trap) == 0) {
            parse_request_body(f, h.body, h.body_len);
            check_fields(f);
        } else {
            CHECK(error_status == EXIT_USAGE, "parse_request_body ended with status %d", error_status);
        }
        error_trap = NULL;
        free_serve_fields(f);
        free(f);
    }
    free(buf);
    return 0;
}
