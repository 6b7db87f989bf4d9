/* MT19937 draws as torch's CPU generator makes them for uniform_() on float64
 * (mt19937.c), shared by the sampling step (sample.c). */
#ifndef ATB_MT19937_H
#define ATB_MT19937_H

#include <stdint.h>

/* torch's CPUGeneratorImplState (get_state()): 5056 bytes; at these offsets the
 * int32 count of words left in the block (+1), the uint64 next index and the
 * 624 words, each stored as a uint64 */
#define ATB_MT_STATE_BYTES 5056
#define ATB_MT_LEFT 8
#define ATB_MT_NEXT 16
#define ATB_MT_WORDS 24

/* state bytes -> key[624], pos (0 ok, 1 a layout it does not know); and back */
int atb_mt_load(const uint8_t *raw, uint32_t *key, int64_t *pos);
void atb_mt_store(uint8_t *raw, const uint32_t *key, int64_t pos);

/* The next n draws from the state (s[624] words, *pos words of the block used:
 * 1..624), writing those at the ascending indices want[nwant] to out and moving
 * the state past all n. 0, or ATB_ERR_ARGS. */
int64_t atb_mt_uniforms_at(uint32_t *s, int64_t *pos, int64_t n, const int64_t *want,
                           int64_t nwant, double *out);

#endif
