"""chainrun: keep long training runs alive across walltime-limited batch jobs.

This package's top level stays import-light: ``chainrun.checkpoint`` runs
inside training jobs and must not pull in the service's dependencies. So the
Python API (``chainrun.submit``, ``chainrun.chains``, ``chainrun.Chain``, in
``chainrun.api``) is imported at its first use, through the module's
``__getattr__`` (PEP 562): ``import chainrun`` alone imports nothing else.
"""

__version__ = "0.1.0"
__all__ = ["Chain", "__version__", "chains", "submit"]

# typing.TYPE_CHECKING without importing typing: mypy reads the names, Python never runs this.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from chainrun.api import Chain, chains, submit

_API = ("Chain", "chains", "submit")


def __getattr__(name: str) -> object:
    if name in _API:
        from chainrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'chainrun' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
