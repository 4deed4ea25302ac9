/* libFuzzer target: the layer-call frame's parser, the step checks and the step
 * bookkeeping (service/attnserve/plane/callframe.c), against a model of the
 * rules written independently here. Built and run by tools/fuzz/run.sh with
 * -fsanitize=fuzzer,address,undefined; any invariant that fails aborts.
 *
 * An input: a config prefix (the first step's id, dtype, sizes, layers; the
 * table's capacity), then operations until the input ends: raw frames (parsed and
 * checked as they come), frames made for a step (a head written for a step and a
 * layer, the body from the input, a NaN or an infinity planted, the length off by
 * one), claims, settles, closes, reopens and whole tokens. After every operation
 * the table must agree with the model: the open steps, each one's token (never
 * decreasing), its broken state, and each layer's claimed and applied bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "callframe.h"

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "callframe_fuzz: invariant failed: %s (line %d)\n", #cond, __LINE__); \
            abort();                                                                    \
        }                                                                               \
    } while (0)

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static uint8_t u8(reader *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}
static uint32_t u16(reader *r) {
    uint32_t lo = u8(r);
    return lo | ((uint32_t)u8(r) << 8);
}
static uint32_t u32(reader *r) {
    uint32_t lo = u16(r);
    return lo | (u16(r) << 16);
}

#define SLOTS 3
#define MAX_STEP_LAYERS 8
enum { FREE = 0, IN_FLIGHT = 1, APPLIED = 2 };

typedef struct {
    bool open;
    atc_step_def def;
    uint32_t layers[MAX_STEP_LAYERS];
    uint8_t state[MAX_STEP_LAYERS];
    uint64_t token, last_token;
    bool broken;
    uint32_t broken_layer;
    uint64_t broken_token;
} model_step;

typedef struct {
    atc_table table;
    uint32_t capacity;
    model_step s[SLOTS];
} world;

static int layer_pos(const model_step *m, uint32_t layer) {
    for (size_t i = 0; i < m->def.n_layers; i++)
        if (m->layers[i] == layer) return (int)i;
    return -1;
}

static model_step *open_by_id(world *w, uint32_t id) {
    for (int i = 0; i < SLOTS; i++)
        if (w->s[i].open && w->s[i].def.id == id) return &w->s[i];
    return NULL;
}

static uint32_t n_open(const world *w) {
    uint32_t n = 0;
    for (int i = 0; i < SLOTS; i++) n += w->s[i].open;
    return n;
}

/* the reference finite check: through a float where the bits allow it */
static bool finite_ref(const uint8_t *p, atc_dtype dtype) {
    if (dtype == ATC_F16) {
        uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
        return ((h >> 10) & 0x1f) != 0x1f;
    }
    uint32_t bits = dtype == ATC_F32 ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24
                                     : ((uint32_t)p[0] << 16 | (uint32_t)p[1] << 24);
    float f;
    memcpy(&f, &bits, sizeof f);
    return isfinite(f);
}

static void agree(world *w) {
    CHECK(w->table.count == n_open(w));
    for (int i = 0; i < SLOTS; i++) {
        model_step *m = &w->s[i];
        const atc_step *s = atc_lookup(&w->table, m->def.id);
        if (!m->open) {
            if (!open_by_id(w, m->def.id)) CHECK(s == NULL);
            continue;
        }
        CHECK(s != NULL && s->id == m->def.id && s->owner == m->def.owner);
        CHECK(s->token == m->token && s->token >= m->last_token);
        m->last_token = s->token;
        CHECK(s->broken == m->broken);
        if (m->broken) CHECK(s->broken_layer == m->broken_layer && s->broken_token == m->broken_token);
        uint32_t claimed = 0, applied = 0;
        for (size_t l = 0; l < m->def.n_layers; l++) {
            CHECK(atc_step_has_layer(s, m->layers[l]));
            CHECK(atc_layer_claimed(s, m->layers[l]) == (m->state[l] != FREE));
            CHECK(atc_layer_applied(s, m->layers[l]) == (m->state[l] == APPLIED));
            claimed += m->state[l] != FREE;
            applied += m->state[l] == APPLIED;
        }
        CHECK(s->n_claimed == claimed && s->n_applied == applied && s->n_layers == m->def.n_layers);
        for (uint32_t k = 0; k < ATC_LAYER_WORDS; k++) {
            CHECK((s->claimed[k] & ~s->layers[k]) == 0);
            CHECK((s->applied[k] & ~s->claimed[k]) == 0);
        }
    }
}

