/* A bound program's consecutive C calls as one call from Python: a decode step is
 * ~60 kernel calls of 3-20 us each, and one ctypes call plus the Python around it
 * costs ~5-10 us, so the calls go as a table of (entry point, argument block)
 * pairs that this loop walks (atbcore/runtime/native_run.py builds the table).
 *
 * The table: int64 [3 + 2 n]: the steps to run [lo, hi), the address of an int64
 * that receives the index of a failing step, then per step the entry point's
 * address and its packed argument block's address (every atb_* entry point takes
 * one block). The walk stops at the first step whose status is not 0 and returns
 * that status (the caller reruns that step through its Python call, which reports
 * or falls back). */
#define _GNU_SOURCE
#include <stdint.h>
#include <time.h>

#include "common.h"

typedef int64_t (*atb_entry_fn)(const char *args);

ATB_API int64_t atb_run_steps(const int64_t *table) {
    int64_t lo = table[0], hi = table[1];
    int64_t *failed = (int64_t *)(intptr_t)table[2];
    const int64_t *s = table + 3;
    for (int64_t i = lo; i < hi; ++i) {
        atb_entry_fn fn = (atb_entry_fn)(intptr_t)s[2 * i];
        int64_t status = fn((const char *)(intptr_t)s[2 * i + 1]);
        if (status != 0) {
            *failed = i;
            return status;
        }
    }
    return 0;
}

/* atb_run_steps that also writes each step's wall time (ns) to ns[i] (a diagnostic:
 * benchmarks/decode_split.py compares a kernel's time inside a decode step with
 * its time in the same table made back to back). */
ATB_API int64_t atb_run_steps_timed(const int64_t *table, int64_t *ns) {
    int64_t lo = table[0], hi = table[1];
    int64_t *failed = (int64_t *)(intptr_t)table[2];
    const int64_t *s = table + 3;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int64_t i = lo; i < hi; ++i) {
        atb_entry_fn fn = (atb_entry_fn)(intptr_t)s[2 * i];
        int64_t status = fn((const char *)(intptr_t)s[2 * i + 1]);
        clock_gettime(CLOCK_MONOTONIC, &b);
        ns[i] = (int64_t)(b.tv_sec - a.tv_sec) * 1000000000 + (b.tv_nsec - a.tv_nsec);
        a = b;
        if (status != 0) {
            *failed = i;
            return status;
        }
    }
    return 0;
}
