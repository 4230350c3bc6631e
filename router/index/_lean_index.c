/* The precise index's two big tables, packed (router/index/lean_index.py says what they
 * hold and why; its Python twins are what these must equal, and
 * tests/router/test_lean_index.py checks that they do, operation by operation):
 *
 * - BlockTable, one per replica: engine block hash -> the router's chain link at that
 *   block (chain_key.h), its cache salt's number, its phase (blocks since the last
 *   stride key) and the tiers holding it. 21 bytes a slot, in four arrays.
 * - KeySets, one per index: stride key -> the set of replicas holding it, as the
 *   number of an interned Python int (a bitmask): a prefix held by the same replicas
 *   shares one mask. 12 bytes a slot, in two arrays.
 *
 * Both are open-addressing tables with linear probing and backward-shift deletion (no
 * tombstones), grown by half when more than 80% full; a slot's home is the top of the
 * product of its mixed hash and the table's size, so a size need not be a power of 2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../../replica/api/chain_key.h"

#define MAX_LOAD_NUM 4 /* grow past 4/5 full */
#define MAX_LOAD_DEN 5
#define TIERS_MASK 3u
#define GPU_TIER 1u
#define MAX_STRIDE 63 /* a phase fits in six bits beside the two tier bits */

static inline uint64_t mix(uint64_t x) { /* murmur3's finalizer: sequential hashes spread */
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline Py_ssize_t home(uint64_t hash, Py_ssize_t size) {
    return (Py_ssize_t)(((__uint128_t)mix(hash) * (uint64_t)size) >> 64);
}

static inline Py_ssize_t next_slot(Py_ssize_t slot, Py_ssize_t size) {
    return slot + 1 == size ? 0 : slot + 1;
}

/* Whether slot ``j``, empty now, may take the entry at ``i`` whose home is ``h``
 * (backward-shift deletion: the entry stays reachable from its home). */
static inline int may_move(Py_ssize_t h, Py_ssize_t i, Py_ssize_t j) {
    return j <= i ? (h <= j || h > i) : (h <= j && h > i);
}

/* An engine's block hash as 64 bits: an int's low 64 bits (vLLM's and ours fit), the
 * xxh3 of a bytes hash (vLLM's sha256). */
static int engine_hash(PyObject *value, uint64_t *out) {
    if (PyLong_Check(value)) {
        unsigned long long low = PyLong_AsUnsignedLongLongMask(value);
        if (low == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        *out = (uint64_t)low;
        return 0;
    }
    if (PyBytes_Check(value)) {
        *out = XXH3_64bits(PyBytes_AS_STRING(value), (size_t)PyBytes_GET_SIZE(value));
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a block hash is an int or bytes, not %.100s",
                 Py_TYPE(value)->tp_name);
    return -1;
}

/* Append ``value`` to ``list`` as a Python int: 0, or -1 on error. */
static int append_u64(PyObject *list, unsigned long long value) {
    PyObject *item = PyLong_FromUnsignedLongLong(value);
    if (item == NULL)
        return -1;
    int failed = PyList_Append(list, item);
    Py_DECREF(item);
    return failed;
}

/* ------------------------------------------------------------------ BlockTable */

typedef struct {
    PyObject_HEAD
    Py_ssize_t size, count;
    uint64_t *hashes;
    uint64_t *links;
    uint32_t *salts;
    uint8_t *flags; /* 0: empty; else phase << 2 | tiers (tiers never 0) */
} BlockTable;

static int blocks_alloc(BlockTable *t, Py_ssize_t size) {
    t->hashes = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    t->links = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    t->salts = PyMem_Calloc((size_t)size, sizeof(uint32_t));
    t->flags = PyMem_Calloc((size_t)size, sizeof(uint8_t));
    t->size = size;
    t->count = 0;
    if (!t->hashes || !t->links || !t->salts || !t->flags) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void blocks_free(BlockTable *t) {
    PyMem_Free(t->hashes);
    PyMem_Free(t->links);
    PyMem_Free(t->salts);
    PyMem_Free(t->flags);
    t->hashes = t->links = NULL;
    t->salts = NULL;
    t->flags = NULL;
}

static Py_ssize_t blocks_find(BlockTable *t, uint64_t hash) {
    Py_ssize_t slot = home(hash, t->size);
    while (t->flags[slot]) {
        if (t->hashes[slot] == hash)
            return slot;
        slot = next_slot(slot, t->size);
    }
    return -1 - slot; /* where it would go */
}

static void blocks_place(BlockTable *t, Py_ssize_t free_slot, uint64_t hash, uint64_t link,
                         uint32_t salt, uint8_t flags) {
    t->hashes[free_slot] = hash;
    t->links[free_slot] = link;
    t->salts[free_slot] = salt;
    t->flags[free_slot] = flags;
    t->count++;
}

static int blocks_grow(BlockTable *t) {
    BlockTable old = *t;
    if (blocks_alloc(t, old.size + old.size / 2 + 8) < 0) {
        blocks_free(t);
        *t = old;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old.size; i++) {
        if (old.flags[i]) {
            Py_ssize_t slot = -1 - blocks_find(t, old.hashes[i]);
            blocks_place(t, slot, old.hashes[i], old.links[i], old.salts[i], old.flags[i]);
        }
    }
    blocks_free(&old);
    return 0;
}

static void blocks_delete(BlockTable *t, Py_ssize_t gap) {
    Py_ssize_t i = next_slot(gap, t->size);
    while (t->flags[i]) {
        Py_ssize_t h = home(t->hashes[i], t->size);
        if (may_move(h, i, gap)) {
            t->hashes[gap] = t->hashes[i];
            t->links[gap] = t->links[i];
            t->salts[gap] = t->salts[i];
            t->flags[gap] = t->flags[i];
            gap = i;
        }
        i = next_slot(i, t->size);
    }
    t->flags[gap] = 0;
    t->count--;
}

/* Insert or overwrite; grows first if need be. */
static int blocks_put(BlockTable *t, uint64_t hash, uint64_t link, uint32_t salt, uint8_t flags) {
    Py_ssize_t slot = blocks_find(t, hash);
    if (slot >= 0) {
        t->links[slot] = link;
        t->salts[slot] = salt;
        t->flags[slot] = flags;
        return 0;
    }
    if ((t->count + 1) * MAX_LOAD_DEN > t->size * MAX_LOAD_NUM) {
        if (blocks_grow(t) < 0)
            return -1;
        slot = blocks_find(t, hash);
    }
    blocks_place(t, -1 - slot, hash, link, salt, flags);
    return 0;
}

static int BlockTable_init(BlockTable *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"capacity", NULL};
    Py_ssize_t capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n", names, &capacity))
        return -1;
    if (capacity < 0)
        capacity = 0;
    blocks_free(self);
    return blocks_alloc(self, capacity * MAX_LOAD_DEN / MAX_LOAD_NUM + 8);
}

static void BlockTable_dealloc(BlockTable *self) {
    blocks_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t BlockTable_len(BlockTable *self) { return self->count; }

/* stored(parent, seed, salt, data, hashes, block_bytes, stride, tier)
 *   -> (keys, gpu_blocks_added, displaced_salts, the chain's salt), or None if
 *   ``parent`` is unknown */
static PyObject *BlockTable_stored(BlockTable *self, PyObject *args) {
    PyObject *parent, *hashes;
    unsigned long long seed;
    unsigned int salt, tier;
    Py_buffer data;
    Py_ssize_t step, stride;
    if (!PyArg_ParseTuple(args, "OKIy*OnnI", &parent, &seed, &salt, &data, &hashes, &step,
                          &stride, &tier))
        return NULL;
    PyObject *result = NULL, *keys = NULL, *displaced = NULL;
    PyObject *sequence = PySequence_Fast(hashes, "block hashes must be a sequence");
    if (sequence == NULL)
        goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    if (stride < 1 || stride > MAX_STRIDE || step < 1 || data.len != step * count ||
        tier < 1 || tier > TIERS_MASK) {
        PyErr_SetString(PyExc_ValueError, "stored: bad stride, tier or token bytes");
        goto done;
    }
    uint64_t link = (uint64_t)seed;
    unsigned int phase = 0;
    if (parent != Py_None) {
        uint64_t parent_hash;
        if (engine_hash(parent, &parent_hash) < 0)
            goto done;
        Py_ssize_t slot = blocks_find(self, parent_hash);
        if (slot < 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        link = self->links[slot];
        salt = self->salts[slot];
        phase = self->flags[slot] >> 2;
    }
    keys = PyList_New(0);
    displaced = PyList_New(0);
    if (keys == NULL || displaced == NULL)
        goto done;
    long gpu_added = 0;
    const char *bytes = (const char *)data.buf;
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t hash;
        if (engine_hash(items[i], &hash) < 0)
            goto done;
        link = chain_key(link, bytes + i * step, (size_t)step);
        phase = (phase + 1) % (unsigned int)stride;
        if (phase == 0) {
            if (append_u64(keys, link) < 0)
                goto done;
        }
        Py_ssize_t slot = blocks_find(self, hash);
        unsigned int tiers = slot >= 0 ? self->flags[slot] & TIERS_MASK : 0;
        if (tier & ~tiers & GPU_TIER)
            gpu_added++;
        if (slot >= 0 && self->links[slot] == link && (self->flags[slot] >> 2) == phase) {
            self->flags[slot] |= (uint8_t)tier; /* the same block, in another tier too */
            continue;
        }
        if (tiers & GPU_TIER) { /* a block the GPU held under another chain */
            if (append_u64(displaced, self->salts[slot]) < 0)
                goto done;
            gpu_added++;
        }
        if (blocks_put(self, hash, link, salt, (uint8_t)(phase << 2 | tier | tiers)) < 0)
            goto done;
    }
    result = Py_BuildValue("(OlOI)", keys, gpu_added, displaced, salt);
done:
    Py_XDECREF(sequence);
    Py_XDECREF(keys);
    Py_XDECREF(displaced);
    PyBuffer_Release(&data);
    return result;
}

/* removed(hashes, tier) -> (keys of the stride blocks the tier let go, their salts,
 * the salts of the GPU blocks let go) */
static PyObject *BlockTable_removed(BlockTable *self, PyObject *args) {
    PyObject *hashes;
    unsigned int tier;
    if (!PyArg_ParseTuple(args, "OI", &hashes, &tier))
        return NULL;
    PyObject *sequence = PySequence_Fast(hashes, "block hashes must be a sequence");
    if (sequence == NULL)
        return NULL;
    PyObject *keys = PyList_New(0), *gpu_salts = PyList_New(0), *result = NULL;
    if (keys == NULL || gpu_salts == NULL)
        goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t hash;
        if (engine_hash(items[i], &hash) < 0)
            goto done;
        Py_ssize_t slot = blocks_find(self, hash);
        if (slot < 0 || !(self->flags[slot] & tier))
            continue;
        self->flags[slot] &= (uint8_t)~tier;
        if (tier == GPU_TIER) {
            if (append_u64(gpu_salts, self->salts[slot]) < 0)
                goto done;
        }
        int boundary = (self->flags[slot] >> 2) == 0;
        uint64_t link = self->links[slot];
        if (!(self->flags[slot] & TIERS_MASK))
            blocks_delete(self, slot);
        if (boundary && append_u64(keys, link) < 0)
            goto done;
    }
    result = PyTuple_Pack(2, keys, gpu_salts);
done:
    Py_DECREF(sequence);
    Py_XDECREF(keys);
    Py_XDECREF(gpu_salts);
    return result;
}

static PyObject *BlockTable_clear(BlockTable *self, PyObject *unused) {
    memset(self->flags, 0, (size_t)self->size);
    self->count = 0;
    Py_RETURN_NONE;
}

static PyObject *BlockTable_nbytes(BlockTable *self, void *closure) {
    return PyLong_FromSsize_t(self->size * (Py_ssize_t)(8 + 8 + 4 + 1));
}

static PyMethodDef BlockTable_methods[] = {
    {"stored", (PyCFunction)BlockTable_stored, METH_VARARGS, NULL},
    {"removed", (PyCFunction)BlockTable_removed, METH_VARARGS, NULL},
    {"clear", (PyCFunction)BlockTable_clear, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockTable_getset[] = {
    {"nbytes", (getter)BlockTable_nbytes, NULL, "bytes of the table's arrays", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods BlockTable_as_sequence = {.sq_length = (lenfunc)BlockTable_len};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.index._lean_index.BlockTable",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "engine block hash -> chain link, salt, phase and tiers (router/index/lean_index.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockTable_init,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_methods = BlockTable_methods,
    .tp_getset = BlockTable_getset,
    .tp_as_sequence = &BlockTable_as_sequence,
};

/* -------------------------------------------------------------------- KeySets */

typedef struct {
    PyObject_HEAD
    Py_ssize_t size, count;
    uint64_t *keys;
    uint32_t *ids; /* 0: empty; else a mask's number */
    PyObject **masks; /* by number: the interned bitmask (an int), or NULL */
    uint32_t *refs;   /* by number: the keys that hold it */
    uint32_t masks_size, next_free; /* next_free: a free number, chained through refs */
    PyObject *interned; /* mask -> its number */
    Py_ssize_t *sizes; /* by replica bit: the keys it holds */
    Py_ssize_t sizes_len;
} KeySets;

static int sets_alloc(KeySets *t, Py_ssize_t size) {
    t->keys = PyMem_Calloc((size_t)size, sizeof(uint64_t));
    t->ids = PyMem_Calloc((size_t)size, sizeof(uint32_t));
    t->size = size;
    t->count = 0;
    if (!t->keys || !t->ids) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static Py_ssize_t sets_find(KeySets *t, uint64_t key) {
    Py_ssize_t slot = home(key, t->size);
    while (t->ids[slot]) {
        if (t->keys[slot] == key)
            return slot;
        slot = next_slot(slot, t->size);
    }
    return -1 - slot;
}

static int sets_grow(KeySets *t) {
    uint64_t *old_keys = t->keys;
    uint32_t *old_ids = t->ids;
    Py_ssize_t old_size = t->size, old_count = t->count;
    if (sets_alloc(t, old_size + old_size / 2 + 8) < 0) {
        PyMem_Free(t->keys);
        PyMem_Free(t->ids);
        t->keys = old_keys;
        t->ids = old_ids;
        t->size = old_size;
        t->count = old_count;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_size; i++) {
        if (old_ids[i]) {
            Py_ssize_t slot = -1 - sets_find(t, old_keys[i]);
            t->keys[slot] = old_keys[i];
            t->ids[slot] = old_ids[i];
            t->count++;
        }
    }
    PyMem_Free(old_keys);
    PyMem_Free(old_ids);
    return 0;
}

static void sets_delete(KeySets *t, Py_ssize_t gap) {
    Py_ssize_t i = next_slot(gap, t->size);
    while (t->ids[i]) {
        Py_ssize_t h = home(t->keys[i], t->size);
        if (may_move(h, i, gap)) {
            t->keys[gap] = t->keys[i];
            t->ids[gap] = t->ids[i];
            gap = i;
        }
        i = next_slot(i, t->size);
    }
    t->ids[gap] = 0;
    t->count--;
}

/* The number of ``mask`` (a new reference to it is taken if it is new), 0 on error. */
static uint32_t intern_mask(KeySets *t, PyObject *mask) {
    PyObject *known = PyDict_GetItemWithError(t->interned, mask);
    if (known != NULL)
        return (uint32_t)PyLong_AsUnsignedLong(known);
    if (PyErr_Occurred())
        return 0;
    if (t->next_free == 0) { /* no free number: make room for twice as many */
        uint32_t size = t->masks_size ? t->masks_size * 2 : 64;
        PyObject **masks = PyMem_Realloc(t->masks, size * sizeof(PyObject *));
        if (masks == NULL) {
            PyErr_NoMemory();
            return 0;
        }
        t->masks = masks;
        uint32_t *refs = PyMem_Realloc(t->refs, size * sizeof(uint32_t));
        if (refs == NULL) {
            PyErr_NoMemory();
            return 0;
        }
        t->refs = refs;
        uint32_t first = t->masks_size ? t->masks_size : 1; /* number 0 means empty */
        for (uint32_t n = first; n < size; n++) {
            t->masks[n] = NULL;
            t->refs[n] = n + 1 < size ? n + 1 : 0;
        }
        t->next_free = first;
        t->masks_size = size;
    }
    uint32_t number = t->next_free;
    PyObject *value = PyLong_FromUnsignedLong(number);
    if (value == NULL || PyDict_SetItem(t->interned, mask, value) < 0) {
        Py_XDECREF(value);
        return 0;
    }
    Py_DECREF(value);
    t->next_free = t->refs[number];
    t->masks[number] = Py_NewRef(mask);
    t->refs[number] = 0;
    return number;
}

/* One key fewer holds mask ``number``: 1 if that was the last (the number is free
 * now), 0 if not, -1 on error. */
static int release_mask(KeySets *t, uint32_t number) {
    if (--t->refs[number])
        return 0;
    PyObject *mask = t->masks[number];
    int failed = PyDict_DelItem(t->interned, mask);
    Py_DECREF(mask);
    t->masks[number] = NULL;
    t->refs[number] = t->next_free;
    t->next_free = number;
    return failed < 0 ? -1 : 1;
}

static int KeySets_init(KeySets *self, PyObject *args, PyObject *kwargs) {
    if (!PyArg_ParseTuple(args, ""))
        return -1;
    self->interned = PyDict_New();
    if (self->interned == NULL)
        return -1;
    return sets_alloc(self, 64);
}

static void KeySets_dealloc(KeySets *self) {
    for (uint32_t n = 1; n < self->masks_size; n++)
        Py_XDECREF(self->masks[n]);
    PyMem_Free(self->masks);
    PyMem_Free(self->refs);
    PyMem_Free(self->keys);
    PyMem_Free(self->ids);
    PyMem_Free(self->sizes);
    Py_XDECREF(self->interned);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t KeySets_len(KeySets *self) { return self->count; }

static int resize_sizes(KeySets *t, Py_ssize_t bit) {
    if (bit < t->sizes_len)
        return 0;
    Py_ssize_t length = bit + 64;
    Py_ssize_t *sizes = PyMem_Realloc(t->sizes, (size_t)length * sizeof(Py_ssize_t));
    if (sizes == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(sizes + t->sizes_len, 0, (size_t)(length - t->sizes_len) * sizeof(Py_ssize_t));
    t->sizes = sizes;
    t->sizes_len = length;
    return 0;
}

/* The mask after ``number``'s with ``bit`` set (adding) or cleared: its number, 0 for an
 * empty mask, -1 on error. A one-entry cache: a prompt's keys mostly share a mask. */
typedef struct {
    uint32_t from, to;
} Step;

static long changed_mask(KeySets *t, uint32_t number, PyObject *bitmask, int adding,
                         Step *cache) {
    if (cache->from == number && number)
        return cache->to;
    PyObject *mask = number ? t->masks[number] : NULL, *next;
    if (adding) {
        next = mask ? PyNumber_Or(mask, bitmask) : Py_NewRef(bitmask);
    } else {
        PyObject *inverse = PyNumber_Invert(bitmask);
        next = inverse ? PyNumber_And(mask, inverse) : NULL;
        Py_XDECREF(inverse);
    }
    if (next == NULL)
        return -1;
    int empty = PyObject_Not(next);
    long result;
    if (empty < 0)
        result = -1;
    else if (empty)
        result = 0;
    else {
        uint32_t interned = intern_mask(t, next);
        result = interned ? (long)interned : -1;
    }
    Py_DECREF(next);
    if (result >= 0 && number) {
        cache->from = number;
        cache->to = (uint32_t)result;
    }
    return result;
}

/* ``1 << bit``, a replica's bitmask (a new reference, NULL on error). */
static PyObject *replica_mask(Py_ssize_t bit) {
    if (bit < 0) {
        PyErr_SetString(PyExc_ValueError, "a replica's bit is not negative");
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1), *position = PyLong_FromSsize_t(bit), *mask = NULL;
    if (one && position)
        mask = PyNumber_Lshift(one, position);
    Py_XDECREF(one);
    Py_XDECREF(position);
    return mask;
}

/* add(bit, keys) / discard(bit, keys) */
static PyObject *KeySets_change(KeySets *self, PyObject *args, int adding) {
    Py_ssize_t bit;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "nO", &bit, &keys))
        return NULL;
    if (bit < 0 || resize_sizes(self, bit) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a replica's bit is not negative");
        return NULL;
    }
    PyObject *sequence = PySequence_Fast(keys, "keys must be a sequence");
    if (sequence == NULL)
        return NULL;
    PyObject *result = NULL, *bitmask = replica_mask(bit);
    if (bitmask == NULL)
        goto done;
    Step cache = {0, 0};
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
    PyObject **items = PySequence_Fast_ITEMS(sequence);
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t key = (uint64_t)PyLong_AsUnsignedLongLongMask(items[i]);
        if (PyErr_Occurred())
            goto done;
        Py_ssize_t slot = sets_find(self, key);
        if (slot < 0 && !adding)
            continue;
        uint32_t number = slot >= 0 ? self->ids[slot] : 0;
        long next = changed_mask(self, number, bitmask, adding, &cache);
        if (next < 0)
            goto done;
        if ((uint32_t)next == number)
            continue; /* the bit was already so */
        if (next) {
            self->refs[next]++;
        }
        if (number) {
            int freed = release_mask(self, number);
            if (freed < 0)
                goto done;
            if (freed && cache.from == number)
                cache.from = 0; /* its number may name another mask next */
        }
        self->sizes[bit] += adding ? 1 : -1;
        if (slot >= 0 && next) {
            self->ids[slot] = (uint32_t)next;
        } else if (slot >= 0) {
            sets_delete(self, slot);
        } else {
            if ((self->count + 1) * MAX_LOAD_DEN > self->size * MAX_LOAD_NUM) {
                if (sets_grow(self) < 0)
                    goto done;
                slot = sets_find(self, key);
            }
            slot = -1 - slot;
            self->keys[slot] = key;
            self->ids[slot] = (uint32_t)next;
            self->count++;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(sequence);
    Py_XDECREF(bitmask);
    return result;
}

static PyObject *KeySets_add(KeySets *self, PyObject *args) { return KeySets_change(self, args, 1); }

static PyObject *KeySets_discard(KeySets *self, PyObject *args) {
    return KeySets_change(self, args, 0);
}

/* get(key, default) -> the mask of the replicas holding ``key``, else ``default`` */
static PyObject *KeySets_get(KeySets *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default)");
        return NULL;
    }
    uint64_t key = (uint64_t)PyLong_AsUnsignedLongLongMask(args[0]);
    if (key == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t slot = sets_find(self, key);
    return Py_NewRef(slot >= 0 ? self->masks[self->ids[slot]] : args[1]);
}

/* clear(bit): no key is held by replica ``bit`` any more. One pass over the slots,
 * each mask with the bit mapped to its twin without it (or to none). */
static PyObject *KeySets_clear(KeySets *self, PyObject *arg) {
    Py_ssize_t bit = PyLong_AsSsize_t(arg);
    if (bit == -1 && PyErr_Occurred())
        return NULL;
    if (bit < 0 || bit >= self->sizes_len || self->sizes[bit] == 0)
        Py_RETURN_NONE;
    PyObject *result = NULL, *bitmask = replica_mask(bit);
    uint32_t *remap = NULL, live = self->masks_size;
    if (bitmask == NULL)
        goto done;
    remap = PyMem_Calloc(live, sizeof(uint32_t)); /* 0: unchanged */
    uint8_t *gone = PyMem_Calloc(live, 1);         /* maps to no mask at all */
    if (remap == NULL || gone == NULL) {
        PyMem_Free(gone);
        PyErr_NoMemory();
        goto done;
    }
    for (uint32_t n = 1; n < live; n++) {
        if (self->masks[n] == NULL)
            continue;
        PyObject *held = PyNumber_And(self->masks[n], bitmask);
        int has = held ? PyObject_IsTrue(held) : -1;
        Py_XDECREF(held);
        if (has < 0)
            goto fail;
        if (!has)
            continue;
        Step none = {0, 0};
        long next = changed_mask(self, n, bitmask, 0, &none);
        if (next < 0)
            goto fail;
        if (next)
            remap[n] = (uint32_t)next;
        else
            gone[n] = 1;
    }
    /* Interning may have grown the masks: numbers past ``live`` lack the bit. A slot
     * is looked at again after a deletion shifted another into it; mapping a mask twice
     * does nothing the second time (its twin lacks the bit). */
    for (Py_ssize_t i = 0; i < self->size;) {
        uint32_t number = self->ids[i];
        if (number == 0 || number >= live || (!remap[number] && !gone[number])) {
            i++;
            continue;
        }
        if (gone[number]) {
            sets_delete(self, i);
        } else {
            self->ids[i] = remap[number];
            self->refs[remap[number]]++;
            i++;
        }
        if (release_mask(self, number) < 0)
            goto fail;
    }
    self->sizes[bit] = 0;
    result = Py_NewRef(Py_None);
fail:
    PyMem_Free(gone);
done:
    PyMem_Free(remap);
    Py_XDECREF(bitmask);
    return result;
}

/* held(bit) -> the keys replica ``bit`` holds (for tests and inspection: a whole pass) */
static PyObject *KeySets_held(KeySets *self, PyObject *arg) {
    Py_ssize_t bit = PyLong_AsSsize_t(arg);
    if (bit == -1 && PyErr_Occurred())
        return NULL;
    PyObject *keys = PyList_New(0), *bitmask = replica_mask(bit);
    int8_t *has = PyMem_Calloc(self->masks_size ? self->masks_size : 1, 1); /* 0: unknown */
    if (keys == NULL || bitmask == NULL || has == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < self->size; i++) {
        uint32_t number = self->ids[i];
        if (number == 0)
            continue;
        if (has[number] == 0) {
            PyObject *held = PyNumber_And(self->masks[number], bitmask);
            int truth = held ? PyObject_IsTrue(held) : -1;
            Py_XDECREF(held);
            if (truth < 0)
                goto fail;
            has[number] = truth ? 1 : -1;
        }
        if (has[number] > 0) {
            if (append_u64(keys, self->keys[i]) < 0)
                goto fail;
        }
    }
    goto done;
fail:
    if (!PyErr_Occurred())
        PyErr_NoMemory(); /* what else fails without saying */
    Py_CLEAR(keys);
done:
    PyMem_Free(has);
    Py_XDECREF(bitmask);
    return keys;
}

static PyObject *KeySets_size(KeySets *self, PyObject *arg) {
    Py_ssize_t bit = PyLong_AsSsize_t(arg);
    if (bit == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(bit >= 0 && bit < self->sizes_len ? self->sizes[bit] : 0);
}

static PyObject *KeySets_nbytes(KeySets *self, void *closure) {
    Py_ssize_t masks = PyDict_GET_SIZE(self->interned);
    return PyLong_FromSsize_t(self->size * (Py_ssize_t)(8 + 4) +
                              (Py_ssize_t)self->masks_size * (Py_ssize_t)(8 + 4) +
                              masks * 100 /* a dict entry and its int, about */);
}

static PyObject *KeySets_masks(KeySets *self, void *closure) {
    return PyLong_FromSsize_t(PyDict_GET_SIZE(self->interned));
}

static PyMethodDef KeySets_methods[] = {
    {"add", (PyCFunction)KeySets_add, METH_VARARGS, NULL},
    {"discard", (PyCFunction)KeySets_discard, METH_VARARGS, NULL},
    {"get", (PyCFunction)(void (*)(void))KeySets_get, METH_FASTCALL, NULL},
    {"size", (PyCFunction)KeySets_size, METH_O, NULL},
    {"clear", (PyCFunction)KeySets_clear, METH_O, NULL},
    {"held", (PyCFunction)KeySets_held, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeySets_getset[] = {
    {"nbytes", (getter)KeySets_nbytes, NULL, "bytes of the table and its masks", NULL},
    {"masks", (getter)KeySets_masks, NULL, "distinct sets of replicas", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeySets_as_sequence = {.sq_length = (lenfunc)KeySets_len};

static PyTypeObject KeySetsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router.index._lean_index.KeySets",
    .tp_basicsize = sizeof(KeySets),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "stride key -> bitmask of the replicas holding it (router/index/lean_index.py)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeySets_init,
    .tp_dealloc = (destructor)KeySets_dealloc,
    .tp_methods = KeySets_methods,
    .tp_getset = KeySets_getset,
    .tp_as_sequence = &KeySets_as_sequence,
};

/* --------------------------------------------------------------------- module */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lean_index", "The precise index's packed tables in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__lean_index(void) {
    if (PyType_Ready(&BlockTableType) < 0 || PyType_Ready(&KeySetsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "BlockTable", (PyObject *)&BlockTableType) < 0 ||
        PyModule_AddObjectRef(m, "KeySets", (PyObject *)&KeySetsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
