/* kvseal's native CPU kernels (x86-64, AVX2 + FMA + F16C), called through ctypes from kvseal/kernels/ops.py.
 *
 *  kvs_gemm            y (M, N) = x (M, K) @ W^T for W held as GGUF rows as stored (every type of kvs.h,
 *                      dequantized in registers by dequant.c, exactly as gguf-py does), float32 FMA.
 *  kvs_gemm_mat        the same for a matrix of row segments of different types (q|k|v), one result.
 *  kvs_dequant         W -> float32 (N, K), for large M where a dense GEMM library wins.
 *  kvs_dequant_rows    selected rows of W -> float32 (an embedding lookup).
 *  kvs_paged_decode    one query token per sequence against its own pages: K/V are read only through the
 *                      sequence's page table (never a gathered copy), with an online-free two-pass softmax.
 *
 * Threads: OpenMP. torch's CPU build ships libgomp.so.1 and loads it first, so these loops share torch's
 * thread pool instead of oversubscribing the cores with a second one.
 * Every function returns 0, or a negative code when its arguments are invalid (nothing is written then).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvs.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[r * ldo + c] = dot(w + r * K, x + c * K) for r < 4, c < 2 (K a multiple of 8) */
static inline void mk_4x2(const float *w, int64_t K, const float *x0, const float *x1, float *o, int64_t ldo) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const float *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k), v;
        v = _mm256_loadu_ps(w + k);  a00 = _mm256_fmadd_ps(v, xa, a00); a01 = _mm256_fmadd_ps(v, xb, a01);
        v = _mm256_loadu_ps(w1 + k); a10 = _mm256_fmadd_ps(v, xa, a10); a11 = _mm256_fmadd_ps(v, xb, a11);
        v = _mm256_loadu_ps(w2 + k); a20 = _mm256_fmadd_ps(v, xa, a20); a21 = _mm256_fmadd_ps(v, xb, a21);
        v = _mm256_loadu_ps(w3 + k); a30 = _mm256_fmadd_ps(v, xa, a30); a31 = _mm256_fmadd_ps(v, xb, a31);
    }
    o[0] = hsum(a00); o[1] = hsum(a01);
    o[ldo] = hsum(a10); o[ldo + 1] = hsum(a11);
    o[2 * ldo] = hsum(a20); o[2 * ldo + 1] = hsum(a21);
    o[3 * ldo] = hsum(a30); o[3 * ldo + 1] = hsum(a31);
}

static inline void mk_4x1(const float *w, int64_t K, const float *x0, float *o, int64_t ldo) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xa = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), xa, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xa, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xa, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xa, a3);
    }
    o[0] = hsum(a0); o[ldo] = hsum(a1); o[2 * ldo] = hsum(a2); o[3 * ldo] = hsum(a3);
}

#define TILE_N 16 /* rows of W dequantized at once: 16 x K floats (L2-sized), reused for every row of x */
/* y (M, N) = x (M, K) @ W^T, row m of y at y + m * ldy. W is read from memory and dequantized exactly once per
   call; each thread owns whole tiles of TILE_N output columns, so no two threads write the same element of y.
   Every element is one fixed-order sum (8 lanes, then hsum), whatever M is: a row's bits do not depend on the
   other rows of x. */
