/*
 * offload-engine: a device job's launch, issued in one foreign call.
 *
 * A launch "program" is a flat array of int64 words: an opcode, then its
 * operands. This file only walks the program and calls the CUDA driver entry
 * points whose addresses the caller hands in (offload_engine/device/runtimes/_native.py
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
 *   OP_COPY2D  stream dst src width height dst_pitch src_pitch to_host
 *              cuMemcpy2DAsync_v2: `height` rows of `width` bytes, the rows
 *              `*_pitch` bytes apart on each side; to_host 1: device to host,
 *              0: host to device
 *
 * oe_launch_run returns 0 when every call succeeded. Otherwise it stops at the
 * first failing call and returns 1 with fail[0] = that op's index (0 for the
 * first op), fail[1] = its opcode, fail[2] = the driver's result and fail[3] =
 * a batch's variant (0 for other ops); a program it cannot read returns -1 with
 * fail[0] = the word where reading stopped.
 *
 * oe_staged_build writes a staged job's pieces as program words and descriptors
 * (the handler's per-job planning, which in Python cost more than the calls);
 * its header is described above the function.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
/* CUDA_MEMCPY2D (cuda.h), field for field */
struct oe_memcpy2d {
    size_t src_x, src_y;
    int src_type; /* CUmemorytype: 1 host, 2 device */
    const void *src_host;
    uint64_t src_device;
    void *src_array;
    size_t src_pitch;
    size_t dst_x, dst_y;
    int dst_type;
    void *dst_host;
    uint64_t dst_device;
    void *dst_array;
    size_t dst_pitch;
    size_t width, height;
};
typedef int (*copy2d_fn)(const struct oe_memcpy2d *copy, void *stream);

enum { OP_WAIT = 1, OP_RECORD = 2, OP_BATCH = 3, OP_LAUNCH = 4, OP_HTOD = 5, OP_COPY2D = 6 };
/* the words of a batch and a launch op that oe_staged_build sets per piece (the same
   names in _native.py): a batch's stream, descriptor columns and count; a launch's
   grid x and the block-copy kernel's cache ids (parameter 4) and slot base (6) */
enum { BATCH_STREAM = 1, BATCH_DST = 2, BATCH_SRC = 3, BATCH_SIZES = 4, BATCH_COUNT = 5,
       BATCH_WORDS = 9 };
enum { LAUNCH_GRID_X = 2, LAUNCH_NPARAMS = 10, LAUNCH_PARAMS = 11,
       LAUNCH_IDS = LAUNCH_PARAMS + 4, LAUNCH_SLOT_BASE = LAUNCH_PARAMS + 6 };
enum { E_RECORD = 0, E_WAIT = 1, E_BATCH = 2, E_MEMCPY = 3, E_LAUNCH = 4, E_HTOD = 5, E_COPY2D = 6 };
enum { COPY2D_WORDS = 9 };
/* the largest pitch a 2D copy takes (the device's memPitch on current GPUs) */
#define MAX_PITCH 0x7fffffffull
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
        case OP_COPY2D: {
            used = COPY2D_WORDS - 1;
            if (left < used || w[3] < 0 || w[4] < 0 || w[5] < w[3] || w[6] < w[3]) goto bad;
            struct oe_memcpy2d c;
            memset(&c, 0, sizeof c);
            c.src_pitch = (size_t)w[6];
            c.dst_pitch = (size_t)w[5];
            c.width = (size_t)w[3];
            c.height = (size_t)w[4];
            if (w[7]) {
                c.src_type = 2;
                c.src_device = (uint64_t)w[2];
                c.dst_type = 1;
                c.dst_host = P(w[1]);
            } else {
                c.src_type = 1;
                c.src_host = P(w[2]);
                c.dst_type = 2;
                c.dst_device = (uint64_t)w[1];
            }
            rc = ((copy2d_fn)entries[E_COPY2D])(&c, P(w[0]));
            break;
        }
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

/*
 * A staged job's pieces, planned here rather than in Python: the same ops, in the
 * same order with the same operands, that offload_engine/device/staged.py makes
 * call by call. The header is StagedHeader in _native.py, field for field; the
 * first fields hold a stream set's facts, whatever the job, the rest the job's.
 */
