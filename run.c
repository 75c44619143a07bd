/* run.c - inference for Llama-architecture language models, in one C11 file.

   USAGE
     ./run checkpoint.bin [options]           (./run --help lists the options)
     ./run stories260K.bin -z tok512.bin -i "Once upon a time"
     ./run model.bin -m chat -y "You are a helpful assistant."

   WHAT IS IN HERE, IN READING ORDER
     1. data structures: Config, Matrix, Weights, RunState, Transformer
     2. checkpoint loading: mmap, header validation, weight mapping
     3. kernels: rmsnorm, softmax, matmul, rope, attention (the math in comments)
     4. the forward pass over a batch of rows (prompt blocks or beams)
     5. the BPE tokenizer (llama2.c's tokenizer.bin)
     6. samplers: greedy, temperature, top-p, and beam search
     7. generation loops: generate and chat
     8. the command line

   BUILD OPTIONS
     -fopenmp        threads over matrix rows (set the count with -T)
     -march=native   AVX2 or AVX-512 matmul kernels where the machine has them
                     (otherwise plain C, summed in llama2.c's order)
     -DTESTING       leaves out main(), so tests can #include "run.c"

   Output is byte-identical to karpathy's llama2.c run.c for the same checkpoint,
   tokenizer, flags and seed (built as `make run`: no -march, no fast-math);
   unlike it, every input is validated and every failure is a one-line error
   with a non-zero exit status (1: bad file or runtime failure, 2: bad usage). */

#define _POSIX_C_SOURCE 200809L
#define _DEFAULT_SOURCE /* madvise */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
/* the loop that follows split in equal ranges between threads, or run on one
   thread when `cond` is false (too little work) */
#define PRAGMA(text) _Pragma(#text)
#define PARALLEL_FOR_IF(cond) PRAGMA(omp parallel for schedule(static) if (cond))
static int max_threads(void) { return omp_get_max_threads(); }
#else
#define PARALLEL_FOR_IF(cond)
static int max_threads(void) { return 1; }
#endif

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

enum { EXIT_BAD_FILE = 1, EXIT_USAGE = 2 };

#ifdef TESTING
#include <setjmp.h>
/* Unit tests and fuzz targets set error_trap to catch errors instead of
   exiting; error_status then holds the exit status that would have been. */
static jmp_buf *error_trap;
static int error_status;
#endif

/* Ends the program with `status`, or returns to the test's trap. */
static void leave(int status) {
#ifdef TESTING
    if (error_trap) {
        error_status = status;
        longjmp(*error_trap, 1);
    }
#endif
    exit(status);
}

/* Prints "run: <message>" on one line of stderr and exits with `status`. */
static void die(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("run: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    leave(status);
}

static void *xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) die(EXIT_BAD_FILE, "out of memory (%zu x %zu bytes)", count, size);
    return p;
}

/* ------------------------------------------------------------------------ */
/* 1. Data structures                                                       */
/* ------------------------------------------------------------------------ */

typedef struct {
    int dim;        /* transformer width */
    int hidden_dim; /* FFN inner width */
    int n_layers;
    int n_heads;    /* query heads */
    int n_kv_heads; /* key/value heads: n_heads (MHA), fewer (GQA) or 1 (MQA) */
    int vocab_size;
    int seq_len;    /* maximum context length */
} Config;

/* A weight matrix W of shape (rows, cols), row-major, applied as W @ x:
   float32 values, or int8 values in groups of group_size consecutive values
   of a row, value = q * scale of its group ("Q8_0"). */
typedef struct {
    const float *w;     /* float32: (rows, cols); NULL for int8 */
    const int8_t *q;    /* int8: (rows, cols) */
    const char *scales; /* int8: (rows * cols / group_size) float32, maybe unaligned */
    int rows, cols;
    int group_size;     /* 0 for float32 */
} Matrix;

typedef struct {
    Matrix token_embedding;       /* (vocab_size, dim) */
    const float *rms_att;         /* (n_layers, dim) */
    const float *rms_ffn;         /* (n_layers, dim) */
    const float *rms_final;       /* (dim) */
    Matrix *wq;  /* n_layers x (dim, dim) */
    Matrix *wk;  /* n_layers x (kv_dim, dim) */
    Matrix *wv;  /* n_layers x (kv_dim, dim) */
    Matrix *wo;  /* n_layers x (dim, dim) */
    Matrix *w1;  /* n_layers x (hidden_dim, dim) */
    Matrix *w2;  /* n_layers x (dim, hidden_dim) */
    Matrix *w3;  /* n_layers x (hidden_dim, dim) */
    Matrix wcls; /* (vocab_size, dim): the embedding itself when shared */
} Weights;

/* Activations for up to max_rows rows processed together (the tokens of a
   prompt block, or the beams of a beam search), and the key/value cache.
   The cache has one "slot" per beam: slot s holds, for every layer and
   position, the key and value computed by the sequence running in slot s. */
typedef struct {
    int max_rows;
    int n_slots;
    int context;    /* positions the cache holds: the -n steps, at most seq_len */
    float *x;       /* (max_rows, dim) residual stream */
    float *xb;      /* (max_rows, dim) normalised input / attention output */
    float *xb2;     /* (max_rows, dim) projection output */
    float *hb;      /* (max_rows, hidden_dim) FFN gate */
    float *hb2;     /* (max_rows, hidden_dim) FFN up */
    float *q;       /* (max_rows, dim) queries */
    float *k;       /* (max_rows, kv_dim) keys of the rows, before caching */
    float *v;       /* (max_rows, kv_dim) values of the rows, before caching */
    float *att;     /* (max_rows, n_heads, context) attention weights */
    float *logits;  /* (max_rows, vocab_size) */
    float *key_cache;   /* (n_layers, n_slots, context, kv_dim) */
    float *value_cache; /* (n_layers, n_slots, context, kv_dim) */
} RunState;

typedef struct {
    Config config;
    int version;      /* 0 legacy, 1 float32 "ak42", 2 int8 "ak42" */
    int group_size;   /* version 2: int8 values per float32 scale */
    Weights weights;
    RunState state;
    void *mapping;    /* the whole checkpoint file, mmap'ed read-only */
    size_t file_size;
} Transformer;

/* ------------------------------------------------------------------------ */
/* 2. Checkpoint loading                                                    */
/* ------------------------------------------------------------------------ */

#define AK42_MAGIC 0x616b3432u
#define AK42_HEADER_BYTES 256
#define LEGACY_HEADER_BYTES 28

/* A cursor over the mapped file that refuses to run past its end. */
typedef struct {
    const char *base;
    size_t size, offset;
    const char *path;
} FileCursor;

/* Returns a pointer to the next `bytes` bytes and advances, or dies when the
   file is shorter than that. */
static const char *take_bytes(FileCursor *c, uint64_t bytes, const char *what) {
    if (c->offset > c->size || bytes > c->size - c->offset)
        die(EXIT_BAD_FILE, "%s: truncated checkpoint: %s needs %llu bytes at offset %zu, file has %zu",
            c->path, what, (unsigned long long)bytes, c->offset, c->size);
    const char *p = c->base + c->offset;
    c->offset += bytes;
    return p;
}

/* The next `count` floats. Every float array starts at a multiple of 4 bytes:
   after a 28- or 256-byte header, float arrays, or (version 2) the norms. */
static const float *take_floats(FileCursor *c, uint64_t count, const char *what) {
    return (const float *)take_bytes(c, count * sizeof(float), what);
}

/* The next matrix: float32 values, or (group_size > 0) int8 values followed
   by their float32 scales, one per group of group_size values. */
static Matrix take_matrix(FileCursor *c, int rows, int cols, int group_size, const char *what) {
    uint64_t count = (uint64_t)rows * (uint64_t)cols;
    if (group_size == 0) return (Matrix){take_floats(c, count, what), NULL, NULL, rows, cols, 0};
    const int8_t *q = (const int8_t *)take_bytes(c, count, what);
    const char *scales = take_bytes(c, count / (uint64_t)group_size * sizeof(float), what);
    return (Matrix){NULL, q, scales, rows, cols, group_size};
}

