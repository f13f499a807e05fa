/* The fast arithmetic's shared definitions: packed tile sizes (qpack.c) and the quantized rows of x (qgemm.c). */
#ifndef KVS_QGEMM_H
#define KVS_QGEMM_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kvs.h"

#define NT 16 /* output columns per packed tile */

int64_t kvs_qunit_elems(int type);
int64_t kvs_qunit_bytes(int type);
int64_t kvs_qpacked_bytes(int type, int64_t N, int64_t K);

/* x (M, K) quantized row by row, per block b of 32 inputs: int8 qx, scale dx = max|x| / 127, sx = sum(qx),
   dxs = dx * sx (the offset term of Q4_0/Q4_1/Q5_0 and the K-quants' mins), and bs32 = 32 * (sum of qx over
   inputs 0..15, over 16..31) (Q6_K's -32 offset, per half block). */
typedef struct {
    const int8_t *qx;            /* (M, K) */
    const float *dx, *dxs;       /* (M, K/32) */
    const int32_t *sx, *bs32;    /* (M, K/32), (M, K/32, 2) */
} qrows;

typedef void (*tile_fn)(int type, const uint8_t *tile, int64_t nu, const qrows *x, int64_t K, int64_t m0,
                        int64_t mr, float *y, int64_t ldy, int64_t ncols);

/* x for the unpacked-tile paths (qunpack.c, qamx.c): per row tile of 16 rows and block b, the 16 rows' 32 int8
   inputs side by side (512 bytes, row r at 32 r) and their per-block values (16 each, rows past M zero) */
typedef struct {
    const int8_t *qt;                   /* (M16 / 16, nb, 16, 32) */
    const float *dx, *dxs;              /* (M16 / 16, nb, 16) */
    const int32_t *sx128, *bslo, *bshi; /* 128 sum(qx) (Q8_0's offset on VNNI), 32 sum of each half (Q6_K's) */
    int64_t nb;
} qtiles;

void kvs_qup_rows(const qrows *xr, int64_t M, int64_t K, int8_t *qt, float *dxt, float *dxst, int32_t *sx128,
                  int32_t *bslo, int32_t *bshi);
int64_t kvs_qup_work_bytes(void);
void kvs_qup_unpack(int type, const uint8_t *tile, int64_t nu, uint8_t *out, int vnni);
void kvs_qup_tile(int amx, int type, const uint8_t *tile, int64_t K, const qtiles *x, int64_t m0, int64_t rows,
                  float *y, int64_t ldy, int64_t ncols, uint8_t *work, const uint8_t *next, int64_t next_bytes);
/* one row of x (qvec.c): AVX-512-VNNI, the types kvs_qvec_takes */
#ifndef PF_AHEAD
#define PF_AHEAD 2048 /* bytes ahead of the block being multiplied that one-row products prefetch into L2 */
#endif
int kvs_qvec_takes(int type);
void kvs_qvec_tile(int type, const uint8_t *tile, int64_t nu, const qrows *x, float *y, int64_t ncols);
/* AMX int8 tiles (qamx.c) */
int kvs_qamx_usable(void);
void kvs_qamx_begin(void);
void kvs_qamx_end(void);
void kvs_qamx_rows16(int type, const uint8_t *wb, int64_t nbc, const qtiles *x, int64_t t, int64_t b0, float *part,
                     int first, int last, float *y, int64_t ldy, int64_t rows, int64_t ncols, const uint8_t *pf,
                     int64_t pf_lines);
int64_t kvs_qamx_peak(int kind, int64_t rounds);

static inline int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
#endif