struct oe_staged_header {
    int64_t store;          /* 1: store (gather, then DMA), 0: load */
    int64_t sm_stream;
    int64_t dma_streams[2]; /* a piece's DMA stream, by its parity */
    int64_t buffers;        /* staging buffers */
    int64_t rows;           /* rows per staging buffer */
    int64_t row_bytes;      /* a staging row's bytes (a tier slot's) */
    const int64_t *batch_template;   /* a batch op's 9 words */
    const int64_t *buffer_addresses; /* `buffers` addresses */
    uint64_t tier_base;
    uint64_t slot_bytes;
    uint64_t factor;       /* tier slots per tier block */
    uint64_t block_stride; /* slot s is at (s / factor) * block_stride + (s % factor) * slot_bytes */
    int64_t copy2d_rows;   /* a run of at least this many rows of one stride moves as one
                              2D copy (a group that moves part of each slot); 0: never */
    int64_t *words;        /* where the program's words go */
    uint64_t *descriptors; /* the descriptor array */
    int64_t first_descriptor; /* its first free word */
    uint64_t *slots;       /* the groups' tier slots, group after group: replaced by
                              their tier addresses, sorted */
    int64_t *host_ids;     /* the groups' cache ids in the id buffer's host memory,
                              sorted with them */
    int64_t device_ids;    /* those ids' device address */
    int64_t next_buffer;   /* the staging buffer the first piece takes */
    int64_t pieces_before; /* pieces staged before this job (their DMA streams' parity) */
    int64_t groups;
    /* `buffers` words (each buffer's last event, 0: none), then per group four
       (its blocks, its bytes per block, its launch op template's address, where
       those bytes start in a tier slot: a part of each block, such as some layers,
       moves from that offset), then two events per piece (its first half done,
       its second) */
    const int64_t *tail;
};

/* sizeof(struct oe_staged_header), which _native.py checks against its StagedHeader */
int64_t oe_staged_header_size(void) { return (int64_t)sizeof(struct oe_staged_header); }

/*
 * Each group's blocks are sorted by tier address (stable) and cut into pieces of
 * `rows` blocks; within a piece, blocks whose tier rows continue each other (and
 * whose staging rows do: a group that fills a row) merge into one descriptor.
 * A group that moves part of each slot (some layers, or a group smaller than the
 * slot) leaves gaps between its tier rows: a run of at least copy2d_rows rows
 * one stride apart (consecutive slots) moves as one 2D copy instead, which the
 * copy engine runs at the link's rate where one descriptor per row does not.
 * A piece is: [wait first <- buffer's last event] first half, record, wait,
 * second half, record; a store gathers (launch) then DMAs, a load the reverse.
 * A piece's DMA half is its batch of descriptors (if any), then its 2D copies.
 * out = (words written, ops, the descriptor array's first free word, rows moved by
 * 2D copies). Returns 0,
 * or -1 if memory for the sort could not be had.
 */

#define RUN 16

static int sort_rows(uint64_t *tier, int64_t *ids, int64_t n) {
    int64_t i;
    for (i = 1; i < n; i++)
        if (tier[i] <= tier[i - 1]) break;
    if (i >= n) return 0; /* strictly ascending: as given */
    uint64_t *t2 = malloc((size_t)n * sizeof *t2);
    int64_t *i2 = malloc((size_t)n * sizeof *i2);
    if (!t2 || !i2) {
        free(t2);
        free(i2);
        return -1;
    }
    /* stable, as numpy's argsort(kind="stable"): insertion sort of runs of RUN,
       then bottom-up merges */
    for (int64_t lo = 0; lo < n; lo += RUN) {
        const int64_t hi = lo + RUN < n ? lo + RUN : n;
        for (int64_t j = lo + 1; j < hi; j++) {
            const uint64_t t = tier[j];
            const int64_t v = ids[j];
            int64_t k = j;
            for (; k > lo && tier[k - 1] > t; k--) {
                tier[k] = tier[k - 1];
                ids[k] = ids[k - 1];
            }
            tier[k] = t;
            ids[k] = v;
        }
    }
    uint64_t *ts = tier, *td = t2;
    int64_t *is = ids, *id = i2;
    for (int64_t width = RUN; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi) {
                if (ts[b] < ts[a]) {
                    td[k] = ts[b];
                    id[k++] = is[b++];
                } else {
                    td[k] = ts[a];
                    id[k++] = is[a++];
                }
            }
            while (a < mid) {
                td[k] = ts[a];
                id[k++] = is[a++];
            }
            while (b < hi) {
                td[k] = ts[b];
                id[k++] = is[b++];
            }
        }
        uint64_t *tt = ts;
        ts = td;
        td = tt;
        int64_t *it = is;
        is = id;
        id = it;
    }
    if (ts != tier) {
        memcpy(tier, ts, (size_t)n * sizeof *tier);
        memcpy(ids, is, (size_t)n * sizeof *ids);
    }
    free(t2);
    free(i2);
    return 0;
}

