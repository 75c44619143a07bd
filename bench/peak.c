/* The machine's peak float32 multiply-add rate, and the rate of run.c's
   matmul kernels on many rows (bench/bench.py runs it; built like ./runomp).

   Peak: every thread runs 12 independent chains of vector multiply-adds
   (enough to cover the latency of two FMA units), best of 20 tries.
   Matmul: out (64, rows) = x (64, cols) @ W^T for the matrices of a
   stories110M layer (768 x 768, 2048 x 768, 768 x 2048), float32 and int8
   (group size 64; VNNI builds pack it as the loader does), the fastest of
   30 calls each. Prints, per thread count,
     threads T: peak P GFLOP/s, f32 F GFLOP/s, int8 Q GOP/s
   (a multiply-add counts as 2). */
#define TESTING
#pragma GCC diagnostic ignored "-Wunused-function"
#include "../run.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double peak(int threads) {
#ifdef SIMD_WIDTH
    enum { CHAINS = 12, STEPS = 1000000 };
    double best = 0;
    for (int try = 0; try < 20; try++) {
        double t0 = now();
        float sink = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(+ : sink)
#endif
        {
            vfloat a[CHAINS], m = vf_set(0.999999f), c = vf_set(1e-7f);
            for (int k = 0; k < CHAINS; k++) a[k] = vf_set(1.0f + k);
            for (int s = 0; s < STEPS; s++)
                for (int k = 0; k < CHAINS; k++) a[k] = vf_fma(a[k], m, c);
            for (int k = 0; k < CHAINS; k++) sink += vf_sum(a[k]);
        }
        double rate = 2.0 * SIMD_WIDTH * CHAINS * STEPS * threads / (now() - t0) / 1e9;
        if (rate > best && sink != 0) best = rate;
    }
    return best;
#else
    (void)threads;
    return 0;
#endif
}

static double matmul_rate(int gs) {
    const int shapes[3][2] = {{768, 768}, {2048, 768}, {768, 2048}}, n = 64;
    double flops = 0, seconds = 0;
    for (int s = 0; s < 3; s++) {
        int rows = shapes[s][0], cols = shapes[s][1];
        float *w = xcalloc((size_t)rows * cols, sizeof(float)), *x = xcalloc((size_t)n * cols, sizeof(float));
        float *out = xcalloc((size_t)n * rows, sizeof(float));
        int8_t *q = xcalloc((size_t)rows * cols, 1);
        for (size_t i = 0; i < (size_t)rows * cols; i++) { w[i] = (float)(i % 13) - 6; q[i] = (int8_t)(i % 251 - 125); }
        for (size_t i = 0; i < (size_t)n * cols; i++) x[i] = (float)(i % 7) - 3;
        /* int8: the float array doubles as the scales; packed as at load where this build packs */
        Matrix m = {.w = gs ? NULL : w, .q = gs ? q : NULL, .scales = gs ? (const char *)w : NULL, .rows = rows, .cols = cols, .group_size = gs};
        size_t packed = matrix_packed_bytes(&m);
        void *packing = packed ? alloc_pages(packed, "weights", 0) : NULL;
        Matrix *one = &m;
        if (packing) pack_matrices(&one, 1, packing, 0, NULL, NULL, NULL, NULL);
        double best = 1e9;
        for (int k = 0; k < 30; k++) {
            double t0 = now();
            matmul(out, x, &m, n);
            if (now() - t0 < best) best = now() - t0;
        }
        flops += 2.0 * rows * cols * n;
        seconds += best;
        if (packing) free_pages(packing, packed);
        free(w); free(x); free(out); free(q);
    }
    return flops / seconds / 1e9;
}

int main(void) {
    for (int threads = 1; threads <= 2; threads++) {
#ifdef _OPENMP
        omp_set_num_threads(threads);
#endif
        printf("threads %d: peak %.1f GFLOP/s, f32 %.1f GFLOP/s, int8 %.1f GOP/s\n", threads, peak(threads), matmul_rate(0), matmul_rate(64));
    }
    return 0;
}
