/* The fast arithmetic over tiles unpacked to one byte a weight: for products of enough rows of x that unpacking
 * a tile once and multiplying it by every row tile beats unpacking it in registers for each group of rows
 * (qtile.h). Two multipliers: AMX int8 tiles (qamx.c) and AVX-512-VNNI (here). Both compute qtile.h's integers
 * and float32 steps, so the same bits.
 *
 *  kvs_qup_unpack   units of one packed tile (qpack.c: 16 columns) -> per block of 32 inputs: 8 rows of 64 bytes,
 *                   row g = the 4 weights 4g..4g+3 of each column (VNNI's and AMX's operand layout), and the
 *                   block's float scales per column (D, M: the float32 products qtile.h forms; Q6_K: d and its two
 *                   integer half-block scales as floats).
 *  kvs_qup_rows     x's quantized rows (qgemm.c) -> the qtiles layout.
 *  kvs_qup_tile     rows [m0, m0 + rows) of y for one packed tile: unpacked a chunk of K at a time into the calling
 *                   thread's work area (in L1), each chunk multiplied by every row tile of 16 rows, whose partial
 *                   sums wait in the work area between chunks (stored and loaded unchanged: each row's float steps
 *                   stay in block order).
 * x comes as qtiles (qgemm.h): per row tile and block, the 16 rows' 32 int8 inputs side by side, so a row tile's
 * block is one 512-byte piece (AMX's A tile; VNNI broadcasts 4 bytes of it at a constant offset).
 * Q6_K: the block's sum splits at its halves (weights 0..15, 16..31), each with its own integer scale; then
 * sca * lo + scb * hi in float32 is exact (every term an integer below 2^24: |lo|, |hi| <= 16 * 32 * 127,
 * |sc| <= 128) and equals qtile.h's float(int32 sum).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")

static inline __m512 loadh(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 loadu8f(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 loadi8f(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512i ldw(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void stw(uint8_t *p, __m512i v) { _mm512_store_si512((void *)p, v); }

/* nu units of one packed tile -> out (64-byte aligned, nu * units' blocks * kvs_qup_block_bytes); the scales are the
   float32 values qtile.h forms. vnni: the weights as VNNI's unsigned operand (Q6_K: q, 0..63; Q8_0: w + 128), else
   as AMX's (Q6_K: q - 32; Q8_0: w; both signed). */
