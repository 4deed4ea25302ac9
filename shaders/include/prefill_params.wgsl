    // (shaders/include/prefill_params.wgsl: the PREFILL_PARAMS words of `prm`: the
    // block's own in the batched query-block kernels; inlined by the loader.)
    let n_heads = prm.n_heads;
    let n_kv_heads = prm.n_kv_heads;
    let head_dim = prm.head_dim;
    let kv_dim = prm.kv_dim;
    let max_seq = prm.max_seq;
    let scale = prm.scale;
    let start_pos = prm.start_pos;
    let n_queries = prm.n_queries;
    let q_stride = prm.q_stride;
    let out_stride = prm.out_stride;
    let q_base = prm.q_base;
    let flags = prm.flags;
    let table_off = prm.table_off;
    let q_off = prm.q_off;
    let out_off = prm.out_off;
    let page_shift = prm.page_shift;
