// Split-KV attention (flash-decoding) over a plain (f32, f16 or bf16) KV cache: the decode path.
//
// The seed kernel (`attention_prefill.wgsl`) runs one workgroup per (head,
// query): at decode that is 32 workgroups on a 132-SM GPU, each thread walking
// a whole key row with a `kv_dim` stride between threads. Here the context is
// cut into splits of `split_len` timesteps and one workgroup handles
// (split, KV head, query row) for ALL the query heads of that KV head's GQA
// group, so each K/V row is read once per query row instead of once per query
// head, and thousands of workgroups are in flight. Each workgroup writes a
// partial (max, sum, unnormalized accumulator) per query head; the merge kernel
// (`attention_merge.wgsl`) combines the splits.
//
// Within a split (at most MAX_SCORES / G timesteps):
//   1. Scores, one thread per key: thread i scores keys i, i + WG, ... of the
//      split against every query head of the group. It reads its key row
//      straight from global memory as vec4 (eight loads in flight per step,
//      no staging, no barriers) and the queries from workgroup memory, where
//      every thread of a subgroup reads the same address (a broadcast). The
//      seven earlier versions of this phase (staged tiles, one subgroup per
//      key) serialized each subgroup on one key at a time; see
//      docs/benchmarks.md for what each measured.
//   2. Per query head: max and sum of exp over the split's scores (inlined
//      tree reductions over segments of WG / G threads).
//   3. Thread (c, grp) owns the vec4 column c of the output for EVERY query
//      head of the group (G vec4 accumulators in registers) and reads V rows
//      grp, grp + NG, ... straight from global memory (coalesced: consecutive
//      threads, consecutive 16-byte words), four rows per step; the NG row
//      groups are summed in workgroup memory at the end.
//
// Every workgroupBarrier() sits at entry-point scope in uniform control flow:
// loop bounds depend only on params and the workgroup id (naga's SPIR-V path
// miscompiles a barrier reached through a function call inside a loop).
//
// Constraints (checked host-side: kernels.split_eligible, kernels.split_sizes):
//   head_dim % 4 == 0 and <= 128; G = n_heads / n_kv_heads in {1, 2, 4, 8};
//   G * split_len <= MAX_SCORES.
//
// Bind group 0 (one dispatch serves a batch of attends, one params block per
// query row; a single attend is the batch of one):
// @binding(0) q_batch:  array<f32>        every item's queries, the item's n_queries x
//                                         q_stride floats at word q_off
// @binding(1) k_cache:  the pool slab, [rows, kv_dim] (f32, f16 or bf16: include/kv_vec4_{f32,f16,bf16}.wgsl)
// @binding(2) v_cache:  the slab's values, [rows, kv_dim], read through key4() / value4()
// @binding(3) partial:  array<f32>        every item's [acc: n_q*H*n_splits*d | m: n_q*H*n_splits
//                                         | l: same] at word part_off (rw)
// @binding(4) params:   array<SplitParams> (gpu/params.py SPLIT_PARAMS), block wid.z
//                                         for query row q_row of its item
// @binding(5) pages:    array<u32>        page tables (include/paging.wgsl)
//   flags bit 0: non-causal (every row attends to all max_seq timesteps).
//   q_total: the item's query rows (the row stride of its partials).
//
// Dispatch: (the batch's largest n_splits, n_kv_heads, query rows of the batch)
// workgroups of 256 threads; a workgroup past its item's n_splits returns.

// #include "split_plain_decls.wgsl" SLAB="vec4"

// Column c of key k dotted with query heads 0..3 (lo) and 4..7 (hi) of the group.
fn qk_lo(c: u32, d4: u32, group: u32, k: vec4<f32>) -> vec4<f32> {
    var s = vec4<f32>(dot(q_sh[c], k), 0.0, 0.0, 0.0);
    if group > 1u { s.y = dot(q_sh[d4 + c], k); }
    if group > 2u {
        s.z = dot(q_sh[2u * d4 + c], k);
        s.w = dot(q_sh[3u * d4 + c], k);
    }
    return s;
}

