/* The prefill attention's (flash.c) lane loops outside AVX-512 builds: the AVX2
 * register tiles of x86-64-v3 builds (the same sums in the same order as flash.c's
 * plain loops, each lane's sum over d or over keys by FMAs in sequence, held in
 * registers rather than re-read from memory) and the online softmax with lanes
 * innermost, which the compiler vectorises for any target. */
#ifndef ATB_FLASH_LANES_H
#define ATB_FLASH_LANES_H

#include <stdint.h>

#define FL_NONE (INT32_MIN / 2)   /* position of a padding lane: it sees no key */

/* Qt[d][m0 + i] = src[i][d] * scale for 8 lanes' query rows of dtype dt (fp32, bf16 or
 * fp16, widened exactly; AVX2 builds: 8 x 8 register transposes; the same products as
 * the plain loop, bit for bit) */
void atb_flash_fill_q8(const void *const *src, int dt, float *Qt, int64_t m0, int64_t Mp,
                       int64_t D, float scale);
/* St[j][0..Mp) = kr[j] . Qt for nk keys (Qt [D][Mp], Mp a multiple of 16) */
void atb_flash_scores_lanes(const float *const *kr, const float *Qt, float *St, int64_t Mp,
                            int64_t D, int nk);
/* Ot[d][0..Mp) += sum_j vr[j][d] St[j][0..Mp) */
void atb_flash_accumulate_lanes(const float *const *vr, const float *St, float *Ot,
                                int64_t Mp, int64_t D, int nk);
/* The online softmax over the key block [j0, j0 + nk) for every lane m (flash.c's
 * softmax_block): scores of keys a lane does not see become 0, the others
 * exp(s - max); the running max mx, sum and Ot rescale by exp(old max - new max).
 * pos[m]: lane m's position (FL_NONE: padding). */
void atb_flash_softmax_lanes(float *St, float *Ot, float *mx, float *sum, const int32_t *pos,
                             int64_t Mp, int64_t D, int64_t j0, int nk, int causal,
                             int64_t window);

#endif
