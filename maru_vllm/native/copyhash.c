/*
 * Fused copy + checksum for pool payloads: one pass that moves a payload between its contiguous
 * pool buffer and the paged KV cache (a list of memory segments in payload order) and feeds
 * every 64-byte stripe it moves through XXH3-64's stripe accumulation while the stripe is in
 * registers. The result equals XXH3-64 (seed 0, default secret) of the whole payload, so the
 * object format written by the pure-Python path (the `xxhash` package) stays the same.
 *
 * Written from the public XXH3 specification (doc/xxhash_spec.md in the xxHash repository):
 * inputs longer than 240 bytes only; shorter ones are hashed by the caller.
 *
 * Why one pass: a copy and a hash are both bound by memory bandwidth when run one after the
 * other; hashing the stripe the copy has just loaded costs only arithmetic, which the memory
 * stalls hide.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* x86-64 gets AVX2 / AVX-512F versions picked at run time; any other CPU the portable one.
 * -DMARU_X86=0 builds the portable one only (how the non-x86 build is checked on x86). */
#if !defined(MARU_X86)
#if defined(__x86_64__) || defined(_M_X64)
#define MARU_X86 1
#else
#define MARU_X86 0
#endif
#endif
#if MARU_X86
#include <immintrin.h>
#endif

#define STRIPE 64
#define STRIPES_PER_BLOCK 16 /* (secret length 192 - 64) / 8 */
#define SECRET_SCRAMBLE 128  /* secret length - 64 */
#define SECRET_LAST_STRIPE 121 /* secret length - 71 */
#define SECRET_MERGE 11
#define MIN_LONG_INPUT 241
/*
 * How the copy keeps up with memory: the hash arithmetic between a stripe's load and its store
 * fills the out-of-order window, so fewer cache-line fills are in flight than in a plain copy.
 * Two things give that back (benchmarks/profile_load.py and bench_store.py measure the result):
 *  - software prefetch well ahead of the loads (a hint: past a span's end it is harmless);
 *  - streaming (non-temporal) stores where the destination is vector-aligned: no read for
 *    ownership of destination lines, and neither destination (a pool object another process
 *    reads, or KV cache pages the next forward reads) is read again by this core meanwhile.
 */
#ifndef PREFETCH_COPY
#define PREFETCH_COPY 4096
#endif
#ifndef PREFETCH_HASH
#define PREFETCH_HASH 8192
#endif

static const uint32_t P32_1 = 0x9E3779B1U;
static const uint32_t P32_2 = 0x85EBCA77U;
static const uint32_t P32_3 = 0xC2B2AE3DU;
static const uint64_t P64_1 = 0x9E3779B185EBCA87ULL;
static const uint64_t P64_2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t P64_3 = 0x165667B19E3779F9ULL;
static const uint64_t P64_4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t P64_5 = 0x27D4EB2F165667C5ULL;
static const uint64_t PMX_1 = 0x165667919E3779F9ULL;

/* The default 192-byte secret (a constant of the specification). */
static const uint8_t SECRET[192] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* ---- one stripe, portable ------------------------------------------------------------------ */

static inline void accumulate_portable(uint64_t acc[8], const uint8_t *stripe, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = le64(stripe + 8 * i);
        uint64_t k = v ^ le64(secret + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static inline void scramble_portable(uint64_t acc[8]) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= le64(SECRET + SECRET_SCRAMBLE + 8 * i);
        acc[i] = a * P32_1;
    }
}

/*
 * A span of whole stripes: stripes first..first+count-1 of the payload, all of them "regular"
 * (accumulated in order, scrambled after every 16th). `src` is where the bytes are read;
 * `dst`, when not NULL, receives a copy of them. Each implementation keeps the accumulators in
 * registers for the whole span.
 */
typedef void (*span_fn)(uint64_t acc[8], size_t first, size_t count, const uint8_t *src, uint8_t *dst);

static void span_portable(uint64_t acc[8], size_t first, size_t count, const uint8_t *src, uint8_t *dst) {
    for (size_t n = 0; n < count; n++) {
        size_t s = first + n;
        const uint8_t *p = src + n * STRIPE;
        accumulate_portable(acc, p, SECRET + 8 * (s % STRIPES_PER_BLOCK));
        if (dst != NULL)
            memcpy(dst + n * STRIPE, p, STRIPE);
        if ((s + 1) % STRIPES_PER_BLOCK == 0)
            scramble_portable(acc);
    }
}

