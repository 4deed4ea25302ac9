    // ── in-place Walsh-Hadamard butterfly over {ARR}[0..head_dim) ──
    // (shaders/include/butterfly.wgsl: inlined by the loader, so its barriers stay
    // at entry-point scope; needs `tid`, `head_dim` and `{ARR}` in scope)
    for (var stride = 1u; stride < head_dim; stride = stride * 2u) {
        workgroupBarrier();
        if tid < head_dim / 2u {
            let i = (tid / stride) * 2u * stride + (tid % stride);
            let a = {ARR}[i];
            let b = {ARR}[i + stride];
            {ARR}[i] = a + b;
            {ARR}[i + stride] = a - b;
        }
    }
    workgroupBarrier();