int kvs_gemm_ld(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t ldy) {
    int64_t rb = kvs_row_bytes(type, K);
    if (rb < 0 || N <= 0 || M <= 0 || ldy < N) return -1;
    int64_t ntiles = (N + TILE_N - 1) / TILE_N;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = (float *)aligned_alloc(64, ((size_t)TILE_N * K * sizeof(float) + 63) & ~(size_t)63);
        float tmp[8];
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntiles; t++) {
            if (!buf) continue;
            int64_t n0 = t * TILE_N, nr = N - n0 < TILE_N ? N - n0 : TILE_N;
            int64_t ngroups = (nr + 3) / 4;
            for (int64_t r = 0; r < ngroups * 4; r++)  /* padding rows repeat row n0; their results are dropped */
                kvs_dequant_row(type, w + (n0 + (r < nr ? r : 0)) * rb, K, buf + r * K);
            int64_t m = 0;
            for (; m + 1 < M; m += 2) {
                for (int64_t g = 0; g < ngroups; g++) {
                    int64_t rows = nr - 4 * g < 4 ? nr - 4 * g : 4;
                    mk_4x2(buf + 4 * g * K, K, x + m * K, x + (m + 1) * K, tmp, 2);
                    for (int64_t r = 0; r < rows; r++) {
                        y[m * ldy + n0 + 4 * g + r] = tmp[r * 2];
                        y[(m + 1) * ldy + n0 + 4 * g + r] = tmp[r * 2 + 1];
                    }
                }
            }
            if (m < M) {
                for (int64_t g = 0; g < ngroups; g++) {
                    int64_t rows = nr - 4 * g < 4 ? nr - 4 * g : 4;
                    mk_4x1(buf + 4 * g * K, K, x + m * K, tmp, 1);
                    for (int64_t r = 0; r < rows; r++) y[m * ldy + n0 + 4 * g + r] = tmp[r];
                }
            }
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

int kvs_gemm(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    return kvs_gemm_ld(type, w, N, K, x, M, y, N);
}

/* every segment into its own columns of y (M, rows of m): unfused (one pass per segment), no copy of a weight */
int kvs_gemm_mat(const kvs_mat *m, int64_t K, const float *x, int64_t M, float *y) {
    if (m->nseg < 1 || m->nseg > KVS_MAXSEG) return -1;
    const int64_t N = kvs_mat_rows(m);
    int64_t c0 = 0;
    for (int s = 0; s < m->nseg; c0 += m->rows[s], s++) {
        int rc = kvs_gemm_ld(m->type[s], m->data[s], m->rows[s], K, x, M, y + c0, N);
        if (rc) return rc;
    }
    return 0;
}

int kvs_dequant(int type, const uint8_t *w, int64_t N, int64_t K, float *out) {
    int64_t rb = kvs_row_bytes(type, K);
    if (rb < 0 || N <= 0) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) kvs_dequant_row(type, w + n * rb, K, out + n * K);
    return 0;
}

int kvs_dequant_rows(int type, const uint8_t *w, int64_t N, int64_t K, const int64_t *rows, int64_t R, float *out) {
    int64_t rb = kvs_row_bytes(type, K);
    if (rb < 0) return -1;
    for (int64_t i = 0; i < R; i++)
        if (rows[i] < 0 || rows[i] >= N) return -3;
    for (int64_t i = 0; i < R; i++) kvs_dequant_row(type, w + rows[i] * rb, K, out + i * K);
    return 0;
}

/* exp(x) for float32 lanes, Cephes' polynomial (relative error ~2e-7 on the range softmax uses). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 8 vectors of partial sums -> one vector of their 8 totals (lane i = sum of a[i]) */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
    __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
    /* c0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves), likewise c1 for keys 4..7 */
    __m256 lo = _mm256_permute2f128_ps(c0, c1, 0x20), hi = _mm256_permute2f128_ps(c0, c1, 0x31);
    return _mm256_add_ps(lo, hi);
}

/* scores s[t] = scale * dot(qj, key t) for the n (<= 8) keys at kp, kp + stride, ...; D = 8 * ND */
#define DEFINE_SCORES(ND)                                                                                    \
    static inline void scores8_##ND(const float *qj, const float *kp, int64_t stride, int n, float scale,     \
                                    float *s) {                                                               \
        __m256 a[8];                                                                                          \
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();                                               \
        for (int i = 0; i < ND; i++) {                                                                        \
            __m256 qv = _mm256_loadu_ps(qj + 8 * i);                                                          \
            for (int r = 0; r < 8; r++)                                                                       \
                a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp + (r < n ? r : 0) * stride + 8 * i), a[r]);     \
        }                                                                                                     \
        __m256 v = _mm256_mul_ps(reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]), _mm256_set1_ps(scale)); \
        if (n == 8) {                                                                                         \
            _mm256_storeu_ps(s, v);                                                                           \
        } else {                                                                                              \
            float tmp[8];                                                                                     \
            _mm256_storeu_ps(tmp, v);                                                                         \
            for (int r = 0; r < n; r++) s[r] = tmp[r];                                                        \
        }                                                                                                     \
    }                                                                                                         \
    /* o += sum_t w[t] * value t over the n values at vp, vp + stride, ... */                                 \
    static inline void accum_##ND(__m256 *o, const float *w, const float *vp, int64_t stride, int64_t n) {    \
        __m256 a[ND];                                                                                         \
        for (int i = 0; i < ND; i++) a[i] = o[i];                                                             \
        for (int64_t t = 0; t < n; t++) {                                                                     \
            __m256 wt = _mm256_set1_ps(w[t]);                                                                 \
            for (int i = 0; i < ND; i++) a[i] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vp + t * stride + 8 * i), a[i]); \
        }                                                                                                     \
        for (int i = 0; i < ND; i++) o[i] = a[i];                                                             \
    }
