/*
 * index.key_table_native: KeyTable, the index's block key -> node id map as a compiled type (index/key_table.py
 * chooses it, or its Python twin PyKeyTable when this module is not built; tests/unit/test_key_table.py runs both on
 * the same operations and compares them with a dict).
 *
 * Units: keys are block keys, ints in [0, 2**64); values are node ids, ints in [0, 2**62); sizes are in bytes.
 *
 * Why: in 64 dicts every entry costs a dict slot plus a separate int object for its node id (~70 B a key), and a
 * dict insert touches three places of memory (index, entry, the id object). Here a key and its id are one 16-byte
 * slot of an open-addressing table: 23 to 46 B a key (the load between 0.7 and 0.35, ~32 B on average), one cache
 * line read by most lookups.
 *
 * Layout: 64 sub-tables (shards), so that a growth copies 1/64 of the entries and no insert pauses long. A key's
 * 64-bit mix h (murmur3's fmix64 finalizer, a bijection: keys 1, 2, 3 spread like random ones) chooses its shard
 * (h & 63) and its home slot in it ((h >> 6) & (capacity - 1)); collisions probe linearly. A shard is allocated at
 * its first key (8 slots) and doubles before its count would pass 0.7 of its capacity; it never shrinks (clear()
 * frees every shard). Deletion shifts the following entries of the cluster back (no tombstones): the probes stay as
 * short as the load makes them, however many deletions came before.
 *
 * No Python object is held (no GC support needed). No Python code runs while a shard is changed or read through a
 * pointer: argument conversions (__index__) happen before, and results that allocate GC-tracked objects (items())
 * are built from a copy of the entries.
 */
#include "table_args.h"

#define SHARD_BITS 6
#define NSHARDS (1 << SHARD_BITS)
#define FIRST_CAP 8
/* node ids are below this (values stored as id + 1 in an int64_t, 0 meaning an empty slot) */
#define ID_END ((int64_t)1 << 62)

typedef struct {
    uint64_t key;
    int64_t id1; /* node id + 1; 0: the slot is empty (so a fresh array is PyMem_Calloc's zeroes) */
} Slot;

typedef struct {
    Slot *slots; /* NULL while cap is 0 */
    size_t cap;  /* a power of two (or 0) */
    size_t count;
} Shard;

typedef struct {
    PyObject_HEAD
    Py_ssize_t len;
    Shard shards[NSHARDS];
} KeyTable;

static PyTypeObject KeyTableType;

static inline Shard *shard_of(KeyTable *t, uint64_t h) { return &t->shards[h & (NSHARDS - 1)]; }

static inline size_t home_of(const Shard *s, uint64_t h) { return (size_t)(h >> SHARD_BITS) & (s->cap - 1); }

/* The slot holding key in s (cap > 0), or the empty slot that ends its probe. */
static inline Slot *probe(const Shard *s, uint64_t key, uint64_t h) {
    size_t mask = s->cap - 1;
    for (size_t i = home_of(s, h);; i = (i + 1) & mask) {
        Slot *slot = &s->slots[i];
        if (slot->id1 == 0 || slot->key == key) return slot;
    }
}

/* The slot holding key, or NULL. */
static inline Slot *find(KeyTable *t, uint64_t key) {
    uint64_t h = mix64(key);
    Shard *s = shard_of(t, h);
    if (s->cap == 0) return NULL;
    Slot *slot = probe(s, key, h);
    return slot->id1 ? slot : NULL;
}

/* Double s (or give it its first slots). 0, or -1 with MemoryError (s unchanged). */
static int grow(Shard *s) {
    if (s->cap > ((size_t)PY_SSIZE_T_MAX / sizeof(Slot)) / 2) {
        PyErr_NoMemory();
        return -1;
    }
    Shard bigger = {NULL, s->cap ? s->cap * 2 : FIRST_CAP, s->count};
    bigger.slots = PyMem_Calloc(bigger.cap, sizeof(Slot));
    if (bigger.slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < s->cap; i++) {
        if (s->slots[i].id1) *probe(&bigger, s->slots[i].key, mix64(s->slots[i].key)) = s->slots[i];
    }
    PyMem_Free(s->slots);
    *s = bigger;
    return 0;
}

/* Map key to nid (0 <= nid < ID_END). 1 when the key was absent, 0 when present (its id replaced when replace,
 * else left), -1 with MemoryError (nothing changed). */
