"""chainrun: keep long training runs alive across walltime-limited batch jobs.

This package's top level stays import-light: ``chainrun.checkpoint`` runs
inside training jobs and must not pull in the service's dependencies. So the
Python API (``chainrun.submit``, ``chainrun.chains``, ``chainrun.wait``, ``chainrun.Chain``, in
``chainrun.api``) is imported at its first use, through the module's
``__getattr__`` (PEP 562): ``import chainrun`` alone imports nothing else.
``chainrun.__version__`` is ``chainrun.constants.VERSION``, read at its first use too.
"""

__all__ = ["Chain", "__version__", "chains", "submit", "wait"]

# typing.TYPE_CHECKING without importing typing: mypy reads the names, Python never runs this.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from chainrun.api import Chain, chains, submit, wait
    from chainrun.constants import VERSION as __version__

_API = ("Chain", "chains", "submit", "wait")


def __getattr__(name: str) -> object:
    if name == "__version__":
        from chainrun.constants import VERSION

        return VERSION
    if name in _API:
        from chainrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'chainrun' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "__version__", *_API})
