"""Fittings beyond the energy: the equivariant tensor fittings (dipole, polarizability).

Each maps the descriptor ``D`` and its rotation matrix ``gr`` to an atomic tensor, with
DeePMD-kit 3.2's formulas (``deepmd/dpmodel/fitting/``): ``nets.py`` (per-type nets with
several outputs), ``dipole.py``, ``polar.py``, ``config.py`` (their ``fitting_net`` keys,
without torch), ``deepmd_io.py`` (DeePMD-kit's serialised fitting dict, both ways).
"""
