/* The fast arithmetic's micro-kernel: one tile of 16 packed columns (qpack.c) times mr rows of quantized x,
 * written once and included by qgemm.c per instruction set, with these defined:
 *   ISA (name suffix), NV (columns per vector: 8 or 16), MRX (most rows per call), VF / VI (float / int vector),
 *   F_ZERO F_SET1 F_FMA F_MUL F_CVT F_LOADH (NV fp16) F_LOADU8 (NV u8 as float), I_ZERO I_SET1_8 I_SET1_32 I_LOADW
 *   (NV x 4 bytes) I_LOADI8 (NV int8 as int32) I_AND I_OR I_SRLI16 I_SLLI32 I_SRLI32 I_ADD32 I_SUB32 I_MULLO,
 *   PROD(a, u, s): a += u8 x s8 products of u and s (4 per 32-bit lane), in the accumulator type of the ISA,
 *   FLUSH(is, a): is += a as int32, a = 0; Q8_DOT / Q8_FIX: Q8_0's signed weights; STORE(y, acc, ncols).
 * Every path computes the same exact int32 sum per (row, column, block of 32) (AVX2 in int16 pairs flushed before
 * they can overflow: 8 products of 4-bit, 4 of 5-bit, 2 of 6-bit weights; VNNI in int32), then the same float32
 * operations in the same order: acc = fma(float(isum), D * dx, acc) [; acc = fma(M, dxs, acc)], so every
 * instruction set gives the same bits.
 */
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