#if MARU_X86
/* ---- AVX2: two 256-bit halves per stripe ----------------------------------------------------- */

__attribute__((target("avx2"))) static inline __m256i accumulate_avx2(__m256i acc, __m256i data, __m256i key) {
    __m256i mixed = _mm256_xor_si256(data, key);
    __m256i product = _mm256_mul_epu32(mixed, _mm256_srli_epi64(mixed, 32));
    __m256i swapped = _mm256_shuffle_epi32(data, 0x4E); /* lanes i and i^1 trade places */
    return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

__attribute__((target("avx2"))) static inline __m256i scramble_avx2(__m256i acc, __m256i key) {
    const __m256i prime = _mm256_set1_epi64x(P32_1);
    acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    acc = _mm256_xor_si256(acc, key);
    __m256i lo = _mm256_mul_epu32(acc, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) static void span_avx2(uint64_t acc[8], size_t first, size_t count,
                                                      const uint8_t *src, uint8_t *dst) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc);
    __m256i a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    const int stream = ((uintptr_t)dst & 31) == 0;
    const size_t ahead = dst != NULL ? PREFETCH_COPY : PREFETCH_HASH;
    for (size_t n = 0; n < count; n++) {
        size_t s = first + n;
        const uint8_t *p = src + n * STRIPE;
        const uint8_t *k = SECRET + 8 * (s % STRIPES_PER_BLOCK);
        __builtin_prefetch(p + ahead);
        __m256i d0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        if (dst != NULL) {
            if (stream) {
                _mm256_stream_si256((__m256i *)(dst + n * STRIPE), d0);
                _mm256_stream_si256((__m256i *)(dst + n * STRIPE + 32), d1);
            } else {
                _mm256_storeu_si256((__m256i *)(dst + n * STRIPE), d0);
                _mm256_storeu_si256((__m256i *)(dst + n * STRIPE + 32), d1);
            }
        }
        a0 = accumulate_avx2(a0, d0, _mm256_loadu_si256((const __m256i *)k));
        a1 = accumulate_avx2(a1, d1, _mm256_loadu_si256((const __m256i *)(k + 32)));
        if ((s + 1) % STRIPES_PER_BLOCK == 0) {
            a0 = scramble_avx2(a0, _mm256_loadu_si256((const __m256i *)(SECRET + SECRET_SCRAMBLE)));
            a1 = scramble_avx2(a1, _mm256_loadu_si256((const __m256i *)(SECRET + SECRET_SCRAMBLE + 32)));
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    if (dst != NULL)
        _mm_sfence(); /* streamed stores are ordered before anything this thread does next */
}

/* ---- AVX-512F: one register per stripe ------------------------------------------------------- */

__attribute__((target("avx512f"))) static void span_avx512(uint64_t acc[8], size_t first, size_t count,
                                                          const uint8_t *src, uint8_t *dst) {
    const __m512i prime = _mm512_set1_epi64(P32_1);
    const __m512i scramble_key = _mm512_loadu_si512((const void *)(SECRET + SECRET_SCRAMBLE));
    __m512i a = _mm512_loadu_si512((const void *)acc);
    const int stream = ((uintptr_t)dst & 63) == 0;
    const size_t ahead = dst != NULL ? PREFETCH_COPY : PREFETCH_HASH;
    for (size_t n = 0; n < count; n++) {
        size_t s = first + n;
        const uint8_t *p = src + n * STRIPE;
        __builtin_prefetch(p + ahead);
        __m512i d = _mm512_loadu_si512((const void *)p);
        if (dst != NULL) {
            if (stream)
                _mm512_stream_si512((void *)(dst + n * STRIPE), d);
            else
                _mm512_storeu_si512((void *)(dst + n * STRIPE), d);
        }
        __m512i mixed = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)(SECRET + 8 * (s % STRIPES_PER_BLOCK))));
        __m512i product = _mm512_mul_epu32(mixed, _mm512_srli_epi64(mixed, 32));
        __m512i swapped = _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)0x4E);
        a = _mm512_add_epi64(a, _mm512_add_epi64(product, swapped));
        if ((s + 1) % STRIPES_PER_BLOCK == 0) {
            a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
            a = _mm512_xor_si512(a, scramble_key);
            __m512i lo = _mm512_mul_epu32(a, prime);
            __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
            a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
        }
    }
    _mm512_storeu_si512((void *)acc, a);
    if (dst != NULL)
        _mm_sfence();
}
#endif

