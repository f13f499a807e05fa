/* One core's peak rate of each multiply-add instruction, for benchmarks.limits (how far the kernels are from the
 * machine): kvs_peak_issue issues one instruction in independent chains and returns how many it issued; the
 * caller times it. */
#include <stdint.h>

#include "qgemm.h"

#define PEAK12(op)                                                                                              \
    op " %%zmm0, %%zmm1, %%zmm2\n\t" op " %%zmm0, %%zmm1, %%zmm3\n\t" op " %%zmm0, %%zmm1, %%zmm4\n\t"          \
    op " %%zmm0, %%zmm1, %%zmm5\n\t" op " %%zmm0, %%zmm1, %%zmm6\n\t" op " %%zmm0, %%zmm1, %%zmm7\n\t"          \
    op " %%zmm0, %%zmm1, %%zmm8\n\t" op " %%zmm0, %%zmm1, %%zmm9\n\t" op " %%zmm0, %%zmm1, %%zmm10\n\t"         \
    op " %%zmm0, %%zmm1, %%zmm11\n\t" op " %%zmm0, %%zmm1, %%zmm12\n\t" op " %%zmm0, %%zmm1, %%zmm13\n\t"
#define PEAK_CLOBBER "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni,avx512bf16")
/* 12 independent 512-bit instructions per round, `rounds` times: kind 0 vpdpbusd (64 int8 multiply-adds each),
   1 vfmadd231ps (16 float32), 2 vdpbf16ps (32 bfloat16); 256-bit: 3 vpmaddubsw (32 int8 multiply-adds, the AVX2
   path's), 4 vfmadd231ps (8 float32); AMX tiles: 5 TDPBSSD (16 x 16 x 64 int8), 6 TDPBF16PS (16 x 16 x 32
   bfloat16). Returns instructions issued (the caller times it); -1 when this CPU lacks
   the instruction. */
static int64_t peak_issue_avx2(int kind, int64_t rounds);

int64_t kvs_peak_issue(int kind, int64_t rounds) {
    if (kind >= 5) return kvs_qamx_peak(kind - 5, rounds);
    if (kind >= 3) return peak_issue_avx2(kind, rounds);
    if (!__builtin_cpu_supports("avx512f") || (kind == 0 && !__builtin_cpu_supports("avx512vnni")) ||
        (kind == 2 && !__builtin_cpu_supports("avx512bf16")))
        return -1;
    for (int64_t k = 0; k < rounds; k++) {
        if (kind == 0)
            __asm__ volatile(PEAK12("vpdpbusd")::: PEAK_CLOBBER);
        else if (kind == 1)
            __asm__ volatile(PEAK12("vfmadd231ps")::: PEAK_CLOBBER);
        else
            __asm__ volatile(PEAK12("vdpbf16ps")::: PEAK_CLOBBER);
    }
    return 12 * rounds;
}
#pragma GCC pop_options

#define PEAK12Y(op)                                                                                             \
    op " %%ymm0, %%ymm1, %%ymm2\n\t" op " %%ymm0, %%ymm1, %%ymm3\n\t" op " %%ymm0, %%ymm1, %%ymm4\n\t"          \
    op " %%ymm0, %%ymm1, %%ymm5\n\t" op " %%ymm0, %%ymm1, %%ymm6\n\t" op " %%ymm0, %%ymm1, %%ymm7\n\t"          \
    op " %%ymm0, %%ymm1, %%ymm8\n\t" op " %%ymm0, %%ymm1, %%ymm9\n\t" op " %%ymm0, %%ymm1, %%ymm10\n\t"         \
    op " %%ymm0, %%ymm1, %%ymm11\n\t" op " %%ymm0, %%ymm1, %%ymm12\n\t" op " %%ymm0, %%ymm1, %%ymm13\n\t"
#pragma GCC push_options
#pragma GCC target("avx2,fma")
static int64_t peak_issue_avx2(int kind, int64_t rounds) {
    if (kind > 4) return -1;
    __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\n\tvpxor %%ymm1, %%ymm1, %%ymm1" ::: "xmm0", "xmm1");
    for (int64_t k = 0; k < rounds; k++) {
        if (kind == 3) /* independent: each writes its own register (vpmaddubsw does not accumulate) */
            __asm__ volatile(PEAK12Y("vpmaddubsw")::: PEAK_CLOBBER);
        else
            __asm__ volatile(PEAK12Y("vfmadd231ps")::: PEAK_CLOBBER);
    }
    return 12 * rounds;
}
#pragma GCC pop_options