DEFINE_SCORES(4)
DEFINE_SCORES(8)
DEFINE_SCORES(16)

static inline void scores_any(int64_t nd, const float *qj, const float *kp, int64_t stride, int n, float scale,
                              float *s) {
    if (nd == 8) { scores8_8(qj, kp, stride, n, scale, s); return; }
    if (nd == 16) { scores8_16(qj, kp, stride, n, scale, s); return; }
    if (nd == 4) { scores8_4(qj, kp, stride, n, scale, s); return; }
    for (int r = 0; r < n; r++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < nd; i++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * i), _mm256_loadu_ps(kp + r * stride + 8 * i), acc);
        s[r] = hsum(acc) * scale;
    }
}

static inline void accum_any(int64_t nd, __m256 *o, const float *w, const float *vp, int64_t stride, int64_t n) {
    if (nd == 8) { accum_8(o, w, vp, stride, n); return; }
    if (nd == 16) { accum_16(o, w, vp, stride, n); return; }
    if (nd == 4) { accum_4(o, w, vp, stride, n); return; }
    for (int64_t t = 0; t < n; t++) {
        __m256 wt = _mm256_set1_ps(w[t]);
        for (int64_t i = 0; i < nd; i++) o[i] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vp + t * stride + 8 * i), o[i]);
    }
}

/* Decode attention over a paged KV pool: one query token per sequence.
 *   q       (B, H, D)                 this step's rotated queries
 *   kc, vc  (P, S, KVH, D)            one layer's pool
 *   pages   (B, max_pages) int64      each sequence's own page table (the only way a key is reached)
 *   kv_lens (B,) int64                keys 0..kv_len-1 of sequence b are read, nothing else
 *   out     (B, H, D)
 * Query head h reads kv head h / (H / KVH) (grouped-query attention). Arguments are checked before any read:
 * every page a sequence will touch must lie inside the pool (-3 otherwise), every kv_len inside its table.
 * Work item = (sequence, kv head): its G query heads score every key of the sequence page by page, softmax,
 * then sum the values page by page; keys and values of one page are contiguous rows KVH * D apart. */
int kvs_paged_decode(const float *q, const float *kc, const float *vc, int64_t P, const int64_t *pages,
                     int64_t max_pages, const int64_t *kv_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                     int64_t S, float scale, float *out) {
    if (D % 8 || D > 256 || KVH <= 0 || H % KVH || H / KVH > 64 || S <= 0 || B <= 0) return -1;
    int64_t maxlen = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t L = kv_lens[b];
        if (L < 1 || L > max_pages * S) return -2;
        for (int64_t i = 0; i < (L + S - 1) / S; i++)
            if (pages[b * max_pages + i] < 0 || pages[b * max_pages + i] >= P) return -3;
        if (L > maxlen) maxlen = L;
    }
    const int64_t G = H / KVH, nd = D / 8, stride = KVH * D;
    int failed = 0;
