/* bandwidth.c - the machine's streaming read bandwidth, the ceiling for
   decoding (every weight is read once per token).

   Sums a buffer much larger than the last-level cache with T threads, each
   reading a contiguous slice, and prints the best of several passes:
     threads T: X GB/s
   Build: cc -O3 -march=native -fopenmp bandwidth.c -o bandwidth
   Usage: bandwidth [MiB] [threads...]   (default 1024 MiB, 1 and 2 threads) */
#define _DEFAULT_SOURCE /* madvise */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* Sum of 64-bit words: independent accumulators keep it memory-bound. */
static uint64_t sum_words(const uint64_t *p, size_t n) {
    uint64_t a[8] = {0};
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) a[k] += p[i + k];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    size_t n = mib * 1024 * 1024 / sizeof(uint64_t);
    uint64_t *buf = aligned_alloc(2 << 20, n * sizeof(uint64_t));
    if (!buf) { fprintf(stderr, "bandwidth: out of memory\n"); return 1; }
    madvise(buf, n * sizeof(uint64_t), MADV_HUGEPAGE);
    memset(buf, 1, n * sizeof(uint64_t));
    int counts[16] = {1, 2}, n_counts = 2;
    if (argc > 2) {
        n_counts = 0;
        for (int i = 2; i < argc && n_counts < 16; i++) counts[n_counts++] = atoi(argv[i]);
    }
    volatile uint64_t sink = 0;
    for (int c = 0; c < n_counts; c++) {
        int threads = counts[c];
        double best = 0;
        for (int pass = 0; pass < 7; pass++) {
            uint64_t total = 0;
            double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
            {
                int t = omp_get_thread_num(), nt = omp_get_num_threads();
                size_t lo = n / nt * t, hi = t == nt - 1 ? n : n / nt * (t + 1);
                total += sum_words(buf + lo, hi - lo);
            }
            double gbs = n * sizeof(uint64_t) / (omp_get_wtime() - start) / 1e9;
            sink += total;
            if (gbs > best) best = gbs;
        }
        printf("threads %d: %.1f GB/s\n", threads, best);
    }
    free(buf);
    return sink == 42; /* keeps the sums alive */
}
