/* Shared by kvseal's C kernels: the GGML block types they take, and the matrix and layer descriptors that
 * ops.py builds with ctypes (MatDesc, LayerDesc). */
#ifndef KVS_H
#define KVS_H
#include <stdint.h>

/* GGML type ids */
enum {
    QT_F32 = 0, QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q8_0 = 8,
    QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14, QT_BF16 = 30,
};
#define QK 32    /* weights per block of the 32-block types; the fast arithmetic quantizes inputs per 32 */
#define QK_K 256 /* weights per super-block of the K-quants (Q4_K, Q5_K, Q6_K): K must be a multiple of it */

/* Elements and bytes per block as the GGUF file stores them (floats: one element); -1 for unknown types. */
static inline int64_t kvs_block_elems(int type) {
    switch (type) {
        case QT_F32: case QT_F16: case QT_BF16: return 1;
        case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q8_0: return QK;
        case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: return QK_K;
        default: return -1;
    }
}
static inline int64_t kvs_block_size(int type) {
    switch (type) {
        case QT_F32: return 4;
        case QT_F16: case QT_BF16: return 2;
        case QT_Q4_0: return 18;  /* fp16 d, 16 bytes of nibbles:              w = d (q - 8)          */
        case QT_Q4_1: return 20;  /* fp16 d, fp16 m, 16 nibbles:                w = d q + m            */
        case QT_Q5_0: return 22;  /* fp16 d, 32 high bits, 16 nibbles:          w = d (q - 16)         */
        case QT_Q8_0: return 34;  /* fp16 d, 32 int8:                           w = d q                */
        case QT_Q4_K: return 144; /* d, dmin, 12 bytes of 6-bit sc/m, 128 nibbles: w = d sc q - dmin m  */
        case QT_Q5_K: return 176; /* Q4_K's, plus 32 bytes of high bits                               */
        case QT_Q6_K: return 210; /* 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 sc, d: d sc (q - 32) */
        default: return -1;
    }
}
/* Every kernel takes K a multiple of 32 (and of 256 for the K-quants). */
static inline int64_t kvs_row_bytes_of(int type, int64_t K) {
    int64_t e = kvs_block_elems(type);
    if (e < 0 || K <= 0 || K % QK || K % e) return -1;
    return K / e * kvs_block_size(type);
}
/* Bytes per block of 32 inputs unpacked by the fast kernels (qunpack.c; qamx.c reads them): 8 rows of 64 (Q6_K: lo
   rows | 256 zero bytes | hi rows, so that AMX reads its two half tiles at 0 and 256), then D and M (Q6_K: D, sca,
   scb) x 16 floats */
static inline int64_t kvs_qup_block_bytes(int type) { return type == QT_Q6_K ? 768 + 192 : 512 + 128; }

#define KVS_MAXSEG 4
/* A matrix (N, K) as up to KVS_MAXSEG row segments, each of one block type (q|k|v with v in another type):
 * segment s holds rows[s] output rows at data[s] (GGUF rows for the exact kernels, kvs_qpack's layout for the
 * fast ones). The segments' outputs are adjacent columns of one result. */
typedef struct {
    int32_t nseg;
    int32_t type[KVS_MAXSEG];
    int64_t rows[KVS_MAXSEG];
    const uint8_t *data[KVS_MAXSEG];
} kvs_mat;

typedef struct {
    kvs_mat qkv, o, gu, down;  /* (H+2KVH)*D x E, E x H*D, 2I x E, E x I */
    const float *b_qkv;        /* ((H + 2 KVH) * D,) or NULL */
    const float *ln1, *ln2;    /* (E,) */
} kvs_layer;

static inline int64_t kvs_mat_rows(const kvs_mat *m) {
    int64_t n = 0;
    for (int s = 0; s < m->nseg; s++) n += m->rows[s];
    return n;
}

/* exact kernels (cpu_kernels.c, dequant.c) */
int64_t kvs_row_bytes(int type, int64_t K);
void kvs_dequant_row(int type, const uint8_t *row, int64_t K, float *out);
int kvs_gemm_ld(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int64_t ldy);
int kvs_gemm_mat(const kvs_mat *m, int64_t K, const float *x, int64_t M, float *y);
/* fast kernels (qgemm.c) */
int64_t kvs_qscratch_bytes(int64_t M, int64_t K);
int kvs_qlinear_mat(const kvs_mat *m, int64_t K, const float *x, int64_t M, float *y, void *scratch);
#endif
