/* The Python extension ringreduce._native: the node's allreduce (node.c), the reduction
 * kernels (kernels.c) and MPI exchanges between nodes (p2p.c) as Python functions that take
 * addresses and release the GIL, and the shared constants (constants.h). A small synchronous
 * allreduce calls into it a few times, where ctypes would cost a microsecond a call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <string.h>

#include "constants.h"
#include "kernels.h"
#include "node.h"
#include "p2p.h"
#include "status.h"

#define MAX_DIMS 64
#define NODE "ringreduce.node"
#define DETACHED "ringreduce.node (detached)"
#define PENDING (-1)    /* what mpi_test and doubling return for RR_PENDING */

/* The one place a failed rr_status becomes a Python exception: ValueError for what the
 * caller passed (dtype, op, sizes), MemoryError, else RuntimeError (MPI's failures with MPI's
 * own text, calls out of order), each naming the _native function and what failed. Returns
 * NULL for the wrapper to return. */
static PyObject *raise_status(rr_status status, const char *call) {
    PyObject *type;
    switch (status) {
    case RR_BAD_DTYPE: case RR_BAD_OP: case RR_BAD_ARGUMENT: type = PyExc_ValueError; break;
    case RR_NO_MEMORY: type = PyExc_MemoryError; break;
    case RR_BAD_STATE: case RR_MPI_ERROR: type = PyExc_RuntimeError; break;
    default:
        return PyErr_Format(PyExc_SystemError, "ringreduce: %s: status %d is no failure", call,
                            (int)status);
    }
    return PyErr_Format(type, "ringreduce: %s: %s", call, rr_error());
}

static int check_args(Py_ssize_t nargs, Py_ssize_t expected, const char *name) {
    if (nargs == expected) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, expected, nargs);
    return -1;
}

/* The rr_node behind a capsule from node_attach (NULL, with an exception, once detached). */
static rr_node *node_of(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, NODE);
}

static void node_capsule_free(PyObject *capsule) {
    if (strcmp(PyCapsule_GetName(capsule), NODE) == 0) rr_node_detach(node_of(capsule));
}

/* node_layout(small_bytes, block_bytes) -> (slot_bytes, block_bytes, segment_bytes) */
static PyObject *node_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 2, "node_layout")) return NULL;
    size_t small = PyLong_AsSize_t(args[0]), block = PyLong_AsSize_t(args[1]), slot, rounded;
    if (PyErr_Occurred()) return NULL;
    size_t segment = rr_node_layout(small, block, &slot, &rounded);
    return Py_BuildValue("nnn", (Py_ssize_t)slot, (Py_ssize_t)rounded, (Py_ssize_t)segment);
}

/* node_attach(me, bases, slot_bytes, block_bytes) -> a capsule for the other calls; bases is
 * every local rank's segment address. Zeroes our flag. */
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
    rr_node *node = NULL;
    rr_status status = RR_OK;
    if (addresses != NULL && !PyErr_Occurred())
        status = rr_node_attach(me, (int)n, addresses, slot_bytes, block_bytes, &node);
    PyMem_Free(addresses);
    Py_DECREF(bases);
    if (addresses == NULL) return PyErr_NoMemory();
    if (PyErr_Occurred()) return NULL;
    if (RR_FAILED(status)) return raise_status(status, "node_attach");
    PyObject *capsule = PyCapsule_New(node, NODE, node_capsule_free);
    if (capsule == NULL) rr_node_detach(node);
    return capsule;
}

/* node_detach(node): forget the segments (before the window is freed). */
static PyObject *node_detach(PyObject *self, PyObject *capsule) {
    rr_node *node = node_of(capsule);
    if (node == NULL) return NULL;
    rr_node_detach(node);
    PyCapsule_SetName(capsule, DETACHED);
    Py_RETURN_NONE;
}

static PyObject *node_ready(PyObject *self, PyObject *capsule) {
    rr_node *node = node_of(capsule);
    return node == NULL ? NULL : PyBool_FromLong(rr_node_ready(node));
}

/* node_wait(node, spin_seconds) -> True when every flag is up (polled for up to the spin). */
static PyObject *node_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 2, "node_wait")) return NULL;
    rr_node *node = node_of(args[0]);
    double spin = PyFloat_AsDouble(args[1]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_node_wait(node, spin);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == RR_OK);
}

