    // (shaders/include/split_plain_prologue.wgsl: the prologue shared by
    // attention_split.wgsl: params, this workgroup's
    // split window, and the GQA group's queries in workgroup memory; inlined by
    // the loader, barrier included.)
    let tid = lid.x;
    let prm = params[wid.z];                   // this query row's block (an item of the batch)
    let n_heads = prm.n_heads;
    let n_kv_heads = prm.n_kv_heads;
    let head_dim = prm.head_dim;
    let kv_dim = prm.kv_dim;
    let max_seq = prm.max_seq;
    let scale = prm.scale;
    let start_pos = prm.start_pos;
    let split_len = prm.split_len;
    let q_stride = prm.q_stride;
    let n_splits = prm.n_splits;
    let q_row = prm.q_row;
    let q_off = prm.q_off;
    let part_off = prm.part_off;
    let table_off = prm.table_off;
    let page_shift = prm.page_shift;
    let flags = prm.flags;
    let q_total = prm.q_total;

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
    let group = n_heads / n_kv_heads;          // query heads per workgroup (n_kv_heads: the dispatch's head groups)
    let cache_head = kv_head * group / prm.kv_group;  // the cache's KV head they read (kv_group: its GQA group)
    let seg = WG / group;                      // threads per query head in reductions
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
    let head4 = cache_head * head_dim / 4u;     // vec4 offset of this head in a row
    // the pages this split reads, in workgroup memory: a key's row is then one
    // shared-memory read away instead of a dependent global load (split_row)
    let page0 = t0 >> page_shift;
    let n_pg = select(0u, ((t0 + n_t - 1u) >> page_shift) - page0 + 1u, n_t > 0u);
    for (var i = tid; i < n_pg; i += WG) {
        pg_sh[i] = pages[table_off + page0 + i];
    }
    let kv4 = kv_dim / 4u;

    // ── the group's query heads (contiguous: heads kv_head*G .. +G-1) ──
    let q_first = q_off + q_idx * q_stride + kv_head * group * head_dim;
    for (var e = tid; e < group * d4; e += WG) {
        let o = q_first + 4u * e;
        q_sh[e] = vec4<f32>(q_batch[o], q_batch[o + 1u], q_batch[o + 2u], q_batch[o + 3u]);
    }
    workgroupBarrier();
