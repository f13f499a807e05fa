/* The fast arithmetic on AMX int8 tiles (Sapphire Rapids and later), over tiles unpacked by qunpack.c: the same
 * integers and float32 steps as qtile.h, so the same bits, with the integer dot products on the tile unit.
 * qgemm.c runs it for M >= AMX_FROM_ROWS when the CPU and the OS allow AMX; it is never required.
 *
 *  kvs_qamx_usable   1 when CPUID has AMX-TILE and AMX-INT8 with AVX-512 (F, BW, VL, VNNI), the OS saves tile
 *                    state (XCR0 bits 17, 18) and Linux grants this process the tile data (ARCH_REQ_XCOMP_PERM).
 *  kvs_qamx_rows16   one row tile (16 rows) of an unpacked chunk: per block b, C (16 x 16 int32) = A (the rows'
 *                    int8 inputs, 16 x 32) . B (the block's 8 rows of 4 weights per column), exact; then per row,
 *                    in block order, acc = fma(float(C), D * dx, acc) [; acc = fma(M, dxs, acc)] as in qtile.h.
 *                    Q6_K's halves: two C tiles, from B with the other half zero.
 *  kvs_qamx_peak     the tile unit's rate, for benchmarks.limits.
 */
#define _GNU_SOURCE /* syscall */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif

#include "qgemm.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int cpuid_has_amx(void) {
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int amx = (d >> 24) & 1 && (d >> 25) & 1; /* AMX-TILE, AMX-INT8 */
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!amx || !((c >> 27) & 1)) return 0; /* OSXSAVE: xgetbv is allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3) == 3; /* the OS saves XTILECFG and XTILEDATA */
}

int kvs_qamx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        __builtin_cpu_init();
        int ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && cpuid_has_amx();
#if defined(__linux__)
        ok = ok && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        ok = 0;
#endif
        usable = ok;
    }
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")

/* tiles 0..3: C (16 x 16 int32); 4, 5: A (16 rows x 32 int8); 6, 7: B (8 rows x 64 int8). A constant in
   memory: GCC drops stores to a local that only ldtilecfg reads. */
static const tilecfg kernel_cfg __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 32, 32, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 8, 8}};
static const tilecfg peak_cfg __attribute__((aligned(64))) = {
    .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};

void kvs_qamx_begin(void) { _tile_loadconfig(&kernel_cfg); }

void kvs_qamx_end(void) { _tile_release(); }

/* Blocks are issued to the tile unit a pair ahead of the float steps that consume them: while the vector units
   scale one pair's C tiles, the tile unit multiplies the next pair into the other two C tiles. */
#define TDP(c, a, b_)              \
    do {                           \
        if (sx)                    \
            _tile_dpbssd(c, a, b_); \
        else                       \
            _tile_dpbsud(c, a, b_); \
    } while (0)

/* blocks b (and b + 1 when two) into C tiles c0, c1: A tiles 4, 5 and B tiles 6, 7 */
#define ISSUE_PAIR(c0, c1, b, two)                                                                            \
    do {                                                                                                      \
        _tile_zero(c0);                                                                                       \
        _tile_loadd(4, qx + (b) * 512, 32);                                                                     \
        _tile_loadd(6, wb + (b) * ub, 64);                                                                    \
        TDP(c0, 4, 6);                                                                                        \
        if (two) {                                                                                            \
            _tile_zero(c1);                                                                                   \
            _tile_loadd(5, qx + ((b) + 1) * 512, 32);                                                           \
            _tile_loadd(7, wb + ((b) + 1) * ub, 64);                                                          \
            TDP(c1, 5, 7);                                                                                    \
        }                                                                                                     \
    } while (0)
/* Q6_K's block b into C tiles c0 (weights 0..15), c1 (16..31) */
#define ISSUE_Q6(c0, c1, b, a)                                                                                \
    do {                                                                                                      \
        _tile_zero(c0);                                                                                       \
        _tile_zero(c1);                                                                                       \
        _tile_loadd(a, qx + (b) * 512, 32);                                                                     \
        _tile_loadd(6, wb + (b) * ub, 64);                                                                    \
        _tile_loadd(7, wb + (b) * ub + 256, 64);                                                              \
        _tile_dpbssd(c0, a, 6);                                                                               \
        _tile_dpbssd(c1, a, 7);                                                                               \
    } while (0)

