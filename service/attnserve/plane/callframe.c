/* callframe.c: the layer-call frame's parser, the step's checks and bookkeeping
 * (callframe.h says what each function promises). Pure C11, no Python.
 *
 * Safety rules kept throughout: every length is checked before a byte it covers is
 * read; sizes are added and multiplied as uint64_t from uint32_t operands (no
 * overflow possible), and a sum that must fit a uint32_t is checked against it;
 * values are read byte by byte (no unaligned or type-punned loads, no float
 * conversion: a non-finite value is found from its exponent bits). */
#include "callframe.h"

#include <stdlib.h>
#include <string.h>

static const char *const STATUS_NAMES[ATC_STATUS_COUNT] = {
    [ATC_OK] = "OK",
    [ATC_NEED_MORE] = "NEED_MORE",
    [ATC_BAD_MAGIC] = "BAD_MAGIC",
    [ATC_TOO_LARGE] = "TOO_LARGE",
    [ATC_UNKNOWN_STEP] = "UNKNOWN_STEP",
    [ATC_BROKEN] = "BROKEN",
    [ATC_LAYER_NOT_IN_STEP] = "LAYER_NOT_IN_STEP",
    [ATC_LAYER_CALLED] = "LAYER_CALLED",
    [ATC_BODY_LEN] = "BODY_LEN",
    [ATC_NOT_FINITE] = "NOT_FINITE",
    [ATC_STEP_EXISTS] = "STEP_EXISTS",
    [ATC_TABLE_FULL] = "TABLE_FULL",
    [ATC_BAD_STEP] = "BAD_STEP",
    [ATC_NOT_CLAIMED] = "NOT_CLAIMED",
    [ATC_BAD_ARGUMENT] = "BAD_ARGUMENT",
    [ATC_NO_MEMORY] = "NO_MEMORY",
};

static const char MAGIC[4] = {'A', 'T', 'C', '1'};
static const char REPLY_MAGIC[4] = {'A', 'T', 'R', '1'};

const char *atc_status_name(int status) {
    if (status < 0 || status >= (int)ATC_STATUS_COUNT) return "UNKNOWN";
    return STATUS_NAMES[status];
}

const char *atc_dtype_name(atc_dtype dtype) {
    switch (dtype) {
    case ATC_F32: return "f32";
    case ATC_F16: return "f16";
    case ATC_BF16: return "bf16";
    default: return "unknown";
    }
}

uint32_t atc_dtype_size(atc_dtype dtype) {
    switch (dtype) {
    case ATC_F32: return 4;
    case ATC_F16:
    case ATC_BF16: return 2;
    default: return 0;
    }
}

/* little-endian reads and writes, byte by byte (compilers make them one load) */
static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline void wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* ---- bitmaps of layers ---- */

static inline bool bit_get(const uint64_t *words, uint32_t i) {
    return i < ATC_MAX_LAYERS && ((words[i >> 6] >> (i & 63u)) & 1u);
}

static inline void bit_set(uint64_t *words, uint32_t i) { words[i >> 6] |= (uint64_t)1 << (i & 63u); }

static inline void bit_clear(uint64_t *words, uint32_t i) { words[i >> 6] &= ~((uint64_t)1 << (i & 63u)); }

bool atc_step_has_layer(const atc_step *step, uint32_t layer) { return bit_get(step->layers, layer); }
bool atc_layer_claimed(const atc_step *step, uint32_t layer) { return bit_get(step->claimed, layer); }
bool atc_layer_applied(const atc_step *step, uint32_t layer) { return bit_get(step->applied, layer); }

/* ---- the table ---- */

static inline uint32_t home(const atc_table *t, uint32_t id) {
    uint32_t h = id * 2654435761u; /* Knuth's multiplicative hash; unsigned: wraps, defined */
    h ^= h >> 15;
    return h & t->index_mask;
}

atc_status atc_table_init(atc_table *t, uint32_t capacity) {
    memset(t, 0, sizeof *t);
    if (capacity == 0 || capacity > ATC_MAX_CAPACITY) return ATC_BAD_ARGUMENT;
    uint32_t size = 2;
    while (size < 2u * capacity) size <<= 1; /* <= 2^21: no overflow */
    t->index = calloc(size, sizeof *t->index);
    t->steps = calloc(capacity, sizeof *t->steps);
    t->free_slots = calloc(capacity, sizeof *t->free_slots);
    if (!t->index || !t->steps || !t->free_slots) {
        atc_table_free(t);
        return ATC_NO_MEMORY;
    }
    t->capacity = capacity;
    t->index_mask = size - 1;
    for (uint32_t i = 0; i < capacity; i++) t->free_slots[i] = capacity - 1 - i; /* slot 0 first */
    t->n_free = capacity;
    return ATC_OK;
}

void atc_table_free(atc_table *t) {
    free(t->index);
    free(t->steps);
    free(t->free_slots);
    memset(t, 0, sizeof *t);
}

