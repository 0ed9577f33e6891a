/* A step's forward up to the logits in one call: the token embeddings, then each layer's RMSNorm, q|k|v, RoPE, the
 * KV store, paged attention, o_proj, the residual add with the second norm, gate|up, the gated activation and down
 * (a sandwich layer also norms each block's output; a residual scale multiplies it), then the final norm, in that
 * order, through the same kernels and with the same arguments as the Python path makes them, so every output has
 * its bits. The step's plan (positions, slots, block tables, rows) is set once
 * for all layers; the activations live in one workspace the caller keeps. */
#include "common.h"

/* linears.c, quant_linears.c, elementwise.c, attention.c, logits.c, moe.c */
extern void linear_f32(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t n, int64_t k,
                       const float *bias, float *y);
extern int linear_bf16(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, const bf16 *bias,
                       bf16 *y);
extern int quant_linear(const void *x, int64_t rows, int64_t k, int xbf, const uint8_t *packed, const float *pscale,
                        const float *poffset, int64_t n, int64_t wgs, int64_t gs, int bits, const void *bias, void *y,
                        int ybf, int plain);
extern void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps, int add, int res_fp32, int bf);
extern void silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf);
extern void gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf);
extern void add_residual(const void *x, void *residual, void *out, int64_t rows, int64_t dim, int res_fp32, int bf);
extern void rms_norm_heads(const void *x, int64_t stride, const void *weight, void *out, int64_t tokens,
                           int64_t heads, int64_t dim, float eps, int bf);
extern void rope(void *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, int64_t rot,
                 const int64_t *positions, const float *cos_t, const float *sin_t, int bf);
extern int paged_attention(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                           int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out,
                           int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf,
                           int64_t amx_lanes, int64_t window, float softcap);
extern void store_kv(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
                     int64_t width, void *kc, void *vc, int64_t elsize);
extern int paged_attention_int8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                                int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out,
                                int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf,
                                int64_t window, float softcap);
extern int greedy_bf16(const bf16 *x, int64_t rows, const bf16 *packed, const bf16 *weight, int64_t n, int64_t k,
                       int64_t top, int64_t *tokens);
extern void store_kv_fp8(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
                         int64_t width, void *kc, void *vc, int bf, int e5m2);
extern int paged_attention_fp8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                               int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out,
                               int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf,
                               int64_t window, float softcap, int e5m2);
extern void moe_route(const void *logits, int64_t rows, int64_t experts, int64_t top_k, int normalize, int bf,
                      float *weights, int64_t *chosen);
extern void moe_combine(const void *outputs, const int64_t *where, const float *weights, const int64_t *chosen,
                        int64_t rows, int64_t top_k, int64_t hidden, void *out, int bf);
extern void moe_add_shared(void *out, const void *shared, const void *gate_logits, int64_t rows, int64_t hidden,
                           int bf);
extern void store_kv_int8(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
                          int64_t hkv, int64_t d, void *kc, void *vc, int bf);

enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_QUANT = 2 };
enum { LAYER_PRE_NORM = 0, LAYER_SANDWICH = 1, LAYER_POST_NORM = 2 };
enum { ROPE_GLOBAL = 0, ROPE_LOCAL = 1 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { KV_MODEL_DTYPE = 0, KV_INT8 = 1, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

/* One linear as its module holds it: panels (fp32 or bf16) or a quantized weight's packed panels. */
typedef struct {
    int64_t kind, n, k;
    const void *packed, *bias;
    const float *scale, *offset; /* LINEAR_QUANT: the packed scales, the 4-bit offsets (NULL for int8) */
    int64_t weight_group, group, bits, plain;
} NativeLinear;

typedef struct {
    NativeLinear qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    /* q and k RMSNorm weights, or NULL: per head [head_dim] (Qwen3, Gemma 3), or with DecoderShape.qk_proj over the
     * whole projection [q | kv] (OLMo 2) */
    const void *q_norm, *k_norm;
    /* LAYER_SANDWICH (Gemma 2, 3): post_norm norms the attention's output, pre_ff_norm adds it and norms the MLP's
     * input, post_ff_norm norms the MLP's output. LAYER_POST_NORM (OLMo 2): no input_norm; post_norm norms the
     * attention's output and post_ff_norm the MLP's, each added to the stream by the next block */
    const void *pre_ff_norm, *post_ff_norm;
    int64_t kind, window, rope;
    float scale, softcap, residual_scale; /* residual_scale: each block's output times it (Granite; 1: none) */
    /* a sparse MoE block instead of the gated MLP where experts is set: the router's linear, and each expert's
     * gate|up and down at experts[2 e] and experts[2 e + 1]; with inter, the shared expert's in gate_up and down and
     * its gate's linear (one output) in shared_gate */
    NativeLinear router;
    const NativeLinear *experts;
    NativeLinear shared_gate;
    int64_t inter; /* gate_up and down's intermediate size: the gated MLP's, or the shared expert's (0: none) */
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, rot, block_size;
    int64_t activation, kv_format, amx_lanes, bf, res_fp32, qk_proj;
    /* MoE layers: their experts (0: none), each row's top_k of them, renormalised or not; inter is an expert's
     * intermediate size */
    int64_t experts, top_k, normalize;
    float eps, embed_scale; /* embed_scale: the embeddings times it, rounded to the model's dtype (0: none) */
} DecoderShape;

typedef struct {
    const int64_t *ids;  /* [rows]: the step's token ids */
    const void *embed;   /* [vocab, hidden]: the embedding table, in the model's dtype */
    int64_t vocab;
    const void *final_norm; /* [hidden]: the final RMSNorm's weight */
    void *residual;      /* [rows, hidden] in the residual dtype: the stream, hidden state before the final norm */
    void *x;             /* [rows, hidden]: the embeddings, then each layer's output */
    void *h;             /* [rows, hidden]: each norm's output; the final norm's on return */
    void *qkv, *attn, *gate_up, *act; /* the workspace: [rows, q + 2 kv | q | 2 inter | inter], inter the widest */
    void *q_normed, *k_normed, *v_copy; /* with q/k norms: [rows, q | kv | kv] */
    int64_t rows;
    const int64_t *positions, *slots;
    const float *cos_t, *sin_t, *cos_local, *sin_local; /* the global rotary tables, and the ROPE_LOCAL layers' */
    const int32_t *block_tables, *row_seq, *row_len;
    int64_t bt_stride;
    char *kv;                        /* the pool: layer l's K at kv + l * layer_bytes, its V half_bytes after */
    int64_t layer_bytes, half_bytes;
    /* with lm_packed (bf16 models): each row's greedy token into tokens, as logits.c's greedy_bf16 finds it from
     * the lm_head's panels and plain weight [lm_n, hidden] */
    const void *lm_packed, *lm_weight;
    int64_t lm_n, top;
    int64_t *tokens;
    /* MoE layers' workspace: router logits [rows, experts], one expert's input rows [rows, hidden], each pair's
     * expert output [rows * top_k, hidden] (by expert); each pair's weight and expert [rows * top_k], where its
     * output lies and which pair each output row is [rows * top_k]; each expert's first output row and a cursor
     * [2 (experts + 1)] */
    void *router_logits, *expert_in, *expert_out;
    float *route_weights;
    int64_t *route_experts, *pair_row, *row_pair, *expert_start;
} DecoderStep;

/* y [rows, n] = x [rows, k] W^T + b; nonzero where a kernel found no scratch memory. */
static int run_linear(const NativeLinear *w, const void *x, int64_t rows, void *y, int bf) {
    switch (w->kind) {
    case LINEAR_F32:
        linear_f32(x, w->k, rows, w->packed, w->n, w->k, w->bias, y);
        return 0;
    case LINEAR_BF16:
        return linear_bf16(x, rows, w->packed, w->n, w->k, w->bias, y);
    default:
        return quant_linear(x, rows, w->k, bf, w->packed, w->scale, w->offset, w->n, w->weight_group, w->group,
                            (int)w->bits, w->bias, y, bf, (int)w->plain);
    }
}

/* Columns [col, col + width) of `rows` rows `stride` apart, into a contiguous [rows, width]: the copy torch's
 * .contiguous() makes of a q / k / v view. */
static void copy_columns(const char *src, int64_t stride, int64_t rows, int64_t width, char *dst, int64_t elsize) {
#pragma omp parallel for if (rows * width > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * width * elsize, src + r * stride * elsize, width * elsize);
}

static int attention(const DecoderShape *s, const DecoderLayer *layer, const DecoderStep *t, int64_t l) {
    const int bf = (int)s->bf;
    const int64_t q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t elsize = bf ? 2 : 4;
    int64_t q_stride = q_size + 2 * kv_size, kv_stride = q_stride;
    char *q = t->qkv, *k = q + q_size * elsize, *v = k + kv_size * elsize;
    char *kc = t->kv + l * t->layer_bytes, *vc = kc + t->half_bytes;
    if (layer->q_norm != NULL) { /* q/k norms into contiguous rows, as the Python layer takes them */
        const int64_t q_heads = s->qk_proj ? 1 : s->heads, kv_heads = s->qk_proj ? 1 : s->kv_heads;
        rms_norm_heads(q, q_stride, layer->q_norm, t->q_normed, t->rows, q_heads, q_size / q_heads, s->eps, bf);
        rms_norm_heads(k, q_stride, layer->k_norm, t->k_normed, t->rows, kv_heads, kv_size / kv_heads, s->eps, bf);
        copy_columns(v, q_stride, t->rows, kv_size, t->v_copy, elsize);
        q = t->q_normed, k = t->k_normed, v = t->v_copy, q_stride = q_size, kv_stride = kv_size;
    }
    const float *cos_t = layer->rope == ROPE_LOCAL ? t->cos_local : t->cos_t;
    const float *sin_t = layer->rope == ROPE_LOCAL ? t->sin_local : t->sin_t;
    rope(q, q_stride, t->rows, s->heads, s->head_dim, s->rot, t->positions, cos_t, sin_t, bf);
    rope(k, kv_stride, t->rows, s->kv_heads, s->head_dim, s->rot, t->positions, cos_t, sin_t, bf);
    if (s->kv_format == KV_INT8) {
        store_kv_int8(k, v, kv_stride, t->slots, t->rows, s->kv_heads, s->head_dim, kc, vc, bf);
        return paged_attention_int8(q, q_stride, kc, vc, t->block_tables, t->bt_stride, t->row_seq, t->row_len,
                                    t->attn, t->rows, s->heads, s->kv_heads, s->head_dim, s->block_size,
                                    layer->scale, bf, layer->window, layer->softcap);
    }
    if (s->kv_format == KV_FP8_E4M3 || s->kv_format == KV_FP8_E5M2) {
        const int e5m2 = s->kv_format == KV_FP8_E5M2;
        store_kv_fp8(k, v, kv_stride, t->slots, t->rows, kv_size, kc, vc, bf, e5m2);
        return paged_attention_fp8(q, q_stride, kc, vc, t->block_tables, t->bt_stride, t->row_seq, t->row_len,
                                   t->attn, t->rows, s->heads, s->kv_heads, s->head_dim, s->block_size, layer->scale,
                                   bf, layer->window, layer->softcap, e5m2);
    }
    store_kv(k, v, kv_stride, t->slots, t->rows, kv_size, kc, vc, elsize);
    return paged_attention(q, q_stride, kc, vc, t->block_tables, t->bt_stride, t->row_seq, t->row_len, t->attn,
                           t->rows, s->heads, s->kv_heads, s->head_dim, s->block_size, layer->scale, bf,
                           s->amx_lanes, layer->window, layer->softcap);
}

/* row[i] *= scale for i < n, in the row's dtype (bf16: the fp32 product rounded). */
static void scale_row(void *row, int64_t n, float scale, int bf) {
    if (bf) {
        bf16 *v = row;
        for (int64_t i = 0; i < n; i++) v[i] = f_to_bf16(bf16_to_f(v[i]) * scale);
    } else {
        float *v = row;
        for (int64_t i = 0; i < n; i++) v[i] *= scale;
    }
}

/* Each row's embedding into x (times the embedding scale), and into the residual stream in its dtype (bf16 to
 * fp32 is exact); 0, or 2 where an id is outside the table (nothing read). */
static int embed_rows(const DecoderShape *s, const DecoderStep *t) {
    const int64_t hidden = s->hidden, elsize = s->bf ? 2 : 4;
    for (int64_t r = 0; r < t->rows; r++)
        if (t->ids[r] < 0 || t->ids[r] >= t->vocab) return 2;
#pragma omp parallel for if (t->rows * hidden > PAR_MIN_WORK)
    for (int64_t r = 0; r < t->rows; r++) {
        char *x = (char *)t->x + r * hidden * elsize;
        memcpy(x, (const char *)t->embed + t->ids[r] * hidden * elsize, hidden * elsize);
        if (s->embed_scale != 0.0f) scale_row(x, hidden, s->embed_scale, (int)s->bf);
        if (s->bf && s->res_fp32) {
            float *res = (float *)t->residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] = bf16_to_f(((const bf16 *)x)[i]);
        } else {
            memcpy((char *)t->residual + r * hidden * elsize, x, hidden * elsize);
        }
    }
    return 0;
}

/* x[rows, n] *= scale in place, each value rounded to the dtype: torch's product of a tensor and a float. */
static void scale_rows(void *x, int64_t rows, int64_t n, float scale, int bf) {
#pragma omp parallel for if (rows * n > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) scale_row((char *)x + r * n * (bf ? 2 : 4), n, scale, bf);
}

/* x = o_proj(attention(qkv_proj(in))) of layer l; nonzero where a kernel found no scratch memory. */
static int attention_block(const DecoderShape *s, const DecoderLayer *layer, const DecoderStep *t, int64_t l,
                           const void *in) {
    const int bf = (int)s->bf;
    return run_linear(&layer->qkv, in, t->rows, t->qkv, bf) || attention(s, layer, t, l) ||
           run_linear(&layer->o, t->attn, t->rows, t->x, bf);
}

/* out [rows] = down(act(gate_up(in))), `inter` wide inside; nonzero where a linear found no scratch memory. */
static int gated_mlp(const DecoderShape *s, const DecoderStep *t, const NativeLinear *gate_up, const NativeLinear *down,
                     const void *in, int64_t rows, int64_t inter, void *out) {
    const int bf = (int)s->bf;
    if (run_linear(gate_up, in, rows, t->gate_up, bf)) return 1;
    if (s->activation == ACT_SILU)
        silu_mul(t->gate_up, t->act, rows, inter, bf);
    else
        gelu_tanh_mul(t->gate_up, t->act, rows, inter, bf);
    return run_linear(down, t->act, rows, out, bf);
}

/* out = the sparse MoE block of `in` (arch/moe.py's calls): the router's linear and moe_route; the pairs (row, its
 * j-th expert) sorted by expert, stable, and each expert's rows gathered and run through its gated MLP, experts in
 * ascending order; moe_combine; then a shared expert's gated output added (moe_add_shared). Nonzero where a linear
 * found no scratch memory. */
static int moe_mlp(const DecoderShape *s, const DecoderLayer *layer, const DecoderStep *t, const void *in, void *out) {
    const int bf = (int)s->bf;
    const int64_t rows = t->rows, top_k = s->top_k, experts = s->experts, pairs = rows * top_k;
    const int64_t row_bytes = s->hidden * (bf ? 2 : 4);
    if (run_linear(&layer->router, in, rows, t->router_logits, bf)) return 1;
    moe_route(t->router_logits, rows, experts, top_k, (int)s->normalize, bf, t->route_weights, t->route_experts);
    int64_t *start = t->expert_start, *cursor = start + experts + 1;
    memset(start, 0, (experts + 1) * sizeof *start);
    for (int64_t p = 0; p < pairs; p++) start[t->route_experts[p] + 1]++;
    for (int64_t e = 0; e < experts; e++) start[e + 1] += start[e];
    memcpy(cursor, start, (experts + 1) * sizeof *start);
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t row = cursor[t->route_experts[p]]++;
        t->pair_row[p] = row;
        t->row_pair[row] = p;
    }
    for (int64_t e = 0; e < experts; e++) {
        const int64_t first = start[e], count = start[e + 1] - first;
        if (!count) continue;
        for (int64_t i = 0; i < count; i++)
            memcpy((char *)t->expert_in + i * row_bytes, (const char *)in + t->row_pair[first + i] / top_k * row_bytes,
                   row_bytes);
        const NativeLinear *gate_up = layer->experts + 2 * e;
        if (gated_mlp(s, t, gate_up, gate_up + 1, t->expert_in, count, s->inter,
                      (char *)t->expert_out + first * row_bytes))
            return 1;
    }
    moe_combine(t->expert_out, t->pair_row, t->route_weights, t->route_experts, rows, top_k, s->hidden, out, bf);
    if (!layer->inter) return 0;
    /* the shared expert into expert_in, its gate's logits into router_logits (both free now) */
    if (gated_mlp(s, t, &layer->gate_up, &layer->down, in, rows, layer->inter, t->expert_in) ||
        run_linear(&layer->shared_gate, in, rows, t->router_logits, bf))
        return 1;
    moe_add_shared(out, t->expert_in, t->router_logits, rows, s->hidden, bf);
    return 0;
}