static int32_t read_i32(const char *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Checks the header fields. Every array in the file is the product of at most
   two positive int32 fields, so its float count is below 2^62 and its byte
   count below 2^64: sizes cannot wrap, and take_floats compares each one with
   what is left of the file before it is used. */
static void validate_config(const Config *p, const char *path) {
    const int fields[] = {p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads, p->vocab_size, p->seq_len};
    const char *names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    for (int i = 0; i < 7; i++)
        if (fields[i] <= 0) die(EXIT_BAD_FILE, "%s: bad header: %s is %d, must be positive", path, names[i], fields[i]);
    if (p->dim % p->n_heads != 0)
        die(EXIT_BAD_FILE, "%s: bad header: dim %d is not divisible by n_heads %d", path, p->dim, p->n_heads);
    if (p->n_heads % p->n_kv_heads != 0)
        die(EXIT_BAD_FILE, "%s: bad header: n_heads %d is not divisible by n_kv_heads %d", path, p->n_heads, p->n_kv_heads);
    if ((p->dim / p->n_heads) % 2 != 0)
        die(EXIT_BAD_FILE, "%s: bad header: head size %d is odd (RoPE rotates pairs)", path, p->dim / p->n_heads);
    if (p->vocab_size < 3)
        die(EXIT_BAD_FILE, "%s: bad header: vocab_size %d has no room for BOS (1) and EOS (2)", path, p->vocab_size);
}

static Matrix *map_layer_matrices(FileCursor *c, int n_layers, int rows, int cols, int group_size, const char *what) {
    Matrix *m = xcalloc((size_t)n_layers, sizeof(Matrix));
    for (int l = 0; l < n_layers; l++) m[l] = take_matrix(c, rows, cols, group_size, what);
    return m;
}

/* Maps the arrays in the order of the legacy (version 0) or the "ak42"
   layout (version 1 float32, version 2 int8 matrices with float32 norms). */
static void map_weights(Transformer *t, FileCursor *c, int shared_classifier) {
    const Config *p = &t->config;
    Weights *w = &t->weights;
    int head_size = p->dim / p->n_heads;
    int kv_dim = head_size * p->n_kv_heads;
    uint64_t L = (uint64_t)p->n_layers, dim = (uint64_t)p->dim;
    int gs = t->group_size;
    if (t->version >= 1) {
        w->rms_att = take_floats(c, L * dim, "rms_att");
        w->rms_ffn = take_floats(c, L * dim, "rms_ffn");
        w->rms_final = take_floats(c, dim, "rms_final");
        w->token_embedding = take_matrix(c, p->vocab_size, p->dim, gs, "token_embedding");
    } else {
        w->token_embedding = take_matrix(c, p->vocab_size, p->dim, gs, "token_embedding");
        w->rms_att = take_floats(c, L * dim, "rms_att");
    }
    w->wq = map_layer_matrices(c, p->n_layers, p->dim, p->dim, gs, "wq");
    w->wk = map_layer_matrices(c, p->n_layers, kv_dim, p->dim, gs, "wk");
    w->wv = map_layer_matrices(c, p->n_layers, kv_dim, p->dim, gs, "wv");
    w->wo = map_layer_matrices(c, p->n_layers, p->dim, p->dim, gs, "wo");
    if (t->version == 0) w->rms_ffn = take_floats(c, L * dim, "rms_ffn");
    w->w1 = map_layer_matrices(c, p->n_layers, p->hidden_dim, p->dim, gs, "w1");
    w->w2 = map_layer_matrices(c, p->n_layers, p->dim, p->hidden_dim, gs, "w2");
    w->w3 = map_layer_matrices(c, p->n_layers, p->hidden_dim, p->dim, gs, "w3");
    if (t->version == 0) {
        w->rms_final = take_floats(c, dim, "rms_final");
        /* two RoPE tables (seq_len, head_size / 2) that run.c recomputes */
        take_floats(c, (uint64_t)p->seq_len * (uint64_t)head_size, "rope tables");
    }
    w->wcls = shared_classifier ? w->token_embedding : take_matrix(c, p->vocab_size, p->dim, gs, "classifier");
}

/* Reads the header at the start of the mapping into t->config and returns
   whether the classifier is shared with the embedding; positions the cursor
   at the first weight. */
static int read_header(Transformer *t, FileCursor *c) {
    uint32_t magic;
    if (c->size < LEGACY_HEADER_BYTES)
        die(EXIT_BAD_FILE, "%s: truncated checkpoint: %zu bytes is shorter than any header", c->path, c->size);
    memcpy(&magic, c->base, 4);
    int32_t h[7];
    int shared;
    if (magic == AK42_MAGIC) {
        if (c->size < AK42_HEADER_BYTES)
            die(EXIT_BAD_FILE, "%s: truncated checkpoint: header needs %d bytes, file has %zu", c->path, AK42_HEADER_BYTES, c->size);
        int32_t version = read_i32(c->base + 4);
        if (version != 1 && version != 2)
            die(EXIT_BAD_FILE, "%s: unknown checkpoint version %d (this program reads 1 and 2)", c->path, version);
        for (int i = 0; i < 7; i++) h[i] = read_i32(c->base + 8 + 4 * i);
        shared = (unsigned char)c->base[36] != 0;
        t->version = version;
        if (version == 2) t->group_size = read_i32(c->base + 37);
        c->offset = AK42_HEADER_BYTES;
    } else {
        for (int i = 0; i < 7; i++) h[i] = read_i32(c->base + 4 * i);
        /* a negative vocab_size means a separate classifier follows */
        shared = h[5] > 0;
        if (h[5] < 0 && h[5] != INT32_MIN) h[5] = -h[5];
        t->version = 0;
        c->offset = LEGACY_HEADER_BYTES;
    }
    t->config = (Config){h[0], h[1], h[2], h[3], h[4], h[5], h[6]};
    validate_config(&t->config, c->path);
    /* whole groups in every row; an int32 group sum of products of int8
       values (|q| <= 127) stays below 2^31 */
    int gs = t->group_size;
    if (t->version == 2 && (gs <= 0 || t->config.dim % gs != 0 || t->config.hidden_dim % gs != 0))
        die(EXIT_BAD_FILE, "%s: bad header: group size %d does not divide dim %d and hidden_dim %d",
            c->path, gs, t->config.dim, t->config.hidden_dim);
    if (gs > 65536) die(EXIT_BAD_FILE, "%s: bad header: group size %d is above 65536", c->path, gs);
    return shared;
}

static void *map_file(const char *path, size_t *size, const char *kind) {
    int fd = open(path, O_RDONLY | O_NONBLOCK); /* a FIFO must not block here: it is rejected below */
    if (fd < 0) die(EXIT_BAD_FILE, "%s: cannot open %s: %s", path, kind, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        die(EXIT_BAD_FILE, "%s: %s is not a regular file", path, kind);
    }
    *size = (size_t)st.st_size;
    if (*size == 0) {
        close(fd);
        die(EXIT_BAD_FILE, "%s: %s is empty", path, kind);
    }
    void *data = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (data == MAP_FAILED) die(EXIT_BAD_FILE, "%s: cannot map %s: %s", path, kind, strerror(errno));
    /* advice only: 2 MB pages where the file system has them (streaming the
       weights then misses the TLB 512 times less often), and every page read
       and mapped now rather than faulted in during the first tokens */
#ifdef MADV_HUGEPAGE /* Linux */
    madvise(data, *size, MADV_HUGEPAGE);
#endif
#ifdef MADV_POPULATE_READ /* Linux 5.14 */
    madvise(data, *size, MADV_POPULATE_READ);
#endif
    return data;
}

static void load_checkpoint(Transformer *t, const char *path) {
    memset(t, 0, sizeof(*t));
    t->mapping = map_file(path, &t->file_size, "checkpoint");
    FileCursor c = {t->mapping, t->file_size, 0, path};
    int shared = read_header(t, &c);
    map_weights(t, &c, shared);
}

/* Allocates activations for `max_rows` rows at once and a cache with
   `n_slots` slots of `context` positions (no more than the run will use, so
   that a long seq_len costs nothing when -n is small). */
static void alloc_run_state(RunState *s, const Config *p, int max_rows, int n_slots, int context) {
    int kv_dim = p->dim / p->n_heads * p->n_kv_heads;
    size_t rows = (size_t)max_rows;
    /* the cache has four factors: check its size in floating point first */
    double cache_bytes = 2.0 * sizeof(float) * p->n_layers * (double)n_slots * context * kv_dim;
    if (cache_bytes > (double)(SIZE_MAX / 4))
        die(EXIT_BAD_FILE, "the key/value cache would need %.3g bytes, too large for this machine", cache_bytes);
    size_t cache = (size_t)p->n_layers * (size_t)n_slots * (size_t)context * (size_t)kv_dim;
    s->max_rows = max_rows;
    s->n_slots = n_slots;
    s->context = context;
    s->x = xcalloc(rows * p->dim, sizeof(float));
    s->xb = xcalloc(rows * p->dim, sizeof(float));
    s->xb2 = xcalloc(rows * p->dim, sizeof(float));
    s->hb = xcalloc(rows * p->hidden_dim, sizeof(float));
    s->hb2 = xcalloc(rows * p->hidden_dim, sizeof(float));
    s->q = xcalloc(rows * p->dim, sizeof(float));
    s->k = xcalloc(rows * kv_dim, sizeof(float));
    s->v = xcalloc(rows * kv_dim, sizeof(float));
    s->att = xcalloc(rows * (size_t)p->n_heads * (size_t)context, sizeof(float));
    s->logits = xcalloc(rows * (size_t)p->vocab_size, sizeof(float));
    s->key_cache = xcalloc(cache, sizeof(float));
    s->value_cache = xcalloc(cache, sizeof(float));
}

static void free_run_state(RunState *s) {
    free(s->x); free(s->xb); free(s->xb2); free(s->hb); free(s->hb2);
    free(s->q); free(s->k); free(s->v); free(s->att); free(s->logits);
    free(s->key_cache); free(s->value_cache);
    memset(s, 0, sizeof(*s));
}

static void free_transformer(Transformer *t) {
    Weights *w = &t->weights;
    free(w->wq); free(w->wk); free(w->wv); free(w->wo);
    free(w->w1); free(w->w2); free(w->w3);
    free_run_state(&t->state);
    if (t->mapping) munmap(t->mapping, t->file_size);
    memset(t, 0, sizeof(*t));
}

/* ------------------------------------------------------------------------ */
/* 3. Kernels                                                               */
/* ------------------------------------------------------------------------ */

/* o = w * x / sqrt(mean(x^2) + 1e-5), for one row of `size` values. */
static void rmsnorm(float *o, const float *x, const float *w, int size) {
    float ss = 0.0f;
    for (int j = 0; j < size; j++) ss += x[j] * x[j];
    ss /= size;
    ss += 1e-5f;
    ss = 1.0f / sqrtf(ss);
    for (int j = 0; j < size; j++) o[j] = w[j] * (ss * x[j]);
}

/* x = exp(x - max(x)) / sum(exp(x - max(x))), in place. */
static void softmax(float *x, int size) {
    float max_val = x[0];
    for (int i = 1; i < size; i++)
        if (x[i] > max_val) max_val = x[i];
    float sum = 0.0f;
    for (int i = 0; i < size; i++) {
        x[i] = expf(x[i] - max_val);
        sum += x[i];
    }
    for (int i = 0; i < size; i++) x[i] /= sum;
}

/* ---- Matrix multiplication -------------------------------------------------
   matmul(out, x, W, n): out (n, W.rows) = x (n, W.cols) @ W^T, that is
     out[b][i] = sum_j W[i][j] * x[b][j]
   for n input rows at once (1 when decoding, a prompt block, or the beams):
   each row of W is read from memory once for all n of them.

   float32 weights: the plain C kernel sums each output left to right, as
   llama2.c does, so the default build prints exactly what llama2.c prints.
   The vector kernels (AVX2, AVX-512) keep one vector accumulator per output,
   add the products of the next SIMD_WIDTH columns to it lane by lane, and add
   up its lanes at the end: the same order for every n, so a prompt read in
   blocks gives the same logits as one read token by token.

   int8 weights ("Q8_0", as llama2.c's runq.c): each input row is quantised in
   groups of group_size values, x ~ xq * xs with xs = max|x| / 127 and
   xq = round(x / xs) in -127..127; then, with exact integer sums per group g,
     out[b][i] = sum_g (sum_{j in g} wq[i][j] * xq[b][j]) * ws[i][g] * xs[b][g] */

/* Starts loading the `bytes` bytes at p into the cache ahead of their use,
   where the compiler offers it (GCC, Clang; inlined by force, as GCC drops
   the calls of a function that does nothing but prefetch). */
#if defined(__GNUC__)
static inline __attribute__((always_inline)) void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}
#else
static void prefetch(const void *p, size_t bytes) { (void)p; (void)bytes; }
#endif

/* A matmul of fewer multiply-adds than this runs on one thread: waking the
   others would cost more than it saves. */
#define PARALLEL_MIN_WORK 100000.0
#define PARALLEL_WORK(W, n) ((double)(W)->rows * (W)->cols * (n) >= PARALLEL_MIN_WORK)

/* The float32 scale of group g of an int8 matrix (read bytewise: scales
   follow int8 arrays, so they need not be 4-byte aligned). */
static float group_scale(const Matrix *W, size_t g) {
    float s;
    memcpy(&s, W->scales + g * sizeof(float), sizeof(float));
    return s;
}

/* out = row `row` of W in float32: int8 values times their group's scale. */
static void matrix_row(float *out, const Matrix *W, int row) {
    size_t at = (size_t)row * W->cols;
    if (W->group_size == 0) {
        memcpy(out, W->w + at, (size_t)W->cols * sizeof(float));
        return;
    }
    for (int j = 0; j < W->cols; j++) out[j] = W->q[at + j] * group_scale(W, (at + j) / W->group_size);
}

/* Quantises `count` values (whole groups of gs) as described above: per
   group xs = max|x| / 127 and xq = round(x / xs), 0 for an all-zero group.
   xq is int16 so that vector kernels multiply it with widened weights. */
static void quantize_groups(int16_t *xq, float *xs, const float *x, size_t count, int gs) {
    for (size_t g = 0; g < count / gs; g++) {
        const float *v = x + g * gs;
        float amax = 0.0f;
        for (int j = 0; j < gs; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]);
        float scale = amax / 127.0f;
        xs[g] = scale;
        for (int j = 0; j < gs; j++) {
            float q = scale > 0.0f ? roundf(v[j] / scale) : 0.0f;
            /* in -127..127 unless x holds NaN or infinities (a broken
               model): those become 0 rather than an undefined conversion */
            xq[g * gs + j] = q >= -127.0f && q <= 127.0f ? (int16_t)q : 0;
        }
    }
}

/* Plain C, float32: each output summed left to right. */
static void matmul_f32_plain(float *out, const float *x, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int i = 0; i < rows; i++) {
        const float *w = W->w + (size_t)i * cols;
        for (int b = 0; b < n; b++) {
            const float *xr = x + (size_t)b * cols;
            float val = 0.0f;
            for (int j = 0; j < cols; j++) val += w[j] * xr[j];
            out[(size_t)b * rows + i] = val;
        }
    }
}

