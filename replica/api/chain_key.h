/* One link of the router's key chain (replica/api/identity.py says why it is so),
 * shared by the prefix keys (replica/api/_prefix_keys.c) and the lean index's event
 * keys (router/_lean_index.c), so both compute the very same numbers:
 *
 *   key' = XXH3_64(block, seed = key)                  a block of at most 240 bytes
 *   key' = XXH3_64(le64(XXH3_64(block)), seed = key)   a longer one
 *
 * (xxh3 seeded over more than 240 bytes derives a secret from the seed on every call,
 * six times the cost of hashing the block; over 8 bytes it costs nothing more.)
 */
#ifndef PREFIX_ROUTER_CHAIN_KEY_H
#define PREFIX_ROUTER_CHAIN_KEY_H

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h"

#define CHAIN_SHORT_BLOCK 240

static inline XXH64_hash_t chain_key(XXH64_hash_t key, const char *block, size_t size) {
    if (size <= CHAIN_SHORT_BLOCK)
        return XXH3_64bits_withSeed(block, size, key);
    XXH64_hash_t link = XXH3_64bits(block, size);
    unsigned char bytes[8]; /* little-endian, as Python's int.to_bytes(8, "little") */
    for (int i = 0; i < 8; i++)
        bytes[i] = (unsigned char)(link >> (8 * i));
    return XXH3_64bits_withSeed(bytes, 8, key);
}

#endif