/* headers_begin(node, digest, per_rank, spin_seconds) -> True when every flag is up. */
static PyObject *headers_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 4, "headers_begin")) return NULL;
    rr_node *node = node_of(args[0]);
    int64_t digest = PyLong_AsLongLong(args[1]), per_rank = PyLong_AsLongLong(args[2]);
    double spin = PyFloat_AsDouble(args[3]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_headers_begin(node, digest, per_rank, spin);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == RR_OK);
}

/* headers_read(node, digests_address, per_rank_address, stride) -> whether the digests
 * agree; rank r's words go `stride` int64s apart. */
static PyObject *headers_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 4, "headers_read")) return NULL;
    rr_node *node = node_of(args[0]);
    int64_t *digests = PyLong_AsVoidPtr(args[1]), *per_rank = PyLong_AsVoidPtr(args[2]);
    size_t stride = PyLong_AsSize_t(args[3]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    return PyBool_FromLong(rr_headers_read(node, digests, per_rank, stride) == RR_OK);
}

/* small_begin(node, src_address, nbytes, digest, spin_seconds) -> True when every flag is up
 * (a negative spin: published, the flags looked at once) */
static PyObject *small_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "small_begin")) return NULL;
    rr_node *node = node_of(args[0]);
    void *src = PyLong_AsVoidPtr(args[1]);
    size_t nbytes = PyLong_AsSize_t(args[2]);
    int64_t digest = PyLong_AsLongLong(args[3]);
    double spin = PyFloat_AsDouble(args[4]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_small_begin(node, src, nbytes, digest, spin);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(status == RR_OK);
}

/* small_end(node, dst_address, count, dtype, op, divisor, scale) -> 0, or -1 when the
 * digests differ (dst untouched); ValueError for an unknown dtype or op (dst untouched). */
static PyObject *small_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "small_end")) return NULL;
    rr_node *node = node_of(args[0]);
    void *dst = PyLong_AsVoidPtr(args[1]);
    size_t count = PyLong_AsSize_t(args[2]);
    int dtype = PyLong_AsLong(args[3]), op = PyLong_AsLong(args[4]);
    double divisor = PyFloat_AsDouble(args[5]), scale = PyFloat_AsDouble(args[6]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_small_end(node, dst, count, dtype, op, divisor, scale);
    Py_END_ALLOW_THREADS
    if (RR_FAILED(status)) return raise_status(status, "small_end");
    return PyLong_FromLong(status == RR_MISMATCH ? -1 : 0);
}

/* small_now(node, spin_seconds, address, nbytes, count, dtype, op, divisor, scale, digest)
 * -> True, False or None: small_begin in place, and where every flag came up within the
 * spin, small_end too, in one call (an asynchronous small allreduce on the caller's thread):
 * True done, False when the digests differ (nothing written), None when published and the
 * peers are still to come (node_wait, then small_end, finish it). */
static PyObject *small_now(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 10, "small_now")) return NULL;
    rr_node *node = node_of(args[0]);
    double spin = PyFloat_AsDouble(args[1]);
    void *address = PyLong_AsVoidPtr(args[2]);
    size_t nbytes = PyLong_AsSize_t(args[3]), count = PyLong_AsSize_t(args[4]);
    int dtype = PyLong_AsLong(args[5]), op = PyLong_AsLong(args[6]);
    double divisor = PyFloat_AsDouble(args[7]), scale = PyFloat_AsDouble(args[8]);
    int64_t digest = PyLong_AsLongLong(args[9]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_small_begin(node, address, nbytes, digest, spin);
    if (status == RR_OK) status = rr_small_end(node, address, count, dtype, op, divisor, scale);
    Py_END_ALLOW_THREADS
    if (status == RR_WAITING) Py_RETURN_NONE;
    if (RR_FAILED(status)) return raise_status(status, "small_now");
    return PyBool_FromLong(status != RR_MISMATCH);
}

/* large_begin(node, src, dst, count, dtype, op, divisor, scale, digest, between_nodes);
 * ValueError for an unknown dtype or op, before anything is published. */
static PyObject *large_begin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 10, "large_begin")) return NULL;
    rr_node *node = node_of(args[0]);
    const void *src = PyLong_AsVoidPtr(args[1]);
    void *dst = PyLong_AsVoidPtr(args[2]);
    size_t count = PyLong_AsSize_t(args[3]);
    int dtype = PyLong_AsLong(args[4]), op = PyLong_AsLong(args[5]);
    double divisor = PyFloat_AsDouble(args[6]), scale = PyFloat_AsDouble(args[7]);
    int64_t digest = PyLong_AsLongLong(args[8]);
    int between_nodes = PyObject_IsTrue(args[9]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status = rr_large_begin(node, src, dst, count, dtype, op, divisor, scale, digest,
                                      between_nodes);
    if (RR_FAILED(status)) return raise_status(status, "large_begin");
    Py_RETURN_NONE;
}

