/* Shared by the libFuzzer targets in tests/fuzz/: includes run.c (built with
   -DTESTING, so without main()) and gives the targets

   - a trap for run.c's errors: die() and usage_error() end in leave(), which
     longjmps to error_trap (set to &fuzz_trap) instead of exiting;
   - file "mappings" that ASan can watch: run.c's mmap/munmap are replaced
     here by a heap copy of exactly the file's bytes, so any read past the
     end of a checkpoint or tokenizer is a heap-buffer-overflow report rather
     than a silent read of the zeros at the end of the last mapped page
     (anonymous mappings become zeroed heap blocks, madvise does nothing).
     The blocks still live after a caught error (run.c leaks them then, as
     the process would exit) are freed by release_mappings();
   - run.c's messages to stderr silenced, and its stdout sent to /dev/null
     by quiet_stdout(), so that the harness's reports stand out;
   - a scratch file that holds the current input, for the loaders that take
     a path.

   Build (from the repository root; see the Makefile's fuzz targets):
     clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_X.c -lm
   Memory allocated by run.c before a caught error is not freed: run the
   targets with -detect_leaks=0 (valgrind checks the real runs for leaks). */
#ifndef FUZZ_COMMON_H
#define FUZZ_COMMON_H

/* Every feature of the C library, so that run.c finds what it asks for
   whatever feature macros it sets; those are undefined again after the
   headers are read (each header is read once), so run.c's own definitions
   of them do not clash. */
#define _GNU_SOURCE
#define TESTING
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>
#undef _GNU_SOURCE
#undef _DEFAULT_SOURCE
#undef _POSIX_C_SOURCE

/* ---- heap-backed stand-ins for mmap/munmap ------------------------------ */

#define FUZZ_MAX_MAPPINGS 1024 /* a GGUF model converts each tensor into pages of its own */
static void *fuzz_mappings[FUZZ_MAX_MAPPINGS];

static inline void *fuzz_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t offset) {
    (void)addr; (void)prot;
    /* anonymous memory (run.c's key/value caches) is zeroed heap memory too */
    int anonymous = (flags & MAP_ANONYMOUS) || fd < 0;
    char *p = anonymous ? calloc(len ? len : 1, 1) : malloc(len ? len : 1);
    if (!p) return MAP_FAILED;
    for (size_t got = 0; !anonymous && got < len;) {
        ssize_t r = pread(fd, p + got, len - got, offset + (off_t)got);
        if (r <= 0) { free(p); return MAP_FAILED; }
        got += (size_t)r;
    }
    for (int i = 0; i < FUZZ_MAX_MAPPINGS; i++)
        if (!fuzz_mappings[i]) { fuzz_mappings[i] = p; return p; }
    fprintf(stderr, "fuzz harness: more than %d live mappings\n", FUZZ_MAX_MAPPINGS);
    abort();
}

static inline int fuzz_munmap(void *addr, size_t len) {
    (void)len;
    for (int i = 0; i < FUZZ_MAX_MAPPINGS; i++)
        if (fuzz_mappings[i] == addr) {
            free(addr);
            fuzz_mappings[i] = NULL;
            return 0;
        }
    fprintf(stderr, "fuzz harness: munmap of %p, which is not mapped\n", addr);
    abort(); /* run.c unmapped something it never mapped */
}

/* Hints about mapped memory mean nothing for heap copies. */
static inline int fuzz_madvise(void *addr, size_t len, int advice) {
    (void)addr; (void)len; (void)advice;
    return 0;
}

/* Frees what run.c left mapped when an error was caught. */
static inline void release_mappings(void) {
    for (int i = 0; i < FUZZ_MAX_MAPPINGS; i++) {
        free(fuzz_mappings[i]);
        fuzz_mappings[i] = NULL;
    }
}

/* run.c's error messages go to /dev/null: thousands of inputs a second are
   rejected. The harness's own messages (and sanitizer reports) still reach
   the real stderr. */
static FILE *fuzz_quiet_stream(void) {
    static FILE *null_stream;
    if (!null_stream) null_stream = fopen("/dev/null", "w");
    if (!null_stream) abort();
    return null_stream;
}

#define mmap fuzz_mmap
#define munmap fuzz_munmap
#define madvise fuzz_madvise
#undef stderr
#define stderr fuzz_quiet_stream()
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "run.c"
#pragma GCC diagnostic pop
#undef mmap
#undef munmap
#undef madvise
#undef stderr
#define stderr stderr /* as <stdio.h> has it */

#include <setjmp.h>

/* ---- the error trap ----------------------------------------------------- */

/* Targets catch run.c's errors with
       error_trap = &fuzz_trap;
       if (setjmp(fuzz_trap) == 0) { ...calls into run.c...; }
       error_trap = NULL;
   Locals that the calls change and that are read after a caught error must
   be static or volatile (longjmp). */
