"""Build script. The package is pure Python for now; the checksum kernels in csrc/ will be built
here as a torch extension (ABFT_BUILD=auto|cuda|cpu|none)."""

from setuptools import setup

setup()
