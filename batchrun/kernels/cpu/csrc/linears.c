/* Linears y = x W^T + bias, fp32 and bf16, on weights packed once into column panels of PANEL_WIDTH outputs:
 * register-blocked FMA tiles (widening bf16), vdpbf16ps tiles, or AMX tiles. Threads split the panels, and the rows
 * go in chunks that stay in L2, so each weight byte is read once per chunk.
 *
 * Every output is one chain over k in order from zero, then the bias, whatever the row count, the rows beside it
 * or the thread: a row's bits never depend on its batch, at every row count. The weights stream with a software
 * prefetch PANEL_PREFETCH k-steps ahead, and the first row tiles fetch the next panel into L2 meanwhile. */
#include "common.h"

/* The register tile: PANEL_ROWS rows x PANEL_VECS vectors of PV_LANES fp32 sums (AVX-512: 8 x 3 x 16, 24 of 32
 * registers; AVX2: 4 x 3 x 8, 12 of 16). */
#if defined(__AVX512F__)
#define HAVE_PANELS 1
#define PANEL_ROWS 8
#define PV_LANES 16
#define PANEL_CHUNK_BYTES (1024 * 1024)
typedef __m512 pv;
static inline pv pv_zero(void) { return _mm512_setzero_ps(); }
static inline pv pv_set1(float x) { return _mm512_set1_ps(x); }
static inline pv pv_fma(pv a, pv b, pv c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS pv pv_load(const void *p, const int bf) {
    return bf ? (__m512)vload_bf16((const bf16 *)p) : _mm512_loadu_ps((const float *)p);
}
#define PV_IN_REGISTER(v) (void)(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_PANELS 1
#define PANEL_ROWS 4
#define PV_LANES 8
#define PANEL_CHUNK_BYTES (256 * 1024) /* half of a Zen 3 core's L2 */
typedef __m256 pv;
static inline pv pv_zero(void) { return _mm256_setzero_ps(); }
static inline pv pv_set1(float x) { return _mm256_set1_ps(x); }
static inline pv pv_fma(pv a, pv b, pv c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS pv pv_load(const void *p, const int bf) { return ld8(p, 0, bf); }
/* Keeps a weight vector in a register: GCC would fold its load into each of the 4 rows' multiply-adds. */
#define PV_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define HAVE_PANELS 0
#define PANEL_ROWS 1
#define PV_LANES 1
#define PANEL_CHUNK_BYTES 1
#endif
#define PANEL_VECS 3
#define PANEL_WIDTH (PV_LANES * PANEL_VECS)
#define PANEL_PREFETCH 32
#define PANEL_FETCHERS 8 /* the most row tiles of a panel that share fetching the next one */

/* The outputs per panel, or 0 where the panel linears do not run (no AVX-512 or AVX2). */
int f32_linear_panel(void) { return HAVE_PANELS ? PANEL_WIDTH : 0; }

/* bf16 weights on CPUs with AMX, k a multiple of its tiles' 32: pairs of k-steps interleaved (see amx_panel). */
#if HAVE_AMX
#define AMX_PANELS(k, es) ((es) == 2 && (k) % 32 == 0 && amx_allowed())
#else
#define AMX_PANELS(k, es) 0
#endif

/* bf16 weights with k even where AMX does not take them: the same pair layout, for vdpbf16ps (dot_tile);
 * BATCHRUN_BF16_DOT=0 keeps them on the widening kernel. */
#if HAVE_DPBF16 && HAVE_PANELS && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_DOT 1
static int dot_allowed(void) {
    static int state = 0; /* 1 on, -1 off; first asked outside any parallel region */
    if (state == 0) {
        const char *env = getenv("BATCHRUN_BF16_DOT");
        state = env == NULL || strcmp(env, "0") != 0 ? 1 : -1;
    }
    return state > 0;
}
#define DOT_PANELS(k, es) ((es) == 2 && (k) % 2 == 0 && !AMX_PANELS(k, es) && dot_allowed())
#else
#define HAVE_DOT 0
#define DOT_PANELS(k, es) 0
#endif

/* packed[p][i][j] = w[PANEL_WIDTH p + j][i] (0 past n), elements of `es` bytes; with AMX_PANELS or DOT_PANELS
 * packed[p][i / 2][j][i % 2] (pairs of k-steps interleaved). */
static void pack_linear(const void *w, int64_t n, int64_t k, void *packed, const int64_t es) {
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int dp = AMX_PANELS(k, es) || DOT_PANELS(k, es);
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < PANEL_WIDTH; j++) {
                const int64_t row = p * PANEL_WIDTH + j;
                const int64_t at = dp ? p * k * PANEL_WIDTH + (i / 2 * PANEL_WIDTH + j) * 2 + i % 2
                                      : (p * k + i) * PANEL_WIDTH + j;
                char *dst = (char *)packed + at * es;
                if (row < n)
                    memcpy(dst, (const char *)w + (row * k + i) * es, es);
                else
                    memset(dst, 0, es);
            }
}
void pack_f32_linear(const float *w, int64_t n, int64_t k, float *packed) { pack_linear(w, n, k, packed, 4); }
void pack_bf16_linear(const bf16 *w, int64_t n, int64_t k, bf16 *packed) { pack_linear(w, n, k, packed, 2); }

#if HAVE_PANELS
/* Vector q of a tile's rows plus the bias, stored at y (rows ldy apart); only the first `left` in a panel's tail. */
ALWAYS void panel_store(pv *acc, int rows, int64_t q, void *y, int64_t ldy, int64_t left, const void *bias,
                        const int bf) {
#if defined(__AVX512F__)
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (!bf) {
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, (const float *)bias + 16 * q) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * q, mask, _mm512_add_ps(acc[r * PANEL_VECS], b));
        return;
    }
