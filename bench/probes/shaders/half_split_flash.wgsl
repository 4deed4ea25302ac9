// Probe kernel (issue 54 item 1, variant "flash"; not shipped): a flash-decoding
// split kernel without the scores in workgroup memory. Same bindings, params,
// partials and dispatch as the shipped split kernel (shaders/attention_split.wgsl;
// the shipped merge finishes it), over a slab read in 16-byte pieces of eight
// elements (include/kv_wide_{KV}.wgsl: f16, bf16, or f32 as two 16-byte loads).
//
// A lane group of LG consecutive invocations (a power of two, at most the subgroup
// size: the host queries it, and the kernel checks it) owns one key at a time: lane
// j holds pieces j, j + LG, .. (PPL of them; lanes past the row's NP pieces hold
// zeros) of the G queries of the group in registers, for the whole split.
// The workgroup's 256 / LG lane groups take tiles of TK consecutive keys in turn.
// Per tile, each lane of a group:
//   - loads its pieces of the TK keys' K and V rows (2 TK PPL loads in flight),
//   - forms its share of the TK x G dot products, finished over the lane group by
//     log2(LG) subgroupShuffleXor steps (every lane then holds every score),
//   - runs the online softmax of each head over the tile (one rescale of its
//     running max, sum and accumulator per tile, not per key) and accumulates
//     p * V into its own eight columns of each head (G x PPL pairs of vec4).
// At the end the lane groups' (max, sum, accumulator) are combined through
// workgroup memory (one head a pass) into the split's partial, as shipped.
//
// Subgroup operations sit in control flow uniform across the workgroup: every lane
// group runs the same tiles (keys past the split are clamped loads, masked out).
// Lane groups are consecutive invocation ranges of a subgroup (the subgroups of a
// one-dimensional workgroup are its consecutive invocation ranges).
//
// Every per-lane value is a named register (no function-scope arrays: naga clamps
// their indices, and the NVIDIA compiler then keeps them in local memory: a first
// version with arrays ran 4x slower than the shipped kernel on the H200); the G
// heads' scores, maxima and sums are vec4 pairs (heads 0..3, 4..7), so the online
// softmax of four heads is one vector operation.
//
// Override constants (set by bench/probes/half_decode_variants.py): GROUP (= the
// params' G, 1..8), NP = head_dim / 8, LG, PPL = ceil(NP / LG) (1 or 2), TK (2 or
// 4), PG_MAX (page-table entries of the longest split). A mismatch with the params
// or a subgroup narrower than LG poisons the partials (NaN sums), never silently
// wrong numbers.

// #include "half_split_decls.wgsl"

override GROUP: u32 = 4u;
override NP: u32 = 16u;
override LG: u32 = 16u;
override PPL: u32 = 1u;
override TK: u32 = 4u;
override NLG: u32 = WG / LG;                    // lane groups of the workgroup

var<workgroup> mg: array<f32, NLG * GROUP>;     // each lane group's running max per head
var<workgroup> lg_sum: array<f32, NLG * GROUP>; // ... and sum of exp
var<workgroup> xs: array<f32, NLG * NP * 8u>;   // one head's accumulators of every lane group

// A value per head of the group: heads 0..3 in lo, 4..7 in hi.
struct S8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// Eight columns (one piece) per head of the group.
struct Heads8 {
    h0: H8, h1: H8, h2: H8, h3: H8, h4: H8, h5: H8, h6: H8, h7: H8,
}

fn h8_zero() -> H8 {
    return H8(vec4<f32>(0.0), vec4<f32>(0.0));
}

fn heads_zero() -> Heads8 {
    let z = h8_zero();
    return Heads8(z, z, z, z, z, z, z, z);
}

fn s8_fill(x: f32) -> S8 {
    return S8(vec4<f32>(x), vec4<f32>(x));
}

fn s8_get(s: S8, h: u32) -> f32 {
    if h < 4u {
        return s.lo[h];
    }
    return s.hi[h - 4u];
}

fn head_of(a: Heads8, h: u32) -> H8 {
    switch h {
        case 0u: { return a.h0; }
        case 1u: { return a.h1; }
        case 2u: { return a.h2; }
        case 3u: { return a.h3; }
        case 4u: { return a.h4; }
        case 5u: { return a.h5; }
        case 6u: { return a.h6; }
        default: { return a.h7; }
    }
}

