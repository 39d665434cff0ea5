/* Standalone check of one build of dsq's C CPU kernels (cpu_<isa>.c) against plain scalar C written
 * here (dequantize block by block, then a double dot), without Python or torch: how the neon build
 * is tested on x86 (cross-compiled, run under qemu-aarch64: tests/test_kernels_neon_qemu.py), and
 * it runs natively for the generic, avx2 and avx512 builds too (a check of the harness itself).
 *
 *   cc -O2 -std=c11 -fopenmp-simd -pthread -Ikernels/csrc kernels/csrc/test_harness.c kernels/csrc/cpu_generic.c -lm
 *   ./a.out [seed]          checks every exported kernel; exit status 1 on any mismatch
 *   ./a.out bench [N K]     M = 1 timings per format (GB/s of weights read); no checks
 *
 * Inputs are deterministic (splitmix64 from the seed). GGUF blocks are random bytes with finite
 * normal fp16 scales (as tests/test_kernels_ref.py makes them); integer weights random codes,
 * zero points and small fp16 scales; FP8 every non-NaN e4m3 code. Each kernel runs at M = 1, 2, 4,
 * 5 (row dots and the tiled / blocked paths) on odd N and several K: as the build picks its path,
 * the GGUF kernels again with DSQ_INT8_PREFILL=1 (the x86 builds' integer tiles), then everything
 * with DSQ_NO_VNNI=1 DSQ_NO_DOTPROD=1 (the float row dots). An output is wrong when
 * |y - ref| > 1e-5 sqrt(max(K, 64) / 1024) sum_k |x_k w_k| (float32 rounding grows like sqrt(K); relative to
 * the summed terms, so a sum that cancels to ~0 does not fail a correct kernel), with x as the
 * kernel computes with it: the avx2 build's integer dots round it to int8 per 32 values, and the
 * reference rounds it the same way (x_as_computed); the outputs are poisoned with NaN before each
 * call. Also: dsq_gguf_rows bit for bit against the reference dequantization, x spread over 8
 * decades at M = 1 (error norm / reference norm < 1e-5), a non-finite x giving
 * non-finite outputs, FP8 codes exactly (x = unit vectors), FP8 NaN codes poisoning only their
 * row, and refused shapes. */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* the build's exports (gguf_cpu.inc, intq_cpu.inc) */
int dsq_gguf_gemm(const uint8_t *w, int qtype, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                  int nthreads);
int dsq_gguf_rows(const uint8_t *w, int qtype, int64_t K, const int64_t *ids, int64_t n_ids, float *out);
int dsq_int_gemm(const uint8_t *qw, const uint16_t *scales, const uint8_t *zeros, int bits, int64_t N, int64_t K,
                 int64_t G, const float *x, int64_t M, float *y, int nthreads);
int dsq_fp8_gemm(const uint8_t *w, const float *scale, int scale_kind, int64_t N, int64_t K, const float *x,
                 int64_t M, float *y, int nthreads);
const char *dsq_cpu_isa(void);

#define NTHREADS 2
static const int64_t BATCHES[] = {1, 2, 4, 5};
#define NBATCH ((int)(sizeof(BATCHES) / sizeof(BATCHES[0])))

/* --- random numbers ---------------------------------------------------------------------------- */
static uint64_t rng_state;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double unif(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); } /* [0, 1) */
static double normal(void) {
    const double u = unif(), v = unif();
    return sqrt(-2.0 * log(1.0 - u)) * cos(6.283185307179586 * v);
}
static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