#endif
    const int64_t es = bf ? 2 : 4, n = left < PV_LANES ? left : PV_LANES;
    float b[PV_LANES] = {0}, out[PV_LANES];
    for (int64_t j = 0; bias != NULL && j < n; j++) b[j] = ld1(bias, PV_LANES * q + j, bf);
    for (int r = 0; r < rows; r++) {
        pv v = acc[r * PANEL_VECS];
        memcpy(out, &v, sizeof out);
        char *dst = (char *)y + (r * ldy + PV_LANES * q) * es;
        if (!bf && n == PV_LANES) {
            for (int j = 0; j < PV_LANES; j++) out[j] += b[j];
            memcpy(dst, out, sizeof out);
        } else {
            for (int64_t j = 0; j < n; j++) st1(dst, j, out[j] + b[j], bf);
        }
    }
}

/* rows x width outputs at y from fp32 rows of x and kn k-steps of a panel (wbf: bf16 weights; ybf: bf16 out).
 * Blocked in k, the sums come from `part` (unless first) and go back to it (unless last): the same chain. This
 * tile, `tile` of the `tiles` sharing it, fetches its share of the next panel; without `stream` nothing. */
ALWAYS void panel_tile(const int rows, const float *x, int64_t ldx, const void *panel, int64_t kn, float *part,
                       int first, int last, void *y, int64_t ldy, int64_t width, const void *bias, const void *next,
                       int64_t tile, int64_t tiles, int stream, const int wbf, const int ybf) {
    const int64_t step = PANEL_WIDTH * (wbf ? 2 : 4); /* bytes of one k-step of a panel */
    const char *pw = panel, *pn = next;
    /* k-step fetch_at fetches row fetch_row of the next panel: evenly over the tiles' k-steps */
    int64_t fetch_row = (tile * kn + tiles - 1) / tiles, fetch_at = fetch_row * tiles - tile * kn;
    pv acc[PANEL_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = first ? pv_zero() : pv_load(part + r * PANEL_WIDTH + PV_LANES * q, 0);
    if (!stream) {
#pragma GCC unroll 4
        for (int64_t i = 0; i < kn; i++) {
            pv w[PANEL_VECS];
            for (int q = 0; q < PANEL_VECS; q++) {
                w[q] = pv_load(pw + i * step + PV_LANES * q * (wbf ? 2 : 4), wbf);
                PV_IN_REGISTER(w[q]);
            }
            for (int r = 0; r < rows; r++) {
                const pv xv = pv_set1(x[r * ldx + i]);
                for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = pv_fma(xv, w[q], acc[r][q]);
            }
        }
    }
#pragma GCC unroll 4
    for (int64_t i = 0; stream && i < kn; i++) {
        pv w[PANEL_VECS];
        for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pw + (i + PANEL_PREFETCH) * step + b, _MM_HINT_T0);
        for (int q = 0; q < PANEL_VECS; q++) w[q] = pv_load(pw + i * step + PV_LANES * q * (wbf ? 2 : 4), wbf);
        if (pn != NULL && i == fetch_at) {
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pn + fetch_row * step + b, _MM_HINT_T1);
            fetch_row++;
            fetch_at += tiles;
        }
        for (int r = 0; r < rows; r++) {
            const pv xv = pv_set1(x[r * ldx + i]);
            for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = pv_fma(xv, w[q], acc[r][q]);
        }
    }
    if (!last) {
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < PANEL_VECS; q++) memcpy(part + r * PANEL_WIDTH + PV_LANES * q, &acc[r][q], sizeof(pv));
        return;
    }
    for (int q = 0; q < PANEL_VECS; q++) {
        const int64_t left = width - PV_LANES * q;
        if (left <= 0) break;
        panel_store(&acc[0][q], rows, q, y, ldy, left, bias, ybf);
    }
}

