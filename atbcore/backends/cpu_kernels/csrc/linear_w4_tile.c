/* The w4 matmul's panel tiles (see linear_w4.c for the layout): AVX512-VNNI where the
 * CPU has it, AVX2 in x86-64-v3 builds, else plain C; all sum the same exact int32
 * products per block and scale them in fp32. */
#include <string.h>

#include "linear_w4.h"
#include "simd.h"

#define PTR(v) ((const void *)(intptr_t)(v))

static inline float w4_half(uint16_t h) { return atb_f16_to_f32(h); }

/* sums of MB rows against one panel, generic C (the same integer math) */
/* (unused in AVX2 builds, which always have their tile) */
__attribute__((unused)) static void tile_scalar(const W4Job *job, int mb, const uint8_t *wp, const uint16_t *sp,
                        const uint8_t *zp, int64_t m, float *res) {
    const W4Args *a = job->a;
    const int64_t nblk = job->nblk, kp = nblk * W4_BLOCK, bpg = a->group / W4_BLOCK;
    memset(res, 0, sizeof(float) * (size_t)mb * W4_PANEL);
    for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t *blk = wp + b * W4_BLOCK_BYTES;
        const int64_t g = b / bpg;
        for (int i = 0; i < mb; ++i) {
            const int8_t *xq = job->xq + (m + i) * kp + b * W4_BLOCK;
            const float dx = job->dx[(m + i) * nblk + b];
            const int32_t xs = job->xsum[(m + i) * nblk + b];
            for (int j = 0; j < W4_PANEL; ++j) {
                int32_t s = 0;
                for (int kk = 0; kk < 8; ++kk)
                    for (int t = 0; t < 4; ++t) {
                        const uint8_t byte = blk[kk * 64 + (j & 15) * 4 + t];
                        const int32_t q = j < 16 ? (byte & 15) : (byte >> 4);
                        s += q * xq[kk * 4 + t];
                    }
                const int32_t z = zp ? zp[g * W4_PANEL + j] : 8;
                const float sc = w4_half(sp[g * W4_PANEL + j]);
                res[i * W4_PANEL + j] += (float)(s - z * xs) * (sc * dx);
            }
        }
    }
}

#if defined(ATB_AVX512) && (defined(__GNUC__) || defined(__clang__))
#define W4_VNNI 1
#define W4_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

/* sums of MB rows (a constant) against one panel: per block 8 x 2 VPDPBUSD per row, then
 * the fp32 epilogue s * dx * (sum - z * xsum) */