// The group's queries, piece pc (zeros where `live` is false: a lane past the row).
fn load_q(d4: u32, pc: u32, live: bool) -> Heads8 {
    var q = heads_zero();
    if live {
        q.h0 = H8(q_sh[2u * pc], q_sh[2u * pc + 1u]);
        if GROUP > 1u { q.h1 = H8(q_sh[d4 + 2u * pc], q_sh[d4 + 2u * pc + 1u]); }
        if GROUP > 2u {
            q.h2 = H8(q_sh[2u * d4 + 2u * pc], q_sh[2u * d4 + 2u * pc + 1u]);
            q.h3 = H8(q_sh[3u * d4 + 2u * pc], q_sh[3u * d4 + 2u * pc + 1u]);
        }
        if GROUP > 4u {
            q.h4 = H8(q_sh[4u * d4 + 2u * pc], q_sh[4u * d4 + 2u * pc + 1u]);
            q.h5 = H8(q_sh[5u * d4 + 2u * pc], q_sh[5u * d4 + 2u * pc + 1u]);
            q.h6 = H8(q_sh[6u * d4 + 2u * pc], q_sh[6u * d4 + 2u * pc + 1u]);
            q.h7 = H8(q_sh[7u * d4 + 2u * pc], q_sh[7u * d4 + 2u * pc + 1u]);
        }
    }
    return q;
}

fn qdot(q: H8, k: H8) -> f32 {
    return dot(q.a, k.a) + dot(q.b, k.b);
}

// This lane's share of one key's G scores (its piece k).
fn score8(q: Heads8, k: H8) -> S8 {
    var s = s8_fill(0.0);
    s.lo.x = qdot(q.h0, k);
    if GROUP > 1u { s.lo.y = qdot(q.h1, k); }
    if GROUP > 2u {
        s.lo.z = qdot(q.h2, k);
        s.lo.w = qdot(q.h3, k);
    }
    if GROUP > 4u {
        s.hi = vec4<f32>(qdot(q.h4, k), qdot(q.h5, k), qdot(q.h6, k), qdot(q.h7, k));
    }
    return s;
}

fn s8_add(a: S8, b: S8) -> S8 {
    return S8(a.lo + b.lo, a.hi + b.hi);
}

// The lane group's sum of s (every lane gets it): log2(LG) butterfly steps.
fn group_sum(s: S8) -> S8 {
    var x = s;
    for (var mask = 1u; mask < LG; mask = mask << 1u) {
        x.lo += subgroupShuffleXor(x.lo, mask);
        if GROUP > 4u {
            x.hi += subgroupShuffleXor(x.hi, mask);
        }
    }
    return x;
}

// Scaled scores of a key, NEG_INF where the key is past the split.
fn masked(s: S8, scale: f32, live: bool) -> S8 {
    return S8(select(vec4<f32>(NEG_INF), s.lo * scale, live), select(vec4<f32>(NEG_INF), s.hi * scale, live));
}

fn s8_max(a: S8, b: S8) -> S8 {
    return S8(max(a.lo, b.lo), max(a.hi, b.hi));
}

// exp(s - mx), zero where the key is dead.
fn weight(s: S8, mx: S8, live: bool) -> S8 {
    var w = s8_fill(0.0);
    if live {
        w.lo = exp(s.lo - mx.lo);
        if GROUP > 4u {
            w.hi = exp(s.hi - mx.hi);
        }
    }
    return w;
}

fn h8_step(a: H8, c: f32, p0: f32, v0: H8, p1: f32, v1: H8, p2: f32, v2: H8, p3: f32, v3: H8) -> H8 {
    var x = a.a * c + p0 * v0.a + p1 * v1.a;
    var y = a.b * c + p0 * v0.b + p1 * v1.b;
    if TK > 2u {
        x += p2 * v2.a + p3 * v3.a;
        y += p2 * v2.b + p3 * v3.b;
    }
    return H8(x, y);
}

