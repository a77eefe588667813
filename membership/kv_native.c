/*
 * membership.kv_native: the common form of an engine KV-event batch, decoded in C.
 *
 * One function, ``decode``, reads a msgpack batch ``[ts, [events...], dp_rank, ...]`` whose events are all in the
 * form today's engines send (vLLM >= 0.24 and SGLang maps; see membership/kv_decode.py): ``BlockStored`` with token
 * ids, ``BlockRemoved``, ``AllBlocksCleared``. It returns exactly what the Python decoder would make of the batch, as
 * plain tuples, or None ("declined") for anything else: another form, a field the fast way does not read, a value the
 * Python decoder would drop, count or note, malformed msgpack, a bound exceeded. The caller then decodes the batch in
 * Python, so every answer of the fast way equals the Python decoder's and everything else is the Python decoder's
 * (tests/unit/test_kv_native.py checks both on the same payloads, valid, hand-made and fuzzed).
 *
 * What it saves: the token ids are read from the msgpack bytes straight into one buffer of uint32s (no Python int
 * per token, no list, no ``array`` conversion), and the events' maps, keys and strings are never built as objects.
 *
 * Result (not None): ``(ts, events, rank)`` where ``ts`` and ``rank`` are the batch's raw values (None when
 * absent) and ``events`` a list of
 *   (0, hashes, parent, tokens, block_size, medium_key, tier, lora_name, lora_id)   BlockStored
 *   (1, hashes, medium_key, tier, count)                                          consecutive BlockRemoved, merged
 *   (2,)                                                                          AllBlocksCleared
 * ``hashes``: list of int in [0, 2**64); ``tokens``: bytes of native uint32s (``array("I", tokens)``).
 *
 * No I/O, no global state; the GIL is held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* memory estimate of a decoded batch, bytes (membership/kv_decode.py EVENT_COST, HASH_COST, TOKEN_COST) */
#define EVENT_COST 128
#define HASH_COST 40
#define TOKEN_COST 4
/* deepest nesting of a value the fast way skips over; deeper -> declined */
#define MAX_SKIP_DEPTH 32

/* outcome of a step: OK, DECLINE (the Python decoder takes the batch), ERR (a Python exception is set) */
enum { OK = 0, DECLINE = 1, ERR = 2 };

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
    Py_ssize_t most; /* most elements of one array or map */
} Cur;

typedef struct {
    Py_ssize_t max_events, max_hashes, max_tokens, max_block_size;
    int has_group;
    long long group_idx;
    PyObject *media;     /* dict: medium spelling -> (key, tier) */
    PyObject *no_medium; /* (key, tier) of an event without a medium */
    long long max_cost;
    /* the last medium spelling looked up (bytes in the payload) and its entry: a batch names one or two */
    const char *last_medium;
    Py_ssize_t last_medium_len;
    PyObject *last_entry;
} Limits;

static int need(Cur *c, Py_ssize_t n) { return (c->end - c->p) >= n ? OK : DECLINE; }

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An integer: *neg set when negative (then *v holds it as int64 bits). Not an integer -> DECLINE. */
static int read_int(Cur *c, uint64_t *v, int *neg) {
    if (need(c, 1)) return DECLINE;
    unsigned char b = *c->p;
    *neg = 0;
    if (b <= 0x7f) { *v = b; c->p += 1; return OK; }
    if (b >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)b; *neg = 1; c->p += 1; return OK; }
    int n;
    int sign = 0;
    switch (b) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: return DECLINE;
    }
    if (need(c, 1 + n)) return DECLINE;
    uint64_t u = be(c->p + 1, n);
    c->p += 1 + n;
    if (sign) {
        int64_t s;
        if (n == 1) s = (int8_t)u;
        else if (n == 2) s = (int16_t)u;
        else if (n == 4) s = (int32_t)u;
        else s = (int64_t)u;
        *neg = s < 0;
        *v = (uint64_t)s;
    } else {
        *v = u;
    }
    return OK;
}

static int is_nil(Cur *c) { return c->p < c->end && *c->p == 0xc0; }