static inline __attribute__((always_inline)) W4_TARGET void
tile_vnni(const W4Job *job, int MB, const uint8_t *wp, const uint16_t *sp, const uint8_t *zp,
          int64_t m, float *res) {
    const W4Args *a = job->a;
    const int64_t nblk = job->nblk, kp = nblk * W4_BLOCK, bpg = a->group / W4_BLOCK;
    /* the high nibbles are summed in place (16 q, masked, not shifted: one op less per
     * 4 k), so their sums, zero term and scale carry a factor 16 (exact: a power of 2) */
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    __m512 f[2 * W4_MB];
    for (int i = 0; i < 2 * MB; ++i) f[i] = _mm512_setzero_ps();
    __m512 s0 = _mm512_setzero_ps(), s1 = s0;
    __m512i z0 = _mm512_set1_epi32(8), z1 = _mm512_set1_epi32(8 * 16);
    int64_t g = -1, in_group = bpg - 1; /* counters, not a division per block */
    for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t *blk = wp + b * W4_BLOCK_BYTES;
        if (++in_group == bpg) { /* a new weight group: its scales and zero points */
            in_group = 0;
            ++g;
            s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + g * W4_PANEL)));
            s1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(
                                   (const __m256i *)(sp + g * W4_PANEL + 16))),
                               _mm512_set1_ps(1.f / 16.f));
            if (zp) {
                z0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + g * W4_PANEL)));
                z1 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(
                                           _mm_loadu_si128((const __m128i *)(zp + g * W4_PANEL + 16))), 4);
            }
        }
        /* few rows: even and odd sub-blocks in separate sums, so that more VPDPBUSD
         * chains run at once (one row's two chains alone wait on its latency) */
        enum { SPLIT = 2 };
        __m512i acc[2 * W4_MB * SPLIT];
        const int chains = MB <= 2 ? SPLIT : 1;
        for (int i = 0; i < 2 * MB * chains; ++i) acc[i] = _mm512_setzero_si512();
        _mm_prefetch((const char *)(blk + 8 * W4_BLOCK_BYTES), _MM_HINT_T0);
        for (int kk = 0; kk < 8; ++kk) {
            const __m512i v = _mm512_loadu_si512((const void *)(blk + kk * 64));
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(v, high);
            const int c = chains > 1 ? (kk & 1) * 2 * MB : 0;
            for (int i = 0; i < MB; ++i) {
                int32_t x4;
                memcpy(&x4, job->xq + (m + i) * kp + b * W4_BLOCK + kk * 4, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                acc[c + 2 * i] = _mm512_dpbusd_epi32(acc[c + 2 * i], lo, xb);
                acc[c + 2 * i + 1] = _mm512_dpbusd_epi32(acc[c + 2 * i + 1], hi, xb);
            }
        }
        if (chains > 1)
            for (int i = 0; i < 2 * MB; ++i) acc[i] = _mm512_add_epi32(acc[i], acc[2 * MB + i]);
        for (int i = 0; i < MB; ++i) {
            const int32_t x_sum = job->xsum[(m + i) * nblk + b];
            const __m512 dx = _mm512_set1_ps(job->dx[(m + i) * nblk + b]);
            __m512i d0, d1;
            if (zp) {
                const __m512i xs = _mm512_set1_epi32(x_sum);
                d0 = _mm512_sub_epi32(acc[2 * i], _mm512_mullo_epi32(z0, xs));
                d1 = _mm512_sub_epi32(acc[2 * i + 1], _mm512_mullo_epi32(z1, xs));
            } else { /* z = 8 everywhere: the zero term is one number */
                d0 = _mm512_sub_epi32(acc[2 * i], _mm512_set1_epi32(8 * x_sum));
                d1 = _mm512_sub_epi32(acc[2 * i + 1], _mm512_set1_epi32(8 * 16 * x_sum));
            }
            f[2 * i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(s0, dx), f[2 * i]);
            f[2 * i + 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(s1, dx),
                                           f[2 * i + 1]);
        }
    }
    for (int i = 0; i < MB; ++i) {
        _mm512_storeu_ps(res + i * W4_PANEL, f[2 * i]);
        _mm512_storeu_ps(res + i * W4_PANEL + 16, f[2 * i + 1]);
    }
}

static W4_TARGET void tile_vnni_rt(const W4Job *job, int mb, const uint8_t *wp,
                                   const uint16_t *sp, const uint8_t *zp, int64_t m,
                                   float *res) {
    switch (mb) {
    case 1: tile_vnni(job, 1, wp, sp, zp, m, res); break;
    case 2: tile_vnni(job, 2, wp, sp, zp, m, res); break;
    case 3: tile_vnni(job, 3, wp, sp, zp, m, res); break;
    default: tile_vnni(job, 4, wp, sp, zp, m, res); break;
    }
}

static int have_vnni(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx512vnni") ? 1 : 0;
    return known;
}
#endif

#ifdef ATB_AVX2
/* one row against one panel, AVX2: per sub-block of 4 k the four 8-output operands (low
 * nibbles: outputs 0-15, high: 16-31) times the row's x quad by VPMADDUBSW into int16
 * pair sums (|q x| <= 15 x 127, so the 8 sub-blocks of a block add up below 2^15 with no
 * saturation), one VPMADDWD per block to int32, then s dx (sum - z xsum) by FMA. ZP (a
 * constant) 0: symmetric, the zero term one number (no VPMULLD, a slow multiply). The
 * working set fits the 16 registers (GCC had reassociated the int16 sums into a tree of
 * spilled products: half the time went to stack traffic), the scales are read where used. */
