// The single-pass kernels' online-softmax state reset (running max and sum), then
// a barrier: after each kernel stages its query in workgroup memory.
    if tid == 0u {
        st[0] = NEG_INF; // running max
        st[1] = 0.0; // running sum
    }
    workgroupBarrier();
