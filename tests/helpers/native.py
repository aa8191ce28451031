"""What the tests of the compiled CPU kernels (``tether.engine.native``) share."""

import shutil

import pytest

from tether.engine import native

needs_toolchain = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler here"
)


def built_kernels():
    """The compiled module; where a compiler is here it must build (a failure is a test failure)."""
    built = native.compiled_kernels()
    assert built is not None, "a C++ compiler is here but the kernels did not build (see the warning)"
    return built
