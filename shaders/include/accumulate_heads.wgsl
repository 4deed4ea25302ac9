            // (shaders/include/accumulate_heads.wgsl: a0..a7 += p * v for the G heads of
            // the group, p the weight of timestep {T} of each head in `scores`.)
            a0 += scores[{T}] * {V};
            if group > 1u {
                a1 += scores[split_len + {T}] * {V};
            }
            if group > 2u {
                a2 += scores[2u * split_len + {T}] * {V};
                a3 += scores[3u * split_len + {T}] * {V};
            }
            if group > 4u {
                a4 += scores[4u * split_len + {T}] * {V};
                a5 += scores[5u * split_len + {T}] * {V};
                a6 += scores[6u * split_len + {T}] * {V};
                a7 += scores[7u * split_len + {T}] * {V};
            }
