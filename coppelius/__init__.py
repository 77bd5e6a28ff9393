"""Coppelius: train a small GPT-style language model with exact, checkable semantics.

One import name holds the whole project: `coppelius.reference` (the NumPy
definition of the semantics), `coppelius.accelerated` (the CuPy and MLX
backends), `coppelius.conformance` (the suite that compares them) and
`coppelius.bench` (step timings beside the PyTorch peer).

In the source tree these sub-packages are the top-level folders
`reference/`, `accelerated/`, `conformance/` and `bench/`; an installed copy
has them under `coppelius/` (pyproject.toml maps them with `package-dir`).
Run from the tree, the tree's root is added to this package's search path,
so `coppelius.reference` resolves to `reference/` there too.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "reference")) and os.path.isfile(
        os.path.join(_TREE, "reference", "__init__.py")):
    __path__.append(_TREE)  # noqa: F821  (a package's module search path)