// acc_h = acc_h * corr_h + sum_i w_i,h v_i for the G heads (one piece).
fn accumulate(a: Heads8, c: S8, w0: S8, v0: H8, w1: S8, v1: H8, w2: S8, v2: H8, w3: S8, v3: H8) -> Heads8 {
    var r = a;
    r.h0 = h8_step(a.h0, c.lo.x, w0.lo.x, v0, w1.lo.x, v1, w2.lo.x, v2, w3.lo.x, v3);
    if GROUP > 1u { r.h1 = h8_step(a.h1, c.lo.y, w0.lo.y, v0, w1.lo.y, v1, w2.lo.y, v2, w3.lo.y, v3); }
    if GROUP > 2u {
        r.h2 = h8_step(a.h2, c.lo.z, w0.lo.z, v0, w1.lo.z, v1, w2.lo.z, v2, w3.lo.z, v3);
        r.h3 = h8_step(a.h3, c.lo.w, w0.lo.w, v0, w1.lo.w, v1, w2.lo.w, v2, w3.lo.w, v3);
    }
    if GROUP > 4u {
        r.h4 = h8_step(a.h4, c.hi.x, w0.hi.x, v0, w1.hi.x, v1, w2.hi.x, v2, w3.hi.x, v3);
        r.h5 = h8_step(a.h5, c.hi.y, w0.hi.y, v0, w1.hi.y, v1, w2.hi.y, v2, w3.hi.y, v3);
        r.h6 = h8_step(a.h6, c.hi.z, w0.hi.z, v0, w1.hi.z, v1, w2.hi.z, v2, w3.hi.z, v3);
        r.h7 = h8_step(a.h7, c.hi.w, w0.hi.w, v0, w1.hi.w, v1, w2.hi.w, v2, w3.hi.w, v3);
    }
    return r;
}

