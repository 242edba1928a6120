"""onnxforge graph passes.

Each module holds one pass (a ``passes._infra.Pass`` subclass) that rewrites an ``onnx_ir.Model``;
``passes.registry`` lists them explicitly and builds them from a job's pass specs. This package imports
nothing on purpose: importing ``passes`` must stay cheap for the API process, which only needs the
catalogue when it asks ``passes.registry`` for it.
"""
