/*
 * index.engine_table_native: EngineTable, one replica's engine page hash -> router block key map as a compiled type
 * (index/engine_table.py chooses it, or its Python twin PyEngineTable, a dict, when this module is not built;
 * tests/unit/test_engine_table.py runs both on the same operations and compares them with a dict).
 *
 * Units: hashes and keys are ints in [0, 2**64), every value valid (no sentinel is taken from them); sizes are in
 * bytes; entry numbers count entries from the start of the entry array.
 *
 * Why: a dict entry costs its slot plus the hash's int object (~70 B a page). Here a hash and its key are one
 * 16-byte entry, found through a 4-byte index slot: ~22 to 43 B a page (~30 on average).
 *
 * Layout, as CPython's dict: the entries in insertion order, entries[0, used) (live and deleted ones), in one block
 * with a bitmap after them (bit i set: entries[i] is deleted; all 2**64 values of a hash and of a key are valid,
 * so an entry cannot say it itself). The index: icap (a power of two) uint32 slots, each 0 (empty) or an entry
 * number + 1; a hash's home slot is its 64-bit mix (murmur3's fmix64 finalizer) & (icap - 1), collisions probe
 * linearly. The index holds the live entries only: a deletion shifts back the following slots of its cluster (no
 * tombstones), so its load is live / icap, kept <= 0.7 (it doubles before), whatever was deleted before.
 *
 * Growth and compaction: the entry array doubles (a realloc: entry numbers stay, the index too) when an append
 * finds it full, unless an eighth or more of it is deleted: it is then compacted in place (live entries moved to the
 * front, in order) and the index rebuilt. A deletion that leaves as many deleted entries as live ones compacts too,
 * and shrinks both arrays to twice the live count: each compaction is paid by the deletions since the previous
 * one (amortised O(1)), and used < 2 * live + 1 between deletions, so a listing walks O(live) entries. head: every
 * entry before it is deleted, entries[head] is live (or head == used): pop_oldest starts there.
 *
 * At most 2**31 entries (OverflowError beyond). No Python object is held (no GC support needed). No Python code runs
 * while the arrays are changed or read through a pointer: arguments are converted first (update_pairs converts
 * every pair into a C buffer before storing any), and the listings are built from a copy of the entries. An
 * allocation that fails raises MemoryError before anything is changed; the compactions deletions make never fail
 * (a smaller array that cannot be had: the larger one kept).
 */
#include "table_args.h"
#include <stdint.h>
#include <string.h>

#define MIN_ENTRIES 8
#define MIN_SLOTS 8
#define MAX_ENTRIES ((size_t)1 << 31)
/* bitmap words for n entries */
#define WORDS(n) (((n) + 63) / 64)

typedef struct {
    uint64_t hash;
    uint64_t key;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;  /* ecap entries, then WORDS(ecap) bitmap words; NULL while ecap is 0 */
    uint32_t *index; /* icap slots; NULL while icap is 0 */
    size_t ecap;     /* 0 or a power of two >= MIN_ENTRIES */
    size_t icap;     /* 0 or a power of two >= MIN_SLOTS */
    size_t used;     /* entries appended since the last compaction, live or deleted */
    size_t live;
    size_t head;     /* entries before it are deleted; entries[head] is live unless head == used */
} EngineTable;

static PyTypeObject EngineTableType;

static inline uint64_t *dead_bits(const EngineTable *t) { return (uint64_t *)(t->entries + t->ecap); }

static inline int is_dead(const uint64_t *bits, size_t i) { return (int)((bits[i >> 6] >> (i & 63)) & 1); }

/* The index slot holding hash's entry, or the empty slot that ends its probe (icap > 0). */
static inline uint32_t *probe(const EngineTable *t, uint64_t hash) {
    size_t mask = t->icap - 1;
    size_t i = (size_t)mix64(hash) & mask;
    while (t->index[i] != 0 && t->entries[t->index[i] - 1].hash != hash) i = (i + 1) & mask;
    return &t->index[i];
}

