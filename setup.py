"""The compiled part of maru-dynamo: only `ext_modules` here; every other fact is in pyproject.toml.

`maru_vllm.native._copyhash` (fused page copy + payload checksum) is optional: when it cannot be
built the wheel still installs and the connector uses its pure torch + xxhash path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "maru_vllm.native._copyhash",
            sources=["maru_vllm/native/copyhash.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