static void do_open(world *w, model_step *m) {
    if (m->open) return;
    atc_status want = open_by_id(w, m->def.id) ? ATC_STEP_EXISTS
                      : n_open(w) >= w->capacity ? ATC_TABLE_FULL
                                                  : ATC_OK;
    atc_step *s = NULL;
    atc_status got = atc_open(&w->table, &m->def, &s);
    CHECK(got == want);
    CHECK((s != NULL) == (got == ATC_OK));
    if (got == ATC_OK) {
        m->open = true;
        m->token = m->last_token = 0;
        m->broken = false;
        memset(m->state, 0, sizeof m->state);
    }
}

/* a head and body checked: the result must be the model's */
static void check_frame(world *w, uint32_t owner, const atc_head *head, const uint8_t *body, size_t body_len) {
    atc_call call;
    atc_status got = atc_check_call(&w->table, owner, head, body, body_len, &call);
    model_step *m = open_by_id(w, head->step);
    atc_status want;
    int pos = m ? layer_pos(m, head->layer) : -1;
    uint64_t total = m ? (uint64_t)m->def.q_bytes + m->def.k_bytes + m->def.v_bytes : 0;
    if (!m || m->def.owner != owner) want = ATC_UNKNOWN_STEP;
    else if (m->broken) want = ATC_BROKEN;
    else if (pos < 0) want = ATC_LAYER_NOT_IN_STEP;
    else if (m->state[pos] != FREE) want = ATC_LAYER_CALLED;
    else if (head->body_len != total || body_len != total) want = ATC_BODY_LEN;
    else want = ATC_OK;
    if (want == ATC_OK && m->def.check_finite) {
        uint32_t size = atc_dtype_size(m->def.dtype);
        uint32_t lens[3] = {m->def.q_bytes, m->def.k_bytes, m->def.v_bytes};
        uint64_t off = 0;
        for (int a = 0; a < 3 && want == ATC_OK; a++) {
            for (uint64_t i = 0; i < lens[a] / size; i++) {
                if (!finite_ref(body + off + i * size, m->def.dtype)) {
                    want = ATC_NOT_FINITE;
                    CHECK(got == ATC_NOT_FINITE && call.bad_array == a && call.bad_index == i);
                    break;
                }
            }
            off += lens[a];
        }
    }
    CHECK(got == want);
    if (got == ATC_OK) {
        CHECK(call.step == atc_lookup(&w->table, head->step) && call.step->owner == owner);
        CHECK(call.q_off == 0 && call.q_bytes == m->def.q_bytes);
        CHECK(call.k_off == call.q_off + call.q_bytes && call.k_bytes == m->def.k_bytes);
        CHECK(call.v_off == call.k_off + call.k_bytes && call.v_bytes == m->def.v_bytes);
        CHECK((uint64_t)call.v_off + call.v_bytes == body_len);
    } else {
        CHECK(call.step == NULL);
    }
}

static void do_claim(world *w, model_step *m, uint32_t layer) {
    if (!m->open) return;
    atc_step *s = atc_lookup(&w->table, m->def.id);
    CHECK(s != NULL);
    int pos = layer_pos(m, layer);
    atc_status want = m->broken ? ATC_BROKEN : pos < 0 ? ATC_LAYER_NOT_IN_STEP
                                           : m->state[pos] != FREE ? ATC_LAYER_CALLED
                                                                   : ATC_OK;
    CHECK(atc_claim(s, layer) == want);
    if (want == ATC_OK) m->state[pos] = IN_FLIGHT;
}

