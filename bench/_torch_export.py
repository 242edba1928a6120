"""The export loop the torch-built held-out probes share (timm, diffusers, time series, recommenders).

Imports torch, onnx and onnxruntime only, so that it runs in the probes' own venvs (a CPU torch with timm or
diffusers beside it), where the project's dependencies are not installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.heldout_detection import _check

# (axis, name) of each input's free axis, in input order; or a sequence of them for an input with several
Dims = Sequence[tuple[int, str] | Sequence[tuple[int, str]]]


def _axes(dim: tuple[int, str] | Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    if not dim:  # an input with every axis fixed
        return []
    return [dim] if isinstance(dim[0], int) else list(dim)  # type: ignore[list-item]


def export_both(
    model: Any,
    example: Callable[[int], tuple],
    names: Sequence[str],
    dims: Dims,
    *,
    out: Path,
    stem: str,
    output: str = "out",
    sizes: tuple[int, int, int] = (2, 2, 3),
) -> None:
    """``model`` exported with the TorchScript exporter (opset 17) and dynamo (opset 18) to ``out/stem_ts.onnx``
    and ``out/stem_dynamo.onnx``, the free axes ``dims`` dynamic; each checked in ONNX Runtime against torch.
    ``example(n)`` gives the inputs at size ``n``: ``sizes[0]`` for the export (not 1, which torch.export
    specializes), the other two for the check. A line per file; a failure is printed, not raised."""
    import onnx
    import torch

    free = {name: torch.export.Dim(name, min=1, max=4096) for dim in dims for _, name in _axes(dim)}
    for form in ("ts", "dynamo"):
        path = out / f"{stem}_{form}.onnx"
        try:
            if form == "ts":
                axes = {n: dict(_axes(dim)) for n, dim in zip(names, dims, strict=True)}
                torch.onnx.export(model, example(sizes[0]), str(path), opset_version=17, dynamo=False,
                                  input_names=list(names), output_names=[output], dynamic_axes=axes)  # fmt: skip
            else:
                shapes = tuple({axis: free[d] for axis, d in _axes(dim)} for dim in dims)
                program = torch.onnx.export(model, example(sizes[0]), dynamo=True, opset_version=18,
                                            input_names=list(names), output_names=[output],
                                            dynamic_shapes=shapes)  # fmt: skip
                program.save(str(path))
            worst = _check(path, model, [list(example(sizes[1])), list(example(sizes[2]))])
            nodes = len(onnx.load(str(path)).graph.node)
            print(path.stem, nodes, "nodes; max |ort - torch|", f"{worst:.2e}", flush=True)
        except Exception as exc:  # a row of the table, not the end of the probe
            path.unlink(missing_ok=True)
            print(path.stem, "build failed:", type(exc).__name__, str(exc).splitlines()[0][:200], flush=True)


def build_models(models: Iterable[tuple[str, Any, Callable[[int], tuple], Sequence[str], Dims]], out: Path,
                 only: list[str] | None = None) -> None:  # fmt: skip
    """Each of ``models`` (name, module, example, input names, free axes) perturbed as every probe's are
    (``bench.heldout_detection._perturb``), in eval mode, and exported both ways into ``out``; ``only``: those
    names."""
    from bench.heldout_detection import _perturb

    out.mkdir(parents=True, exist_ok=True)
    for name, model, example, names, dims in models:
        if only and name not in only:
            continue
        _perturb(model)
        model.eval()
        export_both(model, example, names, dims, out=out, stem=name)


def probe_main(out: Path, build: Callable[[list[str] | None], None], *, attention: bool = True) -> None:
    """A torch-built probe's command line: ``build [NAME ...]`` (in the probe's venv), or ``run`` (the default,
    in the project's): a ``fast`` job on each export in ``out``, with the attention column unless told not."""
    repo = str(Path(__file__).resolve().parent.parent)
    if repo not in sys.path:  # probes run as files too
        sys.path.insert(0, repo)
    command = sys.argv[1] if len(sys.argv) > 1 else "run"
    if command == "build":
        build(sys.argv[2:] or None)
        return
    from bench import _heldout

    _heldout.run_exports(sorted(out.glob("*.onnx")), _heldout.ATTENTION_COLUMN if attention else None)
