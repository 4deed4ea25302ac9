/* attnserve.gpu._commands: a batch's GPU commands recorded and submitted in one call.
 *
 * The GPU thread's hot loop (docs/benchmarks.md, issue 43 item 6): a batch writes
 * its uploads, records its dispatches and copies into one command buffer and
 * submits it. Through wgpu-py each of those is a Python call into wgpu-native (its
 * argument checks, its error capture, a cffi call that releases and takes back the
 * GIL): about 17 of them for one fused decode step. Here they are one call: the
 * Python side (attnserve/gpu/native.py) hands over the uploads and a program of
 * 64-bit words, and this module makes the wgpu-native calls with the GIL released
 * once for all of them (and once more for the submission: native.py submits only
 * a command buffer that wgpu-native reported no error for).
 *
 * It calls the same wgpu-native library that wgpu-py loaded (bind() looks its
 * functions up in it, never loading another copy), on handles that wgpu-py's
 * objects own: it takes no reference to them. Every descriptor it passes is NULL
 * (no label), except a timestamped compute pass's (profiling). wgpu-native reports
 * a validation error through the device's error callback, which wgpu-py installed:
 * native.py captures it around this call as wgpu-py does around its own.
 *
 * The program: for each command, an opcode word and five operands.
 *   OP_DISPATCH  pipeline, bind group, x, y, z
 *   OP_COPY      source buffer, source offset, destination buffer, destination offset, size
 * Dispatches in a row share a compute pass; with a query set, each dispatch is a
 * pass of its own whose start and end are written at queries 2i and 2i + 1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* the SHA-256 of this file, set by setup.py */
#ifndef SOURCE_DIGEST
#error "build through setup.py (pip install .): it defines SOURCE_DIGEST"
#endif

#define OP_DISPATCH 1
#define OP_COPY 2
#define OP_WORDS 6

typedef void *Handle;

/* webgpu.h's layouts of the two structs a timestamped pass needs (a label is a
 * WGPUStringView: a pointer and a length). */
typedef struct {
    const char *data;
    size_t length;
} StringView;

typedef struct {
    void *next_in_chain;
    Handle query_set;
    uint32_t beginning_index;
    uint32_t end_index;
} PassTimestampWrites;

typedef struct {
    void *next_in_chain;
    StringView label;
    const PassTimestampWrites *timestamp_writes;
} ComputePassDescriptor;

static struct {
    int bound;
    Handle (*create_command_encoder)(Handle device, const void *descriptor);
    Handle (*begin_compute_pass)(Handle encoder, const ComputePassDescriptor *descriptor);
    void (*set_pipeline)(Handle pass, Handle pipeline);
    void (*set_bind_group)(Handle pass, uint32_t index, Handle group, size_t n_offsets, const uint32_t *offsets);
    void (*dispatch)(Handle pass, uint32_t x, uint32_t y, uint32_t z);
    void (*end_pass)(Handle pass);
    void (*release_pass)(Handle pass);
    void (*copy)(Handle encoder, Handle src, uint64_t src_offset, Handle dst, uint64_t dst_offset, uint64_t size);
    Handle (*finish)(Handle encoder, const void *descriptor);
    void (*release_encoder)(Handle encoder);
    void (*submit)(Handle queue, size_t count, const Handle *buffers);
    void (*release_command_buffer)(Handle buffer);
    void (*write_buffer)(Handle queue, Handle buffer, uint64_t offset, const void *data, size_t size);
} wgpu;

static int look_up(void *lib, const char *name, void **slot) {
    *slot = dlsym(lib, name);
    if (*slot == NULL) {
        PyErr_Format(PyExc_RuntimeError, "wgpu-native has no %s", name);
        return -1;
    }
    return 0;
}