static inline __attribute__((always_inline)) void CAT(tile_body_, ISA)(
        const int type, const uint8_t *tile, int64_t nu, const qrows *x, int64_t K, int64_t m0, const int mr,
        float *y, int64_t ldy, int64_t ncols) {
    const int64_t nb = K / QK, tb = kvs_qunit_bytes(type);
    const int kq = type == QT_Q4_K || type == QT_Q5_K || type == QT_Q6_K;
    const int five = type == QT_Q5_0 || type == QT_Q5_K;
    const int64_t sub = type == QT_Q4_K ? 288 : type == QT_Q5_K ? 352 : 416, hdr = type == QT_Q6_K ? 32 : 64;
    const VI m4 = I_SET1_8(0x0F), m10 = I_SET1_8(0x10), m30 = I_SET1_8(0x30);
    for (int half = 0; half < 16 / NV; half++) {
        const int64_t hw = 4 * NV * half, hh = 2 * NV * half, hb = NV * half; /* this half's columns' offsets */
        VF acc[MRX];
        for (int r = 0; r < MRX; r++) acc[r] = F_ZERO();
        for (int64_t u = 0; u < nu; u++) {
            const uint8_t *ub = tile + u * tb;
            VF dsup = F_ZERO(), ndmin = F_ZERO();
            if (kq) {
                dsup = F_LOADH(ub + hh);
                if (type != QT_Q6_K) ndmin = F_MUL(F_LOADH(ub + 32 + hh), F_SET1(-1.0f));
            }
            for (int s = 0; s < (kq ? 8 : 1); s++) {
                const int64_t b = kq ? u * 8 + s : u;
                const uint8_t *blk = kq ? ub + hdr + s * sub : ub;
                const int8_t *xb[MRX];
                for (int r = 0; r < mr; r++) xb[r] = x->qx + (m0 + r) * K + b * QK;
                if (mr == 1) /* one row: the weights stream past once; keep the reads ahead (qvec.c) */
                    for (int64_t l = 0; l < (kq ? sub : tb); l += 64) _mm_prefetch((const char *)blk + PF_AHEAD + l, _MM_HINT_T1);
                VI a[MRX], is[MRX];
                for (int r = 0; r < MRX; r++) a[r] = is[r] = I_ZERO();
                VF D, M = F_ZERO();
                if (type == QT_Q8_0) {
                    for (int g = 0; g < 8; g++) {
                        const VI w = I_LOADW(blk + 64 * g + hw);
                        for (int r = 0; r < mr; r++) Q8_DOT(is[r], w, I_SET1_32(ld32(xb[r] + 4 * g)));
                    }
                    for (int r = 0; r < mr; r++) Q8_FIX(is[r], x->sx[(m0 + r) * nb + b]);
                    D = F_LOADH(blk + 512 + hh);
                } else if (type == QT_Q6_K) {
                    const VI sca = I_LOADI8(blk + 384 + hb), scb = I_LOADI8(blk + 400 + hb);
                    for (int part = 0; part < 2; part++) { /* weights 0..15 (low nibbles), 16..31 (high) */
                        const VI P = I_LOADW(blk + 256 + 64 * part + hw);
                        VI t[MRX];
                        for (int r = 0; r < MRX; r++) t[r] = I_ZERO();
                        for (int c = 0; c < 4; c++) {
                            const VI w = I_LOADW(blk + 64 * c + hw);
                            VI v = part ? I_AND(I_SRLI16(w, 4), m4) : I_AND(w, m4);
                            const VI top = c == 0 ? I_SLLI32(P, 4) : c == 1 ? I_SLLI32(P, 2) : c == 2 ? P : I_SRLI32(P, 2);
                            v = I_OR(v, I_AND(top, m30));
                            for (int r = 0; r < mr; r++) a[r] = PROD(a[r], v, I_SET1_32(ld32(xb[r] + 16 * part + 4 * c)));
                            if (c & 1)
                                for (int r = 0; r < mr; r++) FLUSH(t[r], a[r]);
                        }
                        for (int r = 0; r < mr; r++) {
                            const VI off = I_SET1_32(x->bs32[((m0 + r) * nb + b) * 2 + part]);
                            is[r] = I_ADD32(is[r], I_MULLO(I_SUB32(t[r], off), part ? scb : sca));
                        }
                    }
                    D = dsup;
                } else { /* 4-bit nibbles, with a fifth bit from the plane for Q5_0 / Q5_K */
                    const VI P = five ? I_LOADW(blk + 256 + hw) : I_ZERO();
                    for (int c = 0; c < 4; c++) {
                        const VI w = I_LOADW(blk + 64 * c + hw);
                        VI lo = I_AND(w, m4), hi = I_AND(I_SRLI16(w, 4), m4);
                        if (five) {
                            const VI pl = c == 0 ? I_SLLI32(P, 4) : c == 1 ? I_SLLI32(P, 3) : c == 2 ? I_SLLI32(P, 2) : I_SLLI32(P, 1);
                            const VI ph = c == 0 ? P : c == 1 ? I_SRLI32(P, 1) : c == 2 ? I_SRLI32(P, 2) : I_SRLI32(P, 3);
                            lo = I_OR(lo, I_AND(pl, m10));
                            hi = I_OR(hi, I_AND(ph, m10));
                        }
                        for (int r = 0; r < mr; r++) {
                            a[r] = PROD(a[r], lo, I_SET1_32(ld32(xb[r] + 4 * c)));
                            a[r] = PROD(a[r], hi, I_SET1_32(ld32(xb[r] + 16 + 4 * c)));
                        }
                        if (!five ? c == 3 : (c & 1))
                            for (int r = 0; r < mr; r++) FLUSH(is[r], a[r]);
                    }
                    if (type == QT_Q4_K || type == QT_Q5_K) {
                        const uint8_t *scm = blk + sub - 32;
                        D = F_MUL(dsup, F_LOADU8(scm + hb));
                        M = F_MUL(ndmin, F_LOADU8(scm + 16 + hb));
                    } else if (type == QT_Q5_0) {
                        D = F_LOADH(blk + 320 + hh);
                        M = F_MUL(D, F_SET1(-16.0f));
                    } else {
                        D = F_LOADH(blk + 256 + hh);
                        M = F_LOADH(blk + 288 + hh);
                    }
                }
                const int offset = type != QT_Q8_0 && type != QT_Q6_K;
                for (int r = 0; r < mr; r++) {
                    const int64_t i = (m0 + r) * nb + b;
                    acc[r] = F_FMA(F_CVT(is[r]), F_MUL(D, F_SET1(x->dx[i])), acc[r]);
                    if (offset) acc[r] = F_FMA(M, F_SET1(x->dxs[i]), acc[r]);
                }
            }
        }
        const int64_t nc = ncols - NV * half;
        for (int r = 0; r < mr; r++) STORE(y + r * ldy + NV * half, acc[r], nc);
    }
}

#define TILE_CASE(T, R) case R: CAT(tile_body_, ISA)(T, tile, nu, x, K, m0, R, y, ldy, ncols); return;

static void CAT(tile_, ISA)(int type, const uint8_t *tile, int64_t nu, const qrows *x, int64_t K, int64_t m0,
                            int64_t mr, float *y, int64_t ldy, int64_t ncols) {
    /* constant types and row counts: the accumulators stay in registers, the type tests fold away */
#define TILE_TYPE(T)                                                                    \
    case T:                                                                             \
        switch (mr) { TILE_ROWS(T) default: TILE_CASE(T, 1) }                            \
        return;
    switch (type) {
        TILE_TYPE(QT_Q4_0) TILE_TYPE(QT_Q4_1) TILE_TYPE(QT_Q5_0) TILE_TYPE(QT_Q8_0)
        TILE_TYPE(QT_Q4_K) TILE_TYPE(QT_Q5_K) TILE_TYPE(QT_Q6_K)
        default: return;
    }
#undef TILE_TYPE
}
#undef TILE_CASE