static int put(KeyTable *t, uint64_t key, int64_t nid, int replace) {
    uint64_t h = mix64(key);
    Shard *s = shard_of(t, h);
    Slot *slot = NULL;
    if (s->cap) {
        slot = probe(s, key, h);
        if (slot->id1) {
            if (replace) slot->id1 = nid + 1;
            return 0;
        }
    }
    /* grow when count + 1 > 0.7 * cap */
    if ((s->count + 1) * 10 > s->cap * 7) {
        if (grow(s) < 0) return -1;
        slot = probe(s, key, h);
    }
    slot->key = key;
    slot->id1 = nid + 1;
    s->count++;
    t->len++;
    return 1;
}

/* Empty the occupied slot at index i of s, shifting back the entries after it in its cluster: walking j = i + 1,
 * i + 2, ... (wrapping) while slot j is occupied, the entry at j moves into the hole i (which then moves to j) when
 * i lies cyclically in [home(j), j), i.e. when a probe from its home would otherwise stop at the hole before j. */
static void erase(KeyTable *t, Shard *s, size_t i) {
    size_t mask = s->cap - 1;
    for (size_t j = (i + 1) & mask; s->slots[j].id1; j = (j + 1) & mask) {
        size_t home = home_of(s, mix64(s->slots[j].key));
        if (((i - home) & mask) < ((j - home) & mask)) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i].key = 0;
    s->slots[i].id1 = 0;
    s->count--;
    t->len--;
}

/* Remove key: 1 when it was present, 0 when absent. */
static int discard(KeyTable *t, uint64_t key) {
    uint64_t h = mix64(key);
    Shard *s = shard_of(t, h);
    if (s->cap == 0) return 0;
    Slot *slot = probe(s, key, h);
    if (slot->id1 == 0) return 0;
    erase(t, s, (size_t)(slot - s->slots));
    return 1;
}

static void free_shards(KeyTable *t) {
    for (int i = 0; i < NSHARDS; i++) {
        PyMem_Free(t->shards[i].slots);
        t->shards[i] = (Shard){NULL, 0, 0};
    }
    t->len = 0;
}

/* ---- arguments ---- */

/* o as a key to store: 0 with *out, or -1 with TypeError (not an int) or OverflowError (out of [0, 2**64)). */
static int key_arg(PyObject *o, uint64_t *out) {
    int r = u64_value(o, out);
    if (r == 1) return 0;
    if (r < 0)
        PyErr_Format(PyExc_TypeError, "block keys are ints, got %.100s", Py_TYPE(o)->tp_name);
    else
        PyErr_SetString(PyExc_OverflowError, "block keys are ints in [0, 2**64)");
    return -1;
}

/* An int argument >= 0 (__index__ accepted): 0 with *out (INT64_MAX when larger), or -1 with TypeError or
 * ValueError (negative). */
static int count_arg(PyObject *o, const char *what, int64_t *out) {
    PyObject *i = PyNumber_Index(o);
    if (i == NULL) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || (overflow == 0 && v < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", what);
        return -1;
    }
    *out = overflow > 0 ? INT64_MAX : (int64_t)v;
    return 0;
}

/* A node id argument: count_arg's, and OverflowError when >= 2**62. */
static int id_arg(PyObject *o, const char *what, int64_t *out) {
    if (count_arg(o, what, out) < 0) return -1;
    if (*out >= ID_END) {
        PyErr_Format(PyExc_OverflowError, "%s: node ids are below 2**62", what);
        return -1;
    }
    return 0;
}

/* ids nid .. nid + n - 1 must all be node ids. 0, or -1 with OverflowError. */
static int ids_fit(int64_t nid, Py_ssize_t n) {
    if ((int64_t)n > ID_END - nid) {
        PyErr_SetString(PyExc_OverflowError, "node ids are below 2**62: the run would pass it");
        return -1;
    }
    return 0;
}

/* The keys a run stores, keys[lo:hi], all checked before any is: TypeError at the first key that is not an int, else
 * OverflowError if one is out of [0, 2**64). 0 or -1. (No prefetching of their slots on the way: measured, the
 * out-of-order core already overlaps the misses of consecutive keys.) */
static int check_keys(PyObject *keys, Py_ssize_t lo, Py_ssize_t hi) {
    int out_of_range = 0;
    for (Py_ssize_t j = lo; j < hi; j++) {
        PyObject *o = PyList_GET_ITEM(keys, j);
        uint64_t key = 0;
        int r = u64_value(o, &key);
        if (r < 0) return key_arg(o, &key);
        if (r == 0) out_of_range = 1;
    }
    if (out_of_range) {
        PyErr_SetString(PyExc_OverflowError, "block keys are ints in [0, 2**64)");
        return -1;
    }
    return 0;
}

/* ---- the type ---- */

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyTable() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0); /* zeroed: every shard empty */
}

