        // (bench/probes/shaders/include/split_tq_v2_accumulate.wgsl: row {T}'s value word {W}
        // into a0..a7: its four codes at bit vsh decoded, times each head's weight.)
        {
            let cv = dec4v({W}, vsh, cb);
            let wq = wrow({T}, 0u);
            a0 += wq.x * cv;
            if GROUP > 1u {
                a1 += wq.y * cv;
            }
            if GROUP > 2u {
                a2 += wq.z * cv;
                a3 += wq.w * cv;
            }
            if GROUP > 4u {
                let wr = wrow({T}, 1u);
                a4 += wr.x * cv;
                a5 += wr.y * cv;
                a6 += wr.z * cv;
                a7 += wr.w * cv;
            }
        }
