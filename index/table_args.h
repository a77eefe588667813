/*
 * What the index's compiled tables (index/key_table_native.c, index/engine_table_native.c) share: the 64-bit mix
 * that spreads their keys, reading an int argument as a 64-bit value, and their argument errors.
 *
 * Everything is static inline: each module compiles its own copy of what it uses, and nothing unused is warned of.
 */
#ifndef KVROUTE_INDEX_TABLE_ARGS_H
#define KVROUTE_INDEX_TABLE_ARGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* murmur3's fmix64 finalizer: a bijection of 64-bit values (keys 1, 2, 3 spread like random ones). */
static inline uint64_t mix64(uint64_t k) {
    k ^= k >> 33;
    k *= UINT64_C(0xff51afd7ed558ccd);
    k ^= k >> 33;
    k *= UINT64_C(0xc4ceb9fe1a85ec53);
    k ^= k >> 33;
    return k;
}

/* o as a 64-bit value: 1 with *out for an int in [0, 2**64), 0 for an int out of that range, -1 for anything else
 * (no exception set in any case). Not PyLong_AsUnsignedLongLong: it goes through a byte array and raises (to be
 * cleared) for a negative int; for a 64-bit key it took twice the time of the whole lookup that follows. */
static inline int u64_value(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) return -1;
#if PY_VERSION_HEX < 0x030C0000
    /* 3.11: the digits (PyLong_SHIFT bits each, least significant first), the sign in ob_size */
    Py_ssize_t size = Py_SIZE(o);
    if (size < 0) return 0;
    const digit *d = ((PyLongObject *)o)->ob_digit;
    uint64_t v = 0;
    for (Py_ssize_t i = size; i-- > 0;) {
        if (v >> (64 - PyLong_SHIFT)) return 0; /* the next digit would push bits past 64 */
        v = (v << PyLong_SHIFT) | d[i];
    }
    *out = v;
    return 1;
#else
    PyLongObject *l = (PyLongObject *)o;
    if (PyUnstable_Long_IsCompact(l)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue(l);
        *out = (uint64_t)v;
        return v >= 0;
    }
    if (_PyLong_Sign(o) < 0) return 0;
    size_t bits = _PyLong_NumBits(o);
    if (bits > 64) {
        if (bits == (size_t)-1) PyErr_Clear(); /* more bits than a size_t counts */
        return 0;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o); /* no error: o is an int */
    return 1;
#endif
}

/* 0 when lo <= nargs <= hi, else -1 with TypeError. */
static inline int arg_count(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs >= lo && nargs <= hi) return 0;
    if (lo == hi)
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, lo, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s() takes %zd to %zd arguments (%zd given)", name, lo, hi, nargs);
    return -1;
}

/* 0 when o is a list, else -1 with TypeError naming the argument. */
static inline int list_arg(PyObject *o, const char *what) {
    if (PyList_Check(o)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a list, got %.100s", what, Py_TYPE(o)->tp_name);
    return -1;
}

/* NULL with KeyError(key) set (a tuple key must not become KeyError's arguments). */
static inline PyObject *key_error(PyObject *key) {
    PyObject *args = PyTuple_Pack(1, key);
    if (args != NULL) {
        PyErr_SetObject(PyExc_KeyError, args);
        Py_DECREF(args);
    }
    return NULL;
}

#endif
