/* The prefill attention's (flash.c) lane loops outside AVX-512 builds: the AVX2
 * register tiles of x86-64-v3 builds, one key block's scores, softmax and value sums
 * per 16-lane slice while it is in L1 (each lane's sum over d or over keys by FMAs in
 * sequence, held in registers), and elsewhere the online softmax with lanes innermost,
 * which the compiler vectorises for any target. */
#ifndef ATB_FLASH_LANES_H
#define ATB_FLASH_LANES_H

#include <stdint.h>

#define FL_NONE (INT32_MIN / 2)   /* position of a padding lane: it sees no key */
#define FL_BK 64                  /* keys per block */

/* One key block's walk in AVX-512 and plain builds (flash_blocks.c), Qt, Ot [D][Mp]:
 * St[j][0..Mp) = kr[j] . Qt for the block's nk keys; the online softmax over it (as
 * atb_flash_softmax_lanes below, in base e); Ot[d][0..Mp) += sum_j vr[j][d] St[j][..] */
void atb_flash_scores(const float *const *kr, const float *Qt, float *St, int64_t Mp, int64_t D,
                      int nk);
void atb_flash_softmax(float *St, float *Ot, float *mx, float *sum, const int32_t *pos,
                       int64_t Mp, int64_t D, int64_t j0, int nk, int causal, int64_t window);
void atb_flash_accumulate(const float *const *vr, const float *St, float *Ot, int64_t Mp,
                          int64_t D, int nk);

/* AVX2 builds hold Qt and Ot slice-major: lanes [16 s, 16 s + 16) as one [D][16] panel
 * at Qt + 16 s D (in a [D][Mp] layout a slice's rows lie Mp floats apart, at Mp = 128
 * 512 bytes: the 192 lines of a slice's Qt, St and Ot rows fell in 8 of L1's 64 sets,
 * 64 lines' room). */
static inline int64_t atb_flash_slice_at(int64_t d, int64_t m, int64_t D) {
    return (m & ~(int64_t)15) * D + 16 * d + (m & 15);
}
/* Qt[d][m0 + i] = src[i][d] * scale for 8 lanes' query rows of dtype dt (fp32, bf16 or
 * fp16, widened exactly), slice-major, m0 a multiple of 8 (AVX2 builds: 8 x 8 register
 * transposes; the same products as the plain loop, bit for bit) */
void atb_flash_fill_q8(const void *const *src, int dt, float *Qt, int64_t m0, int64_t D,
                       float scale);
/* dst[i][d] = Ot[d][m0 + i] * inv[i] for 8 lanes, Ot slice-major, m0 a multiple of 8
 * (AVX2 builds: 8 x 8 register transposes; the plain loop's products) */
void atb_flash_out8(const float *Ot, int64_t m0, int64_t D, const float *inv, float *const *dst);
/* One key block [j0, j0 + nk) for all Mp lanes (AVX2 builds), slice by slice: the scores
 * Qt . kr[j] into Ss (one slice's [64][16]), the online softmax in base 2 (Qt holds the
 * queries times scale * log2(e); running max m2 in those units, sum), Ot = Ot * corr +
 * sum_j vr[j] Ss[j]. Qt, Ot slice-major and 32-byte aligned; pos as below. */
void atb_flash_block_lanes(const float *const *kr, const float *const *vr, const float *Qt,
                           float *Ss, float *Ot, float *m2, float *sum, const int32_t *pos,
                           int64_t Mp, int64_t D, int64_t j0, int nk, int causal,
                           int64_t window);
/* The online softmax over the key block [j0, j0 + nk) for every lane m (flash.c's
 * softmax_block): scores of keys a lane does not see become 0, the others
 * exp(s - max); the running max mx, sum and Ot rescale by exp(old max - new max).
 * pos[m]: lane m's position (FL_NONE: padding). */
void atb_flash_softmax_lanes(float *St, float *Ot, float *mx, float *sum, const int32_t *pos,
                             int64_t Mp, int64_t D, int64_t j0, int nk, int causal,
                             int64_t window);

#endif
