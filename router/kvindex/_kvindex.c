/* The router's KV index (router/kvindex/__init__.py), its hot part compiled.

   chain(key, tokens, block_size, n) -> list of n ints, or None when `tokens` holds fewer than
   block_size * n token ids. `tokens` is a list of ints (a prompt) or a buffer holding one msgpack
   array of ints (a BlockStored event's token_ids, decoded as msgspec.Raw): both give the same keys,
   so events are keyed without making a Python int of every token id.

   Block i's key mixes the previous key with its token ids in order (xxHash64's round and
   avalanche): it depends on every token of the prefix and on their order. Keys are used only
   inside one router process; they never need to match anything else.

   Blocks(): one source's blocks, {engine hash: content key} and a count of blocks per content
   key, in two open-addressing tables of 64-bit words. An event's keys go from its token bytes into
   the tables with no Python object per block: Python dicts and sets of ints held the index near
   1M block events/s on 2 shared cores, a third of it spent on those objects and their inserts.
   Engine hashes are ints (taken as their 64-bit pattern: vLLM's are 64-bit, SGLang's signed 64-bit)
   or bytes (hashed to 64 bits). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P4 9650029242287828579ULL
#define P5 2870177450012600261ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t round_(uint64_t acc, uint64_t t) { return rotl(acc + t * P2, 31) * P1; }

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    return h;
}

/* ---- msgpack ---------------------------------------------------------------------------- */

/* The array header at *p; -1 if it is not an array. */
static Py_ssize_t array_len(const unsigned char **p, const unsigned char *end) {
    const unsigned char *s = *p;
    if (s >= end) return -1;
    if ((*s & 0xf0) == 0x90) { *p = s + 1; return *s & 0x0f; }
    if (*s == 0xdc && end - s >= 3) { *p = s + 3; return (s[1] << 8) | s[2]; }
    if (*s == 0xdd && end - s >= 5) {
        *p = s + 5;
        return (Py_ssize_t)(((uint32_t)s[1] << 24) | ((uint32_t)s[2] << 16) | ((uint32_t)s[3] << 8) | s[4]);
    }
    return -1;
}

static inline uint64_t be(const unsigned char *s, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | s[i];
    return v;
}

/* The int at *p as the 64-bit pattern of its value; 0 on success, -1 if not an int. */
static int read_int_any(const unsigned char **p, const unsigned char *end, uint64_t *out) {
    const unsigned char *s = *p;
    if (s >= end) return -1;
    unsigned char c = *s;
    if (c <= 0x7f) { *out = c; *p = s + 1; return 0; }
    if (c >= 0xe0) { *out = (uint64_t)(int64_t)(int8_t)c; *p = s + 1; return 0; }
    int n;
    switch (c) {
        case 0xcc: case 0xd0: n = 1; break;
        case 0xcd: case 0xd1: n = 2; break;
        case 0xce: case 0xd2: n = 4; break;
        case 0xcf: case 0xd3: n = 8; break;
        default: return -1;
    }
    if (end - s < 1 + n) return -1;
    uint64_t v = be(s + 1, n);
    if (c >= 0xd0 && n < 8) {  /* signed: extend the sign bit */
        int shift = 64 - 8 * n;
        v = (uint64_t)(((int64_t)(v << shift)) >> shift);
    }
    *out = v;
    *p = s + 1 + n;
    return 0;
}

/* The same, with token ids' usual widths first. Their fixed steps let the CPU run ahead to the
   next id on a predicted branch; a width looked up from the tag byte makes every id wait for the
   last (3x slower on 4-byte ids). */
static inline int read_int(const unsigned char **p, const unsigned char *end, uint64_t *out) {
    const unsigned char *s = *p;
    if (end - s >= 5) {
        unsigned char c = *s;
        if (c <= 0x7f) { *out = c; *p = s + 1; return 0; }
        if (c == 0xcd) { *out = be(s + 1, 2); *p = s + 3; return 0; }
        if (c == 0xce) { *out = be(s + 1, 4); *p = s + 5; return 0; }
    }
    return read_int_any(p, end, out);
}

