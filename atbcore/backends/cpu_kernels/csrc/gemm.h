/* The many-row GEMMs of gemm_bf16.c (VDPBF16PS on bf16 panels) and gemm_i8.c
 * (int8 activations x int8 weights, VNNI): their entry points into linear.c and
 * what they share. Both run on linear.h's LinArgs and write through the panel
 * epilogue (atb_panel_emit: per-channel scale, bias, residual, one rounding). */
#ifndef ATB_GEMM_H
#define ATB_GEMM_H

#include "linear.h"

#define ATB_GEMM_PANEL 32   /* outputs per panel, as panel.c's ATB_PANEL */
#define ATB_GEMM_MBLOCK 64  /* x rows per chunk (a block kept in L2 across its panels) */

/* panel.c: sums over K in blocks of this many, added up in res: fp32 error ~ (block +
 * K / block) roundings instead of K (16 x 768 x 512 against float64: 9e-5 -> 2e-5) */
#define ATB_PANEL_KB 128
/* x rows per call of a tile: a group's block of x (18 x 128 fp32) stays in L1 beside
 * the weights' block while every part of the group (three sixes) runs over it */
#ifdef ATB_AVX2
#define ATB_PANEL_MT 18
#else
#define ATB_PANEL_MT 8
#endif

#ifdef ATB_AVX2
/* panel_avx2.c. res[i * 32 + j] = x row i . panel column j for mb <= ATB_PANEL_MT rows
 * (xs elements apart) of the panel w (K rows of 32 weights of dtype wdt); pf 1: each
 * block of K prefetches the weights' next block (the next panel's after the last) */
void atb_panel_tile_avx2(int mb, int wdt, const float *x, int64_t xs, const uint8_t *w,
                         int64_t K, int pf, float *res);
/* one x row against the two panels w and w + ps bytes: res holds 64 sums */
void atb_panel_row2_avx2(int wdt, const float *x, const uint8_t *w, int64_t ps, int64_t K,
                         float *res);
#endif

/* y[m .. m+mb, n .. n+32) from res (mb rows of 32 fp32 sums): panel.c's epilogue */
void atb_panel_emit(const LinArgs *a, int64_t m, int64_t n, int mb, const float *res);

/* a gated call's epilogue (LinArgs.gated): rg / ru the gate and up panels' sums, y =
 * act(gate + bias) * (up + bias) over y[m .. m+mb, n .. n+32) */
void atb_panel_emit_gated(const LinArgs *a, int64_t m, int64_t n, int mb, const float *rg,
                          const float *ru);

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