#pragma omp parallel
    {
        float *s = (float *)malloc((size_t)(G * (maxlen + 8)) * sizeof(float)); /* (G, L) scores -> weights */
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t bg = 0; bg < B * KVH; bg++) {
            if (!s) continue;
            const int64_t b = bg / KVH, g = bg % KVH, L = kv_lens[b], npages = (L + S - 1) / S;
            const int64_t *table = pages + b * max_pages;
            const float *qg = q + (b * H + g * G) * D;
            for (int64_t pi = 0; pi < npages; pi++) {
                const float *kp = kc + (table[pi] * S * KVH + g) * D;
                int64_t n = L - pi * S < S ? L - pi * S : S;
                for (int64_t t = 0; t < n; t += 8) {
                    int m = (int)(n - t < 8 ? n - t : 8);
                    for (int64_t j = 0; j < G; j++)
                        scores_any(nd, qg + j * D, kp + t * stride, stride, m, scale, s + j * L + pi * S + t);
                }
            }
            for (int64_t j = 0; j < G; j++) {
                float *sj = s + j * L;
                __m256 vmx = _mm256_set1_ps(-INFINITY);
                int64_t t = 0;
                for (; t + 8 <= L; t += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sj + t));
                float tmp[8], mx;
                _mm256_storeu_ps(tmp, vmx);
                mx = tmp[0];
                for (int r = 1; r < 8; r++) mx = tmp[r] > mx ? tmp[r] : mx;
                for (; t < L; t++) mx = sj[t] > mx ? sj[t] : mx;
                __m256 vm = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
                for (t = 0; t + 8 <= L; t += 8) {
                    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sj + t), vm));
                    _mm256_storeu_ps(sj + t, e);
                    vs = _mm256_add_ps(vs, e);
                }
                float sum = hsum(vs);
                for (; t < L; t++) {
                    sj[t] = expf(sj[t] - mx);
                    sum += sj[t];
                }
                __m256 o[32];
                for (int64_t i = 0; i < nd; i++) o[i] = _mm256_setzero_ps();
                for (int64_t pi = 0; pi < npages; pi++) {
                    int64_t n = L - pi * S < S ? L - pi * S : S;
                    accum_any(nd, o, sj + pi * S, vc + (table[pi] * S * KVH + g) * D, stride, n);
                }
                float *oj = out + (b * H + g * G + j) * D;
                __m256 vi = _mm256_set1_ps(1.0f / sum);
                for (int64_t i = 0; i < nd; i++) _mm256_storeu_ps(oj + 8 * i, _mm256_mul_ps(o[i], vi));
            }
        }
        free(s);
    }
    return failed ? -4 : 0;
}

/* ---- the small per-token ops of a layer, fused so one call replaces a chain of torch ops ---------------- */

/* out (T, E) = w * x / sqrt(mean(x^2) + eps), row by row (RMSNorm) */
int kvs_rmsnorm(const float *x, const float *w, int64_t T, int64_t E, float eps, float *out) {
    if (E % 8 || T < 0) return -1;
#pragma omp parallel for schedule(static) if (T * E > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * E;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < E; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)E + eps));
        for (int64_t i = 0; i < E; i += 8)
            _mm256_storeu_ps(out + t * E + i,
                             _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), r)));
    }
    return 0;
}

/* Rotate-half RoPE in place on the first NH heads of each row of x (rows `ld` floats apart, heads D apart):
   x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin rows (D,) taken at each token's position. */
int kvs_rope(float *x, int64_t T, int64_t ld, int64_t NH, int64_t D, const float *cos, const float *sin,
             const int64_t *pos, int64_t max_pos) {
    if (D % 2 || T < 0) return -1;
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -3;
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t h = 0; h < NH; h++) {
            float *x1 = x + t * ld + h * D, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
                _mm256_storeu_ps(x1 + i, _mm256_fmsub_ps(a, _mm256_loadu_ps(c + i), _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(x2 + i, _mm256_fmadd_ps(b, _mm256_loadu_ps(c + half + i),
                                                         _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
            }
            for (; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
    return 0;
}

/* out (T, I) = silu(gu[:, :I]) * gu[:, I:] for gu (T, 2I): SwiGLU's gate times up */
int kvs_silu_mul(const float *gu, int64_t T, int64_t I, float *out) {
    if (I % 8 || T < 0) return -1;
    const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (T * I > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 a = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), a))));
            _mm256_storeu_ps(out + t * I + i, _mm256_mul_ps(_mm256_mul_ps(a, sig), _mm256_loadu_ps(u + i)));
        }
    }
    return 0;
}

/* ---- one whole decode step of a Llama layer stack in one call (no Python between the ops) ------------- */