/* Plain C, int8: groups in order, as runq.c sums them. */
static void matmul_q8_plain(float *out, const int16_t *xq, const float *xs, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols, gs = W->group_size, groups = cols / gs;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int i = 0; i < rows; i++) {
        const int8_t *w = W->q + (size_t)i * cols;
        for (int b = 0; b < n; b++) {
            const int16_t *q = xq + (size_t)b * cols;
            float val = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t ival = 0;
                for (int j = g * gs; j < (g + 1) * gs; j++) ival += w[j] * q[j];
                val += (float)ival * group_scale(W, (size_t)i * groups + g) * xs[(size_t)b * groups + g];
            }
            out[(size_t)b * rows + i] = val;
        }
    }
}

/* Vector types and operations, when the compiler targets AVX-512 or AVX2:
   vfloat holds SIMD_WIDTH floats; vint SIMD_WIDTH int32 or twice as many
   int16. Each kernel block computes MM_ROWS weight rows times MM_INPUTS
   (float32) or QMM_INPUTS (int8) input rows, as many accumulators as the
   registers hold (32 vector registers with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SIMD_WIDTH 16
#define MM_INPUTS 4
#define QMM_INPUTS 2
typedef __m512 vfloat;
typedef __m512i vint;
static inline vfloat vf_zero(void) { return _mm512_setzero_ps(); }
static inline vfloat vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vfloat vf_set(float v) { return _mm512_set1_ps(v); }
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vfloat v) { return _mm512_reduce_add_ps(v); }
static inline vint vi_zero(void) { return _mm512_setzero_si512(); }
static inline vint vi_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vint vi_load_i16(const int16_t *p) { return _mm512_loadu_si512(p); }
static inline vfloat vi_to_float(vint v) { return _mm512_cvtepi32_ps(v); }
/* int32 lane k += a[2k] * b[2k] + a[2k+1] * b[2k+1] (int16 a, b) */
static inline vint vi_dot(vint acc, vint a, vint b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIMD_WIDTH 8
#define MM_INPUTS 2
#define QMM_INPUTS 1
typedef __m256 vfloat;
typedef __m256i vint;
static inline vfloat vf_zero(void) { return _mm256_setzero_ps(); }
static inline vfloat vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vfloat vf_set(float v) { return _mm256_set1_ps(v); }
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vf_sum(vfloat v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vint vi_zero(void) { return _mm256_setzero_si256(); }
static inline vint vi_load_i8(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vint vi_load_i16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vfloat vi_to_float(vint v) { return _mm256_cvtepi32_ps(v); }
static inline vint vi_dot(vint acc, vint a, vint b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

#ifdef SIMD_WIDTH
#define MM_ROWS 4
/* Always inlined, so that NB is a constant in every copy: the loops over
   rows and inputs unroll and the accumulators live in registers. */
#define KERNEL static inline __attribute__((always_inline))

/* out[b * stride + r] = W_r . x_b for the MM_ROWS rows of W from w (the last
   one repeated when only n_rows remain) and the NB input rows from x (the
   last repeated past n_in); cols is a multiple of SIMD_WIDTH.
   A block reads MM_ROWS short streams (a row of int8 is about a kilobyte),
   too short for the hardware prefetchers to follow: the kernels prefetch
   `next`, the next block of rows (the last block: its own rows), as many
   bytes at a time as they read. */
KERNEL void block_f32(float *out, size_t stride, const float *w, int n_rows, const float *next, const float *x, int n_in, int cols,
                      const int NB) {
    const float *wr[MM_ROWS], *xr[MM_INPUTS];
    vfloat acc[MM_ROWS][MM_INPUTS];
    for (int r = 0; r < MM_ROWS; r++) wr[r] = w + (size_t)(r < n_rows ? r : n_rows - 1) * cols;
    for (int b = 0; b < NB; b++) xr[b] = x + (size_t)(b < n_in ? b : n_in - 1) * cols;
    for (int r = 0; r < MM_ROWS; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = vf_zero();
    for (int j = 0; j < cols; j += SIMD_WIDTH) {
        vfloat xv[MM_INPUTS];
        for (int b = 0; b < NB; b++) xv[b] = vf_load(xr[b] + j);
        prefetch(next + (size_t)MM_ROWS * j, MM_ROWS * SIMD_WIDTH * sizeof(float));
        for (int r = 0; r < MM_ROWS; r++) {
            vfloat wv = vf_load(wr[r] + j);
            for (int b = 0; b < NB; b++) acc[r][b] = vf_fma(wv, xv[b], acc[r][b]);
        }
    }
    for (int r = 0; r < n_rows; r++)
        for (int b = 0; b < NB && b < n_in; b++) out[b * stride + r] = vf_sum(acc[r][b]);
}

/* The same for int8 rows i.. of W and quantised inputs: per group, exact
   int32 sums of products (two columns per lane), then
   acc += float(sum) * ws * xs lane by lane; group_size is a multiple of
   2 * SIMD_WIDTH. */
KERNEL void block_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const int8_t *next, const int16_t *xq,
                     const float *xs, int n_in, const int NB) {
    const int cols = W->cols, gs = W->group_size, groups = cols / gs;
    const int8_t *wr[MM_ROWS];
    const int16_t *xr[QMM_INPUTS];
    const float *sr[QMM_INPUTS];
    size_t wg[MM_ROWS];
    vfloat acc[MM_ROWS][QMM_INPUTS];
    for (int r = 0; r < MM_ROWS; r++) {
        size_t row = (size_t)i + (r < n_rows ? r : n_rows - 1);
        wr[r] = W->q + row * cols;
        wg[r] = row * groups;
    }
    for (int b = 0; b < NB; b++) {
        int in = b < n_in ? b : n_in - 1;
        xr[b] = xq + (size_t)in * cols;
        sr[b] = xs + (size_t)in * groups;
    }
    for (int r = 0; r < MM_ROWS; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = vf_zero();
    for (int g = 0; g < groups; g++) {
        vint isum[MM_ROWS][QMM_INPUTS];
        for (int r = 0; r < MM_ROWS; r++)
            for (int b = 0; b < NB; b++) isum[r][b] = vi_zero();
        for (int j = g * gs; j < (g + 1) * gs; j += 2 * SIMD_WIDTH) {
            prefetch(next + (size_t)MM_ROWS * j, MM_ROWS * 2 * SIMD_WIDTH);
            for (int r = 0; r < MM_ROWS; r++) {
                vint wv = vi_load_i8(wr[r] + j);
                for (int b = 0; b < NB; b++) isum[r][b] = vi_dot(isum[r][b], wv, vi_load_i16(xr[b] + j));
            }
        }
        for (int r = 0; r < MM_ROWS; r++) {
            float ws = group_scale(W, wg[r] + g);
            for (int b = 0; b < NB; b++) acc[r][b] = vf_fma(vi_to_float(isum[r][b]), vf_set(ws * sr[b][g]), acc[r][b]);
        }
    }
    for (int r = 0; r < n_rows; r++)
        for (int b = 0; b < NB && b < n_in; b++) out[b * stride + r] = vf_sum(acc[r][b]);
}

/* Blocks of MM_ROWS rows of W, split between threads; in each, all input
   rows, while the block's weights stay in the L1 cache. */
static void matmul_f32_simd(float *out, const float *x, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols, n_blocks = (rows + MM_ROWS - 1) / MM_ROWS;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int blk = 0; blk < n_blocks; blk++) {
        int i = blk * MM_ROWS, n_rows = rows - i < MM_ROWS ? rows - i : MM_ROWS;
        const float *w = W->w + (size_t)i * cols, *next = blk + 1 < n_blocks ? w + (size_t)MM_ROWS * cols : w;
        if (n == 1) {
            block_f32(out + i, (size_t)rows, w, n_rows, next, x, 1, cols, 1);
            continue;
        }
        for (int b = 0; b < n; b += MM_INPUTS)
            block_f32(out + (size_t)b * rows + i, (size_t)rows, w, n_rows, next, x + (size_t)b * cols, n - b, cols, MM_INPUTS);
    }
}

/* The same with int8 weights and quantised inputs. */
static void matmul_q8_simd(float *out, const int16_t *xq, const float *xs, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols, groups = cols / W->group_size;
    const int n_blocks = (rows + MM_ROWS - 1) / MM_ROWS;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int blk = 0; blk < n_blocks; blk++) {
        int i = blk * MM_ROWS, n_rows = rows - i < MM_ROWS ? rows - i : MM_ROWS;
        const int8_t *next = W->q + (size_t)(blk + 1 < n_blocks ? i + MM_ROWS : i) * cols;
        if (n == 1) {
            block_q8(out + i, (size_t)rows, W, i, n_rows, next, xq, xs, 1, 1);
            continue;
        }
        for (int b = 0; b < n; b += QMM_INPUTS)
            block_q8(out + (size_t)b * rows + i, (size_t)rows, W, i, n_rows, next, xq + (size_t)b * cols,
                     xs + (size_t)b * groups, n - b, QMM_INPUTS);
    }
}
#endif

/* out (n, W.rows) = x (n, W.cols) @ W^T with the fastest kernel that fits:
   the vector kernels need the columns (float32) or the groups (int8) to be
   whole vectors. */
static void matmul(float *out, const float *x, const Matrix *W, int n) {
    if (W->group_size == 0) {
#ifdef SIMD_WIDTH
        if (W->cols % SIMD_WIDTH == 0) {
            matmul_f32_simd(out, x, W, n);
            return;
        }
#endif
        matmul_f32_plain(out, x, W, n);
        return;
    }
    size_t count = (size_t)n * W->cols;
    int16_t *xq = xcalloc(count, sizeof(int16_t));
    float *xs = xcalloc(count / W->group_size, sizeof(float));
    quantize_groups(xq, xs, x, count, W->group_size);
#ifdef SIMD_WIDTH
    if (W->group_size % (2 * SIMD_WIDTH) == 0) matmul_q8_simd(out, xq, xs, W, n);
    else matmul_q8_plain(out, xq, xs, W, n);
#else
    matmul_q8_plain(out, xq, xs, W, n);
#endif
    free(xq);
    free(xs);
}

/* Rotary position embedding on adjacent pairs: for the pair (v[2i], v[2i+1])
   at offset d = 2i mod head_size inside its head, rotate by the angle
   pos / 10000^(d / head_size). q (dim values) is rotated in all heads and k
   (kv_dim values) in the key heads; each angle's cosine and sine are
   computed once for all the heads. */
static void rope(float *q, float *k, int pos, int dim, int kv_dim, int head_size) {
    for (int head_dim = 0; head_dim < head_size; head_dim += 2) {
        float freq = 1.0f / powf(10000.0f, head_dim / (float)head_size);
        float val = pos * freq;
        float fcr = cosf(val), fci = sinf(val);
        for (int i = head_dim; i < dim; i += head_size) {
            int n_vectors = i < kv_dim ? 2 : 1;
            for (int v = 0; v < n_vectors; v++) {
                float *vec = v == 0 ? q : k;
                float v0 = vec[i], v1 = vec[i + 1];
                vec[i] = v0 * fcr - v1 * fci;
                vec[i + 1] = v0 * fci + v1 * fcr;
            }
        }
    }
}

/* ------------------------------------------------------------------------ */
/* 4. The forward pass                                                      */
/* ------------------------------------------------------------------------ */

/* A batch of rows to push through the transformer together. Row r is token
   token[r] at position pos[r]; its key and value are written to cache slot
   slot[r]. Its attention reads positions 0..pos[r]: position pos[r] from its
   own slot, and each earlier position t from slot history[r * context + t],
   or from its own slot when history is NULL (a single sequence). */
typedef struct {
    int n_rows;
    const int *token;
    const int *pos;
    const int *slot;
    const int *history;
    int n_logits; /* logits are computed for the last n_logits rows only */
} Batch;

static size_t cache_offset(const Config *p, const RunState *s, int layer, int slot, int pos) {
    size_t kv_dim = (size_t)(p->dim / p->n_heads * p->n_kv_heads);
    return (((size_t)layer * s->n_slots + slot) * s->context + pos) * kv_dim;
}

/* Where in the caches row r of the batch reads position tp: its own slot, or
   the slot the history names (see Batch). */
static size_t attended_offset(const Transformer *t, const Batch *b, int layer, int r, int tp) {
    const Config *p = &t->config;
    int slot = (b->history && tp < b->pos[r]) ? b->history[(size_t)r * t->state.context + tp] : b->slot[r];
    return cache_offset(p, &t->state, layer, slot, tp);
}

/* Positions ahead whose keys or values attention prefetches: it reads the
   cache at a stride of kv_dim floats, which hardware prefetchers follow
   poorly. */
#define ATTENTION_PREFETCH 16

/* Multi-head attention of every row, reading keys and values from the cache:
   for each head h, with key head h / (n_heads / n_kv_heads),
     att[t] = softmax_t(q_h . k_t / sqrt(head_size)),  xb_h = sum_t att[t] v_t.
   Work items are a row and a range of consecutive heads, as many ranges as
   threads: the heads of a range read one stretch of each cached position,
   and each thread takes one range of every row (in a prompt block, later
   rows attend to more positions). */
static void attention(Transformer *t, const Batch *b, int layer) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const int head_size = p->dim / p->n_heads, kv_mul = p->n_heads / p->n_kv_heads, n_rows = b->n_rows;
    const int threads = max_threads() < p->n_heads ? max_threads() : p->n_heads;
    const int range = (p->n_heads + threads - 1) / threads, n_ranges = (p->n_heads + range - 1) / range;
    double work = 0; /* multiply-adds */
    for (int r = 0; r < n_rows; r++) work += 2.0 * p->dim * (b->pos[r] + 1);
    PARALLEL_FOR_IF(work >= PARALLEL_MIN_WORK)
    for (int item = 0; item < n_ranges * n_rows; item++) {
        const int r = item % n_rows, pos = b->pos[r];
        const int h0 = item / n_rows * range, h1 = h0 + range < p->n_heads ? h0 + range : p->n_heads;
        /* the part of a cached position that heads h0..h1-1 read */
        const size_t kv0 = (size_t)(h0 / kv_mul) * head_size;
        const size_t kv_bytes = ((size_t)((h1 - 1) / kv_mul + 1) * head_size - kv0) * sizeof(float);
        float *att = s->att + (size_t)r * p->n_heads * s->context; /* (n_heads, context) */
        /* the first positions now, later ones ATTENTION_PREFETCH ahead */
        for (int tp = 0; tp < ATTENTION_PREFETCH && tp <= pos; tp++) {
            prefetch(s->key_cache + attended_offset(t, b, layer, r, tp) + kv0, kv_bytes);
            prefetch(s->value_cache + attended_offset(t, b, layer, r, tp) + kv0, kv_bytes);
        }
        for (int tp = 0; tp <= pos; tp++) {
            if (tp + ATTENTION_PREFETCH <= pos)
                prefetch(s->key_cache + attended_offset(t, b, layer, r, tp + ATTENTION_PREFETCH) + kv0, kv_bytes);
            const float *keys = s->key_cache + attended_offset(t, b, layer, r, tp);
            for (int h = h0; h < h1; h++) {
                const float *q = s->q + (size_t)r * p->dim + h * head_size;
                const float *k = keys + (size_t)(h / kv_mul) * head_size;
                float score = 0.0f;
                for (int i = 0; i < head_size; i++) score += q[i] * k[i];
                score /= sqrtf(head_size);
                att[(size_t)h * s->context + tp] = score;
            }
        }
        for (int h = h0; h < h1; h++) {
            softmax(att + (size_t)h * s->context, pos + 1);
            memset(s->xb + (size_t)r * p->dim + h * head_size, 0, head_size * sizeof(float));
        }
        for (int tp = 0; tp <= pos; tp++) {
            if (tp + ATTENTION_PREFETCH <= pos)
                prefetch(s->value_cache + attended_offset(t, b, layer, r, tp + ATTENTION_PREFETCH) + kv0, kv_bytes);
            const float *values = s->value_cache + attended_offset(t, b, layer, r, tp);
            for (int h = h0; h < h1; h++) {
                float *xb = s->xb + (size_t)r * p->dim + h * head_size;
                const float *v = values + (size_t)(h / kv_mul) * head_size;
                float a = att[(size_t)h * s->context + tp];
                for (int i = 0; i < head_size; i++) xb[i] += a * v[i];
            }
        }
    }
}

/* Runs the rows of `b` through every layer; returns the logits
   (b->n_logits, vocab_size) of the last b->n_logits rows. */
static float *forward(Transformer *t, const Batch *b) {
    const Config *p = &t->config;
    const Weights *w = &t->weights;
    RunState *s = &t->state;
    const int dim = p->dim, hidden = p->hidden_dim, n = b->n_rows;
    const int head_size = dim / p->n_heads, kv_dim = head_size * p->n_kv_heads;

    for (int r = 0; r < n; r++)
        matrix_row(s->x + (size_t)r * dim, &w->token_embedding, b->token[r]);

    for (int l = 0; l < p->n_layers; l++) {
        /* attention block: x += wo @ attention(rope(wq @ xb), rope(wk @ xb), wv @ xb) */
        for (int r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * dim, s->x + (size_t)r * dim, w->rms_att + (size_t)l * dim, dim);
        matmul(s->q, s->xb, &w->wq[l], n);
        matmul(s->k, s->xb, &w->wk[l], n);
        matmul(s->v, s->xb, &w->wv[l], n);
        for (int r = 0; r < n; r++) {
            float *k = s->k + (size_t)r * kv_dim, *v = s->v + (size_t)r * kv_dim;
            rope(s->q + (size_t)r * dim, k, b->pos[r], dim, kv_dim, head_size);
            size_t at = cache_offset(p, s, l, b->slot[r], b->pos[r]);
            memcpy(s->key_cache + at, k, kv_dim * sizeof(float));
            memcpy(s->value_cache + at, v, kv_dim * sizeof(float));
        }
        attention(t, b, l);
        matmul(s->xb2, s->xb, &w->wo[l], n);
        for (size_t i = 0; i < (size_t)n * dim; i++) s->x[i] += s->xb2[i];

        /* FFN block: x += w2 @ (silu(w1 @ xb) * (w3 @ xb)), silu(v) = v * sigmoid(v) */
        for (int r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * dim, s->x + (size_t)r * dim, w->rms_ffn + (size_t)l * dim, dim);
        matmul(s->hb, s->xb, &w->w1[l], n);
        matmul(s->hb2, s->xb, &w->w3[l], n);
        /* split between threads for a prompt block: an exponential costs
           about as much as 20 multiply-adds */
        PARALLEL_FOR_IF(20.0 * n * hidden >= PARALLEL_MIN_WORK)
        for (size_t i = 0; i < (size_t)n * hidden; i++) {
            float val = s->hb[i];
            val *= (1.0f / (1.0f + expf(-val)));
            val *= s->hb2[i];
            s->hb[i] = val;
        }
        matmul(s->xb2, s->hb, &w->w2[l], n);
        for (size_t i = 0; i < (size_t)n * dim; i++) s->x[i] += s->xb2[i];
    }

    int first = n - b->n_logits;
    for (int r = first; r < n; r++)
        rmsnorm(s->x + (size_t)r * dim, s->x + (size_t)r * dim, w->rms_final, dim);
    if (b->n_logits > 0) matmul(s->logits, s->x + (size_t)first * dim, &w->wcls, b->n_logits);
    return s->logits;
}

/* Runs one sequence's tokens at positions start.. through the model in blocks
   of up to max_rows rows (cache slot `slot`); returns the logits of the last
   token. */
static float *forward_sequence(Transformer *t, const int *tokens, int n_tokens, int start, int slot) {
    RunState *s = &t->state;
    int *pos = xcalloc((size_t)s->max_rows, sizeof(int));
    int *slots = xcalloc((size_t)s->max_rows, sizeof(int));
    float *logits = NULL;
    for (int done = 0; done < n_tokens;) {
        int rows = n_tokens - done < s->max_rows ? n_tokens - done : s->max_rows;
        for (int r = 0; r < rows; r++) { pos[r] = start + done + r; slots[r] = slot; }
        int last_block = done + rows == n_tokens;
        Batch b = {rows, tokens + done, pos, slots, NULL, last_block ? 1 : 0};
        logits = forward(t, &b);
        done += rows;
    }
    free(pos);
    free(slots);
    return logits;
}

/* Convenience for a single token of sequence slot 0. */
static float *forward_token(Transformer *t, int token, int pos) {
    int slot = 0;
    Batch b = {1, &token, &pos, &slot, NULL, 1};
    return forward(t, &b);
}

/* ------------------------------------------------------------------------ */
/* 5. The BPE tokenizer                                                     */
/* ------------------------------------------------------------------------ */

enum { TOKEN_BOS = 1, TOKEN_EOS = 2, BYTE_TOKEN_OFFSET = 3 };

typedef struct {
    const char *str;
    int id;
} TokenIndex;

typedef struct {
    int vocab_size;
    int max_token_length;
    char **vocab;             /* (vocab_size) NUL-terminated pieces */
    float *vocab_scores;      /* (vocab_size) merge priority: higher merges first */
    TokenIndex *sorted_vocab; /* (vocab_size) pieces sorted by strcmp, for bsearch */
    unsigned char byte_pieces[512]; /* byte b as the string {b, 0} at 2b */
} Tokenizer;

static int compare_tokens(const void *a, const void *b) {
    return strcmp(((const TokenIndex *)a)->str, ((const TokenIndex *)b)->str);
}

/* Reads llama2.c's tokenizer.bin: int32 max_token_length, then for each of
   the model's vocab_size tokens a float32 score, an int32 byte length and the
   bytes. The file must hold exactly vocab_size tokens. */
static void load_tokenizer(Tokenizer *t, const char *path, int vocab_size) {
    size_t size;
    const unsigned char *data = map_file(path, &size, "tokenizer");
    size_t at = 0;
    memset(t, 0, sizeof(*t));
    t->vocab_size = vocab_size;
    if (size < 4) die(EXIT_BAD_FILE, "%s: truncated tokenizer: no max_token_length", path);
    int32_t max_len = read_i32((const char *)data);
    if (max_len <= 0 || max_len > (1 << 20))
        die(EXIT_BAD_FILE, "%s: bad tokenizer: max_token_length is %d", path, max_len);
    t->max_token_length = max_len;
    at = 4;
    t->vocab = xcalloc((size_t)vocab_size, sizeof(char *));
    t->vocab_scores = xcalloc((size_t)vocab_size, sizeof(float));
    for (int i = 0; i < vocab_size; i++) {
        if (size - at < 8)
            die(EXIT_BAD_FILE, "%s: truncated tokenizer: it ends at token %d, the model has %d tokens", path, i, vocab_size);
        memcpy(&t->vocab_scores[i], data + at, 4);
        int32_t len = read_i32((const char *)data + at + 4);
        at += 8;
        if (len < 0 || len > max_len)
            die(EXIT_BAD_FILE, "%s: bad tokenizer: token %d has length %d (max_token_length %d)", path, i, len, max_len);
        if (size - at < (size_t)len)
            die(EXIT_BAD_FILE, "%s: truncated tokenizer: token %d needs %d bytes, %zu left", path, i, len, size - at);
        t->vocab[i] = xcalloc((size_t)len + 1, 1);
        memcpy(t->vocab[i], data + at, (size_t)len);
        at += (size_t)len;
    }
    if (at != size)
        die(EXIT_BAD_FILE, "%s: tokenizer has more than the model's %d tokens (%zu bytes left over): wrong tokenizer for this model?",
            path, vocab_size, size - at);
    munmap((void *)data, size);
    for (int i = 0; i < 256; i++) {
        t->byte_pieces[i * 2] = (unsigned char)i;
        t->byte_pieces[i * 2 + 1] = '\0';
    }
    t->sorted_vocab = xcalloc((size_t)vocab_size, sizeof(TokenIndex));
    for (int i = 0; i < vocab_size; i++) t->sorted_vocab[i] = (TokenIndex){t->vocab[i], i};
    qsort(t->sorted_vocab, (size_t)vocab_size, sizeof(TokenIndex), compare_tokens);
}

static void free_tokenizer(Tokenizer *t) {
    for (int i = 0; i < t->vocab_size; i++) free(t->vocab[i]);
    free(t->vocab);
    free(t->vocab_scores);
    free(t->sorted_vocab);
    memset(t, 0, sizeof(*t));
}

/* The id of the piece spelled `str`, or -1. */
static int lookup_piece(const Tokenizer *t, const char *str) {
    TokenIndex key = {str, 0};
    const TokenIndex *hit = bsearch(&key, t->sorted_vocab, (size_t)t->vocab_size, sizeof(TokenIndex), compare_tokens);
    return hit ? hit->id : -1;
}

/* A candidate merge of the adjacent tokens at `left` and `right`, with the
   token ids it was computed for; it is stale once either has changed. */
typedef struct {
    float score;
    int left, right;
    int left_id, right_id, merged_id;
} Merge;

/* Max-heap order: higher score first, then the leftmost pair, which is the
   order in which llama2.c's quadratic scan picks merges. */
static int merge_before(const Merge *a, const Merge *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static void heap_push(Merge *heap, int *n, Merge m) {
    int i = (*n)++;
    while (i > 0 && merge_before(&m, &heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = m;
}

static Merge heap_pop(Merge *heap, int *n) {
    Merge top = heap[0], last = heap[--(*n)];
    int i = 0;
    for (;;) {
        int child = 2 * i + 1;
        if (child >= *n) break;
        if (child + 1 < *n && merge_before(&heap[child + 1], &heap[child])) child++;
        if (!merge_before(&heap[child], &last)) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*n > 0) heap[i] = last;
    return top;
}

/* Pushes the merge of tokens left and right if their concatenation is a
   piece whose score beats llama2.c's floor of -1e10. */
static void consider_merge(const Tokenizer *t, const int *ids, int left, int right, char *buffer, Merge *heap, int *n_heap) {
    if (left < 0 || right < 0) return;
    strcpy(buffer, t->vocab[ids[left]]);
    strcat(buffer, t->vocab[ids[right]]);
    int id = lookup_piece(t, buffer);
    if (id != -1 && t->vocab_scores[id] > -1e10f)
        heap_push(heap, n_heap, (Merge){t->vocab_scores[id], left, right, ids[left], ids[right], id});
}

/* Encodes `text` into `tokens` (room for strlen(text) + 3 ids) and returns the
   count: optional BOS, a dummy-prefix space for non-empty text, each UTF-8
   code point as its piece or else as byte tokens <0xNN> (id byte + 3), then
   merges of the best-scoring adjacent pair, leftmost first, until none is in
   the vocabulary. A heap of candidate merges gives llama2.c's result in
   O(n log n) instead of its O(n^2) rescans. Returns -1 (and names the byte in
   *bad_byte) when a byte has no token. */
static int encode(const Tokenizer *t, const char *text, int bos, int eos, int *tokens, int *bad_byte) {
    char *buffer = xcalloc((size_t)t->max_token_length * 2 + 3, 1);
    int n = 0;
    if (bos) tokens[n++] = TOKEN_BOS;
    if (text[0] != '\0') {
        int dummy_prefix = lookup_piece(t, " ");
        if (dummy_prefix != -1) tokens[n++] = dummy_prefix;
    }
    /* code points: a lead byte and up to three continuation bytes (10xxxxxx) */
    size_t len = 0;
    for (const char *c = text; *c != '\0'; c++) {
        if ((*c & 0xC0) != 0x80) len = 0;
        buffer[len++] = *c;
        buffer[len] = '\0';
        if ((*(c + 1) & 0xC0) == 0x80 && len < 4) continue;
        int id = lookup_piece(t, buffer);
        if (id != -1) {
            tokens[n++] = id;
        } else {
            for (size_t i = 0; i < len; i++) {
                int byte_id = (unsigned char)buffer[i] + BYTE_TOKEN_OFFSET;
                if (byte_id >= t->vocab_size) {
                    *bad_byte = (unsigned char)buffer[i];
                    free(buffer);
                    return -1;
                }
                tokens[n++] = byte_id;
            }
        }
        len = 0;
    }
    /* merges over a doubly linked list of the surviving tokens */
    int *prev = xcalloc((size_t)n + 1, sizeof(int)), *next = xcalloc((size_t)n + 1, sizeof(int));
    Merge *heap = xcalloc(3 * (size_t)n + 1, sizeof(Merge));
    int n_heap = 0;
    for (int i = 0; i < n; i++) {
        prev[i] = i - 1;
        next[i] = i + 1 < n ? i + 1 : -1;
    }
    for (int i = 0; i + 1 < n; i++) consider_merge(t, tokens, i, i + 1, buffer, heap, &n_heap);
    while (n_heap > 0) {
        Merge m = heap_pop(heap, &n_heap);
        if (next[m.left] != m.right || tokens[m.left] != m.left_id || tokens[m.right] != m.right_id) continue;
        tokens[m.left] = m.merged_id;
        tokens[m.right] = -1;
        next[m.left] = next[m.right];
        if (next[m.right] >= 0) prev[next[m.right]] = m.left;
        next[m.right] = -2; /* dead */
        consider_merge(t, tokens, prev[m.left], m.left, buffer, heap, &n_heap);
        consider_merge(t, tokens, m.left, next[m.left], buffer, heap, &n_heap);
    }
    int out = 0;
    for (int i = 0; i < n; i++)
        if (tokens[i] >= 0) tokens[out++] = tokens[i];
    if (eos) tokens[out++] = TOKEN_EOS;
    free(prev);
    free(next);
    free(heap);
    free(buffer);
    return out;
}

/* The text of `token` following `prev_token`: the space that SentencePiece
   puts at the start of a text is dropped after BOS, and byte tokens <0xNN>
   become the byte itself. */
static const char *decode(const Tokenizer *t, int prev_token, int token) {
    const char *piece = t->vocab[token];
    if (prev_token == TOKEN_BOS && piece[0] == ' ') piece++;
    unsigned char byte_val;
    if (sscanf(piece, "<0x%02hhX>", &byte_val) == 1) piece = (const char *)t->byte_pieces + byte_val * 2;
    return piece;
}

/* Whether a decoded piece is printed: not when empty, nor when it is a single
   byte that is neither printable nor white space (a lone control byte, or a
   fragment of a UTF-8 sequence that has no token of its own). */
static int piece_is_printable(const char *piece) {
    if (piece[0] == '\0') return 0;
    if (piece[1] == '\0') {
        unsigned char byte_val = (unsigned char)piece[0];
        if (!(isprint(byte_val) || isspace(byte_val))) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------ */
/* 6. Samplers                                                              */
/* ------------------------------------------------------------------------ */

typedef struct {
    float prob;
    int index;
} ProbIndex;

typedef struct {
    int vocab_size;
    float temperature; /* 0: greedy */
    float topp;        /* nucleus mass; outside (0, 1): plain multinomial */
    uint64_t rng_state;
    ProbIndex *probindex; /* (vocab_size) scratch for top-p */
} Sampler;

/* xorshift64* (Vigna), as in llama2.c, so a seed gives the same story. */
static uint32_t random_u32(uint64_t *state) {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

/* uniform in [0, 1) with 24 random bits */
static float random_f32(uint64_t *state) { return (random_u32(state) >> 8) / 16777216.0f; }

/* index of the largest value, the first one on ties */
static int sample_argmax(const float *x, int n) {
    int max_i = 0;
    float max_p = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > max_p) { max_i = i; max_p = x[i]; }
    return max_i;
}

/* the first index whose cumulative probability exceeds coin in [0, 1) */
static int sample_mult(const float *probabilities, int n, float coin) {
    float cdf = 0.0f;
    for (int i = 0; i < n; i++) {
        cdf += probabilities[i];
        if (coin < cdf) return i;
    }
    return n - 1; /* rounding */
}

static int compare_prob_desc(const void *a, const void *b) {
    const ProbIndex *x = a, *y = b;
    if (x->prob > y->prob) return -1;
    if (x->prob < y->prob) return 1;
    return 0;
}

/* Nucleus sampling: draw from the smallest set of most likely tokens whose
   mass exceeds topp. The tokens below cutoff = (1 - topp) / (n - 1) hold less
   than (n - 1) * cutoff = 1 - topp in all, so the others hold more than topp
   and contain that set: only they are sorted. */
static int sample_topp(const float *probabilities, int n, float topp, ProbIndex *probindex, float coin) {
    int n0 = 0;
    const float cutoff = (1.0f - topp) / (n - 1);
    for (int i = 0; i < n; i++)
        if (probabilities[i] >= cutoff) probindex[n0++] = (ProbIndex){probabilities[i], i};
    if (n0 == 0) return sample_argmax(probabilities, n); /* topp < 1/n on a flat distribution */
    qsort(probindex, (size_t)n0, sizeof(ProbIndex), compare_prob_desc);
    float cumulative_prob = 0.0f;
    int last_idx = n0 - 1;
    for (int i = 0; i < n0; i++) {
        cumulative_prob += probindex[i].prob;
        if (cumulative_prob > topp) { last_idx = i; break; }
    }
    float r = coin * cumulative_prob, cdf = 0.0f;
    for (int i = 0; i <= last_idx; i++) {
        cdf += probindex[i].prob;
        if (r < cdf) return probindex[i].index;
    }
    return probindex[last_idx].index;
}

static void init_sampler(Sampler *s, int vocab_size, float temperature, float topp, uint64_t seed) {
    s->vocab_size = vocab_size;
    s->temperature = temperature;
    s->topp = topp;
    s->rng_state = seed;
    s->probindex = xcalloc((size_t)vocab_size, sizeof(ProbIndex));
}

static void free_sampler(Sampler *s) { free(s->probindex); s->probindex = NULL; }

/* Picks the next token from `logits` (overwritten with probabilities). */
static int sample(Sampler *s, float *logits) {
    if (s->temperature == 0.0f) return sample_argmax(logits, s->vocab_size);
    /* a temperature so small that the largest logit overflows is greedy */
    if (!isfinite(logits[sample_argmax(logits, s->vocab_size)] / s->temperature)) return sample_argmax(logits, s->vocab_size);
    for (int q = 0; q < s->vocab_size; q++) logits[q] /= s->temperature;
    softmax(logits, s->vocab_size);
    float coin = random_f32(&s->rng_state);
    if (s->topp <= 0 || s->topp >= 1) return sample_mult(logits, s->vocab_size, coin);
    return sample_topp(logits, s->vocab_size, s->topp, s->probindex, coin);
}

/* log softmax(logits)[token], in double: log p = x_token - max - log sum exp(x - max) */
static double log_prob(const float *logits, int n, int token) {
    float max_val = logits[sample_argmax(logits, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - max_val);
    return (double)logits[token] - max_val - log(sum);
}

/* Beam search, with the semantics of Hugging Face transformers' generate()
   (version 4.38): B beams advance together; each step ranks every (beam,
   token) continuation by beam score + log softmax(logits)[token] and walks the
   top 3B in order. An end token (BOS or EOS) ranked within the first B closes
   a finished hypothesis; other end tokens are dropped; the first B other
   continuations become the next beams. Finished hypotheses compete in a pool
   of B, scored sum_logprobs / generated_length^length_penalty. */

typedef enum { STOP_HEURISTIC, STOP_EARLY, STOP_NEVER } EarlyStopping; /* -e 0, 1, never */

typedef struct {
    int beams;            /* B; 1 is greedy */
    float length_penalty; /* exponent of the length in the score */
    EarlyStopping early_stopping;
} BeamSettings;

/* A returned sequence: the generated ids (no prompt, no end token), its score
   and why it ended ("bos", "eos" or "length"). For beam search, slots[i] is
   the cache slot holding the key/value of tokens[i], or -1 if never computed. */
typedef struct {
    int *tokens;
    int *slots;
    int n_tokens;
    double score;
    const char *stop;
} Hypothesis;

static void free_hypothesis(Hypothesis *h) {
    free(h->tokens);
    free(h->slots);
    memset(h, 0, sizeof(*h));
}

/* The finished hypotheses, at most B. worst_score follows the library: 1e9
   while empty, then the lowest score kept. */
typedef struct {
    Hypothesis *hyps; /* (B) */
    int n;
    double worst_score;
} HypothesisPool;

/* Offers a hypothesis of generated_length tokens (the end token counted) with
   summed log-probability sum_logprobs. The pool takes ownership of h. */
static void pool_add(HypothesisPool *pool, const BeamSettings *bs, Hypothesis h, float sum_logprobs, int generated_length) {
    double score = sum_logprobs / pow((double)generated_length, bs->length_penalty);
    if (pool->n == bs->beams && !(score > pool->worst_score)) {
        free_hypothesis(&h);
        return;
    }
    h.score = score;
    if (pool->n < bs->beams) {
        pool->hyps[pool->n++] = h;
        pool->worst_score = score < pool->worst_score ? score : pool->worst_score;
        return;
    }
    /* full: the new one replaces the worst (the earliest among equals), and
       the worst score becomes the lowest of the others, the new one included */
    int worst = 0;
    for (int i = 1; i < pool->n; i++)
        if (pool->hyps[i].score < pool->hyps[worst].score) worst = i;
    free_hypothesis(&pool->hyps[worst]);
    memmove(pool->hyps + worst, pool->hyps + worst + 1, (size_t)(pool->n - worst - 1) * sizeof(Hypothesis));
    pool->hyps[pool->n - 1] = h;
    pool->worst_score = pool->hyps[0].score;
    for (int i = 1; i < pool->n; i++)
        if (pool->hyps[i].score < pool->worst_score) pool->worst_score = pool->hyps[i].score;
}

/* Whether no running beam can still enter the pool. best_sum is this step's
   highest candidate score, generated the tokens generated including this
   step's, max_new the most tokens the search may generate. */
static int pool_is_done(const HypothesisPool *pool, const BeamSettings *bs, float best_sum, int generated, int max_new) {
    if (pool->n < bs->beams) return 0;
    if (bs->early_stopping == STOP_EARLY) return 1;
    int length = (bs->early_stopping == STOP_NEVER && bs->length_penalty > 0) ? max_new : generated;
    double highest_attainable = best_sum / pow((double)length, bs->length_penalty);
    return pool->worst_score >= highest_attainable;
}

/* A continuation of beam `beam` by `token`, with its summed log-probability. */
typedef struct {
    float score;
    int beam, token;
} Candidate;

/* Keeps the k best continuations in `best` (sorted, best first; among equal
   scores the lower beam, then the lower token, first). Beam b continues with
   log-probabilities logprobs[b] (vocab values). */
static int top_candidates(const float *beam_scores, float *const *logprobs, int n_beams, int vocab, Candidate *best, int k) {
    int n = 0;
    for (int b = 0; b < n_beams; b++) {
        const float *lp = logprobs[b];
        for (int v = 0; v < vocab; v++) {
            float score = beam_scores[b] + lp[v];
            if (n == k && !(score > best[k - 1].score)) continue;
            int i = n < k ? n++ : k - 1;
            while (i > 0 && score > best[i - 1].score) {
                best[i] = best[i - 1];
                i--;
            }
            best[i] = (Candidate){score, b, v};
        }
    }
    return n;
}

/* out = log softmax(x) = x - max - log sum exp(x - max), in float32 */
static void log_softmax(float *out, const float *x, int n) {
    float max_val = x[sample_argmax(x, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += expf(x[i] - max_val);
    float log_sum = (float)log(sum);
    for (int i = 0; i < n; i++) out[i] = (x[i] - max_val) - log_sum;
}

/* ------------------------------------------------------------------------ */
/* 7. Generation loops                                                      */
/* ------------------------------------------------------------------------ */

typedef enum { FORMAT_TEXT, FORMAT_JSON } OutputFormat;

typedef struct {
    int prompt_tokens;
    double prompt_seconds;
    int generated_tokens;
    double generate_seconds;
} Stats;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void print_stats(const Stats *st) {
    double prompt_rate = st->prompt_seconds > 0 ? st->prompt_tokens / st->prompt_seconds : 0;
    double gen_rate = st->generate_seconds > 0 ? st->generated_tokens / st->generate_seconds : 0;
    fprintf(stderr, "stats: prompt %d tokens, %.1f tok/s; generated %d tokens, %.1f tok/s\n",
            st->prompt_tokens, prompt_rate, st->generated_tokens, gen_rate);
}

/* Flushes stdout; when the reader has gone (a closed pipe), there is no one
   left to generate for, so the program stops with a one-line message. */
static void flush_output(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) die(EXIT_BAD_FILE, "cannot write to stdout: %s", strerror(errno));
}

static void print_piece(const char *piece) {
    if (piece_is_printable(piece)) fputs(piece, stdout);
}

static int is_end_token(int token) { return token == TOKEN_BOS || token == TOKEN_EOS; }

static const char *end_reason(int token) { return token == TOKEN_BOS ? "bos" : "eos"; }

/* Encodes `text` after a BOS. Returns NULL when it needs more than `room`
   positions; text longer than room * max_token_length bytes is refused before
   encoding, since no token spans more bytes than that. */
static int *encode_prompt(const Tokenizer *tok, const char *text, int room, int *n_tokens) {
    size_t len = strlen(text);
    if (len / (size_t)tok->max_token_length > (size_t)room) return NULL;
    int *tokens = xcalloc(len + 3, sizeof(int));
    int bad_byte = 0;
    *n_tokens = encode(tok, text, 1, 0, tokens, &bad_byte);
    if (*n_tokens < 0) die(EXIT_BAD_FILE, "the tokenizer has no token for the byte 0x%02X in the prompt", bad_byte);
    if (*n_tokens > room) {
        free(tokens);
        return NULL;
    }
    return tokens;
}

/* Writes `s` as a JSON string; bytes that are not valid UTF-8 become U+FFFD. */
static void print_json_string(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    putchar('"');
    while (*p) {
        unsigned char c = *p;
        /* well-formed UTF-8 only (RFC 3629): no overlong forms, surrogates or
           code points above U+10FFFF, which JSON parsers reject */
        int len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
        int valid = len > 0;
        if (len > 1) {
            unsigned char lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80, hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
            valid = p[1] >= lo && p[1] <= hi;
        }
        for (int i = 2; valid && i < len; i++) valid = (p[i] & 0xC0) == 0x80;
        if (!valid) { fputs("\\ufffd", stdout); p++; continue; }
        if (len > 1) { fwrite(p, 1, (size_t)len, stdout); p += len; continue; }
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c < 0x20 || c == 0x7f) printf("\\u%04x", c);
        else putchar(c);
        p++;
    }
    putchar('"');
}

/* The printable text of `tokens` as generate prints it, the first one
   decoded after `prev_token`. The caller frees it. */
static char *decode_text(const Tokenizer *tok, int prev_token, const int *tokens, int n) {
    size_t cap = 1, len = 0;
    for (int i = 0; i < n; i++) cap += strlen(tok->vocab[tokens[i]]) + 1;
    char *text = xcalloc(cap, 1);
    for (int i = 0; i < n; i++) {
        const char *piece = decode(tok, prev_token, tokens[i]);
        if (piece_is_printable(piece)) {
            size_t piece_len = strlen(piece);
            memcpy(text + len, piece, piece_len);
            len += piece_len;
        }
        prev_token = tokens[i];
    }
    return text;
}

/* One JSON line for a returned sequence. */
static void print_json_hypothesis(const Tokenizer *tok, int rank, const Hypothesis *h, int last_prompt_token) {
    char *text = decode_text(tok, last_prompt_token, h->tokens, h->n_tokens);
    printf("{\"rank\":%d,\"score\":%.6f,\"tokens\":[", rank, h->score);
    for (int i = 0; i < h->n_tokens; i++) printf(i ? ",%d" : "%d", h->tokens[i]);
    printf("],\"text\":");
    print_json_string(text);
    printf(",\"stop\":\"%s\"}\n", h->stop);
    free(text);
}

/* How to choose the continuation of a prompt. */
typedef struct {
    Sampler *sampler;     /* used when beam.beams == 0 */
    BeamSettings beam;    /* beam search when beam.beams >= 1 */
    int n_return;         /* hypotheses printed, best first (beam search) */
    OutputFormat format;
} Decoding;

/* Feeds `feed` (n_feed tokens) at positions start.. of cache slot 0, then
   samples up to max_new tokens, each fed back at the next position; stops
   after BOS, or EOS when `stop_at_eos` (the end token is not included). With
   `stream`, pieces are printed as they come. Returns the generated tokens;
   without `stream` (JSON output, the only one that prints it), score is the
   sum of their log-probs. */
static Hypothesis sample_continuation(Transformer *t, const Tokenizer *tok, Sampler *sampler, const int *feed, int n_feed,
                                      int start, int max_new, int stop_at_eos, int stream, Stats *stats) {
    const int vocab = t->config.vocab_size;
    Hypothesis h = {xcalloc((size_t)max_new, sizeof(int)), NULL, 0, 0.0, "length"};
    double t0 = now_seconds();
    float *logits = forward_sequence(t, feed, n_feed, start, 0);
    double t1 = now_seconds();
    stats->prompt_seconds += t1 - t0;
    stats->prompt_tokens += n_feed;
    /* the sampler overwrites the logits; the score needs them as they were.
       Text output never prints the score, so it skips this pass over the
       vocabulary per token. */
    float *raw = stream ? NULL : xcalloc((size_t)vocab, sizeof(float));
    int token = feed[n_feed - 1], pos = start + n_feed;
    for (;;) {
        if (raw) memcpy(raw, logits, (size_t)vocab * sizeof(float));
        int next = sample(sampler, logits);
        if (raw) h.score += log_prob(raw, vocab, next);
        if (next == TOKEN_BOS || (stop_at_eos && next == TOKEN_EOS)) { h.stop = end_reason(next); break; }
        h.tokens[h.n_tokens++] = next;
        if (stream) {
            print_piece(decode(tok, token, next));
            flush_output();
        }
        token = next;
        if (h.n_tokens == max_new) break;
        logits = forward_token(t, token, pos++);
    }
    free(raw);
    stats->generated_tokens += h.n_tokens;
    stats->generate_seconds += now_seconds() - t1;
    return h;
}

/* A hypothesis holding the first n tokens of `tokens`, with the cache slots
   of those that have been fed through the model (`n_slots` of them). */
static Hypothesis make_hypothesis(const int *tokens, int n, const int *slots, int n_slots, const char *stop) {
    Hypothesis h = {xcalloc((size_t)n + 1, sizeof(int)), xcalloc((size_t)n + 1, sizeof(int)), n, 0.0, stop};
    if (n > 0) memcpy(h.tokens, tokens, (size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) h.slots[i] = i < n_slots ? slots[i] : -1;
    return h;
}

/* Puts the hypotheses in the library's output order: best score first, and
   among equal scores the one that entered the pool last first. */
static void sort_best_first(Hypothesis *hyps, int n) {
    for (int i = 1; i < n; i++) {
        Hypothesis h = hyps[i];
        int j = i;
        while (j > 0 && hyps[j - 1].score <= h.score) {
            hyps[j] = hyps[j - 1];
            j--;
        }
        hyps[j] = h;
    }
}

/* Beam search after `feed` (n_feed tokens at positions start.. of cache
   slot 0), generating at most max_new tokens. Fills `out` (room for B) with
   the finished hypotheses, best first, and returns their count.

   The B beams run as the rows of one batch, so each weight matrix is read
   once per step for all of them. Their keys and values are never copied when
   beams are reordered: beam j writes the token it feeds at position p into
   cache slot j, and history[j][t] names the slot holding its key/value for
   each earlier position t (FasterTransformer's "cache indirection"). A
   reorder copies these small index rows (B x positions ints) instead of the
   cache (B x positions x layers x kv_dim floats), and the prompt's keys and
   values, computed once in slot 0, are shared by every beam. */
static int beam_search(Transformer *t, const BeamSettings *bs, const int *feed, int n_feed, int start, int max_new,
                       Hypothesis *out, Stats *stats) {
    const int B = bs->beams, vocab = t->config.vocab_size, context = t->state.context, K = 3 * B;
    const int first_pos = start + n_feed; /* position of the first generated token */
    double t0 = now_seconds();
    float *logits = forward_sequence(t, feed, n_feed, start, 0);
    double t1 = now_seconds();
    stats->prompt_seconds += t1 - t0;
    stats->prompt_tokens += n_feed;

    float *beam_scores = xcalloc((size_t)B, sizeof(float));
    float *logprob_rows = xcalloc((size_t)B * vocab, sizeof(float)); /* (B, vocab) */
    float **logprobs = xcalloc((size_t)B, sizeof(float *));
    int *history = xcalloc((size_t)B * context, sizeof(int)), *next_history = xcalloc((size_t)B * context, sizeof(int));
    int *tokens = xcalloc((size_t)B * max_new, sizeof(int)), *next_tokens = xcalloc((size_t)B * max_new, sizeof(int));
    int *parent = xcalloc((size_t)B, sizeof(int)), *row_token = xcalloc((size_t)B, sizeof(int));
    int *row_pos = xcalloc((size_t)B, sizeof(int)), *row_slot = xcalloc((size_t)B, sizeof(int));
    float *next_scores = xcalloc((size_t)B, sizeof(float));
    Candidate *cand = xcalloc((size_t)K, sizeof(Candidate));
    HypothesisPool pool = {out, 0, 1e9};

    /* every beam starts as the prompt, but only the first one expands at the
       first step (the others score -1e9), so the B beams come out distinct */
    log_softmax(logprob_rows, logits, vocab);
    for (int b = 0; b < B; b++) {
        logprobs[b] = logprob_rows;
        beam_scores[b] = b == 0 ? 0.0f : -1e9f;
    }
    for (int step = 0;; step++) { /* step: tokens generated so far by each beam */
        int n_cand = top_candidates(beam_scores, logprobs, B, vocab, cand, K), n_next = 0;
        for (int rank = 0; rank < n_cand && n_next < B; rank++) {
            Candidate c = cand[rank];
            if (is_end_token(c.token)) {
                if (rank >= B) continue;
                const int *slots = history + (size_t)c.beam * context + first_pos;
                Hypothesis h = make_hypothesis(tokens + (size_t)c.beam * max_new, step, slots, step, end_reason(c.token));
                pool_add(&pool, bs, h, c.score, step + 1);
            } else {
                parent[n_next] = c.beam;
                row_token[n_next] = c.token;
                next_scores[n_next++] = c.score;
            }
        }
        int generated = step + 1, done = pool_is_done(&pool, bs, cand[0].score, generated, max_new);
        /* reorder: beam j continues beam parent[j] with row_token[j] */
        for (int j = 0; j < B; j++) {
            memcpy(next_tokens + (size_t)j * max_new, tokens + (size_t)parent[j] * max_new, (size_t)step * sizeof(int));
            next_tokens[(size_t)j * max_new + step] = row_token[j];
            memcpy(next_history + (size_t)j * context, history + (size_t)parent[j] * context, (size_t)(first_pos + step) * sizeof(int));
            beam_scores[j] = next_scores[j];
        }
        int *swap = tokens; tokens = next_tokens; next_tokens = swap;
        swap = history; history = next_history; next_history = swap;
        stats->generated_tokens++;
        if (done) break;
        if (generated == max_new) { /* the length limit: running beams join the pool */
            for (int j = 0; j < B; j++) {
                const int *slots = history + (size_t)j * context + first_pos;
                pool_add(&pool, bs, make_hypothesis(tokens + (size_t)j * max_new, generated, slots, step, "length"), beam_scores[j], generated);
            }
            break;
        }
        /* feed every beam's new token at position first_pos + step into its own slot */
        for (int j = 0; j < B; j++) {
            row_pos[j] = first_pos + step;
            row_slot[j] = j;
        }
        Batch batch = {B, row_token, row_pos, row_slot, history, B};
        logits = forward(t, &batch);
        for (int j = 0; j < B; j++) {
            history[(size_t)j * context + first_pos + step] = j;
            logprobs[j] = logprob_rows + (size_t)j * vocab;
            log_softmax(logprobs[j], logits + (size_t)j * vocab, vocab);
        }
    }
    stats->generate_seconds += now_seconds() - t1;
    sort_best_first(pool.hyps, pool.n);
    free(beam_scores); free(logprob_rows); free(logprobs); free(history); free(next_history);
    free(tokens); free(next_tokens); free(parent); free(row_token); free(row_pos); free(row_slot);
    free(next_scores); free(cand);
    return pool.n;
}

/* Copies the keys and values of a beam-search reply, scattered over the
   beams' slots, into slot 0 at positions first_pos.., so that the reply joins
   the conversation's cache. */
static void adopt_hypothesis_cache(Transformer *t, const Hypothesis *h, int first_pos) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    size_t kv_bytes = (size_t)(p->dim / p->n_heads * p->n_kv_heads) * sizeof(float);
    for (int l = 0; l < p->n_layers; l++)
        for (int i = 0; i < h->n_tokens; i++) {
            if (h->slots[i] <= 0) continue;
            size_t from = cache_offset(p, s, l, h->slots[i], first_pos + i), to = cache_offset(p, s, l, 0, first_pos + i);
            memcpy(s->key_cache + to, s->key_cache + from, kv_bytes);
            memcpy(s->value_cache + to, s->value_cache + from, kv_bytes);
        }
}

/* Chooses the continuation of `feed` (fed at positions start..) with at most
   max_new tokens: by sampling (streamed in text mode when `stream`; EOS ends
   it when `stop_at_eos`) or by beam search (BOS and EOS end hypotheses).
   Returns the number of hypotheses in `out` (room for max(1, B)), best first. */
static int continue_sequence(Transformer *t, const Tokenizer *tok, const Decoding *d, const int *feed, int n_feed, int start,
                             int max_new, int stop_at_eos, int stream, Hypothesis *out, Stats *stats) {
    if (d->beam.beams == 0) {
        out[0] = sample_continuation(t, tok, d->sampler, feed, n_feed, start, max_new, stop_at_eos, stream, stats);
        return 1;
    }
    return beam_search(t, &d->beam, feed, n_feed, start, max_new, out, stats);
}

/* Prints the best n_show hypotheses: in text mode after the prompt (or, with
   several, each in a block with its rank and score); in JSON one line each.
   Sampled text has already been streamed (`streamed`): only its end of line
   is left to print. */
static void print_results(const Tokenizer *tok, OutputFormat format, const Hypothesis *hyps, int n_show, int last_prompt_token,
                          const char *prompt_text, int streamed) {
    if (format == FORMAT_JSON) {
        for (int i = 0; i < n_show; i++) print_json_hypothesis(tok, i + 1, &hyps[i], last_prompt_token);
        return;
    }
    for (int i = 0; i < n_show; i++) {
        if (n_show > 1) printf("%s[rank %d] score %.6f, stop %s\n%s", i ? "\n" : "", i + 1, hyps[i].score, hyps[i].stop, prompt_text);
        if (!streamed) {
            char *text = decode_text(tok, last_prompt_token, hyps[i].tokens, hyps[i].n_tokens);
            fputs(text, stdout);
            free(text);
        }
        if (n_show > 1) printf("\n");
    }
    if (n_show <= 1) printf("\n");
}

/* Generates from a prompt, as llama2.c does: the prompt's tokens are forced
   and printed, then the continuation is chosen until `steps` positions are
   used (prompt included) or it ends. Sampling ends at BOS only, exactly as in
   llama2.c (a sampled EOS prints as its piece and generation goes on), so
   that the output stays byte-identical; beam search ends hypotheses at BOS or
   EOS, as the library does. Sampled text streams to stdout as it comes. */
static void generate(Transformer *t, const Tokenizer *tok, const Decoding *d, const char *prompt, int steps) {
    const Config *p = &t->config;
    int n_prompt;
    int *prompt_tokens = encode_prompt(tok, prompt, p->seq_len, &n_prompt);
    if (!prompt_tokens) die(EXIT_USAGE, "the prompt does not fit the model's context of %d tokens", p->seq_len);
    Stats stats = {0, 0, 0, 0};
    /* llama2.c prints each prompt token as it forces it, up to `steps` */
    int n_forced = n_prompt - 1 < steps ? n_prompt - 1 : steps;
    char *prompt_text = decode_text(tok, prompt_tokens[0], prompt_tokens + 1, n_forced);
    int several = d->format == FORMAT_TEXT && d->n_return > 1 && d->beam.beams > 0;
    if (d->format == FORMAT_TEXT && !several) {
        fputs(prompt_text, stdout);
        flush_output();
    }
    int stream = d->format == FORMAT_TEXT && d->beam.beams == 0;
    Hypothesis *hyps = xcalloc((size_t)(d->beam.beams > 1 ? d->beam.beams : 1), sizeof(Hypothesis));
    int n_hyps = 0;
    if (steps >= n_prompt)
        n_hyps = continue_sequence(t, tok, d, prompt_tokens, n_prompt, 0, steps - n_prompt + 1, 0, stream, hyps, &stats);
    else
        hyps[n_hyps++] = make_hypothesis(NULL, 0, NULL, 0, "length");
    print_results(tok, d->format, hyps, n_hyps < d->n_return ? n_hyps : d->n_return, prompt_tokens[n_prompt - 1], prompt_text, stream);
    flush_output();
    print_stats(&stats);
    for (int i = 0; i < n_hyps; i++) free_hypothesis(&hyps[i]);
    free(hyps);
    free(prompt_text);
    free(prompt_tokens);
}

/* Reads one line of any length from stdin after printing `guide` (text mode),
   without its newline. Returns NULL at end of input. The caller frees it. */
static char *read_line(const char *guide, OutputFormat format) {
    if (format == FORMAT_TEXT) {
        fputs(guide, stdout);
        flush_output();
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len = getline(&line, &cap, stdin);
    if (len < 0) {
        free(line);
        return NULL;
    }
    if (len > 0 && line[len - 1] == '\n') line[len - 1] = '\0';
    return line;
}

/* The Llama 2 chat template for one user turn; the system prompt goes into
   the first turn only. */
static char *render_chat_turn(const char *system_prompt, const char *user) {
    static const char *with_system = "[INST] <<SYS>>\n%s\n<</SYS>>\n\n%s [/INST]";
    static const char *plain = "[INST] %s [/INST]";
    int has_system = system_prompt && system_prompt[0] != '\0';
    size_t size = strlen(user) + (has_system ? strlen(system_prompt) : 0) + 64;
    char *out = xcalloc(size, 1);
    if (has_system) snprintf(out, size, with_system, system_prompt, user);
    else snprintf(out, size, plain, user);
    return out;
}

static void announce_full_context(int steps) {
    fprintf(stderr, "run: the context of %d positions is full; ending the chat\n", steps);
}

/* An interactive conversation. Each user turn (BOS + template) is appended to
   the key/value cache after the previous reply and its end token, so the
   model sees the whole conversation; a reply ends at EOS (or BOS). The chat
   ends at end of input or when the `steps` positions are used up. In JSON
   mode the guides are not printed and each reply is one JSON line. */
static void chat(Transformer *t, const Tokenizer *tok, const Decoding *d, const char *cli_user, const char *cli_system, int steps) {
    Stats stats = {0, 0, 0, 0};
    int text_mode = d->format == FORMAT_TEXT;
    char *system_prompt = cli_system ? strdup(cli_system) : read_line("Enter system prompt (optional): ", d->format);
    int pos = 0, pending_end = -1; /* the last reply's end token, not yet in the cache */
    Hypothesis *hyps = xcalloc((size_t)(d->beam.beams > 1 ? d->beam.beams : 1), sizeof(Hypothesis));
    if (!system_prompt && text_mode) printf("\n");
    for (int turn = 0; system_prompt; turn++) {
        char *user = (turn == 0 && cli_user) ? strdup(cli_user) : read_line("User: ", d->format);
        if (!user) {
            if (text_mode) printf("\n");
            break;
        }
        char *rendered = render_chat_turn(turn == 0 ? system_prompt : NULL, user);
        free(user);
        int room = steps - pos - (pending_end >= 0), n_prompt;
        int *prompt = encode_prompt(tok, rendered, room, &n_prompt);
        free(rendered);
        if (!prompt) {
            if (text_mode) printf("\n");
            announce_full_context(steps);
            break;
        }
        if (text_mode) printf("Assistant: ");
        flush_output();
        /* the previous reply's end token and this turn's prompt go in one batch */
        int *feed = xcalloc((size_t)n_prompt + 1, sizeof(int)), n_feed = 0;
        if (pending_end >= 0) feed[n_feed++] = pending_end;
        memcpy(feed + n_feed, prompt, (size_t)n_prompt * sizeof(int));
        n_feed += n_prompt;
        int first_pos = pos + n_feed, stream = text_mode && d->beam.beams == 0;
        int n_hyps = continue_sequence(t, tok, d, feed, n_feed, pos, steps - first_pos + 1, 1, stream, hyps, &stats);
        Hypothesis *reply = &hyps[0];
        if (d->beam.beams > 0) adopt_hypothesis_cache(t, reply, first_pos);
        print_results(tok, d->format, reply, 1, prompt[n_prompt - 1], "", stream);
        flush_output();
        int context_full = strcmp(reply->stop, "length") == 0;
        pending_end = context_full ? -1 : (strcmp(reply->stop, "bos") == 0 ? TOKEN_BOS : TOKEN_EOS);
        pos = first_pos + reply->n_tokens;
        for (int i = 0; i < n_hyps; i++) free_hypothesis(&hyps[i]);
        free(feed);
        free(prompt);
        if (context_full) {
            announce_full_context(steps);
            break;
        }
    }
    flush_output();
    free(hyps);
    free(system_prompt);
    print_stats(&stats);
}

/* ------------------------------------------------------------------------ */
/* 8. The command line                                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
    const char *checkpoint;
    const char *tokenizer;
    const char *prompt;        /* NULL: empty */
    const char *system_prompt; /* NULL: asked for in chat */
    const char *mode;
    float temperature;
    float topp;
    uint64_t seed;             /* 0: from the clock */
    int steps;
    OutputFormat format;
    int threads;               /* 0: all cores */
    int beams;                 /* 0: sampling */
    float length_penalty;
    EarlyStopping early_stopping;
    int n_return;
    int sampling_flags;        /* whether -t, -p or -s was given */
} Options;

static const char *usage_text =
    "Usage:   run <checkpoint> [options]\n"
    "Example: run stories260K.bin -z tok512.bin -i \"Once upon a time\"\n"
    "Options:\n"
    "  -t <float>  temperature, >= 0; 0 is greedy (default 1.0)\n"
    "  -p <float>  top-p (nucleus) mass in [0, 1]; 0 or 1 samples from all tokens (default 0.9)\n"
    "  -s <int>    random seed, >= 0; 0 takes it from the clock (default 0)\n"
    "  -n <int>    positions to run, prompt included; 0 or above the context = the context (default 256)\n"
    "  -i <string> prompt (default empty)\n"
    "  -z <string> tokenizer file (default tokenizer.bin)\n"
    "  -m <string> mode: generate or chat (default generate)\n"
    "  -y <string> system prompt in chat mode (default: asked for)\n"
    "  -f <string> output format: text or json (default text)\n"
    "  -b <int>    beam search with this many beams; 1 is greedy (default: off, sample)\n"
    "  -l <float>  beam search length penalty: score = sum logprob / length^l (default 1.0)\n"
    "  -e <string> beam search early stopping: 0 (heuristic), 1 or never (default 0)\n"
    "  -r <int>    beam search hypotheses to print, best first, 1..b (default 1)\n"
    "  -T <int>    threads, >= 1 (default: all cores; needs an OpenMP build)\n"
    "  -h, --help  this help\n";

static void usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("run: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fputs(usage_text, stderr);
    leave(EXIT_USAGE);
}

static double parse_number(const char *flag, const char *text, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (text[0] == '\0' || *end != '\0' || errno == ERANGE || !isfinite(v))
        usage_error("%s needs a number, got '%s'", flag, text);
    if (v < lo || v > hi) usage_error("%s is %s, outside [%g, %g]", flag, text, lo, hi);
    return v;
}

static long long parse_integer(const char *flag, const char *text, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (text[0] == '\0' || *end != '\0' || errno == ERANGE)
        usage_error("%s needs an integer, got '%s'", flag, text);
    if (v < lo || v > hi) usage_error("%s is %s, outside [%lld, %lld]", flag, text, lo, hi);
    return v;
}

static Options parse_options(int argc, char **argv) {
    Options o = {NULL, "tokenizer.bin", NULL, NULL, "generate", 1.0f, 0.9f, 0, 256, FORMAT_TEXT, 0, 0, 1.0f, STOP_HEURISTIC, 1, 0};
    /* -h or --help where a checkpoint or a flag is expected (not as a value) */
    for (int i = 1; i < argc; i += (i == 1 ? 1 : 2))
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            fputs(usage_text, stdout);
            leave(0);
        }
    if (argc < 2) usage_error("missing the checkpoint file");
    if (argv[1][0] == '-') usage_error("the first argument must be the checkpoint file, got '%s'", argv[1]);
    o.checkpoint = argv[1];
    for (int i = 2; i < argc; i += 2) {
        const char *flag = argv[i];
        if (flag[0] != '-' || strlen(flag) != 2 || !strchr("tpsnizmyfTbler", flag[1]))
            usage_error("unknown option '%s'", flag);
        if (i + 1 >= argc) usage_error("%s needs a value", flag);
        const char *val = argv[i + 1];
        switch (flag[1]) {
        case 't': o.temperature = (float)parse_number(flag, val, 0.0, 1e30); break;
        case 'p': o.topp = (float)parse_number(flag, val, 0.0, 1.0); break;
        case 's': o.seed = (uint64_t)parse_integer(flag, val, 0, LLONG_MAX); break;
        case 'n': o.steps = (int)parse_integer(flag, val, 0, INT_MAX); break;
        case 'i': o.prompt = val; break;
        case 'z': o.tokenizer = val; break;
        case 'm':
            if (strcmp(val, "generate") != 0 && strcmp(val, "chat") != 0)
                usage_error("-m must be generate or chat, got '%s'", val);
            o.mode = val;
            break;
        case 'y': o.system_prompt = val; break;
        case 'f':
            if (strcmp(val, "text") == 0) o.format = FORMAT_TEXT;
            else if (strcmp(val, "json") == 0) o.format = FORMAT_JSON;
            else usage_error("-f must be text or json, got '%s'", val);
            break;
        case 'T': o.threads = (int)parse_integer(flag, val, 1, 1024); break;
        case 'b': o.beams = (int)parse_integer(flag, val, 1, INT_MAX); break;
        case 'l': o.length_penalty = (float)parse_number(flag, val, -1e30, 1e30); break;
        case 'e':
            if (strcmp(val, "0") == 0) o.early_stopping = STOP_HEURISTIC;
            else if (strcmp(val, "1") == 0) o.early_stopping = STOP_EARLY;
            else if (strcmp(val, "never") == 0) o.early_stopping = STOP_NEVER;
            else usage_error("-e must be 0, 1 or never, got '%s'", val);
            break;
        case 'r': o.n_return = (int)parse_integer(flag, val, 1, INT_MAX); break;
        }
        if (strchr("tps", flag[1])) o.sampling_flags = 1;
    }
    if (o.n_return > (o.beams > 0 ? o.beams : 1))
        usage_error("-r %d asks for more hypotheses than the %d beams (-b) keep", o.n_return, o.beams > 0 ? o.beams : 1);
    return o;
}

/* Rows pushed through the model at once while reading a prompt. */
#define PROMPT_BLOCK_ROWS 64

#ifndef TESTING
int main(int argc, char **argv) {
    Options o = parse_options(argc, argv);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout becomes a write error, reported by flush_output */
#ifdef _OPENMP
    if (o.threads > 0) omp_set_num_threads(o.threads);
#else
    if (o.threads > 1) fprintf(stderr, "run: note: -T needs an OpenMP build (make runomp); running on one thread\n");
#endif
    Transformer t;
    load_checkpoint(&t, o.checkpoint);
    const Config *p = &t.config;
    int steps = (o.steps == 0 || o.steps > p->seq_len) ? p->seq_len : o.steps;
    if (o.beams > p->vocab_size)
        usage_error("-b %d is more beams than the %d tokens of the vocabulary", o.beams, p->vocab_size);
    if (o.beams > 1 && o.sampling_flags)
        fprintf(stderr, "run: note: -t, -p and -s do not apply to beam search (-b %d)\n", o.beams);
    Tokenizer tok;
    load_tokenizer(&tok, o.tokenizer, p->vocab_size);
    int n_slots = o.beams > 1 ? o.beams : 1;
    alloc_run_state(&t.state, p, n_slots > PROMPT_BLOCK_ROWS ? n_slots : PROMPT_BLOCK_ROWS, n_slots, steps);
    Sampler sampler;
    init_sampler(&sampler, p->vocab_size, o.temperature, o.topp, o.seed ? o.seed : (uint64_t)time(NULL));
    /* one beam is greedy search, as in the library: it stops at the first end
       token whatever -e says */
    EarlyStopping early = o.beams == 1 ? STOP_EARLY : o.early_stopping;
    Decoding d = {&sampler, {o.beams, o.length_penalty, early}, o.n_return, o.format};

    if (strcmp(o.mode, "chat") == 0) chat(&t, &tok, &d, o.prompt, o.system_prompt, steps);
    else generate(&t, &tok, &d, o.prompt ? o.prompt : "", steps);

    free_sampler(&sampler);
    free_tokenizer(&tok);
    free_transformer(&t);
    return 0;
}
#endif
