/* Paged attention for every row of a step, prompt chunks and decode tokens alike, in one call.
 *
 *  kvs_paged_attention  q (T, H, D) float32 against pools of float32 or bfloat16 pages, read in place only
 *                       through each span's own page table; out (T, H, D) float32.
 *  kvs_write_kv         this step's new keys and values into their slots (the same layouts, either dtype).
 *
 * Page layouts (the fast arithmetic's "kt" layout): a key page is (KVH, D, S), so the 16 keys of a block at
 * one input d are 16 contiguous values (no transpose at read time); a value page is (S, KVH, D) as usual.
 * S is a multiple of 16.
 *
 * A span is one sequence's rows in this step: rows r0..r0+n-1 at positions pos0..pos0+n-1; row i sees keys
 * 0..pos0+i (causal). Keys are visited in blocks of 16 positions from position 0, and every row runs the same
 * float operations in the same order whatever its span's length, its chunk boundaries, the rows beside it or
 * the instruction set (plain C, fmaf and no reassociation: -std=c11 turns fp contraction off):
 *   per group of 64 positions (4 blocks of 16):
 *     s_t = (q[0] k_t[0] + q[1] k_t[1] + ... + q[D-1] k_t[D-1], one fused chain in d order) * scale;
 *     m' = max(m, max of the row's valid s_t); a = exp(m - m'); p_t = exp(s_t - m') for valid t, else 0;
 *     l = l * a + ((sum16(p, block 0) + sum16(block 1)) + (sum16(block 2) + sum16(block 3))), where sum16 is
 *         a fixed tree (lane i + lane i+8, then +4, +2, +1) and a block the row does not reach adds 0;
 *     o = o * a, then o += p_t v_t for each valid t, blocks in order, t in order
 *   out = o / l
 * so a prompt's attention does not depend on how it was chunked or whether a prefix came from the cache, nor
 * a decode token's on the batch (the batch invariance of the fast arithmetic). A work item is (span, kv head,
 * tile of 16 rows): each block of keys is read once for every query head of the group in the tile.
 * Every page id a span touches and every row range is checked before the first read (-3 / -2 otherwise).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KB 16   /* key positions per block (one vector of scores) */
#define GB 4    /* blocks per online-softmax step (64 positions) */
#define ROWS 16 /* rows of a span per work item */
#define MAXD 256

/* exp(x), Cephes' polynomial as in cpu_kernels.c, written per lane so every instruction set computes the same */
static inline float exp_poly(float x) {
    x = fminf(fmaxf(x, -87.3365447504f), 88.3762626647949f);
    float fx = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    x = fmaf(-fx, 0.693359375f, x);
    x = fmaf(-fx, -2.12194440e-4f, x);
    float y = 1.9875691500e-4f;
    y = fmaf(y, x, 1.3981999507e-3f);
    y = fmaf(y, x, 8.3334519073e-3f);
    y = fmaf(y, x, 4.1665795894e-2f);
    y = fmaf(y, x, 1.6666665459e-1f);
    y = fmaf(y, x, 5.0000001201e-1f);
    y = fmaf(y, x * x, x + 1.0f);
    union { uint32_t u; float f; } e = {.u = (uint32_t)((int32_t)fx + 127) << 23};
    return y * e.f;
}

typedef struct {
    const float *q;
    const void *kc, *vc;
    int bf16;
    int64_t H, KVH, D, S;
    float scale;
    float *out;
} attn_args;

/* Scores of NJ query vectors against NB blocks of 16 keys (blocks b0 .. b0 + NB - 1 of the group): each s_t is
   one fused chain over d in order (the canonical order); NJ x NB independent chains keep the fma units busy,
   each broadcast of q[d] serves NB blocks and each load of 16 keys NJ queries. */
