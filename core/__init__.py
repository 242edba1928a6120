"""The ground floor: what app, workers and passes all stand on.

Typed settings, the job store, the blob store, errors, job config, the session recipe, the benchmark
verdict, the broker client, ORT session helpers and webhook signing. Nothing here imports ``app``,
``workers``, ``passes`` or ``onnxforge`` (the import-linter contract in pyproject.toml fails the build
otherwise), and this package imports nothing on purpose so that each module stays cheap to load.
"""
