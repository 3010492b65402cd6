"""chainrun: keep long training runs alive across walltime-limited batch jobs.

This package's top level stays import-light: ``chainrun.checkpoint`` runs
inside training jobs and must not pull in the service's dependencies.
"""

__version__ = "0.1.0"
