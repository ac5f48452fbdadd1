"""chunkserve.kernels: two-phase partition (TPP) attention over a prefix-aware chunked KV cache."""

import sys as _sys

if __name__ == "kernels":
    # Found as a bare top-level ``kernels``: the checkout root is on sys.path (``python -m`` or
    # ``python -c`` run there). PyPI has a ``kernels`` package too (transformers >= 5 imports it), so
    # hand the importer that one instead of this folder, or say what happened.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            f"'kernels' resolved to chunkserve's folder {_os.path.dirname(__file__)} because {_root} is on "
            "sys.path; chunkserve's kernels are `chunkserve.kernels`, and no other 'kernels' package is "
            "installed. Run Python with -P (or PYTHONSAFEPATH=1) from the checkout root.",
            name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds at the end
    _spec.loader.exec_module(_module)
else:
    from chunkserve.kernels.api import (
        BACKENDS,
        chunk_attention,
        decode_attention,
        get_decode_fn,
        resolve_backend,
    )
    from chunkserve.kernels.context import ChunkContext
    from chunkserve.kernels.prefill import prefill_attention
    from chunkserve.kernels.torch_ops import Workspace

__all__ = [
    "BACKENDS",
    "ChunkContext",
    "Workspace",
    "chunk_attention",
    "decode_attention",
    "get_decode_fn",
    "prefill_attention",
    "resolve_backend",
]