void kvs_qup_unpack(int type, const uint8_t *tile, int64_t nu, uint8_t *out, int vnni) {
    const int64_t tb = kvs_qunit_bytes(type), ub = kvs_qup_block_bytes(type);
    const int kq = type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K;
    const int five = type == QT_Q5_0 || type == QT_Q5_K;
    const int64_t sub = type == QT_Q4_K ? 288 : type == QT_Q5_K ? 352 : 416, hdr = type == QT_Q6_K ? 32 : 64;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10), m30 = _mm512_set1_epi8(0x30);
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *unit = tile + u * tb;
        __m512 dsup = _mm512_setzero_ps(), ndmin = _mm512_setzero_ps();
        if (kq) {
            dsup = loadh(unit);
            if (type != QT_Q6_K) ndmin = _mm512_mul_ps(loadh(unit + 32), _mm512_set1_ps(-1.0f));
        }
        for (int s = 0; s < (kq ? 8 : 1); s++) {
            const uint8_t *blk = kq ? unit + hdr + s * sub : unit;
            uint8_t *o = out + ((kq ? u * 8 + s : u)) * ub;
            float *sc = (float *)(o + (type == QT_Q6_K ? 768 : 512));
            if (type == QT_Q8_0) {
                const __m512i flip = _mm512_set1_epi8(vnni ? (char)0x80 : 0);
                for (int g = 0; g < 8; g++) stw(o + 64 * g, _mm512_xor_si512(ldw(blk + 64 * g), flip));
                _mm512_store_ps(sc, loadh(blk + 512));
            } else if (type == QT_Q6_K) {
                /* lo (weights 0..15) | 256 zero bytes | hi (16..31): AMX's B_lo = the first 512 bytes, B_hi = the 512
                   from byte 256 */
                const __m512i b32 = _mm512_set1_epi8(vnni ? 0 : 32), P0 = ldw(blk + 256), P1 = ldw(blk + 320);
                for (int c = 0; c < 4; c++) {
                    const __m512i w = ldw(blk + 64 * c);
                    const int up = 4 - 2 * c; /* the 2-bit plane of chunk c to bits 4, 5 */
                    const __m512i t0 = up >= 0 ? _mm512_slli_epi32(P0, up) : _mm512_srli_epi32(P0, -up);
                    const __m512i t1 = up >= 0 ? _mm512_slli_epi32(P1, up) : _mm512_srli_epi32(P1, -up);
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(w, m4), _mm512_and_si512(t0, m30));
                    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), m4),
                                                       _mm512_and_si512(t1, m30));
                    stw(o + 64 * c, _mm512_sub_epi8(lo, b32));
                    stw(o + 256 + 64 * c, _mm512_setzero_si512());
                    stw(o + 512 + 64 * c, _mm512_sub_epi8(hi, b32));
                }
                _mm512_store_ps(sc, dsup);
                _mm512_store_ps(sc + 16, loadi8f(blk + 384));
                _mm512_store_ps(sc + 32, loadi8f(blk + 400));
            } else {
                const __m512i P = five ? ldw(blk + 256) : _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    const __m512i w = ldw(blk + 64 * c);
                    __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
                    if (five) {
                        const __m512i pl = _mm512_slli_epi32(P, 4 - c), ph = _mm512_srli_epi32(P, c);
                        lo = _mm512_or_si512(lo, _mm512_and_si512(pl, m10));
                        hi = _mm512_or_si512(hi, _mm512_and_si512(ph, m10));
                    }
                    stw(o + 64 * c, lo);
                    stw(o + 64 * (4 + c), hi);
                }
                __m512 D, M;
                if (type == QT_Q4_K || type == QT_Q5_K) {
                    const uint8_t *scm = blk + sub - 32;
                    D = _mm512_mul_ps(dsup, loadu8f(scm));
                    M = _mm512_mul_ps(ndmin, loadu8f(scm + 16));
                } else if (type == QT_Q5_0) {
                    D = loadh(blk + 320);
                    M = _mm512_mul_ps(D, _mm512_set1_ps(-16.0f));
                } else {
                    D = loadh(blk + 256);
                    M = loadh(blk + 288);
                }
                _mm512_store_ps(sc, D);
                _mm512_store_ps(sc + 16, M);
            }
        }
    }
}

