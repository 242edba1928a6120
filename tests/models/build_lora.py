"""Build the LoRA fixtures under ``tests/models/lora/`` (a tiny BERT with peft LoRA adapters).

Run ``python -m tests.models.build_lora`` (needs the ``dev`` extra: torch, transformers, peft). Writes:

* ``bert_lora.onnx``: ``BertModel`` (the tiny ``bert_encoder`` of ``build_hf``, same seeds and weight noise)
  wrapped by peft with adapter ``one`` (r=4, alpha=8) on ``query`` and ``value`` of every layer, exported
  unmerged by the dynamo exporter (opset 18, eager attention). As in a real export, the LoRA weights lose
  their peft names (they are ``val_NN`` constants); the only hints left are the base layers' bias names
  (``...query.base_layer.bias``) and the exporter's ``pkg.torch.onnx.name_scopes`` node metadata, which is
  kept (every other piece of node metadata, e.g. stack traces with local paths, is dropped).
* ``bert_lora_legacy.onnx``: the same peft model through the TorchScript exporter (``dynamo=False``), the
  form the issue quotes: ``onnx::MatMul_NNN`` initializers, nodes ``.../query/default/MatMul`` and
  ``.../query/default_1/MatMul``.
* ``adapter_one/``, ``adapter_two/``: ``save_pretrained`` of the two peft adapters (``adapter_config.json``
  + ``adapter_model.safetensors``); ``two`` has r=8, alpha=4 (a different rank and scale than the export).
* ``expected.npz``: for two padded input sets (``set{i}.{input}``), the torch outputs of the base model
  (``set{i}.base``), with adapter one (``set{i}.one``) and with adapter two (``set{i}.two``).

Standard peft setups, each exported by both exporters (``<name>.onnx`` dynamo, ``<name>_legacy.onnx``
TorchScript), with ``expected_standard.npz`` (``<name>.set{i}.{input}``, ``.base``, ``.lora``):

* ``bert_cls_lora``: ``BertForSequenceClassification`` with peft's sequence-classification config
  (``task_type="SEQ_CLS"``, so the classifier is a ``modules_to_save`` copy; ``lora_dropout=0.1``) on
  ``query``/``value``, with transformers' initial weights (zero biases, as a model built from its config
  has them; the classifier scaled to give logits of order 1). Every base Linear has a bias, and the
  TorchScript exporter shares the equal biases through ``Identity`` nodes.
* ``gpt2_lora``: ``GPT2Model`` with LoRA on ``c_attn``, a ``Conv1D`` (``fan_in_fan_out=True``): the base
  runs as ``Reshape(Gemm(Reshape(x, [-1, in]), W, bias))``.

peft initialises ``lora_B`` to zero (an untrained adapter is a no-op); every LoRA weight gets seeded noise so
that the adapters change the output. The builder checks that both exports match torch in ONNX Runtime
(atol = rtol = 1e-4) and fails (deleting what it wrote) otherwise.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from tests.models.build_hf import OPSET, SPECS, _config, make_inputs

HERE = Path(__file__).resolve().parent
OUT = HERE / "lora"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "last_hidden_state"
TARGETS = ("query", "value")
ADAPTERS = {"one": {"r": 4, "lora_alpha": 8, "seed": 1}, "two": {"r": 8, "lora_alpha": 4, "seed": 2}}
# (batch, sequence, pad fraction, seed) of the input sets stored in expected.npz
SETS = ((3, 5, 0.2, 11), (2, 9, 0.3, 12))
ATOL = RTOL = 1e-4
KEEP_METADATA = ("pkg.torch.onnx.name_scopes",)


def _perturbed(model: Any) -> Any:
    """Seeded noise on every parameter: HF's zero biases would be dropped by the exporter, unlike a checkpoint's."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    return model.eval()


def _base() -> Any:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    return _perturbed(tf.BertModel(_config(SPECS["bert_encoder"], "tiny"), add_pooling_layer=False))


def _peft(base: Any, name: str) -> Any:
    import peft

    spec = ADAPTERS[name]
    config = peft.LoraConfig(
        r=spec["r"], lora_alpha=spec["lora_alpha"], target_modules=list(TARGETS), lora_dropout=0.0, bias="none"
    )
    return _noisy_lora(peft.get_peft_model(copy.deepcopy(base), config), spec["seed"])