static jmp_buf fuzz_trap;

/* ---- checks ------------------------------------------------------------- */

/* A failed property: prints it and aborts, which libFuzzer reports as a
   crash with the input saved. */
#define CHECK(cond, ...)                                            \
    do {                                                            \
        if (!(cond)) {                                              \
            fprintf(stderr, "fuzz check failed: %s: ", #cond);     \
            fprintf(stderr, __VA_ARGS__);                           \
            fputc('\n', stderr);                                    \
            abort();                                                \
        }                                                           \
    } while (0)

/* ---- the input as a file ------------------------------------------------ */

static char fuzz_path[256];
static int fuzz_fd = -1;

static inline void remove_input_file(void) {
    if (fuzz_path[0]) unlink(fuzz_path);
}

/* Writes `size` bytes to this process's scratch file; returns its path. */
static inline const char *input_file(const uint8_t *data, size_t size) {
    if (fuzz_fd < 0) {
        const char *dir = getenv("TMPDIR");
        snprintf(fuzz_path, sizeof(fuzz_path), "%s/runc-fuzz-XXXXXX", dir && dir[0] ? dir : "/tmp");
        fuzz_fd = mkstemp(fuzz_path);
        if (fuzz_fd < 0) { perror("fuzz harness: mkstemp"); abort(); }
        atexit(remove_input_file);
    }
    if (ftruncate(fuzz_fd, 0) != 0) { perror("fuzz harness: ftruncate"); abort(); }
    for (size_t done = 0; done < size;) {
        ssize_t w = pwrite(fuzz_fd, data + done, size - done, (off_t)done);
        if (w <= 0) { perror("fuzz harness: pwrite"); abort(); }
        done += (size_t)w;
    }
    return fuzz_path;
}

/* Output of run.c's printing helpers goes nowhere. */
static inline void quiet_stdout(void) {
    if (!freopen("/dev/null", "w", stdout)) abort();
}

/* ---- a model file, loaded and run ----------------------------------------- */

/* Loads the model at `path` (`size` bytes: a checkpoint or a GGUF file),
   checks the target's own properties of the loaded model (check; NULL:
   none) and runs two positions of the forward pass (one batch of two rows,
   then one row) with the context cut to 4 positions, so that a header's
   context cannot ask for huge caches; returns whether that went without an
   error. A weight placed past the end of the file is an ASan report here. */
static inline int load_and_run(const char *path, size_t size, void (*check)(const Transformer *t, size_t size)) {
    static Transformer t; /* static: read after longjmp */
    static BlockTable table;
    volatile int ok = 0;
    error_trap = &fuzz_trap;
    if (setjmp(fuzz_trap) == 0) {
        load_checkpoint(&t, path);
        const Config *p = &t.config;
        CHECK(p->dim > 0 && p->hidden_dim > 0 && p->n_layers > 0 && p->n_heads > 0 && p->n_kv_heads > 0 &&
                  p->vocab_size > 0 && p->seq_len > 0,
              "a loaded config has a non-positive field");
        CHECK(p->dim % p->n_heads == 0 && p->n_heads % p->n_kv_heads == 0 && (p->dim / p->n_heads) % 2 == 0,
              "a loaded config has inconsistent heads");
        if (check) check(&t, size);
        t.config.seq_len = 4; /* only the state's size depends on it now */
        alloc_run_state(&t.state, &t.config, 2, t.config.seq_len, 1, 0, KV_F32);
        int tokens[3] = {0, t.config.vocab_size - 1, t.config.vocab_size / 2};
        forward_rows(&t, &table, tokens, 2, 0, 1);
        forward_rows(&t, &table, tokens + 2, 1, 2, 0);
        ok = 1;
    }
    error_trap = NULL;
    table_free(&t.state.cache, &table);
    free_run_state(&t.state);
    free_transformer(&t);
    release_mappings();
    return ok;
}

/* The harness itself must work: the valid seed `name` of `target`'s corpus
   (FUZZ_CORPUS, default tests/fuzz/corpus) loads and runs, or the target
   stops at once instead of rejecting every input without a word (as when
   run.c starts mapping memory in a new way). */
static inline void check_model_seed(const char *target, const char *name, void (*check)(const Transformer *t, size_t size)) {
    const char *corpus = getenv("FUZZ_CORPUS");
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s/%s", corpus && corpus[0] ? corpus : "tests/fuzz/corpus", target, name);
    FILE *f = fopen(path, "rb");
    if (!f) return; /* not run from the repository root: no check */
    static uint8_t data[1 << 16];
    size_t n = fread(data, 1, sizeof(data), f);
    fclose(f);
    if (!load_and_run(input_file(data, n), n, check)) {
        fprintf(stderr, "fuzz_%s: the valid seed %s does not load and run: the harness is broken\n", target, path);
        abort();
    }
}

#endif
