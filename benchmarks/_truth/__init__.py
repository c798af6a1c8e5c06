"""The CUDA truth corpus: what a real GPU's caching allocator did, kept in the repository.

A corpus is a folder (``benchmarks/data/cuda_truth/<gpu>-<date>/``) with an ``index.json``
and one compressed file per case (``cases/<case>.json.gz``). See
``benchmarks/data/cuda_truth/README.md`` for the layout; :mod:`_truth.corpus` reads and
writes it, :mod:`_truth.cases` lists the cases, :mod:`_truth.record` records them (on a
real GPU, or on a simulated one with the same format), :mod:`_truth.replay` runs a recorded
request stream through the allocator model, and :mod:`_truth.diff` sets the estimator's
predicted stream against the real one.
"""
