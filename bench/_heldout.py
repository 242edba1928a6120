"""The driver the held-out probe scripts share (issue 17): build record, optimize job, structure counts, table, CLI.

Each ``bench/heldout_*.py`` keeps only what is its family's own (configs, wrappers, inputs, export, verification,
its columns); the record of a build, the way a job is run on it and kept, and the loop over models and exporters
are one code here so that the rows of every family mean the same thing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from bench.coverage import fusion_counts, run_job  # noqa: E402
from tests.models.corpus import _cause, _strip  # noqa: E402

Row = dict[str, Any]


@contextmanager
def build_record(info: Row, path: Path) -> Iterator[Path]:
    """Yields the temporary file the export goes to; an exception becomes the row's error (where it was raised)
    instead of ending the probe, and the export is removed unless it was its verification that failed (the file
    is then the finding)."""
    started = time.perf_counter()
    tmp = path.with_suffix(".onnx.tmp")
    try:
        yield tmp
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        last = traceback.extract_tb(exc.__traceback__)[-1]
        info.update(ok=False, error=f"{type(exc).__name__}: {_cause(exc)} ({Path(last.filename).name}:{last.lineno})")
        if "verify_error" not in info:
            path.unlink(missing_ok=True)
    info["build_s"] = round(time.perf_counter() - started, 1)


def finish_build(
    info: Row,
    proto: onnx.ModelProto,
    tmp: Path,
    path: Path,
    *,
    builder: str,
    verify: Callable[[], Any],
    keys: tuple[str, ...] = ("max_abs_vs_torch",),
) -> None:
    """Stamps, checks and saves the export, then records ``verify()``'s figures under ``keys`` (its failure is
    kept as ``verify_error`` before it propagates to ``build_record``)."""
    proto = _strip(proto, {"onnxforge.builder": builder})
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, tmp)
    tmp.replace(path)
    try:
        figures = verify()
    except BaseException as exc:
        info["verify_error"] = _cause(exc)[:300]
        raise
    info.update(zip(keys, figures if len(keys) > 1 else (figures,), strict=True))
    info.update(ok=True, nodes=len(proto.graph.node), path=str(path))


def structure(
    src: Path,
    dst: Path | None,
    before: Callable[[onnx.ModelProto, Counter[str]], Row] = lambda model, ops: {},
    after: Callable[[onnx.ModelProto, Counter[str]], Row] = lambda model, ops: {},
) -> Row:
    """Op counts of the upload and, where the job returned one, of the artifact; ``before``/``after`` add a
    family's own counts."""
    model = onnx.load(str(src), load_external_data=False)
    ops = Counter(n.op_type for n in model.graph.node)
    out: Row = {"softmax": ops["Softmax"], **before(model, ops)}
    if dst is not None and dst.exists():
        done_model = onnx.load(str(dst), load_external_data=False)
        done = Counter(n.op_type for n in done_model.graph.node)
        out["fusions"] = fusion_counts(model, done_model)
        out["softmax_after"] = done["Softmax"]
        out["nodes"] = [len(model.graph.node), len(done_model.graph.node)]
        out.update(after(done_model, done))
    return out


def session_ops(path: Path | str) -> Counter[str]:
    """Ops of the graph ORT's session builds at its default level, what a user runs (RMS norms are fused there,
    not in the artifact)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    with tempfile.TemporaryDirectory() as tmp:
        so.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def probe(
    name: str,
    exporter: str,
    out: Path,
    reuse: bool,
    *,
    version: int,
    build: Callable[[str, str, Path], Row],
    counts: Callable[[Path, Path | None], Row],
) -> Row:
    """One row: the record kept from this builder version, or a fresh build optimized by ``run_job`` in a
    temporary folder, its artifact kept next to the export."""
    record = out / f"{name}_{exporter}.json"
    if reuse and record.exists():
        row = json.loads(record.read_text())
        if row.get("builder_version") == version:
            return row
    row = build(name, exporter, out)
    if row.get("ok"):
        with tempfile.TemporaryDirectory(prefix=f"heldout_{name}_{exporter}_") as tmp:
            job = run_job(Path(row["path"]), Path(tmp), benchmark_seconds=1, timeout=900)
            returned = Path(job["path"]) if job.get("ok") else None
            row["structure"] = counts(Path(row["path"]), returned)
            if returned is not None:
                kept = out / f"{name}_{exporter}.fast.onnx"
                kept.write_bytes(returned.read_bytes())
                job["path"] = str(kept)
        row["job"] = job
    record.write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
    return row


def job_notes(job: Row, width: int = 120) -> list[str]:
    """What the report says went short: fusions missing, fuse_transformer not applied, passes that failed."""
    notes = []
    ft = job["fuse_transformer"]
    if ft.get("missing"):
        notes.append(f"missing: {ft['missing']}")
    if ft.get("status") and ft["status"] != "applied":
        notes.append(f"fuse_transformer {ft['status']}: {(ft.get('reason') or '')[:120]}")
    if job["failed_passes"]:
        notes.append("failed: " + "; ".join(f[:width] for f in job["failed_passes"]))
    return notes


def fusion_cells(row: Row, notes: Callable[[Row], list[str]]) -> list[str]:
    """The encoder tables' columns (job, exact, attention / norms / GELU fused against expected, speedup and
    notes); ``notes(row)`` gives a family's own notes, asked only of a row whose job ran."""
    name, exporter = row["model"], row["exporter"]
    if not row.get("ok"):
        if "does not support an attention implementation" in row["error"]:
            return [name, exporter, "n/a", "", "", "", "", "transformers has no SDPA attention for it"]
        return [name, exporter, "export failed", "", "", "", "", row["error"][:160]]
    job = row["job"]
    if not job.get("ok"):
        return [name, exporter, "**failed**", "", "", "", "", job["error"][:200]]
    fus = row["structure"].get("fusions", {})
    att, norm, gelu = fus.get("attention", {}), fus.get("skip_norm", {}), fus.get("gelu", {})
    speed = job.get("gate_speedup")
    return [
        name,
        exporter,
        f"ok ({job['decision']})",
        f"yes ({job['max_abs']:.1e})" if job["exact"] else f"**no** ({job['max_abs']:.1e})",
        f"{att.get('found', 0)}/{att.get('expected', 0)}",
        f"{norm.get('found', 0)}/{norm.get('expected', 0)}",
        f"{gelu.get('found', 0)}/{gelu.get('expected', 0)}",
        (f"x{speed:.2f}; " if speed else "") + "; ".join(notes(row)),
    ]


