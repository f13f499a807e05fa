/* GGUF blocks -> float32, for the exact arithmetic: every weight equals, bit for bit, what gguf-py's
 * `gguf.quants.dequantize` (and so transformers' GGUF loader) makes of it, since the same float32 operations run
 * in the same order: d * q for Q4_0/Q5_0/Q8_0 (q with its offset taken off as an integer), (d * q) + m for Q4_1,
 * (d * sc) * q - (dmin * m) for Q4_K/Q5_K, (d * sc) * (q - 32) for Q6_K; F16 and BF16 widen exactly.
 * (The library is built with -std=c11, so the compiler does not contract a * b + c into an fma.)
 */
#include <immintrin.h>
#include <string.h>

#include "kvs.h"

int64_t kvs_row_bytes(int type, int64_t K) { return kvs_row_bytes_of(type, K); }

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* out[i] = a * q[i] (+ b, or - b), n a multiple of 8 */
static inline void scale_mul(const int8_t *q, float a, float *out, int n) {
    const __m256 va = _mm256_set1_ps(a);
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(va, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))))));
}
static inline void scale_add(const uint8_t *q, float a, float b, int sub, float *out, int n) {
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int i = 0; i < n; i += 8) {
        __m256 p = _mm256_mul_ps(va, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)))));
        _mm256_storeu_ps(out + i, sub ? _mm256_sub_ps(p, vb) : _mm256_add_ps(p, vb));
    }
}

/* the 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4) */
static inline void scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

void kvs_dequant_row(int type, const uint8_t *row, int64_t K, float *out) {
    const int64_t bs = kvs_block_size(type), nb = K / kvs_block_elems(type);
    int8_t q[QK_K];
    uint8_t u[QK_K];
    switch (type) {
        case QT_F32: memcpy(out, row, sizeof(float) * (size_t)K); return;
        case QT_F16:
            for (int64_t i = 0; i < K; i += 8)
                _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i))));
            return;
        case QT_BF16:
            for (int64_t i = 0; i < K; i += 8) {
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * i)));
                _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            return;
        default: break;
    }
    for (int64_t b = 0; b < nb; b++, row += bs) {
        switch (type) {
            case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: { /* low nibbles are weights 0..15, high ones 16..31 */
                const int off = type == QT_Q4_1 ? 4 : type == QT_Q5_0 ? 6 : 2;
                uint32_t qh = 0;
                if (type == QT_Q5_0) memcpy(&qh, row + 2, 4);
                for (int j = 0; j < 16; j++) {
                    u[j] = (uint8_t)((row[off + j] & 0x0F) | (((qh >> j) & 1) << 4));
                    u[j + 16] = (uint8_t)((row[off + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
                }
                if (type == QT_Q4_1) {
                    scale_add(u, h2f(row), h2f(row + 2), 0, out + b * QK, QK);
                } else {
                    const int zero = type == QT_Q5_0 ? 16 : 8;
                    for (int j = 0; j < QK; j++) q[j] = (int8_t)(u[j] - zero);
                    scale_mul(q, h2f(row), out + b * QK, QK);
                }
                break;
            }
            case QT_Q8_0: scale_mul((const int8_t *)(row + 2), h2f(row), out + b * QK, QK); break;
            case QT_Q4_K: case QT_Q5_K: {
                const float d = h2f(row), dmin = h2f(row + 2);
                const uint8_t *sc = row + 4, *qh = row + 16, *qs = row + (type == QT_Q5_K ? 48 : 16);
                for (int j = 0; j < 4; j++) /* sub-blocks 2j (low nibbles) and 2j + 1 (high) of qs[32j..] */
                    for (int l = 0; l < 32; l++) {
                        u[64 * j + l] = qs[32 * j + l] & 0x0F;
                        u[64 * j + 32 + l] = qs[32 * j + l] >> 4;
                    }
                if (type == QT_Q5_K)
                    for (int s = 0; s < 8; s++)
                        for (int l = 0; l < 32; l++) u[32 * s + l] |= (uint8_t)(((qh[l] >> s) & 1) << 4);
                for (int s = 0; s < 8; s++) {
                    uint8_t scs, ms;
                    scale_min_k4(s, sc, &scs, &ms);
                    scale_add(u + 32 * s, d * (float)scs, dmin * (float)ms, 1, out + b * QK_K + 32 * s, 32);
                }
                break;
            }
            case QT_Q6_K: {
                const uint8_t *ql = row, *qh = row + 128;
                const int8_t *sc = (const int8_t *)(row + 192);
                const float d = h2f(row + 208);
                for (int h = 0; h < 2; h++) /* halves of 128: ql[64h..], qh[32h..] */
                    for (int l = 0; l < 32; l++) {
                        const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], bits = qh[32 * h + l];
                        int8_t *o = q + 128 * h + l;
                        o[0] = (int8_t)(((lo & 0x0F) | ((bits & 3) << 4)) - 32);
                        o[32] = (int8_t)(((hi & 0x0F) | (((bits >> 2) & 3) << 4)) - 32);
                        o[64] = (int8_t)(((lo >> 4) | (((bits >> 4) & 3) << 4)) - 32);
                        o[96] = (int8_t)(((hi >> 4) | (((bits >> 6) & 3) << 4)) - 32);
                    }
                for (int s = 0; s < 16; s++) scale_mul(q + 16 * s, d * (float)sc[s], out + b * QK_K + 16 * s, 16);
                break;
            }
            default: break;
        }
    }
}