@compute @workgroup_size(256, 1, 1)
fn half_split_flash(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_size) sg_size: u32,
) {
    // #include "split_plain_prologue.wgsl"

    let kv8 = kv_dim / 8u;
    let head8 = cache_head * NP;
    let lane = tid % LG;
    let slot = tid / LG;
    let bad = sg_size < LG || group != GROUP || head_dim != 8u * NP || PPL > 2u || (TK != 2u && TK != 4u);

    // the lane's pieces (pc0, and pc1 when PPL = 2) of the group's queries, for the split
    let pc0 = min(lane, NP - 1u);
    let pc1 = min(lane + LG, NP - 1u);
    let q0 = load_q(d4, pc0, lane < NP);
    var q1 = heads_zero();
    if PPL > 1u {
        q1 = load_q(d4, pc1, lane + LG < NP);
    }
    var acc0 = heads_zero();
    var acc1 = heads_zero();
    var m = s8_fill(NEG_INF);
    var l = s8_fill(0.0);
    let z8 = h8_zero();

    // ── keys in tiles of TK per lane group: scores, online softmax, values ──
    for (var tb = 0u; tb < n_t; tb += TK * NLG) {
        let tk0 = tb + slot * TK;
        let live0 = tk0 < n_t;
        let live1 = tk0 + 1u < n_t;
        let live2 = TK > 2u && tk0 + 2u < n_t;
        let live3 = TK > 2u && tk0 + 3u < n_t;
        let r0 = split_row(page0, page_shift, t0 + min(tk0, n_t - 1u)) * kv8 + head8;
        let r1 = split_row(page0, page_shift, t0 + min(tk0 + 1u, n_t - 1u)) * kv8 + head8;
        var r2 = r0;
        var r3 = r0;
        if TK > 2u {
            r2 = split_row(page0, page_shift, t0 + min(tk0 + 2u, n_t - 1u)) * kv8 + head8;
            r3 = split_row(page0, page_shift, t0 + min(tk0 + 3u, n_t - 1u)) * kv8 + head8;
        }
        // K and V pieces: key i, piece p -> ki_p, vi_p
        let k0_0 = key8(r0 + pc0);
        let k1_0 = key8(r1 + pc0);
        let v0_0 = value8(r0 + pc0);
        let v1_0 = value8(r1 + pc0);
        var k2_0 = z8;
        var k3_0 = z8;
        var v2_0 = z8;
        var v3_0 = z8;
        if TK > 2u {
            k2_0 = key8(r2 + pc0);
            k3_0 = key8(r3 + pc0);
            v2_0 = value8(r2 + pc0);
            v3_0 = value8(r3 + pc0);
        }
        var k0_1 = z8;
        var k1_1 = z8;
        var k2_1 = z8;
        var k3_1 = z8;
        var v0_1 = z8;
        var v1_1 = z8;
        var v2_1 = z8;
        var v3_1 = z8;
        if PPL > 1u {
            k0_1 = key8(r0 + pc1);
            k1_1 = key8(r1 + pc1);
            v0_1 = value8(r0 + pc1);
            v1_1 = value8(r1 + pc1);
            if TK > 2u {
                k2_1 = key8(r2 + pc1);
                k3_1 = key8(r3 + pc1);
                v2_1 = value8(r2 + pc1);
                v3_1 = value8(r3 + pc1);
            }
        }
        // this lane's shares of the scores, then the lane group's sums
        var s0 = score8(q0, k0_0);
        var s1 = score8(q0, k1_0);
        var s2 = s8_fill(0.0);
        var s3 = s8_fill(0.0);
        if TK > 2u {
            s2 = score8(q0, k2_0);
            s3 = score8(q0, k3_0);
        }
        if PPL > 1u {
            s0 = s8_add(s0, score8(q1, k0_1));
            s1 = s8_add(s1, score8(q1, k1_1));
            if TK > 2u {
                s2 = s8_add(s2, score8(q1, k2_1));
                s3 = s8_add(s3, score8(q1, k3_1));
            }
        }
        s0 = masked(group_sum(s0), scale, live0);
        s1 = masked(group_sum(s1), scale, live1);
        if TK > 2u {
            s2 = masked(group_sum(s2), scale, live2);
            s3 = masked(group_sum(s3), scale, live3);
        }
        // online softmax over the tile: one rescale per tile
        var tmax = s8_max(s0, s1);
        if TK > 2u {
            tmax = s8_max(tmax, s8_max(s2, s3));
        }
        let mn = s8_max(m, tmax);
        let corr = S8(exp(m.lo - mn.lo), exp(m.hi - mn.hi));
        m = mn;
        let w0 = weight(s0, mn, live0);
        let w1 = weight(s1, mn, live1);
        let w2 = weight(s2, mn, live2);
        let w3 = weight(s3, mn, live3);
        l = S8(l.lo * corr.lo + w0.lo + w1.lo + w2.lo + w3.lo, l.hi * corr.hi + w0.hi + w1.hi + w2.hi + w3.hi);
        acc0 = accumulate(acc0, corr, w0, v0_0, w1, v1_0, w2, v2_0, w3, v3_0);
        if PPL > 1u {
            acc1 = accumulate(acc1, corr, w0, v0_1, w1, v1_1, w2, v2_1, w3, v3_1);
        }
    }

    // ── combine the lane groups: max, rescaled sums and accumulators; partials ──
    if lane == 0u {
        for (var h = 0u; h < GROUP; h += 1u) {
            mg[slot * GROUP + h] = s8_get(m, h);
            lg_sum[slot * GROUP + h] = s8_get(l, h);
        }
    }
    workgroupBarrier();
    let n_part = q_total * n_heads * split_total;
    let pbase = (q_idx * n_heads + kv_head * group) * split_total + split_at;
    if tid < GROUP {
        var mx = NEG_INF;
        for (var g = 0u; g < NLG; g += 1u) {
            mx = max(mx, mg[g * GROUP + tid]);
        }
        var lt = 0.0;
        for (var g = 0u; g < NLG; g += 1u) {
            lt += lg_sum[g * GROUP + tid] * exp(mg[g * GROUP + tid] - mx);
        }
        let pi = pbase + tid * split_total;
        partial[part_off + n_part * head_dim + pi] = mx;              // m (NEG_INF if empty)
        partial[part_off + n_part * (head_dim + 1u) + pi] = lt;       // l (0 if empty)
    }
    if bad && tid < group {                      // every head of the params' group, whatever GROUP says
        partial[part_off + n_part * (head_dim + 1u) + pbase + tid * split_total] = nan_f32();
    }
    for (var h = 0u; h < GROUP; h += 1u) {
        var mx = NEG_INF;
        for (var g = 0u; g < NLG; g += 1u) {
            mx = max(mx, mg[g * GROUP + h]);
        }
        let f = exp(s8_get(m, h) - mx);          // this lane group's share of the split's max
        workgroupBarrier();                      // xs read by the pass before
        for (var p = 0u; p < PPL; p += 1u) {
            let pc = lane + p * LG;
            if pc < NP {
                var a = head_of(acc0, h);
                if p == 1u {
                    a = head_of(acc1, h);
                }
                let o = (slot * NP + pc) * 8u;
                xs[o] = a.a.x * f;
                xs[o + 1u] = a.a.y * f;
                xs[o + 2u] = a.a.z * f;
                xs[o + 3u] = a.a.w * f;
                xs[o + 4u] = a.b.x * f;
                xs[o + 5u] = a.b.y * f;
                xs[o + 6u] = a.b.z * f;
                xs[o + 7u] = a.b.w * f;
            }
        }
        workgroupBarrier();
        if tid < head_dim {
            var sum = 0.0;
            for (var g = 0u; g < NLG; g += 1u) {
                sum += xs[g * NP * 8u + tid];
            }
            partial[part_off + (pbase + h * split_total) * head_dim + tid] = sum;
        }
    }
}
