        // (shaders/include/split_sum_row_groups.wgsl, of attention_split.wgsl and
        // attention_split_wide.wgsl: inside their loop over pairs of heads h0, h0+1,
        // after each row group has put its accumulators of the pair in `scores`, head
        // hx's float e of row group g at hx * {PASS} + g * head_dim + e: the row groups
        // summed and written as the heads' partial accumulators. Barrier included.)
        workgroupBarrier();
        // thread -> (head hh of this pass, float column e)
        let hh = tid / head_dim;
        let e = tid % head_dim;
        for (var hx = hh; hx < 2u; hx += WG / head_dim) {
            if h0 + hx < group {
                var sum = 0.0;
                for (var g = 0u; g < n_grp; g += 1u) {
                    sum += scores[hx * {PASS} + g * head_dim + e];
                }
                partial[part_off + (pbase + (h0 + hx) * split_total) * head_dim + e] = sum;
            }
        }
