/* The many-row GEMMs of gemm_bf16.c (VDPBF16PS on bf16 panels) and gemm_i8.c
 * (int8 activations x int8 weights, VNNI): their entry points into linear.c and
 * what they share. Both run on linear.h's LinArgs and write through the panel
 * epilogue (atb_panel_emit: per-channel scale, bias, residual, one rounding). */
#ifndef ATB_GEMM_H
#define ATB_GEMM_H

#include "linear.h"

#define ATB_GEMM_PANEL 32   /* outputs per panel, as panel.c's ATB_PANEL */
#define ATB_GEMM_MBLOCK 64  /* x rows per chunk (a block kept in L2 across its panels) */

/* y[m .. m+mb, n .. n+32) from res (mb rows of 32 fp32 sums): panel.c's epilogue */
void atb_panel_emit(const LinArgs *a, int64_t m, int64_t n, int mb, const float *res);

/* y = x w^T for bf16 rows x (xs elements apart, already RmsNorm'd when asked) and
 * bf16 panels, with VDPBF16PS. Returns 0 when it ran, -1 when it cannot here
 * (dtypes, layout, or a CPU without AVX512_BF16): the caller runs the fp32 path. */
int atb_linear_bf16(const LinArgs *a, const void *x, int64_t xs, int nth);

/* y = x w^T for fp32 rows x (xs elements apart) on int8 panels (w8), x quantized to int8
 * per row and block of 32 inputs (panel_q8.c). Returns 0, or ATB_ERR_NOMEM. */
int atb_linear_panels_q8(const LinArgs *a, const float *x, int64_t xs, int nth);

/* x (K fp32) -> nblk int8 blocks of 32 (nblk >= ceil(K / 32); zeros past K): per block
 * dx = max |x| / 127, q = rint(x * 127 / max |x|) (ties to even), and, when xsum is not
 * NULL, the sum of the block's q (the w4 zero-point term). One quantizer for w8 and w4. */
void atb_q8_quantize_row(const float *x, int64_t K, int64_t nblk, int8_t *xq, float *dx,
                         int32_t *xsum);

/* x (K fp32) read as int8 blocks of 32: each element q * dx (for the [N, K] int8 rows) */
void atb_q8_round_row(const float *x, int64_t K, float *out);

/* whether this CPU runs VDPBF16PS / VPDPBUSD (cpuid, once) */
int atb_cpu_bf16(void);
int atb_cpu_vnni(void);

#endif