/* the index position holding id, or index_mask + 1 when absent */
static uint32_t find(const atc_table *t, uint32_t id) {
    for (uint32_t i = home(t, id);; i = (i + 1) & t->index_mask) {
        uint32_t e = t->index[i];
        if (e == 0) return t->index_mask + 1;
        if (t->steps[e - 1].id == id) return i;
    }
}

atc_step *atc_lookup(const atc_table *t, uint32_t id) {
    if (id == 0 || !t->index) return NULL;
    uint32_t i = find(t, id);
    return i > t->index_mask ? NULL : &t->steps[t->index[i] - 1];
}

atc_status atc_open(atc_table *t, const atc_step_def *def, atc_step **out) {
    if (out) *out = NULL;
    uint32_t size = atc_dtype_size(def->dtype);
    if (def->id == 0 || size == 0 || def->n_layers == 0 || def->n_layers > ATC_MAX_LAYERS || !def->layers) {
        return ATC_BAD_STEP;
    }
    if (def->q_bytes == 0 || def->q_bytes % size || def->k_bytes % size || def->k_bytes != def->v_bytes) {
        return ATC_BAD_STEP;
    }
    if ((uint64_t)def->q_bytes + def->k_bytes + def->v_bytes > UINT32_MAX) return ATC_BAD_STEP;
    uint64_t layers[ATC_LAYER_WORDS] = {0};
    for (size_t i = 0; i < def->n_layers; i++) {
        uint32_t l = def->layers[i];
        if (l >= ATC_MAX_LAYERS || bit_get(layers, l)) return ATC_BAD_STEP;
        bit_set(layers, l);
    }
    if (!t->index) return ATC_BAD_ARGUMENT;
    if (atc_lookup(t, def->id)) return ATC_STEP_EXISTS;
    if (t->count >= t->capacity || t->n_free == 0) return ATC_TABLE_FULL;

    uint32_t slot = t->free_slots[--t->n_free];
    atc_step *s = &t->steps[slot];
    memset(s, 0, sizeof *s);
    s->id = def->id;
    s->owner = def->owner;
    s->q_bytes = def->q_bytes;
    s->k_bytes = def->k_bytes;
    s->v_bytes = def->v_bytes;
    s->dtype = def->dtype;
    s->check_finite = def->check_finite;
    s->n_layers = (uint32_t)def->n_layers;
    memcpy(s->layers, layers, sizeof layers);
    s->slot = slot;
    uint32_t i = home(t, def->id);
    while (t->index[i] != 0) i = (i + 1) & t->index_mask;
    t->index[i] = slot + 1;
    t->count++;
    if (out) *out = s;
    return ATC_OK;
}

atc_status atc_close(atc_table *t, uint32_t id) {
    if (id == 0 || !t->index) return ATC_UNKNOWN_STEP;
    uint32_t i = find(t, id);
    if (i > t->index_mask) return ATC_UNKNOWN_STEP;
    uint32_t slot = t->index[i] - 1;
    /* backward-shift deletion: move later entries of the probe run back into the
     * hole while the hole lies on their probe path (from their home to them) */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & t->index_mask;
        uint32_t e = t->index[j];
        if (e == 0) break;
        uint32_t k = home(t, t->steps[e - 1].id);
        if (((j - k) & t->index_mask) >= ((j - i) & t->index_mask)) {
            t->index[i] = e;
            i = j;
        }
    }
    t->index[i] = 0;
    memset(&t->steps[slot], 0, sizeof t->steps[slot]);
    t->free_slots[t->n_free++] = slot;
    t->count--;
    return ATC_OK;
}

/* ---- the frame ---- */

atc_status atc_parse_head(const uint8_t *buf, size_t len, uint64_t max_body, atc_head *head) {
    size_t m = len < sizeof MAGIC ? len : sizeof MAGIC;
    if (m && memcmp(buf, MAGIC, m) != 0) return ATC_BAD_MAGIC;
    if (len < ATC_HEAD_BYTES) return ATC_NEED_MORE;
    head->step = rd32(buf + 4);
    head->layer = rd32(buf + 8);
    head->seq = rd32(buf + 12);
    head->body_len = rd32(buf + 16);
    if (head->body_len > max_body) return ATC_TOO_LARGE;
    return ATC_OK;
}

void atc_write_head(uint8_t out[ATC_HEAD_BYTES], const atc_head *head) {
    memcpy(out, MAGIC, 4);
    wr32(out + 4, head->step);
    wr32(out + 8, head->layer);
    wr32(out + 12, head->seq);
    wr32(out + 16, head->body_len);
}

void atc_write_reply_head(uint8_t out[ATC_REPLY_HEAD_BYTES], uint32_t seq, uint32_t status, uint32_t body_len) {
    memcpy(out, REPLY_MAGIC, 4);
    wr32(out + 4, seq);
    wr32(out + 8, status);
    wr32(out + 12, body_len);
}

/* ---- finite values ---- */

