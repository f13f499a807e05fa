/* GGUF rows -> the fast arithmetic's tiles (qgemm.c multiplies them).
 *
 * A matrix (N, K) becomes tiles of NT = 16 output columns (columns past N are zero), one after another; a tile
 * is its units of inputs in order (32 inputs for Q4_0, Q4_1, Q5_0, Q8_0; a 256-input super-block for the
 * K-quants), so a thread streams its tiles front to back. Within a unit, for each block of 32 inputs:
 *   nibbles (4-bit types, and the low 4 bits of Q5_0/Q5_K/Q6_K): 4 chunks of 64 bytes; chunk c holds for
 *       column j (bytes 4j..4j+3) the weights 4c..4c+3 in its low nibbles and 16+4c..16+4c+3 in its high ones
 *       (ggml's Q4_0 order), so one AND / one shift gives 4 weights of 16 columns against 4 broadcast inputs.
 *   Q5 bit plane (64 bytes): column j's 32-bit word has the 5th bit of sub-chunk s (s = c: weights 4c..4c+3,
 *       s = 4 + c: weights 16+4c..) at bits 8i + s for its i-th weight: one shift and AND put it at bit 4.
 *   Q6 2-bit planes (2 x 64 bytes): word 0 (weights 0..15) and word 1 (16..31) of column j have the top two bits
 *       of the i-th weight of chunk c at bits 8i + 2c, 8i + 2c + 1.
 * Layouts (fp16 = 16 half floats, one per column; u8 / i8 = 16 bytes, one per column):
 *   Q4_0, Q4_1 (320 B / 32):  nibbles | d fp16 | m fp16 (Q4_0: m = -8 d)          w = d q + m
 *   Q5_0 (352 B / 32):        nibbles | Q5 plane | d fp16                          w = d q - 16 d
 *   Q8_0 (544 B / 32):        8 chunks of 64 bytes, chunk g = int8 weights 4g..4g+3 | d fp16
 *   Q4_K (2368 B / 256):      d fp16 | dmin fp16 | 8 x (nibbles | sc u8 | m u8)      w = d sc q - dmin m
 *   Q5_K (2880 B / 256):      d fp16 | dmin fp16 | 8 x (nibbles | Q5 plane | sc u8 | m u8)
 *   Q6_K (3360 B / 256):      d fp16 | 8 x (nibbles | Q6 planes | sc i8 of weights 0..15 | sc i8 of 16..31)
 *                                                                                  w = d sc (q - 32)
 * Float types (F32, F16, BF16) are not repacked: the fast arithmetic multiplies them as stored (qgemm.c).
 */
#include <math.h>
#include <string.h>

#include "qgemm.h"

int64_t kvs_qunit_elems(int type) { return kvs_block_elems(type) == QK_K ? QK_K : QK; }

int64_t kvs_qunit_bytes(int type) {
    switch (type) {
        case QT_Q4_0: case QT_Q4_1: return 320;
        case QT_Q5_0: return 352;
        case QT_Q8_0: return 544;
        case QT_Q4_K: return 2368;
        case QT_Q5_K: return 2880;
        case QT_Q6_K: return 3360;
        default: return -1;
    }
}

static int is_float(int type) { return type == QT_F32 || type == QT_F16 || type == QT_BF16; }

int64_t kvs_qpacked_bytes(int type, int64_t N, int64_t K) {
    if (N <= 0 || kvs_row_bytes_of(type, K) < 0) return -1;
    if (is_float(type)) return N * kvs_row_bytes_of(type, K);
    return (N + NT - 1) / NT * (K / kvs_qunit_elems(type)) * kvs_qunit_bytes(type);
}

static inline uint16_t f2h(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float h2f16(uint16_t h) { return _cvtsh_ss(h); }

/* 32 weights q (0..63) of one block of column j -> its nibble chunks, and the planes that hold bits 4 (and 5) */
static void put_nibbles(const uint8_t *q, uint8_t *dst, int64_t j) {
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) dst[64 * c + 4 * j + i] = (uint8_t)((q[4 * c + i] & 0x0F) | ((q[16 + 4 * c + i] & 0x0F) << 4));
}
static void put_q5_plane(const uint8_t *q, uint8_t *dst, int64_t j) {
    uint32_t w = 0;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 4; i++) {
            w |= (uint32_t)((q[4 * c + i] >> 4) & 1) << (8 * i + c);
            w |= (uint32_t)((q[16 + 4 * c + i] >> 4) & 1) << (8 * i + 4 + c);
        }
    memcpy(dst + 4 * j, &w, 4);
}
static void put_q6_planes(const uint8_t *q, uint8_t *dst, int64_t j) {
    for (int half = 0; half < 2; half++) {
        uint32_t w = 0;
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < 4; i++) w |= (uint32_t)((q[16 * half + 4 * c + i] >> 4) & 3) << (8 * i + 2 * c);
        memcpy(dst + 64 * half + 4 * j, &w, 4);
    }
}