/* --- fp16, written independently of the kernels ---------------------------------------------- */
static double h2d(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}
static uint16_t d2h(double v) { /* round to nearest even; finite |v| < 65520 */
    const uint16_t s = signbit(v) ? 0x8000 : 0;
    v = fabs(v);
    if (v < ldexp(1, -14)) return s | (uint16_t)nearbyint(ldexp(v, 24)); /* subnormal (or 2^-14) */
    int e;
    const double f = frexp(v, &e); /* v = f 2^e, f in [0.5, 1) */
    const uint32_t m = (uint32_t)nearbyint(ldexp(f, 11)); /* 1024..2048 */
    return s | (uint16_t)(((uint32_t)(e + 14) << 10) + m - 1024); /* m = 2048 carries into the exponent */
}
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* --- GGUF: reference dequantization (ggml's dequantize_row_*, float arithmetic in its order) ---- */
typedef struct { const char *name; int type, elems, bytes, nf16, f16[2]; } gfmt;
static const gfmt GFMTS[] = {
    {"Q4_0", 2, 32, 18, 1, {0}},      {"Q5_0", 6, 32, 22, 1, {0}},      {"Q8_0", 8, 32, 34, 1, {0}},
    {"Q4_K", 12, 256, 144, 2, {0, 2}}, {"Q5_K", 13, 256, 176, 2, {0, 2}}, {"Q6_K", 14, 256, 210, 1, {208}},
};
#define NGFMT 6
#define QK 256

static void k_scale_min(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static void ref_block(int type, const uint8_t *b, float *y) {
    switch (type) {
        case 2: { /* Q4_0 */
            const float d = (float)h2d(rd16(b));
            for (int j = 0; j < 16; j++) {
                y[j] = d * ((b[2 + j] & 0x0F) - 8);
                y[j + 16] = d * ((b[2 + j] >> 4) - 8);
            }
            break;
        }
        case 6: { /* Q5_0 */
            const float d = (float)h2d(rd16(b));
            const uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
            for (int j = 0; j < 16; j++) {
                const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                y[j] = d * (((b[6 + j] & 0x0F) | h0) - 16);
                y[j + 16] = d * (((b[6 + j] >> 4) | h1) - 16);
            }
            break;
        }
        case 8: { /* Q8_0 */
            const float d = (float)h2d(rd16(b));
            for (int j = 0; j < 32; j++) y[j] = d * (int8_t)b[2 + j];
            break;
        }
        case 12:
        case 13: { /* Q4_K, Q5_K */
            const int q5 = type == 13;
            const float d = (float)h2d(rd16(b)), dmin = (float)h2d(rd16(b + 2));
            const uint8_t *sc = b + 4, *qh = b + 16, *q = b + (q5 ? 48 : 16);
            int is = 0;
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0; j < QK; j += 64) {
                int s, m;
                k_scale_min(is, sc, &s, &m);
                const float d1 = d * s, m1 = dmin * m;
                k_scale_min(is + 1, sc, &s, &m);
                const float d2 = d * s, m2 = dmin * m;
                for (int l = 0; l < 32; l++)
                    *y++ = d1 * ((q[l] & 0xF) + (q5 && (qh[l] & u1) ? 16 : 0)) - m1;
                for (int l = 0; l < 32; l++)
                    *y++ = d2 * ((q[l] >> 4) + (q5 && (qh[l] & u2) ? 16 : 0)) - m2;
                q += 32;
                is += 2;
                u1 <<= 2;
                u2 <<= 2;
            }
            break;
        }
        default: { /* 14: Q6_K */
            const float d = (float)h2d(rd16(b + 208));
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int n = 0; n < 256; n += 128) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is + 0] * q1;
                    y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3;
                    y[l + 96] = d * sc[is + 6] * q4;
                }
                y += 128;
                ql += 64;
                qh += 32;
                sc += 8;
            }
        }
    }
}
/* --- bookkeeping ------------------------------------------------------------------------------ */
typedef struct { const char *name; long checks; double max_rel[2], max_ratio[2]; } stat_t; /* [M = 1, M > 1] */
static long n_checks = 0, n_fail = 0;

static void fail(const char *what) {
    if (n_fail++ < 20) fprintf(stderr, "MISMATCH %s\n", what);
}

/* The avx2 build's integer dots round x to int8 per 32 values (gguf_avx2_cpu.inc: every format at
 * M = 1; gguf_i8gemm_cpu.inc with DSQ_INT8_PREFILL=1: all but Q8_0 above, as the avx512 build does
 * from M = 4 with AVX512-VNNI); they are checked against x rounded the same way here
 * (kernels/gguf_ref.py round_x_q8), with the float tolerance. */
static int env_on(const char *name) {
    const char *e = getenv(name);
    return e && *e && *e != '0';
}
static int have_vnni(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}
static int int8_path(int type, int64_t M) {
    const int tiles = type != 8 && env_on("DSQ_INT8_PREFILL");
    if (env_on("DSQ_NO_VNNI")) return 0;
    if (!strcmp(dsq_cpu_isa(), "avx2")) return M == 1 || tiles;
    return !strcmp(dsq_cpu_isa(), "avx512") && tiles && M > 3 && have_vnni();
}
/* x (n values, n a multiple of 32 when int8) as the kernel computes with it: as it is, or per 32
 * values xq * sx with sx = max|x| / 127 and xq = x * (127 / max|x|) rounded half to even (0 where
 * 127 / max|x| overflows) */