/* Copy-only spans (a load that is not verified): the same loads and stores, no arithmetic. */
typedef void (*copy_fn)(uint8_t *dst, const uint8_t *src, size_t count);

static void copy_portable(uint8_t *dst, const uint8_t *src, size_t count) {
    memcpy(dst, src, count * STRIPE);
}

#if MARU_X86
__attribute__((target("avx2"))) static void copy_avx2(uint8_t *dst, const uint8_t *src, size_t count) {
    if (((uintptr_t)dst & 31) != 0) {
        memcpy(dst, src, count * STRIPE);
        return;
    }
    for (size_t n = 0; n < count; n++) {
        const uint8_t *p = src + n * STRIPE;
        __builtin_prefetch(p + PREFETCH_COPY);
        __m256i d0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i d1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        _mm256_stream_si256((__m256i *)(dst + n * STRIPE), d0);
        _mm256_stream_si256((__m256i *)(dst + n * STRIPE + 32), d1);
    }
    _mm_sfence();
}

__attribute__((target("avx512f"))) static void copy_avx512(uint8_t *dst, const uint8_t *src, size_t count) {
    if (((uintptr_t)dst & 63) != 0) {
        memcpy(dst, src, count * STRIPE);
        return;
    }
    for (size_t n = 0; n < count; n++) {
        const uint8_t *p = src + n * STRIPE;
        __builtin_prefetch(p + PREFETCH_COPY);
        _mm512_stream_si512((void *)(dst + n * STRIPE), _mm512_loadu_si512((const void *)p));
    }
    _mm_sfence();
}
#endif

static span_fn SPAN = span_portable;
static copy_fn COPY = copy_portable;
static const char *ISA = "portable";

static int cpu_has(const char *isa) {
#if MARU_X86
    __builtin_cpu_init();
    if (strcmp(isa, "avx512f") == 0)
        return __builtin_cpu_supports("avx512f");
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2");
#endif
    return strcmp(isa, "portable") == 0;
}

/* Select an implementation by name; 0 when this CPU (or build) lacks it. */
static int select_isa(const char *isa) {
    if (!cpu_has(isa))
        return 0;
#if MARU_X86
    if (strcmp(isa, "avx512f") == 0) {
        SPAN = span_avx512;
        COPY = copy_avx512;
        ISA = "avx512f";
        return 1;
    }
    if (strcmp(isa, "avx2") == 0) {
        SPAN = span_avx2;
        COPY = copy_avx2;
        ISA = "avx2";
        return 1;
    }
#endif
    SPAN = span_portable;
    COPY = copy_portable;
    ISA = "portable";
    return 1;
}

/* AVX2 first: as fast as AVX-512F on 64-byte aligned buffers (the copy is memory-bound either
 * way) and faster on unaligned ones, where every 64-byte load would straddle two cache lines. */
static void pick_isa(void) {
    if (!select_isa("avx2") && !select_isa("avx512f"))
        select_isa("portable");
}

/* ---- the hash state over one payload --------------------------------------------------------- */

typedef struct {
    uint64_t acc[8];
    size_t next;    /* index of the next stripe to accumulate */
    size_t regular; /* stripes accumulated in order (all but the final, overlapping one) */
    int active;     /* 0: payload too short for the long-input algorithm, copy only */
} hash_state;

static void hash_init(hash_state *h, size_t len) {
    const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(h->acc, init, sizeof init);
    h->next = 0;
    h->active = len >= MIN_LONG_INPUT;
    if (h->active) {
        size_t blocks = (len - 1) / (STRIPE * STRIPES_PER_BLOCK);
        h->regular = blocks * STRIPES_PER_BLOCK + ((len - 1) - blocks * STRIPE * STRIPES_PER_BLOCK) / STRIPE;
    } else {
        h->regular = 0;
    }
}

