/* kvseal's fast matrix products: int8 activations times the weights' own 4/5/6/8-bit blocks with integer dot
 * products, or float weights (F32, F16, BF16) as they are.
 *
 *  kvs_qlinear_mat     y (M, N) = x (M, K) @ W^T for a matrix of row segments (kvs.h), each packed by kvs_qpack
 *                      (qpack.c) from its own block type: each row of x is quantized once to int8 per block of 32
 *                      (scale = max|x| / 127, round to nearest even), the 32-term dot products are exact int32
 *                      sums (with the weights' integer sub-block scales for Q6_K), then scaled in float32 block by
 *                      block in a fixed order (qtile.h). Segments of mixed types (q|k Q4_K, v Q6_K) run fused:
 *                      one quantization of x, one parallel pass over all their tiles. Float segments are multiplied
 *                      as stored by the exact kernel (kvs_gemm_ld: float32 FMA, also batch invariant).
 *  kvs_qlinear         one segment, scratch of its own.
 *  kvs_qisa            which instruction set the dispatcher picked (4 amx-int8: AMX tiles from AMX_FROM_ROWS rows
 *                      of x, AVX-512-VNNI below; 3 avx512-vnni, 2 avx-vnni, 1 avx2); each set is checked on its own
 *                      (kvs_qisa_have, kvs_qisa_pick), and KVSEAL_QISA naming one the CPU lacks is refused
 *                      (kvs_qisa_refused), never run
 *
 * Invariant (batch invariance): an element y[m, n] is computed by one thread, from row m of x and column n of
 * W only, with the same float operations in the same order whatever M is, whichever rows share the call, and
 * whichever instruction set runs it (the integer sums are exact; the float steps are the same lane-wise fma/mul
 * on every path). So a request's output does not depend on what else is in the batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

#ifndef MR512
#define MR512 8 /* rows of x per micro-kernel call: 512-bit paths (32 registers) */
#endif
#ifndef AMX_FROM_ROWS
#define AMX_FROM_ROWS 16 /* rows of x from which the AMX path runs (below: AVX-512-VNNI, the same bits) */
#endif
/* Rows of x from which AVX-512-VNNI multiplies unpacked tiles (qunpack.c) rather than unpacking in registers per
   group of rows (qtile.h), by block type (measured on Sapphire Rapids: Q6_K's in-register unpacking costs more) */
static int64_t unpack_from(int type) { return type == QT_Q6_K || type == QT_Q5_K ? 8 : 24; }
#define MR256 6 /* 256-bit paths (16 registers): 6 rows for the 4/5-bit types, 4 for Q6_K and Q8_0 (measured:
                   their extra weight registers make 6 rows spill) */

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

/* One row of x -> int8 qx (K), per block: dx = max|x| / 127 (0 for an all-zero block), sx = sum(qx),
   dxs = dx * sx (Q4's offset term); q = x * (127 / max|x|) rounded to nearest even, within [-127, 127].
   AVX2 (the library's baseline): lane-wise the same operations as the scalar definition, so every CPU that
   runs kvseal gets the same bits. */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *dx, int32_t *sx, float *dxs, int32_t *bs32) {
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
        /* q[0] + q[1] holds inputs 0..15 (in 8 lanes), q[2] + q[3] inputs 16..31 */
        __m256i ha = _mm256_add_epi32(q[0], q[1]), hb2 = _mm256_add_epi32(q[2], q[3]);
        bs32[2 * b] = 32 * hsum_epi32(ha);
        bs32[2 * b + 1] = 32 * hsum_epi32(hb2);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const int32_t s = _mm_cvtsi128_si32(s4);
        dx[b] = d;
        sx[b] = s;
        dxs[b] = d * (float)s;
    }
}