/* panel_tile with rows and dtypes constants, not inlined: inlined, its live vectors were spilled (AVX2). */
#define PANEL_TILE_FN(R, W, Y) \
    static __attribute__((noinline)) void panel_tile_##R##_##W##Y( \
        const float *x, int64_t ldx, const void *panel, int64_t kn, float *part, int first, int last, void *y, \
        int64_t ldy, int64_t width, const void *bias, const void *next, int64_t tile, int64_t tiles, int stream) { \
        panel_tile(R, x, ldx, panel, kn, part, first, last, y, ldy, width, bias, next, tile, tiles, stream, W, Y); \
    }
#define PANEL_TILE_FNS(R) PANEL_TILE_FN(R, 0, 0) PANEL_TILE_FN(R, 1, 1) PANEL_TILE_FN(R, 0, 1)
PANEL_TILE_FNS(1) PANEL_TILE_FNS(2) PANEL_TILE_FNS(3) PANEL_TILE_FNS(4)
#if PANEL_ROWS > 4
PANEL_TILE_FNS(5) PANEL_TILE_FNS(6) PANEL_TILE_FNS(7) PANEL_TILE_FNS(8)
#endif

/* The row tiles of a chunk, rows [m0, end), on k-steps [k0, k1) of one panel (w at k0). */
ALWAYS void panel_tiles(const float *xc, int64_t ldc, int64_t m0, int64_t end, const void *w, int64_t k, int64_t k0,
                        int64_t k1, float *part, void *y, int64_t n, int64_t col, int64_t width, const void *bias,
                        const void *next, int blocked, const int wbf, const int ybf) {
    const int64_t tiles = (end - m0 + PANEL_ROWS - 1) / PANEL_ROWS;
    const int64_t fetchers = tiles < PANEL_FETCHERS ? tiles : PANEL_FETCHERS; /* tiles that fetch `next` */
    for (int64_t i = m0; i < end; i += PANEL_ROWS) {
        const int64_t t = (i - m0) / PANEL_ROWS;
        const float *xt = xc + (i - m0) * ldc + k0;
        float *pt = part + (i - m0) * PANEL_WIDTH;
        void *yt = (char *)y + (i * n + col) * (ybf ? 2 : 4);
        /* a blocked chunk's first tile brings the slice into L1; the ones after it find it there */
        const int stream = !blocked || (i == m0 && wbf == ybf), first = k0 == 0, last = k1 == k;
        const void *nt = !blocked && t < fetchers ? next : NULL;
#define PANEL_TILE(R) \
    case R: \
        if (wbf != ybf) \
            panel_tile_##R##_01(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        else if (wbf) \
            panel_tile_##R##_11(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        else \
            panel_tile_##R##_00(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        break;
        switch (end - i < PANEL_ROWS ? end - i : PANEL_ROWS) {
            PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4)
#if PANEL_ROWS > 4
            PANEL_TILE(5) PANEL_TILE(6) PANEL_TILE(7) PANEL_TILE(8)
#endif
            default: break;
        }
#undef PANEL_TILE
    }
}

#if HAVE_AMX
/* bf16 linears on AMX (AMX_PANELS): a panel is three B tiles (16 pairs of k-steps x 16 outputs), the rows go in
 * tiles of 16 with three C tiles of fp32 sums, over k in chunks of 32. The rows go a chunk of up to AMX_CHUNK_ROWS
 * at a time (past AMX_PACK_TILES tiles copied into tile order first: each A tile 1 KiB in one piece), and every
 * panel passes over the whole chunk: the weights stream from memory once per chunk. A thread's panels go in groups
 * that share each span of k of the chunk's rows while it sits in L2. With several row tiles a panel goes in k
 * blocks of up to AMX_KB chunks that stay in L1 for every tile (sums parked in `part`). Each output's sum is the
 * same chain of tile products, in k order, at any row count: the parked sums are exact fp32. */