/* large_run(node, spin_seconds) -> its outcome, by name: LARGE_DONE, LARGE_WAITING for peers
 * (wait, then call again), LARGE_BETWEEN_NODES: our chunk is reduced on this node (run the ring
 * between nodes on it, then call again), LARGE_MISMATCH when the digests differ; an exception
 * when its kernel fails or no begin succeeded. */
static PyObject *large_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 2, "large_run")) return NULL;
    rr_node *node = node_of(args[0]);
    double seconds = PyFloat_AsDouble(args[1]);
    if (node == NULL || PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_large_run(node, seconds);
    Py_END_ALLOW_THREADS
    if (RR_FAILED(status) || status == RR_PENDING) return raise_status(status, "large_run");
    return PyLong_FromLong(status);
}

/* large_chunk(node) -> (first element, count) of our chunk of the current block */
static PyObject *large_chunk(PyObject *self, PyObject *capsule) {
    rr_node *node = node_of(capsule);
    if (node == NULL) return NULL;
    size_t first, count;
    rr_large_chunk(node, &first, &count);
    return Py_BuildValue("nn", (Py_ssize_t)first, (Py_ssize_t)count);
}

/* large_profile(node, reset) -> (seconds in each phase (RR_PHASE_* order) of the large
 * allreduces so far, blocks written each RR_WRITE_* way); `reset` starts the sums again. */
static PyObject *large_profile(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 2, "large_profile")) return NULL;
    rr_node *node = node_of(args[0]);
    int reset = PyObject_IsTrue(args[1]);
    if (node == NULL || reset < 0) return NULL;
    double seconds[RR_PHASES];
    int64_t blocks[RR_WRITE_WAYS];
    rr_large_profile(node, seconds, blocks, reset);
    PyObject *phases = PyTuple_New(RR_PHASES);
    if (phases == NULL) return NULL;
    for (int p = 0; p < RR_PHASES; p++) {
        PyObject *value = PyFloat_FromDouble(seconds[p]);
        if (value == NULL) {
            Py_DECREF(phases);
            return NULL;
        }
        PyTuple_SET_ITEM(phases, p, value);
    }
    return Py_BuildValue("N(LL)", phases, (long long)blocks[RR_WRITE_PLAIN],
                         (long long)blocks[RR_WRITE_STREAM]);
}

/* copy_stream(dst, src, nbytes): memcpy with non-temporal stores for large copies. */
static PyObject *copy_stream(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "copy_stream")) return NULL;
    void *dst = PyLong_AsVoidPtr(args[0]);
    const void *src = PyLong_AsVoidPtr(args[1]);
    size_t nbytes = PyLong_AsSize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rr_copy_stream(dst, src, nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* mpi_bind(path, request_size, status_size, byte): find the MPI functions through mpi4py's
 * extension at `path` (loaded already), with the sizes of MPI_Request and MPI_Status and the
 * handle of MPI_BYTE as mpi4py reports them. */
static PyObject *mpi_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 4, "mpi_bind")) return NULL;
    const char *path = PyUnicode_AsUTF8(args[0]);
    size_t request_size = PyLong_AsSize_t(args[1]), status_size = PyLong_AsSize_t(args[2]);
    intptr_t byte = (intptr_t)PyLong_AsUnsignedLongLongMask(args[3]);
    if (path == NULL || PyErr_Occurred()) return NULL;
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (library == NULL)
        return raise_status(rr_fail(RR_MPI_ERROR, "cannot open %s: %s", path, dlerror()),
                            "mpi_bind");
    rr_status status = rr_mpi_bind(library, request_size, status_size, byte);
    if (RR_FAILED(status)) return raise_status(status, "mpi_bind");
    Py_RETURN_NONE;     /* the handle stays open: mpi4py keeps the library loaded anyway */
}

/* An exchange's outcome: the bytes received, PENDING, or the exception. */
static PyObject *exchange_result(rr_status status, const rr_exchange *x, const char *call) {
    if (status == RR_OK) return PyLong_FromLong(x->received);
    if (status == RR_PENDING) return PyLong_FromLong(PENDING);
    return raise_status(status, call);
}