/* h (T, E), the residual stream of T single-token decode rows, is run through all L layers in place:
 * RMSNorm, q|k|v, RoPE, the new k/v written at slots[t] of layer l's pool (P pages of S tokens), paged decode
 * attention through each row's page table, o, residual, RMSNorm, gate|up, SwiGLU, down, residual. The same
 * calls, in the same order, as the Python native path: the result is bit for bit the same.
 * Every slot, page id, length and position is checked before the first write (-3 / -2 otherwise). */
int kvs_decode_forward(const kvs_layer *layers, int64_t L, int64_t E, int64_t I, int64_t H, int64_t KVH,
                       int64_t D, float eps, float scale, const float *cos, const float *sin, int64_t max_pos,
                       float *kpool, float *vpool, int64_t P, int64_t S, int64_t T, float *h, const int64_t *pos,
                       const int64_t *slots, const int64_t *pages, int64_t max_pages, const int64_t *kv_lens) {
    if (T <= 0 || L <= 0) return -1;
    for (int64_t l = 0; l < L; l++) /* every matrix has the rows its place in the layer needs */
        if (kvs_mat_rows(&layers[l].qkv) != H * D + 2 * KVH * D || kvs_mat_rows(&layers[l].o) != E ||
            kvs_mat_rows(&layers[l].gu) != 2 * I || kvs_mat_rows(&layers[l].down) != E)
            return -1;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= P * S || pos[t] < 0 || pos[t] >= max_pos) return -3;
        if (kv_lens[t] < 1 || kv_lens[t] > max_pages * S) return -2;
        for (int64_t i = 0; i < (kv_lens[t] + S - 1) / S; i++)
            if (pages[t * max_pages + i] < 0 || pages[t * max_pages + i] >= P) return -3;
    }
    const int64_t HD = H * D, KD = KVH * D, NQKV = HD + 2 * KD, layer_floats = P * S * KD;
    float *buf = (float *)malloc(sizeof(float) * (size_t)T * (size_t)(E + NQKV + HD + HD + E + 2 * I + I));
    if (!buf) return -4;
    float *x = buf, *qkv = x + T * E, *q = qkv + T * NQKV, *o = q + T * HD, *tmp = o + T * HD,
          *gu = tmp + T * E, *act = gu + T * 2 * I;
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const kvs_layer *ly = layers + l;
        float *kl = kpool + l * layer_floats, *vl = vpool + l * layer_floats;
        if ((rc = kvs_rmsnorm(h, ly->ln1, T, E, eps, x))) break;
        if ((rc = kvs_gemm_mat(&ly->qkv, E, x, T, qkv))) break;
        if (ly->b_qkv)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < NQKV; i++) qkv[t * NQKV + i] += ly->b_qkv[i];
        if ((rc = kvs_rope(qkv, T, NQKV, H + KVH, D, cos, sin, pos, max_pos))) break;
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * NQKV;
            memcpy(q + t * HD, row, sizeof(float) * HD);
            memcpy(kl + slots[t] * KD, row + HD, sizeof(float) * KD);
            memcpy(vl + slots[t] * KD, row + HD + KD, sizeof(float) * KD);
        }
        if ((rc = kvs_paged_decode(q, kl, vl, P, pages, max_pages, kv_lens, T, H, KVH, D, S, scale, o))) break;
        if ((rc = kvs_gemm_mat(&ly->o, HD, o, T, tmp))) break;
        for (int64_t i = 0; i < T * E; i++) h[i] += tmp[i];
        if ((rc = kvs_rmsnorm(h, ly->ln2, T, E, eps, x))) break;
        if ((rc = kvs_gemm_mat(&ly->gu, E, x, T, gu))) break;
        if ((rc = kvs_silu_mul(gu, T, I, act))) break;
        if ((rc = kvs_gemm_mat(&ly->down, I, act, T, tmp))) break;
        for (int64_t i = 0; i < T * E; i++) h[i] += tmp[i];
    }
    free(buf);
    return rc;
}

/* The calling thread's OpenMP team size (a per-thread setting): an engine stepping on a thread of its own takes
   torch's thread count with it (kernels/ops.py, match_torch_threads). */
void kvs_set_threads(int n) {
    if (n > 0) omp_set_num_threads(n);
}

int kvs_get_threads(void) { return omp_get_max_threads(); }
