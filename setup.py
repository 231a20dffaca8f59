"""Package layout that pyproject.toml cannot express on its own.

The kernels live in a top-level ``kernels/`` folder so that the data flow reads from the tree
(Arrow batches in ``src/lossmask``, kernels in ``kernels/``), yet they ship inside the installed
package as ``lossmask.kernels``.
"""

from setuptools import setup

setup(
    packages=["lossmask", "lossmask.kernels", "lossmask.data"],
    package_dir={"lossmask": "src/lossmask", "lossmask.kernels": "kernels"},
    package_data={"lossmask": ["py.typed"], "lossmask.data": ["*.json"]},
)
