/* The router's chained prefix keys (replica/api/identity.py says why they are so):
 *
 *   keys[0] = XXH3_64(chunk 0, seed)
 *   keys[i] = XXH3_64(le64(XXH3_64(chunk i)), seed = keys[i - 1])
 *
 * the same numbers as identity.py's Python loop (tests/replica/api/test_identity.py
 * checks it), in one call instead of one per 64-token chunk: a 240k-token prompt in
 * about 0.1 ms instead of 1.5 ms. xxHash is vendored (BSD-2, vendor/xxhash).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h"

static XXH64_hash_t next_key(XXH64_hash_t key, const char *chunk, size_t size, int first) {
    if (first)
        return XXH3_64bits_withSeed(chunk, size, key);
    /* little-endian, as Python's int.to_bytes(8, "little") */
    XXH64_hash_t link = XXH3_64bits(chunk, size);
    unsigned char bytes[8];
    for (int i = 0; i < 8; i++)
        bytes[i] = (unsigned char)(link >> (8 * i));
    return XXH3_64bits_withSeed(bytes, 8, key);
}

static PyObject *py_next_key(PyObject *self, PyObject *args) {
    unsigned long long key;
    Py_buffer chunk;
    int first;
    if (!PyArg_ParseTuple(args, "Ky*p", &key, &chunk, &first))
        return NULL;
    XXH64_hash_t next = next_key((XXH64_hash_t)key, (const char *)chunk.buf, (size_t)chunk.len, first);
    PyBuffer_Release(&chunk);
    return PyLong_FromUnsignedLongLong(next);
}

static PyObject *prefix_keys(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t step;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*nK", &data, &step, &seed))
        return NULL;
    if (step < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "the chunk must be at least one byte");
        return NULL;
    }
    Py_ssize_t count = data.len / step;
    PyObject *keys = PyList_New(count);
    if (keys == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *bytes = (const char *)data.buf;
    XXH64_hash_t key = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < count; i++) {
        key = next_key(key, bytes + i * step, (size_t)step, i == 0);
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_DECREF(keys);
            PyBuffer_Release(&data);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, value);
    }
    PyBuffer_Release(&data);
    return keys;
}

static PyMethodDef methods[] = {
    {"prefix_keys", prefix_keys, METH_VARARGS,
     "prefix_keys(data, chunk_bytes, seed) -> the chained key of every full chunk"},
    {"next_key", py_next_key, METH_VARARGS,
     "next_key(key, chunk, first) -> the key after key over chunk (first: key is the seed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_keys", "Chained prefix keys in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_keys(void) { return PyModule_Create(&module); }
