/* Unit driver of callframe.c in C, run by tools/fuzz/run.sh under ASan and UBSan:
 * the table against a reference under long random churn of opens and closes (the
 * index's backward-shift deletion), every status name, the parser's edges, step
 * definitions at the size limits, the finite check on every special bit pattern
 * of each dtype, and the heads' bytes. The Python tests (tests/test_callframe.py)
 * cover the rest through the binding. Exit 0, or abort() at the first failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "callframe.h"

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "callframe_test: failed: %s (line %d)\n", #cond, __LINE__); \
            abort();                                                                 \
        }                                                                            \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15u;
static uint64_t rnd(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717u;
}

static atc_step_def def_of(uint32_t id, const uint32_t *layers, size_t n) {
    return (atc_step_def){.id = id, .owner = 1, .q_bytes = 4, .dtype = ATC_F32, .layers = layers, .n_layers = n};
}

static void test_names(void) {
    for (int i = 0; i < ATC_STATUS_COUNT; i++) {
        CHECK(strcmp(atc_status_name(i), "UNKNOWN") != 0);
        for (int j = 0; j < i; j++) CHECK(strcmp(atc_status_name(i), atc_status_name(j)) != 0);
    }
    CHECK(strcmp(atc_status_name(-1), "UNKNOWN") == 0 && strcmp(atc_status_name(ATC_STATUS_COUNT), "UNKNOWN") == 0);
}

/* random opens, closes and lookups of ids from a small range (so that probe runs
 * collide and wrap), checked against a plain array */
static void test_churn(void) {
    enum { CAP = 64, IDS = 200, OPS = 200000 };
    atc_table t;
    CHECK(atc_table_init(&t, CAP) == ATC_OK);
    static bool open[IDS + 1];
    static atc_step *where[IDS + 1];
    uint32_t count = 0, layer = 0;
    for (int op = 0; op < OPS; op++) {
        uint32_t id = 1 + (uint32_t)(rnd() % IDS);
        if (op % 1000 == 0) id = 1 + (uint32_t)(rnd() % 4) * 64; /* ids whose hashes may collide */
        switch (rnd() % 3) {
        case 0: {
            atc_step_def d = def_of(id, &layer, 1);
            atc_step *s;
            atc_status st = atc_open(&t, &d, &s);
            CHECK(st == (open[id] ? ATC_STEP_EXISTS : count == CAP ? ATC_TABLE_FULL : ATC_OK));
            if (st == ATC_OK) {
                open[id] = true;
                where[id] = s;
                count++;
            }
            break;
        }
        case 1:
            CHECK(atc_close(&t, id) == (open[id] ? ATC_OK : ATC_UNKNOWN_STEP));
            if (open[id]) count--;
            open[id] = false;
            break;
        default: break;
        }
        CHECK(t.count == count);
        if (op % 97 == 0) {
            for (uint32_t k = 1; k <= IDS; k++) {
                atc_step *s = atc_lookup(&t, k);
                CHECK(open[k] ? s == where[k] && s->id == k : s == NULL); /* a step keeps its address */
            }
        }
    }
    CHECK(atc_lookup(&t, 0) == NULL && atc_close(&t, 0) == ATC_UNKNOWN_STEP);
    atc_table_free(&t);
    atc_table_free(&t); /* idempotent */
    CHECK(atc_table_init(&t, 0) == ATC_BAD_ARGUMENT);
    CHECK(atc_table_init(&t, ATC_MAX_CAPACITY + 1) == ATC_BAD_ARGUMENT);
    CHECK(atc_lookup(&t, 1) == NULL && atc_close(&t, 1) == ATC_UNKNOWN_STEP);
}