static void do_settle(world *w, model_step *m, uint32_t layer, uint64_t applied, uint64_t failed) {
    if (!m->open) return;
    atc_step *s = atc_lookup(&w->table, m->def.id);
    CHECK(s != NULL);
    int pos = layer_pos(m, layer);
    atc_status got = atc_settle(s, layer, applied, failed);
    if (pos < 0 || m->state[pos] != IN_FLIGHT) {
        CHECK(got == ATC_NOT_CLAIMED);
        return;
    }
    CHECK(got == ATC_OK);
    if (applied == 0) {
        m->state[pos] = FREE;
        return;
    }
    m->state[pos] = APPLIED;
    if (failed && !m->broken) {
        m->broken = true;
        m->broken_layer = layer;
        m->broken_token = m->token;
    }
    size_t done = 0;
    for (size_t l = 0; l < m->def.n_layers; l++) done += m->state[l] == APPLIED;
    if (done == m->def.n_layers) {
        m->token++;
        memset(m->state, 0, sizeof m->state);
    }
}

static uint32_t pick_layer(reader *r, const model_step *m) {
    uint8_t how = u8(r);
    if (how < 200) return m->layers[how % m->def.n_layers];
    if (how < 230) return u16(r) % (ATC_MAX_LAYERS + 8); /* near and past the limit */
    return u32(r);
}

