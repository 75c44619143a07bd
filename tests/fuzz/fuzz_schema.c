/* Fuzz target: the JSON-schema compiler (--json-schema FILE, a request's
   response_format), which reads untrusted JSON.

   Input: a schema's text. compile_schema() must refuse it with one line of
   message, or give nodes that refer only to nodes that exist, with their
   properties and enum values sorted and distinct and their bounds in order.
   Its automaton is then walked from the start, each byte chosen among the
   bytes it allows by the input's bytes: a walk never reaches a dead end (no
   byte allowed while the value is incomplete; a recursive schema's depth
   limit aside), and a walk that ends with a complete value has written one
   JSON value, read back whole by the server's JSON reader (json_skip). The
   same text given as response_format's json_schema compiles the same. */
#include "fuzz_common.h"

#define WALK_BYTES 512

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    quiet_stdout();
    return 0;
}

static void check_nodes(const JsonSchema *s) {
    CHECK(s->n_nodes >= 2, "%d nodes", s->n_nodes);
    for (int i = 0; i < s->n_nodes; i++) {
        const SchemaNode *nd = &s->nodes[i];
        CHECK(nd->types > 0 && nd->types <= JT_ALL, "node %d: types %d", i, nd->types);
        CHECK(nd->items >= 0 && nd->items < s->n_nodes, "node %d: items %d", i, nd->items);
        CHECK(nd->n_props >= 0 && nd->n_props <= SCHEMA_MAX_PROPS, "node %d: %d properties", i, nd->n_props);
        CHECK(nd->n_props == 64 || nd->required >> nd->n_props == 0, "node %d: a required bit past the properties", i);
        for (int k = 0; k < nd->n_props; k++) {
            CHECK(nd->props[k].node >= 0 && nd->props[k].node < s->n_nodes, "node %d: property %d's node", i, k);
            CHECK((int)strlen(nd->props[k].name) == nd->props[k].len, "node %d: property %d's length", i, k);
            CHECK(k == 0 || strcmp(nd->props[k - 1].name, nd->props[k].name) < 0, "node %d: properties not sorted", i);
        }
        for (int k = 0; k < nd->n_any; k++) CHECK(nd->any[k] >= 0 && nd->any[k] < s->n_nodes, "node %d: branch %d", i, k);
        for (int k = 1; k < nd->n_lits; k++) CHECK(strcmp(nd->lits[k - 1], nd->lits[k]) < 0, "node %d: enum not sorted", i);
        CHECK(nd->min_items <= nd->max_items && nd->min_len <= nd->max_len && nd->minimum <= nd->maximum, "node %d: bounds", i);
    }
}

/* Whether text (n bytes) is exactly one JSON value for the server's reader. */
static int reads_as_json(const char *text, size_t n) {
    jmp_buf trap, *outer = error_trap;
    JsonCursor j = {text, text + n, "walk"};
    error_trap = &trap;
    int ok = 0;
    if (setjmp(trap) == 0) {
        json_skip(&j, 0);
        ok = j.p == j.end;
    }
    error_trap = outer;
    return ok;
}

static void walk(const JsonSchema *s, const uint8_t *data, size_t size) {
    static JsonState st, next;
    static char text[WALK_BYTES + 1];
    int n = 0, allowed[256];
    json_start(&st);
    for (; n < WALK_BYTES; n++) {
        int n_allowed = 0, deepest = 0;
        for (int ch = 1; ch < 256; ch++) {
            json_feed(s, &st, ch, &next);
            if (next.n > 0) allowed[n_allowed++] = ch;
        }
        for (int i = 0; i < st.n; i++) deepest = st.alt[i].depth > deepest ? st.alt[i].depth : deepest;
        int complete = json_complete(s, &st);
        CHECK(n_allowed > 0 || complete || deepest >= JSON_MAX_DEPTH - 1, "a dead end after '%.*s'", n, text);
        uint8_t choice = size ? data[(size_t)n * 7 % size] : 0;
        if (n_allowed == 0 || (complete && choice % 4 == 0)) break;
        int ch = allowed[(choice + n) % n_allowed];
        json_feed(s, &st, ch, &next);
        st = next;
        text[n] = (char)ch;
    }
    if (json_complete(s, &st)) CHECK(reads_as_json(text, (size_t)n), "the complete answer '%.*s' is not one JSON value", n, text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256] = "";
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) != 0) CHECK(0, "an error escaped the compiler (status %d): %s", error_status, error_text);
    JsonSchema *s = compile_schema((const char *)data, size, err, sizeof(err));
    if (!s) {
        CHECK(err[0] != '\0' && !strchr(err, '\n'), "a refusal without a one-line message: '%s'", err);
    } else {
        check_nodes(s);
        walk(s, data, size);
        /* the same schema inside a response_format compiles to as many nodes */
        char *wrapped = calloc(size + 64, 1);
        int head = snprintf(wrapped, 64, "{\"type\":\"json_schema\",\"json_schema\":{\"schema\":");
        memcpy(wrapped + head, data, size);
        memcpy(wrapped + head + size, "}}", 2);
        size_t used;
        int plain;
        char err2[256];
        JsonSchema *w = compile_json_value(wrapped, wrapped + head + size + 2, 1, &used, &plain, err2, sizeof(err2));
        CHECK(w && w->n_nodes == s->n_nodes, "inside response_format: %s", w ? "a different node count" : err2);
        free_schema(w);
        free(wrapped);
        free_schema(s);
    }
    error_trap = NULL;
    return 0;
}
