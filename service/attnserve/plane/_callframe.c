/* attnserve.plane._callframe: the Python binding of callframe.c (the layer-call
 * frame's parser and the step's checks; callframe.h, docs/architecture.md "The
 * call frame's parser, as built").
 *
 * A StepTable holds the open steps' C records; parse_head and check read the
 * caller's buffers in place (the buffer protocol: no copy), and every buffer taken
 * is released on every path. It runs under the GIL, which it never releases: every
 * argument is converted before the table is touched, so no Python code runs while
 * a step pointer is held. A refused frame raises CallFrameError, whose ``status``
 * is the C status's stable name (NOT_FINITE: ``array`` "q", "k" or "v" and the
 * flat element ``index`` too). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "callframe.h"

/* set by setup.py: the digest of this module's three sources (SOURCE_DIGEST) and
 * each one's (SOURCES) */
#ifndef SOURCE_DIGEST
#error "build through setup.py (pip install .): it defines SOURCE_DIGEST and the SOURCE_* digests"
#endif

static PyObject *CallFrameError; /* the exception type */
static const char ARRAY_NAMES[3][2] = {"q", "k", "v"};

/* Raises CallFrameError(message) with .status = the status's name; NOT_FINITE's
 * array and index when call is given. Returns NULL. */
static PyObject *fail(atc_status status, const atc_call *call, const char *format, ...) {
    va_list args;
    va_start(args, format);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (!message) return NULL;
    PyObject *exc = PyObject_CallOneArg(CallFrameError, message);
    Py_DECREF(message);
    if (!exc) return NULL;
    PyObject *name = PyUnicode_FromString(atc_status_name(status));
    int bad = !name || PyObject_SetAttrString(exc, "status", name) < 0;
    Py_XDECREF(name);
    if (!bad && status == ATC_NOT_FINITE && call && call->bad_array >= 0) {
        PyObject *array = PyUnicode_FromString(ARRAY_NAMES[call->bad_array]);
        PyObject *index = PyLong_FromUnsignedLongLong(call->bad_index);
        bad = !array || !index || PyObject_SetAttrString(exc, "array", array) < 0 ||
              PyObject_SetAttrString(exc, "index", index) < 0;
        Py_XDECREF(array);
        Py_XDECREF(index);
    }
    if (!bad) PyErr_SetObject(CallFrameError, exc);
    Py_DECREF(exc);
    return NULL;
}

/* A Python int in 0 .. UINT32_MAX (OverflowError otherwise). */
static int as_u32(PyObject *obj, const char *what, uint32_t *out) {
    unsigned long long v;
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.80s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long signed_v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (signed_v == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || (overflow == 0 && signed_v < 0)) goto range;
    if (overflow > 0) goto range;
    v = (unsigned long long)signed_v;
    if (v > UINT32_MAX) goto range;
    *out = (uint32_t)v;
    return 0;
range:
    PyErr_Format(PyExc_OverflowError, "%s must be in 0 .. 4294967295", what);
    return -1;
}

/* A Python int >= 0 as a uint64_t. */
static int as_u64(PyObject *obj, const char *what, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.80s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s must be in 0 .. 2**64 - 1", what);
        return -1;
    }
    *out = v;
    return 0;
}

static int as_dtype(PyObject *obj, atc_dtype *out) {
    const char *s = PyUnicode_Check(obj) ? PyUnicode_AsUTF8(obj) : NULL;
    if (s && (!strcmp(s, "f32") || !strcmp(s, "<f4") || !strcmp(s, "float32"))) *out = ATC_F32;
    else if (s && (!strcmp(s, "f16") || !strcmp(s, "<f2") || !strcmp(s, "float16"))) *out = ATC_F16;
    else if (s && (!strcmp(s, "bf16") || !strcmp(s, "bfloat16"))) *out = ATC_BF16;
    else {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "dtype must be one of f32/<f4, f16/<f2, bf16/bfloat16, not %R", obj);
        return -1;
    }
    return 0;
}

/* ---- StepTable ---- */