/* ---- the micro-kernel per instruction set (qtile.h) ------------------------------------------------------ */
#define F_SET1(v) _mm256_set1_ps(v)
#define F_ZERO() _mm256_setzero_ps()
#define F_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define F_MUL(a, b) _mm256_mul_ps(a, b)
#define F_CVT(i) _mm256_cvtepi32_ps(i)
#define F_LOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F_LOADU8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define I_ZERO() _mm256_setzero_si256()
#define I_SET1_8(v) _mm256_set1_epi8(v)
#define I_SET1_32(v) _mm256_set1_epi32(v)
#define I_LOADW(p) _mm256_loadu_si256((const __m256i *)(p))
#define I_LOADI8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define I_AND(a, b) _mm256_and_si256(a, b)
#define I_OR(a, b) _mm256_or_si256(a, b)
#define I_SRLI16(a, n) _mm256_srli_epi16(a, n)
#define I_SLLI32(a, n) _mm256_slli_epi32(a, n)
#define I_SRLI32(a, n) _mm256_srli_epi32(a, n)
#define I_ADD32(a, b) _mm256_add_epi32(a, b)
#define I_SUB32(a, b) _mm256_sub_epi32(a, b)
#define I_MULLO(a, b) _mm256_mullo_epi32(a, b)
#define VF __m256
#define VI __m256i
#define NV 8
#define MRX MR256
#define STORE(yp, v, nc)                                                   \
    do {                                                                   \
        if ((nc) >= 8) {                                                   \
            _mm256_storeu_ps(yp, v);                                       \
        } else if ((nc) > 0) {                                             \
            float tmp_[8];                                                 \
            _mm256_storeu_ps(tmp_, v);                                     \
            memcpy(yp, tmp_, sizeof(float) * (size_t)(nc));                \
        }                                                                  \
    } while (0)
#define TILE_ROWS(T) TILE_CASE(T, 6) TILE_CASE(T, 5) TILE_CASE(T, 4) TILE_CASE(T, 3) TILE_CASE(T, 2)
#define Q8_FIX(is, sx) ((void)0)

/* AVX2: u8 x s8 pairs -> s16 (8 products of 4-bit weights, 4 of 5-bit, 2 of 6-bit fit in s16: at most
   8 * 2 * 15 * 127 < 32768), flushed to s32 by a multiply-add with ones. Q8_0: |w| x (x signed like w), each pair
   at most 2 * 128 * 127, flushed at once. The sums are the same integers as VNNI's. */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ISA avx2
#define PROD(a, u, s) _mm256_add_epi16(a, _mm256_maddubs_epi16(u, s))
#define FLUSH(is, a) (is = _mm256_add_epi32(is, _mm256_madd_epi16(a, _mm256_set1_epi16(1))), a = _mm256_setzero_si256())
#define Q8_DOT(is, w, xv) \
    (is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), _mm256_set1_epi16(1))))
#include "qtile.h"
#undef ISA
#undef PROD
#undef FLUSH
#undef Q8_DOT
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define ISA avxvnni
#define PROD(a, u, s) _mm256_dpbusd_avx_epi32(a, u, s)
#define FLUSH(is, a) (is = _mm256_add_epi32(is, a), a = _mm256_setzero_si256())
#define Q8_DOT(is, w, xv) (is = _mm256_dpbusd_avx_epi32(is, _mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)))
#include "qtile.h"
#undef ISA
#undef PROD
#undef FLUSH
#undef Q8_DOT
#pragma GCC pop_options

#undef F_SET1
#undef F_ZERO
#undef F_FMA
#undef F_MUL
#undef F_CVT
#undef F_LOADH
#undef F_LOADU8
#undef I_ZERO
#undef I_SET1_8
#undef I_SET1_32
#undef I_LOADW
#undef I_LOADI8
#undef I_AND
#undef I_OR
#undef I_SRLI16
#undef I_SLLI32
#undef I_SRLI32
#undef I_ADD32
#undef I_SUB32
#undef I_MULLO
#undef VF
#undef VI
#undef NV
#undef MRX
#undef STORE
#undef TILE_ROWS
#undef Q8_FIX

