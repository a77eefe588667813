/*
 * index.id_map_native: the bulk operations of the index's block key -> node id map, in C.
 *
 * The map is ``shards``: a list of dicts (a power-of-two count), a key living in ``shards[key & (len - 1)]``
 * (index/nodes.py). The functions here run the per-key loops the index runs per KV event and per compaction
 * (claim ids for a run of new keys, look keys up, assign ids to moved keys, forget deleted keys) on the same dicts,
 * with the same results and the same exceptions as their Python forms in index/id_map.py, which are used when this
 * module is not built (tests/unit/test_id_map.py runs both on the same inputs). What they save is the interpreter's
 * work per key: the loop, the ``&``, the shard's subscript and the method call.
 *
 * No I/O, no global state; the GIL is held throughout (a dict operation may run a key's ``__eq__``: keys are ints).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The shard of ``key`` (borrowed), or NULL with TypeError (a key not an int, a shard not a dict). */
static PyObject *shard_of(PyObject *shards, Py_ssize_t mask, PyObject *key) {
    if (!PyLong_Check(key)) {
        PyErr_Format(PyExc_TypeError, "block keys are ints, got %.100s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    unsigned long long low = PyLong_AsUnsignedLongLongMask(key);
    if (low == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *shard = PyList_GET_ITEM(shards, (Py_ssize_t)(low & (unsigned long long)mask));
    if (!PyDict_CheckExact(shard)) {
        PyErr_SetString(PyExc_TypeError, "every shard must be a dict");
        return NULL;
    }
    return shard;
}

/* The call's shards, keys and shard mask (its first two arguments; ``nargs`` must be ``want``, ``usage`` names
 * them): ``shards`` a non-empty list whose length is a power of two, ``keys`` a list. 0, or -1 with an exception. */
static int head(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, PyObject **shards,
                PyObject **keys, Py_ssize_t *mask) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", usage, want, nargs);
        return -1;
    }
    *shards = args[0];
    *keys = args[1];
    if (!PyList_CheckExact(*shards) || !PyList_CheckExact(*keys)) {
        PyErr_SetString(PyExc_TypeError, "shards and keys must be lists");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(*shards);
    if (n <= 0 || (n & (n - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "the shard count must be a power of two, got %zd", n);
        return -1;
    }
    *mask = n - 1;
    return 0;
}

/* A position or node id argument (an int >= 0). 0, or -1 with an exception. */
static int position(PyObject *arg, const char *what, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(arg);
    if (*out == -1 && PyErr_Occurred()) return -1;
    if (*out < 0) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", what);
        return -1;
    }
    return 0;
}

static PyObject *claim_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *shards, *keys;
    Py_ssize_t mask, start, stop, nid;
    if (head(args, nargs, 5, "claim_run(shards, keys, start, stop, nid)", &shards, &keys, &mask) < 0 ||
        position(args[2], "start", &start) < 0 || position(args[3], "stop", &stop) < 0 ||
        position(args[4], "nid", &nid) < 0)
        return NULL;
    Py_ssize_t first = nid;
    /* the list may shrink under a key's __eq__ (ints: never); its length is read on every step all the same */
    for (Py_ssize_t j = start; j < stop && j < PyList_GET_SIZE(keys); j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        Py_INCREF(key);
        PyObject *shard = shard_of(shards, mask, key);
        if (shard == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyObject *value = PyLong_FromSsize_t(nid);
        if (value == NULL) {
            Py_DECREF(key);
            return NULL;
        }
        PyObject *got = PyDict_SetDefault(shard, key, value); /* borrowed */
        Py_DECREF(key);
        int claimed = got == value;
        Py_DECREF(value);
        if (got == NULL) return NULL;
        if (!claimed) break;
        nid++;
    }
    return PyLong_FromSsize_t(nid - first);
}

static PyObject *lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *shards, *keys;
    Py_ssize_t mask;
    if (head(args, nargs, 2, "lookup(shards, keys)", &shards, &keys, &mask) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        /* ``out`` is ours alone: the keys' list cannot change its length under an int's hash or __eq__ */
        PyObject *key = PyList_GET_ITEM(keys, j);
        PyObject *shard = shard_of(shards, mask, key);
        if (shard == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *value = PyDict_GetItemWithError(shard, key); /* borrowed */
        if (value == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(out);
                return NULL;
            }
            value = Py_None;
        }
        Py_INCREF(value);
        PyList_SET_ITEM(out, j, value);
    }
    return out;
}

static PyObject *assign_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *shards, *keys;
    Py_ssize_t mask, nid;
    if (head(args, nargs, 3, "assign_run(shards, keys, nid)", &shards, &keys, &mask) < 0 ||
        position(args[2], "nid", &nid) < 0)
        return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(keys); j++, nid++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        Py_INCREF(key);
        PyObject *shard = shard_of(shards, mask, key);
        PyObject *value = shard == NULL ? NULL : PyLong_FromSsize_t(nid);
        int rc = value == NULL ? -1 : PyDict_SetItem(shard, key, value);
        Py_XDECREF(value);
        Py_DECREF(key);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *forget(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *shards, *keys;
    Py_ssize_t mask;
    if (head(args, nargs, 2, "forget(shards, keys)", &shards, &keys, &mask) < 0) return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(keys); j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        Py_INCREF(key);
        PyObject *shard = shard_of(shards, mask, key);
        int rc = shard == NULL ? -1 : PyDict_DelItem(shard, key); /* KeyError when absent, as ``del`` */
        Py_DECREF(key);
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"claim_run", (PyCFunction)(void (*)(void))claim_run, METH_FASTCALL,
     "claim_run(shards, keys, start, stop, nid) -> int: map keys[start], keys[start + 1], ... (up to stop) to\n"
     "nid, nid + 1, ... while they are absent; how many were mapped (nid must be an id no key maps to)."},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "lookup(shards, keys) -> list: each key's node id, or None when it is absent."},
    {"assign_run", (PyCFunction)(void (*)(void))assign_run, METH_FASTCALL,
     "assign_run(shards, keys, nid) -> None: map keys[j] to nid + j, present or not."},
    {"forget", (PyCFunction)(void (*)(void))forget, METH_FASTCALL,
     "forget(shards, keys) -> None: remove every key (KeyError at the first absent one, as del)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "id_map_native",
    "The bulk operations of the index's block key -> node id map, in C (index/id_map.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_id_map_native(void) { return PyModule_Create(&module); }