/* ---- keys ------------------------------------------------------------------------------- */

/* Scratch for n words: `local` (the caller's stack) when they fit, else the heap. */
#define LOCAL_WORDS 512
static uint64_t *scratch(uint64_t *local, Py_ssize_t n) {
    if (n <= LOCAL_WORDS) return local;
    uint64_t *w = malloc(sizeof(uint64_t) * (size_t)n);
    if (w == NULL) PyErr_NoMemory();
    return w;
}

static void scratch_free(uint64_t *w, const uint64_t *local) {
    if (w != local) free(w);
}

/* The first `need` token ids of `tokens` into buf: 1, or 0 when there are fewer, or -1 with an
   exception set. */
static int read_tokens(PyObject *tokens, Py_ssize_t need, uint64_t *buf) {
    if (!PyObject_CheckBuffer(tokens)) {  /* a list (or tuple) of ints */
        PyObject *seq = PySequence_Fast(tokens, "tokens: a list of ints or a buffer of msgpack");
        if (seq == NULL) return -1;
        int ok = PySequence_Fast_GET_SIZE(seq) >= need;
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = 0; ok && i < need; i++) {
            buf[i] = PyLong_AsUnsignedLongLongMask(items[i]);
            if (buf[i] == (uint64_t)-1 && PyErr_Occurred()) ok = -1;
        }
        Py_DECREF(seq);
        return ok;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) return -1;
    const unsigned char *p = view.buf, *end = p + view.len;
    Py_ssize_t count = array_len(&p, end);
    int ok = count >= need;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "tokens: not a msgpack array");
        ok = -1;
    }
    for (Py_ssize_t i = 0; ok == 1 && i < need; i++) {
        if (read_int(&p, end, &buf[i]) < 0) {
            PyErr_SetString(PyExc_ValueError, "tokens: a msgpack array item is not an integer");
            ok = -1;
        }
    }
    PyBuffer_Release(&view);
    return ok;
}

/* One block's key: xxHash64's four lanes over its token ids as 64-bit words, seeded with the key
   of the block before. Four independent lanes, not one chain of rounds: the multiplies overlap. */
static inline uint64_t block_key(uint64_t seed, const uint64_t *t, Py_ssize_t bs) {
    uint64_t v0 = seed + P1 + P2, v1 = seed + P2, v2 = seed, v3 = seed - P1;
    Py_ssize_t i = 0;
    for (; i + 4 <= bs; i += 4) {
        v0 = round_(v0, t[i]); v1 = round_(v1, t[i + 1]); v2 = round_(v2, t[i + 2]); v3 = round_(v3, t[i + 3]);
    }
    for (; i < bs; i++) v0 = round_(v0, t[i]);  /* a block size that is not a multiple of 4 */
    uint64_t h = rotl(v0, 1) + rotl(v1, 7) + rotl(v2, 12) + rotl(v3, 18);
    h = (h ^ round_(0, v0)) * P1 + P4;
    h = (h ^ round_(0, v1)) * P1 + P4;
    h = (h ^ round_(0, v2)) * P1 + P4;
    h = (h ^ round_(0, v3)) * P1 + P4;
    return avalanche(h + (uint64_t)bs);
}

/* The keys of the first n blocks of `tokens` after `key` into out[n]: 1, or 0 when there are
   fewer than bs * n token ids, or -1 with an exception set. */
static int keys_into(uint64_t key, PyObject *tokens, Py_ssize_t bs, Py_ssize_t n, uint64_t *out) {
    if (n && bs > PY_SSIZE_T_MAX / 8 / n) return 0;  /* more ids than any buffer holds */
    uint64_t local[LOCAL_WORDS], *buf = scratch(local, bs * n);
    if (buf == NULL) return -1;
    int ok = read_tokens(tokens, bs * n, buf);
    for (Py_ssize_t b = 0; ok == 1 && b < n; b++) out[b] = key = block_key(key, buf + b * bs, bs);
    scratch_free(buf, local);
    return ok;
}

