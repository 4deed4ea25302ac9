// The write path of the plain kv formats (`kv_write_rows`): a batch's appended rows
// copied into their pool slabs, one params block per row, each row to the slab row its
// layer's page table names (the plain twin of tqx.wgsl's encodes; rows in the layer's
// dtype, as sent or converted by convert.wgsl before this runs). A row is `row_words` u32 words (kv_dim f32 values, or
// kv_dim halves, IEEE or bfloat16, two to a word: f16 and bf16 take an even head_dim), the same layout in the
// input arena and in the slab (row-major [rows, kv_dim], pool.py).
//
// @binding(0) src:    array<u32>  the input arena: row j of the item at word src_off + j * row_words
// @binding(1) k_cache: array<u32> the pool slab's keys (rw)
// @binding(2) v_cache: array<u32> the pool slab's values (rw)
// @binding(3) wparams: array<KvWriteParams> (gpu/params.py KV_WRITE_PARAMS), block
//   workgroup_id.y for one row: its keys at word src_off, its values at v_off, its
//   timestep t of the layer whose page table starts at word table_off
// @binding(4) pages:  array<u32>  page tables (pool.PageTables)
// Dispatch: (1, rows, 1) workgroups of 256 threads.

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read_write> v_cache: array<u32>;
// #struct KvWriteParams
@group(0) @binding(3) var<storage, read> wparams: array<KvWriteParams>;   // one block per row (wid.y)
@group(0) @binding(4) var<storage, read> pages: array<u32>;

// #include "paging.wgsl"

const WG: u32 = 256u;

@compute @workgroup_size(256, 1, 1)
fn kv_write_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let p = wparams[wid.y];
    let row_words = p.row_words;
    let src_off = p.src_off;
    let v_off = p.v_off;
    let dst = phys_row(p.table_off, p.page_shift, p.t) * row_words;
    for (var w = lid.x; w < row_words; w += WG) {
        k_cache[dst + w] = src[src_off + w];
        v_cache[dst + w] = src[v_off + w];
    }
}
