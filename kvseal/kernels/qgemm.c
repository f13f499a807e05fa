/* kvseal's fast matrix products: int8 activations times 4/8-bit weights with integer dot products.
 *
 *  kvs_qpack           GGUF rows (Q4_0, Q4_1, Q8_0) -> tiles of 16 output columns laid out for dot products
 *  kvs_qlinear         y (M, N) = x (M, K) @ W^T: each row of x is quantized to int8 per block of 32
 *                      (scale = max|x| / 127, round to nearest even), the 32-term dot products are exact int32
 *                      sums, then scaled in float32 block by block in a fixed order.
 *  kvs_qisa            which instruction set the dispatcher picked (3 avx512-vnni, 2 avx-vnni, 1 avx2); each set
 *                      is checked on its own (kvs_qisa_have, kvs_qisa_pick), and KVSEAL_QISA naming one the CPU
 *                      lacks is refused (kvs_qisa_refused), never run
 *
 * Invariant (batch invariance): an element y[m, n] is computed by one thread, from row m of x and column n of
 * W only, with the same float operations in the same order whatever M is, whichever rows share the call, and
 * whichever instruction set runs it (the integer sums are exact; the float steps are the same lane-wise fma/mul
 * on every path). So a request's output does not depend on what else is in the batch.
 *
 * Packed layout, per tile of 16 columns (n0..n0+15; columns past N are zero) and block b of 32 inputs:
 *   Q4 (Q4_0, Q4_1): 4 chunks of 64 bytes, chunk c holds for lane j the 4 bytes qs_j[4c..4c+3] of the GGUF
 *       block: low nibbles are weights 4c..4c+3, high nibbles weights 16+4c..16+4c+3 (ggml's nibble order);
 *       then 16 fp16 scales d and 16 fp16 offsets m (Q4_0: m = -8 d), so w = d * q + m.
 *   Q8 (Q8_0): 8 chunks of 64 bytes, chunk g holds for lane j the int8 weights 4g..4g+3; then 16 fp16 d.
 * Tiles are stored one after another, a tile's blocks contiguous, so a thread streams its tiles in order.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8 };
#define QK 32
#define NT 16
#define Q4_TB (4 * 64 + 2 * 32)
#define Q8_TB (8 * 64 + 32)
#ifndef MR512
#define MR512 8 /* rows of x per micro-kernel call: 512-bit paths (32 registers) */
#endif
#define MR256 4 /* 256-bit paths (16 registers) */

static int64_t tile_block_bytes(int type) {
    return type == QT_Q4_0 || type == QT_Q4_1 ? Q4_TB : type == QT_Q8_0 ? Q8_TB : -1;
}

int64_t kvs_qpacked_bytes(int type, int64_t N, int64_t K) {
    int64_t tb = tile_block_bytes(type);
    if (tb < 0 || N <= 0 || K <= 0 || K % QK) return -1;
    return (N + NT - 1) / NT * (K / QK) * tb;
}

static inline uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float h2f16(uint16_t h) { return _cvtsh_ss(h); }

/* w: N GGUF rows of K/32 blocks -> out (kvs_qpacked_bytes). -1 bad arguments, -5 a Q4_0 offset overflows fp16. */
int kvs_qpack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    int64_t total = kvs_qpacked_bytes(type, N, K);
    if (total < 0) return -1;
    const int64_t nb = K / QK, tb = tile_block_bytes(type), ntiles = (N + NT - 1) / NT;
    const int64_t gb = type == QT_Q4_1 ? 20 : type == QT_Q4_0 ? 18 : 34; /* GGUF block bytes */
    memset(out, 0, (size_t)total);
    int bad = 0;
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (t * nb + b) * tb;
            for (int64_t j = 0; j < NT; j++) {
                int64_t n = t * NT + j;
                if (n >= N) continue;
                const uint8_t *src = w + n * nb * gb + b * gb;
                uint16_t d;
                memcpy(&d, src, 2);
                if (type == QT_Q8_0) {
                    for (int g = 0; g < 8; g++) memcpy(dst + 64 * g + 4 * j, src + 2 + 4 * g, 4);
                    memcpy(dst + 8 * 64 + 2 * j, &d, 2);
                } else {
                    const uint8_t *qs = src + (type == QT_Q4_1 ? 4 : 2);
                    for (int c = 0; c < 4; c++) memcpy(dst + 64 * c + 4 * j, qs + 4 * c, 4);
                    uint16_t m;
                    if (type == QT_Q4_1) {
                        memcpy(&m, src + 2, 2);
                    } else {
                        float mf = -8.0f * h2f16(d); /* exact: a power-of-two multiple, unless it overflows */
                        if (!isfinite(mf) || fabsf(mf) > 65504.0f) bad = 1;
                        m = f2h(mf);
                    }
                    memcpy(dst + 4 * 64 + 2 * j, &d, 2);
                    memcpy(dst + 4 * 64 + 32 + 2 * j, &m, 2);
                }
            }
        }
    return bad ? -5 : 0;
}