static int check_sizes(Py_ssize_t bs, Py_ssize_t n) {
    if (bs >= 1 && n >= 0) return 0;
    PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and n >= 0");
    return -1;
}

static PyObject *chain(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *key_obj, *tokens;
    Py_ssize_t bs, n;
    if (!PyArg_ParseTuple(args, "OOnn", &key_obj, &tokens, &bs, &n) || check_sizes(bs, n) < 0) return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(key_obj);
    if (key == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t local[LOCAL_WORDS], *keys = scratch(local, n);
    if (keys == NULL) return NULL;
    PyObject *out = NULL;
    int ok = keys_into(key, tokens, bs, n, keys);
    if (ok == 0) {
        out = Py_NewRef(Py_None);
    } else if (ok == 1 && (out = PyList_New(n)) != NULL) {
        for (Py_ssize_t b = 0; b < n; b++) {
            PyObject *k = PyLong_FromLongLong((long long)(int64_t)keys[b]);
            if (k == NULL) { Py_CLEAR(out); break; }
            PyList_SET_ITEM(out, b, k);
        }
    }
    scratch_free(keys, local);
    return out;
}

/* ---- a table of 64-bit words: linear probing, deletion by backward shift (no tombstones) ----
   A slot is its key and its value side by side (one cache line per probe); key 0 marks an empty
   slot, so a real key 0 lives apart, in `zero`. */

typedef struct {
    uint64_t *kv;   /* key, value, key, value, ... */
    size_t cap;     /* slots: a power of two, or 0 */
    size_t len;     /* keys held, key 0 included */
    int shift;      /* 64 - log2(cap) */
    int has_zero;
    uint64_t zero;  /* the value of key 0 */
} Table;

static inline size_t home(const Table *t, uint64_t k) { return (size_t)((k * P1) >> t->shift); }

/* The slot of key k != 0: where it is, or the empty slot where it would go. */
static inline size_t find(const Table *t, uint64_t k) {
    size_t mask = t->cap - 1, i = home(t, k);
    while (t->kv[2 * i] != 0 && t->kv[2 * i] != k) i = (i + 1) & mask;
    return i;
}

static int resize(Table *t, size_t cap) {
    uint64_t *kv = calloc(2 * cap, sizeof(uint64_t));
    if (kv == NULL) { PyErr_NoMemory(); return -1; }
    uint64_t *old = t->kv;
    size_t old_cap = t->cap;
    t->kv = kv; t->cap = cap; t->shift = 64;
    for (size_t c = cap; c > 1; c >>= 1) t->shift--;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[2 * i] == 0) continue;
        size_t at = find(t, old[2 * i]);
        kv[2 * at] = old[2 * i];
        kv[2 * at + 1] = old[2 * i + 1];
    }
    free(old);
    return 0;
}

static void table_free(Table *t) {
    free(t->kv);
    memset(t, 0, sizeof(*t));
}

/* Where k's value is; NULL when k is absent. */
static uint64_t *table_get(Table *t, uint64_t k) {
    if (k == 0) return t->has_zero ? &t->zero : NULL;
    if (t->cap == 0) return NULL;
    size_t at = find(t, k);
    return t->kv[2 * at] ? &t->kv[2 * at + 1] : NULL;
}

/* Room for `len` keys without a resize (table_put's addresses stay valid); -1 when out of memory. */
static int table_reserve(Table *t, size_t len) {
    size_t cap = t->cap ? t->cap : 64;
    while (len * 4 > cap * 3) cap *= 2;
    return cap == t->cap ? 0 : resize(t, cap);
}

/* Start loading the slot where k's probe begins. */
static inline void table_prefetch(const Table *t, uint64_t k) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&t->kv[2 * home(t, k)], 1);
#endif
}

