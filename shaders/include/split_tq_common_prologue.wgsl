    // (shaders/include/split_tq_common_prologue.wgsl: the part of the prologue every
    // TurboQuant split kernel shares (split_tq_prologue.wgsl, split_tqx_prologue.wgsl):
    // the params and this workgroup's split window; no barrier.)
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
    let c0 = prm.c0;
    let c1 = prm.c1;
    let c2 = prm.c2;
    let c3 = prm.c3;
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
    let group = GROUP;                         // = n_heads / n_kv_heads, fixed per pipeline
    let seg = WG / group;
    let d4 = head_dim / 4u;
    let pos_q = start_pos + q_idx;
    var seq_len = min(pos_q + 1u, max_seq);
    if (flags & FLAG_NON_CAUSAL) != 0u {
        seq_len = max_seq;
    }
    let t0 = split * split_len;
    var n_t = 0u;
    if t0 < seq_len {
        n_t = min(split_len, seq_len - t0);