static int read_str(Cur *c, const char **s, Py_ssize_t *n) {
    if (need(c, 1)) return DECLINE;
    unsigned char b = *c->p;
    Py_ssize_t len;
    int h;
    if (b >= 0xa0 && b <= 0xbf) { len = b & 0x1f; h = 1; }
    else if (b == 0xd9) { if (need(c, 2)) return DECLINE; len = c->p[1]; h = 2; }
    else if (b == 0xda) { if (need(c, 3)) return DECLINE; len = (Py_ssize_t)be(c->p + 1, 2); h = 3; }
    else if (b == 0xdb) { if (need(c, 5)) return DECLINE; len = (Py_ssize_t)be(c->p + 1, 4); h = 5; }
    else return DECLINE;
    if (need(c, h + len)) return DECLINE;
    *s = (const char *)c->p + h;
    *n = len;
    c->p += h + len;
    return OK;
}

/* A str as the Python decoder would have it (strict UTF-8), new reference; invalid -> DECLINE. */
static int str_object(const char *s, Py_ssize_t n, PyObject **out) {
    *out = PyUnicode_DecodeUTF8(s, n, NULL);
    if (*out == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) { PyErr_Clear(); return DECLINE; }
        return ERR;
    }
    return OK;
}

static int container(Cur *c, int map, Py_ssize_t *n) {
    if (need(c, 1)) return DECLINE;
    unsigned char b = *c->p;
    unsigned char fix = map ? 0x80 : 0x90, h16 = map ? 0xde : 0xdc, h32 = map ? 0xdf : 0xdd;
    if (b >= fix && b <= fix + 0x0f) { *n = b & 0x0f; c->p += 1; }
    else if (b == h16) { if (need(c, 3)) return DECLINE; *n = (Py_ssize_t)be(c->p + 1, 2); c->p += 3; }
    else if (b == h32) { if (need(c, 5)) return DECLINE; *n = (Py_ssize_t)be(c->p + 1, 4); c->p += 5; }
    else return DECLINE;
    return *n <= c->most ? OK : DECLINE;
}

static int is_container(unsigned char b) {
    return (b >= 0x80 && b <= 0x9f) || (b >= 0xdc && b <= 0xdf);
}

/* Skip one value, checked as the msgpack parser checks it (strict UTF-8 strs, bounded containers); extension
 * types and 0xc1 are declined. */
static int skip(Cur *c, int depth) {
    if (depth > MAX_SKIP_DEPTH || need(c, 1)) return DECLINE;
    unsigned char b = *c->p;
    uint64_t v;
    int neg, r;
    if (b <= 0x7f || b >= 0xe0 || (b >= 0xcc && b <= 0xd3)) return read_int(c, &v, &neg);
    if (b == 0xc0 || b == 0xc2 || b == 0xc3) { c->p += 1; return OK; }
    if (b == 0xca) { if (need(c, 5)) return DECLINE; c->p += 5; return OK; }
    if (b == 0xcb) { if (need(c, 9)) return DECLINE; c->p += 9; return OK; }
    if ((b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb)) {
        const char *s;
        Py_ssize_t n;
        PyObject *o;
        if ((r = read_str(c, &s, &n)) != OK) return r;
        if ((r = str_object(s, n, &o)) != OK) return r;
        Py_DECREF(o);
        return OK;
    }
    if (b >= 0xc4 && b <= 0xc6) {
        int h = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
        if (need(c, 1 + h)) return DECLINE;
        Py_ssize_t n = (Py_ssize_t)be(c->p + 1, h);
        if (need(c, 1 + h + n)) return DECLINE;
        c->p += 1 + h + n;
        return OK;
    }
    Py_ssize_t n;
    if ((b >= 0x90 && b <= 0x9f) || b == 0xdc || b == 0xdd) {
        if ((r = container(c, 0, &n)) != OK) return r;
        for (Py_ssize_t i = 0; i < n; i++)
            if ((r = skip(c, depth + 1)) != OK) return r;
        return OK;
    }
    if ((b >= 0x80 && b <= 0x8f) || b == 0xde || b == 0xdf) {
        if ((r = container(c, 1, &n)) != OK) return r;
        for (Py_ssize_t i = 0; i < 2 * n; i++) {
            /* a key that is an array or a map (unhashable in Python): the Python parser's answer */
            if (i % 2 == 0 && need(c, 1) == OK && is_container(*c->p)) return DECLINE;
            if ((r = skip(c, depth + 1)) != OK) return r;
        }
        return OK;
    }
    return DECLINE; /* ext types, 0xc1 */
}

