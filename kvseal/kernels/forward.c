/* The fast arithmetic's pass through every layer of a Llama stack in one call: any step (prompt chunks and
 * decode tokens together), no Python between the ops, the GIL released by ctypes for the whole call.
 *
 *  kvs_forward_fast  h (T, E), the residual stream of the step's T rows, through all L layers in place:
 *                    RMSNorm, q|k|v (int8 x blocks), RoPE, k/v written at slots[t], paged attention through each
 *                    span's page table, o, residual, RMSNorm, gate|up, SwiGLU, down, residual.
 * The same functions in the same order as the op-by-op Python path (LlamaModel._layers_fast), so the result is
 * bit for bit the same. Every slot, position, span, page id and table range is checked once, before the first
 * write (-3 / -2 otherwise): a bad table fails the call with the pools untouched.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvs.h"

int kvs_rmsnorm(const float *x, const float *w, int64_t T, int64_t E, float eps, float *out);
int kvs_rope(float *x, int64_t T, int64_t ld, int64_t NH, int64_t D, const float *cos, const float *sin,
             const int64_t *pos, int64_t max_pos);
int kvs_silu_mul(const float *gu, int64_t T, int64_t I, float *out);
int kvs_write_kv(const float *k, const float *v, int64_t T, int64_t KVH, int64_t D, void *kc, void *vc, int bf16,
                 int64_t P, int64_t S, const int64_t *slots);
int64_t kvs_paged_attention_items(int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t P, int64_t S,
                                  const int64_t *spans, int64_t nspans, const int64_t *tables, int64_t ntables);
int kvs_paged_attention_run(const float *q, int64_t H, int64_t KVH, int64_t D, const void *kc, const void *vc,
                            int kv_bf16, int64_t S, const int64_t *spans, int64_t nspans, const int64_t *tables,
                            int64_t items, float scale, float *out);

int kvs_forward_fast(const kvs_layer *layers, int64_t L, int64_t E, int64_t I, int64_t H, int64_t KVH, int64_t D,
                     float eps, float scale, const float *cos, const float *sin, int64_t max_pos, void *kpool,
                     void *vpool, int kv_bf16, int64_t P, int64_t S, int64_t T, float *h, const int64_t *pos,
                     const int64_t *slots, const int64_t *spans, int64_t nspans, const int64_t *tables,
                     int64_t ntables) {
    if (T <= 0 || L <= 0 || S <= 0 || nspans <= 0) return -1;
    const int64_t HD = H * D, KD = KVH * D, NQKV = HD + 2 * KD;
    for (int64_t l = 0; l < L; l++) /* every matrix has the rows its place in the layer needs */
        if (kvs_mat_rows(&layers[l].qkv) != NQKV || kvs_mat_rows(&layers[l].o) != E ||
            kvs_mat_rows(&layers[l].gu) != 2 * I || kvs_mat_rows(&layers[l].down) != E)
            return -1;
    int64_t rows = 0;
    for (int64_t s = 0; s < nspans; s++) { /* spans tile the rows in order; pages inside the pool */
        const int64_t *sp = spans + 5 * s;
        if (sp[0] != rows || sp[1] < 1 || sp[2] < 0 || sp[3] < 0 || sp[4] < 0 || sp[3] + sp[4] > ntables) return -2;
        if (sp[2] + sp[1] > sp[4] * S) return -2;
        for (int64_t i = 0; i < sp[4]; i++)
            if (tables[sp[3] + i] < 0 || tables[sp[3] + i] >= P) return -3;
        for (int64_t i = 0; i < sp[1]; i++) { /* each row's slot is its position's place in its own table */
            const int64_t t = sp[0] + i, p = sp[2] + i;
            if (pos[t] != p || p >= max_pos || slots[t] != tables[sp[3] + p / S] * S + p % S) return -3;
        }
        rows += sp[1];
    }
    if (rows != T) return -2;
    /* the attention kernel's own argument check, once for the step (the pages do not change between layers) */
    const int64_t items = kvs_paged_attention_items(T, H, KVH, D, P, S, spans, nspans, tables, ntables);
    if (items < 0) return (int)items;
    const int64_t layer_elems = P * S * KD, esz = kv_bf16 ? 2 : 4;
    /* one allocation for the step: the activations, then the int8 rows of the widest product input */
    const int64_t kmax = E > HD ? (E > I ? E : I) : (HD > I ? HD : I);
    const size_t act_bytes = sizeof(float) * (size_t)T * (size_t)(E + NQKV + HD + 2 * KD + HD + E + 3 * I);
    float *buf = (float *)malloc(act_bytes + (size_t)kvs_qscratch_bytes(T, kmax) + 64);
    if (!buf) return -4;
    void *qs = (char *)buf + ((act_bytes + 63) & ~(size_t)63);
    float *x = buf, *qkv = x + T * E, *q = qkv + T * NQKV, *k = q + T * HD, *v = k + T * KD, *o = v + T * KD,
          *tmp = o + T * HD, *gu = tmp + T * E, *act = gu + T * 2 * I;
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const kvs_layer *ly = layers + l;
        char *kl = (char *)kpool + l * layer_elems * esz, *vl = (char *)vpool + l * layer_elems * esz;
        if ((rc = kvs_rmsnorm(h, ly->ln1, T, E, eps, x))) break;
        if ((rc = kvs_qlinear_mat(&ly->qkv, E, x, T, qkv, qs))) break;
        if (ly->b_qkv)
            for (int64_t t = 0; t < T; t++)
                for (int64_t i = 0; i < NQKV; i++) qkv[t * NQKV + i] += ly->b_qkv[i];
        if ((rc = kvs_rope(qkv, T, NQKV, H + KVH, D, cos, sin, pos, max_pos))) break;
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + t * NQKV;
            memcpy(q + t * HD, row, sizeof(float) * HD);
            memcpy(k + t * KD, row + HD, sizeof(float) * KD);
            memcpy(v + t * KD, row + HD + KD, sizeof(float) * KD);
        }
        if ((rc = kvs_write_kv(k, v, T, KVH, D, kl, vl, kv_bf16, P, S, slots))) break;
        if ((rc = kvs_paged_attention_run(q, H, KVH, D, kl, vl, kv_bf16, S, spans, nspans, tables, items, scale, o)))
            break;
        if ((rc = kvs_qlinear_mat(&ly->o, HD, o, T, tmp, qs))) break;
        for (int64_t i = 0; i < T * E; i++) h[i] += tmp[i];
        if ((rc = kvs_rmsnorm(h, ly->ln2, T, E, eps, x))) break;
        if ((rc = kvs_qlinear_mat(&ly->gu, E, x, T, gu, qs))) break;
        if ((rc = kvs_silu_mul(gu, T, I, act))) break;
        if ((rc = kvs_qlinear_mat(&ly->down, I, act, T, tmp, qs))) break;
        for (int64_t i = 0; i < T * E; i++) h[i] += tmp[i];
    }
    free(buf);
    return rc;
}