/* AVX-512 VNNI: one 512-bit vector = the 16 columns of a tile. Q8_0 as (w + 128) x x - 128 sum(x). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")
#define F_SET1(v) _mm512_set1_ps(v)
#define F_ZERO() _mm512_setzero_ps()
#define F_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define F_MUL(a, b) _mm512_mul_ps(a, b)
#define F_CVT(i) _mm512_cvtepi32_ps(i)
#define F_LOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F_LOADU8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define I_ZERO() _mm512_setzero_si512()
#define I_SET1_8(v) _mm512_set1_epi8(v)
#define I_SET1_32(v) _mm512_set1_epi32(v)
#define I_LOADW(p) _mm512_loadu_si512((const void *)(p))
#define I_LOADI8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define I_AND(a, b) _mm512_and_si512(a, b)
#define I_OR(a, b) _mm512_or_si512(a, b)
#define I_SRLI16(a, n) _mm512_srli_epi16(a, n)
#define I_SLLI32(a, n) _mm512_slli_epi32(a, n)
#define I_SRLI32(a, n) _mm512_srli_epi32(a, n)
#define I_ADD32(a, b) _mm512_add_epi32(a, b)
#define I_SUB32(a, b) _mm512_sub_epi32(a, b)
#define I_MULLO(a, b) _mm512_mullo_epi32(a, b)
#define VF __m512
#define VI __m512i
#define NV 16
#define MRX MR512
#define STORE(yp, v, nc) \
    _mm512_mask_storeu_ps(yp, (__mmask16)((nc) >= 16 ? 0xFFFF : (1u << (nc)) - 1), v)
#define TILE_ROWS(T) \
    TILE_CASE(T, 8) TILE_CASE(T, 7) TILE_CASE(T, 6) TILE_CASE(T, 5) TILE_CASE(T, 4) TILE_CASE(T, 3) TILE_CASE(T, 2)
#define ISA avx512
#define PROD(a, u, s) _mm512_dpbusd_epi32(a, u, s)
#define FLUSH(is, a) (is = _mm512_add_epi32(is, a), a = _mm512_setzero_si512())
#define Q8_DOT(is, w, xv) (is = _mm512_dpbusd_epi32(is, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), xv))
#define Q8_FIX(is, sx) (is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * (sx))))
#include "qtile.h"
#pragma GCC pop_options

/* The integer instruction sets this CPU has, as a mask: bit 1 AVX2 (the library's baseline), bit 2 AVX-VNNI, bit 3
   AVX-512-VNNI (with the F, BW and VL parts the AVX-512 tiles use), bit 4 AMX-INT8 (with AVX-512-VNNI, tile state
   saved by the OS and granted to this process: qamx.c). They are independent features, not a ladder: Zen 4, Ice
   Lake and Cascade Lake have AVX-512-VNNI but no AVX-VNNI; Alder Lake has AVX-VNNI but no AVX-512. */
int kvs_qisa_have(void) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return (avx2 << 1) | ((avx2 && __builtin_cpu_supports("avxvnni")) << 2) | (avx512 << 3) |
           ((avx512 && kvs_qamx_usable()) << 4);
}

/* The set to run for a CPU with sets `have` (kvs_qisa_have's mask) when `forced` (KVSEAL_QISA; 0: none) asks for
   one: the forced one only if the CPU has it, else the best it has. Each set is checked on its own. */
int kvs_qisa_pick(int have, int forced) {
    if (forced >= 1 && forced <= 4 && ((have >> forced) & 1)) return forced;
    return (have >> 4) & 1 ? 4 : (have >> 3) & 1 ? 3 : (have >> 2) & 1 ? 2 : 1;
}