/* non-finite: every exponent bit set. f32: bits 23..30 (byte 3's low 7, byte 2's
 * top); f16: bits 10..14 (byte 1's bits 2..6); bf16: bits 7..14 (byte 1's low 7,
 * byte 0's top). */
static inline int bad_f32(const uint8_t *p) { return (p[3] & 0x7f) == 0x7f && (p[2] & 0x80); }
static inline int bad_f16(const uint8_t *p) { return (p[1] & 0x7c) == 0x7c; }
static inline int bad_bf16(const uint8_t *p) { return (p[1] & 0x7f) == 0x7f && (p[0] & 0x80); }

#define BLOCK 256u

/* Scans a block with no early exit (vectorisable), then finds the first bad one
 * only in a block that has one. */
#define SCAN(bad, size)                                                          \
    for (uint64_t start = 0; start < count; start += BLOCK) {                    \
        uint64_t end = count - start < BLOCK ? count : start + BLOCK;            \
        int any = 0;                                                             \
        for (uint64_t i = start; i < end; i++) any |= bad(data + i * (size));    \
        if (any) {                                                               \
            for (uint64_t i = start; i < end; i++)                               \
                if (bad(data + i * (size))) return (int64_t)i;                   \
        }                                                                        \
    }

int64_t atc_first_nonfinite(const uint8_t *data, uint64_t count, atc_dtype dtype) {
    switch (dtype) {
    case ATC_F32: SCAN(bad_f32, 4u) break;
    case ATC_F16: SCAN(bad_f16, 2u) break;
    case ATC_BF16: SCAN(bad_bf16, 2u) break;
    default: break;
    }
    return -1;
}

/* ---- the checks ---- */

atc_status atc_check_call(const atc_table *t, uint32_t owner, const atc_head *head, const uint8_t *body,
                          size_t body_len, atc_call *call) {
    memset(call, 0, sizeof *call);
    call->bad_array = -1;
    call->layer = head->layer;
    call->seq = head->seq;
    atc_step *s = atc_lookup(t, head->step);
    if (!s || s->owner != owner) return ATC_UNKNOWN_STEP;
    if (s->broken) return ATC_BROKEN;
    if (!bit_get(s->layers, head->layer)) return ATC_LAYER_NOT_IN_STEP;
    if (bit_get(s->claimed, head->layer)) return ATC_LAYER_CALLED;
    uint64_t want = (uint64_t)s->q_bytes + s->k_bytes + s->v_bytes;
    if ((uint64_t)head->body_len != want || (uint64_t)body_len != want || (want && !body)) return ATC_BODY_LEN;
    call->step = s;
    call->q_off = 0;
    call->q_bytes = s->q_bytes;
    call->k_off = s->q_bytes;
    call->k_bytes = s->k_bytes;
    call->v_off = s->q_bytes + s->k_bytes; /* <= want <= UINT32_MAX (atc_open) */
    call->v_bytes = s->v_bytes;
    if (s->check_finite) {
        uint32_t size = atc_dtype_size(s->dtype);
        const uint32_t offs[3] = {call->q_off, call->k_off, call->v_off};
        const uint32_t lens[3] = {call->q_bytes, call->k_bytes, call->v_bytes};
        for (int a = 0; a < 3; a++) {
            int64_t bad = atc_first_nonfinite(body + offs[a], lens[a] / size, s->dtype);
            if (bad >= 0) {
                call->step = NULL;
                call->bad_array = a;
                call->bad_index = (uint64_t)bad;
                return ATC_NOT_FINITE;
            }
        }
    }
    return ATC_OK;
}

/* ---- the bookkeeping ---- */

atc_status atc_claim(atc_step *s, uint32_t layer) {
    if (s->broken) return ATC_BROKEN;
    if (!bit_get(s->layers, layer)) return ATC_LAYER_NOT_IN_STEP;
    if (bit_get(s->claimed, layer)) return ATC_LAYER_CALLED;
    bit_set(s->claimed, layer);
    s->n_claimed++;
    return ATC_OK;
}

atc_status atc_settle(atc_step *s, uint32_t layer, uint64_t applied_items, uint64_t failed_items) {
    if (!bit_get(s->claimed, layer) || bit_get(s->applied, layer)) return ATC_NOT_CLAIMED;
    if (applied_items == 0) {
        bit_clear(s->claimed, layer);
        s->n_claimed--;
        return ATC_OK;
    }
    bit_set(s->applied, layer);
    s->n_applied++;
    if (failed_items > 0 && !s->broken) {
        s->broken = true;
        s->broken_layer = layer;
        s->broken_token = s->token;
    }
    if (s->n_applied == s->n_layers) {
        /* every layer applied once: none is in flight, so the token's bitmaps clear */
        s->token++;
        s->n_applied = 0;
        s->n_claimed = 0;
        memset(s->claimed, 0, sizeof s->claimed);
        memset(s->applied, 0, sizeof s->applied);
    }
    return ATC_OK;
}
