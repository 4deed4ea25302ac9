// (shaders/include/prefill_write_row.wgsl: the f32 prefill kernels' output
// write; module scope, needs `out_batch: array<vec4<f32>>`.)

// Row r's output columns tc and tc + 16 (vec4), if r is a query row of the batch,
// and (thread tc 0) its log-sum-exp `lse` at word lse_off + row * n_heads + head
// (the attend's log-sum-exp region, after its outputs: gpu/kernels.py "LSE").
fn write_row(r: u32, l: f32, lse: f32, a: vec4<f32>, b: vec4<f32>, q_first: u32, q_last: u32, bq: u32,
             head0: u32, head_dim: u32, out_stride: u32, d4: u32, tc: u32, out_off: u32,
             lse_off: u32, n_heads: u32) {
    let qi = q_first + r % bq;
    if qi <= q_last {
        let inv = 1.0 / l;
        let head = head0 + r / bq;
        let o = (out_off + qi * out_stride + head * head_dim) / 4u;
        if tc < d4 { out_batch[o + tc] = a * inv; }
        if tc + 16u < d4 { out_batch[o + tc + 16u] = b * inv; }
        if tc == 0u {
            let w = lse_off + qi * n_heads + head;
            out_batch[w / 4u][w % 4u] = lse;
        }
    }
}