/* VNNI: 8 rows (h: the first or second half of row tile t) of one chunk's blocks, into acc */
static inline __attribute__((always_inline)) void vnni8(const int type, const uint8_t *wb, int64_t nbc,
                                                       const qtiles *x, int64_t t, int64_t b0, int h, __m512 *acc,
                                                       const uint8_t *pf, int64_t pf_lines) {
    const int64_t ub = kvs_qup_block_bytes(type), pf_step = (pf_lines + nbc - 1) / nbc;
    const int offset = type != QT_Q8_0 && type != QT_Q6_K;
    for (int64_t b = 0; b < nbc; b++) {
        for (int64_t i = 0; i < pf_step && pf_lines > 0; i++, pf_lines--, pf += 64)
            _mm_prefetch((const char *)pf, _MM_HINT_T1);
        const uint8_t *o = wb + b * ub;
        const int64_t i = (t * x->nb + b0 + b) * 16 + 8 * h; /* this block's scales of the 8 rows */
        const int8_t *xb = x->qt + i * 32;                     /* row r's 32 inputs at xb + 32 r */
        const float *sc = (const float *)(o + (type == QT_Q6_K ? 768 : 512));
        const __m512 D = _mm512_load_ps(sc);
        if (type == QT_Q6_K) {
            __m512i lo[8], hi[8];
            for (int r = 0; r < 8; r++) lo[r] = hi[r] = _mm512_setzero_si512();
            for (int g = 0; g < 4; g++) {
                const __m512i wl = _mm512_load_si512((const void *)(o + 64 * g));
                const __m512i wh = _mm512_load_si512((const void *)(o + 512 + 64 * g));
                for (int r = 0; r < 8; r++) {
                    int32_t a, c;
                    memcpy(&a, xb + 32 * r + 4 * g, 4);
                    memcpy(&c, xb + 32 * r + 16 + 4 * g, 4);
                    lo[r] = _mm512_dpbusd_epi32(lo[r], wl, _mm512_set1_epi32(a));
                    hi[r] = _mm512_dpbusd_epi32(hi[r], wh, _mm512_set1_epi32(c));
                }
            }
            const __m512 sa = _mm512_load_ps(sc + 16), sb = _mm512_load_ps(sc + 32);
            for (int r = 0; r < 8; r++) {
                const __m512 l = _mm512_cvtepi32_ps(_mm512_sub_epi32(lo[r], _mm512_set1_epi32(x->bslo[i + r])));
                const __m512 u = _mm512_cvtepi32_ps(_mm512_sub_epi32(hi[r], _mm512_set1_epi32(x->bshi[i + r])));
                const __m512 is = _mm512_fmadd_ps(u, sb, _mm512_mul_ps(l, sa)); /* exact: see the top */
                acc[r] = _mm512_fmadd_ps(is, _mm512_mul_ps(D, _mm512_set1_ps(x->dx[i + r])), acc[r]);
            }
        } else {
            __m512i is[8];
            for (int r = 0; r < 8; r++) is[r] = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) {
                const __m512i w = _mm512_load_si512((const void *)(o + 64 * g));
                for (int r = 0; r < 8; r++) {
                    int32_t a;
                    memcpy(&a, xb + 32 * r + 4 * g, 4);
                    is[r] = _mm512_dpbusd_epi32(is[r], w, _mm512_set1_epi32(a));
                }
            }
            const __m512 M = _mm512_load_ps(sc + 16);
            for (int r = 0; r < 8; r++) {
                if (type == QT_Q8_0) is[r] = _mm512_sub_epi32(is[r], _mm512_set1_epi32(x->sx128[i + r]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(D, _mm512_set1_ps(x->dx[i + r])),
                                         acc[r]);
                if (offset) acc[r] = _mm512_fmadd_ps(M, _mm512_set1_ps(x->dxs[i + r]), acc[r]);
            }
        }
    }
}