/* Accumulate, from the payload, every regular stripe that ends at or before `upto`. */
static void hash_upto(hash_state *h, const uint8_t *payload, size_t upto) {
    size_t end = upto / STRIPE;
    if (end > h->regular)
        end = h->regular;
    if (end > h->next) {
        SPAN(h->acc, h->next, end - h->next, payload + h->next * STRIPE, NULL);
        h->next = end;
    }
}

static uint64_t mul_fold(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    unsigned __int128 r = (unsigned __int128)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
#else
    uint64_t a_lo = a & 0xFFFFFFFFULL, a_hi = a >> 32, b_lo = b & 0xFFFFFFFFULL, b_hi = b >> 32;
    uint64_t ll = a_lo * b_lo, lh = a_lo * b_hi, hl = a_hi * b_lo, hh = a_hi * b_hi;
    uint64_t mid = (ll >> 32) + (lh & 0xFFFFFFFFULL) + (hl & 0xFFFFFFFFULL);
    uint64_t lo = (mid << 32) | (ll & 0xFFFFFFFFULL);
    uint64_t hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    return lo ^ hi;
#endif
}

static uint64_t hash_finish(hash_state *h, const uint8_t *payload, size_t len) {
    hash_upto(h, payload, len);
    accumulate_portable(h->acc, payload + len - STRIPE, SECRET + SECRET_LAST_STRIPE);
    uint64_t r = (uint64_t)len * P64_1;
    for (int i = 0; i < 4; i++)
        r += mul_fold(h->acc[2 * i] ^ le64(SECRET + SECRET_MERGE + 16 * i),
                      h->acc[2 * i + 1] ^ le64(SECRET + SECRET_MERGE + 16 * i + 8));
    r ^= r >> 37;
    r *= PMX_1;
    r ^= r >> 32;
    return r;
}

/*
 * Copy one segment: payload[off, off + len) <-> mem[0, len). `load`: payload -> mem.
 * Stripes that lie wholly inside the segment and start on a stripe boundary are copied and
 * hashed in one go; the ragged head and tail are copied with memcpy and hashed from the payload
 * once their stripe is complete.
 */
static void copy_segment(hash_state *h, uint8_t *payload, size_t off, uint8_t *mem, size_t len, int load) {
    size_t pos = off, end = off + len;
    hash_upto(h, payload, pos); /* stripes wholly before this segment (hash-only ranges) */
    if (pos % STRIPE) {
        size_t head = STRIPE - pos % STRIPE;
        if (head > end - pos)
            head = end - pos;
        if (load)
            memcpy(mem, payload + pos, head);
        else
            memcpy(payload + pos, mem, head);
        pos += head;
        hash_upto(h, payload, pos);
    }
    size_t whole = (end - pos) / STRIPE;
    if (whole) {
        size_t first = pos / STRIPE, fused = 0;
        if (h->next == first && first < h->regular) {
            fused = h->regular - first;
            if (fused > whole)
                fused = whole;
        }
        uint8_t *m = mem + (pos - off);
        if (fused) {
            if (load)
                SPAN(h->acc, first, fused, payload + pos, m);
            else
                SPAN(h->acc, first, fused, m, payload + pos);
            h->next = first + fused;
            pos += fused * STRIPE;
            m += fused * STRIPE;
        }
        if (!h->active && whole > fused) { /* a plain copy: whole stripes stream too */
            if (load)
                COPY(m, payload + pos, whole - fused);
            else
                COPY(payload + pos, m, whole - fused);
            pos += (whole - fused) * STRIPE;
        }
    }
    if (pos < end) {
        if (load)
            memcpy(mem + (pos - off), payload + pos, end - pos);
        else
            memcpy(payload + pos, mem + (pos - off), end - pos);
    }
}

/* ---- Python bindings ------------------------------------------------------------------------- */

typedef struct {
    uint64_t offset; /* in the payload */
    uint64_t address;
    uint64_t length;
} segment;

PyDoc_STRVAR(copy_doc,
"copy(payload, segments, load, hashed=True) -> int | None\n\n"
"Copy between `payload` (a contiguous buffer) and memory segments, hashing the whole payload\n"
"in the same pass. `segments` is a C-contiguous buffer of uint64 triples (payload offset,\n"
"address, length), sorted by offset and not overlapping; payload bytes outside every segment\n"
"are hashed but not copied (they must already hold their data). `load`: payload -> memory;\n"
"otherwise memory -> payload (then `payload` must be writable). Returns XXH3-64 of the\n"
"payload after the copy, or None when it is 240 bytes or shorter or `hashed` is false (a\n"
"plain copy). Runs without the GIL;\n"
"the addresses must stay valid and untouched by other threads until it returns.");

