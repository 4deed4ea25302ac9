    // (shaders/include/split_tq_prologue.wgsl: the prologue shared by
    // flash_attention_tq_split.wgsl and flash_attention_tq_split_sg.wgsl: params,
    // this workgroup's split window, and the GQA group's queries in workgroup
    // memory; inlined by the loader, barrier included.)
    // #include "split_tq_common_prologue.wgsl"
    }

    // Compressed regions of this layer.
    let pw = head_dim / 16u;
    let jw = head_dim / 32u;
    let vecs = n_kv_heads * cache_cap;
    let k_jl_off = vecs * pw;
    let k_norm_off = k_jl_off + vecs * jw;
    let v_norm_off = vecs * pw;
    let hslot = kv_head * cache_cap;             // slot of this head's slab row 0
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