#define SCORE(P, NJ, NB)                                                                                        \
    do {                                                                                                        \
        P##_v c[NJ][NB];                                                                                        \
        for (int jj = 0; jj < NJ; jj++)                                                                         \
            for (int b = 0; b < NB; b++) c[jj][b] = P##_zero();                                                 \
        for (int64_t d = 0; d < D; d++) {                                                                       \
            P##_v kd[NB];                                                                                       \
            for (int b = 0; b < NB; b++) kd[b] = P##_loadkv(a->kc, a->bf16, kbase[b0 + b] + d * S);             \
            for (int jj = 0; jj < NJ; jj++) {                                                                   \
                const P##_v qd = P##_set1(qv[j0 + jj][d]);                                                      \
                for (int b = 0; b < NB; b++) c[jj][b] = P##_fma(qd, kd[b], c[jj][b]);                           \
            }                                                                                                   \
        }                                                                                                       \
        for (int jj = 0; jj < NJ; jj++)                                                                         \
            for (int b = 0; b < NB; b++) sv[jj][b0 + b] = c[jj][b];                                             \
    } while (0)
#define SCORE_NB(P, NJ)                                                                                         \
    do {                                                                                                        \
        for (int64_t b0 = 0; b0 < ng; b0 += NB) {                                                               \
            switch (ng - b0 < NB ? ng - b0 : NB) {                                                              \
                case 1: SCORE(P, NJ, 1); break;                                                                 \
                case 2: SCORE(P, NJ, 2); break;                                                                 \
                case 3: SCORE(P, NJ, (NB > 2 ? 3 : 2)); break;                                                  \
                default: SCORE(P, NJ, NB); break;                                                               \
            }                                                                                                   \
        }                                                                                                       \
    } while (0)

/* o = o * alpha + p_0 v_0 + ... + p_15 v_15 over block b for NQ queries whose rows see all of it: each value
   row (4 vectors of 16 lanes at c) is loaded once for all of them */
#define PV_FULL(P, NQ)                                                                                          \
    do {                                                                                                        \
        P##_v x[NQ][4];                                                                                         \
        for (int jj = 0; jj < NQ; jj++)                                                                         \
            for (int u = 0; u < 4; u++) x[jj][u] = P##_load(acc + (j0 + jj) * D + 16 * (c + u));                 \
        for (int t = 0; t < KB; t++) {                                                                          \
            P##_v vv[4];                                                                                        \
            for (int u = 0; u < 4; u++) vv[u] = P##_loadkv(a->vc, a->bf16, vbase[b] + t * KVH * D + 16 * (c + u)); \
            for (int jj = 0; jj < NQ; jj++) {                                                                   \
                const P##_v pt = P##_set1(pw[jj][b][t]);                                                        \
                for (int u = 0; u < 4; u++) x[jj][u] = P##_fma(pt, vv[u], x[jj][u]);                            \
            }                                                                                                   \
        }                                                                                                       \
        for (int jj = 0; jj < NQ; jj++)                                                                         \
            for (int u = 0; u < 4; u++) P##_store(acc + (j0 + jj) * D + 16 * (c + u), x[jj][u]);                \
    } while (0)

/* The tile body, instantiated once per instruction set over a 16-lane float vector type P##_v, with JBMAX_##P
   queries and NBMAX_##P key blocks per scoring pass (register budget; the results do not depend on them).
   Rows [i0, i1) of a span (row r0 + i at position pos0 + i), kv head g, pages `table`. Keys are read in place
   from the key pool's (KVH, D, S) pages: the 16 keys of a block at input d are 16 contiguous values. Values
   are rows of the value pool's (S, KVH, D) pages. acc: (ROWS * G, D) scratch for the running numerators.
   The online softmax steps once per group of GB blocks (64 positions), the canonical grouping. */