#define AMX_ROWS 16
#define AMX_K 32
#define AMX_TILE (AMX_ROWS * AMX_K)       /* bf16 values of an A tile */
#define AMX_KB 12                         /* most chunks of a k block (a span in equal blocks): 36 KiB, in L1 */
#define AMX_CHUNK_ROWS 512                /* rows a chunk takes at most: each weight byte serves them all */
#define AMX_SPAN_BYTES (512 * 1024)       /* a chunk's rows over a span of k: they stay in L2 for a group */
#define AMX_GROUP 8                       /* panels a span of rows serves before the next span */
#define AMX_PACK_TILES 8                  /* row tiles a call reads in place: more are copied into tile order */
#define AMX_PANEL_CHUNK (AMX_K * PANEL_WIDTH * 2) /* bytes of one k chunk of a panel */

/* Rows [r0, r0 + 16) of y, panel columns [col, col + width), from the fp32 sums (16 x PANEL_WIDTH) plus b. */
static void amx_store(const float *sums, int64_t r0, int64_t rows, bf16 *y, int64_t n, int64_t col, int64_t width,
                      const vf *b) {
    for (int64_t r = 0; r < AMX_ROWS && r0 + r < rows; r++) {
        bf16 *out = y + (r0 + r) * n + col, row[PANEL_WIDTH];
        bf16 *dst = width == PANEL_WIDTH ? out : row;
        for (int q = 0; q < PANEL_VECS; q++)
            vstore_bf16(dst + PV_LANES * q, vload(sums + r * PANEL_WIDTH + PV_LANES * q) + b[q]);
        if (dst != out) memcpy(out, row, 2 * width);
    }
}

/* A row chunk's A tiles: tile t's k chunk c at a[t] + c * step, its 16 rows `stride` bytes apart. */
typedef struct {
    const bf16 **a;
    int64_t step, stride;
} AmxRows;

/* One panel (col, width outputs) for rows [m0, end) of y over the k chunks [cs, ce); part: the tiles' fp32 sums
 * before cs and after ce (cs 0: none; ce the last chunk: y written instead); next: the panel block read after this
 * one (fetched into L2 by the later row tiles of a call of more than AMX_PACK_TILES). */
