    // (shaders/include/tq_attention_params.wgsl: the TqAttentionParams fields,
    // read by flash_attention_tqx and attention_tqx_tiled; inlined by the loader.)
    let n_heads = prm.n_heads;
    let n_kv_heads = prm.n_kv_heads;
    let head_dim = prm.head_dim;
    let max_seq = prm.max_seq;
    let start_pos = prm.start_pos;
    let scale = prm.scale;
    let q_cap = prm.q_cap;
    let out_stride = prm.out_stride;
    let qjl_scale = prm.qjl_scale;
    let sign_off = prm.sign_off;
    let q_base = prm.q_base;
    let cache_cap = prm.cache_cap;
    let flags = prm.flags;
    let table_off = prm.table_off;
    let q_off = prm.q_off;
    let out_off = prm.out_off;
    let page_shift = prm.page_shift;