#define DEFINE_ATTEND(P)                                                                                        \
    static void P##_attend_tile(const attn_args *a, int64_t r0, int64_t pos0, int64_t i0, int64_t i1,          \
                                int64_t g, const int64_t *table, float *acc) {                                  \
        enum { JB = JBMAX_##P, NB = NBMAX_##P };                                                                \
        const int64_t G = a->H / a->KVH, D = a->D, S = a->S, KVH = a->KVH, nc = D / 16;                         \
        const int64_t nq = (i1 - i0) * G;                                                                       \
        float m[ROWS * 64], l[ROWS * 64];                                                                       \
        const float *qv[ROWS * 64];                                                                             \
        int64_t qpos[ROWS * 64];                                                                                \
        for (int64_t j = 0; j < nq; j++) {                                                                      \
            int64_t i = i0 + j / G, h = j % G;                                                                  \
            qv[j] = a->q + ((r0 + i) * a->H + g * G + h) * D;                                                   \
            qpos[j] = pos0 + i;                                                                                 \
            m[j] = -INFINITY;                                                                                   \
            l[j] = 0.0f;                                                                                        \
            memset(acc + j * D, 0, sizeof(float) * (size_t)D);                                                  \
        }                                                                                                       \
        const int64_t pmax = pos0 + i1 - 1;                                                                     \
        for (int64_t p0 = 0; p0 <= pmax; p0 += KB * GB) {                                                       \
            const int64_t left = (pmax - p0) / KB + 1, ng = left < GB ? left : GB;                              \
            int64_t kbase[GB], vbase[GB];                                                                       \
            for (int64_t b = 0; b < ng; b++) {                                                                  \
                const int64_t pb = p0 + b * KB, page = table[pb / S], off = pb % S;                             \
                kbase[b] = ((page * KVH + g) * D) * S + off; /* element index of k[d=0][t=0] */                 \
                vbase[b] = ((page * S + off) * KVH + g) * D; /* element index of v[t=0][0] */                   \
            }                                                                                                   \
            int64_t j0 = 0;                                                                                     \
            while (j0 < nq && qpos[j0] < p0) j0++; /* rows ascend: earlier rows see none of this group */      \
            for (; j0 < nq; j0 += JB) {                                                                         \
                const int64_t nj = nq - j0 < JB ? nq - j0 : JB;                                                 \
                P##_v sv[JB][GB];                                                                               \
                switch (nj) { /* constant counts keep the chains in registers */                                \
                    case 1: SCORE_NB(P, 1); break;                                                              \
                    case 2: SCORE_NB(P, 2); break;                                                              \
                    case 3: SCORE_NB(P, (JB > 2 ? 3 : 2)); break;                                               \
                    default: SCORE_NB(P, JB); break;                                                            \
                }                                                                                               \
                float pw[JB][GB][KB];                                                                           \
                int64_t valid[JB][GB];                                                                          \
                for (int64_t jj = 0; jj < nj; jj++) { /* one online-softmax step over the group */             \
                    const int64_t j = j0 + jj;                                                                  \
                    float mx = -INFINITY;                                                                       \
                    P##_v sc[GB];                                                                               \
                    for (int64_t b = 0; b < GB; b++) {                                                          \
                        const int64_t v = b < ng ? qpos[j] - (p0 + b * KB) + 1 : 0;                             \
                        valid[jj][b] = v < 0 ? 0 : v < KB ? v : KB;                                             \
                        if (!valid[jj][b]) continue;                                                            \
                        sc[b] = P##_mul(sv[jj][b], P##_set1(a->scale));                                         \
                        const float bm = P##_hmax(P##_blend_neginf(sc[b], valid[jj][b]));                       \
                        mx = bm > mx ? bm : mx;                                                                 \
                    }                                                                                           \
                    const float mn = m[j] > mx ? m[j] : mx;                                                     \
                    const float alpha = m[j] == -INFINITY ? 0.0f : exp_poly(m[j] - mn);                         \
                    float part[GB];                                                                             \
                    for (int64_t b = 0; b < GB; b++) {                                                          \
                        part[b] = 0.0f;                                                                         \
                        if (!valid[jj][b]) continue;                                                            \
                        P##_v pv = P##_keep(P##_exp(P##_sub(sc[b], P##_set1(mn))), valid[jj][b]);              \
                        P##_store(pw[jj][b], pv);                                                               \
                        part[b] = P##_hsum(pv);                                                                 \
                    }                                                                                           \
                    l[j] = l[j] * alpha + ((part[0] + part[1]) + (part[2] + part[3]));                          \
                    m[j] = mn;                                                                                  \
                    float *oj = acc + j * D;                                                                    \
                    const P##_v va = P##_set1(alpha);                                                           \
                    for (int64_t c = 0; c < nc; c++) P##_store(oj + 16 * c, P##_mul(P##_load(oj + 16 * c), va)); \
                }                                                                                               \
                /* o += p_0 v_0 + p_1 v_1 + ... over each block's valid t, blocks in order */                   \
                for (int64_t b = 0; b < ng; b++) {                                                              \
                    int64_t full = 0;                                                                           \
                    while (full < nj && valid[full][b] == KB) full++;                                           \
                    for (int64_t c = 0; c < nc; c += 4) {                                                       \
                        const int64_t n4 = nc - c < 4 ? nc - c : 4;                                             \
                        if (full == nj && n4 == 4) { /* the common case: whole blocks, no conditions */         \
                            switch (nj) {                                                                       \
                                case 1: PV_FULL(P, 1); break;                                                   \
                                case 2: PV_FULL(P, 2); break;                                                   \
                                case 3: PV_FULL(P, (JB > 2 ? 3 : 2)); break;                                    \
                                default: PV_FULL(P, JB); break;                                                 \
                            }                                                                                   \
                            continue;                                                                           \
                        }                                                                                       \
                        for (int64_t jj = 0; jj < nj; jj++) { /* a diagonal block or a short tail: one by one */ \
                            if (!valid[jj][b]) continue;                                                        \
                            float *oj = acc + (j0 + jj) * D + 16 * c;                                           \
                            P##_v x[4];                                                                         \
                            for (int64_t u = 0; u < n4; u++) x[u] = P##_load(oj + 16 * u);                      \
                            for (int64_t t = 0; t < valid[jj][b]; t++) {                                        \
                                const P##_v pt = P##_set1(pw[jj][b][t]);                                        \
                                const int64_t vr = vbase[b] + t * KVH * D + 16 * c;                             \
                                for (int64_t u = 0; u < n4; u++)                                                \
                                    x[u] = P##_fma(pt, P##_loadkv(a->vc, a->bf16, vr + 16 * u), x[u]);          \
                            }                                                                                   \
                            for (int64_t u = 0; u < n4; u++) P##_store(oj + 16 * u, x[u]);                      \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int64_t j = 0; j < nq; j++) {                                                                      \
            float *dst = a->out + (qv[j] - a->q);                                                               \
            const P##_v inv = P##_set1(1.0f / l[j]);                                                            \
            for (int64_t c = 0; c < nc; c++) P##_store(dst + 16 * c, P##_mul(P##_load(acc + j * D + 16 * c), inv)); \
        }                                                                                                       \
    }

#define JBMAX_z 4
#define NBMAX_z 4
#define JBMAX_y 2
#define NBMAX_y 2

/* 16 lanes as one 512-bit vector */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,fma")
typedef __m512 z_v;
static inline z_v z_zero(void) { return _mm512_setzero_ps(); }
static inline z_v z_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void z_store(float *p, z_v v) { _mm512_storeu_ps(p, v); }
static inline z_v z_set1(float f) { return _mm512_set1_ps(f); }
static inline z_v z_loadkv(const void *pool, int bf16, int64_t i) { /* 16 pool values as float32 (exact) */
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i))), 16));
    return _mm512_loadu_ps((const float *)pool + i);
}
static inline z_v z_fma(z_v a, z_v b, z_v c) { return _mm512_fmadd_ps(a, b, c); }
static inline z_v z_mul(z_v a, z_v b) { return _mm512_mul_ps(a, b); }
static inline z_v z_sub(z_v a, z_v b) { return _mm512_sub_ps(a, b); }
static inline z_v z_add(z_v a, z_v b) { return _mm512_add_ps(a, b); }
static inline z_v z_blend_neginf(z_v a, int64_t valid) { /* lanes >= valid -> -inf */
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << valid) - 1), a);
}
static inline z_v z_keep(z_v a, int64_t valid) { return _mm512_maskz_mov_ps((__mmask16)((1u << valid) - 1), a); }
static inline float z_hmax(z_v a) { return _mm512_reduce_max_ps(a); } /* max: any order gives the same */
static inline float z_hsum(z_v a) { /* the fixed tree: (lane i + lane i+8), then i + i+4, i + i+2, i + i+1 */
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
static inline z_v z_exp(z_v x) { /* exp_poly lane by lane */
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447504f));
    z_v fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    z_v y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
