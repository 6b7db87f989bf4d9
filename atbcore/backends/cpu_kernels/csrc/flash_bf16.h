/* flash.c's score product on bf16 operands with VDPBF16PS (flash_bf16.c): for bf16
 * q and k on CPUs with AVX512_BF16. Pairs along D share a 32-bit lane: Q^T as
 * [ceil(D/2)][Mp] pairs (q[d], q[d+1]) of a lane's query. */
#ifndef ATB_FLASH_BF16_H
#define ATB_FLASH_BF16_H

#include <stdint.h>

/* whether the bf16 score product runs here (cpuid AVX512_BF16, an AVX-512 build) */
int atb_flash_bf16_ready(void);

/* Qp[(d / 2) * Mp + m] = the pair (q[d], q[d + 1]) of bf16 row q (D elements) for
 * lane m (zero past D) */
void atb_flash_bf16_q(uint32_t *Qp, const uint16_t *q, int64_t m, int64_t Mp, int64_t D);

/* St[j][0..Mp) = scale * (k row j . Qp) for the block's nk bf16 key rows */
void atb_flash_bf16_scores(const uint16_t *const *kr, const uint32_t *Qp, float *St, int64_t Mp,
                           int64_t D, int nk, float scale);

#endif