static void test_definitions(void) {
    atc_table t;
    CHECK(atc_table_init(&t, 4) == ATC_OK);
    static uint32_t many[ATC_MAX_LAYERS + 1];
    for (uint32_t i = 0; i <= ATC_MAX_LAYERS; i++) many[i] = i;
    atc_step_def d = def_of(1, many, ATC_MAX_LAYERS); /* every layer: fine */
    CHECK(atc_open(&t, &d, NULL) == ATC_OK && atc_close(&t, 1) == ATC_OK);
    d.n_layers = ATC_MAX_LAYERS + 1; /* 4096 is out of range */
    CHECK(atc_open(&t, &d, NULL) == ATC_BAD_STEP);
    uint32_t twice[2] = {3, 3};
    struct {
        atc_step_def d;
        atc_status want;
    } cases[] = {
        {def_of(0, many, 1), ATC_BAD_STEP},
        {def_of(1, many, 0), ATC_BAD_STEP},
        {def_of(1, NULL, 1), ATC_BAD_STEP},
        {def_of(1, twice, 2), ATC_BAD_STEP},
        {{.id = 1, .q_bytes = 0, .layers = many, .n_layers = 1}, ATC_BAD_STEP},
        {{.id = 1, .q_bytes = 6, .layers = many, .n_layers = 1}, ATC_BAD_STEP}, /* 1.5 f32 */
        {{.id = 1, .q_bytes = 4, .k_bytes = 4, .v_bytes = 8, .layers = many, .n_layers = 1}, ATC_BAD_STEP},
        {{.id = 1, .q_bytes = 2, .k_bytes = 1, .v_bytes = 1, .dtype = ATC_F16, .layers = many, .n_layers = 1},
         ATC_BAD_STEP},
        {{.id = 1, .q_bytes = 4, .dtype = (atc_dtype)7, .layers = many, .n_layers = 1}, ATC_BAD_STEP},
        /* q + k + v above 2^32 - 1: no frame carries it */
        {{.id = 1, .q_bytes = 0xfffffffc, .k_bytes = 4, .v_bytes = 4, .layers = many, .n_layers = 1}, ATC_BAD_STEP},
        {{.id = 1, .q_bytes = 0xfffffff4, .k_bytes = 4, .v_bytes = 4, .layers = many, .n_layers = 1}, ATC_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) CHECK(atc_open(&t, &cases[i].d, NULL) == cases[i].want);
    /* the largest step's frame: a head saying 2^32 - 4 bytes is the step's length,
     * but 8 bytes given is BODY_LEN before any byte is read */
    atc_head h = {.step = 1, .layer = 0, .body_len = 0xfffffffc};
    atc_call call;
    uint8_t small[8] = {0};
    CHECK(atc_check_call(&t, 0, &h, small, sizeof small, &call) == ATC_BODY_LEN && call.step == NULL);
    CHECK(atc_check_call(&t, 0, &h, NULL, 0, &call) == ATC_BODY_LEN);
    atc_table_free(&t);
}

static void test_parse(void) {
    uint8_t buf[ATC_HEAD_BYTES];
    atc_head h = {.step = 0x01020304, .layer = 4095, .seq = 0xffffffff, .body_len = 77}, got;
    atc_write_head(buf, &h);
    CHECK(memcmp(buf, "ATC1\x04\x03\x02\x01\xff\x0f\x00\x00\xff\xff\xff\xff\x4d\x00\x00\x00", 20) == 0);
    for (size_t len = 0; len < ATC_HEAD_BYTES; len++) CHECK(atc_parse_head(buf, len, 1000, &got) == ATC_NEED_MORE);
    CHECK(atc_parse_head(buf, ATC_HEAD_BYTES, 77, &got) == ATC_OK && memcmp(&got, &h, sizeof h) == 0);
    CHECK(atc_parse_head(buf, ATC_HEAD_BYTES, 76, &got) == ATC_TOO_LARGE);
    CHECK(atc_parse_head((const uint8_t *)"ATF1", 4, 1000, &got) == ATC_BAD_MAGIC);
    CHECK(atc_parse_head((const uint8_t *)"X", 1, 1000, &got) == ATC_BAD_MAGIC);
    uint8_t reply[ATC_REPLY_HEAD_BYTES];
    atc_write_reply_head(reply, 1, 0x200, 0xfffffffe);
    CHECK(memcmp(reply, "ATR1\x01\x00\x00\x00\x00\x02\x00\x00\xfe\xff\xff\xff", 16) == 0);
}

static void test_finite(void) {
    /* f32: +-0, subnormal, max, +-inf, quiet and signalling NaNs, a NaN payload */
    static const uint32_t f32[][2] = {{0x00000000, 1}, {0x80000000, 1}, {0x00000001, 1}, {0x7f7fffff, 1},
                                      {0xff7fffff, 1}, {0x7f800000, 0}, {0xff800000, 0}, {0x7fc00000, 0},
                                      {0x7f800001, 0}, {0xffffffff, 0}, {0x3f800000, 1}};
    static const uint16_t f16[][2] = {{0x0000, 1}, {0x8000, 1}, {0x0001, 1}, {0x7bff, 1}, {0xfbff, 1},
                                      {0x7c00, 0}, {0xfc00, 0}, {0x7e00, 0}, {0x7c01, 0}, {0xffff, 0}};
    static const uint16_t bf16[][2] = {{0x0000, 1}, {0x8000, 1}, {0x0001, 1}, {0x7f7f, 1}, {0xff7f, 1},
                                       {0x7f80, 0}, {0xff80, 0}, {0x7fc0, 0}, {0x7f81, 0}, {0xffff, 0}};
    uint8_t b[4];
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++) {
        for (int k = 0; k < 4; k++) b[k] = (uint8_t)(f32[i][0] >> (8 * k));
        CHECK((atc_first_nonfinite(b, 1, ATC_F32) < 0) == (f32[i][1] == 1));
    }
    for (size_t i = 0; i < sizeof f16 / sizeof f16[0]; i++) {
        b[0] = (uint8_t)f16[i][0];
        b[1] = (uint8_t)(f16[i][0] >> 8);
        CHECK((atc_first_nonfinite(b, 1, ATC_F16) < 0) == (f16[i][1] == 1));
        b[0] = (uint8_t)bf16[i][0];
        b[1] = (uint8_t)(bf16[i][0] >> 8);
        CHECK((atc_first_nonfinite(b, 1, ATC_BF16) < 0) == (bf16[i][1] == 1));
    }
    /* the first bad one across block boundaries, in exactly sized buffers */
    for (int trial = 0; trial < 2000; trial++) {
        atc_dtype dt = (atc_dtype)(rnd() % 3);
        uint32_t es = atc_dtype_size(dt);
        uint64_t n = 1 + rnd() % 1100;
        uint8_t *p = malloc(n * es);
        CHECK(p != NULL);
        memset(p, 0x11, n * es);
        int64_t first = -1;
        for (int k = (int)(rnd() % 3); k > 0; k--) {
            uint64_t at = rnd() % n;
            memset(p + at * es, 0xff, es);
            if (first < 0 || (int64_t)at < first) first = (int64_t)at;
        }
        CHECK(atc_first_nonfinite(p, n, dt) == first);
        free(p);
    }
    CHECK(atc_first_nonfinite(NULL, 0, ATC_F32) == -1);
}