/* Where k's value is, k inserted with value 0 if new (*fresh = 1); NULL when out of memory. */
static uint64_t *table_put(Table *t, uint64_t k, int *fresh) {
    if (k == 0) {
        *fresh = !t->has_zero;
        if (*fresh) { t->has_zero = 1; t->zero = 0; t->len++; }
        return &t->zero;
    }
    if ((t->len + 1) * 4 > t->cap * 3 && resize(t, t->cap ? t->cap * 2 : 64) < 0) return NULL;
    size_t at = find(t, k);
    *fresh = t->kv[2 * at] == 0;
    if (*fresh) {
        t->kv[2 * at] = k;
        t->kv[2 * at + 1] = 0;
        t->len++;
    }
    return &t->kv[2 * at + 1];
}

/* Remove k; 1 with its value in *v, or 0 if it was absent. */
static int table_pop(Table *t, uint64_t k, uint64_t *v) {
    if (k == 0) {
        if (!t->has_zero) return 0;
        *v = t->zero; t->has_zero = 0; t->len--;
        return 1;
    }
    if (t->cap == 0) return 0;
    size_t mask = t->cap - 1, i = find(t, k), j = i;
    if (t->kv[2 * i] == 0) return 0;
    *v = t->kv[2 * i + 1];
    t->kv[2 * i] = 0;
    t->len--;
    for (;;) {  /* pull later entries of the run back over the hole when their home allows it */
        j = (j + 1) & mask;
        if (t->kv[2 * j] == 0) return 1;
        size_t h = home(t, t->kv[2 * j]);
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays) continue;
        t->kv[2 * i] = t->kv[2 * j];
        t->kv[2 * i + 1] = t->kv[2 * j + 1];
        t->kv[2 * j] = 0;
        i = j;
    }
}

/* ---- Blocks --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Table key;   /* engine hash -> content key */
    Table held;  /* content key -> blocks with that key */
} Blocks;

/* An engine hash as 64 bits: 1, or 0 if it is neither int nor bytes (no exception set), -1 on error. */
static int hash_of(PyObject *h, uint64_t *out) {
    if (PyLong_Check(h)) {
        *out = PyLong_AsUnsignedLongLongMask(h);
        return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 1;
    }
    if (PyBytes_Check(h)) {  /* a digest (vLLM's bytes hashes): its 8-byte words through the rounds */
        const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(h);
        Py_ssize_t n = PyBytes_GET_SIZE(h), i = 0;
        uint64_t acc = P5 + (uint64_t)n;
        for (; i + 8 <= n; i += 8) { uint64_t w; memcpy(&w, s + i, 8); acc = round_(acc, w); }
        for (; i < n; i++) acc = round_(acc, s[i]);
        *out = avalanche(acc);
        return 1;
    }
    return 0;
}

static void unhold(Blocks *b, uint64_t k) {
    uint64_t *count = table_get(&b->held, k), gone;
    if (count != NULL && --*count == 0) table_pop(&b->held, k, &gone);
}

