    // (shaders/include/tq_attention_params.wgsl: the TqAttentionParams fields,
    // read by flash_attention_tq and attention_tq_tiled; inlined by the loader.)
    let n_heads = params.n_heads;
    let n_kv_heads = params.n_kv_heads;
    let head_dim = params.head_dim;
    let max_seq = params.max_seq;
    let start_pos = params.start_pos;
    let scale = params.scale;
    let q_cap = params.q_cap;
    let out_stride = params.out_stride;
    let qjl_scale = params.qjl_scale;
    let sign_off = params.sign_off;
    let c0 = params.c0;
    let c1 = params.c1;
    let c2 = params.c2;
    let c3 = params.c3;
    let q_base = params.q_base;
    let cache_cap = params.cache_cap;
    let flags = params.flags;
    let table_off = params.table_off;
    let page_shift = params.page_shift;