static void test_bookkeeping(void) {
    atc_table t;
    CHECK(atc_table_init(&t, 2) == ATC_OK);
    uint32_t layers[3] = {0, 7, 4095};
    atc_step *s;
    atc_step_def d = def_of(5, layers, 3);
    CHECK(atc_open(&t, &d, &s) == ATC_OK);
    CHECK(atc_settle(s, 7, 1, 0) == ATC_NOT_CLAIMED);
    CHECK(atc_claim(s, 7) == ATC_OK && atc_claim(s, 7) == ATC_LAYER_CALLED);
    CHECK(atc_settle(s, 7, 0, 3) == ATC_OK && !atc_layer_claimed(s, 7)); /* nothing applied: free again */
    CHECK(atc_claim(s, 4096) == ATC_LAYER_NOT_IN_STEP && atc_claim(s, UINT32_MAX) == ATC_LAYER_NOT_IN_STEP);
    CHECK(atc_settle(s, UINT32_MAX, 1, 0) == ATC_NOT_CLAIMED);
    for (uint64_t token = 0; token < 3; token++) {
        for (int i = 0; i < 3; i++) {
            CHECK(s->token == token);
            CHECK(atc_claim(s, layers[i]) == ATC_OK);
            CHECK(atc_settle(s, layers[i], 2, 0) == ATC_OK);
        }
    }
    CHECK(s->token == 3 && s->n_claimed == 0 && s->n_applied == 0);
    CHECK(atc_claim(s, 0) == ATC_OK && atc_claim(s, 7) == ATC_OK);
    CHECK(atc_settle(s, 0, 1, UINT64_MAX) == ATC_OK && s->broken && s->broken_layer == 0 && s->broken_token == 3);
    CHECK(atc_claim(s, 4095) == ATC_BROKEN);
    CHECK(atc_settle(s, 7, 1, 1) == ATC_OK && s->broken_layer == 0); /* the first failure stays */
    atc_table_free(&t);
}

int main(void) {
    test_names();
    test_churn();
    test_definitions();
    test_parse();
    test_finite();
    test_bookkeeping();
    printf("callframe_test: ok\n");
    return 0;
}
