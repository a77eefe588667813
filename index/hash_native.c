/*
 * index.hash_native: the chained block-key loop of index/hashing.py, in C.
 *
 * ``chain(data, stride, seed, start, stop)`` returns the keys of blocks ``start..stop-1`` of ``data`` (a buffer of
 * ``stride``-byte blocks: the packed token ids, little-endian uint32, ``stride = 4 * block_size``), each hashed
 * with XXH3-64 seeded by the key before it (``seed`` for block ``start``): the same list as the Python form
 *
 *     [k := xxhash.xxh3_64_intdigest(data[i * stride:(i + 1) * stride], k) for i in range(start, stop)]
 *
 * What it saves is the interpreter's work per block: a slice object, a ``bytes`` copy of the block, a call and
 * the comprehension's step (a prompt of 8k tokens is 512 blocks; the router hashes every prompt it routes and the
 * tokens of every ``BlockStored`` it applies).
 *
 * The hash function is the one the ``xxhash`` package itself computes with: its extension module exports the
 * xxHash library's ``XXH3_64bits_withSeed`` (a stable public symbol since xxHash 0.8.0), found here with ``dlsym``
 * in the already loaded module, so no copy of xxHash is built into kvroute and the keys cannot differ from
 * ``xxhash.xxh3_64_intdigest``'s. When the symbol cannot be found the import fails and index/hashing.py uses its
 * Python form; index/hashing.py also checks this module against the Python form on known inputs at import.
 *
 * No I/O, no global state besides the function pointer; the GIL is held throughout (the buffer is read in place:
 * a caller must not resize a bytearray while it is hashed, which the GIL ensures).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

typedef uint64_t (*xxh3_seeded_fn)(const void *input, size_t length, uint64_t seed);

static xxh3_seeded_fn xxh3_seeded = NULL;

/* An index argument (block number) as a Py_ssize_t >= 0, or -1 with an exception. */
static Py_ssize_t block_index(PyObject *arg, const char *what) {
    Py_ssize_t v = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", what);
        return -1;
    }
    return v;
}

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "chain(data, stride, seed, start, stop) takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    Py_ssize_t stride = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    if (stride <= 0) {
        PyErr_Format(PyExc_ValueError, "stride must be positive, got %zd", stride);
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, got %.100s", Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    unsigned long long seed = PyLong_AsUnsignedLongLongMask(args[2]); /* modulo 2**64, as xxhash takes seeds */
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = block_index(args[3], "start");
    if (start < 0) return NULL;
    Py_ssize_t stop = block_index(args[4], "stop");
    if (stop < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t blocks = view.len / stride;
    if (stop > blocks) stop = blocks;
    Py_ssize_t n = stop > start ? stop - start : 0;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    /* only when there is a block to hash: then start < blocks, so start * stride < view.len (no overflow) */
    const char *p = n > 0 ? (const char *)view.buf + start * stride : NULL;
    uint64_t k = (uint64_t)seed;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        k = xxh3_seeded(p, (size_t)stride, k);
        PyObject *key = PyLong_FromUnsignedLongLong((unsigned long long)k);
        if (key == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, i, key);
    }
    PyBuffer_Release(&view);
    return out;
}

/* ``XXH3_64bits_withSeed`` from the loaded ``xxhash._xxhash`` module, or NULL with ImportError. */
static xxh3_seeded_fn find_xxh3(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL) return NULL;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL) return NULL;
    const char *path = PyUnicode_Check(file) ? PyUnicode_AsUTF8(file) : NULL;
    if (path == NULL) {
        Py_DECREF(file);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "xxhash._xxhash has no file path");
        return NULL;
    }
    void *handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* already loaded by the import: only a reference */
    if (handle == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot open %s: %s", path, dlerror());
        Py_DECREF(file);
        return NULL;
    }
    void *sym = dlsym(handle, "XXH3_64bits_withSeed");
    if (sym == NULL) {
        PyErr_Format(PyExc_ImportError, "%s exports no XXH3_64bits_withSeed", path);
        dlclose(handle);
        Py_DECREF(file);
        return NULL;
    }
    Py_DECREF(file); /* the handle stays open: the module is never unloaded */
    xxh3_seeded_fn fn;
    *(void **)(&fn) = sym;
    return fn;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL,
     "chain(data, stride, seed, start, stop) -> list: the chained XXH3-64 keys of blocks start..stop-1 of data\n"
     "(stride bytes each; stop past the last full block is the last full block), block start seeded by seed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hash_native", "The chained block-key loop of index/hashing.py, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_hash_native(void) {
    xxh3_seeded = find_xxh3();
    if (xxh3_seeded == NULL) return NULL;
    return PyModule_Create(&module);
}