def _noisy_lora(model: Any, seed: int, scale: float = 0.1) -> Any:
    """peft starts lora_B at zero (a no-op adapter); seeded noise on every LoRA weight makes it matter."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "lora_" in _:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return model.eval()


def _wrap(model: Any) -> Any:
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.model = inner

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> torch.Tensor:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    return Wrapper(model).eval()


def _run(module: Any, feeds: dict[str, np.ndarray], inputs: tuple[str, ...] = INPUTS) -> np.ndarray:
    import torch

    with torch.no_grad():
        return module(*(torch.from_numpy(feeds[k]) for k in inputs)).numpy()


def _standard_models() -> dict[str, tuple[Any, Any, str, tuple[str, ...], str]]:
    """name -> (peft model, wrapper, input spec, inputs, output) of the standard peft setups."""
    import peft
    import torch
    import transformers as tf

    # HF's initial weights, as a model built from its config has them (zero biases): the form the issue's
    # corpus exported, where the TorchScript exporter shares equal biases through Identity nodes.
    torch.manual_seed(0)
    bert = tf.BertForSequenceClassification(_config(SPECS["bert_encoder"], "tiny")).eval()
    with torch.no_grad():  # a trained head's weights are of order 1, not the init's 0.02: logits of order 1
        bert.classifier.weight.mul_(50.0)
    bert_config = peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["query", "value"]
    )
    torch.manual_seed(0)
    gpt2 = tf.GPT2Model(_config(SPECS["gpt2"], "tiny")).eval()
    gpt2_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)

    class ThreeInputs(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.model = inner

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]

    class TwoInputs(ThreeInputs):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return self.model(input_ids=input_ids, attention_mask=attention_mask)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bert_lora = _noisy_lora(peft.get_peft_model(bert, bert_config), 3, 0.5)
        gpt2_lora = _noisy_lora(peft.get_peft_model(gpt2, gpt2_config), 4, 0.5)
    return {
        "bert_cls_lora": (bert_lora, ThreeInputs, "bert_encoder", INPUTS, "logits"),
        "gpt2_lora": (gpt2_lora, TwoInputs, "gpt2", INPUTS[:2], "last_hidden_state"),
    }


def build_standard(out: Path = OUT) -> None:
    """The standard peft setups (module docstring), both exporters, and ``expected_standard.npz``."""
    import onnxruntime as ort

    out.mkdir(parents=True, exist_ok=True)
    expected: dict[str, np.ndarray] = {}
    written: list[Path] = []
    try:
        for name, (model, wrapper, spec, inputs, output) in _standard_models().items():
            lora = wrapper(model).eval()
            paths = [out / f"{name}.onnx", out / f"{name}_legacy.onnx"]
            written += paths
            for path, dynamo in zip(paths, (True, False), strict=True):
                _export(
                    lora, path, dynamo=dynamo, spec=spec, inputs=inputs, output=output, per_token=output != "logits"
                )
            for i, (batch, seq, pad, seed) in enumerate(SETS):
                made = make_inputs(spec, batch, seq, pad_fraction=pad, seed=seed, size="tiny")
                feeds = {k: made[k] for k in inputs}
                for k, v in feeds.items():
                    expected[f"{name}.set{i}.{k}"] = v
                expected[f"{name}.set{i}.lora"] = _run(lora, feeds, inputs)
                with model.disable_adapter():
                    expected[f"{name}.set{i}.base"] = _run(lora, feeds, inputs)
                for path in paths:
                    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                    got = session.run([output], feeds)[0]
                    np.testing.assert_allclose(
                        got, expected[f"{name}.set{i}.lora"], atol=ATOL, rtol=RTOL, err_msg=str(path)
                    )
                change = np.abs(expected[f"{name}.set{i}.lora"] - expected[f"{name}.set{i}.base"]).max()
                if change < 1e-2:
                    raise AssertionError(
                        f"{name}: the adapter barely changes the output: the fixture would prove nothing"
                    )
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    np.savez(out / "expected_standard.npz", **expected)
    for path in [*written, out / "expected_standard.npz"]:
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)", flush=True)


def _clean(model: onnx.ModelProto, name: str, builder: str) -> onnx.ModelProto:
    g = model.graph
    for node in g.node:
        keep = [(p.key, p.value) for p in node.metadata_props if p.key in KEEP_METADATA]
        del node.metadata_props[:]
        for key, value in keep:
            node.metadata_props.add(key=key, value=value)
        node.doc_string = ""
    for coll in (g.input, g.output, g.value_info, g.initializer):
        for item in coll:
            if hasattr(item, "metadata_props"):
                del item.metadata_props[:]
            item.doc_string = ""
    del g.metadata_props[:]
    del model.metadata_props[:]
    model.doc_string = g.doc_string = ""
    g.name = name
    model.metadata_props.add(key="onnxforge.builder", value=builder)
    return model


def _export(
    module: Any,
    path: Path,
    *,
    dynamo: bool,
    spec: str = "bert_encoder",
    inputs: tuple[str, ...] = INPUTS,
    output: str = OUTPUT,
    per_token: bool = True,
) -> None:
    import torch

    example = make_inputs(spec, 2, 8, pad_fraction=0.125, seed=0, size="tiny")
    args = tuple(torch.from_numpy(example[k]) for k in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(
                module,
                args,
                input_names=list(inputs),
                output_names=[output],
                dynamic_shapes=tuple({0: "batch", 1: "sequence"} for _ in inputs),
                opset_version=OPSET,
                dynamo=True,
                optimize=True,
                verbose=False,
            )
            proto = program.model_proto
        else:
            tmp = path.with_suffix(".tmp.onnx")
            torch.onnx.export(
                module,
                args,
                str(tmp),
                input_names=list(inputs),
                output_names=[output],
                dynamic_axes={k: {0: "batch", 1: "sequence"} for k in inputs}
                | {output: {0: "batch", 1: "sequence"} if per_token else {0: "batch"}},
                opset_version=OPSET,
                dynamo=False,
            )
            proto = onnx.load(str(tmp))
            tmp.unlink()
    proto = _clean(proto, path.stem, "tests.models.build_lora")
    onnx.checker.check_model(proto, full_check=True)
    onnx.save(proto, str(path))


def build(out: Path = OUT) -> None:
    import onnxruntime as ort

    out.mkdir(parents=True, exist_ok=True)
    base = _base()
    models = {name: _peft(base, name) for name in ADAPTERS}
    for name, model in models.items():
        model.save_pretrained(str(out / f"adapter_{name}"))
        (out / f"adapter_{name}" / "README.md").unlink(missing_ok=True)  # peft's model card template
    written = [out / "bert_lora.onnx", out / "bert_lora_legacy.onnx"]
    _export(_wrap(models["one"]), written[0], dynamo=True)
    _export(_wrap(models["one"]), written[1], dynamo=False)
    expected: dict[str, np.ndarray] = {}
    try:
        for i, (batch, seq, pad, seed) in enumerate(SETS):
            feeds = make_inputs("bert_encoder", batch, seq, pad_fraction=pad, seed=seed, size="tiny")
            for k, v in feeds.items():
                expected[f"set{i}.{k}"] = v
            expected[f"set{i}.base"] = _run(_wrap(base), feeds)
            for name, model in models.items():
                expected[f"set{i}.{name}"] = _run(_wrap(model), feeds)
            for path in written:
                session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                got = session.run([OUTPUT], feeds)[0]
                np.testing.assert_allclose(got, expected[f"set{i}.one"], atol=ATOL, rtol=RTOL, err_msg=str(path))
            if np.abs(expected[f"set{i}.one"] - expected[f"set{i}.base"]).max() < 1e-2:
                raise AssertionError("adapter one barely changes the output: the fixture would prove nothing")
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    np.savez(out / "expected.npz", **expected)
    for path in [*written, out / "expected.npz"]:
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.models.build_lora", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", choices=("bert", "standard"), help="default: both")
    args = parser.parse_args(argv)
    if args.only in (None, "bert"):
        build(args.out)
    if args.only in (None, "standard"):
        build_standard(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
