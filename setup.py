"""Build hook for the one compiled module; everything else is in pyproject.toml.

``detectors._bestc`` is the fused ``best`` detector in C (bit-identical to the
pure-Python ``detectors.best.PyBest``). It is optional: without a C compiler the build
goes on and ``detectors.best.Best`` falls back to the Python class (same scores, ~20x
slower per value; ``python -c "import detectors.best as b; print(b.COMPILED)"`` says
which one is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "detectors._bestc",
            sources=["detectors/_bestc.c"],
            # IEEE arithmetic exactly as CPython's floats: no -ffast-math, no FMA
            # contraction, so the scores equal the Python reference bit for bit.
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