/* One row of x -> int8 qx (K), per block: dx = max|x| / 127 (0 for an all-zero block), sx = sum(qx),
   dxs = dx * sx (Q4's offset term); q = x * (127 / max|x|) rounded to nearest even, within [-127, 127].
   AVX2 (the library's baseline): lane-wise the same operations as the scalar definition, so every CPU that
   runs kvseal gets the same bits. */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, int32_t *sx, float *dxs) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4], acc = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, lim), nlim));
            acc = _mm256_add_epi32(acc, q[i]);
        }
        /* 32 int32 -> 32 int8 in order (packs interleave 128-bit lanes; the permute undoes it) */
        __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i bytes = _mm256_packs_epi16(w01, w23);
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + b * QK), bytes);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const int32_t s = _mm_cvtsi128_si32(s4);
        dx[b] = d;
        sx[b] = s;
        dxs[b] = d * (float)s;
    }
}

typedef struct {
    const int8_t *qx; /* (M, K) */
    const float *dx, *dxs; /* (M, K/32) */
    const int32_t *sx;
} qrows;

/* ---- AVX-512 VNNI: one 512-bit vector = the 16 columns of a tile --------------------------------------- */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")
static inline __attribute__((always_inline)) void tile_avx512_body(
        int type, const uint8_t *tile, int64_t nb, const qrows *x, int64_t K, int64_t m0, const int mr, float *y,
        int64_t ldy, int64_t ncols) {
    const __m512i nib = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MR512];
    for (int r = 0; r < MR512; r++) acc[r] = _mm512_setzero_ps();
    const int64_t tb = tile_block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tb;
        __m512i ia[MR512], ib[MR512];
        for (int r = 0; r < MR512; r++) ia[r] = ib[r] = _mm512_setzero_si512();
        if (type == QT_Q8_0) {
            for (int g = 0; g < 8; g += 2) {
                __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g), flip);      /* q + 128 as u8 */
                __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(blk + 64 * g + 64), flip);
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = x->qx + (m0 + r) * K + b * QK;
                    ia[r] = _mm512_dpbusd_epi32(ia[r], w0, _mm512_set1_epi32(*(const int32_t *)(xr + 4 * g)));
                    ib[r] = _mm512_dpbusd_epi32(ib[r], w1, _mm512_set1_epi32(*(const int32_t *)(xr + 4 * g + 4)));
                }
            }
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 8 * 64)));
            for (int r = 0; r < mr; r++) {
                int64_t i = (m0 + r) * (K / QK) + b;
                __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(ia[r], ib[r]), _mm512_set1_epi32(128 * x->sx[i]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(x->dx[i])), acc[r]);
            }
        } else {
            for (int c = 0; c < 4; c++) {
                __m512i w = _mm512_loadu_si512(blk + 64 * c);
                __m512i lo = _mm512_and_si512(w, nib), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = x->qx + (m0 + r) * K + b * QK;
                    ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_set1_epi32(*(const int32_t *)(xr + 4 * c)));
                    ib[r] = _mm512_dpbusd_epi32(ib[r], hi, _mm512_set1_epi32(*(const int32_t *)(xr + 16 + 4 * c)));
                }
            }
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 4 * 64)));
            __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 4 * 64 + 32)));
            for (int r = 0; r < mr; r++) {
                int64_t i = (m0 + r) * (K / QK) + b;
                __m512i dot = _mm512_add_epi32(ia[r], ib[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(x->dx[i])), acc[r]);
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x->dxs[i]), acc[r]);
            }
        }
    }
    __mmask16 k = (__mmask16)(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1);
    for (int r = 0; r < mr; r++) _mm512_mask_storeu_ps(y + r * ldy, k, acc[r]);
}
static void tile_avx512(int type, const uint8_t *tile, int64_t nb, const qrows *x, int64_t K, int64_t m0,
                        int64_t mr, float *y, int64_t ldy, int64_t ncols) {
    switch (mr) { /* constant row counts: the accumulators stay in registers */
        case 8: tile_avx512_body(type, tile, nb, x, K, m0, 8, y, ldy, ncols); break;
        case 7: tile_avx512_body(type, tile, nb, x, K, m0, 7, y, ldy, ncols); break;
        case 6: tile_avx512_body(type, tile, nb, x, K, m0, 6, y, ldy, ncols); break;
        case 5: tile_avx512_body(type, tile, nb, x, K, m0, 5, y, ldy, ncols); break;
        case 4: tile_avx512_body(type, tile, nb, x, K, m0, 4, y, ldy, ncols); break;
        case 3: tile_avx512_body(type, tile, nb, x, K, m0, 3, y, ldy, ncols); break;
        case 2: tile_avx512_body(type, tile, nb, x, K, m0, 2, y, ldy, ncols); break;
        default: tile_avx512_body(type, tile, nb, x, K, m0, 1, y, ldy, ncols); break;
    }
}
#pragma GCC pop_options