/* one block's C (cb: 16 x 16 int32) -> acc, per row: qtile.h's float steps */
static inline __attribute__((always_inline)) void epilogue(__m512 *acc, const int32_t *cb, const uint8_t *o,
                                                          const float *dxb, const float *dxsb, int offset) {
    const float *sc = (const float *)(o + 512);
    const __m512 D = _mm512_load_ps(sc), M = _mm512_load_ps(sc + 16);
    for (int r = 0; r < 16; r++) {
        const __m512 c = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb + 16 * r)));
        acc[r] = _mm512_fmadd_ps(c, _mm512_mul_ps(D, _mm512_set1_ps(dxb[r])), acc[r]);
        if (offset) acc[r] = _mm512_fmadd_ps(M, _mm512_set1_ps(dxsb[r]), acc[r]);
    }
}

/* Q6_K: sca * C0 + scb * C1 in float32 (exact, see the top), then as the others without the offset */
static inline __attribute__((always_inline)) void epilogue_q6(__m512 *acc, const int32_t *c0, const int32_t *c1,
                                                             const uint8_t *o, const float *dxb) {
    const float *sc = (const float *)(o + 768);
    const __m512 D = _mm512_load_ps(sc), sa = _mm512_load_ps(sc + 16), sb = _mm512_load_ps(sc + 32);
    for (int r = 0; r < 16; r++) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c0 + 16 * r)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c1 + 16 * r)));
        const __m512 is = _mm512_fmadd_ps(hi, sb, _mm512_mul_ps(lo, sa));
        acc[r] = _mm512_fmadd_ps(is, _mm512_mul_ps(D, _mm512_set1_ps(dxb[r])), acc[r]);
    }
}

/* 16 rows from m0 (x's scratch holds whole row tiles: rows past M are zero), stores the first `rows`.
   A three-stage pipeline over steps (a pair of blocks; Q6_K: one block and its two halves): step p + 1 is
   issued to the tile unit, step p's C tiles are stored, and step p - 1's stores (one step old, so committed)
   are scaled into acc. Even steps use C tiles 0, 1 and buffers 0, 1; odd steps 2, 3. */
static inline __attribute__((always_inline)) void rows16(const int type, const uint8_t *wb, int64_t nb,
                                                        const int8_t *qx, const float *dxt, const float *dxst,
                                                        float *part, int first, int last, float *y,
                                                        int64_t ldy, int64_t rows, int64_t ncols,
                                                        const uint8_t *pf, int64_t pf_lines) {
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = first ? _mm512_setzero_ps() : _mm512_load_ps(part + 16 * r);
    int32_t cb[4][256] __attribute__((aligned(64)));
    const int64_t ub = kvs_qup_block_bytes(type);
    const int offset = type != QT_Q8_0 && type != QT_Q6_K;
    const int sx = type == QT_Q8_0; /* signed weights (Q6_K's are signed too: its own path) */
    const int q6 = type == QT_Q6_K;
    const int64_t steps = q6 ? nb : (nb + 1) / 2;
#define ISSUE(c0, c1, p, a)                                                                                   \
    do {                                                                                                      \
        if (q6)                                                                                               \
            ISSUE_Q6(c0, c1, p, a);                                                                           \
        else                                                                                                  \
            ISSUE_PAIR(c0, c1, 2 * (p), 2 * (p) + 1 < nb);                                                   \
    } while (0)
#define STORE(c0, c1, p)                                                                                      \
    do {                                                                                                      \
        _tile_stored(c0, cb[c0], 64);                                                                         \
        if (q6 || 2 * (p) + 1 < nb) _tile_stored(c1, cb[c1], 64);                                            \
    } while (0)
    const int64_t pf_step = (pf_lines + steps - 1) / steps; /* the prefetch spread over the steps */
    ISSUE(0, 1, 0, 4);
    for (int64_t p = 0; p <= steps; p++) {
        for (int64_t i = 0; i < pf_step && pf_lines > 0; i++, pf_lines--, pf += 64)
            _mm_prefetch((const char *)pf, _MM_HINT_T1);
        if (p < steps) {
            if ((p & 1) == 0) {
                if (p + 1 < steps) ISSUE(2, 3, p + 1, 5);
                STORE(0, 1, p);
            } else {
                if (p + 1 < steps) ISSUE(0, 1, p + 1, 4);
                STORE(2, 3, p);
            }
        }
        if (p >= 1) {
            const int64_t e = p - 1;
            const int32_t *c0 = cb[(e & 1) * 2], *c1 = cb[(e & 1) * 2 + 1];
            if (q6) {
                epilogue_q6(acc, c0, c1, wb + e * ub, dxt + e * 16);
            } else {
                const int64_t b = 2 * e;
                epilogue(acc, c0, wb + b * ub, dxt + b * 16, dxst + b * 16, offset);
                if (b + 1 < nb) epilogue(acc, c1, wb + (b + 1) * ub, dxt + (b + 1) * 16, dxst + (b + 1) * 16, offset);
            }
        }
    }
#undef ISSUE
#undef STORE
    if (!last) {
        for (int r = 0; r < 16; r++) _mm512_store_ps(part + 16 * r, acc[r]);
        return;
    }
    const __mmask16 mask = (__mmask16)(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1);
    for (int r = 0; r < 16; r++)
        if (r < rows) _mm512_mask_storeu_ps(y + r * ldy, mask, acc[r]);
}

