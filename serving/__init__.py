"""attnzoo serving: the published ONNX models behind the Open Inference Protocol; never imports torch."""

from pathlib import Path


def _version() -> str:
    """pyproject.toml's version, the one place it is written: from the installed package's metadata,
    else (a checkout never installed) from the file, else (a Triton bundle of this package) unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnzoo")
    except PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        if not pyproject.exists():
            return "0+unknown"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()
