"""Which folders install under which package names (the rest is in pyproject.toml).

``connectors/`` installs as ``offload_engine.connectors``: the top-level name
``connectors`` belongs to another PyPI project, and installing ours there would
overwrite its files. Nothing installs at the top level but ``offload_engine``.
"""

from setuptools import find_packages, setup


def _under(prefix: str, where: str) -> dict[str, str]:
    """``{package name: folder}``: the folder ``where`` and its packages, as ``prefix.*``."""
    names = {prefix: where}
    for name in find_packages(where):
        names[f"{prefix}.{name}"] = f"{where}/{name.replace('.', '/')}"
    return names


_CONNECTORS = _under("offload_engine.connectors", "connectors")

setup(
    packages=[*find_packages(include=["offload_engine", "offload_engine.*"]), *_CONNECTORS],
    package_dir=_CONNECTORS,
)