/* hash's slot in the index, or NULL when absent. */
static inline uint32_t *slot_of(const EngineTable *t, uint64_t hash) {
    if (t->icap == 0) return NULL;
    uint32_t *s = probe(t, hash);
    return *s ? s : NULL;
}

/* Empty index slots (the array of icap of them, given or t's own) and put every live entry in. */
static void fill_index(EngineTable *t, uint32_t *index, size_t icap) {
    if (index != t->index) {
        PyMem_Free(t->index);
        t->index = index;
        t->icap = icap;
    }
    memset(index, 0, icap * sizeof(uint32_t));
    const uint64_t *bits = dead_bits(t);
    size_t mask = icap - 1;
    for (size_t e = t->head; e < t->used; e++) {
        if (is_dead(bits, e)) continue;
        size_t i = (size_t)mix64(t->entries[e].hash) & mask;
        while (index[i]) i = (i + 1) & mask;
        index[i] = (uint32_t)(e + 1);
    }
}

/* Move the live entries to the front, in order (the index must be filled again after). */
static void compact(EngineTable *t) {
    uint64_t *bits = dead_bits(t);
    size_t to = 0;
    for (size_t e = t->head; e < t->used; e++)
        if (!is_dead(bits, e)) t->entries[to++] = t->entries[e];
    memset(bits, 0, WORDS(t->used) * sizeof(uint64_t));
    t->used = t->live;
    t->head = 0;
}

/* Give the entry block room for cap (> ecap) entries, the bitmap moved after them. 0, or -1 (nothing changed). */
static int grow_entries(EngineTable *t, size_t cap) {
    size_t old_words = WORDS(t->ecap), words = WORDS(cap);
    char *block = PyMem_Realloc(t->entries, cap * sizeof(Entry) + words * sizeof(uint64_t));
    if (block == NULL) return -1;
    uint64_t *bits = (uint64_t *)(block + cap * sizeof(Entry));
    memmove(bits, block + t->ecap * sizeof(Entry), old_words * sizeof(uint64_t));
    memset(bits + old_words, 0, (words - old_words) * sizeof(uint64_t));
    t->entries = (Entry *)block;
    t->ecap = cap;
    return 0;
}

static void free_arrays(EngineTable *t) {
    PyMem_Free(t->entries);
    PyMem_Free(t->index);
    t->entries = NULL;
    t->index = NULL;
    t->ecap = t->icap = t->used = t->live = t->head = 0;
}

/* The index size for n live entries: a power of two >= MIN_SLOTS with n <= 0.7 of it. */
static size_t slots_for(size_t n, size_t from) {
    size_t cap = from;
    while (n * 10 > cap * 7) cap *= 2;
    return cap;
}

/* Room for extra more entries: appending them needs no allocation. 0, or -1 with OverflowError (past 2**31
 * entries) or MemoryError (nothing changed in either case). */
static int reserve(EngineTable *t, size_t extra) {
    if (extra > MAX_ENTRIES - t->live) {
        PyErr_SetString(PyExc_OverflowError, "an EngineTable holds at most 2**31 entries");
        return -1;
    }
    size_t dead = t->used - t->live;
    int squeeze = t->used + extra > t->ecap && dead && (dead * 8 >= t->used || t->used + extra > MAX_ENTRIES);
    size_t need = (squeeze ? t->live : t->used) + extra;
    size_t ecap = t->ecap ? t->ecap : MIN_ENTRIES;
    while (ecap < need) ecap *= 2;
    size_t icap = slots_for(t->live + extra, t->icap ? t->icap : MIN_SLOTS);
    uint32_t *index = NULL;
    if (icap != t->icap && (index = PyMem_Calloc(icap, sizeof(uint32_t))) == NULL) goto nomem;
    if (ecap != t->ecap && grow_entries(t, ecap) < 0) goto nomem;
    /* from here nothing fails */
    if (squeeze) compact(t);
    if (index != NULL || squeeze) fill_index(t, index ? index : t->index, icap);
    return 0;
nomem:
    PyMem_Free(index);
    PyErr_NoMemory();
    return -1;
}