static double *x_as_computed(const float *x, int64_t n, int int8) {
    double *o = (double *)xmalloc(sizeof(double) * (size_t)n);
    for (int64_t b = 0; b < n; b += 32) {
        const int64_t e = int8 ? b + 32 : n;
        float mx = 0.f;
        for (int64_t k = b; k < e; k++) mx = fabsf(x[k]) > mx ? fabsf(x[k]) : mx;
        const float r = 127.f / mx, inv = r <= 3.402823466e38f ? r : 0.f, sx = mx / 127.f;
        for (int64_t k = b; k < e; k++) {
            const float v = x[k] * inv;
            o[k] = int8 ? (double)nearbyintf(v) * (double)sx : (double)x[k];
        }
        if (!int8) break;
    }
    return o;
}

/* y (M, N) against x (M, K, as the kernel computes with it: x_as_computed) . w (N, K)^T in double;
 * the tolerance as at the top */
static void compare(stat_t *st, const char *ctx, const double *x, const float *w, const float *y, int64_t M,
                    int64_t N, int64_t K) {
    const double tol = 1e-5 * sqrt((double)(K < 64 ? 64 : K) / 1024.0);
    const int b = M > 1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double ref = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                const double t = x[m * K + k] * (double)w[n * K + k];
                ref += t;
                mag += fabs(t);
            }
            const double yv = y[m * N + n], err = fabs(yv - ref), rel = mag > 0 ? err / mag : err;
            n_checks++;
            st->checks++;
            if (!(err <= tol * mag || rel <= tol)) { /* NaN too */
                char msg[256];
                snprintf(msg, sizeof msg, "%s %s: y[%lld, %lld] = %.9g, reference %.9g (error %.3g of sum |x w|)",
                         st->name, ctx, (long long)m, (long long)n, yv, ref, rel);
                fail(msg);
                continue;
            }
            if (rel > st->max_rel[b]) st->max_rel[b] = rel;
            if (rel / tol > st->max_ratio[b]) st->max_ratio[b] = rel / tol;
        }
}

static void report(const stat_t *st, const char *path) {
    printf("  %-5s %-5s %6ld checks; max error / sum |x w|: M=1 %.2e (%.3f of the tolerance), M>1 %.2e (%.3f)\n",
           st->name, path, st->checks, st->max_rel[0], st->max_ratio[0], st->max_rel[1], st->max_ratio[1]);
}

static float *random_x(int64_t n) {
    float *x = (float *)xmalloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = (float)normal();
    return x;
}
static float *poisoned(int64_t n) {
    float *y = (float *)xmalloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) y[i] = NAN;
    return y;
}

/* --- GGUF ------------------------------------------------------------------------------------- */
static uint8_t *random_gguf(const gfmt *f, int64_t N, int64_t K) {
    const int64_t nb = N * (K / f->elems);
    uint8_t *w = (uint8_t *)xmalloc((size_t)(nb * f->bytes));
    for (int64_t i = 0; i < nb * f->bytes; i++) w[i] = (uint8_t)rnd();
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < f->nf16; i++) {
            const uint16_t h = d2h(normal());
            w[b * f->bytes + f->f16[i]] = (uint8_t)h;
            w[b * f->bytes + f->f16[i] + 1] = (uint8_t)(h >> 8);
        }
    return w;
}
static float *ref_rows(const gfmt *f, const uint8_t *w, int64_t N, int64_t K) {
    float *o = (float *)xmalloc(sizeof(float) * (size_t)(N * K));
    for (int64_t i = 0; i < N * (K / f->elems); i++) ref_block(f->type, w + i * f->bytes, o + i * f->elems);
    return o;
}