/* ---- 256-bit paths: two vectors of 8 columns per tile; integer dot products by AVX-VNNI or AVX2 --------- */
/* instantiated between #pragma GCC target lines (a _Pragma inside the macro is lost by GCC 12) */
#define DEFINE_TILE256(NAME, DPBUSD)                                                                            \
    static inline __attribute__((always_inline)) void NAME##_body(int type, const uint8_t *tile, int64_t nb,    \
            const qrows *x, int64_t K, int64_t m0, const int mr, float *y, int64_t ldy, int64_t ncols) {         \
        const __m256i nib = _mm256_set1_epi8(0x0F);                                                             \
        const int64_t tb = tile_block_bytes(type);                                                              \
        for (int half = 0; half < 2; half++) {                                                                  \
            __m256 acc[MR256];                                                                                  \
            for (int r = 0; r < MR256; r++) acc[r] = _mm256_setzero_ps();                                       \
            for (int64_t b = 0; b < nb; b++) {                                                                  \
                const uint8_t *blk = tile + b * tb + 32 * half;                                                 \
                __m256i ia[MR256];                                                                              \
                for (int r = 0; r < MR256; r++) ia[r] = _mm256_setzero_si256();                                 \
                if (type == QT_Q8_0) {                                                                          \
                    for (int g = 0; g < 8; g++) {                                                               \
                        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 64 * g));                        \
                        __m256i aw = _mm256_abs_epi8(w);                                                        \
                        for (int r = 0; r < mr; r++) {                                                          \
                            const int8_t *xr = x->qx + (m0 + r) * K + b * QK;                                   \
                            __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xr + 4 * g));                     \
                            ia[r] = DPBUSD(ia[r], aw, _mm256_sign_epi8(xv, w)); /* |w| * (x sign w) = w x */    \
                        }                                                                                       \
                    }                                                                                           \
                    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tile + b * tb + 8 * 64 + 16 * half))); \
                    for (int r = 0; r < mr; r++) {                                                              \
                        int64_t i = (m0 + r) * (K / QK) + b;                                                    \
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]),                                     \
                                                 _mm256_mul_ps(dw, _mm256_set1_ps(x->dx[i])), acc[r]);          \
                    }                                                                                           \
                } else {                                                                                        \
                    for (int c = 0; c < 4; c++) {                                                               \
                        __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));                        \
                        __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib); \
                        for (int r = 0; r < mr; r++) {                                                          \
                            const int8_t *xr = x->qx + (m0 + r) * K + b * QK;                                   \
                            ia[r] = DPBUSD(ia[r], lo, _mm256_set1_epi32(*(const int32_t *)(xr + 4 * c)));       \
                            ia[r] = DPBUSD(ia[r], hi, _mm256_set1_epi32(*(const int32_t *)(xr + 16 + 4 * c)));  \
                        }                                                                                       \
                    }                                                                                           \
                    const uint8_t *sc = tile + b * tb + 4 * 64 + 16 * half;                                     \
                    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));                          \
                    __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32)));                   \
                    for (int r = 0; r < mr; r++) {                                                              \
                        int64_t i = (m0 + r) * (K / QK) + b;                                                    \
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]),                                     \
                                                 _mm256_mul_ps(dw, _mm256_set1_ps(x->dx[i])), acc[r]);          \
                        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->dxs[i]), acc[r]);                        \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            int64_t c0 = 8 * half, nc = ncols - c0 < 8 ? ncols - c0 : 8;                                        \
            for (int r = 0; r < mr; r++) {                                                                      \
                if (nc == 8) {                                                                                  \
                    _mm256_storeu_ps(y + r * ldy + c0, acc[r]);                                                 \
                } else if (nc > 0) {                                                                            \
                    float tmp[8];                                                                               \
                    _mm256_storeu_ps(tmp, acc[r]);                                                              \
                    memcpy(y + r * ldy + c0, tmp, sizeof(float) * (size_t)nc);                                  \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    static void NAME(int type, const uint8_t *tile, int64_t nb, const qrows *x, int64_t K, int64_t m0,         \
                     int64_t mr, float *y, int64_t ldy, int64_t ncols) {                                       \
        switch (mr) {                                                                                           \
            case 4: NAME##_body(type, tile, nb, x, K, m0, 4, y, ldy, ncols); break;                             \
            case 3: NAME##_body(type, tile, nb, x, K, m0, 3, y, ldy, ncols); break;                             \
            case 2: NAME##_body(type, tile, nb, x, K, m0, 2, y, ldy, ncols); break;                             \
            default: NAME##_body(type, tile, nb, x, K, m0, 1, y, ldy, ncols); break;                            \
        }                                                                                                       \
    }

/* AVX2: u8 x s8 pairs -> s16 (no saturation here: |q| <= 15 for Q4, and |w| <= 128, |x| <= 127 for Q8 give
   at most 2 * 128 * 127 < 32768), then pairs of s16 -> s32. The sum is the same integer as VNNI's. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static inline __m256i dpbusd_avx2(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
DEFINE_TILE256(tile_avx2, dpbusd_avx2)
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
DEFINE_TILE256(tile_avxvnni, _mm256_dpbusd_avx_epi32)
#pragma GCC pop_options

typedef void (*tile_fn)(int, const uint8_t *, int64_t, const qrows *, int64_t, int64_t, int64_t, float *, int64_t,
                        int64_t);

/* The integer instruction sets this CPU has, as a mask: bit 1 AVX2 (the library's baseline), bit 2 AVX-VNNI, bit 3
   AVX-512-VNNI (with the F, BW and VL parts tile_avx512 uses). They are independent features, not a ladder: Zen 4,
   Ice Lake and Cascade Lake have AVX-512-VNNI but no AVX-VNNI; Alder Lake has AVX-VNNI but no AVX-512. */
int kvs_qisa_have(void) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return (avx2 << 1) | ((avx2 && __builtin_cpu_supports("avxvnni")) << 2) | (avx512 << 3);
}

/* The set to run for a CPU with sets `have` (kvs_qisa_have's mask) when `forced` (KVSEAL_QISA; 0: none) asks for
   one: the forced one only if the CPU has it, else the best it has. Each set is checked on its own. */
int kvs_qisa_pick(int have, int forced) {
    if (forced >= 1 && forced <= 3 && ((have >> forced) & 1)) return forced;
    return (have >> 3) & 1 ? 3 : (have >> 2) & 1 ? 2 : 1;
}

static int qisa_forced(void) { /* KVSEAL_QISA (tests: a lower path on a CPU that has a higher one); 0: unset,
                                  -1: not one of 1, 2, 3 */
    const char *force = getenv("KVSEAL_QISA");
    if (!force || !*force) return 0;
    return (force[0] >= '1' && force[0] <= '3' && !force[1]) ? force[0] - '0' : -1;
}

static int chosen_isa(void) {
    static int isa = 0;
    if (!isa) isa = kvs_qisa_pick(kvs_qisa_have(), qisa_forced());
    return isa;
}

int kvs_qisa(void) { return chosen_isa(); }

/* KVSEAL_QISA when it asks for a set this CPU lacks (or is no set at all: -1), so that the caller refuses to run
   (kernels/ops.qisa); 0 when it is unset or honoured. The kernels themselves never run a set the CPU lacks. */
int kvs_qisa_refused(void) {
    const int forced = qisa_forced();
    return forced != 0 && forced != chosen_isa() ? forced : 0;
}

/* Bytes of scratch kvs_qlinear_into needs for M rows of K inputs: the int8 rows and their block scales. */
int64_t kvs_qscratch_bytes(int64_t M, int64_t K) { return M * K + M * (K / QK) * 12; }

/* y (M, N) = x (M, K) @ W^T for W packed by kvs_qpack, with caller-owned scratch (kvs_qscratch_bytes). Threads
   split the tiles (never K). */
int kvs_qlinear_into(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x, int64_t M, float *y,
                     void *scratch) {
    if (kvs_qpacked_bytes(type, N, K) < 0 || M <= 0) return -1;
    const int64_t nb = K / QK, ntiles = (N + NT - 1) / NT, tb = tile_block_bytes(type);
    int8_t *qx = (int8_t *)scratch;
    float *dx = (float *)(qx + M * K), *dxs = dx + M * nb;
    int32_t *sx = (int32_t *)(dxs + M * nb);
#pragma omp parallel for schedule(static) if (M * K > 16384)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, qx + m * K, dx + m * nb, sx + m * nb, dxs + m * nb);
    const qrows xr = {qx, dx, dxs, sx};
    const int isa = chosen_isa();
    const tile_fn fn = isa == 3 ? tile_avx512 : isa == 2 ? tile_avxvnni : tile_avx2;
    const int64_t mr = isa == 3 ? MR512 : MR256;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const uint8_t *tile = packed + t * nb * tb;
        int64_t ncols = N - t * NT < NT ? N - t * NT : NT;
        for (int64_t m = 0; m < M; m += mr)
            fn(type, tile, nb, &xr, K, m, M - m < mr ? M - m : mr, y + m * N + t * NT, N, ncols);
    }
    return 0;
}