def positional_wrapper(model: Any, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    """``model`` (a transformers model) as a module of positional inputs in ``inputs`` order returning its
    ``outputs`` fields as a tuple: the exporters name the inputs from that order. One class per arity, because
    dynamo maps ``dynamic_shapes`` onto the named arguments of ``forward``."""
    import torch

    class Base(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def run(self, *args: Any) -> tuple[Any, ...]:
            result = self.model(**dict(zip(inputs, args, strict=True)), return_dict=True)
            return tuple(getattr(result, k) for k in outputs)

    class One(Base):
        def forward(self, a: Any) -> tuple[Any, ...]:
            return self.run(a)

    class Two(Base):
        def forward(self, a: Any, b: Any) -> tuple[Any, ...]:
            return self.run(a, b)

    class Three(Base):
        def forward(self, a: Any, b: Any, c: Any) -> tuple[Any, ...]:
            return self.run(a, b, c)

    class Four(Base):
        def forward(self, a: Any, b: Any, c: Any, d: Any) -> tuple[Any, ...]:
            return self.run(a, b, c, d)

    return (One, Two, Three, Four)[len(inputs) - 1]().eval()


def table(head: list[str], cells: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines)


def arguments(
    prog: str, doc: str | None, names: Iterable[str], exporters: Iterable[str], nargs: str = "+"
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    parser.add_argument("--only", nargs=nargs, choices=sorted(names), default=list(names))
    parser.add_argument("--exporters", nargs=nargs, choices=list(exporters), default=list(exporters))
    return parser


def run_all(
    names: Iterable[str],
    exporters: Iterable[str],
    one: Callable[[str, str], Row],
    cells: Callable[[Row], list[str]],
) -> list[Row]:
    """Every model with every exporter, each row printed as it comes (a long run shows its progress)."""
    rows = []
    for name in names:
        for exporter in exporters:
            row = one(name, exporter)
            print("| " + " | ".join(cells(row)) + " |", flush=True)
            rows.append(row)
    return rows


def encoder_main(
    argv: list[str] | None,
    *,
    prog: str,
    doc: str | None,
    specs: Iterable[str],
    exporters: Iterable[str],
    out: Path,
    one: Callable[[str, str, Path, bool], Row],
    cells: Callable[[Row], list[str]],
    head: list[str],
    results: bool = False,
) -> int:
    """``--only``, ``--exporters``, ``--reuse``, ``--out``: every row printed, then the table (and, with
    ``results``, all rows in ``results.json``)."""
    parser = arguments(prog, doc, specs, exporters)
    parser.add_argument("--reuse", action="store_true", help=f"keep the rows already in --out (default {out})")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_all(args.only, args.exporters, lambda n, e: one(n, e, args.out, args.reuse), cells)
    if results:
        (args.out / "results.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    print()
    print(table(head, map(cells, rows)))
    return 0


def attention_cell(counts: Row) -> str:
    """The attention fusions of a row's structure counts: fused ops in the artifact / Softmax nodes in the upload."""
    fused = counts.get("fusions", {}).get("attention", {})
    return f"{fused.get('found', 0)}/{fused.get('expected', 0)}"


ATTENTION_COLUMN = ("attention fused / Softmax", attention_cell)


def run_exports(
    paths: Iterable[Path],
    extra: tuple[str, Callable[[Row], str]] | None = None,
    label: Callable[[Path], str] = lambda path: path.stem,
) -> None:
    """A ``fast`` job on each export of another toolchain's probe (``bench.coverage.run_job``), one table row
    printed as it comes: ``label(path)``, job, exact, passes applied, ``extra``'s column (a header and a cell
    read from the structure counts), speedup and notes. A ``.fast.onnx`` artifact beside an export is not sent."""
    head = ["model", "job", "exact", "passes applied", *([extra[0]] if extra else []), "speedup; notes"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|", flush=True)
    for path in paths:
        if path.name.endswith(".fast.onnx"):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            job = run_job(path, Path(tmp), benchmark_seconds=1, timeout=900)
            counts = structure(path, Path(job["path"]) if job.get("ok") else None)
        own = [extra[1](counts)] if extra else []
        if not job.get("ok"):
            cells = [label(path), "**failed**", "", "", *own, job.get("error", "")[:300]]
        else:
            cells = [
                label(path),
                f"ok ({job['decision']})",
                f"{'yes' if job['exact'] else 'no'} ({job['max_abs']:.1e})",
                ", ".join(job["applied"]),
                *own,
                (f"x{job['gate_speedup']:.2f}; " if job.get("gate_speedup") else "not timed; ")
                + "; ".join(job_notes(job))[:300],
            ]
        print("| " + " | ".join(c.replace("|", "/") for c in cells) + " |", flush=True)