/* After a deletion left as many deleted entries as live ones: compact, both arrays shrunk to fit 2 * live. */
static void squeeze_after_deletion(EngineTable *t) {
    if (t->live == 0) {
        free_arrays(t);
        return;
    }
    size_t icap = slots_for(2 * t->live, MIN_SLOTS);
    size_t ecap = MIN_ENTRIES;
    while (ecap < 2 * t->live) ecap *= 2;
    uint32_t *index = icap < t->icap ? PyMem_Calloc(icap, sizeof(uint32_t)) : NULL; /* NULL: keep the old one */
    compact(t);
    if (ecap < t->ecap) {
        /* the bitmap is all zeroes after compact(): the smaller block's is zeroed again below */
        Entry *block = PyMem_Realloc(t->entries, ecap * sizeof(Entry) + WORDS(ecap) * sizeof(uint64_t));
        if (block != NULL) {
            t->entries = block;
            t->ecap = ecap;
            memset(dead_bits(t), 0, WORDS(ecap) * sizeof(uint64_t));
        }
    }
    fill_index(t, index ? index : t->index, index ? icap : t->icap);
}

/* Remove the entry the index slot s holds. */
static void unlink_slot(EngineTable *t, uint32_t *s) {
    size_t e = *s - 1, mask = t->icap - 1;
    /* backward shift: walking j after the hole i while slot j is taken, the entry at j moves into the hole (which
     * moves to j) when i lies cyclically in [home(j), j): a probe from its home would stop at the hole first */
    size_t i = (size_t)(s - t->index);
    for (size_t j = (i + 1) & mask; t->index[j]; j = (j + 1) & mask) {
        size_t home = (size_t)mix64(t->entries[t->index[j] - 1].hash) & mask;
        if (((i - home) & mask) < ((j - home) & mask)) {
            t->index[i] = t->index[j];
            i = j;
        }
    }
    t->index[i] = 0;
    uint64_t *bits = dead_bits(t);
    bits[e >> 6] |= (uint64_t)1 << (e & 63);
    t->live--;
    if (e == t->head)
        while (t->head < t->used && is_dead(bits, t->head)) t->head++;
    if (t->used - t->live >= t->live) squeeze_after_deletion(t);
}

/* hash -> key: 1 when the hash was new (appended), 0 when present (its key replaced in place), -1 with an
 * exception (nothing changed). */
static int put(EngineTable *t, uint64_t hash, uint64_t key) {
    uint32_t *s = NULL;
    if (t->icap) {
        s = probe(t, hash);
        if (*s) {
            t->entries[*s - 1].key = key;
            return 0;
        }
    }
    if (t->used == t->ecap || (t->live + 1) * 10 > t->icap * 7) {
        if (reserve(t, 1) < 0) return -1;
        s = probe(t, hash);
    }
    t->entries[t->used] = (Entry){hash, key};
    *s = (uint32_t)(++t->used);
    t->live++;
    return 1;
}

/* ---- arguments ---- */

static int store_error(PyObject *o, int r, const char *what) {
    if (r < 0)
        PyErr_Format(PyExc_TypeError, "%s are ints, got %.100s", what, Py_TYPE(o)->tp_name);
    else
        PyErr_Format(PyExc_OverflowError, "%s are ints in [0, 2**64)", what);
    return -1;
}

/* o as a value to store: 0 with *out, or -1 with TypeError (not an int) or OverflowError (out of range). */
static int store_arg(PyObject *o, const char *what, uint64_t *out) {
    int r = u64_value(o, out);
    return r == 1 ? 0 : store_error(o, r, what);
}

