/* callframe.h: the binary layer-call frame of an open step, its parser and the
 * step's checks and bookkeeping (issue 53; docs/architecture.md, "The call
 * frame's parser, as built"). Pure C11: no Python, no I/O, no allocation outside
 * atc_table_init; the compiled data plane's I/O thread and the Python binding
 * (_callframe.c) both drive it.
 *
 * A request (little-endian), ATC_HEAD_BYTES of head then the body:
 *   "ATC1" | u32 step | u32 layer | u32 seq | u32 body_len | body
 * the body: q | k | v back to back in the step's dtype, C order, q [B, queries,
 * Hq, d], k and v [B, rows, Hkv, d] (absent when rows == 0). The step fixes the
 * byte size of each, so a frame is checked against it before a byte is copied.
 * A reply, ATC_REPLY_HEAD_BYTES of head then its body:
 *   "ATR1" | u32 seq | u32 status | u32 body_len | body
 *
 * Not thread-safe: one thread (or one lock) owns a table and its steps. */
#ifndef ATTNSERVE_CALLFRAME_H
#define ATTNSERVE_CALLFRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ATC_HEAD_BYTES 20u
#define ATC_REPLY_HEAD_BYTES 16u
/* layer indices a step may name: 0 .. ATC_MAX_LAYERS - 1 */
#define ATC_MAX_LAYERS 4096u
#define ATC_LAYER_WORDS (ATC_MAX_LAYERS / 64u)
/* the most steps one table holds */
#define ATC_MAX_CAPACITY (1u << 20)

/* Every answer of this module. The names (atc_status_name) are stable: the
 * binding's CallFrameError.status carries them, and counters will be keyed by them. */
typedef enum {
    ATC_OK = 0,
    /* atc_parse_head */
    ATC_NEED_MORE,      /* fewer than ATC_HEAD_BYTES bytes, and those agree with the magic */
    ATC_BAD_MAGIC,      /* not "ATC1" (judged on as many of its 4 bytes as there are) */
    ATC_TOO_LARGE,      /* body_len > the reader's max_body */
    /* atc_check_call, in the order they are checked */
    ATC_UNKNOWN_STEP,   /* no such open step, or another tenant's */
    ATC_BROKEN,         /* the step is broken (a call applied to some items only) */
    ATC_LAYER_NOT_IN_STEP,
    ATC_LAYER_CALLED,   /* the layer is claimed (in flight) or applied this token */
    ATC_BODY_LEN,       /* body_len is not q_bytes + k_bytes + v_bytes, or not the bytes given */
    ATC_NOT_FINITE,     /* a NaN or an infinity, with check_finite */
    /* the table and the bookkeeping */
    ATC_STEP_EXISTS,    /* atc_open: the id is open already */
    ATC_TABLE_FULL,     /* atc_open: capacity steps are open */
    ATC_BAD_STEP,       /* atc_open: an invalid definition (id 0, no layers, a layer out of
                           range or repeated, a size not whole elements, k != v, ...) */
    ATC_NOT_CLAIMED,    /* atc_settle: the layer is not in flight */
    ATC_BAD_ARGUMENT,   /* atc_table_init: capacity 0 or above ATC_MAX_CAPACITY */
    ATC_NO_MEMORY,      /* atc_table_init */
    ATC_STATUS_COUNT
} atc_status;

typedef enum { ATC_F32 = 0, ATC_F16 = 1, ATC_BF16 = 2, ATC_DTYPE_COUNT } atc_dtype;

enum { ATC_ARRAY_Q = 0, ATC_ARRAY_K = 1, ATC_ARRAY_V = 2 };

/* What a step fixes, and its bookkeeping for the current token. */
typedef struct atc_step {
    uint32_t id;       /* > 0 */
    uint32_t owner;    /* the tenant that opened it */
    uint32_t q_bytes, k_bytes, v_bytes; /* k_bytes == v_bytes; 0 when rows == 0 */
    atc_dtype dtype;
    bool check_finite;
    bool broken;
    uint32_t n_layers;     /* layers in the step */
    uint32_t n_claimed;    /* layers claimed this token: in flight or applied */
    uint32_t n_applied;    /* layers applied this token */
    uint64_t token;        /* tokens completed: every layer applied once per token */
    uint32_t broken_layer; /* the first partial call, when broken */
    uint64_t broken_token;
    uint64_t layers[ATC_LAYER_WORDS];  /* bit l: layer l is in the step */
    uint64_t claimed[ATC_LAYER_WORDS]; /* bit l: claimed this token (in flight or applied) */
    uint64_t applied[ATC_LAYER_WORDS]; /* bit l: applied this token (a subset of claimed) */
    uint32_t slot;                     /* private: its index in the table's steps */
} atc_step;

