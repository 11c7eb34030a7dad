"""CowClip-Adam for TorchRec embeddings: the math (``reference``: torch ops, the reference every
kernel is tested against; ``catchup``: rows absent for n steps brought up to date when next read),
the kernels (``kernels/``), table-batched storage with the update inside the backward (``tbe``),
the cross-rank step of column-wise and data-parallel tables (``exchange``), and the drop-in
sharders and compute kernels for TorchRec: ``sharder`` for EmbeddingBagCollection (and what
both share), ``sequence`` for EmbeddingCollection. docs/cowclip.md.

Submodules are imported by their full names; importing this package imports nothing else.
"""