/* Every item of list as a value to store, into out[j].hash (or .key): TypeError at the first that is not an int,
 * else OverflowError if one is out of range (the same order as PyEngineTable's checks). 0 or -1. */
static int store_list(PyObject *list, Entry *out, int keys, const char *what) {
    PyObject *outside = NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(list); j++) {
        PyObject *o = PyList_GET_ITEM(list, j);
        uint64_t *v = keys ? &out[j].key : &out[j].hash;
        int r = u64_value(o, v);
        if (r < 0) return store_error(o, r, what);
        if (r == 0 && outside == NULL) outside = o;
    }
    return outside ? store_error(outside, 0, what) : 0;
}

/* The slot of o's entry, or NULL (o not an int in range, or absent). */
static uint32_t *slot_arg(EngineTable *t, PyObject *o) {
    uint64_t hash = 0;
    return u64_value(o, &hash) == 1 ? slot_of(t, hash) : NULL;
}

static inline PyObject *key_at(EngineTable *t, const uint32_t *s) {
    return PyLong_FromUnsignedLongLong(t->entries[*s - 1].key);
}

/* ---- the type ---- */

static PyObject *EngineTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "EngineTable() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0); /* zeroed: empty, no arrays */
}

static void EngineTable_dealloc(EngineTable *t) {
    free_arrays(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t EngineTable_len(EngineTable *t) { return (Py_ssize_t)t->live; }

static int EngineTable_contains(EngineTable *t, PyObject *o) { return slot_arg(t, o) != NULL; }

static PyObject *EngineTable_subscript(EngineTable *t, PyObject *o) {
    uint32_t *s = slot_arg(t, o);
    return s ? key_at(t, s) : key_error(o);
}

static int EngineTable_ass_subscript(EngineTable *t, PyObject *o, PyObject *value) {
    if (value == NULL) { /* del */
        uint32_t *s = slot_arg(t, o);
        if (s == NULL) {
            key_error(o);
            return -1;
        }
        unlink_slot(t, s);
        return 0;
    }
    uint64_t hash, key;
    if (store_arg(o, "engine hashes", &hash) < 0 || store_arg(value, "router keys", &key) < 0) return -1;
    return put(t, hash, key) < 0 ? -1 : 0;
}

static PyObject *EngineTable_get(EngineTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("get", nargs, 1, 2) < 0) return NULL;
    uint32_t *s = slot_arg(t, args[0]);
    if (s) return key_at(t, s);
    return Py_NewRef(nargs > 1 ? args[1] : Py_None);
}

static PyObject *EngineTable_pop(EngineTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("pop", nargs, 1, 2) < 0) return NULL;
    uint32_t *s = slot_arg(t, args[0]);
    if (s == NULL) return nargs > 1 ? Py_NewRef(args[1]) : key_error(args[0]);
    PyObject *key = key_at(t, s); /* before the removal: a MemoryError leaves the entry */
    if (key != NULL) unlink_slot(t, s);
    return key;
}

enum { HASHES, KEYS, ITEMS };

/* The live entries as a list of their hashes, keys or (hash, key) tuples, in order: built from a copy (making a
 * tuple may run the GC, whose finalizers may change the table). */
static PyObject *listing(EngineTable *t, int what) {
    size_t n = t->live;
    Entry *copy = PyMem_Malloc(n ? n * sizeof(Entry) : 1);
    if (copy == NULL) return PyErr_NoMemory();
    if (n) {
        const uint64_t *bits = dead_bits(t);
        size_t k = 0;
        for (size_t e = t->head; e < t->used; e++)
            if (!is_dead(bits, e)) copy[k++] = t->entries[e];
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t j = 0; out != NULL && j < n; j++) {
        PyObject *h = what == KEYS ? NULL : PyLong_FromUnsignedLongLong(copy[j].hash);
        PyObject *k = what == HASHES ? NULL : PyLong_FromUnsignedLongLong(copy[j].key);
        PyObject *item = what == HASHES ? h : what == KEYS ? k : NULL;
        if (what == ITEMS) {
            item = h && k ? PyTuple_Pack(2, h, k) : NULL;
            Py_XDECREF(h);
            Py_XDECREF(k);
        }
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)j, item);
    }
    PyMem_Free(copy);
    return out;
}