/* Engine block hashes: a non-empty array of ints, at most max_hashes. Negative ints are taken as int64 two's
 * complement (the Python decoder's rule) when neg_ok, else declined. New list in *out. */
static int read_hashes(Cur *c, const Limits *L, int neg_ok, PyObject **out) {
    Py_ssize_t n;
    int r;
    if ((r = container(c, 0, &n)) != OK) return r;
    if (n == 0 || n > L->max_hashes) return DECLINE;
    PyObject *list = PyList_New(n);
    if (list == NULL) return ERR;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        int neg;
        if ((r = read_int(c, &v, &neg)) != OK || (neg && !neg_ok)) {
            Py_DECREF(list);
            return r != OK ? r : DECLINE;
        }
        PyObject *h = PyLong_FromUnsignedLongLong(v);
        if (h == NULL) { Py_DECREF(list); return ERR; }
        PyList_SET_ITEM(list, i, h);
    }
    *out = list;
    return OK;
}

/* Token ids: a non-empty array of ints in [0, 2**32), at most max_tokens, into bytes of uint32s. */
static int read_tokens(Cur *c, const Limits *L, PyObject **out, Py_ssize_t *count) {
    Py_ssize_t n;
    int r;
    if ((r = container(c, 0, &n)) != OK) return r;
    if (n == 0 || n > L->max_tokens) return DECLINE; /* empty: a location-only event (Python's way) */
    PyObject *bytes = PyBytes_FromStringAndSize(NULL, n * 4);
    if (bytes == NULL) return ERR;
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(bytes);
    const unsigned char *p = c->p, *end = c->end;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (p >= end) goto decline;
        unsigned char b = *p;
        if (b <= 0x7f) { dst[i] = b; p += 1; continue; }
        if (b == 0xcd && end - p >= 3) { dst[i] = (uint32_t)((p[1] << 8) | p[2]); p += 3; continue; }
        if (b == 0xcc && end - p >= 2) { dst[i] = p[1]; p += 2; continue; }
        if (b == 0xce && end - p >= 5) { dst[i] = (uint32_t)be(p + 1, 4); p += 5; continue; }
        { /* any other integer encoding of a value in range */
            uint64_t v;
            int neg;
            c->p = p;
            if (read_int(c, &v, &neg) != OK || neg || v > 0xffffffffULL) goto decline;
            p = c->p;
            dst[i] = (uint32_t)v;
        }
    }
    c->p = p;
    *out = bytes;
    *count = n;
    return OK;
decline:
    Py_DECREF(bytes);
    return DECLINE;
}

/* A medium: nil -> no_medium; a spelling in the table -> its (key, tier); anything else DECLINE. Borrowed. */
static int read_medium(Cur *c, Limits *L, PyObject **entry) {
    if (is_nil(c)) { c->p += 1; *entry = L->no_medium; return OK; }
    const char *s;
    Py_ssize_t n;
    PyObject *o;
    int r;
    if ((r = read_str(c, &s, &n)) != OK) return r;
    if (L->last_entry != NULL && n == L->last_medium_len && memcmp(s, L->last_medium, (size_t)n) == 0) {
        *entry = L->last_entry;
        return OK;
    }
    if ((r = str_object(s, n, &o)) != OK) return r;
    PyObject *e = PyDict_GetItemWithError(L->media, o);
    Py_DECREF(o);
    if (e == NULL) return PyErr_Occurred() ? ERR : DECLINE;
    L->last_medium = s;
    L->last_medium_len = n;
    L->last_entry = e;
    *entry = e;
    return OK;
}

/* group_idx: nil, or (when the limits name a group) that group; any value when they do not. */
static int read_group(Cur *c, const Limits *L) {
    if (!L->has_group) return skip(c, 0);
    if (is_nil(c)) { c->p += 1; return OK; }
    uint64_t v;
    int neg, r;
    if ((r = read_int(c, &v, &neg)) != OK) return r;
    if (neg ? (long long)v != L->group_idx : (L->group_idx < 0 || v != (uint64_t)L->group_idx)) return DECLINE;
    return OK;
}

static int key_is(const char *s, Py_ssize_t n, const char *name) {
    size_t m = strlen(name);
    return (size_t)n == m && memcmp(s, name, m) == 0;
}