static void amx_panel(const AmxRows *rows, int64_t m0, int64_t end, const char *panel, const char *next, int64_t k,
                      int64_t cs, int64_t ce, bf16 *y, int64_t n, int64_t col, int64_t width, const bf16 *bias,
                      float *part) {
    const int64_t pair_row = PANEL_WIDTH * 4, chunk = AMX_PANEL_CHUNK;
    const int64_t chunks = k / AMX_K, tiles = (end - m0 + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t blocks = tiles == 1 ? 1 : (ce - cs + AMX_KB - 1) / AMX_KB, kb = (ce - cs + blocks - 1) / blocks;
    const int64_t block_lines = kb * chunk / 64, steps = (tiles - 1) * kb;
    const int64_t per_step = next != NULL && tiles > AMX_PACK_TILES ? (block_lines + steps - 1) / steps : 0;
    float sums[AMX_ROWS * PANEL_WIDTH];
    vf b[PANEL_VECS];
    for (int q = 0; q < PANEL_VECS; q++) {
        bf16 lanes[PV_LANES] = {0};
        const int64_t left = width - PV_LANES * q;
        if (bias != NULL && left > 0) memcpy(lanes, bias + col + PV_LANES * q, 2 * (left < PV_LANES ? left : PV_LANES));
        b[q] = vload_bf16(lanes);
    }
    for (int64_t c0 = cs; c0 < ce; c0 += kb) {
        const int64_t c1 = c0 + kb < ce ? c0 + kb : ce;
        const char *ahead = c1 < ce ? panel + c1 * chunk : next;
        int64_t fetched = 0;
        for (int64_t t = 0; t < tiles; t++) {
            float *pt = part + t * AMX_ROWS * PANEL_WIDTH;
            const bf16 *at = rows->a[t];
            if (c0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
            } else {
                _tile_loadd(0, pt, PANEL_WIDTH * 4);
                _tile_loadd(1, pt + 16, PANEL_WIDTH * 4);
                _tile_loadd(2, pt + 32, PANEL_WIDTH * 4);
            }
            for (int64_t c = c0; c < c1; c++) {
                const char *w = panel + c * chunk;
                if (t == 0) /* the first row tile brings the block into L1; the others find it there */
                    for (int64_t line = 0; line < chunk; line += 64) _mm_prefetch(w + 2 * chunk + line, _MM_HINT_T0);
                else
                    for (int64_t i = 0; i < per_step && fetched < block_lines; i++, fetched++)
                        _mm_prefetch(ahead + fetched * 64, _MM_HINT_T1);
                _tile_loadd(3, at + c * rows->step, rows->stride);
                _tile_loadd(4, w, pair_row);
                _tile_loadd(5, w + 64, pair_row);
                _tile_loadd(6, w + 128, pair_row);
                _tile_dpbf16ps(0, 3, 4);
                _tile_dpbf16ps(1, 3, 5);
                _tile_dpbf16ps(2, 3, 6);
            }
            float *dst = c1 == chunks ? sums : pt;
            _tile_stored(0, dst, PANEL_WIDTH * 4);
            _tile_stored(1, dst + 16, PANEL_WIDTH * 4);
            _tile_stored(2, dst + 32, PANEL_WIDTH * 4);
            if (c1 == chunks) amx_store(sums, m0 + t * AMX_ROWS, end, y, n, col, width, b);
        }
    }
}

/* Rows [m0, end) of x [rows, k] copied into tile order at xa (each tile's k chunk one 1 KiB piece, the last tile's
 * missing rows zero); in the enclosing parallel region's threads, with its barrier. */
static void amx_pack_rows(const bf16 *x, int64_t m0, int64_t end, int64_t k, bf16 *xa) {
    const int64_t chunks = k / AMX_K, tiles = (end - m0 + AMX_ROWS - 1) / AMX_ROWS;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r = 0; r < AMX_ROWS; r++) {
            const int64_t row = m0 + t * AMX_ROWS + r;
            bf16 *dst = xa + t * chunks * AMX_TILE + r * AMX_K;
            for (int64_t c = 0; c < chunks; c++, dst += AMX_TILE) {
                if (row < end)
                    memcpy(dst, x + row * k + c * AMX_K, AMX_K * 2);
                else
                    memset(dst, 0, AMX_K * 2);
            }
        }
}