static PyObject *EngineTable_keys(EngineTable *t, PyObject *unused) { return listing(t, HASHES); }
static PyObject *EngineTable_values(EngineTable *t, PyObject *unused) { return listing(t, KEYS); }
static PyObject *EngineTable_items(EngineTable *t, PyObject *unused) { return listing(t, ITEMS); }

static PyObject *EngineTable_iter(EngineTable *t) {
    PyObject *hashes = listing(t, HASHES);
    if (hashes == NULL) return NULL;
    PyObject *it = PyObject_GetIter(hashes);
    Py_DECREF(hashes);
    return it;
}

static PyObject *EngineTable_clear(EngineTable *t, PyObject *unused) {
    free_arrays(t);
    Py_RETURN_NONE;
}

static PyObject *EngineTable_nbytes(EngineTable *t, PyObject *unused) {
    return PyLong_FromSize_t(sizeof(EngineTable) + t->ecap * sizeof(Entry) + WORDS(t->ecap) * sizeof(uint64_t) +
                             t->icap * sizeof(uint32_t));
}

static PyObject *EngineTable_update_pairs(EngineTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (arg_count("update_pairs", nargs, 2, 2) < 0 || list_arg(args[0], "hashes") < 0 ||
        list_arg(args[1], "keys") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (n != PyList_GET_SIZE(args[1]))
        return PyErr_Format(PyExc_ValueError, "%zd hashes for %zd keys", n, PyList_GET_SIZE(args[1]));
    if (n == 0) return PyLong_FromLong(0);
    Entry *pairs = PyMem_Malloc((size_t)n * sizeof(Entry));
    if (pairs == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    if (store_list(args[0], pairs, 0, "engine hashes") < 0 || store_list(args[1], pairs, 1, "router keys") < 0)
        goto done;
    /* room for every pair whose hash is absent now (a hash repeated in the call counted each time): no
     * allocation, hence no failure, once the first pair is stored */
    size_t absent = (size_t)n;
    if (t->used + absent > t->ecap || (t->live + absent) * 10 > t->icap * 7) {
        absent = 0;
        for (Py_ssize_t j = 0; j < n; j++) absent += slot_of(t, pairs[j].hash) == NULL;
        if (absent && reserve(t, absent) < 0) goto done;
    }
    Py_ssize_t added = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        int r = put(t, pairs[j].hash, pairs[j].key);
        if (r < 0) goto done; /* not reached: reserved */
        added += r;
    }
    result = PyLong_FromSsize_t(added);
done:
    PyMem_Free(pairs);
    return result;
}

static PyObject *EngineTable_lookup(EngineTable *t, PyObject *hashes) {
    if (list_arg(hashes, "hashes") < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    PyObject *out = PyList_New(n); /* may run the GC: before anything is read */
    if (out == NULL) return NULL;
    /* from here only ints are made (not GC-tracked): no Python code runs, the list keeps its length */
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t *s = slot_arg(t, PyList_GET_ITEM(hashes, j));
        PyObject *v = s ? key_at(t, s) : Py_NewRef(Py_None);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, v);
    }
    return out;
}

