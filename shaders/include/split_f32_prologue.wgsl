    // (shaders/include/split_f32_prologue.wgsl: the prologue shared by
    // attention_split.wgsl and attention_split_sg.wgsl: params, this workgroup's
    // split window, and the GQA group's queries in workgroup memory; inlined by
    // the loader, barrier included.)
    let tid = lid.x;
    let n_heads = params.n_heads;
    let n_kv_heads = params.n_kv_heads;
    let head_dim = params.head_dim;
    let kv_dim = params.kv_dim;
    let max_seq = params.max_seq;
    let scale = params.scale;
    let start_pos = params.start_pos;
    let split_len = params.split_len;
    let q_stride = params.q_stride;
    let n_splits = params.n_splits;
    let q_base = params.q_base;
    let flags = params.flags;
    let q_total = params.q_total;

    let split = wid.x;
    let kv_head = wid.y;
    let q_idx = q_base + wid.z;
    let group = n_heads / n_kv_heads;
    let seg = WG / group;                      // threads per query head in reductions
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
    }
    let row0 = (t0 * kv_dim + kv_head * head_dim) / 4u;   // vec4 index of (t0, this head)
    let kv4 = kv_dim / 4u;

    // ── the group's query heads (contiguous: heads kv_head*G .. +G-1) ──
    let q_off = q_idx * q_stride + kv_head * group * head_dim;
    for (var e = tid; e < group * d4; e += WG) {
        let o = q_off + 4u * e;
        q_sh[e] = vec4<f32>(q_batch[o], q_batch[o + 1u], q_batch[o + 2u], q_batch[o + 3u]);
    }
    workgroupBarrier();