int64_t oe_staged_build(const struct oe_staged_header *h, int64_t *out) {
    const int64_t store = h->store, sm = h->sm_stream, nbuf = h->buffers, rows = h->rows;
    const int64_t pitch = h->row_bytes;
    const int64_t *batch_tpl = h->batch_template;
    const int64_t *buffers = h->buffer_addresses;
    const uint64_t tier_base = h->tier_base, slot_bytes = h->slot_bytes;
    const uint64_t factor = h->factor, block_stride = h->block_stride;
    int64_t *w = h->words;
    uint64_t *desc = h->descriptors;
    int64_t nd = h->first_descriptor;
    uint64_t *tier = h->slots;
    int64_t *ids = h->host_ids;
    const int64_t ids_device = h->device_ids, next = h->next_buffer, before = h->pieces_before;
    const int64_t ngroups = h->groups;
    const int64_t *free_in = h->tail, *groups = free_in + nbuf, *events = groups + 4 * ngroups;
    const int64_t m2d = h->copy2d_rows;
    int64_t *last = malloc((size_t)(nbuf > 0 ? nbuf : 1) * sizeof *last);
    /* a piece's 2D runs: (first row, rows, stride) each; a run has at least m2d rows */
    int64_t *runs = malloc((size_t)(m2d > 1 ? rows / m2d + 1 : 1) * 3 * sizeof *runs);
    if (!last || !runs) {
        free(last);
        free(runs);
        return -1;
    }
    memcpy(last, free_in, (size_t)nbuf * sizeof *last);
    int64_t nw = 0, ops = 0, piece = 0, at = 0, rows2d = 0;
    for (int64_t g = 0; g < ngroups; g++) {
        const int64_t n = groups[4 * g], size = groups[4 * g + 1];
        const int64_t *launch_tpl = (const int64_t *)(intptr_t)groups[4 * g + 2];
        const uint64_t start = (uint64_t)groups[4 * g + 3];
        const int64_t launch_words = LAUNCH_PARAMS + launch_tpl[LAUNCH_NPARAMS];
        const int merge = size == pitch;
        /* 2D runs: a group that moves part of each slot (a part, or a group that does
           not fill its slot), whose rows in the tier are apart by more than they hold */
        const int two_d = m2d > 1 && (uint64_t)size < slot_bytes;
        for (int64_t i = at; i < at + n; i++) { /* slots to tier addresses, in place */
            const uint64_t slot = tier[i];
            tier[i] = tier_base + slot / factor * block_stride + slot % factor * slot_bytes + start;
        }
        if (sort_rows(tier + at, ids + at, n)) {
            free(last);
            free(runs);
            return -1;
        }
        for (int64_t lo = 0; lo < n; lo += rows, piece++) {
            const int64_t hi = lo + rows < n ? lo + rows : n, count = hi - lo;
            const int64_t b = (next + piece) % nbuf;
            const int64_t dma = h->dma_streams[(before + 1 + piece) % 2];
            const int64_t first = store ? sm : dma, second = store ? dma : sm;
            const int64_t full = events[2 * piece], end = events[2 * piece + 1];
            const uint64_t row0 = (uint64_t)buffers[b];
            /* descriptors: columns of `count` words each (fewer used after merging) */
            uint64_t *dst = desc + nd, *src = dst + count, *sizes = src + count;
            uint64_t *tier_col = store ? dst : src, *row_col = store ? src : dst;
            int64_t k = 0, nruns = 0, last_row = -1; /* last_row: the last row in a descriptor */
            for (int64_t i = lo; i < hi; i++) {
                const uint64_t t = tier[at + i];
                if (two_d && hi - i >= m2d) { /* rows i..j apart by one stride d */
                    const uint64_t d = tier[at + i + 1] - t;
                    int64_t j = i + 1;
                    if (d >= (uint64_t)size && d <= MAX_PITCH && !(merge && d == (uint64_t)size))
                        while (j + 1 < hi && tier[at + j + 1] - tier[at + j] == d) j++;
                    else
                        j = i;
                    if (j + 1 - i >= m2d) {
                        runs[3 * nruns] = i;
                        runs[3 * nruns + 1] = j + 1 - i;
                        runs[3 * nruns + 2] = (int64_t)d;
                        nruns++;
                        rows2d += j + 1 - i;
                        i = j;
                        continue;
                    }
                }
                if (k && merge && last_row == i - 1 && tier[at + i - 1] + (uint64_t)size == t) {
                    sizes[k - 1] += (uint64_t)size;
                    last_row = i;
                    continue;
                }
                last_row = i;
                tier_col[k] = t;
                row_col[k] = row0 + (uint64_t)((i - lo) * pitch);
                sizes[k++] = (uint64_t)size;
            }
            if (k < count) { /* close the gaps merging left */
                memmove(dst + k, src, (size_t)k * sizeof *src);
                memmove(dst + 2 * k, sizes, (size_t)k * sizeof *sizes);
            }
            int64_t batch[BATCH_WORDS];
            memcpy(batch, batch_tpl, sizeof batch);
            batch[BATCH_STREAM] = dma;
            batch[BATCH_DST] = nd;
            batch[BATCH_SRC] = nd + k;
            batch[BATCH_SIZES] = nd + 2 * k;
            batch[BATCH_COUNT] = k;
            nd += 3 * k;
            if (last[b]) {
                w[nw++] = OP_WAIT;
                w[nw++] = first;
                w[nw++] = last[b];
                ops++;
            }
            for (int half = 0; half < 2; half++) {
                const int launch = (half == 0) == (store != 0);
                if (launch) {
                    int64_t *op = w + nw;
                    memcpy(op, launch_tpl, (size_t)launch_words * sizeof *op);
                    op[LAUNCH_GRID_X] = count;
                    op[LAUNCH_IDS] = ids_device + 8 * (at + lo);
                    /* a part's region table counts slot offsets from the slot's
                       start, and its bytes sit at the row's start */
                    op[LAUNCH_SLOT_BASE] = (int64_t)(row0 - start);
                    nw += launch_words;
                } else {
                    if (k) {
                        memcpy(w + nw, batch, sizeof batch);
                        nw += BATCH_WORDS;
                    }
                    for (int64_t r = 0; r < nruns; r++) {
                        const int64_t first_row = runs[3 * r], height = runs[3 * r + 1];
                        const int64_t stride = runs[3 * r + 2];
                        const int64_t row = (int64_t)row0 + (first_row - lo) * pitch;
                        const int64_t t = (int64_t)tier[at + first_row];
                        w[nw++] = OP_COPY2D;
                        w[nw++] = dma;
                        w[nw++] = store ? t : row;         /* dst */
                        w[nw++] = store ? row : t;         /* src */
                        w[nw++] = size;                    /* width */
                        w[nw++] = height;
                        w[nw++] = store ? stride : pitch;  /* dst pitch */
                        w[nw++] = store ? pitch : stride;  /* src pitch */
                        w[nw++] = store;                   /* to host */
                    }
                }
                w[nw++] = OP_RECORD;
                w[nw++] = half == 0 ? full : end;
                w[nw++] = half == 0 ? first : second;
                if (half == 0) {
                    w[nw++] = OP_WAIT;
                    w[nw++] = second;
                    w[nw++] = full;
                }
            }
            ops += 4 + (k > 0) + nruns;
            last[b] = end;
        }
        at += n;
    }
    free(last);
    free(runs);
    out[0] = nw;
    out[1] = ops;
    out[2] = nd;
    out[3] = rows2d;
    return 0;
}