/* Row tile t of one unpacked chunk (kvs_qup_tile), the type a constant in each case */
void kvs_qamx_rows16(int type, const uint8_t *wb, int64_t nbc, const qtiles *x, int64_t t, int64_t b0, float *part,
                     int first, int last, float *y, int64_t ldy, int64_t rows, int64_t ncols, const uint8_t *pf,
                     int64_t pf_lines) {
    const int8_t *a = x->qt + (t * x->nb + b0) * 512;
    const float *d = x->dx + (t * x->nb + b0) * 16, *ds = x->dxs + (t * x->nb + b0) * 16;
#define ROWS(T) rows16(T, wb, nbc, a, d, ds, part, first, last, y, ldy, rows, ncols, pf, pf_lines)
    switch (type) {
        case QT_Q4_0: ROWS(QT_Q4_0); break;
        case QT_Q4_1: ROWS(QT_Q4_1); break;
        case QT_Q5_0: ROWS(QT_Q5_0); break;
        case QT_Q8_0: ROWS(QT_Q8_0); break;
        case QT_Q4_K: ROWS(QT_Q4_K); break;
        case QT_Q5_K: ROWS(QT_Q5_K); break;
        case QT_Q6_K: ROWS(QT_Q6_K); break;
        default: return;
    }
#undef ROWS
}

/* ---- the tile unit's peak, for benchmarks.limits: `rounds` x 4 independent full-tile products ---------------- */
/* kind 0: TDPBSSD (16 x 16 x 64 int8 multiply-adds each), 1: TDPBF16PS (16 x 16 x 32 bfloat16). Returns the
   instructions issued, -1 without AMX (or, for bf16, without AMX-BF16). */
#pragma GCC push_options
#pragma GCC target("amx-bf16")
int64_t kvs_qamx_peak(int kind, int64_t rounds) {
    if (!kvs_qamx_usable()) return -1;
    if (kind == 1) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        if (!((d >> 22) & 1)) return -1;
    }
    _tile_loadconfig(&peak_cfg);
    static const uint8_t src[16 * 64] __attribute__((aligned(64))) = {0};
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t i = 0; i < rounds; i++) {
        if (kind == 0) {
            _tile_dpbssd(0, 4, 5);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 6, 5);
            _tile_dpbssd(3, 6, 7);
        } else {
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 6, 7);
        }
    }
    _tile_release();
    return 4 * rounds;
}
#pragma GCC pop_options
#pragma GCC pop_options