static PyObject *bind(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    /* RTLD_NOLOAD: the library wgpu-py loaded, or nothing (never a second copy) */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "wgpu-native is not loaded from %s", path);
        return NULL;
    }
    if (look_up(lib, "wgpuDeviceCreateCommandEncoder", (void **)&wgpu.create_command_encoder) ||
        look_up(lib, "wgpuCommandEncoderBeginComputePass", (void **)&wgpu.begin_compute_pass) ||
        look_up(lib, "wgpuComputePassEncoderSetPipeline", (void **)&wgpu.set_pipeline) ||
        look_up(lib, "wgpuComputePassEncoderSetBindGroup", (void **)&wgpu.set_bind_group) ||
        look_up(lib, "wgpuComputePassEncoderDispatchWorkgroups", (void **)&wgpu.dispatch) ||
        look_up(lib, "wgpuComputePassEncoderEnd", (void **)&wgpu.end_pass) ||
        look_up(lib, "wgpuComputePassEncoderRelease", (void **)&wgpu.release_pass) ||
        look_up(lib, "wgpuCommandEncoderCopyBufferToBuffer", (void **)&wgpu.copy) ||
        look_up(lib, "wgpuCommandEncoderFinish", (void **)&wgpu.finish) ||
        look_up(lib, "wgpuCommandEncoderRelease", (void **)&wgpu.release_encoder) ||
        look_up(lib, "wgpuQueueSubmit", (void **)&wgpu.submit) ||
        look_up(lib, "wgpuCommandBufferRelease", (void **)&wgpu.release_command_buffer) ||
        look_up(lib, "wgpuQueueWriteBuffer", (void **)&wgpu.write_buffer)) {
        dlclose(lib);
        return NULL;
    }
    /* the handle stays open: wgpu-py keeps the library loaded for the process */
    wgpu.bound = 1;
    Py_RETURN_NONE;
}

static Handle as_handle(uint64_t word) { return (Handle)(uintptr_t)word; }

/* Record the program into a new command encoder; returns the finished command
 * buffer (NULL when wgpu-native gave none). Runs without the GIL. */
static Handle record(Handle device, const uint64_t *program, Py_ssize_t n_ops, Handle query_set) {
    Handle encoder = wgpu.create_command_encoder(device, NULL);
    if (encoder == NULL)
        return NULL;
    Handle pass = NULL;
    uint32_t n_timed = 0;
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        const uint64_t *op = program + i * OP_WORDS;
        if (op[0] == OP_DISPATCH) {
            if (query_set != NULL) {
                PassTimestampWrites writes = {NULL, query_set, 2 * n_timed, 2 * n_timed + 1};
                ComputePassDescriptor desc = {NULL, {NULL, 0}, &writes};
                pass = wgpu.begin_compute_pass(encoder, &desc);
                n_timed++;
            } else if (pass == NULL) {
                pass = wgpu.begin_compute_pass(encoder, NULL);
            }
            wgpu.set_pipeline(pass, as_handle(op[1]));
            wgpu.set_bind_group(pass, 0, as_handle(op[2]), 0, NULL);
            wgpu.dispatch(pass, (uint32_t)op[3], (uint32_t)op[4], (uint32_t)op[5]);
            if (query_set != NULL) {
                wgpu.end_pass(pass);
                wgpu.release_pass(pass);
                pass = NULL;
            }
        } else { /* OP_COPY (checked by the caller) */
            if (pass != NULL) {
                wgpu.end_pass(pass);
                wgpu.release_pass(pass);
                pass = NULL;
            }
            wgpu.copy(encoder, as_handle(op[1]), op[2], as_handle(op[3]), op[4], op[5]);
        }
    }
    if (pass != NULL) {
        wgpu.end_pass(pass);
        wgpu.release_pass(pass);
    }
    Handle commands = wgpu.finish(encoder, NULL);
    wgpu.release_encoder(encoder);
    return commands;
}

/* record(device, queue, writes, program, query_set) -> int
 *
 * writes: a list of (buffer, offset, data) with data any C-contiguous buffer;
 * program: a C-contiguous buffer of uint64 words, OP_WORDS per command; query_set:
 * a handle or 0. Writes the uploads and records the program into a command buffer,
 * whose handle it returns: the caller submits it (submit) or hands it to wgpu-py's
 * GPUCommandBuffer, once it knows wgpu-native reported no error (wgpu-native's
 * submit aborts the process on an invalid command buffer). */