/* event kinds, and the fields the fast way reads (bit per field: a repeated field is declined) */
enum { EV_NONE = -1, EV_STORED = 0, EV_REMOVED = 1, EV_CLEARED = 2 };
enum {
    F_TYPE = 1 << 0, F_HASHES = 1 << 1, F_PARENT = 1 << 2, F_TOKENS = 1 << 3, F_BLOCK_SIZE = 1 << 4,
    F_LORA_ID = 1 << 5, F_MEDIUM = 1 << 6, F_LORA_NAME = 1 << 7, F_EXTRA = 1 << 8, F_GROUP = 1 << 9,
    F_LOCALITY = 1 << 10, F_SALT = 1 << 11, F_META = 1 << 12,
};

typedef struct {
    int kind;
    PyObject *hashes, *parent, *tokens, *lora_name, *lora_id, *medium; /* medium borrowed, the rest owned */
    Py_ssize_t n_tokens;
    long long block_size;
    int extra_pages;        /* length of extra_keys, -1 when absent or nil */
    const char *extra_str;  /* the one string of extra_keys' pages (a LoRA adapter's name), NULL when none */
    Py_ssize_t extra_len;
} Ev;

static void ev_clear(Ev *e) {
    Py_CLEAR(e->hashes);
    Py_CLEAR(e->parent);
    Py_CLEAR(e->tokens);
    Py_CLEAR(e->lora_name);
    Py_CLEAR(e->lora_id);
}

/* extra_keys: nil, or one entry per page, each nil or [name] with the same name on every page (vLLM writes a LoRA
 * adapter's name there; read_event checks it is lora_name's). Anything else (multimodal items, a cache salt,
 * prompt-embedding digests) DECLINE. */
static int read_extra(Cur *c, Ev *e) {
    if (is_nil(c)) { c->p += 1; e->extra_pages = -1; return OK; }
    Py_ssize_t n;
    int r;
    if ((r = container(c, 0, &n)) != OK) return r;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (is_nil(c)) { c->p += 1; continue; }
        Py_ssize_t m;
        const char *s;
        Py_ssize_t len;
        if ((r = container(c, 0, &m)) != OK) return r;
        if (m != 1 || (r = read_str(c, &s, &len)) != OK) return DECLINE;
        if (e->extra_str == NULL) { e->extra_str = s; e->extra_len = len; }
        else if (len != e->extra_len || memcmp(s, e->extra_str, (size_t)len) != 0) return DECLINE;
    }
    e->extra_pages = (int)(n > 0x7fffffff ? 0x7fffffff : n);
    return OK;
}