typedef struct {
    PyObject_HEAD
    atc_table table;
} StepTable;

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:StepTable", kwlist, &capacity)) return NULL;
    if (capacity < 1 || capacity > (Py_ssize_t)ATC_MAX_CAPACITY) {
        return PyErr_Format(PyExc_ValueError, "capacity must be in 1 .. %u", ATC_MAX_CAPACITY);
    }
    StepTable *self = (StepTable *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    if (atc_table_init(&self->table, (uint32_t)capacity) != ATC_OK) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void table_dealloc(StepTable *self) {
    atc_table_free(&self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t table_len(StepTable *self) { return (Py_ssize_t)self->table.count; }

static PyObject *table_open(StepTable *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"step", "owner", "layers", "q_bytes", "k_bytes", "v_bytes", "dtype", "check_finite", NULL};
    PyObject *o_step, *o_owner, *o_layers, *o_q, *o_k, *o_v, *o_dtype;
    int check_finite;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOp:open", kwlist, &o_step, &o_owner, &o_layers, &o_q, &o_k,
                                     &o_v, &o_dtype, &check_finite)) {
        return NULL;
    }
    atc_step_def def = {.check_finite = check_finite != 0};
    if (as_u32(o_step, "step", &def.id) < 0 || as_u32(o_owner, "owner", &def.owner) < 0 ||
        as_u32(o_q, "q_bytes", &def.q_bytes) < 0 || as_u32(o_k, "k_bytes", &def.k_bytes) < 0 ||
        as_u32(o_v, "v_bytes", &def.v_bytes) < 0 || as_dtype(o_dtype, &def.dtype) < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(o_layers, "layers must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > (Py_ssize_t)ATC_MAX_LAYERS) {
        Py_DECREF(seq);
        return fail(ATC_BAD_STEP, NULL, "step %u: %zd layers, a step has 1 .. %u", def.id, n, ATC_MAX_LAYERS);
    }
    uint32_t layers[ATC_MAX_LAYERS];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u32(PySequence_Fast_GET_ITEM(seq, i), "a layer", &layers[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    def.layers = layers;
    def.n_layers = (size_t)n;
    atc_status st = atc_open(&self->table, &def, NULL);
    switch (st) {
    case ATC_OK: Py_RETURN_NONE;
    case ATC_STEP_EXISTS: return fail(st, NULL, "step %u is open already", def.id);
    case ATC_TABLE_FULL: return fail(st, NULL, "%u steps are open, the table's capacity", self->table.capacity);
    default:
        return fail(st, NULL,
                    "step %u: not a valid step (id > 0; 1 .. %u distinct layers each < %u; q_bytes > 0, "
                    "k_bytes == v_bytes, each whole %s elements, their sum < 2**32)",
                    def.id, ATC_MAX_LAYERS, ATC_MAX_LAYERS, atc_dtype_name(def.dtype));
    }
}

static PyObject *table_close(StepTable *self, PyObject *arg) {
    uint32_t id;
    if (as_u32(arg, "step", &id) < 0) return NULL;
    if (atc_close(&self->table, id) != ATC_OK) return fail(ATC_UNKNOWN_STEP, NULL, "step %u is not open", id);
    Py_RETURN_NONE;
}

/* the head of a frame, from a buffer (parsed) or a (step, layer, seq, body_len) tuple */
static int get_head(PyObject *obj, atc_head *head) {
    if (PyTuple_Check(obj)) {
        if (PyTuple_GET_SIZE(obj) != 4) {
            PyErr_SetString(PyExc_TypeError, "a head tuple is (step, layer, seq, body_len)");
            return -1;
        }
        uint32_t *fields[4] = {&head->step, &head->layer, &head->seq, &head->body_len};
        static const char *names[4] = {"step", "layer", "seq", "body_len"};
        for (int i = 0; i < 4; i++)
            if (as_u32(PyTuple_GET_ITEM(obj, i), names[i], fields[i]) < 0) return -1;
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return -1;
    atc_status st = atc_parse_head(view.buf, (size_t)view.len, UINT32_MAX, head);
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (st != ATC_OK) {
        fail(st, NULL, st == ATC_NEED_MORE ? "a head is %u bytes, %zd given" : "not a layer-call frame (ATC1)",
             ATC_HEAD_BYTES, len);
        return -1;
    }
    return 0;
}

static PyObject *parse_head(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"buffer", "max_body", NULL};
    Py_buffer view;
    unsigned long long max_body = UINT32_MAX;
    (void)module;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|K:parse_head", kwlist, &view, &max_body)) return NULL;
    atc_head head;
    atc_status st = atc_parse_head(view.buf, (size_t)view.len, max_body, &head);
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    switch (st) {
    case ATC_OK: return Py_BuildValue("(IIII)", head.step, head.layer, head.seq, head.body_len);
    case ATC_NEED_MORE: return fail(st, NULL, "a head is %u bytes, %zd given", ATC_HEAD_BYTES, len);
    case ATC_BAD_MAGIC: return fail(st, NULL, "not a layer-call frame: it does not start with ATC1");
    default: return fail(st, NULL, "body_len %u is above the limit %llu", head.body_len, max_body);
    }
}

static PyObject *table_check(StepTable *self, PyObject *args) {
    PyObject *o_owner, *o_head, *o_body;
    if (!PyArg_ParseTuple(args, "OOO:check", &o_owner, &o_head, &o_body)) return NULL;
    uint32_t owner;
    atc_head head;
    if (as_u32(o_owner, "owner", &owner) < 0 || get_head(o_head, &head) < 0) return NULL;
    Py_buffer body;
    if (PyObject_GetBuffer(o_body, &body, PyBUF_SIMPLE) < 0) return NULL;
    atc_call call;
    atc_status st = atc_check_call(&self->table, owner, &head, body.buf, (size_t)body.len, &call);
    Py_ssize_t given = body.len;
    PyBuffer_Release(&body);
    const atc_step *s = atc_lookup(&self->table, head.step);
    switch (st) {
    case ATC_OK: return Py_BuildValue("(III)", call.q_off, call.k_off, call.v_off);
    case ATC_UNKNOWN_STEP: return fail(st, NULL, "step %u is not open for this tenant", head.step);
    case ATC_BROKEN:
        return fail(st, NULL, "step %u is broken: layer %u of token %llu applied to some items only", head.step,
                    s->broken_layer, (unsigned long long)s->broken_token);
    case ATC_LAYER_NOT_IN_STEP: return fail(st, NULL, "layer %u is not one of step %u's layers", head.layer, head.step);
    case ATC_LAYER_CALLED:
        return fail(st, NULL, "layer %u was already called for token %llu of step %u", head.layer,
                    (unsigned long long)s->token, head.step);
    case ATC_BODY_LEN:
        return fail(st, NULL, "step %u's body is %llu bytes (q %u, k %u, v %u); the head says %u, %zd given",
                    head.step, (unsigned long long)s->q_bytes + s->k_bytes + s->v_bytes, s->q_bytes, s->k_bytes,
                    s->v_bytes, head.body_len, given);
    case ATC_NOT_FINITE:
        return fail(st, &call, "%s[%llu] is not finite (NaN or infinity)", ARRAY_NAMES[call.bad_array],
                    (unsigned long long)call.bad_index);
    default: return fail(st, NULL, "refused");
    }
}

/* the open step of id (CallFrameError UNKNOWN_STEP otherwise) */
static atc_step *open_step(StepTable *self, PyObject *o_step, uint32_t *id) {
    if (as_u32(o_step, "step", id) < 0) return NULL;
    atc_step *s = atc_lookup(&self->table, *id);
    if (!s) fail(ATC_UNKNOWN_STEP, NULL, "step %u is not open", *id);
    return s;
}

static PyObject *table_claim(StepTable *self, PyObject *args) {
    PyObject *o_step, *o_layer;
    uint32_t id, layer;
    if (!PyArg_ParseTuple(args, "OO:claim", &o_step, &o_layer)) return NULL;
    if (as_u32(o_layer, "layer", &layer) < 0) return NULL;
    atc_step *s = open_step(self, o_step, &id);
    if (!s) return NULL;
    atc_status st = atc_claim(s, layer);
    switch (st) {
    case ATC_OK: return PyLong_FromUnsignedLongLong(s->token);
    case ATC_BROKEN: return fail(st, NULL, "step %u is broken", id);
    case ATC_LAYER_NOT_IN_STEP: return fail(st, NULL, "layer %u is not one of step %u's layers", layer, id);
    default:
        return fail(st, NULL, "layer %u was already called for token %llu of step %u", layer,
                    (unsigned long long)s->token, id);
    }
}

static PyObject *table_settle(StepTable *self, PyObject *args) {
    PyObject *o_step, *o_layer, *o_applied, *o_failed;
    uint32_t id, layer;
    uint64_t applied, failed;
    if (!PyArg_ParseTuple(args, "OOOO:settle", &o_step, &o_layer, &o_applied, &o_failed)) return NULL;
    if (as_u32(o_layer, "layer", &layer) < 0 || as_u64(o_applied, "applied_items", &applied) < 0 ||
        as_u64(o_failed, "failed_items", &failed) < 0) {
        return NULL;
    }
    atc_step *s = open_step(self, o_step, &id);
    if (!s) return NULL;
    if (atc_settle(s, layer, applied, failed) != ATC_OK)
        return fail(ATC_NOT_CLAIMED, NULL, "layer %u of step %u is not in flight", layer, id);
    return PyLong_FromUnsignedLongLong(s->token);
}

static PyObject *layer_list(const atc_step *s, const uint64_t *bits, const uint64_t *minus) {
    PyObject *list = PyList_New(0);
    for (uint32_t w = 0; list && w < ATC_LAYER_WORDS; w++) {
        uint64_t word = bits[w] & ~(minus ? minus[w] : 0);
        for (uint32_t b = 0; word && b < 64; b++, word >>= 1) {
            if (!(word & 1)) continue;
            PyObject *l = PyLong_FromUnsignedLong(w * 64 + b);
            if (!l || PyList_Append(list, l) < 0) Py_CLEAR(list);
            Py_XDECREF(l);
            if (!list) break;
        }
    }
    (void)s;
    return list;
}

static PyObject *table_info(StepTable *self, PyObject *arg) {
    uint32_t id;
    const atc_step *s = open_step(self, arg, &id);
    if (!s) return NULL;
    PyObject *layers = layer_list(s, s->layers, NULL);
    PyObject *in_flight = layer_list(s, s->claimed, s->applied);
    PyObject *applied = layer_list(s, s->applied, NULL);
    PyObject *out = NULL;
    if (layers && in_flight && applied) {
        out = Py_BuildValue(
            "{s:I,s:I,s:O,s:I,s:I,s:I,s:s,s:O,s:K,s:O,s:O,s:O,s:N,s:N}", "step", s->id, "owner", s->owner, "layers",
            layers, "q_bytes", s->q_bytes, "k_bytes", s->k_bytes, "v_bytes", s->v_bytes, "dtype",
            atc_dtype_name(s->dtype), "check_finite", s->check_finite ? Py_True : Py_False, "token",
            (unsigned long long)s->token, "in_flight", in_flight, "applied", applied, "broken",
            s->broken ? Py_True : Py_False, "broken_layer",
            s->broken ? PyLong_FromUnsignedLong(s->broken_layer) : Py_NewRef(Py_None), "broken_token",
            s->broken ? PyLong_FromUnsignedLongLong(s->broken_token) : Py_NewRef(Py_None));
    }
    Py_XDECREF(layers);
    Py_XDECREF(in_flight);
    Py_XDECREF(applied);
    return out;
}

static PyObject *table_get_capacity(StepTable *self, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLong(self->table.capacity);
}

static PyMethodDef table_methods[] = {
    {"open", (PyCFunction)(void (*)(void))table_open, METH_VARARGS | METH_KEYWORDS,
     "open(step, owner, layers, q_bytes, k_bytes, v_bytes, dtype, check_finite): add a step"},
    {"close", (PyCFunction)table_close, METH_O, "close(step): remove a step"},
    {"check", (PyCFunction)table_check, METH_VARARGS,
     "check(owner, head, body) -> (q_off, k_off, v_off): a call's head (a buffer or a (step, layer, seq, "
     "body_len) tuple) and body checked against its step; changes nothing"},
    {"claim", (PyCFunction)table_claim, METH_VARARGS, "claim(step, layer) -> token: the layer is in flight"},
    {"settle", (PyCFunction)table_settle, METH_VARARGS,
     "settle(step, layer, applied_items, failed_items) -> token: the layer's call ended"},
    {"info", (PyCFunction)table_info, METH_O, "info(step) -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef table_getset[] = {
    {"capacity", (getter)table_get_capacity, NULL, "the most steps open at once", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods table_as_sequence = {.sq_length = (lenfunc)table_len};

static PyTypeObject StepTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "attnserve.plane._callframe.StepTable",
    .tp_basicsize = sizeof(StepTable),
    .tp_dealloc = (destructor)table_dealloc,
    .tp_as_sequence = &table_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "StepTable(capacity): the open steps, at most capacity of them",
    .tp_methods = table_methods,
    .tp_getset = table_getset,
    .tp_new = table_new,
};

/* ---- module functions ---- */

static PyObject *write_head(PyObject *args, const char *format, int reply) {
    PyObject *o[4];
    uint32_t v[4];
    static const char *names[2][4] = {{"step", "layer", "seq", "body_len"}, {"seq", "status", "body_len", ""}};
    int n = reply ? 3 : 4;
    if (reply ? !PyArg_ParseTuple(args, format, &o[0], &o[1], &o[2])
              : !PyArg_ParseTuple(args, format, &o[0], &o[1], &o[2], &o[3])) {
        return NULL;
    }
    for (int i = 0; i < n; i++)
        if (as_u32(o[i], names[reply][i], &v[i]) < 0) return NULL;
    uint8_t out[ATC_HEAD_BYTES];
    if (reply) {
        atc_write_reply_head(out, v[0], v[1], v[2]);
        return PyBytes_FromStringAndSize((const char *)out, ATC_REPLY_HEAD_BYTES);
    }
    atc_head head = {v[0], v[1], v[2], v[3]};
    atc_write_head(out, &head);
    return PyBytes_FromStringAndSize((const char *)out, ATC_HEAD_BYTES);
}

static PyObject *reply_head(PyObject *module, PyObject *args) {
    (void)module;
    return write_head(args, "OOO:reply_head", 1);
}

static PyObject *call_head(PyObject *module, PyObject *args) {
    (void)module;
    return write_head(args, "OOOO:call_head", 0);
}

static PyMethodDef module_methods[] = {
    {"parse_head", (PyCFunction)(void (*)(void))parse_head, METH_VARARGS | METH_KEYWORDS,
     "parse_head(buffer, max_body=2**32-1) -> (step, layer, seq, body_len)"},
    {"reply_head", reply_head, METH_VARARGS, "reply_head(seq, status, body_len) -> bytes: a reply's head"},
    {"call_head", call_head, METH_VARARGS, "call_head(step, layer, seq, body_len) -> bytes: a call's head"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_callframe",
    .m_doc = "The layer-call frame's parser and the step's checks (callframe.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__callframe(void) {
    if (PyType_Ready(&StepTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    PyObject *defaults = Py_BuildValue("{s:O,s:O,s:O}", "status", Py_None, "array", Py_None, "index", Py_None);
    PyObject *sources = Py_BuildValue("{s:s,s:s,s:s}", "callframe.h", SOURCE_CALLFRAME_H, "callframe.c",
                                      SOURCE_CALLFRAME_C, "_callframe.c", SOURCE_BINDING_C);
    if (defaults) {
        CallFrameError = PyErr_NewExceptionWithDoc(
            "attnserve.plane._callframe.CallFrameError",
            "A frame or a step operation refused: .status is the C status's name (NOT_FINITE: .array, .index)",
            PyExc_ValueError, defaults);
    }
    Py_XDECREF(defaults);
    if (!CallFrameError || !sources || PyModule_AddObjectRef(m, "CallFrameError", CallFrameError) < 0 ||
        PyModule_AddObjectRef(m, "StepTable", (PyObject *)&StepTableType) < 0 ||
        PyModule_AddObjectRef(m, "SOURCES", sources) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0 ||
        PyModule_AddIntConstant(m, "HEAD_BYTES", ATC_HEAD_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "REPLY_HEAD_BYTES", ATC_REPLY_HEAD_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_LAYERS", ATC_MAX_LAYERS) < 0) {
        Py_XDECREF(sources);
        Py_DECREF(m);
        return NULL;
    }
    Py_DECREF(sources);
    return m;
}