static void KeyTable_dealloc(KeyTable *t) {
    free_shards(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->len; }

static int KeyTable_contains(KeyTable *t, PyObject *o) {
    uint64_t key = 0;
    return u64_value(o, &key) == 1 && find(t, key) != NULL;
}

static PyObject *KeyTable_subscript(KeyTable *t, PyObject *o) {
    uint64_t key = 0;
    Slot *slot = u64_value(o, &key) == 1 ? find(t, key) : NULL;
    if (slot == NULL) return key_error(o);
    return PyLong_FromLongLong(slot->id1 - 1);
}

static int KeyTable_ass_subscript(KeyTable *t, PyObject *o, PyObject *value) {
    uint64_t key = 0;
    if (value == NULL) { /* del */
        if (u64_value(o, &key) == 1 && discard(t, key)) return 0;
        key_error(o);
        return -1;
    }
    int64_t nid;
    if (key_arg(o, &key) < 0 || id_arg(value, "nid", &nid) < 0) return -1;
    return put(t, key, nid, 1) < 0 ? -1 : 0;
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("get", nargs, 1, 2) < 0) return NULL;
    uint64_t key = 0;
    Slot *slot = u64_value(args[0], &key) == 1 ? find(t, key) : NULL;
    if (slot != NULL) return PyLong_FromLongLong(slot->id1 - 1);
    PyObject *dflt = nargs > 1 ? args[1] : Py_None;
    Py_INCREF(dflt);
    return dflt;
}

/* A copy of every entry (n of them; PyMem_Free it), or NULL with MemoryError. */
static Slot *entries(KeyTable *t, Py_ssize_t *n) {
    *n = t->len;
    Slot *out = PyMem_Malloc(t->len ? (size_t)t->len * sizeof(Slot) : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t k = 0;
    for (int i = 0; i < NSHARDS; i++) {
        const Shard *s = &t->shards[i];
        for (size_t j = 0; j < s->cap; j++)
            if (s->slots[j].id1) out[k++] = s->slots[j];
    }
    return out;
}

enum { KEYS, VALUES, ITEMS };

/* keys(), values() or items() as a list, built from a copy of the entries (making a tuple may run the GC, and a
 * finalizer could change the table). */
static PyObject *listing(KeyTable *t, int what) {
    Py_ssize_t n;
    Slot *all = entries(t, &n);
    if (all == NULL) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t j = 0; out != NULL && j < n; j++) {
        PyObject *k = what == VALUES ? NULL : PyLong_FromUnsignedLongLong(all[j].key);
        PyObject *v = what == KEYS ? NULL : PyLong_FromLongLong(all[j].id1 - 1);
        PyObject *item = what == KEYS ? k : what == VALUES ? v : (k && v) ? PyTuple_Pack(2, k, v) : NULL;
        if (what == ITEMS) {
            Py_XDECREF(k);
            Py_XDECREF(v);
        }
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, j, item);
    }
    PyMem_Free(all);
    return out;
}

static PyObject *KeyTable_keys(KeyTable *t, PyObject *unused) { return listing(t, KEYS); }
static PyObject *KeyTable_values(KeyTable *t, PyObject *unused) { return listing(t, VALUES); }
static PyObject *KeyTable_items(KeyTable *t, PyObject *unused) { return listing(t, ITEMS); }