/* The rows of a chunk: at most AMX_CHUNK_ROWS, in equal whole tiles. */
static int64_t amx_chunk_rows(int64_t rows) {
    const int64_t chunks = (rows + AMX_CHUNK_ROWS - 1) / AMX_CHUNK_ROWS;
    return ((rows + chunks - 1) / chunks + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
}

/* The k chunks of a span: k in equal spans, each keeping a row chunk's rows within AMX_SPAN_BYTES (at least a k
 * block's worth). */
static int64_t amx_span_chunks(int64_t chunk_rows, int64_t chunks) {
    int64_t most = AMX_SPAN_BYTES / (chunk_rows * AMX_K * 2);
    if (most < AMX_KB) most = AMX_KB;
    const int64_t spans = (chunks + most - 1) / most;
    return (chunks + spans - 1) / spans;
}

/* A thread's scratch, kept between calls (the pool's threads live as long as the process): no allocation, and no
 * page faults, per call. NULL without memory. */
static void *amx_scratch(int slot, size_t bytes) {
    static __thread void *buffers[2];
    static __thread size_t sizes[2];
    if (sizes[slot] < bytes) {
        free(buffers[slot]);
        buffers[slot] = malloc(bytes);
        sizes[slot] = buffers[slot] != NULL ? bytes : 0;
    }
    return buffers[slot];
}

/* y = x W^T + bias on AMX_PANELS weights; 1 without memory. Each thread takes a run of panels, a group of
 * AMX_GROUP at a time, and for each span of k the group's panels pass over the row chunk's rows there. A call of
 * up to AMX_PACK_TILES row tiles reads x in place (a call of under 16 rows on tiles of its rows, else its last short
 * tile through a zero-padded copy); a larger one copies each row chunk into tile order first. */
static int linear_amx(const bf16 *x, int64_t rows, const void *packed, int64_t n, int64_t k, const bf16 *bias,
                      bf16 *y) {
    const int64_t chunk = amx_chunk_rows(rows), chunks = k / AMX_K, panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int64_t span = amx_span_chunks(chunk, chunks), panel_bytes = k * PANEL_WIDTH * 2;
    const int64_t tiles = chunk / AMX_ROWS, full = rows / AMX_ROWS * AMX_ROWS;
    const int packs = rows > AMX_PACK_TILES * AMX_ROWS;
    /* the copied rows (a chunk in tile order, or the last short tile), then the tile pointers */
    const size_t copy_bytes = sizeof(bf16) * (packs ? chunk : AMX_ROWS) * k;
    char *shared = amx_scratch(0, copy_bytes + sizeof(bf16 *) * tiles);
    if (shared == NULL) return 1;
    bf16 *copy = (bf16 *)shared;
    AmxRows tiled = {(const bf16 **)(shared + copy_bytes), packs ? AMX_TILE : AMX_K, packs ? AMX_K * 2 : k * 2};
    if (packs) {
        for (int64_t t = 0; t < tiles; t++) tiled.a[t] = copy + t * chunks * AMX_TILE;
    } else if (rows < AMX_ROWS) { /* one short tile, read in place: the tiles are configured to its rows */
        tiled.a[0] = x;
    } else {
        memset(copy, 0, sizeof(bf16) * AMX_ROWS * k);
        memcpy(copy, x + full * k, sizeof(bf16) * (rows - full) * k);
        for (int64_t t = 0; t < tiles; t++) tiled.a[t] = t * AMX_ROWS < full ? x + t * AMX_ROWS * k : copy;
    }
    const int64_t spans = (chunks + span - 1) / span, parked = spans > 1 ? AMX_GROUP : 1;
    int failed = 0;
#pragma omp parallel if (n * k > PAR_MIN_WORK) reduction(| : failed)
    {
        float *part = amx_scratch(1, sizeof(float) * parked * chunk * PANEL_WIDTH);
        failed = part == NULL;
        if (!failed) amx_configure_rows(rows < AMX_ROWS ? (int)rows : AMX_ROWS);
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
        for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
            const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
            if (packs) amx_pack_rows(x, m0, end, k, copy);
            for (int64_t g0 = p0; g0 < p1 && part != NULL; g0 += AMX_GROUP) {
                const int64_t g1 = g0 + AMX_GROUP < p1 ? g0 + AMX_GROUP : p1;
                const char *group = (const char *)packed + g0 * panel_bytes;
                for (int64_t s0 = 0; s0 < chunks; s0 += span) {
                    const int64_t s1 = s0 + span < chunks ? s0 + span : chunks;
                    for (int64_t p = g0; p < g1; p++) {
                        const char *panel = (const char *)packed + p * panel_bytes;
                        const char *next = p + 1 < g1 ? panel + panel_bytes + s0 * AMX_PANEL_CHUNK
                                           : s1 < chunks ? group + s1 * AMX_PANEL_CHUNK
                                           : g1 < p1 ? group + (g1 - g0) * panel_bytes : NULL;
                        const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
                        const AmxRows here = {tiled.a + (packs ? 0 : m0 / AMX_ROWS), tiled.step, tiled.stride};
                        amx_panel(&here, m0, end, panel, next, k, s0, s1, y, n, col, width, bias,
                                  part + (spans > 1 ? p - g0 : 0) * chunk * PANEL_WIDTH);
                    }
                }
            }
            if (packs) {
#pragma omp barrier
            }
        }
        if (!failed) _tile_release();
    }
    return failed;
}
#endif

#if HAVE_DOT
/* bf16 linears on vdpbf16ps (DOT_PANELS: AVX512-BF16, no AMX): the widening kernel's tile over pairs of k-steps,
 * x read as bf16 in place. Each output is one chain of vdpbf16ps over the pairs in order (the instruction's
 * rounding, denormals flushed), then the bias: the same at any row count. */
#define DOT_FETCHERS PANEL_FETCHERS

ALWAYS void dot_tile(const int rows, const bf16 *x, int64_t ldx, const char *panel, int64_t k, bf16 *y, int64_t ldy,
                     int64_t width, const bf16 *bias, const char *next, int64_t tile, int64_t tiles) {
    const int64_t step = PANEL_WIDTH * 4, kp = k / 2; /* bytes of one pair of k-steps of the panel; pairs */
    int64_t fetch_row = (tile * kp + tiles - 1) / tiles, fetch_at = fetch_row * tiles - tile * kp;
    __m512 acc[PANEL_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t i = 0; i < kp; i++) {
        const char *pw = panel + i * step;
        for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pw + PANEL_PREFETCH / 2 * step + b, _MM_HINT_T0);
        __m512bh w[PANEL_VECS];
        for (int q = 0; q < PANEL_VECS; q++) memcpy(&w[q], pw + 64 * q, 64);
        if (next != NULL && i == fetch_at) {
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch(next + fetch_row * step + b, _MM_HINT_T1);
            fetch_row++;
            fetch_at += tiles;
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, 4);
            const __m512bh xp = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xp, w[q]);
        }
    }
    for (int q = 0; q < PANEL_VECS; q++) {
        const int64_t left = width - 16 * q;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias != NULL ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                             _mm256_maskz_loadu_epi16(mask, bias + 16 * q)), 16)) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * q, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][q], b)));
    }
}