static void check_gguf(const gfmt *f, stat_t *st) {
    static const int64_t NS[] = {1, 7, 33, 65};
    static const int64_t K32[] = {32, 96, 160, 544, 4096}, K256[] = {256, 768, 1280, 4096};
    const int64_t *KS = f->elems == 32 ? K32 : K256;
    const int nk = f->elems == 32 ? 5 : 4;
    for (int in = 0; in < 4; in++)
        for (int ik = 0; ik < nk; ik++) {
            const int64_t N = NS[in], K = KS[ik];
            if (N * K > 33 * 4096) continue;
            uint8_t *w = random_gguf(f, N, K);
            float *wf = ref_rows(f, w, N, K);
            for (int ib = 0; ib < NBATCH; ib++) {
                const int64_t M = BATCHES[ib];
                float *x = random_x(M * K), *y = poisoned(M * N);
                char ctx[96];
                snprintf(ctx, sizeof ctx, "N=%lld K=%lld M=%lld", (long long)N, (long long)K, (long long)M);
                double *xd = x_as_computed(x, M * K, int8_path(f->type, M));
                if (dsq_gguf_gemm(w, f->type, N, K, x, M, y, ib % 2 ? 1 : NTHREADS)) fail(ctx);
                else compare(st, ctx, xd, wf, y, M, N, K);
                free(xd);
                free(x);
                free(y);
            }
            free(w);
            free(wf);
        }
}

/* M = 1 with x over 8 decades (the integer paths quantize x per 32 values), then a non-finite x */
static void check_gguf_spread(const gfmt *f, stat_t *st) {
    const int64_t N = 37, K = f->elems * (f->elems == 32 ? 23 : 5);
    uint8_t *w = random_gguf(f, N, K);
    float *wf = ref_rows(f, w, N, K), *x = random_x(K), *y = poisoned(N);
    for (int64_t k = 0; k < K; k++) x[k] *= (float)exp(18.0 * unif() - 9.0);
    if (dsq_gguf_gemm(w, f->type, N, K, x, 1, y, NTHREADS)) fail("spread x: refused");
    double e2 = 0, r2 = 0, *xd = x_as_computed(x, K, int8_path(f->type, 1));
    for (int64_t n = 0; n < N; n++) {
        double ref = 0;
        for (int64_t k = 0; k < K; k++) ref += xd[k] * wf[n * K + k];
        e2 += (y[n] - ref) * (y[n] - ref);
        r2 += ref * ref;
    }
    free(xd);
    n_checks++, st->checks++;
    if (!(sqrt(e2 / r2) < 1e-5)) {
        char msg[128];
        snprintf(msg, sizeof msg, "%s spread x: error norm %.3g of the reference's", f->name, sqrt(e2 / r2));
        fail(msg);
    }
    x[77] = INFINITY;
    for (int64_t n = 0; n < N; n++) y[n] = 0.f;
    dsq_gguf_gemm(w, f->type, N, K, x, 1, y, NTHREADS);
    for (int64_t n = 0; n < N; n++, n_checks++, st->checks++)
        if (isfinite(y[n])) {
            char msg[96];
            snprintf(msg, sizeof msg, "%s: x with an inf gave a finite y[%lld]", f->name, (long long)n);
            fail(msg);
            break;
        }
    free(w), free(wf), free(x), free(y);
}

static void check_gguf_rows(const gfmt *f, stat_t *st) {
    const int64_t N = 50, K = 512, ids[] = {3, 49, 0, 7, 7, 12};
    uint8_t *w = random_gguf(f, N, K);
    float *wf = ref_rows(f, w, N, K), *o = poisoned(6 * K);
    if (dsq_gguf_rows(w, f->type, K, ids, 6, o)) fail("dsq_gguf_rows refused");
    for (int i = 0; i < 6; i++, n_checks++, st->checks++)
        if (memcmp(o + i * K, wf + ids[i] * K, sizeof(float) * K)) {
            char msg[96];
            snprintf(msg, sizeof msg, "%s: dsq_gguf_rows row %lld differs from the reference", f->name,
                     (long long)ids[i]);
            fail(msg);
        }
    free(w), free(wf), free(o);
}

