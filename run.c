/* run.c - inference for Llama-architecture language models, in one C11 file.

   USAGE
     ./run checkpoint.bin [options]           (./run --help lists the options)
     ./run stories260K.bin -z tok512.bin -i "Once upon a time"
     ./run model.bin -m chat -y "You are a helpful assistant."
     ./run model.bin -i "Lily" --top-k 40 --repetition-penalty 1.2 --stop "."

   WHAT IS IN HERE, IN READING ORDER
        errors, and the platform layer (POSIX or Windows): mapping a file,
        reading a line, the clock, sockets
     1. data structures: Config, the architectures (Arch, a row each),
        Matrix, Weights, RunState, Transformer
     2. checkpoint loading: mmap, header validation, weight mapping, files
        of the wrong kind named as what they are; 2.1 GGUF files (llama.cpp's
        format), 2.2 a model from one (types F32 to Q6_K, IQ4_NL, IQ4_XS
        and MXFP4; the architectures of section 1's table: llama, qwen2,
        qwen3, gemma3, phi3, smollm3, granite; with experts qwen3moe,
        qwen2moe, olmoe, gpt-oss and deepseek2)
     3. kernels: rmsnorm, softmax, matmul (quantised weights packed at
        load for the VNNI kernel, GGUF's straight from their blocks;
        bfloat16 dot products, bfloat16 weights packed in 12 bits), rope,
        attention (the math in comments)
     4. the paged key/value cache (float32, f16 or q8_0 rows: --kv-type;
        past the context with --keep: a ring of slots)
        and the forward pass over a batch of rows
     5. the tokenizers: 5.1 llama2.c's tokenizer.bin (SentencePiece BPE),
        5.2 byte-level BPE "tk42" files (Llama 3), 5.3 the vocabularies of
        GGUF files (SentencePiece or byte-level, with their pre-tokenizers)
     6. samplers: greedy, temperature, top-p; the generation controls
        (logits processors, top-k, min-p, stop strings); beam search;
        6.1 JSON constraints (a JSON-schema subset compiled to an automaton
        that masks the tokens an answer cannot take)
     7. the engine: requests served together (continuous batching);
        speculative decoding (drafts verified in one pass)
     8. drivers: generate, tokenize, chat; perplexity of a text
     9. the command line
    10. batch requests: JSON Lines in, JSON lines out
    11. serving: an HTTP server with the OpenAI API (-m serve);
        11.1 tool calls (tools rendered in the prompt, calls constrained
        by 6.1 to their functions' parameters); 11.2 the same calls from
        the command line (-m chat --tools, --batch lines with messages)
    12. main

   BUILD OPTIONS
     -fopenmp        threads over matrix rows (set the count with -T)
     -march=native   AVX2 or AVX-512 matmul kernels where the machine has them
                     (otherwise plain C, summed in llama2.c's order)
     -DRUN_SIMD      NEON matmul kernels on aarch64 (with sdot under
                     -march=armv8.2-a+dotprod); `make runfast` and `make runomp`
                     set it. `./run --version` names the kernels built in.
     Linux, macOS (POSIX) and Windows (MinGW-w64: `make run.exe`) build it.
     -DTESTING       leaves out main(), so tests can #include "run.c"

   Output is byte-identical to karpathy's llama2.c run.c for the same checkpoint,
   tokenizer, flags and seed (built as `make run`: no -march, no fast-math);
   unlike it, every input is validated and every failure is a one-line error
   with a non-zero exit status (1: bad file or runtime failure, 2: bad usage). */

#define _POSIX_C_SOURCE 200809L
#ifdef __linux__
#define _DEFAULT_SOURCE /* madvise (glibc) */
#endif
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#include <io.h>
#include <shellapi.h>
#ifdef _MSC_VER
#pragma comment(lib, "shell32.lib")
#endif
#else
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#ifdef __linux__
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <linux/sockios.h>
#endif
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <unistd.h>
#endif
#ifdef _OPENMP
#include <omp.h>
/* the loop that follows split in equal ranges between threads, or run on one
   thread when `cond` is false (too little work) */
#define PRAGMA(text) _Pragma(#text)
#define PARALLEL_FOR_IF(cond) PRAGMA(omp parallel for schedule(static) if (cond))
/* the same in shares that shrink as the loop runs out (guided): each
   thread starts on a large share and then takes smaller ones as it is
   free, so that a thread slowed by the other's memory traffic does not
   keep it waiting at the end */
#define PARALLEL_GUIDED_IF(cond) PRAGMA(omp parallel for schedule(guided) if (cond))
/* a region that every thread runs (one thread when `cond` is false), the
   loops inside it shared out by SHARED_LOOP (a range at a time, to
   whichever thread is free; no thread waits for the others at its end),
   and a read-and-update of one variable (ATOMIC_CAPTURE) that no other
   thread interleaves with */
#define PARALLEL_REGION_IF(cond) PRAGMA(omp parallel if (cond))
#define SHARED_LOOP PRAGMA(omp for schedule(dynamic) nowait)
#define ATOMIC_CAPTURE PRAGMA(omp atomic capture)
static int max_threads(void) { return omp_get_max_threads(); }
static int thread_id(void) { return omp_get_thread_num(); }
#else
/* no threads: the loop runs as written (the condition is only evaluated, so
   that the variables it reads count as used) */
#define PARALLEL_FOR_IF(cond) if ((void)(cond), 1)
#define PARALLEL_GUIDED_IF(cond) if ((void)(cond), 1)
#define PARALLEL_REGION_IF(cond) if ((void)(cond), 1)
#define SHARED_LOOP
#define ATOMIC_CAPTURE
static int max_threads(void) { return 1; }
static int thread_id(void) { return 0; }
#endif

/* ------------------------------------------------------------------------ */
/* Errors                                                                   */
/* ------------------------------------------------------------------------ */

enum { EXIT_BAD_FILE = 1, EXIT_USAGE = 2 };

#include <setjmp.h>
/* Unit tests, fuzz targets and the server (a bad request) set error_trap to
   catch errors instead of exiting; error_status then holds the exit status
   that would have been, and error_text the message. */
static jmp_buf *error_trap;
static int error_status;
static char error_text[1024];

/* Ends the program with `status`, or returns to the test's trap. */
static void leave(int status) {
    if (error_trap) {
        error_status = status;
        longjmp(*error_trap, 1);
    }
    exit(status);
}

/* Prints "run: <message>" on one line of stderr and exits with `status`. */
static void die(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_text, sizeof(error_text), fmt, ap);
    va_end(ap);
    fprintf(stderr, "run: %s\n", error_text);
    leave(status);
}

static void *xcalloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) die(EXIT_BAD_FILE, "out of memory (%zu x %zu bytes)", count, size);
    return p;
}

/* The n bytes at p as a string of their own. */
static char *span_dup(const char *p, size_t n) {
    char *s = xcalloc(n + 1, 1);
    memcpy(s, p, n);
    return s;
}

/* A copy of s without white space at either end (the templates' `| trim`). */
static char *trimmed(const char *s) {
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) n--;
    return span_dup(s, n);
}

/* A growing byte buffer, NUL-terminated. */
typedef struct {
    char *data;
    size_t n, cap;
} ByteBuf;

static void buf_add(ByteBuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->data, cap);
        if (!p) die(EXIT_BAD_FILE, "out of memory (a buffer of %zu bytes)", cap);
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->n, s, n);
    b->n += n;
    b->data[b->n] = '\0';
}

static void buf_str(ByteBuf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_printf(ByteBuf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < (int)sizeof(small)) { buf_add(b, small, (size_t)n); return; }
    char *big = xcalloc((size_t)n + 1, 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    buf_add(b, big, (size_t)n);
    free(big);
}

static void buf_free(ByteBuf *b) {
    free(b->data);
    memset(b, 0, sizeof(*b));
}

/* ------------------------------------------------------------------------ */
/* Platform: POSIX (Linux, macOS) or Windows (MinGW-w64)                    */
/* ------------------------------------------------------------------------ */

/* What the C library does not give portably: mapping a file, reading a line
   of any length, reading input as it arrives, a monotonic clock, and the
   process's standard streams. Each
   has a POSIX and a Windows version that behave alike, so the rest of the
   file has no platform #ifdef. */

/* A socket of the server (section 11) is an int; NO_SOCKET is none. */
typedef int Socket;
#define NO_SOCKET (-1)

/* The server's sockets are waited on together by a poller: each is watched
   under a tag (a small integer, below the poller's capacity) for reading,
   writing or neither, and a wait reports the tags of those that can move.
   Its cost is that of the sockets that are ready, not of those watched
   (epoll on Linux; elsewhere poll, over all of them). */
typedef struct {
    int tag;
    int can_read, can_write;   /* a closed or failed socket counts as readable */
} NetEvent;

typedef struct NetPoller NetPoller;

#ifndef _WIN32
/* Maps the regular file at `path` read-only and sets *size to its length;
   dies naming `kind` when it cannot be opened, is not a regular file, is
   empty or cannot be mapped. */
static void *map_readonly(const char *path, size_t *size, const char *kind) {
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
    return data;
}

static void unmap(void *data, size_t size) { munmap(data, size); }

/* Asks for 2 MB pages for p..p+bytes (alloc_pages). */
static void advise_huge_pages(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#else
    (void)p, (void)bytes;
#endif
}

/* `bytes` of zeroed memory in whole pages, in 2 MB pages where the system
   gives them (Linux's transparent huge pages on request), as the mapped
   file has where its file system does; the packed weights and the
   key/value cache live there: streams of reads that cross no 4 KB page
   boundary every few rows (the hardware prefetchers stop at them) and miss
   the address-translation caches less. `what` names them in the error.
   huge_now 0: small pages first, for memory written whole at once (the
   packed weights), with advise_huge_pages afterwards: a system that finds
   each 2 MB page by compacting memory at its first touch (Linux's default
   for memory that asks for them) took 0.5 to 1.5 s more to pack a 1B
   model's 850 MB, and the system joins small pages into huge ones later. */
static void *alloc_pages(size_t bytes, const char *what, int huge_now) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die(EXIT_BAD_FILE, "out of memory (%zu bytes for %s)", bytes, what);
    if (huge_now) advise_huge_pages(p, bytes);
    return p;
}

static void free_pages(void *p, size_t bytes) { munmap(p, bytes); }

/* Gives back the memory of the pages wholly inside p..p+bytes-1 of the
   read-only mapped file: read again from the file if touched again. */
static void release_pages(const void *p, size_t bytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), from = ((uintptr_t)p + page - 1) / page * page, to = ((uintptr_t)p + bytes) / page * page;
    if (to > from) madvise((void *)from, to - from, MADV_DONTNEED);
}

/* One line of any length from f, with its newline: its length, or -1 at
   the end of input (getline's contract). From a terminal, each read is what
   the user sent: a line ended by Enter, or part of one sent by Ctrl-D, which
   is taken as the whole line (getline would wait for a second Ctrl-D), or
   nothing (Ctrl-D at a line's start: the end). */
static ptrdiff_t read_line_raw(char **line, size_t *cap, FILE *f) {
    if (!isatty(fileno(f))) return getline(line, cap, f);
    size_t n = 0;
    for (;;) {
        if (*cap < n + 4097) {
            char *p = realloc(*line, n + 8192);
            if (!p) return -1;
            *line = p;
            *cap = n + 8192;
        }
        size_t room = *cap - n - 1;
        ptrdiff_t k = read(fileno(f), *line + n, room);
        if (k <= 0) break;
        n += (size_t)k;
        if ((*line)[n - 1] == '\n' || (size_t)k < room) break; /* Enter, or Ctrl-D; else a line longer than the room */
    }
    if (n == 0) return -1;
    (*line)[n] = '\0';
    return (ptrdiff_t)n;
}

/* Input read as it arrives (--batch): a file descriptor of `path` (- for
   standard input), or -1 with errno set. */
static int input_open(const char *path) { return strcmp(path, "-") == 0 ? STDIN_FILENO : open(path, O_RDONLY); }

static void input_close(int fd) {
    if (fd != STDIN_FILENO) close(fd);
}

/* Whether a read of fd would not block now (bytes, the end of input or an
   error are there), waiting up to timeout_ms for it; a signal ends the wait
   early (then 0). */
static int input_wait(int fd, int timeout_ms) {
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, timeout_ms) > 0;
}

/* Bytes read (> 0), 0 at the end of input, -1 on an error, -2 when nothing
   can be read now. */
static ptrdiff_t input_read(int fd, char *buf, size_t n) {
    ptrdiff_t k = read(fd, buf, n);
    return k >= 0 ? k : (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? -2 : -1;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void platform_setup(int *argc, char ***argv) {
    (void)argc, (void)argv;
    signal(SIGPIPE, SIG_IGN); /* a closed stdout becomes a write error, reported by flush_output */
}

/* Calls `handler` on SIGINT (Ctrl-C); `restart`: the system calls it
   interrupts go on (writes to stdout), else they fail with EINTR (the read
   of a chat message, which then ends). */
static void on_sigint(void (*handler)(int), int restart) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = handler;
    sa.sa_flags = restart ? SA_RESTART : 0;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
}

/* Calls `handler` on SIGTERM (a service manager's stop). */
static void on_sigterm(void (*handler)(int)) { signal(SIGTERM, handler); }

/* Sockets for the server (section 11): TCP, non-blocking, waited on by a
   NetPoller. */
static void net_nonblocking(Socket s) { fcntl(s, F_SETFL, fcntl(s, F_GETFL, 0) | O_NONBLOCK); }

/* A listening socket on host:port (port 0: a free one); *bound gets the
   port. Dies naming what failed. */
static Socket net_listen(const char *host, int port, int *bound) {
    char service[16];
    snprintf(service, sizeof(service), "%d", port);
    struct addrinfo hints, *list = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int rc = getaddrinfo(host, service, &hints, &list);
    if (rc != 0) die(EXIT_USAGE, "--host %s: %s", host, gai_strerror(rc));
    Socket s = NO_SOCKET;
    int error = 0;
    for (struct addrinfo *a = list; a && s == NO_SOCKET; a = a->ai_next) {
        s = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (s < 0) { error = errno; s = NO_SOCKET; continue; }
        int one = 1;
        setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(s, a->ai_addr, a->ai_addrlen) != 0 || listen(s, SOMAXCONN) != 0) {
            error = errno;
            close(s);
            s = NO_SOCKET;
        }
    }
    freeaddrinfo(list);
    if (s == NO_SOCKET) die(EXIT_BAD_FILE, "cannot listen on %s:%d: %s", host, port, strerror(error));
    struct sockaddr_storage addr;
    socklen_t len = sizeof(addr);
    getsockname(s, (struct sockaddr *)&addr, &len);
    *bound = ntohs(addr.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&addr)->sin6_port : ((struct sockaddr_in *)&addr)->sin_port);
    net_nonblocking(s);
    return s;
}

/* A waiting connection (non-blocking), or NO_SOCKET. */
static Socket net_accept(Socket listener) {
    Socket s = accept(listener, NULL, NULL);
    if (s < 0) return NO_SOCKET;
    net_nonblocking(s);
    return s;
}

/* Bytes moved (> 0), 0 when the peer has closed (recv), -1 on an error,
   -2 when nothing can move now. */
static ptrdiff_t net_recv(Socket s, char *buf, size_t n) {
    ptrdiff_t k = recv(s, buf, n, 0);
    return k >= 0 ? k : (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? -2 : -1;
}

static ptrdiff_t net_send(Socket s, const char *buf, size_t n) {
    ptrdiff_t k = send(s, buf, n, 0);
    return k >= 0 ? k : (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? -2 : -1;
}

static void net_close(Socket s) { close(s); }

/* Bytes sent on s that its peer has not taken yet: the kernel's send queue
   (Linux: SIOCOUTQ; macOS: SO_NWRITE; elsewhere unknown, 0). The kernel
   grows that queue to megabytes for a client that does not read, so what
   the process still holds alone says little. (What the peer's kernel has
   taken and its reader has not, its receive buffer, nothing here can see.) */
static size_t net_queued(Socket s) {
    int n = 0;
#if defined(__linux__)
    if (ioctl(s, SIOCOUTQ, &n) != 0) n = 0;
#elif defined(SO_NWRITE)
    socklen_t len = sizeof(n);
    if (getsockopt(s, SOL_SOCKET, SO_NWRITE, &n, &len) != 0) n = 0;
#else
    (void)s;
#endif
    return n > 0 ? (size_t)n : 0;
}

/* The soft limit on open descriptors raised toward `want` (as far as the
   hard limit allows); returns the soft limit now, and *hard the hard one
   (-1: none). */
static long net_raise_descriptors(long want, long *hard) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) { *hard = -1; return want; }
    *hard = r.rlim_max == RLIM_INFINITY ? -1 : (long)r.rlim_max;
    if (r.rlim_cur != RLIM_INFINITY && (long)r.rlim_cur < want) {
        rlim_t before = r.rlim_cur;
        r.rlim_cur = r.rlim_max != RLIM_INFINITY && (long)r.rlim_max < want ? r.rlim_max : (rlim_t)want;
        if (setrlimit(RLIMIT_NOFILE, &r) != 0) r.rlim_cur = before;
    }
    return r.rlim_cur == RLIM_INFINITY ? want : (long)r.rlim_cur;
}

/* Gives the allocator's free memory back to the system: glibc keeps what a
   burst of requests freed for reuse, so that a server idle after one would
   keep the size of its peak. */
static void release_free_memory(void) {
#ifdef __GLIBC__
    malloc_trim(0);
#endif
}

/* What a socket is watched for: NET_READ, NET_WRITE, both or neither (0). */
#define NET_READ 1
#define NET_WRITE 2

#ifdef __linux__
struct NetPoller {
    int fd;                     /* the epoll instance */
    unsigned char *watched;     /* (capacity) by tag: 0 not watched, else 1 + what it is watched for */
    struct epoll_event *ready;  /* (capacity) what a wait found */
    int capacity;
};

static NetPoller *net_poller_new(int capacity) {
    NetPoller *p = xcalloc(1, sizeof(NetPoller));
    p->fd = epoll_create1(EPOLL_CLOEXEC);
    if (p->fd < 0) die(EXIT_BAD_FILE, "cannot create an epoll instance: %s", strerror(errno));
    p->watched = xcalloc((size_t)capacity, 1);
    p->ready = xcalloc((size_t)capacity, sizeof(struct epoll_event));
    p->capacity = capacity;
    return p;
}

/* Watches socket s under `tag` for what want (NET_READ | NET_WRITE) says;
   nothing is asked of the system when that has not changed. */
static void net_watch(NetPoller *p, Socket s, int tag, int want) {
    if (p->watched[tag] == want + 1) return;
    struct epoll_event ev;
    memset(&ev, 0, sizeof(ev));
    ev.events = (want & NET_READ ? EPOLLIN : 0u) | (want & NET_WRITE ? EPOLLOUT : 0u);
    ev.data.u32 = (uint32_t)tag;
    epoll_ctl(p->fd, p->watched[tag] ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s, &ev);
    p->watched[tag] = (unsigned char)(want + 1);
}

/* Stops watching s (before it is closed). */
static void net_unwatch(NetPoller *p, Socket s, int tag) {
    if (!p->watched[tag]) return;
    epoll_ctl(p->fd, EPOLL_CTL_DEL, s, NULL);
    p->watched[tag] = 0;
}

/* Waits up to timeout_ms for a watched socket to be ready; fills ev (room
   for the poller's capacity) and returns how many are. */
static int net_poll(NetPoller *p, NetEvent *ev, int timeout_ms) {
    int n = epoll_wait(p->fd, p->ready, p->capacity, timeout_ms);
    for (int i = 0; i < n; i++) {
        uint32_t r = p->ready[i].events;
        ev[i] = (NetEvent){(int)p->ready[i].data.u32, (r & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0, (r & (EPOLLOUT | EPOLLHUP | EPOLLERR)) != 0};
    }
    return n > 0 ? n : 0;
}

static void net_poller_free(NetPoller *p) {
    close(p->fd);
    free(p->watched);
    free(p->ready);
    free(p);
}
#else
struct NetPoller {
    struct pollfd *fds;         /* (n) the watched sockets */
    int *tag_of;                /* (n) the tag of each */
    int *at;                    /* (capacity) by tag: its place in fds, -1 when not watched */
    int n, capacity;
};

static NetPoller *net_poller_new(int capacity) {
    NetPoller *p = xcalloc(1, sizeof(NetPoller));
    p->fds = xcalloc((size_t)capacity, sizeof(struct pollfd));
    p->tag_of = xcalloc((size_t)capacity, sizeof(int));
    p->at = xcalloc((size_t)capacity, sizeof(int));
    for (int i = 0; i < capacity; i++) p->at[i] = -1;
    p->capacity = capacity;
    return p;
}

static void net_watch(NetPoller *p, Socket s, int tag, int want) {
    if (p->at[tag] < 0) {
        p->at[tag] = p->n;
        p->tag_of[p->n] = tag;
        p->fds[p->n++].fd = s;
    }
    p->fds[p->at[tag]].events = (short)((want & NET_READ ? POLLIN : 0) | (want & NET_WRITE ? POLLOUT : 0));
}

static void net_unwatch(NetPoller *p, Socket s, int tag) {
    (void)s;
    int i = p->at[tag];
    if (i < 0) return;
    p->n--;
    p->fds[i] = p->fds[p->n];
    p->tag_of[i] = p->tag_of[p->n];
    p->at[p->tag_of[i]] = i;
    p->at[tag] = -1;
}

static int net_poll(NetPoller *p, NetEvent *ev, int timeout_ms) {
    int ready = poll(p->fds, (nfds_t)p->n, timeout_ms), k = 0;
    for (int i = 0; ready > 0 && i < p->n; i++) {
        short r = p->fds[i].revents;
        if (r) ev[k++] = (NetEvent){p->tag_of[i], (r & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) != 0, (r & (POLLOUT | POLLERR | POLLHUP)) != 0};
    }
    return k;
}

static void net_poller_free(NetPoller *p) {
    free(p->fds);
    free(p->tag_of);
    free(p->at);
    free(p);
}
#endif
#else
/* Text is UTF-8 inside the program, as on POSIX; Windows' own calls take
   UTF-16. Returns the UTF-16 copy of `s`, to be freed. */
static wchar_t *utf8_to_wide(const char *s) {
    int n = MultiByteToWideChar(CP_UTF8, 0, s, -1, NULL, 0);
    wchar_t *w = xcalloc(n > 0 ? (size_t)n : 1, sizeof(wchar_t));
    if (n > 0) MultiByteToWideChar(CP_UTF8, 0, s, -1, w, n);
    return w;
}

/* The same through the C runtime's file descriptors (so that errno, and the
   message for a missing file, are those of the POSIX version) and a file
   mapping object; the view stays valid after both handles are closed. */
static void *map_readonly(const char *path, size_t *size, const char *kind) {
    wchar_t *wide_path = utf8_to_wide(path);
    int fd = _wopen(wide_path, _O_RDONLY | _O_BINARY);
    free(wide_path);
    if (fd < 0) die(EXIT_BAD_FILE, "%s: cannot open %s: %s", path, kind, strerror(errno));
    struct _stat64 st;
    if (_fstat64(fd, &st) != 0 || (st.st_mode & _S_IFMT) != _S_IFREG) {
        _close(fd);
        die(EXIT_BAD_FILE, "%s: %s is not a regular file", path, kind);
    }
    *size = (size_t)st.st_size;
    if (*size == 0) {
        _close(fd);
        die(EXIT_BAD_FILE, "%s: %s is empty", path, kind);
    }
    HANDLE mapping = CreateFileMappingA((HANDLE)_get_osfhandle(fd), NULL, PAGE_READONLY, 0, 0, NULL);
    void *data = mapping ? MapViewOfFile(mapping, FILE_MAP_READ, 0, 0, 0) : NULL;
    unsigned long error = data ? 0 : (unsigned long)GetLastError();
    if (mapping) CloseHandle(mapping);
    _close(fd);
    if (!data) die(EXIT_BAD_FILE, "%s: cannot map %s: Windows error %lu", path, kind, error);
    return data;
}

static void unmap(void *data, size_t size) {
    (void)size;
    UnmapViewOfFile(data);
}

static void advise_huge_pages(void *p, size_t bytes) { (void)p, (void)bytes; }

static void *alloc_pages(size_t bytes, const char *what, int huge_now) {
    (void)huge_now;
    void *p = VirtualAlloc(NULL, bytes, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE);
    if (!p) die(EXIT_BAD_FILE, "out of memory (%zu bytes for %s)", bytes, what);
    return p;
}

static void free_pages(void *p, size_t bytes) {
    (void)bytes;
    VirtualFree(p, 0, MEM_RELEASE);
}

static void release_pages(const void *p, size_t bytes) { (void)p; (void)bytes; } /* the mapping's pages stay */

/* getline's contract, one character at a time (there is no getline). */
static ptrdiff_t read_line_raw(char **line, size_t *cap, FILE *f) {
    size_t len = 0;
    for (int c; (c = getc(f)) != EOF;) {
        if (len + 2 > *cap) {
            size_t grown = *cap ? 2 * *cap : 128;
            char *p = realloc(*line, grown);
            if (!p) die(EXIT_BAD_FILE, "out of memory reading a line of %zu bytes", len);
            *line = p;
            *cap = grown;
        }
        (*line)[len++] = (char)c;
        if (c == '\n') break;
    }
    if (len == 0) return -1;
    (*line)[len] = '\0';
    return (ptrdiff_t)len;
}

static double now_seconds(void) {
    LARGE_INTEGER count, frequency;
    QueryPerformanceCounter(&count);
    QueryPerformanceFrequency(&frequency);
    return (double)count.QuadPart / (double)frequency.QuadPart;
}

/* The same input for --batch through the C runtime's descriptors. Only a
   pipe can be asked whether bytes are there (PeekNamedPipe; a writer gone
   counts as the end of input, readable); a file never blocks, and a console
   is taken as always readable: there a read waits for the next typed line
   even while requests run (Windows has no poll for consoles, and this file
   uses no threads). */
static int input_open(const char *path) {
    if (strcmp(path, "-") == 0) return _fileno(stdin);
    wchar_t *wide_path = utf8_to_wide(path);
    int fd = _wopen(wide_path, _O_RDONLY | _O_BINARY);
    free(wide_path);
    return fd;
}

static void input_close(int fd) {
    if (fd != _fileno(stdin)) _close(fd);
}

static int input_wait(int fd, int timeout_ms) {
    HANDLE h = (HANDLE)_get_osfhandle(fd);
    if (GetFileType(h) != FILE_TYPE_PIPE) return 1;
    for (double until = now_seconds() + timeout_ms / 1000.0;;) {
        DWORD avail = 0;
        if (!PeekNamedPipe(h, NULL, 0, NULL, &avail, NULL) || avail > 0) return 1;
        if (now_seconds() >= until) return 0;
        Sleep(1);
    }
}

static ptrdiff_t input_read(int fd, char *buf, size_t n) {
    int k = _read(fd, buf, n > INT_MAX ? INT_MAX : (unsigned)n);
    return k >= 0 ? k : errno == EINTR ? -2 : -1;
}

/* The arguments in UTF-8 (the C runtime's argv has the ANSI code page's
   bytes, and '?' for what that lacks); stdout and stderr in binary mode, so
   that "\n" is written as one byte and the output is the same bytes as on
   Linux (text mode writes "\r\n"); stdin stays in text mode, so a typed
   line's "\r\n" ends it as "\n" would. There is no SIGPIPE: a closed pipe
   is a write error already. */
static void platform_setup(int *argc, char ***argv) {
    int n;
    wchar_t **wide = CommandLineToArgvW(GetCommandLineW(), &n);
    if (wide) {
        char **utf8 = xcalloc((size_t)n + 1, sizeof(char *)); /* kept until the program ends, as argv */
        for (int i = 0; i < n; i++) {
            int bytes = WideCharToMultiByte(CP_UTF8, 0, wide[i], -1, NULL, 0, NULL, NULL);
            utf8[i] = xcalloc(bytes > 0 ? (size_t)bytes : 1, 1);
            if (bytes > 0) WideCharToMultiByte(CP_UTF8, 0, wide[i], -1, utf8[i], bytes, NULL, NULL);
        }
        LocalFree(wide);
        *argc = n;
        *argv = utf8;
    }
    _setmode(_fileno(stdout), _O_BINARY);
    _setmode(_fileno(stderr), _O_BINARY);
}

/* The C runtime's signal(): SIGINT comes on Ctrl-C; system calls are not
   interrupted, so `restart` changes nothing. */
static void on_sigint(void (*handler)(int), int restart) {
    (void)restart;
    signal(SIGINT, handler);
}

static void on_sigterm(void (*handler)(int)) { signal(SIGTERM, handler); }

/* The server is not built for Windows: listening says so (the rest is never
   reached), and the Windows build needs no socket library. */
static Socket net_listen(const char *host, int port, int *bound) {
    (void)host, (void)port, (void)bound;
    die(EXIT_USAGE, "-m serve is not supported on Windows (run it on Linux or macOS)");
    return NO_SOCKET;
}
static Socket net_accept(Socket listener) { (void)listener; return NO_SOCKET; }
static ptrdiff_t net_recv(Socket s, char *buf, size_t n) { (void)s, (void)buf, (void)n; return -1; }
static ptrdiff_t net_send(Socket s, const char *buf, size_t n) { (void)s, (void)buf, (void)n; return -1; }
static void net_close(Socket s) { (void)s; }
static size_t net_queued(Socket s) { (void)s; return 0; }
static long net_raise_descriptors(long want, long *hard) { *hard = -1; return want; }
static void release_free_memory(void) {}
#define NET_READ 1
#define NET_WRITE 2
struct NetPoller { int unused; };
static NetPoller *net_poller_new(int capacity) { (void)capacity; return xcalloc(1, sizeof(NetPoller)); }
static void net_watch(NetPoller *p, Socket s, int tag, int want) { (void)p, (void)s, (void)tag, (void)want; }
static void net_unwatch(NetPoller *p, Socket s, int tag) { (void)p, (void)s, (void)tag; }
static int net_poll(NetPoller *p, NetEvent *ev, int timeout_ms) {
    (void)p, (void)ev;
    Sleep((DWORD)timeout_ms);
    return 0;
}
static void net_poller_free(NetPoller *p) { free(p); }
#endif

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
    /* version 4 headers; older ones: 1e-5 and RoPE base 10000, unscaled */
    float norm_eps;      /* rmsnorm's epsilon */
    float rope_theta;    /* RoPE base */
    int rope_scaling;    /* ROPE_SCALING_NONE or ROPE_SCALING_LLAMA3 */
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor; /* llama3 scaling */
    int rope_original_context; /* llama3 scaling: the context the model was trained with */
    int rope_halves;     /* RoPE turns element i with i + rope_dims / 2 (GGUF qwen2 and most others), not adjacent pairs */
    /* the width of a head and of the part RoPE turns: dim / n_heads for
       run.c's own checkpoints; a GGUF file may set both apart (section 2.3) */
    int head_size;
    int rope_dims;
    const struct Arch *arch; /* the architecture's row (ARCHS, below): what the forward pass adds to llama's */
    int window;          /* the windowed layers' attention reaches the last `window` positions; 0: no windows */
    int window_period;   /* layer l is global when l % window_period == window_period - 1, else windowed */
    float rope_theta_local;   /* RoPE base of the windowed layers */
    float rope_mscale;        /* RoPE's cosines and sines times this (LongRoPE's attention factor, YaRN's); 0 or 1: none */
    int rope_off;             /* no layer turns RoPE (Granite's rope.scaling.finetuned false) */
    float embed_scale;        /* the token embedding times this (Gemma: sqrt(dim); Granite); 0: none */
    float residual_scale;     /* each block's output times this as it joins the residual (Granite); 0: none */
    float att_multiplier;     /* attention scores times this; 0: divided by sqrt(head_size) */
    float logit_scale;        /* the logits divided by this (Granite); 0: none */
    float softcap;            /* logits = softcap * tanh(logits / softcap) (Gemma); 0: none */
    /* a mixture of experts (GGUF expert_count > 0; section 4's moe_ffn) */
    int n_experts;            /* experts of a layer; 0: every layer's FFN is dense */
    int n_experts_used;       /* the k experts each row takes */
    int expert_hidden;        /* an expert's FFN inner width */
    int shared_hidden;        /* a shared expert's (expert_shared_feed_forward_length; default hidden_dim) */
    int qk_norm_whole;        /* QK-norm over the whole q and k rows (OLMoE), not head by head */
    int gating;               /* how a router's logits choose experts: GATING_* (the Arch's, or the file's) */
    int moe_norm;             /* the chosen experts' weights renormalised to sum 1 (the Arch's, or the file's) */
    float expert_scale;       /* the chosen experts' weights times this (DeepSeek's expert_weights_scale); 0: none */
    /* multi-head latent attention (Arch mla, section 4's MLA step): the
       attention runs as one key head of head_size = mla_rank + rope_dims
       values (the latent c and the RoPE key, one cache row a position),
       each query head's nope part absorbed into the latent's width */
    int mla_rank;             /* the latent's width (attention.kv_lora_rank); 0: no MLA */
    int mla_nope;             /* a query head's part without RoPE (key_length_mla - rope_dims) */
    int mla_value;            /* a head's output width (value_length_mla) */
    int q_rank;               /* attention.q_lora_rank: q = attn_q_b @ norm(attn_q_a @ x); 0: q = attn_q @ x */
    int mla_split;            /* the newer files (key_length_mla): attn_k_b and attn_v_b; else attn_kv_b */
    int leading_dense;        /* DeepSeek: its first leading_dense_block_count layers' FFNs are dense */
} Config;

/* An architecture (GGUF's general.architecture): llama's forward pass and
   which of a few optional steps it adds (section 4 names each where it
   runs). run.c's own checkpoints are `llama`. */
enum { ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI };
/* how a router's logits become the chosen experts and their weights (route) */
enum { GATING_SOFTMAX, GATING_TOPK_SOFTMAX, GATING_SIGMOID };
typedef struct Arch {
    const char *name;
    int rope_halves;    /* RoPE pairs (i, i + rope_dims / 2) (llama.cpp's NEOX); 0: adjacent pairs
                           (its NORM: the converter permuted q and k's rows to them) */
    int qk_norm;        /* q and k RMS-normalised head by head (attn_q_norm, attn_k_norm), before RoPE */
    int post_norms;     /* the attention's and the FFN's outputs RMS-normalised before they join the
                           residual (post_attention_norm, post_ffw_norm) */
    int activation;     /* the gated FFN's (the experts' too): ACT_SILU (SwiGLU), ACT_GELU (GELU, tanh form)
                           or ACT_SWIGLU_OAI (gpt-oss: gate and up clamped, sigmoid(1.702 g), up + 1) */
    int embed_sqrt_dim; /* the embedding times sqrt(dim) */
    int window_period;  /* where the file gives a sliding window, the period of its layers unless the file
                           says (attention.sliding_window_pattern): layer l attends to all its past when
                           l % period == period - 1, to the window otherwise */
    int no_rope_period; /* layer l turns no RoPE when (l + 1) % period == 0; 0: all turn */
    int fused;          /* attn_qkv may hold q, k and v's rows, ffn_up the gate's then the up's */
    int scales;         /* the file's embedding, residual, attention and logit scales (Granite) */
    int moe_norm;       /* with experts (expert_count): the chosen experts' weights renormalised to sum to 1 */
    int gating;         /* with experts: GATING_SOFTMAX (the softmax over all experts, the k most probable)
                           or GATING_TOPK_SOFTMAX (the k largest logits, their softmax: gpt-oss) */
    int sinks;          /* attn_sinks: a learned logit per head that joins each softmax's denominator */
    int biases;         /* attn_output.bias, the router's (ffn_gate_inp.bias) and the experts' biases
                           (ffn_{gate,up,down}_exps.bias, a row per expert), all required (gpt-oss) */
    const char *ffn_norm; /* the FFN's input norm: blk.N.<ffn_norm>.weight */
    float swa_base;     /* the windowed layers' RoPE base unless the file says (rope.freq_base_swa);
                           0: the global layers' */
    int mla;            /* multi-head latent attention (DeepSeek-V2: Config mla_rank); the file says how
                           experts are gated, weighted and scaled, and how wide its shared experts are */
} Arch;

static const Arch ARCHS[] = {
    /* name      halves qk_norm post_norms activation      sqrt(dim) window no_rope fused scales moe_norm gating
                 sinks biases ffn_norm swa_base mla */
    {"llama",    0,     0,      0,         ACT_SILU,       0,        0,     0,      0,    0,     1, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"qwen2",    1,     0,      0,         ACT_SILU,       0,        0,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"qwen3",    1,     1,      0,         ACT_SILU,       0,        0,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"gemma3",   1,     1,      1,         ACT_GELU,       1,        6,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 10000.0f, 0},
    {"phi3",     1,     0,      0,         ACT_SILU,       0,        0,     0,      1,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"smollm3",  0,     0,      0,         ACT_SILU,       0,        0,     4,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"granite",  0,     0,      0,         ACT_SILU,       0,        0,     0,      0,    1,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"qwen3moe", 1,     1,      0,         ACT_SILU,       0,        0,     0,      0,    0,     1, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"qwen2moe", 1,     0,      0,         ACT_SILU,       0,        0,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    {"olmoe",    1,     1,      0,         ACT_SILU,       0,        0,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        0},
    /* gpt-oss: the FFN's norm is named post_attention_norm; every second layer windowed (0, 2, ...) */
    {"gpt-oss",  1,     0,      0,         ACT_SWIGLU_OAI, 0,        2,     0,      0,    0,     0, GATING_TOPK_SOFTMAX,
                 1,     1,     "post_attention_norm", 0, 0},
    /* DeepSeek-V2: latent attention, adjacent RoPE pairs on the 64-wide part */
    {"deepseek2", 0,    0,      0,         ACT_SILU,       0,        0,     0,      0,    0,     0, GATING_SOFTMAX,
                 0,     0,     "ffn_norm", 0,        1},
};
#define N_ARCHS ((int)(sizeof(ARCHS) / sizeof(ARCHS[0])))
#define ARCH_NAMES "llama, qwen2, qwen3, gemma3, phi3, smollm3, granite, qwen3moe, qwen2moe, olmoe, gpt-oss, deepseek2"

/* Query and key/value widths of a row: heads x head_size. */
static int q_dim(const Config *p) { return p->n_heads * p->head_size; }
static int kv_dim_of(const Config *p) { return p->n_kv_heads * p->head_size; }

enum { ROPE_SCALING_NONE, ROPE_SCALING_LLAMA3 };

/* A value of a bfloat16 matrix that its 12-bit form cannot hold (section 3) */
typedef struct {
    uint32_t row, col;
    float value;
} SplitException;

/* A weight matrix W of shape (rows, cols), row-major, applied as W @ x:
   float32 values (or 16-bit floats, computed as the float32 they widen to),
   or int8 or 4-bit values in groups of group_size consecutive
   values of a row, value = q * scale of its group ("Q8_0", version 3's Q4),
   plus the group's offset for the GGUF types that have one (section 2.2). */
typedef struct {
    const float *w;     /* float32: (rows, cols); NULL for the other types */
    const uint16_t *half; /* GGUF F16 or BF16 (`bf16`): (rows, cols) 16-bit values, read in place from
                             the file and widened to float32 as the kernels load them (exactly) */
    int bf16;
    const int8_t *q;    /* int8: (rows, cols); NULL for 4-bit */
    const char *scales; /* int8, 4-bit: (rows * cols / group_size) float32, maybe unaligned */
    const float *offsets; /* GGUF types with a minimum: (cols / group_size, rows) float32, group
                             by group (add_offsets reads them so), value = q * scale + offset;
                             NULL: no offsets */
    int rows, cols;
    int group_size;     /* 0 for float32 */
    const uint8_t *q4;  /* 4-bit: (rows, cols / 2) bytes, two values each (see section 2) */
    /* VNNI builds, int8 and 4-bit: the values and scales as the kernel reads
       them (pack_matrices, section 3); NULL: read as stored */
    const uint8_t *packed;        /* (rows / PACK_ROWS rounded up, cols / 4, PACK_ROWS, 4 values);
                                     bfloat16: (rows / SPLIT_ROWS rounded up, cols / SPLIT_COLS,
                                     SPLIT_ROWS, a unit of SPLIT_UNIT_BYTES), then exception_first
                                     and the exceptions */
    const uint8_t *packed_scales; /* (rows / PACK_ROWS rounded up, a block's scales in scale_form, then its offsets) */
    int packed_bits;              /* a packed value's bits: 8, 6 (int8 values in -32..31), 5 (in -16..15) or 4;
                                     12: bfloat16 in 12 bits (BF16_SPLIT builds) */
    const int8_t *packed_table;   /* 4 bits: the values that the 4-bit codes n name (GGUF types of a
                                     table: table[n]); NULL: n - 8 */
    int scale_form;               /* SCALES_F32, SCALES_F16 or SCALES_SHARED (section 3) */
    int offset_form;              /* OFFSETS_NONE, OFFSETS_F32 or OFFSETS_MIN (section 3): a packed
                                     block's offsets, after its scales */
    float offset_centre;          /* OFFSETS_MIN: offset = centre x scale - dmin x m */
    int scale_run;                /* GGUF block types: the groups of a block (K-quants: 256 values),
                                     whose scales share its f16 d; 0: other checkpoints */
    /* BF16_SPLIT builds, bfloat16 packed in 12 bits (packed_bits 12,
       section 3): the table of the 16 high bytes a value's 4-bit code
       names, and the values whose high byte is not in it (stored there as
       zero), sorted by row then column: exception_first (blocks + 1) the
       first of each block of SPLIT_ROWS rows; both inside `packed` */
    uint8_t split_table[16];
    size_t n_exceptions;
    const SplitException *exceptions;
    const uint32_t *exception_first;
    /* a GGUF matrix of a block type as stored: the token embedding, a row
       unpacked at each lookup (matrix_row; no other field is set), or, in
       the builds that pack, a matrix until pack_weights packs it from its
       blocks (rows, cols, group_size and scale_run set) */
    const uint8_t *blocks;
    int block_type;     /* its GGML type number */
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
    const float *bq; /* GGUF qwen2: (n_layers, dim) biases of q; NULL: none */
    const float *bk; /* (n_layers, kv_dim) biases of k, or NULL */
    const float *bv; /* (n_layers, kv_dim) biases of v, or NULL */
    const float *bo; /* Arch biases: (n_layers, dim) biases of the attention's output, or NULL */
    const float *sinks; /* Arch sinks: (n_layers, n_heads) each head's sink logit, or NULL */
    const float *q_norm, *k_norm;     /* Arch qk_norm: (n_layers, head_size); NULL: none */
    const float *post_att, *post_ffn; /* Arch post_norms: (n_layers, dim); NULL: none */
    /* mixture of experts: each layer's router (n_experts, dim), rows 0 in a
       dense layer; the experts' matrices, (n_layers, n_experts) of each:
       gate and up (expert_hidden, dim), down (dim, expert_hidden). A
       shared expert (Qwen2-MoE) is the layer's w1, w3 and w2, its output
       times sigmoid(shared_gate . x) where shared_gate is set. */
    Matrix *router;
    Matrix *e_gate, *e_up, *e_down;
    const float *shared_gate; /* (n_layers, dim) or NULL */
    /* Arch biases: the router's (n_layers, n_experts) and the experts'
       (n_layers, n_experts, rows): gate and up expert_hidden, down dim; NULL: none */
    const float *router_bias, *e_gate_bias, *e_up_bias, *e_down_bias;
    const float *select_bias; /* (n_layers, n_experts) DeepSeek-V3's blk.N.exp_probs_b.bias: added to the
                                 probabilities to choose experts, not to weigh them; NULL: none */
    /* multi-head latent attention (Config mla_rank): q from wq, or from
       wq_b @ rmsnorm(wq_a @ x) (q_a_norm); the latent c and the RoPE key
       from wkv_a (mla_rank + rope_dims, dim), c normalised by kv_a_norm;
       per layer and head (n_layers * n_heads) wk_b (mla_rank, mla_nope),
       which takes a head's nope query into the latent's space, and wv_b
       (mla_value, mla_rank), which takes its sum of latents to its output */
    Matrix *wq_a, *wq_b, *wkv_a, *wk_b, *wv_b;
    const float *q_a_norm, *kv_a_norm; /* (n_layers, q_rank), (n_layers, mla_rank) */
} Weights;

/* The key/value cache is a pool of blocks of KV_BLOCK positions; a sequence
   holds a block table (section 4). A block has, for every layer, the key and
   the value of each of its positions; in a model with sliding-window layers,
   for every layer that attends to all its past, and a block of a second
   pool holds the windowed layers' rows while some sequence's window still
   covers them (section 4, "Windowed layers"). */
#define KV_BLOCK 16
#define KV_RUN 8 /* blocks stored together, layer by layer (kv_block_offset) */

/* The element type of the cache (--kv-type): float32; IEEE half precision;
   or q8_0, a row's values in groups of 32 as int8 q with one float32 scale
   per group, value = q * scale (the row: kv_dim int8, then kv_dim / 32
   scales). */
enum { KV_F32, KV_F16, KV_Q8_0 };
#define KV_GROUP 32

typedef struct KVCache {
    int n_blocks, n_layers, kv_dim; /* n_layers: the layers whose rows it holds */
    int type;            /* KV_F32, KV_F16 or KV_Q8_0 */
    size_t row_bytes;    /* one position's key (or value) of one layer */
    int values_in_keys;  /* MLA: a position's value is its key row (the latent c within it); no value rows */
    unsigned char *key;    /* (n_blocks / KV_RUN rounded up, n_layers, KV_RUN, KV_BLOCK) rows of row_bytes */
    unsigned char *value;  /* as key; NULL where values_in_keys */
    int held, peak_held;   /* blocks held by some table now, and at most */
    int *ref;      /* (n_blocks) block tables holding the block */
    /* free blocks (ref 0) in two lists, oldest first, linked through
       prev/next: list 0 holds blocks with nothing worth keeping, list 1
       indexed blocks whose contents a later prompt may still reuse */
    int *prev, *next;       /* (n_blocks) */
    int head[2], tail[2];   /* -1 when empty */
    /* the prefix index (section 4): an indexed block is found by its tokens
       and the block before it in its sequence */
    int *state;             /* (n_blocks) BLOCK_PLAIN, BLOCK_PENDING or BLOCK_READY */
    int *tokens;            /* (n_blocks, KV_BLOCK) the tokens of an indexed block */
    int *parent;            /* (n_blocks) the indexed block before it, -1 at position 0 */
    unsigned *generation;   /* (n_blocks) counts reuses, so that a link to a reused parent is stale */
    unsigned *parent_generation; /* (n_blocks) the parent's generation when linked */
    int *bucket;            /* (n_buckets) first indexed block of each hash bucket, -1 none */
    int *chain;             /* (n_blocks) next indexed block in the same bucket */
    int n_buckets;          /* a power of two */
    long long promised;     /* blocks promised to running requests (their worst case) */
    /* sliding-window layers (section 4, "Windowed layers"); win NULL: this
       cache holds every layer */
    int window;             /* positions a windowed layer attends to */
    int window_span;        /* blocks of win one sequence holds at once, at most */
    int *layer_at;          /* (the model's layers) layer l's index here, or -1 - its index in win */
    struct KVCache *win;    /* the windowed layers' pool (its own window fields unused) */
    int *partner;           /* (n_blocks) the block of the other pool with the same positions, -1 none */
} KVCache;

/* Activations for up to max_rows rows processed together (the rows of one
   engine step: decoding sequences, beams, prompt chunks) and the cache. */
typedef struct {
    int max_rows;
    int context;    /* the most positions a sequence may reach */
    float att_scale; /* what attention scores are divided by, or multiplied by: attention_scale */
    float *x;       /* (max_rows, dim) residual stream */
    float *xb;      /* (max_rows, dim) normalised input / (max_rows, q_dim) attention output */
    float *xb2;     /* (max_rows, dim) projection output */
    float *hb;      /* (max_rows, the widest dense FFN: hidden_dim or shared_hidden) FFN gate */
    float *hb2;     /* (max_rows, as hb) FFN up */
    float *q;       /* (max_rows, q_dim) queries */
    float *q_turned; /* (max_rows, 2, q_dim) --keep: each query rotated for the ring's two stretches (kv_query_turn) */
    float *k;       /* (max_rows, kv_dim) keys of the rows, before caching */
    float *v;       /* (max_rows, kv_dim) values of the rows, before caching */
    float *att;     /* (threads, attention_floats) attention scores, queries, outputs and converted rows, per thread */
    float *chunks;  /* (attention_chunks(context), q_dim) a lone row's values summed over each chunk of positions */
    int *tiles;     /* (max_rows + 1) the first row of each tile of attention, then the row count */
    int *groups;    /* (max_rows + 1) the first tile of each group of tiles, then the tile count */
    float *logits;  /* (max_rows, vocab_size) */
    /* mixture of experts (moe_ffn); NULL for a dense model */
    float *router;  /* (max_rows, n_experts) router logits, then probabilities */
    int *chosen;    /* (max_rows, n_experts_used) each row's experts, best first */
    float *route_w; /* (max_rows, n_experts_used) their weights */
    int *slot_of;   /* (max_rows * n_experts_used) the rows routed to each expert, expert by expert */
    float *ex;      /* (max_rows, dim) an expert's rows gathered */
    float *eh, *eh2; /* (max_rows, expert_hidden) its gate and up */
    float *slots;   /* (max_rows, n_experts_used, dim) each row's experts' outputs, best first */
    /* MLA (mla_project, mla_output); NULL without */
    float *mla_q;   /* (max_rows, n_heads x the wider of mla_nope + rope_dims and mla_value) the queries before
                       absorption; then the heads' outputs */
    float *mla_in;  /* (max_rows, the widest of mla_rank, q_rank, mla_nope) a head's rows gathered */
    float *mla_out; /* (max_rows, as mla_in and mla_rank + rope_dims) a projection's rows */
    KVCache cache;
} RunState;

/* Pages the loader allocated (GGUF tensors converted at load), handed out
   in turn: used of bytes. */
typedef struct {
    void *p;
    size_t bytes, used;
} OwnedPages;

struct GGUF; /* section 2.1 */
enum { VERSION_GGUF = 5 };

typedef struct {
    Config config;
    int version;      /* 0 legacy, 1 float32 "ak42", 2 int8 "ak42", 3 4-bit "ak42", 4 "ak42" with RoPE and norm
                         settings; VERSION_GGUF a GGUF file */
    int group_size;   /* versions 2, 3 (and 4 with int8 weights): quantised values per float32 scale */
    float *rope_freq; /* version 4, GGUF: (rope_dims / 2) RoPE inverse frequencies; NULL: 10000^(-d/head_size) */
    float *rope_freq_local; /* GGUF with a sliding window: the windowed layers' (rope_dims / 2); NULL: none */
    float *rope_freq_other; /* GGUF with LongRoPE: the factors' table not in use (choose_rope_factors) */
    int rope_long;          /* rope_freq has LongRoPE's long factors */
    Weights weights;
    RunState state;
    void *mapping;    /* the whole checkpoint file, mmap'ed read-only */
    size_t file_size;
    void *packing;    /* VNNI and BF16_SPLIT builds: the packed matrices (pack_weights), packing_bytes of them */
    size_t packing_bytes;
    OwnedPages *owned; /* (n_owned) GGUF: converted tensors, norms and biases */
    int n_owned;
    struct GGUF *gguf; /* GGUF: the parsed file (its vocabulary is read after the model) */
    int weight_bits;   /* 4: 4-bit weights (version 3, version 4's WEIGHTS_Q4), else 8 */
} Transformer;

/* ------------------------------------------------------------------------ */
/* 2. Checkpoint loading                                                    */
/* ------------------------------------------------------------------------ */

#define AK42_MAGIC 0x616b3432u
#define AK42_HEADER_BYTES 256
#define LEGACY_HEADER_BYTES 28

/* Version 4 headers name their weights' encoding: float32, int8 (version
   2's layout) or 4-bit (version 3's). */
enum { WEIGHTS_F32 = 0, WEIGHTS_Q8_0 = 1, WEIGHTS_Q4 = 2 };

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

/* The next matrix: float32 values, or (group_size > 0) quantised values
   followed by their float32 scales, one per group of group_size values:
   `bits` 8, one int8 per value (version 2), or 4, two values per byte
   (version 3: byte k holds value 2k in its low nibble and value 2k + 1 in its
   high nibble, each stored as q + 8 in 0..15, for q in -8..7; the group size
   is even, so every row and every group starts on a byte). */
static Matrix take_matrix(FileCursor *c, int rows, int cols, int group_size, int bits, const char *what) {
    uint64_t count = (uint64_t)rows * (uint64_t)cols;
    if (group_size == 0) return (Matrix){.w = take_floats(c, count, what), .rows = rows, .cols = cols};
    const char *values = take_bytes(c, bits == 4 ? count / 2 : count, what);
    char scales_what[64];
    snprintf(scales_what, sizeof(scales_what), "the scales of %s", what);
    const char *scales = take_bytes(c, count / (uint64_t)group_size * sizeof(float), scales_what);
    if (bits == 4) return (Matrix){.scales = scales, .rows = rows, .cols = cols, .group_size = group_size, .q4 = (const uint8_t *)values};
    return (Matrix){.q = (const int8_t *)values, .scales = scales, .rows = rows, .cols = cols, .group_size = group_size};
}

static int32_t read_i32(const char *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Checks the header fields. Every array in the file is the product of at most
   two positive int32 fields, so its float count is below 2^62 and its byte
   count below 2^64: sizes cannot wrap, and take_floats compares each one with
   what is left of the file before it is used.
   A head is dim / n_heads wide unless the file set head_size (GGUF); RoPE
   turns all of it unless the file set rope_dims. */
static void validate_config(Config *p, const char *path) {
    const int fields[] = {p->dim, p->hidden_dim, p->n_layers, p->n_heads, p->n_kv_heads, p->vocab_size, p->seq_len};
    const char *names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
    for (int i = 0; i < 7; i++)
        if (fields[i] <= 0) die(EXIT_BAD_FILE, "%s: bad header: %s is %d, must be positive", path, names[i], fields[i]);
    if (p->head_size == 0 && p->dim % p->n_heads != 0)
        die(EXIT_BAD_FILE, "%s: bad header: dim %d is not divisible by n_heads %d", path, p->dim, p->n_heads);
    if (p->n_heads % p->n_kv_heads != 0)
        die(EXIT_BAD_FILE, "%s: bad header: n_heads %d is not divisible by n_kv_heads %d", path, p->n_heads, p->n_kv_heads);
    if (!p->arch) p->arch = &ARCHS[0];
    if (p->head_size == 0) p->head_size = p->dim / p->n_heads;
    if (p->rope_dims == 0) p->rope_dims = p->head_size;
    if (p->head_size % 2 != 0)
        die(EXIT_BAD_FILE, "%s: bad header: head size %d is odd (RoPE rotates pairs)", path, p->head_size);
    if (p->rope_dims % 2 != 0 || p->rope_dims > p->head_size)
        die(EXIT_BAD_FILE, "%s: bad header: RoPE turns %d values of a head of %d (an even count, at most the head)", path, p->rope_dims,
            p->head_size);
    if ((long long)p->n_heads * p->head_size > INT_MAX / 4)
        die(EXIT_BAD_FILE, "%s: bad header: %d heads of %d values are too wide", path, p->n_heads, p->head_size);
    if (p->vocab_size < 3)
        die(EXIT_BAD_FILE, "%s: bad header: vocab_size %d has no room for BOS (1) and EOS (2)", path, p->vocab_size);
}

static Matrix *map_layer_matrices(FileCursor *c, int n_layers, int rows, int cols, int group_size, int bits, const char *what) {
    Matrix *m = xcalloc((size_t)n_layers, sizeof(Matrix));
    for (int l = 0; l < n_layers; l++) m[l] = take_matrix(c, rows, cols, group_size, bits, what);
    return m;
}

/* Maps the arrays in the order of the legacy (version 0) or the "ak42"
   layout (version 1 float32, version 2 int8 and version 3 4-bit matrices,
   each matrix's values then its scales, with float32 norms; version 4 as 1
   or 2, by its weight encoding). */
static void map_weights(Transformer *t, FileCursor *c, int shared_classifier) {
    const Config *p = &t->config;
    Weights *w = &t->weights;
    int head_size = p->dim / p->n_heads;
    int kv_dim = head_size * p->n_kv_heads;
    uint64_t L = (uint64_t)p->n_layers, dim = (uint64_t)p->dim;
    int gs = t->group_size, bits = t->weight_bits;
    if (t->version >= 1) {
        w->rms_att = take_floats(c, L * dim, "rms_att");
        w->rms_ffn = take_floats(c, L * dim, "rms_ffn");
        w->rms_final = take_floats(c, dim, "rms_final");
        w->token_embedding = take_matrix(c, p->vocab_size, p->dim, gs, bits, "token_embedding");
    } else {
        w->token_embedding = take_matrix(c, p->vocab_size, p->dim, gs, bits, "token_embedding");
        w->rms_att = take_floats(c, L * dim, "rms_att");
    }
    w->wq = map_layer_matrices(c, p->n_layers, p->dim, p->dim, gs, bits, "wq");
    w->wk = map_layer_matrices(c, p->n_layers, kv_dim, p->dim, gs, bits, "wk");
    w->wv = map_layer_matrices(c, p->n_layers, kv_dim, p->dim, gs, bits, "wv");
    w->wo = map_layer_matrices(c, p->n_layers, p->dim, p->dim, gs, bits, "wo");
    if (t->version == 0) w->rms_ffn = take_floats(c, L * dim, "rms_ffn");
    w->w1 = map_layer_matrices(c, p->n_layers, p->hidden_dim, p->dim, gs, bits, "w1");
    w->w2 = map_layer_matrices(c, p->n_layers, p->dim, p->hidden_dim, gs, bits, "w2");
    w->w3 = map_layer_matrices(c, p->n_layers, p->hidden_dim, p->dim, gs, bits, "w3");
    if (t->version == 0) {
        w->rms_final = take_floats(c, dim, "rms_final");
        /* two RoPE tables (seq_len, head_size / 2) that run.c recomputes */
        take_floats(c, (uint64_t)p->seq_len * (uint64_t)head_size, "rope tables");
    }
    w->wcls = shared_classifier ? w->token_embedding : take_matrix(c, p->vocab_size, p->dim, gs, bits, "classifier");
}

/* ---- Files of the wrong kind ----------------------------------------------
   A first try often gives run the wrong file: the tokenizer as the model, a
   model downloaded for another program, a directory. These functions name
   what the file is from its content (magic bytes, header sanity), so that
   the error can say what to do instead. */

#define CONVERT_HINT "convert the original model with `python3 export.py model DIR out.bin` (DIR: its Hugging Face directory)"

/* What a file in another program's format is, or NULL (GGUF is read, by
   section 2.1): safetensors (an 8-byte header length, then a JSON object), a PyTorch zip
   (torch.save) or a bare pickle (protocol 2 to 5, then an opcode that starts
   a torch.save stream; a legacy header whose dim ends in 0x0?80 has a zero
   byte there). */
static const char *foreign_format(const unsigned char *d, size_t size) {
    if (size >= 4 && memcmp(d, "PK\x03\x04", 4) == 0) return "a zip archive (a PyTorch .pt/.pth/.bin checkpoint)";
    if (size >= 3 && d[0] == 0x80 && d[1] >= 2 && d[1] <= 5 && strchr("\x8a\x95}]c(", d[2]) && d[2] != 0)
        return "a Python pickle (a PyTorch checkpoint)";
    if (size >= 10) {
        uint64_t n;
        memcpy(&n, d, 8);
        if (n >= 2 && n <= size - 8 && d[8] == '{') return "a safetensors file";
    }
    return NULL;
}

/* What a file of text is, or NULL: JSON (its first character, past white
   space, is { or [; a tokenizer.json or config.json) or any other text (a
   README, a prompt). Text is 512 leading bytes with no NUL and no control
   byte but white space; every run.c checkpoint and tokenizer.bin has zero
   bytes in its first int32s. */
static const char *text_format(const unsigned char *d, size_t size) {
    size_t n = size < 512 ? size : 512, at = 0;
    if (n == 0) return NULL;
    for (size_t i = 0; i < n; i++)
        if (d[i] == 0 || (d[i] < 0x20 && !strchr("\t\n\r\f", d[i])) || d[i] == 0x7f) return NULL;
    while (at < n && strchr(" \t\n\r", d[at])) at++;
    return at < n && (d[at] == '{' || d[at] == '[') ? "a JSON file" : "a text file";
}

/* Whether the file is a SentencePiece tokenizer.model: a protobuf whose
   first field is a piece (field 1, length-delimited: 0x0A, its length) that
   starts with its text (field 1 again, 0x0A, a shorter length). */
static int looks_like_sentencepiece(const unsigned char *d, size_t size) {
    return size >= 8 && d[0] == 0x0A && d[1] >= 3 && d[1] < 0x80 && d[2] == 0x0A && d[3] + 2 <= d[1] && (size_t)d[1] + 2 <= size;
}

/* Whether the file parses as a whole llama2.c tokenizer.bin: a plausible
   max_token_length, then (score, length <= max, bytes) entries that end
   exactly at the end of the file. A checkpoint fails within a few entries. */
static int looks_like_tokenizer(const unsigned char *d, size_t size) {
    if (size < 4) return 0;
    int32_t max_len = read_i32((const char *)d);
    if (max_len <= 0 || max_len > (1 << 20)) return 0;
    size_t at = 4;
    int entries = 0;
    while (size - at >= 8) {
        int32_t len = read_i32((const char *)d + at + 4);
        if (len < 0 || len > max_len || size - at - 8 < (size_t)len) return 0;
        at += 8 + (size_t)len;
        entries++;
    }
    return at == size && entries >= 3;
}

/* Whether the file is a run.c checkpoint: the "ak42" magic, or a legacy
   header whose shapes account for exactly the file's size (with or without
   a separate classifier). */
static int looks_like_checkpoint(const unsigned char *d, size_t size) {
    if (size >= 8 && read_i32((const char *)d) == (int32_t)AK42_MAGIC) return 1;
    if (size < LEGACY_HEADER_BYTES) return 0;
    double h[7];
    for (int i = 0; i < 7; i++) h[i] = fabs((double)read_i32((const char *)d + 4 * i));
    double dim = h[0], hidden = h[1], L = h[2], heads = h[3], kv = h[4], vocab = h[5], seq = h[6];
    if (dim == 0 || heads == 0 || kv == 0 || fmod(dim, heads) != 0) return 0;
    double head = dim / heads, kv_dim = head * kv;
    double floats = vocab * dim + 2 * L * dim + L * dim * (2 * dim + 2 * kv_dim) + 3 * L * hidden * dim + dim + seq * head;
    double bytes = LEGACY_HEADER_BYTES + 4 * floats;
    return bytes == (double)size || bytes + 4 * vocab * dim == (double)size;
}

/* Dies with a line naming the file's kind when it is not a checkpoint. */
static void refuse_non_checkpoint(const FileCursor *c) {
    const unsigned char *d = (const unsigned char *)c->base;
    const char *kind = foreign_format(d, c->size);
    if (kind) die(EXIT_BAD_FILE, "%s: is %s, not a run.c checkpoint: %s", c->path, kind, CONVERT_HINT);
    if (looks_like_tokenizer(d, c->size))
        die(EXIT_BAD_FILE, "%s: is a tokenizer, not a checkpoint (the checkpoint comes first; the tokenizer goes after -z)", c->path);
    if (looks_like_checkpoint(d, c->size)) return;
    if (looks_like_sentencepiece(d, c->size))
        die(EXIT_BAD_FILE, "%s: is a SentencePiece tokenizer.model, not a checkpoint: the checkpoint comes first; the tokenizer "
            "goes after -z, converted with `python3 export.py tokenizer tokenizer.model tokenizer.bin`", c->path);
    const char *text = text_format(d, c->size);
    if (text && strcmp(text, "a JSON file") == 0)
        die(EXIT_BAD_FILE, "%s: is a JSON file, not a checkpoint: the checkpoint (a .bin or .gguf model) comes first; "
            "a Hugging Face model (config.json, tokenizer.json) is converted with `python3 export.py model DIR out.bin`", c->path);
    if (text)
        die(EXIT_BAD_FILE, "%s: is a text file, not a checkpoint: the checkpoint (a .bin or .gguf model) comes first; "
            "a prompt goes after -i (or -I FILE)", c->path);
}

static float read_f32(const char *p) { float v; memcpy(&v, p, 4); return v; }

/* RoPE's inverse frequencies for a version 4 header, (head_size / 2):
   theta^(-2i / head_size), and with llama3 scaling (Llama 3.1 and later),
   for the wavelength w = 2 pi / f of each and the original context C:
     w < C / high_freq_factor (fast rotations): f unchanged;
     w > C / low_freq_factor (slow ones): f / factor;
     between: (1 - s) f / factor + s f, s = (C / w - low) / (high - low).
   Computed in double, rounded once to float. */
static float *rope_frequencies(const Config *p) {
    int head_size = p->dim / p->n_heads;
    float *freq = xcalloc((size_t)head_size / 2, sizeof(float));
    for (int i = 0; i < head_size / 2; i++) {
        double f = pow((double)p->rope_theta, -2.0 * i / head_size);
        if (p->rope_scaling == ROPE_SCALING_LLAMA3) {
            double context = p->rope_original_context, wavelen = 2.0 * M_PI / f;
            double low = p->rope_low_freq_factor, high = p->rope_high_freq_factor, factor = p->rope_factor;
            if (wavelen > context / low) f /= factor;
            else if (wavelen >= context / high) {
                double smooth = (context / wavelen - low) / (high - low);
                f = (1.0 - smooth) * f / factor + smooth * f;
            }
        }
        freq[i] = (float)f;
    }
    return freq;
}

/* The fields that follow the shape in a version 4 header (after the shared
   classifier byte at 36):
     40 int32 weight encoding: WEIGHTS_F32, WEIGHTS_Q8_0 or WEIGHTS_Q4
     44 int32 group size (values per scale; 0 for float32)
     48 float32 norm_eps        52 float32 rope_theta
     56 int32 rope scaling: 0 none, 1 llama3
     60 float32 factor, 64 low_freq_factor, 68 high_freq_factor
     72 int32 original_max_position_embeddings
   The arrays follow at 256 in the order of versions 1 and 2. */
static void read_header_v4(Transformer *t, const FileCursor *c) {
    Config *p = &t->config;
    const char *b = c->base;
    int32_t encoding = read_i32(b + 40);
    if (encoding != WEIGHTS_F32 && encoding != WEIGHTS_Q8_0 && encoding != WEIGHTS_Q4)
        die(EXIT_BAD_FILE, "%s: bad header: unknown weight encoding %d", c->path, encoding);
    t->group_size = encoding != WEIGHTS_F32 ? read_i32(b + 44) : 0;
    t->weight_bits = encoding == WEIGHTS_Q4 ? 4 : 8;
    if (encoding != WEIGHTS_F32 && t->group_size <= 0)
        die(EXIT_BAD_FILE, "%s: bad header: %s group size %d", c->path, encoding == WEIGHTS_Q4 ? "4-bit" : "int8", t->group_size);
    p->norm_eps = read_f32(b + 48);
    p->rope_theta = read_f32(b + 52);
    p->rope_scaling = read_i32(b + 56);
    p->rope_factor = read_f32(b + 60);
    p->rope_low_freq_factor = read_f32(b + 64);
    p->rope_high_freq_factor = read_f32(b + 68);
    p->rope_original_context = read_i32(b + 72);
    if (!(p->norm_eps >= 0.0f && p->norm_eps < 1.0f))
        die(EXIT_BAD_FILE, "%s: bad header: norm_eps %g is not in [0, 1)", c->path, p->norm_eps);
    if (!(p->rope_theta > 0.0f && isfinite(p->rope_theta)))
        die(EXIT_BAD_FILE, "%s: bad header: rope_theta %g must be positive", c->path, p->rope_theta);
    if (p->rope_scaling != ROPE_SCALING_NONE && p->rope_scaling != ROPE_SCALING_LLAMA3)
        die(EXIT_BAD_FILE, "%s: bad header: unknown rope scaling type %d (0 none, 1 llama3)", c->path, p->rope_scaling);
    if (p->rope_scaling == ROPE_SCALING_LLAMA3 &&
        !(p->rope_factor > 0.0f && isfinite(p->rope_factor) && p->rope_low_freq_factor > 0.0f &&
          p->rope_high_freq_factor > p->rope_low_freq_factor && isfinite(p->rope_high_freq_factor) && p->rope_original_context > 0))
        die(EXIT_BAD_FILE, "%s: bad header: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor "
            "and original context > 0 (got %g, %g, %g, %d)", c->path, p->rope_factor, p->rope_low_freq_factor,
            p->rope_high_freq_factor, p->rope_original_context);
}

/* Reads the header at the start of the mapping into t->config and returns
   whether the classifier is shared with the embedding; positions the cursor
   at the first weight. */
static int read_header(Transformer *t, FileCursor *c) {
    uint32_t magic;
    refuse_non_checkpoint(c);
    if (c->size < LEGACY_HEADER_BYTES)
        die(EXIT_BAD_FILE, "%s: truncated checkpoint: %zu bytes is shorter than any header", c->path, c->size);
    memcpy(&magic, c->base, 4);
    int32_t h[7];
    int shared;
    if (magic == AK42_MAGIC) {
        if (c->size < AK42_HEADER_BYTES)
            die(EXIT_BAD_FILE, "%s: truncated checkpoint: header needs %d bytes, file has %zu", c->path, AK42_HEADER_BYTES, c->size);
        int32_t version = read_i32(c->base + 4);
        if (version < 1 || version > 4)
            die(EXIT_BAD_FILE, "%s: unknown checkpoint version %d (this program reads 0, 1, 2, 3 and 4)", c->path, version);
        for (int i = 0; i < 7; i++) h[i] = read_i32(c->base + 8 + 4 * i);
        shared = (unsigned char)c->base[36] != 0;
        t->version = version;
        if (version >= 2) t->group_size = read_i32(c->base + 37);
        c->offset = AK42_HEADER_BYTES;
    } else {
        for (int i = 0; i < 7; i++) h[i] = read_i32(c->base + 4 * i);
        /* a negative vocab_size means a separate classifier follows */
        shared = h[5] > 0;
        if (h[5] < 0 && h[5] != INT32_MIN) h[5] = -h[5];
        t->version = 0;
        c->offset = LEGACY_HEADER_BYTES;
    }
    t->config = (Config){h[0], h[1], h[2], h[3], h[4], h[5], h[6], 1e-5f, 10000.0f, ROPE_SCALING_NONE, 0, 0, 0, 0, 0, .arch = NULL};
    validate_config(&t->config, c->path);
    t->weight_bits = t->version == 3 ? 4 : 8;
    if (t->version == 4) read_header_v4(t, c);
    /* whole groups in every row; an int32 group sum of products of int8
       values (|q| <= 127) stays below 2^31; 4-bit groups are whole bytes */
    int gs = t->group_size;
    if ((t->version == 2 || t->version == 3 || gs != 0) && (gs <= 0 || t->config.dim % gs != 0 || t->config.hidden_dim % gs != 0))
        die(EXIT_BAD_FILE, "%s: bad header: group size %d does not divide dim %d and hidden_dim %d",
            c->path, gs, t->config.dim, t->config.hidden_dim);
    if (t->weight_bits == 4 && gs % 2 != 0)
        die(EXIT_BAD_FILE, "%s: bad header: group size %d is odd (4-bit values come in pairs)", c->path, gs);
    if (gs > 65536) die(EXIT_BAD_FILE, "%s: bad header: group size %d is above 65536", c->path, gs);
    return shared;
}

/* Dies for a directory given as a file: a Hugging Face model directory
   (it holds config.json) is named as one, with the command that converts it. */
static void refuse_directory(const char *path, const char *kind) {
    size_t len = strlen(path) + sizeof("/config.json");
    char *config = xcalloc(len, 1);
    snprintf(config, len, "%s/config.json", path);
    FILE *probe = fopen(config, "rb");
    int hf = probe != NULL;
    if (probe) fclose(probe);
    free(config);
    if (hf) die(EXIT_BAD_FILE, "%s: is a Hugging Face model directory, not a %s file: convert it with `python3 export.py model %s out.bin`",
                path, kind, path);
    die(EXIT_BAD_FILE, "%s: is a directory, not a %s file", path, kind);
}

/* Maps the file read-only (section "Platform"), with advice to the kernel
   where it takes it: 2 MB pages where the file system has them (streaming
   the weights then misses the TLB 512 times less often). */
static void *map_file(const char *path, size_t *size, const char *kind) {
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) refuse_directory(path, kind);
    void *data = map_readonly(path, size, kind);
#ifdef MADV_HUGEPAGE /* Linux */
    madvise(data, *size, MADV_HUGEPAGE);
#endif
    return data;
}

/* Advice only: every page of data..data+size-1 in the mapping read and
   mapped now, rather than faulted in during the first tokens (from the
   start of data's page: the call takes whole pages). */
static void populate(const void *data, size_t size) {
#ifdef MADV_POPULATE_READ /* Linux 5.14 */
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), from = (uintptr_t)data / page * page;
    madvise((void *)from, size + ((uintptr_t)data - from), MADV_POPULATE_READ);
#else
    (void)data; (void)size;
#endif
}

/* ---- 2.1 GGUF files (llama.cpp's format) ----------------------------------
   The files people download for llama.cpp, Ollama or LM Studio, read with
   nothing else (versions 2 and 3, little-endian):
     "GGUF", uint32 version, uint64 tensor count, uint64 metadata count;
     metadata: a key (a string: uint64 byte length, the bytes) and a typed
       value (uint32 type, then the value: an integer, a float, a bool byte,
       a string, or an array: uint32 element type, uint64 count, elements);
     tensor infos: a name (string), uint32 dimension count (1 to 4), that
       many uint64 sizes ne[] (ne[0], the length of a row, first), uint32
       ggml type, uint64 offset into the data section;
     padding to general.alignment (default 32), then the data section, each
       tensor at its offset, a multiple of the alignment.
   Every count, length and offset is checked against what is left of the
   file before it is used. The tensors are read in place (float32) or
   converted once at load into the layouts of section 1 (section 2.2). */

enum {
    GGUF_UINT8, GGUF_INT8, GGUF_UINT16, GGUF_INT16, GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL,
    GGUF_STRING, GGUF_ARRAY, GGUF_UINT64, GGUF_INT64, GGUF_FLOAT64, GGUF_VALUE_TYPES
};
#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32

/* A metadata value where it lies in the mapping: scalars at `at`; arrays
   `count` elements of type `elem` from `at`. */
typedef struct {
    const char *key;      /* key_len bytes, not NUL-terminated */
    uint64_t key_len;
    uint32_t type, elem;  /* elem: arrays only */
    uint64_t count;       /* array elements; 1 for a scalar */
    const char *at;
} GGUFValue;

typedef struct {
    char *name;                 /* NUL-terminated copy */
    uint32_t n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* sizes, ne[0] the values of a row; 1 past n_dims */
    uint32_t type;              /* a ggml type (GGMLType) */
    const char *data;           /* in the mapping */
    uint64_t bytes;
} GGUFTensor;

typedef struct GGUF {
    const char *path;
    const char *base; /* the mapped file */
    size_t size;
    uint32_t version;
    uint64_t n_values, n_tensors;
    GGUFValue *values;   /* (n_values) in file order */
    GGUFTensor *tensors; /* (n_tensors) sorted by name */
} GGUF;

/* The ggml tensor types, by their number in the file: name, values per
   block and bytes per block (block 0: a type this program does not read,
   named for the error). How section 1 holds each type: `bits` 32 (float32),
   8 (int8 q) or 4 (4-bit q), with a float32 scale per `group` values and,
   for the types with a minimum (`offsets`), a float32 offset per group:
   value = q x scale + offset. `unpack` turns one block into that form;
   `factors` gives its scales (and a K-quant's offsets) as the products the
   format stores, for the builds that pack the blocks as they are (section
   3): the f16 d as stored and group g's multiplier k[g], scale = d x k[g]
   (k = 1 for the types of one group a block; no `factors` where the scale
   is no such product: MXFP4's powers of two), and for the K-quants with a
   minimum the f16 dmin and group g's m[g], offset = centre x scale - dmin x
   m[g] (centre: 2^(value_bits - 1), the middle of the values' range).
   The types of a `table` (IQ4_NL, IQ4_XS, MXFP4) store 4-bit codes n that
   name one of its 16 int8 values: value = table[n] x scale. Their unpack
   gives the codes as Q4_0's gives its values, n - 8 (the 4-bit layout,
   centred), which the builds that pack keep as 4 bits (section 3's packed
   weights look the table up in the kernel); block_values looks them up
   for the rest (the other builds hold their values as int8, `bits` 8). */
typedef void (*GGMLUnpack)(const uint8_t *block, int8_t *q, float *scales, float *offsets);
typedef void (*GGMLFactors)(const uint8_t *block, uint16_t *d, int8_t *k, uint16_t *dmin, uint8_t *m);
typedef struct {
    const char *name;
    int block, block_bytes;
    int bits, group, offsets;
    GGMLUnpack unpack; /* NULL: float types */
    GGMLFactors factors; /* NULL: scales kept as float32 */
    int value_bits;    /* the bits that hold the values unpack gives (4, 5, 6 or 8) */
    const int8_t *table; /* the values that codes n name (table[n]); NULL: unpack gives the values */
    int e8m0;            /* scales 2^(e - 128) of a byte e (MXFP4's E8M0): packed as those bytes */
} GGMLType;

static float half_to_float(uint16_t h); /* section 4 */
static uint16_t half_from_float(float f);

static uint16_t u16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

static float f16_at(const uint8_t *p) { return half_to_float(u16_at(p)); }

/* bfloat16: the top 16 bits of a float32 */
static float bf16_to_float(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static float bf16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return bf16_to_float(h);
}

/* The 4-bit values n - 8 of Q4_0 and Q4_1: 16 bytes at qs, byte j holding
   value j in its low nibble and value j + 16 in its high one. */
static void four_bit_values(const uint8_t *qs, int8_t *q) {
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 15) - 8);
        q[j + 16] = (int8_t)((qs[j] >> 4) - 8);
    }
}

/* Q4_0, 32 values: f16 d, then 16 bytes of nibbles n; value = d (n - 8). */
static void unpack_q4_0(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    scales[0] = f16_at(b);
    four_bit_values(b + 2, q);
}

/* Q4_1, 32 values: f16 d, f16 m, nibbles as Q4_0; value = d n + m, held as
   d (n - 8) + (m + 8 d): q fits the 4-bit layout, centred. */
static void unpack_q4_1(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    float d = f16_at(b), m = f16_at(b + 2);
    scales[0] = d;
    offsets[0] = m + 8.0f * d;
    four_bit_values(b + 4, q);
}

/* The 5-bit values n - 16 of Q5_0 and Q5_1: the nibbles as Q4_0 at qs, the
   fifth bit of value j in bit j of the uint32 at qh. */
static void five_bit_values(const uint8_t *qh, const uint8_t *qs, int8_t *q) {
    uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 15) | ((h >> j) & 1) << 4) - 16);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - 16);
    }
}

/* Q5_0, 32 values: f16 d, 4 bytes qh, 16 bytes qs; value = d (n - 16). */
static void unpack_q5_0(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    scales[0] = f16_at(b);
    five_bit_values(b + 2, b + 6, q);
}

/* Q5_1, 32 values: f16 d, f16 m, 4 bytes qh, 16 bytes qs; value = d n + m,
   held as d (n - 16) + (m + 16 d): centred values, so that rounding the
   inputs to 8 bits errs on the weight's spread, not on its mean. */
static void unpack_q5_1(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    float d = f16_at(b);
    scales[0] = d;
    offsets[0] = f16_at(b + 2) + 16.0f * d;
    five_bit_values(b + 4, b + 8, q);
}

/* Q8_0, 32 values: f16 d, 32 int8 q; value = d q. */
static void unpack_q8_0(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    scales[0] = f16_at(b);
    memcpy(q, b + 2, 32);
}

/* The K-quants' 6-bit scale and minimum of sub-block j (0..7), packed in 12
   bytes: j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the
   nibbles of byte j + 4 with their top 2 bits in the top of bytes j - 4
   (scale) and j (minimum). */
static void k_scale_min(const uint8_t *s, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *min = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Q4_K and Q5_K, 256 values in 8 sub-blocks of 32: f16 d, f16 dmin, 12
   bytes of scales and minimums, for Q5_K 32 bytes qh (bit g of byte l: the
   fifth bit of value l of sub-block g), then 128 bytes: 4 runs of 32 bytes,
   run r holding sub-block 2r in its low nibbles and 2r + 1 in its high ones;
   value = (d sc) n - (dmin m), held centred as Q4_1 and Q5_1 are:
   (d sc)(n - c) + (c d sc - dmin m), c = 8 or 16. */
static void k_quant_values(const uint8_t *b, const uint8_t *qh, int8_t *q, float *scales, float *offsets) {
    const float d = f16_at(b), dmin = f16_at(b + 2), centre = qh ? 16.0f : 8.0f;
    const uint8_t *qs = qh ? qh + 32 : b + 16;
    for (int g = 0; g < 8; g++) {
        int sc, m;
        k_scale_min(b + 4, g, &sc, &m);
        scales[g] = d * (float)sc;
        offsets[g] = fmaf(-dmin, (float)m, centre * scales[g]); /* one rounding, as packed_offset */
        for (int l = 0; l < 32; l++) {
            int byte = qs[g / 2 * 32 + l], n = (g % 2 ? byte >> 4 : byte & 15) | (qh ? ((qh[l] >> g) & 1) << 4 : 0);
            q[g * 32 + l] = (int8_t)(n - (int)centre);
        }
    }
}

static void unpack_q4_k(const uint8_t *b, int8_t *q, float *scales, float *offsets) { k_quant_values(b, NULL, q, scales, offsets); }
static void unpack_q5_k(const uint8_t *b, int8_t *q, float *scales, float *offsets) { k_quant_values(b, b + 16, q, scales, offsets); }

/* The factors of the types of one group a block: d, the first 2 bytes. */
static void factors_one(const uint8_t *b, uint16_t *d, int8_t *k, uint16_t *dmin, uint8_t *m) {
    (void)dmin, (void)m;
    *d = u16_at(b);
    k[0] = 1;
}

/* Q4_K's and Q5_K's: d, dmin, then the 6-bit scales and minimums. */
static void factors_k(const uint8_t *b, uint16_t *d, int8_t *k, uint16_t *dmin, uint8_t *m) {
    *d = u16_at(b);
    *dmin = u16_at(b + 2);
    for (int g = 0; g < 8; g++) {
        int sc, mn;
        k_scale_min(b + 4, g, &sc, &mn);
        k[g] = (int8_t)sc;
        m[g] = (uint8_t)mn;
    }
}

/* Q6_K, 256 values in 16 sub-blocks of 16: 128 bytes ql (low 4 bits), 64
   bytes qh (high 2 bits), 16 int8 scales, f16 d. Each half of 128 values
   reads 64 bytes of ql and 32 of qh: value l (0..31) of its quarters 0..3
   takes ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high, and bits
   0-1, 2-3, 4-5, 6-7 of qh[l]; value = (d sc) (n - 32). */
static void unpack_q6_k(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    float d = f16_at(b + 208);
    for (int g = 0; g < 16; g++) scales[g] = d * (float)(int8_t)b[192 + g];
    for (int half = 0; half < 2; half++) {
        const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
        int8_t *out = q + 128 * half;
        for (int l = 0; l < 32; l++) {
            out[l] = (int8_t)(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
            out[l + 32] = (int8_t)(((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
            out[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
            out[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
        }
    }
}

static void factors_q6_k(const uint8_t *b, uint16_t *d, int8_t *k, uint16_t *dmin, uint8_t *m) {
    (void)dmin, (void)m;
    *d = u16_at(b + 208);
    for (int g = 0; g < 16; g++) k[g] = (int8_t)b[192 + g];
}

/* IQ4_NL's and IQ4_XS's table (ggml's kvalues_iq4nl): 16 values spread
   non-linearly, closer together near zero, as trained weights are. */
static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IQ4_NL, 32 values: f16 d, 16 bytes of codes n laid out as Q4_0's
   nibbles; value = d table[n]. */
static void unpack_iq4_nl(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    scales[0] = f16_at(b);
    four_bit_values(b + 2, q);
}

/* IQ4_XS, 256 values in 8 sub-blocks of 32: f16 d, 2 bytes scales_h
   (uint16), 4 bytes scales_l, then 128 bytes of codes, 16 a sub-block laid
   out as IQ4_NL's. Sub-block g's 6-bit scale ls has its low 4 bits in
   nibble g % 2 of scales_l[g / 2] (low first) and its top 2 in bits 2g and
   2g + 1 of scales_h; value = d (ls - 32) table[n]. */
static int iq4_xs_scale(const uint8_t *b, int g) {
    return ((b[4 + g / 2] >> 4 * (g % 2)) & 15) | ((u16_at(b + 2) >> 2 * g) & 3) << 4;
}

static void unpack_iq4_xs(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    const float d = f16_at(b);
    for (int g = 0; g < 8; g++) {
        scales[g] = d * (float)(iq4_xs_scale(b, g) - 32);
        four_bit_values(b + 8 + 16 * g, q + 32 * g);
    }
}

static void factors_iq4_xs(const uint8_t *b, uint16_t *d, int8_t *k, uint16_t *dmin, uint8_t *m) {
    (void)dmin, (void)m;
    *d = u16_at(b);
    for (int g = 0; g < 8; g++) k[g] = (int8_t)(iq4_xs_scale(b, g) - 32);
}

/* MXFP4 (OCP microscaling FP4), 32 values: 1 byte e, an E8M0 power of two
   2^(e - 127), then 16 bytes of E2M1 codes n (sign, 2 exponent bits, 1
   mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; -0 is 0);
   value = 2^(e - 127) E2M1(n). Held as ggml holds it, its table twice
   E2M1 (the integers -12..12) times 2^(e - 128): a float32 for every e
   (2^-128 and 2^-127 subnormal; e = 255, NaN to the standard, a power of
   two as any other to ggml, which writes the files). That scale lies
   beyond f16's range: MXFP4 has no factors; its packed scales are its
   bytes e (section 3's SCALES_E8M0). */
static const int8_t doubled_e2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static void unpack_mxfp4(const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    (void)offsets;
    scales[0] = ldexpf(1.0f, b[0] - 128);
    four_bit_values(b + 1, q);
}

/* A block's values: unpack's, or a table type's codes looked up. */
static void block_values(const GGMLType *type, const uint8_t *b, int8_t *q, float *scales, float *offsets) {
    type->unpack(b, q, scales, offsets);
    for (int j = 0; type->table && j < type->block; j++) q[j] = type->table[q[j] + 8];
}

static const GGMLType ggml_types[] = {
    [0] = {"F32", 1, 4, 32, 0, 0, NULL, NULL, 32, NULL, 0},
    [1] = {"F16", 1, 2, 32, 0, 0, NULL, NULL, 16, NULL, 0},
    [2] = {"Q4_0", 32, 18, 4, 32, 0, unpack_q4_0, factors_one, 4, NULL, 0},
    [3] = {"Q4_1", 32, 20, 4, 32, 1, unpack_q4_1, factors_one, 4, NULL, 0},
    [6] = {"Q5_0", 32, 22, 8, 32, 0, unpack_q5_0, factors_one, 5, NULL, 0},
    [7] = {"Q5_1", 32, 24, 8, 32, 1, unpack_q5_1, factors_one, 5, NULL, 0},
    [8] = {"Q8_0", 32, 34, 8, 32, 0, unpack_q8_0, factors_one, 8, NULL, 0},
    [9] = {"Q8_1", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [10] = {"Q2_K", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [11] = {"Q3_K", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [12] = {"Q4_K", 256, 144, 4, 32, 1, unpack_q4_k, factors_k, 4, NULL, 0},
    [13] = {"Q5_K", 256, 176, 8, 32, 1, unpack_q5_k, factors_k, 5, NULL, 0},
    [14] = {"Q6_K", 256, 210, 8, 16, 0, unpack_q6_k, factors_q6_k, 6, NULL, 0},
    [15] = {"Q8_K", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [16] = {"IQ2_XXS", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [17] = {"IQ2_XS", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [18] = {"IQ3_XXS", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [19] = {"IQ1_S", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [20] = {"IQ4_NL", 32, 18, 8, 32, 0, unpack_iq4_nl, factors_one, 4, iq4_values, 0},
    [21] = {"IQ3_S", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [22] = {"IQ2_S", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [23] = {"IQ4_XS", 256, 136, 8, 32, 0, unpack_iq4_xs, factors_iq4_xs, 4, iq4_values, 0},
    [24] = {"I8", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [25] = {"I16", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [26] = {"I32", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [27] = {"I64", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [28] = {"F64", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [29] = {"IQ1_M", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [30] = {"BF16", 1, 2, 32, 0, 0, NULL, NULL, 16, NULL, 0},
    [34] = {"TQ1_0", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [35] = {"TQ2_0", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
    [39] = {"MXFP4", 32, 17, 8, 32, 0, unpack_mxfp4, NULL, 4, doubled_e2m1, 1},
    [40] = {"NVFP4", 0, 0, 0, 0, 0, NULL, NULL, 0, NULL, 0},
};
#define GGML_TYPES ((int)(sizeof(ggml_types) / sizeof(ggml_types[0])))
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_BF16 = 30 };

/* The type numbered `type`, or NULL when this program does not read it. */
static const GGMLType *ggml_type(uint32_t type) {
    return type < (uint32_t)GGML_TYPES && ggml_types[type].block > 0 ? &ggml_types[type] : NULL;
}

/* ---- Reading the header, the metadata and the tensor infos ---- */

static uint64_t take_u64(FileCursor *c, const char *what) {
    uint64_t v;
    memcpy(&v, take_bytes(c, 8, what), 8);
    return v;
}

static uint32_t take_u32(FileCursor *c, const char *what) {
    uint32_t v;
    memcpy(&v, take_bytes(c, 4, what), 4);
    return v;
}

/* A GGUF string: its bytes (not NUL-terminated) and length. */
static const char *take_gguf_string(FileCursor *c, uint64_t *len, const char *what) {
    *len = take_u64(c, what);
    return take_bytes(c, *len, what);
}

/* Bytes of one value of a fixed-size type; 0 for strings and arrays. */
static int gguf_scalar_bytes(uint32_t type) {
    static const int bytes[GGUF_VALUE_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < GGUF_VALUE_TYPES ? bytes[type] : 0;
}

/* Steps over one value of `type` (an array's elements too, nested arrays up
   to a depth of 8), dying where the file ends first or the type is unknown. */
static void skip_gguf_value(FileCursor *c, uint32_t type, int depth, const char *key) {
    if (type >= GGUF_VALUE_TYPES)
        die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' has unknown value type %u", c->path, key, type);
    uint64_t len;
    if (type == GGUF_STRING) take_gguf_string(c, &len, key);
    else if (type != GGUF_ARRAY) take_bytes(c, (uint64_t)gguf_scalar_bytes(type), key);
    else {
        if (depth >= 8) die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' nests arrays deeper than 8", c->path, key);
        uint32_t elem = take_u32(c, key);
        uint64_t count = take_u64(c, key);
        if (elem >= GGUF_VALUE_TYPES)
            die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is an array of unknown type %u", c->path, key, elem);
        int size = gguf_scalar_bytes(elem);
        /* every element takes at least one byte (a string eight): a count
           past the end of the file is refused before the loop */
        if (count > (c->size - c->offset) / (size ? (uint64_t)size : 8))
            die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' has %llu elements, more than the file holds", c->path, key,
                (unsigned long long)count);
        if (size) take_bytes(c, count * (uint64_t)size, key);
        else
            for (uint64_t i = 0; i < count; i++) skip_gguf_value(c, elem, depth + 1, key);
    }
}

/* A key as a C string, for messages (cut at 200 bytes). */
static const char *gguf_key_text(const char *key, uint64_t len, char *buf, size_t cap) {
    size_t n = len < cap - 1 ? (size_t)len : cap - 1;
    memcpy(buf, key, n);
    buf[n] = '\0';
    return buf;
}

static int compare_tensor_names(const void *a, const void *b) {
    return strcmp(((const GGUFTensor *)a)->name, ((const GGUFTensor *)b)->name);
}

/* Reads one tensor info and checks its shape and type. */
static GGUFTensor take_tensor_info(FileCursor *c) {
    GGUFTensor x = {0};
    uint64_t len;
    const char *name = take_gguf_string(c, &len, "a tensor name");
    if (len > 4096 || memchr(name, '\0', (size_t)len))
        die(EXIT_BAD_FILE, "%s: bad GGUF: a tensor name of %llu bytes", c->path, (unsigned long long)len);
    x.name = xcalloc((size_t)len + 1, 1);
    memcpy(x.name, name, (size_t)len);
    x.n_dims = take_u32(c, x.name);
    if (x.n_dims < 1 || x.n_dims > GGUF_MAX_DIMS)
        die(EXIT_BAD_FILE, "%s: bad GGUF: tensor '%s' has %u dimensions (1 to 4)", c->path, x.name, x.n_dims);
    uint64_t count = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        x.ne[d] = d < (int)x.n_dims ? take_u64(c, x.name) : 1;
        if (x.ne[d] == 0 || x.ne[d] > ((uint64_t)1 << 40) || count > ((uint64_t)1 << 62) / x.ne[d])
            die(EXIT_BAD_FILE, "%s: bad GGUF: tensor '%s' has a dimension of %llu", c->path, x.name, (unsigned long long)x.ne[d]);
        count *= x.ne[d];
    }
    x.type = take_u32(c, x.name);
    const GGMLType *type = ggml_type(x.type);
    if (!type) {
        const char *known = x.type < (uint32_t)GGML_TYPES ? ggml_types[x.type].name : NULL;
        die(EXIT_BAD_FILE, "%s: tensor '%s' has type %s%s%u, which this program does not read "
            "(it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4)",
            c->path, x.name, known ? known : "", known ? " = " : "", x.type);
    }
    if (x.ne[0] % (uint64_t)type->block != 0)
        die(EXIT_BAD_FILE, "%s: bad GGUF: tensor '%s' has rows of %llu values, not whole %s blocks of %d", c->path, x.name,
            (unsigned long long)x.ne[0], type->name, type->block);
    x.bytes = count / (uint64_t)type->block * (uint64_t)type->block_bytes;
    x.data = (const char *)(uintptr_t)take_u64(c, x.name); /* the offset, until the data section is known */
    return x;
}

/* Parses the header, the metadata and the tensor infos of a mapped GGUF
   file, and places each tensor in the data section. */
static void parse_gguf(GGUF *g, const char *base, size_t size, const char *path) {
    memset(g, 0, sizeof(*g));
    g->path = path;
    g->base = base;
    g->size = size;
    FileCursor c = {base, size, 0, path};
    take_bytes(&c, 4, "the magic");
    g->version = take_u32(&c, "the version");
    if (g->version != 2 && g->version != 3)
        die(EXIT_BAD_FILE, "%s: GGUF version %u (this program reads versions 2 and 3)", path, g->version);
    g->n_tensors = take_u64(&c, "the tensor count");
    g->n_values = take_u64(&c, "the metadata count");
    /* a metadata entry takes at least 12 bytes, a tensor info 24 */
    if (g->n_values > size / 12 || g->n_tensors > size / 24)
        die(EXIT_BAD_FILE, "%s: bad GGUF: %llu metadata and %llu tensors cannot fit in %zu bytes", path,
            (unsigned long long)g->n_values, (unsigned long long)g->n_tensors, size);
    g->values = xcalloc((size_t)g->n_values, sizeof(GGUFValue));
    g->tensors = xcalloc((size_t)g->n_tensors, sizeof(GGUFTensor));
    uint64_t alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_values; i++) {
        GGUFValue *v = &g->values[i];
        char key[208];
        v->key = take_gguf_string(&c, &v->key_len, "a metadata key");
        gguf_key_text(v->key, v->key_len, key, sizeof(key));
        v->type = take_u32(&c, key);
        v->count = 1;
        if (v->type == GGUF_ARRAY) {
            size_t start = c.offset;
            v->elem = take_u32(&c, key);
            v->count = take_u64(&c, key);
            c.offset = start;
        }
        v->at = base + c.offset + (v->type == GGUF_ARRAY ? 12 : 0);
        skip_gguf_value(&c, v->type, 0, key);
        if (strcmp(key, "general.alignment") == 0) {
            uint32_t a;
            if (v->type != GGUF_UINT32) die(EXIT_BAD_FILE, "%s: bad GGUF: general.alignment is not a uint32", path);
            memcpy(&a, v->at, 4);
            if (a == 0 || (a & (a - 1)) != 0 || a > 65536)
                die(EXIT_BAD_FILE, "%s: bad GGUF: general.alignment %u is not a power of two up to 65536", path, a);
            alignment = a;
        }
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) g->tensors[i] = take_tensor_info(&c);
    size_t data = (c.offset + alignment - 1) / alignment * alignment;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        GGUFTensor *x = &g->tensors[i];
        uint64_t offset = (uint64_t)(uintptr_t)x->data;
        if (offset % alignment != 0)
            die(EXIT_BAD_FILE, "%s: bad GGUF: tensor '%s' at offset %llu is not aligned to %llu bytes", path, x->name,
                (unsigned long long)offset, (unsigned long long)alignment);
        if (data > size || offset > size - data || x->bytes > size - data - offset)
            die(EXIT_BAD_FILE, "%s: truncated GGUF: tensor '%s' needs %llu bytes at offset %llu of the data section, the file ends first",
                path, x->name, (unsigned long long)x->bytes, (unsigned long long)offset);
        x->data = base + data + offset;
    }
    qsort(g->tensors, (size_t)g->n_tensors, sizeof(GGUFTensor), compare_tensor_names);
    for (uint64_t i = 1; i < g->n_tensors; i++)
        if (strcmp(g->tensors[i - 1].name, g->tensors[i].name) == 0)
            die(EXIT_BAD_FILE, "%s: bad GGUF: tensor '%s' appears twice", path, g->tensors[i].name);
}

static void free_gguf(GGUF *g) {
    for (uint64_t i = 0; g->tensors && i < g->n_tensors; i++) free(g->tensors[i].name);
    free(g->tensors);
    free(g->values);
    memset(g, 0, sizeof(*g));
}

/* ---- Looking up metadata and tensors ---- */

static const GGUFValue *gguf_value(const GGUF *g, const char *key) {
    size_t len = strlen(key);
    for (uint64_t i = 0; i < g->n_values; i++)
        if (g->values[i].key_len == len && memcmp(g->values[i].key, key, len) == 0) return &g->values[i];
    return NULL;
}

/* The integer at `at` of an integer type, or 0 with *ok = 0 for another type. */
static int64_t gguf_integer_at(uint32_t type, const char *at, int *ok) {
    *ok = 1;
    switch (type) {
    case GGUF_UINT8: return (uint8_t)at[0];
    case GGUF_INT8: return (int8_t)at[0];
    case GGUF_BOOL: return at[0] != 0;
    case GGUF_UINT16: { uint16_t v; memcpy(&v, at, 2); return v; }
    case GGUF_INT16: { int16_t v; memcpy(&v, at, 2); return v; }
    case GGUF_UINT32: { uint32_t v; memcpy(&v, at, 4); return v; }
    case GGUF_INT32: { int32_t v; memcpy(&v, at, 4); return v; }
    case GGUF_UINT64: { uint64_t v; memcpy(&v, at, 8); return v > INT64_MAX ? INT64_MAX : (int64_t)v; }
    case GGUF_INT64: { int64_t v; memcpy(&v, at, 8); return v; }
    default: *ok = 0; return 0;
    }
}

/* The integer metadata `key` in lo..hi, `absent` when the file lacks it
   (absent < lo: the key is required). */
static int gguf_int(const GGUF *g, const char *key, int absent, int lo, int hi) {
    const GGUFValue *v = gguf_value(g, key);
    if (!v) {
        if (absent < lo) die(EXIT_BAD_FILE, "%s: GGUF metadata '%s' is missing", g->path, key);
        return absent;
    }
    int ok;
    int64_t x = gguf_integer_at(v->type, v->at, &ok);
    if (!ok) die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is not an integer", g->path, key);
    if (x < lo || x > hi) die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is %lld, must be in %d..%d", g->path, key, (long long)x, lo, hi);
    return (int)x;
}

/* The float metadata `key`, or `absent`. */
static float gguf_float(const GGUF *g, const char *key, float absent) {
    const GGUFValue *v = gguf_value(g, key);
    if (!v) return absent;
    if (v->type == GGUF_FLOAT32) return read_f32(v->at);
    if (v->type == GGUF_FLOAT64) {
        double d;
        memcpy(&d, v->at, 8);
        return (float)d;
    }
    die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is not a float", g->path, key);
    return 0;
}

/* The string metadata `key` as a NUL-terminated copy (free it), or NULL. */
static char *gguf_string(const GGUF *g, const char *key) {
    const GGUFValue *v = gguf_value(g, key);
    if (!v) return NULL;
    if (v->type != GGUF_STRING) die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is not a string", g->path, key);
    uint64_t len;
    memcpy(&len, v->at, 8);
    char *s = xcalloc((size_t)len + 1, 1);
    memcpy(s, v->at + 8, (size_t)len);
    return s;
}

static const GGUFTensor *gguf_tensor(const GGUF *g, const char *name) {
    GGUFTensor key = {.name = (char *)name};
    return g->n_tensors ? bsearch(&key, g->tensors, (size_t)g->n_tensors, sizeof(GGUFTensor), compare_tensor_names) : NULL;
}

/* ---- 2.2 A model from a GGUF file -------------------------------------------
   The architectures of section 1's table (ARCHS): the hyperparameters from
   {arch}.embedding_length and the like, the vocabulary size from the token
   embedding, the weights from tensors named blk.N.attn_q.weight and so on
   (ne[0] the input width: row-major (out, in) as section 1 holds them).
   RoPE: llama.cpp's converter permutes a `llama` (or smollm3, granite)
   file's Q and K rows so that adjacent pairs rotate, as run.c always has;
   the others keep Hugging Face's order, where element i turns with element
   i + rope_dims / 2 (the halves). Llama 3.1's scaling comes as
   `rope_freqs.weight`, a factor per frequency that divides the angle;
   Phi-3's LongRoPE as two such tables. Biases of q, k and v (qwen2) are
   read wherever a file has them. What each row adds to the forward pass
   (QK-norm, post-norms, GELU, windows, scales) is read here, once, into
   Config and Weights; section 4 runs it.

   The values are read in place (F32, F16 and BF16: the kernels widen the
   16-bit values as they load them), packed straight from their blocks by
   the builds that pack (section 3), or else converted once: the block
   types to int8 or 4-bit values with a float32 scale per group and, for
   the types with a minimum, a float32 offset per group (value = q x scale
   + offset, as the format defines it; matmul adds the offsets' part as
   offset x the group's sum of inputs). The stored pages are given back
   once packed or converted. */

#define GGUF_CONVERT_HINT "convert the original model with `python3 export.py model DIR out.gguf`"

/* Memory for converted tensors, freed with the model: 64-byte aligned
   pieces of chunks of at least MODEL_CHUNK bytes, so that small tensors do
   not each take a 2 MB page of their own (alloc_pages asks for them). */
#define MODEL_CHUNK ((size_t)32 << 20)
static void *model_pages(Transformer *t, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    OwnedPages *last = t->n_owned ? &t->owned[t->n_owned - 1] : NULL;
    if (!last || last->bytes - last->used < bytes) {
        t->owned = realloc(t->owned, (size_t)(t->n_owned + 1) * sizeof(*t->owned));
        if (!t->owned) die(EXIT_BAD_FILE, "out of memory (the list of converted tensors)");
        size_t chunk = bytes > MODEL_CHUNK ? bytes : MODEL_CHUNK;
        last = &t->owned[t->n_owned++];
        *last = (OwnedPages){alloc_pages(chunk, "converted weights", 1), chunk, 0};
    }
    void *p = (char *)last->p + last->used;
    last->used += bytes;
    return p;
}

/* The tensor `name`, which must have the shape (ne1 rows of ne0); NULL when
   it is absent and not `required`. */
static const GGUFTensor *gguf_shaped(const GGUF *g, const char *name, uint64_t ne0, uint64_t ne1, int required) {
    const GGUFTensor *x = gguf_tensor(g, name);
    if (!x) {
        if (required) die(EXIT_BAD_FILE, "%s: GGUF tensor '%s' is missing", g->path, name);
        return NULL;
    }
    if (x->ne[0] != ne0 || x->ne[1] != ne1 || x->ne[2] != 1 || x->ne[3] != 1)
        die(EXIT_BAD_FILE, "%s: GGUF tensor '%s' has shape [%llu, %llu, %llu, %llu], the metadata make it [%llu, %llu]", g->path, name,
            (unsigned long long)x->ne[0], (unsigned long long)x->ne[1], (unsigned long long)x->ne[2], (unsigned long long)x->ne[3],
            (unsigned long long)ne0, (unsigned long long)ne1);
    return x;
}

/* The value at index i of a float tensor (F32, F16 or BF16). */
static float tensor_float(const GGUFTensor *x, size_t i) {
    const uint8_t *p = (const uint8_t *)x->data;
    return x->type == GGML_F32 ? read_f32((const char *)p + 4 * i) : x->type == GGML_F16 ? f16_at(p + 2 * i) : bf16_at(p + 2 * i);
}

/* Copies the float tensor `name` of `rows` rows of n (a vector: one row)
   to out; 0 when it is absent and not required. */
static int gguf_table(const GGUF *g, const char *name, float *out, int n, int rows, int required) {
    const GGUFTensor *x = gguf_shaped(g, name, (uint64_t)n, (uint64_t)rows, required);
    if (!x) return 0;
    if (!ggml_types[x->type].bits || ggml_types[x->type].unpack)
        die(EXIT_BAD_FILE, "%s: GGUF tensor '%s' is %s; a vector must be F32, F16 or BF16", g->path, name, ggml_types[x->type].name);
    for (size_t i = 0; i < (size_t)n * rows; i++) out[i] = tensor_float(x, i);
    return 1;
}

static int gguf_vector(const GGUF *g, const char *name, float *out, int n, int required) { return gguf_table(g, name, out, n, 1, required); }

/* Unpacks the blocks of x into values (int8, or 4-bit as section 2 lays
   them out: value 2k in the low nibble of byte k), scales and offsets
   (group by group: (groups of a row, rows), as add_offsets reads them). */
static void unpack_tensor(const GGUFTensor *x, const GGMLType *type, int8_t *values, float *scales, float *offsets) {
    const long long blocks = (long long)(x->bytes / (uint64_t)type->block_bytes);
    const int per = type->block / type->group;
    PARALLEL_FOR_IF(blocks >= 64)
    for (long long b = 0; b < blocks; b++) {
        int8_t q[256];
        float s[16], o[16];
        block_values(type, (const uint8_t *)x->data + (size_t)b * type->block_bytes, q, s, o);
        memcpy(scales + (size_t)b * per, s, (size_t)per * sizeof(float));
        for (int k = 0; offsets && k < per; k++) { /* group g of row r */
            const size_t at = (size_t)b * type->block + (size_t)k * type->group, r = at / x->ne[0], g = at % x->ne[0] / type->group;
            offsets[g * x->ne[1] + r] = o[k];
        }
        if (type->bits == 8) memcpy(values + (size_t)b * type->block, q, (size_t)type->block);
        else
            for (int j = 0; j < type->block; j += 2)
                ((uint8_t *)values)[((size_t)b * type->block + j) / 2] = (uint8_t)((q[j] + 8) | (q[j + 1] + 8) << 4);
    }
}

static int packs_blocks(const GGMLType *type); /* section 3 */

/* The matrix tensor `name` of (rows, cols) in section 1's layout: F32, F16
   and BF16 read in place (the kernels widen 16-bit values as they load
   them: half the bytes of float32 to read per token); the block types
   left as they are for the builds that pack them straight from their
   blocks (pack_weights), or else unpacked. */
static Matrix gguf_matrix_of(Transformer *t, const GGUF *g, const GGUFTensor *x, const char *name, int rows, int cols) {
    const GGMLType *type = ggml_type(x->type);
    const size_t count = (size_t)rows * (size_t)cols;
    Matrix m = {.rows = rows, .cols = cols};
    if (x->type == GGML_F32) {
        if ((uintptr_t)x->data % sizeof(float) != 0)
            die(EXIT_BAD_FILE, "%s: bad GGUF: F32 tensor '%s' is not aligned to 4 bytes", g->path, name);
        m.w = (const float *)x->data;
        return m;
    }
    if (!type->unpack) {
        if ((uintptr_t)x->data % sizeof(uint16_t) != 0)
            die(EXIT_BAD_FILE, "%s: bad GGUF: %s tensor '%s' is not aligned to 2 bytes", g->path, type->name, name);
        m.half = (const uint16_t *)x->data;
        m.bf16 = x->type == GGML_BF16;
        return m;
    }
    m.group_size = type->group;
    m.scale_run = type->block / type->group;
    if (packs_blocks(type)) {
        m.blocks = (const uint8_t *)x->data;
        m.block_type = (int)x->type;
        return m;
    }
    const size_t groups = count / (size_t)type->group, value_bytes = ((type->bits == 4 ? count / 2 : count) + 63) / 64 * 64;
    char *memory = model_pages(t, value_bytes + groups * sizeof(float) * (type->offsets ? 2 : 1));
    float *scales = (float *)(memory + value_bytes), *offsets = type->offsets ? scales + groups : NULL;
    unpack_tensor(x, type, (int8_t *)memory, scales, offsets);
    m.scales = (const char *)scales;
    m.offsets = offsets;
    if (type->bits == 4) m.q4 = (const uint8_t *)memory;
    else m.q = (const int8_t *)memory;
    release_pages(x->data, (size_t)x->bytes); /* read once, never again */
    return m;
}

static Matrix gguf_matrix(Transformer *t, const GGUF *g, const char *name, int rows, int cols) {
    return gguf_matrix_of(t, g, gguf_shaped(g, name, (uint64_t)cols, (uint64_t)rows, 1), name, rows, cols);
}

/* Rows first..first+rows-1 of the matrix tensor x as a tensor of their own
   (a row is whole blocks, so they lie together): one of the matrices that
   a fused tensor holds. */
static GGUFTensor tensor_rows(const GGUFTensor *x, uint64_t first, uint64_t rows) {
    GGUFTensor part = *x;
    const uint64_t row_bytes = x->bytes / x->ne[1];
    part.data = x->data + first * row_bytes;
    part.ne[1] = rows;
    part.bytes = rows * row_bytes;
    return part;
}

/* The token embedding (rows, cols): of a block type, read in place, each
   looked-up row unpacked from its blocks (matrix_row), rather than a
   converted copy of the whole table held for the few rows a text reads;
   of a float type, as gguf_matrix reads it. */
static Matrix gguf_embedding(Transformer *t, const GGUF *g, int rows, int cols) {
    const GGUFTensor *x = gguf_shaped(g, "token_embd.weight", (uint64_t)cols, (uint64_t)rows, 1);
    const GGMLType *type = ggml_type(x->type);
    if (!type || !type->unpack) return gguf_matrix(t, g, "token_embd.weight", rows, cols);
    return (Matrix){.rows = rows, .cols = cols, .blocks = (const uint8_t *)x->data, .block_type = (int)x->type};
}

/* n_layers matrices named blk.N.<what>.weight. */
static Matrix *gguf_layer_matrices(Transformer *t, const GGUF *g, const char *what, int rows, int cols) {
    Matrix *m = xcalloc((size_t)t->config.n_layers, sizeof(Matrix));
    for (int l = 0; l < t->config.n_layers; l++) {
        char name[64];
        snprintf(name, sizeof(name), "blk.%d.%s.weight", l, what);
        m[l] = gguf_matrix(t, g, name, rows, cols);
    }
    return m;
}

/* The tables blk.N.<what> of `rows` rows of n floats of every layer,
   (n_layers, rows, n), into memory of the model (fresh pages, zeros: a
   layer without an optional one adds nothing); NULL when no layer has one
   and it is optional. */
static float *gguf_layer_tables(Transformer *t, const GGUF *g, const char *what, int n, int rows, int required) {
    const int L = t->config.n_layers;
    float *v = NULL;
    for (int l = 0; l < L; l++) {
        char name[64];
        snprintf(name, sizeof(name), "blk.%d.%s", l, what);
        if (!required && !gguf_tensor(g, name)) continue;
        if (!v) v = model_pages(t, (size_t)L * rows * n * sizeof(float));
        gguf_table(g, name, v + (size_t)l * rows * n, n, rows, 1);
    }
    return v;
}

/* The vectors blk.N.<what> of n floats of every layer, (n_layers, n). */
static float *gguf_layer_vectors(Transformer *t, const GGUF *g, const char *what, int n, int required) {
    return gguf_layer_tables(t, g, what, n, 1, required);
}

/* The architecture named by the file: its row of ARCHS. Linear-attention and
   recurrent hybrids are named as such. */
static const Arch *gguf_arch(const GGUF *g, const char *arch) {
    for (int i = 0; i < N_ARCHS; i++)
        if (strcmp(arch, ARCHS[i].name) == 0) return &ARCHS[i];
    const char *hybrid = strstr(arch, "mamba") || strstr(arch, "rwkv") || strstr(arch, "next") || strstr(arch, "hybrid") || strstr(arch, "jamba")
                             ? " (a recurrent or linear-attention hybrid, which this program does not run)"
                             : "";
    die(EXIT_BAD_FILE, "%s: GGUF architecture '%s'%s is not one this program runs (" ARCH_NAMES ")", g->path, arch, hybrid);
    return NULL;
}

/* A positive finite float metadata `key` of the architecture, or `absent`. */
static float gguf_positive(const GGUF *g, const char *key, float absent) {
    float v = gguf_float(g, key, absent);
    if (!(v > 0.0f && isfinite(v)) && v != absent) die(EXIT_BAD_FILE, "%s: bad GGUF: %s is %g, must be positive", g->path, key, v);
    return v;
}

/* Multi-head latent attention's widths (DeepSeek-V2, Config mla_rank). The
   attention runs as one key head of the latent and the RoPE key
   (kv_lora_rank + rope.dimension_count wide), which every query head reads.
   A head's query is mla_nope values without RoPE and rope_dims with, its
   output mla_value wide: key_length_mla and value_length_mla where the file
   has them (the newer files, whose key_length and value_length are the
   latent's), else key_length and value_length (default dim / n_heads). */
static void gguf_mla_config(Config *p, const GGUF *g, const char *arch, int heads) {
    char key[128];
#define ARCH_KEY(name) (snprintf(key, sizeof(key), "%s.%s", arch, name), key)
    p->mla_rank = gguf_int(g, ARCH_KEY("attention.kv_lora_rank"), -1, 1, 65536);
    p->q_rank = gguf_int(g, ARCH_KEY("attention.q_lora_rank"), 0, 0, 65536);
    p->rope_dims = gguf_int(g, ARCH_KEY("rope.dimension_count"), -1, 2, 65536);
    const int newer = p->mla_split = gguf_value(g, ARCH_KEY("attention.key_length_mla")) != NULL;
    const int k = gguf_int(g, ARCH_KEY(newer ? "attention.key_length_mla" : "attention.key_length"), heads > 0 ? heads : -1, 1, 65536);
    if (k <= p->rope_dims) die(EXIT_BAD_FILE, "%s: %s is %d, not more than rope.dimension_count %d", g->path, key, k, p->rope_dims);
    p->mla_nope = k - p->rope_dims;
    p->mla_value = gguf_int(g, ARCH_KEY(newer ? "attention.value_length_mla" : "attention.value_length"), heads > 0 ? heads : -1, 1, 65536);
    p->head_size = p->mla_rank + p->rope_dims;
    p->n_kv_heads = 1;
    /* llama.cpp's kq_scale: 1 / sqrt(the query head's width), times YaRN's mscale squared (gguf_rope) */
    p->att_multiplier = 1.0f / sqrtf((float)k);
#undef ARCH_KEY
}

/* How DeepSeek's routers weigh their experts, as its file says:
   expert_gating_func 1 (or none) the softmax, 2 the sigmoid of each logit
   (with exp_probs_b.bias added to choose, not to weigh); the chosen
   weights renormalised where expert_weights_norm, times
   expert_weights_scale; its expert_shared_count shared experts one FFN of
   that many experts' width. */
static void gguf_deepseek_experts(Config *p, const GGUF *g, const char *arch) {
    char key[128];
#define ARCH_KEY(name) (snprintf(key, sizeof(key), "%s.%s", arch, name), key)
    const int gating = gguf_int(g, ARCH_KEY("expert_gating_func"), 0, 0, INT_MAX);
    if (gating > 2) die(EXIT_BAD_FILE, "%s: %s is %d; this program runs 1 (softmax) and 2 (sigmoid)", g->path, key, gating);
    p->gating = gating == 2 ? GATING_SIGMOID : GATING_SOFTMAX;
    p->moe_norm = gguf_int(g, ARCH_KEY("expert_weights_norm"), 0, 0, 1);
    p->expert_scale = gguf_float(g, ARCH_KEY("expert_weights_scale"), 0.0f);
    if (!isfinite(p->expert_scale)) die(EXIT_BAD_FILE, "%s: bad GGUF: %s is %g", g->path, key, p->expert_scale);
    const int shared = gguf_int(g, ARCH_KEY("expert_shared_count"), -1, 1, 4096);
    if ((long long)shared * p->expert_hidden > INT_MAX) die(EXIT_BAD_FILE, "%s: bad GGUF: %s is %d, too many", g->path, key, shared);
    p->shared_hidden = shared * p->expert_hidden;
    p->leading_dense = gguf_int(g, ARCH_KEY("leading_dense_block_count"), 0, 0, p->n_layers);
#undef ARCH_KEY
}

/* The hyperparameters of a file of architecture `arch` (its row: p->arch):
   widths, heads, RoPE, the sliding window and the scales the row reads. */
static void gguf_config(Config *p, const GGUF *g, const char *arch) {
    char key[128];
#define ARCH_KEY(name) (snprintf(key, sizeof(key), "%s.%s", arch, name), key)
    const Arch *a = p->arch;
    p->dim = gguf_int(g, ARCH_KEY("embedding_length"), -1, 1, INT_MAX);
    p->hidden_dim = gguf_int(g, ARCH_KEY("feed_forward_length"), -1, 1, INT_MAX);
    p->n_layers = gguf_int(g, ARCH_KEY("block_count"), -1, 1, 65536);
    p->n_heads = gguf_int(g, ARCH_KEY("attention.head_count"), -1, 1, INT_MAX);
    p->n_kv_heads = gguf_int(g, ARCH_KEY("attention.head_count_kv"), p->n_heads, 1, INT_MAX);
    p->seq_len = gguf_int(g, ARCH_KEY("context_length"), -1, 1, INT_MAX);
    p->norm_eps = gguf_float(g, ARCH_KEY("attention.layer_norm_rms_epsilon"), 1e-5f);
    p->rope_theta = gguf_float(g, ARCH_KEY("rope.freq_base"), 10000.0f);
    p->rope_scaling = ROPE_SCALING_NONE;
    p->rope_halves = a->rope_halves;
    const GGUFTensor *embedding = gguf_tensor(g, "token_embd.weight");
    if (!embedding) die(EXIT_BAD_FILE, "%s: GGUF tensor 'token_embd.weight' is missing", g->path);
    if (embedding->ne[1] > INT_MAX) die(EXIT_BAD_FILE, "%s: bad GGUF: %llu tokens", g->path, (unsigned long long)embedding->ne[1]);
    p->vocab_size = (int)embedding->ne[1];
    /* a head's width: key_length where the file sets it (Qwen3, Gemma 3, Mistral Nemo), which values share */
    const int heads = p->dim % p->n_heads == 0 ? p->dim / p->n_heads : 0;
    if (a->mla) {
        gguf_mla_config(p, g, arch, heads);
    } else {
        p->head_size = gguf_int(g, ARCH_KEY("attention.key_length"), heads > 0 ? heads : -1, 2, 65536);
        const int value_length = gguf_int(g, ARCH_KEY("attention.value_length"), p->head_size, 1, 65536);
        if (value_length != p->head_size)
            die(EXIT_BAD_FILE, "%s: %s is %d, not the key length %d (this program runs heads whose keys and values are alike)", g->path,
                key, value_length, p->head_size);
        p->rope_dims = gguf_int(g, ARCH_KEY("rope.dimension_count"), p->head_size, 2, p->head_size);
    }
    validate_config(p, g->path);
    if (!(p->norm_eps >= 0.0f && p->norm_eps < 1.0f))
        die(EXIT_BAD_FILE, "%s: bad GGUF: rms epsilon %g is not in [0, 1)", g->path, p->norm_eps);
    if (!(p->rope_theta > 0.0f && isfinite(p->rope_theta)))
        die(EXIT_BAD_FILE, "%s: bad GGUF: rope.freq_base %g must be positive", g->path, p->rope_theta);
    if (a->window_period) {
        p->window = gguf_int(g, ARCH_KEY("attention.sliding_window"), 0, 0, INT_MAX);
        const GGUFValue *pattern = gguf_value(g, ARCH_KEY("attention.sliding_window_pattern"));
        if (pattern && pattern->type == GGUF_ARRAY)
            die(EXIT_BAD_FILE, "%s: %s is a per-layer array; this program reads it as one period (every n-th layer global)", g->path, key);
        p->window_period = gguf_int(g, key, a->window_period, 1, 65536);
        p->rope_theta_local = gguf_positive(g, ARCH_KEY("rope.freq_base_swa"), a->swa_base > 0.0f ? a->swa_base : p->rope_theta);
    }
    p->rope_mscale = gguf_positive(g, ARCH_KEY("rope.scaling.attn_factor"), 1.0f);
    p->softcap = gguf_positive(g, ARCH_KEY("final_logit_softcapping"), 0.0f);
    if (a->embed_sqrt_dim) p->embed_scale = sqrtf((float)p->dim);
    /* Gemma 3 scales queries by 1/sqrt(head_size) but for 27B (62 layers), by 1/sqrt(dim / n_heads) */
    if (a->embed_sqrt_dim) p->att_multiplier = 1.0f / sqrtf((float)(p->n_layers == 62 ? p->dim / p->n_heads : p->head_size));
    if (a->scales) {
        p->embed_scale = gguf_positive(g, ARCH_KEY("embedding_scale"), 0.0f);
        p->residual_scale = gguf_positive(g, ARCH_KEY("residual_scale"), 0.0f);
        p->att_multiplier = gguf_positive(g, ARCH_KEY("attention.scale"), 0.0f);
        p->logit_scale = gguf_positive(g, ARCH_KEY("logit_scale"), 0.0f);
        if (p->logit_scale == 0.0f) die(EXIT_BAD_FILE, "%s: GGUF metadata '%s' is missing", g->path, key);
        p->rope_off = !gguf_int(g, ARCH_KEY("rope.scaling.finetuned"), 1, 0, 1); /* Granite's switch for RoPE, on by default */
    }
    p->n_experts = gguf_int(g, ARCH_KEY("expert_count"), a->biases ? -1 : 0, 0, 4096); /* gpt-oss: experts in every layer */
    if (p->n_experts == 1) p->n_experts = 0; /* one expert is a dense FFN, as llama.cpp takes it */
    if (p->n_experts > 0) {
        p->n_experts_used = gguf_int(g, ARCH_KEY("expert_used_count"), -1, 1, p->n_experts);
        /* an expert's width as its tensors have it (Mixtral's and OLMoE's is
           feed_forward_length, Qwen's expert_feed_forward_length) */
        for (int l = 0; l < p->n_layers && p->expert_hidden == 0; l++) {
            char name[64];
            snprintf(name, sizeof(name), "blk.%d.ffn_up_exps.weight", l);
            const GGUFTensor *up = gguf_tensor(g, name);
            if (up && up->ne[1] > 0 && up->ne[1] <= INT_MAX) p->expert_hidden = (int)up->ne[1];
        }
        if (p->expert_hidden == 0)
            die(EXIT_BAD_FILE, "%s: %s is %d, but no layer has experts (blk.N.ffn_up_exps.weight)", g->path, ARCH_KEY("expert_count"),
                p->n_experts);
        p->shared_hidden = gguf_int(g, ARCH_KEY("expert_shared_feed_forward_length"), p->hidden_dim, 1, INT_MAX);
    }
    p->gating = a->gating;
    p->moe_norm = a->moe_norm;
    if (a->mla && p->n_experts > 0) gguf_deepseek_experts(p, g, arch);
    const GGUFValue *tokens = gguf_value(g, "tokenizer.ggml.tokens");
    if (tokens && (tokens->type != GGUF_ARRAY || tokens->count != (uint64_t)p->vocab_size))
        die(EXIT_BAD_FILE, "%s: the vocabulary has %llu tokens, the token embedding %d", g->path,
            (unsigned long long)(tokens->type == GGUF_ARRAY ? tokens->count : 0), p->vocab_size);
#undef ARCH_KEY
}

/* YaRN's ramp (rope.scaling.type yarn, as ggml's rope computes it): pair i
   of rope_dims turns at its frequency times (1 - r) / factor + r, r = 1
   for the pairs of fast rotation (below the dimension at which a pair turns
   beta_fast = 32 times over the original context), 0 for the slow ones
   (beyond beta_slow = 1 turn), linear between; the dimensions in float as
   ggml_rope_yarn_corr_dims has them. */
static double yarn_ramp(const Config *p, double theta, double factor, int i) {
    const float n = (float)p->rope_dims, ctx = (float)p->rope_original_context, base = logf((float)theta);
    const float low = floorf(n * logf(ctx / (32.0f * 2 * (float)M_PI)) / (2 * base));
    const float high = ceilf(n * logf(ctx / (1.0f * 2 * (float)M_PI)) / (2 * base));
    const float lo = low > 0.0f ? low : 0.0f, hi = high < n - 1 ? high : n - 1;
    float y = (i - lo) / (hi - lo > 0.001f ? hi - lo : 0.001f);
    const float r = 1.0f - (y < 0.0f ? 0.0f : y > 1.0f ? 1.0f : y);
    return (1.0 - r) / factor + r;
}

/* RoPE's inverse frequencies (rope_dims / 2) for base theta:
   theta^(-2i / rope_dims), divided by the factors of the tensor `factors`
   (Llama 3.1's rope_freqs, Phi-3's LongRoPE factors) and by a linear
   scaling factor, or YaRN's ramp (yarn_ramp), where the file has them.
   Computed in double, rounded once to float. `linear`: whether the file's
   scaling applies (not to Gemma 3's windowed layers). */
static float *gguf_rope_frequencies(const GGUF *g, const Config *p, const char *arch, double theta, const char *factors_name, int linear) {
    const int half = p->rope_dims / 2;
    float *freq = xcalloc((size_t)half, sizeof(float)), *factors = xcalloc((size_t)half, sizeof(float));
    int have_factors = gguf_vector(g, factors_name, factors, half, 0);
    char key[128];
    snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
    char *scaling = gguf_string(g, key);
    double by = 1.0;
    const int yarn = scaling && strcmp(scaling, "yarn") == 0 && linear;
    if (scaling && (strcmp(scaling, "linear") == 0 || yarn) && linear) {
        snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
        by = gguf_float(g, key, 1.0f);
        if (by == 0.0) by = 1.0; /* llama.cpp: 0, no scaling */
        if (!(by > 0.0 && isfinite(by))) die(EXIT_BAD_FILE, "%s: bad GGUF: %s is %g", g->path, key, by);
    } else if (scaling && strcmp(scaling, "none") != 0 && strcmp(scaling, "linear") != 0 && strcmp(scaling, "longrope") != 0 &&
               strcmp(scaling, "yarn") != 0)
        die(EXIT_BAD_FILE, "%s: RoPE scaling '%s' is not one this program runs (none, linear, yarn, longrope, or rope_freqs factors)", g->path,
            scaling);
    for (int i = 0; i < half; i++) {
        if (have_factors && !(factors[i] > 0.0f && isfinite(factors[i])))
            die(EXIT_BAD_FILE, "%s: bad GGUF: %s[%d] is %g, must be positive", g->path, factors_name, i, factors[i]);
        double f = yarn ? pow(theta, -2.0 * i / (2.0 * half)) * yarn_ramp(p, theta, by, i) : pow(theta, -2.0 * i / (2.0 * half)) / by;
        freq[i] = (float)(have_factors ? f / factors[i] : f);
    }
    free(scaling);
    free(factors);
    return freq;
}

/* Phi-3's LongRoPE: the short factors serve a context up to the original
   one (rope.scaling.original_context_length), the long ones a longer
   context, as llama.cpp chooses them; t->rope_freq is the table in use,
   t->rope_freq_other the other. Called at load and again when --ctx-size
   changes the context. */
static void choose_rope_factors(Transformer *t) {
    if (!t->rope_freq_other) return;
    const int want_long = t->config.seq_len > t->config.rope_original_context;
    if (want_long != t->rope_long) {
        float *f = t->rope_freq;
        t->rope_freq = t->rope_freq_other;
        t->rope_freq_other = f;
        t->rope_long = want_long;
    }
}

/* The RoPE tables of a GGUF model: the global layers' (with Llama 3.1's
   rope_freqs or Phi-3's LongRoPE factors), and Gemma 3's windowed layers'
   at their own base. */
static void gguf_rope(Transformer *t, const GGUF *g, const char *arch) {
    Config *p = &t->config;
    char key[128];
    snprintf(key, sizeof(key), "%s.rope.scaling.original_context_length", arch);
    p->rope_original_context = gguf_int(g, key, p->seq_len, 1, INT_MAX);
    if (gguf_tensor(g, "rope_factors_short.weight") || gguf_tensor(g, "rope_factors_long.weight")) {
        t->rope_freq = gguf_rope_frequencies(g, p, arch, p->rope_theta, "rope_factors_short.weight", 1);
        t->rope_freq_other = gguf_rope_frequencies(g, p, arch, p->rope_theta, "rope_factors_long.weight", 1);
        choose_rope_factors(t);
    } else
        t->rope_freq = gguf_rope_frequencies(g, p, arch, p->rope_theta, "rope_freqs.weight", 1);
    /* the windowed layers: Gemma 3's unscaled, gpt-oss's as the global ones */
    if (p->window > 0) t->rope_freq_local = gguf_rope_frequencies(g, p, arch, p->rope_theta_local, "", p->arch->swa_base == 0.0f);
    /* YaRN's attention factor: cosines and sines times 1 + ln(factor) / 10
       where the factor is above 1 (llama.cpp's yarn_attn_factor, its
       cancelled mscale and ggml's rope's together); but for DeepSeek's
       files with a yarn_log_multiplier L, which llama.cpp reads only
       there, the cosines and sines are left as they are and the attention
       scores are multiplied by mscale^2 instead, mscale = 1 + L ln(factor)
       (the converter wrote L as 0.1 x mscale_all_dim) */
    snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
    char *scaling = gguf_string(g, key);
    float log_mul = 0.0f, factor = 1.0f;
    if (scaling && strcmp(scaling, "yarn") == 0) {
        snprintf(key, sizeof(key), "%s.rope.scaling.yarn_log_multiplier", arch);
        log_mul = gguf_float(g, key, 0.0f);
        if (log_mul != 0.0f && !p->arch->mla)
            die(EXIT_BAD_FILE, "%s: %s is set: YaRN with a log multiplier is not one this program runs but for deepseek2", g->path, key);
        if (!isfinite(log_mul)) die(EXIT_BAD_FILE, "%s: bad GGUF: %s is %g", g->path, key, log_mul);
        snprintf(key, sizeof(key), "%s.rope.scaling.factor", arch);
        factor = gguf_float(g, key, 1.0f);
        if (factor > 1.0f && log_mul == 0.0f) p->rope_mscale = (p->rope_mscale > 0.0f ? p->rope_mscale : 1.0f) * (1.0f + 0.1f * logf(factor));
    }
    free(scaling);
    /* MLA: the scores times the square of RoPE's factor and of YaRN's mscale (llama.cpp's kq_scale) */
    if (p->arch->mla) {
        const float mscale = (p->rope_mscale > 0.0f ? p->rope_mscale : 1.0f) * (factor > 1.0f ? 1.0f + log_mul * logf(factor) : 1.0f);
        p->att_multiplier *= mscale * mscale;
    }
}

/* Layer matrices stored apart (blk.N.<names[i]>.weight) or fused in one
   tensor blk.N.<fused>.weight whose rows are theirs in order (fused: NULL
   or absent, apart): out[i] the n_layers matrices of rows[i] rows. */
static void gguf_layer_parts(Transformer *t, const GGUF *g, const char *fused, const char *const *names, const int *rows, int n, int cols,
                             Matrix **out) {
    const int L = t->config.n_layers;
    char name[64];
    if (fused) snprintf(name, sizeof(name), "blk.0.%s.weight", fused);
    if (!fused || !gguf_tensor(g, name)) {
        for (int i = 0; i < n; i++) out[i] = gguf_layer_matrices(t, g, names[i], rows[i], cols);
        return;
    }
    int total = 0;
    for (int i = 0; i < n; i++) {
        out[i] = xcalloc((size_t)L, sizeof(Matrix));
        total += rows[i];
    }
    for (int l = 0; l < L; l++) {
        snprintf(name, sizeof(name), "blk.%d.%s.weight", l, fused);
        const GGUFTensor *x = gguf_shaped(g, name, (uint64_t)cols, (uint64_t)total, 1);
        for (int i = 0, first = 0; i < n; first += rows[i++]) {
            GGUFTensor part = tensor_rows(x, (uint64_t)first, (uint64_t)rows[i]);
            out[i][l] = gguf_matrix_of(t, g, &part, name, rows[i], cols);
        }
    }
}

/* The n matrices of (rows, cols) that the 3-D tensor blk.<l>.<what>.weight
   holds, one after the other (n experts, or n heads: `of` says which),
   into out[0..n-1]. */
static void gguf_stacked(Transformer *t, const GGUF *g, int l, const char *what, int rows, int cols, int n, const char *of, Matrix *out) {
    char name[64];
    snprintf(name, sizeof(name), "blk.%d.%s.weight", l, what);
    const GGUFTensor *x = gguf_tensor(g, name);
    if (!x) die(EXIT_BAD_FILE, "%s: GGUF tensor '%s' is missing", g->path, name);
    if (x->ne[0] != (uint64_t)cols || x->ne[1] != (uint64_t)rows || x->ne[2] != (uint64_t)n || x->ne[3] != 1)
        die(EXIT_BAD_FILE, "%s: GGUF tensor '%s' has shape [%llu, %llu, %llu, %llu], the metadata make it [%d, %d, %d] (%d %s)", g->path,
            name, (unsigned long long)x->ne[0], (unsigned long long)x->ne[1], (unsigned long long)x->ne[2], (unsigned long long)x->ne[3],
            cols, rows, n, n, of);
    GGUFTensor all = *x;
    all.ne[1] = (uint64_t)rows * n;
    all.ne[2] = 1;
    for (int e = 0; e < n; e++) {
        GGUFTensor part = tensor_rows(&all, (uint64_t)e * rows, (uint64_t)rows);
        out[e] = gguf_matrix_of(t, g, &part, name, rows, cols);
    }
}

static void gguf_experts(Transformer *t, const GGUF *g, int l, const char *what, int rows, int cols, Matrix *out) {
    gguf_stacked(t, g, l, what, rows, cols, t->config.n_experts, "experts", out);
}

static void matrix_row(float *out, const Matrix *W, int row); /* section 3 */

/* The transpose of m, in float32 (model pages). */
static Matrix transposed(Transformer *t, const Matrix *m) {
    float *w = model_pages(t, (size_t)m->rows * m->cols * sizeof(float)), *row = xcalloc((size_t)m->cols, sizeof(float));
    for (int i = 0; i < m->rows; i++) {
        matrix_row(row, m, i);
        for (int j = 0; j < m->cols; j++) w[(size_t)j * m->rows + i] = row[j];
    }
    free(row);
    return (Matrix){.w = w, .rows = m->cols, .cols = m->rows};
}

/* Multi-head latent attention's tensors (Config mla_rank): attn_q, or
   attn_q_a, attn_q_a_norm and attn_q_b (q_rank); attn_kv_a_mqa and
   attn_kv_a_norm; attn_output; and each head's wk_b and wv_b: the newer
   files' attn_k_b [mla_nope, mla_rank, heads] and attn_v_b [mla_rank,
   mla_value, heads] as they are, or the older files' attn_kv_b [mla_rank,
   heads x (mla_nope + mla_value)] split at load, a head's rows of k
   (mla_nope, mla_rank) transposed into float32 (wk_b multiplies the query,
   not the latent), its rows of v as they are. */
static void gguf_mla_layers(Transformer *t, const GGUF *g) {
    const Config *p = &t->config;
    Weights *w = &t->weights;
    const int L = p->n_layers, H = p->n_heads, dim = p->dim, R = p->mla_rank, nope = p->mla_nope, rope = p->rope_dims;
    const int q_width = H * (nope + rope);
    w->wk = xcalloc((size_t)L, sizeof(Matrix)); /* none: rows 0 */
    w->wv = xcalloc((size_t)L, sizeof(Matrix));
    if (p->q_rank > 0) {
        w->wq = xcalloc((size_t)L, sizeof(Matrix)); /* rows 0: q comes from q_a and q_b */
        w->wq_a = gguf_layer_matrices(t, g, "attn_q_a", p->q_rank, dim);
        w->wq_b = gguf_layer_matrices(t, g, "attn_q_b", q_width, p->q_rank);
        w->q_a_norm = gguf_layer_vectors(t, g, "attn_q_a_norm.weight", p->q_rank, 1);
    } else
        w->wq = gguf_layer_matrices(t, g, "attn_q", q_width, dim);
    w->wkv_a = gguf_layer_matrices(t, g, "attn_kv_a_mqa", R + rope, dim);
    w->kv_a_norm = gguf_layer_vectors(t, g, "attn_kv_a_norm.weight", R, 1);
    w->wo = gguf_layer_matrices(t, g, "attn_output", dim, H * p->mla_value);
    w->wk_b = xcalloc((size_t)L * H, sizeof(Matrix));
    w->wv_b = xcalloc((size_t)L * H, sizeof(Matrix));
    for (int l = 0; l < L; l++) {
        char name[64];
        snprintf(name, sizeof(name), "blk.%d.attn_kv_b.weight", l);
        if (p->mla_split) {
            gguf_stacked(t, g, l, "attn_k_b", R, nope, H, "heads", w->wk_b + (size_t)l * H);
            gguf_stacked(t, g, l, "attn_v_b", p->mla_value, R, H, "heads", w->wv_b + (size_t)l * H);
            continue;
        }
        const int per = nope + p->mla_value;
        const GGUFTensor *x = gguf_shaped(g, name, (uint64_t)R, (uint64_t)H * per, 1);
        for (int h = 0; h < H; h++) {
            GGUFTensor k = tensor_rows(x, (uint64_t)h * per, (uint64_t)nope), v = tensor_rows(x, (uint64_t)h * per + nope, (uint64_t)p->mla_value);
            const Matrix k_rows = gguf_matrix_of(t, g, &k, name, nope, R);
            w->wk_b[(size_t)l * H + h] = transposed(t, &k_rows);
            w->wv_b[(size_t)l * H + h] = gguf_matrix_of(t, g, &v, name, p->mla_value, R);
        }
    }
}

/* The FFNs of a model with experts: in each layer with a router
   (ffn_gate_inp), the experts' matrices and, where the file has one, a
   shared expert (ffn_*_shexp, gated by ffn_gate_inp_shexp where present)
   in w1, w3 and w2; in a layer without, a dense FFN there. */
static void gguf_moe_layers(Transformer *t, const GGUF *g) {
    const Config *p = &t->config;
    Weights *w = &t->weights;
    const int L = p->n_layers, E = p->n_experts, dim = p->dim, F = p->expert_hidden;
    w->router = xcalloc((size_t)L, sizeof(Matrix));
    w->e_gate = xcalloc((size_t)L * E, sizeof(Matrix));
    w->e_up = xcalloc((size_t)L * E, sizeof(Matrix));
    w->e_down = xcalloc((size_t)L * E, sizeof(Matrix));
    w->w1 = xcalloc((size_t)L, sizeof(Matrix));
    w->w2 = xcalloc((size_t)L, sizeof(Matrix));
    w->w3 = xcalloc((size_t)L, sizeof(Matrix));
    char name[64];
    int dense = 0, shared = 0; /* whether a layer reads a dense FFN, a shared expert */
    for (int l = 0; l < L; l++) {
        snprintf(name, sizeof(name), "blk.%d.ffn_gate_inp.weight", l);
        const char *ffn[3] = {"ffn_gate", "ffn_up", "ffn_down"};
        int width = p->hidden_dim;
        /* gpt-oss: a router in every layer, DeepSeek's past its leading dense ones (gguf_matrix names it if missing) */
        if (p->arch->mla ? l >= p->leading_dense : gguf_tensor(g, name) || p->arch->biases) {
            w->router[l] = gguf_matrix(t, g, name, E, dim);
            gguf_experts(t, g, l, "ffn_gate_exps", F, dim, w->e_gate + (size_t)l * E);
            gguf_experts(t, g, l, "ffn_up_exps", F, dim, w->e_up + (size_t)l * E);
            gguf_experts(t, g, l, "ffn_down_exps", dim, F, w->e_down + (size_t)l * E);
            snprintf(name, sizeof(name), "blk.%d.ffn_gate_shexp.weight", l);
            if (!gguf_tensor(g, name) && !p->arch->mla) continue; /* DeepSeek's are required */
            ffn[0] = "ffn_gate_shexp", ffn[1] = "ffn_up_shexp", ffn[2] = "ffn_down_shexp";
            width = p->shared_hidden;
            shared = 1;
        } else
            dense = 1;
        Matrix *out[3] = {&w->w1[l], &w->w3[l], &w->w2[l]};
        for (int i = 0; i < 3; i++) {
            snprintf(name, sizeof(name), "blk.%d.%s.weight", l, ffn[i]);
            *out[i] = i < 2 ? gguf_matrix(t, g, name, width, dim) : gguf_matrix(t, g, name, dim, width);
        }
    }
    /* a width no tensor has (Qwen3-MoE's feed_forward_length, with experts
       in every layer) is the experts' instead: the buffers are sized by
       the widths the layers read, not by a number the file's tensors do
       not bound */
    if (!dense) t->config.hidden_dim = F;
    if (!shared) t->config.shared_hidden = F;
    w->shared_gate = gguf_layer_vectors(t, g, "ffn_gate_inp_shexp.weight", dim, 0);
    if (p->arch->mla) w->select_bias = gguf_layer_vectors(t, g, "exp_probs_b.bias", E, 0); /* DeepSeek-V3's */
    if (p->arch->biases) { /* gpt-oss: the router's and each expert's biases */
        w->router_bias = gguf_layer_vectors(t, g, "ffn_gate_inp.bias", E, 1);
        w->e_gate_bias = gguf_layer_tables(t, g, "ffn_gate_exps.bias", F, E, 1);
        w->e_up_bias = gguf_layer_tables(t, g, "ffn_up_exps.bias", F, E, 1);
        w->e_down_bias = gguf_layer_tables(t, g, "ffn_down_exps.bias", dim, E, 1);
    }
}

/* The norm weights blk.N.<what>.weight of n floats of every layer, when
   the architecture has them (`has`), else NULL. */
static const float *gguf_layer_norms(Transformer *t, const GGUF *g, int has, const char *what, int n) {
    char name[40];
    snprintf(name, sizeof(name), "%s.weight", what);
    return has ? gguf_layer_vectors(t, g, name, n, 1) : NULL;
}

/* Reads the model of a parsed GGUF file into t. */
static void load_gguf_model(Transformer *t, const GGUF *g) {
    if (g->n_tensors == 0)
        die(EXIT_BAD_FILE, "%s: is a GGUF file with no tensors (a vocabulary only?): it serves `-m tokenize` or -z, not as a model; "
            GGUF_CONVERT_HINT, g->path);
    char *arch = gguf_string(g, "general.architecture");
    if (!arch) die(EXIT_BAD_FILE, "%s: GGUF metadata 'general.architecture' is missing", g->path);
    Config *p = &t->config;
    p->arch = gguf_arch(g, arch);
    gguf_config(p, g, arch);
    t->version = VERSION_GGUF;
    gguf_rope(t, g, arch);
    const Arch *a = p->arch;
    const int dim = p->dim, hidden = p->hidden_dim, qd = q_dim(p), kv_dim = kv_dim_of(p);
    Weights *w = &t->weights;
    w->token_embedding = gguf_embedding(t, g, p->vocab_size, dim);
    const char *qkv_names[] = {"attn_q", "attn_k", "attn_v"}, *up_names[] = {"ffn_gate", "ffn_up"};
    const int qkv_rows[] = {qd, kv_dim, kv_dim}, up_rows[] = {hidden, hidden};
    Matrix *qkv[3], *up[2];
    if (p->mla_rank > 0) {
        gguf_mla_layers(t, g);
    } else {
        gguf_layer_parts(t, g, a->fused ? "attn_qkv" : NULL, qkv_names, qkv_rows, 3, dim, qkv);
        w->wq = qkv[0], w->wk = qkv[1], w->wv = qkv[2];
        w->wo = gguf_layer_matrices(t, g, "attn_output", dim, qd);
    }
    if (p->n_experts > 0)
        gguf_moe_layers(t, g);
    else {
        gguf_layer_parts(t, g, a->fused ? "ffn_up" : NULL, up_names, up_rows, 2, dim, up);
        w->w1 = up[0], w->w3 = up[1];
        w->w2 = gguf_layer_matrices(t, g, "ffn_down", dim, hidden);
    }
    w->rms_att = gguf_layer_vectors(t, g, "attn_norm.weight", dim, 1);
    char ffn_norm[48];
    snprintf(ffn_norm, sizeof(ffn_norm), "%s.weight", a->ffn_norm); /* gpt-oss: post_attention_norm */
    w->rms_ffn = gguf_layer_vectors(t, g, ffn_norm, dim, 1);
    /* QK-norm head by head, or (OLMoE: its weights as wide as q) over the whole row */
    const GGUFTensor *q_norm = gguf_tensor(g, "blk.0.attn_q_norm.weight");
    p->qk_norm_whole = a->qk_norm && q_norm && q_norm->ne[0] == (uint64_t)qd && qd != p->head_size;
    w->q_norm = gguf_layer_norms(t, g, a->qk_norm, "attn_q_norm", p->qk_norm_whole ? qd : p->head_size);
    w->k_norm = gguf_layer_norms(t, g, a->qk_norm, "attn_k_norm", p->qk_norm_whole ? kv_dim : p->head_size);
    w->post_att = gguf_layer_norms(t, g, a->post_norms, "post_attention_norm", dim);
    w->post_ffn = gguf_layer_norms(t, g, a->post_norms, "post_ffw_norm", dim);
    float *final = model_pages(t, (size_t)dim * sizeof(float));
    gguf_vector(g, "output_norm.weight", final, dim, 1);
    w->rms_final = final;
    if (!a->mla) {
        w->bq = gguf_layer_vectors(t, g, "attn_q.bias", qd, 0);
        w->bk = gguf_layer_vectors(t, g, "attn_k.bias", kv_dim, 0);
        w->bv = gguf_layer_vectors(t, g, "attn_v.bias", kv_dim, 0);
    }
    w->bo = gguf_layer_vectors(t, g, "attn_output.bias", dim, a->biases);
    w->sinks = a->sinks ? gguf_layer_vectors(t, g, "attn_sinks.weight", p->n_heads, 1) : NULL;
    if (gguf_tensor(g, "output.weight")) w->wcls = gguf_matrix(t, g, "output.weight", p->vocab_size, dim);
    else if (w->token_embedding.blocks) w->wcls = gguf_matrix(t, g, "token_embd.weight", p->vocab_size, dim); /* tied: converted */
    else w->wcls = w->token_embedding; /* tied: both read in place */
    free(arch);
}

/* section 3: the matrices as the kernels read them, and their memory freed */
static void pack_weights(Transformer *t, void (*meanwhile)(Transformer *t, void *arg), void *arg);
static void populate_in_place(Transformer *t);
static void unpack_weights(Transformer *t);

static int is_gguf(const void *data, size_t size) { return size >= 4 && memcmp(data, "GGUF", 4) == 0; }

/* Loads a checkpoint: run.c's own formats (section 2) or GGUF (2.1, 2.2),
   told apart by their content; `meanwhile` (NULL: nothing) runs on one
   thread while the others pack the weights (pack_weights), once the file
   is parsed. */
static void load_checkpoint_while(Transformer *t, const char *path, void (*meanwhile)(Transformer *t, void *arg), void *arg) {
    memset(t, 0, sizeof(*t));
    t->mapping = map_file(path, &t->file_size, "checkpoint");
    if (is_gguf(t->mapping, t->file_size)) {
        t->gguf = xcalloc(1, sizeof(GGUF));
        parse_gguf(t->gguf, t->mapping, t->file_size, path);
        load_gguf_model(t, t->gguf);
    } else {
        FileCursor c = {t->mapping, t->file_size, 0, path};
        int shared = read_header(t, &c);
        map_weights(t, &c, shared);
        /* only now: a header's head size is bounded by the file once its weights fit */
        if (t->version == 4) t->rope_freq = rope_frequencies(&t->config);
    }
    pack_weights(t, meanwhile, arg);
    populate_in_place(t);
}

static void load_checkpoint(Transformer *t, const char *path) { load_checkpoint_while(t, path, NULL, NULL); }

static void free_transformer(Transformer *t) {
    Weights *w = &t->weights;
    free(t->rope_freq);
    free(t->rope_freq_local);
    free(t->rope_freq_other);
    unpack_weights(t);
    free(w->wq); free(w->wk); free(w->wv); free(w->wo);
    free(w->w1); free(w->w2); free(w->w3);
    free(w->router); free(w->e_gate); free(w->e_up); free(w->e_down);
    free(w->wq_a); free(w->wq_b); free(w->wkv_a); free(w->wk_b); free(w->wv_b);
    for (int i = 0; i < t->n_owned; i++) free_pages(t->owned[i].p, t->owned[i].bytes);
    free(t->owned);
    if (t->gguf) free_gguf(t->gguf);
    free(t->gguf);
    if (t->mapping) unmap(t->mapping, t->file_size);
    memset(t, 0, sizeof(*t));
}

/* ------------------------------------------------------------------------ */
/* 3. Kernels                                                               */
/* ------------------------------------------------------------------------ */

/* o = w * x / sqrt(mean(x^2) + eps), for one row of `size` values (eps is
   1e-5 but in version 4 checkpoints). */
static void rmsnorm(float *o, const float *x, const float *w, int size, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < size; j++) ss += x[j] * x[j];
    ss /= size;
    ss += eps;
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
   The vector kernels (AVX2, AVX-512, NEON) keep one vector accumulator per output,
   add the products of the next SIMD_WIDTH columns to it lane by lane, and add
   up its lanes at the end: the same order for every n, so a prompt read in
   blocks gives the same logits as one read token by token.

   int8 weights ("Q8_0", as llama2.c's runq.c): each input row is quantised in
   groups of group_size values, x ~ xq * xs with xs = max|x| / 127 and
   xq = round(x / xs) in -127..127; then, with exact integer sums per group g,
     out[b][i] = sum_g (sum_{j in g} wq[i][j] * xq[b][j]) * ws[i][g] * xs[b][g]
   4-bit weights (version 3): the same, with wq in -8..7 unpacked from nibbles.
   The VNNI kernels add each output's group terms one after the other (as
   the plain kernel does, with a fused multiply-add), whatever n is. */

/* Starts loading the `bytes` bytes at p into the cache ahead of their use,
   where the compiler offers it (GCC, Clang; inlined by force, as GCC drops
   the calls of a function that does nothing but prefetch): the vector
   kernels, and the tokenizer's table of merges as it is filled. */
#if defined(__GNUC__)
static inline __attribute__((always_inline, unused)) void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}
/* the same into the second-level cache only: for data needed well after
   the data now in use, which the first-level cache has too little room to
   hold beside it, and for the next block of a matrix's weights. Prefetched
   into the first level, each line held one of the core's few first-level
   fill buffers until it came, buffers the hardware's own prefetcher needs
   to stream from memory (Llama 3.2 1B shape, Q8_0, 2 threads, tok/s:
   17.2 into the first level, 20.4 into the second, 21.4 with none; the
   stories110M shape, weights in the third-level cache: 418, 425, 362) */
static inline __attribute__((always_inline)) void prefetch_far(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}
#else
static void prefetch(const void *p, size_t bytes) { (void)p; (void)bytes; }
static void prefetch_far(const void *p, size_t bytes) { (void)p; (void)bytes; }
#endif

/* A thread's scratch buffer, grown as needed and kept for the next call:
   `bytes` usable from base, 64-byte aligned (a cache line); malloc'ed with
   room to round up, as aligned_alloc is not everywhere (MinGW). */
typedef struct {
    void *raw;    /* as malloc returned it */
    void *base;   /* raw rounded up to 64 bytes */
    size_t bytes; /* usable from base */
} Scratch;

static void *scratch_grow(Scratch *s, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (bytes > s->bytes) {
        free(s->raw);
        s->raw = malloc(bytes + 64);
        if (!s->raw) die(EXIT_BAD_FILE, "out of memory (%zu bytes of scratch)", bytes);
        s->base = (void *)(((uintptr_t)s->raw + 63) & ~(uintptr_t)63);
        s->bytes = bytes;
    }
    return s->base;
}

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

/* The 4-bit value q in -8..7 at index `at` of a 4-bit matrix (row-major). */
static int q4_value(const Matrix *W, size_t at) {
    uint8_t pair = W->q4[at / 2];
    return (at % 2 ? pair >> 4 : pair & 15) - 8;
}

/* The weight at index `at` (row-major) of a float matrix: float32, or a
   16-bit float widened (exactly). */
static float float_weight(const Matrix *W, size_t at) {
    if (W->w) return W->w[at];
    return W->bf16 ? bf16_to_float(W->half[at]) : half_to_float(W->half[at]);
}

/* out = row `row` of W in float32: quantised values times their group's
   scale, plus its offset where W has them (a row of blocks unpacked as
   section 2.2 unpacks them: the values a converted copy would give). */
static void matrix_row(float *out, const Matrix *W, int row) {
    size_t at = (size_t)row * W->cols;
    if (W->blocks) {
        const GGMLType *type = &ggml_types[W->block_type];
        const uint8_t *block = W->blocks + at / type->block * type->block_bytes;
        for (int j0 = 0; j0 < W->cols; j0 += type->block, block += type->block_bytes) {
            int8_t q[256];
            float s[16], o[16];
            block_values(type, block, q, s, o);
            for (int j = 0; j < type->block; j++) {
                out[j0 + j] = q[j] * s[j / type->group];
                if (type->offsets) out[j0 + j] += o[j / type->group];
            }
        }
        return;
    }
    if (W->group_size == 0) {
        for (int j = 0; j < W->cols; j++) out[j] = float_weight(W, at + j);
        return;
    }
    if (W->q4) {
        for (int j = 0; j < W->cols; j++) out[j] = q4_value(W, at + j) * group_scale(W, (at + j) / W->group_size);
    } else {
        for (int j = 0; j < W->cols; j++) out[j] = W->q[at + j] * group_scale(W, (at + j) / W->group_size);
    }
    if (W->offsets)
        for (int j = 0; j < W->cols; j++) out[j] += W->offsets[(size_t)(j / W->group_size) * W->rows + row];
}

/* Plain C, float32: each output summed left to right (16-bit weights
   widened one at a time). */
static void matmul_f32_plain(float *out, const float *x, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int i = 0; i < rows; i++) {
        const float *w = W->w ? W->w + (size_t)i * cols : NULL;
        for (int b = 0; b < n; b++) {
            const float *xr = x + (size_t)b * cols;
            float val = 0.0f;
            if (w)
                for (int j = 0; j < cols; j++) val += w[j] * xr[j];
            else
                for (int j = 0; j < cols; j++) val += float_weight(W, (size_t)i * cols + j) * xr[j];
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

/* Plain C, 4-bit: as matmul_q8_plain, with each byte's two values. */
static void matmul_q4_plain(float *out, const int16_t *xq, const float *xs, const Matrix *W, int n) {
    const int rows = W->rows, cols = W->cols, gs = W->group_size, groups = cols / gs;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n))
    for (int i = 0; i < rows; i++) {
        const uint8_t *w = W->q4 + (size_t)i * cols / 2;
        for (int b = 0; b < n; b++) {
            const int16_t *q = xq + (size_t)b * cols;
            float val = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t ival = 0;
                for (int j = g * gs; j < (g + 1) * gs; j += 2)
                    ival += ((w[j / 2] & 15) - 8) * q[j] + ((w[j / 2] >> 4) - 8) * q[j + 1];
                val += (float)ival * group_scale(W, (size_t)i * groups + g) * xs[(size_t)b * groups + g];
            }
            out[(size_t)b * rows + i] = val;
        }
    }
}

/* Vector types and operations, when the compiler targets AVX-512, AVX2 or
   (asked for with RUN_SIMD) NEON: vfloat holds SIMD_WIDTH floats; vint
   SIMD_WIDTH int32, or twice as many int16, or four times as many bytes. The kernels below use only these
   operations, so that another instruction set needs only its own version of
   this list. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define KERNEL_NAME "AVX-512 VNNI, BF16 dot products"
#elif defined(__AVX512VNNI__)
#define KERNEL_NAME "AVX-512 VNNI"
#else
#define KERNEL_NAME "AVX-512"
#endif
#define SIMD_WIDTH 16
typedef __m512 vfloat;
typedef __m512i vint;
static inline vfloat vf_zero(void) { return _mm512_setzero_ps(); }
static inline vfloat vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vfloat vf_set(float v) { return _mm512_set1_ps(v); }
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
/* to the nearest whole number (ties to even); 2^n of whole numbers n in -126..127 */
static inline vfloat vf_round(vfloat v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vfloat vf_div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
/* m, or |v| where it is larger: a NaN in v is passed over */
static inline vfloat vf_amax(vfloat m, vfloat v) { return _mm512_max_ps(_mm512_abs_ps(v), m); }
/* to the nearest whole number, ties away from zero (roundf): v - trunc(v)
   is exact, so a fraction of at least a half rounds up in magnitude */
static inline vfloat vf_round_away(vfloat v) {
    vfloat t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512i one = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)), _mm512_castps_si512(_mm512_set1_ps(1.0f)));
    return _mm512_mask_add_ps(t, up, t, _mm512_castsi512_ps(one));
}
static inline vfloat vf_pow2(vfloat n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* The sum of the lanes, as a tree: v[k] + v[k+8], then + the lanes 4 on,
   then 2 on, then 1 on. */
static inline float vf_sum(vfloat v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
/* Lane q = vf_sum(v[q]) for 16 vectors, with the same additions of the same
   pairs (a + b = b + a exactly), but 15 vector additions for all of them. */
static inline vfloat vf_sums(const vfloat *v) {
    vfloat s8[8], s4[4], s2[2];
    for (int q = 0; q < 8; q++) /* lanes 0..7: v[2q][k] + v[2q][k+8]; 8..15: v[2q+1] */
        s8[q] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * q], v[2 * q + 1], 0x44), _mm512_shuffle_f32x4(v[2 * q], v[2 * q + 1], 0xEE));
    for (int q = 0; q < 4; q++) /* 128-bit block m: vector 4q + m, its sums 4 apart */
        s4[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * q], s8[2 * q + 1], 0x88), _mm512_shuffle_f32x4(s8[2 * q], s8[2 * q + 1], 0xDD));
    for (int q = 0; q < 2; q++) /* block m: sums 2 apart of vectors 8q + m, 8q + 4 + m */
        s2[q] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * q], s4[2 * q + 1], 0x44), _mm512_shuffle_ps(s4[2 * q], s4[2 * q + 1], 0xEE));
    /* block m: the sums of vectors m, 4 + m, 8 + m, 12 + m; put back in order */
    vfloat s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s1);
}
static inline vfloat vi_to_float(vint v) { return _mm512_cvtepi32_ps(v); }
/* SIMD_WIDTH half-precision values, or int8 values times a scale, as floats
   (the key/value cache's f16 and q8_0 types) */
#define VF_CACHE_LOADS 1
static inline vfloat vf_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* SIMD_WIDTH bfloat16 values as floats: each the top half of its float */
#define VF_HALF_LOADS 1
static inline vfloat vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vfloat vf_load_i8_scaled(const int8_t *p, float scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), _mm512_set1_ps(scale));
}
#ifdef __AVX512BF16__
/* bfloat16 matrices by vdpbf16ps (KERNEL_BF16_DOT): a vector of 32
   bfloat16 weights w times 32 bfloat16 inputs x, lane k adding the
   products of columns 2k and 2k + 1 to acc (in float32, as the
   instruction rounds: to nearest even, bfloat16 subnormals as zero); the
   inputs rounded to bfloat16 (to nearest even) once per matmul, two
   vectors of floats to one of 32 values (lo the first 16) */
#define BF16_DOT 1
static inline vfloat vf_dot_bf16(vfloat acc, vfloat w, vfloat x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
static inline vfloat vf_bf16_pairs(vfloat lo, vfloat hi) { return (vfloat)_mm512_cvtne2ps_pbh(hi, lo); }
/* bfloat16 matrices in 12 bits (BF16_SPLIT; the layout: section 3): the
   128 weights of a unit as 4 vectors of 32 bfloat16, in column order. A
   value's high byte is its code's entry in the table (vpshufb looks up 16
   entries in each 128-bit lane), its low byte stored as it is; vpunpcklbw
   and vpunpckhbw then interleave 8 low bytes with 8 high bytes in each
   lane, which is why the low bytes are stored in that order. */
#define BF16_SPLIT 1
static inline vint vi_split_table(const uint8_t *table) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table)); }
static inline void vf_split_unit(vfloat w[4], const uint8_t *unit, vint table) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), codes = _mm512_loadu_si512(unit + 128);
    const __m512i lo0 = _mm512_loadu_si512(unit), lo1 = _mm512_loadu_si512(unit + 64);
    const __m512i hi0 = _mm512_shuffle_epi8(table, _mm512_and_si512(codes, nibble));
    const __m512i hi1 = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble));
    w[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi8(lo0, hi0));
    w[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi8(lo0, hi0));
    w[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi8(lo1, hi1));
    w[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi8(lo1, hi1));
}
/* The inverse, for packing: the 128 bfloat16 values at v as a unit (the
   first match in the table gives a high byte its code; vpackuswb, low
   bytes and high bytes alike, makes the order vf_split_unit undoes).
   Returns, for each half, a mask of the bytes whose high byte is not in
   the table (stored as zero): bit p of miss[h] is byte p of half h. */
static inline void split_encode_unit(uint8_t *unit, const uint16_t *v, const uint8_t *table, uint64_t miss[2]) {
    __m512i codes[2];
    for (int h = 0; h < 2; h++) {
        const __m512i a = _mm512_loadu_si512(v + 64 * h), b = _mm512_loadu_si512(v + 64 * h + 32), low = _mm512_set1_epi16(0xFF);
        const __m512i lo = _mm512_packus_epi16(_mm512_and_si512(a, low), _mm512_and_si512(b, low));
        const __m512i hi = _mm512_packus_epi16(_mm512_srli_epi16(a, 8), _mm512_srli_epi16(b, 8));
        __mmask64 found = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)table[0]));
        codes[h] = _mm512_setzero_si512();
        for (int k = 1; k < 16; k++) {
            const __mmask64 is = _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)table[k])) & ~found;
            codes[h] = _mm512_mask_mov_epi8(codes[h], is, _mm512_set1_epi8((char)k));
            found |= is;
        }
        miss[h] = ~(uint64_t)found;
        _mm512_storeu_si512(unit + 64 * h, _mm512_maskz_mov_epi8(found, lo));
    }
    _mm512_storeu_si512(unit + 128, _mm512_or_si512(codes[0], _mm512_slli_epi16(codes[1], 4)));
}
/* How many of the 64 bfloat16 values at v have a high byte that is not in
   the table. */
static inline int split_misses(const uint16_t *v, const uint8_t *table) {
    const __m512i hi = _mm512_packus_epi16(_mm512_srli_epi16(_mm512_loadu_si512(v), 8), _mm512_srli_epi16(_mm512_loadu_si512(v + 32), 8));
    __mmask64 found = 0;
    for (int k = 0; k < 16; k++) found |= _mm512_cmpeq_epi8_mask(hi, _mm512_set1_epi8((char)table[k]));
    return 64 - __builtin_popcountll(found);
}
#endif
#ifndef __AVX512VNNI__
static inline vint vi_zero(void) { return _mm512_setzero_si512(); }
static inline vint vi_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vint vi_load_i16(const int16_t *p) { return _mm512_loadu_si512(p); }
/* int32 lane k += a[2k] * b[2k] + a[2k+1] * b[2k+1] (int16 a, b) */
static inline vint vi_dot(vint acc, vint a, vint b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#else
#define VNNI 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KERNEL_NAME "AVX2"
#define SIMD_WIDTH 8
typedef __m256 vfloat;
typedef __m256i vint;
static inline vfloat vf_zero(void) { return _mm256_setzero_ps(); }
static inline vfloat vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vfloat vf_set(float v) { return _mm256_set1_ps(v); }
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vf_add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vfloat vf_round(vfloat v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vfloat vf_div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
static inline vfloat vf_amax(vfloat m, vfloat v) { return _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), m); }
static inline vfloat vf_round_away(vfloat v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    return _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(v, sign), _mm256_set1_ps(1.0f))));
}
static inline vfloat vf_pow2(vfloat n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
/* as a tree: v[k] + v[k+4], then + the lanes 2 on, then 1 on */
static inline float vf_sum(vfloat v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* lane q = vf_sum(v[q]) for 8 vectors, the same additions */
static inline vfloat vf_sums(const vfloat *v) {
    vfloat s4[4], s2[2];
    for (int q = 0; q < 4; q++) /* lanes 0..3: v[2q][k] + v[2q][k+4]; 4..7: v[2q+1] */
        s4[q] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * q], v[2 * q + 1], 0x20), _mm256_permute2f128_ps(v[2 * q], v[2 * q + 1], 0x31));
    for (int q = 0; q < 2; q++) /* 128-bit half m: vectors 4q + m, 4q + 2 + m, sums 2 apart */
        s2[q] = _mm256_add_ps(_mm256_shuffle_ps(s4[2 * q], s4[2 * q + 1], 0x44), _mm256_shuffle_ps(s4[2 * q], s4[2 * q + 1], 0xEE));
    /* half m: the sums of vectors m, 2 + m, 4 + m, 6 + m; put back in order */
    vfloat s1 = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
    return _mm256_permutevar8x32_ps(s1, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline vint vi_zero(void) { return _mm256_setzero_si256(); }
static inline vint vi_load_i8(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vint vi_load_i16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vfloat vi_to_float(vint v) { return _mm256_cvtepi32_ps(v); }
static inline vint vi_dot(vint acc, vint a, vint b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#ifdef __F16C__
#define VF_CACHE_LOADS 1
static inline vfloat vf_load_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#define VF_HALF_LOADS 1
/* 8 bfloat16 values as floats: the 16 bytes in both halves of a vector (a
   load), then one byte shuffle puts values 0-3 (low half) and 4-7 (high
   half) into the top of their lanes and zeros below: one shuffling
   operation where widening then shifting took two, both on the ports the
   multiply-adds share on Zen 3 (4 x 3 blocks of 1B-shape rows, one Zen 3
   core: 62-72 -> 79-83 GFLOP/s; docs/speed.md, "bfloat16 widened by one
   shuffle"). */
static inline vfloat vf_load_bf16(const uint16_t *p) {
    const __m256i tops = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7, /* (-1: a zero byte) */
                                          -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)), tops));
}
static inline vfloat vf_load_i8_scaled(const int8_t *p, float scale) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))), _mm256_set1_ps(scale));
}
#endif
#elif defined(RUN_SIMD) && defined(__aarch64__) && defined(__ARM_NEON)
/* NEON, on every aarch64 CPU, so a build takes it only when asked (RUN_SIMD,
   as `make runfast` and `make runomp` do): `make run` stays plain C. 32
   vector registers of 4 floats. int8 dot products either with the sdot
   instruction (ARMv8.2 dotprod: 4 products per int32 lane) or by int16
   multiplies whose pairs are added into int32 lanes. */
#include <arm_neon.h>
#define SIMD_NEON 1
#define SIMD_WIDTH 4
typedef float32x4_t vfloat;
typedef int32x4_t vint; /* also 16 int8 or 8 int16, reinterpreted */
static inline vfloat vf_zero(void) { return vdupq_n_f32(0.0f); }
static inline vfloat vf_load(const float *p) { return vld1q_f32(p); }
static inline void vf_store(float *p, vfloat v) { vst1q_f32(p, v); }
static inline vfloat vf_set(float v) { return vdupq_n_f32(v); }
static inline vfloat vf_fma(vfloat a, vfloat b, vfloat c) { return vfmaq_f32(c, a, b); }
static inline vfloat vf_add(vfloat a, vfloat b) { return vaddq_f32(a, b); }
static inline vfloat vf_mul(vfloat a, vfloat b) { return vmulq_f32(a, b); }
static inline vfloat vf_max(vfloat a, vfloat b) { return vmaxq_f32(a, b); }
static inline vfloat vf_round(vfloat v) { return vrndnq_f32(v); }
static inline vfloat vf_div(vfloat a, vfloat b) { return vdivq_f32(a, b); }
static inline vfloat vf_amax(vfloat m, vfloat v) { return vmaxnmq_f32(vabsq_f32(v), m); }
static inline vfloat vf_round_away(vfloat v) { return vrndaq_f32(v); }
static inline vfloat vf_pow2(vfloat n) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23)); }
static inline float vf_sum(vfloat v) { return vaddvq_f32(v); }
/* lane q = vf_sum(v[q]) for 4 vectors: the same instruction for each */
static inline vfloat vf_sums(const vfloat *v) {
    float s[4] = {vf_sum(v[0]), vf_sum(v[1]), vf_sum(v[2]), vf_sum(v[3])};
    return vld1q_f32(s);
}
static inline vint vi_zero(void) { return vdupq_n_s32(0); }
static inline vfloat vi_to_float(vint v) { return vcvtq_f32_s32(v); }
/* SIMD_WIDTH half-precision or bfloat16 values as floats (GGUF F16, BF16) */
#define VF_HALF_LOADS 1
static inline vfloat vf_load_half(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline vfloat vf_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
#ifdef __ARM_FEATURE_DOTPROD
#define KERNEL_NAME "NEON dotprod"
/* 16 columns per vi_dot: the quantised inputs (in -127..127) narrowed to
   int8, exactly */
#define VI_COLS 16
static inline vint vi_load_i8(const int8_t *p) { return vreinterpretq_s32_s8(vld1q_s8(p)); }
static inline vint vi_load_i16(const int16_t *p) {
    return vreinterpretq_s32_s8(vcombine_s8(vmovn_s16(vld1q_s16(p)), vmovn_s16(vld1q_s16(p + 8))));
}
/* int32 lane k += a[4k] * b[4k] + ... + a[4k+3] * b[4k+3] (int8 a, b) */
static inline vint vi_dot(vint acc, vint a, vint b) {
    return vdotq_s32(acc, vreinterpretq_s8_s32(a), vreinterpretq_s8_s32(b));
}
#else
#define KERNEL_NAME "NEON"
static inline vint vi_load_i8(const int8_t *p) { return vreinterpretq_s32_s16(vmovl_s8(vld1_s8(p))); }
static inline vint vi_load_i16(const int16_t *p) { return vreinterpretq_s32_s16(vld1q_s16(p)); }
/* int32 lane k += a[2k] * b[2k] + a[2k+1] * b[2k+1] (int16 a, b): each
   product of an int8 weight and an input in -127..127 fits in int16 */
static inline vint vi_dot(vint acc, vint a, vint b) {
    return vpadalq_s16(acc, vmulq_s16(vreinterpretq_s16_s32(a), vreinterpretq_s16_s32(b)));
}
#endif
#else
#define KERNEL_NAME "plain C"
#endif
/* Builds whose kernels read GGUF blocks packed at load (section 3's packed
   weights): VNNI ones; AVX2 ones without VNNI (x86 machines before
   AVX-512, and AVX-512 ones without VNNI), by vpmaddubsw (packed_q8 in its
   AVX2 form; F16C for the f16 scales); NEON ones with dotprod, by sdot. */
#if !defined(VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PACKED_AVX2 1
#endif
#if defined(SIMD_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define PACKED_NEON 1
#endif
#if defined(VNNI) || defined(PACKED_AVX2) || defined(PACKED_NEON)
#define PACKED_Q 1
#endif

/* ---- Packed weights --------------------------------------------------------
   VNNI builds lay out each int8 or 4-bit matrix as packed_q8 reads it when
   the checkpoint is loaded (pack_matrices, after the matrix multiplications):
   blocks of PACK_ROWS rows; AVX2 and NEON dotprod builds (PACKED_AVX2,
   PACKED_NEON) the GGUF matrices, in the same layout. */
#define PACK_ROWS 16
/* BF16_SPLIT builds (AVX-512 with BF16) also pack bfloat16 matrices, in 12
   bits a weight: decoding reads every weight once a token, so three
   quarters of the bytes is three quarters of the time where memory is the
   limit. A bfloat16's high byte (its sign and top 7 exponent bits) takes
   few values in a matrix of weights, its low byte (the last exponent bit
   and the mantissa) any; so the low byte is kept and the high byte becomes
   a 4-bit code, the matrix's table of 16 naming the high byte of each:
   0x00, and the 15 most frequent others (split_plan). A value whose high
   byte is not in the table (about 2 in 10,000 of normally distributed
   weights: the smallest, 2^14 below the largest) is stored as zero and
   kept apart, exactly, as an exception that the kernel adds after the
   block's dot products (add_exceptions); a matrix with more than
   1 in SPLIT_EXCEPTIONS_MAX of them stays as stored. Blocks of SPLIT_ROWS
   rows, each one stream of units: a unit is SPLIT_COLS columns of a row,
   SPLIT_UNIT_BYTES bytes (the low bytes of columns 0..63, of 64..127, then
   64 bytes of codes, the first half's in low nibbles), the block's rows
   unit by unit: rows read side by side from one place, which the hardware
   prefetchers follow at the full speed of memory (rows read as separate
   streams ran at 70% of it). Decoding Llama 3.2 1B-shape BF16 on a Zen 4
   machine, 2 threads, 9 alternating rounds: 13.9 -> 21.5 tok/s (1.25x);
   the stories110M shape 128 -> 179 (1.42x); a 128-token prompt pays for
   the unpacking (matmul_split_block): 0.94x. */
#define SPLIT_ROWS 6
#define SPLIT_COLS 128
#define SPLIT_UNIT_BYTES 192
#define SPLIT_BITS 12
#define SPLIT_EXCEPTIONS_MAX 256

/* The rows of a packed block of W. */
static int packed_rows(const Matrix *W) { return W->packed_bits == SPLIT_BITS ? SPLIT_ROWS : PACK_ROWS; }

static size_t packed_block_bytes(const Matrix *W) {
    if (W->packed_bits == SPLIT_BITS) return (size_t)SPLIT_ROWS * (size_t)W->cols / SPLIT_COLS * SPLIT_UNIT_BYTES;
    const size_t cols = W->packed_bits == 4 ? ((size_t)W->cols + 7) / 8 * 8 : (size_t)W->cols; /* 4 bits: whole units of 8 */
    return (size_t)PACK_ROWS * cols * (size_t)W->packed_bits / 8;
}
#define SIX_BIT_COLS 16 /* the columns of a run of 5- or 6-bit values (packed_weights) */

/* A block's scales, in one of four forms (pack_matrices picks the smallest
   that holds every scale exactly):
     SCALES_F32     float32 (groups, PACK_ROWS)
     SCALES_F16     f16 (groups, PACK_ROWS): the GGUF types of one scale
                    per block (Q8_0, Q4_0, ...), whose d is f16
     SCALES_SHARED  int8 k (groups, PACK_ROWS), then f16 d (groups /
                    scale_run, PACK_ROWS): scale = k * d, the K-quants'
                    sub-block scale times their block's d
     SCALES_E8M0    uint8 e (groups, PACK_ROWS): scale = 2^(e - 128),
                    MXFP4's, widened as 2^(h - 64) x 2^(e - h - 64), h =
                    e / 2: two normal floats made from their exponent
                    bits, whose product is exact for every e (2^-128
                    and 2^-127 subnormal)
   Q4_K's values and scales then take 0.54 bytes a weight instead of
   0.625, Q6_K's (as 6 bits) 0.82, MXFP4's 0.53, the file's.
   Then, for the types with a minimum, the block's offsets, in one of two
   forms:
     OFFSETS_F32    float32 (groups, PACK_ROWS)
     OFFSETS_MIN    uint8 m (groups, PACK_ROWS), then f16 dmin (groups /
                    scale_run, PACK_ROWS): offset = centre x scale - dmin x
                    m, computed as the K-quants' unpack computes it (Q4_K,
                    Q5_K: their 6-bit minimums and their block's dmin)
   so that a Q4_K block of 16 rows is 2368 bytes against the file's 2304. */
enum { SCALES_F32, SCALES_F16, SCALES_SHARED, SCALES_E8M0 };
enum { OFFSETS_NONE, OFFSETS_F32, OFFSETS_MIN };

/* The bytes of a block's scales alone. */
static size_t scale_part_bytes(const Matrix *W) {
    const size_t groups = (size_t)(W->cols / W->group_size);
    if (W->scale_form == SCALES_F32) return groups * PACK_ROWS * sizeof(float);
    if (W->scale_form == SCALES_F16) return groups * PACK_ROWS * sizeof(uint16_t);
    if (W->scale_form == SCALES_E8M0) return groups * PACK_ROWS;
    return groups * PACK_ROWS + groups / (size_t)W->scale_run * PACK_ROWS * sizeof(uint16_t);
}

/* The bytes of a block's scales and offsets. */
static size_t packed_scale_bytes(const Matrix *W) {
    const size_t groups = (size_t)(W->cols / W->group_size), bytes = scale_part_bytes(W);
    if (W->offset_form == OFFSETS_F32) return bytes + groups * PACK_ROWS * sizeof(float);
    if (W->offset_form == OFFSETS_MIN) return bytes + groups * PACK_ROWS + groups / (size_t)W->scale_run * PACK_ROWS * sizeof(uint16_t);
    return bytes;
}

/* Whether this build may pack W in 12 bits (split_plan decides). */
static int split_candidate(const Matrix *W) {
#ifdef BF16_SPLIT
    return W->half && W->bf16 && W->cols % SPLIT_COLS == 0;
#else
    (void)W;
    return 0;
#endif
}

/* AVX2 builds: the columns of a unit of packed values of `bits` bits, a
   constant that packed_q8 unrolls (16 for 6 bits, 32 for the others); a
   group is whole units. */
#define AVX2_GROUP(bits) ((bits) == 6 ? 16 : 32)

/* Whether this build packs matrices whose groups (of one scale) are
   `group` columns: VNNI builds a multiple of 4; AVX2 ones whole units of
   every width the values may pack as (AVX2_GROUP: a multiple of 32); NEON
   dotprod ones whole runs of SIX_BIT_COLS columns. */
static int packs_groups(int group) {
#if defined(VNNI)
    return group % 4 == 0;
#elif defined(PACKED_AVX2)
    return group % 32 == 0;
#elif defined(PACKED_Q)
    return group % SIX_BIT_COLS == 0;
#else
    (void)group;
    return 0;
#endif
}

/* Whether this build packs GGUF matrices of this block type straight
   from their blocks (gguf_matrix leaves them as stored): every type's
   groups are whole units (AVX2: Q6_K's 16 columns are one unit of 6 bits). */
static int packs_blocks(const GGMLType *type) {
#if defined(PACKED_AVX2)
    return type->group % AVX2_GROUP(type->value_bits) == 0;
#else
    return packs_groups(type->group);
#endif
}

/* Whether this build packs W (bfloat16: once split_plan chose to): a GGUF
   matrix by its block type, an int8 or 4-bit one of the project's own
   checkpoints (versions 2 and 3) by its group size, so that the same
   weights take the same kernel whichever file they came in. */
static int matrix_packs(const Matrix *W) {
    if (W->packed_bits == SPLIT_BITS) return 1;
    if (W->blocks) return packs_blocks(&ggml_types[W->block_type]);
    return W->group_size > 0 && packs_groups(W->group_size);
}

#ifdef SIMD_WIDTH
/* The int8 columns one vi_dot consumes (without VNNI): vi_load_i8 and
   vi_load_i16 load VI_COLS values, and vi_dot adds to int32 lane k the
   products of columns k * c .. k * c + c - 1 (c = VI_COLS / SIMD_WIDTH),
   exactly. */
#ifndef VI_COLS
#define VI_COLS (2 * SIMD_WIDTH)
#endif
/* Register blocks: the n = 1 kernels compute MM_ROWS weight rows at a time
   (few accumulators, as decoding is bound by reading the weights); with
   more input rows, a block is MB_ROWS weight rows times MB_INPUTS input
   rows, as many accumulators as the registers hold next to the inputs (32
   vector registers with AVX-512, 16 with AVX2), so that each loaded vector
   feeds several multiply-adds and the arithmetic units, not the loads, are
   the limit. */
#define MM_ROWS 4
#if SIMD_WIDTH == 16
#define MB_ROWS 6
#define MB_INPUTS 4
#define QB_ROWS 4 /* without VNNI (VNNI builds: packed_q8) */
#define QB_INPUTS 2
#elif SIMD_WIDTH == 4 /* NEON: 32 registers of 4 floats */
#define MB_ROWS 4
#define MB_INPUTS 4
#define QB_ROWS 4
#define QB_INPUTS 2
#else /* AVX2: 16 registers of 8 floats; 4 x 3 accumulators (4 x 2 left two
         multiply-adds' latencies uncovered: float32 rows of a stories110M
         layer on one Zen 3 core, 63 -> 81 GFLOP/s of its 104) */
#define MB_ROWS 4
#define MB_INPUTS 3
#define QB_ROWS 4
#define QB_INPUTS 1
#endif
/* float32 blocks of many rows are taken in slices of at most F32_SLICE
   columns, each over F32_SLAB passes of input rows before the next slice
   (block_f32 carries the lane sums between slices): a slice of MB_ROWS
   weight rows (24 KB with AVX-512) then stays in the first-level cache
   beside the inputs while every pass reads it, and the passes' inputs in
   the second-level cache. Whole rows of 2048 columns (w2 of stories110M)
   did not: 128 rows times w2 ran at 167-174 GFLOP/s on one Zen 5 core, in
   slices at 187-190 (its peak: 277). 16-bit weights (F16 widened, BF16)
   are taken whole: their rows are half the bytes, and on a Zen 4 machine
   slices of 1024 cost 1B-shape 128-token prompts 16% (F16 82 -> 96 tok/s,
   BF16 144 -> 164 whole) and stories110M-shape BF16 ones 18%. (AVX2
   builds take them in chunks of rows instead: matmul_chunk.) */
#define F32_SLICE 1024
#define F32_SLAB 8
/* the largest block: the size of the kernels' accumulator arrays */
#define MB_MAX 6
#define MB_MAX_INPUTS 4
/* Always inlined, so that NR and NB are constants in every copy: the loops
   over rows and inputs unroll and the accumulators live in registers. */
#define KERNEL static inline __attribute__((always_inline))

/* How block_f32 loads weights: float32, or 16-bit floats widened; or
   (DOT_BF16) bfloat16 kept as it is, 2 x SIMD_WIDTH of them a vector, for
   vf_dot_bf16 with inputs in bfloat16. */
enum { LOAD_F32, LOAD_F16, LOAD_BF16, DOT_BF16 };

/* SIMD_WIDTH weights from column j of a row at w, as floats: float32, or
   F16/BF16 widened (builds with VF_HALF_LOADS); DOT_BF16: 2 x SIMD_WIDTH
   bfloat16 as they are. */
KERNEL vfloat vf_load_weights(const void *w, int j, const int kind) {
#ifdef VF_HALF_LOADS
    if (kind == LOAD_F16) return vf_load_half((const uint16_t *)w + j);
    if (kind == LOAD_BF16) return vf_load_bf16((const uint16_t *)w + j);
#endif
    if (kind == DOT_BF16) return vf_load((const float *)((const uint16_t *)w + j));
    return vf_load((const float *)w + j);
}

/* acc + the products of weights w and inputs x as `kind` loads them. */
KERNEL vfloat weight_products(vfloat acc, vfloat w, vfloat x, const int kind) {
#ifdef BF16_DOT
    if (kind == DOT_BF16) return vf_dot_bf16(acc, w, x);
#endif
    (void)kind;
    return vf_fma(w, x, acc);
}

/* out[b * stride + r] = the lanes of acc[r * NB + b] added up (vf_sum),
   for the n_rows x n_in results a block keeps; SIMD_WIDTH of them at a time
   with vf_sums, which adds the same pairs. */
KERNEL void store_sums(float *out, size_t stride, const vfloat *acc, int n_rows, int n_in, const int NR, const int NB) {
    if (NR * NB < SIMD_WIDTH) {
        for (int r = 0; r < n_rows; r++)
            for (int b = 0; b < NB && b < n_in; b++) out[b * stride + r] = vf_sum(acc[r * NB + b]);
        return;
    }
    for (int first = 0; first < NR * NB; first += SIMD_WIDTH) {
        vfloat v[SIMD_WIDTH];
        float sums[SIMD_WIDTH];
        for (int q = 0; q < SIMD_WIDTH; q++) v[q] = first + q < NR * NB ? acc[first + q] : vf_zero();
        vf_store(sums, vf_sums(v));
        for (int q = 0; q < SIMD_WIDTH && first + q < NR * NB; q++) {
            int r = (first + q) / NB, b = (first + q) % NB;
            if (r < n_rows && b < n_in) out[b * stride + r] = sums[q];
        }
    }
}

/* out[b * stride + r] = W_r . x_b for NR rows of W from w (the last one
   repeated when only n_rows remain), `cols` columns of rows `ld` apart, and
   NB input rows packed in xp: the SIMD_WIDTH values of columns j.. of input
   b at xp[j * NB + b * SIMD_WIDTH] (one input row as it is, for NB = 1);
   cols is a multiple of SIMD_WIDTH. A slice of the columns (F32_SLICE)
   starts from the lane sums `from` (NULL: zero) and, but for the last
   slice, leaves them in `to` instead of adding them up (NULL: into out), so
   that every lane adds the same products in the same order as one pass over
   whole rows. A block reads NR short streams of weights (a row of int8 is
   about a kilobyte), too short for the hardware prefetchers to follow: the
   kernels prefetch `next`, the next block of rows (NULL: none), as many
   bytes at a time as they read. The weights are float32, or 16-bit floats
   (`kind`) widened as they are loaded: the same products in the same order
   as the float32 matrix they widen to; or bfloat16 by vf_dot_bf16 (inputs
   in bfloat16 as xp lays out floats, a pair of them to a float: twice the
   columns a vector). */
KERNEL void block_f32(float *out, size_t stride, const void *w, size_t ld, int n_rows, const void *next, int share, const float *xp,
                      int n_in, int cols, const vfloat *from, vfloat *to, const int NR, const int NB, const int kind) {
    const size_t size = kind == LOAD_F32 ? sizeof(float) : sizeof(uint16_t);
    const int pack = kind == DOT_BF16 ? 2 : 1, step = pack * SIMD_WIDTH; /* input columns a float of xp; columns a step */
    const char *wr[MB_MAX];
    vfloat acc[MB_MAX * MB_MAX_INPUTS]; /* acc[r * NB + b] */
    for (int r = 0; r < NR; r++) wr[r] = (const char *)w + (size_t)(r < n_rows ? r : n_rows - 1) * ld * size;
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < NB; b++) acc[r * NB + b] = from ? from[r * NB + b] : vf_zero();
    const size_t ahead = (size_t)NR * step * size / (size_t)share; /* bytes of `next` prefetched a step */
    for (int j = 0; j < cols; j += step) {
        vfloat xv[MB_MAX_INPUTS];
        for (int b = 0; b < NB; b++) xv[b] = vf_load(xp + (size_t)(j / pack) * NB + b * SIMD_WIDTH);
        if (next) prefetch_far((const char *)next + (size_t)(j / step) * ahead, ahead);
        for (int r = 0; r < NR; r++) {
            vfloat wv = vf_load_weights(wr[r], j, kind);
            for (int b = 0; b < NB; b++) acc[r * NB + b] = weight_products(acc[r * NB + b], wv, xv[b], kind);
        }
    }
    if (to)
        for (int k = 0; k < NR * NB; k++) to[k] = acc[k];
    else store_sums(out, stride, acc, n_rows, n_in, NR, NB);
}

#ifdef PACKED_Q
/* Where the scales and offsets of a packed block lie (its scales at ws),
   found once for its group loop: scale_run is a power of 2 where the forms
   share a d or dmin per run (K-quants: 8 or 16 groups), so that a group's
   run is g >> shift. */
typedef struct {
    const uint8_t *scales, *d, *offsets, *dmin;
    int shift;
} PackedSide;

static PackedSide packed_side(const Matrix *W, const uint8_t *ws) {
    const size_t groups = (size_t)(W->cols / W->group_size);
    PackedSide side = {ws, ws + groups * PACK_ROWS, ws + scale_part_bytes(W), NULL, 0};
    side.dmin = side.offsets + groups * PACK_ROWS;
    while (W->scale_run >> (side.shift + 1)) side.shift++;
    return side;
}
#endif

#ifndef VNNI
#define Q8_BLOCK_ROWS QB_ROWS
#define Q8_ONE_ROWS MM_ROWS
/* The same for int8 rows i.. of W and quantised inputs (xq, xs: NB rows,
   one after the other): per group, exact int32 sums of products
   (VI_COLS / SIMD_WIDTH columns per lane), then acc += float(sum) * (ws * xs)
   lane by lane; group_size is a multiple of VI_COLS. */
KERNEL void block_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const int8_t *next, const int16_t *xq,
                     const float *xs, int n_in, const int NR, const int NB) {
    const int cols = W->cols, gs = W->group_size, groups = cols / gs;
    const int8_t *wr[MB_MAX];
    const int16_t *xr[MB_MAX_INPUTS];
    const float *sr[MB_MAX_INPUTS];
    size_t wg[MB_MAX];
    vfloat acc[MB_MAX * MB_MAX_INPUTS]; /* acc[r * NB + b] */
    for (int r = 0; r < NR; r++) {
        size_t row = (size_t)i + (r < n_rows ? r : n_rows - 1);
        wr[r] = W->q + row * cols;
        wg[r] = row * groups;
    }
    for (int b = 0; b < NB; b++) {
        int in = b < n_in ? b : n_in - 1;
        xr[b] = xq + (size_t)in * cols;
        sr[b] = xs + (size_t)in * groups;
    }
    for (int r = 0; r < NR; r++)
        for (int b = 0; b < NB; b++) acc[r * NB + b] = vf_zero();
    for (int g = 0; g < groups; g++) {
        vint isum[MB_MAX][MB_MAX_INPUTS];
        for (int r = 0; r < NR; r++)
            for (int b = 0; b < NB; b++) isum[r][b] = vi_zero();
        for (int j = g * gs; j < (g + 1) * gs; j += VI_COLS) {
            if (next) prefetch_far(next + (size_t)NR * j, NR * VI_COLS);
            for (int r = 0; r < NR; r++) {
                vint wv = vi_load_i8(wr[r] + j);
                for (int b = 0; b < NB; b++) isum[r][b] = vi_dot(isum[r][b], wv, vi_load_i16(xr[b] + j));
            }
        }
        for (int r = 0; r < NR; r++) {
            float ws = group_scale(W, wg[r] + g);
            for (int b = 0; b < NB; b++) acc[r * NB + b] = vf_fma(vi_to_float(isum[r][b]), vf_set(ws * sr[b][g]), acc[r * NB + b]);
        }
    }
    store_sums(out, stride, acc, n_rows, n_in, NR, NB);
}
#else
/* int8 with VNNI's byte dot products: vpdpbusd adds to each int32 lane the
   four products of unsigned bytes by signed bytes. The weights are made
   unsigned (wq + 128: the sign bit flipped) and the inputs stay signed (xq
   in -127..127), so that a group's sum of (wq + 128) * xq is its isum plus
   128 * sum xq: it starts at -128 * sum xq ("the start", prepared with the
   inputs). Each output is summed group by group, in order,
     acc = fma(float(isum_g), ws_g * xs_g, acc),  isum_g exact in int32,
   so a row's result does not depend on the other rows of its batch.
   group_size is a multiple of 4. 4-bit weights (bits = 4) go the same way:
   their stored nibbles are q + 8, unsigned already, and the group sums
   start at -8 * sum xq. The 4-bit codes n of a table's values (`table`:
   GGUF IQ4_NL, IQ4_XS, MXFP4) become table[n] + 128 by one vpshufb, and
   then go as 8-bit values do, from -128 * sum xq.

   The kernel reads the weights as pack_matrices lays them out when the
   checkpoint is loaded: PACK_ROWS rows at a time, columns 4 at a time, each
   row's 4 weights one int32 lane (int8: 4 bytes wq + 128; 4-bit: its 2
   bytes as stored). One vector load gives 4 columns of 16 rows, and one
   vpdpbusd with an input's 4 bytes in every lane (a broadcast load) adds
   their products to the 16 rows' sums: lane r is row r's sum, with no sums
   across lanes, and every product computed is used, for one input row or
   many. The scales are packed alike, 16 rows' scales of a group in one
   vector (packed_scale). In row-major order, each weight would have to be copied across
   lanes first: with 4 input rows that took 2.5 times as long (stories110M
   shape, 2 threads, weights in the third-level cache). */
#define PACK_INPUTS 8 /* the input rows the kernel takes at once, at most */
#define PACK_FEW 4     /* up to this many, a kernel of their own; more take PACK_INPUTS's */
/* Decoding an int8 matrix (one input row), the next block is prefetched
   only when it is at most this big: the 32 KB blocks of 2048 columns (Llama
   3.2 1B shape, Q8_0) streamed faster with the hardware's prefetchers
   alone (tok/s 29.0 -> 33.4, 9 alternating rounds, 2 threads; the whole
   lm head read at 95% of the streaming probe against 89%), while the 12 KB
   blocks of 768 columns (stories110M shape) ran 3% slower without it, and
   the 4-, 5- and 6-bit kernels, with more work a byte, lost up to 20%. */
#define INT8_PREFETCH_MAX 16384

/* 4-bit values in units of 8 columns: 64 bytes, row r's 4 bytes at 4r,
   byte k holding column k of the unit in its low nibble and column 4 + k
   in its high one. One load gives 8 columns of the 16 rows; half 0 or 1 of
   it is columns 0..3 or 4..7, as unsigned bytes (lane r: row r's 4
   values), parted by an and and a shift (a layout of 4 columns a row in 2
   bytes had to be widened across lanes: the 4-bit kernel decoded 24.5 GB/s
   from the second-level cache on one Zen 4 core where the int8 one decodes
   42.8). */
KERNEL __m512i nibble_half(__m512i unit, const int half) {
    return _mm512_and_si512(half ? _mm512_srli_epi16(unit, 4) : unit, _mm512_set1_epi8(15));
}

/* Columns 4 step .. 4 step + 3 of a run of SIX_BIT_COLS columns of 6-bit
   values (192 bytes: the low nibbles in 2 units of 4-bit values, then 64
   bytes laid out as the values of a step, bits 2s and 2s + 1 of each the
   top 2 bits of its value in step s: rotated to bits 4-5 and or-ed in),
   the run's units and tops loaded. */
KERNEL __m512i six_bit_step(const __m512i *units, __m512i tops, const int step) {
    const __m512i t = step == 0   ? _mm512_rol_epi32(tops, 4)
                      : step == 1 ? _mm512_rol_epi32(tops, 2)
                      : step == 2 ? tops
                                  : _mm512_ror_epi32(tops, 2);
    return _mm512_ternarylogic_epi32(nibble_half(units[step / 2], step % 2), t, _mm512_set1_epi8(0x30), 0xF8); /* a | (b & c) */
}

/* The same for 5-bit values: runs of 160 bytes, the low nibbles as 6-bit's,
   then a 64-bit mask a step, bit 4r + k the top bit of row r's value in
   column k of the step: 16 added where it is set. */
KERNEL __m512i five_bit_step(const uint8_t *run, const __m512i *units, const int step) {
    uint64_t tops;
    memcpy(&tops, run + 128 + 8 * step, 8);
    const __m512i low = nibble_half(units[step / 2], step % 2);
    return _mm512_mask_add_epi8(low, (__mmask64)tops, low, _mm512_set1_epi8(16));
}

/* W's table (packed_table) as the unsigned bytes of 8-bit values, table[n]
   + 128, in each 128-bit lane: vpshufb of it by a half of 4-bit codes (each
   in 0..15) gives their values so. */
static inline __m512i table_bytes(const Matrix *W) {
    return _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)W->packed_table), _mm_set1_epi8(-128)));
}

/* Columns j..j+3 (j a multiple of 4) of the packed block at p, as unsigned
   bytes: lane r holds row r's 4 values (a table's: its codes). */
KERNEL __m512i packed_weights(const uint8_t *p, int j, const int bits) {
    if (bits == 8) return _mm512_loadu_si512(p + (size_t)j * PACK_ROWS);
    if (bits == 4) return nibble_half(_mm512_loadu_si512(p + (size_t)j / 8 * 64), j / 4 % 2);
    const uint8_t *run = p + (size_t)(j / SIX_BIT_COLS) * SIX_BIT_COLS * PACK_ROWS * bits / 8;
    const __m512i units[2] = {_mm512_loadu_si512(run), _mm512_loadu_si512(run + 64)};
    if (bits == 5) return five_bit_step(run, units, j % SIX_BIT_COLS / 4);
    return six_bit_step(units, _mm512_loadu_si512(run + 128), j % SIX_BIT_COLS / 4);
}

/* The scales 2^(e - 128) of 16 bytes e at p (SCALES_E8M0). */
static inline vfloat e8m0_16(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i h = _mm512_srli_epi32(e, 1), bias = _mm512_set1_epi32(63);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, bias), 23)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(e, h), bias), 23)));
}

/* Group g's scales of the 16 rows of a packed block. */
KERNEL vfloat packed_scale(const Matrix *W, const PackedSide *side, int g) {
    if (W->scale_form == SCALES_F32) return vf_load((const float *)side->scales + (size_t)g * PACK_ROWS);
    if (W->scale_form == SCALES_F16) return vf_load_half((const uint16_t *)side->scales + (size_t)g * PACK_ROWS);
    if (W->scale_form == SCALES_E8M0) return e8m0_16(side->scales + (size_t)g * PACK_ROWS);
    const vfloat d = vf_load_half((const uint16_t *)side->d + (size_t)(g >> side->shift) * PACK_ROWS);
    const __m512i k = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(side->scales + (size_t)g * PACK_ROWS)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(k), d);
}

/* Group g's offsets of the 16 rows of a packed block, whose group g's
   scales are wsg. OFFSETS_MIN: centre x scale is exact (a power of 2), so
   the one rounding of the fused multiply-add is the one of the K-quants'
   unpack. */
KERNEL vfloat packed_offset(const Matrix *W, const PackedSide *side, vfloat wsg, int g) {
    if (W->offset_form == OFFSETS_F32) return vf_load((const float *)side->offsets + (size_t)g * PACK_ROWS);
    const vfloat dmin = vf_load_half((const uint16_t *)side->dmin + (size_t)(g >> side->shift) * PACK_ROWS);
    const vfloat m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(side->offsets + (size_t)g * PACK_ROWS))));
    return _mm512_fnmadd_ps(dmin, m, _mm512_mul_ps(vf_set(W->offset_centre), wsg));
}

/* out[b * stride + r] for rows i..i+n_rows-1 of W (a packed block: i a
   multiple of PACK_ROWS) and n_in <= N input rows b: x (N, cols) their
   bytes, c and s (N, groups) their starts and scales (rows past n_in: zero),
   and xsum (N, groups) the float sums of their groups, which W's offsets
   multiply (value = q x scale + offset) right after each group's term.
   Each group's sums are taken in `chains` int32 sums per input, columns 4 at
   a time in turn, added exactly at the end of the group: a vpdpbusd waits
   for the one before it on its sum, so that few inputs need several sums
   in flight (4 for fewer than 4 inputs). `next`: the next block, prefetched
   a group at a time.
   N, bits and table are constants in every inlined copy. */
KERNEL void packed_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const uint8_t *next, const int8_t *x,
                      const int32_t *c, const float *s, const float *xsum, int n_in, const int N, const int bits, const int table) {
    enum { MAX_CHAINS = 4 };
    const int cols = W->cols, gs = W->group_size, groups = cols / gs, chains = N < 4 ? 4 : 2;
    const uint8_t *p = W->packed + (size_t)(i / PACK_ROWS) * packed_block_bytes(W);
    const size_t scale_bytes = packed_scale_bytes(W);
    const uint8_t *ws = W->packed_scales + (size_t)(i / PACK_ROWS) * scale_bytes;
    const PackedSide side = packed_side(W, ws);
    if (N == 1 && bits == 8 && packed_block_bytes(W) > INT8_PREFETCH_MAX) next = NULL;
    if (next) prefetch_far(ws + scale_bytes, scale_bytes);
    const __m512i lut = table ? table_bytes(W) : _mm512_setzero_si512();
    vfloat acc[PACK_INPUTS];
    for (int m = 0; m < N; m++) acc[m] = vf_zero();
    for (int g = 0; g < groups; g++) {
        const int j0 = g * gs, j1 = j0 + gs;
        if (next) prefetch_far(next + (size_t)j0 * PACK_ROWS * bits / 8, (size_t)gs * PACK_ROWS * bits / 8);
        __m512i sum[PACK_INPUTS][MAX_CHAINS];
        for (int m = 0; m < N; m++)
            for (int k = 0; k < chains; k++) sum[m][k] = k == 0 ? _mm512_set1_epi32(c[(size_t)m * groups + g]) : _mm512_setzero_si512();
        for (int j = j0; bits == 4 && gs % 16 == 0 && j < j1; j += 16) { /* 2 units of 8 columns, a load each */
            const __m512i units[2] = {_mm512_loadu_si512(p + (size_t)j * PACK_ROWS / 2), _mm512_loadu_si512(p + (size_t)(j + 8) * PACK_ROWS / 2)};
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
            for (int step = 0; step < 4; step++) { /* columns j + 4 step .. j + 4 step + 3 */
                const __m512i n = nibble_half(units[step / 2], step % 2), w = table ? _mm512_shuffle_epi8(lut, n) : n;
                for (int m = 0; m < N; m++) {
                    int32_t x4;
                    memcpy(&x4, x + (size_t)m * cols + j + 4 * step, sizeof(x4));
                    sum[m][step % chains] = _mm512_dpbusd_epi32(sum[m][step % chains], w, _mm512_set1_epi32(x4));
                }
            }
        }
        for (int j = j0; (bits == 5 || bits == 6) && j < j1; j += SIX_BIT_COLS) { /* a run's units and 6-bit tops loaded once */
            const uint8_t *run = p + (size_t)j * PACK_ROWS * bits / 8;
            const __m512i units[2] = {_mm512_loadu_si512(run), _mm512_loadu_si512(run + 64)};
            const __m512i tops = bits == 6 ? _mm512_loadu_si512(run + 128) : _mm512_setzero_si512();
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
            for (int step = 0; step < 4; step++) {
                __m512i w = bits == 6 ? six_bit_step(units, tops, step) : five_bit_step(run, units, step);
                for (int m = 0; m < N; m++) {
                    int32_t x4;
                    memcpy(&x4, x + (size_t)m * cols + j + 4 * step, sizeof(x4));
                    sum[m][step % chains] = _mm512_dpbusd_epi32(sum[m][step % chains], w, _mm512_set1_epi32(x4));
                }
            }
        }
        for (int j = j0; (bits == 8 || (bits == 4 && gs % 16 != 0)) && j < j1; j += 4 * chains)
            for (int k = 0; k < chains && j + 4 * k < j1; k++) { /* the last round may be short */
                __m512i w = packed_weights(p, j + 4 * k, bits);
                for (int m = 0; m < N; m++) {
                    int32_t x4;
                    memcpy(&x4, x + (size_t)m * cols + j + 4 * k, sizeof(x4));
                    sum[m][k] = _mm512_dpbusd_epi32(sum[m][k], w, _mm512_set1_epi32(x4));
                }
            }
        const vfloat wsg = packed_scale(W, &side, g);
        for (int m = 0; m < N; m++) {
            __m512i total = sum[m][0];
            for (int k = 1; k < chains; k++) total = _mm512_add_epi32(total, sum[m][k]);
            acc[m] = vf_fma(vi_to_float(total), _mm512_mul_ps(wsg, vf_set(s[(size_t)m * groups + g])), acc[m]);
        }
        if (W->offset_form) {
            const vfloat off = packed_offset(W, &side, wsg, g);
            for (int m = 0; m < N; m++) acc[m] = vf_fma(off, vf_set(xsum[(size_t)m * groups + g]), acc[m]);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << n_rows) - 1);
    for (int m = 0; m < n_in; m++) _mm512_mask_storeu_ps(out + (size_t)m * stride, stored, acc[m]);
}

/* ---- Many input rows on AMX tiles ----
   Machines with AMX (Intel's tile unit; x86-64 Linux, which must first
   grant a process the tiles' state) take the inputs 16 at a time through
   tdpbsud instead: one instruction multiplies a tile of 16 input rows by K
   signed bytes (A, the rows of x8 as they lie) with a tile of the packed
   block's 16 weight rows by K unsigned bytes (B: the packed layout, 4
   columns of 16 rows per 64 bytes, is the tile's layout already), giving
   C[m][r] = sum over K of x[m] * (wq[r] + 128), exact in int32. K is the
   group (a group of more than 64 columns in pieces of 64, summed in the
   tile), so that C holds each group sum apart: with the start c added,
   the very isum_g of packed_q8, and then the same
     acc = fma(float(isum_g), ws_g * xs_g, acc)
   in the same order. A row's result is bit for bit the one packed_q8 gives
   it alone. 4-bit blocks are widened to bytes once per block (the bytes
   packed_weights makes).
   RUN_NO_AMX at compile time leaves it out. */
#if (defined(__AMX_INT8__) || defined(__AMXINT8__)) && (defined(__AMX_TILE__) || defined(__AMXTILE__)) && defined(__linux__) && \
    !defined(RUN_NO_AMX) /* gcc's names, clang's */
#define AMX 1
#define AMX_INPUTS 16
enum { AMX_PERMISSION = 0x1023 /* ARCH_REQ_XCOMP_PERM */, AMX_TILE_DATA = 18 /* XFEATURE_XTILEDATA */ };
static int amx_allowed = -1; /* -1: not asked yet */

/* Whether this process may use the tiles (asked once, from the thread
   that starts a parallel region). */
static int amx_usable(void) {
    if (amx_allowed < 0) amx_allowed = syscall(SYS_arch_prctl, AMX_PERMISSION, AMX_TILE_DATA) == 0;
    return amx_allowed;
}

/* The group sizes the tiles take: K of at most 64 bytes a row. */
static int amx_fits(int gs) { return gs <= 64 || gs % 64 == 0; }

/* Each thread's tile configuration: tiles 0-3 C (16 input rows of 16
   int32 sums, a lane a weight row), 4-5 A (16 input rows of k bytes), 6-7
   B (k / 4 rows of 16 weight rows' 4 bytes); configured for pieces of k
   columns (0: not yet). */
static _Thread_local int amx_k;
static void amx_configure(int k) {
    if (amx_k == k) return;
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t < 6 ? 16 : (uint8_t)(k / 4);
        cfg.colsb[t] = t < 4 || t >= 6 ? 64 : (uint16_t)k;
    }
    _tile_loadconfig(&cfg);
    amx_k = k;
}

/* Each thread's 4-bit block widened to bytes: (cols / 4, PACK_ROWS, 4)
   (a table's codes looked up, as packed_q8 does). */
static _Thread_local Scratch amx_widened;

static const uint8_t *amx_widen(const Matrix *W, const uint8_t *p, const int bits, const int table) {
    const int cols = W->cols;
    const __m512i lut = table ? table_bytes(W) : _mm512_setzero_si512();
    uint8_t *base = scratch_grow(&amx_widened, (size_t)cols * PACK_ROWS);
    for (int j = 0; j < cols; j += 4) {
        const __m512i w = packed_weights(p, j, bits);
        _mm512_store_si512(base + (size_t)j * PACK_ROWS, table ? _mm512_shuffle_epi8(lut, w) : w);
    }
    return base;
}

/* The products of group g on tiles C, A, B (constants), left in C: x the
   inputs' rows, wb the block's weights as bytes. */
#define AMX_PRODUCT(C, A, B, g)                                                    \
    if ((g) < groups) {                                                            \
        _tile_zero(C);                                                             \
        for (int j = (g) * gs; j < ((g) + 1) * gs; j += k) {                       \
            _tile_loadd(A, x + j, cols);                                           \
            _tile_loadd(B, wb + (size_t)j * PACK_ROWS, 64);                        \
            _tile_dpbsud(C, A, B);                                                 \
        }                                                                          \
    }
/* Group g's sums, from tile C to sums[at] (16 rows of 16 int32). */
#define AMX_STORE(C, g, at) \
    if ((g) >= 0 && (g) < groups) _tile_stored(C, sums[at], 64)

/* acc[m] = fma(float(sums[m] + c_m), ws_g * xs_m, acc[m]), then the
   offsets' term, for the 16 inputs m of group g (if there is one), as
   packed_q8 finishes a group. */
KERNEL void amx_scale(vfloat *acc, const int32_t *sums, const Matrix *W, const PackedSide *side, const int32_t *c, const float *s,
                      const float *xsum, int groups, int g) {
    if (g < 0 || g >= groups) return;
    const vfloat wsg = packed_scale(W, side, g);
#if defined(__GNUC__)
#pragma GCC unroll 16
#endif
    for (int m = 0; m < AMX_INPUTS; m++) {
        __m512i total = _mm512_add_epi32(_mm512_load_si512(sums + m * PACK_ROWS), _mm512_set1_epi32(c[(size_t)m * groups + g]));
        acc[m] = vf_fma(vi_to_float(total), _mm512_mul_ps(wsg, vf_set(s[(size_t)m * groups + g])), acc[m]);
    }
    if (W->offset_form) {
        const vfloat off = packed_offset(W, side, wsg, g);
        for (int m = 0; m < AMX_INPUTS; m++) acc[m] = vf_fma(off, vf_set(xsum[(size_t)m * groups + g]), acc[m]);
    }
}

/* out[m * stride + r] for the packed block at rows i.. and AMX_INPUTS input
   rows (x, c, s as packed_q8 takes them); wb the block's weights as bytes;
   `pre`: pre_bytes of the next block to prefetch, spread over the groups.
   A pipeline over the groups, two at a time on tiles 0-1 and 2-3 in turn
   (4-7 hold their inputs and weights): a pair's sums are stored while the
   next pair's products run, and scaled a pair later again, when the
   stores are done. */
static void amx_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const uint8_t *pre, size_t pre_bytes,
                   const uint8_t *wb, const int8_t *x, const int32_t *c, const float *s, const float *xsum) {
    const int cols = W->cols, gs = W->group_size, groups = cols / gs, k = gs < 64 ? gs : 64;
    const size_t step = (pre_bytes / ((groups + 3) / 4) + 63) / 64 * 64; /* prefetched per 4 groups */
    const PackedSide side = packed_side(W, W->packed_scales + (size_t)(i / PACK_ROWS) * packed_scale_bytes(W));
    _Alignas(64) int32_t sums[4][AMX_INPUTS * PACK_ROWS];
    vfloat acc[AMX_INPUTS];
    for (int m = 0; m < AMX_INPUTS; m++) acc[m] = vf_zero();
    amx_configure(k);
    for (int g = 0; g < groups + 4; g += 4) {
        if (pre && (size_t)g / 4 * step < pre_bytes) {
            const size_t at = (size_t)g / 4 * step;
            prefetch_far(pre + at, pre_bytes - at < step ? pre_bytes - at : step);
        }
        AMX_PRODUCT(0, 4, 6, g)
        AMX_PRODUCT(1, 5, 7, g + 1)
        amx_scale(acc, sums[0], W, &side, c, s, xsum, groups, g - 4);
        amx_scale(acc, sums[1], W, &side, c, s, xsum, groups, g - 3);
        AMX_STORE(2, g - 2, 2);
        AMX_STORE(3, g - 1, 3);
        AMX_PRODUCT(2, 4, 6, g + 2)
        AMX_PRODUCT(3, 5, 7, g + 3)
        amx_scale(acc, sums[2], W, &side, c, s, xsum, groups, g - 2);
        amx_scale(acc, sums[3], W, &side, c, s, xsum, groups, g - 1);
        AMX_STORE(0, g, 0);
        AMX_STORE(1, g + 1, 1);
    }
    const __mmask16 stored = (__mmask16)((1u << n_rows) - 1);
    for (int m = 0; m < AMX_INPUTS; m++) _mm512_mask_storeu_ps(out + (size_t)m * stride, stored, acc[m]);
}
#endif
#endif
/* ---- Packed weights with AVX2 ----
   AVX2 builds without VNNI read the GGUF blocks packed as VNNI builds pack
   them (pack_values), half a 64-byte line at a time: 8 rows' 4 columns as
   unsigned bytes, lane r row r's. vpmaddubsw multiplies them by the
   input's 4 bytes (broadcast, signed) and adds pairs into int16, which add
   up over a few steps of 4 columns (each pair at most 2 x 63 x 127 = 16002
   in size for 6-bit values, 7874 for 5, 3810 for 4: 2, 4 or 8 steps stay
   below 32768) before vpmaddwd by ones widens them, a row's 4 columns to
   its int32 lane: the group sums exact, as vpdpbusd's. 8-bit values
   (q + 128) would overflow a pair (2 x 255 x 127); their sign bit flipped
   back gives q, and |q| times the input with q's sign (vpsignb) is q x xq,
   at most 2 x 128 x 127 = 32512 a pair, widened at every step: the group
   sum itself, from 0 rather than from the start. The 4-bit codes n of a
   table's values (`table`: GGUF IQ4_NL, IQ4_XS, MXFP4) become table[n]
   by one vpshufb of the table and then go as 8-bit values do: |table[n]|
   x xq pairs at most 2 x 127 x 127 too, where the unsigned table[n] + 128
   of the VNNI form would overflow. IQ4_NL so held takes Q4_0's 0.5625
   bytes a weight instead of 1.0625 as int8: a 4096 x 4096 matrix times one
   input row, one core of a busy AMD EPYC (AVX2) machine, the least of
   300 runs: 1.18-1.62 ms -> 0.50-0.53 (Q4_0: 0.34-0.37, whose 4-bit values
   pair 8 steps before widening). Each group then ends as
   packed_q8's VNNI form ends it, the same float operations lane by lane:
   from the same prepared inputs, a row's result is bit for bit the one a
   VNNI build gives it, whatever its batch (checked by hand on a 37 x 1024
   matrix of each of the 8 types, n = 1..9: the outputs of an AVX-512
   build without VNNI, which runs this kernel, were the VNNI build's; a
   Haswell build's too where the inputs' group sums were exact, which
   -Ofast vectorises by the build's width). Before, the blocks were
   unpacked at load to int8 or 4-bit values with float32 scales (Q4_K 6
   bits a weight, Q6_K 10, against the file's 4.5 and 6.6) and read a row
   at a time, each weight widened to int16.
   Llama 3.2 1B shape, -march=haswell, 2 threads on the Zen 4 machine, 3
   alternating rounds (tok/s, decode then 128-token prompt): Q4_0 25.9 ->
   46.4, 49.8 -> 104.1; Q4_K_M 17.3 -> 41.6, 45.9 -> 91.3; Q5_K_M 18.3 ->
   31.3, 59.0 -> 89.1; Q6_K 16.3 -> 30.8, 46.1 -> 91.7; Q8_0 23.0 -> 23.2,
   62.6 -> 100.2. 2 input rows at a time instead of 4: prompts 0.98x-1.05x.
   gcc reassociated the adds of a group's pair and int32 sums into trees,
   computing all the group's products first and spilling a third of them
   to the stack; in_register keeps each sum a chain, and the group's
   columns are known from the bits, so its steps unroll whole. One Zen 3
   core, a stories110M-shape layer times 64 input rows (GMAC/s): Q4_0 50
   -> 85, Q8_0 43 -> 53, Q4_K 43 -> 60, Q5_K 40 -> 44, Q6_K 41 -> 48. */
#ifdef PACKED_AVX2
#define PACK_INPUTS 4 /* the input rows the kernel takes at once, at most (16 registers) */
#define PACK_FEW 4

/* Half h (rows 8h..8h+7) of a line of 4-bit values, columns 0..3 or 4..7 (nibble `half`). */
static inline __m256i nibbles8(const uint8_t *line, int h, const int half) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(line + 32 * h));
    return _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
}

/* Columns 4 step .. 4 step + 3 of half h of a run of 5- or 6-bit values
   (six_bit_step, five_bit_step: the same layout; 5 bits: byte i of the
   half's 32-bit mask word, 16 added where bit i is set). */
static inline __m256i run_step8(const uint8_t *run, int h, const int step, const int bits) {
    const __m256i low = nibbles8(run + 64 * (step / 2), h, step % 2);
    if (bits == 6) {
        const __m256i tops = _mm256_loadu_si256((const __m256i *)(run + 128 + 32 * h));
        const __m256i t = step == 0 ? _mm256_slli_epi32(tops, 4) : step == 1 ? _mm256_slli_epi32(tops, 2) : step == 2 ? tops : _mm256_srli_epi32(tops, 2);
        return _mm256_or_si256(low, _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
    }
    uint32_t mask;
    memcpy(&mask, run + 128 + 8 * step + 4 * h, 4);
    const __m256i byte = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mask), _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(byte, bit), bit), _mm256_set1_epi8(16)));
}

/* f16 values at p (8 of them) as floats. */
static inline __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* The scales 2^(e - 128) of 8 bytes e at p (SCALES_E8M0). */
static inline __m256 e8m0_8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i h = _mm256_srli_epi32(e, 1), bias = _mm256_set1_epi32(63);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, h), bias), 23)));
}

/* Half h of group g's scales, as packed_scale. */
static inline __m256 packed_scale8(const Matrix *W, const PackedSide *side, int g, int h) {
    const size_t at = (size_t)g * PACK_ROWS + 8 * (size_t)h;
    if (W->scale_form == SCALES_F32) return _mm256_loadu_ps((const float *)side->scales + at);
    if (W->scale_form == SCALES_F16) return halves8(side->scales + at * 2);
    if (W->scale_form == SCALES_E8M0) return e8m0_8(side->scales + at);
    const __m256 d = halves8(side->d + ((size_t)(g >> side->shift) * PACK_ROWS + 8 * (size_t)h) * 2);
    const __m256i k = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(side->scales + at)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(k), d);
}

/* Half h of group g's offsets, as packed_offset. */
static inline __m256 packed_offset8(const Matrix *W, const PackedSide *side, __m256 wsg, int g, int h) {
    const size_t at = (size_t)g * PACK_ROWS + 8 * (size_t)h;
    if (W->offset_form == OFFSETS_F32) return _mm256_loadu_ps((const float *)side->offsets + at);
    const __m256 dmin = halves8(side->dmin + ((size_t)(g >> side->shift) * PACK_ROWS + 8 * (size_t)h) * 2);
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(side->offsets + at))));
    return _mm256_fnmadd_ps(dmin, m, _mm256_mul_ps(_mm256_set1_ps(W->offset_centre), wsg));
}

/* v as it is now, in a register: the compiler may not reassociate the
   additions before it with those after (gcc otherwise turned a group's
   chains of adds into one tree, computed every product of the group first
   and spilled them to the stack). */
static inline __attribute__((always_inline)) void in_register(__m256i *v) {
#if defined(__GNUC__)
    __asm__("" : "+x"(*v));
#else
    (void)v;
#endif
}

/* packed_q8 (the same arguments and results). A unit's columns are a
   constant of the value bits (AVX2_GROUP), so that its steps unroll whole
   and each flush into the int32 sums falls where it is known; a group is
   one unit (every GGUF type) or several (the project's own checkpoints:
   groups of 64 columns, say), whose int32 sums go on across them. `wide`:
   int8 values (8 bits, or a table's), |q| x (xq with q's sign). */
KERNEL void packed_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const uint8_t *next, const int8_t *x,
                      const int32_t *c, const float *s, const float *xsum, int n_in, const int N, const int bits, const int table) {
    const int wide = bits == 8 || table, U = AVX2_GROUP(bits), G = W->group_size, cols = W->cols, groups = cols / G;
    const int flush = wide ? 1 : bits == 4 ? 8 : bits == 5 ? 4 : 2;
    const __m256i lut = table ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)W->packed_table)) : _mm256_setzero_si256();
    const uint8_t *p = W->packed + (size_t)(i / PACK_ROWS) * packed_block_bytes(W);
    const size_t scale_bytes = packed_scale_bytes(W);
    const uint8_t *ws = W->packed_scales + (size_t)(i / PACK_ROWS) * scale_bytes;
    const PackedSide side = packed_side(W, ws);
    const __m256i ones = _mm256_set1_epi16(1);
    if (next) prefetch_far(ws + scale_bytes, scale_bytes);
    __m256 acc[PACK_INPUTS][2];
    for (int m = 0; m < N; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int j0 = g * G;
        if (next) prefetch_far(next + (size_t)j0 * PACK_ROWS * bits / 8, (size_t)G * PACK_ROWS * bits / 8);
        __m256i sum[PACK_INPUTS][2], pairs[PACK_INPUTS][2];
        for (int m = 0; m < N; m++)
            for (int h = 0; h < 2; h++) {
                sum[m][h] = _mm256_set1_epi32(wide ? 0 : c[(size_t)m * groups + g]); /* wide: q x xq itself */
                pairs[m][h] = _mm256_setzero_si256();
            }
        for (int u = j0; u < j0 + G; u += U) { /* the group's units */
#if defined(__GNUC__)
#pragma GCC unroll 8
#endif
            for (int step = 0; step < U / 4; step++) { /* columns j .. j + 3 */
                const int j = u + 4 * step, at = step % 4; /* at: the step within its run of SIX_BIT_COLS columns */
                const uint8_t *run = p + (size_t)(j - 4 * at) * PACK_ROWS * bits / 8; /* 4 lines of 8-bit values, 2 units of 4-bit ones, or 5- or 6-bit values */
                for (int h = 0; h < 2; h++) {
                    const __m256i v = bits == 8   ? _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(run + 64 * at + 32 * h)), _mm256_set1_epi8(-128))
                                      : table     ? _mm256_shuffle_epi8(lut, nibbles8(run + 64 * (at / 2), h, at % 2))
                                      : bits == 4 ? nibbles8(run + 64 * (at / 2), h, at % 2)
                                                  : run_step8(run, h, at, bits);
                    const __m256i w = wide ? _mm256_abs_epi8(v) : v;
                    for (int m = 0; m < N; m++) {
                        int32_t x4;
                        memcpy(&x4, x + (size_t)m * cols + j, sizeof(x4));
                        const __m256i xb = wide ? _mm256_sign_epi8(_mm256_set1_epi32(x4), v) : _mm256_set1_epi32(x4);
                        pairs[m][h] = _mm256_add_epi16(pairs[m][h], _mm256_maddubs_epi16(w, xb));
                        in_register(&pairs[m][h]);
                    }
                }
                if ((step + 1) % flush == 0 || step == U / 4 - 1)
                    for (int m = 0; m < N; m++)
                        for (int h = 0; h < 2; h++) {
                            sum[m][h] = _mm256_add_epi32(sum[m][h], _mm256_madd_epi16(pairs[m][h], ones));
                            in_register(&sum[m][h]);
                            pairs[m][h] = _mm256_setzero_si256();
                        }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 wsg = packed_scale8(W, &side, g, h);
            for (int m = 0; m < N; m++)
                acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m][h]), _mm256_mul_ps(wsg, _mm256_set1_ps(s[(size_t)m * groups + g])), acc[m][h]);
            if (W->offset_form) {
                const __m256 off = packed_offset8(W, &side, wsg, g, h);
                for (int m = 0; m < N; m++) acc[m][h] = _mm256_fmadd_ps(off, _mm256_set1_ps(xsum[(size_t)m * groups + g]), acc[m][h]);
            }
        }
    }
    for (int m = 0; m < n_in; m++) {
        float rows[PACK_ROWS];
        _mm256_storeu_ps(rows, acc[m][0]);
        _mm256_storeu_ps(rows + 8, acc[m][1]);
        memcpy(out + (size_t)m * stride, rows, (size_t)n_rows * sizeof(float));
    }
}
#endif

/* ---- Packed weights with NEON dotprod ----
   aarch64 builds with sdot (ARMv8.2 dotprod) read the same packed blocks a
   quarter of a 64-byte line at a time: 4 rows' 4 columns, lane r row r's,
   as 16 bytes. sdot multiplies signed bytes: values of 4 to 6 bits (0..63)
   are their own signed bytes, so sdot with the input's 4 bytes (lane s of
   the run's 16 input bytes, vdotq_laneq_s32) adds what vpdpbusd adds, from
   the same start; 8-bit values (q + 128) get their sign bit flipped back
   to q, summed from 0 as the AVX2 form does, and so do a table's values
   (`table`: GGUF IQ4_NL, IQ4_XS, MXFP4), table[n] from the 4-bit codes n
   by one tbl (vqtbl1q_s8). Each group ends with the
   same float operations lane by lane as packed_q8's other forms (vfmaq_f32
   and vfmsq_f32 fused as the x86 ones): under qemu, a 37 x 1024 matrix of
   each of the 8 types gave the VNNI build's outputs bit for bit, n = 1..9,
   where the inputs' group sums were exact. Before, the blocks were
   unpacked at load (Q4_K to 6 bits a weight, Q5_K and Q6_K to 10, against
   4.5, 5.5 and 6.6 in the file). No ARM machine here to time it: counted
   under qemu, instructions executed a weight and input row (a 512 x 2048
   matrix, its inputs' preparation included), one input row then 8, before
   -> now: Q4_0 0.99 -> 0.37, 0.67 -> 0.26; Q8_0 0.60 -> 0.41, 0.45 ->
   0.27; Q4_K 1.20 -> 0.60, 0.70 -> 0.33; Q6_K 0.91 -> 0.87, 0.70 -> 0.45;
   Q5_K 0.81 -> 1.00 (its fifth bits spread from masks, 4 instructions a
   sdot), 0.48 -> 0.42, for 55% of the bytes. */
#ifdef PACKED_NEON
#define PACK_INPUTS 4 /* the input rows the kernel takes at once, at most */
#define PACK_FEW 4

/* Columns 4 step .. 4 step + 3 of quarter k (rows 4k..4k+3) of a run of
   packed values (as packed_weights reads them), as bytes (table: the
   values lut names). */
static inline int8x16_t run_quarter(const uint8_t *run, int k, const int step, const int bits, const int table, int8x16_t lut) {
    if (bits == 8) return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(run + 64 * step + 16 * k), vdupq_n_u8(0x80)));
    const uint8x16_t unit = vld1q_u8(run + 64 * (step / 2) + 16 * k);
    uint8x16_t v = step % 2 ? vshrq_n_u8(unit, 4) : vandq_u8(unit, vdupq_n_u8(15));
    if (table) return vqtbl1q_s8(lut, v);
    if (bits == 6) {
        const uint32x4_t tops = vld1q_u32((const uint32_t *)(const void *)(run + 128 + 16 * k));
        const uint32x4_t t = step == 0 ? vshlq_n_u32(tops, 4) : step == 1 ? vshlq_n_u32(tops, 2) : step == 2 ? tops : vshrq_n_u32(tops, 2);
        v = vorrq_u8(v, vandq_u8(vreinterpretq_u8_u32(t), vdupq_n_u8(0x30)));
    }
    if (bits == 5) { /* byte i of the quarter: bit i of its 2 bytes of the step's mask (each byte 8 times, by vqtbl1q) */
        const uint8x8_t mask = vld1_u8(run + 128 + 8 * step);
        const uint8x16_t pick = vcombine_u8(vdup_n_u8((uint8_t)(2 * k)), vdup_n_u8((uint8_t)(2 * k + 1)));
        const uint8x16_t byte = vqtbl1q_u8(vcombine_u8(mask, mask), pick);
        const uint8x16_t bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ull));
        v = vorrq_u8(v, vandq_u8(vtstq_u8(byte, bit), vdupq_n_u8(16)));
    }
    return vreinterpretq_s8_u8(v);
}

/* f16 values at p (4 of them) as floats. */
static inline float32x4_t halves4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }

/* The scales 2^(e - 128) of 4 bytes e at p (SCALES_E8M0). */
static inline float32x4_t e8m0_4(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, 4);
    const uint32x4_t e = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four))))), h = vshrq_n_u32(e, 1);
    const uint32x4_t bias = vdupq_n_u32(63);
    return vmulq_f32(vreinterpretq_f32_u32(vshlq_n_u32(vaddq_u32(h, bias), 23)), vreinterpretq_f32_u32(vshlq_n_u32(vaddq_u32(vsubq_u32(e, h), bias), 23)));
}

/* Quarter k of group g's scales, as packed_scale. */
static inline float32x4_t packed_scale4(const Matrix *W, const PackedSide *side, int g, int k) {
    const size_t at = (size_t)g * PACK_ROWS + 4 * (size_t)k;
    if (W->scale_form == SCALES_F32) return vld1q_f32((const float *)(const void *)side->scales + at);
    if (W->scale_form == SCALES_F16) return halves4(side->scales + at * 2);
    if (W->scale_form == SCALES_E8M0) return e8m0_4(side->scales + at);
    const float32x4_t d = halves4(side->d + ((size_t)(g >> side->shift) * PACK_ROWS + 4 * (size_t)k) * 2);
    int32_t four;
    memcpy(&four, side->scales + at, 4);
    const int32x4_t m = vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)))));
    return vmulq_f32(vcvtq_f32_s32(m), d);
}

/* Quarter k of group g's offsets, as packed_offset. */
static inline float32x4_t packed_offset4(const Matrix *W, const PackedSide *side, float32x4_t wsg, int g, int k) {
    const size_t at = (size_t)g * PACK_ROWS + 4 * (size_t)k;
    if (W->offset_form == OFFSETS_F32) return vld1q_f32((const float *)(const void *)side->offsets + at);
    const float32x4_t dmin = halves4(side->dmin + ((size_t)(g >> side->shift) * PACK_ROWS + 4 * (size_t)k) * 2);
    uint32_t four;
    memcpy(&four, side->offsets + at, 4);
    const uint32x4_t m = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(four)))));
    return vfmsq_f32(vmulq_f32(vdupq_n_f32(W->offset_centre), wsg), dmin, vcvtq_f32_u32(m));
}

/* packed_q8 (the same arguments and results). */
KERNEL void packed_q8(float *out, size_t stride, const Matrix *W, int i, int n_rows, const uint8_t *next, const int8_t *x,
                      const int32_t *c, const float *s, const float *xsum, int n_in, const int N, const int bits, const int table) {
    const int cols = W->cols, gs = W->group_size, groups = cols / gs;
    const uint8_t *p = W->packed + (size_t)(i / PACK_ROWS) * packed_block_bytes(W);
    const size_t scale_bytes = packed_scale_bytes(W);
    const uint8_t *ws = W->packed_scales + (size_t)(i / PACK_ROWS) * scale_bytes;
    const PackedSide side = packed_side(W, ws);
    if (next) prefetch_far(ws + scale_bytes, scale_bytes);
    const int8x16_t lut = table ? vld1q_s8(W->packed_table) : vdupq_n_s8(0);
    float32x4_t acc[PACK_INPUTS][4];
    for (int m = 0; m < N; m++)
        for (int k = 0; k < 4; k++) acc[m][k] = vdupq_n_f32(0.0f);
    for (int g = 0; g < groups; g++) {
        const int j0 = g * gs, j1 = j0 + gs;
        if (next) prefetch_far(next + (size_t)j0 * PACK_ROWS * bits / 8, (size_t)gs * PACK_ROWS * bits / 8);
        int32x4_t sum[PACK_INPUTS][4];
        for (int m = 0; m < N; m++)
            for (int k = 0; k < 4; k++) sum[m][k] = vdupq_n_s32(bits == 8 || table ? 0 : c[(size_t)m * groups + g]);
        for (int j = j0; j < j1; j += SIX_BIT_COLS) {
            const uint8_t *run = p + (size_t)j * PACK_ROWS * bits / 8;
            int8x16_t xv[PACK_INPUTS]; /* the run's 16 input bytes: step s in lane s */
            for (int m = 0; m < N; m++) xv[m] = vld1q_s8(x + (size_t)m * cols + j);
#if defined(__GNUC__)
#pragma GCC unroll 4
#endif
            for (int step = 0; step < 4; step++)
                for (int k = 0; k < 4; k++) {
                    const int8x16_t w = run_quarter(run, k, step, bits, table, lut);
                    for (int m = 0; m < N; m++) {
                        switch (step) { /* the lane must be a constant */
                        case 0: sum[m][k] = vdotq_laneq_s32(sum[m][k], w, xv[m], 0); break;
                        case 1: sum[m][k] = vdotq_laneq_s32(sum[m][k], w, xv[m], 1); break;
                        case 2: sum[m][k] = vdotq_laneq_s32(sum[m][k], w, xv[m], 2); break;
                        default: sum[m][k] = vdotq_laneq_s32(sum[m][k], w, xv[m], 3);
                        }
                    }
                }
        }
        for (int k = 0; k < 4; k++) {
            const float32x4_t wsg = packed_scale4(W, &side, g, k);
            for (int m = 0; m < N; m++) acc[m][k] = vfmaq_f32(acc[m][k], vcvtq_f32_s32(sum[m][k]), vmulq_f32(wsg, vdupq_n_f32(s[(size_t)m * groups + g])));
            if (W->offset_form) {
                const float32x4_t off = packed_offset4(W, &side, wsg, g, k);
                for (int m = 0; m < N; m++) acc[m][k] = vfmaq_f32(acc[m][k], off, vdupq_n_f32(xsum[(size_t)m * groups + g]));
            }
        }
    }
    for (int m = 0; m < n_in; m++) {
        float rows[PACK_ROWS];
        for (int k = 0; k < 4; k++) vst1q_f32(rows + 4 * k, acc[m][k]);
        memcpy(out + (size_t)m * stride, rows, (size_t)n_rows * sizeof(float));
    }
}
#endif

/* ---- 4-bit weights (version 3), without VNNI ----
   The vector kernel takes Q4_INPUTS input rows a block, on x86 and NEON.
   vi_load_q4(p): the VI_COLS / 2 bytes at p, that is VI_COLS 4-bit values
   in order (a byte's low nibble first), as vi_dot takes them: int16 values
   q in -8..7, or int8 ones with NEON's sdot. x86: each byte is widened to
   an int32 lane; (b | b << 12) & 0x000F000F puts its low nibble in the
   lane's low int16 and its high nibble in the high one, the order of the
   values. NEON: the low and high nibbles of the bytes, zipped. On ARM
   this replaced the plain C kernel for GGUF Q4_0 and Q4_K; counted under
   emulation (qemu, a 64 x 2048 matrix, no ARM machine here to time it),
   the instructions executed a weight and input row: 8.8 plain C (as gcc
   vectorises it), 1.75 NEON, 1.15 with sdot for one input row; 8.75,
   1.23 and 0.83 for 8. */
#define Q4_INPUTS 2
#if !defined(VNNI) && (defined(__AVX2__) || defined(__AVX512F__) || defined(SIMD_NEON))
#define HAVE_Q4_SIMD 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline vint vi_load_q4(const uint8_t *p) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i pairs = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
    return _mm512_sub_epi16(pairs, _mm512_set1_epi16(8));
}
#elif defined(SIMD_NEON) && defined(__ARM_FEATURE_DOTPROD)
static inline vint vi_load_q4(const uint8_t *p) {
    const uint8x8_t b = vld1_u8(p);
    const uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4));
    return vreinterpretq_s32_s8(vsubq_s8(vreinterpretq_s8_u8(vcombine_u8(z.val[0], z.val[1])), vdupq_n_s8(8)));
}
#elif defined(SIMD_NEON)
static inline vint vi_load_q4(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, sizeof(four));
    const uint8x8_t b = vcreate_u8(four);
    const uint8x8_t z = vzip_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4)).val[0];
    return vreinterpretq_s32_s16(vsubq_s16(vreinterpretq_s16_u16(vmovl_u8(z)), vdupq_n_s16(8)));
}
#else
static inline vint vi_load_q4(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i pairs = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)), _mm256_set1_epi32(0x000F000F));
    return _mm256_sub_epi16(pairs, _mm256_set1_epi16(8));
}
#endif

/* block_q8 for 4-bit rows: the same sums in the same order (the group sums
   are exact, so they equal matmul_q4_plain's; only the float additions of
   the groups' terms are ordered differently, lane by lane). */
KERNEL void block_q4(float *out, size_t stride, const Matrix *W, int i, int n_rows, const uint8_t *next, const int16_t *xq,
                     const float *xs, int n_in, const int NB) {
    const int cols = W->cols, gs = W->group_size, groups = cols / gs;
    const uint8_t *wr[MM_ROWS];
    const int16_t *xr[Q4_INPUTS];
    const float *sr[Q4_INPUTS];
    size_t wg[MM_ROWS];
    vfloat acc[MM_ROWS][Q4_INPUTS];
    for (int r = 0; r < MM_ROWS; r++) {
        size_t row = (size_t)i + (r < n_rows ? r : n_rows - 1);
        wr[r] = W->q4 + row * cols / 2;
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
        vint isum[MM_ROWS][Q4_INPUTS];
        for (int r = 0; r < MM_ROWS; r++)
            for (int b = 0; b < NB; b++) isum[r][b] = vi_zero();
        for (int j = g * gs; j < (g + 1) * gs; j += VI_COLS) {
            prefetch_far(next + (size_t)MM_ROWS * j / 2, MM_ROWS * VI_COLS / 2);
            for (int r = 0; r < MM_ROWS; r++) {
                vint wv = vi_load_q4(wr[r] + j / 2);
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

#endif

#endif

/* ---- Preparing the inputs once, and the dispatcher -------------------------
   The inputs of a matmul are quantised (int8 weights) or packed for the
   vector kernels once per call, then read by every matrix of the call:
   matmul_shared() takes several matrices that read the same input rows
   (wq, wk, wv; w1, w3) and runs all their blocks of rows in one parallel
   region. The buffers are scratch memory of the calling thread, grown as
   needed and kept for the next call. */
#define MATMUL_SHARED_MAX 4
static _Thread_local Scratch matmul_scratch;

static void *scratch_get(size_t bytes) { return scratch_grow(&matmul_scratch, bytes); }

/* How a matrix is multiplied, from its format and shape. */
typedef enum {
    KERNEL_F32_PLAIN, /* plain C, llama2.c's order */
    KERNEL_Q8_PLAIN,
    KERNEL_Q4_PLAIN,
    KERNEL_F32_SIMD,  /* cols a multiple of SIMD_WIDTH */
    KERNEL_BF16_DOT,  /* BF16_DOT builds, bfloat16 weights: cols a multiple of 2 * SIMD_WIDTH */
    KERNEL_BF16_SPLIT, /* BF16_SPLIT builds, bfloat16 weights packed in 12 bits */
    KERNEL_Q8_SIMD,   /* VNNI: group_size a multiple of 4; else a multiple of VI_COLS */
    KERNEL_Q4_SIMD,   /* VNNI: group_size a multiple of 4; else of VI_COLS */
    KERNEL_Q5_SIMD,   /* VNNI: int8 values in -16..15, packed as 5 bits */
    KERNEL_Q6_SIMD,   /* VNNI: int8 values in -32..31, packed as 6 bits */
    KERNEL_TABLE_SIMD, /* packed: 4-bit codes of a table's int8 values (packed_table) */
} KernelKind;

static KernelKind kernel_of(const Matrix *W) {
#ifdef SIMD_WIDTH
#ifdef BF16_SPLIT
    if (W->packed && W->packed_bits == SPLIT_BITS) return KERNEL_BF16_SPLIT;
#endif
#ifdef BF16_DOT
    if (W->half && W->bf16 && W->cols % (2 * SIMD_WIDTH) == 0) return KERNEL_BF16_DOT;
#endif
#ifdef VF_HALF_LOADS
    if (W->group_size == 0 && W->cols % SIMD_WIDTH == 0) return KERNEL_F32_SIMD;
#else
    if (W->w && W->cols % SIMD_WIDTH == 0) return KERNEL_F32_SIMD;
#endif
#ifdef PACKED_Q
    if (W->packed)
        return W->packed_table ? KERNEL_TABLE_SIMD : W->packed_bits == 4 ? KERNEL_Q4_SIMD : W->packed_bits == 5 ? KERNEL_Q5_SIMD : W->packed_bits == 6 ? KERNEL_Q6_SIMD : KERNEL_Q8_SIMD;
#endif
#ifndef VNNI
    if (!W->q4 && W->group_size > 0 && W->group_size % VI_COLS == 0) return KERNEL_Q8_SIMD;
#endif
#ifdef HAVE_Q4_SIMD
    if (W->q4 && W->group_size % VI_COLS == 0) return KERNEL_Q4_SIMD;
#endif
#endif
    return W->group_size == 0 ? KERNEL_F32_PLAIN : W->q4 ? KERNEL_Q4_PLAIN : KERNEL_Q8_PLAIN;
}

/* The input rows x (n, cols) as the kernel `kind` reads them. */
typedef struct {
    KernelKind kind;
    int n, cols, group_size;
    const float *x; /* (n, cols) */
    int16_t *xq;    /* int8, 4-bit (not packed): (n, cols) quantised values */
    float *xs;      /* int8, 4-bit (not packed): (n, cols / group_size) their scales */
    float *xf;      /* float32, n > 1: (n / MB_INPUTS rounded up, cols / SIMD_WIDTH, MB_INPUTS, SIMD_WIDTH);
                       bfloat16 dot products: the same in bfloat16, 2 x SIMD_WIDTH columns a vector
                       (n = 1: the row as it is) */
    int8_t *x8;     /* packed: (packed_inputs(n), cols) xq as bytes */
    int32_t *c8;    /* packed: (packed_inputs(n), groups) the starts of the group sums */
    float *s8;      /* packed: (packed_inputs(n), groups) the scales xs (zero past n) */
    float *sum8;    /* packed, with offsets: (packed_inputs(n), groups) the float sums of x
                       over each group (group_sums; zero past n); NULL otherwise */
} Inputs;

#if defined(SIMD_WIDTH) && defined(PACKED_Q)
/* The input rows that matmul_packed reads for n: n, or, when the last run
   of rows is more than PACK_FEW, up to a multiple of PACK_INPUTS (the
   kernel of PACK_INPUTS reads rows past n, as zeros). */
static int packed_inputs(int n) {
    const int last = n % PACK_INPUTS;
    return last > PACK_FEW ? n - last + PACK_INPUTS : n;
}

/* The start of a group sum of quantised values q (group_size of them;
   NULL: a row past n, whose start is 0); a table's values as 8-bit ones
   (VNNI: table[n] + 128). */
static int32_t group_start(const Inputs *in, const int16_t *q) {
    int32_t sum = 0;
    for (int j = 0; q && j < in->group_size; j++) sum += q[j];
    return (in->kind == KERNEL_Q4_SIMD ? -8 : in->kind == KERNEL_Q5_SIMD ? -16 : in->kind == KERNEL_Q6_SIMD ? -32 : -128) * sum;
}

/* Lays out quantised rows xq (n, cols) as packed_q8 reads them: x8 the
   values as bytes, c8 the start -128 * sum xq (4-bit weights: -8 * sum xq,
   6-bit: -32 * sum xq) of each group sum; the rows past n, up to packed_inputs(n), zero. */
static void pack_q8(Inputs *in, const int16_t *xq) {
    const int n = in->n, cols = in->cols, gs = in->group_size, groups = cols / gs;
    for (int b = 0; b < packed_inputs(n); b++) {
        const int16_t *q = b < n ? xq + (size_t)b * cols : NULL;
        for (int g = 0; g < groups; g++) in->c8[(size_t)b * groups + g] = group_start(in, q ? q + (size_t)g * gs : NULL);
        int8_t *dst = in->x8 + (size_t)b * cols;
        if (!q) memset(dst, 0, (size_t)cols);
        else
            for (int j = 0; j < cols; j++) dst[j] = (int8_t)q[j]; /* each in -127..127 */
    }
}
#endif

/* Quantises `count` values (whole groups of gs) as the text on matrix
   multiplication above says: per group xs = max|x| / 127 and xq =
   round(x / xs), halves away from zero (roundf), 0 for an all-zero group.
   xq is int16 so that vector kernels multiply it with widened weights. A
   group of whole vectors is taken a vector at a time (every row of every
   batch alike): the same maximum, the same quotients, the same rounding. A
   value out of -127..127 (x holds NaN or infinities: a broken model)
   becomes 0 rather than an undefined conversion. */
static int16_t quantized(float q) { return q >= -127.0f && q <= 127.0f ? (int16_t)q : 0; }

static void quantize_groups(int16_t *xq, float *xs, const float *x, size_t count, int gs) {
    for (size_t g = 0; g < count / gs; g++) {
        const float *v = x + g * gs;
        int16_t *q = xq + g * gs;
        float amax = 0.0f;
        int j = 0;
#ifdef SIMD_WIDTH
        if (gs % SIMD_WIDTH == 0) {
            float lanes[SIMD_WIDTH];
            vfloat m = vf_zero();
            for (; j < gs; j += SIMD_WIDTH) m = vf_amax(m, vf_load(v + j));
            vf_store(lanes, m);
            for (int k = 0; k < SIMD_WIDTH; k++)
                if (lanes[k] > amax) amax = lanes[k];
        }
#endif
        for (; j < gs; j++)
            if (fabsf(v[j]) > amax) amax = fabsf(v[j]);
        float scale = amax / 127.0f;
        xs[g] = scale;
        j = 0;
#ifdef SIMD_WIDTH
        if (gs % SIMD_WIDTH == 0 && scale > 0.0f) {
            const vfloat by = vf_set(scale);
            for (; j < gs; j += SIMD_WIDTH) {
                float r[SIMD_WIDTH];
                vf_store(r, vf_round_away(vf_div(vf_load(v + j), by)));
                for (int k = 0; k < SIMD_WIDTH; k++) q[j + k] = quantized(r[k]);
            }
        }
#endif
        for (; j < gs; j++) q[j] = scale > 0.0f ? quantized(roundf(v[j] / scale)) : 0;
    }
}

/* The sums of x (n, cols) over its groups of gs values: sums (n, cols / gs). */
static void group_sums(float *sums, const float *x, int n, int cols, int gs) {
    for (size_t g = 0; g < (size_t)n * (cols / gs); g++) {
        float sum = 0.0f;
        for (int j = 0; j < gs; j++) sum += x[g * gs + j];
        sums[g] = sum;
    }
}

#ifdef BF16_DOT
/* Where column j of input row k lies in the inputs in bfloat16 that
   prepare_inputs lays out for n rows of `cols` (in->xf): the row as it is
   for n = 1, else (n / MB_INPUTS rounded up, cols / (2 x SIMD_WIDTH),
   MB_INPUTS, 2 x SIMD_WIDTH). */
static size_t bf16_input_at(int n, int cols, size_t k, int j) {
    const size_t per = n == 1 ? 1 : MB_INPUTS, step = 2 * SIMD_WIDTH;
    return k / per * per * (size_t)cols + (size_t)j / step * step * per + k % per * step + (size_t)j % step;
}
#endif

/* Quantises or packs x (n, W.cols) for the kernel of W; with_sums: the
   group sums too, for packed matrices with offsets. */
static Inputs prepare_inputs(const float *x, int n, const Matrix *W, int with_sums) {
    Inputs in = {kernel_of(W), n, W->cols, W->group_size, x, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    (void)with_sums; /* read by VNNI builds only */
    size_t count = (size_t)n * W->cols;
    if (in.kind == KERNEL_F32_PLAIN) return in;
#ifdef SIMD_WIDTH
    if (in.kind == KERNEL_F32_SIMD) {
        if (n == 1) return in;
        size_t padded = (size_t)(n + MB_INPUTS - 1) / MB_INPUTS * MB_INPUTS;
        in.xf = scratch_get(padded * W->cols * sizeof(float));
        for (size_t b0 = 0; b0 < padded; b0 += MB_INPUTS)
            for (int j = 0; j < W->cols; j += SIMD_WIDTH)
                for (int b = 0; b < MB_INPUTS; b++) {
                    float *dst = in.xf + b0 * W->cols + (size_t)j * MB_INPUTS + b * SIMD_WIDTH;
                    if (b0 + b < (size_t)n) memcpy(dst, x + (b0 + b) * W->cols + j, SIMD_WIDTH * sizeof(float));
                    else memset(dst, 0, SIMD_WIDTH * sizeof(float));
                }
        return in;
    }
#ifdef BF16_DOT
    if (in.kind == KERNEL_BF16_DOT || in.kind == KERNEL_BF16_SPLIT) {
        const int step = 2 * SIMD_WIDTH, per = n == 1 ? 1 : MB_INPUTS;
        size_t padded = (size_t)(n + per - 1) / per * per;
        uint16_t *xb = scratch_get(padded * W->cols * sizeof(uint16_t));
        in.xf = (float *)xb;
        for (size_t b0 = 0; b0 < padded; b0 += per)
            for (int j = 0; j < W->cols; j += step)
                for (int b = 0; b < per; b++) {
                    const float *src = x + (b0 + b) * W->cols + j;
                    const vfloat v = b0 + b < (size_t)n ? vf_bf16_pairs(vf_load(src), vf_load(src + SIMD_WIDTH)) : vf_zero();
                    vf_store((float *)(xb + bf16_input_at(n, W->cols, b0 + b, j)), v);
                }
        return in;
    }
#endif
#endif
    size_t groups = count / W->group_size;
#if defined(SIMD_WIDTH) && defined(PACKED_Q)
    if (W->packed && in.kind >= KERNEL_Q8_SIMD) {
        size_t padded = (size_t)packed_inputs(n); /* rows of x8, c8 and s8 */
        size_t pgroups = padded * (W->cols / W->group_size);
        size_t qbytes = (count * sizeof(int16_t) + 63) / 64 * 64, gbytes = (pgroups * sizeof(float) + 63) / 64 * 64;
        size_t pbytes = (padded * W->cols + 63) / 64 * 64;
        char *base = scratch_get(qbytes + pbytes + (with_sums ? 3 : 2) * gbytes);
        int16_t *xq = (int16_t *)base;
        in.x8 = (int8_t *)(base + qbytes);
        in.c8 = (int32_t *)(base + qbytes + pbytes);
        in.s8 = (float *)(base + qbytes + pbytes + gbytes); /* xs itself, its rows past n zero */
        quantize_groups(xq, in.s8, x, count, W->group_size);
        memset(in.s8 + groups, 0, (pgroups - groups) * sizeof(float));
        pack_q8(&in, xq);
        if (with_sums) {
            in.sum8 = (float *)(base + qbytes + pbytes + 2 * gbytes);
            group_sums(in.sum8, x, n, W->cols, W->group_size);
            memset(in.sum8 + groups, 0, (pgroups - groups) * sizeof(float));
        }
        return in;
    }
#endif
    size_t qbytes = (count * sizeof(int16_t) + 63) / 64 * 64;
    char *base = scratch_get(qbytes + groups * sizeof(float));
    in.xq = (int16_t *)base;
    in.xs = (float *)(base + qbytes);
    quantize_groups(in.xq, in.xs, x, count, W->group_size);
    return in;
}

#ifdef SIMD_WIDTH
#ifdef PACKED_Q
/* The same for any number of input rows (x, c, s as prepare_inputs lays
   them out): PACK_INPUTS at a time; a last run of up to PACK_FEW (the cases
   1 to 4 below) in kernels of their own, of 5 to 7 in the kernel of 8,
   whose extra rows are zero (packed_inputs; AVX2: 4 at most, each run its
   own). */
KERNEL void matmul_packed(float *out, const Matrix *W, int i, const uint8_t *next, const Inputs *in, const int bits, const int table) {
    const int rows = W->rows, cols = W->cols, groups = cols / W->group_size, n_rows = rows - i < PACK_ROWS ? rows - i : PACK_ROWS;
    int b = 0;
#ifdef AMX
    if (in->n >= AMX_INPUTS && amx_allowed == 1 && amx_fits(W->group_size)) {
        /* the next block's weights, prefetched a share per run of inputs */
        const size_t block = packed_block_bytes(W), runs = (size_t)(in->n / AMX_INPUTS), share = (block / runs + 63) / 64 * 64;
        const uint8_t *p = W->packed + (size_t)(i / PACK_ROWS) * block;
        const uint8_t *wb = bits == 8 ? p : amx_widen(W, p, bits, table);
        for (size_t r = 0; r < runs; r++, b += AMX_INPUTS) {
            const size_t at = r * share < block ? r * share : block;
            amx_q8(out + (size_t)b * rows + i, (size_t)rows, W, i, n_rows, next ? (const uint8_t *)next + at : NULL,
                   block - at < share ? block - at : share, wb, in->x8 + (size_t)b * cols, in->c8 + (size_t)b * groups,
                   in->s8 + (size_t)b * groups, in->sum8 + (size_t)b * groups);
        }
        next = NULL;
    }
#endif
    for (; b < in->n; b += PACK_INPUTS) {
        const int n_in = in->n - b < PACK_INPUTS ? in->n - b : PACK_INPUTS;
        const uint8_t *pre = b == 0 ? next : NULL;
        const int8_t *x = in->x8 + (size_t)b * cols;
        const int32_t *c = in->c8 + (size_t)b * groups;
        const float *s = in->s8 + (size_t)b * groups, *xsum = in->sum8 + (size_t)b * groups;
        float *o = out + (size_t)b * rows + i;
        switch (n_in) {
        case 1: packed_q8(o, (size_t)rows, W, i, n_rows, pre, x, c, s, xsum, n_in, 1, bits, table); break;
        case 2: packed_q8(o, (size_t)rows, W, i, n_rows, pre, x, c, s, xsum, n_in, 2, bits, table); break;
        case 3: packed_q8(o, (size_t)rows, W, i, n_rows, pre, x, c, s, xsum, n_in, 3, bits, table); break;
        case 4: packed_q8(o, (size_t)rows, W, i, n_rows, pre, x, c, s, xsum, n_in, 4, bits, table); break;
        default: packed_q8(o, (size_t)rows, W, i, n_rows, pre, x, c, s, xsum, n_in, PACK_INPUTS, bits, table);
        }
    }
}
#endif

/* The weights of row i of W, as the kernels read them: where a block of
   rows starts. */
static const void *matrix_weights(const Matrix *W, int i) {
    if (W->packed) return W->packed + (size_t)(i / packed_rows(W)) * packed_block_bytes(W);
    if (W->w) return W->w + (size_t)i * W->cols;
    if (W->half) return W->half + (size_t)i * W->cols;
    if (W->q) return W->q + (size_t)i * W->cols;
    return W->q4 + (size_t)i * W->cols / 2;
}

/* Rows i.. (a block) of a float matrix W, whose weights are at w (rows
   of W.cols), times all the input rows, its weights loaded as `kind` says
   (a constant in each inlined copy). */
KERNEL void matmul_float_block(float *out, const Matrix *W, int i, const void *w, const void *next, const Inputs *in, const int kind) {
    const int rows = W->rows, cols = W->cols, n = in->n;
    const size_t size = kind == LOAD_F32 ? sizeof(float) : sizeof(uint16_t);
    const int pack = kind == DOT_BF16 ? 2 : 1; /* input columns a float of in->xf */
    if (n == 1 && kind == LOAD_F16 && SIMD_WIDTH == 16) {
        /* F16 decoding with AVX-512, a row at a time, each prefetching its
           row of the next block: the rows of a block are read one after
           the other, as one stream, not as MM_ROWS streams side by side
           (each row's sum is the same: one accumulator, in column order).
           Llama 3.2 1B shape, 2 threads, a token's matrices in one process
           alternating with the MM_ROWS-row kernel, 100 tokens: 41.2 -> 47.7
           GB/s (1.16x at the higher memory speed, 1.05x at the lower); the
           stories110M shape 29.4 -> 32.8 (1.11x). float32 rows so read ran
           2-6% slower; so did an AVX2 build's F16 ones at the 1B shape
           (0.95x; 110M 1.00x): a row's one chain of multiply-adds takes 32
           bytes of F16 a latency with 16 lanes, half that with 8. */
        for (int r = 0; r < MM_ROWS && i + r < rows; r++)
            block_f32(out + i + r, (size_t)rows, (const char *)w + (size_t)r * cols * size, (size_t)cols, 1,
                      next && i + MM_ROWS + r < rows ? (const char *)next + (size_t)r * cols * size : NULL, 1, in->x, 1, cols, NULL, NULL, 1,
                      1, kind);
        return;
    }
    if (n == 1) {
        block_f32(out + i, (size_t)rows, w, (size_t)cols, rows - i < MM_ROWS ? rows - i : MM_ROWS, next, 1,
                  kind == DOT_BF16 ? in->xf : in->x, 1, cols, NULL, NULL, MM_ROWS, 1, kind);
        return;
    }
    /* passes of MB_INPUTS input rows over a slice of the block, F32_SLAB
       passes at a time; each prefetches its share of the next block */
    const int passes = (n + MB_INPUTS - 1) / MB_INPUTS, n_rows = rows - i < MB_ROWS ? rows - i : MB_ROWS;
    const int slice = kind != LOAD_F32 || cols < F32_SLICE ? cols : F32_SLICE;
    vfloat carry[F32_SLAB][MB_ROWS * MB_INPUTS];
    size_t done = 0; /* columns read by the passes so far */
    for (int p0 = 0; p0 < passes; p0 += F32_SLAB)
        for (int j0 = 0; j0 < cols; j0 += slice) {
            const int len = cols - j0 < slice ? cols - j0 : slice;
            for (int p = p0; p < passes && p < p0 + F32_SLAB; p++, done += len) {
                const int b = p * MB_INPUTS;
                block_f32(out + (size_t)b * rows + i, (size_t)rows, (const char *)w + (size_t)j0 * size, (size_t)cols, n_rows,
                          next ? (const char *)next + (size_t)MB_ROWS * done / passes * size : NULL, passes,
                          in->xf + ((size_t)b * cols + (size_t)j0 * MB_INPUTS) / pack, n - b, len, j0 > 0 ? carry[p - p0] : NULL,
                          j0 + len < cols ? carry[p - p0] : NULL, MB_ROWS, MB_INPUTS, kind);
            }
        }
}

#ifdef BF16_SPLIT
_Static_assert(SPLIT_ROWS == MB_ROWS, "a block of 12-bit rows is a block of the many-row kernel");
static _Thread_local Scratch split_scratch; /* a block's rows in bfloat16 (matmul_split_block) */

/* out[r] = W_r . x for the SPLIT_ROWS rows of a block of a bfloat16
   matrix in 12 bits at p (n_rows of them real) and one input row x in
   bfloat16: the products that block_f32 takes for DOT_BF16, in the same
   order, of the values the block holds (its exceptions as zeros). */
KERNEL void block_split(float *out, const uint8_t *p, const uint8_t *table, int cols, int n_rows, const uint16_t *x) {
    const vint t = vi_split_table(table);
    vfloat acc[SPLIT_ROWS];
    for (int r = 0; r < SPLIT_ROWS; r++) acc[r] = vf_zero();
    for (int j = 0; j < cols; j += SPLIT_COLS, p += (size_t)SPLIT_ROWS * SPLIT_UNIT_BYTES) {
        vfloat xv[4];
        for (int q = 0; q < 4; q++) xv[q] = vf_load((const float *)(x + j + 32 * q));
        for (int r = 0; r < SPLIT_ROWS; r++) {
            vfloat w[4];
            vf_split_unit(w, p + (size_t)r * SPLIT_UNIT_BYTES, t);
            for (int q = 0; q < 4; q++) acc[r] = vf_dot_bf16(acc[r], w[q], xv[q]);
        }
    }
    store_sums(out, 1, acc, n_rows, 1, SPLIT_ROWS, 1);
}

/* The rows of a block (at p) as bfloat16 rows of `cols` in dst. */
static void split_unpack(uint16_t *dst, const uint8_t *p, const uint8_t *table, int cols) {
    const vint t = vi_split_table(table);
    for (int j = 0; j < cols; j += SPLIT_COLS)
        for (int r = 0; r < SPLIT_ROWS; r++, p += SPLIT_UNIT_BYTES) {
            vfloat w[4];
            vf_split_unit(w, p, t);
            for (int q = 0; q < 4; q++) vf_store((float *)(dst + (size_t)r * cols + j + 32 * q), w[q]);
        }
}

/* Input k's column j in bfloat16, from in->xf as prepare_inputs lays it out. */
static float input_bf16(const Inputs *in, int k, int j) {
    return bf16_to_float(((const uint16_t *)in->xf)[bf16_input_at(in->n, in->cols, (size_t)k, j)]);
}

/* out (in->n, W.rows) += the exceptions of the block of rows i.. times
   inputs k0..k1-1 (the ones the dot products just wrote, still in the
   first-level cache: added row by row over the whole batch, they missed
   it, and a 1B-shape prompt ran 20% slower), each product exact in
   float32, added after the block's dot products in the order of their
   columns: the same for a row of any batch. */
static void add_exceptions(float *out, const Matrix *W, int i, const Inputs *in, int k0, int k1) {
    const size_t b = (size_t)i / SPLIT_ROWS;
    for (int k = k0; k < k1; k++)
        for (uint32_t e = W->exception_first[b]; e < W->exception_first[b + 1]; e++) {
            const SplitException *x = &W->exceptions[e];
            out[(size_t)k * W->rows + x->row] += x->value * input_bf16(in, k, (int)x->col);
        }
}

/* Rows i.. (a block) of a bfloat16 matrix in 12 bits times all the input
   rows: one row as the units are unpacked (block_split); more, the block
   unpacked once into this thread's scratch and multiplied as the bfloat16
   rows it holds, a pass of MB_INPUTS inputs at a time (block_f32), each
   pass prefetching its share of `next`, the next block (NULL: none), as
   block_f32 spreads it over its steps (4/3 of it: block_f32 counts 2 bytes
   a weight). Unpacking costs these 64-row prompt steps 2-7% (1B shape,
   against the same rows read in place); the share prefetched in one burst
   before each pass, 5-12%; none, 5-13%. */
static void matmul_split_block(float *out, const Matrix *W, int i, const void *next, const Inputs *in) {
    const uint8_t *p = matrix_weights(W, i);
    const int rows = W->rows, cols = W->cols, n = in->n, n_rows = rows - i < SPLIT_ROWS ? rows - i : SPLIT_ROWS;
    if (n == 1) {
        block_split(out + i, p, W->split_table, cols, n_rows, (const uint16_t *)in->xf);
        add_exceptions(out, W, i, in, 0, 1);
        return;
    }
    uint16_t *block = scratch_grow(&split_scratch, (size_t)SPLIT_ROWS * cols * sizeof(uint16_t));
    split_unpack(block, p, W->split_table, cols);
    const int passes = (n + MB_INPUTS - 1) / MB_INPUTS;
    const size_t bytes = packed_block_bytes(W);
    for (int pass = 0; pass < passes; pass++) {
        const int b = pass * MB_INPUTS;
        const float *xp = in->xf + (size_t)b * cols / 2;
        const uint8_t *share = next ? (const uint8_t *)next + bytes * (size_t)pass / (size_t)passes : NULL;
        block_f32(out + (size_t)b * rows + i, (size_t)rows, block, (size_t)cols, n_rows, share, passes, xp, n - b, cols, NULL, NULL, MB_ROWS,
                  MB_INPUTS, DOT_BF16);
        add_exceptions(out, W, i, in, b, b + MB_INPUTS < n ? b + MB_INPUTS : n);
    }
}
#endif

/* Rows i.. (a block) of W times all the input rows; `next`: the weights of
   the next block (NULL: none). */
static void matmul_block(float *out, const Matrix *W, int i, const void *next, const Inputs *in) {
    const void *w = matrix_weights(W, i);
    if (in->kind == KERNEL_F32_SIMD) {
        if (W->w) matmul_float_block(out, W, i, w, next, in, LOAD_F32);
        else if (W->bf16) matmul_float_block(out, W, i, w, next, in, LOAD_BF16);
        else matmul_float_block(out, W, i, w, next, in, LOAD_F16);
        return;
    }
    if (in->kind == KERNEL_BF16_DOT) {
        matmul_float_block(out, W, i, w, next, in, DOT_BF16);
        return;
    }
#ifdef BF16_SPLIT
    if (in->kind == KERNEL_BF16_SPLIT) {
        matmul_split_block(out, W, i, next, in);
        return;
    }
#endif
#ifdef PACKED_Q
    if (W->packed) { /* VNNI builds: every int8 or 4-bit matrix */
        if (in->kind == KERNEL_Q4_SIMD) matmul_packed(out, W, i, next, in, 4, 0);
        else if (in->kind == KERNEL_Q5_SIMD) matmul_packed(out, W, i, next, in, 5, 0);
        else if (in->kind == KERNEL_Q6_SIMD) matmul_packed(out, W, i, next, in, 6, 0);
        else if (in->kind == KERNEL_TABLE_SIMD) matmul_packed(out, W, i, next, in, 4, 1);
        else matmul_packed(out, W, i, next, in, 8, 0);
        return;
    }
#endif
#ifndef VNNI
    const int rows = W->rows, cols = W->cols, n = in->n, groups = cols / W->group_size;
#ifdef HAVE_Q4_SIMD
    if (in->kind == KERNEL_Q4_SIMD) {
        const uint8_t *pre = next ? next : W->q4 + (size_t)i * cols / 2;
        const int n_rows = rows - i < MM_ROWS ? rows - i : MM_ROWS;
        if (n == 1) {
            block_q4(out + i, (size_t)rows, W, i, n_rows, pre, in->xq, in->xs, 1, 1);
            return;
        }
        for (int b = 0; b < n; b += Q4_INPUTS)
            block_q4(out + (size_t)b * rows + i, (size_t)rows, W, i, n_rows, pre, in->xq + (size_t)b * cols, in->xs + (size_t)b * groups,
                     n - b, Q4_INPUTS);
        return;
    }
#endif
    if (n == 1) {
        block_q8(out + i, (size_t)rows, W, i, rows - i < MM_ROWS ? rows - i : MM_ROWS, next, in->xq, in->xs, 1, MM_ROWS, 1);
        return;
    }
    for (int b = 0; b < n; b += QB_INPUTS)
        block_q8(out + (size_t)b * rows + i, (size_t)rows, W, i, rows - i < QB_ROWS ? rows - i : QB_ROWS, b == 0 ? next : NULL,
                 in->xq + (size_t)b * cols, in->xs + (size_t)b * groups, n - b, QB_ROWS, QB_INPUTS);
#endif
}

/* The rows of a block of matmul_simd, for the kernel and the input rows. */
static int block_rows(const Inputs *in) {
    if (in->kind == KERNEL_F32_SIMD || in->kind == KERNEL_BF16_DOT) return in->n == 1 ? MM_ROWS : MB_ROWS;
    if (in->kind == KERNEL_BF16_SPLIT) return SPLIT_ROWS;
#ifdef VNNI
    return PACK_ROWS;
#else
    if (in->x8) return PACK_ROWS; /* packed (AVX2, NEON dotprod) */
    if (in->kind == KERNEL_Q4_SIMD) return MM_ROWS;
    return in->n == 1 ? Q8_ONE_ROWS : Q8_BLOCK_ROWS;
#endif
}

#if SIMD_WIDTH == 8 && defined(VF_HALF_LOADS)
/* AVX2 builds, 16-bit rows times many input rows. A block of MB_ROWS rows
   read all the inputs (a 64-row prompt step of the Llama 3.2 1B shape: 512
   KB of float32 at 2048 columns, as much as a Zen 3 core's second-level
   cache) before the next block: the inputs came from the shared third
   level again for every block, and 2 threads ran at 1.3x one. So a
   parallel work item is a chunk of blocks of about CHUNK_BYTES of weights,
   which stays in the second-level cache while each pass of MB_INPUTS input
   rows (in the first level) goes over all its blocks: the inputs are read
   from beyond the second level once a chunk. Each product is block_f32's
   over whole rows, as before: the same sums. 128-token prompts on Zen 3, 5
   alternating rounds (with the 4 x 3 block): 1B shape F16 1.24x, BF16
   1.13x. */
#define CHUNK_BYTES (128 * 1024)

/* Whether products of many rows take W in chunks of rows (matmul_chunk). */
static int takes_chunks(const Matrix *W) { return kernel_of(W) == KERNEL_F32_SIMD && W->half; }

static int chunk_blocks(const Matrix *W, const Inputs *in) {
    if (in->n == 1 || !takes_chunks(W)) return 1;
    const int blocks = CHUNK_BYTES / (MB_ROWS * W->cols * (int)sizeof(uint16_t));
    const int spread = W->rows / (MB_ROWS * 4 * max_threads()); /* at least 4 chunks a thread */
    const int chunk = blocks < spread ? blocks : spread;
    return chunk > 1 ? chunk : 1;
}

/* Rows i..i + chunk_rows - 1 of a 16-bit matrix W times all the input
   rows, pass by pass; `next`: the next chunk (NULL: none), prefetched a
   share per block and pass. */
static void matmul_chunk(float *out, const Matrix *W, int i, int chunk_rows, const void *next, const Inputs *in) {
    const int rows = W->rows, cols = W->cols, n = in->n, end = i + chunk_rows < rows ? i + chunk_rows : rows;
    const int passes = (n + MB_INPUTS - 1) / MB_INPUTS, blocks = (end - i + MB_ROWS - 1) / MB_ROWS;
    const size_t block_bytes = (size_t)MB_ROWS * cols * sizeof(uint16_t);
    for (int p = 0; p < passes; p++)
        for (int k = 0; k < blocks; k++) {
            const int b = p * MB_INPUTS, r = i + k * MB_ROWS, n_rows = end - r < MB_ROWS ? end - r : MB_ROWS;
            const void *pre = next ? (const char *)next + block_bytes * ((size_t)p * blocks + k) / passes : NULL;
            float *o = out + (size_t)b * rows + r;
            const uint16_t *w = W->half + (size_t)r * cols;
            const float *xp = in->xf + (size_t)b * cols;
            if (W->bf16)
                block_f32(o, (size_t)rows, w, (size_t)cols, n_rows, pre, passes, xp, n - b, cols, NULL, NULL, MB_ROWS, MB_INPUTS, LOAD_BF16);
            else
                block_f32(o, (size_t)rows, w, (size_t)cols, n_rows, pre, passes, xp, n - b, cols, NULL, NULL, MB_ROWS, MB_INPUTS, LOAD_F16);
        }
}
#else
static int chunk_blocks(const Matrix *W, const Inputs *in) {
    (void)W, (void)in;
    return 1;
}
#endif

/* The blocks of rows of `count` matrices of one kind, all in one parallel
   region shared between threads in guided shares (decode in one process,
   runs of 16 tokens alternating with equal shares, 2 threads: Llama 3.2 1B
   shape F16 +4%, BF16 +13%, Q8_0 +11%, Q4_0 +2%, Q4_K_M +2%, Q5_K_M +5%,
   Q6_K +8%; stories110M shape F16 +10%, Q8_0 +7%, Q4_0 -1% to +5%;
   128-token prompts +1-5%); in each block, all input rows, while the
   block's weights stay in the L1 cache. A block is one thread's whole:
   the results do not depend on the shares. Guided shares assume work
   items that cost alike (a thread's first share is half of them), so the
   items are made so: the 16-bit chunks of the matrices of one call all
   take the fewest blocks any of them wants, and each matrix's blocks are
   split evenly between its items (a block apart at most). Before, a
   stories110M-shape layer's wq came in chunks of 84 rows beside wk's and
   wv's of 32 (and one of 12 rows at wq's end), and one of 2 threads got
   two thirds of the work: 64 rows times wq, wk and wv on 2 Zen 3 cores,
   F16, best of 41: 128-130 -> 173 GFLOP/s, wo 129-157 -> 171, w2 (as it
   was) 175 in both. */
static void matmul_simd(const Matrix *const *Ws, float *const *outs, int count, const Inputs *in) {
    int first[MATMUL_SHARED_MAX + 1] = {0}, chunk[MATMUL_SHARED_MAX], least = 0; /* blocks a work item, at most */
    int blocks[MATMUL_SHARED_MAX];
    const int height = block_rows(in);
    double work = 0;
    for (int m = 0; m < count; m++) {
        chunk[m] = chunk_blocks(Ws[m], in);
        if (chunk[m] > 1 && (least == 0 || chunk[m] < least)) least = chunk[m];
    }
    for (int m = 0; m < count; m++) {
        if (chunk[m] > 1) chunk[m] = least;
        blocks[m] = (Ws[m]->rows + height - 1) / height;
        first[m + 1] = first[m] + (blocks[m] + chunk[m] - 1) / chunk[m];
        work += (double)Ws[m]->rows * Ws[m]->cols * in->n;
    }
    (void)work; /* read only by OpenMP */
#ifdef AMX
    if (in->n >= AMX_INPUTS && in->kind >= KERNEL_Q8_SIMD) amx_usable();
#endif
    PARALLEL_GUIDED_IF(work >= PARALLEL_MIN_WORK)
    for (int t = 0; t < first[count]; t++) {
        int m = 0;
        while (t >= first[m + 1]) m++;
        const Matrix *W = Ws[m];
        const int items = first[m + 1] - first[m], k = t - first[m];
        const int i = height * (int)((long long)blocks[m] * k / items), end = height * (int)((long long)blocks[m] * (k + 1) / items); /* rows i..end-1 */
        const void *next = end < W->rows ? matrix_weights(W, end) : NULL;
#if SIMD_WIDTH == 8 && defined(VF_HALF_LOADS)
        if (chunk[m] > 1) {
            matmul_chunk(outs[m], W, i, end - i, next, in);
            continue;
        }
#endif
        matmul_block(outs[m], W, i, next, in);
    }
}
#endif

/* out (n, W.rows) += the part of W @ x that W's offsets make (section 2.2:
   value = q * scale + offset): each row's offsets times the sums of x over
   their groups (group_sums), added group by group (in the same order for
   every row and batch), ADD_OFFSETS_ROWS rows at a time so that the rows of
   a group are one vector loop. Vector builds take SIMD_WIDTH rows of
   OFFSET_INPUTS inputs at a time, each output in a register across the
   groups, fma(offset, s, o) as -Ofast contracts the loop of the rows that
   are left: with many inputs, the offsets were read once per input and the
   outputs loaded and stored once per group, 14% of a Q4_K_M prompt. */
#define ADD_OFFSETS_ROWS 256
#define OFFSET_INPUTS 8

#ifdef SIMD_WIDTH
/* Rows i.. (SIMD_WIDTH of them) of n_in <= OFFSET_INPUTS inputs. */
KERNEL void offsets_block(float *out, const Matrix *W, const float *sums, int i, int n_in) {
    const int rows = W->rows, groups = W->cols / W->group_size;
    vfloat acc[OFFSET_INPUTS];
    const float *s[OFFSET_INPUTS];
    for (int b = 0; b < OFFSET_INPUTS; b++) {
        const int in = b < n_in ? b : n_in - 1;
        acc[b] = vf_load(out + (size_t)in * rows + i);
        s[b] = sums + (size_t)in * groups;
    }
    for (int g = 0; g < groups; g++) {
        const vfloat offset = vf_load(W->offsets + (size_t)g * rows + i);
        for (int b = 0; b < OFFSET_INPUTS; b++) acc[b] = vf_fma(offset, vf_set(s[b][g]), acc[b]);
    }
    for (int b = 0; b < n_in; b++) vf_store(out + (size_t)b * rows + i, acc[b]);
}
#endif

static void add_offsets(float *out, const Matrix *W, const float *sums, int n) {
    const int rows = W->rows, groups = W->cols / W->group_size;
    const int blocks = (rows + ADD_OFFSETS_ROWS - 1) / ADD_OFFSETS_ROWS;
    PARALLEL_FOR_IF(PARALLEL_WORK(W, n)) /* as the product itself */
    for (int k = 0; k < blocks; k++) {
        int i0 = k * ADD_OFFSETS_ROWS;
        const int i1 = i0 + ADD_OFFSETS_ROWS < rows ? i0 + ADD_OFFSETS_ROWS : rows;
#ifdef SIMD_WIDTH
        for (; i0 + SIMD_WIDTH <= i1; i0 += SIMD_WIDTH)
            for (int b = 0; b < n; b += OFFSET_INPUTS)
                offsets_block(out + (size_t)b * rows, W, sums + (size_t)b * groups, i0, n - b < OFFSET_INPUTS ? n - b : OFFSET_INPUTS);
#endif
        for (int b = 0; b < n; b++) {
            float *o = out + (size_t)b * rows;
            for (int g = 0; g < groups; g++) {
                const float s = sums[(size_t)b * groups + g], *offset = W->offsets + (size_t)g * rows;
                for (int i = i0; i < i1; i++) o[i] += offset[i] * s;
            }
        }
    }
}

/* outs[m] (n, Ws[m].rows) = x (n, cols) @ Ws[m]^T for `count` matrices of
   the same columns, that read the same inputs: x is quantised or packed once
   for all of them (for up to MATMUL_SHARED_MAX at a time). */
static void matmul_shared(const Matrix *const *Ws, float *const *outs, int count, const float *x, int n) {
    if (count > MATMUL_SHARED_MAX) {
        matmul_shared(Ws, outs, MATMUL_SHARED_MAX, x, n);
        matmul_shared(Ws + MATMUL_SHARED_MAX, outs + MATMUL_SHARED_MAX, count - MATMUL_SHARED_MAX, x, n);
        return;
    }
    for (int m = 1; m < count; m++)
        if (kernel_of(Ws[m]) != kernel_of(Ws[0]) || !Ws[m]->packed != !Ws[0]->packed || Ws[m]->cols != Ws[0]->cols ||
            Ws[m]->group_size != Ws[0]->group_size) {
            for (int k = 0; k < count; k++) matmul_shared(&Ws[k], &outs[k], 1, x, n);
            return;
        }
    int with_sums = 0; /* packed matrices add their offsets in the kernel */
    for (int m = 0; m < count; m++) with_sums |= Ws[m]->packed && Ws[m]->offset_form != OFFSETS_NONE;
    Inputs in = prepare_inputs(x, n, Ws[0], with_sums);
    for (int m = 0; m < count; m++) {
        if (in.kind == KERNEL_F32_PLAIN) matmul_f32_plain(outs[m], x, Ws[m], n);
        if (in.kind == KERNEL_Q8_PLAIN) matmul_q8_plain(outs[m], in.xq, in.xs, Ws[m], n);
        if (in.kind == KERNEL_Q4_PLAIN) matmul_q4_plain(outs[m], in.xq, in.xs, Ws[m], n);
    }
#ifdef SIMD_WIDTH
    if (in.kind >= KERNEL_F32_SIMD) matmul_simd(Ws, outs, count, &in);
#endif
    float *sums = NULL; /* the matrices share cols and group_size; where prepare_inputs put the
                           kernels' inputs, read no more once the kernels are done */
    for (int m = 0; m < count; m++)
        if (Ws[m]->offsets && !Ws[m]->packed) {
            if (!sums) {
                sums = scratch_get((size_t)n * (Ws[0]->cols / Ws[0]->group_size) * sizeof(float));
                group_sums(sums, x, n, Ws[0]->cols, Ws[0]->group_size);
            }
            add_offsets(outs[m], Ws[m], sums, n);
        }
}

/* out (n, W.rows) = x (n, W.cols) @ W^T with the fastest kernel that fits. */
static void matmul(float *out, const float *x, const Matrix *W, int n) {
    matmul_shared(&W, &out, 1, x, n);
}

/* ---- Packing ---------------------------------------------------------------
   VNNI builds lay out each int8 or 4-bit matrix as packed_q8 reads it when
   the checkpoint is loaded (AVX2 and NEON dotprod builds: the GGUF
   matrices): for each block of PACK_ROWS rows (the last one padded with
   zero rows), 64-byte lines of a 4-byte word a row (int8: 4 columns,
   wq + 128; 4-bit: a unit of 8 columns; 5 and 6 bits: runs of
   SIX_BIT_COLS columns; pack_values); then each block's scales and
   offsets, group by group, a row a lane. The rows come from section 1's
   arrays (run.c's own checkpoints) or straight from a GGUF matrix's
   blocks (stored_row), a block of rows per thread. BF16_SPLIT builds lay
   out GGUF bfloat16 matrices in 12 bits as well (see "Packed weights").
   The copy takes the place of the stored matrix, whose pages are given
   back to the system (only the lookups of the token embedding read it
   again): the weights are in memory once. */

/* Scale g of row r of W as stored. */
static float stored_scale(const Matrix *W, size_t r, int g) {
    return read_f32(W->scales + (r * (size_t)(W->cols / W->group_size) + (size_t)g) * sizeof(float));
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof(a)) == 0; }

/* d, an f16 value, and k[j] in -128..127 with k[j] * d == s[j] bit for bit
   for the n scales s of a run of groups (a K-quant block's d and its
   sub-blocks' scales, or another such pair); 0 when there is none. d is
   the largest scale in magnitude over a multiplier k tried from 128 down,
   each sign (a K-quant's own k is found within a few tries). */
static int shared_scale(const float *s, int n, float *d, int8_t *k) {
    float top = 0.0f;
    for (int j = 0; j < n; j++)
        if (fabsf(s[j]) > fabsf(top)) top = s[j];
    for (int m = 128; m >= 1; m--)
        for (int sign = 1; sign >= -1; sign -= 2) {
            const int km = sign * m;
            *d = top == 0.0f ? 0.0f : top / (float)km;
            if (km > 127 || !same_bits(half_to_float(half_from_float(*d)), *d)) continue;
            int j = 0;
            for (; j < n; j++) {
                const float q = *d == 0.0f ? 0.0f : rintf(s[j] / *d);
                if (!(q >= -128.0f && q <= 127.0f) || !same_bits(q * *d, s[j])) break;
                k[j] = (int8_t)q;
            }
            if (j == n) return 1;
        }
    return 0;
}

/* Which forms hold row r's scales exactly: bit 0 SCALES_SHARED (runs of
   `run` groups), bit 1 SCALES_F16. */
static int row_scale_forms(const Matrix *W, size_t r, int run) {
    const int groups = W->cols / W->group_size;
    int forms = (run > 1 ? 1 : 0) | 2;
    for (int g = 0; g < groups && forms; g += run) {
        float s[256], d;
        int8_t k[256];
        for (int j = 0; j < run; j++) s[j] = stored_scale(W, r, g + j);
        if ((forms & 1) && !shared_scale(s, run, &d, k)) forms &= ~1;
        for (int j = 0; j < run && (forms & 2); j++)
            if (!same_bits(half_to_float(half_from_float(s[j])), s[j])) forms &= ~2;
    }
    return forms;
}

/* The smallest form of W's scales that holds them all exactly (the rows
   looked at by all threads). */
static int scale_form_of(const Matrix *W) {
    const int run = W->scale_run, rows = W->rows;
    if (run < 1 || run > 256 || (run & (run - 1)) != 0 || (W->cols / W->group_size) % run != 0) return SCALES_F32; /* PackedSide */
    uint8_t *forms = xcalloc((size_t)rows, 1);
    PARALLEL_FOR_IF(rows >= 64)
    for (int r = 0; r < rows; r++) forms[r] = (uint8_t)row_scale_forms(W, (size_t)r, run);
    int all = 3;
    for (int r = 0; r < rows; r++) all &= forms[r];
    free(forms);
    return all & 1 ? SCALES_SHARED : all & 2 ? SCALES_F16 : SCALES_F32;
}

/* The bits W's int8 values pack as: 5 when all are in -16..15, 6 in
   -32..31 (the GGUF types of 5 and 6 bits), else 8 (packed_weights); the
   groups must fill runs of SIX_BIT_COLS for 5 or 6. */
static int value_bits_of(const Matrix *W) {
    if (!W->q || W->group_size % SIX_BIT_COLS != 0) return 8; /* whole runs in each group */
    const int rows = W->rows, cols = W->cols;
    uint8_t *fits = xcalloc((size_t)rows, 1);
    PARALLEL_FOR_IF(rows >= 64)
    for (int r = 0; r < rows; r++) {
        const int8_t *q = W->q + (size_t)r * cols;
        int lo = 0, hi = 0;
        for (int j = 0; j < cols; j++) {
            lo = q[j] < lo ? q[j] : lo;
            hi = q[j] > hi ? q[j] : hi;
        }
        fits[r] = (uint8_t)((lo >= -32 && hi <= 31) | (lo >= -16 && hi <= 15) << 1);
    }
    int all = 3;
    for (int r = 0; r < rows; r++) all &= fits[r];
    free(fits);
    return all & 2 ? 5 : all & 1 ? 6 : 8;
}

/* Eight int8 values from q plus c's bytes, each modulo 256 (no carries
   between them), as the bytes of a little-endian word. */
static uint64_t eight_values(const int8_t *q, uint64_t c) {
    const uint64_t low7 = 0x7F7F7F7F7F7F7F7Full;
    uint64_t w;
    memcpy(&w, q, 8);
    return ((w & low7) + (c & low7)) ^ ((w ^ c) & ~low7);
}

/* The 4-bit values of 8 columns (the nibbles of v's bytes) as one unit
   (nibble_half): byte k holds columns k and k + 4. */
static uint32_t nibble_unit(uint64_t v) {
    v &= 0x0F0F0F0F0F0F0F0Full;
    return (uint32_t)v | (uint32_t)(v >> 32) << 4;
}

/* The int8 value that packs as bits of 0 (a lane past a matrix's last row,
   a column past its last; a table's code 0, whatever value it names: those
   lanes' sums are never stored, and a GGUF row is whole blocks of 32). */
static int8_t packed_zero(int bits) { return (int8_t)-(1 << (bits - 1)); }

/* A block's values, as packed_weights reads them, from the int8 values of
   its PACK_ROWS rows (q: row `lane` at q + lane * stride, cols values then
   packed_zero up to stride, a multiple of 8), one 64-byte line at a time,
   the 4-byte words of its PACK_ROWS lanes: 8 bits (q + 128, 4 columns a
   word), 4 (q + 8, a unit of 8 columns a word, column k and k + 4 in byte
   k), 6 (q + 32, a run of SIX_BIT_COLS columns in 3 lines: the low nibbles
   in 2 units, then the tops, bits 2s and 2s + 1 of byte k the top 2 bits of
   column 4s + k) or 5 (q + 16: the 2 lines of low nibbles, then the tops of
   step s (columns 4s .. 4s + 3) in bits 4 lane .. 4 lane + 3 of the run's
   64-bit mask s). Written a line at a time: each line once, in order. */
static void pack_values(uint8_t *block, const int8_t *q, int cols, size_t stride, int bits) {
    uint32_t line[PACK_ROWS];
    for (int j = 0; bits == 8 && j < cols; j += 4, block += 64) {
        for (int lane = 0; lane < PACK_ROWS; lane++) {
            memcpy(&line[lane], q + lane * stride + j, 4);
            line[lane] ^= 0x80808080u; /* each byte + 128 */
        }
        memcpy(block, line, sizeof line);
    }
    for (int j = 0; bits == 4 && j < cols; j += 8, block += 64) {
        for (int lane = 0; lane < PACK_ROWS; lane++) line[lane] = nibble_unit(eight_values(q + lane * stride + j, 0x0808080808080808ull));
        memcpy(block, line, sizeof line);
    }
    const uint64_t centre = bits == 6 ? 0x2020202020202020ull : 0x1010101010101010ull;
    for (int j = 0; (bits == 5 || bits == 6) && j < cols; j += SIX_BIT_COLS) {
        uint64_t v[PACK_ROWS][2];
        for (int lane = 0; lane < PACK_ROWS; lane++)
            for (int h = 0; h < 2; h++) v[lane][h] = eight_values(q + lane * stride + j + 8 * h, centre);
        for (int h = 0; h < 2; h++, block += 64) {
            for (int lane = 0; lane < PACK_ROWS; lane++) line[lane] = nibble_unit(v[lane][h]);
            memcpy(block, line, sizeof line);
        }
        if (bits == 6) {
            for (int lane = 0; lane < PACK_ROWS; lane++) {
                const uint64_t t0 = v[lane][0] >> 4 & 0x0303030303030303ull, t1 = v[lane][1] >> 4 & 0x0303030303030303ull;
                line[lane] = (uint32_t)t0 | (uint32_t)(t0 >> 32) << 2 | (uint32_t)t1 << 4 | (uint32_t)(t1 >> 32) << 6;
            }
            memcpy(block, line, sizeof line);
            block += 64;
            continue;
        }
        uint64_t masks[4] = {0, 0, 0, 0};
        for (int lane = 0; lane < PACK_ROWS; lane++)
            for (int step = 0; step < 4; step++) {
                const uint32_t t = (uint32_t)(v[lane][step / 2] >> (32 * (step % 2) + 4)) & 0x01010101u; /* the top bit of each byte, then as 4 bits */
                masks[step] |= (uint64_t)((t | t >> 7 | t >> 14 | t >> 21) & 15u) << (4 * lane);
            }
        memcpy(block, masks, 32);
        block += 32;
    }
}

static size_t packed_blocks(const Matrix *W) { return ((size_t)W->rows + packed_rows(W) - 1) / packed_rows(W); }

/* A bfloat16 matrix in 12 bits: after its blocks (from this offset),
   exception_first (blocks + 1 of them), then the exceptions. */
static size_t split_first_at(const Matrix *W) { return packed_blocks(W) * packed_block_bytes(W); }
static size_t split_exceptions_at(const Matrix *W) { return split_first_at(W) + (packed_blocks(W) + 1) * sizeof(uint32_t); }

/* The bytes of W packed in the forms that matrix_packed_bytes chose for it
   (0: W does not pack). */
static size_t packed_bytes(const Matrix *W) {
    if (!matrix_packs(W)) return 0;
    if (W->packed_bits == SPLIT_BITS) return (split_exceptions_at(W) + W->n_exceptions * sizeof(SplitException) + 63) / 64 * 64;
    return (packed_blocks(W) * (packed_block_bytes(W) + packed_scale_bytes(W)) + 63) / 64 * 64;
}

/* ---- bfloat16 in 12 bits (BF16_SPLIT) ----
   Chooses W's table from the counts of the high bytes of every
   SPLIT_SAMPLE-th row: 0x00, which holds zero, then the 15 most frequent
   others, the smaller byte first among equals; counts the exceptions of
   every row (each thread a share of them), and packs W (packed_bits
   SPLIT_BITS) unless they are more than 1 in SPLIT_EXCEPTIONS_MAX.
   Returns whether it packs. The count reads every page of W: they are
   mapped in one call first (populate), not faulted in one by one
   (pack_weights gives them back once counted). */
#define SPLIT_SAMPLE 32
#define SPLIT_SHARES 16
static int split_plan(Matrix *W) {
#ifdef BF16_SPLIT
    const size_t cols = (size_t)W->cols, count = (size_t)W->rows * cols;
    uint64_t total[256] = {0};
    populate(W->half, count * sizeof(uint16_t));
    for (size_t r = 0; r < (size_t)W->rows; r += SPLIT_SAMPLE)
        for (size_t j = 0; j < cols; j++) total[W->half[r * cols + j] >> 8]++;
    memset(W->split_table, 0, sizeof(W->split_table));
    for (int k = 1; k < 16; k++) {
        int best = -1;
        for (int h = 1; h < 256; h++) {
            int taken = 0;
            for (int q = 1; q < k; q++) taken |= W->split_table[q] == h;
            if (!taken && total[h] > 0 && (best < 0 || total[h] > total[best])) best = h;
        }
        if (best < 0) break; /* fewer than 16 high bytes: the rest of the table 0x00 */
        W->split_table[k] = (uint8_t)best;
    }
    size_t misses[SPLIT_SHARES] = {0};
    PARALLEL_FOR_IF(W->rows >= SPLIT_SHARES)
    for (int share = 0; share < SPLIT_SHARES; share++)
        for (size_t at = count / 64 * share / SPLIT_SHARES * 64; at < count / 64 * (share + 1) / SPLIT_SHARES * 64; at += 64)
            misses[share] += (size_t)split_misses(W->half + at, W->split_table);
    W->n_exceptions = 0;
    for (int share = 0; share < SPLIT_SHARES; share++) W->n_exceptions += misses[share];
    if (W->n_exceptions > count / SPLIT_EXCEPTIONS_MAX) return 0;
    W->packed_bits = SPLIT_BITS;
    return 1;
#else
    (void)W;
    return 0;
#endif
}

/* The column of a unit's half (64 columns) that byte p of it holds (the
   order vf_split_unit's interleaving undoes): in 128-bit lane L, bytes
   0..7 hold columns 8L.., bytes 8..15 columns 32 + 8L... */
#ifdef BF16_SPLIT
static int split_column(int p) { return p % 16 < 8 ? 8 * (p / 16) + p % 16 : 32 + 8 * (p / 16) + p % 16 - 8; }
#endif

/* Block b of a bfloat16 matrix W into its place in p (its unpacked rows
   past W's zero, as the memory is); each exception written at the next
   free place of `exceptions` (*written of them so far, shared by the
   threads), in no order (split_finish sorts them). */
static void pack_split_block(const Matrix *W, size_t b, uint8_t *p, SplitException *exceptions, size_t *written) {
#ifdef BF16_SPLIT
    const size_t cols = (size_t)W->cols, units = cols / SPLIT_COLS;
    uint8_t *block = p + b * packed_block_bytes(W);
    for (size_t r = 0; r < SPLIT_ROWS && b * SPLIT_ROWS + r < (size_t)W->rows; r++) {
        const size_t row = b * SPLIT_ROWS + r;
        for (size_t u = 0; u < units; u++) {
            const uint16_t *v = W->half + row * cols + u * SPLIT_COLS;
            uint64_t miss[2];
            split_encode_unit(block + (u * SPLIT_ROWS + r) * SPLIT_UNIT_BYTES, v, W->split_table, miss);
            for (int h = 0; h < 2; h++)
                for (uint64_t left = miss[h]; left; left &= left - 1) {
                    const int c = 64 * h + split_column(__builtin_ctzll(left));
                    size_t e;
                    ATOMIC_CAPTURE
                    e = (*written)++;
                    if (e >= W->n_exceptions) die(EXIT_BAD_FILE, "a bfloat16 matrix changed while it was packed (was the file rewritten?)");
                    /* a subnormal as zero, as vdpbf16ps takes the stored ones */
                    const float value = (v[c] & 0x7F80) == 0 ? 0.0f : bf16_to_float(v[c]);
                    exceptions[e] = (SplitException){(uint32_t)row, (uint32_t)(u * SPLIT_COLS + (size_t)c), value};
                }
        }
    }
#else
    (void)W, (void)b, (void)p, (void)exceptions, (void)written;
#endif
}

static int exception_order(const void *a, const void *b) {
    const SplitException *x = a, *y = b;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    return x->col < y->col ? -1 : x->col > y->col;
}

/* Once every block of W is packed at p: its exceptions sorted, and where
   each block's begin. */
static void split_finish(Matrix *W, uint8_t *p) {
    uint32_t *first = (uint32_t *)(p + split_first_at(W));
    SplitException *exceptions = (SplitException *)(p + split_exceptions_at(W));
    qsort(exceptions, W->n_exceptions, sizeof(SplitException), exception_order);
    size_t e = 0;
    for (size_t b = 0; b <= packed_blocks(W); b++) {
        while (e < W->n_exceptions && exceptions[e].row < b * SPLIT_ROWS) e++;
        first[b] = (uint32_t)e;
    }
    W->exception_first = first;
    W->exceptions = exceptions;
}

/* The bytes of W packed (0: W is read as stored), a multiple of 64;
   chooses its bits and the forms of its scales and offsets: for GGUF
   blocks, the ones their type stores (values of 5 or 6 bits as such,
   scales as f16 or shared, or float32 for a type without factors,
   K-quants' offsets as minimums); otherwise the smallest
   that hold W's values and scales exactly, offsets as float32. */
static size_t matrix_packed_bytes(Matrix *W) {
    if (split_candidate(W)) return split_plan(W) ? packed_bytes(W) : 0;
    if (!matrix_packs(W)) return 0;
    if (W->blocks) {
        const GGMLType *type = &ggml_types[W->block_type];
        W->packed_bits = type->value_bits;
        W->packed_table = type->table; /* stored_row's values are its codes, n - 8 */
        W->scale_form = type->e8m0 ? SCALES_E8M0 : !type->factors ? SCALES_F32 : W->scale_run > 1 ? SCALES_SHARED : SCALES_F16;
        W->offset_form = !type->offsets ? OFFSETS_NONE : W->scale_run > 1 ? OFFSETS_MIN : OFFSETS_F32;
        W->offset_centre = (float)(1 << (type->value_bits - 1));
    } else {
        W->packed_bits = W->q4 ? 4 : value_bits_of(W);
        W->scale_form = scale_form_of(W);
        W->offset_form = W->offsets ? OFFSETS_F32 : OFFSETS_NONE;
    }
    return packed_bytes(W);
}

/* One row of W as pack_block takes it, whatever W's source: its values in
   int8 and its scales and offsets as section 1 holds them, with the
   factors of the forms that store them so (k, d for SCALES_SHARED, d alone
   for SCALES_F16: each group's scale; m, dmin for OFFSETS_MIN). */
typedef struct {
    int8_t *q;          /* (cols) */
    float *s, *o;       /* (groups) */
    int8_t *k;          /* (groups) */
    uint8_t *m;         /* (groups) */
    uint16_t *d, *dmin; /* (groups) f16 bits, one a run of scale_run groups (SCALES_F16: one a group) */
} PackRow;

/* Row r of W: unpacked from its GGUF blocks (a table type's codes n - 8,
   as packed_table names them), or read from section 1's
   arrays (a shared scale's factors found by shared_scale). */
static void stored_row(const Matrix *W, size_t r, PackRow *row) {
    const int cols = W->cols, groups = cols / W->group_size;
    if (W->blocks) {
        const GGMLType *type = &ggml_types[W->block_type];
        const int per = type->block / type->group, n_blocks = cols / type->block;
        const uint8_t *b = W->blocks + r * (size_t)n_blocks * type->block_bytes;
        for (int i = 0; i < n_blocks; i++, b += type->block_bytes) {
            type->unpack(b, row->q + (size_t)i * type->block, row->s + i * per, row->o + i * per);
            if (type->factors) type->factors(b, row->d + i, row->k + i * per, row->dmin + i, row->m + i * per);
        }
        return;
    }
    for (int j = 0; j < cols; j++) row->q[j] = W->q ? W->q[r * cols + j] : (int8_t)q4_value(W, r * cols + j);
    for (int g = 0; g < groups; g++) {
        row->s[g] = stored_scale(W, r, g);
        if (W->offsets) row->o[g] = W->offsets[(size_t)g * W->rows + r];
        if (W->scale_form == SCALES_F16) row->d[g] = half_from_float(row->s[g]);
    }
    for (int g = 0; W->scale_form == SCALES_SHARED && g < groups; g += W->scale_run) {
        float d;
        shared_scale(row->s + g, W->scale_run, &d, row->k + g); /* found before, by scale_form_of */
        row->d[g / W->scale_run] = half_from_float(d);
    }
}

/* Row `row`'s scales and offsets into lane `lane` of its packed block's (at
   ws), in W's forms: a group's scale (or k and, once a run, d) at group g's
   lane, then its offset (or m, and once a run dmin). */
static void pack_row_scales(const Matrix *W, uint8_t *ws, size_t lane, const PackRow *row) {
    /* the forms read once: the byte stores below may alias W, which the
       compiler would otherwise read again at every store */
    const int groups = W->cols / W->group_size, runs = W->scale_run > 1 ? groups / W->scale_run : groups;
    const int scale_form = W->scale_form, offset_form = W->offset_form;
    uint8_t *wo = ws + scale_part_bytes(W), *d_at = ws + (size_t)groups * PACK_ROWS, *dmin_at = wo + (size_t)groups * PACK_ROWS;
    for (int g = 0; scale_form == SCALES_F32 && g < groups; g++) memcpy(ws + ((size_t)g * PACK_ROWS + lane) * 4, &row->s[g], 4);
    for (int g = 0; scale_form == SCALES_F16 && g < groups; g++) memcpy(ws + ((size_t)g * PACK_ROWS + lane) * 2, &row->d[g], 2);
    for (int g = 0; scale_form == SCALES_E8M0 && g < groups; g++) ws[(size_t)g * PACK_ROWS + lane] = (uint8_t)(ilogbf(row->s[g]) + 128);
    for (int g = 0; scale_form == SCALES_SHARED && g < groups; g++) ws[(size_t)g * PACK_ROWS + lane] = (uint8_t)row->k[g];
    for (int r = 0; scale_form == SCALES_SHARED && r < runs; r++) memcpy(d_at + ((size_t)r * PACK_ROWS + lane) * 2, &row->d[r], 2);
    for (int g = 0; offset_form == OFFSETS_F32 && g < groups; g++) memcpy(wo + ((size_t)g * PACK_ROWS + lane) * 4, &row->o[g], 4);
    for (int g = 0; offset_form == OFFSETS_MIN && g < groups; g++) wo[(size_t)g * PACK_ROWS + lane] = row->m[g];
    for (int r = 0; offset_form == OFFSETS_MIN && r < runs; r++) memcpy(dmin_at + ((size_t)r * PACK_ROWS + lane) * 2, &row->dmin[r], 2);
}

/* Each thread's buffers for packing matrices of up to `cols` columns and
   `groups` groups a row: a PackRow and the int8 values of a block's rows
   (PACK_ROWS x stride, each row stored_row's q in turn). */
typedef struct {
    char *memory;
    PackRow *rows; /* (threads) */
} PackBuffers;

static size_t pack_stride(int cols) { return ((size_t)cols + 7) / 8 * 8; }

static PackBuffers pack_buffers(int cols, int groups) {
    const int threads = max_threads();
    const size_t row_bytes = ((size_t)groups * (2 * sizeof(float) + 2 + 2 * sizeof(uint16_t)) + PACK_ROWS * pack_stride(cols) + 63) / 64 * 64;
    PackBuffers pb = {xcalloc((size_t)threads, row_bytes), xcalloc((size_t)threads, sizeof(PackRow))};
    for (int t = 0; t < threads; t++) {
        PackRow *r = &pb.rows[t];
        char *b = pb.memory + (size_t)t * row_bytes;
        r->s = (float *)b;
        r->o = r->s + groups;
        r->d = (uint16_t *)(r->o + groups);
        r->dmin = r->d + groups;
        r->k = (int8_t *)(r->dmin + groups);
        r->m = (uint8_t *)r->k + groups;
        r->q = (int8_t *)r->m + groups;
    }
    return pb;
}

static void free_pack_buffers(PackBuffers *pb) {
    free(pb->rows);
    free(pb->memory);
}

/* Block b of W (PACK_ROWS rows from b * PACK_ROWS) into its place in the
   packed values p and scales ps, with the calling thread's buffers. */
static void pack_block(const Matrix *W, size_t b, uint8_t *p, uint8_t *ps, const PackBuffers *pb) {
    const size_t stride = pack_stride(W->cols);
    PackRow row = pb->rows[thread_id()];
    int8_t *values = row.q;
    memset(values, packed_zero(W->packed_bits), PACK_ROWS * stride);
    for (size_t lane = 0; lane < PACK_ROWS && b * PACK_ROWS + lane < (size_t)W->rows; lane++) {
        row.q = values + lane * stride;
        stored_row(W, b * PACK_ROWS + lane, &row);
        pack_row_scales(W, ps + b * packed_scale_bytes(W), lane, &row);
    }
    pack_values(p + b * packed_block_bytes(W), values, W->cols, stride, W->packed_bits);
}

/* The bytes of W's GGUF blocks. */
static size_t stored_block_bytes(const Matrix *W) {
    const GGMLType *type = &ggml_types[W->block_type];
    return (size_t)W->rows * W->cols / (size_t)type->block * (size_t)type->block_bytes;
}

/* Gives back the pages of a packed matrix as stored (in the mapped file, or
   converted). */
static void matrix_release_stored(const Matrix *W) {
    if (!W->packed) return;
    size_t count = (size_t)W->rows * W->cols;
    if (W->blocks) {
        release_pages(W->blocks, stored_block_bytes(W));
        return;
    }
    if (W->half) {
        release_pages(W->half, count * sizeof(uint16_t));
        return;
    }
    release_pages(W->q4 ? (const void *)W->q4 : (const void *)W->q, W->q4 ? count / 2 : count);
    release_pages(W->scales, count / W->group_size * sizeof(float));
    if (W->offsets) release_pages(W->offsets, count / W->group_size * sizeof(float));
}

/* The matrices of t that a matmul reads (*n of them, in an array to
   free): the classifier (packed first: pack_weights), then each layer's 7
   (those a layer has: a layer with experts may have no dense FFN), its
   router and its experts'. */
static Matrix **matmul_matrices(Transformer *t, int *n) {
    Weights *w = &t->weights;
    const int L = t->config.n_layers, E = t->config.n_experts;
    const int H = t->config.mla_rank > 0 ? t->config.n_heads : 0;
    Matrix **all = xcalloc(1 + (size_t)L * (11 + 3 * (size_t)E + 2 * (size_t)H), sizeof(Matrix *));
    *n = 0;
    all[(*n)++] = &w->wcls;
    for (int l = 0; w->wq && l < L; l++) {
        Matrix *layer[] = {&w->wq[l], &w->wk[l], &w->wv[l], &w->wo[l], &w->w1[l], &w->w2[l], &w->w3[l], w->router ? &w->router[l] : NULL};
        for (int m = 0; m < 8; m++)
            if (layer[m] && layer[m]->rows > 0) all[(*n)++] = layer[m];
        for (int e = 0; w->router && w->router[l].rows > 0 && e < E; e++) {
            all[(*n)++] = &w->e_gate[(size_t)l * E + e];
            all[(*n)++] = &w->e_up[(size_t)l * E + e];
            all[(*n)++] = &w->e_down[(size_t)l * E + e];
        }
        Matrix *mla[] = {w->wq_a ? &w->wq_a[l] : NULL, w->wq_b ? &w->wq_b[l] : NULL, w->wkv_a ? &w->wkv_a[l] : NULL};
        for (int m = 0; m < 3; m++)
            if (mla[m]) all[(*n)++] = mla[m];
        for (int h = 0; h < H; h++) {
            all[(*n)++] = &w->wk_b[(size_t)l * H + h];
            all[(*n)++] = &w->wv_b[(size_t)l * H + h];
        }
    }
    return all;
}

/* Packs the n matrices `all` into `memory` (zeroed, 64-byte aligned: each
   one's matrix_packed_bytes in turn, its values then its scales, or a
   bfloat16 matrix's blocks then its exceptions; that call chose its
   forms), a block of rows at a time. All the threads take blocks
   in one region, matrix after matrix, none waiting for the others at a
   matrix's end; `release`: each matrix's pages as stored are given back
   once its last block is packed. `meanwhile` (NULL: nothing) runs first on thread 0, which then
   joins the others (t and arg are its arguments). */
static void pack_matrices(Matrix **all, int n, uint8_t *memory, int release, void (*meanwhile)(Transformer *t, void *arg), Transformer *t,
                          void *arg) {
    int cols = 1, groups = 1;
    size_t *left = xcalloc((size_t)n, sizeof(size_t)), total = 0; /* the blocks of each still to pack, of all */
    size_t *at = xcalloc((size_t)n, sizeof(size_t)); /* where each begins in memory */
    for (int m = 0; m < n; m++) {
        at[m] = m == 0 ? 0 : at[m - 1] + packed_bytes(all[m - 1]);
        if (!matrix_packs(all[m])) continue;
        total += left[m] = packed_blocks(all[m]);
        if (all[m]->cols > cols) cols = all[m]->cols;
        if (all[m]->group_size > 0 && all[m]->cols / all[m]->group_size > groups) groups = all[m]->cols / all[m]->group_size;
    }
    size_t *written = xcalloc((size_t)n, sizeof(size_t)); /* bfloat16 in 12 bits: the exceptions of each so far */
    PackBuffers pb = pack_buffers(cols, groups);
    PARALLEL_REGION_IF(total >= 4)
    {
        if (meanwhile && thread_id() == 0) meanwhile(t, arg);
        for (int m = 0; m < n; m++) {
            Matrix *W = all[m];
            const size_t blocks = matrix_packs(W) ? packed_blocks(W) : 0;
            uint8_t *p = blocks > 0 ? memory + at[m] : NULL, *ps = blocks > 0 ? p + blocks * packed_block_bytes(W) : NULL;
            SHARED_LOOP
            for (size_t b = 0; b < blocks; b++) {
                if (W->packed_bits == SPLIT_BITS) pack_split_block(W, b, p, (SplitException *)(p + split_exceptions_at(W)), &written[m]);
                else pack_block(W, b, p, ps, &pb);
                size_t still;
                ATOMIC_CAPTURE
                still = --left[m];
                if (still == 0) { /* the matrix's last block */
                    if (W->packed_bits != SPLIT_BITS) W->packed_scales = ps;
                    W->packed = p;
                    if (release) matrix_release_stored(W);
                }
            }
        }
    }
    /* after the region's barrier, which makes every thread's exceptions
       visible to this one */
    for (int m = 0; m < n; m++)
        if (all[m]->packed_bits == SPLIT_BITS) split_finish(all[m], memory + at[m]);
    free_pack_buffers(&pb);
    free(written);
    free(at);
    free(left);
}

/* Packs every matrix that a matmul reads, all in one allocation (so that
   the system can give it 2 MB pages), and gives back the pages of each as
   stored once it is packed (the classifier's too when it is the token
   embedding: lookups map them again): the peak of memory is the packed
   copy and the matrices being packed (a GGUF embedding is never a
   converted copy: gguf_embedding). The classifier, the largest matrix of
   a model with a large vocabulary, goes first (matmul_matrices): packed
   last, its pages as stored were all mapped beside the whole packed copy
   at the end (peak RSS loading the Llama 3.2 1B shape: Q4_K_M 1.04 ->
   0.84 GB, BF16 2.47 -> 1.88 GB; the file 0.81 and 2.48 GB). `meanwhile` runs beside the packing
   (pack_matrices): the loading of a GGUF vocabulary, 35 ms of one thread
   for Llama 3's, overlaps the packing of a 1B model's weights. */
static void pack_weights(Transformer *t, void (*meanwhile)(Transformer *t, void *arg), void *arg) {
    int n;
    Matrix **all = matmul_matrices(t, &n);
    size_t bytes = 0;
    for (int m = 0; m < n; m++) {
        bytes += matrix_packed_bytes(all[m]);
        /* a bfloat16 matrix's pages, all mapped by the count of its exceptions, given back
           until the packing maps them again from the system's page cache (up to 0.2 s more
           of the 1B shape's 1.2-1.5 s load): else the whole file would be mapped before any
           matrix is packed */
        if (all[m]->packed_bits == SPLIT_BITS) release_pages(all[m]->half, (size_t)all[m]->rows * all[m]->cols * sizeof(uint16_t));
    }
    if (bytes > 0) {
        t->packing = alloc_pages(bytes, "weights", 0);
        t->packing_bytes = bytes;
    }
    pack_matrices(all, n, t->packing, 1, meanwhile, t, arg);
    if (bytes > 0) advise_huge_pages(t->packing, bytes);
    free(all);
}

/* The pages of every matrix that the kernels read in place from the mapped
   file (float32, and F16 and BF16 in GGUF files, which they widen as they
   load), read and mapped at load rather than faulted in by the first
   prompt: a 128-token prompt of the stories110M shape in BF16 ran 10-20%
   slower cold. Packed or converted matrices were read once already. */
static void populate_in_place(Transformer *t) {
    int n;
    Matrix **all = matmul_matrices(t, &n);
    for (int m = 0; m < n; m++) {
        const Matrix *W = all[m];
        if (W->packed) continue;
        const char *at = W->w ? (const char *)W->w : (const char *)W->half;
        const size_t bytes = (size_t)W->rows * W->cols * (W->w ? sizeof(float) : sizeof(uint16_t));
        if (at && at >= (const char *)t->mapping && at + bytes <= (const char *)t->mapping + t->file_size) populate(at, bytes);
    }
    free(all);
}

static void unpack_weights(Transformer *t) {
    if (t->packing) free_pages(t->packing, t->packing_bytes);
    t->packing = NULL;
}

/* Rotary position embedding on adjacent pairs: for the pair (v[2i], v[2i+1])
   at offset d = 2i mod head_size inside its head, rotate by the angle
   pos * freq[d / 2], where freq[d / 2] = 10000^(-d / head_size) (versions
   0 to 2: `freq` is NULL, computed here exactly as llama2.c does) or comes
   from rope_frequencies() (version 4). q (dim values) is rotated in all
   heads and k (kv_dim values) in the key heads (k may be NULL when kv_dim
   is 0); each angle's cosine and sine are computed once for all the heads.
   `halves` (GGUF qwen2 and others, Hugging Face's order): pair i of a head
   is (v[i], v[i + rot / 2]) instead, turned by the same angle. Only the
   first rot values of a head turn (rot < head_size: partial rotary, as
   Phi-4-mini's), and the cosines and sines are times mscale (LongRoPE's
   attention factor; 1 otherwise). */
typedef struct {
    int head_size, rot, halves;
    float mscale;
    const float *freqs;
} Rope;

static void rope(float *q, float *k, int pos, int dim, int kv_dim, Rope r) {
    for (int head_dim = 0; head_dim < r.rot; head_dim += 2) {
        float freq = r.freqs ? r.freqs[head_dim / 2] : 1.0f / powf(10000.0f, head_dim / (float)r.head_size);
        float val = pos * freq;
        float fcr = cosf(val) * r.mscale, fci = sinf(val) * r.mscale;
        const int first = r.halves ? head_dim / 2 : head_dim, apart = r.halves ? r.rot / 2 : 1;
        for (int i = first; i < dim; i += r.head_size) {
            int n_vectors = i < kv_dim ? 2 : 1;
            for (int v = 0; v < n_vectors; v++) {
                float *vec = v == 0 ? q : k;
                float v0 = vec[i], v1 = vec[i + apart];
                vec[i] = v0 * fcr - v1 * fci;
                vec[i + apart] = v0 * fci + v1 * fcr;
            }
        }
    }
}

/* The gated FFN's activation, h = act(h) * g for n rows of `size` values:
   SwiGLU, act(v) = silu(v) = v * sigmoid(v), or (Gemma) GELU in its tanh
   form, gelu(v) = v / 2 * (1 + tanh(u)) = v * sigmoid(2u) with
   u = sqrt(2 / pi) (v + 0.044715 v^3); or gpt-oss's clamped SwiGLU
   (ggml's swiglu_oai), h = v sigmoid(1.702 v) (u + 1) with v = min(h, 7)
   and u = g clamped to [-7, 7]. Split between threads for a prompt
   chunk (an exponential costs about as much as 20 multiply-adds). The plain
   build uses expf, as llama2.c. The vector builds use exp_poly on blocks of
   GATED_BLOCK values, the end of a row padded into a full block, so that
   the compiler vectorises one loop and every value is computed by the same
   instructions: a row's result does not depend on its place in the batch. */
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f
#ifdef SIMD_WIDTH
#define GATED_BLOCK 16
/* e^x to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in a
   part exact in float and a small correction), e^r by its Taylor series to
   r^7 (the next term is below 2^-27), times 2^n put into the exponent bits.
   x is clamped to [-87, 88], where 2^n is a normal float (NaN goes to -87:
   the callers multiply by x itself, so NaN still comes out). */
static inline float exp_poly(float x) {
    if (!(x > -87.0f)) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    float n = floorf(x * 1.44269504f + 0.5f);
    float r = fmaf(n, -0.693359375f, x); /* fmaf: kept apart under -Ofast */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return p * scale;
}

KERNEL void gated_block(float *h, const float *g, const int activation) {
    if (activation == ACT_SWIGLU_OAI) {
        for (int i = 0; i < GATED_BLOCK; i++) {
            const float v = h[i] < SWIGLU_OAI_LIMIT ? h[i] : SWIGLU_OAI_LIMIT;
            const float u = g[i] < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : g[i] > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : g[i];
            h[i] = v / (1.0f + exp_poly(-SWIGLU_OAI_ALPHA * v)) * (u + 1.0f);
        }
        return;
    }
    for (int i = 0; i < GATED_BLOCK; i++) {
        const float v = h[i], minus = activation == ACT_SILU ? -v : -1.5957691216f * (v + 0.044715f * v * v * v);
        h[i] = v / (1.0f + exp_poly(minus)) * g[i];
    }
}

static void gated_activation(int activation, float *h, const float *g, int n, int size) {
    const int blocks = (size + GATED_BLOCK - 1) / GATED_BLOCK;
    PARALLEL_FOR_IF(20.0 * n * size >= PARALLEL_MIN_WORK)
    for (int item = 0; item < n * blocks; item++) {
        size_t at = (size_t)(item / blocks) * size + (size_t)(item % blocks) * GATED_BLOCK;
        int count = size - item % blocks * GATED_BLOCK;
        float hp[GATED_BLOCK] = {0}, gp[GATED_BLOCK] = {0};
        float *hb = h + at;
        const float *gb = g + at;
        if (count < GATED_BLOCK) { /* the end of a row, padded */
            memcpy(hp, hb, (size_t)count * sizeof(float));
            memcpy(gp, gb, (size_t)count * sizeof(float));
            hb = hp, gb = gp;
        }
        if (activation == ACT_SILU) gated_block(hb, gb, ACT_SILU);
        else if (activation == ACT_GELU) gated_block(hb, gb, ACT_GELU);
        else gated_block(hb, gb, ACT_SWIGLU_OAI);
        if (count < GATED_BLOCK) memcpy(h + at, hp, (size_t)count * sizeof(float));
    }
}
#else
static void gated_activation(int activation, float *h, const float *g, int n, int size) {
    PARALLEL_FOR_IF(20.0 * n * size >= PARALLEL_MIN_WORK)
    for (size_t i = 0; i < (size_t)n * size; i++) {
        float val = h[i], up = g[i];
        if (activation == ACT_SWIGLU_OAI) {
            val = val < SWIGLU_OAI_LIMIT ? val : SWIGLU_OAI_LIMIT;
            up = up < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : up > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : up;
            h[i] = val / (1.0f + expf(-SWIGLU_OAI_ALPHA * val)) * (up + 1.0f);
            continue;
        }
        if (activation == ACT_SILU) val *= (1.0f / (1.0f + expf(-val)));
        else val /= 1.0f + expf(-1.5957691216f * (val + 0.044715f * val * val * val));
        val *= up;
        h[i] = val;
    }
}
#endif

/* ------------------------------------------------------------------------ */
/* 4. The paged key/value cache and the forward pass                        */
/* ------------------------------------------------------------------------ */

/* ---- Blocks, block tables, reference counts -------------------------------
   The cache is a pool of blocks of KV_BLOCK positions (the KVCache struct in
   section 1). A sequence holds a block table: entry i is the block with its
   positions i * KV_BLOCK .. i * KV_BLOCK + KV_BLOCK - 1. Blocks are reference
   counted so that sequences share what they have in common: the beams of a
   beam search share the blocks of their common past, and requests whose
   prompts start alike share the blocks of that prefix. A block held by more
   than one table is never written: a sequence about to write into one copies
   it first (copy on write), which can only happen to its last, partly filled
   block. Free blocks wait in two lists; an indexed one keeps its contents for
   a later prompt until the pool runs out of plain ones. */

enum { BLOCK_PLAIN, BLOCK_PENDING, BLOCK_READY }; /* not indexed; indexed, being computed; indexed, computed */

typedef struct {
    int *ids;   /* (cap) block ids in position order */
    int n, cap;
    /* --keep (generation past the context, see kv_slot): 0 slots is off */
    int slots;          /* positions the table holds at most (the context) */
    int keep;           /* leading positions never dropped (attention sinks) */
    int shift;          /* 0 .. slots - keep - 1: how far the ring after them has turned */
    long long dropped;  /* positions dropped so far */
    /* the blocks whose windowed layers' rows (the cache's win) the table
       holds: wfirst .. wend - 1 (see "Windowed layers") */
    int wfirst, wend;
} BlockTable;

static void list_remove(KVCache *c, int list, int b) {
    if (c->prev[b] >= 0) c->next[c->prev[b]] = c->next[b];
    else c->head[list] = c->next[b];
    if (c->next[b] >= 0) c->prev[c->next[b]] = c->prev[b];
    else c->tail[list] = c->prev[b];
}

static void list_append(KVCache *c, int list, int b) {
    c->prev[b] = c->tail[list];
    c->next[b] = -1;
    if (c->tail[list] >= 0) c->next[c->tail[list]] = b;
    else c->head[list] = b;
    c->tail[list] = b;
}

/* b at the head of the list: a plain block freed goes first in line, so
   that the blocks in use stay few and warm (a beam's copied last block is
   freed and taken again at every step); an indexed one waits at the tail
   (list_append), as the last to be taken for reuse. */
static void list_prepend(KVCache *c, int list, int b) {
    c->next[b] = c->head[list];
    c->prev[b] = -1;
    if (c->head[list] >= 0) c->prev[c->head[list]] = b;
    else c->tail[list] = b;
    c->head[list] = b;
}

static int free_list_of(const KVCache *c, int b) { return c->state[b] == BLOCK_READY; }

/* The bytes of one cache row (a key or a value) of kv_dim values of `type`. */
static size_t kv_row_bytes(int type, int kv_dim) {
    if (type == KV_F16) return (size_t)kv_dim * sizeof(uint16_t);
    if (type == KV_Q8_0) return (size_t)kv_dim + (size_t)kv_dim / KV_GROUP * sizeof(float);
    return (size_t)kv_dim * sizeof(float);
}

/* n_blocks rounded up to whole runs of KV_RUN: the blocks laid out. */
static size_t kv_padded_blocks(int n_blocks) { return ((size_t)n_blocks + KV_RUN - 1) / KV_RUN * KV_RUN; }

/* Bytes of c->key, and of c->value. */
static size_t kv_array_bytes(const KVCache *c) { return kv_padded_blocks(c->n_blocks) * c->n_layers * KV_BLOCK * c->row_bytes; }

/* Whether layer l attends to a sliding window of positions (Gemma 3's
   local layers, gpt-oss's even ones; Config window_period). */
static int layer_windowed(const Config *p, int l) {
    return p->window > 0 && l % p->window_period != p->window_period - 1;
}

/* Rows a position stores a layer: a key and a value, or (MLA) one row that
   is both (the latent c and the RoPE key: the values are the latent). */
static int kv_rows_of(const Config *p) { return p->mla_rank > 0 ? 1 : 2; }

/* Bytes of one block's keys and values, all its layers. */
static double kv_block_bytes(const KVCache *c) { return (c->values_in_keys ? 1.0 : 2.0) * c->row_bytes * c->n_layers * KV_BLOCK; }

/* A pool of n_blocks blocks of `type`, all free, for n_layers layers. */
static void kv_pool_init(KVCache *c, const Config *p, int n_layers, int n_blocks, int type) {
    int kv_dim = kv_dim_of(p);
    if (type == KV_Q8_0 && kv_dim % KV_GROUP != 0)
        die(EXIT_USAGE, "--kv-type q8_0 needs a key/value dimension that is a multiple of %d; this model's is %d", KV_GROUP, kv_dim);
    size_t row_bytes = kv_row_bytes(type, kv_dim);
    double bytes = (double)kv_rows_of(p) * row_bytes * n_layers * (double)kv_padded_blocks(n_blocks) * KV_BLOCK;
    if (bytes > (double)(SIZE_MAX / 4))
        die(EXIT_BAD_FILE, "the key/value cache would need %.3g bytes, too large for this machine", bytes);
    memset(c, 0, sizeof(*c));
    c->n_blocks = n_blocks;
    c->n_layers = n_layers;
    c->kv_dim = kv_dim;
    c->type = type;
    c->row_bytes = row_bytes;
    c->values_in_keys = kv_rows_of(p) == 1;
    const char *what = "the key/value cache; --ctx-size, --kv-mb or --kv-type make it smaller";
    if (n_layers > 0) { /* a model whose every layer is windowed has none outside the window pool */
        c->key = alloc_pages(kv_array_bytes(c), what, 1);
        if (!c->values_in_keys) c->value = alloc_pages(kv_array_bytes(c), what, 1);
    }
    c->ref = xcalloc((size_t)n_blocks, sizeof(int));
    c->prev = xcalloc((size_t)n_blocks, sizeof(int));
    c->next = xcalloc((size_t)n_blocks, sizeof(int));
    c->state = xcalloc((size_t)n_blocks, sizeof(int));
    c->tokens = xcalloc((size_t)n_blocks * KV_BLOCK, sizeof(int));
    c->parent = xcalloc((size_t)n_blocks, sizeof(int));
    c->generation = xcalloc((size_t)n_blocks, sizeof(unsigned));
    c->parent_generation = xcalloc((size_t)n_blocks, sizeof(unsigned));
    c->chain = xcalloc((size_t)n_blocks, sizeof(int));
    for (c->n_buckets = 1; c->n_buckets < n_blocks; c->n_buckets *= 2) {}
    c->bucket = xcalloc((size_t)c->n_buckets, sizeof(int));
    for (int i = 0; i < c->n_buckets; i++) c->bucket[i] = -1;
    c->head[0] = c->head[1] = c->tail[0] = c->tail[1] = -1;
    for (int b = 0; b < n_blocks; b++) list_append(c, 0, b);
}

/* A cache of n_blocks blocks of `type`, all free. In a model with windowed
   layers, window_blocks > 0 puts those layers' rows in a pool of their own
   of that many blocks (see "Windowed layers"); 0 keeps every layer here. */
static void kv_init(KVCache *c, const Config *p, int n_blocks, int window_blocks, int type) {
    int n_windowed = 0;
    for (int l = 0; l < p->n_layers; l++) n_windowed += layer_windowed(p, l);
    if (window_blocks == 0 || n_windowed == 0) {
        kv_pool_init(c, p, p->n_layers, n_blocks, type);
        return;
    }
    kv_pool_init(c, p, p->n_layers - n_windowed, n_blocks, type);
    c->win = xcalloc(1, sizeof(KVCache));
    kv_pool_init(c->win, p, n_windowed, window_blocks, type);
    c->window = p->window;
    c->layer_at = xcalloc((size_t)p->n_layers, sizeof(int));
    for (int l = 0, g = 0, w = 0; l < p->n_layers; l++) c->layer_at[l] = layer_windowed(p, l) ? -1 - w++ : g++;
    c->partner = xcalloc((size_t)n_blocks, sizeof(int));
    c->win->partner = xcalloc((size_t)window_blocks, sizeof(int));
    for (int b = 0; b < n_blocks; b++) c->partner[b] = -1;
    for (int b = 0; b < window_blocks; b++) c->win->partner[b] = -1;
}

static void kv_free(KVCache *c) {
    if (c->key) free_pages(c->key, kv_array_bytes(c));
    if (c->value) free_pages(c->value, kv_array_bytes(c));
    free(c->ref); free(c->prev); free(c->next); free(c->state);
    free(c->tokens); free(c->parent); free(c->generation); free(c->parent_generation);
    free(c->chain); free(c->bucket);
    if (c->win) kv_free(c->win);
    free(c->win); free(c->layer_at); free(c->partner);
    memset(c, 0, sizeof(*c));
}

/* ---- The prefix index ------------------------------------------------------
   A full block is indexed under the KV_BLOCK tokens it holds and its parent,
   the indexed block before it in its sequence (-1 for positions 0..). Two
   blocks with the same key hold the same tokens at the same positions after
   the same past, so their keys and values are the same bits (a row's
   arithmetic does not depend on its batch): a prompt that starts like an
   indexed chain takes its blocks instead of computing them. A parent link
   records the parent's generation; a block taken for reuse starts a new
   generation, so links to its old self no longer match. */

static uint32_t prefix_bucket(const KVCache *c, int parent, unsigned parent_gen, const int *tokens) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)parent ^ ((uint64_t)parent_gen << 32);
    for (int i = 0; i < KV_BLOCK; i++) h = (h ^ (uint32_t)tokens[i]) * 1099511628211ull;
    return (uint32_t)(h ^ (h >> 32)) & (uint32_t)(c->n_buckets - 1);
}

/* The indexed block holding `tokens` after `parent`, or -1. */
static int prefix_find(const KVCache *c, int parent, const int *tokens) {
    unsigned gen = parent >= 0 ? c->generation[parent] : 0;
    for (int b = c->bucket[prefix_bucket(c, parent, gen, tokens)]; b >= 0; b = c->chain[b])
        if (c->parent[b] == parent && c->parent_generation[b] == gen &&
            memcmp(c->tokens + (size_t)b * KV_BLOCK, tokens, KV_BLOCK * sizeof(int)) == 0)
            return b;
    return -1;
}

/* Indexes block b (held, full or about to be) under its tokens and parent,
   unless an equal block is indexed already. */
static void prefix_add(KVCache *c, int b, int parent, const int *tokens, int state) {
    if (c->state[b] != BLOCK_PLAIN || prefix_find(c, parent, tokens) >= 0) return;
    c->state[b] = state;
    c->parent[b] = parent;
    c->parent_generation[b] = parent >= 0 ? c->generation[parent] : 0;
    memcpy(c->tokens + (size_t)b * KV_BLOCK, tokens, KV_BLOCK * sizeof(int));
    uint32_t h = prefix_bucket(c, parent, c->parent_generation[b], tokens);
    c->chain[b] = c->bucket[h];
    c->bucket[h] = b;
}

static void prefix_remove(KVCache *c, int b) {
    if (c->state[b] == BLOCK_PLAIN) return;
    uint32_t h = prefix_bucket(c, c->parent[b], c->parent_generation[b], c->tokens + (size_t)b * KV_BLOCK);
    int *link = &c->bucket[h];
    while (*link != b) link = &c->chain[*link];
    *link = c->chain[b];
    c->state[b] = BLOCK_PLAIN;
}

/* ---- Taking and giving back blocks ------------------------------------- */

/* Block b of a cache with windowed layers is taken for new positions: the
   partner that kept its windowed rows (free, for a later prompt: see
   "Windowed layers") holds nothing worth keeping any more. */
static void partner_forget(KVCache *c, int b) {
    KVCache *w = c->win;
    int p = c->partner[b];
    list_remove(w, 1, p);
    w->state[p] = BLOCK_PLAIN;
    list_prepend(w, 0, p);
    w->partner[p] = c->partner[b] = -1;
}

/* A free block for the caller to fill (reference count 1): a plain one if
   any, else the indexed one freed longest ago, which leaves the index. The
   engine promises blocks before it takes them (see Engine), so one is free. */
static int block_take(KVCache *c) {
    int list = c->head[0] >= 0 ? 0 : 1, b = c->head[list];
    if (b < 0) die(EXIT_BAD_FILE, "internal error: the key/value cache has no free block");
    list_remove(c, list, b);
    prefix_remove(c, b);
    if (c->win && c->partner[b] >= 0) partner_forget(c, b);
    c->generation[b]++;
    c->ref[b] = 1;
    if (++c->held > c->peak_held) c->peak_held = c->held;
    return b;
}

static void block_hold(KVCache *c, int b) {
    if (c->ref[b]++ > 0) return;
    list_remove(c, free_list_of(c, b), b);
    if (++c->held > c->peak_held) c->peak_held = c->held;
}

/* Drops one reference; a block nobody holds becomes free. One still being
   computed leaves the index, as nobody will finish it. */
static void block_release(KVCache *c, int b) {
    if (--c->ref[b] > 0) return;
    c->held--;
    if (c->state[b] == BLOCK_PENDING) prefix_remove(c, b);
    if (free_list_of(c, b) == 0) list_prepend(c, 0, b);
    else list_append(c, 1, b);
}

/* ---- Windowed layers ------------------------------------------------------
   A windowed layer's row at pos attends to positions pos - window + 1 .. pos
   only (attention_start), so a sequence never reads its keys and values
   further back again. In a model with such layers (Gemma 3: 5 of every 6)
   the cache keeps their rows in a second pool, win, of blocks of the same
   KV_BLOCK positions, held only while some sequence's window covers them: a
   context of N positions costs the other layers' rows for N positions and
   the windowed layers' for about the window. The main pool's blocks, now of
   the other layers only, work as before: block tables, reference counts,
   copy on write, the prefix index. A main block's partner is the block of
   win with the windowed rows of the same positions. A table holds the
   partners of its blocks wfirst .. wend - 1, a reference each: it takes a
   block's partner when it first writes into the block (table_prepare_write)
   and gives back those wholly before its window once the positions it has
   computed (a Sequence's n_cached) have left them (table_leave_window). Only
   computed positions count: a sequence never goes back before them
   (speculative drafts past them are verified or overwritten later), so it
   never gives back a row it may read again. A partner whose last holder lets
   go of it stays linked to its main block while that block is in the prefix
   index, in win's second free list, taken last: a later prompt that resumes
   within its window takes it (engine_start); otherwise it is freed plainly.
   The draft model's cache (speculative decoding) keeps every layer in one
   pool, since its sequences roll back (speculator_setup). */

/* The first block whose windowed rows a sequence needs when its next
   position to compute is `next`. */
static int window_first_block(const KVCache *c, int next) {
    return next >= c->window ? (next - c->window + 1) / KV_BLOCK : 0;
}

/* A free block of win for the windowed rows of new positions (reference
   count 1): a plain one if any, else the one kept for a prefix longest ago,
   whose main block loses it. Promised beforehand, as block_take's. */
static int window_take(KVCache *c) {
    KVCache *w = c->win;
    int list = w->head[0] >= 0 ? 0 : 1, p = w->head[list];
    if (p < 0) die(EXIT_BAD_FILE, "internal error: the key/value cache has no free block for the windowed layers");
    list_remove(w, list, p);
    if (list == 1) {
        c->partner[w->partner[p]] = -1;
        w->state[p] = BLOCK_PLAIN;
    }
    w->ref[p] = 1;
    if (++w->held > w->peak_held) w->peak_held = w->held;
    return p;
}

/* Drops a table's reference to the partner of main block b. Its last holder
   leaves it linked (BLOCK_READY, the list kept for prefixes) only where b is
   indexed and computed, so that a later prompt may take both. */
static void window_release(KVCache *c, int b) {
    KVCache *w = c->win;
    int p = c->partner[b];
    if (w->ref[p] == 1) {
        w->state[p] = c->state[b] == BLOCK_READY ? BLOCK_READY : BLOCK_PLAIN;
        if (w->state[p] == BLOCK_PLAIN) c->partner[b] = w->partner[p] = -1;
    }
    block_release(w, p);
}

/* Gives back the partners of t's blocks that no position from `next` on
   reads: `next` is the first position t has not computed. */
static void table_leave_window(KVCache *c, BlockTable *t, int next) {
    if (!c->win) return;
    for (int first = window_first_block(c, next); t->wfirst < first; t->wfirst++) window_release(c, t->ids[t->wfirst]);
}

static void table_push(BlockTable *t, int b) {
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 8;
        int *ids = realloc(t->ids, (size_t)t->cap * sizeof(int));
        if (!ids) die(EXIT_BAD_FILE, "out of memory (block table of %d blocks)", t->cap);
        t->ids = ids;
    }
    t->ids[t->n++] = b;
}

/* Gives back every block of t and empties it (the partners first, whose
   fate depends on their main blocks' state). */
static void table_clear(KVCache *c, BlockTable *t) {
    for (int i = t->wfirst; i < t->wend; i++) window_release(c, t->ids[i]);
    for (int i = 0; i < t->n; i++) block_release(c, t->ids[i]);
    t->n = t->wfirst = t->wend = 0;
}

static void table_free(KVCache *c, BlockTable *t) {
    table_clear(c, t);
    free(t->ids);
    memset(t, 0, sizeof(*t));
}

/* dst becomes a second holder of src's blocks. */
static void table_copy(KVCache *c, BlockTable *dst, const BlockTable *src) {
    table_clear(c, dst);
    for (int i = 0; i < src->n; i++) {
        block_hold(c, src->ids[i]);
        table_push(dst, src->ids[i]);
    }
    for (int i = src->wfirst; i < src->wend; i++) block_hold(c->win, c->partner[src->ids[i]]);
    dst->wfirst = src->wfirst;
    dst->wend = src->wend;
}

/* ---- Generation past the context (--keep N) -------------------------------
   When a sequence's cache is full (slots positions, the context), its oldest
   position after the first `keep` is dropped for each new one (attention
   sinks, as StreamingLLM has them): positions are renumbered by slot, so the
   key in slot j attends as position j and each new query at slots - 1. A
   drop moves no data: the slots after the first `keep` are a ring of
   w = slots - keep physical slots, and logical slot j >= keep lives at
       keep + (j - keep + shift) mod w,
   where shift counts drops modulo w; the new position takes the slot of the
   one dropped. kv_slot() is that mapping, and every store and load goes
   through it (kv_row).

   Keys are stored rotated (RoPE) at their PHYSICAL slot P, as they are
   without --keep, where P is the position: until the cache is full nothing
   differs, bit for bit, in every cache type (storing keys unrotated and
   rotating them when read would round f16 and q8_0 keys differently, and
   cost a rotation per key per token). The key of logical slot j then has to
   be turned by j - P, which is 0 for the sinks, shift for the logical slots
   keep .. slots - 1 - shift and shift - w for the rest; since q . R(d) k =
   (R(-d) q) . k, attention instead reads those two stretches with the query
   rotated at pos + (P - j) (kv_query_turn): two extra rotations of each
   query, none of the keys. */

/* The physical slot of logical position pos of table t. */
static int kv_slot(const BlockTable *t, int pos) {
    if (t->shift == 0 || pos < t->keep) return pos;
    int w = t->slots - t->keep, r = pos - t->keep + t->shift; /* r < 2w */
    return t->keep + (r >= w ? r - w : r);
}

/* Which query reads logical position pos of t: 0 the row's own (rotated at
   its position), 1 the one rotated `shift` further, 2 `shift - w` further. */
static int kv_query_turn(const BlockTable *t, int pos) {
    int d = kv_slot(t, pos) - pos;
    return d == 0 ? 0 : d > 0 ? 1 : 2;
}

/* A full table drops its oldest position after the first `keep`: the ring
   turns by one, and logical slot slots - 1 is the dropped one's, free. */
static void table_drop_oldest(BlockTable *t) {
    t->shift = t->shift + 1 == t->slots - t->keep ? 0 : t->shift + 1;
    t->dropped++;
}

/* Where layer `layer` of block `block` starts in the keys (or the values),
   in bytes. Blocks go in runs of KV_RUN, each run holding its blocks' rows
   layer by layer: a layer's rows of a run are contiguous (attention streams
   them), and a short prompt's rows of all the layers lie in a few 2 MB
   pages, whose first touch costs milliseconds (it may compact memory
   first): in layer-major order a 128-token prompt touched a 2 MB page for
   each layer. */
static size_t kv_block_offset(const KVCache *c, int layer, int block) {
    size_t run = (size_t)block / KV_RUN, in_run = (size_t)block % KV_RUN;
    return ((run * c->n_layers + layer) * KV_RUN + in_run) * KV_BLOCK * c->row_bytes;
}

/* The key (values = 0) or the value of position pos of the model's layer
   `layer` of block table t: the one place that maps a position to the
   cache. A windowed layer's rows are in the partner of the main block. */
static unsigned char *kv_row(const KVCache *c, int layer, const BlockTable *t, int pos, int values) {
    int slot = kv_slot(t, pos), block = t->ids[slot / KV_BLOCK];
    if (c->layer_at) {
        layer = c->layer_at[layer];
        if (layer < 0) {
            block = c->partner[block];
            layer = -1 - layer;
            c = c->win;
        }
    }
    return (values ? c->value : c->key) + kv_block_offset(c, layer, block) + (size_t)(slot % KV_BLOCK) * c->row_bytes;
}

/* ---- The cache's element types ---------------------------------------------
   float32 rows are stored as they are. f16: IEEE half precision, rounded to
   nearest even (the F16C instruction where the compiler targets it, else the
   plain C below, which gives the same bits). q8_0: per group of 32 values,
   scale = (largest magnitude) / 127 in float32, q = x / scale rounded half
   away from zero, 0 where the scale is 0. */

/* float32 -> half, round to nearest even: overflow to infinity, subnormal
   halves below 2^-14, NaN stays a (quiet) NaN with its payload's top bits. */
#if !defined(__F16C__) || defined(TESTING) /* tests compare it with F16C's */
static uint16_t half_from_float_plain(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: infinity */
    if (ax <= 0x33000000u) return (uint16_t)sign;             /* <= 2^-25: zero (2^-25 is a tie to 0) */
    uint32_t r, rem, half;
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24 */
        int shift = 126 - (int)(ax >> 23);
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        r = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else { /* normal: exponent rebased from 127 to 15, 13 mantissa bits dropped */
        r = (ax - 0x38000000u) >> 13;
        rem = ax & 0x1fffu;
        half = 0x1000u;
    }
    if (rem > half || (rem == half && (r & 1))) r++; /* a carry into the exponent is right */
    return (uint16_t)(sign | r);
}

static float half_to_float_plain(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact */
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    x = sign | (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, sizeof(f));
    return f;
}
#endif

#ifdef __F16C__
#include <immintrin.h>
static uint16_t half_from_float(float f) { return (uint16_t)_cvtss_sh(f, 0); /* 0: to nearest even */ }
static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static uint16_t half_from_float(float f) { return half_from_float_plain(f); }
static float half_to_float(uint16_t h) { return half_to_float_plain(h); }
#endif

/* x (n values, n a multiple of KV_GROUP) as a q8_0 row: n int8, then n / 32
   float32 scales. */
static void q8_row_from_floats(unsigned char *row, const float *x, int n) {
    int8_t *q = (int8_t *)row;
    float *scales = (float *)(row + n);
    for (int g = 0; g < n / KV_GROUP; g++) {
        const float *xg = x + g * KV_GROUP;
        float amax = 0.0f;
        for (int i = 0; i < KV_GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        float scale = amax / 127.0f;
        scales[g] = scale;
        for (int i = 0; i < KV_GROUP; i++) q[g * KV_GROUP + i] = (int8_t)(scale != 0.0f ? roundf(xg[i] / scale) : 0.0f);
    }
}

/* Stores n floats as a cache row of type c->type. */
static void kv_encode(const KVCache *c, unsigned char *row, const float *x, int n) {
    if (c->type == KV_F16) {
        uint16_t *h = (uint16_t *)row;
        for (int i = 0; i < n; i++) h[i] = half_from_float(x[i]);
    } else if (c->type == KV_Q8_0) {
        q8_row_from_floats(row, x, n);
    } else {
        memcpy(row, x, (size_t)n * sizeof(float));
    }
}

/* The one function that stores a cache row: the key k and value v
   (kv_dim floats each) of position pos of layer `layer`, in the cache's type. */
static void kv_store(KVCache *c, int layer, const BlockTable *t, int pos, const float *k, const float *v) {
    kv_encode(c, kv_row(c, layer, t, pos, 0), k, c->kv_dim);
    if (!c->values_in_keys) kv_encode(c, kv_row(c, layer, t, pos, 1), v, c->kv_dim);
}

/* The one function that finds a cache row to read: the key (values = 0) or
   the value (values = 1) of position pos of layer `layer`, as stored (MLA:
   the key row both); kv_dot and kv_axpy read its values. */
static const unsigned char *kv_load(const KVCache *c, int layer, const BlockTable *t, int pos, int values) {
    return kv_row(c, layer, t, pos, values && !c->values_in_keys);
}

/* Bytes of values from..from+n-1 of a row (the int8 part for q8_0), for
   prefetching. */
static size_t kv_span(const KVCache *c, size_t from, size_t n, size_t *start) {
    size_t size = c->type == KV_F32 ? sizeof(float) : c->type == KV_F16 ? sizeof(uint16_t) : 1;
    *start = from * size;
    return n * size;
}

/* The reads of attention, on a row as stored, without a float copy of it.
   q . row[off..off+n-1]: in vector builds, when the stretch is whole vectors
   (for q8_0: of one group each), one vector accumulator takes the products
   SIMD_WIDTH values at a time and its lanes are added up at the end (vf_sum);
   otherwise in order (the plain build: llama2.c's order). */
#ifdef SIMD_WIDTH
/* Whether row[off..off+n-1] is read as vectors: whole vectors, of a type
   this build loads as vectors. */
static int kv_vectors(const KVCache *c, int off, int n) {
#ifdef VF_CACHE_LOADS
    (void)c;
    const int typed = 1;
#else
    const int typed = c->type == KV_F32;
#endif
    return typed && off % SIMD_WIDTH == 0 && n % SIMD_WIDTH == 0;
}

/* Values j..j+SIMD_WIDTH-1 of a row of `type` (kv_dim values), as floats;
   always inlined, so that the type is a constant where it is one. */
static inline __attribute__((always_inline)) vfloat kv_vector(const unsigned char *row, int j, int kv_dim, int type) {
#ifdef VF_CACHE_LOADS
    if (type == KV_F16) return vf_load_half((const uint16_t *)row + j);
    if (type == KV_Q8_0) return vf_load_i8_scaled((const int8_t *)row + j, ((const float *)(row + kv_dim))[j / KV_GROUP]);
#endif
    (void)kv_dim; (void)type;
    return vf_load((const float *)row + j);
}
#endif

/* Value j of a row, as a float. */
static float kv_value(const KVCache *c, const unsigned char *row, int j) {
    if (c->type == KV_F32) return ((const float *)row)[j];
    if (c->type == KV_F16) return half_to_float(((const uint16_t *)row)[j]);
    return (float)((const int8_t *)row)[j] * ((const float *)(row + c->kv_dim))[j / KV_GROUP];
}

static float kv_dot(const KVCache *c, const unsigned char *row, int off, const float *q, int n) {
#ifdef SIMD_WIDTH
    if (kv_vectors(c, off, n)) {
        vfloat acc = vf_zero();
        for (int i = 0; i < n; i += SIMD_WIDTH) acc = vf_fma(vf_load(q + i), kv_vector(row, off + i, c->kv_dim, c->type), acc);
        return vf_sum(acc);
    }
#endif
    float score = 0.0f;
    if (c->type == KV_F32) { /* as llama2.c */
        const float *k = (const float *)row + off;
        for (int i = 0; i < n; i++) score += q[i] * k[i];
        return score;
    }
    for (int i = 0; i < n; i++) score += q[i] * kv_value(c, row, off + i);
    return score;
}

/* xb[0..n-1] += a * row[off..off+n-1], the same way (one fused multiply-add
   per value in vector builds). */
static void kv_axpy(const KVCache *c, const unsigned char *row, int off, float a, float *xb, int n) {
#ifdef SIMD_WIDTH
    if (kv_vectors(c, off, n)) {
        vfloat va = vf_set(a);
        for (int i = 0; i < n; i += SIMD_WIDTH) vf_store(xb + i, vf_fma(va, kv_vector(row, off + i, c->kv_dim, c->type), vf_load(xb + i)));
        return;
    }
#endif
    if (c->type == KV_F32) { /* as llama2.c */
        const float *v = (const float *)row + off;
        for (int i = 0; i < n; i++) xb[i] += a * v[i];
        return;
    }
    for (int i = 0; i < n; i++) xb[i] += a * kv_value(c, row, off + i);
}

/* Copies the first n rows of block `from` of pool c to block `to`, every
   layer. */
static void kv_copy_rows(KVCache *c, int from, int to, int n) {
    size_t bytes = (size_t)n * c->row_bytes;
    for (int l = 0; l < c->n_layers; l++) {
        size_t src = kv_block_offset(c, l, from), dst = kv_block_offset(c, l, to);
        memcpy(c->key + dst, c->key + src, bytes);
        if (!c->values_in_keys) memcpy(c->value + dst, c->value + src, bytes);
    }
}

/* Makes position pos writable for table t: a new block when pos starts one,
   or a private copy of a shared last block (its first pos % KV_BLOCK
   positions, every layer, its partner's too); and, in a cache with windowed
   layers, a partner for a block t writes into for the first time. Once a
   table drops positions (--keep), it writes into full blocks, so that
   nobody else ever reads what the ring overwrites: a shared one is copied
   whole first (a free block exists then, since the promises count a shared
   block once per holder), and one of its own leaves the prefix index (a new
   generation: links to it go stale). */
static void table_prepare_write(KVCache *c, BlockTable *t, int pos) {
    int slot = kv_slot(t, pos), i = slot / KV_BLOCK;
    if (i == t->n) {
        table_push(t, block_take(c));
    } else if (c->ref[t->ids[i]] == 1) {
        int old = t->ids[i];
        if (t->dropped > 0 && c->state[old] != BLOCK_PLAIN) {
            prefix_remove(c, old);
            c->generation[old]++;
        }
    } else {
        int old = t->ids[i], fresh = block_take(c), rows = t->dropped > 0 ? KV_BLOCK : slot % KV_BLOCK;
        kv_copy_rows(c, old, fresh, rows);
        if (i < t->wend) {
            int p = window_take(c);
            kv_copy_rows(c->win, c->partner[old], p, rows);
            window_release(c, old);
            c->partner[fresh] = p;
            c->win->partner[p] = fresh;
        }
        block_release(c, old);
        t->ids[i] = fresh;
    }
    if (c->win && i == t->wend) {
        int b = t->ids[i], p = window_take(c);
        c->partner[b] = p;
        c->win->partner[p] = b;
        t->wend++;
    }
}

/* ---- Activations ---------------------------------------------------------- */

/* Rows of attention scores (a query head of a row: context floats) that a
   thread holds at once: all heads of a decoding row, or ATTENTION_SCORES
   for a tile of a prompt's rows (rows x query heads of one key head) or a
   group of decoding rows (rows x the heads of a thread). More rows read the
   cache fewer times: on a 3968-token prompt (stories110M shape, 2 threads),
   96 rows ran 1.1x faster than 32, and 16 requests decoding after a common
   3000-token prompt 1.3x; 64 and 128 did no better than 96. Rows of
   scores lie ATTENTION_PAD floats more than the context apart, so that they
   fall in different sets of the first-level cache, and so that
   attention_softmax has room for whole vectors. */
#define ATTENTION_SCORES 96
#define ATTENTION_PAD 16
static int attention_score_rows(const Config *p) { return p->n_heads > ATTENTION_SCORES ? p->n_heads : ATTENTION_SCORES; }
static size_t attention_score_stride(int context) { return (size_t)context + ATTENTION_PAD; }

/* Cached positions that attention takes at once (section 4): their keys
   (values) stay in the first-level cache while every query of a tile uses
   them, and the next block's are prefetched meanwhile. */
#define ATTENTION_KEYS 16
/* Query heads whose sums of a block of keys a lone row's scores hold at once
   (dot_rows): a 16 KB array with AVX-512. */
#define ATTENTION_ROW_HEADS 16
/* How far ahead a lone row's attention prefetches the rows it reads whole
   (dot_rows, axpy_rows): the rows in the next 6 KB (on a 3968-position
   cache, 2 f32 rows of 3 KB ran faster than 4 or 8, 4 f16 rows than 2 or
   8). */
#ifdef SIMD_WIDTH
#define ATTENTION_AHEAD_BYTES 6144
static int attention_ahead(const KVCache *c) { return (int)((ATTENTION_AHEAD_BYTES + c->row_bytes - 1) / c->row_bytes); }
/* ahead[] = the keys (values = 0) or values of a table that the kernels
   prefetch while reading positions t0..t0+n-1: up to n rows from
   attention_ahead positions on, up to `last`. Returns how many. */
static int attention_rows_ahead(const KVCache *c, int layer, const BlockTable *table, int t0, int n, int last, int values,
                                const unsigned char **ahead) {
    int n_ahead = 0;
    for (int tp = t0 + attention_ahead(c); tp <= last && n_ahead < n; tp++) ahead[n_ahead++] = kv_load(c, layer, table, tp, values);
    return n_ahead;
}
#endif
/* Vector builds sum each output of attention over positions in chunks of
   ATTENTION_CHUNK, each from zero, and add the chunks' sums in order: the
   threads can then share a lone row's values by position (section 4), and
   every path sums alike. Plain builds keep llama2.c's one sum over all
   positions: a chunk longer than any context. */
#ifdef SIMD_WIDTH
#define ATTENTION_CHUNK 256
#else
#define ATTENTION_CHUNK (1 << 30)
#endif
static int attention_chunks(int context) { return (context - 1) / ATTENTION_CHUNK + 1; }

/* Floats of one thread's attention buffers (AttnScratch, section 4): the
   rows of scores, their queries (three sets: --keep), outputs and sums of a
   chunk, and a block of cached rows as floats. */
static size_t attention_floats(const Config *p, int context) {
    return (size_t)attention_score_rows(p) * (attention_score_stride(context) + 5 * (size_t)p->head_size) +
           (size_t)ATTENTION_KEYS * kv_dim_of(p);
}

/* A score q . k divided by sqrt(head_size), as llama2.c does: by = RunState's
   att_scale. With reciprocal math (-Ofast), a compiler turns divisions by
   one value into multiplications by its reciprocal where it counts enough
   of them, so that one score could round differently in two places; those
   builds multiply by the reciprocal everywhere, computed once.
   An architecture may multiply the scores by a factor of its own
   (att_multiplier: Gemma 3, Granite) instead: divided by its reciprocal. */
#if defined(__RECIPROCAL_MATH__) || defined(__FAST_MATH__)
static float attention_scale_of(const Config *p) { return p->att_multiplier > 0.0f ? p->att_multiplier : 1.0f / sqrtf(p->head_size); }
static inline float attention_scale(float score, float by) { return score * by; }
#else
static float attention_scale_of(const Config *p) { return p->att_multiplier > 0.0f ? 1.0f / p->att_multiplier : sqrtf(p->head_size); }
static inline float attention_scale(float score, float by) { return score / by; }
#endif

/* Activations for `max_rows` rows at once, for sequences of at most
   `context` positions, and a cache of n_blocks blocks of kv_type (and
   window_blocks for the windowed layers: kv_init). */
static void alloc_run_state(RunState *s, const Config *p, int max_rows, int context, int n_blocks, int window_blocks, int kv_type) {
    int kv_dim = kv_dim_of(p);
    size_t rows = (size_t)max_rows;
    s->max_rows = max_rows;
    s->context = context;
    s->att_scale = attention_scale_of(p);
    s->x = xcalloc(rows * p->dim, sizeof(float));
    s->xb = xcalloc(rows * (p->dim > q_dim(p) ? p->dim : q_dim(p)), sizeof(float));
    s->xb2 = xcalloc(rows * p->dim, sizeof(float));
    const int ffn = p->hidden_dim > p->shared_hidden ? p->hidden_dim : p->shared_hidden;
    s->hb = xcalloc(rows * ffn, sizeof(float));
    s->hb2 = xcalloc(rows * ffn, sizeof(float));
    s->q = xcalloc(rows * q_dim(p), sizeof(float));
    s->q_turned = xcalloc(rows * 2 * q_dim(p), sizeof(float));
    s->k = xcalloc(rows * kv_dim, sizeof(float));
    s->v = xcalloc(rows * kv_dim, sizeof(float));
    s->att = xcalloc((size_t)max_threads() * attention_floats(p, context), sizeof(float));
    s->chunks = xcalloc((size_t)attention_chunks(context) * q_dim(p), sizeof(float));
    s->tiles = xcalloc(rows + 1, sizeof(int));
    s->groups = xcalloc(rows + 1, sizeof(int));
    s->logits = xcalloc(rows * (size_t)p->vocab_size, sizeof(float));
    if (p->n_experts > 0) {
        const size_t k = (size_t)p->n_experts_used;
        s->router = xcalloc(rows * p->n_experts, sizeof(float));
        s->chosen = xcalloc(rows * k, sizeof(int));
        s->route_w = xcalloc(rows * k, sizeof(float));
        s->slot_of = xcalloc(rows * k, sizeof(int));
        s->ex = xcalloc(rows * p->dim, sizeof(float));
        s->eh = xcalloc(rows * p->expert_hidden, sizeof(float));
        s->eh2 = xcalloc(rows * p->expert_hidden, sizeof(float));
        s->slots = xcalloc(rows * k * p->dim, sizeof(float));
    }
    if (p->mla_rank > 0) {
        const int per_head = p->mla_nope + p->rope_dims > p->mla_value ? p->mla_nope + p->rope_dims : p->mla_value;
        int in = p->mla_rank > p->q_rank ? p->mla_rank : p->q_rank;
        if (p->mla_nope > in) in = p->mla_nope;
        s->mla_q = xcalloc(rows * p->n_heads * per_head, sizeof(float));
        s->mla_in = xcalloc(rows * in, sizeof(float));
        s->mla_out = xcalloc(rows * (in > p->mla_rank + p->rope_dims ? in : p->mla_rank + p->rope_dims), sizeof(float));
    }
    kv_init(&s->cache, p, n_blocks, window_blocks, kv_type);
}

static void free_run_state(RunState *s) {
    free(s->x); free(s->xb); free(s->xb2); free(s->hb); free(s->hb2);
    free(s->q); free(s->q_turned); free(s->k); free(s->v); free(s->att); free(s->chunks); free(s->tiles); free(s->groups); free(s->logits);
    free(s->router); free(s->chosen); free(s->route_w); free(s->slot_of); free(s->ex); free(s->eh); free(s->eh2); free(s->slots);
    free(s->mla_q); free(s->mla_in); free(s->mla_out);
    kv_free(&s->cache);
    memset(s, 0, sizeof(*s));
}

/* ---- The forward pass ----------------------------------------------------- */

/* A batch of rows to push through the transformer together: row r is token
   token[r] at position pos[r] of the sequence whose block table is table[r]
   (a block for pos[r], held by that table alone, must be in it: see
   table_prepare_write). Its attention reads that table's positions
   0..pos[r]. Rows of one sequence at consecutive positions may share a
   batch (a prompt chunk): within each layer every row's key and value is
   stored before any row attends. */
typedef struct {
    int n_rows;
    const int *token;               /* (n_rows) */
    const int *pos;                 /* (n_rows) */
    const BlockTable *const *table; /* (n_rows) */
    const int *logit_rows;          /* (n_logits) rows whose logits are wanted, ascending */
    int n_logits;
} Batch;

/* ---- Attention in tiles ------------------------------------------------------
   A tile is up to tile_rows rows of one sequence at consecutive positions
   (the same block table). Attention walks the cached positions once per
   tile and head range, ATTENTION_KEYS at a time: each block of keys
   (values) read from the cache is used at once by every query of the tile
   that attends to it, and by every query head sharing its key head. The
   scores of all positions are kept (each row's softmax is over all of
   them, as when rows were taken one by one): (tile rows) x (heads at once)
   rows of scores, at most attention_score_rows(p).
   A thread's buffers (AttnScratch) also hold the tile's queries and outputs
   packed: rows of q and xb lie dim floats apart, which for dims like 768
   puts the same head of every row in the same few sets of the first-level
   cache. */

/* One thread's part of RunState.att. */
typedef struct {
    float *scores; /* (score_rows, stride): softmax weights of positions 0..pos */
    float *q;      /* (3, score_rows, head_size) the queries of the rows of scores, by kv_query_turn */
    float *out;    /* (score_rows, head_size) their outputs */
    float *chunk;  /* (score_rows, head_size) their sums over the chunk of positions at hand (ATTENTION_CHUNK) */
    float *rows;   /* (ATTENTION_KEYS, kv_dim) a block of f16 or q8_0 keys or values, as floats */
    size_t stride; /* floats from one row of scores to the next */
    size_t turn;   /* score_rows * head_size: from one set of queries to the next */
} AttnScratch;

/* The buffers of thread `thread`. */
static AttnScratch attention_scratch(const Config *p, const RunState *s, int thread) {
    AttnScratch a;
    const size_t rows = (size_t)attention_score_rows(p);
    a.stride = attention_score_stride(s->context);
    a.scores = s->att + (size_t)thread * attention_floats(p, s->context);
    a.q = a.scores + rows * a.stride;
    a.turn = rows * (size_t)p->head_size;
    a.out = a.q + 3 * a.turn;
    a.chunk = a.out + a.turn;
    a.rows = a.chunk + a.turn;
    return a;
}

/* Splits the rows of b into tiles of up to tile_rows rows, each of one
   sequence at consecutive positions: first[i] is tile i's first row,
   first[n_tiles] = b->n_rows. Returns n_tiles. */
static int attention_tiles(const Batch *b, int tile_rows, int *first) {
    int n_tiles = 0;
    for (int r = 0; r < b->n_rows; r++) {
        int start = n_tiles > 0 ? first[n_tiles - 1] : 0;
        if (n_tiles == 0 || r - start == tile_rows || b->table[r] != b->table[r - 1] || b->pos[r] != b->pos[r - 1] + 1)
            first[n_tiles++] = r;
    }
    first[n_tiles] = b->n_rows;
    return n_tiles;
}

/* Groups the tiles first[0..n_tiles-1] of b for attention: a group is a
   tile of several rows, or up to `rows` tiles of one row each whose tables
   start with the same block (beams, or requests whose prompts start alike,
   decoding). The queries of a group take each block of cached positions in
   turn, so that the blocks their tables share are read from memory once.
   group[i] is group i's first tile, group[n_groups] = n_tiles. Returns
   n_groups. */
static int attention_groups(const Batch *b, const int *first, int n_tiles, int rows, int *group) {
    int n_groups = 0;
    for (int j = 0; j < n_tiles; j++)
        if (j == 0 || first[j + 1] - first[j] > 1 || first[j] - first[j - 1] > 1 || j - group[n_groups - 1] == rows ||
            b->table[first[j]]->ids[0] != b->table[first[j - 1]]->ids[0])
            group[n_groups++] = j;
    group[n_groups] = n_tiles;
    return n_groups;
}

/* The softmax of a row of attention scores, x[0..size-1]. The plain build
   calls softmax() (llama2.c's); vector builds take it SIMD_WIDTH scores at a
   time, e^x by vf_exp and the sum in vector lanes added up by vf_sum, so x
   must have room for size rounded up to a whole vector (rows of scores are
   ATTENTION_PAD floats longer than the context). Each weight depends on its
   row alone, not on where the row lies. */
#ifdef SIMD_WIDTH
/* e^x for x <= 0, within a unit in the last place (the unit tests measure
   it): x = n ln 2 + r with |r| <= ln(2) / 2, e^r by Cephes's polynomial,
   times 2^n. Below -87 it gives e^-87 (about 1.6e-38), which beside the
   largest score's e^0 = 1 weighs nothing. */
static inline vfloat vf_exp(vfloat x) {
    x = vf_max(x, vf_set(-87.0f));
    vfloat n = vf_round(vf_mul(x, vf_set(1.44269504088896341f)));
    vfloat r = vf_fma(n, vf_set(-0.693359375f), x); /* ln 2 in two parts, the first exact in few bits */
    r = vf_fma(n, vf_set(2.12194440e-4f), r);
    vfloat p = vf_set(1.9875691500e-4f);
    p = vf_fma(p, r, vf_set(1.3981999507e-3f));
    p = vf_fma(p, r, vf_set(8.3334519073e-3f));
    p = vf_fma(p, r, vf_set(4.1665795894e-2f));
    p = vf_fma(p, r, vf_set(1.6666665459e-1f));
    p = vf_fma(p, r, vf_set(5.0000001201e-1f));
    vfloat e = vf_add(vf_fma(p, vf_mul(r, r), r), vf_set(1.0f));
    return vf_mul(e, vf_pow2(n));
}

static void attention_softmax(float *x, int size, float sink) {
    const int whole = size / SIMD_WIDTH * SIMD_WIDTH, n = whole < size ? whole + SIMD_WIDTH : whole;
    for (int i = size; i < n; i++) x[i] = -INFINITY;
    vfloat m = vf_load(x);
    for (int i = SIMD_WIDTH; i < n; i += SIMD_WIDTH) m = vf_max(m, vf_load(x + i));
    float lanes[SIMD_WIDTH], max_val = sink;
    vf_store(lanes, m);
    for (int k = 0; k < SIMD_WIDTH; k++)
        if (lanes[k] > max_val) max_val = lanes[k];
    const vfloat minus_max = vf_set(-max_val);
    vfloat sum = vf_zero();
    for (int i = 0; i < n; i += SIMD_WIDTH) {
        vf_store(x + i, vf_exp(vf_add(vf_load(x + i), minus_max)));
        if (i == whole) /* the last, partial vector: the lanes past size add nothing */
            for (int k = size; k < n; k++) x[k] = 0.0f;
        sum = vf_add(sum, vf_load(x + i));
    }
    const vfloat inverse = vf_set(1.0f / (vf_sum(sum) + (sink > -INFINITY ? expf(sink - max_val) : 0.0f)));
    for (int i = 0; i < n; i += SIMD_WIDTH) vf_store(x + i, vf_mul(vf_load(x + i), inverse));
}
#else
static void attention_softmax(float *x, int size, float sink) {
    if (sink == -INFINITY) {
        softmax(x, size);
        return;
    }
    float max_val = sink, sum = 0.0f;
    for (int i = 0; i < size; i++)
        if (x[i] > max_val) max_val = x[i];
    for (int i = 0; i < size; i++) {
        x[i] = expf(x[i] - max_val);
        sum += x[i];
    }
    sum += expf(sink - max_val);
    for (int i = 0; i < size; i++) x[i] /= sum;
}
#endif

/* The kernels of a block of keys. Each score and each output value is
   computed exactly as kv_dot and kv_axpy compute it (the unit tests check
   it bit for bit), so a row's attention does not depend on the other rows
   of its tile; vector builds only keep more of it in registers and in
   flight: the accumulators of SIMD_WIDTH keys' scores at once, added up
   with vf_sums, and the outputs of several queries across keys. */

#ifdef SIMD_WIDTH
/* scores[k] = q . key_k[off..off+hs-1] * or / scale for the n <= ATTENTION_KEYS
   rows keys[0..n-1] of `type`, read as vectors, SIMD_WIDTH keys at a time
   (a constant type in each inlined copy). */
KERNEL void dot_block(const unsigned char *const *keys, int n, int off, const float *q, int hs, float scale, float *scores, int kv_dim,
                      const int type) {
    for (int k0 = 0; k0 < n; k0 += SIMD_WIDTH) {
        vfloat acc[SIMD_WIDTH];
        const unsigned char *key[SIMD_WIDTH]; /* past n: key k0 again, its sum unused */
        for (int k = 0; k < SIMD_WIDTH; k++) {
            acc[k] = vf_zero();
            key[k] = keys[k0 + k < n ? k0 + k : k0];
        }
        for (int i = 0; i < hs; i += SIMD_WIDTH) {
            vfloat qi = vf_load(q + i);
            for (int k = 0; k < SIMD_WIDTH; k++) acc[k] = vf_fma(qi, kv_vector(key[k], off + i, kv_dim, type), acc[k]);
        }
        float sums[SIMD_WIDTH];
        vf_store(sums, vf_sums(acc));
        for (int k = 0; k < SIMD_WIDTH && k0 + k < n; k++) scores[k0 + k] = attention_scale(sums[k], scale);
    }
}

/* out_r[i..i+V*SIMD_WIDTH-1] += sum_k w_r[k] * value_k[off+i..] for R
   queries r (weights w + r * ws, outputs out + r * os) and the n rows
   `values` of `type`, keys in order: each output one fused multiply-add
   per key, as kv_axpy. R, V and the type are constants in each inlined
   copy. */
KERNEL void axpy_slab(const unsigned char *const *values, int n, int off, int i, const float *w, size_t ws, float *out, size_t os,
                      int kv_dim, const int type, const int R, const int V) {
    vfloat acc[4][4];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = vf_load(out + r * os + i + v * SIMD_WIDTH);
    for (int k = 0; k < n; k++) {
        vfloat x[4];
        for (int v = 0; v < V; v++) x[v] = kv_vector(values[k], off + i + v * SIMD_WIDTH, kv_dim, type);
        for (int r = 0; r < R; r++) {
            vfloat a = vf_set(w[r * ws + k]);
            for (int v = 0; v < V; v++) acc[r][v] = vf_fma(a, x[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) vf_store(out + r * os + i + v * SIMD_WIDTH, acc[r][v]);
}

/* The lane sums of q . row[off..off+hs-1] (a query head and its key head). */
KERNEL vfloat head_dot(const float *q, const unsigned char *row, int off, int hs, int kv_dim, const int type) {
    vfloat acc = vf_zero();
    for (int i = 0; i < hs; i += SIMD_WIDTH) acc = vf_fma(vf_load(q + i), kv_vector(row, off + i, kv_dim, type), acc);
    return acc;
}

/* scores[h * stride + k] = q_k,h . key_k[kv head of h] * or / scale for every
   query head h (kv_mul query heads to a key head) and the n <= ATTENTION_KEYS
   rows keys[0..n-1] of `type`, query k,h at q[k] + h * hs (each key's query:
   kv_query_turn). Rows are read whole and in order, SIMD_WIDTH at a time: the
   sums of each (key, head) wait in `part` until those of SIMD_WIDTH keys are
   added up at once (vf_sums), so each score is dot_block's; f16 rows have
   each sum added up at once (vf_sum, the same pairs), as their conversion
   leaves the shuffles room (on a Zen 5 at depth 3968, f16 scores then took
   12-15% less time, f32 and q8_0 scores 3% and 7% more). Row k of ahead
   (n_ahead rows, row_bytes each) is prefetched as row k is read: spread over
   the reads, where a burst of prefetches would find the misses it adds to
   already queued. */
KERNEL void dot_rows(const unsigned char *const *keys, int n, const float *const *q, int n_heads, int kv_mul, int hs, float scale,
                     float *scores, size_t stride, int kv_dim, const int type, const unsigned char *const *ahead, int n_ahead,
                     size_t row_bytes) {
    if (type == KV_F16) {
        for (int k = 0; k < n; k++) {
            if (k < n_ahead) prefetch(ahead[k], row_bytes);
            for (int h = 0; h < n_heads; h++)
                scores[h * stride + k] = attention_scale(vf_sum(head_dot(q[k] + h * hs, keys[k], h / kv_mul * hs, hs, kv_dim, type)), scale);
        }
        return;
    }
    vfloat part[ATTENTION_ROW_HEADS * SIMD_WIDTH];
    for (int k0 = 0; k0 < n; k0 += SIMD_WIDTH) {
        const int k1 = k0 + SIMD_WIDTH < n ? k0 + SIMD_WIDTH : n;
        for (int h0 = 0; h0 < n_heads; h0 += ATTENTION_ROW_HEADS) {
            const int h1 = h0 + ATTENTION_ROW_HEADS < n_heads ? h0 + ATTENTION_ROW_HEADS : n_heads;
            for (int k = k0; k < k1; k++) {
                if (h0 == 0 && k < n_ahead) prefetch(ahead[k], row_bytes);
                for (int h = h0; h < h1; h++)
                    part[(h - h0) * SIMD_WIDTH + k - k0] = head_dot(q[k] + h * hs, keys[k], h / kv_mul * hs, hs, kv_dim, type);
            }
            for (int h = h0; h < h1; h++) {
                float sums[SIMD_WIDTH];
                for (int k = k1; k < k0 + SIMD_WIDTH; k++) part[(h - h0) * SIMD_WIDTH + k - k0] = vf_zero(); /* sums unused */
                vf_store(sums, vf_sums(part + (h - h0) * SIMD_WIDTH));
                for (int k = k0; k < k1; k++) scores[h * stride + k] = attention_scale(sums[k - k0], scale);
            }
        }
    }
}

/* out[h * hs + i] += sum_k w[h * stride + k] * value_k[kv head of h, i] for
   every query head h and the n rows values[0..n-1] of `type`, read whole
   and in order: for each row, every head's outputs, each one fused
   multiply-add per row as axpy_slab does (the outputs wait in memory, in
   the first-level cache, between rows). Rows of ahead are prefetched as in
   dot_rows. */
KERNEL void axpy_rows(const unsigned char *const *values, int n, const float *w, size_t stride, float *out, int n_heads, int kv_mul, int hs,
                      int kv_dim, const int type, const unsigned char *const *ahead, int n_ahead, size_t row_bytes) {
    for (int k = 0; k < n; k++) {
        if (k < n_ahead) prefetch(ahead[k], row_bytes);
        for (int h = 0; h < n_heads; h++) {
            const vfloat a = vf_set(w[h * stride + k]);
            const int off = h / kv_mul * hs;
            for (int i = 0; i < hs; i += SIMD_WIDTH)
                vf_store(out + h * hs + i, vf_fma(a, kv_vector(values[k], off + i, kv_dim, type), vf_load(out + h * hs + i)));
        }
    }
}

/* All of a head (hs values from off) in slabs of 4 vectors, then of 1. */
KERNEL void axpy_head(const unsigned char *const *values, int n, int off, const float *w, size_t ws, float *out, size_t os, int rows,
                      int hs, int kv_dim, const int type) {
    int i = 0;
    for (; i + 4 * SIMD_WIDTH <= hs; i += 4 * SIMD_WIDTH) {
        if (rows == 4) axpy_slab(values, n, off, i, w, ws, out, os, kv_dim, type, 4, 4);
        else axpy_slab(values, n, off, i, w, ws, out, os, kv_dim, type, 1, 4);
    }
    for (; i < hs; i += SIMD_WIDTH) {
        if (rows == 4) axpy_slab(values, n, off, i, w, ws, out, os, kv_dim, type, 4, 1);
        else axpy_slab(values, n, off, i, w, ws, out, os, kv_dim, type, 1, 1);
    }
}
#endif

/* scores[k] = q . key_k[off..off+hs-1] / sqrt(hs) for the n <= ATTENTION_KEYS
   rows keys[0..n-1], float32 rows where `floats` is set, else rows of c's
   type (scale: RunState's att_scale). */
static void attention_dot_keys(const KVCache *c, const unsigned char *const *keys, int floats, int n, int off, const float *q, int hs,
                               float scale, float *scores) {
#ifdef SIMD_WIDTH
    if (kv_vectors(c, off, hs)) {
        const int type = floats ? KV_F32 : c->type;
        if (type == KV_F16) dot_block(keys, n, off, q, hs, scale, scores, c->kv_dim, KV_F16);
        else if (type == KV_Q8_0) dot_block(keys, n, off, q, hs, scale, scores, c->kv_dim, KV_Q8_0);
        else dot_block(keys, n, off, q, hs, scale, scores, c->kv_dim, KV_F32);
        return;
    }
#endif
    (void)floats;
    for (int k = 0; k < n; k++) scores[k] = attention_scale(kv_dot(c, keys[k], off, q, hs), scale);
}

/* out_r += sum_k w_r[k] * value_k[off..off+hs-1] for `rows` (1 or 4)
   queries r (weights w + r * ws, outputs out + r * os) and the n rows
   `values` (float32 where `floats` is set, else of c's type), keys in order. */
static void attention_axpy_keys(const KVCache *c, const unsigned char *const *values, int floats, int n, int off, const float *w,
                                size_t ws, float *out, size_t os, int rows, int hs) {
#ifdef SIMD_WIDTH
    if (kv_vectors(c, off, hs)) {
        const int type = floats ? KV_F32 : c->type;
        if (type == KV_F16) axpy_head(values, n, off, w, ws, out, os, rows, hs, c->kv_dim, KV_F16);
        else if (type == KV_Q8_0) axpy_head(values, n, off, w, ws, out, os, rows, hs, c->kv_dim, KV_Q8_0);
        else axpy_head(values, n, off, w, ws, out, os, rows, hs, c->kv_dim, KV_F32);
        return;
    }
#endif
    (void)floats;
    for (int k = 0; k < n; k++)
        for (int r = 0; r < rows; r++) kv_axpy(c, values[k], off, w[r * ws + k], out + r * os, hs);
}

/* Prefetches values off..off+count-1 of the keys (values = 0) or values of
   positions from..to-1 of a table. */
static void attention_prefetch(const KVCache *c, int layer, const BlockTable *table, int from, int to, int values, int off, int count) {
    size_t start, bytes = kv_span(c, (size_t)off, (size_t)count, &start);
    for (int tp = from; tp < to; tp++) prefetch_far(kv_load(c, layer, table, tp, values) + start, bytes);
}

/* Whether attention converts f16 and q8_0 rows to floats for the kernels
   above: when the kernels read them as vectors and each is read by several
   queries (`readers`), so that converting once costs less than converting
   at every read (kv_vector gives the very values kv_dot and kv_axpy read). */
static int attention_converts(const KVCache *c, int head_size, int readers) {
#ifdef SIMD_WIDTH
    return c->type != KV_F32 && readers > 1 && kv_vectors(c, 0, head_size);
#else
    (void)c; (void)head_size; (void)readers;
    return 0;
#endif
}

/* What the query heads g0..g1-1 of a group of tiles first[0..m-1] read of
   each cached position: values off..off+count-1 (their key heads),
   converted to floats or not (attention_converts). A block is read by the
   queries of one tile: the rows of a group of several tiles (one row each)
   read their own tables, which may or may not share it. */
typedef struct {
    int off, count, convert;
} AttnSpan;

static AttnSpan attention_span(const Config *p, const KVCache *c, const int *first, int m, int g0, int g1) {
    const int head_size = p->head_size, kv_mul = p->n_heads / p->n_kv_heads, w = g1 - g0;
    const int n = m == 1 ? first[1] - first[0] : 1; /* the queries of a block */
    AttnSpan span;
    span.off = g0 / kv_mul * head_size;
    span.count = ((g1 - 1) / kv_mul + 1) * head_size - span.off;
    span.convert = attention_converts(c, head_size, n * (kv_mul < w ? kv_mul : w));
    return span;
}

/* A block of keys (or values) as attention reads them: the cached rows of
   n <= ATTENTION_KEYS positions, and the same rows as the kernels take
   them, as stored or converted to floats (then `floats` is set). */
typedef struct {
    int n, floats;
    const unsigned char *cached[ATTENTION_KEYS];
    const unsigned char *at[ATTENTION_KEYS];
} AttnBlock;

/* Makes *blk the keys (values = 0) or values of positions t0..t0+n-1 of a
   table, the span of each: as stored, or converted to floats in `floats`
   (ATTENTION_KEYS, kv_dim); prefetches the span of the positions two blocks
   on, up to `last` (and, at the first block, of the first two). When *blk
   already holds those very rows (beams hold the blocks of their common
   past together), it is left as it is: rows read by one sequence's queries
   are then read by the next one's from the processor's cache. */
static void attention_block(const KVCache *c, int layer, const BlockTable *table, int t0, int n, int last, int values, AttnSpan span,
                            float *floats, AttnBlock *blk) {
    const unsigned char *rows[ATTENTION_KEYS];
    int held = blk->n >= n;
    for (int k = 0; k < n; k++) {
        rows[k] = kv_load(c, layer, table, t0 + k, values);
        held = held && rows[k] == blk->cached[k];
    }
    if (held) return;
    if (t0 == 0)
        attention_prefetch(c, layer, table, 0, last + 1 < 2 * ATTENTION_KEYS ? last + 1 : 2 * ATTENTION_KEYS, values, span.off, span.count);
    attention_prefetch(c, layer, table, t0 + 2 * n, t0 + 3 * n < last + 1 ? t0 + 3 * n : last + 1, values, span.off, span.count);
    blk->n = n;
    blk->floats = c->type == KV_F32 || span.convert;
    memcpy(blk->cached, rows, (size_t)n * sizeof(rows[0]));
    memcpy(blk->at, rows, (size_t)n * sizeof(rows[0]));
#ifdef SIMD_WIDTH
    if (span.convert)
        for (int k = 0; k < n; k++) {
            float *row = floats + (size_t)k * c->kv_dim;
            for (int j = span.off; j < span.off + span.count; j += SIMD_WIDTH) vf_store(row + j, kv_vector(rows[k], j, c->kv_dim, c->type));
            blk->at[k] = (const unsigned char *)row;
        }
#else
    (void)floats;
#endif
}

/* The first position a row at pos attends to in layer l. */
static int attention_start(const Config *p, int l, int pos) {
    return layer_windowed(p, l) && pos >= p->window ? pos - p->window + 1 : 0;
}

/* The first block of keys (a multiple of ATTENTION_KEYS) that a tile whose
   first row is at `from` reads in layer l: 0 but in windowed layers. The
   cache may no longer hold the blocks before it ("Windowed layers"). */
static int tile_origin(const Config *p, int l, int from) { return attention_start(p, l, from) / ATTENTION_KEYS * ATTENTION_KEYS; }

/* The first block of keys that any tile of b's tiles first[0..m-1] reads in
   layer l. Scores of a row before its own start, in the blocks its tile
   reads, are computed and then given weight 0 (window_softmax); a tile skips
   the blocks before its origin, whose scores window_softmax sets to 0 and
   whose values would add nothing; so a row's result does not depend on the
   rows it is read with. */
static int attention_origin(const Config *p, const Batch *b, int l, const int *first, int m) {
    int origin = INT_MAX;
    for (int j = 0; j < m; j++) {
        const int start = attention_start(p, l, b->pos[first[j]]);
        if (start < origin) origin = start;
    }
    return origin / ATTENTION_KEYS * ATTENTION_KEYS;
}

/* The softmax of a row of scores (positions from 0) of head h at pos over
   the positions it attends to in layer l, those before them (from
   `origin`) given weight 0; the head's sink logit (Arch sinks), where the
   model has one, joins the denominator only: the weights sum to less than 1. */
static void window_softmax(const Transformer *t, int l, int h, float *scores, int origin, int pos) {
    const Config *p = &t->config;
    const int start = attention_start(p, l, pos);
    const float *sinks = t->weights.sinks;
    attention_softmax(scores + start, pos + 1 - start, sinks ? sinks[(size_t)l * p->n_heads + h] : -INFINITY);
    for (int k = origin; k < start; k++) scores[k] = 0.0f;
}

/* The latest position of the rows of b's tiles first[0..m-1]. */
static int attention_reach(const Batch *b, const int *first, int m) {
    int last = 0;
    for (int j = 0; j < m; j++)
        if (b->pos[first[j + 1] - 1] > last) last = b->pos[first[j + 1] - 1];
    return last;
}

/* The scores of the rows of the tiles first[0..m-1] of b (a group: see
   attention) for query heads g0..g1-1, then their softmax: a->scores row
   i * (g1 - g0) + h - g0 for row first[0] + i and head h, positions
   0..its pos. Keys are taken ATTENTION_KEYS positions at a time, each block
   by every query of the group that attends to it, tile by tile. */
static void attention_scores(Transformer *t, const Batch *b, int layer, const int *first, int m, int g0, int g1, const AttnScratch *a) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const KVCache *c = &s->cache;
    const int head_size = p->head_size, kv_mul = p->n_heads / p->n_kv_heads, w = g1 - g0;
    const int r0 = first[0], n = first[m] - r0, last = attention_reach(b, first, m);
    /* the rows' queries, and (--keep) the two rotated for the ring */
    for (int i = 0; i < n; i++)
        for (int turn = 0; turn < (b->table[r0 + i]->shift != 0 ? 3 : 1); turn++) {
            const float *q = turn == 0 ? s->q + (size_t)(r0 + i) * q_dim(p) : s->q_turned + ((size_t)(r0 + i) * 2 + turn - 1) * q_dim(p);
            memcpy(a->q + turn * a->turn + (size_t)i * w * head_size, q + g0 * head_size, (size_t)w * head_size * sizeof(float));
        }
    const AttnSpan span = attention_span(p, c, first, m, g0, g1);
    const int origin = attention_origin(p, b, layer, first, m);
    for (int t0 = origin; t0 <= last; t0 += ATTENTION_KEYS) {
        AttnBlock keys;
        keys.n = 0;
        for (int j = 0; j < m; j++) {
            const BlockTable *table = b->table[first[j]];
            const int from = b->pos[first[j]], to = b->pos[first[j + 1] - 1];
            if (to < t0 || t0 < tile_origin(p, layer, from)) continue;
            const int nk = to + 1 - t0 < ATTENTION_KEYS ? to + 1 - t0 : ATTENTION_KEYS;
            int turn[ATTENTION_KEYS];
            attention_block(c, layer, table, t0, nk, to, 0, span, a->rows, &keys);
            for (int k = 0; k < nk; k++) turn[k] = kv_query_turn(table, t0 + k);
            /* the tile's rows that attend to some of the block: pos >= t0 */
            for (int i = first[j] - r0 + (t0 > from ? t0 - from : 0); i < first[j + 1] - r0; i++) {
                const int len = b->pos[r0 + i] + 1 - t0 < nk ? b->pos[r0 + i] + 1 - t0 : nk;
                for (int h = 0; h < w; h++) {
                    const size_t row = (size_t)i * w + h;
                    /* runs of keys read with the same query */
                    for (int k = 0, end; k < len; k = end) {
                        for (end = k + 1; end < len && turn[end] == turn[k]; end++) {}
                        attention_dot_keys(c, keys.at + k, keys.floats, end - k, (g0 + h) / kv_mul * head_size,
                                           a->q + turn[k] * a->turn + row * head_size, head_size, s->att_scale, a->scores + row * a->stride + t0 + k);
                    }
                }
            }
        }
    }
    for (int i = 0; i < n; i++)
        for (int h = g0; h < g1; h++) window_softmax(t, layer, h, a->scores + ((size_t)i * w + h - g0) * a->stride, origin, b->pos[r0 + i]);
}

/* xb of the rows of the tiles first[0..m-1] (a group), heads g0..g1-1 =
   the values weighted by the scores (attention_scores): each output summed
   over each chunk of positions (ATTENTION_CHUNK) in ascending order, from
   zero, and the chunks' sums added in order, the first straight into out.
   Values are taken ATTENTION_KEYS positions at a time, tile by tile, and
   four rows of a tile at once where all four attend to the whole block. */
_Static_assert(ATTENTION_CHUNK % ATTENTION_KEYS == 0, "a block of keys lies in one chunk");
static void attention_values(Transformer *t, const Batch *b, int layer, const int *first, int m, int g0, int g1, const AttnScratch *a) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const KVCache *c = &s->cache;
    const int head_size = p->head_size, kv_mul = p->n_heads / p->n_kv_heads, w = g1 - g0;
    const int r0 = first[0], n = first[m] - r0, last = attention_reach(b, first, m);
    const size_t floats = (size_t)n * w * head_size;
    const AttnSpan span = attention_span(p, c, first, m, g0, g1);
    const int origin = attention_origin(p, b, layer, first, m);
    memset(a->out, 0, floats * sizeof(float));
    for (int t0 = origin; t0 <= last; t0 += ATTENTION_KEYS) {
        float *sum = t0 < ATTENTION_CHUNK ? a->out : a->chunk;
        if (sum == a->chunk && (t0 % ATTENTION_CHUNK == 0 || t0 == origin)) memset(a->chunk, 0, floats * sizeof(float));
        AttnBlock values;
        values.n = 0;
        for (int j = 0; j < m; j++) {
            const int from = b->pos[first[j]], to = b->pos[first[j + 1] - 1], end = first[j + 1] - r0;
            if (to < t0 || t0 < tile_origin(p, layer, from)) continue;
            const int nk = to + 1 - t0 < ATTENTION_KEYS ? to + 1 - t0 : ATTENTION_KEYS;
            attention_block(c, layer, b->table[first[j]], t0, nk, to, 1, span, a->rows, &values);
            for (int h = 0; h < w; h++)
                for (int i = first[j] - r0 + (t0 > from ? t0 - from : 0), rows; i < end; i += rows) {
                    const int len = b->pos[r0 + i] + 1 - t0 < nk ? b->pos[r0 + i] + 1 - t0 : nk;
                    rows = len == nk && i + 4 <= end ? 4 : 1; /* later rows attend to at least as much */
                    const size_t row = (size_t)i * w + h;
                    attention_axpy_keys(c, values.at, values.floats, len, (g0 + h) / kv_mul * head_size, a->scores + row * a->stride + t0,
                                        (size_t)w * a->stride, sum + row * head_size, (size_t)w * head_size, rows, head_size);
                }
        }
        if (sum == a->chunk && ((t0 + ATTENTION_KEYS) % ATTENTION_CHUNK == 0 || t0 + ATTENTION_KEYS > last))
            for (size_t i = 0; i < floats; i++) a->out[i] += a->chunk[i]; /* rows that end before the chunk add zeros */
    }
    for (int i = 0; i < n; i++)
        memcpy(s->xb + (size_t)(r0 + i) * q_dim(p) + g0 * head_size, a->out + (size_t)i * w * head_size, (size_t)w * head_size * sizeof(float));
}

/* ---- A lone row's attention, spread over threads by position ---------------
   A batch of one decoding row (one sequence generating) has one tile: split
   by heads, each thread would read its half of every cached row, a pattern
   that streams memory at about half the rate of reading rows whole (measured
   on a 3968-position f32 cache, 2 threads). So it is split by position
   instead: each thread takes a run of blocks of keys and computes every
   head's scores of them (attention_row_scores), reading rows whole and in
   order; then, with all scores known, a range of heads for the softmax;
   then a run of chunks of positions (ATTENTION_CHUNK), whose values it sums
   for every head, again reading rows whole and in order
   (attention_row_values); the chunks' sums are then added in order. Each
   score is computed as attention_dot_keys computes it, each output summed
   in the same order: the results are those of the tiled path, bit for bit.
   With the cache in 2 MB pages (alloc_pages), this reads a 3968-position
   f32 cache at 0.90 of the streaming probe's rate, f16 at 0.87. */

/* The scores of b's one row, all heads, for the n keys of positions
   t0..t0+n-1: scores row h (stride apart), from t0. In vector builds rows
   are read whole by dot_rows, which prefetches the rows attention_ahead
   positions on (up to `last`); otherwise head by head as attention_scores
   reads them. */
static void attention_row_scores(Transformer *t, const Batch *b, int layer, int t0, int n, float *scores, size_t stride) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const KVCache *c = &s->cache;
    const int head_size = p->head_size, kv_mul = p->n_heads / p->n_kv_heads, last = b->pos[0];
    const BlockTable *table = b->table[0];
    const unsigned char *keys[ATTENTION_KEYS];
    const float *q[ATTENTION_KEYS]; /* each key's query: kv_query_turn */
    for (int k = 0; k < n; k++) {
        const int turn = kv_query_turn(table, t0 + k);
        keys[k] = kv_load(c, layer, table, t0 + k, 0);
        q[k] = turn == 0 ? s->q : s->q_turned + (size_t)(turn - 1) * q_dim(p);
    }
#ifdef SIMD_WIDTH
    if (kv_vectors(c, 0, head_size)) {
        const unsigned char *ahead[ATTENTION_KEYS];
        const int n_ahead = attention_rows_ahead(c, layer, table, t0, n, last, 0, ahead);
        if (c->type == KV_F16)
            dot_rows(keys, n, q, p->n_heads, kv_mul, head_size, s->att_scale, scores, stride, c->kv_dim, KV_F16, ahead, n_ahead, c->row_bytes);
        else if (c->type == KV_Q8_0)
            dot_rows(keys, n, q, p->n_heads, kv_mul, head_size, s->att_scale, scores, stride, c->kv_dim, KV_Q8_0, ahead, n_ahead, c->row_bytes);
        else
            dot_rows(keys, n, q, p->n_heads, kv_mul, head_size, s->att_scale, scores, stride, c->kv_dim, KV_F32, ahead, n_ahead, c->row_bytes);
        return;
    }
#endif
    (void)last;
    for (int h = 0; h < p->n_heads; h++)
        for (int k = 0, end; k < n; k = end) { /* runs of keys read with the same query */
            for (end = k + 1; end < n && q[end] == q[k]; end++) {}
            attention_dot_keys(c, keys + k, c->type == KV_F32, end - k, h / kv_mul * head_size, q[k] + h * head_size, head_size,
                               s->att_scale, scores + h * stride + k);
        }
}

/* out (dim) += the values of b's one row, all heads, for the n positions
   t0..t0+n-1, weighted by the softmax of the scores (rows h, stride apart,
   from position 0). In vector builds rows are read whole by axpy_rows;
   otherwise head by head as attention_values reads them. */
static void attention_row_values(Transformer *t, const Batch *b, int layer, int t0, int n, const float *w, size_t stride, float *out) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const KVCache *c = &s->cache;
    const int head_size = p->head_size, kv_mul = p->n_heads / p->n_kv_heads, last = b->pos[0];
    const BlockTable *table = b->table[0];
    const unsigned char *values[ATTENTION_KEYS];
    for (int k = 0; k < n; k++) values[k] = kv_load(c, layer, table, t0 + k, 1);
#ifdef SIMD_WIDTH
    if (kv_vectors(c, 0, head_size)) {
        const unsigned char *ahead[ATTENTION_KEYS];
        const int n_ahead = attention_rows_ahead(c, layer, table, t0, n, last, 1, ahead);
        if (c->type == KV_F16)
            axpy_rows(values, n, w + t0, stride, out, p->n_heads, kv_mul, head_size, c->kv_dim, KV_F16, ahead, n_ahead, c->row_bytes);
        else if (c->type == KV_Q8_0)
            axpy_rows(values, n, w + t0, stride, out, p->n_heads, kv_mul, head_size, c->kv_dim, KV_Q8_0, ahead, n_ahead, c->row_bytes);
        else
            axpy_rows(values, n, w + t0, stride, out, p->n_heads, kv_mul, head_size, c->kv_dim, KV_F32, ahead, n_ahead, c->row_bytes);
        return;
    }
#endif
    (void)last;
    for (int h = 0; h < p->n_heads; h++)
        attention_axpy_keys(c, values, c->type == KV_F32, n, h / kv_mul * head_size, w + h * stride + t0, 0, out + h * head_size, 0, 1, head_size);
}

/* Attention of b's one row: the scores by runs of blocks of keys, the
   softmax by heads, the values by runs of chunks. The scores lie in thread
   0's buffer of scores, which has a row for every head; the chunks' sums
   in s->chunks. */
static void attention_lone_row(Transformer *t, const Batch *b, int layer) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const int qd = q_dim(p), last = b->pos[0], n_blocks = last / ATTENTION_KEYS + 1, n_chunks = last / ATTENTION_CHUNK + 1;
    const int origin = attention_start(p, layer, last) / ATTENTION_KEYS * ATTENTION_KEYS, first_chunk = origin / ATTENTION_CHUNK;
    const AttnScratch shared = attention_scratch(p, s, 0);
    PARALLEL_FOR_IF(1)
    for (int block = origin / ATTENTION_KEYS; block < n_blocks; block++) {
        const int t0 = block * ATTENTION_KEYS;
        attention_row_scores(t, b, layer, t0, last + 1 - t0 < ATTENTION_KEYS ? last + 1 - t0 : ATTENTION_KEYS, shared.scores + t0, shared.stride);
    }
    PARALLEL_FOR_IF(1)
    for (int h = 0; h < p->n_heads; h++) window_softmax(t, layer, h, shared.scores + (size_t)h * shared.stride, origin, last);
    PARALLEL_FOR_IF(1)
    for (int chunk = first_chunk; chunk < n_chunks; chunk++) {
        float *sum = s->chunks + (size_t)chunk * qd;
        memset(sum, 0, (size_t)qd * sizeof(float));
        for (int t0 = chunk == first_chunk ? origin : chunk * ATTENTION_CHUNK; t0 <= last && t0 < (chunk + 1) * ATTENTION_CHUNK; t0 += ATTENTION_KEYS)
            attention_row_values(t, b, layer, t0, last + 1 - t0 < ATTENTION_KEYS ? last + 1 - t0 : ATTENTION_KEYS, shared.scores, shared.stride, sum);
    }
    memcpy(s->xb, s->chunks + (size_t)first_chunk * qd, (size_t)qd * sizeof(float));
    for (int chunk = first_chunk + 1; chunk < n_chunks; chunk++)
        for (int i = 0; i < qd; i++) s->xb[i] += s->chunks[(size_t)chunk * qd + i];
}

/* Multi-head attention of every row, reading keys and values from the cache:
   for each head h, with key head h / (n_heads / n_kv_heads),
     att[t] = softmax_t(q_h . k_t / sqrt(head_size)),  xb_h = sum_t att[t] v_t.
   Rows of one sequence at consecutive positions (a prompt chunk, a verified
   draft) are taken in tiles (attention_tiles), so that each key and value
   read from the cache serves every query of the tile; a decoding row is a
   tile of its own, and decoding rows whose tables start alike (beams,
   prompts with a common start) are grouped (attention_groups), so that the
   blocks they share are read once. Work items are a group and a range of
   consecutive heads, as many ranges as threads: the heads of a range read
   one stretch of each cached position, and each thread takes one range of
   every group (later rows attend to more positions); a batch of one
   decoding row is spread over the threads by position instead
   (attention_lone_row). Tiling and grouping change only the order in which
   different outputs are computed: each score is what kv_dot gives, each
   softmax the same, each output sums what kv_axpy adds over positions in
   ascending order (by chunks: ATTENTION_CHUNK), so a row's result does not
   depend on its tile or group. */
static void attention(Transformer *t, const Batch *b, int layer) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const int threads = max_threads() < p->n_heads ? max_threads() : p->n_heads;
    const int range = (p->n_heads + threads - 1) / threads, n_ranges = (p->n_heads + range - 1) / range;
    double work = 0; /* multiply-adds */
    for (int r = 0; r < b->n_rows; r++) work += 2.0 * p->dim * (b->pos[r] + 1);
    if (b->n_rows == 1 && threads > 1 && work >= PARALLEL_MIN_WORK) {
        attention_lone_row(t, b, layer);
        return;
    }
    const int score_rows = attention_score_rows(p);
    const int n_tiles = attention_tiles(b, score_rows / (p->n_heads / p->n_kv_heads), s->tiles);
    const int n_groups = attention_groups(b, s->tiles, n_tiles, score_rows / range, s->groups);
    PARALLEL_FOR_IF(work >= PARALLEL_MIN_WORK)
    for (int item = 0; item < n_ranges * n_groups; item++) {
        const int group = item % n_groups, m = s->groups[group + 1] - s->groups[group];
        const int *first = s->tiles + s->groups[group], n = first[m] - first[0];
        const int h0 = item / n_groups * range, h1 = h0 + range < p->n_heads ? h0 + range : p->n_heads;
        const AttnScratch a = attention_scratch(p, s, thread_id());
        /* as many heads at once as the scores of the group's rows fit in */
        const int w = score_rows / n > 0 ? score_rows / n : 1;
        for (int g0 = h0; g0 < h1; g0 += w) {
            const int g1 = g0 + w < h1 ? g0 + w : h1;
            attention_scores(t, b, layer, first, m, g0, g1, &a);
            attention_values(t, b, layer, first, m, g0, g1, &a);
        }
    }
}

/* x (n, size) += layer l's bias (row l of biases, (n_layers, size); an expert's: row l * n_experts + e) in
   every row; NULL biases add nothing. */
static void add_bias(float *x, const float *biases, int l, int n, int size) {
    for (int r = 0; biases && r < n; r++)
        for (int i = 0; i < size; i++) x[(size_t)r * size + i] += biases[(size_t)l * size + i];
}

/* Layer l's RoPE (Arch no_rope_period: SmolLM3 turns none in every fourth
   layer; Granite's rope_off: none at all; there .rot is 0): the windowed
   layers' table or the global one. */
static Rope layer_rope(const Transformer *t, int l) {
    const Config *p = &t->config;
    const int period = p->arch->no_rope_period, turns = !p->rope_off && (period == 0 || (l + 1) % period != 0);
    Rope r = {p->head_size, turns ? p->rope_dims : 0, p->rope_halves, p->rope_mscale > 0.0f ? p->rope_mscale : 1.0f,
              layer_windowed(p, l) ? t->rope_freq_local : t->rope_freq};
    return r;
}

/* RoPE for a row at position pos of table t in layer l: the query q at pos,
   the key k at its physical slot, which is pos but after --keep drops (see
   kv_slot); then, as the ring has turned, the two queries that read its
   stretches (q_turned, 2 x q_dim), rotated from the same unrotated query. */
static void rope_row(const Transformer *t, int l, const BlockTable *table, int pos, float *q, float *q_turned, float *k) {
    const Config *p = &t->config;
    const int dim = q_dim(p), kv_dim = kv_dim_of(p), slot = kv_slot(table, pos);
    const Rope r = layer_rope(t, l);
    if (table->shift != 0) {
        int w = table->slots - table->keep;
        memcpy(q_turned, q, (size_t)dim * sizeof(float));
        memcpy(q_turned + dim, q, (size_t)dim * sizeof(float));
        rope(q_turned, NULL, pos + table->shift, dim, 0, r);
        rope(q_turned + dim, NULL, pos + table->shift - w, dim, 0, r);
    }
    if (slot == pos) {
        rope(q, k, pos, dim, kv_dim, r);
        return;
    }
    rope(q, NULL, pos, dim, 0, r);
    rope(k, NULL, slot, kv_dim, 0, r);
}

/* RMSNorm of n rows of `size` values in place, each with the same weights
   (q and k's heads: Arch qk_norm; the blocks' outputs: Arch post_norms). */
static void rmsnorm_rows(float *x, const float *weight, int n, int size, float eps) {
    for (int r = 0; r < n; r++) rmsnorm(x + (size_t)r * size, x + (size_t)r * size, weight, size, eps);
}

/* x (n, dim) += y (n, dim), each block's output joining the residual
   stream, times residual_scale where the architecture has one (Granite). */
static void add_residual(float *x, const float *y, int n, int dim, float scale) {
    if (scale > 0.0f)
        for (size_t i = 0; i < (size_t)n * dim; i++) x[i] += y[i] * scale;
    else
        for (size_t i = 0; i < (size_t)n * dim; i++) x[i] += y[i];
}

/* ---- Multi-head latent attention (DeepSeek-V2) -------------------------------
   The keys and values of every head are one latent vector c of a position
   (mla_rank wide) taken up by each head's matrices: k_nope_h = Wk_h c,
   v_h = Wv_h c. The up-projections are absorbed instead, as llama.cpp
   computes it: head h's query becomes [q_pe_h, wk_b_h q_nope_h], which
   against the cached row [k_pe, c] gives q_pe_h . k_pe + q_nope_h . Wk_h c;
   its output is wv_b_h (sum_t p_t c_t). So the attention of section 4 runs
   unchanged as one key head (n_kv_heads 1) of head_size = rope_dims +
   mla_rank values, the RoPE part first so that rope() turns it; the cache
   holds that one row a position and layer, and reads the values from it
   (KVCache values_in_keys): the sums of its RoPE part are left unread. */

/* q (n, n_heads x head_size) and k (n, head_size) of n rows of xb in layer l. */
static void mla_project(Transformer *t, int l, int n) {
    const Config *p = &t->config;
    const Weights *w = &t->weights;
    RunState *s = &t->state;
    const int H = p->n_heads, R = p->mla_rank, rope = p->rope_dims, nope = p->mla_nope, hs = p->head_size, per = nope + rope;
    if (p->q_rank > 0) { /* q = wq_b @ rmsnorm(wq_a @ x) */
        matmul(s->mla_out, s->xb, &w->wq_a[l], n);
        rmsnorm_rows(s->mla_out, w->q_a_norm + (size_t)l * p->q_rank, n, p->q_rank, p->norm_eps);
        matmul(s->mla_q, s->mla_out, &w->wq_b[l], n);
    } else
        matmul(s->mla_q, s->xb, &w->wq[l], n);
    matmul(s->mla_out, s->xb, &w->wkv_a[l], n); /* [c, k_pe] */
    for (int r = 0; r < n; r++) {
        const float *ckr = s->mla_out + (size_t)r * (R + rope);
        float *k = s->k + (size_t)r * hs;
        memcpy(k, ckr + R, (size_t)rope * sizeof(float));
        rmsnorm(k + rope, ckr, w->kv_a_norm + (size_t)l * R, R, p->norm_eps);
    }
    for (int h = 0; h < H; h++) {
        for (int r = 0; r < n; r++) memcpy(s->mla_in + (size_t)r * nope, s->mla_q + ((size_t)r * H + h) * per, (size_t)nope * sizeof(float));
        matmul(s->mla_out, s->mla_in, &w->wk_b[(size_t)l * H + h], n);
        for (int r = 0; r < n; r++) {
            float *q = s->q + ((size_t)r * H + h) * hs;
            memcpy(q, s->mla_q + ((size_t)r * H + h) * per + nope, (size_t)rope * sizeof(float));
            memcpy(q + rope, s->mla_out + (size_t)r * R, (size_t)R * sizeof(float));
        }
    }
}

/* The heads' outputs (n, n_heads x mla_value) from the attention's sums
   of latents in xb (n, n_heads x head_size; each head's after its RoPE
   part): wv_b_h of head h's. Returns them (in mla_q). */
static const float *mla_output(Transformer *t, int l, int n) {
    const Config *p = &t->config;
    RunState *s = &t->state;
    const int H = p->n_heads, R = p->mla_rank, V = p->mla_value, hs = p->head_size;
    for (int h = 0; h < H; h++) {
        for (int r = 0; r < n; r++)
            memcpy(s->mla_in + (size_t)r * R, s->xb + ((size_t)r * H + h) * hs + p->rope_dims, (size_t)R * sizeof(float));
        matmul(s->mla_out, s->mla_in, &t->weights.wv_b[(size_t)l * H + h], n);
        for (int r = 0; r < n; r++) memcpy(s->mla_q + ((size_t)r * H + h) * V, s->mla_out + (size_t)r * V, (size_t)V * sizeof(float));
    }
    return s->mla_q;
}

/* The dense FFN of n rows of xb: out = w2 @ (act(w1 @ xb) * (w3 @ xb)), act
   SiLU (v * sigmoid(v)) or GELU, its width w1's rows. */
static void dense_ffn(Transformer *t, const Matrix *w1, const Matrix *w3, const Matrix *w2, int n, float *out) {
    RunState *s = &t->state;
    const Matrix *gate_up[2] = {w1, w3};
    float *const gate_up_out[2] = {s->hb, s->hb2};
    matmul_shared(gate_up, gate_up_out, 2, s->xb, n);
    gated_activation(t->config.arch->activation, s->hb, s->hb2, n, w1->rows);
    matmul(out, s->hb, w2, n);
}

/* xb2 (n, dim) += a shared expert's output y (n, dim) of layer l, row by
   row times sigmoid(shared_gate_l . xb) where the model has that gate
   (Qwen2-MoE), else whole. */
static void add_shared_expert(Transformer *t, int l, int n, const float *y) {
    const int dim = t->config.dim;
    const float *gate = t->weights.shared_gate;
    RunState *s = &t->state;
    for (int r = 0; r < n; r++) {
        float g = 1.0f;
        if (gate) {
            float dot = 0.0f;
            for (int i = 0; i < dim; i++) dot += gate[(size_t)l * dim + i] * s->xb[(size_t)r * dim + i];
            g = 1.0f / (1.0f + expf(-dot));
        }
        for (int i = 0; i < dim; i++) s->xb2[(size_t)r * dim + i] += g * y[(size_t)r * dim + i];
    }
}

/* The k experts of a row and their weights from its router logits
   (n_experts, turned into probabilities in place): the softmax over all
   experts (or, GATING_SIGMOID, each logit's sigmoid), the k most probable
   (at a tie, the lower index first, as llama.cpp's sort takes them up to
   16 experts; beyond, its order at exact ties is its sort's), chosen by
   their probabilities plus select_bias where the model has one (DeepSeek-V3's
   exp_probs_b.bias, NULL: none), their probabilities as weights,
   renormalised to sum 1 where the model does so (Config moe_norm; the sum
   held above 2^-14 as llama.cpp holds it), then times expert_scale where
   set; or (GATING_TOPK_SOFTMAX, gpt-oss) the k largest logits, weighted by
   their softmax among themselves. Only DeepSeek's loader reads
   expert_weights_scale, as only llama.cpp's does. */
static void route(const Config *p, const float *select_bias, float *probs, int *chosen, float *weights) {
    const int E = p->n_experts, k = p->n_experts_used;
    if (p->gating == GATING_SOFTMAX) softmax(probs, E);
    if (p->gating == GATING_SIGMOID)
        for (int e = 0; e < E; e++) probs[e] = 1.0f / (1.0f + expf(-probs[e]));
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        float best_score = 0.0f;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= chosen[i] == e;
            const float score = probs[e] + (select_bias ? select_bias[e] : 0.0f);
            if (!taken && (best < 0 || score > best_score)) best = e, best_score = score;
        }
        chosen[j] = best;
        weights[j] = probs[best];
        sum += weights[j];
    }
    if (p->gating == GATING_TOPK_SOFTMAX) {
        softmax(weights, k);
        return;
    }
    if (sum < 6.103515625e-5f) sum = 6.103515625e-5f;
    for (int j = 0; p->moe_norm && j < k; j++) weights[j] /= sum;
    for (int j = 0; p->expert_scale != 0.0f && j < k; j++) weights[j] *= p->expert_scale;
}

/* The mixture of experts of n rows of xb into out (n, dim): each row's
   router picks k experts (route); the rows are then taken expert by
   expert, each expert's matrices read once for all the rows routed to it
   (as llama.cpp's mul_mat_id), its biases added where the architecture
   has them (gpt-oss), its outputs left in the rows' slots; then
   each row sums its k outputs times their weights, best first. A row's
   result does not depend on the rows that share its step. */
static void moe_ffn(Transformer *t, int l, int n, float *out) {
    const Config *p = &t->config;
    const Weights *w = &t->weights;
    RunState *s = &t->state;
    const int E = p->n_experts, k = p->n_experts_used, dim = p->dim, F = p->expert_hidden;
    matmul(s->router, s->xb, &w->router[l], n);
    add_bias(s->router, w->router_bias, l, n, E); /* gpt-oss */
    const float *select_bias = w->select_bias ? w->select_bias + (size_t)l * E : NULL;
    for (int r = 0; r < n; r++) route(p, select_bias, s->router + (size_t)r * E, s->chosen + (size_t)r * k, s->route_w + (size_t)r * k);
    for (int e = 0; e < E; e++) {
        int m = 0; /* the slots (row * k + rank) routed to e */
        for (int slot = 0; slot < n * k; slot++)
            if (s->chosen[slot] == e) s->slot_of[m++] = slot;
        if (m == 0) continue;
        for (int i = 0; i < m; i++) memcpy(s->ex + (size_t)i * dim, s->xb + (size_t)(s->slot_of[i] / k) * dim, (size_t)dim * sizeof(float));
        const size_t at = (size_t)l * E + e;
        const Matrix *gate_up[2] = {&w->e_gate[at], &w->e_up[at]};
        float *const gate_up_out[2] = {s->eh, s->eh2};
        matmul_shared(gate_up, gate_up_out, 2, s->ex, m);
        add_bias(s->eh, w->e_gate_bias, (int)at, m, F); /* gpt-oss: the expert's biases */
        add_bias(s->eh2, w->e_up_bias, (int)at, m, F);
        gated_activation(p->arch->activation, s->eh, s->eh2, m, F);
        matmul(s->ex, s->eh, &w->e_down[at], m);
        add_bias(s->ex, w->e_down_bias, (int)at, m, dim);
        for (int i = 0; i < m; i++) memcpy(s->slots + (size_t)s->slot_of[i] * dim, s->ex + (size_t)i * dim, (size_t)dim * sizeof(float));
    }
    for (int r = 0; r < n; r++)
        for (int i = 0; i < dim; i++) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += s->route_w[(size_t)r * k + j] * s->slots[((size_t)r * k + j) * dim + i];
            out[(size_t)r * dim + i] = sum;
        }
}

/* The logits' last steps: divided by logit_scale (Granite), then capped
   softly at +-softcap (Gemma): softcap * tanh(logit / softcap). */
static void finish_logits(const Config *p, float *logits, int n) {
    const size_t count = (size_t)n * p->vocab_size;
    if (p->logit_scale > 0.0f)
        for (size_t i = 0; i < count; i++) logits[i] /= p->logit_scale;
    if (p->softcap > 0.0f)
        for (size_t i = 0; i < count; i++) logits[i] = p->softcap * tanhf(logits[i] / p->softcap);
}

/* Runs the rows of `b` through every layer; returns the logits
   (b->n_logits, vocab_size) of the rows b->logit_rows, in that order.
   The steps an architecture adds to llama's (section 1's Arch) are named
   where they run. */
static float *forward(Transformer *t, const Batch *b) {
    const Config *p = &t->config;
    const Weights *w = &t->weights;
    RunState *s = &t->state;
    const int dim = p->dim, n = b->n_rows;
    const int head_size = p->head_size, qd = q_dim(p), kv_dim = kv_dim_of(p);

    for (int r = 0; r < n; r++)
        matrix_row(s->x + (size_t)r * dim, &w->token_embedding, b->token[r]);
    if (p->embed_scale > 0.0f) /* Gemma: sqrt(dim); Granite: the file's */
        for (size_t i = 0; i < (size_t)n * dim; i++) s->x[i] *= p->embed_scale;

    for (int l = 0; l < p->n_layers; l++) {
        /* attention block: x += wo @ attention(rope(wq @ xb), rope(wk @ xb), wv @ xb) */
        for (int r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * dim, s->x + (size_t)r * dim, w->rms_att + (size_t)l * dim, dim, p->norm_eps);
        if (p->mla_rank > 0) { /* latent attention: one key head, the latent and the RoPE key */
            mla_project(t, l, n);
        } else {
            const Matrix *qkv[3] = {&w->wq[l], &w->wk[l], &w->wv[l]};
            float *const qkv_out[3] = {s->q, s->k, s->v};
            matmul_shared(qkv, qkv_out, 3, s->xb, n);
        }
        add_bias(s->q, w->bq, l, n, qd); /* GGUF qwen2 */
        add_bias(s->k, w->bk, l, n, kv_dim);
        add_bias(s->v, w->bv, l, n, kv_dim);
        if (w->q_norm && p->qk_norm_whole) { /* QK-norm over each row of q and k (OLMoE) */
            rmsnorm_rows(s->q, w->q_norm + (size_t)l * qd, n, qd, p->norm_eps);
            rmsnorm_rows(s->k, w->k_norm + (size_t)l * kv_dim, n, kv_dim, p->norm_eps);
        } else if (w->q_norm) { /* QK-norm: each head of q and k RMS-normalised */
            rmsnorm_rows(s->q, w->q_norm + (size_t)l * head_size, n * p->n_heads, head_size, p->norm_eps);
            rmsnorm_rows(s->k, w->k_norm + (size_t)l * head_size, n * p->n_kv_heads, head_size, p->norm_eps);
        }
        /* rows write distinct cache positions, so threads can share them */
        PARALLEL_FOR_IF(n >= 8)
        for (int r = 0; r < n; r++) {
            float *k = s->k + (size_t)r * kv_dim, *v = s->v + (size_t)r * kv_dim;
            rope_row(t, l, b->table[r], b->pos[r], s->q + (size_t)r * qd, s->q_turned + (size_t)r * 2 * qd, k);
            kv_store(&s->cache, l, b->table[r], b->pos[r], k, v);
        }
        attention(t, b, l);
        matmul(s->xb2, p->mla_rank > 0 ? mla_output(t, l, n) : s->xb, &w->wo[l], n); /* MLA: the heads' outputs from their latents */
        add_bias(s->xb2, w->bo, l, n, dim); /* gpt-oss */
        if (w->post_att) rmsnorm_rows(s->xb2, w->post_att + (size_t)l * dim, n, dim, p->norm_eps); /* post-norm */
        add_residual(s->x, s->xb2, n, dim, p->residual_scale);

        /* FFN block: x += ffn(xb), dense or a mixture of experts (with a shared expert) */
        for (int r = 0; r < n; r++)
            rmsnorm(s->xb + (size_t)r * dim, s->x + (size_t)r * dim, w->rms_ffn + (size_t)l * dim, dim, p->norm_eps);
        if (w->router && w->router[l].rows > 0) {
            moe_ffn(t, l, n, s->xb2);
            if (w->w1[l].rows > 0) { /* a shared expert; the slots are free again */
                dense_ffn(t, &w->w1[l], &w->w3[l], &w->w2[l], n, s->slots);
                add_shared_expert(t, l, n, s->slots);
            }
        } else
            dense_ffn(t, &w->w1[l], &w->w3[l], &w->w2[l], n, s->xb2);
        if (w->post_ffn) rmsnorm_rows(s->xb2, w->post_ffn + (size_t)l * dim, n, dim, p->norm_eps); /* post-norm */
        add_residual(s->x, s->xb2, n, dim, p->residual_scale);
    }

    /* the classifier reads the normalised rows that want logits, packed */
    for (int i = 0; i < b->n_logits; i++)
        rmsnorm(s->xb + (size_t)i * dim, s->x + (size_t)b->logit_rows[i] * dim, w->rms_final, dim, p->norm_eps);
    if (b->n_logits > 0) matmul(s->logits, s->xb, &w->wcls, b->n_logits);
    finish_logits(p, s->logits, b->n_logits);
    return s->logits;
}

/* Runs n tokens of one sequence at positions start.. (n <= max_rows) through
   the model as one batch, their keys and values going into `table`; returns
   the logits of every row (all) or of the last one. */
static float *forward_rows(Transformer *t, BlockTable *table, const int *tokens, int n, int start, int all) {
    int *pos = xcalloc((size_t)n, sizeof(int)), *rows = xcalloc((size_t)n, sizeof(int));
    const BlockTable **tables = xcalloc((size_t)n, sizeof(BlockTable *));
    for (int r = 0; r < n; r++) {
        pos[r] = start + r;
        rows[r] = r;
        tables[r] = table;
        table_prepare_write(&t->state.cache, table, start + r);
    }
    Batch b = {n, tokens, pos, tables, all ? rows : rows + n - 1, all ? n : 1};
    float *logits = forward(t, &b);
    free(pos);
    free(rows);
    free(tables);
    return logits;
}

/* ------------------------------------------------------------------------ */
/* 5. The tokenizers                                                        */
/* ------------------------------------------------------------------------ */

/* The fixed ids of tokenizer.bin files; "tk42" files name their own. */
enum { TOKEN_BOS = 1, TOKEN_EOS = 2, BYTE_TOKEN_OFFSET = 3 };

/* chat template families: [INST] (Llama 2), header tokens (Llama 3),
   <|im_start|> (ChatML: Qwen, SmolLM), <|user|> (Phi-3), <start_of_turn>
   (Gemma), <|role|> without newlines (Phi-4-mini), <|start_of_role|>
   (Granite), [SYSTEM_PROMPT] (Mistral v7), <|start|>role<|message|>
   (Harmony: gpt-oss), User: ... Assistant: (DeepSeek-V2) */
enum { CHAT_LLAMA2, CHAT_LLAMA3, CHAT_CHATML, CHAT_PHI3, CHAT_GEMMA, CHAT_PHI4, CHAT_GRANITE, CHAT_MISTRAL7, CHAT_SMOLLM3,
       CHAT_HARMONY, CHAT_DEEPSEEK2 };
/* what becomes of a reply's <think> block (Qwen3): printed as it comes, left
   out of what is printed, or not asked for (the template's empty block) */
enum { REASONING_SHOW, REASONING_HIDE, REASONING_OFF };
#define MAX_END_TOKENS 8

/* byte-level pre-tokenizers (how text is split before BPE), by the names
   GGUF files give them in tokenizer.ggml.pre; "tk42" files are PRE_LLAMA3 */
enum { PRE_LLAMA3 = 1, PRE_QWEN2, PRE_GPT2, PRE_SMOLLM, PRE_DEEPSEEK_LLM, PRE_DEEPSEEK_CODER, PRE_GPT4O, PRE_TEKKEN, PRE_DEEPSEEK3 };

typedef struct {
    const char *str;
    int id;
} TokenIndex;

/* A byte-level BPE merge: the pair (left, right) becomes `merged`; lower
   ranks merge first. A slot of the hash table, empty when left < 0. */
typedef struct {
    int left, right, merged, rank;
} MergeRule;

/* Texts (text[id], len[id] bytes) by their bytes: a hash table of ids
   (slot, mask + 1 of them, -1 empty), at most half full. */
typedef struct {
    int *slot;
    uint32_t mask;
    char *const *text;
    const int *len;
} TextIndex;

typedef struct {
    int vocab_size;
    int max_token_length;
    char **vocab;             /* (vocab_size) NUL-terminated pieces */
    float *vocab_scores;      /* (vocab_size) merge priority: higher merges first (tokenizer.bin) */
    TokenIndex *sorted_vocab; /* (vocab_size) pieces sorted by strcmp, for bsearch (SentencePiece) */
    unsigned char byte_pieces[512]; /* byte b as the string {b, 0} at 2b */
    /* what the file says about the model's special tokens (tokenizer.bin:
       BOS 1, the one end token EOS 2, the Llama 2 chat template) */
    int bos;
    int eos;                  /* end[0] */
    int n_end;
    int end[MAX_END_TOKENS];  /* tokens that end a reply */
    int end_of_turn;          /* the token that closes a turn in the chat template */
    int chat_template;        /* CHAT_LLAMA2, CHAT_LLAMA3, CHAT_CHATML, ... */
    int llama31_tools;        /* CHAT_LLAMA3 whose template has Llama 3.1's tool calls (ipython; see 11.1) */
    int reasoning;            /* --reasoning: REASONING_SHOW, REASONING_HIDE or REASONING_OFF */
    int eos_ends_generate;    /* generate mode stops at an end token (llama2.c does not) */
    int add_bos, add_eos;     /* encode(..., bos = 1, ...) adds BOS (and EOS) only if the vocabulary says so */
    int no_space_prefix;      /* SentencePiece without its dummy-prefix space (Gemma: add_space_prefix false) */
    int fixed_ids;            /* a tokenizer.bin: BOS 1 and EOS 2, whose pieces are "\n<s>\n" and "\n</s>\n" */
    int byte_token[256];      /* the token of each single byte (-1: none): <0xNN> in SentencePiece */
    int n_user;               /* user-defined tokens (GGUF), matched in text before anything else, */
    int *user_tokens;         /* (n_user) longest first, as llama.cpp and Hugging Face match added tokens */
    /* byte-level BPE only (5.2) */
    int byte_level;
    int *piece_len;           /* (vocab_size) bytes of each piece: pieces may hold NUL */
    unsigned char *special;   /* (vocab_size) 1: never produced from plain text (user-defined tokens only by matching) */
    int pre;                  /* PRE_LLAMA3, ... */
    int ignore_merges;        /* a split piece that is itself a token is taken whole */
    MergeRule *merges;        /* (merge_mask + 1) hash table on (left, right) */
    int merge_mask;
    int n_letter, n_number;
    int *letter_ranges;       /* (n_letter, 2) first and last code point of \p{L} runs, ascending */
    int *number_ranges;       /* (n_number, 2) the same for \p{N} */
    int n_punct;
    int *punct_ranges;        /* (n_punct, 2) \p{P}: GGUF vocabularies only */
    TextIndex pieces;         /* the ordinary (not special) pieces by their bytes: lookup_bytes */
} Tokenizer;

/* Sub-section 5.2 (byte-level BPE), used by the common entry points below. */
static void load_byte_level_tokenizer(Tokenizer *t, const unsigned char *data, size_t size, const char *path, int vocab_size);
static int encode_byte_level(const Tokenizer *t, const char *text, int bos, int eos, int *tokens);
/* Sub-section 5.3: a GGUF file's vocabulary, given with -z. */
static void load_gguf_tokenizer_file(Tokenizer *t, const void *data, size_t size, const char *path, int vocab_size);
/* Sub-section 5.3's Unicode table: the class of a code point ('u' upper or
   title case letter, 'l' lower case, 'L' other letter, 'M', 'N', 'P', 'S'), or 0. */
static char unicode_class(int cp);

/* Whether `token` ends a reply: one of the file's end tokens. */
static int is_eos_token(const Tokenizer *t, int token) {
    for (int i = 0; i < t->n_end; i++)
        if (token == t->end[i]) return 1;
    return 0;
}

/* ---- 5.1 llama2.c's tokenizer.bin --------------------------------------- */

static int compare_tokens(const void *a, const void *b) {
    return strcmp(((const TokenIndex *)a)->str, ((const TokenIndex *)b)->str);
}

/* Dies with a line naming the file's kind when it is not a tokenizer.bin. */
static void refuse_non_tokenizer(const unsigned char *d, size_t size, const char *path) {
    const char *kind = foreign_format(d, size);
    if (kind) die(EXIT_BAD_FILE, "%s: is %s, not a tokenizer.bin: convert tokenizer.model with `python3 export.py tokenizer tokenizer.model tokenizer.bin`",
                  path, kind);
    if (looks_like_checkpoint(d, size))
        die(EXIT_BAD_FILE, "%s: is a checkpoint, not a tokenizer (-z takes a tokenizer.bin)", path);
    if (looks_like_tokenizer(d, size)) return;
    if (looks_like_sentencepiece(d, size))
        die(EXIT_BAD_FILE, "%s: is a SentencePiece tokenizer.model, which -z does not read: convert it with "
            "`python3 export.py tokenizer tokenizer.model tokenizer.bin` and pass -z tokenizer.bin", path);
    const char *text = text_format(d, size);
    if (text && strcmp(text, "a JSON file") == 0)
        die(EXIT_BAD_FILE, "%s: is a JSON file, which -z does not read: convert a tokenizer.json with "
            "`python3 export.py tokenizer tokenizer.json tokenizer.bin` and pass -z tokenizer.bin", path);
    if (text)
        die(EXIT_BAD_FILE, "%s: is a text file, not a tokenizer: -z takes a tokenizer.bin (`python3 export.py tokenizer "
            "tokenizer.model tokenizer.bin` makes one)", path);
}

/* byte_pieces: byte b as the string {b, 0} at 2b, what byte tokens decode to */
static void set_byte_pieces(Tokenizer *t) {
    for (int i = 0; i < 256; i++) {
        t->byte_pieces[i * 2] = (unsigned char)i;
        t->byte_pieces[i * 2 + 1] = '\0';
    }
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
    if (size >= 4 && memcmp(data, "tk42", 4) == 0) {
        load_byte_level_tokenizer(t, data, size, path, vocab_size);
        unmap((void *)data, size);
        return;
    }
    if (is_gguf(data, size)) {
        load_gguf_tokenizer_file(t, data, size, path, vocab_size);
        unmap((void *)data, size);
        return;
    }
    refuse_non_tokenizer(data, size, path);
    t->bos = TOKEN_BOS;
    t->eos = t->end[0] = t->end_of_turn = TOKEN_EOS;
    t->n_end = 1;
    t->chat_template = CHAT_LLAMA2;
    t->add_bos = 1;
    t->fixed_ids = 1;
    for (int b = 0; b < 256; b++) t->byte_token[b] = b + BYTE_TOKEN_OFFSET < vocab_size ? b + BYTE_TOKEN_OFFSET : -1;
    if (size < 4) die(EXIT_BAD_FILE, "%s: truncated tokenizer: no max_token_length", path);
    int32_t max_len = read_i32((const char *)data);
    if (max_len <= 0 || max_len > (1 << 20))
        die(EXIT_BAD_FILE, "%s: bad tokenizer: max_token_length is %d", path, max_len);
    t->max_token_length = max_len;
    at = 4;
    t->vocab = xcalloc((size_t)vocab_size, sizeof(char *));
    t->vocab_scores = xcalloc((size_t)vocab_size, sizeof(float));
    for (int i = 0; i < vocab_size; i++) {
        if (at == size) /* whole, and short: another model's */
            die(EXIT_BAD_FILE, "%s: tokenizer has %d tokens, the model has %d: wrong tokenizer for this model? "
                "(each model needs the tokenizer it was trained with)", path, i, vocab_size);
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
    unmap((void *)data, size);
    set_byte_pieces(t);
    t->sorted_vocab = xcalloc((size_t)vocab_size, sizeof(TokenIndex));
    for (int i = 0; i < vocab_size; i++) t->sorted_vocab[i] = (TokenIndex){t->vocab[i], i};
    qsort(t->sorted_vocab, (size_t)vocab_size, sizeof(TokenIndex), compare_tokens);
}

static void free_tokenizer(Tokenizer *t) {
    for (int i = 0; i < t->vocab_size; i++) free(t->vocab[i]);
    free(t->vocab);
    free(t->vocab_scores);
    free(t->sorted_vocab);
    free(t->pieces.slot);
    free(t->piece_len);
    free(t->special);
    free(t->merges);
    free(t->letter_ranges);
    free(t->number_ranges);
    free(t->punct_ranges);
    free(t->user_tokens);
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

/* SentencePiece's encoding of one text (no special tokens in it), appended
   at `tokens`; returns the count, or -1 (naming the byte in *bad_byte) when a
   byte has no token. A dummy-prefix space first (when asked and the text is
   not empty), each UTF-8 code point as its piece or else as byte tokens
   <0xNN>, then merges of the best-scoring adjacent pair, leftmost first, until
   none is in the vocabulary. A heap of candidate merges gives llama2.c's
   result in O(n log n) instead of its O(n^2) rescans. A `lead` token (>= 0)
   goes first and takes part in the merges: llama2.c merges its BOS with the
   text when the vocabulary has the concatenation. */
static int encode_sentencepiece(const Tokenizer *t, const char *text, int lead, int dummy_prefix, int *tokens, int *bad_byte) {
    char *buffer = xcalloc((size_t)t->max_token_length * 2 + 3, 1);
    int n = 0;
    if (lead >= 0) tokens[n++] = lead;
    if (dummy_prefix && text[0] != '\0') {
        int space = lookup_piece(t, " ");
        if (space != -1) tokens[n++] = space;
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
                int byte_id = t->byte_token[(unsigned char)buffer[i]];
                if (byte_id < 0) {
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
    free(prev);
    free(next);
    free(heap);
    free(buffer);
    return out;
}

/* A stretch of the text: plain text from `start`, `len` bytes long, or
   (token >= 0) a user-defined token found there. */
typedef struct {
    int start, len, token;
} Fragment;

static Fragment *split_user_tokens(const Tokenizer *t, const char *text, size_t len, int *n_fragments);

/* Encodes `text` into `tokens` (room for encode_capacity() ids) and returns the
   count: BOS when asked and the vocabulary adds one, the text's tokens, EOS
   when asked (or with BOS, when the vocabulary adds it). Returns -1 (and names
   the byte in *bad_byte) when a byte has no token. A byte-level tokenizer's
   text goes to encode_byte_level() (5.2). A tokenizer.bin's BOS merges
   with the text as in llama2.c; a GGUF vocabulary's BOS stands alone, as in
   llama.cpp. In a SentencePiece vocabulary from a GGUF file, user-defined
   tokens are cut out of the text first; each stretch of text between them is
   encoded alone, with the dummy prefix when it starts the text or follows
   such a token, as llama.cpp does (none where the file says add_space_prefix
   false: Gemma). */
static int encode(const Tokenizer *t, const char *text, int bos, int eos, int *tokens, int *bad_byte) {
    if (t->byte_level) return encode_byte_level(t, text, bos, eos, tokens);
    int n = 0;
    if (bos && t->add_bos && !t->fixed_ids) tokens[n++] = t->bos;
    if (t->n_user == 0) {
        int lead = bos && t->add_bos && t->fixed_ids ? t->bos : -1;
        int count = encode_sentencepiece(t, text, lead, !t->no_space_prefix, tokens + n, bad_byte);
        if (count < 0) return -1;
        n += count;
    } else {
        int n_fragments;
        Fragment *f = split_user_tokens(t, text, strlen(text), &n_fragments);
        char *piece = xcalloc(strlen(text) + 1, 1);
        for (int i = 0; i < n_fragments; i++) {
            if (f[i].token >= 0) {
                tokens[n++] = f[i].token;
                continue;
            }
            memcpy(piece, text + f[i].start, (size_t)f[i].len);
            piece[f[i].len] = '\0';
            int count = encode_sentencepiece(t, piece, -1, !t->no_space_prefix && (i == 0 || f[i - 1].token >= 0), tokens + n, bad_byte);
            if (count < 0) {
                free(piece);
                free(f);
                return -1;
            }
            n += count;
        }
        free(piece);
        free(f);
    }
    if (eos || (bos && t->add_eos)) tokens[n++] = t->eos;
    return n;
}

/* The text of `token` following `prev_token`: the space that SentencePiece
   puts at the start of a text is dropped after BOS (unless it puts none), and byte tokens <0xNN>
   become the byte itself. A byte-level piece is its bytes, as they are. */
static const char *decode(const Tokenizer *t, int prev_token, int token) {
    const char *piece = t->vocab[token];
    if (t->byte_level) return piece;
    if (prev_token == t->bos && piece[0] == ' ' && !t->no_space_prefix) piece++;
    unsigned char byte_val;
    if (sscanf(piece, "<0x%02hhX>", &byte_val) == 1) piece = (const char *)t->byte_pieces + byte_val * 2;
    return piece;
}

/* Whether a decoded piece is printed: not when empty, nor when it is a single
   byte that is neither printable nor white space (a lone control byte, or a
   fragment of a UTF-8 sequence that has no token of its own). Byte-level
   pieces are printed whole: their fragments of UTF-8 join up in the output. */
static int piece_is_printable(const Tokenizer *t, const char *piece) {
    if (piece[0] == '\0') return 0;
    if (t->byte_level) return 1;
    if (piece[1] == '\0') {
        unsigned char byte_val = (unsigned char)piece[0];
        if (!(isprint(byte_val) || isspace(byte_val))) return 0;
    }
    return 1;
}

/* Room encode() needs for a text of `len` bytes: llama2.c's bound of one id
   per byte plus BOS, EOS and the dummy prefix; byte-level BPE replaces each
   invalid byte by U+FFFD (three bytes, so up to three ids); user-defined
   tokens cut SentencePiece text into stretches that each get a dummy prefix. */
static size_t encode_capacity(const Tokenizer *t, size_t len) {
    return (t->byte_level ? 3 * len : t->n_user ? 2 * len : len) + 3;
}

/* ---- 5.2 byte-level BPE (Llama 3) ---------------------------------------
   A "tk42" file, written by export.py from a Hugging Face tokenizer.json
   (int32 little-endian unless said otherwise):
     "tk42", format version 1, vocab_size, n_merges, max_token_length, bos,
     end_of_turn, chat template (0 llama2, 1 llama3), pre-tokenizer (1: the
     Llama 3 split), n_end (1..8), end[n_end];
     per token: flags (1: special), byte length, the bytes;
     per merge, best rank first: left id, right id, merged id;
     n_letter, (first, last) code point ranges of \p{L};
     n_number, the ranges of \p{N}.
   tokenizer.bin has no magic: it starts with max_token_length, at most 2^20
   here, while "tk42" read as an int32 is 842230644, so neither is taken for
   the other.

   Encoding splits the text as Llama 3's pre-tokenizer regex does, then runs
   BPE inside each piece: start from one token per byte, merge the adjacent
   pair of lowest rank (the leftmost among equals) until no pair has a merge.
   A piece that is itself a token is taken whole (the tokenizer's
   "ignore_merges"). Special tokens (<|begin_of_text|>, ...) are never
   produced from text; the chat template inserts them by id.

   The split needs Unicode's letter (L*) and number (N*) categories. They
   come in the file, as ranges written from Python's unicodedata: about 700
   ranges that a program would otherwise have to carry and keep current with
   Unicode, and the tokenizer file is made by the same tool that reads
   tokenizer.json. White space is the fixed, short White_Space property. */

/* A cursor over a tokenizer file that refuses to run past its end. */
static int32_t take_tokenizer_i32(const unsigned char *data, size_t size, size_t *at, const char *path, const char *what) {
    if (size - *at < 4) die(EXIT_BAD_FILE, "%s: truncated tokenizer: no room for %s at offset %zu", path, what, *at);
    int32_t v = read_i32((const char *)data + *at);
    *at += 4;
    return v;
}

static uint32_t merge_hash(int left, int right) {
    return ((uint32_t)left * 2654435761u) ^ ((uint32_t)right * 2246822519u);
}

/* FNV-1a of len bytes, carried on from h (FNV_START: from nothing) */
#define FNV_START 2166136261u
static uint32_t bytes_hash_from(uint32_t h, const char *b, int len) {
    for (int i = 0; i < len; i++) h = (h ^ (uint8_t)b[i]) * 16777619u;
    return h;
}

static uint32_t bytes_hash(const char *b, int len) { return bytes_hash_from(FNV_START, b, len); }

/* The slot of the text of these bytes, or the empty slot where it would go. */
static uint32_t text_slot(const TextIndex *x, const char *bytes, int len) {
    uint32_t i = bytes_hash(bytes, len) & x->mask;
    for (int id; (id = x->slot[i]) >= 0; i = (i + 1) & x->mask)
        if (x->len[id] == len && memcmp(x->text[id], bytes, (size_t)len) == 0) break;
    return i;
}

/* The id of the text of these bytes, or -1. */
static int text_id(const TextIndex *x, const char *bytes, int len) { return x->slot[text_slot(x, bytes, len)]; }

/* The id of the text a (la bytes) followed by b (lb bytes), or -1: text_id
   of the two joined, without joining them. */
static int text_id_joined(const TextIndex *x, const char *a, int la, const char *b, int lb) {
    for (uint32_t i = bytes_hash_from(bytes_hash(a, la), b, lb) & x->mask;; i = (i + 1) & x->mask) {
        const int id = x->slot[i];
        if (id < 0 || (x->len[id] == la + lb && memcmp(x->text[id], a, (size_t)la) == 0 && memcmp(x->text[id] + la, b, (size_t)lb) == 0))
            return id;
    }
}

/* An index of the n texts but those marked in `skip`; of two the same, the
   later id (as llama.cpp's map of a vocabulary's tokens). A sorted array
   searched in halves took 0.2 s for Llama 3's 128,000 pieces and the three
   lookups of each of its 280,000 merges. */
static TextIndex index_texts(char *const *text, const int *len, const unsigned char *skip, int n) {
    uint32_t cap = 2;
    while (cap < 2 * (uint32_t)n) cap *= 2;
    TextIndex x = {xcalloc(cap, sizeof(int)), cap - 1, text, len};
    for (uint32_t i = 0; i < cap; i++) x.slot[i] = -1;
    for (int id = 0; id < n; id++)
        if (!skip[id]) x.slot[text_slot(&x, text[id], len[id])] = id;
    return x;
}

/* The merge rule of the pair (left, right), or NULL. */
static const MergeRule *find_merge(const Tokenizer *t, int left, int right) {
    for (uint32_t i = merge_hash(left, right) & (uint32_t)t->merge_mask;; i = (i + 1) & (uint32_t)t->merge_mask) {
        const MergeRule *m = &t->merges[i];
        if (m->left < 0) return NULL;
        if (m->left == left && m->right == right) return m;
    }
}

/* Reads `n` (first, last) code point ranges, ascending and disjoint. */
static int *load_ranges(const unsigned char *data, size_t size, size_t *at, const char *path, int *n, const char *what) {
    *n = take_tokenizer_i32(data, size, at, path, what);
    if (*n < 0 || (size_t)*n > (size - *at) / 8)
        die(EXIT_BAD_FILE, "%s: bad tokenizer: %d %s ranges do not fit the file", path, *n, what);
    int *r = xcalloc(2 * (size_t)*n, sizeof(int));
    for (int i = 0; i < 2 * *n; i++) r[i] = take_tokenizer_i32(data, size, at, path, what);
    for (int i = 0; i < *n; i++)
        if (r[2 * i] > r[2 * i + 1] || r[2 * i] < (i ? r[2 * i - 1] + 1 : 0) || r[2 * i + 1] > 0x10FFFF)
            die(EXIT_BAD_FILE, "%s: bad tokenizer: %s range %d is not ascending code points", path, what, i);
    return r;
}

static void load_byte_level_tokenizer(Tokenizer *t, const unsigned char *data, size_t size, const char *path, int vocab_size) {
    size_t at = 4;
    int32_t h[8];
    static const char *names[] = {"version", "vocab_size", "n_merges", "max_token_length", "bos", "end_of_turn",
                                  "chat template", "pre-tokenizer"};
    for (int i = 0; i < 8; i++) h[i] = take_tokenizer_i32(data, size, &at, path, names[i]);
    if (h[0] != 1) die(EXIT_BAD_FILE, "%s: unknown tokenizer version %d (this program reads tk42 version 1)", path, h[0]);
    if (h[1] != vocab_size)
        die(EXIT_BAD_FILE, "%s: tokenizer has %d tokens, the model has %d: wrong tokenizer for this model?", path, h[1], vocab_size);
    if (h[2] < 0 || (size_t)h[2] > size / 12) die(EXIT_BAD_FILE, "%s: bad tokenizer: %d merges do not fit the file", path, h[2]);
    if (h[3] <= 0 || h[3] > (1 << 20)) die(EXIT_BAD_FILE, "%s: bad tokenizer: max_token_length is %d", path, h[3]);
    if (h[4] < 0 || h[4] >= vocab_size || h[5] < 0 || h[5] >= vocab_size)
        die(EXIT_BAD_FILE, "%s: bad tokenizer: BOS %d or end-of-turn %d is not a token", path, h[4], h[5]);
    if (h[6] != CHAT_LLAMA2 && h[6] != CHAT_LLAMA3) die(EXIT_BAD_FILE, "%s: bad tokenizer: unknown chat template %d", path, h[6]);
    if (h[7] != 1) die(EXIT_BAD_FILE, "%s: bad tokenizer: unknown pre-tokenizer %d", path, h[7]);
    t->byte_level = 1;
    t->pre = PRE_LLAMA3;
    t->ignore_merges = 1;
    t->add_bos = 1;
    t->max_token_length = h[3];
    t->bos = h[4];
    t->end_of_turn = h[5];
    t->chat_template = h[6];
    t->eos_ends_generate = 1;
    t->n_end = take_tokenizer_i32(data, size, &at, path, "n_end");
    if (t->n_end < 1 || t->n_end > MAX_END_TOKENS)
        die(EXIT_BAD_FILE, "%s: bad tokenizer: %d end tokens (1 to %d)", path, t->n_end, MAX_END_TOKENS);
    for (int i = 0; i < t->n_end; i++) {
        t->end[i] = take_tokenizer_i32(data, size, &at, path, "end token");
        if (t->end[i] < 0 || t->end[i] >= vocab_size) die(EXIT_BAD_FILE, "%s: bad tokenizer: end token %d is not a token", path, t->end[i]);
    }
    t->eos = t->end[0];

    t->vocab = xcalloc((size_t)vocab_size, sizeof(char *));
    t->piece_len = xcalloc((size_t)vocab_size, sizeof(int));
    t->special = xcalloc((size_t)vocab_size, 1);
    for (int i = 0; i < 256; i++) t->byte_token[i] = -1;
    for (int i = 0; i < vocab_size; i++) {
        int32_t flags = take_tokenizer_i32(data, size, &at, path, "token flags");
        int32_t len = take_tokenizer_i32(data, size, &at, path, "token length");
        if ((flags != 0 && flags != 1) || len < 0 || len > t->max_token_length || (flags == 0 && len == 0))
            die(EXIT_BAD_FILE, "%s: bad tokenizer: token %d has flags %d and length %d (max_token_length %d)",
                path, i, flags, len, t->max_token_length);
        if (size - at < (size_t)len) die(EXIT_BAD_FILE, "%s: truncated tokenizer: token %d needs %d bytes", path, i, len);
        t->vocab[i] = xcalloc((size_t)len + 1, 1);
        memcpy(t->vocab[i], data + at, (size_t)len);
        at += (size_t)len;
        t->piece_len[i] = len;
        t->special[i] = (unsigned char)flags;
        if (!flags && len == 1 && t->byte_token[data[at - 1]] < 0) t->byte_token[data[at - 1]] = i;
    }
    for (int b = 0; b < 256; b++)
        if (t->byte_token[b] < 0) die(EXIT_BAD_FILE, "%s: bad tokenizer: no token for the byte 0x%02X", path, b);

    /* merges, in a hash table at most half full */
    int n_merges = h[2], cap = 2;
    while (cap < 2 * n_merges) cap *= 2;
    t->merge_mask = cap - 1;
    t->merges = xcalloc((size_t)cap, sizeof(MergeRule));
    for (int i = 0; i < cap; i++) t->merges[i].left = -1;
    for (int r = 0; r < n_merges; r++) {
        int left = take_tokenizer_i32(data, size, &at, path, "merge");
        int right = take_tokenizer_i32(data, size, &at, path, "merge");
        int merged = take_tokenizer_i32(data, size, &at, path, "merge");
        if (left < 0 || left >= vocab_size || right < 0 || right >= vocab_size || merged < 0 || merged >= vocab_size)
            die(EXIT_BAD_FILE, "%s: bad tokenizer: merge %d names a token outside the vocabulary", path, r);
        int ll = t->piece_len[left], lr = t->piece_len[right];
        if (t->special[left] || t->special[right] || t->special[merged] || t->piece_len[merged] != ll + lr ||
            memcmp(t->vocab[merged], t->vocab[left], (size_t)ll) != 0 || memcmp(t->vocab[merged] + ll, t->vocab[right], (size_t)lr) != 0)
            die(EXIT_BAD_FILE, "%s: bad tokenizer: merge %d: token %d is not tokens %d and %d joined", path, r, merged, left, right);
        if (find_merge(t, left, right)) continue; /* a repeated pair keeps its best rank */
        uint32_t i = merge_hash(left, right) & (uint32_t)t->merge_mask;
        while (t->merges[i].left >= 0) i = (i + 1) & (uint32_t)t->merge_mask;
        t->merges[i] = (MergeRule){left, right, merged, r};
    }
    t->letter_ranges = load_ranges(data, size, &at, path, &t->n_letter, "letter");
    t->number_ranges = load_ranges(data, size, &at, path, &t->n_number, "number");
    if (at != size) die(EXIT_BAD_FILE, "%s: bad tokenizer: %zu bytes left over after the number ranges", path, size - at);

    t->pieces = index_texts(t->vocab, t->piece_len, t->special, vocab_size); /* for taking a split piece whole */
}

/* The id of the ordinary piece with exactly these bytes, or -1. */
static int lookup_bytes(const Tokenizer *t, const char *bytes, int len) { return text_id(&t->pieces, bytes, len); }

/* The id of the special token spelled `text`, or -1. */
static int lookup_special(const Tokenizer *t, const char *text) {
    for (int i = 0; i < t->vocab_size; i++)
        if (t->special[i] && strcmp(t->vocab[i], text) == 0) return i;
    return -1;
}

static int in_ranges(const int *r, int n, int cp) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (cp < r[2 * mid]) hi = mid - 1;
        else if (cp > r[2 * mid + 1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

/* Unicode's White_Space property, the regex's \s. */
static int is_space_cp(int cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* The decoded text: code points and where each starts in the UTF-8 bytes. */
typedef struct {
    int n;
    int *cp;      /* (n + 1) code points; cp[n] = 0 ends it */
    char *bytes;  /* the text as well-formed UTF-8 */
    int *offset;  /* (n + 1) byte offset of each code point; offset[n] = the length */
    unsigned char *cls; /* (n + 1) CP_LETTER, CP_NUMBER, CP_SPACE or CP_OTHER */
    char *cat;    /* (n + 1) unicode_class of each, white space 0: only for the
                     pre-tokenizers that tell letters by case, marks or symbols */
} CodePoints;

enum { CP_OTHER, CP_LETTER, CP_NUMBER, CP_SPACE };

/* Decodes one code point at s (n bytes left, n >= 1); *len gets the bytes it
   takes. An ill-formed sequence is U+FFFD, once for each maximal part that
   could begin a well-formed one (Unicode's and the WHATWG decoder's rule, as
   text decoders before a tokenizer apply it). */
static int decode_utf8(const unsigned char *s, size_t n, int *len) {
    unsigned char c = s[0];
    int need = c < 0x80 ? 0 : (c >= 0xC2 && c <= 0xDF) ? 1 : (c >= 0xE0 && c <= 0xEF) ? 2 : (c >= 0xF0 && c <= 0xF4) ? 3 : -1;
    *len = 1;
    if (need == 0) return c;
    if (need < 0) return 0xFFFD;
    int cp = c & (0x3F >> need);
    for (int i = 1; i <= need; i++) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (i == 1) {
            lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
        }
        if ((size_t)i >= n || s[i] < lo || s[i] > hi) {
            *len = i;
            return 0xFFFD;
        }
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    *len = need + 1;
    return cp;
}

/* Writes code point cp (at most 0x10FFFF) as UTF-8 at out; returns the byte count. */
static int encode_utf8(int cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12); out[1] = (char)(0x80 | (cp >> 6 & 0x3F)); out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18); out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Whether t's pre-tokenizer asks more of a code point than its class. */
static int needs_unicode_class(const Tokenizer *t) { return t->pre == PRE_GPT4O || t->pre == PRE_TEKKEN || t->pre == PRE_DEEPSEEK3; }

static CodePoints decode_code_points(const Tokenizer *t, const char *text) {
    size_t len = strlen(text);
    CodePoints c = {0, xcalloc(len + 1, sizeof(int)), xcalloc(3 * len + 1, 1), xcalloc(len + 1, sizeof(int)), xcalloc(len + 1, 1),
                    needs_unicode_class(t) ? xcalloc(len + 1, 1) : NULL};
    int at = 0;
    for (size_t i = 0; i < len;) {
        int step, cp = decode_utf8((const unsigned char *)text + i, len - i, &step);
        i += (size_t)step;
        c.cp[c.n] = cp;
        c.offset[c.n] = at;
        c.cls[c.n] = is_space_cp(cp) ? CP_SPACE : in_ranges(t->letter_ranges, t->n_letter, cp) ? CP_LETTER
                   : in_ranges(t->number_ranges, t->n_number, cp) ? CP_NUMBER : CP_OTHER;
        if (c.cat) c.cat[c.n] = c.cls[c.n] == CP_SPACE ? 0 : unicode_class(cp);
        at += encode_utf8(cp, c.bytes + at);
        c.n++;
    }
    c.offset[c.n] = at;
    return c;
}

static void free_code_points(CodePoints *c) {
    free(c->cp); free(c->bytes); free(c->offset); free(c->cls); free(c->cat);
}

/* The end of the run of code points of class `cls` starting at i, before b. */
static int run_end(const CodePoints *c, int i, int b, int cls) {
    while (i < b && c->cls[i] == cls) i++;
    return i;
}

static int is_newline(int cp) { return cp == '\r' || cp == '\n'; }

/* The end of a run of digits at i (< b), at most max_digits of them. */
static int digits_end(const CodePoints *c, int i, int b, int max_digits) {
    int j = i;
    while (j < b && j < i + max_digits && c->cls[j] == CP_NUMBER) j++;
    return j;
}

/* ---- Pre-tokenizers --------------------------------------------------------
   A pre-tokenizer cuts the text into pieces that BPE then encodes one by one.
   Each is a list of stages, as llama.cpp runs its list of regular
   expressions: a stage cuts every piece of the stage before into its matches
   and the stretches between them. A stage is a function that finds the next
   match in a piece [from, b): it returns the match's end and sets *start, or
   returns -1 when there is none. The regular expressions (from llama.cpp's
   llama-vocab.cpp, as Hugging Face's tokenizer.json files give them) are
   written out by hand: \s is Unicode's White_Space, \p{L}, \p{N}, \p{P},
   \p{M}, \p{S} and the letters' cases Unicode's general categories, white
   space taking precedence. */
typedef int (*SplitStage)(const Tokenizer *t, const CodePoints *c, int from, int b, int *start);

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at code point i (< b): its end, or -1. */
static int contraction_end(const CodePoints *c, int i, int b) {
    const int *cp = c->cp;
    if (cp[i] != '\'' || i + 1 >= b) return -1;
    int a = cp[i + 1] | 0x20, a2 = i + 2 < b ? cp[i + 2] | 0x20 : 0;
    /* (?i) also folds U+017F (long s) to s */
    if (a == 's' || a == 't' || a == 'm' || a == 'd' || cp[i + 1] == 0x17F) return i + 2;
    if ((a == 'r' && a2 == 'e') || (a == 'v' && a2 == 'e') || (a == 'l' && a2 == 'l')) return i + 3;
    return -1;
}

/* The last three alternatives at white space i (< b):
     \s*[\r\n]+                       white space up to its last newline
     \s+(?!\S)                        white space but the last before a non-space
     \s+                              white space */
static int space_piece_end(const CodePoints *c, int i, int b) {
    const int *cp = c->cp;
    int j = run_end(c, i, b, CP_SPACE), last_newline = -1;
    for (int k = i; k < j; k++)
        if (is_newline(cp[k])) last_newline = k;
    if (last_newline >= 0) return last_newline + 1;
    if (j < b && j - 1 > i) return j - 1;
    return j;
}

/* The Llama 3 (and Qwen2) expression at code point i (< b): the first of its
   alternatives that matches at i, in order,
     (?i:'s|'t|'re|'ve|'m|'ll|'d)     a contraction
     [^\r\n\p{L}\p{N}]?\p{L}+         letters, after at most one other non-newline
     \p{N}{1,max_digits}              up to three digits (Qwen2: one)
      ?[^\s\p{L}\p{N}]+[\r\n]*        punctuation, after at most a space, with its newlines
     \s*[\r\n]+                       white space up to its last newline
     \s+(?!\S)                        white space but the last before a non-space
     \s+                              white space
   Every code point starts some alternative, so the pieces cover the text. */
static int llama3_piece_end(const CodePoints *c, int i, int b, int max_digits) {
    const int *cp = c->cp;
    const unsigned char *cls = c->cls;
    int contraction = contraction_end(c, i, b);
    if (contraction >= 0) return contraction;
    if (cls[i] == CP_LETTER) return run_end(c, i, b, CP_LETTER);
    if (cls[i] != CP_NUMBER && !is_newline(cp[i]) && i + 1 < b && cls[i + 1] == CP_LETTER) return run_end(c, i + 1, b, CP_LETTER);
    if (cls[i] == CP_NUMBER) return digits_end(c, i, b, max_digits);
    int from = cp[i] == ' ' && i + 1 < b && cls[i + 1] == CP_OTHER ? i + 1 : i;
    if (cls[from] == CP_OTHER) {
        int j = run_end(c, from, b, CP_OTHER);
        while (j < b && is_newline(cp[j])) j++;
        return j;
    }
    return space_piece_end(c, i, b);
}

static int stage_llama3(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    *start = from;
    return llama3_piece_end(c, from, b, 3);
}

static int stage_qwen2(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    *start = from;
    return llama3_piece_end(c, from, b, 1);
}

/* GPT-4o's classes of letters: [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] ("upper")
   and [\p{Ll}\p{Lm}\p{Lo}\p{M}] ("lower"): uncased letters and marks are both. */
static int is_upper_at(const CodePoints *c, int i) { return c->cat[i] == 'u' || c->cat[i] == 'L' || c->cat[i] == 'M'; }
static int is_lower_at(const CodePoints *c, int i) { return c->cat[i] == 'l' || c->cat[i] == 'L' || c->cat[i] == 'M'; }

/* The end of a cased word at i (< b), or -1: [upper]*[lower]+ (upper_first
   0) or [upper]+[lower]* (1), each quantifier as greedy as a regex's and
   giving back what the next needs. */
static int cased_word_end(const CodePoints *c, int i, int b, int upper_first) {
    int e = i;
    while (e < b && is_upper_at(c, e)) e++;
    if (upper_first && e == i) return -1;
    if (upper_first || (e < b && is_lower_at(c, e))) {
        while (e < b && is_lower_at(c, e)) e++;
        return e;
    }
    /* [upper]* gives back up to its last code point that is also lower */
    for (int k = e - 1; k >= i; k--)
        if (is_lower_at(c, k)) return k + 1;
    return -1;
}

/* The GPT-4o (o200k) expression at code point i (< b), as its tokenizer.json
   gives it: the first of its alternatives that matches at i, in order,
     [^\r\n\p{L}\p{N}]?[upper]*[lower]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
     [^\r\n\p{L}\p{N}]?[upper]+[lower]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
                                      a word, cut before a capital that follows lower case
     \p{N}{1,max_digits}              up to three digits
      ?[^\s\p{L}\p{N}]+[\r\n/]*       punctuation, after at most a space, with its newlines and slashes
     and white space as Llama 3's. Tekken (Mistral) is the same without the
   contractions and with one digit. Every code point starts some alternative. */
static int o200k_piece_end(const CodePoints *c, int i, int b, int contractions, int max_digits) {
    const int *cp = c->cp;
    const unsigned char *cls = c->cls;
    int prefix = !is_newline(cp[i]) && cls[i] != CP_LETTER && cls[i] != CP_NUMBER;
    for (int upper_first = 0; upper_first < 2; upper_first++) {
        int e = prefix ? cased_word_end(c, i + 1, b, upper_first) : -1;
        if (e < 0) e = cased_word_end(c, i, b, upper_first);
        if (e < 0) continue;
        int contraction = contractions && e < b ? contraction_end(c, e, b) : -1;
        return contraction >= 0 ? contraction : e;
    }
    if (cls[i] == CP_NUMBER) return digits_end(c, i, b, max_digits);
    int from = cp[i] == ' ' && i + 1 < b && cls[i + 1] == CP_OTHER ? i + 1 : i;
    if (cls[from] == CP_OTHER) {
        int j = run_end(c, from, b, CP_OTHER);
        while (j < b && (is_newline(cp[j]) || cp[j] == '/')) j++;
        return j;
    }
    return space_piece_end(c, i, b);
}

static int stage_gpt4o(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    *start = from;
    return o200k_piece_end(c, from, b, 1, 3);
}

static int stage_tekken(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    *start = from;
    return o200k_piece_end(c, from, b, 0, 1);
}

static int is_ascii_letter(int cp) { return (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z'); }
static int is_letter_or_mark_at(const CodePoints *c, int i) { return c->cls[i] == CP_LETTER || c->cat[i] == 'M'; }
static int is_punct_or_symbol_at(const CodePoints *c, int i) { return c->cat[i] == 'P' || c->cat[i] == 'S'; }

/* DeepSeek V3's last expression at code point i (< b): its end, or -1 when
   none of its alternatives matches there:
     [!-/:-@[-`{-~][A-Za-z]+          ASCII letters after one ASCII punctuation or symbol
     [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
                                      letters and marks, after at most one other non-newline
      ?[\p{P}\p{S}]+[\r\n]*          punctuation and symbols, after at most a space, with their newlines
     and white space as Llama 3's. */
static int deepseek3_piece_end(const CodePoints *c, int i, int b) {
    const int *cp = c->cp;
    int ascii_punct = cp[i] > 0x20 && cp[i] < 0x7F && !is_ascii_letter(cp[i]) && !(cp[i] >= '0' && cp[i] <= '9');
    if (ascii_punct && i + 1 < b && is_ascii_letter(cp[i + 1])) {
        int j = i + 1;
        while (j < b && is_ascii_letter(cp[j])) j++;
        return j;
    }
    int from = !is_newline(cp[i]) && c->cls[i] != CP_LETTER && !is_punct_or_symbol_at(c, i) && i + 1 < b && is_letter_or_mark_at(c, i + 1) ? i + 1 : i;
    if (is_letter_or_mark_at(c, from)) {
        int j = from;
        while (j < b && is_letter_or_mark_at(c, j)) j++;
        return j;
    }
    from = cp[i] == ' ' && i + 1 < b && is_punct_or_symbol_at(c, i + 1) ? i + 1 : i;
    if (is_punct_or_symbol_at(c, from)) {
        int j = from;
        while (j < b && is_punct_or_symbol_at(c, j)) j++;
        while (j < b && is_newline(cp[j])) j++;
        return j;
    }
    return c->cls[i] == CP_SPACE ? space_piece_end(c, i, b) : -1;
}

/* The next match of DeepSeek V3's last expression: digits and other
   code points not before a letter match none of its alternatives. */
static int stage_deepseek3(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    for (int i = from; i < b; i++) {
        int end = deepseek3_piece_end(c, i, b);
        if (end >= 0) {
            *start = i;
            return end;
        }
    }
    return -1;
}

/* GPT-2's expression at code point `from`, as llama.cpp matches it:
     's|'t|'re|'ve|'m|'ll|'d          a contraction (lower case only)
      ?\p{L}+ |  ?\p{N}+              letters or numbers, after at most a space
      ?[^\s\p{L}\p{N}]+               anything else, after at most a space
     \s+(?!\S)                        white space but the last before a non-space
   and a code point that none matches (a lone space before a non-space) is a
   piece of its own. */
static int stage_gpt2(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    const int *cp = c->cp;
    int i = from;
    *start = from;
    if (cp[i] == '\'' && i + 1 < b) {
        int n = cp[i + 1], n2 = i + 2 < b ? cp[i + 2] : 0;
        if (n == 's' || n == 't' || n == 'm' || n == 'd') return i + 2;
        if ((n == 'r' && n2 == 'e') || (n == 'v' && n2 == 'e') || (n == 'l' && n2 == 'l')) return i + 3;
    }
    int k = cp[i] == ' ' && i + 1 < b ? i + 1 : i; /* after the optional space */
    if (!(cp[i] == ' ' && k == i)) {
        int cls = c->cls[k];
        if (cls != CP_SPACE) return run_end(c, k, b, cls);
    }
    int j = run_end(c, i, b, CP_SPACE);
    if (j - i > 1 && j < b) return j - 1;
    return j > i ? j : i + 1;
}

static int is_newline_at(const Tokenizer *t, const CodePoints *c, int i) { (void)t; return is_newline(c->cp[i]); }
static int is_number_at(const Tokenizer *t, const CodePoints *c, int i) { (void)t; return c->cls[i] == CP_NUMBER; }
static int is_letter_at(const Tokenizer *t, const CodePoints *c, int i) { (void)t; return c->cls[i] == CP_LETTER; }
static int is_punct_at(const Tokenizer *t, const CodePoints *c, int i) {
    return c->cls[i] != CP_SPACE && in_ranges(t->punct_ranges, t->n_punct, c->cp[i]);
}

/* DeepSeek LLM's own letters: its expression's list of Latin, Greek,
   Cyrillic, Armenian, Georgian, Cherokee, Glagolitic, Coptic... ranges
   (llama.cpp's llama-vocab.cpp, from DeepSeek's tokenizer.json). */
static const int deepseek_letters[][2] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xB5, 0xB5}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x1BA}, {0x1BC, 0x1BF}, {0x1C4, 0x293},
    {0x295, 0x2AF}, {0x370, 0x373}, {0x376, 0x377}, {0x37B, 0x37D}, {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C},
    {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481}, {0x48A, 0x52F}, {0x531, 0x556}, {0x10A0, 0x10C5}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD},
    {0x1C90, 0x1CBA}, {0x1CBD, 0x1CBF}, {0x1D00, 0x1D2B}, {0x1D6B, 0x1D77}, {0x1D79, 0x1D9A}, {0x1E00, 0x1F15}, {0x1F18, 0x1F1D}, {0x1F20, 0x1F45},
    {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59}, {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC},
    {0x1FBE, 0x1FBE}, {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4}, {0x1FF6, 0x1FFC},
    {0x2102, 0x2102}, {0x2107, 0x2107}, {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128},
    {0x212A, 0x212D}, {0x212F, 0x2134}, {0x2139, 0x2139}, {0x213C, 0x213F}, {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184}, {0x2C00, 0x2C7B},
    {0x2C7E, 0x2CE4}, {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF3}, {0xA640, 0xA66D}, {0xA680, 0xA69B}, {0xA722, 0xA76F}, {0xA771, 0xA787}, {0xA78B, 0xA78E},
    {0xAB70, 0xABBF}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17}, {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0x10400, 0x1044F}, {0x104B0, 0x104D3}, {0x104D8, 0x104FB},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x118A0, 0x118DF}, {0x1E900, 0x1E943},
};

/* DeepSeek LLM's punctuation: [!-/:-~！-／：-～‘-‟　-。], ASCII and full-width
   punctuation, the curly quotes, and U+3000..U+3002 of which the first, an
   ideographic space, is white space and so never matches (llama.cpp matches
   white space as \s only). */
static const int deepseek_punct[][2] = {{0x21, 0x2F}, {0x3A, 0x7E}, {0x2018, 0x201F}, {0x3001, 0x3002}, {0xFF01, 0xFF0F}, {0xFF1A, 0xFF5E}};

static int is_deepseek_letter_at(const Tokenizer *t, const CodePoints *c, int i) {
    (void)t;
    return c->cls[i] != CP_SPACE && in_ranges(&deepseek_letters[0][0], (int)(sizeof(deepseek_letters) / sizeof(deepseek_letters[0])), c->cp[i]);
}
static int is_deepseek_punct_at(const Tokenizer *t, const CodePoints *c, int i) {
    (void)t;
    return c->cls[i] != CP_SPACE && in_ranges(&deepseek_punct[0][0], (int)(sizeof(deepseek_punct) / sizeof(deepseek_punct[0])), c->cp[i]);
}

/* [一-龥ࠀ-一가-퟿]: U+0800..U+9FA5 and the Hangul U+AC00..U+D7FF, white space
   (U+2000.., U+3000) excepted. */
static int is_deepseek_cjk_at(const Tokenizer *t, const CodePoints *c, int i) {
    (void)t;
    int cp = c->cp[i];
    return c->cls[i] != CP_SPACE && ((cp >= 0x800 && cp <= 0x9FA5) || (cp >= 0xAC00 && cp <= 0xD7FF));
}

/* The next run of `test` code points (at most `max` of them: 0 for no limit),
   with an optional white space before it when `space` is set: \s?X+, X+ or X. */
static int next_run(const Tokenizer *t, const CodePoints *c, int from, int b, int *start, int space, int max,
                    int (*test)(const Tokenizer *, const CodePoints *, int)) {
    for (int i = from; i < b; i++) {
        int first = i;
        if (space && c->cls[i] == CP_SPACE && i + 1 < b && test(t, c, i + 1)) first = i + 1;
        else if (!test(t, c, i)) continue;
        int j = first;
        while (j < b && test(t, c, j) && (max == 0 || j - first < max)) j++;
        *start = i;
        return j;
    }
    return -1;
}

static int stage_newline(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 1, is_newline_at);
}
static int stage_digit(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 1, is_number_at);
}
static int stage_digits(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 0, is_number_at);
}
static int stage_space_letters(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 1, 0, is_letter_at);
}
static int stage_space_punct(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 1, 0, is_punct_at);
}
static int stage_deepseek_letters(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 1, 0, is_deepseek_letter_at);
}
static int stage_deepseek_punct(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 1, 0, is_deepseek_punct_at);
}
static int stage_cjk(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 0, is_deepseek_cjk_at);
}

/* DeepSeek V3's [一-龥぀-ゟ゠-ヿ]: U+4E00..U+9FA5 and the kana, U+3040..U+30FF. */
static int is_han_kana_at(const Tokenizer *t, const CodePoints *c, int i) {
    (void)t;
    int cp = c->cp[i];
    return (cp >= 0x4E00 && cp <= 0x9FA5) || (cp >= 0x3040 && cp <= 0x30FF);
}
static int stage_han_kana(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 0, is_han_kana_at);
}
static int stage_three_digits(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    return next_run(t, c, from, b, start, 0, 3, is_number_at);
}

/* \s+$: the white space that ends the piece. */
static int stage_trailing_space(const Tokenizer *t, const CodePoints *c, int from, int b, int *start) {
    (void)t;
    int i = b;
    while (i > from && c->cls[i - 1] == CP_SPACE) i--;
    if (i == b) return -1;
    *start = i;
    return b;
}

/* The stages of each pre-tokenizer (llama.cpp's list for its name). */
static int pre_tokenizer_stages(int pre, SplitStage *stages) {
    int n = 0;
    switch (pre) {
    case PRE_LLAMA3: stages[n++] = stage_llama3; break;
    case PRE_QWEN2: stages[n++] = stage_qwen2; break;
    case PRE_GPT2: stages[n++] = stage_gpt2; break;
    case PRE_SMOLLM: stages[n++] = stage_digit; stages[n++] = stage_gpt2; break;
    case PRE_DEEPSEEK_LLM:
        stages[n++] = stage_newline; stages[n++] = stage_deepseek_letters; stages[n++] = stage_deepseek_punct;
        stages[n++] = stage_trailing_space; stages[n++] = stage_cjk; stages[n++] = stage_digits;
        break;
    case PRE_DEEPSEEK_CODER:
        stages[n++] = stage_newline; stages[n++] = stage_space_letters; stages[n++] = stage_space_punct;
        stages[n++] = stage_cjk; stages[n++] = stage_digit;
        break;
    case PRE_GPT4O: stages[n++] = stage_gpt4o; break;
    case PRE_TEKKEN: stages[n++] = stage_tekken; break;
    case PRE_DEEPSEEK3: stages[n++] = stage_three_digits; stages[n++] = stage_han_kana; stages[n++] = stage_deepseek3; break;
    }
    return n;
}

/* Cuts the code points [a, b) into pieces: returns their count and their
   ends in *ends (the caller frees it). Pieces are never empty, so there are
   at most b - a. */
static int split_pieces(const Tokenizer *t, const CodePoints *c, int a, int b, int **ends) {
    SplitStage stages[8];
    int n_stages = pre_tokenizer_stages(t->pre, stages);
    int n = 0, *cur = xcalloc((size_t)(b - a) + 1, sizeof(int));
    if (b > a) cur[n++] = b;
    for (int s = 0; s < n_stages; s++) {
        int m = 0, *next = xcalloc((size_t)(b - a) + 1, sizeof(int));
        for (int p = 0, lo = a; p < n; lo = cur[p++]) {
            int hi = cur[p];
            for (int i = lo; i < hi;) {
                int start, end = stages[s](t, c, i, hi, &start);
                if (end < 0) start = end = hi;
                if (start > i) next[m++] = start; /* the stretch before the match */
                if (end > start) next[m++] = end;
                i = end;
            }
        }
        free(cur);
        cur = next;
        n = m;
    }
    *ends = cur;
    return n;
}

/* BPE on the bytes of one split piece: appends its tokens to `out` and
   returns how many. */
static int bpe_piece(const Tokenizer *t, const char *bytes, int len, int *out) {
    int whole = t->ignore_merges ? lookup_bytes(t, bytes, len) : -1;
    if (whole >= 0) {
        out[0] = whole;
        return 1;
    }
    int *prev = xcalloc((size_t)len, sizeof(int)), *next = xcalloc((size_t)len, sizeof(int));
    Merge *heap = xcalloc(3 * (size_t)len + 1, sizeof(Merge));
    int n_heap = 0;
    for (int i = 0; i < len; i++) {
        out[i] = t->byte_token[(unsigned char)bytes[i]];
        prev[i] = i - 1;
        next[i] = i + 1 < len ? i + 1 : -1;
    }
    /* candidate merges in the heap of 5.1, ranked by -rank: lowest rank
       first, then leftmost */
    for (int i = 0; i + 1 < len; i++) {
        const MergeRule *m = find_merge(t, out[i], out[i + 1]);
        if (m) heap_push(heap, &n_heap, (Merge){-(float)m->rank, i, i + 1, m->left, m->right, m->merged});
    }
    while (n_heap > 0) {
        Merge m = heap_pop(heap, &n_heap);
        if (next[m.left] != m.right || out[m.left] != m.left_id || out[m.right] != m.right_id) continue;
        out[m.left] = m.merged_id;
        out[m.right] = -1;
        next[m.left] = next[m.right];
        if (next[m.right] >= 0) prev[next[m.right]] = m.left;
        next[m.right] = -2;
        int neighbours[2][2] = {{prev[m.left], m.left}, {m.left, next[m.left]}};
        for (int k = 0; k < 2; k++) {
            int a = neighbours[k][0], b = neighbours[k][1];
            if (a < 0 || b < 0) continue;
            const MergeRule *r = find_merge(t, out[a], out[b]);
            if (r) heap_push(heap, &n_heap, (Merge){-(float)r->rank, a, b, r->left, r->right, r->merged});
        }
    }
    int n = 0;
    for (int i = 0; i < len; i++)
        if (out[i] >= 0) out[n++] = out[i];
    free(prev);
    free(next);
    free(heap);
    return n;
}

/* The index of the code point that starts at byte `offset` of c's text. */
static int code_point_at(const CodePoints *c, int offset) {
    int lo = 0, hi = c->n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (c->offset[mid] < offset) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Encodes `text` with a byte-level tokenizer: BOS when asked and the
   vocabulary adds one, then user-defined tokens cut out of the text and the
   BPE tokens of each piece the pre-tokenizer splits the rest into, EOS when
   asked (or with BOS, when the vocabulary adds it). Every byte of well-formed
   UTF-8 has a token, so it cannot fail. */
static int encode_byte_level(const Tokenizer *t, const char *text, int bos, int eos, int *tokens) {
    CodePoints c = decode_code_points(t, text);
    int n = 0;
    if (bos && t->add_bos) tokens[n++] = t->bos;
    int n_fragments = 1;
    Fragment whole = {0, c.offset[c.n], -1}, *f = &whole;
    if (t->n_user > 0) f = split_user_tokens(t, c.bytes, (size_t)c.offset[c.n], &n_fragments);
    for (int k = 0; k < n_fragments; k++) {
        if (f[k].token >= 0) {
            tokens[n++] = f[k].token;
            continue;
        }
        int a = code_point_at(&c, f[k].start), b = code_point_at(&c, f[k].start + f[k].len), *ends;
        int n_pieces = split_pieces(t, &c, a, b, &ends);
        for (int p = 0, i = a; p < n_pieces; i = ends[p++])
            n += bpe_piece(t, c.bytes + c.offset[i], c.offset[ends[p]] - c.offset[i], tokens + n);
        free(ends);
    }
    if (f != &whole) free(f);
    if (eos || (bos && t->add_eos)) tokens[n++] = t->eos;
    free_code_points(&c);
    return n;
}

/* ---- 5.3 vocabularies from GGUF files ----------------------------------------
   A GGUF file holds its vocabulary as metadata (tokenizer.ggml.*), which the
   loader (section 2) copies into a GGUFVocab. Two kinds:
   - "llama": SentencePiece, as tokenizer.bin (5.1): pieces with U+2581 for
     the space, scores, and byte tokens <0xNN> of type 6. The ids come from the
     file, so BOS, EOS and the byte tokens are wherever it puts them.
   - "gpt2": byte-level BPE, as "tk42" (5.2): tokens written in GPT-2's
     byte-to-unicode alphabet (each byte one printable code point), merges as
     "left right" in that alphabet, best first, and tokenizer.ggml.pre naming
     the split before BPE.
   Token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6
   byte. Control, unknown and unused tokens are never produced from text (the
   chat template inserts them by id). User-defined tokens are written as text
   (not in GPT-2's alphabet) and are found in the text before anything else,
   longest first, as Hugging Face matches its non-special added tokens and
   llama.cpp its user-defined ones; DeepSeek's vocabularies have them (their
   "ü", for one, is a user-defined token). */

/* A vocabulary as a GGUF file holds it (tokenizer.ggml.*), copied out of the file. */
typedef struct {
    const char *model;        /* tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE); NUL-terminated */
    const char *pre;          /* tokenizer.ggml.pre, or NULL when absent */
    int n_tokens;
    char **tokens;            /* (n_tokens) as stored: SentencePiece pieces with U+2581, or GPT-2 byte-mapped strings; NUL-terminated copies */
    int *token_lens;          /* (n_tokens) their byte lengths */
    const float *scores;      /* (n_tokens) tokenizer.ggml.scores, or NULL */
    const int *types;         /* (n_tokens) tokenizer.ggml.token_type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), or NULL */
    int n_merges;
    char **merges;            /* (n_merges) tokenizer.ggml.merges "left right", NUL-terminated copies */
    int bos, eos, eot, eom, unk, pad; /* tokenizer.ggml.*_token_id, -1 when absent */
    int add_bos, add_eos;     /* tokenizer.ggml.add_bos_token / add_eos_token: 0, 1, or -1 when absent */
    int add_space_prefix;     /* tokenizer.ggml.add_space_prefix: 0, 1, or -1 when absent */
    const char *chat_template;/* tokenizer.chat_template, or NULL */
} GGUFVocab;

enum { TOKEN_TYPE_NORMAL = 1, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED, TOKEN_TYPE_BYTE };

/* The runs of code points of one class of Unicode general categories
   (tests/gen_unicode_ranges.py names them). */
typedef struct {
    int first, last;
    char category;
} UnicodeRange;

/* BEGIN_UNICODE_RANGES: Unicode 14.0.0 (Python 3.11's unicodedata), written by
   tests/gen_unicode_ranges.py: 2706 runs of \p{L} by case (u, l, L), \p{M}, \p{N}, \p{P} and \p{S} */
static const UnicodeRange unicode_ranges[] = {
    {0x21, 0x23, 'P'}, {0x24, 0x24, 'S'}, {0x25, 0x2A, 'P'}, {0x2B, 0x2B, 'S'}, {0x2C, 0x2F, 'P'}, {0x30, 0x39, 'N'},
    {0x3A, 0x3B, 'P'}, {0x3C, 0x3E, 'S'}, {0x3F, 0x40, 'P'}, {0x41, 0x5A, 'u'}, {0x5B, 0x5D, 'P'}, {0x5E, 0x5E, 'S'},
    {0x5F, 0x5F, 'P'}, {0x60, 0x60, 'S'}, {0x61, 0x7A, 'l'}, {0x7B, 0x7B, 'P'}, {0x7C, 0x7C, 'S'}, {0x7D, 0x7D, 'P'},
    {0x7E, 0x7E, 'S'}, {0xA1, 0xA1, 'P'}, {0xA2, 0xA6, 'S'}, {0xA7, 0xA7, 'P'}, {0xA8, 0xA9, 'S'}, {0xAA, 0xAA, 'L'},
    {0xAB, 0xAB, 'P'}, {0xAC, 0xAC, 'S'}, {0xAE, 0xB1, 'S'}, {0xB2, 0xB3, 'N'}, {0xB4, 0xB4, 'S'}, {0xB5, 0xB5, 'l'},
    {0xB6, 0xB7, 'P'}, {0xB8, 0xB8, 'S'}, {0xB9, 0xB9, 'N'}, {0xBA, 0xBA, 'L'}, {0xBB, 0xBB, 'P'}, {0xBC, 0xBE, 'N'},
    {0xBF, 0xBF, 'P'}, {0xC0, 0xD6, 'u'}, {0xD7, 0xD7, 'S'}, {0xD8, 0xDE, 'u'}, {0xDF, 0xF6, 'l'}, {0xF7, 0xF7, 'S'},
    {0xF8, 0xFF, 'l'}, {0x100, 0x100, 'u'}, {0x101, 0x101, 'l'}, {0x102, 0x102, 'u'}, {0x103, 0x103, 'l'}, {0x104, 0x104, 'u'},
    {0x105, 0x105, 'l'}, {0x106, 0x106, 'u'}, {0x107, 0x107, 'l'}, {0x108, 0x108, 'u'}, {0x109, 0x109, 'l'}, {0x10A, 0x10A, 'u'},
    {0x10B, 0x10B, 'l'}, {0x10C, 0x10C, 'u'}, {0x10D, 0x10D, 'l'}, {0x10E, 0x10E, 'u'}, {0x10F, 0x10F, 'l'}, {0x110, 0x110, 'u'},
    {0x111, 0x111, 'l'}, {0x112, 0x112, 'u'}, {0x113, 0x113, 'l'}, {0x114, 0x114, 'u'}, {0x115, 0x115, 'l'}, {0x116, 0x116, 'u'},
    {0x117, 0x117, 'l'}, {0x118, 0x118, 'u'}, {0x119, 0x119, 'l'}, {0x11A, 0x11A, 'u'}, {0x11B, 0x11B, 'l'}, {0x11C, 0x11C, 'u'},
    {0x11D, 0x11D, 'l'}, {0x11E, 0x11E, 'u'}, {0x11F, 0x11F, 'l'}, {0x120, 0x120, 'u'}, {0x121, 0x121, 'l'}, {0x122, 0x122, 'u'},
    {0x123, 0x123, 'l'}, {0x124, 0x124, 'u'}, {0x125, 0x125, 'l'}, {0x126, 0x126, 'u'}, {0x127, 0x127, 'l'}, {0x128, 0x128, 'u'},
    {0x129, 0x129, 'l'}, {0x12A, 0x12A, 'u'}, {0x12B, 0x12B, 'l'}, {0x12C, 0x12C, 'u'}, {0x12D, 0x12D, 'l'}, {0x12E, 0x12E, 'u'},
    {0x12F, 0x12F, 'l'}, {0x130, 0x130, 'u'}, {0x131, 0x131, 'l'}, {0x132, 0x132, 'u'}, {0x133, 0x133, 'l'}, {0x134, 0x134, 'u'},
    {0x135, 0x135, 'l'}, {0x136, 0x136, 'u'}, {0x137, 0x138, 'l'}, {0x139, 0x139, 'u'}, {0x13A, 0x13A, 'l'}, {0x13B, 0x13B, 'u'},
    {0x13C, 0x13C, 'l'}, {0x13D, 0x13D, 'u'}, {0x13E, 0x13E, 'l'}, {0x13F, 0x13F, 'u'}, {0x140, 0x140, 'l'}, {0x141, 0x141, 'u'},
    {0x142, 0x142, 'l'}, {0x143, 0x143, 'u'}, {0x144, 0x144, 'l'}, {0x145, 0x145, 'u'}, {0x146, 0x146, 'l'}, {0x147, 0x147, 'u'},
    {0x148, 0x149, 'l'}, {0x14A, 0x14A, 'u'}, {0x14B, 0x14B, 'l'}, {0x14C, 0x14C, 'u'}, {0x14D, 0x14D, 'l'}, {0x14E, 0x14E, 'u'},
    {0x14F, 0x14F, 'l'}, {0x150, 0x150, 'u'}, {0x151, 0x151, 'l'}, {0x152, 0x152, 'u'}, {0x153, 0x153, 'l'}, {0x154, 0x154, 'u'},
    {0x155, 0x155, 'l'}, {0x156, 0x156, 'u'}, {0x157, 0x157, 'l'}, {0x158, 0x158, 'u'}, {0x159, 0x159, 'l'}, {0x15A, 0x15A, 'u'},
    {0x15B, 0x15B, 'l'}, {0x15C, 0x15C, 'u'}, {0x15D, 0x15D, 'l'}, {0x15E, 0x15E, 'u'}, {0x15F, 0x15F, 'l'}, {0x160, 0x160, 'u'},
    {0x161, 0x161, 'l'}, {0x162, 0x162, 'u'}, {0x163, 0x163, 'l'}, {0x164, 0x164, 'u'}, {0x165, 0x165, 'l'}, {0x166, 0x166, 'u'},
    {0x167, 0x167, 'l'}, {0x168, 0x168, 'u'}, {0x169, 0x169, 'l'}, {0x16A, 0x16A, 'u'}, {0x16B, 0x16B, 'l'}, {0x16C, 0x16C, 'u'},
    {0x16D, 0x16D, 'l'}, {0x16E, 0x16E, 'u'}, {0x16F, 0x16F, 'l'}, {0x170, 0x170, 'u'}, {0x171, 0x171, 'l'}, {0x172, 0x172, 'u'},
    {0x173, 0x173, 'l'}, {0x174, 0x174, 'u'}, {0x175, 0x175, 'l'}, {0x176, 0x176, 'u'}, {0x177, 0x177, 'l'}, {0x178, 0x179, 'u'},
    {0x17A, 0x17A, 'l'}, {0x17B, 0x17B, 'u'}, {0x17C, 0x17C, 'l'}, {0x17D, 0x17D, 'u'}, {0x17E, 0x180, 'l'}, {0x181, 0x182, 'u'},
    {0x183, 0x183, 'l'}, {0x184, 0x184, 'u'}, {0x185, 0x185, 'l'}, {0x186, 0x187, 'u'}, {0x188, 0x188, 'l'}, {0x189, 0x18B, 'u'},
    {0x18C, 0x18D, 'l'}, {0x18E, 0x191, 'u'}, {0x192, 0x192, 'l'}, {0x193, 0x194, 'u'}, {0x195, 0x195, 'l'}, {0x196, 0x198, 'u'},
    {0x199, 0x19B, 'l'}, {0x19C, 0x19D, 'u'}, {0x19E, 0x19E, 'l'}, {0x19F, 0x1A0, 'u'}, {0x1A1, 0x1A1, 'l'}, {0x1A2, 0x1A2, 'u'},
    {0x1A3, 0x1A3, 'l'}, {0x1A4, 0x1A4, 'u'}, {0x1A5, 0x1A5, 'l'}, {0x1A6, 0x1A7, 'u'}, {0x1A8, 0x1A8, 'l'}, {0x1A9, 0x1A9, 'u'},
    {0x1AA, 0x1AB, 'l'}, {0x1AC, 0x1AC, 'u'}, {0x1AD, 0x1AD, 'l'}, {0x1AE, 0x1AF, 'u'}, {0x1B0, 0x1B0, 'l'}, {0x1B1, 0x1B3, 'u'},
    {0x1B4, 0x1B4, 'l'}, {0x1B5, 0x1B5, 'u'}, {0x1B6, 0x1B6, 'l'}, {0x1B7, 0x1B8, 'u'}, {0x1B9, 0x1BA, 'l'}, {0x1BB, 0x1BB, 'L'},
    {0x1BC, 0x1BC, 'u'}, {0x1BD, 0x1BF, 'l'}, {0x1C0, 0x1C3, 'L'}, {0x1C4, 0x1C5, 'u'}, {0x1C6, 0x1C6, 'l'}, {0x1C7, 0x1C8, 'u'},
    {0x1C9, 0x1C9, 'l'}, {0x1CA, 0x1CB, 'u'}, {0x1CC, 0x1CC, 'l'}, {0x1CD, 0x1CD, 'u'}, {0x1CE, 0x1CE, 'l'}, {0x1CF, 0x1CF, 'u'},
    {0x1D0, 0x1D0, 'l'}, {0x1D1, 0x1D1, 'u'}, {0x1D2, 0x1D2, 'l'}, {0x1D3, 0x1D3, 'u'}, {0x1D4, 0x1D4, 'l'}, {0x1D5, 0x1D5, 'u'},
    {0x1D6, 0x1D6, 'l'}, {0x1D7, 0x1D7, 'u'}, {0x1D8, 0x1D8, 'l'}, {0x1D9, 0x1D9, 'u'}, {0x1DA, 0x1DA, 'l'}, {0x1DB, 0x1DB, 'u'},
    {0x1DC, 0x1DD, 'l'}, {0x1DE, 0x1DE, 'u'}, {0x1DF, 0x1DF, 'l'}, {0x1E0, 0x1E0, 'u'}, {0x1E1, 0x1E1, 'l'}, {0x1E2, 0x1E2, 'u'},
    {0x1E3, 0x1E3, 'l'}, {0x1E4, 0x1E4, 'u'}, {0x1E5, 0x1E5, 'l'}, {0x1E6, 0x1E6, 'u'}, {0x1E7, 0x1E7, 'l'}, {0x1E8, 0x1E8, 'u'},
    {0x1E9, 0x1E9, 'l'}, {0x1EA, 0x1EA, 'u'}, {0x1EB, 0x1EB, 'l'}, {0x1EC, 0x1EC, 'u'}, {0x1ED, 0x1ED, 'l'}, {0x1EE, 0x1EE, 'u'},
    {0x1EF, 0x1F0, 'l'}, {0x1F1, 0x1F2, 'u'}, {0x1F3, 0x1F3, 'l'}, {0x1F4, 0x1F4, 'u'}, {0x1F5, 0x1F5, 'l'}, {0x1F6, 0x1F8, 'u'},
    {0x1F9, 0x1F9, 'l'}, {0x1FA, 0x1FA, 'u'}, {0x1FB, 0x1FB, 'l'}, {0x1FC, 0x1FC, 'u'}, {0x1FD, 0x1FD, 'l'}, {0x1FE, 0x1FE, 'u'},
    {0x1FF, 0x1FF, 'l'}, {0x200, 0x200, 'u'}, {0x201, 0x201, 'l'}, {0x202, 0x202, 'u'}, {0x203, 0x203, 'l'}, {0x204, 0x204, 'u'},
    {0x205, 0x205, 'l'}, {0x206, 0x206, 'u'}, {0x207, 0x207, 'l'}, {0x208, 0x208, 'u'}, {0x209, 0x209, 'l'}, {0x20A, 0x20A, 'u'},
    {0x20B, 0x20B, 'l'}, {0x20C, 0x20C, 'u'}, {0x20D, 0x20D, 'l'}, {0x20E, 0x20E, 'u'}, {0x20F, 0x20F, 'l'}, {0x210, 0x210, 'u'},
    {0x211, 0x211, 'l'}, {0x212, 0x212, 'u'}, {0x213, 0x213, 'l'}, {0x214, 0x214, 'u'}, {0x215, 0x215, 'l'}, {0x216, 0x216, 'u'},
    {0x217, 0x217, 'l'}, {0x218, 0x218, 'u'}, {0x219, 0x219, 'l'}, {0x21A, 0x21A, 'u'}, {0x21B, 0x21B, 'l'}, {0x21C, 0x21C, 'u'},
    {0x21D, 0x21D, 'l'}, {0x21E, 0x21E, 'u'}, {0x21F, 0x21F, 'l'}, {0x220, 0x220, 'u'}, {0x221, 0x221, 'l'}, {0x222, 0x222, 'u'},
    {0x223, 0x223, 'l'}, {0x224, 0x224, 'u'}, {0x225, 0x225, 'l'}, {0x226, 0x226, 'u'}, {0x227, 0x227, 'l'}, {0x228, 0x228, 'u'},
    {0x229, 0x229, 'l'}, {0x22A, 0x22A, 'u'}, {0x22B, 0x22B, 'l'}, {0x22C, 0x22C, 'u'}, {0x22D, 0x22D, 'l'}, {0x22E, 0x22E, 'u'},
    {0x22F, 0x22F, 'l'}, {0x230, 0x230, 'u'}, {0x231, 0x231, 'l'}, {0x232, 0x232, 'u'}, {0x233, 0x239, 'l'}, {0x23A, 0x23B, 'u'},
    {0x23C, 0x23C, 'l'}, {0x23D, 0x23E, 'u'}, {0x23F, 0x240, 'l'}, {0x241, 0x241, 'u'}, {0x242, 0x242, 'l'}, {0x243, 0x246, 'u'},
    {0x247, 0x247, 'l'}, {0x248, 0x248, 'u'}, {0x249, 0x249, 'l'}, {0x24A, 0x24A, 'u'}, {0x24B, 0x24B, 'l'}, {0x24C, 0x24C, 'u'},
    {0x24D, 0x24D, 'l'}, {0x24E, 0x24E, 'u'}, {0x24F, 0x293, 'l'}, {0x294, 0x294, 'L'}, {0x295, 0x2AF, 'l'}, {0x2B0, 0x2C1, 'L'},
    {0x2C2, 0x2C5, 'S'}, {0x2C6, 0x2D1, 'L'}, {0x2D2, 0x2DF, 'S'}, {0x2E0, 0x2E4, 'L'}, {0x2E5, 0x2EB, 'S'}, {0x2EC, 0x2EC, 'L'},
    {0x2ED, 0x2ED, 'S'}, {0x2EE, 0x2EE, 'L'}, {0x2EF, 0x2FF, 'S'}, {0x300, 0x36F, 'M'}, {0x370, 0x370, 'u'}, {0x371, 0x371, 'l'},
    {0x372, 0x372, 'u'}, {0x373, 0x373, 'l'}, {0x374, 0x374, 'L'}, {0x375, 0x375, 'S'}, {0x376, 0x376, 'u'}, {0x377, 0x377, 'l'},
    {0x37A, 0x37A, 'L'}, {0x37B, 0x37D, 'l'}, {0x37E, 0x37E, 'P'}, {0x37F, 0x37F, 'u'}, {0x384, 0x385, 'S'}, {0x386, 0x386, 'u'},
    {0x387, 0x387, 'P'}, {0x388, 0x38A, 'u'}, {0x38C, 0x38C, 'u'}, {0x38E, 0x38F, 'u'}, {0x390, 0x390, 'l'}, {0x391, 0x3A1, 'u'},
    {0x3A3, 0x3AB, 'u'}, {0x3AC, 0x3CE, 'l'}, {0x3CF, 0x3CF, 'u'}, {0x3D0, 0x3D1, 'l'}, {0x3D2, 0x3D4, 'u'}, {0x3D5, 0x3D7, 'l'},
    {0x3D8, 0x3D8, 'u'}, {0x3D9, 0x3D9, 'l'}, {0x3DA, 0x3DA, 'u'}, {0x3DB, 0x3DB, 'l'}, {0x3DC, 0x3DC, 'u'}, {0x3DD, 0x3DD, 'l'},
    {0x3DE, 0x3DE, 'u'}, {0x3DF, 0x3DF, 'l'}, {0x3E0, 0x3E0, 'u'}, {0x3E1, 0x3E1, 'l'}, {0x3E2, 0x3E2, 'u'}, {0x3E3, 0x3E3, 'l'},
    {0x3E4, 0x3E4, 'u'}, {0x3E5, 0x3E5, 'l'}, {0x3E6, 0x3E6, 'u'}, {0x3E7, 0x3E7, 'l'}, {0x3E8, 0x3E8, 'u'}, {0x3E9, 0x3E9, 'l'},
    {0x3EA, 0x3EA, 'u'}, {0x3EB, 0x3EB, 'l'}, {0x3EC, 0x3EC, 'u'}, {0x3ED, 0x3ED, 'l'}, {0x3EE, 0x3EE, 'u'}, {0x3EF, 0x3F3, 'l'},
    {0x3F4, 0x3F4, 'u'}, {0x3F5, 0x3F5, 'l'}, {0x3F6, 0x3F6, 'S'}, {0x3F7, 0x3F7, 'u'}, {0x3F8, 0x3F8, 'l'}, {0x3F9, 0x3FA, 'u'},
    {0x3FB, 0x3FC, 'l'}, {0x3FD, 0x42F, 'u'}, {0x430, 0x45F, 'l'}, {0x460, 0x460, 'u'}, {0x461, 0x461, 'l'}, {0x462, 0x462, 'u'},
    {0x463, 0x463, 'l'}, {0x464, 0x464, 'u'}, {0x465, 0x465, 'l'}, {0x466, 0x466, 'u'}, {0x467, 0x467, 'l'}, {0x468, 0x468, 'u'},
    {0x469, 0x469, 'l'}, {0x46A, 0x46A, 'u'}, {0x46B, 0x46B, 'l'}, {0x46C, 0x46C, 'u'}, {0x46D, 0x46D, 'l'}, {0x46E, 0x46E, 'u'},
    {0x46F, 0x46F, 'l'}, {0x470, 0x470, 'u'}, {0x471, 0x471, 'l'}, {0x472, 0x472, 'u'}, {0x473, 0x473, 'l'}, {0x474, 0x474, 'u'},
    {0x475, 0x475, 'l'}, {0x476, 0x476, 'u'}, {0x477, 0x477, 'l'}, {0x478, 0x478, 'u'}, {0x479, 0x479, 'l'}, {0x47A, 0x47A, 'u'},
    {0x47B, 0x47B, 'l'}, {0x47C, 0x47C, 'u'}, {0x47D, 0x47D, 'l'}, {0x47E, 0x47E, 'u'}, {0x47F, 0x47F, 'l'}, {0x480, 0x480, 'u'},
    {0x481, 0x481, 'l'}, {0x482, 0x482, 'S'}, {0x483, 0x489, 'M'}, {0x48A, 0x48A, 'u'}, {0x48B, 0x48B, 'l'}, {0x48C, 0x48C, 'u'},
    {0x48D, 0x48D, 'l'}, {0x48E, 0x48E, 'u'}, {0x48F, 0x48F, 'l'}, {0x490, 0x490, 'u'}, {0x491, 0x491, 'l'}, {0x492, 0x492, 'u'},
    {0x493, 0x493, 'l'}, {0x494, 0x494, 'u'}, {0x495, 0x495, 'l'}, {0x496, 0x496, 'u'}, {0x497, 0x497, 'l'}, {0x498, 0x498, 'u'},
    {0x499, 0x499, 'l'}, {0x49A, 0x49A, 'u'}, {0x49B, 0x49B, 'l'}, {0x49C, 0x49C, 'u'}, {0x49D, 0x49D, 'l'}, {0x49E, 0x49E, 'u'},
    {0x49F, 0x49F, 'l'}, {0x4A0, 0x4A0, 'u'}, {0x4A1, 0x4A1, 'l'}, {0x4A2, 0x4A2, 'u'}, {0x4A3, 0x4A3, 'l'}, {0x4A4, 0x4A4, 'u'},
    {0x4A5, 0x4A5, 'l'}, {0x4A6, 0x4A6, 'u'}, {0x4A7, 0x4A7, 'l'}, {0x4A8, 0x4A8, 'u'}, {0x4A9, 0x4A9, 'l'}, {0x4AA, 0x4AA, 'u'},
    {0x4AB, 0x4AB, 'l'}, {0x4AC, 0x4AC, 'u'}, {0x4AD, 0x4AD, 'l'}, {0x4AE, 0x4AE, 'u'}, {0x4AF, 0x4AF, 'l'}, {0x4B0, 0x4B0, 'u'},
    {0x4B1, 0x4B1, 'l'}, {0x4B2, 0x4B2, 'u'}, {0x4B3, 0x4B3, 'l'}, {0x4B4, 0x4B4, 'u'}, {0x4B5, 0x4B5, 'l'}, {0x4B6, 0x4B6, 'u'},
    {0x4B7, 0x4B7, 'l'}, {0x4B8, 0x4B8, 'u'}, {0x4B9, 0x4B9, 'l'}, {0x4BA, 0x4BA, 'u'}, {0x4BB, 0x4BB, 'l'}, {0x4BC, 0x4BC, 'u'},
    {0x4BD, 0x4BD, 'l'}, {0x4BE, 0x4BE, 'u'}, {0x4BF, 0x4BF, 'l'}, {0x4C0, 0x4C1, 'u'}, {0x4C2, 0x4C2, 'l'}, {0x4C3, 0x4C3, 'u'},
    {0x4C4, 0x4C4, 'l'}, {0x4C5, 0x4C5, 'u'}, {0x4C6, 0x4C6, 'l'}, {0x4C7, 0x4C7, 'u'}, {0x4C8, 0x4C8, 'l'}, {0x4C9, 0x4C9, 'u'},
    {0x4CA, 0x4CA, 'l'}, {0x4CB, 0x4CB, 'u'}, {0x4CC, 0x4CC, 'l'}, {0x4CD, 0x4CD, 'u'}, {0x4CE, 0x4CF, 'l'}, {0x4D0, 0x4D0, 'u'},
    {0x4D1, 0x4D1, 'l'}, {0x4D2, 0x4D2, 'u'}, {0x4D3, 0x4D3, 'l'}, {0x4D4, 0x4D4, 'u'}, {0x4D5, 0x4D5, 'l'}, {0x4D6, 0x4D6, 'u'},
    {0x4D7, 0x4D7, 'l'}, {0x4D8, 0x4D8, 'u'}, {0x4D9, 0x4D9, 'l'}, {0x4DA, 0x4DA, 'u'}, {0x4DB, 0x4DB, 'l'}, {0x4DC, 0x4DC, 'u'},
    {0x4DD, 0x4DD, 'l'}, {0x4DE, 0x4DE, 'u'}, {0x4DF, 0x4DF, 'l'}, {0x4E0, 0x4E0, 'u'}, {0x4E1, 0x4E1, 'l'}, {0x4E2, 0x4E2, 'u'},
    {0x4E3, 0x4E3, 'l'}, {0x4E4, 0x4E4, 'u'}, {0x4E5, 0x4E5, 'l'}, {0x4E6, 0x4E6, 'u'}, {0x4E7, 0x4E7, 'l'}, {0x4E8, 0x4E8, 'u'},
    {0x4E9, 0x4E9, 'l'}, {0x4EA, 0x4EA, 'u'}, {0x4EB, 0x4EB, 'l'}, {0x4EC, 0x4EC, 'u'}, {0x4ED, 0x4ED, 'l'}, {0x4EE, 0x4EE, 'u'},
    {0x4EF, 0x4EF, 'l'}, {0x4F0, 0x4F0, 'u'}, {0x4F1, 0x4F1, 'l'}, {0x4F2, 0x4F2, 'u'}, {0x4F3, 0x4F3, 'l'}, {0x4F4, 0x4F4, 'u'},
    {0x4F5, 0x4F5, 'l'}, {0x4F6, 0x4F6, 'u'}, {0x4F7, 0x4F7, 'l'}, {0x4F8, 0x4F8, 'u'}, {0x4F9, 0x4F9, 'l'}, {0x4FA, 0x4FA, 'u'},
    {0x4FB, 0x4FB, 'l'}, {0x4FC, 0x4FC, 'u'}, {0x4FD, 0x4FD, 'l'}, {0x4FE, 0x4FE, 'u'}, {0x4FF, 0x4FF, 'l'}, {0x500, 0x500, 'u'},
    {0x501, 0x501, 'l'}, {0x502, 0x502, 'u'}, {0x503, 0x503, 'l'}, {0x504, 0x504, 'u'}, {0x505, 0x505, 'l'}, {0x506, 0x506, 'u'},
    {0x507, 0x507, 'l'}, {0x508, 0x508, 'u'}, {0x509, 0x509, 'l'}, {0x50A, 0x50A, 'u'}, {0x50B, 0x50B, 'l'}, {0x50C, 0x50C, 'u'},
    {0x50D, 0x50D, 'l'}, {0x50E, 0x50E, 'u'}, {0x50F, 0x50F, 'l'}, {0x510, 0x510, 'u'}, {0x511, 0x511, 'l'}, {0x512, 0x512, 'u'},
    {0x513, 0x513, 'l'}, {0x514, 0x514, 'u'}, {0x515, 0x515, 'l'}, {0x516, 0x516, 'u'}, {0x517, 0x517, 'l'}, {0x518, 0x518, 'u'},
    {0x519, 0x519, 'l'}, {0x51A, 0x51A, 'u'}, {0x51B, 0x51B, 'l'}, {0x51C, 0x51C, 'u'}, {0x51D, 0x51D, 'l'}, {0x51E, 0x51E, 'u'},
    {0x51F, 0x51F, 'l'}, {0x520, 0x520, 'u'}, {0x521, 0x521, 'l'}, {0x522, 0x522, 'u'}, {0x523, 0x523, 'l'}, {0x524, 0x524, 'u'},
    {0x525, 0x525, 'l'}, {0x526, 0x526, 'u'}, {0x527, 0x527, 'l'}, {0x528, 0x528, 'u'}, {0x529, 0x529, 'l'}, {0x52A, 0x52A, 'u'},
    {0x52B, 0x52B, 'l'}, {0x52C, 0x52C, 'u'}, {0x52D, 0x52D, 'l'}, {0x52E, 0x52E, 'u'}, {0x52F, 0x52F, 'l'}, {0x531, 0x556, 'u'},
    {0x559, 0x559, 'L'}, {0x55A, 0x55F, 'P'}, {0x560, 0x588, 'l'}, {0x589, 0x58A, 'P'}, {0x58D, 0x58F, 'S'}, {0x591, 0x5BD, 'M'},
    {0x5BE, 0x5BE, 'P'}, {0x5BF, 0x5BF, 'M'}, {0x5C0, 0x5C0, 'P'}, {0x5C1, 0x5C2, 'M'}, {0x5C3, 0x5C3, 'P'}, {0x5C4, 0x5C5, 'M'},
    {0x5C6, 0x5C6, 'P'}, {0x5C7, 0x5C7, 'M'}, {0x5D0, 0x5EA, 'L'}, {0x5EF, 0x5F2, 'L'}, {0x5F3, 0x5F4, 'P'}, {0x606, 0x608, 'S'},
    {0x609, 0x60A, 'P'}, {0x60B, 0x60B, 'S'}, {0x60C, 0x60D, 'P'}, {0x60E, 0x60F, 'S'}, {0x610, 0x61A, 'M'}, {0x61B, 0x61B, 'P'},
    {0x61D, 0x61F, 'P'}, {0x620, 0x64A, 'L'}, {0x64B, 0x65F, 'M'}, {0x660, 0x669, 'N'}, {0x66A, 0x66D, 'P'}, {0x66E, 0x66F, 'L'},
    {0x670, 0x670, 'M'}, {0x671, 0x6D3, 'L'}, {0x6D4, 0x6D4, 'P'}, {0x6D5, 0x6D5, 'L'}, {0x6D6, 0x6DC, 'M'}, {0x6DE, 0x6DE, 'S'},
    {0x6DF, 0x6E4, 'M'}, {0x6E5, 0x6E6, 'L'}, {0x6E7, 0x6E8, 'M'}, {0x6E9, 0x6E9, 'S'}, {0x6EA, 0x6ED, 'M'}, {0x6EE, 0x6EF, 'L'},
    {0x6F0, 0x6F9, 'N'}, {0x6FA, 0x6FC, 'L'}, {0x6FD, 0x6FE, 'S'}, {0x6FF, 0x6FF, 'L'}, {0x700, 0x70D, 'P'}, {0x710, 0x710, 'L'},
    {0x711, 0x711, 'M'}, {0x712, 0x72F, 'L'}, {0x730, 0x74A, 'M'}, {0x74D, 0x7A5, 'L'}, {0x7A6, 0x7B0, 'M'}, {0x7B1, 0x7B1, 'L'},
    {0x7C0, 0x7C9, 'N'}, {0x7CA, 0x7EA, 'L'}, {0x7EB, 0x7F3, 'M'}, {0x7F4, 0x7F5, 'L'}, {0x7F6, 0x7F6, 'S'}, {0x7F7, 0x7F9, 'P'},
    {0x7FA, 0x7FA, 'L'}, {0x7FD, 0x7FD, 'M'}, {0x7FE, 0x7FF, 'S'}, {0x800, 0x815, 'L'}, {0x816, 0x819, 'M'}, {0x81A, 0x81A, 'L'},
    {0x81B, 0x823, 'M'}, {0x824, 0x824, 'L'}, {0x825, 0x827, 'M'}, {0x828, 0x828, 'L'}, {0x829, 0x82D, 'M'}, {0x830, 0x83E, 'P'},
    {0x840, 0x858, 'L'}, {0x859, 0x85B, 'M'}, {0x85E, 0x85E, 'P'}, {0x860, 0x86A, 'L'}, {0x870, 0x887, 'L'}, {0x888, 0x888, 'S'},
    {0x889, 0x88E, 'L'}, {0x898, 0x89F, 'M'}, {0x8A0, 0x8C9, 'L'}, {0x8CA, 0x8E1, 'M'}, {0x8E3, 0x903, 'M'}, {0x904, 0x939, 'L'},
    {0x93A, 0x93C, 'M'}, {0x93D, 0x93D, 'L'}, {0x93E, 0x94F, 'M'}, {0x950, 0x950, 'L'}, {0x951, 0x957, 'M'}, {0x958, 0x961, 'L'},
    {0x962, 0x963, 'M'}, {0x964, 0x965, 'P'}, {0x966, 0x96F, 'N'}, {0x970, 0x970, 'P'}, {0x971, 0x980, 'L'}, {0x981, 0x983, 'M'},
    {0x985, 0x98C, 'L'}, {0x98F, 0x990, 'L'}, {0x993, 0x9A8, 'L'}, {0x9AA, 0x9B0, 'L'}, {0x9B2, 0x9B2, 'L'}, {0x9B6, 0x9B9, 'L'},
    {0x9BC, 0x9BC, 'M'}, {0x9BD, 0x9BD, 'L'}, {0x9BE, 0x9C4, 'M'}, {0x9C7, 0x9C8, 'M'}, {0x9CB, 0x9CD, 'M'}, {0x9CE, 0x9CE, 'L'},
    {0x9D7, 0x9D7, 'M'}, {0x9DC, 0x9DD, 'L'}, {0x9DF, 0x9E1, 'L'}, {0x9E2, 0x9E3, 'M'}, {0x9E6, 0x9EF, 'N'}, {0x9F0, 0x9F1, 'L'},
    {0x9F2, 0x9F3, 'S'}, {0x9F4, 0x9F9, 'N'}, {0x9FA, 0x9FB, 'S'}, {0x9FC, 0x9FC, 'L'}, {0x9FD, 0x9FD, 'P'}, {0x9FE, 0x9FE, 'M'},
    {0xA01, 0xA03, 'M'}, {0xA05, 0xA0A, 'L'}, {0xA0F, 0xA10, 'L'}, {0xA13, 0xA28, 'L'}, {0xA2A, 0xA30, 'L'}, {0xA32, 0xA33, 'L'},
    {0xA35, 0xA36, 'L'}, {0xA38, 0xA39, 'L'}, {0xA3C, 0xA3C, 'M'}, {0xA3E, 0xA42, 'M'}, {0xA47, 0xA48, 'M'}, {0xA4B, 0xA4D, 'M'},
    {0xA51, 0xA51, 'M'}, {0xA59, 0xA5C, 'L'}, {0xA5E, 0xA5E, 'L'}, {0xA66, 0xA6F, 'N'}, {0xA70, 0xA71, 'M'}, {0xA72, 0xA74, 'L'},
    {0xA75, 0xA75, 'M'}, {0xA76, 0xA76, 'P'}, {0xA81, 0xA83, 'M'}, {0xA85, 0xA8D, 'L'}, {0xA8F, 0xA91, 'L'}, {0xA93, 0xAA8, 'L'},
    {0xAAA, 0xAB0, 'L'}, {0xAB2, 0xAB3, 'L'}, {0xAB5, 0xAB9, 'L'}, {0xABC, 0xABC, 'M'}, {0xABD, 0xABD, 'L'}, {0xABE, 0xAC5, 'M'},
    {0xAC7, 0xAC9, 'M'}, {0xACB, 0xACD, 'M'}, {0xAD0, 0xAD0, 'L'}, {0xAE0, 0xAE1, 'L'}, {0xAE2, 0xAE3, 'M'}, {0xAE6, 0xAEF, 'N'},
    {0xAF0, 0xAF0, 'P'}, {0xAF1, 0xAF1, 'S'}, {0xAF9, 0xAF9, 'L'}, {0xAFA, 0xAFF, 'M'}, {0xB01, 0xB03, 'M'}, {0xB05, 0xB0C, 'L'},
    {0xB0F, 0xB10, 'L'}, {0xB13, 0xB28, 'L'}, {0xB2A, 0xB30, 'L'}, {0xB32, 0xB33, 'L'}, {0xB35, 0xB39, 'L'}, {0xB3C, 0xB3C, 'M'},
    {0xB3D, 0xB3D, 'L'}, {0xB3E, 0xB44, 'M'}, {0xB47, 0xB48, 'M'}, {0xB4B, 0xB4D, 'M'}, {0xB55, 0xB57, 'M'}, {0xB5C, 0xB5D, 'L'},
    {0xB5F, 0xB61, 'L'}, {0xB62, 0xB63, 'M'}, {0xB66, 0xB6F, 'N'}, {0xB70, 0xB70, 'S'}, {0xB71, 0xB71, 'L'}, {0xB72, 0xB77, 'N'},
    {0xB82, 0xB82, 'M'}, {0xB83, 0xB83, 'L'}, {0xB85, 0xB8A, 'L'}, {0xB8E, 0xB90, 'L'}, {0xB92, 0xB95, 'L'}, {0xB99, 0xB9A, 'L'},
    {0xB9C, 0xB9C, 'L'}, {0xB9E, 0xB9F, 'L'}, {0xBA3, 0xBA4, 'L'}, {0xBA8, 0xBAA, 'L'}, {0xBAE, 0xBB9, 'L'}, {0xBBE, 0xBC2, 'M'},
    {0xBC6, 0xBC8, 'M'}, {0xBCA, 0xBCD, 'M'}, {0xBD0, 0xBD0, 'L'}, {0xBD7, 0xBD7, 'M'}, {0xBE6, 0xBF2, 'N'}, {0xBF3, 0xBFA, 'S'},
    {0xC00, 0xC04, 'M'}, {0xC05, 0xC0C, 'L'}, {0xC0E, 0xC10, 'L'}, {0xC12, 0xC28, 'L'}, {0xC2A, 0xC39, 'L'}, {0xC3C, 0xC3C, 'M'},
    {0xC3D, 0xC3D, 'L'}, {0xC3E, 0xC44, 'M'}, {0xC46, 0xC48, 'M'}, {0xC4A, 0xC4D, 'M'}, {0xC55, 0xC56, 'M'}, {0xC58, 0xC5A, 'L'},
    {0xC5D, 0xC5D, 'L'}, {0xC60, 0xC61, 'L'}, {0xC62, 0xC63, 'M'}, {0xC66, 0xC6F, 'N'}, {0xC77, 0xC77, 'P'}, {0xC78, 0xC7E, 'N'},
    {0xC7F, 0xC7F, 'S'}, {0xC80, 0xC80, 'L'}, {0xC81, 0xC83, 'M'}, {0xC84, 0xC84, 'P'}, {0xC85, 0xC8C, 'L'}, {0xC8E, 0xC90, 'L'},
    {0xC92, 0xCA8, 'L'}, {0xCAA, 0xCB3, 'L'}, {0xCB5, 0xCB9, 'L'}, {0xCBC, 0xCBC, 'M'}, {0xCBD, 0xCBD, 'L'}, {0xCBE, 0xCC4, 'M'},
    {0xCC6, 0xCC8, 'M'}, {0xCCA, 0xCCD, 'M'}, {0xCD5, 0xCD6, 'M'}, {0xCDD, 0xCDE, 'L'}, {0xCE0, 0xCE1, 'L'}, {0xCE2, 0xCE3, 'M'},
    {0xCE6, 0xCEF, 'N'}, {0xCF1, 0xCF2, 'L'}, {0xD00, 0xD03, 'M'}, {0xD04, 0xD0C, 'L'}, {0xD0E, 0xD10, 'L'}, {0xD12, 0xD3A, 'L'},
    {0xD3B, 0xD3C, 'M'}, {0xD3D, 0xD3D, 'L'}, {0xD3E, 0xD44, 'M'}, {0xD46, 0xD48, 'M'}, {0xD4A, 0xD4D, 'M'}, {0xD4E, 0xD4E, 'L'},
    {0xD4F, 0xD4F, 'S'}, {0xD54, 0xD56, 'L'}, {0xD57, 0xD57, 'M'}, {0xD58, 0xD5E, 'N'}, {0xD5F, 0xD61, 'L'}, {0xD62, 0xD63, 'M'},
    {0xD66, 0xD78, 'N'}, {0xD79, 0xD79, 'S'}, {0xD7A, 0xD7F, 'L'}, {0xD81, 0xD83, 'M'}, {0xD85, 0xD96, 'L'}, {0xD9A, 0xDB1, 'L'},
    {0xDB3, 0xDBB, 'L'}, {0xDBD, 0xDBD, 'L'}, {0xDC0, 0xDC6, 'L'}, {0xDCA, 0xDCA, 'M'}, {0xDCF, 0xDD4, 'M'}, {0xDD6, 0xDD6, 'M'},
    {0xDD8, 0xDDF, 'M'}, {0xDE6, 0xDEF, 'N'}, {0xDF2, 0xDF3, 'M'}, {0xDF4, 0xDF4, 'P'}, {0xE01, 0xE30, 'L'}, {0xE31, 0xE31, 'M'},
    {0xE32, 0xE33, 'L'}, {0xE34, 0xE3A, 'M'}, {0xE3F, 0xE3F, 'S'}, {0xE40, 0xE46, 'L'}, {0xE47, 0xE4E, 'M'}, {0xE4F, 0xE4F, 'P'},
    {0xE50, 0xE59, 'N'}, {0xE5A, 0xE5B, 'P'}, {0xE81, 0xE82, 'L'}, {0xE84, 0xE84, 'L'}, {0xE86, 0xE8A, 'L'}, {0xE8C, 0xEA3, 'L'},
    {0xEA5, 0xEA5, 'L'}, {0xEA7, 0xEB0, 'L'}, {0xEB1, 0xEB1, 'M'}, {0xEB2, 0xEB3, 'L'}, {0xEB4, 0xEBC, 'M'}, {0xEBD, 0xEBD, 'L'},
    {0xEC0, 0xEC4, 'L'}, {0xEC6, 0xEC6, 'L'}, {0xEC8, 0xECD, 'M'}, {0xED0, 0xED9, 'N'}, {0xEDC, 0xEDF, 'L'}, {0xF00, 0xF00, 'L'},
    {0xF01, 0xF03, 'S'}, {0xF04, 0xF12, 'P'}, {0xF13, 0xF13, 'S'}, {0xF14, 0xF14, 'P'}, {0xF15, 0xF17, 'S'}, {0xF18, 0xF19, 'M'},
    {0xF1A, 0xF1F, 'S'}, {0xF20, 0xF33, 'N'}, {0xF34, 0xF34, 'S'}, {0xF35, 0xF35, 'M'}, {0xF36, 0xF36, 'S'}, {0xF37, 0xF37, 'M'},
    {0xF38, 0xF38, 'S'}, {0xF39, 0xF39, 'M'}, {0xF3A, 0xF3D, 'P'}, {0xF3E, 0xF3F, 'M'}, {0xF40, 0xF47, 'L'}, {0xF49, 0xF6C, 'L'},
    {0xF71, 0xF84, 'M'}, {0xF85, 0xF85, 'P'}, {0xF86, 0xF87, 'M'}, {0xF88, 0xF8C, 'L'}, {0xF8D, 0xF97, 'M'}, {0xF99, 0xFBC, 'M'},
    {0xFBE, 0xFC5, 'S'}, {0xFC6, 0xFC6, 'M'}, {0xFC7, 0xFCC, 'S'}, {0xFCE, 0xFCF, 'S'}, {0xFD0, 0xFD4, 'P'}, {0xFD5, 0xFD8, 'S'},
    {0xFD9, 0xFDA, 'P'}, {0x1000, 0x102A, 'L'}, {0x102B, 0x103E, 'M'}, {0x103F, 0x103F, 'L'}, {0x1040, 0x1049, 'N'}, {0x104A, 0x104F, 'P'},
    {0x1050, 0x1055, 'L'}, {0x1056, 0x1059, 'M'}, {0x105A, 0x105D, 'L'}, {0x105E, 0x1060, 'M'}, {0x1061, 0x1061, 'L'}, {0x1062, 0x1064, 'M'},
    {0x1065, 0x1066, 'L'}, {0x1067, 0x106D, 'M'}, {0x106E, 0x1070, 'L'}, {0x1071, 0x1074, 'M'}, {0x1075, 0x1081, 'L'}, {0x1082, 0x108D, 'M'},
    {0x108E, 0x108E, 'L'}, {0x108F, 0x108F, 'M'}, {0x1090, 0x1099, 'N'}, {0x109A, 0x109D, 'M'}, {0x109E, 0x109F, 'S'}, {0x10A0, 0x10C5, 'u'},
    {0x10C7, 0x10C7, 'u'}, {0x10CD, 0x10CD, 'u'}, {0x10D0, 0x10FA, 'l'}, {0x10FB, 0x10FB, 'P'}, {0x10FC, 0x10FC, 'L'}, {0x10FD, 0x10FF, 'l'},
    {0x1100, 0x1248, 'L'}, {0x124A, 0x124D, 'L'}, {0x1250, 0x1256, 'L'}, {0x1258, 0x1258, 'L'}, {0x125A, 0x125D, 'L'}, {0x1260, 0x1288, 'L'},
    {0x128A, 0x128D, 'L'}, {0x1290, 0x12B0, 'L'}, {0x12B2, 0x12B5, 'L'}, {0x12B8, 0x12BE, 'L'}, {0x12C0, 0x12C0, 'L'}, {0x12C2, 0x12C5, 'L'},
    {0x12C8, 0x12D6, 'L'}, {0x12D8, 0x1310, 'L'}, {0x1312, 0x1315, 'L'}, {0x1318, 0x135A, 'L'}, {0x135D, 0x135F, 'M'}, {0x1360, 0x1368, 'P'},
    {0x1369, 0x137C, 'N'}, {0x1380, 0x138F, 'L'}, {0x1390, 0x1399, 'S'}, {0x13A0, 0x13F5, 'u'}, {0x13F8, 0x13FD, 'l'}, {0x1400, 0x1400, 'P'},
    {0x1401, 0x166C, 'L'}, {0x166D, 0x166D, 'S'}, {0x166E, 0x166E, 'P'}, {0x166F, 0x167F, 'L'}, {0x1681, 0x169A, 'L'}, {0x169B, 0x169C, 'P'},
    {0x16A0, 0x16EA, 'L'}, {0x16EB, 0x16ED, 'P'}, {0x16EE, 0x16F0, 'N'}, {0x16F1, 0x16F8, 'L'}, {0x1700, 0x1711, 'L'}, {0x1712, 0x1715, 'M'},
    {0x171F, 0x1731, 'L'}, {0x1732, 0x1734, 'M'}, {0x1735, 0x1736, 'P'}, {0x1740, 0x1751, 'L'}, {0x1752, 0x1753, 'M'}, {0x1760, 0x176C, 'L'},
    {0x176E, 0x1770, 'L'}, {0x1772, 0x1773, 'M'}, {0x1780, 0x17B3, 'L'}, {0x17B4, 0x17D3, 'M'}, {0x17D4, 0x17D6, 'P'}, {0x17D7, 0x17D7, 'L'},
    {0x17D8, 0x17DA, 'P'}, {0x17DB, 0x17DB, 'S'}, {0x17DC, 0x17DC, 'L'}, {0x17DD, 0x17DD, 'M'}, {0x17E0, 0x17E9, 'N'}, {0x17F0, 0x17F9, 'N'},
    {0x1800, 0x180A, 'P'}, {0x180B, 0x180D, 'M'}, {0x180F, 0x180F, 'M'}, {0x1810, 0x1819, 'N'}, {0x1820, 0x1878, 'L'}, {0x1880, 0x1884, 'L'},
    {0x1885, 0x1886, 'M'}, {0x1887, 0x18A8, 'L'}, {0x18A9, 0x18A9, 'M'}, {0x18AA, 0x18AA, 'L'}, {0x18B0, 0x18F5, 'L'}, {0x1900, 0x191E, 'L'},
    {0x1920, 0x192B, 'M'}, {0x1930, 0x193B, 'M'}, {0x1940, 0x1940, 'S'}, {0x1944, 0x1945, 'P'}, {0x1946, 0x194F, 'N'}, {0x1950, 0x196D, 'L'},
    {0x1970, 0x1974, 'L'}, {0x1980, 0x19AB, 'L'}, {0x19B0, 0x19C9, 'L'}, {0x19D0, 0x19DA, 'N'}, {0x19DE, 0x19FF, 'S'}, {0x1A00, 0x1A16, 'L'},
    {0x1A17, 0x1A1B, 'M'}, {0x1A1E, 0x1A1F, 'P'}, {0x1A20, 0x1A54, 'L'}, {0x1A55, 0x1A5E, 'M'}, {0x1A60, 0x1A7C, 'M'}, {0x1A7F, 0x1A7F, 'M'},
    {0x1A80, 0x1A89, 'N'}, {0x1A90, 0x1A99, 'N'}, {0x1AA0, 0x1AA6, 'P'}, {0x1AA7, 0x1AA7, 'L'}, {0x1AA8, 0x1AAD, 'P'}, {0x1AB0, 0x1ACE, 'M'},
    {0x1B00, 0x1B04, 'M'}, {0x1B05, 0x1B33, 'L'}, {0x1B34, 0x1B44, 'M'}, {0x1B45, 0x1B4C, 'L'}, {0x1B50, 0x1B59, 'N'}, {0x1B5A, 0x1B60, 'P'},
    {0x1B61, 0x1B6A, 'S'}, {0x1B6B, 0x1B73, 'M'}, {0x1B74, 0x1B7C, 'S'}, {0x1B7D, 0x1B7E, 'P'}, {0x1B80, 0x1B82, 'M'}, {0x1B83, 0x1BA0, 'L'},
    {0x1BA1, 0x1BAD, 'M'}, {0x1BAE, 0x1BAF, 'L'}, {0x1BB0, 0x1BB9, 'N'}, {0x1BBA, 0x1BE5, 'L'}, {0x1BE6, 0x1BF3, 'M'}, {0x1BFC, 0x1BFF, 'P'},
    {0x1C00, 0x1C23, 'L'}, {0x1C24, 0x1C37, 'M'}, {0x1C3B, 0x1C3F, 'P'}, {0x1C40, 0x1C49, 'N'}, {0x1C4D, 0x1C4F, 'L'}, {0x1C50, 0x1C59, 'N'},
    {0x1C5A, 0x1C7D, 'L'}, {0x1C7E, 0x1C7F, 'P'}, {0x1C80, 0x1C88, 'l'}, {0x1C90, 0x1CBA, 'u'}, {0x1CBD, 0x1CBF, 'u'}, {0x1CC0, 0x1CC7, 'P'},
    {0x1CD0, 0x1CD2, 'M'}, {0x1CD3, 0x1CD3, 'P'}, {0x1CD4, 0x1CE8, 'M'}, {0x1CE9, 0x1CEC, 'L'}, {0x1CED, 0x1CED, 'M'}, {0x1CEE, 0x1CF3, 'L'},
    {0x1CF4, 0x1CF4, 'M'}, {0x1CF5, 0x1CF6, 'L'}, {0x1CF7, 0x1CF9, 'M'}, {0x1CFA, 0x1CFA, 'L'}, {0x1D00, 0x1D2B, 'l'}, {0x1D2C, 0x1D6A, 'L'},
    {0x1D6B, 0x1D77, 'l'}, {0x1D78, 0x1D78, 'L'}, {0x1D79, 0x1D9A, 'l'}, {0x1D9B, 0x1DBF, 'L'}, {0x1DC0, 0x1DFF, 'M'}, {0x1E00, 0x1E00, 'u'},
    {0x1E01, 0x1E01, 'l'}, {0x1E02, 0x1E02, 'u'}, {0x1E03, 0x1E03, 'l'}, {0x1E04, 0x1E04, 'u'}, {0x1E05, 0x1E05, 'l'}, {0x1E06, 0x1E06, 'u'},
    {0x1E07, 0x1E07, 'l'}, {0x1E08, 0x1E08, 'u'}, {0x1E09, 0x1E09, 'l'}, {0x1E0A, 0x1E0A, 'u'}, {0x1E0B, 0x1E0B, 'l'}, {0x1E0C, 0x1E0C, 'u'},
    {0x1E0D, 0x1E0D, 'l'}, {0x1E0E, 0x1E0E, 'u'}, {0x1E0F, 0x1E0F, 'l'}, {0x1E10, 0x1E10, 'u'}, {0x1E11, 0x1E11, 'l'}, {0x1E12, 0x1E12, 'u'},
    {0x1E13, 0x1E13, 'l'}, {0x1E14, 0x1E14, 'u'}, {0x1E15, 0x1E15, 'l'}, {0x1E16, 0x1E16, 'u'}, {0x1E17, 0x1E17, 'l'}, {0x1E18, 0x1E18, 'u'},
    {0x1E19, 0x1E19, 'l'}, {0x1E1A, 0x1E1A, 'u'}, {0x1E1B, 0x1E1B, 'l'}, {0x1E1C, 0x1E1C, 'u'}, {0x1E1D, 0x1E1D, 'l'}, {0x1E1E, 0x1E1E, 'u'},
    {0x1E1F, 0x1E1F, 'l'}, {0x1E20, 0x1E20, 'u'}, {0x1E21, 0x1E21, 'l'}, {0x1E22, 0x1E22, 'u'}, {0x1E23, 0x1E23, 'l'}, {0x1E24, 0x1E24, 'u'},
    {0x1E25, 0x1E25, 'l'}, {0x1E26, 0x1E26, 'u'}, {0x1E27, 0x1E27, 'l'}, {0x1E28, 0x1E28, 'u'}, {0x1E29, 0x1E29, 'l'}, {0x1E2A, 0x1E2A, 'u'},
    {0x1E2B, 0x1E2B, 'l'}, {0x1E2C, 0x1E2C, 'u'}, {0x1E2D, 0x1E2D, 'l'}, {0x1E2E, 0x1E2E, 'u'}, {0x1E2F, 0x1E2F, 'l'}, {0x1E30, 0x1E30, 'u'},
    {0x1E31, 0x1E31, 'l'}, {0x1E32, 0x1E32, 'u'}, {0x1E33, 0x1E33, 'l'}, {0x1E34, 0x1E34, 'u'}, {0x1E35, 0x1E35, 'l'}, {0x1E36, 0x1E36, 'u'},
    {0x1E37, 0x1E37, 'l'}, {0x1E38, 0x1E38, 'u'}, {0x1E39, 0x1E39, 'l'}, {0x1E3A, 0x1E3A, 'u'}, {0x1E3B, 0x1E3B, 'l'}, {0x1E3C, 0x1E3C, 'u'},
    {0x1E3D, 0x1E3D, 'l'}, {0x1E3E, 0x1E3E, 'u'}, {0x1E3F, 0x1E3F, 'l'}, {0x1E40, 0x1E40, 'u'}, {0x1E41, 0x1E41, 'l'}, {0x1E42, 0x1E42, 'u'},
    {0x1E43, 0x1E43, 'l'}, {0x1E44, 0x1E44, 'u'}, {0x1E45, 0x1E45, 'l'}, {0x1E46, 0x1E46, 'u'}, {0x1E47, 0x1E47, 'l'}, {0x1E48, 0x1E48, 'u'},
    {0x1E49, 0x1E49, 'l'}, {0x1E4A, 0x1E4A, 'u'}, {0x1E4B, 0x1E4B, 'l'}, {0x1E4C, 0x1E4C, 'u'}, {0x1E4D, 0x1E4D, 'l'}, {0x1E4E, 0x1E4E, 'u'},
    {0x1E4F, 0x1E4F, 'l'}, {0x1E50, 0x1E50, 'u'}, {0x1E51, 0x1E51, 'l'}, {0x1E52, 0x1E52, 'u'}, {0x1E53, 0x1E53, 'l'}, {0x1E54, 0x1E54, 'u'},
    {0x1E55, 0x1E55, 'l'}, {0x1E56, 0x1E56, 'u'}, {0x1E57, 0x1E57, 'l'}, {0x1E58, 0x1E58, 'u'}, {0x1E59, 0x1E59, 'l'}, {0x1E5A, 0x1E5A, 'u'},
    {0x1E5B, 0x1E5B, 'l'}, {0x1E5C, 0x1E5C, 'u'}, {0x1E5D, 0x1E5D, 'l'}, {0x1E5E, 0x1E5E, 'u'}, {0x1E5F, 0x1E5F, 'l'}, {0x1E60, 0x1E60, 'u'},
    {0x1E61, 0x1E61, 'l'}, {0x1E62, 0x1E62, 'u'}, {0x1E63, 0x1E63, 'l'}, {0x1E64, 0x1E64, 'u'}, {0x1E65, 0x1E65, 'l'}, {0x1E66, 0x1E66, 'u'},
    {0x1E67, 0x1E67, 'l'}, {0x1E68, 0x1E68, 'u'}, {0x1E69, 0x1E69, 'l'}, {0x1E6A, 0x1E6A, 'u'}, {0x1E6B, 0x1E6B, 'l'}, {0x1E6C, 0x1E6C, 'u'},
    {0x1E6D, 0x1E6D, 'l'}, {0x1E6E, 0x1E6E, 'u'}, {0x1E6F, 0x1E6F, 'l'}, {0x1E70, 0x1E70, 'u'}, {0x1E71, 0x1E71, 'l'}, {0x1E72, 0x1E72, 'u'},
    {0x1E73, 0x1E73, 'l'}, {0x1E74, 0x1E74, 'u'}, {0x1E75, 0x1E75, 'l'}, {0x1E76, 0x1E76, 'u'}, {0x1E77, 0x1E77, 'l'}, {0x1E78, 0x1E78, 'u'},
    {0x1E79, 0x1E79, 'l'}, {0x1E7A, 0x1E7A, 'u'}, {0x1E7B, 0x1E7B, 'l'}, {0x1E7C, 0x1E7C, 'u'}, {0x1E7D, 0x1E7D, 'l'}, {0x1E7E, 0x1E7E, 'u'},
    {0x1E7F, 0x1E7F, 'l'}, {0x1E80, 0x1E80, 'u'}, {0x1E81, 0x1E81, 'l'}, {0x1E82, 0x1E82, 'u'}, {0x1E83, 0x1E83, 'l'}, {0x1E84, 0x1E84, 'u'},
    {0x1E85, 0x1E85, 'l'}, {0x1E86, 0x1E86, 'u'}, {0x1E87, 0x1E87, 'l'}, {0x1E88, 0x1E88, 'u'}, {0x1E89, 0x1E89, 'l'}, {0x1E8A, 0x1E8A, 'u'},
    {0x1E8B, 0x1E8B, 'l'}, {0x1E8C, 0x1E8C, 'u'}, {0x1E8D, 0x1E8D, 'l'}, {0x1E8E, 0x1E8E, 'u'}, {0x1E8F, 0x1E8F, 'l'}, {0x1E90, 0x1E90, 'u'},
    {0x1E91, 0x1E91, 'l'}, {0x1E92, 0x1E92, 'u'}, {0x1E93, 0x1E93, 'l'}, {0x1E94, 0x1E94, 'u'}, {0x1E95, 0x1E9D, 'l'}, {0x1E9E, 0x1E9E, 'u'},
    {0x1E9F, 0x1E9F, 'l'}, {0x1EA0, 0x1EA0, 'u'}, {0x1EA1, 0x1EA1, 'l'}, {0x1EA2, 0x1EA2, 'u'}, {0x1EA3, 0x1EA3, 'l'}, {0x1EA4, 0x1EA4, 'u'},
    {0x1EA5, 0x1EA5, 'l'}, {0x1EA6, 0x1EA6, 'u'}, {0x1EA7, 0x1EA7, 'l'}, {0x1EA8, 0x1EA8, 'u'}, {0x1EA9, 0x1EA9, 'l'}, {0x1EAA, 0x1EAA, 'u'},
    {0x1EAB, 0x1EAB, 'l'}, {0x1EAC, 0x1EAC, 'u'}, {0x1EAD, 0x1EAD, 'l'}, {0x1EAE, 0x1EAE, 'u'}, {0x1EAF, 0x1EAF, 'l'}, {0x1EB0, 0x1EB0, 'u'},
    {0x1EB1, 0x1EB1, 'l'}, {0x1EB2, 0x1EB2, 'u'}, {0x1EB3, 0x1EB3, 'l'}, {0x1EB4, 0x1EB4, 'u'}, {0x1EB5, 0x1EB5, 'l'}, {0x1EB6, 0x1EB6, 'u'},
    {0x1EB7, 0x1EB7, 'l'}, {0x1EB8, 0x1EB8, 'u'}, {0x1EB9, 0x1EB9, 'l'}, {0x1EBA, 0x1EBA, 'u'}, {0x1EBB, 0x1EBB, 'l'}, {0x1EBC, 0x1EBC, 'u'},
    {0x1EBD, 0x1EBD, 'l'}, {0x1EBE, 0x1EBE, 'u'}, {0x1EBF, 0x1EBF, 'l'}, {0x1EC0, 0x1EC0, 'u'}, {0x1EC1, 0x1EC1, 'l'}, {0x1EC2, 0x1EC2, 'u'},
    {0x1EC3, 0x1EC3, 'l'}, {0x1EC4, 0x1EC4, 'u'}, {0x1EC5, 0x1EC5, 'l'}, {0x1EC6, 0x1EC6, 'u'}, {0x1EC7, 0x1EC7, 'l'}, {0x1EC8, 0x1EC8, 'u'},
    {0x1EC9, 0x1EC9, 'l'}, {0x1ECA, 0x1ECA, 'u'}, {0x1ECB, 0x1ECB, 'l'}, {0x1ECC, 0x1ECC, 'u'}, {0x1ECD, 0x1ECD, 'l'}, {0x1ECE, 0x1ECE, 'u'},
    {0x1ECF, 0x1ECF, 'l'}, {0x1ED0, 0x1ED0, 'u'}, {0x1ED1, 0x1ED1, 'l'}, {0x1ED2, 0x1ED2, 'u'}, {0x1ED3, 0x1ED3, 'l'}, {0x1ED4, 0x1ED4, 'u'},
    {0x1ED5, 0x1ED5, 'l'}, {0x1ED6, 0x1ED6, 'u'}, {0x1ED7, 0x1ED7, 'l'}, {0x1ED8, 0x1ED8, 'u'}, {0x1ED9, 0x1ED9, 'l'}, {0x1EDA, 0x1EDA, 'u'},
    {0x1EDB, 0x1EDB, 'l'}, {0x1EDC, 0x1EDC, 'u'}, {0x1EDD, 0x1EDD, 'l'}, {0x1EDE, 0x1EDE, 'u'}, {0x1EDF, 0x1EDF, 'l'}, {0x1EE0, 0x1EE0, 'u'},
    {0x1EE1, 0x1EE1, 'l'}, {0x1EE2, 0x1EE2, 'u'}, {0x1EE3, 0x1EE3, 'l'}, {0x1EE4, 0x1EE4, 'u'}, {0x1EE5, 0x1EE5, 'l'}, {0x1EE6, 0x1EE6, 'u'},
    {0x1EE7, 0x1EE7, 'l'}, {0x1EE8, 0x1EE8, 'u'}, {0x1EE9, 0x1EE9, 'l'}, {0x1EEA, 0x1EEA, 'u'}, {0x1EEB, 0x1EEB, 'l'}, {0x1EEC, 0x1EEC, 'u'},
    {0x1EED, 0x1EED, 'l'}, {0x1EEE, 0x1EEE, 'u'}, {0x1EEF, 0x1EEF, 'l'}, {0x1EF0, 0x1EF0, 'u'}, {0x1EF1, 0x1EF1, 'l'}, {0x1EF2, 0x1EF2, 'u'},
    {0x1EF3, 0x1EF3, 'l'}, {0x1EF4, 0x1EF4, 'u'}, {0x1EF5, 0x1EF5, 'l'}, {0x1EF6, 0x1EF6, 'u'}, {0x1EF7, 0x1EF7, 'l'}, {0x1EF8, 0x1EF8, 'u'},
    {0x1EF9, 0x1EF9, 'l'}, {0x1EFA, 0x1EFA, 'u'}, {0x1EFB, 0x1EFB, 'l'}, {0x1EFC, 0x1EFC, 'u'}, {0x1EFD, 0x1EFD, 'l'}, {0x1EFE, 0x1EFE, 'u'},
    {0x1EFF, 0x1F07, 'l'}, {0x1F08, 0x1F0F, 'u'}, {0x1F10, 0x1F15, 'l'}, {0x1F18, 0x1F1D, 'u'}, {0x1F20, 0x1F27, 'l'}, {0x1F28, 0x1F2F, 'u'},
    {0x1F30, 0x1F37, 'l'}, {0x1F38, 0x1F3F, 'u'}, {0x1F40, 0x1F45, 'l'}, {0x1F48, 0x1F4D, 'u'}, {0x1F50, 0x1F57, 'l'}, {0x1F59, 0x1F59, 'u'},
    {0x1F5B, 0x1F5B, 'u'}, {0x1F5D, 0x1F5D, 'u'}, {0x1F5F, 0x1F5F, 'u'}, {0x1F60, 0x1F67, 'l'}, {0x1F68, 0x1F6F, 'u'}, {0x1F70, 0x1F7D, 'l'},
    {0x1F80, 0x1F87, 'l'}, {0x1F88, 0x1F8F, 'u'}, {0x1F90, 0x1F97, 'l'}, {0x1F98, 0x1F9F, 'u'}, {0x1FA0, 0x1FA7, 'l'}, {0x1FA8, 0x1FAF, 'u'},
    {0x1FB0, 0x1FB4, 'l'}, {0x1FB6, 0x1FB7, 'l'}, {0x1FB8, 0x1FBC, 'u'}, {0x1FBD, 0x1FBD, 'S'}, {0x1FBE, 0x1FBE, 'l'}, {0x1FBF, 0x1FC1, 'S'},
    {0x1FC2, 0x1FC4, 'l'}, {0x1FC6, 0x1FC7, 'l'}, {0x1FC8, 0x1FCC, 'u'}, {0x1FCD, 0x1FCF, 'S'}, {0x1FD0, 0x1FD3, 'l'}, {0x1FD6, 0x1FD7, 'l'},
    {0x1FD8, 0x1FDB, 'u'}, {0x1FDD, 0x1FDF, 'S'}, {0x1FE0, 0x1FE7, 'l'}, {0x1FE8, 0x1FEC, 'u'}, {0x1FED, 0x1FEF, 'S'}, {0x1FF2, 0x1FF4, 'l'},
    {0x1FF6, 0x1FF7, 'l'}, {0x1FF8, 0x1FFC, 'u'}, {0x1FFD, 0x1FFE, 'S'}, {0x2010, 0x2027, 'P'}, {0x2030, 0x2043, 'P'}, {0x2044, 0x2044, 'S'},
    {0x2045, 0x2051, 'P'}, {0x2052, 0x2052, 'S'}, {0x2053, 0x205E, 'P'}, {0x2070, 0x2070, 'N'}, {0x2071, 0x2071, 'L'}, {0x2074, 0x2079, 'N'},
    {0x207A, 0x207C, 'S'}, {0x207D, 0x207E, 'P'}, {0x207F, 0x207F, 'L'}, {0x2080, 0x2089, 'N'}, {0x208A, 0x208C, 'S'}, {0x208D, 0x208E, 'P'},
    {0x2090, 0x209C, 'L'}, {0x20A0, 0x20C0, 'S'}, {0x20D0, 0x20F0, 'M'}, {0x2100, 0x2101, 'S'}, {0x2102, 0x2102, 'u'}, {0x2103, 0x2106, 'S'},
    {0x2107, 0x2107, 'u'}, {0x2108, 0x2109, 'S'}, {0x210A, 0x210A, 'l'}, {0x210B, 0x210D, 'u'}, {0x210E, 0x210F, 'l'}, {0x2110, 0x2112, 'u'},
    {0x2113, 0x2113, 'l'}, {0x2114, 0x2114, 'S'}, {0x2115, 0x2115, 'u'}, {0x2116, 0x2118, 'S'}, {0x2119, 0x211D, 'u'}, {0x211E, 0x2123, 'S'},
    {0x2124, 0x2124, 'u'}, {0x2125, 0x2125, 'S'}, {0x2126, 0x2126, 'u'}, {0x2127, 0x2127, 'S'}, {0x2128, 0x2128, 'u'}, {0x2129, 0x2129, 'S'},
    {0x212A, 0x212D, 'u'}, {0x212E, 0x212E, 'S'}, {0x212F, 0x212F, 'l'}, {0x2130, 0x2133, 'u'}, {0x2134, 0x2134, 'l'}, {0x2135, 0x2138, 'L'},
    {0x2139, 0x2139, 'l'}, {0x213A, 0x213B, 'S'}, {0x213C, 0x213D, 'l'}, {0x213E, 0x213F, 'u'}, {0x2140, 0x2144, 'S'}, {0x2145, 0x2145, 'u'},
    {0x2146, 0x2149, 'l'}, {0x214A, 0x214D, 'S'}, {0x214E, 0x214E, 'l'}, {0x214F, 0x214F, 'S'}, {0x2150, 0x2182, 'N'}, {0x2183, 0x2183, 'u'},
    {0x2184, 0x2184, 'l'}, {0x2185, 0x2189, 'N'}, {0x218A, 0x218B, 'S'}, {0x2190, 0x2307, 'S'}, {0x2308, 0x230B, 'P'}, {0x230C, 0x2328, 'S'},
    {0x2329, 0x232A, 'P'}, {0x232B, 0x2426, 'S'}, {0x2440, 0x244A, 'S'}, {0x2460, 0x249B, 'N'}, {0x249C, 0x24E9, 'S'}, {0x24EA, 0x24FF, 'N'},
    {0x2500, 0x2767, 'S'}, {0x2768, 0x2775, 'P'}, {0x2776, 0x2793, 'N'}, {0x2794, 0x27C4, 'S'}, {0x27C5, 0x27C6, 'P'}, {0x27C7, 0x27E5, 'S'},
    {0x27E6, 0x27EF, 'P'}, {0x27F0, 0x2982, 'S'}, {0x2983, 0x2998, 'P'}, {0x2999, 0x29D7, 'S'}, {0x29D8, 0x29DB, 'P'}, {0x29DC, 0x29FB, 'S'},
    {0x29FC, 0x29FD, 'P'}, {0x29FE, 0x2B73, 'S'}, {0x2B76, 0x2B95, 'S'}, {0x2B97, 0x2BFF, 'S'}, {0x2C00, 0x2C2F, 'u'}, {0x2C30, 0x2C5F, 'l'},
    {0x2C60, 0x2C60, 'u'}, {0x2C61, 0x2C61, 'l'}, {0x2C62, 0x2C64, 'u'}, {0x2C65, 0x2C66, 'l'}, {0x2C67, 0x2C67, 'u'}, {0x2C68, 0x2C68, 'l'},
    {0x2C69, 0x2C69, 'u'}, {0x2C6A, 0x2C6A, 'l'}, {0x2C6B, 0x2C6B, 'u'}, {0x2C6C, 0x2C6C, 'l'}, {0x2C6D, 0x2C70, 'u'}, {0x2C71, 0x2C71, 'l'},
    {0x2C72, 0x2C72, 'u'}, {0x2C73, 0x2C74, 'l'}, {0x2C75, 0x2C75, 'u'}, {0x2C76, 0x2C7B, 'l'}, {0x2C7C, 0x2C7D, 'L'}, {0x2C7E, 0x2C80, 'u'},
    {0x2C81, 0x2C81, 'l'}, {0x2C82, 0x2C82, 'u'}, {0x2C83, 0x2C83, 'l'}, {0x2C84, 0x2C84, 'u'}, {0x2C85, 0x2C85, 'l'}, {0x2C86, 0x2C86, 'u'},
    {0x2C87, 0x2C87, 'l'}, {0x2C88, 0x2C88, 'u'}, {0x2C89, 0x2C89, 'l'}, {0x2C8A, 0x2C8A, 'u'}, {0x2C8B, 0x2C8B, 'l'}, {0x2C8C, 0x2C8C, 'u'},
    {0x2C8D, 0x2C8D, 'l'}, {0x2C8E, 0x2C8E, 'u'}, {0x2C8F, 0x2C8F, 'l'}, {0x2C90, 0x2C90, 'u'}, {0x2C91, 0x2C91, 'l'}, {0x2C92, 0x2C92, 'u'},
    {0x2C93, 0x2C93, 'l'}, {0x2C94, 0x2C94, 'u'}, {0x2C95, 0x2C95, 'l'}, {0x2C96, 0x2C96, 'u'}, {0x2C97, 0x2C97, 'l'}, {0x2C98, 0x2C98, 'u'},
    {0x2C99, 0x2C99, 'l'}, {0x2C9A, 0x2C9A, 'u'}, {0x2C9B, 0x2C9B, 'l'}, {0x2C9C, 0x2C9C, 'u'}, {0x2C9D, 0x2C9D, 'l'}, {0x2C9E, 0x2C9E, 'u'},
    {0x2C9F, 0x2C9F, 'l'}, {0x2CA0, 0x2CA0, 'u'}, {0x2CA1, 0x2CA1, 'l'}, {0x2CA2, 0x2CA2, 'u'}, {0x2CA3, 0x2CA3, 'l'}, {0x2CA4, 0x2CA4, 'u'},
    {0x2CA5, 0x2CA5, 'l'}, {0x2CA6, 0x2CA6, 'u'}, {0x2CA7, 0x2CA7, 'l'}, {0x2CA8, 0x2CA8, 'u'}, {0x2CA9, 0x2CA9, 'l'}, {0x2CAA, 0x2CAA, 'u'},
    {0x2CAB, 0x2CAB, 'l'}, {0x2CAC, 0x2CAC, 'u'}, {0x2CAD, 0x2CAD, 'l'}, {0x2CAE, 0x2CAE, 'u'}, {0x2CAF, 0x2CAF, 'l'}, {0x2CB0, 0x2CB0, 'u'},
    {0x2CB1, 0x2CB1, 'l'}, {0x2CB2, 0x2CB2, 'u'}, {0x2CB3, 0x2CB3, 'l'}, {0x2CB4, 0x2CB4, 'u'}, {0x2CB5, 0x2CB5, 'l'}, {0x2CB6, 0x2CB6, 'u'},
    {0x2CB7, 0x2CB7, 'l'}, {0x2CB8, 0x2CB8, 'u'}, {0x2CB9, 0x2CB9, 'l'}, {0x2CBA, 0x2CBA, 'u'}, {0x2CBB, 0x2CBB, 'l'}, {0x2CBC, 0x2CBC, 'u'},
    {0x2CBD, 0x2CBD, 'l'}, {0x2CBE, 0x2CBE, 'u'}, {0x2CBF, 0x2CBF, 'l'}, {0x2CC0, 0x2CC0, 'u'}, {0x2CC1, 0x2CC1, 'l'}, {0x2CC2, 0x2CC2, 'u'},
    {0x2CC3, 0x2CC3, 'l'}, {0x2CC4, 0x2CC4, 'u'}, {0x2CC5, 0x2CC5, 'l'}, {0x2CC6, 0x2CC6, 'u'}, {0x2CC7, 0x2CC7, 'l'}, {0x2CC8, 0x2CC8, 'u'},
    {0x2CC9, 0x2CC9, 'l'}, {0x2CCA, 0x2CCA, 'u'}, {0x2CCB, 0x2CCB, 'l'}, {0x2CCC, 0x2CCC, 'u'}, {0x2CCD, 0x2CCD, 'l'}, {0x2CCE, 0x2CCE, 'u'},
    {0x2CCF, 0x2CCF, 'l'}, {0x2CD0, 0x2CD0, 'u'}, {0x2CD1, 0x2CD1, 'l'}, {0x2CD2, 0x2CD2, 'u'}, {0x2CD3, 0x2CD3, 'l'}, {0x2CD4, 0x2CD4, 'u'},
    {0x2CD5, 0x2CD5, 'l'}, {0x2CD6, 0x2CD6, 'u'}, {0x2CD7, 0x2CD7, 'l'}, {0x2CD8, 0x2CD8, 'u'}, {0x2CD9, 0x2CD9, 'l'}, {0x2CDA, 0x2CDA, 'u'},
    {0x2CDB, 0x2CDB, 'l'}, {0x2CDC, 0x2CDC, 'u'}, {0x2CDD, 0x2CDD, 'l'}, {0x2CDE, 0x2CDE, 'u'}, {0x2CDF, 0x2CDF, 'l'}, {0x2CE0, 0x2CE0, 'u'},
    {0x2CE1, 0x2CE1, 'l'}, {0x2CE2, 0x2CE2, 'u'}, {0x2CE3, 0x2CE4, 'l'}, {0x2CE5, 0x2CEA, 'S'}, {0x2CEB, 0x2CEB, 'u'}, {0x2CEC, 0x2CEC, 'l'},
    {0x2CED, 0x2CED, 'u'}, {0x2CEE, 0x2CEE, 'l'}, {0x2CEF, 0x2CF1, 'M'}, {0x2CF2, 0x2CF2, 'u'}, {0x2CF3, 0x2CF3, 'l'}, {0x2CF9, 0x2CFC, 'P'},
    {0x2CFD, 0x2CFD, 'N'}, {0x2CFE, 0x2CFF, 'P'}, {0x2D00, 0x2D25, 'l'}, {0x2D27, 0x2D27, 'l'}, {0x2D2D, 0x2D2D, 'l'}, {0x2D30, 0x2D67, 'L'},
    {0x2D6F, 0x2D6F, 'L'}, {0x2D70, 0x2D70, 'P'}, {0x2D7F, 0x2D7F, 'M'}, {0x2D80, 0x2D96, 'L'}, {0x2DA0, 0x2DA6, 'L'}, {0x2DA8, 0x2DAE, 'L'},
    {0x2DB0, 0x2DB6, 'L'}, {0x2DB8, 0x2DBE, 'L'}, {0x2DC0, 0x2DC6, 'L'}, {0x2DC8, 0x2DCE, 'L'}, {0x2DD0, 0x2DD6, 'L'}, {0x2DD8, 0x2DDE, 'L'},
    {0x2DE0, 0x2DFF, 'M'}, {0x2E00, 0x2E2E, 'P'}, {0x2E2F, 0x2E2F, 'L'}, {0x2E30, 0x2E4F, 'P'}, {0x2E50, 0x2E51, 'S'}, {0x2E52, 0x2E5D, 'P'},
    {0x2E80, 0x2E99, 'S'}, {0x2E9B, 0x2EF3, 'S'}, {0x2F00, 0x2FD5, 'S'}, {0x2FF0, 0x2FFB, 'S'}, {0x3001, 0x3003, 'P'}, {0x3004, 0x3004, 'S'},
    {0x3005, 0x3006, 'L'}, {0x3007, 0x3007, 'N'}, {0x3008, 0x3011, 'P'}, {0x3012, 0x3013, 'S'}, {0x3014, 0x301F, 'P'}, {0x3020, 0x3020, 'S'},
    {0x3021, 0x3029, 'N'}, {0x302A, 0x302F, 'M'}, {0x3030, 0x3030, 'P'}, {0x3031, 0x3035, 'L'}, {0x3036, 0x3037, 'S'}, {0x3038, 0x303A, 'N'},
    {0x303B, 0x303C, 'L'}, {0x303D, 0x303D, 'P'}, {0x303E, 0x303F, 'S'}, {0x3041, 0x3096, 'L'}, {0x3099, 0x309A, 'M'}, {0x309B, 0x309C, 'S'},
    {0x309D, 0x309F, 'L'}, {0x30A0, 0x30A0, 'P'}, {0x30A1, 0x30FA, 'L'}, {0x30FB, 0x30FB, 'P'}, {0x30FC, 0x30FF, 'L'}, {0x3105, 0x312F, 'L'},
    {0x3131, 0x318E, 'L'}, {0x3190, 0x3191, 'S'}, {0x3192, 0x3195, 'N'}, {0x3196, 0x319F, 'S'}, {0x31A0, 0x31BF, 'L'}, {0x31C0, 0x31E3, 'S'},
    {0x31F0, 0x31FF, 'L'}, {0x3200, 0x321E, 'S'}, {0x3220, 0x3229, 'N'}, {0x322A, 0x3247, 'S'}, {0x3248, 0x324F, 'N'}, {0x3250, 0x3250, 'S'},
    {0x3251, 0x325F, 'N'}, {0x3260, 0x327F, 'S'}, {0x3280, 0x3289, 'N'}, {0x328A, 0x32B0, 'S'}, {0x32B1, 0x32BF, 'N'}, {0x32C0, 0x33FF, 'S'},
    {0x3400, 0x4DBF, 'L'}, {0x4DC0, 0x4DFF, 'S'}, {0x4E00, 0xA48C, 'L'}, {0xA490, 0xA4C6, 'S'}, {0xA4D0, 0xA4FD, 'L'}, {0xA4FE, 0xA4FF, 'P'},
    {0xA500, 0xA60C, 'L'}, {0xA60D, 0xA60F, 'P'}, {0xA610, 0xA61F, 'L'}, {0xA620, 0xA629, 'N'}, {0xA62A, 0xA62B, 'L'}, {0xA640, 0xA640, 'u'},
    {0xA641, 0xA641, 'l'}, {0xA642, 0xA642, 'u'}, {0xA643, 0xA643, 'l'}, {0xA644, 0xA644, 'u'}, {0xA645, 0xA645, 'l'}, {0xA646, 0xA646, 'u'},
    {0xA647, 0xA647, 'l'}, {0xA648, 0xA648, 'u'}, {0xA649, 0xA649, 'l'}, {0xA64A, 0xA64A, 'u'}, {0xA64B, 0xA64B, 'l'}, {0xA64C, 0xA64C, 'u'},
    {0xA64D, 0xA64D, 'l'}, {0xA64E, 0xA64E, 'u'}, {0xA64F, 0xA64F, 'l'}, {0xA650, 0xA650, 'u'}, {0xA651, 0xA651, 'l'}, {0xA652, 0xA652, 'u'},
    {0xA653, 0xA653, 'l'}, {0xA654, 0xA654, 'u'}, {0xA655, 0xA655, 'l'}, {0xA656, 0xA656, 'u'}, {0xA657, 0xA657, 'l'}, {0xA658, 0xA658, 'u'},
    {0xA659, 0xA659, 'l'}, {0xA65A, 0xA65A, 'u'}, {0xA65B, 0xA65B, 'l'}, {0xA65C, 0xA65C, 'u'}, {0xA65D, 0xA65D, 'l'}, {0xA65E, 0xA65E, 'u'},
    {0xA65F, 0xA65F, 'l'}, {0xA660, 0xA660, 'u'}, {0xA661, 0xA661, 'l'}, {0xA662, 0xA662, 'u'}, {0xA663, 0xA663, 'l'}, {0xA664, 0xA664, 'u'},
    {0xA665, 0xA665, 'l'}, {0xA666, 0xA666, 'u'}, {0xA667, 0xA667, 'l'}, {0xA668, 0xA668, 'u'}, {0xA669, 0xA669, 'l'}, {0xA66A, 0xA66A, 'u'},
    {0xA66B, 0xA66B, 'l'}, {0xA66C, 0xA66C, 'u'}, {0xA66D, 0xA66D, 'l'}, {0xA66E, 0xA66E, 'L'}, {0xA66F, 0xA672, 'M'}, {0xA673, 0xA673, 'P'},
    {0xA674, 0xA67D, 'M'}, {0xA67E, 0xA67E, 'P'}, {0xA67F, 0xA67F, 'L'}, {0xA680, 0xA680, 'u'}, {0xA681, 0xA681, 'l'}, {0xA682, 0xA682, 'u'},
    {0xA683, 0xA683, 'l'}, {0xA684, 0xA684, 'u'}, {0xA685, 0xA685, 'l'}, {0xA686, 0xA686, 'u'}, {0xA687, 0xA687, 'l'}, {0xA688, 0xA688, 'u'},
    {0xA689, 0xA689, 'l'}, {0xA68A, 0xA68A, 'u'}, {0xA68B, 0xA68B, 'l'}, {0xA68C, 0xA68C, 'u'}, {0xA68D, 0xA68D, 'l'}, {0xA68E, 0xA68E, 'u'},
    {0xA68F, 0xA68F, 'l'}, {0xA690, 0xA690, 'u'}, {0xA691, 0xA691, 'l'}, {0xA692, 0xA692, 'u'}, {0xA693, 0xA693, 'l'}, {0xA694, 0xA694, 'u'},
    {0xA695, 0xA695, 'l'}, {0xA696, 0xA696, 'u'}, {0xA697, 0xA697, 'l'}, {0xA698, 0xA698, 'u'}, {0xA699, 0xA699, 'l'}, {0xA69A, 0xA69A, 'u'},
    {0xA69B, 0xA69B, 'l'}, {0xA69C, 0xA69D, 'L'}, {0xA69E, 0xA69F, 'M'}, {0xA6A0, 0xA6E5, 'L'}, {0xA6E6, 0xA6EF, 'N'}, {0xA6F0, 0xA6F1, 'M'},
    {0xA6F2, 0xA6F7, 'P'}, {0xA700, 0xA716, 'S'}, {0xA717, 0xA71F, 'L'}, {0xA720, 0xA721, 'S'}, {0xA722, 0xA722, 'u'}, {0xA723, 0xA723, 'l'},
    {0xA724, 0xA724, 'u'}, {0xA725, 0xA725, 'l'}, {0xA726, 0xA726, 'u'}, {0xA727, 0xA727, 'l'}, {0xA728, 0xA728, 'u'}, {0xA729, 0xA729, 'l'},
    {0xA72A, 0xA72A, 'u'}, {0xA72B, 0xA72B, 'l'}, {0xA72C, 0xA72C, 'u'}, {0xA72D, 0xA72D, 'l'}, {0xA72E, 0xA72E, 'u'}, {0xA72F, 0xA731, 'l'},
    {0xA732, 0xA732, 'u'}, {0xA733, 0xA733, 'l'}, {0xA734, 0xA734, 'u'}, {0xA735, 0xA735, 'l'}, {0xA736, 0xA736, 'u'}, {0xA737, 0xA737, 'l'},
    {0xA738, 0xA738, 'u'}, {0xA739, 0xA739, 'l'}, {0xA73A, 0xA73A, 'u'}, {0xA73B, 0xA73B, 'l'}, {0xA73C, 0xA73C, 'u'}, {0xA73D, 0xA73D, 'l'},
    {0xA73E, 0xA73E, 'u'}, {0xA73F, 0xA73F, 'l'}, {0xA740, 0xA740, 'u'}, {0xA741, 0xA741, 'l'}, {0xA742, 0xA742, 'u'}, {0xA743, 0xA743, 'l'},
    {0xA744, 0xA744, 'u'}, {0xA745, 0xA745, 'l'}, {0xA746, 0xA746, 'u'}, {0xA747, 0xA747, 'l'}, {0xA748, 0xA748, 'u'}, {0xA749, 0xA749, 'l'},
    {0xA74A, 0xA74A, 'u'}, {0xA74B, 0xA74B, 'l'}, {0xA74C, 0xA74C, 'u'}, {0xA74D, 0xA74D, 'l'}, {0xA74E, 0xA74E, 'u'}, {0xA74F, 0xA74F, 'l'},
    {0xA750, 0xA750, 'u'}, {0xA751, 0xA751, 'l'}, {0xA752, 0xA752, 'u'}, {0xA753, 0xA753, 'l'}, {0xA754, 0xA754, 'u'}, {0xA755, 0xA755, 'l'},
    {0xA756, 0xA756, 'u'}, {0xA757, 0xA757, 'l'}, {0xA758, 0xA758, 'u'}, {0xA759, 0xA759, 'l'}, {0xA75A, 0xA75A, 'u'}, {0xA75B, 0xA75B, 'l'},
    {0xA75C, 0xA75C, 'u'}, {0xA75D, 0xA75D, 'l'}, {0xA75E, 0xA75E, 'u'}, {0xA75F, 0xA75F, 'l'}, {0xA760, 0xA760, 'u'}, {0xA761, 0xA761, 'l'},
    {0xA762, 0xA762, 'u'}, {0xA763, 0xA763, 'l'}, {0xA764, 0xA764, 'u'}, {0xA765, 0xA765, 'l'}, {0xA766, 0xA766, 'u'}, {0xA767, 0xA767, 'l'},
    {0xA768, 0xA768, 'u'}, {0xA769, 0xA769, 'l'}, {0xA76A, 0xA76A, 'u'}, {0xA76B, 0xA76B, 'l'}, {0xA76C, 0xA76C, 'u'}, {0xA76D, 0xA76D, 'l'},
    {0xA76E, 0xA76E, 'u'}, {0xA76F, 0xA76F, 'l'}, {0xA770, 0xA770, 'L'}, {0xA771, 0xA778, 'l'}, {0xA779, 0xA779, 'u'}, {0xA77A, 0xA77A, 'l'},
    {0xA77B, 0xA77B, 'u'}, {0xA77C, 0xA77C, 'l'}, {0xA77D, 0xA77E, 'u'}, {0xA77F, 0xA77F, 'l'}, {0xA780, 0xA780, 'u'}, {0xA781, 0xA781, 'l'},
    {0xA782, 0xA782, 'u'}, {0xA783, 0xA783, 'l'}, {0xA784, 0xA784, 'u'}, {0xA785, 0xA785, 'l'}, {0xA786, 0xA786, 'u'}, {0xA787, 0xA787, 'l'},
    {0xA788, 0xA788, 'L'}, {0xA789, 0xA78A, 'S'}, {0xA78B, 0xA78B, 'u'}, {0xA78C, 0xA78C, 'l'}, {0xA78D, 0xA78D, 'u'}, {0xA78E, 0xA78E, 'l'},
    {0xA78F, 0xA78F, 'L'}, {0xA790, 0xA790, 'u'}, {0xA791, 0xA791, 'l'}, {0xA792, 0xA792, 'u'}, {0xA793, 0xA795, 'l'}, {0xA796, 0xA796, 'u'},
    {0xA797, 0xA797, 'l'}, {0xA798, 0xA798, 'u'}, {0xA799, 0xA799, 'l'}, {0xA79A, 0xA79A, 'u'}, {0xA79B, 0xA79B, 'l'}, {0xA79C, 0xA79C, 'u'},
    {0xA79D, 0xA79D, 'l'}, {0xA79E, 0xA79E, 'u'}, {0xA79F, 0xA79F, 'l'}, {0xA7A0, 0xA7A0, 'u'}, {0xA7A1, 0xA7A1, 'l'}, {0xA7A2, 0xA7A2, 'u'},
    {0xA7A3, 0xA7A3, 'l'}, {0xA7A4, 0xA7A4, 'u'}, {0xA7A5, 0xA7A5, 'l'}, {0xA7A6, 0xA7A6, 'u'}, {0xA7A7, 0xA7A7, 'l'}, {0xA7A8, 0xA7A8, 'u'},
    {0xA7A9, 0xA7A9, 'l'}, {0xA7AA, 0xA7AE, 'u'}, {0xA7AF, 0xA7AF, 'l'}, {0xA7B0, 0xA7B4, 'u'}, {0xA7B5, 0xA7B5, 'l'}, {0xA7B6, 0xA7B6, 'u'},
    {0xA7B7, 0xA7B7, 'l'}, {0xA7B8, 0xA7B8, 'u'}, {0xA7B9, 0xA7B9, 'l'}, {0xA7BA, 0xA7BA, 'u'}, {0xA7BB, 0xA7BB, 'l'}, {0xA7BC, 0xA7BC, 'u'},
    {0xA7BD, 0xA7BD, 'l'}, {0xA7BE, 0xA7BE, 'u'}, {0xA7BF, 0xA7BF, 'l'}, {0xA7C0, 0xA7C0, 'u'}, {0xA7C1, 0xA7C1, 'l'}, {0xA7C2, 0xA7C2, 'u'},
    {0xA7C3, 0xA7C3, 'l'}, {0xA7C4, 0xA7C7, 'u'}, {0xA7C8, 0xA7C8, 'l'}, {0xA7C9, 0xA7C9, 'u'}, {0xA7CA, 0xA7CA, 'l'}, {0xA7D0, 0xA7D0, 'u'},
    {0xA7D1, 0xA7D1, 'l'}, {0xA7D3, 0xA7D3, 'l'}, {0xA7D5, 0xA7D5, 'l'}, {0xA7D6, 0xA7D6, 'u'}, {0xA7D7, 0xA7D7, 'l'}, {0xA7D8, 0xA7D8, 'u'},
    {0xA7D9, 0xA7D9, 'l'}, {0xA7F2, 0xA7F4, 'L'}, {0xA7F5, 0xA7F5, 'u'}, {0xA7F6, 0xA7F6, 'l'}, {0xA7F7, 0xA7F9, 'L'}, {0xA7FA, 0xA7FA, 'l'},
    {0xA7FB, 0xA801, 'L'}, {0xA802, 0xA802, 'M'}, {0xA803, 0xA805, 'L'}, {0xA806, 0xA806, 'M'}, {0xA807, 0xA80A, 'L'}, {0xA80B, 0xA80B, 'M'},
    {0xA80C, 0xA822, 'L'}, {0xA823, 0xA827, 'M'}, {0xA828, 0xA82B, 'S'}, {0xA82C, 0xA82C, 'M'}, {0xA830, 0xA835, 'N'}, {0xA836, 0xA839, 'S'},
    {0xA840, 0xA873, 'L'}, {0xA874, 0xA877, 'P'}, {0xA880, 0xA881, 'M'}, {0xA882, 0xA8B3, 'L'}, {0xA8B4, 0xA8C5, 'M'}, {0xA8CE, 0xA8CF, 'P'},
    {0xA8D0, 0xA8D9, 'N'}, {0xA8E0, 0xA8F1, 'M'}, {0xA8F2, 0xA8F7, 'L'}, {0xA8F8, 0xA8FA, 'P'}, {0xA8FB, 0xA8FB, 'L'}, {0xA8FC, 0xA8FC, 'P'},
    {0xA8FD, 0xA8FE, 'L'}, {0xA8FF, 0xA8FF, 'M'}, {0xA900, 0xA909, 'N'}, {0xA90A, 0xA925, 'L'}, {0xA926, 0xA92D, 'M'}, {0xA92E, 0xA92F, 'P'},
    {0xA930, 0xA946, 'L'}, {0xA947, 0xA953, 'M'}, {0xA95F, 0xA95F, 'P'}, {0xA960, 0xA97C, 'L'}, {0xA980, 0xA983, 'M'}, {0xA984, 0xA9B2, 'L'},
    {0xA9B3, 0xA9C0, 'M'}, {0xA9C1, 0xA9CD, 'P'}, {0xA9CF, 0xA9CF, 'L'}, {0xA9D0, 0xA9D9, 'N'}, {0xA9DE, 0xA9DF, 'P'}, {0xA9E0, 0xA9E4, 'L'},
    {0xA9E5, 0xA9E5, 'M'}, {0xA9E6, 0xA9EF, 'L'}, {0xA9F0, 0xA9F9, 'N'}, {0xA9FA, 0xA9FE, 'L'}, {0xAA00, 0xAA28, 'L'}, {0xAA29, 0xAA36, 'M'},
    {0xAA40, 0xAA42, 'L'}, {0xAA43, 0xAA43, 'M'}, {0xAA44, 0xAA4B, 'L'}, {0xAA4C, 0xAA4D, 'M'}, {0xAA50, 0xAA59, 'N'}, {0xAA5C, 0xAA5F, 'P'},
    {0xAA60, 0xAA76, 'L'}, {0xAA77, 0xAA79, 'S'}, {0xAA7A, 0xAA7A, 'L'}, {0xAA7B, 0xAA7D, 'M'}, {0xAA7E, 0xAAAF, 'L'}, {0xAAB0, 0xAAB0, 'M'},
    {0xAAB1, 0xAAB1, 'L'}, {0xAAB2, 0xAAB4, 'M'}, {0xAAB5, 0xAAB6, 'L'}, {0xAAB7, 0xAAB8, 'M'}, {0xAAB9, 0xAABD, 'L'}, {0xAABE, 0xAABF, 'M'},
    {0xAAC0, 0xAAC0, 'L'}, {0xAAC1, 0xAAC1, 'M'}, {0xAAC2, 0xAAC2, 'L'}, {0xAADB, 0xAADD, 'L'}, {0xAADE, 0xAADF, 'P'}, {0xAAE0, 0xAAEA, 'L'},
    {0xAAEB, 0xAAEF, 'M'}, {0xAAF0, 0xAAF1, 'P'}, {0xAAF2, 0xAAF4, 'L'}, {0xAAF5, 0xAAF6, 'M'}, {0xAB01, 0xAB06, 'L'}, {0xAB09, 0xAB0E, 'L'},
    {0xAB11, 0xAB16, 'L'}, {0xAB20, 0xAB26, 'L'}, {0xAB28, 0xAB2E, 'L'}, {0xAB30, 0xAB5A, 'l'}, {0xAB5B, 0xAB5B, 'S'}, {0xAB5C, 0xAB5F, 'L'},
    {0xAB60, 0xAB68, 'l'}, {0xAB69, 0xAB69, 'L'}, {0xAB6A, 0xAB6B, 'S'}, {0xAB70, 0xABBF, 'l'}, {0xABC0, 0xABE2, 'L'}, {0xABE3, 0xABEA, 'M'},
    {0xABEB, 0xABEB, 'P'}, {0xABEC, 0xABED, 'M'}, {0xABF0, 0xABF9, 'N'}, {0xAC00, 0xD7A3, 'L'}, {0xD7B0, 0xD7C6, 'L'}, {0xD7CB, 0xD7FB, 'L'},
    {0xF900, 0xFA6D, 'L'}, {0xFA70, 0xFAD9, 'L'}, {0xFB00, 0xFB06, 'l'}, {0xFB13, 0xFB17, 'l'}, {0xFB1D, 0xFB1D, 'L'}, {0xFB1E, 0xFB1E, 'M'},
    {0xFB1F, 0xFB28, 'L'}, {0xFB29, 0xFB29, 'S'}, {0xFB2A, 0xFB36, 'L'}, {0xFB38, 0xFB3C, 'L'}, {0xFB3E, 0xFB3E, 'L'}, {0xFB40, 0xFB41, 'L'},
    {0xFB43, 0xFB44, 'L'}, {0xFB46, 0xFBB1, 'L'}, {0xFBB2, 0xFBC2, 'S'}, {0xFBD3, 0xFD3D, 'L'}, {0xFD3E, 0xFD3F, 'P'}, {0xFD40, 0xFD4F, 'S'},
    {0xFD50, 0xFD8F, 'L'}, {0xFD92, 0xFDC7, 'L'}, {0xFDCF, 0xFDCF, 'S'}, {0xFDF0, 0xFDFB, 'L'}, {0xFDFC, 0xFDFF, 'S'}, {0xFE00, 0xFE0F, 'M'},
    {0xFE10, 0xFE19, 'P'}, {0xFE20, 0xFE2F, 'M'}, {0xFE30, 0xFE52, 'P'}, {0xFE54, 0xFE61, 'P'}, {0xFE62, 0xFE62, 'S'}, {0xFE63, 0xFE63, 'P'},
    {0xFE64, 0xFE66, 'S'}, {0xFE68, 0xFE68, 'P'}, {0xFE69, 0xFE69, 'S'}, {0xFE6A, 0xFE6B, 'P'}, {0xFE70, 0xFE74, 'L'}, {0xFE76, 0xFEFC, 'L'},
    {0xFF01, 0xFF03, 'P'}, {0xFF04, 0xFF04, 'S'}, {0xFF05, 0xFF0A, 'P'}, {0xFF0B, 0xFF0B, 'S'}, {0xFF0C, 0xFF0F, 'P'}, {0xFF10, 0xFF19, 'N'},
    {0xFF1A, 0xFF1B, 'P'}, {0xFF1C, 0xFF1E, 'S'}, {0xFF1F, 0xFF20, 'P'}, {0xFF21, 0xFF3A, 'u'}, {0xFF3B, 0xFF3D, 'P'}, {0xFF3E, 0xFF3E, 'S'},
    {0xFF3F, 0xFF3F, 'P'}, {0xFF40, 0xFF40, 'S'}, {0xFF41, 0xFF5A, 'l'}, {0xFF5B, 0xFF5B, 'P'}, {0xFF5C, 0xFF5C, 'S'}, {0xFF5D, 0xFF5D, 'P'},
    {0xFF5E, 0xFF5E, 'S'}, {0xFF5F, 0xFF65, 'P'}, {0xFF66, 0xFFBE, 'L'}, {0xFFC2, 0xFFC7, 'L'}, {0xFFCA, 0xFFCF, 'L'}, {0xFFD2, 0xFFD7, 'L'},
    {0xFFDA, 0xFFDC, 'L'}, {0xFFE0, 0xFFE6, 'S'}, {0xFFE8, 0xFFEE, 'S'}, {0xFFFC, 0xFFFD, 'S'}, {0x10000, 0x1000B, 'L'}, {0x1000D, 0x10026, 'L'},
    {0x10028, 0x1003A, 'L'}, {0x1003C, 0x1003D, 'L'}, {0x1003F, 0x1004D, 'L'}, {0x10050, 0x1005D, 'L'}, {0x10080, 0x100FA, 'L'}, {0x10100, 0x10102, 'P'},
    {0x10107, 0x10133, 'N'}, {0x10137, 0x1013F, 'S'}, {0x10140, 0x10178, 'N'}, {0x10179, 0x10189, 'S'}, {0x1018A, 0x1018B, 'N'}, {0x1018C, 0x1018E, 'S'},
    {0x10190, 0x1019C, 'S'}, {0x101A0, 0x101A0, 'S'}, {0x101D0, 0x101FC, 'S'}, {0x101FD, 0x101FD, 'M'}, {0x10280, 0x1029C, 'L'}, {0x102A0, 0x102D0, 'L'},
    {0x102E0, 0x102E0, 'M'}, {0x102E1, 0x102FB, 'N'}, {0x10300, 0x1031F, 'L'}, {0x10320, 0x10323, 'N'}, {0x1032D, 0x10340, 'L'}, {0x10341, 0x10341, 'N'},
    {0x10342, 0x10349, 'L'}, {0x1034A, 0x1034A, 'N'}, {0x10350, 0x10375, 'L'}, {0x10376, 0x1037A, 'M'}, {0x10380, 0x1039D, 'L'}, {0x1039F, 0x1039F, 'P'},
    {0x103A0, 0x103C3, 'L'}, {0x103C8, 0x103CF, 'L'}, {0x103D0, 0x103D0, 'P'}, {0x103D1, 0x103D5, 'N'}, {0x10400, 0x10427, 'u'}, {0x10428, 0x1044F, 'l'},
    {0x10450, 0x1049D, 'L'}, {0x104A0, 0x104A9, 'N'}, {0x104B0, 0x104D3, 'u'}, {0x104D8, 0x104FB, 'l'}, {0x10500, 0x10527, 'L'}, {0x10530, 0x10563, 'L'},
    {0x1056F, 0x1056F, 'P'}, {0x10570, 0x1057A, 'u'}, {0x1057C, 0x1058A, 'u'}, {0x1058C, 0x10592, 'u'}, {0x10594, 0x10595, 'u'}, {0x10597, 0x105A1, 'l'},
    {0x105A3, 0x105B1, 'l'}, {0x105B3, 0x105B9, 'l'}, {0x105BB, 0x105BC, 'l'}, {0x10600, 0x10736, 'L'}, {0x10740, 0x10755, 'L'}, {0x10760, 0x10767, 'L'},
    {0x10780, 0x10785, 'L'}, {0x10787, 0x107B0, 'L'}, {0x107B2, 0x107BA, 'L'}, {0x10800, 0x10805, 'L'}, {0x10808, 0x10808, 'L'}, {0x1080A, 0x10835, 'L'},
    {0x10837, 0x10838, 'L'}, {0x1083C, 0x1083C, 'L'}, {0x1083F, 0x10855, 'L'}, {0x10857, 0x10857, 'P'}, {0x10858, 0x1085F, 'N'}, {0x10860, 0x10876, 'L'},
    {0x10877, 0x10878, 'S'}, {0x10879, 0x1087F, 'N'}, {0x10880, 0x1089E, 'L'}, {0x108A7, 0x108AF, 'N'}, {0x108E0, 0x108F2, 'L'}, {0x108F4, 0x108F5, 'L'},
    {0x108FB, 0x108FF, 'N'}, {0x10900, 0x10915, 'L'}, {0x10916, 0x1091B, 'N'}, {0x1091F, 0x1091F, 'P'}, {0x10920, 0x10939, 'L'}, {0x1093F, 0x1093F, 'P'},
    {0x10980, 0x109B7, 'L'}, {0x109BC, 0x109BD, 'N'}, {0x109BE, 0x109BF, 'L'}, {0x109C0, 0x109CF, 'N'}, {0x109D2, 0x109FF, 'N'}, {0x10A00, 0x10A00, 'L'},
    {0x10A01, 0x10A03, 'M'}, {0x10A05, 0x10A06, 'M'}, {0x10A0C, 0x10A0F, 'M'}, {0x10A10, 0x10A13, 'L'}, {0x10A15, 0x10A17, 'L'}, {0x10A19, 0x10A35, 'L'},
    {0x10A38, 0x10A3A, 'M'}, {0x10A3F, 0x10A3F, 'M'}, {0x10A40, 0x10A48, 'N'}, {0x10A50, 0x10A58, 'P'}, {0x10A60, 0x10A7C, 'L'}, {0x10A7D, 0x10A7E, 'N'},
    {0x10A7F, 0x10A7F, 'P'}, {0x10A80, 0x10A9C, 'L'}, {0x10A9D, 0x10A9F, 'N'}, {0x10AC0, 0x10AC7, 'L'}, {0x10AC8, 0x10AC8, 'S'}, {0x10AC9, 0x10AE4, 'L'},
    {0x10AE5, 0x10AE6, 'M'}, {0x10AEB, 0x10AEF, 'N'}, {0x10AF0, 0x10AF6, 'P'}, {0x10B00, 0x10B35, 'L'}, {0x10B39, 0x10B3F, 'P'}, {0x10B40, 0x10B55, 'L'},
    {0x10B58, 0x10B5F, 'N'}, {0x10B60, 0x10B72, 'L'}, {0x10B78, 0x10B7F, 'N'}, {0x10B80, 0x10B91, 'L'}, {0x10B99, 0x10B9C, 'P'}, {0x10BA9, 0x10BAF, 'N'},
    {0x10C00, 0x10C48, 'L'}, {0x10C80, 0x10CB2, 'u'}, {0x10CC0, 0x10CF2, 'l'}, {0x10CFA, 0x10CFF, 'N'}, {0x10D00, 0x10D23, 'L'}, {0x10D24, 0x10D27, 'M'},
    {0x10D30, 0x10D39, 'N'}, {0x10E60, 0x10E7E, 'N'}, {0x10E80, 0x10EA9, 'L'}, {0x10EAB, 0x10EAC, 'M'}, {0x10EAD, 0x10EAD, 'P'}, {0x10EB0, 0x10EB1, 'L'},
    {0x10F00, 0x10F1C, 'L'}, {0x10F1D, 0x10F26, 'N'}, {0x10F27, 0x10F27, 'L'}, {0x10F30, 0x10F45, 'L'}, {0x10F46, 0x10F50, 'M'}, {0x10F51, 0x10F54, 'N'},
    {0x10F55, 0x10F59, 'P'}, {0x10F70, 0x10F81, 'L'}, {0x10F82, 0x10F85, 'M'}, {0x10F86, 0x10F89, 'P'}, {0x10FB0, 0x10FC4, 'L'}, {0x10FC5, 0x10FCB, 'N'},
    {0x10FE0, 0x10FF6, 'L'}, {0x11000, 0x11002, 'M'}, {0x11003, 0x11037, 'L'}, {0x11038, 0x11046, 'M'}, {0x11047, 0x1104D, 'P'}, {0x11052, 0x1106F, 'N'},
    {0x11070, 0x11070, 'M'}, {0x11071, 0x11072, 'L'}, {0x11073, 0x11074, 'M'}, {0x11075, 0x11075, 'L'}, {0x1107F, 0x11082, 'M'}, {0x11083, 0x110AF, 'L'},
    {0x110B0, 0x110BA, 'M'}, {0x110BB, 0x110BC, 'P'}, {0x110BE, 0x110C1, 'P'}, {0x110C2, 0x110C2, 'M'}, {0x110D0, 0x110E8, 'L'}, {0x110F0, 0x110F9, 'N'},
    {0x11100, 0x11102, 'M'}, {0x11103, 0x11126, 'L'}, {0x11127, 0x11134, 'M'}, {0x11136, 0x1113F, 'N'}, {0x11140, 0x11143, 'P'}, {0x11144, 0x11144, 'L'},
    {0x11145, 0x11146, 'M'}, {0x11147, 0x11147, 'L'}, {0x11150, 0x11172, 'L'}, {0x11173, 0x11173, 'M'}, {0x11174, 0x11175, 'P'}, {0x11176, 0x11176, 'L'},
    {0x11180, 0x11182, 'M'}, {0x11183, 0x111B2, 'L'}, {0x111B3, 0x111C0, 'M'}, {0x111C1, 0x111C4, 'L'}, {0x111C5, 0x111C8, 'P'}, {0x111C9, 0x111CC, 'M'},
    {0x111CD, 0x111CD, 'P'}, {0x111CE, 0x111CF, 'M'}, {0x111D0, 0x111D9, 'N'}, {0x111DA, 0x111DA, 'L'}, {0x111DB, 0x111DB, 'P'}, {0x111DC, 0x111DC, 'L'},
    {0x111DD, 0x111DF, 'P'}, {0x111E1, 0x111F4, 'N'}, {0x11200, 0x11211, 'L'}, {0x11213, 0x1122B, 'L'}, {0x1122C, 0x11237, 'M'}, {0x11238, 0x1123D, 'P'},
    {0x1123E, 0x1123E, 'M'}, {0x11280, 0x11286, 'L'}, {0x11288, 0x11288, 'L'}, {0x1128A, 0x1128D, 'L'}, {0x1128F, 0x1129D, 'L'}, {0x1129F, 0x112A8, 'L'},
    {0x112A9, 0x112A9, 'P'}, {0x112B0, 0x112DE, 'L'}, {0x112DF, 0x112EA, 'M'}, {0x112F0, 0x112F9, 'N'}, {0x11300, 0x11303, 'M'}, {0x11305, 0x1130C, 'L'},
    {0x1130F, 0x11310, 'L'}, {0x11313, 0x11328, 'L'}, {0x1132A, 0x11330, 'L'}, {0x11332, 0x11333, 'L'}, {0x11335, 0x11339, 'L'}, {0x1133B, 0x1133C, 'M'},
    {0x1133D, 0x1133D, 'L'}, {0x1133E, 0x11344, 'M'}, {0x11347, 0x11348, 'M'}, {0x1134B, 0x1134D, 'M'}, {0x11350, 0x11350, 'L'}, {0x11357, 0x11357, 'M'},
    {0x1135D, 0x11361, 'L'}, {0x11362, 0x11363, 'M'}, {0x11366, 0x1136C, 'M'}, {0x11370, 0x11374, 'M'}, {0x11400, 0x11434, 'L'}, {0x11435, 0x11446, 'M'},
    {0x11447, 0x1144A, 'L'}, {0x1144B, 0x1144F, 'P'}, {0x11450, 0x11459, 'N'}, {0x1145A, 0x1145B, 'P'}, {0x1145D, 0x1145D, 'P'}, {0x1145E, 0x1145E, 'M'},
    {0x1145F, 0x11461, 'L'}, {0x11480, 0x114AF, 'L'}, {0x114B0, 0x114C3, 'M'}, {0x114C4, 0x114C5, 'L'}, {0x114C6, 0x114C6, 'P'}, {0x114C7, 0x114C7, 'L'},
    {0x114D0, 0x114D9, 'N'}, {0x11580, 0x115AE, 'L'}, {0x115AF, 0x115B5, 'M'}, {0x115B8, 0x115C0, 'M'}, {0x115C1, 0x115D7, 'P'}, {0x115D8, 0x115DB, 'L'},
    {0x115DC, 0x115DD, 'M'}, {0x11600, 0x1162F, 'L'}, {0x11630, 0x11640, 'M'}, {0x11641, 0x11643, 'P'}, {0x11644, 0x11644, 'L'}, {0x11650, 0x11659, 'N'},
    {0x11660, 0x1166C, 'P'}, {0x11680, 0x116AA, 'L'}, {0x116AB, 0x116B7, 'M'}, {0x116B8, 0x116B8, 'L'}, {0x116B9, 0x116B9, 'P'}, {0x116C0, 0x116C9, 'N'},
    {0x11700, 0x1171A, 'L'}, {0x1171D, 0x1172B, 'M'}, {0x11730, 0x1173B, 'N'}, {0x1173C, 0x1173E, 'P'}, {0x1173F, 0x1173F, 'S'}, {0x11740, 0x11746, 'L'},
    {0x11800, 0x1182B, 'L'}, {0x1182C, 0x1183A, 'M'}, {0x1183B, 0x1183B, 'P'}, {0x118A0, 0x118BF, 'u'}, {0x118C0, 0x118DF, 'l'}, {0x118E0, 0x118F2, 'N'},
    {0x118FF, 0x11906, 'L'}, {0x11909, 0x11909, 'L'}, {0x1190C, 0x11913, 'L'}, {0x11915, 0x11916, 'L'}, {0x11918, 0x1192F, 'L'}, {0x11930, 0x11935, 'M'},
    {0x11937, 0x11938, 'M'}, {0x1193B, 0x1193E, 'M'}, {0x1193F, 0x1193F, 'L'}, {0x11940, 0x11940, 'M'}, {0x11941, 0x11941, 'L'}, {0x11942, 0x11943, 'M'},
    {0x11944, 0x11946, 'P'}, {0x11950, 0x11959, 'N'}, {0x119A0, 0x119A7, 'L'}, {0x119AA, 0x119D0, 'L'}, {0x119D1, 0x119D7, 'M'}, {0x119DA, 0x119E0, 'M'},
    {0x119E1, 0x119E1, 'L'}, {0x119E2, 0x119E2, 'P'}, {0x119E3, 0x119E3, 'L'}, {0x119E4, 0x119E4, 'M'}, {0x11A00, 0x11A00, 'L'}, {0x11A01, 0x11A0A, 'M'},
    {0x11A0B, 0x11A32, 'L'}, {0x11A33, 0x11A39, 'M'}, {0x11A3A, 0x11A3A, 'L'}, {0x11A3B, 0x11A3E, 'M'}, {0x11A3F, 0x11A46, 'P'}, {0x11A47, 0x11A47, 'M'},
    {0x11A50, 0x11A50, 'L'}, {0x11A51, 0x11A5B, 'M'}, {0x11A5C, 0x11A89, 'L'}, {0x11A8A, 0x11A99, 'M'}, {0x11A9A, 0x11A9C, 'P'}, {0x11A9D, 0x11A9D, 'L'},
    {0x11A9E, 0x11AA2, 'P'}, {0x11AB0, 0x11AF8, 'L'}, {0x11C00, 0x11C08, 'L'}, {0x11C0A, 0x11C2E, 'L'}, {0x11C2F, 0x11C36, 'M'}, {0x11C38, 0x11C3F, 'M'},
    {0x11C40, 0x11C40, 'L'}, {0x11C41, 0x11C45, 'P'}, {0x11C50, 0x11C6C, 'N'}, {0x11C70, 0x11C71, 'P'}, {0x11C72, 0x11C8F, 'L'}, {0x11C92, 0x11CA7, 'M'},
    {0x11CA9, 0x11CB6, 'M'}, {0x11D00, 0x11D06, 'L'}, {0x11D08, 0x11D09, 'L'}, {0x11D0B, 0x11D30, 'L'}, {0x11D31, 0x11D36, 'M'}, {0x11D3A, 0x11D3A, 'M'},
    {0x11D3C, 0x11D3D, 'M'}, {0x11D3F, 0x11D45, 'M'}, {0x11D46, 0x11D46, 'L'}, {0x11D47, 0x11D47, 'M'}, {0x11D50, 0x11D59, 'N'}, {0x11D60, 0x11D65, 'L'},
    {0x11D67, 0x11D68, 'L'}, {0x11D6A, 0x11D89, 'L'}, {0x11D8A, 0x11D8E, 'M'}, {0x11D90, 0x11D91, 'M'}, {0x11D93, 0x11D97, 'M'}, {0x11D98, 0x11D98, 'L'},
    {0x11DA0, 0x11DA9, 'N'}, {0x11EE0, 0x11EF2, 'L'}, {0x11EF3, 0x11EF6, 'M'}, {0x11EF7, 0x11EF8, 'P'}, {0x11FB0, 0x11FB0, 'L'}, {0x11FC0, 0x11FD4, 'N'},
    {0x11FD5, 0x11FF1, 'S'}, {0x11FFF, 0x11FFF, 'P'}, {0x12000, 0x12399, 'L'}, {0x12400, 0x1246E, 'N'}, {0x12470, 0x12474, 'P'}, {0x12480, 0x12543, 'L'},
    {0x12F90, 0x12FF0, 'L'}, {0x12FF1, 0x12FF2, 'P'}, {0x13000, 0x1342E, 'L'}, {0x14400, 0x14646, 'L'}, {0x16800, 0x16A38, 'L'}, {0x16A40, 0x16A5E, 'L'},
    {0x16A60, 0x16A69, 'N'}, {0x16A6E, 0x16A6F, 'P'}, {0x16A70, 0x16ABE, 'L'}, {0x16AC0, 0x16AC9, 'N'}, {0x16AD0, 0x16AED, 'L'}, {0x16AF0, 0x16AF4, 'M'},
    {0x16AF5, 0x16AF5, 'P'}, {0x16B00, 0x16B2F, 'L'}, {0x16B30, 0x16B36, 'M'}, {0x16B37, 0x16B3B, 'P'}, {0x16B3C, 0x16B3F, 'S'}, {0x16B40, 0x16B43, 'L'},
    {0x16B44, 0x16B44, 'P'}, {0x16B45, 0x16B45, 'S'}, {0x16B50, 0x16B59, 'N'}, {0x16B5B, 0x16B61, 'N'}, {0x16B63, 0x16B77, 'L'}, {0x16B7D, 0x16B8F, 'L'},
    {0x16E40, 0x16E5F, 'u'}, {0x16E60, 0x16E7F, 'l'}, {0x16E80, 0x16E96, 'N'}, {0x16E97, 0x16E9A, 'P'}, {0x16F00, 0x16F4A, 'L'}, {0x16F4F, 0x16F4F, 'M'},
    {0x16F50, 0x16F50, 'L'}, {0x16F51, 0x16F87, 'M'}, {0x16F8F, 0x16F92, 'M'}, {0x16F93, 0x16F9F, 'L'}, {0x16FE0, 0x16FE1, 'L'}, {0x16FE2, 0x16FE2, 'P'},
    {0x16FE3, 0x16FE3, 'L'}, {0x16FE4, 0x16FE4, 'M'}, {0x16FF0, 0x16FF1, 'M'}, {0x17000, 0x187F7, 'L'}, {0x18800, 0x18CD5, 'L'}, {0x18D00, 0x18D08, 'L'},
    {0x1AFF0, 0x1AFF3, 'L'}, {0x1AFF5, 0x1AFFB, 'L'}, {0x1AFFD, 0x1AFFE, 'L'}, {0x1B000, 0x1B122, 'L'}, {0x1B150, 0x1B152, 'L'}, {0x1B164, 0x1B167, 'L'},
    {0x1B170, 0x1B2FB, 'L'}, {0x1BC00, 0x1BC6A, 'L'}, {0x1BC70, 0x1BC7C, 'L'}, {0x1BC80, 0x1BC88, 'L'}, {0x1BC90, 0x1BC99, 'L'}, {0x1BC9C, 0x1BC9C, 'S'},
    {0x1BC9D, 0x1BC9E, 'M'}, {0x1BC9F, 0x1BC9F, 'P'}, {0x1CF00, 0x1CF2D, 'M'}, {0x1CF30, 0x1CF46, 'M'}, {0x1CF50, 0x1CFC3, 'S'}, {0x1D000, 0x1D0F5, 'S'},
    {0x1D100, 0x1D126, 'S'}, {0x1D129, 0x1D164, 'S'}, {0x1D165, 0x1D169, 'M'}, {0x1D16A, 0x1D16C, 'S'}, {0x1D16D, 0x1D172, 'M'}, {0x1D17B, 0x1D182, 'M'},
    {0x1D183, 0x1D184, 'S'}, {0x1D185, 0x1D18B, 'M'}, {0x1D18C, 0x1D1A9, 'S'}, {0x1D1AA, 0x1D1AD, 'M'}, {0x1D1AE, 0x1D1EA, 'S'}, {0x1D200, 0x1D241, 'S'},
    {0x1D242, 0x1D244, 'M'}, {0x1D245, 0x1D245, 'S'}, {0x1D2E0, 0x1D2F3, 'N'}, {0x1D300, 0x1D356, 'S'}, {0x1D360, 0x1D378, 'N'}, {0x1D400, 0x1D419, 'u'},
    {0x1D41A, 0x1D433, 'l'}, {0x1D434, 0x1D44D, 'u'}, {0x1D44E, 0x1D454, 'l'}, {0x1D456, 0x1D467, 'l'}, {0x1D468, 0x1D481, 'u'}, {0x1D482, 0x1D49B, 'l'},
    {0x1D49C, 0x1D49C, 'u'}, {0x1D49E, 0x1D49F, 'u'}, {0x1D4A2, 0x1D4A2, 'u'}, {0x1D4A5, 0x1D4A6, 'u'}, {0x1D4A9, 0x1D4AC, 'u'}, {0x1D4AE, 0x1D4B5, 'u'},
    {0x1D4B6, 0x1D4B9, 'l'}, {0x1D4BB, 0x1D4BB, 'l'}, {0x1D4BD, 0x1D4C3, 'l'}, {0x1D4C5, 0x1D4CF, 'l'}, {0x1D4D0, 0x1D4E9, 'u'}, {0x1D4EA, 0x1D503, 'l'},
    {0x1D504, 0x1D505, 'u'}, {0x1D507, 0x1D50A, 'u'}, {0x1D50D, 0x1D514, 'u'}, {0x1D516, 0x1D51C, 'u'}, {0x1D51E, 0x1D537, 'l'}, {0x1D538, 0x1D539, 'u'},
    {0x1D53B, 0x1D53E, 'u'}, {0x1D540, 0x1D544, 'u'}, {0x1D546, 0x1D546, 'u'}, {0x1D54A, 0x1D550, 'u'}, {0x1D552, 0x1D56B, 'l'}, {0x1D56C, 0x1D585, 'u'},
    {0x1D586, 0x1D59F, 'l'}, {0x1D5A0, 0x1D5B9, 'u'}, {0x1D5BA, 0x1D5D3, 'l'}, {0x1D5D4, 0x1D5ED, 'u'}, {0x1D5EE, 0x1D607, 'l'}, {0x1D608, 0x1D621, 'u'},
    {0x1D622, 0x1D63B, 'l'}, {0x1D63C, 0x1D655, 'u'}, {0x1D656, 0x1D66F, 'l'}, {0x1D670, 0x1D689, 'u'}, {0x1D68A, 0x1D6A5, 'l'}, {0x1D6A8, 0x1D6C0, 'u'},
    {0x1D6C1, 0x1D6C1, 'S'}, {0x1D6C2, 0x1D6DA, 'l'}, {0x1D6DB, 0x1D6DB, 'S'}, {0x1D6DC, 0x1D6E1, 'l'}, {0x1D6E2, 0x1D6FA, 'u'}, {0x1D6FB, 0x1D6FB, 'S'},
    {0x1D6FC, 0x1D714, 'l'}, {0x1D715, 0x1D715, 'S'}, {0x1D716, 0x1D71B, 'l'}, {0x1D71C, 0x1D734, 'u'}, {0x1D735, 0x1D735, 'S'}, {0x1D736, 0x1D74E, 'l'},
    {0x1D74F, 0x1D74F, 'S'}, {0x1D750, 0x1D755, 'l'}, {0x1D756, 0x1D76E, 'u'}, {0x1D76F, 0x1D76F, 'S'}, {0x1D770, 0x1D788, 'l'}, {0x1D789, 0x1D789, 'S'},
    {0x1D78A, 0x1D78F, 'l'}, {0x1D790, 0x1D7A8, 'u'}, {0x1D7A9, 0x1D7A9, 'S'}, {0x1D7AA, 0x1D7C2, 'l'}, {0x1D7C3, 0x1D7C3, 'S'}, {0x1D7C4, 0x1D7C9, 'l'},
    {0x1D7CA, 0x1D7CA, 'u'}, {0x1D7CB, 0x1D7CB, 'l'}, {0x1D7CE, 0x1D7FF, 'N'}, {0x1D800, 0x1D9FF, 'S'}, {0x1DA00, 0x1DA36, 'M'}, {0x1DA37, 0x1DA3A, 'S'},
    {0x1DA3B, 0x1DA6C, 'M'}, {0x1DA6D, 0x1DA74, 'S'}, {0x1DA75, 0x1DA75, 'M'}, {0x1DA76, 0x1DA83, 'S'}, {0x1DA84, 0x1DA84, 'M'}, {0x1DA85, 0x1DA86, 'S'},
    {0x1DA87, 0x1DA8B, 'P'}, {0x1DA9B, 0x1DA9F, 'M'}, {0x1DAA1, 0x1DAAF, 'M'}, {0x1DF00, 0x1DF09, 'l'}, {0x1DF0A, 0x1DF0A, 'L'}, {0x1DF0B, 0x1DF1E, 'l'},
    {0x1E000, 0x1E006, 'M'}, {0x1E008, 0x1E018, 'M'}, {0x1E01B, 0x1E021, 'M'}, {0x1E023, 0x1E024, 'M'}, {0x1E026, 0x1E02A, 'M'}, {0x1E100, 0x1E12C, 'L'},
    {0x1E130, 0x1E136, 'M'}, {0x1E137, 0x1E13D, 'L'}, {0x1E140, 0x1E149, 'N'}, {0x1E14E, 0x1E14E, 'L'}, {0x1E14F, 0x1E14F, 'S'}, {0x1E290, 0x1E2AD, 'L'},
    {0x1E2AE, 0x1E2AE, 'M'}, {0x1E2C0, 0x1E2EB, 'L'}, {0x1E2EC, 0x1E2EF, 'M'}, {0x1E2F0, 0x1E2F9, 'N'}, {0x1E2FF, 0x1E2FF, 'S'}, {0x1E7E0, 0x1E7E6, 'L'},
    {0x1E7E8, 0x1E7EB, 'L'}, {0x1E7ED, 0x1E7EE, 'L'}, {0x1E7F0, 0x1E7FE, 'L'}, {0x1E800, 0x1E8C4, 'L'}, {0x1E8C7, 0x1E8CF, 'N'}, {0x1E8D0, 0x1E8D6, 'M'},
    {0x1E900, 0x1E921, 'u'}, {0x1E922, 0x1E943, 'l'}, {0x1E944, 0x1E94A, 'M'}, {0x1E94B, 0x1E94B, 'L'}, {0x1E950, 0x1E959, 'N'}, {0x1E95E, 0x1E95F, 'P'},
    {0x1EC71, 0x1ECAB, 'N'}, {0x1ECAC, 0x1ECAC, 'S'}, {0x1ECAD, 0x1ECAF, 'N'}, {0x1ECB0, 0x1ECB0, 'S'}, {0x1ECB1, 0x1ECB4, 'N'}, {0x1ED01, 0x1ED2D, 'N'},
    {0x1ED2E, 0x1ED2E, 'S'}, {0x1ED2F, 0x1ED3D, 'N'}, {0x1EE00, 0x1EE03, 'L'}, {0x1EE05, 0x1EE1F, 'L'}, {0x1EE21, 0x1EE22, 'L'}, {0x1EE24, 0x1EE24, 'L'},
    {0x1EE27, 0x1EE27, 'L'}, {0x1EE29, 0x1EE32, 'L'}, {0x1EE34, 0x1EE37, 'L'}, {0x1EE39, 0x1EE39, 'L'}, {0x1EE3B, 0x1EE3B, 'L'}, {0x1EE42, 0x1EE42, 'L'},
    {0x1EE47, 0x1EE47, 'L'}, {0x1EE49, 0x1EE49, 'L'}, {0x1EE4B, 0x1EE4B, 'L'}, {0x1EE4D, 0x1EE4F, 'L'}, {0x1EE51, 0x1EE52, 'L'}, {0x1EE54, 0x1EE54, 'L'},
    {0x1EE57, 0x1EE57, 'L'}, {0x1EE59, 0x1EE59, 'L'}, {0x1EE5B, 0x1EE5B, 'L'}, {0x1EE5D, 0x1EE5D, 'L'}, {0x1EE5F, 0x1EE5F, 'L'}, {0x1EE61, 0x1EE62, 'L'},
    {0x1EE64, 0x1EE64, 'L'}, {0x1EE67, 0x1EE6A, 'L'}, {0x1EE6C, 0x1EE72, 'L'}, {0x1EE74, 0x1EE77, 'L'}, {0x1EE79, 0x1EE7C, 'L'}, {0x1EE7E, 0x1EE7E, 'L'},
    {0x1EE80, 0x1EE89, 'L'}, {0x1EE8B, 0x1EE9B, 'L'}, {0x1EEA1, 0x1EEA3, 'L'}, {0x1EEA5, 0x1EEA9, 'L'}, {0x1EEAB, 0x1EEBB, 'L'}, {0x1EEF0, 0x1EEF1, 'S'},
    {0x1F000, 0x1F02B, 'S'}, {0x1F030, 0x1F093, 'S'}, {0x1F0A0, 0x1F0AE, 'S'}, {0x1F0B1, 0x1F0BF, 'S'}, {0x1F0C1, 0x1F0CF, 'S'}, {0x1F0D1, 0x1F0F5, 'S'},
    {0x1F100, 0x1F10C, 'N'}, {0x1F10D, 0x1F1AD, 'S'}, {0x1F1E6, 0x1F202, 'S'}, {0x1F210, 0x1F23B, 'S'}, {0x1F240, 0x1F248, 'S'}, {0x1F250, 0x1F251, 'S'},
    {0x1F260, 0x1F265, 'S'}, {0x1F300, 0x1F6D7, 'S'}, {0x1F6DD, 0x1F6EC, 'S'}, {0x1F6F0, 0x1F6FC, 'S'}, {0x1F700, 0x1F773, 'S'}, {0x1F780, 0x1F7D8, 'S'},
    {0x1F7E0, 0x1F7EB, 'S'}, {0x1F7F0, 0x1F7F0, 'S'}, {0x1F800, 0x1F80B, 'S'}, {0x1F810, 0x1F847, 'S'}, {0x1F850, 0x1F859, 'S'}, {0x1F860, 0x1F887, 'S'},
    {0x1F890, 0x1F8AD, 'S'}, {0x1F8B0, 0x1F8B1, 'S'}, {0x1F900, 0x1FA53, 'S'}, {0x1FA60, 0x1FA6D, 'S'}, {0x1FA70, 0x1FA74, 'S'}, {0x1FA78, 0x1FA7C, 'S'},
    {0x1FA80, 0x1FA86, 'S'}, {0x1FA90, 0x1FAAC, 'S'}, {0x1FAB0, 0x1FABA, 'S'}, {0x1FAC0, 0x1FAC5, 'S'}, {0x1FAD0, 0x1FAD9, 'S'}, {0x1FAE0, 0x1FAE7, 'S'},
    {0x1FAF0, 0x1FAF6, 'S'}, {0x1FB00, 0x1FB92, 'S'}, {0x1FB94, 0x1FBCA, 'S'}, {0x1FBF0, 0x1FBF9, 'N'}, {0x20000, 0x2A6DF, 'L'}, {0x2A700, 0x2B738, 'L'},
    {0x2B740, 0x2B81D, 'L'}, {0x2B820, 0x2CEA1, 'L'}, {0x2CEB0, 0x2EBE0, 'L'}, {0x2F800, 0x2FA1D, 'L'}, {0x30000, 0x3134A, 'L'}, {0xE0100, 0xE01EF, 'M'},
}; /* END_UNICODE_RANGES */

/* The (first, last) ranges of the classes in `classes` from the table
   above, adjacent ones joined; *n gets their count. */
static int *unicode_category_ranges(const char *classes, int *n) {
    int count = 0, total = (int)(sizeof(unicode_ranges) / sizeof(unicode_ranges[0]));
    int *r = xcalloc(2 * (size_t)total, sizeof(int));
    for (int i = 0; i < total; i++) {
        if (!strchr(classes, unicode_ranges[i].category)) continue;
        if (count > 0 && r[2 * count - 1] + 1 == unicode_ranges[i].first) {
            r[2 * count - 1] = unicode_ranges[i].last;
            continue;
        }
        r[2 * count] = unicode_ranges[i].first;
        r[2 * count + 1] = unicode_ranges[i].last;
        count++;
    }
    *n = count;
    return r;
}

static char unicode_class(int cp) {
    int lo = 0, hi = (int)(sizeof(unicode_ranges) / sizeof(unicode_ranges[0])) - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (cp < unicode_ranges[mid].first) hi = mid - 1;
        else if (cp > unicode_ranges[mid].last) lo = mid + 1;
        else return unicode_ranges[mid].category;
    }
    return 0;
}

/* The user-defined tokens of `text` (len bytes) and the stretches of text
   between them, in order; *n_fragments gets their count. As llama.cpp does:
   each token in turn, longest first, cuts every stretch of text left where
   it occurs, leftmost first. Tokens whose first two bytes never occur
   together in the text are not searched for. */
static Fragment *split_user_tokens(const Tokenizer *t, const char *text, size_t len, int *n_fragments) {
    Fragment *f = xcalloc(len + 1, sizeof(Fragment)), *next = xcalloc(len + 1, sizeof(Fragment));
    int n = 0;
    if (len > 0) f[n++] = (Fragment){0, (int)len, -1};
    unsigned char *pairs = xcalloc(65536 / 8, 1), bytes[256] = {0};
    for (size_t i = 0; i < len; i++) {
        bytes[(unsigned char)text[i]] = 1;
        if (i + 1 < len) {
            unsigned pair = (unsigned char)text[i] << 8 | (unsigned char)text[i + 1];
            pairs[pair >> 3] |= (unsigned char)(1u << (pair & 7));
        }
    }
    for (int u = 0; u < t->n_user; u++) {
        int id = t->user_tokens[u], tl = t->piece_len[id];
        const char *tok = t->vocab[id];
        unsigned pair = tl >= 2 ? (unsigned char)tok[0] << 8 | (unsigned char)tok[1] : 0;
        if (tl == 0 || !bytes[(unsigned char)tok[0]] || (tl >= 2 && !(pairs[pair >> 3] & (1u << (pair & 7))))) continue;
        int m = 0;
        for (int k = 0; k < n; k++) {
            if (f[k].token >= 0) {
                next[m++] = f[k];
                continue;
            }
            int at = f[k].start, end = f[k].start + f[k].len;
            for (int i = at; i + tl <= end; i++) {
                if (text[i] != tok[0] || memcmp(text + i, tok, (size_t)tl) != 0) continue;
                if (i > at) next[m++] = (Fragment){at, i - at, -1};
                next[m++] = (Fragment){i, tl, id};
                at = i + tl;
                i = at - 1;
            }
            if (end > at) next[m++] = (Fragment){at, end - at, -1};
        }
        Fragment *swap = f;
        f = next;
        next = swap;
        n = m;
    }
    free(next);
    free(pairs);
    *n_fragments = n;
    return f;
}

/* GPT-2's alphabet: bytes 0x21..0x7E, 0xA1..0xAC and 0xAE..0xFF are written as
   the code point of the same number, the other 68 bytes, in order, as
   U+0100..U+0143. Returns the byte code point cp stands for, or -1. */
static int gpt2_byte_of(int cp) {
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF)) return cp;
    if (cp < 0x100 || cp > 0x143) return -1;
    int k = cp - 0x100; /* the k-th byte outside those ranges: 0x00..0x20, 0x7F..0xA0, 0xAD */
    return k < 33 ? k : k < 67 ? 0x7F + (k - 33) : 0xAD;
}

/* Writes the bytes that GPT-2-alphabet text s (len bytes) stands for to out
   (room for len bytes); returns their count, or -1 when s is not in that
   alphabet. */
static int gpt2_unmap(const char *s, int len, char *out) {
    int n = 0;
    for (int i = 0; i < len;) {
        int step, cp = decode_utf8((const unsigned char *)s + i, (size_t)(len - i), &step);
        int b = cp == 0xFFFD ? -1 : gpt2_byte_of(cp);
        if (b < 0) return -1;
        out[n++] = (char)b;
        i += step;
    }
    return n;
}

/* The pre-tokenizer of a tokenizer.ggml.pre name (llama.cpp's names for the
   splits implemented here), or 0. */
static int pre_tokenizer_of(const char *name) {
    static const struct { const char *name; int pre; } names[] = {
        {"llama-bpe", PRE_LLAMA3}, {"llama3", PRE_LLAMA3}, {"llama-v3", PRE_LLAMA3}, {"falcon3", PRE_LLAMA3},
        {"smaug-bpe", PRE_LLAMA3}, {"dbrx", PRE_LLAMA3},
        {"qwen2", PRE_QWEN2}, {"deepseek-r1-qwen", PRE_QWEN2}, {"megrez", PRE_QWEN2}, {"stablelm2", PRE_QWEN2},
        {"gpt-2", PRE_GPT2}, {"phi-2", PRE_GPT2}, {"mpt", PRE_GPT2}, {"olmo", PRE_GPT2},
        {"smollm", PRE_SMOLLM}, {"starcoder", PRE_SMOLLM}, {"refact", PRE_SMOLLM}, {"codeshell", PRE_SMOLLM},
        {"deepseek-llm", PRE_DEEPSEEK_LLM}, {"deepseek-coder", PRE_DEEPSEEK_CODER},
        {"gpt-4o", PRE_GPT4O}, {"tekken", PRE_TEKKEN}, {"deepseek-v3", PRE_DEEPSEEK3},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(name, names[i].name) == 0) return names[i].pre;
    return 0;
}

/* The id of the control or user-defined token spelled `text`, or -1. */
static int lookup_special(const Tokenizer *t, const char *text);

/* The chat template family of a tokenizer.chat_template, by its markers; -1
   when it has none of them. */
static int chat_family_of(const char *tmpl) {
    if (strstr(tmpl, "<|channel|>")) return CHAT_HARMONY;
    if (strstr(tmpl, "<|start_header_id|>")) return CHAT_LLAMA3;
    if (strstr(tmpl, "<|im_start|>") && strstr(tmpl, "Reasoning Mode")) return CHAT_SMOLLM3; /* ChatML with its own system header */
    if (strstr(tmpl, "<|im_start|>")) return CHAT_CHATML;
    if (strstr(tmpl, "<|user|>")) return CHAT_PHI3;
    if (strstr(tmpl, "[SYSTEM_PROMPT]")) return CHAT_MISTRAL7;
    if (strstr(tmpl, "[INST]")) return CHAT_LLAMA2;
    if (strstr(tmpl, "<start_of_turn>")) return CHAT_GEMMA;
    if (strstr(tmpl, "<|start_of_role|>")) return CHAT_GRANITE;
    /* Phi-4-mini's '<|' + message['role'] + '|>' + message['content'] + '<|end|>' */
    if (strstr(tmpl, "<|assistant|>") && strstr(tmpl, "<|end|>")) return CHAT_PHI4;
    /* DeepSeek-V2's User: / Assistant: lines, as llama.cpp recognises them */
    if (strstr(tmpl, "'Assistant: ' + message['content'] + eos_token")) return CHAT_DEEPSEEK2;
    return -1;
}

static const char *const chat_family_names[] = {"llama2", "llama3", "chatml", "phi3", "gemma", "phi4", "granite", "mistral7", "smollm3",
                                                   "harmony", "deepseek2"};

/* The token that closes a turn in the tokenizer's chat template: Llama 3's
   <|eot_id|>, ChatML's <|im_end|>, Phi-3's and Phi-4's <|end|>, Gemma's
   <end_of_turn>, Granite's <|end_of_text|> where the vocabulary has them,
   else the file's end of turn (Mistral's </s>). */
static int turn_end_token(const Tokenizer *t) {
    static const char *const names[] = {NULL, "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end|>", "<|end_of_text|>", NULL,
                                        "<|im_end|>", "<|end|>", NULL};
    const char *name = names[t->chat_template];
    int id = name && t->special ? lookup_special(t, name) : -1;
    return id >= 0 ? id : t->end_of_turn;
}

/* Adds `token` to the end tokens unless it is one already (or there is no room). */
static void add_end_token(Tokenizer *t, int token) {
    if (token < 0 || is_eos_token(t, token) || t->n_end == MAX_END_TOKENS) return;
    t->end[t->n_end++] = token;
}

/* An id from the file: -1 (absent) or a token. */
static int vocab_id(const GGUFVocab *v, int id, const char *what, const char *path) {
    if (id < -1 || id >= v->n_tokens) die(EXIT_BAD_FILE, "%s: bad vocabulary: %s %d is not a token (%d tokens)", path, what, id, v->n_tokens);
    return id;
}

static const Tokenizer *sorting_user_tokens;

/* Longest first, then by id. */
static int compare_user_tokens(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    int lx = sorting_user_tokens->piece_len[x], ly = sorting_user_tokens->piece_len[y];
    return lx != ly ? (lx < ly) - (lx > ly) : (x > y) - (x < y);
}

/* SentencePiece pieces as tokenizer.bin holds them: U+2581 becomes a space
   (what llama2.c's export does), and the byte tokens <0xNN> are found by name. */
static void load_gguf_sentencepiece(Tokenizer *t, const GGUFVocab *v, const char *path) {
    int n = v->n_tokens;
    t->vocab_scores = xcalloc((size_t)n, sizeof(float));
    for (int i = 0; i < n; i++) {
        const char *src = v->tokens[i];
        int len = v->token_lens[i], out = 0;
        char *piece = xcalloc((size_t)len + 1, 1);
        for (int k = 0; k < len; k++) {
            if (k + 2 < len && memcmp(src + k, "\xE2\x96\x81", 3) == 0) {
                piece[out++] = ' ';
                k += 2;
            } else {
                piece[out++] = src[k];
            }
        }
        t->vocab[i] = piece;
        t->piece_len[i] = out;
        if (out > t->max_token_length) t->max_token_length = out;
        if (v->scores) {
            if (isnan(v->scores[i]))
                die(EXIT_BAD_FILE, "%s: bad vocabulary: token %d has the score NaN", path, i);
            t->vocab_scores[i] = v->scores[i];
        }
    }
    set_byte_pieces(t);
    t->sorted_vocab = xcalloc((size_t)n, sizeof(TokenIndex));
    for (int i = 0; i < n; i++) t->sorted_vocab[i] = (TokenIndex){t->vocab[i], i};
    qsort(t->sorted_vocab, (size_t)n, sizeof(TokenIndex), compare_tokens);
    /* byte b: the token <0xNN>, else the token that is the byte itself (llama.cpp's order) */
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof(name), "<0x%02X>", b);
        int id = lookup_piece(t, name);
        if (id < 0 && b != 0) {
            name[0] = (char)b;
            name[1] = '\0';
            id = lookup_piece(t, name);
        }
        t->byte_token[b] = id;
    }
}

/* Byte-level BPE: ordinary tokens back to bytes from GPT-2's alphabet; the
   merges by id, best rank first. */
static void load_gguf_byte_level(Tokenizer *t, const GGUFVocab *v, const char *path) {
    int n = v->n_tokens;
    t->byte_level = 1;
    const char *pre = v->pre ? v->pre : "(none)";
    t->pre = v->pre ? pre_tokenizer_of(v->pre) : 0;
    if (!t->pre)
        die(EXIT_BAD_FILE, "%s: unknown pre-tokenizer '%s' (tokenizer.ggml.pre): this program splits text as llama-bpe, qwen2, gpt-2, smollm, deepseek-llm, deepseek-coder, "
            "deepseek-v3, gpt-4o and tekken do",
            path, pre);
    t->ignore_merges = (t->pre == PRE_LLAMA3 && strcmp(pre, "smaug-bpe") != 0 && strcmp(pre, "dbrx") != 0) || t->pre == PRE_TEKKEN;
    for (int b = 0; b < 256; b++) t->byte_token[b] = -1;
    for (int i = 0; i < n; i++) {
        int len = v->token_lens[i], type = v->types ? v->types[i] : TOKEN_TYPE_NORMAL;
        char *piece = xcalloc((size_t)len + 1, 1);
        int out = -1;
        if (type == TOKEN_TYPE_NORMAL || type == TOKEN_TYPE_BYTE) out = gpt2_unmap(v->tokens[i], len, piece);
        if (out < 0) {
            /* control, user-defined...: written as they read; an ordinary
               token outside GPT-2's alphabet could never come out of BPE */
            memcpy(piece, v->tokens[i], (size_t)len);
            out = len;
            t->special[i] = 1;
        }
        t->vocab[i] = piece;
        t->piece_len[i] = out;
        if (out > t->max_token_length) t->max_token_length = out;
        if (!t->special[i] && out == 1 && t->byte_token[(unsigned char)piece[0]] < 0) t->byte_token[(unsigned char)piece[0]] = i;
    }
    /* every byte of well-formed UTF-8 needs a token (0xC0, 0xC1 and 0xF5..0xFF never occur) */
    for (int b = 0; b < 0xF5; b++)
        if (t->byte_token[b] < 0 && b != 0xC0 && b != 0xC1)
            die(EXIT_BAD_FILE, "%s: bad vocabulary: no token for the byte 0x%02X", path, b);

    t->pieces = index_texts(t->vocab, t->piece_len, t->special, n);

    /* merges, in a hash table at most half full; a merge whose parts or
       result are not ordinary tokens can never apply (Hugging Face refuses
       such files), so it is left out. The merges spell their tokens as the
       file does (GPT-2's alphabet, a character a byte): they are found by
       that spelling, in an index of the ordinary tokens' spellings, and
       not turned back into bytes each (a third of the time) */
    TextIndex spelled = index_texts(v->tokens, v->token_lens, t->special, n);
    int cap = 2;
    while (cap < 2 * v->n_merges) cap *= 2;
    t->merge_mask = cap - 1;
    t->merges = xcalloc((size_t)cap, sizeof(MergeRule));
    for (int i = 0; i < cap; i++) t->merges[i].left = -1;
    /* first the three ids of every merge, by all threads (lookups in a
       read-only index); then the table, in rank order, each merge's slot
       prefetched MERGE_AHEAD merges before: Llama 3's 280,000 merges took
       70 ms in one loop, most of it waiting on memory */
    enum { MERGE_AHEAD = 16 };
    const int n_merges = v->n_merges;
    int *ids = xcalloc((size_t)n_merges * 3 + 1, sizeof(int)); /* (n_merges, 3): left, right, merged; -2: malformed */
    PARALLEL_FOR_IF(n_merges >= 4096)
    for (int r = 0; r < n_merges; r++) {
        const char *m = v->merges[r], *space = m[0] ? strchr(m + 1, ' ') : NULL;
        int *id = ids + (size_t)r * 3;
        id[0] = id[1] = id[2] = -1;
        if (!space) {
            id[0] = -2;
            continue;
        }
        int ll = (int)(space - m), lr = (int)strlen(space + 1);
        id[0] = text_id(&spelled, m, ll);
        id[1] = lr > 0 ? text_id(&spelled, space + 1, lr) : -1;
        if (id[0] >= 0 && id[1] >= 0) id[2] = text_id_joined(&spelled, m, ll, space + 1, lr);
    }
    for (int r = 0; r < n_merges; r++) {
        const int *id = ids + (size_t)r * 3, *ahead = id + 3 * MERGE_AHEAD;
        if (id[0] == -2) die(EXIT_BAD_FILE, "%s: bad vocabulary: merge %d is not \"left right\"", path, r);
        if (r + MERGE_AHEAD < n_merges && ahead[2] >= 0) prefetch(&t->merges[merge_hash(ahead[0], ahead[1]) & (uint32_t)t->merge_mask], sizeof(MergeRule));
        if (id[2] < 0 || find_merge(t, id[0], id[1])) continue; /* a repeated pair keeps its best rank */
        uint32_t i = merge_hash(id[0], id[1]) & (uint32_t)t->merge_mask;
        while (t->merges[i].left >= 0) i = (i + 1) & (uint32_t)t->merge_mask;
        t->merges[i] = (MergeRule){id[0], id[1], id[2], r};
    }
    free(ids);
    free(spelled.slot);
    t->letter_ranges = unicode_category_ranges("ulL", &t->n_letter);
    t->number_ranges = unicode_category_ranges("N", &t->n_number);
    t->punct_ranges = unicode_category_ranges("P", &t->n_punct);
}

/* Builds t from v (path names the file in errors); dies with a one-line
   error on anything malformed or unsupported. */
static void load_gguf_tokenizer(Tokenizer *t, const GGUFVocab *v, const char *path) {
    memset(t, 0, sizeof(*t));
    if (!v->model) die(EXIT_BAD_FILE, "%s: the file has no vocabulary (tokenizer.ggml.model)", path);
    int spm = strcmp(v->model, "llama") == 0;
    if (!spm && strcmp(v->model, "gpt2") != 0)
        die(EXIT_BAD_FILE, "%s: unknown tokenizer '%s' (tokenizer.ggml.model): this program reads llama (SentencePiece) and gpt2 (byte-level BPE)",
            path, v->model);
    if (spm && v->pre && strcmp(v->pre, "default") != 0)
        die(EXIT_BAD_FILE, "%s: unknown pre-tokenizer '%s' (tokenizer.ggml.pre) for a SentencePiece vocabulary (only 'default')", path, v->pre);
    if (v->n_tokens < 1 || !v->tokens || !v->token_lens) die(EXIT_BAD_FILE, "%s: bad vocabulary: no tokens (tokenizer.ggml.tokens)", path);
    if (v->n_merges < 0 || (v->n_merges > 0 && !v->merges)) die(EXIT_BAD_FILE, "%s: bad vocabulary: %d merges", path, v->n_merges);
    int n = v->n_tokens;
    t->vocab_size = n;
    t->vocab = xcalloc((size_t)n, sizeof(char *));
    t->piece_len = xcalloc((size_t)n, sizeof(int));
    t->special = xcalloc((size_t)n, 1);
    for (int i = 0; i < n; i++) {
        int type = v->types ? v->types[i] : TOKEN_TYPE_NORMAL;
        if (type < TOKEN_TYPE_NORMAL || type > TOKEN_TYPE_BYTE)
            die(EXIT_BAD_FILE, "%s: bad vocabulary: token %d has the type %d (1 to 6)", path, i, type);
        if (v->token_lens[i] < 0 || !v->tokens[i]) die(EXIT_BAD_FILE, "%s: bad vocabulary: token %d has no text", path, i);
        t->special[i] = type == TOKEN_TYPE_UNKNOWN || type == TOKEN_TYPE_CONTROL || type == TOKEN_TYPE_USER_DEFINED || type == TOKEN_TYPE_UNUSED;
    }
    if (spm) load_gguf_sentencepiece(t, v, path);
    else load_gguf_byte_level(t, v, path);
    if (t->max_token_length < 1) t->max_token_length = 1;

    /* user-defined tokens, longest first */
    t->user_tokens = xcalloc((size_t)n, sizeof(int));
    for (int i = 0; i < n; i++)
        if (v->types && v->types[i] == TOKEN_TYPE_USER_DEFINED && t->piece_len[i] > 0) t->user_tokens[t->n_user++] = i;
    sorting_user_tokens = t;
    qsort(t->user_tokens, (size_t)t->n_user, sizeof(int), compare_user_tokens);

    /* special ids; SentencePiece's BOS and EOS are 1 and 2 unless the file says
       otherwise, as llama.cpp assumes */
    int bos = vocab_id(v, v->bos, "BOS", path), eos = vocab_id(v, v->eos, "EOS", path);
    int eot = vocab_id(v, v->eot, "end of turn", path), eom = vocab_id(v, v->eom, "end of message", path);
    vocab_id(v, v->unk, "unknown token", path);
    vocab_id(v, v->pad, "padding token", path);
    if (spm && bos < 0 && n > 1) bos = 1;
    if (spm && eos < 0 && n > 2) eos = 2;
    if (eos < 0) eos = eot >= 0 ? eot : eom;
    if (eos < 0) die(EXIT_BAD_FILE, "%s: bad vocabulary: no end token (tokenizer.ggml.eos_token_id)", path);
    t->add_bos = v->add_bos >= 0 ? v->add_bos : spm || t->pre == PRE_LLAMA3;
    t->add_eos = v->add_eos > 0;
    t->no_space_prefix = spm && v->add_space_prefix == 0;
    if (t->add_bos && bos < 0) die(EXIT_BAD_FILE, "%s: bad vocabulary: it adds BOS but names none (tokenizer.ggml.bos_token_id)", path);
    /* the engine takes BOS for an end of text too: without one, EOS stands in */
    t->bos = bos >= 0 ? bos : eos;
    t->eos = eos;
    t->n_end = 0;
    add_end_token(t, eos);
    add_end_token(t, eot);
    add_end_token(t, eom);
    t->eos_ends_generate = 1;

    /* the chat template's family, by its markers; without a template, by the
       vocabulary's turn tokens */
    int family = v->chat_template ? chat_family_of(v->chat_template) : -1;
    if (family < 0) {
        family = lookup_special(t, "<|start_header_id|>") >= 0 ? CHAT_LLAMA3 : lookup_special(t, "<|im_start|>") >= 0 ? CHAT_CHATML
               : lookup_special(t, "<|user|>") >= 0 ? CHAT_PHI3 : lookup_special(t, "<start_of_turn>") >= 0 ? CHAT_GEMMA
               : lookup_special(t, "<|start_of_role|>") >= 0 ? CHAT_GRANITE : lookup_special(t, "[SYSTEM_PROMPT]") >= 0 ? CHAT_MISTRAL7
               : lookup_special(t, "<|channel|>") >= 0 ? CHAT_HARMONY : CHAT_LLAMA2;
        if (v->chat_template)
            fprintf(stderr, "run: note: %s: the chat template is none of Llama 2's, Llama 3's, ChatML, Phi-3's, Phi-4's, Gemma's, Granite's, "
                            "Mistral v7's, SmolLM3's, Harmony or DeepSeek-V2's; using %s (--chat-template chooses)\n",
                    path, chat_family_names[family]);
    }
    t->chat_template = family;
    /* Llama 3.1+'s templates call tools in their own way (11.1): the
       ipython environment, whose role carries the results, and
       <|python_tag|> for the built-in tools; Llama 3's has no tools (the
       generic fallback) */
    t->llama31_tools = family == CHAT_LLAMA3 && v->chat_template &&
                       (strstr(v->chat_template, "<|python_tag|>") || strstr(v->chat_template, "Environment: ipython"));
    t->end_of_turn = eot >= 0 ? eot : eos;
    t->end_of_turn = turn_end_token(t);
    add_end_token(t, t->end_of_turn);
    /* the tokens that end text in llama.cpp's list, where the vocabulary has them */
    static const char *const ends[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>", "<|eom_id|>",
                                       "<end_of_turn>", "<EOT>"};
    for (size_t i = 0; i < sizeof(ends) / sizeof(ends[0]); i++) add_end_token(t, lookup_special(t, ends[i]));
    /* Harmony (gpt-oss's o200k_harmony): <|end|> closes a message, the
       analysis channel's among them, not the reply, which ends at <|return|>
       or <|call|>; with both in the vocabulary, llama.cpp takes <|end|> off
       its end tokens, and so does this (but where it is the file's EOS) */
    const int end = lookup_special(t, "<|end|>");
    if (end >= 0 && end != t->eos && lookup_special(t, "<|return|>") >= 0 && lookup_special(t, "<|call|>") >= 0) {
        int kept = 0;
        for (int i = 0; i < t->n_end; i++)
            if (t->end[i] != end) t->end[kept++] = t->end[i];
        t->n_end = kept;
        if (t->end_of_turn == end) t->end_of_turn = t->eos;
    }
}

/* The array `key` of `elem` elements, or NULL when absent. */
static const GGUFValue *gguf_array(const GGUF *g, const char *key, uint32_t elem) {
    const GGUFValue *v = gguf_value(g, key);
    if (v && (v->type != GGUF_ARRAY || v->elem != elem))
        die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' is not an array of %s", g->path, key,
            elem == GGUF_STRING ? "strings" : elem == GGUF_FLOAT32 ? "float32" : "int32");
    if (v && v->count > INT_MAX) die(EXIT_BAD_FILE, "%s: bad GGUF: metadata '%s' has %llu elements", g->path, key, (unsigned long long)v->count);
    return v;
}

/* NUL-terminated copies of the strings of a string array (its bounds were
   checked by parse_gguf), one after the other in one allocation, which
   out[0] points to (free_strings): Llama 3's 400,000 strings took 16 ms
   to copy and free one by one. lens (may be NULL) gets their lengths. */
static char **gguf_strings(const GGUF *g, const GGUFValue *v, int **lens) {
    char **out = xcalloc((size_t)v->count + 1, sizeof(char *));
    if (lens) *lens = xcalloc((size_t)v->count, sizeof(int));
    size_t total = 1;
    const char *at = v->at;
    for (uint64_t i = 0; i < v->count; i++) {
        uint64_t len;
        memcpy(&len, at, 8);
        if (len > (1 << 20)) die(EXIT_BAD_FILE, "%s: bad GGUF: a vocabulary string of %llu bytes", g->path, (unsigned long long)len);
        total += len + 1;
        at += 8 + len;
    }
    char *text = xcalloc(total, 1);
    at = v->at;
    for (uint64_t i = 0; i < v->count; i++) {
        uint64_t len;
        memcpy(&len, at, 8);
        out[i] = text;
        memcpy(text, at + 8, (size_t)len);
        text += len + 1;
        if (lens) (*lens)[i] = (int)len;
        at += 8 + len;
    }
    if (v->count == 0) out[0] = text; /* still the allocation's start */
    return out;
}

/* Frees what gguf_strings returned (NULL: nothing). */
static void free_strings(char **strings) {
    if (!strings) return;
    free(strings[0]);
    free(strings);
}

/* A copy of the `count` 4-byte elements of a numeric array, or NULL. */
static void *gguf_numbers(const GGUFValue *v) {
    if (!v) return NULL;
    void *out = xcalloc((size_t)v->count, 4);
    memcpy(out, v->at, (size_t)v->count * 4);
    return out;
}

/* Builds t from the vocabulary of a parsed GGUF file (tokenizer.ggml.*). */
static void load_gguf_vocabulary(Tokenizer *t, const GGUF *g) {
    GGUFVocab v = {0};
    char *model = gguf_string(g, "tokenizer.ggml.model"), *pre = gguf_string(g, "tokenizer.ggml.pre");
    char *chat_template = gguf_string(g, "tokenizer.chat_template");
    const GGUFValue *tokens = gguf_array(g, "tokenizer.ggml.tokens", GGUF_STRING);
    const GGUFValue *merges = gguf_array(g, "tokenizer.ggml.merges", GGUF_STRING);
    if (!model || !tokens)
        die(EXIT_BAD_FILE, "%s: the GGUF file holds no vocabulary (tokenizer.ggml.model, tokenizer.ggml.tokens): write one with "
            "`python3 export.py tokenizer tokenizer.json out.gguf`", g->path);
    float *scores = gguf_numbers(gguf_array(g, "tokenizer.ggml.scores", GGUF_FLOAT32));
    int *types = gguf_numbers(gguf_array(g, "tokenizer.ggml.token_type", GGUF_INT32));
    v.model = model;
    v.pre = pre;
    v.chat_template = chat_template;
    v.n_tokens = (int)tokens->count;
    v.tokens = gguf_strings(g, tokens, &v.token_lens);
    v.scores = scores;
    v.types = types;
    v.n_merges = merges ? (int)merges->count : 0;
    v.merges = merges ? gguf_strings(g, merges, NULL) : NULL;
    const char *ids[] = {"bos", "eos", "eot", "eom", "unknown", "padding"};
    int *fields[] = {&v.bos, &v.eos, &v.eot, &v.eom, &v.unk, &v.pad};
    for (int i = 0; i < 6; i++) {
        char key[64];
        snprintf(key, sizeof(key), "tokenizer.ggml.%s_token_id", ids[i]);
        *fields[i] = gguf_int(g, key, -1, -1, INT_MAX);
    }
    v.add_bos = gguf_int(g, "tokenizer.ggml.add_bos_token", -1, -1, 1);
    v.add_eos = gguf_int(g, "tokenizer.ggml.add_eos_token", -1, -1, 1);
    v.add_space_prefix = gguf_int(g, "tokenizer.ggml.add_space_prefix", -1, -1, 1);
    load_gguf_tokenizer(t, &v, g->path);
    free_strings(v.tokens);
    free_strings(v.merges);
    free(v.token_lens);
    free(scores); free(types); free(model); free(pre); free(chat_template);
}

/* A tokenizer from a GGUF file given with -z (a model's or a vocabulary's):
   its vocabulary must have the model's vocab_size tokens. */
static void load_gguf_tokenizer_file(Tokenizer *t, const void *data, size_t size, const char *path, int vocab_size) {
    GGUF g;
    parse_gguf(&g, data, size, path);
    load_gguf_vocabulary(t, &g);
    free_gguf(&g);
    if (t->vocab_size != vocab_size)
        die(EXIT_BAD_FILE, "%s: the vocabulary has %d tokens, the model %d: wrong vocabulary for this model?", path, t->vocab_size, vocab_size);
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
    ProbIndex *probindex; /* (2, vocab_size) scratch for top-p: the tokens, and the sort's */
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

/* The largest of lp[0..CANDIDATE_RUN-1], or NaN where a NaN may hide a
   larger one (vf_max keeps some NaNs, by instruction set): a NaN in the
   first SIMD_WIDTH values always gives NaN. Vector builds look for the
   largest of many values (a row of logits, the beams' continuations) run by
   run, and compare values one by one only in the run that holds it. */
#define CANDIDATE_RUN 256
#ifdef SIMD_WIDTH
static float run_max(const float *lp) {
    vfloat m = vf_load(lp);
    for (int v = SIMD_WIDTH; v < CANDIDATE_RUN; v += SIMD_WIDTH) m = vf_max(vf_load(lp + v), m);
    float lanes[SIMD_WIDTH];
    vf_store(lanes, m);
    float top = lanes[0];
    for (int i = 0; i < SIMD_WIDTH; i++) {
        if (lanes[i] != lanes[i]) return lanes[i];
        if (lanes[i] > top) top = lanes[i];
    }
    return top;
}
#endif

/* index of the largest of x[from..to-1], the first one on ties, by
   llama2.c's loop: a NaN is passed over, unless it is x[from] (then from) */
static int argmax_plain(const float *x, int from, int to) {
    int max_i = from;
    float max_p = x[from];
    for (int i = from + 1; i < to; i++)
        if (x[i] > max_p) { max_i = i; max_p = x[i]; }
    return max_i;
}

/* index of the largest value, the first one on ties: argmax_plain's
   answer. Vector builds take the largest of each run of CANDIDATE_RUN values
   (run_max) and run the loop only over the first run whose largest is the
   greatest, then over the values past the last whole run: the first run
   that holds the maximum holds its first place, and no value there is a
   NaN at the run's start. A NaN that run_max reports sends the whole row
   through the loop. (A row of 32000 logits: 16 us to about 1.) */
static int sample_argmax(const float *x, int n) {
#ifdef SIMD_WIDTH
    const int whole = n / CANDIDATE_RUN * CANDIDATE_RUN;
    int run = -1;
    float top = 0.0f;
    for (int v = 0; v < whole; v += CANDIDATE_RUN) {
        float m = run_max(x + v);
        if (m != m) return argmax_plain(x, 0, n);
        if (run < 0 || m > top) {
            run = v;
            top = m;
        }
    }
    if (run >= 0) {
        int max_i = argmax_plain(x, run, run + CANDIDATE_RUN);
        for (int i = whole; i < n; i++)
            if (x[i] > x[max_i]) max_i = i;
        return max_i;
    }
#endif
    return argmax_plain(x, 0, n);
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

/* Sorts a (n) by probability, largest first, equal ones in the order they
   come (the samplers fill `a` in token order, so ties go by token id): the
   order of a stable sort, which glibc's qsort (a merge sort) gives llama2.c
   and the numpy references' stable argsort give the tests. A radix sort on
   the bits of the floats (a non-negative float orders as its bit pattern;
   the complement for largest first), 8 bits a pass from the lowest, each
   pass stable, through tmp (n); a pass where every key has the same digit
   is skipped. Sorting a flat distribution's 32000 tokens this way is ten
   times faster than qsort's comparisons. */
static void sort_by_prob(ProbIndex *a, ProbIndex *tmp, int n) {
    enum { digits = 4 };
    int count[digits][256];
    memset(count, 0, sizeof(count));
    for (int i = 0; i < n; i++) {
        uint32_t key;
        memcpy(&key, &a[i].prob, sizeof(key));
        key = ~key;
        for (int d = 0; d < digits; d++) count[d][(key >> (8 * d)) & 255]++;
    }
    ProbIndex *from = a, *to = tmp;
    for (int d = 0; d < digits; d++) {
        int at = 0, whole = 0;
        for (int v = 0; v < 256; v++) {
            int c = count[d][v];
            whole |= c == n;
            count[d][v] = at;
            at += c;
        }
        if (whole) continue; /* every key has this digit: the order stays */
        for (int i = 0; i < n; i++) {
            uint32_t key;
            memcpy(&key, &from[i].prob, sizeof(key));
            to[count[d][((~key) >> (8 * d)) & 255]++] = from[i];
        }
        ProbIndex *swap = from;
        from = to;
        to = swap;
    }
    if (from != a) memcpy(a, from, (size_t)n * sizeof(ProbIndex));
}

/* Nucleus sampling: draw from the smallest set of most likely tokens whose
   mass exceeds topp. The tokens below cutoff = (1 - topp) / (n - 1) hold less
   than (n - 1) * cutoff = 1 - topp in all, so the others hold more than topp
   and contain that set: only they are sorted. probindex has room for 2n
   (the second half is the sort's scratch). */
static int sample_topp(const float *probabilities, int n, float topp, ProbIndex *probindex, float coin) {
    int n0 = 0;
    const float cutoff = (1.0f - topp) / (n - 1);
    for (int i = 0; i < n; i++)
        if (probabilities[i] >= cutoff) probindex[n0++] = (ProbIndex){probabilities[i], i};
    if (n0 == 0) return sample_argmax(probabilities, n); /* topp < 1/n on a flat distribution */
    sort_by_prob(probindex, probindex + n, n0);
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
    s->probindex = xcalloc(2 * (size_t)vocab_size, sizeof(ProbIndex));
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

/* log sum exp(x - max) over the n logits, in double; *max_val gets the max. */
static double log_normalizer(const float *logits, int n, float *max_val) {
    *max_val = logits[sample_argmax(logits, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - *max_val);
    return log(sum);
}

/* log softmax(logits)[token], in double: log p = x_token - max - log sum exp(x - max) */
static double log_prob(const float *logits, int n, int token) {
    float max_val;
    double log_sum = log_normalizer(logits, n, &max_val);
    return (double)logits[token] - max_val - log_sum;
}

static int is_end_token(const Tokenizer *tok, int token) { return token == tok->bos || is_eos_token(tok, token); }

static const char *end_reason(const Tokenizer *tok, int token) { return token == tok->bos ? "bos" : "eos"; }
/* Generation controls, with the semantics of Hugging Face transformers'
   generate() (version 4.38) where the library has them. Logits processors
   change the scores of the next token from the sequence so far: in greedy
   search and sampling they act on the logits, in beam search on log
   softmax(logits), and the processed values are what beam scores add up, so
   the library's sequences_scores come out. They run in the library's order:
   repetition penalty, no-repeat n-grams, minimum new tokens. Sampling then
   applies the warpers: temperature, top-k, top-p, min-p. */

#define MAX_STOPS 16

/* One request's controls; all zero changes nothing, so a command line or a
   batch request fills in only what it sets (the stop strings are not copied). */
typedef struct {
    int min_new_tokens;       /* BOS and EOS masked before this many new tokens; 0: off */
    float repetition_penalty; /* > 0; 1 (the library's default) or 0: off */
    int no_repeat_ngram_size; /* 0: off */
    int top_k;                /* sampling only; 0: off */
    float min_p;              /* sampling only, in [0, 1]; 0: off */
    int n_stops;
    const char *stops[MAX_STOPS]; /* non-empty texts that end generation */
} Controls;

/* The CTRL penalty (Keskar et al. 2019) as the library applies it: each
   token id present in seq gets score < 0 ? score * p : score / p, once
   however often it occurs (the library gathers all the scores, then writes
   them back). */
static void apply_repetition_penalty(float penalty, const int *seq, int n_seq, float *scores) {
    float *gathered = xcalloc((size_t)n_seq, sizeof(float)); /* (n_seq) */
    for (int i = 0; i < n_seq; i++) {
        float s = scores[seq[i]];
        gathered[i] = s < 0 ? s * penalty : s / penalty;
    }
    for (int i = 0; i < n_seq; i++) scores[seq[i]] = gathered[i];
    free(gathered);
}

/* Masks each token that would complete an n-gram (n = size) already in seq:
   wherever the last size - 1 tokens occurred before, the token that followed. */
static void ban_repeated_ngrams(int size, const int *seq, int n_seq, float *scores) {
    if (n_seq + 1 < size) return;
    const int *tail = seq + n_seq - (size - 1);
    for (int i = 0; i + size <= n_seq; i++)
        if (memcmp(seq + i, tail, (size_t)(size - 1) * sizeof(int)) == 0) scores[seq[i + size - 1]] = -INFINITY;
}

/* Applies the logits processors to `scores` (vocab values) for the next
   token after seq (n_seq tokens, the prompt's BOS first; its last n_new are
   the ones generated so far); the end tokens are the tokenizer's BOS and
   end tokens. */
static void process_logits(const Controls *c, const Tokenizer *tok, const int *seq, int n_seq, int n_new, float *scores) {
    if (c->repetition_penalty > 0.0f && c->repetition_penalty != 1.0f) apply_repetition_penalty(c->repetition_penalty, seq, n_seq, scores);
    if (c->no_repeat_ngram_size > 0) ban_repeated_ngrams(c->no_repeat_ngram_size, seq, n_seq, scores);
    if (n_new < c->min_new_tokens) {
        scores[tok->bos] = -INFINITY;
        for (int i = 0; i < tok->n_end; i++) scores[tok->end[i]] = -INFINITY;
    }
}

/* The k-th largest of x (n values, none NaN, 1 <= k <= n): Hoare's
   quickselect on a copy in `scratch` (n), in linear time on average. */
static float kth_largest(const float *x, int n, int k, float *scratch) {
    memcpy(scratch, x, (size_t)n * sizeof(float));
    int lo = 0, hi = n - 1, want = k - 1; /* its index in descending order */
    while (lo < hi) {
        float pivot = scratch[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) { /* afterwards: [lo, j] >= pivot, (j, i) == pivot, [i, hi] <= pivot */
            while (scratch[i] > pivot) i++;
            while (scratch[j] < pivot) j--;
            if (i <= j) {
                float swap = scratch[i];
                scratch[i++] = scratch[j];
                scratch[j--] = swap;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return pivot;
    }
    return scratch[want];
}

/* Draws from `probabilities` (after temperature) cut by the warpers, in the
   library's order, with llama2.c's coin:
   - top-k keeps the tokens not below the k-th largest probability (ties
     kept, as the library keeps every logit not below the k-th);
   - top-p then keeps llama2.c's nucleus, computed on the top-k tokens'
     renormalized probabilities: the fewest likeliest tokens whose mass
     exceeds topp (the library's rule differs only at the boundary: it keeps
     the tokens whose cumulative mass before them is below topp);
   - min-p keeps those with probability >= min_p times the largest (a ratio,
     so renormalizing first changes nothing).
   The kept tokens are walked from the likeliest with r = coin * their mass.
   Only the tokens that can survive are sorted (probindex: room for 2n, as
   sample_topp's): those above the k-th
   probability, the nucleus cutoff of sample_topp() or the min-p bound. */
static int sample_truncated(const float *probabilities, int n, int top_k, float topp, float min_p, ProbIndex *probindex,
                            float coin) {
    float floor_p = 0.0f;
    if (top_k > 0 && top_k < n) {
        float *scratch = xcalloc((size_t)n, sizeof(float)); /* (n) */
        floor_p = kth_largest(probabilities, n, top_k, scratch);
        free(scratch);
    }
    int use_topp = topp > 0 && topp < 1, n_kept = 0;
    float mass = 0.0f, max_p = probabilities[sample_argmax(probabilities, n)];
    for (int i = 0; i < n; i++)
        if (probabilities[i] >= floor_p) { mass += probabilities[i]; n_kept++; }
    if (floor_p == 0.0f) mass = 1.0f; /* no top-k: the softmax sums to 1, as sample_topp() assumes */
    float bound = floor_p;
    if (use_topp && n_kept > 1) bound = fmaxf(bound, mass * (1.0f - topp) / (n_kept - 1));
    if (!use_topp && min_p > 0) bound = fmaxf(bound, min_p * max_p);
    int n0 = 0;
    for (int i = 0; i < n; i++)
        if (probabilities[i] >= bound) probindex[n0++] = (ProbIndex){probabilities[i], i};
    if (n0 == 0) return sample_argmax(probabilities, n);
    sort_by_prob(probindex, probindex + n, n0);
    int last = n0 - 1;
    if (use_topp) {
        float cumulative = 0.0f;
        for (int i = 0; i < n0; i++) {
            cumulative += probindex[i].prob;
            if (cumulative > topp * mass) { last = i; break; }
        }
    }
    while (last > 0 && probindex[last].prob < min_p * probindex[0].prob) last--;
    float kept = 0.0f;
    for (int i = 0; i <= last; i++) kept += probindex[i].prob;
    float r = coin * kept, cdf = 0.0f;
    for (int i = 0; i <= last; i++) {
        cdf += probindex[i].prob;
        if (r < cdf) return probindex[i].index;
    }
    return probindex[last].index;
}

/* sample() with the warpers of `c`; with top-k and min-p off it is sample()
   itself, so the output stays llama2.c's. Greedy (temperature 0) takes the
   largest logit: the library applies no warpers without sampling. */
static int sample_with_controls(Sampler *s, const Controls *c, float *logits) {
    if (c->top_k == 0 && c->min_p == 0.0f) return sample(s, logits);
    if (s->temperature == 0.0f) return sample_argmax(logits, s->vocab_size);
    if (!isfinite(logits[sample_argmax(logits, s->vocab_size)] / s->temperature)) return sample_argmax(logits, s->vocab_size);
    for (int q = 0; q < s->vocab_size; q++) logits[q] /= s->temperature;
    softmax(logits, s->vocab_size);
    float coin = random_f32(&s->rng_state);
    return sample_truncated(logits, s->vocab_size, c->top_k, s->topp, c->min_p, s->probindex, coin);
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
   and why it ended ("bos", "eos", "length", "interrupted" (Ctrl-C),
   "string": stop_string appeared in its text, the token that completed it
   included; under a JSON schema (6.1) "json": the value is complete, or
   "constraint": no token could go on with it). */
typedef struct {
    int *tokens;
    int n_tokens;
    double score;
    const char *stop;
    const char *stop_string; /* NULL unless stop is "string" */
} Hypothesis;

static void free_hypothesis(Hypothesis *h) {
    free(h->tokens);
    memset(h, 0, sizeof(*h));
}

/* A hypothesis holding a copy of the first n of `tokens`. */
static Hypothesis make_hypothesis(const int *tokens, int n, const char *stop) {
    Hypothesis h = {xcalloc((size_t)n + 1, sizeof(int)), n, 0.0, stop, NULL};
    if (n > 0) memcpy(h.tokens, tokens, (size_t)n * sizeof(int));
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
   log-probabilities logprobs[b] (vocab values). Once k are held, vector
   builds pass over a run of CANDIDATE_RUN tokens whose best score (the sum
   with the largest log-probability: rounding is monotonic) does not beat
   the k-th, as every one of them would be passed over. */
static int top_candidates(const float *beam_scores, float *const *logprobs, int n_beams, int vocab, Candidate *best, int k) {
    int n = 0;
    for (int b = 0; b < n_beams; b++) {
        const float *lp = logprobs[b];
        for (int v = 0; v < vocab; v++) {
#ifdef SIMD_WIDTH
            if (n == k && v % CANDIDATE_RUN == 0 && v + CANDIDATE_RUN <= vocab && beam_scores[b] + run_max(lp + v) <= best[k - 1].score) {
                v += CANDIDATE_RUN - 1;
                continue;
            }
#endif
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

/* Ranks twice as many continuations as the n in *cand (all of them at
   most), in a grown buffer; the first n stay as they were. Returns the count. */
static int more_candidates(const float *beam_scores, float *const *logprobs, int n_beams, int vocab, Candidate **cand, int n) {
    int k = 2 * n < n_beams * vocab ? 2 * n : n_beams * vocab;
    Candidate *grown = realloc(*cand, (size_t)k * sizeof(Candidate));
    if (!grown) die(EXIT_BAD_FILE, "out of memory (%d beam candidates)", k);
    *cand = grown;
    return top_candidates(beam_scores, logprobs, n_beams, vocab, grown, k);
}

/* out = log softmax(x) = x - max - log sum exp(x - max), in float32, the
   sum in double; vector builds take e^x by vf_exp, SIMD_WIDTH values at a
   time added up by vf_sum before they join the sum (a beam search step
   takes it of every beam's row of the vocabulary). */
static void log_softmax(float *out, const float *x, int n) {
    float max_val = x[sample_argmax(x, n)];
    double sum = 0.0;
    int i = 0;
#ifdef SIMD_WIDTH
    for (const vfloat minus_max = vf_set(-max_val); i + SIMD_WIDTH <= n; i += SIMD_WIDTH) sum += vf_sum(vf_exp(vf_add(vf_load(x + i), minus_max)));
#endif
    for (; i < n; i++) sum += expf(x[i] - max_val);
    float log_sum = (float)log(sum);
    for (int i = 0; i < n; i++) out[i] = (x[i] - max_val) - log_sum;
}

/* ---- Text: what a continuation prints, and stop strings ------------------ */

/* The printable text of `tokens` as generate prints it, the first one
   decoded after `prev_token`. The caller frees it. */
static char *decode_text(const Tokenizer *tok, int prev_token, const int *tokens, int n) {
    size_t cap = 1, len = 0;
    for (int i = 0; i < n; i++) cap += strlen(tok->vocab[tokens[i]]) + 1;
    char *text = xcalloc(cap, 1);
    for (int i = 0; i < n; i++) {
        const char *piece = decode(tok, prev_token, tokens[i]);
        if (piece_is_printable(tok, piece)) {
            size_t piece_len = strlen(piece);
            memcpy(text + len, piece, piece_len);
            len += piece_len;
        }
        prev_token = tokens[i];
    }
    return text;
}

/* Stop strings: generation ends when its printed text (the prompt not
   included) would contain one of the strings. The text is watched as it
   grows; a StopMatcher holds back only its end that could still become a
   stop string, so streamed text is printed as soon as it cannot be part of
   one, and the stop string itself never is. */
typedef struct {
    const Controls *c;
    char *held;          /* (cap) the text not yet released, NUL-terminated */
    size_t n_held, cap;
    size_t released;     /* bytes at the start of held that the last feed released */
    const char *matched; /* the stop string found; NULL while none */
} StopMatcher;

static StopMatcher stop_matcher(const Controls *c) { return (StopMatcher){c, xcalloc(1, 1), 0, 1, 0, NULL}; }

static void free_stop_matcher(StopMatcher *m) { free(m->held); }

/* The length of the longest end of text (n bytes) that begins a stop string. */
static size_t partial_stop_length(const Controls *c, const char *text, size_t n) {
    size_t best = 0;
    for (int s = 0; s < c->n_stops; s++) {
        size_t len = strlen(c->stops[s]);
        for (size_t k = len - 1 < n ? len - 1 : n; k > best; k--)
            if (memcmp(text + n - k, c->stops[s], k) == 0) { best = k; break; }
    }
    return best;
}

/* Adds a printable piece to the text. Returns the text that is now safe to
   print (*n_safe bytes, valid until the next call): everything before the
   first stop string when one appeared (m->matched names it; the earliest in
   the text, the first listed among those that start at the same byte), else
   all but the held-back end. */
static const char *stop_feed(StopMatcher *m, const char *piece, size_t *n_safe) {
    m->n_held -= m->released;
    memmove(m->held, m->held + m->released, m->n_held + 1);
    size_t len = strlen(piece);
    if (m->n_held + len + 1 > m->cap) {
        m->cap = 2 * (m->n_held + len + 1);
        char *grown = realloc(m->held, m->cap);
        if (!grown) die(EXIT_BAD_FILE, "out of memory (%zu bytes)", m->cap);
        m->held = grown;
    }
    memcpy(m->held + m->n_held, piece, len + 1);
    m->n_held += len;
    const char *first = NULL;
    for (int s = 0; s < m->c->n_stops; s++) {
        const char *at = strstr(m->held, m->c->stops[s]);
        if (at && (!first || at < first)) { first = at; m->matched = m->c->stops[s]; }
    }
    m->released = first ? (size_t)(first - m->held) : m->n_held - partial_stop_length(m->c, m->held, m->n_held);
    *n_safe = m->released;
    return m->held;
}

/* The text still held back once generation has ended without a stop string
   (*n bytes). */
static const char *stop_rest(const StopMatcher *m, size_t *n) {
    *n = m->matched ? 0 : m->n_held - m->released;
    return m->held + m->released;
}

/* The stop string that the text of `tokens` (n, decoded after prev_token)
   followed by `next` contains, or NULL: beam search asks this of each
   candidate (whose own text has none). */
static const char *continuation_stop(const Controls *c, const Tokenizer *tok, int prev_token, const int *tokens, int n, int next) {
    if (c->n_stops == 0) return NULL;
    char *text = decode_text(tok, prev_token, tokens, n);
    StopMatcher m = stop_matcher(c);
    size_t n_safe;
    stop_feed(&m, text, &n_safe);
    const char *piece = decode(tok, n > 0 ? tokens[n - 1] : prev_token, next);
    if (!m.matched && piece_is_printable(tok, piece)) stop_feed(&m, piece, &n_safe);
    const char *matched = m.matched;
    free_stop_matcher(&m);
    free(text);
    return matched;
}

/* The text of a hypothesis as printed: its tokens decoded after
   last_prompt_token, cut before its stop string. The caller frees it. */
static char *hypothesis_text(const Tokenizer *tok, const Hypothesis *h, int last_prompt_token) {
    char *text = decode_text(tok, last_prompt_token, h->tokens, h->n_tokens);
    char *at = h->stop_string ? strstr(text, h->stop_string) : NULL;
    if (at) *at = '\0';
    return text;
}

/* ---- 6.1 JSON constraints: answers that are JSON, or valid under a schema --
   A request may ask for an answer that is one JSON value: any JSON object
   (--json, response_format "json_object") or a value valid under a JSON
   schema (--json-schema, "json_schema"). The schema, untrusted input, is
   parsed (bounded nesting; every error one line naming the keyword or the
   problem) and compiled to nodes, one per sub-schema, for this subset:
   "type" (a name or a list), "properties", "required",
   "additionalProperties" (true or false), "enum", "const", "items",
   "minItems"/"maxItems", "minLength"/"maxLength", "minimum"/"maximum" (of
   integers), "anyOf", "$ref" to "#", "#/$defs/NAME" or
   "#/definitions/NAME"; annotations (title, description, default, ...) are
   read past; any other keyword is refused by name.
   The answer is read byte by byte by a pushdown automaton: a stack of
   frames, one per value being written (an object, an array, a string, a
   number, a literal from a fixed list), each knowing what may come next. An
   "anyOf" is read as several stacks at once, one per branch still possible.
   The answer has no white space between its tokens (JSON allows none), so a
   schema whose strings, arrays and numbers are bounded bounds the answer;
   numbers have at most JSON_MAX_DIGITS digits before and after the point
   and 3 in the exponent; object keys outside "properties" are printable
   ASCII without escapes; strings are well-formed UTF-8. Each of these only
   narrows what may be written: whatever is written is valid.
   The mask: before the processors and the sampler see a step's logits,
   every token whose bytes would not keep the text a prefix of a valid
   answer gets -inf, and the end tokens get -inf unless the value is
   complete; so greedy search, sampling and every control choose among the
   allowed tokens. The vocabulary is walked as a trie of the tokens' bytes
   (built once per tokenizer), carrying the automaton's state down it, so a
   byte that fails prunes every token that starts with the bytes so far.
   Once the value is complete and nothing can extend it, the answer ends
   (stop "json"). */

#define SCHEMA_MAX_NESTING 64 /* nesting of the schema's JSON text */
#define SCHEMA_MAX_PROPS 64   /* properties of one object (a bit each) */
#define JSON_MAX_DEPTH 24     /* values nested in an answer, at most */
#define JSON_MAX_ALTS 8       /* readings (anyOf branches) held at once; more are dropped */
#define JSON_MAX_BRANCHES 64  /* alternatives one value may open (nested anyOf), at most */
#define JSON_MAX_DIGITS 18    /* digits before (and after) a number's point; |integers| < 10^18 */
#define NUMBER_SCALE_DIGITS 6 /* a bounded number: at most 6 digits after the point, */
#define NUMBER_INT_DIGITS 12  /* 12 before it, and no exponent, so its millionths fit an int64 */

enum { JT_OBJECT = 1, JT_ARRAY = 2, JT_STRING = 4, JT_INTEGER = 8, JT_NUMBER = 16, JT_BOOLEAN = 32, JT_NULL = 64, JT_ALL = 127 };

/* A property of an object node: its name as the answer writes it (the JSON
   string's bytes between the quotes) and the node of its value. */
typedef struct {
    char *name;
    int len, node;
} SchemaProp;

/* One sub-schema. Node 0 is any JSON value. */
typedef struct {
    int types;                /* JT_* bits allowed */
    SchemaProp *props;        /* (n_props) sorted by name (strcmp) */
    int n_props;
    int closed;               /* additionalProperties: false */
    uint64_t required;        /* bit i: props[i] is required */
    int items;                /* the node of an array's items */
    int min_items, max_items, min_len, max_len;
    long long minimum, maximum; /* of integers; of numbers in millionths (NUMBER_SCALE), when `bounded` */
    int bounded;              /* a number with minimum, maximum or their exclusive forms */
    char **lits;              /* (n_lits) enum/const: the values as compact JSON texts, sorted (strcmp) */
    int n_lits;
    int *any;                 /* (n_any) anyOf: the branches' nodes; 0 branches: not an anyOf */
    int n_any;
} SchemaNode;

typedef struct JsonSchema {
    SchemaNode *nodes;        /* (n_nodes) */
    int n_nodes, cap_nodes;
} JsonSchema;

static void free_schema(JsonSchema *s) {
    if (!s) return;
    for (int i = 0; i < s->n_nodes; i++) {
        SchemaNode *n = &s->nodes[i];
        for (int k = 0; k < n->n_props; k++) free(n->props[k].name);
        for (int k = 0; k < n->n_lits; k++) free(n->lits[k]);
        free(n->props); free(n->lits); free(n->any);
    }
    free(s->nodes);
    free(s);
}

/* -- The schema's JSON text, parsed into a tree -- */

/* From section 10, which reads JSON for --batch and the server. */
static int hex_value(char c);
static long json_hex4(const char *p, const char *end);


typedef enum { JV_NULL, JV_FALSE, JV_TRUE, JV_NUMBER, JV_STRING, JV_ARRAY, JV_OBJECT } JvKind;

/* A value of the tree; values are numbered in the order they start. */
typedef struct {
    JvKind kind;
    int key;         /* a member of an object: its name's offset in chars; else -1 */
    int text;        /* a string: its bytes' offset in chars (NUL-terminated); a number: its spelling's */
    int first, next; /* first child and next sibling; -1: none */
    int n;           /* children */
} Jv;

/* The parse and the compilation of one schema: errors longjmp to `fail`
   with the message in err. */
typedef struct {
    const char *p, *end;
    Jv *v;
    int n_v, cap_v;
    char *chars;     /* the strings decoded and the numbers' spellings, each NUL-terminated */
    int n_chars;
    jmp_buf fail;
    char *err;
    size_t err_len;
    JsonSchema *s;
    int root;        /* the schema's value */
    int defs;        /* the root's "$defs" or "definitions" object; -1: none */
    int *def_node;   /* (n_v) the node compiled for a definition's value; -1: not yet */
    int depth;       /* sub-schemas being compiled, $refs followed included */
    int strict;      /* response_format's "strict": true: every object closed, every property required */
} SchemaCompiler;

static void schema_fail(SchemaCompiler *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->err_len, fmt, ap);
    va_end(ap);
    for (char *p = c->err; *p; p++) /* names quoted from the schema stay on the line */
        if ((unsigned char)*p < 0x20) *p = '?';
    longjmp(c->fail, 1);
}

static void jv_space(SchemaCompiler *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n')) c->p++;
}

/* A JSON string at the cursor (after its quote), decoded into chars;
   returns its offset. \u0000 is refused (names are C strings). */
static int jv_string(SchemaCompiler *c) {
    int at = c->n_chars;
    char *o = c->chars + at;
    for (;;) {
        if (c->p >= c->end) schema_fail(c, "a string has no closing quote");
        unsigned char ch = (unsigned char)*c->p++;
        if (ch == '"') break;
        if (ch < 0x20) schema_fail(c, "a control character inside a string must be escaped");
        if (ch != '\\') { *o++ = (char)ch; continue; }
        char e = c->p < c->end ? *c->p++ : '\0';
        const char *plain = e ? strchr("\"\\/bfnrt", e) : NULL;
        if (plain) { *o++ = "\"\\/\b\f\n\r\t"[plain - "\"\\/bfnrt"]; continue; }
        long cp = e == 'u' ? json_hex4(c->p, c->end) : -1;
        if (cp < 0) schema_fail(c, "bad escape in a string");
        c->p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF && c->end - c->p >= 6 && c->p[0] == '\\' && c->p[1] == 'u') {
            long lo = json_hex4(c->p + 2, c->end);
            if (lo >= 0xDC00 && lo <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                c->p += 6;
            }
        }
        if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) schema_fail(c, "a \\u escape is NUL or a lone surrogate");
        o += encode_utf8((int)cp, o);
    }
    *o++ = '\0';
    c->n_chars = (int)(o - c->chars);
    return at;
}

/* The length of the JSON number at p (RFC 8259 grammar; e: the text's end), or 0. */
static size_t json_number_span(const char *start, const char *e) {
    const char *p = start;
    if (p < e && *p == '-') p++;
    if (p < e && *p == '0') p++;
    else if (p < e && *p >= '1' && *p <= '9') while (p < e && isdigit((unsigned char)*p)) p++;
    else return 0;
    if (p < e && *p == '.') {
        if (++p >= e || !isdigit((unsigned char)*p)) return 0;
        while (p < e && isdigit((unsigned char)*p)) p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || !isdigit((unsigned char)*p)) return 0;
        while (p < e && isdigit((unsigned char)*p)) p++;
    }
    return (size_t)(p - start);
}

/* The value at the cursor, `nesting` levels deep; returns its number. */
static int jv_value(SchemaCompiler *c, int nesting) {
    if (nesting > SCHEMA_MAX_NESTING) schema_fail(c, "the schema is nested more than %d levels deep", SCHEMA_MAX_NESTING);
    jv_space(c);
    if (c->p >= c->end) schema_fail(c, "the schema ends where a value was expected");
    int at = c->n_v++; /* cap_v: one per byte of text, and a value takes one at least */
    Jv *v = &c->v[at];
    *v = (Jv){JV_NULL, -1, -1, -1, -1, 0};
    char ch = *c->p;
    if (ch == '{' || ch == '[') {
        int object = ch == '{', last = -1;
        v->kind = object ? JV_OBJECT : JV_ARRAY;
        c->p++;
        jv_space(c);
        if (c->p < c->end && *c->p == (object ? '}' : ']')) { c->p++; return at; }
        for (;;) {
            int key = -1;
            if (object) {
                if (c->p >= c->end || *c->p != '"') schema_fail(c, "expected a member name in quotes");
                c->p++;
                key = jv_string(c);
                jv_space(c);
                if (c->p >= c->end || *c->p != ':') schema_fail(c, "expected ':' after a member name");
                c->p++;
            }
            int child = jv_value(c, nesting + 1);
            c->v[child].key = key;
            if (last < 0) c->v[at].first = child;
            else c->v[last].next = child;
            last = child;
            c->v[at].n++;
            jv_space(c);
            if (c->p < c->end && *c->p == ',') { c->p++; jv_space(c); continue; }
            if (c->p < c->end && *c->p == (object ? '}' : ']')) { c->p++; return at; }
            schema_fail(c, object ? "expected ',' or '}' in an object" : "expected ',' or ']' in a list");
        }
    }
    if (ch == '"') {
        c->p++;
        v->kind = JV_STRING;
        v->text = jv_string(c);
        return at;
    }
    static const struct { const char *word; JvKind kind; } words[] = {{"true", JV_TRUE}, {"false", JV_FALSE}, {"null", JV_NULL}};
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++) {
        size_t n = strlen(words[i].word);
        if ((size_t)(c->end - c->p) >= n && memcmp(c->p, words[i].word, n) == 0) {
            c->p += n;
            v->kind = words[i].kind;
            return at;
        }
    }
    size_t n = json_number_span(c->p, c->end);
    if (n == 0) schema_fail(c, "not a JSON value");
    v->kind = JV_NUMBER;
    v->text = c->n_chars;
    memcpy(c->chars + c->n_chars, c->p, n);
    c->n_chars += (int)n + 1; /* chars is zeroed: the NUL is there */
    c->p += n;
    return at;
}

/* -- Compiling -- */

static const char *jv_str(const SchemaCompiler *c, int v) { return c->chars + c->v[v].text; }
static const char *jv_key(const SchemaCompiler *c, int v) { return c->chars + c->v[v].key; }

/* The member `name` of object v, or -1. */
static int jv_member(const SchemaCompiler *c, int v, const char *name) {
    for (int m = c->v[v].first; m >= 0; m = c->v[m].next)
        if (strcmp(jv_key(c, m), name) == 0) return m;
    return -1;
}

static int new_node(SchemaCompiler *c) {
    JsonSchema *s = c->s;
    if (s->n_nodes == s->cap_nodes) {
        s->cap_nodes = s->cap_nodes ? 2 * s->cap_nodes : 16;
        SchemaNode *grown = realloc(s->nodes, (size_t)s->cap_nodes * sizeof(SchemaNode));
        if (!grown) die(EXIT_BAD_FILE, "out of memory (schema of %d nodes)", s->cap_nodes);
        s->nodes = grown;
    }
    s->nodes[s->n_nodes] = (SchemaNode){.types = JT_ALL, .max_items = INT_MAX, .max_len = INT_MAX,
                                        .minimum = -999999999999999999LL, .maximum = 999999999999999999LL};
    return s->n_nodes++;
}

/* Appends `s` (n bytes) to out as JSON string content: quotes, backslashes
   and control characters escaped, everything else as it is. */
static void escape_json_into(ByteBuf *out, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *named = ch == '"' ? "\\\"" : ch == '\\' ? "\\\\" : ch == '\n' ? "\\n" : ch == '\t' ? "\\t" : ch == '\r' ? "\\r" : NULL;
        if (named) buf_str(out, named);
        else if (ch < 0x20) buf_printf(out, "\\u%04x", ch);
        else buf_add(out, (const char *)&ch, 1);
    }
}

/* Value v as compact JSON text (numbers as spelled) into out. */
static void jv_write(const SchemaCompiler *c, int v, ByteBuf *out) {
    const Jv *x = &c->v[v];
    switch (x->kind) {
    case JV_NULL: buf_str(out, "null"); break;
    case JV_FALSE: buf_str(out, "false"); break;
    case JV_TRUE: buf_str(out, "true"); break;
    case JV_NUMBER: buf_str(out, jv_str(c, v)); break;
    case JV_STRING:
        buf_str(out, "\"");
        escape_json_into(out, jv_str(c, v), strlen(jv_str(c, v)));
        buf_str(out, "\"");
        break;
    default: {
        int object = x->kind == JV_OBJECT;
        buf_str(out, object ? "{" : "[");
        for (int m = x->first; m >= 0; m = c->v[m].next) {
            if (m != x->first) buf_str(out, ",");
            if (object) {
                buf_str(out, "\"");
                escape_json_into(out, jv_key(c, m), strlen(jv_key(c, m)));
                buf_str(out, "\":");
            }
            jv_write(c, m, out);
        }
        buf_str(out, object ? "}" : "]");
    }
    }
}

/* The code points of a UTF-8 string. */
static int utf8_length(const char *s) {
    int n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* x (a JSON number's text) times 10^scale, rounded up (round_up) or down
   to an integer, exactly (decimal digits, no floating point): *out. Returns
   0 when its magnitude reaches 10^18. */
static int decimal_scaled(const char *x, int scale, int round_up, long long *out) {
    int negative = *x == '-', n = 0, point = -1, rest = 0;
    const char *p = x + negative, *q = p;
    for (; (*q >= '0' && *q <= '9') || *q == '.'; q++) {
        if (*q == '.') point = n;
        else n++;
    }
    if (point < 0) point = n;
    long exp = *q == 'e' || *q == 'E' ? strtol(q + 1, NULL, 10) : 0;
    if (exp < -100) exp = -100; /* every digit is below the point either way */
    if (exp > 40) exp = 40;     /* too large, unless every digit is 0 */
    long whole = point + exp + scale, i = 0; /* the leading digits that make the integer */
    long long v = 0;
    for (; p < q; p++) {
        if (*p == '.') continue;
        if (i++ >= whole) { rest |= *p != '0'; continue; }
        if (v >= 100000000000000000LL) return 0;
        v = v * 10 + (*p - '0');
    }
    for (; i < whole; i++) {
        if (v >= 100000000000000000LL) return 0;
        v *= 10;
    }
    if (rest && round_up != negative) v++; /* up for a positive value, down (toward -inf) for a negative one */
    *out = negative ? -v : v;
    return 1;
}

/* Whether value v is allowed by node nd's type and bounds (enum and const
   values are kept only if so). */
static int literal_fits(const SchemaCompiler *c, const SchemaNode *nd, int v) {
    const Jv *x = &c->v[v];
    switch (x->kind) {
    case JV_NULL: return (nd->types & JT_NULL) != 0;
    case JV_TRUE: case JV_FALSE: return (nd->types & JT_BOOLEAN) != 0;
    case JV_STRING: {
        int n = utf8_length(jv_str(c, v));
        return (nd->types & JT_STRING) && n >= nd->min_len && n <= nd->max_len;
    }
    case JV_ARRAY: return (nd->types & JT_ARRAY) && x->n >= nd->min_items && x->n <= nd->max_items;
    case JV_OBJECT: return (nd->types & JT_OBJECT) != 0;
    case JV_NUMBER: {
        long long lo, hi;
        if (nd->types & JT_NUMBER) /* a literal the automaton writes: exact in millionths, in range */
            return !nd->bounded || (decimal_scaled(jv_str(c, v), NUMBER_SCALE_DIGITS, 1, &lo) &&
                                    decimal_scaled(jv_str(c, v), NUMBER_SCALE_DIGITS, 0, &hi) && lo == hi &&
                                    lo >= nd->minimum && lo <= nd->maximum);
        return (nd->types & JT_INTEGER) && decimal_scaled(jv_str(c, v), 0, 1, &lo) && decimal_scaled(jv_str(c, v), 0, 0, &hi) &&
               lo == hi && lo >= nd->minimum && lo <= nd->maximum;
    }
    }
    return 0;
}

static void compile_into(SchemaCompiler *c, int v, int at);
static int compile_node(SchemaCompiler *c, int v);

/* The node a "$ref" names. */
static int resolve_ref(SchemaCompiler *c, const char *ref) {
    if (strcmp(ref, "#") == 0) return 1; /* the root's node */
    const char *name = NULL;
    if (strncmp(ref, "#/$defs/", 8) == 0) name = ref + 8;
    else if (strncmp(ref, "#/definitions/", 14) == 0) name = ref + 14;
    if (!name) schema_fail(c, "$ref: only \"#\", \"#/$defs/NAME\" and \"#/definitions/NAME\" are supported, got \"%.60s\"", ref);
    int m = c->defs >= 0 ? jv_member(c, c->defs, name) : -1;
    if (m < 0) schema_fail(c, "$ref: \"%.60s\" names no definition", ref);
    if (c->def_node[m] < 0) { /* numbered first: a definition may refer to itself */
        c->def_node[m] = new_node(c);
        compile_into(c, m, c->def_node[m]);
    }
    return c->def_node[m];
}

/* A non-negative integer keyword's value. */
static int count_value(SchemaCompiler *c, int v, const char *keyword) {
    double d = c->v[v].kind == JV_NUMBER ? strtod(jv_str(c, v), NULL) : -1;
    if (!(d >= 0 && d == floor(d) && d <= INT_MAX)) schema_fail(c, "%s: must be a non-negative integer", keyword);
    return (int)d;
}

/* Whether `key` is an annotation (read past: it asserts nothing). */
static int is_annotation(const char *key) {
    static const char *const names[] = {"title", "description", "$schema", "$id", "$comment", "default", "examples",
                                        "deprecated", "readOnly", "writeOnly"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(key, names[i]) == 0) return 1;
    return 0;
}

static int compare_props(const void *a, const void *b) {
    return strcmp(((const SchemaProp *)a)->name, ((const SchemaProp *)b)->name);
}

static int compare_strings(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* "type": a name or a list of names, as JT_* bits. */
static int type_bits(SchemaCompiler *c, int v) {
    static const char *const names[] = {"object", "array", "string", "integer", "number", "boolean", "null"};
    int bits = 0, single = c->v[v].kind == JV_STRING;
    if (!single && c->v[v].kind != JV_ARRAY) schema_fail(c, "type: must be a type name or a list of them");
    for (int t = single ? v : c->v[v].first; t >= 0; t = single ? -1 : c->v[t].next) {
        int bit = 0;
        for (int i = 0; i < 7 && c->v[t].kind == JV_STRING; i++)
            if (strcmp(jv_str(c, t), names[i]) == 0) bit = 1 << i;
        if (!bit) schema_fail(c, "type: unknown type %s", c->v[t].kind == JV_STRING ? jv_str(c, t) : "(not a string)");
        bits |= bit;
    }
    if (!bits) schema_fail(c, "type: an empty list admits no value");
    return bits;
}

/* The literals of "enum" (a list) or "const" (one value) into node at. */
static void add_literals(SchemaCompiler *c, int at, int v, int is_enum) {
    if (is_enum && c->v[v].kind != JV_ARRAY) schema_fail(c, "enum: must be a list");
    int n = is_enum ? c->v[v].n : 1;
    if (n == 0) schema_fail(c, "enum: an empty list admits no value");
    SchemaNode *nd = &c->s->nodes[at];
    if (nd->lits) schema_fail(c, "enum and const together are not supported");
    nd->lits = xcalloc((size_t)n, sizeof(char *));
    for (int m = is_enum ? c->v[v].first : v; m >= 0 && nd->n_lits < n; m = is_enum ? c->v[m].next : -1) {
        ByteBuf b = {0};
        jv_write(c, m, &b);
        nd->lits[nd->n_lits++] = b.data;
    }
}

/* Whether key is one of the numeric bounds. */
static int is_bound_keyword(const char *key) {
    return strcmp(key, "minimum") == 0 || strcmp(key, "maximum") == 0 || strcmp(key, "exclusiveMinimum") == 0 ||
           strcmp(key, "exclusiveMaximum") == 0;
}

/* The bounds of node nd (from value v): of an integer, as integers; of a
   number, in millionths, rounded inward (a bound with more digits keeps the
   numbers strictly inside it), and such a number is written with at most
   NUMBER_SCALE_DIGITS after its point, NUMBER_INT_DIGITS before, and no
   exponent: whatever is written is in range. */
static void set_bounds(SchemaCompiler *c, SchemaNode *nd, int v) {
    static const char *const keys[] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    int real = (nd->types & JT_NUMBER) != 0, scale = real ? NUMBER_SCALE_DIGITS : 0;
    for (int k = 0; k < 4; k++) {
        int m = jv_member(c, v, keys[k]);
        if (m < 0) continue;
        if (!(nd->types & (JT_INTEGER | JT_NUMBER))) schema_fail(c, "%s: applies to \"type\": \"integer\" or \"number\"", keys[k]);
        int lower = k < 2, exclusive = k % 2;
        long long b;
        /* a lower bound rounds up, an upper one down; an exclusive one then steps inward when it was exact */
        if (!decimal_scaled(jv_str(c, m), scale, lower, &b))
            schema_fail(c, "%s: must be below 10^%d in magnitude", keys[k], real ? 12 : 18);
        long long other;
        decimal_scaled(jv_str(c, m), scale, !lower, &other);
        if (exclusive && b == other) b += lower ? 1 : -1;
        if (lower && b > nd->minimum) nd->minimum = b;
        if (!lower && b < nd->maximum) nd->maximum = b;
        nd->bounded = real;
    }
    if (nd->minimum > nd->maximum) schema_fail(c, "minimum is greater than maximum (no value is allowed)");
}

/* Checks what the keywords of node `at` (from value v) say together. */
static void check_node(SchemaCompiler *c, int at, int v, int required) {
    SchemaNode *nd = &c->s->nodes[at];
    if (c->strict && (nd->types & JT_OBJECT) && !nd->n_any) { /* OpenAI's strict mode: objects closed */
        int extra = jv_member(c, v, "additionalProperties");
        if (extra >= 0 && c->v[extra].kind == JV_TRUE)
            schema_fail(c, "additionalProperties: true cannot be \"strict\" (strict objects are closed)");
        nd->closed = 1;
    }
    if (nd->n_any && c->v[v].n > 1) {
        for (int m = c->v[v].first; m >= 0; m = c->v[m].next)
            if (!is_annotation(jv_key(c, m)) && strcmp(jv_key(c, m), "anyOf") != 0 && strcmp(jv_key(c, m), "$ref") != 0 &&
                strcmp(jv_key(c, m), "$defs") != 0 && strcmp(jv_key(c, m), "definitions") != 0)
                schema_fail(c, "%s: not supported beside anyOf or $ref (put it in each branch)", jv_key(c, m));
        if (jv_member(c, v, "anyOf") >= 0 && jv_member(c, v, "$ref") >= 0) schema_fail(c, "anyOf and $ref together are not supported");
    }
    if (nd->types & JT_NUMBER) nd->types &= ~JT_INTEGER; /* numbers include the integers */
    set_bounds(c, nd, v);
    if (nd->min_items > nd->max_items) schema_fail(c, "minItems is greater than maxItems");
    if (nd->min_len > nd->max_len) schema_fail(c, "minLength is greater than maxLength");
    if (required >= 0) {
        if (c->v[required].kind != JV_ARRAY) schema_fail(c, "required: must be a list of names");
        for (int m = c->v[required].first; m >= 0; m = c->v[m].next) {
            if (c->v[m].kind != JV_STRING) schema_fail(c, "required: must be a list of names");
            ByteBuf name = {0};
            escape_json_into(&name, jv_str(c, m), strlen(jv_str(c, m)));
            int found = -1;
            for (int k = 0; k < nd->n_props; k++)
                if (strcmp(nd->props[k].name, name.data ? name.data : "") == 0) found = k;
            if (found < 0 && nd->closed) {
                free(name.data);
                schema_fail(c, "required: \"%.60s\" is not among the properties, and additionalProperties is false", jv_str(c, m));
            }
            if (found < 0) { /* required but free: a property of any value */
                if (nd->n_props == SCHEMA_MAX_PROPS) { free(name.data); schema_fail(c, "properties: more than %d", SCHEMA_MAX_PROPS); }
                nd->props = realloc(nd->props, (size_t)(nd->n_props + 1) * sizeof(SchemaProp));
                if (!nd->props) die(EXIT_BAD_FILE, "out of memory");
                nd->props[nd->n_props] = (SchemaProp){name.data ? name.data : strdup(""), (int)name.n, 0};
                found = nd->n_props++;
            } else {
                free(name.data);
            }
        }
    }
    if (nd->n_props > 1) qsort(nd->props, (size_t)nd->n_props, sizeof(SchemaProp), compare_props);
    for (int k = 1; k < nd->n_props; k++)
        if (strcmp(nd->props[k - 1].name, nd->props[k].name) == 0) schema_fail(c, "properties: \"%.60s\" appears twice", nd->props[k].name);
    if (required >= 0)
        for (int m = c->v[required].first; m >= 0; m = c->v[m].next) {
            ByteBuf name = {0};
            escape_json_into(&name, jv_str(c, m), strlen(jv_str(c, m)));
            for (int k = 0; k < nd->n_props; k++)
                if (strcmp(nd->props[k].name, name.data ? name.data : "") == 0) nd->required |= 1ull << k;
            free(name.data);
        }
    if (nd->closed && c->strict) /* and every property required */
        nd->required = nd->n_props == SCHEMA_MAX_PROPS ? ~0ull : (1ull << nd->n_props) - 1;
    if (nd->lits) {
        int kept = 0;
        if (nd->n_props || jv_member(c, v, "items") >= 0) schema_fail(c, "enum/const beside properties or items is not supported");
        int m = jv_member(c, v, "enum") >= 0 ? c->v[jv_member(c, v, "enum")].first : jv_member(c, v, "const");
        for (int i = 0; i < nd->n_lits; i++, m = c->v[m].next) {
            if (literal_fits(c, nd, m)) nd->lits[kept++] = nd->lits[i];
            else free(nd->lits[i]);
        }
        nd->n_lits = kept;
        if (kept == 0) schema_fail(c, "enum/const: no value fits the other keywords");
        if (nd->n_lits > 1) qsort(nd->lits, (size_t)nd->n_lits, sizeof(char *), compare_strings);
        kept = 1;
        for (int i = 1; i < nd->n_lits; i++) { /* equal values: one is enough */
            if (strcmp(nd->lits[kept - 1], nd->lits[i]) == 0) free(nd->lits[i]);
            else nd->lits[kept++] = nd->lits[i];
        }
        nd->n_lits = kept;
    }
}

/* Compiles schema value v (an object or a boolean) into node `at`. */
static void compile_into(SchemaCompiler *c, int v, int at) {
    if (++c->depth > 4 * SCHEMA_MAX_NESTING) schema_fail(c, "the schema is nested too deeply ($ref included)");
    const Jv *x = &c->v[v];
    if (x->kind == JV_FALSE) schema_fail(c, "the schema false admits no value");
    if (x->kind != JV_TRUE && x->kind != JV_OBJECT) schema_fail(c, "a schema must be an object or true");
    int required = -1;
    static const char *const keywords[] = {"type", "properties", "required", "additionalProperties", "enum", "const", "items",
                                           "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum", "anyOf",
                                           "exclusiveMinimum", "exclusiveMaximum",
                                           "$ref", "$defs", "definitions"};
    unsigned seen = 0;
    for (int m = x->kind == JV_OBJECT ? x->first : -1; m >= 0; m = c->v[m].next) {
        const char *key = jv_key(c, m);
        const Jv *val = &c->v[m];
        if (is_annotation(key)) continue;
        for (unsigned k = 0; k < sizeof(keywords) / sizeof(keywords[0]); k++)
            if (strcmp(key, keywords[k]) == 0) {
                if (seen >> k & 1) schema_fail(c, "%s: appears twice", key);
                seen |= 1u << k;
            }
        if (strcmp(key, "type") == 0) {
            c->s->nodes[at].types = type_bits(c, m);
        } else if (strcmp(key, "properties") == 0) {
            if (val->kind != JV_OBJECT) schema_fail(c, "properties: must be an object");
            if (val->n > SCHEMA_MAX_PROPS) schema_fail(c, "properties: more than %d", SCHEMA_MAX_PROPS);
            SchemaProp *props = xcalloc((size_t)val->n + 1, sizeof(SchemaProp));
            c->s->nodes[at].props = props;
            for (int p = val->first; p >= 0; p = c->v[p].next) {
                ByteBuf name = {0};
                escape_json_into(&name, jv_key(c, p), strlen(jv_key(c, p)));
                SchemaNode *nd = &c->s->nodes[at];
                nd->props[nd->n_props++] = (SchemaProp){name.data ? name.data : strdup(""), (int)name.n, 0};
                int child = compile_node(c, p);
                nd = &c->s->nodes[at];
                nd->props[nd->n_props - 1].node = child;
            }
        } else if (strcmp(key, "required") == 0) {
            required = m;
        } else if (strcmp(key, "additionalProperties") == 0) {
            if (val->kind != JV_TRUE && val->kind != JV_FALSE) schema_fail(c, "additionalProperties: only true or false is supported");
            c->s->nodes[at].closed = val->kind == JV_FALSE;
        } else if (strcmp(key, "enum") == 0 || strcmp(key, "const") == 0) {
            add_literals(c, at, m, key[0] == 'e');
        } else if (strcmp(key, "items") == 0) {
            if (val->kind == JV_ARRAY) schema_fail(c, "items: a list of schemas (tuples) is not supported");
            int child = compile_node(c, m);
            c->s->nodes[at].items = child;
        } else if (strcmp(key, "minItems") == 0) c->s->nodes[at].min_items = count_value(c, m, key);
        else if (strcmp(key, "maxItems") == 0) c->s->nodes[at].max_items = count_value(c, m, key);
        else if (strcmp(key, "minLength") == 0) c->s->nodes[at].min_len = count_value(c, m, key);
        else if (strcmp(key, "maxLength") == 0) c->s->nodes[at].max_len = count_value(c, m, key);
        else if (is_bound_keyword(key)) {
            if (val->kind != JV_NUMBER) schema_fail(c, "%s: must be a number", key);
        } else if (strcmp(key, "anyOf") == 0 || strcmp(key, "$ref") == 0) {
            int is_any = key[0] == 'a', n = is_any ? val->n : 1;
            if (is_any && (val->kind != JV_ARRAY || n == 0)) schema_fail(c, "anyOf: must be a non-empty list of schemas");
            if (!is_any && val->kind != JV_STRING) schema_fail(c, "$ref: must be a string");
            int *any = xcalloc((size_t)n, sizeof(int));
            c->s->nodes[at].any = any;
            for (int b = is_any ? val->first : m; b >= 0 && c->s->nodes[at].n_any < n; b = is_any ? c->v[b].next : -1) {
                int child = is_any ? compile_node(c, b) : resolve_ref(c, jv_str(c, b));
                SchemaNode *nd = &c->s->nodes[at];
                nd->any[nd->n_any++] = child;
            }
        } else if (strcmp(key, "$defs") == 0 || strcmp(key, "definitions") == 0) {
            if (v != c->root) schema_fail(c, "%s: supported at the top of the schema only", key);
        } else {
            schema_fail(c, "unsupported schema keyword '%.60s'", key);
        }
    }
    check_node(c, at, v, required);
    c->depth--;
}

/* Compiles schema value v into a new node; its number. */
static int compile_node(SchemaCompiler *c, int v) {
    int at = new_node(c);
    compile_into(c, v, at);
    return at;
}

/* The schemas that are not anyOf reached from node i through anyOf and $ref
   alone (paths counted; count memoizes, 0: not yet), beyond
   JSON_MAX_BRANCHES: JSON_MAX_BRANCHES + 1. No loop runs through them. */
static int branch_leaves(const JsonSchema *s, int i, int *count, int depth) {
    const SchemaNode *nd = &s->nodes[i];
    if (nd->n_any == 0) return 1;
    if (count[i] > 0) return count[i];
    int n = 0;
    for (int b = 0; b < nd->n_any && n <= JSON_MAX_BRANCHES; b++)
        n += depth > 2 * SCHEMA_MAX_NESTING ? JSON_MAX_BRANCHES + 1 : branch_leaves(s, nd->any[b], count, depth + 1);
    return count[i] = n > JSON_MAX_BRANCHES ? JSON_MAX_BRANCHES + 1 : n;
}

/* Fails when some anyOf (or $ref) leads back to itself through anyOf and
   $ref alone (reading it would never start a value), or opens more than
   JSON_MAX_BRANCHES alternatives at once (each byte would read them all). */
static void check_ref_loops(SchemaCompiler *c) {
    const JsonSchema *s = c->s;
    unsigned char *mark = xcalloc((size_t)s->n_nodes, 1); /* 0 new, 1 on the path, 2 done */
    int *path = xcalloc((size_t)s->n_nodes + 1, sizeof(int)), *branch = xcalloc((size_t)s->n_nodes + 1, sizeof(int));
    int loop = 0;
    for (int start = 0; start < s->n_nodes && !loop; start++) {
        if (mark[start]) continue;
        int n = 0;
        path[n] = start; branch[n++] = 0; mark[start] = 1;
        while (n > 0 && !loop) {
            int at = path[n - 1];
            if (branch[n - 1] == s->nodes[at].n_any) { mark[at] = 2; n--; continue; }
            int next = s->nodes[at].any[branch[n - 1]++];
            if (mark[next] == 1) loop = 1;
            else if (mark[next] == 0) { mark[next] = 1; path[n] = next; branch[n++] = 0; }
        }
    }
    free(mark); free(path); free(branch);
    if (loop) schema_fail(c, "$ref/anyOf: a schema refers to itself before any value is written");
    int *count = xcalloc((size_t)s->n_nodes, sizeof(int));
    int worst = 0;
    for (int i = 0; i < s->n_nodes; i++) {
        int n = branch_leaves(s, i, count, 0);
        worst = n > worst ? n : worst;
    }
    free(count);
    if (worst > JSON_MAX_BRANCHES) schema_fail(c, "anyOf: more than %d alternatives at one place (nested anyOf and $ref)", JSON_MAX_BRANCHES);
}

/* The schema of response_format `format` (a value of the tree): node 1 an
   object for "json_object", the schema of "json_schema"; *plain for "text". */
static void compile_response_format(SchemaCompiler *c, int format, int *plain) {
    if (c->v[format].kind != JV_OBJECT) schema_fail(c, "must be an object with a \"type\"");
    int type = jv_member(c, format, "type"), inner = jv_member(c, format, "json_schema");
    for (int m = c->v[format].first; m >= 0; m = c->v[m].next)
        if (m != type && m != inner) schema_fail(c, "unknown field '%.60s'", jv_key(c, m));
    const char *name = type >= 0 && c->v[type].kind == JV_STRING ? jv_str(c, type) : "";
    *plain = strcmp(name, "text") == 0;
    if (*plain) return;
    if (strcmp(name, "json_object") == 0) {
        c->s->nodes[new_node(c)].types = JT_OBJECT;
        return;
    }
    if (strcmp(name, "json_schema") != 0) schema_fail(c, "type: must be \"text\", \"json_object\" or \"json_schema\"");
    if (inner < 0 || c->v[inner].kind != JV_OBJECT) schema_fail(c, "json_schema: must be an object with a \"schema\"");
    int schema = -1;
    for (int m = c->v[inner].first; m >= 0; m = c->v[m].next) {
        const char *key = jv_key(c, m);
        if (strcmp(key, "schema") == 0) schema = m;
        else if (strcmp(key, "strict") == 0) {
            if (c->v[m].kind != JV_TRUE && c->v[m].kind != JV_FALSE) schema_fail(c, "json_schema: strict must be true or false");
            c->strict = c->v[m].kind == JV_TRUE;
        } else if (strcmp(key, "name") != 0 && strcmp(key, "description") != 0)
            schema_fail(c, "json_schema: unknown field '%.60s'", key);
    }
    if (schema < 0) schema_fail(c, "json_schema: missing field 'schema'");
    c->root = schema;
}

/* The compilation proper (see compile_json_value); 0 after an error. */
static int compile_value_at(SchemaCompiler *c, int response_format, const char *text, size_t *used, int *plain) {
    if (setjmp(c->fail)) return 0;
    c->root = jv_value(c, 0);
    *used = (size_t)(c->p - text);
    new_node(c); /* node 0: any value */
    c->s->nodes[0].items = 0;
    if (response_format) compile_response_format(c, c->root, plain);
    if (c->s->n_nodes > 1 || *plain) return 1; /* "json_object", or "text" */
    c->defs = -1;
    if (c->v[c->root].kind == JV_OBJECT) {
        c->defs = jv_member(c, c->root, "$defs");
        if (c->defs < 0) c->defs = jv_member(c, c->root, "definitions");
        if (c->defs >= 0 && c->v[c->defs].kind != JV_OBJECT) schema_fail(c, "%s: must be an object", jv_key(c, c->defs));
    }
    c->def_node = xcalloc((size_t)c->n_v, sizeof(int));
    for (int i = 0; i < c->n_v; i++) c->def_node[i] = -1;
    compile_node(c, c->root); /* node 1: the root */
    check_ref_loops(c);
    return 1;
}

/* Compiles the JSON value at text (up to end): a schema, or with
   `response_format` a response_format object holding one; *used gets the
   value's length. Returns the schema, or NULL: for response_format "text"
   (*plain set), or with a one-line message in err when the value is not
   JSON, not a schema, or outside the subset. */
static JsonSchema *compile_json_value(const char *text, const char *end, int response_format, size_t *used, int *plain,
                                      char *err, size_t err_len) {
    size_t n = (size_t)(end - text);
    *plain = 0;
    *used = 0;
    if (n > (size_t)INT_MAX / 4) {
        snprintf(err, err_len, "the schema is too long");
        return NULL;
    }
    SchemaCompiler *c = xcalloc(1, sizeof(SchemaCompiler));
    c->p = text;
    c->end = end;
    c->cap_v = (int)n + 1;
    c->v = xcalloc((size_t)c->cap_v, sizeof(Jv));
    c->chars = xcalloc(2 * n + 2, 1);
    c->err = err;
    c->err_len = err_len;
    c->s = xcalloc(1, sizeof(JsonSchema));
    JsonSchema *s = c->s;
    if (!compile_value_at(c, response_format, text, used, plain) || *plain) {
        free_schema(s);
        s = NULL;
    }
    free(c->v);
    free(c->chars);
    free(c->def_node);
    free(c);
    return s;
}

/* The schema text of a file (n bytes), compiled; NULL with err as above. */
static JsonSchema *compile_schema(const char *text, size_t n, char *err, size_t err_len) {
    size_t used;
    int plain;
    JsonSchema *s = compile_json_value(text, text + n, 0, &used, &plain, err, err_len);
    const char *rest = text + used;
    while (s && rest < text + n && (*rest == ' ' || *rest == '\t' || *rest == '\r' || *rest == '\n')) rest++;
    if (s && rest < text + n) {
        free_schema(s);
        snprintf(err, err_len, "text after the schema");
        return NULL;
    }
    return s;
}

/* The schema of --json and response_format "json_object": any object. */
static JsonSchema *any_object_schema(void) {
    size_t used;
    int plain;
    char err[8];
    static const char format[] = "{\"type\":\"json_object\"}";
    return compile_json_value(format, format + strlen(format), 1, &used, &plain, err, sizeof(err));
}

/* -- The automaton: reading an answer byte by byte -- */

typedef enum { F_ROOT, F_VALUE, F_OBJECT, F_ARRAY, F_STRING, F_NUMBER, F_LITERAL } FrameKind;

/* phases of an object: after '{', in a key, after the key, in a value, after
   a value, after ','; of an array: after '[', in a value, after a value; of
   a string: a character, after '\', in a \u escape; of a number: as the
   JSON grammar reads one */
enum { O_FIRST, O_KEY, O_COLON, O_VALUE, O_AFTER, O_NEXT };
enum { A_FIRST, A_VALUE, A_AFTER };
enum { S_CHAR, S_ESCAPE, S_HEX };
enum { N_START, N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_EXP, N_EXP_SIGN, N_EXP_DIGITS };

/* One value being written. The fields' use by kind:
   F_ROOT: phase 1 once the answer's value is complete;
   F_VALUE: a value of `node` is to start with the next byte;
   F_OBJECT: a, b: the properties whose names the key so far begins; c: the
     key's bytes so far, then the property's index (-1: not a property);
     x: the key may be a name outside the properties; seen: properties written;
   F_ARRAY: a: items written;
   F_STRING: a: code points; x: bytes still due in a UTF-8 sequence, lo..hi
     the next one's range; b: hex digits of a \u escape so far (x: count);
   F_NUMBER: x: negative; a, b, c: digits before the point, after it, in the
     exponent; seen: the magnitude of an integer;
   F_LITERAL: x: the list (0: the node's enum, 1: false/true, 2: null);
     a, b: the values that the bytes so far begin; c: bytes so far. */
typedef struct {
    int node;
    uint8_t kind, phase, x, lo, hi, pad[3];
    int a, b, c;
    uint64_t seen;
} Frame;

typedef struct {
    int depth;
    Frame f[JSON_MAX_DEPTH];
} JsonStack;

/* The readings of the text so far (no reading left: not a valid prefix). */
typedef struct {
    int n;
    JsonStack alt[JSON_MAX_ALTS];
} JsonState;

static const char *const bool_literals[] = {"false", "true"};
static const char *const null_literals[] = {"null"};

static const char *const *frame_literals(const JsonSchema *s, const Frame *f) {
    return f->x == 1 ? bool_literals : f->x == 2 ? null_literals : (const char *const *)s->nodes[f->node].lits;
}

/* The integers a number whose magnitude so far is v (`digits` of them) can
   still become meet [min, max]. */
static int integer_reachable(const SchemaNode *nd, int negative, long long v, int digits) {
    if (digits == 0) return negative ? nd->minimum <= -1 && nd->maximum >= -999999999999999999LL : 1;
    if (v == 0) return nd->minimum <= 0 && nd->maximum >= 0; /* "0" and "-0" take no more digits */
    long long scale = 1;
    for (int k = 0; digits + k <= JSON_MAX_DIGITS; k++, scale *= 10) {
        long long lo = v * scale, hi = lo + scale - 1;
        if (negative) { long long t = -hi; hi = -lo; lo = t; }
        if (hi >= nd->minimum && lo <= nd->maximum) return 1;
        if (digits + k == JSON_MAX_DIGITS) break;
    }
    return 0;
}

/* What a frame did with a byte. */
typedef enum { STEP_FAIL, STEP_TAKEN, STEP_DONE, STEP_DONE_BEFORE, STEP_OPEN, STEP_OPEN_BEFORE } StepResult;
/* STEP_DONE: the byte completed the value; STEP_DONE_BEFORE: the value was
   complete and the byte is the parent's; STEP_OPEN: the byte opened a child
   value (pushed); STEP_OPEN_BEFORE: a child value starts with the byte */

/* Whether f's object may take another key: not when it is closed
   (additionalProperties: false) and every property is seen, or it has none. */
static int keys_left(const SchemaNode *nd, const Frame *f) {
    return !nd->closed || f->seen != (nd->n_props == 64 ? ~0ull : (1ull << nd->n_props) - 1);
}

static StepResult object_step(const JsonSchema *s, Frame *f, int ch) {
    const SchemaNode *nd = &s->nodes[f->node];
    switch (f->phase) {
    case O_FIRST:
    case O_NEXT:
        if (ch == '}' && f->phase == O_FIRST) return (f->seen & nd->required) == nd->required ? STEP_DONE : STEP_FAIL;
        if (ch != '"' || !keys_left(nd, f)) return STEP_FAIL;
        f->phase = O_KEY;
        f->a = 0, f->b = nd->n_props, f->c = 0, f->x = !nd->closed;
        return STEP_TAKEN;
    case O_KEY: {
        int lo = f->b, hi = f->a, unseen = 0; /* the properties that go on with ch */
        for (int k = f->a; k < f->b; k++)
            if (nd->props[k].len > f->c && (unsigned char)nd->props[k].name[f->c] == ch) {
                if (k < lo) lo = k;
                hi = k + 1;
                unseen |= !(f->seen >> k & 1);
            }
        /* a '"' that a name goes on with is escaped (a name is a well-formed
           JSON string, which no name could end before); else it ends the key */
        if (ch == '"' && lo >= hi) {
            if (f->a < f->b && nd->props[f->a].len == f->c) { /* a property's name */
                if (f->seen >> f->a & 1) return STEP_FAIL;
                f->c = f->a;
            } else if (f->x) {
                f->c = -1;
            } else {
                return STEP_FAIL;
            }
            f->phase = O_COLON;
            return STEP_TAKEN;
        }
        f->x = f->x && ch >= 0x20 && ch < 0x7f && ch != '\\';
        if (!unseen && !f->x) return STEP_FAIL;
        if (unseen) f->a = lo, f->b = hi;
        else f->a = f->b = 0;
        f->c++;
        return STEP_TAKEN;
    }
    case O_COLON:
        if (ch != ':') return STEP_FAIL;
        f->phase = O_VALUE;
        return STEP_OPEN;
    case O_AFTER:
        if (ch == '}') return (f->seen & nd->required) == nd->required ? STEP_DONE : STEP_FAIL;
        if (ch != ',' || !keys_left(nd, f)) return STEP_FAIL;
        f->phase = O_NEXT;
        return STEP_TAKEN;
    }
    return STEP_FAIL;
}

static StepResult array_step(const JsonSchema *s, Frame *f, int ch) {
    const SchemaNode *nd = &s->nodes[f->node];
    if (f->phase == A_FIRST && ch == ']') return nd->min_items == 0 ? STEP_DONE : STEP_FAIL;
    if (f->phase == A_FIRST) {
        if (nd->max_items == 0) return STEP_FAIL;
        f->phase = A_VALUE;
        return STEP_OPEN_BEFORE;
    }
    if (f->phase != A_AFTER) return STEP_FAIL;
    if (ch == ']') return f->a >= nd->min_items ? STEP_DONE : STEP_FAIL;
    if (ch != ',' || f->a >= nd->max_items) return STEP_FAIL;
    f->phase = A_VALUE;
    return STEP_OPEN;
}

/* Byte ch of a string's text (not its quote, nor an escape) on f's UTF-8
   state (x bytes still due in a sequence, lo..hi the next one's range):
   1 when ch starts a character, 0 when it goes on with one, -1 when it
   cannot come (a control byte, or not well-formed UTF-8, RFC 3629). */
static int utf8_step(Frame *f, int ch) {
    if (f->x > 0) {
        if (ch < f->lo || ch > f->hi) return -1;
        f->x--, f->lo = 0x80, f->hi = 0xBF;
        return 0;
    }
    if (ch < 0x20 || ch == '"' || ch == '\\') return -1;
    if (ch >= 0x80) { /* the lead byte of a sequence */
        if (ch < 0xC2 || ch > 0xF4) return -1;
        f->x = ch < 0xE0 ? 1 : ch < 0xF0 ? 2 : 3;
        f->lo = ch == 0xE0 ? 0xA0 : ch == 0xF0 ? 0x90 : 0x80;
        f->hi = ch == 0xED ? 0x9F : ch == 0xF4 ? 0x8F : 0xBF;
    }
    return 1;
}

static StepResult string_step(const JsonSchema *s, Frame *f, int ch) {
    const SchemaNode *nd = &s->nodes[f->node];
    if (f->phase == S_ESCAPE) {
        if (ch == 'u') { f->phase = S_HEX; f->x = 0; f->b = 0; return STEP_TAKEN; }
        if (!strchr("\"\\/bfnrt", ch) || ch == 0) return STEP_FAIL;
        f->phase = S_CHAR;
        return STEP_TAKEN;
    }
    if (f->phase == S_HEX) {
        int d = hex_value((char)ch);
        if (d < 0) return STEP_FAIL;
        f->b = f->b * 16 + d;
        if (++f->x == 2 && f->b >= 0xD8 && f->b <= 0xDF) return STEP_FAIL; /* a surrogate half alone */
        if (f->x == 4 && f->b == 0) return STEP_FAIL; /* \u0000: no NUL, which C strings cannot hold */
        if (f->x == 4) f->phase = S_CHAR, f->x = 0;
        return STEP_TAKEN;
    }
    if (f->x == 0) {
        if (ch == '"') return f->a >= nd->min_len ? STEP_DONE : STEP_FAIL;
        if (f->a >= nd->max_len) return STEP_FAIL;
        if (ch == '\\') {
            f->phase = S_ESCAPE;
            f->a++;
            return STEP_TAKEN;
        }
    }
    int started = utf8_step(f, ch);
    if (started < 0) return STEP_FAIL;
    f->a += started;
    return STEP_TAKEN;
}

/* 10^k, k <= 18. */
static long long power_of_ten(int k) {
    long long p = 1;
    while (k-- > 0) p *= 10;
    return p;
}

/* Whether the values of sign `negative` and magnitude in [lo, hi]
   millionths meet a bounded number's [minimum, maximum]. */
static int millionths_meet(const SchemaNode *nd, int negative, long long lo, long long hi) {
    if (negative) { long long t = -hi; hi = -lo; lo = t; }
    return hi >= nd->minimum && lo <= nd->maximum;
}

/* Whether a bounded number written so far (frame f) can still end in range:
   the magnitudes, in millionths, that its completions can have (more digits
   before the point, up to NUMBER_INT_DIGITS, then up to NUMBER_SCALE_DIGITS
   after it) meet [minimum, maximum]. */
static int number_reachable(const SchemaNode *nd, const Frame *f) {
    const long long unit = power_of_ten(NUMBER_SCALE_DIGITS), v = (long long)f->seen;
    switch (f->phase) {
    case N_MINUS: return millionths_meet(nd, 1, 0, power_of_ten(NUMBER_INT_DIGITS) * unit - 1);
    case N_ZERO:
    case N_DOT: return millionths_meet(nd, f->x, v * unit, v * unit + unit - 1);
    case N_FRAC: {
        long long step = power_of_ten(NUMBER_SCALE_DIGITS - f->b), base = v * unit + f->c * step;
        return millionths_meet(nd, f->x, base, base + step - 1);
    }
    default: /* N_INT: a digits so far */
        for (long long scale = 1, k = 0; f->a + k <= NUMBER_INT_DIGITS; k++, scale *= 10)
            if (millionths_meet(nd, f->x, v * scale * unit, (v + 1) * scale * unit - 1)) return 1;
        return 0;
    }
}

/* Whether a number frame holds a complete number (an integer in range; a
   bounded number in range). */
static int number_complete(const JsonSchema *s, const Frame *f) {
    const SchemaNode *nd = &s->nodes[f->node];
    if (f->phase != N_ZERO && f->phase != N_INT && f->phase != N_FRAC && f->phase != N_EXP_DIGITS) return 0;
    if (nd->bounded) {
        long long m = (long long)f->seen * power_of_ten(NUMBER_SCALE_DIGITS) +
                      (f->phase == N_FRAC ? f->c * power_of_ten(NUMBER_SCALE_DIGITS - f->b) : 0);
        return millionths_meet(nd, f->x, m, m);
    }
    if (nd->types & JT_NUMBER) return 1;
    long long v = f->x ? -(long long)f->seen : (long long)f->seen;
    return v >= nd->minimum && v <= nd->maximum;
}

/* What a byte taken by a number leaves: taken while the number can still
   end in range (integers: integer_reachable; bounded numbers:
   number_reachable; other numbers: always). */
static StepResult number_taken(const SchemaNode *nd, const Frame *f) {
    if (nd->bounded) return number_reachable(nd, f) ? STEP_TAKEN : STEP_FAIL;
    if (nd->types & JT_NUMBER) return STEP_TAKEN;
    return integer_reachable(nd, f->x, (long long)f->seen, f->phase == N_MINUS ? 0 : f->a) ? STEP_TAKEN : STEP_FAIL;
}

static StepResult number_step(const JsonSchema *s, Frame *f, int ch) {
    const SchemaNode *nd = &s->nodes[f->node];
    int real = (nd->types & JT_NUMBER) != 0, digit = ch >= '0' && ch <= '9';
    switch (f->phase) {
    case N_START:
        if (ch == '-') {
            f->x = 1;
            f->phase = N_MINUS;
            return number_taken(nd, f);
        }
        /* fall through */
    case N_MINUS:
        if (!digit) return STEP_FAIL;
        f->phase = ch == '0' ? N_ZERO : N_INT;
        f->a = 1;
        f->seen = (uint64_t)(ch - '0');
        return number_taken(nd, f);
    case N_INT:
        if (digit) {
            if (f->a == (nd->bounded ? NUMBER_INT_DIGITS : JSON_MAX_DIGITS)) return STEP_FAIL;
            f->a++;
            f->seen = f->seen * 10 + (uint64_t)(ch - '0');
            return number_taken(nd, f);
        }
        /* fall through */
    case N_ZERO:
        if (ch == '.' && real) { f->phase = N_DOT; return number_taken(nd, f); }
        /* fall through */
    case N_FRAC:
        if (f->phase == N_FRAC && digit) {
            if (++f->b > (nd->bounded ? NUMBER_SCALE_DIGITS : JSON_MAX_DIGITS)) return STEP_FAIL;
            if (nd->bounded) f->c = f->c * 10 + (ch - '0'); /* at most NUMBER_SCALE_DIGITS of them */
            return number_taken(nd, f);
        }
        if ((ch == 'e' || ch == 'E') && real && !nd->bounded) { f->phase = N_EXP; return STEP_TAKEN; }
        return number_complete(s, f) ? STEP_DONE_BEFORE : STEP_FAIL;
    case N_DOT:
        if (!digit) return STEP_FAIL;
        f->phase = N_FRAC;
        f->b = 1;
        f->c = ch - '0';
        return number_taken(nd, f);
    case N_EXP:
        if (ch == '+' || ch == '-') { f->phase = N_EXP_SIGN; return STEP_TAKEN; }
        /* fall through */
    case N_EXP_SIGN:
        if (!digit) return STEP_FAIL;
        f->phase = N_EXP_DIGITS;
        f->c = 1;
        return STEP_TAKEN;
    case N_EXP_DIGITS:
        if (digit) return ++f->c > 3 ? STEP_FAIL : STEP_TAKEN;
        return STEP_DONE_BEFORE;
    }
    return STEP_FAIL;
}

static StepResult literal_step(const JsonSchema *s, Frame *f, int ch) {
    const char *const *lits = frame_literals(s, f);
    int lo = f->b, hi = f->a;
    for (int k = f->a; k < f->b; k++)
        if ((unsigned char)lits[k][f->c] == ch && ch != 0) {
            if (k < lo) lo = k;
            hi = k + 1;
        }
    if (lo < hi) {
        f->a = lo, f->b = hi, f->c++;
        return STEP_TAKEN;
    }
    return lits[f->a][f->c] == '\0' ? STEP_DONE_BEFORE : STEP_FAIL; /* sorted: a complete one comes first */
}

/* Turns a F_VALUE frame (not an anyOf) into the value that byte ch starts. */
static StepResult value_start(const JsonSchema *s, Frame *f, int ch) {
    const SchemaNode *nd = &s->nodes[f->node];
    if (nd->n_lits) {
        *f = (Frame){.node = f->node, .kind = F_LITERAL, .x = 0, .a = 0, .b = nd->n_lits};
        return literal_step(s, f, ch);
    }
    int t = nd->types;
    if (ch == '{' && (t & JT_OBJECT)) { *f = (Frame){.node = f->node, .kind = F_OBJECT, .phase = O_FIRST}; return STEP_TAKEN; }
    if (ch == '[' && (t & JT_ARRAY)) { *f = (Frame){.node = f->node, .kind = F_ARRAY, .phase = A_FIRST}; return STEP_TAKEN; }
    if (ch == '"' && (t & JT_STRING)) { *f = (Frame){.node = f->node, .kind = F_STRING, .phase = S_CHAR}; return STEP_TAKEN; }
    if ((ch == '-' || (ch >= '0' && ch <= '9')) && (t & (JT_INTEGER | JT_NUMBER))) {
        *f = (Frame){.node = f->node, .kind = F_NUMBER, .phase = N_START};
        return number_step(s, f, ch);
    }
    if ((ch == 't' || ch == 'f') && (t & JT_BOOLEAN)) { *f = (Frame){.node = f->node, .kind = F_LITERAL, .x = 1, .a = 0, .b = 2}; return literal_step(s, f, ch); }
    if (ch == 'n' && (t & JT_NULL)) { *f = (Frame){.node = f->node, .kind = F_LITERAL, .x = 2, .a = 0, .b = 1}; return literal_step(s, f, ch); }
    return STEP_FAIL;
}

/* The parent of a completed value takes note: the root is done, an object
   has one more property written, an array one more item. */
static void value_done(Frame *parent) {
    if (parent->kind == F_ROOT) parent->phase = 1;
    else if (parent->kind == F_OBJECT) {
        if (parent->c >= 0) parent->seen |= 1ull << parent->c;
        parent->phase = O_AFTER;
    } else {
        parent->a++;
        parent->phase = A_AFTER;
    }
}

/* The node of the value an object or array frame opens next. */
static int child_node(const JsonSchema *s, const Frame *f) {
    const SchemaNode *nd = &s->nodes[f->node];
    if (f->kind == F_ARRAY) return nd->items;
    return f->c >= 0 ? nd->props[f->c].node : 0;
}

static void add_reading(JsonState *out, const JsonStack *st) {
    for (int i = 0; i < out->n; i++)
        if (out->alt[i].depth == st->depth && memcmp(out->alt[i].f, st->f, (size_t)st->depth * sizeof(Frame)) == 0) return;
    if (out->n == JSON_MAX_ALTS) return; /* dropped: the answer has fewer ways to go, all valid */
    JsonStack *to = &out->alt[out->n++];
    if (to == st) return; /* fed in its place */
    to->depth = st->depth;
    memcpy(to->f, st->f, (size_t)st->depth * sizeof(Frame));
}

/* Feeds byte ch to stack st (changed), adding the readings that take it to
   out; an anyOf starting here forks one reading per branch. */
static void stack_feed(const JsonSchema *s, JsonStack *st, int ch, JsonState *out, int forks) {
    for (;;) {
        Frame *f = &st->f[st->depth - 1];
        StepResult r;
        if (f->kind == F_VALUE && s->nodes[f->node].n_any) {
            if (forks > 2 * SCHEMA_MAX_NESTING) return;
            const SchemaNode *nd = &s->nodes[f->node];
            JsonStack base; /* st may be out's next place, which the branches fill */
            base.depth = st->depth;
            memcpy(base.f, st->f, (size_t)st->depth * sizeof(Frame));
            for (int b = 0; b < nd->n_any; b++) {
                JsonStack copy;
                copy.depth = base.depth;
                memcpy(copy.f, base.f, (size_t)base.depth * sizeof(Frame));
                copy.f[copy.depth - 1].node = nd->any[b];
                stack_feed(s, &copy, ch, out, forks + 1);
            }
            return;
        }
        switch (f->kind) {
        case F_ROOT: r = STEP_FAIL; break;
        case F_VALUE: r = value_start(s, f, ch); break;
        case F_OBJECT: r = object_step(s, f, ch); break;
        case F_ARRAY: r = array_step(s, f, ch); break;
        case F_STRING: r = string_step(s, f, ch); break;
        case F_NUMBER: r = number_step(s, f, ch); break;
        default: r = literal_step(s, f, ch); break;
        }
        if (r == STEP_FAIL) return;
        if (r == STEP_TAKEN) break;
        if (r == STEP_DONE || r == STEP_DONE_BEFORE) {
            st->depth--;
            value_done(&st->f[st->depth - 1]);
            if (r == STEP_DONE) break;
            continue;
        }
        if (st->depth == JSON_MAX_DEPTH) return; /* nested too deeply: not this way */
        Frame *child = &st->f[st->depth++];
        *child = (Frame){.node = child_node(s, f), .kind = F_VALUE};
        if (r == STEP_OPEN) break;
    }
    add_reading(out, st);
}

/* out = the readings of `in` after byte ch (out->n == 0: ch cannot come).
   Each reading is fed in out's next place, where it stays if it takes ch. */
static void json_feed(const JsonSchema *s, const JsonState *in, int ch, JsonState *out) {
    out->n = 0;
    for (int i = 0; i < in->n && out->n < JSON_MAX_ALTS; i++) {
        JsonStack *work = &out->alt[out->n];
        work->depth = in->alt[i].depth;
        memcpy(work->f, in->alt[i].f, (size_t)work->depth * sizeof(Frame));
        stack_feed(s, work, ch, out, 0);
    }
}

/* Whether the text read so far is a whole answer. */
static int json_complete(const JsonSchema *s, const JsonState *st) {
    for (int i = 0; i < st->n; i++) {
        const JsonStack *k = &st->alt[i];
        const Frame *top = &k->f[k->depth - 1];
        if (k->depth == 1 && top->phase == 1) return 1;
        if (k->depth != 2) continue;
        if (top->kind == F_NUMBER && number_complete(s, top)) return 1;
        if (top->kind == F_LITERAL && frame_literals(s, top)[top->a][top->c] == '\0') return 1;
    }
    return 0;
}

/* The state before the first byte of an answer: the root value (node 1) to come. */
static void json_start(JsonState *st) {
    st->n = 1;
    st->alt[0].depth = 2;
    st->alt[0].f[0] = (Frame){.kind = F_ROOT};
    st->alt[0].f[1] = (Frame){.node = 1, .kind = F_VALUE};
}

/* -- The vocabulary as a trie, and the mask -- */

/* A node of the trie: the tokens whose bytes are the path to it. Nodes are
   in depth-first order, so a node's subtree is the nodes up to `skip`. */
typedef struct {
    unsigned char byte, depth; /* depth: bytes from the root (1 for the first) */
    unsigned char flags;       /* TRIE_* of the path to it */
    unsigned char chars;       /* TRIE_TEXT: the characters the path starts */
    unsigned char due, lo, hi; /* TRIE_TEXT: the UTF-8 state after the path (a Frame's x, lo, hi) */
    int skip;                  /* the first node after its subtree */
    int first, n;              /* its tokens: order[first..first+n-1] */
} TrieNode;

/* What a path is, read inside a string (the bulk of a vocabulary is words):
   TRIE_TEXT: string text (well-formed UTF-8 so far, no quote, backslash or
   control byte); TRIE_ASCII: text of printable ASCII only (a free object
   key's bytes); the _PARENT flags say the same of the path to the parent. */
enum { TRIE_TEXT = 1, TRIE_ASCII = 2, TRIE_TEXT_PARENT = 4, TRIE_ASCII_PARENT = 8 };

/* The two kinds of text a path can be (TRIE_TEXT, TRIE_ASCII), by index. */
enum { TEXT_KINDS = 2 };

typedef struct {
    TrieNode *nodes;
    int n_nodes, max_depth;
    int *order;                /* tokens sorted by their bytes */
    const char **bytes;        /* (vocab) each token's bytes as printed; NULL: never allowed */
    int *len;                  /* (vocab) */
    /* by kind of text k: the tokens that are text of that kind (1 each), how
       many, their most characters, and the nodes where text of that kind
       ends (the first node off a text path: the rest of the subtree must be read) */
    unsigned char *text_tokens[TEXT_KINDS];  /* (vocab) */
    int n_text_tokens[TEXT_KINDS], max_chars[TEXT_KINDS];
    int *edges[TEXT_KINDS];                  /* (n_edges[k]) */
    int n_edges[TEXT_KINDS];
} TokenTrie;

static const char *const *trie_sort_bytes;
static const int *trie_sort_len;

static int compare_token_bytes(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b, lx = trie_sort_len[x], ly = trie_sort_len[y];
    int c = memcmp(trie_sort_bytes[x], trie_sort_bytes[y], (size_t)(lx < ly ? lx : ly));
    return c ? c : lx != ly ? lx - ly : x - y;
}

/* The trie of tok's printable tokens (not BOS, the end tokens or special
   ones; not pieces longer than 255 bytes or holding NUL). A token's bytes
   are its piece as printed after a token other than BOS. */
static TokenTrie *token_trie_new(const Tokenizer *tok) {
    const int vocab = tok->vocab_size;
    TokenTrie *t = xcalloc(1, sizeof(TokenTrie));
    t->bytes = xcalloc((size_t)vocab, sizeof(char *));
    t->len = xcalloc((size_t)vocab, sizeof(int));
    t->order = xcalloc((size_t)vocab, sizeof(int));
    int n = 0;
    size_t total = 0;
    for (int i = 0; i < vocab; i++) {
        if (is_end_token(tok, i) || (tok->special && tok->special[i])) continue;
        const char *piece = decode(tok, -1, i);
        int len = tok->byte_level ? tok->piece_len[i] : (int)strlen(piece);
        if (len == 0 || len > 255 || !piece_is_printable(tok, piece) || memchr(piece, '\0', (size_t)len)) continue;
        t->bytes[i] = piece;
        t->len[i] = len;
        t->order[n++] = i;
        total += (size_t)len;
    }
    trie_sort_bytes = t->bytes; /* qsort has no context argument; built once per tokenizer */
    trie_sort_len = t->len;
    qsort(t->order, (size_t)n, sizeof(int), compare_token_bytes);
    t->nodes = xcalloc(total + 1, sizeof(TrieNode));
    int open[256], prev = -1; /* open[d]: the node at depth d+1 on the path of the last token */
    for (int k = 0; k < n; k++) {
        int tk = t->order[k], common = 0;
        if (prev >= 0)
            while (common < t->len[prev] && common < t->len[tk] && t->bytes[prev][common] == t->bytes[tk][common]) common++;
        for (int d = prev >= 0 ? t->len[prev] : 0; d > common; d--) t->nodes[open[d - 1]].skip = t->n_nodes;
        for (int d = common; d < t->len[tk]; d++) {
            int ch = (unsigned char)t->bytes[tk][d];
            TrieNode node = {(unsigned char)ch, (unsigned char)(d + 1), TRIE_TEXT_PARENT | TRIE_ASCII_PARENT, 0, 0, 0, 0, 0, k, 0};
            if (d > 0) { /* the parent's path, read on by ch */
                const TrieNode *parent = &t->nodes[open[d - 1]];
                node.flags = (unsigned char)((parent->flags & TRIE_TEXT ? TRIE_TEXT_PARENT : 0) | (parent->flags & TRIE_ASCII ? TRIE_ASCII_PARENT : 0));
                node.chars = parent->chars, node.due = parent->due, node.lo = parent->lo, node.hi = parent->hi;
            }
            Frame utf8 = {.x = node.due, .lo = node.lo, .hi = node.hi};
            int started = node.flags & TRIE_TEXT_PARENT ? utf8_step(&utf8, ch) : -1;
            if (started >= 0) {
                node.flags |= TRIE_TEXT | (ch < 0x7f && (node.flags & TRIE_ASCII_PARENT) ? TRIE_ASCII : 0);
                node.chars = (unsigned char)(node.chars + started), node.due = utf8.x, node.lo = utf8.lo, node.hi = utf8.hi;
            }
            open[d] = t->n_nodes;
            t->nodes[t->n_nodes++] = node;
        }
        TrieNode *at = &t->nodes[open[t->len[tk] - 1]];
        if (at->n == 0) at->first = k;
        at->n++;
        if (t->len[tk] > t->max_depth) t->max_depth = t->len[tk];
        prev = tk;
    }
    for (int d = prev >= 0 ? t->len[prev] : 0; d > 0; d--) t->nodes[open[d - 1]].skip = t->n_nodes;
    for (int k = 0; k < TEXT_KINDS; k++) {
        const int flag = k == 0 ? TRIE_TEXT : TRIE_ASCII;
        t->text_tokens[k] = xcalloc((size_t)vocab, 1);
        t->edges[k] = xcalloc((size_t)t->n_nodes + 1, sizeof(int));
        for (int i = 0; i < t->n_nodes; i++) {
            const TrieNode *node = &t->nodes[i];
            if (node->flags & flag) {
                for (int j = 0; j < node->n; j++) t->text_tokens[k][t->order[node->first + j]] = 1;
                t->n_text_tokens[k] += node->n;
                if (node->chars > t->max_chars[k]) t->max_chars[k] = node->chars;
            } else if (node->flags & (flag * TRIE_TEXT_PARENT)) {
                t->edges[k][t->n_edges[k]++] = i;
            }
        }
    }
    return t;
}

static void token_trie_free(TokenTrie *t) {
    if (!t) return;
    free(t->nodes); free(t->order); free(t->bytes); free(t->len);
    for (int k = 0; k < TEXT_KINDS; k++) { free(t->text_tokens[k]); free(t->edges[k]); }
    free(t);
}

/* A request's reading of its answer: the state, and scratch for the mask. */
typedef struct {
    const JsonSchema *schema;
    JsonState state;
    JsonState *walk;          /* (trie max_depth + 1) the states down the trie's path */
    unsigned char *allowed;   /* (vocab) */
} JsonMatch;

static JsonMatch *json_match_new(const JsonSchema *s, const TokenTrie *t, int vocab) {
    JsonMatch *m = xcalloc(1, sizeof(JsonMatch));
    m->schema = s;
    json_start(&m->state);
    m->walk = xcalloc((size_t)t->max_depth + 1, sizeof(JsonState));
    m->allowed = xcalloc((size_t)vocab, 1);
    return m;
}

static void json_match_free(JsonMatch *m) {
    if (!m) return;
    free(m->walk);
    free(m->allowed);
    free(m);
}

/* Where the text so far has one reading and it is between characters of
   a string (TRIE_TEXT paths go on with it) or of a free object key
   (TRIE_ASCII ones), that flag, and the characters it may still take in
   *room; else 0. */
static int text_room(const JsonSchema *s, const JsonState *st, int *room) {
    if (st->n != 1) return 0;
    const Frame *top = &st->alt[0].f[st->alt[0].depth - 1];
    if (top->kind == F_STRING && top->phase == S_CHAR && top->x == 0) {
        *room = s->nodes[top->node].max_len - top->a;
        return TRIE_TEXT;
    }
    if (top->kind == F_OBJECT && top->phase == O_KEY && top->x && top->a >= top->b) { /* no property's name left */
        *room = INT_MAX;
        return TRIE_ASCII;
    }
    return 0;
}

/* The state after a path of `bytes` that text_room's flag covers, whose
   characters and UTF-8 state `text` holds (its node, or a child's off the
   text, which keeps them), from a state text_room accepted: the same
   frames, the top one further on. */
static void text_state_after(const JsonState *from, const TrieNode *text, int bytes, JsonState *out) {
    out->n = 1;
    out->alt[0].depth = from->alt[0].depth;
    memcpy(out->alt[0].f, from->alt[0].f, (size_t)from->alt[0].depth * sizeof(Frame));
    Frame *top = &out->alt[0].f[out->alt[0].depth - 1];
    if (top->kind == F_OBJECT) {
        top->c += bytes;
        return;
    }
    top->a += text->chars;
    top->x = text->due, top->lo = text->lo, top->hi = text->hi;
}

/* Marks the allowed tokens of nodes from..to-1 (whole subtrees) of the
   trie, reading each node's byte on the state of its parent (walk[depth -
   1]) into walk[depth], and skipping the subtree of a byte that cannot
   come. With `text` (text_room's flag) a node on a text path that fits in
   `room` is allowed without being read, and the state below it is made
   when a node off the text needs it. Returns the count marked. */
static int walk_trie(const JsonMatch *m, const TokenTrie *t, int from, int to, int text, int room) {
    JsonState *walk = m->walk;
    const TrieNode *path[256]; /* path[d]: the node at depth d on the way to the current one */
    int n_allowed = 0;
    for (int i = from; i < to;) {
        const TrieNode *node = &t->nodes[i];
        path[node->depth] = node;
        if ((node->flags & text) && node->chars <= room) { /* text that fits */
            for (int k = 0; k < node->n; k++) m->allowed[t->order[node->first + k]] = 1;
            n_allowed += node->n;
            i++;
            continue;
        }
        if ((node->flags & text * TRIE_TEXT_PARENT) && node->depth > 1 && path[node->depth - 1]->chars <= room)
            text_state_after(&m->state, node, node->depth - 1, &walk[node->depth - 1]); /* below text that fits */
        JsonState *next = &walk[node->depth];
        json_feed(m->schema, &walk[node->depth - 1], node->byte, next);
        if (next->n == 0) { i = node->skip; continue; } /* no token below goes on */
        for (int k = 0; k < node->n; k++) m->allowed[t->order[node->first + k]] = 1;
        n_allowed += node->n;
        i++;
    }
    return n_allowed;
}

/* Sets to -inf the logits of the tokens that cannot come next: those whose
   bytes do not keep the text a valid prefix, and the end tokens unless the
   value is complete. Returns how many tokens stay allowed. Inside a string
   (or a free key) with room for any token, the tokens that are text are
   allowed as a whole (a copy of the trie's set) and only the subtrees that
   leave the text are read. */
static int json_mask(const JsonMatch *m, const TokenTrie *t, const Tokenizer *tok, float *logits) {
    int room = 0, n_allowed = 0;
    const int vocab = tok->vocab_size, text = text_room(m->schema, &m->state, &room), k = text == TRIE_ASCII;
    memcpy(&m->walk[0], &m->state, offsetof(JsonState, alt) + (size_t)m->state.n * sizeof(JsonStack));
    if (text && room >= t->max_chars[k]) {
        memcpy(m->allowed, t->text_tokens[k], (size_t)vocab);
        n_allowed = t->n_text_tokens[k];
        for (int e = 0; e < t->n_edges[k]; e++) {
            const TrieNode *node = &t->nodes[t->edges[k][e]];
            if (node->depth > 1) text_state_after(&m->state, node, node->depth - 1, &m->walk[node->depth - 1]);
            n_allowed += walk_trie(m, t, t->edges[k][e], node->skip, 0, 0);
        }
    } else {
        memset(m->allowed, 0, (size_t)vocab);
        n_allowed = walk_trie(m, t, 0, t->n_nodes, text, room);
    }
    if (json_complete(m->schema, &m->state))
        for (int i = 0; i < tok->n_end; i++, n_allowed++) m->allowed[tok->end[i]] = 1;
    for (int i = 0; i < vocab; i++)
        if (!m->allowed[i]) logits[i] = -INFINITY;
    return n_allowed;
}

/* Reads n bytes into st; returns 0, st as before the byte, when a byte
   cannot come. */
static int json_read(const JsonSchema *s, JsonState *st, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        JsonState next;
        json_feed(s, st, (unsigned char)p[i], &next);
        if (next.n == 0) return 0;
        *st = next;
    }
    return 1;
}

/* Reads token `token`'s bytes; returns whether the answer is then finished
   (complete, and no byte could extend it). */
static int json_take(JsonMatch *m, const TokenTrie *t, int token) {
    JsonState next;
    for (int i = 0; i < t->len[token]; i++) {
        json_feed(m->schema, &m->state, (unsigned char)t->bytes[token][i], &next);
        m->state = next;
    }
    if (!json_complete(m->schema, &m->state)) return 0;
    for (int ch = 1; ch < 256; ch++) {
        json_feed(m->schema, &m->state, ch, &next);
        if (next.n > 0) return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------ */
/* 7. The engine: requests served together (continuous batching)           */
/* ------------------------------------------------------------------------ */

/* Every mode is a driver of one engine. A request is a prompt and how to
   continue it; the engine runs the requests it is given in steps. Each step
   builds one batch of rows: one row for each sequence that is decoding (a
   sampled request has one sequence, a beam search B), then chunks of the
   prompts of newly admitted requests (chunked prefill) up to prefill_rows
   rows, so that reading a long prompt does not stall the others; each weight
   matrix is then read once for all of them. A finished request's place goes
   to the next waiting one at the next step. Since a row's arithmetic does not
   depend on the other rows of its batch, every request gets exactly what it
   would get alone. generate is one request, beam search one request of B
   sequences, each chat turn one request whose prompt is the conversation so
   far (the prefix index hands back all but its last partial block), and
   --batch many. */

typedef enum { FORMAT_TEXT, FORMAT_JSON } OutputFormat;

typedef struct {
    int prompt_tokens;      /* prompt positions computed */
    int reused_tokens;      /* prompt positions taken from the prefix index */
    double prompt_seconds;
    int generated_tokens;
    double generate_seconds;
    /* speculative decoding (printed when `speculating`) */
    int speculating;
    long long drafted;      /* tokens drafted */
    long long accepted;     /* drafted tokens the target chose too */
    long long target_passes; /* forward passes that gave a sampled request its next token(s) */
    int keeping;            /* --keep was given (printed then) */
    long long dropped;      /* positions dropped by --keep */
    long long paused;       /* times a request paused for another (see "Turns") */
} Stats;

/* How to choose the continuation of a prompt. */
typedef struct {
    float temperature;    /* sampling: 0 is greedy */
    float topp;
    uint64_t seed;
    BeamSettings beam;    /* beam search when beam.beams >= 1 */
    int n_return;         /* hypotheses returned, best first (beam search) */
    OutputFormat format;
    Controls controls;    /* processors, warpers and stop strings */
    int max_new_tokens;   /* --max-new-tokens: new tokens per reply at most; 0: no limit */
    int rolling;          /* --keep given: past the context, drop old positions (see kv_slot) */
    int keep;             /* --keep: the leading positions never dropped */
    const JsonSchema *schema; /* the answer is one JSON value valid under it (6.1); NULL: any text */
    const char *constrain_after; /* the schema holds only after the reply writes this text (a tool call's
                                    marker, 11.1), from the next byte on; NULL: from the start */
    const char *constrain_leading; /* the schema holds from a '{' that starts the reply, after its white space
                                      and then this text or not (Llama 3.1's <|python_tag|>, 11.1); a reply
                                      that starts otherwise is free; NULL: not so */
} Decoding;

/* The new tokens a continuation may have: `room` (what the positions
   allow), or fewer by --max-new-tokens. */
static int cap_new_tokens(const Decoding *d, int room) {
    return d->max_new_tokens > 0 && d->max_new_tokens < room ? d->max_new_tokens : room;
}

/* Rows of prompt read per step, at most: a prompt of that many rows reads
   each weight matrix once for all of them, and a longer one is read in
   chunks. 64 rows; 128 where the layers' matrices go in chunks of rows
   (takes_chunks: F16 and BF16 in AVX2 builds), each chunk read from memory
   once a step for all its rows. 128-token prompts on 2 Zen 3 cores, 128
   rows against 64, the median of interleaved rounds: BF16 1.107x
   (stories110M shape, 15 rounds), 1.056x and 1.071x (Llama 3.2 1B shape,
   8 and 6 rounds); F16 1.003x (stories110M) and 1.021x (1B). The int8 and
   4-bit kernels keep 64: at the 1B shape 128 gave Q8_0 0.92x, Q6_K 0.99x,
   Q4_K_M 1.02x, Q4_0 1.03x (6 rounds), and on a Xeon's tiles 0.88-0.93x. */
#define PREFILL_CHUNK 64

static int prefill_rows(const Transformer *t) {
#if SIMD_WIDTH == 8 && defined(VF_HALF_LOADS)
    if (takes_chunks(&t->weights.w1[0])) return 2 * PREFILL_CHUNK;
#endif
    (void)t;
    return PREFILL_CHUNK;
}

/* One sequence of tokens and the cache blocks of the positions computed. */
typedef struct {
    BlockTable table;
    int *tokens;    /* (cap) the prompt, then each token generated and fed back */
    int n_tokens;   /* tokens[n_cached..n_tokens-1] are still to be fed */
    int n_cached;   /* leading positions whose keys and values are in the cache */
    int n_indexed;  /* leading blocks of the table that have been offered to the prefix index */
    int cap;
} Sequence;

/* The state of a beam search between steps (see section 6 for the rules). */
typedef struct {
    int step;               /* tokens generated so far by each beam */
    float *beam_scores;     /* (B) */
    float *logprob_rows;    /* (B, vocab) log softmax of each beam's logits */
    float **logprobs;       /* (B) the row each beam continues from */
    int *generated;         /* (B, max_new) each beam's generated tokens */
    int *next_generated;    /* (B, max_new) the same after a reorder */
    int *parent, *next_token;
    float *next_scores;     /* (B) */
    Candidate *cand;        /* (3B) */
    HypothesisPool pool;
    JsonState *json, *next_json; /* (B) under a schema: each beam's answer read so far, and the same after a reorder */
} BeamState;

/* ---- Log-probabilities reported --------------------------------------------
   A request may keep, for each token it chooses, the log-probability of that
   token and of the `top` likeliest ones, under the distribution it was chosen
   from: log softmax of the logits after the logits processors (repetition
   penalty, no-repeat n-grams, minimum new tokens) and before temperature and
   the warpers, so that they add up to the JSON output's score at any
   temperature (both are log_prob of the same values). With `score_prompt`
   it keeps them for its prompt's tokens too, each predicted from the
   tokens before it by the plain logits, as -m perplexity scores a text: the
   engine then computes the logits of every prompt row (and reads the whole
   prompt, none of it taken from the prefix index). The server's logprobs
   and echo are these. */

#define MAX_TOP_LOGPROBS 20

/* One token's log-probability, and the likeliest tokens where it was chosen,
   best first (ties: the lower id first). */
typedef struct {
    int token;
    double logprob;
    int top_token[MAX_TOP_LOGPROBS];
    double top_logprob[MAX_TOP_LOGPROBS];
} TokenLogprob;

typedef struct {
    int top;                /* alternatives kept per token, 0..MAX_TOP_LOGPROBS */
    int score_prompt;       /* the prompt's tokens are scored too */
    TokenLogprob *prompt;   /* (n_prompt) prompt token p >= 1 at [p]; the first token has none */
    TokenLogprob *chosen;   /* (max_new + 1) each chosen token's, an end token that ended it included */
    int n_chosen;
    /* this step: the prompt rows read from position scored_from, their logits from logits row scored_at */
    int scored_from, scored_rows, scored_at;
} Logprobs;

static Logprobs *logprobs_new(int top, int score_prompt, int n_prompt, int max_new) {
    Logprobs *lp = xcalloc(1, sizeof(Logprobs));
    lp->top = top;
    lp->score_prompt = score_prompt;
    if (score_prompt) lp->prompt = xcalloc((size_t)n_prompt, sizeof(TokenLogprob));
    lp->chosen = xcalloc((size_t)max_new + 1, sizeof(TokenLogprob));
    return lp;
}

static void logprobs_free(Logprobs *lp) {
    if (!lp) return;
    free(lp->prompt);
    free(lp->chosen);
    free(lp);
}

/* Fills `out` for `token` from `logits` (vocab values): its log-probability
   as log_prob gives it, and the `top` likeliest tokens' (an insertion into
   the kept ones, best first). */
static void record_logprob(TokenLogprob *out, const float *logits, int vocab, int token, int top) {
    float max_val;
    double log_sum = log_normalizer(logits, vocab, &max_val);
    out->token = token;
    out->logprob = (double)logits[token] - max_val - log_sum;
    int n = 0;
    for (int i = 0; i < vocab && top > 0; i++) {
        if (n == top && !(logits[i] > logits[out->top_token[top - 1]])) continue;
        int at = n < top ? n++ : top - 1;
        for (; at > 0 && logits[i] > logits[out->top_token[at - 1]]; at--) out->top_token[at] = out->top_token[at - 1];
        out->top_token[at] = i;
    }
    for (int k = 0; k < n; k++) out->top_logprob[k] = (double)logits[out->top_token[k]] - max_val - log_sum;
}

typedef enum { REQUEST_WAITING, REQUEST_RUNNING, REQUEST_DONE } RequestState;

typedef struct Request Request;
struct Request {
    /* what is asked */
    int *prompt;            /* (n_prompt) BOS first; owned by the request */
    int n_prompt;
    int max_new;            /* tokens to generate at most */
    int stop_at_eos;        /* sampling: EOS ends the continuation as BOS does */
    Decoding d;
    int index;              /* place in the input, for ordered output (the server's: see Conn) */
    Logprobs *lp;           /* the log-probabilities to keep; NULL: none (owned by the request) */
    char *id;               /* --batch: the request's "id" as JSON text */
    const char *error;      /* set when the request cannot run */
    JsonSchema *own_schema; /* d.schema when the request owns it (--batch, the server) */
    int marker_seen;        /* bytes of d.constrain_after the reply's text ends with, so far */
    int lead;               /* under d.constrain_leading, while '{' may yet start the value: the bytes of that
                               text read after the reply's white space (0: none yet); LEAD_FREE: no longer */
    /* called with the text of each sampled token once it is safe to print
       (see StopMatcher), for streamed output; may be NULL */
    void (*on_text)(Request *r, const char *text, size_t n);
    void *owner;            /* the driver's, for on_text (the server's) */
    /* progress */
    RequestState state;
    long long arrival;      /* its place in the order of submission */
    double paused_at;       /* when it last gave its place up (see "Turns"); 0: never */
    Sequence *seqs;         /* (max(1, B)) */
    int n_seqs;
    long long promised;     /* cache blocks promised to it (its worst case) */
    long long window_promised; /* and blocks of the windowed layers' pool */
    Sampler sampler;
    StopMatcher stops;      /* sampling: the text so far, against the stop strings */
    float *raw;             /* (vocab) sampling with a score: the logits before sampling */
    BeamState *beam;        /* NULL when sampling */
    JsonMatch *json;        /* under d.schema: the answer read so far (beam search: the scratch of each beam's mask); NULL: unconstrained */
    Hypothesis *hyps;       /* (max(1, B)) the result, best first */
    int n_hyps;
    int logit_at;           /* this step: the first of its rows in the logits, -1 if none */
    int chosen;             /* this step: a sampled request's token, chosen in parallel */
    int n_draft;            /* this step: tokens drafted after its next one, all verified; -1: not speculating */
    Sequence draft;         /* drafting with a draft model: the tokens its cache holds (n_cached) and its block table there */
    double draft_budget;    /* the draft model drafts while -log(its drafts' probability) is at most this */
};

/* Speculative decoding (see its sub-section below): where drafts come from,
   and the draft model's own cache. */
typedef struct {
    int lookup;             /* --lookup N: drafts copied after an earlier N-gram; 0: the draft model */
    int draft_max;          /* --draft-max: tokens drafted per step, at most */
    Transformer *draft;     /* --draft: the draft model (its own RunState, and a cache with a block table per request); NULL with lookup */
    /* the draft model's steps: rows (draft->state.max_rows), and its requests of a step (parallel) */
    int *row_token, *row_pos, *logit_rows;
    const BlockTable **row_table;
    Request **drafting;
    int *fed, *logit_at;    /* (parallel) each drafting request's rows in the step, and its logits' place (-1: none) */
    double *surprise;       /* (parallel) -log of each one's drafts' probability so far */
} Speculator;

typedef struct {
    Transformer *t;
    const Tokenizer *tok;   /* BOS, the end tokens, and the text that stop strings are matched in */
    int parallel;           /* requests running at once, at most */
    Request **queue;        /* (n_queue) submitted, in order; waiting ones from `next_waiting` */
    int n_queue, cap_queue, next_waiting;
    Request **running;      /* (parallel) */
    int n_running;
    int turn;               /* tokens a request generates before one that has had less may take its place; 0: first come, first served */
    Request **paused;       /* (n_paused) running requests that gave their places up, their cache given back */
    int n_paused, cap_paused;
    long long arrivals;     /* requests submitted so far */
    /* the rows of the current step */
    int *row_token, *row_pos, *logit_rows;  /* (max_rows) */
    const BlockTable **row_table;           /* (max_rows) */
    Sequence **row_seq;                     /* (max_rows) */
    void (*on_done)(Request *r, void *user);
    void *user;
    Speculator *spec;       /* greedy requests draft and verify several tokens per step; NULL: off */
    TokenTrie *trie;        /* the vocabulary's trie, built for the first request under a schema */
    Stats stats;
} Engine;


/* ---- Sequences ------------------------------------------------------------ */

static void sequence_init(Sequence *s, const int *tokens, int n, int cap) {
    memset(s, 0, sizeof(*s));
    s->cap = cap > n ? cap : n;
    s->tokens = xcalloc((size_t)s->cap, sizeof(int));
    if (n > 0) memcpy(s->tokens, tokens, (size_t)n * sizeof(int)); /* tokens may be NULL when n is 0 */
    s->n_tokens = n;
}

static void sequence_free(KVCache *c, Sequence *s) {
    table_free(c, &s->table);
    free(s->tokens);
    memset(s, 0, sizeof(*s));
}

/* dst (initialised, same cap) becomes a copy of src sharing its blocks. */
static void sequence_copy(KVCache *c, Sequence *dst, const Sequence *src) {
    table_copy(c, &dst->table, &src->table);
    memcpy(dst->tokens, src->tokens, (size_t)src->n_tokens * sizeof(int));
    dst->n_tokens = src->n_tokens;
    dst->n_cached = src->n_cached;
    dst->n_indexed = src->n_indexed;
}

static void sequence_push(Sequence *s, int token) { s->tokens[s->n_tokens++] = token; }

/* Offers the blocks that have become full to the prefix index: a block
   indexed while pending is now ready; another is indexed if the block
   before it is. */
static void sequence_index_blocks(KVCache *c, Sequence *s) {
    /* a table that drops positions (--keep) offers those before its first
       drop only: after it, a block's positions are no longer the index's */
    int cached = s->table.slots > 0 && s->n_cached > s->table.slots ? s->table.slots : s->n_cached;
    for (; s->n_indexed < cached / KV_BLOCK; s->n_indexed++) {
        int i = s->n_indexed, b = s->table.ids[i], parent = i > 0 ? s->table.ids[i - 1] : -1;
        if (c->state[b] == BLOCK_PENDING) c->state[b] = BLOCK_READY;
        else if (parent < 0 || c->state[parent] != BLOCK_PLAIN)
            prefix_add(c, b, parent, s->tokens + (size_t)i * KV_BLOCK, BLOCK_READY);
    }
}

/* ---- Requests ------------------------------------------------------------- */

/* A request for the continuation of prompt (n_prompt tokens, BOS first; the
   request takes ownership) with at most max_new tokens. */
static Request *request_new(int *prompt, int n_prompt, int max_new, int stop_at_eos, const Decoding *d) {
    Request *r = xcalloc(1, sizeof(Request));
    r->prompt = prompt;
    r->n_prompt = n_prompt;
    r->max_new = max_new;
    r->stop_at_eos = stop_at_eos;
    r->d = *d;
    r->n_seqs = d->beam.beams > 0 ? d->beam.beams : 1;
    r->hyps = xcalloc((size_t)r->n_seqs, sizeof(Hypothesis));
    return r;
}

static void request_free(Request *r) {
    for (int i = 0; i < r->n_hyps; i++) free_hypothesis(&r->hyps[i]);
    free(r->hyps);
    free(r->prompt);
    free(r->id);
    logprobs_free(r->lp);
    free_schema(r->own_schema);
    free(r);
}

/* The most positions a request computes: its prompt and every generated
   token but the last. */
static int request_positions(const Request *r) { return r->n_prompt + (r->max_new > 0 ? r->max_new - 1 : 0); }

/* The most cache blocks the request can hold at once, with a context of
   `context` positions (--keep holds no more, however far it goes): each
   sequence's own blocks (shared ones counted for each holder), and one more
   for the moment a copy on write holds both the copy and the original. */
static long long request_blocks(const Request *r, int context) {
    int positions = request_positions(r);
    if (r->d.rolling && positions > context) positions = context;
    long long per_seq = (positions + KV_BLOCK - 1) / KV_BLOCK;
    return (long long)r->n_seqs * per_seq + (r->n_seqs > 1);
}

/* The same for the windowed layers' pool of c (see "Windowed layers"): each
   sequence holds no more than a window's span of it; 0 without one. */
static long long request_window_blocks(const Request *r, const KVCache *c) {
    if (!c->win) return 0;
    long long per_seq = (request_positions(r) + KV_BLOCK - 1) / KV_BLOCK;
    if (per_seq > c->window_span) per_seq = c->window_span;
    return (long long)r->n_seqs * per_seq + (r->n_seqs > 1);
}

/* Whether r could ever fit the cache c, empty. */
static int request_fits(const Request *r, const KVCache *c, int context) {
    return request_blocks(r, context) <= c->n_blocks && (!c->win || request_window_blocks(r, c) <= c->win->n_blocks);
}

static void beam_state_free(BeamState *b) {
    if (!b) return;
    free(b->beam_scores); free(b->logprob_rows); free(b->logprobs); free(b->generated); free(b->next_generated);
    free(b->parent); free(b->next_token); free(b->next_scores); free(b->cand);
    free(b->json); free(b->next_json);
    free(b);
}

/* Takes back the blocks promised to r, in each pool. */
static void release_promise(KVCache *c, Request *r) {
    c->promised -= r->promised;
    r->promised = 0;
    if (c->win) c->win->promised -= r->window_promised;
    r->window_promised = 0;
}

/* Ends a request: its hypotheses are final, its cache blocks and working
   memory are given back. */
static void request_finish(Engine *e, Request *r) {
    KVCache *c = &e->t->state.cache;
    if (r->beam) {
        r->n_hyps = r->beam->pool.n;
        sort_best_first(r->hyps, r->n_hyps);
    }
    for (int i = 0; i < r->n_seqs && r->seqs; i++) sequence_free(c, &r->seqs[i]);
    free(r->seqs);
    if (r->draft.tokens) sequence_free(&e->spec->draft->state.cache, &r->draft);
    r->seqs = NULL;
    beam_state_free(r->beam);
    r->beam = NULL;
    free(r->raw);
    r->raw = NULL;
    json_match_free(r->json);
    r->json = NULL;
    free_sampler(&r->sampler);
    free_stop_matcher(&r->stops);
    r->stops.held = NULL;
    release_promise(c, r);
    r->state = REQUEST_DONE;
}

/* ---- Ctrl-C ----------------------------------------------------------------
   The first SIGINT only sets a flag: generation stops at the next token,
   keeping what it printed, and the program ends with status 130 (or, in
   chat, the reply ends and the next message is asked for). A second one
   while the first is pending ends the program at once. While a line is read
   from stdin, the signal interrupts the read, which ends the chat. */

#define EXIT_INTERRUPTED 130 /* 128 + SIGINT, as the shell reports it */

static volatile sig_atomic_t interrupt_pending;
static int interrupts_caught; /* whether the handler is installed (main does; tests do not) */

static void on_interrupt(int sig) {
    (void)sig;
    if (interrupt_pending) _Exit(EXIT_INTERRUPTED);
    interrupt_pending = 1;
}

/* Installs the handler; `restart` as on_sigint (section "Platform"). */
static void catch_interrupts(int restart) {
    on_sigint(on_interrupt, restart);
    interrupts_caught = 1;
}

/* Whether Ctrl-C asked generation to stop. */
static int interrupted(void) { return interrupt_pending != 0; }

/* Forgets a Ctrl-C that has been acted on (a chat reply it ended). */
static void clear_interrupt(void) { interrupt_pending = 0; }

/* ---- Choosing tokens -------------------------------------------------------- */

/* The lead of a reply under d.constrain_leading (Request's lead), read on
   by byte ch of its text: the bytes of `text` matched after the white
   space, LEAD_VALUE when ch is the value's '{', LEAD_FREE when the value
   can no longer start. */
enum { LEAD_FREE = -1, LEAD_VALUE = -2 };

static int lead_step(const char *text, int lead, int ch) {
    if (ch == '{' && (lead == 0 || text[lead] == '\0')) return LEAD_VALUE;
    if (lead == 0 && isspace(ch)) return 0;
    return text[lead] != '\0' && ch == (unsigned char)text[lead] ? lead + 1 : LEAD_FREE;
}

/* The lead after n bytes p (stopped at the first that decides); *at: the
   offset of the '{' when LEAD_VALUE. */
static int lead_after(const char *text, int lead, const char *p, int n, int *at) {
    for (*at = 0; *at < n && lead >= 0; ++*at) {
        lead = lead_step(text, lead, (unsigned char)p[*at]);
        if (lead == LEAD_VALUE) break;
    }
    return lead;
}

/* The mask of a step where the reply may yet start the value (r->lead >=
   0): a token whose bytes start it is allowed only when the schema takes
   them from the '{' on; every other token stays free. (Tokens outside the
   trie, special ones, are free: their text starts no value.) */
static void lead_mask(const Engine *e, const Request *r, float *logits) {
    const TokenTrie *t = e->trie;
    for (int i = 0; i < e->tok->vocab_size; i++) {
        int at;
        if (!t->bytes[i] || lead_after(r->d.constrain_leading, r->lead, t->bytes[i], t->len[i], &at) != LEAD_VALUE) continue;
        JsonState st;
        json_start(&st);
        if (!json_read(r->d.schema, &st, t->bytes[i] + at, (size_t)(t->len[i] - at))) logits[i] = -INFINITY;
    }
}

/* The choice of a sampled request's next token (the first half of
   sample_step, below): the token, and with
   JSON output its log-probability added to the score. It touches nothing but
   the request (its sampler, scratch and score), so the requests of a step
   choose in parallel (engine_step). */
static int choose_token(const Engine *e, Request *r, float *logits) {
    const int vocab = e->t->config.vocab_size;
    const Controls *ctl = &r->d.controls;
    const Sequence *s = &r->seqs[0];
    if (r->json && json_mask(r->json, e->trie, e->tok, logits) == 0) return -1;
    if (r->lead >= 0) lead_mask(e, r, logits);
    process_logits(ctl, e->tok, s->tokens, s->n_tokens, r->hyps[0].n_tokens, logits);
    if (r->json && !(logits[sample_argmax(logits, vocab)] > -INFINITY)) return -1; /* the controls banned every allowed token */
    if (r->raw) memcpy(r->raw, logits, (size_t)vocab * sizeof(float));
    int next = sample_with_controls(&r->sampler, ctl, logits);
    if (r->raw) r->hyps[0].score += log_prob(r->raw, vocab, next);
    if (r->lp) record_logprob(&r->lp->chosen[r->lp->n_chosen++], r->raw, vocab, next, r->lp->top);
    return next;
}

/* Keeps the log-probabilities of the prompt tokens that r's prompt rows of
   this step predict (see Logprobs), from their logits. */
static void score_prompt_rows(const Engine *e, Request *r, const float *logits) {
    Logprobs *lp = r->lp;
    const int vocab = e->t->config.vocab_size;
    for (int k = 0; lp && k < lp->scored_rows; k++) {
        int p = lp->scored_from + k + 1; /* the token row k predicts */
        if (p >= r->n_prompt) break;
        record_logprob(&lp->prompt[p], logits + (size_t)(lp->scored_at + k) * vocab, vocab, r->prompt[p], lp->top);
    }
}

/* Ends a request at Ctrl-C: every token it has is fed. */
static void finish_interrupted(Engine *e, Request *r) {
    r->hyps[0].stop = "interrupted";
    request_finish(e, r);
}

/* Reads a reply's next text for d.constrain_after: once the reply has
   written the marker, the schema's constraint starts, with the bytes of the
   text after the marker read. Returns 0 when those bytes already break it. */
static int constrain_from_marker(Engine *e, Request *r, const char *text) {
    const char *marker = r->d.constrain_after;
    for (const char *p = text; *p && !r->json; p++) {
        if (*p != marker[r->marker_seen]) r->marker_seen = 0; /* (the marker's first byte comes nowhere else in it) */
        if (*p == marker[r->marker_seen] && marker[++r->marker_seen] == '\0')
            r->json = json_match_new(r->d.schema, e->trie, e->t->config.vocab_size);
        if (!r->json) continue;
        return json_read(r->json->schema, &r->json->state, p + 1, strlen(p + 1));
    }
    return 1;
}

/* Reads a reply's next text for d.constrain_leading: once it starts the
   value, the schema's constraint starts, with the bytes from its '{' read.
   Returns 0 when those bytes break it (a token lead_mask did not read). */
static int constrain_from_lead(Engine *e, Request *r, const char *text) {
    int at, n = (int)strlen(text);
    r->lead = lead_after(r->d.constrain_leading, r->lead, text, n, &at);
    if (r->lead != LEAD_VALUE) return 1;
    r->lead = LEAD_FREE;
    r->json = json_match_new(r->d.schema, e->trie, e->t->config.vocab_size);
    return json_read(r->json->schema, &r->json->state, text + at, (size_t)(n - at));
}

/* The second half: takes the chosen token (see sample_step). */
static void take_token(Engine *e, Request *r, int next) {
    Hypothesis *h = &r->hyps[0];
    Sequence *s = &r->seqs[0];
    int ended = next < 0 || next == e->tok->bos || ((r->stop_at_eos || r->json) && is_eos_token(e->tok, next));
    if (ended) h->stop = next < 0 ? "constraint" : end_reason(e->tok, next);
    else {
        const char *piece = decode(e->tok, s->tokens[s->n_tokens - 1], next);
        h->tokens[h->n_tokens++] = next;
        e->stats.generated_tokens++;
        if (piece_is_printable(e->tok, piece)) {
            size_t n_safe;
            const char *safe = stop_feed(&r->stops, piece, &n_safe);
            if (r->on_text) r->on_text(r, safe, n_safe);
        }
        int before_marker = !r->json && (r->d.constrain_after || r->lead >= 0) && piece_is_printable(e->tok, piece);
        if (before_marker && !(r->d.constrain_after ? constrain_from_marker(e, r, piece) : constrain_from_lead(e, r, piece))) {
            h->stop = "constraint";
            ended = 1;
        } else if (r->stops.matched) {
            h->stop = "string";
            h->stop_string = r->stops.matched;
            ended = 1;
        } else if (r->json && !before_marker && json_take(r->json, e->trie, next)) {
            h->stop = "json";
            ended = 1;
        } else if (h->n_tokens == r->max_new) {
            ended = 1;
        }
    }
    if (!ended) {
        sequence_push(s, next);
        return;
    }
    size_t n_rest;
    const char *rest = stop_rest(&r->stops, &n_rest);
    if (r->on_text && n_rest > 0) r->on_text(r, rest, n_rest);
    request_finish(e, r);
}

/* A sampled request's next token from its logits row (overwritten), under
   its controls: ends it at BOS (or EOS when stop_at_eos), after max_new
   tokens, at Ctrl-C (stop "interrupted": every token it has is fed), or when
   its text would contain a stop string (that token is kept, not fed), else
   feeds the token back. Text output never prints the score, so only JSON
   output keeps a copy of the logits to score the choice. */
static void sample_step(Engine *e, Request *r, float *logits) {
    if (interrupted()) finish_interrupted(e, r);
    else take_token(e, r, choose_token(e, r, logits));
}

/* The scores beam search ranks a sequence's continuations by, into `out`
   (vocab values): log softmax(logits) and then the processors, as the
   library's beam search has them; one beam is the library's greedy search,
   whose processors act on the logits before. The sequence holds the prompt
   and its n_new generated tokens. */
static void beam_token_scores(const Controls *ctl, const Tokenizer *tok, int beams, const Sequence *s, int n_new, float *logits,
                              float *out, int vocab) {
    if (beams == 1) process_logits(ctl, tok, s->tokens, s->n_tokens, n_new, logits);
    log_softmax(out, logits, vocab);
    if (beams > 1) process_logits(ctl, tok, s->tokens, s->n_tokens, n_new, out);
}

static BeamState *beam_state_new(int B, int vocab, int max_new) {
    BeamState *b = xcalloc(1, sizeof(BeamState));
    b->beam_scores = xcalloc((size_t)B, sizeof(float));
    b->logprob_rows = xcalloc((size_t)B * vocab, sizeof(float));
    b->logprobs = xcalloc((size_t)B, sizeof(float *));
    b->generated = xcalloc((size_t)B * max_new, sizeof(int));
    b->next_generated = xcalloc((size_t)B * max_new, sizeof(int));
    b->parent = xcalloc((size_t)B, sizeof(int));
    b->next_token = xcalloc((size_t)B, sizeof(int));
    b->next_scores = xcalloc((size_t)B, sizeof(float));
    b->cand = xcalloc(3 * (size_t)B, sizeof(Candidate));
    return b;
}

/* One step of beam search (the rules in section 6) on the logits of the B
   beams, or at the first step of the prompt's last row: every beam starts as
   the prompt, but only the first one expands (the others score -1e9), so
   the B beams come out distinct. Beam j then continues beam parent[j]: it
   takes a copy of that beam's block table, sharing its blocks (the partly
   filled last one is copied when written), and feeds its new token. */
static void beam_step(Engine *e, Request *r, float *logits) {
    KVCache *c = &e->t->state.cache;
    const int B = r->d.beam.beams, vocab = e->t->config.vocab_size, max_new = r->max_new;
    BeamState *bs = r->beam;
    if (r->json && bs) /* each beam's tokens that keep its answer valid (serially: one scratch) */
        for (int j = 0; j < B; j++) {
            r->json->state = bs->json[j];
            json_mask(r->json, e->trie, e->tok, logits + (size_t)j * vocab);
        }
    if (!bs) {
        bs = r->beam = beam_state_new(B, vocab, max_new);
        bs->pool = (HypothesisPool){r->hyps, 0, 1e9};
        if (r->json) {
            json_mask(r->json, e->trie, e->tok, logits);
            bs->json = xcalloc((size_t)B, sizeof(JsonState));
            bs->next_json = xcalloc((size_t)B, sizeof(JsonState));
            for (int j = 0; j < B; j++) bs->json[j] = r->json->state;
        }
        beam_token_scores(&r->d.controls, e->tok, B, &r->seqs[0], 0, logits, bs->logprob_rows, vocab);
        for (int j = 0; j < B; j++) {
            bs->logprobs[j] = bs->logprob_rows;
            bs->beam_scores[j] = j == 0 ? 0.0f : -1e9f;
            if (j > 0) sequence_copy(c, &r->seqs[j], &r->seqs[0]);
        }
    } else {
        for (int j = 0; j < B; j++) bs->logprobs[j] = bs->logprob_rows + (size_t)j * vocab;
        /* each beam's scores touch its own rows only; threads where the
           exponentials are worth waking them for (as gated_activation) */
        PARALLEL_FOR_IF(20.0 * B * vocab >= PARALLEL_MIN_WORK)
        for (int j = 0; j < B; j++)
            beam_token_scores(&r->d.controls, e->tok, B, &r->seqs[j], bs->step, logits + (size_t)j * vocab, bs->logprobs[j], vocab);
    }
    const int step = bs->step;
    int n_cand = top_candidates(bs->beam_scores, bs->logprobs, B, vocab, bs->cand, 3 * B), n_next = 0;
    for (int rank = 0; n_next < B; rank++) {
        /* stop strings can take more than the 2B places that end tokens
           can: then the walk goes on down the ranking */
        if (rank == n_cand) {
            if (n_cand == B * vocab || !(bs->cand[n_cand - 1].score > -INFINITY)) break; /* the rest are masked */
            n_cand = more_candidates(bs->beam_scores, bs->logprobs, B, vocab, &bs->cand, n_cand);
        }
        Candidate cd = bs->cand[rank];
        if (!(cd.score > -INFINITY)) break; /* a masked token (a schema), and all after it */
        const int *beam_tokens = bs->generated + (size_t)cd.beam * max_new;
        const char *stop_string = is_end_token(e->tok, cd.token) ? NULL
                                  : continuation_stop(&r->d.controls, e->tok, r->prompt[r->n_prompt - 1], beam_tokens, step, cd.token);
        if (is_end_token(e->tok, cd.token)) {
            if (rank >= B) continue;
            Hypothesis h = make_hypothesis(beam_tokens, step, end_reason(e->tok, cd.token));
            pool_add(&bs->pool, &r->d.beam, h, cd.score, step + 1);
        } else if (stop_string) {
            /* a stop string ends a hypothesis as an end token does, but the
               token that completed it stays in the hypothesis */
            if (rank >= B) continue;
            Hypothesis h = make_hypothesis(beam_tokens, step, "string");
            h.tokens[h.n_tokens++] = cd.token;
            h.stop_string = stop_string;
            pool_add(&bs->pool, &r->d.beam, h, cd.score, step + 1);
        } else if (r->json && (r->json->state = bs->json[cd.beam], json_take(r->json, e->trie, cd.token))) {
            /* the answer is complete: a hypothesis, its last token kept */
            if (rank >= B) continue;
            Hypothesis h = make_hypothesis(beam_tokens, step, "json");
            h.tokens[h.n_tokens++] = cd.token;
            pool_add(&bs->pool, &r->d.beam, h, cd.score, step + 1);
        } else {
            if (r->json) bs->next_json[n_next] = r->json->state;
            bs->parent[n_next] = cd.beam;
            bs->next_token[n_next] = cd.token;
            bs->next_scores[n_next++] = cd.score;
        }
    }
    if (n_next == 0) { /* under a schema every continuation may have ended */
        e->stats.generated_tokens++;
        request_finish(e, r);
        return;
    }
    for (int j = n_next; j < B; j++) { /* too few left (a schema): copies that never win */
        bs->parent[j] = bs->parent[0];
        bs->next_token[j] = bs->next_token[0];
        bs->next_scores[j] = -INFINITY;
        if (r->json) bs->next_json[j] = bs->next_json[0];
    }
    int generated = step + 1, done = pool_is_done(&bs->pool, &r->d.beam, bs->cand[0].score, generated, max_new);
    /* reorder: beam j continues beam parent[j] with next_token[j] */
    Sequence *next = xcalloc((size_t)B, sizeof(Sequence));
    for (int j = 0; j < B; j++) {
        const Sequence *from = &r->seqs[bs->parent[j]];
        sequence_init(&next[j], from->tokens, 0, from->cap);
        sequence_copy(c, &next[j], from);
        memcpy(bs->next_generated + (size_t)j * max_new, bs->generated + (size_t)bs->parent[j] * max_new, (size_t)step * sizeof(int));
        bs->next_generated[(size_t)j * max_new + step] = bs->next_token[j];
        bs->beam_scores[j] = bs->next_scores[j];
    }
    for (int j = 0; j < B; j++) {
        sequence_free(c, &r->seqs[j]);
        r->seqs[j] = next[j];
    }
    free(next);
    int *swap = bs->generated; bs->generated = bs->next_generated; bs->next_generated = swap;
    JsonState *swap_json = bs->json; bs->json = bs->next_json; bs->next_json = swap_json;
    bs->step++;
    e->stats.generated_tokens++;
    if (done) {
        request_finish(e, r);
        return;
    }
    if (generated == max_new || interrupted()) { /* the length limit (or Ctrl-C): running beams join the pool */
        for (int j = 0; j < B; j++)
            if (bs->beam_scores[j] > -INFINITY)
                pool_add(&bs->pool, &r->d.beam, make_hypothesis(bs->generated + (size_t)j * max_new, generated, "length"),
                         bs->beam_scores[j], generated);
        request_finish(e, r);
        return;
    }
    for (int j = 0; j < B; j++) sequence_push(&r->seqs[j], bs->next_token[j]);
}

/* ---- Speculative decoding ---------------------------------------------------
   Decoding reads every weight once per token. Reading them once for a few
   rows costs about the same, so a sampled (not beam search) request guesses
   (drafts) up to K tokens after its next one and the engine feeds the next
   token and the K drafts as consecutive rows of one step; the target's
   choice at each row decides (greedy, or a draw with the request's sampler:
   the same draw as without speculation). The drafts are accepted while each equals the choice at
   the row before it, and the choice at the first mismatch (or after the last
   draft) is one more token for free. Each row's choice goes through
   sample_step with the sequence up to that row, so the controls, the end
   tokens, the length limit, stop strings, scores and streamed text are
   exactly those of one token per step, and since a row's arithmetic does not
   depend on its batch, so are the tokens. Rejected drafts' keys and values
   are left where they are and overwritten when those positions are fed
   again; the sequence's n_cached only ever counts accepted positions, so the
   prefix index (which takes full blocks below n_cached) never holds a
   rejected token. Drafts never go past the request's length limit, so they
   stay inside the blocks promised to it.
   Drafts come from prompt lookup (--lookup N: what followed the latest
   earlier occurrence of the last N tokens, copied on, the copy reading its
   own drafts where it runs into them) or from a draft model (--draft: a
   smaller model, or a cheaper export of the same one, run greedily on its own
   cache, where each request has a block table that rolls back to the
   longest prefix it shares with the request's tokens; the requests of a step
   draft together, a row each per draft model pass). Each request's draft
   model stops drafting when the product of its
   probabilities for its drafts falls below a threshold that follows the
   acceptance: exp(-budget), where the budget (in nats, starting at log 2)
   doubles after a step whose drafts were all accepted and halves after a
   step with a rejected one (the threshold squared, or its square root).
   Drafts then settle near the length at which half the steps take all of
   them: long when the draft agrees with the model, short when it does not,
   whatever the scale of the draft's probabilities (a model with random
   weights is never sure). The first draft is always made. */

/* Drafts after tokens[0..n-1] by prompt lookup (N-grams of `size` tokens)
   into tokens[n..]; returns how many, at most k_max. */
static int draft_by_lookup(int size, int *tokens, int n, int k_max) {
    if (n <= size) return 0;
    const int *tail = tokens + n - size;
    for (int j = n - size - 1; j >= 0; j--) {
        if (memcmp(tokens + j, tail, (size_t)size * sizeof(int)) != 0) continue;
        for (int k = 0; k < k_max; k++) tokens[n + k] = tokens[j + size + k]; /* j + size + k < n + k */
        return k_max;
    }
    return 0;
}

/* The draft model's greedy token from its logits, and its probability. */
static int draft_choice(const float *logits, int vocab, double *prob) {
    int best = sample_argmax(logits, vocab);
    double sum = 0;
    for (int i = 0; i < vocab; i++) sum += exp((double)logits[i] - logits[best]);
    *prob = 1.0 / sum;
    return best;
}

/* Rolls r's draft sequence back to the longest prefix its cache shares with
   r's tokens (the last one is always fed again, for its logits) and gives it
   the rest of them to feed. */
static void draft_sync(Request *r) {
    Sequence *ds = &r->draft;
    const Sequence *s = &r->seqs[0];
    if (!ds->tokens) {
        sequence_init(ds, NULL, 0, s->cap);
        r->draft_budget = log(2.0);
    }
    int common = 0;
    while (common < ds->n_cached && common < s->n_tokens && ds->tokens[common] == s->tokens[common]) common++;
    ds->n_cached = common < s->n_tokens ? common : s->n_tokens - 1;
    memcpy(ds->tokens + ds->n_cached, s->tokens + ds->n_cached, (size_t)(s->n_tokens - ds->n_cached) * sizeof(int));
    ds->n_tokens = s->n_tokens;
}

/* One step of the draft model over the requests sp->drafting[0..n-1]: each
   one's tokens still to feed, as many as fit in its rows (a long catch-up
   takes several steps), with the logits of the last one wanted. */
static float *draft_model_step(Speculator *sp, int n) {
    Transformer *t = sp->draft;
    KVCache *c = &t->state.cache;
    int rows = 0, n_logits = 0;
    for (int i = 0; i < n; i++) {
        Sequence *ds = &sp->drafting[i]->draft;
        int room = t->state.max_rows - rows, pending = ds->n_tokens - ds->n_cached;
        sp->fed[i] = pending < room ? pending : room;
        sp->logit_at[i] = sp->fed[i] == pending && pending > 0 ? n_logits : -1;
        for (int j = 0; j < sp->fed[i]; j++, rows++) {
            int pos = ds->n_cached + j;
            table_prepare_write(c, &ds->table, pos);
            sp->row_token[rows] = ds->tokens[pos];
            sp->row_pos[rows] = pos;
            sp->row_table[rows] = &ds->table;
        }
        if (sp->logit_at[i] >= 0) sp->logit_rows[n_logits++] = rows - 1;
    }
    Batch b = {rows, sp->row_token, sp->row_pos, sp->row_table, sp->logit_rows, n_logits};
    return forward(t, &b);
}

/* Drafts with the draft model for the requests sp->drafting[0..n-1] at once,
   after each one's pending token, at most r->n_draft tokens each (the cap on
   entry; the count drafted on return), into its tokens still to feed. */
static void draft_by_model(Speculator *sp, int n) {
    const int vocab = sp->draft->config.vocab_size;
    for (int i = 0; i < n; i++) {
        draft_sync(sp->drafting[i]);
        sp->surprise[i] = 0.0;
    }
    int *cap = xcalloc((size_t)n, sizeof(int));
    for (int i = 0; i < n; i++) {
        cap[i] = sp->drafting[i]->n_draft;
        sp->drafting[i]->n_draft = 0;
    }
    for (int active = n; active > 0;) {
        float *logits = draft_model_step(sp, n);
        active = 0;
        for (int i = 0; i < n; i++) {
            Request *r = sp->drafting[i];
            Sequence *ds = &r->draft, *s = &r->seqs[0];
            ds->n_cached += sp->fed[i];
            if (sp->logit_at[i] < 0) { /* done drafting, or still catching up */
                active += ds->n_cached < ds->n_tokens;
                continue;
            }
            double prob;
            int next = draft_choice(logits + (size_t)sp->logit_at[i] * vocab, vocab, &prob);
            sp->surprise[i] -= log(prob);
            if (r->n_draft > 0 && sp->surprise[i] > r->draft_budget) continue;
            s->tokens[s->n_tokens++] = next;
            r->n_draft++;
            if (r->n_draft == cap[i]) continue;
            sequence_push(ds, next);
            active++;
        }
    }
    free(cap);
}

/* Drafts the next tokens of every running request that speculates (sampled,
   not beam search, with its next token pending) after that token, into its
   sequence as tokens still to feed; sets each request's n_draft (-1: not
   speculating this step). */
static void speculate(Engine *e) {
    Speculator *sp = e->spec;
    int n = 0;
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        Sequence *s = &r->seqs[0];
        r->n_draft = -1;
        if (!sp || r->d.beam.beams > 0 || s->n_tokens - s->n_cached != 1) continue;
        if (r->json || r->d.constrain_after || r->d.constrain_leading) { /* drafts are not checked against the schema: this request goes a token at a time */
            static int noted;
            if (!noted) fprintf(stderr, "run: note: speculative decoding is off for answers under a JSON schema\n");
            noted = 1;
            continue;
        }
        int k_max = r->max_new - r->hyps[0].n_tokens - 1; /* the last new token is never fed */
        r->n_draft = k_max < sp->draft_max ? (k_max > 0 ? k_max : 0) : sp->draft_max;
        if (r->n_draft == 0) continue;
        if (sp->lookup) {
            r->n_draft = draft_by_lookup(sp->lookup, s->tokens, s->n_tokens, r->n_draft);
            s->n_tokens += r->n_draft;
        } else {
            sp->drafting[n++] = r;
        }
    }
    if (n > 0) draft_by_model(sp, n);
    for (int i = 0; i < e->n_running; i++) e->stats.drafted += e->running[i]->n_draft > 0 ? e->running[i]->n_draft : 0;
}

/* Verifies r's drafts on the logits of its rows (the pending token's, then
   one per draft): chooses at each row as sample_step does, with the
   sequence up to that row, while the choice equals the draft fed after it.
   With sampling (-t > 0) each row draws the random number that the plain
   run would draw for that token, so the output is the same; a draft is then
   accepted with its probability under the model, as in standard speculative
   sampling with a draft that is certain of its tokens. */
static void verify_step(Engine *e, Request *r, float *logits) {
    KVCache *c = &e->t->state.cache;
    const int vocab = e->t->config.vocab_size, k = r->n_draft;
    Sequence *s = &r->seqs[0];
    const int first = s->n_cached; /* the position of the pending token */
    int *draft = xcalloc((size_t)k + 1, sizeof(int));
    memcpy(draft, s->tokens + first + 1, (size_t)k * sizeof(int));
    int accepted = 0;
    for (int i = 0; i <= k; i++) {
        s->n_cached = s->n_tokens = first + i + 1;
        sequence_index_blocks(c, s);
        table_leave_window(c, &s->table, s->n_cached);
        sample_step(e, r, logits + (size_t)i * vocab);
        if (r->state == REQUEST_DONE || i == k || s->tokens[first + i + 1] != draft[i]) break;
        accepted++;
    }
    free(draft);
    e->stats.accepted += accepted;
    double *budget = &r->draft_budget;
    if (k > 0) *budget = accepted == k ? fmin(*budget * 2, 1e4) : fmax(*budget / 2, 1e-3);
}

static Speculator *speculator_new(int lookup, int draft_max, Transformer *draft) {
    Speculator *sp = xcalloc(1, sizeof(Speculator));
    sp->lookup = lookup;
    sp->draft_max = draft_max;
    sp->draft = draft;
    return sp;
}

/* Gives the draft model rows for `parallel` requests and a cache for as
   many sequences of `context` positions. */
static void speculator_setup(Speculator *sp, int parallel, int context, int prefill) {
    if (!sp->draft) return;
    int rows = parallel + prefill, blocks_each = (context + KV_BLOCK - 1) / KV_BLOCK;
    alloc_run_state(&sp->draft->state, &sp->draft->config, rows, context, parallel * blocks_each, 0, KV_F32);
    sp->row_token = xcalloc((size_t)rows, sizeof(int));
    sp->row_pos = xcalloc((size_t)rows, sizeof(int));
    sp->logit_rows = xcalloc((size_t)rows, sizeof(int));
    sp->row_table = xcalloc((size_t)rows, sizeof(BlockTable *));
    sp->drafting = xcalloc((size_t)parallel, sizeof(Request *));
    sp->fed = xcalloc((size_t)parallel, sizeof(int));
    sp->logit_at = xcalloc((size_t)parallel, sizeof(int));
    sp->surprise = xcalloc((size_t)parallel, sizeof(double));
}

static void speculator_free(Speculator *sp) {
    if (!sp) return;
    if (sp->draft && sp->drafting) free_run_state(&sp->draft->state);
    free(sp->row_token); free(sp->row_pos); free(sp->logit_rows); free(sp->row_table);
    free(sp->drafting); free(sp->fed); free(sp->logit_at); free(sp->surprise);
    free(sp);
}

/* ---- The engine ------------------------------------------------------------- */

static void engine_init(Engine *e, Transformer *t, const Tokenizer *tok, int parallel) {
    memset(e, 0, sizeof(*e));
    e->t = t;
    e->tok = tok;
    e->parallel = parallel;
    e->running = xcalloc((size_t)parallel, sizeof(Request *));
    size_t rows = (size_t)t->state.max_rows;
    e->row_token = xcalloc(rows, sizeof(int));
    e->row_pos = xcalloc(rows, sizeof(int));
    e->logit_rows = xcalloc(rows, sizeof(int));
    e->row_table = xcalloc(rows, sizeof(BlockTable *));
    e->row_seq = xcalloc(rows, sizeof(Sequence *));
}

static void engine_free(Engine *e) {
    token_trie_free(e->trie);
    free(e->queue); free(e->running); free(e->paused); free(e->row_token); free(e->row_pos); free(e->logit_rows);
    free(e->row_table); free(e->row_seq);
    memset(e, 0, sizeof(*e));
}

/* Adds a request at the end of the queue. */
static void engine_submit(Engine *e, Request *r) {
    if (e->next_waiting == e->n_queue) e->n_queue = e->next_waiting = 0; /* all started: the queue starts over */
    if (e->n_queue == e->cap_queue && e->next_waiting > e->cap_queue / 2) {
        /* a stream of requests (--batch from a pipe) may never let the queue
           empty: the started ones make room instead */
        e->n_queue -= e->next_waiting;
        memmove(e->queue, e->queue + e->next_waiting, (size_t)e->n_queue * sizeof(Request *));
        e->next_waiting = 0;
    }
    if (e->n_queue == e->cap_queue) {
        e->cap_queue = e->cap_queue ? 2 * e->cap_queue : 16;
        Request **q = realloc(e->queue, (size_t)e->cap_queue * sizeof(Request *));
        if (!q) die(EXIT_BAD_FILE, "out of memory (queue of %d requests)", e->cap_queue);
        e->queue = q;
    }
    r->state = REQUEST_WAITING;
    r->arrival = e->arrivals++;
    e->queue[e->n_queue++] = r;
}

static void engine_done(Engine *e, Request *r) {
    if (e->on_done) e->on_done(r, e->user);
}

/* How many of the n blocks `matched` of a prompt's prefix (prefix_match) a
   request can take in a cache with windowed layers: as many as leave the
   partners of the window before the position it resumes at all kept. */
static int window_resumable(const KVCache *c, const int *matched, int n) {
    for (; n > 0; n--) {
        int i = window_first_block(c, n * KV_BLOCK);
        while (i < n && c->partner[matched[i]] >= 0) i++;
        if (i == n) break;
    }
    return n;
}

/* Blocks of the first n_tokens of `tokens` (a prompt, or a paused request's
   tokens) that the prefix index holds ready: their count, or -1 when the
   next one is still being computed by a running request (the request then
   waits for it rather than compute it a second time). The last token is
   always computed, for its logits. In a cache with windowed layers, only
   as many as window_resumable allows. */
static int prefix_match(const KVCache *c, const int *tokens, int n_tokens, int *blocks) {
    int n = 0, parent = -1;
    for (; (n + 1) * KV_BLOCK <= n_tokens - 1; n++) {
        int b = prefix_find(c, parent, tokens + (size_t)n * KV_BLOCK);
        if (b < 0) break;
        if (c->state[b] == BLOCK_PENDING) return -1;
        blocks[n] = parent = b;
    }
    return c->win ? window_resumable(c, blocks, n) : n;
}

/* Gives s (empty) the blocks of its tokens: the first n_matched from the
   prefix index (`matched`), cached already (with the partners of the window
   before them, in a cache with windowed layers); then the main blocks of
   the rest, each full one indexed as pending, so that another request with
   the same tokens waits for it rather than computes it too. Their partners
   come as the rows are computed, a window's at a time (table_prepare_write). */
static void sequence_take_blocks(Engine *e, Sequence *s, const int *matched, int n_matched) {
    KVCache *c = &e->t->state.cache;
    for (int i = 0; i < n_matched; i++) {
        block_hold(c, matched[i]);
        table_push(&s->table, matched[i]);
    }
    if (c->win) {
        s->table.wfirst = window_first_block(c, n_matched * KV_BLOCK);
        s->table.wend = n_matched;
        for (int i = s->table.wfirst; i < n_matched; i++) block_hold(c->win, c->partner[matched[i]]);
    }
    s->n_cached = n_matched * KV_BLOCK;
    s->n_indexed = n_matched;
    e->stats.reused_tokens += s->n_cached;
    for (int pos = s->n_cached; pos < s->n_tokens; pos += KV_BLOCK) {
        table_push(&s->table, block_take(c));
        int i = pos / KV_BLOCK;
        if ((i + 1) * KV_BLOCK <= s->n_tokens) prefix_add(c, s->table.ids[i], i > 0 ? s->table.ids[i - 1] : -1,
                                                          s->tokens + (size_t)i * KV_BLOCK, BLOCK_PENDING);
    }
}

/* Whether the blocks r may need (its worst case, in each pool) can be
   promised now. */
static int cache_has_room(const KVCache *c, const Request *r, int context) {
    return c->promised + request_blocks(r, context) <= c->n_blocks &&
           (!c->win || c->win->promised + request_window_blocks(r, c) <= c->win->n_blocks);
}

/* Promises r the blocks it may need (its worst case, in each pool). */
static void promise_blocks(KVCache *c, Request *r, int context) {
    r->promised = request_blocks(r, context);
    c->promised += r->promised;
    r->window_promised = c->win ? request_window_blocks(r, c) : 0;
    if (c->win) c->win->promised += r->window_promised;
}

/* Starts r: promises its blocks, takes the blocks of its prompt's prefix
   from the index, and takes (and indexes, as pending) the blocks the rest of
   its prompt will fill. Returns 0 when r must wait. */
static int engine_start(Engine *e, Request *r) {
    Transformer *t = e->t;
    KVCache *c = &t->state.cache;
    if (!cache_has_room(c, r, t->config.seq_len)) return 0;
    int *matched = xcalloc((size_t)r->n_prompt / KV_BLOCK + 1, sizeof(int));
    int n_matched = r->lp && r->lp->score_prompt ? 0 : prefix_match(c, r->prompt, r->n_prompt, matched);
    if (n_matched < 0) {
        free(matched);
        return 0;
    }
    promise_blocks(c, r, t->config.seq_len);
    r->seqs = xcalloc((size_t)r->n_seqs, sizeof(Sequence));
    int cap = r->n_prompt + r->max_new;
    for (int j = 0; j < r->n_seqs; j++) sequence_init(&r->seqs[j], r->prompt, j == 0 ? r->n_prompt : 0, cap);
    Sequence *s = &r->seqs[0];
    if (r->d.rolling) {
        s->table.slots = t->config.seq_len;
        s->table.keep = r->d.keep;
    }
    sequence_take_blocks(e, s, matched, n_matched);
    free(matched);
    init_sampler(&r->sampler, t->config.vocab_size, r->d.temperature, r->d.topp, r->d.seed);
    if (r->d.schema && !e->trie) e->trie = token_trie_new(e->tok);
    if (r->d.schema && !r->d.constrain_after && !r->d.constrain_leading) r->json = json_match_new(r->d.schema, e->trie, t->config.vocab_size);
    r->lead = r->d.constrain_leading ? 0 : LEAD_FREE;
    r->stops = stop_matcher(&r->d.controls);
    if (r->d.beam.beams == 0 && (r->d.format == FORMAT_JSON || r->lp)) r->raw = xcalloc((size_t)t->config.vocab_size, sizeof(float));
    if (r->d.beam.beams == 0) r->hyps[0] = (Hypothesis){xcalloc((size_t)r->max_new + 1, sizeof(int)), 0, 0.0, "length", NULL};
    r->n_hyps = r->d.beam.beams == 0;
    r->state = REQUEST_RUNNING;
    return 1;
}

/* ---- Turns ---------------------------------------------------------------
   First come, first served makes a request that arrives behind long ones
   wait for all of them: behind 100 streams of 400 tokens, a 40-token answer
   waits for 40000 tokens. The server (turn > 0) gives every request's first
   `turn` tokens before anyone's later ones: a request that waits for its
   first turn takes the place of a running one past its first turn, which
   pauses. A paused request gives its cache blocks back (the full ones stay
   in the prefix index while nobody needs their memory) and keeps its
   tokens; it resumes, in order of arrival, when no request waits for its
   first turn, reading its tokens again as a prompt (from the prefix index
   where its blocks are still there). A row's arithmetic does not depend on
   its batch, so its continuation is the one it would have had. Past their
   first turns requests run first come, first served, so a batch of long
   ones pauses each at most once while no new one comes. One paused for
   PAUSE_AGE seconds counts as new again (before those that came after it),
   so that a crowd of short requests cannot keep it out for ever. Beams,
   drafts of a draft model, --keep and requests that score their prompt keep
   their places. */

#define PAUSE_AGE 5.0

/* 1 for a request past its first turn (and not paused for PAUSE_AGE), else 0. */
static int service_level(const Engine *e, const Request *r) {
    if (!r->seqs || (r->paused_at > 0 && now_seconds() - r->paused_at >= PAUSE_AGE)) return 0;
    return r->seqs[0].n_tokens - r->n_prompt >= e->turn;
}

/* Whether running request r may pause for another: it samples one
   sequence, has read its prompt, and nothing else holds state in a cache. */
static int takes_turns(const Request *r) {
    return r->d.beam.beams == 0 && !r->d.rolling && !(r->lp && r->lp->score_prompt) && !r->draft.tokens &&
           r->seqs[0].n_cached >= r->n_prompt && r->max_new > 0;
}

/* Pauses running[i]: its blocks and promise given back, its tokens kept. */
static void engine_pause(Engine *e, int i) {
    KVCache *c = &e->t->state.cache;
    Request *r = e->running[i];
    Sequence *s = &r->seqs[0];
    table_clear(c, &s->table);
    s->n_cached = s->n_indexed = 0;
    release_promise(c, r);
    e->stats.paused++;
    r->paused_at = now_seconds();
    r->state = REQUEST_WAITING; /* a server that stops refuses it, as it refuses those not started */
    memmove(e->running + i, e->running + i + 1, (size_t)(--e->n_running - i) * sizeof(Request *));
    if (e->n_paused == e->cap_paused) {
        e->cap_paused = e->cap_paused ? 2 * e->cap_paused : 16;
        Request **p = realloc(e->paused, (size_t)e->cap_paused * sizeof(Request *));
        if (!p) die(EXIT_BAD_FILE, "out of memory (%d paused requests)", e->cap_paused);
        e->paused = p;
    }
    e->paused[e->n_paused++] = r;
}

/* Resumes paused request r: promises its blocks again and takes those of its
   tokens the prefix index still holds. Returns 0 when it must wait (a block
   it needs is being computed). */
static int engine_resume(Engine *e, Request *r) {
    KVCache *c = &e->t->state.cache;
    Sequence *s = &r->seqs[0];
    int *matched = xcalloc((size_t)s->n_tokens / KV_BLOCK + 1, sizeof(int));
    int n_matched = prefix_match(c, s->tokens, s->n_tokens, matched);
    if (n_matched >= 0) {
        promise_blocks(c, r, e->t->config.seq_len);
        sequence_take_blocks(e, s, matched, n_matched);
        r->state = REQUEST_RUNNING;
    }
    free(matched);
    return n_matched >= 0;
}

/* The request to start next, or NULL: the first waiting one, or a paused
   one of a lower level (*paused_at: its place among the paused; -1 for the
   waiting one); among equals, the earlier arrival. */
static Request *next_to_start(const Engine *e, int *paused_at) {
    Request *best = e->next_waiting < e->n_queue ? e->queue[e->next_waiting] : NULL;
    int best_level = 0;
    *paused_at = -1;
    for (int i = 0; i < e->n_paused; i++) {
        Request *r = e->paused[i];
        int level = service_level(e, r);
        if (!best || level < best_level || (level == best_level && r->arrival < best->arrival)) {
            best = r;
            best_level = level;
            *paused_at = i;
        }
    }
    return best;
}

/* Pauses a running request of a level above `level` that takes turns (the
   latest arrival of the highest level); 0 when there is none. */
static int pause_one_above(Engine *e, int level) {
    int victim = -1, victim_level = level;
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        if (!takes_turns(r)) continue;
        int l = service_level(e, r);
        if (l > victim_level || (victim >= 0 && l == victim_level && r->arrival > e->running[victim]->arrival)) {
            victim = i;
            victim_level = l;
        }
    }
    if (victim >= 0) engine_pause(e, victim);
    return victim >= 0;
}

/* Moves waiting (and paused) requests to the running ones while there is
   room: a place among `parallel`, and the cache blocks each may need; in
   order of arrival, or with turns, of level (see "Turns"), pausing a
   running request of a higher level when there is no room. A request that
   needs more blocks than the whole cache fails at once. */
static void engine_admit(Engine *e) {
    const KVCache *c = &e->t->state.cache;
    int at;
    for (Request *r; (r = next_to_start(e, &at)) != NULL;) {
        if (at < 0 && !request_fits(r, c, e->t->config.seq_len)) {
            r->error = "the request needs more key/value cache than --kv-mb allows";
            r->state = REQUEST_DONE;
            e->next_waiting++;
            engine_done(e, r);
            continue;
        }
        if (e->n_running == e->parallel || !cache_has_room(c, r, e->t->config.seq_len)) {
            if (e->turn > 0 && pause_one_above(e, service_level(e, r))) continue;
            return;
        }
        if (!(at < 0 ? engine_start(e, r) : engine_resume(e, r))) return;
        if (at < 0) e->next_waiting++;
        else e->paused[at] = e->paused[--e->n_paused];
        e->running[e->n_running++] = r;
    }
}

/* Whether requests wait to start or resume. */
static int engine_waiting(const Engine *e) { return e->next_waiting < e->n_queue || e->n_paused > 0; }

/* Adds sequence s's next `rows` tokens to the step's batch; the last one's
   logits are wanted when it is the last token s has, every row's when they
   are drafts to verify (`verify`: then verify_step, not the step, counts
   the positions that stay cached) or prompt rows to score (`every`). */
static int add_rows(Engine *e, int n, Sequence *s, int rows, int *n_logits, int verify, int every) {
    KVCache *c = &e->t->state.cache;
    for (int i = 0; i < rows; i++, n++) {
        int at = s->n_cached + i, pos = at; /* the token's index, and its position */
        if (s->table.slots > 0 && at >= s->table.slots) { /* --keep: full, one row per step from here */
            table_drop_oldest(&s->table);
            e->stats.dropped++;
            pos = s->table.slots - 1;
        }
        table_prepare_write(c, &s->table, pos);
        e->row_token[n] = s->tokens[at];
        e->row_pos[n] = pos;
        e->row_table[n] = &s->table;
        e->row_seq[n] = verify ? NULL : s;
        if (verify || every || at == s->n_tokens - 1) e->logit_rows[(*n_logits)++] = n;
    }
    return n;
}

/* Builds the step's rows: every decoding sequence's next token first, then
   prompt chunks, prefill_rows rows in all, in the order requests started.
   Returns the row count; *n_prompt_rows of them read prompts. */
static int engine_gather(Engine *e, int *n_logits, int *n_prompt_rows) {
    int n = 0, budget = prefill_rows(e->t);
    *n_logits = 0;
    speculate(e);
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        r->logit_at = -1;
        if (r->lp) r->lp->scored_rows = 0;
        if (r->n_draft >= 0) {
            r->logit_at = *n_logits;
            n = add_rows(e, n, &r->seqs[0], 1 + r->n_draft, n_logits, 1, 0);
            continue;
        }
        if (r->seqs[0].n_tokens - r->seqs[0].n_cached != 1) continue;
        r->logit_at = *n_logits;
        int live = r->beam ? r->n_seqs : 1;
        for (int j = 0; j < live; j++) n = add_rows(e, n, &r->seqs[j], 1, n_logits, 0, 0);
    }
    *n_prompt_rows = 0;
    for (int i = 0; i < e->n_running && budget > 0; i++) {
        Request *r = e->running[i];
        Sequence *s = &r->seqs[0];
        int pending = s->n_tokens - s->n_cached;
        if (r->logit_at >= 0 || pending == 0) continue;
        int rows = pending < budget ? pending : budget, every = r->lp && r->lp->score_prompt;
        if (every) {
            r->lp->scored_from = s->n_cached;
            r->lp->scored_rows = rows;
            r->lp->scored_at = *n_logits;
        }
        if (rows == pending) r->logit_at = *n_logits + (every ? rows - 1 : 0);
        n = add_rows(e, n, s, rows, n_logits, 0, every);
        budget -= rows;
        *n_prompt_rows += rows;
    }
    return n;
}

/* One step: admit, gather rows, run them through the model, and let each
   request choose from its logits. Returns whether any request is left. */
static int engine_step(Engine *e) {
    engine_admit(e);
    if (e->n_running == 0) return engine_waiting(e);
    double t0 = now_seconds();
    int n_logits, n_prompt_rows, n = engine_gather(e, &n_logits, &n_prompt_rows);
    Batch b = {n, e->row_token, e->row_pos, e->row_table, e->logit_rows, n_logits};
    float *logits = forward(e->t, &b);
    KVCache *c = &e->t->state.cache;
    for (int i = 0; i < n; i++) {
        if (!e->row_seq[i]) continue; /* a draft's row: verify_step counts it */
        e->row_seq[i]->n_cached++;
        sequence_index_blocks(c, e->row_seq[i]);
        table_leave_window(c, &e->row_seq[i]->table, e->row_seq[i]->n_cached);
    }
    const int vocab = e->t->config.vocab_size, stop_now = interrupted();
    for (int i = 0; i < e->n_running; i++) score_prompt_rows(e, e->running[i], logits);
    /* sampled requests choose their tokens in parallel (a choice touches only
       its own request: softmax and top-p over the vocabulary are the costly
       part), then everything else happens in order */
    PARALLEL_FOR_IF(e->n_running > 1 && !stop_now)
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        if (r->logit_at >= 0 && r->max_new > 0 && r->d.beam.beams == 0 && r->n_draft < 0 && !stop_now)
            r->chosen = choose_token(e, r, logits + (size_t)r->logit_at * vocab);
    }
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        if (r->logit_at < 0) continue;
        float *row = logits + (size_t)r->logit_at * vocab;
        if (r->max_new == 0) {
            request_finish(e, r); /* it only reads its prompt */
            continue;
        }
        if (r->d.beam.beams > 0) beam_step(e, r, row);
        else if (r->n_draft >= 0) verify_step(e, r, row);
        else if (stop_now) finish_interrupted(e, r);
        else take_token(e, r, r->chosen);
        e->stats.target_passes += r->d.beam.beams == 0;
    }
    /* the share of the step's time spent on prompt rows counts as prompt time */
    double seconds = now_seconds() - t0, prompt_share = (double)n_prompt_rows / n;
    e->stats.prompt_tokens += n_prompt_rows;
    e->stats.prompt_seconds += seconds * prompt_share;
    e->stats.generate_seconds += seconds * (1.0 - prompt_share);
    int kept = 0;
    for (int i = 0; i < e->n_running; i++) {
        Request *r = e->running[i];
        if (r->state == REQUEST_DONE) engine_done(e, r);
        else e->running[kept++] = r;
    }
    e->n_running = kept;
    return e->n_running > 0 || engine_waiting(e);
}

static void engine_run(Engine *e) {
    while (engine_step(e)) {}
}

/* Drops r, waiting, paused or running (a client that went away): its cache blocks
   and working memory are given back at once, and on_done is not called.
   The caller frees r. */
static void engine_cancel(Engine *e, Request *r) {
    for (int i = e->next_waiting; i < e->n_queue; i++) {
        if (e->queue[i] != r) continue;
        memmove(e->queue + i, e->queue + i + 1, (size_t)(e->n_queue - i - 1) * sizeof(Request *));
        e->n_queue--;
        r->state = REQUEST_DONE;
        return;
    }
    for (int i = 0; i < e->n_paused; i++) {
        if (e->paused[i] != r) continue;
        request_finish(e, r);
        e->paused[i] = e->paused[--e->n_paused];
        return;
    }
    for (int i = 0; i < e->n_running; i++) {
        if (e->running[i] != r) continue;
        request_finish(e, r);
        memmove(e->running + i, e->running + i + 1, (size_t)(e->n_running - i - 1) * sizeof(Request *));
        e->n_running--;
        return;
    }
}

/* ------------------------------------------------------------------------ */
/* 8. Drivers: generate, tokenize, chat; perplexity of a text              */
/* ------------------------------------------------------------------------ */

static const char *const kv_type_names[] = {"f32", "f16", "q8_0"}; /* by KV_F32.. */

/* The stats line; last, the cache's type and the most of it held at once. */
static void print_stats(const Engine *e) {
    const Stats *st = &e->stats;
    const KVCache *c = &e->t->state.cache;
    double prompt_rate = st->prompt_seconds > 0 ? st->prompt_tokens / st->prompt_seconds : 0;
    double gen_rate = st->generate_seconds > 0 ? st->generated_tokens / st->generate_seconds : 0;
    fprintf(stderr, "stats: prompt %d tokens, %d reused, %.1f tok/s; generated %d tokens, %.1f tok/s",
            st->prompt_tokens, st->reused_tokens, prompt_rate, st->generated_tokens, gen_rate);
    if (st->speculating)
        fprintf(stderr, "; drafted %lld, accepted %lld (%.2f tokens per target pass)", st->drafted, st->accepted,
                st->target_passes > 0 ? (double)st->generated_tokens / (double)st->target_passes : 0.0);
    double peak = kv_block_bytes(c) * c->peak_held + (c->win ? kv_block_bytes(c->win) * c->win->peak_held : 0);
    fprintf(stderr, ", kv %s %.2f MB peak", kv_type_names[c->type], peak / 1e6);
    if (st->keeping) fprintf(stderr, "; %lld positions dropped (--keep)", st->dropped);
    fputc('\n', stderr);
}

/* Flushes stdout; when the reader has gone (a closed pipe), there is no one
   left to generate for, so the program stops with a one-line message. */
static void flush_output(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) die(EXIT_BAD_FILE, "cannot write to stdout: %s", strerror(errno));
}


/* Encodes `text` after a BOS. Returns NULL when it needs more than `room`
   positions; text longer than room * max_token_length bytes is refused before
   encoding, since no token spans more bytes than that. */
static int *encode_prompt(const Tokenizer *tok, const char *text, int room, int *n_tokens) {
    size_t len = strlen(text);
    if (len / (size_t)tok->max_token_length > (size_t)room) return NULL;
    int *tokens = xcalloc(encode_capacity(tok, len), sizeof(int));
    int bad_byte = 0;
    *n_tokens = encode(tok, text, 1, 0, tokens, &bad_byte);
    if (*n_tokens < 0) {
        free(tokens);
        die(EXIT_BAD_FILE, "the tokenizer has no token for the byte 0x%02X in the prompt", bad_byte);
    }
    if (*n_tokens > room) {
        free(tokens);
        return NULL;
    }
    return tokens;
}

/* `s` as a JSON string (quotes included); bytes that are not valid UTF-8
   become U+FFFD. The caller frees it. */
static char *json_quote(const char *s) {
    const unsigned char *p = (const unsigned char *)s;
    char *out = xcalloc(6 * strlen(s) + 3, 1), *o = out;
    *o++ = '"';
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
        if (!valid) { o += sprintf(o, "\\ufffd"); p++; continue; }
        if (len > 1) { memcpy(o, p, (size_t)len); o += len; p += len; continue; }
        if (c == '"' || c == '\\') o += sprintf(o, "\\%c", c);
        else if (c == '\n') o += sprintf(o, "\\n");
        else if (c == '\t') o += sprintf(o, "\\t");
        else if (c < 0x20 || c == 0x7f) o += sprintf(o, "\\u%04x", c);
        else *o++ = (char)c;
        p++;
    }
    *o++ = '"';
    return out;
}

/* Writes `s` as a JSON string (see json_quote). */
static void print_json_string(const char *s) {
    char *quoted = json_quote(s);
    fputs(quoted, stdout);
    free(quoted);
}


/* One JSON line for a returned sequence; `id` (JSON text) leads it when
   given, `extra` (JSON object members; NULL: none) ends it. */
static void print_json_hypothesis_with(const Tokenizer *tok, const char *id, int rank, const Hypothesis *h, int last_prompt_token,
                                       const char *extra) {
    char *text = hypothesis_text(tok, h, last_prompt_token);
    if (id) printf("{\"id\":%s,", id);
    else putchar('{');
    printf("\"rank\":%d,\"score\":%.6f,\"tokens\":[", rank, h->score);
    for (int i = 0; i < h->n_tokens; i++) printf(i ? ",%d" : "%d", h->tokens[i]);
    printf("],\"text\":");
    print_json_string(text);
    printf(",\"stop\":\"%s\"", h->stop);
    if (h->stop_string) {
        printf(",\"stop_string\":");
        print_json_string(h->stop_string);
    }
    if (extra) printf(",%s", extra);
    printf("}\n");
    free(text);
}

static void print_json_hypothesis(const Tokenizer *tok, const char *id, int rank, const Hypothesis *h, int last_prompt_token) {
    print_json_hypothesis_with(tok, id, rank, h, last_prompt_token, NULL);
}

/* Prints the best n_show hypotheses: in text mode after the prompt (or, with
   several, each in a block with its rank and score); in JSON one line each.
   Sampled text has already been streamed (`streamed`): only its end of line
   is left to print. */
static void print_results(const Tokenizer *tok, OutputFormat format, const Hypothesis *hyps, int n_show, int last_prompt_token,
                          const char *prompt_text, int streamed) {
    if (format == FORMAT_JSON) {
        for (int i = 0; i < n_show; i++) print_json_hypothesis(tok, NULL, i + 1, &hyps[i], last_prompt_token);
        return;
    }
    for (int i = 0; i < n_show; i++) {
        if (n_show > 1) printf("%s[rank %d] score %.6f, stop %s\n%s", i ? "\n" : "", i + 1, hyps[i].score, hyps[i].stop, prompt_text);
        if (!streamed) {
            char *text = hypothesis_text(tok, &hyps[i], last_prompt_token);
            fputs(text, stdout);
            free(text);
        }
        if (n_show > 1) printf("\n");
    }
    if (n_show <= 1) printf("\n");
}

/* What a cache for t costs (engine_setup): the bytes of a block of the main
   pool and of the windowed layers' pool (0 without one), and the blocks of
   that pool a sequence holds at once, at most (request_window_blocks). */
typedef struct {
    double main_bytes, window_bytes;
    int span;
} CacheShape;

static CacheShape cache_shape(const Transformer *t, int kv_type, const Speculator *spec) {
    const Config *p = &t->config;
    int windowed = 0;
    for (int l = 0; l < p->n_layers; l++) windowed += layer_windowed(p, l);
    double row = kv_rows_of(p) * kv_row_bytes(kv_type, kv_dim_of(p)) * KV_BLOCK;
    CacheShape shape = {row * (p->n_layers - windowed), row * windowed, 0};
    if (windowed > 0) {
        /* a sequence feeds up to a prompt chunk or its drafts a step, and
           holds the blocks from where the window of its first reaches back
           to that of its last */
        int rows = spec && spec->draft_max + 1 > prefill_rows(t) ? spec->draft_max + 1 : prefill_rows(t);
        shape.span = (p->window + rows - 2) / KV_BLOCK + 2;
    }
    return shape;
}

/* Main blocks a request of `beams` sequences (1: sampled) of `positions`
   positions may hold (as request_blocks), and blocks of the windowed
   layers' pool. */
static double request_main_blocks(int beams, int positions) {
    return (double)beams * ((positions + KV_BLOCK - 1) / KV_BLOCK) + (beams > 1);
}

static double request_span_blocks(const CacheShape *shape, int beams, int positions) {
    if (shape->window_bytes == 0) return 0;
    return (double)beams * fmin((positions + KV_BLOCK - 1) / KV_BLOCK, shape->span) + (beams > 1);
}

/* The windowed layers' pool for `parallel` sampled requests of `positions`,
   or one of `beams`, at once: the windows of every sequence at once, as the
   main pool holds their whole length. */
static double windows_wanted(const CacheShape *shape, int parallel, int beams, int positions) {
    return fmax(parallel * request_span_blocks(shape, 1, positions), request_span_blocks(shape, beams, positions));
}

static double cache_bytes(const CacheShape *shape, double main_blocks, double window_blocks) {
    return main_blocks * shape->main_bytes + window_blocks * shape->window_bytes;
}

/* Sets up e and t's activations and cache for `parallel` requests of
   `beams` sequences (1 when sampling) and `context` positions each: by
   default a cache that holds all of them at full length, or kv_mb MiB of it
   in kv_type (then requests that do not fit wait); drafting with `spec`
   (NULL: no speculation), whose drafts take rows too. */
static void engine_setup(Engine *e, Transformer *t, const Tokenizer *tok, int parallel, int beams, int context, int kv_mb,
                         int kv_type, Speculator *spec) {
    const Config *p = &t->config;
    const CacheShape shape = cache_shape(t, kv_type, spec);
    double main_blocks = parallel * request_main_blocks(beams, context), window_blocks = windows_wanted(&shape, parallel, beams, context);
    if (kv_mb > 0) {
        /* kv_mb MiB: the windows wanted, the rest main blocks; a budget too
           small for that, as many blocks in each pool, so that whatever
           fitted one pool of every layer still fits */
        double bytes = kv_mb * 1048576.0, even = floor(bytes / (shape.main_bytes + shape.window_bytes));
        if (even <= window_blocks) main_blocks = window_blocks = even;
        else main_blocks = floor((bytes - window_blocks * shape.window_bytes) / shape.main_bytes);
    }
    if (main_blocks < 1) main_blocks = 1;
    if (shape.window_bytes > 0 && window_blocks < 1) window_blocks = 1;
    if (main_blocks > INT_MAX / KV_BLOCK || window_blocks > INT_MAX / KV_BLOCK)
        die(EXIT_BAD_FILE, "the key/value cache would need %.0f blocks of %d positions, too many", fmax(main_blocks, window_blocks), KV_BLOCK);
    alloc_run_state(&t->state, p, parallel * (beams + (spec ? spec->draft_max : 0)) + prefill_rows(t), context, (int)main_blocks,
                    (int)window_blocks, kv_type);
    t->state.cache.window_span = shape.span;
    engine_init(e, t, tok, parallel);
    if (spec) speculator_setup(spec, parallel, context, prefill_rows(t));
    e->spec = spec;
    e->stats.speculating = spec != NULL;
}

/* Prints a sampled continuation's text as it comes. */
static void stream_text(Request *r, const char *text, size_t n) {
    (void)r;
    fwrite(text, 1, n, stdout);
    flush_output();
}

/* Stops the program when r could never fit the whole cache (--kv-mb): the
   engine would end it with nothing generated, and the modes that run one
   request at a time would print nothing and succeed. Called before anything
   of r is printed. */
static void require_room(const Engine *e, const Request *r) {
    const KVCache *c = &e->t->state.cache;
    if (request_fits(r, c, e->t->config.seq_len)) return;
    const int beams = r->d.beam.beams;
    if (request_blocks(r, e->t->config.seq_len) <= c->n_blocks)
        die(EXIT_USAGE, "the key/value cache is too small for this request: its windowed layers need %lld blocks of %d "
            "positions and --kv-mb leaves room for %d; raise --kv-mb", request_window_blocks(r, c), KV_BLOCK, c->win->n_blocks);
    if (beams > 1)
        die(EXIT_USAGE, "the key/value cache is too small for this request: it needs %d positions for each of %d beams "
            "and --kv-mb leaves room for %d in all; raise --kv-mb, or lower -n or -b", request_positions(r), beams,
            e->t->state.cache.n_blocks * KV_BLOCK);
    die(EXIT_USAGE, "the key/value cache is too small for this request: it needs %d positions and --kv-mb leaves "
        "room for %d; raise --kv-mb, or lower -n", request_positions(r), e->t->state.cache.n_blocks * KV_BLOCK);
}

/* Runs r alone to its end. */
static void run_alone(Engine *e, Request *r) {
    require_room(e, r);
    engine_submit(e, r);
    engine_run(e);
}

/* A prompt of more tokens than the `steps` positions: llama2.c reads (and
   prints) the first `steps` of them and generates nothing. So does run: a
   request with nothing to generate reads them, and stderr says so, naming
   the limit: -n, or the context (-n 0, or -n beyond it). */
static void read_prompt_that_fits(Engine *e, const int *tokens, int n_tokens, int steps) {
    const char *limit = steps == e->t->config.seq_len ? "the model's context" : "-n";
    fprintf(stderr, "run: warning: the prompt is %d tokens (BOS included) but %s allows %d positions: "
            "printing the %d that fit, generating nothing\n", n_tokens, limit, steps, steps);
    int *head = xcalloc((size_t)steps, sizeof(int));
    memcpy(head, tokens, (size_t)steps * sizeof(int));
    Decoding greedy = {.topp = 0.9f, .seed = 1, .beam = {0, 1.0f, STOP_HEURISTIC}, .n_return = 1, .format = FORMAT_TEXT};
    Request *r = request_new(head, steps, 0, 0, &greedy);
    run_alone(e, r);
    request_free(r);
}

/* Generates from a prompt, as llama2.c does: the prompt's tokens are forced
   and printed, then the continuation is chosen until `steps` positions are
   used (prompt included) or it ends. Sampling ends at BOS only, exactly as in
   llama2.c (a sampled EOS prints as its piece and generation goes on), so
   that the output stays byte-identical; beam search ends hypotheses at BOS or
   EOS, as the library does. Sampled text streams to stdout as it comes. */
static void generate(Engine *e, const Tokenizer *tok, const Decoding *d, int *prompt_tokens, int n_prompt, int steps) {
    if (d->rolling && n_prompt > e->t->config.seq_len && steps > e->t->config.seq_len)
        die(EXIT_USAGE, "the prompt is %d tokens (BOS included), more than the model's context of %d positions; "
            "--keep drops generated positions, not the prompt's", n_prompt, e->t->config.seq_len);
    if (n_prompt > steps) read_prompt_that_fits(e, prompt_tokens, n_prompt, steps);
    /* llama2.c prints each prompt token as it forces it, up to `steps` */
    int n_forced = n_prompt - 1 < steps ? n_prompt - 1 : steps, last_prompt_token = prompt_tokens[n_prompt - 1];
    char *prompt_text = decode_text(tok, prompt_tokens[0], prompt_tokens + 1, n_forced);
    int several = d->format == FORMAT_TEXT && d->n_return > 1 && d->beam.beams > 0;
    Request *r = steps >= n_prompt ? request_new(prompt_tokens, n_prompt, cap_new_tokens(d, steps - n_prompt + 1),
                                                 tok->eos_ends_generate, d) : NULL;
    if (r) require_room(e, r);
    if (d->format == FORMAT_TEXT && !several) {
        fputs(prompt_text, stdout);
        flush_output();
    }
    int stream = d->format == FORMAT_TEXT && d->beam.beams == 0;
    if (r) {
        r->on_text = stream ? stream_text : NULL;
        run_alone(e, r);
        print_results(tok, d->format, r->hyps, r->n_hyps < d->n_return ? r->n_hyps : d->n_return, last_prompt_token, prompt_text, stream);
        request_free(r);
    } else {
        Hypothesis none = make_hypothesis(NULL, 0, "length");
        print_results(tok, d->format, &none, 1, last_prompt_token, prompt_text, stream);
        free_hypothesis(&none);
        free(prompt_tokens);
    }
    flush_output();
    print_stats(e);
    free(prompt_text);
}

/* The piece -m tokenize shows for a token: its vocabulary entry as stored
   (a leading space kept, byte tokens as <0xNN>), "<s>" and "</s>" for BOS and
   EOS, whose entries in tokenizer.bin are wrapped in newlines. */
static const char *token_piece(const Tokenizer *tok, int token) {
    if (tok->fixed_ids && token == TOKEN_BOS) return "<s>";
    if (tok->fixed_ids && token == TOKEN_EOS) return "</s>";
    return tok->vocab[token];
}

/* -m tokenize: the prompt's tokens, BOS first, as generation feeds them. In
   text mode one line per token, `id -> 'piece'` with the id right-aligned in
   6 columns, as llama.cpp's tokenize tool prints them; in JSON one line
   {"tokens":[...],"pieces":[...]}. */
static void print_tokens(const Tokenizer *tok, const char *prompt, OutputFormat format) {
    int n;
    int *tokens = encode_prompt(tok, prompt, INT_MAX, &n);
    if (format == FORMAT_TEXT)
        for (int i = 0; i < n; i++) printf("%6d -> '%s'\n", tokens[i], token_piece(tok, tokens[i]));
    else {
        printf("{\"tokens\":[");
        for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", tokens[i]);
        printf("],\"pieces\":[");
        for (int i = 0; i < n; i++) {
            if (i) putchar(',');
            print_json_string(token_piece(tok, tokens[i]));
        }
        printf("]}\n");
    }
    flush_output();
    free(tokens);
}

/* Reads one line of any length from stdin after printing `guide` (text mode),
   without its newline. Returns NULL at end of input or Ctrl-C. The caller
   frees it. */
static char *read_line(const char *guide, OutputFormat format) {
    if (format == FORMAT_TEXT) {
        fputs(guide, stdout);
        flush_output();
    }
    char *line = NULL;
    size_t cap = 0;
    if (interrupts_caught) catch_interrupts(0); /* Ctrl-C ends the read */
    ptrdiff_t len = read_line_raw(&line, &cap, stdin);
    if (interrupts_caught) catch_interrupts(1);
    if (len < 0) {
        free(line);
        return NULL;
    }
    if (len > 0 && line[len - 1] == '\n') line[len - 1] = '\0';
    else if (format == FORMAT_TEXT && isatty(STDIN_FILENO)) putchar('\n'); /* Ctrl-D ended it: the reply goes on its own line */
    return line;
}

/* The Llama 2 chat template for one user turn, as text; the system prompt
   goes into the first turn only. */
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

/* Appends the tokens of `text` (no BOS) to `out` at *n, `room` ids long in
   all; returns 0 when they do not fit. */
static int append_text_tokens(const Tokenizer *tok, const char *text, int *out, int *n, int room) {
    size_t len = strlen(text);
    if (len / (size_t)tok->max_token_length > (size_t)(room - *n)) return 0;
    int *ids = xcalloc(encode_capacity(tok, len), sizeof(int)), bad_byte = 0;
    int count = encode(tok, text, 0, 0, ids, &bad_byte);
    if (count < 0) die(EXIT_BAD_FILE, "the tokenizer has no token for the byte 0x%02X in the prompt", bad_byte);
    int fits = count <= room - *n;
    if (fits) memcpy(out + *n, ids, (size_t)count * sizeof(int));
    if (fits) *n += count;
    free(ids);
    return fits;
}

/* The special token `name` that the chat template needs. */
static int template_token(const Tokenizer *tok, const char *name) {
    int id = tok->special ? lookup_special(tok, name) : -1;
    if (id < 0)
        die(EXIT_USAGE, "the %s chat template needs the token %s, which this tokenizer lacks (use --chat-template llama2)",
            chat_family_names[tok->chat_template], name);
    return id;
}

/* Appends one Llama 3 message, <|start_header_id|>role<|end_header_id|>\n\n
   content as it is, and (unless content is NULL: the header that opens the
   reply) <|eot_id|>. */
static int append_llama3_header_text(const Tokenizer *tok, const char *role, const char *content, int *out, int *n, int room) {
    if (*n + 2 > room) return 0;
    out[(*n)++] = template_token(tok, "<|start_header_id|>");
    if (!append_text_tokens(tok, role, out, n, room) || *n + 1 > room) return 0;
    out[(*n)++] = template_token(tok, "<|end_header_id|>");
    char *text = xcalloc(strlen(content ? content : "") + 3, 1);
    sprintf(text, "\n\n%s", content ? content : "");
    int fits = append_text_tokens(tok, text, out, n, room);
    free(text);
    if (!fits || !content) return fits;
    if (*n + 1 > room) return 0;
    out[(*n)++] = template_token(tok, "<|eot_id|>");
    return 1;
}

/* The same with the content trimmed of white space at both ends, as the
   template's `| trim` does. */
static int append_llama3_message(const Tokenizer *tok, const char *role, const char *content, int *out, int *n, int room) {
    if (!content) return append_llama3_header_text(tok, role, NULL, out, n, room);
    char *text = trimmed(content);
    int fits = append_llama3_header_text(tok, role, text, out, n, room);
    free(text);
    return fits;
}

/* The Llama 3 template for one user turn, as tokens (its special tokens are
   not text): BOS in the first turn, the system message (first turn, when
   given), the user message, and the assistant header that opens the reply. */
static int *render_chat_turn_llama3(const Tokenizer *tok, const char *system_prompt, const char *user, int first, int room,
                                    int *n_tokens) {
    size_t bound = encode_capacity(tok, strlen(user) + (system_prompt ? strlen(system_prompt) : 0)) + 64;
    int *out = xcalloc(bound < (size_t)room ? bound : (size_t)room + 1, sizeof(int)), n = 0;
    int fits = 1;
    if (first) {
        if (room < 1) fits = 0;
        else out[n++] = tok->bos;
    }
    if (fits && system_prompt && system_prompt[0] != '\0') fits = append_llama3_message(tok, "system", system_prompt, out, &n, room);
    if (fits) fits = append_llama3_message(tok, "user", user, out, &n, room);
    if (fits) fits = append_llama3_message(tok, "assistant", NULL, out, &n, room);
    if (!fits) {
        free(out);
        return NULL;
    }
    *n_tokens = n;
    return out;
}

/* Appends one message of a template that opens it with a role token and
   closes it with an end token, then a newline: ChatML's
   <|im_start|>role\ncontent<|im_end|>\n and Phi-3's <|role|>\ncontent<|end|>\n
   (content NULL: only the opening, which the reply follows). */
static int append_tagged_message(const Tokenizer *tok, const char *role, const char *content, int *out, int *n, int room) {
    int chatml = tok->chat_template == CHAT_CHATML;
    char name[32];
    snprintf(name, sizeof(name), "<|%s|>", role);
    if (*n + 1 > room) return 0;
    out[(*n)++] = template_token(tok, chatml ? "<|im_start|>" : name);
    const char *body = content ? content : "";
    char *text = xcalloc(strlen(role) + strlen(body) + 2, 1);
    sprintf(text, "%s\n%s", chatml ? role : "", body);
    int fits = append_text_tokens(tok, text, out, n, room);
    free(text);
    if (!fits || !content) return fits;
    if (*n + 1 > room) return 0;
    out[(*n)++] = template_token(tok, chatml ? "<|im_end|>" : "<|end|>");
    return append_text_tokens(tok, "\n", out, n, room);
}

/* Whether the template is ChatML (Qwen3's, SmolLM3's) and the vocabulary
   has <think>. */
static int chatml_thinks(const Tokenizer *tok) {
    return (tok->chat_template == CHAT_CHATML || tok->chat_template == CHAT_SMOLLM3) && tok->special && lookup_special(tok, "<think>") >= 0;
}

/* The ChatML (Qwen, SmolLM) or Phi-3 template for one user turn, as tokens:
   BOS in the first turn when the vocabulary adds one, else the newline that
   follows the previous reply's end token; the system message (first turn,
   when given), the user message, and the assistant's opening. Neither adds
   a default system message of its own. */
static int *render_chat_turn_tagged(const Tokenizer *tok, const char *system_prompt, const char *user, int first, int room,
                                    int *n_tokens) {
    size_t bound = encode_capacity(tok, strlen(user) + (system_prompt ? strlen(system_prompt) : 0) + 32) + 16;
    int *out = xcalloc(bound < (size_t)room ? bound : (size_t)room + 1, sizeof(int)), n = 0;
    int fits = 1;
    if (first && tok->add_bos) {
        if (room < 1) fits = 0;
        else out[n++] = tok->bos;
    }
    if (!first) fits = append_text_tokens(tok, "\n", out, &n, room);
    if (fits && system_prompt && system_prompt[0] != '\0') fits = append_tagged_message(tok, "system", system_prompt, out, &n, room);
    if (fits) fits = append_tagged_message(tok, "user", user, out, &n, room);
    if (fits) fits = append_tagged_message(tok, "assistant", NULL, out, &n, room);
    /* Qwen3's template with enable_thinking false: an empty think block
       after the assistant's opening, where the vocabulary has <think> */
    if (fits && chatml_thinks(tok) && tok->reasoning == REASONING_OFF) fits = append_text_tokens(tok, "<think>\n\n</think>\n\n", out, &n, room);
    if (!fits) {
        free(out);
        return NULL;
    }
    *n_tokens = n;
    return out;
}

/* A turn being rendered: the template's special tokens go out as ids, and
   the text between two of them, template text and content together, is
   encoded in one piece, as a tokenizer reads the rendered template. Content
   is only ever text: a special token's spelling in it stays text. */
typedef struct {
    const Tokenizer *tok;
    int *out, n, room, fits;
    ByteBuf text; /* the text since the last special token */
} TurnBuilder;

static void turn_string(TurnBuilder *b, const char *s) { buf_str(&b->text, s); }

/* `s` without white space at either end, as the template's `| trim`. */
static void turn_trimmed(TurnBuilder *b, const char *s) {
    size_t len = strlen(s);
    while (len > 0 && isspace((unsigned char)*s)) { s++; len--; }
    while (len > 0 && isspace((unsigned char)s[len - 1])) len--;
    buf_add(&b->text, s, len);
}

/* Encodes the text so far. */
static void turn_flush(TurnBuilder *b) {
    if (b->fits && b->text.n > 0) b->fits = append_text_tokens(b->tok, b->text.data, b->out, &b->n, b->room);
    b->text.n = 0;
}

static void turn_id(TurnBuilder *b, int id) {
    turn_flush(b);
    if (b->fits && b->n + 1 > b->room) b->fits = 0;
    if (b->fits) b->out[b->n++] = id;
}

static void turn_token(TurnBuilder *b, const char *name) { turn_id(b, template_token(b->tok, name)); }

/* Gemma: <start_of_turn>user\n, the system prompt and a blank line (first
   turn: Gemma has no system role), the message trimmed, <end_of_turn>\n,
   then <start_of_turn>model\n. BOS starts the conversation, the newline
   after the previous reply's <end_of_turn> every later turn. */
static void render_gemma(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first) turn_id(b, b->tok->bos);
    else turn_string(b, "\n");
    turn_token(b, "<start_of_turn>");
    turn_string(b, "user\n");
    if (system_prompt && system_prompt[0] != '\0') {
        turn_string(b, system_prompt);
        turn_string(b, "\n\n");
    }
    turn_trimmed(b, user);
    turn_token(b, "<end_of_turn>");
    turn_string(b, "\n");
    turn_token(b, "<start_of_turn>");
    turn_string(b, "model\n");
}

/* Phi-4-mini: <|system|>system<|end|><|user|>message<|end|><|assistant|>,
   no newlines (Phi-3 has them); BOS where the vocabulary adds one. */
static void render_phi4(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first && b->tok->add_bos) turn_id(b, b->tok->bos);
    if (system_prompt && system_prompt[0] != '\0') {
        turn_token(b, "<|system|>");
        turn_string(b, system_prompt);
        turn_token(b, "<|end|>");
    }
    turn_token(b, "<|user|>");
    turn_string(b, user);
    turn_token(b, "<|end|>");
    turn_token(b, "<|assistant|>");
}

/* Today's date in the local time zone as strftime's `format` has it, as
   the templates' strftime_now gives it (Granite's and Mistral v7's default
   system messages carry it). */
static const char *today(const char *format, char *out, size_t size) {
    time_t now = time(NULL);
    struct tm local;
#ifdef _WIN32
    localtime_s(&local, &now);
#else
    localtime_r(&now, &local);
#endif
    if (strftime(out, size, format, &local) == 0) out[0] = '\0';
    return out;
}

/* Granite: <|start_of_role|>role<|end_of_role|>content<|end_of_text|>\n per
   message, then <|start_of_role|>assistant<|end_of_role|>; the newline
   after the previous reply's <|end_of_text|> starts a later turn. Without a
   system prompt the first turn has Granite 3.3's default one, with today's
   date (its template's, without tools, documents or thinking). */
static void render_granite(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first && b->tok->add_bos) turn_id(b, b->tok->bos);
    if (!first) turn_string(b, "\n");
    char date[64], fallback[192];
    if (first && (!system_prompt || system_prompt[0] == '\0')) {
        snprintf(fallback, sizeof(fallback), "Knowledge Cutoff Date: April 2024. Today's Date: %s. You are Granite, developed by IBM. "
                 "You are a helpful AI assistant.", today("%B %d, %Y", date, sizeof(date)));
        system_prompt = fallback;
    }
    const char *roles[2] = {"system", "user"}, *contents[2] = {system_prompt, user};
    for (int i = 0; i < 2; i++) {
        if (!contents[i] || (i == 0 && contents[i][0] == '\0')) continue;
        turn_token(b, "<|start_of_role|>");
        turn_string(b, roles[i]);
        turn_token(b, "<|end_of_role|>");
        turn_string(b, contents[i]);
        turn_token(b, "<|end_of_text|>");
        turn_string(b, "\n");
    }
    turn_token(b, "<|start_of_role|>");
    turn_string(b, "assistant");
    turn_token(b, "<|end_of_role|>");
}

/* SmolLM3's default custom instructions in "/think" mode. */
static const char SMOLLM3_THINKING[] =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly "
    "exploring questions through a systematic thinking process before providing the final precise and accurate solutions. "
    "This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, "
    "backtracking, and iteration to develop well-considered thinking process. Please structure your response into two main "
    "sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. In the "
    "Thought section, detail your reasoning process in steps. Each step should include detailed considerations such as "
    "analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the current steps, "
    "refining any errors, and revisiting previous steps. In the Solution section, based on various attempts, explorations, and "
    "reflections from the Thought section, systematically present the final solution that you deem correct. The Solution "
    "section should be logical, accurate, and concise and detail necessary steps needed to reach the conclusion.";

/* Mistral Small 3.2's default system message: the head, today's date
   (%Y-%m-%d), the rest. */
static const char MISTRAL7_SYSTEM_HEAD[] =
    "You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French startup headquartered in Paris.\n"
    "Your knowledge base was last updated on 2023-10-01. The current date is ";
static const char MISTRAL7_SYSTEM_TAIL[] =
    ".\n\n"
    "When you're not sure about some information or when the user's request requires up-to-date or specific data, you must use "
    "the available tools to fetch the information. Do not hesitate to use tools whenever they can provide a more accurate or "
    "complete response. If no relevant tools are available, then clearly state that you don't have the information and avoid "
    "making up anything.\n\n"
    "If the user's question is not clear, ambiguous, or does not provide enough context for you to accurately answer the "
    "question, you do not try to answer it right away and you rather ask the user to clarify their request (e.g. \"What are "
    "some good restaurants around me?\" => \"Where are you?\" or \"When is the next flight to Tokyo\" => \"Where do you travel "
    "from?\").\n"
    "You are always very attentive to dates, and when asked about information at specific dates, you discard information that "
    "is at another date.\n"
    "You follow these instructions in all languages, and always respond to the user in the language they use or request.\n"
    "Next sections describe the capabilities that you have.\n\n"
    "# WEB BROWSING INSTRUCTIONS\n\n"
    "You cannot perform any web search or access internet to open URLs, links etc. If it seems like the user is expecting you "
    "to do so, you clarify the situation and ask the user to copy paste the text directly in the chat.\n\n"
    "# MULTI-MODAL INSTRUCTIONS\n\n"
    "You have the ability to read images, but you cannot generate images. You also cannot transcribe audio files or videos.\n"
    "You cannot read nor transcribe audio files or videos.\n\n"
    "# TOOL CALLING INSTRUCTIONS\n\n"
    "You may have access to tools that you can use to fetch information or perform actions. You must use these tools in the "
    "following situations:\n\n"
    "1. When the request requires up-to-date information.\n"
    "2. When the request requires specific data that you do not have in your knowledge base.\n"
    "3. When the request involves actions that you cannot perform without tools.\n\n"
    "Always prioritize using tools to provide the most accurate and helpful response. If tools are not available, inform the "
    "user that you cannot perform the requested action at the moment.";

/* Mistral v7 (Tekken: no spaces around the tags): BOS, then
   [SYSTEM_PROMPT]system[/SYSTEM_PROMPT] (first turn; without a system
   prompt, Mistral Small 3.2's default one with today's date, as its
   template renders it), [INST]message[/INST]; the reply ends with </s>. */
static void render_mistral7(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first) {
        char date[64];
        turn_id(b, b->tok->bos);
        turn_token(b, "[SYSTEM_PROMPT]");
        if (system_prompt && system_prompt[0] != '\0') turn_string(b, system_prompt);
        else {
            turn_string(b, MISTRAL7_SYSTEM_HEAD);
            turn_string(b, today("%Y-%m-%d", date, sizeof(date)));
            turn_string(b, MISTRAL7_SYSTEM_TAIL);
        }
        turn_token(b, "[/SYSTEM_PROMPT]");
    }
    turn_token(b, "[INST]");
    turn_string(b, user);
    turn_token(b, "[/INST]");
}

/* SmolLM3's reasoning mode for a conversation with `system_prompt` (NULL:
   a later turn, whose tokenizer the caller has set: smollm3_tokenizer):
   the system prompt's "/no_think", else its "/think", as its template reads
   them; otherwise "/no_think" with --reasoning off and "/think" with show
   or hide. 1: "/think". */
static int smollm3_thinks(const Tokenizer *tok, const char *system_prompt) {
    if (system_prompt && strstr(system_prompt, "/no_think")) return 0;
    if (system_prompt && strstr(system_prompt, "/think")) return 1;
    return tok->reasoning != REASONING_OFF;
}

/* A copy of tok whose --reasoning is SmolLM3's mode under system_prompt's
   flags, for rendering every turn of that conversation alike (tok itself
   for the other families). */
static Tokenizer smollm3_tokenizer(const Tokenizer *tok, const char *system_prompt) {
    Tokenizer t = *tok;
    if (tok->chat_template == CHAT_SMOLLM3 && smollm3_thinks(tok, system_prompt) != smollm3_thinks(tok, NULL))
        t.reasoning = t.reasoning == REASONING_OFF ? REASONING_SHOW : REASONING_OFF;
    return t;
}

/* Appends `s` with every `flag` taken out to text. */
static void turn_without(ByteBuf *text, const char *s, const char *flag) {
    for (const char *at; (at = strstr(s, flag)) != NULL; s = at + strlen(flag)) buf_add(text, s, (size_t)(at - s));
    buf_str(text, s);
}

/* SmolLM3 (ChatML with a system header of its own, always there): in the
   first turn <|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June
   2025\nReasoning Mode: {/think or /no_think}\n\n## Custom Instructions\n\n
   then the system prompt without its flags and trailing white space, or
   its default (by the mode) when that leaves nothing, \n\n<|im_end|>\n;
   <|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n, and with
   "/no_think" an empty think block, <think>\n\n</think>\n, there (so in
   every turn, as the template gives each earlier reply one). The newline
   after the previous reply's <|im_end|> starts a later turn. */
static void render_smollm3(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    const int think = smollm3_thinks(b->tok, first ? system_prompt : NULL);
    if (first && b->tok->add_bos) turn_id(b, b->tok->bos);
    if (first) {
        turn_token(b, "<|im_start|>");
        turn_string(b, "system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: ");
        turn_string(b, think ? "/think" : "/no_think");
        turn_string(b, "\n\n## Custom Instructions\n\n");
        size_t before = b->text.n;
        if (system_prompt) { /* .replace("/no_think", "").replace("/think", "").rstrip() */
            ByteBuf once = {NULL, 0, 0};
            turn_without(&once, system_prompt, "/no_think");
            turn_without(&b->text, once.data ? once.data : "", "/think");
            free(once.data);
            while (b->text.n > before && isspace((unsigned char)b->text.data[b->text.n - 1])) b->text.n--;
        }
        if (b->text.n == before)
            turn_string(b, think ? SMOLLM3_THINKING : "You are a helpful AI assistant named SmolLM, trained by Hugging Face.");
        turn_string(b, "\n\n");
        turn_token(b, "<|im_end|>");
        turn_string(b, "\n");
    } else {
        turn_string(b, "\n");
    }
    turn_token(b, "<|im_start|>");
    turn_string(b, "user\n");
    turn_string(b, user);
    turn_token(b, "<|im_end|>");
    turn_string(b, "\n");
    turn_token(b, "<|im_start|>");
    turn_string(b, "assistant\n");
    if (!think) turn_string(b, "<think>\n\n</think>\n");
}

/* Harmony (gpt-oss): each message <|start|>role<|message|>content<|end|>.
   The first turn opens with the template's system message (the model's
   identity, knowledge cutoff, today's date, "Reasoning: medium", the valid
   channels) and the system prompt as the developer's instructions; a turn
   ends with <|start|>assistant, after which the model names its channel
   (analysis: its reasoning; final: the answer, ended by <|return|>). */
static void render_harmony(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first) {
        char date[32];
        time_t now = time(NULL);
        struct tm *tm = localtime(&now);
        if (!tm || strftime(date, sizeof(date), "%Y-%m-%d", tm) == 0) snprintf(date, sizeof(date), "1970-01-01");
        turn_token(b, "<|start|>");
        turn_string(b, "system");
        turn_token(b, "<|message|>");
        turn_string(b, "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ");
        turn_string(b, date);
        turn_string(b, "\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.");
        turn_token(b, "<|end|>");
        if (system_prompt && system_prompt[0] != '\0') {
            turn_token(b, "<|start|>");
            turn_string(b, "developer");
            turn_token(b, "<|message|>");
            turn_string(b, "# Instructions\n\n");
            turn_string(b, system_prompt);
            turn_string(b, "\n\n");
            turn_token(b, "<|end|>");
        }
    }
    turn_token(b, "<|start|>");
    turn_string(b, "user");
    turn_token(b, "<|message|>");
    turn_string(b, user);
    turn_token(b, "<|end|>");
    turn_token(b, "<|start|>");
    turn_string(b, "assistant");
}

/* DeepSeek-V2: BOS where the vocabulary adds one, the system prompt and a
   blank line (first turn), "User: message", a blank line, "Assistant:"; the
   reply ends with EOS, after which the next turn's "User: " follows. */
static void render_deepseek2(TurnBuilder *b, const char *system_prompt, const char *user, int first) {
    if (first && b->tok->add_bos) turn_id(b, b->tok->bos);
    if (first && system_prompt && system_prompt[0] != '\0') {
        turn_string(b, system_prompt);
        turn_string(b, "\n\n");
    }
    turn_string(b, "User: ");
    turn_string(b, user);
    turn_string(b, "\n\nAssistant:");
}

/* One user turn of the families rendered with a TurnBuilder. */
static int *render_chat_turn_built(const Tokenizer *tok, const char *system_prompt, const char *user, int first, int room,
                                   int *n_tokens) {
    /* at most a token per byte of text and template (a default system
       message at most Mistral's or Harmony's), and the special tokens */
    size_t bound = encode_capacity(tok, strlen(user) + (system_prompt ? strlen(system_prompt) : 0) + sizeof(MISTRAL7_SYSTEM_HEAD) + sizeof(MISTRAL7_SYSTEM_TAIL) + sizeof(SMOLLM3_THINKING) + 320) + 32;
    int cap = bound < (size_t)room ? (int)bound : room;
    TurnBuilder b = {tok, xcalloc((size_t)cap + 1, sizeof(int)), 0, cap, 1, {NULL, 0, 0}};
    switch (tok->chat_template) {
    case CHAT_GEMMA: render_gemma(&b, system_prompt, user, first); break;
    case CHAT_PHI4: render_phi4(&b, system_prompt, user, first); break;
    case CHAT_GRANITE: render_granite(&b, system_prompt, user, first); break;
    case CHAT_SMOLLM3: render_smollm3(&b, system_prompt, user, first); break;
    case CHAT_HARMONY: render_harmony(&b, system_prompt, user, first); break;
    case CHAT_DEEPSEEK2: render_deepseek2(&b, system_prompt, user, first); break;
    default: render_mistral7(&b, system_prompt, user, first); break;
    }
    turn_flush(&b);
    free(b.text.data);
    if (!b.fits) {
        free(b.out);
        return NULL;
    }
    *n_tokens = b.n;
    return b.out;
}

/* The tokens of one user turn in the tokenizer's chat template (see
   --chat-template); NULL when they need more than `room` positions. */
static int *chat_turn_tokens(const Tokenizer *tok, const char *system_prompt, const char *user, int first, int room, int *n_tokens) {
    if (tok->chat_template == CHAT_LLAMA3) return render_chat_turn_llama3(tok, system_prompt, user, first, room, n_tokens);
    if (tok->chat_template == CHAT_CHATML || tok->chat_template == CHAT_PHI3)
        return render_chat_turn_tagged(tok, system_prompt, user, first, room, n_tokens);
    if (tok->chat_template >= CHAT_GEMMA) return render_chat_turn_built(tok, system_prompt, user, first, room, n_tokens);
    char *rendered = render_chat_turn(system_prompt, user);
    int *tokens = encode_prompt(tok, rendered, room, n_tokens);
    free(rendered);
    return tokens;
}

/* ---- Reasoning ---------------------------------------------------------------
   A reply that thinks first (Qwen3) starts with <think>, its reasoning, and
   </think>, then the white space before the answer. ThinkSplit tells the
   two apart as the text streams in, holding back what may be the start of
   a marker until the next text decides; the markers and that white space
   go nowhere. A reply that does not open with <think> is all answer.
   Harmony's (gpt-oss: its special tokens read as their spelling) opens
   with <|channel|>analysis<|message|>, its reasoning, <|end|>, then
   <|start|>assistant<|channel|>final<|message|> and the answer (or another
   analysis message), or with the final channel's header at once. */
enum { THINK_START, THINK_IN, THINK_AFTER, THINK_ANSWER };

typedef struct {
    int state;
    ByteBuf held; /* text not yet given to the sink */
    int harmony;  /* the reply opened with a Harmony channel */
} ThinkSplit;

#define HARMONY_ANALYSIS "<|channel|>analysis<|message|>"
#define HARMONY_FINAL "<|channel|>final<|message|>"
#define HARMONY_NEXT "<|start|>assistant"

/* Whether the template's replies reason first in a form ThinkSplit reads. */
static int reasoning_splits(const Tokenizer *tok) { return chatml_thinks(tok) || tok->chat_template == CHAT_HARMONY; }

/* Which of the markers (n of them) text[0, len) starts with: its index,
   or -1 when it is the start of one (wait for more), or -2 for none. */
static int think_marker(const char *text, size_t len, const char *const *markers, int n) {
    int partial = 0;
    for (int i = 0; i < n; i++) {
        size_t m = strlen(markers[i]);
        if (len >= m && memcmp(text, markers[i], m) == 0) return i;
        if (len < m && memcmp(text, markers[i], len) == 0) partial = 1;
    }
    return partial ? -1 : -2;
}

/* Receives the reasoning (reasoning 1) or the answer (0), a part at a time. */
typedef void (*ThinkSink)(void *ctx, int reasoning, const char *text, size_t n);

/* The length of the longest end of text[0, n) that starts `marker`. */
static size_t partial_marker(const char *text, size_t n, const char *marker) {
    size_t m = strlen(marker);
    for (size_t k = n < m - 1 ? n : m - 1; k > 0; k--)
        if (memcmp(text + n - k, marker, k) == 0) return k;
    return 0;
}

/* Drops the first n held bytes. */
static void think_drop(ThinkSplit *s, size_t n) {
    memmove(s->held.data, s->held.data + n, s->held.n - n + 1);
    s->held.n -= n;
}

static void think_feed(ThinkSplit *s, const char *text, size_t n, ThinkSink sink, void *ctx) {
    buf_add(&s->held, text, n);
    for (;;) {
        const char *h = s->held.data;
        size_t len = s->held.n, ws = 0;
        if ((s->state == THINK_START || s->state == THINK_AFTER) && !s->harmony)
            while (ws < len && isspace((unsigned char)h[ws])) ws++;
        if (s->state == THINK_START) {
            static const char *const opening[] = {HARMONY_ANALYSIS, HARMONY_FINAL};
            const int harmony = think_marker(h, len, opening, 2);
            if (harmony == -1) return;
            if (harmony >= 0) { /* Harmony: the analysis channel, or the final one at once */
                s->harmony = 1;
                think_drop(s, strlen(opening[harmony]));
                s->state = harmony == 0 ? THINK_IN : THINK_ANSWER;
                continue;
            }
            if (len - ws < 7 && strncmp(h + ws, "<think>", len - ws) == 0) return;
            s->state = strncmp(h + ws, "<think>", 7) == 0 ? THINK_IN : THINK_ANSWER;
            if (s->state == THINK_IN) think_drop(s, ws + 7);
        } else if (s->state == THINK_IN) {
            const char *close = s->harmony ? "<|end|>" : "</think>";
            const char *end = strstr(h, close);
            size_t emit = end ? (size_t)(end - h) : len - partial_marker(h, len, close);
            if (emit > 0) sink(ctx, 1, h, emit);
            think_drop(s, end ? emit + strlen(close) : emit);
            if (!end) return;
            s->state = THINK_AFTER;
        } else if (s->state == THINK_AFTER && s->harmony) {
            /* the next message's header: the final channel (the answer) or more analysis */
            static const char *const next[] = {HARMONY_NEXT HARMONY_FINAL, HARMONY_NEXT HARMONY_ANALYSIS};
            const int which = think_marker(h, len, next, 2);
            if (which == -1) return;
            if (which >= 0) think_drop(s, strlen(next[which]));
            s->state = which == 1 ? THINK_IN : THINK_ANSWER;
        } else if (s->state == THINK_AFTER) {
            think_drop(s, ws);
            if (s->held.n == 0) return;
            s->state = THINK_ANSWER;
        } else {
            if (len > 0) sink(ctx, 0, h, len);
            s->held.n = 0;
            return;
        }
    }
}

/* Gives the sink (NULL: none) what was held back, at the end of the reply,
   and readies s for the next. */
static void think_finish(ThinkSplit *s, ThinkSink sink, void *ctx) {
    if (sink && s->held.n > 0 && s->state != THINK_AFTER) sink(ctx, s->state == THINK_IN, s->held.data, s->held.n);
    free(s->held.data);
    *s = (ThinkSplit){THINK_START, {NULL, 0, 0}, 0};
}

/* A ThinkSink that prints the answer only (--reasoning hide). */
static void print_answer(void *ctx, int reasoning, const char *text, size_t n) {
    (void)ctx;
    if (!reasoning) fwrite(text, 1, n, stdout);
}

/* The engine's on_text in chat with --reasoning hide: the answer as it comes. */
static void stream_answer(Request *r, const char *text, size_t n) {
    think_feed(r->owner, text, n, print_answer, NULL);
    flush_output();
}

/* Prints a reply's answer, without its reasoning, and the end of its line:
   the rest held back when it was streamed, else all of it. */
static void print_answer_of(const Tokenizer *tok, const Hypothesis *reply, int last_prompt_token, int streamed, ThinkSplit *split) {
    if (!streamed) {
        char *text = hypothesis_text(tok, reply, last_prompt_token);
        think_feed(split, text, strlen(text), print_answer, NULL);
        free(text);
    }
    think_finish(split, print_answer, NULL);
    printf("\n");
}

/* Whether a chat in text mode leaves the replies' reasoning out: --reasoning
   hide, and off for Harmony, whose reasoning cannot be asked off. */
static int hides_reasoning(const Tokenizer *tok) {
    return reasoning_splits(tok) && (tok->reasoning == REASONING_HIDE || (tok->reasoning == REASONING_OFF && tok->chat_template == CHAT_HARMONY));
}

/* ---- The conversation ------------------------------------------------------
   What the cache holds in a chat, as turns: each is the user's message
   rendered with the template (BOS first; the system prompt goes into the
   first turn kept), the reply, and the reply's end token. When a new message
   does not fit, the oldest turns are dropped, the first one left is rendered
   again with the system prompt, and the kept tokens are read again from
   position 0 (in batched chunks, with the new message). These functions
   only keep the tokens; chat() runs the model. */

typedef struct {
    char *user;   /* the message, to render the turn again */
    int *tokens;  /* (n_tokens) rendered prompt (BOS first), then the reply and its end token */
    int n_tokens;
    int n_prompt; /* of which the rendered prompt */
} Turn;

typedef struct {
    const char *system_prompt; /* rendered into the first kept turn */
    Turn *turns;               /* (n_turns) the kept turns, oldest first */
    int n_turns;
    int context;               /* positions the conversation may use */
} Conversation;

/* The tokens of all kept turns, one after the other. */
static int conversation_length(const Conversation *c) {
    int n = 0;
    for (int i = 0; i < c->n_turns; i++) n += c->turns[i].n_tokens;
    return n;
}

/* Copies the kept turns' tokens from index `from` on into `out`; returns
   their count. */
static int conversation_tokens(const Conversation *c, int from, int *out) {
    int at = 0, n = 0;
    for (int i = 0; i < c->n_turns; i++)
        for (int j = 0; j < c->turns[i].n_tokens; j++, at++)
            if (at >= from) out[n++] = c->turns[i].tokens[j];
    return n;
}

/* (Re)renders the turn's prompt in the chat template, with `system_prompt`
   when it is the first kept turn (NULL otherwise); a reply already there is
   kept after it. */
static void render_turn(Turn *turn, const Tokenizer *tok, const char *system_prompt) {
    int n_prompt = 0, n_reply = turn->n_tokens - turn->n_prompt;
    int *prompt = chat_turn_tokens(tok, system_prompt, turn->user, system_prompt != NULL, INT_MAX, &n_prompt);
    int *tokens = xcalloc((size_t)(n_prompt + n_reply), sizeof(int));
    memcpy(tokens, prompt, (size_t)n_prompt * sizeof(int));
    if (n_reply > 0) memcpy(tokens + n_prompt, turn->tokens + turn->n_prompt, (size_t)n_reply * sizeof(int));
    free(prompt);
    free(turn->tokens);
    turn->tokens = tokens;
    turn->n_prompt = n_prompt;
    turn->n_tokens = n_prompt + n_reply;
}

/* A turn for the message `user`, to follow the kept turns. */
static Turn conversation_new_turn(const Conversation *c, const Tokenizer *tok, const char *user) {
    Turn turn = {strdup(user), NULL, 0, 0};
    render_turn(&turn, tok, c->n_turns == 0 ? c->system_prompt : NULL);
    return turn;
}

static void free_turn(Turn *turn) {
    free(turn->user);
    free(turn->tokens);
    memset(turn, 0, sizeof(*turn));
}

/* Puts the reply (n tokens) and its end token after the turn's prompt. */
static void turn_set_reply(Turn *turn, const int *reply, int n, int end_token) {
    turn->tokens = realloc(turn->tokens, (size_t)(turn->n_prompt + n + 1) * sizeof(int));
    if (!turn->tokens) die(EXIT_BAD_FILE, "out of memory");
    if (n > 0) memcpy(turn->tokens + turn->n_prompt, reply, (size_t)n * sizeof(int));
    turn->tokens[turn->n_prompt + n] = end_token;
    turn->n_tokens = turn->n_prompt + n + 1;
}

static void conversation_append(Conversation *c, Turn turn) {
    c->turns = realloc(c->turns, (size_t)(c->n_turns + 1) * sizeof(Turn));
    if (!c->turns) die(EXIT_BAD_FILE, "out of memory");
    c->turns[c->n_turns++] = turn;
}

/* Drops the oldest turn; the next one takes the system prompt (so the
   kept turns are read again: the prefix index has no block of them). */
static void conversation_drop_oldest(Conversation *c, const Tokenizer *tok) {
    free_turn(&c->turns[0]);
    memmove(c->turns, c->turns + 1, (size_t)(c->n_turns - 1) * sizeof(Turn));
    c->n_turns--;
    if (c->n_turns > 0) render_turn(&c->turns[0], tok, c->system_prompt);
}

/* Makes room for `turn` (a new message, not yet appended) with `reserve`
   positions left for its reply: drops the oldest turns until that much is
   free, or none is left (the message then takes the system prompt). Returns
   the number of turns dropped, or -1, dropping nothing, when the message
   does not fit the context even alone. */
static int conversation_make_room(Conversation *c, const Tokenizer *tok, Turn *turn, int reserve) {
    if (conversation_length(c) + turn->n_prompt + reserve <= c->context) return 0;
    Conversation empty = {c->system_prompt, NULL, 0, c->context};
    Turn alone = conversation_new_turn(&empty, tok, turn->user);
    int fits = alone.n_prompt <= c->context;
    if (!fits || c->n_turns == 0) {
        free_turn(&alone);
        return fits ? 0 : -1;
    }
    int dropped = 0;
    while (c->n_turns > 0 && conversation_length(c) + turn->n_prompt + reserve > c->context) {
        conversation_drop_oldest(c, tok);
        dropped++;
    }
    if (c->n_turns == 0) {
        free_turn(turn);
        *turn = alone;
    } else {
        free_turn(&alone);
    }
    return dropped;
}

static void free_conversation(Conversation *c) {
    for (int i = 0; i < c->n_turns; i++) free_turn(&c->turns[i]);
    free(c->turns);
    memset(c, 0, sizeof(*c));
}

/* The end token that closes a reply in the conversation: BOS when it ended
   with BOS, else the end-of-turn token (EOS for llama2.c's tokenizers), also
   for a reply cut short (length limit, stop string, Ctrl-C). */
static int reply_end_token(const Tokenizer *tok, const Hypothesis *h) {
    return strcmp(h->stop, "bos") == 0 ? tok->bos : turn_end_token(tok);
}

/* An interactive conversation over a context of `steps` positions. Each
   user turn (BOS + template) follows the previous reply and its end token,
   so the model sees the whole conversation: the turn's request has all of
   it as its prompt, and the prefix index hands back the blocks computed in
   earlier turns. A reply ends at EOS (or BOS), at the end of the context or
   after --max-new-tokens. A message that would leave less than a quarter of
   the context (or --max-new-tokens, if fewer) for the reply makes room by
   dropping the oldest turns (see Conversation). The chat ends at end of
   input or Ctrl-C at the prompt. In JSON mode the guides are not printed
   and each reply is one JSON line. */
static void chat(Engine *e, const Tokenizer *tok, const Decoding *d, const char *cli_user, const char *cli_system, int steps) {
    int text_mode = d->format == FORMAT_TEXT;
    char *system_prompt = cli_system ? strdup(cli_system) : read_line("Enter system prompt (optional): ", d->format);
    const Tokenizer flagged = smollm3_tokenizer(tok, system_prompt); /* SmolLM3: its /think or /no_think, every turn */
    tok = &flagged;
    Conversation conv = {system_prompt, NULL, 0, steps};
    int reserve = cap_new_tokens(d, steps / 4);
    Decoding turn_decoding = *d; /* each turn's sampler goes on from where the last one stopped */
    if (!system_prompt && text_mode) printf("\n");
    for (int turn_index = 0; system_prompt; turn_index++) {
        char *user = (turn_index == 0 && cli_user) ? strdup(cli_user) : read_line("User: ", d->format);
        if (!user) {
            if (text_mode) printf("\n");
            break;
        }
        Turn turn = conversation_new_turn(&conv, tok, user);
        free(user);
        int dropped = conversation_make_room(&conv, tok, &turn, reserve);
        if (dropped < 0) {
            flush_output();
            fprintf(stderr, "run: the message is %d tokens with the chat template, more than the %d positions of the context; "
                    "send a shorter one\n", turn.n_prompt, steps);
            free_turn(&turn);
            continue;
        }
        if (dropped > 0)
            fprintf(stderr, "run: note: the context of %d positions is full: dropped the %d oldest turn%s, %d kept (%d tokens, read again)\n",
                    steps, dropped, dropped > 1 ? "s" : "", conv.n_turns, conversation_length(&conv));
        if (text_mode) printf("Assistant: ");
        flush_output();
        /* the prompt: the kept conversation, then this turn */
        int n_kept = conversation_length(&conv), n_feed = n_kept + turn.n_prompt;
        int *feed = xcalloc((size_t)n_feed, sizeof(int));
        conversation_tokens(&conv, 0, feed);
        memcpy(feed + n_kept, turn.tokens, (size_t)turn.n_prompt * sizeof(int));
        const int hide = text_mode && hides_reasoning(tok);
        int stream = text_mode && d->beam.beams == 0;
        ThinkSplit split = {THINK_START, {NULL, 0, 0}, 0};
        Request *r = request_new(feed, n_feed, cap_new_tokens(d, steps - n_feed + 1), 1, &turn_decoding);
        r->on_text = stream ? (hide ? stream_answer : stream_text) : NULL;
        r->owner = &split;
        run_alone(e, r);
        Hypothesis *reply = &r->hyps[0];
        if (hide) print_answer_of(tok, reply, turn.tokens[turn.n_prompt - 1], stream, &split);
        else print_results(tok, d->format, reply, 1, turn.tokens[turn.n_prompt - 1], "", stream);
        turn_decoding.seed = r->sampler.rng_state;
        flush_output();
        turn_set_reply(&turn, reply->tokens, reply->n_tokens, reply_end_token(tok, reply));
        conversation_append(&conv, turn);
        clear_interrupt(); /* Ctrl-C ended this reply only */
        request_free(r);
    }
    flush_output();
    free_conversation(&conv);
    free(system_prompt);
    print_stats(e);
}

/* ---- Perplexity -------------------------------------------------------------
   How well the model predicts a text: the text's tokens t_1..t_N (after the
   BOS that the tokenizer puts first) are scored as
     nll = -(1/N) sum_i log p(t_i | what precedes it),  perplexity = exp(nll)
   A text longer than the context is cut into consecutive windows of
   seq_len - 1 tokens; each window runs from position 0 as BOS + its tokens,
   with nothing of the windows before it, so every token is predicted once,
   from BOS and the earlier tokens of its own window. */

typedef struct {
    double nll_sum; /* sum of -log p over the predicted tokens */
    long tokens;    /* tokens predicted */
} Score;

/* Adds to `sc` the scores of one window: window[0] is BOS, window[1..n-1]
   the tokens to predict. It runs through the model (forward_rows) in chunks
   of prefill_rows rows at positions 0..n-2 of a block table of its own,
   with the logits of every row: the row at position p predicts window[p + 1]. */
static void score_window(Transformer *t, const int *window, int n, Score *sc) {
    const int vocab = t->config.vocab_size, step = prefill_rows(t);
    BlockTable table = {0};
    for (int done = 0; done < n - 1;) {
        int rows = n - 1 - done < step ? n - 1 - done : step;
        const float *logits = forward_rows(t, &table, window + done, rows, done, 1);
        for (int r = 0; r < rows; r++) sc->nll_sum -= log_prob(logits + (size_t)r * vocab, vocab, window[done + r + 1]);
        sc->tokens += rows;
        done += rows;
        table_leave_window(&t->state.cache, &table, done);
    }
    table_free(&t->state.cache, &table);
}

/* Scores `text` (see above) and prints its perplexity; the state must hold
   prefill_rows rows and the cache seq_len positions (engine_setup for one
   request of seq_len positions). Progress goes to stderr when that is a
   terminal. */
static void perplexity(Transformer *t, const Tokenizer *tok, const char *text, OutputFormat format) {
    const int window = t->config.seq_len; /* positions per window, BOS included */
    if (window < 2) die(EXIT_BAD_FILE, "the model's context of %d position cannot score a text", window);
    int *tokens = xcalloc(encode_capacity(tok, strlen(text)), sizeof(int)), bad_byte = 0;
    int n = encode(tok, text, 1, 0, tokens, &bad_byte);
    if (n < 0) die(EXIT_BAD_FILE, "the tokenizer has no token for the byte 0x%02X in the text", bad_byte);
    if (n < 2) die(EXIT_BAD_FILE, "perplexity needs a text of at least one token; the text is empty");
    Score sc = {0.0, 0};
    int *buffer = xcalloc((size_t)window, sizeof(int));
    int progress = isatty(STDERR_FILENO) && n > 4 * window;
    buffer[0] = tok->bos;
    for (int at = 1; at < n; at += window - 1) {
        int count = n - at < window - 1 ? n - at : window - 1;
        memcpy(buffer + 1, tokens + at, (size_t)count * sizeof(int));
        score_window(t, buffer, count + 1, &sc);
        if (progress) fprintf(stderr, "\rperplexity: %d of %d tokens", at + count - 1, n - 1);
    }
    if (progress) fputc('\n', stderr);
    double nll = sc.nll_sum / (double)sc.tokens;
    if (format == FORMAT_JSON) printf("{\"perplexity\":%.17g,\"tokens\":%ld,\"nll\":%.17g}\n", exp(nll), sc.tokens, nll);
    else printf("perplexity %.4f over %ld tokens\n", exp(nll), sc.tokens);
    flush_output();
    free(buffer);
    free(tokens);
}

/* ------------------------------------------------------------------------ */
/* 9. The command line                                                      */
/* ------------------------------------------------------------------------ */

typedef struct {
    const char *checkpoint;
    const char *tokenizer;
    const char *prompt;        /* NULL: empty */
    const char *prompt_file;   /* -I: read the prompt from this file ("-": stdin); NULL: none */
    const char *prompt_ids;    /* --prompt-ids: the prompt as token ids; NULL: none */
    const char *system_prompt; /* NULL: asked for in chat */
    const char *mode;
    float temperature;
    float topp;
    uint64_t seed;             /* 0: from the clock */
    int steps;
    int steps_given;           /* whether -n (or a batch line's "steps") was given */
    int max_new_tokens;        /* --max-new-tokens; 0: no limit */
    OutputFormat format;
    int threads;               /* 0: all cores */
    int beams;                 /* 0: sampling */
    float length_penalty;
    EarlyStopping early_stopping;
    int n_return;
    int sampling_flags;        /* whether -t, -p or -s was given */
    const char *batch_file;    /* --batch: JSON Lines requests; NULL: none */
    int parallel;              /* --parallel: requests in flight at once */
    int kv_mb;                 /* --kv-mb: cache cap in MiB; 0: enough for --parallel requests */
    int ctx_size;              /* --ctx-size: positions of context at most; 0: the model's */
    int kv_type;               /* --kv-type: KV_F32 (default), KV_F16 or KV_Q8_0 */
    int keep;                  /* --keep: positions kept when generation goes past the context; -1: off */
    int ordered;               /* --ordered: batch results in input order */
    int format_given;          /* whether -f was given */
    Controls controls;         /* --min-new-tokens ... --stop */
    int json_object;           /* --json: answers are JSON objects */
    const char *schema_file;   /* --json-schema: answers are valid under this schema; NULL: none */
    const JsonSchema *schema;  /* the one of --json or --json-schema (compiled in main); NULL: any text */
    int chat_template;         /* --chat-template: CHAT_LLAMA2, CHAT_LLAMA3, ...; -1: the tokenizer's */
    int reasoning;             /* --reasoning: REASONING_SHOW (default), REASONING_HIDE or REASONING_OFF */
    const char *draft_file;    /* --draft: the draft model's checkpoint; NULL: none */
    int lookup;                /* --lookup: prompt lookup's N-gram size; 0: off */
    int draft_max;             /* --draft-max: tokens drafted per step, at most */
    const char *host;          /* -m serve: --host, --port, --api-key (NULL: none), --max-body-kb */
    int port;
    const char *api_key;
    int max_body_kb;
    int max_conns, max_queue;  /* -m serve: --max-conns, --max-queue, --header-timeout, --drain-seconds */
    double header_timeout, drain_seconds;
    const char *tools_file;    /* --tools: a JSON array of tools (chat and --batch: 11.2); NULL: none */
    const char *tools_json;    /* its text, checked (main: load_tools) */
    const char *tool_choice;   /* --tool-choice: auto, none, required or a tool's name; NULL: auto */
    const char *tool_results;  /* --tool-results: the calls' results, a line each, in chat; NULL: asked for */
} Options;

static const char *usage_text =
    "Usage:   run <checkpoint> [options]\n"
    "Example: run stories260K.bin -z tok512.bin -i \"Once upon a time\"\n"
    "Every option, its values and its errors: docs/options.md\n"
    "\n"
    "Model and files:\n"
    "  <checkpoint>       a run.c checkpoint (versions 0-4) or a GGUF file, known by its content\n"
    "  -z <file>          tokenizer: tokenizer.bin, tk42 or a GGUF vocabulary (default: a GGUF\n"
    "                     model's own vocabulary, else tokenizer.bin)\n"
    "  -i <string>        prompt (default empty); in chat the first message\n"
    "  -I <file>          the prompt read from a file, '-' for stdin, byte for byte (not with -i)\n"
    "  --prompt-ids <ids> the prompt as token ids, e.g. 1,403,407 (generate; BOS first, as given)\n"
    "  -y <string>        system prompt in chat (default: asked for)\n"
    "\n"
    "Generation:\n"
    "  -m <mode>          generate (default), chat, tokenize (print the prompt's tokens), serve,\n"
    "                     perplexity (score the prompt in windows of the context; not -n)\n"
    "  -n <int>           positions to run, prompt included; 0 or above the context = the context\n"
    "                     (default 256; in chat or with --max-new-tokens: the context)\n"
    "  --max-new-tokens <int>    new tokens at most, per reply in chat (default: no limit)\n"
    "  --ctx-size <int>   context positions at most; 0 is the model's (default 0; a Llama 3 GGUF\n"
    "                     declares 131072: chat and serve size their caches by it)\n"
    "  --chat-template <name>    llama2, llama3, chatml, gemma, harmony... (all: docs/options.md)\n"
    "  --reasoning <show|hide|off>  a Qwen3 reply's <think> block in chat: printed, not printed,\n"
    "                     or not asked for (default show); serve sends it as reasoning_content\n"
    "  -f <format>        output: text or json (default text)\n"
    "\n"
    "Sampling and controls:\n"
    "  -t <float>         temperature, >= 0; 0 is greedy (default 1.0)\n"
    "  -p <float>         top-p (nucleus) mass in [0, 1]; 0 or 1 samples from all tokens (default 0.9)\n"
    "  -s <int>           random seed, >= 0; 0 takes it from the clock (default 0)\n"
    "  --top-k <int>      only the k likeliest tokens; 0 is off (default 0)\n"
    "  --min-p <float>    only tokens at least this fraction as likely as the likeliest (default 0: off)\n"
    "  --repetition-penalty <float>  > 0: scores of tokens already in the text are divided by it\n"
    "                                (multiplied when negative); 1 is off (default 1)\n"
    "  --no-repeat-ngram-size <int>  no n-gram of this size occurs twice; 0 is off (default 0)\n"
    "  --min-new-tokens <int>        no end before this many new tokens (default 0)\n"
    "  --stop <string>    end the text before this string (repeatable, up to 16; default none)\n"
    "  --json             the answer is one JSON object, and ends with it (default: off)\n"
    "  --json-schema <file>  the answer is one JSON value valid under this schema (default: off)\n"
    "  --tools <file>     functions the model may call, a JSON array as OpenAI's: chat, --batch\n"
    "  --tool-choice <c>  auto (default with --tools), none, required or a tool's name\n"
    "  --tool-results <file>  chat: the calls' results, a line each, in order (default: asked for)\n"
    "\n"
    "Beam search:\n"
    "  -b <int>           beams; 1 is greedy (default: off, sample)\n"
    "  -l <float>         length penalty: score = sum logprob / length^l (default 1.0)\n"
    "  -e <string>        early stopping: 0 (heuristic), 1 or never (default 0)\n"
    "  -r <int>           hypotheses to print, best first, 1..b (default 1)\n"
    "\n"
    "Engines and modes:\n"
    "  --batch <file>     many requests: JSON Lines in ('-': stdin), a JSON line out each; fields\n"
    "                     \"prompt\" or \"messages\", \"id\", the long options' names with _ for -, \"steps\",\n"
    "                     \"temperature\", \"top_p\", \"seed\", \"beams\", \"response_format\", \"tools\" (docs)\n"
    "  --ordered          --batch: print the results in input order (default: as they end)\n"
    "  --parallel <int>   requests run at once, --batch and serve (default 8)\n"
    "  --draft <file>     speculative decoding with this draft model (same vocabulary); the same\n"
    "                     output as without it (generate, chat, --batch; default: off)\n"
    "  --lookup <int>     speculative decoding by prompt lookup of the last <int> tokens (default: off)\n"
    "  --draft-max <int>  tokens drafted per step at most, >= 1 (default 8)\n"
    "  --keep <int>       generate past the context: when the cache is full, drop the oldest position\n"
    "                     after the first <int> (attention sinks; 4 is usual); generate and --batch\n"
    "                     (default: off, stop at the context)\n"
    "\n"
    "Server (-m serve; the options above are the requests' defaults):\n"
    "  --host <string>    address to listen on (default 127.0.0.1)\n"
    "  --port <int>       port, 0 for a free one (default 8080)\n"
    "  --api-key <string> requests need 'Authorization: Bearer KEY' (default: none)\n"
    "  --max-body-kb <int>  request bodies above this many KiB get 413 (default 1024)\n"
    "  --max-conns <int>  connections open at once; the open-file limit is raised for them (default 4096)\n"
    "  --max-queue <int>  requests waiting beyond the --parallel running; more get 429 (default 1024)\n"
    "  --header-timeout <float>  seconds for a request's header, and as long for its body (default 5)\n"
    "  --drain-seconds <float>   on SIGTERM, seconds until the process exits (default 5)\n"
    "\n"
    "Performance:\n"
    "  -T <int>           threads, >= 1 (default: all cores; needs an OpenMP build)\n"
    "  --kv-type <type>   key/value cache: f32 (exact; default), f16 (half the memory), q8_0 (28%)\n"
    "  --kv-mb <int>      key/value cache in MiB (default: enough for --parallel full requests)\n"
    "\n"
    "  -h, --help         this help\n"
    "  --version          the version, the checkpoint versions read, the kernels of this build\n";

/* A usage error is one line: what is wrong, and where the options are
   listed (the whole usage would push the problem off the screen). */
static void usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("run: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("; see 'run --help'\n", stderr);
    va_end(ap);
    leave(EXIT_USAGE);
}

/* Reads `text` as a number in [lo, hi] into *v: returns 0, or 1 when it is
   not a finite number, 2 when it is outside the range. */
static int check_number(const char *text, double lo, double hi, double *v) {
    char *end;
    errno = 0;
    *v = strtod(text, &end);
    if (text[0] == '\0' || *end != '\0' || errno == ERANGE || !isfinite(*v)) return 1;
    return *v < lo || *v > hi ? 2 : 0;
}

/* The same for a whole number in decimal. */
static int check_integer(const char *text, long long lo, long long hi, long long *v) {
    char *end;
    errno = 0;
    *v = strtoll(text, &end, 10);
    if (text[0] == '\0' || *end != '\0' || errno == ERANGE) return 1;
    return *v < lo || *v > hi ? 2 : 0;
}

static double parse_number(const char *flag, const char *text, double lo, double hi) {
    double v;
    int bad = check_number(text, lo, hi, &v);
    if (bad == 1) usage_error("%s needs a number, got '%s'", flag, text);
    if (bad == 2) usage_error("%s is %s, outside [%g, %g]", flag, text, lo, hi);
    return v;
}

static long long parse_integer(const char *flag, const char *text, long long lo, long long hi) {
    long long v;
    int bad = check_integer(text, lo, hi, &v);
    if (bad == 1) usage_error("%s needs an integer, got '%s'", flag, text);
    if (bad == 2) usage_error("%s is %s, outside [%lld, %lld]", flag, text, lo, hi);
    return v;
}

/* The program's version, what it reads and how this build computes. */
#define RUN_VERSION "0.4.0"

static void print_version(void) {
    printf("run %s\n", RUN_VERSION);
    printf("checkpoints: versions 0 (llama2.c), 1 (float32), 2 (int8 Q8_0), 3 (4-bit), 4 (float32, int8 or 4-bit, RoPE theta and scaling, norm eps)\n");
    printf("GGUF: versions 2 and 3; architectures " ARCH_NAMES "; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4\n");
#ifdef AMX
    printf("kernels: %s%s\n", KERNEL_NAME, amx_usable() ? ", AMX tiles for 16 or more rows" : " (AMX built in, not granted by the system)");
#else
    printf("kernels: %s\n", KERNEL_NAME);
#endif
#ifdef VF_CACHE_LOADS
    printf("key/value cache types: f32, f16, q8_0 (f16 and q8_0 read with vector kernels)\n");
#else
    printf("key/value cache types: f32, f16, q8_0\n");
#endif
#ifdef _OPENMP
    printf("openmp: yes (%d threads by default)\n", omp_get_max_threads());
#else
    printf("openmp: no\n");
#endif
}

/* Whether argv[i] asks for the help or the version, which end the program
   at once wherever they stand as a flag. */
static void answer_help_or_version(const char *arg) {
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
        fputs(usage_text, stdout);
        leave(0);
    }
    if (strcmp(arg, "--version") == 0) {
        print_version();
        leave(0);
    }
}

/* The value after argv[i], which must be there. */
static const char *option_value(int argc, char **argv, int i) {
    if (i + 1 >= argc) usage_error("%s needs a value", argv[i]);
    return argv[i + 1];
}

/* A repetition penalty: a number above 0 (float32, where it is applied). */
static float parse_penalty(const char *flag, const char *text) {
    float v = (float)parse_number(flag, text, 0.0, 1e30);
    if (!(v > 0.0f)) usage_error("%s must be above 0, got '%s'", flag, text);
    return v;
}

/* One more stop string (--stop, repeatable). */
static void add_stop(Controls *c, const char *text) {
    if (text[0] == '\0') usage_error("--stop needs a non-empty string");
    if (c->n_stops == MAX_STOPS) usage_error("more than %d stop strings (--stop)", MAX_STOPS);
    c->stops[c->n_stops++] = text;
}

/* --kv-type's value: one of kv_type_names. */
static int parse_kv_type(const char *text) {
    for (int type = KV_F32; type <= KV_Q8_0; type++)
        if (strcmp(text, kv_type_names[type]) == 0) return type;
    usage_error("--kv-type must be f32, f16 or q8_0, got '%s'", text);
    return KV_F32;
}

/* Refuses an option that does not exist, naming the one meant when it is a
   common guess (other programs' spellings, OpenAI's field names). */
static void unknown_option(const char *flag) {
    static const char *const guesses[][2] = {
        {"--temperature", "-t"}, {"--temp", "-t"}, {"--seed", "-s"}, {"--prompt", "-i"}, {"--input", "-i"},
        {"--max-tokens", "--max-new-tokens"}, {"--max_tokens", "--max-new-tokens"}, {"--max_new_tokens", "--max-new-tokens"},
        {"--n-predict", "--max-new-tokens"}, {"--steps", "-n"}, {"--top-p", "-p"}, {"--top_p", "-p"}, {"--top_k", "--top-k"},
        {"--tokenizer", "-z"}, {"--mode", "-m"}, {"--system", "-y"}, {"--system-prompt", "-y"}, {"--threads", "-T"},
        {"--beams", "-b"}, {"--num-beams", "-b"}, {"--num_beams", "-b"}, {"--format", "-f"}, {"--file", "-I"},
    };
    size_t len = strcspn(flag, "="); /* --seed=1 is --seed */
    for (size_t g = 0; g < sizeof(guesses) / sizeof(guesses[0]); g++)
        if (strlen(guesses[g][0]) == len && strncmp(flag, guesses[g][0], len) == 0)
            usage_error("unknown option '%s' (did you mean %s?)", flag, guesses[g][1]);
    if (flag[0] != '-')
        usage_error("unexpected argument '%s': a prompt goes after -i (-i \"%s\")", flag, flag);
    usage_error("unknown option '%s'", flag);
}

/* A long option: `--name value`, or `--name` alone for a switch. Returns how
   many arguments it took (1 or 2). Each option is one `if` here. */
static int parse_long_option(Options *o, int argc, char **argv, int i) {
    const char *flag = argv[i];
    if (strcmp(flag, "--batch") == 0) { o->batch_file = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--parallel") == 0) { o->parallel = (int)parse_integer(flag, option_value(argc, argv, i), 1, 4096); return 2; }
    if (strcmp(flag, "--kv-mb") == 0) { o->kv_mb = (int)parse_integer(flag, option_value(argc, argv, i), 1, 1 << 24); return 2; }
    if (strcmp(flag, "--ctx-size") == 0) { o->ctx_size = (int)parse_integer(flag, option_value(argc, argv, i), 0, INT_MAX); return 2; }
    if (strcmp(flag, "--ordered") == 0) { o->ordered = 1; return 1; }
    if (strcmp(flag, "--kv-type") == 0) { o->kv_type = parse_kv_type(option_value(argc, argv, i)); return 2; }
    if (strcmp(flag, "--keep") == 0) { o->keep = (int)parse_integer(flag, option_value(argc, argv, i), 0, INT_MAX - 1); return 2; }
    if (strcmp(flag, "--draft") == 0) { o->draft_file = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--lookup") == 0) { o->lookup = (int)parse_integer(flag, option_value(argc, argv, i), 1, 1 << 20); return 2; }
    if (strcmp(flag, "--draft-max") == 0) { o->draft_max = (int)parse_integer(flag, option_value(argc, argv, i), 1, 1024); return 2; }
    if (strcmp(flag, "--host") == 0) { o->host = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--port") == 0) { o->port = (int)parse_integer(flag, option_value(argc, argv, i), 0, 65535); return 2; }
    if (strcmp(flag, "--api-key") == 0) { o->api_key = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--max-body-kb") == 0) { o->max_body_kb = (int)parse_integer(flag, option_value(argc, argv, i), 1, 1 << 20); return 2; }
    if (strcmp(flag, "--max-conns") == 0) { o->max_conns = (int)parse_integer(flag, option_value(argc, argv, i), 1, 1 << 20); return 2; }
    if (strcmp(flag, "--max-queue") == 0) { o->max_queue = (int)parse_integer(flag, option_value(argc, argv, i), 0, 1 << 20); return 2; }
    if (strcmp(flag, "--header-timeout") == 0) { o->header_timeout = parse_number(flag, option_value(argc, argv, i), 0.1, 3600); return 2; }
    if (strcmp(flag, "--drain-seconds") == 0) { o->drain_seconds = parse_number(flag, option_value(argc, argv, i), 0, 3600); return 2; }
    Controls *c = &o->controls;
    if (strcmp(flag, "--min-new-tokens") == 0) { c->min_new_tokens = (int)parse_integer(flag, option_value(argc, argv, i), 0, INT_MAX); return 2; }
    if (strcmp(flag, "--repetition-penalty") == 0) { c->repetition_penalty = parse_penalty(flag, option_value(argc, argv, i)); return 2; }
    if (strcmp(flag, "--no-repeat-ngram-size") == 0) { c->no_repeat_ngram_size = (int)parse_integer(flag, option_value(argc, argv, i), 0, INT_MAX); return 2; }
    if (strcmp(flag, "--top-k") == 0) { c->top_k = (int)parse_integer(flag, option_value(argc, argv, i), 0, INT_MAX); return 2; }
    if (strcmp(flag, "--min-p") == 0) { c->min_p = (float)parse_number(flag, option_value(argc, argv, i), 0.0, 1.0); return 2; }
    if (strcmp(flag, "--stop") == 0) { add_stop(c, option_value(argc, argv, i)); return 2; }
    if (strcmp(flag, "--json") == 0) { o->json_object = 1; return 1; }
    if (strcmp(flag, "--json-schema") == 0) { o->schema_file = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--tools") == 0) { o->tools_file = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--tool-choice") == 0) { o->tool_choice = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--tool-results") == 0) { o->tool_results = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--prompt-ids") == 0) { o->prompt_ids = option_value(argc, argv, i); return 2; }
    if (strcmp(flag, "--max-new-tokens") == 0) { o->max_new_tokens = (int)parse_integer(flag, option_value(argc, argv, i), 1, INT_MAX); return 2; }
    if (strcmp(flag, "--chat-template") == 0) {
        const char *v = option_value(argc, argv, i);
        o->chat_template = -1;
        for (int f = 0; f < (int)(sizeof(chat_family_names) / sizeof(chat_family_names[0])); f++)
            if (strcmp(v, chat_family_names[f]) == 0) o->chat_template = f;
        if (o->chat_template < 0)
            usage_error("--chat-template must be llama2, llama3, chatml, phi3, phi4, gemma, granite, mistral7, smollm3, harmony or "
                        "deepseek2, got '%s'", v);
        return 2;
    }
    if (strcmp(flag, "--reasoning") == 0) {
        static const char *const names[] = {"show", "hide", "off"};
        const char *v = option_value(argc, argv, i);
        o->reasoning = -1;
        for (int k = 0; k < 3; k++)
            if (strcmp(v, names[k]) == 0) o->reasoning = k;
        if (o->reasoning < 0) usage_error("--reasoning must be show, hide or off, got '%s'", v);
        return 2;
    }
    unknown_option(flag);
    return 1;
}

/* Reads a short option and its value into o. */
static void parse_short_option(Options *o, const char *flag, const char *val) {
    switch (flag[1]) {
    case 't': o->temperature = (float)parse_number(flag, val, 0.0, 1e30); break;
    case 'p': o->topp = (float)parse_number(flag, val, 0.0, 1.0); break;
    case 's': o->seed = (uint64_t)parse_integer(flag, val, 0, LLONG_MAX); break;
    case 'n': o->steps = (int)parse_integer(flag, val, 0, INT_MAX); o->steps_given = 1; break;
    case 'i':
        if (o->prompt) usage_error("-i given twice: one prompt a run (put it all in one -i, or in a file for -I)");
        o->prompt = val;
        break;
    case 'I':
        if (o->prompt_file) usage_error("-I given twice: one prompt file a run");
        o->prompt_file = val;
        break;
    case 'z': o->tokenizer = val; break;
    case 'm':
        if (strcmp(val, "generate") != 0 && strcmp(val, "chat") != 0 && strcmp(val, "tokenize") != 0 &&
            strcmp(val, "perplexity") != 0 && strcmp(val, "serve") != 0)
            usage_error("-m must be generate, chat, tokenize, perplexity or serve, got '%s'", val);
        o->mode = val;
        break;
    case 'y': o->system_prompt = val; break;
    case 'f':
        o->format_given = 1;
        if (strcmp(val, "text") == 0) o->format = FORMAT_TEXT;
        else if (strcmp(val, "json") == 0) o->format = FORMAT_JSON;
        else usage_error("-f must be text or json, got '%s'", val);
        break;
    case 'T': o->threads = (int)parse_integer(flag, val, 1, 1024); break;
    case 'b': o->beams = (int)parse_integer(flag, val, 1, INT_MAX); break;
    case 'l': o->length_penalty = (float)parse_number(flag, val, -1e30, 1e30); break;
    case 'e':
        if (strcmp(val, "0") == 0) o->early_stopping = STOP_HEURISTIC;
        else if (strcmp(val, "1") == 0) o->early_stopping = STOP_EARLY;
        else if (strcmp(val, "never") == 0) o->early_stopping = STOP_NEVER;
        else usage_error("-e must be 0, 1 or never, got '%s'", val);
        break;
    case 'r': o->n_return = (int)parse_integer(flag, val, 1, INT_MAX); break;
    }
    if (strchr("tps", flag[1])) o->sampling_flags = 1;
}

/* Speculative decoding's limits: one source of drafts, in generate, chat
   or --batch (whose beam-search requests do not speculate), no beam search
   on the command line. */
static void check_speculation(const Options *o) {
    if (o->draft_file && o->lookup) usage_error("--draft and --lookup are two sources of drafts: use one");
    if (o->beams > 0) usage_error("speculative decoding (--draft, --lookup) does not work with beam search (-b)");
    if (o->keep >= 0) usage_error("speculative decoding (--draft, --lookup) does not work with --keep");
    if (!o->batch_file && strcmp(o->mode, "generate") != 0 && strcmp(o->mode, "chat") != 0)
        usage_error("speculative decoding (--draft, --lookup) applies to -m generate, chat and --batch only");
}

/* --keep's limits: generate and --batch only (a chat drops whole turns
   instead; a server's requests end at the context), sampling only (beam
   search and speculative decoding keep positions of their own). */
static void check_keep(const Options *o) {
    if (!o->batch_file && strcmp(o->mode, "generate") != 0)
        usage_error("--keep applies to -m generate and --batch only (a chat drops whole turns when full)");
    if (o->beams > 0) usage_error("--keep does not work with beam search (-b)");
}

/* --json and --json-schema: one of them, for answers (not -m tokenize or
   perplexity). */
static void check_json(const Options *o) {
    if (o->json_object && o->schema_file) usage_error("--json and --json-schema both constrain the answer: use one");
    if (!o->batch_file && (strcmp(o->mode, "tokenize") == 0 || strcmp(o->mode, "perplexity") == 0))
        usage_error("--json and --json-schema apply to -m generate, chat, serve and --batch");
}

/* --tools, --tool-choice and --tool-results (11.2): a chat's or a batch's
   (serve takes "tools" in each request); the results are a chat's. */
static void check_tools(const Options *o) {
    if (!o->tools_file) usage_error("--tool-choice and --tool-results need --tools FILE (the tools the model may call)");
    if (o->batch_file ? 0 : strcmp(o->mode, "chat") != 0)
        usage_error("--tools applies to -m chat and --batch (a line with \"messages\"); -m serve takes \"tools\" in each request");
    if (o->tool_results && o->batch_file) usage_error("--tool-results applies to -m chat (a batch line's messages carry the results)");
    if (o->beams > 0) usage_error("--tools does not work with beam search (-b): a call is constrained as it is sampled");
    if (o->json_object || o->schema_file) usage_error("--tools and --json or --json-schema cannot be combined (a call's arguments follow its schema)");
}

static Options parse_options(int argc, char **argv) {
    Options o = {.mode = "generate", .temperature = 1.0f, .topp = 0.9f, .steps = 256,
                 .format = FORMAT_TEXT, .length_penalty = 1.0f, .early_stopping = STOP_HEURISTIC, .n_return = 1, .parallel = 8,
                 .chat_template = -1, .host = "127.0.0.1", .port = 8080, .max_body_kb = 1024,
                 .max_conns = 4096, .max_queue = 1024, .header_timeout = 5.0, .drain_seconds = 5.0, .draft_max = 8, .keep = -1};
    if (argc < 2) { /* no arguments at all: a first try, shown everything */
        fputs(usage_text, stderr);
        leave(EXIT_USAGE);
    }
    answer_help_or_version(argv[1]);
    if (argv[1][0] == '-') usage_error("the first argument must be the checkpoint file, got '%s'", argv[1]);
    o.checkpoint = argv[1];
    for (int i = 2; i < argc;) {
        const char *flag = argv[i];
        answer_help_or_version(flag);
        if (strncmp(flag, "--", 2) == 0 && flag[2] != '\0') {
            i += parse_long_option(&o, argc, argv, i);
            continue;
        }
        if (flag[0] != '-' || strlen(flag) != 2 || !strchr("tpsniIzmyfTbler", flag[1])) unknown_option(flag);
        if (i + 1 >= argc) usage_error("%s needs a value", flag);
        parse_short_option(&o, flag, argv[i + 1]);
        i += 2;
    }
    if (o.prompt && o.prompt_file) usage_error("-i and -I both give the prompt: use one");
    if (o.prompt_ids && (o.prompt || o.prompt_file)) usage_error("--prompt-ids and -i or -I all give the prompt: use one");
    if (o.prompt_ids && (strcmp(o.mode, "generate") != 0 || o.batch_file))
        usage_error("--prompt-ids applies to -m generate (a --batch line has the field \"prompt_ids\")");
    if (o.batch_file && o.format_given && o.format != FORMAT_JSON)
        usage_error("--batch writes JSON lines only (-f json)");
    if (o.draft_file || o.lookup) check_speculation(&o);
    if (o.keep >= 0) check_keep(&o);
    if (o.json_object || o.schema_file) check_json(&o);
    if (o.tools_file || o.tool_choice || o.tool_results) check_tools(&o);
    if (o.n_return > (o.beams > 0 ? o.beams : 1))
        usage_error("-r %d asks for more hypotheses than the %d beams (-b) keep", o.n_return, o.beams > 0 ? o.beams : 1);
    return o;
}

/* The whole of a file (- for stdin) as a NUL-terminated string of *len
   bytes; the caller frees it. */
static char *read_whole_file(const char *path, const char *kind, size_t *len) {
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) die(EXIT_BAD_FILE, "%s: cannot open the %s: %s", path, kind, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) die(EXIT_BAD_FILE, "%s: the %s is a directory", path, kind);
    size_t cap = 4096, n = 0;
    char *data = xcalloc(cap, 1);
    for (;;) {
        n += fread(data + n, 1, cap - n - 1, f);
        if (ferror(f)) die(EXIT_BAD_FILE, "%s: cannot read the %s: %s", path, kind, strerror(errno));
        if (feof(f)) break;
        if (n + 1 == cap) {
            char *bigger = realloc(data, cap * 2);
            if (!bigger) die(EXIT_BAD_FILE, "%s: out of memory reading %s (%zu bytes)", path, kind, n);
            data = bigger;
            cap *= 2;
        }
    }
    if (f != stdin) fclose(f);
    data[n] = '\0';
    *len = n;
    return data;
}

/* The prompt text of -I FILE: its bytes as they are (a final newline
   included); a NUL byte, which a C string cannot hold, is refused. */
static char *read_text_file(const char *path) {
    size_t len;
    char *text = read_whole_file(path, "prompt file", &len);
    if (strlen(text) != len) die(EXIT_BAD_FILE, "%s: the prompt file holds a NUL byte", path);
    return text;
}

/* The schema of --json or --json-schema FILE (a bad one ends the run with
   its one-line error), or NULL. */
static JsonSchema *schema_of_options(const Options *o) {
    if (o->json_object) return any_object_schema();
    if (!o->schema_file) return NULL;
    size_t len;
    char *text = read_whole_file(o->schema_file, "JSON schema", &len), err[256];
    JsonSchema *s = compile_schema(text, len, err, sizeof(err));
    free(text);
    if (!s) die(EXIT_USAGE, "%s: %s", o->schema_file, err);
    return s;
}

/* ------------------------------------------------------------------------ */
/* 10. Batch requests: JSON Lines in, JSON lines out                        */
/* ------------------------------------------------------------------------ */

/* --batch FILE (- for stdin): JSON Lines, one request per line, a flat
   object: "prompt" (string, required); optional "id" (string or number;
   default: the line number), "steps" (as -n), "temperature", "top_p", "seed",
   "beams", "length_penalty", "early_stopping" (0, 1 or "never"), "return"
   (as -r), and the controls by their long options' names with '_' for '-'
   ("max_new_tokens", "min_new_tokens", "repetition_penalty",
   "no_repeat_ngram_size", "top_k", "min_p", "stop": a string or an array
   of them); an absent field takes the command line's value. A line may be
   a chat instead, as the server's: "messages" for "prompt", with "tools",
   "tool_choice" and "parallel_tool_calls" (read by section 11's parsers:
   see 11.2).

   Lines are read as they arrive, while the engine runs, and each becomes a
   request at once: a program can write a line and wait for its answer on
   stdout. Reading never waits while a request has work to do; the input's
   end ends the run once every request has finished. A blank line (spaces
   only) is skipped, though it counts in the line numbers. A line that is not
   such an object (not JSON, a field of the wrong type or out of range, an
   unknown field) is refused alone: one JSON line on stdout, {"line": N,
   "id": ID, "error": "..."} ("id" when it was read before the fault), and
   the same message on stderr after FILE:N; every other line runs as it
   would alone. Results are printed (and flushed) as JSON lines with the
   request's "id" as each request finishes, or in input order with
   --ordered, refusals included. The exit status is 1 when a line was
   refused or a request failed (after all the others ran), else 0. */

typedef enum { JSON_STRING, JSON_NUMBER, JSON_TRUE, JSON_FALSE, JSON_NULL, JSON_COMPOUND } JsonKind;

/* A cursor over one line of JSON text; `where` names the line for errors
   (NULL: the caller reports them). */
typedef struct {
    const char *p, *end;
    const char *where;
} JsonCursor;

static void json_fail(const JsonCursor *j, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(error_text, sizeof(error_text), fmt, ap);
    va_end(ap);
    if (j && j->where) fprintf(stderr, "run: %s: %s\n", j->where, error_text);
    leave(EXIT_USAGE);
}

static void json_space(JsonCursor *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\r' || *j->p == '\n')) j->p++;
}

/* Whether another item follows in the list or object at the cursor (it is
   not at `close`); before every item but the first, reads the ',' (else
   json_fail says `expected`) and the spaces after it. */
static int json_next_item(JsonCursor *j, char close, int *first, const char *expected) {
    if (j->p < j->end && *j->p == close) return 0;
    if (!*first) {
        if (j->p >= j->end || *j->p != ',') json_fail(j, "%s", expected);
        j->p++;
        json_space(j);
    }
    *first = 0;
    return 1;
}

static int hex_value(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* The 4 hex digits of a \u escape at p (end: the line's end), or -1. */
static long json_hex4(const char *p, const char *end) {
    if (end - p < 4) return -1;
    long v = 0;
    for (int i = 0; i < 4; i++) {
        int d = hex_value(p[i]);
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* The string at the cursor (after its opening quote), unescaped; `what`
   names it for errors. The caller frees it. */
static char *json_string(JsonCursor *j, const char *what) {
    char *out = xcalloc((size_t)(j->end - j->p) + 1, 1), *o = out;
    for (;;) {
        if (j->p >= j->end) { free(out); json_fail(j, "%s: the string has no closing quote", what); }
        unsigned char c = (unsigned char)*j->p++;
        if (c == '"') break;
        if (c < 0x20) { free(out); json_fail(j, "%s: a control character (0x%02X) inside a string must be escaped", what, c); }
        if (c != '\\') { *o++ = (char)c; continue; }
        char e = j->p < j->end ? *j->p++ : '\0';
        const char *plain = strchr("\"\\/bfnrt", e), *meaning = "\"\\/\b\f\n\r\t";
        if (e != '\0' && e != 'u' && plain) { *o++ = meaning[plain - "\"\\/bfnrt"]; continue; }
        if (e != 'u') { free(out); json_fail(j, "%s: bad escape in a string", what); }
        long cp = json_hex4(j->p, j->end);
        j->p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF && j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u') {
            long lo = json_hex4(j->p + 2, j->end);
            if (lo >= 0xDC00 && lo <= 0xDFFF) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                j->p += 6;
            }
        }
        if (cp <= 0 || (cp >= 0xD800 && cp <= 0xDFFF)) { free(out); json_fail(j, "%s: bad \\u escape (NUL, lone surrogate or not hex)", what); }
        o += encode_utf8((int)cp, o);
    }
    *o = '\0';
    return out;
}

/* The length of the JSON number at the cursor, or 0 (json_number_span). */
static size_t json_number_length(const JsonCursor *j) { return json_number_span(j->p, j->end); }

/* Reads the value at the cursor: *text gets a string's contents or a
   number's or literal's spelling (the caller frees it). Objects and arrays
   are not read: no field takes one. */
static JsonKind json_value(JsonCursor *j, const char *what, char **text) {
    static const struct { const char *word; JsonKind kind; } literals[] = {{"true", JSON_TRUE}, {"false", JSON_FALSE}, {"null", JSON_NULL}};
    *text = NULL;
    if (j->p < j->end && *j->p == '"') {
        j->p++;
        *text = json_string(j, what);
        return JSON_STRING;
    }
    if (j->p < j->end && (*j->p == '{' || *j->p == '[')) return JSON_COMPOUND;
    for (size_t i = 0; i < sizeof(literals) / sizeof(literals[0]); i++) {
        size_t n = strlen(literals[i].word);
        if ((size_t)(j->end - j->p) >= n && memcmp(j->p, literals[i].word, n) == 0) {
            j->p += n;
            *text = strdup(literals[i].word);
            return literals[i].kind;
        }
    }
    size_t n = json_number_length(j);
    if (n == 0) json_fail(j, "%s: not a JSON value", what);
    *text = xcalloc(n + 1, 1);
    memcpy(*text, j->p, n);
    j->p += n;
    return JSON_NUMBER;
}

/* One parsed line: the options it runs with (the command line's, with its
   fields applied), its prompt and its id as JSON text. */
typedef struct {
    Options o;
    char *prompt;
    int *ids, n_ids;        /* the prompt as token ids ("prompt_ids"; the server's "prompt" list); NULL: none */
    char *id;
    char *stops[MAX_STOPS]; /* the texts o.controls.stops points to */
    JsonSchema *schema;     /* its "response_format"'s (or its tools' calls': 11.2), which o.schema points to; NULL: none */
    struct ServeFields *chat; /* a chat line's "messages", "tools", "tool_choice", "parallel_tool_calls" (11.2); NULL: none */
    int tools_given;        /* whether the line has "tools" (else --tools's) */
    int tool_choice_given;  /* whether the line has "tool_choice" (else --tool-choice's, with --tools's) */
} BatchLine;

/* The strings a line's parse holds for a moment (field names, a value's
   text). An error leaves the parse at once (a longjmp to the trap of
   parse_line, or of the tests), so they live here, where the next parse or
   the trap frees them, not in locals. */
typedef struct {
    char *names[16];    /* (n_names) the fields seen so far */
    int n_names;
    char *text;         /* the value being applied */
} JsonTemps;

static void json_temps_free(JsonTemps *t) {
    for (int i = 0; i < t->n_names; i++) free(t->names[i]);
    free(t->text);
    memset(t, 0, sizeof(*t));
}

/* The positions a run of `steps` (-n) may use: 0 or more than the context
   means the context. */
static int resolve_steps(int steps, int seq_len) { return steps == 0 || steps > seq_len ? seq_len : steps; }

/* The value of a number field, checked as check_number does. */
static double number_field(const JsonCursor *j, const char *name, JsonKind kind, const char *text, double lo, double hi) {
    double v = 0;
    int bad = kind != JSON_NUMBER ? 1 : check_number(text, lo, hi, &v);
    if (bad == 1) json_fail(j, "field '%s': must be a number", name);
    if (bad == 2) json_fail(j, "field '%s': %s is outside [%g, %g]", name, text, lo, hi);
    return v;
}

static long long integer_field(const JsonCursor *j, const char *name, JsonKind kind, const char *text, long long lo, long long hi) {
    long long v = 0;
    int bad = kind != JSON_NUMBER ? 1 : check_integer(text, lo, hi, &v);
    if (bad == 1) json_fail(j, "field '%s': must be an integer", name);
    if (bad == 2) json_fail(j, "field '%s': %s is outside [%lld, %lld]", name, text, lo, hi);
    return v;
}

/* Empties the line's stop strings, freeing those it read (the command
   line's, which it inherits, are only pointed to: their line->stops are
   NULL). Field "stop" calls it first, so that a line's stop strings
   replace the command line's, as every field given replaces its default. */
static void free_batch_stops(BatchLine *line) {
    for (int k = 0; k < line->o.controls.n_stops; k++) free(line->stops[k]);
    line->o.controls.n_stops = 0;
}

/* One more stop string of a batch line (field "stop"). */
static void add_batch_stop(const JsonCursor *j, BatchLine *line, const char *text) {
    Controls *c = &line->o.controls;
    if (text[0] == '\0') json_fail(j, "field 'stop': an empty string");
    if (c->n_stops == MAX_STOPS) json_fail(j, "field 'stop': more than %d strings", MAX_STOPS);
    line->stops[c->n_stops] = strdup(text);
    c->stops[c->n_stops] = line->stops[c->n_stops];
    c->n_stops++;
}

/* Refuses a field no request has; where it is another program's name or
   an option's that the batch spells otherwise, names the field meant. */
static void unknown_batch_field(const JsonCursor *j, const char *name) {
    static const char *const guesses[][2] = {
        {"json", "response_format"}, {"json_schema", "response_format"}, {"json_object", "response_format"},
        {"max_tokens", "max_new_tokens"}, {"n", "steps"}, {"num_beams", "beams"}, {"b", "beams"},
        {"t", "temperature"}, {"p", "top_p"}, {"s", "seed"}, {"i", "prompt"}, {"input", "prompt"}, {"text", "prompt"},
    };
    for (size_t g = 0; g < sizeof(guesses) / sizeof(guesses[0]); g++)
        if (strcmp(name, guesses[g][0]) == 0) json_fail(j, "unknown field '%s' (did you mean '%s'?)", name, guesses[g][1]);
    json_fail(j, "unknown field '%s'", name);
}

/* Applies field `name` with value (kind, text) to the line. */
static void apply_field(const JsonCursor *j, BatchLine *line, const char *name, JsonKind kind, const char *text, int vocab) {
    Options *o = &line->o;
    if (strcmp(name, "prompt") == 0) {
        if (kind != JSON_STRING) json_fail(j, "field 'prompt': must be a string");
        line->prompt = strdup(text);
    } else if (strcmp(name, "id") == 0) {
        if (kind != JSON_STRING && kind != JSON_NUMBER) json_fail(j, "field 'id': must be a string or a number");
        line->id = kind == JSON_STRING ? json_quote(text) : strdup(text);
    } else if (strcmp(name, "steps") == 0) {
        o->steps = (int)integer_field(j, name, kind, text, 0, INT_MAX);
        o->steps_given = 1;
    } else if (strcmp(name, "max_new_tokens") == 0) o->max_new_tokens = (int)integer_field(j, name, kind, text, 1, INT_MAX);
    else if (strcmp(name, "temperature") == 0) o->temperature = (float)number_field(j, name, kind, text, 0.0, 1e30);
    else if (strcmp(name, "top_p") == 0) o->topp = (float)number_field(j, name, kind, text, 0.0, 1.0);
    else if (strcmp(name, "seed") == 0) o->seed = (uint64_t)integer_field(j, name, kind, text, 0, LLONG_MAX);
    else if (strcmp(name, "beams") == 0) o->beams = (int)integer_field(j, name, kind, text, 1, vocab);
    else if (strcmp(name, "length_penalty") == 0) o->length_penalty = (float)number_field(j, name, kind, text, -1e30, 1e30);
    else if (strcmp(name, "return") == 0) o->n_return = (int)integer_field(j, name, kind, text, 1, INT_MAX);
    else if (strcmp(name, "min_new_tokens") == 0) o->controls.min_new_tokens = (int)integer_field(j, name, kind, text, 0, INT_MAX);
    else if (strcmp(name, "no_repeat_ngram_size") == 0) o->controls.no_repeat_ngram_size = (int)integer_field(j, name, kind, text, 0, INT_MAX);
    else if (strcmp(name, "top_k") == 0) o->controls.top_k = (int)integer_field(j, name, kind, text, 0, vocab);
    else if (strcmp(name, "min_p") == 0) o->controls.min_p = (float)number_field(j, name, kind, text, 0.0, 1.0);
    else if (strcmp(name, "repetition_penalty") == 0) {
        o->controls.repetition_penalty = (float)number_field(j, name, kind, text, 0.0, 1e30);
        if (!(o->controls.repetition_penalty > 0.0f)) json_fail(j, "field 'repetition_penalty': must be above 0");
    } else if (strcmp(name, "stop") == 0) {
        if (kind != JSON_STRING) json_fail(j, "field 'stop': must be a string or a list of strings");
        free_batch_stops(line);
        add_batch_stop(j, line, text);
    }
    else if (strcmp(name, "early_stopping") == 0) {
        if (kind == JSON_STRING && strcmp(text, "never") == 0) o->early_stopping = STOP_NEVER;
        else if (kind == JSON_NUMBER && strcmp(text, "0") == 0) o->early_stopping = STOP_HEURISTIC;
        else if (kind == JSON_NUMBER && strcmp(text, "1") == 0) o->early_stopping = STOP_EARLY;
        else json_fail(j, "field 'early_stopping': must be 0, 1 or \"never\"");
    } else {
        unknown_batch_field(j, name);
    }
}

/* The value of "stop" when it is a list: each string is a stop string.
   *text holds the one being read (the caller frees it after an error). */
static void parse_stop_list(JsonCursor *j, BatchLine *line, char **text) {
    j->p++; /* [ */
    json_space(j);
    free_batch_stops(line);
    for (int first = 1; json_next_item(j, ']', &first, "field 'stop': expected ',' or ']' in the list");) {
        if (j->p >= j->end || *j->p != '"') json_fail(j, "field 'stop': must be a string or a list of strings");
        j->p++;
        *text = json_string(j, "stop");
        add_batch_stop(j, line, *text);
        free(*text);
        *text = NULL;
        json_space(j);
    }
    j->p++; /* ] */
}

/* A prompt as token ids (field `field`): a list of integers in [0, vocab).
   They are the prompt exactly: BOS is not added. */
static void parse_token_ids(JsonCursor *j, BatchLine *line, const char *field, int vocab, char **text) {
    j->p++; /* [ */
    json_space(j);
    free(line->ids);
    line->ids = NULL;
    line->n_ids = 0;
    for (int first = 1; json_next_item(j, ']', &first, "expected ',' or ']' in the list of token ids");) {
        JsonKind kind = json_value(j, field, text);
        long long id = integer_field(j, field, kind, *text, 0, vocab - 1);
        free(*text);
        *text = NULL;
        line->ids = realloc(line->ids, (size_t)(line->n_ids + 1) * sizeof(int));
        if (!line->ids) die(EXIT_BAD_FILE, "out of memory");
        line->ids[line->n_ids++] = (int)id;
        json_space(j);
    }
    j->p++; /* ] */
    if (line->n_ids == 0) json_fail(j, "field '%s': an empty list of token ids", field);
}

/* Field "response_format", OpenAI's: {"type": "text"}, {"type":
   "json_object"} or {"type": "json_schema", "json_schema": {"name",
   "schema", "strict", "description"}}; the line's answers follow it. */
static void apply_response_format(JsonCursor *j, BatchLine *line) {
    char err[256];
    size_t used = 0;
    int plain;
    JsonSchema *s = compile_json_value(j->p, j->end, 1, &used, &plain, err, sizeof(err));
    if (!s && !plain) json_fail(j, "field 'response_format': %s", err);
    j->p += used;
    free_schema(line->schema);
    line->schema = s;
    line->o.schema = s;
}

/* Parses one line (a flat JSON object) over the defaults in line->o. */
static int run_positions(const Options *o, int seq_len);
static void batch_chat_field(JsonCursor *j, BatchLine *line, const char *name, int vocab); /* 11.2 */

static void parse_batch_line(JsonCursor *j, BatchLine *line, JsonTemps *tmp, int vocab, int seq_len) {
    json_temps_free(tmp);
    json_space(j);
    if (j->p >= j->end || *j->p != '{') json_fail(j, "not a JSON object");
    j->p++;
    json_space(j);
    for (int first = 1; json_next_item(j, '}', &first, "expected ',' or '}' after a field");) {
        if (j->p >= j->end || *j->p != '"') json_fail(j, "expected a field name in quotes");
        j->p++;
        if (tmp->n_names == 16) json_fail(j, "too many fields");
        char *name = tmp->names[tmp->n_names++] = json_string(j, "field name");
        json_space(j);
        if (j->p >= j->end || *j->p != ':') json_fail(j, "expected ':' after field '%s'", name);
        j->p++;
        json_space(j);
        for (int i = 0; i < tmp->n_names - 1; i++)
            if (strcmp(tmp->names[i], name) == 0) json_fail(j, "field '%s' appears twice", name);
        if (strcmp(name, "stop") == 0 && j->p < j->end && *j->p == '[') {
            parse_stop_list(j, line, &tmp->text);
        } else if (strcmp(name, "prompt_ids") == 0) {
            if (j->p >= j->end || *j->p != '[') json_fail(j, "field 'prompt_ids': must be a list of token ids");
            parse_token_ids(j, line, name, vocab, &tmp->text);
        } else if (strcmp(name, "response_format") == 0) {
            apply_response_format(j, line);
        } else if (strcmp(name, "messages") == 0 || strcmp(name, "tools") == 0 || strcmp(name, "tool_choice") == 0 ||
                   strcmp(name, "parallel_tool_calls") == 0) {
            batch_chat_field(j, line, name, vocab); /* a chat, as the server's (11.2) */
        } else {
            JsonKind kind = json_value(j, name, &tmp->text);
            apply_field(j, line, name, kind, tmp->text, vocab);
            free(tmp->text);
            tmp->text = NULL;
        }
        json_space(j);
    }
    j->p++;
    json_space(j);
    if (j->p < j->end) json_fail(j, "text after the object");
    json_temps_free(tmp);
    if (!line->prompt && !line->ids && !line->chat) json_fail(j, "missing field 'prompt' (or 'prompt_ids', or 'messages')");
    if (line->prompt && line->ids) json_fail(j, "fields 'prompt' and 'prompt_ids' both give the prompt: use one");
    int positions = line->o.keep >= 0 ? run_positions(&line->o, seq_len) : resolve_steps(line->o.steps, seq_len);
    if (line->o.controls.min_new_tokens > positions)
        json_fail(j, "field 'min_new_tokens': %d is more than the %d positions to run (steps)", line->o.controls.min_new_tokens,
                  positions);
    if (line->o.n_return > (line->o.beams > 0 ? line->o.beams : 1))
        json_fail(j, "field 'return': %d is more hypotheses than the %d beams keep", line->o.n_return, line->o.beams > 0 ? line->o.beams : 1);
}

/* Whether o's tokens are drawn at random (a temperature above 0 and no
   beam search): only then does a seed change them, and is one named. */
static int samples(const Options *o) { return o->temperature > 0 && o->beams == 0; }

/* How a request with options o continues its prompt; seed 0 takes the
   run's clock seed. */

static Decoding decoding_of(const Options *o, uint64_t clock_seed) {
    /* one beam is greedy search, as in the library: it stops at the first
       end token whatever -e says */
    EarlyStopping early = o->beams == 1 ? STOP_EARLY : o->early_stopping;
    return (Decoding){o->temperature, o->topp, o->seed ? o->seed : clock_seed, {o->beams, o->length_penalty, early},
                      o->n_return, o->format, o->controls, o->max_new_tokens, o->keep >= 0, o->keep >= 0 ? o->keep : 0, o->schema, NULL, NULL};
}

/* The positions a run may use: -n (0 or above the context: the context), as
   in llama2.c; without -n, 256 for generate, as llama2.c, but the whole
   context for a chat and for --max-new-tokens, which set their own limits. */
static int context_positions(const Options *o, int seq_len) {
    int steps = o->steps;
    if (!o->steps_given && (strcmp(o->mode, "chat") == 0 || o->max_new_tokens > 0)) steps = 0;
    return (steps == 0 || steps > seq_len) ? seq_len : steps;
}

/* The positions a run counts: context_positions(), but with --keep, which
   goes past the context, -n is not capped by it (0 is still the context),
   and without -n --max-new-tokens alone bounds the run. */
static int run_positions(const Options *o, int seq_len) {
    if (o->keep < 0) return context_positions(o, seq_len);
    if (o->steps_given) return o->steps > 0 ? o->steps : seq_len;
    return o->max_new_tokens > 0 ? INT_MAX : o->steps;
}


/* ---- Lines as they arrive --------------------------------------------------- */

/* The batch input, read in pieces as they arrive (input_wait says when a
   read would not block) and cut into lines. */
typedef struct {
    int fd;
    const char *name;       /* the path, - for stdin: line N is name:N in errors */
    char *buf;              /* (cap) bytes read; buf[start..len-1] are not yet taken */
    size_t start, scanned, len, cap; /* buf[start..scanned-1] holds no newline */
    int line_no;            /* lines taken */
    int ended;              /* the end of input was read (or Ctrl-C came) */
} BatchInput;

/* Bytes asked of one read; and how long an idle batch waits for input at a
   time before it looks at Ctrl-C again. */
#define BATCH_READ_BYTES 65536
#define BATCH_IDLE_WAIT_MS 100

static void batch_input_open(BatchInput *in, const char *path) {
    memset(in, 0, sizeof(*in));
    in->name = path;
    in->fd = input_open(path);
    if (in->fd < 0) die(EXIT_BAD_FILE, "%s: cannot open the batch file: %s", path, strerror(errno));
    struct stat st;
    if (fstat(in->fd, &st) == 0 && S_ISDIR(st.st_mode)) {
        input_close(in->fd);
        die(EXIT_BAD_FILE, "%s: the batch file is a directory", path);
    }
}

static void batch_input_close(BatchInput *in) {
    input_close(in->fd);
    free(in->buf);
    memset(in, 0, sizeof(*in));
}

/* Room for one more read after the bytes not yet taken (moved to the
   front: the lines before them are done with). */
static void batch_input_room(BatchInput *in) {
    if (in->start > 0) {
        memmove(in->buf, in->buf + in->start, in->len - in->start);
        in->len -= in->start;
        in->scanned -= in->start;
        in->start = 0;
    }
    if (in->cap - in->len >= BATCH_READ_BYTES) return;
    size_t cap = in->cap ? 2 * in->cap : 2 * BATCH_READ_BYTES;
    char *grown = realloc(in->buf, cap);
    if (!grown) die(EXIT_BAD_FILE, "%s: out of memory reading a line of %zu bytes", in->name, in->len);
    in->buf = grown;
    in->cap = cap;
}

/* Reads what has arrived, after waiting up to timeout_ms for something to:
   until a line is whole or nothing more is there now. */
static void batch_input_fill(BatchInput *in, int timeout_ms) {
    for (int wait = timeout_ms; !in->ended && input_wait(in->fd, wait); wait = 0) {
        batch_input_room(in);
        ptrdiff_t k = input_read(in->fd, in->buf + in->len, BATCH_READ_BYTES);
        if (k == -1) die(EXIT_BAD_FILE, "%s: cannot read the batch file: %s", in->name, strerror(errno));
        if (k == 0) in->ended = 1;
        if (k <= 0) return;
        in->len += (size_t)k;
        if (memchr(in->buf + in->len - k, '\n', (size_t)k)) return;
    }
}

/* The next whole line, without its newline (after the end of input, the
   last one even without), and its length; NULL when there is none yet. It
   lives until the next fill. */
static const char *batch_input_line(BatchInput *in, size_t *n) {
    const char *nl = in->len > in->scanned ? memchr(in->buf + in->scanned, '\n', in->len - in->scanned) : NULL;
    in->scanned = in->len;
    if (!nl && !(in->ended && in->len > in->start)) return NULL;
    const char *line = in->buf + in->start, *end = nl ? nl : in->buf + in->len;
    *n = (size_t)(end - line);
    in->start = in->scanned = (size_t)(end - in->buf) + (nl != NULL);
    in->line_no++;
    return line;
}

/* Whether every line has been taken and no more will come. */
static int batch_input_done(const BatchInput *in) { return in->ended && in->start == in->len; }

/* Ctrl-C: no more lines are taken; the requests running end as they do in
   a lone run. */
static void batch_input_stop(BatchInput *in) {
    in->ended = 1;
    in->start = in->scanned = in->len;
}

/* ---- A line: a request, or refused alone ------------------------------------ */

/* What a line is checked against: the model's vocabulary and context, and
   the beams the engine was set up for; `windowed`: the model has
   sliding-window layers, which --keep's ring does not serve. */
typedef struct {
    int vocab, seq_len, max_beams, windowed;
    const Tokenizer *tok; /* a chat line's template (11.2) */
} BatchLimits;

static void batch_chat_check(JsonCursor *j, BatchLine *line, const Tokenizer *tok);
static void free_batch_chat(BatchLine *line);

/* Parses line `text` (n bytes, named `where` in errors) into *line, over the
   defaults in line->o. Returns 1 for a request, 0 for a blank line (spaces
   only), -1 for a refused one: its message went to stderr and is in
   error_text; line->id stays when it was read, the rest is freed. An error
   that is not the line's (out of memory) goes on to the caller's trap. */
static int parse_line(const char *text, size_t n, const char *where, BatchLine *line, JsonTemps *tmp, const BatchLimits *lim) {
    JsonCursor j = {text, text + n, where};
    json_space(&j);
    if (j.p == j.end) return 0;
    jmp_buf trap, *outer = error_trap;
    error_trap = &trap;
    if (setjmp(trap)) {
        error_trap = outer;
        if (error_status != EXIT_USAGE) leave(error_status);
        json_temps_free(tmp);
        free(line->prompt);
        line->prompt = NULL;
        free(line->ids);
        line->ids = NULL;
        free_batch_stops(line);
        free_schema(line->schema);
        line->schema = NULL;
        free_batch_chat(line);
        return -1;
    }
    parse_batch_line(&j, line, tmp, lim->vocab, lim->seq_len);
    if (line->chat) batch_chat_check(&j, line, lim->tok);
    if (line->o.beams > lim->max_beams)
        json_fail(&j, "field 'beams': %d is more than a batch runs (%d, or -b when that is more)", line->o.beams, lim->max_beams);
    if (line->o.keep >= 0 && lim->windowed) json_fail(&j, "field 'keep': this model's sliding-window layers do not work with it");
    error_trap = outer;
    return 1;
}

/* A refused line's JSON line: its number, its id when it was read, and why.
   The caller frees it. */
static char *refusal_line(int line_no, const char *id, const char *message) {
    char *quoted = json_quote(message);
    size_t size = strlen(quoted) + (id ? strlen(id) : 0) + 48;
    char *text = xcalloc(size, 1);
    if (id) snprintf(text, size, "{\"line\":%d,\"id\":%s,\"error\":%s}\n", line_no, id, quoted);
    else snprintf(text, size, "{\"line\":%d,\"error\":%s}\n", line_no, quoted);
    free(quoted);
    return text;
}

/* ---- The output: each line's results as it ends, or in input order -------- */

/* A line's place in the output. */
typedef struct {
    Request *request;   /* NULL for a refused line */
    char *refusal;      /* a refused line's JSON line */
    int handed;         /* done and handed over by the engine (a refusal: at once) */
    int printed;
    int chat;           /* a line with "messages": its answers carry the message (11.2) */
    int calls;          /* how its replies make tool calls: CALLS_NONE, ... (11.1) */
    int line_no;        /* its line's number: its calls' ids are call_N_K */
} BatchSlot;

typedef struct {
    const Tokenizer *tok;
    BatchSlot *slots;   /* (n - base, of cap) the places of lines base.. */
    int base, n, cap;
    int first;          /* the first place not yet printed: those before it are dropped when room is needed */
    int ordered, progress; /* --ordered; whether to show the count of requests done on stderr (a terminal) */
    int requests, done, failed, refused;
} BatchOutput;

static BatchSlot *slot_at(BatchOutput *out, int i) { return &out->slots[i - out->base]; }

/* A new place at the end: its index. */
static int new_slot(BatchOutput *out) {
    if (out->n - out->base == out->cap) {
        int dropped = out->first - out->base;
        if (dropped > out->cap / 2) {
            memmove(out->slots, out->slots + dropped, (size_t)(out->n - out->first) * sizeof(BatchSlot));
            out->base = out->first;
        } else {
            out->cap = out->cap ? 2 * out->cap : 64;
            BatchSlot *grown = realloc(out->slots, (size_t)out->cap * sizeof(BatchSlot));
            if (!grown) die(EXIT_BAD_FILE, "out of memory (%d batch lines in flight)", out->cap);
            out->slots = grown;
        }
    }
    memset(&out->slots[out->n - out->base], 0, sizeof(BatchSlot));
    return out->n++;
}

static void print_chat_hypothesis(const Tokenizer *tok, const char *id, int rank, const Hypothesis *h, int last_prompt_token,
                                  int calls, const char *prefix); /* 11.2 */

/* A request's JSON lines (its error, or its hypotheses); then it is freed,
   with the stop strings its line allocated. */
static void print_request(BatchOutput *out, const BatchSlot *s) {
    Request *r = s->request;
    if (r->error) {
        printf("{\"id\":%s,\"error\":", r->id);
        print_json_string(r->error);
        printf("}\n");
        out->failed++;
    } else {
        int n_show = r->n_hyps < r->d.n_return ? r->n_hyps : r->d.n_return;
        char prefix[32];
        snprintf(prefix, sizeof(prefix), "call_%d", s->line_no);
        for (int i = 0; i < n_show; i++) {
            if (s->chat) print_chat_hypothesis(out->tok, r->id, i + 1, &r->hyps[i], r->prompt[r->n_prompt - 1], s->calls, prefix);
            else print_json_hypothesis(out->tok, r->id, i + 1, &r->hyps[i], r->prompt[r->n_prompt - 1]);
        }
    }
    for (int k = 0; k < r->d.controls.n_stops; k++) free((char *)r->d.controls.stops[k]);
    request_free(r);
}

static void print_slot(BatchOutput *out, int i) {
    BatchSlot *s = slot_at(out, i);
    if (s->refusal) fputs(s->refusal, stdout);
    else print_request(out, s);
    free(s->refusal);
    *s = (BatchSlot){.handed = 1, .printed = 1};
    flush_output();
    while (out->first < out->n && slot_at(out, out->first)->printed) out->first++;
}

/* Line i is done: printed at once, or with --ordered once the lines before
   it are. */
static void hand_slot(BatchOutput *out, int i) {
    slot_at(out, i)->handed = 1;
    if (!out->ordered) print_slot(out, i);
    else
        while (out->first < out->n && slot_at(out, out->first)->handed) print_slot(out, out->first);
}

/* The engine's callback when a request is done. In input order, a request
   is printed (and freed) once handed over, not merely done: requests that
   finish in the same step are handed over one by one, and the engine still
   holds the later ones. */
static void batch_request_done(Request *r, void *user) {
    BatchOutput *out = user;
    if (out->progress) fprintf(stderr, "\rbatch: %d of %d requests done", ++out->done, out->requests);
    hand_slot(out, r->index);
}

/* ---- The run ---------------------------------------------------------------- */

/* Beams a batch line may ask for, unless -b is more: the engine is set up
   before any line is read, with rows for this many beams of every request. */
#define BATCH_MAX_BEAMS 4

/* The lines of the batch so far, the engine they run on, and the output. */
typedef struct {
    Engine *e;
    const Tokenizer *tok;
    const Options *defaults;
    BatchLimits limits;
    uint64_t clock_seed;
    int seed_named;      /* whether stderr has named the clock's seed (for the lines that use it) */
    BatchInput in;
    BatchOutput out;
    JsonTemps temps;     /* the line being parsed */
    char *where;         /* "name:N" of the line being parsed */
} BatchRun;

static void name_clock_seed(uint64_t clock_seed);

static int waiting_requests(const Engine *e) { return e->n_queue - e->next_waiting + e->n_paused; }

/* encode_prompt for a batch line: NULL, with *why, for a prompt that does
   not fit `room` or that the tokenizer cannot encode (a byte without a
   token: named on stderr), which fails its own request only. */
static int *line_prompt(const Tokenizer *tok, const char *text, int room, int *n_tokens, const char **why) {
    jmp_buf trap, *outer = error_trap;
    int *volatile tokens = NULL;
    *why = "the prompt does not fit the model's context";
    error_trap = &trap;
    if (setjmp(trap) == 0) tokens = encode_prompt(tok, text, room, n_tokens);
    else *why = "the tokenizer has no token for a byte of the prompt";
    error_trap = outer;
    return tokens;
}

/* A line's prompt given as token ids, taken from it, or NULL (freed) when
   they do not fit `room` positions. */
static int *take_ids(BatchLine *line, int room, int *n_tokens, const char **why) {
    if (!line->ids) return NULL;
    int *ids = line->ids;
    *n_tokens = line->n_ids;
    line->ids = NULL;
    *why = "the prompt does not fit the model's context";
    if (*n_tokens <= room) return ids;
    free(ids);
    return NULL;
}

static int *batch_chat_prompt(BatchLine *line, const Tokenizer *tok, int room, int *n_tokens, const char **why, int *calls); /* 11.2 */
static void constrain_calls(Decoding *d, int calls);

/* The request of a parsed line, which it takes (prompt, id, stop strings),
   at place i: submitted to the engine, or done at once when it cannot run
   or has nothing to generate. */
static void submit_line(BatchRun *b, BatchLine *line, int i) {
    const int seq_len = b->limits.seq_len;
    int steps = run_positions(&line->o, seq_len), n_prompt = 0;
    const char *why;
    BatchSlot *slot = slot_at(&b->out, i);
    int *prompt = line->chat ? batch_chat_prompt(line, b->tok, seq_len, &n_prompt, &why, &slot->calls)
                  : line->ids ? take_ids(line, seq_len, &n_prompt, &why) : line_prompt(b->tok, line->prompt, seq_len, &n_prompt, &why);
    free(line->prompt);
    for (int k = 0; k < line->o.controls.n_stops; k++) /* the request frees them all: the command line's are copied */
        if (!line->stops[k]) line->o.controls.stops[k] = line->stops[k] = strdup(line->o.controls.stops[k]);
    Decoding d = decoding_of(&line->o, b->clock_seed);
    d.format = FORMAT_JSON;
    constrain_calls(&d, slot->calls);
    slot->chat = line->chat != NULL;
    slot->line_no = b->in.line_no;
    free_batch_chat(line);
    /* a chat's reply ends at the end of its turn, as the server's */
    Request *r = request_new(prompt, n_prompt, prompt ? cap_new_tokens(&d, steps - n_prompt + 1) : 0, slot->chat || b->tok->eos_ends_generate, &d);
    r->index = i;
    r->id = line->id;
    r->own_schema = line->schema;
    slot->request = r;
    b->out.requests++;
    if (!prompt) {
        r->error = why;
        r->state = REQUEST_DONE;
    } else if (d.rolling && d.beam.beams > 0) {
        r->error = "--keep does not work with beam search (beams)";
        r->state = REQUEST_DONE;
    } else if (steps < n_prompt) { /* nothing to generate, as a lone run with this -n */
        r->hyps[0] = make_hypothesis(NULL, 0, "length");
        r->n_hyps = 1;
        r->state = REQUEST_DONE;
    }
    if (r->state == REQUEST_DONE) batch_request_done(r, &b->out);
    else engine_submit(b->e, r);
}

/* Takes line `text` (n bytes), the input's last: a request for the engine,
   a refusal printed in its turn, or nothing (a blank line). */
static void take_line(BatchRun *b, const char *text, size_t n) {
    snprintf(b->where, strlen(b->in.name) + 24, "%s:%d", b->in.name, b->in.line_no);
    BatchLine line = {.o = *b->defaults};
    int kind = parse_line(text, n, b->where, &line, &b->temps, &b->limits);
    if (kind == 0) return;
    int i = new_slot(&b->out);
    if (kind < 0) {
        slot_at(&b->out, i)->refusal = refusal_line(b->in.line_no, line.id, error_text);
        free(line.id);
        b->out.refused++;
        hand_slot(&b->out, i);
        return;
    }
    if (!line.id) {
        line.id = xcalloc(16, 1);
        snprintf(line.id, 16, "%d", b->in.line_no);
    }
    if (line.o.seed == 0 && samples(&line.o) && !b->seed_named) {
        name_clock_seed(b->clock_seed);
        b->seed_named = 1;
    }
    submit_line(b, &line, i);
}

/* Runs the batch of options o on the engine e (set up by batch_setup): a
   line is taken as soon as it is read, while the engine has places to fill
   soon (so a file is not read all ahead), and the engine steps meanwhile;
   input is waited for only when no request has work. Returns the exit
   status: 1 when a line was refused or a request failed. */
static int run_batch(Engine *e, const Tokenizer *tok, const Options *o, uint64_t clock_seed) {
    const Config *p = &e->t->config;
    int max_beams = o->beams > BATCH_MAX_BEAMS ? o->beams : BATCH_MAX_BEAMS;
    BatchRun b = {.e = e, .tok = tok, .defaults = o, .limits = {p->vocab_size, p->seq_len, max_beams, p->window > 0, tok}, .clock_seed = clock_seed};
    b.out = (BatchOutput){.tok = tok, .ordered = o->ordered, .progress = isatty(STDERR_FILENO)};
    batch_input_open(&b.in, o->batch_file);
    b.where = xcalloc(strlen(b.in.name) + 24, 1);
    e->on_done = batch_request_done;
    e->user = &b.out;
    for (;;) {
        if (interrupted()) batch_input_stop(&b.in);
        const char *text;
        size_t n;
        int room = waiting_requests(e) < e->parallel; /* else the lines wait, unread or untaken */
        while (room && (text = batch_input_line(&b.in, &n))) {
            take_line(&b, text, n);
            room = waiting_requests(e) < e->parallel;
        }
        int busy = e->n_running > 0 || waiting_requests(e) > 0;
        if (room && !b.in.ended) batch_input_fill(&b.in, busy ? 0 : BATCH_IDLE_WAIT_MS);
        if (busy) engine_step(e);
        else if (batch_input_done(&b.in)) break;
    }
    if (b.out.progress && b.out.requests > 0) fputc('\n', stderr);
    batch_input_close(&b.in);
    free(b.where);
    json_temps_free(&b.temps);
    free(b.out.slots);
    int lines = b.out.requests + b.out.refused;
    if (lines == 0) fprintf(stderr, "run: note: %s: no requests (no line with a JSON object)\n", o->batch_file);
    if (b.out.refused) fprintf(stderr, "run: %d of %d lines refused\n", b.out.refused, lines);
    if (b.out.failed) fprintf(stderr, "run: %d of %d requests failed\n", b.out.failed, b.out.requests);
    return b.out.refused || b.out.failed ? EXIT_BAD_FILE : 0;
}

/* Sets up e for a batch of options o before it sees a line: rows for
   --parallel requests of up to BATCH_MAX_BEAMS beams (or -b) and the model's
   whole context; by default, a cache that holds --parallel sampled requests
   of the command line's positions (-n) at once, and one request of the most
   beams at the whole context, so that every line fits (a longer one waits
   for room); --kv-mb sets it. */
static void batch_setup(Engine *e, Transformer *t, const Tokenizer *tok, const Options *o, Speculator *spec) {
    const Config *p = &t->config;
    int beams = o->beams > BATCH_MAX_BEAMS ? o->beams : BATCH_MAX_BEAMS, kv_mb = o->kv_mb;
    if (kv_mb == 0) {
        const CacheShape shape = cache_shape(t, o->kv_type, spec);
        int positions = context_positions(o, p->seq_len);
        double main_blocks = fmax(o->parallel * (request_main_blocks(1, positions) + 1), request_main_blocks(beams, p->seq_len));
        double bytes = cache_bytes(&shape, main_blocks, windows_wanted(&shape, o->parallel, beams, p->seq_len));
        kv_mb = (int)fmin(ceil(bytes / 1048576.0), INT_MAX);
    }
    engine_setup(e, t, tok, o->parallel, beams, p->seq_len, kv_mb, o->kv_type, spec);
    e->stats.keeping = o->keep >= 0;
}

/* ------------------------------------------------------------------------ */
/* 11. Serving: HTTP on the engine                                          */
/* ------------------------------------------------------------------------ */

/* -m serve: an HTTP/1.1 server with the OpenAI API's completions and chat
   completions, on one thread. Its loop waits on the sockets (without waiting
   while requests are in flight), reads what arrived, and runs one engine
   step; a request that arrives while others run joins the next step's batch.
   Each request is built as --batch builds it, so its text is the command
   line's for the same prompt, settings and seed. Connections are
   persistent (HTTP/1.1 keep-alive): after an answer the next request is
   read from the same connection, unless the client sent "Connection:
   close", spoke HTTP/1.0, or its request could not be parsed; a streamed
   answer is Server-Sent Events in chunked transfer coding, so that its end
   is marked without closing. Limits come before memory: a header over
   HTTP_MAX_HEADER bytes or a body over --max-body-kb is refused before it
   is stored. A crowd is held, not refused (see "Holding a crowd" below):
   requests beyond what the engine runs at once wait in its queue, first
   come first served, and only beyond --max-queue get 429; up to
   --max-conns connections are open at once, and the loop's cost per engine
   step is that of the sockets that are ready, not of those open; slow and
   hostile clients are dropped by deadlines and a cap on what is buffered
   for them. A client that goes away cancels its request. */

#define HTTP_MAX_HEADER 16384
#define SERVE_MAX_BEAMS 4 /* num_beams at most, unless -b is more */
#define SERVE_MAX_N 16     /* n: choices of one completion, at most */
#define SERVE_TURN 64      /* a request's first turn: tokens before a newer one may take its place (see "Turns") */

/* s as a JSON string (see json_quote). */
static void buf_json(ByteBuf *b, const char *s) {
    char *q = json_quote(s);
    buf_add(b, q, strlen(q));
    free(q);
}

/* ---- HTTP requests ------------------------------------------------------- */

/* A parsed request: the method and path (query cut off), the body and the
   Authorization header's value (pointers into the received bytes). */
typedef struct {
    char method[8];
    char path[128];
    size_t header_len, body_len;
    const char *body;
    const char *auth;
    size_t auth_len;
    int expect_continue;   /* "Expect: 100-continue": the client waits for a go-ahead before the body */
    int close;             /* HTTP/1.0, or "Connection: close": the connection ends after the answer */
} HttpRequest;

/* Whether header line [p, end) is `name:` (any case); *value gets its value
   with the spaces around it cut. */
static int http_header_is(const char *p, const char *end, const char *name, const char **value, size_t *len) {
    size_t n = strlen(name);
    if ((size_t)(end - p) <= n || p[n] != ':') return 0;
    for (size_t i = 0; i < n; i++)
        if (tolower((unsigned char)p[i]) != name[i]) return 0;
    const char *v = p + n + 1;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t')) end--;
    *value = v;
    *len = (size_t)(end - v);
    return 1;
}

/* Whether the comma-separated header value [v, v + len) has `token` (any
   case) among its items. */
static int http_has_token(const char *v, size_t len, const char *token) {
    size_t n = strlen(token);
    for (size_t i = 0; i < len;) {
        while (i < len && (v[i] == ' ' || v[i] == '\t' || v[i] == ',')) i++;
        size_t start = i;
        while (i < len && v[i] != ',') i++;
        size_t end = i;
        while (end > start && (v[end - 1] == ' ' || v[end - 1] == '\t')) end--;
        int same = end - start == n;
        for (size_t k = 0; same && k < n; k++) same = tolower((unsigned char)v[start + k]) == token[k];
        if (same) return 1;
    }
    return 0;
}

/* Parses the n bytes received so far. Returns 0 when more are needed, 1
   when the request is whole (h filled), or the HTTP status that refuses it:
   400 (malformed), 413 (body over max_body), 431 (header too large), 501
   (a body not sent with Content-Length). */
static int http_parse(const char *buf, size_t n, size_t max_body, HttpRequest *h) {
    memset(h, 0, sizeof(*h));
    size_t scan = n < HTTP_MAX_HEADER ? n : HTTP_MAX_HEADER;
    const char *head_end = NULL;
    for (size_t i = 0; i + 4 <= scan; i++)
        if (memcmp(buf + i, "\r\n\r\n", 4) == 0) { head_end = buf + i; break; }
    if (!head_end) return n >= HTTP_MAX_HEADER ? 431 : 0;
    h->header_len = (size_t)(head_end - buf) + 4;
    /* the request line: METHOD SP target SP HTTP/1.x */
    const char *p = buf, *line_end = memchr(buf, '\r', (size_t)(head_end - buf) + 1);
    size_t m = 0;
    while (p < line_end && *p >= 'A' && *p <= 'Z' && m < sizeof(h->method) - 1) h->method[m++] = *p++;
    if (m == 0 || p >= line_end || *p++ != ' ') return 400;
    size_t t = 0;
    if (p >= line_end || *p != '/') return 400;
    while (p < line_end && *p != ' ') {
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f) return 400;
        if (t == sizeof(h->path) - 1) return 400;
        h->path[t++] = *p++;
    }
    char *query = strchr(h->path, '?');
    if (query) *query = '\0';
    if (line_end - p != 9 || (memcmp(p, " HTTP/1.1", 9) != 0 && memcmp(p, " HTTP/1.0", 9) != 0)) return 400;
    h->close = p[8] == '0';
    /* the header fields */
    int has_length = 0;
    for (p = line_end + 2; p < head_end + 2;) {
        const char *end = memchr(p, '\r', (size_t)(head_end + 2 - p));
        if (!end || end[1] != '\n') return 400;
        const char *v;
        size_t len;
        if (end == p || *p == ' ' || *p == '\t' || !memchr(p, ':', (size_t)(end - p))) return 400;
        if (http_header_is(p, end, "content-length", &v, &len)) {
            if (len == 0 || len > 12) return 400;
            size_t value = 0;
            for (size_t i = 0; i < len; i++) {
                if (!isdigit((unsigned char)v[i])) return 400;
                value = value * 10 + (size_t)(v[i] - '0');
            }
            if (has_length && value != h->body_len) return 400;
            has_length = 1;
            h->body_len = value;
        } else if (http_header_is(p, end, "transfer-encoding", &v, &len)) {
            return 501;
        } else if (http_header_is(p, end, "expect", &v, &len)) {
            h->expect_continue = len == 12 && strncmp(v, "100-continue", 12) == 0;
        } else if (http_header_is(p, end, "connection", &v, &len)) {
            h->close |= http_has_token(v, len, "close");
        } else if (http_header_is(p, end, "authorization", &v, &len)) {
            h->auth = v;
            h->auth_len = len;
        }
        p = end + 2;
    }
    if (h->body_len > max_body) return 413;
    if (n < h->header_len + h->body_len) return 0;
    h->body = buf + h->header_len;
    return 1;
}

/* ---- The request JSON ------------------------------------------------------ */

/* One prompt of a list of them: its text, or its token ids (then text is NULL). */
typedef struct {
    char *text;
    int *ids, n_ids;
} PromptItem;

/* ---- 11.1 Tool calls ----------------------------------------------------------
   A chat request may give "tools" (functions, each a name, a description and
   a JSON schema of its "parameters") and "tool_choice": "auto" (the default
   with tools), "none", "required", or {"type": "function", "function":
   {"name"}}; with "parallel_tool_calls" (default true) one reply may make
   several calls.
   The format is Hermes's, as the templates of Qwen2.5, Qwen3 and SmolLM3
   render it: the tools in the system message, each as the template's
   `tojson` writes it, a call as <tool_call>\n{"name": ..., "arguments":
   ...}\n</tool_call> in the assistant's message, the results as
   <tool_response> blocks in a user message. The messages are rewritten
   into such a plain conversation (tool_messages), which the family's
   renderer renders as any other: ChatML gets it exactly as Qwen's Jinja
   does; every other family (llama2.c's models, Llama 3, Gemma, ...) gets
   the same text in its own turns, the generic fallback for templates that
   have no tool format of theirs here.
   A call always parses and matches its function's parameters: the reply is
   constrained (6.1) by the schema of the calls, {"name": const, "arguments":
   parameters} for each function allowed (one of them, anyOf), or with
   parallel calls also a list of them. With "required" or a named function
   the prompt ends with the marker <tool_call>\n and the whole reply is the
   call; with "auto" the reply is free text until the model writes the
   marker itself, and the constraint holds from there (Decoding's
   constrain_after). A reply that ends with its calls whole answers with
   them as message.tool_calls, its text before the marker as the content,
   and finish_reason "tool_calls".
   Llama 3.1+'s templates (Tokenizer's llama31_tools) have a format of their
   own, which replaces Hermes's there: a system message that opens with
   "Environment: ipython" and the knowledge and today's dates, the tools in
   the first user message (each as `tojson(indent=4)` writes it, the
   template's default tools_in_user_message), a call as the assistant's
   whole message, plain JSON {"name": ..., "parameters": ...} (one a
   message: the template refuses more), and each result in an "ipython"
   message, as `tojson` writes its text. The messages are rendered as the
   template does (llama31_prompt_tokens); "required" and a named function
   constrain the whole reply to the call (no marker: the call is the
   reply). With "auto" no marker comes before a call, whose own first
   byte, '{', starts it (after white space and <|python_tag|>, when the
   model writes them), so the constraint switches on there (Decoding's
   constrain_leading): while the reply is only that lead, a token whose
   text would start the call is allowed only if the constraint takes its
   bytes from the '{' on, every other token stays free, and once the '{'
   is written the constraint holds to the end of the call, which ends the
   reply as under "required". A reply is then either free text (its
   content) or a call that parses and matches its function's parameters
   (cut short, by max_tokens, it is content). */

#define TOOL_MARKER "<tool_call>\n"
#define PYTHON_TAG "<|python_tag|>" /* Llama 3.1's, before a call (or not) */
#define SERVE_MAX_TOOLS 64 /* tools of one request, at most */
#define SERVE_MAX_CALLS 4  /* calls of one reply, at most (parallel_tool_calls) */

enum { TOOLS_AUTO, TOOLS_NONE, TOOLS_REQUIRED, TOOLS_NAMED };

typedef struct {
    char *name;
    char *json;       /* the tool as the templates' `tojson` writes it */
    char *parameters; /* its "parameters" as given; NULL: none (any object) */
} Tool;

typedef struct {
    Tool tools[SERVE_MAX_TOOLS]; /* (n) */
    int n;
    int choice;   /* TOOLS_* */
    char *named;  /* TOOLS_NAMED: the function's name */
    int parallel; /* parallel_tool_calls */
    int llama31;  /* Llama 3.1's format (see above; tool_messages sets it) */
} ToolSet;

/* One call of a reply. */
typedef struct {
    char *name, *arguments; /* arguments: the JSON text the reply wrote */
} ToolCall;

static void free_tools(ToolSet *ts) {
    for (int i = 0; i < ts->n; i++) { free(ts->tools[i].name); free(ts->tools[i].json); free(ts->tools[i].parameters); }
    free(ts->named);
}

/* A completion's fields as read from its JSON body: the options (the
   command line's, with the fields applied, as a --batch line), the prompt or
   the messages, and whether to stream. Owns every string. */
typedef struct ServeFields {
    BatchLine line;
    int stream, chat;
    int vocab;
    int max_tokens;          /* -1: not given */
    int n;                   /* choices (see "Choices and their log-probabilities") */
    int echo;                /* completions: the prompt comes before each choice's text */
    int logprobs;            /* log-probabilities asked for (completions: "logprobs" given; chat: true) */
    int top_logprobs;        /* alternatives per token; -1: not given */
    PromptItem prompts[SERVE_MAX_N]; /* (n_prompts) completions' "prompt" as a list of prompts; 0: one, in line */
    int n_prompts;
    char **roles, **contents; /* (n_messages) chat */
    char **calls;            /* (n_messages) an assistant message's tool calls, rendered (11.1); NULL: none */
    char **call_ids;         /* (n_messages) a tool message's tool_call_id; NULL: none */
    int n_messages, messages_given;
    ToolSet tools;           /* chat's "tools", "tool_choice" and "parallel_tool_calls" (11.1) */
    ToolCall call;           /* the call of a message's tool_calls being read */
    ByteBuf calls_text;      /* a message's tool_calls rendered so far (freed on any exit, as the call) */
    char *name, *text;       /* the field being read (freed on any exit) */
    char *member;            /* the name of the message field being read (the same) */
} ServeFields;

static void free_serve_fields(ServeFields *f) {
    free(f->line.prompt);
    free(f->line.ids);
    for (int i = 0; i < f->n_prompts; i++) { free(f->prompts[i].text); free(f->prompts[i].ids); }
    free_schema(f->line.schema);
    for (int k = 0; k < f->line.o.controls.n_stops; k++) free(f->line.stops[k]);
    for (int i = 0; i < f->n_messages; i++) {
        free(f->roles[i]);
        free(f->contents[i]);
        if (f->calls) { free(f->calls[i]); free(f->call_ids[i]); }
    }
    free(f->roles);
    free(f->contents);
    free(f->calls);
    free(f->call_ids);
    free_tools(&f->tools);
    free(f->call.name);
    free(f->call.arguments);
    buf_free(&f->calls_text);
    free(f->name);
    free(f->text);
    free(f->member);
    memset(f, 0, sizeof(*f));
}

/* Skips any JSON value (objects and arrays included, to `depth` levels). */
static void json_skip(JsonCursor *j, int depth) {
    if (depth > 32) json_fail(j, "nested too deeply");
    json_space(j);
    if (j->p < j->end && (*j->p == '{' || *j->p == '[')) {
        char close = *j->p == '{' ? '}' : ']';
        int object = close == '}';
        j->p++;
        json_space(j);
        for (int first = 1; json_next_item(j, close, &first, object ? "expected ',' or '}'" : "expected ',' or ']'");) {
            if (object) {
                if (j->p >= j->end || *j->p != '"') json_fail(j, "expected a field name in quotes");
                j->p++;
                free(json_string(j, "field name"));
                json_space(j);
                if (j->p >= j->end || *j->p != ':') json_fail(j, "expected ':'");
                j->p++;
            }
            json_skip(j, depth + 1);
            json_space(j);
        }
        j->p++;
        return;
    }
    char *text;
    json_value(j, "value", &text);
    free(text);
}

/* Calls field(j, f, name) for each field of the object at the cursor; the
   callback reads the value. */
static void json_object(JsonCursor *j, ServeFields *f, void (*field)(JsonCursor *, ServeFields *, char *)) {
    json_space(j);
    if (j->p >= j->end || *j->p != '{') json_fail(j, "expected a JSON object");
    j->p++;
    json_space(j);
    for (int first = 1; json_next_item(j, '}', &first, "expected ',' or '}' after a field");) {
        if (j->p >= j->end || *j->p != '"') json_fail(j, "expected a field name in quotes");
        j->p++;
        char *name = json_string(j, "field name");
        json_space(j);
        if (j->p >= j->end || *j->p != ':') { free(name); json_fail(j, "expected ':' after a field name"); }
        j->p++;
        json_space(j);
        field(j, f, name);
        json_space(j);
    }
    j->p++;
}

/* -- 11.1's fields: "tools", "tool_choice", and the messages' calls -- */

static const char *tojson_string(ByteBuf *b, const char *p, const char *end);

/* Appends the JSON text [p, end) (valid: json_skip has read it) as the
   templates' `tojson` writes it (@huggingface/jinja's, JavaScript's
   JSON.stringify with ", " and ": " between items): no other white space,
   strings escaped only where JSON needs it; numbers as spelled. */
static void buf_tojson(ByteBuf *b, const char *p, const char *end) {
    while (p < end) {
        char ch = *p++;
        if (ch == '"') p = tojson_string(b, p, end);
        else if (ch == ',' || ch == ':') buf_str(b, ch == ',' ? ", " : ": ");
        else if (!isspace((unsigned char)ch)) buf_add(b, &ch, 1);
    }
}

/* A string's rest from p (after its opening quote), as buf_tojson writes
   it; returns the position after its closing quote. */
static const char *tojson_string(ByteBuf *b, const char *p, const char *end) {
    buf_str(b, "\"");
    while (p < end && *p != '"') {
        if (*p != '\\' || (p[1] != 'u' && p[1] != '/')) { /* a character, or an escape JSON.stringify writes too */
            int n = *p == '\\' ? 2 : 1;
            buf_add(b, p, (size_t)n);
            p += n;
            continue;
        }
        if (p[1] == '/') { buf_str(b, "/"); p += 2; continue; }
        long cp = json_hex4(p + 2, end);
        p += 6;
        if (cp >= 0xD800 && cp < 0xDC00 && end - p >= 6 && p[0] == '\\' && p[1] == 'u') {
            long low = json_hex4(p + 2, end);
            if (low >= 0xDC00 && low < 0xE000) { cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00); p += 6; }
        }
        const char *named = cp == '"' ? "\\\"" : cp == '\\' ? "\\\\" : cp == '\b' ? "\\b" : cp == '\f' ? "\\f" : cp == '\n' ? "\\n"
                          : cp == '\r' ? "\\r" : cp == '\t' ? "\\t" : NULL;
        char utf8[4];
        if (named) buf_str(b, named);
        else if (cp < 0x20 || (cp >= 0xD800 && cp < 0xE000)) buf_printf(b, "\\u%04lx", cp);
        else buf_add(b, utf8, (size_t)encode_utf8((int)cp, utf8));
    }
    buf_str(b, "\"");
    return p + 1;
}

/* The JSON value at the cursor, as given (read past). */
static char *json_raw_value(JsonCursor *j) {
    const char *start = j->p;
    json_skip(j, 0);
    char *text = xcalloc((size_t)(j->p - start) + 1, 1);
    memcpy(text, start, (size_t)(j->p - start));
    return text;
}

/* A tool's "function": its "name" and "parameters" (an object). */
static void tool_function_field(JsonCursor *j, ServeFields *f, char *name) {
    Tool *t = &f->tools.tools[f->tools.n - 1];
    int is_name = strcmp(name, "name") == 0, is_parameters = strcmp(name, "parameters") == 0;
    free(name);
    if (is_name) {
        if (json_value(j, "name", &f->text) != JSON_STRING || f->text[0] == '\0')
            json_fail(j, "field 'tools[%d].function.name': must be a string, not empty", f->tools.n - 1);
        free(t->name);
        t->name = f->text;
        f->text = NULL;
    } else if (is_parameters) {
        if (j->p >= j->end || *j->p != '{') json_fail(j, "field 'tools[%d].function.parameters': must be an object (a JSON schema)", f->tools.n - 1);
        free(t->parameters);
        t->parameters = json_raw_value(j);
    } else {
        json_skip(j, 1);
    }
}

/* A tool: {"type": "function", "function": {...}}. */
static void tool_field(JsonCursor *j, ServeFields *f, char *name) {
    int is_function = strcmp(name, "function") == 0, is_type = strcmp(name, "type") == 0;
    free(name);
    if (is_function) {
        json_object(j, f, tool_function_field);
    } else if (is_type) {
        if (json_value(j, "type", &f->text) != JSON_STRING || strcmp(f->text, "function") != 0)
            json_fail(j, "field 'tools[%d].type': must be \"function\"", f->tools.n - 1);
        free(f->text);
        f->text = NULL;
    } else {
        json_skip(j, 1);
    }
}

/* "tools": a list of functions, each with a name unlike the others'. */
static void parse_tools(JsonCursor *j, ServeFields *f) {
    ToolSet *ts = &f->tools;
    if (j->p >= j->end || *j->p != '[') json_fail(j, "field 'tools': must be a list of tools");
    j->p++;
    json_space(j);
    for (int first = 1; json_next_item(j, ']', &first, "field 'tools': expected ',' or ']'");) {
        if (ts->n == SERVE_MAX_TOOLS) json_fail(j, "field 'tools': %d tools at most", SERVE_MAX_TOOLS);
        Tool *t = &ts->tools[ts->n++];
        const char *start = j->p;
        json_object(j, f, tool_field);
        if (!t->name) json_fail(j, "field 'tools[%d].function.name': missing (every tool needs a name)", ts->n - 1);
        for (int k = 0; k < ts->n - 1; k++)
            if (strcmp(ts->tools[k].name, t->name) == 0) json_fail(j, "field 'tools[%d].function.name': '%s' is given twice", ts->n - 1, t->name);
        ByteBuf b = {0};
        buf_tojson(&b, start, j->p);
        t->json = b.data;
        json_space(j);
    }
    j->p++;
}

/* tool_choice's {"type": "function", "function": {"name": ...}}. */
static void choice_function_field(JsonCursor *j, ServeFields *f, char *name) {
    int is_name = strcmp(name, "name") == 0;
    free(name);
    if (!is_name) { json_skip(j, 1); return; }
    if (json_value(j, "name", &f->text) != JSON_STRING) json_fail(j, "field 'tool_choice': the function's name must be a string");
    free(f->tools.named);
    f->tools.named = f->text;
    f->text = NULL;
}

static void choice_field_of_tool(JsonCursor *j, ServeFields *f, char *name) {
    int is_function = strcmp(name, "function") == 0;
    free(name);
    if (is_function) json_object(j, f, choice_function_field);
    else json_skip(j, 1);
}

/* "tool_choice": "auto", "none", "required" or a function by name. */
static void parse_tool_choice(JsonCursor *j, ServeFields *f) {
    static const char *const choices[] = {"auto", "none", "required"};
    if (j->p < j->end && *j->p == '{') {
        json_object(j, f, choice_field_of_tool);
        if (!f->tools.named) json_fail(j, "field 'tool_choice': an object needs 'function': {'name': ...}");
        f->tools.choice = TOOLS_NAMED;
        return;
    }
    if (json_value(j, "tool_choice", &f->text) == JSON_STRING)
        for (int k = 0; k < 3; k++)
            if (strcmp(f->text, choices[k]) == 0) { f->tools.choice = k; return; }
    json_fail(j, "field 'tool_choice': must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}");
}

/* A call of an assistant message's "tool_calls": its function's "name" and
   "arguments" (a JSON text in a string, as OpenAI sends it, or a value). */
static void call_function_field(JsonCursor *j, ServeFields *f, char *name) {
    int is_name = strcmp(name, "name") == 0, is_arguments = strcmp(name, "arguments") == 0;
    free(name);
    if (is_name) {
        if (json_value(j, "name", &f->text) != JSON_STRING) json_fail(j, "field 'messages[%d].tool_calls': a function's name must be a string", f->n_messages - 1);
        free(f->call.name);
        f->call.name = f->text;
        f->text = NULL;
    } else if (is_arguments) {
        free(f->call.arguments);
        if (j->p < j->end && *j->p == '"') {
            json_value(j, "arguments", &f->call.arguments);
        } else {
            ByteBuf b = {0};
            const char *start = j->p;
            json_skip(j, 0);
            buf_tojson(&b, start, j->p);
            f->call.arguments = b.data;
        }
    } else {
        json_skip(j, 1);
    }
}

static void call_field(JsonCursor *j, ServeFields *f, char *name) {
    int is_function = strcmp(name, "function") == 0;
    free(name);
    if (is_function) json_object(j, f, call_function_field);
    else json_skip(j, 1);
}

/* A message's "tool_calls", rendered as the template renders them: one
   <tool_call> block each, a newline between two. */
static void parse_message_calls(JsonCursor *j, ServeFields *f) {
    int i = f->n_messages - 1, k = 0;
    if (j->p >= j->end || *j->p != '[') json_fail(j, "field 'messages[%d].tool_calls': must be a list of calls", i);
    ByteBuf *b = &f->calls_text;
    buf_free(b);
    j->p++;
    json_space(j);
    for (int first = 1; json_next_item(j, ']', &first, "field 'tool_calls': expected ',' or ']'"); k++) {
        json_object(j, f, call_field);
        if (!f->call.name) json_fail(j, "field 'messages[%d].tool_calls[%d].function.name': missing", i, k);
        buf_printf(b, "%s<tool_call>\n{\"name\": \"%s\", \"arguments\": %s}\n</tool_call>", k ? "\n" : "", f->call.name,
                   f->call.arguments ? f->call.arguments : "{}");
        free(f->call.name);
        free(f->call.arguments);
        f->call = (ToolCall){NULL, NULL};
        json_space(j);
    }
    j->p++;
    free(f->calls[i]);
    f->calls[i] = b->data;
    *b = (ByteBuf){NULL, 0, 0};
}

/* The system message's part that gives the tools: Qwen's template's text
   for ChatML; for the other families, the generic fallback, a short one
   (llama2.c's models have 512 positions): each tool's name and description
   and the form of a call, whose arguments the constraint then holds to the
   schema. */
static void buf_tools_system(ByteBuf *b, const ToolSet *ts, const Tokenizer *tok) {
    if (tok->chat_template != CHAT_CHATML) {
        buf_str(b, "Tools:");
        for (int i = 0; i < ts->n; i++) buf_printf(b, "\n- %s", ts->tools[i].name);
        buf_str(b, "\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call>");
        return;
    }
    buf_str(b, "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>");
    for (int i = 0; i < ts->n; i++) {
        buf_str(b, "\n");
        buf_str(b, ts->tools[i].json);
    }
    buf_str(b, "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
}

/* Appends JSON text that buf_tojson wrote as `tojson(indent=4)` writes it
   (JSON.stringify with 4 spaces): each item of a non-empty list or object
   on a line of its own, indented by its depth; empty ones as [] and {}. */
static void buf_tojson_indent(ByteBuf *b, const char *p) {
    int depth = 0;
    for (; *p; p++) {
        if (*p == '"') {
            const char *q = p + 1;
            while (*q != '"') q += *q == '\\' ? 2 : 1;
            buf_add(b, p, (size_t)(q + 1 - p));
            p = q;
        } else if ((*p == '{' || *p == '[') && p[1] != (*p == '{' ? '}' : ']')) {
            buf_printf(b, "%c\n%*s", *p, 4 * ++depth, "");
        } else if (*p == '{' || *p == '[') {
            buf_add(b, p++, 2);
        } else if (*p == '}' || *p == ']') {
            buf_printf(b, "\n%*s%c", 4 * --depth, "", *p);
        } else if (*p == ',') {
            buf_printf(b, ",\n%*s", 4 * depth, "");
            p++; /* the space after it */
        } else {
            buf_add(b, p, 1);
        }
    }
}

/* tool_messages for Llama 3.1's format (see 11.1): the messages as its
   template writes them, for llama31_prompt_tokens to render verbatim. The
   first message that is not the system's must be the user's. */
static void tool_messages_llama31(ServeFields *f) {
    int n = 0, i = 0;
    char **roles = xcalloc((size_t)f->n_messages + 2, sizeof(char *)), **contents = xcalloc((size_t)f->n_messages + 2, sizeof(char *));
    ByteBuf b = {0};
    char *system = i < f->n_messages && strcmp(f->roles[i], "system") == 0 ? trimmed(f->contents[i++] ? f->contents[i - 1] : "") : strdup("");
    buf_printf(&b, "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n%s", system);
    free(system);
    roles[n] = strdup("system");
    contents[n++] = b.data;
    if (i >= f->n_messages || strcmp(f->roles[i], "user") != 0)
        json_fail(&(JsonCursor){NULL, NULL, NULL}, "field 'messages': with 'tools', Llama 3.1's template needs a user message first (it gives the tools)");
    b = (ByteBuf){0};
    buf_str(&b, "Given the following functions, please respond with a JSON for a function call with its proper arguments "
                "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}.Do not use variables.\n\n");
    for (int k = 0; k < f->tools.n; k++) {
        buf_tojson_indent(&b, f->tools.tools[k].json);
        buf_str(&b, "\n\n");
    }
    char *first = trimmed(f->contents[i] ? f->contents[i] : "");
    buf_str(&b, first);
    free(first);
    roles[n] = strdup("user");
    contents[n++] = b.data;
    for (i++; i < f->n_messages; i++) {
        b = (ByteBuf){0};
        if (strcmp(f->roles[i], "tool") == 0 || strcmp(f->roles[i], "ipython") == 0) {
            buf_json(&b, f->contents[i] ? f->contents[i] : ""); /* a string is iterable: `tojson` writes it */
            roles[n] = strdup("ipython");
        } else if (f->calls[i]) {
            /* the first call, from parse_message_calls's block: <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call> */
            const char *name = strstr(f->calls[i], "{\"name\": \"") + 10, *args = strstr(name, "\", \"arguments\": ");
            const char *args_end = strstr(args, "}\n</tool_call>");
            buf_printf(&b, "{\"name\": \"%.*s\", \"parameters\": ", (int)(args - name), name);
            args += strlen("\", \"arguments\": ");
            if (*args == '"') { /* OpenAI's arguments: a JSON text in a string, which the template takes as the object it holds */
                JsonCursor j = {args, args_end, NULL};
                char *text = json_string(&j, "arguments");
                buf_tojson(&b, text, text + strlen(text));
                free(text);
            } else {
                buf_add(&b, args, (size_t)(args_end - args));
            }
            buf_str(&b, "}");
            roles[n] = strdup(f->roles[i]);
        } else {
            b.data = trimmed(f->contents[i] ? f->contents[i] : "");
            roles[n] = strdup(f->roles[i]);
        }
        contents[n++] = b.data;
    }
    for (i = 0; i < f->n_messages; i++) { free(f->roles[i]); free(f->contents[i]); free(f->calls[i]); free(f->call_ids[i]); }
    free(f->roles); free(f->contents); free(f->calls); free(f->call_ids);
    f->calls = f->call_ids = NULL;
    f->roles = roles;
    f->contents = contents;
    f->n_messages = n;
}

/* Rewrites the messages into the plain conversation that the family's
   renderer takes (see 11.1): the tools into the system message (one is
   made when there is none), an assistant message's calls after its
   content (a newline between), and each run of "tool" messages into one
   user message of <tool_response> blocks. */
static void tool_messages(ServeFields *f, const Tokenizer *tok) {
    f->tools.llama31 = tok->chat_template == CHAT_LLAMA3 && tok->llama31_tools;
    if (f->tools.llama31 && f->tools.n > 0) { tool_messages_llama31(f); return; }
    int n = 0, i = 0;
    char **roles = xcalloc((size_t)f->n_messages + 1, sizeof(char *)), **contents = xcalloc((size_t)f->n_messages + 1, sizeof(char *));
    if (f->tools.n > 0) {
        ByteBuf b = {0};
        if (strcmp(f->roles[0], "system") == 0) {
            buf_printf(&b, "%s\n\n", f->contents[0]);
            free(f->roles[0]);
            free(f->contents[0]);
            f->roles[0] = NULL;
            i = 1;
        }
        buf_tools_system(&b, &f->tools, tok);
        roles[n] = strdup("system");
        contents[n++] = b.data;
    }
    for (; i < f->n_messages; i++) {
        char *role = f->roles[i], *content = f->contents[i] ? f->contents[i] : strdup("");
        ByteBuf b = {0};
        if (strcmp(role, "tool") == 0) {
            if (i > 0 && f->roles[i - 1] && strcmp(f->roles[i - 1], "tool") == 0) { /* (a tool's role is kept until the end) */
                buf_printf(&b, "%s\n", contents[--n]);
                free(contents[n]);
                free(roles[n]);
            }
            buf_printf(&b, "<tool_response>\n%s\n</tool_response>", content);
            free(content);
            roles[n] = strdup("user");
            contents[n++] = b.data;
        } else if (f->calls[i]) {
            buf_printf(&b, "%s%s%s", content, content[0] ? "\n" : "", f->calls[i]);
            free(content);
            roles[n] = role;
            contents[n++] = b.data;
            f->roles[i] = NULL;
        } else {
            roles[n] = role;
            contents[n++] = content;
            f->roles[i] = NULL;
        }
    }
    for (i = 0; i < f->n_messages; i++) { free(f->roles[i]); free(f->calls[i]); free(f->call_ids[i]); }
    free(f->roles); free(f->contents); free(f->calls); free(f->call_ids);
    f->calls = f->call_ids = NULL;
    f->roles = roles;
    f->contents = contents;
    f->n_messages = n;
}

/* One field of a message: "role", "content" and "tool_call_id" (strings;
   content may be null), "tool_calls" (11.1); others ignored. */
static void message_field(JsonCursor *j, ServeFields *f, char *name) {
    f->member = name;
    int i = f->n_messages - 1;
    if (strcmp(name, "tool_calls") == 0) {
        parse_message_calls(j, f);
    } else if (strcmp(name, "role") == 0 || strcmp(name, "content") == 0 || strcmp(name, "tool_call_id") == 0) {
        JsonKind kind = json_value(j, name, &f->text);
        if (kind == JSON_NULL && name[0] == 'c') {
        } else if (kind != JSON_STRING) json_fail(j, "field 'messages[%d].%s': must be a string", i, name);
        char **slot = name[0] == 'r' ? &f->roles[i] : name[0] == 'c' ? &f->contents[i] : &f->call_ids[i];
        free(*slot);
        *slot = kind == JSON_NULL ? NULL : f->text;
        if (kind == JSON_NULL) free(f->text);
        f->text = NULL;
    } else {
        json_skip(j, 1);
    }
    free(f->member);
    f->member = NULL;
}

/* "messages": a list of {"role", "content"} objects. */
static void parse_messages(JsonCursor *j, ServeFields *f) {
    if (j->p >= j->end || *j->p != '[') json_fail(j, "field 'messages': must be a list of objects");
    f->messages_given = 1;
    j->p++;
    json_space(j);
    for (int first = 1; json_next_item(j, ']', &first, "field 'messages': expected ',' or ']'");) {
        char ***lists[4] = {&f->roles, &f->contents, &f->calls, &f->call_ids};
        for (int k = 0; k < 4; k++) {
            *lists[k] = realloc(*lists[k], (size_t)(f->n_messages + 1) * sizeof(char *));
            if (!*lists[k]) die(EXIT_BAD_FILE, "out of memory");
            (*lists[k])[f->n_messages] = NULL;
        }
        f->n_messages++;
        json_object(j, f, message_field);
        int i = f->n_messages - 1;
        if (!f->roles[i] || (!f->contents[i] && !f->calls[i]))
            json_fail(j, "field 'messages': each needs a 'role' and a 'content' string (or, the assistant's, 'tool_calls')");
        if (strcmp(f->roles[i], "tool") == 0 && !f->call_ids[i])
            json_fail(j, "field 'messages[%d].tool_call_id': missing (a 'tool' message answers the call of that id)", i);
        json_space(j);
    }
    j->p++;
}

/* Fields of the OpenAI API that change the result in ways run does not do:
   refused unless they hold their harmless value (null, false, 0, 1, {}). */
static const char *const refused_fields[] = {"best_of", "echo", "top_logprobs", "suffix", "presence_penalty",
                                             "frequency_penalty", "logit_bias", "tools", "tool_choice", "functions",
                                             "function_call", "parallel_tool_calls"};

/* Whether the value at the cursor is harmless for a refused field. */
static int harmless_value(JsonCursor *j, ServeFields *f) {
    const char *start = j->p;
    json_skip(j, 0);
    size_t n = (size_t)(j->p - start);
    char *v = xcalloc(n + 1, 1), *o = v;
    for (size_t i = 0; i < n; i++)
        if (!isspace((unsigned char)start[i])) *o++ = start[i];
    f->text = v;
    return strcmp(v, "null") == 0 || strcmp(v, "false") == 0 || strcmp(v, "0") == 0 || strcmp(v, "1") == 0 ||
           strcmp(v, "{}") == 0 || strcmp(v, "0.0") == 0 || strcmp(v, "1.0") == 0 || strcmp(v, "[]") == 0;
}

/* The fields of choices and log-probabilities (see "Choices and their
   log-probabilities" below): n in both endpoints; completions' logprobs
   (0..20 alternatives) and echo; chat's logprobs (true or false) and
   top_logprobs. Reads the value of field `name` when it is one of them and
   returns 1; 0 for any other (chat's echo and completions' top_logprobs go
   on to be refused). null stands for an absent field. */
static int choice_field(JsonCursor *j, ServeFields *f, const char *name) {
    int bool_field = (f->chat && strcmp(name, "logprobs") == 0) || (!f->chat && strcmp(name, "echo") == 0);
    int int_field = strcmp(name, "n") == 0 || (!f->chat && strcmp(name, "logprobs") == 0) ||
                    (f->chat && strcmp(name, "top_logprobs") == 0);
    if (!bool_field && !int_field) return 0;
    JsonKind kind = json_value(j, name, &f->text);
    if (kind == JSON_NULL) return 1;
    if (bool_field && kind != JSON_TRUE && kind != JSON_FALSE) json_fail(j, "field '%s': must be true or false", name);
    if (name[0] == 'n') f->n = (int)integer_field(j, name, kind, f->text, 1, SERVE_MAX_N);
    else if (name[0] == 'e') f->echo = kind == JSON_TRUE;
    else if (f->chat && name[0] == 'l') f->logprobs = kind == JSON_TRUE;
    else f->top_logprobs = (int)integer_field(j, name, kind, f->text, 0, MAX_TOP_LOGPROBS);
    if (!f->chat && name[0] == 'l') f->logprobs = 1;
    return 1;
}

/* Forgets the prompt or prompts read so far (a field given twice: the last counts). */
static void forget_prompts(ServeFields *f) {
    free(f->line.prompt);
    f->line.prompt = NULL;
    free(f->line.ids);
    f->line.ids = NULL;
    for (int i = 0; i < f->n_prompts; i++) { free(f->prompts[i].text); free(f->prompts[i].ids); }
    f->n_prompts = 0;
}

/* Completions' "prompt" as a list: one prompt's token ids, or a list of
   prompts (OpenAI's batch of prompts), each a string or a list of token
   ids; each prompt gets its n choices. */
static void parse_prompt_list(JsonCursor *j, ServeFields *f, const char *field) {
    forget_prompts(f);
    const char *q = j->p + 1;
    while (q < j->end && (*q == ' ' || *q == '\t' || *q == '\n' || *q == '\r')) q++;
    if (q >= j->end || (*q != '"' && *q != '[')) { /* token ids (or an empty list, refused there) */
        parse_token_ids(j, &f->line, field, f->vocab, &f->text);
        return;
    }
    j->p++; /* [ */
    json_space(j);
    for (int first = 1; json_next_item(j, ']', &first, "field 'prompt': expected ',' or ']' in the list of prompts");) {
        if (f->n_prompts == SERVE_MAX_N) json_fail(j, "field '%s': %d prompts at most a request", field, SERVE_MAX_N);
        PromptItem *item = &f->prompts[f->n_prompts];
        if (j->p < j->end && *j->p == '[') {
            parse_token_ids(j, &f->line, field, f->vocab, &f->text);
            item->ids = f->line.ids;
            item->n_ids = f->line.n_ids;
            f->line.ids = NULL;
        } else if (json_value(j, field, &f->text) == JSON_STRING) {
            item->text = f->text;
            f->text = NULL;
        } else {
            json_fail(j, "field '%s': each prompt of the list must be a string or a list of token ids", field);
        }
        f->n_prompts++;
        json_space(j);
    }
    j->p++; /* ] */
}

/* One field of the request body. The fields that --batch has go through
   its apply_field; null stands for an absent field; unknown ones are
   ignored. */
static void request_field(JsonCursor *j, ServeFields *f, char *name) {
    static const char *const batch_fields[] = {"temperature", "top_p", "seed", "min_new_tokens", "top_k", "min_p",
                                               "repetition_penalty", "no_repeat_ngram_size", "length_penalty"};
    f->name = name;
    int given = !(j->end - j->p >= 4 && memcmp(j->p, "null", 4) == 0); /* (null stands for an absent field) */
    if (strcmp(name, "messages") == 0 && f->chat) {
        parse_messages(j, f);
    } else if (strcmp(name, "tools") == 0 && f->chat && given) {
        parse_tools(j, f);
    } else if (strcmp(name, "tool_choice") == 0 && f->chat && given) {
        parse_tool_choice(j, f);
    } else if (strcmp(name, "parallel_tool_calls") == 0 && f->chat && given) {
        JsonKind kind = json_value(j, name, &f->text);
        if (kind != JSON_TRUE && kind != JSON_FALSE) json_fail(j, "field 'parallel_tool_calls': must be true or false");
        f->tools.parallel = kind == JSON_TRUE;
    } else if (strcmp(name, "stop") == 0 && j->p < j->end && *j->p == '[') {
        parse_stop_list(j, &f->line, &f->text);
    } else if (choice_field(j, f, name)) {
    } else if (strcmp(name, "response_format") == 0 && !(j->end - j->p >= 4 && memcmp(j->p, "null", 4) == 0)) {
        apply_response_format(j, &f->line); /* (null stands for an absent field, below) */
    } else {
        int refused = 0, known = 0;
        for (size_t i = 0; i < sizeof(refused_fields) / sizeof(refused_fields[0]); i++)
            if (strcmp(name, refused_fields[i]) == 0) refused = 1;
        if (refused) {
            if (!harmless_value(j, f)) json_fail(j, "field '%s' is not supported (only its default value)", name);
        } else {
            int compound = j->p < j->end && (*j->p == '{' || *j->p == '[');
            JsonKind kind = compound ? JSON_COMPOUND : JSON_NULL;
            if (compound && strcmp(name, "prompt") == 0 && !f->chat) {
                if (*j->p != '[') json_fail(j, "field 'prompt': must be a string, a list of token ids or a list of prompts");
                parse_prompt_list(j, f, name);
                kind = JSON_NULL; /* read */
            } else if (compound) {
                json_skip(j, 0);
            } else {
                kind = json_value(j, name, &f->text);
            }
            for (size_t i = 0; i < sizeof(batch_fields) / sizeof(batch_fields[0]); i++)
                if (strcmp(name, batch_fields[i]) == 0) known = 1;
            if (kind == JSON_NULL) {
            } else if ((strcmp(name, "prompt") == 0 && !f->chat) || strcmp(name, "stop") == 0 || known) {
                if (kind == JSON_COMPOUND) json_fail(j, "field '%s': wrong type", name);
                if (strcmp(name, "prompt") == 0) forget_prompts(f); /* a repeated field: the last one counts */
                apply_field(j, &f->line, name, kind, f->text, f->vocab);
            } else if (strcmp(name, "max_tokens") == 0 || strcmp(name, "max_completion_tokens") == 0) {
                f->max_tokens = (int)integer_field(j, name, kind, f->text, 0, INT_MAX);
            } else if (strcmp(name, "num_beams") == 0) {
                f->line.o.beams = (int)integer_field(j, name, kind, f->text, 1, INT_MAX);
            } else if (strcmp(name, "stream") == 0) {
                if (kind != JSON_TRUE && kind != JSON_FALSE) json_fail(j, "field 'stream': must be true or false");
                f->stream = kind == JSON_TRUE;
            }
        }
    }
    free(f->name);
    free(f->text);
    f->name = f->text = NULL;
}

/* A tool_choice that names a function needs one of that name, and
   "required" needs tools (a server's request, a batch line's: 11.2). */
static void check_tool_choice(const JsonCursor *j, const ToolSet *ts) {
    if (ts->choice == TOOLS_NAMED) {
        int found = 0;
        for (int i = 0; i < ts->n; i++) found |= strcmp(ts->tools[i].name, ts->named) == 0;
        if (!found) json_fail(j, "field 'tool_choice': no tool named '%s' in 'tools'", ts->named);
    }
    if (ts->n == 0 && ts->choice == TOOLS_REQUIRED) json_fail(j, "field 'tool_choice': \"required\" needs 'tools'");
}

/* Reads a request body (n bytes) into f (whose line.o holds the defaults);
   a bad one fails through json_fail. */
static void parse_request_body(ServeFields *f, const char *body, size_t n) {
    JsonCursor j = {body, body + n, NULL}; /* not logged here: the answer's 400 is, once */
    json_object(&j, f, request_field);
    json_space(&j);
    if (j.p < j.end) json_fail(&j, "text after the object");
    if (f->chat && f->n_messages == 0)
        json_fail(&j, f->messages_given ? "field 'messages': the list is empty; it needs a user message at least"
                                        : "missing field 'messages'");
    if (!f->chat && !f->line.prompt && !f->line.ids && f->n_prompts == 0) json_fail(&j, "missing field 'prompt'");
    check_tool_choice(&j, &f->tools);
}

/* The tokens of a whole conversation in the tokenizer's chat template, as
   chat() feeds them: an optional first "system" message, then user turns
   (rendered as chat_turn_tokens renders them, the system prompt in the first
   one), each earlier reply followed by its end token; the last message is
   the user's, and the assistant's reply follows. NULL (and *why set) for a
   list that is not such a conversation or needs more than `room` positions. */
static int *chat_messages_tokens(const Tokenizer *tok, char **roles, char **contents, int n, int room, int *n_tokens,
                                 const char **why) {
    int i = 0, count = 0;
    const char *system_prompt = NULL;
    if (n > 0 && strcmp(roles[0], "system") == 0) system_prompt = contents[i++];
    *why = "the last message must be the user's";
    if (n == i || strcmp(roles[n - 1], "user") != 0) return NULL;
    int *out = xcalloc((size_t)room + 1, sizeof(int));
    /* earlier turns as the template renders them: Qwen3's without
       --reasoning off's empty think block, which only opens the reply asked
       for; SmolLM3's with it, in the mode its system prompt's flags set */
    const Tokenizer current = smollm3_tokenizer(tok, system_prompt);
    Tokenizer earlier = current;
    if (tok->chat_template != CHAT_SMOLLM3) earlier.reasoning = REASONING_SHOW;
    for (int first = 1; i < n; i++) {
        if (strcmp(roles[i], "user") == 0) {
            int nt = 0;
            int *turn = chat_turn_tokens(i == n - 1 ? &current : &earlier, first ? system_prompt : NULL, contents[i], first, room - count, &nt);
            first = 0;
            if (!turn) break;
            memcpy(out + count, turn, (size_t)nt * sizeof(int));
            count += nt;
            free(turn);
        } else if (strcmp(roles[i], "assistant") == 0 && i > 0 && strcmp(roles[i - 1], "user") == 0) {
            /* Harmony: an earlier reply is its final channel's message (its reasoning is not kept) */
            if (tok->chat_template == CHAT_HARMONY) {
                if (count + 1 > room) break;
                out[count++] = template_token(tok, "<|channel|>");
                if (!append_text_tokens(tok, "final", out, &count, room) || count + 1 > room) break;
                out[count++] = template_token(tok, "<|message|>");
            }
            if (!append_text_tokens(tok, contents[i], out, &count, room) || count + 1 > room) break;
            out[count++] = turn_end_token(tok);
        } else {
            *why = "messages must be an optional system message, then user and assistant messages in turn";
            free(out);
            return NULL;
        }
    }
    if (i < n) {
        *why = "the messages do not fit the model's context";
        free(out);
        return NULL;
    }
    *n_tokens = count;
    return out;
}

/* ---- Connections ------------------------------------------------------------ */

/* ---- Holding a crowd ---------------------------------------------------------

   Connections: --max-conns slots, allocated at the start; the soft limit
   on open descriptors is raised for them (and --max-conns lowered to what
   the system grants, said on stderr). A new connection when every slot is
   taken pushes out the one idle the longest between requests, and gets 503
   when none is idle. The sockets are watched by a NetPoller (epoll on
   Linux), so a step of the engine costs a wait on the ready ones; the
   deadlines below are checked in a sweep over the slots every
   SERVE_SWEEP seconds, not at every step.
   Deadlines: a request's header must be whole within --header-timeout of
   its first byte (of the connection, for its first request), and its body
   within as long again; a connection idle between requests is closed after
   SERVE_IDLE_TIMEOUT; an answer that no byte of leaves for
   SERVE_SEND_TIMEOUT is dropped. A streamed answer whose client does not
   read it is dropped, and its request cancelled (its cache blocks freed),
   once SERVE_MAX_PENDING bytes of it wait, in the process or in the
   kernel's send queue (net_queued).
   Back-pressure: a completion that would make more than --parallel
   running plus --max-queue waiting gets 429 with Retry-After.
   Stopping (SIGTERM or SIGINT): no more connections are accepted, waiting
   requests get 503, running ones have --drain-seconds less SERVE_DRAIN_GRACE
   to end (then they end at their next token, as a second signal makes
   them), the answers the rest to leave, and --drain-seconds after the
   signal the process ends, whatever its connections do. */

#define SERVE_IDLE_TIMEOUT 5.0
#define SERVE_SEND_TIMEOUT 10.0
#define SERVE_MAX_PENDING (32 * 1024)
#define SERVE_SWEEP 0.1
#define SERVE_DRAIN_GRACE 1.0
#define SERVE_FD_RESERVE 16 /* descriptors kept beyond the connections: standard streams, the listener, the poller */

typedef enum { CONN_FREE, CONN_READING, CONN_RUNNING, CONN_WRITING } ConnPhase;

/* One client connection: the bytes received (at most HTTP_MAX_HEADER plus
   --max-body-kb; those of the request being answered are dropped once it is
   read, so what follows is the client's next request), the answer still to
   send, and its completion's requests (one per choice) while they run. A
   request's index is its connection's place times SERVE_MAX_N plus its
   choice. */
typedef struct {
    Socket s;
    ConnPhase phase;
    char *in;
    size_t n_in, cap_in;
    ByteBuf out;
    size_t sent;
    double last;          /* when it last moved bytes */
    double deadline;      /* reading a request: when its header (head set: its body) must be whole; 0: idle */
    double blocked;       /* since when its answer waits for the client to read; 0: not waiting */
    int head;             /* the request's header is whole, its body is awaited */
    int retry_after;      /* the next answer says Retry-After: this many seconds (0: not) */
    int gone;             /* the client went away: closed after the engine step */
    int continued;        /* "100 Continue" was sent */
    int may_keep;         /* the request allows the connection to persist (see conn_keeps) */
    int keep;             /* the answer's head said keep-alive: the next request is read once it is sent */
    int chunked;          /* the answer's body is in chunked transfer coding (a stream) */
    long long served;     /* answers sent in full on this connection */
    Request *req[SERVE_MAX_N]; /* (n_choices) each choice's request, kept until all are done */
    int n_choices, n_left;     /* choices, and those still running */
    int per_prompt;            /* choices of each prompt (n): choice i answers prompt i / per_prompt */
    char *echo[SERVE_MAX_N];   /* (n_choices) its prompt, put before each choice's text (echo); NULL: none */
    int chat, stream;
    unsigned char first_chunk[SERVE_MAX_N]; /* a choice's next chunk is its first */
    ByteBuf held[SERVE_MAX_N]; /* each choice's streamed text not yet sent: an incomplete UTF-8 character */
    ThinkSplit think[SERVE_MAX_N]; /* each choice's reasoning told from its answer (chat, a template that thinks) */
    int calls;                 /* how its replies make tool calls: CALLS_NONE, CALLS_AT_MARKER, CALLS_PREFILLED (11.1) */
    ByteBuf reply[SERVE_MAX_N]; /* with tools, streamed: each choice's text so far (a call is held back) */
    size_t told[SERVE_MAX_N];   /* bytes of it streamed as content */
    char *stops[MAX_STOPS]; /* the request's stop strings */
    char id[40];
    long long created;
    double started;
} Conn;

typedef struct {
    Engine *e;
    const Tokenizer *tok;
    const Options *o;
    uint64_t clock_seed;
    char model[256];         /* the checkpoint's file name */
    size_t max_body;
    int steps, beams;        /* positions per request and beams the engine was set up for */
    Conn *conns;             /* (max_conns) */
    int max_conns, n_open;
    int *free_slots, n_free; /* (max_conns) the unused conns */
    int *finished, n_finished; /* (max_conns * SERVE_MAX_N) conns whose requests (choices) ended in this engine step */
    NetPoller *poller;       /* the conns by index; the listener as max_conns */
    double now;              /* this turn of the loop */
    double header_timeout;
    int trimmed;             /* idle, and the memory its requests freed given back */
    int stopping;            /* SIGTERM: draining until drain_until */
    double drain_until;
    long long n_requests, n_failed, n_refused, n_dropped, next_id;
} Server;

static const char *status_text(int status) {
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 501: return "Not Implemented";
    default: return "Service Unavailable";
    }
}

/* Whether c, between requests, waits for the next one. */
static int conn_idle(const Conn *c) { return c->phase == CONN_READING && c->served > 0 && c->n_in == 0; }

/* Whether c's answer may keep the connection open: the request allows it
   and the server is not stopping. */
static int conn_keeps(const Server *srv, const Conn *c) { return c->may_keep && !srv->stopping; }

/* Queues a whole answer; the connection waits for the next request once it
   is sent, or closes (see conn_keeps). */
static void conn_answer(Server *srv, Conn *c, int status, const char *type, const char *body) {
    c->keep = conn_keeps(srv, c);
    buf_printf(&c->out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n", status, status_text(status), type,
               strlen(body));
    if (c->retry_after) buf_printf(&c->out, "Retry-After: %d\r\n", c->retry_after);
    c->retry_after = 0;
    buf_printf(&c->out, "Connection: %s\r\n\r\n", c->keep ? "keep-alive" : "close");
    buf_add(&c->out, body, strlen(body));
    c->phase = CONN_WRITING;
}

/* Queues n bytes of a streamed body, as one chunk when it is chunked. */
static void conn_body(Conn *c, const char *s, size_t n) {
    if (c->chunked) buf_printf(&c->out, "%zx\r\n", n);
    buf_add(&c->out, s, n);
    if (c->chunked) buf_str(&c->out, "\r\n");
}

/* Ends a streamed body: the last chunk, and the answer is complete. */
static void conn_end_stream(Conn *c) {
    if (c->chunked) buf_str(&c->out, "0\r\n\r\n");
    c->phase = CONN_WRITING;
}

/* An answer in the OpenAI API's error shape. */
static void conn_error(Server *srv, Conn *c, int status, const char *message) {
    const char *type = status == 401 ? "authentication_error" : status == 429 ? "rate_limit_error" :
                       status >= 500 ? "server_error" : "invalid_request_error";
    ByteBuf b = {0};
    buf_str(&b, "{\"error\":{\"message\":");
    buf_json(&b, message);
    buf_printf(&b, ",\"type\":\"%s\",\"code\":%d}}", type, status);
    conn_answer(srv, c, status, "application/json", b.data);
    buf_free(&b);
    srv->n_failed++;
    fprintf(stderr, "run: serve: %d %s\n", status, message);
}

static void conn_free_echo(Conn *c) {
    for (int i = 0; i < SERVE_MAX_N; i++) {
        free(c->echo[i]);
        c->echo[i] = NULL;
        buf_free(&c->reply[i]);
        c->told[i] = 0;
    }
}

/* The prompt tokens of c's completion: each prompt's once (OpenAI counts
   a prompt once whatever its n). */
static int conn_prompt_tokens(const Conn *c) {
    int n = 0;
    for (int i = 0; i < c->n_choices; i += c->per_prompt) n += c->req[i]->n_prompt;
    return n;
}

/* Drops c's requests, waiting, running or done, and what they held. */
static void conn_drop_requests(Engine *e, Conn *c) {
    for (int i = 0; i < c->n_choices; i++) {
        engine_cancel(e, c->req[i]);
        request_free(c->req[i]);
        c->req[i] = NULL;
    }
    c->n_choices = c->n_left = 0;
    conn_free_echo(c);
}

/* Whether one of c's requests is still waiting for its place. */
static int conn_waiting(const Conn *c) {
    for (int i = 0; i < c->n_choices; i++)
        if (c->req[i]->state == REQUEST_WAITING) return 1;
    return 0;
}

/* Closes c (its requests, if any, are cancelled: their cache blocks are
   freed) and gives its slot back. */
static void conn_close(Server *srv, Conn *c) {
    if (c->phase == CONN_FREE) return;
    int slot = (int)(c - srv->conns);
    if (c->n_choices > 0) {
        conn_drop_requests(srv->e, c);
        fprintf(stderr, "run: serve: %s cancelled (its connection closed)\n", c->id);
    }
    net_unwatch(srv->poller, c->s, slot);
    net_close(c->s);
    for (int k = 0; k < MAX_STOPS; k++) free(c->stops[k]);
    free(c->in);
    buf_free(&c->out);
    for (int i = 0; i < SERVE_MAX_N; i++) {
        buf_free(&c->held[i]);
        free(c->think[i].held.data);
    }
    memset(c, 0, sizeof(*c));
    c->s = NO_SOCKET;
    srv->free_slots[srv->n_free++] = slot;
    srv->n_open--;
}

/* Closes a connection the server gives up on, saying why. */
static void conn_drop(Server *srv, Conn *c, const char *why) {
    fprintf(stderr, "run: serve: a connection dropped: %s\n", why);
    srv->n_dropped++;
    conn_close(srv, c);
}

/* The most bytes a connection holds received. */
static size_t conn_limit(const Server *srv) { return HTTP_MAX_HEADER + srv->max_body; }

/* Tells the poller what c waits for: bytes to read (a full buffer is not
   read while its request runs) and room to write its answer. */
static void conn_watch(Server *srv, Conn *c) {
    int want = (c->phase == CONN_READING || c->n_in < conn_limit(srv) ? NET_READ : 0) | (c->sent < c->out.n ? NET_WRITE : 0);
    net_watch(srv->poller, c->s, (int)(c - srv->conns), want);
}

/* Sends what it can of the queued answer; an answer sent in full closes the
   connection, or, kept, readies it for the next request. A stream whose
   client lets more than SERVE_MAX_PENDING bytes wait, here or in the
   kernel's send queue, is dropped. */
static void conn_flush(Server *srv, Conn *c) {
    while (c->sent < c->out.n) {
        ptrdiff_t k = net_send(c->s, c->out.data + c->sent, c->out.n - c->sent);
        if (k == -2) break;
        if (k <= 0) { conn_close(srv, c); return; }
        c->sent += (size_t)k;
        c->last = srv->now;
        c->blocked = 0;
    }
    if (c->phase == CONN_RUNNING && c->out.n - c->sent + net_queued(c->s) > SERVE_MAX_PENDING) {
        conn_drop(srv, c, "its client does not read its stream");
        return;
    }
    if (c->sent < c->out.n) {
        if (!c->blocked) c->blocked = srv->now;
        if (c->sent > c->out.n / 2) { /* what was sent is let go of */
            memmove(c->out.data, c->out.data + c->sent, c->out.n - c->sent + 1);
            c->out.n -= c->sent;
            c->sent = 0;
        }
        return;
    }
    buf_free(&c->out);
    c->sent = 0;
    c->blocked = 0;
    if (c->phase != CONN_WRITING) return;
    if (!c->keep || srv->stopping) { conn_close(srv, c); return; }
    c->phase = CONN_READING;
    c->served++;
    c->last = srv->now;
    c->head = 0;
    c->deadline = c->n_in > 0 ? srv->now + srv->header_timeout : 0;
    c->continued = c->keep = c->chunked = c->may_keep = 0;
}

static void conn_parse(Server *srv, Conn *c);

/* Moves c on as far as it can without waiting: serves a whole request that
   has arrived, sends what it can, and, when an answer has gone in full,
   serves the next request already received (pipelined), one after another;
   then tells the poller what c waits for. */
static void conn_advance(Server *srv, Conn *c) {
    for (;;) {
        long long served = c->served;
        if (c->phase == CONN_READING && c->n_in > 0) conn_parse(srv, c);
        if (c->phase != CONN_FREE && (c->sent < c->out.n || c->phase == CONN_WRITING)) conn_flush(srv, c);
        if (c->phase == CONN_FREE) return;
        if (c->served == served || c->phase != CONN_READING || c->n_in == 0) break;
    }
    conn_watch(srv, c);
}

/* ---- Completions ------------------------------------------------------------ */

/* The opening of every completion object: id, object, created, model. */
static void completion_head(Server *srv, Conn *c, ByteBuf *b, const char *object) {
    buf_printf(b, "{\"id\":\"%s\",\"object\":\"%s\",\"created\":%lld,\"model\":", c->id, object, c->created);
    buf_json(b, srv->model);
}

/* One Server-Sent Event with choice `choice`'s text delta `text` (NULL: the
   last one, with the finish reason) in the delta's `field`: "content", or
   "reasoning_content" for a reply's reasoning. */
static void send_delta(Server *srv, Conn *c, int choice, const char *field, const char *text, const char *finish) {
    ByteBuf b = {0};
    buf_str(&b, "data: ");
    completion_head(srv, c, &b, c->chat ? "chat.completion.chunk" : "text_completion");
    buf_printf(&b, ",\"choices\":[{\"index\":%d,", choice);
    if (c->chat) {
        buf_str(&b, "\"delta\":{");
        if (c->first_chunk[choice]) buf_str(&b, "\"role\":\"assistant\"");
        if (text) {
            if (c->first_chunk[choice]) buf_str(&b, ",");
            buf_printf(&b, "\"%s\":", field);
            buf_json(&b, text);
        }
        buf_str(&b, "},");
    } else {
        buf_str(&b, "\"text\":");
        buf_json(&b, text ? text : "");
        buf_str(&b, ",");
    }
    c->first_chunk[choice] = 0;
    if (finish) buf_printf(&b, "\"finish_reason\":\"%s\"}]}\n\n", finish);
    else buf_str(&b, "\"finish_reason\":null}]}\n\n");
    conn_body(c, b.data, b.n);
    buf_free(&b);
}

static void send_chunk(Server *srv, Conn *c, int choice, const char *text, const char *finish) {
    send_delta(srv, c, choice, "content", text, finish);
}

/* ---- 11.1's answers: a reply's calls ----------------------------------------- */

/* How a reply makes its calls (Conn's calls): none; after the marker, from
   where the constraint holds; the whole reply, constrained; or, Llama
   3.1's "auto", a reply that starts with the call, constrained from its
   '{' (free when it starts otherwise). */
enum { CALLS_NONE, CALLS_AT_MARKER, CALLS_PREFILLED, CALLS_LEADING };

static int calls_mode(const ToolSet *ts) {
    if (ts->n == 0 || ts->choice == TOOLS_NONE) return CALLS_NONE;
    if (ts->choice == TOOLS_AUTO) return ts->llama31 ? CALLS_LEADING : CALLS_AT_MARKER;
    return CALLS_PREFILLED;
}

/* Where the calls' constraint starts in a reply (Decoding's constrain_after
   and constrain_leading), for calls made as `calls` says: after the
   marker, at a leading '{', or (NULL, NULL) from the start. */
static void constrain_calls(Decoding *d, int calls) {
    d->constrain_after = calls == CALLS_AT_MARKER ? TOOL_MARKER : NULL;
    d->constrain_leading = calls == CALLS_LEADING ? PYTHON_TAG : NULL;
}

/* The schema of the calls a reply may make (see 11.1); NULL with the
   refusal in err: a function's parameters that 6.1 does not take. */
static JsonSchema *tool_call_schema(const ToolSet *ts, char *err, size_t err_len) {
    ByteBuf b = {0};
    buf_str(&b, "{\"$defs\":{\"call\":{\"anyOf\":[");
    for (int i = 0, k = 0; i < ts->n; i++) {
        const Tool *t = &ts->tools[i];
        if (ts->choice == TOOLS_NAMED && strcmp(t->name, ts->named) != 0) continue;
        char why[256];
        JsonSchema *alone = t->parameters ? compile_schema(t->parameters, strlen(t->parameters), why, sizeof(why)) : NULL;
        if (t->parameters && !alone) {
            snprintf(err, err_len, "field 'tools[%d].function.parameters': %s", i, why);
            buf_free(&b);
            return NULL;
        }
        free_schema(alone);
        buf_str(&b, k++ ? "," : "");
        buf_str(&b, "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":");
        buf_json(&b, t->name);
        const char *key = ts->llama31 ? "parameters" : "arguments"; /* Llama 3.1's name for them */
        buf_printf(&b, "},\"%s\":%s},\"required\":[\"name\",\"%s\"],\"additionalProperties\":false}", key,
                   t->parameters ? t->parameters : "{\"type\":\"object\"}", key);
    }
    if (ts->parallel && !ts->llama31) /* (Llama 3.1's template takes one call a message) */
        buf_printf(&b, "]}},\"anyOf\":[{\"$ref\":\"#/$defs/call\"},{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/call\"},"
                       "\"minItems\":1,\"maxItems\":%d}]}", SERVE_MAX_CALLS);
    else
        buf_str(&b, "]}},\"$ref\":\"#/$defs/call\"}");
    JsonSchema *s = compile_schema(b.data, b.n, err, err_len);
    buf_free(&b);
    return s;
}

/* The end of the JSON value that starts at p, in text the constraint wrote
   (valid, without white space). */
static const char *json_value_end(const char *p) {
    int depth = 0;
    do {
        if (*p == '"') {
            for (p++; *p != '"'; p++)
                if (*p == '\\') p++;
        } else if (*p == '{' || *p == '[') {
            depth++;
        } else if (*p == '}' || *p == ']') {
            depth--;
        } else if (depth == 0) { /* a number or a literal */
            while (*p && !strchr(",}]", *p)) p++;
            return p;
        }
        p++;
    } while (depth > 0);
    return p;
}

static void free_calls(ToolCall *calls, int n) {
    for (int k = 0; k < n; k++) { free(calls[k].name); free(calls[k].arguments); }
}

/* A reply in Llama 3.1's "auto" mode (CALLS_LEADING) past its leading
   white space and <|python_tag|>: where its call would start. */
static const char *past_call_lead(const char *text) {
    while (isspace((unsigned char)*text)) text++;
    return strncmp(text, PYTHON_TAG, strlen(PYTHON_TAG)) == 0 ? text + strlen(PYTHON_TAG) : text;
}

/* Where such a reply starts its call; NULL when it does not start '{'. */
static const char *leading_call_start(const char *text) {
    const char *p = past_call_lead(text);
    return *p == '{' ? p : NULL;
}

/* The call that a reply in Llama 3.1's "auto" mode makes with its whole
   text: 1 with its name and its "parameters" (or "arguments") object's
   text in *c, 0 when the text is not one call object, name a string,
   parameters an object. The reply is written under the calls' constraint
   from its '{' on (Decoding's constrain_leading), so a whole one is a
   call that matches its function's parameters and one cut short is not
   a call; the text is read as any JSON (white space anywhere) all the same. */
static int leading_call(const char *text, ToolCall *c) {
    const char *p = leading_call_start(text);
    *c = (ToolCall){NULL, NULL};
    if (!p) return 0;
    JsonCursor j = {p + 1, p + strlen(p), NULL};
    jmp_buf trap, *outer = error_trap;
    error_trap = &trap;
    if (setjmp(trap)) { /* (json_fail: not a call) */
        error_trap = outer;
        free_calls(c, 1);
        *c = (ToolCall){NULL, NULL};
        return 0;
    }
    json_space(&j);
    for (int first = 1; json_next_item(&j, '}', &first, "expected ',' or '}'");) {
        if (j.p >= j.end || *j.p != '"') json_fail(&j, "expected a key");
        j.p++;
        char key[16] = "";
        char *name = json_string(&j, "key");
        snprintf(key, sizeof(key), "%s", name);
        free(name);
        json_space(&j);
        if (j.p >= j.end || *j.p++ != ':') json_fail(&j, "expected ':'");
        json_space(&j);
        const char *start = j.p;
        if (strcmp(key, "name") == 0 && !c->name && j.p < j.end && *j.p == '"') {
            j.p++;
            c->name = json_string(&j, "name");
        } else if ((strcmp(key, "parameters") == 0 || strcmp(key, "arguments") == 0) && !c->arguments && *start == '{') {
            json_skip(&j, 0);
            c->arguments = span_dup(start, (size_t)(j.p - start));
        } else {
            json_skip(&j, 0);
        }
        json_space(&j);
    }
    j.p++;
    json_space(&j);
    error_trap = outer;
    if (c->name && c->arguments && j.p >= j.end) return 1;
    free_calls(c, 1);
    *c = (ToolCall){NULL, NULL};
    return 0;
}

/* The calls of a reply's text, made as `mode` says: the JSON value after
   the marker (the whole reply, when the prompt ends with the marker), one
   call or a list. Returns their count, 0 when the reply made none whole
   (it is all content); *content_len: the length of the text before them. */
static int reply_calls(const char *text, const Hypothesis *h, int mode, ToolCall *calls, size_t *content_len) {
    if (mode == CALLS_LEADING) {
        int n = leading_call(text, &calls[0]);
        *content_len = n ? 0 : strlen(text);
        return n;
    }
    const char *at = mode == CALLS_AT_MARKER ? strstr(text, TOOL_MARKER) : text;
    *content_len = strlen(text);
    if (strcmp(h->stop, "json") != 0 || !at) return 0;
    *content_len = (size_t)(at - text);
    const char *p = at + (mode == CALLS_AT_MARKER ? strlen(TOOL_MARKER) : 0);
    int n = 0;
    for (p += *p == '['; *p == '{' && n < SERVE_MAX_CALLS; n++) {
        const char *end = json_value_end(p);
        ToolCall *c = &calls[n];
        *c = (ToolCall){NULL, NULL};
        for (const char *key = p + 1; *key == '"';) { /* "name":..., "arguments":... in either order */
            const char *value = json_value_end(key) + 1, *value_end = json_value_end(value);
            if (strncmp(key, "\"name\":", 7) == 0) {
                JsonCursor j = {value + 1, value_end, NULL};
                c->name = json_string(&j, "name");
            } else {
                c->arguments = span_dup(value, (size_t)(value_end - value));
            }
            key = value_end + (*value_end == ',');
        }
        p = end + (*end == ',');
    }
    return n;
}

/* The prefix of a choice's call ids: call_ID_CHOICE (the completion's
   number and the choice's); call k's "id" is the prefix, '_' and k. The
   command line names its calls the same way (11.2). */
static void call_id_prefix(char *out, size_t size, const Conn *c, int choice) {
    snprintf(out, size, "call_%s_%d", c->id + strlen("chatcmpl-"), choice);
}

static void buf_call_id(ByteBuf *b, const char *prefix, int k) { buf_printf(b, "\"id\":\"%s_%d\"", prefix, k); }

/* message.tool_calls of an answer (and of a --batch line's, 11.2). */
static void buf_tool_calls(ByteBuf *b, const char *prefix, const ToolCall *calls, int n) {
    buf_str(b, ",\"tool_calls\":[");
    for (int k = 0; k < n; k++) {
        buf_str(b, k ? ",{" : "{");
        buf_call_id(b, prefix, k);
        buf_str(b, ",\"type\":\"function\",\"function\":{\"name\":");
        buf_json(b, calls[k].name);
        buf_str(b, ",\"arguments\":");
        buf_json(b, calls[k].arguments);
        buf_str(b, "}}");
    }
    buf_str(b, "]");
}

/* One Server-Sent Event whose delta is `members` (JSON object members). */
static void send_raw_delta(Server *srv, Conn *c, int choice, const char *members) {
    ByteBuf b = {0};
    buf_str(&b, "data: ");
    completion_head(srv, c, &b, "chat.completion.chunk");
    buf_printf(&b, ",\"choices\":[{\"index\":%d,\"delta\":{%s%s},\"finish_reason\":null}]}\n\n", choice,
               c->first_chunk[choice] ? "\"role\":\"assistant\",\"content\":null," : "", members);
    c->first_chunk[choice] = 0;
    conn_body(c, b.data, b.n);
    buf_free(&b);
}

/* A streamed reply's calls, as OpenAI streams them: each call's id, type
   and name with empty arguments, then its arguments, as delta.tool_calls
   items with the call's index. */
static void stream_calls(Server *srv, Conn *c, int choice, const ToolCall *calls, int n) {
    char prefix[64];
    call_id_prefix(prefix, sizeof(prefix), c, choice);
    for (int k = 0; k < n; k++) {
        ByteBuf b = {0};
        buf_printf(&b, "\"tool_calls\":[{\"index\":%d,", k);
        buf_call_id(&b, prefix, k);
        buf_str(&b, ",\"type\":\"function\",\"function\":{\"name\":");
        buf_json(&b, calls[k].name);
        buf_str(&b, ",\"arguments\":\"\"}}]");
        send_raw_delta(srv, c, choice, b.data);
        b.n = 0;
        buf_printf(&b, "\"tool_calls\":[{\"index\":%d,\"function\":{\"arguments\":", k);
        buf_json(&b, calls[k].arguments);
        buf_str(&b, "}}]");
        send_raw_delta(srv, c, choice, b.data);
        buf_free(&b);
    }
}

/* Whether a chat answer's reasoning goes apart from its content: the
   template's replies open with <think> (Qwen3), as llama-server and vLLM
   send them. */
static int serve_thinks(const Server *srv, const Conn *c) { return c->chat && reasoning_splits(srv->tok); }

/* A choice being streamed, for serve_think_sink. */
typedef struct {
    Server *srv;
    Conn *c;
    int choice;
} StreamedChoice;

/* A ThinkSink that streams each part as the delta's reasoning_content or content. */
static void serve_think_sink(void *ctx, int reasoning, const char *text, size_t n) {
    StreamedChoice *sc = ctx;
    char *part = xcalloc(n + 1, 1);
    memcpy(part, text, n);
    send_delta(sc->srv, sc->c, sc->choice, reasoning ? "reasoning_content" : "content", part, NULL);
    free(part);
}

/* A ThinkSink that keeps the reasoning in ctx[1] and the answer in ctx[0]. */
static void keep_think_sink(void *ctx, int reasoning, const char *text, size_t n) { buf_add((ByteBuf *)ctx + reasoning, text, n); }

/* The length of the leading part of s (n bytes) that ends on a whole UTF-8
   character. */
static size_t utf8_whole(const char *s, size_t n) {
    size_t i = n;
    for (int back = 1; back <= 3 && i > 0; back++) {
        unsigned char c = (unsigned char)s[i - 1];
        if ((c & 0xC0) == 0x80) { i--; continue; }
        int need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
        return need > back ? i - 1 : n;
    }
    return n;
}

/* The connection and the choice of a request (see Conn). */
static Conn *request_conn(Server *srv, const Request *r) { return &srv->conns[r->index / SERVE_MAX_N]; }
static int request_choice(const Request *r) { return r->index % SERVE_MAX_N; }

/* A reply's streamed text as content (its reasoning apart: see serve_thinks). */
static void stream_content(Server *srv, Conn *c, int choice, const char *text, size_t n) {
    StreamedChoice sc = {srv, c, choice};
    if (serve_thinks(srv, c)) {
        think_feed(&c->think[choice], text, n, serve_think_sink, &sc);
    } else if (n > 0) {
        char *part = span_dup(text, n);
        send_chunk(srv, c, choice, part, NULL);
        free(part);
    }
}

/* A reply's streamed text; with tools, what may be a call is held back
   (all of it when the prompt ends with the marker; else from the marker, or
   what may be its start, on) until the reply ends (serve_on_done). */
static void stream_reply(Server *srv, Conn *c, int choice, const char *text, size_t n) {
    if (c->calls == CALLS_NONE) { stream_content(srv, c, choice, text, n); return; }
    ByteBuf *all = &c->reply[choice];
    buf_add(all, text, n);
    if (c->calls == CALLS_PREFILLED || !all->data) return;
    if (c->calls == CALLS_LEADING) { /* all held while it may yet start a call; then all told */
        const char *p = past_call_lead(all->data);
        size_t n_p = strlen(p);
        if (*p == '{' || partial_marker(p, n_p, PYTHON_TAG) == n_p) return;
        if (all->n > c->told[choice]) stream_content(srv, c, choice, all->data + c->told[choice], all->n - c->told[choice]);
        c->told[choice] = all->n;
        return;
    }
    const char *at = strstr(all->data, TOOL_MARKER);
    size_t safe = at ? (size_t)(at - all->data) : all->n - partial_marker(all->data, all->n, TOOL_MARKER);
    if (safe <= c->told[choice]) return;
    stream_content(srv, c, choice, all->data + c->told[choice], safe - c->told[choice]);
    c->told[choice] = safe;
}

/* The engine's on_text: a streamed request's next text, as one event per
   token (a character split between tokens waits for its end). */
static void serve_on_text(Request *r, const char *text, size_t n) {
    Server *srv = r->owner;
    Conn *c = request_conn(srv, r);
    int choice = request_choice(r);
    ByteBuf *held = &c->held[choice];
    if (!c->stream || c->gone) return;
    buf_add(held, text, n);
    size_t whole = utf8_whole(held->data, held->n);
    if (whole == 0) return;
    char *piece = xcalloc(whole + 1, 1);
    memcpy(piece, held->data, whole);
    memmove(held->data, held->data + whole, held->n - whole + 1);
    held->n -= whole;
    stream_reply(srv, c, choice, piece, whole);
    free(piece);
}

static const char *finish_reason(const Hypothesis *h) { return strcmp(h->stop, "length") == 0 ? "length" : "stop"; }

/* The members of a chat reply's message, as the answer's message has them
   (and a --batch line with messages, and -m chat -f json: 11.2): "content",
   the text before the calls when there are calls (null when that is
   empty); "reasoning_content" when `thinks` (serve_thinks) and the reply
   reasoned; "tool_calls" when it made calls (mode: CALLS_*), their ids
   prefix_K. text is the reply's whole text (cut at its calls here); *n_calls
   gets their count. Returns the finish reason: "tool_calls" with calls. */
static const char *buf_reply_message(ByteBuf *b, char *text, const Hypothesis *h, int mode, int thinks, const char *prefix, int *n_calls) {
    ToolCall calls[SERVE_MAX_CALLS];
    size_t content_len;
    int n = mode != CALLS_NONE ? reply_calls(text, h, mode, calls, &content_len) : 0;
    if (n > 0) text[content_len] = '\0'; /* the content: the text before the calls */
    ByteBuf parts[2] = {{0}, {0}}; /* the answer, the reasoning */
    if (thinks) {
        ThinkSplit split = {THINK_START, {NULL, 0, 0}, 0};
        think_feed(&split, text, strlen(text), keep_think_sink, parts);
        think_finish(&split, keep_think_sink, parts);
    } else {
        buf_str(&parts[0], text);
    }
    buf_str(b, "\"content\":");
    if (n > 0 && parts[0].n == 0) buf_str(b, "null");
    else buf_json(b, parts[0].data ? parts[0].data : "");
    if (parts[1].n > 0) {
        buf_str(b, ",\"reasoning_content\":");
        buf_json(b, parts[1].data);
    }
    if (n > 0) buf_tool_calls(b, prefix, calls, n);
    buf_free(&parts[0]);
    buf_free(&parts[1]);
    free_calls(calls, n);
    if (n_calls) *n_calls = n;
    return n > 0 ? "tool_calls" : finish_reason(h);
}

/* ---- Choices and their log-probabilities -----------------------------------
   A completion with n choices runs as n requests on the engine, choice i
   with seed + i (the request's seed, or the clock's), so they are batched
   together and choice i is what a request for one choice with that seed
   gives. The answer waits for all of them; a stream carries each choice's
   chunks under its index, each ending with its finish reason, and [DONE]
   after the last. With logprobs each request keeps its tokens'
   log-probabilities (see Logprobs); with echo and logprobs its prompt's too.
   A token's text is what it adds to the printed text (decode after the token
   before it; nothing for a byte that is not printed); an end token's is its
   vocabulary entry, which adds nothing to the text. */

static const char *token_text(const Tokenizer *tok, int prev_token, int token) {
    if (is_end_token(tok, token)) return tok->vocab[token];
    const char *piece = decode(tok, prev_token, token);
    return piece_is_printable(tok, piece) ? piece : "";
}

/* A log-probability as JSON: all of its digits, so that sums come out as
   the engine's; a masked token's (-infinity) as -9999, as OpenAI gives it. */
static void buf_logprob(ByteBuf *b, double v) {
    if (isfinite(v)) buf_printf(b, "%.17g", v);
    else buf_str(b, "-9999.0");
}

/* The UTF-8 bytes of s as a JSON list of numbers. */
static void buf_bytes(ByteBuf *b, const char *s) {
    buf_str(b, "[");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) buf_printf(b, p == (const unsigned char *)s ? "%u" : ",%u", *p);
    buf_str(b, "]");
}

/* One token of the legacy completions' logprobs lists: tokens,
   token_logprobs, top_logprobs and text_offset, in four buffers. `lp` NULL:
   an unscored first prompt token. Returns the text offset after it. */
static size_t completion_logprob(const Tokenizer *tok, ByteBuf lists[4], int prev, int token, const TokenLogprob *lp, int top,
                                 size_t offset) {
    const char *text = token_text(tok, prev, token);
    for (int k = 0; k < 4; k++) buf_str(&lists[k], lists[k].n > 1 ? "," : "");
    buf_json(&lists[0], text);
    if (!lp) {
        buf_str(&lists[1], "null");
        buf_str(&lists[2], "null");
    } else {
        buf_logprob(&lists[1], lp->logprob);
        buf_str(&lists[2], "{");
        for (int k = 0; k < top; k++) {
            if (k) buf_str(&lists[2], ",");
            buf_json(&lists[2], token_text(tok, prev, lp->top_token[k]));
            buf_str(&lists[2], ":");
            buf_logprob(&lists[2], lp->top_logprob[k]);
        }
        buf_str(&lists[2], "}");
    }
    buf_printf(&lists[3], "%zu", offset);
    return offset + (is_end_token(tok, token) ? 0 : strlen(text));
}

/* A completion choice's "logprobs" object: with echo the prompt's tokens
   first (the first one unscored), then every chosen token, an end token that
   ended the choice included (so they add up to the command line's score). */
static void completion_logprobs(const Tokenizer *tok, ByteBuf *b, const Request *r, const char *echo) {
    const Logprobs *lp = r->lp;
    ByteBuf lists[4] = {{0}};
    for (int k = 0; k < 4; k++) buf_str(&lists[k], "[");
    size_t offset = 0;
    for (int p = 0; echo && p < r->n_prompt; p++)
        offset = completion_logprob(tok, lists, p > 0 ? r->prompt[p - 1] : -1, r->prompt[p], p > 0 ? &lp->prompt[p] : NULL, lp->top, offset);
    offset = echo ? strlen(echo) : 0;
    for (int i = 0, prev = r->prompt[r->n_prompt - 1]; i < lp->n_chosen; prev = lp->chosen[i++].token)
        offset = completion_logprob(tok, lists, prev, lp->chosen[i].token, &lp->chosen[i], lp->top, offset);
    static const char *const names[4] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    for (int k = 0; k < 4; k++) {
        buf_printf(b, "%s\"%s\":%s]", k ? "," : "{", names[k], lists[k].data);
        buf_free(&lists[k]);
    }
    buf_str(b, "}");
}

/* A chat choice's "logprobs" object: content, one entry per token of the
   reply (an end token that ended it is not part of the reply). */
static void chat_logprobs(const Tokenizer *tok, ByteBuf *b, const Request *r) {
    const Logprobs *lp = r->lp;
    buf_str(b, "{\"content\":[");
    for (int i = 0, prev = r->prompt[r->n_prompt - 1]; i < r->hyps[0].n_tokens; prev = lp->chosen[i++].token) {
        const TokenLogprob *t = &lp->chosen[i];
        for (int k = -1; k < lp->top; k++) {
            const char *text = token_text(tok, prev, k < 0 ? t->token : t->top_token[k]);
            buf_str(b, k < 0 ? (i ? ",{\"token\":" : "{\"token\":") : k ? ",{\"token\":" : "{\"token\":");
            buf_json(b, text);
            buf_str(b, ",\"logprob\":");
            buf_logprob(b, k < 0 ? t->logprob : t->top_logprob[k]);
            buf_str(b, ",\"bytes\":");
            buf_bytes(b, text);
            buf_str(b, k < 0 ? ",\"top_logprobs\":[" : "}");
        }
        buf_str(b, "]}");
    }
    buf_str(b, "],\"refusal\":null}");
}

/* The whole answer of a completion whose choices are all done. */
static void answer_choices(Server *srv, Conn *c) {
    ByteBuf b = {0};
    int generated = 0;
    completion_head(srv, c, &b, c->chat ? "chat.completion" : "text_completion");
    buf_str(&b, ",\"choices\":[");
    for (int i = 0; i < c->n_choices; i++) {
        const Request *r = c->req[i];
        const Hypothesis *h = &r->hyps[0];
        char *text = hypothesis_text(srv->tok, h, r->prompt[r->n_prompt - 1]);
        buf_printf(&b, "%s{\"index\":%d,", i ? "," : "", i);
        const char *finish = finish_reason(h);
        if (c->chat) {
            char prefix[64];
            call_id_prefix(prefix, sizeof(prefix), c, i);
            buf_str(&b, "\"message\":{\"role\":\"assistant\",");
            finish = buf_reply_message(&b, text, h, c->calls, serve_thinks(srv, c), prefix, NULL);
            buf_str(&b, "},\"logprobs\":");
            if (r->lp) chat_logprobs(srv->tok, &b, r);
        } else {
            const char *echo = c->echo[i] ? c->echo[i] : "";
            char *whole = xcalloc(strlen(echo) + strlen(text) + 1, 1);
            strcat(strcpy(whole, echo), text);
            buf_str(&b, "\"text\":");
            buf_json(&b, whole);
            free(whole);
            buf_str(&b, ",\"logprobs\":");
            if (r->lp) completion_logprobs(srv->tok, &b, r, c->echo[i]);
        }
        if (!r->lp) buf_str(&b, "null");
        buf_printf(&b, ",\"finish_reason\":\"%s\"}", finish);
        generated += h->n_tokens;
        free(text);
    }
    int n_prompt = conn_prompt_tokens(c);
    buf_printf(&b, "],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}", n_prompt, generated,
               n_prompt + generated);
    conn_answer(srv, c, 200, "application/json", b.data);
    buf_free(&b);
}

/* The log line of a finished completion: its tokens in and out (all its
   choices'), seconds, and how it ended (the first choice's; "N choices"). */
static void serve_log_done(const Conn *c) {
    int out = 0;
    for (int i = 0; i < c->n_choices; i++) out += c->req[i]->n_hyps > 0 ? c->req[i]->hyps[0].n_tokens : 0;
    const Request *first = c->req[0];
    if (first->n_hyps == 0) return; /* failed: its error answer is logged */
    fprintf(stderr, "run: serve: %s %d tokens in, %d out, %.3f s, %s", c->id, conn_prompt_tokens(c), out, now_seconds() - c->started,
            first->hyps[0].stop);
    if (c->n_choices > 1) fprintf(stderr, " (%d choices)", c->n_choices);
    fputc('\n', stderr);
}

/* The engine's on_done for one choice: its stream's last events, a log
   line; once every choice is done, the answer (or the stream's end), and
   the requests are freed. When one choice cannot run (its prompt needs
   more cache than there is), the answer is its error. */
static void serve_on_done(Request *r, void *user) {
    Server *srv = user;
    Conn *c = request_conn(srv, r);
    int choice = request_choice(r);
    const Hypothesis *h = r->n_hyps > 0 ? &r->hyps[0] : NULL;
    if (c->stream && h && !r->error) {
        StreamedChoice sc = {srv, c, choice};
        if (c->held[choice].n > 0) stream_reply(srv, c, choice, c->held[choice].data, c->held[choice].n);
        buf_free(&c->held[choice]); /* nothing of it is left for the connection's next answer */
        ToolCall calls[SERVE_MAX_CALLS];
        int n_calls = 0;
        if (c->calls != CALLS_NONE) { /* the text held back: content up to the calls, then the calls */
            char *text = hypothesis_text(srv->tok, h, r->prompt[r->n_prompt - 1]);
            size_t content_len;
            n_calls = reply_calls(text, h, c->calls, calls, &content_len);
            if (content_len > c->told[choice]) stream_content(srv, c, choice, text + c->told[choice], content_len - c->told[choice]);
            free(text);
        }
        if (serve_thinks(srv, c)) think_finish(&c->think[choice], serve_think_sink, &sc);
        stream_calls(srv, c, choice, calls, n_calls);
        free_calls(calls, n_calls);
        send_chunk(srv, c, choice, NULL, n_calls > 0 ? "tool_calls" : finish_reason(h));
    }
    think_finish(&c->think[choice], NULL, NULL); /* nor of its reasoning (after an error) */
    if (--c->n_left > 0) return;
    serve_log_done(c);
    const char *error = NULL;
    for (int i = 0; i < c->n_choices; i++)
        if (c->req[i]->error || c->req[i]->n_hyps == 0) error = c->req[i]->error ? c->req[i]->error : "the request produced nothing";
    if (error) {
        conn_error(srv, c, 503, error);
    } else if (c->stream) {
        conn_body(c, "data: [DONE]\n\n", 14);
        conn_end_stream(c);
    } else {
        answer_choices(srv, c);
    }
    for (int i = 0; i < c->n_choices; i++) {
        request_free(c->req[i]);
        c->req[i] = NULL;
    }
    c->n_choices = 0;
    conn_free_echo(c);
    for (int k = 0; k < MAX_STOPS; k++) { free(c->stops[k]); c->stops[k] = NULL; }
}

/* The engine's on_done while serving: the answer, and its connection is
   noted to be flushed after the step. */
static void serve_finished(Request *r, void *user) {
    Server *srv = user;
    int slot = (int)(request_conn(srv, r) - srv->conns);
    serve_on_done(r, user);
    srv->finished[srv->n_finished++] = slot;
}

/* Whether the Authorization header is "Bearer KEY", compared in a time that
   does not depend on where they differ. */
static int authorized(const char *key, const HttpRequest *h) {
    size_t n = strlen(key);
    if (!h->auth || h->auth_len != n + 7 || memcmp(h->auth, "Bearer ", 7) != 0) return 0;
    unsigned char diff = 0;
    for (size_t i = 0; i < n; i++) diff |= (unsigned char)(h->auth[7 + i] ^ key[i]);
    return diff == 0;
}

/* Why the choices and log-probabilities asked for cannot be given, or NULL. */
static const char *choice_refusal(const ServeFields *f) {
    if (f->max_tokens == 0 && !f->echo) return "field 'max_tokens': 0 is allowed only with 'echo': true";
    if (f->max_tokens == 0 && f->line.o.beams > 0) return "field 'max_tokens': 0 cannot be combined with num_beams";
    if (f->top_logprobs >= 0 && !f->logprobs) return "field 'top_logprobs' needs 'logprobs': true";
    if (f->logprobs && f->line.o.beams > 0) return "field 'logprobs' cannot be combined with num_beams";
    if (f->logprobs && f->stream) return "field 'logprobs' cannot be streamed: ask with stream false";
    return NULL;
}

/* Submits the n choices of each of a completion's prompts (see "Choices
   and their log-probabilities"): choice p * n + i is prompt p's i-th, with
   the seed plus i, as if each prompt came alone. Each choice has its own
   copy of its prompt (the prompt itself goes to its first). */
static void submit_choices(Server *srv, Conn *c, const ServeFields *f, const Decoding *d, int **prompts, const int *n_prompt,
                           int n_prompts) {
    c->n_choices = c->n_left = n_prompts * f->n;
    c->per_prompt = f->n;
    for (int k = 0; k < c->n_choices; k++) {
        int p = k / f->n, i = k % f->n, n = n_prompt[p];
        int max_new = f->max_tokens == 0 ? 0 : cap_new_tokens(d, srv->steps - n + 1);
        Decoding di = *d;
        di.seed = d->seed + (uint64_t)i;
        int *tokens = prompts[p];
        if (i > 0) {
            tokens = xcalloc((size_t)n, sizeof(int));
            memcpy(tokens, prompts[p], (size_t)n * sizeof(int));
        }
        Request *r = request_new(tokens, n, max_new, f->chat || srv->tok->eos_ends_generate, &di);
        if (f->logprobs) r->lp = logprobs_new(f->top_logprobs > 0 ? f->top_logprobs : 0, f->echo, n, max_new);
        r->index = (int)(c - srv->conns) * SERVE_MAX_N + k;
        r->owner = srv;
        r->on_text = serve_on_text;
        c->req[k] = r;
        c->first_chunk[k] = 1;
    }
}

/* The tokens of a conversation in Llama 3.1's tool format, as
   tool_messages_llama31 left it, in `room` positions: BOS, each message
   <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|> (the
   content as it is: the template trims only some, done there), then the
   assistant's header; the last message must be the user's or a result. */
static int *llama31_prompt_tokens(const Tokenizer *tok, const ServeFields *f, int room, int *n_tokens, const char **why) {
    const char *last = f->roles[f->n_messages - 1];
    *why = "the last message must be the user's or a tool's";
    if (strcmp(last, "user") != 0 && strcmp(last, "ipython") != 0) return NULL;
    int *out = xcalloc((size_t)room + 1, sizeof(int)), n = 0, fits = room >= 1;
    if (fits) out[n++] = tok->bos;
    for (int i = 0; fits && i < f->n_messages; i++) fits = append_llama3_header_text(tok, f->roles[i], f->contents[i], out, &n, room);
    if (fits) fits = append_llama3_header_text(tok, "assistant", NULL, out, &n, room);
    if (!fits) {
        *why = "the messages do not fit the model's context";
        free(out);
        return NULL;
    }
    *n_tokens = n;
    return out;
}

/* The tokens of a chat's messages (as tool_messages left them) in `room`
   positions: chat_messages_tokens's, and with "required" or a named
   function the marker after them, so that the reply starts with the call
   (11.1). NULL (and *why) as chat_messages_tokens. The server and the
   command line's chats and batch lines (11.2) all prompt with it. */
static int *chat_prompt_tokens(const Tokenizer *tok, const ServeFields *f, int room, int *n_tokens, const char **why) {
    if (f->tools.llama31 && f->tools.n > 0) return llama31_prompt_tokens(tok, f, room, n_tokens, why);
    int *tokens = chat_messages_tokens(tok, f->roles, f->contents, f->n_messages, room, n_tokens, why);
    if (tokens && calls_mode(&f->tools) == CALLS_PREFILLED && !append_text_tokens(tok, TOOL_MARKER, tokens, n_tokens, room)) {
        *why = "the messages do not fit the model's context";
        free(tokens);
        return NULL;
    }
    return tokens;
}

/* The token ids of a completion's prompts (the messages, for chat), at
   most SERVE_MAX_N, each fitting the context: their count, or 0 with *why
   (those made are freed). With echo, each prompt's text goes to echo[p]
   (token ids: their text, as a prompt's is printed, after BOS). */
static int completion_prompts(Server *srv, ServeFields *f, int **prompts, int *n_prompt, char **echo, const char **why) {
    const Tokenizer *tok = srv->tok;
    int count = f->n_prompts > 0 ? f->n_prompts : 1;
    *why = "the prompt does not fit the model's context";
    for (int p = 0; p < count; p++) {
        PromptItem one = {f->line.prompt, f->line.ids, f->line.n_ids}, *item = f->n_prompts > 0 ? &f->prompts[p] : &one;
        if (f->chat) prompts[p] = chat_prompt_tokens(tok, f, srv->steps, &n_prompt[p], why);
        else if (item->ids && item->n_ids <= srv->steps) {
            prompts[p] = xcalloc((size_t)item->n_ids, sizeof(int));
            memcpy(prompts[p], item->ids, (size_t)item->n_ids * sizeof(int));
            n_prompt[p] = item->n_ids;
        } else if (!item->ids) prompts[p] = encode_prompt(tok, item->text, srv->steps, &n_prompt[p]);
        else prompts[p] = NULL;
        if (!prompts[p]) {
            while (p-- > 0) free(prompts[p]);
            return 0;
        }
        if (f->echo && !item->ids) echo[p] = strdup(item->text);
        else if (f->echo) echo[p] = prompts[p][0] == tok->bos ? decode_text(tok, prompts[p][0], prompts[p] + 1, n_prompt[p] - 1)
                                                               : decode_text(tok, tok->bos, prompts[p], n_prompt[p]);
    }
    return count;
}

/* The constraint of a request (a server's, or a batch line's: 11.2) with
   tools ts (11.1), as its line's schema; the refusal, or NULL. */
static const char *tool_constraint(const ToolSet *ts, BatchLine *line, char *err, size_t err_len) {
    if (line->schema) return "fields 'tools' and 'response_format' cannot be combined (a call's arguments follow its schema)";
    if (line->o.beams > 0) return "field 'tools' cannot be combined with beam search (num_beams, beams)";
    line->schema = tool_call_schema(ts, err, err_len);
    line->o.schema = line->schema;
    return line->schema ? NULL : err;
}

/* Starts a completion (chat or not) from the request body: the fields are
   read over the command line's options and its requests are built as
   run_batch builds one; a streamed answer's head goes out at once. */
static void start_completion(Server *srv, Conn *c, const HttpRequest *h, int chat) {
    ServeFields *f = xcalloc(1, sizeof(ServeFields));
    f->line.o = *srv->o;
    f->chat = chat;
    f->max_tokens = f->top_logprobs = -1;
    f->n = 1;
    f->tools.parallel = 1;
    f->vocab = srv->e->t->config.vocab_size;
    jmp_buf trap;
    error_trap = &trap;
    if (setjmp(trap)) {
        error_trap = NULL;
        free_serve_fields(f);
        free(f);
        conn_error(srv, c, 400, error_text);
        return;
    }
    parse_request_body(f, h->body, h->body_len);
    if (chat) tool_messages(f, srv->tok);
    Options *o = &f->line.o;
    if (f->max_tokens > 0) o->max_new_tokens = f->max_tokens;
    const char *refusal = NULL;
    if (o->beams > srv->beams) refusal = "num_beams is more than the server allows (4, or -b when it is more)";
    else if (o->beams > 0 && f->stream) refusal = "num_beams cannot be streamed: ask with stream false";
    else refusal = choice_refusal(f);
    if (!refusal && f->n_prompts * f->n > SERVE_MAX_N) refusal = "fields 'prompt' and 'n': the prompts times n is 16 at most";
    char tool_refusal[320];
    int calls = calls_mode(&f->tools);
    if (!refusal && calls != CALLS_NONE) refusal = tool_constraint(&f->tools, &f->line, tool_refusal, sizeof(tool_refusal));
    int n_prompt[SERVE_MAX_N], *prompts[SERVE_MAX_N], n_prompts = 0;
    char *echo[SERVE_MAX_N] = {NULL};
    const char *why = NULL;
    if (!refusal) n_prompts = completion_prompts(srv, f, prompts, n_prompt, echo, &why);
    error_trap = NULL;
    if (!refusal && n_prompts == 0) refusal = why;
    if (refusal) {
        free_serve_fields(f);
        free(f);
        conn_error(srv, c, 400, refusal);
        return;
    }
    Decoding d = decoding_of(o, srv->clock_seed);
    d.n_return = 1;
    constrain_calls(&d, calls);
    submit_choices(srv, c, f, &d, prompts, n_prompt, n_prompts);
    for (int k = 0; k < c->n_choices; k++) /* each choice its own copy of its prompt's */
        c->echo[k] = echo[k / f->n] && k % f->n != 0 ? strdup(echo[k / f->n]) : echo[k / f->n];
    /* the choices share the schema; the last one owns it, as it is freed
       last (conn_drop_requests, serve_on_done) */
    c->req[c->n_choices - 1]->own_schema = f->line.schema;
    f->line.schema = NULL;
    /* the requests' stop strings are f's: the connection keeps them */
    for (int k = 0; k < d.controls.n_stops; k++) c->stops[k] = f->line.stops[k];
    f->line.o.controls.n_stops = 0;
    c->chat = chat;
    c->stream = f->stream;
    c->calls = calls;
    free_serve_fields(f);
    free(f);
    c->phase = CONN_RUNNING;
    c->created = (long long)time(NULL);
    c->started = now_seconds();
    snprintf(c->id, sizeof(c->id), "%s-%lld", chat ? "chatcmpl" : "cmpl", ++srv->next_id);
    srv->n_requests++;
    if (c->stream) {
        c->keep = conn_keeps(srv, c);
        c->chunked = 1;
        buf_printf(&c->out, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                   "Transfer-Encoding: chunked\r\nConnection: %s\r\n\r\n", c->keep ? "keep-alive" : "close");
        for (int i = 0; i < c->n_choices; i++)
            if (c->echo[i]) send_chunk(srv, c, i, c->echo[i], NULL);
    }
    for (int i = 0; i < c->n_choices; i++) engine_submit(srv->e, c->req[i]);
}

/* GET /metrics: Prometheus text. */
static void answer_metrics(Server *srv, Conn *c) {
    const Engine *e = srv->e;
    ByteBuf b = {0};
    buf_printf(&b, "# TYPE run_requests_total counter\nrun_requests_total %lld\n", srv->n_requests);
    buf_printf(&b, "# TYPE run_requests_failed_total counter\nrun_requests_failed_total %lld\n", srv->n_failed);
    buf_printf(&b, "# TYPE run_generated_tokens_total counter\nrun_generated_tokens_total %d\n", e->stats.generated_tokens);
    buf_printf(&b, "# TYPE run_prompt_tokens_total counter\nrun_prompt_tokens_total %d\n", e->stats.prompt_tokens);
    buf_printf(&b, "# TYPE run_prompt_tokens_reused_total counter\nrun_prompt_tokens_reused_total %d\n", e->stats.reused_tokens);
    buf_printf(&b, "# TYPE run_requests_paused_total counter\nrun_requests_paused_total %lld\n", e->stats.paused);
    buf_printf(&b, "# TYPE run_queue_length gauge\nrun_queue_length %d\n", waiting_requests(e));
    buf_printf(&b, "# TYPE run_running_requests gauge\nrun_running_requests %d\n", e->n_running);
    buf_printf(&b, "# TYPE run_requests_refused_total counter\nrun_requests_refused_total %lld\n", srv->n_refused);
    buf_printf(&b, "# TYPE run_connections_open gauge\nrun_connections_open %d\n", srv->n_open);
    buf_printf(&b, "# TYPE run_connections_dropped_total counter\nrun_connections_dropped_total %lld\n", srv->n_dropped);
    buf_printf(&b, "# TYPE run_cache_blocks gauge\nrun_cache_blocks %d\n", e->t->state.cache.n_blocks);
    buf_printf(&b, "# TYPE run_cache_blocks_free gauge\nrun_cache_blocks_free %d\n", e->t->state.cache.n_blocks - e->t->state.cache.held);
    conn_answer(srv, c, 200, "text/plain; version=0.0.4", b.data);
    buf_free(&b);
}

/* Whether a new completion would wait beyond --max-queue. */
static int queue_full(const Server *srv) {
    const Engine *e = srv->e;
    return e->n_running + waiting_requests(e) >= e->parallel + srv->o->max_queue;
}

/* Answers (or starts) a whole request. */
static void serve_request(Server *srv, Conn *c, const HttpRequest *h) {
    static const struct { const char *path, *method; } routes[] = {
        {"/health", "GET"}, {"/metrics", "GET"}, {"/v1/models", "GET"}, {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}};
    int route = -1;
    for (int i = 0; i < (int)(sizeof(routes) / sizeof(routes[0])); i++)
        if (strcmp(h->path, routes[i].path) == 0) route = i;
    if (route < 0) { conn_error(srv, c, 404, "unknown path"); return; }
    if (strcmp(h->method, routes[route].method) != 0) { conn_error(srv, c, 405, "wrong method for this path"); return; }
    if (route > 0 && srv->o->api_key && !authorized(srv->o->api_key, h)) {
        conn_error(srv, c, 401, "a valid API key is needed (Authorization: Bearer KEY)");
        return;
    }
    if (route == 0) { conn_answer(srv, c, 200, "application/json", "{\"status\":\"ok\"}"); return; }
    if (route == 1) { answer_metrics(srv, c); return; }
    if (route == 2) {
        ByteBuf b = {0};
        buf_str(&b, "{\"object\":\"list\",\"data\":[{\"id\":");
        buf_json(&b, srv->model);
        buf_str(&b, ",\"object\":\"model\",\"created\":0,\"owned_by\":\"run\"}]}");
        conn_answer(srv, c, 200, "application/json", b.data);
        buf_free(&b);
        return;
    }
    if (queue_full(srv)) {
        c->retry_after = 1;
        srv->n_refused++;
        conn_error(srv, c, 429, "too many requests are waiting (--max-queue): retry later");
        return;
    }
    start_completion(srv, c, h, route == 4);
}

/* Serves the request at the start of what c has received, if it is whole;
   its bytes are then dropped (what follows is the next request). A request
   that cannot be parsed is refused and ends the connection. */
static void conn_parse(Server *srv, Conn *c) {
    HttpRequest h;
    int status = http_parse(c->in, c->n_in, srv->max_body, &h);
    if (status == 0 && c->n_in == conn_limit(srv)) status = 413;
    if (status == 0 && h.expect_continue && !c->continued) {
        buf_str(&c->out, "HTTP/1.1 100 Continue\r\n\r\n");
        c->continued = 1;
    }
    if (status == 0 && h.header_len > 0 && !c->head) { /* the header is whole: the body's deadline starts */
        c->head = 1;
        c->deadline = srv->now + srv->header_timeout;
    }
    if (status == 0) return;
    c->head = 0;
    c->deadline = 0;
    c->may_keep = status == 1 && !h.close;
    if (status != 1) {
        conn_error(srv, c, status, status == 413 ? "the body is over --max-body-kb" : status == 431 ? "the header is too large" :
                                   status == 501 ? "only bodies with a Content-Length are read" : "malformed HTTP request");
        return;
    }
    serve_request(srv, c, &h);
    size_t used = h.header_len + h.body_len;
    memmove(c->in, c->in + used, c->n_in - used);
    c->n_in -= used;
}

/* Reads what has arrived on a connection into its buffer, which grows only
   as far as the limits allow. While a request runs, what arrives waits (the
   client's next request), and the end of the connection marks it gone. The
   first byte of a request starts its header's deadline. */
static void conn_read(Server *srv, Conn *c) {
    size_t limit = conn_limit(srv);
    if (c->n_in == c->cap_in) {
        size_t cap = c->cap_in ? 2 * c->cap_in : 4096;
        if (cap > limit) cap = limit;
        char *p = realloc(c->in, cap + 1);
        if (!p) { conn_close(srv, c); return; }
        c->in = p;
        c->cap_in = cap;
    }
    if (c->n_in == c->cap_in) return; /* full while a request runs: the rest waits */
    ptrdiff_t k = net_recv(c->s, c->in + c->n_in, c->cap_in - c->n_in);
    if (k == -2) return;
    if (k <= 0) {
        if (c->phase == CONN_READING) conn_close(srv, c);
        else c->gone = 1;
        return;
    }
    c->n_in += (size_t)k;
    c->last = srv->now;
    if (c->phase == CONN_READING && c->deadline == 0) c->deadline = srv->now + srv->header_timeout;
}

/* A connection beyond --max-conns: 503 at once, as far as one send takes
   it, and closed. */
static void refuse_busy(Server *srv, Socket s) {
    static const char body[] = "{\"error\":{\"message\":\"too many connections\",\"type\":\"server_error\",\"code\":503}}";
    char answer[512];
    int n = snprintf(answer, sizeof(answer), "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n%s", sizeof(body) - 1, body);
    (void)net_send(s, answer, (size_t)n);
    net_close(s);
    srv->n_refused++;
}

/* A free connection for a new client: an unused one, or else the one idle
   the longest between requests, closed (a scan made only when all are
   taken); NULL when every one is busy. */
static Conn *conn_slot(Server *srv) {
    if (srv->n_free == 0) {
        Conn *idlest = NULL;
        for (int i = 0; i < srv->max_conns; i++) {
            Conn *c = &srv->conns[i];
            if (conn_idle(c) && (!idlest || c->last < idlest->last)) idlest = c;
        }
        if (!idlest) return NULL;
        conn_close(srv, idlest);
    }
    srv->n_open++;
    return &srv->conns[srv->free_slots[--srv->n_free]];
}

/* Takes every connection waiting on the listener. */
static void serve_accept(Server *srv, Socket listener) {
    for (Socket s; (s = net_accept(listener)) != NO_SOCKET;) {
        Conn *c = conn_slot(srv);
        if (!c) { refuse_busy(srv, s); continue; }
        *c = (Conn){.s = s, .phase = CONN_READING, .last = srv->now, .deadline = srv->now + srv->header_timeout};
        conn_watch(srv, c);
    }
}

/* The deadlines of "Holding a crowd", checked for every open connection. */
static void serve_sweep(Server *srv) {
    for (int i = 0; i < srv->max_conns; i++) {
        Conn *c = &srv->conns[i];
        if (c->phase == CONN_READING && c->deadline > 0 && srv->now > c->deadline)
            conn_drop(srv, c, c->head ? "its body took longer than --header-timeout" : "its header took longer than --header-timeout");
        else if (c->phase == CONN_READING && c->deadline == 0 && srv->now - c->last > SERVE_IDLE_TIMEOUT) conn_close(srv, c);
        else if (c->phase != CONN_FREE && c->blocked > 0 && srv->now - c->blocked > SERVE_SEND_TIMEOUT)
            conn_drop(srv, c, "its client read none of its answer for a while");
    }
}

/* After an engine step: the answers it added to are sent as far as they go
   (the running requests' streams, from the last, since a dropped connection
   takes its requests, one or more choices, off the running list; then those
   that ended in the step). */
static void serve_flush_step(Server *srv) {
    const Engine *e = srv->e;
    for (int i = e->n_running - 1; i >= 0; i--) {
        if (i >= e->n_running) continue; /* gone with the choices of a dropped connection */
        Conn *c = request_conn(srv, e->running[i]);
        if (c->sent < c->out.n) conn_advance(srv, c);
    }
    for (int i = 0; i < srv->n_finished; i++) {
        Conn *c = &srv->conns[srv->finished[i]];
        if (c->phase != CONN_FREE) conn_advance(srv, c);
    }
    srv->n_finished = 0;
}

/* The checkpoint's file name, the model's name in answers. */
static void model_name(char *out, size_t size, const char *path) {
    const char *base = path;
    for (const char *p = path; *p; p++)
        if (*p == '/' || *p == '\\') base = p + 1;
    snprintf(out, size, "%s", base);
}

/* SIGTERM or SIGINT while serving: the first drains (see serve_stop), a
   second ends the running requests at their next token. */
static volatile sig_atomic_t serve_stop_asked;

static void on_serve_stop(int sig) {
    (void)sig;
    if (serve_stop_asked) interrupt_pending = 1;
    serve_stop_asked = 1;
}

/* The last seconds of the drain, left for the answers to leave once the
   running requests are ended: SERVE_DRAIN_GRACE, or half of a shorter
   --drain-seconds. */
static double drain_grace(const Options *o) {
    return o->drain_seconds < 2 * SERVE_DRAIN_GRACE ? o->drain_seconds / 2 : SERVE_DRAIN_GRACE;
}

/* Stops accepting: the connections between requests are closed, and the
   waiting requests answered 503 (a stream ends empty); the running ones go
   on until drain_until. */
static void serve_stop(Server *srv, Socket *listener) {
    fprintf(stderr, "run: serve: stopping: %d requests running, up to %g s\n", srv->e->n_running, srv->o->drain_seconds);
    srv->stopping = 1;
    srv->drain_until = srv->now + srv->o->drain_seconds;
    net_unwatch(srv->poller, *listener, srv->max_conns);
    net_close(*listener);
    *listener = NO_SOCKET;
    for (int i = 0; i < srv->max_conns; i++) {
        Conn *c = &srv->conns[i];
        if (c->phase == CONN_READING) {
            conn_close(srv, c);
        } else if (conn_waiting(c)) {
            conn_drop_requests(srv->e, c);
            srv->n_refused++;
            if (c->stream) conn_end_stream(c);
            else conn_error(srv, c, 503, "the server is stopping");
            conn_advance(srv, c);
        }
    }
}

/* Connections at most: --max-conns, or fewer when the system grants fewer
   descriptors (the soft limit is raised toward the hard one for them); the
   one line on stderr says which. */
static int serve_max_conns(const Options *o) {
    long hard, want = (long)o->max_conns + SERVE_FD_RESERVE;
    long got = net_raise_descriptors(want, &hard);
    int n = got - SERVE_FD_RESERVE < (long)o->max_conns ? (int)(got - SERVE_FD_RESERVE) : o->max_conns;
    if (n < 1) n = 1;
    char hard_text[32];
    if (hard < 0) snprintf(hard_text, sizeof(hard_text), "unlimited");
    else snprintf(hard_text, sizeof(hard_text), "%ld", hard);
    fprintf(stderr, "run: serve: %ld open files allowed (hard limit %s): %d connections at most%s\n", got, hard_text, n,
            n < o->max_conns ? " (fewer than --max-conns)" : "");
    return n;
}

/* -m serve: listens until SIGTERM or SIGINT, then drains (serve_stop) and
   returns 0. */
static int serve(Engine *e, const Tokenizer *tok, const Options *o, uint64_t clock_seed) {
    Server *srv = xcalloc(1, sizeof(Server));
    *srv = (Server){.e = e, .tok = tok, .o = o, .clock_seed = clock_seed, .max_body = (size_t)o->max_body_kb * 1024,
                    .header_timeout = o->header_timeout};
    srv->steps = o->steps_given ? resolve_steps(o->steps, e->t->config.seq_len) : e->t->config.seq_len;
    srv->beams = o->beams > SERVE_MAX_BEAMS ? o->beams : SERVE_MAX_BEAMS;
    model_name(srv->model, sizeof(srv->model), o->checkpoint);
    int port;
    Socket listener = net_listen(o->host, o->port, &port); /* first: where serving is not built, this says so */
    srv->max_conns = serve_max_conns(o);
    srv->conns = xcalloc((size_t)srv->max_conns, sizeof(Conn));
    srv->free_slots = xcalloc((size_t)srv->max_conns, sizeof(int));
    srv->finished = xcalloc((size_t)srv->max_conns * SERVE_MAX_N, sizeof(int));
    for (int i = srv->max_conns - 1; i >= 0; i--) {
        srv->conns[i].s = NO_SOCKET;
        srv->free_slots[srv->n_free++] = i;
    }
    srv->poller = net_poller_new(srv->max_conns + 1);
    NetEvent *events = xcalloc((size_t)srv->max_conns + 1, sizeof(NetEvent));
    e->on_done = serve_finished;
    e->user = srv;
    net_watch(srv->poller, listener, srv->max_conns, NET_READ);
    serve_stop_asked = 0;
    on_sigterm(on_serve_stop);
    on_sigint(on_serve_stop, 1);
    fprintf(stderr, "listening on http://%s:%d\n", o->host, port);
    for (double next_sweep = 0;;) {
        srv->now = now_seconds();
        if (serve_stop_asked && !srv->stopping) serve_stop(srv, &listener);
        /* the running requests end at their next token, their answers leave, and at drain_until the
           process ends whatever its connections do */
        if (srv->stopping && srv->now > srv->drain_until - drain_grace(o)) interrupt_pending = 1;
        if (srv->stopping && (srv->n_open == 0 || srv->now > srv->drain_until)) break;
        int busy = e->n_running > 0 || engine_waiting(e);
        int n = net_poll(srv->poller, events, busy ? 0 : 100);
        srv->now = now_seconds();
        for (int i = 0; i < n; i++) {
            if (events[i].tag == srv->max_conns) {
                if (listener != NO_SOCKET) serve_accept(srv, listener);
                continue;
            }
            Conn *c = &srv->conns[events[i].tag];
            if (c->phase == CONN_FREE) continue;
            if (events[i].can_read) conn_read(srv, c);
            if (c->phase != CONN_FREE && c->gone) conn_close(srv, c);
            if (c->phase != CONN_FREE) conn_advance(srv, c);
        }
        if (srv->now >= next_sweep) {
            serve_sweep(srv);
            next_sweep = srv->now + SERVE_SWEEP;
            if (!busy && !srv->trimmed) release_free_memory();
            srv->trimmed = !busy;
        }
        if (busy) {
            engine_step(e);
            srv->now = now_seconds();
            serve_flush_step(srv);
        }
    }
    for (int i = 0; i < srv->max_conns; i++) conn_close(srv, &srv->conns[i]);
    net_poller_free(srv->poller);
    free(events);
    free(srv->conns);
    free(srv->free_slots);
    free(srv->finished);
    free(srv);
    clear_interrupt();
    fprintf(stderr, "run: serve: stopped\n");
    return 0;
}

/* ---- 11.2 Tool calls from the command line: chat and --batch ------------------
   The server's tool calls (11.1) from the command line, on the same code:
   there is one engine of calls, and these are two more ways in.
   -m chat with --tools FILE (a JSON array of tools, as a request's "tools")
   and --tool-choice (auto by default; none, required, or a tool's name):
   the conversation is kept as a request's "messages" (JSON text), and each
   reply is asked as the server is asked: the messages are read by its
   parser, rewritten by tool_messages, prompted by chat_prompt_tokens and
   constrained by tool_call_schema, so a chat's calls are the server's for
   the same conversation, settings and seed. A reply's calls are shown as
   JSON (OpenAI's shape: id, type, function: name and arguments) and their
   results asked for, a line each (--tool-results FILE: the file's lines, in
   order; at its end the chat ends), then sent back as "tool" messages. The
   reply after results is asked with "auto" (a "required" or named choice
   holds for the reply to each user message, "none" for every reply), so
   the model may answer in words or call again, and a chat that requires
   calls still ends in an answer. Replies are printed whole, not streamed
   (a call is shown once it parses). Unlike a chat without tools, this one
   drops no turns when the context is full: calls and their results are
   kept whole, as the server takes them, and a message that does not fit is
   refused.
   --batch: a line may be a chat, with "messages" (the server's shape,
   tool_calls and tool messages included) instead of "prompt", and "tools",
   "tool_choice", "parallel_tool_calls"; --tools and --tool-choice are the
   defaults of a chat line without "tools". The output line has, after the
   usual fields, the server's "message" (content, reasoning_content,
   tool_calls) and "finish_reason" ("tool_calls" when the reply made calls). */

/* --tool-choice (NULL: auto) into ts: auto, none, required, or a tool's
   name (checked in load_tools). */
static void set_tool_choice(ToolSet *ts, const char *choice) {
    static const char *const names[] = {"auto", "none", "required"};
    for (int k = 0; k < 3; k++)
        if (!choice || strcmp(choice, names[k]) == 0) {
            ts->choice = choice ? k : TOOLS_AUTO;
            return;
        }
    ts->choice = TOOLS_NAMED;
    free(ts->named);
    ts->named = strdup(choice);
}

/* --tools's text (checked: load_tools) into f's tools, read by the server's
   parser; with `choice`, --tool-choice too. */
static void apply_tool_options(ServeFields *f, const Options *o, int choice) {
    JsonCursor j = {o->tools_json, o->tools_json + strlen(o->tools_json), NULL};
    json_space(&j);
    parse_tools(&j, f);
    if (choice) set_tool_choice(&f->tools, o->tool_choice);
}

/* --tools FILE and --tool-choice, checked before the model loads: the file
   is one JSON array of tools that a request's "tools" may be (each with a
   name of its own and parameters that 6.1 takes), and the choice names one
   of them. A fault ends the run with one line: what is wrong, and what to
   give. Returns the file's text; the caller frees it. */
static char *load_tools(const Options *o) {
    size_t len;
    char *text = read_whole_file(o->tools_file, "tools file", &len), err[320];
    ServeFields *f = xcalloc(1, sizeof(ServeFields));
    jmp_buf trap;
    error_trap = &trap;
    if (setjmp(trap)) {
        error_trap = NULL;
        char why[sizeof(error_text)];
        memcpy(why, error_text, sizeof(why));
        die(EXIT_USAGE, "--tools %s: %s; the file must be a JSON array of tools, [{\"type\": \"function\", \"function\": "
            "{\"name\": ..., \"description\": ..., \"parameters\": {a JSON schema}}}]", o->tools_file, why);
    }
    JsonCursor j = {text, text + len, NULL};
    json_space(&j);
    if (j.p >= j.end || *j.p != '[') json_fail(&j, j.p >= j.end ? "the file is empty" : "not a JSON array (it starts with '%c')", *j.p);
    parse_tools(&j, f);
    json_space(&j);
    if (j.p < j.end) json_fail(&j, "text after the array");
    if (f->tools.n == 0) json_fail(&j, "an empty array (no tool to call)");
    JsonSchema *all = tool_call_schema(&f->tools, err, sizeof(err)); /* every tool's parameters (a batch line may choose any) */
    if (!all) json_fail(&j, "%s", err);
    free_schema(all);
    error_trap = NULL;
    set_tool_choice(&f->tools, o->tool_choice);
    if (f->tools.choice == TOOLS_NAMED) {
        ByteBuf names = {0};
        int found = 0;
        for (int i = 0; i < f->tools.n; i++) {
            found |= strcmp(f->tools.tools[i].name, f->tools.named) == 0;
            buf_printf(&names, "%s%s", i ? ", " : "", f->tools.tools[i].name);
        }
        if (!found)
            usage_error("--tool-choice '%s': no tool of that name in %s; give auto, none, required or a tool's name (%s)", o->tool_choice,
                        o->tools_file, names.data);
        buf_free(&names);
    }
    free_serve_fields(f);
    free(f);
    return text;
}

/* -- --batch's chat lines -- */

/* A chat field of a batch line ("messages", "tools", "tool_choice",
   "parallel_tool_calls"), read by the server's parsers into line->chat. */
static void batch_chat_field(JsonCursor *j, BatchLine *line, const char *name, int vocab) {
    if (!line->chat) {
        line->chat = xcalloc(1, sizeof(ServeFields));
        line->chat->chat = 1;
        line->chat->tools.parallel = 1;
        line->chat->vocab = vocab;
    }
    ServeFields *f = line->chat;
    if (strcmp(name, "messages") == 0) {
        parse_messages(j, f);
    } else if (strcmp(name, "tools") == 0) {
        parse_tools(j, f);
        line->tools_given = 1;
    } else if (strcmp(name, "tool_choice") == 0) {
        parse_tool_choice(j, f);
        line->tool_choice_given = 1;
    } else {
        JsonKind kind = json_value(j, name, &f->text);
        if (kind != JSON_TRUE && kind != JSON_FALSE) json_fail(j, "field 'parallel_tool_calls': must be true or false");
        f->tools.parallel = kind == JSON_TRUE;
    }
    free(f->text);
    f->text = NULL;
}

static void free_batch_chat(BatchLine *line) {
    if (!line->chat) return;
    free_serve_fields(line->chat);
    free(line->chat);
    line->chat = NULL;
}

/* A parsed chat line, checked as the server checks a request, its messages
   rewritten (tool_messages) and, with tools, its constraint made: the
   line's schema. --tools and --tool-choice stand for a line without
   "tools" (the choice names their tools: a line's own tools take its own
   choice, auto by default). */
static void batch_chat_check(JsonCursor *j, BatchLine *line, const Tokenizer *tok) {
    ServeFields *f = line->chat;
    if (!f->messages_given) json_fail(j, "fields 'tools', 'tool_choice' and 'parallel_tool_calls' are a chat's: they need 'messages'");
    if (line->prompt || line->ids) json_fail(j, "fields 'messages' and 'prompt' both give the prompt: use one");
    if (f->n_messages == 0) json_fail(j, "field 'messages': the list is empty; it needs a user message at least");
    if (!line->tools_given && line->o.tools_json) apply_tool_options(f, &line->o, !line->tool_choice_given);
    check_tool_choice(j, &f->tools);
    tool_messages(f, tok);
    char err[320];
    const char *refusal = calls_mode(&f->tools) != CALLS_NONE ? tool_constraint(&f->tools, line, err, sizeof(err)) : NULL;
    if (refusal) json_fail(j, "%s", refusal);
}

/* A chat line's prompt (chat_prompt_tokens), or NULL with *why, which
   fails its request only; *calls: how its replies make calls. */
static int *batch_chat_prompt(BatchLine *line, const Tokenizer *tok, int room, int *n_tokens, const char **why, int *calls) {
    jmp_buf trap, *outer = error_trap;
    int *volatile tokens = NULL;
    *calls = calls_mode(&line->chat->tools);
    error_trap = &trap;
    if (setjmp(trap) == 0) tokens = chat_prompt_tokens(tok, line->chat, room, n_tokens, why);
    else *why = "the tokenizer has no token for a byte of the messages";
    error_trap = outer;
    return tokens;
}


/* A chat's JSON line for a reply: print_json_hypothesis's, then the
   server's "message" and "finish_reason" (calls named prefix_K). */
static void print_chat_hypothesis(const Tokenizer *tok, const char *id, int rank, const Hypothesis *h, int last_prompt_token,
                                  int calls, const char *prefix) {
    char *text = hypothesis_text(tok, h, last_prompt_token);
    ByteBuf b = {0};
    buf_str(&b, "\"message\":{\"role\":\"assistant\",");
    const char *finish = buf_reply_message(&b, text, h, calls, reasoning_splits(tok), prefix, NULL);
    buf_printf(&b, "},\"finish_reason\":\"%s\"", finish);
    print_json_hypothesis_with(tok, id, rank, h, last_prompt_token, b.data);
    buf_free(&b);
    free(text);
}

/* -- -m chat --tools -- */

/* One more message, as a request's, after those in msgs. */
static void buf_message(ByteBuf *msgs, const char *role, const char *content, const char *call_id) {
    buf_str(msgs, msgs->n ? ",{\"role\":" : "{\"role\":");
    buf_json(msgs, role);
    buf_str(msgs, ",\"content\":");
    buf_json(msgs, content);
    if (call_id) {
        buf_str(msgs, ",\"tool_call_id\":");
        buf_json(msgs, call_id);
    }
    buf_str(msgs, "}");
}

/* The next line of the results file, without its line end; NULL at its end. */
static char *next_result(FILE *f) {
    char *line = NULL;
    size_t cap = 0;
    ptrdiff_t len = read_line_raw(&line, &cap, f);
    if (len < 0) {
        free(line);
        return NULL;
    }
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
    return line;
}

/* The request of the conversation so far (msgs), as the server reads it:
   its messages rewritten with the tools, its constraint in f->line.schema.
   after_results: a reply to results, asked with "auto" unless the choice
   is "none". */
static ServeFields *chat_tools_request(const ByteBuf *msgs, const Options *o, const Tokenizer *tok, int vocab, int after_results) {
    ServeFields *f = xcalloc(1, sizeof(ServeFields));
    f->chat = 1;
    f->tools.parallel = 1;
    f->vocab = vocab;
    ByteBuf body = {0};
    buf_printf(&body, "{\"messages\":[%s]}", msgs->data ? msgs->data : "");
    char err[320];
    jmp_buf trap;
    error_trap = &trap;
    if (setjmp(trap)) { /* not expected: run wrote the messages, and load_tools checked the tools */
        error_trap = NULL;
        char why[sizeof(error_text)];
        memcpy(why, error_text, sizeof(why));
        die(EXIT_BAD_FILE, "the chat's request with tools: %s", why);
    }
    parse_request_body(f, body.data, body.n);
    apply_tool_options(f, o, 1);
    if (after_results && f->tools.choice != TOOLS_NONE) set_tool_choice(&f->tools, NULL);
    tool_messages(f, tok);
    if (calls_mode(&f->tools) != CALLS_NONE && tool_constraint(&f->tools, &f->line, err, sizeof(err))) json_fail(NULL, "%s", err);
    error_trap = NULL;
    buf_free(&body);
    return f;
}

/* Prints a reply with calls in text mode: its content (the text before
   the calls), then each call as one JSON line. */
static void print_calls_text(const char *text, const Hypothesis *h, int mode, const char *prefix) {
    ToolCall calls[SERVE_MAX_CALLS];
    size_t content_len;
    int n = reply_calls(text, h, mode, calls, &content_len);
    printf("%.*s\n", (int)content_len, text);
    for (int k = 0; k < n; k++) {
        ByteBuf b = {0};
        buf_str(&b, "{");
        buf_call_id(&b, prefix, k);
        buf_str(&b, ",\"type\":\"function\",\"function\":{\"name\":");
        buf_json(&b, calls[k].name);
        buf_str(&b, ",\"arguments\":");
        buf_json(&b, calls[k].arguments);
        printf("Tool call: %s}}\n", b.data);
        buf_free(&b);
    }
    free_calls(calls, n);
}

/* -m chat with --tools (see above): a conversation over a context of
   `steps` positions, each reply a request run alone on e. */
static void chat_tools(Engine *e, const Tokenizer *tok, const Decoding *d, const Options *o, int steps) {
    int text_mode = d->format == FORMAT_TEXT;
    FILE *results = NULL;
    if (o->tool_results && !(results = fopen(o->tool_results, "rb")))
        die(EXIT_BAD_FILE, "%s: cannot open the tool results file: %s", o->tool_results, strerror(errno));
    char *system_prompt = o->system_prompt ? strdup(o->system_prompt) : read_line("Enter system prompt (optional): ", d->format);
    ByteBuf msgs = {0}; /* the conversation: a request's messages, as JSON text */
    if (system_prompt && system_prompt[0]) buf_message(&msgs, "system", system_prompt, NULL);
    Decoding turn_decoding = *d; /* each reply's sampler goes on from where the last one stopped */
    int after_results = 0, replies = 0, turn_index = 0;
    while (system_prompt) {
        size_t before = msgs.n;
        if (!after_results) {
            char *user = (turn_index++ == 0 && o->prompt) ? strdup(o->prompt) : read_line("User: ", d->format);
            if (!user) {
                if (text_mode) printf("\n");
                break;
            }
            buf_message(&msgs, "user", user, NULL);
            free(user);
        }
        ServeFields *f = chat_tools_request(&msgs, o, tok, e->t->config.vocab_size, after_results);
        int calls = calls_mode(&f->tools), n_prompt = 0;
        const char *why;
        int *prompt = chat_prompt_tokens(tok, f, steps, &n_prompt, &why);
        if (!prompt) {
            flush_output();
            fprintf(stderr, "run: %s (%d positions; a chat with --tools keeps every turn)%s\n", why, steps,
                    after_results ? ": the chat ends" : "; send a shorter message, or start a new chat");
            free_serve_fields(f);
            free(f);
            if (after_results) break;
            msgs.n = before; /* the message is not kept */
            msgs.data[before] = '\0';
            continue;
        }
        if (text_mode) printf("Assistant: ");
        flush_output();
        Decoding dd = turn_decoding;
        dd.schema = f->line.schema;
        constrain_calls(&dd, calls);
        Request *r = request_new(prompt, n_prompt, cap_new_tokens(&dd, steps - n_prompt + 1), 1, &dd);
        run_alone(e, r);
        turn_decoding.seed = r->sampler.rng_state;
        const Hypothesis *h = &r->hyps[0];
        int last = r->prompt[r->n_prompt - 1], n_calls = 0;
        char prefix[32], *text = hypothesis_text(tok, h, last), *cut = strdup(text);
        snprintf(prefix, sizeof(prefix), "call_%d", ++replies);
        ByteBuf m = {0}; /* the reply's message, as the server answers it and its client sends it back */
        buf_str(&m, "{\"role\":\"assistant\",");
        const char *finish = buf_reply_message(&m, cut, h, calls, reasoning_splits(tok), prefix, &n_calls);
        buf_str(&m, "}");
        ThinkSplit split = {THINK_START, {NULL, 0, 0}, 0};
        if (text_mode && n_calls > 0) print_calls_text(text, h, calls, prefix);
        else if (text_mode && hides_reasoning(tok)) print_answer_of(tok, h, last, 0, &split);
        else if (text_mode) printf("%s\n", text);
        else {
            ByteBuf extra = {0};
            buf_printf(&extra, "\"message\":%s,\"finish_reason\":\"%s\"", m.data, finish);
            print_json_hypothesis_with(tok, NULL, 1, h, last, extra.data);
            buf_free(&extra);
        }
        flush_output();
        buf_printf(&msgs, ",%s", m.data);
        free(text);
        free(cut);
        buf_free(&m);
        request_free(r);
        free_serve_fields(f); /* (its schema, the request's constraint, with it) */
        free(f);
        clear_interrupt(); /* Ctrl-C ended this reply only */
        after_results = 0;
        for (int k = 0; k < n_calls; k++) {
            char guide[64], id[48];
            snprintf(id, sizeof(id), "%s_%d", prefix, k);
            snprintf(guide, sizeof(guide), "Tool result (%s): ", id);
            char *result = results ? next_result(results) : read_line(guide, d->format);
            if (!result) {
                if (results) fprintf(stderr, "run: note: %s has no more results: the chat ends\n", o->tool_results);
                after_results = -1;
                break;
            }
            if (results && text_mode) printf("%s%s\n", guide, result);
            buf_message(&msgs, "tool", result, id);
            free(result);
            after_results = 1;
        }
        if (after_results < 0) break;
    }
    flush_output();
    if (results) fclose(results);
    buf_free(&msgs);
    free(system_prompt);
    print_stats(e);
}

/* ------------------------------------------------------------------------ */
/* 12. main                                                                 */
/* ------------------------------------------------------------------------ */

/* Without -z, a checkpoint's tokenizer is ./tokenizer.bin, as in llama2.c;
   when there is none, says what the checkpoint needs and how to give it. */
static void require_default_tokenizer(void) {
    FILE *f = fopen("tokenizer.bin", "rb");
    if (f) { fclose(f); return; }
    die(EXIT_USAGE, "no tokenizer: a llama2.c checkpoint needs the tokenizer it was trained with; pass it with -z "
        "(e.g. -z tok512.bin for stories260K), or put tokenizer.bin in the current directory (`python3 export.py "
        "tokenizer tokenizer.model tokenizer.bin` makes it from Llama 2's tokenizer.model)");
}

/* --prompt-ids: token ids separated by commas or spaces, each in [0,
   vocab), at least one; the prompt exactly, the first in BOS's place (not
   printed). The caller frees them. */
static int *parse_prompt_ids(const char *text, int vocab, int *n) {
    int *ids = xcalloc(strlen(text) / 2 + 1, sizeof(int));
    *n = 0;
    for (const char *p = text; *p;) {
        if (*p == ',' || *p == ' ') { p++; continue; }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v >= vocab || (*end && *end != ',' && *end != ' '))
            usage_error("--prompt-ids: '%.*s' is not a token id in [0, %d) (ids as -m tokenize prints them: 1,403,407)",
                        (int)strcspn(p, ", "), p, vocab);
        ids[(*n)++] = (int)v;
        p = end;
    }
    if (*n == 0) usage_error("--prompt-ids: no token ids (e.g. --prompt-ids 1,403,407)");
    return ids;
}

/* Names the seed that -s 0 (the default) stands for, the clock's as in
   llama2.c, so that `-s N` replays the run. */
static void name_clock_seed(uint64_t clock_seed) { fprintf(stderr, "run: seed %llu\n", (unsigned long long)clock_seed); }

/* Runs what the options ask for with a loaded model and tokenizer, on the
   engine e (zeroed; the caller frees it and t->state, also after an error).
   Returns the exit status. */
static int run_program(Engine *e, Transformer *t, const Tokenizer *tok, const Options *o, uint64_t clock_seed, Speculator *spec) {
    const Config *p = &t->config;
    if (o->keep >= p->seq_len) /* the ring after the sinks needs a slot */
        usage_error("--keep %d is not smaller than the model's context of %d positions", o->keep, p->seq_len);
    if (o->keep >= 0 && p->window > 0)
        usage_error("--keep does not work with %s's sliding-window layers; run without it (generation stops at the context, --ctx-size)",
                    p->arch->name);
    if (o->batch_file) {
        batch_setup(e, t, tok, o, spec);
        int status = run_batch(e, tok, o, clock_seed);
        print_stats(e);
        return status;
    }
    if (strcmp(o->mode, "serve") == 0) {
        /* rows for requests of up to SERVE_MAX_BEAMS beams (or -b), a cache
           for --parallel sampled ones at full length unless --kv-mb says */
        int steps = o->steps_given ? resolve_steps(o->steps, p->seq_len) : p->seq_len;
        int beams = o->beams > SERVE_MAX_BEAMS ? o->beams : SERVE_MAX_BEAMS, kv_mb = o->kv_mb;
        const CacheShape shape = cache_shape(t, KV_F32, NULL);
        if (kv_mb == 0)
            kv_mb = (int)ceil(cache_bytes(&shape, o->parallel * (request_main_blocks(1, steps) + 1), windows_wanted(&shape, o->parallel, beams, steps)) / 1048576.0);
        engine_setup(e, t, tok, o->parallel, beams, steps, kv_mb, o->kv_type, NULL);
        e->turn = SERVE_TURN;
        if (o->seed == 0) name_clock_seed(clock_seed);
        return serve(e, tok, o, clock_seed);
    }
    if (strcmp(o->mode, "tokenize") == 0) {
        print_tokens(tok, o->prompt ? o->prompt : "", o->format);
        return 0;
    }
    if (strcmp(o->mode, "perplexity") == 0) {
        engine_setup(e, t, tok, 1, 1, p->seq_len, o->kv_mb, o->kv_type, NULL); /* windows of the whole context */
        perplexity(t, tok, o->prompt ? o->prompt : "", o->format);
        return 0;
    }
    int steps = context_positions(o, p->seq_len);
    engine_setup(e, t, tok, 1, o->beams > 1 ? o->beams : 1, steps, o->kv_mb, o->kv_type, spec);
    Decoding d = decoding_of(o, clock_seed);
    e->stats.keeping = d.rolling;
    int n_prompt = 0, *prompt = o->prompt_ids ? parse_prompt_ids(o->prompt_ids, p->vocab_size, &n_prompt) : NULL;
    if (o->seed == 0 && samples(o)) name_clock_seed(clock_seed);
    if (strcmp(o->mode, "chat") == 0 && o->tools_json) chat_tools(e, tok, &d, o, steps); /* 11.2 */
    else if (strcmp(o->mode, "chat") == 0) chat(e, tok, &d, o->prompt, o->system_prompt, steps);
    else {
        if (!prompt) prompt = encode_prompt(tok, o->prompt ? o->prompt : "", INT_MAX, &n_prompt);
        generate(e, tok, &d, prompt, n_prompt, run_positions(o, p->seq_len));
    }
    return 0;
}

/* --ctx-size: the context a model runs with, at most `positions` (0: the
   model's own). Only the cache, the limits of -n and the choice of
   LongRoPE's factors read it. */
static void limit_context(Transformer *t, int positions) {
    if (positions > 0 && positions < t->config.seq_len) t->config.seq_len = positions;
    choose_rope_factors(t);
}

/* -m tokenize on a vocabulary-only GGUF file (no tensors, as llama.cpp's
   models/ggml-vocab-*.gguf), without -z: prints the tokens of the prompt
   with no model. Returns whether the file was one. */
static int tokenize_vocabulary_file(const Options *o) {
    if (strcmp(o->mode, "tokenize") != 0 || o->tokenizer) return 0;
    size_t size;
    void *data = map_file(o->checkpoint, &size, "checkpoint");
    GGUF g = {0};
    if (is_gguf(data, size)) parse_gguf(&g, data, size, o->checkpoint);
    int vocabulary_only = is_gguf(data, size) && g.n_tensors == 0;
    if (vocabulary_only) {
        Tokenizer tok;
        load_gguf_vocabulary(&tok, &g);
        print_tokens(&tok, o->prompt ? o->prompt : "", o->format);
        free_tokenizer(&tok);
    }
    free_gguf(&g);
    unmap(data, size);
    return vocabulary_only;
}

#ifndef TESTING
/* The vocabulary of a GGUF model file into the Tokenizer at tok (run.c's
   own checkpoints have none: tokenizer.bin, loaded after). */
static void own_vocabulary(Transformer *t, void *tok) {
    if (t->gguf) load_gguf_vocabulary(tok, t->gguf);
}

int main(int argc, char **argv) {
    platform_setup(&argc, &argv);
    Options o = parse_options(argc, argv);
    catch_interrupts(1);
#ifdef _OPENMP
    if (o.threads > 0) omp_set_num_threads(o.threads);
#else
    if (o.threads > 1) fprintf(stderr, "run: note: -T needs an OpenMP build (make runomp); running on one thread\n");
#endif
    char *prompt_text = o.prompt_file ? read_text_file(o.prompt_file) : NULL;
    if (prompt_text) o.prompt = prompt_text;
    JsonSchema *schema = schema_of_options(&o);
    o.schema = schema;
    char *tools_text = o.tools_file ? load_tools(&o) : NULL; /* checked before the model loads (11.2) */
    o.tools_json = tools_text;
    if (tokenize_vocabulary_file(&o)) {
        free(prompt_text);
        free(tools_text);
        return 0;
    }
    Transformer t;
    Tokenizer tok;
    /* a GGUF file's own vocabulary (-z overrides it) loads as the weights pack */
    load_checkpoint_while(&t, o.checkpoint, o.tokenizer ? NULL : own_vocabulary, &tok);
    limit_context(&t, o.ctx_size);
    const Config *p = &t.config;
    if (o.beams > p->vocab_size)
        usage_error("-b %d is more beams than the %d tokens of the vocabulary", o.beams, p->vocab_size);
    if (o.beams > 1 && o.sampling_flags)
        fprintf(stderr, "run: note: -t, -p and -s do not apply to beam search (-b %d)\n", o.beams);
    if (o.beams > 0 && (o.controls.top_k > 0 || o.controls.min_p > 0))
        fprintf(stderr, "run: note: --top-k and --min-p do not apply to beam search (-b %d)\n", o.beams);
    if (o.controls.top_k > p->vocab_size)
        usage_error("--top-k %d is more than the %d tokens of the vocabulary", o.controls.top_k, p->vocab_size);
    int positions = o.keep >= 0 ? run_positions(&o, p->seq_len) : resolve_steps(o.steps, p->seq_len);
    if (o.controls.min_new_tokens > positions)
        usage_error("--min-new-tokens %d is more than the %d positions to run (-n)", o.controls.min_new_tokens, positions);
    if (!t.gguf && !o.tokenizer) require_default_tokenizer();
    if (!t.gguf || o.tokenizer) load_tokenizer(&tok, o.tokenizer ? o.tokenizer : "tokenizer.bin", p->vocab_size);
    if (o.chat_template >= 0) tok.chat_template = o.chat_template;
    tok.reasoning = o.reasoning;
    Transformer draft;
    Speculator *spec = NULL;
    if (o.draft_file) {
        load_checkpoint(&draft, o.draft_file);
        limit_context(&draft, o.ctx_size);
        if (draft.config.vocab_size != p->vocab_size)
            die(EXIT_BAD_FILE, "%s: the draft's vocabulary has %d tokens, the model's %d", o.draft_file, draft.config.vocab_size,
                p->vocab_size);
    }
    if (o.draft_file || o.lookup) spec = speculator_new(o.lookup, o.draft_max, o.draft_file ? &draft : NULL);
    Engine e;
    memset(&e, 0, sizeof(e));
    int status = run_program(&e, &t, &tok, &o, (uint64_t)time(NULL), spec);
    engine_free(&e);
    speculator_free(spec);
    if (o.draft_file) free_transformer(&draft);
    free_run_state(&t.state);
    free_tokenizer(&tok);
    free_transformer(&t);
    free(prompt_text);
    free(tools_text);
    free_schema(schema);
    return interrupted() ? EXIT_INTERRUPTED : status;
}
#endif