static int qisa_forced(void) { /* KVSEAL_QISA (tests: a lower path on a CPU that has a higher one); 0: unset,
                                  -1: not one of 1, 2, 3, 4 */
    const char *force = getenv("KVSEAL_QISA");
    if (!force || !*force) return 0;
    return (force[0] >= '1' && force[0] <= '4' && !force[1]) ? force[0] - '0' : -1;
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

/* Rows of x in the unpacked paths' layout: whole row tiles of 16 (the padding rows are zero). */
static int64_t padded_rows(int64_t M) { return (M + 15) / 16 * 16; }

/* Bytes of scratch kvs_qlinear_mat needs for M rows of K inputs: the int8 rows and their block sums and scales,
   row by row (qtile.h), and again per row tile (the unpacked paths: qtiles). */
int64_t kvs_qscratch_bytes(int64_t M, int64_t K) {
    return M * K + M * (K / QK) * 20 + padded_rows(M) * K + padded_rows(M) * (K / QK) * 20;
}

static int is_float(int type) { return type == QT_F32 || type == QT_F16 || type == QT_BF16; }

/* The unpacked paths' rows per pass over the tiles: x's int8 rows of one pass stay in this core's L2 (about 1 MB)
   while every tile is multiplied by them. */
static int64_t pass_rows(int64_t K) {
    int64_t r = (1 << 20) / K / 16 * 16;
    return r < 32 ? 32 : r > 256 ? 256 : r;
}

/* One thread's work area for the unpacked paths (kvs_qup_work_bytes), kept between calls. */
static _Thread_local uint8_t *up_work;

static uint8_t *work_area(void) {
    if (!up_work) up_work = aligned_alloc(64, (size_t)((kvs_qup_work_bytes() + 63) / 64 * 64));
    return up_work;
}

typedef struct {
    const kvs_mat *mat;
    const int64_t *tile0; /* first tile of each segment in the pass */
    int64_t K;
} tiles;

/* tile t of the pass -> its segment's type, packed data, units, output columns and their count */
static const uint8_t *tile_at(const tiles *ts, int64_t t, int *type, int64_t *nu, int64_t *col, int64_t *ncols) {
    int s = 0;
    int64_t c0 = 0;
    while (t >= ts->tile0[s + 1]) c0 += ts->mat->rows[s++];
    *type = ts->mat->type[s];
    const int64_t lt = t - ts->tile0[s];
    *nu = ts->K / kvs_qunit_elems(*type);
    *col = c0 + lt * NT;
    *ncols = ts->mat->rows[s] - lt * NT < NT ? ts->mat->rows[s] - lt * NT : NT;
    return ts->mat->data[s] + lt * *nu * kvs_qunit_bytes(*type);
}

/* y (M, N) = x (M, K) @ W^T, N the rows of all segments, with caller-owned scratch (kvs_qscratch_bytes).
   Threads split the tiles of every quantized segment in one pass (never K). */
int kvs_qlinear_mat(const kvs_mat *mat, int64_t K, const float *x, int64_t M, float *y, void *scratch) {
    if (mat->nseg < 1 || mat->nseg > KVS_MAXSEG || M <= 0) return -1;
    const int64_t N = kvs_mat_rows(mat), nb = K / QK, M16 = padded_rows(M);
    int64_t tile0[KVS_MAXSEG + 1] = {0}; /* first tile of each segment in the pass; float segments have none */
    for (int s = 0; s < mat->nseg; s++) {
        if (mat->rows[s] <= 0 || kvs_qpacked_bytes(mat->type[s], mat->rows[s], K) < 0) return -1;
        tile0[s + 1] = tile0[s] + (is_float(mat->type[s]) ? 0 : (mat->rows[s] + NT - 1) / NT);
    }
    const int64_t ntiles = tile0[mat->nseg];
    if (ntiles > 0) {
        int8_t *qx = (int8_t *)scratch;
        float *dx = (float *)(qx + M * K), *dxs = dx + M * nb;
        int32_t *sx = (int32_t *)(dxs + M * nb), *bs32 = sx + M * nb;
        int8_t *qt = (int8_t *)(bs32 + 2 * M * nb);
        float *dxt = (float *)(qt + M16 * K), *dxst = dxt + M16 * nb;
        int32_t *sx128 = (int32_t *)(dxst + M16 * nb), *bslo = sx128 + M16 * nb, *bshi = bslo + M16 * nb;
#pragma omp parallel for schedule(static) if (M * K > 16384)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, K, qx + m * K, dx + m * nb, sx + m * nb, dxs + m * nb, bs32 + 2 * m * nb);
        const qrows xr = {qx, dx, dxs, sx, bs32};
        const int isa = chosen_isa();
        const tiles ts = {mat, tile0, K};
        const int amx = isa == 4 && M >= AMX_FROM_ROWS;
        int unpacked = amx; /* does any tile run on unpacked tiles */
        for (int s = 0; s < mat->nseg; s++) unpacked |= isa >= 3 && !is_float(mat->type[s]) && M >= unpack_from(mat->type[s]);
        const qtiles xt = {qt, dxt, dxst, sx128, bslo, bshi, nb};
        if (unpacked) kvs_qup_rows(&xr, M, K, qt, dxt, dxst, sx128, bslo, bshi);
        const int64_t pass = unpacked ? pass_rows(K) : M;
        const tile_fn fn = isa >= 3 ? tile_avx512 : isa == 2 ? tile_avxvnni : tile_avx2;
        int failed = 0;
#pragma omp parallel reduction(| : failed)
        {
            if (amx) kvs_qamx_begin();
            for (int64_t m0 = 0; m0 < M; m0 += pass) {
                const int64_t rows = M - m0 < pass ? M - m0 : pass;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < ntiles; t++) {
                    int type;
                    int64_t nu, col, ncols;
                    const uint8_t *tile = tile_at(&ts, t, &type, &nu, &col, &ncols);
                    float *yt = y + m0 * N + col;
                    if (amx || (isa >= 3 && M >= unpack_from(type))) {
                        uint8_t *work = work_area();
                        const uint8_t *next = NULL;
                        int64_t next_bytes = 0;
                        if (t + 1 < ntiles) {
                            int nt;
                            int64_t nnu, ncol, nnc;
                            next = tile_at(&ts, t + 1, &nt, &nnu, &ncol, &nnc);
                            next_bytes = nnu * kvs_qunit_bytes(nt);
                        }
                        if (work)
                            kvs_qup_tile(amx, type, tile, K, &xt, m0, rows, yt, N, ncols, work, next, next_bytes);
                        else
                            failed = 1;
                        continue;
                    }
                    if (M == 1 && isa >= 3 && kvs_qvec_takes(type)) {
                        kvs_qvec_tile(type, tile, nu, &xr, yt, ncols);
                        continue;
                    }
                    const int64_t mr = isa >= 3 ? MR512 : type == QT_Q6_K || type == QT_Q8_0 ? 4 : MR256;
                    for (int64_t m = 0; m < rows; m += mr)
                        fn(type, tile, nu, &xr, K, m0 + m, rows - m < mr ? rows - m : mr, yt + m * N, N, ncols);
                }
            }
            if (amx) kvs_qamx_end();
        }
        if (failed) return -4;
    }
    int64_t c0 = 0;
    for (int s = 0; s < mat->nseg; c0 += mat->rows[s], s++)
        if (is_float(mat->type[s])) {
            int rc = kvs_gemm_ld(mat->type[s], mat->data[s], mat->rows[s], K, x, M, y + c0, N);
            if (rc) return rc;
        }
    return 0;
}

/* one packed segment, scratch of its own */
int kvs_qlinear(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    if (kvs_qpacked_bytes(type, N, K) < 0 || M <= 0) return -1;
    void *scratch = malloc((size_t)kvs_qscratch_bytes(M, K));
    if (!scratch) return -4;
    kvs_mat mat = {1, {type}, {N}, {packed}};
    int rc = kvs_qlinear_mat(&mat, K, x, M, y, scratch);
    free(scratch);
    return rc;
}
