/*
 * offload-engine: a device job's launch, issued in one foreign call.
 *
 * A launch "program" is a flat array of int64 words: an opcode, then its
 * operands. This file only walks the program and calls the CUDA driver entry
 * points whose addresses the caller hands in (offload_engine/runtimes/_native.py
 * builds both). It includes no CUDA or Python header, so one build serves every
 * Python version and needs no CUDA toolkit: the prototypes are declared here.
 *
 *   OP_WAIT    stream event              cuStreamWaitEvent(stream, event, 0)
 *   OP_RECORD  event stream              cuEventRecord(event, stream)
 *   OP_BATCH   stream dst src sizes count step attrs variant
 *              `count` descriptors at desc[dst..], desc[src..], desc[sizes..] (word
 *              offsets); in driver calls of at most `step` descriptors (variant
 *              13: the CUDA 13 cuMemcpyBatchAsync, 12: the 12.8 one with
 *              failIdx), or variant 0: one cuMemcpyAsync per descriptor
 *   OP_LAUNCH  function gx gy gz bx by bz shared stream nparams value...
 *              cuLaunchKernel; each parameter is read from its own 8-byte word
 *              (a narrower parameter from the word's first bytes: little endian)
 *   OP_HTOD    dst src nbytes stream     cuMemcpyHtoDAsync_v2
 *
 * oe_launch_run returns 0 when every call succeeded. Otherwise it stops at the
 * first failing call and returns 1 with fail[0] = that op's index (0 for the
 * first op), fail[1] = its opcode, fail[2] = the driver's result and fail[3] =
 * a batch's variant (0 for other ops); a program it cannot read returns -1 with
 * fail[0] = the word where reading stopped.
 */

#include <stddef.h>
#include <stdint.h>

typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned int flags);
typedef int (*batch13_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs,
                          size_t *attr_idxs, size_t num_attrs, void *stream);
typedef int (*batch12_fn)(void *dsts, void *srcs, void *sizes, size_t count, void *attrs,
                          size_t *attr_idxs, size_t num_attrs, size_t *fail_idx, void *stream);
typedef int (*memcpy_fn)(uint64_t dst, uint64_t src, size_t bytes, void *stream);
typedef int (*launch_fn)(void *function, unsigned int gx, unsigned int gy, unsigned int gz,
                         unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared,
                         void *stream, void **params, void **extra);
typedef int (*htod_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);

enum { OP_WAIT = 1, OP_RECORD = 2, OP_BATCH = 3, OP_LAUNCH = 4, OP_HTOD = 5 };
enum { E_RECORD = 0, E_WAIT = 1, E_BATCH = 2, E_MEMCPY = 3, E_LAUNCH = 4, E_HTOD = 5 };
#define MAX_PARAMS 32

#define P(x) ((void *)(intptr_t)(x))

static int batch(void *const *entries, const uint64_t *desc, const int64_t *w) {
    void *stream = P(w[0]);
    const uint64_t *dst = desc + w[1], *src = desc + w[2], *sizes = desc + w[3];
    int64_t count = w[4], step = w[5];
    void *attrs = P(w[6]);
    int64_t variant = w[7];
    if (variant == 0) {
        memcpy_fn copy = (memcpy_fn)entries[E_MEMCPY];
        for (int64_t i = 0; i < count; i++) {
            int rc = copy(dst[i], src[i], (size_t)sizes[i], stream);
            if (rc) return rc;
        }
        return 0;
    }
    for (int64_t lo = 0; lo < count; lo += step) {
        size_t k = (size_t)(count - lo < step ? count - lo : step);
        size_t attr_idx = 0, fail_idx = 0;
        int rc;
        if (variant == 13)
            rc = ((batch13_fn)entries[E_BATCH])(P(dst + lo), P(src + lo), P(sizes + lo), k, attrs,
                                                &attr_idx, 1, stream);
        else
            rc = ((batch12_fn)entries[E_BATCH])(P(dst + lo), P(src + lo), P(sizes + lo), k, attrs,
                                                &attr_idx, 1, &fail_idx, stream);
        if (rc) return rc;
    }
    return 0;
}

int64_t oe_launch_run(const int64_t *prog, int64_t words, const uint64_t *desc,
                      void *const *entries, int64_t *fail) {
    int64_t at = 0, op = 0;
    void *params[MAX_PARAMS];
    while (at < words) {
        int64_t code = prog[at];
        const int64_t *w = prog + at + 1;
        int64_t left = words - at - 1, used;
        int rc;
        switch (code) {
        case OP_WAIT:
            used = 2;
            if (left < used) goto bad;
            rc = ((wait_fn)entries[E_WAIT])(P(w[0]), P(w[1]), 0);
            break;
        case OP_RECORD:
            used = 2;
            if (left < used) goto bad;
            rc = ((record_fn)entries[E_RECORD])(P(w[0]), P(w[1]));
            break;
        case OP_BATCH:
            used = 8;
            if (left < used || w[4] < 0 || w[5] < 1) goto bad;
            if (w[7] != 0 && w[7] != 12 && w[7] != 13) goto bad;
            rc = w[4] ? batch(entries, desc, w) : 0;
            break;
        case OP_LAUNCH:
            if (left < 10 || w[9] < 0 || w[9] > MAX_PARAMS || left < 10 + w[9]) goto bad;
            used = 10 + w[9];
            for (int64_t i = 0; i < w[9]; i++) params[i] = (void *)(w + 10 + i);
            rc = ((launch_fn)entries[E_LAUNCH])(
                P(w[0]), (unsigned int)w[1], (unsigned int)w[2], (unsigned int)w[3],
                (unsigned int)w[4], (unsigned int)w[5], (unsigned int)w[6], (unsigned int)w[7],
                P(w[8]), params, NULL);
            break;
        case OP_HTOD:
            used = 4;
            if (left < used) goto bad;
            rc = ((htod_fn)entries[E_HTOD])((uint64_t)w[0], P(w[1]), (size_t)w[2], P(w[3]));
            break;
        default:
            goto bad;
        }
        if (rc) {
            fail[0] = op;
            fail[1] = code;
            fail[2] = rc;
            fail[3] = code == OP_BATCH ? w[7] : 0;
            return 1;
        }
        at += 1 + used;
        op++;
    }
    return 0;
bad:
    fail[0] = at;
    fail[1] = 0;
    fail[2] = 0;
    fail[3] = 0;
    return -1;
}