#define DOT_TILE_FN(R) \
    static __attribute__((noinline)) void dot_tile_##R(const bf16 *x, int64_t ldx, const char *panel, int64_t k, \
                                                       bf16 *y, int64_t ldy, int64_t width, const bf16 *bias, \
                                                       const char *next, int64_t tile, int64_t tiles) { \
        dot_tile(R, x, ldx, panel, k, y, ldy, width, bias, next, tile, tiles); \
    }
DOT_TILE_FN(1) DOT_TILE_FN(2) DOT_TILE_FN(3) DOT_TILE_FN(4) DOT_TILE_FN(5) DOT_TILE_FN(6) DOT_TILE_FN(7) DOT_TILE_FN(8)

/* y = x W^T + bias on DOT_PANELS weights, in row chunks that stay in L2 (no shared copy of x: no barrier). */
static void linear_dot(const bf16 *x, int64_t rows, const void *packed, int64_t n, int64_t k, const bf16 *bias,
                       bf16 *y) {
    int64_t chunk = PANEL_CHUNK_BYTES / (4 * k) / PANEL_ROWS * PANEL_ROWS;
    if (chunk < PANEL_ROWS) chunk = PANEL_ROWS;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    chunk = ((rows + chunks - 1) / chunks + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
#pragma omp parallel if (n * k > PAR_MIN_WORK)
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
        const int64_t tiles = (end - m0 + PANEL_ROWS - 1) / PANEL_ROWS;
        const int64_t fetchers = tiles < DOT_FETCHERS ? tiles : DOT_FETCHERS;
        /* nowait: a thread's panels are the same in every chunk, and no chunk needs another thread's results */
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const char *panel = (const char *)packed + p * k * PANEL_WIDTH * 2;
            const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
            const bf16 *b = bias != NULL ? bias + col : NULL;
            const char *next = p + 1 < panels ? panel + k * PANEL_WIDTH * 2 : NULL;
            for (int64_t i = m0; i < end; i += PANEL_ROWS) {
                const int64_t t = (i - m0) / PANEL_ROWS;
                const bf16 *xt = x + i * k;
                bf16 *yt = y + i * n + col;
                const char *nt = t < fetchers ? next : NULL;
                switch (end - i < PANEL_ROWS ? end - i : PANEL_ROWS) {
                    case 1: dot_tile_1(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 2: dot_tile_2(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 3: dot_tile_3(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 4: dot_tile_4(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 5: dot_tile_5(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 6: dot_tile_6(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    case 7: dot_tile_7(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                    default: dot_tile_8(xt, k, panel, k, yt, n, width, b, nt, t, fetchers); break;
                }
            }
        }
    }
}
#endif

/* A chunk of at least PANEL_BLOCK_TILES row tiles walks each panel in slices of PANEL_KC k-steps that stay in L1
 * (fp32: 24 KiB), every tile in turn, a bf16 slice widened once; AVX-512 keeps one pass (PANEL_KC 0). */
#define PANEL_BLOCK_TILES 4
#if PV_LANES == 8
#define PANEL_KC (24576 / (PANEL_WIDTH * 4) / 8 * 8)
#else
#define PANEL_KC 0
#endif

/* One thread's share of linear_panels, the dtype a constant: bf16 rows of x are widened a chunk at a time into the
 * shared xf by one thread; in a blocked chunk each bf16 weight slice into the thread's own wf. */
ALWAYS void panel_rows(const void *x, int64_t ldx, int64_t rows, const void *packed, int64_t n, int64_t k,
                       const void *bias, void *y, int64_t chunk, float *xf, float *part, float *wf, const int bf) {
    const int64_t es = bf ? 2 : 4, panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int blocked = part != NULL;
    const int64_t kc = blocked ? PANEL_KC : k, ldc = bf ? k : ldx;
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
        const float *xc = bf ? xf : (const float *)x + m0 * ldx; /* the chunk's fp32 rows, ldc apart */
        if (bf) {
#pragma omp single
            for (int64_t i = 0; i < (end - m0) * k; i++) xf[i] = bf16_to_f(((const bf16 *)x)[m0 * ldx + i]);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const char *panel = (const char *)packed + p * k * PANEL_WIDTH * es;
            const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
            const void *b = bias != NULL ? (const char *)bias + col * es : NULL;
            const void *next = p + 1 < panels ? panel + k * PANEL_WIDTH * es : NULL;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t k1 = k0 + kc < k ? k0 + kc : k;
                const char *w = panel + k0 * PANEL_WIDTH * es;
                if (bf && blocked) {
                    for (int64_t i = 0; i < (k1 - k0) * PANEL_WIDTH; i++) wf[i] = bf16_to_f(((const bf16 *)w)[i]);
                    panel_tiles(xc, ldc, m0, end, wf, k, k0, k1, part, y, n, col, width, b, next, 1, 0, 1);
                } else {
                    panel_tiles(xc, ldc, m0, end, w, k, k0, k1, part, y, n, col, width, b, next, blocked, bf, bf);
                }
            }
        }
    }
}

/* y [rows, n] = x [rows, k] W^T + bias, all fp32 (x's rows ldx apart) or bf16 (contiguous); 1 without memory. */
static int linear_panels(const void *x, int64_t ldx, int64_t rows, const void *packed, int64_t n, int64_t k,
                         const void *bias, void *y, int bf) {
    int64_t chunk = PANEL_CHUNK_BYTES / (4 * k) / PANEL_ROWS * PANEL_ROWS;
    if (chunk < PANEL_ROWS) chunk = PANEL_ROWS;
    const int64_t chunks = (rows + chunk - 1) / chunk; /* equal chunks: 256 rows are not 224 + 32 */
    chunk = ((rows + chunks - 1) / chunks + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    const int blocked = PANEL_KC > 0 && k > PANEL_KC && (chunk < rows ? chunk : rows) >= PANEL_BLOCK_TILES * PANEL_ROWS;
    float *xf = bf ? malloc(sizeof(float) * (chunk < rows ? chunk : rows) * k) : NULL;
    if (bf && xf == NULL) return 1;
#pragma omp parallel if (n * k > PAR_MIN_WORK)
    {
        /* the tiles' sums between k slices, and a widened bf16 weight slice (none: one pass) */
        float *part = blocked ? malloc(sizeof(float) * (chunk + PANEL_KC) * PANEL_WIDTH) : NULL;
        BY_DTYPE(bf, panel_rows, x, ldx, rows, packed, n, k, bias, y, chunk, xf, part,
                 part != NULL ? part + chunk * PANEL_WIDTH : NULL);
        free(part);
    }
    free(xf);
    return 0;
}
#endif

/* y [rows, n] = x [rows, k] (rows ldx apart) W^T + bias (NULL or [n]); a no-op where f32_linear_panel() is 0. */
void linear_f32(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t n, int64_t k,
                const float *bias, float *y) {
#if HAVE_PANELS
    if (rows > 0) linear_panels(x, ldx, rows, packed, n, k, bias, y, 0);
#else
    (void)x, (void)ldx, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
}

/* Whether bf16 linears with an even k run on vdpbf16ps here (where AMX does not take them). */
int dot_linears(void) {
#if HAVE_DOT
    return dot_allowed();
#else
    return 0;
#endif
}

/* Whether bf16 linears with k a multiple of 32 run on AMX tiles here. */
int amx_linears(void) {
#if HAVE_AMX
    return amx_allowed();
#else
    return 0;
#endif
}

/* The same in bf16 (x's rows contiguous), each fp32 sum rounded once; 1 without scratch memory (y not written). */
int linear_bf16(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, const bf16 *bias, bf16 *y) {
#if HAVE_AMX
    if (AMX_PANELS(k, 2)) return rows > 0 ? linear_amx(x, rows, packed, n, k, bias, y) : 0;
#endif
#if HAVE_DOT
    if (DOT_PANELS(k, 2)) {
        if (rows > 0) linear_dot(x, rows, packed, n, k, bias, y);
        return 0;
    }
#endif
#if HAVE_PANELS
    if (rows > 0) return linear_panels(x, k, rows, packed, n, k, bias, y, 1);
#else
    (void)x, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
    return 0;
}
