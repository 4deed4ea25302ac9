// (shaders/include/paging.wgsl: where a layer's timestep lives in the paged KV
// pool, service/attnserve/pool.py. `pages` holds page tables; a layer's table
// starts at word `table_off`; a page holds 1 << `shift` timesteps; timestep t is
// row (pages[table_off + t / P] * P + t % P) of the slab bound as the cache.)
fn phys_row(table_off: u32, shift: u32, t: u32) -> u32 {
    return (pages[table_off + (t >> shift)] << shift) | (t & ((1u << shift) - 1u));
}