/* One field of an event map (key already read). A field the kind does not read is skipped, as Python ignores it. */
static int read_field(Cur *c, Limits *L, Ev *e, const char *k, Py_ssize_t kn, int *seen) {
    int bit = 0, r;
    uint64_t v;
    int neg;
    if (key_is(k, kn, "block_hashes")) bit = F_HASHES;
    else if (key_is(k, kn, "medium")) bit = F_MEDIUM;
    else if (key_is(k, kn, "group_idx")) bit = F_GROUP;
    else if (key_is(k, kn, "locality")) bit = F_LOCALITY;
    else if (e->kind == EV_STORED) {
        if (key_is(k, kn, "parent_block_hash")) bit = F_PARENT;
        else if (key_is(k, kn, "token_ids")) bit = F_TOKENS;
        else if (key_is(k, kn, "block_size")) bit = F_BLOCK_SIZE;
        else if (key_is(k, kn, "lora_id")) bit = F_LORA_ID;
        else if (key_is(k, kn, "lora_name")) bit = F_LORA_NAME;
        else if (key_is(k, kn, "extra_keys")) bit = F_EXTRA;
        else if (key_is(k, kn, "cache_salt")) bit = F_SALT;
        else if (key_is(k, kn, "metadata")) bit = F_META;
    }
    if (bit == 0) { /* a field the kind does not read: its key must still be a valid str, as for the parser */
        PyObject *o;
        if ((r = str_object(k, kn, &o)) != OK) return r;
        Py_DECREF(o);
    }
    if (bit == 0 || e->kind == EV_CLEARED) return skip(c, 0);
    if (*seen & bit) return DECLINE;
    *seen |= bit;
    switch (bit) {
    case F_HASHES: return read_hashes(c, L, e->kind == EV_STORED, &e->hashes);
    case F_MEDIUM: return read_medium(c, L, &e->medium);
    case F_GROUP: return read_group(c, L);
    case F_LOCALITY:
    case F_SALT:
    case F_META: /* read only when nil: a value changes the tier or the keys (Python's way) */
        if (!is_nil(c)) return DECLINE;
        c->p += 1;
        return OK;
    case F_PARENT:
        if (is_nil(c)) { c->p += 1; return OK; }
        if ((r = read_int(c, &v, &neg)) != OK) return r;
        e->parent = PyLong_FromUnsignedLongLong(v); /* negative: int64 two's complement, as Python */
        return e->parent == NULL ? ERR : OK;
    case F_TOKENS: return read_tokens(c, L, &e->tokens, &e->n_tokens);
    case F_BLOCK_SIZE:
        if ((r = read_int(c, &v, &neg)) != OK) return r;
        if (neg || v == 0 || v > (uint64_t)L->max_block_size) return DECLINE;
        e->block_size = (long long)v;
        return OK;
    case F_LORA_ID:
        if (is_nil(c)) { c->p += 1; return OK; }
        if ((r = read_int(c, &v, &neg)) != OK) return r;
        e->lora_id = neg ? PyLong_FromLongLong((long long)v) : PyLong_FromUnsignedLongLong(v);
        return e->lora_id == NULL ? ERR : OK;
    case F_LORA_NAME:
        if (is_nil(c)) { c->p += 1; return OK; }
        {
            const char *s;
            Py_ssize_t n;
            if ((r = read_str(c, &s, &n)) != OK) return r;
            return str_object(s, n, &e->lora_name);
        }
    case F_EXTRA: return read_extra(c, e);
    }
    return DECLINE;
}

/* The value of "type": the kind, or DECLINE for another type or a non-str. */
static int read_kind(Cur *c, int *kind) {
    const char *s;
    Py_ssize_t n;
    int r;
    if ((r = read_str(c, &s, &n)) != OK) return r;
    if (key_is(s, n, "BlockStored")) *kind = EV_STORED;
    else if (key_is(s, n, "BlockRemoved")) *kind = EV_REMOVED;
    else if (key_is(s, n, "AllBlocksCleared")) *kind = EV_CLEARED;
    else return DECLINE;
    return OK;
}

/* One event map. Its "type" may come anywhere: the fields before it are read for a BlockStored (the widest set)
 * and the map is read again once the kind is known. */
static int read_event(Cur *c, Limits *L, Ev *e) {
    Py_ssize_t n;
    int r;
    if ((r = container(c, 1, &n)) != OK) return r; /* positional arrays (vLLM <= 0.23): Python's way */
    const unsigned char *fields = c->p;
    /* find the type first (the engines write it first: one pass) */
    e->kind = EV_NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *k;
        Py_ssize_t kn;
        if ((r = read_str(c, &k, &kn)) != OK) return r; /* non-str keys: Python's way */
        if (key_is(k, kn, "type")) {
            if (e->kind != EV_NONE) return DECLINE;
            if ((r = read_kind(c, &e->kind)) != OK) return r;
        } else if ((r = skip(c, 0)) != OK) {
            return r;
        }
        if (i == 0 && e->kind != EV_NONE) break; /* the common case: type first, read the rest below */
    }
    if (e->kind == EV_NONE) return DECLINE;
    int seen = F_TYPE;
    Py_ssize_t start = 1;
    if (fields[0] != 0xa4 || memcmp(fields + 1, "type", 4) != 0) {
        c->p = fields; /* the type was not first: read every field again now that the kind is known */
        start = 0;
    }
    for (Py_ssize_t i = start; i < n; i++) {
        const char *k;
        Py_ssize_t kn;
        if ((r = read_str(c, &k, &kn)) != OK) return r;
        if (key_is(k, kn, "type")) {
            /* after a first "type" another one is a repeat (the last would win in Python): declined; from the
             * top again, it is the one the first pass read (that pass declined repeats) */
            if (start == 1) return DECLINE;
            if ((r = skip(c, 0)) != OK) return r;
            continue;
        }
        if ((r = read_field(c, L, e, k, kn, &seen)) != OK) return r;
    }
    if (e->kind == EV_CLEARED) return OK;
    if (!(seen & F_HASHES)) return DECLINE;
    if (e->medium == NULL) e->medium = L->no_medium;
    if (e->kind == EV_REMOVED) return OK;
    if (!(seen & F_TOKENS) || !(seen & F_BLOCK_SIZE)) return DECLINE;
    Py_ssize_t pages = PyList_GET_SIZE(e->hashes);
    if (e->n_tokens != pages * e->block_size) return DECLINE;
    if (e->extra_pages >= 0 && e->extra_pages != pages) return DECLINE;
    if (e->extra_str != NULL) { /* pages keyed by the adapter's name: only lora_name's (else Python's way) */
        Py_ssize_t len;
        const char *name = e->lora_name ? PyUnicode_AsUTF8AndSize(e->lora_name, &len) : NULL;
        if (name == NULL) { PyErr_Clear(); return DECLINE; }
        if (len != e->extra_len || memcmp(name, e->extra_str, (size_t)len) != 0) return DECLINE;
    }
    return OK;
}