DEFINE_ATTEND(z)
#pragma GCC pop_options

/* 16 lanes as two 256-bit vectors: the same operations lane by lane */
#pragma GCC push_options
#pragma GCC target("avx2,fma")
typedef struct { __m256 lo, hi; } y_v;
static inline y_v y_zero(void) { return (y_v){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline y_v y_load(const float *p) { return (y_v){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void y_store(float *p, y_v v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline y_v y_set1(float f) { return (y_v){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline __m256 y_bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline y_v y_loadkv(const void *pool, int bf16, int64_t i) {
    if (bf16) return (y_v){y_bf8((const uint16_t *)pool + i), y_bf8((const uint16_t *)pool + i + 8)};
    return y_load((const float *)pool + i);
}
static inline y_v y_fma(y_v a, y_v b, y_v c) {
    return (y_v){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline y_v y_mul(y_v a, y_v b) { return (y_v){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline y_v y_sub(y_v a, y_v b) { return (y_v){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline y_v y_add(y_v a, y_v b) { return (y_v){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline __m256 y_lanes(int64_t valid, int64_t first) { /* all-ones in lanes first + i < valid */
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(valid - first)), idx));
}
static inline y_v y_blend_neginf(y_v a, int64_t valid) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    return (y_v){_mm256_blendv_ps(ninf, a.lo, y_lanes(valid, 0)), _mm256_blendv_ps(ninf, a.hi, y_lanes(valid, 8))};
}
static inline y_v y_keep(y_v a, int64_t valid) {
    return (y_v){_mm256_and_ps(a.lo, y_lanes(valid, 0)), _mm256_and_ps(a.hi, y_lanes(valid, 8))};
}
static inline float y_hmax(y_v a) {
    __m256 m8 = _mm256_max_ps(a.lo, a.hi);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
}
static inline float y_hsum(y_v a) { /* the same tree as z_hsum */
    __m256 s8 = _mm256_add_ps(a.lo, a.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
static inline __m256 y_exp8(__m256 x) {
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
static inline y_v y_exp(y_v x) { return (y_v){y_exp8(x.lo), y_exp8(x.hi)}; }
DEFINE_ATTEND(y)
#pragma GCC pop_options

typedef void (*attend_fn)(const attn_args *, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *, float *);

/* spans: nspans x (row0, n_rows, pos0, table_offset, n_pages) int64; tables: the page tables, concatenated.
   The work items (span, tile of ROWS rows, kv head), or a negative code when an argument is invalid. */
static int64_t attn_items(int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t P, int64_t S, const int64_t *spans,
                          int64_t nspans, const int64_t *tables, int64_t ntables) {
    if (D % 16 || D > MAXD || KVH <= 0 || H % KVH || H / KVH > 64 || S <= 0 || S % KB || T <= 0) return -1;
    int64_t items = 0;
    for (int64_t s = 0; s < nspans; s++) {
        const int64_t *sp = spans + 5 * s;
        int64_t r0 = sp[0], n = sp[1], pos0 = sp[2], off = sp[3], np = sp[4];
        if (n < 1 || r0 < 0 || r0 + n > T || pos0 < 0 || off < 0 || np < 0 || off + np > ntables) return -2;
        if (pos0 + n > np * S) return -2; /* a row would see a key past its page table */
        for (int64_t i = 0; i < (pos0 + n + S - 1) / S; i++)
            if (tables[off + i] < 0 || tables[off + i] >= P) return -3;
        items += (n + ROWS - 1) / ROWS * KVH;
    }
    return items;
}

static attend_fn chosen_attend(void) {
    static attend_fn fn = NULL;
    if (!fn) { /* KVSEAL_QISA=1 or 2 (tests) runs the 256-bit body on a CPU with AVX-512: the results are the same */
        const char *force = getenv("KVSEAL_QISA");
        const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq"); /* each feature z_attend_tile is compiled for */
        fn = avx512 && !(force && *force && atoi(force) < 3) ? z_attend_tile : y_attend_tile;
    }
    return fn;
}

/* The work itself, for arguments attn_items() accepted (forward.c checks a step's spans once, not per layer). */
int kvs_paged_attention_run(const float *q, int64_t H, int64_t KVH, int64_t D, const void *kc, const void *vc,
                            int kv_bf16, int64_t S, const int64_t *spans, int64_t nspans, const int64_t *tables,
                            int64_t items, float scale, float *out) {
    const attn_args a = {q, kc, vc, kv_bf16, H, KVH, D, S, scale, out};
    const attend_fn attend = chosen_attend();
    const int64_t G = H / KVH;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = (float *)aligned_alloc(64, sizeof(float) * (size_t)(ROWS * G * D + 16));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!buf) continue;
            int64_t rem = it, s = 0; /* the span of work item `it`: spans are few next to the work in a tile */
            for (; s < nspans; s++) {
                int64_t k = (spans[5 * s + 1] + ROWS - 1) / ROWS * KVH;
                if (rem < k) break;
                rem -= k;
            }
            const int64_t *sp = spans + 5 * s;
            const int64_t i0 = rem / KVH * ROWS, g = rem % KVH, i1 = i0 + ROWS < sp[1] ? i0 + ROWS : sp[1];
            attend(&a, sp[0], sp[2], i0, i1, g, tables + sp[3], buf);
        }
        free(buf);
    }
    return failed ? -4 : 0;
}

int64_t kvs_paged_attention_items(int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t P, int64_t S,
                                  const int64_t *spans, int64_t nspans, const int64_t *tables, int64_t ntables) {
    return attn_items(T, H, KVH, D, P, S, spans, nspans, tables, ntables);
}

int kvs_paged_attention(const float *q, int64_t T, int64_t H, int64_t KVH, int64_t D, const void *kc,
                        const void *vc, int kv_bf16, int64_t P, int64_t S, const int64_t *spans, int64_t nspans,
                        const int64_t *tables, int64_t ntables, float scale, float *out) {
    const int64_t items = attn_items(T, H, KVH, D, P, S, spans, nspans, tables, ntables);
    if (items < 0) return (int)items;
    return kvs_paged_attention_run(q, H, KVH, D, kc, vc, kv_bf16, S, spans, nspans, tables, items, scale, out);
}

/* k, v (T, KVH, D) float32 -> slot slots[t] (= page * S + offset) of the pools, kt key layout (P, KVH, D, S) and
   value layout (P, S, KVH, D), stored as float32 or bfloat16 (round to nearest even). -3 for a slot outside. */
static inline uint16_t f2bf(float f) {
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((v.u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

int kvs_write_kv(const float *k, const float *v, int64_t T, int64_t KVH, int64_t D, void *kc, void *vc, int bf16,
                 int64_t P, int64_t S, const int64_t *slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= P * S) return -3;
    for (int64_t t = 0; t < T; t++) {
        const int64_t page = slots[t] / S, off = slots[t] % S;
        for (int64_t g = 0; g < KVH; g++) {
            const float *kr = k + (t * KVH + g) * D, *vr = v + (t * KVH + g) * D;
            const int64_t kb = (page * KVH + g) * D * S + off, vb = ((page * S + off) * KVH + g) * D;
            if (bf16) {
                uint16_t *K = (uint16_t *)kc, *V = (uint16_t *)vc;
                for (int64_t d = 0; d < D; d++) {
                    K[kb + d * S] = f2bf(kr[d]);
                    V[vb + d] = f2bf(vr[d]);
                }
            } else {
                float *K = (float *)kc, *V = (float *)vc;
                for (int64_t d = 0; d < D; d++) K[kb + d * S] = kr[d];
                memcpy(V + vb, vr, sizeof(float) * (size_t)D);
            }
        }
    }
    return 0;
}
