    // ── red[0] = sum of red[0..128) ──
    // (shaders/include/tree_sum_128.wgsl: inlined by the loader, so its barriers
    // stay at entry-point scope; needs `tid` and a `red` of at least 128 in scope)
    workgroupBarrier();
    if tid < 64u { red[tid] += red[tid + 64u]; }
    workgroupBarrier();
    if tid < 32u { red[tid] += red[tid + 32u]; }
    workgroupBarrier();
    if tid < 16u { red[tid] += red[tid + 16u]; }
    workgroupBarrier();
    if tid < 8u { red[tid] += red[tid + 8u]; }
    workgroupBarrier();
    if tid < 4u { red[tid] += red[tid + 4u]; }
    workgroupBarrier();
    if tid < 2u { red[tid] += red[tid + 2u]; }
    workgroupBarrier();
    if tid < 1u { red[tid] += red[tid + 1u]; }
    workgroupBarrier();