static PyObject *KeyTable_iter(KeyTable *t) {
    PyObject *keys = listing(t, KEYS);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *KeyTable_clear(KeyTable *t, PyObject *unused) {
    free_shards(t);
    Py_RETURN_NONE;
}

static PyObject *KeyTable_nbytes(KeyTable *t, PyObject *unused) {
    size_t n = sizeof(KeyTable);
    for (int i = 0; i < NSHARDS; i++) n += t->shards[i].cap * sizeof(Slot);
    return PyLong_FromSize_t(n);
}

static PyObject *KeyTable_claim_run(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    int64_t start, stop, nid;
    if (arg_count("claim_run", nargs, 4, 4) < 0 || list_arg(args[0], "keys") < 0 ||
        count_arg(args[1], "start", &start) < 0 || count_arg(args[2], "stop", &stop) < 0 ||
        id_arg(args[3], "nid", &nid) < 0)
        return NULL;
    PyObject *keys = args[0];
    Py_ssize_t n = PyList_GET_SIZE(keys); /* the list cannot change from here on: no Python code runs */
    Py_ssize_t lo = start < n ? (Py_ssize_t)start : n;
    Py_ssize_t hi = stop < n ? (Py_ssize_t)stop : n;
    if (hi < lo) hi = lo;
    if (check_keys(keys, lo, hi) < 0 || ids_fit(nid, hi - lo) < 0) return NULL;
    Py_ssize_t j = lo;
    for (; j < hi; j++) {
        uint64_t key = 0;
        u64_value(PyList_GET_ITEM(keys, j), &key);
        int r = put(t, key, nid + (j - lo), 0);
        if (r < 0) return NULL;
        if (r == 0) break;
    }
    return PyLong_FromSsize_t(j - lo);
}

static PyObject *KeyTable_lookup(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("lookup", nargs, 1, 1) < 0 || list_arg(args[0], "keys") < 0) return NULL;
    PyObject *keys = args[0];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n); /* may run the GC: before anything is read */
    if (out == NULL) return NULL;
    /* from here only ints are made (not GC-tracked): no Python code runs, the list keeps its length */
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *o = PyList_GET_ITEM(keys, j);
        uint64_t key = 0;
        int r = u64_value(o, &key);
        if (r < 0) { /* TypeError */
            key_arg(o, &key);
            Py_DECREF(out);
            return NULL;
        }
        Slot *slot = r == 1 ? find(t, key) : NULL; /* an int out of range is absent */
        PyObject *v = slot ? PyLong_FromLongLong(slot->id1 - 1) : Py_NewRef(Py_None);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, v);
    }
    return out;
}

static PyObject *KeyTable_assign_run(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    int64_t nid;
    if (arg_count("assign_run", nargs, 2, 2) < 0 || list_arg(args[0], "keys") < 0 || id_arg(args[1], "nid", &nid) < 0)
        return NULL;
    PyObject *keys = args[0];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (check_keys(keys, 0, n) < 0 || ids_fit(nid, n) < 0) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t key = 0;
        u64_value(PyList_GET_ITEM(keys, j), &key);
        if (put(t, key, nid + j, 1) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *KeyTable_forget(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("forget", nargs, 1, 1) < 0 || list_arg(args[0], "keys") < 0) return NULL;
    PyObject *keys = args[0];
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(keys); j++) {
        PyObject *o = PyList_GET_ITEM(keys, j);
        uint64_t key = 0;
        int r = u64_value(o, &key);
        if (r < 0) { /* TypeError, the keys before it removed (as KeyError below) */
            key_arg(o, &key);
            return NULL;
        }
        if (r == 0 || !discard(t, key)) return key_error(o);
    }
    Py_RETURN_NONE;
}

#define FAST(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef KeyTable_methods[] = {
    {"get", FAST(KeyTable_get), METH_FASTCALL, "get(key, default=None, /): the key's node id, or default."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys() -> list: every key (no order)."},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS, "values() -> list: every node id (keys() order)."},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "items() -> list: every (key, node id) (no order)."},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "clear() -> None: remove every key, free the slots."},
    {"nbytes", (PyCFunction)KeyTable_nbytes, METH_NOARGS,
     "nbytes() -> int: bytes the table takes (the object and its slot arrays)."},
    {"claim_run", FAST(KeyTable_claim_run), METH_FASTCALL,
     "claim_run(keys, start, stop, nid, /) -> int: map keys[start], keys[start + 1], ... (before stop) to nid,\n"
     "nid + 1, ... while they are absent; how many were mapped (the first present key, an earlier one of the run\n"
     "included, ends it)."},
    {"lookup", FAST(KeyTable_lookup), METH_FASTCALL, "lookup(keys, /) -> list: each key's node id, or None."},
    {"assign_run", FAST(KeyTable_assign_run), METH_FASTCALL,
     "assign_run(keys, nid, /) -> None: map keys[j] to nid + j, present or not."},
    {"forget", FAST(KeyTable_forget), METH_FASTCALL,
     "forget(keys, /) -> None: remove every key (KeyError at the first absent one, the keys before it removed)."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyTable_mapping = {
    .mp_length = (lenfunc)KeyTable_len,
    .mp_subscript = (binaryfunc)KeyTable_subscript,
    .mp_ass_subscript = (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "index.key_table_native.KeyTable",
    .tp_doc = PyDoc_STR("KeyTable(): block key (an int in [0, 2**64)) -> node id (an int in [0, 2**62)), stored\n"
                        "inline in 64 open-addressing shards (index/key_table.py)."),
    .tp_basicsize = sizeof(KeyTable),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &KeyTable_mapping,
    .tp_as_sequence = &KeyTable_sequence,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_methods = KeyTable_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "key_table_native",
    "KeyTable: the index's block key -> node id map as a compiled type (index/key_table.py).", -1, NULL,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_key_table_native(void) {
    if (PyType_Ready(&KeyTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
