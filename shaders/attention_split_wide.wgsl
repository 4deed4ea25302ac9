// Split-KV attention (flash-decoding) over a half-precision (f16, bf16) KV cache,
// read in 16-byte pieces: the decode path of the half formats where head_dim % 8 == 0
// (kernels.wide_split; other head sizes take attention_split.wgsl).
//
// attention_split.wgsl's design (read its header: the work split, the params, the
// partials, the dispatch, the constraints) with the slab read eight halves at a
// time (include/kv_wide_{f16,bf16}.wgsl: one vec4<u32> load, widened to two
// vec4<f32>), so that a half-precision key row costs half the load instructions of
// an f32 row instead of the same number (issue 54 item 1):
//
//   1. scores: one thread per key, every head of the group; the key row as d/8
//      pieces, eight pieces in flight per step; the queries from workgroup memory
//      (a broadcast), as attention_split.wgsl;
//   2. softmax: the shared include (split_softmax.wgsl);
//   3. values: thread (piece c, row group grp) owns the eight columns of piece c
//      for every head of the group (G pairs of vec4 accumulators): head_dim/8
//      threads a row, so twice attention_split's row groups; four rows a step;
//      the row groups summed through `scores` (two heads a pass), partials as
//      attention_split.wgsl writes them (attention_merge.wgsl combines them).
//
// Measured in bench/probes/half_decode_variants.py as the variant "wide" before it
// shipped (docs/benchmarks.md, "Half-precision decode kernels").
//
// Bindings: attention_split.wgsl's, k_cache and v_cache as array<vec4<u32>>.
// Constraints: head_dim % 8 == 0 and <= 128; G in {1, 2, 4, 8}; G * split_len <= MAX_SCORES.

// #include "split_plain_decls.wgsl" SLAB="wide"

// Piece c (vec4 columns 2c, 2c+1) of key k dotted with query heads 0..3 (lo), 4..7 (hi).
fn qk_lo8(c: u32, d4: u32, group: u32, k: H8) -> vec4<f32> {
    let i = 2u * c;
    var s = vec4<f32>(dot(q_sh[i], k.a) + dot(q_sh[i + 1u], k.b), 0.0, 0.0, 0.0);
    if group > 1u { s.y = dot(q_sh[d4 + i], k.a) + dot(q_sh[d4 + i + 1u], k.b); }
    if group > 2u {
        s.z = dot(q_sh[2u * d4 + i], k.a) + dot(q_sh[2u * d4 + i + 1u], k.b);
        s.w = dot(q_sh[3u * d4 + i], k.a) + dot(q_sh[3u * d4 + i + 1u], k.b);
    }
    return s;
}

fn qk_hi8(c: u32, d4: u32, k: H8) -> vec4<f32> {
    let i = 2u * c;
    return vec4<f32>(dot(q_sh[4u * d4 + i], k.a) + dot(q_sh[4u * d4 + i + 1u], k.b),
                     dot(q_sh[5u * d4 + i], k.a) + dot(q_sh[5u * d4 + i + 1u], k.b),
                     dot(q_sh[6u * d4 + i], k.a) + dot(q_sh[6u * d4 + i + 1u], k.b),
                     dot(q_sh[7u * d4 + i], k.a) + dot(q_sh[7u * d4 + i + 1u], k.b));
}

fn h8_fma(acc: H8, p: f32, v: H8) -> H8 {
    return H8(acc.a + p * v.a, acc.b + p * v.b);
}

// The G heads' accumulators of one thread (eight columns each).
struct Acc8 {
    h0: H8, h1: H8, h2: H8, h3: H8, h4: H8, h5: H8, h6: H8, h7: H8,
}

// acc += p_h(t) * v for the G heads, p from `scores`.
fn accumulate(acc: ptr<function, Acc8>, group: u32, split_len: u32, t: u32, v: H8) {
    (*acc).h0 = h8_fma((*acc).h0, scores[t], v);
    if group > 1u { (*acc).h1 = h8_fma((*acc).h1, scores[split_len + t], v); }
    if group > 2u {
        (*acc).h2 = h8_fma((*acc).h2, scores[2u * split_len + t], v);
        (*acc).h3 = h8_fma((*acc).h3, scores[3u * split_len + t], v);
    }
    if group > 4u {
        (*acc).h4 = h8_fma((*acc).h4, scores[4u * split_len + t], v);
        (*acc).h5 = h8_fma((*acc).h5, scores[5u * split_len + t], v);
        (*acc).h6 = h8_fma((*acc).h6, scores[6u * split_len + t], v);
        (*acc).h7 = h8_fma((*acc).h7, scores[7u * split_len + t], v);
    }
}