static inline __attribute__((always_inline)) void tile_avx2_z(int ZP, const W4Job *job,
                                                              const uint8_t *wp, const uint16_t *sp,
                                                              const uint8_t *zp, int64_t m,
                                                              float *res) {
    const W4Args *a = job->a;
    const int64_t nblk = job->nblk, kp = nblk * W4_BLOCK, bpg = a->group / W4_BLOCK;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const int8_t *xq = job->xq + m * kp;
    const float *dxr = job->dx + m * nblk;
    const int32_t *xsr = job->xsum + m * nblk;
    __m256 f[4];
    for (int u = 0; u < 4; ++u) f[u] = _mm256_setzero_ps();
    int64_t g = -1, in_group = bpg - 1;
    for (int64_t b = 0; b < nblk; ++b) {
        const uint8_t *blk = wp + b * W4_BLOCK_BYTES;
        if (++in_group == bpg) { /* a new weight group */
            in_group = 0;
            ++g;
        }
        __m256i h[4];
        for (int u = 0; u < 4; ++u) h[u] = _mm256_setzero_si256();
        /* both streams 16 blocks (8 KiB of codes) ahead, every line of them: one line per
         * block 4 blocks ahead left a decode step streaming at ~5.5 GB/s where a plain
         * read of the same bytes ran ~7 (one core, loaded machine); now ~7.5 */
        _mm_prefetch((const char *)(sp + (g + 16) * W4_PANEL), _MM_HINT_T0);
        for (int kk = 0; kk < 8; ++kk) {
            _mm_prefetch((const char *)(blk + 16 * W4_BLOCK_BYTES + kk * 64), _MM_HINT_T0);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + kk * 64));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + kk * 64 + 32));
            int32_t x4;
            memcpy(&x4, xq + b * W4_BLOCK + kk * 4, 4);
            const __m256i xb = _mm256_set1_epi32(x4);
            h[0] = _mm256_add_epi16(h[0], _mm256_maddubs_epi16(_mm256_and_si256(v0, low), xb));
            h[1] = _mm256_add_epi16(h[1], _mm256_maddubs_epi16(_mm256_and_si256(v1, low), xb));
            h[2] = _mm256_add_epi16(h[2], _mm256_maddubs_epi16(
                                              _mm256_and_si256(_mm256_srli_epi16(v0, 4), low), xb));
            h[3] = _mm256_add_epi16(h[3], _mm256_maddubs_epi16(
                                              _mm256_and_si256(_mm256_srli_epi16(v1, 4), low), xb));
            /* sums in k order, one register each (the same exact int16 sums) */
            __asm__("" : "+x"(h[0]), "+x"(h[1]), "+x"(h[2]), "+x"(h[3]));
        }
        const __m256 dx = _mm256_set1_ps(dxr[b]);
        const __m256i xs = _mm256_set1_epi32(ZP ? xsr[b] : 8 * xsr[b]);
        const uint16_t *sg = sp + g * W4_PANEL;
        for (int u = 0; u < 4; ++u) {
            __m256i zt = xs;
            if (ZP)
                zt = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                            (const __m128i *)(zp + g * W4_PANEL + 8 * u))), xs);
            const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(h[u], ones), zt);
            const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8 * u)));
            f[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sc, dx), f[u]);
        }
    }
    for (int u = 0; u < 4; ++u) _mm256_storeu_ps(res + 8 * u, f[u]);
}

static void tile_avx2(const W4Job *job, const uint8_t *wp, const uint16_t *sp,
                      const uint8_t *zp, int64_t m, float *res) {
    if (zp)
        tile_avx2_z(1, job, wp, sp, zp, m, res);
    else
        tile_avx2_z(0, job, wp, sp, zp, m, res);
}
#endif

void atb_w4_tile(const W4Job *job, int mb, const uint8_t *wp, const uint16_t *sp,
                 const uint8_t *zp, int64_t m, float *res) {
#ifdef W4_VNNI
    if (have_vnni()) {
        tile_vnni_rt(job, mb, wp, sp, zp, m, res);
        return;
    }
#endif
#ifdef ATB_AVX2
    for (int i = 0; i < mb; ++i) tile_avx2(job, wp, sp, zp, m + i, res + i * W4_PANEL);
#else
    tile_scalar(job, mb, wp, sp, zp, m, res);
#endif
}
