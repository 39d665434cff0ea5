/* One core, weights in cache: dsq's GGUF kernels (dsq_gguf_gemm, 1 thread) against the ggml
 * kernels llama.cpp runs for the same work on the same build of the CPU, called directly from
 * llama.cpp's libggml-cpu: Q4_K repacked 8 rows at a time (ggml_gemv / ggml_gemm_q4_K_8x8_q8_K, what
 * llama.cpp's AVX2 build does with every Q4_K matrix whose rows are a multiple of 8) and Q6_K row by
 * row (ggml_vec_dot_q6_K_q8_K: no repacked form on x86), x quantized to Q8_K inside the timing as
 * llama.cpp does per call. Random bytes (the work does not depend on them); the best of many calls,
 * so that a shared machine's load mostly falls outside it. Built and run by ggml_kernels_cpu.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*dsq_gemm_fn)(const uint8_t *, int, int64_t, int64_t, const float *, int64_t, float *, int);
typedef void (*gemv_fn)(int, float *, size_t, const void *, const void *, int, int);
typedef void (*vdot_fn)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*quant_fn)(const float *, void *, int64_t);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) { fprintf(stderr, "missing %s\n", name); exit(2); }
    return p;
}

static uint8_t *rnd(size_t n) {
    uint8_t *p = aligned_alloc(64, (n + 63) / 64 * 64);
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(rand() >> 7);
    return p;
}
/* fp16 scales kept small and finite at the given offsets of each block */
static void fix_f16(uint8_t *w, size_t nblocks, int bsize, const int *offs, int noffs) {
    for (size_t b = 0; b < nblocks; b++)
        for (int i = 0; i < noffs; i++) { w[b * bsize + offs[i]] = 0x00; w[b * bsize + offs[i] + 1] = 0x1c; }
}

#define BEST(expr, reps, out)                                                                   \
    do {                                                                                        \
        double best_ = 1e9;                                                                     \
        for (int r_ = 0; r_ < (reps); r_++) {                                                   \
            double t0_ = now();                                                                 \
            expr;                                                                               \
            double dt_ = now() - t0_;                                                           \
            if (dt_ < best_) best_ = dt_;                                                       \
        }                                                                                       \
        out = best_;                                                                            \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: dsq.so libggml-cpu.so N K M [reps [copies]]\n"); return 2; }
    void *hd = dlopen(argv[1], RTLD_NOW);
    if (!hd) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    void *hg = dlopen(argv[2], RTLD_NOW);
    if (!hg) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    const int N = atoi(argv[3]), K = atoi(argv[4]), M = atoi(argv[5]), reps = argc > 6 ? atoi(argv[6]) : 200;
    /* copies > 1: that many copies of each weight, a call on each in turn, so that every call reads
     * its weights from DRAM (as a decode step does) when copies x the weight exceed the caches */
    const int copies = argc > 7 ? atoi(argv[7]) : 1;
    const int nb = K / 256;
    dsq_gemm_fn dsq = (dsq_gemm_fn)sym(hd, "dsq_gguf_gemm");
    void (*cpu_init)(void) = (void (*)(void))sym(hg, "ggml_cpu_init");
    cpu_init();
    gemv_fn gv = (gemv_fn)sym(hg, "ggml_gemv_q4_K_8x8_q8_K"), gm = (gemv_fn)sym(hg, "ggml_gemm_q4_K_8x8_q8_K");
    vdot_fn vd6 = (vdot_fn)sym(hg, "ggml_vec_dot_q6_K_q8_K");
    quant_fn q8k = (quant_fn)sym(hg, "quantize_row_q8_K");
    quant_fn q8k4 = (quant_fn)sym(hg, "ggml_quantize_mat_q8_K_4x8");

    float *x = malloc(sizeof(float) * M * K), *y = malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    uint8_t *xq = rnd((size_t)M * nb * 1168 + 4096); /* Q8_K rows, or Q8_Kx4 groups of 4 rows */
    const size_t s4 = (size_t)N * nb * 144, s6 = (size_t)N * nb * 210;
    uint8_t *W4 = rnd(s4 * copies), *W6 = rnd(s6 * copies);
    const int o4[2] = {0, 2}, o6[1] = {208};
    fix_f16(W4, (size_t)N * nb * copies, 144, o4, 2);
    fix_f16(W6, (size_t)N * nb * copies, 210, o6, 1);
    uint8_t *W4x8 = rnd(s4 * copies); /* the repacked layout: 8 rows' blocks interleaved */
    for (size_t b = 0; b < (size_t)N / 8 * nb * copies; b++)
        for (int i = 0; i < 16; i++) { W4x8[b * 1152 + 2 * i] = 0x00; W4x8[b * 1152 + 2 * i + 1] = 0x1c; }
    int c4 = 0, c6 = 0, g4 = 0, g6 = 0; /* the copy each kernel's next call reads */
#define W(base, sz, c) ((base) + (sz) * (size_t)((c)++ % copies))

    double t_d4, t_g4, t_d6, t_g6;
    BEST(dsq(W(W4, s4, c4), 12, N, K, x, M, y, 1), reps, t_d4);
    BEST(dsq(W(W6, s6, c6), 14, N, K, x, M, y, 1), reps, t_d6);
    if (M == 1) {
        BEST((q8k(x, xq, K), gv(K, y, N, W(W4x8, s4, g4), xq, 1, N)), reps, t_g4);
        BEST({
            q8k(x, xq, K);
            const uint8_t *w6 = W(W6, s6, g6);
            for (int n = 0; n < N; n++) vd6(K, y + n, 0, w6 + (size_t)n * nb * 210, 0, xq, 0, 1);
        }, reps, t_g6);
    } else { /* M a multiple of 4: ggml's gemm takes x as Q8_Kx4 groups; Q6_K a row dot per pair */
        BEST({
            for (int m = 0; m < M; m += 4) q8k4(x + (size_t)m * K, xq + (size_t)m / 4 * nb * 1168, K);
            gm(K, y, N, W(W4x8, s4, g4), xq, M, N);
        }, reps, t_g4);
        BEST({
            const uint8_t *w6 = W(W6, s6, g6);
            for (int m = 0; m < M; m++) q8k(x + (size_t)m * K, xq + (size_t)m * nb * 292, K);
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++)
                    vd6(K, y + (size_t)m * N + n, 0, w6 + (size_t)n * nb * 210, 0, xq + (size_t)m * nb * 292, 0, 1);
        }, reps, t_g6);
    }
    const double b4 = (double)N * nb * 144, b6 = (double)N * nb * 210, ops = 2.0 * N * K * M;
    printf("Q4_K %dx%d M=%d: dsq %.1f us (%.1f GB/s, %.0f GOP/s), ggml %.1f us (%.1f GB/s, %.0f GOP/s): %.2fx\n", N, K, M,
           t_d4 * 1e6, b4 / t_d4 * 1e-9, ops / t_d4 * 1e-9, t_g4 * 1e6, b4 / t_g4 * 1e-9, ops / t_g4 * 1e-9, t_g4 / t_d4);
    printf("Q6_K %dx%d M=%d: dsq %.1f us (%.1f GB/s, %.0f GOP/s), ggml %.1f us (%.1f GB/s, %.0f GOP/s): %.2fx\n", N, K, M,
           t_d6 * 1e6, b6 / t_d6 * 1e-9, ops / t_d6 * 1e-9, t_g6 * 1e6, b6 / t_g6 * 1e-9, ops / t_g6 * 1e-9, t_g6 / t_d6);
    return 0;
}