static PyObject *py_copy(PyObject *self, PyObject *args) {
    Py_buffer payload, segs;
    PyObject *payload_obj;
    int load, hashed = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oy*p|p", &payload_obj, &segs, &load, &hashed))
        return NULL;
    if (PyObject_GetBuffer(payload_obj, &payload, PyBUF_C_CONTIGUOUS | (load ? 0 : PyBUF_WRITABLE)) < 0) {
        PyBuffer_Release(&segs);
        return NULL;
    }
    PyObject *result = NULL;
    if (segs.len % (Py_ssize_t)sizeof(segment)) {
        PyErr_Format(PyExc_ValueError, "segments buffer has %zd bytes, not a multiple of %zu (uint64 triples)",
                     segs.len, sizeof(segment));
        goto done;
    }
    size_t n = (size_t)segs.len / sizeof(segment), plen = (size_t)payload.len;
    const segment *sg = (const segment *)segs.buf;
    uint64_t prev_end = 0;
    for (size_t i = 0; i < n; i++) {
        if (sg[i].offset < prev_end || sg[i].length > plen || sg[i].offset > plen - sg[i].length) {
            PyErr_Format(PyExc_ValueError,
                         "segment %zu (offset %llu, length %llu) is out of order, overlapping or past the "
                         "payload's %zu bytes",
                         i, (unsigned long long)sg[i].offset, (unsigned long long)sg[i].length, plen);
            goto done;
        }
        prev_end = sg[i].offset + sg[i].length;
    }
    hash_state h;
    uint8_t *pay = (uint8_t *)payload.buf;
    uint64_t digest = 0;
    Py_BEGIN_ALLOW_THREADS
    hash_init(&h, hashed ? plen : 0);
    for (size_t i = 0; i < n; i++)
        if (sg[i].length)
            copy_segment(&h, pay, (size_t)sg[i].offset, (uint8_t *)(uintptr_t)sg[i].address,
                         (size_t)sg[i].length, load);
    if (h.active)
        digest = hash_finish(&h, pay, plen);
    Py_END_ALLOW_THREADS
    if (h.active)
        result = PyLong_FromUnsignedLongLong(digest);
    else
        result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&payload);
    PyBuffer_Release(&segs);
    return result;
}

PyDoc_STRVAR(hash_doc,
"hash(payload) -> int | None\n\n"
"XXH3-64 of `payload`, or None when it is 240 bytes or shorter. Runs without the GIL.");

static PyObject *py_hash(PyObject *self, PyObject *arg) {
    Py_buffer payload;
    (void)self;
    if (PyObject_GetBuffer(arg, &payload, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    hash_state h;
    size_t plen = (size_t)payload.len;
    uint8_t *pay = (uint8_t *)payload.buf;
    uint64_t digest = 0;
    hash_init(&h, plen);
    if (h.active) {
        Py_BEGIN_ALLOW_THREADS
        digest = hash_finish(&h, pay, plen);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&payload);
    if (!h.active)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(use_isa_doc,
"use_isa(name) -> bool\n\n"
"Switch to the implementation `name` ('avx512f', 'avx2', 'portable'); False when this CPU lacks\n"
"it. All give the same results; the fastest one is chosen at import. For tests and benchmarks.");

static PyObject *py_use_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    return PyBool_FromLong(select_isa(name));
}

PyDoc_STRVAR(isa_doc, "isa() -> str\n\nThe implementation in use ('avx512f', 'avx2' or 'portable').");

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(ISA);
}

static PyMethodDef METHODS[] = {
    {"use_isa", py_use_isa, METH_O, use_isa_doc},
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"copy", py_copy, METH_VARARGS, copy_doc},
    {"hash", py_hash, METH_O, hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_copyhash",
    "Fused page copy + XXH3-64 checksum for pool payloads (see maru_vllm.native).", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copyhash(void) {
    pick_isa();
    PyObject *m = PyModule_Create(&MODULE);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MIN_HASHED_LEN", MIN_LONG_INPUT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
