"""The GPU side: device and its owner thread, shader loading, params, kernels."""
