// Split-KV attention over a plain (f32 or f16) KV cache, lane-group variant
// (decode path; needs the `subgroup` feature).
//
// Same work split, partial layout, params, bindings and dispatch as
// `attention_split.wgsl` (read its header); only the score phase differs:
//
//   scores: a lane group of LG = min(8, subgroup size) lanes scores a key.
//           Lane j reads vec4 columns j, j + LG, j + 2 LG, j + 3 LG of the key
//           row straight from global memory: the group reads whole 128-byte
//           spans (at f32 and head_dim 128: a warp reads four whole 512-byte
//           rows per load, where the one-thread-per-key kernel touches 32 rows
//           per load and uses half of each 32-byte sector). Each lane takes four
//           keys per step (t, t + S, t + 2S, t + 3S for S = WG / LG lane groups):
//           sixteen loads in flight at head_dim 128. Its share of the G dot
//           products is summed over the lane group by log2(LG) subgroupShuffleXor
//           steps (the sg kernel's subgroupAdd spans 32 lanes per key).
//   values: as the plain kernel (shaders/include/split_plain_values.wgsl).
//
// Lane groups are consecutive invocations of a subgroup: the subgroups of a
// one-dimensional workgroup are its consecutive invocation ranges (as the sg
// kernel assumes), so lane j of a group is invocation tid with tid % LG = j.
// subgroupShuffleXor sits in control flow uniform across the workgroup: every
// lane group runs the same number of key steps (dead keys contribute zeros).
//
// Dispatch: (n_splits, n_kv_heads, query rows of the batch) workgroups of 256.

// #include "split_plain_decls.wgsl"

// Query head h's column c dotted with column c of four keys.
fn dot_keys(h: u32, d4: u32, c: u32, k0: vec4<f32>, k1: vec4<f32>, k2: vec4<f32>, k3: vec4<f32>) -> vec4<f32> {
    let q = q_sh[h * d4 + c];
    return vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
}

// Query head h's share of the four keys' scores over the lane's columns c0..c3.
fn head_share(
    h: u32, d4: u32, c0: u32, c1: u32, c2: u32, c3: u32,
    a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>,
    b0: vec4<f32>, b1: vec4<f32>, b2: vec4<f32>, b3: vec4<f32>,
    e0: vec4<f32>, e1: vec4<f32>, e2: vec4<f32>, e3: vec4<f32>,
    f0: vec4<f32>, f1: vec4<f32>, f2: vec4<f32>, f3: vec4<f32>,
) -> vec4<f32> {
    // aX: column cX of key 0, bX: of key 1, eX: of key 2, fX: of key 3 (zeros where dead)
    return dot_keys(h, d4, c0, a0, b0, e0, f0) + dot_keys(h, d4, min(c1, d4 - 1u), a1, b1, e1, f1)
        + dot_keys(h, d4, min(c2, d4 - 1u), a2, b2, e2, f2) + dot_keys(h, d4, min(c3, d4 - 1u), a3, b3, e3, f3);
}