static PyObject *EngineTable_discard(EngineTable *t, PyObject *hashes) {
    if (list_arg(hashes, "hashes") < 0) return NULL;
    Py_ssize_t removed = 0;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(hashes); j++) {
        uint32_t *s = slot_arg(t, PyList_GET_ITEM(hashes, j));
        if (s != NULL) {
            unlink_slot(t, s);
            removed++;
        }
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *EngineTable_pop_oldest(EngineTable *t, PyObject *arg) {
    PyObject *i = PyNumber_Index(arg); /* may run __index__: before anything is read */
    if (i == NULL) return NULL;
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (overflow < 0 || (overflow == 0 && n < 0)) {
        PyErr_SetString(PyExc_ValueError, "n must not be negative");
        return NULL;
    }
    size_t live = t->live;
    if (overflow > 0 || (unsigned long long)n >= live) {
        free_arrays(t);
        return PyLong_FromSize_t(live);
    }
    for (long long k = 0; k < n; k++) /* entries[head] is live: its slot is found */
        unlink_slot(t, probe(t, t->entries[t->head].hash));
    return PyLong_FromLongLong(n);
}

#define FAST(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef EngineTable_methods[] = {
    {"get", FAST(EngineTable_get), METH_FASTCALL, "get(hash, default=None, /): the hash's key, or default."},
    {"pop", FAST(EngineTable_pop), METH_FASTCALL,
     "pop(hash[, default], /): remove the hash and return its key; default (KeyError without it) when absent."},
    {"keys", (PyCFunction)EngineTable_keys, METH_NOARGS, "keys() -> list: every hash, oldest first."},
    {"values", (PyCFunction)EngineTable_values, METH_NOARGS, "values() -> list: every key, in keys() order."},
    {"items", (PyCFunction)EngineTable_items, METH_NOARGS, "items() -> list: every (hash, key), oldest first."},
    {"clear", (PyCFunction)EngineTable_clear, METH_NOARGS, "clear() -> None: remove every entry, free the arrays."},
    {"nbytes", (PyCFunction)EngineTable_nbytes, METH_NOARGS,
     "nbytes() -> int: bytes the table takes (the object, its entry array with the bitmap, its index)."},
    {"update_pairs", FAST(EngineTable_update_pairs), METH_FASTCALL,
     "update_pairs(hashes, keys, /) -> int: self[hashes[j]] = keys[j] for every j in order (every hash and key\n"
     "checked first); how many of the hashes were new."},
    {"lookup", (PyCFunction)EngineTable_lookup, METH_O,
     "lookup(hashes, /) -> list: each hash's key, or None."},
    {"discard", (PyCFunction)EngineTable_discard, METH_O,
     "discard(hashes, /) -> int: remove every hash that is present; how many were."},
    {"pop_oldest", (PyCFunction)EngineTable_pop_oldest, METH_O,
     "pop_oldest(n, /) -> int: remove the n oldest entries (all when n >= len); how many were removed."},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods EngineTable_mapping = {
    .mp_length = (lenfunc)EngineTable_len,
    .mp_subscript = (binaryfunc)EngineTable_subscript,
    .mp_ass_subscript = (objobjargproc)EngineTable_ass_subscript,
};

static PySequenceMethods EngineTable_sequence = {
    .sq_contains = (objobjproc)EngineTable_contains,
};

static PyTypeObject EngineTableType = {
    .ob_base = PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "index.engine_table_native.EngineTable",
    .tp_doc = PyDoc_STR("EngineTable(): engine page hash -> router block key (ints in [0, 2**64)) in insertion\n"
                        "order, entries inline in one array found through an open-addressing index\n"
                        "(index/engine_table.py)."),
    .tp_basicsize = sizeof(EngineTable),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = EngineTable_new,
    .tp_dealloc = (destructor)EngineTable_dealloc,
    .tp_as_mapping = &EngineTable_mapping,
    .tp_as_sequence = &EngineTable_sequence,
    .tp_iter = (getiterfunc)EngineTable_iter,
    .tp_methods = EngineTable_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "engine_table_native",
    "EngineTable: one replica's engine page hash -> router block key map as a compiled type (index/engine_table.py).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_engine_table_native(void) {
    if (PyType_Ready(&EngineTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "EngineTable", (PyObject *)&EngineTableType) < 0) Py_CLEAR(m);
    return m;
}
