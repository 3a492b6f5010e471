"""What optimized graphs run with: CUDA graph replay, activation offload and recompute, and
asynchronous batch loading (``prefetch``)."""