/* mpi_test(state) -> bytes received, or -1 while pending. */
static PyObject *mpi_test(PyObject *self, PyObject *state) {
    rr_exchange *x = PyLong_AsVoidPtr(state);
    if (PyErr_Occurred()) return NULL;
    return exchange_result(rr_mpi_test(x), x, "mpi_test");
}

/* doubling(state, comm, tag, rounds, nrounds, resume, nbytes, count, dtype, op, src, dst,
 *          divisor, scale, data, incoming, capacity, gathered, members, spin_seconds)
 * -> 1 (complete, digests agree, dst written), 0, or -1 while pending; nbytes < 0: headers
 * only; spin_seconds < 0: post the first round and return (resume with dst). ValueError for
 * an unknown dtype or op or inconsistent sizes (before anything is sent). */
static PyObject *doubling(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 20, "doubling")) return NULL;
    rr_exchange *x = PyLong_AsVoidPtr(args[0]);
    intptr_t comm = (intptr_t)PyLong_AsUnsignedLongLongMask(args[1]);
    int tag = PyLong_AsLong(args[2]);
    const rr_round *rounds = PyLong_AsVoidPtr(args[3]);
    int nrounds = PyLong_AsLong(args[4]);
    int resume = PyObject_IsTrue(args[5]);
    rr_reduction reduction = {
        PyLong_AsLongLong(args[6]), PyLong_AsLongLong(args[7]), PyLong_AsLongLong(args[8]),
        PyLong_AsLongLong(args[9]), (int64_t)(intptr_t)PyLong_AsVoidPtr(args[10]),
        (int64_t)(intptr_t)PyLong_AsVoidPtr(args[11]), PyFloat_AsDouble(args[12]),
        PyFloat_AsDouble(args[13]), (int64_t)(intptr_t)PyLong_AsVoidPtr(args[14])};
    void *incoming = PyLong_AsVoidPtr(args[15]);
    int capacity = PyLong_AsLong(args[16]);
    const int64_t *gathered = PyLong_AsVoidPtr(args[17]);
    int members = PyLong_AsLong(args[18]);
    double spin_seconds = PyFloat_AsDouble(args[19]);
    if (PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_doubling(x, resume, comm, tag, rounds, nrounds,
                         reduction.nbytes >= 0 ? &reduction : NULL, incoming, capacity,
                         gathered, members, spin_seconds);
    Py_END_ALLOW_THREADS
    switch (status) {
    case RR_OK: return PyLong_FromLong(1);
    case RR_MISMATCH: return PyLong_FromLong(0);
    case RR_PENDING: return PyLong_FromLong(PENDING);
    default: return raise_status(status, "doubling");
    }
}

/* combine(dtype, op, a, b, out, count, last, divisor, scale): out = a op b (addresses). */
static PyObject *combine(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 9, "combine")) return NULL;
    int dtype = PyLong_AsLong(args[0]), op = PyLong_AsLong(args[1]);
    const void *a = PyLong_AsVoidPtr(args[2]), *b = PyLong_AsVoidPtr(args[3]);
    void *out = PyLong_AsVoidPtr(args[4]);
    size_t count = PyLong_AsSize_t(args[5]);
    int last = PyObject_IsTrue(args[6]);
    double divisor = PyFloat_AsDouble(args[7]), scale = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_combine(dtype, op, a, b, out, count, last, divisor, scale);
    Py_END_ALLOW_THREADS
    if (RR_FAILED(status)) return raise_status(status, "combine");
    Py_RETURN_NONE;
}

/* address(buffer): where a contiguous buffer (a NumPy array, say) begins. NumPy's own
 * `.ctypes.data` makes a ctypes object each time, about 2 us, and the kernels take addresses
 * once a call (or a ring segment). */
static PyObject *address(PyObject *self, PyObject *buffer) {
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_ANY_CONTIGUOUS) != 0) return NULL;
    PyObject *result = PyLong_FromVoidPtr(view.buf);
    PyBuffer_Release(&view);
    return result;
}

/* finish(dtype, x, count, divisor, scale): x = x * (scale / divisor), in place (rr_finish). */
static PyObject *finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "finish")) return NULL;
    int dtype = PyLong_AsLong(args[0]);
    void *x = PyLong_AsVoidPtr(args[1]);
    size_t count = PyLong_AsSize_t(args[2]);
    double divisor = PyFloat_AsDouble(args[3]), scale = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    rr_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rr_finish(dtype, x, count, divisor, scale);
    Py_END_ALLOW_THREADS
    if (RR_FAILED(status)) return raise_status(status, "finish");
    Py_RETURN_NONE;
}

