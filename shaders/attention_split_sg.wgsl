// Split-KV attention over an f32 KV cache, subgroup variant (decode path).
//
// Same work split, partial layout, params and bindings as `attention_split.wgsl`
// (read its header). Opt-in (KernelPolicy.subgroups, and the device needs the
// `subgroup` feature): on the H200 it measured 1.3-1.7x slower than the plain
// kernel, which scores one key per thread (docs/benchmarks.md). The difference
// is how a key is scored (the value phase is shared):
//
//   scores: one subgroup scores four keys per step. Lane c reads vec4 column c
//           (and c + sg, ... when head_dim/4 > subgroup size) of the key row
//           straight from global memory (consecutive lanes, consecutive 16-byte
//           words: one coalesced 512-byte read per key at head_dim 128), forms
//           its share of the dot product with every query head of the GQA
//           group, and subgroupAdd finishes the G dot products. No staging, no
//           barriers per tile.
//   values: thread (c, grp) owns output column c of every head of the group
//           (G vec4 registers) and reads V rows grp, grp + NG, ... straight
//           from global memory (coalesced), four rows per step
//           (shaders/include/split_plain_values.wgsl, as the plain kernel).
//
// Subgroup builtins need no `enable` line with this naga once the device has
// the feature. Calls to subgroupAdd sit in control flow uniform across the
// workgroup: every subgroup runs the same number of key steps, lanes of a
// subgroup past the split's end contribute zeros.
//
// Dispatch: (n_splits, n_kv_heads, n_queries) workgroups of 256 threads.

// #include "split_plain_decls.wgsl"

@compute @workgroup_size(256, 1, 1)
fn attention_split_sg(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) lane_id: u32,
    @builtin(subgroup_size) sg_size: u32,
) {
    // #include "split_plain_prologue.wgsl"

    // ── 1. scores: one subgroup per key, four keys per step (four loads in flight) ──
    let n_sg = WG / sg_size;                    // subgroups in the workgroup
    let sg = tid / sg_size;
    for (var tb = 0u; tb < n_t; tb += 4u * n_sg) {
        let t = tb + sg;                          // keys t, t + n_sg, t + 2 n_sg, t + 3 n_sg
        let live = vec4<bool>(t < n_t, t + n_sg < n_t, t + 2u * n_sg < n_t, t + 3u * n_sg < n_t);
        // the four keys' rows (a dead key's row is computed but never read)
        let r0 = split_row(page0, page_shift, t0 + t) * kv4 + head4;
        let r1 = split_row(page0, page_shift, t0 + t + n_sg) * kv4 + head4;
        let r2 = split_row(page0, page_shift, t0 + t + 2u * n_sg) * kv4 + head4;
        let r3 = split_row(page0, page_shift, t0 + t + 3u * n_sg) * kv4 + head4;
        // pH = the four keys' partial dot products with query head H
        var p0 = vec4<f32>(0.0);
        var p1 = vec4<f32>(0.0);
        var p2 = vec4<f32>(0.0);
        var p3 = vec4<f32>(0.0);
        var p4 = vec4<f32>(0.0);
        var p5 = vec4<f32>(0.0);
        var p6 = vec4<f32>(0.0);
        var p7 = vec4<f32>(0.0);
        for (var c = lane_id; c < d4; c += sg_size) {
            var k0 = vec4<f32>(0.0);
            var k1 = vec4<f32>(0.0);
            var k2 = vec4<f32>(0.0);
            var k3 = vec4<f32>(0.0);
            if live.x { k0 = key4(r0 + c); }
            if live.y { k1 = key4(r1 + c); }
            if live.z { k2 = key4(r2 + c); }
            if live.w { k3 = key4(r3 + c); }
            var q = q_sh[c];
            p0 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
            if group > 1u {
                q = q_sh[d4 + c];
                p1 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
            }
            if group > 2u {
                q = q_sh[2u * d4 + c];
                p2 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
                q = q_sh[3u * d4 + c];
                p3 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
            }
            if group > 4u {
                q = q_sh[4u * d4 + c];
                p4 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
                q = q_sh[5u * d4 + c];
                p5 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
                q = q_sh[6u * d4 + c];
                p6 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
                q = q_sh[7u * d4 + c];
                p7 += vec4<f32>(dot(q, k0), dot(q, k1), dot(q, k2), dot(q, k3));
            }
        }
        // subgroupAdd in workgroup-uniform control flow (`group` is uniform)
        let s0 = subgroupAdd(p0) * scale;
        var s1 = vec4<f32>(0.0);
        var s2 = vec4<f32>(0.0);
        var s3 = vec4<f32>(0.0);
        var s4 = vec4<f32>(0.0);
        var s5 = vec4<f32>(0.0);
        var s6 = vec4<f32>(0.0);
        var s7 = vec4<f32>(0.0);
        if group > 1u { s1 = subgroupAdd(p1) * scale; }
        if group > 2u {
            s2 = subgroupAdd(p2) * scale;
            s3 = subgroupAdd(p3) * scale;
        }
        if group > 4u {
            s4 = subgroupAdd(p4) * scale;
            s5 = subgroupAdd(p5) * scale;
            s6 = subgroupAdd(p6) * scale;
            s7 = subgroupAdd(p7) * scale;
        }
        // lane i < 4 writes key i of the step, for every head
        if lane_id < 4u && live[lane_id] {
            let tt = t + lane_id * n_sg;
            scores[tt] = s0[lane_id];
            if group > 1u { scores[split_len + tt] = s1[lane_id]; }
            if group > 2u {
                scores[2u * split_len + tt] = s2[lane_id];
                scores[3u * split_len + tt] = s3[lane_id];
            }
            if group > 4u {
                scores[4u * split_len + tt] = s4[lane_id];
                scores[5u * split_len + tt] = s5[lane_id];
                scores[6u * split_len + tt] = s6[lane_id];
                scores[7u * split_len + tt] = s7[lane_id];
            }
        }
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p"

    // #include "split_plain_values.wgsl"
}
