"""Build of kvroute's one compiled module (``membership.kv_native``, the KV-event batch decoder's common form).

Everything else is in pyproject.toml. The module is optional: when it cannot be built (no C compiler), the install
goes on and ``membership.kv_decode`` decodes every batch in Python (same results, ~4x the CPU). ``make venv``
builds it and checks that it imports (``scripts/check_native.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "membership.kv_native",
            sources=["membership/kv_native.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
