"""CUDA: page-locked host memory, and whole KV blocks copied between it and a GPU's paged KV cache.

- `pinned`: the pool of pinned host buffers (`PinnedPool`, `PinnedBuffer`), arenas, and the
  reader processes' shared region registered with CUDA.
- `transfer`: whole blocks gathered out of and scattered into the KV cache (`CudaBlockTransfer`,
  `transfer_for`), streamed in while still being read (`StreamIn`).
- `placement`: the two kernels a layer that place a batch of rows, and their CUDA graph.

torch is imported by these modules, not by this package: import the one you need.
"""