@compute @workgroup_size(256, 1, 1)
fn attention_split_wide(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_plain_prologue.wgsl"

    let d8 = head_dim / 8u;
    let kv8 = kv_dim / 8u;
    let head8 = cache_head * d8;

    // ── 1. scores: one thread per key, eight 16-byte pieces in flight ──
    for (var t = tid; t < n_t; t += WG) {
        let r = split_row(page0, page_shift, t0 + t) * kv8 + head8;
        var sa = vec4<f32>(0.0);
        var sb = vec4<f32>(0.0);
        var c = 0u;
        for (; c + 8u <= d8; c += 8u) {
            let k0 = key8(r + c);
            let k1 = key8(r + c + 1u);
            let k2 = key8(r + c + 2u);
            let k3 = key8(r + c + 3u);
            let k4 = key8(r + c + 4u);
            let k5 = key8(r + c + 5u);
            let k6 = key8(r + c + 6u);
            let k7 = key8(r + c + 7u);
            sa += qk_lo8(c, d4, group, k0) + qk_lo8(c + 1u, d4, group, k1)
                + qk_lo8(c + 2u, d4, group, k2) + qk_lo8(c + 3u, d4, group, k3)
                + qk_lo8(c + 4u, d4, group, k4) + qk_lo8(c + 5u, d4, group, k5)
                + qk_lo8(c + 6u, d4, group, k6) + qk_lo8(c + 7u, d4, group, k7);
            if group > 4u {
                sb += qk_hi8(c, d4, k0) + qk_hi8(c + 1u, d4, k1) + qk_hi8(c + 2u, d4, k2) + qk_hi8(c + 3u, d4, k3)
                    + qk_hi8(c + 4u, d4, k4) + qk_hi8(c + 5u, d4, k5) + qk_hi8(c + 6u, d4, k6)
                    + qk_hi8(c + 7u, d4, k7);
            }
        }
        for (; c < d8; c += 1u) {
            let k = key8(r + c);
            sa += qk_lo8(c, d4, group, k);
            if group > 4u { sb += qk_hi8(c, d4, k); }
        }
        sa *= scale;
        sb *= scale;
        store_scores(t, split_len, group, sa, sb);
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p"

    // ── 3. V: thread (piece c, row group grp), all G heads, four rows a step ──
    let n_grp = WG / d8;
    let pc = tid % d8;
    let grp = tid / d8;
    let z8 = H8(vec4<f32>(0.0), vec4<f32>(0.0));
    var acc = Acc8(z8, z8, z8, z8, z8, z8, z8, z8);
    if grp < n_grp {
        var t = grp;
        for (; t + 3u * n_grp < n_t; t += 4u * n_grp) {
            let v0 = value8(split_row(page0, page_shift, t0 + t) * kv8 + head8 + pc);
            let v1 = value8(split_row(page0, page_shift, t0 + t + n_grp) * kv8 + head8 + pc);
            let v2 = value8(split_row(page0, page_shift, t0 + t + 2u * n_grp) * kv8 + head8 + pc);
            let v3 = value8(split_row(page0, page_shift, t0 + t + 3u * n_grp) * kv8 + head8 + pc);
            accumulate(&acc, group, split_len, t, v0);
            accumulate(&acc, group, split_len, t + n_grp, v1);
            accumulate(&acc, group, split_len, t + 2u * n_grp, v2);
            accumulate(&acc, group, split_len, t + 3u * n_grp, v3);
        }
        for (; t < n_t; t += n_grp) {
            accumulate(&acc, group, split_len, t, value8(split_row(page0, page_shift, t0 + t) * kv8 + head8 + pc));
        }
    }

    // ── sum the row groups (through `scores`, two heads a pass); write partials ──
    let n_part = q_total * n_heads * split_total;
    let pbase = (q_idx * n_heads + kv_head * group) * split_total + split_at;
    if tid < group {
        let pi = pbase + tid * split_total;
        partial[part_off + n_part * head_dim + pi] = stat[tid];
        partial[part_off + n_part * (head_dim + 1u) + pi] = red[tid * seg];
    }
    let pass_len = 8u * WG;                         // floats of one head's pass (n_grp * d8 * 8 <= 8 * WG)
    for (var h0 = 0u; h0 < group; h0 += 2u) {
        workgroupBarrier();
        if grp < n_grp {
            var x = acc.h0;
            var y = acc.h1;
            if h0 == 2u { x = acc.h2; y = acc.h3; }
            if h0 == 4u { x = acc.h4; y = acc.h5; }
            if h0 == 6u { x = acc.h6; y = acc.h7; }
            let o = 8u * (grp * d8 + pc);
            scores[o] = x.a.x;
            scores[o + 1u] = x.a.y;
            scores[o + 2u] = x.a.z;
            scores[o + 3u] = x.a.w;
            scores[o + 4u] = x.b.x;
            scores[o + 5u] = x.b.y;
            scores[o + 6u] = x.b.z;
            scores[o + 7u] = x.b.w;
            scores[pass_len + o] = y.a.x;
            scores[pass_len + o + 1u] = y.a.y;
            scores[pass_len + o + 2u] = y.a.z;
            scores[pass_len + o + 3u] = y.a.w;
            scores[pass_len + o + 4u] = y.b.x;
            scores[pass_len + o + 5u] = y.b.y;
            scores[pass_len + o + 6u] = y.b.z;
            scores[pass_len + o + 7u] = y.b.w;
        }
        // #include "split_sum_row_groups.wgsl" PASS="pass_len"
    }
}
