    // (shaders/include/split_tqx_prologue.wgsl: the prologue of the TurboQuant split
    // kernels (flash_attention_tqx_split.wgsl): the params, this workgroup's
    // split window, the format's regions (tqx.wgsl), its codebooks and the split's
    // page table entries in workgroup memory, and the GQA group's rotated queries;
    // inlined by the loader, barrier included.)
    let tid = lid.x;
    let prm = params[wid.z];                   // this query row's block (an item of the batch)
    let n_heads = prm.n_heads;
    let n_kv_heads = prm.n_kv_heads;
    let head_dim = HEAD_DIM;                   // = prm.head_dim, fixed per pipeline
    let max_seq = prm.max_seq;
    let start_pos = prm.start_pos;
    let scale = prm.scale;
    let q_cap = prm.q_cap;
    let split_len = prm.split_len;
    let qjl_scale = prm.qjl_scale;
    let n_splits = prm.n_splits;
    let q_row = prm.q_row;
    let q_off = prm.q_off;
    let part_off = prm.part_off;
    let table_off = prm.table_off;
    let page_shift = prm.page_shift;
    let cache_cap = prm.cache_cap;
    let flags = prm.flags;

    let split = wid.x;
    let kv_head = wid.y;
    let q_idx = q_row;
    if split >= n_splits {
        return;                                // a shorter item of the batch
    }
    // the item's partials hold split_total splits (every part of a windowed attend);
    // this dispatch's are split_base .. split_base + n_splits - 1 of them
    let split_total = prm.split_total;
    let split_at = prm.split_base + split;
    let group = GROUP;                         // query heads per workgroup, fixed per pipeline
    let cache_head = kv_head * group / prm.kv_group;  // the cache's KV head they read (kv_group: its GQA group)
    let seg = WG / group;
    let d4 = head_dim / 4u;
    let pos_q = start_pos + q_idx;
    var seq_len = min(pos_q + 1u, max_seq);
    if (flags & FLAG_NON_CAUSAL) != 0u {
        seq_len = max_seq;
    }
    // this split's keys: timesteps t_first .. (logical; a part of a windowed attend
    // starts at t_lo), read from cache rows t0 .. (the cache's row 0 holds timestep row_base)
    let t_first = prm.t_lo + split * split_len;
    var n_t = 0u;
    if t_first < seq_len {
        n_t = min(split_len, seq_len - t_first);
    }
    let t0 = t_first - prm.row_base;

    // #include "tqx_regions.wgsl"
    g_vcw = vcw;
    g_lw = lw;
    g_pwd = pwd;
    g_vn_off = v_norm_off;
    g_vo_off = v_out_off;
    g_vow = vow;
    g_isd = 1.0 / sqrt(f32(head_dim));
    if tid < 16u {
        var kc = key_centroids(head_dim);
        var vc = value_centroids(head_dim);
        kc_sh[tid] = kc[tid];
        vc_sh[tid] = vc[tid];
    }
    let hslot = cache_head * cache_cap;          // slot of this head's slab row 0
    // the pages this split reads, in workgroup memory: a key's row is then one
    // shared-memory read away instead of a dependent global load (split_row)
    let page0 = t0 >> page_shift;
    let n_pg = select(0u, ((t0 + n_t - 1u) >> page_shift) - page0 + 1u, n_t > 0u);
    for (var i = tid; i < n_pg; i += WG) {
        pg_sh[i] = pages[table_off + page0 + i];
    }

    // ── the group's rotated queries, as vec4 ──
    let q_region = q_cap * n_heads * head_dim;
    let q_first = q_off + (q_idx * n_heads + kv_head * group) * head_dim;
    for (var e = tid; e < group * d4; e += WG) {
        let o = q_first + 4u * e;
        qbuf[e] = vec4<f32>(qrot[o], qrot[o + 1u], qrot[o + 2u], qrot[o + 3u]);
        let oj = q_region + o;
        qbuf[256u + e] = vec4<f32>(qrot[oj], qrot[oj + 1u], qrot[oj + 2u], qrot[oj + 3u]);
    }
    if tid < group {
        qsum_sh[tid] = qrot[q_off + 2u * q_region + q_idx * n_heads + kv_head * group + tid];
    }
    workgroupBarrier();