/* kvs_qlinear_into with scratch of its own */
int kvs_qlinear(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    if (kvs_qpacked_bytes(type, N, K) < 0 || M <= 0) return -1;
    void *scratch = malloc((size_t)kvs_qscratch_bytes(M, K));
    if (!scratch) return -4;
    int rc = kvs_qlinear_into(type, packed, N, K, x, M, y, scratch);
    free(scratch);
    return rc;
}

/* ---- this core's peak rate of one instruction, for bench.limits (how far the kernels are from the machine) --- */
#define PEAK12(op)                                                                                              \
    op " %%zmm0, %%zmm1, %%zmm2\n\t" op " %%zmm0, %%zmm1, %%zmm3\n\t" op " %%zmm0, %%zmm1, %%zmm4\n\t"          \
    op " %%zmm0, %%zmm1, %%zmm5\n\t" op " %%zmm0, %%zmm1, %%zmm6\n\t" op " %%zmm0, %%zmm1, %%zmm7\n\t"          \
    op " %%zmm0, %%zmm1, %%zmm8\n\t" op " %%zmm0, %%zmm1, %%zmm9\n\t" op " %%zmm0, %%zmm1, %%zmm10\n\t"         \
    op " %%zmm0, %%zmm1, %%zmm11\n\t" op " %%zmm0, %%zmm1, %%zmm12\n\t" op " %%zmm0, %%zmm1, %%zmm13\n\t"
#define PEAK_CLOBBER "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx512bf16")
/* 12 independent 512-bit instructions per round, `rounds` times: kind 0 vpdpbusd (64 int8 multiply-adds each),
   1 vfmadd231ps (16 float32), 2 vdpbf16ps (32 bfloat16). Returns instructions issued (the caller times it);
   -1 when this CPU lacks the instruction. */
int64_t kvs_peak_issue(int kind, int64_t rounds) {
    if (!__builtin_cpu_supports("avx512f") || (kind == 0 && !__builtin_cpu_supports("avx512vnni")) ||
        (kind == 2 && !__builtin_cpu_supports("avx512bf16")))
        return -1;
    for (int64_t k = 0; k < rounds; k++) {
        if (kind == 0)
            __asm__ volatile(PEAK12("vpdpbusd")::: PEAK_CLOBBER);
        else if (kind == 1)
            __asm__ volatile(PEAK12("vfmadd231ps")::: PEAK_CLOBBER);
        else
            __asm__ volatile(PEAK12("vdpbf16ps")::: PEAK_CLOBBER);
    }
    return 12 * rounds;
}
#pragma GCC pop_options