/*
 * oe_check_pairs: a submit's checks of the common job (one KV group, one slot per
 * tier block) in one pass, so that a submit makes one foreign call instead of a
 * handful of numpy calls (each costs tens of microseconds when the caller's thread
 * has been idle). cache[i] pairs with tier[i], i < n. Returns 0 when every cache id
 * is in [0, ncache), every tier id in [0, ntier) and the destinations (tier ids if
 * dst_tier, else cache ids) are distinct; 1 when they are not (the caller's general
 * path then finds what is wrong and says so); -1 if memory could not be had.
 */
int64_t oe_check_pairs(const int64_t *cache, const int64_t *tier, int64_t n, int64_t ncache,
                       int64_t ntier, int64_t dst_tier) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (cache[i] < 0 || cache[i] >= ncache || tier[i] < 0 || tier[i] >= ntier) return 1;
    const int64_t *dst = dst_tier ? tier : cache;
    /* open addressing, at most half full; ids are >= 0, so -1 marks an empty slot */
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n) cap <<= 1;
    int64_t local[2048];
    int64_t *table = local;
    if (cap > sizeof local / sizeof local[0]) {
        table = malloc(cap * sizeof *table);
        if (!table) return -1;
    }
    memset(table, 0xff, cap * sizeof *table);
    int64_t rc = 0;
    for (i = 0; i < n && !rc; i++) {
        const int64_t v = dst[i];
        uint64_t h = ((uint64_t)v * 0x9E3779B97F4A7C15ull) >> 17;
        for (;; h++) {
            h &= cap - 1;
            if (table[h] < 0) {
                table[h] = v;
                break;
            }
            if (table[h] == v) {
                rc = 1;
                break;
            }
        }
    }
    if (table != local) free(table);
    return rc;
}

