"""The one compiled part: `galahad.adapters.posix._readhash` (csrc/readhash.c), a checksum frame's
read and hash outside the interpreter lock. Everything else is declared in pyproject.toml.

The extension is optional: where it cannot be built (no C compiler, no Python headers) the install
goes on without it and the filesystem store reads through its Python loop instead, with the same
results (one startup line says which). Built against the limited API of Python 3.11, so one build
serves every later Python."""

import sysconfig

from setuptools import Extension, setup

_X86 = any(arch in sysconfig.get_platform().lower() for arch in ("x86_64", "amd64", "i686", "i386"))

sources = ["csrc/readhash.c", "csrc/xxhash/xxhash.c"]
macros = [("Py_LIMITED_API", "0x030B0000")]
if _X86:  # xxHash's run-time choice of SSE2, AVX2 or AVX-512 (built with baseline flags only)
    sources.append("csrc/xxhash/xxh_x86dispatch.c")
    macros.append(("GALAHAD_XXH_DISPATCH", "1"))

setup(
    ext_modules=[
        Extension(
            "galahad.adapters.posix._readhash",
            sources,
            include_dirs=["csrc/xxhash"],
            define_macros=macros,
            extra_compile_args=["-O3", "-fvisibility=hidden"],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