/* --- dsq's integer layout --------------------------------------------------------------------- */
static void check_int(int bits, stat_t *st) {
    /* (N, K, g): groups of 32 / 64 / 128, per channel, unit tails, tiny groups, odd groups (8 bits) */
    static const int64_t S[][3] = {{1, 256, 128}, {7, 384, 128}, {33, 96, 32},  {65, 640, 64}, {7, 74, 74},
                                   {33, 1000, 1000}, {7, 120, 40}, {33, 64, 2}, {1, 96, 96},  {17, 4096, 128},
                                   {9, 200, 8},   {5, 75, 15},   {3, 7, 7}};
    for (size_t si = 0; si < sizeof(S) / sizeof(S[0]); si++) {
        const int64_t N = S[si][0], K = S[si][1], g = S[si][2], G = K / g;
        if (bits == 4 && g % 2) continue;
        const int64_t rb = bits == 4 ? K / 2 : K;
        uint8_t *qw = (uint8_t *)xmalloc((size_t)(N * rb)), *z = (uint8_t *)xmalloc((size_t)(N * G));
        uint16_t *sc = (uint16_t *)xmalloc(sizeof(uint16_t) * (size_t)(N * G));
        float *wf = (float *)xmalloc(sizeof(float) * (size_t)(N * K));
        for (int64_t i = 0; i < N * G; i++) {
            sc[i] = d2h(unif() * 0.02 + 1e-3);
            z[i] = (uint8_t)(rnd() & ((1u << bits) - 1));
        }
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++) {
                const int q = (int)(rnd() & ((1u << bits) - 1));
                if (bits == 8) qw[n * rb + k] = (uint8_t)q;
                else if (k % 2 == 0) qw[n * rb + k / 2] = (uint8_t)q;
                else qw[n * rb + k / 2] |= (uint8_t)(q << 4);
                const int64_t j = n * G + k / g;
                wf[n * K + k] = (float)h2d(sc[j]) * ((float)q - (float)z[j]);
            }
        for (int ib = 0; ib < NBATCH; ib++) {
            const int64_t M = BATCHES[ib];
            float *x = random_x(M * K), *y = poisoned(M * N);
            char ctx[96];
            snprintf(ctx, sizeof ctx, "N=%lld K=%lld g=%lld M=%lld", (long long)N, (long long)K, (long long)g,
                     (long long)M);
            double *xd = x_as_computed(x, M * K, 0);
            if (dsq_int_gemm(qw, sc, z, bits, N, K, G, x, M, y, ib % 2 ? 1 : NTHREADS)) fail(ctx);
            else compare(st, ctx, xd, wf, y, M, N, K);
            free(x), free(y), free(xd);
        }
        free(qw), free(z), free(sc), free(wf);
    }
}

/* --- FP8 e4m3fn ------------------------------------------------------------------------------- */
static double e4m3(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    const double v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return (c & 0x80) ? -v : v;
}
static uint8_t random_fp8_code(void) {
    for (;;) {
        const uint8_t c = (uint8_t)rnd();
        if ((c & 0x7F) != 0x7F) return c;
    }
}

static void check_fp8(int kind, stat_t *st) {
    static const int64_t S[][2] = {{1, 200}, {7, 300}, {33, 129}, {131, 257}, {129, 1000}, {7, 33}, {33, 4096},
                                   {3, 31},  {5, 1}};
    for (size_t si = 0; si < sizeof(S) / sizeof(S[0]); si++) {
        const int64_t N = S[si][0], K = S[si][1], nbk = (K + 127) / 128;
        const int64_t ns = kind == 0 ? 1 : kind == 1 ? N : ((N + 127) / 128) * nbk;
        uint8_t *w = (uint8_t *)xmalloc((size_t)(N * K));
        float *s = (float *)xmalloc(sizeof(float) * (size_t)ns), *wf = (float *)xmalloc(sizeof(float) * (size_t)(N * K));
        for (int64_t i = 0; i < ns; i++) s[i] = (float)(unif() + 0.01);
        for (int64_t n = 0; n < N; n++)
            for (int64_t k = 0; k < K; k++) {
                w[n * K + k] = random_fp8_code();
                const float sv = kind == 0 ? s[0] : kind == 1 ? s[n] : s[(n / 128) * nbk + k / 128];
                wf[n * K + k] = (float)e4m3(w[n * K + k]) * sv;
            }
        for (int ib = 0; ib < NBATCH; ib++) {
            const int64_t M = BATCHES[ib];
            float *x = random_x(M * K), *y = poisoned(M * N);
            char ctx[96];
            snprintf(ctx, sizeof ctx, "kind=%d N=%lld K=%lld M=%lld", kind, (long long)N, (long long)K, (long long)M);
            double *xd = x_as_computed(x, M * K, 0);
            if (dsq_fp8_gemm(w, s, kind, N, K, x, M, y, ib % 2 ? 1 : NTHREADS)) fail(ctx);
            else compare(st, ctx, xd, wf, y, M, N, K);
            free(x), free(y), free(xd);
        }
        free(w), free(s), free(wf);
    }
}