/*
 * oe_chunk_descriptors: a dma job's copy descriptors for one KV group, the ones
 * chunk_descriptors in offload_engine/host/layout.py makes with numpy (about
 * fifteen numpy calls, tens of microseconds in a thread that has been idle).
 *
 * tables: the group's regions as four columns of nreg words each: base address,
 * block stride, size, offset in a tier slot. ids: n cache ids, then the n tier
 * slots they pair with. Slot s starts at tier_base + (s / factor) * block_stride
 * + (s % factor) * slot_bytes (a tier whose blocks are back to back has
 * block_stride = factor * slot_bytes). store: 1 when the tier is the destination.
 *
 * Chunks go block by block, a block's regions in order; a chunk that continues
 * the previous one on both sides joins it (merge_runs). out has room for 3 * n *
 * nreg words; the k descriptors are written as three columns, dst at out[0..k),
 * src at out[k..2k), sizes at out[2k..3k). Returns k.
 */
int64_t oe_chunk_descriptors(const uint64_t *tables, int64_t nreg, const int64_t *ids, int64_t n,
                             uint64_t tier_base, uint64_t slot_bytes, uint64_t factor,
                             uint64_t block_stride, int64_t store, uint64_t *out) {
    const uint64_t *base = tables, *stride = tables + nreg, *size = tables + 2 * nreg,
                   *offset = tables + 3 * nreg;
    const int64_t cap = n * nreg;
    uint64_t *dst = out, *src = out + cap, *len = out + 2 * cap;
    int64_t k = 0, i, r;
    for (i = 0; i < n; i++) {
        const uint64_t block = (uint64_t)ids[i], slot = (uint64_t)ids[n + i];
        const uint64_t slot_at =
            tier_base + (slot / factor) * block_stride + (slot % factor) * slot_bytes;
        for (r = 0; r < nreg; r++) {
            const uint64_t cache_at = base[r] + block * stride[r];
            const uint64_t tier_at = slot_at + offset[r];
            const uint64_t d = store ? tier_at : cache_at, s = store ? cache_at : tier_at;
            if (k && dst[k - 1] + len[k - 1] == d && src[k - 1] + len[k - 1] == s) {
                len[k - 1] += size[r];
                continue;
            }
            dst[k] = d;
            src[k] = s;
            len[k] = size[r];
            k++;
        }
    }
    memmove(out + k, src, (size_t)k * sizeof *out);
    memmove(out + 2 * k, len, (size_t)k * sizeof *out);
    return k;
}