/* A step's definition, for atc_open. */
typedef struct {
    uint32_t id, owner;
    uint32_t q_bytes, k_bytes, v_bytes;
    atc_dtype dtype;
    bool check_finite;
    const uint32_t *layers; /* distinct, each < ATC_MAX_LAYERS */
    size_t n_layers;        /* >= 1 */
} atc_step_def;

/* A fixed-capacity table of open steps: the steps in an array (a step keeps its
 * address while open), found by id through an open-addressed index (linear
 * probing, deletion by backward shift: no tombstones, O(1) expected). */
typedef struct {
    uint32_t capacity, count;
    uint32_t index_mask;  /* index size - 1: a power of two >= 2 * capacity */
    uint32_t *index;      /* slot + 1, 0 when empty */
    atc_step *steps;      /* capacity of them */
    uint32_t *free_slots; /* a stack of the unused slots */
    uint32_t n_free;
} atc_table;

/* A request's head. */
typedef struct {
    uint32_t step, layer, seq, body_len;
} atc_head;

/* What atc_check_call found. On ATC_OK: the step, and where q, k and v are in the
 * body (offsets and byte counts, each within it). On ATC_NOT_FINITE: which array
 * and the flat element index of its first non-finite value. */
typedef struct {
    atc_step *step;
    uint32_t layer, seq;
    uint32_t q_off, k_off, v_off;
    uint32_t q_bytes, k_bytes, v_bytes;
    int bad_array;      /* ATC_ARRAY_*, or -1 */
    uint64_t bad_index; /* element index within that array */
} atc_call;

const char *atc_status_name(int status); /* "UNKNOWN" for a value out of range */
const char *atc_dtype_name(atc_dtype dtype);
uint32_t atc_dtype_size(atc_dtype dtype); /* 0 for a value out of range */

atc_status atc_table_init(atc_table *table, uint32_t capacity);
void atc_table_free(atc_table *table); /* idempotent; a zeroed table too */
atc_status atc_open(atc_table *table, const atc_step_def *def, atc_step **out);
atc_status atc_close(atc_table *table, uint32_t id);
atc_step *atc_lookup(const atc_table *table, uint32_t id);

/* Parses a request head from the first len bytes of buf. Reads at most
 * ATC_HEAD_BYTES of them. */
atc_status atc_parse_head(const uint8_t *buf, size_t len, uint64_t max_body, atc_head *head);

/* Checks a parsed head and its body (body_len bytes at body; body may be NULL when
 * body_len is 0) against the table, for the tenant owner: the step, then the
 * layer, then the body's length, then (check_finite) its values. Changes nothing. */
atc_status atc_check_call(const atc_table *table, uint32_t owner, const atc_head *head, const uint8_t *body,
                          size_t body_len, atc_call *call);

/* The first non-finite element of count elements of dtype at data: its index, or
 * -1 when all are finite. */
int64_t atc_first_nonfinite(const uint8_t *data, uint64_t count, atc_dtype dtype);

/* Bookkeeping of a layer call (docs/architecture.md). atc_claim marks the layer as
 * in flight (ATC_BROKEN, ATC_LAYER_NOT_IN_STEP, ATC_LAYER_CALLED when it may not be);
 * atc_settle ends it: applied_items == 0 releases the layer (a retry is safe);
 * otherwise it is applied, and failed_items > 0 too breaks the step (the first such
 * call is remembered). When every layer of the token is applied, token += 1 and
 * the token's bitmaps clear. ATC_NOT_CLAIMED when the layer is not in flight.
 * atc_settle works on a broken step too (calls in flight when it broke settle). */
atc_status atc_claim(atc_step *step, uint32_t layer);
atc_status atc_settle(atc_step *step, uint32_t layer, uint64_t applied_items, uint64_t failed_items);

bool atc_step_has_layer(const atc_step *step, uint32_t layer);
bool atc_layer_claimed(const atc_step *step, uint32_t layer);
bool atc_layer_applied(const atc_step *step, uint32_t layer);

/* Writes a request head / a reply head (little-endian) into out. */
void atc_write_head(uint8_t out[ATC_HEAD_BYTES], const atc_head *head);
void atc_write_reply_head(uint8_t out[ATC_REPLY_HEAD_BYTES], uint32_t seq, uint32_t status, uint32_t body_len);

#endif
