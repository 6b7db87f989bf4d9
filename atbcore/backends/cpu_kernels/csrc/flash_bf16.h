/* flash.c's two products on bf16 operands with VDPBF16PS (flash_bf16.c): for bf16
 * q and k/v on CPUs with AVX512_BF16. Pairs along the summed dim share a 32-bit
 * lane: Q^T as [ceil(D/2)][Mp] pairs (q[d], q[d+1]) of a lane's query, P as
 * [ceil(nk/2)][Mp] pairs of two keys' probabilities, V as [ceil(nk/2)][D] pairs of
 * two keys' values. */
#ifndef ATB_FLASH_BF16_H
#define ATB_FLASH_BF16_H

#include <stdint.h>

/* whether the bf16 products run here (cpuid AVX512_BF16, an AVX-512 build) */
int atb_flash_bf16_ready(void);

/* Qp[(d / 2) * Mp + m] = the pair (q[d], q[d + 1]) of bf16 row q (D elements) for
 * lane m (zero past D) */
void atb_flash_bf16_q(uint32_t *Qp, const uint16_t *q, int64_t m, int64_t Mp, int64_t D);

/* St[j][0..Mp) = scale * (k row j . Qp) for the block's nk bf16 key rows */
void atb_flash_bf16_scores(const uint16_t *const *kr, const uint32_t *Qp, float *St, int64_t Mp,
                           int64_t D, int nk, float scale);

/* Ot[d][0..Mp) += sum_j v row j [d] St[j][0..Mp): P (St) rounded to bf16 pairs into
 * Pp ([32][Mp] scratch), the values paired into Vp ([32][D] scratch) */
void atb_flash_bf16_accumulate(const uint16_t *const *vr, const float *St, float *Ot, int64_t Mp,
                               int64_t D, int nk, uint32_t *Pp, uint32_t *Vp);

#endif
