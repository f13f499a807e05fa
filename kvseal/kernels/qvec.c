/* The fast arithmetic for one row of x (M = 1: a decode token), on AVX-512-VNNI: Q4_K, Q6_K and Q8_0 tiles.
 *
 * At M = 1 a product reads every weight once and does little with it, so it runs at the speed the weights stream
 * from memory, if the arithmetic keeps out of the loads' way. What differs from qtile.h's micro-kernel with one
 * row (the other types and instruction sets still run that):
 *  - the tile's bytes are prefetched into L2 a fixed distance ahead (PF_AHEAD), past the 4 KB pages where the
 *    hardware's streamer stops, so the reads stay in flight while the integer and float steps run;
 *  - fewer instructions a weight: Q4_K's high nibbles are multiplied in place (w & 0xF0 is 16 q; the sum is
 *    shifted back once a block), Q6_K's 2-bit planes are merged in with one ternary-logic select, and every
 *    block's 8 dot products run as two independent chains.
 * The integer sums are exact, so they are the same integers as qtile.h's; the float steps per block and column
 * are qtile.h's, in its order (D = d sc, M = -dmin m; acc = fma(float(isum), D dx, acc), acc = fma(M, dxs, acc)):
 * the same bits as every other path (tests/unit/test_fast_kernels.py compares them).
 */
#include <immintrin.h>
#include <stdint.h>

#include "qgemm.h"

int kvs_qvec_takes(int type) { return type == QT_Q4_K || type == QT_Q6_K || type == QT_Q8_0; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

static inline __m512 loadh(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 loadu8f(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512i ldw(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __m512i bx(const int8_t *p) { return _mm512_set1_epi32(ld32(p)); }

/* the lines of [p, p + bytes) PF_AHEAD bytes ahead, into L2 (a prefetch never faults: past the matrix it is
   wasted, not wrong) */
static inline void ahead(const uint8_t *p, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)p + PF_AHEAD + l, _MM_HINT_T1);
}

/* one float step of a block (qtile.h's order) */
static inline __m512 step(__m512 acc, __m512i is, __m512 D, __m512 M, float dx, float dxs, int offset) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(D, _mm512_set1_ps(dx)), acc);
    return offset ? _mm512_fmadd_ps(M, _mm512_set1_ps(dxs), acc) : acc;
}

static __m512 q4k(const uint8_t *tile, int64_t nu, const qrows *x) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), mf0 = _mm512_set1_epi8((char)0xF0);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *ub = tile + u * 2368;
        const __m512 dsup = loadh(ub), ndmin = _mm512_mul_ps(loadh(ub + 32), _mm512_set1_ps(-1.0f));
        for (int s = 0; s < 8; s++) {
            const int64_t b = u * 8 + s;
            const uint8_t *blk = ub + 64 + s * 288;
            const int8_t *xb = x->qx + b * QK;
            ahead(blk, 288);
            __m512i lo = _mm512_setzero_si512(), hi = lo; /* hi: 16 x the high nibbles' sum */
            for (int c = 0; c < 4; c++) {
                const __m512i w = ldw(blk + 64 * c);
                lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(w, m4), bx(xb + 4 * c));
                hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(w, mf0), bx(xb + 16 + 4 * c));
            }
            const __m512i is = _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
            const __m512 D = _mm512_mul_ps(dsup, loadu8f(blk + 256)), M = _mm512_mul_ps(ndmin, loadu8f(blk + 272));
            acc = step(acc, is, D, M, x->dx[b], x->dxs[b], 1);
        }
    }
    return acc;
}

/* Q6_K: weight i of chunk c (bytes 4j..4j+3 of column j) = its nibble | plane bits at 4, 5 (qpack.c). The planes'
   even chunks (bits 0-1, 4-5 of each byte) and odd ones (2-3, 6-7) are split once a block, so that each chunk's
   two bits shift to bits 4, 5 with zeros above; one select (bits 0-3 from the nibbles, 4-7 from the plane) makes
   the 6-bit weight. */
static __m512 q6k(const uint8_t *tile, int64_t nu, const qrows *x) {
    const __m512i m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xCC), m0f = _mm512_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *ub = tile + u * 3360;
        const __m512 D = loadh(ub);
        for (int s = 0; s < 8; s++) {
            const int64_t b = u * 8 + s;
            const uint8_t *blk = ub + 32 + s * 416;
            const int8_t *xb = x->qx + b * QK;
            ahead(blk, 416);
            __m512i is = _mm512_setzero_si512();
            for (int part = 0; part < 2; part++) { /* weights 0..15 (low nibbles), 16..31 (high) */
                const __m512i P = ldw(blk + 256 + 64 * part);
                const __m512i pe = _mm512_and_si512(P, m33), po = _mm512_and_si512(P, mcc);
                const __m512i top[4] = {_mm512_slli_epi32(pe, 4), _mm512_slli_epi32(po, 2), pe,
                                        _mm512_srli_epi32(po, 2)};
                __m512i a0 = _mm512_setzero_si512(), a1 = a0;
                for (int c = 0; c < 4; c++) {
                    __m512i w = ldw(blk + 64 * c);
                    if (part) w = _mm512_srli_epi16(w, 4);
                    /* 0xCA: m0f ? w : top, bit by bit */
                    const __m512i v = _mm512_ternarylogic_epi32(m0f, w, top[c], 0xCA);
                    if (c & 1)
                        a1 = _mm512_dpbusd_epi32(a1, v, bx(xb + 16 * part + 4 * c));
                    else
                        a0 = _mm512_dpbusd_epi32(a0, v, bx(xb + 16 * part + 4 * c));
                }
                const __m512i off = _mm512_set1_epi32(x->bs32[b * 2 + part]);
                const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 384 + 16 * part)));
                is = _mm512_add_epi32(is, _mm512_mullo_epi32(_mm512_sub_epi32(_mm512_add_epi32(a0, a1), off), sc));
            }
            acc = step(acc, is, D, D, x->dx[b], 0.0f, 0);
        }
    }
    return acc;
}

/* Q8_0: (w + 128) x x - 128 sum(x), as qgemm.c's AVX-512 path */
static __m512 q80(const uint8_t *tile, int64_t nu, const qrows *x) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nu; b++) {
        const uint8_t *blk = tile + b * 544;
        const int8_t *xb = x->qx + b * QK;
        ahead(blk, 544);
        __m512i a0 = _mm512_setzero_si512(), a1 = a0;
        for (int g = 0; g < 8; g += 2) {
            a0 = _mm512_dpbusd_epi32(a0, _mm512_xor_si512(ldw(blk + 64 * g), flip), bx(xb + 4 * g));
            a1 = _mm512_dpbusd_epi32(a1, _mm512_xor_si512(ldw(blk + 64 * g + 64), flip), bx(xb + 4 * g + 4));
        }
        const __m512i is = _mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(128 * x->sx[b]));
        const __m512 D = loadh(blk + 512);
        acc = step(acc, is, D, D, x->dx[b], 0.0f, 0);
    }
    return acc;
}

/* y[0, 0..ncols) for one packed tile of a type kvs_qvec_takes, from row 0 of x */
void kvs_qvec_tile(int type, const uint8_t *tile, int64_t nu, const qrows *x, float *y, int64_t ncols) {
    const __m512 acc = type == QT_Q4_K ? q4k(tile, nu, x) : type == QT_Q6_K ? q6k(tile, nu, x) : q80(tile, nu, x);
    _mm512_mask_storeu_ps(y, (__mmask16)(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1), acc);
}
#pragma GCC pop_options
