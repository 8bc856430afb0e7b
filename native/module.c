/* The Python extension ringreduce._native: the node's allreduce (node.c) as Python functions,
 * since the small one runs on every small synchronous call and a ctypes call costs a
 * microsecond; the kernels in kernels.c are loaded by ringreduce/kernels.py with ctypes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "node.h"

#define MAX_DIMS 64

static int check_args(Py_ssize_t nargs, Py_ssize_t expected, const char *name) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* node_attach(me, bases, slot_bytes, block_bytes): bases is every local rank's segment
 * address; the sizes are those of a small slot and of a block (NodeShm's). */
static PyObject *node_attach(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 4, "node_attach")) return NULL;
    int me = PyLong_AsLong(args[0]);
    PyObject *bases = PySequence_Fast(args[1], "bases must be a sequence");
    size_t slot_bytes = PyLong_AsSize_t(args[2]), block_bytes = PyLong_AsSize_t(args[3]);
    if (bases == NULL || PyErr_Occurred()) {
        Py_XDECREF(bases);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(bases);
    uintptr_t *addresses = PyMem_Malloc(sizeof(uintptr_t) * (size_t)(n ? n : 1));
    for (Py_ssize_t r = 0; addresses != NULL && r < n; r++)
        addresses[r] = (uintptr_t)PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(bases, r));
    int failed = addresses == NULL || PyErr_Occurred() ||
                 rr_node_attach(me, (int)n, addresses, slot_bytes, block_bytes) != 0;
    PyMem_Free(addresses);
    Py_DECREF(bases);
    if (failed) return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *node_detach(PyObject *self, PyObject *unused) {
    rr_node_detach();
    Py_RETURN_NONE;
}

static PyObject *node_ready(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(rr_node_ready());
}

/* small_begin(src_address, nbytes, digest, spin_seconds) -> True when every flag is up. */
static PyObject *small_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 4, "small_begin")) return NULL;
    void *src = PyLong_AsVoidPtr(args[0]);
    size_t nbytes = PyLong_AsSize_t(args[1]);
    int64_t digest = PyLong_AsLongLong(args[2]);
    double spin = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    int ready;
    Py_BEGIN_ALLOW_THREADS
    ready = rr_small_begin(src, nbytes, digest, spin);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

/* small_end(dst_address, count, kind, divisor, scale) -> 0, or -1 when digests differ. */
static PyObject *small_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "small_end")) return NULL;
    void *dst = PyLong_AsVoidPtr(args[0]);
    size_t count = PyLong_AsSize_t(args[1]);
    int kind = PyLong_AsLong(args[2]);
    double divisor = PyFloat_AsDouble(args[3]), scale = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_small_end(dst, count, kind, divisor, scale);
    Py_END_ALLOW_THREADS
    if (status == -2) return PyErr_Format(PyExc_ValueError, "small_end: unknown kind %d", kind);
    return PyLong_FromLong(status);
}

/* large_begin(src_address, dst_address, count, kind, divisor, scale, digest, between_nodes) */
static PyObject *large_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 8, "large_begin")) return NULL;
    const void *src = PyLong_AsVoidPtr(args[0]);
    void *dst = PyLong_AsVoidPtr(args[1]);
    size_t count = PyLong_AsSize_t(args[2]);
    int kind = PyLong_AsLong(args[3]);
    double divisor = PyFloat_AsDouble(args[4]), scale = PyFloat_AsDouble(args[5]);
    int64_t digest = PyLong_AsLongLong(args[6]);
    int between_nodes = PyObject_IsTrue(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (rr_large_begin(src, dst, count, kind, divisor, scale, digest, between_nodes) != 0)
        return PyErr_Format(PyExc_ValueError, "large_begin: unknown kind %d", kind);
    Py_RETURN_NONE;
}

/* large_run(spin_seconds) -> 1 done, 0 waiting for peers (wait, then call again), 2 our
 * chunk is reduced on this node (run the ring between nodes on it, then call again), -1 when
 * the digests differ. */
static PyObject *large_run(PyObject *self, PyObject *spin) {
    double seconds = PyFloat_AsDouble(spin);
    if (PyErr_Occurred()) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_large_run(seconds);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* large_chunk() -> (first element, count) of our chunk of the current block */
static PyObject *large_chunk(PyObject *self, PyObject *unused) {
    size_t first, count;
    rr_large_chunk(&first, &count);
    return Py_BuildValue("nn", (Py_ssize_t)first, (Py_ssize_t)count);
}

static int utf8(PyObject *text, const char **data, Py_ssize_t *size) {
    *data = PyUnicode_AsUTF8AndSize(text, size);
    return *data == NULL ? -1 : 0;
}

/* allreduce_digest(name, op, dtype, shape, prescale, postscale) -> int64 */
static PyObject *allreduce_digest(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 6, "allreduce_digest")) return NULL;
    const char *name, *op, *dtype;
    Py_ssize_t name_len, op_len, dtype_len;
    if (utf8(args[0], &name, &name_len) || utf8(args[1], &op, &op_len) ||
        utf8(args[2], &dtype, &dtype_len))
        return NULL;
    if (!PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) > MAX_DIMS)
        return PyErr_Format(PyExc_TypeError, "allreduce_digest: shape must be a short tuple");
    int64_t shape[MAX_DIMS];
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[3]);
    for (Py_ssize_t i = 0; i < ndim; i++)
        shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[3], i));
    double prescale = PyFloat_AsDouble(args[4]), postscale = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong(rr_allreduce_digest(name, (size_t)name_len, op, (size_t)op_len,
                                                   dtype, (size_t)dtype_len, shape,
                                                   (size_t)ndim, prescale, postscale));
}

static PyMethodDef methods[] = {
    {"node_attach", (PyCFunction)(void (*)(void))node_attach, METH_FASTCALL,
     "Point the small allreduce at the node's shared segments."},
    {"node_detach", node_detach, METH_NOARGS, "Forget the segments (before they are freed)."},
    {"node_ready", node_ready, METH_NOARGS, "Whether every local rank has raised our flag."},
    {"small_begin", (PyCFunction)(void (*)(void))small_begin, METH_FASTCALL,
     "Publish data and header, raise the flag, spin a while for the peers."},
    {"small_end", (PyCFunction)(void (*)(void))small_end, METH_FASTCALL,
     "Check the digests and reduce every slot in rank order."},
    {"large_begin", (PyCFunction)(void (*)(void))large_begin, METH_FASTCALL,
     "Set up a block-by-block allreduce of a large buffer."},
    {"large_run", large_run, METH_O, "Run it until done, a mismatch, or a long wait."},
    {"large_chunk", large_chunk, METH_NOARGS, "Where our chunk of the current block lies."},
    {"allreduce_digest", (PyCFunction)(void (*)(void))allreduce_digest, METH_FASTCALL,
     "64-bit digest of an allreduce's signature fields."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "ringreduce native code (kernels through ctypes)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