/* The finished removal run (hashes, medium entry, count) as its tuple, appended to events. */
static int flush_run(PyObject *events, PyObject **hashes, PyObject *medium, Py_ssize_t count) {
    if (*hashes == NULL) return OK;
    PyObject *t = Py_BuildValue("(iOOOn)", EV_REMOVED, *hashes, PyTuple_GET_ITEM(medium, 0),
                                PyTuple_GET_ITEM(medium, 1), count);
    Py_CLEAR(*hashes);
    if (t == NULL) return ERR;
    int r = PyList_Append(events, t);
    Py_DECREF(t);
    return r < 0 ? ERR : OK;
}

static int append_stored(PyObject *events, Ev *e) {
    PyObject *t = Py_BuildValue("(iOOOLOOOO)", EV_STORED, e->hashes, e->parent ? e->parent : Py_None, e->tokens,
                                e->block_size, PyTuple_GET_ITEM(e->medium, 0), PyTuple_GET_ITEM(e->medium, 1),
                                e->lora_name ? e->lora_name : Py_None, e->lora_id ? e->lora_id : Py_None);
    if (t == NULL) return ERR;
    int r = PyList_Append(events, t);
    Py_DECREF(t);
    return r < 0 ? ERR : OK;
}

/* A top-level scalar (ts, rank): nil -> None, int or float -> its value, anything else DECLINE. */
static int read_scalar(Cur *c, PyObject **out) {
    if (need(c, 1)) return DECLINE;
    unsigned char b = *c->p;
    if (b == 0xc0) { c->p += 1; *out = Py_NewRef(Py_None); return OK; }
    if (b == 0xcb || b == 0xca) {
        if (need(c, b == 0xcb ? 9 : 5)) return DECLINE;
        double d;
        if (b == 0xcb) {
            uint64_t u = be(c->p + 1, 8);
            memcpy(&d, &u, 8);
            c->p += 9;
        } else {
            uint32_t u = (uint32_t)be(c->p + 1, 4);
            float f;
            memcpy(&f, &u, 4);
            d = f;
            c->p += 5;
        }
        *out = PyFloat_FromDouble(d);
        return *out == NULL ? ERR : OK;
    }
    uint64_t v;
    int neg, r;
    if ((r = read_int(c, &v, &neg)) != OK) return r;
    *out = neg ? PyLong_FromLongLong((long long)v) : PyLong_FromUnsignedLongLong(v);
    return *out == NULL ? ERR : OK;
}