/* every code decodes exactly (x = unit vectors, M = 4: the row dots; M = 128: the tiled path), and
 * a NaN code makes its row NaN and leaves the other alone */
static void check_fp8_codes(stat_t *st) {
    uint8_t w[256];
    for (int c = 0; c < 256; c++) w[c] = (c & 0x7F) == 0x7F ? 0x3C : (uint8_t)c;
    float *eye = (float *)xmalloc(sizeof(float) * 128 * 128), y[2 * 128];
    for (int i = 0; i < 128 * 128; i++) eye[i] = i % 129 == 0 ? 1.f : 0.f;
    const float one = 1.f;
    for (int m0 = 0; m0 < 128; m0 += 4) {
        dsq_fp8_gemm(w, &one, 0, 2, 128, eye + m0 * 128, 4, y, NTHREADS);
        for (int m = 0; m < 4; m++)
            for (int n = 0; n < 2; n++, n_checks++, st->checks++)
                if (y[m * 2 + n] != (float)e4m3(w[n * 128 + m0 + m])) fail("FP8 code not exact (row dots)");
    }
    dsq_fp8_gemm(w, &one, 0, 2, 128, eye, 128, y, NTHREADS);
    for (int m = 0; m < 128; m++)
        for (int n = 0; n < 2; n++, n_checks++, st->checks++)
            if (y[m * 2 + n] != (float)e4m3(w[n * 128 + m])) fail("FP8 code not exact (tiled)");
    static const int64_t MS[] = {1, 3, 5, 16};
    for (int mi = 0; mi < 4; mi++)
        for (int n = 0; n < 2; n++) {
            uint8_t bad[256];
            memcpy(bad, w, 256);
            bad[n * 128 + (n ? 127 : 5)] = n ? 0xFF : 0x7F;
            float *x = random_x(MS[mi] * 128), *yy = poisoned(MS[mi] * 2);
            dsq_fp8_gemm(bad, &one, 0, 2, 128, x, MS[mi], yy, NTHREADS);
            for (int64_t m = 0; m < MS[mi]; m++, n_checks++, st->checks++)
                if (!isnan(yy[m * 2 + n]) || !isfinite(yy[m * 2 + 1 - n])) fail("FP8 NaN code: wrong rows");
            free(x), free(yy);
        }
    free(eye);
}

static void check_refusals(void) {
    uint8_t w[4 * 34] = {0};
    float x[2 * 64] = {0}, y[8];
    const uint16_t sc[4] = {0};
    const int64_t id = 0;
    struct { int rc; const char *what; } c[] = {
        {dsq_gguf_gemm(w, 8, 4, 48, x, 1, y, 1), "Q8_0 with K = 48"},
        {dsq_gguf_gemm(w, 3, 4, 32, x, 1, y, 1), "an unknown GGUF type"},
        {dsq_gguf_rows(w, 12, 128, &id, 1, y), "Q4_K rows of 128"},
        {dsq_int_gemm(w, sc, w, 3, 4, 64, 2, x, 1, y, 1), "3 bits"},
        {dsq_int_gemm(w, sc, w, 4, 4, 10, 2, x, 1, y, 1), "4 bits in groups of 5"},
        {dsq_int_gemm(w, sc, w, 8, 4, 64, 3, x, 1, y, 1), "3 groups of 64"},
        {dsq_fp8_gemm(w, (const float *)x, 3, 4, 64, x, 1, y, 1), "scale kind 3"},
    };
    for (size_t i = 0; i < sizeof(c) / sizeof(c[0]); i++, n_checks++)
        if (c[i].rc != -1) {
            char msg[96];
            snprintf(msg, sizeof msg, "not refused: %s", c[i].what);
            fail(msg);
        }
    n_checks++;
    if (dsq_int_gemm(w, sc, w, 8, 0, 64, 2, x, 1, y, 1) || dsq_fp8_gemm(w, (const float *)x, 0, 0, 64, x, 1, y, 1))
        fail("N = 0 refused");
}

