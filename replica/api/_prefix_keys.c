/* The router's prefix keys (replica/api/identity.py says why they are so): a chain
 * over every block (chain_key.h), of which every stride-th link is a key,
 *
 *   link[0] = chain_key(seed, block 0),  link[b] = chain_key(link[b - 1], block b)
 *   keys[i] = link[(i + 1) * stride - 1]
 *
 * the same numbers as identity.py's Python loop (tests/replica/api/test_identity.py
 * checks it), in one call instead of one per block: a 240k-token prompt in about
 * 0.2 ms. xxHash is vendored (BSD-2, vendor/xxhash).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "chain_key.h"

static PyObject *py_next_key(PyObject *self, PyObject *args) {
    unsigned long long key;
    Py_buffer block;
    if (!PyArg_ParseTuple(args, "Ky*", &key, &block))
        return NULL;
    XXH64_hash_t next = chain_key((XXH64_hash_t)key, (const char *)block.buf, (size_t)block.len);
    PyBuffer_Release(&block);
    return PyLong_FromUnsignedLongLong(next);
}

static PyObject *prefix_keys(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t step, stride;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*nnK", &data, &step, &stride, &seed))
        return NULL;
    if (step < 1 || stride < 1) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "a block must be at least one byte, a stride one block");
        return NULL;
    }
    Py_ssize_t count = data.len / step / stride;
    PyObject *keys = PyList_New(count);
    if (keys == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *bytes = (const char *)data.buf;
    XXH64_hash_t key = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < count; i++) {
        for (Py_ssize_t b = i * stride; b < (i + 1) * stride; b++)
            key = chain_key(key, bytes + b * step, (size_t)step);
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

/* prefix_keys_after(data, block_bytes, stride, seed, old_data, old_keys) -> (keys, kept):
 * prefix_keys of ``data``, given an earlier prompt's bytes and keys (under the same seed and
 * sizes): the strides both prompts hold byte for byte keep the earlier keys (the same
 * int objects), the chain goes on from the last of them. One memcmp, then hashing in
 * proportion to what is new. */
static PyObject *prefix_keys_after(PyObject *self, PyObject *args) {
    Py_buffer data, old;
    Py_ssize_t step, stride;
    unsigned long long seed;
    PyObject *old_keys;
    if (!PyArg_ParseTuple(args, "y*nnKy*O!", &data, &step, &stride, &seed, &old, &PyList_Type,
                          &old_keys))
        return NULL;
    PyObject *keys = NULL;
    if (step < 1 || stride < 1) {
        PyErr_SetString(PyExc_ValueError, "a block must be at least one byte, a stride one block");
        goto done;
    }
    Py_ssize_t chunk = step * stride, count = data.len / chunk;
    Py_ssize_t shared = Py_MIN(Py_MIN(data.len, old.len) / chunk, PyList_GET_SIZE(old_keys));
    shared = Py_MIN(shared, count);
    const char *bytes = (const char *)data.buf, *before = (const char *)old.buf;
    if (shared && memcmp(bytes, before, (size_t)(shared * chunk)) != 0) {
        Py_ssize_t low = 0, high = shared; /* [0, low) agree; a stride in [low, high) not */
        while (low + 1 < high) {
            Py_ssize_t middle = (low + high) / 2;
            if (memcmp(bytes + low * chunk, before + low * chunk,
                       (size_t)((middle - low) * chunk)) == 0)
                low = middle;
            else
                high = middle;
        }
        shared = low; /* stride ``low`` is the first that differs */
    }
    keys = PyList_New(count);
    if (keys == NULL)
        goto done;
    XXH64_hash_t key = (XXH64_hash_t)seed;
    for (Py_ssize_t i = 0; i < shared; i++)
        PyList_SET_ITEM(keys, i, Py_NewRef(PyList_GET_ITEM(old_keys, i)));
    if (shared) {
        key = (XXH64_hash_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(old_keys, shared - 1));
        if (PyErr_Occurred()) {
            Py_CLEAR(keys);
            goto done;
        }
    }
    for (Py_ssize_t i = shared; i < count; i++) {
        for (Py_ssize_t b = i * stride; b < (i + 1) * stride; b++)
            key = chain_key(key, bytes + b * step, (size_t)step);
        PyObject *value = PyLong_FromUnsignedLongLong(key);
        if (value == NULL) {
            Py_CLEAR(keys);
            goto done;
        }
        PyList_SET_ITEM(keys, i, value);
    }
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&old);
    if (keys == NULL)
        return NULL;
    PyObject *answer = Py_BuildValue("(Nn)", keys, shared);
    return answer;
}

static PyMethodDef methods[] = {
    {"prefix_keys", prefix_keys, METH_VARARGS,
     "prefix_keys(data, block_bytes, stride, seed) -> the chain's link at every stride-th "
     "full block"},
    {"prefix_keys_after", prefix_keys_after, METH_VARARGS,
     "prefix_keys_after(data, block_bytes, stride, seed, old_data, old_keys) -> (prefix_keys "
     "of data, how many of old_keys it kept: the strides it shares with old_data)"},
    {"next_key", py_next_key, METH_VARARGS,
     "next_key(key, block) -> the chain's next link, over one block's token bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_keys", "Chained prefix keys in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_keys(void) { return PyModule_Create(&module); }