static int read_events(Cur *c, Limits *L, PyObject *events) {
    Py_ssize_t n;
    int r;
    if ((r = container(c, 0, &n)) != OK) return r;
    if (n > L->max_events) return DECLINE;
    long long cost = 0;
    PyObject *run = NULL;     /* hashes of the current removal run (owned) */
    PyObject *run_medium = NULL; /* its (key, tier), borrowed */
    Py_ssize_t run_count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ev e = {EV_NONE, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, -1, NULL, 0};
        if ((r = read_event(c, L, &e)) != OK) goto fail;
        if (e.kind == EV_REMOVED) {
            Py_ssize_t k = PyList_GET_SIZE(e.hashes);
            cost += (long long)HASH_COST * k;
            if (run != NULL && e.medium == run_medium) {
                if (k == 1 ? PyList_Append(run, PyList_GET_ITEM(e.hashes, 0)) < 0
                           : PyList_SetSlice(run, PyList_GET_SIZE(run), PyList_GET_SIZE(run), e.hashes) < 0) {
                    r = ERR;
                    goto fail;
                }
                run_count += 1;
            } else {
                if ((r = flush_run(events, &run, run_medium, run_count)) != OK) goto fail;
                run = Py_NewRef(e.hashes);
                run_medium = e.medium;
                run_count = 1;
                cost += EVENT_COST;
            }
        } else {
            if ((r = flush_run(events, &run, run_medium, run_count)) != OK) goto fail;
            if (e.kind == EV_STORED) {
                cost += EVENT_COST + (long long)HASH_COST * PyList_GET_SIZE(e.hashes) + (long long)TOKEN_COST * e.n_tokens;
                if ((r = append_stored(events, &e)) != OK) goto fail;
            } else {
                cost += EVENT_COST;
                PyObject *t = Py_BuildValue("(i)", EV_CLEARED);
                if (t == NULL || PyList_Append(events, t) < 0) { Py_XDECREF(t); r = ERR; goto fail; }
                Py_DECREF(t);
            }
        }
        ev_clear(&e);
        if (cost > L->max_cost) { Py_XDECREF(run); return DECLINE; }
        continue;
    fail:
        ev_clear(&e);
        Py_XDECREF(run);
        return r;
    }
    return flush_run(events, &run, run_medium, run_count);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Limits L;
    PyObject *group;
    Py_ssize_t most;
    if (!PyArg_ParseTuple(args, "y*nnnnnOO!O!L", &buf, &most, &L.max_events, &L.max_hashes, &L.max_tokens,
                          &L.max_block_size, &group, &PyDict_Type, &L.media, &PyTuple_Type, &L.no_medium,
                          &L.max_cost))
        return NULL;
    PyObject *result = NULL, *ts = NULL, *rank = NULL, *events = NULL;
    int r = DECLINE;
    if (PyTuple_GET_SIZE(L.no_medium) != 2) goto done;
    L.last_medium = NULL;
    L.last_medium_len = 0;
    L.last_entry = NULL;
    L.has_group = group != Py_None;
    L.group_idx = 0;
    if (L.has_group) {
        if (!PyLong_Check(group)) goto done;
        int overflow;
        L.group_idx = PyLong_AsLongLongAndOverflow(group, &overflow);
        if (overflow || (L.group_idx == -1 && PyErr_Occurred())) { PyErr_Clear(); goto done; }
    }
    Cur c = {(const unsigned char *)buf.buf, (const unsigned char *)buf.buf + buf.len, most};
    Py_ssize_t n;
    if ((r = container(&c, 0, &n)) != OK) goto done;
    if (n < 2) { r = DECLINE; goto done; }
    if ((r = read_scalar(&c, &ts)) != OK) goto done;
    events = PyList_New(0);
    if (events == NULL) { r = ERR; goto done; }
    if ((r = read_events(&c, &L, events)) != OK) goto done;
    if (n > 2) {
        if ((r = read_scalar(&c, &rank)) != OK) goto done;
        for (Py_ssize_t i = 3; i < n; i++)
            if ((r = skip(&c, 0)) != OK) goto done;
    } else {
        rank = Py_NewRef(Py_None);
    }
    if (c.p != c.end) { r = DECLINE; goto done; } /* trailing bytes: Python's way (bad_msgpack) */
    result = PyTuple_Pack(3, ts, events, rank);
    if (result == NULL) r = ERR;
done:
    Py_XDECREF(ts);
    Py_XDECREF(rank);
    Py_XDECREF(events);
    PyBuffer_Release(&buf);
    if (r == ERR) { Py_XDECREF(result); return NULL; }
    if (r == DECLINE) Py_RETURN_NONE;
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(payload, most, max_events, max_hashes, max_tokens, max_block_size, group_idx, media, no_medium, "
     "max_cost) -> (ts, events, rank) | None\n\nThe common form of a KV-event batch (module docstring of "
     "membership/kv_native.c); None: not that form, the Python decoder decides."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kv_native",
    "The common form of an engine KV-event batch decoded in C (membership/kv_decode.py uses it when built).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_kv_native(void) { return PyModule_Create(&module); }