static uint8_t scratch[ATC_HEAD_BYTES + 4096];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    reader r = {data, size};
    world w;
    memset(&w, 0, sizeof w);
    /* slot 0: from the input */
    model_step *a = &w.s[0];
    uint8_t cfg = u8(&r);
    a->def.id = u32(&r);
    a->def.owner = 7;
    a->def.dtype = (atc_dtype)(cfg % 3);
    uint32_t esize = atc_dtype_size(a->def.dtype);
    a->def.q_bytes = (1u + u8(&r) % 24) * esize;
    a->def.k_bytes = a->def.v_bytes = (u8(&r) % 9) * esize;
    a->def.check_finite = (cfg >> 2) & 1;
    a->def.n_layers = 1 + (cfg >> 3) % 6;
    uint32_t base = u16(&r) % ATC_MAX_LAYERS, stride = 1 + u16(&r) % 700;
    for (size_t i = 0; i < a->def.n_layers; i++) a->layers[i] = (uint32_t)((base + i * stride) % ATC_MAX_LAYERS);
    /* slot 1 and 2: fixed (slot 0's id may be theirs: then one of them is refused) */
    static const uint32_t layers1[] = {0, 1, 2}, layers2[] = {4095};
    w.s[1].def = (atc_step_def){.id = 2, .owner = 7, .dtype = ATC_F16, .q_bytes = 16, .k_bytes = 8, .v_bytes = 8,
                                .check_finite = true, .n_layers = 3};
    memcpy(w.s[1].layers, layers1, sizeof layers1);
    w.s[2].def = (atc_step_def){.id = UINT32_MAX, .owner = 9, .dtype = ATC_BF16, .q_bytes = 6, .check_finite = true,
                                .n_layers = 1};
    memcpy(w.s[2].layers, layers2, sizeof layers2);
    for (int i = 0; i < SLOTS; i++) w.s[i].def.layers = w.s[i].layers;
    if (a->def.id == 0) {
        atc_table_init(&w.table, 1);
        CHECK(atc_open(&w.table, &a->def, NULL) == ATC_BAD_STEP);
        atc_table_free(&w.table);
        a->def.id = 1;
    }
    w.capacity = 2 + (cfg >> 6) % 2;
    CHECK(atc_table_init(&w.table, w.capacity) == ATC_OK);
    for (int i = 0; i < SLOTS; i++) do_open(&w, &w.s[i]);
    agree(&w);

    for (int ops = 0; r.n && ops < 512; ops++) {
        uint8_t op = u8(&r);
        model_step *m = &w.s[u8(&r) % SLOTS];
        uint32_t owner = (op & 0x80) ? 9 : 7;
        switch (op % 8) {
        case 0: { /* a raw frame: parsed, then checked with the bytes after its head */
            size_t len = u16(&r);
            if (len > r.n) len = r.n;
            const uint8_t *frame = r.p;
            r.p += len;
            r.n -= len;
            uint64_t max_body = (op & 0x40) ? 64 : UINT32_MAX;
            atc_head head;
            atc_status st = atc_parse_head(frame, len, max_body, &head);
            bool magic_ok = len < 4 ? memcmp(frame, "ATC1", len) == 0 : memcmp(frame, "ATC1", 4) == 0;
            if (!magic_ok) CHECK(st == ATC_BAD_MAGIC);
            else if (len < ATC_HEAD_BYTES) CHECK(st == ATC_NEED_MORE);
            else CHECK(st == (head.body_len > max_body ? ATC_TOO_LARGE : ATC_OK));
            if (st == ATC_OK) check_frame(&w, owner, &head, frame + ATC_HEAD_BYTES, len - ATC_HEAD_BYTES);
            break;
        }
        case 1:
        case 2: { /* a frame made for a step and a layer */
            atc_head head = {.step = m->def.id, .layer = pick_layer(&r, m), .seq = u32(&r)};
            uint8_t how = u8(&r);
            if (how % 16 == 0) head.step = u32(&r);
            uint32_t total = m->def.q_bytes + m->def.k_bytes + m->def.v_bytes; /* <= 240 */
            uint32_t body_len = total;
            if (how % 8 == 1) body_len = total + 1;
            if (how % 8 == 2 && total) body_len = total - 1;
            head.body_len = (how % 8 == 3) ? total + 4 : body_len;
            uint8_t *body = scratch + ATC_HEAD_BYTES;
            size_t have = r.n < body_len ? r.n : body_len;
            memcpy(body, r.p, have);
            r.p += have;
            r.n -= have;
            for (size_t i = have; i < body_len; i++) body[i] = (uint8_t)(i * 37u); /* finite in every dtype */
            uint8_t plant = u8(&r);
            if (plant & 1 && body_len >= 4) { /* a NaN or an infinity at an element boundary */
                uint32_t es = atc_dtype_size(m->def.dtype);
                size_t at = (u8(&r) % (body_len / es)) * es;
                if (m->def.dtype == ATC_F32) {
                    body[at + 2] |= 0x80;
                    body[at + 3] |= 0x7f;
                } else if (m->def.dtype == ATC_F16) {
                    body[at + 1] |= 0x7c;
                } else {
                    body[at] |= 0x80;
                    body[at + 1] |= 0x7f;
                }
            }
            atc_write_head(scratch, &head);
            atc_head back;
            CHECK(atc_parse_head(scratch, ATC_HEAD_BYTES + body_len, UINT32_MAX, &back) == ATC_OK);
            CHECK(memcmp(&back, &head, sizeof head) == 0);
            /* an exactly sized copy, so that ASan sees a read past the body */
            uint8_t *exact = malloc(body_len ? body_len : 1);
            CHECK(exact != NULL);
            memcpy(exact, body, body_len);
            check_frame(&w, owner, &head, body_len ? exact : NULL, body_len);
            if (op % 8 == 2) { /* the call goes through: claimed, then settled */
                do_claim(&w, m, head.layer);
                do_settle(&w, m, head.layer, u8(&r) % 3, u8(&r) % 2);
            }
            free(exact);
            break;
        }
        case 3: do_claim(&w, m, pick_layer(&r, m)); break;
        case 4: {
            uint32_t layer = pick_layer(&r, m);
            uint8_t items = u8(&r);
            do_settle(&w, m, layer, items & 3, (items >> 2) & 1 ? (uint64_t)u32(&r) | 1 : 0);
            break;
        }
        case 5:
            if (m->open) {
                CHECK(atc_close(&w.table, m->def.id) == ATC_OK);
                m->open = false;
            } else {
                CHECK(atc_close(&w.table, m->def.id) == (open_by_id(&w, m->def.id) ? ATC_OK : ATC_UNKNOWN_STEP));
                model_step *other = open_by_id(&w, m->def.id);
                if (other) other->open = false;
            }
            break;
        case 6: do_open(&w, m); break;
        case 7: /* a whole token: every layer claimed and applied */
            for (size_t l = 0; l < m->def.n_layers; l++) {
                do_claim(&w, m, m->layers[l]);
                do_settle(&w, m, m->layers[l], 1, 0);
            }
            break;
        }
        agree(&w);
    }
    atc_table_free(&w.table);
    return 0;
}