/* One GGUF unit (block or super-block) of column j -> its place in the tile's unit. 0, or -5 on overflow. */
static int pack_unit(int type, const uint8_t *src, uint8_t *dst, int64_t j) {
    uint8_t q[QK_K];
    uint16_t d;
    memcpy(&d, src, 2);
    switch (type) {
        case QT_Q8_0:
            for (int g = 0; g < 8; g++) memcpy(dst + 64 * g + 4 * j, src + 2 + 4 * g, 4);
            memcpy(dst + 512 + 2 * j, &d, 2);
            return 0;
        case QT_Q4_0: case QT_Q4_1: {
            const uint8_t *qs = src + (type == QT_Q4_1 ? 4 : 2);
            for (int c = 0; c < 4; c++) memcpy(dst + 64 * c + 4 * j, qs + 4 * c, 4);
            uint16_t m;
            int bad = 0;
            if (type == QT_Q4_1) {
                memcpy(&m, src + 2, 2);
            } else {
                float mf = -8.0f * h2f16(d); /* exact: a power-of-two multiple, unless it overflows */
                bad = !isfinite(mf) || fabsf(mf) > 65504.0f;
                m = f2h(mf);
            }
            memcpy(dst + 256 + 2 * j, &d, 2);
            memcpy(dst + 288 + 2 * j, &m, 2);
            return bad ? -5 : 0;
        }
        case QT_Q5_0: {
            uint32_t qh;
            memcpy(&qh, src + 2, 4);
            for (int l = 0; l < 16; l++) {
                q[l] = (uint8_t)((src[6 + l] & 0x0F) | (((qh >> l) & 1) << 4));
                q[l + 16] = (uint8_t)((src[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4));
            }
            put_nibbles(q, dst, j);
            put_q5_plane(q, dst + 256, j);
            memcpy(dst + 320 + 2 * j, &d, 2);
            return 0;
        }
        case QT_Q4_K: case QT_Q5_K: {
            const int five = type == QT_Q5_K;
            const int64_t sub = five ? 352 : 288;
            const uint8_t *sc = src + 4, *qh = src + 16, *qs = src + (five ? 48 : 16);
            memcpy(dst + 2 * j, src, 2);
            memcpy(dst + 32 + 2 * j, src + 2, 2);
            for (int s = 0; s < 8; s++) {
                uint8_t *o = dst + 64 + s * sub;
                for (int l = 0; l < 32; l++) {
                    uint8_t v = (s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 0x0F;
                    q[l] = (uint8_t)(v | (five ? ((qh[l] >> s) & 1) << 4 : 0));
                }
                put_nibbles(q, o, j);
                if (five) put_q5_plane(q, o + 256, j);
                uint8_t scs, ms; /* ggml's get_scale_min_k4 */
                if (s < 4) {
                    scs = sc[s] & 63;
                    ms = sc[s + 4] & 63;
                } else {
                    scs = (uint8_t)((sc[s + 4] & 0x0F) | ((sc[s - 4] >> 6) << 4));
                    ms = (uint8_t)((sc[s + 4] >> 4) | ((sc[s] >> 6) << 4));
                }
                o[sub - 32 + j] = scs;
                o[sub - 16 + j] = ms;
            }
            return 0;
        }
        case QT_Q6_K: {
            const uint8_t *ql = src, *qh = src + 128, *sc = src + 192;
            memcpy(dst + 2 * j, src + 208, 2);
            for (int s = 0; s < 8; s++) { /* block s = weights 32s..32s+31: half h = s / 4, quarter k = s % 4 */
                const int h = s / 4, k = s % 4;
                uint8_t *o = dst + 32 + s * 416;
                for (int l = 0; l < 32; l++) {
                    const uint8_t lo = ql[64 * h + 32 * (k & 1) + l], bits = qh[32 * h + l];
                    q[l] = (uint8_t)(((k < 2 ? lo & 0x0F : lo >> 4)) | (((bits >> (2 * k)) & 3) << 4));
                }
                put_nibbles(q, o, j);
                put_q6_planes(q, o + 256, j);
                o[384 + j] = sc[2 * s];
                o[400 + j] = sc[2 * s + 1];
            }
            return 0;
        }
        default: return -1;
    }
}

/* w: N GGUF rows of K inputs -> out (kvs_qpacked_bytes). -1 bad arguments, -5 a Q4_0 offset overflows fp16. */
int kvs_qpack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    const int64_t total = kvs_qpacked_bytes(type, N, K);
    if (total < 0) return -1;
    if (is_float(type)) {
        memcpy(out, w, (size_t)total);
        return 0;
    }
    const int64_t ue = kvs_qunit_elems(type), nu = K / ue, tb = kvs_qunit_bytes(type), ntiles = (N + NT - 1) / NT;
    const int64_t rb = kvs_row_bytes_of(type, K), gb = rb / nu; /* GGUF bytes per unit */
    memset(out, 0, (size_t)total);
    int bad = 0;
    for (int64_t t = 0; t < ntiles; t++)
        for (int64_t u = 0; u < nu; u++)
            for (int64_t j = 0; j < NT && t * NT + j < N; j++)
                bad |= pack_unit(type, w + (t * NT + j) * rb + u * gb, out + (t * nu + u) * tb, j);
    return bad ? -5 : 0;
}