/* The layer's gated MLP, or its MoE block: nonzero where a linear found no scratch memory. */
static int mlp(const DecoderShape *s, const DecoderLayer *layer, const DecoderStep *t, const void *in, void *out) {
    if (layer->experts) return moe_mlp(s, layer, t, in, out);
    return gated_mlp(s, t, &layer->gate_up, &layer->down, in, t->rows, layer->inter, out);
}

/* LAYER_POST_NORM: h = stream + x (layer 0: the embeddings, which the stream holds); stream = h + norm(attention(h));
 * x = norm(mlp(stream)), the layer's output, which the next layer adds. Each block's input is the stream rounded to
 * the model's dtype, as the Python layer's `.to(x.dtype)`. */
static int post_norm_layer(const DecoderShape *s, const DecoderLayer *layer, const DecoderStep *t, int64_t l) {
    const int bf = (int)s->bf, res_fp32 = (int)s->res_fp32;
    const int64_t rows = t->rows, hidden = s->hidden;
    void *in = t->x;
    if (l) {
        add_residual(t->x, t->residual, t->h, rows, hidden, res_fp32, bf);
        in = t->h;
    }
    if (attention_block(s, layer, t, l, in)) return 1;
    rms_norm(t->x, NULL, layer->post_norm, t->h, rows, hidden, s->eps, 0, 0, bf);
    add_residual(t->h, t->residual, t->x, rows, hidden, res_fp32, bf);
    if (mlp(s, layer, t, t->x, t->h)) return 1;
    rms_norm(t->h, NULL, layer->post_ff_norm, t->x, rows, hidden, s->eps, 0, 0, bf);
    return 0;
}