/* Row tile t (its first `rows` rows stored) of one chunk on VNNI: partial sums in part (16 x 16) between chunks */
static void vnni_rows16(int type, const uint8_t *wb, int64_t nbc, const qtiles *x, int64_t t, int64_t b0,
                        float *part, int first, int last, float *y, int64_t ldy, int64_t rows, int64_t ncols,
                        const uint8_t *pf, int64_t pf_lines) {
    const __mmask16 mask = (__mmask16)(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1);
    for (int h = 0; h < 2 && 8 * h < rows; h++) {
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(part + 16 * (8 * h + r));
        switch (type) {
            case QT_Q4_0: vnni8(QT_Q4_0, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q4_1: vnni8(QT_Q4_1, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q5_0: vnni8(QT_Q5_0, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q8_0: vnni8(QT_Q8_0, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q4_K: vnni8(QT_Q4_K, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q5_K: vnni8(QT_Q5_K, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            case QT_Q6_K: vnni8(QT_Q6_K, wb, nbc, x, t, b0, h, acc, h ? NULL : pf, h ? 0 : pf_lines); break;
            default: return;
        }
        for (int r = 0; r < 8; r++) {
            if (!last)
                _mm512_store_ps(part + 16 * (8 * h + r), acc[r]);
            else if (8 * h + r < rows)
                _mm512_mask_storeu_ps(y + (8 * h + r) * ldy, mask, acc[r]);
        }
    }
}
#pragma GCC pop_options

/* x's quantized rows, row by row (xr: qtile.h's layout) -> qtiles' layout, whole row tiles (padding rows zero) */
void kvs_qup_rows(const qrows *xr, int64_t M, int64_t K, int8_t *qt, float *dxt, float *dxst, int32_t *sx128,
                      int32_t *bslo, int32_t *bshi) {
    const int64_t nb = K / QK, M16 = (M + 15) / 16 * 16;
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M16; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = (m / 16 * nb + b) * 16 + m % 16, j = m * nb + b;
            if (m < M) {
                memcpy(qt + i * 32, xr->qx + m * K + b * QK, QK);
                dxt[i] = xr->dx[j];
                dxst[i] = xr->dxs[j];
                sx128[i] = 128 * xr->sx[j];
                bslo[i] = xr->bs32[2 * j];
                bshi[i] = xr->bs32[2 * j + 1];
            } else {
                memset(qt + i * 32, 0, QK);
                dxt[i] = dxst[i] = 0.0f;
                sx128[i] = bslo[i] = bshi[i] = 0;
            }
        }
}

/* Units (blocks of 32, or super-blocks of 256) unpacked at a time: the whole tile when it unpacks into at most
   CHUNK_MAX bytes, else chunks of at most CHUNK bytes, which stay in L1 while every row tile of the pass multiplies
   them (each chunk restarts the AMX pipeline once per row tile: no smaller than needed). */
#define CHUNK_MAX (32 << 10)
#define CHUNK (16 << 10)
static int64_t chunk_units(int type, int64_t nu) {
    const int64_t unit = kvs_qup_block_bytes(type) * (kvs_qunit_elems(type) / QK);
    if (nu * unit <= CHUNK_MAX) return nu;
    return CHUNK / unit > 0 ? CHUNK / unit : 1;
}

#define WORK_ACC (256 * 16 * 4) /* partial sums of the pass's rows (at most 256) between chunks */
int64_t kvs_qup_work_bytes(void) { return WORK_ACC + CHUNK_MAX; }

/* Rows [m0, m0 + rows) (m0 a multiple of 16, rows <= 256) of one packed tile's 16 columns, on AMX (inside
   kvs_qamx_begin / kvs_qamx_end) or VNNI. work: kvs_qup_work_bytes, 64-byte aligned. next, next_bytes: the tile
   this thread multiplies next (or NULL), prefetched into L2 a few lines per block step while this one is
   multiplied, so that its unpacking does not wait on memory (a decode step reads its weights from DRAM) and the
   prefetches never queue up in bursts. */
void kvs_qup_tile(int amx, int type, const uint8_t *tile, int64_t K, const qtiles *x, int64_t m0, int64_t rows,
                  float *y, int64_t ldy, int64_t ncols, uint8_t *work, const uint8_t *next, int64_t next_bytes) {
    const int64_t ue = kvs_qunit_elems(type), nu = K / ue, bpu = ue / QK, cu = chunk_units(type, nu);
    const int64_t pieces = (nu + cu - 1) / cu * ((rows + 15) / 16); /* (chunk, row tile) pairs */
    const int64_t lines = next ? (next_bytes + 63) / 64 : 0, per = (lines + pieces - 1) / pieces;
    int64_t fetched = 0; /* lines of next prefetched so far */
    float *part = (float *)work;
    uint8_t *wb = work + WORK_ACC;
    for (int64_t u0 = 0; u0 < nu; u0 += cu) {
        const int64_t nuc = nu - u0 < cu ? nu - u0 : cu, b0 = u0 * bpu, nbc = nuc * bpu;
        kvs_qup_unpack(type, tile + u0 * kvs_qunit_bytes(type), nuc, wb, !amx);
        const int first = u0 == 0, last = u0 + nuc == nu;
        for (int64_t m = m0; m < m0 + rows; m += 16) {
            const int64_t pf_lines = lines - fetched < per ? lines - fetched : per;
            const uint8_t *pf = next ? next + 64 * fetched : NULL;
            fetched += pf_lines;
            const int64_t n = m0 + rows - m < 16 ? m0 + rows - m : 16;
            float *yr = y + (m - m0) * ldy, *pr = part + (m - m0) * 16;
            if (amx)
                kvs_qamx_rows16(type, wb, nbc, x, m / 16, b0, pr, first, last, yr, ldy, n, ncols, pf, pf_lines);
            else
                vnni_rows16(type, wb, nbc, x, m / 16, b0, pr, first, last, yr, ldy, n, ncols, pf, pf_lines);
        }
    }
}
