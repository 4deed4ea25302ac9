        // (bench/probes/shaders/include/split_tq_v3_vload.wgsl: this thread's value words of rows
        // 8 {J} .. 8 {J} + 7 of its own (grp + n_grp * r) into {DST}0..{DST}7. When
        // the eight rows lie in one page (P >= 8 * n_grp: always at P = 64, d = 128)
        // their words are one page lookup and fixed strides apart.)
        {
            let rj = 8u * {J};
            let tj = grp + n_grp * rj;
            if rj + 7u < n_my && ((t0 + tj) >> page_shift) == ((t0 + tj + 7u * n_grp) >> page_shift) {
                let w0 = (hslot + split_row(page0, page_shift, t0 + tj)) * pw + vw;
                let st = n_grp * pw;
                {DST}0 = vword(w0);
                {DST}1 = vword(w0 + st);
                {DST}2 = vword(w0 + 2u * st);
                {DST}3 = vword(w0 + 3u * st);
                {DST}4 = vword(w0 + 4u * st);
                {DST}5 = vword(w0 + 5u * st);
                {DST}6 = vword(w0 + 6u * st);
                {DST}7 = vword(w0 + 7u * st);
            } else {
                if rj < n_my { {DST}0 = vrow(tj, hslot, page0, page_shift, t0, vw); }
                if rj + 1u < n_my { {DST}1 = vrow(tj + n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 2u < n_my { {DST}2 = vrow(tj + 2u * n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 3u < n_my { {DST}3 = vrow(tj + 3u * n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 4u < n_my { {DST}4 = vrow(tj + 4u * n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 5u < n_my { {DST}5 = vrow(tj + 5u * n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 6u < n_my { {DST}6 = vrow(tj + 6u * n_grp, hslot, page0, page_shift, t0, vw); }
                if rj + 7u < n_my { {DST}7 = vrow(tj + 7u * n_grp, hslot, page0, page_shift, t0, vw); }
            }
        }
