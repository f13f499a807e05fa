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

/* AMX int8 tiles (qamx.c) */
int kvs_qamx_usable(void);
int64_t kvs_qamx_work_bytes(void);
void kvs_qamx_begin(void);
void kvs_qamx_end(void);
void kvs_qamx_unpack(int type, const uint8_t *tile, int64_t nu, uint8_t *out);
void kvs_qamx_tile(int type, const uint8_t *tile, int64_t K, const int8_t *qx, const float *dxt, const float *dxst,
                   int64_t m0, int64_t rows, float *y, int64_t ldy, int64_t ncols, uint8_t *work);
int64_t kvs_qamx_peak(int kind, int64_t rounds);

static inline int32_t ld32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
#endif
