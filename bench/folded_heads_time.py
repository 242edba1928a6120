"""Time the graphs ``python -m bench.folded_heads_attention --save DIR`` wrote, with numpy and onnxruntime alone.

Run ``python bench/folded_heads_time.py DIR [SECONDS]`` on a machine without torch (the device machine's CPU: a
quiet host, where the 2-CPU development host is too loaded to read a tie). Reads ``{mha,wavlm}_dynamo_{none,mha}
.onnx`` from DIR; per model, shape and thread count (1, 4): sessions at ORT's default level for ``none``, ``mha``
and a second ``mha`` session (A/A), checked against each other (1e-4) and timed interleaved in blocks whose order
rotates for SECONDS (default 8); prints the medians, the median per-block ratio mha / none and the A/A ratio.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnxruntime as ort

SHAPES = {"mha": ("1x64", "4x256", "8x512"), "wavlm": ("1x50", "4x200", "8x500")}
HIDDEN, HOP = 256, 320


def feeds(model: str, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == "wavlm":
        return {"input_values": rng.standard_normal((batch, length * HOP + 80)).astype(np.float32)}
    mask = np.zeros((batch, length), bool)
    mask[0, length - length // 3 :] = True
    return {"x": rng.standard_normal((batch, length, HIDDEN)).astype(np.float32), "key_padding_mask": mask}


def session(path: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = threads, 1, 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def main(folder: str, seconds: float) -> None:
    print(f"ort {ort.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print("| model | shape | threads | none ms | mha ms | mha / none (paired) | A/A | blocks |")
    print("|---|---|---|---|---|---|---|---|")
    for model, shapes in SHAPES.items():
        for shape in shapes:
            batch, length = (int(x) for x in shape.split("x"))
            inputs = feeds(model, batch, length, length)
            for threads in (1, 4):
                paths = {m: os.path.join(folder, f"{model}_dynamo_{m}.onnx") for m in ("none", "mha")}
                sessions = {"none": session(paths["none"], threads), "mha": session(paths["mha"], threads)}
                sessions["copy"] = session(paths["mha"], threads)
                outs = {k: s.run(None, inputs)[0] for k, s in sessions.items()}
                np.testing.assert_allclose(outs["mha"], outs["none"], rtol=1e-4, atol=1e-4, equal_nan=True)
                names, times, block = list(sessions), {k: [] for k in sessions}, 0
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline or block < 6:
                    for name in names[block % 3 :] + names[: block % 3]:
                        start = time.perf_counter()
                        sessions[name].run(None, inputs)
                        times[name].append((time.perf_counter() - start) * 1e3)
                    block += 1
                ratio = np.median(np.array(times["mha"]) / np.array(times["none"]))
                control = np.median(np.array(times["copy"]) / np.array(times["mha"]))
                print(
                    f"| {model} | {shape} | {threads} | {np.median(times['none']):.2f} | {np.median(times['mha']):.2f} "
                    f"| {ratio:.3f} | {control:.3f} | {block} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 8.0)
