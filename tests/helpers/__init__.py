"""Helpers shared by the tests; a test module imports from here (and uses the fixtures of
``tests/conftest.py``), never from another test module.

- ``datagen``: labelled water-like systems (pair-potential labels) written as deepmd/npy or
  deepmd/hdf5;
- ``models``: small model configurations and models, random frames, one-frame evaluation,
  batches of model inputs, a tiny checkpoint;
- ``reference``: brute-force numpy references (neighbour pairs and blocks, the switch);
- ``training``: a tiny training project that trains in seconds;
- ``micro_batch``: a tiny float64 energy model and the attempt functions that drive the batch
  controller (simulated OOMs, weighted gradient accumulation);
- ``processes``: real processes with deadlines: Python workers wired like torchrun, torchrun;
- ``runs``: training runs in the background (preemption, rank failure) and their comparison.
"""
