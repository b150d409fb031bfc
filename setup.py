"""Build streamload's optional native parts: the JPEG batch kernel, the batch read (the rest: pyproject.toml).

The extension is optional: without a C compiler or libjpeg-turbo's headers (Debian:
``libjpeg62-turbo-dev``) the install still succeeds, and decoding takes the per-sample path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "streamload.decode._jpegbatch",
            sources=["streamload/decode/_jpegbatch.c"],
            depends=["streamload/_draws_core.h", "streamload/_then.h"],
            libraries=["jpeg", "m"],
            # (-ffp-contract=off: its crop draws round as Python's, see streamload/_draws_core.h)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        ),
        # A batch's preads in one call without the GIL (streamload._pread); no library needed.
        # (the system's xxHash, libxxhash.so.0, is looked up at run time: it hashes the reads when there)
        Extension(
            "streamload._gather",
            sources=["streamload/_gather.c"],
            depends=["streamload/_then.h"],
            libraries=["dl"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # A batch's random crops and flips, drawn as numpy draws them (streamload.decode.native); no library needed.
        Extension(
            "streamload._draws",
            sources=["streamload/_draws.c"],
            depends=["streamload/_draws_core.h"],
            libraries=["m"],
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        ),
    ]
)
