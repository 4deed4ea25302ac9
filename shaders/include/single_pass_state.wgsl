// Module-scope workgroup memory of the single-pass kernels (attention_prefill.wgsl,
// flash_attention_tqx.wgsl): the reduction scratch and the online-softmax state.
var<workgroup> red: array<f32, TILE>; // reduction scratch
// Running online-softmax state, broadcast to all threads via workgroup memory.
// [0]=running max, [1]=running sum, [2]=this tile's new max, [3]=correction.
var<workgroup> st: array<f32, 4>;
