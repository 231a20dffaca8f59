"""Package layout that pyproject.toml cannot express on its own.

The kernels live in a top-level ``kernels/`` folder so that they read apart from the Python that
feeds them (each beside its readable reference), yet they ship inside the installed package as
``lossmask.engine.kernels``: the engine is the one stage that calls them.
"""

from setuptools import setup

setup(
    packages=["lossmask", "lossmask.chat", "lossmask.engine", "lossmask.engine.kernels", "lossmask.jobs",
              "lossmask.markers", "lossmask.data"],
    package_dir={"lossmask": "src/lossmask", "lossmask.engine.kernels": "kernels"},
    package_data={"lossmask": ["py.typed"], "lossmask.data": ["*.json"]},
)