/* --- timings ----------------------------------------------------------------------------------- */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void bench(int64_t N, int64_t K, int nthreads) {
    printf("M = 1, N = %lld, K = %lld, %d threads: GB/s of weights read (best of 5)\n", (long long)N, (long long)K,
           nthreads);
    float *x = random_x(K), *y = poisoned(N);
    for (int i = 0; i < NGFMT; i++) {
        const gfmt *f = &GFMTS[i];
        uint8_t *w = random_gguf(f, N, K);
        double best = 1e30;
        for (int r = 0; r < 6; r++) {
            const double t0 = now();
            dsq_gguf_gemm(w, f->type, N, K, x, 1, y, nthreads);
            if (r) best = fmin(best, now() - t0);
        }
        printf("  %-5s %7.2f\n", f->name, (double)N * (K / f->elems) * f->bytes / best * 1e-9);
        free(w);
    }
    for (int bits = 4; bits <= 8; bits += 4) {
        const int64_t G = K / 128, rb = bits == 4 ? K / 2 : K;
        uint8_t *qw = (uint8_t *)xmalloc((size_t)(N * rb)), *z = (uint8_t *)xmalloc((size_t)(N * G));
        uint16_t *sc = (uint16_t *)xmalloc(sizeof(uint16_t) * (size_t)(N * G));
        for (int64_t i = 0; i < N * rb; i++) qw[i] = (uint8_t)rnd();
        for (int64_t i = 0; i < N * G; i++) sc[i] = d2h(0.01), z[i] = 8;
        double best = 1e30;
        for (int r = 0; r < 6; r++) {
            const double t0 = now();
            dsq_int_gemm(qw, sc, z, bits, N, K, G, x, 1, y, nthreads);
            if (r) best = fmin(best, now() - t0);
        }
        printf("  int%d  %7.2f\n", bits, (double)N * (rb + 3 * G) / best * 1e-9);
        free(qw), free(z), free(sc);
    }
    uint8_t *w = (uint8_t *)xmalloc((size_t)(N * K));
    for (int64_t i = 0; i < N * K; i++) w[i] = random_fp8_code();
    const float s = 0.5f;
    double best = 1e30;
    for (int r = 0; r < 6; r++) {
        const double t0 = now();
        dsq_fp8_gemm(w, &s, 0, N, K, x, 1, y, nthreads);
        if (r) best = fmin(best, now() - t0);
    }
    printf("  fp8   %7.2f\n", (double)N * K / best * 1e-9);
    free(w), free(x), free(y);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "bench")) {
        rng_state = 1;
        bench(argc > 3 ? atoll(argv[2]) : 4096, argc > 3 ? atoll(argv[3]) : 4096, argc > 4 ? atoi(argv[4]) : 1);
        return 0;
    }
    const uint64_t seed = argc > 1 ? strtoull(argv[1], NULL, 0) : 20240601;
    printf("harness %s: seed %llu\n", dsq_cpu_isa(), (unsigned long long)seed);
    /* the build's own choice of path; with the avx2 build's integer tiles at M > 1 (GGUF only);
     * the float row dots and tiles */
    static const char *PATHS[] = {"auto", "int8", "float"};
    for (int pass = 0; pass < 3; pass++) {
        const char *path = PATHS[pass];
        if (pass == 1) setenv("DSQ_INT8_PREFILL", "1", 1);
        if (pass == 2) unsetenv("DSQ_INT8_PREFILL"), setenv("DSQ_NO_VNNI", "1", 1), setenv("DSQ_NO_DOTPROD", "1", 1);
        rng_state = seed + (uint64_t)pass;
        for (int i = 0; i < NGFMT; i++) {
            stat_t st = {GFMTS[i].name, 0, {0, 0}, {0, 0}};
            check_gguf(&GFMTS[i], &st);
            check_gguf_spread(&GFMTS[i], &st);
            if (!pass) check_gguf_rows(&GFMTS[i], &st);
            report(&st, path);
        }
        if (pass == 1) continue;
        for (int bits = 4; bits <= 8; bits += 4) {
            stat_t st = {bits == 4 ? "int4" : "int8", 0, {0, 0}, {0, 0}};
            check_int(bits, &st);
            report(&st, path);
        }
        stat_t st = {"fp8", 0, {0, 0}, {0, 0}};
        for (int kind = 0; kind < 3; kind++) check_fp8(kind, &st);
        if (!pass) check_fp8_codes(&st);
        report(&st, path);
    }
    check_refusals();
    if (n_fail) {
        printf("harness %s: %ld of %ld checks FAILED\n", dsq_cpu_isa(), n_fail, n_checks);
        return 1;
    }
    printf("harness %s: %ld checks passed\n", dsq_cpu_isa(), n_checks);
    return 0;
}
