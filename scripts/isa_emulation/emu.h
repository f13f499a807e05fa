/* scripts/isa_emulation/run.sh only, never the product: SIMDe in place of <immintrin.h> for qgemm.c. */

#ifndef EMU_H
#define EMU_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#define __builtin_cpu_supports(x) 1
#define _mm256_dpbusd_avx_epi32(a, b, c) simde_mm256_dpbusd_epi32(a, b, c)

/* SIMDe 0.8.2 lacks these two widenings: lane by lane */
static inline __m512i emu_cvt8_32(__m128i a, int is_signed) {
    int8_t s[16]; uint8_t u[16]; int32_t o[16];
    simde_mm_storeu_si128((simde__m128i *)s, a); simde_mm_storeu_si128((simde__m128i *)u, a);
    for (int i = 0; i < 16; i++) o[i] = is_signed ? s[i] : u[i];
    return simde_mm512_loadu_si512(o);
}
#undef _mm512_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepi8_epi32(a) emu_cvt8_32(a, 1)
#define _mm512_cvtepu8_epi32(a) emu_cvt8_32(a, 0)
#endif