/* cast(source_dtype, target_dtype, src, dst, count): float32 <-> bfloat16 / float16. */
static PyObject *cast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "cast")) return NULL;
    int from = PyLong_AsLong(args[0]), to = PyLong_AsLong(args[1]);
    const void *src = PyLong_AsVoidPtr(args[2]);
    void *dst = PyLong_AsVoidPtr(args[3]);
    size_t count = PyLong_AsSize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    void (*convert)(const void *, void *, size_t) = NULL;
    if (from == RR_F32 && to == RR_BF16) convert = (void (*)(const void *, void *, size_t))rr_f32_to_bf16;
    if (from == RR_BF16 && to == RR_F32) convert = (void (*)(const void *, void *, size_t))rr_bf16_to_f32;
    if (from == RR_F32 && to == RR_F16) convert = (void (*)(const void *, void *, size_t))rr_f32_to_f16;
    if (from == RR_F16 && to == RR_F32) convert = (void (*)(const void *, void *, size_t))rr_f16_to_f32;
    if (convert == NULL)
        return raise_status(rr_fail(RR_BAD_DTYPE, "no cast from dtype code %d to %d", from, to),
                            "cast");
    Py_BEGIN_ALLOW_THREADS
    convert(src, dst, count);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
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

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    FAST(node_layout, "Sizes of a slot, a block and one rank's segment."),
    FAST(node_attach, "Point the node's allreduce at the set's shared segments."),
    {"node_detach", node_detach, METH_O, "Forget the segments (before they are freed)."},
    {"node_ready", node_ready, METH_O, "Whether every local rank has raised our flag."},
    FAST(node_wait, "Spin a while until every local rank has raised our flag."),
    FAST(headers_begin, "Publish a signature digest, raise the flag, spin a while."),
    FAST(headers_read, "Every rank's digest and per-rank word of the last exchange."),
    FAST(small_begin, "Publish data and header, raise the flag, spin a while for the peers."),
    FAST(small_end, "Check the digests and reduce every slot in rank order."),
    FAST(small_now, "small_begin in place, then small_end if every flag came up."),
    FAST(large_begin, "Set up a block-by-block allreduce of a large buffer."),
    FAST(large_run, "Run it until done, a mismatch, or a long wait."),
    {"large_chunk", large_chunk, METH_O, "Where our chunk of the current block lies."},
    FAST(large_profile, "Seconds in each phase of the large allreduces so far."),
    FAST(copy_stream, "memcpy with non-temporal stores for large copies."),
    FAST(mpi_bind, "Find the MPI functions of the library mpi4py loaded."),
    FAST(doubling, "Recursive doubling between nodes: headers, and data reduced in place."),
    {"mpi_test", mpi_test, METH_O, "Poll a pending exchange once."},
    {"address", address, METH_O, "Where a contiguous buffer begins."},
    FAST(combine, "out = a op b over count elements."),
    FAST(finish, "x = x * (scale / divisor), in place, as Horovod scales."),
    FAST(cast, "Convert between float32 and a 16-bit float type."),
    FAST(allreduce_digest, "64-bit digest of an allreduce's signature fields."),
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "ringreduce native code: the node's allreduce, kernels, MPI exchanges, "
                                    "and the constants shared with CUDA and Python", -1,
                                    methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    struct { const char *name; long value; } constants[] = {
        {"OP_AVERAGE", RR_OP_AVERAGE}, {"OP_SUM", RR_OP_SUM}, {"OP_ADASUM", RR_OP_ADASUM},
        {"OP_MIN", RR_OP_MIN}, {"OP_MAX", RR_OP_MAX}, {"OP_PRODUCT", RR_OP_PRODUCT},
        {"U8", RR_U8}, {"I8", RR_I8}, {"I16", RR_I16}, {"I32", RR_I32}, {"I64", RR_I64},
        {"F16", RR_F16}, {"BF16", RR_BF16}, {"F32", RR_F32}, {"F64", RR_F64},
        {"LINE", RR_LINE}, {"PAGE", RR_PAGE}, {"HEADER_WORDS", RR_HEADER_WORDS},
        {"STREAM_MIN", RR_STREAM_MIN}, {"PHASES", RR_PHASES},
        {"EXCHANGE_BYTES", sizeof(rr_exchange)}, {"PENDING", PENDING},
        {"LARGE_DONE", RR_OK}, {"LARGE_WAITING", RR_WAITING},
        {"LARGE_BETWEEN_NODES", RR_BETWEEN_NODES}, {"LARGE_MISMATCH", RR_MISMATCH}};
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