fn qk_hi(c: u32, d4: u32, k: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot(q_sh[4u * d4 + c], k), dot(q_sh[5u * d4 + c], k),
                     dot(q_sh[6u * d4 + c], k), dot(q_sh[7u * d4 + c], k));
}

// Eight consecutive vec4 columns of a key row, from slab vec4 index i.
struct Keys8 {
    k0: vec4<f32>, k1: vec4<f32>, k2: vec4<f32>, k3: vec4<f32>,
    k4: vec4<f32>, k5: vec4<f32>, k6: vec4<f32>, k7: vec4<f32>,
}

fn keys8(i: u32) -> Keys8 {
    return Keys8(key4(i), key4(i + 1u), key4(i + 2u), key4(i + 3u),
                 key4(i + 4u), key4(i + 5u), key4(i + 6u), key4(i + 7u));
}

// Columns c .. c+7 of a key (ks) dotted with query heads 0..3 (lo) and 4..7 (hi).
fn qk8_lo(c: u32, d4: u32, group: u32, ks: Keys8) -> vec4<f32> {
    return qk_lo(c, d4, group, ks.k0) + qk_lo(c + 1u, d4, group, ks.k1)
        + qk_lo(c + 2u, d4, group, ks.k2) + qk_lo(c + 3u, d4, group, ks.k3)
        + qk_lo(c + 4u, d4, group, ks.k4) + qk_lo(c + 5u, d4, group, ks.k5)
        + qk_lo(c + 6u, d4, group, ks.k6) + qk_lo(c + 7u, d4, group, ks.k7);
}

fn qk8_hi(c: u32, d4: u32, ks: Keys8) -> vec4<f32> {
    return qk_hi(c, d4, ks.k0) + qk_hi(c + 1u, d4, ks.k1) + qk_hi(c + 2u, d4, ks.k2) + qk_hi(c + 3u, d4, ks.k3)
        + qk_hi(c + 4u, d4, ks.k4) + qk_hi(c + 5u, d4, ks.k5) + qk_hi(c + 6u, d4, ks.k6) + qk_hi(c + 7u, d4, ks.k7);
}

@compute @workgroup_size(256, 1, 1)
fn attention_split(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    // #include "split_plain_prologue.wgsl"

    // ── 1. scores: one thread per key, every head of the group ──
    for (var t = tid; t < n_t; t += WG) {
        let r = split_row(page0, page_shift, t0 + t) * kv4 + head4;
        var sa = vec4<f32>(0.0);                 // heads 0..3
        var sb = vec4<f32>(0.0);                 // heads 4..7
        var c = 0u;
        if KV_NARROW {
            // a narrow slab (f16, bf16: 8 bytes a column): sixteen loads in flight per step
            for (; c + 16u <= d4; c += 16u) {
                let ka = keys8(r + c);
                let kb = keys8(r + c + 8u);
                sa += qk8_lo(c, d4, group, ka);
                sa += qk8_lo(c + 8u, d4, group, kb);
                if group > 4u {
                    sb += qk8_hi(c, d4, ka);
                    sb += qk8_hi(c + 8u, d4, kb);
                }
            }
        }
        for (; c + 8u <= d4; c += 8u) {
            let ka = keys8(r + c);
            sa += qk8_lo(c, d4, group, ka);
            if group > 4u { sb += qk8_hi(c, d4, ka); }
        }
        for (; c < d4; c += 1u) {
            let k = key4(r + c);
            sa += qk_lo(c, d4, group, k);
            if group > 4u { sb += qk_hi(c, d4, k); }
        }
        sa *= scale;
        sb *= scale;
        store_scores(t, split_len, group, sa, sb);
    }
    workgroupBarrier();

    // #include "split_softmax.wgsl" WEIGHT="p"

    // #include "split_plain_values.wgsl"
}