/* The step's forward to the final norm's output (in h), and its greedy tokens where asked: 0 when done, 1 where a
 * kernel found no scratch memory, 2 where a token id is outside the embedding table, 3 where the greedy tokens were
 * asked and a row has a NaN (h is done, tokens unset). */
int decoder_forward(const DecoderShape *s, const DecoderLayer *layers, int64_t num_layers, const DecoderStep *t) {
    const int bf = (int)s->bf, res_fp32 = (int)s->res_fp32;
    const int64_t rows = t->rows;
    if (embed_rows(s, t)) return 2;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecoderLayer *layer = layers + l;
        if (layer->kind == LAYER_POST_NORM) {
            if (post_norm_layer(s, layer, t, l)) return 1;
            continue;
        }
        /* layer 0 norms the embeddings (the residual holds them already); later layers add their input first */
        rms_norm(t->x, l ? t->residual : NULL, layer->input_norm, t->h, rows, s->hidden, s->eps, l > 0, res_fp32, bf);
        if (attention_block(s, layer, t, l, t->h)) return 1;
        const int sandwich = layer->kind == LAYER_SANDWICH, scaled = layer->residual_scale != 1.0f;
        if (scaled) scale_rows(t->x, rows, s->hidden, layer->residual_scale, bf);
        void *mlp_in = t->h, *mlp_out = t->x; /* sandwich: the MLP between h and x the other way round */
        if (sandwich) {
            rms_norm(t->x, NULL, layer->post_norm, t->h, rows, s->hidden, s->eps, 0, 0, bf);
            rms_norm(t->h, t->residual, layer->pre_ff_norm, t->x, rows, s->hidden, s->eps, 1, res_fp32, bf);
            mlp_in = t->x, mlp_out = t->h;
        } else {
            rms_norm(t->x, t->residual, layer->post_norm, t->h, rows, s->hidden, s->eps, 1, res_fp32, bf);
        }
        if (mlp(s, layer, t, mlp_in, mlp_out)) return 1;
        if (scaled) scale_rows(mlp_out, rows, s->hidden, layer->residual_scale, bf);
        if (sandwich) rms_norm(t->h, NULL, layer->post_ff_norm, t->x, rows, s->hidden, s->eps, 0, 0, bf);
    }
    rms_norm(t->x, t->residual, t->final_norm, t->h, rows, s->hidden, s->eps, 1, res_fp32, bf);
    if (t->lm_packed == NULL) return 0;
    const int status = greedy_bf16(t->h, rows, t->lm_packed, t->lm_weight, t->lm_n, s->hidden, t->top, t->tokens);
    return status < 0 ? 1 : status ? 3 : 0;
}
