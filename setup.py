"""Build of kvroute's compiled modules: ``membership.kv_native`` (the KV-event batch decoder's common form),
``index.key_table_native`` (the index's key -> node id table, keys and ids stored inline),
``index.engine_table_native`` (a replica's engine page hash -> router key table, in insertion order, hashes and
keys stored inline) and ``index.hash_native`` (the chained block-key loop).

Everything else is in pyproject.toml. The modules are optional: when they cannot be built (no C compiler), the
install goes on and the Python forms run (``membership.kv_decode`` decodes every batch in Python, ~3.5x the CPU;
``index.key_table`` keeps the map in dicts with ``index.id_map``'s loops, ``index.engine_table`` in a dict,
``index.hashing`` runs its chained loop), with the same results. ``make venv`` builds them and checks that they import.
"""

from typing import Any

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
#: what every module is built with: optional, so an install without a C compiler goes on with the Python forms
_EACH: dict[str, Any] = {"extra_compile_args": _FLAGS, "optional": True}
#: the header index's two tables share (index/table_args.h): a change to it rebuilds both
_TABLES_H = ["index/table_args.h"]

setup(
    ext_modules=[
        Extension("membership.kv_native", sources=["membership/kv_native.c"], **_EACH),
        Extension("index.key_table_native", sources=["index/key_table_native.c"], depends=_TABLES_H, **_EACH),
        Extension(
            "index.engine_table_native", sources=["index/engine_table_native.c"], depends=_TABLES_H, **_EACH
        ),
        # XXH3 is found at import in the loaded xxhash package's module (dlsym): nothing of xxHash is built here
        Extension("index.hash_native", sources=["index/hash_native.c"], libraries=["dl"], **_EACH),
    ]
)
