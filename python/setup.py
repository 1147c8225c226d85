"""Copies the library into the package being built, so that an installed cudapool finds
it beside itself: $CUDAPOOL_LIB if set, else ../bin/libcudapool.so, where the README's
build puts it. The rest of the configuration is pyproject.toml's."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        lib = os.environ.get("CUDAPOOL_LIB") or os.path.join(HERE, "..", "bin", "libcudapool.so")
        if os.path.exists(lib):
            dst = os.path.join(self.build_lib, "cudapool")
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(lib, os.path.join(dst, "libcudapool.so"))


setup(cmdclass={"build_py": BuildWithLibrary})
