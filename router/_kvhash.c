/* Chained content keys of KV blocks for the router's KV index (router/kvindex.py), compiled.

   chain(key, tokens, block_size, n) -> list of n ints, or None when `tokens` holds fewer than
   block_size * n token ids. `tokens` is a list of ints (a prompt) or a buffer holding one msgpack
   array of ints (a BlockStored event's token_ids, decoded as msgspec.Raw): both give the same keys,
   so events are keyed without making a Python int of every token id, the cost that held the pure
   Python index at 0.5-0.8M block events/s.

   Block i's key mixes the previous key with its token ids in order (xxHash64's round and
   avalanche): it depends on every token of the prefix and on their order. Keys are used only
   inside one router process; they never need to match anything else. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define P1 11400714785074694791ULL
#define P2 14029467366897019727ULL
#define P3 1609587929392839161ULL
#define P5 2870177450012600261ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t round_(uint64_t acc, uint64_t t) { return rotl(acc + t * P2, 31) * P1; }

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    return h;
}

/* msgpack: the array header at *p; -1 if it is not an array. */
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

/* msgspec/msgpack int at *p as the 64-bit pattern of its value; 0 on success, -1 if not an int. */
static inline int read_int(const unsigned char **p, const unsigned char *end, uint64_t *out) {
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

static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *key_obj, *tokens;
    Py_ssize_t bs, n;
    if (!PyArg_ParseTuple(args, "OOnn", &key_obj, &tokens, &bs, &n)) return NULL;
    if (bs < 1 || n < 0) { PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and n >= 0"); return NULL; }
    uint64_t key = PyLong_AsUnsignedLongLongMask(key_obj);
    if (key == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    if (!PyObject_CheckBuffer(tokens)) {  /* a list (or tuple) of ints */
        PyObject *seq = PySequence_Fast(tokens, "tokens: a list of ints or a buffer of msgpack");
        if (seq == NULL) { Py_DECREF(out); return NULL; }
        if (PySequence_Fast_GET_SIZE(seq) < bs * n) { Py_DECREF(seq); Py_DECREF(out); Py_RETURN_NONE; }
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t b = 0; b < n; b++) {
            uint64_t acc = key + P5 + (uint64_t)bs;
            for (Py_ssize_t i = b * bs; i < (b + 1) * bs; i++) {
                uint64_t t = PyLong_AsUnsignedLongLongMask(items[i]);
                if (t == (uint64_t)-1 && PyErr_Occurred()) { Py_DECREF(seq); Py_DECREF(out); return NULL; }
                acc = round_(acc, t);
            }
            key = avalanche(acc);
            PyList_SET_ITEM(out, b, PyLong_FromLongLong((long long)(int64_t)key));
        }
        Py_DECREF(seq);
        return out;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) { Py_DECREF(out); return NULL; }
    const unsigned char *p = view.buf, *end = p + view.len;
    Py_ssize_t count = array_len(&p, end);
    if (count < 0) {
        PyBuffer_Release(&view); Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError, "tokens: not a msgpack array");
        return NULL;
    }
    if (count < bs * n) { PyBuffer_Release(&view); Py_DECREF(out); Py_RETURN_NONE; }
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t acc = key + P5 + (uint64_t)bs;
        for (Py_ssize_t i = 0; i < bs; i++) {
            uint64_t t;
            if (read_int(&p, end, &t) < 0) {
                PyBuffer_Release(&view); Py_DECREF(out);
                PyErr_SetString(PyExc_ValueError, "tokens: a msgpack array item is not an integer");
                return NULL;
            }
            acc = round_(acc, t);
        }
        key = avalanche(acc);
        PyList_SET_ITEM(out, b, PyLong_FromLongLong((long long)(int64_t)key));
    }
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(key, tokens, block_size, n): chained keys of the first n full blocks of tokens (a list of ints "
     "or a msgpack array of ints in a buffer); None when there are fewer than block_size * n tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kvhash(void) { return PyModule_Create(&module); }
