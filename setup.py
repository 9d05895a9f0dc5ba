"""Builds overmind._C from csrc/ against the installed torch.

Install with `pip install --no-build-isolation .` so the extension links the torch
already in the environment. `OVERMIND_NO_EXT=1` skips the extension (pure-Python
fallback through torch.frombuffer); `DEBUG=1` builds with -O0 -g.
"""
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("OVERMIND_NO_EXT", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    debug = os.environ.get("DEBUG", "0") == "1"
    ext_modules.append(
        CppExtension(
            "overmind._C",
            ["csrc/overmind.cpp"],
            extra_compile_args=["-O0", "-g"] if debug else ["-O3"],
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