static PyObject *record_batch(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long device, queue, query_set;
    PyObject *writes;
    Py_buffer program;
    if (!wgpu.bound) {
        PyErr_SetString(PyExc_RuntimeError, "attnserve.gpu._commands: bind() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "KKO!y*K", &device, &queue, &PyList_Type, &writes, &program, &query_set))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n_writes = PyList_GET_SIZE(writes);
    Py_buffer *data = PyMem_Calloc(n_writes ? n_writes : 1, sizeof(Py_buffer));
    uint64_t *targets = PyMem_Calloc(n_writes ? 2 * n_writes : 1, sizeof(uint64_t));
    Py_ssize_t n_held = 0;
    const uint64_t *words = program.buf;
    Py_ssize_t n_ops = program.len / (OP_WORDS * (Py_ssize_t)sizeof(uint64_t));
    Handle commands;
    if (data == NULL || targets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (program.len % (OP_WORDS * sizeof(uint64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "the program is not whole commands");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        if (words[i * OP_WORDS] != OP_DISPATCH && words[i * OP_WORDS] != OP_COPY) {
            PyErr_Format(PyExc_ValueError, "command %zd has no opcode", i);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n_writes; i++) {
        PyObject *item = PyList_GET_ITEM(writes, i);
        unsigned long long buffer, offset;
        PyObject *obj;
        if (!PyArg_ParseTuple(item, "KKO", &buffer, &offset, &obj))
            goto done;
        if (PyObject_GetBuffer(obj, &data[i], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        n_held++;
        targets[2 * i] = buffer;
        targets[2 * i + 1] = offset;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n_writes; i++) {
        if (data[i].len > 0)
            wgpu.write_buffer(as_handle(queue), as_handle(targets[2 * i]), targets[2 * i + 1], data[i].buf,
                              (size_t)data[i].len);
    }
    commands = record(as_handle(device), words, n_ops, as_handle(query_set));
    Py_END_ALLOW_THREADS
    if (commands == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "wgpu-native recorded no command buffer");
        goto done;
    }
    result = PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)commands);
done:
    for (Py_ssize_t i = 0; i < n_held; i++)
        PyBuffer_Release(&data[i]);
    PyMem_Free(data);
    PyMem_Free(targets);
    PyBuffer_Release(&program);
    return result;
}

/* submit(queue, commands): submit a recorded command buffer and release it. */
static PyObject *submit(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long queue, commands;
    if (!wgpu.bound) {
        PyErr_SetString(PyExc_RuntimeError, "attnserve.gpu._commands: bind() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "KK", &queue, &commands))
        return NULL;
    Handle buffer = as_handle(commands);
    Py_BEGIN_ALLOW_THREADS
    wgpu.submit(as_handle(queue), 1, &buffer);
    wgpu.release_command_buffer(buffer);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* release(commands): release a recorded command buffer that will not be submitted. */
static PyObject *release(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long commands;
    if (!wgpu.bound) {
        PyErr_SetString(PyExc_RuntimeError, "attnserve.gpu._commands: bind() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "K", &commands))
        return NULL;
    wgpu.release_command_buffer(as_handle(commands));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(path): look the wgpu-native functions up in the library loaded from path"},
    {"record", record_batch, METH_VARARGS,
     "record(device, queue, writes, program, query_set) -> int: write a batch's uploads, record its commands"},
    {"submit", submit, METH_VARARGS, "submit(queue, commands): submit a recorded command buffer and release it"},
    {"release", release, METH_VARARGS, "release(commands): release a recorded command buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_commands",
    "A batch's GPU commands recorded and submitted in one call (attnserve/gpu/native.py drives it).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__commands(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0 ||
        PyModule_AddIntConstant(m, "OP_DISPATCH", OP_DISPATCH) < 0 || PyModule_AddIntConstant(m, "OP_COPY", OP_COPY) < 0 ||
        PyModule_AddIntConstant(m, "OP_WORDS", OP_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