@compute @workgroup_size(256, 1, 1)
fn attention_split_lanes(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) lane_id: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    // #include "split_plain_prologue.wgsl"

    // ── 1. scores: a lane group per key, four keys per lane group and step ──
    let lg = min(8u, sg_size);                  // lanes per key (uniform)
    let j = lane_id % lg;                       // = tid % lg
    let n_slots = WG / lg;                      // lane groups in the workgroup
    let slot = tid / lg;
    for (var tb = 0u; tb < n_t; tb += 4u * n_slots) {
        let t = tb + slot;                      // keys t, t + S, t + 2S, t + 3S
        let live = vec4<bool>(t < n_t, t + n_slots < n_t, t + 2u * n_slots < n_t, t + 3u * n_slots < n_t);
        // the four keys' rows (a dead key's row is computed but never read)
        let r0 = split_row(page0, page_shift, t0 + min(t, n_t - 1u)) * kv4 + head4;
        let r1 = split_row(page0, page_shift, t0 + min(t + n_slots, n_t - 1u)) * kv4 + head4;
        let r2 = split_row(page0, page_shift, t0 + min(t + 2u * n_slots, n_t - 1u)) * kv4 + head4;
        let r3 = split_row(page0, page_shift, t0 + min(t + 3u * n_slots, n_t - 1u)) * kv4 + head4;
        // pH = the four keys' partial dot products with query head H
        var p0 = vec4<f32>(0.0);
        var p1 = vec4<f32>(0.0);
        var p2 = vec4<f32>(0.0);
        var p3 = vec4<f32>(0.0);
        var p4 = vec4<f32>(0.0);
        var p5 = vec4<f32>(0.0);
        var p6 = vec4<f32>(0.0);
        var p7 = vec4<f32>(0.0);
        for (var c0 = j; c0 < d4; c0 += 4u * lg) {
            let c1 = c0 + lg;
            let c2 = c0 + 2u * lg;
            let c3 = c0 + 3u * lg;
            let cl = vec4<bool>(true, c1 < d4, c2 < d4, c3 < d4);
            var a0 = vec4<f32>(0.0);
            var a1 = vec4<f32>(0.0);
            var a2 = vec4<f32>(0.0);
            var a3 = vec4<f32>(0.0);
            var b0 = vec4<f32>(0.0);
            var b1 = vec4<f32>(0.0);
            var b2 = vec4<f32>(0.0);
            var b3 = vec4<f32>(0.0);
            var e0 = vec4<f32>(0.0);
            var e1 = vec4<f32>(0.0);
            var e2 = vec4<f32>(0.0);
            var e3 = vec4<f32>(0.0);
            var f0 = vec4<f32>(0.0);
            var f1 = vec4<f32>(0.0);
            var f2 = vec4<f32>(0.0);
            var f3 = vec4<f32>(0.0);
            if live.x {
                a0 = key4(r0 + c0);
                if cl.y { a1 = key4(r0 + c1); }
                if cl.z { a2 = key4(r0 + c2); }
                if cl.w { a3 = key4(r0 + c3); }
            }
            if live.y {
                b0 = key4(r1 + c0);
                if cl.y { b1 = key4(r1 + c1); }
                if cl.z { b2 = key4(r1 + c2); }
                if cl.w { b3 = key4(r1 + c3); }
            }
            if live.z {
                e0 = key4(r2 + c0);
                if cl.y { e1 = key4(r2 + c1); }
                if cl.z { e2 = key4(r2 + c2); }
                if cl.w { e3 = key4(r2 + c3); }
            }
            if live.w {
                f0 = key4(r3 + c0);
                if cl.y { f1 = key4(r3 + c1); }
                if cl.z { f2 = key4(r3 + c2); }
                if cl.w { f3 = key4(r3 + c3); }
            }
            p0 += head_share(0u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
            if group > 1u {
                p1 += head_share(1u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
            }
            if group > 2u {
                p2 += head_share(2u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
                p3 += head_share(3u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
            }
            if group > 4u {
                p4 += head_share(4u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
                p5 += head_share(5u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
                p6 += head_share(6u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
                p7 += head_share(7u, d4, c0, c1, c2, c3, a0, a1, a2, a3, b0, b1, b2, b3, e0, e1, e2, e3, f0, f1, f2, f3);
            }
        }
        // the lane group's sums (workgroup-uniform control flow: lg and group are uniform)
        for (var mask = 1u; mask < lg; mask = mask << 1u) {
            p0 += subgroupShuffleXor(p0, mask);
            if group > 1u { p1 += subgroupShuffleXor(p1, mask); }
            if group > 2u {
                p2 += subgroupShuffleXor(p2, mask);
                p3 += subgroupShuffleXor(p3, mask);
            }
            if group > 4u {
                p4 += subgroupShuffleXor(p4, mask);
                p5 += subgroupShuffleXor(p5, mask);
                p6 += subgroupShuffleXor(p6, mask);
                p7 += subgroupShuffleXor(p7, mask);
            }
        }
        // lanes i, i + lg, .. < 4 of the group write keys i, i + lg, .. of the step, for every head
        for (var i = j; i < 4u; i += lg) {
            if live[i] {
                let tt = t + i * n_slots;
                scores[tt] = p0[i] * scale;
                if group > 1u { scores[split_len + tt] = p1[i] * scale; }
                if group > 2u {
                    scores[2u * split_len + tt] = p2[i] * scale;
                    scores[3u * split_len + tt] = p3[i] * scale;
                }
                if group > 4u {
                    scores[4u * split_len + tt] = p4[i] * scale;
                    scores[5u * split_len + tt] = p5[i] * scale;
                    scores[6u * split_len + tt] = p6[i] * scale;
                    scores[7u * split_len + tt] = p7[i] * scale;
                }
            }
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p"

    // #include "split_plain_values.wgsl"
}