static PyObject *Blocks_store(Blocks *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[1])) {  /* called once per event: no argument parser */
        PyErr_SetString(PyExc_TypeError, "store(base, hashes: list, tokens, block_size)");
        return NULL;
    }
    PyObject *hashes = args[1], *tokens = args[2];
    Py_ssize_t n = PyList_GET_SIZE(hashes), bs = PyLong_AsSsize_t(args[3]);
    if ((bs == -1 && PyErr_Occurred()) || check_sizes(bs, n) < 0) return NULL;
    uint64_t base = PyLong_AsUnsignedLongLongMask(args[0]);
    if (base == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t local[LOCAL_WORDS], *w = scratch(local, 2 * n);  /* hashes, then keys */
    if (w == NULL) return NULL;
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = hash_of(PyList_GET_ITEM(hashes, i), &w[i]);
        if (r <= 0) {
            if (r == 0) PyErr_SetString(PyExc_TypeError, "block_hashes: a hash is neither an int nor bytes");
            goto done;
        }
    }
    int ok = keys_into(base, tokens, bs, n, w + n);
    if (ok < 0) goto done;
    if (ok == 0) { result = Py_NewRef(Py_False); goto done; }
    if (table_reserve(&self->key, self->key.len + n) < 0 || table_reserve(&self->held, self->held.len + n) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {  /* the slots are scattered: ask for all of them at once */
        table_prefetch(&self->key, w[i]);
        table_prefetch(&self->held, w[n + i]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int fresh;
        uint64_t *v = table_put(&self->key, w[i], &fresh), k = w[n + i];
        if (v == NULL) goto done;
        if (!fresh) {
            if (*v == k) continue;  /* stored again (a replay): nothing changes */
            unhold(self, *v);
        }
        *v = k;
        uint64_t *count = table_put(&self->held, k, &fresh);
        if (count == NULL) goto done;
        ++*count;
    }
    result = Py_NewRef(Py_True);
done:
    scratch_free(w, local);
    return result;
}

static PyObject *Blocks_key(Blocks *self, PyObject *h) {
    uint64_t hv, *k;
    int r = hash_of(h, &hv);
    if (r < 0) return NULL;
    if (r == 0 || (k = table_get(&self->key, hv)) == NULL) Py_RETURN_NONE;
    return PyLong_FromLongLong((long long)(int64_t)*k);
}

static PyObject *Blocks_remove(Blocks *self, PyObject *hashes) {
    PyObject *seq = PySequence_Fast(hashes, "block_hashes: a list");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), gone = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t hv, k;
        int r = hash_of(items[i], &hv);
        if (r < 0) { Py_DECREF(seq); return NULL; }
        if (r == 0 || !table_pop(&self->key, hv, &k)) continue;  /* a block we never held */
        unhold(self, k);
        gone++;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(gone);
}

static PyObject *Blocks_held(Blocks *self, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys: a list of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; i < n; i++) {
        uint64_t k = PyLong_AsUnsignedLongLongMask(items[i]);
        if (k == (uint64_t)-1 && PyErr_Occurred()) { Py_DECREF(seq); return NULL; }
        if (table_get(&self->held, k) == NULL) break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

static PyObject *Blocks_clear(Blocks *self, PyObject *Py_UNUSED(ignored)) {
    table_free(&self->key);
    table_free(&self->held);
    Py_RETURN_NONE;
}

static Py_ssize_t Blocks_len(Blocks *self) { return (Py_ssize_t)self->key.len; }

static void Blocks_dealloc(Blocks *self) {
    table_free(&self->key);
    table_free(&self->held);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Blocks_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Blocks() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);  /* zeroed: empty tables */
}

static PyMethodDef Blocks_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Blocks_store, METH_FASTCALL,
     "store(base, hashes, tokens, block_size) -> bool: key the blocks `hashes` (a list) from their token ids "
     "after the block keyed `base` and hold them; False (nothing stored) when there are fewer token ids than "
     "blocks. TypeError for a hash that is neither int nor bytes, ValueError for token ids that are not ints."},
    {"key", (PyCFunction)Blocks_key, METH_O, "key(hash) -> the content key of a held block, or None."},
    {"remove", (PyCFunction)Blocks_remove, METH_O, "remove(hashes) -> how many of these blocks were held."},
    {"held", (PyCFunction)Blocks_held, METH_O, "held(keys) -> how many of `keys`, from the first, are held."},
    {"clear", (PyCFunction)Blocks_clear, METH_NOARGS, "Forget every block."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Blocks_seq = {.sq_length = (lenfunc)Blocks_len};

static PyTypeObject BlocksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pdsdk.router.kvindex._kvindex.Blocks",
    .tp_doc = "One source's blocks: {engine hash: content key} and the content keys held.",
    .tp_basicsize = sizeof(Blocks),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Blocks_new,
    .tp_dealloc = (destructor)Blocks_dealloc,
    .tp_methods = Blocks_methods,
    .tp_as_sequence = &Blocks_seq,
};

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(key, tokens, block_size, n): chained keys of the first n full blocks of tokens (a list of ints "
     "or a msgpack array of ints in a buffer); None when there are fewer than block_size * n tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvindex", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvindex(void) {
    if (PyType_Ready(&BlocksType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Blocks", (PyObject *)&BlocksType) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
