/* The activations of act.c, for kernels that apply them in their epilogue (a gated
 * FFN's first matmul, panel.c) with the same arithmetic as the activation kernel. */
#ifndef ATB_ACT_H
#define ATB_ACT_H

#include <stdint.h>

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_GELU_TANH = 2, ACT_QUICK_GELU = 3, ACT_RELU = 4,
       ACT_NONE = 5 };

/* v[i] = act(x[i]) for i < m (x may be v) */
void atb_act_apply(int act, int64_t m, const float *x, float *v);

#endif
